"""``reflrl train``'s run, top to bottom (CleanRL style: one readable path from the config to the loss).

    cfg -> splits (train/val/test tasks)                       reflrl.train.data
        -> model, engines, envs, critic                        reflrl.train.setup
        -> run folder                                          reflrl.runlog
    eval before (greedy exact match on the test split)         reflrl.heldout
    warm-up: SFT on the train split's gold calls when the model cannot write calls yet   reflrl.train.warmup
    eval after the warm-up
    for each RL step (Trainer.train_step; reflrl.train.step):
        collect    n rollouts per prompt of the seeded per-epoch order, minus the prompts the online
                   pre-rollout filter skips (efficiency paper, arXiv:2606.00135, sec. 4.1, eqs. 4-6);
                   env steps run concurrently (VerlTool, arXiv:2509.01055, sec. 3.3)
        recover    Tool-ReRL: failures critiqued and retried under q*, repairs join their groups
        score      DSCL: curriculum stage reward (eq. 7)
        select     filter streaks, DAPO / DSCL samplers (refill rounds)
        advantages masked GRPO over the live rollouts (eq. 2), max-variance down-sampling (sec. 4.2, eq. 7)
        update     clipped surrogate with clip-higher (eq. 3, appendix F), token-mean; eq. 2's importance
                   weight on repaired rows (reflrl.train.update)
        account    metrics, recovery accounting
    eval after; summary.json; a short human summary (reflrl.train.summary).

Old log-probs: with one optimiser step per rollout batch (``algo.epochs_per_batch == 1``) the policy
that sampled is exactly the current one, so old_logprob = current logprob, detached (ratio 1, the plain
policy gradient); the engine's log-probs are not used as "old" because they come from a different kernel
path (KV-cache decoding) whose numerical noise would show up as spurious ratios and clipping. With several
epochs the old log-probs are recomputed once with the current model before the first update.

The recipe is defined by step counts, so the same seed gives the same numbers on any machine; the time
budget is only a guard (reflrl.budget).
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reflrl import config as C
from reflrl import rollout as R
from reflrl.algos import PreRolloutFilter, advantage_needs_critic
from reflrl.budget import budget_cut_text, cut_record
from reflrl.errors import DiskSpaceError
from reflrl.memory import PeakMemory, offload_optimizer_state, release_heap
from reflrl.envs.seeding import derive_seed
from reflrl.progress import Progress
from reflrl.recovery import RecoveryLedger, own_rollouts, step_accounting
from reflrl.runlog import RunLog, latest_checkpoint, load_checkpoint, refuse_existing_run, refuse_slimmed_resume
from reflrl.threads import fix_threads

from . import step as S
from .callbacks import Callback, CallbackList, Notices, RolloutLog
from .data import PromptSampler, splits_from_config
from .extras import value_head_for
from .setup import EngineFactory, EnvFactory, answer_format, build_components, check_checkpoint_space, messages_fn
from .state import RunState
from .summary import build_summary, ledger_totals
from .update import dpo_update
from .warmup import run_warmup


class Trainer:
    """Holds everything a run needs; :meth:`run` executes it (see the module docstring).

    ``run_dir``: the run folder (created; with ``resume=True`` the run continues from its last
    checkpoint with the same data order and filter state). Components, each built from ``cfg`` when not
    given (as TRL's trainers take theirs):

    * ``model``, ``tokenizer``: the policy (a causal LM with trainable parameters) and its tokenizer;
    * ``tasks``: the splits, ``{"train": [...], "val": [...], "test": [...]}`` of
      :class:`reflrl.envs.types.Task` (a missing split comes from ``cfg.data``);
    * ``env_factory``: ``(cfg, tasks, count) -> (envs, server or None)``, the rollout environments
      (default :func:`reflrl.train.setup.make_envs`);
    * ``critic``: the reflection critic of a variant that reflects (``reflrl.recovery.get_critic``);
    * ``engine``: a factory ``(model, tokenizer) -> RolloutEngine`` for rollouts, retries and evaluation;
    * ``callbacks``: :class:`reflrl.train.callbacks.Callback` s, called after the built-in ones (notices
      unless ``quiet``; the rollout log with ``train.log_rollouts``).
    """

    def __init__(self, cfg: C.Config, run_dir: str | Path, *, resume: bool = False, progress: bool = True,
                 quiet: bool = False, engine: EngineFactory | None = None, model: torch.nn.Module | None = None,
                 tokenizer: Any = None, tasks: dict[str, list] | None = None, env_factory: EnvFactory | None = None,
                 critic: Any = None, callbacks: list[Callback] | tuple[Callback, ...] = ()):
        self.cfg = cfg
        self.quiet = quiet
        self.callbacks = CallbackList(([] if quiet else [Notices()]) + ([RolloutLog()] if cfg.train.log_rollouts
                                                                         else []) + list(callbacks))
        self.state = RunState()
        self.t_start = time.perf_counter()
        if not resume:
            refuse_existing_run(run_dir)  # before the model loads
        else:
            refuse_slimmed_resume(run_dir)  # before RunLog would cut its metrics back to no checkpoint
        # bars on a terminal, plain lines with elapsed time and ETA elsewhere (CI logs, nohup, pipes)
        self.progress_out = Progress(enabled=progress and not quiet, clock=self.elapsed, start=0.0,
                                     remaining_after=self._remaining_after)
        tr = cfg.train
        fix_threads(tr.threads)  # fixed for the run (reflrl.threads: why the count never changes mid-run)
        random.seed(tr.seed)
        np.random.seed(tr.seed)
        torch.manual_seed(tr.seed)
        C.check_trainer(cfg)  # this trainer's limits (e.g. reflection.variant='ppo' needs a value head)

        # ---- data ------------------------------------------------------------------
        self.splits = {**(splits_from_config(cfg.data) if set(tasks or {}) < {"train", "val", "test"} else {}),
                       **(tasks or {})}
        self.train_tasks = self.splits["train"]
        self.prefilter = PreRolloutFilter(cfg.algo.prefilter_k)
        self.sampler = PromptSampler([t.id for t in self.train_tasks], tr.seed, self.prefilter)
        self.sampling = None  # DSCL curriculum / prompt-level samplers; None = off
        sc = cfg.sampling
        if sc.sampler != "none" or sc.curriculum:
            from reflrl.algos.dscl import SamplingController, batches_per_epoch

            self.sampling = SamplingController.from_config(
                sc, reward_name=cfg.env.reward, seed=tr.seed,
                batches_per_epoch=batches_per_epoch(len(self.train_tasks), cfg.rollout.batch_prompts))
        self.messages = messages_fn(cfg)

        # ---- model, engines, critic, envs -------------------------------------------------
        parts = build_components(cfg, self.train_tasks, say=self.say, engine=engine, model=model, tokenizer=tokenizer,
                                 env_factory=env_factory, critic=critic)
        self.model, self.tokenizer, self.precision = parts.model, parts.tokenizer, parts.precision
        self.decode_weights = parts.decode_weights  # rollout.packed_weights as resolved
        self.decode_attention = parts.decode_attention  # rollout.decode_attention as resolved
        self.decode_matmul = parts.decode_matmul  # rollout.decode_matmul as resolved
        self.engine, self.eval_engine, self.remote_engine = parts.engine, parts.eval_engine, parts.remote_engine
        self.variant, self.critic, self.envs, self.tool_server = parts.variant, parts.critic, parts.envs, parts.tool_server
        self.rollout_cfg, self.load_s = parts.rollout, parts.load_s
        try:
            check_checkpoint_space(cfg, run_dir, self.model, resume=resume)  # before minutes of work are lost
        except DiskSpaceError:
            if parts.tool_server is not None:
                parts.tool_server.shutdown()
            raise
        self.eval_cfg = dataclasses.replace(self.rollout_cfg, temperature=0.0)  # greedy, same caps and early stop
        self.eval_batch = 64  # greedy evaluation: prompts decoded together (sorted by length)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise C.ConfigError(f"model.trainable={cfg.model.trainable!r} leaves no trainable parameter")
        groups = [{"params": params}]
        self._demos: list | None = None  # the supervised anchor's demonstrations (algo.sft_coef), built on first use
        self.value_head = None  # PPO's critic (algo.advantage=gae): a value head on the policy's trunk
        if advantage_needs_critic(cfg.algo.advantage):
            self.value_head = value_head_for(self.model)
            groups.append({"params": list(self.value_head.parameters())})
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.algo.lr, weight_decay=cfg.algo.weight_decay)
        self.ref_model = None  # KL / DPO reference: the policy as RL starts, see run()
        self.loop = asyncio.new_event_loop()

        # ---- run folder and state -------------------------------------------------------
        self.log = RunLog(run_dir, None, resume=resume)
        trunk = getattr(self.eval_engine, "trunk_cache", None)
        if trunk is not None and trunk.spill is None:  # the held-out prompts' trunk states wait on disk
            trunk.spill = self.log.path
        if not resume:
            C.save_config(cfg, self.log.path / "config.yaml", header="resolved config of this run "
                          "(reflrl train --resume RUN_DIR reads it back)")
        self.step = 0
        if resume:
            ck = latest_checkpoint(self.log.path)
            if ck is None:  # killed before the first checkpoint: RunLog emptied the metrics
                self.say(f"{self.log.path} has no checkpoint yet: the run starts from the beginning")
            else:
                self._load(ck)
        # peak resident memory by phase (summary, report): loading is what this process held so far
        self.memory = PeakMemory(self.state.peak_rss_mb)
        self.memory.record("load")

    # -------------------------------------------------------------------------------- small helpers
    @property
    def rollout_engine(self):
        """The engine that samples RL rollouts: the remote one when configured, else ``self.engine``."""
        return self.remote_engine if self.remote_engine is not None else self.engine

    def elapsed(self) -> float:
        """Seconds of this run so far (across --resume)."""
        return self.state.elapsed_before_s + (time.perf_counter() - self.t_start)

    def demo_batch(self) -> dict[str, Any]:
        """``algo.sft_batch`` clean demonstrations (the warm-up's gold answers of the training split), drawn by
        the step's seed, collated for :func:`reflrl.sft.sft_loss` (the update's supervised anchor, algo.sft_coef)."""
        from reflrl.sft import build_examples, collate, sft_pad_id

        if self._demos is None:
            self._demos = build_examples(self.train_tasks, self.tokenizer, self.messages, fmt=answer_format(self.cfg))
            if not self._demos:
                raise ValueError("algo.sft_coef > 0 needs demonstrations: no training task has gold calls")
        rng = random.Random(derive_seed(self.cfg.train.seed, self.step, 3, bits=31))
        pick = rng.sample(range(len(self._demos)), min(self.cfg.algo.sft_batch, len(self._demos)))
        return collate([self._demos[i] for i in pick], sft_pad_id(self.tokenizer))

    def weights_updated(self) -> None:
        """After each optimiser step: the engine hook ``on_weights_updated(model)`` of the engine that samples
        rollouts, where it has one (vLLM copies the weights in; an engine sampling from the trained model
        itself needs nothing)."""
        hook = getattr(self.rollout_engine, "on_weights_updated", None)
        if hook is not None:
            hook(self.model)

    def training_forwards(self) -> Any:
        """A context for the training forward passes (warm-up, update): the rollout engine's hook
        ``training_forwards(model)`` where it has one (the transformers engine lends its packed copies of
        the frozen float32 layers), else a plain context."""
        hook = getattr(self.rollout_engine, "training_forwards", None)
        return hook(self.model) if hook is not None else contextlib.nullcontext()

    def release_memory(self) -> None:
        """Before a phase's peak (an evaluation, an RL step's generation): the C heap's free memory back to
        the system (:func:`reflrl.memory.release_heap`), and the engine hook ``release_unused_weights(model)``
        of each engine that has one (the plain weights that its packed copies stand in for, read again by
        a checkpoint's save)."""
        release_heap()
        for engine in {id(e): e for e in (self.rollout_engine, self.eval_engine) if e is not None}.values():
            hook = getattr(engine, "release_unused_weights", None)
            if hook is not None:
                hook(self.model)

    def weights_changing(self) -> None:
        """Before the optimiser steps of an update or a warm-up: the engine hook ``on_weights_changing(model)``
        of each engine that has one (the decode step's copies of the trained weights are freed for the
        update, not rebuilt until the next generation)."""
        for engine in {id(e): e for e in (self.rollout_engine, self.eval_engine) if e is not None}.values():
            hook = getattr(engine, "on_weights_changing", None)
            if hook is not None:
                hook(self.model)

    def _remaining_after(self) -> float | None:
        """Estimated seconds after the current phase (progress ETA): during RL, the final evaluation."""
        return self._eval_estimate_s() if self.state.get("phase") == "rl" else None

    def say(self, msg: str) -> None:
        """A notice for the user, through the callbacks (printed by :class:`reflrl.train.callbacks.Notices`)."""
        self.callbacks.on_notice(self, msg)

    # -------------------------------------------------------------------------------- evaluation
    def evaluate(self, split: str = "test") -> dict[str, Any]:
        """The held-out evaluation of a split (reflrl.heldout): greedy exact-match accuracy; with faults,
        the greedy episodes under them (:meth:`evaluate_episodes`) are the one evaluation."""
        from reflrl.heldout import evaluate

        t0 = time.perf_counter()
        offload_optimizer_state(self.optimizer, self.log.path)  # AdamW's moments wait on disk meanwhile
        self.release_memory()  # theirs and what the phase before freed or read (a warm-up, a checkpoint)
        with self.memory.phase("eval"):
            if self.cfg.env.faults:
                res = self.evaluate_episodes(split)
            else:
                res = evaluate(self.eval_engine, self.tokenizer, self.splits[split], self.messages, self.eval_cfg,
                               batch_size=self.eval_batch).to_dict()
        release_heap()  # its KV and prefill buffers back to the system (reflrl.memory)
        self.state["timers"]["eval_s"] += time.perf_counter() - t0
        return res

    def evaluate_episodes(self, split: str = "test") -> dict[str, Any]:
        """Greedy episodes of a split under the run's faults and fault exposure, with the fixed fault seed
        ``env.eval_fault_seed``, and reflection's repair rate on their failures when the variant reflects
        (:func:`reflrl.heldout.aevaluate_episodes`)."""
        from reflrl.heldout import aevaluate_episodes
        from reflrl.recovery import arecover
        from reflrl.train.setup import make_envs

        tasks = self.splits[split]
        if len(getattr(self, "_eval_envs", None) or []) < len(tasks):  # one env per task: one batched evaluation
            self._close_eval_envs()
            self._eval_envs, self._eval_server = make_envs(self.cfg, tasks, len(tasks), prefix="e", fault_seed=None)
        envs, seed = self._eval_envs, int(self.cfg.env.eval_fault_seed)

        # every fault-caused failure of the evaluation is reflected on, and the first
        # reflection.eval_policy_errors policy errors (reflection.max_per_step caps a training step only)
        cfg = dataclasses.replace(self.cfg, reflection=dataclasses.replace(self.cfg.reflection, max_per_step=0))

        def recover(trajs):
            return arecover(trajs, cfg=cfg, engine=self.eval_engine, tokenizer=self.tokenizer, envs=envs,
                            critic=self.critic, messages_of=self.messages, rollout_cfg=self.eval_cfg, seed=seed,
                            max_policy_errors=self.cfg.reflection.eval_policy_errors)

        return self.loop.run_until_complete(aevaluate_episodes(
            self.eval_engine, self.tokenizer, envs, tasks, self.eval_cfg, seed=seed,
            recover=recover if self.critic is not None else None))

    def probe_format_rate(self) -> float:
        """The share of sampled answers (rollout temperature) on ``warmup.probe_n`` tasks that parse as calls."""
        from reflrl.heldout import format_rate

        w = self.cfg.warmup
        pool = self.splits["val"] or self.train_tasks
        tasks = [pool[i % len(pool)] for i in range(w.probe_n)]
        t0 = time.perf_counter()
        with self.memory.phase("eval"):
            r = format_rate(self.engine, self.tokenizer, tasks, self.messages, self.rollout_cfg,
                            batch_size=self.eval_batch, seed=derive_seed(self.cfg.train.seed, 77, bits=31))
        self.state["timers"]["eval_s"] += time.perf_counter() - t0
        return r

    def _evaluate_phase(self, name: str, split: str) -> dict[str, Any]:
        """A held-out evaluation as a progress phase (a line when it starts and when it ends)."""
        n = len(self.splits[split])
        if self.progress_out.enabled:
            self.progress_out.line(f"{name}: {n} held-out tasks, greedy")
        res = self.evaluate(split)
        self.callbacks.on_evaluate(self, name, res)
        if self.progress_out.enabled:
            self.progress_out.line(f"{name} done: accuracy {res['accuracy']:.1%} in {res['seconds']:.0f}s "
                                   f"({res.get('new_tokens', 0)} new tokens)")
        return res

    # -------------------------------------------------------------------------------- warm-up
    def warmup(self) -> dict[str, Any]:
        """The warm-up phase (reflrl.train.warmup): exactly ``warmup.steps`` SFT steps unless the time
        guard cuts it (then recorded as a budget cut)."""
        w, tr = self.cfg.warmup, self.cfg.train
        if w.probe_n > 0:  # sampled at the rollout temperature on probe_n tasks (costs a generation pass)
            before = (self.probe_format_rate(), f"{w.probe_n} sampled answers (temperature {self.cfg.rollout.temperature})")
        elif self.state.get("eval_before"):  # free: the greedy answers of the held-out evaluation that just ran
            before = (float(self.state["eval_before"]["format_rate"]), "greedy held-out evaluation")
        else:  # train.eval_before=false (validated: warmup.enabled is then true or false)
            before = (None, "not measured: train.eval_before=false")
        n_evals = 1 + int(bool(w.eval_after or tr.eval_every))  # still to come, each about the first one's cost
        with self.memory.phase("warmup"), self.training_forwards():
            self.weights_changing()
            out = run_warmup(self.cfg, model=self.model, tokenizer=self.tokenizer, train_tasks=self.train_tasks,
                             messages=self.messages, fmt=answer_format(self.cfg), format_rate_before=before,
                             over_budget=self._over_budget, reserve_s=n_evals * self._eval_estimate_s(),
                             progress=self.progress_out, log=lambda s, m: self.log.log(s, m, phase="warmup"),
                             say=self.say, probe=self.probe_format_rate if w.probe_n > 0 else None)
        self.state["timers"]["warmup_s"] += out.get("seconds", 0.0)
        if out.get("sft_cut"):
            self._record_cut("warm-up", out["sft_steps"], w.steps)
        return out

    # -------------------------------------------------------------------------------- one RL step
    def rollout(self, task_idx: list[int], round_: int, timings: dict[str, float]) -> list[R.Trajectory]:
        """n rollouts of each training task in ``task_idx`` (seeded by the step and the sampling round)."""
        tasks = [self.train_tasks[i] for i in task_idx]
        seed = derive_seed(self.cfg.train.seed, self.step, round_, 1, bits=31)
        self.state.episodes += len(tasks) * self.cfg.rollout.n
        return self.loop.run_until_complete(
            R.arollout(self.rollout_engine, self.tokenizer, self.envs, tasks, self.cfg.rollout.n, self.rollout_cfg,
                       seed=seed, timings=timings))

    def recover(self, trajs: list[R.Trajectory], round_: int) -> Any:
        """Tool-ReRL's reflection-recovery on one round of rollouts (:func:`reflrl.recovery.arecover`):
        triage, batched reflection-guided retries, repaired rollouts in their groups."""
        from reflrl.recovery import arecover

        res = self.loop.run_until_complete(arecover(
            trajs, cfg=self.cfg, engine=self.engine, tokenizer=self.tokenizer, envs=self.envs, critic=self.critic,
            messages_of=self.messages, rollout_cfg=self.rollout_cfg,
            seed=derive_seed(self.cfg.train.seed, self.step, round_, 2, bits=31)))
        if res.errors and not self.state.reflection_error_shown:
            self.state.reflection_error_shown = True
            self.say(f"reflection failed for {len(res.errors)} rollout(s) (counted, training goes on): {res.errors[0]}")
        return res

    def train_step(self) -> dict[str, Any]:
        """One RL step: :func:`reflrl.train.step.train_step` (collect -> recover -> select -> advantages ->
        batch -> loss -> optimiser step -> account); returns its metrics. AdamW's moments then wait on
        disk until the next optimiser step reads them (:func:`reflrl.memory.offload_optimizer_state`): the
        rollouts and the forward/backward passes between two steps never read them."""
        m = S.train_step(self)
        if m.get("update_skipped") == 0.0 and offload_optimizer_state(self.optimizer, self.log.path):
            release_heap()  # the memory they held in the heap (their first step), back to the system
        return m

    def dpo_step(self, kept: list[list[R.Trajectory]]) -> tuple[int, dict[str, Any]]:
        """DPO's own update (the ``dpo`` variant, Tool-ReRL's baseline): one step of DPO on the (repaired,
        failed) pairs of the kept groups against the policy as DPO started; (rollouts with a signal, metrics)."""
        from reflrl.recovery import dpo_pairs

        pairs = dpo_pairs([t for g in kept for t in g])
        if not pairs:
            return 0, {}
        if self.ref_model is None:  # the policy as DPO starts (no update happened before the first pair)
            self.ref_model = frozen_copy(self.model)
        m = dpo_update(self.model, self.optimizer, self.ref_model, pairs, self.cfg, self.pad_id)
        self.weights_updated()
        return 2 * len(pairs), m

    def account(self, got: S.StepRollouts, n_signal: int, update_metrics: dict[str, Any], timings: dict[str, float],
                rollout_s: float, update_s: float, t_step: float) -> dict[str, Any]:
        """The step's metrics and the run's running totals (reward/accuracy of the policy's own samples;
        ``masked``: left out of the loss)."""
        all_trajs = got.trajectories
        stats = R.rollout_stats(own_rollouts(all_trajs))
        counts, rec_metrics = step_accounting(got.recoveries, all_trajs, n_signal)
        RecoveryLedger(self.state.setdefault("recovery", {})).add_step(
            counts, [r.critic for r in got.recoveries], n_signal, update_metrics)
        masked = sum(t.masked for t in all_trajs)
        zvr = got.zero_var / max(1, got.live_groups)
        st = self.state
        st.masked += masked
        st.trajectories += len(all_trajs)
        st.zero_var_ratio.append(zvr)
        st.rewards.append(stats["reward_mean"])
        st.timers.rollout_s += rollout_s
        st.timers.update_s += update_s
        return {**rec_metrics, **stats,
                "epoch": self.sampler.epoch, "groups": len(got.groups), "zero_var_ratio": zvr, "masked": masked,
                "sampling_rounds": got.rounds, "prefilter_skipped_epoch": self.sampler.skipped.get(self.sampler.epoch, 0),
                "task_ids": [g[0].task.id for g in got.groups],
                "group_all_correct": [S.group_all_correct(g) for g in got.groups],  # aligned with task_ids (reflrl.report)
                "time_rollout_s": rollout_s, "time_generate_s": timings.get("generate_s", 0.0),
                "time_env_s": timings.get("env_s", 0.0), "time_update_s": update_s,
                "time_step_s": time.perf_counter() - t_step}

    # -------------------------------------------------------------------------------- checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        s = self.state.to_dict()
        s["step"] = self.step
        s["elapsed_before_s"] = self.elapsed()
        s["sampler"] = self.sampler.state_dict()
        s["prefilter"] = self.prefilter.state_dict()
        if self.sampling is not None:
            s["sampling"] = self.sampling.state_dict()
        return s

    def save(self) -> Path:
        path = self.log.save_checkpoint(self.step, model=self.model, tokenizer=self.tokenizer,
                                        optimizer=self.optimizer, state=self.checkpoint_state(),
                                        keep_last=self.cfg.train.keep_checkpoints)
        if self.value_head is not None:  # PPO's critic travels with the checkpoint
            torch.save(self.value_head.state_dict(), Path(path) / "value_head.pt")
        return path

    def _load(self, ck: Path) -> None:
        s = load_checkpoint(ck, model=self.model, optimizer=self.optimizer)
        if self.value_head is not None and (ck / "value_head.pt").exists():
            self.value_head.load_state_dict(torch.load(ck / "value_head.pt", map_location="cpu", weights_only=True))
        self.step = int(s.pop("step"))
        self.sampler.load_state_dict(s.pop("sampler"))
        self.prefilter.load_state_dict(s.pop("prefilter"))
        sampling = s.pop("sampling", None)
        if self.sampling is not None and sampling is not None:
            self.sampling.load_state_dict(sampling)
        self.state.update(s)
        self.t_start = time.perf_counter()
        self.say(f"resumed {self.log.path} at step {self.step} ({ck.name})")

    # -------------------------------------------------------------------------------- the run
    def run(self) -> dict[str, Any]:
        """Eval before, warm-up, eval after warm-up, RL steps, eval after, summary.

        The time budget (``train.time_budget_min``, ``warmup.time_budget_min``) is only a guard: a phase
        it cuts is recorded in ``state["budget_cuts"]`` and reported loudly (log, summary, report, exit status)."""
        cfg, tr = self.cfg, self.cfg.train
        st = self.state
        st.setdefault("budget_cuts", [])
        if st["phase"] == "done":  # resumed after the final checkpoint: nothing to redo
            summary = self.summary()
            self.log.write_summary(summary)
            return summary
        if st["phase"] == "start":
            self.say(f"run folder {self.log.path}; model {cfg.model.name} loaded in {self.load_s:.0f}s; "
                     f"{len(self.train_tasks)} train / {len(self.splits['test'])} test tasks; "
                     f"faults: {cfg.env.faults or 'none'}"
                     + (f" (RL rollouts: {C.train_faults(cfg.env)}, env.train_fault_scale)"
                        if C.train_faults(cfg.env) != cfg.env.faults else ""))
            if tr.eval_before:
                st["eval_before"] = self._evaluate_phase("eval before", "test")
                self.log.log(0, {f"test_{k}": v for k, v in st["eval_before"].items()}, phase="eval")
                self.say(f"held-out accuracy before: {st['eval_before']['accuracy']:.1%} "
                         f"({st['eval_before']['n']} tasks, {st['eval_before']['seconds']:.0f}s)")
            else:
                self.say("held-out evaluation before training: skipped (train.eval_before=false)")
            st["warmup"] = self.warmup()
            if st["warmup"].get("ran") and (cfg.warmup.eval_after or tr.eval_every):
                # what the warm-up alone gives, to tell it apart from RL's gain (costs one more evaluation)
                st["eval_after_warmup"] = self._evaluate_phase("eval after warm-up", "test")
                self.log.log(0, {f"test_after_warmup_{k}": v for k, v in st["eval_after_warmup"].items()},
                             phase="eval")
                self.say(f"held-out accuracy after warm-up: {st['eval_after_warmup']['accuracy']:.1%} "
                         f"({st['eval_after_warmup']['seconds']:.0f}s)")
                if cfg.warmup.probe_n == 0:  # the warm-up's format rate, from the same greedy answers
                    st["warmup"]["format_rate_after"] = float(st["eval_after_warmup"]["format_rate"])
            st["phase"] = "rl"
            self.save()
        if cfg.algo.kl_coef > 0 and self.ref_model is None:
            # the reference is the policy RL starts from (after the warm-up; on --resume, the resumed one)
            self.ref_model = frozen_copy(self.model)
        with self.memory.phase("rl"):
            self._rl_phase()
        st["phase"] = "done"
        if self.step == 0 and "eval_after_warmup" in st:
            # no RL step ran (e.g. a warm-up-only run, train.steps=0): the model is the one just evaluated
            st["eval_after"] = dict(st["eval_after_warmup"])
        else:
            st["eval_after"] = self._evaluate_phase("eval after", "test")
        self.log.log(self.step, {f"test_{k}": v for k, v in st["eval_after"].items()}, phase="eval")
        self.save()
        summary = self.summary()
        self.log.write_summary(summary)
        self.callbacks.on_train_end(self, summary)
        return summary

    def _rl_phase(self) -> None:
        """RL steps until ``train.steps`` (or ``train.rl_minutes``, or the time guard); periodic validation
        and checkpoints."""
        tr = self.cfg.train
        final_eval_s = self._eval_estimate_s()
        step_times: list[float] = []
        stop_reason = "steps"
        phase = self.progress_out.phase("RL", tr.steps, initial=self.step) if tr.steps else None
        while self.step < tr.steps:
            est = float(np.mean(step_times[-3:])) if step_times else 0.0
            rl_s = self.state.rl_seconds  # RL step time so far (kept across --resume)
            if tr.rl_minutes is not None and rl_s > 0 and rl_s + est > tr.rl_minutes * 60:
                stop_reason = "rl_minutes"  # the equal-time rule the user chose: not a cut, but said
                self.say(f"RL stopped by train.rl_minutes={tr.rl_minutes:g} after {self.step} steps "
                         f"({rl_s / 60:.1f} min of RL steps): a time-based stop, so the step count depends on "
                         "this machine's speed and load")
                break
            if self._over_budget(est + final_eval_s):
                stop_reason = "time_budget"
                self._record_cut("RL", self.step, tr.steps)
                break
            m = self.train_step()
            self.step += 1
            step_times.append(m["time_step_s"])
            self.state.rl_seconds += float(m["time_step_s"])
            if self.step % tr.log_every == 0 or self.step == tr.steps:
                self.log.log(self.step, m)
            if tr.eval_every and self.step % tr.eval_every == 0 and self.splits["val"]:
                ev = self.evaluate("val")
                self.log.log(self.step, {f"val_{k}": v for k, v in ev.items()}, phase="eval")
            if tr.save_every and self.step % tr.save_every == 0:
                self.save()
            if phase is not None:
                phase.update(1, reward=m["reward_mean"], acc=m["correct_rate"], zero_var=m["zero_var_ratio"],
                             masked=int(m["masked"]))
        if phase is not None:
            phase.close({"time_budget": "cut by the time budget", "rl_minutes": "stopped by train.rl_minutes"}
                        .get(stop_reason, ""))
        self.state["stop_reason"] = stop_reason
        if self.sampling is not None and self.sampler.epoch >= 0:  # the last epoch's shares so far
            self.log.log(self.step, self.sampling.epoch_record(
                self.sampler.epoch, partial=self.sampler.pos < len(self.sampler.order)), phase="epoch")

    # -------------------------------------------------------------------------------- the time guard
    def _eval_estimate_s(self) -> float:
        """Seconds the next held-out evaluation should take: the last one's."""
        for key in ("eval_after_warmup", "eval_before"):
            if self.state.get(key):
                return float(self.state[key].get("seconds", 0.0))
        return 0.0

    def _over_budget(self, upcoming_s: float) -> bool:
        """Would ``upcoming_s`` more seconds overrun ``train.time_budget_min`` (the whole run's guard)?"""
        b = self.cfg.train.time_budget_min
        return b is not None and self.elapsed() + upcoming_s > b * 60

    def _record_cut(self, phase: str, done: int, planned: int) -> None:
        """Record (and say loudly) that the time budget cut ``phase`` at ``done`` of ``planned`` steps."""
        cut = cut_record(phase, done, planned, elapsed_s=self.elapsed(), budget_min=self.cfg.train.time_budget_min,
                         warmup_budget_min=self.cfg.warmup.time_budget_min)
        self.state.setdefault("budget_cuts", []).append(cut)
        print(f"[reflrl] WARNING: {budget_cut_text(cut)}", file=sys.stderr, flush=True)
        self.log.log(self.step, {"budget_cut_phase": phase, "budget_cut_done": done, "budget_cut_planned": planned},
                     phase="budget")

    # -------------------------------------------------------------------------------- the end
    def summary(self) -> dict[str, Any]:
        return build_summary(self.state.to_dict(), cfg=self.cfg, run_dir=str(self.log.path), step=self.step,
                             precision=self.precision, decode_weights=self.decode_weights,
                             decode_attention=self.decode_attention, decode_matmul=self.decode_matmul,
                             load_s=self.load_s, elapsed_s=self.elapsed(),
                             prefilter_skipped=self.sampler.skipped, sampling=self.sampling,
                             faults=ledger_totals(self.envs))

    def _close_eval_envs(self) -> None:
        """Close the held-out evaluation's envs and their tool server (best-effort)."""
        for env in getattr(self, "_eval_envs", None) or []:
            try:
                if getattr(env, "_client", None) is not None:
                    self.loop.run_until_complete(env.aclose())
            except Exception:  # noqa: BLE001  closing is best-effort
                pass
        if getattr(self, "_eval_server", None) is not None:
            self._eval_server.shutdown()
        self._eval_envs, self._eval_server = None, None

    def close(self) -> None:
        for env in self.envs:
            try:
                if getattr(env, "_client", None) is not None:
                    self.loop.run_until_complete(env.aclose())
            except Exception:  # noqa: BLE001  closing is best-effort at shutdown
                pass
        self._close_eval_envs()
        if not self.loop.is_closed():
            self.loop.close()
        if self.tool_server is not None:
            self.tool_server.shutdown()
        self.log.close()


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of ``model`` (the KL / DPO reference: the policy as RL starts)."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def train(cfg: C.Config, run_dir: str | Path, *, resume: bool = False, progress: bool = True,
          quiet: bool = False, report: bool = True, engine: EngineFactory | None = None,
          **components: Any) -> dict[str, Any]:
    """Run a whole training job; returns the summary (also in run_dir/summary.json). With ``report``
    the run report (reflrl.report: report.html, report.md, plots/) is written at the end and its
    path returned as ``summary["report"]`` (None, with the reason on stderr, if it failed: the
    finished training is never lost to a report error). ``components``: :class:`Trainer`'s (model,
    tokenizer, tasks, env_factory, critic, callbacks)."""
    trainer = Trainer(cfg, run_dir, resume=resume, progress=progress, quiet=quiet, engine=engine, **components)
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    if report:
        summary["report"] = write_run_report(trainer.log.path)
    return summary


def write_run_report(run_dir: str | Path) -> str | None:
    """``reflrl report RUN_DIR`` for a finished run; logs (never raises) a failure."""
    try:
        from reflrl.report import build_report

        return str(build_report(run_dir).html)
    except Exception as e:  # noqa: BLE001  the training is done; the report can be redone by hand
        print(f"[reflrl] the run finished but its report could not be written: {type(e).__name__}: {e}\n"
              f"[reflrl] retry with: reflrl report {run_dir}", file=sys.stderr, flush=True)
        return None
