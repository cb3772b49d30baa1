"""The synthetic tool catalogue and the bfcl-eval backends wrapped as ToolSpecs."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from reflrl.envs.tools.base import ToolContext, ToolError
from reflrl.envs.tools.catalog import DOMAINS, SANDBOX_FILES, build_catalog, tools_by_domain

VALID = {
    "get_current_weather": {"city": "Paris"},
    "get_forecast": {"city": "tokyo", "days": 2, "units": "fahrenheit"},
    "get_air_quality": {"city": "Lima"},
    "get_weather_alerts": {"city": "Oslo"},
    "get_stock_quote": {"symbol": "AAPL"},
    "get_market_trend": {"symbol": "NVDA", "period": "week"},
    "get_exchange_rate": {"base": "USD", "target": "EUR"},
    "convert_currency": {"amount": 100, "from_currency": "GBP", "to_currency": "JPY"},
    "get_crypto_price": {"coin": "BTC", "currency": "EUR"},
    "search_flights": {"origin": "LHR", "destination": "CDG", "date": "2026-03-04"},
    "search_hotels": {"city": "Rome", "check_in": "2026-05-01", "nights": 2},
    "get_flight_status": {"flight_number": "AF123"},
    "get_airport_info": {"code": "SIN"},
    "list_files": {},
    "read_file": {"path": "notes.txt"},
    "write_file": {"path": "a/b.txt", "content": "hi"},
    "delete_file": {"path": "todo.md"},
    "search_files": {"pattern": "revenue"},
    "get_file_info": {"path": "reports"},
    "send_email": {"to": "a@b.com", "subject": "Hi", "body": "x"},
    "send_sms": {"phone": "+1 555 0100", "message": "hey"},
    "list_messages": {"folder": "sent", "limit": 2},
    "search_contacts": {"name": "Ana"},
    "create_event": {"title": "Lunch", "date": "2026-02-02", "start_time": "12:00"},
    "list_events": {"date": "2026-02-02"},
    "cancel_event": {"event_id": "EVT-1234"},
    "find_free_slot": {"date": "2026-02-02", "duration_minutes": 45},
    "search_products": {"query": "lamp", "max_price": 100, "sort_by": "price"},
    "get_product_details": {"product_id": "P-12345"},
    "add_to_cart": {"product_id": "P-12346", "quantity": 2},
    "get_order_status": {"order_id": "ORD-123456"},
    "track_package": {"tracking_number": "TRK0123456789"},
}


@pytest.fixture(scope="module")
def catalog():
    return build_catalog()


def ctx_for(tmp_path, seed=1, name="sb"):
    sb = tmp_path / name
    sb.mkdir(parents=True, exist_ok=True)
    return ToolContext(seed=seed, episode_id=name, sandbox=sb)


def run_all(catalog, ctx):
    out = {}
    for name, args in VALID.items():
        out[name] = catalog[name].handler(dict(args), ctx)
    return out


def test_catalog_size_domains_and_grouping(catalog):
    assert len(catalog) >= 24
    assert len(DOMAINS) >= 6
    groups = tools_by_domain(catalog)
    assert set(groups) == set(DOMAINS)
    assert all(len(v) >= 3 for v in groups.values())
    assert sum(len(v) for v in groups.values()) == len(catalog)
    assert set(VALID) == set(catalog)


def test_schemas_are_valid_json_schema_with_described_defaults(catalog):
    for spec in catalog.values():
        jsonschema.Draft202012Validator.check_schema(spec.parameters)
        jsonschema.Draft202012Validator.check_schema(spec.returns)
        assert spec.parameters["type"] == "object"
        props, req = spec.parameters["properties"], spec.parameters["required"]
        assert set(req) <= set(props), spec.name
        for p, s in props.items():
            assert s.get("type") and s.get("description"), (spec.name, p)
            if p not in req:  # optional: a default, stated in the description, or "optional"
                if "default" in s:
                    assert "default" in s["description"], (spec.name, p)
                else:
                    assert "optional" in s["description"], (spec.name, p)
            if "enum" in s and "default" in s:
                assert s["default"] in s["enum"]
        assert len(spec.description) <= 60, spec.name
        sch = spec.schema()
        assert set(sch) == {"name", "description", "parameters"}


def test_every_tool_answers_valid_args_with_its_returns_schema(catalog, tmp_path):
    ctx = ctx_for(tmp_path)
    for name, args in VALID.items():
        jsonschema.validate(args, catalog[name].parameters)
        result = catalog[name].handler(dict(args), ctx)
        jsonschema.validate(result, catalog[name].returns)
        json.dumps(result)


def test_handlers_are_deterministic_per_seed(catalog, tmp_path):
    a = run_all(catalog, ctx_for(tmp_path, seed=7, name="a"))
    b = run_all(catalog, ctx_for(tmp_path, seed=7, name="b"))
    c = run_all(catalog, ctx_for(tmp_path, seed=8, name="c"))
    assert a == b
    differing = [n for n in a if a[n] != c[n]]
    assert len(differing) >= len(a) // 2, differing


def test_concurrent_calls_match_sequential(catalog, tmp_path):
    names = [n for n in VALID if catalog[n].domain not in ("files", "calendar", "ecommerce",
                                                             "messaging")]
    expected = {n: catalog[n].handler(dict(VALID[n]), ctx_for(tmp_path, 3, "seq")) for n in names}

    def one(i):
        n = names[i % len(names)]
        return n, catalog[n].handler(dict(VALID[n]), ctx_for(tmp_path, 3, f"t{i % 4}"))

    with ThreadPoolExecutor(4) as pool:
        for n, r in pool.map(one, range(200)):
            assert r == expected[n]


@pytest.mark.parametrize("name,args,kind", [
    ("get_current_weather", {"city": "Atlantis"}, "unknown_city"),
    ("search_flights", {"origin": "LHR", "destination": "XXX", "date": "2026-01-01"},
     "unknown_airport"),
    ("search_flights", {"origin": "LHR", "destination": "CDG", "date": "01/02/2026"},
     "invalid_date"),
    ("list_events", {"date": "2026-02-30"}, "invalid_date"),
    ("get_stock_quote", {"symbol": "ZZZZ"}, "unknown_symbol"),
    ("read_file", {"path": "missing.txt"}, "file_not_found"),
    ("delete_file", {"path": "reports"}, "not_a_file"),
    ("write_file", {"path": "notes.txt", "content": "x"}, "file_exists"),
    ("send_email", {"to": "not-an-email", "subject": "a", "body": "b"}, "invalid_email"),
    ("create_event", {"title": "x", "date": "2026-01-01", "start_time": "25:00"},
     "invalid_time"),
    ("get_forecast", {"city": "Paris", "days": 9}, "out_of_range"),
    ("get_flight_status", {"flight_number": "ZZ12"}, "unknown_flight"),
])
def test_policy_errors_raise_tool_error(catalog, tmp_path, name, args, kind):
    with pytest.raises(ToolError) as e:
        catalog[name].handler(args, ctx_for(tmp_path))
    assert e.value.kind == kind


def test_cancel_twice_is_a_policy_error(catalog, tmp_path):
    ctx = ctx_for(tmp_path)
    catalog["cancel_event"].handler({"event_id": "EVT-1111"}, ctx)
    with pytest.raises(ToolError):
        catalog["cancel_event"].handler({"event_id": "EVT-1111"}, ctx)


def test_sandbox_starts_with_seeded_files_and_file_tools_stay_inside(catalog, tmp_path):
    ctx = ctx_for(tmp_path, seed=5, name="box")
    listing = catalog["list_files"].handler({}, ctx)
    for f in SANDBOX_FILES:
        assert (ctx.sandbox / f).is_file()
    assert {"notes.txt", "reports", "logs"} <= {e["name"] for e in listing["entries"]}
    other = ctx_for(tmp_path, seed=5, name="box2")
    assert (catalog["read_file"].handler({"path": "notes.txt"}, ctx)
            == catalog["read_file"].handler({"path": "notes.txt"}, other))
    outside = tmp_path / "secret.txt"
    outside.write_text("top secret")
    for name, args in [("read_file", {"path": "../secret.txt"}),
                       ("write_file", {"path": "../evil.txt", "content": "x"}),
                       ("delete_file", {"path": "../secret.txt"}),
                       ("list_files", {"directory": "../"}),
                       ("search_files", {"pattern": "secret", "directory": ".."}),
                       ("get_file_info", {"path": "/../secret.txt"})]:
        with pytest.raises(ToolError) as e:
            catalog[name].handler(args, ctx)
        assert e.value.kind == "forbidden_path", name
    assert outside.read_text() == "top secret"
    assert not (tmp_path / "evil.txt").exists()
    # a write then read round-trips, and deletes are real
    catalog["write_file"].handler({"path": "d/new.txt", "content": "hello"}, ctx)
    assert catalog["read_file"].handler({"path": "d/new.txt"}, ctx)["content"] == "hello"
    catalog["delete_file"].handler({"path": "d/new.txt"}, ctx)
    with pytest.raises(ToolError):
        catalog["read_file"].handler({"path": "d/new.txt"}, ctx)


def test_calendar_and_cart_state_is_per_episode(catalog, tmp_path):
    ctx = ctx_for(tmp_path, name="cal")
    ev = catalog["create_event"].handler(
        {"title": "Lunch", "date": "2026-04-04", "start_time": "12:00"}, ctx)
    ids = [e["event_id"] for e in catalog["list_events"].handler({"date": "2026-04-04"}, ctx)[
        "events"]]
    assert ev["event_id"] in ids
    catalog["cancel_event"].handler({"event_id": ev["event_id"]}, ctx)
    ids = [e["event_id"] for e in catalog["list_events"].handler({"date": "2026-04-04"}, ctx)[
        "events"]]
    assert ev["event_id"] not in ids
    fresh = ctx_for(tmp_path, name="cal2")
    assert ev["event_id"] not in [e["event_id"] for e in catalog["list_events"].handler(
        {"date": "2026-04-04"}, fresh)["events"]]


# --------------------------------------------------------------------------------------------
# bfcl-eval backends
# --------------------------------------------------------------------------------------------

bfcl = pytest.importorskip("bfcl_eval")

from reflrl.envs.tools import bfcl_backends as B  # noqa: E402


def _bfcl_types_left(schema) -> bool:
    if isinstance(schema, dict):
        if schema.get("type") in ("dict", "float", "tuple", "any"):
            return True
        return any(_bfcl_types_left(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_bfcl_types_left(v) for v in schema)
    return False


@pytest.fixture(scope="module")
def btools():
    return B.bfcl_tools()


def test_bfcl_tools_cover_all_classes_with_valid_schemas(btools, catalog):
    assert len(btools) == 128
    assert {s.domain for s in btools.values()} == {f"bfcl:{c}" for c in B.BFCL_CLASSES}
    for s in btools.values():
        jsonschema.Draft202012Validator.check_schema(s.parameters)
        assert s.parameters["type"] == "object"
        assert not _bfcl_types_left(s.parameters), s.name
    assert not set(btools) & set(catalog), "catalogue names collide with bfcl names"
    only_fs = B.bfcl_tools(["GorillaFileSystem"])
    assert "ls" in only_fs and "post_tweet" not in only_fs
    with pytest.raises(ValueError):
        B.bfcl_tools(["NoSuchAPI"])


def test_parse_python_calls_uses_ast_only():
    calls = B.parse_python_calls("[f(a=1, b='x', c=[1, (2, 3)], d={'k': None}), g.h(z=-2.5)]")
    assert [c.name for c in calls] == ["f", "g.h"]
    assert calls[0].arguments == {"a": 1, "b": "x", "c": [1, [2, 3]], "d": {"k": None}}
    assert calls[1].arguments == {"z": -2.5}
    assert B.parse_python_calls("f()")[0].arguments == {}
    for bad in ["f(a=os.system('rm -rf /'))", "f(a=__import__('os'))", "[1, 2]", "f(1)",
                "f(**{'a': 1})", "f(a=1, a=2)", "f(a=", "lambda: 0"]:
        with pytest.raises(ValueError):
            B.parse_python_calls(bad)
    assert B.parse_bfcl_calls(["sort('final_report.pdf')"])[0].arguments == {
        "file_name": "final_report.pdf"}


def test_bfcl_dispatch_is_whitelisted_and_never_evaluates(tmp_path, btools):
    ctx = ToolContext(seed=0, episode_id="e", sandbox=tmp_path, state={"initial_config": {}})
    sess = B.session_for(ctx)
    for name in ["_load_scenario", "__init__", "eval", "__class__", "nonexistent"]:
        with pytest.raises(ToolError) as e:
            sess.call(name, {})
        assert e.value.kind == "unknown_tool"
    # a string that would do something if evaluated is just a file name
    btools["touch"].handler({"file_name": "__import__('os').system('x')"}, ctx)
    listing = btools["ls"].handler({}, ctx)
    assert "__import__('os').system('x')" in json.dumps(listing)
    with pytest.raises(ToolError) as e:  # wrong argument name -> policy error, not a crash
        btools["ls"].handler({"bogus": 1}, ctx)
    assert e.value.kind == "invalid_arguments"


def test_bfcl_gold_replay_matches_bfcl_own_executor():
    """Replay gold calls through our ToolSpec dispatch and through bfcl's executor (which
    evals its strings; fine in a test): instance states agree after every turn."""
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import (
        execute_multi_turn_func_call,
    )
    answers = {a["id"]: a["ground_truth"] for a in B._read_jsonl(
        B._bfcl_root() / "data" / "possible_answer" / "BFCL_v4_multi_turn_base.json")}
    tasks = B.load_bfcl_multi_turn("multi_turn_base")
    # pick tasks so that every class is exercised
    picked, covered = [], set()
    for t in tasks:
        new = set(t.meta["involved_classes"]) - covered
        if new or len(picked) < 6:
            picked.append(t)
            covered |= set(t.meta["involved_classes"])
    assert covered == set(B.BFCL_CLASSES)
    tools = B.bfcl_tools()
    for t in picked:
        ctx = ToolContext(seed=0, episode_id=t.id, sandbox=None,  # bfcl tools use no sandbox
                          state={"initial_config": t.initial_config})
        for ti, turn in enumerate(t.gold):
            ours = []
            for c in turn:
                try:
                    ours.append(tools[c.name].handler(dict(c.arguments), ctx))
                except ToolError as e:
                    ours.append(str(e))
            theirs, inst = execute_multi_turn_func_call(
                answers[t.id][ti], t.initial_config, t.meta["involved_classes"],
                "reflrl_test", t.id)
            sess = B.session_for(ctx)
            sess.ensure(t.meta["involved_classes"])
            assert B.states_equal(sess.instances, inst), (t.id, ti)
            for a, b in zip(ours, theirs):
                if isinstance(a, dict) and "mpf" not in b:
                    assert json.dumps(a) == b, (t.id, ti)


def test_load_bfcl_multi_turn_tasks():
    base = B.load_bfcl_multi_turn("multi_turn_base", limit=5)
    assert len(base) == 5
    t = base[0]
    assert t.kind == "multi_turn" and t.id == "multi_turn_base_0"
    assert len(t.gold) == len(t.turns) + 1
    assert t.query.startswith("Move 'final_report.pdf'")
    assert t.gold[0][0].name == "cd" and t.gold[0][0].arguments == {"folder": "document"}
    names = {s["name"] for s in t.tools}
    assert {"ls", "post_tweet"} <= names
    assert "GorillaFileSystem" in t.initial_config and "long_context" not in t.initial_config
    miss = B.load_bfcl_multi_turn("multi_turn_miss_func", limit=3)
    for m in miss:
        held = {n for ns in m.meta["missed_function"].values() for n in ns}
        assert held and not held & {s["name"] for s in m.tools}
        assert "" in m.turns  # the turn where the function comes back has no message
    lc = B.load_bfcl_multi_turn("multi_turn_long_context", limit=1)[0]
    assert lc.initial_config["long_context"] is True
    assert B.BfclSession(lc.initial_config).long_context is True
    with pytest.raises(ValueError):
        B.load_bfcl_multi_turn("simple")


def test_hostile_paths_are_policy_errors_not_crashes(catalog, tmp_path):
    ctx = ctx_for(tmp_path, name="hostile")
    for args in [{"path": "a\x00b"}, {"path": "x" * 600}, {"path": ("d/" * 100) + "f"},
                 {"path": "y" * 300}]:
        with pytest.raises(ToolError):
            catalog["read_file"].handler(args, ctx)
    with pytest.raises(ToolError) as e:
        catalog["write_file"].handler({"path": "z" * 300, "content": "x"}, ctx)
    assert e.value.kind in ("io_error", "invalid_path")


def test_bfcl_gold_that_breaks_its_own_schema_is_flagged():
    tasks = {t.id: t for t in B.load_bfcl_multi_turn("multi_turn_base")}
    flagged = {i for i, t in tasks.items() if "gold_schema_errors" in t.meta}
    assert "multi_turn_base_173" in flagged
    assert "close_ticket" in tasks["multi_turn_base_173"].meta["gold_schema_errors"][0]
    assert len(flagged) < 5
