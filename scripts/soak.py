"""Soak the tool server over loopback and print the figures issue 18's acceptance asks for.

    python scripts/soak.py [--calls 10000] [--rounds 5] [--prob 0.05] [--concurrency 32]

A real server process (``python -m reflrl.envs.loopback --port 0``) and a real httpx client. Each
round opens episodes with every fault kind at ``--prob``, makes its share of the calls (a mix of
valid calls to weather, finance, file and messaging tools, whole-number floats for integer
arguments, and about 15% policy errors), and deletes the episodes. Single attempts (no retries):
every call is one billed attempt the ledger must account for. After each round it reads the
server's resident memory (VmRSS), open file descriptors, threads, open episodes, ledger records
(``GET /v1/health``) and sandbox folders. Then it sends four concurrent 50 MB bodies (two announced
by Content-Length, two chunked) and reads the server's peak memory (VmHWM) before and after.

Checks (exit status 1 if one fails): no exception on the client; the ledger reconciles exactly and
injected == observed for every kind; RSS after the last round within 10% of after round 1; 0 open
episodes, 0 ledger records and 0 sandbox folders after each round; fds and threads back to their
round-1 values; the 50 MB bodies refused with 413 without the peak memory growing by more than
64 MB. Timings depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from reflrl.envs.client import RetryPolicy, ToolClient
from reflrl.faults import KIND_NAMES, Ledger

CITIES = ("Paris", "London", "Oslo", "Tokyo", "Lima", "Cairo")
TICKERS = ("AAPL", "MSFT", "NVDA", "KO")


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM (kB) and Threads of a process, and its open file descriptors."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM", "Threads"):
            out[k] = int(v.split()[0])
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def make_call(rng: random.Random, step: int) -> tuple[str, dict]:
    """One call of the mix (name, arguments); about 15% are the policy's errors."""
    r = rng.random()
    if r < 0.08:
        return "get_current_weather", {"city": "Atlantis"}               # unknown city: 422
    if r < 0.15:
        return "get_forecast", {"days": 3}                                # missing city: 422
    choice = rng.randrange(7)
    if choice == 0:
        return "get_current_weather", {"city": rng.choice(CITIES)}
    if choice == 1:
        return "get_forecast", {"city": rng.choice(CITIES), "days": float(rng.randint(1, 7))}
    if choice == 2:
        return "get_stock_quote", {"symbol": rng.choice(TICKERS)}
    if choice == 3:
        return "read_file", {"path": "notes.txt"}
    if choice == 4:
        return "write_file", {"path": f"soak/{step % 5}.txt", "content": "x" * rng.randint(1, 2000),
                              "overwrite": True}
    if choice == 5:
        return "list_messages", {"limit": float(rng.randint(1, 5))}
    return "list_files", {}


async def run_episode(client: ToolClient, eid: str, spec: str, seed: int, n_calls: int,
                      errors: list[str]) -> None:
    rng = random.Random(seed)
    try:
        await client.open_episode(eid, seed=seed, faults=spec, fault_seed=seed)
    except Exception as e:  # noqa: BLE001  counted: the acceptance wants none
        errors.append(f"open {eid}: {type(e).__name__}: {e}")
        return
    for step in range(n_calls):
        name, args = make_call(rng, step)
        try:
            await client.call(eid, step=step, call_index=0, name=name, arguments=args)
        except Exception as e:  # noqa: BLE001
            errors.append(f"call {eid}/{step}: {type(e).__name__}: {e}")
    try:
        await client.close_episode(eid)
    except Exception as e:  # noqa: BLE001
        errors.append(f"close {eid}: {type(e).__name__}: {e}")


