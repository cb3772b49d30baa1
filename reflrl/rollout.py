"""Rollouts: sample n answers per task from the policy and run them through the tool environments.

Single-turn (``kind == "single"``/``"parallel"``): the B prompts are rendered once with the tokenizer's
chat template, all B×n samples come from ONE batched engine call, then every environment steps
concurrently (``asyncio.gather`` over ``env.astep``), so a slow or rate-limited tool only delays its
own trajectory's reward, not the others' (VerlTool, sec. 3.3 "Asynchronous Rollout Design").

Multi-turn: each trajectory alternates generation and tool observations. Generation is batched
over every trajectory that is *ready* (not waiting for a tool); tool calls of all trajectories run
concurrently on the event loop while the next generation batch runs in a worker thread
(torch releases the GIL), again following VerlTool sec. 3.3.

On a continuous-batching engine (``rollout.continuous``: :func:`pooled`) there are no generation batches:
each task's n first answers are one request and each later answer of an episode its own, submitted to the
engine's decode loop as soon as the episode is ready (:func:`_pooled_episodes`), so an episode's next turn
decodes beside the others' answers instead of waiting for a batch.

Tokenization (VerlTool, sec. 3.3 "Tokenization"): the action tokens of a trajectory are exactly the
sampled ids (never re-tokenized text); observation tokens (tool messages rendered by the chat
template + the next assistant header) are tokenized separately and appended with loss_mask 0, so the
trained tokens are on-policy and observations get no gradient.

Env faults that the env could not recover (``masked``) leave the trajectory out of the loss: they are
never turned into a negative reward. With faults the policy sees (``env.fault_exposure="policy"``) a
single-turn episode goes on after a fault: those trajectories continue as multi-turn ones (the tool's
error as the observation, then the policy's next answer) until the env ends the episode.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from reflrl.envs.parsing import answer_complete, format_calls
from reflrl.envs.types import Task


@dataclass
class StepRecord:
    """What one env step told the rollout: the typed view of the env's ``info`` dict (the Gymnasium
    contract between env and rollout), kept per step on the :class:`Trajectory`.

    reward / correct:     the step's reward and exact-match verdict.
    masked:               an env fault the client's retries did not recover (never penalised).
    parse_ok / n_calls:   whether the answer parsed, and how many calls it made.
    triage:               the env's triage of the step's calls (ok / env_fault / policy_error ...).
    env_fault_treatment:  "retried-recovered" | "masked" | None.
    reward_parts:         the reward's parts (the fine reward's format/name/key/value), if any.
    fault_events:         the fault events the step observed.
    billed_calls:         tool calls billed (retries included).
    info:                 the env's whole info dict (what a critic is shown about the step).
    """

    reward: float
    correct: bool
    masked: bool
    parse_ok: bool | None = None
    n_calls: int = 0
    triage: Any = None
    env_fault_treatment: str | None = None
    reward_parts: dict[str, float] | None = None
    fault_events: list[Any] = field(default_factory=list)
    billed_calls: int = 0
    info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_info(cls, reward: float, info: dict[str, Any]) -> "StepRecord":
        return cls(reward=float(reward), correct=_is_correct(info, reward), masked=_fault_outcome(info),
                   parse_ok=info.get("parse_ok"), n_calls=len(info.get("calls") or []), triage=info.get("triage"),
                   env_fault_treatment=info.get("env_fault_treatment"),
                   reward_parts=dict(info["reward_parts"]) if isinstance(info.get("reward_parts"), dict) else None,
                   fault_events=list(info.get("fault_events") or []),
                   billed_calls=int(info.get("billed_calls") or 0), info=info)


@dataclass
class Trajectory:
    """One rollout.

    prompt_ids:    the rendered prompt (chat template + generation prompt), list[int] of length P.
    response_ids:  everything after the prompt, length R: sampled action tokens and, in multi-turn
                   episodes, the observation tokens between them.
    loss_mask:     length R; 1 on sampled (action) tokens, 0 on observation tokens.
    old_logprobs:  length R; the engine's log-prob of each sampled token (0.0 on observations).
    reward:        the env's reward (0 for a masked trajectory: it is not used anyway).
    correct:       the answer was fully right (exact match) — used by the pre-rollout filter.
    masked:        an env fault was not recovered: excluded from the loss, never penalised.
    steps:         one :class:`StepRecord` per env step (fault events, triage, parse_ok, calls, ...).
    group:         index of the task in the batch (GRPO group).
    added:         a reflection repair that joined its group beside the failure it repairs (Tool-ReRL,
                   ``reflection.group="add"``), rather than taking its place.
    seed:          the env seed its episode was reset with (``reset(seed=...)`` with the same task
                   replays the episode: the same tool answers and faults for the same actions).
    """

    task: Task
    group: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    old_logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    correct: bool = False
    masked: bool = False
    steps: list[StepRecord] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # decoded actions, one per turn
    turns: int = 0
    truncated: bool = False
    # Tool-ReRL (reflrl.recovery): a reflection-repaired rollout keeps its RepairRecord (q, q*, attempts,
    # critiques) and the failed rollout it replaced in the group; old_logprobs are then log pi(tau*|q*).
    repair: Any = None
    original: Any = None
    added: bool = False
    seed: int | None = None

    @property
    def last(self) -> StepRecord | None:
        """The last env step (its triage and env info are what a critic judges), or None."""
        return self.steps[-1] if self.steps else None

    @property
    def fault_events(self) -> list[Any]:
        return [e for s in self.steps for e in s.fault_events]

    @property
    def parse_ok(self) -> bool | None:
        return self.steps[-1].parse_ok if self.steps else None

    @property
    def met_fault(self) -> bool:
        """Some attempt of the episode failed with an env fault (absorbed by the client's retries, shown
        to the policy, or masking the episode)."""
        return any(e.get("triage") == "env_fault" for e in self.fault_events)

    @property
    def recovered_by_policy(self) -> bool:
        """Faults the policy sees: a fault came back to the policy as the tool's answer and the policy
        itself ended the episode right (it called again; a reflection repair is not the policy's own)."""
        return bool(self.correct) and not self.masked and self.repair is None and any(
            s.env_fault_treatment == "to-policy" for s in self.steps[:-1])

    @property
    def n_calls(self) -> int:
        return sum(s.n_calls for s in self.steps)

    @property
    def repaired(self) -> bool:
        """tau* sampled under q* and judged positive (trained on q with eq. 2's weight)."""
        return self.repair is not None and bool(getattr(self.repair, "repaired", False))

    @property
    def n_action_tokens(self) -> int:
        return int(sum(self.loss_mask))

    def append_action(self, ids: Sequence[int], logprobs: Sequence[float]) -> None:
        if len(ids) != len(logprobs):
            raise ValueError(f"action has {len(ids)} ids but {len(logprobs)} log-probs")
        self.response_ids.extend(int(i) for i in ids)
        self.loss_mask.extend([1] * len(ids))
        self.old_logprobs.extend(float(x) for x in logprobs)

    def append_observation(self, ids: Sequence[int]) -> None:
        self.response_ids.extend(int(i) for i in ids)
        self.loss_mask.extend([0] * len(ids))
        self.old_logprobs.extend([0.0] * len(ids))


@dataclass
class RolloutSpec:
    """How rollouts run: tokens per turn, temperature, turns, concurrency, when an answer stops.

    Built from a run's config by :meth:`from_config` (the ``rollout`` section, ``env.concurrency``, the
    answer format and whether prompts ask for a thought); tests and scripts construct it directly."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    max_turns: int = 1
    max_total_tokens: int = 1024      # prompt + response cap for multi-turn episodes
    concurrent: bool = True           # False: step envs one at a time (the baseline bench (d) measures)
    concurrency: int = 64             # at most this many env calls (reset/step) in flight at once
    answer_cap: float | None = None   # single-turn: per-task cap sized to the gold answer (answer_token_cap)
    stop_at_complete: bool = False    # stop an answer once its tool calls are complete (answer_complete)
    fmt: str = "hermes"               # the tool-call format answers are written in
    think: bool = False               # answers start with a <think> block (adds THINK_TOKENS to the cap)

    @classmethod
    def from_config(cls, cfg: Any, *, fmt: str, think: bool) -> "RolloutSpec":
        """From a :class:`reflrl.config.Config` (``fmt``: the format answers are written in; ``think``:
        whether prompts ask for a <think> block)."""
        r = cfg.rollout
        return cls(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, max_turns=r.max_turns,
                   max_total_tokens=r.max_total_tokens, concurrent=cfg.env.concurrency > 1,
                   concurrency=cfg.env.concurrency, answer_cap=r.answer_cap, stop_at_complete=r.stop_at_complete,
                   fmt=fmt, think=think)

    def stop_when(self):
        """The engine's ``stop_when`` test for this config (None: stop at the end of the turn only)."""
        return functools.partial(answer_complete, fmt=self.fmt) if self.stop_at_complete else None


ANSWER_CAP_MARGIN = 16  # tokens added to answer_cap x the gold answer's length
THINK_TOKENS = 128      # extra tokens for a <think> block


def answer_token_cap(task: Task, tokenizer: Any, cfg: RolloutSpec) -> int:
    """New-token cap of one single-turn answer to ``task``: ``ceil(cfg.answer_cap x g) + 16`` (+ 128
    with a ``<think>`` block), where g counts the tokens of the task's gold first-turn calls written in
    ``cfg.fmt`` plus the end-of-turn token; at most ``cfg.max_new_tokens``. A correct answer is about
    g tokens long, so the cap never cuts one, while a rambling answer costs no more than about
    ``answer_cap`` correct ones. Tasks without gold calls, and ``cfg.answer_cap=None``, get
    ``cfg.max_new_tokens``."""
    if cfg.answer_cap is None or not task.gold or not task.gold[0]:
        return cfg.max_new_tokens
    try:
        text = format_calls(list(task.gold[0]), cfg.fmt)
    except ValueError:  # a gold call this format cannot write: no basis for a cap
        return cfg.max_new_tokens
    g = len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1
    cap = math.ceil(cfg.answer_cap * g) + ANSWER_CAP_MARGIN + (THINK_TOKENS if cfg.think else 0)
    return max(1, min(cfg.max_new_tokens, cap))


# ---------------------------------------------------------------------------------------- rendering
def render_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template and the assistant
    generation prompt appended."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def observation_text(tokenizer: Any, before: list[dict[str, Any]], action_text: str,
                     after: list[dict[str, Any]], sampled_text: str) -> str:
    """The text to append after a sampled action so the sequence equals the chat template's
    rendering of ``after`` with a new assistant generation prompt.

    before:       messages up to (not including) the assistant action.
    action_text:  the assistant message content as the env recorded it.
    after:        messages after the action (tool results, maybe a new user turn); must not be empty.
    sampled_text: the decoded sampled ids WITH special tokens (e.g. "...</tool_call><|im_end|>").

    The result = (what the template writes after the sampled text to close the assistant message,
    e.g. "\\n" after "<|im_end|>", or "<|im_end|>\\n" if generation was cut) + (the rendering of
    ``after`` + the assistant header). Falls back to rendering ``after`` alone when the template
    rewrites earlier text (rare: templates that drop reasoning from history).
    """
    asst = {"role": "assistant", "content": action_text}
    head = tokenizer.apply_chat_template(before, tokenize=False, add_generation_prompt=True)
    closed = tokenizer.apply_chat_template(before + [asst], tokenize=False)
    full = tokenizer.apply_chat_template(before + [asst] + after, tokenize=False, add_generation_prompt=True)
    block = closed[len(head):] if closed.startswith(head) else ""
    if block.startswith(sampled_text):
        tail = block[len(sampled_text):]
    else:  # the sample stopped early or the template normalised the content: close it ourselves
        eos = tokenizer.eos_token or ""
        tail = block[len(action_text):] if block.startswith(action_text) else (eos + "\n")
        if sampled_text.endswith(eos) and tail.startswith(eos):
            tail = tail[len(eos):]
    if full.startswith(closed):
        return tail + full[len(closed):]
    rendered = tokenizer.apply_chat_template(after, tokenize=False, add_generation_prompt=True)
    return tail + rendered


