"""The Python API: reflrl.Trainer takes its components and callbacks (whatever is not given is built from
the config), and research options plug into the update through the registries of reflrl.train.extras."""
from __future__ import annotations

import json

import pytest
import torch

import reflrl
from reflrl.critic import RuleCritic
from reflrl.models import load_model
from reflrl.train import Callback
from reflrl.train.data import splits_from_config
from reflrl.train.extras import AUX_LOSSES
from reflrl.train.setup import make_envs

from doubles import scripted, tiny_cfg


class Recorder(Callback):
    def __init__(self):
        self.notices, self.steps, self.evals, self.ended = [], [], [], None

    def on_notice(self, trainer, msg):
        self.notices.append(msg)

    def on_step_end(self, trainer, rollouts, rows, metrics):
        self.steps.append(([r.advantage for r in rows], len(rollouts.groups), dict(metrics)))
        metrics["recorder_saw"] = 1.0  # a callback may add to the step's metrics line

    def on_evaluate(self, trainer, name, result):
        self.evals.append(name)

    def on_train_end(self, trainer, summary):
        self.ended = summary


def test_trainer_takes_its_components_and_callbacks(tmp_path):
    cfg = tiny_cfg(tmp_path, **{"reflection.variant": "tool_rerl", "reflection.group": "add", "train.steps": 2,
                                "train.log_rollouts": "true"})
    model, tok = load_model("tiny-random", dtype="float32", trainable="all", seed=0)
    splits = splits_from_config(cfg.data)
    tasks = {"train": splits["train"][:4], "test": splits["test"][:2]}  # val comes from the config
    made = []

    def env_factory(c, ts, count):
        made.append((len(ts), count))
        return make_envs(c, ts, count)

    critic, rec = RuleCritic(), Recorder()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tr = reflrl.Trainer(cfg, tmp_path / "run", progress=False, quiet=True, model=model, tokenizer=tok, tasks=tasks,
                        env_factory=env_factory, critic=critic, engine=scripted(cfg), callbacks=[rec])
    try:
        assert tr.model is model and tr.critic is critic and tr.train_tasks == tasks["train"]
        assert tr.splits["test"] == tasks["test"] and tr.splits["val"] == splits["val"]
        assert made == [(4, cfg.rollout.n * cfg.rollout.batch_prompts)]
        summary = tr.run()
    finally:
        tr.close()
    assert any(not torch.equal(before[n], p.detach()) for n, p in model.named_parameters())  # the given model trained
    assert rec.notices and not any("[reflrl]" in n for n in rec.notices)  # quiet: notices reach callbacks only
    assert len(rec.steps) == 2 and any(any(a != 0 for a in adv) for adv, _, _ in rec.steps)
    assert rec.evals[0] == "eval before" and rec.ended is summary
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(x.get("recorder_saw") == 1.0 for x in lines if x.get("phase") == "train")
    logged = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    trained = sorted(a for adv, _, _ in rec.steps for a in adv)
    assert sorted(r["advantage"] for r in logged if r["advantage"] is not None) == pytest.approx(trained)


def test_model_without_tokenizer_is_refused(tmp_path):
    cfg = tiny_cfg(tmp_path)
    model, _tok = load_model("tiny-random", dtype="float32", trainable="all", seed=0)
    with pytest.raises(reflrl.ConfigError, match="tokenizer"):
        reflrl.Trainer(cfg, tmp_path / "run", progress=False, quiet=True, model=model)


def test_a_registered_auxiliary_loss_enters_the_update_and_an_unused_one_costs_nothing(tmp_path):
    calls = []

    def make(ctx):
        calls.append(len(ctx.mbs))
        return lambda j, mb, lp: (0.0 * lp.sum(), {"probe": 1.0})

    AUX_LOSSES.register("probe_loss", make, when=lambda a: a.lr == 0.00042)
    try:
        for lr, want in ((1e-4, False), (0.00042, True)):
            cfg = tiny_cfg(tmp_path / str(lr), **{"algo.lr": lr})
            tr = reflrl.Trainer(cfg, tmp_path / str(lr) / "run", progress=False, quiet=True, engine=scripted(cfg))
            try:
                m = tr.train_step()
            finally:
                tr.close()
            assert m["update_skipped"] == 0.0
            assert ("probe" in m) == want and (bool(calls) == want)
    finally:
        del AUX_LOSSES._entries["probe_loss"], AUX_LOSSES._meta["probe_loss"]
