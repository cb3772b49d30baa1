"""Which precision to compute in on this machine: ``model.dtype: auto`` and its log line.

bfloat16 halves memory traffic and, on CPUs with native bfloat16 arithmetic (x86 AVX512-BF16 or
AMX; Arm's BF16 extension), runs a 135M-parameter model about twice as fast as float32. On CPUs
without it (AVX2-only x86: AMD Zen 2/3, Intel consumer chips since Alder Lake, many cloud VMs)
PyTorch emulates it: a 256x576x1536 matmul measured 43x slower than float32 on a 2-core AMD EPYC
(1.2 against 51.5 GFLOP/s). So "auto" picks bfloat16 only where the hardware computes it:

1. capability check (:func:`cpu_features`): AVX512-BF16 or AMX on x86, the ``bf16`` feature on Arm;
2. confirmation by a sub-second micro-benchmark (:func:`measure_bf16_slowdown`): the same matmul in
   both precisions; bfloat16 is dropped only if it runs like emulation (more than
   :data:`EMULATED_BF16_SLOWDOWN` times float32's time), so the load of the moment never picks the
   precision. The verdict is cached per CPU model, feature set, torch version and
   thread count in ``<cache>/precision.json`` (``reflrl.paths.cache_root``), so later runs skip it.

Everything else gets float32. An explicit ``bfloat16`` on a CPU without native support is honoured,
with a warning giving the measured slowdown. Every entry point that loads a model (``reflrl train``,
``reflrl eval``, ``reflrl env demo``, ``python -m reflrl.chat_server``, the scripts) resolves its dtype
here, so they agree; :meth:`DtypeChoice.log_line` is the line they print.

The probes are injectable (``features=``, ``bench=``), which is how the tests fake an AVX2 or an
AVX512-BF16 machine.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

DTYPE_NAMES = ("auto", "float32", "bfloat16")
BENCH_SHAPE = (256, 576, 1536)  # (M, K, N): a prefill-sized slice of SmolLM2-135M's MLP
MAX_BF16_SLOWDOWN = 1.1  # bfloat16 time / float32 time above which an explicit bfloat16 gets a warning
# Where the CPU reports native bfloat16, "auto" takes float32 only when the micro-benchmark says bfloat16 is
# emulated after all (tens of times slower). A busy machine can make either side of a sub-second benchmark
# a few times slower, so a threshold near 1 would let the load of the moment pick a run's precision, and
# with it the run's numbers; emulation is an order of magnitude beyond that noise.
EMULATED_BF16_SLOWDOWN = 4.0
_CACHE_VERSION = 2


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


def measure_bf16_slowdown(shape: tuple[int, int, int] = BENCH_SHAPE, *, repeats: int = 3) -> float:
    """bfloat16 time / float32 time of one (M, K) x (K, N) matmul on this CPU (best of ``repeats``
    after one warm-up each; well under a second even where bfloat16 is emulated)."""
    import torch

    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    a32, b32 = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    best: dict[torch.dtype, float] = {}
    for dt in (torch.float32, torch.bfloat16):
        a, b = a32.to(dt), b32.to(dt)
        t0 = time.perf_counter()
        torch.matmul(a, b)  # warm-up: kernel selection, page faults
        first = time.perf_counter() - t0
        if dt == torch.bfloat16 and first > 10 * best[torch.float32]:
            best[dt] = first  # emulated: one run settles it (and keeps the probe sub-second)
            break
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            times.append(time.perf_counter() - t0)
        best[dt] = min(times)
    return best[torch.bfloat16] / max(best[torch.float32], 1e-9)


@dataclass(frozen=True)
class DtypeChoice:
    """The precision a run computes in, and why.

    requested: what the config asked ("auto", "float32", "bfloat16"); dtype: what is used;
    reason: one sentence; bf16_slowdown: measured bfloat16/float32 time ratio (None when not
    measured); cached: the measurement came from the cache; warning: set when an explicit choice is
    expected to be slow here.
    """

    requested: str
    dtype: str
    reason: str
    cpu: str
    bf16_slowdown: float | None = None
    cached: bool = False
    warning: str | None = None

    def log_line(self) -> str:
        return f"precision: {self.dtype} ({self.reason})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cache_file() -> Path:
    from .paths import cache_root

    return cache_root() / "precision.json"


def _cache_key(f: CpuFeatures) -> str:
    import torch

    return "|".join([f"v{_CACHE_VERSION}", f.model, f.capability, f"bf16={int(f.native_bf16)}",
                     f"torch={torch.__version__}", f"threads={torch.get_num_threads()}"])


def _cached_slowdown(key: str, path: Path) -> float | None:
    try:
        val = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return float(val) if isinstance(val, (int, float)) and val > 0 else None


def _store_slowdown(key: str, value: float, path: Path) -> None:
    """Best effort: a read-only cache folder only costs the next run a sub-second measurement."""
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(data, dict):
            data = {}
        data[key] = round(float(value), 4)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except (OSError, ValueError):
        pass


def resolve_dtype(requested: str = "auto", *, features: CpuFeatures | None = None,
                  bench: Callable[[], float] | None = None, cache: Path | None | bool = True) -> DtypeChoice:
    """Resolve ``model.dtype`` for the CPU (see the module doc).

    features: the CPU's features (default :func:`cpu_features`); bench: returns the bfloat16/float32
    time ratio (default :func:`measure_bf16_slowdown`); cache: True = the default cache file, a path,
    or False/None = always measure. Raises ValueError for a name outside :data:`DTYPE_NAMES`.
    """
    if requested not in DTYPE_NAMES:
        raise ValueError(f"dtype={requested!r}: expected one of {', '.join(DTYPE_NAMES)}")
    f = features if features is not None else cpu_features()
    cpu = f.describe()
    if requested == "float32":
        return DtypeChoice(requested, "float32", f"as configured; {cpu}", cpu)

    path = _cache_file() if cache is True else (Path(cache) if cache else None)
    key = _cache_key(f) if path is not None else ""
    measured_from_cache = False

    def slowdown() -> float:
        nonlocal measured_from_cache
        if path is not None:
            hit = _cached_slowdown(key, path)
            if hit is not None:
                measured_from_cache = True
                return hit
        value = float((bench or measure_bf16_slowdown)())
        if path is not None:
            _store_slowdown(key, value, path)
        return value

    if requested == "bfloat16":
        ratio = slowdown()
        if ratio > MAX_BF16_SLOWDOWN:
            warn = (f"model.dtype=bfloat16 on a {cpu}: bfloat16 is emulated here and measured {ratio:.1f}x "
                    f"slower than float32 on a {'x'.join(map(str, BENCH_SHAPE))} matmul; "
                    "use model.dtype=auto (float32 on this CPU)")
            return DtypeChoice(requested, "bfloat16", f"as configured; {ratio:.1f}x slower than float32 here",
                               cpu, ratio, measured_from_cache, warn)
        return DtypeChoice(requested, "bfloat16", f"as configured; {cpu}", cpu, ratio, measured_from_cache)

    # auto
    if not f.native_bf16:
        return DtypeChoice(requested, "float32", f"auto: {cpu}, where bfloat16 is emulated", cpu)
    ratio = slowdown()
    shape = "x".join(map(str, BENCH_SHAPE))
    if ratio > EMULATED_BF16_SLOWDOWN:
        return DtypeChoice(requested, "float32", f"auto: {cpu}, but bfloat16 measured {ratio:.2f}x the time of "
                           f"float32 on a {shape} matmul", cpu, ratio, measured_from_cache)
    return DtypeChoice(requested, "bfloat16", f"auto: {cpu}; bfloat16 measured {ratio:.2f}x the time of "
                       f"float32 on a {shape} matmul", cpu, ratio, measured_from_cache)


def announce(choice: DtypeChoice, file: Any = None) -> None:
    """Print the choice's log line (and its warning, if any) to stderr, as every entry point does."""
    out = file if file is not None else sys.stderr
    print(f"[reflrl] {choice.log_line()}", file=out, flush=True)
    if choice.warning:
        print(f"[reflrl] warning: {choice.warning}", file=out, flush=True)
