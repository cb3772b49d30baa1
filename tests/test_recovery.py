"""Tool-ReRL in the trainer: triage, batched reflection, repaired rollouts in their groups, eq. 2 on q,
variants, accounting (reflrl.recovery; Tool-ReRL sec. 3.2-3.3, A.3, appendix C)."""
from __future__ import annotations

import json

import asyncio
import copy
import math
from pathlib import Path

import pytest
import torch

from reflrl import config as C
from reflrl import recovery as RC
from reflrl import rollout as R
from reflrl import train as T
from reflrl.cli import main as cli_main
from reflrl.train.batch import batch_logprobs, make_batch
from reflrl.train.step import policy_update
from reflrl.critic import Critique, CritiqueRequest, RuleCritic
from reflrl.envs.parsing import format_calls
from reflrl.envs.types import ToolCall
from reflrl.recovery.reflection import RETRY_HEADER, Generation

from doubles import ScriptedEngine, gold_text, scripted

ROOT = Path(__file__).resolve().parent.parent


def tiny_cfg(tmp_path: Path, variant: str = "tool_rerl", **over) -> C.Config:
    sets = [f"train.out_dir={tmp_path}", "train.run_name=run", "data.n_train=6", "data.n_test=4",
            "data.n_val=0", "warmup.enabled=false", "rollout.max_new_tokens=200", "algo.downsample_m=0",
            f"reflection.variant={variant}", "train.save_every=0"]
    sets += [f"{k}={v}" for k, v in over.items()]
    return C.load_config(ROOT / "configs" / "tiny.yaml", sets)


def repairing_answer(tasks):
    """Gold for even samples, a wrong call for odd ones; under q* (the retry prompt) always gold."""
    def answer(prompt_text: str, j: int) -> str:
        task = next(t for t in tasks if t.query in prompt_text)
        if RETRY_HEADER in prompt_text or j % 2 == 0:
            return gold_text(task)
        return format_calls([ToolCall(task.gold[0][0].name, {"nonsense": j})], "hermes")
    return answer


def gold_on_retry(tasks):
    """Every rollout wrong (a nonsense argument), every retry under q* the gold answer."""
    def answer(text, j):
        task = next(t for t in tasks if t.query in text)
        if RETRY_HEADER in text:
            return gold_text(task)
        return format_calls([ToolCall(task.gold[0][0].name, {"nonsense": j})], "hermes")
    return answer


def make_trainer(cfg, run_dir, answer=None):
    """A Trainer whose engine answers by script (default: gold under q*, wrong for odd samples under q)."""
    return T.Trainer(cfg, run_dir, progress=False, quiet=True, engine=scripted(cfg, answer or repairing_answer))


# ----------------------------------------------------------------------------- variants and config
def test_variants_in_sync_and_configs_load():
    assert RC.VARIANTS.names() == C.registered("variant") and "tool_rerl" in RC.VARIANTS
    for name in ("grpo", "cot", "ref", "cot_is", "tool_rerl", "external", "external_is", "dpo", "ppo"):
        cfg = C.load_config(ROOT / "configs" / f"{name}.yaml")
        assert cfg.reflection.variant == name
        base = C.load_config(ROOT / "configs" / "default.yaml")
        assert cfg.model.name == base.model.name and cfg.train.time_budget_min == base.train.time_budget_min  # base: default.yaml
    assert RC.think_of(C.load_config(None, ["reflection.variant=cot_is"]))
    assert not RC.think_of(C.load_config(None, ["reflection.variant=tool_rerl"]))
    assert RC.think_of(C.load_config(None, ["reflection.variant=tool_rerl", "reflection.think=true"]))
    assert C.check_trainer(C.load_config(ROOT / "configs" / "ppo.yaml")).algo.advantage == "gae"  # the native trainer runs PPO
    with pytest.raises(C.ConfigError, match="critic_base_url"):
        C.load_config(None, ["reflection.variant=external"])
    with pytest.raises(C.ConfigError, match="max_turns"):
        C.load_config(None, ["reflection.variant=tool_rerl", "rollout.max_turns=3"])
    with pytest.raises(C.ConfigError, match="reflection.variant"):
        C.load_config(None, ["reflection.variant=toolrerl"])


