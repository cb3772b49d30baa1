"""BFCL (Berkeley Function Calling Leaderboard) with ``bfcl-eval``'s own data, prompt, decoder and checkers.

What runs is bfcl-eval's code (``bfcl_eval==2026.3.23``, installed ``--no-deps``):

* data: ``bfcl_eval.utils.load_dataset_entry`` / ``load_ground_truth_entry`` (the package's ``data/``);
* prompt: ``model_handler.utils.system_prompt_pre_processing_chat_model`` -- BFCL's default system prompt
  (``DEFAULT_SYSTEM_PROMPT_FORMAT``: python return format, no tag, JSON function docs, plaintext,
  classic style), exactly as bfcl's prompting OSS handler builds it;
* decoder: ``default_decode_ast_prompting`` / ``default_decode_execute_prompting`` (bfcl's
  ``base_oss_handler.decode_ast/decode_execute``), for python outputs through
  :mod:`reflrl.eval.bfcl_decode` (bfcl's ``resolve_ast_call`` on a tree whose literal expressions are
  folded first, see below);
* checkers: ``ast_checker`` (single-turn), the relevance rule, and ``multi_turn_checker`` (state +
  response checker of multi-turn categories); the per-entry glue of :func:`score_single` and
  :func:`score_multi_turn` mirrors ``eval_checker/eval_runner.py::_evaluate_single_ast_entry``,
  ``_evaluate_single_relevance_entry`` and ``_evaluate_single_multi_turn_entry`` line by line
  (tests/test_eval_bfcl.py runs those very functions, compiled from the installed file, and asserts
  equal verdicts);
* summary groups: ``eval_runner_helper.generate_leaderboard_csv`` (Non-Live: unweighted mean of
  simple / multiple / parallel / parallel_multiple with simple = mean of the python/java/js simple
  categories; Live: count-weighted mean of the four live AST categories; Multi-turn: unweighted mean;
  Overall: BFCL's percentage weights 10/10/10/30/40 for non-live/live/irrelevance/multi-turn/agentic).
  BFCL counts a category that was not run as 0; we average over the categories that were run and
  renormalise the Overall weights over the groups that were run (the report lists which).

Importing bfcl's checker modules needs two small shims, registered in ``sys.modules`` only when the
real module cannot be imported (:func:`bfcl`):

* ``bfcl_eval.constants.model_config`` imports every model handler (anthropic, cohere, mistralai, ...).
  ``ast_checker`` uses only ``MODEL_CONFIG_MAPPING[name].underscore_to_dot``; the shim provides the
  ``ModelConfig`` dataclass and a mapping holding our prompting-mode entry (``underscore_to_dot=False``,
  like every prompting model in BFCL). With the real module present, our entry is added to it.
* ``model_handler/parser/{java,js}_parser`` import ``tree_sitter``; without it the shim raises a clear
  error when a Java/JavaScript entry is decoded (install ``tree-sitter tree-sitter-java
  tree-sitter-javascript`` to score ``simple_java`` / ``simple_javascript``).

Model output is data (project rule). bfcl's decoder ``eval``s the ``BinOp`` values of an output and
its multi-turn executor ``eval``s call strings. We decode with :mod:`reflrl.eval.bfcl_decode`, which
gives bfcl's result without running anything: it folds the literal expressions bfcl would evaluate
and hands the calls to bfcl's own ``resolve_ast_call``. An output whose decoding would need
anything else run is scored wrong in every category (counted as ``unevaluated`` and listed in the
report); it is never taken for "no call", which the irrelevance categories would credit. Every
call string handed to the multi-turn executor must be a plain call of a method of the entry's
involved classes with literal arguments (others are replaced by a call that fails with a
NameError, as unknown names do in bfcl).
"""
from __future__ import annotations

import ast
import copy
import importlib
import importlib.util
import inspect
import os
import re
import sys
import types
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Generator

from reflrl.envs.parsing import parse_expression
from reflrl.errors import UserError

from .bfcl_decode import Unevaluated, decode_python, decode_python_calls

NON_LIVE_AST = ("simple_python", "simple_java", "simple_javascript", "multiple", "parallel",
                "parallel_multiple")
