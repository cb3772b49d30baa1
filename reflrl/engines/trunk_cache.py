"""Prompt states of a model's frozen bottom layers, kept across generation calls.

With ``model.trainable: top_layers:K`` the bottom decoder layers (and the embeddings) never change
during a run, so what they compute for a prompt never changes either. A run evaluates the same
held-out prompts several times (before training, after the warm-up, after RL): the second and later
times, only the top K layers need to run over each prompt. :class:`TrunkCache` keeps, per prompt, the
bottom layers' keys/values and the hidden state entering the first trainable layer; the engine's
prefill then swaps the bottom layers for :class:`_CachedLayer` stubs that replay them (the model's own
forward runs unchanged: masks, positions, the trainable layers, the final norm). With SmolLM2-135M and
the top 6 of 30 layers trainable that is about a fifth of the prefill compute; the outputs are the
same up to float rounding (tested).

The cache checks the frozen parameters' version counters on every use and empties itself if any of
them changed (an in-place update, a loaded checkpoint), so it can never serve stale states.

Between evaluations (a warm-up, an RL phase) nothing reads the states, so :meth:`TrunkCache.offload`
moves them to a file in a given folder and maps it back (``torch.load(mmap=True)``): the process keeps
no copy in memory until the next evaluation reads a prompt's states again from the page cache (or the
disk). The file is unlinked once mapped, so nothing is left behind. A prompt's states read back are
given up again at once (:func:`reflrl.memory.release_mapped_pages`: an evaluation reads each prompt's
states once), and the next offload writes only the states stored since the last one.

With a ``spill`` folder the states never wait in memory at all: each prefill's new states are written
there and mapped back as soon as they are stored, so an evaluation holds none of them beside its KV
cache (hundreds of MB for 48 prompts of SmolLM2-135M); the page cache keeps them close for the next
evaluation.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from reflrl.memory import map_to_disk, release_mapped_pages


def frozen_depth(model: nn.Module) -> int:
    """Leading decoder layers (with the input embeddings) that have no trainable parameter; 0 when the
    embeddings train or the model has no ``model.model.layers``-style decoder."""
    try:
        layers = model.get_decoder().layers
        emb = model.get_input_embeddings()
    except AttributeError:
        return 0
    if any(p.requires_grad for p in emb.parameters()):
        return 0
    depth = 0
    for layer in layers:
        if any(p.requires_grad for p in layer.parameters()):
            break
        depth += 1
    return depth if depth < len(layers) else 0  # an all-frozen model gains nothing over a plain prefill


class _CachedLayer(nn.Module):
    """Stands in for frozen layer ``index`` during a prefill: writes the cached keys/values into the KV
    cache and passes the hidden state through (the last one returns the cached boundary state)."""

    def __init__(self, index: int, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor | None):
        super().__init__()
        self.index, self.keys, self.values, self.out = index, keys, values, out

    def forward(self, hidden_states: torch.Tensor, *args: Any, past_key_values: Any = None, **kwargs: Any):
        past_key_values.update(self.keys, self.values, self.index)
        self.keys = self.values = None  # copied into the cache: freed now (a stub replays once)
        out, self.out = self.out, None
        return out if out is not None else hidden_states


class TrunkCache:
    """Per-prompt states of ``model``'s frozen bottom layers (see the module doc).

    max_bytes: the states kept hold at most this many bytes; the least recently used prompt is dropped
    first (an evaluation's first turns are used again by the next evaluation and stay; the later turns
    of a policy that has changed since are not, and go). Each prompt costs about
    ``(2 x depth x kv_heads x head_dim + hidden) x prompt_len`` numbers (about 11 MB for a 380-token
    prompt of SmolLM2-135M in float32 with 18 frozen layers). None: no limit.

    spill: a folder where each prefill's new states go at once (:meth:`offload`), None: they stay in
    memory until :meth:`offload` is called (or for good when it never is).
    """

    def __init__(self, model: nn.Module, max_bytes: int | None = 512 << 20, spill: str | Path | None = None):
        self.model = model
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self.spill = spill
        self.entries: dict[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]] = {}
        self.nbytes = 0
        self.hits = self.misses = 0
        self._stamp: tuple | None = None
        self._mapped: set[tuple[int, ...]] = set()  # prompts whose states are on disk, mapped (offload)

    # ------------------------------------------------------------------ validity
    def depth(self) -> int:
        return frozen_depth(self.model)

    def _current_stamp(self, depth: int) -> tuple:
        dec = self.model.get_decoder()
        params = list(self.model.get_input_embeddings().parameters())
        for layer in list(dec.layers)[:depth]:
            params.extend(layer.parameters())
        return (depth, tuple((id(p), p._version, p.dtype) for p in params))

    def check(self) -> int:
        """The frozen depth now; empties the cache when the frozen part changed since the last use."""
        depth = self.depth()
        stamp = self._current_stamp(depth) if depth else (0,)
        if stamp != self._stamp:
            self.entries.clear()
            self._mapped.clear()
            self.nbytes = 0
            self._stamp = stamp
        return depth

    def offload(self, folder: str | Path) -> bool:
        """Move the states to a file under ``folder`` and map them back from it: their memory is given up
        until a prefill reads them again (see the module doc); the same tensors' values, the same
        entries. False (nothing moved) when there is nothing to move or the folder's disk has no room
        for it."""
        fresh = {k: e for k, e in self.entries.items() if k not in self._mapped}  # those on disk stay there
        if not fresh:
            return False
        mapped = map_to_disk(fresh, folder, "the held-out prompts' trunk states", sum(map(self._size, fresh.values())))
        if mapped is None:
            return False
        for k, e in mapped.items():
            self.entries[k] = e  # (the order, least recently used first, is kept)
        self._mapped.update(mapped)
        return True

    # ------------------------------------------------------------------ entries
    def has_all(self, prompts: list[list[int]]) -> bool:
        return all(tuple(p) in self.entries for p in prompts)

    @staticmethod
    def _size(entry: tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]) -> int:
        ks, vs, h = entry
        return sum(t.numel() * t.element_size() for t in (*ks, *vs, h))

    def store(self, prompts: list[list[int]], cache: Any, boundary: torch.Tensor, width: int, depth: int) -> None:
        """Keep each prompt's states from a left-padded prefill of ``width`` columns: layers < depth of
        the KV ``cache`` and the hidden states ``boundary`` [rows, width, hidden] entering layer depth."""
        for r, p in enumerate(prompts):
            key = tuple(p)
            if key in self.entries:
                continue
            start = width - len(p)
            ks = [cache.layers[i].keys[r, :, start:width].clone() for i in range(depth)]
            vs = [cache.layers[i].values[r, :, start:width].clone() for i in range(depth)]
            entry = (ks, vs, boundary[r, start:width].clone())
            size = self._size(entry)
            if self.max_bytes is not None and size > self.max_bytes:
                continue  # a prompt over the whole budget is not kept
            self.entries[key] = entry
            self.nbytes += size
            while self.max_bytes is not None and self.nbytes > self.max_bytes:
                old = next(iter(self.entries))  # least recently used
                self.nbytes -= self._size(self.entries.pop(old))
                self._mapped.discard(old)
        if self.spill is not None:
            self.offload(self.spill)  # the new states to disk now (a full disk: they stay in memory)

    def batch(self, prompts: list[list[int]], width: int, depth: int
              ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """Left-padded [rows, kv_heads, width, head_dim] keys/values per frozen layer and the boundary
        hidden states [rows, width, hidden] of cached ``prompts`` (zeros in the padding)."""
        k0, _, h0 = self.entries[tuple(prompts[0])]
        rows = len(prompts)
        keys = [k0[i].new_zeros((rows, k0[i].shape[0], width, k0[i].shape[-1])) for i in range(depth)]
        values = [k.clone() for k in keys]
        hidden = h0.new_zeros((rows, width, h0.shape[-1]))
        for r, p in enumerate(prompts):
            key = tuple(p)
            ks, vs, h = self.entries[key] = self.entries.pop(key)  # used now: the most recent
            start = width - len(p)
            for i in range(depth):
                keys[i][r, :, start:] = ks[i]
                values[i][r, :, start:] = vs[i]
            hidden[r, start:] = h
            if key in self._mapped:  # read from the page cache: its pages go back until the next evaluation
                release_mapped_pages([*ks, *vs, h])
        return keys, values, hidden

    @contextlib.contextmanager
    def capture(self, depth: int) -> Iterator[dict[str, torch.Tensor]]:
        """Within the block, a plain prefill records the hidden states entering layer ``depth``
        (yielded dict, key "h")."""
        got: dict[str, torch.Tensor] = {}

        def hook(_module: nn.Module, args: tuple, kwargs: dict):
            h = args[0] if args else kwargs["hidden_states"]
            got["h"] = h.detach()

        handle = self.model.get_decoder().layers[depth].register_forward_pre_hook(hook, with_kwargs=True)
        try:
            yield got
        finally:
            handle.remove()

    @contextlib.contextmanager
    def replaying(self, keys: list[torch.Tensor], values: list[torch.Tensor], hidden: torch.Tensor,
                  depth: int) -> Iterator[None]:
        """Within the block, the decoder's bottom ``depth`` layers are stubs replaying ``keys``,
        ``values`` and ``hidden`` (from :meth:`batch`). The lists are handed over (emptied here): each
        layer's tensors are freed as soon as its stub has written them into the KV cache, so the prefill
        holds one layer's copy at a time, not a second copy of every frozen layer's."""
        dec = self.model.get_decoder()
        real = dec.layers
        stubs = [_CachedLayer(i, keys[i], values[i], hidden if i == depth - 1 else None) for i in range(depth)]
        keys.clear()
        values.clear()
        dec.layers = nn.ModuleList(stubs + list(real)[depth:])
        try:
            yield
        finally:
            dec.layers = real
