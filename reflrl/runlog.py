"""The run folder: everything a training run leaves behind, in one place.

    runs/<name>/
        config.yaml        the resolved config (after --config, --faults and --set)
        versions.json      python, torch, transformers, reflrl, git sha, host cores
        metrics.jsonl      one JSON object per logged step ({"step", "phase", ...metrics})
        events.out.tfevents.*   the same scalars for TensorBoard
        checkpoints/step_000012/
            model/         save_pretrained() of the policy (+ tokenizer): loads in transformers/vLLM as is
            trainable.pt   the trainable parameters, exact dtype (what --resume loads)
            optimizer.pt   optimizer state
            rng.pt         python / numpy / torch RNG states
            state.json     step, data-order position, pre-rollout filter streaks, timers, and how
                           many metrics.jsonl records existed when it was written
        summary.json       the final report (accuracy before/after, fault counts, timings ...)

Crash safety (``kill -9`` at any moment): a checkpoint is written to ``step_N.tmp`` and renamed;
an old one is renamed to ``step_N.del`` before it is deleted, so a half-deleted folder is never
taken for a checkpoint (a checkpoint counts only with its ``state.json`` and ``trainable.pt``).
Resuming (``RunLog(path, resume=True)``) cuts metrics.jsonl back to the records the last checkpoint
had seen (the resumed run logs the later steps again) and rewrites the TensorBoard events from it,
so each (phase, step) appears once in both.

Nothing here knows about RL: the trainer hands in plain dicts and modules.
"""
from __future__ import annotations

import errno
import json
import math
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from reflrl.diskspace import DiskSpaceError, disk_full, human_bytes, release_frames, tensor_bytes, tree_bytes

CHECKPOINT_DIR = "checkpoints"
METRICS = "metrics.jsonl"
ROLLOUTS = "rollouts.jsonl"
_CKPT_RE = re.compile(r"step_(\d+)")


def refuse_existing_run(path: str | Path) -> None:
    """Raise FileExistsError (saying what to do) if ``path`` already holds a run: a config.yaml or
    logged metrics. Cheap: the trainer calls it before loading the model."""
    p = Path(path)
    metrics = p / METRICS
    if (p / "config.yaml").exists() or (metrics.exists() and metrics.stat().st_size > 0):
        raise FileExistsError(
            f"run folder {p} already holds a run; continue it with 'reflrl train --resume {p}', "
            "or start a new one under another name (--name NAME or --set train.run_name=NAME)")


def refuse_slimmed_resume(path: str | Path) -> None:
    """Raise FileNotFoundError if ``path`` is a finished run whose checkpoints were removed
    (:func:`slim_run_folder`): resuming it would start it over and overwrite its results."""
    p = Path(path)
    if (p / "summary.json").is_file() and not list_checkpoints(p):
        raise FileNotFoundError(
            f"run folder {p} is finished (summary.json) and keeps no checkpoint (removed by a sweep's "
            "--keep-checkpoints): there is nothing to resume; start a new run under another name")


def versions() -> dict[str, Any]:
    """Versions of what produced the run: python, torch, transformers, reflrl and the git sha (if any)."""
    import transformers

    import reflrl

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "reflrl": reflrl.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        import peft

        out["peft"] = peft.__version__
    except Exception:  # peft is optional at run time
        pass
    repo = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                             timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=5)
        if sha.returncode == 0:
            out["git_sha"] = sha.stdout.strip()
            out["git_dirty"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        out["git_sha"] = None
    return out


def rng_state() -> dict[str, Any]:
    """Snapshot of the python, numpy and torch RNGs (restore with :func:`set_rng_state`)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _jsonable(x: Any) -> Any:
    """Make metrics JSON-safe: tensors/numpy scalars to floats, NaN/inf to None (and say so)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        x = x.item() if x.numel() == 1 else x.tolist()
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def _read_jsonl(p: Path) -> list[dict[str, Any]]:
    """The records of a JSONL log, up to the first unreadable line (a last line without "\n" is
    half-written: a kill while appending); [] for a missing file."""
    recs: list[dict[str, Any]] = []
    if p.exists():
        for line in p.read_text().split("\n")[:-1]:
            try:
                recs.append(json.loads(line))
            except ValueError:
                break
    return recs


def _write_jsonl(p: Path, recs: list[dict[str, Any]]) -> None:
    """Replace a JSONL log with ``recs`` atomically (write a sibling, then rename)."""
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in recs))
    os.replace(tmp, p)


