"""BFCL's Python-call decoder, run without evaluating model output.

bfcl-eval decodes a prompting model's answer ``[f(a=1), g(b='x')]`` with
``model_handler/utils.py``: ``default_decode_ast_prompting`` (strip, add brackets) -> ``ast_parse``
(``ast.parse``; one call or a list of calls) -> ``resolve_ast_call`` / ``resolve_ast_by_type``
(keyword arguments only; positional arguments are ignored). One branch of ``resolve_ast_by_type``
runs model text: a ``BinOp`` value becomes ``eval`` of ``ast.unparse(value)``, evaluated in the globals of
bfcl's ``utils`` module. (Its ``Lambda`` branch reads ``value.body[0]``, which raises TypeError before
its ``eval``: a lambda's body is one node, not a list, so bfcl never runs a lambda.)

:func:`decode_python` gives bfcl's result without that ``eval``. It walks the values bfcl's resolver
would reach (keyword values, and inside them list/tuple elements, dict keys and values, keyword
values of nested calls), replaces each ``BinOp`` there by an ``ast.Constant`` holding the value
``eval`` would give, then hands the calls to bfcl's own ``resolve_ast_call``. Folding:

* operands: literals (numbers, strings, bytes, booleans, None), list/tuple/set/dict displays of
  literals, unary ``- + ~ not`` and nested binary operations over them;
* operators: every binary operator Python defines on those values (``+ - * / // % **`` on numbers,
  ``+`` and ``*`` on strings, bytes, lists and tuples, the bitwise and set operators, ...), applied
  with Python's own semantics, so an error (``1/0``, ``'a' + 1``, ``2.0**5000``) is raised as bfcl's
  ``eval`` would raise it (a decode failure);
* bounds: a result may not hold more than :data:`MAX_ITEMS` characters/elements (counted through
  nested containers) or an integer of more than :data:`MAX_INT_BITS` bits (about Python's 4300-digit
  limit for printing an int), and one output may not make folding build more than
  :data:`MAX_WORK` items in all; ``%`` on a string or bytes (printf formatting, whose field widths can
  ask for gigabytes) is not folded.

Whatever is not folded -- a name, call, attribute, comprehension or f-string inside the operation,
or a result over the bounds -- is *unevaluated*: bfcl would run it and its result (a value or an
exception) cannot be known without running it. If the rest of the decoding fails anyway, bfcl's
verdict is the same whatever that result is, and the failure is raised here too; otherwise
:class:`Unevaluated` is raised, listing the expressions, and the caller scores the output wrong (as
a call: never as "no call", which would earn credit in the irrelevance categories).
"""
from __future__ import annotations

import ast
import operator
from typing import Any, Callable

from reflrl.envs.parsing import parse_expression

#: the largest number of characters / elements a folded value may hold (nested containers counted)
MAX_ITEMS = 100_000
#: the largest integer a folded value may be (bits); Python 3.11 refuses to print ints over 4300 digits
MAX_INT_BITS = 14_000
#: items one output may make folding build in all (bounds the time spent on one output)
MAX_WORK = 1_000_000

_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitOr: operator.or_,
    ast.BitXor: operator.xor, ast.BitAnd: operator.and_, ast.MatMult: operator.matmul,
}
_UNARY: dict[type, Callable[[Any], Any]] = {
    ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert, ast.Not: operator.not_,
}
_SEQ = (str, bytes, list, tuple)


class Unevaluated(ValueError):
    """The output holds expressions bfcl would evaluate as code; ``expressions`` lists them."""

    def __init__(self, expressions: list[str]):
        self.expressions = expressions
        shown = "; ".join(e[:80] for e in expressions[:3])
        super().__init__(f"{len(expressions)} expression(s) bfcl would evaluate as code, not run here: {shown}")


class _NotFolded(Exception):
    """An operand or result this module does not compute (see the module doc)."""


class _Unknown:
    """Stands, in the decoded output, for the value of an unevaluated expression."""

    __slots__ = ("source",)

    def __init__(self, source: str):
        self.source = source

    def __repr__(self) -> str:
        return f"<unevaluated: {self.source[:60]}>"


def size(v: Any) -> int:
    """Characters / elements a value holds, counted through nested containers."""
    if isinstance(v, (str, bytes)):
        return len(v)
    if isinstance(v, dict):
        return len(v) + sum(size(k) + size(x) for k, x in v.items())
    if isinstance(v, (list, tuple, set, frozenset)):
        return len(v) + sum(size(x) for x in v)
    return 1


