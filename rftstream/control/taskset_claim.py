"""Who publishes the taskset: the claim protocol as a pure state machine. No I/O.

The training tasksets are published into the task stream once per run, by
one explorer: the one holding KV key ``taskset.published.claim``
(:class:`~rftstream.wire.TasksetClaim`). Every explorer runs this protocol
(driven by :class:`rftstream.actors.taskset_publisher.TasksetPublisher`):

* **seeking**: it looks at ``taskset.published`` and the claim. A published
  taskset ends the protocol. No claim: it creates one (create-if-absent). A
  claim of its own name (it restarted) is taken over at once; a claim of
  another explorer whose revision has not moved for ``stale_s`` seconds (its
  publisher died) is taken over by compare-and-set on that revision, from the
  claim's ``seq`` on. Otherwise it looks again after ``poll_s``.
* **claiming**: its write is in flight. Won: it publishes from the claim's
  ``seq``. Lost (another writer first): it looks again. A KV failure: it looks
  again after a pause.
* **publishing**: every stored chunk of tasks is recorded
  (:class:`Progressed`: compare-and-set of the new ``seq`` on its revision),
  and the record is rewritten every ``keepalive_s`` meanwhile (:class:`Tick`),
  so the others see it alive. A write lost to another explorer means the
  claim was taken over: :class:`ClaimLost`, and it seeks again. A write
  abandoned without an answer (cancelled: :class:`WriteFailed`) is forgotten.
* **finished**: the taskset is published; nothing more to do.

:meth:`ClaimProtocol.step` takes the state, an event (what the KV answered, or
what the publisher did) and the time (``now``: monotonic seconds, injected),
and returns the next state and the actions for the driver to perform in order.
A write action's answer is the next event (:class:`Wrote` or
:class:`WriteFailed`); a :class:`Look` action's answer is :class:`Observed`.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from rftstream.wire import TasksetClaim

__all__ = [
    "Action",
    "Claiming",
    "ClaimLost",
    "ClaimProtocol",
    "ClaimState",
    "Done",
    "Event",
    "Finished",
    "Look",
    "Observed",
    "Progressed",
    "Publishing",
    "Seeking",
    "StartPublishing",
    "Tick",
    "Wait",
    "WriteClaim",
    "WriteFailed",
    "Wrote",
]


# ------------------------------------------------------------------ states
class Seeking(msgspec.Struct, frozen=True, kw_only=True):
    """Not the publisher: watching someone's claim (or none yet).

    ``revision``: the claim's revision last seen (None: none seen yet);
    ``since``: when that revision was first seen (it is stale ``stale_s`` later).
    """

    revision: int | None = None
    since: float = 0.0


class Claiming(msgspec.Struct, frozen=True, kw_only=True):
    """A claim write is in flight: created (``revision`` None) or taken over."""

    seq: int  # where publishing starts if the write wins
    taken_over_from: str = ""  # the claim's holder when taking over; "" when creating
    stale: bool = False  # taken over because it stopped moving (not our own)
    revision: int | None = None  # the revision the write replaces (None: create)
    seen_since: float = 0.0  # the seeking state's clock, kept when the write loses


class Publishing(msgspec.Struct, frozen=True, kw_only=True):
    """The publisher: every task before ``seq`` is stored and recorded at ``revision``."""

    revision: int
    seq: int
    written_at: float  # when the claim was last written
    writing: int | None = None  # the seq of a progress write in flight


class Finished(msgspec.Struct, frozen=True, kw_only=True):
    """The taskset is published (``taskset.published`` exists)."""


ClaimState = Seeking | Claiming | Publishing | Finished


# ------------------------------------------------------------------ events
class Observed(msgspec.Struct, frozen=True, kw_only=True):
    """The answer to :class:`Look`: whether ``taskset.published`` exists, and the claim.

    ``claim`` None with a ``revision``: the key holds a record that does not
    decode; both None: there is no claim.
    """

    published: bool
    claim: TasksetClaim | None = None
    revision: int | None = None


class Wrote(msgspec.Struct, frozen=True, kw_only=True):
    """The answer to :class:`WriteClaim`: the new revision, or None when another
    writer was first (the key was not at the expected revision)."""

    revision: int | None


class WriteFailed(msgspec.Struct, frozen=True, kw_only=True):
    """A claim write failed for another reason (a KV timeout, a lost connection)."""

    reason: str


class Progressed(msgspec.Struct, frozen=True, kw_only=True):
    """The publisher stored every task before ``seq``: record it."""

    seq: int


class Tick(msgspec.Struct, frozen=True, kw_only=True):
    """Time passed: the publisher keeps its claim alive if it is due."""


Event = Observed | Wrote | WriteFailed | Progressed | Tick


# ------------------------------------------------------------------ actions
class Look(msgspec.Struct, frozen=True, kw_only=True):
    """Read ``taskset.published`` and the claim; answer with :class:`Observed`."""


class Wait(msgspec.Struct, frozen=True, kw_only=True):
    """Sleep ``seconds`` before the next action."""

    seconds: float


class WriteClaim(msgspec.Struct, frozen=True, kw_only=True):
    """Write the claim ``(by=<us>, seq, taken_over_from)`` stamped with the wall clock:
    create it when ``revision`` is None, else compare-and-set on ``revision``; answer
    with :class:`Wrote` (or :class:`WriteFailed`)."""

    seq: int
    revision: int | None
    taken_over_from: str = ""


class StartPublishing(msgspec.Struct, frozen=True, kw_only=True):
    """The claim is ours: publish the plan from position ``start``.

    ``taken_over_from``: the previous holder when this is a take-over
    (``stale``: it had stopped moving; else it was our own earlier claim).
    """

    start: int
    taken_over_from: str = ""
    stale: bool = False


class ClaimLost(msgspec.Struct, frozen=True, kw_only=True):
    """Another explorer took the claim over: stop publishing (and seek again)."""


class Done(msgspec.Struct, frozen=True, kw_only=True):
    """The taskset is published: nothing to publish."""


Action = Look | Wait | WriteClaim | StartPublishing | ClaimLost | Done


@dataclass(frozen=True)
class ClaimProtocol:
    """The claim protocol of explorer ``name`` (see the module docstring).

    ``stale_s``: a claim whose revision has not moved this long belongs to a dead
    publisher. ``keepalive_s``: how often a publisher rewrites its claim while it
    has no progress to record (well under ``stale_s``). ``poll_s``: the longest
    pause between two looks at someone else's claim (the I/O loop ends a
    :class:`Wait` early at a write of the claim or of ``taskset.published``, and the
    pause never runs past the claim's going stale); ``retry_s``: after a failed create.
    """

    name: str
    stale_s: float = 30.0
    keepalive_s: float = 5.0
    poll_s: float = 2.0
    retry_s: float = 0.5

    def start(self) -> tuple[ClaimState, list[Action]]:
        """The initial state and actions: seek, starting with a look."""
        return Seeking(), [Look()]

    def step(self, state: ClaimState, event: Event, now: float) -> tuple[ClaimState, list[Action]]:
        """The state after ``event`` at time ``now`` and the actions to perform, in order.

        Raises :class:`ValueError` for an event the state cannot receive (a
        driver bug, e.g. :class:`Progressed` while seeking).
        """
        if isinstance(state, Finished):
            return state, []
        if isinstance(state, Seeking) and isinstance(event, Observed):
            return self._observed(state, event, now)
        if isinstance(state, Claiming) and isinstance(event, Wrote | WriteFailed):
            return self._claim_written(state, event, now)
        if isinstance(state, Publishing):
            return self._publishing(state, event, now)
        raise ValueError(f"taskset claim: {type(event).__name__} while {type(state).__name__}")

    def _observed(
        self, state: Seeking, event: Observed, now: float
    ) -> tuple[ClaimState, list[Action]]:
        if event.published:
            return Finished(), [Done()]
        if event.revision is None:  # no claim: create it
            return Claiming(seq=0, seen_since=now), [WriteClaim(seq=0, revision=None)]
        if event.revision != state.revision:  # it moved: its publisher is alive
            state = Seeking(revision=event.revision, since=now)
        claim = event.claim
        if claim is None:  # a record that does not decode: wait for it to change
            return state, [Wait(seconds=self.poll_s), Look()]
        stale = now - state.since > self.stale_s
        if claim.by != self.name and not stale:
            # until a write (its keep-alive, taskset.published) or the claim going stale
            until_stale = state.since + self.stale_s - now + 0.01
            return state, [Wait(seconds=min(self.poll_s, until_stale)), Look()]
        taking = Claiming(
            seq=claim.seq,
            taken_over_from=claim.by,
            stale=claim.by != self.name,
            revision=event.revision,
            seen_since=state.since,
        )
        write = WriteClaim(seq=claim.seq, revision=event.revision, taken_over_from=claim.by)
        return taking, [write]

    def _claim_written(
        self, state: Claiming, event: Wrote | WriteFailed, now: float
    ) -> tuple[ClaimState, list[Action]]:
        seeking = Seeking(revision=state.revision, since=state.seen_since)
        if isinstance(event, WriteFailed):  # a KV hiccup, not a lost race: look again later
            pause = self.retry_s if state.revision is None else self.poll_s
            return seeking, [Wait(seconds=pause), Look()]
        if event.revision is None:  # someone else was first
            if state.revision is None:  # the claim exists now: look at it at once
                return seeking, [Look()]
            return seeking, [Wait(seconds=self.poll_s), Look()]
        won = Publishing(revision=event.revision, seq=state.seq, written_at=now)
        start = StartPublishing(
            start=state.seq, taken_over_from=state.taken_over_from, stale=state.stale
        )
        return won, [start]

    def _publishing(
        self, state: Publishing, event: Event, now: float
    ) -> tuple[ClaimState, list[Action]]:
        if isinstance(event, Progressed | Tick):
            if state.writing is not None:
                raise ValueError("taskset claim: a progress write is already in flight")
            if isinstance(event, Tick) and now - state.written_at < self.keepalive_s:
                return state, []
            seq = event.seq if isinstance(event, Progressed) else state.seq
            writing = msgspec.structs.replace(state, writing=seq)
            return writing, [WriteClaim(seq=seq, revision=state.revision)]
        if isinstance(event, Wrote) and state.writing is not None:
            if event.revision is None:  # another explorer took it over
                return Seeking(), [ClaimLost(), Look()]
            return Publishing(revision=event.revision, seq=state.writing, written_at=now), []
        if isinstance(event, WriteFailed) and state.writing is not None:
            # the write was abandoned (cancelled) without an answer: the next one tries on
            # the revision we know; if this one landed after all, that one finds the claim
            # moved and reads as lost (our own claim: taken over again at once)
            return msgspec.structs.replace(state, writing=None), []
        raise ValueError(f"taskset claim: {type(event).__name__} while publishing")
