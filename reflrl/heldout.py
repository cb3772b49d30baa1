"""The held-out evaluation a training run makes of itself (before, after the warm-up, after RL): exact-match
tool-call accuracy with greedy decoding, and the format rate. (The benchmark harness, ``reflrl eval``, is
:mod:`reflrl.eval`.)

* accuracy: the share of tasks whose greedy answer parses (``pred.ok``) and calls exactly the gold
  calls of the first turn (multiset of name + normalised arguments, ``envs.rewards.calls_match``;
  the binary reward's ``correct``, the efficiency paper (arXiv:2606.00135) appendix E eq. 8). No tool is executed, so env faults
  cannot touch the metric.
* accuracy by gold calls per task (``by_gold_calls``): [right, tasks] for the tasks whose gold answer
  makes 1, 2, 3, ... calls, since parallel answers are much harder for a small model than single ones.
* format rate: the share of SAMPLED answers (temperature 1, like RL rollouts) that parse as at least
  one tool call in the expected format — what decides whether GRPO gets any signal (the warm-up
  rule of the default recipe).

Both run batched through the rollout engine on prompts rendered exactly like rollouts, with the
rollouts' generation settings (``gen``, a :class:`reflrl.rollout.RolloutSpec`): each answer stops
as soon as it is complete (the end of the turn, or the end of its tool-call blocks when other text
follows: ``gen.stop_at_complete``) and at a token cap sized to its gold answer (``gen.answer_cap``),
so a model that rambles costs about what one that answers does.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from reflrl.envs.parsing import parse
from reflrl.envs.rewards import calls_match
from reflrl.envs.types import Task, ToolCall

from .rollout import RolloutSpec, answer_token_cap, render_prompt


@dataclass
class EvalResult:
    """accuracy and format_rate in [0, 1] over n tasks (or n samples for format_rate);
    stderr: binomial standard error of accuracy; seconds: wall time; new_tokens: tokens generated;
    capped: answers that reached their token cap (not complete when cut)."""

    accuracy: float
    format_rate: float
    n: int
    stderr: float = 0.0
    seconds: float = 0.0
    per_task: list[dict[str, Any]] = field(default_factory=list)
    new_tokens: int = 0
    capped: int = 0
    by_gold_calls: dict[str, list[int]] = field(default_factory=dict)

    def to_dict(self, with_tasks: bool = False) -> dict[str, Any]:
        d = {"accuracy": self.accuracy, "format_rate": self.format_rate, "n": self.n,
             "stderr": self.stderr, "seconds": round(self.seconds, 2), "new_tokens": self.new_tokens,
             "capped": self.capped, "by_gold_calls": self.by_gold_calls}
        if with_tasks:
            d["per_task"] = self.per_task
        return d


def _generate_texts(engine: Any, tokenizer: Any, tasks: Sequence[Task], messages_fn: Callable[[Task], list[dict]],
                    gen: RolloutSpec, *, batch_size: int, temperature: float, seed: int = 0) -> tuple[list[str], int, int]:
    """One answer per entry of ``tasks`` (rendered as rollouts are, capped by its gold answer):
    (decoded completions in the order of ``tasks``, new tokens, answers cut at their cap); batches
    group prompts of similar length; each answer stops when complete."""
    prompts = [render_prompt(tokenizer, messages_fn(t)) for t in tasks]
    caps = [answer_token_cap(t, tokenizer, gen) for t in tasks]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[str] = [""] * len(prompts)
    extra: dict[str, Any] = {}
    if gen.stop_when() is not None:
        extra["stop_when"] = gen.stop_when()
    tokens = capped = 0
    if getattr(engine, "continuous", False):  # one decode loop refills its rows from all the prompts
        batch_size = max(1, len(order))
    for s in range(0, len(order), batch_size):
        chunk = order[s: s + batch_size]
        samples = engine.generate([prompts[i] for i in chunk], n=1, max_new_tokens=[caps[i] for i in chunk],
                                  temperature=temperature, seed=seed + s, **extra)
        for i, smp in zip(chunk, samples):
            out[i] = tokenizer.decode(list(smp.token_ids), skip_special_tokens=True)
            tokens += len(smp.token_ids)
            capped += smp.finish_reason == "length"
    return out, tokens, capped


def _exact(p: Any, task: Task) -> bool:
    """The parsed answer ``p`` calls exactly the gold calls of the task's first turn."""
    return bool(p.ok and task.gold and calls_match(list(p.calls), list(task.gold[0])))


