"""Rollout engines by name (``--engine transformers | openai | vllm``), all with the
:class:`reflrl.engines.base.RolloutEngine` interface (``generate`` -> Samples with token ids and log-probs,
``update_weights``).

    engine = get_engine("transformers", model=model, tokenizer=tok)
    engine = get_engine("openai", base_url="http://127.0.0.1:8000/v1", model="Qwen/Qwen2.5-7B-Instruct",
                        tokenizer=tok)
    engine = get_engine("vllm", model_path="Qwen/Qwen2.5-7B-Instruct")   # GPU only

- ``transformers``: :class:`.transformers_engine.TransformersEngine` (CPU; shares the training model).
- ``openai``: :class:`.openai_engine.OpenAIEngine` (any OpenAI-compatible server; frozen policy, eval).
- ``vllm``: :class:`.vllm_engine.VLLMEngine` (vLLM offline engine on one GPU; weights synced after
  each update). Written against vLLM's API, not runnable on this CPU-only machine.
"""
from __future__ import annotations

from typing import Any

from reflrl.registry import Registry

ENGINES: Registry = Registry("engine")  # name -> factory(**kwargs) -> RolloutEngine


@ENGINES.register("transformers")
def _transformers(**kw: Any) -> Any:
    from .transformers_engine import TransformersEngine

    return TransformersEngine(**kw)


@ENGINES.register("openai")
def _openai(**kw: Any) -> Any:
    from .openai_engine import OpenAIEngine

    return OpenAIEngine(**kw)


@ENGINES.register("vllm")
def _vllm(**kw: Any) -> Any:
    from .vllm_engine import VLLMEngine

    return VLLMEngine(**kw)


def get_engine(name: str, **kwargs: Any) -> Any:
    """Build the engine registered as ``name`` with ``kwargs`` (see the module doc for each engine's
    arguments); UnknownName (a KeyError) with a suggestion for an unknown name."""
    return ENGINES.build(name, **kwargs)


__all__ = ["ENGINES", "get_engine"]
