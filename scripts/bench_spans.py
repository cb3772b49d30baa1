"""The held-out evaluation with the decode step's attention in spans of like-length rows, and with every
row over the longest row's width, alternated in one process (prints figures measured in this run).

    .venv/bin/python scripts/bench_spans.py --checkpoint RUN/checkpoints/step_N [--repeats 2] [--set KEY=VALUE ...]

The evaluation of the default recipe's 48 held-out tasks, greedy, from ``--checkpoint`` (a warm-up
checkpoint of the main job), ``--repeats`` times each way, alternated: spans as the pool picks them
(:func:`reflrl.engines.continuous.attention_spans`), then one span over every live row (a span's price set
beyond any saving, which reads as the attention did before spans). Per run: the evaluation's seconds,
its prefill and decode seconds, its decode steps, the rows x columns its attention read, the new tokens
and the accuracy. The attention is SDPA's (``rollout.decode_attention=sdpa``: the native kernel reads
each row only as far as its own length and needs no spans). The process settings are the ``reflrl`` command's (OpenMP threads sleep while they
wait). CPU-heavy: run it alone.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from reflrl.threads import configure_process  # noqa: E402

configure_process()  # the reflrl command's process settings, before torch loads

import torch  # noqa: E402

ONE_SPAN = 10 ** 15  # a span price no saving beats: every live row in one span, the longest row's width


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="evaluate this checkpoint (model.init_from)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from reflrl import config as C
    from reflrl.engines import continuous as CB
    from reflrl.train.loop import Trainer

    cfg = C.load_config(None, ["env.faults=rate_limit=0.1", "train.out_dir=" + tempfile.mkdtemp(prefix="spans"),
                               f"model.init_from={args.checkpoint}", "warmup.enabled=false",
                               "rollout.decode_attention=sdpa"] + list(args.set))  # spans are SDPA's
    tr = Trainer(cfg, Path(cfg.train.out_dir) / "run", progress=False, quiet=True)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}; {torch.get_num_threads()} threads; "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}", flush=True)
    read = [0]
    spans_of = CB.attention_spans

    def counted(needs, overhead=None):
        out = spans_of(needs, overhead)
        read[0] += sum((e - a) * w for a, e, w in out)
        return out

    CB.attention_spans = counted
    default = CB.SPAN_OVERHEAD
    for rep in range(args.repeats):
        for name, price in (("spans", default), ("one span", ONE_SPAN)):
            CB.SPAN_OVERHEAD = price
            read[0] = 0
            eng = tr.eval_engine
            before = _pool_stats(eng)
            t0 = time.perf_counter()
            ev = tr.evaluate("test")
            wall = time.perf_counter() - t0
            after = _pool_stats(eng)
            d = {k: after[k] - before[k] for k in after}
            print(f"{rep + 1} {name:8s}: evaluation {wall:.1f}s, prefill {d['prefill_s']:.1f}s, decode "
                  f"{d['decode_s']:.1f}s in {d['steps']} steps, {read[0] / 1e6:.2f} M rows x columns read, "
                  f"{d['new_tokens']} new tokens, accuracy {100 * ev.get('accuracy', 0.0):.1f}%", flush=True)
    CB.SPAN_OVERHEAD = default
    return 0


def _pool_stats(engine) -> dict[str, float]:
    """What the engine's shared decode loop (the evaluation's episodes join it) has served so far."""
    st = engine.pool().stats
    return {"prefill_s": st.prefill_s, "decode_s": st.decode_s, "steps": len(st.decode_rows),
            "new_tokens": st.new_tokens}


if __name__ == "__main__":
    sys.exit(main())
