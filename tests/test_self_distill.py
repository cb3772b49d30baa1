"""Self-distillation from the critic's feedback (algo.self_distill, SDPO arXiv:2601.20802)."""
from __future__ import annotations

import pytest
import torch

from reflrl import config as C
from reflrl import rollout as R
from reflrl.algos.distill import self_distill_advantages, topk_forward_kl
from reflrl.critic.rule import RuleCritic
from reflrl.envs.parsing import format_calls
from reflrl.envs.types import Task, ToolCall
from reflrl.models import load_tokenizer
from reflrl.recovery.distill import teacher_messages
from reflrl.train.batch import make_batch
from reflrl.train.distill import teacher_prompts

from doubles import tiny_cfg
from test_trainer import scripted_trainer, trainable

TOOLS = [{"type": "function", "function": {"name": "get_stock_quote", "description": "price of a stock",
                                          "parameters": {"type": "object", "properties": {"symbol": {"type": "string"}},
                                                         "required": ["symbol"]}}}]
GOLD = [ToolCall("get_stock_quote", {"symbol": "DIS"})]
QUERY = "What is Disney trading at?"


def msgs(task):
    return [{"role": "system", "content": "You call tools."}, {"role": "user", "content": task.query}]


def traj(task, text, correct, tok, group=0):
    t = R.Trajectory(task=task, group=group, prompt_ids=R.render_prompt(tok, msgs(task)))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    t.append_action(ids, [-0.5] * len(ids))
    t.turns, t.texts = 1, [text]
    R.record_step(t, 1.0 if correct else 0.0, {"correct": correct})
    return t


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-random")


