"""The self-teacher's prompt for self-distillation (``algo.self_distill``): SDPO's reprompt.

SDPO ("Reinforcement Learning via Self-Distillation", arXiv:2601.20802, sec. 3) re-scores a rollout y
of prompt q under a teacher context c = q + a correct solution (another rollout of the same group that
succeeded, when there is one) + the feedback on y, and distills the teacher's next-token predictions
back into the policy on q (:func:`reflrl.algos.distill.self_distill_advantages`). Here the feedback is
the frozen critic's analysis of y (:mod:`reflrl.critic`): the rule critic sees the ground truth, as
Tool-ReRL's critic does (appendix C), so the policy's prompt q never carries it; only the teacher
context does. Unlike Tool-ReRL's q* (:func:`reflrl.recovery.reflection.augmented_messages`), c does not
quote the failed attempt: y is what the teacher scores, and a small policy shown its own attempt tends
to copy it (README: retries under q* repeat the failed answer word for word).

Pure: no torch, no trainer imports.
"""
from __future__ import annotations

from typing import Any

# SDPO's templates (TRL ``SDPOConfig`` defaults: reprompt_template, solution_template, feedback_template)
SOLUTION_TEMPLATE = "\nCorrect solution:\n\n{solution}\n\n"
FEEDBACK_TEMPLATE = "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback}\n\n"
REPROMPT_TEMPLATE = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n"


def teacher_messages(task_messages: list[dict[str, Any]], *, feedback: str | None = None,
                     solution: str | None = None) -> list[dict[str, Any]]:
    """The teacher context c as chat messages: ``task_messages`` (q) with its last user message
    rewritten by SDPO's reprompt template around ``solution`` (a correct answer of the same task) and
    ``feedback`` (the critic's analysis of the rollout being scored). Raises ValueError when both are
    missing (the teacher would be the student) or q has no user message. Returns new dicts."""
    if not (feedback and feedback.strip()) and not (solution and solution.strip()):
        raise ValueError("a teacher context needs feedback, a correct solution, or both")
    msgs = [dict(m) for m in task_messages]
    users = [i for i, m in enumerate(msgs) if m.get("role") == "user"]
    if not users:
        raise ValueError("the messages have no user message to reprompt")
    i = users[-1]
    sol = SOLUTION_TEMPLATE.format(solution=solution.strip()) if solution and solution.strip() else ""
    fb = FEEDBACK_TEMPLATE.format(feedback=" ".join(feedback.split())) if feedback and feedback.strip() else ""
    msgs[i]["content"] = REPROMPT_TEMPLATE.format(prompt=str(msgs[i].get("content") or ""), solution=sol, feedback=fb)
    return msgs
