"""Synthetic task generation, splits, and the ToolACE / xLAM / Hammer / own-format loaders."""
from __future__ import annotations

import json
import logging
from collections import Counter

import jsonschema
import pytest

from reflrl.envs.datasets import (
    KINDS, LoadReport, generate_synthetic, load_tasks, save_tasks, synthetic_splits,
)
from reflrl.envs.tools.base import ToolContext, ToolError
from reflrl.envs.tools.catalog import build_catalog
from reflrl.envs.types import Task, ToolCall


def _values(v):
    if isinstance(v, dict):
        for x in v.values():
            yield from _values(x)
    elif isinstance(v, list):
        for x in v:
            yield from _values(x)
    else:
        yield v


@pytest.fixture(scope="module")
def tasks():
    return generate_synthetic(300, seed=11, kinds=KINDS)


def test_generation_is_seeded_and_distinct(tasks):
    again = generate_synthetic(300, seed=11, kinds=KINDS)
    assert [(t.id, t.query, t.turns, t.gold, t.tools) for t in tasks] == \
           [(t.id, t.query, t.turns, t.gold, t.tools) for t in again]
    other = generate_synthetic(300, seed=12, kinds=KINDS)
    assert len({t.query for t in tasks} & {t.query for t in other}) < 30
    assert len({t.query for t in tasks}) == len(tasks) == len({t.id for t in tasks})
    assert Counter(t.kind for t in tasks) == {"single": 100, "parallel": 100, "multi_turn": 100}
    assert generate_synthetic(0, seed=1) == []


def test_task_shapes_per_kind(tasks):
    for t in tasks:
        if t.kind == "single":
            assert len(t.gold) == 1 and len(t.gold[0]) == 1 and t.turns == []
        elif t.kind == "parallel":
            assert len(t.gold) == 1 and 2 <= len(t.gold[0]) <= 3 and t.turns == []
        else:
            assert 2 <= len(t.gold) <= 3 and len(t.turns) == len(t.gold) - 1
            assert all(len(turn) == 1 for turn in t.gold)


def test_gold_is_recoverable_from_the_text_and_fits_the_offered_tools(tasks):
    catalog = build_catalog()
    for t in tasks:
        messages = [t.query, *t.turns]
        offered = {s["name"]: s for s in t.tools}
        validators = {n: jsonschema.Draft202012Validator(s["parameters"])
                      for n, s in offered.items()}
        gold_names = {c.name for turn in t.gold for c in turn}
        assert gold_names <= set(offered)
        assert 2 <= len(offered) - len(gold_names) <= 4, t.id
        assert set(offered) <= set(catalog)
        for i, turn in enumerate(t.gold):
            text = messages[i] if t.kind == "multi_turn" else t.query
            for c in turn:
                validators[c.name].validate(c.arguments)
                for v in _values(c.arguments):
                    if isinstance(v, bool):
                        assert "overwrit" in text, (t.id, c)
                    else:
                        assert str(v) in text, (t.id, c, v, text)


def test_gold_calls_succeed_against_the_catalogue(tasks, tmp_path):
    catalog = build_catalog()
    returns = {n: jsonschema.Draft202012Validator(s.returns) for n, s in catalog.items()}
    failures = Counter()
    for n, t in enumerate(tasks):
        sb = tmp_path / f"ep{n}"
        sb.mkdir()
        ctx = ToolContext(seed=n, episode_id=t.id, sandbox=sb)
        for turn in t.gold:
            for c in turn:
                try:
                    result = catalog[c.name].handler(dict(c.arguments), ctx)
                    returns[c.name].validate(result)
                except ToolError as e:
                    failures[e.kind] += 1
    # only the seeded stock level may refuse a correct call
    assert set(failures) <= {"out_of_stock"}, failures
    assert sum(failures.values()) < 0.05 * sum(len(turn) for t in tasks for turn in t.gold)


