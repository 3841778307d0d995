"""Units: the studio's Run and Stop (``/api/launch``) with a stand-in for ``rftstream up``.

The launcher's interpreter is a small shell script standing in for ``python -m
rftstream.cli up``: it prints its arguments and waits until SIGINT (then exits 130,
as ``up`` does), or fails at once. The real ``up`` is started from the page in
``tests/smoke/test_studio.py``. No NATS server: the studio's URL refuses connections,
so a started run gets the embedded server of its ``up`` (no ``--nats-url``).
"""

from __future__ import annotations

import stat
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from rftstream.presentation.plot import RAW_ALPHA, ema, smoothing_alpha
from rftstream.run_lock import RunLock
from rftstream.studio.launcher import Launcher, outcome_of
from rftstream.studio.live import smoothed_curve
from rftstream.studio.server import Studio, make_app

WAITS_FOR_SIGINT = """#!/bin/sh
trap 'echo "fake up: stopping"; exit 130' INT
echo "fake up: $@"
while true; do sleep 0.05; done
"""
FAILS = """#!/bin/sh
echo "fake up: $@"
echo "error: config key model.model_path: no such model" >&2
exit 2
"""


def _script(tmp_path: Path, text: str) -> str:
    path = tmp_path / "fake-python"
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _with_client(
    launcher: Launcher, body: Callable[[TestClient[Any, Any]], Awaitable[None]]
) -> None:
    async def main() -> None:
        studio = Studio("nats://127.0.0.1:1", launcher=launcher)
        client = TestClient(TestServer(make_app(studio)))
        await client.start_server()
        try:
            await body(client)
        finally:
            await client.close()  # the app's cleanup stops a run still running

    anyio.run(main, backend="asyncio")


async def _json(client: TestClient[Any, Any], method: str, url: str, body: Any = None) -> Any:
    resp = await client.request(method, url, json=body)
    return resp.status, await resp.json()


async def _until(
    client: TestClient[Any, Any], done: str | Callable[[Any], bool], timeout: float = 10
) -> Any:
    """The launch once it is in state ``done`` (or ``done(launch)`` holds), or at ``timeout``."""
    holds = (lambda launch: launch["state"] == done) if isinstance(done, str) else done
    deadline = time.monotonic() + timeout
    while True:
        _, out = await _json(client, "GET", "/api/launch")
        if holds(out["launch"]) or time.monotonic() > deadline:
            return out["launch"]
        await anyio.sleep(0.05)


def test_run_starts_up_refuses_a_second_start_and_stop_sends_sigint(tmp_path: Path) -> None:
    launcher = Launcher(python=_script(tmp_path, WAITS_FOR_SIGINT), folder=tmp_path / "studio")
    run_dir = tmp_path / "run"
    values = {"name": "Launch-Test", "run_dir": str(run_dir), "buffer.total_steps": "2"}

    async def body(client: TestClient[Any, Any]) -> None:
        status, out = await _json(client, "GET", "/api/launch")
        assert status == 200 and out == {"ok": True, "launch": None}
        status, out = await _json(client, "POST", "/api/launch/stop")
        assert status == 409 and out["error"] == "no run started from the studio is running"

        status, out = await _json(client, "POST", "/api/launch", {"values": values})
        assert status == 200 and out["ok"], out
        launch = out["launch"]
        assert launch["run"] == "launch_test" and launch["live_url"] == "/live?run=launch_test"
        assert launch["state"] == "running" and launch["exit_code"] is None
        assert launch["run_dir"] == str(run_dir)
        # the checked YAML, written to the studio's folder and passed with the run dir
        config = Path(launch["config_path"])
        assert config.parent == tmp_path / "studio"
        assert yaml.safe_load(await anyio.Path(config).read_text()) == {
            "name": "Launch-Test",
            "run_dir": str(run_dir),
            "buffer": {"total_steps": 2},
        }
        assert launch["command"].endswith(
            f"-m rftstream.cli up --config {config} --run-dir {run_dir}"
        )
        # no NATS server at the studio's URL: up starts its own (no --nats-url)
        assert launch["nats"] == "embedded" and "not reachable" in launch["nats_note"]
        assert launch["continue_command"] == (f"rftstream up --config {config} --run-dir {run_dir}")

        # a second start while it runs: refused, naming the running one; nothing started
        status, out = await _json(client, "POST", "/api/launch", {"values": {"name": "other"}})
        assert status == 409 and not out["ok"]
        assert "a run started from the studio is running: Launch-Test" in out["error"]
        assert "one at a time" in out["error"] and out["launch"]["pid"] == launch["pid"]
        # the run is listed for the live view although the studio's server is down
        status, out = await _json(client, "GET", "/api/runs")
        assert status == 200 and out["runs"][0]["run"] == "launch_test"
        assert "nats://127.0.0.1:1" in out["nats_error"]
        # the live view explains it cannot read the embedded server yet (no run.lock)
        status, out = await _json(client, "GET", "/api/runs/launch_test")
        assert status == 502 and "rftstream up is starting" in out["error"]

        running = await _until(client, "running")
        assert "fake up: -m rftstream.cli up --config" in running["tail"]
        status, out = await _json(client, "POST", "/api/launch/stop")
        assert status == 200 and out["launch"]["state"] in ("stopping", "exited")
        ended = await _until(client, "exited")
        assert ended["exit_code"] == 130 and ended["outcome"] == "stopped"
        assert "fake up: stopping" in ended["tail"]  # the script got SIGINT
        status, out = await _json(client, "POST", "/api/launch/stop")
        assert status == 409 and out["launch"]["exit_code"] == 130

        # once it ended, a new start is accepted (--fresh passed on)
        status, out = await _json(client, "POST", "/api/launch", {"values": values, "fresh": True})
        assert status == 200 and out["launch"]["command"].endswith("--fresh")
        assert "--fresh" not in out["launch"]["continue_command"]
        # its trap is set (it echoes after setting it): the SIGINT at the studio's close
        # must find it, not a shell still starting
        second = await _until(client, lambda launch: "fake up:" in launch["tail"])
        assert "fake up:" in second["tail"], second

    _with_client(launcher, body)
    # the app's cleanup stopped the second run (SIGINT) when the studio closed
    assert launcher.current is not None and launcher.current.exit_code() == 130


