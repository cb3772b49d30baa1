"""Continuous batching against fixed batches on the same work: RL steps (rollouts, the turns after a fault,
reflection retries) and one held-out evaluation, run once with ``rollout.continuous=false`` and once with
``true`` from the same checkpoint and seed.

    .venv/bin/python scripts/bench_continuous.py [--recipe configs/X.yaml] [--checkpoint RUN/checkpoints/step_N]
        [--rl-steps 2] [--eval] [--dtype auto|float32] [--set KEY=VALUE ...] [--json FILE]

Printed per path: decode steps (one forward of every active row), row-steps (rows that sampled, summed
over the decode steps), rows per decode step (mean), prefill calls, new tokens, and wall seconds. The first
five do not depend on the machine's load (the work is the seed's); the wall seconds mean something only on
a quiet machine. The two paths draw from different seeds (continuous batching seeds every row by its
request), so their answers, and with them their token counts, differ a little.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class Counter:
    """Decode steps and rows of every generation an engine served: its ``generate`` calls (``last_stats``)
    and its shared pool (``agenerate``)."""

    def __init__(self, engines: list[Any]):
        self.steps = self.row_steps = self.prefills = self.tokens = 0
        self.engines = list({id(e): e for e in engines}.values())
        self._pool0: dict[int, tuple[int, int, int, int]] = {}
        for e in self.engines:
            orig, c = e.generate, self

            def generate(*a, _orig=orig, _e=e, **k):
                out = _orig(*a, **k)
                c.add(_e.last_stats)
                return out

            e.generate = generate

    def add(self, st: Any) -> None:
        self.steps += len(st.decode_rows)
        self.row_steps += sum(st.decode_rows)
        self.prefills += st.forward_calls - len(st.decode_rows)
        self.tokens += st.new_tokens

    def pools(self) -> None:
        """Add what the engines' shared pools served (call once, at the end)."""
        for e in self.engines:
            if getattr(e, "_pool", None) is not None:
                self.add(e._pool.stats)

    def row(self) -> dict[str, Any]:
        return {"decode_steps": self.steps, "row_steps": self.row_steps,
                "rows_per_step": self.row_steps / max(1, self.steps), "prefill_calls": self.prefills,
                "new_tokens": self.tokens}


def run_path(continuous: bool, args: argparse.Namespace) -> dict[str, Any]:
    from reflrl import config as C
    from reflrl.train.loop import Trainer

    over = [f"model.dtype={args.dtype}", "train.out_dir=" + tempfile.mkdtemp(prefix="cont"),
            f"rollout.continuous={str(continuous).lower()}"]
    if args.checkpoint:
        over += [f"model.init_from={args.checkpoint}", "warmup.enabled=false"]
    cfg = C.load_config(args.recipe, over + list(args.set))
    tr = Trainer(cfg, Path(cfg.train.out_dir) / "run", progress=False, quiet=True)
    try:
        count = Counter([tr.engine, tr.eval_engine])
        t0 = time.perf_counter()
        for _ in range(args.rl_steps):
            tr.train_step()
            tr.step += 1
        rl_s = time.perf_counter() - t0
        out: dict[str, Any] = {"rl_steps": args.rl_steps, "rl_wall_s": rl_s}
        if args.eval:
            t0 = time.perf_counter()
            res = tr.evaluate("test")
            out.update(eval_wall_s=time.perf_counter() - t0, eval_accuracy=res["accuracy"])
        count.pools()
        out.update(count.row())
        return out
    finally:
        tr.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=None, help="a recipe YAML (default: the default recipe)")
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--rl-steps", type=int, default=2)
    ap.add_argument("--eval", action="store_true", help="also one held-out evaluation (the test split)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = {}
    for name, cont in (("batches", False), ("continuous", True)):
        r = res[name] = run_path(cont, args)
        line = (f"{name:>10}: {r['decode_steps']} decode steps, {r['row_steps']} row-steps, "
                f"{r['rows_per_step']:.1f} rows/step, {r['prefill_calls']} prefill calls, {r['new_tokens']} new tokens; "
                f"{r['rl_wall_s']:.1f}s for {r['rl_steps']} RL steps")
        if "eval_wall_s" in r:
            line += f", {r['eval_wall_s']:.1f}s evaluation (accuracy {r['eval_accuracy']:.1%})"
        print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
