"""Writing the report: plots/*.png, a self-contained report.html (the PNGs embedded as base64, no
script, no external resource) and report.md (the same content, linking the PNGs)."""
from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import yaml

from . import derive as D
from .data import RunData, SweepData
from .plots import RUN_PLOTS, SWEEP_PLOTS, NoData, PlotSpec, png_bytes

CSS = """
body { font-family: system-ui, sans-serif; max-width: 1000px; margin: 1.5em auto; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .5em 0; font-size: .9em; }
td, th { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: .85em; color: #444; }
.missing { background: #fff4e5; border-left: 4px solid #f0a030; padding: .4em .8em; margin: .5em 0; }
.ok { color: #2a7a2a; } .bad { color: #b02020; }
pre { background: #f7f7f7; padding: .6em; overflow-x: auto; font-size: .8em; }
"""
NOT_RECORDED = "not recorded in this run"


@dataclass
class Section:
    """Report content, rendered to both HTML and markdown."""

    title: str
    rows: list[tuple[str, str]] = field(default_factory=list)        # key/value table
    table: tuple[list[str], list[list[str]]] | None = None           # header, rows
    notes: list[str] = field(default_factory=list)                   # warnings (missing things)
    pre: str | None = None                                            # a verbatim block (config)


@dataclass
class PlotResult:
    spec: PlotSpec
    png: bytes | None
    path: Path | None
    reason: str | None    # why there is no plot


@dataclass
class Report:
    """What :func:`write_report` wrote."""

    html: Path
    markdown: Path
    plots: list[PlotResult]
    missing: list[str]

    @property
    def plot_paths(self) -> dict[str, Path]:
        return {p.spec.name: p.path for p in self.plots if p.path is not None}


def make_plots(specs: Sequence[PlotSpec], data: Any, out_dir: Path) -> list[PlotResult]:
    """Draw every plot into ``out_dir``/NAME.png; a plot without data gets its reason instead, and a
    plot that fails is reported (with the error) without stopping the others."""
    out_dir.mkdir(parents=True, exist_ok=True)
    res = []
    for spec in specs:
        path = out_dir / f"{spec.name}.png"
        try:
            fig = spec.make(data)
            png = png_bytes(fig)
        except NoData as e:
            path.unlink(missing_ok=True)
            res.append(PlotResult(spec, None, None, f"{NOT_RECORDED}: {e}"))
            continue
        except Exception as e:  # noqa: BLE001  one broken plot must not lose the report
            path.unlink(missing_ok=True)
            res.append(PlotResult(spec, None, None, f"plot failed: {type(e).__name__}: {e}"))
            continue
        path.write_bytes(png)
        res.append(PlotResult(spec, png, path, None))
    return res


# ============================================================================ formatting
def pct(x: Any) -> str:
    return "n/a" if not isinstance(x, (int, float)) or x != x else f"{100 * x:.1f}%"


def num(x: Any, fmt: str = "{:.3g}") -> str:
    if x is None:
        return NOT_RECORDED
    if isinstance(x, float):
        return "n/a" if x != x else fmt.format(x)
    return str(x)


def _esc(s: Any) -> str:
    return html.escape(str(s))


