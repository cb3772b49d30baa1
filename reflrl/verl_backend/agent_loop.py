"""``reflrl_tool_agent``: a verl agent loop running our tool env (with faults) and Tool-ReRL's reflection.

One dataset row = one episode (Tool-ReRL, sec. 3.2-3.3, Definition 1):

1. q = the env's chat messages for the task (system prompt with the tools + the user request);
   its tokens come from verl's own Continuous Token builder (``ct_build_initial_tokens``).
2. The policy samples tau under q through verl's LLM server client (``server_manager.generate``,
   vLLM/SGLang in a real run); the env executes the tool calls (injected faults, client retries).
3. If the critic judges the response negative, :func:`reflrl.recovery.reflection.reflect_and_retry` builds the
   augmented query q* = [q, t, a, rfl] and samples retries under q* until one is positive or
   ``max_attempts`` is reached; each retry runs in a fresh episode of the same task and seed.
4. The output is what verl trains on (eq. 2): ``prompt_ids`` = tokens of the ORIGINAL prompt q,
   ``response_ids`` = tau* (the repaired response), ``response_logprobs`` = log pi(tau* | q*) at
   sampling time (Assumption 1; the rollout log-probs verl's rollout correction compares with the
   actor's log pi(tau* | q)), ``response_mask`` = 1 on the sampled tokens, ``reward_score`` = tau*'s
   reward. When nothing was repaired (first response positive, or no retry was judged positive) the
   output is the original response tau under q with its reward, and its rollout log-probs are the
   ordinary-row marker of :mod:`reflrl.verl_backend.losses` (``mark_unrepaired``; otherwise its
   sampling log-probs). An episode whose env fault was not recovered gets ``response_mask`` all 0
   (left out of the loss, never penalised; sec. 3.2), like the CPU trainer's ``masked`` rollouts.

Single-step tasks (``kind`` "single" / "parallel", the Tool-ReRL training setting: ToolACE, one
assistant message with the calls) get the reflection loop above; there are no tool tokens inside
such a response. Multi-turn tasks (``kind`` "multi_turn", the efficiency paper's multi-turn setting)
run as one token stream without reflection: assistant tokens (mask 1, their sampling log-probs) and
the tool results / next user turns between them, tokenized by verl's Continuous Token builder as the
delta of the chat-template rendering (mask 0) -- so tool tokens get no loss -- until the env
terminates or ``response_length`` is reached (VerlTool, arXiv:2509.01055, sec. 3.3). The
rollout log-probs of such an (ordinary) episode are the ordinary-row marker unless
``mark_unrepaired`` is false.

Per-episode settings come from the row's ``extra_info`` (written by
:func:`reflrl.verl_backend.data.rows_from_tasks`: ``{"task": <task JSON>, "faults": "rate_limit=0.1", ...}``)
over defaults from the top-level ``reflrl`` section of the verl config (:class:`EpisodeSettings`).
``extra_fields`` of the output carry ``reflrl_repaired``, ``reflrl_masked``, ``reflrl_stop_reason``,
``reflrl_retries``, ``reflrl_cause`` and ``reflrl_correct`` (verl keeps them in the batch's
non-tensor fields).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

from reflrl.envs.types import Task
from reflrl.recovery.reflection import EnvFeedback, Generation, feedback_from_step, reflect_and_retry

from .episode import EpisodeSettings, episode_seeds, fit_qstar, task_from_dict
from .losses import UNREPAIRED_LOGPROB

log = logging.getLogger(__name__)

AGENT_NAME = "reflrl_tool_agent"
_MAX_GROUPS = 65536


class RolloutCounter:
    """The rollout index of each episode inside its group: verl repeats a prompt's row ``n`` times with
    the same ``uid`` and starts its agent loops in row order, so the k-th episode seen with a uid is
    rollout k. Bounded: the oldest uids are forgotten after ``max_groups``."""

    def __init__(self, max_groups: int = _MAX_GROUPS):
        self.seen: OrderedDict[str, int] = OrderedDict()
        self.max_groups = max_groups

    def claim(self, uid: Any) -> int:
        """The next rollout index of ``uid`` (0 for an episode without a uid)."""
        if uid is None:
            return 0
        key = str(uid)
        k = self.seen.get(key, 0)
        self.seen[key] = k + 1
        self.seen.move_to_end(key)
        while len(self.seen) > self.max_groups:
            self.seen.popitem(last=False)
        return k


#: one per process (verl runs the agent loops of a worker in one event loop)
ROLLOUTS = RolloutCounter()


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if obj is None:
        return default
    if hasattr(obj, "get"):
        return obj.get(key, default)
    return getattr(obj, key, default)


@register(AGENT_NAME)
class ReflrlToolAgentLoop(AgentLoopBase):
    """verl ``AgentLoopBase`` running one reflrl tool episode with reflection (module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("tools", None)  # verl's own tool list: our env brings its tools
        super().__init__(*args, **kwargs)
        self.response_length = int(self.rollout_config.response_length)
        self.defaults = _get(self.config, "reflrl", None)

    def _make_env(self, task: Task, s: EpisodeSettings, seeds: dict[str, Any]) -> Any:
        """The env of one episode, seeded by :func:`reflrl.verl_backend.episode.episode_seeds`."""
        from reflrl.envs.client import RetryPolicy
        from reflrl.envs.tool_env import ToolCallEnv, ToolCallMultiTurnEnv

        retry = RetryPolicy(max_attempts=int(s.retry_max_attempts), budget_s=float(s.retry_budget_s))
        cls = ToolCallMultiTurnEnv if task.kind == "multi_turn" else ToolCallEnv
        extra = {} if s.max_steps is None else {"max_steps": int(s.max_steps)}
        return cls(dataset=[task], faults=s.faults or None, fault_seed=seeds["fault_seed"],
                   seed=seeds["seed"], reward=s.reward, parser=s.parser, prompt_style=s.prompt_style,
                   think=bool(s.think), retry=retry, episode_prefix=seeds["prefix"], **extra)

    async def _n_tokens(self, messages: list[dict[str, Any]]) -> int:
        """Tokens of ``messages`` as verl's Continuous Token builder renders them, before verl's
        ``ct_build_initial_tokens`` left-truncates them to ``rollout.prompt_length``."""
        builder = self.continuous_token_builder
        return len(await self.loop.run_in_executor(None, lambda: builder.build_initial_tokens(messages)))

    def _critic(self, s: EpisodeSettings) -> Any:
        from reflrl.recovery.critics import get_critic

        if s.critic == "llm":
            return get_critic("llm", base_url=s.critic_base_url, model=s.critic_model, timeout=float(s.critic_timeout_s))
        return get_critic("rule", reveal=s.reveal, parser=s.parser)

    async def _sample(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> Generation:
        out = await self.server_manager.generate(request_id=uuid4().hex, prompt_ids=prompt_ids,
                                                 sampling_params=sampling_params)
        ids = [int(t) for t in out.token_ids][: self.response_length]
        lps = list(out.log_probs or [])[: len(ids)]
        if len(lps) != len(ids):
            raise ValueError(
                f"the LLM server returned {len(out.log_probs or [])} log-probs for {len(out.token_ids)} tokens; "
                "Tool-ReRL needs the behaviour log-probs: set actor_rollout_ref.rollout.calculate_log_probs=true")
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Generation(text=text, token_ids=ids, logprobs=[float(x) for x in lps])

    async def _run_multi_turn(self, task: Task, s: EpisodeSettings, sampling_params: dict[str, Any],
                              seeds: dict[str, Any]) -> AgentLoopOutput:
        """A multi-turn episode as one token stream (module doc); no reflection. It ends when the env
        ends it, or after ``max_turns`` assistant turns, or at ``max_total_tokens`` prompt + response
        tokens, or at the response length."""
        env = self._make_env(task, s, seeds)
        try:
            _, info = await env.areset(seed=seeds["seed"], options={"task": task})
            messages = list(info["messages"])
            tokens = await self.ct_build_initial_tokens(messages)
            n_prompt = len(tokens)
            mask: list[int] = []
            lps: list[float] = []
            reward, step_info, turns = 0.0, {}, 0
            request_id = uuid4().hex  # sticky session: prefix caching across the turns
            while True:
                out = await self.server_manager.generate(request_id=request_id, prompt_ids=tokens,
                                                         sampling_params=sampling_params)
                ids = [int(t) for t in out.token_ids]
                if len(out.log_probs or []) != len(ids):
                    raise ValueError("the LLM server returned no log-probs; set "
                                     "actor_rollout_ref.rollout.calculate_log_probs=true")
                merged, mask, lps = await self.ct_merge_assistant_token(
                    tokens, ids, mask, lps, assistant_logprobs=[float(x) for x in out.log_probs])
                tokens = merged.token_ids
                turns += 1
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                _, reward, terminated, truncated, step_info = await env.astep(text)
                if terminated or truncated or len(mask) >= self.response_length:
                    break
                if (s.max_turns is not None and turns >= int(s.max_turns)) or (
                        s.max_total_tokens is not None and len(tokens) >= int(s.max_total_tokens)):
                    break
                conv = step_info["messages"]
                before = messages + [conv[len(messages)]]  # the conversation the tokens hold (+ the action)
                merged, new_mask, new_lps = await self.ct_merge_context_msg(before, conv, tokens, mask, lps)
                if len(new_mask) >= self.response_length:
                    break
                tokens, mask, lps, messages = merged.token_ids, new_mask, list(new_lps or []), list(conv)
        finally:
            try:
                await env.aclose()
            finally:
                env.close()
        masked = bool(step_info.get("masked"))
        resp = list(tokens[n_prompt:])[: self.response_length]
        mask = [0 if masked else int(m) for m in mask][: len(resp)]
        lps = list(lps)[: len(resp)]
        if s.mark_unrepaired:
            lps = [UNREPAIRED_LOGPROB if m else 0.0 for m in mask]
        output = AgentLoopOutput(prompt_ids=list(tokens[:n_prompt]), response_ids=resp, response_mask=mask,
                                 response_logprobs=lps, reward_score=float(reward), num_turns=2 * turns + 1,
                                 metrics=AgentLoopMetrics(), extra_fields={})
        output.extra_fields.update({"reflrl_repaired": False, "reflrl_masked": masked, "reflrl_stop_reason": "multi_turn",
                                    "reflrl_retries": 0, "reflrl_cause": "none", "reflrl_correct": bool(step_info.get("correct")),
                                    "turn_scores": list(step_info.get("turn_rewards") or []), "tool_rewards": []})
        return output

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """One episode -> AgentLoopOutput (module doc). ``kwargs`` are the dataset row's fields."""
        extra = dict(kwargs.get("extra_info") or {})
        if "task" not in extra:
            raise ValueError("reflrl_tool_agent: the dataset row's extra_info has no 'task' "
                             "(write rows with reflrl.verl_backend.data.rows_from_tasks)")
        task = task_from_dict(extra["task"])
        s = EpisodeSettings.from_sources(self.defaults, extra)
        # before the first await: verl starts the agent loops in row order, so the claim order is the row order
        index = extra.get("index", kwargs.get("index", 0))
        seeds = episode_seeds(s, int(index or 0), ROLLOUTS.claim(kwargs.get("uid")))
        if task.kind == "multi_turn":
            return await self._run_multi_turn(task, s, sampling_params, seeds)
        critic = self._critic(s)
        env = self._make_env(task, s, seeds)
        metrics: dict[str, Any] = {}
        limit = int(self.rollout_config.prompt_length)
        try:
            _, info = await env.areset(seed=seeds["seed"], options={"task": task})
            messages = info["messages"]
            prompt_ids = await self.ct_build_initial_tokens(messages)

            async def count(msgs: list[dict[str, Any]]) -> int:
                return await self._n_tokens(msgs)

            async def generate(msgs: list[dict[str, Any]]) -> Generation:
                # q* within the prompt limit: the failed answers and analyses shrink, never q's system
                # prompt and tools (verl would left-truncate it: rollout.prompt_length)
                msgs = await fit_qstar(msgs, len(messages), count, limit)
                return await self._sample(await self.ct_build_initial_tokens(msgs), sampling_params)

            async def step_env(text: str) -> EnvFeedback:
                await env.areset(seed=seeds["seed"], options={"task": task})  # a fresh episode per attempt
                _, reward, _, _, step_info = await env.astep(text)
                return feedback_from_step(step_info, reward)

            first = await self._sample(prompt_ids, sampling_params)
            _, r0, _, _, i0 = await env.astep(first.text)
            fb0 = feedback_from_step(i0, r0)
            attempts = int(s.max_attempts)
            if s.reflect_on == "env_fault" and fb0.env_fault is None:
                attempts = 0
            rec = await reflect_and_retry(generate, critic, step_env, task, first, attempts,
                                          first_feedback=fb0, messages=messages, mode=s.mode)
        finally:
            try:
                await env.aclose()
            finally:
                env.close()  # stops the env's private loop thread (idempotent after aclose)
        if rec.repaired:  # tau* sampled under q*, judged positive: trained on q with eq. 2's weight
            final, ids, lps = rec.final_feedback, list(rec.response_ids), list(rec.behaviour_logprobs)
        else:  # nothing repaired: the original response tau under q (on-policy), with its own verdict
            final, ids, lps = rec.first_feedback, list(first.token_ids), list(first.logprobs)
            if s.mark_unrepaired:
                lps = [UNREPAIRED_LOGPROB] * len(ids)
        masked = final.env_fault is not None or bool(final.info.get("masked"))
        mask = [0 if masked else 1] * len(ids)
        out = AgentLoopOutput(
            prompt_ids=list(prompt_ids),
            response_ids=ids,
            response_mask=mask,
            response_logprobs=lps,
            reward_score=float(final.reward),
            num_turns=2 + 2 * rec.retries,
            metrics=AgentLoopMetrics(**metrics),
            extra_fields={},
        )
        out.extra_fields.update({
            "reflrl_repaired": bool(rec.repaired),
            "reflrl_masked": bool(masked),
            "reflrl_stop_reason": rec.stop_reason,
            "reflrl_retries": int(rec.retries),
            "reflrl_cause": rec.cause,
            "reflrl_correct": bool(final.correct),
            "turn_scores": [],
            "tool_rewards": [],
        })
        return out
