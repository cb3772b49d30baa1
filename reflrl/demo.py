"""``reflrl env demo``: a model answers a few tasks against the fault-injecting tools, every call shown.

It lives in the core (it loads a model and an engine); the envs it drives never import the core.

A model (default: the embedded SmolLM2-135M-Instruct) answers a handful of synthetic tasks in
``reflrl/ToolCall-v0`` (or the multi-turn env); every assistant message is parsed and its calls run
against the tool server with the chosen fault plan; each call, fault, retry and triage is printed,
then the fault ledger's totals and its reconciliation of injected vs observed faults.

A 135M model rarely calls a tool zero-shot, so by default each task is followed by a *gold replay*
(clearly labelled): the task's gold calls go through the same faulty tools in a fresh episode, which
shows the fault machinery (retries, Retry-After waits, give-ups, masking) on every task.

The module imports no torch at import time: the model and engine load inside :func:`load_generator`.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable, TextIO

from reflrl.envs.types import Task

Generate = Callable[[list[dict[str, Any]]], str]


def load_generator(model: str, *, dtype: str = "auto", max_new_tokens: int = 128,
                   temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> Generate:
    """Load ``model`` (``reflrl.models.load_model``) and return ``generate(messages) -> text``.

    The messages are rendered with the tokenizer's chat template (generation prompt added) and
    decoded by ``reflrl.engines.transformers_engine.TransformersEngine`` (greedy when ``temperature == 0``); special
    tokens are stripped from the returned text.
    """
    from reflrl import models
    from reflrl.engines.transformers_engine import TransformersEngine

    net, tok = models.load_model(model, dtype=dtype, seed=seed)
    net.eval()
    engine = TransformersEngine(net, tok, max_batch_size=1)
    calls = {"n": 0}

    def generate(messages: list[dict[str, Any]]) -> str:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        samples = engine.generate([ids], n=1, max_new_tokens=max_new_tokens,
                                  temperature=temperature, top_p=top_p, seed=seed + calls["n"])
        calls["n"] += 1
        return tok.decode(samples[0].token_ids, skip_special_tokens=True)

    return generate


def _fmt_args(args: dict[str, Any], limit: int = 80) -> str:
    s = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False, default=str)}" for k, v in args.items())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _short(text: Any, limit: int = 100) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def format_step(info: dict[str, Any], reward: float, *, indent: str = "    ") -> list[str]:
    """Human-readable lines for one env step: each call with its faults, retries and triage."""
    lines = []
    calls = info.get("calls") or []
    if not info.get("parse_ok", True):
        lines.append(f"{indent}parse failed: {_short(info.get('parse_error'))}")
    elif not calls:
        lines.append(f"{indent}no tool call (a text answer)")
    events_by_call: dict[int, list[dict[str, Any]]] = {}
    for ev in info.get("fault_events") or []:
        events_by_call.setdefault(int(ev.get("call_index", 0)), []).append(ev)
    for res in info.get("tool_results") or []:
        i = res["call_index"]
        call = calls[i] if i < len(calls) else {"name": res["name"], "arguments": {}}
        lines.append(f"{indent}call {i}: {call['name']}({_fmt_args(call.get('arguments') or {})})")
        for ev in events_by_call.get(i, []):
            status = f" HTTP {ev['status']}" if ev.get("status") else ""
            detail = f" ({ev['detail']})" if ev.get("detail") else ""
            lines.append(f"{indent}  attempt {ev.get('attempt')}: fault {ev.get('kind')}{status}{detail}")
        attempts = res.get("attempts", 1)
        retry = f", {attempts - 1} retr{'y' if attempts == 2 else 'ies'}" if attempts > 1 else ""
        if res["ok"]:
            outcome = f"ok -> {_short(json.dumps(res.get('result'), ensure_ascii=False, default=str), 70)}"
        else:
            outcome = f"{res['triage']}: {_short(res.get('error'), 70)}"
        verdict = {"ok": "ok", "env_fault": "ENV FAULT (retries gave up)",
                   "policy_error": "POLICY ERROR", "tool_bug": "TOOL BUG (not retried)"}.get(res["triage"], res["triage"])
        took = f", {res['elapsed_s']:g}s" if res.get("elapsed_s") else ""
        lines.append(f"{indent}  => triage {verdict}{retry}, billed {attempts}{took}: {outcome}")
    for c in info.get("skipped_calls") or []:
        lines.append(f"{indent}call {c['name']} not executed (too many calls in one message)")
    parts = ", ".join(f"{k}={v:g}" if isinstance(v, (int, float)) else f"{k}={v}"
                      for k, v in (info.get("reward_parts") or {}).items())
    lines.append(f"{indent}reward {reward:g} ({parts or 'no parts'}), correct={info.get('correct')}, "
                 f"env faults: {info.get('env_fault_treatment')}, masked={info.get('masked')}, "
                 f"billed calls {info.get('billed_calls')}")
    return lines


def run_episode(env: Any, generate: Generate, *, task: Task | None = None, seed: int | None = None,
                out: TextIO | None = None, label: str = "model",
                header: Callable[[dict[str, Any]], None] | None = None,
                policy_for_task: Callable[[Task], Generate] | None = None) -> dict[str, Any]:
    """Run one episode with ``generate`` as the policy; print every step to ``out``.

    ``task`` None = the env draws one; ``header(reset_info)`` is called after the reset;
    ``policy_for_task(task)``, when given, builds the episode's policy instead of ``generate``.

    Returns {"reward" (episode return), "correct", "masked", "steps", "billed_calls"}.
    """
    options = {"task": task} if task is not None else None
    obs, info = env.reset(seed=seed, options=options)
    if header is not None:
        header(info)
    if policy_for_task is not None:
        generate = policy_for_task(info["task"])
    messages = info["messages"]
    total, steps = 0.0, 0
    while True:
        t0 = time.perf_counter()
        text = generate(messages)
        dt = time.perf_counter() - t0
        steps += 1
        _print(out, f"  [{label}] step {steps} ({dt:.1f}s): {_short(text, 160)!r}")
        obs, reward, terminated, truncated, info = env.step(text)
        total += float(reward)
        for line in format_step(info, reward):
            _print(out, line)
        messages = info["messages"]
        if terminated or truncated:
            if truncated:
                _print(out, "    (truncated: step limit reached)")
            return {"reward": total, "correct": bool(info.get("correct")),
                    "masked": bool(info.get("masked")), "steps": steps,
                    "billed_calls": int(info.get("episode_billed_calls", 0))}


def gold_policy(task: Task, fmt: str, multi_turn: bool) -> Generate:
    """A scripted policy that answers with the task's gold calls (see ``tool_env.gold_actions``)."""
    from reflrl.envs.tool_env import gold_actions

    actions = iter(gold_actions(task, fmt, multi_turn=multi_turn))

    def generate(_messages: list[dict[str, Any]]) -> str:
        return next(actions, "Done.")

    return generate