LIVE_AST = ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
RELEVANCE = ("irrelevance", "live_irrelevance", "live_relevance")
MULTI_TURN = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param",
              "multi_turn_long_context")
SINGLE_TURN = NON_LIVE_AST + ("irrelevance",) + LIVE_AST + ("live_irrelevance", "live_relevance")
ALL_CATEGORIES = SINGLE_TURN + MULTI_TURN
ALIASES: dict[str, tuple[str, ...]] = {
    "simple": ("simple_python",),
    "java": ("simple_java",),
    "javascript": ("simple_javascript",),
    "non_live": NON_LIVE_AST + ("irrelevance",),
    "live": LIVE_AST + ("live_irrelevance", "live_relevance"),
    "multi_turn": MULTI_TURN,
    "single_turn": SINGLE_TURN,
    "all": ALL_CATEGORIES,
}
#: run when --categories is not given: the python Non-Live and Live AST categories, i.e. the BFCL
#: columns of the Tool-ReRL table (Tool-ReRL Table 2). Multi-turn categories are opt-in
#: (``--categories multi_turn_base`` or ``multi_turn``): their prompts carry thousands of tokens of
#: function docs and every step re-reads the history, which takes hours for a CPU model.
DEFAULT_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "live_simple",
                      "live_multiple", "live_parallel", "live_parallel_multiple")
#: model name handed to bfcl's checkers; "_" -> "/" gives the MODEL_CONFIG_MAPPING key.
CHECKER_MODEL = "reflrl_prompting"
_CHECKER_KEY = CHECKER_MODEL.replace("_", "/")
#: bfcl's MAXIMUM_STEP_LIMIT (constants/default_prompts.py): steps per turn before a forced quit.
MAX_STEPS = 20
BLOCKED_CALL = "reflrl_blocked_call()"
#: error_type of an output scored wrong because its decoding would run part of it
UNEVALUATED = "reflrl:unevaluated_expression"


class BfclUnavailable(UserError, RuntimeError):
    """bfcl-eval (or an optional part of it) is not installed."""


# ------------------------------------------------------------------------------------- import
def _shim_model_config() -> Any:
    name = "bfcl_eval.constants.model_config"
    mod = types.ModuleType(name)
    mod.__doc__ = ("reflrl shim for bfcl's model_config (the real one imports every model handler). "
                   "Only MODEL_CONFIG_MAPPING[...].underscore_to_dot is read by ast_checker.")

    @dataclass
    class ModelConfig:  # same fields as bfcl_eval.constants.model_config.ModelConfig
        model_name: str
        display_name: str
        url: str
        org: str
        license: str
        model_handler: Any
        input_price: float | None = None
        output_price: float | None = None
        is_fc_model: bool = True
        underscore_to_dot: bool = False

    mod.ModelConfig = ModelConfig
    mod.MODEL_CONFIG_MAPPING = {}
    mod.REFLRL_SHIM = True
    sys.modules[name] = mod
    import bfcl_eval.constants as constants

    constants.model_config = mod
    return mod


def _shim_tree_sitter_parsers() -> None:
    hint = ("scoring Java/JavaScript BFCL categories needs tree-sitter: "
            "pip install tree-sitter tree-sitter-java tree-sitter-javascript")
    for lang, fn in (("java", "parse_java_function_call"), ("js", "parse_javascript_function_call")):
        name = f"bfcl_eval.model_handler.parser.{lang}_parser"
        mod = types.ModuleType(name)
        mod.REFLRL_SHIM = True

        def _missing(*_a: Any, **_k: Any) -> Any:
            raise BfclUnavailable(hint)

        setattr(mod, fn, _missing)
        sys.modules[name] = mod


