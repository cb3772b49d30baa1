"""The main job on any CPU: precision from the hardware, a time budget that is only a guard, answers that
stop when complete, progress lines in logs, and an installed wheel that runs the same recipe."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

from reflrl import config as C
from reflrl import precision as P
from reflrl import train as T
from reflrl.cli import main as cli_main
from reflrl.train.batch import batch_logprobs, make_batch
from reflrl.train.step import policy_update
from reflrl.engines.transformers_engine import TransformersEngine, cut_at, Sample
from reflrl.envs.parsing import answer_complete, format_calls
from reflrl.envs.types import Task, ToolCall
from reflrl.heldout import evaluate
from reflrl.models import load_model
from reflrl.progress import Progress
from reflrl.rollout import RolloutSpec, answer_token_cap

ROOT = Path(__file__).resolve().parent.parent

AVX2 = P.CpuFeatures("AVX2", model="AMD EPYC (test)")
AVX512_BF16 = P.CpuFeatures("AVX512", avx512_bf16=True, model="Xeon (test)")
AMX = P.CpuFeatures("AVX512", amx=True, model="Sapphire Rapids (test)")


def _never(*_a):
    raise AssertionError("the micro-benchmark must not run here")


# ----------------------------------------------------------------------------- precision
def test_auto_takes_float32_on_avx2_without_benchmarking(tmp_path):
    c = P.resolve_dtype("auto", features=AVX2, bench=_never, cache=tmp_path / "p.json")
    assert c.dtype == "float32" and c.warning is None
    assert c.log_line() == "precision: float32 (auto: AVX2 CPU without native bfloat16, where bfloat16 is emulated)"


def _timing(decode: float, update: float) -> P.PrecisionTiming:
    """A measurement where bfloat16 takes ``decode`` / ``update`` times float32's time."""
    return P.PrecisionTiming(bf16_decode=decode * 0.01, fp32_decode=0.01, bf16_update=update * 0.1, fp32_update=0.1)


@pytest.mark.parametrize("features", [AVX512_BF16, AMX], ids=["avx512_bf16", "amx"])
def test_auto_takes_bfloat16_where_native_and_measured_faster(tmp_path, features):
    c = P.resolve_dtype("auto", features=features, bench=lambda: _timing(0.5, 0.7), cache=tmp_path / "p.json")
    assert c.dtype == "bfloat16" and c.bf16_slowdown == pytest.approx(0.56) and not c.cached
    assert "bfloat16 measured faster" in c.log_line() and "bfloat16 took 0.56x float32's time" in c.log_line()
    assert "decode 16x576x1536: 0.50x, update 2048x576x1536: 0.70x" in c.reason
    assert c.timing["decode_ratio"] == pytest.approx(0.5) and c.to_dict()["timing"]["update_ratio"] == pytest.approx(0.7)


def test_auto_takes_float32_where_native_bfloat16_measured_slower():
    """An AVX512-BF16 Xeon without AMX ran the recipe 1.2-1.4x faster in float32: auto must take it."""
    c = P.resolve_dtype("auto", features=AVX512_BF16, bench=lambda: _timing(1.3, 1.2), cache=False)
    assert c.dtype == "float32" and "float32 measured faster" in c.reason and "1.27x" in c.reason


def test_the_rule_weighs_decode_over_update_and_keeps_float32_within_five_percent():
    # faster at decode, slower at update: decode's weight (0.7) decides
    assert P.decide_dtype(_timing(0.8, 1.2)) == "bfloat16"  # 0.7*0.8 + 0.3*1.2 = 0.92
    assert P.decide_dtype(_timing(0.8, 1.4)) == "float32"  # 0.98
    assert P.decide_dtype(_timing(1.2, 0.4)) == "float32"  # 0.96: the update's gain does not outweigh decode
    assert P.decide_dtype(_timing(0.97, 0.97)) == "float32"  # within 5%: the more exact one
    c = P.resolve_dtype("auto", features=AMX, bench=lambda: _timing(0.97, 0.97), cache=False)
    assert c.dtype == "float32" and "bfloat16 less than 5% faster" in c.reason


