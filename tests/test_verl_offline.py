"""The verl backend on an install without verl (``make install`` alone): ``reflrl train --backend verl``
says in one line what to install (exit 2, no traceback) before anything optional is imported, and the dry
run still prints the translated config, built on reflrl's copy of verl's defaults (which equals verl's
own composition where verl is installed).

verl (and its hydra) are made absent in this process (``sys.modules[name] = None`` makes ``import name``
fail), so the tests hold whether or not the verl extra is installed; omegaconf is a main dependency and
stays."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

import reflrl.verl_backend.config as vconfig
from reflrl.cli import main
from reflrl.verl_backend import verl_available

_ROOT = Path(__file__).resolve().parents[1]
GRPO = str(_ROOT / "configs/verl/grpo_efficient_qwen3-4b.yaml")
TOOL_RERL = str(_ROOT / "configs/verl/tool_rerl_qwen2.5-7b.yaml")


@pytest.fixture
def without_verl(monkeypatch, tmp_path):
    """verl and hydra cannot be imported; verl's composed default is not cached; cwd is a fresh folder
    (a dry run must write nothing there)."""
    for name in ("verl", "hydra"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(vconfig, "_DEFAULT", [])
    monkeypatch.chdir(tmp_path)
    assert not verl_available()
    return tmp_path


def test_training_without_verl_is_one_line(without_verl, capsys):
    rc = main(["train", "--backend", "verl", "--config", GRPO])
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and out == "" and "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("reflrl train: error: ")
    assert "pip install 'reflrl[verl]'" in lines[0] and "GPU" in lines[0]
    assert list(without_verl.iterdir()) == []  # nothing read, nothing written


def test_dry_run_without_verl_prints_the_translated_config(without_verl, capsys):
    rc = main(["train", "--backend", "verl", "--config", GRPO, "--dry-run", "--set", "verl.n_gpus_per_node=4",
               "--set", "algo.lr=2e-6"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    conf = yaml.safe_load(out)
    actor = conf["actor_rollout_ref"]["actor"]
    assert conf["algorithm"]["adv_estimator"] == "reflrl_grpo" and conf["trainer"]["n_gpus_per_node"] == 4
    assert actor["optim"]["lr"] == 2e-6 and (actor["clip_ratio_low"], actor["clip_ratio_high"]) == (0.2, 0.28)
    assert actor["policy_loss"]["loss_mode"] == "vanilla" and conf["actor_rollout_ref"]["rollout"]["n"] == 16
    assert conf["reflrl"]["max_attempts"] == 0 and "ppo_mini_batch_size" in actor  # our section, verl's keys
    assert "verl's own checks did not run" in err and "Traceback" not in err
    assert list(without_verl.iterdir()) == []  # a dry run writes no data


def test_dry_run_without_verl_keeps_reflrls_checks(without_verl, capsys):
    """Unknown verl keys are still refused (verl's defaults are known), and so are settings the verl backend
    cannot run (e.g. a frozen bottom: exit 2 naming the key)."""
    assert main(["train", "--backend", "verl", "--config", TOOL_RERL, "--dry-run",
                 "--set", "actor_rollout_ref.actor.no_such_key=1"]) == 2
    assert "actor_rollout_ref.actor.no_such_key" in capsys.readouterr().err
    assert main(["train", "--backend", "verl", "--config", GRPO, "--dry-run",
                 "--set", "model.trainable=top_layers:6"]) == 2
    err = capsys.readouterr().err
    assert "model.trainable='top_layers:6'" in err and "Traceback" not in err
    conf = vconfig.build_verl_config(vconfig.load_recipe(TOOL_RERL, []))  # eq. 2's weight carrier, set
    rc = conf.algorithm.rollout_correction
    assert conf.actor_rollout_ref.actor.policy_loss.loss_mode == "reflrl_tool_rerl"
    assert rc.rollout_is == "token" and rc.rollout_is_threshold >= 4.9e8 and not rc.bypass_mode


@pytest.mark.skipif(not verl_available(), reason="verl is not installed (the verl extra)")
def test_reflrls_copy_of_verls_defaults_is_verls_own():
    from omegaconf import OmegaConf

    theirs = OmegaConf.to_container(vconfig._compose_default_uncached(), resolve=False)
    ours = OmegaConf.to_container(vconfig.load_default_snapshot(), resolve=False)
    assert ours == theirs, ("reflrl/verl_backend/verl_ppo_trainer.yaml differs from the installed verl's default "
                            "config: regenerate it with reflrl.verl_backend.config.write_default_snapshot()")
