"""Run and sweep reports: ``reflrl report RUN_OR_SWEEP_DIR``.

Writes into the folder: ``report.html`` (self-contained: the PNGs are embedded), ``report.md``
(links ``plots/*.png``) and ``plots/*.png``. A run folder with missing files (a crashed run) still
gets a report of what exists that says what is missing.

- :mod:`reflrl.report.data`: reading run and sweep folders, tolerating missing files;
- :mod:`reflrl.report.derive`: the numbers (zero-variance shares, temporal stability, recovery,
  tool calls per learning signal);
- :mod:`reflrl.report.plots`: the figures;
- :mod:`reflrl.report.render`: HTML and markdown.
"""
from __future__ import annotations

from pathlib import Path

from .data import ReportError, is_run_dir, is_sweep_dir, load_run, load_sweep


def build_report(path: str | Path):
    """Write the report of a run folder or a sweep folder; returns a :class:`render.Report`.
    Raises ReportError when ``path`` is neither."""
    from .render import write_run_report, write_sweep_report

    p = Path(path)
    if not p.exists():
        raise ReportError(f"{p}: no such folder")
    if not p.is_dir():
        raise ReportError(f"{p}: not a folder (expected a run folder or a sweep folder)")
    if is_sweep_dir(p):
        return write_sweep_report(load_sweep(p))
    if is_run_dir(p):
        return write_run_report(load_run(p))
    raise ReportError(f"{p}: neither a run folder (config.yaml, metrics.jsonl, summary.json) nor a sweep "
                      "folder (sweep.json)")


__all__ = ["ReportError", "build_report", "load_run", "load_sweep"]
