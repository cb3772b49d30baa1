"""PPO on the native trainer: a value head on the policy's trunk, GAE (algo.advantage=gae) and the clipped
value loss, as verl and CleanRL have them; configs/ppo.yaml runs."""
from __future__ import annotations

import json

import pytest
import torch

from reflrl import config as C
from reflrl import rollout as R
from reflrl import train as T
from reflrl.algos.advantages import gae_advantage
from reflrl.cli import main as cli_main
from reflrl.envs.types import Task, ToolCall
from reflrl.models import load_model
from reflrl.train.batch import make_batch, micro_batches
from reflrl.train.extras import UpdateContext, gae_shaper, value_head_for
from reflrl.train.step import policy_update

from doubles import ROOT, scripted


def test_gae_matches_a_hand_computation():
    # one row: action tokens at 0, 1, then an observation token (mask 0), then action token 3; reward at the end
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.2, 9.0, 0.4]])  # the observation token's value is skipped
    mask = torch.tensor([[1, 1, 0, 1]])
    g, lam = 0.9, 0.8
    adv, ret = gae_advantage(r, v, mask, gamma=g, lam=lam, whiten=False)
    d3 = 1.0 - 0.4                        # last action: r + gamma * 0 - V
    a3 = d3
    d1 = 0.0 + g * 0.4 - 0.2              # the next action token is 3 (the observation is skipped)
    a1 = d1 + g * lam * a3
    d0 = 0.0 + g * 0.2 - 0.5
    a0 = d0 + g * lam * a1
    assert adv[0].tolist() == pytest.approx([a0, a1, 0.0, a3])
    assert ret[0].tolist() == pytest.approx([a0 + 0.5, a1 + 0.2, 0.0, a3 + 0.4])


def _batch(tok, rewards):
    task = Task(id="a", query="q", tools=[], gold=[[ToolCall("f", {})]])
    trajs = []
    for k, rew in enumerate(rewards):
        t = R.Trajectory(task=task, group=0, prompt_ids=tok("call f please", add_special_tokens=False)["input_ids"],
                         reward=rew)
        ids = tok(f"answer {k} " * (k + 1), add_special_tokens=False)["input_ids"]
        t.append_action(ids, [-1.0] * len(ids))
        trajs.append(t)
    return make_batch(trajs, [t.reward for t in trajs], tok.pad_token_id or 0)  # a gae row carries its reward


def test_gae_shaper_from_a_fresh_value_head_is_the_whitened_return():
    """V = 0 at the start (zero-initialised head), gamma = lambda = 1: every action token's advantage is the
    row's reward and its return too; the shaper whitens the advantages over the batch's action tokens."""
    model, tok = load_model("tiny-random", dtype="float32", trainable="all", seed=0)
    batch = _batch(tok, [1.0, 0.0, 0.0])
    mbs = micro_batches(batch, 8)
    a = C.AlgoConfig(advantage="gae", gamma=1.0, lam=1.0)
    m = gae_shaper(UpdateContext(model, mbs, a, float(batch.response_mask.sum()), value_head=value_head_for(model)))
    mb = mbs[0]
    sel = mb.response_mask.bool()
    reward_tok = (batch.advantages[batch.response_mask.bool()])  # each token holds its row's reward
    want = (reward_tok - reward_tok.mean()) / (reward_tok.std() + 1e-8)
    assert sorted(mb.advantages[sel].tolist()) == pytest.approx(sorted(want.tolist()), abs=1e-5)
    assert sorted(mb.returns[sel].tolist()) == pytest.approx(sorted(reward_tok.tolist()))
    assert float(mb.values.abs().sum()) == 0.0 and m["value_mean"] == 0.0


def test_value_loss_decreases_on_a_fixed_batch():
    torch.manual_seed(0)
    model, tok = load_model("tiny-random", dtype="float32", trainable="all", seed=0)
    head = value_head_for(model)
    opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.requires_grad]},
                             {"params": list(head.parameters())}], lr=1e-2)
    batch = _batch(tok, [1.0, 0.0, 1.0, 0.0])
    a = C.AlgoConfig(advantage="gae", gamma=1.0, lam=1.0, value_coef=1.0, value_clip=0.2, micro_batch_size=2)
    losses = [policy_update(model, opt, batch, a, value_head=head)["vf_loss"] for _ in range(12)]
    assert all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0] and losses[-1] < losses[len(losses) // 2]


def _ppo_cfg(tmp_path, **over):
    sets = ["model.name=tiny-random", "model.dtype=float32", "model.trainable=all", "data.n_train=6",
            "data.n_val=0", "data.n_test=4", "warmup.enabled=false", "rollout.n=4", "rollout.batch_prompts=2",
            "rollout.max_new_tokens=200", "rollout.answer_cap=null", "algo.downsample_m=0", "algo.micro_batch_size=4",
            "train.steps=2", "train.save_every=1", "train.eval_every=0", "train.time_budget_min=null",
            "train.threads=1", f"train.out_dir={tmp_path}", "train.run_name=run", "env.faults="]
    return C.load_config(ROOT / "configs" / "ppo.yaml", sets + [f"{k}={v}" for k, v in over.items()])


def test_ppo_recipe_trains_on_the_native_trainer_and_checkpoints_its_value_head(tmp_path, capsys):
    cfg = _ppo_cfg(tmp_path)
    assert cfg.reflection.variant == "ppo" and cfg.algo.advantage == "gae"
    assert C.check_trainer(cfg) is cfg
    tr = T.Trainer(cfg, tmp_path / "run", progress=False, quiet=True, engine=scripted(cfg))
    try:
        head0 = {k: v.clone() for k, v in tr.value_head.state_dict().items()}
        tr.run()
        head1 = {k: v.clone() for k, v in tr.value_head.state_dict().items()}
    finally:
        tr.close()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if x.get("phase") == "train"]
    assert len(steps) == 2 and all(x["update_skipped"] == 0.0 and x["vf_loss"] >= 0 for x in steps)
    assert any(not torch.equal(head0[k], head1[k]) for k in head0)  # the critic learns
    ck = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1]
    saved = torch.load(ck / "value_head.pt", weights_only=True)
    assert all(torch.equal(saved[k], head1[k]) for k in head1)
    # the CLI accepts the recipe on the native trainer (no value-head refusal)
    assert cli_main(["train", "--config", str(ROOT / "configs" / "ppo.yaml"), "--print-config"]) == 0
    assert "advantage: gae" in capsys.readouterr().out


def test_entropy_bonus_is_still_refused_by_the_native_trainer():
    with pytest.raises(C.ConfigError, match="entropy"):
        C.check_trainer(C.load_config(None, ["algo.entropy_coef=0.01"]))
