"""Gymnasium environments for tool calling through misbehaving tools.

Two environments, registered by ``import reflrl.envs``:

* ``reflrl/ToolCall-v0`` (:class:`ToolCallEnv`): single turn. The action is one assistant message
  with one or more tool calls; the calls run against the tool server (concurrently when
  parallel), the reward compares them with the gold calls, and the episode terminates.
* ``reflrl/ToolCallMultiTurn-v0`` (:class:`ToolCallMultiTurnEnv`): assistant messages alternate
  with tool observations; a user turn ends when the assistant answers without calls, then the
  next user message of the task (BFCL multi-turn style) follows. The episode terminates after
  the last user turn, or is truncated at ``max_steps`` assistant messages.

Observations and actions are text (:class:`ChatText`). ``info["messages"]`` holds the chat
messages (role/content) to feed a tokenizer's chat template; the observation string is the same
conversation rendered as plain text.

Faults (``faults="rate_limit=0.1,..."``) are injected by the tool server and observed by the
client exactly as a real HTTP client sees them; the client's retry policy retries them. Env faults
are never turned into negative rewards (Tool-ReRL, sec. 1 and 3.2:
environment-caused failures are not the policy's errors): the reward depends only on the policy's
parsed calls against the gold calls; a fault that retries did not recover sets
``info["masked"] = True`` so the trainer drops the rollout from the loss.

Policy-visible faults (``fault_exposure="policy"``): the client's attempts per call default to 1
and a fault it does not absorb comes back to the policy as the tool's answer, in the form a real API
gives it (:func:`fault_observation`: status, reason, the server's message and error code, and the
Retry-After it sent)::

    {"name": "get_weather", "error": "HTTP 429 Too Many Requests: too many requests (rate_limited); Retry-After: 1", "kind": "rate_limit"}

and the episode goes on: the single-turn env then takes further assistant messages while the last
one met such a fault (up to ``max_steps``), so the policy can call again, call another tool, or stop
(a message without calls). Time: each assistant message after the first advances the env's virtual
clock by ``turn_seconds`` (the time a model takes to read the answer and write the next message), and
the server refuses a call made before an earlier 429's Retry-After has passed with 429 again, as a
real server does; so calling again on the next turn works when Retry-After <= ``turn_seconds``, and
otherwise after more turns. No wall time is spent (with a remote server and the system clock,
the server's own time decides). The client does not change its identity after a ban. What the episode
counts as the answer: the calls that got an answer, in every step (a repeat of a call that already
got its answer is not counted twice). Triage per fault kind (``reflrl.faults.kinds``,
``FaultKind.policy_can_act``): a fault the policy could have acted on (call again) and did not is the
policy's failure: the reward is that of the wrong answer it gave, and ``info["fault_caused"]`` says
the answer would have been right had the faulted calls been answered (``info["open_faults"]`` lists
them, for a critic); a fault no action could handle (an ip_ban, which lasts the episode, or a fault
met on the episode's last allowed message) masks the episode: never penalised.

Reproducibility: the episode's data seed, fault seed and episode id derive from (env seed,
episode counter); ``reset(seed=s)`` restarts the counter, so the same seed and fault plan replay
the same tasks, the same fault events and the same observations.

Sync and async: ``areset``/``astep`` are coroutines (a trainer runs many envs concurrently in one
event loop); ``reset``/``step`` run them on a private event loop in a daemon thread, so they also
work when called from inside a running loop (Jupyter, async tests). One env's tool client is
bound to the loop that first used it: drive an env either through the sync API or from one loop.

Nothing here imports torch (envs never import the trainer).
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import string
import threading
import weakref
from pathlib import Path
from typing import Any, Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from reflrl.faults.kinds import CHANGE_KINDS as _CHANGE_KINDS

from .types import ParseResult, Task, ToolCall

SINGLE_TURN_ID = "reflrl/ToolCall-v0"
FAULT_EXPOSURES = ("client", "policy")
MULTI_TURN_ID = "reflrl/ToolCallMultiTurn-v0"

# Characters ``ChatText.sample`` draws from: printable ASCII, whitespace and a few non-ASCII
# letters, symbols and emoji (``contains`` accepts any string; this only shapes random samples).
SAMPLE_CHARSET = "".join(dict.fromkeys(
    string.printable + "äöüßéèçñøåÆ€£¥°µ±×÷–—“”‘’…•→←✓✗中文日本語한국어Ωπλ😀🙂🚀"))


class ChatText(spaces.Text):
    """A text space for chat: any Python string of length in [min_length, max_length].

    ``gymnasium.spaces.Text`` membership requires every character to be in a finite charset, but
    a language model can emit any Unicode character and tool results carry any text. So
    ``contains`` accepts every string within the length bounds, and the charset only defines what
    ``sample()`` draws (``SAMPLE_CHARSET``: printable ASCII, whitespace, some non-ASCII letters,
    CJK and emoji).
    """

    def __init__(self, max_length: int, *, min_length: int = 0, seed: Any = None):
        super().__init__(max_length, min_length=min_length, charset=SAMPLE_CHARSET, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"ChatText({self.min_length}, {self.max_length})"


class _LoopThread:
    """A private asyncio loop running in a daemon thread; the sync API submits coroutines to it.

    Using a thread (rather than ``loop.run_until_complete`` in the caller's thread) makes
    ``env.step`` work even when the caller already runs an event loop.
    """

    def __init__(self, name: str):
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    def run(self, coro):
        """Run ``coro`` on the private loop and return its result (blocking the caller)."""
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def _main():
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                t = threading.Thread(target=_main, name=self._name, daemon=True)
                t.start()
                ready.wait()
                self._loop, self._thread = loop, t
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("reflrl env: the sync API was called from the env's own event loop; "
                               "use 'await env.unwrapped.areset()/astep()' there")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def stop(self) -> None:
        """Stop the loop and join the thread (idempotent)."""
        with self._lock:
            loop, t = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if t is not None:
            t.join(timeout=10)
        if not loop.is_running():
            loop.close()


# Public name: reflrl.integrations.trl runs the tool calls of a whole TRL environment pool on one.
LoopThread = _LoopThread


@dataclasses.dataclass
class _Episode:
    """The mutable state of the current episode."""

    task: Task
    episode_id: str
    data_seed: int
    fault_seed: int
    messages: list[dict[str, Any]]
    n_user_turns: int
    turn: int = 0                 # index of the current user turn
    step: int = 0                 # assistant messages so far (X-Reflrl-Step of the next one)
    turn_calls: list[ToolCall] = dataclasses.field(default_factory=list)
    turn_call_steps: list[int] = dataclasses.field(default_factory=list)  # the step of each turn_calls entry
    turn_format_ok: bool = True
    masked: bool = False          # an env fault was not recovered (sticky for the episode)
    # fault_exposure="policy": faults the policy was shown (dicts; "handled" once the call got an
    # answer in a later step) and the calls of this turn that got an answer
    shown_faults: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    answered: list[ToolCall] = dataclasses.field(default_factory=list)
    last_turn_calls: list[ToolCall] = dataclasses.field(default_factory=list)  # the last ended turn's
    last_turn_format_ok: bool = True
    billed_calls: int = 0
    redraw_from: int = 0          # reset option fault_draw: steps from here on use fault draw ``draw``
    draw: int = 0                 # 0: the seed's own draws
    turn_rewards: list[float] = dataclasses.field(default_factory=list)
    turn_correct: list[bool] = dataclasses.field(default_factory=list)
    turn_fault_caused: list[bool] = dataclasses.field(default_factory=list)  # per ended turn (policy-visible faults)
    # API changes met (param_renamed, tool_moved), in order: the server's record of each (one per tool)
    api_changes: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    turn_change_caused: list[bool] = dataclasses.field(default_factory=list)  # per ended turn (API changes only)
    done: bool = False
    end_turn_index: int | None = None  # aend_episode: the turn in progress when the caller ended it
    end_treatment: str = "none"        # aend_episode: "masked" when ending it masked the episode


REDRAW_STRIDE = 1_000_000  # step coordinate of fault draw d at step s: s + d x REDRAW_STRIDE (reset option fault_draw)
MAX_DRAW = 999             # the coordinate stays below the 10**9 the X-Reflrl-Step header allows


def _fault_draw(value: Any) -> tuple[int, int]:
    """The reset option ``fault_draw`` as (from_step, draw); (0, 0) when absent."""
    if value is None:
        return 0, 0
    try:
        from_step, draw = (int(x) for x in value)
    except (TypeError, ValueError):
        raise ValueError(f"options['fault_draw'] must be (from_step, draw), got {value!r}") from None
    if not (0 <= from_step < REDRAW_STRIDE and 0 <= draw <= MAX_DRAW):
        raise ValueError(f"options['fault_draw']={value!r}: from_step in [0, {REDRAW_STRIDE}), draw in [0, {MAX_DRAW}]")
    return from_step, draw


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integer parts (numpy SeedSequence; stable across platforms)."""
    return int(np.random.SeedSequence([int(p) & (2**63 - 1) for p in parts])
               .generate_state(1, np.uint64)[0] >> np.uint64(1))


class ToolCallEnv(gym.Env[str, str]):
    """Single-turn tool calling: one assistant message with one or more calls, then the reward.

    Args:
        dataset: a list of Task, ``"synthetic"`` (the seeded faker generator of
            ``reflrl.envs.datasets``), ``"bfcl"`` (bfcl-eval's multi-turn tasks, when available) or a
            path to a ToolACE / xLAM / Hammer style JSON(L) file.
        split: ``"train"`` | ``"val"`` | ``"test"`` (for ``"synthetic"``).
        kinds: task kinds kept (default single-turn env: ``("single", "parallel")``; multi-turn:
            all kinds).
        faults: a fault spec (``"rate_limit=0.1,timeout=0.05,latency=0.2:300ms"``) or a FaultPlan.
        fault_seed: seed of the fault stream; None = derived from the env seed. Fix it to keep the
            same faults while the tasks vary (or the reverse).
        seed: the env seed used by the first ``reset()`` without a seed (None = fresh entropy).
        reward: reward name in ``reflrl.envs.rewards`` (``"binary"``: exact match with format
            check, efficiency paper (arXiv:2606.00135) appendix E eq. 8; ``"fine"``: DSCL eqs. 1-6, range [-3, 4]).
        parser: ``"hermes"`` | ``"pythonic"`` | ``"react"`` | ``"auto"``.
        prompt_style: how tools are listed in the system prompt (``reflrl.envs.prompts``): ``"json"``
            (full schemas, Hermes/Qwen layout) or ``"compact"`` (one signature line per tool).
        think: ask for a ``<think>`` block before the calls (for the ``binary_think`` reward).
        max_tool_chars: tool observations are cut to this many characters (0 = no limit).
        max_steps: assistant messages per episode before truncation (multi-turn; None = 8 per user
            turn).
        max_calls_per_step: calls executed from one message; extra calls are not run and are
            reported in ``info["skipped_calls"]``.
        concurrent_calls: run the calls of one message concurrently (default: yes for single-turn,
            no for multi-turn, where stateful backends need BFCL's in-order execution).
        server_url: None = an in-process ASGI tool server (fast); a URL = a real server started
            with ``reflrl tools serve``.
        retry: a ``RetryPolicy`` or a dict of its fields (attempt budget, backoff, cap, jitter);
            None = the client's defaults (``fault_exposure="policy"``: one attempt per call, no
            identity change after a ban).
        fault_exposure: ``"client"`` (the client retries faults; one it gives up on masks the
            episode) or ``"policy"`` (a fault the client does not absorb comes back to the policy as
            the tool's answer and the episode goes on; module doc).
        turn_seconds: under ``fault_exposure="policy"``, virtual seconds each assistant message
            after the first costs on the env's clock (what lets a Retry-After pass).
        triage: True (the default) masks an episode that met a fault it could not act on (the
            client gave up; under ``"policy"``, a fault no action can handle or one met on the last
            message), so it is never penalised. False masks none: such a fault leaves the episode's
            answer wrong, as a plain RL trainer that scores tool errors as failures does (a baseline).
        timeout: the client's read timeout in seconds.
        clock: the clock of client waits and server stalls: ``"virtual"`` (a VirtualClock: latency,
            Retry-After and backoff waits cost no wall time, elapsed times stay exact and
            replayable), ``"system"`` (wall time) or a clock object; None = virtual in-process,
            system with ``server_url`` (a real server needs real time).
        client: a shared ``ToolClient`` (the env then neither creates nor closes one).
        app: a shared in-process ASGI app (ignored when ``server_url`` or ``client`` is given).
        server_seed: seed of the in-process server's catalogue.
        dataset_seed: seed of the synthetic dataset generator (fixed so splits stay stable).
        synthetic_sizes: (train, val, test) sizes of the synthetic splits.
        episode_prefix: prefix of server-side episode ids (``<prefix>-<fault seed hex>-<n>``); give
            envs sharing one server distinct prefixes. The episode id enters the fault decision
            (``reflrl.faults.decide``), so a replay needs the same seed, fault plan and prefix.
        max_action_chars / max_obs_chars: length bounds of the text spaces.
        render_mode: ``"ansi"`` (render returns the conversation) or ``"human"`` (prints it).

    Attributes: ``ledger`` (a ``reflrl.faults.Ledger``: every attempt the client observed and, with
    the env's own in-process server, every injected fault at once; with a shared app or a remote
    server the injected faults arrive when an episode closes, i.e. at the next reset or close),
    ``tasks``, ``episode_id``, ``episode_task``, ``fault_plan``.
    """

    metadata = {"render_modes": ["ansi", "human"], "render_fps": 1}
    multi_turn = False
    default_kinds: tuple[str, ...] | None = ("single", "parallel")

    def __init__(
        self,
        dataset: str | Path | Sequence[Task] = "synthetic",
        split: str = "train",
        *,
        kinds: Sequence[str] | None = None,
        faults: Any = None,
        fault_seed: int | None = None,
        seed: int | None = None,
        reward: str = "binary",
        parser: str = "hermes",
        prompt_style: str = "json",
        think: bool = False,
        max_tool_chars: int = 2000,
        max_steps: int | None = None,
        max_steps_per_turn: int = 8,
        max_calls_per_step: int = 16,
        concurrent_calls: bool | None = None,
        server_url: str | None = None,
        retry: Any = None,
        fault_exposure: str = "client",
        turn_seconds: float = 2.0,
        triage: bool = True,
        timeout: float | None = None,
        clock: Any = None,
        client: Any = None,
        app: Any = None,
        server_seed: int = 0,
        dataset_seed: int = 0,
        synthetic_sizes: tuple[int, int, int] = (512, 64, 64),
        episode_prefix: str = "ep",
        max_action_chars: int = 16_384,
        max_obs_chars: int = 1 << 24,
        render_mode: str | None = None,
    ):
        from reflrl.faults.spec import FaultPlan

        super().__init__()
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode {render_mode!r} not in {self.metadata['render_modes']}")
        self.render_mode = render_mode
        self.fault_plan = FaultPlan.coerce(faults)  # FaultSpecError names a bad entry
        self.tasks: list[Task] = _resolve_dataset(
            dataset, split, kinds if kinds is not None else self.default_kinds, dataset_seed,
            synthetic_sizes)
        if not self.tasks:
            raise ValueError(f"dataset {dataset!r} (split {split!r}) has no task of kinds "
                             f"{kinds if kinds is not None else self.default_kinds}")
        self.split = split
        self.reward_name = reward
        self.parser_name = parser
        self.prompt_style = prompt_style
        self.think = bool(think)
        self.max_tool_chars = int(max_tool_chars)
        self._reward_fn = _get_reward(reward)
        self._parse = _get_parser(parser)
        _check_prompt_style(prompt_style)
        if fault_exposure not in FAULT_EXPOSURES:
            raise ValueError(f"fault_exposure={fault_exposure!r}: expected one of {', '.join(FAULT_EXPOSURES)}")
        if not float(turn_seconds) >= 0:
            raise ValueError(f"turn_seconds={turn_seconds!r}: must be >= 0")
        self.fault_exposure = fault_exposure
        self.turn_seconds = float(turn_seconds)
        self.triage = bool(triage)
        self.fault_seed = fault_seed
        self.max_steps = max_steps
        self.max_steps_per_turn = int(max_steps_per_turn)
        self.max_calls_per_step = int(max_calls_per_step)
        self.concurrent_calls = (not self.multi_turn) if concurrent_calls is None else bool(concurrent_calls)
        self.server_url = server_url
        self.server_seed = server_seed
        self.episode_prefix = episode_prefix
        self._retry = retry
        self._timeout = timeout
        self._clock = clock
        self._app = app
        self._owns_app = False
        self._opened_ids: set[str] = set()
        self._client = client
        self._owns_client = client is None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._runner = _LoopThread(f"reflrl-env-{id(self):x}")
        # an env dropped without close() must not leave its loop thread running
        weakref.finalize(self, self._runner.stop)
        self.ledger = _new_ledger() if client is None else getattr(client, "ledger", None)

        self.observation_space = ChatText(max_obs_chars)
        self.action_space = ChatText(max_action_chars)

        # seeding: base seed and episode counter (reset(seed=s) sets base=s, counter=0)
        self._init_seed = seed
        self._base_seed: int | None = None
        self._counter = -1
        self._episode: _Episode | None = None
        self._last_episode_id: str | None = None
        self._last_task: Task | None = None
        self._closed = False

    # ------------------------------------------------------------------ properties
    @property
    def episode(self) -> _Episode | None:
        """The current episode's state (None before the first reset)."""
        return self._episode

    @property
    def policy_sees_faults(self) -> bool:
        """``fault_exposure == "policy"``: faults the client does not absorb reach the policy."""
        return self.fault_exposure == "policy"

    @property
    def episode_id(self) -> str | None:
        """The server-side id of the current (or last) episode."""
        return self._last_episode_id

    @property
    def episode_task(self) -> Task | None:
        """The task of the current (or last) episode."""
        return self._last_task

    # ------------------------------------------------------------------ client
    async def _ensure_client(self):
        """The ToolClient, created on first use in the running loop (and bound to it)."""
        loop = asyncio.get_running_loop()
        if self._closed:
            raise RuntimeError("reflrl env is closed")
        if self._client is None:
            self._client = _make_client(self)
            self._client_loop = loop
        elif self._owns_client and self._client_loop is not loop:
            raise RuntimeError(
                "reflrl env: this env's tool client is bound to another event loop. Drive one env "
                "either through reset()/step() or through areset()/astep() from a single loop.")
        return self._client

    # ------------------------------------------------------------------ async API
    async def areset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Start an episode; returns (observation text, info).

        options: {"task": Task} or {"task_index": i}; otherwise the task is drawn from np_random.
            "fault_draw": (from_step, draw) with draw >= 1 gives the steps from ``from_step`` on fresh
            fault draws, numbered ``draw``, while the steps before it meet the faults a reset with the
            same seed gives: a replay of an episode's first steps whose later steps are a new try (a
            reflection retry's attempt ``draw``). The fault plan draws per (fault seed, episode, step
            coordinate, call, attempt); a redrawn step's coordinate is ``step + draw x REDRAW_STRIDE``.
        info: "messages" (chat messages), "task", "tools" (schemas offered), "episode_seed",
        "fault_seed", "turn", "n_user_turns".
        """
        if seed is None and self._base_seed is None:
            # first reset without a seed: the constructor's seed, else fresh entropy
            seed = (int(self._init_seed) if self._init_seed is not None
                    else int(np.random.SeedSequence().entropy) & (2**63 - 1))
        super().reset(seed=seed)
        if seed is not None:
            self._base_seed, self._counter = int(seed), 0
        else:
            self._counter += 1
        options = options or {}
        redraw = _fault_draw(options.get("fault_draw"))
        if "task" in options and options["task"] is not None:
            task = options["task"]
            if not isinstance(task, Task):
                raise TypeError(f"options['task'] must be a Task, got {type(task).__name__}")
        elif "task_index" in options and options["task_index"] is not None:
            i = int(options["task_index"])
            if not 0 <= i < len(self.tasks):
                raise IndexError(f"task_index {i} out of range [0, {len(self.tasks)})")
            task = self.tasks[i]
        else:
            task = self.tasks[int(self.np_random.integers(len(self.tasks)))]

        client = await self._ensure_client()
        await self._close_episode()
        data_seed = derive_seed(self._base_seed, self._counter, 0)
        fault_seed = (derive_seed(self.fault_seed, self._counter, 1) if self.fault_seed is not None
                      else derive_seed(self._base_seed, self._counter, 1))
        episode_id = f"{self.episode_prefix}-{fault_seed:x}-{self._counter}"
        if episode_id in self._opened_ids:
            # a replay of an earlier episode (same seed): it supersedes the earlier records, in
            # the env's ledger and in an in-process server's own ledger (a shared app)
            server_ledger = getattr(getattr(self._app, "server", None), "ledger", None)
            for ledger in {id(x): x for x in (self.ledger, server_ledger) if x is not None}.values():
                ledger.forget_episode(episode_id)
        self._opened_ids.add(episode_id)
        try:
            await client.open_episode(
                episode_id, seed=data_seed, faults=self.fault_plan, fault_seed=fault_seed,
                tools=[t["name"] for t in task.tools] or None, initial_config=task.initial_config,
                enforce_retry_after=self.policy_sees_faults)
        except Exception as e:
            if "HTTP 409" in str(e):
                raise RuntimeError(
                    f"episode {episode_id!r} is already open on the tool server: another env with "
                    "the same seed and episode_prefix shares it; give each env its own seed or "
                    "episode_prefix") from e
            raise
        messages = _build_messages(task, self.prompt_style, self.parser_name, self.think)
        self._last_episode_id, self._last_task = episode_id, task
        self._episode = _Episode(task=task, episode_id=episode_id, data_seed=data_seed,
                                 fault_seed=fault_seed, messages=messages,
                                 n_user_turns=1 + (len(task.turns) if self.multi_turn else 0),
                                 redraw_from=redraw[0], draw=redraw[1])
        info = {
            "messages": copy.deepcopy(messages),
            "task": task,
            "tools": copy.deepcopy(task.tools),
            "episode_seed": data_seed,
            "fault_seed": fault_seed,
            "turn": 0,
            "n_user_turns": self._episode.n_user_turns,
        }
        return self._observation(), info

    async def astep(self, action: str):
        """One assistant message -> (observation, reward, terminated, truncated, info).

        info:
          task_id; calls (parsed, as dicts); parse_ok; parse_error;
          tool_results: per call {call_index, name, ok, result, error, triage, fault_kind,
              attempts, elapsed_s (on the env's clock)};
          fault_events: per env fault the client observed {call_index, tool, attempt, kind,
              status, detail, triage, retried, recovered};
          triage: per call "ok" | "env_fault" (retries gave up) | "policy_error" | "tool_bug"
              (the tool crashed on valid arguments: neither the policy's error nor a fault);
          env_fault_treatment: "none" | "retried-recovered" | "to-policy" (a fault came back to
              the policy, fault_exposure="policy") | "masked" | "unexcused" (triage=False: the
              client gave up on a fault and the episode is not masked);
          masked: an env fault was not recovered, or a tool crashed, in this episode (sticky):
              the trainer drops the rollout from the loss; the reward is still what the calls
              deserve against the gold;
          reward_parts; correct (exact match with format; multi-turn: every turn, at the end);
          billed_calls (attempts this step); episode_billed_calls; skipped_calls; messages (the
          whole conversation); turn (user turn of this step); turn_ended; turn_rewards.
          With fault_exposure="policy" also: fault_exposure; shown_faults (this step's faults the
          policy was shown: step, call_index, name, arguments, kind, status, retry_after_s, code,
          attempts, observation, policy_can_act, handled); open_faults (the episode's shown faults
          whose call has not got an answer since); fault_caused (at the end: the answer is wrong
          but would have been right had the open faults' calls been answered, and the episode is
          not masked: the policy could have called again and did not).
          API changes (param_renamed, tool_moved; fault_exposure="policy"): api_changes (the
          episode's changes met so far, in order: {kind, tool, param (old name; None for a move), new
          (the new parameter name or the successor tool), step (where first met), adapted (a later
          call using the new name got an answer)}); change_caused (at the end: the answer is wrong,
          not masked, and would have been right had the calls at the change been adapted; then
          fault_caused is true too); change_recoverable (at the end: the episode met a change, is not
          masked, and ended right or change_caused). An adapted call counts as the call it stands for
          (the old name) in scoring. A shown fault of a change also carries param and new.
        """
        ep = self._episode
        if ep is None:
            raise RuntimeError("call reset() before step()")
        if ep.done:
            raise RuntimeError("the episode is over: call reset() before step()")
        if not isinstance(action, str):
            raise TypeError(f"action must be a str (the assistant message), got {type(action).__name__}")
        client = await self._ensure_client()

        parse = _safe_parse(self._parse, action)
        step_index = ep.step
        ep.step += 1
        policy = self.policy_sees_faults
        if policy and step_index > 0:  # the model read the answers and wrote this message
            advance = getattr(client.clock, "advance", None)
            if advance is not None:
                advance(self.turn_seconds)
        ep.messages.append(_assistant_message(action))
        calls = list(parse.calls) if parse.ok else []
        run, skipped = calls[: self.max_calls_per_step], calls[self.max_calls_per_step:]

        coord = step_index + (ep.draw * REDRAW_STRIDE if ep.draw and step_index >= ep.redraw_from else 0)

        async def one(i: int, c: ToolCall):
            return await client.call(ep.episode_id, step=coord, call_index=i,
                                     name=c.name, arguments=dict(c.arguments))

        if self.concurrent_calls:
            outcomes = list(await asyncio.gather(*(one(i, c) for i, c in enumerate(run))))
        else:
            outcomes = [await one(i, c) for i, c in enumerate(run)]
        for c, o in zip(run, outcomes):
            ep.messages.append(_tool_message(c, o, self.max_tool_chars, shown=policy))
        for c in skipped:
            ep.messages.append(_tool_message(c, None, self.max_tool_chars, note=(
                f"not executed: more than {self.max_calls_per_step} calls in one message")))

        triage = [str(o.triage) for o in outcomes]
        fault_events = [ev for i, (c, o) in enumerate(zip(run, outcomes))
                        for ev in _fault_event_dicts(i, c.name, o)]
        billed = sum(int(getattr(o, "attempts", 1)) for o in outcomes)
        ep.billed_calls += billed
        limit = (self.max_steps if self.max_steps is not None
                 else self.max_steps_per_turn * ep.n_user_turns)
        shown_now: list[dict[str, Any]] = []
        if policy:
            answered = self._note_shown(ep, step_index, run, outcomes, shown_now)
            # a fault no action can handle, or one met with no message left to act on: masked
            # (an API change met at an earlier message is not: the policy had a message to adapt in)
            unhandleable = [f for f in shown_now if not f["policy_can_act"]
                            or (ep.step >= limit and not _change_met_before(ep, f))]
            gave_up = "tool_bug" in triage or bool(unhandleable)
        else:
            answered = (calls if self.triage
                        else [c for c, o in zip(run, outcomes) if o.triage != "env_fault"])
            gave_up = any(t in ("env_fault", "tool_bug") for t in triage)
        # no triage: a fault the policy could not act on is not excused (only a tool's own crash is)
        excused = gave_up if self.triage else "tool_bug" in triage
        if excused:
            treatment = "masked"
        elif shown_now:
            treatment = "to-policy"
        elif gave_up:
            treatment = "unexcused"
        elif fault_events:
            treatment = "retried-recovered"
        else:
            treatment = "none"
        ep.masked = ep.masked or excused

        turn_index = ep.turn
        terminated = truncated = False
        turn_ended = False
        reward = 0.0
        parts: dict[str, Any] = {}
        correct = None
        if not self.multi_turn and not policy:
            # without triage a call whose fault the client gave up on got no answer: it does not count
            reward, parts, correct = self._score(parse.ok, answered, ep.task, 0)
            terminated = True
            turn_ended = True
        else:
            ep.turn_calls.extend(answered)
            ep.turn_call_steps.extend([step_index] * len(answered))
            ep.turn_format_ok = ep.turn_format_ok and parse.ok
            # multi-turn: a message with calls continues the turn; single-turn (policy-visible
            # faults): only a message that met a fault the policy may still act on does
            continues = parse.ok and bool(calls) and (self.multi_turn or bool(shown_now))
            if not continues or ep.step >= limit:
                # the turn ends: the assistant answered without calls, or the step budget ran out
                turn_score, parts, turn_correct = self._score(
                    ep.turn_format_ok, ep.turn_calls, ep.task, ep.turn)
                ep.turn_rewards.append(turn_score)
                ep.turn_correct.append(turn_correct)
                if policy:  # wrong, but right had this turn's open faults' calls been answered
                    by_change = not turn_correct and self._turn_fault_caused(ep, changes_only=True)
                    ep.turn_change_caused.append(by_change)
                    ep.turn_fault_caused.append(by_change or (not turn_correct and self._turn_fault_caused(ep)))
                ep.last_turn_calls, ep.last_turn_format_ok = list(ep.turn_calls), ep.turn_format_ok
                turn_ended = True
                ep.turn += 1
                ep.turn_calls, ep.turn_call_steps, ep.turn_format_ok, ep.answered = [], [], True, []
                if continues:  # the step budget ran out in the middle of a turn
                    truncated = True
                elif ep.turn >= ep.n_user_turns:
                    terminated = True
                elif ep.step >= limit:
                    truncated = True
                else:
                    ep.messages.append({"role": "user", "content": ep.task.turns[ep.turn - 1]})
            if terminated or truncated:
                # sparse terminal reward: the mean turn score; turns never reached score the
                # reward's minimum (a truncated episode is not better than a wrong answer)
                lo = _reward_min(self.reward_name)
                scores = ep.turn_rewards + [lo] * (ep.n_user_turns - len(ep.turn_rewards))
                reward = sum(scores) / ep.n_user_turns
                correct = terminated and all(ep.turn_correct)
            else:
                correct = False
        ep.done = terminated or truncated

        info = {
            "task_id": ep.task.id,
            "calls": [c.to_dict() for c in calls],
            "parse_ok": bool(parse.ok),
            "parse_error": parse.error,
            "tool_results": [_outcome_dict(i, c, o) for i, (c, o) in enumerate(zip(run, outcomes))],
            "fault_events": fault_events,
            "triage": triage,
            "env_fault_treatment": treatment,
            "masked": ep.masked,
            "reward_parts": parts,
            "correct": correct,
            "billed_calls": billed,
            "episode_billed_calls": ep.billed_calls,
            "skipped_calls": [c.to_dict() for c in skipped],
            "messages": copy.deepcopy(ep.messages),
            "turn": turn_index,
            "turn_ended": turn_ended,
            "turn_rewards": list(ep.turn_rewards),
        }
        if policy:
            info["shown_faults"] = copy.deepcopy(shown_now)
            info.update(self._attribution(ep, correct, turn_index))
        if self.render_mode == "human":
            print(self._observation())
        return self._observation(), float(reward), terminated, truncated, info

    def _attribution(self, ep: _Episode, correct: Any, turn_index: int) -> dict[str, Any]:
        """The policy-visible faults' part of a step's info: fault_exposure, open_faults, fault_caused,
        api_changes, change_caused, change_recoverable (see :meth:`astep`)."""
        out: dict[str, Any] = {"fault_exposure": "policy"}
        out["open_faults"] = [copy.deepcopy(f) for f in ep.shown_faults if not f["handled"]]
        out["fault_caused"] = bool(
            ep.done and not correct and not ep.masked and out["open_faults"]
            and self._would_be_right(ep, turn_index, out["open_faults"]))
        out["api_changes"] = copy.deepcopy(ep.api_changes)
        out["change_caused"] = bool(
            ep.done and not correct and not ep.masked
            and any(f["kind"] in _CHANGE_KINDS for f in out["open_faults"])
            and self._would_be_right(ep, turn_index, out["open_faults"], ep.turn_change_caused))
        out["change_recoverable"] = bool(
            ep.done and ep.api_changes and not ep.masked and (bool(correct) or out["change_caused"]))
        return out

    async def aend_episode(self) -> tuple[float, dict[str, Any]]:
        """End the episode from outside, without a message: the caller stopped it before the env did (a
        rollout's token budget ran out while a fault was still open). The turn in progress is scored as
        when the step budget runs out, and the episode ends truncated. Returns (reward, info) with the final
        attribution: a fault shown at the last message, which the policy had no message left to act on,
        masks the episode (never penalised), except an API change the policy had already met at an earlier
        message and did not adapt to: that failure is the policy's (``change_caused``, the reward of a wrong
        answer). info: masked, correct (False), turn_rewards, env_fault_treatment ("masked" when this masked
        it, else "none"), ended_by ("caller"), and under fault_exposure="policy" the fields of :meth:`astep`'s
        attribution (open_faults, fault_caused, api_changes, change_caused, change_recoverable). No tool is
        called. Idempotent on an ended episode: it answers its last verdict again."""
        ep = self._episode
        if ep is None:
            raise RuntimeError("call reset() before aend_episode()")
        policy = self.policy_sees_faults
        if not ep.done:
            last = ep.step - 1
            no_room = [f for f in ep.shown_faults if not f["handled"] and int(f["step"]) == last
                       and not _change_met_before(ep, f)]
            if self.triage and no_room and not ep.masked:
                ep.masked, ep.end_treatment = True, "masked"
            turn_index = ep.turn
            if ep.turn < ep.n_user_turns and (ep.turn_calls or ep.step > 0):
                turn_score, _parts, turn_correct = self._score(ep.turn_format_ok, ep.turn_calls, ep.task, ep.turn)
                ep.turn_rewards.append(turn_score)
                ep.turn_correct.append(turn_correct)
                if policy:
                    by_change = not turn_correct and self._turn_fault_caused(ep, changes_only=True)
                    ep.turn_change_caused.append(by_change)
                    ep.turn_fault_caused.append(by_change or (not turn_correct and self._turn_fault_caused(ep)))
                ep.last_turn_calls, ep.last_turn_format_ok = list(ep.turn_calls), ep.turn_format_ok
                ep.turn += 1
                ep.turn_calls, ep.turn_call_steps, ep.turn_format_ok, ep.answered = [], [], True, []
            ep.done = True
            ep.end_turn_index = turn_index
        lo = _reward_min(self.reward_name)
        scores = ep.turn_rewards + [lo] * (ep.n_user_turns - len(ep.turn_rewards))
        reward = sum(scores) / ep.n_user_turns
        info: dict[str, Any] = {"task_id": ep.task.id, "masked": ep.masked, "correct": False,
                                "turn_rewards": list(ep.turn_rewards), "ended_by": "caller",
                                "env_fault_treatment": ep.end_treatment}
        if policy:
            info.update(self._attribution(ep, False, ep.turn if ep.end_turn_index is None else ep.end_turn_index))
        return float(reward), info

    def _note_shown(self, ep: _Episode, step_index: int, run: list[ToolCall], outcomes: list[Any],
                    shown_now: list[dict[str, Any]]) -> list[ToolCall]:
        """Policy-visible faults: record this step's faults on the episode (appended to
        ``shown_now`` too), mark earlier ones handled when their call got an answer now, and return
        the calls that count toward the answer (those that got an answer, less repeats of a call
        that already got one in an earlier step of the turn)."""
        from reflrl.faults.kinds import KINDS

        counted: list[ToolCall] = []
        before = list(ep.answered)
        for i, (c, o) in enumerate(zip(run, outcomes)):
            if o.triage == "env_fault":
                fault = o.fault
                kind = KINDS.get(str(o.fault_kind))
                f = {"step": step_index, "turn": ep.turn, "call_index": i, "name": c.name,
                     "arguments": copy.deepcopy(dict(c.arguments)), "kind": o.fault_kind,
                     "status": o.status if o.status is not None else getattr(fault, "status", None),
                     "retry_after_s": getattr(fault, "retry_after", None),
                     "code": getattr(fault, "code", None), "attempts": int(o.attempts),
                     "observation": _fault_text(o), "policy_can_act": bool(kind and kind.policy_can_act),
                     "handled": False}
                if o.fault_kind in _CHANGE_KINDS:
                    f.update(_note_change(ep, step_index, c, o))
                ep.shown_faults.append(f)
                shown_now.append(f)
                continue
            # an adapted call (a renamed parameter's new name, a retired tool's successor) stands for
            # the call it replaces: scored, and checked against shown faults, in the old form
            canon = canonical_call(ep.api_changes, c)
            if canon is not c:
                _mark_adapted(ep.api_changes, c)
            key = _call_key(canon)
            for f in ep.shown_faults:
                if (not f["handled"] and f["step"] < step_index
                        and _call_key(canonical_call(ep.api_changes, ToolCall(f["name"], f["arguments"]))) == key):
                    f["handled"] = True
            if any(_call_key(b) == key for b in before):
                continue  # the answer was already there: calling again is not a second call
            counted.append(canon)
            ep.answered.append(canon)
        return counted

    def _turn_fault_caused(self, ep: _Episode, changes_only: bool = False) -> bool:
        """Whether the turn that just ended was failed by its faults: it would have been right had the
        calls of its faults that are still open been answered, either with every call the turn got an
        answer to, or with those answered up to the step of its first open fault (the answer the policy
        had given when it met the fault). Acting on the fault was then the policy's to do, and what it
        wrote instead (stopping, a malformed reply - a small policy often echoes the tool's error inside
        a call - or other calls) failed to call again. A turn with no open fault stays the policy's.
        ``changes_only``: only the open API changes count (had those calls been adapted)."""
        open_now = [f for f in ep.shown_faults if not f["handled"] and f.get("turn", 0) == ep.turn
                    and (not changes_only or f["kind"] in _CHANGE_KINDS)]
        if not open_now:
            return False
        faulted: list[ToolCall] = []  # a call that met its fault again when sent again counts once
        for f in open_now:
            c = canonical_call(ep.api_changes, ToolCall(f["name"], f["arguments"]))
            if all(_call_key(c) != _call_key(x) for x in faulted):
                faulted.append(c)
        first = min(int(f["step"]) for f in open_now)
        before = [c for c, st in zip(ep.turn_calls, ep.turn_call_steps) if st <= first]
        for answered in (list(ep.turn_calls), before):
            if self._score(True, answered + faulted, ep.task, ep.turn)[2]:
                return True
        return False

    def _would_be_right(self, ep: _Episode, turn: int, open_faults: list[dict[str, Any]],
                        caused_by: list[bool] | None = None) -> bool:
        """Whether the episode's answer would have been right had the open faults' calls been answered:
        every turn is right or fault-caused (:meth:`_turn_fault_caused`), at least one is fault-caused,
        and no turn is left unreached (a truncated episode is the policy's). ``caused_by``: the per-turn
        flags to use (default ``ep.turn_fault_caused``; ``ep.turn_change_caused`` for the API changes)."""
        caused = ep.turn_fault_caused if caused_by is None else caused_by
        if len(ep.turn_correct) < ep.n_user_turns:
            return False
        return any(caused) and all(ok or c for ok, c in zip(ep.turn_correct, caused))

    def _score(self, format_ok: bool, calls: list[ToolCall], task: Task, turn: int):
        """(reward, parts, correct) of the calls of one turn against the turn's gold calls."""
        gold = task.gold[turn] if turn < len(task.gold) else []
        parse = ParseResult(ok=format_ok, calls=list(calls))
        res = self._reward_fn(parse, gold)
        return float(res.total), dict(res.parts), bool(res.correct)

    async def aclose(self) -> None:
        """Close the episode on the server and the client (if the env owns it). Idempotent."""
        try:
            await self._close_episode()
        finally:
            if self._owns_client and self._client is not None:
                client, self._client = self._client, None
                await client.aclose()
            self._shutdown_app()
            self._closed = True

    def _shutdown_app(self) -> None:
        """Delete the sandboxes of an in-process server this env created."""
        if self._owns_app and self._app is not None:
            server = getattr(self._app, "server", None)
            if server is not None:
                server.shutdown()
            self._app, self._owns_app = None, False

    async def _close_episode(self) -> None:
        ep, self._episode = self._episode, None
        if ep is not None and self._client is not None:
            try:
                await self._client.close_episode(ep.episode_id)
            except Exception:  # noqa: BLE001  the server may be gone already; nothing to free then
                pass

    # ------------------------------------------------------------------ sync API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Sync ``areset`` (runs on the env's private event loop)."""
        return self._runner.run(self.areset(seed=seed, options=options))

    def step(self, action: str):
        """Sync ``astep`` (runs on the env's private event loop)."""
        return self._runner.run(self.astep(action))

    def close(self) -> None:
        """Close episode, client and private loop. Idempotent; after async use prefer ``aclose``."""
        if self._closed and self._client is None:
            self._runner.stop()
            return
        loop = self._client_loop
        try:
            if self._client is None or loop is None or loop is self._runner.loop:
                if self._runner.loop is not None:
                    self._runner.run(self.aclose())
                else:
                    self._closed = True
            elif loop.is_closed() or not loop.is_running():
                # async use whose loop is gone: an in-process client holds nothing to free
                self._client = None
                self._episode = None
                self._shutdown_app()
                self._closed = True
            else:
                asyncio.run_coroutine_threadsafe(self.aclose(), loop).result(timeout=30)
        finally:
            self._runner.stop()
        super().close()

    def render(self):
        """``ansi``: the conversation as text; ``human``: print it."""
        text = self._observation()
        if self.render_mode == "human":
            print(text)
            return None
        return text

    def _observation(self) -> str:
        if self._episode is None:
            return ""
        text = _render_text(self._episode.messages)
        limit = self.observation_space.max_length
        if len(text) > limit:  # keep the newest part of an over-long conversation
            text = text[-limit:]
        return text


class ToolCallMultiTurnEnv(ToolCallEnv):
    """Multi-turn tool calling (BFCL multi-turn style); see the module docstring.

    Each step is one assistant message. With calls, they run (in order by default) and their
    results are appended as tool messages; the user turn continues. Without calls (a final
    answer, or a message that does not parse), the user turn ends and is scored against its gold
    calls: all calls of the turn as one prediction, format-checked over all its messages
    (``info["turn_rewards"]``). Then the next user message follows, if any.

    The reward is sparse: 0 on every step but the last; at termination (or truncation) it is
    the mean turn score, turns never reached scoring the reward's minimum, so the episode return
    has the single-turn env's scale (binary: [0, 1]; fine: [-3, 4]) and the last step's reward is
    the return. ``info["correct"]`` at the end: every turn exactly right.
    """

    multi_turn = True
    default_kinds = None


def gold_actions(task: Task, fmt: str = "hermes", *, multi_turn: bool = False,
                 final_answer: str = "Done.") -> list[str]:
    """Scripted assistant messages that play the task's gold calls (tests, demo's gold replay).

    Single-turn: one message with the gold calls of turn 1. Multi-turn: per user turn, one message
    with that turn's gold calls (executed in order, BFCL style; omitted when the turn has none),
    then ``final_answer`` to end the turn.
    """
    from .parsing import format_calls

    if fmt == "auto":
        fmt = "hermes"
    if not multi_turn:
        return [format_calls(list(task.gold[0]) if task.gold else [], fmt)]
    out: list[str] = []
    for t in range(1 + len(task.turns)):
        calls = list(task.gold[t]) if t < len(task.gold) else []
        if calls:
            out.append(format_calls(calls, fmt))
        out.append(final_answer)
    return out


# ---------------------------------------------------------------------- adapters to sibling modules
def _resolve_dataset(dataset, split: str, kinds, dataset_seed: int,
                     synthetic_sizes: tuple[int, int, int]) -> list[Task]:
    """A list of Task from a list, a named source ("synthetic", "bfcl") or a file path."""
    if isinstance(dataset, (list, tuple)):
        tasks = list(dataset)
        bad = [type(t).__name__ for t in tasks if not isinstance(t, Task)]
        if bad:
            raise TypeError(f"dataset list must hold Task objects, found {bad[0]}")
    elif isinstance(dataset, (str, Path)) and str(dataset) == "synthetic":
        want = tuple(kinds) if kinds is not None else ("single", "parallel", "multi_turn")
        splits = _synthetic_splits(tuple(int(n) for n in synthetic_sizes), int(dataset_seed), want)
        if split not in splits:
            raise ValueError(f"unknown split {split!r}; choose from {sorted(splits)}")
        tasks = list(splits[split])
    elif isinstance(dataset, (str, Path)) and str(dataset).lower() in ("bfcl", "bfcl-multi-turn"):
        from .tools.bfcl_backends import load_bfcl_multi_turn

        tasks = list(load_bfcl_multi_turn())
    elif isinstance(dataset, (str, Path)):
        path = Path(dataset)
        if not path.exists():
            raise FileNotFoundError(f"dataset {str(dataset)!r} is neither 'synthetic', 'bfcl' nor "
                                    "an existing file")
        from . import datasets as ds

        report = ds.load_tasks(path)
        tasks = list(report.tasks)
    else:
        raise TypeError(f"dataset must be a list of Task, 'synthetic', 'bfcl' or a path; got "
                        f"{type(dataset).__name__}")
    if kinds is not None:
        tasks = [t for t in tasks if t.kind in kinds]
    return tasks


@functools.lru_cache(maxsize=8)
def _synthetic_splits(sizes: tuple[int, int, int], seed: int, kinds: tuple[str, ...]):
    """Synthetic train/val/test splits, cached per process (many envs share one dataset)."""
    from . import datasets as ds

    return ds.synthetic_splits(*sizes, seed, kinds=kinds)


def _get_reward(name: str):
    """fn(ParseResult, gold calls) -> RewardResult(total, parts, correct) (``reflrl.envs.rewards``)."""
    from . import rewards

    return rewards.get_reward(name)


def _reward_min(name: str) -> float:
    from . import rewards

    return float(rewards.REWARD_RANGES.get(name, (0.0, 1.0))[0])


def _get_parser(name: str):
    """fn(text) -> ParseResult for format ``name`` (``reflrl.envs.parsing.parse``; never raises)."""
    from . import parsing

    parsing.check_format(name)  # ValueError listing the formats for a bad name

    def parse(text: str) -> ParseResult:
        return parsing.parse(text, name)

    return parse


def _safe_parse(parse, text: str) -> ParseResult:
    """Parsers must not raise on model output; if one does anyway, it is a parse failure."""
    try:
        return parse(text)
    except Exception as e:  # noqa: BLE001  model output is data: never crash the rollout on it
        return ParseResult(ok=False, calls=[], content=text, error=f"parser raised {type(e).__name__}: {e}")


def _check_prompt_style(style: str) -> None:
    from . import prompts

    if style not in prompts.STYLES:
        raise ValueError(f"unknown prompt_style {style!r}; choose one of {', '.join(prompts.STYLES)}")


def _build_messages(task: Task, style: str, fmt: str, think: bool) -> list[dict[str, Any]]:
    """System prompt (tool list + how to write calls in ``fmt``) and the user query."""
    from . import prompts

    return [dict(m) for m in prompts.build_messages(task, style=style, fmt=fmt, think=think)]


def _render_text(messages: list[dict[str, Any]]) -> str:
    """The conversation as plain text (one block per message: '<|role|>\\ncontent')."""
    out = []
    for m in messages:
        role = m.get("role", "?")
        name = f" {m['name']}" if m.get("name") else ""
        out.append(f"<|{role}{name}|>\n{m.get('content', '')}")
    return "\n".join(out)


def _assistant_message(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def _note_change(ep: _Episode, step_index: int, call: ToolCall, outcome: Any) -> dict[str, Any]:
    """An API change the call met: the server's record of it (the error body: the old and the new
    name), kept on the episode (one per tool, the first time it is met) and returned as the fields the
    shown fault carries: ``param`` (old parameter name, None for a move) and ``new``."""
    fault = outcome.fault
    fields = dict(getattr(fault, "error_fields", None) or {})
    kind = str(outcome.fault_kind)
    tool = str(fields.get("tool") or call.name)
    if kind == "param_renamed":
        param, new = fields.get("param"), fields.get("new_param")
    else:
        param, new = None, fields.get("successor")
    if new and not any(ch["tool"] == tool and ch["kind"] == kind for ch in ep.api_changes):
        ep.api_changes.append({"kind": kind, "tool": tool, "param": param, "new": new,
                               "step": step_index, "adapted": False})
    return {"param": param, "new": new}


def _change_met_before(ep: _Episode, f: dict[str, Any]) -> bool:
    """Whether shown fault ``f`` is an API change the episode had already met at an earlier message (the
    policy then had a message in which to adapt)."""
    return f["kind"] in _CHANGE_KINDS and any(
        ch["kind"] == f["kind"] and ch["tool"] == f["name"] and int(ch["step"]) < int(f["step"])
        for ch in ep.api_changes)


def canonical_call(changes: list[dict[str, Any]], c: ToolCall) -> ToolCall:
    """The call an adapted call stands for (``c`` itself when it is not adapted): a retired tool's
    successor -> the retired tool; a renamed parameter's new name -> the old name."""
    name, args = c.name, dict(c.arguments)
    changed = False
    for ch in changes:
        if ch["kind"] == "tool_moved" and name == ch["new"]:
            name, changed = ch["tool"], True
    for ch in changes:
        if (ch["kind"] == "param_renamed" and name == ch["tool"] and ch["new"] in args
                and ch["param"] not in args):
            args = {(ch["param"] if k == ch["new"] else k): v for k, v in args.items()}
            changed = True
    return ToolCall(name, args) if changed else c


def _mark_adapted(changes: list[dict[str, Any]], c: ToolCall) -> None:
    """Mark the changes an answered call ``c`` used the new name of."""
    for ch in changes:
        if ch["kind"] == "tool_moved" and c.name == ch["new"]:
            ch["adapted"] = True
    name = canonical_call([ch for ch in changes if ch["kind"] == "tool_moved"], c).name
    for ch in changes:
        if ch["kind"] == "param_renamed" and name == ch["tool"] and ch["new"] in c.arguments:
            ch["adapted"] = True


def _call_key(c: ToolCall) -> tuple[str, Any]:
    """A call's identity for "the same call again": its name and normalised arguments."""
    from .rewards import normalize_value

    return (c.name, normalize_value(dict(c.arguments)))


def _fault_text(outcome: Any) -> str:
    """The failure of a call as an API's caller sees it (``ToolCallError.observation``)."""
    fault = getattr(outcome, "fault", None)
    if fault is not None and hasattr(fault, "observation"):
        return fault.observation()
    return str(getattr(outcome, "error", None) or "failed")


def fault_observation(call_name: str, outcome: Any, max_chars: int = 2000) -> str:
    """The tool message content a policy is shown for a call the client gave up on, under
    ``fault_exposure="policy"``: ``{"name", "error": <status, reason, message, code, Retry-After>,
    "kind": <fault kind>}`` (``reflrl.envs.prompts.render_tool_error``; module doc)."""
    from . import prompts

    return prompts.render_tool_error(call_name, _fault_text(outcome), outcome.fault_kind, max_chars)


def _tool_message(call: ToolCall, outcome: Any, max_chars: int, note: str | None = None,
                  shown: bool = False) -> dict[str, Any]:
    """The tool observation (role "tool") the model sees for one call (``shown``: an env fault is
    rendered as the API gave it, :func:`fault_observation`)."""
    from . import prompts

    if outcome is None:
        content = prompts.render_tool_error(call.name, note or "not executed", "not_executed", max_chars)
    elif outcome.ok:
        content = prompts.render_tool_result(call.name, outcome.result, max_chars)
    elif shown and outcome.triage == "env_fault":
        content = fault_observation(call.name, outcome, max_chars)
    else:
        kind = outcome.fault_kind if outcome.triage == "env_fault" else outcome.triage
        content = prompts.render_tool_error(call.name, str(outcome.error or "failed"), kind, max_chars)
    return {"role": "tool", "name": call.name, "content": content}


def _fault_event_dicts(call_index: int, tool: str, outcome: Any) -> list[dict[str, Any]]:
    """The faults the client observed on one call's attempts, as plain dicts.

    Keys: call_index, tool, attempt (0-based), kind, status, detail, triage (of that attempt),
    retried (another attempt followed), recovered (the call finally succeeded).
    """
    events = list(getattr(outcome, "events", None) or [])
    out = []
    for ev in events:
        d = dataclasses.asdict(ev) if dataclasses.is_dataclass(ev) else dict(ev)
        attempt = int(d.get("attempt", 0))
        out.append({
            "call_index": call_index, "tool": tool, "attempt": attempt, "kind": d.get("kind"),
            "status": d.get("status"), "detail": d.get("detail", ""), "triage": d.get("triage"),
            "retried": attempt + 1 < int(getattr(outcome, "attempts", 1)),
            "recovered": bool(getattr(outcome, "ok", False)),
        })
    return out


def _outcome_dict(i: int, call: ToolCall, o: Any) -> dict[str, Any]:
    return {"call_index": i, "name": call.name, "ok": bool(o.ok),
            "result": copy.deepcopy(o.result) if o.ok else None,
            "error": o.error, "triage": o.triage, "fault_kind": o.fault_kind,
            "attempts": int(o.attempts),
            # on the env's clock (virtual by default in-process: exact and replayable)
            "elapsed_s": round(float(getattr(o, "elapsed_s", 0.0) or 0.0), 3)}


def _new_ledger():
    from reflrl.faults.ledger import Ledger

    return Ledger()


def _make_client(env: ToolCallEnv):
    """A ToolClient for the env: over loopback to ``server_url`` or in-process on an ASGI app.

    In-process, the env creates its own server app (unless one was passed) sharing the env's
    ledger (injected and observed records side by side, so ``env.ledger.reconcile()`` works) and
    clock (a VirtualClock makes latency faults and Retry-After waits cost no wall time).
    """
    from .client import ToolClient
    from .clock import SystemClock, VirtualClock

    clock = env._clock
    if clock is None or clock == "auto":
        clock = SystemClock() if env.server_url else VirtualClock()
    elif clock == "virtual":
        clock = VirtualClock()
    elif clock == "system":
        clock = SystemClock()
    env._clock = clock
    kwargs: dict[str, Any] = {"ledger": env.ledger, "clock": clock}
    if env._retry is not None:
        kwargs["retry"] = _coerce_retry(env._retry, env.policy_sees_faults)
    elif env.policy_sees_faults:
        kwargs["retry"] = _coerce_retry({}, True)
    if env._timeout is not None:
        kwargs["timeout"] = env._timeout
    if env.server_url:
        return ToolClient.connect(env.server_url, **kwargs)
    if env._app is None:
        from .tool_server import create_app

        env._app = create_app(clock=clock, ledger=env.ledger, default_seed=env.server_seed)
        env._owns_app = True
        server = getattr(env._app, "server", None)
        if server is not None:  # an env dropped without close() must not leave sandboxes behind
            weakref.finalize(env, server.shutdown)
    return ToolClient.in_process(env._app, **kwargs)


def _coerce_retry(retry: Any, policy_sees_faults: bool = False):
    """A RetryPolicy from one or a dict of its fields; with policy-visible faults a dict's missing
    fields default to one attempt per call and no identity change after a ban."""
    from .client import RetryPolicy

    if isinstance(retry, RetryPolicy):
        return retry
    if isinstance(retry, dict):
        if policy_sees_faults:
            retry = {"max_attempts": 1, "rotate_identity_on_ban": False, **retry}
        return RetryPolicy(**retry)
    raise TypeError(f"retry must be a RetryPolicy or a dict of its fields, got {type(retry).__name__}")
