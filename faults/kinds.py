"""The fault kinds: what each one is, its parameter, and what a real HTTP client sees.

The catalogue follows the failure modes that waste tool-use RL rollouts in practice (Tool-ReRL,
Tool-ReRL sec. 1 and 3.2, Fig. 1: rate limits, timeouts, network resets, bad
files, banned IPs), extended with the other faults a client of a real HTTP API meets (5xx, truncated or
malformed bodies, slow answers, schema drift), and the API evolution a client of a long-lived API meets
after a deploy (a parameter renamed, a tool retired for a successor; ``reflrl.faults.evolve``).

This module is pure data: ``KINDS`` (name -> FaultKind), ``kinds_rows()`` and
``format_kinds_table()`` (what ``reflrl faults list`` prints). It imports nothing outside the standard library.
"""
from __future__ import annotations

from dataclasses import dataclass

# Where in the request a fault acts.
PRE_DISPATCH = "pre"     # the request never reaches the tool (no side effects)
POST_DISPATCH = "post"   # the tool ran (side effects happened); the response is altered or delayed

# What one draw decides.
PER_ATTEMPT = "attempt"          # one exclusive draw per attempt (reflrl.faults.decide)
PER_EPISODE_TOOL = "episode_tool"  # sticky: one draw per (fault seed, episode, tool) (reflrl.faults.evolve)


@dataclass(frozen=True)
class FaultKind:
    """One fault kind.

    name:          the name used in a fault spec (``rate_limit=0.1``).
    param:         name of the optional ``:param`` (None = the kind takes no parameter).
    param_unit:    "duration" (``300ms``, ``2s``, ``1.5m``) when param is set.
    param_default: default parameter value in seconds (None when no param).
    client_sees:   what a real HTTP client observes.
    retryable:     whether the tool client retries it (the one place this is decided: the client's
                   retry policy reads it, reflrl.envs.retry).
    stage:         PRE_DISPATCH or POST_DISPATCH (whether the tool ran).
    applies_to:    "any" or "files" (only file tools: domain "files" or a bfcl file system).
    observed_as:   client-side classifications that count as a faithful observation of this kind
                   in ``Ledger.reconcile`` ("ok" = undetectable by transport: "undetected").
    policy_can_act: under ``fault_exposure="policy"`` (the fault comes back to the policy as the
                   tool's answer): whether an action of the policy can still get the answer, so
                   that not taking it is the policy's failure (the reward of a wrong answer); False:
                   no action available in the episode can, so the episode is masked (never
                   penalised).
    policy_rule:   that rule in words (``reflrl faults list``, docs/faults.md).
    scope:         PER_ATTEMPT (an exclusive per-attempt draw: these kinds' probabilities sum to
                   <= 1) or PER_EPISODE_TOOL (an API change: decided once per (fault seed, episode,
                   tool), met by every call of that tool in the episode; these kinds' probabilities
                   sum to <= 1 among themselves, apart from the per-attempt ones).
    """

    name: str
    param: str | None
    param_unit: str | None
    param_default: float | None
    client_sees: str
    retryable: bool
    stage: str
    applies_to: str = "any"
    observed_as: tuple[str, ...] = ()
    policy_can_act: bool = True
    policy_rule: str = ""
    scope: str = PER_ATTEMPT

    @property
    def takes_param(self) -> bool:
        return self.param is not None

    @property
    def sticky(self) -> bool:
        """An API change (decided per episode and tool), not a per-attempt draw."""
        return self.scope == PER_EPISODE_TOOL


