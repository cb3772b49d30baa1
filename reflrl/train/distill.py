"""Self-distillation from the critic's feedback (``algo.self_distill``), the trainer's side.

For each failed rollout of a step, the frozen critic's analysis of it (and a correct answer from its
group, when one exists) form SDPO's teacher context c (:func:`reflrl.recovery.distill.teacher_messages`);
the current policy re-scores the rollout's own tokens under c without gradient, and the per-token
``log pi(y_t|c) - log pi(y_t|q)`` (:func:`reflrl.algos.distill.self_distill_advantages`) joins the
rollout's advantage. Nothing is generated: it costs two forward passes over the failed rollouts, and it
gives a signal on the all-wrong groups where GRPO's advantage is zero.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from reflrl import rollout as R
from reflrl.algos.distill import self_distill_advantages
from reflrl.critic.base import CritiqueRequest
from reflrl.envs.parsing import parse
from reflrl.recovery.distill import teacher_messages

from .batch import batch_logprobs, make_batch


@dataclass
class Distilled:
    """What :func:`distill_signal` found: per-token advantages of the scored rollouts (by ``id``)."""

    token_adv: dict[int, list[float]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


def _solution(group: Sequence[R.Trajectory], t: R.Trajectory) -> str | None:
    """A correct answer of t's task from its group (the first one; a repair counts), not t itself."""
    for o in group:
        if o is not t and o.correct and not o.masked and o.texts:
            return o.texts[-1]
    return None


def teacher_prompts(groups: Sequence[Sequence[R.Trajectory]], *, critic: Any, messages_of: Callable[[Any], list[dict]],
                    render: Callable[[list[dict]], list[int]], fmt: str
                    ) -> list[tuple[R.Trajectory, list[int]]]:
    """(rollout, teacher prompt ids) for every failed, live, single-turn rollout of ``groups`` with a
    critique or a correct peer. The critic sees the task's gold calls (as Tool-ReRL's critic does);
    a positive verdict with no peer solution gives nothing to distill, so the rollout is skipped."""
    out = []
    for grp in groups:
        for t in grp:
            if t.correct or t.masked or t.turns != 1 or len(t.texts) != 1 or t.n_action_tokens == 0:
                continue
            text = t.texts[0]
            gold = list(t.task.gold[0]) if t.task.gold else None
            c = critic.critique(CritiqueRequest(query=t.task.query, tools=list(t.task.tools), response=text,
                                                parse=parse(text, fmt), gold=gold))
            feedback = c.analysis if not c.positive else None
            sol = _solution(grp, t)
            if not feedback and not sol:
                continue
            out.append((t, render(teacher_messages(messages_of(t.task), feedback=feedback, solution=sol))))
    return out


def distill_signal(model: torch.nn.Module, scored: Sequence[tuple[R.Trajectory, list[int]]], *, pad_id: int,
                   temperature: float, clip: float, micro_batch_size: int = 8) -> Distilled:
    """Per-token self-distillation advantages of ``scored`` (rollout, teacher prompt ids) pairs under the
    CURRENT policy (no gradient): the student's log-probs under the rollout's own prompt, the teacher's
    under its teacher prompt, both at the loss's ``temperature``. Metrics: ``sd_rollouts``,
    ``sd_adv_mean`` / ``sd_neg_frac`` (over their action tokens), ``sd_seconds``."""
    out = Distilled()
    if not scored:
        out.metrics.update(sd_rollouts=0.0, sd_seconds=0.0)
        return out
    t0 = time.perf_counter()
    tot = neg = 0.0
    n_tok = 0.0
    was_training = model.training
    model.eval()
    try:
        for s in range(0, len(scored), micro_batch_size):
            chunk = scored[s: s + micro_batch_size]
            rows = [t for t, _ in chunk]
            as_teacher = []
            for t, ids in chunk:
                c = R.Trajectory(task=t.task, group=t.group, prompt_ids=list(ids))
                c.response_ids, c.loss_mask, c.old_logprobs = list(t.response_ids), list(t.loss_mask), list(t.old_logprobs)
                as_teacher.append(c)
            zeros = [0.0] * len(rows)
            with torch.no_grad():
                sb, tb = make_batch(rows, zeros, pad_id), make_batch(as_teacher, zeros, pad_id)
                adv = self_distill_advantages(batch_logprobs(model, sb, temperature),
                                              batch_logprobs(model, tb, temperature), sb.response_mask, clip)
            mask = sb.response_mask.bool()
            tot += float(adv[mask].sum())
            neg += float((adv[mask] < 0).sum())
            n_tok += float(mask.sum())
            for i, t in enumerate(rows):
                out.token_adv[id(t)] = [float(x) for x in adv[i, : len(t.response_ids)]]
    finally:
        model.train(was_training)
    out.metrics.update(sd_rollouts=float(len(scored)), sd_adv_mean=tot / max(n_tok, 1.0),
                       sd_neg_frac=neg / max(n_tok, 1.0), sd_seconds=time.perf_counter() - t0)
    return out
