"""Supervised warm-up: teach the base model the tool-call format before GRPO.

A 135M instruct model almost never emits a parseable ``<tool_call>`` at first (1 of 20 sampled answers),
so every GRPO group is all-wrong and has zero advantage: no signal. The warm-up fine-tunes on the
training split's gold calls (the "SFT" baseline of the efficiency paper (arXiv:2606.00135), sec. 3.5)
with the loss on the assistant tokens only, then RL takes over.

Each example is ``prompt_ids`` (the chat template rendering of the task's messages with the assistant
generation prompt, exactly what rollouts feed the engine) followed by the tokenized gold answer
(``envs.parsing.format_calls``) and the end-of-turn token; only the answer tokens carry loss.

Demonstrations stay clean: they are gold answers of fault-free episodes (the request, then the gold
calls), so none shows a tool failing and a recovery from it; acting on a misbehaving tool is left to RL
(``env.fault_exposure="policy"``). :func:`shows_fault` tells such an example apart, and the warm-up
counts them (``demonstrations_with_fault`` in its record: 0).

Beside them, critique-following examples (``kind="critique"``, :func:`example_from_messages`): the retry
prompt q* of a policy error, with a critique that names the fix, followed by the gold answer
(:mod:`reflrl.recovery.critique_examples`, ``warmup.critique_share``). They are trained the same way:
the loss is on the answer tokens only, never on q*.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from reflrl.envs.parsing import format_calls
from reflrl.envs.types import Task

from .logprobs import nll_backward
from .memory import budget_bytes, release_heap
from .rollout import render_prompt


@dataclass
class SFTExample:
    """prompt_ids (P) + answer_ids (A); the loss is on answer_ids (which end with the end-of-turn token)."""

    prompt_ids: list[int]
    answer_ids: list[int]
    task_id: str = ""
    shows_fault: bool = False  # the prompt holds a tool's failure or a critique of one (a recovery)
    kind: str = "demonstration"  # | "critique": q* of a policy error -> the gold answer


def shows_fault(messages: Sequence[dict]) -> bool:
    """Whether a demonstration's prompt shows a tool failing or a critique of a fault: a tool message
    with an ``error``, or a fault's critique (:func:`reflrl.critic.format.describe_env_fault`)."""
    import json

    for m in messages:
        content = str(m.get("content") or "")
        if m.get("role") == "tool":
            try:
                if "error" in json.loads(content):
                    return True
            except (ValueError, TypeError):
                return True  # not the tool-answer JSON: not a clean answer either
        if "Your call was right; the tool answered" in content or "Your calls were right; the tool answered" in content:
            return True
    return False


def end_of_turn_id(tokenizer: Any) -> int:
    """The id the model must emit to end its turn (ChatML ``<|im_end|>`` for SmolLM2)."""
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has no eos token: cannot teach the model to end its turn")
    return int(tokenizer.eos_token_id)


def build_examples(tasks: Sequence[Task], tokenizer: Any, messages_fn: Callable[[Task], list[dict]],
                   fmt: str = "hermes") -> list[SFTExample]:
    """One example per task with a gold answer: prompt = messages_fn(task) rendered with the chat
    template; answer = format_calls(task.gold[0], fmt) tokenized on its own + end-of-turn token (the
    same split as rollouts, so SFT trains exactly the token sequence the sampler would produce).

    Tasks without gold calls are skipped (counted in the returned list's absence; see
    :func:`build_examples_report`)."""
    return [example_from_messages(messages_fn(t), t.gold[0], tokenizer, fmt, t.id)
            for t in tasks if t.gold and t.gold[0]]


def example_from_messages(messages: list[dict], gold: Sequence[Any], tokenizer: Any, fmt: str = "hermes",
                          task_id: str = "", kind: str = "demonstration") -> SFTExample:
    """An example with an explicit prompt: ``messages`` rendered with the chat template and the
    assistant generation prompt, then the ``gold`` calls written in ``fmt``, tokenized on their own,
    and the end-of-turn token (the answer, the only tokens with loss)."""
    ids = tokenizer(format_calls(list(gold), fmt), add_special_tokens=False)["input_ids"]
    return SFTExample(render_prompt(tokenizer, messages), list(ids) + [end_of_turn_id(tokenizer)], task_id,
                      shows_fault(messages), kind)


def sft_pad_id(tokenizer: Any) -> int:
    """The id that pads SFT batches: the tokenizer's pad token, else its end-of-turn token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_of_turn_id(tokenizer)


def collate(examples: Sequence[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask, response_mask, all [B, L] (L = longest P+A).

    response_mask is 1 on the answer tokens (their log-probs are trained), 0 on prompt and padding."""
    seqs = [e.prompt_ids + e.answer_ids for e in examples]
    L = max(len(s) for s in seqs)
    B = len(seqs)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    resp = torch.zeros((B, L), dtype=torch.long)
    for i, (e, s) in enumerate(zip(examples, seqs)):
        input_ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        resp[i, len(e.prompt_ids): len(s)] = 1
    return {"input_ids": input_ids, "attention_mask": attn, "response_mask": resp}


