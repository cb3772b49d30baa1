"""The report's plots (matplotlib, Agg, no pyplot state): each returns a Figure or raises
:class:`NoData` with a sentence saying what the run did not record.

Run plots: reward and held-out accuracy; zero-variance prompts (efficiency paper, arXiv:2606.00135, Fig. 4); temporal
stability of all-correct prompts (efficiency paper, arXiv:2606.00135, Fig. 5); importance weights (Tool-ReRL Fig. 3,
top left); failures by cause and their recovery; time in rollout vs update.
Sweep plots: accuracy vs fault rate per method (mean ± std over seeds); recovered-trajectory ratio
vs fault rate; tool calls per learning signal vs fault rate.
Every axis is labelled with its unit.
"""
from __future__ import annotations

import io
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

from . import derive as D  # noqa: E402
from .data import RunData, SweepData  # noqa: E402

WIDE = (9.0, 3.8)
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#7f7f7f")


class NoData(Exception):
    """The run or sweep does not have what this plot needs; the message says what is missing."""


@dataclass(frozen=True)
class PlotSpec:
    name: str                         # file stem: plots/<name>.png
    title: str
    caption: str
    make: Callable[[Any], Figure]


def png_bytes(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _fig(ncols: int = 1, size: tuple[float, float] = WIDE) -> tuple[Figure, list]:
    fig = Figure(figsize=size, layout="constrained")
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, axes


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="#555",
            wrap=True)


# ============================================================================ run plots
def reward_accuracy(run: RunData) -> Figure:
    rows = run.train_rows()
    rs, rv = D.series(rows, "reward_mean")
    acc = D.accuracy(run)
    if not rs and not acc.test_steps:
        raise NoData("no reward_mean in the training rows and no held-out evaluation")
    fig, (a1, a2) = _fig(2)
    if rs:
        a1.plot(rs, rv, marker="o", ms=3, color=COLORS[0], label="mean reward (live rollouts)")
        reward = run.cfg("env.reward", "binary")
        a1.set_ylabel(f"reward ({reward} reward units)")
        a1.legend(fontsize=8)
    else:
        _note(a1, "reward not recorded in this run")
        a1.set_ylabel("reward (reward units)")
    a1.set_xlabel("RL step (policy updates)")
    a1.set_title("training reward")
    cs, cv = D.series(rows, "correct_rate")
    if cs:
        a2.plot(cs, [100 * v for v in cv], color=COLORS[2], alpha=0.6, lw=1, label="train rollouts correct")
    if acc.val_steps:
        a2.plot(acc.val_steps, [100 * v for v in acc.val_acc], marker="s", color=COLORS[3],
                label="validation accuracy")
    if acc.test_steps:
        start = "after warm-up, " if acc.base is not None else ""
        a2.errorbar(acc.test_steps, [100 * v for v in acc.test_acc], yerr=[100 * e for e in acc.test_err],
                    fmt="o-", color=COLORS[1], capsize=4, ms=6,
                    label=f"held-out test accuracy ({start}then after RL; ± s.e.)")
    if acc.base is not None:
        a2.axhline(100 * acc.base, ls=":", color="#555", lw=1,
                   label=f"base model, before the warm-up ({100 * acc.base:.1f}%)")
    a2.set_ylim(-3, 103)
    a2.set_xlabel("RL step (policy updates)")
    a2.set_ylabel("accuracy (% of tasks, exact match)")
    a2.set_title("held-out accuracy")
    a2.legend(fontsize=8)
    return fig


