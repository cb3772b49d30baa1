"""RoTBench (Ye et al. 2024; Tool-ReRL appendix B): tool selection, parameter identification and
content filling on the five noise levels, scored exactly as the upstream evaluator
``Junjie-Ye/RoTBench: Code/Evaluation/evaluate.py`` (``ts_eval``, ``pi_eval``, ``cf_eval``) does.

Upstream rules reproduced here (first turn, ``version=0``, i.e. ``Action:`` / ``Action Input:``):

* the tool list (``get_config``) is the system prompt from its first ``[`` to 13 characters before the
  end (``\\n\\nLet's Begin!``); ``config[-1]`` is the finish tool and ``config[-2]`` ask_to_user, whatever
  their (possibly noised) names;
* the prediction's action is the text between ``Action:`` + 8 characters and ``Action Input:``, minus
  one trailing newline; its input is ``json.loads`` of everything after ``Action Input:`` + 14
  characters. A prediction whose input is not JSON, is a JSON string, or is empty/falsy is wrong for
  all three metrics (upstream ``if not test_action_input: continue``);
* the gold (last message) is a LIST of acceptable answers; a sample is right when one answer matches:
  TS = same action; PI = TS and the same key set; CF = PI and equal values, where keys whose gold
  value is the string ``"None"`` accept any value, and a finish / ask_to_user answer needs no content.
  A predicted ``finish`` matches the (possibly renamed) finish tool. The mutations upstream makes while
  looping over answers (the renamed action, deleted ``"None"`` keys) carry over between answers, as
  upstream;
* each metric = matches / number of records x 100 (records with unusable predictions count as wrong).

Two cases crash the upstream script (an empty action before the newline strip, a JSON input that is
not an object): here they are scored wrong and counted in ``parse_failures``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .data import DataError, check_lengths, first_existing, read_json

LEVELS = ("clean", "slight", "medium", "heavy", "union")
LEVEL_ABBR = {"clean": "CLE", "slight": "SLI", "medium": "MED", "heavy": "HEA", "union": "UNI"}
METRICS = ("tool_selection", "parameter_identification", "content_filling")
_END = "\n\nLet's Begin!"


@dataclass
class RotItem:
    """One RoTBench record: ``messages`` to prompt with, the tool list, the gold answers."""

    id: str
    level: str
    index: int
    scenario: str
    messages: list[dict[str, str]]
    config: list[dict[str, Any]]
    answers: list[str]
    record: dict[str, Any] = field(repr=False, default_factory=dict)


def data_dir_for(root: Path) -> Path:
    """The folder holding ``clean.json`` ... under ``root`` (several layouts accepted)."""
    root = Path(root)
    cands = [root / "rotbench" / "first_turn", root / "rotbench" / "First_Turn", root / "first_turn",
             root / "First_Turn", root / "rotbench", root]
    found = first_existing([c / "clean.json" for c in cands] + [c / f"{lv}.json" for c in cands for lv in LEVELS])
    if found is None:
        raise DataError(f"no RoTBench files under {root} (expected rotbench/first_turn/<level>.json; "
                        "get them with 'reflrl data download rotbench --dest DIR')")
    return found.parent


def get_config(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Upstream ``get_config``: the tool list JSON inside the system prompt."""
    value = record["conversations"][0]["value"]
    p_len = len(value[: value.find("[")])
    return json.loads(value[p_len:-13])


def _check_record(rec: Any, path: Path, i: int) -> None:
    where = f"{path}: record {i}" + (f" (id {rec.get('id')!r})" if isinstance(rec, dict) else "")
    if not isinstance(rec, dict) or not isinstance(rec.get("conversations"), list) or len(rec["conversations"]) < 3:
        raise DataError(f"{where}: expected an object with a 'conversations' list of >= 3 messages")
    conv = rec["conversations"]
    if not all(isinstance(m, dict) and "value" in m for m in conv):
        raise DataError(f"{where}: every conversation message needs a 'value'")
    sys_v = conv[0]["value"]
    if not isinstance(sys_v, str) or "[" not in sys_v or not sys_v.endswith(_END):
        raise DataError(f"{where}: system prompt must hold the tool list between '[' and {_END!r}")
    try:
        cfg = get_config(rec)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: tool list in the system prompt is not JSON: {e.msg}") from None
    if not isinstance(cfg, list) or len(cfg) < 2 or not all(isinstance(t, dict) and "name" in t for t in cfg):
        raise DataError(f"{where}: tool list must be a JSON list of >= 2 tools with names")
    answers = conv[-1]["value"]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise DataError(f"{where}: last message 'value' must be a non-empty list of gold answers")
    for a in answers:
        if "Action:" not in a or "Action Input:" not in a:
            raise DataError(f"{where}: gold answer without 'Action:'/'Action Input:': {a[:80]!r}")
        try:
            json.loads(a[a.find("Action Input:") + 14:])
        except json.JSONDecodeError:
            raise DataError(f"{where}: gold 'Action Input' is not JSON: {a[:120]!r}") from None


