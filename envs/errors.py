"""What a tool call can come back as, other than a valid answer: the exception tree IS the taxonomy.

Like httpx's exception hierarchy, one class per thing a client can see, grouped by who is to blame::

    ToolCallError               any attempt that did not give a valid result
    ├── ToolFault               triage "env_fault": the environment failed, not the model.
    │   │                       ``kind`` is a fault kind of reflrl.faults; retried when
    │   │                       ``FaultKind.retryable`` says so (``retryable_faults()``)
    │   ├── RateLimited         rate_limit    429; ``retry_after`` from the Retry-After header
    │   ├── ToolTimeout         timeout       504, 408, httpx.TimeoutException
    │   ├── ConnectionReset     connection    httpx.NetworkError (ReadError, ...), OSError
    │   ├── ServerError         server_error  500/502/503 and any other 5xx (``status``)
    │   ├── BadBody             (the body cannot be used as an answer)
    │   │   ├── TruncatedBody   truncated     httpx.RemoteProtocolError (fewer bytes than
    │   │   │                                 its Content-Length)
    │   │   └── MalformedBody   malformed     a 2xx body that is not JSON or has no "result";
    │   │                                     httpx.DecodingError
    │   ├── Banned              ip_ban        403 (retried only after an identity change)
    │   ├── InvalidFile         invalid_file  404 file_missing; a result with NUL / U+FFFD
    │   ├── SchemaDrift         schema_drift  a result that fails the tool's ``returns`` schema
    │   └── ApiChanged          (the API changed under the client: a retry cannot help, the
    │       │                   policy can change the call; never retried)
    │       ├── ParamRenamed    param_renamed 400 code parameter_renamed (``param``, ``new_param``)
    │       └── ToolMoved       tool_moved    410 code tool_moved (``successor``)
    ├── PolicyError             triage "policy_error": the model's mistake; never retried
    │   ├── UnknownTool         404 unknown_tool (a tool this episode does not offer)
    │   └── InvalidArguments    422 invalid_arguments (schema violation, not a JSON object)
    │                           (any other 4xx, e.g. the tool's 422 not_found: PolicyError)
    └── ToolBug                 triage "tool_bug": 500 tool_bug, the tool's handler crashed on
                                valid arguments; never retried, counted apart from faults
    ToolClientError             not a tool outcome: a client/protocol bug (400, 404
                                unknown_episode, an episode that cannot be opened): raised
                                to the caller

Every ToolCallError carries what the client saw: ``status`` (HTTP status, None for a transport
error), ``detail`` (the short specifics the ledger records: "503", "retry_after=2.0",
"ReadTimeout", "invalid_arguments", ...), ``retry_after`` (seconds, RateLimited only), ``code`` and
``server_message`` (the error body's code, else its type, and its message, when the server sent one),
``error_fields`` (the error body's other string fields, e.g. ``param`` / ``new_param``) and its
``triage`` and ``kind``: the observed ``FaultEvent`` (reflrl.faults.ledger) the client records for
that attempt takes triage, kind, status and detail from it (a slow answer is not an error: an answer slower than the
client's threshold, error answers included, is recorded with kind "latency"). ``str(error)`` is
the short message; :meth:`ToolCallError.observation` the line an API's caller sees (status, reason,
the server's message and error code, Retry-After), which is what a policy is shown when a fault comes
back to it (``fault_exposure="policy"`` of the envs).

The kind names and which kinds are retried live once, in ``reflrl.faults.kinds.KINDS``; this
module maps each kind to its class (``FAULTS``) and reads ``retryable`` from there.
"""
from __future__ import annotations

from http import HTTPStatus
from typing import ClassVar

from reflrl.faults.kinds import KINDS


class ToolClientError(RuntimeError):
    """A client/protocol bug (unknown episode, bad request), not a tool outcome."""