def test_the_advantage_is_teacher_minus_student_clamped_and_masked():
    s = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    t = torch.tensor([[-3.0, -0.5, -0.5, -9.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    a = self_distill_advantages(s, t, m, clip=1.5)
    assert a.tolist() == [[-1.5, 1.5, 0.0, 0.0]]
    with pytest.raises(ValueError, match="shapes differ"):
        self_distill_advantages(s, t[:, :3], m)
    with pytest.raises(ValueError, match="clip"):
        self_distill_advantages(s, t, m, clip=0)


def test_topk_forward_kl_is_zero_at_the_teacher_and_pulls_toward_its_tokens():
    full_t = torch.log_softmax(torch.tensor([[3.0, 1.0, 0.0, -1.0, -2.0]]), -1)
    ids = full_t.topk(2, -1).indices
    t = full_t.gather(-1, ids)
    assert torch.allclose(topk_forward_kl(t, t), torch.zeros(1), atol=1e-6)
    logits = torch.zeros(1, 5, requires_grad=True)  # a uniform student
    s = torch.log_softmax(logits, -1).gather(-1, ids)
    kl = topk_forward_kl(s, t)
    assert kl.item() > 0
    kl.sum().backward()
    assert logits.grad[0, 0] < 0 and logits.grad[0, 4] > 0  # descent raises the teacher's top token
    assert torch.allclose(topk_forward_kl(s.detach(), t, add_tail=False), topk_forward_kl(s.detach() + 1.0, t, add_tail=False))
    with pytest.raises(ValueError, match="k"):
        topk_forward_kl(s[0], t[0])


def test_the_teacher_prompt_holds_feedback_and_solution_and_leaves_q_alone():
    q = [{"role": "system", "content": "tools"}, {"role": "user", "content": QUERY}]
    c = teacher_messages(q, feedback="Wrong  value\nfor symbol.", solution="<tool_call>x</tool_call>")
    assert q[1]["content"] == QUERY  # q untouched
    body = c[1]["content"]
    assert body.startswith(QUERY) and "Correct solution:\n\n<tool_call>x</tool_call>" in body
    assert "feedback from your unsuccessful earlier attempt:\n\nWrong value for symbol." in body
    assert body.rstrip().endswith("Correctly solve the original question.")
    assert "Correct solution" not in teacher_messages(q, feedback="f")[1]["content"]
    with pytest.raises(ValueError, match="needs feedback"):
        teacher_messages(q, feedback=" ", solution=None)


def test_failed_rollouts_get_a_teacher_prompt_with_the_critique_and_the_ground_truth_stays_out_of_q(tok):
    task = Task(id="t0", query=QUERY, tools=TOOLS, gold=[GOLD])
    right = format_calls(GOLD, "hermes")
    wrong = format_calls([ToolCall("get_stock_quote", {"symbol": "AAPL"})], "hermes")
    group = [traj(task, wrong, False, tok), traj(task, right, True, tok), traj(task, wrong, False, tok)]
    render = lambda m: R.render_prompt(tok, m)  # noqa: E731
    got = teacher_prompts([group], critic=RuleCritic(reveal="answer"), messages_of=msgs, render=render, fmt="hermes")
    assert [t for t, _ in got] == [group[0], group[2]]  # the correct rollout is not re-scored
    teacher = tok.decode(got[0][1])
    student = tok.decode(group[0].prompt_ids)
    assert "DIS" in teacher and "symbol" in teacher and "Correct solution" in teacher
    assert '"DIS"' not in student and "Correct solution" not in student and "feedback" not in student
    # without a correct peer the critique alone makes the teacher context
    alone = teacher_prompts([[group[0]]], critic=RuleCritic(reveal="answer"), messages_of=msgs, render=render,
                            fmt="hermes")
    assert "Correct solution" not in tok.decode(alone[0][1]) and "DIS" in tok.decode(alone[0][1])


def test_make_batch_adds_the_token_bonus_on_action_tokens(tok):
    task = Task(id="t0", query=QUERY, tools=TOOLS, gold=[GOLD])
    t = traj(task, "a wrong answer here", False, tok)
    n = len(t.response_ids)
    b = make_batch([t], [-1.0], 0, token_bonus=[[0.25] * n])
    assert torch.allclose(b.advantages[0, :n], torch.full((n,), -0.75))
    with pytest.raises(ValueError, match="token_bonus"):
        make_batch([t], [-1.0], 0, token_bonus=[[0.25] * (n + 1)])


def test_config_checks_the_self_distill_values(tmp_path):
    with pytest.raises(C.ConfigError, match="algo.self_distill"):
        tiny_cfg(tmp_path, **{"algo.self_distill": -1})
    with pytest.raises(C.ConfigError, match="algo.self_distill_clip"):
        tiny_cfg(tmp_path, **{"algo.self_distill_clip": 0})
    with pytest.raises(C.ConfigError, match="dpo"):
        tiny_cfg(tmp_path, **{"algo.self_distill": 0.5, "reflection.variant": "dpo"})
    with pytest.raises(C.ConfigError, match="algo.self_distill_mode"):
        tiny_cfg(tmp_path, **{"algo.self_distill_mode": "logits"})


def all_wrong(tasks):
    return lambda prompt_text, j: format_calls([ToolCall("no_such_tool", {"x": j})], "hermes")


@pytest.mark.parametrize("mode", ["topk", "sampled_token"])
def test_all_wrong_groups_train_only_with_self_distillation(tmp_path, mode):
    """Every rollout wrong: GRPO's advantages are all zero, so the step skips its update; with
    self_distill the failed rollouts are re-scored under the critic's feedback and the weights move."""
    rows, moved = {}, {}
    for sd in (0.0, 1.0):
        cfg = tiny_cfg(tmp_path / str(sd), **{"train.steps": 1, "train.save_every": 0, "reflection.variant": "grpo",
                                              "algo.self_distill": sd, "algo.self_distill_mode": mode,
                                              "algo.prefilter_k": 0})
        tr = scripted_trainer(cfg, tmp_path / str(sd) / "run", answer=all_wrong)
        try:
            before = trainable(tr.model)
            rows[sd] = tr.train_step()
            after = trainable(tr.model)
        finally:
            tr.close()
        moved[sd] = any(not torch.equal(before[n], after[n]) for n in before)
    assert rows[0.0]["update_skipped"] == 1.0 and not moved[0.0]
    assert rows[1.0]["update_skipped"] == 0.0 and moved[1.0]
    assert rows[1.0]["sd_rollouts"] == 8.0  # 2 prompts x 4 rollouts, all failed
    if mode == "topk":
        assert rows[1.0]["sd_kl"] > 0.0 and 0.0 <= rows[1.0]["sd_teacher_agree"] <= 1.0
    else:
        assert rows[1.0]["sd_adv_mean"] != 0.0


def test_first_divergence_keeps_the_tokens_up_to_the_first_the_teacher_rejects(tok):
    """distill_targets on a real (tiny) model: 'all' keeps every action token; 'first_divergence' keeps
    each rollout's tokens up to and including the first whose teacher top-1 differs from the sampled
    token, and the loss is computed on exactly those."""
    from reflrl.models import load_model
    from reflrl.train.distill import distill_targets, topk_distill_loss

    model, _ = load_model("tiny-random", dtype="float32", seed=0)
    task = Task(id="t0", query=QUERY, tools=TOOLS, gold=[GOLD])
    wrong = format_calls([ToolCall("get_stock_quote", {"symbol": "AAPL"})], "hermes")
    t = traj(task, wrong, False, tok)
    c = R.render_prompt(tok, teacher_messages(msgs(task), feedback="The symbol should be DIS."))
    full = distill_targets(model, [(t, c)], pad_id=0, temperature=1.0, k=4, span="all")
    first = distill_targets(model, [(t, c)], pad_id=0, temperature=1.0, k=4, span="first_divergence")
    n = len(t.response_ids)
    assert full.targets.ids[0].shape == (n, 4) and full.metrics["sd_token_share"] == 1.0
    sampled = torch.tensor(t.response_ids)
    rejects = (full.targets.ids[0][:, 0] != sampled).nonzero()
    want = int(rejects[0]) + 1 if len(rejects) else n
    assert first.targets.ids[0].shape[0] == want
    assert torch.equal(first.targets.logp[0], full.targets.logp[0][:want])
    loss = topk_distill_loss(model, first.targets, [0], pad_id=0, temperature=1.0)
    assert loss.requires_grad and float(loss.detach()) >= 0.0


def test_the_frozen_teacher_keeps_the_weights_rl_started_with(tmp_path):
    cfg = tiny_cfg(tmp_path, **{"train.steps": 2, "train.save_every": 0, "reflection.variant": "grpo",
                                "algo.self_distill": 1.0, "algo.prefilter_k": 0})
    assert cfg.algo.self_distill_teacher == "frozen"
    tr = scripted_trainer(cfg, tmp_path / "run", answer=all_wrong)
    try:
        start = trainable(tr.model)
        tr.train_step()
        tr.train_step()
        teacher = dict(tr._sd_teacher.named_parameters())
        assert all(torch.equal(teacher[n], start[n]) for n in start)  # the teacher did not move
        assert any(not torch.equal(p.detach(), start[n]) for n, p in tr.model.named_parameters() if n in start)
    finally:
        tr.close()
