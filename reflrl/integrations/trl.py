"""reflrl's fault-injecting tools as an ``environment_factory`` for TRL's ``GRPOTrainer``.

    from trl import GRPOConfig, GRPOTrainer
    from reflrl.integrations.trl import ToolEnvironmentFactory, use_tool_chat_template

    factory = ToolEnvironmentFactory(faults="rate_limit=0.1", seed=0)
    trainer = GRPOTrainer(
        model=model, processing_class=use_tool_chat_template(tokenizer), args=GRPOConfig(...),
        train_dataset=factory.dataset(), environment_factory=factory,
        reward_funcs=[factory.reward("binary")], callbacks=[factory.callback()])
    trainer.train()
    print(factory.ledger.totals().format())

The contract, as TRL 1.16 implements it (``GRPOTrainer.__init__`` / ``_generate_and_score_completions``
/ ``_tool_call_loop``; docs "GRPO Trainer > Agent Training"; tested range pinned in the ``trl``
extra of pyproject.toml):

- ``environment_factory`` is a zero-argument callable; the trainer makes one instance per rollout
  of a generation batch, keeps them in a pool and calls ``reset(**row)`` on each before
  generating, ``row`` being the dataset row (here ``prompt`` and ``task_index``). A returned
  string is appended to the prompt's last message; we return None (the prompt is in the row).
- Every public method of the instance's class is a tool; its JSON schema comes from
  ``transformers.utils.get_json_schema`` (type hints + Google docstring). The methods here are
  generated from the tool server's JSON schemas (:func:`environment_class`), one per tool.
  Sync tools are called one after another with the arguments TRL parsed from the model's
  ``<tool_call>`` block; the returned string becomes the tool message. An exception in a tool
  becomes an error message and counts in TRL's ``tools/failure_frequency``.
- Reward functions get ``environments=`` (one instance per completion) besides ``prompts`` and
  ``completions``, and may return None for a completion.

Every tool call goes through reflrl's ``ToolClient`` to the tool server (in-process by default,
or ``server_url``): faults are injected by the server exactly as in reflrl's own environments,
retried by the client's ``RetryPolicy`` (Retry-After aware), triaged (ok / env_fault /
policy_error) and recorded in ``factory.ledger`` (injected and observed, ``reconcile()``).

Keeping env-fault failures out of the loss: a rollout is *masked* when one of its calls ended on
an env fault that retries did not recover (``env.masked``; Tool-ReRL sec. 1 and 3.2:
environment-caused failures are not the policy's errors). For such a rollout every reward
function of this module returns None. TRL (1.16, ``_generate_and_score_completions``) treats a
completion for which *every* reward source returned None as unscorable: its reward is NaN, it is
left out of its group's mean and standard deviation, and its advantage is set to 0, so with
``beta=0`` (TRL's default) it contributes no gradient. Wrap any reward function of your own with
:func:`mask_env_faults`, or it will score masked rollouts and TRL will train on them. (Its tokens
still count in the token normaliser of the "dapo"/"bnpo" losses, and with ``beta > 0`` their KL
term still applies.) The reward functions log ``reflrl/masked_fraction`` through TRL's
``log_metric``, and :class:`LedgerCallback` logs the ledger's totals after every step.

Fault coordinates: a TRL environment does not learn where one assistant message ends and the next
begins, so every call of a rollout has X-Reflrl-Step 0 and X-Reflrl-Call = its index in the
rollout; the episode id and fault seed derive from (factory seed, instance index, reset count),
so the same seed, data order and model outputs replay the same faults.
"""
from __future__ import annotations

import inspect
import json
import random
import weakref
from dataclasses import asdict
from typing import Any, Callable, Sequence

from transformers import TrainerCallback

from reflrl.envs import parsing, prompts, rewards
from reflrl.envs.tool_env import LoopThread, derive_seed
from reflrl.envs.types import ParseResult, Task, ToolCall
from reflrl.faults import FaultPlan, Ledger

