"""rftstream.plugins.registry.Registry: names, decorator form, duplicates, dotted paths."""

from __future__ import annotations

import builtins
import collections
import importlib
import json
import os.path
import sys
import threading

import pytest

from rftstream.errors import RegistryError
from rftstream.plugins.registry import Registry


class Alpha:
    pass


class Beta:
    class Inner:
        pass


def test_register_and_get_by_name() -> None:
    reg: Registry[type] = Registry("things")
    assert reg.register_module("alpha", Alpha) is Alpha
    assert reg.get("alpha") is Alpha
    assert "alpha" in reg
    assert "beta" not in reg
    assert 3 not in reg  # type: ignore[operator]
    assert len(reg) == 1
    assert list(reg) == ["alpha"]
    assert reg.names() == ["alpha"]
    assert "alpha" in repr(reg) and "things" in repr(reg)


def test_decorator_form_returns_the_class() -> None:
    reg: Registry[type] = Registry("workflows")

    @reg.register_module("my_workflow")
    class MyWorkflow:
        pass

    assert reg.get("my_workflow") is MyWorkflow
    assert MyWorkflow.__name__ == "MyWorkflow"


def test_register_functions() -> None:
    reg: Registry = Registry("fns")

    @reg.register_module("double")
    def double(x: int) -> int:
        return 2 * x

    assert reg.get("double")(4) == 8


def test_names_sorted() -> None:
    reg: Registry[type] = Registry("things")
    reg.register_module("zeta", Alpha)
    reg.register_module("beta", Beta)
    reg.register_module("alpha", Beta.Inner)
    assert reg.names() == ["alpha", "beta", "zeta"]
    assert list(reg) == ["alpha", "beta", "zeta"]


def test_duplicate_name_error_and_force() -> None:
    reg: Registry[type] = Registry("things")
    reg.register_module("x", Alpha)
    with pytest.raises(RegistryError) as info:
        reg.register_module("x", Beta)
    msg = str(info.value)
    assert "things" in msg and "'x'" in msg
    assert reg.get("x") is Alpha  # unchanged after the failed attempt
    reg.register_module("x", Beta, force=True)
    assert reg.get("x") is Beta


def test_duplicate_name_error_decorator_form() -> None:
    reg: Registry[type] = Registry("things")
    reg.register_module("x", Alpha)
    with pytest.raises(RegistryError):

        @reg.register_module("x")
        class Other:
            pass


def test_reregistering_same_object_is_allowed() -> None:
    reg: Registry[type] = Registry("things")
    reg.register_module("x", Alpha)
    reg.register_module("x", Alpha)
    assert reg.get("x") is Alpha
    assert len(reg) == 1


def test_reregistering_same_class_from_reimported_module_is_allowed() -> None:
    # a module executed twice creates a new class object with the same qualname
    reg: Registry[type] = Registry("things")
    first = type("Same", (), {"__module__": "some.mod"})
    second = type("Same", (), {"__module__": "some.mod"})
    reg.register_module("same", first)
    reg.register_module("same", second)
    assert reg.get("same") is second


@pytest.mark.parametrize("bad", ["", None, 3])
def test_invalid_name_rejected(bad: object) -> None:
    reg: Registry[type] = Registry("things")
    with pytest.raises(RegistryError):
        reg.register_module(bad, Alpha)  # type: ignore[arg-type]


def test_get_by_dotted_path() -> None:
    reg: Registry = Registry("things")
    assert reg.get("collections.OrderedDict") is collections.OrderedDict
    assert reg.get("os.path.join") is os.path.join
    assert reg.get(f"{__name__}.Alpha") is Alpha


def test_get_by_colon_path() -> None:
    reg: Registry = Registry("things")
    assert reg.get("json:dumps") is json.dumps
    assert reg.get(f"{__name__}:Beta.Inner") is Beta.Inner
    assert reg.get("os.path:join") is os.path.join


def test_registered_name_wins_over_import() -> None:
    reg: Registry = Registry("things")
    reg.register_module("json.dumps", Alpha)
    assert reg.get("json.dumps") is Alpha


def test_unknown_name_lists_known_names() -> None:
    reg: Registry[type] = Registry("operators")
    reg.register_module("reward_filter", Alpha)
    reg.register_module("dedup", Beta)
    with pytest.raises(RegistryError) as info:
        reg.get("reward_filtr")
    msg = str(info.value)
    assert "operators" in msg
    assert "'reward_filtr'" in msg
    assert "dedup, reward_filter" in msg


def test_unknown_name_empty_registry() -> None:
    with pytest.raises(RegistryError) as info:
        Registry("empty").get("anything")
    assert "(none)" in str(info.value)


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("no_such_module_rft.Thing", "no_such_module_rft"),
        ("no_such_module_rft:Thing", "no_such_module_rft"),
        ("collections.NoSuchThing", "NoSuchThing"),
        ("json:nope", "nope"),
        (f"{__name__}:Beta.Missing", "Beta.Missing"),
    ],
)
def test_bad_dotted_path(path: str, fragment: str) -> None:
    reg: Registry = Registry("things")
    with pytest.raises(RegistryError) as info:
        reg.get(path)
    msg = str(info.value)
    assert "things" in msg
    assert fragment in msg