def test_self_thought_critic_uses_the_models_own_thought():
    from reflrl.envs.parsing import parse

    gold = [ToolCall("f", {"a": 1})]
    wrong = "<think>I guess a is 2</think>\n" + format_calls([ToolCall("f", {"a": 2})], "hermes")
    c = RC.SelfThoughtCritic(RuleCritic()).critique(
        CritiqueRequest(query="q", response=wrong, parse=parse(wrong, "hermes"), gold=gold))
    assert c.score == "negative" and c.reflection == "Your own reasoning was: I guess a is 2"
    right = format_calls(gold, "hermes")
    assert RC.SelfThoughtCritic(RuleCritic()).critique(
        CritiqueRequest(query="q", response=right, parse=parse(right, "hermes"), gold=gold)).positive


def test_round_batcher_serves_one_call_per_round():
    calls = []

    def sample(batch):
        calls.append(len(batch))
        return [Generation(f"g{len(calls)}") for _ in batch]

    b = RC.RoundBatcher(3, sample)

    async def client(rounds):
        try:
            out = []
            for _ in range(rounds):
                await asyncio.sleep(0.001 * rounds)  # critic / env work in between
                out.append((await b.generate([{"role": "user", "content": "x"}])).text)
            return out
        finally:
            b.done()

    async def main():
        return await asyncio.gather(client(1), client(3), client(2))

    res = asyncio.run(main())
    assert calls == [3, 2, 1] and b.calls == 3
    assert res == [["g1"], ["g1", "g2", "g3"], ["g1", "g2"]]


def test_round_batcher_orders_a_round_by_key_not_by_arrival():
    """Repairs that wait on tools reach the batcher in an order the machine's timing decides; the batch
    goes to the sampler in key order (the rollout repaired), so the same seed batches the same way."""
    seen = []

    def sample(batch):
        seen.append(list(batch))
        return [Generation(str(r)) for r in batch]

    async def run(delays):
        b = RC.RoundBatcher(len(delays), sample)

        async def client(key, delay):
            try:
                await asyncio.sleep(delay)  # a tool call of its own duration
                return (await b.generate(f"q{key}", key=key)).text
            finally:
                b.done()

        return await asyncio.gather(*(client(k, d) for k, d in enumerate(delays)))

    first = asyncio.run(run([0.03, 0.0, 0.02, 0.01]))  # arrival order 1, 3, 2, 0
    second = asyncio.run(run([0.0, 0.03, 0.01, 0.02]))  # arrival order 0, 2, 3, 1
    assert seen == [["q0", "q1", "q2", "q3"]] * 2
    assert first == second == ["q0", "q1", "q2", "q3"]  # each repair still gets its own answer


# ----------------------------------------------------------------------------- eq. 2 in the update
def _ids(tok, messages):
    return list(R.render_prompt(tok, messages))


def _hand_logprob(model, prompt, response):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    return sum(float(logits[len(prompt) + j - 1][t] - torch.logsumexp(logits[len(prompt) + j - 1], -1))
               for j, t in enumerate(response))


