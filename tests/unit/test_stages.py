"""Trinity-RFT ``stages``: combining, validation with stage key paths, explain, the stage runner."""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console

from rftstream.config import config_from_dict, load_config, load_stages, stages_from_dict
from rftstream.config.explain import explain_file
from rftstream.config.stages import StageConfigError, split_stages
from rftstream.config.trinity import TrinityConfigWarning
from rftstream.errors import ConfigError, RftError
from rftstream.launch.up_stages import StageFailed, final_checkpoint, run_stages

if sys.version_info < (3, 11):  # pragma: no cover - the backport anyio depends on there
    from exceptiongroup import ExceptionGroup


def _base() -> dict[str, Any]:
    return {
        "name": "warm",
        "model": {"model_path": "builtin:tiny", "max_response_tokens": 6},
        "algorithm": {"algorithm_type": "grpo", "repeat_times": 8, "optimizer": {"lr": 2e-4}},
        "buffer": {"batch_size": 2, "total_steps": 5},
        "trainer": {"save_interval": 3},
        "stages": [
            {
                "stage_name": "sft",
                "mode": "train",
                "algorithm": {"algorithm_type": "sft"},
                "buffer": {
                    "total_steps": 2,
                    "trainer_input": {"experience_buffer": {"path": "expert.jsonl"}},
                },
            },
            {"stage_name": "rl", "algorithm": {"algorithm_type": "grpo", "repeat_times": 4}},
        ],
    }


# --------------------------------------------------------------------------- combining


def test_a_stage_replaces_whole_sections_and_keeps_the_others() -> None:
    sft, rl = stages_from_dict(_base())
    # stage sft set algorithm without optimizer: the default lr, not the base's 2e-4
    assert sft.config.algorithm.algorithm_type == "sft"
    assert sft.config.algorithm.optimizer.lr == config_from_dict({}).algorithm.optimizer.lr
    assert sft.config.algorithm.optimizer.lr != 2e-4
    # its buffer replaced the base's: batch_size is the default, total_steps its own
    assert sft.config.buffer.total_steps == 2
    assert sft.config.buffer.batch_size == config_from_dict({}).buffer.batch_size
    assert sft.config.mode == "train"
    # sections it did not set are the base's
    assert sft.config.trainer.save_interval == 3
    assert sft.config.model.max_response_tokens == 6
    # stage rl replaced algorithm only: the base's buffer and mode
    assert (rl.config.algorithm.algorithm_type, rl.config.algorithm.repeat_times) == ("grpo", 4)
    assert rl.config.buffer.total_steps == 5 and rl.config.buffer.batch_size == 2
    assert rl.config.mode == "both"


def test_run_names_and_run_dirs_per_stage() -> None:
    data = _base()
    sft, rl = stages_from_dict(data)
    assert (sft.config.name, rl.config.name) == ("warm/sft", "warm/rl")
    assert (sft.index, rl.index, sft.count) == (0, 1, 2)
    data["run_dir"] = "/tmp/x"
    sft, rl = stages_from_dict(data)
    assert (sft.config.run_dir, rl.config.run_dir) == ("/tmp/x/sft", "/tmp/x/rl")
    del data["name"]
    assert stages_from_dict(data)[0].config.name == "default/sft"


def test_model_in_a_stage_is_merged_and_marks_its_own_model_path() -> None:
    data = _base()
    data["stages"][1]["model"] = {"model_path": "/models/other"}
    sft, rl = stages_from_dict(data)
    assert not sft.sets_model_path and rl.sets_model_path
    assert rl.config.model.model_path == "/models/other"
    assert rl.config.model.max_response_tokens == 6  # merged, not replaced
    data["stages"][1]["model"] = {"max_prompt_tokens": 32}
    assert not stages_from_dict(data)[1].sets_model_path


def test_no_stages_means_no_stage_runs_and_split_is_pure() -> None:
    assert split_stages({"name": "x"}) == []
    assert split_stages({"name": "x", "stages": []}) == []
    data = _base()
    before = copy.deepcopy(data)
    split_stages(data)
    assert data == before
    # an empty list is the plain config
    assert config_from_dict({"name": "x", "stages": []}).name == "x"


