"""Benchmark of the evaluation harness (prints numbers measured in this run).

1. Scoring throughput: every BFCL single-turn entry of the package (python AST + relevance
   categories) scored with its gold answer as the model output (entries per second). This doubles as
   a self-check of the harness: each AST entry must score correct, except entries whose gold answer
   contradicts the function doc in bfcl's own data (listed; no output can be correct for them), and
   each irrelevance entry must score correct with a refusal as output.
2. Generation: the time per seed of a small run (``--model``, default the tiny random model; pass
   ``--model smollm2-135m-instruct`` for the embedded model) on ``--limit`` entries of simple_python.

    python scripts/bench_eval.py [--model NAME] [--limit 4] [--seeds 2] [--skip-generation]
"""
from __future__ import annotations

import argparse
import sys
import time


def scoring(args: argparse.Namespace) -> int:
    from reflrl.eval import bfcl as B

    B.bfcl()
    cats = [c for c in B.SINGLE_TURN if B.language_of(c) == "python"]
    t0 = time.perf_counter()
    entries = {c: B.load_entries(c) for c in cats}
    t_load = time.perf_counter() - t0
    n = 0
    wrong: list[tuple[str, str]] = []
    t0 = time.perf_counter()
    for c, es in entries.items():
        for e in es:
            if c in B.RELEVANCE:
                out = "I cannot answer that with the given functions." if "irrelevance" in c else \
                    "[" + e.prompt["function"][0]["name"] + "()]"
            else:
                out = B.gold_output(e.ground_truth, e.check_prompt["function"])
            v = B.score_single(e, out)
            n += 1
            if not v["valid"]:
                wrong.append((e.id, str(v.get("error"))[:100]))
    dt = time.perf_counter() - t0
    print(f"BFCL single-turn scoring: {n} entries in {dt:.2f}s = {n / dt:.0f} entries/s "
          f"(loading the data: {t_load:.2f}s; categories: {', '.join(cats)})")
    # live_relevance: any call counts; our "call the first function with no args" is a call
    known = {"live_simple_106-63-0", "live_simple_112-68-0", "live_multiple_507-149-4",
             "live_multiple_862-181-3", "live_multiple_964-207-0"}
    unexpected = [w for w in wrong if w[0] not in known]
    print(f"self-check: {n - len(wrong)}/{n} correct; {len(wrong)} not: "
          f"{len(wrong) - len(unexpected)} known bfcl data inconsistencies (gold contradicts the function doc)")
    for i, err in wrong:
        print(f"  {'known' if i in known else 'UNEXPECTED'} {i}: {err}")
    return 1 if unexpected else 0


def generation(args: argparse.Namespace) -> None:
    from reflrl.eval.backends import Decoding, LocalBackend
    from reflrl.eval.run import EvalOptions, run_eval

    t0 = time.perf_counter()
    backend = LocalBackend(args.model, dtype=args.dtype, batch_size=args.batch_size, threads=args.threads)
    t_load = time.perf_counter() - t0
    opts = EvalOptions(benchmarks=["bfcl"], limit=args.limit, seeds=list(range(args.seeds)),
                       decoding=Decoding(temperature=0.7, max_new_tokens=args.max_new_tokens),
                       categories=["simple_python"])
    res = run_eval(backend, opts, out_dir=None, log=lambda m: None)
    per_seed = res["timing"]["seconds_per_seed"]
    print(f"\ngeneration ({args.model}, {args.dtype}, {backend.describe()['torch_threads']} threads, "
          f"{args.limit} simple_python prompts, "
          f"{args.max_new_tokens} new tokens max, batch {args.batch_size}): model load {t_load:.1f}s; "
          + ", ".join(f"seed {s}: {t:.1f}s" for s, t in zip(range(args.seeds), per_seed))
          + f"; mean {sum(per_seed) / len(per_seed):.1f}s per seed = "
          f"{args.limit * len(per_seed) / sum(per_seed):.2f} prompts/s; "
          f"{res['backend_stats'].get('new_tokens', 0)} new tokens in all")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--skip-generation", action="store_true")
    args = p.parse_args()
    rc = scoring(args)
    if not args.skip_generation:
        generation(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
