"""Tests of reflrl.engines.transformers_engine: the RolloutEngine protocol and the transformers sampling loop."""

from __future__ import annotations

import pytest
import torch

from reflrl.engines.transformers_engine import RolloutEngine, Sample, TransformersEngine, sample_next
from reflrl.logprobs import sequence_logprobs
from reflrl.models import load_model

from doubles import right_padded


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model("tiny-random", dtype="float32", seed=0)
    return model, tok


@pytest.fixture(scope="module")
def prompts(tiny):
    _, tok = tiny
    return [tok.encode("hello there"), tok.encode("a much longer prompt with more tokens in it, ok")]


def test_engine_satisfies_protocol(tiny):
    assert isinstance(TransformersEngine(*tiny), RolloutEngine)


def test_generate_shapes_order_and_finish(tiny, prompts):
    eng = TransformersEngine(*tiny)
    out = eng.generate(prompts, n=3, max_new_tokens=6, temperature=1.0, seed=0)
    assert len(out) == 6 and all(isinstance(s, Sample) for s in out)
    assert [s.prompt_index for s in out] == [0, 0, 0, 1, 1, 1]
    for s in out:
        assert s.prompt_ids == prompts[s.prompt_index]
        assert 1 <= len(s.token_ids) <= 6 and len(s.logprobs) == len(s.token_ids)
        assert all(lp <= 0.0 for lp in s.logprobs)
        assert s.finish_reason == ("stop" if s.token_ids[-1] == 2 else "length")
        if s.finish_reason == "length":
            assert len(s.token_ids) == 6
    assert eng.last_stats.samples == 6 and eng.last_stats.new_tokens == sum(len(s.token_ids) for s in out)


def test_generate_is_deterministic_given_seed(tiny, prompts):
    eng = TransformersEngine(*tiny)
    a = eng.generate(prompts, n=2, max_new_tokens=8, seed=5)
    b = eng.generate(prompts, n=2, max_new_tokens=8, seed=5)
    c = eng.generate(prompts, n=2, max_new_tokens=8, seed=6)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert [s.logprobs for s in a] == [s.logprobs for s in b]
    assert [s.token_ids for s in a] != [s.token_ids for s in c]


def test_stop_ids_end_samples_and_drop_rows(tiny, prompts):
    model, tok = tiny
    eng = TransformersEngine(model, tok)
    everything = list(range(len(tok)))
    out = eng.generate(prompts, n=2, max_new_tokens=5, stop_ids=everything, seed=0)
    assert all(len(s.token_ids) == 1 and s.finish_reason == "stop" for s in out)
    # half of the vocabulary stops: rows finish at different steps, the rest keep going correctly
    half = list(range(0, len(tok), 2))
    out = eng.generate(prompts, n=4, max_new_tokens=6, stop_ids=half, seed=1)
    for s in out:
        assert all(t % 2 == 1 for t in s.token_ids[:-1])
        assert s.finish_reason == ("stop" if s.token_ids[-1] % 2 == 0 else "length")
    ids, am, rm = right_padded(out)
    with torch.no_grad():
        lp = sequence_logprobs(model, ids, am, rm)
    for i, s in enumerate(out):
        p = len(s.prompt_ids)
        assert torch.allclose(lp[i, p : p + len(s.token_ids)], torch.tensor(s.logprobs), atol=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_match_sequence_logprobs(tiny, prompts, temperature):
    """Rollout log-probs = trainer log-probs at the same temperature (importance ratio 1)."""
    model, tok = tiny
    out = TransformersEngine(model, tok).generate(
        prompts, n=2, max_new_tokens=8, temperature=temperature, seed=2
    )
    ids, am, rm = right_padded(out)
    with torch.no_grad():
        lp = sequence_logprobs(model, ids, am, rm, temperature=temperature)
    for i, s in enumerate(out):
        p = len(s.prompt_ids)
        assert torch.allclose(lp[i, p : p + len(s.token_ids)], torch.tensor(s.logprobs), atol=1e-4)


def test_left_padding_and_prefill_sharing_do_not_change_greedy(tiny, prompts):
    eng = TransformersEngine(*tiny)
    alone = eng.greedy([prompts[0]], max_new_tokens=8)[0]
    batched = eng.greedy(prompts[::-1], max_new_tokens=8)[1]  # prompts[0] is left-padded here
    assert alone.token_ids == batched.token_ids
    assert torch.allclose(torch.tensor(alone.logprobs), torch.tensor(batched.logprobs), atol=1e-4)
    twice = eng.generate([prompts[0]], n=2, max_new_tokens=8, temperature=0.0)
    assert twice[0].token_ids == twice[1].token_ids == alone.token_ids


def test_max_batch_size_groups_give_same_greedy(tiny, prompts):
    model, tok = tiny
    big = TransformersEngine(model, tok, max_batch_size=64).greedy(prompts, 6)
    small = TransformersEngine(model, tok, max_batch_size=1).greedy(prompts, 6)
    assert [s.token_ids for s in big] == [s.token_ids for s in small]
    assert [s.prompt_index for s in small] == [0, 1]


def test_generate_restores_train_mode_and_keeps_weights(tiny, prompts):
    model, tok = tiny
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    TransformersEngine(model, tok).generate(prompts, n=1, max_new_tokens=3)
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_update_weights_switches_model(tiny, prompts):
    model, tok = tiny
    other, _ = load_model("tiny-random", dtype="float32", seed=9)
    eng = TransformersEngine(model, tok)
    a = eng.greedy(prompts, 6)
    eng.update_weights(other)
    b = eng.greedy(prompts, 6)
    assert eng.model is other
    assert [s.token_ids for s in a] != [s.token_ids for s in b]


def test_generate_validates_arguments(tiny, prompts):
    eng = TransformersEngine(*tiny)
    with pytest.raises(ValueError, match="n=0"):
        eng.generate(prompts, n=0)
    with pytest.raises(ValueError, match="top_p"):
        eng.generate(prompts, top_p=0.0)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        eng.generate([prompts[0], []])
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate(prompts, max_new_tokens=0)


def test_sample_next_greedy_top_p_and_logprob_convention():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 0.0, 0.0]])
    tok, lp = sample_next(logits, 0.0, 1.0, None)
    assert tok.tolist() == [0, 1]
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1))
    g = torch.Generator().manual_seed(0)
    # a tiny nucleus keeps only the top token, whatever the seed
    for _ in range(20):
        tok, lp = sample_next(logits, 1.0, 0.01, g)
        assert tok.tolist() == [0, 1]
    # log-probs are under the temperature-scaled, untruncated distribution
    tok, lp = sample_next(logits, 0.5, 0.01, g)
    ref = torch.log_softmax(logits / 0.5, -1).gather(-1, tok[:, None]).squeeze(-1)
    assert torch.allclose(lp, ref)
    # top_p = 0.8 on probs [0.6, 0.3, 0.1]: the nucleus is {0, 1}; token 2 is never drawn
    lg = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).repeat(200, 1)
    tok, _ = sample_next(lg, 1.0, 0.8, torch.Generator().manual_seed(1))
    assert set(tok.tolist()) == {0, 1}


