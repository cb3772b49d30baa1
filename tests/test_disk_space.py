"""A run folder's disk: the estimate of a checkpoint's size, the check before a run starts, and a disk
that fills up while a checkpoint is written (a CI run once died of "No space left on device" in the
middle of the suite, with nothing saying which folder or how much it needed)."""
from __future__ import annotations

import errno
import shutil
import subprocess
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from doubles import tiny_cfg
from reflrl.diskspace import check_disk_space, tree_bytes
from reflrl.errors import DiskSpaceError
from reflrl.eval.data import DataError
from reflrl.runlog import RunLog, checkpoint_bytes, list_checkpoints
from reflrl.train.setup import check_checkpoint_space, load_policy

Usage = namedtuple("Usage", "total used free")


def _policy(tmp_path: Path, **over):
    cfg = tiny_cfg(tmp_path, **over)
    model, tok, _choice, _s = load_policy(cfg, lambda _line: None)
    return cfg, model, tok


def _one_step(model) -> torch.optim.Optimizer:
    """An AdamW step, so the optimizer holds its two moments (what a checkpoint after a step saves)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    loss = sum((p.float() ** 2).sum() for p in params)
    loss.backward()
    opt.step()
    return opt


@pytest.mark.parametrize("over", [{}, {"model.dtype": "bfloat16", "model.trainable": "top_layers:1"}],
                         ids=["all-float32", "bfloat16-top1-float32-master"])
def test_the_estimate_matches_a_written_checkpoint(tmp_path, over):
    _cfg, model, tok = _policy(tmp_path, **over)
    opt = _one_step(model)
    ck = RunLog(tmp_path / "run", None).save_checkpoint(0, model=model, tokenizer=tok, optimizer=opt, state={})
    est, real = checkpoint_bytes(model), tree_bytes(ck)
    tok_bytes = tree_bytes(ck / "model") - sum(f.stat().st_size for f in (ck / "model").glob("*.safetensors"))
    # the estimate leaves out the tokenizer files, RNG state and state.json; the tensors it counts
    assert 0.9 < est / (real - tok_bytes) < 1.1, (est, real, tok_bytes)
    # and it is not the trivial answer: a frozen model has no optimizer state and no trainable copy
    for p in model.parameters():
        p.requires_grad_(False)
    assert checkpoint_bytes(model) < est and checkpoint_bytes(model, export=False) == 0


def test_check_disk_space_names_the_folder_and_the_sizes(tmp_path):
    target = tmp_path / "runs" / "not-yet"  # does not exist yet: its nearest existing folder is asked
    asked = []

    def usage(p):
        asked.append(Path(p))
        return Usage(10**12, 0, 2_000_000)

    assert check_disk_space(target, 2_000_000, "x", disk_usage=usage) == 2_000_000  # exactly enough
    with pytest.raises(DiskSpaceError) as e:
        check_disk_space(target, 2_000_001, "three checkpoints", hint="lower train.keep_checkpoints",
                         disk_usage=usage)
    assert e.value.errno == errno.ENOSPC
    msg = e.value.strerror
    assert str(target) in msg and "three checkpoints" in msg and "2 MB free" in msg
    assert msg.endswith("lower train.keep_checkpoints")
    assert asked == [tmp_path, tmp_path]


@pytest.mark.parametrize("keep,save_every,steps,held", [(2, 10, 8, 2), (2, 1, 8, 3), (1, 1, 8, 2),
                                                        (5, 0, 100, 2)])
def test_the_run_needs_room_for_the_checkpoints_it_holds_at_once(tmp_path, keep, save_every, steps, held):
    """After the warm-up, every save_every RL steps and at the end; the kept ones plus the one being
    written, never more than the run writes."""
    cfg, model, _tok = _policy(tmp_path, **{"train.keep_checkpoints": keep, "train.save_every": save_every,
                                            "train.steps": steps})
    per = checkpoint_bytes(model)
    room = lambda free: (lambda _p: Usage(10**12, 0, free))  # noqa: E731
    assert check_checkpoint_space(cfg, tmp_path / "run", model, disk_usage=room(held * per)) == held * per
    with pytest.raises(DiskSpaceError, match=f"up to {held} at once"):
        check_checkpoint_space(cfg, tmp_path / "run", model, disk_usage=room(held * per - 1))


def test_a_resumed_run_counts_the_checkpoints_it_already_has(tmp_path):
    cfg, model, tok = _policy(tmp_path, **{"train.keep_checkpoints": 2, "train.save_every": 1})
    run = tmp_path / "run"
    log = RunLog(run, None)
    for step in (0, 1):
        log.save_checkpoint(step, model=model, tokenizer=tok, optimizer=None, state={}, keep_last=2)
    assert len(list_checkpoints(run)) == 2
    per = checkpoint_bytes(model)
    room = lambda free: (lambda _p: Usage(10**12, 0, free))  # noqa: E731
    check_checkpoint_space(cfg, run, model, resume=True, disk_usage=room(per))  # only the one being written
    with pytest.raises(DiskSpaceError):
        check_checkpoint_space(cfg, run, model, resume=False, disk_usage=room(per))


def test_reflrl_train_refuses_to_start_without_room_and_exits_4(tmp_path, monkeypatch, capsys):
    from reflrl.cli import main

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=3_000_000))  # a nearly full disk
    code = main(["train", "--config", str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"),
                 "--set", f"train.out_dir={tmp_path}", "--set", "train.run_name=r", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 4, err
    assert f"reflrl train: error: not enough disk space for this run's checkpoints" in err
    assert str(tmp_path / "r") in err and "3 MB free" in err
    assert not (tmp_path / "r").exists()  # nothing written: the same command runs once there is room


@pytest.fixture
def small_disk(tmp_path):
    """A real 6 MB file system (tmpfs), where mounting one is allowed (root); skipped elsewhere."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6M", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({(r.stderr or r.stdout).strip()[:120]})")
    yield mnt
    if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(mnt)], check=False)  # a file still open: detach it anyway


