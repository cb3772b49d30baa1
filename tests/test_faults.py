"""reflrl.faults: spec grammar, pure decisions, kinds table, ledger and payload transforms."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reflrl.faults import (KIND_NAMES, KINDS, CallRecord, FaultEvent, FaultPlan, FaultSpecError,
                           Ledger, LedgerError, decide, draw, format_kinds_table, is_corrupt,
                           is_file_tool, kinds_rows)
from reflrl.faults.decide import FaultDecision
from reflrl.faults.inject import corrupt, drift


# ---- grammar ------------------------------------------------------------------------------
def test_parse_example_and_round_trip():
    p = FaultPlan.parse("rate_limit=0.1, timeout=0.05 ,latency=0.2:300ms")
    assert p.kinds == ("rate_limit", "timeout", "latency")
    assert p.prob("rate_limit") == 0.1 and p.prob("server_error") == 0.0
    assert p.entry("latency").param == pytest.approx(0.3)
    assert p.entry("rate_limit").value == 1.0          # the kind's default Retry-After
    assert str(p) == "rate_limit=0.1,timeout=0.05,latency=0.2:300ms"
    assert FaultPlan.parse(str(p)) == p
    assert FaultPlan.parse("latency=0.1:2s").entry("latency").param == 2.0
    assert FaultPlan.parse("latency=0.1:1.5m").entry("latency").param == 90.0
    assert FaultPlan.parse("rate_limit=1:3s").entry("rate_limit").param == 3.0


@pytest.mark.parametrize("spec", ["rate_limit=0.1:2", "latency=0.1:300", "timeout=1:0.5"])
def test_a_duration_without_a_unit_is_refused_as_the_readme_says(spec):
    """Fault specs: durations without a unit are rejected (``300`` could be ms or s)."""
    with pytest.raises(FaultSpecError, match="has no unit"):
        FaultPlan.parse(spec)


def test_none_plans():
    for s in ("", "  ", "none", "NONE"):
        assert FaultPlan.parse(s) == FaultPlan.none()
    assert not FaultPlan.none() and str(FaultPlan.none()) == ""
    assert not FaultPlan.parse("timeout=0")
    assert FaultPlan.coerce(None) == FaultPlan.none()
    assert FaultPlan.coerce("timeout=0.5").prob("timeout") == 0.5


@pytest.mark.parametrize("spec, needles", [
    ("rate_limt=0.1", ["rate_limt", "did you mean 'rate_limit'"]),
    ("bogus=0.1", ["unknown fault kind 'bogus'", "known:"]),
    ("timeout=abc", ["timeout=abc", "not a number"]),
    ("timeout=nan", ["timeout=nan", "not a number"]),
    ("latency=1.5", ["latency=1.5", "outside [0, 1]"]),
    ("latency=-0.1", ["latency=-0.1", "outside [0, 1]"]),
    ("rate_limit=0.1,latency=0.5,latency=0.1", ["entry 3", "latency", "twice"]),
    ("server_error=0.1:3s", ["server_error=0.1:3s", "takes no parameter"]),
    ("latency=0.1:3h", ["latency=0.1:3h", "not a duration"]),
    ("latency=0.1:-2s", ["latency=0.1:-2s"]),
    ("rate_limit=0.6,timeout=0.6", ["sum to 1.2", "> 1"]),
    ("rate_limit=0.1,,timeout=0.1", ["entry 2", "empty"]),
    ("rate_limit", ["'rate_limit'", "kind=probability"]),
])
def test_bad_specs_name_the_offending_entry(spec, needles):
    with pytest.raises(FaultSpecError) as ei:
        FaultPlan.parse(spec)
    assert isinstance(ei.value, ValueError)
    for n in needles:
        assert n in str(ei.value), (n, str(ei.value))


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("rate_limitouscnlyp=:,.0123456789msh -eE+")) ,
               max_size=60) | st.text(max_size=40))
def test_fuzz_parse_only_raises_fault_spec_error(text):
    try:
        plan = FaultPlan.parse(text)
    except FaultSpecError as e:
        assert str(e)
        return
    assert FaultPlan.parse(str(plan)) == plan
    assert plan.total <= 1 + 1e-9


_entry = st.tuples(st.sampled_from(KIND_NAMES),
                   st.floats(0, 0.1, allow_nan=False),
                   st.one_of(st.none(), st.floats(0, 100, allow_nan=False)))


@settings(max_examples=200, deadline=None)
@given(st.lists(_entry, max_size=len(KIND_NAMES), unique_by=lambda e: e[0]))
def test_fuzz_valid_plans_round_trip(entries):
    parts = []
    for kind, prob, param in entries:
        s = f"{kind}={prob!r}"
        if param is not None and KINDS[kind].takes_param:
            s += f":{param!r}s"
        parts.append(s)
    plan = FaultPlan.parse(",".join(parts))
    assert FaultPlan.parse(str(plan)) == plan
    assert plan.kinds == tuple(e[0] for e in entries)


# ---- decisions ----------------------------------------------------------------------------
def test_decide_is_pure_and_seed_dependent():
    plan = FaultPlan.parse(",".join(f"{k}=0.05" for k in KIND_NAMES))
    coords = [(e, s, c, a) for e in ("ep-a", "ep-b") for s in range(10) for c in range(3)
              for a in range(4)]
    first = [decide(plan, 7, *x) for x in coords]
    shuffled = list(coords)
    random.Random(0).shuffle(shuffled)
    again = {x: decide(plan, 7, *x) for x in shuffled}
    assert first == [again[x] for x in coords]
    other = [decide(plan, 8, *x) for x in coords]
    assert first != other
    assert [d and d.kind for d in first] != [d and d.kind for d in other]
    # attempts of one call are independent draws
    assert len({draw(7, "ep-a", 0, 0, a) for a in range(50)}) == 50


def test_decide_frequencies_match_the_plan():
    plan = FaultPlan.parse("rate_limit=0.1,timeout=0.05,latency=0.2:300ms")
    n = 40_000
    counts: dict[str | None, int] = {}
    for i in range(n):
        d = decide(plan, 123, "ep", i, 0, 0)
        k = d.kind if d else None
        counts[k] = counts.get(k, 0) + 1
    for kind in plan.kinds:
        p = plan.prob(kind)
        se = math.sqrt(p * (1 - p) / n)
        assert abs(counts.get(kind, 0) / n - p) < 3 * se
    d = next(d for i in range(1000) if (d := decide(plan, 1, "e", i, 0, 0)) and d.kind == "latency")
    assert d.param == pytest.approx(0.3)


def test_decide_without_faults_and_certain_faults():
    assert decide(FaultPlan.none(), 0, "e", 0, 0, 0) is None
    assert decide(FaultPlan.parse("timeout=0"), 0, "e", 0, 0, 0) is None
    plan = FaultPlan.parse("server_error=1")
    codes = {decide(plan, 0, "e", i, 0, 0).choose((500, 502, 503), 1) for i in range(100)}
    assert codes == {500, 502, 503}


# ---- kinds --------------------------------------------------------------------------------
def test_kinds_table_lists_every_kind():
    assert len(KINDS) == 12 and sum(k.sticky for k in KINDS.values()) == 2
    rows = kinds_rows()
    assert [r["kind"] for r in rows] == list(KIND_NAMES)
    table = format_kinds_table()
    for k in KIND_NAMES:
        assert k in table
    assert "Retry-After" in table and "retry_after" in table
    assert is_file_tool("files") and is_file_tool("bfcl:GorillaFileSystem")
    assert not is_file_tool("weather") and not is_file_tool(None)


# ---- payload transforms -------------------------------------------------------------------
def _dec(sub: int) -> FaultDecision:
    return FaultDecision("schema_drift", None, 0.0, sub)


def test_drift_renames_or_drops_exactly_one_field():
    result = {"temp_c": 21.5, "city": "Oslo", "wind": 3}
    seen = set()
    for sub in range(64):
        new, detail = drift(result, _dec(sub * 7919))
        assert new != result
        assert len(set(new) ^ set(result)) in (1, 2)  # dropped one, or one renamed
        seen.add(detail.split()[0])
    assert seen == {"renamed", "dropped"}
    new, _ = drift([{"a_b": 1}, {"a_b": 2}], _dec(0))
    assert new[1] == {"a_b": 2} and new[0] != {"a_b": 1}
    assert drift("text", _dec(0)) is None and drift([], _dec(0)) is None
    assert drift({}, _dec(0)) is None


def test_corrupt_is_detectable():
    r = {"path": "a.txt", "content": "hello world", "size": 11}
    c = corrupt(r)
    assert is_corrupt(c) and not is_corrupt(r)
    assert c["size"] == 11
    assert is_corrupt(corrupt(42)) and is_corrupt(corrupt([1, 2]))


# ---- ledger -------------------------------------------------------------------------------
def _ev(source, kind, attempt=0, triage="env_fault", call=0):
    return FaultEvent("e", 0, call, attempt, source, triage, kind)


def test_ledger_rejects_double_records():
    led = Ledger()
    led.record_injected(_ev("injected", "timeout"))
    with pytest.raises(LedgerError):
        led.record_injected(_ev("injected", "rate_limit"))
    led.record_observed(_ev("observed", "timeout"))
    with pytest.raises(LedgerError):
        led.record_observed(_ev("observed", "timeout"))
    with pytest.raises(LedgerError):
        led.record_observed(_ev("injected", "timeout", attempt=1))
    led.record_call(CallRecord("e", 0, 0, "t", 1, "env_fault", ("timeout",)))
    with pytest.raises(LedgerError):
        led.record_call(CallRecord("e", 0, 0, "t", 1, "env_fault", ("timeout",)))
    # merging the same events again is a no-op; a conflicting one raises
    assert led.merge_injected([_ev("injected", "timeout")]) == 0
    with pytest.raises(LedgerError):
        led.merge_injected([_ev("injected", "malformed")])


def test_reconcile_pairs_and_flags_mismatches():
    led = Ledger()
    led.record_injected(_ev("injected", "rate_limit", 0))
    led.record_observed(_ev("observed", "rate_limit", 0))
    led.record_injected(_ev("injected", "schema_drift", 1))
    led.record_observed(_ev("observed", None, 1, triage="ok"))       # undetected drift
    led.record_injected(_ev("injected", "latency", 2))
    led.record_observed(_ev("observed", "timeout", 2))               # slower than read timeout
    led.record_observed(_ev("observed", None, 3, triage="policy_error"))
    led.record_observed(_ev("observed", "latency", 6, triage="ok"))    # real slowness: not a fault
    rep = led.reconcile()
    assert rep.exact, rep.format()
    assert rep.per_kind["rate_limit"].matched == 1
    assert rep.per_kind["schema_drift"].undetected == 1
    assert rep.per_kind["latency"].as_other == 1
    assert rep.slow_not_injected == 1 and "without an injected latency: 1" in rep.format()
    # a fault observed with nothing injected, and an injected fault seen as ok
    led.record_observed(_ev("observed", "server_error", 4))
    led.record_injected(_ev("injected", "truncated", 5))
    led.record_observed(_ev("observed", None, 5, triage="ok"))
    rep = led.reconcile()
    assert not rep.exact and len(rep.mismatches) == 2
    assert {m.key[3] for m in rep.mismatches} == {4, 5}
    assert "mismatch" in rep.format()


def test_totals_count_calls_attempts_and_outcomes():
    led = Ledger()
    led.record_observed(_ev("observed", "rate_limit", 0, call=0))
    led.record_observed(_ev("observed", None, 1, triage="ok", call=0))
    led.record_call(CallRecord("e", 0, 0, "t", 2, "ok", ("rate_limit",)))
    led.record_observed(_ev("observed", "timeout", 0, call=1))
    led.record_call(CallRecord("e", 0, 1, "t", 1, "env_fault", ("timeout",)))
    led.record_observed(_ev("observed", None, 0, triage="policy_error", call=2))
    led.record_call(CallRecord("e", 0, 2, "t", 1, "policy_error", ()))
    t = led.totals()
    assert (t.calls, t.attempts, t.retries, t.recovered, t.given_up, t.policy_errors) == \
        (3, 4, 1, 1, 1, 1)
    assert t.faults_by_kind == {"rate_limit": 1, "timeout": 1}
    assert "attempts(billed)=4" in t.format()
    led.forget_episode("e")
    assert led.totals().calls == 0


def test_a_scaled_plan_keeps_kinds_and_ratios_and_is_capped():
    plan = FaultPlan.parse("rate_limit=0.1,timeout=0.05:3s")
    x3 = plan.scaled(3.0)
    assert x3.kinds == plan.kinds and x3.entry("timeout").param == 3.0
    assert math.isclose(x3.prob("rate_limit"), 0.3) and math.isclose(x3.prob("timeout"), 0.15)
    capped = plan.scaled(10.0, cap=0.5)          # 1.5 in total would exceed the cap: scaled to total 0.5
    assert math.isclose(capped.total, 0.5) and math.isclose(capped.prob("rate_limit") / capped.prob("timeout"), 2.0)
    high = FaultPlan.parse("server_error=0.8")   # already above the cap: never lowered by a scale above 1
    assert high.scaled(3.0, cap=0.5) is high and plan.scaled(1.0) is plan
    assert math.isclose(plan.scaled(0.5).prob("rate_limit"), 0.05)
    for bad in ((-1.0, 0.5), (float("nan"), 0.5), (2.0, 0.0), (2.0, 1.5)):
        with pytest.raises(FaultSpecError):
            plan.scaled(*bad)
