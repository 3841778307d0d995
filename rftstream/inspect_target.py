"""Which NATS server the inspecting commands (``status``, ``streams``, ``tail``,
``account``) read a run from, when no server is named.

With ``--nats-url`` or a config's ``nats.url`` / ``nats.servers``, that server. Otherwise
the run ran on an embedded server in its run directory (``--run-dir``, default
``runs/<name>``):

* a live ``rftstream up`` holds the directory: its server (the URL from the directory's
  lock record, the password from ``<run_dir>/nats/password``);
* no live run: a private nats-server is started on the run's JetStream store for the
  read (loopback, a random password kept in memory, the directory locked meanwhile so
  that no ``up`` starts on the store), and stopped afterwards.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path

from rftstream.config.resolve import default_run_dir
from rftstream.config.schema import Config
from rftstream.errors import RftError
from rftstream.run_lock import (
    EMBEDDED_USER,
    EmbeddedAuth,
    RunLock,
    live_owner,
    read_embedded_auth,
)


@contextlib.contextmanager
def inspect_target(
    cfg: Config, nats_url: str | None, run_dir: str | None
) -> Iterator[tuple[str | None, Config]]:
    """``(url, cfg)`` to connect with for reading the run of ``cfg`` (see the module
    docstring). ``url`` None: the config's own servers. Blocks while a private server
    starts (about a second) and, on exit, while it stops. Raises :class:`RftError` when
    there is nothing to read from."""
    if nats_url or cfg.nats.url or cfg.nats.servers:
        yield nats_url, cfg
        return
    directory = Path(run_dir or default_run_dir(cfg))
    owner = live_owner(directory)
    if owner is not None and owner.url:
        auth = read_embedded_auth(directory)
        yield owner.url, (auth.on(cfg) if auth else cfg)
        return
    store = directory / "nats"
    if not (store / "jetstream").is_dir():
        raise RftError(
            f"no NATS server to connect to: no live run holds {directory} and it has no "
            f"JetStream store ({store / 'jetstream'}); pass --nats-url or --run-dir"
        )
    from rftstream.nats_server.embedded import EmbeddedNatsServer

    lock = RunLock(directory).acquire(record=False)
    try:
        auth = EmbeddedAuth(user=EMBEDDED_USER, password=secrets.token_urlsafe(24))
        server = EmbeddedNatsServer(
            store, max_payload=cfg.nats.max_payload, user=auth.user, password=auth.password
        )
        url = server.start()
        try:
            yield url, auth.on(cfg)
        finally:
            server.stop()
    finally:
        lock.release("done")
