"""Floor of the embedded model on this CPU: sampling and forward+backward costs, one run.

Prints, for SmolLM2-135M-Instruct (the embedded GGUF) in several precision / trainable settings:
- generation of 8 x 64 new tokens after a ~200-token prompt with reflrl's TransformersEngine
  (8 distinct prompts, and 2 prompts x n=4 sharing their prefill), plus transformers'
  ``model.generate`` on the same 8 prompts for reference (bfloat16 only);
- forward+backward ms/token over a batch of 8 x 256 tokens (last 64 of each row are the
  "response" whose log-probs enter the loss, via reflrl.logprobs.sequence_logprobs), the
  forward alone (no grad), and the same batch as 2 prompts x n=4 with the shared 192-token
  prompt run once (reflrl.logprobs.shared_prefix_logprobs).

Usage: .venv/bin/python scripts/bench_floor.py [--threads 2] [--skip-generate] [--skip-train]
It is CPU-heavy (about 2-4 minutes on 2 cores); run it alone.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch

from reflrl.engines.transformers_engine import TransformersEngine
from reflrl.logprobs import sequence_logprobs, shared_prefix_logprobs
from reflrl.models import count_parameters, load_model

NAME = "smollm2-135m-instruct"


def _prompts(tok, k: int, length: int = 200) -> list[list[int]]:
    base = (
        "You are a function calling assistant. Tools: get_weather(city), get_stock(symbol), "
        "book_flight(origin, destination, date). Answer with a <tool_call> JSON object. "
    )
    out = []
    for i in range(k):
        text = f"Request {i}: " + base * 20
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        ids = tok(ids, add_special_tokens=False)["input_ids"]
        out.append(ids[-length:])
    return out


def bench_generate(model, tok, label: str, hf_too: bool) -> None:
    eng = TransformersEngine(model, tok)
    p8 = _prompts(tok, 8)
    eng.generate(p8[:1], n=1, max_new_tokens=4, stop_ids=[], seed=0)  # warm-up
    t = time.perf_counter()
    out = eng.generate(p8, n=1, max_new_tokens=64, stop_ids=[], seed=0)
    dt = time.perf_counter() - t
    assert all(len(s.token_ids) == 64 for s in out)
    t = time.perf_counter()
    eng.generate(p8[:2], n=4, max_new_tokens=64, stop_ids=[], seed=0)
    dt_shared = time.perf_counter() - t
    line = (f"generate 8x64 after 200-token prompts [{label}]: engine {dt:.2f}s "
            f"(2 prompts x n=4, shared prefill: {dt_shared:.2f}s)")
    if hf_too:
        ids = torch.tensor(p8)
        model.eval()
        with torch.inference_mode():
            t = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                           max_new_tokens=64, min_new_tokens=64, output_scores=True,
                           return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
            dt_hf = time.perf_counter() - t
        model.train()
        line += f"; transformers generate(output_scores) {dt_hf:.2f}s (engine/HF {dt / dt_hf:.2f})"
    print(line, flush=True)


def bench_train(model, label: str, batch: int = 8, seqlen: int = 256, response: int = 64) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40000, (batch, seqlen), generator=g)
    am = torch.ones_like(ids)
    rm = torch.zeros_like(ids)
    rm[:, seqlen - response :] = 1
    # warm-up on a small slice
    sequence_logprobs(model, ids[:2, :32], am[:2, :32], am[:2, :32]).sum().backward()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        t = time.perf_counter()
        sequence_logprobs(model, ids, am, rm)
        fwd = time.perf_counter() - t
    t = time.perf_counter()
    lp = sequence_logprobs(model, ids, am, rm)
    (-lp.sum() / rm.sum()).backward()
    fb = time.perf_counter() - t
    model.zero_grad(set_to_none=True)
    ntok = batch * seqlen
    # the same 8 rows as 2 prompts x n=4 sharing their first seqlen-response tokens
    n, groups, plen = 4, batch // 4, seqlen - response
    pid, pm = ids[::n, :plen], am[::n, :plen]
    sid, sm = ids[:, plen:], am[:, plen:]
    t = time.perf_counter()
    lp = shared_prefix_logprobs(model, pid, pm, sid, sm, sm, n)
    (-lp.sum() / sm.sum()).backward()
    fb_shared = time.perf_counter() - t
    model.zero_grad(set_to_none=True)
    print(f"forward+backward {batch}x{seqlen} [{label}]: {1000 * fb / ntok:.2f} ms/token "
          f"({fb:.1f}s; forward alone {1000 * fwd / ntok:.2f} ms/token); as {groups} prompts x "
          f"n={n} with the prompt run once: {fb_shared:.1f}s ({fb / fb_shared:.2f}x faster)",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-generate", action="store_true")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--model", default=NAME, help="registry name / HF id / folder")
    ap.add_argument("--top", type=int, default=6, help="K of the top_layers:K settings")
    ap.add_argument("--all-dtypes", action="store_true",
                    help="also time the bfloat16 settings on a CPU without native bfloat16 (very slow there)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads {args.threads}; load average before: {os.getloadavg()[0]:.1f} "
          "(other busy processes on the 2 cores slow every multi-threaded op many times over)",
          flush=True)
    from reflrl.precision import resolve_dtype

    choice = resolve_dtype("auto")
    print(choice.log_line(), flush=True)
    t = time.perf_counter()
    load_model(args.model, dtype="float32", trainable="none")  # converts + caches on first use
    print(f"load (cache warm after the first run): {time.perf_counter() - t:.1f}s", flush=True)
    k = args.top
    settings = [
        ("bfloat16, all trainable (pure bf16)", dict(dtype="bfloat16", trainable="all",
                                                     trainable_dtype=None), True, True),
        ("float32, all trainable", dict(dtype="float32", trainable="all"), True, True),
        (f"float32, top {k} trainable", dict(dtype="float32", trainable=f"top_layers:{k}"),
         False, True),
        (f"bfloat16 frozen + float32 top {k} (default)", dict(dtype="bfloat16",
                                                              trainable=f"top_layers:{k}"), True, True),
        ("bfloat16 + LoRA r=16", dict(dtype="bfloat16", trainable="lora"), False, True),
    ]
    if choice.dtype != "bfloat16" and not args.all_dtypes:  # emulated bfloat16: minutes per setting, no insight
        settings = [x for x in settings if x[1]["dtype"] != "bfloat16"]
        print("bfloat16 settings skipped: this CPU emulates bfloat16 (--all-dtypes runs them anyway)", flush=True)
    for label, kw, gen, train in settings:
        model, tok = load_model(args.model, **kw)
        c = count_parameters(model)
        print(f"-- {label}: trainable {c['trainable'] / 1e6:.1f}M of {c['total'] / 1e6:.1f}M",
              flush=True)
        if gen and not args.skip_generate:
            bench_generate(model, tok, label, hf_too=label.startswith("bfloat16, all"))
        if train and not args.skip_train:
            bench_train(model, label)
        del model
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak resident memory: {rss:.0f} MB; load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
