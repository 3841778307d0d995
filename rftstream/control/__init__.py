"""The control plane's loop: KV records moved by pure machines.

Each protocol of the run's KV bucket (the splice record, the taskset claim, the
staleness gate, eval claims, heartbeats) is a pure machine: it takes what the
bucket holds and the time, and says what to write and whether it is done. What
runs it is the same everywhere, :func:`~rftstream.control.driver.drive`: read,
step, act, then wait on a write of the keys it reads (never a fixed poll), with
the clock injected there. See ``ARCHITECTURE.md`` ("The control plane").
"""

from rftstream.control.driver import LOOK_AGAIN_S, Clock, KeyWrites, drive, wall_clock

__all__ = ["LOOK_AGAIN_S", "Clock", "KeyWrites", "drive", "wall_clock"]
