"""``rftstream studio``: an aiohttp server for the config page and the live view.

Routes: ``/`` the config page, ``/live`` the live view (``/live?run=RUN``), and
the JSON API they call: ``GET /api/schema`` (the form's sections),
``POST /api/config`` (values -> YAML and errors by key path), ``POST /api/save``
(the same, then the YAML written to ``path``), ``GET /api/runs`` and
``GET /api/runs/{run}`` (read from NATS), and the run the studio starts:
``POST /api/launch`` (the same check, then ``rftstream up`` on the checked config;
409 while one runs), ``GET /api/launch`` (its state, exit code and output) and
``POST /api/launch/stop`` (SIGINT, as Ctrl-C). The pages are plain HTML and
JavaScript served from ``rftstream/studio/static``; nothing is fetched from
the internet.

The NATS connection is opened on the first live request and kept; a server that
cannot be reached gives an error the page shows, naming the URL. A run started here
uses the studio's server when it is reachable (``up --nats-url``), else the config's
own servers, else the embedded server ``up`` starts in its run dir, which the live
view then reads (with the credential ``up`` writes there) while the run lives.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec
from aiohttp import web

from rftstream.bus.transport import Transport
from rftstream.config.schema import Config, NatsConfig
from rftstream.errors import BusError, RftError
from rftstream.run_lock import live_owner, read_embedded_auth
from rftstream.studio.forms import FormCheck, check_form, form_sections
from rftstream.studio.launcher import Launch, Launcher, LaunchError, NatsMode
from rftstream.studio.live import MetricsReader, list_runs, run_snapshot

__all__ = ["STATIC_DIR", "Studio", "make_app", "serve"]

STATIC_DIR = Path(__file__).with_name("static")


class Studio:
    """The server's state: where NATS is, its connection once opened, the metrics read so
    far, and the run it started (``launcher``; :class:`Launcher` with the studio's
    environment unless given)."""

    def __init__(
        self,
        nats_url: str,
        nats_cfg: NatsConfig | None = None,
        *,
        launcher: Launcher | None = None,
    ) -> None:
        self.nats_url = nats_url
        self.nats_cfg = nats_cfg or NatsConfig()
        self.metrics = MetricsReader()
        self.launcher = launcher or Launcher()
        self.launch_lock = anyio.Lock()  # one start at a time (its check and probe included)
        self._transport: Transport | None = None
        self._lock = anyio.Lock()
        # the connection to a launched run's own server: ((launch start, url), transport)
        self._run_transport: tuple[tuple[float, str], Transport] | None = None

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

    async def launch_target(self, config: Config) -> tuple[NatsMode, str, str]:
        """Where a run of ``config`` started here gets its NATS server: ``(mode, url,
        why)``. The config's own servers when it names any; else the studio's server when
        it answers (so the live view and ``rftstream status`` see the run as any other);
        else the embedded server ``up`` starts. Blocks while the studio's server is tried
        (at most its connect timeout); cancelling cancels that try."""
        nats = config.nats
        if nats.url or nats.servers:
            url = nats.url or ",".join(nats.servers)
            return "config", url, f"the config's NATS server ({url})"
        try:
            await self.transport()
        except RftError:
            return (
                "embedded",
                "",
                f"the studio's NATS server {self.nats_url} is not reachable: "
                "rftstream up starts its own in the run dir, which the live view reads "
                "while the run lives",
            )
        return "studio", self.nats_url, f"the studio's NATS server ({self.nats_url})"

    async def transport_for(self, run: str) -> Transport:
        """The connection the live view reads ``run`` with: the studio's, or for a run
        started here on another server, a connection to that one (the config's servers,
        or its embedded server found through the run dir's ``run.lock``, with the
        credential ``up`` wrote beside it), kept while that server stays the same.
        Raises :class:`BusError` saying why when that server is not up (the run is
        starting, or it ended and its embedded server with it)."""
        launch = self.launcher.current
        if launch is None or launch.run != run or launch.nats == "studio":
            return await self.transport()
        cfg = NatsConfig(connect_timeout=3.0)
        url: str | None = None
        if launch.nats == "config":
            cfg = launch.config.nats
        else:
            owner = live_owner(launch.run_dir)
            if owner is None or not owner.url:
                await self._drop_run_transport()  # its server stopped: no reconnecting
                raise BusError(_no_embedded_server(launch))
            url = owner.url
            auth = read_embedded_auth(launch.run_dir)
            if auth is not None:
                cfg = msgspec.structs.replace(
                    cfg, user=auth.user, password=auth.password, token="", creds=""
                )
        from rftstream.bus.jetstream import connect_transport

        key = (launch.started, url or "")
        async with self._lock:
            held = self._run_transport
            if held is not None and held[0] == key and not held[1].is_closed:
                return held[1]
            await self._drop_run_transport()
            transport = await connect_transport(cfg, url, name="rftstream:studio", actor="studio")
            self._run_transport = (key, transport)
            return transport

    async def _drop_run_transport(self) -> None:
        """Close the connection to a launched run's own server, if open."""
        held, self._run_transport = self._run_transport, None
        if held is not None:
            await held[1].close()

    async def close(self) -> None:
        """Close the NATS connections, if open."""
        if self._transport is not None:
            await self._transport.close()
        await self._drop_run_transport()


