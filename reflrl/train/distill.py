"""Self-distillation from the critic's feedback (``algo.self_distill``), the trainer's side.

For each failed rollout of a step, the frozen critic's analysis of it (and a correct answer from its
group, when one exists) form SDPO's teacher context c (:func:`reflrl.recovery.distill.teacher_messages`);
the teacher (``algo.self_distill_teacher``: the policy as RL started, or the current policy) re-scores
the rollout's own tokens under c without gradient. Then either

* ``topk`` (default): the policy on q is pulled toward the teacher's top-k next-token distribution at
  each action token by a forward-KL loss (:func:`distill_targets`, :func:`topk_distill_loss`), or
* ``sampled_token`` (SDPO's default): ``log pi_T(y_t|c) - log pi(y_t|q)`` joins each token's advantage
  (:func:`distill_signal`, :func:`reflrl.algos.distill.self_distill_advantages`).

Nothing is generated: it costs forward passes over the failed rollouts, and it gives a signal on the
all-wrong groups where GRPO's advantage is zero. Off by default: on this repository's 135M recipe every
form measured lowered held-out accuracy more than GRPO alone (README, "What was tried").
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from reflrl import rollout as R
from reflrl.algos.distill import self_distill_advantages, topk_forward_kl
from reflrl.critic.base import CritiqueRequest
from reflrl.envs.parsing import parse
from reflrl.recovery.distill import teacher_messages

from .batch import batch_logprobs, make_batch, response_hidden


@dataclass
class Distilled:
    """What :func:`distill_signal` / :func:`distill_targets` found: per-token advantages of the scored
    rollouts (by ``id``; ``sampled_token``) or the teacher's top-k targets (``topk``)."""

    token_adv: dict[int, list[float]] = field(default_factory=dict)
    targets: "TopKTargets | None" = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class TopKTargets:
    """The teacher's top-k next-token log-probs on each scored rollout's action tokens.

    rows:  the rollouts (trained on their OWN prompt q).
    ids:   per rollout, [A, k] long: the teacher's k most likely tokens at each of its A action tokens.
    logp:  per rollout, [A, k] float32: their log-probs under the teacher context (full-vocabulary
           normalised, at the loss temperature)."""

    rows: list[R.Trajectory]
    ids: list[torch.Tensor]
    logp: list[torch.Tensor]

    @property
    def n_tokens(self) -> int:
        return int(sum(x.shape[0] for x in self.ids))


