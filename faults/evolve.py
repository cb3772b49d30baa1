"""API evolution: the sticky changes ``param_renamed`` and ``tool_moved``, as pure functions.

A real API changes under its clients after a deploy: a parameter gets a new name, a tool is retired for
a successor. Every call after the deploy meets the change, and the server says what changed (Stripe,
OpenAPI validators: ``400 {"error": {"code": "parameter_renamed", "param": ..., ...}}``; a retired route:
``410 Gone`` naming its successor). Here:

- The change of one tool in one episode is decided ONCE per (fault seed, episode, tool): one BLAKE2b hash
  of those coordinates gives ``u`` in [0, 1), which picks at most one change kind (cumulative
  probabilities of the plan's change entries, apart from the per-attempt kinds of
  ``reflrl.faults.decide``), and 64 bits for the sub-choices (which parameter, which new name). No
  ``hash()``, no global RNG: the same inputs give the same change on any machine, so a replay of an
  episode meets the same changes, and every call of that tool in the episode meets the same one.
- New names come from seeded pools of plausible names, so a policy cannot learn one fixed new name:
  synonyms (city -> location / place, query -> search_query / q, date -> day ...), the camelCase of a
  snake_case name, a prefixed or suffixed variant; a successor tool is ``<tool>_v2``, ``<tool>_v3``,
  ``new_<tool>``, ``<tool>_2`` or ``<tool>V2``. A new name never collides with a parameter (tool) that
  already exists.
- ``param_renamed`` renames one parameter: one of the tool's required parameters (else of its properties),
  or, where no schema is known (the fault proxy), one of the keys of the first JSON-object body seen.

The tool server's middleware (``reflrl.faults.inject``) keeps one :class:`ChangeBook` per episode and
answers from it; the env reads the server's record of a change from the error body it gets back.
Standard library only.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from hashlib import blake2b
from typing import Any, Callable, Iterable, Sequence

PARAM_RENAMED = "param_renamed"
TOOL_MOVED = "tool_moved"
ERROR_CODES = {PARAM_RENAMED: "parameter_renamed", TOOL_MOVED: "tool_moved"}
STATUS = {PARAM_RENAMED: 400, TOOL_MOVED: 410}

_TWO64 = float(1 << 64)

#: plausible new names of common parameter names (the pool also holds the camelCase form and
#: prefixed/suffixed variants; see ``param_pool``)
SYNONYMS: dict[str, tuple[str, ...]] = {
    "city": ("location", "place", "city_name", "town"),
    "location": ("place", "where", "loc", "address"),
    "query": ("search_query", "q", "search", "text"),
    "q": ("query", "search_query", "term"),
    "date": ("day", "on_date", "date_str", "when"),
    "name": ("title", "label", "full_name"),
    "id": ("identifier", "key", "item_id"),
    "path": ("file_path", "filepath", "location"),
    "file": ("file_path", "filename", "path"),
    "filename": ("file_name", "name", "path"),
    "text": ("content", "body", "input"),
    "content": ("text", "body", "data"),
    "message": ("text", "body", "content"),
    "amount": ("value", "sum", "quantity"),
    "currency": ("currency_code", "ccy", "curr"),
    "from_currency": ("source_currency", "base", "from_ccy"),
    "to_currency": ("target_currency", "quote", "to_ccy"),
    "limit": ("max_results", "count", "top_k"),
    "count": ("n", "limit", "num"),
    "start": ("begin", "start_time", "from"),
    "end": ("finish", "end_time", "to"),
    "start_date": ("from_date", "begin_date", "since"),
    "end_date": ("to_date", "until", "finish_date"),
    "symbol": ("ticker", "code", "stock_symbol"),
    "ticker": ("symbol", "stock", "ticker_symbol"),
    "country": ("country_code", "nation", "region"),
    "language": ("lang", "locale", "language_code"),
    "lang": ("language", "locale"),
    "units": ("unit", "unit_system", "measure"),
    "unit": ("units", "unit_name"),
    "user": ("username", "user_name", "account"),
    "username": ("user", "login", "handle"),
    "email": ("email_address", "mail", "address"),
    "title": ("name", "subject", "heading"),
    "url": ("link", "uri", "address"),
    "category": ("type", "kind", "group"),
    "type": ("kind", "category"),
    "origin": ("source", "from_location", "departure"),
    "destination": ("target", "to_location", "arrival"),
    "address": ("location", "street_address", "addr"),
    "latitude": ("lat",), "longitude": ("lon", "lng"),
    "days": ("num_days", "day_count", "n_days"),
}
#: successor tool names: ``{}`` is the retired tool's name
SUCCESSORS: tuple[str, ...] = ("{}_v2", "{}_v3", "new_{}", "{}_2", "{}V2")


@dataclass(frozen=True)
class ApiChange:
    """One change of one tool in one episode.

    kind:  "param_renamed" | "tool_moved".  tool: the tool's (old) name.
    param: the parameter's old name (param_renamed; None for tool_moved).
    new:   the parameter's new name, or the successor tool's name.
    """

    kind: str
    tool: str
    param: str | None
    new: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def status(self) -> int:
        return STATUS[self.kind]

    def message(self) -> str:
        """The server's message: it names both the old and the new name."""
        if self.kind == PARAM_RENAMED:
            return f"unknown parameter '{self.param}': {self.tool} now takes '{self.new}'"
        return f"{self.tool} was retired; call {self.new} with the same arguments"

    def error_body(self) -> dict[str, Any]:
        """The JSON error body a client gets (Stripe / OpenAPI-validator style)."""
        err: dict[str, Any] = {"type": "invalid_request_error", "code": ERROR_CODES[self.kind],
                               "message": self.message()}
        if self.kind == PARAM_RENAMED:
            err.update(param=self.param, new_param=self.new, tool=self.tool)
        else:
            err.update(tool=self.tool, successor=self.new)
        return {"error": err}