def test_sample_next_matches_distribution():
    probs = torch.tensor([0.5, 0.25, 0.25])
    logits = probs.log().repeat(4000, 1)
    tok, _ = sample_next(logits, 1.0, 1.0, torch.Generator().manual_seed(0))
    freq = torch.bincount(tok, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_top_layers_mixed_model_generates_consistent_logprobs(prompts):
    model, tok = load_model("tiny-random", dtype="bfloat16", trainable="top_layers:1", seed=0)
    out = TransformersEngine(model, tok).generate(prompts, n=2, max_new_tokens=5, seed=0)
    ids, am, rm = right_padded(out)
    with torch.no_grad():
        lp = sequence_logprobs(model, ids, am, rm)
    for i, s in enumerate(out):
        p = len(s.prompt_ids)
        # bfloat16 bottom layers: cache vs full recompute differ by bf16 rounding only
        assert torch.allclose(lp[i, p : p + len(s.token_ids)], torch.tensor(s.logprobs), atol=5e-2)


def test_sample_next_draws_from_the_temperature_distribution():
    """Inverse-CDF sampling keeps the law of softmax(logits / T): frequencies over many draws
    match the probabilities, a zero-probability token is never drawn, and the log-prob returned is
    the chosen token's under the temperature-scaled distribution."""
    import torch

    from reflrl.engines.transformers_engine import sample_next

    p = torch.tensor([0.1, 0.6, 0.0, 0.3])
    logits = torch.log(p).clamp(min=-1e9).repeat(20000, 1)
    g = torch.Generator().manual_seed(0)
    tok, lp = sample_next(logits, 1.0, 1.0, g)
    freq = torch.bincount(tok, minlength=4).float() / tok.numel()
    assert freq[2] == 0
    assert torch.allclose(freq, p, atol=0.015)
    assert torch.allclose(lp, torch.log(p)[tok], atol=1e-5)
    # top-p 0.65: the smallest set of top tokens reaching 0.65 is {1, 3}
    tok2, _ = sample_next(logits[:2000], 1.0, 0.65, g)
    assert set(tok2.tolist()) <= {1, 3}


def test_two_level_draw_keeps_the_law_over_a_vocabulary_of_several_blocks():
    """A vocabulary spanning several sampling blocks (and not a multiple of the block): frequencies
    match softmax(logits / T) on tokens in different blocks, zero-probability tokens are never drawn, and
    the log-prob is the trainer's (z - logsumexp z)."""
    from reflrl.engines.transformers_engine import SAMPLE_BLOCK

    vocab = 3 * SAMPLE_BLOCK + 37
    base = torch.full((vocab,), -1e9)
    hot = {5: 0.2, SAMPLE_BLOCK - 1: 0.1, SAMPLE_BLOCK: 0.3, 2 * SAMPLE_BLOCK + 100: 0.15, vocab - 1: 0.25}
    for i, p in hot.items():
        base[i] = torch.log(torch.tensor(p)) * 0.7  # logits such that softmax(logits / 0.7) = hot
    logits = base.repeat(30000, 1)
    tok, lp = sample_next(logits, 0.7, 1.0, torch.Generator().manual_seed(0))
    assert set(tok.tolist()) <= set(hot)
    freq = torch.bincount(tok, minlength=vocab).float() / tok.numel()
    for i, p in hot.items():
        assert abs(float(freq[i]) - p) < 0.01, (i, float(freq[i]), p)
    ref = torch.log_softmax(logits[:50] / 0.7, -1).gather(-1, tok[:50, None]).squeeze(-1)
    assert torch.allclose(lp[:50], ref, atol=1e-5)
