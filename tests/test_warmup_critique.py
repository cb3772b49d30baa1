"""The warm-up's critique-following examples (warmup.critique_share; reflrl.recovery.critique_examples):
q* of a corrupted gold call, as the RL phase's reflection retries build it, with a critique that names
the fix -> the gold call; seeded, policy errors only, the share honoured, counted in the summary, and
only the target trained."""
from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from doubles import ROOT, gold_text, tiny_cfg
from reflrl import config as C
from reflrl import sft
from reflrl.critic.rule import VALUE_LEVELS, _call_text
from reflrl.envs.parsing import format_calls, parse
from reflrl.envs.rewards import calls_match
from reflrl.envs.types import ToolCall
from reflrl.models import load_model
from reflrl.progress import Progress
from reflrl.recovery.critics import get_critic
from reflrl.recovery.critique_examples import CORRUPTIONS, corrupt, critique_count, critique_examples
from reflrl.recovery.reflection import RETRY_HEADER, EnvFeedback, Generation, reflect_and_retry
from reflrl.train.data import splits_from_config
from reflrl.train.setup import messages_fn
from reflrl.train.summary import format_warmup_examples
from reflrl.train.warmup import run_warmup

# words of a tool failure's, a fault's or an API change's critique (reflrl.critic.format.describe_env_fault)
FAULT_WORDS = ("retry", "fault", "HTTP", "rate limit", "timeout", "renamed", "moved", "no longer", "answered")


def _setup(tmp_path, n_train=40, **over):
    cfg = tiny_cfg(tmp_path, **{"data.n_train": n_train, **over})
    return cfg, splits_from_config(cfg.data)["train"], messages_fn(cfg)


def _examples(cfg, tasks, msgs, count, seed=3, reveal="call"):
    return critique_examples(tasks, messages_fn=msgs, critic=get_critic("rule", reveal=reveal, parser="hermes"),
                             fmt="hermes", count=count, seed=seed, mode=cfg.reflection.mode)


def _retry_prompt(cfg, task, q, attempt_text):
    """The q* the RL phase's reflection retry builds for this failed attempt (reflect_and_retry)."""
    seen = []

    def generate(q_star):
        seen.append(q_star)
        return Generation(gold_text(task))

    def step_env(text):
        return EnvFeedback(parse=parse(text, "hermes"))

    asyncio.run(reflect_and_retry(generate, get_critic("rule", reveal="call", parser="hermes"), step_env, task,
                                  Generation(attempt_text), 1, first_feedback=step_env(attempt_text), messages=q,
                                  mode=cfg.reflection.mode))
    return seen[0]


def test_critique_examples_are_real_retry_prompts_of_corrupted_gold_calls(tmp_path):
    """Each example: the attempt is the gold call made wrong (it does not match), the feedback is the rule
    critic's and names the fix (the whole expected call), q* is exactly the retry prompt a reflection
    retry builds for that attempt, the target is the gold call, and q itself never holds the answer."""
    cfg, tasks, msgs = _setup(tmp_path)
    ex = _examples(cfg, tasks, msgs, count=30)
    assert len(ex) == 30 and len({e.task.id for e in ex}) == 30  # each task once before any twice
    assert set(Counter(e.corruption for e in ex)) == set(CORRUPTIONS)
    for e in ex:
        gold = list(e.task.gold[0])
        assert e.gold == gold and not calls_match(e.attempt, gold)
        text = format_calls(e.attempt, "hermes").strip()
        assert not calls_match(list(parse(text, "hermes").calls), gold)  # the attempt as q* shows it is wrong
        assert "; ".join(_call_text(g) for g in gold) in e.feedback  # names the fix
        q = msgs(e.task)
        assert e.messages == _retry_prompt(cfg, e.task, q, text)  # the RL phase's own q*
        retry = e.messages[-1]["content"]
        assert retry.startswith(RETRY_HEADER) and f"Attempt 1: {text}\nFeedback: {e.feedback}" in retry
        assert e.messages[0] == q[0] and gold_text(e.task) not in q[-1]["content"]


def test_critique_examples_are_seeded_and_show_no_tool_error_fault_or_api_change(tmp_path):
    cfg, tasks, msgs = _setup(tmp_path)
    a, b, c = (_examples(cfg, tasks, msgs, count=40, seed=s) for s in (3, 3, 4))
    assert [e.messages for e in a] == [e.messages for e in b]
    assert [e.messages for e in a] != [e.messages for e in c]
    for e in a + c:
        assert not sft.shows_fault(e.messages)
        assert all(m["role"] != "tool" for m in e.messages)
        assert not any(w.lower() in e.feedback.lower() for w in FAULT_WORDS), e.feedback


