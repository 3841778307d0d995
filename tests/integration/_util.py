"""Helpers shared by the tests: the run configs they build (also for unit, smoke and chaos
tests), and reading back what an integration run left on a real nats-server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import nats
import yaml
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from rftstream.experience import EID, Experience, decode_group
from rftstream.nats_server.embedded import find_nats_server
from rftstream.wire import MetricsMsg

if TYPE_CHECKING:
    from rftstream.bus.client import Bus
    from rftstream.runtime import PreparedRun


def _run_sections(tiny_model_path: str, name: str, steps: int, epochs: int, lr: float) -> dict:
    """The sections every test run config shares: the tiny model on the builtin arithmetic
    taskset, batches of 2 tasks x 4 rollouts, GRPO, checkpoint sync paced by the explorer."""
    return {
        "name": name,
        "model": {"model_path": tiny_model_path, "max_response_tokens": 6},
        "buffer": {
            "batch_size": 2,
            "total_steps": steps,
            "total_epochs": epochs,
            "explorer_input": {
                "taskset": {"path": "builtin:arithmetic", "rollout_args": {"max_tokens": 6}}
            },
        },
        "explorer": {"runner_num": 2},
        "synchronizer": {"sync_method": "checkpoint", "sync_style": "dynamic_by_explorer"},
        "algorithm": {"algorithm_type": "grpo", "repeat_times": 4, "optimizer": {"lr": lr}},
    }


def _override(cfg: dict, over: dict[str, object]) -> dict:
    """Set each ``over`` item in ``cfg``: ``name="x"`` a top-level key,
    ``buffer__total_steps=3`` a key of a section, ``algorithm__optimizer__lr=1e-4`` one
    deeper; missing sections are created."""
    for key, value in over.items():
        *sections, leaf = key.split("__")
        node = cfg
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    return cfg


def small_config(tmp_path: Path, tiny_model_path: str, **over: object) -> dict:
    """A two-step in-process run ``itest`` with its run directory under ``tmp_path``;
    ``over`` as in :func:`_override`."""
    cfg = _run_sections(tiny_model_path, "itest", steps=2, epochs=5, lr=1e-3)
    cfg["trainer"] = {"ppo_micro_batch_size_per_gpu": 4}
    cfg["run_dir"] = str(tmp_path / "run")
    return _override(cfg, over)


def kl_entropy_config(
    tmp_path: Path, tiny_model_path: str, *, optimizer: dict[str, float], **algorithm: object
) -> dict:
    """:func:`small_config` for a trainer with a KL loss (``low_var_kl``, coefficient 0.5)
    and an entropy bonus (0.01): responses of up to 16 tokens, batches of 8, ``optimizer``
    the optimizer section; ``algorithm`` more (or other) algorithm keys."""
    cfg = small_config(tmp_path, tiny_model_path)
    cfg["model"]["max_response_tokens"] = 16
    cfg["buffer"]["train_batch_size"] = 8
    cfg["algorithm"].update(
        {
            "kl_loss_fn": "low_var_kl",
            "kl_loss_fn_args": {"kl_coef": 0.5},
            "entropy_loss_fn": "default",
            "entropy_loss_fn_args": {"entropy_coef": 0.01},
            "optimizer": optimizer,
            **algorithm,
        }
    )
    return cfg


def actor_config(
    tmp_path: Path,
    tiny_model_path: str,
    name: str,
    *,
    steps: int,
    max_staleness: int,
    **over: object,
) -> dict:
    """A run whose actors are separate processes (one ``rftstream <actor>`` command each)
    sharing checkpoints in ``tmp_path/shared-ckpt``; no run directory (each command gets
    its own ``--run-dir``). ``over`` as in :func:`_override`."""
    cfg = _run_sections(tiny_model_path, name, steps=steps, epochs=5, lr=1e-4)
    cfg["checkpoint_root_dir"] = str(tmp_path / "shared-ckpt")
    cfg["synchronizer"]["max_staleness"] = max_staleness
    return _override(cfg, over)


def sft_config(tmp_path: Path, tiny_model_path: str, name: str, *, rows: int, batch: int) -> dict:
    """A ``mode: train`` SFT run on ``rows`` chat rows ("i+i?" -> "2i") written to
    ``tmp_path/sft.jsonl``, ``batch`` rows a step, one epoch."""
    data = tmp_path / "sft.jsonl"
    chats = [
        {
            "messages": [
                {"role": "user", "content": f"{i}+{i}?"},
                {"role": "assistant", "content": str(2 * i)},
            ]
        }
        for i in range(rows)
    ]
    data.write_text("\n".join(json.dumps(c) for c in chats))
    return {
        "mode": "train",
        "name": name,
        "checkpoint_root_dir": str(tmp_path / "ckpt"),
        "algorithm": {"algorithm_type": "sft"},
        "model": {"model_path": tiny_model_path, "max_prompt_tokens": 32, "max_response_tokens": 8},
        "buffer": {
            "total_epochs": 1,
            "train_batch_size": batch,
            "trainer_input": {
                "experience_buffer": {
                    "storage_type": "file",
                    "path": str(data),
                    "format": {"prompt_type": "messages", "messages_key": "messages"},
                }
            },
        },
    }


def write_config(cfg: dict, path: Path) -> Path:
    """``cfg`` as YAML at ``path`` (what a user passes to ``--config``); returns ``path``."""
    path.write_text(yaml.safe_dump(cfg))
    return path


async def read_stream(url: str, subject: str) -> list:
    """Every message on ``subject`` (ordered consumer, from the start)."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    out = []
    sub = await js.subscribe(subject, ordered_consumer=True)
    while True:
        try:
            out.append(await sub.next_msg(timeout=1.0))
        except nats.errors.TimeoutError:
            break
    await nc.close()
    return out


