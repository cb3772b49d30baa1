"""TaskBench (Shen et al. 2024; papers/003 appendix B): node F1, link F1, argument-name F1 (t-F1)
and argument-value F1 (v-F1), as ``microsoft/JARVIS: taskbench/evaluate.py`` computes them.

Upstream rules reproduced (``evaluate()``, metrics ``f1``/``argument``/``link``, split "overall"):

* a prediction is ``{"task_steps", "task_nodes": [{"task", "arguments"}], "task_links"}``; the gold is a
  ``data.json`` line in either schema (upstream: ``task_steps``/``task_nodes``/``task_links`` lists;
  dataset hub: ``tool_steps``/``tool_nodes``/``tool_links`` JSON-encoded strings + ``instruction``);
* dependency type ``resource`` (huggingface, multimedia) vs ``temporal`` (dailylifeapis), upstream's
  ``--dependency_type``: with ``resource`` node names have ``_`` replaced by spaces, each argument
  becomes ``{name: content type or the source tool's output type, value}`` and the links are rebuilt
  from ``<node-j>`` references (the gold ``task_links`` are ignored); with ``temporal`` names,
  arguments and ``task_links`` are used as given;
* each metric is a micro F1 over samples after upstream's ``flatten``: per sample the union of gold
  and predicted items (sets, exact string match); node F1 counts only names that are tool ids of
  ``tool_desc.json`` (an unknown predicted tool is neither a true nor a false positive, as in
  upstream's ``labels=types``); t-F1 over ``"task-argname"``, v-F1 over ``"task-argname-value"``,
  link F1 over ``(source, target)`` pairs; an F1 with no positives is 0 (sklearn's zero_division);
* a sample whose prediction cannot be converted (upstream: "Parsing Error ... Ignore #id") or has no
  parseable prediction at all is DROPPED by upstream. We report that number (``upstream``) and the
  strict one (``strict``: such samples count with an empty prediction, i.e. all gold items missed),
  and list the ids.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .data import DataError, first_existing, read_json, read_json_or_jsonl

DOMAINS = ("huggingface", "multimedia", "dailylifeapis")
DOMAIN_ABBR = {"huggingface": "HF", "multimedia": "Mm", "dailylifeapis": "DL"}
DEPENDENCY = {"huggingface": "resource", "multimedia": "resource", "dailylifeapis": "temporal"}
METRICS = ("node_f1", "link_f1", "arg_name_f1", "arg_value_f1")


@dataclass
class TaskItem:
    id: str
    domain: str
    request: str
    gold: dict[str, Any]  # task_steps / task_nodes / task_links (upstream schema)
    messages: list[dict[str, str]] = field(default_factory=list)


def domain_dir(root: Path, domain: str) -> Path:
    root = Path(root)
    d = first_existing([root / "taskbench" / f"data_{domain}", root / f"data_{domain}"])
    if d is None:
        raise DataError(f"no TaskBench folder data_{domain} under {root} (or {root}/taskbench)")
    return d


def load_tool_desc(root: Path, domain: str) -> dict[str, Any]:
    path = domain_dir(root, domain) / "tool_desc.json"
    td = read_json(path)
    if not isinstance(td, dict) or not isinstance(td.get("nodes"), list) or not all(
            isinstance(n, dict) and isinstance(n.get("id"), str) for n in td["nodes"]):
        raise DataError(f"{path}: expected {{'nodes': [{{'id': ..}}, ...]}}")
    return td


def gold_file(root: Path, domain: str) -> Path | None:
    d = domain_dir(root, domain)
    return first_existing([d / "data.json", d / "data.jsonl", d / "test.jsonl"])


def _decode_field(v: Any) -> Any:
    return json.loads(v) if isinstance(v, str) else v


def normalize_gold(rec: Any, path: Path, i: int) -> dict[str, Any]:
    """Either gold schema -> ``{"id", "request", "task_steps", "task_nodes", "task_links"}``."""
    where = f"{path}: record {i}" + (f" (id {rec.get('id')!r})" if isinstance(rec, dict) else "")
    if not isinstance(rec, dict) or "id" not in rec:
        raise DataError(f"{where}: expected an object with an 'id'")
    try:
        if "task_nodes" in rec:
            steps, nodes, links = rec.get("task_steps", []), rec["task_nodes"], rec.get("task_links", [])
        elif "tool_nodes" in rec:
            steps, nodes, links = (_decode_field(rec.get("tool_steps", "[]")), _decode_field(rec["tool_nodes"]),
                                   _decode_field(rec.get("tool_links", "[]")))
        else:
            raise DataError(f"{where}: has neither 'task_nodes' (upstream schema) nor 'tool_nodes' (hub schema)")
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: a tool_* field is not valid JSON: {e.msg}") from None
    if not isinstance(nodes, list) or not all(isinstance(n, dict) and isinstance(n.get("task"), str) for n in nodes):
        raise DataError(f"{where}: nodes must be a list of objects with a 'task' name")
    if not isinstance(links, list):
        raise DataError(f"{where}: links must be a list")
    request = rec.get("user_request", rec.get("instruction", ""))
    return {"id": str(rec["id"]), "request": str(request), "task_steps": steps, "task_nodes": nodes,
            "task_links": links, "type": rec.get("type")}


def load_domain(root: Path, domain: str, limit: int | None = None) -> list[TaskItem]:
    """Gold samples of a domain (first ``limit``). DataError when the gold file is missing/malformed."""
    if domain not in DOMAINS:
        raise ValueError(f"unknown TaskBench domain {domain!r}; expected one of {DOMAINS}")
    path = gold_file(root, domain)
    if path is None:
        raise DataError(f"{domain_dir(root, domain)}: no data.json (the gold task graphs); TaskBench's "
                        "data.json is not part of the shared excerpt -- get it from microsoft/JARVIS "
                        "taskbench or the dataset hub")
    recs = read_json_or_jsonl(path)
    out = []
    for i, rec in enumerate(recs[: limit if limit is not None else None]):
        g = normalize_gold(rec, path, i)
        out.append(TaskItem(g["id"], domain, g["request"], g))
    return out


_JSON_OBJ = re.compile(r"\{.*\}", re.S)


def parse_prediction(text: Any) -> dict[str, Any] | None:
    """The predicted graph from model text (the first-to-last brace span as JSON); None if absent."""
    if not isinstance(text, str):
        return None
    s = text.strip()
    for cand in (s, *(m.group(0) for m in [_JSON_OBJ.search(s)] if m)):
        try:
            obj = json.loads(cand)
        except (json.JSONDecodeError, RecursionError):
            continue
        if isinstance(obj, dict) and isinstance(obj.get("task_nodes"), list):
            return obj
    return None


def _content_type(content: str) -> str:
    """Upstream ``get_content_type``."""
    content = content.strip("'")
    for ext in ["jpg", "png", "jpeg", "gif", "bmp", "tiff", "svg", "ico"]:
        if "." + ext in content:
            return "image"
    for ext in ["mp3", "wav", "wma", "ogg", "aac", "flac", "aiff", "au"]:
        if "." + ext in content:
            return "audio"
    for ext in ["mp4", "avi", "mov", "flv", "wmv", "mkv", "webm", "m4v", "mpg", "mpeg"]:
        if "." + ext in content:
            return "video"
    return "text"


def _resource_args(nodes: list[dict], names: list[str], out_type: dict[str, str], *, label: bool
                   ) -> tuple[list[list[dict]], list[dict]]:
    """Upstream's per-node argument rewrite (resource mode), including its quirks: an argument whose
    conversion raises re-appends the previous argument (or, when there is none, fails the sample)."""
    links: list[dict] = []
    all_args = []
    for inx, node in enumerate(nodes):
        new_arguments = []
        new_argument: Any = _UNSET
        for argument in (node["arguments"] if label else node.get("arguments", [])):
            try:
                if isinstance(argument, dict):
                    argument = list(argument.values())[0]
                if isinstance(argument, list):
                    argument = " ".join(argument)
                if (label or isinstance(argument, str)) and "<node-" in argument:
                    s = argument.index("<node-") + 6
                    e = argument.index(">")
                    if int(argument[s:e]) == inx:
                        continue
                    src = names[int(argument[s:e])]
                    links.append({"source": src, "target": node["task"]})
                    new_argument = {"name": out_type.get(src, "other"), "value": src}
                else:
                    new_argument = {"name": _content_type(argument), "value": argument}
            except Exception:  # noqa: BLE001  upstream: `except Exception: pass`
                pass
            if new_argument is _UNSET:
                raise _SampleError("argument conversion failed with no previous argument")
            new_arguments.append(new_argument)
        all_args.append(new_arguments)
    return all_args, links


class _SampleError(Exception):
    pass


_UNSET = object()


def _sample_sets(gold: dict, pred: dict, dependency: str, out_type: dict[str, str]) -> dict[str, list]:
    """Upstream per-sample conversion -> the lists fed to ``flatten``; raises on a parsing error."""
    import copy

    label_nodes = copy.deepcopy(gold["task_nodes"])
    pred_nodes = copy.deepcopy(pred["task_nodes"])
    label_names = [n["task"] for n in label_nodes]
    pred_names = [n["task"] for n in pred_nodes]
    if dependency == "resource":
        pred_names = [n.replace("_", " ") for n in pred_names]
        label_names = [n.replace("_", " ") for n in label_names]
        label_args, label_links = _resource_args(label_nodes, label_names, out_type, label=True)
        pred_args, pred_links = _resource_args(pred_nodes, pred_names, out_type, label=False)
    else:
        pred_links = pred["task_links"]
        label_links = gold["task_links"]
        pred_args = [n.get("arguments", []) for n in pred_nodes]
        label_args = [n["arguments"] for n in label_nodes]
    p_an, p_anv, l_an, l_anv = [], [], [], []
    for task, args in zip(pred_names, pred_args):
        for a in args:
            p_an.append(f"{task}-{a['name']}")
            p_anv.append(f"{task}-{a['name']}-{a['value']}")
    for task, args in zip(label_names, label_args):
        for a in args:
            l_an.append(f"{task}-{a['name']}")
            l_anv.append(f"{task}-{a['name']}-{a['value']}")
    for n in pred_names:
        if not isinstance(n, str):
            raise _SampleError(f"node name {n!r} is not a string")
    return {"nodes": (label_names, pred_names), "arg_names": (l_an, p_an), "arg_values": (l_anv, p_anv),
            "links": ([(l["source"], l["target"]) for l in label_links],
                      [(l["source"], l["target"]) for l in pred_links])}


def _counts(pairs: list[tuple[list, list]], types: set[str] | None = None) -> tuple[int, int, int]:
    """TP, FP, FN of upstream's ``flatten`` + sklearn micro/binary prfs."""
    tp = fp = fn = 0
    for gt, pr in pairs:
        gset, pset = set(gt), set(pr)
        for s in gset | pset:
            if types is not None and s not in types:
                continue
            g, p = s in gset, s in pset
            tp += g and p
            fp += p and not g
            fn += g and not p
    return tp, fp, fn


