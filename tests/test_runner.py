"""reflrl.experiment.runner: what the table scripts share."""
from __future__ import annotations

import json
import sys

import pytest

from reflrl.experiment.runner import fmt_mean_std, run_train, train_command


def test_fmt_mean_std():
    assert fmt_mean_std([1.0, 2.0, 3.0]) == "2.000 ± 1.000"
    assert fmt_mean_std([0.5, None], ".1f") == "0.5 ± 0.0"
    assert fmt_mean_std([None]) == "n/a"


def test_train_command_carries_every_setting():
    cmd = train_command(seed=2, name="x", out_dir="/o", config="c.yaml", faults="rate_limit=0.1", overrides=["a.b=1"])
    assert cmd[1:4] == ["-m", "reflrl", "train"]
    for part in (["--seed", "2"], ["--config", "c.yaml"], ["--faults", "rate_limit=0.1"], ["--set", "a.b=1"],
                 ["--set", "train.out_dir=/o"]):
        assert any(cmd[j:j + 2] == part for j in range(len(cmd) - 1)), part


def test_run_train_returns_summary_or_raises_with_the_output(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"accuracy_after": 0.5}))
    summary, wall = run_train([sys.executable, "-c", "print('ok')"], tmp_path)
    assert summary == {"accuracy_after": 0.5} and wall > 0
    with pytest.raises(RuntimeError, match="status 1") as e:
        run_train([sys.executable, "-c", "import sys; print('boom'); sys.exit(1)"], tmp_path)
    assert "boom" in str(e.value)
    # exit 3 = the time budget cut a phase: the summary is kept (its budget_cuts say so), not an error
    summary, _ = run_train([sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path)
    assert summary == {"accuracy_after": 0.5}
    with pytest.raises(RuntimeError, match="status 3"):  # ... but only with a summary
        run_train([sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path / "missing")
    with pytest.raises(RuntimeError, match="status 0"):  # exit 0 but no summary: not a silent empty row
        run_train([sys.executable, "-c", "pass"], tmp_path / "missing")


def test_warm_start_points_each_seed_at_its_step0_checkpoint_and_names_a_missing_one(tmp_path):
    from reflrl.experiment.runner import warm_start

    ck = tmp_path / "recipe-s1" / "checkpoints" / "step_000000"
    ck.mkdir(parents=True)
    (ck / "trainable.pt").write_bytes(b"x")
    (ck / "state.json").write_text(json.dumps({"warmup": {"ran": True, "sft_steps": 7},
                                               "eval_before": {"accuracy": 0.0}}))
    over, info = warm_start(str(tmp_path / "recipe-s{seed}"), 1, out_dir=tmp_path)
    assert over == [f"model.init_from={ck.resolve()}", "warmup.enabled=false"]
    assert info["warmup"]["sft_steps"] == 7 and info["accuracy_base"] == 0.0
    with pytest.raises(FileNotFoundError, match="seed 2: .*recipe-s2.*step_000000"):
        warm_start(str(tmp_path / "recipe-s{seed}"), 2, out_dir=tmp_path)
    with pytest.raises(ValueError, match="seed"):
        warm_start(str(tmp_path / "recipe"), 2, out_dir=tmp_path)