def _repaired_batch(tok, model, q_msgs, qstar_msgs, response, adv=1.0, other=None):
    """A batch with one repaired row (tau* trained on q, behaviour log-probs under q* recorded as
    sampling-time log-probs) and optionally an ordinary row."""
    q, q_star = _ids(tok, q_msgs), _ids(tok, qstar_msgs)
    resp = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([q_star + resp])).logits[0].float()
    lps = torch.log_softmax(logits, -1)
    beh = [float(lps[len(q_star) + j - 1, t]) for j, t in enumerate(resp)]
    t = R.Trajectory(task=None, group=0, prompt_ids=q)
    t.append_action(resp, beh)
    t.repair = type("Rec", (), {"repaired": True})()
    trajs, advs = [t], [adv]
    if other is not None:
        o = R.Trajectory(task=None, group=0, prompt_ids=q)
        ids = tok(other, add_special_tokens=False)["input_ids"]
        o.append_action(ids, [-1.0] * len(ids))
        trajs.append(o)
        advs.append(-adv)
    return make_batch(trajs, advs, 0), q, q_star, resp


MSGS = [{"role": "system", "content": "You can call get_weather(city: str)."},
        {"role": "user", "content": "What's the weather in Paris?"}]
TAU = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tiny():
    from reflrl.models import load_model

    model, tok = load_model("tiny-random", dtype="float32", trainable="all", seed=0)
    return model, tok


def test_trainer_update_weight_is_pi_q_over_pi_qstar_by_hand(tiny):
    model, tok = tiny
    from reflrl.recovery.reflection import Attempt, augmented_messages

    q_star_msgs = augmented_messages(MSGS, [Attempt("", "get_weather()", "The call is missing the argument 'city'.")])
    batch, q, q_star, resp = _repaired_batch(tok, model, MSGS, q_star_msgs, TAU, other="no call")
    assert batch.repaired.tolist() == [True, False]
    assert batch.prompts[int(batch.owner[0])] == q  # tau* is trained on the ORIGINAL prompt's tokens
    expected = math.exp(_hand_logprob(model, q, resp) - _hand_logprob(model, q_star, resp))
    assert abs(math.log(expected)) > 1e-3
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.0)
    cfg = C.AlgoConfig(micro_batch_size=1)  # one row per micro-batch: the weight stats are pooled exactly
    out = policy_update(m, opt, batch, cfg, importance={"level": "sequence", "log_cap": 50.0})
    assert out["rerl/count"] == 1.0
    assert out["rerl/weight_mean"] == pytest.approx(expected, rel=1e-3)
    assert out["rerl/weight_std"] == 0.0 and math.isfinite(out["loss"])


def test_identical_prompts_weight_one_and_plain_loss_and_ref_has_no_weight(tiny):
    model, tok = tiny
    batch, *_ = _repaired_batch(tok, model, MSGS, MSGS, TAU, adv=1.3, other="no call")
    res = {}
    for name, imp in (("is", {"level": "sequence", "log_cap": 5.0}), ("plain", None)):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
        out = policy_update(m, opt, batch, C.AlgoConfig(micro_batch_size=8, clip_high=0.2), importance=imp)
        res[name] = (out, [p.detach().clone() for p in m.parameters()])
    out_is, p_is = res["is"]
    out_plain, p_plain = res["plain"]
    assert out_is["rerl/weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert out_is["loss"] == pytest.approx(out_plain["loss"], rel=1e-5)  # behaviour from a full forward: float noise
    assert out_is["grad_norm"] == pytest.approx(out_plain["grad_norm"], rel=1e-4)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(p_is, p_plain))
    assert "rerl/count" not in out_plain  # `ref`: the repaired row is trained with no weight


def test_weight_clipping_bounds_the_update(tiny):
    """A repair whose behaviour log-probs are absurd (ratio e^+-hundreds) gives a finite update whose
    repaired-row gradient is bounded by the cap (test_importance checks the bound exactly)."""
    model, tok = tiny
    batch, *_ = _repaired_batch(tok, model, MSGS, MSGS, TAU, adv=1.0)
    for shift in (-300.0, 300.0):
        b = copy.deepcopy(batch)
        b.engine_logprobs = b.engine_logprobs + shift * b.response_mask.float()
        m = copy.deepcopy(model)
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.0)
        out = policy_update(m, opt, b, C.AlgoConfig(grad_clip=0.0), importance={"level": "sequence", "log_cap": 5.0})
        assert math.isfinite(out["loss"]) and math.isfinite(out["grad_norm"])
        assert out["rerl/capped_frac"] == 1.0
        assert out["grad_norm"] == 0.0  # beyond the cap (or outside the clip on eq. 2's side): no gradient


