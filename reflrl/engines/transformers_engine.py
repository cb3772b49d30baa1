"""The CPU rollout engine: :class:`TransformersEngine` samples from the training model itself.

It runs its own batched sampling loop over a transformers KV cache (no ``model.generate``), because
that loop can (a) prefill each prompt once and copy its cache to the ``n`` samples (GRPO groups share
the prompt), (b) compute only the chosen token's log-prob per step instead of keeping full-vocabulary
scores for all steps, (c) drop finished rows from the batch, (d) decode with an in-place KV cache and
copy-free grouped-query attention (:mod:`.fast_decode`, ~3x faster steps on the CPU), (e) stop each
row at its own cap or as soon as its answer is complete (``stop_when``), and (f) replay the frozen
bottom layers of prompts it has prefilled before (:mod:`.trunk_cache`). The protocol and the
log-prob convention are in :mod:`.base`; the other engines of :mod:`reflrl.engines` (vLLM, any
OpenAI-compatible server) implement the same protocol.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from reflrl.logprobs import head_of

from .base import (FinishReason, GenerateStats, PieceDecoder, RolloutEngine, Sample, cut_at, generation_lock,
                   per_prompt_caps)
from .fast_decode import (fast_decoding, growable, growing_cache, left_padded_buffers, length_chunks, place_rows,
                          prefix_families, reserve)
from .lean_decode import FusedWeights, LeanDecoder, packed_frozen_layers, packed_prefill, supports as lean_supports
from .packed import dense

__all__ = ["FinishReason", "GenerateStats", "PieceDecoder", "RolloutEngine", "Sample", "TransformersEngine",
           "cut_at", "per_prompt_caps", "sample_next"]


SAMPLE_BLOCK = 256  # vocabulary block of the two-level inverse-CDF draw (sample_next)


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    consume: bool = False,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row: logits [B,V] float32 -> (tokens [B] long, logprobs [B] float32).
    ``consume``: ``logits`` may be overwritten (the engine passes a fresh tensor; saves two copies).
    ``uniforms``: the draw's uniform numbers [B, 1] in [0, 1) (float32, on the CPU), one per row, instead of
    drawing them from ``generator``: each row's token then depends only on its own logits and number
    (:mod:`.continuous` gives each row its own seeded stream).

    temperature <= 0: argmax, log-prob at temperature 1. Otherwise sample from
    softmax(logits / T) restricted to the smallest top-p nucleus (Holtzman et al. 2020); the
    returned log-prob is under the untruncated temperature-scaled distribution (module doc), computed as
    the trainer does: z[token] - logsumexp(z) with z = logits / T.

    Without top-p the draw is inverse-CDF sampling in two levels: one uniform per row picks a block of
    :data:`SAMPLE_BLOCK` tokens by the blocks' cumulative mass, then a token inside it. Same law as
    ``torch.multinomial``; over a 49,152-token vocabulary it reads the logits about five times (max,
    exp, block sums) instead of a full-vocabulary log-softmax and cumulative sum.
    """
    if temperature <= 0:
        tok = logits.argmax(dim=-1)
        return tok, logits.gather(-1, tok[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    if temperature != 1.0:
        z = logits.div_(temperature) if consume else logits / temperature
    else:
        z = logits
    if top_p < 1.0:
        logp = torch.log_softmax(z, dim=-1)
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        sorted_p = sorted_lp.exp()
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p  # the top token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = logp.masked_fill(drop, float("-inf")).softmax(dim=-1)
        cdf = probs.cumsum(dim=-1)
        # drawn on the CPU generator whatever the device: the same seed gives the same draws on CPU and GPU
        if uniforms is None:
            uniforms = torch.rand((probs.shape[0], 1), generator=generator, dtype=cdf.dtype)
        u = uniforms.to(device=cdf.device, dtype=cdf.dtype) * cdf[:, -1:]
        tok = torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1)
        # a zero-probability token can't be drawn: step past exact ties at the boundary
        tok = torch.where(probs.gather(-1, tok) > 0, tok, (probs > 0).float().argmax(-1, keepdim=True))
        tok = tok.squeeze(-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
    rows, vocab = z.shape
    m = z.amax(dim=-1, keepdim=True)
    zs = z.sub_(m) if consume else z - m  # z - max(z): the largest 0
    e = torch.exp(zs)  # unnormalised probabilities, the largest 1
    pad = (-vocab) % SAMPLE_BLOCK
    blocks = (torch.nn.functional.pad(e, (0, pad)) if pad else e).view(rows, -1, SAMPLE_BLOCK)
    mass = blocks.sum(-1)  # [B, blocks]
    cmass = mass.cumsum(-1)
    total = cmass[:, -1:]
    # drawn on the CPU generator whatever the device: the same seed gives the same draws on CPU and GPU
    if uniforms is None:
        uniforms = torch.rand((rows, 1), generator=generator, dtype=e.dtype)
    u = uniforms.to(device=e.device, dtype=e.dtype) * total
    blk = torch.searchsorted(cmass, u, right=True).clamp_(max=mass.shape[-1] - 1)  # [B, 1]
    r = torch.arange(rows, device=e.device)
    inside = blocks[r, blk[:, 0]]  # [B, SAMPLE_BLOCK]
    rest = (u - (cmass.gather(-1, blk) - mass.gather(-1, blk))).clamp_(min=0)
    tok = blk[:, 0] * SAMPLE_BLOCK + torch.searchsorted(inside.cumsum(-1), rest, right=True)[:, 0].clamp_(
        max=SAMPLE_BLOCK - 1)
    tok = tok.clamp_(max=vocab - 1)
    bad = e[r, tok] <= 0  # a zero-probability token (a boundary tie, float rounding): take the row's mode
    if bool(bad.any()):
        tok = torch.where(bad, zs.argmax(dim=-1), tok)
    return tok, zs[r, tok] - torch.log(total[:, 0])


# receives one prefilled chunk: (its rows' indices in the prompts, last hidden states, cache left-padded)
Sink = Callable[[list[int], torch.Tensor, Any], None]

# per model, the decode step's weight cache per (packed, native dtypes) layout
_DECODE_WEIGHTS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, FusedWeights]] = weakref.WeakKeyDictionary()
SHARED_PREFIX_MIN = 64  # prompts sharing at least this many leading tokens prefill them once (_prefill)
# a prefill chunk of prompts run whole pads to at most this many tokens (rows x its longest prompt): what it
# holds at once (its KV cache, the activations and attention scores of one layer) stays small beside the
# decode's KV budget, and a chunk this size already multiplies at the matmul rate of a whole batch
PREFILL_CHUNK_TOKENS = 4096


