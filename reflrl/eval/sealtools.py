"""Seal-Tools (Wu et al. 2025; Tool-ReRL appendix B): format rate, API P/R/F1 and parameter P/R/F1
as ``fairyshine/Seal-Tools: LLM_Evaluation/src/llm_tools/evaluation/calculate.py::
calculate_score_ToolLearning`` computes them, with the output parser of ``transform_output.py``
(case ``'ToolLearning'``).

Upstream rules reproduced:

* parsing (``transform_output_format``): replace ``'`` by ``"``, drop newlines, find ``[ { "api"``, take
  the text up to its matching ``]``; it must contain ``api``, ``parameters`` and ``responses`` and be
  JSON, otherwise the prediction is unparseable (-1);
* format rate (``AMOUNT``) = parseable predictions / samples;
* every predicted item with an ``"api"`` key counts as a predicted API; it is correct when SOME gold
  call has the same api name (the first such gold call is its match; gold calls are not consumed);
  each key of a dict ``"parameters"`` counts as a predicted parameter and is correct when the matched
  gold call has that parameter with ``str(value) == str(gold value)``;
* gold APIs / parameters are counted over all samples (unparseable predictions contribute only to
  the gold counts); P = correct/predicted, R = correct/gold, F1 = 2PR/(P+R).

Deviations, both where upstream would crash or print nothing: a metric whose counts are zero is
reported as 0.0 (upstream leaves the key out), and predicted items that are not objects are ignored
(upstream raises on them). Upstream reads the gold calls with ``eval``; we read the dataset's JSON.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .data import DataError, check_lengths, exists, first_existing, read_jsonl

METRICS = ("format_rate", "api_p", "api_r", "api_f1", "param_p", "param_r", "param_f1")
SPLIT_FILES = ("test_in_domain.jsonl", "test_out_domain.jsonl", "dev.jsonl", "dev_subset.jsonl")
SPLIT_NAMES = {"test_in_domain.jsonl": "in_domain", "test_out_domain.jsonl": "out_domain",
               "dev.jsonl": "dev", "dev_subset.jsonl": "dev_subset"}


@dataclass
class SealItem:
    id: str
    query: str
    calling: list[dict[str, Any]]
    messages: list[dict[str, str]]


def seal_dir(root: Path) -> Path:
    root = Path(root)
    d = first_existing([root / "seal-tools", root / "Seal-Tools_Dataset", root / "seal_tools", root])
    if d is None or not any(exists(d / f) for f in SPLIT_FILES):
        raise DataError(f"no Seal-Tools split ({', '.join(SPLIT_FILES)}) under {root}/seal-tools")
    return d


def split_files(root: Path) -> list[Path]:
    """Splits to evaluate: in-domain and out-of-domain tests when present, else dev, else dev_subset."""
    d = seal_dir(root)
    tests = [d / f for f in SPLIT_FILES[:2] if exists(d / f)]
    if tests:
        return tests
    return [first_existing([d / "dev.jsonl", d / "dev_subset.jsonl"])]


def load_tools(root: Path) -> dict[str, dict[str, Any]]:
    path = tool_file(root)
    return load_tools_file(path)


def tool_file(root: Path) -> Path:
    """``tool.jsonl`` (or the excerpt ``tool_subset.jsonl``) of the Seal-Tools folder under ``root``."""
    d = seal_dir(root)
    path = first_existing([d / "tool.jsonl", d / "tool_subset.jsonl"])
    if path is None:
        raise DataError(f"{d}: no tool.jsonl / tool_subset.jsonl")
    return path


def load_tools_file(path: Path) -> dict[str, dict[str, Any]]:
    """``{api_name: tool}`` of a tool file; DataError names a record without ``api_name``."""
    tools = {}
    for i, t in enumerate(read_jsonl(path)):
        if not isinstance(t, dict) or not isinstance(t.get("api_name"), str):
            raise DataError(f"{path}: record {i}: expected an object with 'api_name'")
        tools[t["api_name"]] = t
    return tools


def _check_record(rec: Any, path: Path, i: int) -> str:
    """Raise DataError unless ``rec`` is a split record (query, calls with api and parameters);
    returns the location text for further messages."""
    where = f"{path}: record {i}" + (f" (id {rec.get('id')!r})" if isinstance(rec, dict) else "")
    if not isinstance(rec, dict) or not isinstance(rec.get("query"), str) or not isinstance(rec.get("calling"), list):
        raise DataError(f"{where}: expected an object with 'query' and a 'calling' list")
    for c in rec["calling"]:
        if not isinstance(c, dict) or not isinstance(c.get("api"), str) or not isinstance(c.get("parameters"), dict):
            raise DataError(f"{where}: each call needs 'api' (string) and 'parameters' (object)")
    return where


def check_split(path: Path) -> list[dict[str, Any]]:
    """Every record of a split file, each checked (:func:`_check_record`)."""
    recs = read_jsonl(path)
    for i, rec in enumerate(recs):
        _check_record(rec, path, i)
    return recs


def load_split(path: Path, tools: dict[str, dict[str, Any]], limit: int | None = None,
               n_distractors: int = 3) -> list[SealItem]:
    """Records of a split; each prompt lists the record's gold tools plus ``n_distractors`` other tools
    chosen deterministically from the record id (reflrl's prompt; upstream's retrieval is not shipped)."""
    names = sorted(tools)
    out = []
    for i, rec in enumerate(read_jsonl(path)[: limit if limit is not None else None]):
        where = _check_record(rec, path, i)
        gold_names = [c["api"] for c in rec["calling"]]
        missing = [n for n in gold_names if n not in tools]
        if missing:
            raise DataError(f"{where}: calls tools missing from the tool file: {missing}")
        h = int(hashlib.sha256(str(rec.get("id", i)).encode()).hexdigest(), 16)
        others = [n for n in names if n not in gold_names]
        picks = [others[(h >> (8 * k)) % len(others)] for k in range(min(n_distractors, len(others)))] if others else []
        listed = list(dict.fromkeys(gold_names + picks))
        listed.sort(key=lambda n: hashlib.sha256((n + str(h)).encode()).hexdigest())
        out.append(SealItem(str(rec.get("id", i)), rec["query"], rec["calling"],
                            prompt_messages(rec["query"], [tools[n] for n in listed])))
    return out


def prompt_messages(query: str, tools: list[dict[str, Any]]) -> list[dict[str, str]]:
    system = ("You can call these APIs:\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) +
              '\n\nAnswer with the API calls that solve the request, as a JSON list and nothing else: '
              '[{"api": api name, "parameters": {name: value}, "responses": ["API_call_0", ...]}, ...]. '
              'Name each response "API_call_k" (k counting calls from 0); to pass a response to a later '
              'call use its name as the parameter value.')
    return [{"role": "system", "content": system}, {"role": "user", "content": query}]


def _match_square_bracket(text: str, pos_s: int) -> int:
    counter = -1
    for i in range(pos_s + 1, len(text)):
        if text[i] == "[":
            counter -= 1
        elif text[i] == "]":
            counter += 1
        if counter == 0:
            return i
    return -1


_START = re.compile(r"\[\s*\{\s*\"api\"", re.DOTALL)


def parse_output(output_text: Any) -> Any:
    """Upstream ``transform_output_format('ToolLearning', text)``: the call list, or -1."""
    if not isinstance(output_text, str):
        return -1
    text = re.sub("'", '"', output_text)
    text = re.sub("\n", "", text)
    m = re.search(_START, text)
    if m is None:
        return -1
    pos_s = m.span()[0]
    pos_e = _match_square_bracket(text, pos_s)
    text = text[pos_s: pos_e + 1]
    if "api" in text and "parameters" in text and "responses" in text:
        try:
            return json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            return -1
    return -1


def score(items: list[SealItem], outputs: list[Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Upstream ``calculate_score_ToolLearning`` over parsed outputs; metrics in percent."""
    check_lengths("sealtools", items, outputs)
    n_fmt = c_api = p_api = g_api = c_par = p_par = g_par = 0
    per = []
    for it, text in zip(items, outputs):
        gold = it.calling
        g_api += len(gold)
        for g in gold:
            g_par += len(g["parameters"])
        pred = parse_output(text)
        ok = pred != -1
        s_api = s_par = 0
        if ok:
            n_fmt += 1
            for pa in pred if isinstance(pred, list) else []:
                if not isinstance(pa, dict) or "api" not in pa:
                    continue
                p_api += 1
                params = pa.get("parameters")
                if isinstance(params, dict):
                    p_par += len(params)
                idx = next((k for k, g in enumerate(gold) if g["api"] == pa["api"]), -1)
                if idx != -1:
                    c_api += 1
                    s_api += 1
                    if isinstance(params, dict):
                        for name in params:
                            if name in gold[idx]["parameters"] and str(params[name]) == str(gold[idx]["parameters"][name]):
                                c_par += 1
                                s_par += 1
        per.append({"id": it.id, "parsed": ok, "prediction": pred if ok else None,
                    "correct_apis": s_api, "correct_params": s_par})

    def prf(c: int, p: int, g: int) -> tuple[float, float, float]:
        if c * p * g == 0:
            return 0.0, 0.0, 0.0
        P, R = c / p, c / g
        return 100 * P, 100 * R, 100 * 2 * P * R / (P + R)

    ap, ar, af = prf(c_api, p_api, g_api)
    pp, pr, pf = prf(c_par, p_par, g_par)
    n = len(items)
    metrics = {"format_rate": 100 * n_fmt / n if n else 0.0, "api_p": ap, "api_r": ar, "api_f1": af,
               "param_p": pp, "param_r": pr, "param_f1": pf, "n": n,
               "counts": {"correct_api": c_api, "predicted_api": p_api, "gold_api": g_api,
                          "correct_param": c_par, "predicted_param": p_par, "gold_param": g_par}}
    return metrics, per