def test_a_disk_that_fills_up_during_a_save_says_so_and_leaves_no_half_checkpoint(tmp_path, small_disk):
    """The tiny model's checkpoint (~50 MB) cannot fit in 6 MB: torch.save fails first (a RuntimeError
    that does not say why, in torch 2.13); the error names the folder, says the earlier checkpoints are
    intact, how to continue, and the half-written folder is removed (it held the space left)."""
    _cfg, model, tok = _policy(tmp_path)
    log = RunLog(small_disk / "run", None)
    with pytest.raises(DiskSpaceError) as e:
        log.save_checkpoint(3, model=model, tokenizer=tok, optimizer=None, state={})
    log.close()
    msg = e.value.strerror
    assert f"the disk of run folder {small_disk / 'run'} filled up while checkpoint step_000003 was written" in msg
    assert f"reflrl train --resume {small_disk / 'run'}" in msg
    assert list((small_disk / "run" / "checkpoints").iterdir()) == []
    assert shutil.disk_usage(small_disk).free > 5_000_000  # the space is back


# ----------------------------------------------------------------------------- a finished run's weights
def _finished_run(tmp_path: Path):
    _cfg, model, tok = _policy(tmp_path)
    run = tmp_path / "run"
    log = RunLog(run, None)
    opt = _one_step(model)
    log.save_checkpoint(0, model=model, tokenizer=tok, optimizer=opt, state={}, keep_last=2)
    with torch.no_grad():
        next(p for p in model.parameters() if p.requires_grad).add_(1.0)  # the final weights differ
    log.save_checkpoint(1, model=model, tokenizer=tok, optimizer=opt, state={}, keep_last=2)
    log.write_summary({"accuracy_after": 0.5})
    log.close()
    return run, model


