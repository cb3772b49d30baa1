"""Rollouts: batching, on-policy tokenization of actions vs observations, concurrency, env faults."""
from __future__ import annotations

import asyncio

import pytest

from reflrl import rollout as R
from reflrl.engines.transformers_engine import Sample
from reflrl.envs.parsing import format_calls
from reflrl.envs.types import Task, ToolCall


from doubles import PooledScriptedEngine, ScriptedEngine, answer_by_task, gold_text  # noqa: E402  (shared test doubles)


@pytest.fixture(scope="module")
def tok():
    from reflrl.models import load_tokenizer

    return load_tokenizer("tiny-random")


@pytest.fixture(scope="module")
def tasks():
    from reflrl.envs.datasets import synthetic_splits

    sp = synthetic_splits(n_train=6, n_val=0, n_test=0, seed=3, kinds=("single",))
    return sp["train"]


def make_envs(count, tasks, faults=None, multi=False, **kw):
    import gymnasium as gym

    import reflrl.envs  # noqa: F401
    from reflrl.envs.clock import VirtualClock

    env_id = "reflrl/ToolCallMultiTurn-v0" if multi else "reflrl/ToolCall-v0"
    return [gym.make(env_id, dataset=tasks, faults=faults, seed=k, clock=VirtualClock(), **kw).unwrapped
            for k in range(count)]


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


# ----------------------------------------------------------------------------- single turn
def test_single_turn_one_batched_generate_and_group_order(tok, tasks):
    eng = ScriptedEngine(tok, answer_by_task(tasks))
    envs = make_envs(6, tasks)
    trajs = run(R.arollout(eng, tok, envs, tasks[:2], 3, R.RolloutSpec(max_new_tokens=96), seed=5))
    assert len(trajs) == 6
    assert eng.calls == [6]  # all B x n samples from ONE engine call
    assert [t.group for t in trajs] == [0, 0, 0, 1, 1, 1]
    for t in trajs:
        assert t.task is tasks[t.group]
        assert len(t.response_ids) == len(t.loss_mask) == len(t.old_logprobs)
        assert all(m == 1 for m in t.loss_mask)  # single turn: every response token was sampled
        # the prompt is the chat template rendering of the env's messages + generation prompt
        assert tok.decode(t.prompt_ids).endswith("<|im_start|>assistant\n")
        assert t.task.query in tok.decode(t.prompt_ids)
    # sample 0 and 2 of each group answer the gold call, sample 1 a wrong one
    assert [t.correct for t in trajs] == [True, False, True, True, False, True]
    assert [t.reward for t in trajs] == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert not any(t.masked for t in trajs)


def test_env_steps_run_concurrently():
    """All envs must be in their step at the same time (a barrier that needs every one of them);
    one-at-a-time mode never has two in flight."""

    class BarrierEnv:
        def __init__(self, barrier, counter):
            self.barrier, self.counter = barrier, counter
            self.unwrapped = self

        async def areset(self, seed=None, options=None):
            return "", {"messages": [{"role": "user", "content": options["task"].query}]}

        async def astep(self, action):
            self.counter["now"] += 1
            self.counter["max"] = max(self.counter["max"], self.counter["now"])
            if self.barrier is not None:
                await self.barrier.wait()
            await asyncio.sleep(0)
            self.counter["now"] -= 1
            return "", 0.0, True, False, {"correct": False, "parse_ok": True}

    from reflrl.models import load_tokenizer

    tk = load_tokenizer("tiny-random")
    t = Task(id="t", query="hello", tools=[], gold=[[ToolCall("f", {})]])
    eng = ScriptedEngine(tk, lambda text, j: "hi")

    async def go(concurrent):
        counter = {"now": 0, "max": 0}
        barrier = asyncio.Barrier(8) if concurrent else None
        envs = [BarrierEnv(barrier, counter) for _ in range(8)]
        cfg = R.RolloutSpec(max_new_tokens=8, concurrent=concurrent)
        await asyncio.wait_for(R.arollout(eng, tk, envs, [t, t], 4, cfg), timeout=20)
        return counter["max"]

    assert run(go(True)) == 8
    assert run(go(False)) == 1


