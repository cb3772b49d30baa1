"""rollout.decode_attention: the native one-token attention kernel computes SDPA's attention, reads only
what each row may see, and auto decides from its measurement."""
from __future__ import annotations

import copy

import pytest
import torch

from reflrl.engines import native_attention as NA
from reflrl.engines.native_attention import AttentionTiming, BuildError, reference, resolve, sample_case
from reflrl.engines.transformers_engine import TransformersEngine
from reflrl.models import load_model

from doubles import tiny_cfg
from test_continuous import assert_trainers_logprobs, prompts, tiny  # noqa: F401 -- the pool tests' model and prompts

needs_cc = pytest.mark.skipif(NA.compiler() is None, reason="no C compiler on this machine")
pytestmark = needs_cc


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    return NA.build(tmp_path_factory.mktemp("kernels"))


def _case(dtype, rows=6, heads=2, groups=4, dim=32, cols=40, seed=0):
    """Attention inputs with left padding (row 0), a row whose width stops short of the mask (row 1), an
    idle row (row 2) and a strided q (a slice of a wider q/k projection, as the decode step's)."""
    g = torch.Generator().manual_seed(seed)
    qk = torch.randn(rows, heads * groups + heads, 1, dim, generator=g).to(dtype)
    q = qk[:, : heads * groups].reshape(rows, heads, groups, dim)
    k = torch.randn(rows, heads, cols + 5, dim, generator=g).to(dtype)
    v = torch.randn(rows, heads, cols + 5, dim, generator=g).to(dtype)
    mask = torch.ones(rows, cols, dtype=torch.bool)
    mask[0, :7] = False
    width = torch.full((rows,), cols, dtype=torch.int32)
    width[1], width[2] = 13, 0
    return q, k, v, mask, width


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [dict(), dict(heads=3, groups=3, dim=64)], ids=["generic", "smollm2"])
def test_the_kernel_computes_sdpas_attention(kernel, dtype, atol, shape):
    q, k, v, mask, width = _case(dtype, **shape)
    got = kernel(q, k, v, mask, width, 0.3)
    assert got.dtype == dtype and got.shape == q.shape
    # the reference in float32 from the same (rounded) inputs: the kernel computes in float32 too
    want = reference(q.float(), k.float(), v.float(), mask, width, 0.3)
    assert torch.allclose(got.float(), want, atol=atol, rtol=0)
    assert bool((got[2] == 0).all())  # the idle row
    # row 1 reads 13 columns although its mask shows 40: the same as SDPA over those 13
    short = torch.nn.functional.scaled_dot_product_attention(q[1:2].float(), k[1:2, :, :13].float(),
                                                             v[1:2, :, :13].float(), scale=0.3)
    assert torch.allclose(got[1:2].float(), short, atol=atol, rtol=0)


def test_columns_a_row_may_not_see_are_never_read(kernel):
    """NaN in every masked-out column and beyond each row's width (a slot's stale or uninitialised columns)
    changes nothing."""
    q, k, v, mask, width = _case(torch.float32)
    clean = kernel(q, k, v, mask, width, 0.3)
    kd, vd = k.clone(), v.clone()
    for r in range(len(width)):
        w = int(width[r])
        hidden = torch.ones(k.shape[2], dtype=torch.bool)
        hidden[:w] = ~mask[r, :w]
        kd[r, :, hidden], vd[r, :, hidden] = float("nan"), float("nan")
    dirty = kernel(q, kd, vd, mask, width, 0.3)
    assert torch.equal(dirty, clean)


def test_a_rows_result_depends_on_nothing_but_the_row(kernel):
    """Bit for bit: a row alone, among other rows, and with one or two threads."""
    q, k, v, mask, width = _case(torch.bfloat16, rows=8, heads=3, groups=3, dim=64)
    together = kernel(q, k, v, mask, width, 0.125)
    for r in (0, 1, 5):
        alone = kernel(q[r: r + 1], k[r: r + 1], v[r: r + 1], mask[r: r + 1], width[r: r + 1], 0.125)
        assert torch.equal(alone[0], together[r])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(q, k, v, mask, width, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, together)


