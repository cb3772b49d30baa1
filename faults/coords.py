"""The attempt coordinates a client sends with every tool call, and the rules they must follow.

Every ``POST /v1/call/{tool}`` carries::

    X-Reflrl-Episode   the episode id            (EPISODE_ID_RE: 1-128 chars of A-Z a-z 0-9 . _ ~ -,
                                                  starting with a letter or digit)
    X-Reflrl-Step      the env step              (ASCII digits, 1-9 of them: 0 .. 999,999,999)
    X-Reflrl-Call      the call index in it      (same)
    X-Reflrl-Attempt   the attempt of that call  (same)
    X-Reflrl-Client    the client identity       (optional, default "anonymous";
                                                  CLIENT_RE: 1-128 chars of A-Z a-z 0-9 . _ ~ : @ + -)

The fault decision is a pure function of these (``reflrl.faults.decide``), so a call whose
coordinates are missing or malformed cannot be given its fault: the server answers it with
400 ``bad_header`` naming the header instead of running it fault-free (``parse_coords``).
The episode id alphabet is URL-safe, so ``DELETE /v1/episodes/{id}`` always reaches the episode.

Pure standard library; the server and the client import the header names from here.
"""
from __future__ import annotations

import re
import reprlib
from dataclasses import dataclass

H_EPISODE = b"x-reflrl-episode"
H_STEP = b"x-reflrl-step"
H_CALL = b"x-reflrl-call"
H_ATTEMPT = b"x-reflrl-attempt"
H_CLIENT = b"x-reflrl-client"

MAX_ID_CHARS = 128
MAX_COORD_DIGITS = 9
EPISODE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._~-]{0,127}")
CLIENT_RE = re.compile(r"[A-Za-z0-9._~:@+-]{1,128}")
_DIGITS_RE = re.compile(rb"[0-9]{1,%d}" % MAX_COORD_DIGITS)


@dataclass(frozen=True)
class Coords:
    """The coordinates of one attempt (see the module docstring)."""

    episode: str
    step: int
    call: int
    attempt: int
    client: str = "anonymous"


class CoordError(ValueError):
    """A missing or malformed coordinate header; ``header`` names it (as sent, e.g. X-Reflrl-Step)."""

    def __init__(self, header: str, message: str) -> None:
        super().__init__(f"{header}: {message}")
        self.header = header


def episode_id_problem(eid: object) -> str | None:
    """Why ``eid`` is not a valid episode id, or None when it is."""
    if not isinstance(eid, str) or not eid:
        return "episode id must be a non-empty string"
    if len(eid) > MAX_ID_CHARS:
        return f"episode id is {len(eid)} chars long, the limit is {MAX_ID_CHARS}"
    if not EPISODE_ID_RE.fullmatch(eid):
        return (f"episode id {clip_repr(eid)} has characters outside A-Z a-z 0-9 . _ ~ - "
                "(or does not start with a letter or digit)")
    return None


def parse_coords(headers) -> Coords:
    """Coords from ASGI headers (a list of (name, value) byte pairs); raises CoordError."""
    found: dict[bytes, bytes] = {}
    for name, value in headers:
        if name.startswith(b"x-reflrl-"):
            if name in found:
                raise CoordError(_title(name), "given more than once")
            found[name] = value
    raw = found.get(H_EPISODE)
    if raw is None:
        raise CoordError(_title(H_EPISODE), "missing (open an episode with POST /v1/episodes and "
                         "send its id with every call)")
    eid = raw.decode("latin-1")
    problem = episode_id_problem(eid)
    if problem is not None:
        raise CoordError(_title(H_EPISODE), problem)
    nums = []
    for h in (H_STEP, H_CALL, H_ATTEMPT):
        v = found.get(h)
        if v is None:
            raise CoordError(_title(h), "missing (the fault decision needs every coordinate)")
        if not _DIGITS_RE.fullmatch(v):
            raise CoordError(_title(h), f"{clip_repr(v.decode('latin-1'))} is not a whole number "
                             f"of 1 to {MAX_COORD_DIGITS} ASCII digits")
        nums.append(int(v))
    client = "anonymous"
    v = found.get(H_CLIENT)
    if v is not None:
        client = v.decode("latin-1")
        if not CLIENT_RE.fullmatch(client):
            raise CoordError(_title(H_CLIENT), f"{clip_repr(client)} is not 1-128 chars of "
                             "A-Z a-z 0-9 . _ ~ : @ + -")
    return Coords(eid, nums[0], nums[1], nums[2], client)


def clip_repr(value: object, limit: int = 40) -> str:
    """A repr of ``value`` of about ``limit`` characters at most: error messages quote a short
    prefix of what was sent, never the whole of a huge value (``reprlib`` elides containers)."""
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return repr(value[:limit]) + f"... ({len(value)} chars)"
    r = _REPR.repr(value)
    return r if len(r) <= limit + 10 else r[:limit] + "..."


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 40
_REPR.maxlevel = 3


def _title(name: bytes) -> str:
    return "-".join(p.capitalize() for p in name.decode().split("-"))
