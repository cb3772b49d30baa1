"""rollout.decode_matmul: the native matmul kernel computes F.linear, a row's result depends on nothing but
the row, the decode step, prefills and the frozen layers' training forwards use it and keep agreeing with
the trainer, and auto decides per dtype from its measurement."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from reflrl.engines import native_attention as NA
from reflrl.engines import native_matmul as NM
from reflrl.engines.native_matmul import MatmulTiming, NativeWeight, pack, resolve
from reflrl.engines.transformers_engine import TransformersEngine
from reflrl.logprobs import sequence_logprobs
from reflrl.models import load_model

from doubles import tiny_cfg
from test_continuous import assert_trainers_logprobs, prompts, tiny  # noqa: F401 -- the pool tests' model and prompts
from test_native_attention import assert_lean_steps_match_the_forward

pytestmark = pytest.mark.skipif(NA.compiler() is None, reason="no C compiler on this machine")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    k = NA.build(tmp_path_factory.mktemp("kernels"))
    if torch.float32 not in k.matmul:
        pytest.skip("this CPU has neither AVX-512 nor AVX2 with FMA")
    return k


def _dtypes(kernel):
    return [d for d in (torch.float32, torch.bfloat16) if d in kernel.matmul]


@pytest.fixture(scope="module")
def native(kernel):
    """A MatmulChoice taking every dtype the kernel has."""
    return NM.MatmulChoice("native", kernel, frozenset(kernel.matmul), "as configured")


@pytest.mark.parametrize("n,k", [(100, 96), (64, 64), (33, 18), (3072, 576)])
def test_the_kernel_computes_f_linear(kernel, n, k):
    """Every row count through the 8-row blocks (1..19), outputs not a multiple of the layout's 32, a bias,
    and an input with leading dimensions or a strided row."""
    g = torch.Generator().manual_seed(n + k)
    for dtype in _dtypes(kernel):
        w = (torch.rand(n, k, generator=g) - 0.5).to(dtype)
        b = (torch.rand(n, generator=g) - 0.5).to(dtype)
        pw = pack(kernel, w)
        assert isinstance(pw, NativeWeight) and pw.out_features == n and pw.in_features == k
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        for rows in range(1, 20):
            x = (torch.rand(rows, k, generator=g) - 0.5).to(dtype)
            for bias in (None, b):
                got, want = pw.linear(x, bias), F.linear(x, w, bias)
                assert got.dtype == dtype and got.shape == want.shape
                assert torch.allclose(got.float(), want.float(), atol=tol * max(1.0, k / 64), rtol=tol)
        x3 = (torch.rand(2, 5, 2 * k, generator=g) - 0.5).to(dtype)[..., ::2]  # leading dims, strided rows
        assert torch.allclose(pw.linear(x3, b).float(), F.linear(x3, w, b).float(), atol=tol * max(1.0, k / 64),
                              rtol=tol)


def test_bfloat16_products_round_once_as_pytorchs(kernel):
    if torch.bfloat16 not in kernel.matmul:
        pytest.skip("no AVX512-BF16 here")
    g = torch.Generator().manual_seed(3)
    w = (torch.rand(96, 64, generator=g) - 0.5).to(torch.bfloat16)
    x = (torch.rand(9, 64, generator=g) - 0.5).to(torch.bfloat16)
    exact = (x.double() @ w.double().T)
    got = pack(kernel, w).linear(x)
    # one rounding of a float32 sum: within a bfloat16 half-ulp (plus float32 summation error) of the exact product
    assert bool(((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all())


def test_a_rows_result_depends_on_nothing_but_the_row(kernel):
    """Bit for bit: a row alone, among 37 rows (in any 8-row block position), and on 1 or 2 threads."""
    g = torch.Generator().manual_seed(5)
    for dtype in _dtypes(kernel):
        w = (torch.rand(200, 576, generator=g) - 0.5).to(dtype)
        x = (torch.rand(37, 576, generator=g) - 0.5).to(dtype)
        pw = pack(kernel, w)
        full = pw.linear(x)
        for i in range(37):
            assert torch.equal(pw.linear(x[i: i + 1])[0], full[i]), (dtype, i)
        assert torch.equal(pw.linear(x[3:17]), full[3:17])
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = pw.linear(x)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(one, full)


def test_what_the_kernel_cannot_take_stays_with_pytorch(kernel):
    assert pack(kernel, torch.zeros(8, 8, dtype=torch.float16)) is None
    assert pack(kernel, torch.zeros(8, 8, dtype=torch.float64)) is None
    if torch.bfloat16 in kernel.matmul:
        assert pack(kernel, torch.zeros(8, 7, dtype=torch.bfloat16)) is None  # an odd input width
    pw = pack(kernel, torch.zeros(8, 8))
    with pytest.raises(TypeError, match="input torch.bfloat16 against a torch.float32 weight"):
        pw.linear(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="input"):
        pw.linear(torch.zeros(2, 9))
    off = NM.MatmulChoice("torch", None, reason="as configured")
    assert not off.enabled and off.pack(torch.zeros(8, 8)) is None


@pytest.mark.parametrize("dtype,trainable,atol", [("float32", "all", 1e-5), ("bfloat16", "top_layers:1", 2e-2)])
def test_the_decode_step_with_native_matmuls_equals_the_transformers_forward(kernel, native, dtype, trainable, atol):
    from reflrl.engines.lean_decode import FusedWeights, LeanDecoder

    model, _ = load_model("tiny-random", dtype=dtype, trainable=trainable, seed=0)
    model.eval()
    lean = assert_lean_steps_match_the_forward(
        model, lambda m: LeanDecoder(m, FusedWeights(native=native), attention=kernel), atol)
    for layer, ws in zip(model.get_decoder().layers, lean.weights):  # each matrix in the kernel's layout
        native_here = layer.mlp.down_proj.weight.dtype in kernel.matmul
        assert all(isinstance(w, NativeWeight) == native_here for w in (ws[0], ws[2], ws[3], ws[4]))


def test_the_pool_with_native_matmuls_samples_the_trainers_logprobs(kernel, native, tiny, prompts):
    """Continuous batching with native matmuls (and the native attention): rows of different lengths refilled
    into freed slots sample the log-probs the trainer recomputes; greedy decoding is PyTorch's, token for
    token; a refilled row decodes as it does alone."""
    model, _ = tiny
    ps = [prompts[1] * 3, prompts[2], prompts[0], prompts[3] * 2]
    eng = TransformersEngine(*tiny, continuous=True, max_batch_size=3, attention=kernel, matmul=native)
    assert isinstance(eng.head()[0], NativeWeight)
    out = eng.generate(ps, n=2, max_new_tokens=[4, 9, 6, 7], temperature=1.0, seed=2)
    assert_trainers_logprobs(model, out)
    caps = [5, 9, 7, 3]
    old = TransformersEngine(*tiny).generate(ps, n=2, max_new_tokens=caps, temperature=0.0)
    new = TransformersEngine(*tiny, continuous=True, max_batch_size=3, attention=kernel, matmul=native).generate(
        ps, n=2, max_new_tokens=caps, temperature=0.0)
    assert [s.token_ids for s in old] == [s.token_ids for s in new]
    long_p, short_p = prompts[1] * 3, prompts[2]
    eng = TransformersEngine(*tiny, continuous=True, max_batch_size=1, attention=kernel, matmul=native)
    alone = eng.generate([short_p], max_new_tokens=8, temperature=0.0)[0]
    after = eng.generate([long_p, short_p], max_new_tokens=[12, 8], temperature=0.0)[1]  # the long row's slot
    assert after.token_ids == alone.token_ids and after.logprobs == alone.logprobs


def test_frozen_layers_training_forwards_use_the_kernel_and_gradients_are_unchanged(kernel, native):
    """A training forward within ``training_forwards`` multiplies the frozen layers by the kernel's copies
    (no gradient flows below the trained layers): the loss and every gradient are PyTorch's."""
    if torch.bfloat16 not in kernel.matmul:
        pytest.skip("no AVX512-BF16 here")
    model, tok = load_model("tiny-random", dtype="bfloat16", trainable="top_layers:1", seed=0)
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(7))
    am, rm = torch.ones_like(ids), torch.ones_like(ids)

    def loss_and_grads(ctx):
        model.zero_grad(set_to_none=True)
        with ctx:
            lp = sequence_logprobs(model, ids, am, rm, temperature=1.0)
        loss = -lp.sum()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    eng = TransformersEngine(model, tok, continuous=True, matmul=native)
    calls = []
    orig = NativeWeight.linear

    def counting(self, x, bias=None):
        calls.append(x.shape)
        return orig(self, x, bias)

    base_loss, base = loss_and_grads(TransformersEngine(model, tok).training_forwards(model))
    NativeWeight.linear = counting
    try:
        loss, grads = loss_and_grads(eng.training_forwards(model))
    finally:
        NativeWeight.linear = orig
    assert calls  # the frozen bottom layer went through the kernel
    assert torch.allclose(loss.float(), base_loss.float(), rtol=2e-2)
    for n in base:
        assert torch.allclose(grads[n].float(), base[n].float(), atol=5e-2, rtol=5e-2), n


