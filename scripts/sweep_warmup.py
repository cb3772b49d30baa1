"""How much does the supervised warm-up teach, per step and per second? Held-out accuracy curves of SFT
settings on the default recipe's tasks, one process per setting, all measured in this run.

Each setting trains the embedded model on the training split's gold calls (``reflrl.sft``, the warm-up of
``reflrl train``) for ``--steps`` steps and evaluates the greedy exact-match accuracy on the recipe's
held-out tasks every ``--every`` steps (``reflrl.heldout``: the same caps and early stop as a run). The
accuracies depend on the seed only; the seconds are this machine's (quote them with its CPU kind).

    python scripts/sweep_warmup.py --steps 60 --every 20
    python scripts/sweep_warmup.py --settings "top6:model.trainable=top_layers:6,warmup.lr=3e-4" \\
                                   --settings "all:model.trainable=all,warmup.lr=1e-4"
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

DEFAULT_SETTINGS = [
    "top6-lr3e-4:model.trainable=top_layers:6,warmup.lr=3e-4",
    "top6-lr1e-3:model.trainable=top_layers:6,warmup.lr=1e-3",
    "top12-lr5e-4:model.trainable=top_layers:12,warmup.lr=5e-4",
    "all-lr1e-4:model.trainable=all,warmup.lr=1e-4",
]


def worker(overrides: list[str], steps: int, every: int, seed: int) -> dict:
    import dataclasses

    from reflrl import config as C
    from reflrl.engines.transformers_engine import TransformersEngine
    from reflrl.engines.trunk_cache import TrunkCache
    from reflrl.heldout import evaluate
    from reflrl.envs.seeding import derive_seed
    from reflrl.rollout import RolloutSpec
    from reflrl.sft import build_examples, train_sft
    from reflrl.train.data import splits_from_config
    from reflrl.train.setup import answer_format, load_policy, messages_fn
    from reflrl.recovery import think_of
    from reflrl.threads import fix_threads

    cfg = C.load_config(C.default_recipe(), [f"train.seed={seed}", f"warmup.steps={steps}", *overrides])
    fix_threads(cfg.train.threads)  # as a run does (a setting may pin it, e.g. train.threads=1 beside other work)
    sp = splits_from_config(cfg.data)
    model, tok, precision, _ = load_policy(cfg, lambda m: print(m, file=sys.stderr))
    msgs = messages_fn(cfg)
    spec = dataclasses.replace(RolloutSpec.from_config(cfg, fmt=answer_format(cfg), think=think_of(cfg)),
                               temperature=0.0)
    eng = TransformersEngine(model, tok, max_batch_size=64, trunk_cache=TrunkCache(model))
    curve: list[dict] = []
    t_train = [0.0]
    t0 = [time.perf_counter()]

    def point(done: int) -> None:
        t_train[0] += time.perf_counter() - t0[0]
        r = evaluate(eng, tok, sp["test"], msgs, spec, batch_size=64)
        curve.append({"step": done, "accuracy": r.accuracy, "format_rate": r.format_rate,
                      "train_s": round(t_train[0], 1), "eval_s": round(r.seconds, 1)})
        print(json.dumps(curve[-1]), file=sys.stderr, flush=True)
        t0[0] = time.perf_counter()

    point(0)
    w = cfg.warmup
    ex = build_examples(sp["train"], tok, msgs, fmt=answer_format(cfg))
    train_sft(model, tok, ex, steps=w.steps, batch_size=w.batch_size, lr=w.lr,
              seed=derive_seed(cfg.train.seed, 11, bits=31), grad_clip=cfg.algo.grad_clip or 1.0,
              warmup_steps=min(5, w.steps // 10),
              on_step=lambda done, loss: point(done) if done % every == 0 else None)
    return {"precision": precision.dtype, "curve": curve}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settings", action="append", default=[],
                    help="label:key=value,key=value (repeatable; default: four trainable sets / learning rates)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    if a.worker is not None:
        print(json.dumps(worker([o for o in a.worker.split(",") if o], a.steps, a.every, a.seed)))
        return 0
    import torch

    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, torch threads {torch.get_num_threads()}")
    results = {}
    for spec in a.settings or DEFAULT_SETTINGS:
        label, _, over = spec.partition(":")
        cmd = [sys.executable, __file__, "--worker", over, "--steps", str(a.steps), "--every", str(a.every),
               "--seed", str(a.seed)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{label}: failed\n{out.stderr[-2000:]}")
            continue
        results[label] = json.loads(out.stdout.strip().splitlines()[-1])
        pts = ", ".join(f"{p['step']}: {p['accuracy']:.1%} ({p['train_s']:.0f}s)" for p in results[label]["curve"])
        print(f"{label:16s} {pts}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
