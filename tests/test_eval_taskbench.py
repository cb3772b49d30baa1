"""TaskBench metrics on small hand-computed cases (rules of microsoft/JARVIS taskbench/evaluate.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from reflrl.eval import taskbench as T
from reflrl.eval.data import DataError

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "benchmarks"
pytestmark = pytest.mark.skipif(not (DATA / "taskbench").is_dir(), reason="shared benchmark excerpts not beside the repo")


def _item(rec, domain):
    g = T.normalize_gold(rec, Path("fixture"), 0)
    return T.TaskItem(g["id"], domain, g["request"], g)


def test_resource_domain_hand_computed():
    td = T.load_tool_desc(DATA, "huggingface")
    a = _item({"id": "a", "task_nodes": [{"task": "Image-to-Text", "arguments": ["example.jpg"]},
                                         {"task": "Text-to-Speech", "arguments": ["<node-0>"]}],
               "task_links": [{"source": "ignored", "target": "in resource mode"}]}, "huggingface")
    b = _item({"id": "b", "task_nodes": [{"task": "Translation", "arguments": ["Hello"]}], "task_links": []},
              "huggingface")
    pred_a = {"task_steps": ["..."], "task_nodes": [
        {"task": "Image-to-Text", "arguments": ["example.png"]},
        {"task": "Summarization", "arguments": ["<node-0>"]},
        {"task": "Made-Up Tool", "arguments": []}], "task_links": []}
    m, per = T.score([a, b], ["Here is the plan: " + json.dumps(pred_a) + " done", "sorry, no idea"], td, "huggingface")
    # upstream drops b: node TP1 FP1 FN1 (the unknown tool is ignored) -> 50; arg names TP1 FP1 FN1 -> 50;
    # arg values TP0 -> 0; links (I2T->Summ) vs (I2T->T2S) -> 0
    assert m["upstream"] == pytest.approx({"node_f1": 50.0, "link_f1": 0.0, "arg_name_f1": 50.0, "arg_value_f1": 0.0})
    # strict counts b's gold as missed: node TP1 FP1 FN2 -> 2/5; names 2/5; values 0; links 0
    assert m["strict"] == pytest.approx({"node_f1": 40.0, "link_f1": 0.0, "arg_name_f1": 40.0, "arg_value_f1": 0.0})
    assert m["dropped_ids"] == ["b"] and m["no_prediction_ids"] == ["b"] and m["n_scored_upstream"] == 1
    assert [p["status"] for p in per] == ["ok", "no_prediction"]


def test_temporal_domain_and_hub_schema_hand_computed():
    td = T.load_tool_desc(DATA, "dailylifeapis")
    nodes = [{"task": "get_weather", "arguments": [{"name": "location", "value": "Paris"},
                                                   {"name": "date", "value": "2023-06-01"}]},
             {"task": "send_email", "arguments": [{"name": "email_address", "value": "a@b.c"}]}]
    links = [{"source": "get_weather", "target": "send_email"}]
    upstream_schema = {"id": "w", "task_steps": [], "task_nodes": nodes, "task_links": links}
    hub_schema = {"id": "w", "instruction": "weather", "tool_steps": "[]", "tool_nodes": json.dumps(nodes),
                  "tool_links": json.dumps(links)}
    pred = {"task_nodes": [{"task": "get_weather", "arguments": [{"name": "location", "value": "Paris"},
                                                                 {"name": "date", "value": "tomorrow"}]}],
            "task_links": []}
    for rec in (upstream_schema, hub_schema):
        m, _ = T.score([_item(rec, "dailylifeapis")], [json.dumps(pred)], td, "dailylifeapis")
        # nodes TP1 FN1 -> 2/3; names TP2 FN1 -> 4/5; values TP1 FP1 FN2 -> 2/5; links FN1 -> 0
        assert m["upstream"] == pytest.approx({"node_f1": 200 / 3, "link_f1": 0.0, "arg_name_f1": 80.0,
                                               "arg_value_f1": 40.0})
        assert m["dependency_type"] == "temporal"


def test_prediction_that_breaks_conversion_is_dropped_upstream_and_wrong_strict():
    td = T.load_tool_desc(DATA, "dailylifeapis")
    it = _item({"id": "x", "task_nodes": [{"task": "get_weather", "arguments": [{"name": "location", "value": "P"}]}],
                "task_links": []}, "dailylifeapis")
    bad = {"task_nodes": [{"task": "get_weather", "arguments": ["not a dict"]}], "task_links": []}
    m, per = T.score([it], [json.dumps(bad)], td, "dailylifeapis")
    assert m["upstream"]["node_f1"] is None and m["strict"]["node_f1"] == 0.0
    assert m["dropped_ids"] == ["x"] and per[0]["status"].startswith("parsing_error")


def test_malformed_gold_names_file_and_record(tmp_path):
    d = tmp_path / "taskbench" / "data_huggingface"
    d.mkdir(parents=True)
    (d / "tool_desc.json").write_text((DATA / "taskbench" / "data_huggingface" / "tool_desc.json").read_text())
    (d / "data.json").write_text(json.dumps({"id": "1", "task_nodes": [], "task_links": []}) + "\n" +
                                 json.dumps({"id": "2", "tool_nodes": "[{bad json"}) + "\n")
    with pytest.raises(DataError, match=r"data\.json: record 1 \(id '2'\).*not valid JSON"):
        T.load_domain(tmp_path, "huggingface")
    (d / "data.json").write_text('{"id": "1", "task_nodes": []}\n{"id": \n')
    with pytest.raises(DataError, match=r"data\.json: line 2: invalid JSON"):
        T.load_domain(tmp_path, "huggingface")
    (d / "data.json").unlink()
    with pytest.raises(DataError, match="no data.json"):
        T.load_domain(tmp_path, "huggingface")
