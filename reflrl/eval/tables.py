"""Markdown report in the layout of the Tool-ReRL paper's Table 1 (Tool-ReRL): one row per
benchmark x subset x metric, values ``mean ± std`` over seeds (percent), beside the paper's reported
values where it has them (:mod:`reflrl.eval.paper`), plus the run's key settings and size."""
from __future__ import annotations

from typing import Any

from . import paper, rotbench, taskbench

_ROT_METRICS = (("tool_selection", "TS"), ("parameter_identification", "Par."), ("content_filling", "Cont."))
_TB_METRICS = (("node_f1", "n_f1"), ("arg_name_f1", "t_f1"), ("arg_value_f1", "v_f1"), ("link_f1", "l_f1"))
_SEAL_METRICS = (("format_rate", "Format"), ("api_p", "API P"), ("api_r", "API R"), ("api_f1", "API F1"),
                 ("param_p", "Param P"), ("param_r", "Param R"), ("param_f1", "Param F1"))
_BFCL_GROUPS = (("non_live", "Non-Live"), ("live", "Live"), ("irrelevance", "Irrelevance"),
                ("multi_turn", "Multi-turn"), ("overall", "Overall"))


def fmt(stat: Any) -> str:
    """``{"mean", "std"}`` -> ``"12.34 ± 0.56"`` ("–" when missing)."""
    if not isinstance(stat, dict) or stat.get("mean") is None:
        return "–"
    return f"{stat['mean']:.2f} ± {stat['std']:.2f}"


