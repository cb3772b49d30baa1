"""Frozen critics that score a failed attempt and write a reflection (Tool-ReRL, appendix C).

    from reflrl.critic import RuleCritic, CritiqueRequest
    critic = RuleCritic()                            # embedded default, no model
    c = critic.critique(CritiqueRequest(query=q, response=text, parse=pr, gold=gold_calls))
    c.score, c.analysis, c.reflection                # "negative", "The call to `f` is missing ..."

See :mod:`reflrl.critic.base` (types), :mod:`.format` (appendix C prompt, strict parser),
:mod:`.rule`, :mod:`.llm`, :mod:`.policy`. The critics by name (``rule`` / ``llm`` / ``policy``)
are a registry of the trainer's: ``reflrl.recovery.critics.get_critic`` (this package never imports
the core).
"""
from .base import Critic, CriticStats, Critique, CritiqueRequest, EnvFault, SyncCritic, unparsed
from .format import (
    CRITIC_INSTRUCTION,
    EVALUATION_TEMPLATE,
    ParsedCritique,
    critic_messages,
    describe_env_fault,
    format_critique,
    parse_critique,
    render_evaluation,
    render_ground_truth,
)
from .rule import RuleCritic

__all__ = [
    "CRITIC_INSTRUCTION", "EVALUATION_TEMPLATE", "Critic", "CriticStats", "Critique", "CritiqueRequest",
    "EnvFault", "ParsedCritique", "RuleCritic", "SyncCritic", "critic_messages", "describe_env_fault",
    "format_critique", "parse_critique",
    "render_evaluation", "render_ground_truth", "unparsed",
]