class _FakeMachine:
    """A clock and matmuls whose seconds are scripted: ``cost[(dtype, kind)]``; the calls whose index
    (among all calls) is in ``slow`` take ``factor`` times longer -- a busy moment."""

    def __init__(self, cost, slow=(), factor=20.0):
        self.now, self.calls, self.cost, self.slow, self.factor = 0.0, [], cost, set(slow), factor

    def clock(self):
        return self.now

    def work(self, dtype, kind):
        self.calls.append((dtype, kind))
        self.now += self.cost[dtype, kind] * (self.factor if len(self.calls) - 1 in self.slow else 1.0)


COST = {("bfloat16", "decode"): 0.8, ("float32", "decode"): 1.0,
        ("bfloat16", "update"): 0.9, ("float32", "update"): 1.0}


def test_the_measurement_interleaves_and_keeps_each_sides_fastest_so_a_busy_moment_does_not_decide():
    quiet = _FakeMachine(COST)
    t = P.measure_precisions(repeats=3, clock=quiet.clock, work=quiet.work)
    assert t.decode_ratio == pytest.approx(0.8) and t.update_ratio == pytest.approx(0.9)
    timed = quiet.calls[4:]  # after one untimed warm-up of each product
    assert timed == [("bfloat16", "decode"), ("float32", "decode"), ("bfloat16", "update"), ("float32", "update")] * 3
    # the first timed bfloat16 decode (call 4) and update (call 6) happen while the machine is busy: 20x slower
    busy = _FakeMachine(COST, slow=(4, 6))
    t2 = P.measure_precisions(repeats=3, clock=busy.clock, work=busy.work)
    assert (t2.decode_ratio, t2.update_ratio) == pytest.approx((0.8, 0.9)) and P.decide_dtype(t2) == "bfloat16"
    # a busy float32 repeat cannot hand the choice to bfloat16 either
    slow_bf16 = {("bfloat16", "decode"): 1.2, ("float32", "decode"): 1.0, ("bfloat16", "update"): 1.2,
                 ("float32", "update"): 1.0}
    m = _FakeMachine(slow_bf16, slow=(5, 7))
    assert P.decide_dtype(P.measure_precisions(repeats=3, clock=m.clock, work=m.work)) == "float32"
    # with one repeat the same busy moment would have decided: the repeats are what make it stable
    m1 = _FakeMachine(slow_bf16, slow=(5, 7))
    assert P.decide_dtype(P.measure_precisions(repeats=1, clock=m1.clock, work=m1.work)) == "bfloat16"


def test_the_measurement_is_cached_per_cpu_model(tmp_path, monkeypatch):
    cache = tmp_path / "p.json"
    calls = []

    def bench():
        calls.append(1)
        return _timing(0.6, 0.8)

    c = P.resolve_dtype("auto", features=AVX512_BF16, bench=bench, cache=cache)
    assert c.dtype == "bfloat16" and not c.cached and len(calls) == 1
    stored = json.loads(cache.read_text())
    (key, entry), = stored.items()
    assert "Xeon (test)" in key and f"torch={torch.__version__}" in key and "AVX512" in key
    assert entry["dtype"] == "bfloat16" and entry["ratio"] == pytest.approx(0.66)
    # the same CPU model: read, not measured, the same decision and reason -- at another thread count too
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    again = P.resolve_dtype("auto", features=AVX512_BF16, bench=_never, cache=cache)
    assert again.cached and again.dtype == c.dtype and again.reason == c.reason
    # an explicit bfloat16 on it reads the same measurement
    assert P.resolve_dtype("bfloat16", features=AVX512_BF16, bench=_never, cache=cache).cached
    # another CPU model measures anew, and both are kept
    other = P.CpuFeatures("AVX512", avx512_bf16=True, model="Xeon without AMX (test)")
    c2 = P.resolve_dtype("auto", features=other, bench=lambda: _timing(1.3, 1.2), cache=cache)
    assert not c2.cached and c2.dtype == "float32" and len(json.loads(cache.read_text())) == 2
    # a damaged cache file is measured over, not an error
    cache.write_text("{not json")
    assert not P.resolve_dtype("auto", features=AVX512_BF16, bench=bench, cache=cache).cached and len(calls) == 2


