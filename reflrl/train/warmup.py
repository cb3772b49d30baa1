"""The supervised warm-up phase of a run: when the base model cannot yet write tool calls, SFT on the
training split's gold calls for ``warmup.steps`` steps (:mod:`reflrl.sft`) before RL. A share of the
examples (``warmup.critique_share``) follow a critique: the retry prompt q* of a policy error whose
critique names the fix -> the gold call (:mod:`reflrl.recovery.critique_examples`). A share of both
(``warmup.rename_share``) is made on tasks whose catalogue has one name renamed, so that names are
taken from the context."""
from __future__ import annotations

import time
from typing import Any, Callable

from reflrl import config as C
from reflrl.envs.seeding import derive_seed
from reflrl.progress import Progress
from reflrl.sft import SFTExample, build_examples, example_from_messages, train_sft


def run_warmup(cfg: C.Config, *, model: Any, tokenizer: Any, train_tasks: list, messages: Callable[[Any], list],
               fmt: str, format_rate_before: tuple[float | None, str], over_budget: Callable[[float], bool],
               reserve_s: float, progress: Progress, log: Callable[[int, dict], None],
               say: Callable[[str], None], probe: Callable[[], float] | None = None) -> dict[str, Any]:
    """Run the warm-up if ``warmup.enabled`` says so (``auto``: when the format rate is below the
    threshold) and return its record (``ran``, ``sft_*`` results, format rates, ``sft_cut``).

    format_rate_before: (rate or None when not measured, where it comes from); over_budget(upcoming_s): the run's time guard,
    asked before each step with the step's cost and ``reserve_s`` (the evaluations still to come);
    probe: a sampled format-rate probe to run after the warm-up (``warmup.probe_n > 0``)."""
    w = cfg.warmup
    out: dict[str, Any] = {"ran": False}
    if w.enabled is False or w.steps == 0:
        return out
    out["format_rate_before"], out["format_rate_source"] = format_rate_before
    rate = out["format_rate_before"]
    say(f"format rate before warm-up: {'n/a' if rate is None else f'{rate:.0%}'} "
        f"(threshold {w.format_rate_threshold:.0%}; {out['format_rate_source']})")
    if w.enabled == "auto" and rate is not None and rate >= w.format_rate_threshold:
        return out
    t0 = time.perf_counter()
    examples = build_examples(renamed_share(train_tasks, w.rename_share, derive_seed(cfg.train.seed, 17, bits=31)),
                              tokenizer, messages, fmt=fmt)
    out["renamed_examples"] = sum(1 for e in examples if e.task_id.endswith(RENAMED_SUFFIX))

    # demonstrations are gold answers of fault-free episodes: none shows a fault or a recovery (counted)
    out["demonstrations"] = len(examples)
    critiques = critique_following(cfg, train_tasks, tokenizer, messages, fmt, len(examples))
    out["critique_examples"] = len(critiques)
    examples += critiques
    out["demonstrations_with_fault"] = sum(e.shows_fault for e in examples)

    def should_stop(done: int, sps: float | None) -> bool:
        est = sps or 0.0
        if w.time_budget_min is not None and time.perf_counter() - t0 + est > w.time_budget_min * 60:
            return True
        return over_budget(est + reserve_s)

    phase = progress.phase("warm-up", w.steps)
    res = train_sft(model, tokenizer, examples, steps=w.steps, batch_size=w.batch_size, lr=w.lr,
                    seed=derive_seed(cfg.train.seed, 11, bits=31), grad_clip=cfg.algo.grad_clip or 1.0,
                    warmup_steps=min(5, w.steps // 10), should_stop=should_stop,
                    log=lambda s, m: log(s, m), on_step=lambda done, loss: phase.update(1, loss=loss),
                    activation_budget_mb=cfg.algo.activation_budget_mb)
    phase.close("cut by the time budget" if res["cut"] else "")
    out.update(ran=True, seconds=time.perf_counter() - t0, **{f"sft_{k}": v for k, v in res.items()})
    if probe is not None:
        out["format_rate_after"] = probe()
    loss = ("n/a" if res.get("loss_first") is None  # 0 steps: the time budget left none
            else f"{res['loss_first']:.2f} -> {res['loss_last']:.2f}")
    say(f"warm-up: {res['steps']} SFT steps in {res['seconds']:.0f}s, loss {loss}")
    return out


def critique_following(cfg: C.Config, train_tasks: list, tokenizer: Any, messages: Callable[[Any], list], fmt: str,
                       demonstrations: int) -> list[SFTExample]:
    """The warm-up's critique-following examples (``warmup.critique_share`` of all its examples, beside
    ``demonstrations`` gold answers): q* of a corrupted gold call with the rule critic's analysis at
    ``warmup.critique_reveal``, rendered in ``reflection.mode`` as the RL phase's retries render it
    -> the gold call; seeded by ``train.seed``. None when the share is 0."""
    w = cfg.warmup
    if w.critique_share <= 0:
        return []
    from reflrl.recovery.critics import get_critic
    from reflrl.recovery.critique_examples import critique_count, critique_examples

    made = critique_examples(train_tasks, messages_fn=messages,
                             critic=get_critic("rule", reveal=w.critique_reveal, parser=cfg.env.parser), fmt=fmt,
                             count=critique_count(w.critique_share, demonstrations),
                             seed=derive_seed(cfg.train.seed, 13, bits=31), mode=cfg.reflection.mode,
                             rename_share=w.rename_share)
    return [example_from_messages(c.messages, c.gold, tokenizer, fmt, c.task.id, kind="critique") for c in made]


RENAMED_SUFFIX = "~renamed"


def renamed_share(tasks: list, share: float, seed: int) -> list:
    """``tasks`` with a seeded ``share`` of them renamed (one name of the catalogue:
    :func:`reflrl.recovery.critique_examples.renamed_task`; their ids end in ``~renamed``)."""
    if share <= 0:
        return list(tasks)
    import dataclasses
    import random

    from reflrl.recovery.critique_examples import renamed_task

    rng = random.Random(seed)
    out = []
    for t in tasks:
        r = renamed_task(t, rng) if rng.random() < share else None
        out.append(t if r is None else dataclasses.replace(r, id=f"{t.id}{RENAMED_SUFFIX}"))
    return out