def main_demo(args: Any, *, faults: str, out: TextIO | None = None,
              generate: Generate | None = None,
              policy_for_task: Callable[[Task], Generate] | None = None) -> int:
    """The ``reflrl env demo`` command (``args`` from ``reflrl.cli``); returns the exit status.

    ``generate`` (one policy for all episodes) or ``policy_for_task`` (a policy per task, e.g.
    :func:`gold_policy`) replace the model; otherwise ``args.model`` is loaded.
    """
    import gymnasium

    import reflrl.envs as envs_pkg

    env_id = envs_pkg.MULTI_TURN_ID if args.multi_turn else envs_pkg.SINGLE_TURN_ID
    kwargs: dict[str, Any] = dict(dataset=args.dataset, split=args.split, faults=faults,
                                  seed=args.seed, parser=args.parser, prompt_style=args.prompt_style,
                                  reward=args.reward, server_url=args.server_url)
    if args.max_steps is not None:
        kwargs["max_steps"] = args.max_steps
    if args.retries is not None:
        kwargs["retry"] = {"max_attempts": int(args.retries)}
    try:
        env = gymnasium.make(env_id, **kwargs)
    except (ValueError, TypeError, FileNotFoundError) as e:  # a bad flag value: say which
        _print(sys.stderr, f"reflrl: error: {e}")
        return 2
    u = env.unwrapped
    _print(out, f"reflrl env demo: {env_id}, faults={faults}, seed={args.seed}, "
                f"dataset={args.dataset}/{args.split} ({len(u.tasks)} tasks), parser={args.parser}, "
                f"reward={args.reward}")
    _print(out, "tools: " + ("in-process server, virtual clock (Retry-After, backoff and latency "
                             "waits cost no wall time; times shown are virtual)"
                             if not args.server_url else f"{args.server_url} (real HTTP, wall time)"))
    if generate is None and policy_for_task is None:
        t0 = time.perf_counter()
        _print(out, f"loading model {args.model} ({args.dtype}) ...")
        generate = load_generator(args.model, dtype=args.dtype, max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        _print(out, f"model loaded in {time.perf_counter() - t0:.1f}s")
    results, gold_results = [], []
    try:
        for k in range(args.n_tasks):
            def header(info: dict[str, Any], k: int = k) -> None:
                task = info["task"]
                _print(out, "")
                _print(out, f"task {k + 1}/{args.n_tasks}: {task.id} ({task.kind}, "
                            f"{len(task.tools)} tools offered)")
                _print(out, f"  user: {_short(task.query, 200)}")
                for t, turn in enumerate(task.turns if args.multi_turn else []):
                    _print(out, f"  user turn {t + 2}: {_short(turn, 160)}")
                for t, calls in enumerate(task.gold[: 1 + (len(task.turns) if args.multi_turn else 0)]):
                    gold = "; ".join(f"{c.name}({_fmt_args(c.arguments, 60)})" for c in calls)
                    _print(out, f"  gold (turn {t + 1}): {gold or '(no call)'}")

            # the first reset seeds the env; later resets continue its episode counter
            res = run_episode(env, generate, seed=args.seed if k == 0 else None, out=out,
                              label="model", header=header, policy_for_task=policy_for_task)
            results.append(res)
            if args.gold_replay:
                task = u.episode_task
                g = run_episode(env, gold_policy(task, args.parser, args.multi_turn), task=task,
                                out=out, label="gold replay")
                gold_results.append(g)
        env.close()  # closing the last episode brings a remote server's injected faults home
        _print(out, "")
        _summary(out, "model", results)
        if gold_results:
            _summary(out, "gold replay", gold_results)
        ledger = u.ledger
        if ledger is not None:
            _print(out, "fault ledger totals (all episodes above): " + ledger.totals().format())
            rep = ledger.reconcile()
            _print(out, "injected vs observed:")
            for line in rep.format().splitlines():
                _print(out, "  " + line)
    finally:
        env.close()
    return 0


def _summary(out: TextIO | None, label: str, results: list[dict[str, Any]]) -> None:
    n = max(1, len(results))
    _print(out, f"{label}: mean reward {sum(r['reward'] for r in results) / n:.3f}, "
                f"correct {sum(r['correct'] for r in results)}/{len(results)}, "
                f"masked {sum(r['masked'] for r in results)}/{len(results)}, "
                f"billed tool calls {sum(r['billed_calls'] for r in results)}")


def _print(out: TextIO | None, line: str) -> None:
    print(line, file=out, flush=True)


__all__ = ["load_generator", "run_episode", "format_step", "gold_policy", "main_demo"]
