"""A fault-injection sweep: methods x fault settings x seeds, each cell a normal training run.

The sweep folder::

    SWEEP/
        sweep.json            the manifest: what was asked (methods, grid, expansion, seeds, budget,
                              base config, overrides) and every cell's status, attempts, wall time
        configs/<method>.yaml the recipe each method's cells train with (kept for the record)
        cells/<cell id>/      one run folder per cell (config.yaml, metrics.jsonl, summary.json, ...)
        logs/<cell id>.log    the cell's ``reflrl train`` output, every attempt appended
        failed/<cell id>-attempt<N>/   the folder of an attempt that crashed (checkpoints dropped)
        report.html, report.md, plots/   written by ``reflrl report SWEEP`` (and at the sweep's end)

A finished cell keeps only its final model (``cells/<cell id>/model/``, which ``reflrl eval --model
CELL_DIR`` loads), its checkpoints deleted; ``keep_checkpoints`` ("all", "model", "none") chooses.

Each cell runs ``python -m reflrl train`` in its own process, so a crash in one cell is recorded
(status ``failed``, exit status, the log's tail) and the sweep goes on with the next.

Resuming: running the same command again (same arguments, hence the same default folder, or the
same ``--out``) continues the sweep. A cell is

- ``done`` when its run folder has ``summary.json``: skipped, never redone;
- resumed with ``reflrl train --resume`` when it was interrupted (the sweep or the cell was
  killed) after its first checkpoint: the trainer continues with the same data order, filter
  state and time budget already spent;
- restarted from scratch when it has no checkpoint yet (the partial folder is deleted) or when
  its last attempt crashed (exit status > 0; the folder is moved to ``failed/`` first, since
  resuming a crash would most likely crash again).

The manifest is rewritten atomically after every change, so killing the sweep at any moment
leaves a readable manifest (a cell left ``running`` by a killed sweep is treated as interrupted).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import yaml

from .grid import FaultSetting, expand, parse_grid

from ..budget import EXIT_BUDGET_CUT
from ..config import default_recipe, recipes_dir
from ..errors import UserError

CONFIGS_DIR = recipes_dir()  # configs/ of a checkout, reflrl/configs of an installed wheel
DEFAULT_CONFIG = default_recipe()
MANIFEST = "sweep.json"
MANIFEST_VERSION = 1
_METHOD_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_NOT_METHODS = {"default", "tiny"}  # recipes in configs/ that are not training methods


class SweepError(UserError, ValueError):
    """A sweep that cannot start: bad arguments, unknown method, a folder holding another sweep."""


# ============================================================================ methods
def known_methods(configs_dir: Path = CONFIGS_DIR) -> list[str]:
    """``grpo`` (the default recipe) and every ``configs/<name>.yaml`` that is a method."""
    names = {p.stem for p in configs_dir.glob("*.yaml")} - _NOT_METHODS
    return sorted(names | {"grpo"})


def _chain_layers(path: Path, stop: Path) -> list[dict]:
    """The YAML mappings of ``path``'s ``base:`` chain, nearest last, stopping before ``stop``."""
    layers: list[dict] = []
    seen: set[Path] = set()
    p = path.resolve()
    while p != stop.resolve() and p not in seen:
        seen.add(p)
        data = yaml.safe_load(p.read_text()) or {}
        if not isinstance(data, dict):
            raise SweepError(f"config file {p}: not a YAML mapping")
        base = data.pop("base", None)
        layers.insert(0, data)
        if base is None:
            break
        p = (p.parent / str(base)).resolve()
    return layers


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def method_recipe(method: str, base_config: Path | None, configs_dir: Path = CONFIGS_DIR) -> dict[str, Any]:
    """The config mapping a method's cells train with.

    ``configs/<method>.yaml`` when it exists; ``grpo`` without such a file is the default recipe.
    With ``--config BASE``, the method's own keys (its ``base:`` chain up to, not including,
    ``configs/default.yaml``) are laid over BASE instead of over the default recipe, so
    ``--config configs/tiny.yaml`` compares the methods on the tiny recipe.
    """
    if not _METHOD_RE.match(method):
        raise SweepError(f"method {method!r}: not a valid method name (letters, digits, _ . -)")
    path = configs_dir / f"{method}.yaml"
    if path.is_file():
        if base_config is None:
            return {"base": str(path.resolve())}
        keys: dict = {}
        for layer in _chain_layers(path, configs_dir / "default.yaml"):
            keys = _merge(keys, layer)
        return {"base": str(base_config.resolve()), **keys}
    if method == "grpo":
        return {"base": str((base_config or DEFAULT_CONFIG).resolve())}
    raise SweepError(f"unknown method {method!r}: no {path} (known: {', '.join(known_methods(configs_dir))}; "
                     "a method is a recipe configs/<method>.yaml, 'grpo' is the default recipe)")