def test_overrides_reach_base_stage_sections_and_single_stages() -> None:
    sft, rl = stages_from_dict(_base(), ["buffer.total_steps=7", "name=other"])
    assert (sft.config.buffer.total_steps, rl.config.buffer.total_steps) == (7, 7)
    assert sft.config.name == "other/sft"
    sft, rl = stages_from_dict(_base(), ["stages[1].algorithm.repeat_times=2"])
    assert rl.config.algorithm.repeat_times == 2
    assert sft.config.algorithm.repeat_times != 2


def test_env_interpolation_per_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _base()
    data["stages"][1]["algorithm"]["repeat_times"] = "${oc.env:RFT_STAGE_REPEAT,3}"
    assert stages_from_dict(data)[1].config.algorithm.repeat_times == 3
    monkeypatch.setenv("RFT_STAGE_REPEAT", "6")
    assert stages_from_dict(data)[1].config.algorithm.repeat_times == 6


# --------------------------------------------------------------------------- errors


def _error(data: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        stages_from_dict(data, source="staged.yaml")
    return info.value


def test_errors_name_the_stage_key_path() -> None:
    data = _base()
    data["stages"][1]["algorithm"]["loss_agg_mode"] = "tokenmean"
    err = _error(data)
    assert isinstance(err, StageConfigError)
    assert err.key_path == "stages[1].algorithm.loss_agg_mode"
    assert "staged.yaml" in str(err) and "`stages[1].algorithm.loss_agg_mode`" in str(err)

    data = _base()
    data["stages"][0]["algorithm"]["repeat_times"] = "many"
    assert _error(data).key_path == "stages[0].algorithm.repeat_times"

    data = _base()
    data["stages"][1]["algorithm"]["advantage_fn_argz"] = {}
    err = _error(data)
    assert err.key_path == "stages[1].algorithm.advantage_fn_argz"
    assert "unknown key `stages[1].algorithm.advantage_fn_argz`" in str(err)
    assert "did you mean `advantage_fn_args`" in str(err)


def test_a_base_key_that_fails_in_a_stage_names_the_stage() -> None:
    data = _base()
    data["buffer"]["batch_size"] = 0  # stage sft replaces buffer; stage rl uses this one
    err = _error(data)
    assert err.key_path == "buffer.batch_size"
    assert "in stage `rl` (2/2, stages[1])" in str(err)


@pytest.mark.parametrize(
    ("stage", "path", "words"),
    [
        (
            {"stage_name": "a", "synchronizer": {}},
            "stages[0].synchronizer",
            "set `synchronizer` at the top level",
        ),
        ({"stage_name": "a", "explorr": {}}, "stages[0].explorr", "did you mean `explorer`"),
        ({"mode": "train"}, "stages[0].stage_name", "needs a `stage_name`"),
        ({"stage_name": "a/b"}, "stages[0].stage_name", "[A-Za-z0-9_.-]"),
        ("sft", "stages[0]", "must be a mapping"),
        ({"stage_name": "a", "model": "x"}, "stages[0].model", "must be a mapping"),
    ],
)
def test_malformed_stages(stage: Any, path: str, words: str) -> None:
    data = _base()
    data["stages"] = [stage]
    err = _error(data)
    assert err.key_path == path and words in str(err)


def test_stage_names_unique_and_stages_a_list() -> None:
    data = _base()
    data["stages"][1]["stage_name"] = "sft"
    err = _error(data)
    assert err.key_path == "stages[1].stage_name" and "stages[0] has it too" in str(err)
    data["stages"] = {"stage_name": "sft"}
    assert _error(data).key_path == "stages"


def test_load_config_refuses_a_staged_file(tmp_path: Path) -> None:
    path = tmp_path / "staged.yaml"
    path.write_text(yaml.safe_dump(_base()))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key_path == "stages" and "rftstream up" in str(info.value)
    assert [s.stage_name for s in load_stages(path)] == ["sft", "rl"]
    plain = tmp_path / "plain.yaml"
    plain.write_text("name: x\n")
    assert load_stages(plain) == []


def test_trinity_warnings_once_with_stage_paths() -> None:
    data = _base()
    data["explorer"] = {"runner_prepare_concurrency": 2}  # base: warned once, not per stage
    data["stages"][1]["trainer"] = {"save_strategy": "unrestricted"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stages_from_dict(data)
    texts = [str(w.message) for w in caught if issubclass(w.category, TrinityConfigWarning)]
    assert sum("`explorer.runner_prepare_concurrency`" in t for t in texts) == 1
    assert sum("`stages[1].trainer.save_strategy`" in t for t in texts) == 1


def test_explain_shows_the_stages(tmp_path: Path) -> None:
    data = _base()
    data["stages"][1]["algorithm"]["loss_agg_mode"] = "tokenmean"
    path = tmp_path / "staged.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    lines, errors = explain_file(str(path))
    text = "\n".join(lines)
    assert "stage `sft` (1/2, stages[0]): run `warm/sft`, sets mode, algorithm, buffer" in text
    assert "stage `rl` (2/2, stages[1]): run `warm/rl`, sets algorithm" in text
    assert "starts from the previous stage's final checkpoint" in text
    assert "  stages[0].algorithm.algorithm_type = 'sft'" in lines
    assert "model.model_path = 'builtin:tiny'" in lines
    assert len(errors) == 1 and "`stages[1].algorithm.loss_agg_mode`" in errors[0]


# --------------------------------------------------------------------------- the runner


class _Names:
    def __init__(self, name: str) -> None:
        self.display = name


class _Algorithm:
    name = "algo"


class _FakeRun:
    """What run_stages reads of a PreparedRun."""

    def __init__(self, cfg: Any, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.names = _Names(cfg.name)
        self.algorithm = _Algorithm()
        self.model_path = cfg.model.model_path


def _fake_stages(tmp_path: Path, **stage_model: str) -> list[Any]:
    """Three stages (sft, rl, rl2); ``s<i>=PATH`` sets stage i's own model.model_path."""
    data = _base()
    data["stages"].append({"stage_name": "rl2", "algorithm": {"algorithm_type": "grpo"}})
    for i, path in stage_model.items():
        data["stages"][int(i[1:])]["model"] = {"model_path": path}
    data["run_dir"] = str(tmp_path)
    return stages_from_dict(data)


def _save_checkpoint(run: _FakeRun, step: int) -> Path:
    path = run.run_dir / "checkpoints" / f"global_step_{step}"
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_each_stage_starts_from_the_previous_final_checkpoint(tmp_path: Path) -> None:
    stages = _fake_stages(tmp_path, s2="/models/own")
    prepared: list[tuple[str, str]] = []
    ran: list[str] = []
    saved: dict[str, Path] = {}

    def prepare(cfg: Any, stage: Any) -> _FakeRun:
        prepared.append((stage.stage_name, cfg.model.model_path))
        return _FakeRun(cfg, Path(cfg.run_dir))

    def run_up(run: _FakeRun) -> int:
        ran.append(run.cfg.name)
        _save_checkpoint(run, 1)
        saved[run.cfg.name] = _save_checkpoint(run, 10)  # the highest step is the final one
        (run.run_dir / "checkpoints" / "global_step_11").mkdir()  # no config.json: unfinished
        return 0

    console = Console(record=True, width=300)
    assert run_stages(stages, prepare=prepare, run_up=run_up, console=console) == 0
    assert ran == ["warm/sft", "warm/rl", "warm/rl2"]
    # every stage prepared first with its configured model, then each with what it starts from
    assert prepared[:3] == [("sft", "builtin:tiny"), ("rl", "builtin:tiny"), ("rl2", "/models/own")]
    assert prepared[3:] == [
        ("sft", "builtin:tiny"),
        ("rl", str(saved["warm/sft"])),
        ("rl2", "/models/own"),  # set by the stage itself
    ]
    out = console.export_text()
    assert "stage 2/3 rl starting" in out and "(stage `sft`'s final checkpoint)" in out
    assert "all 3 stages finished" in out


def test_a_failing_stage_stops_the_run_and_names_the_stage(tmp_path: Path) -> None:
    stages = _fake_stages(tmp_path)
    ran: list[str] = []

    def run_up(run: _FakeRun) -> int:
        ran.append(run.cfg.name)
        if run.cfg.name == "warm/rl":
            raise RftError("trainer: loss is nan")
        _save_checkpoint(run, 2)
        return 0

    with pytest.raises(StageFailed) as info:
        run_stages(
            stages,
            prepare=lambda cfg, stage: _FakeRun(cfg, Path(cfg.run_dir)),
            run_up=run_up,
            console=Console(record=True),
        )
    assert ran == ["warm/sft", "warm/rl"]
    assert "stage `rl` (2/3, stages[1]) failed: trainer: loss is nan" in str(info.value)


def test_an_exception_group_of_rft_errors_names_the_stage(tmp_path: Path) -> None:
    stages = _fake_stages(tmp_path)

    def run_up(run: _FakeRun) -> int:
        raise ExceptionGroup("actors", [RftError("explorer: workflow raised")])

    with pytest.raises(StageFailed, match=r"stage `sft` \(1/3, stages\[0\]\) failed: explorer"):
        run_stages(
            stages,
            prepare=lambda cfg, stage: _FakeRun(cfg, Path(cfg.run_dir)),
            run_up=run_up,
            console=Console(record=True),
        )


def test_a_stage_that_cannot_prepare_stops_before_any_runs(tmp_path: Path) -> None:
    stages = _fake_stages(tmp_path)
    ran: list[str] = []

    def prepare(cfg: Any, stage: Any) -> _FakeRun:
        if stage.stage_name == "rl2":
            raise ConfigError("algorithm.algorithm_type", "unknown algorithm", value="grpox")
        return _FakeRun(cfg, Path(cfg.run_dir))

    with pytest.raises(StageFailed, match=r"stage `rl2` \(3/3, stages\[2\]\) cannot start"):
        run_stages(
            stages, prepare=prepare, run_up=lambda r: ran.append("x") or 0, console=Console()
        )
    assert ran == []


def test_a_signal_stops_the_later_stages_and_a_missing_checkpoint_fails(tmp_path: Path) -> None:
    stages = _fake_stages(tmp_path)
    prepare = lambda cfg, stage: _FakeRun(cfg, Path(cfg.run_dir))  # noqa: E731
    ran: list[str] = []
    code = run_stages(
        stages, prepare=prepare, run_up=lambda r: ran.append(r.cfg.name) or 130, console=Console()
    )
    assert code == 130 and ran == ["warm/sft"]
    with pytest.raises(StageFailed, match="trained but left no checkpoint"):
        run_stages(stages, prepare=prepare, run_up=lambda r: 0, console=Console())


def test_final_checkpoint_picks_the_highest_complete_step(tmp_path: Path) -> None:
    cfg = stages_from_dict({**_base(), "run_dir": str(tmp_path)})[0].config
    run = _FakeRun(cfg, Path(cfg.run_dir))
    assert final_checkpoint(run) is None  # type: ignore[arg-type]
    for step in (2, 10, 9):
        _save_checkpoint(run, step)
    (run.run_dir / "checkpoints" / "global_step_12").mkdir()
    (run.run_dir / "checkpoints" / "latest").mkdir()
    assert final_checkpoint(run) == run.run_dir / "checkpoints" / "global_step_10"  # type: ignore[arg-type]


def test_up_refuses_a_bad_stage_before_running_any(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rftstream.cli import main

    data = _base()
    data["stages"][1]["algorithm"]["loss_agg_mode"] = "tokenmean"
    path = tmp_path / "staged.yaml"
    path.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    assert main(["up", "-c", str(path), "--run-dir", str(run_dir)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "`stages[1].algorithm.loss_agg_mode`" in out
    assert not run_dir.exists()  # stage sft never started
