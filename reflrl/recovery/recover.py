"""Reflection-recovery of one round of rollouts (:func:`arecover`): triage, batched reflection-guided
retries, repaired rollouts in their groups. The retries of one attempt round go to the engine in one call
(:class:`.batcher.RoundBatcher`); on a continuous-batching engine (:func:`reflrl.rollout.pooled`) each retry
is its own request instead, decoded as soon as its critique is ready, seeded by (seed, rollout, attempt).

A rollout of several steps (faults the policy sees, ``env.fault_exposure="policy"``: the tool's error
came back and the policy answered it) is repaired at its LAST step: q is the conversation before the
last answer (the request, the earlier answers and the tool's errors), the failed action is that last
answer, and each retry under q* is executed by replaying the episode (same env seed: the same tool
answers and faults for the same earlier answers) and stepping the retry in its place, with fresh fault
draws for that step derived from (episode seed, attempt): replays stay deterministic, and a retry that
meets a fault does not meet the same one at every attempt. The repair keeps
the earlier steps and replaces the last answer, so it trains on the original prompt with the retry's
behaviour log-probs under q* (eq. 2). Under that exposure a masked rollout (a fault no action could
handle) is not reflected on: a replay meets the same fault.

A failure caused by an API change (``change_caused``: a renamed parameter or a moved tool that the
policy was shown and did not adapt to) is repaired where the change was first met instead
(:func:`change_point`): q is the conversation before that answer, the failed action is the call that met
the change, and the critique names the change and the call to make. The retry is stepped right after
that call's error (the replay keeps the call and the tool's error), so tau* is the request, the call
that met the change, the tool's error naming the new name, then the adapted call: trained on the
original prompt, it teaches reading the error. Without this the retry would follow the policy's own
repetitions of the old call, which a small policy copies.

A retry is an answer like any other: when it meets a fault the policy was shown and may act on (a rate
limit, or an API change that the failed attempt never reached, so the critique could not name it), the
tool's answer goes back to the policy and the episode goes on until it ends (:func:`_go_on`). The answer
after the fault is repaired where the fault was met, as a change-caused failure is: it is sampled under
q*' = [the conversation before the answer that met the fault, that answer, the critic's analysis of it
(the fault's fix; or, where the call was wrong too, what is wrong and the call to make as the changed
tool takes it)], and placed after the tool's answer. tau* is then the retry, the tool's answer and the
later answers, each with the log-probs it was sampled with; the critic judges the episode's last answer."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Sequence

from reflrl import config as C
from reflrl import rollout as R
from reflrl.critic.base import CriticStats, CritiqueRequest
from reflrl.envs.parsing import format_calls
from reflrl.envs.rewards import normalize_value
from reflrl.envs.seeding import derive_seed
from reflrl.envs.types import ParseResult, ToolCall

from .accounting import COUNT_KEYS, RecoveryResult, triage
from .batcher import RoundBatcher
from .reflection import (Attempt, EnvFeedback, Generation, RepairRecord, augmented_messages, feedback_from_step,
                         last_user_index, reflect_and_retry, split_response, visible_fault)


def _last_action_start(t: R.Trajectory) -> int:
    """Index in ``t.response_ids`` where the last sampled answer starts (its final run of action tokens)."""
    i = len(t.loss_mask)
    while i > 0 and t.loss_mask[i - 1]:
        i -= 1
    return i


def _action_spans(t: R.Trajectory) -> list[tuple[int, int]]:
    """[start, end) in ``t.response_ids`` of each sampled answer (the runs of action tokens), in order."""
    spans: list[tuple[int, int]] = []
    i, n = 0, len(t.loss_mask)
    while i < n:
        if t.loss_mask[i]:
            j = i
            while j < n and t.loss_mask[j]:
                j += 1
            spans.append((i, j))
            i = j
        else:
            i += 1
    return spans


def change_point(t: R.Trajectory) -> int | None:
    """The step whose answer first met the API change behind ``t``'s failure, when the policy answered
    again after it (a later step exists): the repair point of a change-caused failure (module doc).
    None for any other rollout, or where its answers cannot be told apart in its tokens."""
    last = t.last
    if last is None or not last.info.get("change_caused") or len(t.steps) < 2:
        return None
    met = [int(ch["step"]) for ch in last.info.get("api_changes") or []
           if not ch.get("adapted") and isinstance(ch.get("step"), int)]
    if not met or min(met) >= len(t.steps) - 1 or len(_action_spans(t)) != len(t.steps):
        return None
    return min(met)


def _change_feedback(t: R.Trajectory, j: int) -> dict[str, Any]:
    """The env's verdict on step ``j``'s answer as the critic is to judge it: step j's info with the final
    attribution (the episode failed by the change) and the open faults of step j only."""
    info = dict(t.steps[j].info)
    opened = [f for f in t.last.info.get("open_faults") or [] if int(f.get("step", -1)) == j]
    info.update(fault_caused=bool(opened), change_caused=True, open_faults=opened, correct=False)
    return info


def _first_generation(t: R.Trajectory, j: int | None = None) -> Generation:
    """The failed answer reflection repairs: the rollout's last answer (its only one, single-turn), or
    the answer after step ``j`` (a change-caused failure: what the policy wrote after the change)."""
    if j is None:
        cut = _last_action_start(t)
        return Generation(t.texts[-1] if t.texts else "", list(t.response_ids[cut:]), list(t.old_logprobs[cut:]))
    a, b = _action_spans(t)[j + 1]
    return Generation(t.texts[j + 1], list(t.response_ids[a:b]), list(t.old_logprobs[a:b]))


def _answered(infos: Sequence[dict[str, Any]]) -> list[ToolCall]:
    """The calls of these steps that got an answer (not an env fault)."""
    out = []
    for info in infos:
        calls = info.get("calls") or []
        for res in info.get("tool_results") or []:
            i = res.get("call_index")
            if res.get("triage") != "env_fault" and isinstance(i, int) and i < len(calls):
                out.append(ToolCall.from_dict(calls[i]))
    return out


def _answered_before_last(t: R.Trajectory, upto: int | None = None) -> list[ToolCall]:
    """The calls that got an answer in the steps before the last one (they are already in the answer);
    ``upto``: before that step instead."""
    return _answered([st.info for st in (t.steps[:-1] if upto is None else t.steps[:upto])])


def _remaining_gold(t: R.Trajectory, upto: int | None = None) -> list[ToolCall] | None:
    """The gold calls the last answer (the answer at step ``upto``) still had to make (all of them for a
    single-step rollout)."""
    if not t.task.gold:
        return None
    gold = list(t.task.gold[0])
    for c in _answered_before_last(t, upto):
        key = (c.name, normalize_value(dict(c.arguments)))
        j = next((j for j, g in enumerate(gold) if (g.name, normalize_value(dict(g.arguments))) == key), None)
        if j is not None:
            gold.pop(j)
    return gold


def _keep_cut(t: R.Trajectory, keep: int) -> int:
    """Where in ``t.response_ids`` the answer of step ``keep`` starts: the tokens of the steps kept before
    a retry end there."""
    return _last_action_start(t) if keep == len(t.steps) - 1 else _action_spans(t)[keep][0]


def _prompt_ids(tokenizer: Any, prompt: list[Any]) -> list[int]:
    """A generation request's prompt as token ids: chat messages rendered, or token ids as they are."""
    return list(prompt) if prompt and isinstance(prompt[0], int) else R.render_prompt(tokenizer, prompt)


