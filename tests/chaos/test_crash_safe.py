"""``rftstream up`` as a crash-safe run: the whole run SIGKILLed at ten points and the
same command run again each time; each part of a live run killed; a second ``up`` on a
live run dir; secrets kept out of every command line, file and report.

Everything runs as a user would: ``rftstream up`` subprocesses on the tiny model with
the embedded nats-server (or an external one with a password), killed with SIGKILL
(a machine crash, the OOM killer). The pids come from the run dir's lock record
(``run.lock``), as an operator's script would read them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rftstream.fault_points import ENV as FREEZE_ENV
from rftstream.nats_server.embedded import find_nats_server, free_port
from tests.integration._util import (
    RFTSTREAM,
    descendants,
    small_config,
    user_env,
    write_config,
)

pytestmark = pytest.mark.integration

STEPS = 36
LONG_STEPS = 200  # the run whose parts are killed one by one
EVERY = 4  # trainer.save_interval


def _config(tmp: Path, tiny_model_path: str, name: str, **over: object) -> Path:
    settings: dict[str, object] = {
        "name": name,
        "buffer__total_steps": STEPS,
        "buffer__total_epochs": 50,
        "trainer__save_interval": EVERY,
        # max_staleness 1 paces the explorer by the trainer: the run lasts long enough for
        # the kills, and acked experience is purged while it runs (keep_acked_msgs small)
        "synchronizer__max_staleness": 1,
        "synchronizer__sync_method": "jetstream",
        "nats__ack_wait": 3.0,
        "nats__streams__experience__keep_acked_msgs": 8,
        # what is younger stays for the server's deduplication after a kill (the lost acks
        # are milliseconds old); the default 10 s would let the run train most of its steps
        # before the first purge, leaving too few for the kill points after it
        "nats__streams__experience__keep_acked_s": 2.0,
        "monitor": {"plot": False},
    }
    cfg = small_config(tmp, tiny_model_path, **{**settings, **over})
    cfg.pop("run_dir")
    return write_config(cfg, tmp / f"{name}.yaml")


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()]


def _lock(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "run.lock").read_text())
    except (OSError, ValueError):
        return {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"


class Up:
    """One ``rftstream up`` subprocess of the run config ``config`` in ``run_dir``."""

    def __init__(self, config: Path, run_dir: Path, env: dict[str, str], *extra: str) -> None:
        self.run_dir = run_dir
        self.out = run_dir.parent / f"up-{time.monotonic_ns()}.log"
        with open(self.out, "w") as log:
            self.proc = subprocess.Popen(
                [*RFTSTREAM, "up", "--config", str(config), "--run-dir", str(run_dir), *extra],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )

    @property
    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_for(self, what: str, cond: Callable[[], bool], timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while not cond():
            assert self.proc.poll() is None, (
                f"up exited {self.proc.returncode} waiting for {what}:\n{self.output[-4000:]}"
            )
            assert time.time() < deadline, f"timed out waiting for {what}:\n{self.output[-3000:]}"
            time.sleep(0.05)

    def wait_started(self) -> None:
        """Until this up holds the run dir (its pid in the lock record) and runs its server."""
        self.wait_for(
            "up to hold the run dir",
            lambda: (
                (r := _lock(self.run_dir)).get("pid") == self.proc.pid and bool(r.get("server_pid"))
            ),
        )

    def crash(self) -> list[int]:
        """SIGKILL the whole run at once: up, its nats-server and its children (from the
        lock record, which must be this up's)."""
        record = _lock(self.run_dir)
        assert record.get("pid") == self.proc.pid, record
        pids = [self.proc.pid, record.get("server_pid"), *record.get("children", [])]
        pids = [p for p in pids if p]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=10)
        return pids

    def finish(self, timeout: float = 300) -> str:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"up did not finish:\n{self.output[-4000:]}") from None
        assert self.proc.returncode == 0, self.output[-5000:]
        return self.output


