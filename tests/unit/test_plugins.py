"""rftstream.plugins.loader.load_plugins: plugin dirs and entry points, with real files."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import pickle
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rftstream.errors import PluginError
from rftstream.plugins.loader import load_plugins, plugin_module_name


@pytest.fixture
def sink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, object]]:
    """A uniquely named module in tmp_path holding a Registry and a list plugins append to."""
    name = f"rft_test_sink_{uuid.uuid4().hex[:8]}"
    sink_dir = tmp_path / "sink"
    sink_dir.mkdir()
    (sink_dir / f"{name}.py").write_text(
        "from rftstream.plugins.registry import Registry\nREG = Registry('test_plugins')\nEXECUTED = []\n"
    )
    monkeypatch.syspath_prepend(str(sink_dir))
    module = importlib.import_module(name)
    yield name, module
    sys.modules.pop(name, None)


@pytest.fixture
def clean_modules() -> Iterator[None]:
    """Drop every rftstream_plugins.* module and sys.path entry a test created."""
    before = set(sys.modules)
    path_before = list(sys.path)
    yield
    sys.path[:] = path_before
    for name in set(sys.modules) - before:
        if name.startswith("rftstream_plugins") or name.startswith("rft_test_"):
            sys.modules.pop(name, None)


def write_plugin(directory: Path, stem: str, body: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stem}.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_plugin_dir_loaded_once(tmp_path: Path, sink, clean_modules) -> None:
    sink_name, sink_mod = sink
    plugins = tmp_path / "plugins"
    write_plugin(
        plugins,
        "my_workflow",
        f"""
        import {sink_name} as sink

        sink.EXECUTED.append(__name__)

        @sink.REG.register_module("my_workflow")
        class MyWorkflow:
            pass
        """,
    )
    write_plugin(
        plugins, "_private_helper", f"import {sink_name} as sink\nsink.EXECUTED.append('private')\n"
    )
    (plugins / "notes.txt").write_text("not python")

    names = load_plugins([plugins], entry_points=False)
    expected = plugin_module_name(plugins / "my_workflow.py")
    assert names == [expected]
    assert expected.startswith("rftstream_plugins.")
    assert expected.endswith(".my_workflow")
    assert sink_mod.EXECUTED == [expected]
    cls = sink_mod.REG.get("my_workflow")
    assert cls.__module__ == expected
    assert sys.modules[expected].MyWorkflow is cls

    # idempotent: same dir again (also given as a different spelling of the path)
    again = load_plugins([plugins, plugins / ".." / "plugins"], entry_points=False)
    assert again == [expected]
    assert sink_mod.EXECUTED == [expected]


def test_same_stem_in_two_dirs_are_distinct(tmp_path: Path, sink, clean_modules) -> None:
    sink_name, sink_mod = sink
    body = f"import {sink_name} as sink\nsink.EXECUTED.append(__name__)\n"
    write_plugin(tmp_path / "a", "plug", body)
    write_plugin(tmp_path / "b", "plug", body)
    names = load_plugins([tmp_path / "a", str(tmp_path / "b")], entry_points=False)
    assert len(names) == 2 and names[0] != names[1]
    assert sink_mod.EXECUTED == names


def test_plugin_dataclass_and_pickle_work(tmp_path: Path, clean_modules) -> None:
    write_plugin(
        tmp_path / "p",
        "records",
        """
        from dataclasses import dataclass

        @dataclass
        class Point:
            x: int
            y: int = 0
        """,
    )
    (name,) = load_plugins([tmp_path / "p"], entry_points=False)
    point_cls = sys.modules[name].Point
    point = point_cls(3, 4)
    assert dataclasses.asdict(point) == {"x": 3, "y": 4}
    assert pickle.loads(pickle.dumps(point)) == point


def test_plugin_can_import_sibling_helper(tmp_path: Path, clean_modules) -> None:
    helper = f"_rft_test_helper_{uuid.uuid4().hex[:8]}"
    plugins = tmp_path / "p"
    write_plugin(plugins, helper, "VALUE = 41\n")
    write_plugin(plugins, "uses_helper", f"from {helper} import VALUE\nANSWER = VALUE + 1\n")
    try:
        (name,) = load_plugins([plugins], entry_points=False)
        assert sys.modules[name].ANSWER == 42
        assert str(plugins.resolve()) in sys.path
    finally:
        sys.modules.pop(helper, None)


def test_plugin_imported_by_sibling_is_not_executed_twice(
    tmp_path: Path, sink, clean_modules
) -> None:
    sink_name, sink_mod = sink
    shared = f"rft_test_shared_{uuid.uuid4().hex[:8]}"
    plugins = tmp_path / "p"
    # "a_main" sorts first and imports the other plugin file by its plain name
    write_plugin(plugins, "a_main", f"import {shared}\nVALUE = {shared}.VALUE\n")
    write_plugin(
        plugins,
        shared,
        f"""
        import {sink_name} as sink
        sink.EXECUTED.append("shared")
        VALUE = 7

        @sink.REG.register_module("shared_thing")
        class SharedThing:
            pass
        """,
    )
    names = load_plugins([plugins], entry_points=False)
    assert len(names) == 2
    assert sink_mod.EXECUTED == ["shared"]
    assert sys.modules[names[1]] is sys.modules[shared]
    assert sys.modules[names[0]].VALUE == 7


def test_broken_plugin_raises_plugin_error_naming_file(tmp_path: Path, sink, clean_modules) -> None:
    sink_name, sink_mod = sink
    plugins = tmp_path / "p"
    write_plugin(plugins, "a_good", f"import {sink_name} as sink\nsink.EXECUTED.append('good')\n")
    broken = write_plugin(plugins, "b_broken", "raise RuntimeError('boom in plugin')\n")
    with pytest.raises(PluginError) as info:
        load_plugins([plugins], entry_points=False)
    msg = str(info.value)
    assert str(broken) in msg
    assert "RuntimeError" in msg and "boom in plugin" in msg
    assert isinstance(info.value.__cause__, RuntimeError)
    assert plugin_module_name(broken) not in sys.modules
    assert sink_mod.EXECUTED == ["good"]

    # fixed plugin loads on the next call; the good one is not executed again
    broken.write_text(f"import {sink_name} as sink\nsink.EXECUTED.append('fixed')\n")
    names = load_plugins([plugins], entry_points=False)
    assert names == [plugin_module_name(plugins / "a_good.py"), plugin_module_name(broken)]
    assert sink_mod.EXECUTED == ["good", "fixed"]


def test_plugin_syntax_error(tmp_path: Path, clean_modules) -> None:
    broken = write_plugin(tmp_path / "p", "syntax", "def broken(:\n")
    with pytest.raises(PluginError) as info:
        load_plugins([tmp_path / "p"], entry_points=False)
    assert str(broken) in str(info.value)
    assert "SyntaxError" in str(info.value)


def test_single_dir_given_as_string(tmp_path: Path, clean_modules) -> None:
    write_plugin(tmp_path / "p", "solo", "X = 1\n")
    (name,) = load_plugins(str(tmp_path / "p"), entry_points=False)  # type: ignore[arg-type]
    assert sys.modules[name].X == 1


def test_missing_dir_raises_plugin_error(tmp_path: Path) -> None:
    missing = tmp_path / "does_not_exist"
    with pytest.raises(PluginError) as info:
        load_plugins([missing], entry_points=False)
    assert str(missing) in str(info.value)


def test_file_instead_of_dir_raises_plugin_error(tmp_path: Path) -> None:
    file = tmp_path / "plugin.py"
    file.write_text("")
    with pytest.raises(PluginError) as info:
        load_plugins([file], entry_points=False)
    assert str(file) in str(info.value)


def make_distribution(site: Path, dist: str, entry_points: str, modules: dict[str, str]) -> None:
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    for name, body in modules.items():
        (site / f"{name}.py").write_text(textwrap.dedent(body))


def test_entry_point_plugins_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sink, clean_modules
) -> None:
    sink_name, sink_mod = sink
    suffix = uuid.uuid4().hex[:8]
    module = f"rft_test_ep_plugin_{suffix}"
    site = tmp_path / "site"
    make_distribution(
        site,
        f"rft_test_dist_{suffix}",
        f"""
        [rftstream.plugins]
        demo = {module}
        [console_scripts]
        not-a-plugin = {module}_missing:main
        """,
        {
            module: f"""
            import {sink_name} as sink
            sink.EXECUTED.append(__name__)

            @sink.REG.register_module("ep_workflow")
            class EpWorkflow:
                pass
            """
        },
    )
    monkeypatch.syspath_prepend(str(site))
    group = importlib.metadata.entry_points(group="rftstream.plugins")
    assert module in [ep.value for ep in group]

    names = load_plugins()
    assert module in names
    assert sink_mod.EXECUTED == [module]
    assert sink_mod.REG.get("ep_workflow").__module__ == module

    assert module in load_plugins()
    assert sink_mod.EXECUTED == [module]  # not executed twice

    assert module not in load_plugins(entry_points=False)


def test_broken_entry_point_raises_plugin_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_modules
) -> None:
    suffix = uuid.uuid4().hex[:8]
    module = f"rft_test_ep_broken_{suffix}"
    site = tmp_path / "site"
    make_distribution(
        site,
        f"rft_test_broken_{suffix}",
        f"[rftstream.plugins]\nbroken_ep = {module}\n",
        {module: "raise ImportError('missing dependency xyz')\n"},
    )
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(PluginError) as info:
        load_plugins()
    msg = str(info.value)
    assert "broken_ep" in msg and module in msg
    assert "missing dependency xyz" in msg