# ------------------------------------------------------------------------------------ generation
def generate_batch(engine: Any, prompts: list[list[int]], cfg: RolloutSpec, *, n: int = 1,
                   max_new_tokens: int | Sequence[int] | None = None, seed: int = 0
                   ) -> list[tuple[list[int], list[float], bool]]:
    """One batched engine call: ``n`` samples per prompt (token ids), prompt-major; ``max_new_tokens``:
    one cap or one per prompt (default ``cfg.max_new_tokens``); answers stop early per
    ``cfg.stop_when()``.

    Returns, per sample, (sampled ids, their log-probs, finished) where finished is False when the
    sample was cut at its cap (the engine's finish_reason "length")."""
    out = engine.generate(prompts, **_engine_args(cfg, n, max_new_tokens, seed))
    return _checked(out, len(prompts), n)


async def agenerate_batch(engine: Any, prompts: list[list[int]], cfg: RolloutSpec, *, n: int = 1,
                          max_new_tokens: int | Sequence[int] | None = None, seed: int = 0, held: bool = False
                          ) -> list[tuple[list[int], list[float], bool]]:
    """:func:`generate_batch` through the engine's awaitable ``agenerate`` (a continuous-batching engine:
    the prompts join the decode loop that serves every waiting request, :func:`pooled`). ``held``: the
    caller takes part in the engine's lockstep (it holds one of the engine's holds, see :func:`holding`)."""
    extra = {"held": True} if held else {}
    out = await engine.agenerate(prompts, **_engine_args(cfg, n, max_new_tokens, seed), **extra)
    return _checked(out, len(prompts), n)


