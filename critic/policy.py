"""The policy model itself as critic ("internal" reasoning; Table 2 ablation).

Tool-ReRL's ablation (Tool-ReRL, sec. 4.3, Table 2) compares reasoning produced
by the policy itself ("Internal") with reasoning from an external model ("External"). This critic
sends the same appendix C prompt as :class:`reflrl.critic.llm.LLMCritic` to the policy being
trained, through a ``generate`` callable, so this module never imports the trainer or torch.

``generate`` receives the prompt and returns the answer text; it may be a plain function or a
coroutine function. With ``as_messages=False`` (default) the prompt is ONE string (the critic
instruction, a blank line, the filled evaluation template); with ``as_messages=True`` it is the
chat messages ``[system: instruction, user: evaluation]`` (for a callable that applies the chat
template itself). The answer is parsed strictly; an unparseable answer (a small policy's usual
output) is negative with no reflection and ``parsed=False``, never an exception. Exceptions
raised BY ``generate`` propagate (they are the caller's bugs, not model output).
"""
from __future__ import annotations

import inspect
import time
from typing import Any, Callable

from .base import Critique, CritiqueRequest
from .format import CRITIC_INSTRUCTION, adapt_calls, critic_messages, critique_from_text, fault_critique


class PolicyCritic:
    """Critic that asks the policy model (or any text generator) through ``generate``.

    Args:
        generate: ``prompt -> text`` (sync or async); see the module doc for the prompt type.
        as_messages: pass chat messages instead of one string.
        show_gold: include the gold calls (appendix C's template does).
        instruction: the system instruction (appendix C's critic instruction by default).
    """

    name = "policy"

    def __init__(self, generate: Callable[[Any], Any], *, as_messages: bool = False,
                 show_gold: bool = True, instruction: str = CRITIC_INSTRUCTION) -> None:
        if not callable(generate):
            raise TypeError("PolicyCritic needs a generate callable (prompt -> text)")
        self.generate = generate
        self.as_messages = as_messages
        self.show_gold = show_gold
        self.instruction = instruction

    def prompt(self, request: CritiqueRequest) -> Any:
        """What ``generate`` receives for ``request`` (a string or chat messages)."""
        gold = adapt_calls(request.gold, request.api_changes) if self.show_gold and request.gold else None
        msgs = critic_messages(request.response, gold, request.query, self.instruction)
        if self.as_messages:
            return msgs
        return msgs[0]["content"] + "\n\n" + msgs[1]["content"]

    def critique(self, request: CritiqueRequest) -> Critique:
        """Score one attempt with the policy. An async ``generate`` must use :meth:`acritique`."""
        t0 = time.perf_counter()
        if request.env_fault is not None:
            return fault_critique(request.env_fault, t0)
        out = self.generate(self.prompt(request))
        if inspect.isawaitable(out):
            close = getattr(out, "close", None)
            if close is not None:
                close()
            raise TypeError("generate is async: call acritique() instead of critique()")
        return critique_from_text(out, t0)

    async def acritique(self, request: CritiqueRequest) -> Critique:
        t0 = time.perf_counter()
        if request.env_fault is not None:
            return fault_critique(request.env_fault, t0)
        out = self.generate(self.prompt(request))
        if inspect.isawaitable(out):
            out = await out
        return critique_from_text(out, t0)


def chat_generate_fn(engine: Any, tokenizer: Any, *, max_new_tokens: int = 96, temperature: float = 0.0,
                     seed: int = 0) -> Callable[[list[dict[str, str]]], str]:
    """A ``generate`` for :class:`PolicyCritic` (``as_messages=True``) from a rollout engine.

    ``engine`` follows ``reflrl.engines.base.RolloutEngine`` (e.g. the trainer's TransformersEngine, so
    the critic is the current policy); the messages are rendered with the tokenizer's chat
    template; greedy by default (a critic should answer consistently). Returns the decoded text
    without special tokens. Nothing is imported here: the objects are passed in.
    """
    def generate(messages: list[dict[str, str]]) -> str:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        sample = engine.generate([list(ids)], n=1, max_new_tokens=max_new_tokens,
                                 temperature=temperature, seed=seed)[0]
        return tokenizer.decode(sample.token_ids, skip_special_tokens=True)

    return generate