# ----------------------------------------------------------------------------- the train step
def test_tool_rerl_step_repairs_batches_trains_and_accounts(tmp_path):
    cfg = tiny_cfg(tmp_path, "tool_rerl")
    tr = make_trainer(cfg, tmp_path / "run")
    try:
        tr.engine.calls.clear()
        m = tr.train_step()
        tr.step += 1
        n_fail = int(m["reflect/failed"])
        assert n_fail == 4  # 2 prompts x 4 rollouts, the odd samples are wrong
        # one rollout call, then ONE batched call for all failures (they are all repaired in round 1)
        assert tr.engine.calls == [8, n_fail]
        assert m["reflect/recovered_by_reflection"] == n_fail and m["reflect/generate_calls"] == 1
        assert m["reflect/failed_policy_error"] == n_fail and m["reflect/discarded"] == 0
        assert m["critic/calls"] == 2 * n_fail  # each failure and each retry is critiqued
        assert m["correct_rate"] == 0.5  # the policy's own samples, not the repairs
        # every failure was replaced by its repair in its group: all rewards equal, zero advantage
        assert m["zero_var_ratio"] == 1.0 and m["signal_trajectories"] == 0 and m["repaired_trained"] == 0
        summary = tr.summary()
        rec = summary["recovery"]
        assert rec["variant"] == "tool_rerl" and rec["failed"] == n_fail and rec["recovered_ratio"] == 1.0
        assert rec["rollout_tool_calls"] > 0 and rec["reflection_tool_calls"] > 0
        assert rec["critic_calls"] == 2 * n_fail and rec["critic_latency_mean_s"] is not None
        text = T.format_summary({**summary, "eval_after": {}, "accuracy_before": None, "accuracy_after": None})
        assert "recovered by reflection" in text and "calls per signal" in text
    finally:
        tr.close()


def test_pooled_engine_serves_each_retry_as_its_own_request(tmp_path):
    """On a continuous-batching engine every retry under q* is submitted as soon as its critique is ready
    (no round barrier): one request per retry, the same repairs as the batched rounds."""
    from doubles import PooledScriptedEngine
    from reflrl.train.data import splits_from_config

    cfg = tiny_cfg(tmp_path, "tool_rerl")
    sp = splits_from_config(cfg.data)
    tasks = sp["train"] + sp["val"] + sp["test"]
    tr = T.Trainer(cfg, tmp_path / "run", progress=False, quiet=True,
                   engine=lambda model, tok: PooledScriptedEngine(tok, repairing_answer(tasks)))
    try:
        m = tr.train_step()
        n_fail = int(m["reflect/failed"])
        assert n_fail == 4 and tr.engine.requests == [4, 4] + [1] * n_fail
        assert m["reflect/recovered_by_reflection"] == n_fail and m["reflect/generate_calls"] == n_fail
        assert m["critic/calls"] == 2 * n_fail and m["zero_var_ratio"] == 1.0
    finally:
        tr.close()