def render_html(title: str, subtitle: str, sections: Sequence[Section], plots: Sequence[PlotResult],
                after_plots: Sequence[Section] = ()) -> str:
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           '<link rel="icon" href="data:,">', f"<title>{_esc(title)}</title>", f"<style>{CSS}</style>",
           "</head><body>", f"<h1>{_esc(title)}</h1>", f"<p>{_esc(subtitle)}</p>"]

    def section(s: Section) -> None:
        out.append(f"<h2>{_esc(s.title)}</h2>")
        for n in s.notes:
            out.append(f'<div class="missing">{_esc(n)}</div>')
        if s.rows:
            out.append("<table>" + "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in s.rows)
                       + "</table>")
        if s.table:
            head, body = s.table
            out.append("<table><tr>" + "".join(f"<th>{_esc(h)}</th>" for h in head) + "</tr>"
                       + "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in r) + "</tr>" for r in body)
                       + "</table>")
        if s.pre is not None:
            out.append(f"<details><summary>show</summary><pre>{_esc(s.pre)}</pre></details>")

    for s in sections:
        section(s)
    out.append("<h2>Plots</h2>")
    for p in plots:
        if p.png is not None:
            b64 = base64.b64encode(p.png).decode()
            out.append(f'<figure id="{p.spec.name}"><img src="data:image/png;base64,{b64}" '
                       f'alt="{_esc(p.spec.title)}"><figcaption><b>{_esc(p.spec.title)}.</b> '
                       f"{_esc(p.spec.caption)}</figcaption></figure>")
        else:
            out.append(f'<div class="missing" id="{p.spec.name}"><b>{_esc(p.spec.title)}:</b> {_esc(p.reason)}</div>')
    for s in after_plots:
        section(s)
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def render_markdown(title: str, subtitle: str, sections: Sequence[Section], plots: Sequence[PlotResult],
                    rel: Path, after_plots: Sequence[Section] = ()) -> str:
    out = [f"# {title}", "", subtitle, ""]

    def cell(x: Any) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")

    def section(s: Section) -> None:
        out.extend([f"## {s.title}", ""])
        for n in s.notes:
            out.append(f"> **missing:** {n}")
        if s.notes:
            out.append("")
        if s.rows:
            out.extend(["| | |", "|---|---|"] + [f"| {cell(k)} | {cell(v)} |" for k, v in s.rows] + [""])
        if s.table:
            head, body = s.table
            out.extend(["| " + " | ".join(map(cell, head)) + " |", "|" + "---|" * len(head)])
            out.extend(["| " + " | ".join(map(cell, r)) + " |" for r in body] + [""])
        if s.pre is not None:
            out.extend(["```yaml", s.pre.rstrip(), "```", ""])

    for s in sections:
        section(s)
    out += ["## Plots", ""]
    for p in plots:
        if p.path is not None:
            out += [f"### {p.spec.title}", "", f"![{p.spec.title}]({(rel / p.path.name).as_posix()})", "",
                    p.spec.caption, ""]
        else:
            out += [f"### {p.spec.title}", "", f"_{p.reason}_", ""]
    for s in after_plots:
        section(s)
    return "\n".join(out) + "\n"


def _write(folder: Path, title: str, subtitle: str, sections: list[Section], plots: list[PlotResult],
           missing: list[str], after: Sequence[Section] = ()) -> Report:
    h = folder / "report.html"
    m = folder / "report.md"
    h.write_text(render_html(title, subtitle, sections, plots, after))
    m.write_text(render_markdown(title, subtitle, sections, plots, Path("plots"), after))
    return Report(h, m, plots, missing)


def _stamp() -> str:
    return f"written {datetime.now().isoformat(timespec='seconds')} by reflrl report"


