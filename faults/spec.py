"""FaultPlan: the ``--faults`` spec grammar.

Grammar (whitespace around tokens is ignored)::

    plan     := "" | "none" | entry ("," entry)*
    entry    := kind "=" prob [":" param]
    kind     := one of reflrl.faults.kinds.KIND_NAMES
    prob     := a decimal number in [0, 1]            (e.g. 0.1, .05, 1, 2.5e-2)
    param    := duration = number unit, unit in {ms, s, m}  (e.g. 300ms, 2s, 1.5s, 0.5m)
                the unit is required (``latency=0.1:300`` is refused: 300 what?); only kinds
                with a parameter accept one

Kinds are mutually exclusive per attempt (one uniform draw picks at most one kind, see
``reflrl.faults.decide``), so the probabilities must sum to at most 1. The API-change kinds
(``param_renamed``, ``tool_moved``: sticky per (fault seed, episode, tool), ``reflrl.faults.evolve``)
take no part in that draw: they have their own draw per (episode, tool), at most one change per
pair, so their probabilities sum to at most 1 among themselves. Every error is a
``FaultSpecError`` (a ValueError) whose message names the offending entry.

``str(plan)`` is canonical and round-trips: ``FaultPlan.parse(str(p)) == p``.
"""
from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass

from .kinds import KIND_NAMES, KINDS


class FaultSpecError(ValueError):
    """A fault spec that does not parse; the message names the offending entry."""


@dataclass(frozen=True)
class FaultEntry:
    """One ``kind=prob[:param]`` entry; ``param`` in seconds (None = the kind's default / none)."""

    kind: str
    prob: float
    param: float | None = None

    @property
    def value(self) -> float | None:
        """The effective parameter in seconds (the explicit one or the kind's default)."""
        return self.param if self.param is not None else KINDS[self.kind].param_default

    def __str__(self) -> str:
        s = f"{self.kind}={_fmt_number(self.prob)}"
        if self.param is not None:
            s += f":{format_duration(self.param)}"
        return s


_NUM_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
_DUR_RE = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(ms|s|m)?$")
_UNIT = {"ms": 1e-3, "s": 1.0, "m": 60.0}


@dataclass(frozen=True)
class FaultPlan:
    """An ordered tuple of FaultEntry with cumulative bounds for the per-attempt draw (and,
    apart, for the per-(episode, tool) draw of the API-change kinds)."""

    entries: tuple[FaultEntry, ...] = ()

    def __post_init__(self) -> None:
        # cumulative upper bounds, used by decide(): per-attempt kind i is drawn when u < bounds[i]
        for group, name in ((False, "attempt"), (True, "change")):
            acc, bounds, chosen = 0.0, [], []
            for e in self.entries:
                if KINDS[e.kind].sticky is group:
                    acc += e.prob
                    bounds.append(acc)
                    chosen.append(e)
            object.__setattr__(self, f"_{name}_entries", tuple(chosen))
            object.__setattr__(self, "_bounds" if name == "attempt" else "_change_bounds", tuple(bounds))

    # construction -------------------------------------------------------------------------
    @classmethod
    def none(cls) -> "FaultPlan":
        """The plan without faults."""
        return cls(())

    @classmethod
    def parse(cls, spec: str) -> "FaultPlan":
        """Parse ``kind=prob[:param],...``; raises FaultSpecError naming the offending entry."""
        if not isinstance(spec, str):
            raise FaultSpecError(f"fault spec must be a string, got {type(spec).__name__}")
        text = spec.strip()
        if text == "" or text.lower() == "none":
            return cls.none()
        entries: list[FaultEntry] = []
        seen: dict[str, int] = {}
        for i, raw in enumerate(text.split(",")):
            entry = _parse_entry(raw, i + 1)
            if entry.kind in seen:
                raise FaultSpecError(
                    f"fault spec entry {i + 1} {raw.strip()!r}: kind {entry.kind!r} given twice "
                    f"(first in entry {seen[entry.kind]})")
            seen[entry.kind] = i + 1
            entries.append(entry)
        total = math.fsum(e.prob for e in entries if not KINDS[e.kind].sticky)
        if total > 1.0 + 1e-9:
            raise FaultSpecError(
                f"fault spec {text!r}: probabilities sum to {total:g} > 1 (kinds are exclusive per "
                f"attempt: one draw picks at most one kind)")
        changes = math.fsum(e.prob for e in entries if KINDS[e.kind].sticky)
        if changes > 1.0 + 1e-9:
            raise FaultSpecError(
                f"fault spec {text!r}: the API-change probabilities sum to {changes:g} > 1 (one draw "
                f"per episode and tool picks at most one change)")
        return cls(tuple(entries))

    @classmethod
    def coerce(cls, plan: "FaultPlan | str | None") -> "FaultPlan":
        """Accept a FaultPlan, a spec string or None (no faults)."""
        if plan is None:
            return cls.none()
        if isinstance(plan, FaultPlan):
            return plan
        return cls.parse(plan)

    # queries --------------------------------------------------------------------------------
    def __str__(self) -> str:
        return ",".join(str(e) for e in self.entries)

    def __bool__(self) -> bool:
        return any(e.prob > 0 for e in self.entries)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(e.kind for e in self.entries)

    def entry(self, kind: str) -> FaultEntry | None:
        for e in self.entries:
            if e.kind == kind:
                return e
        return None

    def prob(self, kind: str) -> float:
        e = self.entry(kind)
        return e.prob if e else 0.0

    @property
    def total(self) -> float:
        """The per-attempt kinds' total probability (the API changes are apart: ``change_total``)."""
        return self._bounds[-1] if self._bounds else 0.0  # type: ignore[attr-defined]

    @property
    def change_total(self) -> float:
        """The API-change kinds' total probability (the share of (episode, tool) pairs changed)."""
        b = self._change_bounds  # type: ignore[attr-defined]
        return b[-1] if b else 0.0

    def scaled(self, factor: float, cap: float = 1.0) -> "FaultPlan":
        """The same kinds and parameters with every probability times ``factor``; when that would put
        the total above ``cap``, the probabilities are scaled to total ``cap`` instead (their ratios kept).
        A plan already above ``cap`` is returned unchanged: scaling never lowers a rate below the one
        given. ``factor`` >= 0 and 0 < ``cap`` <= 1, else FaultSpecError. The per-attempt kinds and
        the API-change kinds are scaled (and capped) each on their own total."""
        if not (factor >= 0 and math.isfinite(factor)):
            raise FaultSpecError(f"fault rate scale must be a finite number >= 0, got {factor!r}")
        if not 0 < cap <= 1:
            raise FaultSpecError(f"fault rate cap must be in (0, 1], got {cap!r}")
        fs = {}
        for sticky, total in ((False, self.total), (True, self.change_total)):
            fs[sticky] = min(factor, max(1.0, cap / total)) if factor > 1 and total > 0 else factor
            if total <= 0:
                fs[sticky] = 1.0
        if fs[False] == 1.0 and fs[True] == 1.0:
            return self
        return FaultPlan(tuple(FaultEntry(e.kind, round(e.prob * fs[KINDS[e.kind].sticky], 12), e.param)
                               for e in self.entries))