async def soak_round(url: str, r: int, args, spec: str, ledger: Ledger, errors: list[str]) -> float:
    per_round = args.calls // args.rounds
    n_eps = max(1, per_round // args.calls_per_episode)
    sem = asyncio.Semaphore(args.concurrency)
    t0 = time.perf_counter()
    async with ToolClient.connect(url, retry=RetryPolicy.no_retry(), ledger=ledger,
                                  timeout=args.read_timeout, slow_threshold_s=args.slow) as client:
        async def one(e: int) -> None:
            async with sem:
                await run_episode(client, f"soak-r{r}-e{e}", spec, 1000 * r + e,
                                  args.calls_per_episode, errors)
        await asyncio.gather(*(one(e) for e in range(n_eps)))
    return time.perf_counter() - t0


async def big_bodies(host: str, port: int) -> list[int]:
    """Four concurrent 50 MB bodies over raw sockets: two announced by Content-Length (the client
    reads the answer after the headers and 64 kB, as a client using Expect would), two chunked
    (sent in 1 MB chunks until the server answers or cuts the connection). Their HTTP statuses,
    -1 when the server closed the connection before the client could read an answer."""
    size = 50 << 20
    head = ("POST /v1/call/get_current_weather HTTP/1.1\r\nHost: soak\r\n"
            "x-reflrl-episode: big\r\nx-reflrl-step: 0\r\nx-reflrl-call: 0\r\n"
            "x-reflrl-attempt: 0\r\ncontent-type: application/json\r\n")

    async def status_of(reader) -> int:
        try:
            line = await asyncio.wait_for(reader.readline(), 30)
            return int(line.split()[1]) if line.startswith(b"HTTP/1.1") else -1
        except (OSError, asyncio.TimeoutError, IndexError, ValueError):
            return -1

    async def announced() -> int:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(f"{head}content-length: {size}\r\n\r\n".encode() + b"x" * (64 << 10))
        await writer.drain()
        st = await status_of(reader)
        writer.close()
        return st

    async def chunked() -> int:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(f"{head}transfer-encoding: chunked\r\n\r\n".encode())
        chunk = b"%x\r\n" % (1 << 20) + b"x" * (1 << 20) + b"\r\n"
        try:
            for _ in range(size >> 20):
                writer.write(chunk)
                await writer.drain()
                if reader.at_eof() or reader._buffer:  # noqa: SLF001  the server answered
                    break
        except OSError:
            pass
        st = await status_of(reader)
        writer.close()
        return st

    return list(await asyncio.gather(announced(), announced(), chunked(), chunked()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=10_000, help="tool calls in all (default 10000)")
    ap.add_argument("--rounds", type=int, default=5, help="open/call/delete rounds (default 5)")
    ap.add_argument("--calls-per-episode", type=int, default=20)
    ap.add_argument("--prob", type=float, default=0.05, help="probability of every kind")
    ap.add_argument("--concurrency", type=int, default=32, help="episodes in flight at once")
    ap.add_argument("--read-timeout", type=float, default=3.0, help="client read timeout (s)")
    ap.add_argument("--slow", type=float, default=0.8, help="client slow threshold (s)")
    args = ap.parse_args(argv)
    spec = ",".join(f"{k}={args.prob:g}" + {"timeout": ":10s", "latency": ":1s"}.get(k, "")
                    for k in KIND_NAMES)

    sandbox_root = Path(tempfile.mkdtemp(prefix="reflrl-soak-"))
    server = subprocess.Popen(
        [sys.executable, "-m", "reflrl.envs.loopback", "--port", "0", "--log-level", "warning",
         "--sandbox-root", str(sandbox_root)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = server.stdout.readline()
    m = re.search(r"http://[\d.]+:\d+", line)
    if m is None:
        print(f"server did not start: {line}{server.stderr.read()}", file=sys.stderr)
        return 1
    url = m.group(0)
    print(f"server {url} (pid {server.pid}); fault spec {spec}")
    ledger, errors, rows = Ledger(), [], []
    ok = True
    try:
        for r in range(1, args.rounds + 1):
            took = asyncio.run(soak_round(url, r, args, spec, ledger, errors))
            time.sleep(0.3)  # let the server notice the closed connections
            st = proc_status(server.pid)
            health = httpx.get(f"{url}/v1/health").json()
            st.update(episodes=health["episodes"], ledger=health["ledger_records"],
                      folders=len(list(sandbox_root.iterdir())), seconds=took)
            rows.append(st)
            print(f"round {r}: {args.calls // args.rounds} calls in {took:.1f}s; server RSS "
                  f"{st['VmRSS'] / 1024:.1f} MB, fds {st['fds']}, threads {st['Threads']}, open "
                  f"episodes {st['episodes']}, ledger records {st['ledger']}, sandbox folders "
                  f"{st['folders']}", flush=True)
        rep = ledger.reconcile()
        print(rep.format())
        t = ledger.totals()
        print(t.format())
        hwm0 = proc_status(server.pid)["VmHWM"]
        httpx.post(f"{url}/v1/episodes", json={"episode_id": "big"})
        host, port = url.rsplit("/", 1)[1].split(":")
        statuses = asyncio.run(big_bodies(host, int(port)))
        httpx.delete(f"{url}/v1/episodes/big")
        time.sleep(0.3)
        hwm1 = proc_status(server.pid)["VmHWM"]
        print(f"4 concurrent 50 MB bodies: statuses {statuses}; server peak RSS {hwm0 / 1024:.1f} "
              f"-> {hwm1 / 1024:.1f} MB")
        first, last = rows[0], rows[-1]
        growth = (last["VmRSS"] - first["VmRSS"]) / first["VmRSS"]
        checks = [
            ("client exceptions", len(errors) == 0, f"{len(errors)} {errors[:3]}"),
            ("calls made", t.calls == args.calls // args.rounds * args.rounds,
             f"{t.calls} calls, {t.attempts} attempts"),
            ("ledger reconciles exactly", rep.exact, f"{len(rep.mismatches)} mismatches"),
            ("injected == observed for every kind (latency: less the slow answers nothing "
             "injected)", all(c.injected == c.matched == c.observed - (
                 rep.slow_not_injected if k == "latency" else 0) for k, c in rep.per_kind.items()),
             ", ".join(f"{k} {c.injected}/{c.observed}" for k, c in rep.per_kind.items())),
            ("RSS after the last round within 10% of round 1", abs(growth) <= 0.10,
             f"{first['VmRSS'] / 1024:.1f} -> {last['VmRSS'] / 1024:.1f} MB ({growth:+.1%})"),
            ("no open episode, ledger record or sandbox folder left after each round",
             all(x["episodes"] == x["ledger"] == x["folders"] == 0 for x in rows),
             f"{[(x['episodes'], x['ledger'], x['folders']) for x in rows]}"),
            ("fds and threads back to round 1's", all(x["fds"] <= first["fds"] and
                                                      x["Threads"] <= first["Threads"]
                                                      for x in rows),
             f"fds {[x['fds'] for x in rows]}, threads {[x['Threads'] for x in rows]}"),
            ("50 MB bodies refused (413), peak RSS +64 MB at most",
             all(s in (413, -1) for s in statuses) and 413 in statuses
             and hwm1 - hwm0 <= 64 * 1024, f"{statuses}, +{(hwm1 - hwm0) / 1024:.1f} MB"),
        ]
        for name, passed, detail in checks:
            ok &= passed
            print(f"{'PASS' if passed else 'FAIL'}  {name}: {detail}")
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
        left = list(sandbox_root.iterdir())
        print(f"server exited with {server.returncode}; sandbox root entries left: {len(left)}")
        ok &= not left
        for p in left:
            print(f"  left: {p}")
        import shutil
        shutil.rmtree(sandbox_root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