# ============================================================================ a run
def run_sections(run: RunData) -> tuple[list[Section], list[Section]]:
    s = run.summary or {}
    prov = Section("Provenance", rows=[
        ("run folder", str(run.path.resolve())),
        ("model", run.cfg("model.name", s.get("config", {}).get("model", NOT_RECORDED))),
        ("faults", run.faults),
        ("seed", str(run.seed if run.seed is not None else NOT_RECORDED)),
        ("algorithm", f"advantage {run.cfg('algo.advantage', '?')}, policy loss {run.cfg('algo.policy_loss', '?')}, "
                      f"reward {run.cfg('env.reward', '?')}" if run.config else NOT_RECORDED),
    ])
    if run.versions:
        prov.rows += [(f"version: {k}", str(v)) for k, v in run.versions.items()]
    else:
        prov.rows.append(("versions", NOT_RECORDED + " (no versions.json)"))
    prov.notes = list(run.missing) + list(run.problems)
    res = Section("Results")
    if s:
        f = s.get("faults") or {}
        rec = D.recovery(run)
        ratio, unit = rec.recovered_ratio
        cps, calls, signals = D.calls_per_signal(run)
        t = s.get("time_s") or {}
        mid = s.get("accuracy_after_warmup")
        acc = (f"base {pct(s.get('accuracy_before'))} -> after warm-up {pct(mid)} -> after RL "
               f"{pct(s.get('accuracy_after'))}" if mid is not None else
               f"{pct(s.get('accuracy_before'))} -> {pct(s.get('accuracy_after'))}")
        gain = s.get("rl_gain")
        res.rows = [
            ("held-out accuracy", f"{acc} ({(s.get('eval_after') or {}).get('n', '?')} test tasks)"
                                  + (f"; RL gain {gain * 100:+.1f} points" if gain is not None else "")),
            ("RL steps", f"{s.get('steps')} (stopped by {s.get('stop_reason')})"),
            ("rollouts", f"{s.get('trajectories')} ({s.get('masked_trajectories')} masked: unrecovered env faults, "
                         "not penalised)"),
            ("tool calls", f"{f.get('calls')} ({f.get('attempts')} billed attempts, {f.get('retries')} retries)"),
            ("env faults by kind", ", ".join(f"{k}={v}" for k, v in sorted((f.get('faults_by_kind') or {}).items()))
             or "none"),
            ("recovered ratio", f"{num(ratio)} ({unit})"),
            ("tool calls per learning signal", f"{num(cps)} ({num(calls)} tool calls / {num(signals)} learning signals)"),
            ("time", ", ".join(f"{k[:-2]} {v:.0f}s" for k, v in t.items() if isinstance(v, (int, float)))),
            ("time split", _time_split_text(s.get("time_split"))),
            ("peak memory (resident)", _peak_memory_text(s.get("peak_rss_mb"))),
            ("evaluations", ", ".join(f"{k.replace('_', ' ')} {v:.0f}s" for k, v in (s.get("eval_seconds") or {}).items()
                                      if isinstance(v, (int, float))) or NOT_RECORDED),
        ]
        if s.get("precision"):
            pr = s["precision"]
            res.rows.append(("precision", f"{pr.get('dtype')} ({pr.get('reason')}); {s.get('threads', '?')} threads"))
    else:
        res.notes.append("no summary.json: final accuracy, fault totals and time totals are unknown; "
                         "the plots show what metrics.jsonl recorded")
        rows = run.train_rows()
        res.rows = [("RL steps logged", str(len(rows))),
                    ("last step", str(rows[-1]["step"]) if rows else "none")]
    held = heldout_section(run)
    refl = D.reflection_accounting(run)
    refl_sec = Section("Reflection accounting (Tool-ReRL)")
    if refl:
        refl_sec.rows = [(k, num(v) if not isinstance(v, str) else v) for k, v in refl.items()]
    else:
        refl_sec.notes.append(f"reflection {NOT_RECORDED} (no reflection, critic or importance-weight entries "
                              "in summary.json)")
    cfg = Section("Config (config.yaml)", pre=yaml.safe_dump(run.config, sort_keys=False) if run.config else None)
    if run.config is None:
        cfg.notes.append("config.yaml missing: the recipe that produced this run is unknown")
    first = []
    cuts = s.get("budget_cuts") or []
    if cuts:
        from ..budget import budget_cut_text

        first.append(Section("RESULT INCOMPLETE: the time budget cut this run",
                             notes=[budget_cut_text(c) for c in cuts]))
    return [*first, prov, res, *([held] if held else []), refl_sec], [cfg]