def test_bad_configs_and_early_failures_are_reported(tmp_path: Path) -> None:
    launcher = Launcher(python=_script(tmp_path, FAILS), folder=tmp_path / "studio")
    run_dir = tmp_path / "run"

    async def body(client: TestClient[Any, Any]) -> None:
        # a config that does not check: the field errors, nothing started
        bad = {"values": {"buffer.batch_size": "0", "run_dir": str(run_dir)}}
        status, out = await _json(client, "POST", "/api/launch", bad)
        assert status == 200 and not out["ok"] and "buffer.batch_size" in out["errors"]
        assert "launch" not in out and launcher.current is None

        # a run dir a live `up` holds: refused with its owner, nothing started
        lock = RunLock(run_dir).acquire()
        try:
            good = {"values": {"name": "fails", "run_dir": str(run_dir)}}
            status, out = await _json(client, "POST", "/api/launch", good)
            assert status == 409 and "is held by a live `rftstream up`" in out["error"]
            assert launcher.current is None
        finally:
            lock.release("stopped")

        # up exits non-zero at once: the state says failed, with the end of its output
        status, out = await _json(client, "POST", "/api/launch", good)
        assert status == 200 and out["ok"]
        ended = await _until(client, "exited")
        assert ended["exit_code"] == 2 and ended["outcome"] == "failed"
        assert "error: config key model.model_path: no such model" in ended["tail"]
        assert ended["lock_status"] is None  # the test's lock's record predates the launch
        status, out = await _json(client, "GET", "/api/runs/fails")
        assert status == 502 and "stopped with it (exit code 2)" in out["error"]

    _with_client(launcher, body)


def test_outcomes() -> None:
    assert [outcome_of(c) for c in (None, 0, 130, 1, 2, -9)] == [
        None,
        "finished",
        "stopped",
        "failed",
        "failed",
        "failed",
    ]


@pytest.mark.parametrize("n", [0, 2, 45, 300, 5000])
def test_the_reward_curve_is_smoothed_as_metrics_png_smooths_it(n: int) -> None:
    points = [[step, float(step % 7)] for step in range(1, n + 1)]
    out = smoothed_curve(points)
    alpha = smoothing_alpha(n)
    assert out["points"] == [
        [p[0], v] for p, v in zip(points, ema([p[1] for p in points], alpha), strict=True)
    ]
    assert out["raw_alpha"] == RAW_ALPHA
    # the span metrics.png names in its title: n / 30 steps, at least 1, at most 100
    assert out["span"] == round(min(100, max(1.0, n / 30)))
