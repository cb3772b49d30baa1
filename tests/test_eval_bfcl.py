"""BFCL scoring equals bfcl-eval's own evaluator on the same outputs.

The reference is bfcl's ``eval_checker/eval_runner.py``: its per-entry functions
``_evaluate_single_ast_entry``, ``_evaluate_single_relevance_entry`` and
``_evaluate_single_multi_turn_entry`` are compiled from the installed file (the module itself imports
pandas and every model handler, which we do not install) and run with bfcl's prompting decoder.
"""
from __future__ import annotations

import ast
import copy
import uuid
from pathlib import Path

import pytest

bfcl_eval = pytest.importorskip("bfcl_eval")

from reflrl.eval import bfcl as B  # noqa: E402


@pytest.fixture(scope="module")
def runner():
    ns_b = B.bfcl()
    import bfcl_eval.eval_checker as ec

    src = (Path(ec.__file__).parent / "eval_runner.py").read_text()
    tree = ast.parse(src)
    wanted = {"_evaluate_single_ast_entry", "_evaluate_single_relevance_entry",
              "_evaluate_single_multi_turn_entry"}
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {f.name for f in funcs} == wanted
    ns = {"ast_checker": ns_b.ast_checker, "multi_turn_checker": ns_b.multi_turn_checker,
          "is_function_calling_format_output": ns_b.utils.is_function_calling_format_output,
          "is_empty_output": ns_b.utils.is_empty_output,
          "is_empty_execute_response": ns_b.is_empty_execute_response,
          "Language": ns_b.Language, "ReturnFormat": ns_b.ReturnFormat, "BaseHandler": object}
    exec(compile(ast.Module(body=funcs, type_ignores=[]), "eval_runner.py", "exec"), ns)

    class OssPromptingHandler:  # what bfcl's base_oss_handler.decode_ast/decode_execute do
        def decode_ast(self, result, language, has_tool_call_tag):
            return ns_b.decode_ast(result, language, has_tool_call_tag)

        def decode_execute(self, result, has_tool_call_tag):
            return ns_b.decode_execute(result, has_tool_call_tag)

    ns["handler"] = OssPromptingHandler()
    return ns


def _bfcl_verdict(runner, entry: B.BfclEntry, output):
    h = runner["handler"]
    if entry.category in B.RELEVANCE:
        return runner["_evaluate_single_relevance_entry"](h, entry.id, output, copy.deepcopy(entry.check_prompt),
                                                          B.CHECKER_MODEL, entry.category)
    if entry.multi_turn:
        name = f"ref_{uuid.uuid4().hex[:10]}"
        try:
            return runner["_evaluate_single_multi_turn_entry"](h, entry.id, output, entry.ground_truth,
                                                               copy.deepcopy(entry.check_prompt), name, entry.category)
        finally:
            B._forget_instances(name)
    lang = {"java": runner["Language"].JAVA}.get(B.language_of(entry.category), runner["Language"].PYTHON)
    return runner["_evaluate_single_ast_entry"](h, entry.id, output, entry.ground_truth,
                                                copy.deepcopy(entry.check_prompt), B.CHECKER_MODEL,
                                                entry.category, language=lang,
                                                return_format=runner["ReturnFormat"].PYTHON)


def _variants(entry: B.BfclEntry) -> dict[str, str]:
    """correct, wrong-value, missing-parameter, extra-call and unparseable outputs for an AST entry."""
    gold = B.gold_output(entry.ground_truth, entry.check_prompt["function"])
    first = entry.ground_truth[0]
    fname, params = next(iter(first.items()))
    req = next((f.get("parameters", {}).get("required", []) for f in entry.check_prompt["function"]
                if f["name"] == fname), [])
    wrong = copy.deepcopy(entry.ground_truth)
    p0 = next(iter(params))
    wrong[0][fname][p0] = ["reflrl-wrong-value-123"]
    missing = copy.deepcopy(entry.ground_truth)
    drop = next((p for p in params if p in req), p0)
    del missing[0][fname][drop]
    calls = gold[1:-1]
    return {"correct": gold, "wrong_value": B.gold_output(wrong, entry.check_prompt["function"]),
            "missing_param": B.gold_output(missing, entry.check_prompt["function"]),
            "extra_call": f"[{calls}, {calls.split('), ')[0].rstrip(')')})]",
            "unparseable": "I think you should call the function with base 10.",
            "bad_syntax": gold[:-3]}


AST_CATEGORIES = ["simple_python", "multiple", "parallel", "parallel_multiple", "live_simple",
                  "live_multiple", "live_parallel"]


@pytest.mark.parametrize("category", AST_CATEGORIES)
def test_ast_categories_match_bfcl_evaluator(runner, category):
    entries = B.load_entries(category, limit=4)
    seen_valid = {True: 0, False: 0}
    for e in entries:
        for kind, out in _variants(e).items():
            ours = B.score_single(e, out)
            ref = _bfcl_verdict(runner, e, out)
            assert ours["valid"] == ref["valid"], (e.id, kind, out, ours, ref)
            if not ref["valid"]:
                assert ours["error_type"] == ref["error_type"], (e.id, kind)
            seen_valid[ours["valid"]] += 1
        assert B.score_single(e, _variants(e)["correct"])["valid"]
        assert not B.score_single(e, _variants(e)["unparseable"])["valid"]
    assert seen_valid[True] >= len(entries) and seen_valid[False] >= 3 * len(entries)


