"""One decode step of a Llama-family decoder in plain torch ops, for the CPU sampling loop.

A transformers forward costs far more than its matmuls when it runs one token per row: module calls
and their hooks, a causal mask built anew every step, rotary tables recomputed, casts at precision
boundaries. On 2 CPU cores that overhead is several times the arithmetic of a 135M model at small
batch. :class:`LeanDecoder` runs the same layers -- the model's own parameters, no copy -- with about a
third of the operations:

* the KV cache is the engine's :class:`~reflrl.engines.fast_decode.GrowingLayer` buffers, written in
  place at one shared column per step (rows are left-padded, so every row writes the same column);
* the attention mask is kept as a boolean [rows, columns] tensor and extended by one column a step;
* the rotary angles of the step's positions come from a table built once per call;
* one-token grouped-query attention reads keys/values in place: SDPA with
  :func:`fast_decode.gqa_decode_attention`'s layout trick (with the continuous pool each span of rows
  reading only as many columns as its longest row), or the native kernel
  (:mod:`reflrl.engines.native_attention`, ``rollout.decode_attention``), each row reading only its own
  columns, which also rotates q and k, writes the cache column and runs the RMSNorms;
* q/k/v and the MLP's gate/up run as one matmul each, over concatenated weights (:class:`FusedWeights`,
  rebuilt only for layers whose parameters changed), and q and k are rotated together;
* finished rows stay in the batch until few remain (the engine decides): at small batch a step costs
  about the same for 8 rows as for 32, because the weights are read once per step either way.

The arithmetic is the model's: RMSNorm in float32 then cast back and scaled by its weight, rotary in
the layer's dtype, SDPA, SiLU-gated MLP, each layer in its own parameters' dtype with the hidden state
cast at the boundary as :func:`reflrl.trainable.apply_trainable`'s hooks do. Outputs agree with the
transformers forward to float rounding (tested), so sampled log-probs agree with what the trainer
recomputes.

Supported: decoders of ``model_type`` llama, mistral (no sliding window) and qwen2 (biased q/k/v), default
rotary, SiLU. :func:`supports` says whether a model qualifies; the engine falls back to the transformers
forward otherwise (LoRA-wrapped models, other architectures).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from reflrl.memory import release_file_pages

from . import packed as _packed

_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


def _text_config(model: nn.Module) -> Any:
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def supports(model: nn.Module) -> bool:
    """Whether :class:`LeanDecoder` can run ``model`` (a plain transformers Llama-family causal LM)."""
    try:
        cfg = _text_config(model)
        dec = model.get_decoder()
        layers = dec.layers
    except AttributeError:
        return False
    if getattr(cfg, "model_type", None) not in _TYPES or getattr(cfg, "hidden_act", None) != "silu":
        return False
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return False
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return False
    if type(model).__name__.startswith("Peft") or any("lora" in n for n, _ in model.named_modules()):
        return False
    attn = layers[0].self_attn
    return all(hasattr(attn, k) for k in ("q_proj", "k_proj", "v_proj", "o_proj")) and \
        hasattr(layers[0].mlp, "gate_proj") and hasattr(dec, "rotary_emb")


def _rms(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' LlamaRMSNorm (float32 statistics, cast back, scaled by the weight) in one fused
    normalisation (the same formula: x * rsqrt(mean(x^2) + eps))."""
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)


def _stamp(params: list[torch.Tensor]) -> tuple:
    return tuple((id(p), p._version) for p in params)


