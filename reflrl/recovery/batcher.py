"""Batched generation for concurrent repairs: one engine call per attempt round."""
from __future__ import annotations

import asyncio
from typing import Any, Callable

from .reflection import Generation


class RoundBatcher:
    """Collects the ``generate`` requests of concurrent repairs and serves them in one batch.

    ``n`` coroutines share it; each calls :meth:`generate` (awaits a sample) zero or more times and
    :meth:`done` once when it finishes. When every live coroutine is waiting for a sample, all pending
    requests (whatever the caller asks with: q*'s messages and its token cap, in the trainer) go to
    ``sample(list of requests) -> list of Generation`` in ONE call (one attempt round), in the order of
    their ``key`` (the caller's own number, e.g. the rollout repaired), not in the order they arrived:
    coroutines that wait on tools arrive in an order the machine's timing decides, and a batch's order
    reaches its samples (which prompts share a prefill, which random numbers a row draws). Errors of
    ``sample`` are raised in every waiting coroutine.
    """

    def __init__(self, n: int, sample: Callable[[list[Any]], list[Generation]]):
        self.live = int(n)
        self.sample = sample
        self.pending: list[tuple[int, Any, asyncio.Future]] = []
        self.calls = 0
        self.sizes: list[int] = []

    async def generate(self, request: Any, key: int = 0) -> Generation:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((key, request, fut))
        self._maybe_flush()
        return await fut

    def done(self) -> None:
        self.live -= 1
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if not self.pending or len(self.pending) < self.live:
            return
        batch = [(r, f) for _k, r, f in sorted(self.pending, key=lambda e: e[0])]  # stable sort: by key
        self.pending = []
        self.calls += 1
        self.sizes.append(len(batch))
        try:
            gens = self.sample([m for m, _ in batch])
            if len(gens) != len(batch):
                raise RuntimeError(f"sampler returned {len(gens)} generations for {len(batch)} prompts")
        except Exception as e:  # noqa: BLE001 - delivered to every waiter
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
            return
        for (_, fut), g in zip(batch, gens):
            if not fut.done():
                fut.set_result(g)
