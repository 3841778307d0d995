"""Pure pieces of splicing around the protocol: whose pid runs here, the drain control
(asyncio and trio). The protocol's transitions are in test_splice_protocol_steps.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import anyio
import pytest

from rftstream.actors.operator_host import DrainControl
from rftstream.control.splice.operator_side import local_pid_alive, owner_info
from rftstream.wire import Owner


def test_local_pid_alive_only_judges_this_host() -> None:
    here = socket.gethostname()
    assert local_pid_alive(owner_info("me")) is True
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    assert local_pid_alive(Owner(actor="x", pid=int(gone.stdout), host=here)) is False
    assert local_pid_alive(Owner(actor="x", pid=os.getpid(), host="elsewhere")) is None
    assert local_pid_alive(Owner(actor="x", host=here)) is None  # no pid: never started
    assert local_pid_alive(None) is None


@pytest.mark.anyio
async def test_drain_control_parks_then_drains(anyio_backend) -> None:
    control = DrainControl(hosts=3)
    released: list[int] = []

    async def host(i: int) -> None:
        await control.park()
        released.append(i)
        control.leave()

    async with anyio.create_task_group() as tg:
        tg.start_soon(host, 0)
        tg.start_soon(host, 1)
        await anyio.sleep(0.05)
        assert not control.all_parked.is_set()  # the third host is still working
        control.leave()  # ... until it stops for another reason (it counts as parked)
        with anyio.fail_after(5):
            await control.all_parked.wait()
        assert released == [] and not control.all_drained.is_set()
        control.set_cut(41)
        with anyio.fail_after(5):
            await control.all_drained.wait()
    assert sorted(released) == [0, 1] and control.cut == 41 and control.stopping