def zero_variance_plot(run: RunData) -> Figure:
    zv = D.zero_variance(run.train_rows())
    if zv is None:
        raise NoData("no zero_var_ratio in the training rows")
    fig, (ax,) = _fig(1)
    ax.plot(zv.steps, [1 - v for v in zv.zero_var], marker="o", ms=3, color=COLORS[0],
            label="non-zero variance (learning signal)")
    ax.plot(zv.steps, zv.zero_var, marker="o", ms=3, color=COLORS[7], label="zero variance (no signal)")
    if zv.all_correct_steps:
        ax.plot(zv.all_correct_steps, zv.all_correct, marker="^", ms=3, color=COLORS[3],
                label="all rollouts correct (max reward)")
    else:
        ax.text(0.01, 0.02, "all-correct share not recorded in this run (no group_all_correct)",
                transform=ax.transAxes, fontsize=8, color="#555")
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("RL step (policy updates)")
    ax.set_ylabel("share of prompt groups (fraction)")
    ax.set_title("zero-variance prompts per step (cf. efficiency paper (arXiv:2606.00135) Fig. 4)")
    ax.legend(fontsize=8)
    return fig


def temporal_stability_plot(run: RunData) -> Figure:
    st = D.temporal_stability(run.train_rows())
    if st is None:
        raise NoData("the training rows have no group_all_correct flags (per-prompt all-correct), "
                     "which this plot needs")
    fig, (ax,) = _fig(1)
    any_point = False
    for s, c in zip(st, (COLORS[0], COLORS[3])):
        if s.epochs:
            any_point = True
            ax.plot(s.epochs, s.prob, marker="o", color=c, label=f"k = {s.k}")
            for e, p, n in zip(s.epochs, s.prob, s.n):
                ax.annotate(f"n={n}", (e, p), textcoords="offset points", xytext=(0, 6 if s.k == 1 else -12), fontsize=7,
                            ha="center", color=c)
    if not any_point:
        _note(ax, "no prompt was all-correct k times before a later observation\n"
                  "(too few epochs, or no prompt ever all-correct)")
    else:
        ax.legend(fontsize=8, title="previous all-correct\nobservations", title_fontsize=8)
    ax.set_ylim(-0.03, 1.1)
    ax.set_xlabel("epoch (passes over the training prompts)")
    ax.set_ylabel("P(still all-correct | k) (probability)")
    ax.set_title("temporal stability of all-correct prompts (cf. efficiency paper (arXiv:2606.00135) Fig. 5)")
    return fig


def importance_weights(run: RunData) -> Figure:
    rows = run.train_rows()
    km = D.find_key(rows, D.IW_MEAN_KEYS)
    if km is None:
        raise NoData("no Tool-ReRL repaired trajectories in the metrics ("
                     f"looked for {', '.join(D.IW_MEAN_KEYS)})")
    xs, ys = D.series(rows, km)
    fig, (ax,) = _fig(1)
    ax.plot(xs, ys, marker="o", ms=3, color=COLORS[4], label=f"mean ({km})")
    ks = D.find_key(rows, D.IW_STD_KEYS)
    if ks:
        sd = dict(zip(*D.series(rows, ks)))
        lo = [y - sd.get(x, 0.0) for x, y in zip(xs, ys)]
        hi = [y + sd.get(x, 0.0) for x, y in zip(xs, ys)]
        ax.fill_between(xs, lo, hi, color=COLORS[4], alpha=0.2, label="± 1 std over repaired trajectories")
    ax.set_xlabel("RL step (policy updates)")
    ax.set_ylabel("importance weight (ratio, dimensionless)")
    ax.set_title("importance weights of reflection-repaired trajectories (cf. Tool-ReRL Fig. 3)")
    ax.legend(fontsize=8)
    return fig