def test_slimming_a_finished_run_keeps_its_final_model_where_eval_finds_it(tmp_path):
    from transformers import AutoModelForCausalLM

    from reflrl.eval.backends import is_run_folder, run_checkpoint
    from reflrl.runlog import slim_run_folder

    run, model = _finished_run(tmp_path)
    before = tree_bytes(run / "checkpoints")
    final_model_bytes = tree_bytes(run / "checkpoints" / "step_000001" / "model")
    freed = slim_run_folder(run, "model")
    assert freed == before - final_model_bytes and freed > before / 2
    assert not (run / "checkpoints").exists() and not (run / "checkpoints.del").exists()
    assert (run / "summary.json").is_file() and (run / "metrics.jsonl").is_file()
    assert is_run_folder(run) and run_checkpoint(run) == run / "model"
    loaded = AutoModelForCausalLM.from_pretrained(run / "model", torch_dtype=torch.float32)
    want = {n: p for n, p in model.named_parameters()}
    got = dict(loaded.named_parameters())
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)  # the FINAL weights
    assert slim_run_folder(run, "model") == 0  # again: nothing left to free


def test_slimming_to_none_all_and_refusals(tmp_path):
    from reflrl.eval.backends import run_checkpoint
    from reflrl.runlog import slim_run_folder

    run, _model = _finished_run(tmp_path)
    n = len(list_checkpoints(run))
    assert slim_run_folder(run, "all") == 0 and len(list_checkpoints(run)) == n == 2
    with pytest.raises(ValueError, match="keep='most'"):
        slim_run_folder(run, "most")
    (run / "summary.json").unlink()
    with pytest.raises(ValueError, match="not a finished run"):  # a resume needs them
        slim_run_folder(run, "none")
    assert len(list_checkpoints(run)) == 2
    (run / "summary.json").write_text("{}")
    assert slim_run_folder(run, "none") > 0
    assert not (run / "checkpoints").exists() and not (run / "model").exists()
    with pytest.raises(DataError, match="keeps no weights"):
        run_checkpoint(run)


def test_resuming_a_slimmed_finished_run_is_refused_and_its_results_stay(tmp_path, capsys):
    """Without the refusal, --resume of a finished run that lost its checkpoints would start it over
    (RunLog cuts metrics.jsonl back to the last checkpoint's records: none) and overwrite its summary."""
    from reflrl.cli import main
    from reflrl.runlog import slim_run_folder

    run, _model = _finished_run(tmp_path)
    from reflrl import config as C

    cfg = tiny_cfg(tmp_path)
    C.save_config(cfg, run / "config.yaml")
    (run / "metrics.jsonl").write_text('{"step": 1, "phase": "train", "reward_mean": 0.5}\n')
    summary = (run / "summary.json").read_text()
    slim_run_folder(run, "model")
    assert main(["train", "--resume", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "is finished (summary.json) and keeps no checkpoint" in err and str(run) in err
    from reflrl.train import train  # the Python API refuses too, before it loads anything

    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        train(cfg, run, resume=True, progress=False, quiet=True, report=False)
    assert (run / "summary.json").read_text() == summary
    assert (run / "metrics.jsonl").read_text().count("\n") == 1


@pytest.mark.slow
def test_converting_the_embedded_model_without_room_says_where_and_writes_nothing(tmp_path, monkeypatch):
    """The embedded GGUF is converted once into the cache (0.5 GB); without room the error names the
    folder and REFLRL_CACHE instead of a serialization error from deep inside safetensors."""
    from reflrl import models as M

    monkeypatch.setenv("REFLRL_CACHE", str(tmp_path / "cache"))
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=100_000_000))  # 100 MB free
    with pytest.raises(DiskSpaceError) as e:
        M._convert_embedded()
    msg = e.value.strerror
    assert "the embedded model, converted once to float32" in msg and str(tmp_path / "cache") in msg
    assert "100 MB free" in msg and "REFLRL_CACHE" in msg
    assert not M.embedded_cache_dir().exists()
    assert not (tmp_path / "cache" / "tokenizers").exists()  # refused from the GGUF's header, before any work
    assert not list((tmp_path / "cache" / "models").glob(".tmp-*"))
