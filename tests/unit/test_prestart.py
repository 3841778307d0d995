"""Prestarted actor processes (rftstream.launch.prestart): handed a command line, or ended unused."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

from rftstream.launch import prestart


@pytest.fixture(autouse=True)
def _nothing_left_waiting() -> None:
    yield
    prestart.discard()


def test_a_child_never_taken_is_ended_by_discard() -> None:
    prestart.prestart({"operator": 1})  # a role with nothing to preload: waits at once
    waiting = prestart._waiting[0]
    assert "--await-args --roles operator" in " ".join(waiting.popen.args)
    assert waiting.popen.poll() is None
    t0 = time.monotonic()
    prestart.discard()
    assert waiting.popen.poll() is not None
    assert time.monotonic() - t0 < 5
    assert prestart.take("operator") is None


def test_take_gives_a_live_child_of_the_role_once() -> None:
    prestart.prestart({"operator": 1})
    assert prestart.take("explorer") is None
    child = prestart.take("operator")
    assert child is not None and child.popen.poll() is None
    assert prestart.take("operator") is None
    child.close()


def test_the_handed_command_line_runs_with_its_log_file(tmp_path: Path) -> None:
    """The child runs actor_process.main with the argv it is sent: here a config that
    does not exist, so it fails at once, naming it, in the log file it was told of."""
    prestart.prestart({"operator": 1})
    child = prestart.take("operator")
    assert child is not None
    log = tmp_path / "operator.log"
    missing = tmp_path / "nowhere.yaml"
    argv = ["--config", str(missing), "--nats-url", "nats://127.0.0.1:1"]
    argv += ["--run-dir", str(tmp_path), "--roles", "operator"]
    proc = child.hand_over(argv, {}, log)

    async def wait() -> int:
        with anyio.fail_after(120):
            return await proc.wait()

    code = anyio.run(wait)
    # a config error: the exit code that tells up not to restart it
    from rftstream.launch.actor_process import EXIT_NOT_MENDABLE

    assert code == EXIT_NOT_MENDABLE and proc.returncode == EXIT_NOT_MENDABLE
    text = log.read_text()
    assert "error:" in text and "nowhere.yaml" in text, text[-2000:]


def test_up_prestarts_its_explorers_from_the_config_read_before_plugins(
    tmp_path: Path,
) -> None:
    """``up`` starts one waiting explorer per rollout engine from the config as read
    without plugins; a config that cannot be read so starts none (and raises nothing:
    the load after the plugins reports it)."""
    import argparse

    from rftstream.cli import _prestart_explorers

    cfg = tmp_path / "two.yaml"
    cfg.write_text("explorer:\n  rollout_model:\n    engine_num: 2\n")
    _prestart_explorers(argparse.Namespace(config=str(cfg), set=[]))
    assert [c.role for c in prestart._waiting] == ["explorer", "explorer"]
    prestart.discard()
    _prestart_explorers(argparse.Namespace(config=str(tmp_path / "missing.yaml"), set=[]))
    _prestart_explorers(argparse.Namespace(config=None, set=["synchronizer.sync_method=memory"]))
    assert prestart._waiting == []  # no file; and memory sync runs every actor in one process
