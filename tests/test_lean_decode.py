"""The lean decode step (reflrl.engines.lean_decode) computes what the transformers forward computes."""
from __future__ import annotations

import copy

import pytest
import torch

from reflrl.engines.fast_decode import fast_decoding, growing_cache, reserve
from reflrl.engines import packed
from reflrl.engines.lean_decode import FusedWeights, LeanDecoder, supports
from reflrl.engines.transformers_engine import TransformersEngine
from reflrl.logprobs import sequence_logprobs
from reflrl.models import load_model

from doubles import right_padded


def _prefilled(model, rows: int, width: int, pad_first: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 200, (rows, width), generator=g)
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[0, :pad_first] = 0  # a left-padded row
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = growing_cache(model.config)
    with torch.inference_mode(), fast_decoding(model):
        model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    reserve(cache, width + 8)
    return mask, cache


needs_onednn = pytest.mark.skipif(not packed.supported(), reason="this torch build cannot pack weights for oneDNN")
PACKED = pytest.param(True, marks=needs_onednn, id="packed")


@pytest.mark.parametrize("dtype,trainable,atol,pack", [("float32", "all", 1e-5, False), ("bfloat16", "top_layers:1", 2e-2, False),
                                                       pytest.param("float32", "all", 1e-5, True, marks=needs_onednn, id="float32-packed"),
                                                       pytest.param("bfloat16", "top_layers:1", 2e-2, True, marks=needs_onednn,
                                                                    id="bfloat16-packed")])
def test_step_equals_the_transformers_forward(dtype, trainable, atol, pack):
    model, _ = load_model("tiny-random", dtype=dtype, trainable=trainable, seed=0)
    model.eval()
    assert supports(model)
    mask, cache = _prefilled(model, rows=3, width=7, pad_first=3)
    dec, lean = model.get_decoder(), LeanDecoder(model, FusedWeights(packed=pack))
    # with packing on, every float32 matrix of the step is a packed one (not a silent fallback to F.linear):
    # all of a float32 model's, the float32 trainable layer's of a bfloat16 one (its frozen ones stay plain)
    mats = [w for ws in lean.weights for w in ws if w is not None and w.dim() == 2]
    assert all(w.is_mkldnn == (pack and w.dtype == torch.float32) for w in mats)
    assert any(w.is_mkldnn for w in mats) == pack
    tok = torch.tensor([5, 17, 40])
    pos = mask.sum(-1)
    ref_cache, lean_cache = copy.deepcopy(cache), copy.deepcopy(cache)
    amask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
    with torch.inference_mode(), fast_decoding(model):
        for step in range(3):  # several steps: the cache columns written by the lean step are read back
            ref = dec(input_ids=tok[:, None], attention_mask=amask, position_ids=pos[:, None],
                      past_key_values=ref_cache, use_cache=True).last_hidden_state[:, -1]
            got = lean.step(tok, pos, 7 + step, amask.bool(), lean_cache)
            assert got.dtype == ref.dtype
            assert torch.allclose(got.float(), ref.float(), atol=atol, rtol=0), step
            tok, pos = (tok * 3 + 1) % 200, pos + 1
            amask = torch.cat([amask, torch.ones(3, 1, dtype=torch.long)], 1)


@pytest.mark.parametrize("pack", [False, PACKED])
def test_engine_answers_alike_with_and_without_the_lean_step(pack):
    """Greedy tokens equal and log-probs within 1e-5 (float32), with rows finishing at different
    times (stop ids and per-prompt caps), so rows are kept and compacted along the way; with the
    decode step's weights (and the output head) packed for oneDNN too."""
    model, tok = load_model("tiny-random", dtype="float32", seed=0)
    prompts = [tok.encode("hello there"), tok.encode("a much longer prompt with more tokens in it, ok"),
               tok.encode("third")]
    fast, slow = TransformersEngine(model, tok, packed=pack), TransformersEngine(model, tok, lean=False)
    assert fast.head()[0].is_mkldnn == pack
    assert fast._lean_decoder() is not None and slow._lean_decoder() is None
    first = fast.generate(prompts, n=2, max_new_tokens=16, temperature=0.0)
    stop = sorted({s.token_ids[3] for s in first})[:2]  # tokens that end some rows early
    kw = dict(n=2, max_new_tokens=[16, 5, 11], temperature=0.0, stop_ids=stop)
    a, b = fast.generate(prompts, **kw), slow.generate(prompts, **kw)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert [s.finish_reason for s in a] == [s.finish_reason for s in b]
    assert len({len(s.token_ids) for s in a}) > 1  # rows did finish at different steps
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


@pytest.mark.parametrize("dtype,trainable,atol,pack", [("float32", "all", 1e-4, False), ("bfloat16", "top_layers:1", 5e-2, False),
                                                       pytest.param("float32", "all", 1e-4, True, marks=needs_onednn, id="float32-packed"),
                                                       pytest.param("bfloat16", "top_layers:1", 5e-2, True, marks=needs_onednn,
                                                                    id="bfloat16-packed")])