def _goes_on(reward: float, term: bool, trunc: bool, info: dict[str, Any]) -> bool:
    """An env step after which the episode goes on because the answer met a fault the policy was shown
    and may still act on (``env.fault_exposure="policy"``): the turn has not ended and nothing masks it."""
    del reward
    return (not (term or trunc) and not info.get("turn_ended") and not info.get("masked")
            and any(f.get("policy_can_act") for f in info.get("shown_faults") or []))


async def _go_on(env: Any, tokenizer: Any, step: tuple, before: list[dict], text: str, gen: Generation,
                 context: list[int], sample_one: Callable, cap: int, max_total_tokens: int,
                 guide: Callable | None = None) -> EnvFeedback:
    """A retry's episode after its answer met a fault the policy was shown: the tool's answer goes back
    to the policy, which answers it, until the episode ends or the token budget does (module doc). Each
    answer follows the tokens so far (``context``: q, the kept steps, the retry, the tool's answers); with
    ``guide`` (``guide(conversation before the answer that met the fault, that answer's text, its step's
    info)`` -> q*' messages or None) it is sampled under the critique of the fault it answers, as a repair
    at the point of a change is, with its log-probs under q*'. The verdict is the episode's at its last
    answer; its calls are those answered on the way and the last answer's."""
    steps = [(float(step[1]), step[4])]
    cont: list[tuple[list[int], Generation]] = []
    while _goes_on(*step[1:]):
        got = R.observation_ids(tokenizer, before, step[4], text, gen.token_ids)
        if got is None:
            break
        obs, after = got
        room = min(cap, max_total_tokens - len(context) - len(obs))
        if room < 8:  # no room left for an answer (the rollouts' own budget check)
            break
        context = context + obs
        q_star = await guide(before, text, step[4]) if guide is not None else None
        gen = await sample_one(q_star if q_star else context, room)
        before = after
        context = context + list(gen.token_ids)
        text = gen.text
        step = await R.step_episode(env, text)
        cont.append((obs, gen))
        steps.append((float(step[1]), step[4]))
    fb = feedback_from_step(step[4], step[1])
    info = step[4]
    earlier = _answered([i for _r, i in steps[:-1]])
    if info.get("api_changes"):
        from reflrl.envs.tool_env import canonical_call
        earlier = [canonical_call(info["api_changes"], c) for c in earlier]
    if fb.parse is not None and earlier:
        fb.parse = ParseResult(ok=fb.parse.ok, calls=earlier + list(fb.parse.calls), error=fb.parse.error)
    fb.continuation, fb.steps = cont, steps
    fb.tool_calls = sum(int(i.get("billed_calls") or 0) for _r, i in steps)
    return fb


