"""Test doubles and small helpers shared by the tests (imported as ``from doubles import ...``; the
fixtures built on them are in conftest.py). Nothing here is used by product code."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pytest

from reflrl import config as C
from reflrl.engines.base import PieceDecoder, Sample, cut_at, per_prompt_caps
from reflrl.envs.parsing import format_calls
from reflrl.envs.types import Task, ToolCall

ROOT = Path(__file__).resolve().parent.parent


class ScriptedEngine:
    """Test double of the rollout engine: answers ``answer(prompt_text, sample_index)`` exactly, with a
    fixed log-prob per token, ending with eos (finish_reason "stop"); honours per-prompt caps and
    ``stop_when`` as every engine must (reflrl.engines.base)."""

    def __init__(self, tokenizer, answer, row_as_sample: bool = False):
        self.tok = tokenizer
        self.answer = answer
        self.row_as_sample = row_as_sample  # sample index = row in the batch (multi-turn: n=1 per call)
        self.calls: list[int] = []  # batch size of each generate call

    def generate(self, prompts, n=1, max_new_tokens=256, temperature=1.0, top_p=1.0, stop_ids=None, seed=0,
                 stop_when=None):
        self.calls.append(len(prompts) * n)
        caps = per_prompt_caps(max_new_tokens, len(prompts))
        out = []
        for i, p in enumerate(prompts):
            text = self.tok.decode(p)
            for j in range(n):
                jj = i if self.row_as_sample and n == 1 else j
                ids = self.tok(self.answer(text, jj), add_special_tokens=False)["input_ids"][: caps[i] - 1]
                ids = ids + [self.tok.eos_token_id]
                smp = Sample(i, list(p), ids, [-0.5] * len(ids), "stop")
                out.append(cut_at(smp, stop_when, PieceDecoder(self.tok)) if stop_when is not None else smp)
        return out

    def update_weights(self, model) -> None:
        pass


class PooledScriptedEngine(ScriptedEngine):
    """:class:`ScriptedEngine` with a continuous-batching engine's interface (``continuous``, an awaitable
    ``agenerate``, as reflrl.rollout.pooled asks): the same answers; ``requests`` records each request's
    samples (prompts x n)."""

    continuous = True

    def __init__(self, tokenizer, answer, row_as_sample: bool = False):
        super().__init__(tokenizer, answer, row_as_sample)
        self.requests: list[int] = []

    async def agenerate(self, prompts, n=1, held=False, **kw):
        import asyncio

        self.requests.append(len(prompts) * n)
        await asyncio.sleep(0)  # another coroutine's request may arrive meanwhile, as in a decode loop
        return self.generate(prompts, n=n, **kw)


def gold_text(task: Task) -> str:
    return format_calls(list(task.gold[0]), "hermes")


def answer_by_task(tasks, wrong_every: int = 2):
    """Gold call for samples j % wrong_every == 0, a wrong call otherwise (found by the query)."""
    def answer(prompt_text: str, j: int) -> str:
        task = next(t for t in tasks if t.query in prompt_text)
        if j % wrong_every == 0:
            return gold_text(task)
        return format_calls([ToolCall(task.gold[0][0].name, {"nonsense": j})], "hermes")
    return answer


def tiny_cfg(tmp_path: Path, **over: Any) -> C.Config:
    """configs/tiny.yaml made smaller: 6 train / 4 test tasks, no warm-up, run folder ``tmp_path/run``."""
    sets = [f"train.out_dir={tmp_path}", "train.run_name=run", "data.n_train=6", "data.n_test=4",
            "data.n_val=0", "warmup.enabled=false", "rollout.max_new_tokens=200", "algo.downsample_m=0"]
    sets += [f"{k}={v}" for k, v in over.items()]
    return C.load_config(ROOT / "configs" / "tiny.yaml", sets)


def scripted(cfg: C.Config, make_answer: Callable[[list[Task]], Callable[[str, int], str]] = answer_by_task,
             **kw: Any) -> Callable[[Any, Any], ScriptedEngine]:
    """An engine factory for ``Trainer(engine=...)``: a ScriptedEngine answering with
    ``make_answer(every task of cfg's splits)``."""
    from reflrl.train.data import splits_from_config

    sp = splits_from_config(cfg.data)
    tasks = sp["train"] + sp["val"] + sp["test"]
    return lambda model, tok: ScriptedEngine(tok, make_answer(tasks), **kw)


def run_until_killed(trainer: Any, step: int) -> None:
    """Run ``trainer`` until it is "killed" (KeyboardInterrupt) entering step ``step + 1``; close it."""
    real_step = trainer.train_step

    def dying_step():
        if trainer.step == step:
            raise KeyboardInterrupt("killed")
        return real_step()

    trainer.train_step = dying_step
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    trainer.close()


def tb_scalars(run: Path) -> Counter:
    """(tag, step) -> how many events of it the run's TensorBoard files hold."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    seen: Counter = Counter()
    for f in sorted(run.glob("events.out.tfevents.*")):
        for ev in EventFileLoader(str(f)).Load():
            for v in ev.summary.value:
                seen[(v.tag, ev.step)] += 1
    return seen


def right_padded(samples):
    """(input ids, attention mask, response mask) [B, T] of engine samples as right-padded full sequences
    (what the trainer recomputes log-probs over)."""
    import torch

    seqs = [s.prompt_ids + s.token_ids for s in samples]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    am, rm = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (s, q) in enumerate(zip(samples, seqs)):
        ids[i, : len(q)] = torch.tensor(q)
        am[i, : len(q)] = 1
        rm[i, len(s.prompt_ids) : len(q)] = 1
    return ids, am, rm
