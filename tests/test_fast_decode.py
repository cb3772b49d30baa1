"""reflrl.engines.fast_decode: the growing KV cache and copy-free GQA decode attention give the same
outputs as transformers' DynamicCache + sdpa (tiny model: 4 query heads over 2 key/value heads)."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from reflrl.engines.transformers_engine import TransformersEngine
from reflrl.engines.fast_decode import ATTN_NAME, GrowingLayer, fast_decoding, growing_cache
from reflrl.models import load_model


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model("tiny-random", dtype="float32", seed=0)
    model.eval()
    assert model.config.num_attention_heads != model.config.num_key_value_heads  # GQA is exercised
    return model, tok


def _decode(model, cache, fast: bool, steps: int = 5):
    """Left-padded prefill of 3 rows, then `steps` one-token steps; returns hidden states per step."""
    torch.manual_seed(0)
    ids = torch.randint(10, 1000, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :5] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    dec = model.get_decoder()
    out = []
    with torch.inference_mode():
        ctx = fast_decoding(model) if fast else torch.inference_mode()
        with ctx:
            h = dec(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                    use_cache=True).last_hidden_state[:, -1]
            out.append(h)
            nxt = mask.sum(-1)
            for s in range(steps):
                if s == 2:  # drop a finished row, as the engine does
                    keep = torch.tensor([0, 2])
                    cache.batch_select_indices(keep)
                    mask, nxt = mask[keep], nxt[keep]
                tok = torch.full((mask.shape[0], 1), 100 + s)
                mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=torch.long)], 1)
                h = dec(input_ids=tok, attention_mask=mask, position_ids=nxt[:, None], past_key_values=cache,
                        use_cache=True).last_hidden_state[:, -1]
                nxt = nxt + 1
                out.append(h)
    return out


def test_growing_cache_and_gqa_attention_match_dynamic_cache(tiny):
    model, _ = tiny
    ref = _decode(model, DynamicCache(config=model.config), fast=False)
    cache = growing_cache(model.config)
    assert all(isinstance(layer, GrowingLayer) for layer in cache.layers)
    got = _decode(model, cache, fast=True)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # the buffer grew past its first capacity (12 + 64 > 76 is not reached; force growth below)
    layer = GrowingLayer()
    k = torch.randn(1, 2, 70, 4)
    layer.update(k, k)
    k2 = torch.randn(1, 2, 100, 4)
    keys, _ = layer.update(k2, k2)
    assert keys.shape == (1, 2, 170, 4) and layer.get_seq_length() == 170
    torch.testing.assert_close(keys, torch.cat([k, k2], dim=2))


def test_fast_decoding_switches_and_restores_attention(tiny):
    model, _ = tiny
    before = model.config._attn_implementation
    assert before == "sdpa"
    with fast_decoding(model) as on:
        assert on and model.config._attn_implementation == ATTN_NAME
    assert model.config._attn_implementation == before
    with pytest.raises(RuntimeError):
        with fast_decoding(model):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == before


def test_engine_greedy_unchanged_by_fast_path(tiny, monkeypatch):
    model, tok = tiny
    prompts = [tok.encode("hello there"), tok.encode("a much longer prompt with more tokens in it, ok")]
    eng = TransformersEngine(model, tok)
    fast = eng.generate(prompts, n=2, max_new_tokens=12, temperature=0.0)
    import reflrl.engines.transformers_engine as E
    monkeypatch.setattr(E, "growing_cache", lambda cfg: DynamicCache(config=cfg))
    monkeypatch.setattr(E, "fast_decoding", lambda m: torch.inference_mode())
    slow = eng.generate(prompts, n=2, max_new_tokens=12, temperature=0.0)
    assert [s.token_ids for s in fast] == [s.token_ids for s in slow]
    for a, b in zip(fast, slow):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_length_chunks_cover_every_row_once_and_limit_padding():
    from reflrl.engines.fast_decode import length_chunks

    lengths = [300, 120, 310, 500, 125, 130, 495, 305]
    chunks = length_chunks(lengths, max_waste=0.15, max_rows=16)
    assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))
    for c in chunks:
        width = max(lengths[i] for i in c)
        assert sum(lengths[i] for i in c) >= (1 - 0.15) * width * len(c)
    assert len(chunks) == 3  # ~500, ~300, ~125
    assert all(len(c) <= 2 for c in length_chunks(lengths, max_rows=2))
    capped = length_chunks(lengths, max_tokens=1000)  # rows x the chunk's longest <= 1000, a longer row alone
    assert sorted(i for c in capped for i in c) == list(range(len(lengths)))
    assert all(len(c) * max(lengths[i] for i in c) <= 1000 for c in capped)
    assert len(length_chunks([1500, 1490, 20], max_tokens=1000)) == 3


def test_chunked_prefill_matches_one_padded_prefill(tiny, monkeypatch):
    """Prompts of very different lengths: chunked prefill + merged cache == one left-padded prefill."""
    model, tok = tiny
    prompts = [tok.encode("hi"), tok.encode("word " * 60), tok.encode("ok then"), tok.encode("word " * 58)]
    eng = TransformersEngine(model, tok)
    a = eng.generate(prompts, n=2, max_new_tokens=10, temperature=0.0)
    assert eng.last_stats.forward_calls > 10  # several prefill chunks ran
    import reflrl.engines.transformers_engine as E
    monkeypatch.setattr(E, "length_chunks", lambda lengths, **kw: [list(range(len(lengths)))])
    b = eng.generate(prompts, n=2, max_new_tokens=10, temperature=0.0)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


def test_a_chunked_prefill_holds_one_chunk_cache_at_a_time(tiny, monkeypatch):
    """Each chunk's cache is copied into the call's cache and freed before the next chunk runs (the
    prefill's memory is the call's cache plus one chunk's, not every chunk's at once), and the call's
    cache has room for the decode's new tokens from the start (no reallocation while decoding)."""
    import gc
    import weakref

    import reflrl.engines.transformers_engine as E

    model, tok = tiny
    prompts = [tok.encode("hi"), tok.encode("word " * 60), tok.encode("ok then"), tok.encode("word " * 30)]
    eng = TransformersEngine(model, tok)
    real, alive, seen = E.TransformersEngine._prefill_whole, [], []

    def spy(self, *args, **kwargs):
        gc.collect()
        seen.append(sum(r() is not None for r in alive))  # earlier chunks' caches still alive now
        h, cache = real(self, *args, **kwargs)
        alive.append(weakref.ref(cache.layers[0].keys))
        return h, cache

    monkeypatch.setattr(E.TransformersEngine, "_prefill_whole", spy)
    width = max(len(p) for p in prompts)
    with torch.inference_mode():
        _h, cache = eng._prefill(model.get_decoder(), prompts, width, capacity=width + 40)
    assert len(seen) >= 3 and seen == [0] * len(seen)  # several chunks, never two alive at once
    assert cache.layers[0].kbuf.shape[-2] == width + 40 and cache.get_seq_length() == width


