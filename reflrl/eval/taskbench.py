"""TaskBench (Shen et al. 2024, arXiv 2311.18760; Tool-ReRL appendix B): node F1, link F1,
argument-name F1 (t-F1) and argument-value F1 (v-F1), as ``microsoft/JARVIS: taskbench`` computes them.

Two metrics are reported side by side:

``upstream`` reproduces upstream's pipeline (``inference.py`` then ``evaluate.py`` with the README's
``--splits all --n_tools all --mode add -m all``, split "overall"), quirks included:

* the prediction is what ``inference.py::get_response`` keeps of the model text: newlines and
  backslashes removed, the text after ``RESULT #:`` if present, from the first ``{`` to the last
  ``}``, ``json.loads``. Text that does not load is never written to the predictions file, so the
  sample is not scored at all;
* :func:`upstream_sample` is ``evaluate()``'s loop body, line for line: with ``-m all`` it reads the
  prediction's ``task_steps`` (a prediction without them fails); dependency type ``resource``
  (huggingface, multimedia) replaces ``_`` by spaces in node names, rewrites each argument as
  ``{name: content type or the source tool's output type, value}`` and rebuilds the links from
  ``<node-j>`` references (the gold ``task_links`` are ignored); ``temporal`` (dailylifeapis) uses
  names, arguments and ``task_links`` as given. Any exception drops the sample ("Parsing Error ...
  Ignore #id"). When an argument cannot be converted (an integer, a ``<node-j>`` out of range, an
  empty object ...), upstream's ``except Exception: pass`` appends ``new_argument`` anyway: a
  variable that is never reset, so it still holds the last argument converted -- earlier in the
  node, in an earlier node, in the gold graph (converted first), or in an earlier sample. Only when
  nothing was ever converted does the append fail and drop the sample. We carry it the same way,
  over the samples in the order given (upstream's order is that of a Python ``set`` of ids);
* each metric is a micro F1 over samples after upstream's ``flatten`` (per sample, the union of
  gold and predicted items, exact string match): node F1 counts only names that are tool ids of
  ``tool_desc.json`` (sklearn's ``labels=types``), t-F1 ``"task-argname"``, v-F1
  ``"task-argname-value"``, link F1 ``(source, target)`` pairs; an F1 with no positives is 0
  (sklearn's zero_division); with no sample left every metric is None ("No supports, skip").

``strict`` scores every sample: a sample without a usable prediction counts as an empty prediction
(all its gold items missed); each argument is read on its own (a number as its text, a string
``arguments`` as one argument -- upstream iterates its characters), and one that cannot be read is
a wrong argument that matches nothing, instead of a copy of an earlier one; ``task_steps`` are not
required.

Deviations, where upstream would crash the whole evaluation (outside its per-sample ``try``): a
link that is not an object with hashable ``source``/``target`` drops the sample (upstream metric)
or is a wrong link (strict). The ids of dropped samples and the number of reused arguments are
reported.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .data import DataError, check_lengths, first_existing, read_json, read_json_or_jsonl

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
        raise DataError(f"unknown TaskBench domain {domain!r}; expected one of {DOMAINS}")
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


def parse_prediction(text: Any) -> Any:
    """What upstream ``inference.py::get_response`` stores as the prediction's ``result`` (any JSON
    value), or None when it would store nothing (the model text does not load as JSON)."""
    if not isinstance(text, str):
        return None
    content = text.replace("\n", "").replace("\\_", "_").replace("\\", "")
    start_pos = content.find("RESULT #:")
    if start_pos != -1:
        content = content[start_pos + len("RESULT #:"):]
    content = content[content.find("{"):content.rfind("}") + 1]
    try:
        return json.loads(content)
    except (json.JSONDecodeError, RecursionError):
        return None


def _content_type(content: Any) -> str:
    """Upstream ``get_content_type`` (raises on a non-string, as upstream does)."""
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


class Carry:
    """Upstream's ``new_argument``: set by each converted argument, never reset (see module doc)."""

    def __init__(self) -> None:
        self.new_argument: Any = _UNSET
        self.reused = 0  # arguments appended as a copy of an earlier one (the conversion failed)


_UNSET = object()


