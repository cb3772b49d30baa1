"""Engines by name; the OpenAI engine against a real OpenAI-compatible server on loopback
(reflrl.chat_server with the tiny-random model: real uvicorn server, real openai client)."""
from __future__ import annotations

import pytest
import torch

from reflrl.engines.transformers_engine import RolloutEngine, TransformersEngine
from reflrl.engines import ENGINES, get_engine
from reflrl.engines.openai_engine import OpenAIEngine, TokenAlignmentError, samples_from_completion
from reflrl.logprobs import sequence_logprobs
from reflrl.chat_server import ServerThread, create_app, load_chat_model

MSGS = [[{"role": "system", "content": "You call tools."}, {"role": "user", "content": "Weather in Paris?"}],
        [{"role": "user", "content": "List the files in logs."}]]


@pytest.fixture(scope="module")
def served():
    chat = load_chat_model("tiny-random", dtype="float32", seed=0)
    with ServerThread(create_app(chat)) as srv:
        yield chat, srv


@pytest.fixture(scope="module")
def engine(served):
    chat, srv = served
    return get_engine("openai", base_url=srv.url + "/v1", model=chat.name, tokenizer=chat.tokenizer)


def test_registry_builds_engines_by_name(served):
    chat, _ = served
    assert ENGINES.names() == ["openai", "transformers", "vllm"]
    eng = get_engine("transformers", model=chat.model, tokenizer=chat.tokenizer)
    assert isinstance(eng, TransformersEngine) and isinstance(eng, RolloutEngine)
    with pytest.raises(KeyError, match="did you mean 'openai'"):
        get_engine("opneai")


def test_vllm_engine_without_vllm_is_a_clear_error():
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401
        pytest.skip("vllm is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match=r"pip install -e '\.\[gpu\]'"):
        get_engine("vllm", model_path="Qwen/Qwen2.5-0.5B-Instruct")


def test_chat_samples_carry_token_ids_and_the_models_logprobs(engine, served):
    chat, _ = served
    out = engine.generate_chat(MSGS, n=2, max_new_tokens=12, temperature=1.0, seed=3)
    assert isinstance(engine, RolloutEngine)
    assert [s.prompt_index for s in out] == [0, 0, 1, 1]  # prompt-major
    assert engine.last_stats.extra["retokenized"] == 4  # reflrl.chat_server returns token strings, not ids
    for s, usage in zip(out[::2], engine.last_usage):
        # the local chat-template rendering equals the server's prompt (same tokenizer and template)
        assert len(s.prompt_ids) == usage["prompt_tokens"]
    for s in out:
        assert len(s.token_ids) == len(s.logprobs) > 0
        assert s.finish_reason in ("stop", "length")
        if s.finish_reason == "length":
            assert len(s.token_ids) == 12
        # the ids are the sampled ones: the model's log-probs of exactly these ids equal the server's
        ids = torch.tensor([s.prompt_ids + s.token_ids])
        resp = torch.zeros_like(ids)
        resp[0, len(s.prompt_ids):] = 1
        lp = sequence_logprobs(chat.model, ids, torch.ones_like(ids), resp, temperature=1.0)
        assert torch.allclose(lp[0, len(s.prompt_ids):], torch.tensor(s.logprobs), atol=1e-4)


def test_chat_is_deterministic_given_the_seed(engine):
    a = engine.generate_chat(MSGS[:1], n=2, max_new_tokens=8, seed=11)
    b = engine.generate_chat(MSGS[:1], n=2, max_new_tokens=8, seed=11)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert [s.logprobs for s in a] == [s.logprobs for s in b]


def test_token_id_prompts_need_a_completions_endpoint(engine, served):
    chat, _ = served
    ids = chat.prompt_ids(MSGS[0])
    with pytest.raises(RuntimeError, match=r"no /v1/completions.*generate_chat"):
        engine.generate([ids], n=1, max_new_tokens=4)


def test_server_errors_are_reported(served):
    chat, srv = served
    eng = OpenAIEngine(base_url=srv.url + "/v1", model="not-served", tokenizer=chat.tokenizer, max_retries=0)
    with pytest.raises(RuntimeError, match="not-served"):
        eng.generate_chat(MSGS[:1], max_new_tokens=4)


def test_update_weights_is_refused(engine, served):
    with pytest.raises(RuntimeError, match="frozen policy"):
        engine.update_weights(served[0].model)


def test_completion_parsing_uses_server_token_ids_when_given():
    """vLLM's completions answer with return_tokens_as_token_ids: ids are taken as they are."""
    resp = {"choices": [
        {"index": 1, "text": "b", "finish_reason": "length",
         "logprobs": {"tokens": ["token_id:7", "token_id:8"], "token_logprobs": [-0.5, -1.5]}},
        {"index": 0, "text": "a", "finish_reason": "stop",
         "logprobs": {"tokens": ["token_id:5"], "token_logprobs": [-0.25]}}]}

    def never(text, pieces):
        raise AssertionError("no re-tokenization needed")

    s = samples_from_completion(resp, 3, [1, 2], 2, never)
    assert [x.token_ids for x in s] == [[5], [7, 8]] and [x.logprobs for x in s] == [[-0.25], [-0.5, -1.5]]
    assert [x.finish_reason for x in s] == ["stop", "length"] and s[0].prompt_ids == [1, 2] and s[0].prompt_index == 3
    with pytest.raises(ValueError, match="2 choices, 3 asked"):
        samples_from_completion(resp, 0, [1], 3, never)


def test_unalignable_pieces_raise(engine):
    with pytest.raises(TokenAlignmentError, match="cannot be assigned"):
        engine._retokenize("x", ["this-is-not-a-single-vocabulary-token"])
