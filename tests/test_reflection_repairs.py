"""scripts/reflection_repairs.py: greedy retries of held-out failures under q* per reveal level."""
from __future__ import annotations

from reflrl.envs.parsing import format_calls, parse
from reflrl.envs.prompts import build_messages
from reflrl.envs.rewards import calls_match
from reflrl.envs.types import Task, ToolCall
from reflrl.recovery.critics import get_critic

from script_loader import load_script

TOOLS = [{"name": "get_weather", "description": "weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]}}]


def _task(i: int, city: str) -> Task:
    return Task(id=f"t{i}", kind="single", query=f"What is the weather in {city} in celsius?", tools=TOOLS,
                gold=[[ToolCall("get_weather", {"city": city, "unit": "celsius"})]])


def copy_policy(tasks, messages_fn):
    """A scripted policy: answers with the last <tool_call> line it can read in its prompt (it copies
    an expected answer when q* holds one, else repeats its failed attempt); judged like the held-out
    evaluation."""
    out = []
    for t in tasks:
        text = messages_fn(t)[-1]["content"]
        blocks = [b for b in text.split("<tool_call>")[1:] if "</tool_call>" in b]
        ans = "<tool_call>" + blocks[-1].split("</tool_call>")[0] + "</tool_call>" if blocks else ""
        p = parse(ans, "hermes")
        out.append({"text": ans, "correct": bool(p.ok and calls_match(list(p.calls), list(t.gold[0])))})
    return out


def test_only_levels_that_state_the_answer_let_a_copying_policy_repair():
    rr = load_script("reflection_repairs")
    tasks = [_task(0, "Paris"), _task(1, "Lima")]
    wrong = [format_calls([ToolCall("get_weather", {"city": "Rome"})], "hermes"),  # wrong value, missing unit
             format_calls([ToolCall("get_weather", {"city": "Lima"})], "hermes")]  # missing unit
    failures = list(zip(tasks, wrong))
    rows = {lvl: rr.repairs_at_level(copy_policy, failures, get_critic("rule", reveal=lvl, parser="hermes"),
                                     build_messages, "hermes", "replace")
            for lvl in ("none", "query", "answer")}
    for lvl in ("none", "query"):  # q* holds only the failed attempt: the copy repeats it
        assert rows[lvl]["repaired"] == 0 and rows[lvl]["repeated_failed_answer"] == 2, lvl
    a = rows["answer"]
    assert a["failures"] == a["reflected"] == a["repaired"] == 2 and a["ratio"] == 1.0
    assert a["repaired_ids"] == ["t0", "t1"] and a["repeated_failed_answer"] == 0


def test_a_right_answer_gets_no_reflection_and_is_not_retried():
    rr = load_script("reflection_repairs")
    t = _task(0, "Oslo")
    right = format_calls(list(t.gold[0]), "hermes")
    called = []
    row = rr.repairs_at_level(lambda ts, mf: called.append(ts) or [], [(t, right)],
                              get_critic("rule", reveal="answer", parser="hermes"), build_messages, "hermes", "replace")
    assert row["unreflected"] == 1 and row["reflected"] == 0 and row["repaired"] == 0 and called == []
