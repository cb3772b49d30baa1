"""reflrl.engines.trunk_cache: held-out prompts seen before skip the frozen bottom layers, with the same outputs."""
from __future__ import annotations

import torch
from mapping import mapped_file

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


def test_the_cache_keeps_within_its_bytes_dropping_the_least_recently_used():
    model, tok = load_model("tiny-random", dtype="float32", trainable="top_layers:1", seed=0)
    prompts = _prompts(tok)
    probe = TransformersEngine(model, tok, trunk_cache=TrunkCache(model, max_bytes=None))
    probe.generate(prompts, max_new_tokens=2, temperature=0.0)
    size = {k: TrunkCache._size(e) for k, e in probe.trunk_cache.entries.items()}
    assert probe.trunk_cache.nbytes == sum(size.values())
    budget = size[tuple(prompts[0])] + size[tuple(prompts[1])] + size[tuple(prompts[2])]
    eng = TransformersEngine(model, tok, trunk_cache=TrunkCache(model, max_bytes=budget))
    eng.generate(prompts[:3], max_new_tokens=2, temperature=0.0)
    assert set(eng.trunk_cache.entries) == {tuple(p) for p in prompts[:3]}
    eng.generate(prompts[:1], max_new_tokens=2, temperature=0.0)  # prompt 0 used again: now the most recent
    eng.generate(prompts[3:4], max_new_tokens=2, temperature=0.0)  # prompt 1, the least recently used, goes
    kept = eng.trunk_cache.entries
    assert tuple(prompts[0]) in kept and tuple(prompts[3]) in kept and tuple(prompts[1]) not in kept
    assert eng.trunk_cache.nbytes == sum(size[k] for k in kept) <= budget
    small = TransformersEngine(model, tok, trunk_cache=TrunkCache(model, max_bytes=min(size.values()) - 1))
    out = small.generate(prompts, max_new_tokens=6, temperature=0.0)  # nothing fits: plain prefills
    assert small.trunk_cache.entries == {} and small.trunk_cache.nbytes == 0
    plain = TransformersEngine(model, tok).generate(prompts, max_new_tokens=6, temperature=0.0)
    assert [s.token_ids for s in out] == [s.token_ids for s in plain]


def test_offloaded_states_leave_memory_for_a_mapped_file_and_serve_the_same_samples(tmp_path, monkeypatch):
    model, tok = load_model("tiny-random", dtype="float32", trainable="top_layers:1", seed=0)
    prompts = _prompts(tok)
    eng = TransformersEngine(model, tok, trunk_cache=TrunkCache(model))
    first = eng.generate(prompts[:3], n=2, max_new_tokens=10, temperature=0.8, seed=3)
    tc = eng.trunk_cache
    before = {k: [t.clone() for t in (*ks, *vs, h)] for k, (ks, vs, h) in tc.entries.items()}
    assert tc.offload(tmp_path)
    assert list(tmp_path.iterdir()) == []  # unlinked once mapped: nothing left behind
    for k, (ks, vs, h) in tc.entries.items():  # the same values, now read from the mapping, not the heap
        assert all(".mapped-" in mapped_file(t) for t in (*ks, *vs, h))
        assert all(torch.equal(a, b) for a, b in zip(before[k], (*ks, *vs, h)))
    import reflrl.engines.trunk_cache as T  # a replayed state's pages are given back (reflrl.memory's test)
    released = []
    monkeypatch.setattr(T, "release_mapped_pages", lambda ts: released.append([t.data_ptr() for t in ts]) or 0)
    again = eng.generate(prompts[:3], n=2, max_new_tokens=10, temperature=0.8, seed=3)
    assert tc.hits == 3 and tc.misses == 3  # the offloaded prompts served from the mapping
    assert [s.token_ids for s in again] == [s.token_ids for s in first]
    assert sorted(map(tuple, released)) == sorted(tuple(t.data_ptr() for t in (*ks, *vs, h))
                                                  for ks, vs, h in tc.entries.values())
    files = {k: mapped_file(ks[0]) for k, (ks, _, _) in tc.entries.items()}
    eng.generate(prompts[3:], max_new_tokens=2, temperature=0.0)  # 2 new ones stored in memory
    released.clear()
    eng.generate(prompts[3:], max_new_tokens=2, temperature=0.0)  # replayed from memory: nothing to give back
    assert tc.hits == 5 and released == []
    assert tc.offload(tmp_path) and len(tc.entries) == 5 and list(tmp_path.iterdir()) == []  # again, with both kinds
    # only the 2 new ones were written: the 3 already on disk keep their mapping
    assert {k: mapped_file(tc.entries[k][0][0]) for k in files} == files
    assert all(".mapped-" in mapped_file(ks[0]) for ks, _, _ in tc.entries.values())

    import reflrl.diskspace as D  # a disk without room: nothing moves, nothing is lost
    monkeypatch.setattr(D.shutil, "disk_usage", lambda p: type("U", (), {"free": 0})())
    eng.generate(prompts[:1] + [tok("one more prompt")["input_ids"]], max_new_tokens=2, temperature=0.0)
    in_heap = [k for k, (ks, _, _) in tc.entries.items() if ".mapped-" not in mapped_file(ks[0])]
    assert in_heap and not tc.offload(tmp_path) and list(tmp_path.iterdir()) == []
    assert len(tc.entries) == 6 and ".mapped-" not in mapped_file(tc.entries[in_heap[0]][0][0])
    assert TrunkCache(model).offload(tmp_path) is False  # nothing to move


def test_a_spilling_cache_holds_no_state_in_memory_after_any_prefill(tmp_path):
    model, tok = load_model("tiny-random", dtype="float32", trainable="top_layers:1", seed=0)
    prompts = _prompts(tok)
    plain = TransformersEngine(model, tok).generate(prompts[:3], n=2, max_new_tokens=8, temperature=0.8, seed=4)
    eng = TransformersEngine(model, tok, trunk_cache=TrunkCache(model, spill=tmp_path))
    tc = eng.trunk_cache
    first = eng.generate(prompts[:3], n=2, max_new_tokens=8, temperature=0.8, seed=4)
    assert len(tc.entries) == 3 and list(tmp_path.iterdir()) == []
    assert all(".mapped-" in mapped_file(t) for ks, vs, h in tc.entries.values() for t in (*ks, *vs, h))
    again = eng.generate(prompts[:3], n=2, max_new_tokens=8, temperature=0.8, seed=4)  # replayed from disk
    more = eng.generate(prompts[3:], n=2, max_new_tokens=8, temperature=0.8, seed=4)  # 2 new ones
    assert tc.hits == 3 and tc.misses == 5 and len(tc.entries) == 5 and list(tmp_path.iterdir()) == []
    assert all(".mapped-" in mapped_file(t) for ks, vs, h in tc.entries.values() for t in (*ks, *vs, h))
    assert tc.offload(tmp_path) is False  # nothing left in memory to move
    assert [s.token_ids for s in first] == [s.token_ids for s in again] == [s.token_ids for s in plain]
    more_plain = TransformersEngine(model, tok).generate(prompts[3:], n=2, max_new_tokens=8, temperature=0.8, seed=4)
    assert [s.token_ids for s in more] == [s.token_ids for s in more_plain]
