"""The Tool-ReRL paper's reported numbers (Table 1 and Table 2; metric definitions in its appendix B),
kept so a report can show them beside a model's own: the scale of a result at a glance.

Table 1 gives, for Qwen2.5-7B and Llama3.1-8B and eight training variants, RoTBench's parameter
identification (Par.) and content filling (Cont.) on the five levels and TaskBench's four F1 on the
HuggingFace (HF) and Multimedia (Mm) domains. BFCL (Non-Live, Live) and Seal-Tools appear only in
Table 2, for four reasoning-source variants; its "Internal + IS" rows repeat Table 1's "+CoT+IS"
values (the RoTBench and TaskBench columns are the averages of Table 1's), so its BFCL and Seal-Tools
numbers belong to that variant. Seal-Tools' metric there is not named. All values are percent, on the
full test sets, for 7-8B models trained on ToolACE.
"""
from __future__ import annotations

from typing import Any

SOURCE = "Tool-ReRL paper, Table 1 (RoTBench, TaskBench) and Table 2 (BFCL, Seal-Tools)"
MODELS = ("Qwen2.5-7B", "Llama3.1-8B")
VARIANTS = ("Base", "SFT", "DPO", "PPO", "+CoT", "+Ref.", "+CoT+IS", "Tool-ReRL")

# Table 1, one list per row: the eight variants of Qwen2.5-7B, then those of Llama3.1-8B.
_T1_ROWS: dict[tuple[str, str, str], list[float]] = {
    ("rotbench", "clean", "parameter_identification"):
        [25.71, 33.33, 22.86, 56.19, 58.10, 49.52, 60.95, 63.86, 22.86, 0.95, 20.95, 48.57, 40.00, 36.19, 41.90, 53.33],
    ("rotbench", "clean", "content_filling"):
        [20.00, 26.67, 17.14, 44.76, 46.67, 40.95, 45.71, 51.43, 17.14, 0.00, 15.24, 36.19, 31.43, 30.48, 35.24, 40.00],
    ("rotbench", "heavy", "parameter_identification"):
        [21.90, 20.00, 21.43, 30.00, 37.62, 30.00, 39.05, 45.24, 13.33, 0.95, 13.33, 33.33, 25.71, 24.29, 26.19, 36.19],
    ("rotbench", "heavy", "content_filling"):
        [14.29, 16.19, 14.29, 22.38, 30.00, 22.86, 29.52, 32.86, 8.10, 0.48, 7.62, 21.90, 16.67, 16.19, 17.14, 23.81],
    ("rotbench", "medium", "parameter_identification"):
        [25.71, 23.33, 23.33, 49.52, 55.24, 45.71, 58.10, 59.05, 15.71, 4.29, 17.14, 46.67, 37.14, 35.71, 43.33, 53.81],
    ("rotbench", "medium", "content_filling"):
        [20.00, 20.48, 18.57, 39.05, 43.81, 34.76, 40.00, 48.57, 11.43, 3.81, 12.86, 33.81, 29.52, 29.05, 34.29, 39.05],
    ("rotbench", "slight", "parameter_identification"):
        [24.76, 29.52, 23.33, 50.00, 51.90, 42.38, 57.62, 60.95, 16.67, 2.38, 18.10, 40.95, 34.76, 30.95, 36.19, 47.62],
    ("rotbench", "slight", "content_filling"):
        [19.52, 23.81, 18.57, 39.52, 41.43, 33.33, 43.33, 50.00, 12.86, 1.90, 14.29, 29.05, 28.10, 25.71, 28.57, 33.81],
    ("rotbench", "union", "parameter_identification"):
        [20.95, 20.95, 24.76, 38.10, 45.71, 34.29, 45.71, 53.33, 14.29, 6.67, 13.33, 36.19, 29.52, 29.52, 34.29, 44.76],
    ("rotbench", "union", "content_filling"):
        [16.19, 24.76, 20.00, 26.67, 37.14, 25.71, 36.19, 42.86, 9.52, 5.71, 9.52, 21.90, 22.86, 21.90, 27.62, 32.38],
    ("taskbench", "huggingface", "node_f1"):
        [65.80, 61.18, 65.63, 64.35, 66.88, 66.74, 63.80, 68.70, 59.20, 61.18, 58.75, 61.93, 61.64, 64.13, 65.13, 67.51],
    ("taskbench", "huggingface", "arg_name_f1"):
        [60.50, 56.91, 60.36, 59.21, 61.80, 61.79, 59.10, 63.54, 48.70, 49.37, 48.30, 53.99, 53.71, 56.46, 58.30, 61.64],
    ("taskbench", "huggingface", "arg_value_f1"):
        [38.20, 36.93, 37.94, 38.60, 39.52, 38.97, 37.33, 40.78, 22.20, 23.69, 21.84, 29.12, 29.41, 30.41, 32.69, 38.76],
    ("taskbench", "huggingface", "link_f1"):
        [17.30, 16.66, 17.43, 16.36, 17.33, 17.68, 16.82, 18.59, 18.10, 16.92, 17.89, 18.70, 18.99, 19.17, 18.80, 19.62],
    ("taskbench", "multimedia", "node_f1"):
        [79.90, 77.64, 79.72, 80.59, 81.62, 81.14, 81.15, 82.32, 69.10, 77.73, 68.34, 72.47, 72.76, 75.62, 77.95, 77.78],
    ("taskbench", "multimedia", "arg_name_f1"):
        [74.50, 73.28, 74.38, 75.14, 76.39, 76.11, 76.57, 77.18, 59.70, 62.95, 58.99, 66.96, 67.46, 70.72, 72.94, 73.18],
    ("taskbench", "multimedia", "arg_value_f1"):
        [48.20, 48.62, 48.38, 49.91, 48.91, 49.85, 48.69, 50.49, 33.10, 30.98, 32.49, 41.31, 42.02, 43.85, 45.24, 47.76],
    ("taskbench", "multimedia", "link_f1"):
        [31.20, 30.26, 31.12, 31.57, 32.12, 31.69, 32.14, 32.54, 29.90, 32.16, 29.95, 32.23, 32.16, 32.97, 33.05, 33.70],
}

