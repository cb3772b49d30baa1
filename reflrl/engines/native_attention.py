"""The decode step's one-token attention in a small C kernel built on the user's machine:
``rollout.decode_attention``.

In a decode step each live row's one new query attends to that row's keys and values. PyTorch's CPU
``scaled_dot_product_attention`` runs its flash kernel over blocks made for long queries; with one query
per row (three query heads per key/value head in SmolLM2) most of its time is per-call and per-block
overhead, not reading the cache: on a 2-core AMD EPYC with AVX512-BF16 it took 0.5-0.7 ms a layer at 32
rows where reading their keys and values takes about 0.15 ms, a third of the decode step. The kernel in
``decode_attention.c`` does that attention directly: per (row, key/value head) one pass over the row's
keys for the scores of its query heads, a softmax, one pass over the values, in float32 whatever the
cache's dtype (float32 or bfloat16), the (row, head) pairs shared among as many threads as PyTorch uses. Each
row reads only its own visible columns (its mask, up to its own width), so idle slots cost nothing and a
row refilled into a slot that held a longer sequence never reads what was left there. A row's result does
not depend on the other rows of the step or the thread count (one thread computes it, in a fixed order).
The same call also rotates the row's queries and key (the rotary embedding) and writes its key and value
to the cache (:meth:`Kernel.rope_attention`), and the layers' RMSNorms run in it too
(:meth:`Kernel.rms_norm`): a few operations per layer where PyTorch dispatches about a dozen, each
product and sum rounded to the storage type as PyTorch's operations round them.

* :func:`build` compiles the sources with the machine's C compiler (``$CC`` or ``cc``; ``-O3
  -march=native``, about a second) into ``<cache>/kernels/``, once per source, compiler and CPU model.
  Its calls share their work among threads of its own (``native_parallel.c``), not OpenMP's: a decode
  step makes a few hundred short calls, and an OpenMP region wakes its sleeping workers at each one
  (reflrl lets OpenMP's threads sleep while they wait, and the decode loop runs in an executor thread),
  which cost tens of microseconds a call; these workers spin for 0.2 ms after a call, then sleep.
* :func:`attention` calls it; :func:`reference` is the same attention through SDPA.
* ``auto`` (the default) takes the kernel where it builds, agrees with SDPA on a random case, and a
  sub-second measurement at a decode shape (32 rows over 256 columns, the two interleaved, each keeping its
  fastest repeat) finds it faster by at least 5%; cached per CPU model (``<cache>/attention.json``).
  ``native`` takes it wherever it builds (an error naming the compiler's message where it does not);
  ``sdpa`` never does. Without a C compiler ``auto`` keeps SDPA and says so.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("decode_attention.c")
# built into one library with the attention: the generation's matmuls (reflrl.engines.native_matmul)
SOURCES = (SOURCE, Path(__file__).with_name("decode_matmul.c"), Path(__file__).with_name("native_parallel.c"))
HEADERS = (Path(__file__).with_name("native_parallel.h"),)  # included by the sources (in the build's hash)
FLAGS = ("-O3", "-march=native", "-pthread", "-fPIC", "-shared", "-std=gnu11",
         # sums may be reordered (vectorised), in an order fixed at compile time: the same for every row
         "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fno-math-errno")
MODES = ("auto", "native", "sdpa")
PICK_BELOW = 0.95  # auto takes the kernel when its time / SDPA's at the decode shape is below this
AGREE_ATOL = 2e-2  # largest difference from SDPA on the check's random case (bfloat16 outputs: 3 bits)
_CACHE_VERSION = 1
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
         ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
         ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int]


_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ROPE_ARGS = [_P, _I64, _P, _P, _I64, _P, _P, _P, _I64, _I64, _P, _I64, _P, _P, _I, _I, _I, _I, _F, _I]
_RMS_ARGS = [_P, _I64, _P, _P, _I, _I, _F, _I]
_MATMUL_ARGS = [_P, _I64, _P, _P, _P, _I64, _I, _I, _I, _I]


class BuildError(RuntimeError):
    """The kernel could not be compiled or loaded here (no compiler, a compiler error, a load error)."""


class Kernel:
    """The built kernel (:func:`build`): :meth:`__call__` runs it."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        self._fn, self._rope, self._rms = {}, {}, {}
        for dtype, tag in _DTYPES.items():
            for table, name, args in ((self._fn, "decode_attention", _ARGS),
                                      (self._rope, "decode_rope_attention", _ROPE_ARGS),
                                      (self._rms, "rms_norm", _RMS_ARGS)):
                fn = getattr(lib, f"reflrl_{name}_{tag}")
                fn.argtypes, fn.restype = args, ctypes.c_int
                table[dtype] = fn
        #: the matmul entry points (reflrl.engines.native_matmul), by dtype, where this CPU has them built
        self.matmul: dict[torch.dtype, Any] = {}
        support = lib.reflrl_matmul_support()
        for bit, (dtype, tag) in ((1, (torch.float32, "f32")), (2, (torch.bfloat16, "bf16"))):
            fn = getattr(lib, f"reflrl_matmul_{tag}")
            fn.argtypes, fn.restype = _MATMUL_ARGS, ctypes.c_int
            if support & bit:
                self.matmul[dtype] = fn

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, width: torch.Tensor,
                 scale: float) -> torch.Tensor:
        """Attention of ``q`` [B, H, G, D] over ``k``, ``v`` [B, H, >=W, D] (views of the cache's buffers;
        the last dimension contiguous, G x D of q contiguous), ``mask`` [B, >=W] bool (True = attend),
        ``width`` [B] int32 (row b reads columns < width[b]; 0: an idle row, zeros out). Returns [B, H, G, D]."""
        b, h, g, d = q.shape
        fn = self._fn.get(q.dtype)
        if fn is None or k.dtype != q.dtype or v.dtype != q.dtype:
            raise TypeError(f"decode attention kernel: q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype}; "
                            f"expected one of {sorted(map(str, _DTYPES))} for all three")
        if q.stride(3) != 1 or q.stride(2) != d or k.stride() != v.stride() or k.stride(3) != 1 or k.stride(2) != d:
            raise ValueError(f"decode attention kernel: layouts q{tuple(q.stride())} k{tuple(k.stride())} "
                             f"v{tuple(v.stride())} (the head dimension must be contiguous)")
        if mask.dtype != torch.bool or mask.stride(-1) != 1 or width.dtype != torch.int32 or not width.is_contiguous():
            raise ValueError("decode attention kernel: mask must be bool [B, W] with contiguous columns and "
                             "width int32 [B] contiguous")
        if len(width) != b or mask.shape[0] != b or k.shape[0] != b or k.shape[1] != h:
            raise ValueError(f"decode attention kernel: shapes q{tuple(q.shape)} k{tuple(k.shape)} "
                             f"mask{tuple(mask.shape)} width{tuple(width.shape)} do not match")
        out = torch.empty((b, h, g, d), dtype=q.dtype)
        rc = fn(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1),
                mask.data_ptr(), mask.stride(0), width.data_ptr(), out.data_ptr(), b, h, g, d, float(scale),
                torch.get_num_threads())
        if rc:
            raise RuntimeError(f"decode attention kernel failed (code {rc}: "
                               f"{'unsupported head shape' if rc == 1 else 'out of memory'}) at q{tuple(q.shape)}")
        return out


    def rope_attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, col: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, width: torch.Tensor, heads: int,
                       scale: float) -> torch.Tensor:
        """The decode step's rotary embedding, cache write and attention in one call: ``qkv`` [B, (heads +
        2 x kv heads) x D] (the q/k/v projection's output, rows contiguous), ``cos``/``sin`` [B, D] (the
        rows' rotary angles, in qkv's dtype), ``col`` [B] int64 (the cache column each row writes); ``k``,
        ``v``, ``mask``, ``width`` as for :meth:`__call__` (the written column inside each live row's width).
        Each live row's rotated key and its value are written to ``k``/``v`` at its column; idle rows
        (width 0) write nothing. Returns the attention [B, kv heads, heads / kv heads, D]."""
        b, hkv, d = qkv.shape[0], k.shape[1], k.shape[3]
        g = heads // hkv
        fn = self._rope.get(qkv.dtype)
        if fn is None or not (qkv.dtype == cos.dtype == sin.dtype == k.dtype == v.dtype):
            raise TypeError(f"decode attention kernel: qkv/cos/sin/k/v dtypes {qkv.dtype}/{cos.dtype}/{sin.dtype}/"
                            f"{k.dtype}/{v.dtype}; expected one of {sorted(map(str, _DTYPES))} for all")
        if qkv.dim() != 2 or qkv.shape[1] != (heads + 2 * hkv) * d or qkv.stride(1) != 1 or heads % hkv \
                or cos.shape != (b, d) or sin.stride() != cos.stride() or cos.stride(1) != 1:
            raise ValueError(f"decode attention kernel: qkv{tuple(qkv.shape)} cos{tuple(cos.shape)} for {heads} "
                             f"heads over k{tuple(k.shape)}")
        if k.stride() != v.stride() or k.stride(3) != 1 or k.stride(2) != d or k.shape[0] != b:
            raise ValueError(f"decode attention kernel: layouts k{tuple(k.stride())} v{tuple(v.stride())}")
        if mask.dtype != torch.bool or mask.stride(-1) != 1 or width.dtype != torch.int32 or not width.is_contiguous() \
                or col.dtype != torch.int64 or not col.is_contiguous() or len(col) != b or len(width) != b:
            raise ValueError("decode attention kernel: mask bool [B, W], width int32 [B], col int64 [B] expected")
        out = torch.empty((b, hkv, g, d), dtype=qkv.dtype)
        rc = fn(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), col.data_ptr(),
                k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), mask.data_ptr(), mask.stride(0),
                width.data_ptr(), out.data_ptr(), b, hkv, g, d, float(scale), torch.get_num_threads())
        if rc:
            raise RuntimeError(f"decode attention kernel failed (code {rc}) at qkv{tuple(qkv.shape)}")
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """transformers' RMSNorm of the rows of ``x`` [B, N] (float32 statistics, cast back, scaled by
        ``weight``), or None where the kernel does not take these inputs (other dtypes, layouts)."""
        fn = self._rms.get(x.dtype)
        if fn is None or weight.dtype != x.dtype or x.dim() != 2 or x.stride(1) != 1 or not weight.is_contiguous() \
                or weight.shape != (x.shape[1],):
            return None
        out = torch.empty(x.shape, dtype=x.dtype)
        fn(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], float(eps),
           torch.get_num_threads())
        return out


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, width: torch.Tensor,
              scale: float) -> torch.Tensor:
    """What :class:`Kernel` computes, through SDPA (row by row where widths differ; idle rows zero)."""
    out = q.new_zeros(q.shape)
    for i, w in enumerate(width.tolist()):
        if w > 0:
            out[i: i + 1] = F.scaled_dot_product_attention(q[i: i + 1], k[i: i + 1, :, :w], v[i: i + 1, :, :w],
                                                           attn_mask=mask[i: i + 1, None, None, :w], scale=scale)
    return out


