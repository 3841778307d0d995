"""In-memory experience sources (the ``ExperienceSource`` protocol: ``await read(n)``)
for the unit tests of sample strategies and buffer readers."""

from __future__ import annotations

import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream

from rftstream.experience import Experience


class ListSource:
    """Returns up to ``n`` experiences from a list, fewer only once it has run dry; records
    the sizes asked for in ``asked``. Every read passes one checkpoint (a cancellation
    point), even when it returns nothing."""

    def __init__(self, exps: list[Experience]) -> None:
        self.exps = list(exps)
        self.asked: list[int] = []

    async def read(self, n: int) -> list[Experience]:
        await anyio.lowlevel.checkpoint()
        self.asked.append(n)
        out, self.exps = self.exps[:n], self.exps[n:]
        return out


class StreamSource:
    """Blocks until ``n`` experiences arrived on a memory stream, or it closed (then
    returns what arrived); cancelling a read loses the experiences it had taken."""

    def __init__(self, receive: MemoryObjectReceiveStream[Experience]) -> None:
        self.receive = receive

    async def read(self, n: int) -> list[Experience]:
        out: list[Experience] = []
        async for exp in self.receive:
            out.append(exp)
            if len(out) == n:
                break
        return out