def upstream_sample(label: dict[str, Any], result: Any, dependency: str, out_type: dict[str, str],
                    carry: Carry) -> dict[str, tuple[list, list]]:
    """One pass of upstream ``evaluate()``'s per-sample ``try`` block: the (gold, predicted) lists fed
    to ``flatten``. Raises where upstream drops the sample. ``label`` and ``result`` are modified
    (upstream rewrites ``node["arguments"]`` in place): pass copies."""
    # "rouge"/"bertscore" are in the metrics with -m all: the steps are read first
    _ = result["task_steps"]  # upstream joins them inside a try that swallows every error
    "\n".join(label["task_steps"])

    label_nodes = label["task_nodes"]
    predcition_nodes = result["task_nodes"]
    label_node_name = [node["task"] for node in label_nodes]
    predcition_node_name = [node["task"] for node in predcition_nodes]

    if dependency == "resource":
        predcition_node_name = [name.replace("_", " ") for name in predcition_node_name]
        label_node_name = [name.replace("_", " ") for name in label_node_name]
        label_link: Any = []
        predcition_link: Any = []
        _rewrite_arguments(label_nodes, label_node_name, label_link, out_type, carry, label=True)
        _rewrite_arguments(predcition_nodes, predcition_node_name, predcition_link, out_type, carry, label=False)
    else:
        predcition_link = result["task_links"]
        label_link = label["task_links"]

    predcition_node_argument = [node.get("arguments", []) for node in predcition_nodes]
    label_node_argument = [node["arguments"] for node in label_nodes]
    p_an, p_anv, l_an, l_anv = [], [], [], []
    for task, arguments in zip(predcition_node_name, predcition_node_argument):
        for argument in arguments:
            p_an.append(f"{task}-{argument['name']}")
            p_anv.append(f"{task}-{argument['name']}-{argument['value']}")
    for task, arguments in zip(label_node_name, label_node_argument):
        for argument in arguments:
            l_an.append(f"{task}-{argument['name']}")
            l_anv.append(f"{task}-{argument['name']}-{argument['value']}")
    for node_name in predcition_node_name:
        assert isinstance(node_name, str), node_name
    # upstream does the rest outside the try (a failure there crashes it): here it drops the sample
    links = ([(link["source"], link["target"]) for link in label_link],
             [(link["source"], link["target"]) for link in predcition_link])
    for side in links:
        set(side)
    return {"nodes": (label_node_name, predcition_node_name), "arg_names": (l_an, p_an),
            "arg_values": (l_anv, p_anv), "links": links}


def _rewrite_arguments(nodes: Any, names: list[str], links: list[dict[str, Any]], out_type: dict[str, str],
                       carry: Carry, *, label: bool) -> None:
    """Upstream's resource-mode argument rewrite of the gold (``label``) or predicted nodes, in place.
    The two upstream loops differ only where ``label`` is tested."""
    for inx, node in enumerate(nodes):
        new_arguments = []
        for argument in (node["arguments"] if label else node.get("arguments", [])):
            try:
                if isinstance(argument, dict):
                    argument = list(argument.values())[0]
                if isinstance(argument, list):
                    argument = " ".join(argument)
                if (label or isinstance(argument, str)) and "<node-" in argument:
                    index_start = argument.index("<node-") + 6
                    index_end = argument.index(">")
                    if int(argument[index_start: index_end]) == inx:
                        continue
                    tool_name = names[int(argument[index_start: index_end])]
                    links.append({"source": tool_name, "target": node["task"]})
                    carry.new_argument = {"name": out_type.get(tool_name, "other"), "value": tool_name}
                else:
                    carry.new_argument = {"name": _content_type(argument), "value": argument}
            except Exception:  # noqa: BLE001  upstream: `except Exception as e: pass`
                _stale(carry)
            new_arguments.append(_current(carry))
        node["arguments"] = new_arguments


def _stale(carry: Carry) -> None:
    if carry.new_argument is not _UNSET:
        carry.reused += 1


def _current(carry: Carry) -> Any:
    if carry.new_argument is _UNSET:
        raise UnboundLocalError("local variable 'new_argument' referenced before assignment")
    return carry.new_argument


# ------------------------------------------------------------------------------------- strict
def _node_index(argument: str) -> int | None:
    try:
        return int(argument[argument.index("<node-") + 6: argument.index(">")])
    except ValueError:
        return None


def _strict_argument(argument: Any) -> str | None:
    """One resource-mode argument as text, or None when it cannot be read."""
    if isinstance(argument, dict):
        argument = next(iter(argument.values()), None)
    if isinstance(argument, list) and argument and all(isinstance(x, str) for x in argument):
        argument = " ".join(argument)
    if isinstance(argument, (int, float)) and not isinstance(argument, bool):
        argument = str(argument)
    return argument if isinstance(argument, str) else None