class RunLog:
    """A run folder: config, versions, metrics (JSONL + TensorBoard), checkpoints, summary.

    ``RunLog(path, config)`` creates the folder (refusing one that already holds a run, see
    :func:`refuse_existing_run`, unless ``resume=True``: then metrics.jsonl is cut back to what the
    last checkpoint had seen, TensorBoard's events are rewritten from it, and logging appends).
    """

    def __init__(self, path: str | Path, config: dict[str, Any] | None = None, *, resume: bool = False,
                 tensorboard: bool = True):
        self.path = Path(path)
        self.resume = resume
        if not resume:
            refuse_existing_run(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / CHECKPOINT_DIR).mkdir(exist_ok=True)
        if config is not None and not (resume and (self.path / "config.yaml").exists()):
            self.write_config(config)
        (self.path / "versions.json").write_text(json.dumps(versions(), indent=2) + "\n")
        kept = self._rewind_metrics() if resume else []
        if resume:
            self._rewind_rollouts()
        self._rollouts = None  # rollouts.jsonl, opened on the first log_rollouts()
        self._records = len(kept)
        self._metrics = open(self.path / METRICS, "a", buffering=1)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                if resume:  # the events are rewritten from metrics.jsonl: each step once
                    for old in self.path.glob("events.out.tfevents.*"):
                        old.unlink()
                self._tb = SummaryWriter(log_dir=str(self.path))
            except Exception as e:  # tensorboard missing or broken: JSONL still has everything
                print(f"[reflrl] TensorBoard disabled: {e}", file=sys.stderr)
            for rec in kept:
                self._tb_write(rec)

    def _rewind_metrics(self) -> list[dict[str, Any]]:
        """Cut metrics.jsonl back to the records the last checkpoint had seen (all of them for a
        checkpoint from before this rule: those up to its step; none without a checkpoint), and
        drop a half-written last line. Returns the records kept."""
        p = self.path / METRICS
        recs = _read_jsonl(p)
        ck = latest_checkpoint(self.path)
        if ck is None:
            kept = []
        else:
            st = json.loads((ck / "state.json").read_text())
            n = st.get("metrics_records")
            kept = recs[:n] if n is not None else [r for r in recs if int(r.get("step", 0)) <= int(st["step"])]
        _write_jsonl(p, kept)
        return kept

    def _rewind_rollouts(self) -> None:
        """Cut rollouts.jsonl back to the steps the last checkpoint had done (none without one), so a
        resumed run logs each step's rollouts once."""
        p = self.path / ROLLOUTS
        if not p.exists():
            return
        ck = latest_checkpoint(self.path)
        last = int(json.loads((ck / "state.json").read_text())["step"]) if ck is not None else -1
        _write_jsonl(p, [r for r in _read_jsonl(p) if int(r.get("step", 0)) <= last])

    def log_rollouts(self, step: int, records: list[dict[str, Any]]) -> None:
        """Append one JSON line per rollout of RL step ``step`` to rollouts.jsonl (``train.log_rollouts``)."""
        if self._rollouts is None:
            self._rollouts = open(self.path / ROLLOUTS, "a", buffering=1)
        self._rollouts.write("".join(json.dumps(_jsonable({"step": int(step), **r})) + "\n" for r in records))

    # ------------------------------------------------------------------ config
    def write_config(self, config: dict[str, Any]) -> None:
        (self.path / "config.yaml").write_text(yaml.safe_dump(_jsonable(config), sort_keys=False))

    def read_config(self) -> dict[str, Any]:
        return yaml.safe_load((self.path / "config.yaml").read_text())

    # ----------------------------------------------------------------- metrics
    def log(self, step: int, metrics: dict[str, Any], phase: str = "train") -> None:
        """Append one record to metrics.jsonl and write its numeric scalars to TensorBoard as
        ``<phase>/<key>``."""
        rec = {"step": int(step), "phase": phase, "time": round(time.time(), 3)}
        rec.update(_jsonable(metrics))
        self._metrics.write(json.dumps(rec) + "\n")
        self._records += 1
        self._tb_write(rec)

    def _tb_write(self, rec: dict[str, Any]) -> None:
        if self._tb is None:
            return
        for k, v in rec.items():
            if k in ("step", "phase", "time"):
                continue
            if isinstance(v, bool):
                v = float(v)
            if isinstance(v, (int, float)):
                self._tb.add_scalar(f"{rec['phase']}/{k}", v, int(rec["step"]), walltime=rec.get("time"))

    def read_metrics(self) -> list[dict[str, Any]]:
        p = self.path / METRICS
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []

    # ------------------------------------------------------------- checkpoints
    def checkpoint_dir(self, step: int) -> Path:
        return self.path / CHECKPOINT_DIR / f"step_{step:06d}"

    def save_checkpoint(self, step: int, *, model: torch.nn.Module, tokenizer: Any,
                        optimizer: torch.optim.Optimizer | None, state: dict[str, Any],
                        export: bool = True, keep_last: int = 1) -> Path:
        """Write checkpoints/step_<step>/ atomically (written to a temp folder, then renamed).

        ``state`` is JSON (step, data order position, filter streaks, ...). ``export`` also writes
        ``model/`` with save_pretrained (+ tokenizer) so the checkpoint loads in transformers/vLLM.
        Keeps the newest ``keep_last`` checkpoints.
        """
        final = self.checkpoint_dir(step)
        tmp = final.with_name(final.name + ".tmp")
        for stale in [*self.path.joinpath(CHECKPOINT_DIR).glob("step_*.del"), tmp]:
            if stale.exists():  # left by a kill during an earlier save or deletion
                shutil.rmtree(stale)
        tmp.mkdir(parents=True)
        self._metrics.flush()
        state = {**state, "metrics_records": self._records}
        try:
            trainable = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
            torch.save(trainable, tmp / "trainable.pt")
            if optimizer is not None:
                torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save(rng_state(), tmp / "rng.pt")
            (tmp / "state.json").write_text(json.dumps(_jsonable(state), indent=1) + "\n")
            if export:
                export_model(model, tokenizer, tmp / "model")
        except Exception as e:  # noqa: BLE001 - torch.save and safetensors report a full disk in their own types
            size = checkpoint_bytes(model, export=export)
            if not disk_full(e, self.path, size):
                raise
            release_frames(e)  # a frame of torch.save may hold the open, half-written file
            shutil.rmtree(tmp, ignore_errors=True)  # the half-written checkpoint holds what space is left
            free = shutil.disk_usage(self.path).free
            raise DiskSpaceError(errno.ENOSPC, (
                f"the disk of run folder {self.path} filled up while checkpoint {final.name} was written "
                f"({human_bytes(free)} free now, a checkpoint of this run takes about {human_bytes(size)}); "
                f"the previous checkpoints are intact: free some space, then continue with "
                f"'reflrl train --resume {self.path}'")) from e
        if final.exists():
            _remove_checkpoint(final)
        tmp.rename(final)
        self._prune(keep_last)
        return final

    def _prune(self, keep_last: int) -> None:
        if keep_last <= 0:
            return
        cks = list_checkpoints(self.path)
        for old in cks[:-keep_last]:
            _remove_checkpoint(old)

    # ----------------------------------------------------------------- summary
    def write_summary(self, summary: dict[str, Any]) -> Path:
        p = self.path / "summary.json"
        p.write_text(json.dumps(_jsonable(summary), indent=2) + "\n")
        return p

    def close(self) -> None:
        if self._rollouts is not None:
            self._rollouts.close()
            self._rollouts = None
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
        if not self._metrics.closed:
            self._metrics.close()

    def __enter__(self) -> "RunLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def export_model(model: torch.nn.Module, tokenizer: Any, out: Path) -> None:
    """save_pretrained the policy (and tokenizer) into ``out``: uses reflrl.models.save_checkpoint
    when it exists (it merges LoRA adapters), else the model's own save_pretrained."""
    try:
        from . import models as _models

        save = getattr(_models, "save_checkpoint", None)
    except Exception:
        save = None
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in the middle of training output
    try:
        if save is not None:
            save(model, tokenizer, out)
            return
        model.save_pretrained(out)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def checkpoint_bytes(model: torch.nn.Module, *, export: bool = True) -> int:
    """About how many bytes one checkpoint of ``model`` takes on disk (:meth:`RunLog.save_checkpoint`):
    the trainable parameters, AdamW's two moments of each (the parameters' dtype), and with ``export``
    the whole model once more (``model/``; a tied embedding counted once). The tokenizer, RNG state and
    state.json are small and left out."""
    return 3 * tensor_bytes(model, trainable_only=True) + (tensor_bytes(model) if export else 0)