def test_tool_rerl_step_trains_the_repairs_on_q_with_eq2s_weight(tmp_path, monkeypatch):
    """The headline step: failures repaired under q* join their groups (``group=add``, the default
    recipe's), the update really runs, the repaired rows are trained on the ORIGINAL prompt q, and each
    carries eq. 2's weight pi(tau*|q) / pi_rfl(tau*|q*) computed from the behaviour log-probs recorded
    under q* -- checked against an independent computation on the batch the update received."""
    import reflrl.train.step as L

    cfg = tiny_cfg(tmp_path, "tool_rerl", **{"reflection.group": "add", "algo.lr": 1e-3})
    tr = make_trainer(cfg, tmp_path / "run")
    seen: dict = {}
    real = L.policy_update

    def spy(model, opt, batch, a, **kw):
        with torch.no_grad():
            seen["lp"] = batch_logprobs(model, batch, kw["temperature"])
        seen["batch"], seen["kw"] = batch, kw
        seen["out"] = real(model, opt, batch, a, **kw)
        return seen["out"]

    monkeypatch.setattr(L, "policy_update", spy)
    try:
        before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
        m = tr.train_step()
        after = {n: p.detach() for n, p in tr.model.named_parameters() if p.requires_grad}
    finally:
        tr.close()
    batch, out = seen["batch"], seen["out"]
    rep = batch.repaired
    assert m["update_skipped"] == 0.0 and seen["kw"]["importance"] == {"level": "sequence", "log_cap": 5.0}
    assert int(rep.sum()) == m["repaired_trained"] == 4 and m["signal_trajectories"] == len(batch)
    # trained on q: the prompt of every repaired row is its task's original prompt, no retry prompt in it
    for i in rep.nonzero().flatten().tolist():
        prompt = tr.tokenizer.decode(batch.prompts[int(batch.owner[i])])
        assert RETRY_HEADER not in prompt and "<|im_start|>assistant" in prompt
    # eq. 2: one weight per repaired trajectory, exp(sum_t log pi(y_t|q) - log pi_rfl(y_t|q*)); the loss uses
    # it clamped to [e^-5, e^5] (the metrics report it before the clamp, and how many rows the clamp hit)
    mask = batch.response_mask.bool() & batch.resp_attn.bool()
    log_w = torch.where(mask, seen["lp"] - batch.engine_logprobs, torch.zeros_like(seen["lp"])).sum(-1)[rep]
    assert out["rerl/count"] == 4
    assert out["rerl/log_weight_mean"] == pytest.approx(float(log_w.mean()), rel=1e-4)
    assert out["rerl/capped_frac"] == pytest.approx(float((log_w.abs() > 5.0).float().mean()))
    assert any(not torch.equal(before[n], after[n]) for n in before)  # a real update happened


def test_repaired_rollouts_in_groups_carry_the_record(tmp_path):
    cfg = tiny_cfg(tmp_path, "tool_rerl", **{"rollout.n": 4})
    tr = make_trainer(cfg, tmp_path / "run")
    try:
        trajs = tr.rollout([0, 1], 0, {})
        before = [t.prompt_ids for t in trajs]
        res = tr.recover(trajs, 0)
        rep = [t for t in trajs if t.repaired]
        assert len(rep) == 4 and res.counts["recovered_by_reflection"] == 4
        for t in rep:
            r = t.repair
            assert t.prompt_ids == t.original.prompt_ids == before[trajs.index(t)]  # q's tokens
            assert r.prompt_messages[-1]["content"] == t.task.query  # q
            assert r.augmented_messages[-1]["content"].startswith(RETRY_HEADER)  # q* (appendix C)
            assert r.attempts and r.attempts[0].action == t.original.texts[0]
            assert t.old_logprobs == r.behaviour_logprobs and len(r.behaviour_logprobs) == len(r.response_ids)
            assert t.correct and not t.masked and t.group == t.original.group
            assert not t.original.correct
    finally:
        tr.close()


