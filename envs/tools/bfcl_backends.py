"""bfcl-eval's stateful multi-turn backends as ToolSpecs, and its multi-turn tasks.

BFCL v4's multi-turn categories run model calls against eight Python classes shipped by
``bfcl-eval`` (file system, messaging, Twitter-like posting, ticketing, trading, travel booking,
vehicle control, math). bfcl's own executor (``multi_turn_utils.execute_multi_turn_func_call``)
prefixes method names with an instance name and ``eval``s the call string. We do NOT: a parsed
call (name + keyword arguments) is dispatched to a WHITELISTED public method of the episode's
instance (the names in bfcl's function docs), with ``getattr`` and keyword arguments only.

Semantics copied from bfcl's executor:
- one instance per class per episode, created on first use; stateful classes (all but
  ``MathAPI``) get ``_load_scenario(deepcopy(initial_config.get(cls, {})), long_context=...)``;
- ``long_context`` is on for the ``multi_turn_long_context`` (and composite) categories; our
  loader stores it as ``initial_config["long_context"] = True`` so it travels with the episode;
- a method's return value is the observation (bfcl's ``{"error": ...}`` answers stay results,
  exactly as bfcl shows them to the model); an exception raised by a method becomes a
  ``ToolError`` (bfcl shows ``"Error during execution: ..."``).

Where the instances live: ``ctx.state["bfcl_session"]`` (a :class:`BfclSession`), built from
``ctx.state["initial_config"]`` (the tool server puts the episode's ``initial_config`` there).

bfcl modules are imported lazily, and only the eight class modules, which need the standard
library (``MathAPI`` also needs ``mpmath``, present with torch's sympy).
"""
from __future__ import annotations

import ast
import copy
import functools
import importlib
import importlib.util
import inspect
import json
import threading
from pathlib import Path
from typing import Any

from ..types import Task, ToolCall
from .base import ToolContext, ToolError, ToolSpec

_PREFIX = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"

#: class name -> (module under func_source_code, function-doc file under data/multi_turn_func_doc)
BFCL_CLASSES: dict[str, tuple[str, str]] = {
    "GorillaFileSystem": ("gorilla_file_system", "gorilla_file_system.json"),
    "MathAPI": ("math_api", "math_api.json"),
    "MessageAPI": ("message_api", "message_api.json"),
    "TwitterAPI": ("posting_api", "posting_api.json"),
    "TicketAPI": ("ticket_api", "ticket_api.json"),
    "TradingBot": ("trading_bot", "trading_bot.json"),
    "TravelAPI": ("travel_booking", "travel_booking.json"),
    "VehicleControlAPI": ("vehicle_control", "vehicle_control.json"),
}
STATELESS_CLASSES = frozenset({"MathAPI"})
MULTI_TURN_CATEGORIES = (
    "multi_turn_base", "multi_turn_long_context", "multi_turn_miss_func", "multi_turn_miss_param",
)
LONG_CONTEXT_KEY = "long_context"

_lock = threading.Lock()


MISSING = ("bfcl-eval is not installed (the built-in tools run BFCL's backends): pip install --no-deps "
           "bfcl-eval==2026.3.23 (make install does it)")


class BfclMissing(ImportError):
    """bfcl-eval is not installed; the message says what to install (reported in one line, exit status 2)."""


def _bfcl_root() -> Path:
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise BfclMissing(MISSING)
    return Path(list(spec.submodule_search_locations)[0])


def _check_class(name: str) -> None:
    if name not in BFCL_CLASSES:
        raise ValueError(f"unknown bfcl class {name!r}; known: {', '.join(BFCL_CLASSES)}")


@functools.lru_cache(maxsize=None)
def _class(name: str) -> type:
    """Import one backend class (its module only; never bfcl's heavy packages)."""
    _check_class(name)
    if importlib.util.find_spec("bfcl_eval") is None:
        raise BfclMissing(MISSING)
    module = importlib.import_module(f"{_PREFIX}.{BFCL_CLASSES[name][0]}")
    return getattr(module, name)


# ---------------------------------------------------------------------------------------------
# Schemas
# ---------------------------------------------------------------------------------------------

_TYPE_MAP = {"dict": "object", "float": "number", "tuple": "array", "list": "array",
             "int": "integer", "str": "string", "bool": "boolean"}