_K = FaultKind
KINDS: dict[str, FaultKind] = {k.name: k for k in [
    _K("rate_limit", "retry_after", "duration", 1.0,
       "HTTP 429 with a Retry-After header (whole seconds, rounded up from the parameter)",
       True, PRE_DISPATCH, observed_as=("rate_limit",),
       policy_rule="act: call again once Retry-After has passed (each assistant turn advances the "
                   "env's clock by env.turn_seconds); a call before that is refused with 429 again"),
    _K("server_error", None, None, None,
       "HTTP 500, 502 or 503 (chosen deterministically per attempt) with a JSON error body",
       True, PRE_DISPATCH, observed_as=("server_error",),
       policy_rule="act: call again (each attempt is a fresh draw)"),
    _K("timeout", "stall", "duration", 30.0,
       "no answer: the server stalls for the parameter, so the client's read timeout fires "
       "(httpx.ReadTimeout); a client with a longer timeout gets 504",
       True, PRE_DISPATCH, observed_as=("timeout",),
       policy_rule="act: call again"),
    _K("connection", None, None, None,
       "the TCP connection is reset (RST) after the request is sent: httpx.ReadError "
       "(ConnectError is classified the same way)",
       True, PRE_DISPATCH, observed_as=("connection",),
       policy_rule="act: call again"),
    _K("truncated", None, None, None,
       "headers announce Content-Length N, fewer bytes arrive, then the connection closes: "
       "httpx.RemoteProtocolError; the tool DID run",
       True, POST_DISPATCH, observed_as=("truncated",),
       policy_rule="act: call again (the tool ran; its answer was lost)"),
    _K("malformed", None, None, None,
       "HTTP 200, Content-Type application/json, body that is not valid JSON; the tool DID run",
       True, POST_DISPATCH, observed_as=("malformed",),
       policy_rule="act: call again"),
    _K("ip_ban", None, None, None,
       "HTTP 403 (error type ip_banned) that persists for the rest of the episode for this client "
       "identity (X-Reflrl-Client), as when an abuse detector trips after a burst; an identity "
       "change ('IP change') lifts it",
       True, PRE_DISPATCH, observed_as=("ip_ban",), policy_can_act=False,
       policy_rule="masked: the ban holds for the episode's client identity, which the policy cannot "
                   "change, and no other tool serves the call"),
    _K("invalid_file", None, None, None,
       "file tools only: HTTP 200 whose file content is corrupt (NUL bytes / U+FFFD) or HTTP 404 "
       "error type file_missing for a file that exists; other tools are unaffected",
       True, POST_DISPATCH, applies_to="files", observed_as=("invalid_file",),
       policy_rule="act: call again (the storage error is transient)"),
    _K("latency", "delay", "duration", 0.5,
       "a correct answer that arrives after the parameter's delay (a read timeout fires "
       "if the delay exceeds it)",
       False, POST_DISPATCH, observed_as=("latency", "ok", "timeout"),
       policy_rule="nothing to act on: the answer arrives (past the read timeout it is a timeout)"),
    _K("schema_drift", None, None, None,
       "HTTP 200 whose result has one field renamed or missing; detectable only against the "
       "tool's 'returns' schema, otherwise it looks like valid data",
       True, POST_DISPATCH, observed_as=("schema_drift", "ok"),
       policy_rule="act: call again when the client detects it; undetected, it is data"),
    _K("param_renamed", None, None, None,
       "sticky per episode and tool: one parameter of the tool has a new name; a call that uses the "
       "old name gets HTTP 400 (code parameter_renamed) naming both ('param', 'new_param'); a call "
       "that uses the new name is served; the tool does not run on the refused call",
       False, PRE_DISPATCH, observed_as=("param_renamed",), scope=PER_EPISODE_TOOL,
       policy_rule="act: call again with the parameter's new name that the 400 names"),
    _K("tool_moved", None, None, None,
       "sticky per episode and tool: the tool is retired; a call gets HTTP 410 Gone (code "
       "tool_moved) naming its successor ('successor'), which takes the same parameters and is "
       "served but is not in the prompt's tool list",
       False, PRE_DISPATCH, observed_as=("tool_moved",), scope=PER_EPISODE_TOOL,
       policy_rule="act: call the successor the 410 names, with the same arguments"),
]}

