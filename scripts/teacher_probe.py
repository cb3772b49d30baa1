"""Does the self-teacher of self-distillation (``algo.self_distill``) point toward the right answer?

    .venv/bin/python scripts/teacher_probe.py RUN_DIR [--checkpoint step_000000] [--reveal answer]
                                              [--set key=value ...] [--json FILE]

For each held-out task whose greedy answer is wrong, the policy re-scores that answer twice: under
its own prompt q (the student) and under the teacher prompt that self-distillation builds from the rule
critic's analysis (:func:`reflrl.recovery.distill.teacher_messages`). At the first token where the
failed answer leaves the gold answer, the script asks:

* is the teacher's most likely token there the gold token? And the student's?
* does the teacher give the failed token a lower log-prob than the student?

It also prints the summed teacher-minus-student log-prob of the failed and of the gold answer. A teacher
that is right at the divergence is what self-distillation relies on. The numbers depend on the seed only.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence


def divergence(failed: Sequence[int], gold: Sequence[int]) -> int:
    """Index of the first token where ``failed`` and ``gold`` differ (the shorter length if one is a
    prefix of the other)."""
    return next((k for k in range(min(len(failed), len(gold))) if failed[k] != gold[k]), min(len(failed), len(gold)))


def summary_line(rows: list[dict]) -> str:
    n = len(rows)
    if not n:
        return "no greedy failures"
    mean = lambda k: sum(r[k] for r in rows) / n  # noqa: E731
    return (f"{n} greedy failures: at the first token off the gold answer the teacher's top token is gold in "
            f"{sum(r['teacher_top_is_gold'] for r in rows)} (the student's in {sum(r['student_top_is_gold'] for r in rows)}), "
            f"and it lowers the failed token in {sum(r['teacher_lowers_failed'] for r in rows)}; teacher minus student "
            f"log-prob, summed: failed answer {mean('failed_delta'):+.2f}, gold answer {mean('gold_delta'):+.2f} (mean)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a reflrl train run folder")
    p.add_argument("--checkpoint", default="step_000000", help="checkpoint folder name (step_000000: after the warm-up)")
    p.add_argument("--reveal", default="answer", help="the rule critic's reveal level for the teacher prompt")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", help="write the per-task rows to this JSON file")
    a = p.parse_args(argv)

    import torch

    from reflrl import rollout as R
    from reflrl.critic.base import CritiqueRequest
    from reflrl.envs.parsing import format_calls, parse
    from reflrl.heldout import evaluate
    from reflrl.recovery import get_critic
    from reflrl.recovery.distill import teacher_messages
    from reflrl.train.setup import answer_format, checkpoint_components, messages_fn

    run = Path(a.run)
    try:
        cfg, splits, comp = checkpoint_components(run, a.checkpoint, a.overrides)
    except FileNotFoundError as e:
        p.error(str(e))
    tasks = splits["test"]
    mf, tok, model, fmt = messages_fn(cfg), comp.tokenizer, comp.model, answer_format(cfg)
    critic = get_critic("rule", reveal=a.reveal)
    end = [tok.eos_token_id] if tok.eos_token_id is not None else []
    t0 = time.perf_counter()
    res = evaluate(comp.eval_engine, tok, tasks, mf, comp.rollout, keep_texts=True)

    def scores(prompt: list[int], resp: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([prompt + resp])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1: len(prompt) - 1 + len(resp)].float(), -1)
        return lp.gather(-1, torch.tensor(resp)[:, None])[:, 0], lp.argmax(-1)

    rows = []
    for t, r in zip(tasks, res.per_task):
        if r["correct"] or not t.gold:
            continue
        text, gold = r["text"], list(t.gold[0])
        c = critic.critique(CritiqueRequest(query=t.query, tools=list(t.tools), response=text, parse=parse(text, fmt), gold=gold))
        if c.positive or not c.analysis:  # nothing for a teacher to go on
            continue
        q = R.render_prompt(tok, mf(t))
        teacher = R.render_prompt(tok, teacher_messages(mf(t), feedback=c.analysis))
        failed = tok(text, add_special_tokens=False)["input_ids"] + end
        right = tok(format_calls(gold, fmt), add_special_tokens=False)["input_ids"] + end
        fs, s_top = scores(q, failed)
        ft, t_top = scores(teacher, failed)
        gs, _ = scores(q, right)
        gt, _ = scores(teacher, right)
        d = divergence(failed, right)
        rows.append({"task": t.id, "divergence": d, "tokens": len(failed),
                     "teacher_top_is_gold": bool(d < len(right) and d < len(failed) and int(t_top[d]) == right[d]),
                     "student_top_is_gold": bool(d < len(right) and d < len(failed) and int(s_top[d]) == right[d]),
                     "teacher_lowers_failed": bool(d < len(failed) and float(ft[d]) < float(fs[d])),
                     "failed_delta": float((ft - fs).sum()), "gold_delta": float((gt - gs).sum())})
    print(f"{run} {a.checkpoint}: greedy accuracy {res.accuracy:.1%}; reveal={a.reveal}")
    print(summary_line(rows))
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps({"run": str(run), "checkpoint": a.checkpoint, "reveal": a.reveal,
                                            "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
