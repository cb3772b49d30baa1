"""The CPU trainer: one RL run from a config (``reflrl train``).

* :mod:`.data`     the splits and the order of training prompts
* :mod:`.setup`    model, engines, environments and critic of a run
* :mod:`.warmup`   the supervised warm-up phase
* :mod:`.step`     one RL step in one read: collect -> recover -> select -> advantages -> batch -> loss ->
                   optimiser step (:func:`~reflrl.train.step.train_step`, :func:`~reflrl.train.step.policy_update`)
* :mod:`.batch`    rollouts packed for the update, and their log-probs
* :mod:`.extras`   registries of advantage shapers (GAE) and auxiliary losses (KL, PPO's value loss)
* :mod:`.update`   the update's metrics and DPO's own update
* :mod:`.callbacks` hooks of a run (notices, the rollout log, yours)
* :mod:`.state`    the run's typed state
* :mod:`.loop`     :class:`Trainer`: its components, the run's phases, checkpoints, time guard
* :mod:`.summary`  summary.json and the printed summary
"""
from .callbacks import Callback
from .data import PromptSampler, splits_from_config
from .loop import Trainer, train, write_run_report
from .summary import format_summary

__all__ = ["Callback", "PromptSampler", "Trainer", "format_summary", "splits_from_config", "train", "write_run_report"]