class FusedWeights:
    """Per layer, the q/k/v projections as one [q+k+v, hidden] matrix and the MLP's gate/up as one
    [2 x intermediate, hidden] matrix: fewer, larger matmuls per decode step. Kept across ``generate``
    calls and rebuilt for a layer whose parameters changed (an optimiser step bumps their version), so
    the frozen bottom layers are concatenated once per run and the trained top ones once per update.

    ``packed``: float32 matrices are kept packed for oneDNN instead (:mod:`reflrl.engines.packed`), the
    output and down projections and the output head (:meth:`head`) too; other dtypes stay plain.
    ``native``: a :class:`reflrl.engines.native_matmul.MatmulChoice`: the matrices of the dtypes it takes are
    laid out for the native kernel instead (before ``packed``'s), those four and the head alike."""

    def __init__(self, packed: bool = False, native: Any = None) -> None:
        self.packed = bool(packed)
        self.native = native if native is not None and native.enabled else None
        self.layers: dict[int, tuple] = {}
        self._head: tuple | None = None

    @property
    def any_packed(self) -> bool:
        """Whether some matrix may be held in another layout than the model's (packed or native)."""
        return self.packed or self.native is not None

    def _pack(self, w: torch.Tensor) -> Any:
        p = self.native.pack(w) if self.native is not None else None
        if p is None and self.packed:
            p = _packed.pack(w)
        return w if p is None else p

    def get(self, li: int, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                                      torch.Tensor, torch.Tensor]:
        """(q/k/v, its bias or None, gate/up, o_proj, down_proj) weights for :func:`packed.dense`."""
        at, m = layer.self_attn, layer.mlp
        params = [at.q_proj.weight, at.k_proj.weight, at.v_proj.weight, m.gate_proj.weight, m.up_proj.weight,
                  at.o_proj.weight, m.down_proj.weight]
        biases = [b for b in (at.q_proj.bias, at.k_proj.bias, at.v_proj.bias) if b is not None]
        stamp = _stamp(params + biases)
        hit = self.layers.get(li)
        if hit is None or hit[0] != stamp:
            with torch.no_grad():
                wqkv = self._pack(torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight]))
                bqkv = torch.cat(biases) if len(biases) == 3 else None
                wgu = self._pack(torch.cat([m.gate_proj.weight, m.up_proj.weight]))
                wo, wd = self._pack(at.o_proj.weight), self._pack(m.down_proj.weight)
            hit = self.layers[li] = (stamp, wqkv, bqkv, wgu, wo, wd)
            release_file_pages(self._plain(layer, hit))
        return hit[1:]

    @staticmethod
    def _plain(layer: nn.Module, hit: tuple) -> list[torch.Tensor]:
        """The plain weights that the packed copies ``hit`` stand in for, where ``layer`` is frozen and all
        its matrices are packed (else none): every forward that runs through this cache (decode steps,
        prefills, training forwards) multiplies by the packed copies, so their pages can be given back
        where they are mapped from a file (:func:`reflrl.memory.release_file_pages`: a float32 model loaded
        from safetensors; about 0.25 GB for SmolLM2-135M's 18 frozen layers). A forward outside this cache
        (a checkpoint's ``save_pretrained``) reads them back from the file."""
        if any(p.requires_grad for p in layer.parameters()) or not all(
                _is_packed(w) for w in (hit[1], hit[3], hit[4], hit[5])):
            return []
        at, m = layer.self_attn, layer.mlp
        mods = (at.q_proj, at.k_proj, at.v_proj, at.o_proj, m.gate_proj, m.up_proj, m.down_proj)
        return [t for mod in mods for t in (mod.weight, mod.bias) if t is not None]

    def release_frozen(self, model: nn.Module) -> int:
        """Give back again the pages of every frozen layer's plain weights held here (:meth:`_plain`), after
        something read them (a checkpoint saved, a forward outside this cache). Returns the bytes advised."""
        layers = model.get_decoder().layers
        return release_file_pages([t for li, hit in self.layers.items() if li < len(layers)
                                   for t in self._plain(layers[li], hit)])

    def drop_trainable(self, model: nn.Module) -> int:
        """Forget the copies of ``model``'s layers (and head) that have a parameter with ``requires_grad``:
        an optimiser step is about to change them, so they would be rebuilt at the next use anyway, and
        meanwhile their memory (the packed float32 copies of the trained layers) is free for the update.
        Returns the bytes dropped."""
        def size(t: Any) -> int:
            if t is not None and not isinstance(t, torch.Tensor):
                return t.nbytes  # a native layout
            return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

        freed = 0
        layers = model.get_decoder().layers
        for li in [li for li in self.layers if li < len(layers)]:
            if any(p.requires_grad for p in layers[li].parameters()):
                freed += sum(size(t) for t in self.layers.pop(li)[1:])
        head = model.get_output_embeddings()
        if self._head is not None and head is not None and any(p.requires_grad for p in head.parameters()):
            freed += size(self._head[1]) + size(self._head[2])
            self._head = None
        return freed

    def head(self, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output head in float32 (packed where ``packed``), and its bias: the logits are
        ``packed.dense(h.float(), *head)``."""
        stamp = _stamp([weight] + ([bias] if bias is not None else []))
        if self._head is None or self._head[0] != stamp:
            with torch.no_grad():
                self._head = (stamp, self._pack(weight.float()), None if bias is None else bias.float())
        return self._head[1], self._head[2]


_dense = _packed.dense


def _is_packed(w: Any) -> bool:
    """Whether ``w`` is a copy in another layout (oneDNN's packed tensor or a native kernel's weight)."""
    return not isinstance(w, torch.Tensor) or w.is_mkldnn


class _SharedInput:
    """Linear modules that read the same input (q/k/v, gate/up) served by one product over their
    concatenated weight: the first call computes it and returns its own columns, the others return
    theirs from it when they get the same input tensor (as the transformers layers call them), and
    compute alone otherwise (and always for an input that requires grad: the packed copy has none)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, widths: list[int]) -> None:
        self.weight, self.bias = weight, bias
        self.bounds = [sum(widths[:i]) for i in range(len(widths) + 1)]
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward_of(self, j: int, module: nn.Module) -> Any:
        """The forward of the ``j``-th module of the group (``module``)."""
        lo, hi = self.bounds[j], self.bounds[j + 1]

        def forward(x: torch.Tensor) -> torch.Tensor:
            if x.requires_grad:
                return F.linear(x, module.weight, module.bias)
            if j == 0:
                self.last = (x, _dense(x, self.weight, self.bias))
            elif self.last is None or self.last[0] is not x:
                return F.linear(x, module.weight, module.bias)
            out = self.last[1][..., lo:hi]
            if j == len(self.bounds) - 2:
                self.last = None
            return out
        return forward


