"""RolloutEngine on vLLM's offline engine (one GPU), with weight sync after each policy update.

NOT RUNNABLE ON THIS MACHINE: vLLM needs a GPU (and the ``gpu`` extra, ``pip install -e '.[gpu]'``).
This module was written against vLLM's documented offline API and has not been executed here; the
import of vllm is lazy and a clear ImportError names the extra when it is missing (tested).

API used (vLLM's V1 engine with ``logprobs_mode``, e.g. vllm 0.24.0 that ``verl[vllm]==0.9.1`` pins;
older releases without ``logprobs_mode`` raise a TypeError at ``LLM(...)``):

- ``vllm.LLM(model=..., dtype=..., gpu_memory_utilization=..., seed=..., enable_prefix_caching=True,
  logprobs_mode="processed_logprobs", worker_extension_cls="reflrl.engines.vllm_engine.ReflrlWorkerExtension")``.
  ``processed_logprobs``: log-probs after temperature scaling, to match our convention
  ``log softmax(logits / T)`` (reflrl.engines.base); vLLM's default ``raw_logprobs`` ignores the temperature.
  With ``top_p < 1`` vLLM may report log-probs of the truncated distribution (version dependent),
  ours are before truncation: keep ``top_p = 1`` (the papers' setting) when these log-probs are
  used as behaviour log-probs.
- ``llm.generate([TokensPrompt(prompt_token_ids=ids) ...], SamplingParams(n, max_tokens, temperature,
  top_p, seed, stop_token_ids, logprobs=0), use_tqdm=False)``: ``logprobs=0`` returns the sampled
  token's log-prob only; each ``CompletionOutput`` has ``token_ids``, ``logprobs`` (one
  ``{token_id: Logprob}`` dict per token) and ``finish_reason`` ("stop" | "length").
- Weight sync (the documented RLHF path: a worker extension + ``LLM.collective_rpc``): with
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the engine core runs in this process, so
  ``collective_rpc("reflrl_load_weights", args=(named_tensors,))`` hands the tensors to
  ``model_runner.model.load_weights`` directly; then ``llm.reset_prefix_cache()`` drops KV computed
  with the old weights. LoRA (peft) models are merged for the copy and unmerged after.
"""
from __future__ import annotations

import os
import time
import warnings
from typing import Any, Callable, Sequence

from .base import GenerateStats, PieceDecoder, Sample, cut_at, per_prompt_caps

EXTENSION = "reflrl.engines.vllm_engine.ReflrlWorkerExtension"


def import_vllm() -> Any:
    """``import vllm`` or ImportError naming the extra (vLLM needs a GPU)."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError("--engine vllm needs vLLM on a GPU machine: pip install -e '.[gpu]' "
                          f"(vLLM is not installed: {e})") from e
    return vllm


class ReflrlWorkerExtension:
    """Mixed into vLLM's GPU worker (``worker_extension_cls``): receives new weights."""

    def reflrl_load_weights(self, weights: list[tuple[str, Any]]) -> int:
        """Load ``(name, tensor)`` pairs (HF names) into the worker's model; returns their count."""
        import torch

        self.model_runner.model.load_weights(weights=weights)  # type: ignore[attr-defined]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return len(weights)


def hf_named_weights(model: Any) -> list[tuple[str, Any]]:
    """``(name, tensor)`` pairs with Hugging Face names from a transformers model (peft: the LoRA
    adapters merged into the base weights, names without the peft prefixes)."""
    merged = hasattr(model, "merge_adapter") and hasattr(model, "unmerge_adapter")
    if merged:
        model.merge_adapter()
    try:
        out = []
        for name, t in model.state_dict().items():
            if "lora_" in name:  # adapter matrices: already merged into the base weights
                continue
            if merged:
                name = name.replace("base_model.model.", "", 1).replace(".base_layer", "")
            out.append((name, t.detach()))
        return out
    finally:
        if merged:
            model.unmerge_adapter()