@lru_cache(maxsize=1)
def bfcl() -> types.SimpleNamespace:
    """bfcl-eval's functions we call (imported once, with the shims described in the module doc)."""
    if importlib.util.find_spec("bfcl_eval") is None:
        raise BfclUnavailable("bfcl-eval is not installed: pip install --no-deps bfcl-eval==2026.3.23")
    # bfcl creates result/score/lock folders under BFCL_PROJECT_ROOT at import: keep them in our cache
    root = Path(os.environ.get("REFLRL_CACHE") or Path.home() / ".cache" / "reflrl") / "bfcl"
    os.environ.setdefault("BFCL_PROJECT_ROOT", str(root))
    shims: list[str] = []
    try:
        import bfcl_eval.constants.model_config as mc
    except ImportError:
        mc = _shim_model_config()
        shims.append("bfcl_eval.constants.model_config")
    mc.MODEL_CONFIG_MAPPING.setdefault(_CHECKER_KEY, mc.ModelConfig(
        model_name=_CHECKER_KEY, display_name="reflrl (Prompt)", url="", org="reflrl",
        license="Apache-2.0", model_handler=None, is_fc_model=False, underscore_to_dot=False))
    has_ts = all(importlib.util.find_spec(m) is not None
                 for m in ("tree_sitter", "tree_sitter_java", "tree_sitter_javascript"))
    if not has_ts:
        _shim_tree_sitter_parsers()
        shims.append("bfcl_eval.model_handler.parser.{java,js}_parser")
    from bfcl_eval import utils
    from bfcl_eval.constants import default_prompts
    from bfcl_eval.constants.enums import Language, ReturnFormat
    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker
    from bfcl_eval.model_handler import utils as handler_utils

    from importlib.metadata import version

    return types.SimpleNamespace(
        version=version("bfcl-eval"), shims=shims, has_tree_sitter=has_ts, utils=utils,
        Language=Language, ReturnFormat=ReturnFormat, ast_checker=ast_checker,
        multi_turn_checker=multi_turn_checker, multi_turn_utils=multi_turn_utils,
        execute=multi_turn_utils.execute_multi_turn_func_call,
        is_empty_execute_response=multi_turn_utils.is_empty_execute_response,
        # bfcl's own decoders eval BinOps: reflrl runs decode_ast only for Java/JavaScript (whose
        # decoders evaluate nothing); the tests use both as the reference for bfcl_decode
        decode_ast=handler_utils.default_decode_ast_prompting,
        decode_execute=handler_utils.default_decode_execute_prompting,
        resolve_ast_call=handler_utils.resolve_ast_call,
        to_execution_list=handler_utils.decoded_output_to_execution_list,
        system_prompt=handler_utils.system_prompt_pre_processing_chat_model,
        default_prompts=default_prompts, class_paths=CLASS_FILE_PATH_MAPPING,
        package_root=Path(utils.PROMPT_PATH),
    )


