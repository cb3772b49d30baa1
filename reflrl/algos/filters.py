"""Prompt and rollout filters that save compute: efficiency paper (arXiv:2606.00135), sec. 4.

* :class:`PreRolloutFilter`: online pre-rollout filtering (sec. 4.1, eqs. 4-6): skip the
  prompts whose rollouts were all-correct in the last k epochs.
* :func:`max_variance_subset`: max-variance rollout
  down-sampling (sec. 4.2, eq. 7; Xu et al. 2025): back-propagate m of n rollouts.
* :func:`zero_variance` / :func:`groups_to_request`: DAPO dynamic sampling
  (Yu et al. 2025), the baseline the paper compares against.

Pure Python / torch; no trainer or CLI imports.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence

import torch


def _as_float_list(rewards: Sequence[float] | torch.Tensor) -> list[float]:
    if isinstance(rewards, torch.Tensor):
        return [float(x) for x in rewards.detach().flatten().tolist()]
    return [float(x) for x in rewards]


def all_correct(rewards: Sequence[float] | torch.Tensor, r_max: float, tol: float = 1e-6) -> bool:
    """Eq. 4: z = 1 iff every one of the n rewards equals r_max (within ``tol``); False for n = 0."""
    vals = _as_float_list(rewards)
    return bool(vals) and all(abs(v - r_max) <= tol for v in vals)


class PreRolloutFilter:
    """Online pre-rollout filter, efficiency paper sec. 4.1 (eqs. 4-6).

    Keeps a per-prompt all-correct streak c_i. After a prompt's n rollouts in epoch e,
    ``update`` applies eqs. 4-5: c_i += 1 if all n rewards == r_max, else c_i = 0. Before
    rolling out, ``keep`` applies eq. 6: only prompts with c_i < k get rollouts.

    Re-entry of skipped prompts. Eq. 6 written literally (D^(e) subset of D^(e-1)) would
    drop a prompt for good, but the text says skipped prompts are "temporarily skipped"
    and the active set is re-sampled every epoch. We follow the text through eq. 5: an
    epoch in which a prompt was skipped produced no all-correct observation (z^(e) = 0), so
    at the next epoch its streak is reset to 0 and it is rolled out (re-checked) again. A
    prompt that is still all-correct then needs k more all-correct epochs to be skipped
    again (with k = 1: rolled out every other epoch); one that fails stays in.

    Typical use: call ``keep`` once on the epoch's whole (shuffled) prompt order at the
    start of the epoch (eq. 6 decides D^(e) before any rollout), then batch the kept
    prompts. Usage per epoch::

        flt.start_epoch(e)                 # or pass epoch=e to keep()
        batch = flt.keep(prompt_ids)       # prompt ids to roll out this epoch
        ...                                # rollouts
        flt.update(pid, rewards, r_max)    # for each rolled-out prompt

    ``k = 0`` disables the filter (everything is kept, streaks are still tracked).
    ``state_dict()`` / ``load_state_dict()`` make the state part of a checkpoint.
    """

    def __init__(self, k: int, tol: float = 1e-6):
        if k < 0:
            raise ValueError(f"k must be >= 0 (0 disables the filter), got {k}")
        self.k = int(k)
        self.tol = float(tol)
        self.streaks: dict[Hashable, int] = {}
        self.epoch: int | None = None
        self._skipped_now: set[Hashable] = set()
        self._seen_now: set[Hashable] = set()
        # epoch -> {"considered", "skipped", "rolled_out", "all_correct"}
        self.history: dict[int, dict[str, int]] = {}

    # -- epoch bookkeeping ---------------------------------------------------------------------
    def start_epoch(self, epoch: int) -> None:
        """Begin epoch ``epoch``: prompts skipped in the previous epoch re-enter (streak -> 0)."""
        if self.epoch is not None and epoch == self.epoch:
            return
        if self.epoch is not None and epoch < self.epoch:
            raise ValueError(f"epochs must not go backwards (at {self.epoch}, got {epoch})")
        for pid in self._skipped_now:  # eq. 5 with z^(e) = 0 for an epoch without rollouts
            self.streaks[pid] = 0
        self._skipped_now = set()
        self._seen_now = set()
        self.epoch = int(epoch)
        self.history.setdefault(self.epoch, {"considered": 0, "skipped": 0, "rolled_out": 0, "all_correct": 0})

    def _stats(self) -> dict[str, int]:
        if self.epoch is None:
            self.start_epoch(0)
        return self.history[self.epoch]  # type: ignore[index]

    # -- eq. 6 -----------------------------------------------------------------------------------
    def should_skip(self, prompt_id: Hashable) -> bool:
        """True if ``prompt_id`` is filtered out in the current epoch (c_i >= k, k > 0)."""
        if prompt_id in self._skipped_now:
            return True
        return self.k > 0 and self.streaks.get(prompt_id, 0) >= self.k

    def keep(self, prompt_ids: Iterable[Hashable], epoch: int | None = None) -> list[Hashable]:
        """Eq. 6: the prompts of ``prompt_ids`` to roll out now (order preserved).

        Skipped prompts are recorded for this epoch (stats, and re-entry next epoch).
        Calling it several times in one epoch (one call per batch) is fine: a prompt
        skipped earlier in the epoch stays skipped until the epoch ends.
        """
        if epoch is not None:
            self.start_epoch(epoch)
        stats = self._stats()
        kept = []
        for pid in prompt_ids:
            first_time = pid not in self._seen_now
            self._seen_now.add(pid)
            if self.should_skip(pid):
                if first_time:
                    stats["considered"] += 1
                    stats["skipped"] += 1
                self._skipped_now.add(pid)
            else:
                if first_time:
                    stats["considered"] += 1
                kept.append(pid)
        return kept

    # -- eqs. 4-5 --------------------------------------------------------------------------------
    def update(self, prompt_id: Hashable, rewards: Sequence[float] | torch.Tensor, r_max: float = 1.0) -> int:
        """Record the n rewards of one prompt's rollouts this epoch; returns the new streak c_i.

        Call once per prompt per epoch (a second call in the same epoch counts again).
        """
        stats = self._stats()
        stats["rolled_out"] += 1
        if all_correct(rewards, r_max, self.tol):
            stats["all_correct"] += 1
            c = self.streaks.get(prompt_id, 0) + 1
        else:
            c = 0
        self.streaks[prompt_id] = c
        return c

    # -- stats / checkpoints ---------------------------------------------------------------------
    def skipped_count(self, epoch: int | None = None) -> int:
        """Number of distinct prompts skipped in ``epoch`` (default: the current one)."""
        e = self.epoch if epoch is None else epoch
        return self.history.get(e, {}).get("skipped", 0) if e is not None else 0

    def skip_ratio(self, epoch: int | None = None) -> float:
        """Skipped / considered prompts in ``epoch`` (0.0 when none were considered)."""
        e = self.epoch if epoch is None else epoch
        h = self.history.get(e, {}) if e is not None else {}
        return h.get("skipped", 0) / h["considered"] if h.get("considered") else 0.0

    def state_dict(self) -> dict:
        """JSON-serialisable state (prompt ids are kept as given; use str/int ids for JSON)."""
        return {
            "k": self.k,
            "tol": self.tol,
            "epoch": self.epoch,
            "streaks": [[pid, c] for pid, c in self.streaks.items()],
            "skipped_now": list(self._skipped_now),
            "seen_now": list(self._seen_now),
            "history": {str(e): dict(h) for e, h in self.history.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (k in the state must match this filter's k)."""
        if int(state["k"]) != self.k:
            raise ValueError(f"checkpoint filter has k={state['k']} but this run uses k={self.k}")
        self.tol = float(state.get("tol", self.tol))
        self.epoch = state["epoch"]
        self.streaks = {_hashable(pid): int(c) for pid, c in state["streaks"]}
        self._skipped_now = {_hashable(p) for p in state["skipped_now"]}
        self._seen_now = {_hashable(p) for p in state["seen_now"]}
        self.history = {int(e): {k: int(v) for k, v in h.items()} for e, h in state["history"].items()}