def _epoch_batches(examples: Sequence[SFTExample], batch_size: int, rng: random.Random) -> list[list[int]]:
    """One epoch of batches: a seeded shuffle, cut into windows of 8 batches whose examples are
    sorted by length (so a batch pads little), then the batches shuffled again. Every example
    appears once per epoch (the last batch may be smaller)."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    length = [len(e.prompt_ids) + len(e.answer_ids) for e in examples]
    window = batch_size * 8
    batches = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w: w + window], key=lambda i: length[i])
        batches.extend(chunk[b: b + batch_size] for b in range(0, len(chunk), batch_size))
    rng.shuffle(batches)
    return batches


def sft_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean negative log-likelihood of the answer tokens (token-mean over the batch)."""
    from .logprobs import sequence_logprobs

    lp = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"])
    m = batch["response_mask"].bool()
    return -(torch.where(m, lp, torch.zeros_like(lp)).sum() / m.sum().clamp(min=1))


def lr_schedule(s: int, *, steps: int, lr: float, warmup_steps: int = 0) -> float:
    """Learning rate at step ``s`` of ``steps``: linear warm-up over ``warmup_steps``, then cosine decay
    to 10% of ``lr`` at the last step. Defined by step counts only, so the same seed trains the same
    weights on a fast or a slow machine."""
    if warmup_steps and s < warmup_steps:
        return lr * (s + 1) / warmup_steps
    frac = (s - warmup_steps) / max(1, steps - warmup_steps)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def train_sft(model: torch.nn.Module, tokenizer: Any, examples: Sequence[SFTExample], *, steps: int,
              batch_size: int, lr: float, seed: int = 0, grad_clip: float = 1.0, weight_decay: float = 0.0,
              warmup_steps: int = 0, should_stop: Callable[[int, float | None], bool] | None = None,
              log: Callable[[int, dict[str, float]], None] | None = None,
              on_step: Callable[[int, float], None] | None = None,
              activation_budget_mb: float | None = None) -> dict[str, Any]:
    """Fine-tune the trainable parameters on ``examples`` for ``steps`` optimizer steps.

    Batches are drawn from a seeded shuffle, epoch after epoch. A fresh AdamW is used (its state is
    not carried into RL); the learning rate follows :func:`lr_schedule`. ``should_stop(done,
    seconds_per_step)`` is a guard asked before each step (the run's time budget): when it says stop,
    training ends early and the result says ``cut``. ``on_step(done, loss)`` reports progress.
    ``activation_budget_mb`` (``algo.activation_budget_mb``) bounds a step's activations: a batch over it
    runs in micro-batches with gradient accumulation (:func:`reflrl.logprobs.nll_backward`); None = no bound.
    Returns {"steps", "planned", "cut", "loss_first", "loss_last", "seconds", "trained_by_kind"} (the
    examples trained on per :attr:`SFTExample.kind`, repeats counted).
    """
    if not examples:
        raise ValueError("SFT warm-up has no examples (no training task has gold calls)")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    pad = sft_pad_id(tokenizer)
    dev = params[0].device  # train.device: each batch goes where the model is
    rng = random.Random(seed)
    batches: list[list[int]] = []
    losses: list[float] = []
    trained: dict[str, int] = {}
    t0 = time.perf_counter()
    model.train()
    done = 0
    cut = False
    for s in range(steps):
        if should_stop is not None and should_stop(done, (time.perf_counter() - t0) / done if done else None):
            cut = True
            break
        if not batches:
            batches = _epoch_batches(examples, batch_size, rng)
        idx = batches.pop()
        batch = {k: v.to(dev) for k, v in collate([examples[i] for i in idx], pad).items()}  # the model's device
        for i in idx:
            trained[examples[i].kind] = trained.get(examples[i].kind, 0) + 1
        cur_lr = lr_schedule(s, steps=steps, lr=lr, warmup_steps=warmup_steps)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        opt.zero_grad(set_to_none=True)
        loss, _ = nll_backward(model, batch, budget_bytes(activation_budget_mb))  # sft_loss, in micro-batches
        if not torch.isfinite(loss):
            raise FloatingPointError(f"SFT loss is {float(loss.detach())} at step {s}")
        gn = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        release_heap()
        losses.append(float(loss.detach()))
        done += 1
        if log is not None:
            log(s, {"sft_loss": losses[-1], "grad_norm": float(gn), "lr": cur_lr,
                    "tokens": int(batch["attention_mask"].sum())})
        if on_step is not None:
            on_step(done, losses[-1])
    model.eval()
    del opt
    return {"steps": done, "planned": steps, "cut": cut, "loss_first": losses[0] if losses else None,
            "loss_last": (sum(losses[-5:]) / len(losses[-5:])) if losses else None,
            "seconds": time.perf_counter() - t0, "trained_by_kind": trained}
