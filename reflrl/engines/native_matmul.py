"""The generation's matmuls in a small C kernel built on the user's machine: ``rollout.decode_matmul``.

A decode step multiplies a few rows (the live samples) by every weight matrix of the model. PyTorch's
CPU products are made for large operands: for a few rows they spend much of their time re-laying the
weight out and dispatching, not reading it. On a 2-core AMD EPYC with AVX512-BF16 the products of one
decode step of SmolLM2-135M (bfloat16 frozen layers, float32 trained layers and head) took 23 ms for one
row and 32 ms for 16, where reading the weights once takes about 8 ms. ``decode_matmul.c`` multiplies by
weights laid out once for it (:func:`pack`: blocks of 16 outputs, k-pairs interleaved for bfloat16), each
block read from memory once per call and used for every row: 9 and 20 ms for that step. At prefill and
training sizes it runs about as fast as PyTorch's (oneDNN's) products, so the prefills and the frozen
layers' training forwards multiply by the same copies (nothing is laid out twice).

* float32 runs on AVX2 or AVX-512 (GCC's vector extensions); bfloat16 needs AVX512-BF16 (its dot-product
  instruction), built only where the compiler targets it. Each output is a float32 sum over the inputs in
  a fixed order (bfloat16 outputs rounded once), so a row's result does not depend on the other rows of
  the call or the thread count (tested bit for bit), and the products agree with PyTorch's to float
  rounding (the summation order differs): sampled log-probs agree with the trainer's (tested).
* The kernel is built with the decode attention's (:func:`reflrl.engines.native_attention.build`: ``cc
  -O3 -march=native``, cached per source, compiler and CPU model).
* ``auto`` (the default) takes it for each dtype the kernel has where it agrees with PyTorch on a random
  case and a sub-second measurement at the decode shapes (:func:`measure`: 16 rows through a pool of
  MLP-sized matrices, and a head-sized one in float32; against PyTorch's ``F.linear``, and oneDNN's packed
  float32 products where this torch has them; interleaved, each keeping its fastest repeat) finds it
  faster by at least 5%; cached per CPU model (``<cache>/matmul.json``). ``native`` takes it for every
  dtype it has; ``torch`` never does. Where it is taken it replaces ``rollout.packed_weights``'s copies.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import native_attention as _native
from . import packed as _packed

MODES = ("auto", "native", "torch")
PICK_BELOW = 0.95  # auto takes the kernel for a dtype when its time / PyTorch's at the decode shapes is below this
AGREE_RTOL = 1e-2  # largest difference from F.linear on the check's random case, relative to its largest output
BLOCK, TASK = 16, 32  # outputs per block of the layout; outputs per task (the layout pads N to a multiple)
ROWS = 16  # rows of the measurement (a rollout group)
_POOL = 8  # distinct matrices per shape, so the weights stream from memory as a decode step's do
_SHAPES = ((576, 3072), (1536, 576))  # (in, out): SmolLM2-135M's gate/up and down projections
_HEAD = (576, 49152)
_CACHE_VERSION = 1
_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


class NativeWeight:
    """A weight [out, in] laid out for the kernel (:func:`pack`): ``linear(x, bias)`` is ``F.linear(x,
    weight, bias)`` for ``x`` of the weight's dtype, any leading dimensions."""

    __slots__ = ("data", "out_features", "in_features", "dtype", "_fn")

    def __init__(self, data: torch.Tensor, out_features: int, in_features: int, fn: Any) -> None:
        self.data, self.out_features, self.in_features, self.dtype, self._fn = data, out_features, in_features, \
            data.dtype, fn

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise TypeError(f"native matmul: input {x.dtype} against a {self.dtype} weight")
        lead = x.shape[:-1]
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1 or x2.shape[-1] != self.in_features:
            if x2.shape[-1] != self.in_features:
                raise ValueError(f"native matmul: input {tuple(x.shape)} against w[{self.out_features}, "
                                 f"{self.in_features}]")
            x2 = x2.contiguous()
        m = x2.shape[0]
        y = torch.empty((m, self.out_features), dtype=self.dtype)
        if m:
            b = None if bias is None else bias.detach().to(torch.float32).contiguous()
            rc = self._fn(x2.data_ptr(), x2.stride(0), self.data.data_ptr(), None if b is None else b.data_ptr(),
                          y.data_ptr(), y.stride(0), m, self.out_features, self.in_features, torch.get_num_threads())
            if rc:
                raise RuntimeError(f"native matmul failed (code {rc}) at x{tuple(x.shape)} "
                                   f"w[{self.out_features}, {self.in_features}] {self.dtype}")
        return y if x.dim() == 2 else y.view(*lead, self.out_features)


