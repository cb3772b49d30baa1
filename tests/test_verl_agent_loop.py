"""The reflrl verl agent loop on a reflected episode: verl's AgentLoopBase machinery (its Continuous
Token builder, AgentLoopOutput, and verl's own post-processing into a training batch) with a
stand-in for the LLM server (the only stand-in: vLLM cannot run on this machine)."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("verl")
pytest.importorskip("cachetools")

from omegaconf import OmegaConf  # noqa: E402
from verl.experimental.agent_loop.agent_loop import (  # noqa: E402
    AgentLoopWorker,
    DictConfigWrap,
    _agent_loop_registry,
)
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from reflrl.envs.datasets import generate_synthetic  # noqa: E402
from reflrl.envs.parsing import format_calls  # noqa: E402
from reflrl.envs.types import ToolCall  # noqa: E402
from reflrl.models import load_tokenizer  # noqa: E402
from reflrl.verl_backend.agent_loop import AGENT_NAME, ReflrlToolAgentLoop  # noqa: E402
from reflrl.verl_backend.data import rows_from_tasks  # noqa: E402
from reflrl.verl_backend.losses import UNREPAIRED_LOGPROB  # noqa: E402

PROMPT_LEN, RESP_LEN = 2048, 1024


class StandInLLMServer:
    """Answers verl's ``server_manager.generate`` with scripted texts, tokenized, with log-probs
    that depend on the call (so behaviour log-probs can be told apart)."""

    def __init__(self, tokenizer, texts):
        self.tok, self.texts, self.prompts, self.outputs = tokenizer, list(texts), [], []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
        assert sampling_params.get("logprobs") is not None
        i = len(self.prompts)
        self.prompts.append(list(prompt_ids))
        ids = self.tok.encode(self.texts[i], add_special_tokens=False) + [self.tok.eos_token_id]
        lps = [-0.1 * (i + 1) - 0.01 * j for j in range(len(ids))]
        self.outputs.append((ids, lps))
        return TokenOutput(token_ids=ids, log_probs=lps, stop_reason="completed")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-random")


@pytest.fixture(scope="module")
def task():
    return generate_synthetic(2, 0, kinds=("single",))[0]


def trainer_config(**reflrl):
    return OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"prompt_length": PROMPT_LEN, "response_length": RESP_LEN,
                                          "calculate_log_probs": True}},
        "reflrl": {"reward": "binary", "parser": "hermes", "critic": "rule", "max_attempts": 2, **reflrl},
    })


def make_loop(tokenizer, server, **reflrl):
    conf = trainer_config(**reflrl)
    return ReflrlToolAgentLoop(trainer_config=DictConfigWrap(conf), server_manager=server, tokenizer=tokenizer,
                               processor=None, dataset_cls=None, data_config=DictConfigWrap(OmegaConf.create({})),
                               hf_model_type="llama", tools=None)


def wrong_and_right(task):
    gold = task.gold[0][0]
    args = dict(gold.arguments)
    key = sorted(args)[0]
    args[key] = "definitely-wrong"
    return format_calls([ToolCall(gold.name, args)], "hermes"), format_calls(task.gold[0], "hermes")


def row(task, **episode):
    r = rows_from_tasks([task], parser="hermes", prompt_style="json", episode=episode)[0]
    r["extra_info"] = json.loads(json.dumps(r["extra_info"]))  # as read back from parquet
    return r


def test_agent_loop_is_registered_with_verl():
    assert _agent_loop_registry[AGENT_NAME] == {"_target_": "reflrl.verl_backend.agent_loop.ReflrlToolAgentLoop"}


async def test_reflected_episode_trains_tau_star_on_the_original_prompt(tokenizer, task):
    wrong, right = wrong_and_right(task)
    server = StandInLLMServer(tokenizer, [wrong, right])
    loop = make_loop(tokenizer, server)
    r = row(task)
    out = await loop.run({"temperature": 1.0, "top_p": 1.0, "logprobs": True},
                         raw_prompt=r["prompt"], extra_info=r["extra_info"])
    # two samples: tau under q (wrong), tau* under q* (right)
    assert len(server.prompts) == 2
    q_ids, qstar_ids = server.prompts
    assert "Your previous attempt had issues" in tokenizer.decode(qstar_ids)
    assert "Your previous attempt had issues" not in tokenizer.decode(q_ids)
    # prompt_ids = tokens of the ORIGINAL prompt q (not q*)
    assert out.prompt_ids == q_ids and out.prompt_ids != qstar_ids
    # response = tau* (sampled under q*), with its behaviour log-probs under q*
    ids_star, lps_star = server.outputs[1]
    assert out.response_ids == ids_star
    assert out.response_logprobs == lps_star
    assert out.response_mask == [1] * len(ids_star)
    assert out.reward_score == 1.0
    x = out.extra_fields
    assert x["reflrl_repaired"] and not x["reflrl_masked"] and x["reflrl_stop_reason"] == "positive"
    assert x["reflrl_retries"] == 1 and x["reflrl_cause"] == "policy_error" and x["reflrl_correct"]


async def test_first_positive_is_not_reflected(tokenizer, task):
    _, right = wrong_and_right(task)
    server = StandInLLMServer(tokenizer, [right])
    out = await make_loop(tokenizer, server).run({"logprobs": True}, raw_prompt=[], extra_info=row(task)["extra_info"])
    assert len(server.prompts) == 1 and out.response_ids == server.outputs[0][0]
    assert out.extra_fields["reflrl_stop_reason"] == "first_positive" and not out.extra_fields["reflrl_repaired"]
    # an ordinary row: marked for the verl loss (token-level PPO against the actor's old log-probs)
    assert out.response_logprobs == [UNREPAIRED_LOGPROB] * len(out.response_ids)
    server2 = StandInLLMServer(tokenizer, [right])
    out2 = await make_loop(tokenizer, server2, mark_unrepaired=False).run(
        {"logprobs": True}, raw_prompt=[], extra_info=row(task)["extra_info"])
    assert out2.response_logprobs == server2.outputs[0][1]


async def test_failed_reflection_trains_the_original_response(tokenizer, task):
    wrong, _ = wrong_and_right(task)
    server = StandInLLMServer(tokenizer, [wrong, wrong, wrong])
    out = await make_loop(tokenizer, server, max_attempts=2).run({"logprobs": True}, raw_prompt=[],
                                                                 extra_info=row(task)["extra_info"])
    assert len(server.prompts) == 3 and out.extra_fields["reflrl_stop_reason"] == "max_attempts"
    assert out.response_ids == server.outputs[0][0] and out.prompt_ids == server.prompts[0]
    assert out.reward_score == 0.0 and out.response_mask == [1] * len(out.response_ids)
    assert not out.extra_fields["reflrl_repaired"]


async def test_unrecovered_env_fault_is_masked_not_penalised(tokenizer, task):
    _, right = wrong_and_right(task)
    server = StandInLLMServer(tokenizer, [right, right, right])
    loop = make_loop(tokenizer, server, faults="server_error=1.0", retry_max_attempts=2, max_attempts=1)
    out = await loop.run({"logprobs": True}, raw_prompt=[], extra_info=row(task)["extra_info"])
    assert out.extra_fields["reflrl_masked"] and out.extra_fields["reflrl_cause"] == "env_fault"
    assert out.response_mask == [0] * len(out.response_ids) and len(out.response_ids) > 0


async def test_verl_postprocess_turns_the_episode_into_a_training_batch(tokenizer, task):
    """verl's own AgentLoopWorker post-processing: padded prompts/responses, rollout_log_probs (the
    behaviour log-probs under q*), rm_scores at the last response token."""
    wrong, right = wrong_and_right(task)
    server = StandInLLMServer(tokenizer, [wrong, right])
    r = row(task)
    out = await make_loop(tokenizer, server).run({"logprobs": True}, raw_prompt=r["prompt"], extra_info=r["extra_info"])
    worker = object.__new__(AgentLoopWorker)  # only the post-processing methods are used
    worker.rollout_config = OmegaConf.create({"prompt_length": PROMPT_LEN, "response_length": RESP_LEN})
    worker.tokenizer, worker.processor = tokenizer, None
    worker.reward_loop_worker_handles, worker.teacher_server_manager = None, None
    worker.distillation_enabled, worker.mm_processor_kwargs = False, {}
    worker.config = OmegaConf.create({"distillation": {"enabled": False}})
    internal = await worker._agent_loop_postprocess(out, False, raw_prompt=r["prompt"])
    batch = worker._postprocess([internal], input_non_tensor_batch=None)
    n = len(out.response_ids)
    assert tuple(batch.batch["prompts"].shape) == (1, PROMPT_LEN)
    assert batch.batch["prompts"][0, -len(out.prompt_ids):].tolist() == out.prompt_ids
    assert batch.batch["responses"][0, :n].tolist() == out.response_ids
    assert batch.batch["response_mask"][0].tolist() == [1] * n + [0] * (RESP_LEN - n)
    assert np.allclose(batch.batch["rollout_log_probs"][0, :n].numpy(), server.outputs[1][1])
    assert float(batch.batch["rm_scores"][0, n - 1]) == 1.0
    assert bool(batch.non_tensor_batch["reflrl_repaired"][0])


async def test_multi_turn_episode_masks_tool_and_user_tokens(tokenizer):
    """A multi-turn task: assistant tokens (mask 1) and, between them, the tool results and next user
    turns tokenized by verl's Continuous Token builder (mask 0)."""
    task = generate_synthetic(3, 0, kinds=("multi_turn",))[0]
    script = []
    for turn in task.gold:
        script += [format_calls(turn, "hermes"), "Done."]
    server = StandInLLMServer(tokenizer, script)
    out = await make_loop(tokenizer, server, mark_unrepaired=False).run(
        {"logprobs": True}, raw_prompt=[], extra_info=row(task)["extra_info"])
    assert len(server.prompts) == len(script)
    assert out.reward_score == 1.0 and out.extra_fields["reflrl_correct"]
    assert out.prompt_ids == server.prompts[0]
    # every generation call saw the prompt + everything so far: the response is one token stream
    full = out.prompt_ids + out.response_ids
    for p in server.prompts[1:]:
        assert full[: len(p)] == p
    # action tokens are exactly the sampled ones, with their log-probs; everything else has mask 0
    sampled = [t for ids, _ in server.outputs for t in ids]
    acts = [t for t, m in zip(out.response_ids, out.response_mask) if m == 1]
    assert acts == sampled
    assert [lp for lp, m in zip(out.response_logprobs, out.response_mask) if m == 1] == \
        [x for _, lps in server.outputs for x in lps]
    obs = tokenizer.decode([t for t, m in zip(out.response_ids, out.response_mask) if m == 0])
    assert task.turns[0] in obs and task.turns[1] in obs  # user turns are observations
    assert out.response_mask.count(0) > 0