DEFAULT_TOOLS = ("get_current_weather", "get_stock_quote", "search_flights")
"""Three tools of three domains: a short prompt (each tool schema costs prompt tokens on a CPU)."""

SYSTEM_PROMPT = ("You are a helpful assistant. Answer the user's request by calling the right "
                 "tool with the right arguments.")

RESERVED = ("reset", "get_reward")
_JSON_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list,
               "object": dict}


# ---------------------------------------------------------------------------------- chat template
def use_tool_chat_template(tokenizer: Any) -> Any:
    """Give a ChatML tokenizer a chat template TRL can do tool calling with; returns it.

    TRL renders the tool schemas with the chat template and parses ``<tool_call>`` blocks only for
    templates it knows (``trl.chat_template_utils.add_response_schema``). SmolLM2's own ChatML
    template ignores tools, so it is replaced by TRL's copy of the Qwen2.5 template: the same
    ``<|im_start|>``/``<|im_end|>`` ChatML turns, with Hermes-style ``<tool_call>{json}</tool_call>``
    calls, the format reflrl's ``hermes`` parser reads. A template that already supports tool
    calling is kept. Raises ValueError for a tokenizer that is neither.
    """
    from trl.chat_template_utils import qwen2_5_chat_template, supports_tool_calling

    if getattr(tokenizer, "chat_template", None) and supports_tool_calling(tokenizer):
        return tokenizer
    vocab = tokenizer.get_vocab()
    if "<|im_start|>" not in vocab or "<|im_end|>" not in vocab:
        raise ValueError("the tokenizer's chat template cannot render tool calls and it is not a "
                         "ChatML tokenizer (no <|im_start|>/<|im_end|> tokens): set a chat template "
                         "with tool support yourself")
    tokenizer.chat_template = qwen2_5_chat_template
    return tokenizer


# ---------------------------------------------------------------------------------- tool methods
def _hint(schema: dict[str, Any]) -> Any:
    """The Python type hint whose ``get_json_schema`` rendering matches a JSON-schema fragment."""
    t = schema.get("type")
    if isinstance(t, list):  # ["string", "null"]
        t = next((x for x in t if x != "null"), "string")
    if t == "array":
        item = schema.get("items")
        return list[_hint(item)] if isinstance(item, dict) and item.get("type") else list
    return _JSON_TYPES.get(t, str)


def _docstring(tool: dict[str, Any]) -> str:
    """A Google-style docstring: the description and one Args line per parameter (enums as
    ``(choices: [...])``, which ``get_json_schema`` turns back into an ``enum``). No Returns
    section: the chat template would render it into every prompt."""
    lines = [(tool.get("description") or tool["name"]).strip().replace("\n", " "), "", "Args:"]
    props = (tool.get("parameters") or {}).get("properties") or {}
    for pname, ps in props.items():
        desc = " ".join(str(ps.get("description") or pname).split())
        if isinstance(ps.get("enum"), list) and ps["enum"]:
            desc += f" (choices: {json.dumps(ps['enum'])})"
        lines.append(f"    {pname}: {desc}")
    if not props:
        lines.pop()
    return "\n".join(lines)


def _tool_method(tool: dict[str, Any]) -> Callable[..., str]:
    """A method ``name(self, *, <parameters>) -> str`` that calls the tool through reflrl's client.

    The signature is keyword-only (so required and optional parameters can come in schema order),
    optional parameters default to the schema's ``default`` (None when it has none)."""
    name = tool["name"]
    params = (tool.get("parameters") or {})
    required = set(params.get("required") or ())
    sig = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    hints: dict[str, Any] = {}
    for pname, ps in (params.get("properties") or {}).items():
        ps = ps if isinstance(ps, dict) else {}
        hint = _hint(ps)
        if pname in required:
            default = inspect.Parameter.empty
        else:
            default = ps.get("default")
            if default is None:
                hint = hint | None
        hints[pname] = hint
        sig.append(inspect.Parameter(pname, inspect.Parameter.KEYWORD_ONLY, default=default,
                                     annotation=hint))
    hints["return"] = str

    def method(self, **arguments: Any) -> str:
        return self._call(name, arguments)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = _docstring(tool)
    method.__signature__ = inspect.Signature(sig, return_annotation=str)  # type: ignore[attr-defined]
    method.__annotations__ = hints
    return method


