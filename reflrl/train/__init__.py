"""The CPU trainer: one RL run from a config (``reflrl train``).

* :mod:`.data`     the splits and the order of training prompts
* :mod:`.setup`    model, engines, environments and critic of a run
* :mod:`.warmup`   the supervised warm-up phase
* :mod:`.step`     the stages of one RL step (collect, recover, score, select, advantages)
* :mod:`.batch`    rollouts packed for the update, and their log-probs
* :mod:`.update`   the policy update (clipped surrogate, eq. 2's weight, DPO)
* :mod:`.loop`     :class:`Trainer`: the run's phases, checkpoints, time guard
* :mod:`.summary`  summary.json and the printed summary
"""
from .data import PromptSampler, splits_from_config
from .loop import Trainer, train, write_run_report
from .summary import format_summary

__all__ = ["PromptSampler", "Trainer", "format_summary", "splits_from_config", "train", "write_run_report"]
