"""The import graph (``tools/import_graph.py``, ``just imports``): no circles, and the core
never imports the plugin packages (they register themselves; the core finds them by name)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "import_graph", ROOT / "tools" / "import_graph.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("import_graph", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


import_graph = _tool()


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for package in import_graph.PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.fixture(scope="module")
def repository() -> Any:
    return import_graph.build_graph(ROOT)


def test_the_repository_has_no_import_cycles(repository: Any) -> None:
    """Module-level, function-level and TYPE_CHECKING imports all count."""
    assert repository.cycles() == []


def test_the_repository_has_no_package_cycles(repository: Any) -> None:
    """Packages (``rftstream.bus``, ``rftstream.config``, a loose module...) do not import
    each other in a loop either, whatever modules the imports are in."""
    assert repository.package_cycles() == []


def test_the_core_imports_no_plugin_package(repository: Any) -> None:
    """``rftstream`` finds ``operators``, ``algorithms`` and ``workflows`` through its
    registries (by name), never by an import statement."""
    edges = repository.core_to_plugin()
    assert [f"{e.source} -> {e.target} ({e.where})" for e in edges] == []


def test_the_graph_sees_the_real_plugin_imports(repository: Any) -> None:
    """The plugins import the core, so an empty result above is not an empty graph."""
    assert import_graph.Edge("operators.filters", "rftstream.experience_pipeline", "module") in (
        repository.edges
    )
    assert len(repository.modules) > 100


def test_a_cycle_through_a_function_or_type_checking_import_is_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "rftstream/a.py": "def f():\n    from rftstream.b import g\n",
            "rftstream/b.py": "from rftstream import c\n",
            "rftstream/c.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n"
            ),
            "rftstream/d.py": "import rftstream.c\n",
        },
    )
    graph = import_graph.build_graph(root)
    assert graph.cycles() == [["rftstream.a", "rftstream.b", "rftstream.c"]]
    wheres = {(e.source, e.target): e.where for e in graph.edges}
    assert wheres[("rftstream.a", "rftstream.b")] == "function"
    assert wheres[("rftstream.c", "rftstream.a")] == "type_checking"
    assert wheres[("rftstream.b", "rftstream.c")] == "module"


def test_a_core_import_of_a_plugin_is_found_and_the_reverse_is_allowed(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "rftstream/runtime.py": "def build():\n    from operators.filters import thing\n",
            "operators/filters.py": "from rftstream.runtime import build\nthing = 1\n",
            "workflows/flow.py": "from rftstream import runtime\n",
        },
    )
    graph = import_graph.build_graph(root)
    assert [(e.source, e.target, e.where) for e in graph.core_to_plugin()] == [
        ("rftstream.runtime", "operators.filters", "function")
    ]
    assert import_graph.main([str(root)]) == 1


def test_a_package_cycle_without_a_module_cycle_is_found(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _tree(
        tmp_path,
        {
            "rftstream/loose.py": "def f():\n    from rftstream.sub.b import g\n",
            "rftstream/other.py": "import json\n",
        },
    )
    (root / "rftstream" / "sub").mkdir()
    (root / "rftstream" / "sub" / "__init__.py").write_text("")
    (root / "rftstream" / "sub" / "a.py").write_text("from rftstream import loose\n")
    (root / "rftstream" / "sub" / "b.py").write_text("g = 1\n")
    graph = import_graph.build_graph(root)
    assert graph.cycles() == []  # sub.a -> loose -> sub.b: no two modules in a loop
    assert graph.package_cycles() == [["rftstream.loose", "rftstream.sub"]]
    assert import_graph.main([str(root)]) == 1
    out = capsys.readouterr().out
    assert "package cycles: 1" in out and "rftstream.loose -> rftstream.sub.b (function)" in out


def test_a_clean_tree_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _tree(tmp_path, {"workflows/flow.py": "from rftstream import runtime\n"})
    (root / "rftstream" / "runtime.py").write_text("import json\n")
    assert import_graph.main([str(root)]) == 0
    out = capsys.readouterr().out
    assert "import cycles: 0" in out and "package cycles: 0" in out


def test_architecture_md_layers_hold(repository: Any) -> None:
    """ARCHITECTURE.md's table names every package of the core once, and no package
    imports one of a higher layer."""
    import re

    layer_of: dict[str, int] = {}
    for line in (ROOT / "ARCHITECTURE.md").read_text().splitlines():
        m = re.match(r"\| (\d+) \| (.+?) \|", line)
        if m:
            for name in re.findall(r"`([\w/]+)`", m.group(2)):
                key = f"rftstream.{name.rstrip('/')}"
                assert key not in layer_of, f"{key} is listed twice"
                layer_of[key] = int(m.group(1))
    packages = {
        import_graph.package_of(m) for m in repository.modules if m.startswith("rftstream.")
    }
    assert packages - set(layer_of) == set(), "packages missing from ARCHITECTURE.md"
    assert set(layer_of) - packages == set(), "ARCHITECTURE.md names packages that do not exist"
    upward = [
        f"{e.source} (layer {layer_of[a]}) -> {e.target} (layer {layer_of[b]})"
        for e in repository.edges
        if (a := import_graph.package_of(e.source)) in layer_of
        and (b := import_graph.package_of(e.target)) in layer_of
        and layer_of[a] < layer_of[b]
    ]
    assert upward == []
