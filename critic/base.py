"""The critic interface: what a frozen critic is asked and what it answers.

Tool-ReRL (Reflective Reinforcement Tool Learning, sec. 3.2 and appendix C, "Step 2: Critique"): after a
failed attempt, a *frozen* critic scores the response against the ground truth and writes a
one-sentence analysis in the Score/Analysis format::

    Score: negative
    Analysis: The parameter 'trend_type' is valid, but the call is missing the optional field 'language'.

A negative analysis becomes the reflection ``rfl`` of the augmented query ``q* = [q, t, a, rfl]``.

Types here:

- :class:`EnvFault` -- a failure caused by the environment (rate limit, 5xx, timeout, ...), as the
  tool client classified it after its own retries (``reflrl.envs.client.CallOutcome``).
- :class:`CritiqueRequest` -- everything a critic may look at for one attempt.
- :class:`Critique` -- the critic's verdict: score, analysis, raw answer, whether it parsed.
- :class:`Critic` -- the protocol (``critique`` and async ``acritique``).
- :class:`CriticStats` -- counters the caller keeps (calls, unparseable answers, errors, latency).

This module imports nothing heavy (no torch, no openai): critics are usable from the envs side.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from reflrl.envs.types import ParseResult, ToolCall

Score = Literal["positive", "negative"]
SCORES: tuple[str, str] = ("positive", "negative")


@dataclass(frozen=True)
class EnvFault:
    """An environment-caused failure of a tool call (sec. 3.2: "API limits, network disruptions,
    or tool instability ... identified through abnormal tool responses or known error codes").

    kind:          fault kind name (``reflrl.faults.kinds.KIND_NAMES``: "rate_limit", "timeout", ...).
    tool:          the tool that was called ("" when unknown).
    status:        HTTP status the client saw, if any (429, 503, 403, ...).
    retry_after_s: the server's Retry-After in seconds, if it sent one.
    attempts:      billed attempts the client's retry policy already spent on the call.
    detail:        free text from the client (e.g. "ReadTimeout", "renamed temp->temp_v2").
    visible:       the fault came back to the policy as the tool's answer and the policy could have
                   acted on it (``env.fault_exposure="policy"``): the failure is the policy's not
                   calling again, and the call itself was right.
    arguments:     the failed call's arguments (visible faults), to name the call to make again.
    also:          further visible faults of the same answer (a parallel answer's other failed calls).
    param, new:    an API change's record from the server (param_renamed: the parameter's old and
                   new name; tool_moved: param None, new the successor tool).
    """

    kind: str
    tool: str = ""
    status: int | None = None
    retry_after_s: float | None = None
    attempts: int = 1
    detail: str = ""
    visible: bool = False
    arguments: dict[str, Any] | None = None
    also: tuple["EnvFault", ...] = ()
    param: str | None = None
    new: str | None = None


@dataclass
class CritiqueRequest:
    """What a critic gets for one attempt.

    query:     the task's user request (the original ``q``).
    tools:     the tool schemas offered to the policy (OpenAI/BFCL function style).
    response:  the policy's full response text (thought ``t`` + action ``a``).
    parse:     the env's ParseResult of ``response`` (None: the critic parses it itself, "auto").
    gold:      the ground-truth calls of this turn (appendix C: the critic sees the ground truth);
               required by the rule critic, optional for model critics.
    env_fault: set when the attempt failed because of the environment, not the policy.
    api_changes: the server's record of the API changes the episode met (``ToolCallEnv``'s
               ``info["api_changes"]``: kind, tool, param, new); a critic that states the call to make
               states it as the tool now takes it (``reflrl.critic.format.adapt_calls``).
    """

    query: str
    tools: list[dict[str, Any]] = field(default_factory=list)
    response: str = ""
    parse: ParseResult | None = None
    gold: list[ToolCall] | None = None
    env_fault: EnvFault | None = None
    api_changes: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Critique:
    """A critic's verdict (appendix C format).

    score:     "positive" | "negative". An unparseable critic answer is "negative".
    analysis:  the one-sentence analysis; "" when the answer did not parse (no reflection).
    raw:       the critic's raw answer text (for the logs; "" for the rule critic's own text).
    parsed:    False when the critic's answer was not in the Score/Analysis format, or the critic
               endpoint failed after its retries (then ``error`` says why).
    latency_s: wall time of the critique (model call included).
    error:     transport error after retries, if any (counted as a critic error by the caller).
    """

    score: Score
    analysis: str
    raw: str = ""
    parsed: bool = True
    latency_s: float = 0.0
    error: str | None = None

    @property
    def positive(self) -> bool:
        return self.score == "positive"

    @property
    def reflection(self) -> str | None:
        """The reflection to put into q*: the analysis of a parsed negative critique, else None."""
        if self.score == "negative" and self.parsed and self.analysis:
            return self.analysis
        return None


@runtime_checkable
class Critic(Protocol):
    """A frozen critic (sec. 3.2 "reflection module"; appendix C "frozen critic model")."""

    name: str

    def critique(self, request: CritiqueRequest) -> Critique:
        """Score one attempt. Never raises for bad *model output* (an unparseable answer gives
        ``parsed=False``); may raise ValueError for a bad *request* (e.g. no gold for the rule
        critic) or a misconfigured endpoint."""
        ...

    async def acritique(self, request: CritiqueRequest) -> Critique:
        """Async :meth:`critique`."""
        ...


class SyncCritic:
    """Base for critics whose work is synchronous: ``acritique`` runs ``critique`` in a thread
    (so a slow critic does not block the rollout's event loop)."""

    name = "sync"

    def critique(self, request: CritiqueRequest) -> Critique:  # pragma: no cover - abstract
        raise NotImplementedError

    async def acritique(self, request: CritiqueRequest) -> Critique:
        return await asyncio.to_thread(self.critique, request)


def unparsed(raw: str, latency_s: float = 0.0, error: str | None = None) -> Critique:
    """The critique of an answer that did not parse (or of a failed endpoint): negative, no
    analysis, ``parsed=False`` -- "counted and treated as negative with no reflection"."""
    return Critique("negative", "", raw=raw, parsed=False, latency_s=latency_s, error=error)


@dataclass
class CriticStats:
    """Counters over critiques, for the run's metrics (critic calls and
    their latency). ``record`` every critique the run makes."""

    calls: int = 0
    positive: int = 0
    negative: int = 0
    unparseable: int = 0
    errors: int = 0
    latency_s: float = 0.0
    max_latency_s: float = 0.0

    def record(self, c: Critique) -> Critique:
        self.calls += 1
        if c.positive:
            self.positive += 1
        else:
            self.negative += 1
        if c.error is not None:
            self.errors += 1
        elif not c.parsed:
            self.unparseable += 1
        lat = c.latency_s if math.isfinite(c.latency_s) else 0.0
        self.latency_s += lat
        self.max_latency_s = max(self.max_latency_s, lat)
        return c

    def as_metrics(self, prefix: str = "critic/") -> dict[str, float]:
        mean = self.latency_s / self.calls if self.calls else 0.0
        return {
            f"{prefix}calls": float(self.calls),
            f"{prefix}positive": float(self.positive),
            f"{prefix}negative": float(self.negative),
            f"{prefix}unparseable": float(self.unparseable),
            f"{prefix}errors": float(self.errors),
            f"{prefix}latency_mean_s": mean,
            f"{prefix}latency_max_s": self.max_latency_s,
        }