@pytest.mark.parametrize("category", ["irrelevance", "live_irrelevance", "live_relevance"])
def test_relevance_categories_match_bfcl_evaluator(runner, category):
    entries = B.load_entries(category, limit=3)
    fn = entries[0].check_prompt["function"][0]["name"]
    outputs = ["I cannot help with that.", "[]", f"[{fn}(x=1)]", f"{fn}(", "[{'a': 1}]"]
    verdicts = []
    for e in entries:
        for out in outputs:
            ours = B.score_single(e, out)
            ref = _bfcl_verdict(runner, e, out)
            assert ours["valid"] == ref["valid"], (e.id, out)
            verdicts.append(ours["valid"])
    assert True in verdicts and False in verdicts


def _mt_gold_steps(entry: B.BfclEntry) -> list[list[str]]:
    return [["[" + ", ".join(turn) + "]"] if turn else ["I cannot do that."] for turn in entry.ground_truth]


def test_multi_turn_matches_bfcl_evaluator(runner):
    entries = B.load_entries("multi_turn_base", limit=3)
    kinds = 0
    for e in entries:
        gold = _mt_gold_steps(e)
        short = [t[:] for t in gold]
        short[0] = ["[" + ", ".join(e.ground_truth[0][:-1]) + "]"] if len(e.ground_truth[0]) > 1 else ["nothing"]
        outputs = {"gold": gold, "missing_call": short, "empty_turns": [[""] for _ in gold],
                   "unparseable": [["cd(folder="] for _ in gold], "wrong_turn_count": gold[:-1],
                   "split_steps": [[f"[{c}]" for c in turn] for turn in e.ground_truth]}
        for kind, out in outputs.items():
            ours = B.score_multi_turn(e, out)
            ref = _bfcl_verdict(runner, e, copy.deepcopy(out))
            assert ours["valid"] == ref["valid"], (e.id, kind)
            kinds += 1
            if not ref["valid"]:
                assert ours["error_type"] == ref["error"]["error_type"], (e.id, kind)
        # the same scoring twice gives the same verdict (fresh backend instances each time)
        assert B.score_multi_turn(e, gold)["valid"] == B.score_multi_turn(e, gold)["valid"]
    assert kinds == 18


def test_unsafe_outputs_are_refused_and_counted():
    e = B.load_entries("simple_python", limit=1)[0]
    for out in ["[calculate_triangle_area(base=__import__('os').getpid() + 1, height=5)]",
                "[calculate_triangle_area(base=(lambda: 1)(), height=5)]"]:
        v = B.score_single(e, out)
        assert not v["valid"] and v.get("unsafe")
    ok = B.score_single(e, "[calculate_triangle_area(base=5 * 2, height=5)]")  # literal arithmetic is fine
    assert ok["valid"]


def test_multi_turn_executor_only_sees_whitelisted_calls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    e = B.load_entries("multi_turn_base", limit=1)[0]
    calls = B.decode_execute("[open(file='pwned.txt', mode='w'), cd(folder='document')]",
                             e.check_prompt["involved_classes"])
    assert calls == [B.BLOCKED_CALL, "cd(folder='document')"]
    v = B.score_multi_turn(e, [["[open(file='pwned.txt', mode='w')]"] for _ in e.ground_truth])
    assert not v["valid"] and not (tmp_path / "pwned.txt").exists()


def test_categories_and_summary_groups():
    assert B.resolve_categories("simple,live_simple") == ["simple_python", "live_simple"]
    assert B.resolve_categories("multi_turn")[0] == "multi_turn_base"
    with pytest.raises(ValueError, match="unknown BFCL category 'simpel'"):
        B.resolve_categories("simpel")
    s = B.summarize({"simple_python": 0.5, "multiple": 1.0, "live_simple": 0.0, "live_multiple": 1.0,
                     "multi_turn_base": 0.2},
                    {"simple_python": 10, "multiple": 10, "live_simple": 1, "live_multiple": 3, "multi_turn_base": 5})
    assert s["non_live"] == pytest.approx(0.75)       # unweighted over simple, multiple
    assert s["live"] == pytest.approx(0.75)           # count-weighted: (0*1 + 1*3) / 4
    assert s["multi_turn"] == pytest.approx(0.2)
    assert s["overall"] == pytest.approx((0.75 * 10 + 0.75 * 10 + 0.2 * 30) / 50)


def test_system_prompt_is_bfcl_default():
    t = B.system_prompt_template()
    assert "{functions}" in t and "You are an expert in composing functions." in t
    e = B.load_entries("simple_python", limit=1)[0]
    msgs = B.single_turn_messages(e)
    assert msgs[0]["role"] == "system" and e.prompt["function"][0]["name"] in msgs[0]["content"]
    assert msgs[1] == e.prompt["question"][0][0]
