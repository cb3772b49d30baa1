"""reflrl experiment faults: the grid, methods, bad input, the ETA, and the acceptance sweep (2 methods
x 2 fault rates x 1 seed on the tiny model, killed after its first cell, then finished by re-running
without redoing that cell)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from reflrl import config as C
from reflrl.cli import main
from reflrl.experiment.grid import GridError, expand, parse_grid
from reflrl.experiment.sweep import Eta, SweepError, SweepSpec, method_recipe, parse_seeds, plan_cells

ROOT = Path(__file__).resolve().parent.parent


def test_per_kind_grid_shares_the_no_fault_baseline():
    settings = expand(parse_grid("rate_limit=0,0.1,0.3;timeout=0,0.1"))
    assert [s.spec for s in settings] == ["none", "rate_limit=0.1", "rate_limit=0.3", "timeout=0.1"]
    assert settings[3].rates == {"rate_limit": 0.0, "timeout": 0.1}
    product = expand(parse_grid("rate_limit=0,0.1,0.3;timeout=0,0.1"), "product")
    assert len(product) == 6 and "rate_limit=0.3,timeout=0.1" in [s.spec for s in product]
    assert expand(parse_grid("latency=0.2:300ms"))[0].spec == "latency=0.2:300ms"


@pytest.mark.parametrize("grid,named", [
    ("", "empty"),
    ("rate_limit", "rate_limit"),
    ("ratelimit=0.1", "did you mean 'rate_limit'"),
    ("rate_limit=0.1;;timeout=0", "axis 2 is empty"),
    ("rate_limit=0.1,,0.2", "empty value"),
    ("rate_limit=1.5", "outside [0, 1]"),
    ("rate_limit=0.1;rate_limit=0.2", "given twice"),
])
def test_bad_grids_name_what_is_wrong(grid, named):
    with pytest.raises(GridError, match=None) as e:
        expand(parse_grid(grid))
    assert named in str(e.value)


def test_product_grid_over_probability_one_is_rejected():
    with pytest.raises(GridError, match="rate_limit=0.6,timeout=0.6"):
        expand(parse_grid("rate_limit=0.6;timeout=0.6"), "product")


def test_methods_map_to_recipes_laid_over_the_base_config(tmp_path):
    assert method_recipe("grpo", None)["base"].endswith("configs/grpo.yaml") or \
        method_recipe("grpo", None)["base"].endswith("configs/default.yaml")
    tiny = ROOT / "configs" / "tiny.yaml"
    r = method_recipe("dapo", tiny)
    assert r["base"] == str(tiny) and r["sampling"]["sampler"] == "dapo" and r["sampling"]["refill"] is True
    p = tmp_path / "dapo.yaml"
    p.write_text(yaml.safe_dump(r))
    cfg = C.load_config(p)
    assert cfg.model.name == "tiny-random" and cfg.env.reward == "fine" and cfg.sampling.sampler == "dapo"
    # without a configs/<name>.yaml, only grpo has a meaning (the default recipe)
    empty = tmp_path / "configs"
    empty.mkdir()
    assert method_recipe("grpo", None, empty)["base"].endswith("default.yaml")
    with pytest.raises(SweepError, match="unknown method 'nosuch'"):
        method_recipe("nosuch", None)


def test_cells_and_seeds():
    assert parse_seeds("3") == (0, 1, 2) and parse_seeds("0,5") == (0, 5)
    for bad in ("0", "x", "1,1"):
        with pytest.raises(SweepError, match="--seeds"):
            parse_seeds(bad)
    spec = SweepSpec(("grpo", "tool_rerl"), "rate_limit=0,0.1", seeds=(0, 1))
    cells = plan_cells(spec)
    assert len(cells) == 8 and len({c.id for c in cells}) == 8
    assert cells[0].id == "grpo__none__s0" and cells[-1].id == "tool_rerl__rate_limit-0.1__s1"
    assert spec.default_out() == SweepSpec(("grpo", "tool_rerl"), "rate_limit=0,0.1", seeds=(0, 1)).default_out()
    assert spec.default_out() != SweepSpec(("grpo",), "rate_limit=0,0.1", seeds=(0, 1)).default_out()


def test_eta():
    assert Eta(1).seconds_left(3) is None and "unknown" in Eta(1).text(3)
    assert Eta(1, budget_minutes=2).seconds_left(2) == 2 * 180
    assert Eta(2, durations=[10.0, 20.0]).seconds_left(3) == 30.0  # 2 rounds of 15 s
    assert Eta(1, durations=[5.0]).text(0).startswith("ETA 0s")


@pytest.mark.parametrize("args,named", [
    (["--faults", "bogus=0.1"], "unknown fault kind 'bogus'"),
    (["--faults", "rate_limit=0.1", "--methods", "grpo,nosuch"], "unknown method 'nosuch'"),
    (["--faults", "rate_limit=0.1", "--seeds", "zero"], "--seeds 'zero'"),
    (["--faults", "rate_limit=0.1", "--config", "no/such.yaml"], "no/such.yaml: no such file"),
    (["--faults", "rate_limit=0.1", "--set", "train.threads"], "--set 'train.threads'"),
])
def test_bad_sweep_arguments_exit_2(tmp_path, capsys, args, named):
    assert main(["experiment", "faults", "--out", str(tmp_path / "sw")] + args) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err
    assert not (tmp_path / "sw" / "cells").exists()


def test_a_folder_holding_another_sweep_is_refused(tmp_path, capsys):
    out = tmp_path / "sw"
    out.mkdir()
    spec = SweepSpec(("grpo",), "rate_limit=0.1", seeds=(0,))
    (out / "sweep.json").write_text(json.dumps({"spec": spec.identity(), "cells": []}))
    assert main(["experiment", "faults", "--faults", "rate_limit=0.2", "--seeds", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "holds a different sweep" in err and "rate_limit=0.1" in err and "rate_limit=0.2" in err


# ----------------------------------------------------------------------------- acceptance
SWEEP_ARGS = ["experiment", "faults", "--methods", "grpo,tool_rerl", "--faults", "rate_limit=0,0.1",
              "--seeds", "1", "--budget-minutes", "1", "--config", str(ROOT / "configs" / "tiny.yaml"),
              "--no-cell-reports",
              "--set", "train.threads=1", "--set", "train.steps=1", "--set", "data.n_train=4",
              "--set", "data.n_test=2", "--set", "data.n_val=0", "--set", "rollout.max_new_tokens=8",
              "--set", "train.save_every=1"]


def sweep_cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "reflrl", *SWEEP_ARGS, "--out", str(out), *extra]


def test_sweep_killed_after_its_first_cell_finishes_the_rest_on_rerun(tmp_path):
    out = tmp_path / "sweep"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = open(tmp_path / "first.log", "w")
    # its own process group: killing the group kills the sweep and its running cell at once (SIGKILL:
    # nothing gets to clean up, as when a machine goes down)
    proc = subprocess.Popen(sweep_cmd(out), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    first = out / "cells" / "grpo__none__s0" / "summary.json"
    deadline = time.time() + 240

    def first_done() -> bool:  # the manifest is rewritten atomically: always readable
        m = out / "sweep.json"
        return m.exists() and json.loads(m.read_text())["cells"][0]["status"] == "done"

    try:
        while not first_done():
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.time() < deadline, "the first cell did not finish in 240 s"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    first_mtime = first.stat().st_mtime_ns
    manifest = json.loads((out / "sweep.json").read_text())
    assert manifest["cells"][0]["status"] == "done"
    done_before = sum((out / c["run_dir"] / "summary.json").exists() for c in manifest["cells"])
    assert done_before < 4

    r = subprocess.run(sweep_cmd(out, "--jobs", "2"), capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"{done_before} done already, {4 - done_before} to run" in r.stdout
    assert "ETA" in r.stdout and "sweep finished: 4/4 cells done" in r.stdout
    assert first.stat().st_mtime_ns == first_mtime  # the first cell was not redone
    manifest = json.loads((out / "sweep.json").read_text())
    cells = {c["id"]: c for c in manifest["cells"]}
    assert len(cells) == 4 and all(c["status"] == "done" for c in cells.values())
    assert cells["grpo__none__s0"]["attempts"] == 1
    assert {c["method"] for c in cells.values()} == {"grpo", "tool_rerl"}
    assert {c["faults"] for c in cells.values()} == {"none", "rate_limit=0.1"}
    for c in cells.values():
        s = json.loads((out / c["run_dir"] / "summary.json").read_text())
        # a finished cell keeps its final model only (--keep-checkpoints model, the default)
        assert not (out / c["run_dir"] / "checkpoints").exists()
        assert (out / c["run_dir"] / "model" / "config.json").is_file()
        assert s["config"]["seed"] == c["seed"]
        assert (s["config"]["faults"] or "none") == c["faults"]
        assert s["config"]["variant"] == ("tool_rerl" if c["method"] == "tool_rerl" else "grpo")
    # the sweep report was written at the end
    for name in ("accuracy_vs_faults", "recovered_vs_faults", "calls_per_signal"):
        assert (out / "plots" / f"{name}.png").stat().st_size > 8000, name
    assert "4/4 cells finished" in (out / "report.md").read_text()
    # a third run has nothing to do
    r = subprocess.run(sweep_cmd(out, "--no-report"), capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "4 done already, 0 to run" in r.stdout
