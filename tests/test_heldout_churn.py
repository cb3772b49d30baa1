"""scripts/heldout_churn.py: the task-by-task comparison it prints."""
from __future__ import annotations

import pytest

from script_loader import load_script

hc = load_script("heldout_churn")


def test_churn_counts_both_directions_and_the_first_tasks():
    before = [True, True, False, False, True, False]
    after = [True, False, True, True, True, False]
    c = hc.churn(before, after)
    assert c == {"n": 6, "before": 0.5, "after": 4 / 6, "turned_right": 2, "turned_wrong": 1}
    c3 = hc.churn(before, after, first=3)
    assert (c3["n"], c3["turned_right"], c3["turned_wrong"]) == (3, 1, 1) and c3["before"] == c3["after"]


def test_churn_refuses_lists_of_different_tasks():
    with pytest.raises(ValueError, match="different task counts: 2 and 3"):
        hc.churn([True, False], [True, False, True])