def _parse_entry(raw: str, index: int) -> FaultEntry:
    where = f"fault spec entry {index} {raw.strip()!r}"
    part = raw.strip()
    if not part:
        raise FaultSpecError(f"fault spec entry {index} is empty (stray comma?)")
    if "=" not in part:
        raise FaultSpecError(f"{where}: expected kind=probability[:param], e.g. rate_limit=0.1")
    kind, _, rest = part.partition("=")
    kind = kind.strip()
    if kind not in KINDS:
        close = difflib.get_close_matches(kind.lower(), KIND_NAMES, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise FaultSpecError(
            f"{where}: unknown fault kind {kind!r}{hint} (known: {', '.join(KIND_NAMES)})")
    prob_s, colon, param_s = rest.partition(":")
    prob_s = prob_s.strip()
    if not _NUM_RE.match(prob_s):
        raise FaultSpecError(f"{where}: probability {prob_s!r} is not a number")
    prob = float(prob_s)
    if not (0.0 <= prob <= 1.0):
        raise FaultSpecError(f"{where}: probability {prob_s} is outside [0, 1]")
    param = None
    if colon:
        k = KINDS[kind]
        if not k.takes_param:
            raise FaultSpecError(f"{where}: kind {kind!r} takes no parameter")
        param = parse_duration(param_s, where=f"{where}: {k.param}")
    return FaultEntry(kind, prob, param)


def parse_duration(text: str, *, where: str = "duration") -> float:
    """``300ms`` / ``2s`` / ``1.5m`` -> seconds; FaultSpecError when bad or without a unit."""
    s = text.strip()
    m = _DUR_RE.match(s)
    if not m:
        raise FaultSpecError(f"{where} {s!r} is not a duration (use e.g. 300ms, 2s, 1.5m)")
    if m.group(2) is None:
        raise FaultSpecError(f"{where} {s!r} has no unit (write {s}s or {s}ms; units: ms, s, m)")
    val = float(m.group(1)) * _UNIT[m.group(2)]
    if not math.isfinite(val) or val < 0:
        raise FaultSpecError(f"{where} {s!r} must be a finite duration >= 0")
    return val


def format_duration(seconds: float) -> str:
    """Shortest readable form that parses back to exactly ``seconds``."""
    candidates = []
    ms = seconds * 1000.0
    if seconds < 1 and ms == round(ms):
        candidates.append(f"{int(round(ms))}ms")
    candidates.append(f"{_fmt_number(seconds)}s")
    for c in candidates:
        if parse_duration(c) == seconds:
            return c
    return f"{seconds!r}s"


def _fmt_number(x: float) -> str:
    s = f"{x:g}"
    return s if float(s) == x else repr(x)