def environment_class(tools: Sequence[dict[str, Any]], name: str = "ReflrlToolEnvironment") -> type:
    """A ``ToolEnvironment`` subclass with one public method per tool schema (what TRL exposes)."""
    attrs: dict[str, Any] = {"__doc__": f"reflrl tool environment with tools "
                                        f"{', '.join(t['name'] for t in tools)}."}
    for tool in tools:
        tname = tool["name"]
        if not tname.isidentifier() or tname.startswith("_") or tname in RESERVED \
                or hasattr(ToolEnvironment, tname):
            raise ValueError(f"tool name {tname!r} cannot be a TRL environment method (it must be a "
                             f"public identifier other than {', '.join(RESERVED)} and the "
                             "environment's own attributes)")
        attrs[tname] = _tool_method(tool)
    return type(name, (ToolEnvironment,), attrs)


# ---------------------------------------------------------------------------------- environment
class ToolEnvironment:
    """One rollout's environment (TRL makes one per rollout and resets it between batches).

    Public methods are TRL's tools, so the environment's own state is exposed through read-only
    properties only: ``task`` (the Task of the current rollout), ``masked`` (an env fault that
    retries did not recover ended one of its calls), ``outcomes`` (the ``CallOutcome`` of each
    call, in order) and ``episode_id``.
    """

    def __init__(self, factory: "ToolEnvironmentFactory", index: int) -> None:
        self._factory = factory
        self._index = index
        self._resets = -1
        self._task: Task | None = None
        self._episode_id: str | None = None
        self._outcomes: list[Any] = []
        self._masked = False

    def reset(self, task_index: int | None = None, **row: Any) -> str | None:
        """Start a rollout on task ``task_index`` (a dataset column); without one, draw a task
        from the factory's tasks and return its query (it becomes the user message)."""
        f = self._factory
        self._resets += 1
        i = f._rng.randrange(len(f.tasks)) if task_index is None else int(task_index)
        if not 0 <= i < len(f.tasks):
            raise IndexError(f"task_index {i} out of range [0, {len(f.tasks)})")
        f._close(self)
        self._task, self._outcomes, self._masked = f.tasks[i], [], False
        self._episode_id = f"trl-{f.seed}-{self._index}-{self._resets}"
        # the tools' data follows the task (a GRPO group sees one world), faults the rollout
        f._open(self, data_seed=derive_seed(f.seed, i, 0),
                fault_seed=derive_seed(f.seed, self._index, self._resets, 1))
        return None if task_index is not None else self._task.query

    @property
    def task(self) -> Task | None:
        return self._task

    @property
    def masked(self) -> bool:
        return self._masked

    @property
    def outcomes(self) -> list[Any]:
        return list(self._outcomes)

    @property
    def episode_id(self) -> str | None:
        return self._episode_id

    def _call(self, name: str, arguments: dict[str, Any]) -> str:
        """Run one tool call through reflrl's client; the tool message content for the model."""
        if self._episode_id is None:
            raise RuntimeError("reset() the environment before calling a tool")
        out = self._factory._call(self._episode_id, len(self._outcomes), name, arguments)
        self._outcomes.append(out)
        limit = self._factory.max_tool_chars
        if out.ok:
            return prompts.render_tool_result(name, out.result, limit)
        if out.triage == "env_fault":
            self._masked = True
        kind = out.fault_kind if out.triage == "env_fault" else out.triage
        return prompts.render_tool_error(name, str(out.error or "failed"), kind, limit)