# --------------------------------------------------------------------------------- categories
def resolve_categories(spec: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """``"simple,live,multi_turn_base"`` -> BFCL category names (aliases expanded, order kept).

    Raises ValueError naming an unknown category.
    """
    if spec is None:
        return list(DEFAULT_CATEGORIES)
    items = spec.split(",") if isinstance(spec, str) else [c for s in spec for c in s.split(",")]
    out: list[str] = []
    for raw in items:
        c = raw.strip()
        if not c:
            continue
        names = ALIASES.get(c, (c,) if c in ALL_CATEGORIES else None)
        if names is None:
            raise UserError(f"unknown BFCL category {c!r}; known: {', '.join(ALL_CATEGORIES)} "
                             f"and groups {', '.join(ALIASES)}")
        out.extend(n for n in names if n not in out)
    return out


def language_of(category: str) -> str:
    return "java" if category == "simple_java" else "javascript" if category == "simple_javascript" else "python"


@dataclass
class BfclEntry:
    """One BFCL test entry: ``prompt`` (with bfcl's language hints, used to prompt the model),
    ``check_prompt`` (without hints, what bfcl's evaluator hands to the checker) and
    ``ground_truth`` (None for relevance categories)."""

    id: str
    category: str
    prompt: dict[str, Any]
    check_prompt: dict[str, Any]
    ground_truth: Any = None

    @property
    def multi_turn(self) -> bool:
        return self.category in MULTI_TURN


def data_files(categories: list[str]) -> list[Path]:
    """The package data files the categories read (for the manifest's data hashes)."""
    B = bfcl()
    root = B.package_root
    out = []
    for c in categories:
        out.append(root / f"{B.utils.VERSION_PREFIX}_{c}.json")
        if c not in RELEVANCE:
            out.append(root / "possible_answer" / f"{B.utils.VERSION_PREFIX}_{c}.json")
    return out


def load_entries(category: str, limit: int | None = None) -> list[BfclEntry]:
    """The first ``limit`` entries of ``category`` (all when None), in bfcl's file order."""
    B = bfcl()
    if category not in ALL_CATEGORIES:
        raise UserError(f"unknown BFCL category {category!r}")
    if language_of(category) != "python" and not B.has_tree_sitter:
        raise BfclUnavailable(f"category {category}: needs tree-sitter to decode; "
                              "pip install tree-sitter tree-sitter-java tree-sitter-javascript")
    prompts = B.utils.load_dataset_entry(category, include_prereq=False, include_language_specific_hint=True)
    plain = {e["id"]: e for e in B.utils.load_dataset_entry(
        category, include_prereq=False, include_language_specific_hint=False)}
    answers = {} if category in RELEVANCE else {a["id"]: a for a in B.utils.load_ground_truth_entry(category)}
    out = []
    for e in prompts[: limit if limit is not None else None]:
        if category not in RELEVANCE and e["id"] not in answers:
            raise ValueError(f"BFCL {category}: entry {e['id']} has no ground truth in the package")
        out.append(BfclEntry(e["id"], category, e, plain[e["id"]],
                             None if category in RELEVANCE else answers[e["id"]]["ground_truth"]))
    return out


def system_prompt_template() -> str:
    """BFCL's default system prompt with ``{functions}`` standing for the entry's JSON function docs."""
    B = bfcl()
    text = B.system_prompt([{"role": "user", "content": ""}], [], "x")[0]["content"]
    return text.replace("[]", "{functions}", 1)


def single_turn_messages(entry: BfclEntry) -> list[dict[str, Any]]:
    """Chat messages for a single-turn entry: BFCL's system prompt (with the function docs) + turn 0."""
    B = bfcl()
    msgs = copy.deepcopy(entry.prompt["question"][0])
    return B.system_prompt(msgs, copy.deepcopy(entry.prompt["function"]), entry.id)


# ----------------------------------------------------------------------------------- decoding
def decode_ast(text: str, category: str) -> list[dict[str, Any]]:
    """bfcl's ``default_decode_ast_prompting`` for ``category``'s language, evaluating nothing.

    Raises what bfcl raises on an output it cannot decode, and
    :class:`~reflrl.eval.bfcl_decode.Unevaluated` when bfcl's result would depend on running part of
    the output (python only: the Java/JavaScript decoders evaluate nothing and run as they are).
    """
    B = bfcl()
    lang = language_of(category)
    if lang != "python":
        fmt = B.ReturnFormat.JAVA if lang == "java" else B.ReturnFormat.JAVASCRIPT
        return B.decode_ast(text, fmt, False)
    return decode_python(text, B.resolve_ast_call)


@lru_cache(maxsize=None)
def _class_methods(class_name: str) -> frozenset[str]:
    B = bfcl()
    cls = getattr(importlib.import_module(B.class_paths[class_name]), class_name)
    return frozenset(n for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
                     if not n.startswith("_"))


_ALLOWED_NODES = (ast.Expression, ast.Call, ast.keyword, ast.Constant, ast.List, ast.Tuple, ast.Dict,
                  ast.Set, ast.UnaryOp, ast.USub, ast.UAdd, ast.Load, ast.Name)


def _safe_call_string(call: str, allowed: frozenset[str]) -> bool:
    try:
        tree = parse_expression(call)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    if not isinstance(tree.body, ast.Call):
        return False
    call_funcs = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            return False
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in allowed):
            return False
        if isinstance(node, ast.Name) and id(node) not in call_funcs:
            return False
    return True


def decode_execute(text: str, classes: list[str]) -> list[str]:
    """bfcl's ``default_decode_execute_prompting``, evaluating nothing: the call strings its executor
    would run. A call that is not a plain call of the involved classes' methods with literal
    arguments, or that holds an expression bfcl would evaluate, becomes ``BLOCKED_CALL``."""
    return decode_execute_unevaluated(text, classes)[0]