def _account(run_dir: Path, config: Path, env: dict[str, str]) -> str:
    """``rftstream account`` of the finished embedded run (a private server on its store)."""
    proc = subprocess.run(
        [*RFTSTREAM, "account", "--config", str(config), "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc.stdout


def _assert_trained_once(run_dir: Path) -> None:
    assert _steps(run_dir) == list(range(1, STEPS + 1))
    rows = [json.loads(x) for x in (run_dir / "trained_uids.jsonl").read_text().splitlines()]
    uids = [u for row in rows for u in row["uids"]]
    steps_of: dict[str, list[int]] = {}
    for row in rows:
        for u in row["uids"]:
            steps_of.setdefault(u, []).append(row["step"])
    twice = {u: s for u, s in steps_of.items() if len(s) > 1}
    assert not twice, f"trained twice (uid: steps): {twice}"
    assert len(uids) == STEPS * 8


def test_a_run_killed_at_ten_points_continues_each_time_and_finishes(
    tmp_path: Path, tiny_model_path: str
) -> None:
    config = _config(tmp_path, tiny_model_path, "crashy")
    run_dir = tmp_path / "run"
    # the trainer compares its durable's ack floor with what it holds at every step
    env = {**user_env(tiny_model_path), "RFTSTREAM_ACKED_BELOW_EVERY_S": "0"}
    progress = [0]

    def after_steps(k: int) -> Callable[[Up], None]:
        def wait(up: Up) -> None:
            target = max(progress[0], *_steps(run_dir), 0) + k
            up.wait_for(f"step {target}", lambda: max(_steps(run_dir), default=0) >= target)
            progress[0] = max(_steps(run_dir))

        return wait

    def loading(up: Up) -> None:
        # the explorer and operator host are started (they load the model) and no step
        # of this up's is trained yet; a fixed sleep here let a fast start train 25 of
        # the 36 steps, and the purge point later found no purge left to freeze in
        done = max(_steps(run_dir), default=0)
        up.wait_for("the actor processes", lambda: len(_lock(run_dir).get("children", [])) == 2)
        assert max(_steps(run_dir), default=0) == done, "a step was trained before the kill"

    def server_restored(up: Up) -> None:
        # the server is listening: it has read its store back. Two restarts this close
        # after the kill in a purge: the operator host's last acks of raw messages were
        # lost, and it forwards those messages again only after the second one; their
        # first copies must still be stored for the server to refuse the repeats (the
        # purge keeps what an operator may forward again), or the account counts them twice
        up.wait_for("the embedded server", lambda: "NATS listening" in up.output)

    def frozen_at(point: str) -> tuple[str, Callable[[Up], None]]:
        marker = tmp_path / f"frozen-{point}"

        def wait(up: Up) -> None:
            up.wait_for(f"the run frozen in a {point}", marker.exists, timeout=180)

        return f"{point}:{marker}", wait

    checkpoint_freeze, in_checkpoint = frozen_at("checkpoint")
    purge_freeze, in_purge = frozen_at("purge")
    points: list[tuple[str, Callable[[Up], None], str | None]] = [
        ("while loading the model", loading, None),
        ("after a few steps", after_steps(3), None),
        ("while writing a checkpoint", in_checkpoint, checkpoint_freeze),
        ("mid-run", after_steps(3), None),
        ("while purging acked experience", in_purge, purge_freeze),
        ("right after the server restored its store", server_restored, None),
        ("mid-run again", after_steps(2), None),
        ("one step later", after_steps(1), None),
        ("right after a checkpoint", after_steps(EVERY), None),
        ("late in the run", after_steps(3), None),
    ]
    killed: list[str] = []
    for where, wait, freeze in points:
        up = Up(config, run_dir, {**env, FREEZE_ENV: freeze} if freeze else env)
        up.wait_started()
        wait(up)
        up.crash()
        killed.append(f"{where} (step {max(_steps(run_dir), default=0)})")
        if killed[1:]:
            assert "continuing the run" in up.output, up.output[-3000:]
        assert "replaced the earlier run" not in up.output
    assert (tmp_path / "frozen-checkpoint").exists() and (tmp_path / "frozen-purge").exists()
    up = Up(config, run_dir, env)
    output = up.finish(timeout=400)
    assert "continuing the run" in output
    assert re.search(r"done in \d+s: +36 trainer steps", output), output[-3000:]
    _assert_trained_once(run_dir)
    discarded = run_dir / "metrics.discarded.jsonl"
    assert discarded.exists()  # steps redone after a kill went there, not lost
    account = _account(run_dir, config, env)
    assert "BALANCED" in account and "NOT BALANCED" not in account, account
    assert len(killed) == 10, killed
    if "past durable trainer's ack floor are acked" in account:
        # a server restart left the trainer's floor behind its acks (not every run: it
        # depends on where the server was killed); the trainer saw it and recorded the
        # true floor, by which the explorers purge
        log_text = "\n".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
        assert re.search(r"ack floor is \d+ but everything on its subject below", log_text), account


def _cmdlines(pids: list[int] | None = None) -> list[str]:
    """The command lines of ``pids`` (None: every process on the machine); a process
    gone meanwhile is left out."""
    if pids is None:
        pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    out = []
    for pid in pids:
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            pass
    return out


def _files_holding(root: Path, secret: str, allowed: set[Path]) -> list[Path]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and path not in allowed:
            try:
                if secret.encode() in path.read_bytes():
                    found.append(path)
            except OSError:
                pass
    return found


def _refused_without_password(url: str) -> str:
    """What the server answers a client that connects without credentials (the raw NATS
    protocol: INFO, then CONNECT {} and PING)."""
    host, port = url.removeprefix("nats://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.recv(4096)  # INFO
        sock.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
        return sock.recv(4096).decode(errors="replace")


def test_each_part_killed_the_run_finishes_by_itself_and_a_second_up_harms_nothing(
    tmp_path: Path, tiny_model_path: str
) -> None:
    config = _config(
        tmp_path, tiny_model_path, "supervised", nats__ack_wait=4.0, buffer__total_steps=LONG_STEPS
    )
    run_dir = tmp_path / "run"
    env = user_env(tiny_model_path)
    up = Up(config, run_dir, env)
    up.wait_for("step 3", lambda: len(_steps(run_dir)) >= 3, timeout=180)
    record = _lock(run_dir)
    assert record["pid"] == up.proc.pid and len(record["children"]) == 2

    # a second up on the live dir: refused at once, naming the live run; nothing touched
    watched = ["config.yaml", "nats/nats-server.conf", "nats/password", "run.lock"]
    before = {name: (run_dir / name).read_bytes() for name in watched}
    logs_before = {p.name: p.stat().st_size for p in (run_dir / "logs").iterdir()}
    steps_before = len(_steps(run_dir))
    second = subprocess.run(
        [*RFTSTREAM, "up", "--config", str(config), "--run-dir", str(run_dir), "--steps", "5"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert second.returncode == 2, second.stdout + second.stderr
    assert f"pid {up.proc.pid}" in second.stdout and record["url"] in second.stdout
    assert {name: (run_dir / name).read_bytes() for name in watched} == before
    assert all((run_dir / "logs" / n).stat().st_size >= s for n, s in logs_before.items())
    assert len(_steps(run_dir)) >= steps_before
    servers = [c for c in _cmdlines() if "nats-server" in c and str(run_dir) in c]
    assert len(servers) == 1, servers

    # the embedded server: a password of its own, never on a command line
    password = (run_dir / "nats" / "password").read_text().strip()
    assert len(password) >= 20
    for name in ("nats/password", "nats/nats-server.conf", "config.yaml"):
        assert (run_dir / name).stat().st_mode & 0o077 == 0, name
    assert not [c for c in _cmdlines() if password in c]
    assert "Authorization Violation" in _refused_without_password(record["url"])

    # each part killed: explorer, operator host, the embedded nats-server
    for victim in ("explorer", "operator", "nats-server"):
        record = _lock(run_dir)
        pid = (
            record["server_pid"]
            if victim == "nats-server"
            else record["children"][0 if victim == "explorer" else 1]
        )
        now = len(_steps(run_dir))
        os.kill(pid, signal.SIGKILL)
        up.wait_for(f"{victim} restarted", lambda p=pid: not _alive(p), timeout=30)
        up.wait_for(
            f"training after the {victim} died",
            lambda n=now: len(_steps(run_dir)) >= min(n + 2, LONG_STEPS),
            timeout=180,
        )
    output = up.finish()
    assert _steps(run_dir) == list(range(1, LONG_STEPS + 1))
    for victim in ("explorer", "operator", "nats-server"):
        assert re.search(
            rf"the (embedded )?{victim}( process)? \(pid \d+\) was killed by SIGKILL", output
        ), (
            victim,
            output[-4000:],
        )
    assert re.search(r"restarted: +explorer 1, nats-server 1, operator 1", output), output[-3000:]
    assert (
        _files_holding(
            run_dir,
            password,
            {run_dir / "nats" / "password", run_dir / "nats" / "nats-server.conf"},
        )
        == []
    )
    account = _account(run_dir, config, env)
    assert "BALANCED" in account and "NOT BALANCED" not in account, account


def _auth_server(tmp: Path, user: str, password: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    conf = tmp / "auth-server.conf"
    conf.write_text(
        f"listen: 127.0.0.1:{port}\nmax_payload: 8388608\n"
        f'authorization {{ user: "{user}", password: "{password}" }}\n'
        f'jetstream {{ store_dir: "{tmp / "ext-store"}" }}\n'
    )
    proc = subprocess.Popen(
        [find_nats_server(), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"nats://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("nats-server did not start")


def test_a_password_in_the_nats_url_reaches_no_command_line_file_or_report(
    tmp_path: Path, tiny_model_path: str
) -> None:
    secret = "Sup3r-s3cret-pw-4711"
    server, url = _auth_server(tmp_path, "rft", secret)
    try:
        config = _config(tmp_path, tiny_model_path, "secret", buffer__total_steps=6)
        run_dir = tmp_path / "run"
        env = user_env(tiny_model_path)
        with_secret = url.replace("nats://", f"nats://rft:{secret}@")
        up = Up(config, run_dir, env, "--nats-url", with_secret)
        up.wait_for("step 1", lambda: len(_steps(run_dir)) >= 1, timeout=180)
        children = [
            c for c in _cmdlines(descendants(up.proc.pid)) if "rftstream.launch.actor_process" in c
        ]
        assert len(children) == 2, children
        leaking = [c for c in children if secret in c]
        assert not leaking, leaking
        output = up.finish()
        assert secret not in output
        assert _files_holding(run_dir, secret, set()) == []
        assert (run_dir / "report.html").exists()
        assert (run_dir / "config.yaml").stat().st_mode & 0o077 == 0
    finally:
        server.terminate()
        server.wait(timeout=10)
