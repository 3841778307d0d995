"""Monitor backends (monitor.monitor_type): config checks, and what each backend wrote,
read back with the backend's own reader."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from rftstream.config import config_from_dict
from rftstream.config.masking import MASK, masked_config, masked_data
from rftstream.config.resolve import resolve_config
from rftstream.config.validate import validate_config
from rftstream.errors import ConfigError
from rftstream.monitors import MonitorSet, check_monitor_packages, monitor_types, scalar_metrics
from rftstream.monitors.mlflow_monitor import mlflow_metric_name, tracking_uri
from rftstream.monitors.wandb_monitor import wandb_mode
from tests.monitor_readback import mlflow_run, tensorboard_scalars, wandb_offline_run


def validated(monitor: dict, **root: object):
    cfg = config_from_dict({"monitor": monitor, **root})
    validate_config(cfg)
    return resolve_config(cfg)


# ------------------------------------------------------------------ config


def test_one_name_or_a_list_of_names() -> None:
    assert validated({"monitor_type": "tensorboard"}).monitor.monitor_type == "tensorboard"
    both = validated({"monitor_type": ["jsonl", "mlflow"]}).monitor.monitor_type
    assert monitor_types(both) == ("jsonl", "mlflow")
    # a one-name list reads as that name (code comparing with "none" keeps working)
    assert validated({"monitor_type": ["none"]}).monitor.monitor_type == "none"


@pytest.mark.parametrize(
    ("value", "key", "words"),
    [
        ("graphite", "monitor.monitor_type", "must be one of jsonl, tensorboard, wandb, mlflow"),
        (["jsonl", "swan"], "monitor.monitor_type[1]", "must be one of"),
        ([], "monitor.monitor_type", "non-empty list"),
        (["wandb", "wandb"], "monitor.monitor_type", "twice"),
        (["none", "jsonl"], "monitor.monitor_type", "give it alone"),
    ],
)
def test_bad_monitor_types_name_the_key(value: object, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        validated({"monitor_type": value})
    assert info.value.key_path == key
    assert words in str(info.value)


def test_monitor_args_must_be_read_by_a_chosen_backend() -> None:
    cfg = validated(
        {"monitor_type": ["wandb", "mlflow"], "monitor_args": {"uri": "x", "mode": "offline"}}
    )
    assert cfg.monitor.monitor_args == {"uri": "x", "mode": "offline"}
    with pytest.raises(ConfigError) as info:
        validated({"monitor_type": "tensorboard", "monitor_args": {"uri": "http://h:5000"}})
    assert info.value.key_path == "monitor.monitor_args.uri"
    assert "valid keys: none" in str(info.value)
    with pytest.raises(ConfigError) as info:
        validated({"monitor_type": "wandb", "monitor_args": {"projekt": "p"}})
    assert "valid keys: api_key, base_url, entity, mode, tags" in str(info.value)


def test_a_missing_package_names_the_key_and_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    check_monitor_packages(["jsonl", "tensorboard"])  # installed: no error
    with pytest.raises(ConfigError) as info:
        check_monitor_packages(["tensorboard", "mlflow"])
    assert info.value.key_path == "monitor.monitor_type"
    assert "pip install 'rftstream[mlflow]'" in str(info.value)


def test_scalar_metrics_keeps_finite_numbers_only() -> None:
    record = {"step": 3, "ts": 1.5, "a": 1, "b": 0.5, "c": None, "d": math.nan, "e": "x"}
    record.update({"f": True, "g": math.inf, "h": {"0": 1}})
    assert scalar_metrics(record) == {"a": 1.0, "b": 0.5}


def test_wandb_mode_follows_args_then_environment_then_the_key() -> None:
    assert wandb_mode({}, {}) == "offline"
    assert wandb_mode({}, {"WANDB_API_KEY": "k" * 40}) == "online"
    assert wandb_mode({"api_key": "k" * 40}, {}) == "online"
    assert wandb_mode({}, {"WANDB_MODE": "offline", "WANDB_API_KEY": "k"}) == "offline"
    assert wandb_mode({"mode": "disabled"}, {"WANDB_MODE": "online"}) == "disabled"
    with pytest.raises(ConfigError) as info:
        wandb_mode({"mode": "cloud"}, {})
    assert info.value.key_path == "monitor.monitor_args.mode"


def test_mlflow_names_and_tracking_uri(tmp_path: Path) -> None:
    assert mlflow_metric_name("eval/gsm8k/accuracy/best@4") == "eval/gsm8k/accuracy/best_at_4"
    assert mlflow_metric_name("a(b)/c d") == "a_b_/c d"
    assert tracking_uri({"uri": "http://h:5000"}, {"MLFLOW_TRACKING_URI": "x"}, tmp_path) == (
        "http://h:5000"
    )
    assert tracking_uri({}, {"MLFLOW_TRACKING_URI": "sqlite:///m.db"}, tmp_path) == "sqlite:///m.db"
    assert tracking_uri({}, {}, tmp_path) == f"file://{tmp_path.resolve()}/mlruns"


def test_secrets_are_masked() -> None:
    data = {
        "api_key": "sk-1",
        "hf_token": "hf_x",
        "max_tokens": 5,
        "nested": [{"password": "p", "url": "nats://me:pw@host:4222"}],
        "empty_api_key": "",
    }
    assert masked_data(data) == {
        "api_key": MASK,
        "hf_token": MASK,
        "max_tokens": 5,
        "nested": [{"password": MASK, "url": f"nats://me:{MASK}@host:4222"}],
        "empty_api_key": "",
    }
    cfg = config_from_dict({"monitor": {"monitor_type": "wandb", "monitor_args": {"api_key": "s"}}})
    assert masked_config(cfg)["monitor"]["monitor_args"] == {"api_key": MASK}


# ------------------------------------------------------------------ the backends


def test_every_backend_reads_back_the_same_steps_and_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # no key: wandb runs offline
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = validated(
        {"monitor_type": ["jsonl", "tensorboard", "wandb", "mlflow"]},
        project="proj",
        group="grp",
        name="mrun",
    )
    records = [
        {"step": s, "ts": 100.0 + s, "reward/mean": 0.25 * s, "eval/t/accuracy/best@4": 1 / s}
        for s in (1, 2, 3)
    ]
    records[1]["actor/pg_loss"] = None  # a step without a value: no point anywhere
    monitors = MonitorSet.open(cfg, tmp_path, "trainer")
    assert [m.name for m in monitors.monitors] == ["tensorboard", "wandb", "mlflow"]
    for r in records:
        monitors.log(r, r["step"])
    monitors.log({"step": 4, "actor/pg_loss": -0.5}, 4)
    monitors.close()
    expected_reward = [(1, 0.25), (2, 0.5), (3, 0.75)]
    expected_eval = [(1, 1.0), (2, 0.5), (3, 1 / 3)]

    tb = tensorboard_scalars(tmp_path / "tensorboard" / "trainer")
    assert [s for s, _ in tb["reward/mean"]] == [1, 2, 3]
    assert [v for _, v in tb["reward/mean"]] == pytest.approx([0.25, 0.5, 0.75])  # float32
    assert tb["eval/t/accuracy/best@4"][2][1] == pytest.approx(1 / 3, rel=1e-6)
    assert tb["actor/pg_loss"] == [(4, -0.5)]

    wb = wandb_offline_run(tmp_path)
    assert (wb["project"], wb["group"], wb["name"]) == ("proj", "grp", "mrun_trainer")
    assert "trainer" in wb["tags"]
    assert wb["config"]["monitor"]["monitor_type"] == ["jsonl", "tensorboard", "wandb", "mlflow"]
    rows = [r for r in wb["history"] if "reward/mean" in r]
    assert [(r["_step"], r["reward/mean"]) for r in rows] == expected_reward
    assert [(r["_step"], r["eval/t/accuracy/best@4"]) for r in rows] == expected_eval
    assert [r["_step"] for r in wb["history"] if "actor/pg_loss" in r] == [4]

    ml = mlflow_run(tmp_path / "mlruns", "proj")
    assert (ml["name"], ml["status"]) == ("mrun_trainer", "FINISHED")
    assert (ml["tags"]["group"], ml["tags"]["role"]) == ("grp", "trainer")
    assert ml["metrics"]["reward/mean"] == expected_reward
    assert ml["metrics"]["eval/t/accuracy/best_at_4"] == expected_eval
    assert ml["metrics"]["actor/pg_loss"] == [(4, -0.5)]
    assert ml["config"]["project"] == "proj"

    out, err = capfd.readouterr()
    assert "wandb" not in out + err  # no banners, no "wandb:" lines on the terminal


def test_a_failing_backend_is_dropped_and_the_others_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from rftstream.monitors.base import Monitor

    class Broken(Monitor):
        name = "broken"

        def log(self, metrics, step):  # type: ignore[no-untyped-def]
            raise OSError("disk full")

        def close(self) -> None:
            self.closed = True

    class Keeping(Monitor):
        name = "keeping"

        def __init__(self) -> None:
            self.seen: list[tuple[int, dict]] = []

        def log(self, metrics, step):  # type: ignore[no-untyped-def]
            self.seen.append((step, dict(metrics)))

        def close(self) -> None:
            pass

    broken, keeping = Broken.__new__(Broken), Keeping()
    monitors = MonitorSet([broken, keeping])
    monitors.log({"step": 1, "x": 1.0}, 1)
    monitors.log({"step": 2, "x": 2.0}, 2)
    assert keeping.seen == [(1, {"x": 1.0}), (2, {"x": 2.0})]
    assert monitors.monitors == [keeping] and broken.closed
    assert "monitor broken failed at step 1" in caplog.text and "disk full" in caplog.text