def decode_execute_unevaluated(text: str, classes: list[str]) -> tuple[list[str], list[str]]:
    """:func:`decode_execute` and the expressions bfcl would have evaluated (blocked calls)."""
    B = bfcl()
    allowed = frozenset().union(*(_class_methods(c) for c in classes)) if classes else frozenset()
    out: list[str] = []
    unevaluated: list[str] = []
    for call, unknown in decode_python_calls(text, B.resolve_ast_call):
        if unknown:
            unevaluated.extend(unknown)
            out.append(BLOCKED_CALL)
            continue
        out.extend(c if _safe_call_string(c, allowed) else BLOCKED_CALL for c in B.to_execution_list([call]))
    return out, unevaluated


def _forget_instances(model_name: str) -> None:
    """Drop the backend instances bfcl's executor cached in its module globals for ``model_name``."""
    g = vars(bfcl().multi_turn_utils)
    prefix = re.sub(r"[-./:]", "_", model_name)
    for k in [k for k in g if k.startswith(prefix) and k.endswith("_instance")]:
        del g[k]


# ------------------------------------------------------------------------------------ scoring
def score_single(entry: BfclEntry, text: Any) -> dict[str, Any]:
    """bfcl's verdict for a single-turn output: ``{"valid", "error_type", "error", "decoded"}``, plus
    ``"unevaluated"`` (the expressions) when the output holds code bfcl would run (scored wrong).

    Mirrors ``_evaluate_single_relevance_entry`` (relevance categories) and
    ``_evaluate_single_ast_entry`` (AST categories) of bfcl's ``eval_runner.py``.
    """
    B = bfcl()
    cat = entry.category
    out: dict[str, Any] = {"valid": False, "error_type": None, "error": None, "decoded": None}
    try:
        decoded = decode_ast(text, "simple_python" if cat in RELEVANCE else cat)
    except Unevaluated as e:  # a call we cannot decode without running it: wrong, never "no call"
        out.update(error_type=UNEVALUATED, error=str(e)[:300], unevaluated=e.expressions)
        return out
    except Exception as e:  # noqa: BLE001  bfcl: decode failure (relevance: no function call)
        decoded, decode_error = None, str(e)[:300]
    else:
        decode_error = None
        out["decoded"] = _jsonable(decoded)
    if cat in RELEVANCE:
        contain = decode_error is None and not B.utils.is_empty_output(decoded)
        ok = (not contain) if "irrelevance" in cat else contain
        out["valid"] = ok
        if not ok:
            out["error_type"] = ("irrelevance_error:decoder_success" if "irrelevance" in cat
                                 else "relevance_error:decoder_failed")
            out["error"] = decode_error
        return out
    if decode_error is not None:  # bfcl: "Invalid syntax. Failed to decode AST."
        out.update(error_type="ast_decoder:decoder_failed", error=decode_error)
        return out
    if not B.utils.is_function_calling_format_output(decoded):
        out.update(error_type="ast_decoder:decoder_wrong_output_format", error="not a list of calls")
        return out
    lang = {"java": B.Language.JAVA, "javascript": B.Language.JAVASCRIPT}.get(language_of(cat), B.Language.PYTHON)
    try:
        res = B.ast_checker(entry.check_prompt["function"], decoded, entry.ground_truth, lang, cat, CHECKER_MODEL)
    except Exception as e:  # noqa: BLE001  a checker crash on odd output is a wrong answer, counted
        out.update(error_type="checker_exception", error=f"{type(e).__name__}: {e}"[:300])
        return out
    out["valid"] = bool(res["valid"])
    if not res["valid"]:
        out.update(error_type=res.get("error_type"), error=_jsonable(res.get("error")))
    return out


