"""Progress of a run, readable on a terminal and in a log file alike.

On a terminal each phase with steps gets a tqdm bar. When the stream is not a terminal (CI logs,
``nohup``, a pipe) bars would print nothing useful for minutes, so plain lines are written instead:
one when a phase starts and ends, and one every ``every_steps`` steps (about ten per phase) or
``every_s`` seconds, whichever comes first, each with the run's elapsed time, the phase's rate and
its ETA::

    [reflrl] 03:12 warm-up 40/120 steps (loss 0.41), 4.1 s/step, phase ETA 05:28

The clock is injectable (tests); nothing here changes what a run computes.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO


def clock_text(seconds: float) -> str:
    """``mm:ss``, or ``h:mm:ss`` from an hour on."""
    s = max(0, int(round(seconds)))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m:02d}:{sec:02d}"


def _postfix_text(postfix: dict[str, Any]) -> str:
    parts = []
    for k, v in postfix.items():
        parts.append(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}")
    return f" ({', '.join(parts)})" if parts else ""


class Phase:
    """One phase's progress (see :class:`Progress.phase`)."""

    def __init__(self, owner: "Progress", name: str, total: int, unit: str, initial: int):
        self.owner, self.name, self.total, self.unit = owner, name, int(total), unit
        self.done = int(initial)
        self.t0 = owner.clock()
        self.start_done = self.done
        self.last_line_t = self.t0
        self.last_line_done = self.done
        self.bar = None
        self.every_steps = max(1, self.total // 10)
        if owner.tty and owner.enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, initial=self.done, desc=name, unit=unit, dynamic_ncols=True,
                            leave=False, file=owner.stream)
        elif owner.enabled:
            owner.line(f"{name}: {self.done}/{self.total} {unit}s")

    def seconds_per_step(self) -> float | None:
        n = self.done - self.start_done
        return (self.owner.clock() - self.t0) / n if n > 0 else None

    def eta_s(self) -> float | None:
        sps = self.seconds_per_step()
        return None if sps is None else sps * max(0, self.total - self.done)

    def update(self, n: int = 1, **postfix: Any) -> None:
        self.done += n
        if not self.owner.enabled:
            return
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix({k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in postfix.items()})
            return
        now = self.owner.clock()
        due = (self.done - self.last_line_done >= self.every_steps or now - self.last_line_t >= self.owner.every_s
               or self.done >= self.total)
        if not due:
            return
        self.last_line_t, self.last_line_done = now, self.done
        sps = self.seconds_per_step()
        rate = f", {sps:.1f} s/{self.unit}" if sps is not None else ""
        eta = self.eta_s()
        tail = f", phase ETA {clock_text(eta)}" if eta is not None and self.done < self.total else ""
        extra = self.owner.run_eta(self)
        self.owner.line(f"{self.name} {self.done}/{self.total} {self.unit}s{_postfix_text(postfix)}{rate}{tail}{extra}")

    def close(self, note: str = "") -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.owner.enabled:
            took = self.owner.clock() - self.t0
            self.owner.line(f"{self.name} done: {self.done}/{self.total} {self.unit}s in {clock_text(took)}"
                            + (f"; {note}" if note else ""))


class Progress:
    """Phase progress for a run that started at ``start`` (on ``clock``).

    enabled: False prints nothing (``--quiet`` / ``--no-progress``); tty: bars (True) or lines (False),
    default: whether ``stream`` is a terminal; every_s: at most this long between lines.
    ``remaining_after``: optional callable giving the estimated seconds of the phases after the
    current one (the trainer's plan), so lines can also show when the run should end.
    """

    def __init__(self, *, enabled: bool = True, stream: TextIO | None = None, tty: bool | None = None,
                 every_s: float = 60.0, clock: Callable[[], float] = time.monotonic, start: float | None = None,
                 remaining_after: Callable[[], float | None] | None = None):
        self.stream = stream if stream is not None else sys.stdout
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty
        self.every_s = float(every_s)
        self.clock = clock
        self.start = clock() if start is None else start
        self.remaining_after = remaining_after

    def elapsed(self) -> float:
        return self.clock() - self.start

    def line(self, msg: str) -> None:
        """A progress line with the run's elapsed time (lines mode; on a terminal it is printed too)."""
        print(f"[reflrl] {clock_text(self.elapsed())} {msg}", file=self.stream, flush=True)

    def phase(self, name: str, total: int, *, unit: str = "step", initial: int = 0) -> Phase:
        return Phase(self, name, total, unit, initial)

    def run_eta(self, phase: Phase) -> str:
        if self.remaining_after is None:
            return ""
        eta, later = phase.eta_s(), self.remaining_after()
        if eta is None or later is None:
            return ""
        return f", run ends in ~{clock_text(eta + later)}"