# ============================================================================ the spec
@dataclass(frozen=True)
class SweepSpec:
    """What a sweep runs: its identity (a re-run with the same spec continues the same sweep)."""

    methods: tuple[str, ...]
    faults: str                      # the grid as given, e.g. "rate_limit=0,0.1;timeout=0,0.1"
    grid: str = "per-kind"           # expansion mode, see reflrl.experiment.grid
    seeds: tuple[int, ...] = (0, 1, 2)
    budget_minutes: float | None = None   # each cell's train.time_budget_min (None: the recipe's)
    config: str | None = None        # base recipe (absolute path) or None (the default recipe)
    overrides: tuple[str, ...] = ()  # --set key=value for every cell

    def settings(self) -> list[FaultSetting]:
        return expand(parse_grid(self.faults), self.grid)

    def identity(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    def digest(self) -> str:
        return hashlib.sha1(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:8]

    def default_out(self, parent: Path = Path("runs") / "experiments") -> Path:
        """``runs/experiments/faults-<methods>-<hash of the spec>``: the same command, the same folder."""
        return parent / f"faults-{'-'.join(self.methods)}-{self.digest()}"


def parse_seeds(text: str) -> tuple[int, ...]:
    """``3`` -> (0, 1, 2); ``0,5,7`` -> (0, 5, 7)."""
    t = str(text).strip()
    try:
        if "," not in t:
            n = int(t)
            if n < 1:
                raise SweepError(f"--seeds {text!r}: need at least one seed")
            return tuple(range(n))
        seeds = tuple(int(s) for s in t.split(",") if s.strip())
    except ValueError:
        raise SweepError(f"--seeds {text!r}: expected a count (3) or a comma-separated list (0,1,2)") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise SweepError(f"--seeds {text!r}: expected distinct seeds")
    return seeds


def parse_methods(text: str) -> tuple[str, ...]:
    ms = tuple(m.strip() for m in str(text).split(",") if m.strip())
    if not ms:
        raise SweepError(f"--methods {text!r}: expected e.g. grpo,tool_rerl")
    if len(set(ms)) != len(ms):
        raise SweepError(f"--methods {text!r}: a method is repeated")
    return ms


# ============================================================================ cells
@dataclass
class Cell:
    """One training run of the sweep and what happened to it."""

    id: str
    method: str
    faults: str                  # canonical fault spec ("none")
    rates: dict[str, float]      # each grid kind's probability in this cell
    seed: int
    run_dir: str                 # relative to the sweep folder
    status: str = "pending"      # pending | running | done | failed | interrupted
    attempts: int = 0
    returncode: int | None = None
    wall_s: float = 0.0          # summed over attempts
    resumed: int = 0             # attempts that continued from a checkpoint
    started: str | None = None
    finished: str | None = None
    error: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Cell":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def plan_cells(spec: SweepSpec) -> list[Cell]:
    """Every cell, method-major then fault setting then seed (so a partial sweep already has every
    method at the first settings)."""
    out = []
    for setting in spec.settings():
        for method in spec.methods:
            for seed in spec.seeds:
                cid = f"{method}__{setting.slug}__s{seed}"
                out.append(Cell(cid, method, setting.spec, dict(setting.rates), seed, f"cells/{cid}"))
    return out


def now() -> str:
    return datetime.now().isoformat(timespec="seconds")


class Manifest:
    """``SWEEP/sweep.json``: the spec, the cells, and when things happened (atomic rewrites)."""

    def __init__(self, path: Path, spec: SweepSpec, cells: list[Cell], created: str | None = None,
                 extra: dict[str, Any] | None = None):
        self.path = path
        self.spec = spec
        self.cells = cells
        self.created = created or now()
        self.extra = dict(extra or {})
        self._lock = threading.Lock()

    def to_dict(self) -> dict[str, Any]:
        return {"version": MANIFEST_VERSION, "kind": "fault_sweep", "created": self.created, "updated": now(),
                "spec": self.spec.identity(), **self.extra, "cells": [asdict(c) for c in self.cells]}

    def save(self) -> None:
        with self._lock:
            tmp = self.path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
            os.replace(tmp, self.path)

    @classmethod
    def read(cls, path: Path) -> dict[str, Any]:
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SweepError(f"{path}: cannot read the sweep manifest: {e}") from None


def spec_from_manifest(d: dict[str, Any]) -> SweepSpec:
    s = d["spec"]
    return SweepSpec(methods=tuple(s["methods"]), faults=s["faults"], grid=s.get("grid", "per-kind"),
                     seeds=tuple(s["seeds"]), budget_minutes=s.get("budget_minutes"), config=s.get("config"),
                     overrides=tuple(s.get("overrides", ())))


# ============================================================================ ETA
@dataclass
class Eta:
    """Time left: cells still to run x the mean wall time of the cells finished so far / jobs.
    Before any cell finished, the budget per cell (plus a minute for loading and evaluation) when
    one is set, else unknown."""

    jobs: int = 1
    budget_minutes: float | None = None
    durations: list[float] = field(default_factory=list)

    def seconds_left(self, cells_left: int) -> float | None:
        if cells_left <= 0:
            return 0.0
        if self.durations:
            per = sum(self.durations) / len(self.durations)
        elif self.budget_minutes:
            per = self.budget_minutes * 60 + 60
        else:
            return None
        return per * -(-cells_left // max(1, self.jobs))

    def text(self, cells_left: int) -> str:
        s = self.seconds_left(cells_left)
        if s is None:
            return f"ETA unknown until the first cell finishes ({cells_left} cells left)"
        return f"ETA {format_duration(s)} ({cells_left} cell{'s' if cells_left != 1 else ''} left)"


def format_duration(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


# ============================================================================ the runner
class Sweep:
    """Plans, resumes and runs a sweep in ``out`` (see the module doc).

    ``python``: the interpreter the cells run with; ``say``: where progress lines go;
    ``cell_reports``: each cell's ``reflrl train`` writes its run report (``--no-report`` if False).
    """

    def __init__(self, spec: SweepSpec, out: Path, *, jobs: int = 1, python: str = sys.executable,
                 say: Callable[[str], None] = print, argv: list[str] | None = None, cell_reports: bool = True,
                 keep_checkpoints: str = "model"):
        from reflrl.runlog import KEEP_CHOICES

        if jobs < 1:
            raise SweepError(f"--jobs {jobs}: need at least 1")
        if keep_checkpoints not in KEEP_CHOICES:
            raise SweepError(f"--keep-checkpoints {keep_checkpoints}: expected one of {', '.join(KEEP_CHOICES)}")
        self.spec, self.out, self.jobs, self.python, self.say = spec, Path(out).resolve(), jobs, python, say
        self.cell_reports = cell_reports
        self.keep_checkpoints = keep_checkpoints
        self.cells = plan_cells(spec)  # validates the grid
        self.recipes = {m: method_recipe(m, Path(spec.config) if spec.config else None) for m in spec.methods}
        self.manifest = Manifest(self.out / MANIFEST, spec, self.cells, extra={"argv": argv or []})
        self._procs: set[subprocess.Popen] = set()
        self._procs_lock = threading.Lock()
        self._stopping = False

    # ---------------------------------------------------------------- set-up
    def prepare(self) -> None:
        """Create or reopen the sweep folder; refuses a folder that holds a different sweep."""
        path = self.out / MANIFEST
        if path.exists():
            old = Manifest.read(path)
            if old.get("spec") != self.spec.identity():
                diff = {k: (old.get("spec", {}).get(k), v) for k, v in self.spec.identity().items()
                        if old.get("spec", {}).get(k) != v}
                raise SweepError(f"{self.out} holds a different sweep; differences (there -> asked): "
                                 + "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
                                 + ". Re-run with the same arguments to continue it, or choose another --out")
            prev = {c["id"]: Cell.from_dict(c) for c in old.get("cells", [])}
            self.manifest.created = old.get("created", self.manifest.created)
            for i, c in enumerate(self.cells):
                if c.id in prev:
                    self.cells[i] = prev[c.id]
            self.manifest.cells = self.cells
        elif self.out.exists() and any(self.out.iterdir()):
            raise SweepError(f"{self.out} exists and is not a sweep folder (no {MANIFEST}); choose another --out")
        for sub in ("configs", "cells", "logs"):
            (self.out / sub).mkdir(parents=True, exist_ok=True)
        for m, recipe in self.recipes.items():
            p = self.out / "configs" / f"{m}.yaml"
            p.write_text(f"# recipe of the '{m}' cells of this sweep (written by reflrl experiment faults)\n"
                         + yaml.safe_dump(recipe, sort_keys=False))
            from reflrl import config as C

            try:
                C.load_config(p, list(self.spec.overrides))
            except C.ConfigError as e:
                raise SweepError(f"method {m!r}: its recipe does not load: {e}") from None
        self._take_lock()
        self.manifest.save()

    def _take_lock(self) -> None:
        lock = self.out / ".lock"
        if lock.exists():
            try:
                pid = int(lock.read_text().strip())
                if pid != os.getpid():
                    os.kill(pid, 0)
                    raise SweepError(f"another sweep (pid {pid}) is running in {self.out}; wait for it or stop it")
            except (ValueError, ProcessLookupError, PermissionError):
                pass  # stale lock of a killed sweep
        lock.write_text(str(os.getpid()))

    def _release_lock(self) -> None:
        (self.out / ".lock").unlink(missing_ok=True)

    # ---------------------------------------------------------------- one cell
    def run_dir(self, c: Cell) -> Path:
        return self.out / c.run_dir

    def is_done(self, c: Cell) -> bool:
        return (self.run_dir(c) / "summary.json").is_file()

    def command(self, c: Cell, resume: bool) -> list[str]:
        """The ``reflrl train`` command of a cell (run with this interpreter's ``-m reflrl``)."""
        base = [self.python, "-m", "reflrl", "train", "--no-progress"] + ([] if self.cell_reports else ["--no-report"])
        if resume:
            return base + ["--resume", str(self.run_dir(c))]
        cmd = base + ["--config", str(self.out / "configs" / f"{c.method}.yaml"), "--faults", c.faults,
                      "--seed", str(c.seed), "--name", Path(c.run_dir).name,
                      "--set", f"train.out_dir={self.out / 'cells'}"]
        if self.spec.budget_minutes is not None:
            cmd += ["--set", f"train.time_budget_min={self.spec.budget_minutes:g}"]
        for o in self.spec.overrides:
            cmd += ["--set", o]
        return cmd

    def _start_mode(self, c: Cell) -> bool:
        """Prepare the cell's folder for a new attempt; True = resume from its checkpoint."""
        from reflrl.runlog import latest_checkpoint

        d = self.run_dir(c)
        if c.status == "failed" and d.exists():  # a crash: keep it for forensics, start afresh
            dest = self.out / "failed" / f"{c.id}-attempt{c.attempts}"
            dest.parent.mkdir(exist_ok=True)
            shutil.rmtree(dest, ignore_errors=True)
            shutil.move(str(d), str(dest))
            shutil.rmtree(dest / "checkpoints", ignore_errors=True)
            return False
        if d.exists() and (d / "config.yaml").is_file() and latest_checkpoint(d) is not None:
            return True
        if d.exists():
            shutil.rmtree(d)
        return False

    def run_cell(self, c: Cell) -> Cell:
        """One attempt at a cell in a subprocess; updates ``c`` (status, wall time, error)."""
        resume = self._start_mode(c)
        cmd = self.command(c, resume)
        log = self.out / "logs" / f"{c.id}.log"
        c.status, c.attempts, c.started, c.error = "running", c.attempts + 1, now(), None
        c.resumed += int(resume)
        self.manifest.save()
        t0 = time.perf_counter()
        with open(log, "a") as fh:
            fh.write(f"\n==== attempt {c.attempts} at {c.started}{' (resume)' if resume else ''}: "
                     f"{' '.join(cmd)}\n")
            fh.flush()
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            with self._procs_lock:
                self._procs.add(proc)
            try:
                rc = proc.wait()
            finally:
                with self._procs_lock:
                    self._procs.discard(proc)
        c.wall_s = round(c.wall_s + time.perf_counter() - t0, 1)
        c.returncode, c.finished = rc, now()
        if rc in (0, EXIT_BUDGET_CUT) and self.is_done(c):
            c.status = "done"
            self._slim(c)
            if rc == EXIT_BUDGET_CUT:  # finished, but a phase was cut: kept, and said in the manifest
                c.error = "the time budget cut a phase of this cell (summary.json budget_cuts): not the recipe's result"
        elif rc < 0 or self._stopping:  # killed by a signal: resume next time
            c.status, c.error = "interrupted", f"stopped by signal {-rc}" if rc < 0 else "sweep interrupted"
        else:
            c.status = "failed"
            tail = log.read_text(errors="replace").strip().splitlines()[-15:]
            c.error = f"exit status {rc}" + (f" (no summary.json)" if rc == 0 else "") + ": " + " | ".join(tail)[-1500:]
        self.manifest.save()
        return c

    def _slim(self, c: Cell) -> None:
        """A finished cell keeps the weights ``--keep-checkpoints`` asks for (a sweep of tens of cells
        would otherwise hold about 1.3 GB of checkpoints per cell with the default recipe in bfloat16)."""
        from reflrl.runlog import slim_run_folder

        try:
            slim_run_folder(self.run_dir(c), self.keep_checkpoints)
        except OSError as e:  # the cell's result is whole; only the clean-up failed: say it, go on
            self.say(f"cell {c.id}: could not remove its checkpoints ({e}); the result is kept")

    # ---------------------------------------------------------------- the sweep
    def _describe(self, c: Cell) -> str:
        return f"{c.method} faults={c.faults} seed={c.seed}"

    def _result(self, c: Cell) -> str:
        if c.status != "done":
            return f"{c.status.upper()} ({c.error or ''})"[:300] + f"; log: {self.out / 'logs' / (c.id + '.log')}"
        try:
            s = json.loads((self.run_dir(c) / "summary.json").read_text())
            acc = f"accuracy {s.get('accuracy_before', 0):.1%} -> {s.get('accuracy_after', 0):.1%}"
        except (OSError, ValueError, TypeError):
            acc = "summary unreadable"
        return f"done in {format_duration(c.wall_s)} ({acc})"

    def run(self) -> int:
        """Run every cell not done yet; returns 0 when all are done, 1 when some failed, 130 when
        interrupted. SIGTERM/SIGINT stop the running cells (they resume on the next run)."""
        self.prepare()
        todo = [c for c in self.cells if not self.is_done(c)]
        for c in self.cells:
            if self.is_done(c) and c.status != "done":
                c.status = "done"
        n, done0 = len(self.cells), len(self.cells) - len(todo)
        self.say(f"sweep {self.out}: {n} cells ({len(self.spec.methods)} methods x "
                 f"{len(self.spec.settings())} fault settings x {len(self.spec.seeds)} seeds, grid {self.spec.grid}); "
                 f"{done0} done already, {len(todo)} to run")
        prev = [c.wall_s for c in self.cells if c.status == "done" and c.wall_s and c.resumed == 0]
        eta = Eta(self.jobs, self.spec.budget_minutes, prev)
        if todo:
            self.say(eta.text(len(todo)))
        old_term = signal.signal(signal.SIGTERM, _raise_interrupt) if threading.current_thread() is threading.main_thread() else None
        finished = 0
        try:
            with ThreadPoolExecutor(max_workers=self.jobs) as pool:
                try:
                    pending: dict[Future, Cell] = {}
                    queue = list(todo)
                    while queue or pending:
                        while queue and len(pending) < self.jobs and not self._stopping:
                            c = queue.pop(0)
                            what = "starting" if c.attempts == 0 else f"attempt {c.attempts + 1} (was {c.status})"
                            self.say(f"[{done0 + finished + len(pending) + 1}/{n}] {self._describe(c)}: {what}")
                            pending[pool.submit(self.run_cell, c)] = c
                        if not pending:
                            break
                        ready, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                        for f in ready:
                            c = pending.pop(f)
                            f.result()
                            finished += 1
                            if c.status == "done" and c.resumed == 0:
                                eta.durations.append(c.wall_s)
                            left = len(queue) + len(pending)
                            self.say(f"  {self._describe(c)}: {self._result(c)}; {eta.text(left)}")
                except KeyboardInterrupt:  # stop the running cells before the pool waits for them
                    self._stopping = True
                    self._terminate_children()
                    raise
        except KeyboardInterrupt:
            self._stopping = True
            self._terminate_children()
            for c in self.cells:
                if c.status == "running":
                    c.status, c.error = "interrupted", "sweep interrupted"
            self.manifest.save()
            self.say(f"sweep interrupted; run the same command again to continue ({self.out})")
            return 130
        finally:
            if old_term is not None:
                signal.signal(signal.SIGTERM, old_term)
            self._release_lock()
        failed = [c for c in self.cells if c.status != "done"]
        self.say(f"sweep finished: {n - len(failed)}/{n} cells done"
                 + (f", {len(failed)} failed: " + ", ".join(c.id for c in failed) if failed else ""))
        return 1 if failed else 0

    def _terminate_children(self) -> None:
        with self._procs_lock:
            procs = list(self._procs)
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