def test_tool_restriction_and_bad_arguments():
    ts = generate_synthetic(20, seed=3, tools=["get_current_weather", "get_stock_quote"])
    assert {c.name for t in ts for turn in t.gold for c in turn} <= {"get_current_weather",
                                                                      "get_stock_quote"}
    with pytest.raises(ValueError, match="unknown catalogue tools"):
        generate_synthetic(3, seed=0, tools=["nope"])
    with pytest.raises(ValueError, match="unknown task kind"):
        generate_synthetic(3, seed=0, kinds=("single", "chatty"))
    chained = generate_synthetic(40, seed=3, kinds=("multi_turn",),
                                 tools=["write_file", "read_file"])
    flows = [[c.name for turn in t.gold for c in turn] for t in chained]
    # some conversations are coherent: write a file, then read that same file back
    assert any(f == ["write_file", "read_file"]
               and t.gold[0][0].arguments["path"] == t.gold[1][0].arguments["path"]
               for t, f in zip(chained, flows))
    with pytest.raises(ValueError, match="distinct"):
        generate_synthetic(500, seed=0, kinds=("single",), tools=["get_air_quality"])


def test_splits_have_no_overlap():
    s = synthetic_splits(150, 40, 40, seed=5, kinds=KINDS)
    assert [len(s[k]) for k in ("train", "val", "test")] == [150, 40, 40]
    for a, b in [("train", "val"), ("train", "test"), ("val", "test")]:
        assert not {t.query for t in s[a]} & {t.query for t in s[b]}
        assert not {t.id for t in s[a]} & {t.id for t in s[b]}
    assert all(t.meta["split"] == "train" for t in s["train"])
    assert {t.kind for t in s["test"]} == set(KINDS)


def test_save_and_load_round_trip(tmp_path, tasks):
    path = save_tasks(tasks[:30], tmp_path / "sub" / "syn.jsonl")
    rep = load_tasks(path, fmt="reflrl")
    assert rep.skipped == []
    assert [(t.id, t.query, t.tools, t.gold, t.kind, t.turns, t.meta) for t in rep.tasks] == \
           [(t.id, t.query, t.tools, t.gold, t.kind, t.turns, t.meta) for t in tasks[:30]]
    assert isinstance(rep.tasks[0].gold[0][0], ToolCall)
    assert load_tasks(path).tasks[5].gold == tasks[5].gold  # auto-detected


# --------------------------------------------------------------------------------------------
# Third-party formats, with malformed rows
# --------------------------------------------------------------------------------------------

XLAM_TOOLS = [
    {"name": "live_giveaways_by_type", "description": "Retrieve live giveaways.",
     "parameters": {"type": {"description": "The type of giveaway.", "type": "str",
                             "default": "game"}}},
    {"name": "get_weather", "description": "Weather.",
     "parameters": {"city": {"description": "City.", "type": "str"},
                    "days": {"description": "Days.", "type": "int, optional"},
                    "tags": {"description": "Tags.", "type": "List[str]"}}},
]


def _xlam_row(i, answers, tools=XLAM_TOOLS, query="Where can I find giveaways?"):
    return {"id": i, "query": query, "tools": json.dumps(tools), "answers": json.dumps(answers)}