def repaired_trajectory(t: R.Trajectory, rec: RepairRecord, keep: int | None = None) -> R.Trajectory:
    """tau* as a rollout of t's group: q's prompt tokens, tau*'s ids with their behaviour log-probs
    under q* (``old_logprobs``), tau*'s env verdict; ``repair`` = the record, ``original`` = t.
    ``keep``: the steps of t kept before the retry (default all but the last). A retry whose episode
    went on (:func:`_go_on`) is followed by the tools' answers and the policy's later answers, with their
    own log-probs."""
    new = R.Trajectory(task=t.task, group=t.group, prompt_ids=list(t.prompt_ids), seed=t.seed)
    keep = len(t.steps) - 1 if keep is None else keep
    # a rollout of several steps keeps its earlier ones (module doc)
    cut = _keep_cut(t, keep)
    new.response_ids, new.loss_mask = list(t.response_ids[:cut]), list(t.loss_mask[:cut])
    new.old_logprobs = list(t.old_logprobs[:cut])
    new.append_action(rec.response_ids, rec.behaviour_logprobs)
    new.texts = list(t.texts[:keep]) + [rec.response_text]
    new.steps = list(t.steps[:keep])
    fb = rec.final_feedback
    if fb.continuation:
        R.record_step(new, *fb.steps[0])
        for (obs, g), (reward, info) in zip(fb.continuation, fb.steps[1:]):
            new.append_observation(obs)
            new.append_action(g.token_ids, g.logprobs)
            new.texts.append(g.text)
            R.record_step(new, reward, info)
    else:
        R.record_step(new, fb.reward, dict(fb.info) if fb.info else {"correct": fb.correct})
    new.turns = max(1, t.turns, len(new.texts))
    new.repair = rec
    new.original = t
    return new


