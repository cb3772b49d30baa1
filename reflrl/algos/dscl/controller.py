"""The bundle a trainer uses: curriculum, reward history, sampler and category shares in one checkpointable
object (:class:`SamplingController`), and the per-epoch shares of Fig. 3 (:class:`CategoryShares`)."""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from reflrl.envs.types import ToolCall

from ..filters import groups_to_request
from .curriculum import CurriculumStage, StageTransition
from .rds import CATEGORIES, RDSParams, RewardHistory, _hashable, categorize
from .rewards import episode_stage_reward, stage_reward, subreward_fractions
from .samplers import get_sampler

def _slug(c: str) -> str:
    return c.replace(".", "")


class CategoryShares:
    """Per-epoch shares of the difficulty categories (Fig. 3; appendix Tables 5-6).

    ``record(epoch, prompt_id, category, kept)`` once per rolled-out prompt; a prompt seen twice
    in an epoch counts with its latest category (one datum, one category per epoch, as the
    paper's tables). ``epoch_metrics(epoch)`` gives a flat dict for the metrics log:
    ``dscl/share_a``, ``dscl/share_b1``, ``dscl/share_b2``, ``dscl/share_c1``, ``dscl/share_c2``,
    ``dscl/share_b1_c1`` (the tables' "b.1 & c.1" row), ``dscl/prompts`` (distinct prompts) and
    ``dscl/kept`` / ``dscl/dropped`` (sampler decisions that epoch, repeats included).
    """

    def __init__(self) -> None:
        self.latest: dict[int, dict[Hashable, str]] = {}
        self.decisions: dict[int, list[int]] = {}  # epoch -> [kept, dropped]

    def record(self, epoch: int, prompt_id: Hashable, category: str, kept: bool | None = None) -> None:
        if category not in CATEGORIES:
            raise ValueError(f"unknown category {category!r}; expected one of {CATEGORIES}")
        self.latest.setdefault(int(epoch), {})[prompt_id] = category
        if kept is not None:
            d = self.decisions.setdefault(int(epoch), [0, 0])
            d[0 if kept else 1] += 1

    def shares(self, epoch: int) -> dict[str, float]:
        """Category -> share of the epoch's distinct prompts (all 0 for an unseen epoch)."""
        cats = list(self.latest.get(int(epoch), {}).values())
        n = len(cats)
        return {c: (cats.count(c) / n if n else 0.0) for c in CATEGORIES}

    def epoch_metrics(self, epoch: int) -> dict[str, float]:
        sh = self.shares(epoch)
        out = {f"dscl/share_{_slug(c)}": v for c, v in sh.items()}
        out["dscl/share_b1_c1"] = sh["b.1"] + sh["c.1"]
        out["dscl/prompts"] = float(len(self.latest.get(int(epoch), {})))
        kept, dropped = self.decisions.get(int(epoch), [0, 0])
        out["dscl/kept"], out["dscl/dropped"] = float(kept), float(dropped)
        return out

    def table(self) -> dict[int, dict[str, float]]:
        """epoch -> :meth:`epoch_metrics` for every recorded epoch (for plots like Fig. 3)."""
        return {e: self.epoch_metrics(e) for e in sorted(self.latest)}

    def format_table(self) -> str:
        """A text table like appendix Table 5 (rows b.2, b.1 & c.1, c.2, a; columns epochs; %)."""
        epochs = sorted(self.latest)
        rows = [("b.2", ["b.2"]), ("b.1 & c.1", ["b.1", "c.1"]), ("c.2", ["c.2"]), ("a", ["a"])]
        lines = ["epoch\t" + "\t".join(str(e) for e in epochs)]
        for label, cs in rows:
            vals = [100 * sum(self.shares(e)[c] for c in cs) for e in epochs]
            lines.append(label + "\t" + "\t".join(f"{v:.1f}" for v in vals))
        return "\n".join(lines)

    def state_dict(self) -> dict[str, Any]:
        return {"latest": {str(e): [[pid, c] for pid, c in d.items()] for e, d in self.latest.items()},
                "decisions": {str(e): list(v) for e, v in self.decisions.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.latest = {int(e): {_hashable(pid): str(c) for pid, c in d} for e, d in state["latest"].items()}
        self.decisions = {int(e): [int(v[0]), int(v[1])] for e, v in state["decisions"].items()}


# ============================================================================ the bundle
class SamplingController:
    """Everything a trainer needs for DSCL and the sampling baselines, in one checkpointable object.

    Per training step, on the live (unmasked) rollouts of the batch (DSCL Fig. 2: "for each
    training batch, the TDCL method first determines the training stage ... Then the RDS method
    dynamically samples the data")::

        ctl.observe_subrewards(step, rows)   # rows: subreward_fractions(parts, gold) per rollout
        r = ctl.reward(parts, gold, r_env)   # per rollout: eq. 7 with the stage's lambdas (or r_env)
        keep = ctl.select(step, epoch, [(prompt_id, [r, ...]), ...], round_=k)
        ...train on the kept groups; with ctl.refill, ask groups_to_request(...) more and repeat
        metrics.update(ctl.step_metrics()); at an epoch's end metrics.update(ctl.epoch_metrics(e))

    ``sampler``: a :func:`get_sampler` name. ``warmup_gate``: the sampler only acts once the
    format stage has converged (sec. 4.2.2 last paragraph, sec. 6.4, Table 3; the paper runs SMV
    and SMR "with curriculum learning based on our methodology", sec. 5.2); before that every
    group is kept. Categories are computed and recorded for every group with every sampler (so
    Fig. 3 can be drawn for the baselines too). ``reset_history_on_stage``: forget the per-prompt
    means when the stage changes, since eq. 7's weights change the reward's meaning.
    The RNG of each selection is derived from (seed, step, round_), so a resumed run decides the
    same way without an RNG state in the checkpoint.
    """

    def __init__(self, sampler: str = "none", params: RDSParams | None = None, *,
                 curriculum: CurriculumStage | None = None, warmup_gate: bool = True,
                 refill: bool = False, reset_history_on_stage: bool = True, seed: int = 0,
                 history_max_len: int | None = None):
        self.sampler_name = sampler
        self.sampler = get_sampler(sampler)
        self.params = params or RDSParams()
        self.curriculum = curriculum or CurriculumStage(weighted=False)
        self.warmup_gate = bool(warmup_gate)
        self.refill = bool(refill)
        self.reset_history_on_stage = bool(reset_history_on_stage)
        self.seed = int(seed)
        self.history = RewardHistory(history_max_len)
        self.shares = CategoryShares()
        self._step: int | None = None  # the step the per-step tallies below belong to
        self._tally: dict[str, float] = {}  # per step, summed over its sampling rounds
        self._step_transitions: list[StageTransition] = []

    def _begin(self, step: int) -> None:
        """Start the per-step tallies afresh when ``step`` is a new step (a step may have several
        sampling rounds, DAPO-style refills: they all add to the same step's metrics)."""
        if self._step != int(step):
            self._step = int(step)
            self._tally = {}
            self._step_transitions = []

    @classmethod
    def from_config(cls, sc: Any, *, reward_name: str, batches_per_epoch: int, seed: int = 0
                    ) -> "SamplingController":
        """Build from a ``reflrl.config.SamplingConfig`` (duck-typed: read by attribute)."""
        ratios = {"a": sc.keep_a, "b.1": sc.keep_b1, "b.2": sc.keep_b2, "c.1": sc.keep_c1, "c.2": sc.keep_c2}
        params = RDSParams.for_reward(reward_name, t_mean=sc.t_mean, t_var=sc.t_var,
                                      unit_scale=sc.unit_scale, ratios=ratios, smv_keep=sc.smv_keep,
                                      smr_low=sc.smr_low, smr_high=sc.smr_high)
        cur = CurriculumStage(window=sc.window or batches_per_epoch,
                              thresholds={"format": sc.format_threshold, "name": sc.name_threshold,
                                          "key": sc.key_threshold},
                              weighted=sc.curriculum, reset_window_on_transition=sc.reset_window_on_stage)
        return cls(sc.sampler, params, curriculum=cur, warmup_gate=sc.warmup_gate, refill=sc.refill,
                   reset_history_on_stage=sc.reset_history_on_stage, seed=seed)

    # -- TDCL -------------------------------------------------------------------------------------
    def observe_subrewards(self, step: int, rows: Iterable[Mapping[str, float]]) -> StageTransition | None:
        """Feed the batch's sub-reward fractions to the stage machine; returns a transition, if any."""
        self._begin(step)
        ev = self.curriculum.observe_batch(step, rows)
        if ev is not None:
            self._step_transitions.append(ev)
            if self.reset_history_on_stage and self.curriculum.weighted:
                self.history.clear()
        return ev

    def observe_episodes(self, step: int, episodes: Iterable[tuple[Sequence[Mapping[str, float]],
                                                                     Sequence[Sequence[ToolCall]]]]
                         ) -> StageTransition | None:
        """Feed the batch's live episodes to the stage machine: per episode, (the fine reward's parts of its
        scored turns, the gold calls of each turn); eq. 8 averages the LAST scored turn's sub-reward
        fractions against that turn's gold."""
        rows = [subreward_fractions(parts[-1], golds[min(len(parts), len(golds)) - 1])
                for parts, golds in episodes if parts]
        return self.observe_subrewards(step, rows)

    def episode_reward(self, turn_parts: Sequence[Mapping[str, float]], golds: Sequence[Sequence[ToolCall]],
                       n_turns: int, env_reward: float) -> float:
        """The reward to train an episode on: eq. 7 over its turns (:func:`episode_stage_reward`) with
        the current stage's lambdas when the curriculum is on, else ``env_reward`` unchanged."""
        if not self.curriculum.weighted:
            return float(env_reward)
        return episode_stage_reward(turn_parts, golds, n_turns, self.curriculum.lambdas)

    def reward(self, parts: Mapping[str, float], gold: Sequence[ToolCall], env_reward: float) -> float:
        """The reward to train on: eq. 7 with the current stage's lambdas when the curriculum is
        on, else ``env_reward`` unchanged."""
        if not self.curriculum.weighted:
            return float(env_reward)
        return stage_reward(parts, gold, self.curriculum.lambdas)

    # -- RDS and the baselines ----------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether the sampler filters now (False before format convergence with warmup_gate)."""
        return self.sampler_name != "none" and (not self.warmup_gate or self.curriculum.format_converged)

    def select(self, step: int, epoch: int, groups: Sequence[tuple[Hashable, Sequence[float]]],
               round_: int = 0) -> list[bool]:
        """Keep mask over ``groups`` = (prompt_id, live rollout rewards) of one sampling round.

        Updates the reward history (eqs. 9-11), records each prompt's category for the epoch, and
        applies the sampler when :attr:`active` (else keeps all). Groups with no rewards (all
        rollouts masked) are not kept and leave no trace in the history.
        """
        self._begin(step)
        idx = [i for i, (_, rs) in enumerate(groups) if len(rs) > 0]
        stats = [self.history.update(groups[i][0], groups[i][1]) for i in idx]
        cats = [categorize(s, self.params) for s in stats]
        if self.active:
            rng = np.random.default_rng([self.seed & 0xFFFFFFFF, int(step), int(round_)])
            sub = self.sampler(stats, self.params, rng)
        else:
            sub = [True] * len(stats)
        keep = [False] * len(groups)
        for j, i in enumerate(idx):
            keep[i] = bool(sub[j])
            self.shares.record(epoch, groups[i][0], cats[j], keep[i])
        t = self._tally
        t["active"] = float(self.active)
        t["rounds"] = t.get("rounds", 0.0) + 1
        t["in"] = t.get("in", 0.0) + len(stats)
        t["kept"] = t.get("kept", 0.0) + sum(bool(x) for x in sub)
        for c in CATEGORIES:
            t[c] = t.get(c, 0.0) + cats.count(c)
        return keep

    def to_request(self, target: int, have: int, keep_rate: float | None, max_request: int | None = None) -> int:
        """With ``refill`` (DAPO-style): more groups to sample, :func:`groups_to_request`; else 0."""
        return groups_to_request(target, have, keep_rate, max_request=max_request) if self.refill else 0

    # -- logging / checkpoints ------------------------------------------------------------------
    def step_metrics(self) -> dict[str, Any]:
        """The current step's metrics (keys in the module docstring, "Metrics"): the stage machine's
        state, whether the stage changed during this step, and the sampler's decisions and the
        batch's category shares summed over the step's sampling rounds."""
        out: dict[str, Any] = dict(self.curriculum.metrics())
        out["dscl/stage_changed"] = float(bool(self._step_transitions))
        if self._step_transitions:
            ev = self._step_transitions[-1]
            out["dscl/transition"] = {**ev.to_dict(), "from": self._step_transitions[0].from_stage}
        t = self._tally
        if "in" in t:
            n = max(1.0, t["in"])
            out.update({"dscl/sampler_active": t["active"], "dscl/groups_in": t["in"],
                        "dscl/groups_kept": t["kept"], "dscl/keep_rate": t["kept"] / n})
            for c in CATEGORIES:
                out[f"dscl/batch_{_slug(c)}"] = t[c] / n
        return out

    def epoch_metrics(self, epoch: int) -> dict[str, float]:
        """Category shares and sampler decisions of ``epoch`` (:meth:`CategoryShares.epoch_metrics`)."""
        return self.shares.epoch_metrics(epoch)

    def epoch_record(self, epoch: int, *, partial: bool = False) -> dict[str, Any]:
        """One ``phase="epoch"`` record of metrics.jsonl (module docstring, "Metrics"): the epoch,
        whether it was cut short by the end of the run, its category shares and decisions, the stage
        at its end and the stage transitions that happened during it (by step)."""
        return {"epoch": int(epoch), "dscl/partial": float(bool(partial)), **self.epoch_metrics(epoch),
                "dscl/stage": float(self.curriculum.stage), "dscl/sampler": self.sampler_name}

    def summary(self) -> dict[str, Any]:
        """For summary.json: sampler, final stage, every stage transition and the per-epoch category
        shares (Fig. 3 / Table 5 of DSCL), the last (possibly partial) epoch included."""
        return {"sampler": self.sampler_name, "curriculum": self.curriculum.weighted,
                "stage": self.curriculum.stage,
                "transitions": [t.to_dict() for t in self.curriculum.transitions],
                "epochs": {str(e): m for e, m in self.shares.table().items()}}

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler_name, "curriculum": self.curriculum.state_dict(),
                "history": self.history.state_dict(), "shares": self.shares.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("sampler", self.sampler_name) != self.sampler_name:
            raise ValueError(f"checkpoint used sampler {state['sampler']!r}, this run {self.sampler_name!r}")
        self.curriculum.load_state_dict(state["curriculum"])
        self.history.load_state_dict(state["history"])
        self.shares.load_state_dict(state["shares"])