def _on_prompt(t: R.Trajectory, prompt_ids: Sequence[int]) -> R.Trajectory:
    """t's response (ids, loss mask, log-probs) under another prompt, for scoring it there."""
    c = R.Trajectory(task=t.task, group=t.group, prompt_ids=list(prompt_ids))
    c.response_ids, c.loss_mask, c.old_logprobs = list(t.response_ids), list(t.loss_mask), list(t.old_logprobs)
    return c


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
                   temperature: float, clip: float, micro_batch_size: int = 8,
                   teacher: torch.nn.Module | None = None) -> Distilled:
    """Per-token self-distillation advantages of ``scored`` (rollout, teacher prompt ids) pairs, no
    gradient: the student's (``model``, the current policy) log-probs under the rollout's own prompt,
    the teacher's (``teacher``, default the same model) under its teacher prompt, both at the loss's
    ``temperature``. Metrics: ``sd_rollouts``,
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
            as_teacher = [_on_prompt(t, ids) for t, ids in chunk]
            zeros = [0.0] * len(rows)
            with torch.no_grad():
                sb, tb = make_batch(rows, zeros, pad_id), make_batch(as_teacher, zeros, pad_id)
                adv = self_distill_advantages(batch_logprobs(model, sb, temperature),
                                              batch_logprobs(teacher or model, tb, temperature), sb.response_mask, clip)
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


def _action_hidden(model: torch.nn.Module, prompts: Sequence[list[int]], rows: Sequence[R.Trajectory], pad_id: int
                   ) -> tuple[torch.Tensor, list[int]]:
    """Final hidden states that predict each action token of ``rows`` (under ``prompts[i]``), stacked
    row after row: ([sum A_i, H], [A_i per row]). Rows with the same prompt share its forward
    (:func:`reflrl.train.batch.response_hidden`)."""
    as_rows = [_on_prompt(t, p) for p, t in zip(prompts, rows)]
    mb = make_batch(as_rows, [0.0] * len(as_rows), pad_id)
    hid, r, _c = response_hidden(model, mb)
    counts = torch.bincount(r, minlength=len(as_rows)).tolist()
    return hid, counts


def _log_softmax_rows(model: torch.nn.Module, h: torch.Tensor, temperature: float) -> torch.Tensor:
    from reflrl.logprobs import head_of

    _dec, w, b = head_of(model)
    logits = F.linear(h.float(), w.float(), None if b is None else b.float())
    t = temperature if temperature and temperature > 0 else 1.0
    return torch.log_softmax(logits / t, dim=-1)


def distill_targets(model: torch.nn.Module, scored: Sequence[tuple[R.Trajectory, list[int]]], *, pad_id: int,
                    temperature: float, k: int, span: str = "all", micro_batch_size: int = 8) -> Distilled:
    """The teacher's top-``k`` log-probs on every action token of ``scored`` (rollout, teacher prompt ids)
    under ``model`` (the teacher's weights: the current or the frozen policy), no gradient (``topk``
    self-distillation). Metrics: ``sd_rollouts``,
    ``sd_teacher_agree`` (share of action tokens where the teacher's most likely token is the one the
    rollout sampled), ``sd_seconds``."""
    out = Distilled()
    t0 = time.perf_counter()
    if not scored:
        out.metrics.update(sd_rollouts=0.0, sd_seconds=0.0)
        return out
    rows, ids, logp = [], [], []
    agree = n_tok = kept = 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for s in range(0, len(scored), micro_batch_size):
                chunk = scored[s: s + micro_batch_size]
                h, counts = _action_hidden(model, [p for _, p in chunk], [t for t, _ in chunk], pad_id)
                lp = _log_softmax_rows(model, h, temperature)
                v, i = lp.topk(k, dim=-1)
                o = 0
                for (t, _), c in zip(chunk, counts):
                    sampled = torch.tensor([x for x, m in zip(t.response_ids, t.loss_mask) if m], dtype=torch.long)
                    same = i[o: o + c, 0] == sampled
                    agree += int(same.sum())
                    n_tok += c
                    # first_divergence: the tokens up to the first one the teacher would not have chosen;
                    # after it the teacher scores a prefix it already rejects
                    keep = c if span == "all" or bool(same.all()) else int((~same).nonzero()[0]) + 1
                    rows.append(t)
                    ids.append(i[o: o + keep].clone())
                    logp.append(v[o: o + keep].clone())
                    kept += keep
                    o += c
    finally:
        model.train(was_training)
    out.targets = TopKTargets(rows, ids, logp)
    out.metrics.update(sd_rollouts=float(len(rows)), sd_teacher_agree=agree / max(n_tok, 1),
                       sd_token_share=kept / max(n_tok, 1), sd_seconds=time.perf_counter() - t0)
    return out


def topk_distill_loss(model: torch.nn.Module, targets: TopKTargets, idx: Sequence[int], *, pad_id: int,
                      temperature: float, add_tail: bool = True) -> torch.Tensor:
    """Sum over the action tokens of rollouts ``idx`` of the forward KL(teacher || policy on q) on the
    teacher's top-k tokens (:func:`reflrl.algos.distill.topk_forward_kl`), differentiable in the policy."""
    idx = list(idx)
    rows = [targets.rows[i] for i in idx]
    h, counts = _action_hidden(model, [t.prompt_ids for t in rows], rows, pad_id)
    starts = [sum(counts[:j]) for j in range(len(counts))]  # each row's first action token in h
    h = torch.cat([h[s0: s0 + targets.ids[i].shape[0]] for s0, i in zip(starts, idx)])  # the targeted tokens
    ids = torch.cat([targets.ids[i] for i in idx])
    t_lp = torch.cat([targets.logp[i] for i in idx])
    s_lp = _log_softmax_rows(model, h, temperature).gather(-1, ids)
    return topk_forward_kl(s_lp, t_lp, add_tail).sum()