def test_an_explicit_float32_measures_nothing():
    c = P.resolve_dtype("float32", features=AMX, bench=_never, cache=False)
    assert c.dtype == "float32" and c.reason.startswith("as configured") and c.timing is None


def test_explicit_bfloat16_on_avx2_runs_with_a_warning_giving_the_measured_slowdown(tmp_path):
    c = P.resolve_dtype("bfloat16", features=AVX2, bench=lambda: P.PrecisionTiming(0.43, 0.01, 0.43, 0.01,
                                                                                    emulated=True), cache=False)
    assert c.dtype == "bfloat16"
    assert c.warning and "43.0x float32's time on a 256x576x1536 matmul (emulated)" in c.warning
    assert "about 43.0x slower" in c.warning and "model.dtype=auto" in c.warning
    err = io.StringIO()
    P.announce(c, file=err)
    assert "precision: bfloat16" in err.getvalue() and "warning:" in err.getvalue()


def test_unknown_dtype_names_the_choices():
    with pytest.raises(ValueError, match="auto, float32, bfloat16"):
        P.resolve_dtype("fp8", features=AVX2, bench=_never, cache=False)
    with pytest.raises(C.ConfigError, match="model.dtype"):
        C.load_config(None, ["model.dtype=half"])


def test_the_real_measurement_gives_positive_figures():
    """The real products, once each way (on an AVX2 CPU, bfloat16's are emulated: the probe only)."""
    t = P.measure_precisions(repeats=1, probe_only=not P.cpu_features().native_bf16)
    assert min(t.bf16_decode, t.fp32_decode, t.bf16_update, t.fp32_update) > 0 and t.ratio > 0


def test_an_explicit_bfloat16_on_an_avx2_cpu_measures_only_the_probe(tmp_path):
    m = _FakeMachine({("bfloat16", "probe"): 0.4, ("float32", "probe"): 0.01})
    t = P.measure_precisions(clock=m.clock, work=m.work, probe_only=True)
    assert {k for _, k in m.calls} == {"probe"} and t.emulated and t.ratio == pytest.approx(40.0)
    assert P.decide_dtype(t) == "float32"


def test_trainer_logs_and_summarises_its_precision(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(P, "cpu_features", lambda: AVX2)  # what auto reads on an AVX2 laptop
    cfg = C.load_config(ROOT / "configs" / "tiny.yaml", [f"train.out_dir={tmp_path}", "train.run_name=r",
                                                          "model.dtype=auto", "train.steps=1", "data.n_test=2"])
    s = T.train(cfg, tmp_path / "r", progress=False, quiet=False, report=False)
    out = capsys.readouterr().out
    assert "[reflrl] precision: float32 (auto: AVX2 CPU without native bfloat16, where bfloat16 is emulated)" in out
    assert s["precision"]["dtype"] == "float32" and s["precision"]["requested"] == "auto"
    assert "AVX2 CPU without native bfloat16" in s["precision"]["reason"]


def test_a_bfloat16_cpu_gets_one_precision_line_that_says_auto(tmp_path, monkeypatch, capsys):
    """On a CPU with native bfloat16 the policy loader resolved 'auto' and then asked the model loader for
    'bfloat16' by name, which resolved it again and logged a second line, "as configured" (seen on an
    AVX512-BF16 machine). One line, saying why, is what a user should read."""
    from reflrl.train.setup import load_policy

    monkeypatch.setattr(P, "cpu_features", lambda: AVX512_BF16)
    monkeypatch.setattr(P, "measure_precisions", lambda **_: _timing(0.5, 0.5))
    cfg = C.load_config(ROOT / "configs" / "tiny.yaml", ["model.dtype=auto", "model.trainable=all"])
    monkeypatch.setattr(P, "_cache_file", lambda: tmp_path / "precision.json")  # this fake CPU's verdict
    lines: list[str] = []
    model, _tok, choice, _s = load_policy(cfg, lines.append)
    err = capsys.readouterr().err
    assert choice.dtype == "bfloat16" and len(lines) == 1 and lines[0].startswith("precision: bfloat16 (auto")
    assert "precision:" not in err
    assert {p.dtype for p in model.parameters() if not p.requires_grad} <= {torch.bfloat16}


# ----------------------------------------------------------------------------- the time guard
def test_a_budget_cut_is_reported_in_summary_log_and_exit_status(tmp_path, capsys, monkeypatch):
    # the run's clock advances one second each time it is read: deterministic whatever the machine's speed
    ticks = iter(range(10**6))
    monkeypatch.setattr(T.Trainer, "elapsed", lambda self: float(next(ticks)))
    args = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--name", "cut", "--no-report",
            "--set", f"train.out_dir={tmp_path}", "--set", "warmup.enabled=true", "--set", "warmup.steps=400",
            "--set", "train.time_budget_min=1", "--set", "data.n_test=2", "--set", "warmup.probe_n=0"]
    assert cli_main(["train", *args]) == 3
    out = capsys.readouterr()
    s = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert s["recipe_complete"] is False
    cuts = {c["phase"]: c for c in s["budget_cuts"]}
    assert 0 < cuts["warm-up"]["done"] < 400 and cuts["warm-up"]["planned"] == 400
    assert cuts["RL"]["done"] == 0 and cuts["RL"]["planned"] == 3
    assert "NOT the recipe's" in out.err  # said when it happens
    assert out.out.rstrip().splitlines()[-1].startswith("RESULT INCOMPLETE")  # and as the last line


