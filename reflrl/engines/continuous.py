"""Continuous batching for :class:`~reflrl.engines.transformers_engine.TransformersEngine`: one decode loop
(:class:`DecodePool`) serves every generation request, and a row that finishes is refilled at once.

On a small CPU a decode step costs about the same for 4 rows as for 16 (the weights are read once per
step either way), so separate batches -- the rollouts, the turns after a fault, the reflection retries,
the evaluation episodes -- each pay full steps for few rows, and a batch whose rows finish early keeps
stepping for its longest one. The pool keeps one set of rows busy instead:

* **Requests** (:class:`Request`): one prompt, ``n`` samples, a token cap, sampling settings, a seed. The
  prompt is prefilled once (with the other prompts admitted at the same step, through the engine's prefill:
  length chunks, the frozen trunk's cache) and its keys/values copied to each of its ``n`` rows, chunk
  by chunk as the prefill computes them (the buffers are laid out first; no merged copy of the prompts'
  cache is made, and only a request with rows still waiting for a slot keeps a copy of its state).
* **Rows** are left-aligned in per-layer KV buffers ``[slots, kv_heads, width, head_dim]``: a row's token
  ``t`` sits in column ``t`` (its rotary position), and every row writes its own column each step
  (:meth:`reflrl.engines.lean_decode.LeanDecoder.step` with a column per row). The attention mask of a
  row covers exactly its own columns, so a row refilled into a slot that held a longer sequence never
  sees what was left there. The decode step's attention reads each span of neighbouring slots only as far
  as its longest row (:func:`attention_spans`), and a layout puts the live rows longest first.
* **Refill**: after each step's sampling, finished rows leave and pending requests are prefilled into the
  free slots before the next decode step; the rows of a request finish independently, the request is
  answered when its last row finishes.
* **KV budget** (``kv_budget_bytes``): the buffers hold at most that many bytes (slots x width x bytes per
  token, width = the longest prompt + cap among the rows). A request that does not fit waits for rows to
  finish; one that could not fit even alone is a ValueError naming it. Never an out-of-memory error from
  the pool's own buffers. They grow to the budget in at most a few steps and later layouts reuse them
  (:meth:`DecodePool._layout`), so an evaluation whose rows widen turn after turn keeps one set.
* **Seeds**: each row draws its sampling numbers from its own generator, seeded with
  ``derive_seed(request seed, sample index)``, so its tokens depend on its seed and logits, not on which
  other rows share the step or when it arrived (batch composition changes only float rounding).
* **Lockstep** (:meth:`DecodePool.hold`, ``serve(held=True)``, :meth:`DecodePool.release`): callers that take
  part (rollout episodes, reflection repairs) keep the loop from stepping while one of them is between two
  requests (a tool step, a critique). Which rows share each decode step then follows from the seed and the
  callers' logic, not from when a tool answered, so float rounding -- and with it every sample -- is the
  same on every run (without it, a tool that answers a little later can move a request to a later step).

Callers use it through the engine: :meth:`TransformersEngine.generate` (one call's prompts in one pool,
refilled as rows finish) and :meth:`TransformersEngine.agenerate` (awaitable, from asyncio code: every
coroutine's requests join the engine's shared pool while it runs, e.g. rollout turns that become ready
while others decode). The pool needs the lean decode step (:func:`reflrl.engines.lean_decode.supports`);
other models take the engine's batch path.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from reflrl.envs.seeding import derive_seed
from reflrl.memory import release_heap

from .base import FinishReason, GenerateStats, PieceDecoder, Sample, generation_lock
from .packed import dense

__all__ = ["DecodePool", "Request", "kv_bytes_per_token"]


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of keys and values one token of one row takes in the KV cache (every layer, its own dtype)."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    total = 0
    for layer in model.get_decoder().layers:
        size = layer.self_attn.k_proj.weight.element_size()
        total += 2 * cfg.num_key_value_heads * head_dim * size
    return total


@dataclass
class Request:
    """One prompt's ``n`` samples. ``index``: the prompt's index in its caller's list (``Sample.prompt_index``);
    ``seed``: row j samples from ``torch.Generator().manual_seed(derive_seed(seed, j))``."""

    prompt: list[int]
    n: int
    cap: int
    temperature: float
    top_p: float
    stop: frozenset[int]
    seed: int
    index: int = 0
    stop_when: Callable[[str], bool] | None = None
    samples: list[Sample | None] = field(default_factory=list)
    left: int = 0                                   # rows not finished yet
    future: Any = None                              # asyncio future (agenerate)
    grant: bool = False                             # answered: one hold per sample to the caller (serve)
    # prefilled state while rows of the request still wait for a slot: (keys, values per layer, hidden)
    state: Any = None
    placed: int = 0                                 # rows already in a slot

    def __post_init__(self) -> None:
        self.samples = [None] * self.n
        self.left = self.n


SPAN_OVERHEAD = 512  # one more attention call costs about as much as reading this many rows x columns more


def attention_spans(needs: list[int], overhead: int | None = None) -> list[tuple[int, int, int]]:
    """Contiguous spans ``(first, end, width)`` of slots that the decode step's attention runs over apart
    (:meth:`reflrl.engines.lean_decode.LeanDecoder.step`): ``needs[i]`` = the columns slot ``i`` reads
    (0: idle, in no span). Chosen to read the fewest rows x columns, each span costing ``overhead`` more
    (an exact dynamic programme over the slots, O(slots^2)): one long row no longer widens every row's
    attention, and idle slots are read by none. ``overhead`` defaults to :data:`SPAN_OVERHEAD`."""
    overhead = SPAN_OVERHEAD if overhead is None else overhead
    n = len(needs)
    inf = float("inf")
    best = [0.0] + [inf] * n  # best[j]: the cost of covering slots [0, j)
    cut = [0] * (n + 1)  # where the last span of best[j] starts (-1: slot j-1 idle, left out)
    for j in range(1, n + 1):
        if needs[j - 1] == 0:
            best[j], cut[j] = best[j - 1], -1
        top = 0
        for a in range(j - 1, -1, -1):
            top = max(top, needs[a])
            if top == 0:
                break  # a span that ends on idle slots alone: never better than leaving them out
            c = best[a] + (j - a) * top + overhead
            if c <= best[j]:  # on a tie, the longer span (fewer calls)
                best[j], cut[j] = c, a
    spans: list[tuple[int, int, int]] = []
    j = n
    while j > 0:
        a = cut[j]
        if a < 0:
            j -= 1
            continue
        spans.append((a, j, max(needs[a:j])))
        j = a
    return spans[::-1]


class _Row:
    __slots__ = ("req", "j", "gen", "toks", "lps", "text", "length", "tok")

    def __init__(self, req: Request, j: int):
        self.req, self.j = req, j
        self.gen = torch.Generator().manual_seed(derive_seed(req.seed, j))
        self.toks: list[int] = []
        self.lps: list[float] = []
        self.text = ""
        self.length = len(req.prompt)  # tokens in the cache
        self.tok = 0                    # last sampled token (fed at the next decode step)


class _Layer:
    """One layer's keys and values: ``kbuf``/``vbuf`` [slots, kv_heads, width, head_dim] are views of the
    front of ``kflat``/``vflat``, flat buffers that outlive a relayout when it fits in them."""

    __slots__ = ("kbuf", "vbuf", "kflat", "vflat")

    def __init__(self, kbuf: torch.Tensor, vbuf: torch.Tensor, kflat: torch.Tensor, vflat: torch.Tensor):
        self.kbuf, self.vbuf, self.kflat, self.vflat = kbuf, vbuf, kflat, vflat


class _Cache:
    """What :meth:`LeanDecoder.step` reads: ``layers[i].kbuf / .vbuf``."""

    def __init__(self, layers: list[_Layer]):
        self.layers = layers


class DecodePool:
    """The continuous-batching decode loop over ``engine``'s model (module doc).

    max_rows: rows decoding together at most; kv_budget_bytes: the KV buffers' size at most (None: no
    limit). ``stats``: a :class:`GenerateStats` of everything served (``decode_rows``: active rows per
    decode step; ``extra["slots"]``: buffer rows per decode step)."""

    def __init__(self, engine: Any, max_rows: int = 64, kv_budget_bytes: int | None = None):
        self.engine = engine
        self.max_rows = max(1, int(max_rows))
        self.kv_budget_bytes = None if kv_budget_bytes is None else int(kv_budget_bytes)
        self.stats = GenerateStats()
        self.stats.extra["slots"] = []
        self.pending: deque[Request] = deque()
        self._inbox: list[Request] = []
        self._driver: asyncio.Task | None = None
        self._event: asyncio.Event | None = None
        self.held = 0  # holds out (lockstep: the loop waits while any is)
        self._reset()

    # ----------------------------------------------------------------------------------- state
    def _reset(self) -> None:
        self.slots: list[_Row | None] = []
        self.cache: _Cache | None = None
        self.width = 0
        self.h: torch.Tensor | None = None
        self._lean = None

    def _setup(self) -> None:
        """Per burst of work: the decode step and head weights as the model is now."""
        eng = self.engine
        self._lean = eng._lean_decoder()
        if self._lean is None:
            raise ValueError("DecodePool needs the lean decode step (a Llama-family model without LoRA)")
        self._w32, self._b32 = eng.head()
        self._bpt = kv_bytes_per_token(eng.model)
        self._piece = PieceDecoder(eng.tokenizer)

    @property
    def busy(self) -> bool:
        return bool(self.pending or self._inbox or any(s is not None for s in self.slots))

    def _fits(self, rows: int, width: int) -> bool:
        return self.kv_budget_bytes is None or rows * width * self._bpt <= self.kv_budget_bytes

    # ----------------------------------------------------------------------------------- admission
    def _admit(self) -> None:
        """Fill free slots from the pending requests (FIFO), prefilling the prompts not yet prefilled;
        reallocate the buffers when the rows need more slots or columns, or when half the slots are idle."""
        live = [s for s in self.slots if s is not None]
        free = len(self.slots) - len(live)
        take: list[tuple[Request, int]] = []
        need_w = max((len(r.req.prompt) + r.req.cap for r in live), default=0)
        queue = [(req, j) for req in self.pending for j in range(req.placed, req.n)]
        for req, j in queue:
            w = max(need_w, len(req.prompt) + req.cap)
            rows = len(live) + len(take) + 1
            if rows > self.max_rows:
                break
            in_place = len(take) < free and w <= self.width
            if not in_place and not self._fits(rows, w):
                if not live and not take:
                    raise ValueError(f"a request of {len(req.prompt)} prompt tokens + {req.cap} new tokens needs "
                                     f"{w * self._bpt} bytes of KV cache, over the pool's budget of "
                                     f"{self.kv_budget_bytes} bytes")
                break
            take.append((req, j))
            need_w = w
        if not take:
            if live and 2 * len(live) <= len(self.slots) and len(self.slots) > 1 and not self.pending:
                self._layout(live, need_w)  # compact: half the slots idle and nothing to refill them with
            return
        if len(take) > free or need_w > self.width:
            self._layout(live, need_w, extra=len(take))
        free_idx = [i for i, s in enumerate(self.slots) if s is None]
        slots_of: dict[int, list[int]] = {}  # id(request) -> the slots its rows take now
        for (req, _j), i in zip(take, free_idx):
            slots_of.setdefault(id(req), []).append(i)
        fresh: list[Request] = []  # to prefill now; the others were prefilled before and kept their state
        for req in {id(r): r for r, _ in take}.values():
            if req.state is None:
                fresh.append(req)
            else:
                keys, values, h = req.state
                for i in slots_of[id(req)]:
                    self._place(i, keys, values, h)
        if fresh:
            self._prefill(fresh, slots_of)
        for (req, j), i in zip(take, free_idx):
            self.slots[i] = _Row(req, j)
            req.placed += 1
            if req.placed == req.n:
                req.state = None
                self.pending.remove(req)
        self.stats.samples += len(take)

    def _place(self, i: int, keys: list[torch.Tensor], values: list[torch.Tensor], h: torch.Tensor) -> None:
        """A prompt's keys/values [kv_heads, p, head_dim] per layer and last hidden state into slot ``i``."""
        p = keys[0].shape[-2]
        for li, lay in enumerate(self.cache.layers):
            lay.kbuf[i, :, :p] = keys[li]
            lay.vbuf[i, :, :p] = values[li]
        self.h[i] = h.to(self.h.dtype)

    def _prefill(self, reqs: list[Request], slots_of: dict[int, list[int]]) -> None:
        """Prefill ``reqs`` and copy each chunk of the prefill into its rows' slots as soon as it is
        computed (nothing merged: the buffers and one chunk's cache at a time); a request with rows still
        waiting for a slot keeps a copy of its state."""
        eng = self.engine

        def sink(idx: list[int], h: torch.Tensor, cache: Any) -> None:
            cw = cache.layers[0].keys.shape[-2]
            for r, k in enumerate(idx):
                req, p = reqs[k], len(reqs[k].prompt)
                keys = [lay.keys[r, :, cw - p: cw] for lay in cache.layers]
                values = [lay.values[r, :, cw - p: cw] for lay in cache.layers]
                placed = slots_of.get(id(req), [])
                for i in placed:
                    self._place(i, keys, values, h[r])
                if req.placed + len(placed) < req.n:
                    req.state = ([x.clone() for x in keys], [x.clone() for x in values], h[r].clone())

        prompts = [r.prompt for r in reqs]
        eng._prefill(eng.model.get_decoder(), prompts, max(len(p) for p in prompts), sink=sink)
        self.stats.prompts += len(reqs)
        self.stats.prompt_tokens += sum(len(p) for p in prompts)
        self.stats.forward_calls += 1

    def _layout(self, live: list[_Row], width: int, extra: int = 0) -> None:
        """Buffers of ``len(live) + extra`` slots x ``width`` columns holding the live rows (first, longest
        first: rows of like lengths side by side make the decode step's attention spans narrow).

        Each layer's buffers are views of flat buffers that a later layout reuses when it fits in them
        (rows x width at most their capacity): the live rows are moved inside them, through a copy of
        those rows alone, and nothing else is allocated, so a pool whose shape changes step after step
        (an evaluation's rows widen as its episodes grow) keeps one set of buffers instead of leaving the
        heap a trail of freed ones of every earlier size. When they must grow, they grow to the KV
        budget at once (or twice their size, when that is less; without a budget, to what the layout
        needs), layer by layer: each layer's old buffers are dropped as soon as its rows are copied, so a
        growth holds the new buffers and one layer's old ones at most, never two whole caches. Columns
        past a row's length hold whatever was there (zeros or an earlier row's keys): the mask hides them."""
        old = sorted((i for i, s in enumerate(self.slots) if s is not None), key=lambda i: -self.slots[i].length)
        rows = len(live) + extra
        model = self.engine.model
        cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        hkv = cfg.num_key_value_heads
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dev = self.engine.device
        idx = torch.tensor(old, dtype=torch.long, device=dev)
        need = rows * width * hkv * hd  # elements per buffer
        have = self.cache.layers[0].kflat.numel() if self.cache is not None else 0
        if have < need:  # they grow (every layer holds the same number of elements)
            size = need if self.kv_budget_bytes is None else min(
                self.kv_budget_bytes // self._bpt * hkv * hd, max(need, 2 * have))
            if not old:
                self.cache = None  # no row to keep: the old buffers go before the new ones are made
        w = min(width, self.width)
        moved = old != list(range(len(old))) or width != self.width  # otherwise slot i keeps its place
        layers = []
        for li, layer in enumerate(model.get_decoder().layers):
            prev = self.cache.layers[li] if self.cache is not None else None
            if have >= need:  # in place: the live rows alone are copied out (indexing copies) and back
                kflat, vflat = prev.kflat, prev.vflat
                keep = (prev.kbuf[idx, :, :w], prev.vbuf[idx, :, :w]) if old and moved else None
            else:
                dt = layer.self_attn.k_proj.weight.dtype
                kflat = torch.zeros(size, dtype=dt, device=dev)
                vflat = torch.zeros_like(kflat)
                keep = (prev.kbuf[idx, :, :w], prev.vbuf[idx, :, :w]) if old else None
            kb = kflat[:need].view(rows, hkv, width, hd)
            vb = vflat[:need].view(rows, hkv, width, hd)
            if keep is not None:
                kb[: len(old), :, :w] = keep[0]
                vb[: len(old), :, :w] = keep[1]
            del keep, prev
            if self.cache is not None:
                self.cache.layers[li] = None  # its rows are copied: an old layer's memory goes now
            layers.append(_Layer(kb, vb, kflat, vflat))
        hidden = model.config.get_text_config(decoder=True).hidden_size if hasattr(
            model.config, "get_text_config") else model.config.hidden_size
        h = torch.zeros((rows, hidden), dtype=self.h.dtype if self.h is not None else self._h_dtype(), device=dev)
        if old:
            h[: len(old)] = self.h[idx]
        self.cache, self.width, self.h = _Cache(layers), width, h
        self.slots = [self.slots[i] for i in old] + [None] * extra

    def _h_dtype(self) -> torch.dtype:
        return self.engine.model.get_decoder().norm.weight.dtype

    # ----------------------------------------------------------------------------------- one step
    def iterate(self) -> list[Request]:
        """Admit pending requests, sample one token for every live row, retire finished rows, run one
        decode step for the rest. Returns the requests answered at this step (``req.samples`` complete).
        An admission that prefilled or laid the buffers out again gives the C heap's free memory back
        (:func:`reflrl.memory.release_heap`, a few ms): what the prefill and the old buffers used would
        otherwise stay resident, fragmented, under the next allocations.
        Its time is counted in ``stats``: admission (prefill, the rows' copies) in ``prefill_s``, the head,
        sampling and decode step in ``decode_s``."""
        t0 = time.perf_counter()
        shape, prompts = (len(self.slots), self.width), self.stats.prompts
        self._admit()
        if self.stats.prompts != prompts or (len(self.slots), self.width) != shape:
            release_heap()  # the prefill's activations, a relayout's old buffers: back to the system now
        t1 = time.perf_counter()
        self.stats.prefill_s += t1 - t0
        try:
            return self._sample_and_step()
        finally:
            self.stats.decode_s += time.perf_counter() - t1

    def _sample_and_step(self) -> list[Request]:
        active = [i for i, s in enumerate(self.slots) if s is not None]
        if not active:
            return []
        logits = dense(self.h[torch.tensor(active, device=self.h.device)].float(), self._w32, self._b32)
        rows = [self.slots[i] for i in active]
        tok = torch.empty(len(active), dtype=torch.long)
        lp = torch.empty(len(active), dtype=torch.float32)
        groups: dict[tuple[float, float], list[int]] = {}
        for a, r in enumerate(rows):
            groups.setdefault((r.req.temperature, r.req.top_p), []).append(a)
        for (temp, top_p), members in groups.items():
            sel = torch.tensor(members, device=logits.device)
            part = logits if len(members) == len(rows) else logits[sel]
            u = None if temp <= 0 else torch.cat([torch.rand((1, 1), generator=rows[a].gen) for a in members])
            t, l = self.engine.sample(part, temp, top_p, None, consume=True, uniforms=u)
            tok[torch.tensor(members)] = t.cpu()
            lp[torch.tensor(members)] = l.float().cpu()
        done: list[Request] = []
        going: list[int] = []
        for i, r, t, l in zip(active, rows, tok.tolist(), lp.tolist()):
            r.toks.append(t)
            r.lps.append(l)
            finish: FinishReason | None = None
            if t in r.req.stop:
                finish = "stop"
            elif r.req.stop_when is not None:
                r.text += self._piece(t)
                if r.req.stop_when(r.text):
                    finish = "stop"
            if finish is None and len(r.toks) >= r.req.cap:
                finish = "length"
            if finish is None:
                r.tok = t
                going.append(i)
                continue
            self.slots[i] = None
            req = r.req
            req.samples[r.j] = Sample(req.index, list(req.prompt), r.toks, r.lps, finish)
            self.stats.new_tokens += len(r.toks)
            req.left -= 1
            if req.left == 0:
                done.append(req)
        if going:
            self._decode(going)
        return done

    def _decode(self, going: list[int]) -> None:
        dev = self.h.device
        n = len(self.slots)
        tok = [0] * n
        pos = [0] * n
        for i in going:
            r = self.slots[i]
            tok[i], pos[i] = r.tok, r.length
        pos_t = torch.tensor(pos, dtype=torch.long, device=dev)
        width = max(pos) + 1
        mask = torch.arange(width, device=dev)[None, :] <= pos_t[:, None]
        needs = [0] * n
        for i in going:
            needs[i] = pos[i] + 1
        # the native attention kernel reads each row as far as its own length; SDPA reads spans of rows
        reads = {"widths": needs} if self._lean.attention is not None else {"spans": attention_spans(needs)}
        self.h = self._lean.step(torch.tensor(tok, dtype=torch.long, device=dev), pos_t, pos_t, mask, self.cache,
                                 **reads)
        for i in going:
            self.slots[i].length += 1
        self.stats.forward_calls += 1
        self.stats.decode_rows.append(len(going))
        self.stats.extra["slots"].append(n)

    # ----------------------------------------------------------------------------------- serving
    def _context(self):
        """inference mode and eval mode around pool work (restored after)."""
        import contextlib

        model = self.engine.model

        @contextlib.contextmanager
        def ctx():
            was = model.training
            model.eval()
            try:
                with torch.inference_mode():
                    yield
            finally:
                model.train(was)

        return ctx()

    def run(self, requests: list[Request]) -> None:
        """Serve ``requests`` to the end in this thread (``req.samples`` filled)."""
        if self.busy:
            raise RuntimeError("DecodePool.run: the pool is already serving requests")
        self.pending.extend(requests)
        try:
            with generation_lock(self.engine.model), self._context():
                self._setup()
                while self.pending or any(s is not None for s in self.slots):
                    self.iterate()
        finally:
            self.pending.clear()
            self._reset()

    # ----------------------------------------------------------------------------------- lockstep
    def hold(self, k: int = 1) -> None:
        """``k`` callers are about to submit: the shared loop runs no decode step until each has submitted a
        request made with ``held=True`` or called :meth:`release` (see :meth:`serve`)."""
        self.held += int(k)

    def release(self, k: int = 1) -> None:
        """``k`` holders are done (will submit nothing more)."""
        self.held = max(0, self.held - int(k))
        self._wake()

    def _wake(self) -> None:
        if self._event is not None:
            self._event.set()

    async def serve(self, requests: list[Request], held: bool = False) -> None:
        """Serve ``requests`` in the shared loop of this pool (started if idle); returns when all are answered.
        Decode steps run in a worker thread, one at a time; requests submitted by other coroutines join at
        the next step, in the order of their seeds.

        ``held``: the caller holds one of the pool's holds (:meth:`hold`) and gives it back by submitting; each
        answered request hands one hold per sample back to the caller, who submits its next request with
        ``held=True`` or :meth:`release`-s it. While any hold is out the loop waits, so which requests share
        a decode step follows from the callers' logic (an episode's tool step finishes before the next
        decode step), not from when a tool happened to answer: the same seed gives the same steps, rows and
        float rounding on every run."""
        loop = asyncio.get_running_loop()
        for r in requests:
            r.future = loop.create_future()
            r.grant = held
        if held:
            self.held = max(0, self.held - 1)
        self._inbox.extend(requests)
        self._wake()
        if self._driver is None or self._driver.done():
            self._driver = loop.create_task(self._drive())
        await asyncio.gather(*(r.future for r in requests))

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        failed: BaseException | None = None
        model = self.engine.model
        was_training = model.training
        model.eval()  # for the whole burst: a nested generate restores eval mode, not a mode read mid-burst
        self._event = asyncio.Event()
        try:
            await loop.run_in_executor(None, self._locked_setup)
            while True:
                while self.held > 0:  # callers holding a hold are still to submit (lockstep, serve's doc)
                    self._event.clear()
                    await self._event.wait()
                if self._inbox:
                    self.pending.extend(sorted(self._inbox, key=lambda r: (r.seed, r.index)))
                    self._inbox.clear()
                if not self.pending and not any(s is not None for s in self.slots):
                    break
                done = await loop.run_in_executor(None, self._step_in_context)
                for req in done:
                    if req.grant:
                        self.held += req.n
                    if not req.future.done():
                        req.future.set_result(None)
        except BaseException as e:  # noqa: BLE001 - delivered to every waiting request
            failed = e
        finally:
            model.train(was_training)
            self.held, self._event = 0, None
            waiting = list(self.pending) + list(self._inbox) + [s.req for s in self.slots if s is not None]
            self.pending.clear()
            self._inbox.clear()
            self._reset()
            for req in waiting:
                if req.future is not None and not req.future.done():
                    req.future.set_exception(failed or RuntimeError("decode pool stopped"))
        if failed is not None and not isinstance(failed, Exception):
            raise failed

    def _locked_setup(self) -> None:
        with generation_lock(self.engine.model):
            self._setup()

    def _step_in_context(self) -> list[Request]:
        # inference mode is thread-local: entered in the worker thread that runs the step
        with generation_lock(self.engine.model), torch.inference_mode():
            return self.iterate()
