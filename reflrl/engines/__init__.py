"""Rollout engines by name (``--engine transformers | openai | vllm``), all with the
:class:`reflrl.engine.RolloutEngine` interface (``generate`` -> Samples with token ids and log-probs,
``update_weights``).

    engine = get_engine("transformers", model=model, tokenizer=tok)
    engine = get_engine("openai", base_url="http://127.0.0.1:8000/v1", model="Qwen/Qwen2.5-7B-Instruct",
                        tokenizer=tok)
    engine = get_engine("vllm", model_path="Qwen/Qwen2.5-7B-Instruct")   # GPU only

- ``transformers``: :class:`reflrl.engine.TransformersEngine` (CPU; shares the training model).
- ``openai``: :class:`.openai_engine.OpenAIEngine` (any OpenAI-compatible server; frozen policy, eval).
- ``vllm``: :class:`.vllm_engine.VLLMEngine` (vLLM offline engine on one GPU; weights synced after
  each update). Written against vLLM's API, not runnable on this CPU-only machine.
"""
from __future__ import annotations

import difflib
from typing import Any, Callable


def _transformers(**kw: Any) -> Any:
    from ..engine import TransformersEngine

    return TransformersEngine(**kw)


def _openai(**kw: Any) -> Any:
    from .openai_engine import OpenAIEngine

    return OpenAIEngine(**kw)


def _vllm(**kw: Any) -> Any:
    from .vllm_engine import VLLMEngine

    return VLLMEngine(**kw)


_ENGINES: dict[str, Callable[..., Any]] = {"transformers": _transformers, "openai": _openai, "vllm": _vllm}


def list_engines() -> list[str]:
    """Registered engine names, sorted."""
    return sorted(_ENGINES)


def register_engine(name: str, factory: Callable[..., Any]) -> None:
    """Add an engine factory (``factory(**kwargs)`` -> RolloutEngine); ValueError if the name is taken."""
    if name in _ENGINES and _ENGINES[name] is not factory:
        raise ValueError(f"engine {name!r} is already registered")
    _ENGINES[name] = factory


def get_engine(name: str, **kwargs: Any) -> Any:
    """Build the engine registered as ``name`` with ``kwargs`` (see the module doc for each engine's
    arguments). KeyError with a suggestion for an unknown name."""
    if name not in _ENGINES:
        close = difflib.get_close_matches(name, list(_ENGINES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"unknown engine {name!r}{hint} (registered: {', '.join(list_engines())})")
    return _ENGINES[name](**kwargs)


__all__ = ["get_engine", "list_engines", "register_engine"]