def test_sampled_logprobs_match_the_trainers_recomputation(dtype, trainable, atol, pack):
    """The engine's log-probs at temperature 0.7 = the trainer's sequence_logprobs of the same tokens
    (the importance ratio of the clipped loss is 1 up to this tolerance)."""
    model, tok = load_model("tiny-random", dtype=dtype, trainable=trainable, seed=0)
    prompts = [tok.encode("hello there"), tok.encode("a much longer prompt with more tokens in it, ok")]
    engine = TransformersEngine(model, tok, packed=pack)
    assert engine.head()[0].is_mkldnn == pack  # the float32 head is packed in a bfloat16 model too
    out = engine.generate(prompts, n=4, max_new_tokens=12, temperature=0.7, seed=3)
    ids, am, rm = right_padded(out)
    with torch.no_grad():
        lp = sequence_logprobs(model, ids, am, rm, temperature=0.7)
    for i, s in enumerate(out):
        p = len(s.prompt_ids)
        assert torch.allclose(lp[i, p: p + len(s.token_ids)].float(), torch.tensor(s.logprobs), atol=atol)


def test_lora_models_take_the_transformers_forward():
    model, tok = load_model("tiny-random", dtype="float32", trainable="lora", seed=0)
    assert not supports(model)
    assert TransformersEngine(model, tok)._lean_decoder() is None


@pytest.mark.parametrize("pack", [False, PACKED])
def test_concatenated_weights_follow_an_update_of_the_parameters(pack):
    """The fused q/k/v and gate/up matrices (and, packed, every matrix and the head) are kept across
    calls; an in-place update of a layer's parameters (what an optimiser step does) must reach the
    next generation."""
    model, tok = load_model("tiny-random", dtype="float32", seed=0)
    prompts = [tok.encode("hello there"), tok.encode("a much longer prompt with more tokens in it, ok")]
    fast, slow = TransformersEngine(model, tok, packed=pack), TransformersEngine(model, tok, lean=False)
    before = fast.generate(prompts, n=1, max_new_tokens=8, temperature=0.0)
    with torch.no_grad():
        layer = model.get_decoder().layers[-1]
        layer.self_attn.k_proj.weight.mul_(-3.0)
        layer.mlp.up_proj.weight.add_(0.5)
        layer.self_attn.o_proj.weight.mul_(1.5)
        layer.mlp.down_proj.weight.add_(0.1)
        model.get_output_embeddings().weight.mul_(1.2)
    after, ref = fast.generate(prompts, n=1, max_new_tokens=8, temperature=0.0), \
        slow.generate(prompts, n=1, max_new_tokens=8, temperature=0.0)
    for x, y in zip(after, ref):
        assert x.token_ids == y.token_ids
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
    assert [s.logprobs for s in after] != [s.logprobs for s in before]


def test_engines_of_one_model_share_one_copy_of_the_decode_weights():
    """A run's rollout and evaluation engines decode the same model: the concatenated / packed copies
    exist once (each is as large as the layers it covers)."""
    model, tok = load_model("tiny-random", dtype="float32", seed=0)
    a, b = TransformersEngine(model, tok), TransformersEngine(model, tok, max_batch_size=4)
    assert a._weights() is b._weights()
    other, _ = load_model("tiny-random", dtype="float32", seed=1)
    assert TransformersEngine(other, tok)._weights() is not a._weights()


@needs_onednn
@pytest.mark.parametrize("dtype,trainable,atol", [("float32", "all", 1e-5), ("bfloat16", "top_layers:1", 2e-2)])
def test_a_prefill_multiplies_by_the_packed_matrices_and_computes_the_same(dtype, trainable, atol, monkeypatch):
    """Within packed_prefill, the transformers forward of a prompt batch runs its float32 layers' products
    through the packed copies (counted at oneDNN's op), and its hidden states and keys/values are those of
    the plain forward; outside it, and with gradients on, nothing is switched."""
    from reflrl.engines.lean_decode import packed_prefill

    model, _ = load_model("tiny-random", dtype=dtype, trainable=trainable, seed=0)
    model.eval()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 200, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :4] = 0  # a left-padded row
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    dec = model.get_decoder()

    def prefill():
        cache = growing_cache(model.config)
        h = dec(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                use_cache=True).last_hidden_state
        return h, cache

    calls = []
    import reflrl.engines.lean_decode as ld

    def counting(x, w, b=None):
        calls.append(w.is_mkldnn)
        return packed.dense(x, w, b)

    monkeypatch.setattr(ld, "_dense", counting)
    fused = FusedWeights(packed=True)
    float32_layers = sum(layer.self_attn.q_proj.weight.dtype == torch.float32 for layer in dec.layers)
    with torch.inference_mode():
        ref_h, ref_cache = prefill()
        with packed_prefill(model, fused) as switched:
            got_h, got_cache = prefill()
        assert switched == float32_layers > 0
        # per float32 layer: q/k/v once, o, gate/up once, down -- all on packed weights
        assert len(calls) == 4 * float32_layers and all(calls)
        again_h, _ = prefill()  # restored: the plain forward again
        assert len(calls) == 4 * float32_layers
        assert torch.equal(again_h, ref_h)
    assert torch.allclose(got_h.float(), ref_h.float(), atol=atol, rtol=0)
    for a, b in zip(got_cache.layers, ref_cache.layers):
        assert torch.allclose(a.keys.float(), b.keys.float(), atol=atol, rtol=0)
        assert torch.allclose(a.values.float(), b.values.float(), atol=atol, rtol=0)
    with torch.enable_grad(), packed_prefill(model, fused) as switched:
        assert switched == 0  # the packed copies carry no gradient


