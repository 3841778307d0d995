"""The run dir's lock, the continue-or-start-over decision, URL credentials and the
supervisor's restart policy (no NATS: files, a real flock, a child ``python`` process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from rftstream.config.secrets import split_url_credentials
from rftstream.errors import RftError
from rftstream.launch.actor_process import ActorProcess
from rftstream.launch.supervise import Supervisor, how_it_ended
from rftstream.run_lock import (
    RunDirBusy,
    RunLock,
    last_owner,
    live_owner,
    new_embedded_auth,
    read_embedded_auth,
)
from rftstream.run_start import claim_run_dir, runs_moved_aside


def test_a_held_dir_is_refused_naming_the_holder_and_free_once_released(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    lock = RunLock(run_dir).acquire()
    lock.update(url="nats://127.0.0.1:4999", server_pid=4242)
    owner = live_owner(run_dir)
    assert owner is not None and owner.pid == os.getpid() and owner.server_pid == 4242
    with pytest.raises(RunDirBusy) as refused:
        RunLock(run_dir).acquire()
    text = str(refused.value)
    assert f"pid {os.getpid()}" in text and "nats://127.0.0.1:4999" in text
    assert "nats-server pid 4242" in text and "nothing was written" in text
    lock.release("done")
    assert live_owner(run_dir) is None
    record = last_owner(run_dir)
    assert record is not None and record.status == "done" and record.ended


def test_a_killed_holder_frees_the_dir_at_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code = (
        "import sys, time; from rftstream.run_lock import RunLock; "
        f"lock = RunLock({str(run_dir)!r}).acquire(); print('held', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        assert live_owner(run_dir) is not None
        proc.kill()
        proc.wait(timeout=10)
        assert live_owner(run_dir) is None  # no heartbeat to age: the kernel dropped it
        lock = RunLock(run_dir).acquire()
        assert lock.previous is not None and lock.previous.status == "running"
        assert lock.previous.pid == proc.pid
        lock.release("done")
    finally:
        if proc.poll() is None:
            proc.kill()


def _earlier_run(run_dir: Path, status: str) -> None:
    lock = RunLock(run_dir).acquire()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "nats").mkdir()
    if status != "running":
        lock.release(status)  # type: ignore[arg-type]
    else:  # a crash: the record says running and nobody holds the lock
        lock._file.close()  # type: ignore[union-attr]


@pytest.mark.parametrize("status", ["running", "stopped", "failed"])
def test_an_unfinished_run_continues(tmp_path: Path, status: str) -> None:
    run_dir = tmp_path / "run"
    _earlier_run(run_dir, status)
    claim = claim_run_dir(run_dir)
    try:
        assert claim.continuing and claim.aside is None
        assert claim.note and "continuing the run" in claim.note and "--fresh" in claim.note
        assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
    finally:
        claim.lock.release("done")


def test_fresh_and_a_finished_run_move_the_earlier_run_aside(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _earlier_run(run_dir, "stopped")
    claim = claim_run_dir(run_dir, fresh=True)
    claim.lock.release("done")
    assert not claim.continuing and claim.aside is not None
    assert (claim.aside / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert json.loads((claim.aside / "run.lock").read_text())["status"] == "stopped"
    assert not (run_dir / "metrics.jsonl").exists() and (run_dir / "run.lock").exists()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')  # the new run, now finished
    again = claim_run_dir(run_dir)
    again.lock.release("done")
    assert not again.continuing and again.aside not in (None, claim.aside)
    assert again.note and "the earlier run had finished" in again.note
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("run.")]) == 2


def test_fresh_says_what_the_runs_moved_aside_hold(tmp_path: Path) -> None:
    """Each ``--fresh`` keeps the earlier run beside the directory; from the second on,
    the note says how many there are and how much they hold, so a filling disk has a
    named cause."""
    run_dir = tmp_path / "run"
    (tmp_path / "run.notes").mkdir()  # not a moved-aside run: not counted
    (tmp_path / "run.notes" / "big").write_bytes(b"x" * (3 << 20))
    for size in (1 << 20, 2 << 20):
        _earlier_run(run_dir, "stopped")
        (run_dir / "nats" / "blk").write_bytes(b"x" * size)
        claim = claim_run_dir(run_dir, fresh=True)
        claim.lock.release("done")
    assert claim.note and "2 earlier runs moved aside there hold 3 MiB" in claim.note
    assert "run.<time>" in claim.note
    assert runs_moved_aside(run_dir)[0] == 2
    assert runs_moved_aside(run_dir)[1] >= 3 << 20


def test_a_finished_stage_is_kept_as_it_is(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _earlier_run(run_dir, "done")
    claim = claim_run_dir(run_dir, keep_finished=True)
    claim.lock.release("done")
    assert claim.finished and not claim.continuing and claim.aside is None
    assert (run_dir / "metrics.jsonl").exists()


def test_an_unused_dir_is_a_new_run(tmp_path: Path) -> None:
    claim = claim_run_dir(tmp_path / "run")
    claim.lock.release("done")
    assert not claim.continuing and claim.note is None


def test_the_embedded_password_is_private(tmp_path: Path) -> None:
    auth = new_embedded_auth(tmp_path)
    path = tmp_path / "nats" / "password"
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_embedded_auth(tmp_path) == auth and len(auth.password) >= 20
    assert new_embedded_auth(tmp_path).password != auth.password  # one per start


def test_credentials_leave_the_urls() -> None:
    assert split_url_credentials("nats://u:p%40w@h:4222") == (
        "nats://h:4222",
        {"user": "u", "password": "p@w"},
    )
    assert split_url_credentials("tls://tok@h:4222,tls://tok@h2:4222") == (
        "tls://h:4222,tls://h2:4222",
        {"token": "tok"},
    )
    assert split_url_credentials("nats://h:4222") == ("nats://h:4222", {})


def test_credentials_in_nats_url_move_to_the_nats_keys() -> None:
    from rftstream.config import config_from_dict
    from rftstream.config.resolve import resolve_run

    cfg = resolve_run(config_from_dict({}), nats_url="nats://rft:s3cret@127.0.0.1:4222")
    assert cfg.nats.url == "nats://127.0.0.1:4222"
    assert (cfg.nats.user, cfg.nats.password) == ("rft", "s3cret")


class _Proc:
    """An ActorProcess stand-in whose exits are scripted."""

    def __init__(self, codes: list[int]) -> None:
        self.codes = codes
        self.name = "explorer"
        self.roles = ("explorer",)
        self.process = None
        self.log_path = Path("explorer.log")
        self.starts = 0

    async def wait(self) -> int:
        return self.codes.pop(0)

    failed = staticmethod(ActorProcess.failed)

    def failure(self, code: int) -> RftError:
        return RftError(f"the explorer process {how_it_ended(code)}")

    async def restart(self) -> None:
        self.starts += 1


def test_the_supervisor_restarts_until_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("rftstream.launch.supervise.BACKOFF_S", (0.0,))
    said: list[str] = []
    changes: list[int] = []
    sup = Supervisor(said.append, lambda: changes.append(1), max_restarts=2)
    ok = _Proc([-9, 1, 0])
    anyio.run(sup.child, ok, backend="asyncio")  # type: ignore[arg-type]
    assert ok.starts == 2 and len(changes) == 2
    assert "was killed by SIGKILL" in said[0] and "exited with code 1" in said[1]
    assert sup.summary() == "explorer 2"
    with pytest.raises(RftError, match="2 restarts did not keep it up"):
        anyio.run(sup.child, _Proc([-9]), backend="asyncio")  # type: ignore[arg-type]
    rank = Supervisor(said.append)
    with pytest.raises(RftError, match="exited with code 3"):
        anyio.run(lambda: rank.child(_Proc([3]), restart=False), backend="asyncio")  # type: ignore[arg-type]


def test_a_part_that_cannot_mend_by_restarting_is_not_restarted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A config error or missing credentials: the child exits EXIT_NOT_MENDABLE and the run
    ends with its error at once, not after every restart met it again."""
    from rftstream.launch.actor_process import EXIT_NOT_MENDABLE

    monkeypatch.setattr("rftstream.launch.supervise.BACKOFF_S", (0.0,))
    said: list[str] = []
    sup = Supervisor(said.append, max_restarts=5)
    proc = _Proc([EXIT_NOT_MENDABLE, 0])
    with pytest.raises(RftError, match=f"exited with code {EXIT_NOT_MENDABLE}"):
        anyio.run(sup.child, proc, backend="asyncio")  # type: ignore[arg-type]
    assert proc.starts == 0 and said == [] and sup.summary() is None


def test_errors_a_restart_meets_again_are_told_apart() -> None:
    from rftstream.errors import (
        ConfigError,
        CredentialsError,
        mendable_by_restart,
    )

    def grouped(exc: Exception) -> Exception:
        return ExceptionGroup("unhandled errors in a TaskGroup", [exc])  # noqa: F821 (3.11+)

    assert not mendable_by_restart(ConfigError("model.model_path", "no such directory"))
    assert not mendable_by_restart(grouped(grouped(CredentialsError("no api key"))))
    assert mendable_by_restart(grouped(ConnectionError("nats gone")))
    assert mendable_by_restart(RftError("lost"))


def test_how_it_ended() -> None:
    assert how_it_ended(-9) == "was killed by SIGKILL"
    assert how_it_ended(2) == "exited with code 2"
