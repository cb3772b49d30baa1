"""Which precision to compute in on this machine: ``model.dtype: auto`` and its log line.

bfloat16 halves memory traffic and, on CPUs with native bfloat16 arithmetic (x86 AMX, AVX512-BF16;
Arm's BF16 extension), can run a 135M-parameter model about twice as fast as float32 (AMX). Native
is not always faster: an AVX512-BF16 Xeon without AMX ran the recipe 1.2-1.4x faster in float32. On
CPUs without it (AVX2-only x86: AMD Zen 2/3, Intel consumer chips since Alder Lake, many cloud VMs)
PyTorch emulates bfloat16: a 256x576x1536 matmul measured 43x slower than float32 on a 2-core AMD
EPYC (1.2 against 51.5 GFLOP/s). So "auto" takes the faster of the two where it can be faster:

1. capability check (:func:`cpu_features`): without AVX512-BF16 or AMX on x86, or the ``bf16``
   feature on Arm, bfloat16 is emulated: float32, nothing measured;
2. otherwise a sub-second measurement (:func:`measure_precisions`) of both precisions at the two
   shapes a run spends its time in: a decode step (:data:`DECODE_SHAPE`, 16 rows through 16 distinct
   weight matrices, 57 MB in float32, more than most L3 caches, so the weights stream from memory as
   a decode step's do) and an update / prefill micro-batch (:data:`UPDATE_SHAPE`, 2048 rows). The
   runs are interleaved (bfloat16, float32, bfloat16, float32, ...) and each side keeps its fastest:
   a busy moment slows one repeat, not a side, so the load does not pick the precision;
3. the rule (:func:`decide_dtype`): the two shapes' bfloat16/float32 time ratios weighed by where a
   run spends its time, :data:`DECODE_WEIGHT` (0.7) decode -- in the default recipe's main job
   (docs/results.md: rollouts 344 s and evaluations 209 s, the warm-up 207 s and updates 66 s)
   generation, mostly decode steps, took two thirds and forward+backward the rest. A switch to
   bfloat16 changes a run's time by about that weighted ratio; bfloat16 is taken when it is below
   :data:`BF16_PICK_BELOW` (0.95): within 5% the two are equally fast and float32 (more exact) is kept.

The measurement is cached per CPU model, capability, native-bfloat16 flag and torch version in
``<cache>/precision.json`` (``reflrl.paths.cache_root``): runs on the same CPU model measure once
and decide the same, whatever their thread count or the load of the moment. An explicit ``float32``
is taken as is, nothing measured; an explicit ``bfloat16`` is honoured, with a warning giving the
measured slowdown where it is slower than float32 by more than :data:`MAX_BF16_SLOWDOWN` (where
bfloat16 is emulated only a :data:`PROBE_SHAPE` product is measured: an emulated 2048-row one takes
seconds, and few rows hide emulation). Every entry point that loads a model (``reflrl train``,
``reflrl eval``, ``reflrl env demo``, ``python -m reflrl.chat_server``, the scripts) resolves its
dtype here, so they agree; :meth:`DtypeChoice.log_line` is the line they print (what was picked and
the measured ratios), and the run's summary keeps the choice with its measurement.

The probes are injectable (``features=``, ``bench=``; :func:`measure_precisions` takes a ``clock``
and the ``work`` it times), which is how the tests fake an AVX2 or an AVX512-BF16 machine.
"""
from __future__ import annotations

import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

DTYPE_NAMES = ("auto", "float32", "bfloat16")
DECODE_SHAPE = (16, 576, 1536)  # (M, K, N): a decode step's rows through SmolLM2-135M's MLP width
DECODE_POOL = 16  # distinct weight matrices a decode sample goes through (57 MB in float32)
UPDATE_SHAPE = (2048, 576, 1536)  # an update / prefill micro-batch's tokens
PROBE_SHAPE = (256, 576, 1536)  # where bfloat16 is emulated: the one product measured (few rows hide emulation)
DECODE_WEIGHT = 0.7  # a run's share of time at decode-sized matmuls (rollouts, evaluations)
BF16_PICK_BELOW = 0.95  # auto takes bfloat16 when its weighted time ratio is below this
REPEATS = 5  # interleaved repeats per precision and shape; each keeps its fastest
MAX_BF16_SLOWDOWN = 1.1  # bfloat16 time / float32 time above which an explicit bfloat16 gets a warning
_CACHE_VERSION = 3