# ---------------------------------------------------------------------------- replayable faults
async def _build_batch(tokenizer, tasks, n, **reflrl):
    """What verl does for a batch: every row repeated n times with one fresh uid per prompt, the agent
    loops started in row order. Returns per episode (masked, stop reason, env fault seen)."""
    from uuid import uuid4

    out = []
    for i, t in enumerate(tasks):
        uid = uuid4().hex
        r = rows_from_tasks([t], parser="hermes", prompt_style="json")[0]
        extra = json.loads(json.dumps(r["extra_info"]))
        extra["index"] = i
        for _ in range(n):
            _, right = wrong_and_right(t)
            server = StandInLLMServer(tokenizer, [right] * 4)
            o = await make_loop(tokenizer, server, **reflrl).run({"logprobs": True}, raw_prompt=[], extra_info=extra,
                                                                 uid=uid, index=i)
            out.append((o.extra_fields["reflrl_masked"], o.extra_fields["reflrl_cause"]))
    return out


async def test_two_builds_of_a_batch_meet_the_same_faults(tokenizer):
    """Episode seeds derive from (seed, dataset index, rollout index), as the CPU trainer derives one
    per env and episode: two builds of the same batch (fresh uids, as verl gives) meet the same fault
    decisions; a different seed meets others."""
    tasks = generate_synthetic(4, 0, kinds=("single",))[:4]
    kw = dict(faults="server_error=0.5", retry_max_attempts=1, max_attempts=0)
    a = await _build_batch(tokenizer, tasks, 3, **kw)
    b = await _build_batch(tokenizer, tasks, 3, **kw)
    assert a == b
    masked = [m for m, _ in a]
    assert any(masked) and not all(masked)  # the faults differ between episodes, not one draw for all
    c = await _build_batch(tokenizer, tasks, 3, seed=99, **kw)
    assert [m for m, _ in c] != masked


