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

from reflrl.errors import UserError

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


# Outputs that bfcl's decoder evaluates (BinOp) or would seem to (lambda): literal expressions are
# folded to bfcl's values, positional arguments ignored as bfcl ignores them. bfcl's real decoder is
# safe to run on these fixed strings, so it is the reference here.
LITERAL_EXPRESSION_CASES = {
    "concatenation": "[calculate_triangle_area(base='1' + '0', height=5)]",
    "power": "[calculate_triangle_area(base=10**1, height=5**1)]",
    "positional_lambda": "[calculate_triangle_area(lambda q: q, base=10, height=5)]",
    "keyword_lambda": "[calculate_triangle_area(base=lambda: 10, height=5)]",
    "arithmetic": "[calculate_triangle_area(base=5 * 2, height=-3 + 8)]",
    "float_arithmetic": "[calculate_triangle_area(base=20 / 2, height=5)]",
    "list_concatenation": "[calculate_triangle_area(base=10, height=5, unit=['c'] + ['m'])]",
    "zero_division": "[calculate_triangle_area(base=10 // 0, height=5)]",
    "type_error": "[calculate_triangle_area(base='10' + 1, height=5)]",
    "overflow": "[calculate_triangle_area(base=2.0 ** 5000, height=5)]",
    "nested_call_keyword": "[calculate_triangle_area(base=int(x=5 + 5), height=5)]",
    "nested_call_positional": "[calculate_triangle_area(base=int(5 + 5), height=5)]",
    "repetition": "[calculate_triangle_area(base=10, height=5, unit='c' * 2)]",
}


@pytest.mark.parametrize("category", ["simple_python", "irrelevance"])
def test_literal_expressions_score_as_bfcl_scores_them(runner, category):
    e = B.load_entries(category, limit=1)[0]
    verdicts = {}
    for kind, out in LITERAL_EXPRESSION_CASES.items():
        ours = B.score_single(e, out)
        ref = _bfcl_verdict(runner, e, out)
        assert ours["valid"] == ref["valid"], (kind, ours, ref)
        assert not ours.get("unevaluated"), kind
        if not ref["valid"] and category == "simple_python":
            assert ours["error_type"] == ref["error_type"], kind
        verdicts[kind] = ours["valid"]
    if category == "simple_python":  # the gold is base=10, height=5: folded values are right
        assert verdicts["concatenation"] is False  # '10' is a string, not an integer: wrong type
        assert verdicts["power"] and verdicts["positional_lambda"] and verdicts["arithmetic"]
        assert not verdicts["zero_division"] and not verdicts["keyword_lambda"]
    else:  # irrelevance: a decoded call is wrong; an output bfcl cannot decode is "no call"
        assert verdicts["concatenation"] is False and verdicts["power"] is False
        assert verdicts["positional_lambda"] is False
        assert verdicts["zero_division"] is True and verdicts["keyword_lambda"] is True