@pytest.mark.parametrize("pack", [False, PACKED])
def test_copies_of_the_trained_layers_are_dropped_before_an_update_and_rebuilt_at_the_next_use(pack):
    """``on_weights_changing`` frees the decode step's copies of the layers (and head) that train, keeps
    the frozen ones, and the next generation rebuilds them: the same answers as before."""
    model, tok = load_model("tiny-random", dtype="float32", trainable="top_layers:1", seed=0)
    eng = TransformersEngine(model, tok, packed=pack)
    prompts = [tok.encode("hello there"), tok.encode("a much longer prompt with more tokens in it, ok")]
    before = eng.generate(prompts, n=1, max_new_tokens=6, temperature=0.0)
    fused, n = eng._weights(), len(model.get_decoder().layers)
    frozen = fused.layers[0]
    assert set(fused.layers) == set(range(n)) and fused._head is not None
    eng.on_weights_changing(model)
    assert set(fused.layers) == set(range(n - 1))  # the top layer trains: its copies are gone
    assert fused.layers[0] is frozen and fused._head is not None  # the frozen layers' and the head's stay
    again = eng.generate(prompts, n=1, max_new_tokens=6, temperature=0.0)
    assert set(fused.layers) == set(range(n))
    assert [s.token_ids for s in again] == [s.token_ids for s in before]
    assert [s.logprobs for s in again] == [s.logprobs for s in before]


def test_a_trained_head_is_dropped_too():
    model, tok = load_model("tiny-random", dtype="float32", trainable="all", seed=0)
    eng = TransformersEngine(model, tok)
    eng.generate([tok.encode("hello there")], n=1, max_new_tokens=3, temperature=0.0)
    fused = eng._weights()
    assert fused.layers and fused._head is not None
    assert fused.drop_trainable(model) > 0
    assert not fused.layers and fused._head is None


@needs_onednn
def test_a_training_forward_runs_its_frozen_float32_layers_on_the_packed_matrices(monkeypatch):
    """Within the engine's training_forwards, a training forward and backward of a float32 model
    multiplies its frozen layers (and only those) by the decode step's packed copies: the same loss and
    gradients as the plain forward, nothing packed for the trained layers, and a generation inside the
    block (a probe during the warm-up) leaves the switch as it found it."""
    import reflrl.engines.lean_decode as ld

    model, tok = load_model("tiny-random", dtype="float32", trainable="top_layers:1", seed=0)
    eng = TransformersEngine(model, tok, packed=True)
    ids = torch.tensor([tok.encode("hello there, call the tool please"), tok.encode("and another one, ok now then")])

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    calls = []
    monkeypatch.setattr(ld, "_dense", lambda x, w, b=None: calls.append(w.is_mkldnn) or packed.dense(x, w, b))
    ref_loss, ref_grads = step()
    assert calls == []
    with eng.training_forwards(model):
        loss, grads = step()
        assert len(calls) == 4 and all(calls)  # layer 0 (frozen): q/k/v, o, gate/up, down; layer 1 trains
        assert 1 not in eng._weights().layers  # the trained layer was never packed for it
        eng.generate([ids[0].tolist()], max_new_tokens=3, temperature=0.0)  # nested switch, restored after
        calls.clear()
        step()
        assert len(calls) == 4 and all(calls)
    assert torch.allclose(loss, ref_loss, atol=1e-6, rtol=0)
    assert ref_grads.keys() == grads.keys() and not any(n.startswith("model.layers.0.") for n in grads)
    assert all(torch.allclose(grads[n], ref_grads[n], atol=1e-5, rtol=0) for n in grads)
    calls.clear()
    step()
    assert calls == []  # restored: the plain forward
    assert not [m for m in model.modules() if isinstance(m, torch.nn.Linear) and "forward" in m.__dict__]
    plain = TransformersEngine(model, tok)  # an engine without packed weights lends nothing
    with plain.training_forwards(model):
        step()
    assert calls == []
