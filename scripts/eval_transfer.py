"""Did training transfer? The base model and a trained run folder on the same benchmarks, then
``reflrl eval compare`` of the two (which differences exceed seed noise).

    python scripts/eval_transfer.py RUN_DIR [--base-model smollm2-135m-instruct] [--limit 20] [--seeds 2]
        [--data-dir ../shared/benchmarks] [--dtype float32] [--benchmarks rotbench,taskbench,bfcl]
        [--base-results DIR] [--out DIR] [-- extra 'reflrl eval' options]

Runs, in child processes, ``reflrl eval BENCH... --model BASE`` and ``reflrl eval BENCH... --model
RUN_DIR`` (its final checkpoint) with identical options, then ``reflrl eval compare`` on the two
result folders; writes ``OUT/base``, ``OUT/trained`` and ``OUT/compare.txt`` (OUT defaults to
``runs/eval/transfer-<run name>``). ``--base-results DIR`` reuses an earlier base evaluation (compare
warns if its options differ).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path


def _eval(model: str, out: Path, args: argparse.Namespace, extra: list[str]) -> float:
    cmd = [sys.executable, "-m", "reflrl", "eval", *args.benchmarks.split(","), "--model", model,
           "--limit", str(args.limit), "--seeds", str(args.seeds), "--dtype", args.dtype, "--out", str(out)]
    if args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    cmd += extra
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a 'reflrl train' run folder")
    p.add_argument("--base-model", default="smollm2-135m-instruct", help="the model the run started from")
    p.add_argument("--benchmarks", default="rotbench,taskbench,bfcl")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--data-dir", default=None, help="folder with rotbench/, taskbench/ (see reflrl eval --help)")
    p.add_argument("--dtype", default="float32", help="model precision (float32 on CPUs without native bfloat16)")
    p.add_argument("--base-results", default=None, help="reuse this base-model evaluation folder")
    p.add_argument("--out", default=None)
    args, extra = p.parse_known_args()
    extra = [x for x in extra if x != "--"]
    run = Path(args.run)
    if not (run / "checkpoints").is_dir():
        p.error(f"{run}: not a reflrl run folder (no checkpoints/)")
    out = Path(args.out) if args.out else Path("runs") / "eval" / f"transfer-{run.resolve().name}"
    if args.base_results:
        base = Path(args.base_results)
    else:
        base = out / "base"
        print(f"base model: {_eval(args.base_model, base, args, extra):.0f} s", flush=True)
    print(f"trained run: {_eval(str(run), out / 'trained', args, extra):.0f} s", flush=True)
    cmp = subprocess.run([sys.executable, "-m", "reflrl", "eval", "compare", str(base), str(out / "trained")],
                         check=True, capture_output=True, text=True).stdout
    (out / "compare.txt").write_text(cmp)
    print(cmp)
    print(f"wrote {out}/compare.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
