"""Config errors caught at load, before a run writes anything: each names its key path.

* ``name`` must stay inside ``runs/`` and the checkpoint directory
  (:func:`rftstream.config.validate.check_run_name`);
* token budgets are at least 1 and leave room for a prompt in the model's context
  (:func:`rftstream.config.validate.check_model_context`);
* the local tasksets and datasets a run reads exist
  (:func:`rftstream.run_inputs.check_data_paths`), which
  :func:`rftstream.runtime.prepare_run` checks before the run directory is written;
* a config file that is binary, not UTF-8 or bad YAML is one error naming the file,
  an empty one a warning naming it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from rftstream.config import config_from_dict, load_config, validate_config
from rftstream.config.schema import Config
from rftstream.config.validate import (
    ConfigWarning,
    check_model_context,
    check_output_dirs,
    check_run_name,
)
from rftstream.default_run import DEFAULT_CONFIG
from rftstream.errors import ConfigError
from rftstream.run_inputs import check_data_paths

TASKSET = "buffer.explorer_input.taskset"


def cfg_of(data: dict[str, Any]) -> Config:
    return config_from_dict(data)


def error_of(fn: Any, *args: Any, **kwargs: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)  # one line on the console
    return info.value


def model_dir(tmp_path: Path, config: dict[str, Any] | None) -> str:
    """A model directory whose ``config.json`` is ``config`` (none when ``None``)."""
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return str(d)


# ------------------------------------------------------------------ name


@pytest.mark.parametrize(
    "name",
    ["../../etc/evil", "..", ".", "/tmp/x", "a/../b", "a//b", "a/", "a\\b", "a\0b", "x/./y"],
)
def test_a_name_that_leads_out_of_the_run_directory_is_refused(name: str) -> None:
    err = error_of(validate_config, Config(name=name), "c.yaml")
    assert err.key_path == "name" and "c.yaml" in str(err)
    err = error_of(load_config, None, [f"name={json.dumps(name)}"])
    assert err.key_path == "name"


@pytest.mark.parametrize(
    "name",
    ["default", "GSM8K-GRPO", "qwen2.5-1.5B-gsm8k", "has space", "ümlaut", "x" * 100, "a..b"]
    + ["warm/sft"],  # a staged config's run: <name>/<stage_name>
)
def test_names_that_stay_inside_are_legal(name: str) -> None:
    check_run_name(name)
    validate_config(Config(name=name))


# ------------------------------------------------------------------ token budgets


@pytest.mark.parametrize("key", ["max_prompt_tokens", "max_response_tokens"])
@pytest.mark.parametrize("value", [-5, 0])
def test_token_budgets_below_one_are_refused_at_load(key: str, value: int) -> None:
    err = error_of(load_config, None, [f"model.{key}={value}"])
    assert err.key_path == f"model.{key}" and "must be >= 1" in str(err)


def test_a_tasksets_max_tokens_below_one_is_refused() -> None:
    err = error_of(load_config, None, [f"{TASKSET}.rollout_args.max_tokens=-5"])
    assert err.key_path == f"{TASKSET}.rollout_args.max_tokens"


@pytest.mark.parametrize("tokens", [10**9, 128])
def test_a_response_budget_the_context_cannot_hold_is_refused(tmp_path: Path, tokens: int) -> None:
    path = model_dir(tmp_path, {"max_position_embeddings": 128})
    cfg = cfg_of({"model": {"max_prompt_tokens": 1, "max_response_tokens": tokens}})
    err = error_of(check_model_context, cfg, path, source="c.yaml")
    assert err.key_path == "model.max_response_tokens"
    assert "context of 128 tokens" in str(err) and "config.json" in str(err)


def test_a_budget_that_fits_passes_silently(tmp_path: Path) -> None:
    path = model_dir(tmp_path, {"max_position_embeddings": 128})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_model_context(
            cfg_of({"model": {"max_prompt_tokens": 64, "max_response_tokens": 64}}), path
        )
        check_model_context(cfg_of(DEFAULT_CONFIG), path)  # the default run, on the tiny model


def test_a_prompt_and_response_longer_than_the_context_are_noted_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = model_dir(tmp_path, {"max_position_embeddings": 128})
    with (
        caplog.at_level(logging.INFO, logger="rftstream.config.validate"),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("error")  # a note for the run's log, not a console warning
        check_model_context(Config(), path)
    assert "= 320 exceeds the model's context of 128" in caplog.text


def test_the_context_comes_from_text_config_or_max_model_len(tmp_path: Path) -> None:
    path = model_dir(tmp_path, {"text_config": {"max_position_embeddings": 100}})
    err = error_of(check_model_context, cfg_of({"model": {"max_response_tokens": 100}}), path)
    assert "text_config.max_position_embeddings" in str(err)
    cfg = cfg_of(
        {"model": {"max_model_len": 40, "max_prompt_tokens": 8, "max_response_tokens": 50}}
    )
    err = error_of(check_model_context, cfg, path)
    assert "context of 40 tokens (model.max_model_len)" in str(err)


def test_a_tasksets_max_tokens_is_held_to_the_context(tmp_path: Path) -> None:
    path = model_dir(tmp_path, {"max_position_embeddings": 128})
    data = {"model": {"max_prompt_tokens": 8, "max_response_tokens": 8}}
    data["buffer"] = {"explorer_input": {"eval_tasksets": [{"rollout_args": {"max_tokens": 500}}]}}
    err = error_of(check_model_context, cfg_of(data), path)
    assert err.key_path == "buffer.explorer_input.eval_tasksets[0].rollout_args.max_tokens"


@pytest.mark.parametrize("config", [None, {}, {"max_position_embeddings": "big"}, [1]])
def test_without_a_known_context_nothing_is_checked(tmp_path: Path, config: Any) -> None:
    path = model_dir(tmp_path, config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_model_context(cfg_of({"model": {"max_response_tokens": 10**9}}), path)


# ------------------------------------------------------------------ data paths


def test_the_default_run_and_the_defaults_pass() -> None:
    for cfg in (cfg_of(DEFAULT_CONFIG), load_config(None)):
        validate_config(cfg)
        check_data_paths(cfg)


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"taskset": {"path": "no/such/dir"}}, f"{TASKSET}.path"),
        (
            {
                "tasksets": [
                    {"name": "a", "path": "builtin:arithmetic"},
                    {"name": "b", "path": "x.jsonl"},
                ]
            },
            "buffer.explorer_input.tasksets[1].path",
        ),
        (
            {"eval_tasksets": [{"name": "e", "path": "missing.parquet"}]},
            "buffer.explorer_input.eval_tasksets[0].path",
        ),
        ({"taskset": {"path": "builtin:nope"}}, f"{TASKSET}.path"),
    ],
)
def test_a_missing_taskset_names_its_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: dict[str, Any], key: str
) -> None:
    monkeypatch.chdir(tmp_path)
    err = error_of(check_data_paths, cfg_of({"buffer": {"explorer_input": data}}), source="c.yaml")
    assert err.key_path == key and "c.yaml" in str(err)


def test_existing_files_directories_and_builtins_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n')
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    inp = {
        "taskset": {"name": "a", "path": "data/train.jsonl"},  # relative to the working dir
        "tasksets": [
            {"name": "b", "path": str(tmp_path / "data")},
            {"name": "c", "path": "builtin:arithmetic"},
        ],
        "eval_tasksets": [{"name": "e", "path": "~/data"}, {"name": "f", "path": ""}],
    }
    check_data_paths(cfg_of({"buffer": {"explorer_input": inp}}))


def test_a_hub_dataset_id_gets_a_hint() -> None:
    err = error_of(
        check_data_paths,
        cfg_of({"buffer": {"explorer_input": {"taskset": {"path": "openai/gsm8k"}}}}),
    )
    assert "hub dataset ids are not downloaded" in str(err)


def test_only_what_the_mode_reads_is_checked(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.jsonl")
    inp = {"taskset": {"path": missing}, "eval_tasksets": [{"name": "e", "path": missing}]}
    tin = {"auxiliary_buffers": {"sft": {"path": missing}}}
    data = {"buffer": {"explorer_input": inp, "trainer_input": tin}}
    # mode train: no explorer reads the tasksets; the trainer reads the auxiliary buffer
    err = error_of(check_data_paths, cfg_of({**data, "mode": "train"}))
    assert err.key_path == "buffer.trainer_input.auxiliary_buffers.sft.path"
    # mode bench: the eval tasksets only
    err = error_of(check_data_paths, cfg_of({**data, "mode": "bench"}))
    assert err.key_path == "buffer.explorer_input.eval_tasksets[0].path"
    # mode explore: no trainer, so no auxiliary buffer
    err = error_of(check_data_paths, cfg_of({**data, "mode": "explore"}))
    assert err.key_path == f"{TASKSET}.path"


@pytest.mark.parametrize("root", ["/PATH/TO/CHECKPOINT/", "/path/to/ckpt", "path/to/checkpoints"])
def test_a_placeholder_checkpoint_root_leaves_checkpoints_under_the_run_dir(root: str) -> None:
    """Trinity-RFT's examples say ``checkpoint_root_dir: /PATH/TO/CHECKPOINT/``: unset at
    load with one warning (it made directories at the filesystem root)."""
    from rftstream.config.trinity import TrinityConfigWarning

    with pytest.warns(TrinityConfigWarning, match="placeholder") as caught:
        cfg = cfg_of({"checkpoint_root_dir": root})
    assert cfg.checkpoint_root_dir == ""
    assert "<run_dir>/checkpoints" in str(caught[0].message)
    check_output_dirs(cfg)


def test_an_unwritable_checkpoint_root_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "file").write_text("x")
    err = error_of(check_output_dirs, cfg_of({"checkpoint_root_dir": str(tmp_path / "file" / "c")}))
    assert err.key_path == "checkpoint_root_dir" and "is a file" in str(err)
    check_output_dirs(cfg_of({"checkpoint_root_dir": str(tmp_path / "new" / "deeper")}))
    check_output_dirs(cfg_of({}))  # unset: under the run dir
    # a directory this user may not write (asked of the OS, which lets root write anywhere)
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(
        "rftstream.config.validate.os.access",
        lambda p, mode: False if Path(p) == locked else real(p, mode),
    )
    err = error_of(check_output_dirs, cfg_of({"checkpoint_root_dir": str(locked / "c")}))
    assert f"{locked} is not writable" in str(err)


def test_a_placeholder_data_or_model_path_says_so(tmp_path: Path) -> None:
    err = error_of(
        check_data_paths,
        cfg_of({"buffer": {"explorer_input": {"taskset": {"path": "/PATH/TO/DATASET/"}}}}),
    )
    assert "placeholder" in str(err)
    from rftstream.runtime import resolve_model_path

    err = error_of(resolve_model_path, cfg_of({"model": {"model_path": "/PATH/TO/MODEL/"}}))
    assert err.key_path == "model.model_path" and "placeholder" in str(err)


def test_trainer_datasets_are_existing_files_or_directories(tmp_path: Path) -> None:
    key = "buffer.trainer_input.experience_buffer.path"

    def train(path: str, **storage: Any) -> Config:
        eb = {"path": path, **storage}
        return cfg_of({"mode": "train", "buffer": {"trainer_input": {"experience_buffer": eb}}})

    assert error_of(check_data_paths, train(str(tmp_path / "sft.jsonl"))).key_path == key
    check_data_paths(train(str(tmp_path)))  # a dataset directory: read as a taskset's
    (tmp_path / "sft.jsonl").write_text('{"messages": []}\n')
    check_data_paths(train(str(tmp_path / "sft.jsonl")))
    check_data_paths(train("", storage_type="queue"))  # the experience stream: no file


def test_prepare_run_refuses_a_missing_taskset_before_the_run_dir_exists(tmp_path: Path) -> None:
    from rftstream.runtime import prepare_run

    run_dir = tmp_path / "run"
    data = {
        **DEFAULT_CONFIG,
        "model": {"model_path": model_dir(tmp_path, {"max_position_embeddings": 128})},
        "buffer": {"explorer_input": {"taskset": {"path": str(tmp_path / "gone.jsonl")}}},
    }
    err = error_of(prepare_run, cfg_of(data), run_dir=str(run_dir), source="c.yaml")
    assert err.key_path == f"{TASKSET}.path" and "c.yaml" in str(err)
    data["buffer"] = DEFAULT_CONFIG["buffer"]
    data["model"] = {**data["model"], "max_response_tokens": 10**9}
    err = error_of(prepare_run, cfg_of(data), run_dir=str(run_dir))
    assert err.key_path == "model.max_response_tokens"
    assert not run_dir.exists()


# ------------------------------------------------------------------ the config file


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"\x7fELF\x02\x01\x01\x00\x00\x00", "NUL bytes"),
        (b"name: caf\xe9\n", "byte 9 (0xe9) is not UTF-8"),
        (b"name: a\x01b\n", "character #x0001 at position 7"),
    ],
)
def test_a_file_that_is_not_utf8_text_is_one_error_naming_it(
    tmp_path: Path, content: bytes, why: str
) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    err = error_of(load_config, path)
    assert str(path) in str(err) and "not a text file (UTF-8 YAML)" in str(err) and why in str(err)


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  max_response_tokens: 5\n bad: [\n")
    err = error_of(load_config, path)
    assert str(path) in str(err) and "YAML syntax error at line 3" in str(err)


def test_a_directory_is_one_error(tmp_path: Path) -> None:
    assert "cannot read config file" in str(error_of(load_config, tmp_path))


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_an_empty_file_warns_naming_it_and_runs_the_defaults(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.warns(ConfigWarning, match="is empty: the defaults run") as record:
        assert load_config(path) == Config()
    assert str(path) in str(record[0].message)


def test_a_file_with_keys_does_not_warn(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("name: x\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        assert load_config(path).name == "x"


# ------------------------------------------------------------------ the command line


@pytest.mark.smoke
@pytest.mark.parametrize(
    ("override", "key"),
    [("name=../../x", "`name`"), (f"{TASKSET}.path=/nonexistent/t.jsonl", f"`{TASKSET}.path`")],
)
def test_up_exits_2_with_one_line_and_writes_nothing(
    tmp_path: Path, override: str, key: str
) -> None:
    run_dir = tmp_path / "v1"
    proc = subprocess.run(
        [sys.executable, "-m", "rftstream.cli", "up", "--set", override, "--run-dir", str(run_dir)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2, lines
    assert len(lines) == 1 and lines[0].startswith("error:") and key in lines[0], lines
    assert not run_dir.exists() and not (tmp_path / "runs").exists()