def failures(run: RunData) -> Figure:
    rec = D.recovery(run)
    if run.summary is None and not rec.rollouts:
        raise NoData("no summary.json (fault ledger totals) and no per-step reflect/* counts")
    fig, (a1, a2, a3) = _fig(3, size=(11.0, 3.9))
    kinds = sorted(rec.faults_by_kind)
    if kinds:
        a1.bar(kinds, [rec.faults_by_kind[k] for k in kinds], color=COLORS[1])
        a1.tick_params(axis="x", labelrotation=30, labelsize=8)
    else:
        _note(a1, "no env fault observed" if run.summary else "fault ledger not recorded\n(no summary.json)")
    a1.set_xlabel("fault kind")
    a1.set_ylabel("env faults observed (tool-call attempts)")
    a1.set_title("env faults by kind", fontsize=10)
    calls = [("recovered\nby retry", rec.calls_recovered, COLORS[2]), ("given up", rec.calls_given_up, COLORS[1]),
             ("policy\nerror", rec.calls_policy_errors, COLORS[7])]
    calls = [c for c in calls if c[1] is not None]
    if calls:
        a2.bar(range(len(calls)), [c[1] for c in calls], color=[c[2] for c in calls])
        a2.set_xticks(range(len(calls)), [c[0] for c in calls], fontsize=8)
        for i, c in enumerate(calls):
            a2.annotate(str(c[1]), (i, c[1]), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7)
        a2.set_ylim(0, max(1, max(c[1] for c in calls)) * 1.15)
    else:
        _note(a2, "fault ledger not recorded\n(no summary.json)")
    a2.set_xlabel("outcome of the tool call")
    a2.set_ylabel("tool calls")
    a2.set_title("tool calls", fontsize=10)
    r = rec.rollouts
    if r:
        causes = ["env fault", "policy error"]
        retry = [r["recovered_by_retry"] + r.get("recovered_by_policy", 0.0), 0.0]
        refl = [r["recovered_env_fault"], r["recovered_policy_error"]]
        lost = [max(0.0, r["failed_env_fault"] - r["recovered_env_fault"]),
                max(0.0, r["failed_policy_error"] - r["recovered_policy_error"])]
        a3.bar(causes, retry, color=COLORS[2], label="recovered by the client's retries or the policy calling again"
               if r.get("recovered_by_policy") else "recovered by the client's retries")
        a3.bar(causes, refl, bottom=retry, color=COLORS[4], label="recovered by reflection")
        a3.bar(causes, lost, bottom=[x + y for x, y in zip(retry, refl)], color=COLORS[7],
               label="not recovered (env-fault rollouts masked)")
        tops = [retry[i] + refl[i] + lost[i] for i in range(2)]
        for i, tot in enumerate(tops):
            a3.annotate(f"{tot:.0f}", (i, tot), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7)
        a3.set_ylim(0, max(1.0, max(tops)) * 1.45)  # room for the legend above the bars
        a3.legend(fontsize=7, loc="upper center")
        a3.set_title(f"rollouts by cause (of {r['rollouts']:.0f})", fontsize=10)
    else:
        _note(a3, "per-rollout recovery not recorded in this run")
        a3.set_title("rollouts by cause", fontsize=10)
    a3.set_xlabel("cause of the failure")
    a3.set_ylabel("rollouts")
    return fig


def time_split(run: RunData) -> Figure:
    rows = run.train_rows()
    rs, rv = D.series(rows, "time_rollout_s")
    us, uv = D.series(rows, "time_update_s")
    t = (run.summary or {}).get("time_s") or {}
    if not rs and not t:
        raise NoData("no time_rollout_s / time_update_s in the training rows and no summary time_s")
    fig, (a1, a2) = _fig(2)
    if rs and us and rs == us:
        a1.bar(rs, rv, color=COLORS[0], label="rollout (generation + tools)")
        a1.bar(us, uv, bottom=rv, color=COLORS[3], label="policy update")
        a1.legend(fontsize=8)
    else:
        _note(a1, "per-step times not recorded in this run")
    a1.set_xlabel("RL step (policy updates)")
    a1.set_ylabel("wall time per step (s)")
    a1.set_title("time per step: rollout vs update")
    if t:
        keys = [k for k in ("load_s", "eval_s", "warmup_s", "rollout_s", "update_s") if k in t]
        a2.barh([k[:-2] for k in keys], [t[k] for k in keys],
                color=[COLORS[7], COLORS[2], COLORS[5], COLORS[0], COLORS[3]][: len(keys)])
        if "total_s" in t:
            a2.set_title(f"whole run: {t['total_s']:.0f} s in total", fontsize=10)
    else:
        _note(a2, "run totals not recorded (no summary.json)")
        a2.set_title("whole run", fontsize=10)
    a2.set_xlabel("wall time (s)")
    a2.set_ylabel("phase")
    return fig