def test_auto_takes_the_kernel_per_dtype_where_it_measures_faster_and_caches_it(kernel, tmp_path):
    timing = MatmulTiming({"float32": 1.0, "bfloat16": 1.0}, {"float32": 1.2, "bfloat16": 0.5})
    calls = []

    def bench(k):
        calls.append(k)
        return timing

    c = resolve("auto", cache=tmp_path / "m.json", kernel_dir=kernel.path.parent, bench=bench)
    want = {torch.bfloat16} & set(kernel.matmul)
    assert c.dtypes == want and c.enabled == bool(want) and not c.cached and len(calls) == 1
    assert "float32 1.20x" in c.reason
    again = resolve("auto", cache=tmp_path / "m.json", kernel_dir=kernel.path.parent, bench=bench)
    assert again.cached and again.dtypes == want and len(calls) == 1 and "cached" in again.log_line()
    if want:
        assert again.pack(torch.zeros(32, 8)) is None and isinstance(again.pack(torch.zeros(32, 8, dtype=torch.bfloat16)),
                                                                       NativeWeight)
    slower = resolve("auto", cache=False, kernel_dir=kernel.path.parent,
                     bench=lambda k: MatmulTiming({"float32": 1.0}, {"float32": 1.0}))
    assert not slower.enabled and slower.log_line().startswith("decode matmuls: PyTorch")
    d = c.to_dict()
    assert d["torch_s"] == timing.torch_s and d["requested"] == "auto"


