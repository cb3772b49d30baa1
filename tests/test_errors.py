"""One error tree (reflrl.errors) and one handler in the CLI that maps an error's class to the exit status:
a user's mistake is one line and exit 2 wherever it is raised (in the CLI or deep inside the Trainer), a
run cut by its time budget exits 3, a full disk 4, and anything else is a bug shown with its traceback."""
from __future__ import annotations

import errno
from pathlib import Path

import pytest

from reflrl.cli import main
from reflrl.errors import (ConfigError, DiskSpaceError, IncompleteRun, ReflrlError, ResourceError, UserError,
                           exit_code)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


def test_the_tree_gives_each_class_its_exit_status():
    from reflrl.eval.data import DataError
    from reflrl.experiment.grid import GridError
    from reflrl.faults.spec import FaultPlan, FaultSpecError
    from reflrl.registry import Registry

    assert [exit_code(e) for e in (ConfigError("x"), IncompleteRun("x"), DiskSpaceError(errno.ENOSPC, "x"))] == [2, 3, 4]
    for user in (DataError("x"), GridError("x"), Registry("thing").unknown("nope")):
        assert isinstance(user, UserError) and exit_code(user) == 2
    with pytest.raises(FaultSpecError) as e:  # the standalone faults layer's own error: a user error too
        FaultPlan.parse("rate_limit=2")
    assert exit_code(e.value) == 2
    disk = DiskSpaceError(errno.ENOSPC, "not enough disk space for X")
    assert isinstance(disk, ResourceError) and isinstance(disk, OSError) and disk.errno == errno.ENOSPC
    assert str(disk) == "not enough disk space for X"
    assert isinstance(ConfigError("x"), ValueError) and issubclass(UserError, ReflrlError)
    assert exit_code(ValueError("an internal check")) is None and exit_code(KeyError("k")) is None


def test_a_config_error_raised_inside_the_trainer_is_one_line_and_exit_2(tmp_path, capsys):
    """data.source=file without data.path passes validation (a path may come later) and is refused by the
    Trainer when it builds its splits: still one line, exit 2, no traceback."""
    rc = main(["train", "--config", TINY, "--no-progress", "--set", f"train.out_dir={tmp_path}",
               "--set", "data.source=file", "--name", "r"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.strip().splitlines() == [err.strip()] and err.startswith("reflrl train: error: ")
    assert "data.path" in err and "Traceback" not in err


def test_an_internal_value_error_is_a_bug_with_its_traceback_not_a_config_error(tmp_path, capsys, monkeypatch):
    import reflrl.train

    def broken(*a, **k):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(reflrl.train, "train", broken)
    rc = main(["train", "--config", TINY, "--no-progress", "--set", f"train.out_dir={tmp_path}", "--name", "r"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "Traceback (most recent call last)" in err and "ValueError: an internal invariant broke" in err
    assert "this is a bug in reflrl" in err and "please report it" in err
    assert "error: an internal invariant broke" not in err  # never presented as the user's mistake


def test_a_run_cut_by_its_time_budget_prints_its_summary_and_exits_3(tmp_path, capsys, monkeypatch):
    import reflrl.train

    monkeypatch.setattr(reflrl.train, "train", lambda *a, **k: {"budget_cuts": [{"phase": "rl"}]})
    monkeypatch.setattr(reflrl.train, "format_summary", lambda s: "SUMMARY")
    rc = main(["train", "--config", TINY, "--no-progress", "--set", f"train.out_dir={tmp_path}", "--name", "r"])
    out, err = capsys.readouterr()
    assert rc == 3 and out.strip() == "SUMMARY"
    assert "time budget" in err and "Traceback" not in err


def test_user_errors_of_other_commands_exit_2(tmp_path, capsys):
    assert main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2  # DataError
    assert str(tmp_path / "a") in capsys.readouterr().err
    assert main(["experiment", "faults", "--faults", "rate_limit=2", "--out", str(tmp_path / "s")]) == 2  # GridError
    err = capsys.readouterr().err
    assert err.startswith("reflrl experiment: error: ") and "rate_limit" in err
    assert main(["train", "--config", TINY, "--set", "algo.advantage=grop"]) == 2  # UnknownName via the config
    assert "did you mean 'grpo'" in capsys.readouterr().err


def test_a_missing_bfcl_eval_is_one_line_naming_what_to_install(monkeypatch, capsys):
    """pip install reflrl does not bring bfcl-eval (make install adds it with --no-deps); the built-in tools
    need it at start: the user gets what to install in one line, exit status 2, not a traceback."""
    import importlib.util

    from reflrl.cli import report_error
    from reflrl.envs.tools import bfcl_backends as B

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bfcl_eval" else real(name, *a))
    B._class.cache_clear()
    try:
        with pytest.raises(B.BfclMissing) as err:
            B._class(next(iter(B.BFCL_CLASSES)))
    finally:
        B._class.cache_clear()
    assert report_error(err.value, "reflrl train") == 2
    out = capsys.readouterr().err
    assert out.strip() == f"reflrl train: error: {B.MISSING}" and "pip install --no-deps bfcl-eval==" in out