def test_repaired_trajectory_trains_on_q_and_only_q_star_holds_the_ground_truth(tmp_path):
    """Tool-ReRL sec. 3.2: the critic (which sees the gold calls, appendix C) and q* carry the ground
    truth; the prompt a repaired trajectory trains on is the task's q, with neither the critique nor
    the expected call in it. With reveal='call' the analysis states the whole expected call, so q*
    must hold it -- which makes its absence from q a real check."""
    from reflrl.critic.rule import _call_text  # the form in which the 'call' level states the expected answer

    cfg = tiny_cfg(tmp_path, "tool_rerl", **{"rollout.n": 4, "reflection.reveal": "call"})
    tr = make_trainer(cfg, tmp_path / "run")
    try:
        trajs = tr.rollout([0, 1], 0, {})
        tr.recover(trajs, 0)
        rep = [t for t in trajs if t.repaired]
        assert rep
        for t in rep:
            expected = "; ".join(_call_text(g) for g in t.task.gold[0])
            q = tr.tokenizer.decode(t.prompt_ids)
            q_star = tr.tokenizer.decode(R.render_prompt(tr.tokenizer, t.repair.augmented_messages))
            assert expected in q_star and RETRY_HEADER in q_star  # the critique gave the answer away in q*
            assert t.task.query in q  # q is the task's own prompt ...
            assert expected not in q and RETRY_HEADER not in q  # ... without the critique or its answer
            assert gold_text(t.task) not in q and t.original.texts[0] not in q
            assert t.prompt_ids == R.render_prompt(tr.tokenizer, t.repair.prompt_messages)
    finally:
        tr.close()


def test_mixed_group_gets_a_learning_signal_from_repairs(tmp_path):
    """A group whose rollouts all fail has zero variance without reflection; its repairs give it one."""
    cfg = tiny_cfg(tmp_path, "tool_rerl", **{"reflection.max_per_step": 2})
    tr = make_trainer(cfg, tmp_path / "run", gold_on_retry)
    try:
        m = tr.train_step()
        assert m["reflect/failed"] == 8 and m["reflect/reflected"] == 2 and m["reflect/recovered_by_reflection"] == 2
        assert m["reflect/unrecovered"] == 6 and m["signal_trajectories"] > 0 and m["update_skipped"] == 0.0
        assert m["tool_calls_per_signal"] == pytest.approx(m["tool_calls"] / m["signal_trajectories"])
        assert m["rerl/count"] >= 1
    finally:
        tr.close()


def test_logged_rollouts_show_each_rollout_once_with_its_advantage_and_a_repair_its_q_star(tmp_path):
    """train.log_rollouts: one line per rollout of the step (8 own + 2 added repairs), the advantage the
    update used (null for none), and for a repair the retry prompt it was sampled under and its failure."""
    cfg = tiny_cfg(tmp_path, "tool_rerl", **{"reflection.max_per_step": 2, "reflection.group": "add",
                                              "train.log_rollouts": True})
    tr = make_trainer(cfg, tmp_path / "run", gold_on_retry)
    try:
        tr.train_step()
        tr.log.close()
        recs = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    finally:
        tr.close()
    assert len(recs) == 10 and {r["step"] for r in recs} == {1}
    reps = [r for r in recs if r["repaired"]]
    assert len(reps) == 2 and all(r["added"] and r["correct"] and r["reward"] == 1.0 for r in reps)
    for r in reps:
        assert RETRY_HEADER in r["q_star"] and "nonsense" in r["failed"] and r["advantage"] > 0
    fails = [r for r in recs if not r["repaired"]]
    assert all(not r["correct"] and "nonsense" in r["text"] for r in fails)
    # a group with a repair has a signal: its failures are pushed down; a group without one has none
    with_rep = {r["group"] for r in reps}
    assert all(r["advantage"] < 0 for r in fails if r["group"] in with_rep)
    assert all(r["advantage"] is None for r in fails if r["group"] not in with_rep)


def test_ref_variant_trains_repairs_without_weight(tmp_path):
    cfg = tiny_cfg(tmp_path, "ref", **{"reflection.max_per_step": 1})
    tr = make_trainer(cfg, tmp_path / "run")
    try:
        m = tr.train_step()
        assert m["reflect/recovered_by_reflection"] == 1 and m["repaired_trained"] == 1
        assert "rerl/count" not in m and m["update_skipped"] == 0.0
    finally:
        tr.close()


