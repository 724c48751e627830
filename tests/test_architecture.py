"""The layer rules, checked on the source: no import cycle of more than 2 modules, few private reach-ins."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "tierstore"
MAX_REACH_INS = 15  # issue "step engine": at most 15 across tierstore/ (133 before the rework)


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = (p, ast.parse(p.read_text()))
    return out


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    skip: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            skip.update(id(m) for m in ast.walk(n))
    return skip


def _targets(mod: str, is_pkg: bool, node: ast.AST) -> list[str]:
    """Modules an import statement names: `from x import y` counts x and x.y (if a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        src = ".".join(base + ([node.module] if node.module else []))
    else:
        src = node.module or ""
    return [src] + [f"{src}.{a.name}" for a in node.names]


def import_graph() -> dict[str, set[str]]:
    """Module -> the tierstore modules it imports anywhere (functions included, TYPE_CHECKING not)."""
    mods = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, (path, tree) in mods.items():
        skip = _type_checking_nodes(tree)
        for n in ast.walk(tree):
            if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip:
                is_pkg = path.name == "__init__.py"
                graph[mod].update(t for t in _targets(mod, is_pkg, n) if t in mods and t != mod)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in list(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    out.append(comp)
    return out


def reach_ins() -> list[str]:
    """`x._name` where x is not self/cls and the name is not a dunder, across tierstore/."""
    found = []
    for _mod, (path, tree) in _modules().items():
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.endswith("__"):
                if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                    continue
                found.append(f"{path.relative_to(PKG.parent)}:{n.lineno} {ast.unparse(n)}")
    return found


def test_no_import_cycle_of_more_than_two_modules():
    big = [sorted(c) for c in strongly_connected(import_graph()) if len(c) > 2]
    assert not big, f"import cycles of more than 2 modules: {big}"


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert sorted(len(c) for c in strongly_connected(graph)) == [1, 3]


def test_few_reach_ins_into_other_objects_private_names():
    found = reach_ins()
    assert len(found) <= MAX_REACH_INS, "\n".join(found)


def test_lower_layers_never_import_the_store_or_the_modules():
    upper = {"tierstore.store", "tierstore.module", "tierstore.sequence", "tierstore.distributed",
             "tierstore.prefetch", "tierstore.persistence", "tierstore.export", "tierstore.offline"}
    graph = import_graph()
    for mod, deps in graph.items():
        if mod.startswith(("tierstore.backends", "tierstore.policies", "tierstore.engine")) or mod in (
                "tierstore.config", "tierstore.sizes", "tierstore.index", "tierstore.fused"):
            bad = sorted(d for d in deps if any(d == u or d.startswith(u + ".") for u in upper))
            assert not bad, f"{mod} imports upper layers {bad}"