def heldout_section(run: RunData) -> Section | None:
    """The held-out numbers at base / after warm-up / after RL (summary ``heldout``): overall accuracy,
    accuracy with no fault met, recovery under faults, adaptation to API changes (overall and per kind,
    only where an evaluation met one), reflection's repair rate by cause; and RL's gain over the warm-up.
    None when the run recorded no held-out evaluation."""
    stages = D.heldout_stages(run)
    if not stages:
        return None
    cols = [(k, name) for k, name in D.HELDOUT_STAGES if k in stages]
    h = (run.summary or {}).get("heldout") or {}

    def count(stage: str, key: str) -> str:
        of = {"clean_accuracy": "n_clean", "recovery_under_faults": "n_faulted",
              "adaptation": "n_change_recoverable",
              "adaptation_param_renamed": "n_change_recoverable_param_renamed",
              "adaptation_tool_moved": "n_change_recoverable_tool_moved",
              "reflection_ratio_env_fault": "reflected_env_fault",
              "reflection_ratio_policy_error": "reflected_policy_error"}.get(key)
        n = (h.get(stage) or {}).get(of) if of else None
        return f" (of {n:.0f})" if isinstance(n, (int, float)) and not isinstance(n, bool) else ""

    body = []
    for key, label in D.HELDOUT_METRICS:
        vals = [stages[k].get(key) for k, _ in cols]
        if key.startswith("adaptation") and all(v is None for v in vals):
            continue  # no evaluation met an API change (of this kind)
        w, a = stages.get("after_warmup", {}).get(key), stages.get("after", {}).get(key)
        gain = f"{(a - w) * 100:+.1f} points" if w is not None and a is not None else "n/a"
        body.append([label] + [(pct(v) + count(k, key)) if v is not None else "n/a"
                               for (k, _), v in zip(cols, vals)] + [gain])
    seed = next((v.get("eval_fault_seed") for v in h.values() if isinstance(v, dict) and v.get("eval_fault_seed")
                 is not None), None)
    note = (f"Greedy episodes under the run's faults ({run.faults}; {(run.summary or {}).get('fault_exposure', 'client')} "
            f"sees them), evaluation fault seed {seed}: every checkpoint meets the same faults."
            if run.faults != "none" else "No faults: every episode is clean, so there is no recovery under faults.")
    return Section("Held-out: base, after warm-up, after RL",
                   table=(["metric"] + [name for _, name in cols] + ["RL gain (after RL - after warm-up)"], body),
                   rows=[("how", note)])


def _peak_memory_text(p: Any) -> str:
    """``load 0.90 GB, evaluations 3.10 GB, warm-up 2.60 GB, RL 3.40 GB; the run 3.40 GB``."""
    if not isinstance(p, dict) or "run" not in p:
        return NOT_RECORDED
    parts = [("load", "load"), ("evaluations", "eval"), ("warm-up", "warmup"), ("RL", "rl")]
    return ", ".join(f"{name} {p[k] / 1000:.2f} GB" for name, k in parts if k in p) + f"; the run {p['run'] / 1000:.2f} GB"


def _time_split_text(t: Any) -> str:
    """``load 20s (4%), evaluations 60s (12%), warm-up 100s (20%), RL 300s (60%), other 20s (4%)``."""
    if not isinstance(t, dict) or "total_s" not in t:
        return NOT_RECORDED
    parts = [("load", "load"), ("evaluations", "eval"), ("warm-up", "warmup"), ("RL", "rl"), ("other", "other")]
    return ", ".join(f"{name} {t[k + '_s']:.0f}s ({t[k + '_share']:.0%})" for name, k in parts if k + "_s" in t) \
        + f" of {t['total_s']:.0f}s"


def write_run_report(run: RunData) -> Report:
    plots = make_plots(RUN_PLOTS, run, run.path / "plots")
    before, after = run_sections(run)
    title = f"reflrl run report: {run.path.name}"
    sub = (f"{_stamp()}. Model {run.cfg('model.name', '?')}, faults {run.faults}, seed {run.seed}. "
           + ("Complete run." if not run.missing else f"{len(run.missing)} file(s) missing: see Provenance."))
    return _write(run.path, title, sub, before, plots, list(run.missing), after)


# ============================================================================ a sweep
def _cell_rows(sweep: SweepData) -> list[list[str]]:
    out = []
    for c in sweep.cells:
        e, s = c.entry, (c.run.summary if c.run else None) or {}
        link = f"{e.get('run_dir')}/report.html" if c.run and (c.run.path / "report.html").exists() else ""
        out.append([e.get("id", "?"), e.get("method", "?"), e.get("faults", "?"), str(e.get("seed", "?")),
                    e.get("status", "?") + ("" if c.done or not e.get("error") else f": {e['error'][:120]}"),
                    str(e.get("attempts", 0)), f"{e.get('wall_s', 0):.0f}",
                    pct(s.get("accuracy_before")), pct(s.get("accuracy_after")), link or "-"])
    return out


