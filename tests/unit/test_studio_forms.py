"""Units: the studio's config form is the config schema, and validates as the loader does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import yaml

from rftstream.config import load_config
from rftstream.config.schema import Config
from rftstream.studio.forms import (
    COMMON_KEYS,
    check_form,
    field_for_key,
    form_sections,
    form_values_to_dict,
)


def _leaf_keys(cls: type, prefix: str = "") -> list[str]:
    """Every key path of the schema whose value is not a table (written independently of
    the form: by the Structs' annotations)."""
    out = []
    for f in msgspec.structs.fields(cls):
        if isinstance(f.type, type) and issubclass(f.type, msgspec.Struct):
            out += _leaf_keys(f.type, f"{prefix}{f.encode_name}.")
        else:
            out.append(prefix + f.encode_name)
    return out


def _fields() -> dict[str, Any]:
    return {f.path: f for s in form_sections() for f in s.fields}


def test_every_schema_key_has_one_field_with_its_default() -> None:
    import rftstream.config.schema as schema

    keys = _leaf_keys(Config)
    fields = _fields()
    assert sorted(fields) == sorted(keys)
    assert sum(len(s.fields) for s in form_sections()) == len(keys)  # no key twice
    defaults = msgspec.to_builtins(Config())
    for path, f in fields.items():
        node = defaults
        for part in path.split("."):
            node = node[part]
        assert f.default == node, path
    # scalars typed, the rest YAML
    assert fields["buffer.batch_size"].kind == "int"
    assert fields["buffer.total_steps"].kind == "int" and fields["buffer.total_steps"].optional
    assert fields["algorithm.optimizer.lr"].kind == "float"
    assert fields["monitor.plot"].kind == "bool"
    assert fields["monitor.monitor_type"].kind == "yaml"  # str | list[str]
    assert fields["data_processor.experience_pipeline.operators"].kind == "yaml"
    assert fields["synchronizer.sync_style"].choices == (
        "fixed",
        "dynamic_by_explorer",
        "dynamic_by_trainer",
        "fully_async",
    )
    assert "grpo" in fields["algorithm.algorithm_type"].suggestions
    assert schema.Config.__doc__  # sections carry their struct's docstring
    assert "batch sizes" in next(s for s in form_sections() if s.key == "buffer").help


def test_common_keys_come_first_in_their_section() -> None:
    order = {k: i for i, k in enumerate(COMMON_KEYS)}
    for s in form_sections():
        flags = [f.common for f in s.fields]
        assert flags == sorted(flags, reverse=True), s.key  # common ones, then the advanced
        common = [f.path for f in s.fields if f.common]
        assert common == sorted(common, key=order.__getitem__)
    fields = _fields()
    assert all(k in fields for k in COMMON_KEYS)
    assert [s.key for s in form_sections()][:8] == [
        "general",
        "algorithm",
        "model",
        "buffer",
        "explorer",
        "synchronizer",
        "data_processor",
        "trainer",
    ]


def test_values_parse_by_kind_and_defaults_are_left_out() -> None:
    data, errors = form_values_to_dict(
        {
            "name": "demo",
            "project": "rftstream",  # the default: not written
            "buffer.batch_size": " 4 ",
            "buffer.total_steps": "",  # optional: null, the default
            "algorithm.optimizer.lr": "1e-5",
            "monitor.plot": False,
            "monitor.monitor_type": "[jsonl, tensorboard]",
            "data_processor.experience_pipeline.operators": "- name: reward_filter\n  args: {threshold: 0.5}",
        }
    )
    assert errors == {}
    assert data == {
        "name": "demo",
        "buffer": {"batch_size": 4},
        "algorithm": {"optimizer": {"lr": 1e-5}},
        "data_processor": {
            "experience_pipeline": {
                "operators": [{"name": "reward_filter", "args": {"threshold": 0.5}}]
            }
        },
        "monitor": {"monitor_type": ["jsonl", "tensorboard"], "plot": False},
    }


def test_unparsable_values_are_reported_by_key_path() -> None:
    _, errors = form_values_to_dict(
        {
            "buffer.batch_size": "four",
            "algorithm.optimizer.lr": "fast",
            "buffer.train_batch_size": "",
            "monitor.plot": "maybe",
            "trainer.deepspeed_config": "{a: [1",
            "buffer.no_such_key": "1",
        }
    )
    assert errors["buffer.batch_size"] == "must be an integer"
    assert errors["algorithm.optimizer.lr"] == "must be a number"
    assert errors["buffer.train_batch_size"] == "needs a value"
    assert "true or false" in errors["monitor.plot"]
    assert errors["trainer.deepspeed_config"].startswith("is not valid YAML")
    assert "not a key of the config schema" in errors["buffer.no_such_key"]
    assert len(errors) == 6


def test_a_valid_form_gives_yaml_that_load_config_reads_back(tmp_path: Path) -> None:
    check = check_form(
        {
            "name": "form-run",
            "buffer.batch_size": "3",
            "synchronizer.sync_style": "fixed",
            "algorithm.repeat_times": "5",
            "trainer.zero_stage": "2",
        }
    )
    assert check.ok, (check.errors, check.general)
    assert yaml.safe_load(check.yaml) == {
        "name": "form-run",
        "algorithm": {"repeat_times": 5},
        "buffer": {"batch_size": 3},
        "synchronizer": {"sync_style": "fixed"},
        "trainer": {"zero_stage": 2},
    }
    path = tmp_path / "c.yaml"
    path.write_text(check.yaml)
    cfg = load_config(path)
    assert cfg == check.config
    default = Config()
    expected = msgspec.structs.replace(
        default,
        name="form-run",
        algorithm=msgspec.structs.replace(default.algorithm, repeat_times=5),
        buffer=msgspec.structs.replace(default.buffer, batch_size=3),
        synchronizer=msgspec.structs.replace(default.synchronizer, sync_style="fixed"),
        trainer=msgspec.structs.replace(default.trainer, zero_stage=2),
    )
    assert cfg == expected


def test_loader_errors_land_on_the_field_holding_the_key() -> None:
    check = check_form({"buffer.batch_size": "0"})
    assert not check.ok and check.yaml
    assert list(check.errors) == ["buffer.batch_size"]
    assert "must be >= 1" in check.errors["buffer.batch_size"]
    assert "rftstream-studio-" not in check.errors["buffer.batch_size"]  # no temp file name

    check = check_form({"trainer.zero_stage": "7"})
    assert "must be one of 0, 1, 2, 3" in check.errors["trainer.zero_stage"]

    check = check_form({"data_processor.experience_pipeline.operators": "- nam: reward_filter"})
    msg = check.errors["data_processor.experience_pipeline.operators"]
    assert "operators[0].nam" in msg and "did you mean `name`" in msg

    check = check_form({"synchronizer.sync_style": "sometimes"})
    assert "must be one of" in check.errors["synchronizer.sync_style"]


def test_field_for_key_picks_the_longest_holder() -> None:
    paths = ["data_processor.experience_pipeline.operators", "buffer.batch_size", "buffer"]
    assert (
        field_for_key("data_processor.experience_pipeline.operators[1].args", paths)
        == "data_processor.experience_pipeline.operators"
    )
    assert field_for_key("buffer.batch_size", paths) == "buffer.batch_size"
    assert field_for_key("buffer.batch_sizes", paths) == "buffer"
    assert field_for_key("(root)", paths) is None


def test_parse_errors_and_loader_errors_show_together() -> None:
    check = check_form({"trainer.zero_stage": "x", "buffer.batch_size": "0"})
    assert check.errors["trainer.zero_stage"] == "must be an integer"
    assert "must be >= 1" in check.errors["buffer.batch_size"]
    assert not check.ok and check.yaml == "" and check.config is None