STAGE_STYLE = {"base": ("s", "#555555"), "after warm-up": ("D", COLORS[3]), "after RL": ("o", COLORS[1])}


def learning_curves_plot(run: RunData) -> Figure:
    """Four panels: overall accuracy, accuracy with no fault met, recovery under faults, reflection's repair
    rate by cause; a fifth, adaptation to API changes (overall and per kind), when the run met one. Each
    with the RL rollouts' value per step, the held-out points (base, after warm-up, after RL) and
    validation."""
    curves = {c.key: c for c in D.learning_curves(run)}
    if all(c.empty for c in curves.values()):
        raise NoData("no per-step rollout metrics and no held-out evaluation")
    panels = [("overall accuracy", ["accuracy"]), ("accuracy, no fault met", ["clean_accuracy"]),
              ("recovery under faults (episodes that met a fault, share right)", ["recovery_under_faults"]),
              ("reflection's repair rate by cause", ["reflection_ratio_env_fault", "reflection_ratio_policy_error"])]
    adapt = ["adaptation", "adaptation_param_renamed", "adaptation_tool_moved"]
    if any(not curves[k].empty for k in adapt):
        panels.append(("adaptation to API changes (call at the change right apart from it, share right)", adapt))
    names = {"reflection_ratio_env_fault": "fault-caused", "reflection_ratio_policy_error": "policy errors",
             "adaptation_param_renamed": "param renamed", "adaptation_tool_moved": "tool moved"}
    rows = (len(panels) + 1) // 2
    fig = Figure(figsize=(11.0, 3.6 * rows), layout="constrained")
    for i, (title, keys) in enumerate(panels):
        ax = fig.add_subplot(rows, 2, i + 1)
        ax.grid(True, alpha=0.3)
        drew = False
        for j, key in enumerate(keys):
            c = curves[key]
            tag = f"{names[key]}: " if key in names else ""
            ls = ("-", "--", ":")[min(j, 2)]
            if c.rollout_steps:
                ax.plot(c.rollout_steps, [100 * v for v in c.rollout], ls, color=COLORS[(0, 4, 5)[min(j, 2)]], lw=1,
                        alpha=0.7, marker=".", ms=4, label=f"{tag}RL rollouts (per step)")
            if c.val_steps:
                ax.plot(c.val_steps, [100 * v for v in c.val], ls, color=COLORS[2], marker="^", ms=5,
                        label=f"{tag}validation (greedy)")
            for name, step, v in c.points:
                marker, color = STAGE_STYLE.get(name, ("o", COLORS[7]))
                ax.plot([step], [100 * v], marker=marker, color=color, ms=8 if j == 0 else 6, ls="none",
                        mfc=color if j == 0 else "none", label=f"{tag}held-out, {name}")
            drew = drew or not c.empty
        if not drew:
            _note(ax, "not recorded in this run" + (" (no faults: no episode met one)"
                                                    if run.faults == "none" and keys[0] != "accuracy" else ""))
        else:
            ax.legend(fontsize=7)
        ax.set_ylim(-3, 103)
        ax.set_xlabel("RL step (policy updates)")
        ax.set_ylabel("% of episodes" if not keys[0].startswith("reflection") else "% of failures reflected on")
        ax.set_title(title, fontsize=10)
    return fig