def test_corrupt_makes_each_mistake_or_says_none_applies():
    gold = [ToolCall("a", {"x": 1, "y": "b"}), ToolCall("c", {"z": True})]
    for kind in CORRUPTIONS:
        for seed in range(5):
            made = corrupt(gold, ["a", "c", "d"], random.Random(seed), {"y": ["b", "q"]}, kind=kind)
            assert made is not None and made[0] == kind and not calls_match(made[1], gold), (kind, seed)
    one = [ToolCall("a", {})]
    assert corrupt(one, ["a"], random.Random(0)) is None  # one tool offered, no argument to change
    assert corrupt(one, ["a", "b"], random.Random(0)) == ("wrong_tool", [ToolCall("b", {})])
    assert gold == [ToolCall("a", {"x": 1, "y": "b"}), ToolCall("c", {"z": True})]  # not modified


def _warmup(tmp_path, share, steps=3):
    cfg, tasks, msgs = _setup(tmp_path, n_train=12, **{"warmup.enabled": "true", "warmup.steps": steps,
                                                        "warmup.batch_size": 2, "warmup.critique_share": share})
    model, tok = load_model("tiny-random", dtype="float32", trainable="all", seed=0)
    return run_warmup(cfg, model=model, tokenizer=tok, train_tasks=tasks, messages=msgs, fmt="hermes",
                      format_rate_before=(0.0, "test"), over_budget=lambda s: False, reserve_s=0.0,
                      progress=Progress(enabled=False), log=lambda s, m: None, say=lambda s: None)


@pytest.mark.parametrize("share", [0.5, 0.25])
def test_the_warm_up_honours_the_share_and_counts_both_kinds(tmp_path, share):
    out = _warmup(tmp_path, share)
    d, k = out["demonstrations"], out["critique_examples"]
    assert d == 12 and k == critique_count(share, d) and k / (d + k) == pytest.approx(share, abs=0.5 / (d + k))
    assert out["demonstrations_with_fault"] == 0
    trained = out["sft_trained_by_kind"]
    assert sum(trained.values()) == 3 * 2 and set(trained) <= {"demonstration", "critique"}
    line = format_warmup_examples(out)
    assert f"{d} gold answers" in line and f"{k} critique-following examples" in line and "0 showed a fault" in line


def test_share_zero_gives_demonstrations_only(tmp_path):
    out = _warmup(tmp_path, 0.0, steps=2)
    assert out["critique_examples"] == 0 and out["sft_trained_by_kind"] == {"demonstration": 4}
    assert "critique" not in format_warmup_examples(out)


def test_only_the_gold_target_carries_loss_under_the_retry_prompt(tmp_path):
    cfg, tasks, msgs = _setup(tmp_path)
    _, tok = load_model("tiny-random", dtype="float32", trainable="all", seed=0)
    e = _examples(cfg, tasks, msgs, count=1)[0]
    ex = sft.example_from_messages(e.messages, e.gold, tok, "hermes", e.task.id, kind="critique")
    demo = sft.build_examples([e.task], tok, msgs)[0]
    assert ex.kind == "critique" and demo.kind == "demonstration" and not ex.shows_fault
    assert ex.answer_ids == demo.answer_ids and ex.prompt_ids != demo.prompt_ids  # same target, q* not q
    assert tok.decode(ex.answer_ids[:-1]) == gold_text(e.task) and ex.answer_ids[-1] == tok.eos_token_id
    assert RETRY_HEADER in tok.decode(ex.prompt_ids)
    batch = sft.collate([ex, demo], sft.sft_pad_id(tok))
    mask, ids = batch["response_mask"][0], batch["input_ids"][0]
    P, A = len(ex.prompt_ids), len(ex.answer_ids)
    assert mask[:P].sum() == 0 and mask[P:P + A].all() and mask[P + A:].sum() == 0
    assert ids[mask.bool()].tolist() == ex.answer_ids


