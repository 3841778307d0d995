"""The ``rftstream studio`` command: its arguments and what it runs."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_studio_parser", "cmd_studio"]

DEFAULT_PORT = 8765


def add_studio_parser(sub: Any) -> None:
    """Add ``rftstream studio`` to the CLI's subparsers ``sub``."""
    st = sub.add_parser(
        "studio",
        help="a web page: build a run config with forms (validated as `up` does, saved as "
        "YAML), run it (`up`, stopped with a button as Ctrl-C) and watch a run live from NATS",
    )
    st.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    st.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any)"
    )
    st.add_argument(
        "--nats-url",
        help="NATS server of the live view (default $NATS_URL, else nats://127.0.0.1:4222)",
    )
    st.add_argument(
        "--config",
        help="a run config whose `nats` keys (credentials, TLS) the live view connects with",
    )


def cmd_studio(args: argparse.Namespace) -> int:
    """Serve the studio until Ctrl-C (blocks; a run it started is stopped first, see
    :func:`~rftstream.studio.server.serve`). Raises :class:`~rftstream.errors.RftError`
    for a bad ``--config`` or a port that cannot be bound."""
    from rftstream.config import load_config
    from rftstream.config.schema import NatsConfig
    from rftstream.studio.server import default_nats_url, serve

    nats_cfg = load_config(args.config).nats if args.config else NatsConfig(connect_timeout=3.0)
    url = args.nats_url or nats_cfg.url or default_nats_url()

    def ready(address: str) -> None:
        print(f"rftstream studio on {address}  (live view: {address}live, NATS {url})", flush=True)

    try:
        serve(args.host, args.port, url, nats_cfg, on_ready=ready)
    except KeyboardInterrupt:
        return 0
    return 0