# ---------------------------------------------------------------------------------- factory
class ToolEnvironmentFactory:
    """``environment_factory`` for TRL's GRPOTrainer backed by reflrl's tools and fault plan.

    Args:
        tools: names of the tools offered (the tool server's catalogue; default three tools).
        tasks: the tasks (``reflrl.envs.types.Task``) whose gold calls use only ``tools``; default
            ``n_tasks`` synthetic tasks of ``kinds`` (seed ``dataset_seed``).
        faults: fault spec (``"rate_limit=0.1"``) or FaultPlan, injected by the tool server.
        seed: seeds episode ids, fault streams, tool data and the task draw without a dataset.
        retry: a ``RetryPolicy`` or a dict of its fields (default: the client's policy).
        timeout: the client's read timeout per attempt in seconds.
        clock: ``"virtual"`` (Retry-After, backoff and latency cost no wall time; default
            in-process), ``"system"`` (default with ``server_url``) or a clock object.
        server_url: a running tool server (``reflrl tools serve``, or a ``reflrl faults proxy`` in
            front of one); default an in-process server.
        client: a ready ``ToolClient`` (e.g. ``reflrl.envs.http_tools.http_tool_client`` for a
            user's own HTTP service behind the proxy); its ledger becomes ``self.ledger``.
        max_tool_chars: tool messages are cut to this many characters (0 = no limit).

    Attributes: ``ledger`` (every injected fault and observed attempt), ``tasks``, ``tools``
    (the schemas offered), ``environment_class``, ``plan``.
    """

    def __init__(self, *, tools: Sequence[str] = DEFAULT_TOOLS, tasks: Sequence[Task] | None = None,
                 n_tasks: int = 64, kinds: Sequence[str] = ("single",), dataset_seed: int = 0,
                 faults: Any = None, seed: int = 0, retry: Any = None, timeout: float | None = None,
                 clock: Any = None, server_url: str | None = None, client: Any = None,
                 max_tool_chars: int = 2000, system_prompt: str = SYSTEM_PROMPT) -> None:
        from reflrl.envs.clock import SystemClock, VirtualClock

        self.plan = FaultPlan.coerce(faults)
        self.seed = int(seed)
        self.max_tool_chars = int(max_tool_chars)
        self.system_prompt = system_prompt
        self._rng = random.Random(self.seed)
        self._runner = LoopThread("reflrl-trl-tools")
        self._open_envs: dict[str, ToolEnvironment] = {}
        self._n_instances = 0
        weakref.finalize(self, self._runner.stop)  # a factory dropped without close()
        self._owns_client = client is None
        if client is not None:
            self._client, self.server_url = client, None
            self.ledger = client.ledger
        else:
            self.server_url = server_url
            if clock in (None, "auto"):
                clock = SystemClock() if server_url else VirtualClock()
            elif clock == "virtual":
                clock = VirtualClock()
            elif clock == "system":
                clock = SystemClock()
            self.ledger = Ledger()
            self._client = self._runner.run(self._make_client(clock, retry, timeout))
        schemas = {t["name"]: t for t in self._runner.run(self._client.tools())}
        unknown = [n for n in tools if n not in schemas]
        if unknown:
            raise ValueError(f"unknown tools {unknown}; the tool server offers "
                             f"{', '.join(sorted(schemas))}")
        self.tools = [schemas[n] for n in tools]
        self.environment_class = environment_class(self.tools)
        if tasks is None:
            from reflrl.envs.datasets import generate_synthetic

            tasks = generate_synthetic(n_tasks, dataset_seed, kinds=tuple(kinds), tools=list(tools))
        self.tasks = list(tasks)
        if not self.tasks:
            raise ValueError("no tasks")
        offered = set(tools)
        for t in self.tasks:
            bad = sorted({c.name for turn in t.gold for c in turn} - offered)
            if bad:
                raise ValueError(f"task {t.id!r} needs tools {bad} that are not offered ({tools})")

    async def _make_client(self, clock, retry, timeout):
        from reflrl.envs.client import RetryPolicy, ToolClient
        from reflrl.envs.tool_server import create_app

        kw: dict[str, Any] = {"ledger": self.ledger, "clock": clock}
        if retry is not None:
            kw["retry"] = retry if isinstance(retry, RetryPolicy) else RetryPolicy(**retry)
        if timeout is not None:
            kw["timeout"] = float(timeout)
        if self.server_url:
            return ToolClient.connect(self.server_url, **kw)
        self._app = create_app(clock=clock, ledger=self.ledger, default_seed=self.seed)
        return ToolClient.in_process(self._app, **kw)

    # ---- what TRL calls --------------------------------------------------------------------
    def __call__(self) -> ToolEnvironment:
        """A new environment instance (TRL calls this once per pooled rollout slot)."""
        env = self.environment_class(self, self._n_instances)
        self._n_instances += 1
        return env

    # ---- what the user passes to GRPOTrainer -----------------------------------------------
    def dataset(self, indices: Sequence[int] | None = None):
        """A ``datasets.Dataset`` with one row per task: ``prompt`` (system + user message) and
        ``task_index`` (reaches ``reset``). TRL repeats each row ``num_generations`` times, so the
        rollouts of a GRPO group share their task."""
        from datasets import Dataset

        idx = range(len(self.tasks)) if indices is None else indices
        rows = [{"prompt": [{"role": "system", "content": self.system_prompt},
                            {"role": "user", "content": self.tasks[i].query}],
                 "task_index": int(i)} for i in idx]
        return Dataset.from_list(rows)

    def reward(self, name: str = "binary") -> "RewardFunction":
        """The reward function of reflrl's reward ``name`` (``reflrl.envs.rewards.REWARDS``)."""
        return RewardFunction(name)

    def callback(self, echo: Callable[[str], Any] | None = print) -> "LedgerCallback":
        """A TrainerCallback logging the ledger's totals after every step."""
        return LedgerCallback(self, echo=echo)

    # ---- episodes and calls (run on the factory's own event loop thread) -------------------
    def _open(self, env: ToolEnvironment, data_seed: int, fault_seed: int) -> None:
        task = env.task
        assert task is not None and env.episode_id is not None
        self._runner.run(self._client.open_episode(
            env.episode_id, seed=data_seed, faults=self.plan, fault_seed=fault_seed,
            tools=[t["name"] for t in self.tools], initial_config=task.initial_config))
        self._open_envs[env.episode_id] = env

    def _close(self, env: ToolEnvironment) -> None:
        eid = env.episode_id
        if eid is not None and self._open_envs.pop(eid, None) is not None:
            self._runner.run(self._client.close_episode(eid))

    def _call(self, episode_id: str, call_index: int, name: str, arguments: dict[str, Any]):
        return self._runner.run(self._client.call(episode_id, step=0, call_index=call_index,
                                                  name=name, arguments=dict(arguments)))

    def flush(self) -> None:
        """Close every open episode (a remote server's injected faults reach the ledger then);
        environments keep their state and open a new episode at their next reset."""
        for env in list(self._open_envs.values()):
            self._close(env)

    def close(self) -> None:
        """Close the episodes, the client (unless it was passed in) and the event loop thread
        (idempotent)."""
        if self._runner.loop is not None:
            self.flush()
            if self._owns_client:
                self._runner.run(self._client.aclose())
        self._runner.stop()