def change_draw(seed: int, episode: str, tool: str) -> tuple[float, int]:
    """(u in [0, 1), 64 sub-choice bits) of one (fault seed, episode, tool): the hash behind
    ``change_kind``; salted apart from ``reflrl.faults.decide.draw``."""
    h = blake2b(f"api-change\x1f{seed}\x1f{episode}\x1f{tool}".encode(), digest_size=16).digest()
    return int.from_bytes(h[:8], "big") / _TWO64, int.from_bytes(h[8:], "big")


def change_kind(plan, seed: int, episode: str, tool: str) -> tuple[str, int] | None:
    """(kind, sub bits) of the change the plan draws for ``tool`` in ``episode``, or None. Pure."""
    bounds = plan._change_bounds  # type: ignore[attr-defined]
    if not bounds or bounds[-1] <= 0.0:
        return None
    u, sub = change_draw(seed, episode, tool)
    for entry, b in zip(plan._change_entries, bounds):  # type: ignore[attr-defined]
        if u < b:
            return entry.kind, sub
    return None


def _pick(options: Sequence[str], sub: int, salt: int) -> str:
    bits = (sub >> (salt * 17 % 47)) ^ (salt * 0x9E3779B97F4A7C15)
    return options[bits % len(options)]


def camel(name: str) -> str:
    """``start_date`` -> ``startDate`` (unchanged without an underscore)."""
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def snake(name: str) -> str:
    """``startDate`` -> ``start_date``."""
    return re.sub(r"(?<=[a-z0-9])([A-Z])", lambda m: "_" + m.group(1).lower(), name)


def param_pool(param: str) -> tuple[str, ...]:
    """The plausible new names of parameter ``param`` (synonyms first, then spelling variants)."""
    base = snake(param).lower()
    out = list(SYNONYMS.get(base, ()))
    if "_" in param:
        out.append(camel(param))
    elif param != snake(param):
        out.append(snake(param))
    out += [f"{base}_value" if "_" not in base else f"{base}_id", f"target_{base}", f"{base}_name"]
    return tuple(dict.fromkeys(n for n in out if n != param))


def _split(tool: str) -> tuple[str, str]:
    """(head, last segment) of a tool name; a route such as ``POST /v1/weather`` (the fault proxy's
    tools) changes only its last path segment."""
    i = max(tool.rfind("/"), tool.rfind(" "))
    return tool[: i + 1], tool[i + 1:]


def successor_pool(tool: str) -> tuple[str, ...]:
    """The successor names of ``tool`` (of its last path segment, for a route)."""
    head, seg = _split(tool)
    return tuple(head + p.format(seg) for p in SUCCESSORS)


def _fresh(pool: Sequence[str], sub: int, salt: int, taken: Iterable[str]) -> str:
    """A name of ``pool`` (chosen by ``sub``) that is not taken; the next free one of the pool after
    the chosen one, else the chosen one with ``_`` appended until free."""
    taken = set(taken)
    first = pool.index(_pick(pool, sub, salt))
    for i in range(len(pool)):
        name = pool[(first + i) % len(pool)]
        if name not in taken:
            return name
    name = pool[first]
    while name in taken:
        name += "_"
    return name


