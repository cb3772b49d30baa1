"""Which device the native trainer runs on: ``train.device: auto | cpu | cuda``, and the precision there.

- ``cpu``: the CPU, with ``model.dtype`` resolved by :mod:`reflrl.precision` (the faster of bfloat16 and
  float32 there; bfloat16 only where the CPU computes it natively).
- ``cuda``: the first CUDA device torch sees (``cuda:0``; pick another with ``CUDA_VISIBLE_DEVICES``).
  ``model.dtype: auto`` is bfloat16 there when the GPU supports it (float32 otherwise); an explicit
  ``float32`` / ``bfloat16`` is honoured. A machine where torch sees no CUDA device is refused with
  one line (:class:`reflrl.errors.ConfigError`).
- ``auto``: ``cuda`` when torch sees a CUDA device, else ``cpu``.

The model, the rollout engine's tensors, the log-probs of the update and the optimiser state live on
that device; sampling draws its random numbers from a CPU generator seeded per call, so the same seed
gives the same draws on either device (the sampled tokens still depend on the logits, which differ
in the last bits between devices and precisions). Checkpoints are written and read device-free.
"""
from __future__ import annotations

from typing import Any

from .errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


def cuda_available() -> bool:
    """Whether torch sees a usable CUDA device (False for a CPU-only build of torch)."""
    import torch

    try:
        return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
    except Exception:  # noqa: BLE001  a broken driver reads as "no CUDA device"
        return False


def resolve_device(requested: str = "auto", *, has_cuda: bool | None = None) -> Any:
    """The ``torch.device`` for ``train.device`` (module doc). ``has_cuda``: override the probe (tests).
    Raises ConfigError naming the key for an unknown name, or for ``cuda`` where torch sees no CUDA device."""
    import torch

    if requested not in DEVICES:
        raise ConfigError(f"train.device={requested!r}: expected one of {', '.join(DEVICES)}")
    cuda = cuda_available() if has_cuda is None else bool(has_cuda)
    if requested == "cuda" and not cuda:
        build = getattr(torch.version, "cuda", None)
        why = "this torch build has no CUDA support" if not build else "no CUDA device is visible"
        raise ConfigError(f"train.device=cuda: torch {torch.__version__} sees no CUDA device ({why}); "
                          "use train.device=cpu or auto")
    if requested == "cuda" or (requested == "auto" and cuda):
        return torch.device("cuda", 0)
    return torch.device("cpu")


def resolve_precision(requested: str, device: Any) -> Any:
    """``model.dtype`` on ``device`` -> :class:`reflrl.precision.DtypeChoice` (the CPU rule on the CPU;
    on CUDA: auto = bfloat16 where the GPU supports it, else float32; explicit names as given)."""
    import torch

    from .precision import DTYPE_NAMES, DtypeChoice, resolve_dtype

    if getattr(device, "type", str(device)) != "cuda":
        return resolve_dtype(requested)
    if requested not in DTYPE_NAMES:
        raise ValueError(f"dtype={requested!r}: expected one of {', '.join(DTYPE_NAMES)}")
    name = torch.cuda.get_device_name(device)
    bf16 = bool(torch.cuda.is_bf16_supported())
    where = f"CUDA device {name}"
    if requested == "auto":
        dtype = "bfloat16" if bf16 else "float32"
        return DtypeChoice(requested, dtype, f"auto: {where}" + ("" if bf16 else " without bfloat16"), where)
    warn = None if requested != "bfloat16" or bf16 else f"model.dtype=bfloat16 on {where}, which does not support it"
    return DtypeChoice(requested, requested, f"as configured; {where}", where, warning=warn)



__all__ = ["DEVICES", "cuda_available", "resolve_device", "resolve_precision"]
