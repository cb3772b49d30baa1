"""Torch CPU threads under a busy machine: does another process cost a proportional slowdown or a collapse?

On a 2-core machine torch's default (2 OpenMP threads, GNU OpenMP's spin-then-sleep barriers) has been
seen to run 10-100x slower when one other CPU-bound process runs. This script measures, on the embedded
model in the precision ``model.dtype=auto`` picks here, three workloads of a training run:

* ``matmul``   one prefill-sized GEMM (256x576x1536), repeated;
* ``decode``   greedy decoding, 8 prompts x 32 new tokens (many small ops: the rollouts and evaluations);
* ``train``    forward+backward of 2 x 192 tokens with the top 6 layers trainable (the updates);

for every combination of: torch threads 1 and 2; no background process, a ``nice -n 19`` busy loop, a
busy loop at normal priority; and (with ``--wait-policy``) ``OMP_WAIT_POLICY=PASSIVE``. Each case runs
in a fresh process (the OpenMP runtime reads its settings when torch loads). It prints each case's
median seconds and its slowdown against the same threads on the idle machine, all measured in this one
run, so the ratios hold whatever the machine's speed.

    python scripts/bench_threads.py                 # about 5 minutes on 2 cores
    python scripts/bench_threads.py --wait-policy   # also OMP_WAIT_POLICY=PASSIVE (twice as long)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORKLOADS = ("matmul", "decode", "train")
BACKGROUNDS = ("idle", "nice19", "busy")


def worker(workload: str, threads: int, repeats: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from reflrl.models import load_model
    from reflrl.precision import resolve_dtype

    dtype = resolve_dtype("auto").dtype
    if workload == "matmul":
        a = torch.randn(256, 576).to(getattr(torch, dtype))
        b = torch.randn(576, 1536).to(getattr(torch, dtype))

        def run() -> None:
            for _ in range(20):
                torch.matmul(a, b)
    elif workload == "decode":
        from reflrl.engine import TransformersEngine

        model, tok = load_model("smollm2-135m-instruct", dtype=dtype, trainable="none")
        eng = TransformersEngine(model, tok)
        prompts = [tok(f"Write a short note number {i} about the weather.")["input_ids"] for i in range(8)]

        def run() -> None:
            eng.generate(prompts, n=1, max_new_tokens=32, temperature=0.0, stop_ids=[])
    else:
        from reflrl.logprobs import sequence_logprobs

        model, tok = load_model("smollm2-135m-instruct", dtype=dtype, trainable="top_layers:6")
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(100, 40000, (2, 192), generator=g)
        attn = torch.ones_like(ids)
        resp = torch.zeros_like(ids)
        resp[:, 128:] = 1

        def run() -> None:
            lp = sequence_logprobs(model, ids, attn, resp)
            (-(lp * resp).sum() / resp.sum()).backward()
            model.zero_grad(set_to_none=True)

    run()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "dtype": dtype}


def case(workload: str, threads: int, background: str, passive: bool, repeats: int) -> dict:
    env = dict(os.environ)
    if passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    bg = None
    if background != "idle":
        cmd = [sys.executable, "-c", "while True: pass"]
        bg = subprocess.Popen(cmd, preexec_fn=(lambda: os.nice(19)) if background == "nice19" else None)
        time.sleep(0.5)
    try:
        out = subprocess.run([sys.executable, __file__, "--worker", workload, "--threads", str(threads),
                              "--repeats", str(repeats)], env=env, capture_output=True, text=True, timeout=1800)
    finally:
        if bg is not None:
            bg.kill()
            bg.wait()
    if out.returncode != 0:
        raise RuntimeError(f"{workload} threads={threads} {background}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=WORKLOADS, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=3, help="timed repetitions per case (median reported)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of " + ", ".join(WORKLOADS))
    ap.add_argument("--wait-policy", action="store_true", help="also measure OMP_WAIT_POLICY=PASSIVE")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.threads, args.repeats)))
        return 0
    import torch

    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} logical CPUs, "
          f"torch {torch.__version__}", flush=True)
    policies = [False, True] if args.wait_policy else [False]
    rows = []
    for wl in args.workloads.split(","):
        for passive in policies:
            for threads in (1, 2):
                base = None
                for bg in BACKGROUNDS:
                    r = case(wl, threads, bg, passive, args.repeats)
                    base = r["median_s"] if bg == "idle" else base
                    rows.append((wl, "PASSIVE" if passive else "default", threads, bg, r["median_s"], r["median_s"] / base,
                                 r["dtype"]))
                    print(f"{wl:7s} wait={rows[-1][1]:8s} threads={threads} {bg:7s} {r['median_s']:8.3f}s  "
                          f"x{rows[-1][5]:5.2f} vs idle  ({r['dtype']})", flush=True)
    print("\nsummary: slowdown under one background process (median time / idle median, same settings)")
    print(f"{'workload':8s} {'wait':8s} {'threads':>7s} {'idle s':>8s} {'nice19':>7s} {'busy':>7s}")
    for wl in args.workloads.split(","):
        for pol in ("default", "PASSIVE") if args.wait_policy else ("default",):
            for threads in (1, 2):
                r = {bg: (s, x) for (w, p, t, bg, s, x, _) in rows if w == wl and p == pol and t == threads}
                print(f"{wl:8s} {pol:8s} {threads:7d} {r['idle'][0]:8.3f} {r['nice19'][1]:6.2f}x {r['busy'][1]:6.2f}x")
        one = [s for (w, p, t, bg, s, x, _) in rows if w == wl and p == "default" and t == 1 and bg == "idle"][0]
        two = [s for (w, p, t, bg, s, x, _) in rows if w == wl and p == "default" and t == 2 and bg == "idle"][0]
        print(f"{wl:8s} idle: 2 threads are {one / two:.2f}x as fast as 1")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