def test_explicit_modes_and_a_machine_without_a_compiler(kernel, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="rollout.decode_matmul='fast'"):
        resolve("fast")
    assert not resolve("torch").enabled
    on = resolve("native", kernel_dir=kernel.path.parent)
    assert on.enabled and on.dtypes == frozenset(kernel.matmul)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(NA, "_LOADED", {})
    off = resolve("auto", cache=False, kernel_dir=tmp_path / "k")
    assert not off.enabled and "did not build" in off.reason
    with pytest.raises(NA.BuildError, match="rollout.decode_matmul=native: the kernel did not build"):
        resolve("native", kernel_dir=tmp_path / "k")


def test_a_kernel_that_disagrees_is_not_taken(kernel, monkeypatch):
    monkeypatch.setattr(NM, "check", lambda k: 0.5)
    off = resolve("auto", cache=False, kernel_dir=kernel.path.parent, bench=lambda k: pytest.fail("measured"))
    assert not off.enabled and "differs from PyTorch by 0.5" in off.reason
    with pytest.raises(NA.BuildError, match="differs from PyTorch"):
        resolve("native", kernel_dir=kernel.path.parent)


def test_measure_times_both_interleaved_per_dtype(kernel):
    ticks = iter(range(10_000))
    order = []

    def work(dtype):
        return lambda native: order.append((dtype, native))

    t = NM.measure(kernel, repeats=2, clock=lambda: next(ticks), work=work)
    assert set(t.torch_s) == {NM._NAMES[d] for d in kernel.matmul}
    assert all(v == 1 for v in (*t.torch_s.values(), *t.native_s.values()))
    per = [x for x in order if x[0] == torch.float32]
    assert per == [(torch.float32, False), (torch.float32, True)] * 3  # warm-up, then interleaved
    assert NM.check(kernel) <= NM.AGREE_RTOL


def test_a_run_builds_its_engines_with_the_resolved_matmuls(tmp_path):
    from reflrl.train.setup import build_components

    for mode in ("native", "torch"):
        cfg = tiny_cfg(tmp_path / mode, **{"rollout.decode_matmul": mode})
        comp = build_components(cfg, [], env_factory=lambda *_a: ([], None))
        on = mode == "native"
        assert comp.decode_matmul.enabled == on
        for engine in (comp.engine, comp.eval_engine):
            assert (engine.matmul is not None) == on
            assert isinstance(engine.head()[0], NativeWeight) == on


def test_reflrl_evals_local_backend_multiplies_with_the_resolved_matmuls_and_says_so(tmp_path, monkeypatch):
    from reflrl.eval.backends import Decoding, LocalBackend

    monkeypatch.setenv("REFLRL_CACHE", str(tmp_path))
    be = LocalBackend("tiny-random", dtype="float32", batch_size=2)
    choice = be.decode_matmul
    assert choice.requested == "auto" and choice.timing is not None and (tmp_path / "matmul.json").is_file()
    names = sorted(str(d).removeprefix("torch.") for d in choice.dtypes)
    assert be.describe()["decode_matmul"] == ("native: " + ", ".join(names) if choice.enabled else "torch")
    assert (be.engine.matmul is not None) == choice.enabled
    outs = be.chat([[{"role": "user", "content": "hi"}]] * 3, Decoding(temperature=0.0, max_new_tokens=4), seed=0)
    assert len(outs) == 3