def strict_graph(graph: Any, dependency: str, out_type: dict[str, str], side: str = "predicted") -> dict[str, list]:
    """The ``strict`` reading of one graph: ``{"nodes", "arg_names", "arg_values", "links"}`` item
    lists. Raises ValueError when the graph has no usable node list. Each argument is read on its own
    (a number as its text, a string ``arguments`` as one argument); one that cannot be read (an
    out-of-range ``<node-j>``, an empty object, null, ...) and a link that is not a pair of names
    become ``<invalid ...>`` items that match nothing (``side`` keeps gold and predicted ones apart)."""
    if not isinstance(graph, dict) or not isinstance(graph.get("task_nodes"), list):
        raise ValueError("no task_nodes list")
    nodes = graph["task_nodes"]
    if not all(isinstance(n, dict) and isinstance(n.get("task"), str) for n in nodes):
        raise ValueError("a node is not an object with a string 'task'")
    invalid = f"<invalid {side} item>"
    resource = dependency == "resource"
    names = [n["task"].replace("_", " ") if resource else n["task"] for n in nodes]
    args: list[tuple[str, Any, Any]] = []  # (task, name, value)
    links: list[tuple[Any, Any]] = []
    for inx, node in enumerate(nodes):
        node_args = node.get("arguments", [])
        for argument in node_args if isinstance(node_args, list) else [node_args]:
            if not resource:
                ok = isinstance(argument, dict) and "name" in argument and "value" in argument
                args.append((names[inx], argument["name"], argument["value"]) if ok
                            else (names[inx], invalid, json.dumps(argument)))
                continue
            a = _strict_argument(argument)
            if a is None:
                args.append((names[inx], invalid, json.dumps(argument)))
            elif "<node-" in a:
                j = _node_index(a)
                if j == inx:
                    continue
                if j is None or not 0 <= j < len(names):
                    args.append((names[inx], invalid, a))
                    continue
                links.append((names[j], node["task"]))
                args.append((names[inx], out_type.get(names[j], "other"), names[j]))
            else:
                args.append((names[inx], _content_type(a), a))
    if not resource:
        raw = graph.get("task_links", [])
        for link in raw if isinstance(raw, list) else [raw]:
            ok = isinstance(link, dict) and isinstance(link.get("source"), str) and isinstance(link.get("target"), str)
            links.append((link["source"], link["target"]) if ok else (invalid, json.dumps(link)))
    return {"nodes": names, "arg_names": [f"{t}-{n}" for t, n, _ in args],
            "arg_values": [f"{t}-{n}-{v}" for t, n, v in args], "links": links}


def strict_sample(gold: dict[str, Any], result: Any, dependency: str, out_type: dict[str, str]
                  ) -> tuple[dict[str, tuple[list, list]], str | None]:
    """(gold, predicted) item lists of the ``strict`` reading, and why the prediction was unusable
    (None when it was used)."""
    g = strict_graph(gold, dependency, out_type, side="gold")
    why = None
    try:
        p = strict_graph(result, dependency, out_type)
    except ValueError as e:
        why = str(e)
        p = {k: [] for k in g}
    return {k: (g[k], p[k]) for k in g}, why


# ---------------------------------------------------------------------------------- F1 scores
def counts(pairs: list[tuple[list, list]], types: set[str] | None = None) -> tuple[int, int, int]:
    """TP, FP, FN of upstream's ``flatten`` + sklearn's micro (``labels=types``) / binary prfs."""
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


def metrics_of(samples: list[dict[str, tuple[list, list]]], types: set[str]) -> dict[str, float | None]:
    """The four F1s in percent over samples' item lists; None for all when there is no sample."""
    if not samples:
        return {m: None for m in METRICS}
    return {
        "node_f1": 100 * f1_from_counts(*counts([s["nodes"] for s in samples], types)),
        "link_f1": 100 * f1_from_counts(*counts([s["links"] for s in samples])),
        "arg_name_f1": 100 * f1_from_counts(*counts([s["arg_names"] for s in samples])),
        "arg_value_f1": 100 * f1_from_counts(*counts([s["arg_values"] for s in samples])),
    }


def output_types(tool_desc: dict[str, Any]) -> dict[str, str]:
    """Upstream's ``tool_output_type_map``: tool id -> its first output type (or "none")."""
    return {n["id"]: (n["output-type"][0] if n.get("output-type") else "none") for n in tool_desc["nodes"]}


