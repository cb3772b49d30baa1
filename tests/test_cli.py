"""The ``reflrl`` command line: faults list, bad --faults, env check, tools serve, env demo."""
from __future__ import annotations

import argparse
import io
import subprocess
import sys
from pathlib import Path

import gymnasium
import pytest

import reflrl.envs
from reflrl.cli import build_parser, main
from reflrl import demo
from reflrl.envs.tool_env import gold_actions
from reflrl.faults import KIND_NAMES

BIN = Path(sys.executable).with_name("reflrl")


def test_faults_list_prints_every_kind(capsys):
    assert main(["faults", "list"]) == 0
    out = capsys.readouterr().out
    for kind in KIND_NAMES:
        assert kind in out
    assert "Retry-After" in out and "kind=prob" in out


def test_console_script_faults_list():
    r = subprocess.run([str(BIN), "faults", "list"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "rate_limit" in r.stdout and "schema_drift" in r.stdout


@pytest.mark.parametrize("spec,named", [
    ("ratelimit=0.1", "ratelimit"),
    ("rate_limit=1.5", "rate_limit=1.5"),
    ("rate_limit=0.1,timeout=abc", "timeout=abc"),
])
def test_bad_faults_spec_exits_2_naming_the_entry(capsys, spec, named):
    assert main(["env", "demo", "--faults", spec]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_bad_faults_spec_console_script_no_traceback():
    r = subprocess.run([str(BIN), "env", "demo", "--faults", "rate_limit=0.1,bogus=0.2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "bogus" in r.stderr and "Traceback" not in r.stderr


def test_every_flag_has_help_text():
    def walk(p: argparse.ArgumentParser):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    yield from walk(sub)
            elif a.dest not in ("help", "version", "train_args"):
                yield p.prog, a

    missing = [f"{prog} {a.option_strings or a.dest}" for prog, a in walk(build_parser()) if not a.help]
    assert not missing, missing


def test_env_check_ok_for_both_ids(capsys):
    assert main(["env", "check"]) == 0
    out = capsys.readouterr().out
    for env_id in reflrl.envs.ENV_IDS:
        assert f"OK   {env_id}" in out


def test_tools_serve_refuses_non_loopback(capsys):
    assert main(["tools", "serve", "--host", "0.0.0.0"]) == 2
    assert "loopback" in capsys.readouterr().err


def test_tools_serve_answers_over_loopback_and_env_runs_against_it():
    """`reflrl tools serve` in a subprocess; the env talks to it over a real socket."""
    proc = subprocess.Popen([str(BIN), "tools", "serve", "--port", "0", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line, (line, proc.poll())
        url = line.split()[3]
        from reflrl.envs.tools.catalog import build_catalog
        from reflrl.envs.types import Task, ToolCall

        cat = build_catalog()
        task = Task("w", "Weather in Lima?", [cat["get_current_weather"].schema()],
                    [[ToolCall("get_current_weather", {"city": "Lima"})]])
        env = gymnasium.make(reflrl.envs.SINGLE_TURN_ID, dataset=[task], server_url=url,
                             faults="connection=0.5", seed=3, retry={"base_s": 0.01, "cap_s": 0.02})
        try:
            seen = []
            for seed in range(6):
                env.reset(seed=seed)
                _, r, term, _, info = env.step(gold_actions(task)[0])
                assert term and r == 1.0
                seen += [e["kind"] for e in info["fault_events"]]
            assert "connection" in seen  # resets observed through the real socket
            assert env.unwrapped.ledger.reconcile().exact
        finally:
            env.close()
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _demo_args(**kw):
    ns = build_parser().parse_args(["env", "demo"])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_demo_prints_calls_faults_and_ledger_with_scripted_policy():
    """The demo loop with the scripted gold policy in place of the model (fast)."""
    out = io.StringIO()
    args = _demo_args(n_tasks=3, faults="rate_limit=0.3,server_error=0.3", seed=1, gold_replay=False)
    rc = demo.main_demo(args, faults=args.faults, out=out,
                        policy_for_task=lambda task: demo.gold_policy(task, "hermes", False))
    assert rc == 0
    text = out.getvalue()
    assert text.count("task ") >= 3 and "call 0:" in text
    assert "fault rate_limit HTTP 429" in text or "fault server_error HTTP 5" in text
    assert "triage ok" in text and "fault ledger totals" in text and "reconciled exactly" in text
    assert "model: mean reward 1.000, correct 3/3" in text


def test_demo_with_tiny_random_model(capsys):
    rc = main(["env", "demo", "--model", "tiny-random", "--n-tasks", "1", "--max-new-tokens", "8",
               "--faults", "rate_limit=0.5"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "task 1/1" in out and "[model] step 1" in out and "[gold replay] step 1" in out
    assert "fault ledger totals" in out


@pytest.mark.slow
def test_demo_with_embedded_model(capsys):
    rc = main(["env", "demo", "--n-tasks", "1", "--faults", "rate_limit=0.1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "smollm2" in out and "task 1/1" in out and "fault ledger totals" in out


def test_train_is_a_subcommand_of_the_one_cli(capsys):
    """'reflrl train' is parsed by the reflrl command's own tree (reflrl.cli.train), no second argparse."""
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: reflrl train" in out and "--print-config" in out and "--faults" in out
    assert main(["train", "--set", "algo.clip_hihg=0.3"]) == 2
    assert "clip_high" in capsys.readouterr().err