def test_episode_seeds_follow_seed_index_and_rollout():
    from reflrl.verl_backend.episode import EpisodeSettings, episode_seeds

    s = EpisodeSettings(seed=1)
    assert episode_seeds(s, 3, 2) == episode_seeds(EpisodeSettings(seed=1), 3, 2)
    seeds = {episode_seeds(s, i, k)["seed"] for i in range(3) for k in range(3)}
    assert len(seeds) == 9 and episode_seeds(s, 3, 2)["fault_seed"] is None
    assert episode_seeds(EpisodeSettings(seed=1, fault_seed=7), 3, 2)["fault_seed"] is not None


# ---------------------------------------------------------------------------- finite metrics
def test_the_unrepaired_marker_keeps_verls_debug_metrics_finite():
    """verl's debug metrics take exp of the rollout log-probs: with marked (not repaired) rows they stay
    finite, and the loss still reads the marker back exactly."""
    import torch
    from verl import DataProto
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch  # noqa: F401
    from verl.utils.debug.metrics import calculate_debug_metrics

    from reflrl.verl_backend.losses import split_behaviour

    B, T = 4, 6
    old = -torch.rand(B, T) * 3
    rollout = old + 0.05 * torch.randn(B, T)
    rollout[1:3] = UNREPAIRED_LOGPROB  # two ordinary rows
    mask = torch.ones(B, T)
    data = DataProto.from_dict({"rollout_log_probs": rollout, "old_log_probs": old, "response_mask": mask,
                                "responses": torch.zeros(B, T, dtype=torch.long)})
    m = calculate_debug_metrics(data)
    assert all(np.isfinite(float(v)) for v in m.values()), m
    w = torch.exp(torch.clamp(old - rollout, -20, 20))  # verl's token-level IS weights
    _beh, repaired = split_behaviour(old, w, mask)
    assert repaired.tolist() == [True, False, False, True]