class TransformersEngine:
    """RolloutEngine over a transformers causal LM on the CPU (shares the training model).

    Args:
        model: causal LM (plain or peft); sampled in eval mode under ``torch.inference_mode``.
        tokenizer: gives the default stop id (eos) and pad id.
        max_batch_size: at most this many rows (prompts x n) decode together; prompts are
            processed in consecutive groups of ``max(1, max_batch_size // n)``.
        trunk_cache: a :class:`reflrl.engines.trunk_cache.TrunkCache` of the same model: prompts prefilled
            before skip the frozen bottom layers (the held-out evaluations of a run reuse it).
        lean: decode with :class:`reflrl.engines.lean_decode.LeanDecoder` where the model qualifies
            (Llama-family, no LoRA); False always runs the transformers forward (same outputs, slower).
        continuous: serve ``generate`` and ``agenerate`` with continuous batching
            (:class:`reflrl.engines.continuous.DecodePool`: a finished row is refilled at once, each row
            samples from its own seeded stream) where the lean step runs; otherwise (and for other
            models) ``generate`` decodes each call in fixed batches and ``agenerate`` runs it in a thread.
        kv_budget_bytes: the KV cache holds at most this many bytes: with ``continuous`` the pool's buffers
            (requests that do not fit wait for rows to finish), otherwise each fixed batch takes as many
            prompts as fit (:meth:`prompts_per_batch`); None = no limit beyond ``max_batch_size`` rows.
        packed: the decode step and prefills multiply by float32 weights packed for oneDNN
            (:mod:`reflrl.engines.packed`).
        attention: the lean decode step's one-token attention: a
            :class:`reflrl.engines.native_attention.Kernel`, or None (PyTorch's SDPA).
        matmul: a :class:`reflrl.engines.native_matmul.MatmulChoice`: the decode step, prefills and the frozen
            layers' training forwards multiply by weights laid out for the native kernel in the dtypes it
            takes (before ``packed``'s); None: PyTorch's products.
    """

    sample = staticmethod(sample_next)  # the draw of one token per row (the continuous pool calls it too)

    def __init__(self, model: nn.Module, tokenizer: Any, max_batch_size: int = 64, trunk_cache: Any = None,
                 lean: bool = True, continuous: bool = False, kv_budget_bytes: int | None = None,
                 packed: bool = False, attention: Any = None, matmul: Any = None):
        self.model = model
        self.tokenizer = tokenizer
        # reflrl.engines.trunk_cache.TrunkCache: replay the frozen bottom layers of prompts seen before (evaluation)
        self.trunk_cache = trunk_cache
        self.max_batch_size = max(1, int(max_batch_size))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.eos_id = tokenizer.eos_token_id
        self.last_stats = GenerateStats()
        self.lean = bool(lean)
        self.continuous = bool(continuous)
        self.kv_budget_bytes = kv_budget_bytes
        self.packed = bool(packed)
        self.attention = attention  # the decode step's native attention kernel (native_attention.Kernel) or None
        self.matmul = matmul if matmul is not None and matmul.enabled else None  # native_matmul.MatmulChoice
        self._pool: Any = None  # the shared DecodePool of agenerate (continuous), made on first use

    def prompts_per_batch(self, prompts: Sequence[Sequence[int]], caps: Sequence[int], n: int) -> int:
        """Prompts decoded together on the fixed-batch path: ``max_batch_size // n``, and within
        ``kv_budget_bytes`` for rows as long as the longest prompt plus the largest cap (at least one)."""
        per_group = max(1, self.max_batch_size // n)
        if self.kv_budget_bytes is None or not prompts:
            return per_group
        from .continuous import kv_bytes_per_token

        try:
            per_token = kv_bytes_per_token(self.model)
        except AttributeError:  # a model without the Llama-style layers: rows only
            return per_group
        longest = max(len(p) for p in prompts) + max(caps)
        rows = int(self.kv_budget_bytes // max(1, per_token * longest))
        return max(1, min(per_group, rows // n))

    def _pooled(self) -> bool:
        """Whether continuous batching serves this engine's calls now (on, and the lean step runs)."""
        return self.continuous and self._lean_decoder() is not None

    def pool(self) -> Any:
        """The :class:`reflrl.engines.continuous.DecodePool` that serves :meth:`agenerate` (shared by every
        coroutine of the event loop); its ``stats`` count what it served."""
        if self._pool is None:
            from .continuous import DecodePool

            self._pool = DecodePool(self, self.max_batch_size, self.kv_budget_bytes)
        return self._pool

    def _requests(self, prompts: list[list[int]], n: int, max_new_tokens: int | Sequence[int], temperature: float,
                  top_p: float, stop_ids: list[int] | None, seed: int, stop_when: Callable[[str], bool] | None) -> list:
        """The pool's requests of one call, validated as :meth:`generate` validates; prompt i samples from
        seed ``derive_seed(seed, i)`` (row j of it from ``derive_seed(that, j)``)."""
        from reflrl.envs.seeding import derive_seed

        from .continuous import Request

        caps = self._check(prompts, n, max_new_tokens, top_p)
        stop = frozenset(([] if self.eos_id is None else [self.eos_id]) if stop_ids is None else stop_ids)
        return [Request(list(p), n, caps[i], float(temperature), float(top_p), stop, derive_seed(int(seed), i),
                        index=i, stop_when=stop_when) for i, p in enumerate(prompts)]

    def _check(self, prompts: list[list[int]], n: int, max_new_tokens: int | Sequence[int], top_p: float) -> list[int]:
        if n < 1:
            raise ValueError(f"n={n}: must be >= 1")
        caps = per_prompt_caps(max_new_tokens, len(prompts))
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p={top_p}: must be in (0, 1]")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
        return caps

    async def agenerate(
        self,
        prompts: list[list[int]],
        n: int = 1,
        max_new_tokens: int | Sequence[int] = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_ids: list[int] | None = None,
        seed: int = 0,
        stop_when: Callable[[str], bool] | None = None,
        held: bool = False,
    ) -> list[Sample]:
        """:meth:`generate` as an awaitable. With continuous batching the prompts join the engine's shared
        decode loop (other coroutines' requests decode in the same steps, rows refill as they finish);
        otherwise ``generate`` runs in a worker thread. Same samples as ``generate`` with the same arguments
        (up to float rounding from the rows that share a step). ``held``: the caller takes part in the
        pool's lockstep (:meth:`hold`, :meth:`release`; :meth:`reflrl.engines.continuous.DecodePool.serve`)."""
        if not self._pooled():
            import asyncio
            import functools

            call = functools.partial(self.generate, prompts, n, max_new_tokens, temperature, top_p, stop_ids, seed,
                                     stop_when)
            return await asyncio.get_running_loop().run_in_executor(None, call)
        reqs = self._requests(prompts, n, max_new_tokens, temperature, top_p, stop_ids, seed, stop_when)
        await self.pool().serve(reqs, held=held)
        return [s for r in reqs for s in r.samples]

    def hold(self, k: int = 1) -> None:
        """``k`` coroutines are about to submit through :meth:`agenerate` with ``held=True``: the shared loop
        waits for them before its next decode step (a no-op without continuous batching)."""
        if self._pooled():
            self.pool().hold(k)

    def release(self, k: int = 1) -> None:
        """``k`` holders will submit nothing more (see :meth:`hold`)."""
        if self._pool is not None:
            self._pool.release(k)

    def _weights(self) -> FusedWeights:
        """The decode step's weight cache (concatenated, packed where ``packed``), kept across calls and
        shared by every engine of the same model (a run's rollout and evaluation engines hold one copy)."""
        per_model = _DECODE_WEIGHTS.setdefault(self.model, {})
        key = (self.packed, self.matmul.dtypes if self.matmul is not None else None)
        if key not in per_model:
            per_model[key] = FusedWeights(packed=self.packed, native=self.matmul)
        return per_model[key]

    @property
    def _relaid(self) -> bool:
        """Whether the lean decode step's weights may be held in another layout (packed or native)."""
        return (self.packed or self.matmul is not None) and self.lean and lean_supports(self.model)

    def training_forwards(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """The trainer's forward passes through ``model`` (a warm-up, an update) within this context multiply
        by the decode step's packed copies of its frozen float32 layers
        (:func:`reflrl.engines.lean_decode.packed_frozen_layers`); a plain context where nothing is packed."""
        if model is self.model and self._relaid:
            return packed_frozen_layers(self.model, self._weights())
        return contextlib.nullcontext()

    def on_weights_changing(self, model: nn.Module) -> None:
        """Before optimiser steps on ``model`` (an update, a warm-up): the decode step's copies of the
        trained parameters are dropped now rather than rebuilt after (:meth:`FusedWeights.drop_trainable`),
        so the update's activations can use their memory."""
        for fused in _DECODE_WEIGHTS.get(model, {}).values():
            fused.drop_trainable(model)

    def release_unused_weights(self, model: nn.Module) -> int:
        """Give back the pages of ``model``'s plain weights that the decode step's packed copies stand in for
        (its frozen float32 layers, where they are mapped from a file: :meth:`FusedWeights.release_frozen`),
        after something else read them (a checkpoint saved). Returns the bytes advised."""
        return sum(f.release_frozen(model) for f in _DECODE_WEIGHTS.get(model, {}).values())

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output head's weight and bias as the decode step multiplies by them
        (``packed.dense(h.float(), *head)``: float32, packed where ``packed``)."""
        _, weight, bias = head_of(self.model)
        return self._weights().head(weight, bias)

    def _lean_decoder(self) -> LeanDecoder | None:
        """The lean decode step for the model as it is now, or None (transformers forward)."""
        if not self.lean or not growable(self.model.config) or not lean_supports(self.model):
            return None
        return LeanDecoder(self.model, self._weights(), attention=self.attention)

    @property
    def device(self) -> torch.device:
        """The model's device (``train.device``): every tensor the engine makes goes there."""
        return next(self.model.parameters()).device

    def update_weights(self, model: nn.Module) -> None:
        """Sample from ``model`` from now on (the same object is shared, so usually a no-op)."""
        self.model = model

    def greedy(
        self, prompts: list[list[int]], max_new_tokens: int = 256, stop_ids: list[int] | None = None
    ) -> list[Sample]:
        """Greedy decoding (temperature 0), one completion per prompt, for evaluation."""
        return self.generate(prompts, 1, max_new_tokens, temperature=0.0, stop_ids=stop_ids)

    def generate(
        self,
        prompts: list[list[int]],
        n: int = 1,
        max_new_tokens: int | Sequence[int] = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_ids: list[int] | None = None,
        seed: int = 0,
        stop_when: Callable[[str], bool] | None = None,
    ) -> list[Sample]:
        """See :meth:`RolloutEngine.generate`. Prompts must be non-empty lists of token ids. A row
        leaves the decoding batch as soon as it samples a stop id, reaches its prompt's cap, or its
        text satisfies ``stop_when``, so short answers cost no more than their tokens. With continuous
        batching (``continuous``), the call's prompts are served by one :class:`DecodePool` of
        ``max_batch_size`` rows whose finished rows are refilled from the prompts still waiting."""
        with generation_lock(self.model):  # one generation at a time on a model (base.generation_lock)
            caps = self._check(prompts, n, max_new_tokens, top_p)
            if self._pooled():
                return self._generate_pooled(prompts, n, caps, temperature, top_p, stop_ids, seed, stop_when)
            if stop_ids is None:
                stop_ids = [] if self.eos_id is None else [self.eos_id]
            t0 = time.perf_counter()
            self.last_stats = GenerateStats(prompts=len(prompts), samples=len(prompts) * n)
            gen = torch.Generator().manual_seed(int(seed))
            was_training = self.model.training
            self.model.eval()
            try:
                with torch.inference_mode(), fast_decoding(self.model):
                    w32, b32 = self.head()
                    per_group = self.prompts_per_batch(prompts, caps, n)
                    out: list[Sample] = []
                    for s in range(0, len(prompts), per_group):
                        out.extend(
                            self._generate_group(
                                prompts[s : s + per_group], s, n, caps[s : s + per_group], temperature,
                                top_p, stop_ids, gen, w32, b32, stop_when,
                            )
                        )
            finally:
                self.model.train(was_training)
            self.last_stats.seconds = time.perf_counter() - t0
            return out

    def _generate_pooled(self, prompts: list[list[int]], n: int, caps: list[int], temperature: float, top_p: float,
                         stop_ids: list[int] | None, seed: int, stop_when: Callable[[str], bool] | None) -> list[Sample]:
        from .continuous import DecodePool

        t0 = time.perf_counter()
        reqs = self._requests(prompts, n, caps, temperature, top_p, stop_ids, seed, stop_when)
        pool = DecodePool(self, self.max_batch_size, self.kv_budget_bytes)
        pool.run(reqs)
        pool.stats.seconds = time.perf_counter() - t0
        self.last_stats = pool.stats
        return [s for r in reqs for s in r.samples]

    def _prefill(self, decoder: nn.Module, prompts: list[list[int]], width: int,
                 capacity: int | None = None, sink: Sink | None = None) -> tuple[torch.Tensor, Any] | None:
        """Prompt forward pass: (last hidden state [num, hidden], KV cache left-padded to ``width``);
        see :meth:`_prefill_chunks`. With packed decode weights, its float32 layers multiply by them
        (:func:`reflrl.engines.lean_decode.packed_prefill`)."""
        if self._relaid:
            with packed_prefill(self.model, self._weights()):
                return self._prefill_chunks(decoder, prompts, width, capacity, sink)
        return self._prefill_chunks(decoder, prompts, width, capacity, sink)

    def _prefill_chunks(self, decoder: nn.Module, prompts: list[list[int]], width: int,
                        capacity: int | None = None, sink: Sink | None = None) -> tuple[torch.Tensor, Any] | None:
        """Prompt forward pass: (last hidden state [num, hidden], KV cache left-padded to ``width``).
        With a ``sink``, each chunk goes to ``sink(rows, h, cache)`` as soon as it is computed (its rows'
        indices in ``prompts``, their last hidden states, their cache left-padded to the chunk's own
        width) and nothing is merged or returned: the caller copies what it keeps, and the prefill holds
        one chunk's cache at a time.

        Prompts of very different lengths are prefilled in chunks of similar length
        (:func:`reflrl.engines.fast_decode.length_chunks`, at most 16 rows and :data:`PREFILL_CHUNK_TOKENS`
        padded tokens each), so padding costs little
        compute; each chunk's cache is copied into the call's one as soon as it is computed and then freed,
        so a prefill holds the call's cache and one chunk's at most (never every chunk's at once). The
        merged cache is the same as one left-padded prefill except in masked positions; it has room for
        ``capacity`` columns (default ``width + 64``: the decode writes its tokens there without a copy).
        Rows that begin with the same :data:`SHARED_PREFIX_MIN` or more tokens (the turns after the first
        of one task's rollouts, its reflection retries) run those tokens once (:meth:`_prefill_shared`),
        except on an engine whose trunk cache replays prompts seen before (the evaluations).
        """
        one = len(prompts) == 1 or not growable(self.model.config)
        trunk = self.trunk_cache if growable(self.model.config) else None
        depth = trunk.check() if trunk is not None else 0
        # rows keep their order inside a chunk, so a single chunk is the batch itself (its h and cache
        # rows are the prompts' rows as they are given)
        chunks: list[tuple[list[int], int]] = []  # (rows, tokens they share at the start: prefilled once)
        alone = list(range(len(prompts)))  # rows prefilled whole
        if one:
            chunks, alone = [(alone, 0)], []
        elif not depth:  # rows that share a long start (a group's turns, its retries) prefill it once
            alone = []
            for fam, shared in prefix_families(prompts, SHARED_PREFIX_MIN):
                # a family decodes together up to 16 rows: padding its rows' own tokens costs less than
                # the shared tokens it saves
                own = [len(prompts[i]) - shared for i in fam]
                subs = length_chunks(own, max_waste=1.0) if shared else [list(range(len(fam)))]
                for c in subs:
                    rows = sorted(fam[j] for j in c)
                    if shared and len(rows) > 1:
                        chunks.append((rows, shared))
                    else:
                        alone += rows
            alone.sort()
        if alone:
            chunks += [(sorted(alone[j] for j in c), 0)
                       for c in length_chunks([len(prompts[i]) for i in alone], max_tokens=PREFILL_CHUNK_TOKENS)]
        merged, hs = None, torch.empty(0)
        for idx, shared in chunks:
            chunk_prompts = [prompts[i] for i in idx]
            if shared:
                h, cache = self._prefill_shared(decoder, chunk_prompts, shared)
            else:
                h, cache = self._prefill_whole(decoder, chunk_prompts, trunk, depth)
            if sink is not None:
                sink(idx, h, cache)
                del cache
                continue
            if len(chunks) == 1:
                return h, cache
            if merged is None:
                hs = h.new_empty((len(prompts), h.shape[-1]))
                merged = left_padded_buffers(cache, len(prompts), width, capacity or width + 64)
            hs[torch.tensor(idx, device=h.device)] = h
            place_rows(merged, idx, cache)
            del cache  # the chunk's own cache is freed before the next chunk runs
        return None if sink is not None else (hs, merged)

    def _prefill_whole(self, decoder: nn.Module, prompts: list[list[int]], trunk: Any,
                       depth: int) -> tuple[torch.Tensor, Any]:
        """One chunk of :meth:`_prefill`, every prompt run whole, left-padded to the longest; with a trunk
        cache (``depth`` frozen layers) prompts seen before replay their bottom layers, new ones are stored."""
        dev = self.device
        cw = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), cw), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), cw), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, cw - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[r, cw - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)  # the model's device (train.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = growing_cache(self.model.config)

        def run() -> torch.Tensor:
            return decoder(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                           use_cache=True).last_hidden_state[:, -1]

        if depth and trunk.has_all(prompts):  # seen before: only the trainable top runs
            with trunk.replaying(*trunk.batch(prompts, cw, depth), depth):
                h = run()
            trunk.hits += len(prompts)
        elif depth:
            with trunk.capture(depth) as got:
                h = run()
            trunk.store(prompts, cache, got["h"], cw, depth)
            trunk.misses += len(prompts)
        else:
            h = run()
        self.last_stats.forward_calls += 1
        return h, cache

    def _prefill_shared(self, decoder: nn.Module, prompts: list[list[int]], shared: int) -> tuple[torch.Tensor, Any]:
        """:meth:`_prefill` of rows whose first ``shared`` tokens are the same: those tokens run once (one
        row), their keys/values are copied to every row, and only each row's own tokens run after them.
        The cache comes back left-padded as a plain prefill's: each row's shared keys/values are moved
        next to its own tokens (keys do not depend on the column, only on the position)."""
        dev = self.device
        rows = len(prompts)
        head = torch.tensor([prompts[0][:shared]], dtype=torch.long, device=dev)
        cache = growing_cache(self.model.config)
        decoder(input_ids=head, attention_mask=torch.ones_like(head),
                position_ids=torch.arange(shared, device=dev)[None], past_key_values=cache, use_cache=True)
        cache.batch_repeat_interleave(rows)
        own = [p[shared:] for p in prompts]
        ws = max(len(o) for o in own)
        ids = torch.full((rows, ws), self.pad_id, dtype=torch.long)
        mask = torch.zeros((rows, ws), dtype=torch.long)
        for r, o in enumerate(own):
            ids[r, ws - len(o):] = torch.tensor(o, dtype=torch.long)
            mask[r, ws - len(o):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = shared + (mask.cumsum(-1) - 1).clamp(min=0)
        full = torch.cat([torch.ones((rows, shared), dtype=torch.long, device=dev), mask], 1)
        h = decoder(input_ids=ids, attention_mask=full, position_ids=pos, past_key_values=cache,
                    use_cache=True).last_hidden_state[:, -1]
        self.last_stats.forward_calls += 2
        for r, o in enumerate(own):  # [shared | pad | own] -> [pad | shared | own]
            gap = ws - len(o)
            if gap:
                for lay in cache.layers:
                    for buf in (lay.kbuf, lay.vbuf):
                        buf[r, :, gap: gap + shared] = buf[r, :, :shared].clone()
        return h, cache

    def _generate_group(
        self,
        prompts: list[list[int]],
        offset: int,
        n: int,
        caps: list[int],
        temperature: float,
        top_p: float,
        stop_ids: list[int],
        gen: torch.Generator,
        w32: torch.Tensor,
        b32: torch.Tensor | None,
        stop_when: Callable[[str], bool] | None = None,
    ) -> list[Sample]:
        decoder = self.model.get_decoder()
        max_new = max(caps)
        st = self.last_stats
        num, width = len(prompts), max(len(p) for p in prompts)
        mask = torch.zeros((num, width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            mask[i, width - len(p) :] = 1
        mask = mask.to(self.device)
        st.prompt_tokens += int(mask.sum())
        t_pre = time.perf_counter()
        # room for the rows' new tokens and their n copies from the start: no reallocation while decoding
        h, cache = self._prefill(decoder, prompts, width, capacity=width + max_new)
        st.prefill_s += time.perf_counter() - t_pre
        t_dec = time.perf_counter()
        if n > 1:  # one prefill per prompt, copied to its n samples
            cache.batch_repeat_interleave(n)
            mask = mask.repeat_interleave(n, dim=0)
            h = h.repeat_interleave(n, dim=0)
        rows = num * n
        next_pos = mask.sum(-1)  # [R] position of the next token
        active = torch.arange(rows, device=mask.device)  # original row of each batch row
        stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=mask.device)
        toks: list[list[int]] = [[] for _ in range(rows)]
        lps: list[list[float]] = [[] for _ in range(rows)]
        finish: list[FinishReason] = ["length"] * rows
        row_cap = [caps[r // n] for r in range(rows)]
        texts = [""] * rows
        piece = PieceDecoder(self.tokenizer) if stop_when is not None else None
        lean = self._lean_decoder()
        if lean is not None:  # fixed-size KV buffers and mask for the whole decode (lean_decode's module doc)
            reserve(cache, width + max_new)
            amask = torch.zeros((rows, width + max_new), dtype=torch.bool, device=mask.device)
            amask[:, :width] = mask.bool()
        live = [True] * rows  # per batch row: still sampling
        for step in range(max_new):
            logits = dense(h.float(), w32, b32)
            tok, lp = sample_next(logits, temperature, top_p, gen, consume=True)
            stopped = torch.isin(tok, stop).tolist() if stop.numel() else [False] * len(live)
            for j, (r, t, l) in enumerate(zip(active.tolist(), tok.tolist(), lp.tolist())):
                if not live[j]:
                    continue  # a finished row kept in the batch: its token is ignored
                toks[r].append(t)
                lps[r].append(l)
                if stopped[j]:
                    finish[r] = "stop"
                    live[j] = False
                    continue
                if piece is not None:
                    texts[r] += piece(t)
                    if stop_when(texts[r]):
                        finish[r] = "stop"
                        live[j] = False
                        continue
                if len(toks[r]) >= row_cap[r]:
                    live[j] = False  # finish stays "length"
            n_live = sum(live)
            if step == max_new - 1 or n_live == 0:
                break
            st.decode_rows.append(n_live)
            # Finished rows leave the batch: at once on the transformers path; on the lean path only when at
            # most half the rows still sample (a step costs about the same for a few rows more, a compaction
            # copies the KV cache).
            if n_live < len(live) and (lean is None or 2 * n_live <= len(live)):
                keep = torch.tensor([j for j, x in enumerate(live) if x], dtype=torch.long, device=mask.device)
                cache.batch_select_indices(keep)
                mask, next_pos, active, tok = mask[keep], next_pos[keep], active[keep], tok[keep]
                if lean is not None:
                    amask = amask[keep]
                live = [True] * n_live
            if lean is not None:
                col = width + step
                amask[:, col] = True
                h = lean.step(tok, next_pos, col, amask[:, : col + 1], cache)
            else:
                mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype, device=mask.device)], dim=1)
                h = decoder(
                    input_ids=tok[:, None],
                    attention_mask=mask,
                    position_ids=next_pos[:, None],
                    past_key_values=cache,
                    use_cache=True,
                ).last_hidden_state[:, -1]
            st.forward_calls += 1
            next_pos = next_pos + 1
        st.new_tokens += sum(len(t) for t in toks)
        st.decode_s += time.perf_counter() - t_dec
        return [
            Sample(
                prompt_index=offset + r // n,
                prompt_ids=list(prompts[r // n]),
                token_ids=toks[r],
                logprobs=lps[r],
                finish_reason=finish[r],
            )
            for r in range(rows)
        ]