class VLLMEngine:
    """RolloutEngine on ``vllm.LLM`` (module doc). Not runnable without a GPU.

    Args:
        model_path: HF id or local folder of the policy (same architecture as the trained model).
        dtype, gpu_memory_utilization, seed, max_model_len: passed to ``vllm.LLM``.
        llm_kwargs: any other ``vllm.LLM`` keyword.
    """

    def __init__(self, model_path: str, *, dtype: str = "bfloat16", gpu_memory_utilization: float = 0.5,
                 seed: int = 0, max_model_len: int | None = None, **llm_kwargs: Any) -> None:
        vllm = import_vllm()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # collective_rpc in-process
        kw = dict(model=model_path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization, seed=seed,
                  enable_prefix_caching=True, logprobs_mode="processed_logprobs", worker_extension_cls=EXTENSION)
        if max_model_len is not None:
            kw["max_model_len"] = max_model_len
        kw.update(llm_kwargs)
        self.llm = vllm.LLM(**kw)
        self.last_stats = GenerateStats()
        self.weight_version = 0

    def update_weights(self, model: Any) -> None:
        """Copy ``model``'s current weights into vLLM (after each optimiser step), drop the prefix cache."""
        weights = hf_named_weights(model)
        self.llm.collective_rpc("reflrl_load_weights", args=(weights,))
        self.llm.reset_prefix_cache()
        self.weight_version += 1

    def on_weights_updated(self, model: Any) -> None:
        """The trainer's hook after each optimiser step: the next rollouts sample the updated weights."""
        self.update_weights(model)

    def generate(self, prompts: list[list[int]], n: int = 1, max_new_tokens: int | Sequence[int] = 256,
                 temperature: float = 1.0, top_p: float = 1.0, stop_ids: list[int] | None = None, seed: int = 0,
                 stop_when: Callable[[str], bool] | None = None) -> list[Sample]:
        """See :meth:`reflrl.engines.base.RolloutEngine.generate`; prompt ``i`` is sampled with seed ``seed + i``
        and its own cap. The stop token is included in ``token_ids`` when sampled (as vLLM returns it);
        ``stop_when`` cuts each sample afterwards (:func:`reflrl.engines.base.cut_at`)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if n < 1:
            raise ValueError(f"n={n}: must be >= 1")
        caps = per_prompt_caps(max_new_tokens, len(prompts))
        if top_p < 1.0:
            warnings.warn("top_p < 1: vLLM's processed log-probs may be of the truncated distribution, "
                          "reflrl's convention is before truncation (module doc)", stacklevel=2)
        t0 = time.perf_counter()
        params = [SamplingParams(n=n, max_tokens=caps[i], temperature=temperature, top_p=top_p,
                                 seed=int(seed) + i, stop_token_ids=list(stop_ids or []) or None, logprobs=0)
                  for i in range(len(prompts))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        samples: list[Sample] = []
        for i, (p, out) in enumerate(zip(prompts, outs)):
            for c in out.outputs:
                ids = [int(t) for t in c.token_ids]
                lps = [float(d[t].logprob) for t, d in zip(ids, c.logprobs or [])]
                if len(lps) != len(ids):
                    raise RuntimeError(f"vLLM returned {len(lps)} log-probs for {len(ids)} tokens (prompt {i})")
                samples.append(Sample(prompt_index=i, prompt_ids=list(p), token_ids=ids, logprobs=lps,
                                      finish_reason="length" if c.finish_reason == "length" else "stop"))
        if stop_when is not None:
            decode = PieceDecoder(self.llm.get_tokenizer())
            samples = [cut_at(smp, stop_when, decode) for smp in samples]
        self.last_stats = GenerateStats(prompts=len(prompts), samples=len(samples),
                                        prompt_tokens=sum(len(p) for p in prompts),
                                        new_tokens=sum(len(s.token_ids) for s in samples),
                                        seconds=time.perf_counter() - t0)
        return samples
