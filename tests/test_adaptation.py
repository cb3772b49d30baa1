"""Adaptation to API changes (the sticky param_renamed / tool_moved faults): the metric over hand-built
episodes, its place in the held-out numbers, the printed summary and the report, and the recipe."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from reflrl import config as C
from reflrl import rollout as R
from reflrl.envs.types import Task, ToolCall

ROOT = Path(__file__).resolve().parent.parent
TASK = Task(id="a", query="q", tools=[], gold=[[ToolCall("get_weather", {"city": "Oslo"})]])


def change(kind: str, tool: str = "get_weather", step: int = 0) -> dict:
    return {"kind": kind, "tool": tool, "param": "city" if kind == "param_renamed" else None,
            "new": "location" if kind == "param_renamed" else "get_weather_v2", "step": step, "adapted": False}


def episode(changes: list[dict], *, right: bool, recoverable: bool, masked: bool = False) -> R.Trajectory:
    """An episode of two steps (the call that met the change, then the answer after it) whose last
    step's info carries the env's API-change fields."""
    t = R.Trajectory(task=TASK, group=0, prompt_ids=[1], correct=right, masked=masked)
    first = {"api_changes": changes[:1]}
    last = {"api_changes": list(changes), "change_recoverable": recoverable,
            "change_caused": bool(changes) and recoverable and not right}
    t.steps = [R.StepRecord(reward=0.0, correct=False, masked=False, info=first),
               R.StepRecord(reward=float(right), correct=right, masked=masked, info=last)]
    return t


def batch() -> list[R.Trajectory]:
    return [
        episode([change("param_renamed")], right=True, recoverable=True),    # adapted
        episode([change("param_renamed")], right=False, recoverable=True),   # right call, did not adapt
        episode([change("tool_moved")], right=True, recoverable=True),       # adapted
        episode([change("tool_moved")], right=False, recoverable=False),     # wrong call apart from the change
        episode([change("param_renamed"), change("tool_moved", "get_time", 1)], right=True, recoverable=True),
        episode([change("tool_moved")], right=False, recoverable=False, masked=True),
        episode([], right=True, recoverable=False),                          # met no change
    ]


def test_adaptation_is_the_share_right_of_the_change_recoverable_episodes_per_kind():
    out = R.fault_outcomes(batch())
    assert out["n_changed"] == 6  # every episode with a change met, masked or not
    assert out["n_change_recoverable"] == 4
    assert out["adaptation"] == pytest.approx(3 / 4)
    # an episode that met both kinds counts under each
    assert out["n_change_recoverable_param_renamed"] == 3
    assert out["adaptation_param_renamed"] == pytest.approx(2 / 3)
    assert out["n_change_recoverable_tool_moved"] == 2
    assert out["adaptation_tool_moved"] == 1.0
    # the step metrics carry it, prefixed like the other held-out numbers
    st = R.rollout_stats(batch())
    assert st["rollout_adaptation"] == pytest.approx(3 / 4) and st["rollout_n_changed"] == 6


def test_adaptation_is_none_when_there_is_nothing_to_divide_by():
    none_met = R.fault_outcomes([episode([], right=True, recoverable=False)])
    assert none_met["n_changed"] == 0 and none_met["n_change_recoverable"] == 0
    assert none_met["adaptation"] is None
    assert none_met["adaptation_param_renamed"] is None and none_met["adaptation_tool_moved"] is None
    # changes met, but none at a right call: still nothing to divide by
    wrong = R.fault_outcomes([episode([change("tool_moved")], right=False, recoverable=False)])
    assert wrong["n_changed"] == 1 and wrong["adaptation"] is None
    # one kind met, the other not
    one = R.fault_outcomes([episode([change("tool_moved")], right=False, recoverable=True)])
    assert one["adaptation_tool_moved"] == 0.0 and one["adaptation_param_renamed"] is None
    # an env that reports no API-change fields (another fault kind, client exposure): no change met
    t = R.Trajectory(task=TASK, group=0, prompt_ids=[1], correct=True)
    t.steps = [R.StepRecord(reward=1.0, correct=True, masked=False, info={})]
    assert R.fault_outcomes([t])["n_changed"] == 0 and R.fault_outcomes([])["adaptation"] is None


def _evaluation(adapt: float | None, n_rec: int, per_kind: dict[str, tuple[float | None, int]]) -> dict:
    ev = {"accuracy": 0.5, "first_answer_accuracy": 0.6, "clean_accuracy": 0.7, "n_clean": 10,
          "recovery_under_faults": 0.3, "n_faulted": 6, "recoverable_under_faults": 0.8, "n": 16,
          "eval_fault_seed": 1234, "adaptation": adapt, "n_change_recoverable": n_rec, "n_changed": n_rec + 1}
    for kind in R.API_CHANGE_KINDS:
        v, n = per_kind.get(kind, (None, 0))
        ev[f"adaptation_{kind}"], ev[f"n_change_recoverable_{kind}"] = v, n
    return ev


def _summary(evs: dict[str, dict]) -> dict:
    from reflrl.train.summary import heldout_numbers

    return {"heldout": {stage: heldout_numbers(ev, True) for stage, ev in evs.items()}, "fault_exposure": "policy"}


def test_heldout_numbers_and_the_printout_carry_adaptation_only_where_changes_were_met():
    from reflrl.train.summary import format_heldout, heldout_numbers

    evs = {"before": _evaluation(0.25, 4, {"param_renamed": (0.5, 2), "tool_moved": (0.0, 2)}),
           "after_warmup": _evaluation(0.5, 4, {"param_renamed": (1.0, 2), "tool_moved": (0.0, 2)}),
           "after": _evaluation(0.75, 4, {"param_renamed": (1.0, 2), "tool_moved": (0.5, 2)})}
    h = heldout_numbers(evs["after"], True)
    assert h["adaptation"] == 0.75 and h["adaptation_tool_moved"] == 0.5 and h["n_change_recoverable"] == 4
    assert h["n_changed"] == 5 and h["n_change_recoverable_param_renamed"] == 2
    lines = format_heldout(_summary(evs))
    row = next(x for x in lines if x.strip().startswith("adaptation to API changes:"))
    assert "base 25.0% (of 4) -> after warm-up 50.0% (of 4) -> after RL 75.0% (of 4)" in row
    assert "(RL +25.0 points)" in row
    moved = next(x for x in lines if x.strip().startswith("adaptation, tool moved:"))
    assert "after RL 50.0% (of 2)" in moved and "(RL +50.0 points)" in moved
    assert any(x.strip().startswith("adaptation, param renamed:") for x in lines)
    # a run whose faults are no API change: no adaptation row at all (the other rows stay)
    plain = {k: _evaluation(None, 0, {}) for k in evs}
    lines = format_heldout(_summary(plain))
    assert any("recovery under faults" in x for x in lines)
    assert not any("adaptation" in x for x in lines)
    # only one kind met: only its row
    one = {k: _evaluation(0.5, 2, {"tool_moved": (0.5, 2)}) for k in evs}
    lines = format_heldout(_summary(one))
    assert any("adaptation, tool moved" in x for x in lines) and not any("param renamed" in x for x in lines)


def test_report_table_and_learning_curves_show_adaptation_when_met(tmp_path):
    from report_fixtures import make_run

    from reflrl.report import derive as D
    from reflrl.report import load_run
    from reflrl.report.plots import learning_curves_plot
    from reflrl.report.render import heldout_section

    plain = make_run(tmp_path / "plain")
    sec = heldout_section(load_run(plain))
    assert not any(row[0].startswith("adaptation") for row in sec.table[1])
    assert len(learning_curves_plot(load_run(plain)).axes) == 4

    path = make_run(tmp_path / "changes")
    s = json.loads((path / "summary.json").read_text())
    for stage, v in (("before", 0.25), ("after_warmup", 0.5), ("after", 0.75)):
        s["heldout"][stage].update({"adaptation": v, "n_change_recoverable": 8, "n_changed": 10,
                                    "adaptation_param_renamed": v, "n_change_recoverable_param_renamed": 8,
                                    "adaptation_tool_moved": None, "n_change_recoverable_tool_moved": 0})
    (path / "summary.json").write_text(json.dumps(s))
    rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if r["phase"] == "train":
            r["rollout_adaptation"] = r["rollout_adaptation_param_renamed"] = 0.1 * (r["step"] % 5)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = load_run(path)
    body = {row[0]: row for row in heldout_section(run).table[1]}
    assert body["adaptation to API changes"][1:4] == ["25.0% (of 8)", "50.0% (of 8)", "75.0% (of 8)"]
    assert body["adaptation to API changes"][4] == "+25.0 points"
    assert "adaptation, param renamed" in body and "adaptation, tool moved" not in body
    curves = {c.key: c for c in D.learning_curves(run)}
    train = [r for r in rows if r["phase"] == "train"]
    assert curves["adaptation"].rollout_steps == [r["step"] for r in train]
    assert [p[2] for p in curves["adaptation"].points] == [0.25, 0.5, 0.75]
    assert curves["adaptation_tool_moved"].empty
    fig = learning_curves_plot(run)
    assert len(fig.axes) == 5 and fig.axes[4].get_title().startswith("adaptation to API changes")


def test_the_api_changes_recipe_loads_and_changes_only_its_keys():
    cfg = C.load_config(ROOT / "configs" / "api_changes.yaml")
    assert cfg.data.kinds == ["single"]
    assert cfg.env.fault_exposure == "policy" and cfg.env.train_fault_scale == 2.0
    assert cfg.reflection.variant == "tool_rerl" and cfg.reflection.critic == "rule"
    assert C.train_faults(cfg.env) == "param_renamed=0.4,tool_moved=0.4"  # the RL rollouts: twice the evaluation's
    pieces = ["env.faults=param_renamed=0.2,tool_moved=0.2", "data.kinds=[single]", "env.train_fault_scale=2.0",
              "env.train_fault_cap=0.8", "train.steps=16", "env.max_steps=3", "warmup.critique_share=0.5", "warmup.critique_reveal=answer",
              "warmup.rename_share=0.5", "reflection.reveal=answer", "reflection.level=sequence_mean",
              "reflection.max_per_step=8"]
    assert set(C.config_diff(cfg)) == {p.split("=")[0] for p in pieces}
    # the same run from the command line's pieces
    assert cfg == C.load_config(ROOT / "configs" / "tool_rerl.yaml", pieces)


def _change_kinds_exist() -> bool:
    from reflrl.faults import kinds

    return "param_renamed" in kinds.KINDS and "tool_moved" in kinds.KINDS


@pytest.mark.skipif(not _change_kinds_exist(), reason="the API-change fault kinds are not in reflrl.faults.kinds")
def test_the_recipe_names_the_api_change_kinds_the_metric_counts():
    from reflrl.faults import FaultPlan, kinds

    cfg = C.load_config(ROOT / "configs" / "api_changes.yaml")
    plan = FaultPlan.parse(cfg.env.faults)
    assert {e.kind: e.prob for e in plan.entries} == {"param_renamed": 0.2, "tool_moved": 0.2}
    assert set(R.API_CHANGE_KINDS) == set(getattr(kinds, "CHANGE_KINDS", R.API_CHANGE_KINDS))


def test_paper_table_and_bench_recipe_report_adaptation_when_changes_were_met():
    from script_loader import load_script

    pt, br = load_script("paper_table"), load_script("bench_recipe")

    def row(variant, seed, before, after):
        held = lambda a: {"recovery_under_faults": 0.2, "clean_accuracy": 0.5, "adaptation": a,
                          "adaptation_param_renamed": a, "adaptation_tool_moved": None}
        return {"variant": variant, "seed": seed, "before": 0.4, "after": 0.5, "heldout_before": held(before),
                "heldout_after": held(after), "steps": 8, "rl_s": 60.0, "wall_s": 120.0, "failed": 10.0,
                "recovered": 1.0, "tool_calls": 20, "signal_trajectories": 10}
    text, _, _ = pt.table([row("tool_rerl", 0, 0.2, 0.6), row("tool_rerl", 1, 0.4, 0.6)], ["tool_rerl"])
    head, sep, line = text.splitlines()
    assert "| adaptation, after (gain) | adaptation, param renamed, after (gain) |" in head
    assert "tool moved" not in head and head.count("|") == sep.count("|") == line.count("|")
    assert "| 0.600 ± 0.000 (0.300 ± 0.141) | 0.600 ± 0.000 (0.300 ± 0.141) |" in line
    plain = [row("grpo", 0, None, None)]
    assert "adaptation" not in pt.table(plain, ["grpo"])[0]

    h = lambda a: {"accuracy": 0.5, "adaptation": a, "adaptation_tool_moved": a}
    lines = br.fault_lines([{"heldout": {"after_warmup": h(0.25), "after": h(0.75)}},
                            {"heldout": {"after_warmup": h(0.5), "after": h(0.5)}}])
    ad = next(x for x in lines if x.startswith("adaptation:"))
    assert "RL gain (paired) 0.250 ± 0.354" in ad and "+50.0, +0.0 points" in ad
    assert any(x.startswith("adaptation_tool_moved:") for x in lines)
    assert not any(x.startswith("adaptation_param_renamed") for x in lines)
    assert {"adaptation", "n_changed", "n_change_recoverable"} <= set(br.heldout_row(
        {"heldout": {"after": {"adaptation": 0.5, "n_changed": 3, "n_change_recoverable": 2}}})["after"])


@pytest.mark.skipif(not _change_kinds_exist(), reason="the API-change fault kinds are not in reflrl.faults.kinds")
def test_a_policy_that_adapts_to_the_changes_it_is_shown_has_full_adaptation_in_the_heldout_evaluation():
    """End to end: the held-out evaluation under param_renamed / tool_moved, the changes coming back to
    the policy as the tool's answer. A scripted policy that answers gold and, shown a change, calls again
    with the new parameter name or the successor tool ends right on every change it met."""
    import asyncio
    import re

    import gymnasium

    import reflrl.envs
    from reflrl.envs.datasets import synthetic_splits
    from reflrl.envs.parsing import format_calls
    from reflrl.heldout import aevaluate_episodes
    from reflrl.models import load_tokenizer

    from doubles import ScriptedEngine

    tok = load_tokenizer("tiny-random")
    tasks = synthetic_splits(n_train=0, n_val=0, n_test=8, seed=4, kinds=("single",))["test"]

    def answer(text: str, j: int) -> str:
        task = next(t for t in tasks if t.query in text)
        gold = task.gold[0][0]
        name, args = gold.name, dict(gold.arguments)
        last = text.split("<|im_start|>")[-2]  # the tool's answer to the previous call, if any
        moved = re.search(r"call (\S+) with the same arguments", last)
        renamed = re.search(r"unknown parameter '([^']+)': \S+ now takes '([^']+)'", last)
        if moved:
            name = moved.group(1)
        if renamed and renamed.group(1) in args:
            args[renamed.group(2)] = args.pop(renamed.group(1))
        return format_calls([ToolCall(name, args)], "hermes")

    envs = [gymnasium.make(reflrl.envs.SINGLE_TURN_ID, dataset=tasks, faults="param_renamed=0.3,tool_moved=0.3",
                           fault_exposure="policy", timeout=2.0).unwrapped for _ in tasks]
    try:
        out = asyncio.run(aevaluate_episodes(ScriptedEngine(tok, answer), tok, envs, tasks,
                                             R.RolloutSpec(max_new_tokens=200, temperature=0.0), seed=9))
    finally:
        for e in envs:
            e.close()
    assert out["n_changed"] > 0 and out["n_change_recoverable"] == out["n_changed"]
    assert out["adaptation"] == 1.0 and out["accuracy"] == 1.0
    for kind in R.API_CHANGE_KINDS:  # the evaluation's fixed fault seed gives both kinds here
        assert out[f"n_change_recoverable_{kind}"] > 0 and out[f"adaptation_{kind}"] == 1.0


@pytest.mark.parametrize("max_total_tokens", [4096, 1000])
def test_a_policy_that_repeats_the_old_call_has_zero_adaptation_not_none(max_total_tokens):
    """End to end: a policy that answers gold and, shown a change, sends the same old call again until the
    episode ends (by the env's step budget, or by the rollout's token budget: ``max_total_tokens``) counts every
    change it met as change-recoverable and none as adapted: its episodes are its failures, not masked."""
    import asyncio

    import gymnasium

    import reflrl.envs
    from reflrl.envs.datasets import synthetic_splits
    from reflrl.envs.parsing import format_calls
    from reflrl.heldout import aevaluate_episodes
    from reflrl.models import load_tokenizer

    from doubles import ScriptedEngine

    tok = load_tokenizer("tiny-random")
    tasks = synthetic_splits(n_train=0, n_val=0, n_test=8, seed=4, kinds=("single",))["test"]

    def answer(text: str, j: int) -> str:
        task = next(t for t in tasks if t.query in text)
        return format_calls(list(task.gold[0]), "hermes")

    envs = [gymnasium.make(reflrl.envs.SINGLE_TURN_ID, dataset=tasks, faults="param_renamed=0.3,tool_moved=0.3",
                           fault_exposure="policy", timeout=2.0).unwrapped for _ in tasks]
    try:
        out = asyncio.run(aevaluate_episodes(
            ScriptedEngine(tok, answer), tok, envs, tasks,
            R.RolloutSpec(max_new_tokens=200, temperature=0.0, max_total_tokens=max_total_tokens), seed=9))
    finally:
        for e in envs:
            e.close()
    assert out["n_changed"] > 0 and out["n_change_recoverable"] == out["n_changed"]
    assert out["adaptation"] == 0.0
