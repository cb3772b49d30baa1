"""Does this CPU give the same bits at every thread count? One forward, one cached decode step and one
backward of the policy model on the same tokens, each in a fresh process with ``torch.set_num_threads(N)``;
printed as short hashes of the logits and the gradients, one line per (precision, thread count).

    .venv/bin/python scripts/repro_probe.py [--threads 1,2,4] [--dtypes float32,bfloat16]
        [--model smollm2-135m-instruct] [--trainable top_layers:12]

Equal hashes mean a run is bit-for-bit the same at those thread counts; different hashes mean the vendor
kernels round differently, so runs drift apart (README, "Results depend on the seed, not on the
machine"). To see another instruction set's kernels on this CPU, run it under
``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2``. Quote the output with
``torch.backends.cpu.get_cpu_capability()``, which it prints first.
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys

PROMPT = "Check air pollution levels in Chicago. Plus, add 2 of product P-12657 to my cart."


def _digest(t) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()[:12]


def probe(model_name: str, dtype: str, trainable: str, threads: int, seed: int = 0) -> dict[str, str]:
    """Hashes of the logits of a forward and of a cached one-token decode step (no grad), and of the
    trainable parameters' gradients of a summed log-likelihood, at ``threads`` torch threads (``seed``: the
    initialisation of ``tiny-random``, the tests' model)."""
    import torch

    from reflrl.models import load_model

    torch.set_num_threads(threads)
    model, tok = load_model(model_name, dtype=dtype, trainable=trainable, seed=seed)
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                  return_tensors="pt")
    ids = (ids if torch.is_tensor(ids) else ids["input_ids"]).repeat(3, 1)
    model.eval()
    with torch.no_grad():
        fwd = model(ids).logits
        past = model(ids[:, :-1], use_cache=True).past_key_values
        dec = model(ids[:, -1:], past_key_values=past).logits
    model.train()
    logp = model(ids).logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).sum()
    logp.backward()
    grad = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
    return {"forward": _digest(fwd), "decode": _digest(dec), "grad": _digest(grad)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2,4", help="comma-separated thread counts")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated precisions")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--trainable", default="top_layers:12", help="as model.trainable (the recipe's)")
    ap.add_argument("--worker", nargs=2, metavar=("DTYPE", "THREADS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        h = probe(a.model, a.worker[0], a.trainable, int(a.worker[1]))
        print(" ".join(f"{k} {v}" for k, v in h.items()))
        return 0
    import torch

    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}; model {a.model}, trainable {a.trainable}")
    for dtype in a.dtypes.split(","):
        seen: dict[str, list[str]] = {}
        for n in a.threads.split(","):
            out = subprocess.run([sys.executable, __file__, "--worker", dtype, n, "--model", a.model,
                                  "--trainable", a.trainable], capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{dtype:9s} threads {n}: failed\n{out.stderr[-1500:]}")
                return 1
            line = out.stdout.strip().splitlines()[-1]
            seen.setdefault(line, []).append(n)
            print(f"{dtype:9s} threads {n}: {line}", flush=True)
        verdict = "the same bits" if len(seen) == 1 else f"{len(seen)} different results"
        print(f"{dtype:9s} -> {verdict} over threads {a.threads}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