def score_multi_turn(entry: BfclEntry, model_result: Any, model_name: str | None = None) -> dict[str, Any]:
    """bfcl's verdict for a multi-turn entry; ``model_result[turn][step]`` = raw model text.

    Mirrors ``_evaluate_single_multi_turn_entry``; the checker runs on fresh backend instances
    (a unique ``model_name`` per call, forgotten afterwards). A step holding an expression bfcl
    would evaluate makes the entry wrong (``unevaluated`` lists the expressions).
    """
    B = bfcl()
    gt = entry.ground_truth
    if not isinstance(model_result, list):
        return {"valid": False, "error_type": "multi_turn:inference_error",
                "error": "model did not output a list of model responses"}
    if len(model_result) != len(gt):
        return {"valid": False, "error_type": "multi_turn:force_terminated",
                "error": f"{len(model_result)} result turns for {len(gt)} ground-truth turns"}
    classes = entry.check_prompt["involved_classes"]
    decoded_all: list[list[list[str]]] = []
    unevaluated: list[str] = []
    for turn in model_result:
        decoded_turn = []
        for item in turn:
            try:
                decoded, unknown = decode_execute_unevaluated(item, classes)
                unevaluated.extend(unknown)
                if B.is_empty_execute_response(decoded):
                    continue
                decoded_turn.append(decoded)
            except Exception:  # noqa: BLE001  bfcl ignores steps that fail to decode
                continue
        decoded_all.append(decoded_turn)
    if unevaluated:
        return {"valid": False, "error_type": UNEVALUATED, "decoded": decoded_all, "unevaluated": unevaluated,
                "error": f"{len(unevaluated)} expression(s) bfcl would evaluate as code, not run here"}
    prompt_entry = copy.deepcopy(entry.check_prompt)
    prompt_entry.pop("function", None)
    name = model_name or f"reflrl_check_{uuid.uuid4().hex[:12]}"
    try:
        res = B.multi_turn_checker(decoded_all, gt, prompt_entry, entry.category, name)
    except Exception as e:  # noqa: BLE001
        res = {"valid": False, "error_type": "checker_exception", "error_message": f"{type(e).__name__}: {e}"}
    finally:
        _forget_instances(name)
    return {"valid": bool(res.get("valid")), "error_type": None if res.get("valid") else res.get("error_type"),
            "error": None if res.get("valid") else str(res.get("error_message", ""))[:300],
            "decoded": decoded_all}


def multi_turn_episode(entry: BfclEntry, *, max_steps: int = MAX_STEPS, keep_thinking: bool = True
                       ) -> Generator[list[dict[str, Any]], str, list[list[str]]]:
    """A multi-turn conversation as a generator: yields the chat messages to answer, receives the
    model's text, returns ``model_result[turn][step]``.

    Mirrors bfcl's ``BaseHandler.inference_multi_turn_prompting`` with the OSS handler's message
    handling: the system prompt is prepended to turn 0, held-out functions are announced at their
    turn (miss_func), each decoded call is executed on bfcl's backend instances and its result added
    as a ``tool`` message, a turn ends when the output does not decode or is empty, and more than
    ``max_steps`` steps in a turn force-quit the entry. ``keep_thinking=False`` strips
    ``<think>...</think>`` from earlier assistant messages (the efficiency paper (arXiv:2606.00135) sec. 3.3).
    """
    B = bfcl()
    test = copy.deepcopy(entry.prompt)
    initial_config = test.get("initial_config", {})
    classes = test["involved_classes"]
    long_context = "long_context" in entry.category
    holdout = test.get("missed_function", {})
    name = f"reflrl_gen_{uuid.uuid4().hex[:12]}"
    B.execute([], initial_config, classes, name, entry.id, long_context=long_context, is_evaL_run=False)
    test["question"][0] = B.system_prompt(test["question"][0], test["function"], entry.id)
    messages: list[dict[str, Any]] = []
    result: list[list[str]] = []
    try:
        for turn_idx, turn_msgs in enumerate(test["question"]):
            if str(turn_idx) in holdout:
                turn_msgs = [{"role": "user", "content":
                              B.default_prompts.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(
                                  functions=holdout[str(turn_idx)])}]
            messages.extend(turn_msgs)
            responses: list[str] = []
            steps = 0
            force_quit = False
            while True:
                text = yield _history(messages, keep_thinking)
                responses.append(text)
                messages.append({"role": "assistant", "content": text})
                try:
                    decoded = decode_execute(text, classes)
                    if B.is_empty_execute_response(decoded):
                        break
                except Exception:  # noqa: BLE001  bfcl: failed decoding ends the turn
                    break
                results, _ = B.execute(decoded, initial_config, classes, name, entry.id,
                                       long_context=long_context, is_evaL_run=False)
                for res, call in zip(results, decoded):
                    messages.append({"role": "tool", "name": call, "content": res})
                steps += 1
                if steps > max_steps:
                    force_quit = True
                    break
            result.append(responses)
            if force_quit:
                break
    finally:
        _forget_instances(name)
    return result


