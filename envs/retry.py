"""The tool client's retry policy: tenacity strategies composed, retry decided by exception type.

    policy = RetryPolicy(max_attempts=4, budget_s=30.0)
    retrying = policy.retrying(clock, start=clock.monotonic(), key=(episode, step, call))
    result = await retrying(attempt)      # attempt() returns a result or raises a ToolCallError

What ``retrying`` is made of (tenacity's own strategies, plus three small ones for what tenacity
cannot know: the injectable clock, a reproducible jitter, the server's Retry-After)::

    retry = retry_if_exception_type(<retryable ToolFault classes>)
    stop  = stop_after_attempt(max_attempts) | stop_before_budget(budget_s, clock, start)
    wait  = wait_retry_after(wait_seeded_jitter(wait_exponential(multiplier=base_s, max=cap_s),
                                                jitter, key=(seed, episode, step, call)),
                             max_retry_after_s)
    sleep = clock.sleep

- Retried: the ``ToolFault`` classes (reflrl.envs.errors) whose kind is ``FaultKind.retryable`` in
  reflrl.faults.kinds; ``Banned`` only with ``rotate_identity_on_ban`` (a ban persists for an
  identity, so retrying without a new one cannot help). Policy errors and tool bugs never are.
- Backoff before attempt n+1 is min(cap_s, base_s * 2**(n-1)); ``jitter`` of it is drawn from a hash
  of (seed, episode, step, call, attempt), so a replay waits exactly as long.
- A Retry-After sets the minimum wait; one longer than ``max_retry_after_s`` is not waited for
  (give up at once).
- The budget is time on the client's clock (a VirtualClock in tests and in-process runs): stop
  before a wait that would end more than ``budget_s`` after the call started. tenacity's own
  ``stop_after_delay`` reads ``time.monotonic`` and cannot see a virtual clock.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

from tenacity import (AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt,
                      wait_exponential)
from tenacity.retry import retry_base
from tenacity.stop import stop_base
from tenacity.wait import wait_base

from .errors import Banned, retryable_faults


class stop_before_budget(stop_base):
    """Stop before a wait that would end more than ``budget_s`` after ``start`` on ``clock``
    (tenacity's ``stop_before_delay`` on an injectable clock). An infinite wait always stops:
    it is how ``wait_retry_after`` says a Retry-After is not worth waiting for."""

    def __init__(self, budget_s: float, clock, start: float) -> None:
        self.budget_s = budget_s
        self.clock = clock
        self.start = start

    def __call__(self, retry_state: RetryCallState) -> bool:
        wait = retry_state.upcoming_sleep
        return math.isinf(wait) or self.clock.monotonic() - self.start + wait > self.budget_s


class wait_seeded_jitter(wait_base):
    """``fraction`` of the ``inner`` wait drawn uniformly from a hash of ``key`` and the attempt:
    ``d * (1 - fraction) + d * fraction * u`` with d = inner(state), u in [0, 1). Unlike tenacity's
    ``wait_random_exponential`` / ``wait_exponential_jitter`` (``random``), a replay of the same
    (key, attempt) waits exactly as long. fraction 0 = no jitter, 1 = "full jitter"."""

    def __init__(self, inner: wait_base, fraction: float, key: tuple) -> None:
        self.inner = inner
        self.fraction = fraction
        self.key = "\x1f".join(map(str, key))

    def __call__(self, retry_state: RetryCallState) -> float:
        d = self.inner(retry_state)
        attempt = retry_state.attempt_number - 1          # the failed attempt, 0-based
        h = blake2b(f"{self.key}\x1f{attempt}".encode(), digest_size=8).digest()
        u = int.from_bytes(h, "big") / float(1 << 64)
        return d * (1.0 - self.fraction) + d * self.fraction * u


class wait_retry_after(wait_base):
    """Honour the server's Retry-After: wait max(Retry-After, backoff) after a fault that carries
    one (``RateLimited.retry_after``), the backoff otherwise. A Retry-After longer than
    ``max_retry_after_s`` gives up: the wait is ``math.inf``, on which ``stop_before_budget`` stops
    (compose the two; alone, an infinite wait would never end)."""

    def __init__(self, backoff: wait_base, max_retry_after_s: float) -> None:
        self.backoff = backoff
        self.max_retry_after_s = max_retry_after_s

    def __call__(self, retry_state: RetryCallState) -> float:
        wait = self.backoff(retry_state)
        outcome = retry_state.outcome
        retry_after = getattr(outcome.exception(), "retry_after", None) if outcome else None
        if retry_after is None:
            return wait
        if retry_after > self.max_retry_after_s:
            return math.inf
        return max(wait, retry_after)


@dataclass(frozen=True)
class RetryPolicy:
    """How the tool client retries env faults (module doc).

    max_attempts:        attempts per call including the first (>= 1); each is a billed call.
    budget_s:            give up when elapsed time plus the next wait would exceed this.
    base_s, cap_s:       backoff before attempt n+1 is min(cap_s, base_s * 2**(n-1)).
    jitter:              fraction of that backoff drawn from a hash of (seed, episode, step, call,
                         attempt): 0 = none, 1 = "full jitter"; reproducible.
    max_retry_after_s:   a Retry-After longer than this is not waited for (give up).
    rotate_identity_on_ban: on a ban (403) the client changes its identity ("IP change") and
                         retries; otherwise a ban is not retried.
    seed:                jitter seed.
    """

    max_attempts: int = 4
    budget_s: float = 60.0
    base_s: float = 0.5
    cap_s: float = 8.0
    jitter: float = 0.5
    max_retry_after_s: float = 60.0
    rotate_identity_on_ban: bool = True
    seed: int = 0

    @classmethod
    def no_retry(cls) -> "RetryPolicy":
        return cls(max_attempts=1)

    def retry_strategy(self) -> retry_base:
        """Retry the retryable fault classes (``Banned`` only with identity rotation)."""
        faults = tuple(c for c in retryable_faults()
                       if self.rotate_identity_on_ban or not issubclass(c, Banned))
        return retry_if_exception_type(faults)

    def stop_strategy(self, clock, start: float) -> stop_base:
        """Stop after ``max_attempts`` or before a wait that would overrun ``budget_s``."""
        return stop_after_attempt(self.max_attempts) | stop_before_budget(self.budget_s, clock,
                                                                          start)

    def wait_strategy(self, key: tuple[Any, ...]) -> wait_base:
        """Capped exponential backoff, seeded jitter (``key``: episode, step, call), Retry-After."""
        backoff = wait_exponential(multiplier=self.base_s, max=self.cap_s)
        return wait_retry_after(wait_seeded_jitter(backoff, self.jitter, (self.seed, *key)),
                                self.max_retry_after_s)

    def retrying(self, clock, *, start: float, key: tuple[Any, ...]) -> AsyncRetrying:
        """The tenacity controller of one logical call that started at ``start`` on ``clock``.
        It re-raises the last attempt's exception when it gives up (``reraise=True``)."""
        return AsyncRetrying(retry=self.retry_strategy(), stop=self.stop_strategy(clock, start),
                             wait=self.wait_strategy(key), sleep=clock.sleep, reraise=True)
