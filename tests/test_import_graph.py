"""The import graph between pdserve's top-level packages has no cycle.

Read statically with `ast`, so every import counts: module level, inside functions (a lazy import that exists to
dodge a cycle is still an edge) and under `if TYPE_CHECKING:`. A node is what sits directly under `pdserve/`: a
package (`engine`, `services`, `planner`, `sim`, `bench`, `kv_transfer`, ...) or a top-level module (`cli`,
`cli_args`, ...). Generated code (`_proto`) imports only itself and protobuf.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pdserve"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(tree: ast.AST, module: str, is_pkg: bool) -> set[str]:
    """Every pdserve module (or package) named by an import anywhere in `tree`."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")
                if not is_pkg:
                    base = base[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            # `from pdserve import cli` / `from pdserve.services import up`: the names may be modules
            out.update(f"{target}.{a.name}" for a in node.names if a.name != "*")
    return {m for m in out if m == "pdserve" or m.startswith("pdserve.")}


def _top(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def package_graph() -> dict[str, dict[str, list[str]]]:
    """{top-level node: {imported top-level node: [the importing modules]}}, self edges left out."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        src = _top(module)
        if src is None or src == "_proto":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for target in _imported(tree, module, path.name == "__init__.py"):
            dst = _top(target)
            if dst is None or dst == src:
                continue
            # `from pdserve.x import y` adds the candidate `pdserve.x.y`; a name that is no module changes nothing
            # here, since only the top-level node counts
            graph[src][dst].append(module)
        graph.setdefault(src, defaultdict(list))
    return graph


def find_cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, three colours)."""
    colour: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        colour[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, {})):
            if colour.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if colour.get(m) is None and (found := visit(m)):
                return found
        stack.pop()
        colour[n] = 2
        return None

    for n in sorted(graph):
        if colour.get(n) is None and (found := visit(n)):
            return found
    return None


def test_no_cycle_between_top_level_packages():
    graph = package_graph()
    cycle = find_cycle(graph)
    if cycle:
        hops = [f"  {a} -> {b}: " + ", ".join(sorted(set(graph[a][b]))) for a, b in zip(cycle, cycle[1:])]
        msg = "import cycle between top-level packages: " + " -> ".join(cycle) + "\n" + "\n".join(hops)
        print(msg)
        raise AssertionError(msg)


def test_the_detector_sees_a_lazy_import_cycle():
    """A cycle closed by an import inside a function is found (the check reads every import, not just the
    module-level ones)."""
    a = ast.parse("import pdserve.b.x\n")
    b = ast.parse("def f():\n    from pdserve.a import y\n")
    graph = {"a": {}, "b": {}}
    for name, tree in (("a", a), ("b", b)):
        for t in _imported(tree, f"pdserve.{name}.m", False):
            if _top(t) != name:
                graph[name][_top(t)] = [f"pdserve.{name}.m"]
    assert find_cycle(graph) == ["a", "b", "a"]
