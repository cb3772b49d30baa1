"""Injectable clocks: the real one, and a virtual one so tests and in-process runs never sleep.

A clock has ``monotonic() -> float`` (seconds) and ``async sleep(seconds)``. The client's retry
policy (waits, time budget), the server's latency/timeout faults and the in-process transport all
take the clock as a parameter; sharing one VirtualClock between an in-process server and client
makes a 2 s Retry-After or a 300 ms latency cost no wall time while elapsed times stay exact.
"""
from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """Wall time: ``time.monotonic`` and ``asyncio.sleep``."""

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class VirtualClock:
    """Time that advances only when someone sleeps on it.

    ``sleep(s)`` adds ``s`` to the clock at once (yielding to the event loop once) and records
    ``s`` in ``sleeps``; ``advance(s)`` moves time without recording a sleep. With concurrent
    tasks the clock is a shared counter, not a discrete-event scheduler: elapsed times of
    overlapping sleeps add up, which is fine for tests and for counting.
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += max(0.0, float(seconds))

    async def sleep(self, seconds: float) -> None:
        s = max(0.0, float(seconds))
        self.sleeps.append(s)
        self.now += s
        await asyncio.sleep(0)
