"""scripts/bench_recipe.py's aggregate: the three accuracies and the paired RL gain over seeds."""
from __future__ import annotations

from script_loader import load_script


def test_aggregate_prints_the_three_accuracies_and_the_paired_rl_gain():
    br = load_script("bench_recipe")
    rows = [{"seed": s, "before": 0.0, "after_warmup": w, "after": a, "rl_gain": a - w, "wall_s": 600.0,
             "recipe_complete": s != 2, "recovery": {"reflected": 10, "recovered_by_reflection": r,
                                                     "recovered_policy_error": r}}
            for s, w, a, r in ((0, 0.40, 0.50, 3), (1, 0.30, 0.45, 4), (2, 0.50, 0.45, 5))]
    lines = br.aggregate_lines(rows)
    text = "\n".join(lines)
    assert "accuracy after warm-up:  0.400 ± 0.100" in text
    assert "accuracy after RL:       0.467 ± 0.029" in text
    # paired: mean of (0.10, 0.15, -0.05), not the difference of the means' stds
    rl = next(l for l in lines if l.startswith("RL gain"))
    assert "0.067 ± 0.104" in rl and "+10.0, +15.0, -5.0 points" in rl and "positive in 2 of 3" in rl
    assert "recovered 12 of 30 reflected failures (40.0%" in text
    assert "CUT BY THE TIME GUARD: seed(s) 2" in lines[-1]
