"""Decoding speed of the rollout engine with and without reflrl.engines.fast_decode, one run, same inputs.

The workload is the default recipe's held-out evaluation: the 48 test prompts of the synthetic split
(167-535 tokens, rendered exactly as in training), greedy, up to 160 new tokens, all rows decoded
together -- what `reflrl train` runs twice per run. Two settings on the embedded model in bfloat16:

  plain     transformers' DynamicCache + sdpa attention, one left-padded prefill
  fast      reflrl.engines.fast_decode: growing in-place KV cache + copy-free GQA decode attention,
            prompts prefilled in chunks of similar length and the caches merged (the engine's default)

It also checks that both give the same greedy tokens on most rows (bfloat16 rounding can flip a
near-tie late in a sequence) and prints the ratio.

Usage: .venv/bin/python scripts/bench_decode.py [--limit 48] [--max-new-tokens 160] [--threads N]
CPU-heavy (about 4 minutes on 2 cores); run it alone.
"""
from __future__ import annotations

import argparse
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, default=48, help="test prompts decoded together")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import DynamicCache

    import reflrl.engines.transformers_engine as E
    from reflrl import config as C
    from reflrl.envs.prompts import build_messages
    from reflrl.models import load_model
    from reflrl.rollout import render_prompt
    from reflrl.train.data import splits_from_config

    cfg = C.load_config(None)
    tasks = splits_from_config(cfg.data)["test"][: args.limit]
    model, tok = load_model(cfg.model.name, dtype=cfg.model.dtype)  # auto: the precision rule of reflrl.precision
    prompts = [render_prompt(tok, build_messages(t, style=cfg.data.prompt_style, fmt="hermes")) for t in tasks]
    lens = sorted(len(x) for x in prompts)
    print(f"{len(prompts)} prompts, {lens[0]}-{lens[-1]} tokens (mean {sum(lens) / len(lens):.0f}); "
          f"greedy, up to {args.max_new_tokens} new tokens; torch threads {torch.get_num_threads()}")
    eng = E.TransformersEngine(model, tok, max_batch_size=len(prompts))

    def run(label: str):
        t0 = time.perf_counter()
        out = eng.generate(prompts, n=1, max_new_tokens=args.max_new_tokens, temperature=0.0)
        dt = time.perf_counter() - t0
        st = eng.last_stats
        print(f"{label:>6}: {dt:6.1f} s  ({st.new_tokens} new tokens, {st.forward_calls} forward calls, "
              f"{1000 * dt / max(1, st.forward_calls):.0f} ms per forward call)", flush=True)
        return dt, out

    fast_s, fast = run("fast")
    keep = (E.growing_cache, E.fast_decoding, E.length_chunks)
    E.growing_cache = lambda config: DynamicCache(config=config)
    E.fast_decoding = lambda m: torch.inference_mode()
    E.length_chunks = lambda lengths: [list(range(len(lengths)))]
    try:
        plain_s, plain = run("plain")
    finally:
        E.growing_cache, E.fast_decoding, E.length_chunks = keep
    same = sum(a.token_ids == b.token_ids for a, b in zip(fast, plain))
    print(f"speed-up: {plain_s / fast_s:.2f}x (plain {plain_s:.1f} s / fast {fast_s:.1f} s); "
          f"identical greedy outputs on {same} of {len(prompts)} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
