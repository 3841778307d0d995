"""`rftstream explorer|trainer|operator` alone: `sync_method: memory` is refused exactly where
weights would have to travel between processes."""

from __future__ import annotations

import pytest

from rftstream.cli import check_standalone_sync
from rftstream.config import config_from_dict
from rftstream.errors import RftError


def _cfg(mode: str, sync_method: str):
    return config_from_dict({"mode": mode, "synchronizer": {"sync_method": sync_method}})


@pytest.mark.parametrize("command", ["explorer", "trainer"])
def test_memory_sync_refused_when_weights_travel(command: str) -> None:
    with pytest.raises(RftError, match=r"synchronizer\.sync_method.*checkpoint"):
        check_standalone_sync(_cfg("both", "memory"), command)


@pytest.mark.parametrize(
    ("mode", "command"),
    [
        ("both", "operator"),  # operators never touch weights
        ("train", "trainer"),  # the only actor
        ("explore", "explorer"),  # never synced
        ("bench", "explorer"),  # reads checkpoints from disk
    ],
)
def test_memory_sync_allowed_where_no_weights_travel(mode: str, command: str) -> None:
    check_standalone_sync(_cfg(mode, "memory"), command)


def test_checkpoint_sync_always_allowed() -> None:
    for command in ("explorer", "trainer", "operator"):
        check_standalone_sync(_cfg("both", "checkpoint"), command)