class ToolCallError(Exception):
    """An attempt that did not give a valid result (module doc: the tree and what each carries)."""

    triage: ClassVar[str] = ""
    kind: ClassVar[str | None] = None

    def __init__(self, message: str, *, status: int | None = None, detail: str = "",
                 retry_after: float | None = None, code: str | None = None,
                 server_message: str | None = None, error_fields: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail
        self.retry_after = retry_after
        self.code = code
        self.server_message = server_message
        self.error_fields = dict(error_fields or {})

    def observation(self) -> str:
        """The failure as an API's caller sees it, one line: ``HTTP 429 Too Many Requests: too many
        requests (rate_limited); Retry-After: 2``; ``HTTP 200 OK: response body is not valid JSON``
        for an unusable 2xx answer; ``no HTTP answer: ReadTimeout: timed out`` for a transport
        error. The error code is the error body's ``type``; Retry-After is shown when the server
        sent one."""
        if self.status is None:
            text = f"no HTTP answer: {self}"
        else:
            try:
                phrase = HTTPStatus(self.status).phrase
            except ValueError:
                phrase = ""
            msg = self.server_message or str(self)
            text = f"HTTP {self.status}{' ' + phrase if phrase else ''}: {msg}"
            if self.code:
                text += f" ({self.code})"
        if self.retry_after is not None:
            ra = self.retry_after
            text += f"; Retry-After: {int(ra) if float(ra).is_integer() else ra:g}"
        return text

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({str(self)!r}, status={self.status!r}, "
                f"detail={self.detail!r}, retry_after={self.retry_after!r})")


# ---- the environment's faults -----------------------------------------------------------------
#: fault kind -> the class a client raises for it, filled as the classes below are defined
#: ("latency" has none: a slow answer is an answer)
FAULTS: dict[str, type["ToolFault"]] = {}


class ToolFault(ToolCallError):
    """An environment fault (triage "env_fault"); ``kind`` names its fault kind. A subclass that
    is one kind says so in its class line (``class RateLimited(ToolFault, kind="rate_limit")``)
    and is registered in ``FAULTS``."""

    triage = "env_fault"

    def __init_subclass__(cls, kind: str | None = None, **kw) -> None:
        super().__init_subclass__(**kw)
        if kind is not None:
            if kind not in KINDS or kind in FAULTS:
                raise TypeError(f"{cls.__name__}: kind {kind!r} is not a fault kind of "
                                f"reflrl.faults.kinds, or already has a class")
            cls.kind = kind
            FAULTS[kind] = cls


class RateLimited(ToolFault, kind="rate_limit"):
    """429 Too Many Requests; ``retry_after``: the Retry-After header in seconds (None if absent
    or unreadable), the least the retry policy waits."""


class ToolTimeout(ToolFault, kind="timeout"):
    """No answer in time: the read timeout fired (httpx.TimeoutException), or 504 / 408."""


class ConnectionReset(ToolFault, kind="connection"):
    """The connection was reset or refused (httpx.NetworkError, OSError)."""


class ServerError(ToolFault, kind="server_error"):
    """A 5xx other than a tool bug (500, 502, 503, ...)."""


class BadBody(ToolFault):
    """The answer's body cannot be used (truncated on the wire or not the JSON the API promises)."""


class TruncatedBody(BadBody, kind="truncated"):
    """Fewer body bytes than the Content-Length announced (httpx.RemoteProtocolError); the tool
    ran."""


class MalformedBody(BadBody, kind="malformed"):
    """A 2xx body that is not JSON, or JSON without "result" (or undecodable content)."""


class Banned(ToolFault, kind="ip_ban"):
    """403: this client identity is banned for the episode; a new identity lifts it."""


class InvalidFile(ToolFault, kind="invalid_file"):
    """A file tool answered 404 file_missing for a file that exists, or content with NUL /
    U+FFFD."""


class SchemaDrift(ToolFault, kind="schema_drift"):
    """A result that fails the tool's declared ``returns`` schema (a field renamed or missing)."""


class ApiChanged(ToolFault):
    """The API changed under the client (a deploy): the call as written cannot succeed again, so it is
    never retried; the server's answer says how to change it."""


class ParamRenamed(ApiChanged, kind="param_renamed"):
    """400 with code parameter_renamed: the tool takes ``new_param`` in place of ``param``."""

    @property
    def param(self) -> str | None:
        return self.error_fields.get("param")

    @property
    def new_param(self) -> str | None:
        return self.error_fields.get("new_param")


class ToolMoved(ApiChanged, kind="tool_moved"):
    """410 Gone with code tool_moved: the tool is retired; ``successor`` takes the same arguments."""

    @property
    def successor(self) -> str | None:
        return self.error_fields.get("successor")


def retryable_faults() -> tuple[type[ToolFault], ...]:
    """The fault classes whose kind is retryable (``FaultKind.retryable``, reflrl.faults.kinds)."""
    return tuple(cls for kind, cls in FAULTS.items() if KINDS[kind].retryable)


# ---- the model's mistakes and the tool's bugs -------------------------------------------------
class PolicyError(ToolCallError):
    """The model's mistake (triage "policy_error"): a 4xx the tool server answered on purpose.
    ``detail`` is the server's error type (``not_found``, ``forbidden_path``, ...)."""

    triage = "policy_error"


class UnknownTool(PolicyError):
    """A tool this episode does not offer (404 unknown_tool)."""


class InvalidArguments(PolicyError):
    """Arguments that fail the tool's parameter schema, or are not a JSON object (422)."""


class ToolBug(ToolCallError):
    """The tool's handler crashed on valid arguments (500 tool_bug): neither the model's fault nor
    an injected one; never retried."""

    triage = "tool_bug"
