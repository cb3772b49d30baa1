"""What every rollout engine shares: the :class:`RolloutEngine` protocol, the :class:`Sample` it returns,
and the helpers for per-prompt token caps and stopping an answer when it is complete.

Log-prob convention (all engines): ``Sample.logprobs[i]`` is
``log softmax(logits / temperature)[token_ids[i]]`` -- the temperature-scaled distribution, before
top-p truncation -- which is exactly what :func:`reflrl.logprobs.sequence_logprobs` with the same
temperature computes, so the rollout/train importance ratio is 1 up to numerics. With
``temperature == 0`` (greedy), log-probs are taken at temperature 1.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol, Sequence, runtime_checkable

from torch import nn

FinishReason = Literal["stop", "length"]


@dataclass
class Sample:
    """One sampled completion.

    prompt_index: index of its prompt in the ``prompts`` list given to ``generate``.
    prompt_ids: the prompt's token ids (unpadded).
    token_ids: sampled token ids, no padding; ends with the stop token when ``finish_reason`` is
        "stop" (the stop token is included: it was sampled and is trained on).
    logprobs: one float per token in ``token_ids`` (float32 values), see the module doc.
    finish_reason: "stop" (a stop id was sampled) or "length" (``max_new_tokens`` reached).
    """

    prompt_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout loop needs from a generator backend."""

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
        """Sample ``n`` completions per prompt; returns ``len(prompts) * n`` samples ordered
        prompt-major (samples ``i*n .. i*n+n-1`` belong to prompt ``i``). Deterministic given
        ``seed`` and the same inputs. ``max_new_tokens``: one cap, or one per prompt.
        ``stop_when(text)``: a sample also stops (finish_reason "stop") after the first token at
        which its decoded text satisfies it (e.g. :func:`reflrl.envs.parsing.answer_complete`);
        engines that cannot stop early cut the sample there afterwards (:func:`cut_at`)."""
        ...

    def update_weights(self, model: nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights."""
        ...

    # Optional: ``on_weights_updated(model)``, called by the trainer after each optimiser step (an engine
    # holding its own copy of the weights, as vLLM does, copies them in; one that samples from the trained
    # model itself needs none), and ``on_weights_changing(model)``, called before the optimiser steps of
    # an update or a warm-up (an engine can drop what it derived from the trained weights).


def per_prompt_caps(max_new_tokens: int | Sequence[int], n_prompts: int) -> list[int]:
    """``max_new_tokens`` as one cap per prompt (ValueError naming a bad cap or a length mismatch)."""
    caps = [int(max_new_tokens)] * n_prompts if isinstance(max_new_tokens, int) else [int(c) for c in max_new_tokens]
    if len(caps) != n_prompts:
        raise ValueError(f"max_new_tokens has {len(caps)} caps for {n_prompts} prompts")
    for i, c in enumerate(caps):
        if c < 1:
            raise ValueError(f"max_new_tokens={c} (prompt {i}): must be >= 1")
    return caps


class PieceDecoder:
    """Decoded text of single token ids, memoized (the stop test reads a sample's text token by token)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._memo: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        piece = self._memo.get(token_id)
        if piece is None:
            piece = self._memo[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=True)
        return piece


def cut_at(sample: Sample, stop_when: Callable[[str], bool], decode: Callable[[int], str]) -> Sample:
    """``sample`` cut after the first token at which its text satisfies ``stop_when`` (finish "stop"),
    or unchanged: what an engine that cannot stop early returns, so every engine answers alike."""
    text = ""
    for i, t in enumerate(sample.token_ids):
        text += decode(t)
        if stop_when(text):
            if i + 1 == len(sample.token_ids) and sample.finish_reason == "stop":
                return sample
            return Sample(sample.prompt_index, sample.prompt_ids, list(sample.token_ids[: i + 1]),
                          list(sample.logprobs[: i + 1]), "stop")
    return sample


@dataclass
class GenerateStats:
    """Counters of the last ``generate`` call (for run logs and the floor benchmark).

    prefill_s / decode_s: seconds in prompt forward passes / in the token-by-token loop (sampling
    included); decode_rows: for each decode forward, the rows that still sampled (what the floor of
    that step is computed from)."""

    prompts: int = 0
    samples: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    forward_calls: int = 0
    seconds: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_rows: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


_LOCKS: "weakref.WeakKeyDictionary[nn.Module, threading.RLock]" = weakref.WeakKeyDictionary()


def generation_lock(model: nn.Module) -> threading.RLock:
    """The lock an engine holds while it runs ``model`` (a prefill swaps layers in and out, a decode step reads
    the KV buffers): one per model, shared by every engine sampling from it, so a generation called while a
    continuous-batching loop of another engine runs in a worker thread waits for its step instead of
    interleaving with it. Re-entrant."""
    lock = _LOCKS.get(model)
    if lock is None:
        lock = _LOCKS.setdefault(model, threading.RLock())
    return lock