def test_xlam_jsonl_with_malformed_rows(tmp_path, caplog):
    rows = [
        json.dumps(_xlam_row(1, [{"name": "live_giveaways_by_type",
                                  "arguments": {"type": "beta"}}])),
        "{this is not json",
        json.dumps({"id": 3, "query": "x", "tools": json.dumps(XLAM_TOOLS)}),  # no answers
        json.dumps(_xlam_row(4, [{"name": "unknown_tool", "arguments": {}}])),
        "",  # blank lines are not rows
        json.dumps(_xlam_row(6, [{"name": "get_weather", "arguments": {"city": "Oslo",
                                                                       "tags": ["a"]}},
                                 {"name": "get_weather", "arguments": {"city": "Rome",
                                                                       "tags": []}}],
                             query="Weather in Oslo and Rome?")),
        json.dumps({"id": 7, "query": "x", "tools": "[{bad json", "answers": "[]"}),
        json.dumps([1, 2]),
        json.dumps(_xlam_row(1, [])),  # duplicate id
    ]
    p = tmp_path / "xlam.jsonl"
    p.write_text("\n".join(rows) + "\n")
    with caplog.at_level(logging.WARNING):
        rep = load_tasks(p, fmt="xlam")
    assert isinstance(rep, LoadReport)
    assert [t.id for t in rep.tasks] == ["xlam-1", "xlam-6"]
    assert [no for no, _ in rep.skipped] == [2, 3, 4, 7, 8, 9]
    reasons = dict(rep.skipped)
    assert "invalid JSON" in reasons[2]
    assert "answers" in reasons[3]
    assert "unknown_tool" in reasons[4]
    assert "tools" in reasons[7] and "JSON" in reasons[7]
    assert "not an object" in reasons[8]
    assert "duplicate" in reasons[9]
    assert "skipped 6 malformed rows" in caplog.text
    assert "skipped 6" in rep.summary()
    t1, t6 = rep.tasks
    assert t1.kind == "single" and t1.gold == [[ToolCall("live_giveaways_by_type",
                                                          {"type": "beta"})]]
    assert t6.kind == "parallel" and len(t6.gold[0]) == 2
    schema = {s["name"]: s for s in t6.tools}["get_weather"]["parameters"]
    assert schema["required"] == ["city", "tags"]
    assert schema["properties"]["days"]["type"] == "integer"
    assert schema["properties"]["tags"]["type"] == "array"
    assert {s["name"]: s for s in t1.tools}["live_giveaways_by_type"]["parameters"][
        "required"] == []
    for t in rep.tasks:
        for c in t.gold[0]:
            jsonschema.validate(c.arguments, {s["name"]: s for s in t.tools}[c.name][
                "parameters"])


def test_hammer_json_array_with_irrelevance_and_bad_items(tmp_path):
    data = [
        {"id": 0, "query": "Tell me a joke.", "tools": XLAM_TOOLS, "answers": []},
        {"id": 1, "query": "", "tools": XLAM_TOOLS, "answers": []},
        {"id": 2, "query": "Weather in Oslo",
         "tools": XLAM_TOOLS,
         "answers": [{"name": "get_weather", "arguments": json.dumps({"city": "Oslo",
                                                                        "tags": []})}]},
        "just a string",
    ]
    p = tmp_path / "hammer_irrelevance.json"
    p.write_text(json.dumps(data))
    rep = load_tasks(p)  # auto; the file name says hammer
    assert [t.id for t in rep.tasks] == ["hammer-0", "hammer-2"]
    assert rep.tasks[0].gold == [[]] and rep.tasks[0].meta["no_call"] is True
    assert rep.tasks[1].gold[0][0].arguments == {"city": "Oslo", "tags": []}
    assert [no for no, _ in rep.skipped] == [2, 4]
    assert "query" in rep.skipped[0][1]


TOOLACE_SYSTEM = (
    "You are an expert in composing functions. ...\nHere is a list of functions in JSON format "
    "that you can invoke.\n" + json.dumps([
        {"name": "Get Stock Price", "description": "Price of a stock.",
         "parameters": {"type": "dict", "properties": {
             "symbol": {"type": "string", "description": "Ticker."},
             "precision": {"type": "float", "description": "Rounding."}},
             "required": ["symbol"]}, "required": None},
        {"name": "newAddress", "description": "New address.",
         "parameters": {"type": "dict", "properties": {}, "required": []}},
    ]) + ". \nShould you decide to return the function call(s)...")


