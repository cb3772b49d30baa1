#!/usr/bin/env python
"""Benchmark the tool server + client: calls per second in-process and over loopback HTTP, with
and without faults, and the cost of one fault decision.

    .venv/bin/python scripts/bench_tools.py            # about 30-60 s on 2 cores
    .venv/bin/python scripts/bench_tools.py --calls 500 --loopback-calls 200   # quick

"loopback x8" runs 8 episodes concurrently over one client (a rollout's pattern).
"with faults" = every kind at 5% (latency 10 ms; timeout with a 50 ms client read timeout),
no retries, so each call is one attempt. The last column is the share of a call's time spent in
the fault decision: decision µs × calls/s. Target (issue 2): under 5%.
All figures come from this one run on this machine; nothing is compared with stored numbers.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import timeit

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from reflrl.envs.client import RetryPolicy, ToolClient  # noqa: E402
from reflrl.envs.clock import VirtualClock  # noqa: E402
from reflrl.envs.loopback import ServerThread  # noqa: E402
from reflrl.envs.tool_server import create_app  # noqa: E402
from reflrl.envs.tools.base import ToolSpec  # noqa: E402
from reflrl.faults import KIND_NAMES, FaultPlan, decide  # noqa: E402

READ_TIMEOUT = 0.05
MIXED = ",".join(f"{k}=0.05" + (":10ms" if k == "latency" else ":1s" if k == "timeout" else "")
                 for k in KIND_NAMES)


def _read_file(args, ctx):
    text = f"contents of {args['path']} (seed {ctx.seed})"
    return {"path": args["path"], "content": text, "size_bytes": len(text)}


TOOLS = {"read_file": ToolSpec(
    "read_file", "files", "Read a file.",
    {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    _read_file,
    returns={"type": "object", "required": ["path", "content", "size_bytes"],
             "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                            "size_bytes": {"type": "integer"}}})}


async def _run(client: ToolClient, n: int, spec: str, tag: str, concurrency: int = 1) -> float:
    """Calls over ``n // 100`` episodes of 100 sequential calls, ``concurrency`` episodes at a
    time (as a rollout runs several episodes at once); returns calls per second."""
    per = 100
    eps = max(1, n // per)

    async def episode(e: int) -> None:
        ep = f"{tag}-{e}"
        await client.open_episode(ep, seed=e, faults=spec, fault_seed=e)
        for s in range(per):
            await client.call(ep, step=s, call_index=0, name="read_file",
                              arguments={"path": f"f{s}.txt"})
        await client.close_episode(ep)

    t0 = time.perf_counter()
    for first in range(0, eps, concurrency):
        await asyncio.gather(*(episode(e) for e in range(first, min(eps, first + concurrency))))
    return eps * per / (time.perf_counter() - t0)


async def bench_in_process(n: int, root: str) -> dict[str, float]:
    out = {}
    for label, spec in (("none", "none"), ("mixed", MIXED)):
        app = create_app(TOOLS, sandbox_root=os.path.join(root, f"ip-{label}"))
        client = ToolClient.in_process(app, clock=VirtualClock(), timeout=READ_TIMEOUT,
                                       retry=RetryPolicy.no_retry())
        await _run(client, 200, spec, "warm")
        out[label] = await _run(client, n, spec, "ip")
        rep = client.ledger.reconcile()
        assert rep.exact, rep.format()
        await client.aclose()
    return out


async def bench_loopback(n: int, root: str) -> dict:
    out = {}
    for label, spec in (("none", "none"), ("mixed", MIXED)):
        app = create_app(TOOLS, sandbox_root=os.path.join(root, f"lb-{label}"))
        with ServerThread(app) as srv:
            client = ToolClient.connect(srv.url, timeout=READ_TIMEOUT,
                                        retry=RetryPolicy.no_retry())
            await _run(client, 100, spec, "warm")
            out[label] = await _run(client, n, spec, "lb")
            out[label + "_x8"] = await _run(client, n, spec, "lb8", concurrency=8)
            rep = client.ledger.reconcile()
            await client.aclose()
        out[label + "_exact"] = float(rep.exact)
        out[label + "_mismatch"] = ", ".join(
            f"{m.injected or '-'}->{m.observed or '-'}" for m in rep.mismatches[:5])
    return out


def decision_us() -> float:
    plan = FaultPlan.parse(MIXED)
    n = 200_000
    best = min(timeit.repeat(lambda: decide(plan, 1, "episode-1234", 7, 2, 1), number=n,
                             repeat=3))
    return best / n * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000, help="in-process calls per row")
    ap.add_argument("--loopback-calls", type=int, default=1500, help="loopback calls per row")
    a = ap.parse_args(argv)
    d_us = decision_us()
    with tempfile.TemporaryDirectory(prefix="reflrl-bench-") as root:
        ip = asyncio.run(bench_in_process(a.calls, root))
        lb = asyncio.run(bench_loopback(a.loopback_calls, root))
    print(f"fault plan 'mixed': {MIXED}")
    print(f"client read timeout {READ_TIMEOUT * 1000:.0f} ms, no retries (1 attempt per call); "
          f"cpu count {os.cpu_count()}")
    print()
    print(f"{'transport':<12}{'faults':<8}{'calls/s':>10}{'µs/call':>10}"
          f"{'decision share':>16}")
    rows = [("in-process", ip, "none"), ("in-process", ip, "mixed"), ("loopback", lb, "none"),
            ("loopback", lb, "mixed"), ("loopback x8", lb, "none_x8"),
            ("loopback x8", lb, "mixed_x8")]
    for name, res, key in rows:
        cps = res[key]
        share = d_us * cps / 1e6
        print(f"{name:<12}{key.replace('_x8', ''):<8}{cps:>10.0f}{1e6 / cps:>10.0f}{share:>15.2%}")
    print()
    print(f"one fault decision: {d_us:.2f} µs (blake2b of the attempt coordinates)")
    worst = d_us * max(res[key] for _, res, key in rows) / 1e6
    print(f"decision share of a call's cost, worst row: {worst:.2%} "
          f"({'meets' if worst < 0.05 else 'MISSES'} the < 5% target)")
    for label in ("none", "mixed"):
        if lb[label + "_exact"]:
            print(f"loopback '{label}': ledger reconciled exactly")
        else:  # e.g. '-->timeout': a real read timeout (loaded CPU), nothing injected
            print(f"loopback '{label}': ledger mismatches (injected->observed): "
                  f"{lb[label + '_mismatch']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
