"""The actors' glibc malloc settings (rftstream/utils/malloc.py): applied once per process
on glibc, and left alone when the user opts out or set glibc's own variables. Each case
runs in a fresh interpreter (the settings are per process and applied once)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="glibc's mallopt exists on glibc Linux only",
)

PROBE = "from rftstream.utils.malloc import tune_malloc; print(tune_malloc(), tune_malloc())"


def _probe(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    clean.pop("GLIBC_TUNABLES", None)
    clean.pop("RFTSTREAM_MALLOC_TUNING", None)
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return out.stdout.strip()


def test_applied_once_on_glibc() -> None:
    assert _probe() == "True True"


def test_the_opt_out_leaves_glibc_alone() -> None:
    assert _probe(RFTSTREAM_MALLOC_TUNING="0") == "False False"


@pytest.mark.parametrize("name", ["MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"])
def test_a_users_own_glibc_settings_win(name: str) -> None:
    value = "glibc.malloc.top_pad=1" if name == "GLIBC_TUNABLES" else "1048576"
    assert _probe(**{name: value}) == "False False"
