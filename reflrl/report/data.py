"""Reading a run folder or a sweep folder for the report, tolerating missing and partial files.

A crashed run may lack ``summary.json`` (and ``metrics.jsonl`` may end in a half-written line); a
run killed early may have no metrics at all. Loading never raises for that: what is absent goes to
``missing`` with a sentence saying what it means, and the report shows the rest.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from reflrl.errors import UserError

RUN_FILES = {
    "config.yaml": "the resolved config (which recipe, model, faults and seed produced the run)",
    "versions.json": "the software versions of the run",
    "metrics.jsonl": "the per-step metrics: no curve over steps can be drawn",
    "summary.json": "the final summary: the run did not finish (it crashed, was killed or is still running); "
                    "final accuracy, fault totals and time totals are unknown",
}


class ReportError(UserError, ValueError):
    """A path that is neither a run folder nor a sweep folder."""


@dataclass
class RunData:
    """What a run folder holds. ``rows`` is metrics.jsonl with later records of the same (phase,
    step) replacing earlier ones (a resumed run re-logs the steps after its last checkpoint)."""

    path: Path
    config: dict[str, Any] | None = None
    versions: dict[str, Any] | None = None
    summary: dict[str, Any] | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)     # "file: what it means"
    problems: list[str] = field(default_factory=list)    # unreadable lines, bad JSON, ...

    def train_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("phase") == "train"]

    def eval_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("phase") == "eval"]

    def cfg(self, dotted: str, default: Any = None) -> Any:
        """A config value by dotted key (``train.seed``), or ``default``."""
        node: Any = self.config or {}
        for k in dotted.split("."):
            if not isinstance(node, dict) or k not in node:
                return default
            node = node[k]
        return node

    @property
    def seed(self) -> Any:
        return self.cfg("train.seed", (self.summary or {}).get("config", {}).get("seed"))

    @property
    def faults(self) -> str:
        f = self.cfg("env.faults", (self.summary or {}).get("config", {}).get("faults"))
        return f or "none"


def is_run_dir(path: Path) -> bool:
    return any((path / f).exists() for f in ("config.yaml", "metrics.jsonl", "summary.json", "checkpoints"))


def load_run(path: str | Path) -> RunData:
    """Load a run folder (see the module doc); raises ReportError only if ``path`` is no folder."""
    p = Path(path)
    if not p.is_dir():
        raise ReportError(f"{p}: no such folder")
    run = RunData(p)
    for name, meaning in RUN_FILES.items():
        f = p / name
        if not f.is_file():
            run.missing.append(f"{name}: missing -- {meaning}")
            continue
        try:
            text = f.read_text(errors="replace")
            if name == "config.yaml":
                run.config = yaml.safe_load(text) or {}
            elif name == "versions.json":
                run.versions = json.loads(text)
            elif name == "summary.json":
                run.summary = json.loads(text)
            else:
                run.rows = _read_jsonl(text, run.problems)
        except (ValueError, yaml.YAMLError) as e:
            run.problems.append(f"{name}: unreadable ({e}) -- {meaning}")
    return run


def _read_jsonl(text: str, problems: list[str]) -> list[dict[str, Any]]:
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    order: list[tuple[str, int]] = []
    bad = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if not isinstance(r, dict) or "step" not in r:
            bad += 1
            continue
        key = (str(r.get("phase", "train")), int(r["step"]))
        if key in latest:  # eval rows of one step carry different keys: merge them
            latest[key] = {**latest[key], **r} if key[0] != "train" else r
        else:
            order.append(key)
            latest[key] = r
    if bad:
        problems.append(f"metrics.jsonl: {bad} unreadable line(s) skipped (a run killed mid-write?)")
    rows = [latest[k] for k in order]
    return sorted(rows, key=lambda r: (int(r["step"]), r.get("phase") != "eval"))


# ============================================================================ sweeps
@dataclass
class CellData:
    """One sweep cell: its manifest entry and its run (None when the run folder does not exist)."""

    entry: dict[str, Any]
    run: RunData | None

    @property
    def done(self) -> bool:
        return self.run is not None and self.run.summary is not None


@dataclass
class SweepData:
    path: Path
    manifest: dict[str, Any]
    cells: list[CellData]
    missing: list[str] = field(default_factory=list)

    @property
    def spec(self) -> dict[str, Any]:
        return self.manifest.get("spec", {})

    @property
    def methods(self) -> list[str]:
        return list(self.spec.get("methods") or sorted({c.entry["method"] for c in self.cells}))

    @property
    def kinds(self) -> list[str]:
        ks: list[str] = []
        for c in self.cells:
            for k in c.entry.get("rates", {}):
                if k not in ks:
                    ks.append(k)
        return ks


def is_sweep_dir(path: Path) -> bool:
    return (path / "sweep.json").is_file()


def load_sweep(path: str | Path) -> SweepData:
    p = Path(path)
    try:
        manifest = json.loads((p / "sweep.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ReportError(f"{p / 'sweep.json'}: cannot read the sweep manifest: {e}") from None
    cells, missing = [], []
    for e in manifest.get("cells", []):
        d = p / e.get("run_dir", f"cells/{e.get('id')}")
        run = load_run(d) if d.is_dir() else None
        if run is None:
            missing.append(f"{e.get('id')}: not run yet (status {e.get('status', 'pending')})")
        elif run.summary is None:
            missing.append(f"{e.get('id')}: no summary.json (status {e.get('status')}"
                           + (f"; {e['error'][:200]}" if e.get("error") else "") + ")")
        cells.append(CellData(e, run))
    return SweepData(p, manifest, cells, missing)