#: the kinds of the exclusive per-attempt draw (reflrl.faults.decide), in table order
ATTEMPT_KINDS: tuple[str, ...] = tuple(k.name for k in KINDS.values() if not k.sticky)
#: the API-change kinds (sticky per episode and tool, reflrl.faults.evolve), in table order
CHANGE_KINDS: tuple[str, ...] = tuple(k.name for k in KINDS.values() if k.sticky)

KIND_NAMES: tuple[str, ...] = tuple(KINDS)


def is_file_tool(domain: str | None) -> bool:
    """Whether ``invalid_file`` applies to a tool of this domain ("files" or a bfcl file system)."""
    if not domain:
        return False
    d = domain.lower()
    return d == "files" or (d.startswith("bfcl:") and "file" in d)


def kinds_rows() -> list[dict[str, str]]:
    """One row per kind: kind, param (name=default unit), retried, applies to, client sees, and
    policy (the triage rule under ``env.fault_exposure=policy``)."""
    rows = []
    for k in KINDS.values():
        if k.param is None:
            param = "-"
        else:
            param = f"{k.param} (duration, default {_fmt_seconds(k.param_default)})"
        rows.append({
            "kind": k.name,
            "param": param,
            "retried": "yes" if k.retryable else "no",
            "applies to": k.applies_to,
            "client sees": k.client_sees,
            "policy": k.policy_rule,
        })
    return rows


def format_kinds_table(width: int = 110) -> str:
    """A plain-text table of ``kinds_rows()`` (the 'client sees' column wraps to ``width``)."""
    import textwrap

    rows = kinds_rows()
    cols = ["kind", "param", "retried", "applies to"]
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    lead = sum(widths.values()) + 2 * len(cols)
    text_w = max(30, width - lead)
    head = "  ".join(c.ljust(widths[c]) for c in cols) + "  client sees"
    lines = [head, "-" * min(width, lead + text_w)]
    for r in rows:
        wrapped = textwrap.wrap(r["client sees"], text_w) or [""]
        lines.append("  ".join(r[c].ljust(widths[c]) for c in cols) + "  " + wrapped[0])
        for more in wrapped[1:]:
            lines.append(" " * lead + more)
    lines.append("")
    lines.extend(textwrap.wrap("Under env.fault_exposure=policy a fault the client does not absorb comes back "
                               "to the policy as the tool's answer, and the episode goes on. Per kind:", width))
    kw = max(len(r["kind"]) for r in rows)
    for r in rows:
        wrapped = textwrap.wrap(r["policy"], max(30, width - kw - 4)) or [""]
        lines.append(f"  {r['kind'].ljust(kw)}  {wrapped[0]}")
        lines.extend(" " * (kw + 4) + more for more in wrapped[1:])
    lines.extend(textwrap.wrap(
        "A fault the policy could have acted on and did not: the reward of a wrong answer. A fault met on the "
        "episode's last allowed turn, or one no action can handle: masked, never penalised.", width,
        initial_indent="  ", subsequent_indent="  "))
    lines.append("")
    lines.append("Spec grammar: kind=prob[:param][,kind=prob[:param]...]  e.g. "
                 "rate_limit=0.1,timeout=0.05,latency=0.2:300ms")
    lines.append("Kinds are exclusive per attempt (one uniform draw picks at most one), so the "
                 "probabilities must sum to <= 1.")
    lines.extend(textwrap.wrap(
        f"API changes ({', '.join(CHANGE_KINDS)}) are drawn apart: once per (fault seed, episode, tool), "
        "sticky for the episode (every call of that tool meets the same change; a replay meets it again). "
        "Their rate is the share of (episode, tool) pairs changed; at most one change per pair, so their "
        "probabilities must sum to <= 1 among themselves.", width))
    return "\n".join(lines)


def _fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1 and round(s * 1000) == s * 1000:
        return f"{int(round(s * 1000))}ms"
    return f"{s:g}s"
