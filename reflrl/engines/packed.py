"""Decode matmuls through oneDNN's pre-packed weights: ``rollout.packed_weights``.

A decode step multiplies a few rows (the live samples) by every weight matrix of the model. PyTorch's
``F.linear`` hands that to the BLAS library it was built with (MKL in the CPU wheels), which re-lays the
weight out on every call, and on some CPUs picks a slow kernel for such skinny products: on a 2-core AMD
EPYC (AVX2) the output head, [16 rows, 576] x [576, 49,152], ran at 30 GFLOP/s and a 3,072-wide MLP
product at 37, where oneDNN on weights packed once for its kernel ran them at 100+ (2-3.5x; the same
oneDNN kernels PyTorch's own compiler uses for frozen CPU weights). On large products the two were
about equal on that machine; on a 2-core AMD EPYC with AVX512-BF16, whose MKL takes a generic path for
float32, oneDNN ran prefill-sized products at about 500 GFLOP/s against MKL's 210, so prefills multiply
by the same packed matrices (:func:`reflrl.engines.lean_decode.packed_prefill`); the update keeps
``F.linear`` (autograd).

* :func:`pack` makes the packed copy of a float32 weight (``torch.ops.mkldnn._reorder_linear_weight``,
  for about :data:`ROWS_HINT` rows); :func:`dense` multiplies by a packed or a plain weight. The decode
  step's weight cache (:class:`reflrl.engines.lean_decode.FusedWeights`) packs the concatenated q/k/v and
  gate/up matrices in place of their plain copies, so packing adds only the output projections, the MLP's
  down projection and the output head (about 0.26 GB for SmolLM2-135M).
* Only float32 weights are packed: bfloat16 needs the CPU's bfloat16 support in oneDNN (refused on AVX2),
  and ``F.linear`` already hands bfloat16 products to oneDNN; those layers keep ``F.linear``. A model
  computing in bfloat16 still multiplies by float32 matrices in its decode step: the output head (always
  float32, so that sampled log-probs agree with the trainer's) and the trainable layers' float32 master
  weights (``model.trainable``). Those are packed: on a 2-core AMD EPYC with AVX512-BF16 that took a
  decode step of 32 rows from 84 to 58 ms (the head alone from 19 to 5 ms).
* The two give the same products up to float rounding (the summation order differs; tests check the
  decode step against the transformers forward with packing on).
* ``auto`` (the default) packs where a sub-second measurement at the decode shapes (:func:`measure`:
  16 rows through a pool of MLP-sized matrices and one head-sized one, the two ways interleaved, each
  keeping its fastest repeat) finds packing faster by at least 5%; the result is cached per CPU model
  next to the precision's (``<cache>/packed.json``), so it is measured once per CPU model and the load of
  one moment does not decide. ``true`` packs wherever it can; ``false`` never does.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

ROWS_HINT = 16  # rows a packed layout is made for (rollouts: a group of 8-16; it serves 1-64 rows well)
PICK_BELOW = 0.95  # auto packs when packed time / plain time at the decode shapes is below this
MODES = ("auto", "true", "false")
_SHAPES = ((576, 1536), (576, 3072), (576, 49152))  # (in, out): SmolLM2-135M's MLP widths and its head
_POOL = 8  # distinct matrices per MLP shape, so the weights stream from memory as a decode step's do
_CACHE_VERSION = 1


def supported() -> bool:
    """Whether this torch build can pack weights for oneDNN on this machine."""
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def pack(weight: torch.Tensor, rows: int = ROWS_HINT) -> torch.Tensor | None:
    """oneDNN's packed copy of a float32 CPU ``weight`` [out, in] for :func:`dense`, or None where it
    cannot be packed (another dtype or device, or no oneDNN)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not supported():
        return None
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows)