def test_a_whole_run_says_so_and_exits_0(tmp_path, capsys):
    args = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--name", "ok", "--no-report",
            "--set", f"train.out_dir={tmp_path}", "--set", "train.steps=1", "--set", "data.n_test=2"]
    assert cli_main(["train", *args]) == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == "result: the recipe ran whole (every planned step)"
    s = json.loads((tmp_path / "ok" / "summary.json").read_text())
    assert s["budget_cuts"] == [] and s["recipe_complete"] is True
    assert set(s["eval_seconds"]) == {"before", "after"}


def test_rl_minutes_stops_rl_by_time_and_says_the_count_is_the_machines(tmp_path, capsys, monkeypatch):
    """train.rl_minutes (paper_table --rl-minutes, equal wall time): no RL step starts that would end past
    the minutes, by the steps' own times; it is the rule the user chose (exit 0, no budget cut), and both the
    summary and the printed result say the step count depends on the machine."""
    real_step = T.Trainer.train_step

    def step_of_30s(self):  # every RL step 'takes' 30 s: deterministic whatever the machine's speed
        m = real_step(self)
        m["time_step_s"] = 30.0
        return m

    monkeypatch.setattr(T.Trainer, "train_step", step_of_30s)
    args = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--name", "eq", "--no-report",
            "--set", f"train.out_dir={tmp_path}", "--set", "train.steps=10", "--set", "train.rl_minutes=1",
            "--set", "data.n_test=2"]
    assert cli_main(["train", *args]) == 0
    out = capsys.readouterr().out.rstrip().splitlines()
    s = json.loads((tmp_path / "eq" / "summary.json").read_text())
    # steps 1 and 2 end at 30 s and 60 s; a third would end at 90 s > 60 s
    assert s["steps"] == 2 and s["stop_reason"] == "rl_minutes" and s["rl_seconds"] == 60.0
    assert s["budget_cuts"] == [] and s["recipe_complete"] is True
    assert out[-1].startswith("result: RL stopped by train.rl_minutes after 2 steps")
    assert "depends on this machine's speed" in out[-1]


def test_a_warm_up_only_run_reports_three_accuracies_without_evaluating_twice(tmp_path, capsys):
    """train.steps=0 (the shared warm-up of paper_table --warm-start): the model after the warm-up IS the
    final model, so 'after' is the after-warm-up evaluation (not a second pass) and the RL gain is 0."""
    args = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--name", "w", "--no-report",
            "--set", f"train.out_dir={tmp_path}", "--set", "train.steps=0", "--set", "warmup.enabled=true",
            "--set", "warmup.steps=2", "--set", "warmup.eval_after=true", "--set", "data.n_test=2"]
    assert cli_main(["train", *args]) == 0
    out = capsys.readouterr().out
    assert "eval after warm-up done" in out and "eval after done" not in out
    s = json.loads((tmp_path / "w" / "summary.json").read_text())
    assert s["accuracy_after"] == s["accuracy_after_warmup"] is not None and s["rl_gain"] == 0
    assert set(s["eval_seconds"]) == {"before", "after_warmup", "after"}
    # each evaluation also counts right answers per number of gold calls, and the printed summary says so
    for key in ("eval_before", "eval_after_warmup", "eval_after"):
        b = s[key]["by_gold_calls"]
        assert sum(n for _, n in b.values()) == s[key]["n"] == 2
        assert sum(r for r, _ in b.values()) == round(s[key]["accuracy"] * 2)
    assert "  right by gold calls (" in out and " -> after warm-up " in out