class holding:
    """``async with holding(engine, k):`` ``k`` coroutines take part in the engine's lockstep: the engine's
    decode loop runs no step while one of them is between two requests (a tool step, a critique), so
    which requests share a decode step -- and with it each row's float rounding -- follows from the seed,
    not from when a tool answered. Each coroutine submits with ``held=True`` and calls
    :meth:`release` when it will submit nothing more (``engine.hold`` / ``engine.release``; engines
    without them need nothing)."""

    def __init__(self, engine: Any, k: int):
        self.engine, self.k = engine, int(k)

    def __enter__(self) -> "holding":
        hold = getattr(self.engine, "hold", None)
        if hold is not None:
            hold(self.k)
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def release(self) -> None:
        rel = getattr(self.engine, "release", None)
        if rel is not None:
            rel(1)


def pooled(engine: Any, cfg: RolloutSpec) -> bool:
    """Whether rollouts go through ``engine``'s continuous batching (its ``continuous`` flag and an
    ``agenerate``; env steps concurrent): every answer, first or after a fault, is then its own request,
    submitted as soon as its episode is ready, instead of one engine call per batch of ready episodes."""
    return bool(cfg.concurrent and getattr(engine, "continuous", False) and hasattr(engine, "agenerate"))


def _engine_args(cfg: RolloutSpec, n: int, max_new_tokens: int | Sequence[int] | None, seed: int) -> dict[str, Any]:
    mnt = max_new_tokens or cfg.max_new_tokens
    if not isinstance(mnt, int) and len(set(mnt)) == 1:
        mnt = int(next(iter(mnt)))
    extra: dict[str, Any] = {"n": n, "max_new_tokens": mnt, "temperature": cfg.temperature, "top_p": cfg.top_p,
                             "seed": seed}
    stop_when = cfg.stop_when()
    if stop_when is not None:
        extra["stop_when"] = stop_when
    return extra


