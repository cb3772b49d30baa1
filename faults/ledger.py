"""The fault ledger: injected faults (server side) vs observed outcomes (client side).

Every attempt is keyed by ``(episode, step, call, attempt)``. The server records each fault it
injects (``record_injected``); the client records the outcome of every attempt it made
(``record_observed``: ok / env_fault(kind) / policy_error, classified from status codes,
exception types and response content only) and one ``CallRecord`` per logical call.
Recording the same key twice on one side raises ``LedgerError``: nothing is double-counted.

``reconcile()`` pairs the two sides key by key. An injected fault is *matched* when the client
classified that attempt as the same kind; *undetected* when the kind can be invisible to a
transport-level client and the client saw a valid answer (``schema_drift`` without a known
``returns`` schema, ``latency`` under the client's slow threshold); *observed as other* when the
kind's documented alternative symptom occurred (``latency`` longer than the read timeout ->
``timeout``). Anything else is a mismatch, including an env fault the client saw with nothing
injected (real network trouble). ``report.exact`` means no mismatch. A slow but correct answer
with nothing injected (a loaded machine) is not a fault: it is counted in
``report.slow_not_injected``. A tool's own bug (a 500 ``tool_bug`` answer: the handler crashed on
valid arguments) is neither an env fault nor the policy's error: the client records it with
triage ``tool_bug``, it is never retried, and it is counted apart (``report.tool_bugs``,
``totals().tool_bugs``), not as a mismatch. Post-dispatch kinds (latency, truncated, malformed)
act on error answers too: a delayed 4xx/tool-bug answer is observed as ``latency`` like a
delayed ok one.

Each attempt is one billed tool call (tools may be paid): ``totals().attempts`` is the bill.
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from .kinds import KIND_NAMES, KINDS

Key = tuple[str, int, int, int]
#: observed triages that are an answer of the tool (not an env fault): what a post-dispatch fault
#: such as latency may leave intact
ANSWERS = frozenset({"ok", "policy_error", "tool_bug"})


class LedgerError(ValueError):
    """Same attempt recorded twice, or conflicting records."""


@dataclass(frozen=True)
class FaultEvent:
    """One attempt's record on one side.

    source:  "injected" (server decided and applied a fault) or "observed" (client outcome).
    triage:  observed: "ok" | "env_fault" | "policy_error" | "tool_bug"; injected: always
             "env_fault".
    kind:    fault kind (KIND_NAMES) for injected events and observed env faults; for any other
             observed answer (ok, policy error, tool bug) it is "latency" when the answer was slower
             than the client's slow threshold, otherwise None.
    tool:    tool name called.  status: HTTP status if any.  detail: human-readable specifics
             (e.g. "503", "retry_after=1", "reset", "renamed temp->temp_v2", "ReadTimeout").
    cause:   injected only: "draw" (this attempt's decision), "ban" (a standing ip ban), "window"
             (a call before an earlier 429's Retry-After had passed) or "change" (the episode's API
             change of that tool: param_renamed / tool_moved, reflrl.faults.evolve).
    """

    episode: str
    step: int
    call: int
    attempt: int
    source: str
    triage: str
    kind: str | None
    tool: str = ""
    status: int | None = None
    detail: str = ""
    cause: str = "draw"

    @property
    def key(self) -> Key:
        return (self.episode, self.step, self.call, self.attempt)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FaultEvent":
        return cls(episode=str(d["episode"]), step=int(d["step"]), call=int(d["call"]),
                   attempt=int(d["attempt"]), source=str(d["source"]), triage=str(d["triage"]),
                   kind=d.get("kind"), tool=str(d.get("tool", "")), status=d.get("status"),
                   detail=str(d.get("detail", "")), cause=str(d.get("cause", "draw")))


@dataclass(frozen=True)
class CallRecord:
    """The final outcome of one logical call (after retries)."""

    episode: str
    step: int
    call: int
    tool: str
    attempts: int
    triage: str                 # final: "ok" | "env_fault" | "policy_error" | "tool_bug"
    fault_kinds: tuple[str, ...]  # env-fault kinds seen on its attempts, in order

    @property
    def recovered(self) -> bool:
        return self.triage == "ok" and bool(self.fault_kinds)

    @property
    def given_up(self) -> bool:
        return self.triage == "env_fault"


@dataclass
class KindCounts:
    injected: int = 0      # faults the server injected
    observed: int = 0      # attempts the client classified as this kind
    matched: int = 0       # injected and observed as the same kind
    undetected: int = 0    # injected, client saw a valid answer (documented as possible)
    as_other: int = 0      # injected, client saw the kind's documented alternative symptom


@dataclass(frozen=True)
class Mismatch:
    key: Key
    injected: str | None
    observed: str | None
    reason: str


@dataclass
class ReconcileReport:
    per_kind: dict[str, KindCounts]
    mismatches: list[Mismatch]
    attempts: int
    slow_not_injected: int = 0   # ok answers slower than the client's threshold, none injected
    tool_bugs: int = 0           # attempts answered 500 tool_bug (a handler crashed): not faults

    @property
    def exact(self) -> bool:
        return not self.mismatches

    def format(self) -> str:
        lines = [f"{'kind':<14}{'injected':>9}{'observed':>9}{'matched':>9}{'undetect':>9}"
                 f"{'as other':>9}"]
        for k, c in self.per_kind.items():
            if c.injected or c.observed:
                lines.append(f"{k:<14}{c.injected:>9}{c.observed:>9}{c.matched:>9}"
                             f"{c.undetected:>9}{c.as_other:>9}")
        if self.slow_not_injected:
            lines.append(f"slow answers without an injected latency: {self.slow_not_injected}")
        if self.tool_bugs:
            lines.append(f"tool bugs (a handler crashed; not faults): {self.tool_bugs}")
        lines.append(f"attempts {self.attempts}; reconciled "
                     f"{'exactly' if self.exact else f'with {len(self.mismatches)} mismatches'}")
        for m in self.mismatches[:10]:
            lines.append(f"  mismatch {m.key}: injected={m.injected} observed={m.observed}: "
                         f"{m.reason}")
        return "\n".join(lines)


@dataclass
class LedgerTotals:
    calls: int = 0
    attempts: int = 0                 # billed tool calls
    retries: int = 0
    recovered: int = 0                # calls that hit an env fault and then succeeded
    given_up: int = 0                 # calls that ended on an env fault
    policy_errors: int = 0            # calls that ended on a policy error
    tool_bugs: int = 0                # calls that ended on a tool's own bug (500 tool_bug)
    faults_by_kind: dict[str, int] = field(default_factory=dict)    # observed env faults
    injected_by_kind: dict[str, int] = field(default_factory=dict)

    def format(self) -> str:
        fk = ", ".join(f"{k}={v}" for k, v in sorted(self.faults_by_kind.items())) or "none"
        return (f"calls={self.calls} attempts(billed)={self.attempts} retries={self.retries} "
                f"recovered={self.recovered} given_up={self.given_up} "
                f"policy_errors={self.policy_errors} tool_bugs={self.tool_bugs} faults: {fk}")


class Ledger:
    """Thread-safe store of injected and observed attempt records and call records, grouped by
    episode (forgetting an episode costs only its own records)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._injected: dict[str, dict[Key, FaultEvent]] = {}
        self._observed: dict[str, dict[Key, FaultEvent]] = {}
        self._calls: dict[str, dict[tuple[str, int, int], CallRecord]] = {}

    # recording -------------------------------------------------------------------------------
    def record_injected(self, ev: FaultEvent) -> None:
        if ev.source != "injected":
            raise LedgerError(f"record_injected got a {ev.source!r} event")
        with self._lock:
            d = self._injected.setdefault(ev.episode, {})
            if ev.key in d:
                raise LedgerError(f"injected fault for attempt {ev.key} recorded twice")
            d[ev.key] = ev

    def record_observed(self, ev: FaultEvent) -> None:
        if ev.source != "observed":
            raise LedgerError(f"record_observed got a {ev.source!r} event")
        with self._lock:
            d = self._observed.setdefault(ev.episode, {})
            if ev.key in d:
                raise LedgerError(f"observed outcome for attempt {ev.key} recorded twice")
            d[ev.key] = ev

    def record_call(self, rec: CallRecord) -> None:
        k = (rec.episode, rec.step, rec.call)
        with self._lock:
            d = self._calls.setdefault(rec.episode, {})
            if k in d:
                raise LedgerError(f"call {k} recorded twice")
            d[k] = rec

    def merge_injected(self, events: Iterable[FaultEvent]) -> int:
        """Add injected events fetched from a server (GET /v1/episodes/{id}/ledger); identical
        repeats are skipped, conflicting ones raise. Returns how many were new."""
        new = 0
        with self._lock:
            for ev in events:
                d = self._injected.setdefault(ev.episode, {})
                old = d.get(ev.key)
                if old is None:
                    d[ev.key] = ev
                    new += 1
                elif old != ev:
                    raise LedgerError(f"conflicting injected records for {ev.key}: {old} vs {ev}")
        return new

    def forget_episode(self, episode: str) -> int:
        """Drop every record of an episode (e.g. a server freeing memory after DELETE); returns
        how many records were dropped."""
        with self._lock:
            return sum(len(d.pop(episode, None) or ())
                       for d in (self._injected, self._observed, self._calls))

    def forget_injected(self, episode: str) -> int:
        """Drop the injected records of one episode (a server re-opening a replayed episode id
        starts its record afresh); returns how many were dropped."""
        with self._lock:
            return len(self._injected.pop(episode, None) or ())

    def size(self) -> int:
        """How many records (injected + observed + calls) the ledger holds."""
        with self._lock:
            return sum(len(v) for d in (self._injected, self._observed, self._calls)
                       for v in d.values())

    def episodes(self) -> list[str]:
        """The episodes with at least one record."""
        with self._lock:
            return sorted({e for d in (self._injected, self._observed, self._calls)
                           for e, v in d.items() if v})

    # queries ---------------------------------------------------------------------------------
    @staticmethod
    def _select(d: dict[str, dict], episode: str | None) -> list:
        if episode is not None:
            return list((d.get(episode) or {}).values())
        return [v for sub in d.values() for v in sub.values()]

    def injected(self, episode: str | None = None) -> list[FaultEvent]:
        with self._lock:
            return self._select(self._injected, episode)

    def observed(self, episode: str | None = None) -> list[FaultEvent]:
        with self._lock:
            return self._select(self._observed, episode)

    def calls(self, episode: str | None = None) -> list[CallRecord]:
        with self._lock:
            return self._select(self._calls, episode)

    def totals(self, episode: str | None = None) -> LedgerTotals:
        calls = self.calls(episode)
        obs = self.observed(episode)
        t = LedgerTotals(calls=len(calls), attempts=len(obs))
        t.retries = sum(c.attempts - 1 for c in calls)
        t.recovered = sum(c.recovered for c in calls)
        t.given_up = sum(c.given_up for c in calls)
        t.policy_errors = sum(c.triage == "policy_error" for c in calls)
        t.tool_bugs = sum(c.triage == "tool_bug" for c in calls)
        t.faults_by_kind = dict(Counter(e.kind for e in obs if e.triage == "env_fault"))
        t.injected_by_kind = dict(Counter(e.kind for e in self.injected(episode)))
        return t

    def reconcile(self, episode: str | None = None) -> ReconcileReport:
        """Pair injected and observed records per attempt (see the module docstring)."""
        inj = {e.key: e for e in self.injected(episode)}
        obs = {e.key: e for e in self.observed(episode)}
        per = {k: KindCounts() for k in KIND_NAMES}
        mism: list[Mismatch] = []
        slow = bugs = 0
        for o in obs.values():
            if o.kind in per and (o.triage == "env_fault" or o.kind == "latency"):
                per[o.kind].observed += 1
        for key in sorted(set(inj) | set(obs)):
            i, o = inj.get(key), obs.get(key)
            ocls = None if o is None else (o.kind if o.kind else o.triage)
            if i is not None:
                c = per[i.kind]
                c.injected += 1
                if o is None:
                    mism.append(Mismatch(key, i.kind, None, "no client attempt recorded"))
                elif o.triage == "env_fault" and o.kind == i.kind:
                    c.matched += 1
                elif i.kind == "latency" and o.triage in ANSWERS and o.kind == "latency":
                    c.matched += 1
                elif o.triage in ANSWERS and o.kind is None and "ok" in KINDS[i.kind].observed_as:
                    c.undetected += 1
                elif o.triage == "env_fault" and o.kind in KINDS[i.kind].observed_as:
                    c.as_other += 1
                else:
                    mism.append(Mismatch(key, i.kind, ocls, "client saw a different outcome"))
            elif o is not None and o.triage == "env_fault":
                mism.append(Mismatch(key, None, ocls, "client saw a fault that was not injected"))
            elif o is not None and o.kind == "latency":
                slow += 1
            if o is not None and o.triage == "tool_bug":
                bugs += 1
        return ReconcileReport(per, mism, attempts=len(obs), slow_not_injected=slow, tool_bugs=bugs)