async def read_metrics(url: str, subject: str) -> list[MetricsMsg]:
    """Every metrics record on ``subject`` (e.g. ``rft.<run>.metrics.>``), decoded."""
    return [msgspec.json.decode(m.data, type=MetricsMsg) for m in await read_stream(url, subject)]


async def read_experiences(url: str, subject: str) -> list[Experience]:
    """Every experience of every group message on ``subject``, in stream order."""
    return [e for m in await read_stream(url, subject) for e in decode_group(m.data)]


async def read_kv(url: str, bucket: str) -> dict[str, Any]:
    """Every key of the KV ``bucket`` with its JSON value, read with the plain nats client."""
    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream().key_value(bucket)
        return {key: json.loads((await kv.get(key)).value) for key in await kv.keys()}
    finally:
        await nc.close()


async def wait_drained(
    js: JetStreamContext,
    stream: str,
    durable: str,
    *,
    timeout: float = 90,
    missing_ok: bool = False,
    check: Callable[[], None] | None = None,
) -> None:
    """Poll until ``durable`` on ``stream`` has nothing pending and nothing unacked (every
    message delivered and acked); ``TimeoutError`` after ``timeout`` s.

    ``missing_ok``: a durable that does not exist yet (another process creates it) counts as
    not drained; otherwise its ``NotFoundError`` propagates. ``check`` runs before every poll
    (an assertion that the actors under test are still alive).
    """
    with anyio.fail_after(timeout):
        while True:
            if check is not None:
                check()
            try:
                info = await js.consumer_info(stream, durable)
            except NotFoundError:
                if not missing_ok:
                    raise
            else:
                if info.num_pending == 0 and info.num_ack_pending == 0:
                    return
            await anyio.sleep(0.1)