def load_level(root: Path, level: str, limit: int | None = None) -> list[RotItem]:
    """Records of one noise level (first ``limit``); DataError names the file and record."""
    if level not in LEVELS:
        raise DataError(f"unknown RoTBench level {level!r}; expected one of {LEVELS}")
    path = data_dir_for(root) / f"{level}.json"
    data = read_json(path)
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of records")
    out = []
    for i, rec in enumerate(data[: limit if limit is not None else None]):
        _check_record(rec, path, i)
        conv = rec["conversations"]
        msgs = [{"role": "system", "content": conv[0]["value"]}]
        for m in conv[1:-1]:
            role = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
                    "function": "tool", "observation": "tool"}.get(m.get("from"), "user")
            msgs.append({"role": role, "content": m["value"]})
        out.append(RotItem(str(rec.get("id", i)), level, i, str(rec.get("scenario", "")), msgs,
                           get_config(rec), list(conv[-1]["value"]), rec))
    return out


def data_files(root: Path, levels: list[str]) -> list[Path]:
    d = data_dir_for(root)
    return [d / f"{lv}.json" for lv in levels]


# ------------------------------------------------------------------------------------ scoring
class _Unusable(Exception):
    pass


def _test_value(text: str) -> tuple[str, Any]:
    """Upstream ``get_test_value`` (version 0); ``_Unusable`` where upstream would crash."""
    test_action = text[text.find("Action:") + 8: text.find("Action Input:")]
    if not test_action:
        raise _Unusable("empty action")
    if test_action[-1] == "\n":
        test_action = test_action[:-1]
    try:
        test_action_input = json.loads(text[text.find("Action Input:") + 14:])
    except (json.JSONDecodeError, RecursionError):
        return test_action, 0
    if isinstance(test_action_input, str):
        return test_action, 0
    return test_action, test_action_input


def _answer_action(ans: str) -> str:
    a = ans[ans.find("Action:") + 8: ans.find("Action Input:")]
    if a and a[-1] == "\n":
        a = a[:-1]
    return a


def _answer_input(ans: str) -> Any:
    return json.loads(ans[ans.find("Action Input:") + 14:])


def score_one(text: Any, config: list[dict[str, Any]], answers: list[str]) -> dict[str, Any]:
    """Upstream verdicts for one prediction: ``{"tool_selection", "parameter_identification",
    "content_filling"}`` (bools) plus ``parse_error`` (None or why the prediction was unusable)."""
    out = {m: False for m in METRICS}
    out["parse_error"] = None
    if not isinstance(text, str):
        out["parse_error"] = "no text"
        return out
    try:
        # ts_eval
        test_action, test_input = _test_value(text)
        if not test_input:
            out["parse_error"] = "Action Input is not a non-empty JSON object"
            return out
        if not isinstance(test_input, dict):
            raise _Unusable("Action Input is JSON but not an object")
        for ans in answers:
            aa = _answer_action(ans)
            if aa == config[-1]["name"] and test_action == "finish":
                test_action = aa
            if aa == test_action:
                out["tool_selection"] = True
                break
        # pi_eval
        test_action, test_input = _test_value(text)
        status = 0
        for ans in answers:
            aa = _answer_action(ans)
            ai = _answer_input(ans)
            if aa == config[-1]["name"] and test_action == "finish":
                test_action = aa
            if aa != test_action:
                continue
            status = max(status, 1)
            if not ai.keys() == test_input.keys():
                continue
            status = 2
            break
        out["parameter_identification"] = status >= 2
        # cf_eval
        test_action, test_input = _test_value(text)
        status = 0
        for ans in answers:
            aa = _answer_action(ans)
            ai = _answer_input(ans)
            if aa == config[-1]["name"] and test_action == "finish":
                test_action = aa
            if aa != test_action:
                continue
            status = max(status, 1)
            if not ai.keys() == test_input.keys():
                continue
            status = max(status, 2)
            if aa == config[-1]["name"]:
                aa = "finish"
            if aa == config[-2]["name"]:
                aa = "ask_to_user"
            del_key = [k for k, v in ai.items() if v == "None"]
            for k in del_key:
                del ai[k]
                del test_input[k]
            if not ai == test_input and aa != "finish" and aa != "ask_to_user":
                continue
            status = 3
            break
        out["content_filling"] = status >= 3
    except _Unusable as e:
        out.update({m: False for m in METRICS})
        out["parse_error"] = str(e)
    return out


def score(items: list[RotItem], outputs: list[Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Metrics (percent, like upstream ``show_stats``) and per-sample verdicts for one level."""
    check_lengths("rotbench", items, outputs)
    per = []
    for it, text in zip(items, outputs):
        v = score_one(text, it.config, it.answers)
        per.append({"id": it.id, "index": it.index, "scenario": it.scenario, **v})
    n = len(items)
    metrics = {m: (100.0 * sum(p[m] for p in per) / n if n else 0.0) for m in METRICS}
    metrics["n"] = n
    metrics["parse_failures"] = sum(p["parse_error"] is not None for p in per)
    return metrics, per
