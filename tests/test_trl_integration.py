"""reflrl.integrations.trl: TRL's GRPOTrainer training through reflrl's fault-injecting tools.

The training test runs the real GRPOTrainer (TRL 1.16, transformers generate, CPU) on the
``tiny-random`` model. A random model never writes a tool call, so its generation is steered with
transformers' own ``sequence_bias`` (a GenerationConfig option passed through GRPOConfig's
``generation_kwargs``): it writes ``<tool_call>{"name": "get_current_weather", ...}</tool_call>``
and, after the tool's answer, ends its turn. Everything after the tokens is real: TRL parses the
call, calls the environment's tool method, the method goes through reflrl's client to the in-process
tool server, which injects faults; the client retries them; the ledger records both sides.
"""
from __future__ import annotations

import asyncio
import math
import os

import pytest

pytest.importorskip("trl")

from transformers.utils import get_json_schema  # noqa: E402

from reflrl.envs.tools.catalog import build_catalog  # noqa: E402
from reflrl.envs.types import Task, ToolCall  # noqa: E402
from reflrl.integrations.trl import (ToolEnvironmentFactory, first_message_calls,  # noqa: E402
                                     mask_env_faults, use_tool_chat_template)

PARIS = ToolCall("get_current_weather", {"city": "Paris"})


def _paris_task(i: int = 0) -> Task:
    schema = build_catalog()["get_current_weather"].schema()
    return Task(id=f"paris-{i}", query="What's the weather in Paris right now?", tools=[schema],
                gold=[[PARIS]])


@pytest.fixture
def factory():
    f = ToolEnvironmentFactory(faults="rate_limit=0.5", seed=3, tasks=[_paris_task()])
    yield f
    f.close()


def test_tool_methods_carry_the_tool_servers_schemas():
    """Every catalogue tool becomes a method whose transformers JSON schema (what TRL renders into
    the prompt) has the server's parameter names, types, enums and required list."""
    cat = build_catalog()
    f = ToolEnvironmentFactory(tools=list(cat), seed=0)
    try:
        env = f()
        for name, spec in cat.items():
            got = get_json_schema(getattr(env, name))["function"]
            want = spec.parameters
            assert got["name"] == name and got["description"] == spec.description
            assert set(got["parameters"]["properties"]) == set(want["properties"]), name
            for p, ps in want["properties"].items():
                gp = got["parameters"]["properties"][p]
                assert gp["type"] == ps["type"], (name, p)
                assert gp.get("enum") == ps.get("enum"), (name, p)
            assert set(got["parameters"].get("required", [])) == set(want.get("required", []))
    finally:
        f.close()


def test_reserved_or_unknown_tool_names_are_refused():
    with pytest.raises(ValueError, match="unknown tools"):
        ToolEnvironmentFactory(tools=["no_such_tool"])
    from reflrl.integrations.trl import environment_class

    with pytest.raises(ValueError, match="cannot be a TRL environment method"):
        environment_class([{"name": "reset", "parameters": {}}])
    with pytest.raises(ValueError, match="needs tools"):
        ToolEnvironmentFactory(tools=["get_stock_quote"], tasks=[_paris_task()])


def test_calls_go_through_client_with_faults_retries_and_ledger(factory):
    env = factory()
    assert env.reset(task_index=0, prompt=[]) is None
    for _ in range(6):
        text = env.get_current_weather(city="Paris")
        assert '"name": "get_current_weather"' in text
    outs = env.outcomes
    assert len(outs) == 6 and all(o.ok for o in outs) == (not env.masked)
    t = factory.ledger.totals()
    assert t.calls == 6 and t.attempts == sum(o.attempts for o in outs)
    assert t.injected_by_kind.get("rate_limit", 0) > 0 and t.retries > 0
    assert factory.ledger.reconcile().exact


def test_unrecovered_fault_masks_the_rollout_and_rewards_return_none():
    f = ToolEnvironmentFactory(faults="server_error=1", seed=0, tasks=[_paris_task()],
                               retry={"max_attempts": 2})
    try:
        env, ok_env = f(), f()
        env.reset(task_index=0)
        text = env.get_current_weather(city="Paris")
        assert '"kind": "server_error"' in text and env.masked
        ok_env.reset(task_index=0)  # no call: nothing can fail
        completion = [{"role": "assistant", "content": "",
                       "tool_calls": [{"type": "function", "function": PARIS.to_dict()}]}]
        metrics = {}
        reward = f.reward("binary")
        out = reward(completions=[completion, completion], environments=[env, ok_env],
                     log_metric=metrics.__setitem__)
        assert out == [None, 1.0]
        assert metrics["reflrl/masked_fraction"] == 0.5
        user = mask_env_faults(lambda completions, **kw: [0.5] * len(completions))
        assert user(completions=[completion] * 2, environments=[env, ok_env]) == [None, 0.5]
        env.reset(task_index=0)  # a new rollout starts unmasked
        assert not env.masked and env.outcomes == []
    finally:
        f.close()