def _checked(out: list[Any], n_prompts: int, n: int) -> list[tuple[list[int], list[float], bool]]:
    if len(out) != n_prompts * n:
        raise ValueError(f"engine returned {len(out)} samples for {n_prompts} prompts x {n}")
    res = []
    for smp in out:
        ids = [int(t) for t in smp.token_ids]
        lps = [float(x) for x in smp.logprobs]
        if len(lps) != len(ids):
            raise ValueError(f"engine sample has {len(ids)} tokens but {len(lps)} log-probs")
        res.append((ids, lps, smp.finish_reason == "stop"))
    return res


# ------------------------------------------------------------------------------------------ envs
def _fault_outcome(info: dict[str, Any]) -> bool:
    """True when this env step ended in an env fault the env did not recover (mask it)."""
    if "masked" in info:
        return bool(info["masked"])
    return info.get("env_fault_treatment") == "masked"


def _is_correct(info: dict[str, Any], reward: float) -> bool:
    if "correct" in info:
        return bool(info["correct"])
    parts = info.get("reward_parts") or {}
    if isinstance(parts, dict) and "exact_match" in parts:
        return bool(parts["exact_match"])
    return float(reward) >= 1.0


def record_step(traj: Trajectory, reward: float, info: dict[str, Any]) -> StepRecord:
    """Record an env step's result on ``traj`` (reward, correctness, masking; a :class:`StepRecord`)."""
    rec = StepRecord.from_info(reward, info)
    traj.reward = rec.reward
    traj.correct = rec.correct
    traj.masked = traj.masked or rec.masked
    traj.steps.append(rec)
    return rec


async def reset_episode(env: Any, task: Task, seed: int, *, fault_draw: tuple[int, int] | None = None
                        ) -> tuple[Any, dict[str, Any]]:
    """Start an episode of ``task`` on ``env`` (async when the env offers ``areset``). ``fault_draw``:
    (from_step, draw), the steps from ``from_step`` on meet fresh fault draws numbered ``draw`` (the env's
    reset option: a replay whose last step is a new try)."""
    options: dict[str, Any] = {"task": task}
    if fault_draw is not None:
        options["fault_draw"] = fault_draw
    u = env.unwrapped
    if hasattr(u, "areset"):
        return await u.areset(seed=seed, options=options)
    return env.reset(seed=seed, options=options)


async def step_episode(env: Any, action: str) -> tuple[Any, float, bool, bool, dict[str, Any]]:
    """One env step with ``action`` (async when the env offers ``astep``)."""
    u = env.unwrapped
    if hasattr(u, "astep"):
        return await u.astep(action)
    return env.step(action)


async def end_by_budget(env: Any, tr: Trajectory) -> None:
    """The rollout's token budget ended episode ``tr`` while a fault shown to the policy was still open (its
    env would have gone on). The env's final attribution (``aend_episode``) decides how it ended: masked when
    the policy had no message left to act on the fault, the policy's failure (a wrong answer, ``change_caused``)
    when it had met that API change at an earlier message and still sent the old call. Its fields are merged
    into the last step's record. An env without ``aend_episode``: masked."""
    fn = getattr(env.unwrapped, "aend_episode", None)
    if fn is None:
        tr.masked = True
        return
    reward, info = await fn()
    last = tr.last
    last.info = {**last.info, **{k: v for k, v in info.items() if k != "env_fault_treatment"}}
    last.masked = last.masked or bool(info.get("masked"))
    last.correct = False
    tr.reward, tr.correct = float(reward), False
    tr.masked = tr.masked or bool(info.get("masked"))


async def _run_all(coros: list, concurrent: bool, limit: int = 0) -> list:
    """Await ``coros``: all at once (at most ``limit`` in flight when > 0), or one after another."""
    if concurrent:
        if limit and limit < len(coros):
            sem = asyncio.Semaphore(limit)

            async def bounded(c):
                async with sem:
                    return await c

            return await asyncio.gather(*(bounded(c) for c in coros))
        return await asyncio.gather(*coros)
    out = []
    for c in coros:  # one at a time: the baseline the rollout benchmark compares against
        out.append(await c)
    return out


