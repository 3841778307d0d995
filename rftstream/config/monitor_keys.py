"""The ``monitor`` keys: which backends ``monitor_type`` names and which ``monitor_args`` they
read. Config rules, no I/O and no backend imported (:mod:`rftstream.monitors` opens them).
"""

from __future__ import annotations

from typing import Any

from rftstream.config.schema import MONITOR_TYPES
from rftstream.errors import ConfigError

__all__ = ["KEY", "MONITOR_ARGS", "check_monitor_config", "monitor_types"]

KEY = "monitor.monitor_type"

#: the ``monitor.monitor_args`` keys each backend reads (jsonl and none read none); each
#: backend class of :mod:`rftstream.monitors` declares its ``args`` from here
MONITOR_ARGS: dict[str, tuple[str, ...]] = {
    "tensorboard": (),
    "wandb": ("base_url", "api_key", "mode", "entity", "tags"),
    "mlflow": ("uri", "username", "password"),
}


def monitor_types(value: Any, *, source: str | None = None) -> tuple[str, ...]:
    """The backends ``monitor.monitor_type`` names, in order, each once.

    Accepts a name or a list of names. Raises :class:`ConfigError` (key
    ``monitor.monitor_type``) for an unknown name, an empty list, a name given twice, or
    ``none`` beside other names."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names:
        raise ConfigError(
            KEY,
            f"must be one of {', '.join(MONITOR_TYPES)}, or a non-empty list of them",
            value=value,
            has_value=True,
            source=source,
        )
    for i, name in enumerate(names):
        if name not in MONITOR_TYPES:
            where = KEY if isinstance(value, str) else f"{KEY}[{i}]"
            raise ConfigError(
                where, f"must be one of {', '.join(MONITOR_TYPES)}", value=name, source=source
            )
    if len(set(names)) != len(names):
        raise ConfigError(KEY, "names a monitor twice", value=value, source=source)
    if "none" in names and len(names) > 1:
        raise ConfigError(
            KEY, "`none` turns every monitor off: give it alone", value=value, source=source
        )
    return tuple(names)


def check_monitor_config(monitor: Any, *, source: str | None = None) -> None:
    """Check ``monitor.monitor_type`` and ``monitor.monitor_args`` (keys the chosen backends
    read, nothing else). Raises :class:`ConfigError` naming the key. Pure."""
    names = monitor_types(monitor.monitor_type, source=source)
    known = sorted({a for n in names for a in MONITOR_ARGS.get(n, ())})
    for key in monitor.monitor_args:
        if key not in known:
            readers = ", ".join(known) if known else "none (no chosen backend takes arguments)"
            raise ConfigError(
                f"monitor.monitor_args.{key}",
                f"is not read by monitor_type {list(names)}; valid keys: {readers}",
                value=monitor.monitor_args[key],
                source=source,
            )