# ---------------------------------------------------------------------------------- rewards
def first_message_calls(messages: Sequence[dict[str, Any]] | str) -> ParseResult:
    """The calls of the first assistant message of a TRL completion as a reflrl ParseResult.

    TRL parsed the message with the tokenizer's response schema: its ``tool_calls`` are well-formed
    calls. A message without ``tool_calls`` is read with reflrl's hermes parser, so leftover
    ``<tool_call>`` markup that TRL could not parse is a format error, as in reflrl's own env."""
    if isinstance(messages, str):
        return parsing.parse(messages, "hermes")
    msg = next((m for m in messages if m.get("role") == "assistant"), None)
    if msg is None:
        return ParseResult(ok=True, calls=[], content="")
    content = msg.get("content") if isinstance(msg.get("content"), str) else ""
    raw = msg.get("tool_calls") or []
    if not raw:
        return parsing.parse(content, "hermes")
    calls = []
    for tc in raw:
        fn = tc.get("function", tc) if isinstance(tc, dict) else {}
        args = fn.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return ParseResult(ok=False, content=content, error="tool call arguments are not JSON")
        if not isinstance(fn.get("name"), str) or not isinstance(args, dict):
            return ParseResult(ok=False, content=content, error="malformed tool call")
        calls.append(ToolCall(fn["name"], args))
    return ParseResult(ok=True, calls=calls, content=content)


