"""reflrl.engines.trunk_cache: held-out prompts seen before skip the frozen bottom layers, with the same outputs."""
from __future__ import annotations

import torch

from reflrl.engines.transformers_engine import TransformersEngine
from reflrl.models import load_model
from reflrl.engines.trunk_cache import TrunkCache, frozen_depth


def _prompts(tok):
    return [tok(f"call the weather tool for city {i}" + " please" * (i % 4))["input_ids"] for i in range(5)]


def test_replayed_prefill_gives_the_same_samples_and_counts_hits():
    torch.manual_seed(0)
    model, tok = load_model("tiny-random", dtype="float32", trainable="top_layers:1", seed=0)
    assert frozen_depth(model) == 1  # 2 layers, the top one trains
    prompts = _prompts(tok)
    plain = TransformersEngine(model, tok).generate(prompts, n=2, max_new_tokens=12, temperature=0.8, seed=5)
    eng = TransformersEngine(model, tok, trunk_cache=TrunkCache(model))
    first = eng.generate(prompts, n=2, max_new_tokens=12, temperature=0.8, seed=5)
    assert eng.trunk_cache.misses == 5 and eng.trunk_cache.hits == 0 and len(eng.trunk_cache.entries) == 5
    again = eng.generate(prompts, n=2, max_new_tokens=12, temperature=0.8, seed=5)
    assert eng.trunk_cache.hits == 5
    for a, b, c in zip(plain, first, again):
        assert a.token_ids == b.token_ids == c.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, c.logprobs)) < 1e-5


def test_a_changed_frozen_parameter_empties_the_cache_and_the_trainable_top_never_is_cached():
    model, tok = load_model("tiny-random", dtype="float32", trainable="top_layers:1", seed=0)
    eng = TransformersEngine(model, tok, trunk_cache=TrunkCache(model))
    prompts = _prompts(tok)
    eng.generate(prompts, max_new_tokens=4, temperature=0.0)
    top = model.get_decoder().layers[1].mlp.down_proj.weight
    with torch.no_grad():
        top.add_(0.5)  # the trainable top moved (an optimizer step): cached trunk states stay valid
    after_update = eng.generate(prompts, max_new_tokens=6, temperature=0.0)
    assert eng.trunk_cache.hits == 5
    plain = TransformersEngine(model, tok).generate(prompts, max_new_tokens=6, temperature=0.0)
    assert [s.token_ids for s in after_update] == [s.token_ids for s in plain]  # the new top is used
    with torch.no_grad():
        model.get_decoder().layers[0].mlp.down_proj.weight.mul_(2.0)  # a frozen layer changed: invalid
    eng.generate(prompts, max_new_tokens=4, temperature=0.0)
    assert eng.trunk_cache.misses == 10 and eng.trunk_cache.hits == 5
    everything, tok2 = load_model("tiny-random", dtype="float32", trainable="all", seed=0)
    assert frozen_depth(everything) == 0
    e2 = TransformersEngine(everything, tok2, trunk_cache=TrunkCache(everything))
    e2.generate(prompts, max_new_tokens=4, temperature=0.0)
    assert e2.trunk_cache.entries == {} and e2.trunk_cache.misses == 0
