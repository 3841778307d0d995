"""Helpers shared by the integration and smoke tests."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from rftstream.experience import EID, Experience
from rftstream.wire import MetricsMsg


def small_config(tmp_path: Path, tiny_model_path: str, **over: object) -> dict:
    cfg: dict = {
        "name": "itest",
        "model": {"model_path": tiny_model_path, "max_response_tokens": 6},
        "buffer": {
            "batch_size": 2,
            "total_steps": 2,
            "total_epochs": 5,
            "explorer_input": {
                "taskset": {"path": "builtin:arithmetic", "rollout_args": {"max_tokens": 6}}
            },
        },
        "explorer": {"runner_num": 2},
        "synchronizer": {"sync_method": "checkpoint", "sync_style": "dynamic_by_explorer"},
        "algorithm": {"algorithm_type": "grpo", "repeat_times": 4, "optimizer": {"lr": 1e-3}},
        "trainer": {"ppo_micro_batch_size_per_gpu": 4},
        "run_dir": str(tmp_path / "run"),
    }
    for key, value in over.items():
        section, _, leaf = key.partition("__")
        cfg.setdefault(section, {})[leaf] = value
    return cfg


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


def user_env(tiny_model_path: str) -> dict[str, str]:
    """A user's shell for subprocesses: the shared tiny-model cache, and none of the
    torch.distributed variables this pytest process's own trainers set."""
    skip = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"}
    env = {k: v for k, v in os.environ.items() if k not in skip}
    env["RFTSTREAM_CACHE"] = str(Path(tiny_model_path).parent)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_actors_to_end(run: Any, url: str, *, timeout: float) -> list[dict[str, Any]]:
    """Run explorer, operator host and trainer until the trainer ends (at most ``timeout`` s);
    return the trainer's step records."""
    import anyio

    from rftstream.runtime import run_actors

    steps: list[dict[str, Any]] = []

    async def main() -> None:
        with anyio.fail_after(timeout):
            await run_actors(run, url, on_step=steps.append)

    anyio.run(main, backend="asyncio")
    return steps