# ---------------------------------------------------------------------------- q* within the limit
async def test_qstar_is_shortened_to_the_prompt_limit_keeping_system_prompt_and_request(tokenizer, task):
    from reflrl.recovery.reflection import Attempt, augmented_messages
    from reflrl.verl_backend.episode import fit_qstar

    loop = make_loop(tokenizer, StandInLLMServer(tokenizer, []))
    q = rows_from_tasks([task], parser="hermes", prompt_style="json")[0]["prompt"]
    long_answer = "<tool_call>" + "x" * 3000 + "</tool_call>"
    for mode in ("replace", "append"):
        qstar = augmented_messages(q, [Attempt(thought="", action=long_answer, feedback="y " * 800)], mode)

        async def count(msgs):
            return await loop._n_tokens(msgs)  # uncapped (ct_build_initial_tokens left-truncates)

        full, n_q = await count(qstar), await count(q)
        assert await fit_qstar(qstar, len(q), count, full) == qstar  # at the limit: unchanged
        limit = n_q + 200
        fitted = await fit_qstar(qstar, len(q), count, limit)
        assert await count(fitted) <= limit < full
        assert fitted[0] == q[0]  # the system prompt with the tools, whole
        assert f'Original request: "{task.query}"' in fitted[-1]["content"]  # the request, whole
        assert "[...]" in fitted[-1]["content"]
        with pytest.raises(ValueError, match="max_prompt_length"):
            await fit_qstar(qstar, len(q), count, n_q - 5)


async def test_agent_loop_samples_qstar_within_rollout_prompt_length(tokenizer, task):
    """Through the agent loop: a long failed answer makes q* longer than rollout.prompt_length; the
    retry is sampled from a q* that fits and starts with q's system prompt tokens (verl would have
    left-truncated it)."""
    wrong, right = wrong_and_right(task)
    wrong = wrong + " " + "padding " * 1500
    server = StandInLLMServer(tokenizer, [wrong, right])
    r = row(task)
    q_len = len(await make_loop(tokenizer, server).ct_build_initial_tokens(r["prompt"]))
    limit = q_len + 300
    conf = trainer_config()
    conf.actor_rollout_ref.rollout.prompt_length = limit
    loop = ReflrlToolAgentLoop(trainer_config=DictConfigWrap(conf), server_manager=server, tokenizer=tokenizer,
                               processor=None, dataset_cls=None, data_config=DictConfigWrap(OmegaConf.create({})),
                               hf_model_type="llama", tools=None)
    out = await loop.run({"logprobs": True}, raw_prompt=r["prompt"], extra_info=r["extra_info"])
    q_ids, qstar_ids = server.prompts
    assert len(qstar_ids) <= limit < len(q_ids) + len(tokenizer.encode(wrong))
    system = r["prompt"][0]["content"]
    assert r["prompt"][0]["role"] == "system" and len(system) > 200
    assert system in tokenizer.decode(qstar_ids)  # the system prompt with the tools, whole
    assert task.query in tokenizer.decode(qstar_ids)
    assert out.extra_fields["reflrl_repaired"]
