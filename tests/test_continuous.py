"""Tests of reflrl.engines.continuous: the continuous-batching decode loop (refill, KV budget, per-row seeds)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from reflrl.engines.continuous import kv_bytes_per_token
from reflrl.engines.transformers_engine import TransformersEngine
from reflrl.logprobs import sequence_logprobs
from reflrl.models import load_model

from doubles import right_padded


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random", dtype="float32", seed=0)


@pytest.fixture(scope="module")
def prompts(tiny):
    _, tok = tiny
    return [tok.encode("hello there"), tok.encode("a much longer prompt with more tokens in it, ok"),
            tok.encode("x"), tok.encode("another prompt of middling length")]


def pooled(tiny, **kw):
    return TransformersEngine(*tiny, continuous=True, **kw)


def close(a, b, atol=1e-5):
    return torch.allclose(torch.tensor(a), torch.tensor(b), atol=atol)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9)])
def test_pooled_logprobs_match_the_trainers_recomputation(tiny, prompts, temperature, top_p):
    """Rows refilled into freed slots (3 rows for 8 samples) sample log-probs the trainer recomputes."""
    model, _ = tiny
    eng = pooled(tiny, max_batch_size=3)
    out = eng.generate(prompts, n=2, max_new_tokens=[4, 9, 6, 7], temperature=temperature, top_p=top_p, seed=2)
    assert [s.prompt_index for s in out] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert max(eng.last_stats.extra["slots"]) <= 3
    ids, am, rm = right_padded(out)
    with torch.no_grad():
        lp = sequence_logprobs(model, ids, am, rm, temperature=temperature)
    for i, s in enumerate(out):
        p = len(s.prompt_ids)
        assert s.prompt_ids == prompts[s.prompt_index]
        assert torch.allclose(lp[i, p: p + len(s.token_ids)], torch.tensor(s.logprobs), atol=1e-4)


def test_pooled_greedy_equals_the_batch_path(tiny, prompts):
    caps = [5, 9, 7, 3]
    old = TransformersEngine(*tiny).generate(prompts, n=2, max_new_tokens=caps, temperature=0.0)
    new = pooled(tiny, max_batch_size=3).generate(prompts, n=2, max_new_tokens=caps, temperature=0.0)
    assert [s.token_ids for s in old] == [s.token_ids for s in new]
    assert [s.finish_reason for s in old] == [s.finish_reason for s in new]
    assert all(close(a.logprobs, b.logprobs) for a, b in zip(old, new))


def test_a_refilled_row_never_sees_the_slots_earlier_sequence(tiny, prompts):
    """Two slots: the long prompt finishes after 3 tokens, the short prompt 'x' takes its slot, over columns
    the long sequence wrote; it must decode exactly as it does alone."""
    long_p, short_p = prompts[1] * 3, prompts[2]
    alone = pooled(tiny).generate([short_p], max_new_tokens=8, temperature=0.0)[0]
    eng = pooled(tiny, max_batch_size=2)
    out = eng.generate([long_p, prompts[0], short_p], max_new_tokens=[3, 14, 8], temperature=0.0)
    # 'x' was refilled in place (two slots while it decoded: no new buffers, no compaction)
    assert eng.last_stats.extra["slots"][:10] == [2] * 10
    assert out[2].token_ids == alone.token_ids and len(alone.token_ids) == 8
    assert close(out[2].logprobs, alone.logprobs)


def test_kv_budget_serves_in_waves_with_the_same_results(tiny, prompts):
    model, _ = tiny
    kw = dict(n=2, max_new_tokens=6, temperature=1.0, seed=4)
    free = pooled(tiny).generate(prompts, **kw)
    widest = max(len(p) for p in prompts) + 6
    budget = 2 * widest * kv_bytes_per_token(model)  # two rows of the widest request at most
    eng = pooled(tiny, kv_budget_bytes=budget)
    tight = eng.generate(prompts, **kw)
    assert max(eng.last_stats.extra["slots"]) <= 2 < len(tight)
    assert [s.token_ids for s in free] == [s.token_ids for s in tight]
    assert all(close(a.logprobs, b.logprobs) for a, b in zip(free, tight))
    with pytest.raises(ValueError, match="over the pool's budget"):
        pooled(tiny, kv_budget_bytes=widest * kv_bytes_per_token(model) - 1).generate(prompts, **kw)


def test_samples_depend_on_the_seed_not_on_arrival_or_the_other_rows(tiny, prompts):
    eng = pooled(tiny, max_batch_size=4)
    kw = dict(n=2, max_new_tokens=8, temperature=1.0)

    async def together(order):
        outs = await asyncio.gather(*(eng.agenerate([prompts[i]], seed=10 + i, **kw) for i in order))
        return {i: o for i, o in zip(order, outs)}

    alone = {i: eng.generate([prompts[i]], seed=10 + i, **kw) for i in range(len(prompts))}
    forward = asyncio.run(together([0, 1, 2, 3]))
    backward = asyncio.run(together([3, 2, 1, 0]))
    for i in range(len(prompts)):
        for run in (forward, backward):
            assert [s.token_ids for s in run[i]] == [s.token_ids for s in alone[i]]
            assert all(close(a.logprobs, b.logprobs) for a, b in zip(run[i], alone[i]))
    assert alone[0][0].token_ids != alone[0][1].token_ids  # the n rows of a prompt draw different streams
    other = eng.generate([prompts[0]], seed=99, **kw)
    assert [s.token_ids for s in other] != [s.token_ids for s in alone[0]]


def test_requests_that_arrive_while_the_pool_decodes_join_its_steps(tiny, prompts):
    eng = pooled(tiny, max_batch_size=8)

    async def later():
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return await eng.agenerate([prompts[1]], n=2, max_new_tokens=10, temperature=1.0, seed=1)

    async def main():
        return await asyncio.gather(eng.agenerate([prompts[0]], n=2, max_new_tokens=10, temperature=1.0, seed=0),
                                    later())

    a, b = asyncio.run(main())
    rows = eng.pool().stats.decode_rows
    assert max(rows) == 4  # the later request decoded beside the first
    assert len(rows) < 2 * 9  # fewer steps than serving the two requests one after the other
    assert not eng.pool().busy


def test_pool_restores_train_mode_and_falls_back_without_the_lean_step(tiny, prompts):
    model, tok = tiny
    model.train()
    eng = pooled(tiny)
    asyncio.run(eng.agenerate(prompts, max_new_tokens=3))
    eng.generate(prompts, max_new_tokens=3)
    assert model.training
    model.eval()
    plain = TransformersEngine(model, tok, continuous=True, lean=False)  # no lean step: the batch path
    out = plain.generate(prompts, max_new_tokens=4, temperature=0.0)
    ref = TransformersEngine(model, tok).generate(prompts, max_new_tokens=4, temperature=0.0)
    assert [s.token_ids for s in out] == [s.token_ids for s in ref]
    assert [s.token_ids for s in asyncio.run(plain.agenerate(prompts, max_new_tokens=4, temperature=0.0))] == \
        [s.token_ids for s in ref]


def test_rollout_continuous_runs_a_training_step_through_the_pool(tmp_path):
    """rollout.continuous (the default, not set here): the run's engines decode through the pool (within
    rollout.kv_budget_mb), a step's rollouts and reflection retries are served by the shared loop (every
    hold given back), and the held-out evaluation by a pool."""
    from reflrl import train as T

    from doubles import tiny_cfg
    from mapping import mapped_file

    cfg = tiny_cfg(tmp_path, **{"rollout.kv_budget_mb": 8, "reflection.variant": "tool_rerl",
                                "train.save_every": 0, "model.trainable": "top_layers:1"})
    tr = T.Trainer(cfg, tmp_path / "run", progress=False, quiet=True)
    try:
        assert tr.engine.continuous and tr.eval_engine.continuous
        assert tr.engine.kv_budget_bytes == 8 * 2**20
        m = tr.train_step()
        stats = tr.engine.pool().stats
        retries = int(m["reflect/generate_calls"])
        assert retries > 0 and stats.samples == 8 + retries and stats.prompts == 2 + retries
        assert tr.engine.pool().held == 0 and not tr.engine.pool().busy
        res = tr.evaluate("test")
        assert res["n"] == len(tr.splits["test"]) == tr.eval_engine.last_stats.samples
        # the held-out prompts' trunk states went to the run folder as they were stored: none in memory
        trunk = tr.eval_engine.trunk_cache
        assert trunk.spill == tr.log.path and trunk.misses > 0 and trunk.entries
        assert all(".mapped-" in mapped_file(t) for ks, vs, h in trunk.entries.values() for t in (*ks, *vs, h))
    finally:
        tr.close()


def test_a_generation_during_the_shared_loop_waits_for_its_step(tiny, prompts):
    """A plain generate (e.g. a critic sampling from the policy) called on the event loop while the shared
    loop decodes in its worker thread takes the model's generation lock between steps: both get what they
    get alone."""
    model, tok = tiny
    eng, other = pooled(tiny, max_batch_size=4), TransformersEngine(model, tok)
    kw = dict(max_new_tokens=10, temperature=0.0)
    alone_pool = eng.generate(prompts, **kw)
    alone_other = other.generate(prompts[:2], **kw)

    async def main():
        task = asyncio.ensure_future(eng.agenerate(prompts, **kw))
        await asyncio.sleep(0.01)
        mid = other.generate(prompts[:2], **kw)  # blocks the loop, as a synchronous critic call does
        return await task, mid

    got, mid = asyncio.run(main())
    assert [s.token_ids for s in got] == [s.token_ids for s in alone_pool]
    assert [s.token_ids for s in mid] == [s.token_ids for s in alone_other]


def test_lockstep_makes_the_schedule_a_function_of_the_seed(tiny, prompts):
    """Four coroutines each make three requests with a pause of random length between them (a tool step).
    Holding the pool (engine.hold / held=True / engine.release), every run decodes the same rows in the same
    steps, so the samples are the same to the bit whatever the pauses."""
    import random

    def once(pause_seed, lockstep):
        eng = pooled(tiny, max_batch_size=8)
        rng = random.Random(pause_seed)
        pauses = {(c, t): rng.random() * 0.03 for c in range(4) for t in range(3)}

        async def client(c):
            out = []
            try:
                for t in range(3):
                    s = await eng.agenerate([prompts[c]], max_new_tokens=3 + 2 * c + t, temperature=1.0,
                                            seed=100 * c + t, held=lockstep)
                    out.append(s[0])
                    await asyncio.sleep(pauses[c, t])
            finally:
                if lockstep:
                    eng.release()
            return out

        async def main():
            if lockstep:
                eng.hold(4)
            return await asyncio.gather(*(client(c) for c in range(4)))

        got = asyncio.run(main())
        return eng.pool().stats.decode_rows, [(s.token_ids, s.logprobs) for c in got for s in c]

    a_rows, a = once(1, True)
    b_rows, b = once(2, True)
    assert a_rows == b_rows and a == b
    free_rows = {tuple(once(s, False)[0]) for s in (1, 2, 3)}
    assert len(free_rows) > 1  # without the holds the steps' rows follow the pauses


def test_a_prefill_with_a_sink_hands_over_each_chunk_and_merges_nothing(tiny):
    """The pool's admission takes the prefill chunk by chunk (sink): every row exactly once, with the
    hidden state and keys/values of the merged prefill; no merged cache is built or returned."""
    model, tok = tiny
    eng = TransformersEngine(model, tok)
    prompts = [tok.encode("x"), tok.encode("a much longer prompt with many more tokens in it than the others " * 3),
               tok.encode("hello there"), tok.encode("a middling prompt, neither short nor long")]
    width = max(len(p) for p in prompts)
    got: dict[int, tuple] = {}
    chunks = []

    def sink(idx, h, cache):
        chunks.append(list(idx))
        cw = cache.layers[0].keys.shape[-2]
        for r, k in enumerate(idx):
            p = len(prompts[k])
            got[k] = (h[r].clone(), [lay.keys[r, :, cw - p:].clone() for lay in cache.layers])

    with torch.inference_mode():
        h, merged = eng._prefill(model.get_decoder(), prompts, width)
        assert eng._prefill(model.get_decoder(), prompts, width, sink=sink) is None
    assert len(chunks) > 1 and sorted(k for c in chunks for k in c) == list(range(len(prompts)))
    for k, p in enumerate(prompts):
        assert torch.allclose(got[k][0], h[k], atol=1e-5)
        for mine, lay in zip(got[k][1], merged.layers):
            assert torch.allclose(mine, lay.keys[k, :, width - len(p): width], atol=1e-5)


def test_a_relayout_frees_each_old_layer_as_soon_as_its_rows_are_copied(tiny, prompts, monkeypatch):
    """Growing the pool's buffers never holds two whole KV caches: when layer i's new buffers are made, the
    old buffers of layers before it are gone (and with no row to keep, all of them); the rows are copied."""
    import weakref

    from reflrl.engines import continuous as CB

    eng = pooled(tiny, max_batch_size=4)
    pool = CB.DecodePool(eng, 4)
    pool._setup()
    pool._layout([], width=8, extra=2)
    for lay in pool.cache.layers:  # recognisable rows: slot 0 holds 1s, slot 1 holds 2s
        for buf in (lay.kbuf, lay.vbuf):
            buf[0], buf[1] = 1.0, 2.0
    del lay, buf  # the test keeps no reference to the old buffers
    req = CB.Request(list(prompts[0]), 1, 4, 1.0, 1.0, frozenset(), 0)
    live = [CB._Row(req, 0)]
    pool.slots = [None, live[0]]  # slot 1 is live, slot 0 is free

    seen: list[list[bool]] = []
    real = CB._Layer

    class Watched(real):
        def __init__(self, *buffers):
            seen.append([r() is not None for r in old])
            super().__init__(*buffers)

    old = [weakref.ref(lay.kflat) for lay in pool.cache.layers]
    monkeypatch.setattr(CB, "_Layer", Watched)
    pool._layout(live, width=12, extra=1)
    n = len(old)
    assert [sum(s) for s in seen] == [n - 1 - i for i in range(n)]  # layer i's old buffers gone before it is kept
    for lay in pool.cache.layers:  # the live row (old slot 1) is now slot 0, its 8 columns kept, the rest zero
        assert lay.kbuf.shape[0] == 2 and lay.kbuf.shape[2] == 12
        assert torch.all(lay.kbuf[0, :, :8] == 2.0) and torch.all(lay.kbuf[0, :, 8:] == 0)
        assert torch.all(lay.vbuf[1] == 0)

    del lay
    seen.clear()
    old = [weakref.ref(lay.kflat) for lay in pool.cache.layers]
    pool.slots = [None, None]
    pool._layout([], width=16, extra=2)  # nothing to keep: the old cache goes before the first new layer
    assert seen and all(sum(s) == 0 for s in seen)


def test_a_relayout_that_fits_moves_the_rows_inside_the_same_buffers(tiny, prompts):
    """The buffers grow to twice their size (at most the KV budget), and a later relayout that fits in
    them moves the live rows inside them: no new buffers, each live row's columns where its new slot
    reads them (the budget test below checks that samples through such layouts are unchanged)."""
    from reflrl.engines import continuous as CB

    model, _ = tiny
    bpt = kv_bytes_per_token(model)
    pool = CB.DecodePool(pooled(tiny, max_batch_size=4), 4, kv_budget_bytes=64 * bpt)  # 64 tokens
    pool._setup()
    pool._layout([], width=8, extra=2)  # 16 tokens: what the first layout needs
    per_token = pool.cache.layers[0].kbuf[0, :, 0].numel()
    assert pool.cache.layers[0].kflat.numel() == 16 * per_token
    req = CB.Request(list(prompts[0]), 1, 4, 1.0, 1.0, frozenset(), 0)
    a, b = CB._Row(req, 0), CB._Row(req, 0)
    for lay in pool.cache.layers:  # slot 0 holds 1s, slot 1 holds 2s
        for buf in (lay.kbuf, lay.vbuf):
            buf[0], buf[1] = 1.0, 2.0
    pool.slots = [a, b]
    pool._layout([a, b], width=12, extra=1)  # 36 tokens: more than twice 16, less than the budget
    assert pool.cache.layers[0].kflat.numel() == 36 * per_token
    ptrs = [lay.kflat.data_ptr() for lay in pool.cache.layers]
    pool.slots = [None, b, None]  # slot 0's row finished: slot 1's moves to slot 0, 2 slots x 16 columns
    pool._layout([b], width=16, extra=1)
    assert [lay.kflat.data_ptr() for lay in pool.cache.layers] == ptrs  # the same buffers
    for lay in pool.cache.layers:
        assert lay.kbuf.shape[0] == 2 and lay.kbuf.shape[2] == 16 and lay.kbuf.data_ptr() == lay.kflat.data_ptr()
        assert torch.all(lay.kbuf[0, :, :8] == 2.0) and torch.all(lay.vbuf[0, :, :8] == 2.0)
    pool.slots = [None, None]
    pool._layout([], width=40, extra=1)  # 40 tokens: twice 36 is over the budget, so the budget
    assert pool.cache.layers[0].kflat.numel() == 64 * per_token


def test_the_heap_is_given_back_after_each_admission_that_prefilled_and_never_on_a_plain_step(tiny, prompts,
                                                                                            monkeypatch):
    """A prefill's activations and a relayout's old buffers are freed into the C heap; the pool trims it
    right after such an admission (their pages would otherwise stay resident under the next
    allocations), and not after the decode steps between them."""
    from reflrl.engines import continuous as CB

    trims: list[int] = []
    monkeypatch.setattr(CB, "release_heap", lambda: trims.append(1) or True)
    eng = pooled(tiny, max_batch_size=2)
    real, admits = CB.DecodePool._admit, []

    def watched(self):
        before = (self.stats.prompts, len(self.slots), self.width)
        real(self)
        admits.append(before != (self.stats.prompts, len(self.slots), self.width))

    monkeypatch.setattr(CB.DecodePool, "_admit", watched)
    eng.generate(prompts, max_new_tokens=[3, 9, 5, 12], temperature=0.0)
    assert len(admits) > sum(admits) > 1  # some admissions prefilled, most steps did not
    assert len(trims) == sum(admits)


def _span_cost(spans, overhead):
    return sum((e - a) * w + overhead for a, e, w in spans)


def test_attention_spans_read_the_fewest_columns_and_cover_every_live_slot():
    """Exact against every partition of up to 7 slots: each live slot in one span as wide as its need at
    least, idle slots alone never read, and no cheaper choice exists."""
    import itertools
    import random

    from reflrl.engines.continuous import attention_spans

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 7)
        needs = [rng.choice([0, 0, 1, 5, 40, 300, 900]) for _ in range(n)]
        over = rng.choice([0, 16, 256])
        spans = attention_spans(needs, over)
        covered = [i for a, e, _ in spans for i in range(a, e)]
        assert sorted(covered) == covered and len(set(covered)) == len(covered)
        assert {i for i in range(n) if needs[i]} <= set(covered)
        assert all(w == max(needs[a:e]) > 0 for a, e, w in spans)
        best = float("inf")  # brute force: every way to cut the slots, each piece a span or (all idle) skipped
        for cuts in itertools.product([0, 1], repeat=max(0, n - 1)):
            bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
            cost = sum((e - a) * max(needs[a:e]) + over for a, e in zip(bounds, bounds[1:]) if max(needs[a:e]) > 0)
            best = min(best, cost)
        assert _span_cost(spans, over) == best, (needs, over, spans)
    # one long row among short ones reads alone; equal rows share one span
    assert attention_spans([900, 20, 20, 20], 16) == [(0, 1, 900), (1, 4, 20)]
    assert attention_spans([300] * 5, 0) == [(0, 5, 300)]
    assert attention_spans([0, 0], 0) == []


def test_rows_of_different_lengths_attend_in_spans_with_the_trainers_logprobs(tiny, prompts, monkeypatch):
    """With spans free to split (no overhead), rows of different lengths read only their span's columns:
    the pool still samples the log-probs the trainer recomputes, and greedy decoding is the batch path's."""
    from reflrl.engines import continuous as CB

    model, _ = tiny
    monkeypatch.setattr(CB, "SPAN_OVERHEAD", 0)
    seen = []
    orig = CB.attention_spans
    monkeypatch.setattr(CB, "attention_spans", lambda needs: seen.append(orig(needs)) or seen[-1])
    ps = [prompts[1] * 3, prompts[2], prompts[0], prompts[3] * 2]
    out = pooled(tiny, max_batch_size=3).generate(ps, n=2, max_new_tokens=[4, 9, 6, 7], temperature=1.0, seed=2)
    assert any(len(s) > 1 and len({w for _, _, w in s}) > 1 for s in seen)  # narrower spans beside wide ones
    assert_trainers_logprobs(model, out)
    caps = [5, 9, 7, 3]
    old = TransformersEngine(*tiny).generate(ps, n=2, max_new_tokens=caps, temperature=0.0)
    new = pooled(tiny, max_batch_size=3).generate(ps, n=2, max_new_tokens=caps, temperature=0.0)
    assert [s.token_ids for s in old] == [s.token_ids for s in new]
    assert all(close(a.logprobs, b.logprobs) for a, b in zip(old, new))


