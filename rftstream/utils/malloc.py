"""glibc ``malloc`` settings for actor processes, which move large message bodies.

An explorer encodes every experience group into a fresh body (64 KiB to several MiB) and
keeps it until the stream acks it (a timed-out publish is sent again); the NATS client
joins what is queued for the socket into one buffer of up to a few MiB per write. With
glibc's defaults those buffers keep crossing its dynamic thresholds: the large ones are
``mmap``-ed and unmapped again, and the top of the heap is given back to the kernel and
asked for again, so the same memory is faulted in and zeroed over and over. On the bus
benchmark (``benchmarks/bus.py``, 64 KiB groups) that was about a fifth of the
producer's CPU per message; a raw nats-py client, which frees each body as soon as it is
copied into its command, did not pay it.

:func:`tune_malloc` fixes the thresholds where glibc's own dynamic rule would put them
after a process has freed a large buffer once (its ceiling is 32 MiB for ``mmap``):
blocks under :data:`MMAP_THRESHOLD` come from the heap, the heap grows by
:data:`TOP_PAD` at a time and keeps up to :data:`TRIM_THRESHOLD` free at its top.
Model weights (blocks above the threshold) are ``mmap``-ed as before. Nothing here
blocks; every actor's entry point calls it as it starts (``rftstream.runtime.run_explorer``,
``run_operator_replicas``, ``run_trainer``; once per process).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

__all__ = ["MMAP_THRESHOLD", "TOP_PAD", "TRIM_THRESHOLD", "tune_malloc"]

MMAP_THRESHOLD = 16 << 20
TOP_PAD = 16 << 20
TRIM_THRESHOLD = 128 << 20
# mallopt's parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
# the environment variables glibc reads for the same settings: a user's own win
_USER_SETTINGS = (
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_THRESHOLD_",
    "GLIBC_TUNABLES",
)
#: set to ``0`` to leave glibc's defaults alone
OPT_OUT = "RFTSTREAM_MALLOC_TUNING"

_applied: bool | None = None


def tune_malloc() -> bool:
    """Apply the settings above to this process, once; True if they are in force.

    Does nothing (False) off glibc (macOS, musl), when ``RFTSTREAM_MALLOC_TUNING=0``, or
    when the user set glibc's own ``MALLOC_*_`` variables or ``GLIBC_TUNABLES``."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get(OPT_OUT, "1").strip() == "0":
        return False
    if any(name in os.environ for name in _USER_SETTINGS):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        # the process's own symbols (libc is loaded in every CPython process):
        # ctypes.util.find_library runs ldconfig, 14 ms of an actor's start-up
        libc = ctypes.CDLL(None)
        ok = all(
            libc.mallopt(param, value) == 1
            for param, value in (
                (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                (_M_TOP_PAD, TOP_PAD),
                (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            )
        )
    except (OSError, AttributeError) as exc:
        log.debug("malloc settings not applied: %s", exc)
        return False
    _applied = ok
    return ok