def api_change(plan, seed: int, episode: str, tool: str, params: Sequence[str] | None,
               taken_tools: Iterable[str] = ()) -> ApiChange | None:
    """The change of ``tool`` in ``episode`` (None: none), pure in its arguments.

    params: the tool's parameters to pick the renamed one from (its required ones, else all; sorted
    here, so the order given does not matter); None or empty: a ``param_renamed`` draw cannot apply
    (no change). taken_tools: names a successor must not take (the server's other tools)."""
    drawn = change_kind(plan, seed, episode, tool)
    if drawn is None:
        return None
    kind, sub = drawn
    if kind == TOOL_MOVED:
        return ApiChange(kind, tool, None, _fresh(successor_pool(tool), sub, 2, {tool, *taken_tools}))
    names = sorted({str(p) for p in params or ()})
    if not names:
        return None
    param = _pick(names, sub, 1)
    return ApiChange(kind, tool, param, _fresh(param_pool(param), sub, 3, names))


def moved_from(plan, seed: int, episode: str, name: str, taken_tools: Iterable[str] = (),
               known: Callable[[str], bool] | None = None) -> str | None:
    """The retired tool whose successor in ``episode`` is ``name``, or None: the inverse of the
    ``tool_moved`` successor, found by undoing each successor pattern and checking the draw.
    known: when given, only tools it accepts are candidates (the server: the episode's tools)."""
    taken = tuple(taken_tools)
    head, seg = _split(name)
    for pat in SUCCESSORS:
        pre, post = pat.split("{}")
        if len(seg) > len(pre) + len(post) and seg.startswith(pre) and seg.endswith(post):
            cand = head + seg[len(pre): len(seg) - len(post)]
            if known is not None and not known(cand):
                continue
            ch = api_change(plan, seed, episode, cand, None, taken)
            if ch is not None and ch.kind == TOOL_MOVED and ch.new == name:
                return cand
    return None


def schema_params(schema: Any) -> list[str]:
    """The parameters a rename picks from in a tool's JSON schema: its required ones, else all its
    properties."""
    if not isinstance(schema, dict):
        return []
    req = [p for p in schema.get("required") or () if isinstance(p, str)]
    if req:
        return req
    props = schema.get("properties")
    return [p for p in props if isinstance(p, str)] if isinstance(props, dict) else []


class ChangeBook:
    """The API changes of one episode, decided lazily per tool and kept (sticky).

    params: ``params(tool) -> parameter names`` (the server: from the tool's schema); None = pick among
    the keys of the first JSON-object arguments seen for the tool (the fault proxy). known: which names
    are tools of the episode (None: any). taken_tools: names a successor must not take."""

    def __init__(self, plan, seed: int, episode: str, *,
                 params: Callable[[str], Sequence[str]] | None = None,
                 known: Callable[[str], bool] | None = None, taken_tools: Iterable[str] = ()) -> None:
        self.plan, self.seed, self.episode = plan, int(seed), episode
        self._params, self._known = params, known
        self._taken = tuple(taken_tools)
        self._changes: dict[str, ApiChange | None] = {}

    @property
    def active(self) -> bool:
        return self.plan.change_total > 0

    def change(self, tool: str, arguments: Any = None) -> ApiChange | None:
        """The change of ``tool`` (None: none). Without a params function, a rename waits for the first
        JSON-object ``arguments`` to pick its parameter from, and then stays."""
        if tool in self._changes:
            return self._changes[tool]
        if not self.active or (self._known is not None and not self._known(tool)):
            return None
        drawn = change_kind(self.plan, self.seed, self.episode, tool)
        if drawn is None:
            self._changes[tool] = None
            return None
        if drawn[0] == PARAM_RENAMED:
            if self._params is not None:
                params = list(self._params(tool))
            elif isinstance(arguments, dict) and arguments:
                params = list(arguments)
            else:
                return None  # no parameter known yet: decided at the first JSON-object body
        else:
            params = None
        ch = api_change(self.plan, self.seed, self.episode, tool, params, self._taken)
        self._changes[tool] = ch
        return ch

    def moved_from(self, name: str) -> str | None:
        """The retired tool whose successor is ``name`` in this episode (None: ``name`` is not one)."""
        if not self.active or (self._known is not None and self._known(name)):
            return None
        orig = moved_from(self.plan, self.seed, self.episode, name, self._taken, self._known)
        if orig is not None:
            self._changes.setdefault(orig, api_change(self.plan, self.seed, self.episode, orig, None,
                                                      self._taken))
        return orig


def rewrite_arguments(change: ApiChange, arguments: dict) -> tuple[str, dict]:
    """What a ``param_renamed`` change does to a call's arguments: ("refuse", args) when the old name is
    used, ("rewrite", args with the new name turned back into the old) when the new one is, else
    ("pass", args)."""
    if change.param in arguments:
        return "refuse", arguments
    if change.new in arguments:
        return "rewrite", {(change.param if k == change.new else k): v for k, v in arguments.items()}
    return "pass", arguments

