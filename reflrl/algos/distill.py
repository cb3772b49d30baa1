"""Self-distillation advantages: the policy conditioned on feedback is its own teacher.

SDPO ("Reinforcement Learning via Self-Distillation", Hübotter et al., arXiv:2601.20802, sec. 3)
turns rich feedback into a dense, token-level signal: the same model re-reads a rollout y it sampled
under the prompt q, this time under a *teacher* prompt that also holds feedback on y (and a correct
answer when one exists); its next-token log-probs there are distilled back into the policy on q.
The sampled-token form of the reverse KL (TRL's ``sdpo`` trainer, ``distillation_mode="sampled_token"``)
is the loss ``sg(log pi(y_t|q) - log pi_T(y_t|c)) * log pi(y_t|q)``, whose gradient is a policy
gradient with the per-token advantage

    A_t = log pi_T(y_t | c, y_<t) - log pi(y_t | q, y_<t)          (teacher minus student)

so a token the feedback-informed teacher finds less likely than the student did is pushed down, one it
finds more likely is pushed up, and tokens both agree on get ~0. That is what GRPO lacks on an
all-wrong group (advantage 0 everywhere): there the teacher still says WHERE the answer went wrong.

:func:`self_distill_advantages` is that advantage as a pure function, clamped to ``[-clip, clip]``
(a token the teacher rules out would otherwise get an unbounded push) and zero off the mask; the
trainer adds ``coef * A_t`` to the rollout's GRPO advantage, SDPO's blend
``A = lambda A_GRPO + (1 - lambda) A_SDPO`` up to the scale of the two terms.
"""
from __future__ import annotations

import torch

from .masked import as_bool_mask


def self_distill_advantages(student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor,
                            response_mask: torch.Tensor, clip: float = 5.0) -> torch.Tensor:
    """Per-token self-distillation advantages.

    student_log_prob: [B, T] log pi(y_t | q, y_<t) of the sampled tokens under the policy's prompt.
    teacher_log_prob: [B, T] log pi_T(y_t | c, y_<t) of the same tokens under the teacher prompt c.
    response_mask:    [B, T] 1 on the trained (action) tokens.
    Returns [B, T] float32: ``clamp(teacher - student, -clip, clip)`` on the mask, 0 elsewhere.
    Raises ValueError for mismatched shapes or a non-positive ``clip``.
    """
    if student_log_prob.shape != teacher_log_prob.shape or student_log_prob.shape != response_mask.shape:
        raise ValueError(f"shapes differ: student {tuple(student_log_prob.shape)}, teacher "
                         f"{tuple(teacher_log_prob.shape)}, mask {tuple(response_mask.shape)}")
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    mask = as_bool_mask(response_mask)
    diff = (teacher_log_prob.float() - student_log_prob.float()).clamp(-clip, clip)
    return torch.where(mask, diff, torch.zeros_like(diff))


def topk_forward_kl(student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor, add_tail: bool = True
                    ) -> torch.Tensor:
    """Per-token forward KL(teacher || student) on the teacher's top-k tokens.

    student_log_prob, teacher_log_prob: [N, k] full-vocabulary log-probs of the SAME k token ids per
    row (the teacher's top k at that position). ``add_tail`` appends one bucket holding each side's
    remaining mass (``log(1 - sum p)``), so the divergence approximates the full-vocabulary one (TRL's
    ``distillation_add_tail``); without it both sides are renormalised over the k tokens.
    Returns [N] float32 ``sum_v p_T(v) (log p_T(v) - log p_S(v))`` (>= 0; its gradient in the
    student is ``-(p_T - p_S)`` on the logits of the support, so it pulls probability toward the
    tokens the teacher prefers, sampled or not: the distributional-DAgger / forward cross-entropy
    objective of arXiv:2606.05152, and SDPO's logit-level distillation with alpha = 0).
    """
    if student_log_prob.shape != teacher_log_prob.shape or student_log_prob.dim() != 2:
        raise ValueError(f"expected two [N, k] tensors of one shape, got {tuple(student_log_prob.shape)} and "
                         f"{tuple(teacher_log_prob.shape)}")
    s, t = student_log_prob.float(), teacher_log_prob.float()
    if add_tail:
        s, t = _with_tail(s), _with_tail(t)
    else:
        s = s - torch.logsumexp(s, dim=-1, keepdim=True)
        t = t - torch.logsumexp(t, dim=-1, keepdim=True)
    return (t.exp() * (t - s)).sum(-1)


def _with_tail(log_p: torch.Tensor) -> torch.Tensor:
    """[N, k] log-probs -> [N, k + 1] with the leftover mass ``1 - sum p`` as the last bucket."""
    mass = torch.logsumexp(log_p, dim=-1, keepdim=True).clamp(max=-1e-6)
    return torch.cat([log_p, torch.log(-torch.expm1(mass))], dim=-1)
