"""``reflrl eval compare RUN_A RUN_B``: for each metric, is the difference larger than seed noise?

Each metric's per-seed values of the two runs go through Welch's t-test (two-sided, 95%): the
difference "exceeds seed noise" when |t| is above the Student-t critical value for the
Welch-Satterthwaite degrees of freedom. With fewer than two seeds on a side (or zero variance on both)
noise cannot be estimated and the verdict says so. The manifests are compared too: any difference
other than the model (seeds, decoding, prompts, template, thinking history, data, packages) is
reported as a warning, since it can move scores as much as the model (the efficiency paper (arXiv:2606.00135) sec. 3).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .data import DataError, read_json
from .manifest import flatten, manifest_differences

# two-sided 95% Student-t critical values, df = 1..30 (then ~1.96)
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042]


def t_critical(df: float) -> float:
    if df < 1:
        return _T95[0]
    if df >= 30:
        return 1.96 + (2.042 - 1.96) * 30 / df  # approaches the normal quantile
    lo = int(math.floor(df))
    frac = df - lo
    hi = min(lo + 1, 30)
    return _T95[lo - 1] + frac * (_T95[hi - 1] - _T95[lo - 1])


def load_result(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    data = read_json(p)
    if not isinstance(data, dict) or data.get("kind") != "reflrl-eval-results":
        raise DataError(f"{p}: not a reflrl eval results.json")
    return data


def _metric_values(result: dict[str, Any]) -> dict[str, list[float]]:
    out = {}
    for k, v in flatten(result["results"]).items():
        if k.endswith(".values") and isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
            out[k[: -len(".values")]] = [float(x) for x in v]
    return out


def welch(a: list[float], b: list[float]) -> dict[str, Any]:
    """Welch's t-test on two samples of per-seed values."""
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    diff = mb - ma
    if len(a) < 2 or len(b) < 2:
        return {"diff": diff, "verdict": "unknown (needs >= 2 seeds per run)", "exceeds_noise": None}
    va = sum((x - ma) ** 2 for x in a) / (len(a) - 1)
    vb = sum((x - mb) ** 2 for x in b) / (len(b) - 1)
    se2 = va / len(a) + vb / len(b)
    if se2 == 0:
        same = diff == 0
        return {"diff": diff, "verdict": "equal" if same else "differs (no seed variance in either run)",
                "exceeds_noise": None if same else True}
    t = diff / math.sqrt(se2)
    df = se2 ** 2 / ((va / len(a)) ** 2 / (len(a) - 1) + (vb / len(b)) ** 2 / (len(b) - 1)) if va or vb else 1.0
    crit = t_critical(df)
    exceeds = abs(t) > crit
    return {"diff": diff, "t": t, "df": df, "critical": crit, "exceeds_noise": exceeds,
            "verdict": ("B better" if diff > 0 else "B worse") + " beyond seed noise" if exceeds
            else "within seed noise"}


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    va, vb = _metric_values(a), _metric_values(b)
    metrics = {}
    for k in sorted(set(va) & set(vb)):
        xa = [x for x in va[k] if x is not None]
        xb = [x for x in vb[k] if x is not None]
        if xa and xb:
            metrics[k] = {"a_mean": sum(xa) / len(xa), "b_mean": sum(xb) / len(xb), **welch(xa, xb)}
    return {"metrics": metrics, "only_in_a": sorted(set(va) - set(vb)), "only_in_b": sorted(set(vb) - set(va)),
            "manifest_differences": manifest_differences(a["manifest"], b["manifest"]),
            "models": [a["manifest"]["model"].get("model"), b["manifest"]["model"].get("model")]}


def format_comparison(c: dict[str, Any]) -> str:
    lines = [f"A = {c['models'][0]}   B = {c['models'][1]}", "",
             f"{'metric':58s} {'A':>8s} {'B':>8s} {'B-A':>8s}  verdict"]
    for k, m in c["metrics"].items():
        lines.append(f"{k[:58]:58s} {m['a_mean']:8.2f} {m['b_mean']:8.2f} {m['diff']:+8.2f}  {m['verdict']}")
    if c["manifest_differences"]:
        lines.append("")
        lines.append("WARNING: the runs differ in more than the model; scores may not be comparable:")
        lines += [f"  - {k}" for k in c["manifest_differences"]]
    if c["only_in_a"] or c["only_in_b"]:
        lines.append(f"\nmetrics only in A: {len(c['only_in_a'])}, only in B: {len(c['only_in_b'])}")
    return "\n".join(lines)