def _aggregate_rows(sweep: SweepData) -> list[list[str]]:
    groups: dict[tuple[str, str], list] = {}
    for c in sweep.cells:
        groups.setdefault((c.entry["method"], c.entry["faults"]), []).append(c)
    out = []
    for (m, f), cs in groups.items():
        done = [c for c in cs if c.done]

        def ms(vals: list, scale: float = 1.0, unit: str = "") -> str:
            mean, sd, n = D.mean_std([v for v in vals if v is not None])
            return "n/a" if n == 0 else f"{mean * scale:.3g} ± {sd * scale:.2g}{unit}"

        out.append([m, f, f"{len(done)}/{len(cs)}",
                    ms([c.run.summary.get("accuracy_before") for c in done], 100, "%"),
                    ms([c.run.summary.get("accuracy_after") for c in done], 100, "%"),
                    ms([D.recovery(c.run).recovered_ratio[0] for c in done]),
                    ms([D.calls_per_signal(c.run)[0] for c in done])])
    return out


def sweep_sections(sweep: SweepData) -> tuple[list[Section], list[Section]]:
    spec = sweep.spec
    prov = Section("Provenance", rows=[
        ("sweep folder", str(sweep.path.resolve())),
        ("methods", ", ".join(spec.get("methods", []))),
        ("fault grid", f"{spec.get('faults')} (expanded {spec.get('grid', 'per-kind')})"),
        ("seeds", ", ".join(map(str, spec.get("seeds", [])))),
        ("budget per cell", f"{spec['budget_minutes']:g} min" if spec.get("budget_minutes") else "the recipe's"),
        ("base config", spec.get("config") or "the default recipe (configs/default.yaml)"),
        ("overrides", " ".join(spec.get("overrides", [])) or "none"),
        ("created / updated", f"{sweep.manifest.get('created')} / {sweep.manifest.get('updated')}"),
    ])
    first = next((c.run for c in sweep.cells if c.run and c.run.versions), None)
    if first:
        prov.rows += [(f"version: {k}", str(v)) for k, v in first.versions.items()]
    else:
        prov.rows.append(("versions", NOT_RECORDED + " (no cell has versions.json yet)"))
    prov.notes = list(sweep.missing)
    n_done = sum(c.done for c in sweep.cells)
    agg = Section(f"Results by method and fault setting ({n_done}/{len(sweep.cells)} cells finished)",
                  table=(["method", "faults", "cells done", "accuracy before", "accuracy after",
                          "recovered ratio", "tool calls / learning signal"], _aggregate_rows(sweep)))
    cells = Section("Cells", table=(["cell", "method", "faults", "seed", "status", "attempts", "wall (s)",
                                     "acc. before", "acc. after", "run report"], _cell_rows(sweep)))
    recipes = []
    for m in spec.get("methods", []):
        p = sweep.path / "configs" / f"{m}.yaml"
        recipes.append(f"# configs/{m}.yaml\n" + (p.read_text() if p.is_file() else "# (missing)\n"))
    cfg = Section("Recipes (SWEEP/configs/)", pre="\n".join(recipes))
    return [prov, agg], [cells, cfg]


def write_sweep_report(sweep: SweepData) -> Report:
    plots = make_plots(SWEEP_PLOTS, sweep, sweep.path / "plots")
    before, after = sweep_sections(sweep)
    spec = sweep.spec
    title = f"reflrl fault sweep: {sweep.path.name}"
    sub = (f"{_stamp()}. {len(spec.get('methods', []))} methods x fault grid {spec.get('faults')!r} "
           f"({spec.get('grid', 'per-kind')}) x {len(spec.get('seeds', []))} seeds.")
    return _write(sweep.path, title, sub, before, plots, list(sweep.missing), after)
