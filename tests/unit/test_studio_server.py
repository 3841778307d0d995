"""Units: the studio's JSON API (aiohttp test server; no NATS needed for these routes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import yaml
from aiohttp.test_utils import TestClient, TestServer

from rftstream.studio.server import Studio, make_app


async def _call(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    client = TestClient(TestServer(make_app(Studio("nats://127.0.0.1:1"))))
    await client.start_server()
    try:
        resp = await client.request(method, url, json=body)
        kind = resp.headers.get("Content-Type", "")
        return resp.status, await (resp.json() if "json" in kind else resp.text())
    finally:
        await client.close()


def _run(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    return anyio.run(_call, method, url, body, backend="asyncio")


def test_save_writes_the_checked_yaml_and_names_a_bad_path(tmp_path: Path) -> None:
    target = tmp_path / "run.yaml"
    status, out = _run("POST", "/api/save", {"values": {"name": "x"}, "path": str(target)})
    assert status == 200 and out["ok"] and out["saved"] == str(target)
    assert yaml.safe_load(target.read_text()) == {"name": "x"}

    missing = tmp_path / "nope" / "run.yaml"
    _, out = _run("POST", "/api/save", {"values": {}, "path": str(missing)})
    assert not out["ok"] and out["save_error"] == f"path: folder {missing.parent} does not exist"
    _, out = _run("POST", "/api/save", {"values": {"buffer.batch_size": "0"}, "path": str(target)})
    assert not out["ok"] and "buffer.batch_size" in out["errors"]
    assert yaml.safe_load(target.read_text()) == {"name": "x"}  # an invalid config is not saved


def test_bad_requests_and_an_unreachable_nats_server_are_explained() -> None:
    status, text = _run("POST", "/api/config", {"values": ["not", "a", "mapping"]})
    assert status == 400 and "values" in text
    status, out = _run("GET", "/api/runs")
    assert status == 502 and not out["ok"]
    assert "nats://127.0.0.1:1" in out["error"] and out["nats"] == "nats://127.0.0.1:1"
