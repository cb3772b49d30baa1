"""The LLM critic: appendix C's critic prompt sent to any OpenAI-compatible endpoint.

Tool-ReRL (Reflective Reinforcement Tool Learning, appendix C) scores attempts with "a frozen critic model"
given the critic instruction (system message) and the evaluation template with the response and
the ground truth (user message); the answer is parsed STRICTLY in the Score/Analysis format
(:func:`reflrl.critic.format.parse_critique`).

Works with vLLM, llama.cpp's server, ``python -m reflrl.chat_server`` (the project's own local
endpoint) or a hosted API, through the official ``openai`` client.

Failure handling:

- transient errors (connection errors, timeouts, HTTP 408/409/429 and 5xx) are retried with
  tenacity (exponential backoff with jitter; a server's ``Retry-After`` is honoured up to
  ``max_wait``). The ``openai`` client's own retries are switched off so the policy is in one place;
- when the retries are used up, the critique is negative with no reflection, ``parsed=False`` and
  ``error`` set: the caller counts it (``CriticStats.errors``) and the run goes on;
- an answer that is not in the format is negative with no reflection and ``parsed=False``
  (counted and treated as negative with no reflection, never as a crash);
- any other HTTP error (401 bad key, 404 unknown model, 400 bad request) is a configuration
  mistake and raises :class:`CriticEndpointError` naming the endpoint, model and status.

Env faults are described without a model call (:func:`reflrl.critic.format.describe_env_fault`):
the failure is not the policy's and the description is exact.
"""
from __future__ import annotations

import os
import time
from typing import Any

import openai
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)

from reflrl.envs.client import parse_retry_after

from .base import Critique, CritiqueRequest, unparsed
from .format import CRITIC_INSTRUCTION, adapt_calls, critic_messages, critique_from_text, fault_critique

TRANSIENT_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})


class CriticEndpointError(RuntimeError):
    """The critic endpoint refused the request for a non-transient reason (configuration)."""


def is_transient(exc: BaseException) -> bool:
    """Whether an ``openai`` exception is worth retrying: connection errors, timeouts, 408, 409,
    429 and 5xx."""
    if isinstance(exc, (openai.APIConnectionError, openai.APITimeoutError)):  # timeout subclasses it
        return True
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code in TRANSIENT_STATUS or exc.status_code >= 500
    return False