#: Table 2's BFCL and Seal-Tools columns ("Internal + IS" = Table 1's +CoT+IS), by model
TABLE2_COT_IS: dict[str, dict[str, float]] = {
    "Qwen2.5-7B": {"bfcl/non_live": 86.25, "bfcl/live": 78.68, "sealtools": 92.86},
    "Llama3.1-8B": {"bfcl/non_live": 85.17, "bfcl/live": 71.87, "sealtools": 92.65},
}


def table1() -> dict[tuple[str, str], dict[tuple[str, str, str], float]]:
    """``{(model, variant): {(benchmark, subset, metric): value}}`` of Table 1."""
    out: dict[tuple[str, str], dict[tuple[str, str, str], float]] = {}
    for key, row in _T1_ROWS.items():
        for m, model in enumerate(MODELS):
            for v, variant in enumerate(VARIANTS):
                out.setdefault((model, variant), {})[key] = row[m * len(VARIANTS) + v]
    return out


#: the paper's columns a report shows: the untrained models (the scale of a base model) and the
#: paper's method (the scale of a trained one)
REPORT_COLUMNS = (("Qwen2.5-7B", "Base"), ("Llama3.1-8B", "Base"), ("Qwen2.5-7B", "Tool-ReRL"),
                  ("Llama3.1-8B", "Tool-ReRL"))


def reference(benchmark: str, subset: str, metric: str) -> list[float | None]:
    """The paper's values for one report row, in :data:`REPORT_COLUMNS` order (None: not reported)."""
    t1 = table1()
    return [t1[col].get((benchmark, subset, metric)) for col in REPORT_COLUMNS]


def summary() -> dict[str, Any]:
    """Everything stored here, for results.json."""
    return {"source": SOURCE, "columns": [f"{m} {v}" for m, v in REPORT_COLUMNS],
            "table1": {f"{m} {v}": {"/".join(k): val for k, val in d.items()} for (m, v), d in table1().items()},
            "table2_cot_is": TABLE2_COT_IS}