def _packed_linear(module: nn.Module, weight: torch.Tensor) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad:
            return F.linear(x, module.weight, module.bias)
        return _dense(x, weight, module.bias)
    return forward


@contextlib.contextmanager
def _packed_layers(model: nn.Module, fused: FusedWeights, which: Any) -> Iterator[int]:
    """Within the block, the transformers forward of the decoder layers ``which(li, layer)`` selects
    multiplies by ``fused``'s packed matrices where the layer has them; nested blocks restore what the
    enclosing one set. Yields the number of layers switched."""
    patched: list[tuple[nn.Module, Any]] = []
    try:
        for li, layer in enumerate(model.get_decoder().layers):
            if not which(li, layer):
                continue
            at, m = layer.self_attn, layer.mlp
            wqkv, bqkv, wgu, wo, wd = fused.get(li, layer)
            if not _is_packed(wqkv):
                continue
            qkv = _SharedInput(wqkv, bqkv, [at.q_proj.out_features, at.k_proj.out_features, at.v_proj.out_features])
            gu = _SharedInput(wgu, None, [m.gate_proj.out_features, m.up_proj.out_features])
            forwards = [(mod, qkv.forward_of(j, mod)) for j, mod in enumerate((at.q_proj, at.k_proj, at.v_proj))]
            forwards += [(mod, gu.forward_of(j, mod)) for j, mod in enumerate((m.gate_proj, m.up_proj))]
            forwards += [(at.o_proj, _packed_linear(at.o_proj, wo)), (m.down_proj, _packed_linear(m.down_proj, wd))]
            for mod, fwd in forwards:
                patched.append((mod, mod.__dict__.get("forward")))
                mod.forward = fwd
        yield len(patched) // 7
    finally:
        for mod, before in reversed(patched):
            if before is None:
                del mod.forward
            else:
                mod.forward = before