def rows(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(benchmark, subset, metric, value) rows in the paper's order."""
    return [r[:4] for r in rows_with_paper(result)]


def _ref(benchmark: str, subset: str, metric: str) -> tuple[str, ...]:
    return tuple("–" if v is None else f"{v:.2f}" for v in paper.reference(benchmark, subset, metric))


def rows_with_paper(result: dict[str, Any]) -> list[tuple[str, ...]]:
    """(benchmark, subset, metric, value, *the paper's values in :data:`reflrl.eval.paper.REPORT_COLUMNS`
    order) rows in the paper's order."""
    res = result["results"]
    none = ("–",) * len(paper.REPORT_COLUMNS)
    out: list[tuple[str, ...]] = []
    for lv in ("clean", "heavy", "medium", "slight", "union"):  # the paper's CLE HEA MED SLI UNI
        if lv in res.get("rotbench", {}):
            for key, label in _ROT_METRICS:
                out.append(("RoTBench", rotbench.LEVEL_ABBR[lv], label, fmt(res["rotbench"][lv][key]),
                            *_ref("rotbench", lv, key)))
    for dom in taskbench.DOMAINS:
        r = res.get("taskbench", {}).get(dom)
        if r:
            for key, label in _TB_METRICS:
                out.append(("TaskBench", taskbench.DOMAIN_ABBR[dom], label,
                            f"{fmt(r['upstream'][key])} (strict {fmt(r['strict'][key])})",
                            *_ref("taskbench", dom, key)))
    if "bfcl_summary" in res:
        for key, label in _BFCL_GROUPS:
            v = res["bfcl_summary"].get(key)
            if isinstance(v, dict) and v.get("mean") is not None:
                out.append(("BFCL", label, "Acc.", fmt(v), *none))
        for cat, r in res.get("bfcl", {}).items():
            out.append(("BFCL", cat, "Acc.", fmt(r["accuracy"]), *none))
    for split, r in res.get("sealtools", {}).items():
        for key, label in _SEAL_METRICS:
            out.append(("Seal-Tools", split, label, fmt(r[key]), *none))
    return out


def size_lines(manifest: dict[str, Any]) -> list[str]:
    """What the run covered: a subset (the first N samples of each subset) or every sample."""
    rs = manifest.get("run_size")
    if not rs:
        return []
    head = ("- run size: a SUBSET (the first samples of every subset; `--full` runs everything)"
            if rs.get("subset") else "- run size: every sample")
    parts = []
    for b, v in rs.get("benchmarks", {}).items():
        of = f" of {v['available']}" if v.get("available") is not None else ""
        parts.append(f"{b} {v['samples']}{of} samples x {v['seeds']} seeds")
    return [head + ": " + "; ".join(parts)] if parts else [head]


def _paper_lines(result: dict[str, Any]) -> list[str]:
    res = result["results"]
    cols = ", ".join(f"{m} {v}" for m, v in paper.REPORT_COLUMNS)
    lines = ["", f"Paper columns: {paper.SOURCE}; {cols} (percent, full test sets, 7-8B models trained on "
             "ToolACE). They give the scale of a result; a subset run of another model is not the paper's "
             "setting. TaskBench compares the upstream value."]
    extra = []
    if "bfcl_summary" in res or "sealtools" in res:
        for model, vals in paper.TABLE2_COT_IS.items():
            extra.append(f"{model} +CoT+IS: BFCL Non-Live {vals['bfcl/non_live']:.2f}, Live {vals['bfcl/live']:.2f}, "
                         f"Seal-Tools {vals['sealtools']:.2f}")
        lines.append("The paper reports BFCL and Seal-Tools only for trained variants (Table 2; its Seal-Tools "
                     "metric is not named): " + "; ".join(extra) + ".")
    return lines


def _ids_over_seeds(ids: Any) -> list[str]:
    """Sorted distinct ids from one seed's list or a list of per-seed lists."""
    seeds_ids = ids if isinstance(ids, list) and ids and isinstance(ids[0], list) else [ids or []]
    return sorted({i for s in seeds_ids for i in (s or [])})


def markdown_report(result: dict[str, Any]) -> str:
    m = result["manifest"]
    model = m["model"]
    lines = [f"# reflrl eval: {model.get('model')}", ""]
    lines.append(f"- model: `{model.get('model')}` ({model.get('kind')}), weights sha256 "
                 f"`{(model.get('weights_sha256') or 'n/a')[:16]}`")
    d = m["decoding"]
    lines.append(f"- seeds: {m['seeds']}; decoding: temperature {d['temperature']}, top_p {d['top_p']}, "
                 f"max_new_tokens {d['max_new_tokens']}")
    lines.append(f"- multi-turn template: {m['multi_turn_template']}; thinking history kept: "
                 f"{m['keep_thinking_history']}; limit per subset: {m['limit_per_subset']}")
    lines += size_lines(m)
    lines.append("- values: mean ± std over seeds, percent. TaskBench: upstream's evaluate.py exactly (samples it "
                 "cannot score are left out), the strict value in brackets (every sample scored; unusable "
                 "predictions and unconvertible arguments count as wrong)")
    heads = " | ".join(f"{mdl} {var}" for mdl, var in paper.REPORT_COLUMNS)
    lines += ["", f"| Benchmark | Subset | Metric | Value | {heads} |",
              "|---|---|---|---|" + "---|" * len(paper.REPORT_COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows_with_paper(result)]
    lines += _paper_lines(result)
    tb = result["results"].get("taskbench", {})
    for dom, r in tb.items():
        flat = _ids_over_seeds(r.get("dropped_ids"))
        if flat:
            lines.append("")
            lines.append(f"TaskBench {dom}: upstream scored {r.get('n_scored_upstream')} of {r.get('n')} samples "
                         f"(per seed); left out upstream, wrong in strict: "
                         f"{', '.join(flat[:50])}{' ...' if len(flat) > 50 else ''}")
    for cat, r in result["results"].get("bfcl", {}).items():
        flat = _ids_over_seeds(r.get("unevaluated_ids"))
        if flat:
            lines.append("")
            lines.append(f"BFCL {cat}: outputs holding an expression bfcl would evaluate as code (not run here, "
                         f"scored wrong): {', '.join(flat[:50])}{' ...' if len(flat) > 50 else ''}")
    for s in result.get("skipped", []):
        lines.append(f"\nSkipped {s['unit']}: {s['reason']}")
    for n in result.get("notes", []):
        lines.append(f"\nNote: {n}")
    if "bfcl_summary" in result["results"]:
        lines.append(f"\nBFCL groups averaged over the categories run; Overall renormalises BFCL's weights "
                     f"over {result['results']['bfcl_summary'].get('groups_used')}.")
    return "\n".join(lines) + "\n"
