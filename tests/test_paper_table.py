"""scripts/paper_table.py: the table's fault columns, the ordering on recovery under faults, and the
warm-up run's evaluation taken as the start when the RL runs skip their own."""
from __future__ import annotations

import json

import pytest

from script_loader import load_script

pt = load_script("paper_table")


def _row(variant, seed, before, after, rec_before, rec_after, clean_before=0.5, clean_after=0.5):
    held = lambda rec, clean: {"recovery_under_faults": rec, "clean_accuracy": clean, "n": 240, "eval_fault_seed": 7}
    return {"variant": variant, "seed": seed, "before": before, "after": after,
            "heldout_before": held(rec_before, clean_before), "heldout_after": held(rec_after, clean_after),
            "steps": 8, "rl_s": 60.0, "wall_s": 120.0, "failed": 10.0, "recovered": 1.0,
            "tool_calls": 20, "signal_trajectories": 10}


def test_table_reports_recovery_and_its_gain_per_variant():
    rows = [_row("grpo", 0, 0.40, 0.42, 0.10, 0.20), _row("grpo", 1, 0.40, 0.40, 0.20, 0.20),
            _row("tool_rerl", 0, 0.40, 0.41, 0.10, 0.40), _row("tool_rerl", 1, 0.40, 0.41, 0.20, 0.40)]
    text, means, recovery = pt.table(rows, ["grpo", "tool_rerl"])
    assert recovery == pytest.approx({"grpo": 0.20, "tool_rerl": 0.40})
    assert means == pytest.approx({"grpo": 0.41, "tool_rerl": 0.41})
    grpo_line = next(line for line in text.splitlines() if line.startswith("| grpo "))
    assert "0.200 ± 0.000 (0.050 ± 0.071)" in grpo_line  # recovery after, and its per-seed gain (+0.10, 0)
    lines = pt.ordering(means, recovery)
    assert any("on recovery under faults: holds" in line and "tool_rerl 0.400" in line for line in lines)
    assert any("on accuracy: does NOT hold" in line for line in lines)  # equal means: not strictly better


def test_runs_without_a_start_show_no_gain():
    rows = [_row("grpo", 0, None, 0.42, None, 0.2)]
    rows[0]["heldout_before"] = None
    text, _, _ = pt.table(rows, ["grpo"])
    assert "| 0.420 ± 0.000 | n/a |" in text


def test_warmup_evaluation_is_read_from_the_warmup_run_and_must_match(tmp_path):
    held = {"accuracy": 0.45, "recovery_under_faults": 0.1, "n": 240, "eval_fault_seed": 7}
    (tmp_path / "summary.json").write_text(json.dumps({"heldout": {"after_warmup": held}}))
    acc, h = pt.warmup_evaluation(tmp_path, {"n": 240, "eval_fault_seed": 7})
    assert acc == 0.45 and h["recovery_under_faults"] == 0.1
    with pytest.raises(ValueError, match="240 tasks.*48 tasks"):
        pt.warmup_evaluation(tmp_path, {"n": 48, "eval_fault_seed": 7})
    assert pt.warmup_evaluation(tmp_path / "missing", None) == (None, None)
