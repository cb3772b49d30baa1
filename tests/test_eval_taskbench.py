"""TaskBench scoring equals upstream's pipeline on hand-built predictions over the fixture excerpt.

The oracle below is upstream's code (microsoft/JARVIS, ``taskbench/``, MIT licence, Copyright (c)
Microsoft Corporation): ``inference.py::get_response``'s extraction of the result from the model
text, and ``evaluate.py``: ``flatten``, ``get_content_type`` and the body of ``evaluate()`` from
the loop over ids to the F1 metrics, copied with these changes only: the ids are iterated in the
order given (upstream iterates a ``set``), the step metrics (rouge, BERTScore) are not computed
(their inputs are still read, as with ``-m all``), and sklearn's ``precision_recall_fscore_support``
is replaced by :func:`_prfs_f1`, the F1 it returns for these label lists (micro over ``labels`` or
binary with positive label 1, zero_division 0).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from reflrl.eval import taskbench as T
from reflrl.eval.data import DataError

DATA = Path(__file__).resolve().parent / "fixtures" / "benchmarks"


# ------------------------------------------------------------------ upstream oracle (verbatim logic)
def _get_response_content(text):
    oring_content = text
    oring_content = oring_content.replace("\n", "")
    oring_content = oring_content.replace("\\_", "_")
    content = oring_content.replace("\\", "")
    start_pos = content.find("RESULT #:")
    if start_pos != -1:
        content = content[start_pos + len("RESULT #:"):]
    content = content[content.find("{"):content.rfind("}") + 1]
    return json.loads(content)  # a JSONDecodeError: nothing is written for this id


def flatten(gt, pred, types=None):
    assert len(gt) == len(pred)
    gt_flat = []
    pred_flat = []
    for (sample_gt, sample_pred) in zip(gt, pred):
        union = set()
        union.update(sample_gt)
        union.update(sample_pred)
        for s in union:
            if types:
                if s in types:
                    if s in sample_gt:
                        gt_flat.append(types.index(s) + 1)
                    else:
                        gt_flat.append(0)
                    if s in sample_pred:
                        pred_flat.append(types.index(s) + 1)
                    else:
                        pred_flat.append(0)
                else:
                    gt_flat.append(0)
                    pred_flat.append(0)
            else:
                if s in sample_gt:
                    gt_flat.append(1)
                else:
                    gt_flat.append(0)
                if s in sample_pred:
                    pred_flat.append(1)
                else:
                    pred_flat.append(0)
    return gt_flat, pred_flat


def _prfs_f1(gt_flat, pred_flat, labels=(1,)):
    tp = sum(g == p and g in labels for g, p in zip(gt_flat, pred_flat))
    fp = sum(p in labels and g != p for g, p in zip(gt_flat, pred_flat))
    fn = sum(g in labels and g != p for g, p in zip(gt_flat, pred_flat))
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0


def get_content_type(content):
    content = content.strip('\'')
    assert isinstance(content, str), content
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


def upstream_evaluate(labels_in, texts, tool_desc, dependency_type):  # noqa: C901  (upstream's shape)
    labels, predcitions, ids = {}, {}, []
    for label, text in zip(labels_in, texts):
        try:
            result = _get_response_content(text)
        except json.JSONDecodeError:
            continue
        labels[label["id"]] = copy.deepcopy(label)
        predcitions[label["id"]] = {"id": label["id"], "result": result}
        ids.append(label["id"])
    tool_output_type_map = None
    if dependency_type == "resource":
        tool_output_type_map = {tool["id"]: tool["output-type"][0] if len(tool["output-type"]) else "none" for tool in tool_desc["nodes"]}
    tool_map_reverse = {i + 1: tool["id"] for i, tool in enumerate(tool_desc["nodes"])}

    label_task_steps = []
    predcition_names = []
    label_names = []
    label_graphs = []
    predcition_graphs = []
    label_links = []
    predcition_links = []
    label_task_arg_names = []
    predcition_task_arg_names = []
    label_task_arg_name_values = []
    predcition_task_arg_name_values = []

    for id in ids:
        try:
            label = labels[id]
            predcition = predcitions[id]

            predcition_task_step = predcition["result"]["task_steps"]
            label_task_step = label["task_steps"]
            try:
                if isinstance(predcition_task_step[0], str):
                    "\n".join(predcition_task_step)
                else:
                    str(predcition_task_step)
            except Exception:
                pass
            label_task_steps.append("\n".join(label_task_step))

            label_nodes = label["task_nodes"]
            predcition_nodes = predcition["result"]["task_nodes"]

            label_node_name = [node["task"] for node in label_nodes]
            predcition_node_name = [node["task"] for node in predcition_nodes]

            label_task_arg_name = []
            predcition_task_arg_name = []

            label_task_arg_name_value = []
            predcition_task_arg_name_value = []

            if dependency_type == "resource":
                predcition_node_name = [name.replace("_", " ") for name in predcition_node_name]
                label_node_name = [name.replace("_", " ") for name in label_node_name]
                label_link = []
                predcition_link = []
                for inx, node in enumerate(label_nodes):
                    new_arguments = []
                    for i, argument in enumerate(node["arguments"]):
                        try:
                            if isinstance(argument, dict):
                                argument = list(argument.values())[0]
                            if isinstance(argument, list):
                                argument = " ".join(argument)
                            if "<node-" in argument:
                                index_start = argument.index("<node-") + 6
                                index_end = argument.index(">")
                                if int(argument[index_start: index_end]) == inx:
                                    continue
                                argument_tool_name = label_node_name[int(argument[index_start: index_end])]
                                label_link.append({"source": argument_tool_name, "target": node["task"]})
                                new_argument = {"name": tool_output_type_map.get(argument_tool_name, "other"), "value": argument_tool_name}
                            else:
                                new_argument = {"name": get_content_type(argument), "value": argument}
                        except Exception:
                            pass
                        new_arguments.append(new_argument)  # noqa: F821  (upstream: may be unbound)
                    node["arguments"] = new_arguments

                for inx, node in enumerate(predcition_nodes):
                    new_arguments = []
                    for i, argument in enumerate(node.get("arguments", [])):
                        try:
                            if isinstance(argument, dict):
                                argument = list(argument.values())[0]
                            if isinstance(argument, list):
                                argument = " ".join(argument)
                            if isinstance(argument, str) and "<node-" in argument:
                                index_start = argument.index("<node-") + 6
                                index_end = argument.index(">")

                                if int(argument[index_start: index_end]) == inx:
                                    continue
                                prediction_tool_name = predcition_node_name[int(argument[index_start: index_end])]
                                predcition_link.append({"source": prediction_tool_name, "target": node["task"]})
                                new_argument = {"name": tool_output_type_map.get(prediction_tool_name, "other"), "value": prediction_tool_name}
                            else:
                                new_argument = {"name": get_content_type(argument), "value": argument}

                        except Exception:
                            pass
                        new_arguments.append(new_argument)  # noqa: F821
                    node["arguments"] = new_arguments
            else:
                predcition_link = predcition["result"]["task_links"]
                label_link = label["task_links"]

            predcition_node_argument = [node.get("arguments", []) for node in predcition_nodes]
            label_node_argument = [node["arguments"] for node in label_nodes]

            for task, arguments in zip(predcition_node_name, predcition_node_argument):
                for argument in arguments:
                    label_task_arg_name.append(f"{task}-{argument['name']}")
                    label_task_arg_name_value.append(f"{task}-{argument['name']}-{argument['value']}")

            for task, arguments in zip(label_node_name, label_node_argument):
                for argument in arguments:
                    predcition_task_arg_name.append(f"{task}-{argument['name']}")
                    predcition_task_arg_name_value.append(f"{task}-{argument['name']}-{argument['value']}")

            label_graph = {"nodes": label_node_name, "links": label_link, "arguments": label_node_argument}
            predcition_graph = {"nodes": predcition_node_name, "links": predcition_link,
                                "arguments": predcition_node_argument}

            label_graphs.append(label_graph)
            predcition_graphs.append(predcition_graph)

            for node_name in predcition_node_name:
                assert isinstance(node_name, str), node_name

            predcition_names.append(predcition_node_name)
            label_names.append(label_node_name)

            predcition_task_arg_names.append(predcition_task_arg_name)
            label_task_arg_names.append(label_task_arg_name)

            predcition_task_arg_name_values.append(predcition_task_arg_name_value)
            label_task_arg_name_values.append(label_task_arg_name_value)

            label_links.append(label_link)
            predcition_links.append(predcition_link)

        except Exception:
            pass  # upstream: logger.info(f"Parsing Error: {e}, Ignore #id {id}")

    metric_dict = {"all_samples": len(ids), "node_supports": len(label_names)}
    if len(label_graphs) == 0 or len(label_names) == 0 or len(label_links) == 0:
        return metric_dict

    types = list(range(1, len(tool_desc["nodes"]) + 1))
    types_name = [tool_map_reverse[i] for i in types]
    gt_flat, pred_flat = flatten(label_names, predcition_names, types=types_name)
    metric_dict["node_micro_f1_no_matching"] = _prfs_f1(gt_flat, pred_flat, labels=types)
    gt_flat, pred_flat = flatten(label_task_arg_names, predcition_task_arg_names)
    metric_dict["argument_task_argname_binary_f1_no_matching"] = _prfs_f1(gt_flat, pred_flat)
    gt_flat, pred_flat = flatten(label_task_arg_name_values, predcition_task_arg_name_values)
    metric_dict["argument_task_argname_value_binary_f1_no_matching"] = _prfs_f1(gt_flat, pred_flat)

    tuple_label_links = []
    tuple_predcition_links = []
    for label_link, predcition_link in zip(label_links, predcition_links):
        tuple_label_links.append([(link["source"], link["target"]) for link in label_link])
        tuple_predcition_links.append([(link["source"], link["target"]) for link in predcition_link])
    gt_flat, pred_flat = flatten(tuple_label_links, tuple_predcition_links)
    metric_dict["link_binary_f1"] = _prfs_f1(gt_flat, pred_flat)
    return metric_dict


_ORACLE_KEYS = {"node_f1": "node_micro_f1_no_matching", "link_f1": "link_binary_f1",
                "arg_name_f1": "argument_task_argname_binary_f1_no_matching",
                "arg_value_f1": "argument_task_argname_value_binary_f1_no_matching"}


def assert_equal_to_upstream(items, texts, td, domain):
    ours, _ = T.score(items, texts, td, domain)
    ref = upstream_evaluate([it.gold for it in items], texts, td, T.DEPENDENCY[domain])
    assert ours["n_scored_upstream"] == ref["node_supports"]
    assert ours["n"] - len(ours["no_prediction_ids"]) == ref["all_samples"]
    for ours_key, ref_key in _ORACLE_KEYS.items():
        if ref_key not in ref:
            assert ours["upstream"][ours_key] is None
        else:
            assert ours["upstream"][ours_key] == pytest.approx(100 * ref[ref_key]), ours_key
    return ours


# ----------------------------------------------------------------------------- hand-built cases
def _item(rec, domain):
    g = T.normalize_gold(rec, Path("fixture"), 0)
    return T.TaskItem(g["id"], domain, g["request"], g)


def _result(gold, **changes):
    r = {"task_steps": copy.deepcopy(gold["task_steps"]), "task_nodes": copy.deepcopy(gold["task_nodes"]),
         "task_links": copy.deepcopy(gold["task_links"])}
    r.update(changes)
    return r


def _as_list(arguments):
    return arguments if isinstance(arguments, list) else [arguments]


def _predictions(items, domain):
    """Per kind, one model text per item (gold, variations, and the cases that trip upstream up)."""
    resource = T.DEPENDENCY[domain] == "resource"
    kinds = {}

    def kind(name, fn):
        kinds[name] = [fn(it.gold) for it in items]

    kind("gold", lambda g: json.dumps(_result(g)))
    kind("gold_in_prose", lambda g: "Sure!\n# RESULT #: " + json.dumps(_result(g), indent=2) + "\nHope it helps.")
    kind("no_steps", lambda g: json.dumps({k: v for k, v in _result(g).items() if k != "task_steps"}))
    kind("no_nodes", lambda g: json.dumps({"task_steps": ["x"]}))
    kind("not_json", lambda g: "I would use a tool for this.")
    kind("underscored_names", lambda g: json.dumps(_result(g, task_nodes=[
        {**n, "task": n["task"].replace(" ", "_")} for n in g["task_nodes"]])))
    kind("first_node_only", lambda g: json.dumps(_result(g, task_nodes=g["task_nodes"][:1], task_links=[])))
    kind("unknown_tool", lambda g: json.dumps(_result(g, task_nodes=g["task_nodes"] + [
        {"task": "No Such Tool", "arguments": []}])))
    kind("node_not_string", lambda g: json.dumps(_result(g, task_nodes=[{"task": 5, "arguments": []}])))
    kind("arguments_missing", lambda g: json.dumps(_result(g, task_nodes=[
        {"task": n["task"]} for n in g["task_nodes"]])))
    kind("escaped_quotes", lambda g: json.dumps(_result(g, task_steps=['say "hi"'])))
    if resource:
        # the case of the issue: the first argument of a node cannot be converted
        kind("int_first_argument", lambda g: json.dumps(_result(g, task_nodes=[
            {**n, "arguments": [5] + _as_list(n["arguments"])} for n in g["task_nodes"]])))
        kind("reference_out_of_range", lambda g: json.dumps(_result(g, task_nodes=[
            {**n, "arguments": ["<node-9>"]} for n in g["task_nodes"]])))
        kind("empty_object_then_text", lambda g: json.dumps(_result(g, task_nodes=[
            {**n, "arguments": [{}, "example.jpg"]} for n in g["task_nodes"]])))
        kind("self_and_list_arguments", lambda g: json.dumps(_result(g, task_nodes=[
            {**n, "arguments": ["<node-0>", ["a.wav", "b"], {"image": "x.png"}]} for n in g["task_nodes"]])))
        kind("bad_reference_syntax", lambda g: json.dumps(_result(g, task_nodes=[
            {**n, "arguments": ["x>y<node-1"]} for n in g["task_nodes"]])))
    else:
        kind("argument_not_object", lambda g: json.dumps(_result(g, task_nodes=[
            {**n, "arguments": ["plain"]} for n in g["task_nodes"]])))
        kind("wrong_values", lambda g: json.dumps(_result(g, task_nodes=[
            {**n, "arguments": [{**a, "value": "other"} for a in n["arguments"]]} for n in g["task_nodes"]])))
        kind("no_links", lambda g: json.dumps(_result(g, task_links=[])))
        kind("links_missing", lambda g: json.dumps({k: v for k, v in _result(g).items() if k != "task_links"}))
    return kinds


@pytest.mark.parametrize("domain", T.DOMAINS)
def test_metrics_equal_upstream_pipeline(domain):
    td = T.load_tool_desc(DATA, domain)
    items = T.load_domain(DATA, domain)
    assert len(items) == (10 if domain == "multimedia" else 8)
    kinds = _predictions(items, domain)
    for name, texts in kinds.items():
        assert_equal_to_upstream(items, texts, td, domain)
    # mixtures: the reused argument crosses samples, so one sample's kind changes another's score
    names = list(kinds)
    for shift in range(1, 4):
        texts = [kinds[names[(i * shift + shift) % len(names)]][i] for i in range(len(items))]
        assert_equal_to_upstream(items, texts, td, domain)
    gold = T.score(items, kinds["gold"], td, domain)[0]
    assert gold["upstream"] == gold["strict"] == {m: 100.0 for m in T.METRICS}


def test_unconvertible_first_argument_keeps_the_sample_as_upstream_does():
    """The issue's case: a node whose first predicted argument is an integer or a <node-9> out of
    range. Upstream appends the last argument it converted (here: the gold's, converted first), so
    the sample stays; the strict metric counts a wrong argument instead."""
    td = T.load_tool_desc(DATA, "huggingface")
    it = _item({"id": "a", "task_steps": ["s"], "task_nodes": [{"task": "Translation", "arguments": ["Hello"]}],
                "task_links": []}, "huggingface")
    for bad, strict_name_f1 in ((5, 100.0), ("<node-9>", 0.0)):
        text = json.dumps({"task_steps": ["s"], "task_nodes": [{"task": "Translation", "arguments": [bad]}]})
        m = assert_equal_to_upstream([it], [text], td, "huggingface")
        assert m["n_scored_upstream"] == 1 and m["dropped_ids"] == [] and m["upstream_reused_arguments"] == 1
        # upstream reuses the gold's {"text": "Hello"}: a perfect score
        assert m["upstream"] == {"node_f1": 100.0, "link_f1": 0.0, "arg_name_f1": 100.0, "arg_value_f1": 100.0}
        # strict: the node is right; 5 reads as the text "5" (right name, wrong value), <node-9> is
        # an invalid argument (wrong name and value)
        assert m["strict"] == {"node_f1": 100.0, "link_f1": 0.0, "arg_name_f1": strict_name_f1, "arg_value_f1": 0.0}
    # the reused value crosses samples: a gold graph without arguments converts nothing, so the
    # prediction reuses the previous sample's last argument
    no_args = _item({"id": "b", "task_steps": ["s"], "task_nodes": [{"task": "Translation", "arguments": []}],
                     "task_links": []}, "huggingface")
    bad = json.dumps({"task_steps": ["s"], "task_nodes": [{"task": "Translation", "arguments": [5]}]})
    m = assert_equal_to_upstream([it, no_args], [json.dumps(_result(it.gold)), bad], td, "huggingface")
    assert m["n_scored_upstream"] == 2
    # with nothing converted before, upstream's append fails and the sample is dropped
    m = assert_equal_to_upstream([no_args], [bad], td, "huggingface")
    assert m["n_scored_upstream"] == 0 and m["dropped_ids"] == ["b"] and m["upstream"]["node_f1"] is None
    assert m["strict"]["node_f1"] == 100.0 and m["strict"]["arg_name_f1"] == 0.0


def test_resource_domain_hand_computed():
    td = T.load_tool_desc(DATA, "huggingface")
    a = _item({"id": "a", "task_steps": ["a", "b"],
               "task_nodes": [{"task": "Image-to-Text", "arguments": ["example.jpg"]},
                              {"task": "Text-to-Speech", "arguments": ["<node-0>"]}],
               "task_links": [{"source": "ignored", "target": "in resource mode"}]}, "huggingface")
    b = _item({"id": "b", "task_steps": ["c"], "task_nodes": [{"task": "Translation", "arguments": ["Hello"]}],
               "task_links": []}, "huggingface")
    pred_a = {"task_steps": ["..."], "task_nodes": [
        {"task": "Image-to-Text", "arguments": ["example.png"]},
        {"task": "Summarization", "arguments": ["<node-0>"]},
        {"task": "Made-Up Tool", "arguments": []}], "task_links": []}
    m, per = T.score([a, b], ["Here is the plan: " + json.dumps(pred_a) + " done", "sorry, no idea"], td, "huggingface")
    # upstream never sees b: node TP1 FP1 FN1 (the unknown tool is ignored) -> 50; arg names
    # (Image-to-Text-image, Summarization-text vs Text-to-Speech-text) TP1 FP1 FN1 -> 50; values 0;
    # links (I2T->Summ) vs (I2T->T2S) -> 0
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
    upstream_schema = {"id": "w", "task_steps": ["a", "b"], "task_nodes": nodes, "task_links": links}
    hub_schema = {"id": "w", "instruction": "weather", "tool_steps": '["a", "b"]', "tool_nodes": json.dumps(nodes),
                  "tool_links": json.dumps(links)}
    pred = {"task_steps": ["a"], "task_nodes": [{"task": "get_weather", "arguments": [
        {"name": "location", "value": "Paris"}, {"name": "date", "value": "tomorrow"}]}], "task_links": []}
    for rec in (upstream_schema, hub_schema):
        m, _ = T.score([_item(rec, "dailylifeapis")], [json.dumps(pred)], td, "dailylifeapis")
        # nodes TP1 FN1 -> 2/3; names TP2 FN1 -> 4/5; values TP1 FP1 FN2 -> 2/5; links FN1 -> 0
        assert m["upstream"] == pytest.approx({"node_f1": 200 / 3, "link_f1": 0.0, "arg_name_f1": 80.0,
                                               "arg_value_f1": 40.0})
        assert m["strict"] == m["upstream"] and m["dependency_type"] == "temporal"


def test_prediction_that_breaks_conversion_is_dropped_upstream_and_wrong_strict():
    td = T.load_tool_desc(DATA, "dailylifeapis")
    it = _item({"id": "x", "task_steps": ["s"], "task_links": [],
                "task_nodes": [{"task": "get_weather", "arguments": [{"name": "location", "value": "P"}]}]},
               "dailylifeapis")
    bad = {"task_steps": ["s"], "task_nodes": [{"task": "get_weather", "arguments": ["not a dict"]}], "task_links": []}
    m, per = T.score([it], [json.dumps(bad)], td, "dailylifeapis")
    assert m["upstream"]["node_f1"] is None and m["dropped_ids"] == ["x"] and per[0]["status"].startswith("parsing_error")
    # strict: the node is right, the argument is an invalid (wrong) one
    assert m["strict"] == {"node_f1": 100.0, "link_f1": 0.0, "arg_name_f1": 0.0, "arg_value_f1": 0.0}
    # a link upstream would crash on is a dropped sample here, a wrong link in strict
    odd = {"task_steps": ["s"], "task_nodes": it.gold["task_nodes"], "task_links": [{"source": ["a"], "target": "b"}]}
    m, per = T.score([it], [json.dumps(odd)], td, "dailylifeapis")
    assert m["dropped_ids"] == ["x"] and m["strict"]["node_f1"] == 100.0 and m["strict"]["link_f1"] == 0.0


def test_prompt_is_upstreams_inference_prompt():
    td = T.load_tool_desc(DATA, "dailylifeapis")
    it = T.load_domain(DATA, "dailylifeapis", limit=1)[0]
    (msg,) = T.prompt_messages(it, td, "dailylifeapis")
    text = msg["content"]
    assert msg["role"] == "user" and text.startswith("# TASK LIST #:\n{") and it.request in text
    assert text.endswith("now please generate your result in a strict JSON format:\n# RESULT #:")
    first_tool = json.loads(text.split("\n")[1])
    assert first_tool["parameters"] == [p["name"] for p in td["nodes"][0]["parameters"]]  # names only
    hf = T.prompt_template(T.load_tool_desc(DATA, "huggingface"), "huggingface")
    assert "tag '<node-j>' (start from 0)" in hf and "{{user_request}}" in hf


def test_scorer_rejects_a_length_mismatch():
    td = T.load_tool_desc(DATA, "huggingface")
    items = T.load_domain(DATA, "huggingface", limit=3)
    with pytest.raises(ValueError, match=r"taskbench: 3 items but 2 model outputs"):
        T.score(items, ["{}", "{}"], td, "huggingface")


def test_malformed_gold_names_file_and_record(tmp_path):
    d = tmp_path / "taskbench" / "data_huggingface"
    d.mkdir(parents=True)
    (d / "tool_desc.json").write_text((DATA / "taskbench" / "data_huggingface" / "tool_desc.json").read_text())
    (d / "data.json").write_text(json.dumps({"id": "1", "task_nodes": [], "task_links": []}) + "\n" +
                                 json.dumps({"id": "2", "tool_nodes": "[{bad json"}) + "\n")
    with pytest.raises(DataError, match=r"data\.json: record 1 \(id '2'\).*not valid JSON"):
        T.load_domain(tmp_path, "huggingface")
    (d / "data.json").write_text(json.dumps({"id": "3", "task_nodes": [{"name": "T", "arguments": []}]}) + "\n")
    with pytest.raises(DataError, match=r"data\.json: record 0 \(id '3'\): nodes must be a list of objects with a 'task'"):
        T.load_domain(tmp_path, "huggingface")
    (d / "data.json").write_text('{"id": "1", "task_nodes": []}\n{"id": \n')
    with pytest.raises(DataError, match=r"data\.json: line 2: invalid JSON"):
        T.load_domain(tmp_path, "huggingface")
    (d / "data.json").unlink()
    with pytest.raises(DataError, match="no data.json"):
        T.load_domain(tmp_path, "huggingface")


def test_quirky_gold_records_score_as_upstream_and_read_sensibly_in_strict():
    """Two real multimedia gold graphs: an integer argument, and ``arguments`` as one string (upstream
    iterates its characters). The gold graph as prediction is perfect under both metrics."""
    td = T.load_tool_desc(DATA, "multimedia")
    items = [it for it in T.load_domain(DATA, "multimedia") if it.id in ("17177733",) or any(
        not isinstance(a, (str, dict)) for n in it.gold["task_nodes"] for a in n["arguments"])]
    assert len(items) == 2
    text_arg = next(it for it in items if it.id == "17177733")
    assert isinstance(text_arg.gold["task_nodes"][0]["arguments"], str)
    m = assert_equal_to_upstream(items, [json.dumps(_result(it.gold)) for it in items], td, "multimedia")
    perfect = {"node_f1": 100.0, "link_f1": 0.0, "arg_name_f1": 100.0, "arg_value_f1": 100.0}  # no links at all
    assert m["upstream"] == m["strict"] == perfect
    # the text read as one argument (strict) vs character by character (upstream)
    one = json.dumps(_result(text_arg.gold, task_nodes=[{"task": "Text Simplifier",
                                                          "arguments": [text_arg.gold["task_nodes"][0]["arguments"]]}]))
    m = assert_equal_to_upstream([text_arg], [one], td, "multimedia")
    assert m["strict"]["arg_value_f1"] == 100.0 and m["upstream"]["arg_value_f1"] < 10.0
