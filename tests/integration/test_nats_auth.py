"""Secured NATS servers: token, user/password, nkey, creds (operator-mode JWTs) and TLS.

For each kind of auth a nats-server is started with it; a Bus connects with the
matching `nats.*` keys, provisions the run's streams and round-trips a message;
a wrong credential fails within seconds with one BusError naming the server and the
kind of auth (no secret in it). Accounts isolate runs that share a server.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats.js.errors
import nkeys
import pytest

from rftstream.bus.client import Bus
from rftstream.config.schema import NatsConfig, NatsTlsConfig
from rftstream.errors import BusError
from rftstream.experience import decode_group
from rftstream.nats_server.embedded import SMALL_RUNS_FILE_STORE, EmbeddedNatsServer
from rftstream.subjects import RunNames
from tests.integration._nats_auth import (
    ConfiguredNats,
    account_jwt,
    make_ca,
    make_cert,
    new_key,
    operator_jwt,
    user_creds,
)
from tests.integration._util import _group

pytestmark = pytest.mark.integration

NAMES = RunNames("auth")


def _cfg(**kw: Any) -> NatsConfig:
    return msgspec.structs.replace(NatsConfig(ack_wait=5.0), **kw)


async def _round_trip(url: str, cfg: NatsConfig, names: RunNames = NAMES) -> None:
    async with await Bus.connect(url, names, cfg, "t") as bus:
        await bus.provision()
        await bus.publish_group("raw", _group(3, 0.5), msg_id="g3")
        consumer = await bus.pull(names.exp_stream, names.stage_consumer("raw", "train"))
        (msg,) = await consumer.fetch(5, timeout=5)
        assert decode_group(msg.data)[0].eid.task == 3
        await msg.ack()


def _refused(url: str, cfg: NatsConfig, kind: str, secret: str | None = None) -> str:
    """Connect with a wrong credential: one BusError, in seconds, naming server and kind."""

    async def main() -> None:
        await Bus.connect(url, NAMES, cfg, "t")

    t0 = time.monotonic()
    with pytest.raises(BusError) as info:
        anyio.run(main, backend="asyncio")
    elapsed = time.monotonic() - t0
    text = str(info.value)
    assert elapsed < 8, f"took {elapsed:.1f} s"
    assert url.split("://")[1] in text and kind in text, text
    if secret:
        assert secret not in text
    return text


@pytest.fixture
def server(tmp_path: Path) -> Any:
    started: list[ConfiguredNats] = []

    def start(body: str, scheme: str = "nats") -> ConfiguredNats:
        srv = ConfiguredNats(tmp_path, body, scheme=scheme).start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


def test_token(server: Any) -> None:
    srv = server('authorization { token: "s3cret-token" }')
    anyio.run(_round_trip, srv.url, _cfg(token="s3cret-token"), backend="asyncio")
    text = _refused(srv.url, _cfg(token="wrong-token"), "token (nats.token)", "wrong-token")
    assert "refused the credentials" in text and "authorization violation" in text
    _refused(srv.url, _cfg(), "no credentials")


def test_user_password_and_the_cli_exit(server: Any, tmp_path: Path) -> None:
    srv = server('authorization { user: "rft", password: "pw-ok" }')
    anyio.run(_round_trip, srv.url, _cfg(user="rft", password="pw-ok"), backend="asyncio")
    text = _refused(srv.url, _cfg(user="rft", password="pw-bad"), "user/password", "pw-bad")
    assert "refused the credentials" in text
    # the CLI: one line naming server and kind, exit 2, no traceback, no secret
    conf = tmp_path / "run.yaml"
    conf.write_text("name: auth\nnats:\n  user: rft\n  password: ${oc.env:TEST_NATS_PW}\n")
    env = dict(os.environ, TEST_NATS_PW="pw-bad", PYTHONPATH=os.getcwd())
    t0 = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rftstream.cli",
            "status",
            "--config",
            str(conf),
            "--nats-url",
            srv.url,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 2, out
    both = out.stdout + out.stderr
    assert "Traceback" not in both and "pw-bad" not in both
    assert "refused the credentials" in both and srv.url.split("://")[1] in both
    assert time.monotonic() - t0 < 30


def test_nkey(server: Any, tmp_path: Path) -> None:
    user = new_key(nkeys.PREFIX_BYTE_USER)
    srv = server(f'authorization {{ users: [ {{ nkey: "{user.public_key.decode()}" }} ] }}')
    seed = tmp_path / "user.nk"
    seed.write_bytes(user.seed)
    anyio.run(_round_trip, srv.url, _cfg(nkey_seed=str(seed)), backend="asyncio")
    other = tmp_path / "other.nk"
    other.write_bytes(new_key(nkeys.PREFIX_BYTE_USER).seed)
    text = _refused(srv.url, _cfg(nkey_seed=str(other)), "nkey (nats.nkey_seed)")
    assert "refused the credentials" in text


def test_creds_in_operator_mode(server: Any, tmp_path: Path) -> None:
    op, acc = new_key(nkeys.PREFIX_BYTE_OPERATOR), new_key(nkeys.PREFIX_BYTE_ACCOUNT)
    sys_acc = new_key(nkeys.PREFIX_BYTE_ACCOUNT)  # JetStream needs a system account
    sys_pub, acc_pub = sys_acc.public_key.decode(), acc.public_key.decode()
    srv = server(
        f"operator: {operator_jwt(op)}\n"
        f"system_account: {sys_pub}\n"
        "resolver: MEMORY\n"
        f"resolver_preload: {{ {acc_pub}: {account_jwt(acc, op, 'A')}, "
        f"{sys_pub}: {account_jwt(sys_acc, op, 'SYS', jetstream=False)} }}\n"
    )
    creds = user_creds(new_key(nkeys.PREFIX_BYTE_USER), acc, tmp_path / "u.creds")
    anyio.run(_round_trip, srv.url, _cfg(creds=str(creds)), backend="asyncio")
    stranger = new_key(nkeys.PREFIX_BYTE_ACCOUNT)  # an account the server does not know
    bad = user_creds(new_key(nkeys.PREFIX_BYTE_USER), stranger, tmp_path / "bad.creds")
    text = _refused(srv.url, _cfg(creds=str(bad)), "credentials file (nats.creds)")
    assert "refused the credentials" in text


def test_tls_with_client_certificates(server: Any, tmp_path: Path) -> None:
    ca = make_ca(tmp_path, "ca")
    srv_cert = make_cert(tmp_path, "server", ca, "subjectAltName=IP:127.0.0.1")
    client = make_cert(tmp_path, "client", ca, "extendedKeyUsage=clientAuth")
    srv = server(
        f'tls {{ cert_file: "{srv_cert[0]}", key_file: "{srv_cert[1]}", '
        f'ca_file: "{ca[0]}", verify: true }}',
        scheme="tls",
    )
    good = _cfg(tls=NatsTlsConfig(ca=str(ca[0]), cert=str(client[0]), key=str(client[1])))
    anyio.run(_round_trip, srv.url, good, backend="asyncio")
    other_ca = make_ca(tmp_path, "other-ca")  # does not sign the server's certificate
    untrusted = msgspec.structs.replace(
        good, tls=msgspec.structs.replace(good.tls, ca=str(other_ca[0]))
    )
    text = _refused(srv.url, untrusted, "TLS client certificate")
    assert "certificate is not trusted" in text and "other-ca.pem" in text


def test_accounts_isolate_runs_sharing_a_server(server: Any, tmp_path: Path) -> None:
    srv = server(
        "accounts {\n"
        '  A: { jetstream: enabled, users: [ { user: "a", password: "pa" } ] }\n'
        '  B: { jetstream: enabled, users: [ { user: "b", password: "pb" } ] }\n'
        "}\n"
    )
    run_b = RunNames("runb")
    as_a, as_b = _cfg(user="a", password="pa"), _cfg(user="b", password="pb")

    async def main() -> None:
        await _round_trip(srv.url, as_b, run_b)
        async with await Bus.connect(srv.url, run_b, as_a, "intruder") as bus:
            with pytest.raises(nats.js.errors.NotFoundError):
                await bus.transport.js.stream_info(run_b.exp_stream)
            assert [s.config.name for s in await bus.transport.js.streams_info()] == []
        async with await Bus.connect(srv.url, run_b, as_b, "owner") as bus:
            info = await bus.transport.js.stream_info(run_b.exp_stream)
            assert info.state.messages == 1

    anyio.run(main, backend="asyncio")
    conf = tmp_path / "b.yaml"
    conf.write_text("name: runb\nnats:\n  user: a\n  password: pa\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rftstream.cli",
            "tail",
            "raw",
            "--no-follow",
            "--config",
            str(conf),
            "--nats-url",
            srv.url,
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
        timeout=60,
    )
    both = out.stdout + out.stderr
    assert out.returncode == 2 and "Traceback" not in both, both
    assert "run runb has no state on this server" in both and "another account" in both


def test_embedded_server_listens_on_loopback_only(tmp_path: Path) -> None:
    with EmbeddedNatsServer(tmp_path / "nats", max_file_store=SMALL_RUNS_FILE_STORE) as srv:
        conf = (tmp_path / "nats" / "nats-server.conf").read_text()
        assert f"listen: 127.0.0.1:{srv.port}\n" in conf
        assert srv.url.startswith("nats://127.0.0.1:")
        listening = Path("/proc/net/tcp").read_text().splitlines()[1:]
        mine = [ln.split() for ln in listening if ln.split()[1].endswith(f":{srv.port:04X}")]
        assert mine and all(fields[1].startswith("0100007F:") for fields in mine)