RUN_PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec("reward_accuracy", "Reward and held-out accuracy",
             "Left: mean reward of the live (unmasked) rollouts per RL step. Right: held-out test accuracy "
             "before and after training (greedy exact match, ± standard error), validation accuracy when "
             "evaluated during training, and the share of training rollouts that were correct.",
             reward_accuracy),
    PlotSpec("learning_curves", "Learning curves: accuracy, no fault met, recovery under faults, reflection",
             "Per RL step, the RL rollouts' own numbers (sampled at the rollout temperature): overall accuracy "
             "(share of episodes that ended right), accuracy of the episodes that met no fault, recovery under "
             "faults (of the episodes that met at least one fault, the share that still ended right), "
             "reflection's repair rate on the failures it reflected on, fault-caused vs policy errors, and, when "
             "the run met API changes (param_renamed, tool_moved), adaptation: of the episodes whose call at the "
             "change was right apart from it, the share that ended right, overall and per kind. The large "
             "markers are the held-out evaluations (greedy, the evaluation's fixed fault seed): base model and "
             "after the warm-up at step 0, after RL at the last step; triangles are validation evaluations "
             "(train.eval_every).",
             learning_curves_plot),
    PlotSpec("zero_variance", "Zero-variance prompts",
             "Share of prompt groups per step whose rollout rewards have no variance (no learning signal), and "
             "the share whose rollouts were all correct (efficiency paper (arXiv:2606.00135), sec. 4.1, Fig. 4).",
             zero_variance_plot),
    PlotSpec("temporal_stability", "Temporal stability of all-correct prompts",
             "P(still all-correct | all-correct in the previous k observations) per epoch, k = 1, 2; n = prompts "
             "conditioned on (efficiency paper (arXiv:2606.00135), sec. 4.1, Fig. 5). With the pre-rollout filter on, skipped epochs are "
             "not observations.",
             temporal_stability_plot),
    PlotSpec("importance_weights", "Importance weights",
             "Mean (± std) importance weight of the reflection-repaired trajectories per step "
             "(Tool-ReRL, sec. 3.3 eq. 2, Fig. 3 top left).",
             importance_weights),
    PlotSpec("failures", "Failures by cause and their recovery",
             "Left: env faults observed per tool-call attempt, by kind (fault ledger). Middle: faulted tool calls "
             "recovered by the client's retries or given up, and calls that failed by the policy's error. Right: "
             "rollouts that went wrong, by cause, and how they were recovered: by the client's retries, by "
             "reflection (Tool-ReRL sec. 3.2) or not (an unrecovered env fault is masked: never penalised).",
             failures),
    PlotSpec("time", "Time in rollout vs update",
             "Left: wall time per RL step split into rollout (generation and tool calls) and policy update. "
             "Right: the run's totals by phase.",
             time_split),
)


# ============================================================================ sweep plots
@dataclass
class Point:
    method: str
    axis: str          # the kind on the x axis ("total" for product grids)
    x: float
    values: list[float]


def _axes_of(sweep: SweepData) -> list[str]:
    """Per-kind grids: one x axis per kind (its rate); product grids: one axis, the total rate."""
    if sweep.spec.get("grid", "per-kind") == "product" or not sweep.kinds:
        return ["total"]
    return sweep.kinds


def _x(entry: dict[str, Any], axis: str) -> float | None:
    rates = entry.get("rates", {})
    if axis == "total":
        return float(sum(rates.values()))
    others = sum(v for k, v in rates.items() if k != axis)
    return None if others > 0 else float(rates.get(axis, 0.0))


def sweep_points(sweep: SweepData, value: Callable[[RunData], float | None]) -> list[Point]:
    """Per method, axis and x: the values of the finished cells (None values dropped)."""
    acc: dict[tuple[str, str, float], list[float]] = defaultdict(list)
    for c in sweep.cells:
        if not c.done:
            continue
        v = value(c.run)
        for axis in _axes_of(sweep):
            x = _x(c.entry, axis)
            if x is None:
                continue
            key = (c.entry["method"], axis, x)
            acc.setdefault(key, [])
            if v is not None and math.isfinite(v):
                acc[key].append(float(v))
    return [Point(m, a, x, vs) for (m, a, x), vs in sorted(acc.items())]