def gold_calls(task: Task) -> int:
    """How many calls the task's first-turn gold answer makes (1: a single call; more: parallel calls)."""
    return len(task.gold[0]) if task.gold else 0


def by_gold_calls(tasks: Sequence[Task], correct: Sequence[bool]) -> dict[str, list[int]]:
    """[right, tasks] per number of gold calls, keyed "1", "2", ... in increasing order: where a model's
    exact-match accuracy comes from (a single call is far easier than two or three in one answer)."""
    out: dict[int, list[int]] = {}
    for t, ok in zip(tasks, correct, strict=True):
        row = out.setdefault(gold_calls(t), [0, 0])
        row[0] += bool(ok)
        row[1] += 1
    return {str(k): out[k] for k in sorted(out)}


def _format_ok(text: str, fmt: str) -> bool:
    p = parse(text, fmt)
    return bool(p.ok and p.calls)


def evaluate(engine: Any, tokenizer: Any, tasks: Sequence[Task], messages_fn: Callable[[Task], list[dict]],
             gen: RolloutSpec | None = None, *, batch_size: int = 16, keep_texts: bool = False) -> EvalResult:
    """Greedy exact-match accuracy on ``tasks`` (first-turn gold calls); batched generation.

    ``messages_fn(task)`` gives the chat messages of a task (the same rendering as rollouts); ``gen``:
    the rollouts' settings (format, token caps, early stop; default ``RolloutSpec()``).
    The returned format_rate here is the share of GREEDY answers that parse as a call."""
    t0 = time.perf_counter()
    gen = gen or RolloutSpec()
    fmt = gen.fmt
    tasks = list(tasks)
    if not tasks:
        raise ValueError("evaluate: no tasks")
    texts, new_tokens, capped = _generate_texts(engine, tokenizer, tasks, messages_fn, gen, batch_size=batch_size,
                                                temperature=0.0)
    per = []
    correct = fmt_ok = 0
    for t, text in zip(tasks, texts):
        p = parse(text, fmt)
        ok = bool(p.ok and p.calls)
        hit = _exact(p, t)
        correct += hit
        fmt_ok += ok
        rec: dict[str, Any] = {"id": t.id, "correct": hit, "format_ok": ok}
        if keep_texts:
            rec["text"] = text
        per.append(rec)
    n = len(tasks)
    acc = correct / n
    return EvalResult(accuracy=acc, format_rate=fmt_ok / n, n=n, stderr=math.sqrt(acc * (1 - acc) / n),
                      seconds=time.perf_counter() - t0, per_task=per, new_tokens=new_tokens, capped=capped,
                      by_gold_calls=by_gold_calls(tasks, [r["correct"] for r in per]))


def format_rate(engine: Any, tokenizer: Any, tasks: Sequence[Task], messages_fn: Callable[[Task], list[dict]],
                gen: RolloutSpec | None = None, *, samples_per_task: int = 1, batch_size: int = 16,
                seed: int = 0) -> float:
    """Share of sampled answers (``samples_per_task`` per task, at ``gen.temperature``, with the caps
    and early stop of ``gen``) that parse as at least one tool call in format ``gen.fmt``."""
    gen = gen or RolloutSpec()
    tasks = [t for t in tasks for _ in range(samples_per_task)]
    if not tasks:
        raise ValueError("format_rate: no tasks")
    texts, _, _ = _generate_texts(engine, tokenizer, tasks, messages_fn, gen, batch_size=batch_size,
                                  temperature=gen.temperature, seed=seed)
    return sum(_format_ok(x, gen.fmt) for x in texts) / len(texts)