def _no_embedded_server(launch: Launch) -> str:
    """Why the live view cannot read ``launch``'s run on its embedded server now."""
    if launch.running():
        return (
            f"run {launch.run!r}: rftstream up is starting; its embedded NATS server is not up yet"
        )
    code = launch.exit_code()
    return (
        f"run {launch.run!r} ran on the embedded NATS server of its rftstream up, which "
        f"stopped with it (exit code {code}); its metrics are in "
        f"{launch.run_dir / 'metrics.jsonl'}"
    )


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
    return _check_result(check_form(values))


def _check_result(check: FormCheck) -> dict[str, Any]:
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
        launch = studio.launcher.current
        nats_error = None
        try:
            found = await list_runs(await studio.transport())
        except RftError as exc:
            if launch is None:
                return _error(502, str(exc), nats=studio.nats_url)
            found, nats_error = [], str(exc)  # the launched run may be on another server
        if launch is not None and not any(r["run"] == launch.run for r in found):
            found.insert(
                0,
                {
                    "run": launch.run,
                    "status": launch.state() if launch.running() else "ended",
                    "heartbeat_age": None,
                    "bytes": None,
                },
            )
        return web.json_response(
            {"ok": True, "nats": studio.nats_url, "runs": found, "nats_error": nats_error}
        )

    @routes.get("/api/runs/{run}")
    async def run(request: web.Request) -> web.Response:
        name = request.match_info["run"]
        try:
            transport = await studio.transport_for(name)
            snapshot = await run_snapshot(transport, name, studio.metrics)
        except BusError as exc:
            return _error(404 if "no such run" in str(exc) else 502, str(exc))
        except RftError as exc:
            return _error(502, str(exc))
        return web.json_response({"ok": True, **snapshot})

    @routes.get("/api/launch")
    async def launch_state(_: web.Request) -> web.Response:
        launch = studio.launcher.current
        return web.json_response({"ok": True, "launch": launch and launch.to_json()})

    @routes.post("/api/launch")
    async def launch_start(request: web.Request) -> web.Response:
        body = await _json_body(request)
        async with studio.launch_lock:
            busy = studio.launcher.running()
            if busy is not None:
                message = studio.launcher.busy_message(busy)
                return _error(409, message, launch=busy.to_json())
            check = await anyio.to_thread.run_sync(check_form, body.get("values", {}))
            result = _check_result(check)
            if not check.ok or check.config is None:
                return web.json_response(result)
            mode, url, note = await studio.launch_target(check.config)
            try:  # in the event loop's thread: see Launcher.start
                launched = studio.launcher.start(
                    check.config,
                    check.yaml,
                    nats=mode,
                    nats_url=url,
                    nats_note=note,
                    fresh=bool(body.get("fresh")),
                )
            except LaunchError as exc:  # LaunchBusy included: a start raced this one
                return web.json_response({**result, "ok": False, "error": str(exc)}, status=409)
            studio.metrics.forget(launched.run)  # a run of that name may have run before
            return web.json_response({**result, "launch": launched.to_json()})

    @routes.post("/api/launch/stop")
    async def launch_stop(_: web.Request) -> web.Response:
        try:
            launch = studio.launcher.stop()
        except LaunchError as exc:
            current = studio.launcher.current
            return _error(409, str(exc), launch=current and current.to_json())
        return web.json_response({"ok": True, "launch": launch.to_json()})

    routes.static("/static", STATIC_DIR)
    app = web.Application()
    app.add_routes(routes)

    async def close_nats(_: web.Application) -> None:
        await studio.close()

    async def stop_launch(_: web.Application) -> None:
        # the studio exits: its run stops as with Ctrl-C (waits for its clean shutdown)
        launch = studio.launcher.running()
        if launch is None:
            return
        print(
            f"studio: stopping run {launch.name} (SIGINT to rftstream up, pid {launch.pid})…",
            file=sys.stderr,
            flush=True,
        )
        code = await anyio.to_thread.run_sync(studio.launcher.shutdown)
        print(f"studio: run {launch.name} ended (exit code {code})", file=sys.stderr, flush=True)

    app.on_cleanup.append(stop_launch)
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
    called once it listens. Raises :class:`RftError` when the port cannot be bound.
    Interrupted (Ctrl-C), it first stops a run it started, as Ctrl-C stops ``up``
    (SIGINT), waiting up to :data:`~rftstream.studio.launcher.SHUTDOWN_WAIT_S` seconds
    for its clean shutdown."""
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
