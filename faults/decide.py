"""The fault decision: a pure function of (plan, seed, episode, step, call, attempt).

One BLAKE2b hash of the five coordinates gives 128 bits: the first 64 map to a uniform ``u`` in
[0, 1) that picks at most one kind (kind i when ``bounds[i-1] <= u < bounds[i]``, the cumulative
probabilities of the plan); the other 64 drive deterministic sub-choices (which 5xx, which field
drifts, ...). Same inputs -> same decision on any machine and Python version (no ``hash()``,
no global RNG). Cost: about a microsecond (see scripts/bench_tools.py).

Determinism is what makes fault-injection experiments replayable:
replaying an episode with the same fault seed re-creates the same faults at the same attempts.
"""
from __future__ import annotations

from dataclasses import dataclass
from hashlib import blake2b

from .spec import FaultPlan

_TWO64 = float(1 << 64)


@dataclass(frozen=True)
class FaultDecision:
    """The fault drawn for one attempt.

    kind:  fault kind name.
    param: effective parameter in seconds (explicit or the kind's default); None if it has none.
    u:     the uniform draw in [0, 1) that selected the kind.
    sub:   64 deterministic bits for sub-choices (use ``choose``).
    """

    kind: str
    param: float | None
    u: float
    sub: int

    def choose(self, options, salt: int = 0):
        """A deterministic element of the sequence ``options``; ``salt`` picks independent choices."""
        bits = (self.sub >> (salt * 13 % 51)) ^ (salt * 0x9E3779B97F4A7C15)
        return options[bits % len(options)]


def draw(seed: int, episode: str, step: int, call: int, attempt: int) -> tuple[float, int]:
    """(u in [0, 1), 64 sub-choice bits) for one attempt; the hash behind ``decide``."""
    h = blake2b(f"{seed}\x1f{episode}\x1f{step}\x1f{call}\x1f{attempt}".encode(),
                digest_size=16).digest()
    return int.from_bytes(h[:8], "big") / _TWO64, int.from_bytes(h[8:], "big")


def decide(plan: FaultPlan, seed: int, episode: str, step: int, call: int,
           attempt: int) -> FaultDecision | None:
    """The fault for attempt ``attempt`` of call ``call`` at step ``step`` of ``episode``, or None.

    Pure: depends only on its arguments. At most one kind per attempt (exclusive kinds). The
    API-change kinds are not drawn here (``reflrl.faults.evolve``: per episode and tool).
    """
    bounds = plan._bounds  # type: ignore[attr-defined]
    if not bounds or bounds[-1] <= 0.0:
        return None
    u, sub = draw(seed, episode, step, call, attempt)
    if u >= bounds[-1]:
        return None
    for entry, b in zip(plan._attempt_entries, bounds):  # type: ignore[attr-defined]
        if u < b:
            return FaultDecision(entry.kind, entry.value, u, sub)
    return None  # pragma: no cover  (u < bounds[-1] guarantees a hit)
