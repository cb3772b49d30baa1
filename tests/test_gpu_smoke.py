"""scripts/gpu_smoke.py on the CPU (``--device cpu``, tiny model): the same two RL steps, checks and
checkpoint reload that it runs on a CUDA device; its ``--recipe`` mode (the default recipe through
``reflrl train``, LoRA, ``reflrl eval``); and ``train.device`` resolution without a GPU."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reflrl.device import resolve_device
from reflrl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_smoke_script_passes_on_the_cpu(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_smoke.py"), "--device", "cpu", "--size", "tiny",
                           "--max-new-tokens", "12", "--out", str(tmp_path / "smoke")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("gpu_smoke: {")]
    figures = json.loads(lines[-1].split(": ", 1)[1])
    assert figures["ok"] and figures["device"] == "cpu" and len(figures["step_s"]) == 2
    c = figures["checks"]
    assert c["every_step_updated"] and c["loss_finite"] and c["model_device"] == "cpu"
    ck = c["checkpoint"]
    assert ck["reload_equal"] and ck["weights_changed"] and ck["tensors_finite"]
    assert "gpu_smoke: PASS" in proc.stdout
    assert sum("gpu_smoke: step " in x for x in proc.stdout.splitlines()) == 2


def test_gpu_smoke_recipe_mode_passes_on_the_cpu(tmp_path):
    """``--recipe``: evaluations, warm-up, two RL steps with faults and reflection retries, LoRA and
    ``reflrl eval``, each checked; the script fails if any part of that path breaks."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_smoke.py"), "--recipe", "--device", "cpu",
                           "--size", "tiny", "--out", str(tmp_path / "smoke")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("gpu_smoke: {")]
    figures = json.loads(lines[-1].split(": ", 1)[1])
    assert figures["ok"] and figures["failed"] == [] and figures["mode"] == "recipe"
    rec = figures["recipe"]
    assert rec["exit"] == 0 and len(rec["rl"]) == 2 and rec["warmup"]["ran"] and rec["warmup"]["sft_steps"] == 4
    assert [p["phase"] for p in rec["phases"]] == ["eval before", "warm-up", "eval after warm-up", "RL step 1",
                                                   "RL step 2", "eval after"]
    c = rec["checks"]
    assert c["rl_reflection"] and c["eval_reflection"] and c["every_step_updated"] and c["checkpoint"]["reload_equal"]
    assert all(r["reflect/retries"] > 0 for r in rec["rl"]) and rec["command"].startswith("reflrl train --faults rate_limit=0.1")
    assert figures["lora"]["checks"]["lora_trained"] and figures["lora"]["checks"]["every_step_updated"]
    ev = figures["eval"]
    assert ev["exit"] == 0 and ev["backend_stats"]["new_tokens"] > 0 and "sealtools/in_domain" in ev["units"]
    assert proc.stdout.rstrip().endswith("gpu_smoke: PASS")


def test_format_pretrain_changes_the_saved_model(tmp_path):
    """``--format-steps``: supervised steps on the recipe's gold answers, saved back in place."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM

    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "scripts" / "gpu_smoke.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assets = mod.export_assets(tmp_path / "assets")
    model_dir, _ = mod.build_model(assets, "tiny", tmp_path / "model")
    before = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(str(model_dir)).state_dict().items()}
    res = mod.format_pretrain(model_dir, torch.device("cpu"), steps=2, lr=1e-3, n_train=8)
    after = AutoModelForCausalLM.from_pretrained(str(model_dir)).state_dict()
    assert res["steps"] == 2 and res["examples"] == 8 and res["loss_last"] < float("inf")
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_device_resolution_without_and_with_cuda():
    assert resolve_device("cpu", has_cuda=True).type == "cpu"
    assert resolve_device("auto", has_cuda=False).type == "cpu"
    assert resolve_device("auto", has_cuda=True).type == "cuda"
    assert resolve_device("cuda", has_cuda=True).type == "cuda"
    with pytest.raises(ConfigError, match="train.device=cuda: .*sees no CUDA device.*train.device=cpu"):
        resolve_device("cuda", has_cuda=False)
    with pytest.raises(ConfigError, match="train.device='gpu'"):
        resolve_device("gpu")


def test_train_device_cuda_without_cuda_is_one_error_line(capsys):
    """``reflrl train --set train.device=cuda`` on a machine where torch sees no CUDA device: exit 2 and
    one line naming the key, before any model is loaded."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from reflrl.cli import main

    rc = main(["train", "--config", str(ROOT / "configs" / "tiny.yaml"), "--set", "train.device=cuda",
               "--no-progress", "--no-report"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "train.device=cuda" in err[0] and "sees no CUDA device" in err[0]


def test_train_device_cpu_is_the_cpu_run(capsys):
    """``--set train.device=cpu`` resolves to the same config as the default run, with the device named."""
    from reflrl.cli import main

    assert main(["train", "--config", str(ROOT / "configs" / "tiny.yaml"), "--print-config"]) == 0
    default = capsys.readouterr().out
    assert main(["train", "--config", str(ROOT / "configs" / "tiny.yaml"), "--set", "train.device=cpu",
                 "--print-config"]) == 0
    cpu = capsys.readouterr().out
    diff = [(a, b) for a, b in zip(default.splitlines(), cpu.splitlines()) if a != b]
    assert len(diff) == 1 and "device: auto" in diff[0][0] and "device: cpu" in diff[0][1]


def test_train_device_is_checked_with_the_config():
    from reflrl.config import load_config

    assert load_config(None, ["train.device=cpu"]).train.device == "cpu"
    with pytest.raises(ConfigError, match="train.device: 'gpu' is not one of auto, cpu, cuda"):
        load_config(None, ["train.device=gpu"])