def test_a_batch_of_similar_lengths_answers_each_prompt_as_alone(tiny):
    """Similar lengths in no sorted order make ONE prefill chunk; each row must still be its own
    prompt's (a chunk kept in length order once swapped the rows: every GRPO group was sampled from
    another task's prompt, and greedy evaluation in batches of 16 scored 0%)."""
    model, tok = tiny
    texts = ["word " * 40, "ok go " * 22, "word " * 43, "hi there " * 21, "yes " * 42]
    prompts = [tok.encode(t) for t in texts]
    import reflrl.engines.fast_decode as F
    lengths = [len(p) for p in prompts]
    assert lengths != sorted(lengths) and lengths != sorted(lengths, reverse=True)
    assert len(F.length_chunks(lengths)) == 1
    eng = TransformersEngine(model, tok)
    alone = [eng.generate([p], n=1, max_new_tokens=6, temperature=0.0)[0].token_ids for p in prompts]
    assert len({tuple(a) for a in alone}) > 1  # the prompts' answers differ: a swap would show
    batched = eng.generate(prompts, n=2, max_new_tokens=6, temperature=0.0)
    assert [s.token_ids for s in batched] == [a for a in alone for _ in range(2)]
    assert [s.prompt_index for s in batched] == [i for i in range(len(prompts)) for _ in range(2)]