def test_toolace_conversations(tmp_path):
    good = {"system": TOOLACE_SYSTEM, "conversations": [
        {"from": "user", "value": "Price of AAPL and a new address please."},
        {"from": "assistant",
         "value": '[Get Stock Price(symbol="AAPL", precision=0.01), newAddress()]'},
        {"from": "tool", "value": "[{\"name\": \"newAddress\", \"results\": {}}]"},
        {"from": "assistant", "value": "Done."},
        {"from": "user", "value": "And MSFT?"},
        {"from": "assistant", "value": '[Get Stock Price(symbol="MSFT")]'},
    ]}
    single = {"system": TOOLACE_SYSTEM, "conversations": [
        {"from": "user", "value": "New address."},
        {"from": "assistant", "value": "[newAddress()]"}]}
    bad_call = {"system": TOOLACE_SYSTEM, "conversations": [
        {"from": "user", "value": "x"},
        {"from": "assistant", "value": "[newAddress(a=os.system('ls'))]"}]}
    no_tools = {"system": "You are helpful.", "conversations": [{"from": "user", "value": "x"}]}
    unknown = {"system": TOOLACE_SYSTEM, "conversations": [
        {"from": "user", "value": "x"}, {"from": "assistant", "value": "[launch(x=1)]"}]}
    p = tmp_path / "toolace.json"
    p.write_text(json.dumps([good, single, bad_call, no_tools, unknown]))
    rep = load_tasks(p, fmt="toolace")
    assert len(rep.tasks) == 2
    t = rep.tasks[0]
    assert t.kind == "multi_turn" and t.turns == ["And MSFT?"]
    assert t.gold == [[ToolCall("Get Stock Price", {"symbol": "AAPL", "precision": 0.01}),
                       ToolCall("newAddress", {})],
                      [ToolCall("Get Stock Price", {"symbol": "MSFT"})]]
    params = {s["name"]: s for s in t.tools}["Get Stock Price"]["parameters"]
    assert params["type"] == "object" and params["properties"]["precision"]["type"] == "number"
    jsonschema.Draft202012Validator.check_schema(params)
    assert rep.tasks[1].kind == "single"
    assert [no for no, _ in rep.skipped] == [3, 4, 5]
    assert "unparsable" in rep.skipped[0][1]
    assert "no JSON list of functions" in rep.skipped[1][1]
    assert "launch" in rep.skipped[2][1]


def test_auto_detects_mixed_rows_and_rejects_unknown(tmp_path):
    own = Task(id="mine-1", query="q", tools=[{"name": "f", "description": "",
                                                "parameters": {"type": "object",
                                                               "properties": {}}}],
               gold=[[ToolCall("f", {})]])
    from reflrl.envs.datasets import task_to_dict
    rows = [task_to_dict(own),
            _xlam_row(9, [{"name": "get_weather", "arguments": {"city": "A", "tags": []}}]),
            {"system": TOOLACE_SYSTEM, "conversations": [
                {"from": "user", "value": "addr"}, {"from": "assistant", "value": "[newAddress()]"}]},
            {"prompt": "what?", "completion": "x"},
            {**task_to_dict(own), "id": "mine-2", "kind": "weird"},
            {**task_to_dict(own), "id": "mine-3", "gold": [{"name": "f"}]}]
    p = tmp_path / "mixed.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows))
    rep = load_tasks(p)
    assert [t.meta["source"] for t in rep.tasks] == ["reflrl", "xlam",
                                                      "toolace"]
    assert [no for no, _ in rep.skipped] == [4, 5, 6]
    assert "cannot tell" in rep.skipped[0][1]
    assert "kind" in rep.skipped[1][1]
    assert "gold" in rep.skipped[2][1]
    with pytest.raises(FileNotFoundError):
        load_tasks(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="unknown dataset format"):
        load_tasks(p, fmt="csv")


def test_mix_and_cli(tmp_path, capsys):
    from reflrl.envs.datasets import main, mix_tasks
    a = generate_synthetic(10, seed=1)
    b = generate_synthetic(10, seed=2, kinds=("multi_turn",))
    m = mix_tasks({"a": a, "b": b}, {"a": 4, "b": 3}, seed=0)
    assert len(m) == 7 and sum(t in a for t in m) == 4
    assert [t.id for t in m] == [t.id for t in mix_tasks({"a": a, "b": b}, {"a": 4, "b": 3}, 0)]
    with pytest.raises(ValueError, match="has 10 tasks"):
        mix_tasks({"a": a}, {"a": 11}, seed=0)
    assert main(["synth", str(tmp_path / "out"), "--train", "5", "--val", "2", "--test", "2"]) == 0
    assert len(load_tasks(tmp_path / "out" / "val.jsonl").tasks) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "q", "answers": "[]", "tools": "[]"}\nnot json\n')
    assert main(["check", str(bad)]) == 0
    out = capsys.readouterr().out
    assert "loaded 1 tasks, skipped 1 malformed rows" in out and "row 2: invalid JSON" in out