def score(items: list[TaskItem], outputs: list[Any], tool_desc: dict[str, Any], domain: str,
          dependency: str | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Metrics in percent: ``{"upstream": {...}, "strict": {...}, "dropped_ids": [...], ...}`` and a
    verdict per sample. The samples are scored in the order given (it matters upstream: see
    :class:`Carry`)."""
    check_lengths("taskbench", items, outputs)
    dependency = dependency or DEPENDENCY[domain]
    types = {n["id"] for n in tool_desc["nodes"]}
    out_type = output_types(tool_desc)
    carry = Carry()
    kept: list[dict[str, tuple[list, list]]] = []
    strict: list[dict[str, tuple[list, list]]] = []
    per, dropped, unparsed = [], [], []
    for it, text in zip(items, outputs):
        result = parse_prediction(text)
        status = "ok"
        if result is None:
            status = "no_prediction"
            unparsed.append(it.id)
            dropped.append(it.id)
        else:
            reused_before = carry.reused
            try:
                kept.append(upstream_sample(copy.deepcopy(it.gold), copy.deepcopy(result), dependency,
                                            out_type, carry))
            except Exception as e:  # noqa: BLE001  upstream: "Parsing Error: {e}, Ignore #id {id}"
                status = f"parsing_error: {type(e).__name__}: {e}"[:200]
                dropped.append(it.id)
            if carry.reused > reused_before and status == "ok":
                status = f"ok ({carry.reused - reused_before} argument(s) reused upstream)"
        sets, why = strict_sample(it.gold, result, dependency, out_type)
        strict.append(sets)
        per.append({"id": it.id, "status": status, "strict_unusable": why if result is not None else "no prediction",
                    "prediction": result})
    metrics = {"upstream": metrics_of(kept, types), "strict": metrics_of(strict, types), "n": len(items),
               "n_scored_upstream": len(kept), "dropped_ids": dropped, "no_prediction_ids": unparsed,
               "upstream_reused_arguments": carry.reused, "dependency_type": dependency}
    return metrics, per


#: upstream inference.py's instructions after the tool list (zero-shot: use_demos=0, its default)
_GOAL = {
    "resource": """
# GOAL #: Based on the above tools, I want you generate task steps and task nodes to solve the # USER REQUEST #. The format must in a strict JSON format, like: {"task_steps": [ step description of one or more steps ], "task_nodes": [{"task": "tool name must be from # TOOL LIST #", "arguments": [ a concise list of arguments for the tool. Either original text, or user-mentioned filename, or tag '<node-j>' (start from 0) to refer to the output of the j-th node. ]}]} """
    """

# REQUIREMENTS #: 
1. the generated task steps and task nodes can resolve the given user request # USER REQUEST # perfectly. Task name must be selected from # TASK LIST #; 
2. the task steps should strictly aligned with the task nodes, and the number of task steps should be same with the task nodes; 
3. the dependencies among task steps should align with the argument dependencies of the task nodes; 
4. the tool arguments should be align with the input-type field of # TASK LIST #;""",
    "temporal": """
# GOAL #:
Based on the above tools, I want you generate task steps and task nodes to solve the # USER REQUEST #. The format must in a strict JSON format, like: {"task_steps": [ "concrete steps, format as Step x: Call xxx tool with xxx: 'xxx' and xxx: 'xxx'" ], "task_nodes": [{"task": "task name must be from # TASK LIST #", "arguments": [ {"name": "parameter name", "value": "parameter value, either user-specified text or the specific name of the tool whose result is required by this node"} ]}], "task_links": [{"source": "task name i", "target": "task name j"}]}"""
    """

# REQUIREMENTS #: 
1. the generated task steps and task nodes can resolve the given user request # USER REQUEST # perfectly. Task name must be selected from # TASK LIST #; 
2. the task steps should strictly aligned with the task nodes, and the number of task steps should be same with the task nodes; 
3. The task links (task_links) should reflect the temporal dependencies among task nodes, i.e. the order in which the APIs are invoked;""",
}
_ASK = """

# USER REQUEST #: {{user_request}}
now please generate your result in a strict JSON format:
# RESULT #:"""


def prompt_template(tool_desc: dict[str, Any], domain: str) -> str:
    """Upstream ``inference.py``'s prompt with ``{{user_request}}`` still in it: the tool list (for the
    temporal domain each tool's parameters reduced to their names), the goal, the requirements."""
    dependency = DEPENDENCY[domain]
    tools = copy.deepcopy(tool_desc["nodes"])
    if dependency == "temporal":
        for tool in tools:
            tool["parameters"] = [p["name"] for p in tool.get("parameters", [])]
    tool_string = "# TASK LIST #:\n" + "".join(json.dumps(tool) + "\n" for tool in tools)
    return tool_string + _GOAL[dependency] + _ASK


def prompt_messages(item: TaskItem, tool_desc: dict[str, Any], domain: str,
                    template: str | None = None) -> list[dict[str, str]]:
    """Upstream's single user message for ``item`` (``template`` from :func:`prompt_template`)."""
    template = template if template is not None else prompt_template(tool_desc, domain)
    return [{"role": "user", "content": template.replace("{{user_request}}", item.request)}]
