"""Is an accuracy change real, or churn? Checkpoints scored on a larger held-out split, compared task by task.

The synthetic generator is prefix-stable, so ``--n-test 240`` scores the recipe's 48 test tasks and the next 192
of the same generator (none of them in the training split). Every checkpoint after the first is compared with the
first, task by task: how many turned right and how many turned wrong, on all the tasks and on the recipe's first 48.

    .venv/bin/python scripts/heldout_churn.py RUN_A[:step_000000] RUN_B[:step_000008] ... [--n-test 240]
        [--first 48] [--set key=value ...] [--json FILE]

Greedy, exact match, as the held-out evaluation of a run (``reflrl.heldout``). The numbers depend on the seed, the
CPU kind and the thread count (README); quote them with ``torch.backends.cpu.get_cpu_capability()``.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


def churn(before: Sequence[bool], after: Sequence[bool], first: int | None = None) -> dict:
    """Task-by-task change between two per-task correctness lists of the same tasks (optionally only the first
    ``first`` of them): accuracies, tasks that turned right, tasks that turned wrong."""
    if len(before) != len(after):
        raise ValueError(f"the lists score different task counts: {len(before)} and {len(after)}")
    a, b = list(before[:first]), list(after[:first])
    n = len(a)
    return {"n": n, "before": sum(a) / n if n else 0.0, "after": sum(b) / n if n else 0.0,
            "turned_right": sum(1 for x, y in zip(a, b) if not x and y),
            "turned_wrong": sum(1 for x, y in zip(a, b) if x and not y)}


def _line(label: str, c: dict) -> str:
    return (f"{label}: {c['before']:.1%} -> {c['after']:.1%} ({100 * (c['after'] - c['before']):+.1f} points; "
            f"{c['turned_right']} turned right, {c['turned_wrong']} wrong, of {c['n']})")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="+", help="RUN_DIR[:CHECKPOINT] (default checkpoint step_000000); the first "
                                                  "is the baseline")
    p.add_argument("--n-test", type=int, default=240, help="held-out tasks to score (data.n_test)")
    p.add_argument("--first", type=int, default=48, help="also compare on the first N tasks (the recipe's test split)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", help="write the per-task results to this JSON file")
    a = p.parse_args(argv)

    from reflrl.heldout import evaluate
    from reflrl.train.setup import checkpoint_components, messages_fn

    scored: dict[str, list[bool]] = {}
    for spec in a.checkpoints:
        run, _, ck = spec.partition(":")
        try:
            cfg, splits, comp = checkpoint_components(run, ck or "step_000000",
                                                      [f"data.n_test={a.n_test}", *a.overrides])
        except FileNotFoundError as e:
            p.error(str(e))
        res = evaluate(comp.eval_engine, comp.tokenizer, splits["test"], messages_fn(cfg), comp.rollout)
        scored[spec] = [bool(r["correct"]) for r in res.per_task]
        print(f"{spec}: {res.accuracy:.1%} of {len(scored[spec])} ({sum(scored[spec][:a.first])} of the first "
              f"{a.first} right)", flush=True)
    base, *others = a.checkpoints
    for spec in others:
        print(f"{base} -> {spec}")
        print("  " + _line(f"all {a.n_test}", churn(scored[base], scored[spec])))
        print("  " + _line(f"first {a.first}", churn(scored[base], scored[spec], a.first)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(scored, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