async def operate_until_drained(
    run: PreparedRun, url: str, bus: Bus, *, pipeline: Any = None, timeout: float = 90
) -> None:
    """Run an operator host (on ``pipeline``, or the run's own) until its raw -> train
    durable has every message acked (:func:`wait_drained`, ``TimeoutError`` after
    ``timeout`` s), then cancel it; ``bus`` is the test's own connection, used to poll."""
    from rftstream.runtime import run_operator

    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(run_operator, run, url, pipeline=pipeline))
        await wait_drained(
            bus.transport.js, run.names.exp_stream, "op_raw_to_train", timeout=timeout
        )
        tg.cancel_scope.cancel()


def _group(task: int, reward: float, n: int = 4) -> list[Experience]:
    return [
        Experience(
            tokens=[5, 6, 7, 8, 9],
            prompt_length=2,
            reward=reward,
            logprobs=[-1.0, -1.0, -1.0],
            advantages=[reward - 0.5] * 3,
            eid=EID(0, task, i),
        )
        for i in range(n)
    ]


def start_nats_server(port: int, store: Path) -> subprocess.Popen[bytes]:
    """``nats-server -js`` started the way a user would (not through rftstream) on
    127.0.0.1:``port`` with its JetStream store in ``store``. Blocks until the port
    accepts connections; ``RuntimeError`` if it does not within 10 s. The caller stops it."""
    proc = subprocess.Popen(
        [find_nats_server(), "-js", "-sd", str(store), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"nats-server did not listen on port {port}")


def wait_processes(
    procs: dict[str, subprocess.Popen[bytes]], logs: dict[str, Path], *, timeout: float = 300
) -> None:
    """Block (polling every 0.5 s) until every process in ``procs`` has exited 0. Fails the
    test as soon as one exits otherwise, rather than leaving the others waiting for it, and
    when one still runs after ``timeout`` s; the message holds that process's ``logs`` tail.
    Kills nothing: the caller's ``finally`` does."""
    deadline = time.time() + timeout
    while time.time() < deadline and any(p.poll() is None for p in procs.values()):
        for role, p in procs.items():
            assert p.poll() in (None, 0), (
                f"{role} exited {p.returncode}:\n{logs[role].read_text()[-4000:]}"
            )
        time.sleep(0.5)
    for role, p in procs.items():
        assert p.poll() == 0, f"{role} did not finish:\n{logs[role].read_text()[-4000:]}"


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def user_env(tiny_model_path: str) -> dict[str, str]:
    """A user's shell for subprocesses: the shared tiny-model cache, and none of the
    torch.distributed variables this pytest process's own trainers set."""
    skip = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"}
    env = {k: v for k, v in os.environ.items() if k not in skip}
    env["RFTSTREAM_CACHE"] = str(Path(tiny_model_path).parent)
    env["PYTHONUNBUFFERED"] = "1"
    return env


RFTSTREAM = [sys.executable, "-m", "rftstream.cli"]


def run_up(
    run_dir: Path, tiny_model_path: str, *args: str, timeout: float = 300
) -> tuple[str, list[dict[str, Any]]]:
    """``rftstream up --run-dir RUN_DIR ARGS`` in a user's shell (:func:`user_env`), as a
    subprocess. Asserts it exited 0 (the message holds the tails of its output); returns
    its stdout and the trainer's ``metrics.jsonl`` records (one per step). Blocks."""
    proc = subprocess.run(
        [*RFTSTREAM, "up", "--run-dir", str(run_dir), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=user_env(tiny_model_path),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return proc.stdout, [json.loads(x) for x in lines]


def run_actors_to_end(run: Any, url: str, *, timeout: float) -> list[dict[str, Any]]:
    """Run explorer, operator host and trainer until the trainer ends (at most ``timeout`` s);
    return the trainer's step records."""
    from rftstream.runtime import run_actors

    steps: list[dict[str, Any]] = []

    async def main() -> None:
        with anyio.fail_after(timeout):
            await run_actors(run, url, on_step=steps.append)

    anyio.run(main, backend="asyncio")
    return steps
