"""The trainer: updates, masking, run folder, kill-and-resume (tiny random model, scripted answers)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reflrl import config as C
from reflrl import rollout as R
from reflrl import train as T
from reflrl.cli import main as cli_main
from reflrl.train.batch import batch_logprobs, make_batch
from reflrl.train.step import policy_update
from reflrl.train.data import splits_from_config
from reflrl.train.step import group_advantages
from reflrl.train.summary import ledger_totals
from reflrl.cli import build_parser
from reflrl.cli.train import resolve_config
from reflrl.algos import PreRolloutFilter
from reflrl.envs.types import Task, ToolCall

from doubles import ScriptedEngine, answer_by_task, gold_text, run_until_killed, scripted, tiny_cfg

ROOT = Path(__file__).resolve().parent.parent


def scripted_trainer(cfg, run_dir, answer=None, resume=False) -> T.Trainer:
    """A Trainer whose engine answers by script: ``answer(tasks)`` (default: gold for even samples)."""
    return T.Trainer(cfg, run_dir, resume=resume, progress=False, quiet=True,
                     engine=scripted(cfg, answer or answer_by_task))


def trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


# ----------------------------------------------------------------------------- updates
def test_a_few_steps_change_trainable_params_with_finite_loss(tmp_path):
    cfg = tiny_cfg(tmp_path, **{"train.steps": 2, "train.save_every": 0})
    tr = scripted_trainer(cfg, tmp_path / "run")
    try:
        before = trainable(tr.model)
        frozen_before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if not p.requires_grad}
        summary = tr.run()
    finally:
        tr.close()
    after = trainable(tr.model)
    assert any(not torch.equal(before[n], after[n]) for n in before), "no trainable parameter changed"
    for n, p in tr.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(frozen_before[n], p)
    rows = [r for r in tr.log.read_metrics() if r["phase"] == "train"]
    assert len(rows) == 2
    for r in rows:
        assert r["update_skipped"] == 0.0
        assert r["loss"] is not None and abs(r["loss"]) < 1e3
        assert r["grad_norm"] is not None and r["grad_norm"] > 0
        assert r["zero_var_ratio"] == 0.0  # every group mixes right and wrong answers
    # the run folder has everything the issue lists
    run = tmp_path / "run"
    for f in ("config.yaml", "versions.json", "metrics.jsonl", "summary.json"):
        assert (run / f).is_file(), f
    assert list(run.glob("events.out.tfevents.*"))
    ck = sorted((run / "checkpoints").iterdir())[-1]
    assert (ck / "model" / "config.json").is_file() and (ck / "optimizer.pt").is_file()
    s = json.loads((run / "summary.json").read_text())
    assert s["accuracy_before"] == 1.0 and s["steps"] == 2  # the scripted sample 0 is always right
    assert len(s["zero_var_ratio_per_step"]) == 2
    assert set(s["time_s"]) >= {"rollout_s", "update_s", "eval_s", "total_s"}
    assert summary["faults"]["calls"] > 0
    assert C.load_config(run / "config.yaml") == cfg  # the resolved config reloads to the same


def _traj(prompt, pieces, adv_group=0):
    t = R.Trajectory(task=None, group=adv_group, prompt_ids=list(prompt))
    for kind, ids in pieces:
        if kind == "act":
            t.append_action(ids, [-1.0] * len(ids))
        else:
            t.append_observation(ids)
    return t


def test_observation_tokens_get_no_gradient(tmp_path):
    """Advantages/old log-probs at observation positions (loss_mask 0) cannot change the loss or the
    gradient: garbage there gives exactly the same update as zeros."""
    from reflrl.models import load_model

    model, tok = load_model("tiny-random", dtype="float32", trainable="all", seed=1)
    t = _traj([5, 6, 7, 8], [("act", [10, 11, 12]), ("obs", [20, 21, 22, 23]), ("act", [13, 14])])
    batch = make_batch([t], [1.5], pad_id=0)
    assert batch.response_mask[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 1, 1]
    assert batch.advantages[0, 3:7].tolist() == [0.0] * 4  # no advantage on observations

    from reflrl.algos import clipped_policy_loss

    def grads(poison: bool):
        model.zero_grad(set_to_none=True)
        lp = batch_logprobs(model, batch)
        adv, old = batch.advantages.clone(), lp.detach().clone()
        if poison:
            obs = batch.response_mask == 0
            adv[obs] = 1e6
            old[obs] = -50.0
        loss, _ = clipped_policy_loss(lp, old, adv, batch.response_mask)
        loss.backward()
        return float(loss.detach()), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    l0, g0 = grads(False)
    l1, g1 = grads(True)
    assert l0 == l1
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    # and observation positions carry no log-prob term at all
    lp = batch_logprobs(model, batch)
    assert lp[0, 3:7].tolist() == [0.0] * 4


def test_prompt_sharing_gives_the_full_sequence_logprobs_and_gradients():
    """The prompt-once path (one prefill per prompt, cache copied to its rollouts) computes the same
    log-probs and gradients as full-sequence forwards, with prompts of different lengths."""
    from reflrl.models import load_model

    model, tok = load_model("tiny-random", dtype="float32", trainable="all", seed=2)
    trajs = [_traj([5, 6, 7, 8, 9], [("act", [10, 11, 12])]),
             _traj([5, 6, 7, 8, 9], [("act", [13]), ("obs", [30, 31]), ("act", [14, 15])]),
             _traj([40, 41], [("act", [16, 17, 18, 19])]),
             _traj([40, 41], [("act", [20])])]
    batch = make_batch(trajs, [1.0, -1.0, 0.5, -0.5], pad_id=0)
    assert len(batch.prompts) == 2 and batch.owner.tolist() == [0, 0, 1, 1]

    def run(share):
        model.zero_grad(set_to_none=True)
        lp = batch_logprobs(model, batch, share_prompt=share)
        (lp * batch.advantages).sum().backward()
        return lp.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    lp_s, g_s = run(True)
    lp_f, g_f = run(False)
    assert torch.allclose(lp_s, lp_f, atol=1e-5)
    assert (lp_s[batch.response_mask.bool()] < 0).all()
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g_s, g_f))


def test_masked_rollouts_get_no_advantage_and_no_baseline_shift():
    task = Task(id="a", query="q", tools=[], gold=[[ToolCall("f", {})]])

    def traj(reward, masked):
        t = R.Trajectory(task=task, group=0, prompt_ids=[1], reward=reward, masked=masked)
        t.append_action([2, 3], [-1.0, -1.0])
        return t

    grp = [traj(1.0, False), traj(0.0, False), traj(0.0, True), traj(0.0, True)]
    a = C.AlgoConfig()
    rows = group_advantages([grp], a)
    assert [r.traj for r in rows] == grp[:2] and [r.group for r in rows] == [0, 0]  # the masked rollouts are out
    adv = [r.advantage for r in rows]  # advantages travel on the rows
    assert adv[0] > 0 > adv[1] and adv[0] == pytest.approx(-adv[1])
    # a group whose only live rollout is right: zero variance, zero advantage (never negative)
    rows = group_advantages([[traj(1.0, False), traj(0.0, True)]], a)
    assert [r.advantage for r in rows] == [0.0]
    # down-sampling m=2 keeps one of each class (eq. 7)
    grp = [traj(r, False) for r in (1.0, 1.0, 1.0, 0.0)]
    rows = group_advantages([grp], C.AlgoConfig(downsample_m=2))
    assert sorted(r.traj.reward for r in rows) == [0.0, 1.0]


def test_env_faults_on_one_prompt_are_masked_not_penalised_in_a_training_step(tmp_path):
    """100% server errors on the tools of every episode: all rollouts masked, none trained on,
    no negative advantage anywhere, and the step still completes."""
    cfg = tiny_cfg(tmp_path, **{"train.steps": 1, "train.save_every": 0, "env.faults": "server_error=1.0",
                                "env.retry.max_attempts": 1,
                                "env.fault_exposure": "client"})
    tr = scripted_trainer(cfg, tmp_path / "run")
    try:
        m = tr.train_step()
    finally:
        tr.close()
    assert m["masked"] == m["groups"] * cfg.rollout.n
    assert m["trained_rollouts"] == 0 and m["update_skipped"] == 1.0
    assert ledger_totals(tr.envs)["given_up"] > 0


# ----------------------------------------------------------------------------- data order + filter
def test_prompt_sampler_is_seeded_and_filter_skips_all_correct_prompts():
    ids = [f"t{i}" for i in range(5)]
    s1, s2 = T.PromptSampler(ids, 3, PreRolloutFilter(1)), T.PromptSampler(ids, 3, PreRolloutFilter(1))
    assert s1.next(7) == s2.next(7)
    f = PreRolloutFilter(1)
    s = T.PromptSampler(ids, 0, f)
    first = s.next(5)
    assert sorted(first) == list(range(5))
    for i in first:
        f.update(ids[i], [1.0] * 4 if i in (0, 1) else [1.0, 0.0, 0.0, 0.0])
    second = s.next(3)
    assert 0 not in second and 1 not in second and s.skipped[1] == 2


def test_kill_and_resume_gives_the_same_next_batches_and_filter_state(tmp_path):
    """An uninterrupted 7-step run vs a run killed in step 5 (after the step-4 checkpoint) and
    resumed in a fresh Trainer: the same prompts in steps 5-7 and the same filter streaks.
    Tasks 0, 2, 4 of the train split are always answered right (all-correct groups, skipped by the
    filter next epoch); the others are mixed."""
    over = {"train.steps": 7, "train.save_every": 1, "rollout.batch_prompts": 2, "rollout.n": 2,
            "algo.prefilter_k": 1}

    def engine_for(cfg):
        sp = splits_from_config(cfg.data)
        tasks = sp["train"] + sp["test"]
        easy = {t.query for t in sp["train"][::2]}
        mixed = answer_by_task(tasks)

        def answer(text, j):
            task = next(t for t in tasks if t.query in text)
            return gold_text(task) if task.query in easy else mixed(text, j)
        return lambda model, tok: ScriptedEngine(tok, answer)

    # A: uninterrupted
    cfg_a = tiny_cfg(tmp_path / "a", **over)
    a = T.Trainer(cfg_a, tmp_path / "a" / "run", progress=False, quiet=True, engine=engine_for(cfg_a))
    try:
        a.run()
    finally:
        a.close()
    rows_a = {r["step"]: r["task_ids"] for r in a.log.read_metrics() if r["phase"] == "train"}
    assert sum(a.sampler.skipped.values()) > 0  # the filter did skip prompts

    # B: killed in step 5
    cfg_b = tiny_cfg(tmp_path / "b", **over)
    b = T.Trainer(cfg_b, tmp_path / "b" / "run", progress=False, quiet=True, engine=engine_for(cfg_b))
    run_until_killed(b, 4)
    assert (tmp_path / "b" / "run" / "checkpoints" / "step_000004").is_dir()

    # resume in a fresh Trainer (reads config.yaml + the last checkpoint)
    cfg_r, run_dir, resume = resolve_config(build_parser().parse_args(
        ["train", "--resume", str(tmp_path / "b" / "run")]))
    assert resume and cfg_r == cfg_b
    r = T.Trainer(cfg_r, run_dir, resume=True, progress=False, quiet=True, engine=engine_for(cfg_r))
    assert r.step == 4
    try:
        r.run()
    finally:
        r.close()
    rows_b = {}
    for row in r.log.read_metrics():
        if row["phase"] == "train":
            rows_b[row["step"]] = row["task_ids"]
    assert [rows_b[s] for s in (5, 6, 7)] == [rows_a[s] for s in (5, 6, 7)]
    assert r.prefilter.state_dict() == a.prefilter.state_dict()
    assert r.sampler.state_dict() == a.sampler.state_dict()


def test_dynamic_sampling_refills_zero_variance_groups(tmp_path):
    """DAPO dynamic sampling: groups whose rollouts are all right are dropped and more prompts are
    sampled; only groups with reward variance are trained."""
    cfg = tiny_cfg(tmp_path, **{"train.steps": 1, "train.save_every": 0, "sampling.sampler": "dapo",
                                "sampling.warmup_gate": False, "sampling.refill": True,
                                "sampling.max_refill_rounds": 3, "rollout.batch_prompts": 2, "rollout.n": 2})
    sp = splits_from_config(cfg.data)
    tasks = sp["train"] + sp["test"]
    easy = {t.query for t in sp["train"][:4]}
    mixed = answer_by_task(tasks)

    def answer(text, j):
        task = next(t for t in tasks if t.query in text)
        return gold_text(task) if task.query in easy else mixed(text, j)

    tr = T.Trainer(cfg, tmp_path / "run", progress=False, quiet=True,
                   engine=lambda model, tok: ScriptedEngine(tok, answer))
    try:
        m = tr.train_step()
    finally:
        tr.close()
    order = tr.sampler.state_dict()["order"]
    n_easy_first = sum(1 for i in order[: m["groups"]] if i < 4)
    assert m["sampling_rounds"] > 1 or n_easy_first == 0
    assert m["groups_trained"] == min(2, m["groups"] - n_easy_first)
    assert m["zero_var_ratio"] == pytest.approx(n_easy_first / m["groups"])


def test_kl_to_reference_and_several_epochs_per_batch(tmp_path):
    """kl_coef > 0 builds a frozen reference at RL start; with 2 epochs per batch the old log-probs
    are recomputed once and the second epoch sees ratios != 1 and a non-zero KL."""
    cfg = tiny_cfg(tmp_path, **{"train.steps": 1, "train.save_every": 0, "algo.kl_coef": 0.1,
                                "algo.epochs_per_batch": 2, "algo.lr": 1e-3})
    tr = scripted_trainer(cfg, tmp_path / "run")
    try:
        tr.run()
    finally:
        tr.close()
    row = [r for r in tr.log.read_metrics() if r["phase"] == "train"][0]
    assert tr.ref_model is not None
    assert row["kl"] is not None and row["kl"] > 0
    assert row["ratio_max"] > 1.0 or row["ratio_min"] < 1.0


def test_multi_turn_training_step(tmp_path):
    """A GRPO step on the multi-turn env: a tool call, its observation, then a text answer; the
    update trains the two actions (observations masked) and changes the parameters."""
    cfg = tiny_cfg(tmp_path, **{"train.steps": 1, "train.save_every": 0, "env.id": "reflrl/ToolCallMultiTurn-v0",
                                "rollout.max_turns": 3, "rollout.max_total_tokens": 2048})
    sp = splits_from_config(cfg.data)
    first = answer_by_task(sp["train"] + sp["test"])

    def answer(text, j):
        return first(text, j) if "<|im_start|>tool" not in text else "Done."

    tr = T.Trainer(cfg, tmp_path / "run", progress=False, quiet=True,
                   engine=lambda model, tok: ScriptedEngine(tok, answer, row_as_sample=True))
    try:
        before = trainable(tr.model)
        m = tr.train_step()
    finally:
        tr.close()
    assert m["update_skipped"] == 0.0 and m["masked"] == 0
    assert any(not torch.equal(before[n], p) for n, p in trainable(tr.model).items())


def test_dscl_sampling_and_curriculum_are_wired_and_checkpointed(tmp_path):
    cfg = tiny_cfg(tmp_path, **{"train.steps": 4, "train.save_every": 2, "env.reward": "fine",
                                "sampling.sampler": "rds", "sampling.curriculum": True,
                                "sampling.warmup_gate": False, "algo.prefilter_k": 0})
    tr = scripted_trainer(cfg, tmp_path / "run")
    try:
        summary = tr.run()
    finally:
        tr.close()
    rows = [r for r in tr.log.read_metrics() if r["phase"] == "train"]
    assert all("dscl/keep_rate" in r and "dscl/stage" in r and "dscl/stage_changed" in r for r in rows)
    # visibility (DSCL Fig. 3): one epoch row per finished epoch (6 tasks / 2 per step = 3
    # steps) and one for the epoch the run stopped in, with shares of the categories summing to 1
    epochs = [r for r in tr.log.read_metrics() if r["phase"] == "epoch"]
    assert [(r["epoch"], r["dscl/partial"]) for r in epochs] == [(0, 0.0), (1, 1.0)]
    assert epochs[0]["dscl/prompts"] == 6
    for r in epochs:
        assert sum(r[f"dscl/share_{c}"] for c in ("a", "b1", "b2", "c1", "c2")) == pytest.approx(1.0)
    assert summary["sampling"]["sampler"] == "rds" and set(summary["sampling"]["epochs"]) == {"0", "1"}
    assert summary["rollouts"] == 4 * 2 * cfg.rollout.n  # no refill: steps x prompts x n
    ck = json.loads((sorted((tmp_path / "run" / "checkpoints").iterdir())[-1] / "state.json").read_text())
    assert ck["sampling"]["sampler"] == "rds"
    with pytest.raises(C.ConfigError):
        T.Trainer(tiny_cfg(tmp_path / "x", **{"sampling.curriculum": True}), tmp_path / "x" / "run")


def test_rollout_engine_openai_is_refused_without_off_policy_consent_and_routes_rollouts(tmp_path):
    """rollout.engine='openai': a server samples from its own weights, which the trainer cannot sync, so
    the config is refused unless rollout.engine_off_policy=true; then rollouts (only) go to it."""
    from reflrl.engines.openai_engine import OpenAIEngine

    with pytest.raises(C.ConfigError, match="engine_off_policy"):
        tiny_cfg(tmp_path, **{"rollout.engine": "openai", "rollout.engine_base_url": "http://127.0.0.1:9/v1"})
    with pytest.raises(C.ConfigError, match="engine_base_url"):
        tiny_cfg(tmp_path, **{"rollout.engine": "openai", "rollout.engine_off_policy": True})
    with pytest.raises(C.ConfigError, match="rollout.engine"):
        tiny_cfg(tmp_path, **{"rollout.engine": "sglang"})
    cfg = tiny_cfg(tmp_path, **{"rollout.engine": "openai", "rollout.engine_base_url": "http://127.0.0.1:9/v1",
                                "rollout.engine_off_policy": True, "train.steps": 1, "train.save_every": 0})
    tr = T.Trainer(cfg, tmp_path / "run", progress=False, quiet=True)
    try:
        assert isinstance(tr.remote_engine, OpenAIEngine) and tr.rollout_engine is tr.remote_engine
        assert tr.remote_engine.model == "tiny-random"  # engine_model null = model.name
        answers = answer_by_task(tr.train_tasks + tr.splits["test"])
        tr.remote_engine = ScriptedEngine(tr.tokenizer, answers)  # stands in for the server
        tr.engine = None  # the local engine must not sample rollouts
        m = tr.train_step()
    finally:
        tr.close()
    assert tr.remote_engine.calls and m["update_skipped"] == 0.0


def test_rollout_engine_vllm_needs_vllm_and_gets_the_weights_after_every_update(tmp_path, monkeypatch):
    """rollout.engine='vllm': without vLLM (this CPU machine) the trainer stops with an error naming the
    gpu extra; with an engine (a stand-in here: vLLM cannot run on the CPU) rollouts go to it and the
    trained weights are pushed to it after each update, so sampling stays on-policy."""
    import importlib.util

    cfg = tiny_cfg(tmp_path, **{"rollout.engine": "vllm", "train.steps": 1, "train.save_every": 0})
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError, match=r"\.\[gpu\]"):
            T.Trainer(cfg, tmp_path / "run0", progress=False, quiet=True)
    pushed = []

    class Recording(ScriptedEngine):
        def on_weights_updated(self, model):  # the engine hook the trainer calls after each optimiser step
            pushed.append({k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad})

    import reflrl.engines as engines

    made = {}

    def fake_get_engine(name, **kw):
        made.update(kw, name=name)
        return None  # replaced below, once the tokenizer exists

    monkeypatch.setattr(engines, "get_engine", fake_get_engine)
    tr = T.Trainer(cfg, tmp_path / "run", progress=False, quiet=True)
    try:
        assert made["name"] == "vllm" and made["model_path"] == "tiny-random"
        tr.remote_engine = Recording(tr.tokenizer, answer_by_task(tr.train_tasks + tr.splits["test"]))
        m = tr.train_step()
    finally:
        tr.close()
    assert tr.remote_engine.calls, "rollouts must come from the vllm engine"
    assert m["update_skipped"] == 0.0 and len(pushed) == 1
    for name, p in tr.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(pushed[0][name], p.detach())  # the updated weights, not the old ones


def test_cli_rejects_bad_config_with_status_2(tmp_path, capsys):
    assert cli_main(["train", "--config", str(ROOT / "configs" / "tiny.yaml"), "--set", "algo.clip_hihg=0.3"]) == 2
    assert "clip_high" in capsys.readouterr().err
    assert cli_main(["train", "--faults", "rate_limit=2"]) == 2


@pytest.mark.slow
def test_tiny_recipe_on_the_real_model(tmp_path):
    """The default recipe shrunk to seconds of work on the embedded SmolLM2: warm-up, two GRPO
    steps with faults, both evaluations; everything finite, the run folder complete."""
    cfg = C.load_config(ROOT / "configs" / "default.yaml", [
        f"train.out_dir={tmp_path}", "train.run_name=real", "data.n_train=16", "data.n_val=0",
        "data.n_test=2", "warmup.enabled=true", "warmup.steps=3", "warmup.probe_n=0", "warmup.batch_size=2",
        "warmup.eval_after=false", "rollout.batch_prompts=2", "rollout.n=2", "rollout.max_new_tokens=24",
        "train.steps=2",
        "train.time_budget_min=null", "env.faults=rate_limit=0.2"])
    summary = T.train(cfg, tmp_path / "real", progress=False, quiet=True)
    assert summary["steps"] == 2
    assert summary["warmup"]["ran"] and summary["warmup"]["sft_loss_last"] < summary["warmup"]["sft_loss_first"]
    assert 0.0 <= summary["accuracy_after"] <= 1.0
    assert (tmp_path / "real" / "summary.json").is_file()


def test_sft_epoch_batches_cover_every_example_once_with_little_padding():
    import random

    from reflrl.sft import SFTExample, _epoch_batches, build_examples, collate
    from reflrl.envs.prompts import build_messages
    from reflrl.models import load_tokenizer

    ex = [SFTExample(list(range(n)), [1, 2]) for n in random.Random(0).sample(range(10, 400), 64)]
    batches = _epoch_batches(ex, 4, random.Random(1))
    assert sorted(i for b in batches for i in b) == list(range(64))
    waste = sum(max(len(ex[i].prompt_ids) for i in b) * len(b) - sum(len(ex[i].prompt_ids) for i in b)
                for b in batches)
    assert waste < 0.1 * sum(len(e.prompt_ids) for e in ex)
    # examples: the prompt is the rollout rendering; the answer is the gold call + end of turn, and
    # only the answer carries loss
    tok = load_tokenizer("tiny-random")
    task = Task(id="a", query="weather in Oslo?", tools=[{"name": "get_weather", "description": "d",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}],
                gold=[[ToolCall("get_weather", {"city": "Oslo"})]])
    (e,) = build_examples([task], tok, lambda t: build_messages(t, style="compact"))
    assert e.answer_ids[-1] == tok.eos_token_id
    assert tok.decode(e.answer_ids[:-1]).startswith("<tool_call>")
    b = collate([e], pad_id=0)
    assert int(b["response_mask"].sum()) == len(e.answer_ids)


def test_init_from_starts_from_a_checkpoints_trainable_params_not_its_step_or_optimizer(tmp_path):
    cfg_a = tiny_cfg(tmp_path / "a", **{"train.steps": 1, "train.save_every": 0})
    a = scripted_trainer(cfg_a, tmp_path / "a" / "run")
    try:
        a.run()
    finally:
        a.close()
    trained = trainable(a.model)
    ck = tmp_path / "a" / "run" / "checkpoints" / "step_000001"
    cfg_b = tiny_cfg(tmp_path / "b", **{"train.steps": 1, "model.init_from": str(ck)})
    b = T.Trainer(cfg_b, tmp_path / "b" / "run", progress=False, quiet=True)
    try:
        fresh = T.Trainer(tiny_cfg(tmp_path / "c"), tmp_path / "c" / "run", progress=False, quiet=True)
        fresh.close()
        got = trainable(b.model)
        assert got.keys() == trained.keys()
        assert all(torch.equal(got[n], trained[n]) for n in got)  # exact, dtype kept
        assert any(not torch.equal(got[n], trainable(fresh.model)[n]) for n in got)  # not the plain init
        assert b.step == 0 and not b.optimizer.state  # a new run: step 0, fresh optimizer
    finally:
        b.close()
    with pytest.raises(C.ConfigError, match="model.init_from: .* not a reflrl checkpoint"):
        tiny_cfg(tmp_path / "d", **{"model.init_from": str(tmp_path / "nowhere")})


def test_eval_before_false_skips_the_base_evaluation_and_needs_a_set_warmup(tmp_path):
    """train.eval_before=false: no held-out evaluation before training (the summary says n/a), the warm-up
    still runs when set on; with warmup.enabled='auto' it is refused (auto reads that evaluation)."""
    with pytest.raises(C.ConfigError, match="train.eval_before=false"):
        tiny_cfg(tmp_path / "x", **{"train.eval_before": "false", "warmup.enabled": "auto", "warmup.probe_n": 0})
    cfg = tiny_cfg(tmp_path, **{"train.eval_before": "false", "warmup.enabled": "true", "warmup.probe_n": 0, "warmup.steps": 1,
                                "warmup.batch_size": 2, "warmup.eval_after": "true", "train.steps": 1,
                                "train.save_every": 0})
    tr = scripted_trainer(cfg, tmp_path / "run")
    try:
        s = tr.run()
    finally:
        tr.close()
    assert s["accuracy_before"] is None and s["eval_before"] == {} and s["accuracy_gain"] is None
    assert s["warmup"]["ran"] and s["warmup"]["format_rate_before"] is None
    assert s["accuracy_after_warmup"] is not None and s["accuracy_after"] is not None
    assert "before" not in s["eval_seconds"] and "after_warmup" in s["eval_seconds"]
    from reflrl.train.summary import format_summary

    assert "held-out accuracy: n/a -> " in format_summary(s)
    # peak resident memory by phase: the phases that ran (no evaluation before), the run's peak their largest
    p = s["peak_rss_mb"]
    assert set(p) == {"load", "eval", "warmup", "rl", "run"} and p["run"] == max(v for k, v in p.items() if k != "run")
    assert all(v > 50 for v in p.values())  # MB: the process with torch and a model holds more than this
    assert "peak memory (resident): load " in format_summary(s)


def test_sft_anchor_adds_the_demonstrations_loss_to_the_update(tmp_path):
    """algo.sft_coef > 0: each RL update also descends the supervised loss of algo.sft_batch clean
    demonstrations (drawn by the step's seed, the same for the same step): with the policy's advantages
    zeroed, only that loss moves the parameters, and the demonstrations' loss goes down."""
    from reflrl.sft import sft_loss
    from reflrl.train.step import policy_update

    cfg = tiny_cfg(tmp_path, **{"train.steps": 1, "train.save_every": 0, "algo.sft_coef": 1.0,
                                "algo.sft_batch": 3, "algo.lr": 1e-3})
    tr = scripted_trainer(cfg, tmp_path / "run")
    try:
        demos = tr.demo_batch()
        assert demos["input_ids"].shape[0] == 3
        assert torch.equal(tr.demo_batch()["input_ids"], demos["input_ids"])  # seeded by the step
        trajs = tr.rollout([0], 0, {})
        batch = make_batch(trajs, [0.0] * len(trajs), tr.pad_id)  # no policy-gradient signal at all
        with torch.no_grad():
            nll0 = float(sft_loss(tr.model, demos))
        before = trainable(tr.model)
        m = policy_update(tr.model, tr.optimizer, batch, tr.cfg.algo, demos=demos)
        assert m["sft_loss"] == pytest.approx(nll0, rel=1e-4)
        assert any(not torch.equal(before[n], p) for n, p in trainable(tr.model).items())
        for _ in range(3):
            policy_update(tr.model, tr.optimizer, batch, tr.cfg.algo, demos=demos)
        with torch.no_grad():
            assert float(sft_loss(tr.model, demos)) < nll0
        # off (the default): the same zero-advantage update leaves the parameters as they are (a fresh
        # optimizer, so no momentum of the updates above moves them)
        tr.cfg.algo.sft_coef = 0.0
        before = trainable(tr.model)
        fresh = torch.optim.AdamW([p for p in tr.model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
        policy_update(tr.model, fresh, batch, tr.cfg.algo, demos=demos)
        assert all(torch.equal(before[n], p) for n, p in trainable(tr.model).items())
        tr.cfg.algo.sft_coef = 1.0
        m = tr.train_step()  # wired into the step
        assert m["update_skipped"] == 1.0 or m["sft_loss"] > 0
    finally:
        tr.close()


def test_engines_hear_of_an_update_before_its_optimiser_steps_and_after(tmp_path):
    """``on_weights_changing(model)`` reaches the engine before the update's optimiser steps (the weights
    are still the sampled ones: the engine may free what it derived from them) and ``on_weights_updated``
    after them, once each per update."""
    cfg = tiny_cfg(tmp_path, **{"train.steps": 1, "train.save_every": 0})
    events = []

    class Recording(ScriptedEngine):
        def on_weights_changing(self, model):
            events.append(("changing", trainable(model)))

        def on_weights_updated(self, model):
            events.append(("updated", trainable(model)))

    sp = splits_from_config(cfg.data)
    tasks = sp["train"] + sp["val"] + sp["test"]
    tr = T.Trainer(cfg, tmp_path / "run", progress=False, quiet=True,
                   engine=lambda model, tok: Recording(tok, answer_by_task(tasks)))
    try:
        before = trainable(tr.model)
        m = tr.train_step()
        after = trainable(tr.model)
    finally:
        tr.close()
    assert m["update_skipped"] == 0.0
    assert [e[0] for e in events] == ["changing", "updated"]
    assert all(torch.equal(events[0][1][k], before[k]) for k in before)
    assert all(torch.equal(events[1][1][k], after[k]) for k in after)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_adamws_moments_wait_on_disk_between_rl_steps(tmp_path, monkeypatch):
    """After an RL step that updated, the optimiser's moments live in a mapped (unlinked) file, not in the
    process's heap: the rollouts and forward/backward passes of the next step never read them. A run
    with the moments kept in memory reaches the same weights."""
    from mapping import mapped_file

    import reflrl.train.loop as L

    def two_steps(folder):
        tr = scripted_trainer(tiny_cfg(folder, **{"train.steps": 2, "train.save_every": 0}), folder / "run")
        try:
            m = tr.train_step()
            moments = [s[k] for s in tr.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
            where = [mapped_file(t) for t in moments]
            tr.train_step()
            return m, where, trainable(tr.model)
        finally:
            tr.close()

    m, where, weights = two_steps(tmp_path / "a")
    assert m["update_skipped"] == 0.0 and where and all(".mapped-" in w for w in where)
    monkeypatch.setattr(L, "offload_optimizer_state", lambda opt, folder: False)  # kept in memory
    _, where_kept, weights_kept = two_steps(tmp_path / "b")
    assert not any(".mapped-" in w for w in where_kept)
    assert weights.keys() == weights_kept.keys()
    assert all(torch.equal(v, weights_kept[k]) for k, v in weights.items())


def test_the_heap_is_trimmed_before_every_evaluation(tmp_path, monkeypatch):
    """An evaluation starts on a trimmed heap even where the optimiser has no state to move to disk (the
    evaluation after a warm-up, the one before training): what the phase before freed is not counted
    again under the evaluation's peak."""
    import reflrl.heldout as H
    import reflrl.train.loop as L

    events: list[str] = []
    monkeypatch.setattr(L, "release_heap", lambda: events.append("trim") or True)
    tr = scripted_trainer(tiny_cfg(tmp_path), tmp_path / "run")
    try:
        assert not any(tr.optimizer.state.values())  # nothing for the optimiser's offload to move
        result = {"accuracy": 0.0}
        monkeypatch.setattr(tr, "evaluate_episodes", lambda split="test": events.append("eval") or result)

        class Res:
            def to_dict(self):
                return result

        monkeypatch.setattr(H, "evaluate", lambda *a, **k: events.append("eval") or Res())
        tr.evaluate()
    finally:
        tr.close()
    assert events[:2] == ["trim", "eval"]
