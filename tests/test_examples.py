"""The usage examples in examples/ run as a user runs them (no model needed for the proxy example)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_proxy_example_shows_injected_faults_and_replays_them_with_the_same_seed(capsys):
    ex = _load("proxy_faults")
    args = ["--faults", "rate_limit=0.5,server_error=0.3", "--requests", "6", "--seed", "3"]
    assert ex.main(args) == 0
    first = capsys.readouterr().out
    assert "injected faults:" in first and ("429" in first or "503" in first or "500" in first or "502" in first)
    ex.main(args)
    again = capsys.readouterr().out
    strip = lambda text: [line.split(": ", 1)[-1] for line in text.splitlines()[1:]]  # noqa: E731 (ports differ)
    assert strip(again) == strip(first)


def test_trl_example_parses_its_arguments():
    ex = _load("trl_grpo_faults")
    args = ex.parse_args(["--faults", "timeout=0.1", "--steps", "2"])
    assert args.faults == "timeout=0.1" and args.steps == 2
