"""Stream limits that can lose messages nobody has processed yet: config rules, no I/O.

:func:`limit_warnings` reads ``nats.streams`` and says, one line each, which setting may
remove experience, tasks or weight versions before they are used;
:func:`rftstream.config.validate.validate_config` turns each line into a
:class:`StreamLimitWarning`. (The bus applies the limits: :mod:`rftstream.retention.limits`.)
"""

from __future__ import annotations

from typing import Any

from rftstream.config.schema import StreamLimitsConfig, StreamsConfig

__all__ = ["STREAM_KEYS", "StreamLimitWarning", "limit_warnings", "stream_limits"]

#: the stream keys of ``nats.streams``, with the role each stream has
STREAM_KEYS = ("tasks", "experience", "dead_letter", "metrics", "weights")


class StreamLimitWarning(UserWarning):
    """A ``nats.streams`` setting that can remove messages nobody has processed yet."""


def limit_warnings(streams: StreamsConfig) -> list[str]:
    """Why a ``nats.streams`` setting may lose messages nobody has processed yet (one line each)."""
    out: list[str] = []
    exp = streams.experience
    if exp.discard == "old" and (exp.max_bytes > 0 or exp.max_msgs > 0):
        out.append(
            "config key `nats.streams.experience.discard`: old removes the oldest experience "
            "when the stream is full, trained or not (the loss is reported, but it is lost); "
            "`new` makes explorers wait instead"
        )
    if exp.max_age > 0:
        out.append(
            f"config key `nats.streams.experience.max_age`: experience older than {exp.max_age:g}s "
            "is removed whether it was trained or not"
        )
    weights = streams.weights
    if weights.max_bytes > 0 or weights.max_msgs > 0 or weights.max_age > 0:
        out.append(
            "config key `nats.streams.weights`: a limit can remove versions explorers still "
            "need (a keyframe and its deltas); the trainer bounds the stream itself, and an "
            "explorer that finds a version gone asks for a keyframe and waits for it"
        )
    tasks = streams.tasks
    if tasks.discard == "old" and (tasks.max_bytes > 0 or tasks.max_msgs > 0):
        out.append(
            "config key `nats.streams.tasks.discard`: old drops tasks not yet explored when the "
            "tasks stream is full; `new` makes the task feed wait instead"
        )
    if tasks.max_age > 0:
        out.append(
            f"config key `nats.streams.tasks.max_age`: tasks older than {tasks.max_age:g}s are "
            "removed whether they were explored or not"
        )
    if not exp.purge_acked and exp.max_bytes > 0 and exp.discard == "new":
        out.append(
            "config key `nats.streams.experience.purge_acked`: false keeps every message, so a "
            f"run that publishes more than max_bytes ({exp.max_bytes}) stalls: explorers wait "
            "for room that nothing frees"
        )
    return out


def stream_limits(limits: StreamLimitsConfig) -> dict[str, Any]:
    """The :class:`~rftstream.bus.transport.StreamSpec` fields of one ``nats.streams.<stream>`` table."""
    return {
        "max_bytes": int(limits.max_bytes),
        "max_msgs": int(limits.max_msgs),
        "max_age": float(limits.max_age),
        "discard": "old" if limits.discard == "old" else "new",
    }