_THINK = re.compile(r"<think>.*?</think>\s*", re.S)


def _history(messages: list[dict[str, Any]], keep_thinking: bool) -> list[dict[str, Any]]:
    msgs = copy.deepcopy(messages)
    if not keep_thinking:
        for m in msgs[:-1] if msgs and msgs[-1]["role"] == "assistant" else msgs:
            if m["role"] == "assistant" and isinstance(m.get("content"), str):
                m["content"] = _THINK.sub("", m["content"])
    return msgs


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return repr(x)


# ------------------------------------------------------------------------------------ summary
def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize(acc: dict[str, float], counts: dict[str, int]) -> dict[str, Any]:
    """BFCL's summary groups over the categories present in ``acc`` (accuracy in [0, 1]).

    Returns ``{"non_live", "live", "irrelevance", "multi_turn", "overall"}`` (None when a group has
    no category) and ``"groups_used"``. See the module doc for the formulas and the one deviation.
    """
    simple = [acc[c] for c in ("simple_python", "simple_java", "simple_javascript") if c in acc]
    non_live_parts = ([_mean(simple)] if simple else []) + [acc[c] for c in ("multiple", "parallel", "parallel_multiple") if c in acc]
    live_c = [c for c in LIVE_AST if c in acc]
    live = (sum(acc[c] * counts[c] for c in live_c) / sum(counts[c] for c in live_c)) if live_c and sum(counts[c] for c in live_c) else None
    irr = _mean([acc[c] for c in ("irrelevance", "live_irrelevance") if c in acc])
    mt = _mean([acc[c] for c in MULTI_TURN if c in acc])
    groups = {"non_live": _mean(non_live_parts), "live": live, "irrelevance": irr, "multi_turn": mt}
    weights = {"non_live": 10, "live": 10, "irrelevance": 10, "multi_turn": 30}
    used = [g for g, v in groups.items() if v is not None]
    overall = (sum(groups[g] * weights[g] for g in used) / sum(weights[g] for g in used)) if used else None
    return {**groups, "overall": overall, "groups_used": used}


# ------------------------------------------------------------------------------- gold outputs
def _first_option(options: Any, required: bool = True) -> tuple[bool, Any]:
    """(present, value) from a possible-answer list: absent when the parameter is optional ("" among
    the options) and not required by the function doc, else the first option that is not ""."""
    if "" in options and not required:
        return False, None
    for o in options:
        if o != "":
            return True, _pick(o)
    return False, None


def _pick(v: Any) -> Any:
    if isinstance(v, dict):
        out = {}
        for k, opts in v.items():
            if isinstance(opts, list):
                present, val = _first_option(opts, required=False)
                if present:
                    out[k] = val
            else:
                out[k] = opts
        return out
    if isinstance(v, list):
        return [_pick(x) for x in v]
    return v


def gold_output(ground_truth: list[dict[str, dict[str, list]]], functions: list[dict[str, Any]] | None = None) -> str:
    """A model output that states the gold answer: ``[f(a=1, b='x'), g(...)]`` with, for each
    parameter, the first acceptable value; optional parameters ("" among the options) are left out
    unless ``functions`` (the entry's docs) mark them required. Used by the harness self-check
    (scripts/bench_eval.py) and the tests."""
    req: dict[str, set[str]] = {}
    for f in functions or []:
        req[f["name"]] = set(f.get("parameters", {}).get("required", []))
    calls = []
    for call in ground_truth:
        for fname, params in call.items():
            args = []
            for p, options in params.items():
                present, val = _first_option(options, required=p in req.get(fname, ()))
                if present:
                    args.append(f"{p}={val!r}")
            calls.append(f"{fname}({', '.join(args)})")
    return "[" + ", ".join(calls) + "]"
