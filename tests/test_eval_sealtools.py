"""Seal-Tools metrics on hand-computed cases (rules of fairyshine/Seal-Tools calculate.py and
transform_output.py, case 'ToolLearning')."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from reflrl.eval import sealtools as S
from reflrl.eval.data import DataError

DATA = Path(__file__).resolve().parent / "fixtures" / "benchmarks"


def test_hand_computed_scores():
    items = [S.SealItem("1", "q", [{"api": "A", "parameters": {"x": "1", "y": "2"}},
                                   {"api": "B", "parameters": {"z": "API_call_0"}}], []),
             S.SealItem("2", "q", [{"api": "C", "parameters": {"q": "hi"}}], [])]
    out1 = ("Sure:\n[{'api': 'A', 'parameters': {'x': 1, 'y': '3'}, 'responses': ['API_call_0']},\n"
            ' {"api": "D", "parameters": {"w": "v"}, "responses": []}] hope it helps')
    m, per = S.score(items, [out1, "no idea"])
    assert m["format_rate"] == 50.0
    # APIs: correct 1 / predicted 2 / gold 3; params: correct 1 (x: str(1) == "1") / predicted 3 / gold 4
    assert m["api_p"] == pytest.approx(50.0) and m["api_r"] == pytest.approx(100 / 3)
    assert m["api_f1"] == pytest.approx(40.0)
    assert m["param_p"] == pytest.approx(100 / 3) and m["param_r"] == pytest.approx(25.0)
    assert m["param_f1"] == pytest.approx(200 / 7)
    assert [p["parsed"] for p in per] == [True, False]


def test_parser_follows_upstream():
    assert S.parse_output('[{"api": "A", "parameters": {}}]') == -1          # no "responses"
    assert S.parse_output('[{"api": "A", "parameters": {}, "responses": []}') == -1  # unbalanced
    assert S.parse_output("[{'api': 'A', 'parameters': {'k': 'v'}, 'responses': []}]") == [
        {"api": "A", "parameters": {"k": "v"}, "responses": []}]
    assert S.parse_output(None) == -1
    m, _ = S.score([S.SealItem("1", "q", [{"api": "A", "parameters": {}}], [])],
                   ['[{"api": "A", "parameters": 5, "responses": []}, 7, "api"]'])
    assert m["counts"]["predicted_api"] == 1 and m["api_f1"] == 100.0  # non-object items ignored


def test_gold_as_output_scores_perfectly_and_malformed_record(tmp_path):
    tools = S.load_tools(DATA)
    items = S.load_split(DATA / "seal-tools" / "dev_subset.jsonl", tools, limit=30)
    m, _ = S.score(items, [json.dumps(i.calling) for i in items])
    assert m["api_f1"] == 100.0 and m["param_f1"] == 100.0 and m["format_rate"] == 100.0
    bad = tmp_path / "dev.jsonl"
    bad.write_text('{"id": "ok", "query": "q", "calling": []}\n{"id": "b", "query": "q", "calling": [{"api": 3}]}\n')
    with pytest.raises(DataError, match=r"dev\.jsonl: record 1 \(id 'b'\)"):
        S.load_split(bad, tools)


def test_scorers_reject_a_length_mismatch():
    from reflrl.eval import rotbench as R

    items = [S.SealItem("1", "q", [{"api": "A", "parameters": {}}], []),
             S.SealItem("2", "q", [{"api": "B", "parameters": {}}], [])]
    with pytest.raises(ValueError, match=r"sealtools: 2 items but 1 model outputs"):
        S.score(items, ["[]"])
    rot = R.load_level(DATA, "clean", limit=2)
    with pytest.raises(ValueError, match=r"rotbench: 2 items but 3 model outputs"):
        R.score(rot, ["a", "b", "c"])
