"""The explorer's staleness gate as a pure machine (``control.staleness.StalenessGate``):
what it decides from one look, with no bus, no clock and no sleep."""

from __future__ import annotations

from dataclasses import replace

from rftstream.config.sync_policy import SyncPolicy
from rftstream.control.flights import PeerWork
from rftstream.control.staleness import (
    IDLE_LOOK_S,
    RECOUNT_S,
    AwaitWeights,
    Backlog,
    Blocked,
    GateLook,
    LoadNewest,
    Pause,
    StalenessGate,
    Take,
)
from rftstream.wire import TrainerStarving

GROUP, TBS, BATCH = 8, 64, 8  # 8 experiences a task, 64 a trainer step, 8 tasks a step


def gate(max_staleness: int | None = 2) -> StalenessGate:
    policy = SyncPolicy("dynamic_by_explorer", 1, 0, max_staleness)
    return StalenessGate(policy, batch_size=BATCH, train_batch_size=TBS, group=GROUP)


def look(
    total: int = 0,
    *,
    trainer: int = 0,
    operators: int = 0,
    in_flight: int = 0,
    newest: int = 5,
    mine: int = 5,
    staged: int | None = None,
    will_sync: bool = True,
    others: PeerWork = PeerWork(),
) -> GateLook:
    """``total`` messages (one group each) waiting anywhere, ``trainer`` of them held by
    the trainer, ``operators`` by an operator stage."""
    return GateLook(
        in_flight=in_flight,
        queued=Backlog(total, trainer, operators),
        newest=(0, newest),
        published=mine,
        engine_version=mine,
        staged_version=staged,
        will_sync=will_sync,
        others=others,
    )


def test_without_max_staleness_every_step_takes_a_whole_batch() -> None:
    assert gate(None).decide(look(total=10_000)) == Take(BATCH)
    assert not gate(None).enforced


def test_room_for_part_of_a_batch_takes_that_part() -> None:
    # (2 + 1) * 64 positions stay within the bound; 20 groups (160) wait: 32 left, 4 tasks
    assert gate().decide(look(total=20)) == Take(4)
    # our own tasks in flight land first
    assert gate().decide(look(total=16, in_flight=4)) == Take(4)
    assert gate().decide(look(total=0)) == Take(BATCH)


def test_weights_behind_shrink_the_room() -> None:
    # 12 groups wait (96 positions of 192): one version behind, one train batch fewer
    assert gate().decide(look(total=12)) == Take(BATCH)
    assert gate().decide(look(total=12, newest=6, mine=5)) == Take(4)


def test_a_version_past_the_bound_on_its_way_is_awaited_first() -> None:
    ahead = look(total=10, newest=9, mine=5, staged=5)
    assert gate().decide(ahead) == AwaitWeights((0, 9))
    # it did not come (the trainer restarted): the count decides with the weights held
    assert isinstance(gate().decide(replace(ahead, may_await=False)), Blocked)


def test_an_explorer_held_back_only_by_its_own_old_weights_loads_the_newest() -> None:
    late = look(total=18, newest=7, mine=5, will_sync=False)  # room with fresh weights only
    assert gate().decide(late) == LoadNewest(5)
    assert isinstance(gate().decide(replace(late, may_load=False)), Blocked)


def test_a_full_queue_blocks_and_the_pause_lasts_until_the_trainer_writes() -> None:
    blocked = gate().decide(look(total=24, trainer=8))
    assert blocked == Blocked(ahead=16, held_by_trainer=8, in_flight=0, hidden=False)
    assert isinstance(blocked, Blocked)
    assert gate().settle(blocked, None, ended=False, in_flight_now=0) == Pause(IDLE_LOOK_S)


def test_a_group_an_operator_holds_is_looked_at_again_soon_only_if_it_could_hide_room() -> None:
    # 24 groups, 2 of them in an operator's hands and maybe also downstream: counted
    # once, 22 would leave room for one task
    could = gate().decide(look(total=24, operators=2))
    assert isinstance(could, Blocked) and could.hidden
    assert gate().settle(could, None, ended=False, in_flight_now=0) == Pause(RECOUNT_S)
    # 40 groups: no double count can hide a group's room, so no early look
    cannot = gate().decide(look(total=40, operators=2))
    assert isinstance(cannot, Blocked) and not cannot.hidden
    assert gate().settle(cannot, None, ended=False, in_flight_now=0) == Pause(IDLE_LOOK_S)


def test_a_task_published_while_counting_brings_the_next_look_forward() -> None:
    blocked = gate().decide(look(total=22, in_flight=2))
    assert isinstance(blocked, Blocked)
    assert gate().settle(blocked, None, ended=False, in_flight_now=1) == Pause(RECOUNT_S)


def test_a_starving_trainer_is_never_stalled_and_an_ended_run_is_not_waited_for() -> None:
    blocked = gate().decide(look(total=24, trainer=24))  # all of it in the trainer's hands
    assert isinstance(blocked, Blocked) and blocked.ahead == 0
    starving = TrainerStarving(since=1.0, held=24)
    assert gate().settle(blocked, starving, ended=False, in_flight_now=0) == Take(BATCH)
    stale = TrainerStarving(since=1.0, held=8)  # said before more reached it
    assert gate().settle(blocked, stale, ended=False, in_flight_now=0) == Pause(IDLE_LOOK_S)
    assert gate().settle(blocked, None, ended=True, in_flight_now=0) == Take(BATCH)


