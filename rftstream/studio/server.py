"""``rftstream studio``: an aiohttp server for the config page and the live view.

Routes: ``/`` the config page, ``/live`` the live view (``/live?run=RUN``), and
the JSON API they call: ``GET /api/schema`` (the form's sections),
``POST /api/config`` (values -> YAML and errors by key path), ``POST /api/save``
(the same, then the YAML written to ``path``), ``GET /api/runs`` and
``GET /api/runs/{run}`` (read from NATS). The pages are plain HTML and
JavaScript served from ``rftstream/studio/static``; nothing is fetched from
the internet.

The NATS connection is opened on the first live request and kept; a server that
cannot be reached gives an error the page shows, naming the URL.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from aiohttp import web

from rftstream.bus.transport import Transport
from rftstream.config.schema import NatsConfig
from rftstream.errors import BusError, RftError
from rftstream.studio.forms import check_form, form_sections
from rftstream.studio.live import MetricsReader, list_runs, run_snapshot

__all__ = ["STATIC_DIR", "Studio", "make_app", "serve"]

STATIC_DIR = Path(__file__).with_name("static")


class Studio:
    """The server's state: where NATS is, its connection once opened, the metrics read so far."""

    def __init__(self, nats_url: str, nats_cfg: NatsConfig | None = None) -> None:
        self.nats_url = nats_url
        self.nats_cfg = nats_cfg or NatsConfig()
        self.metrics = MetricsReader()
        self._transport: Transport | None = None
        self._lock = anyio.Lock()

    async def transport(self) -> Transport:
        """The studio's NATS connection (opened on first use). Raises :class:`BusError`
        naming the server when it cannot be reached."""
        from rftstream.bus.jetstream import connect_transport

        async with self._lock:
            if self._transport is None or self._transport.is_closed:
                self._transport = await connect_transport(
                    self.nats_cfg, self.nats_url, name="rftstream:studio", actor="studio"
                )
            return self._transport

    async def close(self) -> None:
        """Close the NATS connection, if open."""
        if self._transport is not None:
            await self._transport.close()


def _error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"ok": False, "error": message, **extra}, status=status)


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise web.HTTPBadRequest(text=f"the request body is not JSON: {exc}") from exc
    if not isinstance(body, dict) or not isinstance(body.get("values", {}), dict):
        raise web.HTTPBadRequest(text='the request body must be {"values": {key path: value}}')
    return body


def _check_json(values: dict[str, Any]) -> dict[str, Any]:
    check = check_form(values)
    return {
        "ok": check.ok,
        "yaml": check.yaml,
        "errors": check.errors,
        "general": check.general,
        "warnings": check.warnings,
    }


def _write_config(path_text: str, text: str) -> str:
    """Write ``text`` to ``path_text`` (``~`` expanded); the absolute path written.
    Raises ValueError naming the path when its folder is missing or not writable."""
    if not path_text.strip():
        raise ValueError("path: give a file path to save the config to")
    path = Path(path_text).expanduser().absolute()
    if not path.parent.is_dir():
        raise ValueError(f"path: folder {path.parent} does not exist")
    if path.is_dir():
        raise ValueError(f"path: {path} is a folder; give a file name (config.yaml)")
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"path: cannot write {path}: {exc.strerror or exc}") from exc
    return str(path)


def make_app(studio: Studio) -> web.Application:
    """The aiohttp application of ``studio`` (its NATS connection closed on cleanup)."""
    routes = web.RouteTableDef()

    @routes.get("/")
    async def config_page(_: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "config.html")

    @routes.get("/live")
    async def live_page(_: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "live.html")

    @routes.get("/api/schema")
    async def schema(_: web.Request) -> web.Response:
        sections = await anyio.to_thread.run_sync(form_sections)
        return web.json_response({"sections": [s.to_json() for s in sections]})

    @routes.post("/api/config")
    async def config(request: web.Request) -> web.Response:
        body = await _json_body(request)
        result = await anyio.to_thread.run_sync(_check_json, body.get("values", {}))
        return web.json_response(result)

    @routes.post("/api/save")
    async def save(request: web.Request) -> web.Response:
        body = await _json_body(request)
        result = await anyio.to_thread.run_sync(_check_json, body.get("values", {}))
        if not result["ok"]:
            return web.json_response(result)
        try:
            written = await anyio.to_thread.run_sync(
                _write_config, str(body.get("path") or ""), result["yaml"]
            )
        except ValueError as exc:
            return web.json_response({**result, "ok": False, "save_error": str(exc)})
        return web.json_response({**result, "saved": written})

    @routes.get("/api/runs")
    async def runs(_: web.Request) -> web.Response:
        try:
            return web.json_response(
                {
                    "ok": True,
                    "nats": studio.nats_url,
                    "runs": await list_runs(await studio.transport()),
                }
            )
        except RftError as exc:
            return _error(502, str(exc), nats=studio.nats_url)

    @routes.get("/api/runs/{run}")
    async def run(request: web.Request) -> web.Response:
        name = request.match_info["run"]
        try:
            snapshot = await run_snapshot(await studio.transport(), name, studio.metrics)
        except BusError as exc:
            return _error(404 if "no such run" in str(exc) else 502, str(exc))
        except RftError as exc:
            return _error(502, str(exc))
        return web.json_response({"ok": True, **snapshot})

    routes.static("/static", STATIC_DIR)
    app = web.Application()
    app.add_routes(routes)

    async def close_nats(_: web.Application) -> None:
        await studio.close()

    app.on_cleanup.append(close_nats)
    return app


def serve(
    host: str,
    port: int,
    nats_url: str,
    nats_cfg: NatsConfig | None = None,
    *,
    on_ready: Any = None,
) -> None:
    """Serve the studio on ``host:port`` until interrupted (blocks). ``on_ready(url)`` is
    called once it listens. Raises :class:`RftError` when the port cannot be bound."""
    import asyncio

    app = make_app(Studio(nats_url, nats_cfg))

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise RftError(
                f"studio: cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from exc
        bound = runner.addresses[0][1] if runner.addresses else port
        if on_ready is not None:
            on_ready(f"http://{host}:{bound}/")
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    asyncio.run(main())


def default_nats_url() -> str:
    """``$NATS_URL``, else the NATS default ``nats://127.0.0.1:4222``."""
    return os.environ.get("NATS_URL") or "nats://127.0.0.1:4222"