def test_a_relayout_puts_the_longest_rows_first(tiny, prompts):
    """Rows of like lengths side by side: a layout orders the live rows by length, longest first, each
    row's keys and values moving with it."""
    from reflrl.engines import continuous as CB

    pool = CB.DecodePool(pooled(tiny, max_batch_size=4), 4)
    pool._setup()
    pool._layout([], width=16, extra=3)
    req = CB.Request(list(prompts[0]), 1, 4, 1.0, 1.0, frozenset(), 0)
    rows = [CB._Row(req, 0) for _ in range(3)]
    for r, n in zip(rows, (3, 9, 5)):
        r.length = n
    for lay in pool.cache.layers:
        for i in range(3):
            lay.kbuf[i], lay.vbuf[i] = float(i + 1), float(-(i + 1))
    pool.slots = list(rows)
    pool._layout(rows, width=16, extra=1)
    assert [s.length for s in pool.slots[:3]] == [9, 5, 3] and pool.slots[3] is None
    for lay in pool.cache.layers:  # the row of length 9 was in slot 1 (2s), 5 in slot 2 (3s), 3 in slot 0 (1s)
        assert [float(lay.kbuf[i, 0, 0, 0]) for i in range(3)] == [2.0, 3.0, 1.0]
        assert [float(lay.vbuf[i, 0, 0, 0]) for i in range(3)] == [-2.0, -3.0, -1.0]


def assert_trainers_logprobs(model, out, atol=1e-4):
    """Each sample's log-probs are those the trainer recomputes for its tokens (temperature 1)."""
    ids, am, rm = right_padded(out)
    with torch.no_grad():
        lp = sequence_logprobs(model, ids, am, rm, temperature=1.0)
    for i, s in enumerate(out):
        p = len(s.prompt_ids)
        assert torch.allclose(lp[i, p: p + len(s.token_ids)], torch.tensor(s.logprobs), atol=atol)