def test_evaluation_counts_right_answers_per_number_of_gold_calls():
    """A scripted policy that answers single-call tasks right and parallel ones with only their first call:
    the breakdown puts every right answer under "1" and every parallel task under its call count."""
    from reflrl.envs.prompts import build_messages
    from reflrl.rollout import render_prompt
    from reflrl.train.summary import format_by_gold_calls

    _, tok = load_model("tiny-random", dtype="float32", trainable="none")
    calls = lambda i, k: [ToolCall("get_weather", {"city": f"C{i}-{j}"}) for j in range(k)]  # noqa: E731
    tasks = [Task(id=f"t{i}", kind="parallel" if k > 1 else "single", query=f"weather in {k} cities, #{i}?",
                  tools=[], gold=[calls(i, k)]) for i, k in enumerate([1, 2, 1, 3, 2, 1])]
    msgs = lambda t: build_messages(t, style="compact", fmt="hermes")  # noqa: E731
    answer = {tuple(render_prompt(tok, msgs(t))): format_calls(t.gold[0][:1], "hermes") for t in tasks}

    class FirstCallOnly:
        def generate(self, prompts, n=1, max_new_tokens=256, temperature=1.0, top_p=1.0, stop_ids=None, seed=0,
                     stop_when=None):
            out = []
            for i, p in enumerate(prompts):
                ids = tok(answer[tuple(p)], add_special_tokens=False)["input_ids"]
                out.append(Sample(i, list(p), ids, [0.0] * len(ids), "stop"))
            return out

    res = evaluate(FirstCallOnly(), tok, tasks, msgs, RolloutSpec(max_new_tokens=64, temperature=0.0), batch_size=4)
    assert res.accuracy == 0.5
    assert res.by_gold_calls == {"1": [3, 3], "2": [0, 2], "3": [0, 1]}
    assert res.to_dict()["by_gold_calls"] == res.by_gold_calls
    line = format_by_gold_calls({"eval_before": {"by_gold_calls": {"1": [0, 3], "2": [0, 2]}},
                                 "eval_after": {"by_gold_calls": {"1": [3, 3], "2": [1, 2], "3": [0, 1]}}})
    assert line == "  right by gold calls (1 call / 2 calls / 3 calls): before 0/3, 0/2, - -> after RL 3/3, 1/2, 0/1"
    assert format_by_gold_calls({"eval_after": {"accuracy": 0.5}}) is None  # a summary from before this count


# ----------------------------------------------------------------------------- progress in logs
def test_progress_lines_when_stdout_is_not_a_terminal(tmp_path, capsys):
    args = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--name", "p", "--no-report",
            "--set", f"train.out_dir={tmp_path}", "--set", "warmup.enabled=true", "--set", "warmup.steps=2",
            "--set", "data.n_test=2", "--set", "warmup.probe_n=2"]
    assert cli_main(["train", *args]) == 0
    out = capsys.readouterr().out  # captured: not a terminal
    for phase in ("eval before: 2 held-out tasks", "warm-up: 0/2 steps", "warm-up 2/2 steps", "warm-up done",
                  "eval after warm-up done", "RL: 0/3 steps", "RL 3/3 steps", "RL done", "eval after done"):
        assert phase in out, phase
    assert "run ends in ~" in out  # an ETA once RL's pace is known