def f1_from_counts(tp: int, fp: int, fn: int) -> float:
    """sklearn's F1 with zero_division=0: 2TP / (2TP + FP + FN)."""
    d = 2 * tp + fp + fn
    return 2 * tp / d if d else 0.0


def score(items: list[TaskItem], outputs: list[Any], tool_desc: dict[str, Any], domain: str,
          dependency: str | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Metrics in percent: ``{"upstream": {...}, "strict": {...}, "dropped_ids": [...], ...}``."""
    dependency = dependency or DEPENDENCY[domain]
    types = {n["id"] for n in tool_desc["nodes"]}
    out_type = {n["id"]: (n["output-type"][0] if n.get("output-type") else "none") for n in tool_desc["nodes"]}
    kept: list[dict[str, list]] = []
    strict: list[dict[str, list]] = []
    per, dropped, unparsed = [], [], []
    for it, text in zip(items, outputs):
        pred = parse_prediction(text)
        status = "ok"
        sets = None
        if pred is None:
            status = "no_prediction"
            unparsed.append(it.id)
        else:
            try:
                sets = _sample_sets(it.gold, pred, dependency, out_type)
            except Exception as e:  # noqa: BLE001  upstream: "Parsing Error ... Ignore #id"
                status = f"parsing_error: {type(e).__name__}: {e}"[:200]
        if sets is None:
            dropped.append(it.id)
            empty = {"task_nodes": [], "task_links": []}
            try:
                sets = _sample_sets(it.gold, empty, dependency, out_type)
            except Exception:  # noqa: BLE001  the gold itself fails upstream's conversion
                sets = None
            if sets is not None:
                strict.append(sets)
        else:
            kept.append(sets)
            strict.append(sets)
        per.append({"id": it.id, "status": status, "prediction": pred})

    def _metrics(samples: list[dict[str, list]]) -> dict[str, float | None]:
        if not samples:
            return {m: None for m in METRICS}
        return {
            "node_f1": 100 * f1_from_counts(*_counts([s["nodes"] for s in samples], types)),
            "link_f1": 100 * f1_from_counts(*_counts([s["links"] for s in samples])),
            "arg_name_f1": 100 * f1_from_counts(*_counts([s["arg_names"] for s in samples])),
            "arg_value_f1": 100 * f1_from_counts(*_counts([s["arg_values"] for s in samples])),
        }

    metrics = {"upstream": _metrics(kept), "strict": _metrics(strict), "n": len(items),
               "n_scored_upstream": len(kept), "dropped_ids": dropped, "no_prediction_ids": unparsed,
               "dependency_type": dependency}
    return metrics, per


def prompt_messages(item: TaskItem, tool_desc: dict[str, Any], domain: str) -> list[dict[str, str]]:
    """Chat messages asking for the task graph as JSON (reflrl's prompt, in upstream's output schema)."""
    dependency = DEPENDENCY[domain]
    tools = json.dumps(tool_desc["nodes"], ensure_ascii=False)
    if dependency == "resource":
        arg_rule = ('"arguments" is a list of argument values (strings); to use the output of an earlier '
                    'node j write "<node-j>".')
        link_rule = '"task_links" lists {"source": tool, "target": tool} for each resource passed between nodes.'
    else:
        arg_rule = '"arguments" is a list of {"name": parameter name, "value": value}.'
        link_rule = '"task_links" lists {"source": tool, "target": tool} for each node that must run before another.'
    system = (
        "You are a task planner. Decompose the user's request into steps and a graph of tool calls "
        "using only these tools:\n" + tools + "\n\nAnswer with one JSON object and nothing else: "
        '{"task_steps": [step descriptions], "task_nodes": [{"task": tool name, "arguments": [...]}], '
        '"task_links": [...]}. ' + arg_rule + " " + link_rule)
    return [{"role": "system", "content": system}, {"role": "user", "content": item.request}]
