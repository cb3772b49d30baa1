"""The run folder and the CLI under crashes and mistakes (issue 18): resume logs each step once in
metrics.jsonl and TensorBoard, half-deleted checkpoints are never loaded, a taken run name is
refused before the model loads, bad YAML and bad ports get one line, sandboxes are not leaked."""
from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch

from reflrl import cli
from reflrl import config as C
from reflrl import train as T
from reflrl.cli import main as cli_main
from reflrl.train.batch import batch_logprobs, make_batch
from reflrl.train.step import policy_update
from reflrl.runlog import RunLog, latest_checkpoint, list_checkpoints

from doubles import ScriptedEngine, answer_by_task, run_until_killed, scripted, tb_scalars, tiny_cfg

ROOT = Path(__file__).resolve().parent.parent


def _save(log: RunLog, step: int, model: torch.nn.Module) -> Path:
    return log.save_checkpoint(step, model=model, tokenizer=None, optimizer=None,
                               state={"step": step}, export=False, keep_last=3)


def test_resume_cuts_the_log_back_to_its_checkpoint_and_tensorboard_follows(tmp_path):
    model = torch.nn.Linear(2, 2)
    log = RunLog(tmp_path / "run")
    for step in (1, 2):
        log.log(step, {"loss": float(step)})
    _save(log, 2, model)
    log.log(3, {"loss": 3.0})                     # logged after the checkpoint, then killed
    log.log(3, {"acc": 0.5}, phase="eval")
    log._metrics.write('{"step": 4, "pha')          # a half-written line
    log._metrics.flush()
    log._tb.flush()
    del log                                        # no close(): a kill

    log = RunLog(tmp_path / "run", resume=True)
    assert [(r["phase"], r["step"]) for r in log.read_metrics()] == [("train", 1), ("train", 2)]
    for step in (3, 4):                            # the resumed run logs them again
        log.log(step, {"loss": float(step)})
    log.close()
    keys = [(r["phase"], r["step"]) for r in log.read_metrics()]
    assert keys == [("train", s) for s in (1, 2, 3, 4)]
    tb = tb_scalars(tmp_path / "run")
    assert tb == Counter({("train/loss", s): 1 for s in (1, 2, 3, 4)})


def test_a_half_deleted_checkpoint_is_never_taken_for_the_latest(tmp_path):
    model = torch.nn.Linear(2, 2)
    log = RunLog(tmp_path / "run", tensorboard=False)
    good = _save(log, 1, model)
    broken = _save(log, 2, model)
    (broken / "trainable.pt").unlink()            # killed while deleting it: state.json is left
    (tmp_path / "run" / "checkpoints" / "step_000003.del").mkdir()
    (tmp_path / "run" / "checkpoints" / "step_000003.del" / "state.json").write_text("{}")
    assert latest_checkpoint(tmp_path / "run") == good
    assert list_checkpoints(tmp_path / "run") == [good]
    _save(log, 4, model)                           # the next save clears the leftovers
    assert not (tmp_path / "run" / "checkpoints" / "step_000003.del").exists()
    log.close()


def test_a_resumed_tiny_run_logs_each_step_once_and_leaves_no_sandbox_folder(tmp_path, monkeypatch):
    """Killed in step 2 after step 1 was logged (the last checkpoint is step 0's): the resumed run
    logs steps 1 and 2 once each, in metrics.jsonl and in TensorBoard; and neither process leaves a
    ``reflrl-sandboxes-*`` folder in the temporary folder."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    cfg = tiny_cfg(tmp_path, **{"train.steps": 2, "train.save_every": 2, "rollout.n": 2, "train.log_rollouts": True})

    a = T.Trainer(cfg, tmp_path / "run", progress=False, quiet=True, engine=scripted(cfg))
    run_until_killed(a, 1)
    logged = [(r["phase"], r["step"]) for r in a.log.read_metrics()]
    assert ("train", 1) in logged and latest_checkpoint(tmp_path / "run").name == "step_000000"
    r = T.Trainer(cfg, tmp_path / "run", resume=True, progress=False, quiet=True, engine=scripted(cfg))
    try:
        r.run()
    finally:
        r.close()
    keys = [(x["phase"], x["step"]) for x in r.log.read_metrics()]
    assert [k for k, n in Counter(keys).items() if n > 1] == []
    assert [s for p, s in keys if p == "train"] == [1, 2]
    tb = tb_scalars(tmp_path / "run")
    assert [k for k, n in tb.items() if n > 1] == []
    assert {s for (tag, s) in tb if tag == "train/loss"} == {1, 2}
    assert list(tmp.glob("reflrl-sandboxes-*")) == []
    rolls = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    per_step = Counter(x["step"] for x in rolls)  # step 1's rollouts once, though it ran twice
    assert per_step == {1: cfg.rollout.n * cfg.rollout.batch_prompts, 2: cfg.rollout.n * cfg.rollout.batch_prompts}


def test_a_taken_run_name_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    run = tmp_path / "runs" / "taken"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("train: {}\n")
    (run / "metrics.jsonl").write_text('{"step": 0, "phase": "eval"}\n')

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("reflrl.models.load_model", no_load)
    rc = cli_main(["train", "--config", str(ROOT / "configs" / "tiny.yaml"), "--name", "taken",
                 "--set", f"train.out_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "already holds a run" in err[0] and f"--resume {run}" in err[0]
    with pytest.raises(FileExistsError, match="--resume"):   # the Python API too, before loading
        T.Trainer(tiny_cfg(tmp_path, **{"train.out_dir": tmp_path / "runs"}), run)


def test_invalid_yaml_is_one_line_naming_file_line_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name: tiny-random\n  dtype: [float32\ntrain:\n  steps: 3\n")
    with pytest.raises(C.ConfigError) as ei:
        C.load_config(bad)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"{bad}:4:6: not valid YAML:")
    assert "line 3, column 10" in msg
    assert cli_main(["train", "--config", str(bad)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_tools_serve_with_a_bad_port_is_a_usage_error_not_a_traceback(port, capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["tools", "serve", "--port", port])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "is not a TCP port (0-65535" in err and "Traceback" not in err


def test_resuming_a_run_whose_final_checkpoint_was_written_only_writes_its_summary(tmp_path):
    cfg = tiny_cfg(tmp_path, **{"train.steps": 1, "train.save_every": 1, "rollout.n": 2})
    a = T.Trainer(cfg, tmp_path / "run", progress=False, quiet=True, engine=scripted(cfg))
    try:
        a.run()
    finally:
        a.close()
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    r = T.Trainer(cfg, tmp_path / "run", resume=True, progress=False, quiet=True)
    r.evaluate = None  # type: ignore[assignment]  (a finished run evaluates nothing again)
    try:
        s = r.run()
    finally:
        r.close()
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before
    assert s["steps"] == 1 and json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 1