def pack(kernel: _native.Kernel, weight: torch.Tensor) -> NativeWeight | None:
    """``weight`` [out, in] laid out for the kernel (a copy), or None where the kernel has no product for its
    dtype or device (or an odd ``in`` for bfloat16)."""
    fn = kernel.matmul.get(weight.dtype)
    if fn is None or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    n, k = weight.shape
    if weight.dtype == torch.bfloat16 and k % 2:
        return None
    with torch.no_grad():
        w = weight.detach()
        pad = -n % TASK
        if pad:
            w = torch.cat([w, w.new_zeros(pad, k)])
        if weight.dtype == torch.bfloat16:  # [N/16, K/2, 16, 2]: a block's 16 outputs for each pair of inputs
            data = w.reshape(-1, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        else:  # [N/16, K, 16]
            data = w.reshape(-1, BLOCK, k).permute(0, 2, 1).contiguous()
    return NativeWeight(data, n, k, fn)


# ---------------------------------------------------------------------------------------------- auto
def check(kernel: _native.Kernel) -> float:
    """The largest difference between the kernel and ``F.linear`` on a random case per dtype it has (an odd
    output count, a bias, rows of one block and of several), relative to the largest output."""
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for dtype in kernel.matmul:
        w = (torch.rand(100, 96, generator=gen) - 0.5).to(dtype)
        b = (torch.rand(100, generator=gen) - 0.5).to(dtype)
        pw = pack(kernel, w)
        for rows in (1, 13):
            x = (torch.rand(rows, 96, generator=gen) - 0.5).to(dtype)
            ref = F.linear(x, w, b).float()
            worst = max(worst, float((pw.linear(x, b).float() - ref).abs().max() / ref.abs().max()))
    return worst


@dataclass(frozen=True)
class MatmulTiming:
    """Seconds of the decode-shape products (:func:`measure`) per dtype: PyTorch's and the kernel's."""

    torch_s: dict[str, float]
    native_s: dict[str, float]

    def ratio(self, dtype: str) -> float:
        t = self.torch_s.get(dtype, 0.0)
        return self.native_s.get(dtype, t) / t if t > 0 else 1.0


class DecodeShapeWork:
    """The products :func:`measure` times for one dtype: :data:`ROWS` rows through :data:`_POOL` matrices of
    each MLP shape (and a head-sized matrix for float32), PyTorch's way (``work(False)``: ``F.linear``, or
    oneDNN's packed copies where this torch packs float32) or the kernel's (``work(True)``)."""

    def __init__(self, kernel: _native.Kernel, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(0)
        shapes = [s for s in _SHAPES for _ in range(_POOL)] + ([_HEAD] if dtype == torch.float32 else [])
        self.items = []  # (x, PyTorch's weight, the kernel's)
        for i, o in shapes:
            w = (torch.rand(o, i, generator=gen) - 0.5).to(dtype)
            x = (torch.rand(ROWS, i, generator=gen) - 0.5).to(dtype)
            onednn = _packed.pack(w) if dtype == torch.float32 else None
            self.items.append((x, w if onednn is None else onednn, pack(kernel, w)))

    def __call__(self, native: bool) -> None:
        for x, w, nw in self.items:
            _packed.dense(x, nw if native else w)


def measure(kernel: _native.Kernel, *, repeats: int = 5, clock: Callable[[], float] = time.perf_counter,
            work: Callable[[torch.dtype], Callable[[bool], None]] | None = None) -> MatmulTiming:
    """PyTorch's products and the kernel's at the decode shapes, for each dtype the kernel has, interleaved,
    the fastest of ``repeats`` each (well under a second on 2 cores); ``clock`` and ``work`` injectable."""
    torch_s: dict[str, float] = {}
    native_s: dict[str, float] = {}
    for dtype in kernel.matmul:
        run = (work or (lambda d: DecodeShapeWork(kernel, d)))(dtype)
        best = _packed.fastest_interleaved({False: lambda: run(False), True: lambda: run(True)}, repeats, clock)
        torch_s[_NAMES[dtype]], native_s[_NAMES[dtype]] = best[False], best[True]
    return MatmulTiming(torch_s, native_s)


@dataclass(frozen=True)
class MatmulChoice:
    """What ``rollout.decode_matmul`` resolved to: the kernel and the dtypes it multiplies (none: PyTorch's
    products), the requested mode, why (one line), the measurement where one was made or cached."""

    requested: str
    kernel: _native.Kernel | None
    dtypes: frozenset = field(default_factory=frozenset)
    reason: str = ""
    timing: MatmulTiming | None = None
    cached: bool = False

    @property
    def enabled(self) -> bool:
        return self.kernel is not None and bool(self.dtypes)

    def pack(self, weight: torch.Tensor) -> NativeWeight | None:
        """``weight`` laid out for the kernel where this choice takes it for its dtype, else None."""
        if not self.enabled or weight.dtype not in self.dtypes:
            return None
        return pack(self.kernel, weight)

    def log_line(self) -> str:
        on = ", ".join(_NAMES[d] for d in sorted(self.dtypes, key=str)) if self.enabled else ""
        return f"decode matmuls: {'native kernel (' + on + ')' if on else 'PyTorch'} ({self.reason})"

    def to_dict(self) -> dict[str, Any]:
        t = self.timing
        return {"requested": self.requested, "enabled": self.enabled, "reason": self.reason, "cached": self.cached,
                "dtypes": sorted(_NAMES[d] for d in self.dtypes),
                "torch_s": None if t is None else t.torch_s, "native_s": None if t is None else t.native_s}


def _cache_file() -> Path:
    from reflrl.paths import cache_root

    return cache_root() / "matmul.json"


def resolve(requested: Any = "auto", *, cache: Path | None | bool = True, kernel_dir: Path | None = None,
            bench: Callable[[_native.Kernel], MatmulTiming] | None = None) -> MatmulChoice:
    """``rollout.decode_matmul`` (``auto``, ``native`` or ``torch``). ``cache``: True = ``<cache>/matmul.json``,
    a path, or False (always measure); ``kernel_dir``: where the kernel is built (default
    ``<cache>/kernels``); ``bench`` is injectable (tests)."""
    mode = str(requested).lower()
    if mode not in MODES:
        raise ValueError(f"rollout.decode_matmul={requested!r}: expected one of {', '.join(MODES)}")
    if mode == "torch":
        return MatmulChoice(mode, None, reason="as configured")
    try:
        kernel = _native.build(kernel_dir)
    except _native.BuildError as e:
        if mode == "native":
            raise _native.BuildError(f"rollout.decode_matmul=native: the kernel did not build: {e}") from e
        return MatmulChoice(mode, None, reason=f"auto: the native kernel did not build ({e})")
    if not kernel.matmul:
        if mode == "native":
            raise _native.BuildError("rollout.decode_matmul=native: this CPU has no vector unit the kernel uses")
        return MatmulChoice(mode, None, reason="auto: this CPU has no vector unit the kernel uses")
    err = check(kernel)
    if err > AGREE_RTOL:
        if mode == "native":
            raise _native.BuildError(f"rollout.decode_matmul=native: the kernel differs from PyTorch by {err:.3g} "
                                     f"(relative) on a random case (more than {AGREE_RTOL})")
        return MatmulChoice(mode, None, reason=f"auto: the native kernel differs from PyTorch by {err:.3g}")
    if mode == "native":
        return MatmulChoice(mode, kernel, frozenset(kernel.matmul), "as configured")
    from reflrl.paths import read_cache_entry, write_cache_entry

    path = _cache_file() if cache is True else (Path(cache) if cache else None)
    key = f"v{_CACHE_VERSION}|{kernel.path.name}|{_native._cpu_key()}"
    hit = None
    if path is not None:
        d = read_cache_entry(path, key)
        try:
            hit = MatmulTiming({k: float(v) for k, v in d["torch_s"].items()},
                               {k: float(v) for k, v in d["native_s"].items()})
        except (ValueError, KeyError, TypeError, AttributeError):
            hit = None
    t = hit if hit is not None else (bench or measure)(kernel)
    if hit is None and path is not None:
        write_cache_entry(path, key, {"torch_s": t.torch_s, "native_s": t.native_s})
    on = frozenset(d for d in kernel.matmul if _NAMES[d] in t.torch_s and t.ratio(_NAMES[d]) < PICK_BELOW)
    ratios = ", ".join(f"{n} {t.ratio(n):.2f}x" for n in sorted(t.torch_s))
    why = f"auto: the native kernel took {ratios} PyTorch's time at the decode shapes{', cached' if hit else ''}"
    return MatmulChoice(mode, kernel if on else None, on, why, t, cached=hit is not None)