def test_a_take_that_leaves_no_groups_room_waits_to_be_woken_before_the_next_look() -> None:
    # 20 groups wait: 32 positions are left, the take is 4 tasks (32): nothing is left
    full = look(total=20)
    take = gate().decide(full)
    assert take == Take(4)
    assert gate().room_after(full, 4) == 0
    assert gate().blocked_until_woken(gate().room_after(full, 4))
    # nothing changed: the next look is Blocked indeed (our 4 tasks now in flight)
    assert isinstance(gate().decide(look(total=20, in_flight=4)), Blocked)
    # room for more than this step: the next step looks at once
    roomy = look(total=4)
    assert gate().decide(roomy) == Take(BATCH)
    assert gate().room_after(roomy, BATCH) == 3 * TBS - 4 * GROUP - BATCH * GROUP
    assert not gate().blocked_until_woken(gate().room_after(roomy, BATCH))
    # unbounded, or unknown (a take a settle granted): look at once
    assert gate(None).room_after(full, 4) is None
    assert not gate().blocked_until_woken(None)


def test_weights_at_the_bound_with_less_than_a_batch_waiting_take_only_what_fits() -> None:
    """The trainer made version 7 and acked its batch, our fetcher still holds 5 (two
    behind: the bound) and 4 groups (32) are on their way to its next batch. Only the 32
    positions left in that batch are trained within the bound; a whole batch here put
    its last 4 groups one version past it (the smoke run's staleness 2 under a bound of
    1 at its fifth step, when staging a version lagged the trainer's ack)."""
    behind = look(total=4, newest=7, mine=5, staged=5)
    assert gate().decide(behind) == Take(4)
    assert gate(1).decide(look(total=4, newest=6, mine=5, staged=5)) == Take(4)
    # the same queue with the weights held past the bound: nothing fits; the version
    # on its way is awaited, and once that gave up, only a starving trainer is served
    past = look(total=4, newest=8, mine=5, staged=5)
    assert gate().decide(past) == AwaitWeights((0, 8))
    blocked = gate().decide(replace(past, may_await=False))
    assert blocked == Blocked(ahead=4, held_by_trainer=0, in_flight=0, hidden=False)
    # with all of it in the trainer's hands and the trainer starving, a batch is taken
    held = gate().decide(replace(look(total=4, trainer=4, newest=8, mine=5), may_load=False))
    assert isinstance(held, Blocked) and held.ahead == 0
    starving = TrainerStarving(since=1.0, held=4)
    assert gate().settle(held, starving, ended=False, in_flight_now=0) == Take(BATCH)


def test_the_other_explorers_tasks_in_flight_count_as_ahead_of_this_step() -> None:
    """Two explorers share the window: what another has in flight (or reserved) lands
    ahead of this step's groups, and keeps a starving trainer from being served twice."""
    # 12 groups queued, 8 tasks in flight at another explorer: 160 of 192 positions
    assert gate().decide(look(total=12, others=PeerWork(tasks=8))) == Take(4)
    assert gate().decide(look(total=12)) == Take(BATCH)  # what the gate saw before
    # the trainer holds all that is queued and starves, but another explorer's tasks are
    # on their way to it: not starving for this explorer's work
    blocked = gate().decide(look(total=24, trainer=24, others=PeerWork(tasks=8)))
    assert isinstance(blocked, Blocked) and blocked.ahead == 8 and not blocked.contended
    starving = TrainerStarving(since=1.0, held=24)
    assert gate().settle(blocked, starving, ended=False, in_flight_now=0) == Pause(IDLE_LOOK_S)


def test_of_two_gates_that_see_each_other_one_goes_on_and_one_waits() -> None:
    """Both reserved a batch and found no room for it: the one that goes first (fewer
    tasks claimed so far: ``PeerWork.yields`` is False for it) keeps its reservation and
    looks again at once; the other gives it back and waits."""
    full = look(total=24, trainer=24)  # no room even alone, and the trainer starves
    first = gate().decide(replace(full, others=PeerWork(tasks=8, reserved=8, yields=False)))
    second = gate().decide(replace(full, others=PeerWork(tasks=8, reserved=8, yields=True)))
    assert isinstance(first, Blocked) and first.contended and not first.yields
    assert isinstance(second, Blocked) and second.contended and second.yields
    starving = TrainerStarving(since=1.0, held=24)
    assert gate().settle(first, starving, ended=False, in_flight_now=0) == Pause(
        RECOUNT_S, keep_reservation=True
    )
    assert gate().settle(second, starving, ended=False, in_flight_now=0) == Pause(IDLE_LOOK_S)
    # once the other's reservation is given back, the first is served as a lone explorer
    alone = gate().decide(full)
    assert isinstance(alone, Blocked) and alone.ahead == 0
    assert gate().settle(alone, starving, ended=False, in_flight_now=0) == Take(BATCH)