# ----------------------------------------------------------------------------- multi turn
@pytest.mark.parametrize("base", [ScriptedEngine, PooledScriptedEngine])
def test_multi_turn_observation_tokens_are_separate_and_masked(tok, tasks, base):
    """Turn 1 calls the gold tool, turn 2 answers in text: the response is
    [action 1 ids] + [observation ids] + [action 2 ids], the action ids are EXACTLY the sampled ones,
    observation tokens have loss_mask 0, and the whole sequence renders as the chat template's
    rendering of the final conversation (VerlTool sec. 3.3 'Tokenization'); batched or through
    continuous batching (each turn its own request)."""
    task = tasks[0]
    sampled: dict[int, list[list[int]]] = {}

    def answer(text, j):
        return gold_text(task) if "<|im_start|>tool" not in text else "The result is in."

    class Recording(base):
        def generate(self, prompts, n=1, **kw):
            out = super().generate(prompts, n=n, **kw)
            for s in out:
                sampled.setdefault(len(sampled), []).append(s.token_ids)
            return out

    eng = Recording(tok, answer)
    envs = make_envs(2, [task], multi=True)
    cfg = R.RolloutSpec(max_new_tokens=96, max_turns=4, max_total_tokens=2048)
    trajs = run(R.arollout(eng, tok, envs, [task], 2, cfg, seed=1))
    for tr in trajs:
        assert tr.turns == 2
        a1 = tok(gold_text(task), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        a2 = tok("The result is in.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert tr.response_ids[: len(a1)] == a1
        assert tr.response_ids[-len(a2):] == a2
        obs = tr.response_ids[len(a1): len(tr.response_ids) - len(a2)]
        assert len(obs) > 0
        assert tr.loss_mask == [1] * len(a1) + [0] * len(obs) + [1] * len(a2)
        assert tr.old_logprobs[len(a1): len(a1) + len(obs)] == [0.0] * len(obs)
        obs_text = tok.decode(obs)
        assert "<|im_start|>tool" in obs_text and obs_text.endswith("<|im_start|>assistant\n")
        # the concatenation is what the chat template renders for the final conversation
        msgs = envs[0].episode.messages if tr is trajs[0] else envs[1].episode.messages
        rendered = tok.apply_chat_template(msgs, tokenize=False)
        assert tok.decode(tr.prompt_ids + tr.response_ids) + "\n" == rendered
        assert tr.correct and tr.reward == 1.0


# ----------------------------------------------------------------------------- env faults
def test_faults_on_one_prompts_tools_mask_its_rollouts_without_penalty(tok, tasks):
    """Group 0's envs fail every tool call (server_error at 100%, retries exhausted): its rollouts
    are masked; their reward is computed on the calls only, so a correct answer keeps reward 1 —
    the fault never becomes a negative reward. Group 1 (no faults) is untouched."""
    eng = ScriptedEngine(tok, answer_by_task(tasks))
    envs = make_envs(3, tasks, faults="server_error=1.0") + make_envs(3, tasks)
    trajs = run(R.arollout(eng, tok, envs, tasks[:2], 3, R.RolloutSpec(max_new_tokens=96), seed=2))
    g0, g1 = trajs[:3], trajs[3:]
    assert all(t.masked for t in g0)
    assert all(t.reward >= 0 for t in g0)
    assert [t.reward for t in g0] == [1.0, 0.0, 1.0]  # same as without faults
    assert all(len(t.fault_events) > 0 for t in g0)
    assert not any(t.masked for t in g1)
    assert [t.reward for t in g1] == [1.0, 0.0, 1.0]
    stats = R.rollout_stats(trajs)
    assert stats["masked_frac"] == 0.5
    assert stats["reward_mean"] == pytest.approx(2 / 3)  # over the live rollouts only


def test_retried_faults_are_recovered_not_masked(tok, tasks):
    """rate_limit faults at 50% are retried by the client: rollouts finish unmasked and the
    recovered faults are recorded."""
    eng = ScriptedEngine(tok, lambda text, j: gold_text(next(t for t in tasks if t.query in text)))
    envs = make_envs(8, tasks, faults="rate_limit=0.5", retry={"max_attempts": 12, "budget_s": 1e6})
    trajs = run(R.arollout(eng, tok, envs, tasks[:2], 4, R.RolloutSpec(max_new_tokens=96), seed=9))
    assert not any(t.masked for t in trajs)
    assert all(t.reward == 1.0 for t in trajs)
    assert sum(len(t.fault_events) for t in trajs) > 0


# ------------------------------------------------------------------- faults the policy sees
def test_policy_visible_fault_continues_the_single_turn_episode(tok, tasks):
    """env.fault_exposure='policy': after a fault the episode goes on; the policy's next answer (the
    same call again) is sampled after the tool's error, which is an observation (loss mask 0)."""
    eng = ScriptedEngine(tok, lambda text, j: gold_text(next(t for t in tasks if t.query in text)))
    envs = make_envs(12, tasks, faults="server_error=0.5", fault_exposure="policy")
    trajs = run(R.arollout(eng, tok, envs, tasks[:6], 2, R.RolloutSpec(max_new_tokens=96), seed=1))
    again = [t for t in trajs if t.turns > 1]
    assert again, "some first answers must meet a fault at 50%"
    for t in again:
        assert '"kind": "server_error"' in tok.decode(t.response_ids) and 0 in t.loss_mask
        assert t.steps[0].env_fault_treatment == "to-policy" and not t.masked
        assert len(t.steps) == t.turns and t.seed is not None
    # calling again until the call is answered gets every episode right
    assert all(t.correct and t.reward == 1.0 for t in trajs if not t.masked)
    assert len(eng.calls) > 1


# ----------------------------------------------------------------------- continuous batching
def _same(a: list[R.Trajectory], b: list[R.Trajectory]) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x.group, x.response_ids, x.loss_mask, x.old_logprobs, x.turns) == \
            (y.group, y.response_ids, y.loss_mask, y.old_logprobs, y.turns)
        assert (x.reward, x.correct, x.masked, x.truncated, len(x.steps)) == \
            (y.reward, y.correct, y.masked, y.truncated, len(y.steps))


def test_pooled_rollouts_are_the_batch_paths_episodes(tok, tasks):
    """A continuous-batching engine gets one request per task (its n first answers) and one per later
    turn, submitted as each episode becomes ready; the episodes are the batch path's (same answers)."""
    spec = R.RolloutSpec(max_new_tokens=96, answer_cap=1.5)
    batch = run(R.arollout(ScriptedEngine(tok, answer_by_task(tasks)), tok, make_envs(6, tasks), tasks[:2], 3,
                           spec, seed=5))
    eng = PooledScriptedEngine(tok, answer_by_task(tasks))
    pooled = run(R.arollout(eng, tok, make_envs(6, tasks), tasks[:2], 3, spec, seed=5))
    _same(batch, pooled)
    assert eng.requests == [3, 3]
    assert [t.correct for t in pooled] == [True, False, True, True, False, True]


def test_pooled_turns_after_a_fault_are_the_batch_paths(tok, tasks):
    def again(text, j):
        return gold_text(next(t for t in tasks if t.query in text))

    spec = R.RolloutSpec(max_new_tokens=96)
    mk = lambda: make_envs(12, tasks, faults="server_error=0.5", fault_exposure="policy")  # noqa: E731
    batch = run(R.arollout(ScriptedEngine(tok, again), tok, mk(), tasks[:6], 2, spec, seed=1))
    eng = PooledScriptedEngine(tok, again)
    timings: dict[str, float] = {}
    pooled = run(R.arollout(eng, tok, mk(), tasks[:6], 2, spec, seed=1, timings=timings))
    _same(batch, pooled)
    later = sum(t.turns - 1 for t in pooled)
    assert later > 0 and eng.requests == [2] * 6 + [1] * later  # each turn after a fault: its own request
    assert timings["generate_s"] > 0 and timings["env_s"] > 0


def test_pooled_rollout_logprobs_match_the_trainer(tok, tasks):
    """The tiny model through the engine's shared decode loop: the rollouts' log-probs are the trainer's."""
    import torch

    from reflrl.engines.transformers_engine import TransformersEngine
    from reflrl.logprobs import sequence_logprobs
    from reflrl.models import load_model

    model, mtok = load_model("tiny-random", dtype="float32", seed=0)
    eng = TransformersEngine(model, mtok, max_batch_size=4, continuous=True)
    spec = R.RolloutSpec(max_new_tokens=12, temperature=0.7)
    trajs = run(R.arollout(eng, mtok, make_envs(6, tasks), tasks[:2], 3, spec, seed=3))
    assert eng.pool().stats.samples == 6 and max(eng.pool().stats.decode_rows) == 4
    seqs = [t.prompt_ids + t.response_ids for t in trajs]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    am, rm = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (t, q) in enumerate(zip(trajs, seqs)):
        ids[i, : len(q)] = torch.tensor(q)
        am[i, : len(q)] = 1
        rm[i, len(t.prompt_ids): len(q)] = torch.tensor(t.loss_mask)
    with torch.no_grad():
        lp = sequence_logprobs(model, ids, am, rm, temperature=0.7)
    for i, t in enumerate(trajs):
        p = len(t.prompt_ids)
        assert torch.allclose(lp[i, p: p + len(t.response_ids)], torch.tensor(t.old_logprobs), atol=1e-4)
