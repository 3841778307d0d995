"""`nats` security keys: validation errors name the key (never the secret); secrets are
masked in `config explain` and kept out of the config file written for actor processes."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from rftstream.bus.jetstream.connect import connect_options, secrets_to_env, server_urls
from rftstream.config import load_config
from rftstream.config.explain import explain_file
from rftstream.config.loader import dump_config_yaml
from rftstream.config.schema import NatsConfig
from rftstream.config.secrets import redact_url
from rftstream.errors import ConfigError


def test_missing_files_and_conflicts_name_the_key(tmp_path: Path) -> None:
    for key in ("creds", "nkey_seed"):
        with pytest.raises(ConfigError, match=f"`nats.{key}`: file not found"):
            load_config(None, [f"nats.{key}={tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match="`nats.tls.ca`: file not found"):
        load_config(None, [f"nats.tls.ca={tmp_path / 'ca.pem'}"])
    with pytest.raises(ConfigError, match="`nats.servers`: give either"):
        load_config(None, ["nats.url=nats://a:4222", "nats.servers=[nats://b:4222]"])
    with pytest.raises(ConfigError, match="`nats.password`: is set without nats.user") as info:
        load_config(None, ["nats.password=hunter2"])
    assert "hunter2" not in str(info.value)
    with pytest.raises(ConfigError, match="`nats.reconnect_window`: must be > 0"):
        load_config(None, ["nats.reconnect_window=0"])


def test_secrets_are_masked_and_moved_to_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MY_PW", "hunter2")
    conf = tmp_path / "c.yaml"
    conf.write_text(
        "nats:\n  url: nats://u:urlpw@h:4222\n  user: u\n  password: ${oc.env:MY_PW}\n"
        "  token: tok-123\n"
    )
    lines, errors = explain_file(str(conf))
    text = "\n".join(lines + errors)
    assert "nats.password = '***'" in text and "nats.token = '***'" in text
    assert "hunter2" not in text and "tok-123" not in text and "urlpw" not in text
    cfg = load_config(str(conf))
    assert cfg.nats.password == "hunter2"
    nats_cfg, env = secrets_to_env(cfg.nats)
    assert env == {"RFTSTREAM_NATS_PASSWORD": "hunter2", "RFTSTREAM_NATS_TOKEN": "tok-123"}
    written = tmp_path / "config.yaml"
    written.write_text(dump_config_yaml(msgspec.structs.replace(cfg, nats=nats_cfg)))
    assert "hunter2" not in written.read_text() and "tok-123" not in written.read_text()
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert load_config(str(written)).nats == cfg.nats  # the child reads them back


def test_servers_and_options() -> None:
    assert server_urls(NatsConfig(servers=["nats://a:1", "nats://b:2"])) == [
        "nats://a:1",
        "nats://b:2",
    ]
    assert server_urls(NatsConfig(url="nats://a:1"), "nats://x:1, nats://y:2") == [
        "nats://x:1",
        "nats://y:2",
    ]
    opts = connect_options(NatsConfig(url="nats://a:1", user="u", password="p"), name="n")
    assert (opts["user"], opts["password"], opts["servers"]) == ("u", "p", ["nats://a:1"])
    assert "tls" not in opts
    assert "tls" in connect_options(NatsConfig(url="tls://a:1"), name="n")
    assert redact_url("nats://u:pw@h:1") == "nats://u:***@h:1"
    assert redact_url("nats://tok@h:1") == "nats://***@h:1"