def to_json_schema(schema: Any) -> Any:
    """bfcl's function-doc types (``dict``, ``float``, ``tuple``, ``any``) to JSON Schema."""
    if isinstance(schema, list):
        return [to_json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "type" and isinstance(v, str):
            if v == "any":
                continue
            out[k] = _TYPE_MAP.get(v, v)
        elif k in ("properties",) and isinstance(v, dict):
            out[k] = {p: to_json_schema(s) for p, s in v.items()}
        elif k in ("items", "additionalProperties", "anyOf", "oneOf"):
            out[k] = to_json_schema(v)
        else:
            out[k] = v
    return out


@functools.lru_cache(maxsize=None)
def _func_docs(class_name: str) -> tuple[dict[str, Any], ...]:
    """bfcl's function docs of one class, as loaded (one JSON object per line)."""
    _check_class(class_name)
    path = _bfcl_root() / "data" / "multi_turn_func_doc" / BFCL_CLASSES[class_name][1]
    docs = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                docs.append(json.loads(line))
    return tuple(docs)


def class_schemas(class_name: str) -> list[dict[str, Any]]:
    """The OpenAI/BFCL style schemas (JSON-Schema types) of one class's whitelisted methods."""
    return [{"name": d["name"], "description": d["description"],
             "parameters": to_json_schema(d["parameters"])} for d in _func_docs(class_name)]


@functools.lru_cache(maxsize=None)
def whitelist(class_name: str) -> frozenset[str]:
    """Method names callable on a class: named in bfcl's docs AND public methods of the class."""
    cls = _class(class_name)
    names = set()
    for d in _func_docs(class_name):
        n = d["name"]
        if not n.startswith("_") and inspect.isfunction(getattr(cls, n, None)):
            names.add(n)
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def method_owner() -> dict[str, str]:
    """Method name -> class name over all eight classes (bfcl's method names are unique)."""
    out: dict[str, str] = {}
    for cls in BFCL_CLASSES:
        for d in _func_docs(cls):
            if d["name"] in out:
                raise RuntimeError(f"bfcl method {d['name']!r} is in {out[d['name']]} and {cls}")
            out[d["name"]] = cls
    return out


# ---------------------------------------------------------------------------------------------
# Per-episode session and dispatch
# ---------------------------------------------------------------------------------------------

def _jsonable(x: Any) -> Any:
    """A JSON-safe copy of a backend's return value (unknown objects become str, as bfcl does)."""
    if x is None or isinstance(x, (str, int, float, bool)):
        return x
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "__float__"):  # mpmath.mpf, Decimal: numbers stay numbers
        try:
            return float(x)
        except (TypeError, ValueError):
            pass
    return str(x)


class BfclSession:
    """The bfcl backend instances of one episode, created lazily per class.

    ``initial_config`` is BFCL's per-class scenario dict (``{"GorillaFileSystem": {...}, ...}``);
    a top-level ``"long_context": true`` turns on bfcl's long-context scenario extension.
    """

    def __init__(self, initial_config: dict[str, Any] | None = None,
                 long_context: bool | None = None):
        self.initial_config = dict(initial_config or {})
        if long_context is None:
            long_context = bool(self.initial_config.get(LONG_CONTEXT_KEY, False))
        self.long_context = bool(long_context)
        self.instances: dict[str, Any] = {}

    def instance(self, class_name: str) -> Any:
        """This episode's instance of a class (created with ``_load_scenario`` on first use)."""
        inst = self.instances.get(class_name)
        if inst is None:
            inst = _class(class_name)()
            if class_name not in STATELESS_CLASSES:
                cfg = self.initial_config.get(class_name, {})
                inst._load_scenario(copy.deepcopy(cfg), long_context=self.long_context)
            self.instances[class_name] = inst
        return inst

    def call(self, name: str, arguments: dict[str, Any]) -> Any:
        """Run one call on the owning class's instance; returns the JSON-safe result.

        Raises ToolError for an unknown or non-whitelisted name, non-dict arguments, and any
        exception the backend raises (bad argument names or values).
        """
        cls = method_owner().get(name)
        if cls is None or name not in whitelist(cls):
            raise ToolError(f"unknown bfcl function {name!r}", kind="unknown_tool")
        if not isinstance(arguments, dict):
            raise ToolError("arguments must be an object", kind="invalid_arguments")
        method = getattr(self.instance(cls), name)
        try:
            result = method(**arguments)
        except TypeError as e:  # wrong or missing argument names
            raise ToolError(f"Error during execution: {e}", kind="invalid_arguments") from None
        except Exception as e:  # noqa: BLE001 - third-party backend failing on caller's values
            raise ToolError(f"Error during execution: {type(e).__name__}: {e}",
                            kind="execution_error") from None
        return _jsonable(result)

    def ensure(self, classes: list[str]) -> None:
        """Create the instances of these classes now (bfcl creates all involved classes)."""
        for c in classes:
            self.instance(c)

    def same_state(self, other: "BfclSession") -> bool:
        """bfcl's state check between two sessions; a class created in only one of them is
        created in the other first (a fresh instance is exactly its loaded scenario)."""
        both = sorted(set(self.instances) | set(other.instances))
        self.ensure(both)
        other.ensure(both)
        return states_equal(self.instances, other.instances)

    def state(self) -> dict[str, dict[str, Any]]:
        """Public attributes of every created instance (what bfcl's state checker compares)."""
        return {c: {k: v for k, v in vars(i).items() if not k.startswith("_")}
                for c, i in self.instances.items()}