@pytest.mark.parametrize("path", [".Alpha", ":Alpha"])
def test_empty_module_in_dotted_path_is_registry_error(path: str) -> None:
    # importlib raises ValueError("Empty module name") here; the registry must translate it
    reg: Registry = Registry("things")
    with pytest.raises(RegistryError) as info:
        reg.get(path)
    assert "things" in str(info.value)
    assert path in str(info.value)


def test_plugin_may_replace_a_builtin_but_not_another_plugin(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reg: Registry[type] = Registry("ops")
    builtin = type("RewardFilter", (), {"__module__": "operators.filters"})
    plugin = type("RewardFilter2", (), {"__module__": "my_plugins.reward"})
    other = type("RewardFilter3", (), {"__module__": "other_plugins.reward"})
    reg.register_module("reward_filter", builtin)
    with caplog.at_level("WARNING"):
        reg.register_module("reward_filter", plugin)
    assert reg.get("reward_filter") is plugin
    assert "replaces the built-in" in caplog.text
    with pytest.raises(RegistryError, match="already registered"):
        reg.register_module("reward_filter", other)


def _defaults_package(tmp_path, monkeypatch: pytest.MonkeyPatch, name: str, body: str) -> Registry:
    """A registry whose built-ins package ``name`` (written under ``tmp_path``) registers into it."""
    reg: Registry[type] = Registry("tools", defaults=(name,))
    holder = tmp_path / f"{name}_holder.py"
    holder.write_text("REG = None\n")
    (tmp_path / f"{name}.py").write_text(f"from {name}_holder import REG\n{body}")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module(f"{name}_holder").REG = reg
    return reg


def test_defaults_are_imported_by_the_first_lookup_only(tmp_path, monkeypatch) -> None:
    body = (
        "import builtins\n"
        "builtins.loads_hammer = getattr(builtins, 'loads_hammer', 0) + 1\n"
        "@REG.register_module('hammer')\n"
        "class Hammer:\n"
        "    pass\n"
        "assert 'hammer' in REG  # a lookup while importing does not import again\n"
    )
    reg = _defaults_package(tmp_path, monkeypatch, "rft_test_defaults_a", body)
    assert "rft_test_defaults_a" not in sys.modules  # nothing imported at construction
    assert reg.names() == ["hammer"]
    assert reg.get("hammer").__name__ == "Hammer"
    assert list(reg) == ["hammer"] and len(reg) == 1
    assert builtins.loads_hammer == 1  # type: ignore[attr-defined]
    del builtins.loads_hammer  # type: ignore[attr-defined]


def test_a_plugin_registered_before_the_defaults_still_replaces_the_builtin(
    tmp_path, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    body = "@REG.register_module('saw')\nclass Saw:\n    __module__ = 'operators.saw'\n"
    reg = _defaults_package(tmp_path, monkeypatch, "rft_test_defaults_b", body)
    mine = type("MySaw", (), {"__module__": "my_plugins.saw"})
    with caplog.at_level("WARNING"):
        reg.register_module("saw", mine)
    assert reg.get("saw") is mine
    assert "replaces the built-in" in caplog.text


def test_a_default_that_fails_to_import_is_a_registry_error_and_retried(
    tmp_path, monkeypatch
) -> None:
    reg = _defaults_package(
        tmp_path, monkeypatch, "rft_test_defaults_c", "raise ValueError('boom')\n"
    )
    with pytest.raises(RegistryError, match="rft_test_defaults_c.*ValueError: boom"):
        reg.get("anything")
    (tmp_path / "rft_test_defaults_c.py").write_text(
        "from rft_test_defaults_c_holder import REG\nREG.register_module('drill', int)\n"
    )
    importlib.invalidate_caches()
    assert reg.get("drill") is int


def test_snapshot_and_restore_keep_whether_the_defaults_were_loaded(tmp_path, monkeypatch) -> None:
    body = "@REG.register_module('level')\nclass Level:\n    pass\n"
    reg = _defaults_package(tmp_path, monkeypatch, "rft_test_defaults_d", body)
    snapshot = Registry.snapshot_all()
    assert reg.names() == ["level"]
    Registry.restore_all(snapshot)
    sys.modules.pop("rft_test_defaults_d")  # imported again on the next first lookup
    assert reg.names() == ["level"]


def test_another_thread_waits_for_the_defaults_to_finish_importing(tmp_path, monkeypatch) -> None:
    """A lookup racing the import of the built-ins sees all of them, not the first few."""
    started = threading.Event()
    monkeypatch.setattr(builtins, "rft_test_started", started, raising=False)
    body = (
        "import builtins, time\n"
        "REG.register_module('first', int)\n"
        "builtins.rft_test_started.set()\n"
        "time.sleep(0.3)\n"
        "REG.register_module('second', float)\n"
    )
    reg = _defaults_package(tmp_path, monkeypatch, "rft_test_defaults_e", body)
    importer = threading.Thread(target=importlib.import_module, args=("rft_test_defaults_e",))
    importer.start()
    assert started.wait(5)
    assert reg.get("second") is float  # waited for the import instead of reading it half-done
    importer.join()
    assert reg.names() == ["first", "second"]