def test_progress_lines_are_spaced_and_carry_eta():
    t = [0.0]
    buf = io.StringIO()
    p = Progress(stream=buf, tty=False, every_s=1e9, clock=lambda: t[0], start=0.0)
    ph = p.phase("warm-up", 100)
    for _ in range(100):
        t[0] += 2.0
        ph.update(1, loss=0.5)
    ph.close()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1 + 10 + 1  # start, every 10 steps, done
    assert lines[1] == "[[reflrl] 00:20 warm-up 10/100 steps (loss 0.5), 2.0 s/step, phase ETA 03:00"[1:]
    assert lines[-1].endswith("warm-up done: 100/100 steps in 03:20")


# ----------------------------------------------------------------------------- answers stop when complete
def test_answer_complete_rule():
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert not answer_complete("Sure, let me check")  # plain text: only the end of the turn ends it
    assert not answer_complete(call)
    assert not answer_complete(call + "\n")
    assert not answer_complete(call + "\n<tool_")  # another block may be starting
    assert not answer_complete(call + "\n<tool_call>\n{")
    assert answer_complete(call + "\nThe weather")  # trailing text: the calls are complete
    assert answer_complete(call + "\n" + call + " ok")
    assert not answer_complete(call + " ok", fmt="pythonic")


def test_engine_stops_rows_at_their_own_caps_and_when_complete():
    model, tok = load_model("tiny-random", dtype="float32", trainable="none", seed=0)
    eng = TransformersEngine(model, tok)
    prompts = [tok.encode("a b c"), tok.encode("d e")]
    out = eng.generate(prompts, n=2, max_new_tokens=[3, 7], temperature=1.0, stop_ids=[], seed=0)
    assert [len(s.token_ids) for s in out] == [3, 3, 7, 7] and {s.finish_reason for s in out} == {"length"}
    texts: list[str] = []

    def after_three_tokens(text: str) -> bool:  # the engine hands over each row's text so far
        texts.append(text)
        return len(tok(text, add_special_tokens=False)["input_ids"]) >= 3 or texts.count(text) > 1

    full = eng.generate(prompts, n=1, max_new_tokens=[9, 9], temperature=0.0, stop_ids=[])
    out = eng.generate(prompts, n=1, max_new_tokens=[9, 9], temperature=0.0, stop_ids=[],
                       stop_when=after_three_tokens)
    for a, b in zip(full, out):
        assert b.finish_reason == "stop" and 1 <= len(b.token_ids) < 9
        assert a.token_ids[: len(b.token_ids)] == b.token_ids  # the same tokens, cut where the test said


def test_cut_at_gives_remote_engines_the_same_stop():
    s = Sample(0, [1], [10, 11, 12, 13], [-0.1, -0.2, -0.3, -0.4], "length")
    decode = {10: "<tool_call>", 11: "{}", 12: "</tool_call>", 13: "\nhi"}.__getitem__
    cut = cut_at(s, answer_complete, decode)
    assert cut.token_ids == [10, 11, 12, 13] and cut.finish_reason == "stop"
    s2 = Sample(0, [1], [10, 11, 12, 13, 13], [-0.1] * 5, "length")
    assert cut_at(s2, answer_complete, decode).token_ids == [10, 11, 12, 13]


class RamblingEngine:
    """Answers every prompt with the task's gold call and then rambles, token by token, honouring the
    engine protocol's caps and ``stop_when`` as TransformersEngine does (its own test is above)."""

    def __init__(self, tok, answers):
        self.tok, self.answers = tok, answers

    def generate(self, prompts, n=1, max_new_tokens=256, temperature=1.0, top_p=1.0, stop_ids=None, seed=0,
                 stop_when=None):
        caps = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        out = []
        for i, p in enumerate(prompts):
            ids = self.tok(self.answers[tuple(p)] + "\nI hope this helps! " * 40, add_special_tokens=False)["input_ids"]
            keep, text = [], ""
            reason = "length"
            for t in ids[: caps[i]]:
                keep.append(t)
                text += self.tok.decode([t])
                if stop_when is not None and stop_when(text):
                    reason = "stop"
                    break
            out.append(Sample(i, list(p), keep, [0.0] * len(keep), reason))
        return out


