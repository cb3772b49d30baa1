"""The import rules of the layout (docs/architecture.md), checked on the source:

* ``envs/``, ``faults/`` and ``critic/`` never import the core (faults imports nothing of ours; envs
  only faults; critic only envs and faults);
* ``reflrl/algos/`` never imports training, rollout, recovery, engine or CLI modules;
* no import cycle anywhere: data flows one way (envs -> rollout -> recovery -> algos -> update), and
  nothing imports the module that calls it.

Every import statement counts, lazy ones inside functions too (only ``if TYPE_CHECKING:`` blocks are
skipped), and importing a package counts as importing its ``__init__``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"reflrl": ROOT / "reflrl", "reflrl.envs": ROOT / "envs", "reflrl.faults": ROOT / "faults",
                "reflrl.critic": ROOT / "critic"}
LEAVES = {"reflrl.faults": ("reflrl.faults",),
          "reflrl.envs": ("reflrl.envs", "reflrl.faults"),
          "reflrl.critic": ("reflrl.critic", "reflrl.envs", "reflrl.faults")}
ALGOS_MUST_NOT = ("reflrl.train", "reflrl.rollout", "reflrl.recovery", "reflrl.engines", "reflrl.cli",
                  "reflrl.experiment", "reflrl.eval", "reflrl.heldout", "reflrl.models", "reflrl.verl_backend")


def modules() -> dict[str, Path]:
    """Module name -> file, for every module of the four source folders."""
    out: dict[str, Path] = {}
    for base, folder in PACKAGE_DIRS.items():
        for f in folder.rglob("*.py"):
            rel = f.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if base == "reflrl" and parts and parts[0] in ("envs", "faults", "critic", "configs"):
                continue  # not a real folder of reflrl/
            out[".".join([base, *parts]) if parts else base] = f
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours ``name`` imports (resolved; a package means its __init__)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    here = name if is_pkg else name.rsplit(".", 1)[0]
    out: set[str] = set()
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            skip.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                targets.append(f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod)
        for t in targets:
            while t and t not in known:
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(m, p, set(mods)) for m, p in mods.items()}


def within(mod: str, prefixes: tuple[str, ...]) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    import sys

    sys.setrecursionlimit(10000)
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def violations(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(g.items()):
        for leaf, allowed in LEAVES.items():
            if within(mod, (leaf,)):
                bad += [f"{mod} imports {d} (the {leaf} folder may import only {', '.join(allowed)})"
                        for d in sorted(deps) if not within(d, allowed)]
        if within(mod, ("reflrl.algos",)):
            bad += [f"{mod} imports {d} (algorithms never import training, rollout, engine or CLI modules)"
                    for d in sorted(deps) if within(d, ALGOS_MUST_NOT)]
    bad += [f"import cycle: {' <-> '.join(c)}" for c in cycles(g)]
    return bad


def test_the_import_rules_hold():
    g = graph()
    assert len(g) > 60 and "reflrl.train.loop" in g and "reflrl.envs.tool_env" in g
    assert violations(g) == []


@pytest.mark.parametrize("module,edge,expect", [
    ("reflrl.envs.rewards", "reflrl.train.loop", "the reflrl.envs folder may import only"),
    ("reflrl.algos.filters", "reflrl.rollout", "algorithms never import"),
    ("reflrl.rollout", "reflrl.train.step", "import cycle"),
])
def test_a_deliberate_back_edge_is_caught(module, edge, expect):
    """The checker is not vacuous: adding one forbidden import makes it fail, naming the edge."""
    g = graph()
    g[module] = set(g[module]) | {edge}
    found = violations(g)
    assert any(expect in v and module in v for v in found), found