# -------------------------------------------------------------------------------------- rollouts
async def arollout(engine: Any, tokenizer: Any, envs: Sequence[Any], tasks: Sequence[Task], n: int,
                   cfg: RolloutSpec, *, seed: int = 0, timings: dict[str, float] | None = None
                   ) -> list[Trajectory]:
    """Roll out n samples for each task: returns B×n Trajectories ordered task-major
    (trajectory j of task i at index i*n + j, ``group == i``).

    envs:  at least B×n environments (gymnasium envs with async ``areset``/``astep``), reused across
           calls; env k serves trajectory k.
    seed:  base seed; episode k is reset with seed + k (deterministic fault schedules).
    timings: if given, receives "generate_s" and "env_s" (wall seconds spent in each).
    """
    total = len(tasks) * n
    if len(envs) < total:
        raise ValueError(f"need {total} environments for {len(tasks)} tasks x {n} rollouts, got {len(envs)}")
    t = timings if timings is not None else {}
    t.setdefault("generate_s", 0.0)
    t.setdefault("env_s", 0.0)
    t0 = time.perf_counter()
    resets = await _run_all([reset_episode(envs[k], tasks[k // n], seed + k) for k in range(total)],
                           cfg.concurrent, cfg.concurrency)
    t["env_s"] += time.perf_counter() - t0
    trajs: list[Trajectory] = []
    messages: list[list[dict[str, Any]]] = []
    for k, (_obs, info) in enumerate(resets):
        msgs = info.get("messages")
        if not msgs:
            raise KeyError("env reset info has no 'messages' to render with the chat template")
        messages.append(list(msgs))
        trajs.append(Trajectory(task=tasks[k // n], group=k // n, prompt_ids=render_prompt(tokenizer, msgs),
                                seed=seed + k))
    if pooled(engine, cfg):
        await _pooled_episodes(engine, tokenizer, envs, trajs, messages, cfg, t, seed)
    elif cfg.max_turns <= 1:
        await _single_turn(engine, tokenizer, envs, trajs, cfg, t, seed, messages)
    else:
        await _multi_turn(engine, tokenizer, envs, trajs, messages, cfg, t, seed)
    return trajs


async def _single_turn(engine, tokenizer, envs, trajs: list[Trajectory], cfg: RolloutSpec,
                       t: dict[str, float], seed: int, messages: list[list[dict]] | None = None) -> None:
    """All B×n samples in one engine call, then all env steps concurrently; episodes the env goes on
    with (a fault the policy sees) continue turn by turn (:func:`_multi_turn`) until the env ends them."""
    t0 = time.perf_counter()
    groups = sorted({tr.group for tr in trajs})
    first = {g: next(k for k, tr in enumerate(trajs) if tr.group == g) for g in groups}
    # every answer to the task, the first and each one after a fault, has the task's answer cap
    caps = [answer_token_cap(tr.task, tokenizer, cfg) for tr in trajs]
    if all(tr.prompt_ids == trajs[first[tr.group]].prompt_ids for tr in trajs) and \
            [tr.group for tr in trajs] == [g for g in groups for _ in range(len(trajs) // len(groups))]:
        # the n rollouts of a task share its prompt: one prefill per task, n samples each
        samples = generate_batch(engine, [trajs[first[g]].prompt_ids for g in groups], cfg,
                                 n=len(trajs) // len(groups), seed=seed,
                                 max_new_tokens=[caps[first[g]] for g in groups])
    else:
        samples = generate_batch(engine, [tr.prompt_ids for tr in trajs], cfg, seed=seed, max_new_tokens=caps)
    t["generate_s"] += time.perf_counter() - t0
    texts = []
    for tr, (ids, lps, fin) in zip(trajs, samples):
        tr.append_action(ids, lps)
        tr.truncated = not fin
        tr.turns = 1
        texts.append(tokenizer.decode(ids, skip_special_tokens=True))
        tr.texts.append(texts[-1])
    t0 = time.perf_counter()
    results = await _run_all([step_episode(envs[k], texts[k]) for k in range(len(trajs))], cfg.concurrent,
                             cfg.concurrency)
    t["env_s"] += time.perf_counter() - t0
    for tr, (_obs, reward, _term, _trunc, info) in zip(trajs, results):
        record_step(tr, reward, info)
    going = [k for k, (_o, _r, term, trunc, _i) in enumerate(results)
             if not (term or trunc or trajs[k].masked or trajs[k].truncated)]
    if going and messages is not None:
        ready = [k for k in going if _observe(tokenizer, trajs[k], messages, k, results[k][4], texts[k],
                                               [i for i, m in zip(trajs[k].response_ids, trajs[k].loss_mask) if m])]
        await _multi_turn(engine, tokenizer, envs, trajs, messages, dataclasses.replace(cfg, max_turns=1 << 30),
                          t, seed + 1, ready=ready, caps=caps)
        for k in going:  # the token budget ended it while a fault was still open
            if trajs[k].last.env_fault_treatment == "to-policy":
                await end_by_budget(envs[k], trajs[k])


async def _multi_turn(engine, tokenizer, envs, trajs: list[Trajectory], messages: list[list[dict]],
                      cfg: RolloutSpec, t: dict[str, float], seed: int, ready: list[int] | None = None,
                      caps: Sequence[int] | None = None) -> None:
    """Alternate batched generation of the ready trajectories with concurrent env steps.

    Loop: generate for every ready trajectory in one batch (in a worker thread, so in-flight tool
    calls keep progressing on the event loop); start an env step for each; then wait until at least
    one env step finishes and collect every finished one; those not done become ready again.
    ``ready``: the trajectories to go on with (default: all). Each trajectory's turn gets its own
    new-token cap: ``caps[k]`` (default ``cfg.max_new_tokens``), at most the room its own context leaves
    under ``cfg.max_total_tokens``, so a long episode in the batch never shortens the others' turns.
    """
    loop = asyncio.get_running_loop()
    ready = list(range(len(trajs))) if ready is None else list(ready)
    pending: dict[asyncio.Future, tuple[int, str, list[int]]] = {}
    rounds = 0
    while ready or pending:
        if ready:
            batch = [k for k in ready if _fits(trajs[k], cfg)]
            for k in ready:
                if k not in batch:
                    trajs[k].truncated = True
            ready = []
            if batch:
                t0 = time.perf_counter()
                prompts = [trajs[k].prompt_ids + trajs[k].response_ids for k in batch]
                room = [min(cfg.max_new_tokens if caps is None else caps[k], max(1, cfg.max_total_tokens - len(p)))
                        for k, p in zip(batch, prompts)]
                call = functools.partial(generate_batch, engine, prompts, cfg, max_new_tokens=room,
                                         seed=seed + 7919 * rounds)
                rounds += 1
                samples = await loop.run_in_executor(None, call)
                t["generate_s"] += time.perf_counter() - t0
                for k, (ids, lps, fin) in zip(batch, samples):
                    tr = trajs[k]
                    text = _take_answer(tokenizer, tr, ids, lps, fin)
                    if cfg.concurrent:
                        fut = asyncio.ensure_future(_timed_step(envs[k], text))
                    else:  # one tool step at a time (the baseline): finish it before the next starts
                        fut = loop.create_future()
                        fut.set_result(await _timed_step(envs[k], text))
                    pending[fut] = (k, text, ids)
        if not pending:
            continue
        done, _ = await asyncio.wait(list(pending), return_when=asyncio.FIRST_COMPLETED)
        if not cfg.concurrent:
            done = sorted(done, key=lambda f: pending[f][0])
        for fut in done:
            k, text, ids = pending.pop(fut)
            (_obs, reward, term, trunc, info), dt = fut.result()
            t["env_s"] += dt
            tr = trajs[k]
            record_step(tr, reward, info)
            if term or trunc or tr.masked or tr.turns >= cfg.max_turns or tr.truncated:
                tr.truncated = tr.truncated or (bool(trunc) and not term)
                continue
            if _observe(tokenizer, tr, messages, k, info, text, ids):
                ready.append(k)


class OverlapTimer:
    """Wall seconds during which at least one of several overlapping waits was in progress (``with busy:``),
    added to ``timings[key]``: generation and env steps overlap on the continuous path, so each is counted
    as the time it was going on, not the sum over episodes."""

    def __init__(self, timings: dict[str, float], key: str):
        self.timings, self.key, self.open, self.t0 = timings, key, 0, 0.0

    def __enter__(self) -> None:
        if self.open == 0:
            self.t0 = time.perf_counter()
        self.open += 1

    def __exit__(self, *exc: Any) -> None:
        self.open -= 1
        if self.open == 0:
            self.timings[self.key] += time.perf_counter() - self.t0


async def _pooled_episodes(engine, tokenizer, envs, trajs: list[Trajectory], messages: list[list[dict]],
                           cfg: RolloutSpec, t: dict[str, float], seed: int) -> None:
    """The episodes of :func:`arollout` on a continuous-batching engine (:func:`pooled`): each task's n first
    answers are one request (its prompt prefilled once), each later answer of an episode (a turn after a
    fault the policy is shown, or the next turn of a multi-turn env) its own request, submitted as soon as
    the episode's env step has answered; the engine decodes every waiting request in one loop. The same
    episodes as the batch path (caps, turn and token limits, truncation, masking), sampled from other
    seeds: a task's first answers from ``derive_seed(seed, 0, group)``, turn j of episode k from
    ``derive_seed(seed, 1, k, j)``."""
    from reflrl.envs.seeding import derive_seed

    single = cfg.max_turns <= 1
    caps = [answer_token_cap(tr.task, tokenizer, cfg) if single else cfg.max_new_tokens for tr in trajs]
    sem = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency > 0 else None
    gen_busy, env_busy = OverlapTimer(t, "generate_s"), OverlapTimer(t, "env_s")

    async def env_step(k: int, text: str):
        with env_busy:
            if sem is None:
                return await step_episode(envs[k], text)
            async with sem:
                return await step_episode(envs[k], text)

    async def act(k: int, ids: list[int], lps: list[float], fin: bool) -> int:
        """Record answer ``ids`` of episode k, step its env: 0 when the episode ended, 1 when the env went on
        but added nothing to answer, 2 when the env's answer was appended (the next turn is due)."""
        tr = trajs[k]
        text = _take_answer(tokenizer, tr, ids, lps, fin)
        _obs, reward, term, trunc, info = await env_step(k, text)
        record_step(tr, reward, info)
        if term or trunc or tr.masked or tr.truncated or (not single and tr.turns >= cfg.max_turns):
            tr.truncated = tr.truncated or (bool(trunc) and not term)
            return 0
        return 2 if _observe(tokenizer, tr, messages, k, info, text, ids) else 1

    async def later_turns(k: int, hold: holding) -> None:
        """Episode k's next answers until it ends; then its hold goes back (lockstep, :class:`holding`)."""
        tr = trajs[k]
        try:
            while True:
                if not _fits(tr, cfg):
                    tr.truncated = True
                    return
                prompt = tr.prompt_ids + tr.response_ids
                room = min(caps[k], max(1, cfg.max_total_tokens - len(prompt)))
                with gen_busy:
                    (ids, lps, fin), = await agenerate_batch(engine, [prompt], cfg, max_new_tokens=room,
                                                             seed=derive_seed(seed, 1, k, tr.turns), held=True)
                if await act(k, ids, lps, fin) < 2:
                    return
        finally:
            hold.release()

    async def episode(k: int, ids: list[int], lps: list[float], fin: bool, hold: holding) -> None:
        try:
            going = await act(k, ids, lps, fin)
        except BaseException:
            hold.release()
            raise
        if going == 2:
            await later_turns(k, hold)
        else:
            hold.release()
        if single and going and trajs[k].last.env_fault_treatment == "to-policy":
            await end_by_budget(envs[k], trajs[k])  # the token budget ended it while a fault was still open

    async def group(members: list[int], hold: holding) -> None:
        first = trajs[members[0]]
        try:
            with gen_busy:
                samples = await agenerate_batch(engine, [first.prompt_ids], cfg, n=len(members), held=True,
                                                max_new_tokens=caps[members[0]], seed=derive_seed(seed, 0, first.group))
        except BaseException:
            hold.release()
            raise
        # the answer handed one hold per sample back: each episode gives its own back when it ends
        await asyncio.gather(*(episode(k, *smp, hold) for k, smp in zip(members, samples)))

    if single:
        by_group: dict[tuple[int, tuple[int, ...]], list[int]] = {}
        for k, tr in enumerate(trajs):  # the rollouts of a task that share its prompt: one request
            by_group.setdefault((tr.group, tuple(tr.prompt_ids)), []).append(k)
        with holding(engine, len(by_group)) as hold:
            await asyncio.gather(*(group(members, hold) for members in by_group.values()))
    else:
        with holding(engine, len(trajs)) as hold:
            await asyncio.gather(*(later_turns(k, hold) for k in range(len(trajs))))


def observation_ids(tokenizer, before: list[dict], info: dict[str, Any], text: str, ids: list[int]
                    ) -> tuple[list[int], list[dict]] | None:
    """What the env answered to action ``ids`` (sampled after the conversation ``before``) as tokens: the
    tool messages, maybe a new user turn, and the next assistant header (:func:`observation_text`), with
    the conversation after it (``info["messages"]``); None when the env added nothing to answer."""
    new_msgs = list(info.get("messages") or [])
    after = new_msgs[len(before) + 1:] if len(new_msgs) > len(before) + 1 else []
    if not after:
        return None
    action_text = new_msgs[len(before)].get("content", text) if len(new_msgs) > len(before) else text
    sampled = tokenizer.decode(ids, skip_special_tokens=False)
    obs = observation_text(tokenizer, before, action_text, after, sampled)
    return tokenizer(obs, add_special_tokens=False)["input_ids"], new_msgs


def _observe(tokenizer, tr: Trajectory, messages: list[list[dict]], k: int, info: dict[str, Any], text: str,
             ids: list[int]) -> bool:
    """Append what the env answered to action ``ids`` to ``tr`` as observation tokens
    (:func:`observation_ids`), and move ``messages[k]`` on; False when the env added nothing to answer
    (the episode is over)."""
    got = observation_ids(tokenizer, messages[k], info, text, ids)
    if got is None:
        return False
    tr.append_observation(got[0])
    messages[k] = got[1]
    return True


def _take_answer(tokenizer, tr: Trajectory, ids: list[int], lps: list[float], fin: bool) -> str:
    """Append a sampled answer to ``tr`` as its next turn (cut at its cap when not ``fin``); its text."""
    tr.append_action(ids, lps)
    tr.turns += 1
    text = tokenizer.decode(ids, skip_special_tokens=True)
    tr.texts.append(text)
    if not fin:
        tr.truncated = True
    return text


def _fits(tr: Trajectory, cfg: RolloutSpec) -> bool:
    return len(tr.prompt_ids) + len(tr.response_ids) < cfg.max_total_tokens - 8


async def _timed_step(env: Any, action: str):
    t0 = time.perf_counter()
    res = await step_episode(env, action)
    return res, time.perf_counter() - t0


def rollout(engine: Any, tokenizer: Any, envs: Sequence[Any], tasks: Sequence[Task], n: int,
            cfg: RolloutSpec, *, seed: int = 0, timings: dict[str, float] | None = None) -> list[Trajectory]:
    """Synchronous wrapper of :func:`arollout` (runs its own event loop)."""
    return asyncio.run(arollout(engine, tokenizer, envs, tasks, n, cfg, seed=seed, timings=timings))


def fault_outcomes(trajs: Sequence[Trajectory]) -> dict[str, Any]:
    """How episodes ended by whether they met a fault (:attr:`Trajectory.met_fault`); an episode is right
    when it is correct and not masked. ``clean_accuracy`` / ``n_clean``: episodes that met no fault;
    ``recovery_under_faults`` / ``n_faulted``: of the episodes that met at least one fault, the share that
    still ended right (None where there is no episode to divide by); ``recovered_by_policy``: episodes the
    policy itself ended right after a fault it was shown; ``recoverable_under_faults``: of the episodes that
    met a fault, the share that ended right or failed only by not calling its faulted calls again (the
    answer given at the fault was right: ``fault_caused``), the most recovery under faults can reach
    without better first answers.

    API changes (the sticky ``param_renamed`` / ``tool_moved`` faults; the env's ``api_changes`` and
    ``change_recoverable`` info at the episode's end): ``n_changed``, the episodes that met at least one
    change; ``adaptation`` / ``n_change_recoverable``: of the episodes whose call at the change was right
    apart from it (``change_recoverable``), the share that ended right; ``adaptation_<kind>`` /
    ``n_change_recoverable_<kind>`` the same for the episodes that met a change of that kind
    (:data:`API_CHANGE_KINDS`). None where there is no episode to divide by."""
    clean = [bool(t.correct) and not t.masked for t in trajs if not t.met_fault]
    hit = [bool(t.correct) and not t.masked for t in trajs if t.met_fault]
    caused = sum(1 for t in trajs if t.met_fault and not t.masked and not t.correct
                 and t.last is not None and t.last.info.get("fault_caused"))
    return {"clean_accuracy": (sum(clean) / len(clean)) if clean else None, "n_clean": len(clean),
            "recovery_under_faults": (sum(hit) / len(hit)) if hit else None, "n_faulted": len(hit),
            "recovered_by_policy": sum(t.recovered_by_policy for t in trajs),
            "recoverable_under_faults": ((sum(hit) + caused) / len(hit)) if hit else None,
            **adaptation_outcomes(trajs)}


# the fault kinds of API evolution: a parameter renamed, a tool moved to a successor (sticky per episode and tool)
API_CHANGE_KINDS = ("param_renamed", "tool_moved")


def api_changes(t: Trajectory) -> list[dict[str, Any]]:
    """The API changes the episode met (the env's ``api_changes`` at its last step: every change met so
    far, in the order met); empty when it met none or the env does not report them."""
    return list((t.last.info.get("api_changes") if t.last is not None else None) or [])


def adaptation_outcomes(trajs: Sequence[Trajectory]) -> dict[str, Any]:
    """The API-change part of :func:`fault_outcomes`: ``n_changed``, ``adaptation`` and
    ``n_change_recoverable``, and per kind of :data:`API_CHANGE_KINDS` ``adaptation_<kind>`` and
    ``n_change_recoverable_<kind>``. An episode is right when it is correct and not masked."""
    changed = [(t, {c.get("kind") for c in api_changes(t)}) for t in trajs]
    changed = [(t, kinds) for t, kinds in changed if kinds]
    rec = [(t, kinds) for t, kinds in changed if t.last.info.get("change_recoverable")]

    def share(ts: list[Trajectory]) -> float | None:
        return (sum(bool(t.correct) and not t.masked for t in ts) / len(ts)) if ts else None

    out: dict[str, Any] = {"adaptation": share([t for t, _ in rec]), "n_changed": len(changed),
                           "n_change_recoverable": len(rec)}
    for kind in API_CHANGE_KINDS:
        ts = [t for t, kinds in rec if kind in kinds]
        out[f"adaptation_{kind}"] = share(ts)
        out[f"n_change_recoverable_{kind}"] = len(ts)
    return out


def rollout_stats(trajs: Sequence[Trajectory]) -> dict[str, Any]:
    """Batch metrics: mean reward (unmasked), accuracy, parse rate, masked share, fault counts, and how the
    rollouts ended by whether they met a fault (:func:`fault_outcomes`, prefixed ``rollout_``: the
    held-out evaluation's numbers, on the policy's own samples)."""
    live = [t for t in trajs if not t.masked]
    n = max(1, len(trajs))
    faults = sum(len(t.fault_events) for t in trajs)
    return {
        "rollout_accuracy": sum(bool(t.correct) and not t.masked for t in trajs) / n,
        **{f"rollout_{k}": v for k, v in fault_outcomes(trajs).items()},
        "reward_mean": (sum(t.reward for t in live) / len(live)) if live else 0.0,
        "correct_rate": (sum(t.correct for t in live) / len(live)) if live else 0.0,
        "format_rate": sum(bool(t.parse_ok) and t.n_calls > 0 for t in trajs) / n,
        "masked_frac": (len(trajs) - len(live)) / n,
        "fault_events": float(faults),
        "response_tokens_mean": sum(len(t.response_ids) for t in trajs) / n,
        "truncated_frac": sum(t.truncated for t in trajs) / n,
    }
