"""The critics a reflection can come from, by name, and the critic of each variant."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reflrl.critic.base import Critic, Critique, CritiqueRequest, SyncCritic
from reflrl.critic.format import format_critique
from reflrl.registry import Registry

if TYPE_CHECKING:
    from reflrl.config import Config

from .reflection import split_response
from .variants import variant_of

CRITICS: Registry = Registry("critic")  # name -> factory(**kwargs) -> Critic


@CRITICS.register("rule")
def _rule(**kw: Any) -> Critic:
    """The embedded rule critic: compares with the ground truth, no model (reflrl.critic.rule)."""
    from reflrl.critic.rule import RuleCritic

    return RuleCritic(**kw)


@CRITICS.register("llm")
def _llm(**kw: Any) -> Critic:
    """A model behind an OpenAI-compatible endpoint (reflrl.critic.llm; imports openai lazily)."""
    try:
        from reflrl.critic.llm import LLMCritic
    except ModuleNotFoundError as e:
        if e.name in ("openai", "tenacity"):
            raise ModuleNotFoundError(f"the 'llm' critic needs the {e.name!r} package: pip install {e.name}",
                                      name=e.name) from e
        raise
    return LLMCritic(**kw)


@CRITICS.register("policy")
def _policy(**kw: Any) -> Critic:
    """The policy model itself (Table 2's "Internal" ablation, Tool-ReRL sec. 4.3; reflrl.critic.policy)."""
    from reflrl.critic.policy import PolicyCritic

    return PolicyCritic(**kw)


def get_critic(name: str, **kwargs: Any) -> Critic:
    """Build the critic registered as ``name`` with ``kwargs`` (UnknownName with a suggestion for an
    unknown name, TypeError naming the bad keyword for a wrong argument)."""
    return CRITICS.build(name, **kwargs)


EXTERNAL_INSTRUCTION = (
    "You are an expert tool-use assistant. Given an agent response to a user request and the ground "
    "truth, reason step by step about how the request should be answered with the available tools: "
    "which tool to call and how to fill each argument from the request.\n"
    "\n"
    "Format your answer as follows:\n"
    "Score: positive or negative\n"
    "Analysis: your step-by-step reasoning about how to answer the request, in a few sentences, "
    "avoiding bullet points."
)


class SelfThoughtCritic(SyncCritic):
    """``cot_is`` (sec. 4.2.2): q* is formed with the model's OWN thought, no external feedback.

    The verdict (positive/negative) is the ground-truth comparison of ``judge`` (the rule critic: the
    same check as the env's exact-match reward), so retries still stop at the first valid one; the
    analysis put into q* is the failed response's own ``<think>`` text ("Your own reasoning was: ..."),
    or a bare "The answer was not accepted." when it had none. An env fault keeps its description:
    it is what the tool answered, not reasoning.
    """

    name = "self"

    def __init__(self, judge: Any):
        self.judge = judge

    def critique(self, request: CritiqueRequest) -> Critique:
        c = self.judge.critique(request)
        if c.positive or request.env_fault is not None:
            return c
        thought, _ = split_response(request.response)
        analysis = f"Your own reasoning was: {thought}" if thought else "The answer was not accepted."
        return Critique("negative", analysis, raw=format_critique("negative", analysis), parsed=True,
                        latency_s=c.latency_s)


def uses_endpoint(cfg: Config) -> bool:
    """Whether ``cfg``'s variant asks a critic endpoint (``reflection.critic_base_url``): the 'llm'
    critic of a reflecting variant, or the ``external*`` variants."""
    v = variant_of(cfg)
    return v.reflect and (v.source == "external" or (v.source == "critic" and cfg.reflection.critic == "llm"))


def check_endpoint(critic: Any) -> Any:
    """Check at start that an endpoint critic's endpoint answers and serves its model (``GET /v1/models``);
    with ``reflection.critic_model`` null the one model it serves becomes the critic's. Returns
    ``critic``; raises :class:`~reflrl.errors.UserError` (one line: the URL, the model asked, the
    models served). An outage later in the run is counted per critique and the run goes on."""
    import openai

    from reflrl.errors import UserError

    url = critic.base_url or "(the openai default)"
    asked = "null (the one model it serves)" if critic.model is None else repr(critic.model)
    where = f"the critic endpoint reflection.critic_base_url={url}"
    try:
        served = critic.served_models()
    except (openai.APIConnectionError, openai.APITimeoutError) as e:
        raise UserError(f"{where} does not answer ({type(e).__name__}: {e}); start it (e.g. python -m "
                        f"reflrl.chat_server --model NAME) or fix the URL; reflection.critic_model={asked}") from None
    except openai.APIStatusError as e:
        raise UserError(f"{where} answered GET /models with HTTP {e.status_code} (is it an OpenAI-compatible "
                        f"/v1 URL?); reflection.critic_model={asked}") from None
    if critic.model is None and len(served) == 1:
        critic.model = served[0]
    elif critic.model is None:
        raise UserError(f"{where} serves {served}, not one model: set reflection.critic_model to the one to use")
    elif critic.model not in served:
        raise UserError(f"{where} does not serve reflection.critic_model={asked}; it serves {served}: set "
                        "reflection.critic_model to one of them (or null: the one model it serves)")
    return critic


def build_critic(cfg: Config, engine: Any = None, tokenizer: Any = None) -> Any:
    """The critic of ``cfg``'s variant (module doc): rule / llm / policy, self-thought for ``cot_is``,
    the LLM endpoint with :data:`EXTERNAL_INSTRUCTION` for ``external*``. An endpoint critic is checked
    now (:func:`check_endpoint`: a UserError before the first step)."""
    f, v = cfg.reflection, variant_of(cfg)
    if v.source == "self":
        return SelfThoughtCritic(get_critic("rule", reveal=f.reveal, parser=cfg.env.parser))
    if v.source == "external":
        return check_endpoint(get_critic("llm", base_url=f.critic_base_url, model=f.critic_model,
                                         timeout=f.critic_timeout_s, instruction=EXTERNAL_INSTRUCTION, max_tokens=320))
    if f.critic == "rule":
        return get_critic("rule", reveal=f.reveal, parser=cfg.env.parser)
    if f.critic == "llm":
        return check_endpoint(get_critic("llm", base_url=f.critic_base_url, model=f.critic_model,
                                         timeout=f.critic_timeout_s))
    from reflrl.critic.policy import chat_generate_fn

    return get_critic("policy", generate=chat_generate_fn(engine, tokenizer), as_messages=True)