@contextlib.contextmanager
def packed_prefill(model: nn.Module, fused: FusedWeights) -> Iterator[int]:
    """Within the block, the transformers forward of ``model`` multiplies by ``fused``'s packed matrices
    where a layer has them (float32 layers of a packed cache): a prefill then runs its float32 products
    through oneDNN too, which on CPUs where PyTorch's BLAS takes a generic path for float32 is 2-2.5x as
    fast at prefill shapes (:mod:`reflrl.engines.packed`), and no weight is packed twice. For use under
    ``torch.inference_mode`` (the packed copies carry no gradient). Yields the number of layers switched."""
    if not fused.any_packed or torch.is_grad_enabled():
        yield 0
        return
    with _packed_layers(model, fused, lambda li, layer: True) as n:
        yield n


def _frozen(layer: nn.Module) -> bool:
    return not any(p.requires_grad for p in layer.parameters())


@contextlib.contextmanager
def packed_frozen_layers(model: nn.Module, fused: FusedWeights) -> Iterator[int]:
    """Within the block, a training forward of ``model`` (gradients on) multiplies by ``fused``'s packed
    matrices in its frozen layers (no parameter with ``requires_grad``) that have them: the float32 trunk
    of a float32 model, whose products autograd does not record anyway while nothing below them trains
    (an input that requires grad is multiplied by the plain weight, so gradients are never wrong). The
    same products up to float rounding, 2-2.3x as fast where PyTorch's float32 BLAS takes a generic path
    (:mod:`reflrl.engines.packed`); the packed copies are the decode step's, so nothing is packed twice.
    Yields the number of layers switched."""
    if not fused.any_packed:
        yield 0
        return
    with _packed_layers(model, fused, lambda li, layer: _frozen(layer)) as n:
        yield n


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LeanDecoder:
    """The decode step of ``model`` (see the module doc). Build one per ``generate`` call: it reads
    the parameters as they are then."""

    def __init__(self, model: nn.Module, fused: FusedWeights | None = None, attention: Any = None):
        cfg = _text_config(model)
        # the one-token attention: a reflrl.engines.native_attention.Kernel, or None (SDPA)
        self.attention = attention
        self.fused = fused if fused is not None else FusedWeights()
        dec = model.get_decoder()
        self.embed = dec.embed_tokens
        self.layers = list(dec.layers)
        self.norm = dec.norm
        self.rotary = dec.rotary_emb
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.qk_norm = hasattr(self.layers[0].self_attn, "q_norm")
        self.dtypes = [layer.self_attn.q_proj.weight.dtype for layer in self.layers]
        biased = [getattr(layer.self_attn, n).bias is not None for layer in self.layers for n in ("q_proj", "k_proj", "v_proj")]
        if any(biased) and not all(biased):
            raise ValueError("LeanDecoder: q/k/v projections with and without bias in one model")
        self.weights = [self.fused.get(li, layer) for li, layer in enumerate(self.layers)]

    def step(self, tok: torch.Tensor, pos: torch.Tensor, col: int | torch.Tensor, mask: torch.Tensor,
             cache: Any, spans: list[tuple[int, int, int]] | None = None,
             widths: list[int] | None = None) -> torch.Tensor:
        """One token per row: ``tok`` [B] ids at positions ``pos`` [B], written to cache column ``col``;
        ``mask`` [B, col + 1] bool (True = attend; the new column included). Returns the final normed
        hidden state [B, hidden] (what ``decoder(...).last_hidden_state[:, -1]`` returns).

        ``col`` may also be a [B] long tensor, one column per row (rows of different lengths, each
        left-aligned in its buffer row, as :mod:`.continuous` keeps them); attention then reads the
        first ``mask.shape[1]`` columns, and the mask hides what each row must not see.

        ``spans`` (with a column per row): attention runs over each span ``(first, end, width)`` of rows
        apart, reading only its first ``width`` columns (rows of one length need not read the columns of
        a longer one: the decode step's attention is bound by the keys/values it reads). Rows outside
        every span (idle slots) get a zero attention output. The masked-out columns a span leaves out add
        nothing to a row's attention, so each row's result is the full width's up to float rounding.

        ``widths`` (with a column per row): the columns each row reads (0: an idle slot, zero attention
        output), for the native attention kernel (``self.attention``), which reads every row only as far as
        its own width; without the kernel they are read as one span of the widest. With the kernel,
        ``spans`` give each of their rows the span's width."""
        b = tok.shape[0]
        per_row = isinstance(col, torch.Tensor)
        width = mask.shape[-1] if per_row else col + 1
        rows = torch.arange(b, device=tok.device) if per_row else None
        kernel = self.attention
        if kernel is not None:
            if widths is None:
                widths = [0] * b if spans is not None else [width] * b
                for a, e, w in spans or ():
                    widths[a:e] = [w] * (e - a)
            row_widths = torch.tensor(widths, dtype=torch.int32)
            kmask = mask if mask.stride(-1) == 1 else mask.contiguous()
            # rotary, cache write and attention in one call (not with q/k norms, which come between)
            fused = not self.qk_norm
            colv = col if per_row else torch.full((b,), col, dtype=torch.long)
        elif widths is not None and spans is None:
            top = max(widths, default=0)
            spans = [(0, b, top)] if top else []
        h = self.embed(tok)  # [B, H]
        emb_dtype = h.dtype
        cos, sin = self.rotary(h[:, None], pos[:, None])  # [B, 1, D] in emb dtype (as transformers)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, 1, D] against [B, heads, 1, D]
        rope = {emb_dtype: (cos, sin)}
        attn_mask = mask[:, None, None, :]  # [B, 1, 1, L]
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        g = nh // nkv
        for li, layer in enumerate(self.layers):
            dt = self.dtypes[li]
            if h.dtype != dt:
                h = h.to(dt)
            if dt not in rope:
                rope[dt] = (cos.to(dt), sin.to(dt))
            c, s = rope[dt]
            at = layer.self_attn
            wqkv, bqkv, wgu, wo, wd = self.weights[li]
            x = self._norm(h, layer.input_layernorm)
            qkv = _dense(x, wqkv, bqkv)
            lay = cache.layers[li]
            if kernel is not None and fused:
                o = kernel.rope_attention(qkv, c.reshape(b, hd), s.reshape(b, hd), colv, lay.kbuf, lay.vbuf, kmask,
                                          row_widths, nh, self.scaling)
            else:
                qkv = qkv.view(b, nh + 2 * nkv, 1, hd)
                if self.qk_norm:
                    qk = torch.cat([_rms(qkv[:, :nh], at.q_norm), _rms(qkv[:, nh: nh + nkv], at.k_norm)], 1)
                else:
                    qk = qkv[:, : nh + nkv]
                qk = _rotate(qk, c, s)  # q and k heads rotated together
                if per_row:
                    lay.kbuf[rows, :, col] = qk[:, nh:, 0]
                    lay.vbuf[rows, :, col] = qkv[:, nh + nkv:, 0]
                else:
                    lay.kbuf[:, :, col] = qk[:, nh:, 0]
                    lay.vbuf[:, :, col] = qkv[:, nh + nkv:, 0]
                q = qk[:, :nh].reshape(b, nkv, g, hd)
                if kernel is not None:
                    o = kernel(q, lay.kbuf, lay.vbuf, kmask, row_widths, self.scaling)  # [B, Hkv, G, D]
                elif spans is None:
                    o = F.scaled_dot_product_attention(q, lay.kbuf[:, :, :width], lay.vbuf[:, :, :width],
                                                       attn_mask=attn_mask, scale=self.scaling)  # [B, Hkv, G, D]
                else:
                    o = q.new_zeros(q.shape)
                    for a, e, w in spans:
                        o[a:e] = F.scaled_dot_product_attention(q[a:e], lay.kbuf[a:e, :, :w], lay.vbuf[a:e, :, :w],
                                                                attn_mask=attn_mask[a:e, ..., :w], scale=self.scaling)
            h = h + _dense(o.reshape(b, nh * hd), wo, at.o_proj.bias)
            x = self._norm(h, layer.post_attention_layernorm)
            gate, up = _dense(x, wgu).chunk(2, dim=-1)
            h = h + _dense(F.silu(gate) * up, wd)
        return self._norm(h, self.norm)

    def _norm(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """:func:`_rms`, through the native kernel where it takes these inputs."""
        if self.attention is not None:
            out = self.attention.rms_norm(x, norm.weight, norm.variance_epsilon)
            if out is not None:
                return out
        return _rms(x, norm)
