"""scripts/teacher_probe.py: the divergence point and the summary it prints."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("teacher_probe", ROOT / "scripts" / "teacher_probe.py")
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


def test_divergence_is_the_first_differing_token_or_the_shorter_length():
    assert probe.divergence([1, 2, 3], [1, 2, 4]) == 2
    assert probe.divergence([5], [1]) == 0
    assert probe.divergence([1, 2], [1, 2, 3]) == 2


def test_summary_counts_the_teacher_and_the_student():
    rows = [dict(teacher_top_is_gold=True, student_top_is_gold=False, teacher_lowers_failed=True,
                 failed_delta=-2.0, gold_delta=3.0),
            dict(teacher_top_is_gold=False, student_top_is_gold=False, teacher_lowers_failed=True,
                 failed_delta=0.0, gold_delta=1.0)]
    line = probe.summary_line(rows)
    assert line.startswith("2 greedy failures") and "gold in 1 (the student's in 0)" in line
    assert "lowers the failed token in 2" in line and "failed answer -1.00, gold answer +2.00" in line
    assert probe.summary_line([]) == "no greedy failures"