def dense(x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a plain weight, one from :func:`pack` (x in float32 then), or one laid
    out for the native kernel (:class:`reflrl.engines.native_matmul.NativeWeight`: x in its dtype)."""
    if not isinstance(weight, torch.Tensor):
        return weight.linear(x, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


# ---------------------------------------------------------------------------------------------- auto
@dataclass(frozen=True)
class PackedTiming:
    """Seconds of the decode-shape work (:func:`measure`), plain ``F.linear`` and packed."""

    plain_s: float
    packed_s: float

    @property
    def ratio(self) -> float:
        return self.packed_s / self.plain_s if self.plain_s > 0 else 1.0


@dataclass(frozen=True)
class PackedChoice:
    """What ``rollout.packed_weights`` resolved to: ``enabled``, the requested mode, why (one line),
    the measurement where one was made or cached."""

    requested: str
    enabled: bool
    reason: str
    timing: PackedTiming | None = None
    cached: bool = False

    def log_line(self) -> str:
        return f"decode weights: {'packed for oneDNN' if self.enabled else 'plain'} ({self.reason})"

    def to_dict(self) -> dict[str, Any]:
        t = self.timing
        return {"requested": self.requested, "enabled": self.enabled, "reason": self.reason, "cached": self.cached,
                "plain_s": None if t is None else t.plain_s, "packed_s": None if t is None else t.packed_s}


class DecodeShapeWork:
    """The products :func:`measure` times: ``rows`` rows through :data:`_POOL` matrices of each MLP shape
    and one head-sized matrix, plain (``work(False)``) or packed (``work(True)``)."""

    def __init__(self, rows: int = ROWS_HINT) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.rand(rows, _SHAPES[0][0], generator=gen) - 0.5
        self.plain = [torch.rand(o, i, generator=gen) - 0.5 for i, o in _SHAPES[:-1] for _ in range(_POOL)]
        self.plain.append(torch.rand(_SHAPES[-1][1], _SHAPES[-1][0], generator=gen) - 0.5)
        self.packed = [pack(w) for w in self.plain]

    def __call__(self, packed: bool) -> None:
        for w in (self.packed if packed else self.plain):
            dense(self.x, w)


def fastest_interleaved(runs: dict[Any, Callable[[], None]], repeats: int = 5,
                        clock: Callable[[], float] = time.perf_counter) -> dict[Any, float]:
    """Each of ``runs`` once to warm up (kernel selection, page faults), then ``repeats`` rounds of all of them
    in turn; the fastest time of each (what the load of one moment does not decide). Shared by the
    measurements that choose a kernel (packing here, the native attention and matmuls)."""
    for fn in runs.values():
        fn()
    best: dict[Any, float] = {}
    for _ in range(max(1, repeats)):
        for key, fn in runs.items():
            t0 = clock()
            fn()
            s = clock() - t0
            best[key] = min(s, best.get(key, s))
    return best


def measure(*, repeats: int = 5, clock: Callable[[], float] = time.perf_counter,
            work: Callable[[bool], None] | None = None) -> PackedTiming:
    """Plain and packed at the decode shapes, interleaved, the fastest of ``repeats`` each (well under a
    second on 2 cores); ``clock`` and ``work`` are injectable."""
    run = work if work is not None else DecodeShapeWork()
    best = fastest_interleaved({False: lambda: run(False), True: lambda: run(True)}, repeats, clock)
    return PackedTiming(best[False], best[True])


def _cache_file() -> Path:
    from reflrl.paths import cache_root

    return cache_root() / "packed.json"


def _cache_key() -> str:
    from reflrl.precision import _cache_key as precision_key, cpu_features

    return f"v{_CACHE_VERSION}|{precision_key(cpu_features())}"


def _read(path: Path, key: str) -> PackedTiming | None:
    from reflrl.paths import read_cache_entry

    d = read_cache_entry(path, key)
    try:
        return PackedTiming(float(d["plain_s"]), float(d["packed_s"]))
    except (ValueError, KeyError, TypeError):
        return None


def _store(path: Path, key: str, t: PackedTiming) -> None:
    from reflrl.paths import write_cache_entry

    write_cache_entry(path, key, {"plain_s": t.plain_s, "packed_s": t.packed_s})


def resolve(requested: Any = "auto", *, cache: Path | None | bool = True,
            bench: Callable[[], PackedTiming] | None = None, available: bool | None = None) -> PackedChoice:
    """``rollout.packed_weights`` (``auto``, true or false): whether the decode step packs its float32
    matrices (all of a float32 model's; the head and any float32 trainable layers of a bfloat16 one).
    ``cache``: True = ``<cache>/packed.json``, a path, or False (always measure); ``bench`` /
    ``available`` are injectable (tests)."""
    mode = str(requested).lower()
    if mode not in MODES:
        raise ValueError(f"rollout.packed_weights={requested!r}: expected one of {', '.join(MODES)}")
    ok = supported() if available is None else available
    if mode == "false":
        return PackedChoice(mode, False, "as configured")
    if not ok:
        return PackedChoice(mode, False, "oneDNN weight packing is not available in this torch build")
    if mode == "true":
        return PackedChoice(mode, True, "as configured")
    path = _cache_file() if cache is True else (Path(cache) if cache else None)
    key = _cache_key() if path is not None else ""
    hit = _read(path, key) if path is not None else None
    t = hit if hit is not None else (bench or measure)()
    if hit is None and path is not None:
        _store(path, key, t)
    on = t.ratio < PICK_BELOW
    why = f"auto: packed {t.ratio:.2f}x the plain time at the decode shapes{', cached' if hit else ''}"
    return PackedChoice(mode, on, why, t, cached=hit is not None)