@dataclass(frozen=True)
class CpuFeatures:
    """What the CPU offers for bfloat16. ``capability``: ``torch.backends.cpu.get_cpu_capability()``
    ("AVX2", "AVX512", "DEFAULT", ...); ``avx512_bf16`` / ``amx``: x86 native bfloat16 instructions;
    ``arm_bf16``: the Arm BF16 extension; ``model``: the CPU's name (cache key, logs)."""

    capability: str
    avx512_bf16: bool = False
    amx: bool = False
    arm_bf16: bool = False
    model: str = ""

    @property
    def native_bf16(self) -> bool:
        return self.avx512_bf16 or self.amx or self.arm_bf16

    def describe(self) -> str:
        """e.g. "AVX2 CPU without native bfloat16" or "AVX512 CPU with AVX512-BF16, AMX"."""
        native = [n for n, ok in (("AVX512-BF16", self.avx512_bf16), ("AMX", self.amx),
                                  ("Arm BF16", self.arm_bf16)) if ok]
        return f"{self.capability} CPU " + (f"with {', '.join(native)}" if native else "without native bfloat16")


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, feature flags) from /proc/cpuinfo ('', empty set where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor() or "", set()
    model, flags = "", set()
    for line in text.splitlines():
        key, _, val = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and not model:
            model = val.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(val.split())
    return model, flags


def cpu_features() -> CpuFeatures:
    """The features of this machine's CPU (torch's own probes on x86, /proc/cpuinfo on Arm)."""
    import torch

    cap = str(torch.backends.cpu.get_cpu_capability())
    model, flags = _cpuinfo()
    probe = getattr(torch, "cpu", None)

    def has(name: str, flag: str) -> bool:
        fn = getattr(probe, name, None)
        if callable(fn):
            try:
                return bool(fn())
            except Exception:  # noqa: BLE001  a probe that fails means "not known to be there"
                pass
        return flag in flags

    machine = platform.machine().lower()
    is_arm = machine in ("aarch64", "arm64")
    return CpuFeatures(
        capability=cap,
        avx512_bf16=(not is_arm) and has("_is_avx512_bf16_supported", "avx512_bf16"),
        amx=(not is_arm) and has("_is_amx_tile_supported", "amx_tile"),
        arm_bf16=is_arm and "bf16" in flags,
        model=model or machine,
    )


def _shape(s: tuple[int, int, int]) -> str:
    return "x".join(map(str, s))


@dataclass(frozen=True)
class PrecisionTiming:
    """The fastest seconds of each precision at the decode and update shapes (module doc, 2.);
    ``emulated``: bfloat16 is emulated on this CPU and only the :data:`PROBE_SHAPE` product was
    measured (its figures stand for both shapes)."""

    bf16_decode: float
    fp32_decode: float
    bf16_update: float
    fp32_update: float
    emulated: bool = False

    @property
    def decode_ratio(self) -> float:
        return self.bf16_decode / max(self.fp32_decode, 1e-12)

    @property
    def update_ratio(self) -> float:
        return self.bf16_update / max(self.fp32_update, 1e-12)

    @property
    def ratio(self) -> float:
        """A run's time in bfloat16 over its time in float32: the shapes' ratios weighed by where a run
        spends its time (:data:`DECODE_WEIGHT`)."""
        return DECODE_WEIGHT * self.decode_ratio + (1 - DECODE_WEIGHT) * self.update_ratio

    def describe(self) -> str:
        """e.g. "bfloat16 took 1.29x float32's time (decode 16x576x1536: 1.31x, update 2048x576x1536: 1.25x;
        weighted 0.7/0.3)"."""
        if self.emulated:
            return f"bfloat16 took {self.ratio:.1f}x float32's time on a {_shape(PROBE_SHAPE)} matmul (emulated)"
        return (f"bfloat16 took {self.ratio:.2f}x float32's time (decode {_shape(DECODE_SHAPE)}: "
                f"{self.decode_ratio:.2f}x, update {_shape(UPDATE_SHAPE)}: {self.update_ratio:.2f}x; weighted "
                f"{DECODE_WEIGHT:g}/{1 - DECODE_WEIGHT:g})")


def decide_dtype(t: PrecisionTiming) -> str:
    """The faster precision by the measurement (module doc, 3.): "bfloat16" when a run's weighted time
    ratio is below :data:`BF16_PICK_BELOW`, else "float32"."""
    return "bfloat16" if not t.emulated and t.ratio < BF16_PICK_BELOW else "float32"


class MatmulWork:
    """The products :func:`measure_precisions` times, ``work(dtype, kind)``: kind "probe"
    (:data:`PROBE_SHAPE`, weights in cache), "decode" (:data:`DECODE_SHAPE`'s rows through
    :data:`DECODE_POOL` distinct weights), "update" (:data:`UPDATE_SHAPE`)."""

    def __init__(self, pool: int = DECODE_POOL) -> None:
        import torch

        gen = torch.Generator().manual_seed(0)
        m, k, n = DECODE_SHAPE
        w = torch.rand(pool, n, k, generator=gen) - 0.5
        x = torch.rand(m, k, generator=gen) - 0.5
        big = torch.rand(UPDATE_SHAPE[0], UPDATE_SHAPE[1], generator=gen) - 0.5
        self.t = {name: (w.to(dt), x.to(dt), big.to(dt)) for name, dt in (("float32", torch.float32),
                                                                         ("bfloat16", torch.bfloat16))}
        self.linear = torch.nn.functional.linear

    def __call__(self, dtype: str, kind: str) -> None:
        w, x, big = self.t[dtype]
        if kind == "probe":
            self.linear(big[: PROBE_SHAPE[0]], w[0])
        elif kind == "decode":
            for i in range(w.shape[0]):
                self.linear(x, w[i])
        else:
            self.linear(big, w[0])


def measure_precisions(*, repeats: int = REPEATS, probe_only: bool = False,
                       clock: Callable[[], float] = time.perf_counter,
                       work: Callable[[str, str], None] | None = None) -> PrecisionTiming:
    """Both precisions at the decode and update shapes, interleaved (bfloat16, float32, bfloat16, ...),
    the fastest of ``repeats`` each (module doc, 2.); each product is run once untimed first.
    ``probe_only``: where bfloat16 is emulated (an explicit bfloat16 on an AVX2 CPU), three
    interleaved repeats of the :data:`PROBE_SHAPE` product only (an emulated 2048-row product takes
    seconds), the figures for both shapes (``emulated=True``). Well under a second on a quiet machine
    with native bfloat16; ``clock`` and ``work`` (``work(dtype, kind)``, default :class:`MatmulWork`)
    are injectable."""
    run = work if work is not None else MatmulWork(pool=1 if probe_only else DECODE_POOL)
    kinds = ("probe",) if probe_only else ("decode", "update")
    for kind in kinds:
        for dt in ("bfloat16", "float32"):
            run(dt, kind)  # warm-up: kernel selection, page faults
    best: dict[tuple[str, str], float] = {}
    for _ in range(3 if probe_only else max(1, repeats)):
        for kind in kinds:
            for dt in ("bfloat16", "float32"):
                t0 = clock()
                run(dt, kind)
                s = clock() - t0
                best[dt, kind] = min(s, best.get((dt, kind), s))
    if probe_only:
        b, f = best["bfloat16", "probe"], best["float32", "probe"]
        return PrecisionTiming(b, f, b, f, emulated=True)
    return PrecisionTiming(best["bfloat16", "decode"], best["float32", "decode"],
                           best["bfloat16", "update"], best["float32", "update"])


@dataclass(frozen=True)
class DtypeChoice:
    """The precision a run computes in, and why.

    requested: what the config asked ("auto", "float32", "bfloat16"); dtype: what is used;
    reason: one sentence; bf16_slowdown: a run's measured bfloat16/float32 time ratio (the weighted
    one of :class:`PrecisionTiming`; None when not measured); cached: the measurement came from the
    cache; warning: set when an explicit choice is expected to be slow here; timing: the measurement's
    seconds and ratios (None when not measured).
    """

    requested: str
    dtype: str
    reason: str
    cpu: str
    bf16_slowdown: float | None = None
    cached: bool = False
    warning: str | None = None
    timing: dict[str, Any] | None = None

    def log_line(self) -> str:
        return f"precision: {self.dtype} ({self.reason})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cache_file() -> Path:
    from .paths import cache_root

    return cache_root() / "precision.json"


def _cache_key(f: CpuFeatures) -> str:
    """One measurement per CPU model: its name, torch's capability string, the native-bfloat16 flag and
    the torch version (kernels change with it). Not the thread count: runs with different
    ``train.threads`` on one CPU model must not compute in different precisions."""
    import torch

    return "|".join([f"v{_CACHE_VERSION}", f.model, f.capability, f"bf16={int(f.native_bf16)}",
                     f"torch={torch.__version__}"])


_TIMING_FIELDS = ("bf16_decode", "fp32_decode", "bf16_update", "fp32_update")


def _cached_timing(key: str, path: Path) -> PrecisionTiming | None:
    from .paths import read_cache_entry

    val = read_cache_entry(path, key)
    try:
        secs = [float(val[k]) for k in _TIMING_FIELDS]
        emulated = bool(val.get("emulated", False))
    except (ValueError, AttributeError, TypeError, KeyError):
        return None
    return PrecisionTiming(*secs, emulated=emulated) if all(s > 0 for s in secs) else None


def _store_timing(key: str, t: PrecisionTiming, path: Path) -> None:
    """Best effort: a read-only cache folder only costs the next run a sub-second measurement."""
    from .paths import write_cache_entry

    write_cache_entry(path, key, {**{k: getattr(t, k) for k in _TIMING_FIELDS}, "emulated": t.emulated,
                                  "ratio": round(t.ratio, 4), "dtype": decide_dtype(t)})


def _timing_dict(t: PrecisionTiming) -> dict[str, Any]:
    return {**{k: getattr(t, k) for k in _TIMING_FIELDS}, "emulated": t.emulated, "decode_ratio": t.decode_ratio,
            "update_ratio": t.update_ratio, "ratio": t.ratio, "decode_weight": DECODE_WEIGHT}


def resolve_dtype(requested: str = "auto", *, features: CpuFeatures | None = None,
                  bench: Callable[[], PrecisionTiming] | None = None,
                  cache: Path | None | bool = True) -> DtypeChoice:
    """Resolve ``model.dtype`` for the CPU (see the module doc).

    features: the CPU's features (default :func:`cpu_features`); bench: returns a
    :class:`PrecisionTiming` (default :func:`measure_precisions`); cache: True = the default cache
    file, a path, or False/None = always measure. Raises ValueError for a name outside
    :data:`DTYPE_NAMES`.
    """
    if requested not in DTYPE_NAMES:
        raise ValueError(f"dtype={requested!r}: expected one of {', '.join(DTYPE_NAMES)}")
    f = features if features is not None else cpu_features()
    cpu = f.describe()
    if requested == "float32":
        return DtypeChoice(requested, "float32", f"as configured; {cpu}", cpu)

    path = _cache_file() if cache is True else (Path(cache) if cache else None)
    key = _cache_key(f) if path is not None else ""
    from_cache = False

    def measure() -> PrecisionTiming:
        """The cached or a new measurement (only the probe where bfloat16 is emulated)."""
        nonlocal from_cache
        if path is not None:
            hit = _cached_timing(key, path)
            if hit is not None:
                from_cache = True
                return hit
        t = bench() if bench is not None else measure_precisions(probe_only=not f.native_bf16)
        if path is not None:
            _store_timing(key, t, path)
        return t

    if requested == "bfloat16":
        t = measure()
        ratio = t.ratio
        if ratio > MAX_BF16_SLOWDOWN:
            warn = (f"model.dtype=bfloat16 on a {cpu}: {t.describe()}, so a run is about {ratio:.1f}x "
                    "slower than in float32; use model.dtype=auto (float32 on this CPU)")
            return DtypeChoice(requested, "bfloat16", f"as configured; {ratio:.1f}x slower than float32 here",
                               cpu, ratio, from_cache, warn, _timing_dict(t))
        return DtypeChoice(requested, "bfloat16", f"as configured; {cpu}", cpu, ratio, from_cache,
                           timing=_timing_dict(t))

    # auto
    if not f.native_bf16:
        return DtypeChoice(requested, "float32", f"auto: {cpu}, where bfloat16 is emulated", cpu)
    t = measure()
    dtype = decide_dtype(t)
    faster = "bfloat16 measured faster" if dtype == "bfloat16" else "float32 measured faster"
    if dtype == "float32" and not t.emulated and t.ratio < 1:
        faster = f"bfloat16 less than {100 * (1 - BF16_PICK_BELOW):.0f}% faster"
    return DtypeChoice(requested, dtype, f"auto: {cpu}; {faster}: {t.describe()}", cpu, t.ratio, from_cache,
                       timing=_timing_dict(t))


def announce(choice: DtypeChoice, file: Any = None) -> None:
    """Print the choice's log line (and its warning, if any) to stderr, as every entry point does."""
    out = file if file is not None else sys.stderr
    print(f"[reflrl] {choice.log_line()}", file=out, flush=True)
    if choice.warning:
        print(f"[reflrl] warning: {choice.warning}", file=out, flush=True)
