"""Torch CPU threads under a busy machine: does another process cost a proportional slowdown or a collapse?

On a 2-core machine torch's default (2 OpenMP threads, GNU OpenMP's spin-then-sleep barriers) has been
seen to run 10-100x slower when other CPU-bound processes run. This script measures, on the embedded
model in the precision ``model.dtype=auto`` picks here, three workloads of a training run:

* ``matmul``   one prefill-sized GEMM (256x576x1536), 20 times;
* ``decode``   greedy decoding, 8 prompts x 32 new tokens (many small ops: rollouts and evaluations);
* ``train``    forward+backward of 2 x 192 tokens with the top 6 layers trainable (the updates);

under three settings: 1 thread; 2 threads with OpenMP's default wait policy; 2 threads with
``OMP_WAIT_POLICY=PASSIVE`` (what the ``reflrl`` command sets: reflrl.threads), each on the idle
machine, beside a ``nice -n 19`` busy loop, and beside a busy loop at normal priority. Each case runs in
a fresh process (OpenMP reads its settings when torch loads). It prints each case's median seconds and
its slowdown against the same setting on the idle machine, all measured in this one run.

    python scripts/bench_threads.py          # about 5 minutes on 2 cores; give it the machine
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
        from reflrl.engines.transformers_engine import TransformersEngine

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


SETTINGS = (("1 thread", 1, {}), ("2 threads, default wait", 2, {}),
            ("2 threads, PASSIVE (reflrl)", 2, {"OMP_WAIT_POLICY": "PASSIVE"}))


def case(workload: str, threads: int, background: str, env_over: dict, repeats: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(env_over)
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
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.threads, args.repeats)))
        return 0
    import torch

    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} logical CPUs, "
          f"torch {torch.__version__}", flush=True)
    res: dict[tuple[str, str, str], float] = {}
    for wl in args.workloads.split(","):
        for label, threads, env in SETTINGS:
            for bg in BACKGROUNDS:
                r = case(wl, threads, bg, env, args.repeats)
                res[(wl, label, bg)] = r["median_s"]
                print(f"{wl:7s} {label:28s} {bg:7s} {r['median_s']:8.3f}s  ({r['dtype']})", flush=True)
    print("\nmedian seconds, and the slowdown a background process causes (time / the same setting idle)")
    print(f"{'workload':8s} {'setting':28s} {'idle s':>8s} {'nice19':>8s} {'busy':>8s} {'busy s':>8s}")
    for wl in args.workloads.split(","):
        for label, _, _ in SETTINGS:
            idle = res[(wl, label, "idle")]
            print(f"{wl:8s} {label:28s} {idle:8.3f} {res[(wl, label, 'nice19')] / idle:7.2f}x "
                  f"{res[(wl, label, 'busy')] / idle:7.2f}x {res[(wl, label, 'busy')]:8.3f}")
        one, two = res[(wl, "1 thread", "idle")], res[(wl, "2 threads, PASSIVE (reflrl)", "idle")]
        print(f"{wl:8s} idle: reflrl's 2 PASSIVE threads are {one / two:.2f}x as fast as 1 thread")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