def states_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """bfcl's state check: same classes, and equal public attributes for each instance.

    ``a`` and ``b`` map class name -> instance (e.g. ``BfclSession.instances``).
    """
    if set(a) != set(b):
        return False
    for cls, ia in a.items():
        ib = b[cls]
        va = {k: v for k, v in vars(ia).items() if not k.startswith("_")}
        vb = {k: v for k, v in vars(ib).items() if not k.startswith("_")}
        if va != vb:
            return False
    return True


def session_for(ctx: ToolContext) -> BfclSession:
    """The episode's BfclSession, created from ``ctx.state["initial_config"]`` on first use."""
    sess = ctx.state.get("bfcl_session")
    if sess is None:
        with _lock:
            sess = ctx.state.get("bfcl_session")
            if sess is None:
                sess = BfclSession(ctx.state.get("initial_config"))
                ctx.state["bfcl_session"] = sess
    return sess


def _make_handler(name: str):
    def handler(arguments: dict[str, Any], ctx: ToolContext) -> Any:
        return session_for(ctx).call(name, arguments)
    handler.__name__ = f"bfcl_{name}"
    handler.__qualname__ = handler.__name__
    return handler


def bfcl_tools(classes: list[str] | None = None) -> dict[str, ToolSpec]:
    """ToolSpecs for the whitelisted methods of the given bfcl classes (default: all eight).

    Tool names are bfcl's bare method names (as in BFCL's prompts and gold); the domain is
    ``"bfcl:<Class>"``. ``returns`` is None: bfcl's "response" docs do not match what the
    methods return (``echo`` returns None, ``send_message`` more fields), so a server that
    validates results must not use them.
    """
    out: dict[str, ToolSpec] = {}
    for cls in classes or list(BFCL_CLASSES):
        allowed = whitelist(cls)
        for d in _func_docs(cls):
            if d["name"] not in allowed:
                continue
            out[d["name"]] = ToolSpec(
                name=d["name"], domain=f"bfcl:{cls}", description=d["description"],
                parameters=to_json_schema(d["parameters"]), handler=_make_handler(d["name"]),
                returns=None)  # bfcl's "response" docs are descriptive, not what is returned

    return out


# ---------------------------------------------------------------------------------------------
# Parsing bfcl's python-call strings (ast only, never eval)
# ---------------------------------------------------------------------------------------------

def _literal(node: ast.AST) -> Any:
    value = ast.literal_eval(node)
    return _tuples_to_lists(value)


def _tuples_to_lists(v: Any) -> Any:
    if isinstance(v, (tuple, list)):
        return [_tuples_to_lists(x) for x in v]
    if isinstance(v, dict):
        return {k: _tuples_to_lists(x) for k, x in v.items()}
    return v


def _call_name(func: ast.AST) -> str:
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        raise ValueError("call target is not a name")
    parts.append(func.id)
    return ".".join(reversed(parts))


def parse_python_calls(text: str, positional: dict[str, list[str]] | None = None
                       ) -> list[ToolCall]:
    """Parse ``f(a=1)``, ``[f(a=1), g(b='x')]`` or a bare list of such calls with ``ast``.

    Argument values must be Python literals (``ast.literal_eval``; tuples become lists).
    Positional arguments are mapped to names through ``positional[name]`` (parameter order);
    without it they are an error. Raises ValueError naming what was wrong.
    """
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not a python call list: {e.msg}") from None
    body = tree.body
    nodes = body.elts if isinstance(body, (ast.List, ast.Tuple)) else [body]
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call):
            raise ValueError(f"expected a function call, got {type(node).__name__}")
        name = _call_name(node.func)
        args: dict[str, Any] = {}
        if node.args:
            order = (positional or {}).get(name)
            if order is None or len(node.args) > len(order):
                raise ValueError(f"{name}: positional arguments are not supported")
            for pname, a in zip(order, node.args):
                args[pname] = _literal(a)
        for kw in node.keywords:
            if kw.arg is None:
                raise ValueError(f"{name}: **kwargs is not supported")
            if kw.arg in args:
                raise ValueError(f"{name}: argument {kw.arg!r} given twice")
            try:
                args[kw.arg] = _literal(kw.value)
            except ValueError:
                raise ValueError(f"{name}: value of {kw.arg!r} is not a literal") from None
        calls.append(ToolCall(name=name, arguments=args))
    return calls


