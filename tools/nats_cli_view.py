"""What the NATS CLI shows for a run, read through nats-py (the CLI is not a Python package).

Each section is one ``nats`` command and what the server answers it with: the JetStream API
replies that ``nats ... --json`` prints as they are, the KV keys ``nats kv ls`` lists, and the
bodies ``nats sub --raw`` prints. docs/monitoring.md shows this for a real run;
tests/integration/test_nats_cli_view.py runs it on one.

Usage: python tools/nats_cli_view.py NATS_URL RUN_ID [--user U --password P]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import nats

# fields that change from run to run, left out so the output reads the same every time
_VOLATILE = {"created", "ts", "first_ts", "last_ts", "last_active", "cluster", "type"}


def _stable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


async def _api(nc: Any, subject: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    reply = await nc.request(subject, json.dumps(body or {}).encode(), timeout=5)
    return json.loads(reply.data)


async def views(url: str, run: str, **auth: str) -> dict[str, Any]:
    """The run's views, by command (see the module docstring). Reads only."""
    nc = await nats.connect(url, **auth)
    try:
        upper = run.upper()
        names = await _api(nc, "$JS.API.STREAM.NAMES", {"subject": f"rft.{run}.>"})
        streams = sorted(n for n in names.get("streams") or [] if n.startswith(f"RFT_{upper}_"))
        exp = f"RFT_{upper}_EXP"
        info = await _api(nc, f"$JS.API.STREAM.INFO.{exp}", {"subjects_filter": ">"})
        consumers = await _api(nc, f"$JS.API.CONSUMER.NAMES.{exp}")
        trainer = await _api(nc, f"$JS.API.CONSUMER.INFO.{exp}.trainer")
        js = nc.jetstream()
        kv = await js.key_value(f"rft_{run}_state")
        keys = sorted(await kv.keys())
        sub = await js.subscribe(f"rft.{run}.metrics.>", ordered_consumer=True)
        bodies = []
        try:
            while len(bodies) < 2:
                msg = await sub.next_msg(timeout=5)
                bodies.append(msg.data.decode())
        finally:
            await sub.unsubscribe()
        return {
            "nats stream ls --names": streams,
            f"nats stream info {exp} --json": _stable(info),
            f"nats consumer ls {exp} --names": sorted(consumers.get("consumers") or []),
            f"nats consumer info {exp} trainer --json": _stable(trainer),
            f"nats kv ls rft_{run}_state": keys,
            f"nats sub 'rft.{run}.metrics.>' --raw": bodies,
        }
    finally:
        await nc.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("run")
    p.add_argument("--user")
    p.add_argument("--password")
    args = p.parse_args()
    auth = {k: v for k, v in (("user", args.user), ("password", args.password)) if v}
    for command, out in asyncio.run(views(args.url, args.run, **auth)).items():
        print(f"$ {command}")
        if isinstance(out, list) and all(isinstance(x, str) for x in out):
            print("\n".join(out))
        else:
            print(json.dumps(out, indent=2))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