def _hashable(x):
    """JSON turns tuples into lists; turn them back so they can be dict keys again."""
    return tuple(_hashable(v) for v in x) if isinstance(x, list) else x


# ---- max-variance down-sampling (sec. 4.2, eq. 7) ------------------------------------------------


def _variance(vals: Sequence[float]) -> float:
    n = len(vals)
    if n == 0:
        return 0.0
    mu = sum(vals) / n
    return sum((v - mu) ** 2 for v in vals) / n


def max_variance_subset(rewards: Sequence[float] | torch.Tensor, m: int) -> list[int]:
    """Indices of the m of n rollouts whose rewards have the largest variance (eq. 7).

    Sort the rewards; the optimal subset is the m' lowest plus the m - m' highest
    (eq. 7), with m' found by brute force over 0..m. Ties between m' values are broken
    towards the most balanced split (m' closest to m/2), so binary rewards with both
    classes well represented give m/2 of each, as the paper states. Ties between equal
    rewards keep the earlier rollouts. Returns the chosen indices in ascending order.
    ``m >= n`` returns all indices.
    """
    vals = _as_float_list(rewards)
    n = len(vals)
    if not all(math.isfinite(v) for v in vals):
        raise ValueError(f"rewards must be finite, got {vals}")
    if m < 0:
        raise ValueError(f"m must be >= 0, got {m}")
    if m >= n:
        return list(range(n))
    order = sorted(range(n), key=lambda i: (vals[i], i))  # stable ascending
    best, best_key = None, None
    for m_low in range(m + 1):
        chosen = order[:m_low] + order[n - (m - m_low):] if m - m_low > 0 else order[:m_low]
        var = _variance([vals[i] for i in chosen])
        key = (round(var, 12), -abs(m_low - m / 2))
        if best_key is None or key > best_key:
            best, best_key = chosen, key
    return sorted(best)  # type: ignore[arg-type]


def zero_variance(rewards: Sequence[float] | torch.Tensor, tol: float = 0.0) -> bool:
    """DAPO's rule (Yu et al. 2025): a group whose rewards are all equal (max - min <= ``tol``), or that
    has fewer than two, gives every rollout a zero GRPO advantage (efficiency paper, sec. 2.2 after
    eq. 3): no learning signal, so dynamic sampling drops it. The one implementation of the rule."""
    vals = _as_float_list(rewards)
    return len(vals) < 2 or max(vals) - min(vals) <= tol


def groups_to_request(
    target: int,
    have: int,
    keep_rate: float | None,
    *,
    min_keep_rate: float = 0.05,
    max_request: int | None = None,
) -> int:
    """How many more prompt groups to sample so that ``have`` kept groups reach ``target``.

    DAPO refills the batch after dropping zero-variance groups; we request
    ceil((target - have) / keep_rate) groups, where ``keep_rate`` is the fraction of
    groups kept so far (None = unknown, treat as 1), floored at ``min_keep_rate`` so a
    batch of all-zero-variance groups does not ask for infinitely many. Capped at
    ``max_request`` when given. Returns 0 when the batch is already full.
    """
    missing = target - have
    if missing <= 0:
        return 0
    rate = 1.0 if keep_rate is None else max(float(keep_rate), min_keep_rate)
    want = math.ceil(missing / min(rate, 1.0))
    return min(want, max_request) if max_request is not None else want
