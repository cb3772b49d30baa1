"""How reflrl runs torch on the CPU's cores: all of them, with OpenMP threads that sleep while they wait.

Measured on a 2-core AVX2 machine (``python scripts/bench_threads.py``, float32, SmolLM2-135M; the
figures are in the README): with the machine to itself, 2 threads are about 1.9x (a prefill-sized
matmul), 1.2x (decoding) and 1.7x (forward+backward) as fast as 1. With GNU OpenMP's default wait policy
(threads spin at every barrier before sleeping), ONE CPU-bound process at normal priority made 2 threads
2.3-3.9x slower, slower than a single thread: each barrier waits for the thread the kernel has just
descheduled. With ``OMP_WAIT_POLICY=PASSIVE`` a waiting thread sleeps at once and gives its core away,
so the same background process costs 1.5-1.8x (about the share of the machine it takes), while the
idle machine is as fast as before (decoding a little faster). A ``nice 19`` background job costs
either setting almost nothing. The price is a wake-up at every parallel region: on a 2-core AMD EPYC with
AVX512-BF16 a short call took 65-190 µs under PASSIVE against 30 with spinning threads, which is why the
native kernels (:mod:`reflrl.engines.native_attention`) share their work among threads of their own that
spin for a fraction of a millisecond between a decode step's calls, not OpenMP's.

Changing the thread count during a run is not an option: some kernels (small-batch matmuls, one-token
attention) round differently with 1 and 2 threads, and a run's numbers must depend on its seed alone.
So the thread count stays fixed (``train.threads``, default: torch's, one per core) and the wait policy
does the rest. OpenMP reads it once, when torch loads, so the ``reflrl`` command sets it first thing
(:func:`configure_openmp`, unless the user chose a policy); importing reflrl sets nothing.

oneDNN (PyTorch's kernels for bfloat16 products and packed float32 weights) keeps every primitive it
builds, one per product shape, in two caches of 1,024 entries each (oneDNN's own and PyTorch's ideep
layer), about 0.5 MB of heap per shape between them. Prefills and training micro-batches have a new
row count almost every time, so over a run the caches fill and hold hundreds of MB that are never
used again. The ``reflrl`` command caps both at :data:`ONEDNN_CACHE` entries (:func:`configure_onednn`,
unless the user set them): a decode step's few shapes stay cached, and a shape built again costs about
a millisecond.

glibc gives each thread that allocates its own heap arena, up to 8 per core. A run allocates from
several threads (the decode loop in an executor thread, training in the main one), and each arena keeps
its own high-water mark and its own fragments: memory freed in one cannot serve the other. The
``reflrl`` command limits the process to :data:`MALLOC_ARENAS` arenas (:func:`limit_malloc_arenas`,
unless ``MALLOC_ARENA_MAX`` or ``GLIBC_TUNABLES`` chose): the main job's peak resident memory in its
evaluations fell from 3.97 to 3.09 GB together with the trunk states' pages given back, and its time
did not grow (docs/results.md).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import MutableMapping

WAIT_POLICY = "PASSIVE"


def configure_openmp(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Make OpenMP threads sleep while they wait (``OMP_WAIT_POLICY=PASSIVE``), in this process and the
    processes it starts, unless the user set a policy. Must run before torch is imported (the
    ``reflrl`` command's first step); returns the policy set, or None when it was already chosen or
    can no longer take effect (torch already loaded: then it is left alone)."""
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in env:
        return None
    if environ is None and "torch" in sys.modules:
        return None
    env["OMP_WAIT_POLICY"] = WAIT_POLICY
    return WAIT_POLICY


ONEDNN_CACHE = 128  # primitives kept per cache (module doc)
_ONEDNN_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def configure_onednn(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Cap oneDNN's and PyTorch's primitive caches at :data:`ONEDNN_CACHE` entries (module doc), each
    unless the user set it. Must run before torch is imported (they are read when it loads); returns
    the variables set (none when torch is already loaded)."""
    env = os.environ if environ is None else environ
    if environ is None and "torch" in sys.modules:
        return []
    done = [k for k in _ONEDNN_CACHE_VARS if k not in env]
    for k in done:
        env[k] = str(ONEDNN_CACHE)
    return done


MALLOC_ARENAS = 2  # glibc heap arenas (module doc)
_M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)


def limit_malloc_arenas(environ: MutableMapping[str, str] | None = None) -> bool:
    """Limit glibc to :data:`MALLOC_ARENAS` heap arenas for the threads started from now on (module doc),
    unless the environment chose (``MALLOC_ARENA_MAX``, ``GLIBC_TUNABLES``' arena_max). True when set; False
    where the user chose or the C library is not glibc."""
    env = os.environ if environ is None else environ
    if "MALLOC_ARENA_MAX" in env or "arena_max" in env.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_ARENA_MAX, MALLOC_ARENAS))


def configure_process() -> None:
    """The process settings the ``reflrl`` command makes before torch loads (module doc): OpenMP's wait
    policy, oneDNN's cache caps, glibc's heap arenas, each unless the user chose. Scripts that mirror a run
    call it first too."""
    configure_openmp()
    configure_onednn()
    limit_malloc_arenas()


def fix_threads(threads: int | None) -> None:
    """Set torch's CPU thread count for the whole process to ``threads`` (``train.threads``); None or 0
    leaves torch's default (one per core). A run, and every script that mirrors one, calls this once
    before any computation: the count never changes afterwards (module doc)."""
    if threads:
        import torch

        torch.set_num_threads(int(threads))


def describe() -> dict[str, object]:
    """The run's thread settings, for its summary."""
    import torch

    return {"threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default")}
