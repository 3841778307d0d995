"""How rftstream connects to NATS: servers, credentials, TLS, the reconnect window.

:func:`connect_options` is the one place that turns a :class:`NatsConfig` (and an
optional ``--nats-url``) into nats-py's ``connect`` options; :func:`open_connection`
connects with them. Every command and actor connects through
:meth:`rftstream.bus.client.Bus.connect`, which calls :func:`open_connection`.

Connection policy:

* The first connect tries every server twice (``reconnect_time_wait`` apart) and
  then raises one :class:`BusError` naming the servers, the kind of auth and what
  the server said (a refused credential, an untrusted certificate, nothing
  listening): seconds, never a hang.
* Once connected, a lost connection is retried for ``nats.reconnect_window``
  seconds (a server restart on the same store: subscriptions and JetStream state
  come back). After the window the connection is closed and every later bus
  operation raises :class:`BusError` naming the servers and the window.

Secrets (``nats.token``, ``nats.password`` and a password inside a URL) never
appear in messages: URLs are shown through :func:`redact_url`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import nats
import nats.errors
from nats.aio.client import Client as NatsClient

from rftstream.config.schema import NatsConfig
from rftstream.config.secrets import SECRET_NATS_KEYS, redact_url
from rftstream.errors import BusError

log = logging.getLogger(__name__)

__all__ = [
    "ConnectionWatch",
    "auth_kind",
    "connect_options",
    "open_connection",
    "secrets_to_env",
    "server_urls",
    "tls_context",
]

RECONNECT_TIME_WAIT = 1.0  # seconds between two attempts on one server
FIRST_CONNECT_ATTEMPTS = 2  # per server, before the first connect gives up

ErrorCallback = Callable[[Exception], Awaitable[None]]


def secrets_to_env(cfg: NatsConfig) -> tuple[NatsConfig, dict[str, str]]:
    """``cfg`` with each secret replaced by ``${oc.env:RFTSTREAM_NATS_<KEY>}``, and the
    environment that gives those variables their values.

    Used where a config is written to a file for a child process (the run dir's
    ``config.yaml``): the file never holds a secret, and the child, started with
    that environment, reads the secret back through the interpolation.
    """
    env: dict[str, str] = {}
    changes: dict[str, str] = {}
    for key in SECRET_NATS_KEYS:
        value = getattr(cfg, key)
        if value:
            var = f"RFTSTREAM_NATS_{key.upper()}"
            env[var] = value
            changes[key] = "${oc.env:" + var + "}"
    return (msgspec.structs.replace(cfg, **changes) if changes else cfg), env


def server_urls(cfg: NatsConfig, url: str | None = None) -> list[str]:
    """The servers to connect to: ``url`` (a ``--nats-url``; several may be given
    comma-separated) when given, else ``nats.servers``, else ``nats.url``.

    Raises :class:`BusError` when none is set.
    """
    for given in (url, ",".join(cfg.servers), cfg.url):
        if given:
            urls = [u.strip() for u in given.split(",") if u.strip()]
            if urls:
                return urls
    raise BusError("no NATS server to connect to: set nats.url or nats.servers, or pass --nats-url")


def auth_kind(cfg: NatsConfig, servers: list[str] | None = None) -> str:
    """What the client authenticates with, in words (``"token (nats.token)"``, ...)."""
    kinds: list[str] = []
    if cfg.creds:
        kinds.append("credentials file (nats.creds)")
    if cfg.nkey_seed:
        kinds.append("nkey (nats.nkey_seed)")
    if cfg.token:
        kinds.append("token (nats.token)")
    if cfg.user:
        kinds.append("user/password (nats.user, nats.password)")
    if cfg.tls.cert:
        kinds.append("TLS client certificate (nats.tls.cert)")
    for url in servers or ():
        if "@" in urllib.parse.urlsplit(url).netloc:
            kinds.append("credentials in the URL")
            break
    return ", ".join(kinds) or "no credentials"


def tls_context(cfg: NatsConfig, servers: list[str]) -> ssl.SSLContext | None:
    """An SSL context from ``nats.tls`` (None when TLS is off and no URL is ``tls://``).

    Reads the files (blocking). Raises :class:`BusError` naming the key when a
    file cannot be loaded.
    """
    tls = cfg.tls
    if not tls.enabled and not any(u.startswith("tls://") for u in servers):
        return None
    try:
        ctx = ssl.create_default_context(cafile=tls.ca or None)
    except (OSError, ssl.SSLError) as exc:
        raise BusError(f"nats.tls.ca: cannot load {tls.ca}: {exc}") from exc
    if tls.cert or tls.key:
        if not (tls.cert and tls.key):
            raise BusError("nats.tls: a client certificate needs both nats.tls.cert and .key")
        try:
            ctx.load_cert_chain(tls.cert, tls.key)
        except (OSError, ssl.SSLError) as exc:
            raise BusError(
                f"nats.tls.cert / nats.tls.key: cannot load {tls.cert} with {tls.key}: {exc}"
            ) from exc
    return ctx


def connect_options(
    cfg: NatsConfig,
    url: str | None = None,
    *,
    name: str,
    error_cb: ErrorCallback | None = None,
    disconnected_cb: Callable[[], Awaitable[None]] | None = None,
    reconnected_cb: Callable[[], Awaitable[None]] | None = None,
    closed_cb: Callable[[], Awaitable[None]] | None = None,
) -> dict[str, Any]:
    """nats-py ``connect`` keyword arguments for ``cfg`` (``url`` overrides its servers).

    Set for the first connect (each server tried :data:`FIRST_CONNECT_ATTEMPTS`
    times); :func:`open_connection` lifts the attempt limit once connected. Reads
    the TLS files (blocking). Raises :class:`BusError` (no server, bad TLS files).
    """
    servers = server_urls(cfg, url)
    opts: dict[str, Any] = {
        "servers": servers,
        "name": name,
        "connect_timeout": cfg.connect_timeout,
        "reconnect_time_wait": RECONNECT_TIME_WAIT,
        "max_reconnect_attempts": FIRST_CONNECT_ATTEMPTS - 1,
        "allow_reconnect": True,
    }
    if cfg.creds:
        opts["user_credentials"] = cfg.creds
    if cfg.nkey_seed:
        opts["nkeys_seed"] = cfg.nkey_seed
    if cfg.token:
        opts["token"] = cfg.token
    if cfg.user:
        opts["user"] = cfg.user
        opts["password"] = cfg.password
    ctx = tls_context(cfg, servers)
    if ctx is not None:
        opts["tls"] = ctx
    for key, cb in (
        ("error_cb", error_cb),
        ("disconnected_cb", disconnected_cb),
        ("reconnected_cb", reconnected_cb),
        ("closed_cb", closed_cb),
    ):
        if cb is not None:
            opts[key] = cb
    return opts


def _explain(exc: BaseException, cfg: NatsConfig, servers: list[str]) -> str:
    """Why a connect failed, in words a user can act on."""
    text = str(exc) or type(exc).__name__
    lowered = text.lower()
    kind = auth_kind(cfg, servers)
    if isinstance(exc, nats.errors.AuthorizationError) or "authoriz" in lowered:
        return f"the server refused the credentials ({kind}): authorization violation"
    if "authentication" in lowered or "expired" in lowered:
        return f"the server refused the credentials ({kind}): {text}"
    if isinstance(exc, ssl.SSLCertVerificationError) or "certificate verify failed" in lowered:
        return (
            f"TLS: the server's certificate is not trusted (nats.tls.ca = "
            f"{cfg.tls.ca or 'the system roots'}): {text}"
        )
    if isinstance(exc, ssl.SSLError) or "tls" in lowered or "ssl" in lowered:
        return f"TLS handshake failed (nats.tls, auth: {kind}): {text}"
    if isinstance(exc, ConnectionRefusedError) or "connect call failed" in lowered:
        return f"nothing accepts connections there: {text}"
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return f"no answer within nats.connect_timeout = {cfg.connect_timeout} s"
    return f"{type(exc).__name__}: {text}"


def _is_refusal(exc: BaseException) -> bool:
    """A refused credential or a failed TLS handshake: retrying will not help."""
    text = str(exc).lower()
    return isinstance(exc, (nats.errors.AuthorizationError, ssl.SSLError)) or any(
        word in text for word in ("authoriz", "authentication", "certificate")
    )


def _main_cause(errors: list[BaseException], last: BaseException) -> BaseException:
    """The error that explains a failed connect best: a refused credential or a TLS
    failure (the server may reset the next attempt), else the latest error."""
    for exc in errors:
        if _is_refusal(exc):
            return exc
    rest = [e for e in errors if not isinstance(e, nats.errors.NoServersError)]
    return rest[-1] if rest else last


class ConnectionWatch:
    """nats-py callbacks that report errors and bound how long a connection stays lost.

    While the first connect runs it keeps the errors (for the one message of
    :func:`open_connection`); afterwards it logs them. A disconnect arms a timer
    of ``nats.reconnect_window`` seconds; a reconnect disarms it; when it fires,
    the connection is closed and :attr:`gave_up` holds the reason that bus
    operations raise from then on.
    """

    def __init__(self, cfg: NatsConfig, servers: list[str], actor: str) -> None:
        self.cfg = cfg
        self.servers = servers
        self.actor = actor
        self.nc: NatsClient | None = None
        self.connecting = True
        self.errors: list[BaseException] = []
        self.gave_up: str | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._closing: asyncio.Future[None] | None = None
        self.refused: asyncio.Future[None] | None = None  # set by open_connection

    @property
    def shown_servers(self) -> str:
        return ", ".join(redact_url(u) for u in self.servers)

    async def on_error(self, exc: Exception) -> None:
        if self.connecting:
            self.errors.append(exc)
            if self.refused is not None and not self.refused.done() and _is_refusal(exc):
                self.refused.set_result(None)  # a credential or certificate: no point retrying
            return
        log.warning("%s: nats error: %s", self.actor, _explain(exc, self.cfg, self.servers))

    async def on_disconnected(self) -> None:
        if self.connecting or self._timer is not None or self.nc is None or self.nc.is_closed:
            return
        window = self.cfg.reconnect_window
        log.warning(
            "%s: lost the connection to NATS (%s); reconnecting for up to %s s (nats.reconnect_window)",
            self.actor,
            self.shown_servers,
            window,
        )
        self._timer = asyncio.get_running_loop().call_later(window, self._expire)

    async def on_reconnected(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        url = self.nc.connected_url if self.nc is not None else None
        shown = redact_url(url.geturl()) if url is not None else self.shown_servers
        log.warning("%s: reconnected to NATS at %s", self.actor, shown)

    async def on_closed(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        """The window passed without a reconnect: close the connection (a task of the
        loop, as nats-py's own callbacks are; awaited by nobody, kept in ``_closing``)."""
        self._timer = None
        if self.nc is None or self.nc.is_closed or self.nc.is_connected:
            return
        self.gave_up = (
            f"lost the connection to NATS at {self.shown_servers} and could not "
            f"reconnect within nats.reconnect_window = {self.cfg.reconnect_window} s"
        )
        log.error("%s: %s", self.actor, self.gave_up)
        self._closing = asyncio.ensure_future(self._close())

    async def _close(self) -> None:
        try:
            if self.nc is not None:
                await self.nc.close()
        except Exception as exc:  # noqa: BLE001 - the transport is gone already
            log.debug("%s: closing the lost connection: %s", self.actor, exc)

    def closed_error(self, what: str) -> BusError:
        """The error for an operation (``what``) on a closed connection."""
        if self.gave_up:
            return BusError(f"{what}: {self.gave_up}")
        return BusError(f"{what}: connection closed (NATS at {self.shown_servers})")


async def open_connection(
    cfg: NatsConfig, url: str | None, *, name: str, actor: str
) -> tuple[NatsClient, ConnectionWatch]:
    """Connect as :func:`connect_options` says; returns the client and its watch.

    Blocks at most about ``2 x (connect_timeout + 1 s)`` per server. Raises one
    :class:`BusError` naming the servers, the kind of auth and the cause when no
    server takes the connection.
    """
    servers = server_urls(cfg, url)
    watch = ConnectionWatch(cfg, servers, actor)
    opts = connect_options(
        cfg,
        url,
        name=name,
        error_cb=watch.on_error,
        disconnected_cb=watch.on_disconnected,
        reconnected_cb=watch.on_reconnected,
        closed_cb=watch.on_closed,
    )
    nc = NatsClient()
    loop = asyncio.get_running_loop()
    watch.refused = loop.create_future()
    # nats-py retries a refused credential, and can hang after a failed TLS handshake:
    # the first refusal ends the connect; a deadline bounds the rest
    deadline = len(servers) * FIRST_CONNECT_ATTEMPTS * (cfg.connect_timeout + RECONNECT_TIME_WAIT)
    connecting = asyncio.ensure_future(nc.connect(**opts))
    try:
        done, _ = await asyncio.wait(
            {connecting, watch.refused}, timeout=deadline + 1, return_when=asyncio.FIRST_COMPLETED
        )
        if connecting not in done:
            connecting.cancel()
            with contextlib.suppress(BaseException):
                await connecting
            with contextlib.suppress(Exception):
                await nc.close()
            raise asyncio.TimeoutError() if not watch.errors else watch.errors[-1]
        connecting.result()
    except asyncio.CancelledError:
        connecting.cancel()
        raise
    except Exception as exc:  # nats raises several unrelated types here
        cause = _main_cause(watch.errors, exc)
        raise BusError(
            f"{actor}: cannot connect to NATS at {watch.shown_servers} "
            f"(auth: {auth_kind(cfg, servers)}): {_explain(cause, cfg, servers)}"
        ) from cause
    watch.nc = nc
    watch.connecting = False
    nc.options["max_reconnect_attempts"] = -1  # the window bounds reconnecting from now on
    return nc, watch
