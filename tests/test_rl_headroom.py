"""scripts/rl_headroom.py and reflrl.heldout.sampled_correct: where sampling-based RL can find a signal."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from reflrl.cli import main as cli_main
from reflrl.engines.transformers_engine import Sample
from reflrl.envs.parsing import format_calls
from reflrl.envs.prompts import build_messages
from reflrl.envs.types import Task, ToolCall
from reflrl.heldout import sampled_correct
from reflrl.models import load_model
from reflrl.rollout import RolloutSpec, render_prompt

from script_loader import load_script

ROOT = Path(__file__).resolve().parent.parent


def test_headroom_row_separates_reachable_greedy_failures_from_all_wrong_groups():
    hr = load_script("rl_headroom")
    r = hr.headroom_row(1.0, [True, True, False, False, False], [8, 3, 0, 2, 8], n=8)
    assert r["greedy_wrong"] == 3 and r["greedy_wrong_reachable"] == 2  # tasks 4 and 5, not task 3
    assert r["mixed_groups"] == 2  # counts 3 and 2; 8, 0 and 8 give GRPO no gradient
    assert r["sampled_accuracy"] == pytest.approx(21 / 40)
    assert r["sampled_accuracy_greedy_right"] == pytest.approx(11 / 16)
    assert r["sampled_accuracy_greedy_wrong"] == pytest.approx(10 / 24)
    assert "2 of 3" in hr.row_line(r)
    with pytest.raises(ValueError, match="3 greedy verdicts but 2"):
        hr.headroom_row(1.0, [True, False, False], [1, 2], n=8)


class CountingEngine:
    """Answers a prompt with its task's gold call on the first ``k`` times it is asked, then with a wrong
    call (a scripted policy: what is checked is the counting and the order, not a model)."""

    def __init__(self, tok, gold_by_prompt, k_by_prompt):
        self.tok, self.gold, self.k = tok, gold_by_prompt, k_by_prompt
        self.seen: dict[tuple, int] = {}

    def generate(self, prompts, n=1, max_new_tokens=256, temperature=1.0, top_p=1.0, stop_ids=None, seed=0,
                 stop_when=None):
        assert n == 1
        out = []
        for i, p in enumerate(prompts):
            key = tuple(p)
            self.seen[key] = self.seen.get(key, 0) + 1
            text = self.gold[key] if self.seen[key] <= self.k[key] else format_calls([ToolCall("nope", {})], "hermes")
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            out.append(Sample(i, list(p), ids, [0.0] * len(ids), "stop"))
        return out


def test_sampled_correct_counts_each_tasks_right_answers_in_task_order():
    _, tok = load_model("tiny-random", dtype="float32", trainable="none")
    # queries of different lengths: the batches are sorted by prompt length, the counts must come back in task order
    tasks = [Task(id=f"t{i}", kind="single", query="weather " + "please " * (5 - i) + f"in city {i}?", tools=[],
                  gold=[[ToolCall("get_weather", {"city": f"C{i}"})]]) for i in range(4)]
    msgs = lambda t: build_messages(t, style="compact", fmt="hermes")  # noqa: E731
    keys = [tuple(render_prompt(tok, msgs(t))) for t in tasks]
    want = [3, 0, 4, 1]
    eng = CountingEngine(tok, {k: format_calls(t.gold[0], "hermes") for k, t in zip(keys, tasks)}, dict(zip(keys, want)))
    got = sampled_correct(eng, tok, tasks, msgs, RolloutSpec(max_new_tokens=64), n=4, temperature=1.0, batch_size=3)
    assert got == want
    assert all(eng.seen[k] == 4 for k in keys)  # n samples of every task, no more
    with pytest.raises(ValueError, match="n must be >= 1"):
        sampled_correct(eng, tok, tasks, msgs, n=0)


def test_the_script_reads_a_run_folders_warm_up_checkpoint(tmp_path, capsys):
    args = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--name", "w", "--no-report",
            "--set", f"train.out_dir={tmp_path}", "--set", "train.steps=0", "--set", "warmup.enabled=true",
            "--set", "warmup.steps=1", "--set", "data.n_test=3"]
    assert cli_main(["train", *args]) == 0
    hr = load_script("rl_headroom")
    out = tmp_path / "h.json"
    assert hr.main([str(tmp_path / "w"), "--n", "2", "--temperatures", "1.0,0.5", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["greedy"]) == 3 and [r["temperature"] for r in res["rows"]] == [1.0, 0.5]
    assert all(r["tasks"] == 3 and r["n"] == 2 and r["greedy_wrong"] == 3 - sum(res["greedy"]) for r in res["rows"])
    assert "greedy accuracy" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        hr.main([str(tmp_path / "w"), "--checkpoint", "step_000099"])