class _Folder:
    def __init__(self) -> None:
        self.work = 0

    def _charge(self, n: int) -> None:
        self.work += n
        if self.work > MAX_WORK:
            raise _NotFolded(f"folding would build more than {MAX_WORK} items")

    def value(self, node: ast.AST) -> Any:
        """The value of a literal expression; _NotFolded for anything else."""
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            if any(isinstance(e, ast.Starred) for e in node.elts):
                raise _NotFolded("starred element")
            items = [self.value(e) for e in node.elts]
            self._charge(len(items))
            return items if isinstance(node, ast.List) else tuple(items) if isinstance(node, ast.Tuple) else set(items)
        if isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):
                raise _NotFolded("dict unpacking")
            keys = [self.value(k) for k in node.keys]
            vals = [self.value(v) for v in node.values]
            self._charge(len(keys))
            return dict(zip(keys, vals))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self.value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            # Python evaluates both operands before the operator: an error in either is raised even
            # when the other is not folded; otherwise an unfolded operand leaves the result unknown.
            left = right = None
            unknown: _NotFolded | None = None
            try:
                left = self.value(node.left)
            except _NotFolded as e:
                unknown = e
            try:
                right = self.value(node.right)
            except _NotFolded as e:
                unknown = unknown or e
            if unknown is not None:
                raise unknown
            return self.apply(node.op, left, right)
        raise _NotFolded(f"{type(node).__name__} is not a literal")

    def apply(self, op: ast.operator, a: Any, b: Any) -> Any:
        """``a op b`` with Python's semantics, refusing results over the bounds before computing them."""
        ints = isinstance(a, int) and isinstance(b, int)
        if isinstance(op, ast.Mod) and isinstance(a, (str, bytes)):
            raise _NotFolded("printf-style formatting is not folded")
        if isinstance(op, ast.Pow) and ints and b > 0 and abs(a) > 1:
            if (abs(a).bit_length() - 1) * b > MAX_INT_BITS:
                raise _NotFolded(f"{a!r} ** {b!r} has more than {MAX_INT_BITS} bits")
        if isinstance(op, ast.LShift) and ints and b > 0 and a.bit_length() + b > MAX_INT_BITS:
            raise _NotFolded(f"{a!r} << {b!r} has more than {MAX_INT_BITS} bits")
        if isinstance(op, ast.Mult):
            seq, n = (a, b) if isinstance(a, _SEQ) and isinstance(b, int) else \
                (b, a) if isinstance(b, _SEQ) and isinstance(a, int) else (None, None)
            if seq is not None and n > 0:
                if size(seq) * n > MAX_ITEMS:
                    raise _NotFolded(f"a sequence repeated {n} times holds more than {MAX_ITEMS} items")
                self._charge(size(seq) * n)
        if isinstance(op, ast.Add) and isinstance(a, _SEQ) and type(a) is type(b):
            if size(a) + size(b) > MAX_ITEMS:
                raise _NotFolded(f"a concatenation holds more than {MAX_ITEMS} items")
            self._charge(len(a) + len(b))
        out = _BINOPS[type(op)](a, b)
        if isinstance(out, int) and out.bit_length() > MAX_INT_BITS:
            raise _NotFolded(f"an integer of more than {MAX_INT_BITS} bits")
        if isinstance(out, (set, frozenset, dict)):
            self._charge(len(out))
            if size(out) > MAX_ITEMS:
                raise _NotFolded(f"a result holding more than {MAX_ITEMS} items")
        return out


class _Prepass:
    """Fold the BinOps bfcl's resolver would ``eval``, visiting exactly the nodes it visits."""

    def __init__(self) -> None:
        self.folder = _Folder()
        self.unknown: list[str] = []

    def call(self, node: ast.Call) -> None:  # resolve_ast_call: keyword values only
        for kw in node.keywords:
            kw.value = self.value(kw.value)

    def value(self, node: ast.AST) -> ast.AST:  # resolve_ast_by_type
        if isinstance(node, ast.BinOp):
            try:
                return ast.Constant(value=self.folder.value(node))
            except _NotFolded:
                src = ast.unparse(node)
                self.unknown.append(src)
                return ast.Constant(value=_Unknown(src))
        if isinstance(node, (ast.List, ast.Tuple)):
            node.elts = [self.value(e) for e in node.elts]
        elif isinstance(node, ast.Dict):
            node.keys = [None if k is None else self.value(k) for k in node.keys]
            node.values = [self.value(v) for v in node.values]
        elif isinstance(node, ast.Call) and node.keywords:
            self.call(node)
        elif isinstance(node, ast.Lambda):
            # bfcl evaluates ast.unparse(value.body[0].value) -- the subscript raises before the eval
            raise TypeError(f"'{type(node.body).__name__}' object is not subscriptable")
        return node


def _prompting_text(result: str) -> str:
    """``default_decode_ast_prompting``'s clean-up, then ``ast_parse``'s (python return format)."""
    result = result.strip("`\n ")
    if not result.startswith("["):
        result = "[" + result
    if not result.endswith("]"):
        result = result + "]"
    return result.strip().strip("'")


def decode_python(result: str, resolve_ast_call: Callable[[ast.Call], dict]) -> list[dict[str, Any]]:
    """bfcl's ``default_decode_ast_prompting(result, ReturnFormat.PYTHON, False)``, evaluating nothing.

    ``resolve_ast_call`` is bfcl's. Raises what bfcl raises for an output it cannot decode, and
    :class:`Unevaluated` for an output whose decoding would depend on running an expression.
    """
    parsed = parse_expression(_prompting_text(result))
    pre = _Prepass()
    extracted = []
    if isinstance(parsed.body, ast.Call):
        pre.call(parsed.body)
        extracted.append(resolve_ast_call(parsed.body))
    else:
        for elem in parsed.body.elts:
            assert isinstance(elem, ast.Call)
            pre.call(elem)
            extracted.append(resolve_ast_call(elem))
    if pre.unknown:
        raise Unevaluated(pre.unknown)
    return extracted


def decode_python_calls(result: str, resolve_ast_call: Callable[[ast.Call], dict]
                        ) -> list[tuple[dict[str, Any], list[str]]]:
    """Like :func:`decode_python`, but returns each call with the expressions it leaves unevaluated
    (the multi-turn driver blocks just those calls) instead of raising :class:`Unevaluated`."""
    try:
        return [(c, []) for c in decode_python(result, resolve_ast_call)]
    except Unevaluated:
        pass
    parsed = parse_expression(_prompting_text(result))
    elems = [parsed.body] if isinstance(parsed.body, ast.Call) else parsed.body.elts
    out = []
    for elem in elems:
        pre = _Prepass()
        pre.call(elem)
        out.append((resolve_ast_call(elem), pre.unknown))
    return out
