"""Callbacks of a run (in the manner of TRL's ``TrainerCallback``): a :class:`Callback` overrides the hooks it
needs; :class:`reflrl.train.Trainer` calls them in order. The run's own notices and its rollout log are
callbacks too (:class:`Notices`, :class:`RolloutLog`), added unless ``quiet`` / ``train.log_rollouts`` say
otherwise.

    class PrintReward(Callback):
        def on_step_end(self, trainer, rollouts, rows, metrics):
            print(trainer.step, metrics["reward_mean"])

    Trainer(cfg, "runs/x", callbacks=[PrintReward()]).run()
"""
from __future__ import annotations

from typing import Any, Sequence


class Callback:
    """Hooks of a run; every one is a no-op here.

    on_notice(trainer, msg):  a line for the user (model loaded, accuracies, warnings of the run).
    on_step_end(trainer, rollouts, rows, metrics): after each RL step, before ``trainer.step`` counts it;
        ``rollouts``: the step's :class:`reflrl.train.step.StepRollouts`; ``rows``: the
        :class:`reflrl.train.step.Row` s it trained on (each with its advantage); ``metrics``: the step's
        metrics line (a callback may add keys before it is logged).
    on_evaluate(trainer, name, result): after a held-out evaluation (``name``: eval before, ...).
    on_train_end(trainer, summary): after the summary is written.
    """

    def on_notice(self, trainer: Any, msg: str) -> None:
        pass

    def on_step_end(self, trainer: Any, rollouts: Any, rows: Sequence[Any], metrics: dict[str, Any]) -> None:
        pass

    def on_evaluate(self, trainer: Any, name: str, result: dict[str, Any]) -> None:
        pass

    def on_train_end(self, trainer: Any, summary: dict[str, Any]) -> None:
        pass


class CallbackList(Callback):
    """Calls each callback's hook in order."""

    def __init__(self, callbacks: Sequence[Callback] = ()):
        self.callbacks = list(callbacks)

    def on_notice(self, trainer: Any, msg: str) -> None:
        for c in self.callbacks:
            c.on_notice(trainer, msg)

    def on_step_end(self, trainer: Any, rollouts: Any, rows: Sequence[Any], metrics: dict[str, Any]) -> None:
        for c in self.callbacks:
            c.on_step_end(trainer, rollouts, rows, metrics)

    def on_evaluate(self, trainer: Any, name: str, result: dict[str, Any]) -> None:
        for c in self.callbacks:
            c.on_evaluate(trainer, name, result)

    def on_train_end(self, trainer: Any, summary: dict[str, Any]) -> None:
        for c in self.callbacks:
            c.on_train_end(trainer, summary)


class Notices(Callback):
    """Prints the run's notices as ``[reflrl] ...`` lines (left out with ``quiet``)."""

    def on_notice(self, trainer: Any, msg: str) -> None:
        print(f"[reflrl] {msg}", flush=True)


class RolloutLog(Callback):
    """``train.log_rollouts``: every rollout of each step to ``rollouts.jsonl`` (text, reward, advantage,
    and for a reflection repair its q* and the failed attempt; :func:`reflrl.train.step.rollout_records`)."""

    def on_step_end(self, trainer: Any, rollouts: Any, rows: Sequence[Any], metrics: dict[str, Any]) -> None:
        from .step import rollout_records

        trainer.log.log_rollouts(trainer.step + 1, rollout_records(rollouts.groups, rows))