def _remove_checkpoint(ck: Path) -> None:
    """Rename to ``step_N.del`` (atomic: never a half-deleted ``step_N``), then delete."""
    trash = ck.with_name(ck.name + ".del")
    if trash.exists():
        shutil.rmtree(trash)
    ck.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first: ``step_N`` folders with ``state.json`` and
    ``trainable.pt`` (half-written ``.tmp`` and half-deleted ``.del`` folders are ignored)."""
    d = Path(run_dir) / CHECKPOINT_DIR
    if not d.is_dir():
        return []
    cks = [p for p in d.iterdir() if p.is_dir() and _CKPT_RE.fullmatch(p.name)
           and (p / "state.json").is_file() and (p / "trainable.pt").is_file()]
    return sorted(cks, key=lambda p: int(p.name.split("_")[1]))


KEEP_CHOICES = ("all", "model", "none")


def slim_run_folder(run_dir: str | Path, keep: str) -> int:
    """Reduce a FINISHED run's weights to ``keep`` (:data:`KEEP_CHOICES`); returns the bytes freed.

    ``all`` keeps its checkpoints; ``model`` keeps only the last checkpoint's exported model, moved
    to ``RUN/model/`` (it loads in transformers and ``reflrl eval --model RUN``), and deletes
    ``checkpoints/`` (the state a resume needs: a finished run is never resumed); ``none`` deletes
    ``checkpoints/`` (summary, metrics, events and report stay). Raises ValueError for another
    ``keep`` or for a run folder without ``summary.json`` (not finished)."""
    if keep not in KEEP_CHOICES:
        raise ValueError(f"keep={keep!r}: expected one of {', '.join(KEEP_CHOICES)}")
    run = Path(run_dir)
    if keep == "all":
        return 0
    if not (run / "summary.json").is_file():
        raise ValueError(f"{run}: not a finished run (no summary.json); its checkpoints are what --resume needs")
    cks = run / CHECKPOINT_DIR
    trash = cks.with_name(CHECKPOINT_DIR + ".del")  # renamed first: never a half-deleted checkpoints/
    if trash.exists():  # left by a kill during an earlier call
        shutil.rmtree(trash)
    if not cks.is_dir():
        return 0
    freed = tree_bytes(cks)
    last = latest_checkpoint(run)
    if keep == "model" and last is not None and (last / "model" / "config.json").is_file():
        dest = run / "model"
        if dest.exists():
            shutil.rmtree(dest)
        (last / "model").rename(dest)  # same folder tree: a rename, not a copy
        freed -= tree_bytes(dest)
    cks.rename(trash)
    shutil.rmtree(trash)
    return freed


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    cks = list_checkpoints(run_dir)
    return cks[-1] if cks else None


def load_checkpoint(ckpt: str | Path, *, model: torch.nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None, restore_rng: bool = True) -> dict[str, Any]:
    """Load a checkpoint written by :meth:`RunLog.save_checkpoint` into ``model`` (trainable
    parameters, exact) and ``optimizer``; restore the RNGs; return the JSON state."""
    ckpt = Path(ckpt)
    if not (ckpt / "state.json").exists():
        raise FileNotFoundError(f"{ckpt} is not a reflrl checkpoint (no state.json)")
    if model is not None:
        saved = torch.load(ckpt / "trainable.pt", map_location="cpu", weights_only=True)
        params = dict(model.named_parameters())
        missing = [n for n in saved if n not in params]
        if missing:
            raise KeyError(f"checkpoint {ckpt} has parameters the model lacks: {missing[:5]} "
                           "(was it trained with another model or trainable-layer setting?)")
        not_saved = [n for n, p in params.items() if p.requires_grad and n not in saved]
        if not_saved:
            raise KeyError(f"model has trainable parameters the checkpoint lacks: {not_saved[:5]}")
        with torch.no_grad():
            for n, t in saved.items():
                params[n].copy_(t.to(params[n].dtype))
    if optimizer is not None and (ckpt / "optimizer.pt").exists():
        optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=False))
    if restore_rng and (ckpt / "rng.pt").exists():
        set_rng_state(torch.load(ckpt / "rng.pt", map_location="cpu", weights_only=False))
    return json.loads((ckpt / "state.json").read_text())
