"""RoTBench scoring equals the upstream evaluator on hand-built predictions over the fixture excerpt
(tests/fixtures/benchmarks).

The oracle below is upstream's ``Code/Evaluation/evaluate.py`` (Junjie-Ye/RoTBench, Apache-2.0),
functions ``get_config``, ``get_answer_list``, ``get_test_value`` (version 0), ``ts_eval``,
``pi_eval`` and ``cf_eval`` copied with only the global ``check_list``/``cata_list`` made local.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from reflrl.eval import rotbench as R
from reflrl.eval.data import DataError

DATA = Path(__file__).resolve().parent / "fixtures" / "benchmarks"


# ------------------------------------------------------------------ upstream oracle (verbatim logic)
def _get_config(data):
    p_len = len(data["conversations"][0]["value"][:data["conversations"][0]["value"].find("[")])
    return json.loads(data["conversations"][0]["value"][p_len:-13])


def _get_answer_list(data):
    return data["conversations"][-1]["value"]


def _get_test_value(data):
    test_value = data["conversations"][-1]["value"]
    test_action = test_value[test_value.find("Action:") + 8: test_value.find("Action Input:")]
    if test_action[-1] == "\n":
        test_action = test_action[:-1]
    try:
        test_action_input = json.loads(test_value[test_value.find("Action Input:") + 14:])
    except json.decoder.JSONDecodeError:
        return test_action, 0
    if isinstance(test_action_input, str):
        return test_action, 0
    return test_action, test_action_input


def _ts_eval(test, answer):
    tool_selection = []
    for i in range(len(answer)):
        config = _get_config(answer[i])
        answers = _get_answer_list(answer[i])
        test_action, test_action_input = _get_test_value(test[i])
        if not test_action_input:
            continue
        right_status = 0
        for ans in answers:
            answer_action = ans[ans.find("Action:") + 8: ans.find("Action Input:")]
            if answer_action[-1] == "\n":
                answer_action = answer_action[:-1]
            if answer_action == config[-1]["name"] and test_action == "finish":
                test_action = answer_action
            if not answer_action == test_action:
                continue
            if right_status < 1:
                right_status = 1
                break
        if right_status >= 1:
            tool_selection.append(i)
    return len(tool_selection)


def _pi_eval(test, answer):
    parameter_identification = []
    for i in range(len(answer)):
        config = _get_config(answer[i])
        answers = _get_answer_list(answer[i])
        test_action, test_action_input = _get_test_value(test[i])
        if not test_action_input:
            continue
        right_status = 0
        for ans in answers:
            answer_action = ans[ans.find("Action:") + 8: ans.find("Action Input:")]
            if answer_action[-1] == "\n":
                answer_action = answer_action[:-1]
            answer_action_input = json.loads(ans[ans.find("Action Input:") + 14:])
            if answer_action == config[-1]["name"] and test_action == "finish":
                test_action = answer_action
            if not answer_action == test_action:
                continue
            if right_status < 1:
                right_status = 1
            if not answer_action_input.keys() == test_action_input.keys():
                continue
            if right_status < 2:
                right_status = 2
                break
        if right_status >= 2:
            parameter_identification.append(i)
    return len(parameter_identification)


def _cf_eval(test, answer):
    content_filling = []
    for i in range(len(answer)):
        config = _get_config(answer[i])
        answers = _get_answer_list(answer[i])
        test_action, test_action_input = _get_test_value(test[i])
        if not test_action_input:
            continue
        right_status = 0
        for ans in answers:
            answer_action = ans[ans.find("Action:") + 8: ans.find("Action Input:")]
            if answer_action[-1] == "\n":
                answer_action = answer_action[:-1]
            answer_action_input = json.loads(ans[ans.find("Action Input:") + 14:])
            if answer_action == config[-1]["name"] and test_action == "finish":
                test_action = answer_action
            if not answer_action == test_action:
                continue
            if right_status < 1:
                right_status = 1
            if not answer_action_input.keys() == test_action_input.keys():
                continue
            if right_status < 2:
                right_status = 2
            if answer_action == config[-1]["name"]:
                answer_action = "finish"
            if answer_action == config[-2]["name"]:
                answer_action = "ask_to_user"
            del_key = []
            for key, value in answer_action_input.items():
                if value == "None":
                    del_key.append(key)
            for key in del_key:
                del answer_action_input[key]
                del test_action_input[key]
            if not answer_action_input == test_action_input and answer_action != "finish" and answer_action != "ask_to_user":
                continue
            if right_status < 3:
                right_status = 3
                break
        if right_status >= 3:
            content_filling.append(i)
    return len(content_filling)


def upstream_metrics(records, predictions):
    test = []
    for rec, pred in zip(records, predictions):
        t = copy.deepcopy(rec)
        t["conversations"][-1] = {"from": "assistant", "value": pred}
        test.append(t)
    n = len(records)
    return {"tool_selection": 100 * _ts_eval(test, records) / n,
            "parameter_identification": 100 * _pi_eval(test, records) / n,
            "content_filling": 100 * _cf_eval(test, records) / n}


# ----------------------------------------------------------------------------- hand-built cases
def _split(ans):
    return R._answer_action(ans), R._answer_input(ans)


def _mk(action, inp):
    return f"Thought: I will call it.\nAction: {action}\nAction Input: {json.dumps(inp)}"


def _predictions(items):
    """Per record, several hand-built predictions; returns (kind, predictions aligned with items)."""
    kinds = {k: [] for k in ("right", "alternative", "wrong_keys", "wrong_value", "none_wildcard", "finish",
                             "wrong_tool", "not_json", "empty_input")}
    for it in items:
        a0, i0 = _split(it.answers[0])
        alt = it.answers[-1]
        kinds["right"].append(it.answers[0])
        kinds["alternative"].append(alt)
        kinds["wrong_keys"].append(_mk(a0, {**i0, "reflrl_extra": "x"}))
        nonnone = [k for k, v in i0.items() if v != "None"]
        kinds["wrong_value"].append(_mk(a0, {**i0, **({nonnone[0]: "reflrl-wrong"} if nonnone else {})}))
        kinds["none_wildcard"].append(_mk(a0, {k: ("anything at all" if v == "None" else v) for k, v in i0.items()}))
        kinds["finish"].append(_mk("finish", {"answer": "done"}) if a0 == it.config[-1]["name"]
                               else _mk("finish", i0))
        kinds["wrong_tool"].append(_mk("reflrl_no_such_tool", i0))
        kinds["not_json"].append(f"Thought:\nAction: {a0}\nAction Input: {{'a': 1}}\nObservation: ...")
        kinds["empty_input"].append(_mk(a0, {}))
    return kinds


@pytest.mark.parametrize("level", R.LEVELS)
def test_metrics_equal_upstream_evaluator(level):
    items = R.load_level(DATA, level)
    records = [it.record for it in items]
    for kind, preds in _predictions(items).items():
        ours, per = R.score(items, preds)
        ref = upstream_metrics(records, preds)
        for m in R.METRICS:
            assert ours[m] == pytest.approx(ref[m]), (level, kind, m)


def test_hand_built_cases_have_the_expected_verdicts():
    items = R.load_level(DATA, "clean")
    # a record whose gold has a "None" value and more than one acceptable answer
    it = next(i for i in items if len(i.answers) > 1 and '"None"' in i.answers[0])
    a0, i0 = _split(it.answers[0])
    v = R.score_one(it.answers[1], it.config, it.answers)          # the alternative gold answer
    assert v["tool_selection"] and v["parameter_identification"] and v["content_filling"]
    none_key = next(k for k, val in i0.items() if val == "None")
    v = R.score_one(_mk(a0, {**i0, none_key: "any value"}), it.config, it.answers)
    assert v["content_filling"]                                     # "None" gold accepts any value
    v = R.score_one(_mk(a0, {k: val for k, val in i0.items() if k != none_key}), it.config, it.answers)
    assert v["tool_selection"] and not v["parameter_identification"]  # wrong key set
    other = next(k for k, val in i0.items() if val != "None")
    v = R.score_one(_mk(a0, {**i0, other: "reflrl-wrong"}), it.config, it.answers)
    assert v["parameter_identification"] and not v["content_filling"]
    # finish: the gold calls the (possibly renamed) finish tool; a predicted "finish" matches it and
    # needs no particular content. Built from a slight-noise record whose finish tool is renamed.
    slight = R.load_level(DATA, "slight")
    rec = copy.deepcopy(next(i for i in slight if i.config[-1]["name"] != "finish").record)
    fname = R.get_config(rec)[-1]["name"]
    rec["conversations"][-1]["value"] = [_mk(fname, {"answer": "It is 5 o'clock."})]
    fin = R.RotItem("fin", "slight", 0, "", [], R.get_config(rec), rec["conversations"][-1]["value"], rec)
    preds = [_mk("finish", {"answer": "something else"}), _mk(fname, {"answer": "x"}),
             _mk("finish", {"text": "x"}), _mk("ask_to_user", {"answer": "x"})]
    got = [R.score_one(p, fin.config, fin.answers) for p in preds]
    assert [g["content_filling"] for g in got] == [True, True, False, False]
    assert [g["parameter_identification"] for g in got] == [True, True, False, False]
    for p, g in zip(preds, got):
        ref = upstream_metrics([rec], [p])
        assert {m: 100.0 * g[m] for m in R.METRICS} == ref


def test_outputs_that_crash_upstream_are_wrong_and_counted():
    items = R.load_level(DATA, "clean", limit=3)
    outs = ["Action:Action Input: {\"a\": 1}", "Thought:\nAction: x\nAction Input: [1, 2]", None]
    m, per = R.score(items, outs)
    assert m["content_filling"] == 0 and m["parse_failures"] == 3
    assert all(p["parse_error"] for p in per)


def test_malformed_file_names_file_and_record(tmp_path):
    d = tmp_path / "rotbench" / "first_turn"
    d.mkdir(parents=True)
    good = json.loads((DATA / "rotbench" / "first_turn" / "clean.json").read_text())[:2]
    bad = copy.deepcopy(good)
    bad[1]["conversations"][-1]["value"] = "Action: x"  # not a list of gold answers
    (d / "clean.json").write_text(json.dumps(bad))
    with pytest.raises(DataError, match=r"clean\.json: record 1 .*list of gold answers"):
        R.load_level(tmp_path, "clean")
    (d / "clean.json").write_text('[{"id": 1,')
    with pytest.raises(DataError, match=r"clean\.json: invalid JSON at line 1"):
        R.load_level(tmp_path, "clean")
    with pytest.raises(DataError, match="no RoTBench files"):
        R.load_level(tmp_path / "nowhere", "clean")
