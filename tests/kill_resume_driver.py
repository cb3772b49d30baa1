"""A tiny training run that really updates its weights, for the kill -9 test (test_kill_resume.py).

    python tests/kill_resume_driver.py RUN_DIR --steps N

Starts the run in RUN_DIR, or resumes it when RUN_DIR already holds one (its config.yaml), as a
user would after a crash. The model is ``tiny-random`` (configs/tiny.yaml, float32, one thread) and
samples its own rollouts; the tiny random model never answers right, so the env's reward is
replaced by a forced positive reward that differs between the samples of a group (a hash of the
sampled tokens), which gives every group non-zero advantages: every step updates the weights.
Every step is checkpointed and every checkpoint kept, so another run can be compared step by step.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def forced_reward(token_ids: list[int]) -> float:
    """A positive reward in {0.25, 0.5, 0.75, 1.0}, a pure function of the sampled tokens."""
    h = hashlib.blake2b(",".join(map(str, token_ids)).encode(), digest_size=4).digest()
    return 0.25 * (1 + h[0] % 4)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args(argv)

    from reflrl import config as C
    from reflrl import train as T

    class ForcedRewardTrainer(T.Trainer):
        def rollout(self, task_idx, round_, timings):
            trajs = super().rollout(task_idx, round_, timings)
            for t in trajs:
                if not t.masked:
                    t.reward = forced_reward(t.response_ids)
            return trajs

    resume = (a.run_dir / "config.yaml").is_file()
    if resume:
        cfg = C.load_config(a.run_dir / "config.yaml")
    else:
        cfg = C.load_config(ROOT / "configs" / "tiny.yaml", [
            f"train.out_dir={a.run_dir.parent}", f"train.run_name={a.run_dir.name}",
            f"train.steps={a.steps}", "train.save_every=1", f"train.keep_checkpoints={a.steps + 2}",
            "train.threads=1", "data.n_train=8", "data.n_test=2", "data.n_val=0",
            "rollout.n=4", "rollout.batch_prompts=2", "rollout.max_new_tokens=8",
            "rollout.temperature=1.0", "algo.downsample_m=0", "algo.prefilter_k=0"])
    tr = ForcedRewardTrainer(cfg, a.run_dir, resume=resume, progress=False, quiet=True)
    try:
        tr.run()
    finally:
        tr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