def test_evaluation_stops_each_answer_when_complete_and_caps_it_by_its_gold():
    _, tok = load_model("tiny-random", dtype="float32", trainable="none")
    tasks = [Task(id=f"t{i}", kind="single", query=f"weather in city {i}?", tools=[],
                  gold=[[ToolCall("get_weather", {"city": f"C{i}"})]]) for i in range(3)]
    from reflrl.envs.prompts import build_messages
    from reflrl.rollout import render_prompt

    msgs = lambda t: build_messages(t, style="compact", fmt="hermes")  # noqa: E731
    answers = {tuple(render_prompt(tok, msgs(t))): format_calls(t.gold[0], "hermes") for t in tasks}
    eng = RamblingEngine(tok, answers)
    gen = RolloutSpec(max_new_tokens=400, answer_cap=1.5, stop_at_complete=True, temperature=0.0)
    res = evaluate(eng, tok, tasks, msgs, gen)
    gold_len = len(tok(format_calls(tasks[0].gold[0], "hermes"), add_special_tokens=False)["input_ids"])
    assert res.accuracy == 1.0 and res.capped == 0
    assert res.new_tokens <= 3 * (gold_len + 2)  # the call and one token of trailing text, not 400
    off = evaluate(eng, tok, tasks, msgs, RolloutSpec(max_new_tokens=400, temperature=0.0))
    assert off.new_tokens > 5 * res.new_tokens and off.accuracy == 1.0
    # without the early stop, the gold-sized cap still bounds a rambling answer
    capped = evaluate(eng, tok, tasks, msgs, RolloutSpec(max_new_tokens=400, answer_cap=1.5, temperature=0.0))
    cap = answer_token_cap(tasks[0], tok, gen)
    assert capped.capped == 3 and capped.new_tokens == 3 * cap and cap == -(-3 * (gold_len + 1) // 2) + 16


# ----------------------------------------------------------------------------- the product as installed
def test_importing_reflrl_sets_no_environment_variable():
    code = r"""
import json, os, pkgutil, importlib
before = dict(os.environ)
import reflrl
skip = ("reflrl.verl_backend", "reflrl.engines.vllm_engine", "reflrl.__main__")  # __main__ runs the CLI
for m in pkgutil.walk_packages(reflrl.__path__, "reflrl."):
    if not m.name.startswith(skip):
        importlib.import_module(m.name)
after = dict(os.environ)
print(json.dumps({k: [before.get(k), after.get(k)] for k in set(before) | set(after) if before.get(k) != after.get(k)}))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}


def test_the_wheel_installs_the_same_default_recipe(tmp_path):
    """Build the wheel, install it into a fresh virtual environment outside the repository, and check
    that `reflrl train` there resolves exactly the repository's default recipe."""
    import shutil

    src, dist = tmp_path / "src", tmp_path / "dist"  # build from a copy: the checkout gets no build/ folder
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "build", "*.egg-info",
                                                             "__pycache__", ".pytest_cache", "dist"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(dist), str(src)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    assert "Warning" not in build.stderr, build.stderr[-3000:]  # packaging declares all its data: a quiet build
    wheel = next(dist.glob("reflrl-*.whl"))
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    import sysconfig

    # the wheel's dependencies come from this environment (no download); reflrl itself only from the wheel
    deps = Path(sysconfig.get_paths()["purelib"])
    Path(site, "deps.pth").write_text(str(deps) + "\n")
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site, str(wheel)],
                          capture_output=True, text=True, timeout=600)
    assert inst.returncode == 0, inst.stderr[-3000:]
    run = subprocess.run([str(env_dir / "bin" / "python"), "-c",
                          "import sys, reflrl, reflrl.config as C; from reflrl.cli import main; "
                          "print(reflrl.__file__, file=sys.stderr); print(C.default_recipe(), file=sys.stderr); "
                          "sys.exit(main(['train', '--print-config']))"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert run.returncode == 0, run.stderr[-3000:]
    where, recipe = run.stderr.strip().splitlines()[-2:]
    assert where.startswith(site) and not where.startswith(str(ROOT))  # the installed copy, not the checkout
    assert recipe.startswith(site)
    import yaml

    installed = yaml.safe_load(run.stdout)
    assert C.config_from_dict(installed) == C.load_config(ROOT / "configs" / "default.yaml")