class Garbage:
    name = "garbage"

    def __init__(self):
        self.n = 0

    async def acritique(self, request: CritiqueRequest) -> Critique:
        self.n += 1
        if self.n % 2:
            raise RuntimeError("critic endpoint exploded")
        return Critique("negative", "", raw="vania executeppm", parsed=False)

    def critique(self, request):  # pragma: no cover
        raise NotImplementedError


def test_garbage_critic_does_not_crash_a_train_step(tmp_path):
    cfg = tiny_cfg(tmp_path, "tool_rerl")
    tr = make_trainer(cfg, tmp_path / "run")
    tr.critic = Garbage()
    try:
        m = tr.train_step()
        assert m["reflect/failed"] == 4 and m["reflect/recovered_by_reflection"] == 0
        assert m["reflect/reflection_errors"] == 2 and m["critic/unparseable"] == 2
        assert m["reflect/unrecovered"] == 4 and m["update_skipped"] == 0.0  # GRPO on the failures as usual
    finally:
        tr.close()


def test_env_faults_are_triaged_and_reflected_with_the_fault(tmp_path):
    cfg = tiny_cfg(tmp_path, "tool_rerl", **{"env.faults": "rate_limit=0.6", "env.retry.max_attempts": 1,
                                         "env.fault_exposure": "client"})
    def all_gold(tasks):
        return lambda text, j: gold_text(next(t for t in tasks if t.query in text))
    tr = make_trainer(cfg, tmp_path / "run", all_gold)
    try:
        trajs = tr.rollout([0, 1], 0, {})
        masked = [k for k, t in enumerate(trajs) if t.masked]
        assert masked, "the fault plan should mask some rollouts"
        res = tr.recover(trajs, 0)
        assert res.counts["failed_env_fault"] == len(masked) and res.counts["failed_policy_error"] == 0
        recs = [r for r in res.records if r.cause == "env_fault"]
        assert recs and all("rate limit" in r.critiques[0].analysis for r in recs)
        assert res.counts["recovered_env_fault"] + res.counts["discarded"] == len(masked)
    finally:
        tr.close()


def test_dpo_variant_trains_on_failure_repair_pairs(tmp_path):
    cfg = tiny_cfg(tmp_path, "dpo")
    tr = make_trainer(cfg, tmp_path / "run")
    try:
        before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
        m = tr.train_step()
        assert m["dpo/pairs"] == 4 and m["signal_trajectories"] == 8 and m["update_skipped"] == 0.0
        assert m["dpo/loss"] == pytest.approx(math.log(2), abs=1e-4)  # reference == policy at the first step
        assert any(not torch.equal(before[n], p) for n, p in tr.model.named_parameters() if p.requires_grad)
    finally:
        tr.close()


def test_group_add_keeps_the_failures_negative_signal(tmp_path):
    """reflection.group=add: every failure is repaired, yet the groups keep their variance (the
    failures stay, the repairs join them); with 'replace' the same step has no signal at all."""
    cfg = tiny_cfg(tmp_path, "tool_rerl", **{"reflection.group": "add"})
    tr = make_trainer(cfg, tmp_path / "run")
    try:
        m = tr.train_step()
        assert m["reflect/recovered_by_reflection"] == 4 and m["correct_rate"] == 0.5
        assert m["zero_var_ratio"] == 0.0 and m["signal_trajectories"] == 12  # 2 groups of 4 + 2 repairs
        assert m["repaired_trained"] == 4 and m["rerl/count"] == 4 and m["update_skipped"] == 0.0
        trajs = tr.rollout([0], 5, {})
        tr.recover(trajs, 5)
        assert len(trajs) == 6 and [t.group for t in trajs] == [0] * 6
        assert len(RC.own_rollouts(trajs)) == 4 and sum(t.repaired for t in trajs) == 2
    finally:
        tr.close()
