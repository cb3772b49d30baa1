"""The fault grid of ``reflrl experiment faults --faults GRID`` and how it expands.

Grammar (whitespace ignored)::

    grid  := axis (";" axis)*
    axis  := kind "=" value ("," value)*          one axis per fault kind
    value := prob [":" param]                      as in a --faults entry, e.g. 0.1 or 0.2:300ms

Expansion (``mode``):

- ``"per-kind"`` (the default): one-factor-at-a-time. Each kind is swept alone with every other
  kind off, so each point answers "what does this kind cost at this rate?", and the accuracy vs
  fault rate plot has one panel per kind with the rate on its x axis. Settings whose rates are all
  zero are the same no-fault baseline; it is run once and shared by every kind's curve.
  ``rate_limit=0,0.1,0.3;timeout=0,0.1`` gives 4 settings: none, rate_limit=0.1, rate_limit=0.3,
  timeout=0.1.
- ``"product"``: the cartesian product of the axes (kinds combined in one run; their probabilities
  must sum to at most 1). The same grid gives 6 settings; sweep plots put the total fault
  probability per attempt on the x axis.

Every error is a :class:`GridError` (a ValueError) naming the axis or value that is wrong.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from reflrl.errors import UserError
from reflrl.faults.spec import FaultPlan, FaultSpecError

MODES = ("per-kind", "product")


class GridError(UserError, ValueError):
    """A --faults grid that does not parse or expand; the message names the offending part."""


@dataclass(frozen=True)
class Axis:
    """One kind and the values it takes, e.g. rate_limit over ("0", "0.1", "0.3")."""

    kind: str
    values: tuple[str, ...]


@dataclass(frozen=True)
class FaultSetting:
    """One point of the grid: the canonical fault spec ("none" for no faults) and each kind's rate."""

    spec: str
    rates: dict[str, float] = field(default_factory=dict, hash=False, compare=False)

    @property
    def total(self) -> float:
        """Total fault probability per attempt (kinds are exclusive per attempt)."""
        return sum(self.rates.values())

    @property
    def slug(self) -> str:
        """A folder-name-safe form: ``rate_limit-0.1+timeout-0.05`` (``none`` for no faults)."""
        return self.spec.replace("=", "-").replace(",", "+").replace(":", "@")


def parse_grid(text: str) -> list[Axis]:
    """Parse ``kind=v1,v2;kind=v1,...`` into axes (values checked as --faults entries)."""
    if not isinstance(text, str) or not text.strip():
        raise GridError("--faults grid is empty; expected e.g. 'rate_limit=0,0.1,0.3;timeout=0,0.1'")
    axes: list[Axis] = []
    seen: set[str] = set()
    for i, raw in enumerate(text.split(";"), 1):
        part = raw.strip()
        if not part:
            raise GridError(f"--faults grid axis {i} is empty (stray ';'?)")
        if "=" not in part:
            raise GridError(f"--faults grid axis {i} {part!r}: expected kind=rate,rate,... "
                            "e.g. rate_limit=0,0.1,0.3")
        kind, _, vals = part.partition("=")
        kind = kind.strip()
        values = tuple(v.strip() for v in vals.split(","))
        if any(not v for v in values):
            raise GridError(f"--faults grid axis {i} {part!r}: empty value (stray ','?)")
        for v in values:  # each value must be a valid --faults entry of this kind
            try:
                FaultPlan.parse(f"{kind}={v}")
            except FaultSpecError as e:
                raise GridError(f"--faults grid axis {i} {part!r}: {e}") from None
        if kind in seen:
            raise GridError(f"--faults grid axis {i} {part!r}: kind {kind!r} given twice")
        if len(set(values)) != len(values):
            raise GridError(f"--faults grid axis {i} {part!r}: a value is repeated")
        seen.add(kind)
        axes.append(Axis(kind, values))
    return axes


def _setting(entries: list[str], kinds: list[str]) -> FaultSetting:
    spec = ",".join(entries)
    try:
        plan = FaultPlan.parse(spec)
    except FaultSpecError as e:
        raise GridError(f"--faults grid: the combination {spec!r} is invalid: {e}") from None
    live = FaultPlan(tuple(e for e in plan.entries if e.prob > 0))
    return FaultSetting(str(live) or "none", {k: plan.prob(k) for k in kinds})


def expand(axes: list[Axis], mode: str = "per-kind") -> list[FaultSetting]:
    """The fault settings of the grid, deduplicated in first-seen order (see the module doc)."""
    if mode not in MODES:
        raise GridError(f"--grid {mode!r}: expected one of {', '.join(MODES)}")
    kinds = [a.kind for a in axes]
    out: list[FaultSetting] = []
    if mode == "per-kind":
        for a in axes:
            out += [_setting([f"{a.kind}={v}"], kinds) for v in a.values]
    else:
        for combo in itertools.product(*[[f"{a.kind}={v}" for v in a.values] for a in axes]):
            out.append(_setting(list(combo), kinds))
    uniq: dict[str, FaultSetting] = {}
    for s in out:
        uniq.setdefault(s.spec, s)
    return list(uniq.values())
