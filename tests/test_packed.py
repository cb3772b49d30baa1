"""rollout.packed_weights: what auto decides from the measurement, its cache, and where packing is off."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from reflrl.engines import packed
from reflrl.engines.packed import PackedTiming, dense, measure, pack, resolve

from doubles import tiny_cfg

needs_onednn = pytest.mark.skipif(not packed.supported(), reason="this torch build cannot pack weights for oneDNN")


def test_auto_packs_where_the_measurement_finds_it_faster_and_caches_it(tmp_path):
    cache = tmp_path / "packed.json"
    calls = []

    def bench(t):
        return lambda: calls.append(1) or t

    on = resolve("auto", cache=cache, available=True, bench=bench(PackedTiming(1.0, 0.5)))
    assert on.enabled and not on.cached and "0.50x" in on.reason
    again = resolve("auto", cache=cache, available=True, bench=bench(PackedTiming(1.0, 2.0)))
    assert again.enabled and again.cached and len(calls) == 1  # the same CPU model: measured once
    off = resolve("auto", cache=False, available=True, bench=bench(PackedTiming(1.0, 0.97)))
    assert not off.enabled  # within 5%: plain weights are kept
    assert off.to_dict()["packed_s"] == 0.97


def test_explicit_modes_and_what_cannot_be_packed():
    never = lambda: pytest.fail("nothing is measured")  # noqa: E731
    assert resolve("true", available=True, bench=never).enabled
    assert resolve(True, available=True, bench=never).enabled  # a YAML boolean
    assert not resolve("false", available=True, bench=never).enabled
    assert not resolve(False, available=True, bench=never).enabled
    no = resolve("true", available=False, bench=never)
    assert not no.enabled and "not available" in no.log_line()
    with pytest.raises(ValueError, match="rollout.packed_weights='fast'"):
        resolve("fast")


def test_measure_interleaves_and_keeps_each_sides_fastest():
    ticks = iter(range(1000))
    seen = []

    def work(p):
        seen.append(p)

    t = measure(repeats=3, clock=lambda: next(ticks), work=work)
    assert seen == [False, True] + [False, True] * 3
    assert t.plain_s == 1 and t.packed_s == 1


@needs_onednn
def test_a_packed_product_equals_the_plain_one():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(300, 64, generator=g), torch.randn(300, generator=g)
    x = torch.randn(10, 64, generator=g)[::2]  # a strided row selection, as the decode step's
    p = pack(w)
    assert p is not None and p.is_mkldnn
    assert torch.allclose(dense(x, p, b), torch.nn.functional.linear(x, w, b), atol=1e-5)
    assert pack(w.bfloat16()) is None  # only float32 is packed


@needs_onednn
def test_a_bfloat16_run_packs_its_float32_head_and_trainable_layers(tmp_path):
    """A model computing in bfloat16 still multiplies by float32 matrices in its decode step (the head, the
    trainable layers' master weights): with packing on, the run's engines pack those and only those."""
    from reflrl.train.setup import build_components

    cfg = tiny_cfg(tmp_path, **{"model.dtype": "bfloat16", "model.trainable": "top_layers:1",
                                "rollout.packed_weights": "true", "rollout.decode_matmul": "torch"})
    comp = build_components(cfg, [], env_factory=lambda *_a: ([], None))
    assert comp.decode_weights.enabled
    for engine in (comp.engine, comp.eval_engine):
        assert engine.packed and engine.head()[0].is_mkldnn
    lean = comp.engine._lean_decoder()
    mats = [w for ws in lean.weights for w in ws if w is not None and w.dim() == 2]
    assert {w.is_mkldnn for w in mats} == {True, False}  # the float32 top layer packed, the bfloat16 rest plain
    assert all(w.is_mkldnn == (w.dtype == torch.float32) for w in mats)


@needs_onednn
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps and madvise(MADV_PAGEOUT) are Linux's")
def test_frozen_float32_weights_mapped_from_a_file_give_their_pages_back_once_packed(tmp_path):
    """A float32 model loaded from safetensors has its weights mapped from the file. Once the decode step
    packs a frozen layer, every forward through the engine multiplies by the packed copies: the plain
    weights' pages leave the process's memory (the file mapping's resident size drops by their size), the
    trained layer's stay, the samples are those of an engine on the same weights in ordinary memory, and
    after a checkpoint's save reads them back, ``release_unused_weights`` gives them back again."""
    from transformers import LlamaForCausalLM

    from mapping import mapped_file, mapped_rss, resident_bytes
    from reflrl.engines.transformers_engine import TransformersEngine
    from reflrl.models import TINY_NAME, load_tokenizer, tiny_config

    tok = load_tokenizer(TINY_NAME)
    torch.manual_seed(0)
    cfg = tiny_config(len(tok), tok, hidden_size=256, intermediate_size=1024, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    os.sync()  # its pages written back: a dirty page of the file stays resident until it is
    model = LlamaForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    heap = LlamaForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    for p in heap.parameters():
        p.data = p.data.clone()  # the same weights in ordinary memory
    if not mapped_file(model.model.layers[0].mlp.down_proj.weight).endswith("model.safetensors"):
        pytest.skip("this transformers version copies safetensors weights instead of mapping them")
    for m in (model, heap):
        m.requires_grad_(False)
        m.model.layers[2].requires_grad_(True)  # top_layers:1
    frozen = [mod.weight for layer in model.model.layers[:2] for mod in layer.modules()
              if isinstance(mod, torch.nn.Linear)]
    trained = model.model.layers[2].mlp.down_proj.weight
    before = [w.clone() for w in frozen]
    with torch.no_grad():
        sum(float(p.sum()) for p in model.parameters())  # every weight read: all resident
    full = mapped_rss(trained)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    got = TransformersEngine(model, tok, packed=True, continuous=True).generate(
        prompts, n=2, max_new_tokens=12, stop_ids=[], seed=3)
    want = TransformersEngine(heap, tok, packed=True, continuous=True).generate(
        prompts, n=2, max_new_tokens=12, stop_ids=[], seed=3)
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    freed = sum(w.numel() * 4 for w in frozen)
    slack = len(frozen) * 16 * 4096  # per weight: pages it shares with its neighbours, and the kernel's fault-around
    assert mapped_rss(trained) <= full - freed + slack  # the frozen layers' pages given back
    assert sum(resident_bytes(w) for w in frozen) <= slack
    trained_all = [p for p in model.model.layers[2].parameters() if p.dim() == 2]
    assert all(resident_bytes(w) >= w.numel() * 4 - 2 * 4096 for w in trained_all)  # the trained layer's stay
    engine = TransformersEngine(model, tok, packed=True, continuous=True)
    engine.generate(prompts, n=1, max_new_tokens=4, stop_ids=[], seed=3)
    model.save_pretrained(tmp_path / "ckpt")  # reads every weight back from the file
    assert mapped_rss(trained) >= full - slack
    assert engine.release_unused_weights(model) >= freed - slack
    assert mapped_rss(trained) <= full - freed + slack
    assert sum(resident_bytes(w) for w in frozen) <= slack
    assert all(torch.equal(a, b) for a, b in zip(frozen, before))  # the same values, read from the file