def test_first_message_calls_reads_trl_messages_and_malformed_markup():
    ok = first_message_calls([{"role": "assistant", "content": "",
                               "tool_calls": [{"type": "function", "function": PARIS.to_dict()}]}])
    assert ok.ok and ok.calls == [PARIS]
    text = first_message_calls([{"role": "assistant", "content": "It is sunny."}])
    assert text.ok and text.calls == []
    broken = first_message_calls([{"role": "assistant", "content": '<tool_call>{"name": "x"'}])
    assert not broken.ok


def test_chat_template_lets_trl_render_and_parse_tool_calls():
    from trl.chat_template_utils import add_response_schema, supports_tool_calling

    from reflrl.models import load_tokenizer

    tok = load_tokenizer("tiny-random")
    assert not supports_tool_calling(tok)  # SmolLM2's ChatML template drops tools
    tok = add_response_schema(use_tool_chat_template(tok))
    assert supports_tool_calling(tok)
    text = '<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parsed = tok.parse_response(tok(text + "<|im_end|>", add_special_tokens=False)["input_ids"])
    assert first_message_calls([parsed]).calls == [PARIS]


def _steer(tok, text: str) -> list:
    """sequence_bias entries that make any model write ``text`` then end its turn, and end the
    turn at once after a tool answer: each prefix of the text biases its next token, longer
    prefixes more, so the full-prefix match always wins."""
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    after_tool = tok("</tool_response><|im_end|>\n<|im_start|>assistant\n",
                     add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    entries = [[ids[:k + 1], 20.0 * (k + 1)] for k in range(len(ids))]
    entries.append([after_tool, 20.0 * (len(ids) + len(after_tool))])
    return entries


def test_grpo_trainer_trains_two_steps_through_faulty_tools(tmp_path):
    """Acceptance: two GRPOTrainer steps with faults at a high rate; faults are injected,
    retried and recorded (injected == observed), masked rollouts are unscorable, no tool raised."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl import GRPOConfig, GRPOTrainer

    from reflrl.models import load_model

    model, tok = load_model("tiny-random", dtype="float32")
    tok = use_tool_chat_template(tok)
    factory = ToolEnvironmentFactory(
        tools=["get_current_weather"],  # one tool: a short prompt (the vocabulary is 49,152)
        faults="rate_limit=0.3,server_error=0.15,connection=0.1,timeout=0.1:2s", seed=1,
        tasks=[_paris_task(i) for i in range(4)], retry={"max_attempts": 2}, timeout=1.0)
    callback = factory.callback(echo=None)
    args = GRPOConfig(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=64, max_tool_calling_iterations=1, bf16=False, use_cpu=True,
        gradient_checkpointing=False, logging_steps=1, report_to="none", save_strategy="no",
        learning_rate=1e-4, seed=0, disable_tqdm=True,
        generation_kwargs={"sequence_bias": _steer(tok, "<tool_call>\n" + (
            '{"name": "get_current_weather", "arguments": {"city": "Paris"}}') + "\n</tool_call>")})
    trainer = GRPOTrainer(model=model, processing_class=tok, args=args,
                          train_dataset=factory.dataset(), environment_factory=factory,
                          reward_funcs=[factory.reward("binary")], callbacks=[callback])
    seen = []  # (rewards_per_func rows, masked flags) of each generation batch
    calc = trainer._calculate_rewards

    def spy(*a, **kw):
        rows = calc(*a, **kw)
        seen.append((rows[:, 0].tolist(), [e.masked for e in trainer.environments]))
        return rows

    trainer._calculate_rewards = spy
    try:
        trainer.train()  # an exception anywhere (trainer, env, client) fails the test here
        totals = factory.ledger.totals()
        report = factory.ledger.reconcile()
    finally:
        factory.close()

    assert trainer.state.global_step == 2 and len(callback.history) == 2
    logs = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert len(logs) == 2 and all(h["tools/call_frequency"] >= 1.0 for h in logs)
    assert all(h["tools/failure_frequency"] == 0.0 for h in logs)  # no tool method raised
    assert totals.calls == 8 and sum(totals.injected_by_kind.values()) >= 5
    assert totals.retries > 0 and totals.recovered > 0 and totals.given_up > 0
    assert report.exact and sum(c.matched for c in report.per_kind.values()) == sum(
        totals.injected_by_kind.values())
    assert callback.history[-1]["attempts"] == totals.attempts
    assert callback.history[0]["calls"] == 4  # the ledger's totals after each step
    # masked rollouts (an unrecovered env fault) are unscorable: NaN reward, so TRL leaves them
    # out of the group baseline and gives them advantage 0; the others score the correct call
    flat = [(r, m) for rows, masks in seen for r, m in zip(rows, masks)]
    assert any(m for _, m in flat) and not all(m for _, m in flat)
    assert all(math.isnan(r) if m else r == 1.0 for r, m in flat)
    assert sum(h["reflrl/masked_fraction"] for h in logs) == pytest.approx(
        sum(m for _, m in flat) / len(flat) * len(logs))


def test_factory_works_from_inside_a_running_event_loop():
    """TRL calls tools synchronously; the factory runs them on its own loop thread, so a caller
    that already runs an event loop (a notebook) is fine."""
    f = ToolEnvironmentFactory(seed=0, tasks=[_paris_task()])
    try:
        async def main():
            env = f()
            env.reset(task_index=0)
            return env.get_current_weather(city="Paris")

        assert '"result"' in asyncio.run(main())
    finally:
        f.close()
