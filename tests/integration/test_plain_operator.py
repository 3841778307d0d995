"""examples/plain_nats_operator.py (a stage written with plain nats-py and msgspec) spliced into a
live run; then the run's real messages read by the two decoders in examples/decoders (Python
with msgspec, JavaScript with @msgpack/msgpack), neither importing rftstream, and checked
against rftstream's own decoder and the published JSON Schema."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import jsonschema
import msgspec
import pytest

from rftstream.config import config_from_dict
from rftstream.experience import decode_group, decode_group_msg
from rftstream.runtime import prepare_run, provision
from rftstream.wire_schema import json_view, published_schema
from tests.integration._util import (
    read_experiences,
    read_stream,
    run_actors_to_end,
    small_config,
    user_env,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "plain_nats_operator.py"
DECODERS = ROOT / "examples" / "decoders"


def test_plain_nats_operator_feeds_the_trainer(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    cfg = small_config(tmp_path, tiny_model_path, buffer__train_batch_size=8, buffer__total_steps=2)
    cfg["buffer"]["batch_size"] = 4
    cfg["data_processor"] = {"experience_pipeline": {"input_stage": "plain"}}
    run = prepare_run(config_from_dict(cfg))
    anyio.run(provision, run, nats_url, backend="asyncio")
    log = tmp_path / "plain.log"
    with open(log, "w") as out:
        op = subprocess.Popen(
            [sys.executable, str(SCRIPT), nats_url, "itest", "raw", "plain"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=user_env(tiny_model_path),
        )
    try:
        steps = run_actors_to_end(run, nats_url, timeout=240)
        op.wait(timeout=30)  # it stops by itself once the run is finished
    finally:
        if op.poll() is None:
            op.kill()
    assert op.returncode == 0, log.read_text()[-3000:]
    counts = json.loads(log.read_text().strip().splitlines()[-1])
    assert [r["step"] for r in steps] == [1, 2]

    async def check() -> None:
        raw = await read_stream(nats_url, "rft.itest.exp.raw")
        plain = await read_stream(nats_url, "rft.itest.exp.plain")
        train = await read_experiences(nats_url, "rft.itest.exp.train")
        assert counts["kept_groups"] == len(plain) and counts["kept_groups"] + counts[
            "dropped_groups"
        ] <= len(raw)
        # everything the trainer consumed passed the plain operator: no all-zero group, advantages set downstream
        groups: dict[str, list[float]] = {}
        for e in train:
            groups.setdefault(e.group_id, []).append(e.reward or 0.0)
            assert e.advantages is not None
        assert groups and all(any(r > 0 for r in rs) for rs in groups.values())
        plain_ids = {e.group_id for m in plain for e in decode_group(m.data)}
        assert set(groups) <= plain_ids

    anyio.run(check, backend="asyncio")
    bodies = anyio.run(_bodies, nats_url, backend="asyncio")
    check_decoders(tmp_path, bodies)
    check_nats_cli_view(nats_url)


def check_nats_cli_view(url: str) -> None:
    """tools/nats_cli_view.py on the finished run: what docs/monitoring.md says the NATS CLI
    shows (stream and consumer names, descriptions, metadata, KV keys, metrics bodies)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "nats_cli_view.py"), url, "itest"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    sections = {
        head: body.strip()
        for head, _, body in (
            part.partition("\n") for part in ("\n" + out.stdout).split("\n$ ")[1:]
        )
    }
    assert sections["nats stream ls --names"].split() == [
        f"RFT_ITEST_{s}" for s in ("DLQ", "EXP", "METRICS", "TASKS", "WEIGHTS")
    ]
    info = json.loads(sections["nats stream info RFT_ITEST_EXP --json"])
    assert info["config"]["metadata"]["rft.schema"] == "rft.experience.v1"
    assert info["config"]["description"].startswith("rftstream run itest: experience groups")
    assert set(info["state"]["subjects"]) >= {"rft.itest.exp.raw", "rft.itest.exp.train"}
    consumers = sections["nats consumer ls RFT_ITEST_EXP --names"].split()
    assert {"trainer", "op_plain_to_train", "plain_raw_to_plain"} <= set(consumers)
    trainer = json.loads(sections["nats consumer info RFT_ITEST_EXP trainer --json"])
    assert trainer["config"]["description"] == "run itest: the trainer reads exp.train"
    assert trainer["config"]["metadata"]["rft.role"] == "trainer"
    keys = sections["nats kv ls rft_itest_state"].split()
    assert {"status", "trainer.step", "weights.latest", "heartbeat.trainer"} <= set(keys)
    for line in sections["nats sub 'rft.itest.metrics.>' --raw"].splitlines():
        record = json.loads(line)
        assert record["schema"] == "rft.metrics.v1" and {"actor", "role", "step"} <= set(record)
    # the page shows these commands
    page = (ROOT / "docs" / "monitoring.md").read_text()
    for command in sections:
        assert f"$ {command.replace('itest', 'default').replace('ITEST', 'DEFAULT')}" in page


