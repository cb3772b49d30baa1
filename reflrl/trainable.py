"""What trains in a model: the trainable subsets (``all``, ``none``, ``top_layers:K``, ``lora``) and the
mixed precision of a frozen bottom and a float32 top (see :mod:`reflrl.models` for the settings)."""
from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_trainable(trainable: str) -> tuple[str, int]:
    """Parse ``"all"`` | ``"none"`` | ``"lora"`` | ``"top_layers:K"`` into (kind, K).

    Raises ValueError naming the bad value.
    """
    t = trainable.strip()
    if t in ("all", "lora", "none"):
        return t, 0
    if t.startswith("top_layers:"):
        try:
            k = int(t.split(":", 1)[1])
        except ValueError:
            k = -1
        if k < 1:
            raise ValueError(f"trainable={trainable!r}: K in 'top_layers:K' must be an integer >= 1")
        return "top_layers", k
    raise ValueError(
        f"trainable={trainable!r}: expected 'all', 'none', 'lora' or 'top_layers:K'"
    )


def _cast_to(obj: Any, dtype: torch.dtype) -> Any:
    if torch.is_tensor(obj) and obj.is_floating_point() and obj.dtype != dtype:
        return obj.to(dtype)
    if isinstance(obj, tuple):
        return tuple(_cast_to(o, dtype) for o in obj)
    return obj


def _boundary_pre_hook(dtype: torch.dtype):
    """Forward pre-hook casting floating inputs (hidden states, rotary cos/sin, float masks)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        args = tuple(_cast_to(a, dtype) for a in args)
        kwargs = {k: (_cast_to(v, dtype) if k != "past_key_values" else v) for k, v in kwargs.items()}
        return args, kwargs

    return hook


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find decoder layers (model.model.layers)")
    return layers


def apply_trainable(
    model: nn.Module,
    trainable: str,
    dtype: torch.dtype | None = None,
    trainable_dtype: torch.dtype | None = torch.float32,
) -> nn.Module:
    """Set ``requires_grad`` and precisions for ``all`` / ``none`` / ``top_layers:K``; returns model.

    Frozen parameters are cast to ``dtype`` (None = leave), trainable ones to ``trainable_dtype``
    (None = same as ``dtype``). Trainable layers are cast from the values the model holds when
    called (load in float32 first so float32 master weights are not bfloat16-rounded). For
    ``top_layers:K`` with differing precisions, forward pre-hooks cast at the two boundaries (into
    the first trainable layer; into the output head). ``lora`` is :func:`apply_lora`'s job.
    """
    kind, k = parse_trainable(trainable)
    t_dtype = trainable_dtype if trainable_dtype is not None else dtype
    if kind == "none":
        if dtype is not None:
            model.to(dtype)
        for p in model.parameters():
            p.requires_grad_(False)
        return model
    if kind == "all":
        if t_dtype is not None:
            model.to(t_dtype)
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    if kind != "top_layers":
        raise ValueError(f"apply_trainable handles 'all', 'none', 'top_layers:K', not {trainable!r}")
    layers = _decoder_layers(model)
    if k > len(layers):
        raise ValueError(f"trainable={trainable!r}: the model has only {len(layers)} layers")
    top = [*list(layers)[len(layers) - k :], model.get_decoder().norm]
    # keep the trainable part's current (full-precision) values across the frozen-part cast
    kept = None
    if t_dtype is not None:
        kept = [{n: v.detach().to(t_dtype, copy=True) for n, v in m.state_dict().items()} for m in top]
    if dtype is not None:
        model.to(dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    for i, m in enumerate(top):
        if kept is not None:
            m.to(t_dtype)
            m.load_state_dict(kept[i])
        for p in m.parameters():
            p.requires_grad_(True)
    first_dtype = next(top[0].parameters()).dtype
    below_dtype = model.get_input_embeddings().weight.dtype
    if first_dtype != below_dtype:
        top[0].register_forward_pre_hook(_boundary_pre_hook(first_dtype), with_kwargs=True)
    head = model.get_output_embeddings()
    if head.weight.dtype != first_dtype:
        head.register_forward_pre_hook(_boundary_pre_hook(head.weight.dtype), with_kwargs=True)
    return model


def apply_lora(
    model: nn.Module,
    r: int = 16,
    alpha: int | None = None,
    dropout: float = 0.0,
    targets: tuple[str, ...] = LORA_TARGETS,
) -> nn.Module:
    """Wrap ``model`` with peft LoRA adapters on ``targets`` (rank r, alpha default 2r).

    Hu et al. 2021, LoRA; only the adapter weights train. Returns the PeftModel.
    """
    from peft import LoraConfig, get_peft_model

    if r < 1:
        raise ValueError(f"lora_r={r}: must be >= 1")
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha if alpha is not None else 2 * r,
        lora_dropout=dropout,
        target_modules=list(targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, cfg)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters with ``requires_grad`` (what the optimizer should get)."""
    return [p for p in model.parameters() if p.requires_grad]