@functools.lru_cache(maxsize=None)
def _positional_orders() -> dict[str, list[str]]:
    out = {}
    for name, cls in method_owner().items():
        fn = getattr(_class(cls), name, None)
        if fn is None:
            continue
        params = list(inspect.signature(fn).parameters)[1:]  # drop self
        out[name] = params
    return out


def parse_bfcl_calls(call_strings: list[str]) -> list[ToolCall]:
    """bfcl gold strings (``"cd(folder='x')"``, ``"sort('a.txt')"``) to keyword ToolCalls."""
    out = []
    for s in call_strings:
        out.extend(parse_python_calls(s, _positional_orders()))
    return out


# ---------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------

def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _turn_text(messages: list[dict[str, Any]]) -> str:
    return "\n".join(str(m.get("content", "")) for m in messages if m.get("role") == "user")


@functools.lru_cache(maxsize=None)
def _validator(class_name: str, name: str):
    import jsonschema

    for s in class_schemas(class_name):
        if s["name"] == name:
            return jsonschema.Draft202012Validator(s["parameters"])
    return None


def _gold_schema_errors(gold: list[list[ToolCall]], classes: list[str]) -> list[str]:
    """Gold calls that the JSON schema of their tool rejects (a validating server would too)."""
    owner = method_owner()
    out = []
    for ti, turn in enumerate(gold):
        for c in turn:
            v = _validator(owner.get(c.name, ""), c.name) if c.name in owner else None
            if v is None:
                out.append(f"turn {ti}: {c.name} is not a function of the involved classes")
                continue
            err = next(iter(v.iter_errors(c.arguments)), None)
            if err is not None:
                out.append(f"turn {ti}: {c.name}: {err.message}")
    return out


def load_bfcl_multi_turn(category: str = "multi_turn_base", limit: int | None = None
                         ) -> list[Task]:
    """BFCL v4 multi-turn entries of a category as Tasks (gold parsed with ast, never eval).

    query = the first turn's user message; turns = the later turns' user messages (an empty
    string for a turn without a message, e.g. the turn in ``miss_func`` where the held-out
    function comes back); gold = one list of keyword ToolCalls per turn; tools = the schemas of
    the involved classes (minus the held-out functions in ``miss_func``, listed per turn in
    ``meta["missed_function"]``); initial_config = bfcl's, plus ``"long_context": true`` for
    the long-context category.
    """
    if category not in MULTI_TURN_CATEGORIES:
        raise ValueError(f"unknown multi-turn category {category!r}; "
                         f"known: {', '.join(MULTI_TURN_CATEGORIES)}")
    data = _bfcl_root() / "data"
    entries = _read_jsonl(data / f"BFCL_v4_{category}.json")
    answers = {a["id"]: a["ground_truth"]
               for a in _read_jsonl(data / "possible_answer" / f"BFCL_v4_{category}.json")}
    long_context = "long_context" in category or "composite" in category
    tasks = []
    for e in entries:
        if limit is not None and len(tasks) >= limit:
            break
        classes = e["involved_classes"]
        for c in classes:
            _check_class(c)
        missed = {str(k): list(v) for k, v in (e.get("missed_function") or {}).items()}
        held_out = {n for names in missed.values() for n in names}
        tools = [s for c in classes for s in class_schemas(c) if s["name"] not in held_out]
        gold = [parse_bfcl_calls(turn) for turn in answers[e["id"]]]
        questions = e["question"]
        cfg = copy.deepcopy(e.get("initial_config") or {})
        if long_context:
            cfg[LONG_CONTEXT_KEY] = True
        meta: dict[str, Any] = {"source": f"bfcl:{category}", "involved_classes": classes,
                                "path": e.get("path", []),
                                "excluded_function": e.get("excluded_function", [])}
        bad = _gold_schema_errors(gold, classes)
        if bad:  # bfcl's own gold breaks its schema (e.g. close_ticket(ticket_id='ticket_001'))
            meta["gold_schema_errors"] = bad
        if missed:
            meta["missed_function"] = missed
            meta["missed_function_schemas"] = {
                t: [s for c in classes for s in class_schemas(c) if s["name"] in names]
                for t, names in missed.items()}
        tasks.append(Task(id=e["id"], query=_turn_text(questions[0]) if questions else "",
                          tools=tools, gold=gold, kind="multi_turn",
                          turns=[_turn_text(q) for q in questions[1:]], initial_config=cfg,
                          meta=meta))
    return tasks


#: the name the tool server looks up (``reflrl.envs.tool_server.default_tools``)
build_bfcl_tools = bfcl_tools