async def _bodies(url: str) -> list[bytes]:
    """The bodies of the run's messages on exp.train (advantages set) and exp.raw."""
    msgs = await read_stream(url, "rft.itest.exp.train") + await read_stream(
        url, "rft.itest.exp.raw"
    )
    return [bytes(m.data) for m in msgs]


def _expected(bodies: list[bytes]) -> list[dict]:
    """What rftstream's own decoder reads from ``bodies``, as the example decoders print it."""
    out = []
    for body in bodies:
        msg = decode_group_msg(body)
        for e in decode_group(body):
            out.append(
                {
                    "uid": e.eid.uid,
                    "group_id": msg.group_id,
                    "producer": msg.producer,
                    "prompt_length": e.prompt_length,
                    "reward": e.reward,
                    "model_version": e.model_version,
                    "tokens": e.tokens.tolist(),
                    "logprobs": None if e.logprobs is None else e.logprobs.tolist(),
                    "advantages": None if e.advantages is None else e.advantages.tolist(),
                    "action_mask": e.action_mask.int().tolist(),
                    "metrics": e.metrics,
                }
            )
    return out


def check_decoders(tmp_path: Path, bodies: list[bytes]) -> None:
    assert len(bodies) >= 4
    files = []
    for i, body in enumerate(bodies):
        path = tmp_path / f"body{i}.msgpack"
        path.write_bytes(body)
        files.append(str(path))
    expected = _expected(bodies)
    assert any(e["advantages"] is not None for e in expected)
    assert any(e["logprobs"] is not None for e in expected)

    # every real message is valid against the published schema
    validator = jsonschema.Draft202012Validator(json.loads(published_schema()))
    for body in bodies:
        validator.validate(json_view(msgspec.msgpack.decode(body)))

    # Python with msgspec, rftstream made unimportable
    blocker = (
        "import runpy, sys; sys.modules['rftstream'] = None; "
        f"sys.argv = ['decode_experience.py', *{files!r}]; "
        f"runpy.run_path({str(DECODERS / 'decode_experience.py')!r}, run_name='__main__')"
    )
    out = subprocess.run(
        [sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert [json.loads(line) for line in out.stdout.splitlines()] == expected

    # JavaScript with @msgpack/msgpack, installed from its lock file as a user would
    js = tmp_path / "js"
    js.mkdir()
    for name in ("package.json", "package-lock.json", "decode_experience.mjs"):
        shutil.copy(DECODERS / "js" / name, js / name)
    npm = subprocess.run(
        ["npm", "ci", "--no-audit", "--no-fund"],
        cwd=js,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert npm.returncode == 0, npm.stdout + npm.stderr
    out = subprocess.run(
        ["node", "decode_experience.mjs", *files],
        cwd=js,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert [json.loads(line) for line in out.stdout.splitlines()] == expected