def test_decoder_equals_bfcl_decoder_on_random_literal_expressions():
    """Random expressions over small literals: folded values (or raised errors) equal bfcl's eval."""
    from hypothesis import given, settings, strategies as st

    ns = B.bfcl()
    atoms = st.sampled_from(["0", "1", "2", "5", "-3", "2.5", "0.0", "True", "None", "'ab'", "''", "b'x'",
                             "[1]", "[]", "(1, 'a')", "{'k': 1}", "{1, 2}", "3j"])
    ops = st.sampled_from(["+", "-", "*", "/", "//", "%", "**", "<<", ">>", "|", "&", "^", "@"])

    def combine(children):
        return st.one_of(
            st.tuples(children, ops, children).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
            st.tuples(st.sampled_from(["-", "+", "~", "not "]), children).map(lambda t: f"({t[0]}{t[1]})"),
            st.lists(children, max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]"))

    exprs = st.recursive(atoms, combine, max_leaves=6)

    def outcome(fn):
        try:
            return repr(fn())
        except Exception as e:  # noqa: BLE001
            return type(e).__name__

    @settings(max_examples=300, deadline=None)
    @given(st.tuples(exprs, ops, exprs))
    def check(t):
        out = f"[f(x={t[0]} {t[1]} {t[2]})]"
        ours = outcome(lambda: B.decode_ast(out, "simple_python"))
        if ours == "Unevaluated":  # over the size bounds: bfcl's value is not computed here
            return
        assert ours == outcome(lambda: ns.decode_ast(out, ns.ReturnFormat.PYTHON, False)), out

    check()


def test_outputs_bfcl_would_run_are_wrong_as_calls_and_never_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    expr = "open('pwned.txt', 'w').write('x') + 1"
    out = f"[calculate_triangle_area(base={expr}, height=5)]"
    for category in ("simple_python", "irrelevance", "live_relevance"):
        e = B.load_entries(category, limit=1)[0]
        v = B.score_single(e, out)
        assert not v["valid"] and v["error_type"] == B.UNEVALUATED, category  # never "no call"
        assert v["unevaluated"] == ["open('pwned.txt', 'w').write('x') + 1"]
    assert not (tmp_path / "pwned.txt").exists()
    # bounds: results too large to build are not computed (bfcl would try), and are listed
    e = B.load_entries("simple_python", limit=1)[0]
    for big in ("9 ** 9 ** 9", "'a' * 10 ** 9", "[0] * 10 ** 8", "1 << 10 ** 9", "'%999999999d' % 1"):
        v = B.score_single(e, f"[calculate_triangle_area(base={big}, height=5)]")
        assert v["error_type"] == B.UNEVALUATED and v["unevaluated"] == [big], big
    # when bfcl's decoding fails whatever the expression gives, the verdict is bfcl's (here: no call)
    irr = B.load_entries("irrelevance", limit=1)[0]
    v = B.score_single(irr, f"[calculate_triangle_area(base={expr}), 5]")
    assert v["valid"] and not v.get("unevaluated") and not (tmp_path / "pwned.txt").exists()


def test_bfcl_scoring_counts_and_lists_unevaluated_outputs():
    from reflrl.eval.run import _bfcl_score

    entries = B.load_entries("irrelevance", limit=3)
    outs = ["I cannot help.", "[f(x=os.getpid() + 1)]", "[f(x=1 + 1)]"]
    m, per = _bfcl_score(entries, outs)
    assert m["n"] == 3 and m["accuracy"] == pytest.approx(100 / 3)
    assert m["unevaluated_outputs"] == 1 and m["unevaluated_ids"] == [entries[1].id]
    assert per[1]["unevaluated"] == ["os.getpid() + 1"]
    with pytest.raises(ValueError, match=r"bfcl: 3 items but 2 model outputs"):
        _bfcl_score(entries, outs[:2])


def test_multi_turn_executor_only_sees_whitelisted_calls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    e = B.load_entries("multi_turn_base", limit=1)[0]
    calls = B.decode_execute("[open(file='pwned.txt', mode='w'), cd(folder='document')]",
                             e.check_prompt["involved_classes"])
    assert calls == [B.BLOCKED_CALL, "cd(folder='document')"]
    v = B.score_multi_turn(e, [["[open(file='pwned.txt', mode='w')]"] for _ in e.ground_truth])
    assert not v["valid"] and not (tmp_path / "pwned.txt").exists()
    # a call holding an expression bfcl would evaluate is blocked, and the entry is wrong
    step = "[cd(folder='doc' + open('pwned.txt', 'w').name), ls()]"
    assert B.decode_execute(step, e.check_prompt["involved_classes"]) == [B.BLOCKED_CALL, "ls()"]
    assert B.decode_execute("[cd(folder='doc' + 'ument')]", e.check_prompt["involved_classes"]) == [
        "cd(folder='document')"]
    v = B.score_multi_turn(e, [[step] for _ in e.ground_truth])
    assert not v["valid"] and v["error_type"] == B.UNEVALUATED and len(v["unevaluated"]) == len(e.ground_truth)
    assert not (tmp_path / "pwned.txt").exists()


def test_categories_and_summary_groups():
    assert B.resolve_categories("simple,live_simple") == ["simple_python", "live_simple"]
    assert B.resolve_categories("multi_turn")[0] == "multi_turn_base"
    with pytest.raises(UserError, match="unknown BFCL category 'simpel'"):
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