def _masked(env: Any) -> bool:
    return bool(getattr(env, "masked", False))


class RewardFunction:
    """A TRL reward function computing reflrl's reward ``name`` on the first assistant message
    against the task's gold calls; None for masked rollouts (see the module docstring).

    ``__name__`` (``reflrl_<name>``) is the column TRL logs it under."""

    def __init__(self, name: str = "binary") -> None:
        self.name = name
        self._fn = rewards.get_reward(name)
        self.__name__ = f"reflrl_{name}"

    def __call__(self, prompts=None, completions=None, environments=None, log_metric=None,
                 **kwargs: Any) -> list[float | None]:
        if environments is None:
            raise ValueError(f"{self.__name__} needs environment_factory=ToolEnvironmentFactory(...)"
                             " (TRL passes the rollouts' environments as 'environments')")
        out: list[float | None] = []
        for completion, env in zip(completions, environments, strict=True):
            task = getattr(env, "task", None)
            if _masked(env) or task is None:
                out.append(None)
                continue
            gold = list(task.gold[0]) if task.gold else []
            out.append(float(self._fn(first_message_calls(completion), gold).total))
        if log_metric is not None and out:
            log_metric("reflrl/masked_fraction", sum(_masked(e) for e in environments) / len(out))
        return out


def mask_env_faults(fn: Callable[..., list]) -> Callable[..., list]:
    """Wrap a TRL reward function so that it returns None for masked rollouts (TRL then leaves a
    rollout for which every reward function returned None out of the loss)."""
    def wrapped(*args: Any, environments=None, **kwargs: Any) -> list:
        out = fn(*args, environments=environments, **kwargs)
        if environments is None:
            return out
        return [None if _masked(e) else r for r, e in zip(out, environments, strict=True)]

    wrapped.__name__ = getattr(fn, "__name__", "reward")
    return wrapped


# ---------------------------------------------------------------------------------- callback
class LedgerCallback(TrainerCallback):
    """After every optimizer step: close the step's episodes and record (and echo) the ledger's
    totals: calls, billed attempts, retries, recovered / given-up calls, faults by kind (observed
    and injected). ``history`` holds one dict per step; the factory closes at the end."""

    def __init__(self, factory: ToolEnvironmentFactory, echo: Callable[[str], Any] | None = print):
        self.factory = factory
        self.echo = echo
        self.history: list[dict[str, Any]] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.factory.flush()
        totals = self.factory.ledger.totals()
        self.history.append({"step": int(state.global_step), **asdict(totals)})
        if self.echo is not None:
            inj = ", ".join(f"{k}={v}" for k, v in sorted(totals.injected_by_kind.items())) or "none"
            self.echo(f"[reflrl] step {state.global_step}: {totals.format()}; injected: {inj}")
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.factory.flush()
        return control


__all__ = ["ToolEnvironmentFactory", "ToolEnvironment", "RewardFunction", "LedgerCallback",
           "environment_class", "use_tool_chat_template", "mask_env_faults",
           "first_message_calls", "DEFAULT_TOOLS", "SYSTEM_PROMPT"]