def test_bad_inputs_are_refused_with_a_message(kernel):
    q, k, v, mask, width = _case(torch.float32)
    with pytest.raises(TypeError, match="dtypes"):
        kernel(q.half(), k.half(), v.half(), mask, width, 1.0)
    with pytest.raises(ValueError, match="layouts"):
        kernel(q.transpose(2, 3), k, v, mask, width, 1.0)
    with pytest.raises(ValueError, match="width int32"):
        kernel(q, k, v, mask, width.long(), 1.0)
    with pytest.raises(ValueError, match="do not match"):
        kernel(q, k[:3], v[:3], mask, width, 1.0)


def assert_lean_steps_match_the_forward(model, make_lean, atol):
    """Three decode steps of ``make_lean(model)`` (a LeanDecoder) after a prefill of three rows, one of them
    left-padded (the kernel reads the mask's holes), each against the transformers forward's last hidden state."""
    from reflrl.engines.fast_decode import fast_decoding, growing_cache, reserve

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 200, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, :3] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = growing_cache(model.config)
    dec = model.get_decoder()
    with torch.inference_mode(), fast_decoding(model):
        dec(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    reserve(cache, 16)
    lean = make_lean(model)
    tok, pos = torch.tensor([5, 17, 40]), mask.sum(-1)
    ref_cache, lean_cache = copy.deepcopy(cache), copy.deepcopy(cache)
    amask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
    with torch.inference_mode(), fast_decoding(model):
        for step in range(3):
            ref = dec(input_ids=tok[:, None], attention_mask=amask, position_ids=pos[:, None],
                      past_key_values=ref_cache, use_cache=True).last_hidden_state[:, -1]
            got = lean.step(tok, pos, 7 + step, amask.bool(), lean_cache)
            assert torch.allclose(got.float(), ref.float(), atol=atol, rtol=0), step
            tok, pos = (tok * 3 + 1) % 200, pos + 1
            amask = torch.cat([amask, torch.ones(3, 1, dtype=torch.long)], 1)
    return lean


@pytest.mark.parametrize("dtype,trainable,atol", [("float32", "all", 1e-5), ("bfloat16", "top_layers:1", 2e-2)])
def test_the_decode_step_with_the_kernel_equals_the_transformers_forward(kernel, dtype, trainable, atol):
    from reflrl.engines.lean_decode import FusedWeights, LeanDecoder

    model, _ = load_model("tiny-random", dtype=dtype, trainable=trainable, seed=0)
    model.eval()
    assert_lean_steps_match_the_forward(model, lambda m: LeanDecoder(m, FusedWeights(), attention=kernel), atol)


def test_the_pool_with_the_kernel_samples_the_trainers_logprobs(kernel, tiny, prompts):
    """Continuous batching with the kernel: rows of different lengths refilled into freed slots sample the
    log-probs the trainer recomputes, and greedy decoding is SDPA's batch path's, token for token."""
    model, _ = tiny
    ps = [prompts[1] * 3, prompts[2], prompts[0], prompts[3] * 2]
    eng = TransformersEngine(*tiny, continuous=True, max_batch_size=3, attention=kernel)
    assert eng._lean_decoder().attention is kernel
    out = eng.generate(ps, n=2, max_new_tokens=[4, 9, 6, 7], temperature=1.0, seed=2)
    assert eng.last_stats.forward_calls > 0
    assert_trainers_logprobs(model, out)
    caps = [5, 9, 7, 3]
    old = TransformersEngine(*tiny).generate(ps, n=2, max_new_tokens=caps, temperature=0.0)
    new = TransformersEngine(*tiny, continuous=True, max_batch_size=3, attention=kernel).generate(
        ps, n=2, max_new_tokens=caps, temperature=0.0)
    assert [s.token_ids for s in old] == [s.token_ids for s in new]
    for a, b in zip(old, new):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_a_refilled_row_never_sees_the_slots_earlier_sequence_with_the_kernel(kernel, tiny, prompts):
    long_p, short_p = prompts[1] * 3, prompts[2]
    alone = TransformersEngine(*tiny, continuous=True, attention=kernel).generate([short_p], max_new_tokens=8,
                                                                                  temperature=0.0)[0]
    eng = TransformersEngine(*tiny, continuous=True, max_batch_size=2, attention=kernel)
    out = eng.generate([long_p, prompts[0], short_p], max_new_tokens=[3, 14, 8], temperature=0.0)
    assert eng.last_stats.extra["slots"][:10] == [2] * 10  # 'x' refilled in place, over the long row's columns
    assert out[2].token_ids == alone.token_ids and len(alone.token_ids) == 8
    assert torch.equal(torch.tensor(out[2].logprobs), torch.tensor(alone.logprobs))  # bit for bit


# ------------------------------------------------------------------------------------------ resolve
def test_auto_takes_the_kernel_where_the_measurement_finds_it_faster_and_caches_it(kernel, tmp_path):
    cache, calls = tmp_path / "attention.json", []

    def bench(t):
        return lambda _k: calls.append(1) or t

    kd = kernel.path.parent
    on = resolve("auto", cache=cache, kernel_dir=kd, bench=bench(AttentionTiming(1.0, 0.4)))
    assert on.enabled and on.kernel is kernel and "0.40x" in on.log_line() and not on.cached
    again = resolve("auto", cache=cache, kernel_dir=kd, bench=bench(AttentionTiming(1.0, 2.0)))
    assert again.enabled and again.cached and len(calls) == 1  # measured once per CPU model
    off = resolve("auto", cache=False, kernel_dir=kd, bench=bench(AttentionTiming(1.0, 0.97)))
    assert not off.enabled and off.kernel is None and "SDPA" in off.log_line()  # within 5%: SDPA kept
    assert off.to_dict()["native_s"] == 0.97


def test_explicit_modes_and_a_machine_without_a_compiler(tmp_path, monkeypatch):
    never = lambda _k: pytest.fail("nothing is measured")  # noqa: E731
    assert not resolve("sdpa", bench=never).enabled
    assert resolve("native", kernel_dir=tmp_path / "k", bench=never).enabled
    with pytest.raises(ValueError, match="rollout.decode_attention='flash'"):
        resolve("flash")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    fresh = tmp_path / "fresh"  # nothing built there yet: the compiler is needed
    off = resolve("auto", kernel_dir=fresh, bench=never)
    assert not off.enabled and "did not build" in off.reason
    with pytest.raises(BuildError, match="rollout.decode_attention=native: the kernel did not build"):
        resolve("native", kernel_dir=fresh, bench=never)


def test_a_compiler_error_is_named(tmp_path, monkeypatch):
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'decode_attention.c:1: error: something broke' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    with pytest.raises(BuildError, match="exited with 1: decode_attention.c:1: error: something broke"):
        NA.build(tmp_path / "k")


def test_measure_times_both_interleaved_on_a_decode_shape(kernel):
    ticks = iter(range(1000))
    t = NA.measure(kernel, repeats=2, clock=lambda: next(ticks))
    assert t.sdpa_s == 1 and t.native_s == 1
    q, k, v, mask, width = sample_case()
    assert q.shape == (32, 3, 3, 64) and int((width == 0).sum()) == 1 and int(width.max()) <= 256
    assert NA.check(kernel) <= NA.AGREE_ATOL


def test_a_run_builds_its_engines_with_the_resolved_attention(tmp_path):
    from reflrl.train.setup import build_components

    for mode, on in (("native", True), ("sdpa", False)):
        cfg = tiny_cfg(tmp_path / mode, **{"rollout.decode_attention": mode})
        comp = build_components(cfg, [], env_factory=lambda *_a: ([], None))
        assert comp.decode_attention.enabled == on
        for engine in (comp.engine, comp.eval_engine):
            assert (engine.attention is not None) == on
            assert (engine._lean_decoder().attention is not None) == on


def test_reflrl_evals_local_backend_decodes_with_the_resolved_attention_and_says_so(tmp_path, monkeypatch):
    from reflrl.eval.backends import Decoding, LocalBackend

    monkeypatch.setenv("REFLRL_CACHE", str(tmp_path))  # a fresh cache: auto builds and measures here
    be = LocalBackend("tiny-random", dtype="float32", batch_size=2)
    choice = be.decode_attention
    assert choice.requested == "auto" and choice.timing is not None and not choice.cached
    assert (tmp_path / "attention.json").is_file() and list((tmp_path / "kernels").glob("*.so"))
    on = choice.enabled
    assert (be.engine.attention is not None) == on and be.engine._lean_decoder().attention is choice.kernel
    assert be.describe()["decode_attention"] == ("native" if on else "sdpa")
    outs = be.chat([[{"role": "user", "content": "hi"}]] * 3, Decoding(temperature=0.0, max_new_tokens=4), seed=0)
    assert len(outs) == 3


def test_the_kernels_threads_serve_concurrent_callers_and_a_forked_child(kernel):
    """The kernel's own worker threads (not OpenMP's): calls from several Python threads at once take turns
    and each gets its own result, bit for bit what it gets alone; a forked child (which has none of the
    parent's threads) still runs the kernel and gets the same result."""
    import os
    import threading

    cases = [sample_case(rows=8, width=64, seed=s) for s in range(4)]
    alone = [kernel(*c, 0.125) for c in cases]
    got: dict[int, list] = {}

    def call(i):
        got[i] = [kernel(*cases[i], 0.125) for _ in range(20)]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    for i in range(4):
        assert all(torch.equal(r, alone[i]) for r in got[i])
    if not hasattr(os, "fork"):
        return
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the kernel again, its answer through the pipe
        try:
            ok = torch.equal(kernel(*cases[0], 0.125), alone[0])
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    import select
    import signal

    ready, _, _ = select.select([r], [], [], 60)
    answer = os.read(r, 1) if ready else b"(no answer: the child hung)"
    if not ready:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert answer == b"1"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_cache_write_and_attention_in_one_call(kernel, dtype):
    """rope_attention = transformers' rotary embedding in the cache's dtype, the key and value written at each
    live row's column, then the attention; the written keys bit for bit in bfloat16 (each product and the sum
    rounded as torch rounds them), idle rows untouched."""
    from reflrl.engines.lean_decode import _rotate

    g = torch.Generator().manual_seed(4)
    b, heads, hkv, d, cols = 5, 6, 2, 16, 24
    qkv = torch.randn(b, (heads + 2 * hkv) * d, generator=g).to(dtype)
    ang = torch.randn(b, d // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    k = torch.randn(b, hkv, cols, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, cols, d, generator=g).to(dtype)
    col = torch.tensor([3, 10, 0, 7, 20])
    width = (col + 1).to(torch.int32)
    width[2] = 0  # idle
    mask = torch.arange(cols)[None, :] <= col[:, None]
    k0, v0 = k.clone(), v.clone()
    got = kernel.rope_attention(qkv, cos, sin, col, k, v, mask, width, heads, 0.25)

    x = qkv.view(b, heads + 2 * hkv, 1, d)
    qk = _rotate(x[:, : heads + hkv], cos[:, None, None], sin[:, None, None])
    kw, vw = k0.clone(), v0.clone()
    for r in range(b):
        if width[r]:
            kw[r, :, col[r]], vw[r, :, col[r]] = qk[r, heads:, 0], x[r, heads + hkv:, 0]
    if dtype == torch.bfloat16:
        assert torch.equal(k, kw) and torch.equal(v, vw)
    else:
        assert torch.allclose(k, kw, atol=1e-6, rtol=0) and torch.equal(v, vw)
    assert torch.equal(k[2], k0[2]) and torch.equal(v[2], v0[2])  # the idle row wrote nothing
    q = qk[:, :heads].reshape(b, hkv, heads // hkv, d)
    want = reference(q.float(), kw.float(), vw.float(), mask, width, 0.25)
    assert torch.allclose(got.float(), want, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=0)
    with pytest.raises(ValueError, match="heads over"):
        kernel.rope_attention(qkv[:, :-d], cos, sin, col, k, v, mask, width, heads, 0.25)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
def test_rms_norm_is_the_models(kernel, dtype, tol):
    from reflrl.engines.lean_decode import _rms

    norm = load_model("tiny-random", dtype="float32", seed=0)[0].get_decoder().norm.to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, norm.weight.numel()))
    x = (torch.randn(4, norm.weight.numel(), generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    with torch.inference_mode():
        got, want = kernel.rms_norm(x, norm.weight, norm.variance_epsilon), _rms(x, norm)
    assert got.dtype == dtype and torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    assert kernel.rms_norm(x.half(), norm.weight.half(), 1e-5) is None  # not taken: the caller's torch path