def _sweep_figure(sweep: SweepData, value: Callable[[RunData], float | None], ylabel: str, title: str,
                  scale: float = 1.0, ylim: tuple[float, float] | None = None, empty: str = "") -> Figure:
    if not any(c.done for c in sweep.cells):
        raise NoData("no cell of the sweep has finished (no summary.json yet)")
    axes_names = _axes_of(sweep)
    pts = sweep_points(sweep, value)
    fig, axes = _fig(len(axes_names), size=(max(7.0, 4.6 * len(axes_names)), 4.0))
    methods = sweep.methods
    for ax, axis in zip(axes, axes_names):
        plotted = False
        for j, m in enumerate(methods):
            ps = [p for p in pts if p.method == m and p.axis == axis and p.values]
            if not ps:
                continue
            stats = [D.mean_std(p.values) for p in ps]
            off = (j - (len(methods) - 1) / 2) * 0.004  # small dodge so error bars don't overlap
            ax.errorbar([p.x + off for p in ps], [s[0] * scale for s in stats], yerr=[s[1] * scale for s in stats],
                        fmt="-o", capsize=4, color=COLORS[j % len(COLORS)], label=f"{m} (n={max(s[2] for s in stats)} seeds)")
            plotted = True
        if not plotted:
            _note(ax, empty or "no value recorded for this quantity")
        else:
            ax.legend(fontsize=8)
        if ylim:
            ax.set_ylim(*ylim)
        ax.set_xlabel("total fault probability per tool-call attempt" if axis == "total"
                      else f"{axis} fault rate (probability per attempt)")
        ax.set_ylabel(ylabel)
    fig.suptitle(title, fontsize=10)
    return fig


def _acc_after(run: RunData) -> float | None:
    return (run.summary or {}).get("accuracy_after")


def _recovered(run: RunData) -> float | None:
    return D.recovery(run).recovered_ratio[0]


def _calls_per_signal(run: RunData) -> float | None:
    return D.calls_per_signal(run)[0]


def accuracy_vs_faults(sweep: SweepData) -> Figure:
    return _sweep_figure(sweep, _acc_after, "held-out accuracy after training (%)",
                         "accuracy vs fault rate (mean ± std over seeds)", scale=100.0, ylim=(-3, 103))


def recovered_vs_faults(sweep: SweepData) -> Figure:
    units = {D.recovery(c.run).recovered_ratio[1] for c in sweep.cells if c.done}
    unit = "tool calls" if "tool calls" in units else "rollouts"
    return _sweep_figure(sweep, _recovered, f"recovered share of failed {unit}",
                         "recovered-trajectory ratio vs fault rate (mean ± std over seeds)", ylim=(-0.03, 1.03),
                         empty="no env fault hit a trajectory (no tool call made, or no faults injected)")


def calls_vs_faults(sweep: SweepData) -> Figure:
    return _sweep_figure(sweep, _calls_per_signal, "tool calls per signal (calls / trajectory)",
                         "tool calls per learning signal vs fault rate (mean ± std over seeds)",
                         empty="no learning signal (no prompt group with reward variance) in any finished cell")


SWEEP_PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec("accuracy_vs_faults", "Accuracy vs fault rate",
             "Held-out test accuracy after training per method, mean ± standard deviation over seeds, against "
             "the fault rate (one panel per fault kind swept; the no-fault cells are each panel's rate 0).",
             accuracy_vs_faults),
    PlotSpec("recovered_vs_faults", "Recovered-trajectory ratio vs fault rate",
             "Of the rollouts that went wrong at some point (an env fault, recovered by the retries or not, or a "
             "policy error), the share that ended usable: (recovered by retry + recovered by reflection) / "
             "(recovered by retry + failed); mean ± std over seeds.",
             recovered_vs_faults),
    PlotSpec("calls_per_signal", "Tool calls per learning signal",
             "Tool calls (of the rollouts and of the reflection retries) per trajectory with a learning signal "
             "(a non-zero advantage that was trained): what one unit of learning signal costs in tool traffic; "
             "mean ± std over seeds.",
             calls_vs_faults),
)