async def arecover(trajs: list[R.Trajectory], *, cfg: C.Config, engine: Any, tokenizer: Any, envs: Sequence[Any],
                   critic: Any, messages_of: Callable[[Any], list[dict]], rollout_cfg: R.RolloutSpec,
                   seed: int = 0, max_policy_errors: int | None = None) -> RecoveryResult:
    """Triage ``trajs`` (one round's single-turn rollouts; env k served trajs[k]), repair the selected
    failures with batched reflection-guided retries, and replace each repaired rollout in place
    -- or, with ``reflection.group="add"``, append it to ``trajs`` with the same ``group`` --
    (module doc). ``max_policy_errors``: reflect on at most this many policy errors (the first ones;
    fault-caused failures are not capped by it); None = no such cap. Never raises for a critic's or a repair's failure: those are counted
    (``reflection_errors``) and the failed rollout is kept as it was."""
    t0 = time.perf_counter()
    f = cfg.reflection
    counts = {k: 0.0 for k in COUNT_KEYS}
    stats = CriticStats()
    counts["rollouts"] = len(trajs)
    failed: list[tuple[int, str]] = []
    for k, t in enumerate(trajs):
        counts["rollout_tool_calls"] += float(t.last.billed_calls if t.last else 0)
        tri = triage(t)
        if tri in ("recovered_by_retry", "recovered_by_policy"):
            counts[tri] += 1
        if tri in ("env_fault", "policy_error"):
            counts["failed"] += 1
            counts[f"failed_{tri}"] += 1
            failed.append((k, tri))
    shown = cfg.env.fault_exposure == "policy"
    # faults the policy sees: a masked rollout met a fault no action could handle; a replay meets it again
    chosen = [(k, c) for k, c in failed if (f.reflect_on == "failure" or c == "env_fault")
              and not (shown and trajs[k].masked)]
    chosen.sort(key=lambda kc: (kc[1] != "env_fault", kc[0]))  # env faults first: they carry no signal otherwise
    if max_policy_errors is not None:
        pe = [kc for kc in chosen if kc[1] == "policy_error"][:max_policy_errors]
        chosen = [kc for kc in chosen if kc[1] == "env_fault"] + pe
    if f.max_per_step:
        chosen = chosen[: f.max_per_step]
    counts["reflected"] = len(chosen)
    for _k, c in chosen:
        counts[f"reflected_{c}"] += 1
    gen_s = [0.0]
    rounds = [0]

    def sample(batch: list[tuple[list[dict], int]]) -> list[Generation]:
        """One attempt round: every waiting repair's q* (with its task's token cap) in ONE generate call."""
        tg = time.perf_counter()
        prompts = [_prompt_ids(tokenizer, m) for m, _cap in batch]
        out = R.generate_batch(engine, prompts, rollout_cfg, n=1, seed=seed + 7919 * (rounds[0] + 1),
                               max_new_tokens=[cap for _m, cap in batch])
        rounds[0] += 1
        gen_s[0] += time.perf_counter() - tg
        return [Generation(tokenizer.decode(ids, skip_special_tokens=True), ids, lps) for ids, lps, _fin in out]

    batcher = RoundBatcher(len(chosen), sample)
    # a continuous-batching engine: each retry is its own request, decoded as soon as its q* is ready
    pooled = R.pooled(engine, rollout_cfg)
    busy = {"generate_s": 0.0}
    gen_timer = R.OverlapTimer(busy, "generate_s")
    requests = [0]
    errors: list[str] = []

    # a change-caused failure is repaired right after the call that met the change (module doc)
    points = {k: change_point(trajs[k]) for k, _c in chosen if trajs[k].seed is not None}
    keeps = {k: j + 1 for k, j in points.items() if j is not None}

    async def repair(k: int) -> RepairRecord | None:
        t = trajs[k]
        env = envs[k]
        attempt = [0]

        j = points.get(k)
        keep = len(t.steps) - 1 if j is None else j + 1  # the steps replayed before the retry
        cap = R.answer_token_cap(t.task, tokenizer, rollout_cfg)  # the rollouts' cap for this task
        asked = [0]

        last: list[Generation | None] = [None]  # the last answer sampled under q* (its episode may go on)

        async def step_env(text: str) -> EnvFeedback:
            attempt[0] += 1
            # each attempt meets its own fault draws, derived from (episode seed, attempt): deterministic,
            # and a retry that meets a fault does not meet the same one at every attempt
            if t.seed is not None:
                # replay the earlier steps (the same faults), then the retry in the next one's place; the
                # replay is the failed episode's, so it has the same API changes (sticky per episode and
                # tool), the ones the critique was written for, even where the retry is the first step
                _o, info = await R.reset_episode(env, t.task, t.seed, fault_draw=(keep, attempt[0]))
                for earlier in t.texts[:keep]:
                    *_r, info = await R.step_episode(env, earlier)
            else:  # no episode seed recorded: a fresh episode of the same task
                _o, info = await R.reset_episode(env, t.task, derive_seed(seed + k, attempt[0], bits=31),
                                                 fault_draw=(0, attempt[0]))
            before = list(info.get("messages") or [])
            step = await R.step_episode(env, text)
            gen = last[0]
            if gen is None or gen.text != text or not _goes_on(*step[1:]):
                return feedback_from_step(step[4], step[1])
            # the retry met a fault the policy was shown: its episode goes on, each answer after a fault
            # sampled under that fault's critique (module doc)
            context = list(t.prompt_ids) + list(t.response_ids[:_keep_cut(t, keep)]) + list(gen.token_ids)
            return await _go_on(env, tokenizer, step, before, text, gen, context, sample_one, cap,
                                rollout_cfg.max_total_tokens, guide=guide)

        async def guide(conv: list[dict], text: str, info: dict[str, Any]) -> list[dict] | None:
            """q*' for the answer after a fault the retry met: the conversation before the answer that met
            it, that answer, and the critic's analysis of the step (the fault's fix when the faulted calls
            were right; else what is wrong, with the call to make as the changed tool takes it)."""
            fb = feedback_from_step(info, 0.0)
            shown = [x for x in info.get("shown_faults") or [] if x.get("policy_can_act")]
            if not shown or fb.parse is None:
                return None
            faulted = [ToolCall(x.get("name") or "", dict(x.get("arguments") or {})) for x in shown]
            if info.get("api_changes"):
                from reflrl.envs.tool_env import canonical_call
                faulted = [canonical_call(info["api_changes"], c) for c in faulted]
            want = {(g.name, repr(normalize_value(dict(g.arguments)))) for g in gold or []}
            right = all((c.name, repr(normalize_value(dict(c.arguments)))) in want for c in faulted)
            fault = visible_fault(shown[0], tuple(visible_fault(x) for x in shown[1:])) if right else None
            req = CritiqueRequest(query=query, tools=list(t.task.tools), response=text, parse=fb.parse,
                                  gold=gold, env_fault=fault, api_changes=list(info.get("api_changes") or []) or None)
            c = await critic.acritique(req)
            stats.record(c)
            if c.positive or c.reflection is None:
                return None
            thought, action = split_response(text)
            if fault is not None:
                try:
                    action = format_calls([ToolCall(x.tool, dict(x.arguments or {})) for x in (fault, *fault.also)],
                                          rollout_cfg.fmt)
                except ValueError:
                    pass
            return augmented_messages(conv, [Attempt(thought, action, c.reflection)], mode=f.mode)

        async def sample_one(prompt: list[dict] | list[int], cap_: int) -> Generation:
            """One answer: under q* (messages) or, in a retry's episode that went on, after its tokens."""
            if not pooled:
                return await batcher.generate((prompt, cap_), key=k)  # a batch in rollout order, whatever the timing
            requests[0] += 1
            asked[0] += 1
            with gen_timer:
                (ids, lps, _fin), = await R.agenerate_batch(
                    engine, [_prompt_ids(tokenizer, prompt)], rollout_cfg, max_new_tokens=cap_,
                    seed=derive_seed(seed, 3, k, asked[0]), held=True)
            return Generation(tokenizer.decode(ids, skip_special_tokens=True), ids, lps)

        try:
            if j is None:
                fb0 = feedback_from_step(t.last.info if t.last else {}, t.reward)
                gold = _remaining_gold(t)
                q = messages_of(t.task) if len(t.steps) < 2 else list(t.steps[-2].info.get("messages") or [])
            else:  # judged, and retried, as the answer that met the change
                fb0 = feedback_from_step(_change_feedback(t, j), t.reward)
                gold = _remaining_gold(t, j)
                q = messages_of(t.task) if j == 0 else list(t.steps[j - 1].info.get("messages") or [])
            q = q or messages_of(t.task)
            query = str(q[last_user_index(q)].get("content") or t.task.query)

            async def generate(messages: list[dict]) -> Generation:
                last[0] = await sample_one(messages, cap)
                return last[0]

            return await reflect_and_retry(generate, critic, step_env, t.task, _first_generation(t, j),
                                           f.max_attempts, first_feedback=fb0, messages=q,
                                           gold=gold, mode=f.mode, stats=stats, fmt=rollout_cfg.fmt)
        except Exception as e:  # noqa: BLE001 - a broken critic/repair must not stop training
            errors.append(f"{type(e).__name__}: {e}")
            return None
        finally:
            batcher.done()
            if pooled:
                hold.release()  # the lockstep hold it had between its requests (reflrl.rollout.holding)

    with R.holding(engine, len(chosen) if pooled else 0) as hold:
        recs = await asyncio.gather(*(repair(k) for k, _ in chosen)) if chosen else []
    records: list[RepairRecord] = []
    added: list[R.Trajectory] = []
    for (k, cause), rec in zip(chosen, recs):
        if rec is None:
            counts["reflection_errors"] += 1
            counts["unrecovered"] += 1
            counts["discarded"] += cause == "env_fault"
            continue
        records.append(rec)
        counts["retries"] += rec.retries
        counts["reflection_tool_calls"] += rec.tool_calls
        if rec.repaired and not (rec.final_feedback.info or {}).get("masked"):
            new = repaired_trajectory(trajs[k], rec, keep=keeps.get(k))
            if f.group == "add" and not trajs[k].masked:
                new.added = True  # beside the failure, which keeps its (negative) advantage
                added.append(new)
            else:  # a masked failure has no signal to keep: the repair always takes its place
                trajs[k] = new
            counts["recovered_by_reflection"] += 1
            counts[f"recovered_{cause}"] += 1
        else:
            counts["unrecovered"] += 1
            counts["discarded"] += cause == "env_fault"
    # failures not reflected on: env faults stay masked (no learning signal)
    picked = {k for k, _ in chosen}
    for k, cause in failed:
        if k not in picked:
            counts["unrecovered"] += 1
            counts["discarded"] += cause == "env_fault"
    counts["generate_calls"] = requests[0] if pooled else batcher.calls
    trajs.extend(added)
    return RecoveryResult(records, counts, stats, time.perf_counter() - t0, busy["generate_s"] if pooled else gen_s[0],
                          errors)
