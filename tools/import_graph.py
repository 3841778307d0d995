"""The import graph of rftstream and its plugin packages, read from the source with ``ast``.

``python tools/import_graph.py [ROOT]`` (``just imports``) prints the core → plugin
edges (``rftstream`` importing ``operators``, ``algorithms`` or ``workflows``), the
number of imports made inside functions, the import cycles between modules, and the
cycles between packages (a package: ``rftstream.<name>``, a subpackage or a loose module
of the core, or a plugin package; ``bus`` importing ``config`` and a module of ``config``
importing one of ``bus`` is a package cycle even where no two modules form one). Every
import counts: module level, inside functions and under ``if TYPE_CHECKING:`` (a
type-only import that closes a circle with a runtime one is still a circle). Exits 1 when
there is a core → plugin edge or a cycle of either kind, else 0. Imports nothing it reads;
pure file reading.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

CORE = "rftstream"
PLUGIN_PACKAGES = ("operators", "algorithms", "workflows")
PACKAGES = (CORE, *PLUGIN_PACKAGES)


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target``; ``where`` is ``module``, ``function`` or ``type_checking``."""

    source: str
    target: str
    where: str


@dataclass
class ImportGraph:
    """Modules of :data:`PACKAGES` under a root directory and the imports between them."""

    modules: dict[str, Path]
    edges: set[Edge] = field(default_factory=set)

    def targets(self, source: str) -> set[str]:
        return {e.target for e in self.edges if e.source == source}

    def core_to_plugin(self) -> list[Edge]:
        """Edges from ``rftstream`` into a plugin package, sorted."""
        return sorted(
            (e for e in self.edges if _top(e.source) == CORE and _top(e.target) in PLUGIN_PACKAGES),
            key=lambda e: (e.source, e.target, e.where),
        )

    def function_level(self) -> list[Edge]:
        """Imports made inside a function body (deduplicated per module pair), sorted."""
        return sorted(
            (e for e in self.edges if e.where == "function"), key=lambda e: (e.source, e.target)
        )

    def cycles(self) -> list[list[str]]:
        """The strongly connected components of more than one module, each sorted."""
        graph = {m: self.targets(m) for m in self.modules}
        return sorted(sorted(c) for c in _strongly_connected(graph) if len(c) > 1)

    def package_cycles(self) -> list[list[str]]:
        """Packages (:func:`package_of`) that import each other in a loop, each sorted."""
        graph: dict[str, set[str]] = {package_of(m): set() for m in self.modules}
        for e in self.edges:
            source, target = package_of(e.source), package_of(e.target)
            if source != target:
                graph[source].add(target)
        return sorted(sorted(c) for c in _strongly_connected(graph) if len(c) > 1)

    def package_edges(self, a: str, b: str) -> list[Edge]:
        """The module imports from package ``a`` into package ``b``, sorted."""
        return sorted(
            (e for e in self.edges if package_of(e.source) == a and package_of(e.target) == b),
            key=lambda e: (e.source, e.target),
        )


def package_of(module: str) -> str:
    """The package a module counts in: ``rftstream.<name>`` for the core (a subpackage or a
    loose module), the top-level name for a plugin package."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == CORE else parts[0]


def _top(module: str) -> str:
    return module.partition(".")[0]


def _module_names(root: Path) -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for file in sorted((root / package).rglob("*.py")):
            parts = list(file.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = file
    return modules


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ``modules`` that ``name`` (a module or ``module.attribute``) lives in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _walk(node: ast.AST, where: str) -> Iterable[tuple[ast.Import | ast.ImportFrom, str]]:
    for child in ast.iter_child_nodes(node):
        inner = where
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inner = "function"
        elif isinstance(child, ast.If) and where == "module" and _is_type_checking(child.test):
            inner = "type_checking"
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, where
        yield from _walk(child, inner)


def build_graph(root: str | Path) -> ImportGraph:
    """Parse every module of :data:`PACKAGES` under ``root``; raises SyntaxError on bad source."""
    modules = _module_names(Path(root))
    graph = ImportGraph(modules)
    for module, file in modules.items():
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        is_package = file.name == "__init__.py"
        for node, where in _walk(tree, "module"):
            for name in _imported_names(node, module, is_package):
                target = _owner(name, modules)
                if target is not None and target != module:
                    graph.edges.add(Edge(module, target, where))
    return graph


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit on deep graphs)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(component)
    return components


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    args = parser.parse_args(argv)
    graph = build_graph(args.root)
    core_to_plugin = graph.core_to_plugin()
    print(f"core -> plugin edges: {len(core_to_plugin)}")
    for edge in core_to_plugin:
        print(f"  {edge.source} -> {edge.target} ({edge.where})")
    print(f"function-level imports (module pairs): {len(graph.function_level())}")
    cycles = graph.cycles()
    print(f"import cycles: {len(cycles)}")
    for cycle in cycles:
        print("  " + " <-> ".join(cycle))
    package_cycles = graph.package_cycles()
    print(f"package cycles: {len(package_cycles)}")
    for cycle in package_cycles:
        print("  " + " <-> ".join(cycle))
        for a in cycle:
            for b in cycle:
                for e in graph.package_edges(a, b) if a != b else []:
                    print(f"    {e.source} -> {e.target} ({e.where})")
    return 1 if core_to_plugin or cycles or package_cycles else 0


if __name__ == "__main__":
    sys.exit(main())
