"""What the trainer trains on: the train/val/test splits and the order of training prompts."""
from __future__ import annotations

import random
import sys
from typing import Any, Sequence

import numpy as np

from reflrl import config as C
from reflrl.algos import PreRolloutFilter


class PromptSampler:
    """Which training prompts come next: a seeded permutation per epoch, filtered at the start of
    each epoch by the online pre-rollout filter (efficiency paper, arXiv:2606.00135, sec. 4.1, eq. 6).

    State (``state_dict``): epoch, position in the epoch's order, and the order itself; with the
    filter's streaks (saved separately) a resumed run draws exactly the same prompts.
    """

    def __init__(self, task_ids: Sequence[str], seed: int, prefilter: PreRolloutFilter):
        if not task_ids:
            raise ValueError("no training tasks")
        self.task_ids = list(task_ids)
        self.seed = int(seed)
        self.filter = prefilter
        self.epoch = -1
        self.pos = 0
        self.order: list[int] = []
        self.skipped: dict[int, int] = {}  # epoch -> prompts skipped by the filter

    def _start_epoch(self) -> None:
        self.epoch += 1
        perm = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.task_ids)).tolist()
        kept = set(self.filter.keep([self.task_ids[i] for i in perm], epoch=self.epoch))
        self.order = [i for i in perm if self.task_ids[i] in kept]
        self.skipped[self.epoch] = len(perm) - len(self.order)
        self.pos = 0

    def next(self, count: int) -> list[int]:
        """The next ``count`` task indices (crossing into new epochs as needed)."""
        out: list[int] = []
        empty_epochs = 0
        while len(out) < count:
            if self.pos >= len(self.order):
                self._start_epoch()
                if not self.order:
                    empty_epochs += 1
                    if empty_epochs > 2:  # cannot happen with re-entry after one skipped epoch
                        raise RuntimeError("the pre-rollout filter skipped every training prompt")
                    continue
            out.append(self.order[self.pos])
            self.pos += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "pos": self.pos, "order": list(self.order),
                "skipped": {str(k): v for k, v in self.skipped.items()}}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        if int(s["seed"]) != self.seed:
            raise ValueError(f"checkpoint data order has seed {s['seed']}, this run {self.seed}")
        self.epoch, self.pos, self.order = int(s["epoch"]), int(s["pos"]), [int(i) for i in s["order"]]
        self.skipped = {int(k): int(v) for k, v in s.get("skipped", {}).items()}



def splits_from_config(d: C.DataConfig) -> dict[str, list]:
    """train/val/test task lists for the data section (synthetic generator or a loader)."""
    from reflrl.envs import datasets as ds

    if d.source == "synthetic":
        sp = ds.synthetic_splits(n_train=d.n_train, n_val=d.n_val, n_test=d.n_test, seed=d.seed,
                                 kinds=tuple(d.kinds))
        splits = {k: list(sp[k]) for k in ("train", "val", "test")}
    else:
        if d.path is None:
            raise C.ConfigError(f"data.source={d.source!r} needs data.path (a local file)")
        fmt = d.fmt or (d.source if d.source in ds.FORMATS else "auto")
        report = ds.load_tasks(d.path, fmt=fmt)
        if report.n_skipped:
            print(f"[reflrl] {report.summary()}", file=sys.stderr)
        tasks = list(report.tasks)
        rng = random.Random(d.seed)
        rng.shuffle(tasks)
        splits = {"test": tasks[: d.n_test], "val": tasks[d.n_test: d.n_test + d.n_val],
                  "train": tasks[d.n_test + d.n_val: d.n_test + d.n_val + d.n_train]}
    for k in splits:
        splits[k] = [t for t in splits[k] if t.kind in d.kinds]
    if not splits["train"]:
        raise C.ConfigError(f"data: no training task of kinds {d.kinds} in source {d.source!r}")
    return splits
