"""Memory budget of a training forward/backward, and the heap given back after it.

What a training step of a decoder holds (SmolLM2-135M, ``top_layers:12``, float32 trainable layers):

* weights: 135 M parameters (0.54 GB in float32, 0.33 GB with the frozen part in bfloat16);
* gradients and AdamW state of the trainable parameters: 3 x 4 bytes each (42.5 M: 0.51 GB);
* activations autograd keeps for the backward pass: per token, per trainable decoder layer, about
  ``7 hidden + 3 intermediate`` values (norms, projections, rotary q/k, the SiLU-gated MLP's gate and
  up: :func:`reflrl.trainable.lean_mlp_activations` recomputes the rest in the backward pass; 5
  without it), 34.6 KB for SmolLM2 in float32, so 0.41 MB per token over 12 layers; frozen layers keep
  nothing. This is the part that grows with the batch;
* logits: only at the trained positions, in chunks of rows (:func:`reflrl.logprobs.token_logprobs_from_hidden`),
  so at most one chunk of ``chunk x vocabulary`` float32 values at a time.

:class:`ActivationCost` estimates the activation bytes of one forward from the model's shape, and
:func:`split_to_budget` cuts a batch into micro-batches whose estimates fit a byte budget
(``algo.activation_budget_mb``): callers accumulate gradients over them, so the result is the unsplit
one up to float rounding. A single sequence over the budget still runs, alone (it cannot be split).

glibc keeps freed memory in its heaps for reuse; after a step of large, short-lived activations that
is hundreds of MB of resident memory nobody uses. :func:`release_heap` returns it to the system
(``malloc_trim``); callers run it after each micro-batch of an update, an optimiser step, a rollout
phase, an evaluation, and a decode pool's admissions that prefilled or laid out its buffers again.

How much a run holds is measured per phase (:class:`PeakMemory`): the kernel's high-water mark of the
process's resident memory (``VmHWM``) is reset when a phase starts and read when it ends, so the summary
can say which phase needs the memory (load, evaluations, warm-up, RL).

What a phase does not read need not stay resident during it. :func:`map_to_disk` writes tensors to a file
and maps them back (``torch.load(mmap=True)``, the file unlinked at once): the values stay readable and
writable, and their pages come back from the page cache only when read. The evaluations use it for the
AdamW state (:func:`offload_optimizer_state`: 8 bytes per trainable parameter that an evaluation never
reads), the RL phase too between two optimiser steps (the rollouts and the forward/backward passes never
read it; the heap is trimmed after the backward passes, so the step reads it back into freed memory); the
frozen trunk's prompt states go to disk the same way as soon as they are stored (:mod:`reflrl.engines.trunk_cache`).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import itertools
import mmap
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch import nn

T = TypeVar("T")

# Backward-pass transients (one layer's activation gradients, the parameter gradients being summed)
# on top of what the forward saved: measured RSS of a float32 SmolLM2 warm-up step over the saved
# bytes, malloc_trim'd, was about 1.2x.
_BACKWARD_FACTOR = 1.25


@dataclass(frozen=True)
class ActivationCost:
    """Bytes a training forward keeps for its backward pass, from the model's shape.

    per_token: bytes per (row, query position) through the trainable decoder layers.
    per_key:   bytes per (row, attended position) of the trainable layers' keys and values.
    per_score: bytes per (row, query, key) of attention probabilities, kept by eager attention only
               (SDPA's fused kernels keep none: measured flat per token from 200 to 400 tokens).
    logits:    bytes of one chunk of log-prob logits (and its log-softmax) held at once.
    """

    per_token: int
    per_key: int
    per_score: int
    logits: int

    @classmethod
    def of(cls, model: nn.Module, chunk_rows: int = 512) -> "ActivationCost":
        """The cost model of ``model`` (a transformers decoder-only LM, peft-wrapped or not)."""
        cfg = model.config
        cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
        h = int(cfg.hidden_size)
        inter = int(getattr(cfg, "intermediate_size", 4 * h) or 4 * h)
        heads = int(cfg.num_attention_heads)
        kv = int(getattr(cfg, "num_key_value_heads", heads) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or h // heads)
        vocab = int(cfg.vocab_size)
        layers, size = _trainable_layers(model)
        lean = _lean_mlps(model, layers)  # keep 3 intermediate values per token, not 5
        eager = getattr(cfg, "_attn_implementation", "sdpa") == "eager"
        f = _BACKWARD_FACTOR
        return cls(
            per_token=int(f * (layers * (7 * h + 5 * inter) - lean * 2 * inter) * size),
            per_key=int(f * layers * 2 * kv * head_dim * size),
            per_score=int(f * layers * 2 * heads * size) if eager else 0,
            logits=int(3 * chunk_rows * vocab * 4),
        )

    def forward_bytes(self, rows: int, queries: int, keys: int | None = None) -> int:
        """Activation bytes of a forward over ``rows`` x ``queries`` tokens attending to ``keys``
        positions each (``keys`` defaults to ``queries``: a full sequence)."""
        k = queries if keys is None else keys
        return rows * (queries * self.per_token + k * self.per_key + queries * k * self.per_score)


def _trainable_layers(model: nn.Module) -> tuple[int, int]:
    """(number of decoder layers from the lowest one with a trainable parameter up, bytes per
    activation value there). Autograd saves activations from the first layer whose parameters train
    upwards; below it nothing needs a gradient."""
    try:
        blocks = list(model.get_decoder().layers)
    except AttributeError:
        blocks = []
    first = next((i for i, b in enumerate(blocks) if any(p.requires_grad for p in b.parameters())), None)
    trainable = [p for p in model.parameters() if p.requires_grad]
    size = max((p.element_size() for p in trainable), default=4)
    if first is None:  # no layer trains (only a head or nothing): count one layer's worth
        return (1 if trainable else 0), size
    return len(blocks) - first, size


def _lean_mlps(model: nn.Module, layers: int) -> int:
    """How many of the top ``layers`` decoder layers run :func:`reflrl.trainable.lean_mlp_activations`'
    MLP (two intermediate-size values per token fewer kept for the backward pass)."""
    try:
        blocks = list(model.get_decoder().layers)
    except AttributeError:
        return 0
    blocks = blocks[len(blocks) - layers:] if layers else []
    return sum(bool(getattr(getattr(b, "mlp", None), "lean_activations", False)) for b in blocks)


def split_to_budget(items: Sequence[T], cost: Callable[[Sequence[T]], int], budget: int | None,
                    max_items: int | None = None) -> list[list[T]]:
    """Cut ``items`` (in the given order) into consecutive groups of at most ``max_items`` whose
    ``cost`` is at most ``budget`` bytes: greedy, a group is closed when the next item would not fit.
    An item that does not fit alone forms its own group (a sequence cannot be split). ``budget``
    None means no byte limit."""
    groups: list[list[T]] = []
    cur: list[T] = []
    for it in items:
        full = max_items is not None and len(cur) >= max_items
        if cur and (full or (budget is not None and cost(cur + [it]) > budget)):
            groups.append(cur)
            cur = []
        cur.append(it)
    if cur:
        groups.append(cur)
    return groups


def budget_bytes(mb: float | None) -> int | None:
    """``algo.activation_budget_mb`` in bytes (None: no limit)."""
    return None if mb is None else int(float(mb) * (1 << 20))


_LIBC: ctypes.CDLL | None | bool = False


def release_heap() -> bool:
    """Give the C heap's free memory back to the system (glibc ``malloc_trim``); True when it ran.
    A no-op returning False where the C library has no ``malloc_trim`` (macOS, musl)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True


def _libc() -> Any:
    """The C library (ctypes), or None where it cannot be loaded."""
    global _LIBC
    if _LIBC is False:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else None
        except OSError:
            _LIBC = None
    return _LIBC


_MAPPED = itertools.count()


def map_to_disk(obj: T, folder: str | Path, what: str, nbytes: int) -> T | None:
    """``obj`` (tensors in dicts, lists and tuples) written to a file under ``folder`` and loaded back from
    it mapped, the file unlinked at once (nothing is left behind; the data stays readable until dropped).
    The same values; their memory is given up until something reads them. Mapped copy-on-write: a write
    to a tensor lands in ordinary memory, never in the file. None (nothing moved) when the folder's disk
    has no room for ``nbytes`` or the write fails; ``what`` names the data in the disk-space check."""
    from reflrl.diskspace import check_disk_space

    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        check_disk_space(folder, nbytes + (16 << 20), what)
    except OSError:  # DiskSpaceError included
        return None
    path = folder / f".mapped-{os.getpid()}-{next(_MAPPED)}.pt"
    try:
        torch.save(obj, path)
        return torch.load(path, mmap=True, weights_only=True)
    except (OSError, RuntimeError):  # a write that failed midway: the data stays where it was
        return None
    finally:
        with contextlib.suppress(OSError):  # mapped: the data stays readable until it is dropped
            path.unlink()


_PAGE = mmap.PAGESIZE
_MADV_PAGEOUT = 21  # Linux 5.4+ (linux/mman.h)


def release_mapped_pages(tensors: Sequence[torch.Tensor]) -> int:
    """Give back the resident pages of tensors that :func:`map_to_disk` returned, once they have been read:
    the kernel drops them (``madvise(MADV_PAGEOUT)``) and a later read brings them back from the file, so
    data read once per phase does not stay counted in the process's memory. The values stay the same
    (clean file pages are dropped, never zeroed). Only whole pages inside each tensor's storage are
    advised. Returns the bytes advised; 0 where the system cannot (not Linux, a kernel before 5.4).
    Meant for mapped tensors only: on ordinary memory it would push the pages to swap, where there is
    swap."""
    return _page_out([(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors])


def _page_out(spans: Sequence[tuple[int, int]]) -> int:
    """``madvise(MADV_PAGEOUT)`` on the whole pages inside each (address, bytes) span; the bytes advised."""
    libc = _libc()
    if not sys.platform.startswith("linux") or libc is None or not hasattr(libc, "madvise"):
        return 0
    done = 0
    for a, n in spans:
        lo, hi = -(-a // _PAGE) * _PAGE, (a + n) // _PAGE * _PAGE
        if hi <= lo:
            continue
        if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_PAGEOUT) != 0:
            return done  # not supported here: nothing more to try
        done += hi - lo
    return done


def _file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of files (not the heap, anonymous memory or the stack)."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    lo, hi = parts[0].split("-")
                    out.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return out


def release_file_pages(tensors: Sequence[torch.Tensor]) -> int:
    """:func:`release_mapped_pages` for the bytes of those of ``tensors`` whose memory is a mapping of a file (a float32
    model's weights as ``from_pretrained`` maps them from its safetensors file), the others left alone:
    their resident pages are dropped and a later read brings them back from the file, the values the
    same. For weights that something else now stands in for (the decode step's packed copies of frozen
    layers): they stop counting in the process's memory until something reads them again. Returns the
    bytes advised; 0 where nothing is file-backed or the system cannot."""
    if not tensors:
        return 0
    files = _file_mappings()
    spans = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]  # the tensor's bytes, not a
    # storage it may share with the rest of the file
    return _page_out([(a, n) for a, n in spans if n and any(lo <= a and a + n <= hi for lo, hi in files)])


def offload_optimizer_state(optimizer: torch.optim.Optimizer, folder: str | Path) -> bool:
    """Move ``optimizer``'s state tensors (AdamW's moments) to a mapped file under ``folder``
    (:func:`map_to_disk`) while something that never reads them runs, such as an evaluation: the next
    optimiser step reads them back from the page cache and updates them as before (the same values, so
    the same step to the bit). False when there is no state or nothing could be moved."""
    states = [s for s in optimizer.state.values() if s]
    tensors = [{k: v for k, v in s.items() if torch.is_tensor(v)} for s in states]
    nbytes = sum(v.numel() * v.element_size() for t in tensors for v in t.values())
    if not nbytes:
        return False
    mapped = map_to_disk(tensors, folder, "the optimiser's state", nbytes)
    if mapped is None:
        return False
    for s, m in zip(states, mapped):
        s.update(m)
    return True


_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kb(key: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def peak_rss_bytes() -> int | None:
    """The process's peak resident memory since the last :func:`reset_peak_rss` (or its start), in bytes:
    ``VmHWM`` (Linux); elsewhere the lifetime peak (``ru_maxrss``); None where neither can be read."""
    kb = _status_kb("VmHWM")
    if kb is not None:
        return kb * 1024
    try:
        import resource
        import sys

        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(r) if sys.platform == "darwin" else int(r) * 1024  # bytes on macOS, KiB on Linux
    except (ImportError, OSError, ValueError):
        return None


def reset_peak_rss() -> bool:
    """Start a new high-water mark at the current resident memory (``echo 5 > /proc/self/clear_refs``);
    False where the kernel does not allow it (then :func:`peak_rss_bytes` keeps the older, higher peak)."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak resident memory per phase of a run, in MB, kept in ``peaks`` (a dict the caller owns, e.g. the
    run's checkpointed state, so a resumed run keeps the peaks of its earlier phases).

    ``with pm.phase("eval"): ...`` resets the high-water mark, runs the phase and records its peak (the
    largest of every time that phase ran). Phases nest: a phase inside another (a format probe inside the
    warm-up) counts for both. Where the mark cannot be reset (``per_phase`` False) every reading is the
    process's peak so far: an upper bound for each phase."""

    def __init__(self, peaks: dict[str, float]):
        self.peaks = peaks
        self.per_phase = True
        self._open: list[str] = []

    def record(self, *names: str) -> None:
        """Record the peak since the last reset for ``names`` (each keeps the largest of its readings)."""
        b = peak_rss_bytes()
        if b is None:
            return
        for name in names:
            self.peaks[name] = round(max(self.peaks.get(name, 0.0), b / 1e6), 1)

    def _restart(self) -> None:
        self.per_phase = reset_peak_rss() and self.per_phase

    @contextlib.contextmanager
    def phase(self, name: str):
        self.record(*self._open)  # what the enclosing phases held so far, before the mark restarts
        self._restart()
        self._open.append(name)
        try:
            yield
        finally:
            self.record(*self._open)
            self._open.pop()
            self._restart()