def test_config_default_and_checks():
    cfg = C.load_config(ROOT / "configs" / "default.yaml")
    assert cfg.warmup.critique_share == 0.0 and cfg.warmup.critique_reveal == "call"  # the main job: gold only
    assert C.load_config(ROOT / "configs" / "api_changes.yaml").warmup.critique_share == 0.5
    for bad in ({"warmup.critique_share": 1.0}, {"warmup.critique_share": -0.1}, {"warmup.critique_reveal": "query"}):
        with pytest.raises(C.ConfigError, match="warmup.critique_"):
            C.load_config(ROOT / "configs" / "default.yaml", [f"{k}={v}" for k, v in bad.items()])
    for level in VALUE_LEVELS:  # the config's choices are the critic's levels that name the fix
        C.load_config(ROOT / "configs" / "default.yaml", [f"warmup.critique_reveal={level}"])
    with pytest.raises(ValueError):
        critique_count(1.0, 10)


def test_a_renamed_task_renames_one_name_in_its_tool_list_and_its_gold_alike():
    import random

    from reflrl.envs.prompts import tool_schema
    from reflrl.recovery.critique_examples import renamed_task
    from reflrl.train.data import splits_from_config
    from reflrl import config as C

    cfg = C.load_config(None, ["data.kinds=[single]", "data.n_train=64"])
    tasks = splits_from_config(cfg.data)["train"]
    rng = random.Random(0)
    kinds = set()
    for t in tasks:
        r = renamed_task(t, rng)
        assert r is not None and r.query == t.query
        old, new = r.meta["renamed"]["from"], r.meta["renamed"]["to"]
        assert old != new
        [g0], [g1] = t.gold[0], r.gold[0]
        names0 = {tool_schema(s)["name"]: tool_schema(s) for s in t.tools}
        names1 = {tool_schema(s)["name"]: tool_schema(s) for s in r.tools}
        if g0.name == old:                        # the tool was renamed: in the list and the gold call
            kinds.add("tool")
            assert g1.name == new and new in names1 and old not in names1 and new not in names0
            assert g1.arguments == g0.arguments
        else:                                     # a parameter of the gold call was renamed
            kinds.add("param")
            props = names1[g1.name]["parameters"]["properties"]
            assert new in props and old not in props and old in names0[g0.name]["parameters"]["properties"]
            assert g1.arguments == {(new if k == old else k): v for k, v in g0.arguments.items()}
        assert tool_schema(t.tools[0]) == names0[tool_schema(t.tools[0])["name"]]   # the task itself is unchanged
    assert kinds == {"tool", "param"}


def test_critique_examples_on_renamed_tasks_show_the_stale_call_and_target_the_renamed_one():
    from reflrl.critic.rule import RuleCritic
    from reflrl.envs.parsing import format_calls
    from reflrl.envs.prompts import build_messages
    from reflrl.recovery.critique_examples import STALE, critique_examples
    from reflrl.train.data import splits_from_config
    from reflrl import config as C

    cfg = C.load_config(None, ["data.kinds=[single]", "data.n_train=32"])
    tasks = splits_from_config(cfg.data)["train"]
    made = critique_examples(tasks, messages_fn=build_messages, critic=RuleCritic(reveal="answer"), fmt="hermes",
                             count=32, seed=3, rename_share=1.0)
    stale = [c for c in made if c.corruption == STALE]
    assert len(stale) >= 24
    for c in stale:
        new = c.task.meta["renamed"]["to"]
        assert new in json_of(c.gold) and new not in json_of(c.attempt)       # the attempt is the memorised call
        assert " ".join(format_calls(c.gold, "hermes").split()) in c.feedback  # the critique gives the call to make
        system = c.messages[0]["content"]
        assert new in system                                                   # the tool list has the new name
        assert "error" not in c.messages[-1]["content"].lower()                # no tool error shown


def json_of(calls):
    import json
    return json.dumps([[c.name, c.arguments] for c in calls])


def test_the_warmups_renamed_share_renames_that_share_of_its_tasks_seeded():
    from reflrl.train.data import splits_from_config
    from reflrl.train.warmup import RENAMED_SUFFIX, renamed_share
    from reflrl import config as C

    tasks = splits_from_config(C.load_config(None, ["data.kinds=[single]", "data.n_train=200"]).data)["train"]
    got = renamed_share(tasks, 0.5, seed=5)
    ids = [t.id for t in got]
    assert ids == [t.id for t in renamed_share(tasks, 0.5, seed=5)]
    n = sum(i.endswith(RENAMED_SUFFIX) for i in ids)
    assert 70 <= n <= 130 and len(got) == len(tasks)
    assert renamed_share(tasks, 0.0, seed=5) == list(tasks)
    with __import__("pytest").raises(Exception, match="rename_share"):
        C.load_config(None, ["warmup.rename_share=1.5"])