# ------------------------------------------------------------------------- episodes under faults
async def aevaluate_episodes(engine: Any, tokenizer: Any, envs: Sequence[Any], tasks: Sequence[Task],
                             gen: RolloutSpec, *, seed: int,
                             recover: Callable[[list], Any] | None = None) -> dict[str, Any]:
    """The held-out evaluation of a run with faults: greedy episodes of ``tasks`` run through ``envs`` (the
    run's faults and fault exposure). It is the one evaluation such a run makes: every number below
    comes from these episodes. Task i is reset with env seed ``seed + i``, so with a fixed ``seed``
    (``env.eval_fault_seed``) every checkpoint meets the same faults for the same actions.

    Batched as rollouts are (:func:`reflrl.rollout.arollout`): with at least as many envs as tasks, every
    task's first answer comes from one engine call, and the episodes the env goes on with (a fault the
    policy sees) continue turn by turn, batched; with fewer envs, the tasks run in chunks of ``len(envs)``.

    Returns (flat keys): ``accuracy`` (share of episodes that ended right: correct and not masked),
    ``stderr``, ``n``, ``by_gold_calls`` ([right, tasks] per number of gold calls), ``format_rate`` (share
    of first answers that parse as at least one call), ``first_answer_accuracy`` (the first answer alone
    calls exactly the gold calls), ``new_tokens`` (sampled tokens, every turn), ``capped`` (episodes cut by
    a token cap), ``seconds``; ``clean_accuracy`` and ``n_clean`` (episodes that met no fault: no attempt
    of theirs failed with an env fault), ``recovery_under_faults`` and ``n_faulted`` (of the episodes that
    met at least one fault, the share that still ended right), ``recovered_by_policy`` (episodes the
    policy itself ended right after a fault it was shown), ``recoverable_under_faults``, the API-change
    numbers (``adaptation``, ``adaptation_<kind>``, ``n_changed``, ``n_change_recoverable``,
    ``n_change_recoverable_<kind>``: of the episodes whose call at the change was right apart from it, the
    share that ended right; :func:`reflrl.rollout.fault_outcomes`), ``masked`` (a fault no action could
    handle), ``eval_fault_seed``; with ``recover`` (an async ``trajectories -> RecoveryResult``, e.g.
    :func:`reflrl.recovery.arecover` with a greedy spec) also reflection's repair rate on the failed
    episodes by cause: ``reflected_env_fault`` / ``recovered_env_fault`` / ``reflection_ratio_env_fault``
    (failures caused by a fault) and the same for ``policy_error``. Ratios are None where there is
    nothing to divide."""
    from .rollout import arollout, fault_outcomes

    t0 = time.perf_counter()
    tasks = list(tasks)
    if not tasks or not envs:
        raise ValueError("aevaluate_episodes: no tasks or no envs")
    trajs: list[Any] = []
    counts = {f"{w}_{c}": 0.0 for w in ("reflected", "recovered") for c in ("env_fault", "policy_error")}
    for s in range(0, len(tasks), len(envs)):
        chunk = await arollout(engine, tokenizer, envs, tasks[s: s + len(envs)], 1, gen, seed=seed + s)
        trajs.extend(chunk)  # before reflection: the policy's own episodes are what is scored
        if recover is not None:
            res = await recover(list(chunk))  # a copy: repairs do not replace the episodes scored here
            for k in counts:
                counts[k] += float(res.counts.get(k, 0.0))
    n = len(trajs)
    right = [bool(t.correct) and not t.masked for t in trajs]
    first = [t.steps[0] for t in trajs if t.steps]
    acc = sum(right) / n
    out: dict[str, Any] = {
        "accuracy": acc, "stderr": math.sqrt(acc * (1 - acc) / n), "n": n,
        "by_gold_calls": by_gold_calls(tasks, right),
        "format_rate": sum(bool(st.parse_ok) and st.n_calls > 0 for st in first) / n,
        "first_answer_accuracy": sum(_first_answer_right(t) for t in trajs) / n,
        "new_tokens": sum(t.n_action_tokens for t in trajs), "capped": sum(bool(t.truncated) for t in trajs),
        **fault_outcomes(trajs),
        "masked": sum(bool(t.masked) for t in trajs), "eval_fault_seed": seed,
    }
    if recover is not None:
        out.update(counts)
        for c in ("env_fault", "policy_error"):
            of = counts[f"reflected_{c}"]
            out[f"reflection_ratio_{c}"] = counts[f"recovered_{c}"] / of if of else None
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def _first_answer_right(t: Any) -> bool:
    """The episode's first answer alone calls exactly the gold calls of the task's first turn."""
    if not t.steps or not t.task.gold:
        return False
    st = t.steps[0]
    calls = st.info.get("calls") or []
    return bool(st.parse_ok and calls and calls_match([ToolCall.from_dict(c) for c in calls], list(t.task.gold[0])))
