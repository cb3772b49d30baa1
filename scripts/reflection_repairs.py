"""How often does a critique repair a failure? For a checkpoint of a run (by default the one right after
the warm-up), the held-out tasks the greedy answer gets wrong are critiqued by the rule critic at each
``reflection.reveal`` level, and the policy answers once more, greedily, under q* = [q, thought, failed
action, reflection] (Tool-ReRL sec. 3.2; appendix C's retry prompt, rendered as in training).

    .venv/bin/python scripts/reflection_repairs.py RUN_DIR [--checkpoint step_000000]
        [--reveal none,query,value,call,answer] [--set key=value ...] [--json FILE]

Printed per level: failures repaired (the retry's calls are exactly the gold calls) out of the greedy
failures, and how many retries repeat the failed answer word for word. This is the recovery rate a
reveal level can give before any RL (training samples its retries at the rollout temperature, and RL
changes the policy), the figure behind the recipe's ``reflection.reveal`` choice. No tool runs: a
retry is judged like the held-out evaluation (exact match). The numbers depend on the seed only (quote
the wall time with the machine's CPU kind).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence


def qstar_messages(task: Any, answer: str, critic: Any, messages: list[dict], fmt: str,
                   mode: str = "replace") -> tuple[list[dict] | None, str]:
    """q* for one failed ``answer`` to ``task`` (q = ``messages``), exactly as the repair loop builds it
    (:func:`reflrl.recovery.reflection.reflect_and_retry`): the critic sees the request, the answer, its
    parse and the gold calls; its negative analysis becomes the reflection. Returns (q*, analysis);
    q* is None when the critic gives no reflection (a positive or unparsed critique: nothing to retry)."""
    from reflrl.critic.base import CritiqueRequest
    from reflrl.envs.parsing import parse
    from reflrl.recovery.reflection import Attempt, augmented_messages, split_response

    user = [m for m in messages if m.get("role") == "user"]
    query = str(user[-1].get("content") if user else task.query)
    req = CritiqueRequest(query=query, tools=list(task.tools), response=answer, parse=parse(answer, fmt),
                          gold=list(task.gold[0]) if task.gold else None)
    c = critic.critique(req)
    if c.reflection is None:
        return None, c.analysis
    thought, action = split_response(answer)
    return augmented_messages(messages, [Attempt(thought, action, c.reflection)], mode=mode), c.reflection


def repairs_at_level(evaluate: Callable[..., Any], failures: Sequence[tuple[Any, str]], critic: Any,
                     messages_fn: Callable[[Any], list[dict]], fmt: str, mode: str) -> dict:
    """Greedy retries of ``failures`` ((task, failed answer) pairs) under the critiques of ``critic``.
    ``evaluate(tasks, messages_fn)`` -> per-task records with ``correct`` and ``text`` (the held-out
    evaluation, :func:`reflrl.heldout.evaluate`, on the given messages)."""
    qstars: dict[str, list[dict]] = {}
    unreflected = 0
    for task, answer in failures:
        q, _analysis = qstar_messages(task, answer, critic, messages_fn(task), fmt, mode)
        if q is None:
            unreflected += 1
        else:
            qstars[task.id] = q
    todo = [(t, a) for t, a in failures if t.id in qstars]
    per = evaluate([t for t, _ in todo], lambda t: qstars[t.id]) if todo else []
    repaired = sum(bool(r["correct"]) for r in per)
    same = sum(r["text"].strip() == a.strip() for r, (_t, a) in zip(per, todo))
    return {"failures": len(failures), "reflected": len(todo), "unreflected": unreflected,
            "repaired": repaired, "repeated_failed_answer": same,
            "ratio": repaired / len(failures) if failures else None,
            "repaired_ids": [t.id for r, (t, _a) in zip(per, todo) if r["correct"]]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a reflrl train run folder")
    p.add_argument("--checkpoint", default="step_000000", help="checkpoint folder name (step_000000: after the warm-up)")
    p.add_argument("--reveal", default=None, help="comma-separated reveal levels (default: every level of the rule critic)")
    p.add_argument("--split", default="test", choices=("test", "val", "train"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", help="write the rows to this JSON file")
    a = p.parse_args(argv)

    from reflrl.heldout import evaluate
    from reflrl.recovery.critics import get_critic
    from reflrl.critic.rule import REVEAL_MODES
    from reflrl.train.setup import checkpoint_components, messages_fn

    levels = [x.strip() for x in (a.reveal or ",".join(REVEAL_MODES)).split(",") if x.strip()]
    bad = [x for x in levels if x not in REVEAL_MODES]
    if bad:
        p.error(f"--reveal: unknown level(s) {', '.join(bad)} (levels: {', '.join(REVEAL_MODES)})")
    run = Path(a.run)
    try:
        cfg, splits, comp = checkpoint_components(run, a.checkpoint, a.overrides)
    except FileNotFoundError as e:
        p.error(str(e))
    tasks = splits[a.split]
    mf = messages_fn(cfg)
    fmt = comp.rollout.fmt
    t0 = time.perf_counter()
    res = evaluate(comp.eval_engine, comp.tokenizer, tasks, mf, comp.rollout, keep_texts=True)
    failures = [(t, r["text"]) for t, r in zip(tasks, res.per_task) if not r["correct"]]
    print(f"{run} {a.checkpoint}, {a.split} split: greedy accuracy {res.accuracy:.1%}; {len(failures)} failures "
          f"retried greedily under q* (reflection.mode={cfg.reflection.mode})", flush=True)

    def ev(ts, mfn):
        return evaluate(comp.eval_engine, comp.tokenizer, ts, mfn, comp.rollout, keep_texts=True).per_task

    rows = []
    for level in levels:
        critic = get_critic("rule", reveal=level, parser=cfg.env.parser)
        row = {"reveal": level, **repairs_at_level(ev, failures, critic, mf, fmt, cfg.reflection.mode)}
        rows.append(row)
        print(f"reveal={level:<7} repaired {row['repaired']} of {row['failures']} "
              f"({row['ratio']:.1%}); retries repeating the failed answer: {row['repeated_failed_answer']}"
              + (f"; {row['unreflected']} without a reflection" if row["unreflected"] else ""), flush=True)
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps({"run": str(run), "checkpoint": a.checkpoint, "split": a.split,
                                            "greedy_accuracy": res.accuracy, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