class LLMCritic:
    """Critic backed by a chat model behind an OpenAI-compatible endpoint (module doc).

    Args:
        base_url: e.g. ``http://127.0.0.1:8000/v1`` (None: the ``openai`` default / env).
        model: model name the endpoint serves; None: the one model it serves (``GET /v1/models``,
            asked once, at :meth:`served_models` or the first critique).
        api_key: key; default ``$OPENAI_API_KEY`` or "EMPTY" (local servers ignore it).
        temperature, max_tokens, top_p, seed: sampling of the critic (greedy by default: a
            frozen critic should answer consistently).
        timeout: per-request timeout in seconds.
        max_attempts: total tries per critique (first + retries) for transient errors.
        wait_initial, max_wait: backoff (seconds) between tries; ``Retry-After`` is capped at max_wait.
        instruction: the system prompt (appendix C's critic instruction by default).
        show_gold: pass the gold calls in the evaluation template (appendix C does).
    """

    name = "llm"

    def __init__(
        self,
        base_url: str | None = None,
        model: str | None = None,
        api_key: str | None = None,
        *,
        temperature: float = 0.0,
        top_p: float | None = None,
        max_tokens: int = 160,
        seed: int | None = 0,
        timeout: float = 60.0,
        max_attempts: int = 4,
        wait_initial: float = 0.5,
        max_wait: float = 20.0,
        instruction: str = CRITIC_INSTRUCTION,
        show_gold: bool = True,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts={max_attempts}: must be >= 1")
        self.base_url = base_url
        self.model = model
        self.temperature = temperature
        self.top_p = top_p
        self.max_tokens = max_tokens
        self.seed = seed
        self.timeout = timeout
        self.max_attempts = max_attempts
        self.wait_initial = wait_initial
        self.max_wait = max_wait
        self.instruction = instruction
        self.show_gold = show_gold
        key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        kw: dict[str, Any] = {"api_key": key, "timeout": timeout, "max_retries": 0}
        if base_url is not None:
            kw["base_url"] = base_url
        self._client = openai.OpenAI(**kw)
        self._aclient = openai.AsyncOpenAI(**kw)

    # ---- plumbing ----------------------------------------------------------------------------

    def messages(self, request: CritiqueRequest) -> list[dict[str, str]]:
        """The chat messages sent for ``request`` (appendix C instruction + evaluation template)."""
        # the ground truth as the tool now takes it (an API change the episode met renames or moves it)
        gold = adapt_calls(request.gold, request.api_changes) if self.show_gold and request.gold else None
        return critic_messages(request.response, gold, request.query, self.instruction)

    def served_models(self) -> list[str]:
        """The model ids the endpoint serves (``GET /v1/models``, one try); raises the ``openai``
        errors (connection, timeout, HTTP status)."""
        return [m.id for m in self._client.models.list()]

    def _kwargs(self, request: CritiqueRequest) -> dict[str, Any]:
        if self.model is None:  # the one model the endpoint serves
            served = self.served_models()
            if len(served) != 1:
                raise CriticEndpointError(f"critic endpoint {self.base_url or '(openai default)'} serves "
                                          f"{served}, not one model: name the one to use")
            self.model = served[0]
        kw: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages(request),
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        if self.top_p is not None:
            kw["top_p"] = self.top_p
        if self.seed is not None:
            kw["seed"] = self.seed
        return kw

    def _wait(self, state: RetryCallState) -> float:
        base = wait_exponential_jitter(multiplier=self.wait_initial, max=self.max_wait, jitter=self.wait_initial)(state)
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, openai.APIStatusError):
            ra = parse_retry_after(exc.response.headers.get("retry-after"))
            if ra is not None:
                return min(max(ra, 0.0), self.max_wait)
        return base

    def _retry_kw(self) -> dict[str, Any]:
        return {
            "retry": retry_if_exception(is_transient),
            "stop": stop_after_attempt(self.max_attempts),
            "wait": self._wait,
            "reraise": True,
        }

    def _config_error(self, exc: openai.APIStatusError) -> CriticEndpointError:
        return CriticEndpointError(
            f"critic endpoint {self.base_url or '(openai default)'} refused model {self.model!r}: "
            f"HTTP {exc.status_code}: {str(exc)[:300]}")

    def _finish(self, completion: Any, t0: float) -> Critique:
        try:
            text = completion.choices[0].message.content
        except (AttributeError, IndexError, TypeError):  # an answer without choices: not a verdict
            text = ""
        return critique_from_text(text, t0)

    # ---- the Critic protocol -----------------------------------------------------------------

    def critique(self, request: CritiqueRequest) -> Critique:
        """Ask the endpoint (with retries) and parse the answer strictly; see the module doc."""
        t0 = time.perf_counter()
        if request.env_fault is not None:
            return fault_critique(request.env_fault, t0)
        try:
            kw = self._kwargs(request)
            completion = Retrying(**self._retry_kw())(self._client.chat.completions.create, **kw)
        except openai.APIStatusError as e:
            if is_transient(e):
                return unparsed("", time.perf_counter() - t0, error=f"HTTP {e.status_code} after {self.max_attempts} attempts")
            raise self._config_error(e) from e
        except (openai.APIConnectionError, openai.APITimeoutError) as e:
            return unparsed("", time.perf_counter() - t0,
                            error=f"{type(e).__name__} after {self.max_attempts} attempts")
        return self._finish(completion, t0)

    async def acritique(self, request: CritiqueRequest) -> Critique:
        """Async :meth:`critique` (``openai.AsyncOpenAI``, tenacity ``AsyncRetrying``)."""
        t0 = time.perf_counter()
        if request.env_fault is not None:
            return fault_critique(request.env_fault, t0)
        try:
            kw = self._kwargs(request)

            async def once() -> Any:
                return await self._aclient.chat.completions.create(**kw)

            completion = await AsyncRetrying(**self._retry_kw())(once)
        except openai.APIStatusError as e:
            if is_transient(e):
                return unparsed("", time.perf_counter() - t0, error=f"HTTP {e.status_code} after {self.max_attempts} attempts")
            raise self._config_error(e) from e
        except (openai.APIConnectionError, openai.APITimeoutError) as e:
            return unparsed("", time.perf_counter() - t0,
                            error=f"{type(e).__name__} after {self.max_attempts} attempts")
        return self._finish(completion, t0)

    def close(self) -> None:
        """Close the HTTP clients."""
        self._client.close()

    async def aclose(self) -> None:
        await self._aclient.close()