def count_parameters(model: nn.Module) -> dict[str, int]:
    """{"total": N, "trainable": M} parameter counts (tied weights counted once)."""
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return {"total": total, "trainable": trainable}


class _SiluGatedDown(torch.autograd.Function):
    """``down(silu(gate) * up)`` that keeps only ``gate`` and ``up`` for its backward pass: the SiLU and
    the product (two intermediate-size tensors per token that autograd would keep) are computed again
    there, with the same operations, so the gradients are autograd's."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up, weight)
        return nn.functional.linear(nn.functional.silu(gate) * up, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gate, up, weight = ctx.saved_tensors
        act = nn.functional.silu(gate)
        grad_h = grad.matmul(weight)  # d loss / d (silu(gate) * up)
        grad_w = None
        if ctx.needs_input_grad[2]:
            h = act * up
            grad_w = grad.reshape(-1, grad.shape[-1]).t().mm(h.reshape(-1, h.shape[-1]))
            del h
        grad_up = grad_h * act if ctx.needs_input_grad[1] else None
        grad_gate = torch.ops.aten.silu_backward(grad_h * up, gate) if ctx.needs_input_grad[0] else None
        return grad_gate, grad_up, grad_w


_SILU = {"SiLU", "SiLUActivation"}  # torch's and transformers' SiLU modules


def _lean_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The forward :func:`lean_mlp_activations` binds to an MLP (a method of the module, so a deep copy of
    the model, e.g. a KL reference, computes with its own weights)."""
    if not torch.is_grad_enabled() or not self.down_proj.weight.requires_grad:
        return type(self).forward(self, x)  # sampling, a frozen layer: the module's own forward
    return _SiluGatedDown.apply(self.gate_proj(x), self.up_proj(x), self.down_proj.weight)


def lean_mlp_activations(model: nn.Module) -> int:
    """Trained SiLU-gated MLPs (Llama-family ``gate_proj``/``up_proj``/``down_proj``, plain linear layers
    without bias) keep two intermediate-size tensors per token for the backward pass instead of four
    (:class:`_SiluGatedDown`): the same values and gradients, about a quarter less activation memory per
    trained layer. Installed on every decoder layer whose down projection trains; a module of another
    shape keeps its forward. Returns the number of MLPs changed."""
    changed = 0
    for layer in getattr(model.get_decoder(), "layers", []):
        mlp = getattr(layer, "mlp", None)
        parts = [getattr(mlp, k, None) for k in ("gate_proj", "up_proj", "down_proj")]
        if mlp is None or any(type(p) is not nn.Linear or p.bias is not None for p in parts):
            continue
        if type(getattr(mlp, "act_fn", None)).__name__ not in _SILU or not parts[2].weight.requires_grad:
            continue
        if not getattr(mlp, "lean_activations", False):
            mlp.lean_activations = True
            mlp.forward = types.MethodType(_lean_mlp_forward, mlp)
            changed += 1
    return changed