# ---------------------------------------------------------------------------------------------- build
def compiler() -> str | None:
    """The C compiler :func:`build` uses: ``$CC``, else ``cc`` or ``gcc`` on the PATH; None without one."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or cc
    return shutil.which("cc") or shutil.which("gcc")


def _cpu_key() -> str:
    from reflrl.precision import _cache_key as precision_key, cpu_features

    return precision_key(cpu_features())


def _tag(cc: str) -> str:
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.read_bytes())
    h.update(" ".join(FLAGS).encode())
    h.update(cc.encode())
    h.update(_cpu_key().encode())
    return h.hexdigest()[:16]


_LOADED: dict[str, Kernel] = {}


def build(cache_dir: Path | None = None) -> Kernel:
    """The kernel, compiled for this machine into ``cache_dir`` (default ``<cache>/kernels``) unless already
    there, and loaded once per process. Raises :class:`BuildError` naming what failed."""
    cc = compiler()
    if cc is None:
        raise BuildError("no C compiler (set CC, or install gcc)")
    if cache_dir is None:
        from reflrl.paths import cache_root

        cache_dir = cache_root() / "kernels"
    path = Path(cache_dir) / f"decode_attention-{_tag(cc)}.so"
    key = str(path)
    if key in _LOADED:
        return _LOADED[key]
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            try:
                res = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", str(out), "-lm"], capture_output=True,
                                     text=True, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise BuildError(f"{cc}: {e}") from e
            if res.returncode != 0:
                last = (res.stderr.strip().splitlines() or ["(no message)"])[-1]
                raise BuildError(f"{cc} exited with {res.returncode}: {last}")
            os.replace(out, path)  # atomic: a concurrent build leaves one whole file
    try:
        kernel = Kernel(ctypes.CDLL(str(path)), path)
    except (OSError, AttributeError) as e:
        raise BuildError(f"loading {path.name}: {e}") from e
    _LOADED[key] = kernel
    return kernel


# ---------------------------------------------------------------------------------------------- auto
def sample_case(rows: int = 32, width: int = 256, dtype: torch.dtype = torch.bfloat16, heads: int = 3,
                groups: int = 3, dim: int = 64, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A decode step's attention inputs: cache buffers a little wider than the rows need, rows of
    different lengths (a quarter of the widest down to the widest), one idle row, the mask of each row's
    own columns. Returns (q, k, v, mask, width)."""
    gen = torch.Generator().manual_seed(seed)
    cols = width + 16
    qk = torch.randn(rows, heads * groups + heads, 1, dim, generator=gen).to(dtype)
    q = qk[:, : heads * groups].reshape(rows, heads, groups, dim)
    k = torch.randn(rows, heads, cols, dim, generator=gen).to(dtype)
    v = torch.randn(rows, heads, cols, dim, generator=gen).to(dtype)
    lens = torch.randint(max(1, width // 4), width + 1, (rows,), generator=gen)
    lens[rows // 2] = 0
    mask = torch.arange(cols)[None, :] < lens[:, None]
    return q, k, v, mask, lens.to(torch.int32)


@dataclass(frozen=True)
class AttentionTiming:
    """Seconds of one decode-shape attention call (:func:`measure`), SDPA and the kernel."""

    sdpa_s: float
    native_s: float

    @property
    def ratio(self) -> float:
        return self.native_s / self.sdpa_s if self.sdpa_s > 0 else 1.0


def measure(kernel: Kernel, *, repeats: int = 5, clock: Callable[[], float] = time.perf_counter) -> AttentionTiming:
    """SDPA (as the decode step calls it: the rows at once, over the widest row's columns, the mask hiding
    the rest) against the kernel on :func:`sample_case`, 30 calls per timing (a model's layers), interleaved,
    the fastest of ``repeats`` each."""
    q, k, v, mask, width = sample_case()
    w = int(width.max())
    am = mask[:, None, None, :w]

    def sdpa() -> None:
        for _ in range(30):
            F.scaled_dot_product_attention(q, k[:, :, :w], v[:, :, :w], attn_mask=am, scale=0.125)

    def native() -> None:
        for _ in range(30):
            kernel(q, k, v, mask, width, 0.125)

    from .packed import fastest_interleaved

    best = fastest_interleaved({"sdpa": sdpa, "native": native}, repeats, clock)
    return AttentionTiming(best["sdpa"], best["native"])


def check(kernel: Kernel) -> float:
    """The largest difference between the kernel and :func:`reference` on :func:`sample_case` in float32 and
    bfloat16 (outputs compared in float32)."""
    worst = 0.0
    for dtype in _DTYPES:
        case = sample_case(rows=8, width=96, dtype=dtype, seed=1)
        a, b = kernel(*case, 0.125), reference(*case, 0.125)
        worst = max(worst, float((a.float() - b.float()).abs().max()))
    return worst


@dataclass(frozen=True)
class AttentionChoice:
    """What ``rollout.decode_attention`` resolved to: the kernel (None: SDPA), the requested mode, why (one
    line), the measurement where one was made or cached."""

    requested: str
    kernel: Kernel | None
    reason: str
    timing: AttentionTiming | None = None
    cached: bool = False

    @property
    def enabled(self) -> bool:
        return self.kernel is not None

    def log_line(self) -> str:
        return f"decode attention: {'native kernel' if self.enabled else 'SDPA'} ({self.reason})"

    def to_dict(self) -> dict[str, Any]:
        t = self.timing
        return {"requested": self.requested, "enabled": self.enabled, "reason": self.reason, "cached": self.cached,
                "sdpa_s": None if t is None else t.sdpa_s, "native_s": None if t is None else t.native_s}


def _cache_file() -> Path:
    from reflrl.paths import cache_root

    return cache_root() / "attention.json"


def resolve(requested: Any = "auto", *, cache: Path | None | bool = True, kernel_dir: Path | None = None,
            bench: Callable[[Kernel], AttentionTiming] | None = None) -> AttentionChoice:
    """``rollout.decode_attention`` (``auto``, ``native`` or ``sdpa``). ``cache``: True =
    ``<cache>/attention.json``, a path, or False (always measure); ``kernel_dir``: where the kernel is built
    (default ``<cache>/kernels``); ``bench`` is injectable (tests)."""
    mode = str(requested).lower()
    if mode not in MODES:
        raise ValueError(f"rollout.decode_attention={requested!r}: expected one of {', '.join(MODES)}")
    if mode == "sdpa":
        return AttentionChoice(mode, None, "as configured")
    try:
        kernel = build(kernel_dir)
    except BuildError as e:
        if mode == "native":
            raise BuildError(f"rollout.decode_attention=native: the kernel did not build: {e}") from e
        return AttentionChoice(mode, None, f"auto: the native kernel did not build ({e})")
    err = check(kernel)
    if err > AGREE_ATOL:
        if mode == "native":
            raise BuildError(f"rollout.decode_attention=native: the kernel differs from SDPA by {err:.3g} on a "
                             f"random case (more than {AGREE_ATOL})")
        return AttentionChoice(mode, None, f"auto: the native kernel differs from SDPA by {err:.3g}")
    if mode == "native":
        return AttentionChoice(mode, kernel, "as configured")
    from reflrl.paths import read_cache_entry, write_cache_entry

    path = _cache_file() if cache is True else (Path(cache) if cache else None)
    key = f"v{_CACHE_VERSION}|{kernel.path.name}|{_cpu_key()}"
    hit = None
    if path is not None:
        d = read_cache_entry(path, key)
        try:
            hit = AttentionTiming(float(d["sdpa_s"]), float(d["native_s"]))
        except (ValueError, KeyError, TypeError):
            hit = None
    t = hit if hit is not None else (bench or measure)(kernel)
    if hit is None and path is not None:
        write_cache_entry(path, key, {"sdpa_s": t.sdpa_s, "native_s": t.native_s})
    on = t.ratio < PICK_BELOW
    why = f"auto: the native kernel took {t.ratio:.2f}x SDPA's time at a decode shape{', cached' if hit else ''}"
    return AttentionChoice(mode, kernel if on else None, why, t, cached=hit is not None)