def test_prefix_families_group_rows_by_a_shared_start():
    from reflrl.engines.fast_decode import prefix_families

    a, b = list(range(100, 180)), list(range(300, 370))
    prompts = [a + [1, 2], b + [5], a + [7], list(range(10)), a, b + [6, 6, 6]]
    fams = prefix_families(prompts, min_shared=64)
    assert sorted(i for f, _ in fams for i in f) == list(range(len(prompts)))  # every row once
    got = {tuple(sorted(f)): k for f, k in fams}
    assert got[(0, 2, 4)] == 79  # all of a but its last token: the shortest member keeps one of its own
    assert got[(1, 5)] == 70
    assert got[(3,)] == 0  # alone: nothing shared
    assert all(k == 0 for f, k in prefix_families(prompts, min_shared=90) if len(f) == 1)


def test_rows_with_a_shared_start_prefill_it_once_with_the_same_answers(monkeypatch):
    """A group's later turns share their first message(s): the shared tokens run once and are copied to
    every row, the rest runs per row; greedy tokens and log-probs equal a whole prefill of each row."""
    import reflrl.engines.transformers_engine as TE
    from reflrl.engines.transformers_engine import TransformersEngine
    from reflrl.models import load_model

    model, tok = load_model("tiny-random", dtype="float32", seed=0)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(3, 200, (90,), generator=g).tolist()
    prompts = [base + torch.randint(3, 200, (k,), generator=g).tolist() for k in (3, 17, 40, 9)]
    prompts.insert(2, torch.randint(3, 200, (50,), generator=g).tolist())  # a row that shares nothing
    calls = []
    orig = TransformersEngine._prefill_shared
    monkeypatch.setattr(TransformersEngine, "_prefill_shared",
                        lambda self, d, ps, shared: calls.append((len(ps), shared)) or orig(self, d, ps, shared))
    shared = TransformersEngine(model, tok).generate(prompts, n=2, max_new_tokens=10, temperature=0.0)
    assert calls == [(4, 90)]
    monkeypatch.setattr(TE, "SHARED_PREFIX_MIN", 10**9)
    whole = TransformersEngine(model, tok).generate(prompts, n=2, max_new_tokens=10, temperature=0.0)
    assert calls == [(4, 90)]
    assert [s.token_ids for s in shared] == [s.token_ids for s in whole]
    for x, y in zip(shared, whole):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


def test_a_prefill_chunk_pads_to_at_most_its_token_cap_with_the_same_answers(tiny, monkeypatch):
    """Prompts run whole are prefilled in chunks of at most PREFILL_CHUNK_TOKENS padded tokens (what a
    chunk holds at once: its cache, one layer's activations and attention scores), with the answers of
    one chunk."""
    import reflrl.engines.transformers_engine as E

    model, tok = tiny
    prompts = [tok.encode("word " * (30 + i)) for i in range(6)]
    eng = TransformersEngine(model, tok)
    whole = eng.generate(prompts, max_new_tokens=8, temperature=0.0)
    real, shapes = E.TransformersEngine._prefill_whole, []

    def spy(self, decoder, chunk, *args, **kwargs):
        shapes.append((len(chunk), max(len(p) for p in chunk)))
        return real(self, decoder, chunk, *args, **kwargs)

    monkeypatch.setattr(E.TransformersEngine, "_prefill_whole", spy)
    eng.generate(prompts, max_new_tokens=8, temperature=0.0)
    assert shapes == [(6, max(len(p) for p in prompts))]  # the default cap holds them in one chunk
    cap = 2 * max(len(p) for p in prompts) + 5
    monkeypatch.setattr(E, "PREFILL_CHUNK_TOKENS", cap)
    shapes.clear()
    capped = eng.generate(prompts, max_new_tokens=8, temperature=0.0)
    assert len(shapes) == 3 and all(rows * width <= cap for rows, width in shapes)
    assert [s.token_ids for s in capped] == [s.token_ids for s in whole]
