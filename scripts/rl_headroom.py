"""Where can RL find a signal? For a checkpoint of a run (by default the one right after the warm-up), the
held-out tasks' greedy verdicts beside n answers sampled per task at each temperature.

    .venv/bin/python scripts/rl_headroom.py RUN_DIR [--checkpoint step_000000] [--temperatures 1.0,0.7]
                                            [--n 8] [--set key=value ...] [--json FILE]

GRPO moves a greedy answer only where some sample differs from it: a task whose greedy answer is wrong
and whose n samples are all wrong gives an all-wrong group (advantage 0), so no amount of sampling-based
RL changes it; there only a repair under a critique (Tool-ReRL) or more supervision brings a correct
answer into the loss. The script prints, per temperature:

* sampled accuracy (all samples), and on the tasks greedy gets right / wrong;
* greedy-wrong tasks with at least one correct sample (pass@n): the room sampling-based RL has;
* mixed groups (some but not all samples right): the groups that give GRPO a gradient.

The numbers depend on the seed only (quote the wall time with the machine's CPU kind).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence


def headroom_row(temperature: float, greedy: Sequence[bool], counts: Sequence[int], n: int) -> dict:
    """The statistics of one temperature from per-task greedy verdicts and correct-sample counts."""
    if len(greedy) != len(counts):
        raise ValueError(f"{len(greedy)} greedy verdicts but {len(counts)} sample counts")
    right = [c for g, c in zip(greedy, counts) if g]
    wrong = [c for g, c in zip(greedy, counts) if not g]
    return {
        "temperature": temperature, "n": n, "tasks": len(counts),
        "sampled_accuracy": sum(counts) / (n * len(counts)) if counts else 0.0,
        "sampled_accuracy_greedy_right": sum(right) / (n * len(right)) if right else None,
        "sampled_accuracy_greedy_wrong": sum(wrong) / (n * len(wrong)) if wrong else None,
        "greedy_wrong": len(wrong),
        "greedy_wrong_reachable": sum(c > 0 for c in wrong),
        "mixed_groups": sum(0 < c < n for c in counts),
    }


def row_line(r: dict) -> str:
    pct = lambda x: "n/a" if x is None else f"{x:.1%}"  # noqa: E731
    return (f"T={r['temperature']:<4} sampled accuracy {pct(r['sampled_accuracy'])} "
            f"(greedy-right tasks {pct(r['sampled_accuracy_greedy_right'])}, greedy-wrong "
            f"{pct(r['sampled_accuracy_greedy_wrong'])}); greedy-wrong tasks with a correct sample: "
            f"{r['greedy_wrong_reachable']} of {r['greedy_wrong']}; mixed groups {r['mixed_groups']} of {r['tasks']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a reflrl train run folder")
    p.add_argument("--checkpoint", default="step_000000", help="checkpoint folder name (step_000000: after the warm-up)")
    p.add_argument("--temperatures", default="1.0,0.7", help="comma-separated sampling temperatures")
    p.add_argument("--n", type=int, default=8, help="answers sampled per task (the GRPO group size)")
    p.add_argument("--split", default="test", choices=("test", "val", "train"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", help="write the rows to this JSON file")
    a = p.parse_args(argv)

    from reflrl.heldout import evaluate, sampled_correct
    from reflrl.train.setup import checkpoint_components, messages_fn

    run = Path(a.run)
    try:
        cfg, splits, comp = checkpoint_components(run, a.checkpoint, a.overrides)
    except FileNotFoundError as e:
        p.error(str(e))
    tasks = splits[a.split]
    mf = messages_fn(cfg)
    t0 = time.perf_counter()
    res = evaluate(comp.eval_engine, comp.tokenizer, tasks, mf, comp.rollout)
    greedy = [bool(r["correct"]) for r in res.per_task]
    print(f"{run} {a.checkpoint}, {a.split} split: greedy accuracy {res.accuracy:.1%} ({sum(greedy)} of {len(greedy)})",
          flush=True)
    rows = []
    for temp in (float(x) for x in a.temperatures.split(",")):
        counts = sampled_correct(comp.engine, comp.tokenizer, tasks, mf, comp.rollout,
                                 n=a.n, temperature=temp, seed=cfg.train.seed)
        rows.append(headroom_row(temp, greedy, counts, a.n))
        print(row_line(rows[-1]), flush=True)
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps({"run": str(run), "checkpoint": a.checkpoint, "greedy": greedy,
                                            "greedy_accuracy": res.accuracy, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
