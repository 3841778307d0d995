"""The splice protocol's pure state machines (rftstream.control.splice.protocol), on a fake clock:
every transition of the ``splice`` record, every event out of turn, the trainer's answer
(also after it died mid-answer), who owns a stage (a dead owner, a stale one taken over),
and the waiting sides' patience. No server, no sleeping."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgspec
import pytest

from rftstream.control.splice import ownership as o
from rftstream.control.splice import protocol as p
from rftstream.control.splice import watch as w
from rftstream.errors import SchemaError
from rftstream.wire import (
    SPLICE,
    STAGE,
    TOPOLOGY,
    TRAINER_INPUT,
    Heartbeat,
    Key,
    Owner,
    RetiredConsumer,
    SpliceAbandoned,
    SpliceAsked,
    SpliceClaimed,
    SpliceCut,
    SpliceDone,
    SpliceDrained,
    SpliceRecord,
    SpliceRefused,
    SpliceRequested,
    StageRecord,
    TopologyEdge,
    TrainerInput,
)
from tests.kv_json import write_json

T0 = 1000.0
TIMING = p.Timing(
    owner_stale_s=15.0, trainer_patience_s=90.0, asked_stale_s=60.0, check_every_s=3.0
)
OWNER = Owner(actor="filter", pid=7, host="h", ts=T0, token="tok")


def _requested_splice() -> SpliceRequested:
    record, actions = p.step(None, p.RequestSplice("s1", "reward_filter", "filtered", OWNER), T0)
    assert isinstance(record, SpliceRequested) and actions == [p.WriteSplice(record)]
    return record


def _asked() -> SpliceAsked:
    record, _ = p.step(None, p.AskUnsplice("u1", "reward_filter", "train", "filtered"), T0)
    assert isinstance(record, SpliceAsked)
    return record


def _unsplice_in(state: type) -> SpliceRecord:
    """An unsplice of exp.filtered (cut at 9) walked through the protocol up to ``state``."""
    record: SpliceRecord | None = _asked()
    path: list[tuple[type, p.Event]] = [
        (SpliceRequested, p.OwnerParked("u1", "reward_filter", "train", "filtered", 9)),
        (SpliceClaimed, p.Claim()),
        (SpliceCut, p.TrainerCut(consumer="trainer")),
        (SpliceDrained, p.OwnerDrained(20)),
        (SpliceDone, p.Close()),
    ]
    for cls, event in [(SpliceAsked, None), *path]:
        if event is not None:
            record, _ = p.step(record, event, T0 + 1)
        if cls is state:
            assert record is not None
            return record
    raise AssertionError(state)


def _splice_in(state: type) -> SpliceRecord:
    """A splice into exp.filtered walked through the protocol up to ``state``."""
    record: SpliceRecord | None = _requested_splice()
    cut = p.TrainerCut(consumer="trainer_filtered", from_stage="train", start_seq=5)
    for event in (p.Claim(), cut):
        if isinstance(record, state):
            break
        record, _ = p.step(record, event, T0 + 1)
    assert isinstance(record, state)
    return record


# ------------------------------------------------------------------ the splice record


def test_a_splice_from_request_to_cut() -> None:
    requested = _requested_splice()
    assert (requested.kind, requested.operator, requested.to_stage) == (
        "splice",
        "reward_filter",
        "filtered",
    )
    assert requested.owner == OWNER and requested.ts == T0 and p.in_flight(requested)
    claimed, actions = p.step(requested, p.Claim(), T0 + 2)
    assert isinstance(claimed, SpliceClaimed) and actions == [p.WriteSplice(claimed)]
    assert claimed.owner == OWNER and claimed.ts == T0 and claimed.ts_changed == T0 + 2
    cut, actions = p.step(
        claimed, p.TrainerCut(consumer="trainer_filtered", from_stage="train", start_seq=5), T0 + 3
    )
    assert isinstance(cut, SpliceCut) and actions == [p.WriteSplice(cut)]
    assert (cut.from_stage, cut.start_seq, cut.consumer) == ("train", 5, "trainer_filtered")
    assert not p.in_flight(cut)  # a splice is done at its cut


def test_an_unsplice_from_ask_to_done() -> None:
    asked = _asked()
    assert asked.kind == "unsplice" and p.in_flight(asked)
    requested, actions = p.step(
        asked, p.OwnerParked("u1", "reward_filter", "train", "filtered", 9), T0 + 1
    )
    assert isinstance(requested, SpliceRequested) and requested.cut_seq == 9
    assert requested.ts == T0 and actions == [p.WriteSplice(requested)]  # the ask, taken up
    claimed, _ = p.step(requested, p.Claim(), T0 + 2)
    cut, _ = p.step(claimed, p.TrainerCut(consumer="trainer"), T0 + 3)
    assert isinstance(cut, SpliceCut) and cut.from_stage == "train" and cut.start_seq is None
    assert p.in_flight(cut)  # an unsplice still drains after its cut
    drained, actions = p.step(cut, p.OwnerDrained(20), T0 + 4)
    assert isinstance(drained, SpliceDrained) and drained.drain_until == 20
    assert actions == [p.WriteSplice(drained), p.DeleteStage("filtered")]
    assert p.in_flight(drained) and p.trainer_to_act(drained) == p.Close()
    done, actions = p.step(drained, p.Close(), T0 + 5)
    assert isinstance(done, SpliceDone) and done.drain_until == 20 and done.cut_seq == 9
    assert actions == [p.WriteSplice(done)] and not p.in_flight(done)


def test_ctrl_c_starts_an_unsplice_without_an_ask() -> None:
    done_splice = _splice_in(SpliceCut)
    record, _ = p.step(
        done_splice, p.OwnerParked("u2", "reward_filter", "train", "filtered", 4), T0
    )
    assert isinstance(record, SpliceRequested) and record.kind == "unsplice"
    assert record.id == "u2" and record.owner is None and record.args == {}


EVENTS: dict[str, p.Event] = {
    "request": p.RequestSplice("s9", "op", "other", OWNER),
    "ask": p.AskUnsplice("u9", "op", "train", "other"),
    "parked": p.OwnerParked("u1", "reward_filter", "train", "filtered", 9),
    "abandon": p.Abandon("why"),
    "claim": p.Claim(),
    "cut": p.TrainerCut(consumer="c", from_stage="train", start_seq=3),
    "refuse": p.Refuse("no"),
    "drained": p.OwnerDrained(20),
    "close": p.Close(),
}

# (record, event) -> what happens: "write" (a new state written), "noop" (a repeat: no
# write), "delete" (only the stage record deleted), or None (illegal)
UNSPLICE_STATES: dict[type, dict[str, str | None]] = {
    SpliceAsked: {"parked": "write", "abandon": "write"},
    SpliceRequested: {"abandon": "write", "claim": "write"},
    SpliceClaimed: {"claim": "noop", "cut": "write", "refuse": "write"},
    SpliceCut: {"drained": "write"},
    SpliceDrained: {"drained": "delete", "close": "write"},
    SpliceDone: {"drained": "delete", "close": "noop", "request": "write", "ask": "write"},
}


@pytest.mark.parametrize("state", list(UNSPLICE_STATES), ids=lambda c: c.__name__)
@pytest.mark.parametrize("event", list(EVENTS))
def test_every_event_in_every_unsplice_state(state: type, event: str) -> None:
    record = _unsplice_in(state)
    expected = UNSPLICE_STATES[state].get(event)
    if expected is None:
        with pytest.raises(p.IllegalTransition, match=type(EVENTS[event]).__name__):
            p.step(record, EVENTS[event], T0 + 10)
        return
    new, actions = p.step(record, EVENTS[event], T0 + 10)
    if expected == "noop":
        assert new is record and actions == []
    elif expected == "delete":
        assert new is record and actions == [p.DeleteStage("filtered")]
    else:
        assert new is not record and isinstance(actions[0], p.WriteSplice)
        assert actions[0].record == new and new.ts_changed == T0 + 10


SPLICE_STATES: dict[type, dict[str, str | None]] = {
    SpliceRequested: {"abandon": "write", "claim": "write"},
    SpliceClaimed: {"claim": "noop", "cut": "write", "refuse": "write"},
    SpliceCut: {"request": "write", "ask": "write", "parked": "write"},
}


@pytest.mark.parametrize("state", list(SPLICE_STATES), ids=lambda c: c.__name__)
@pytest.mark.parametrize("event", list(EVENTS))
def test_every_event_in_every_splice_state(state: type, event: str) -> None:
    record = _splice_in(state)
    expected = SPLICE_STATES[state].get(event)
    if expected is None:
        with pytest.raises(p.IllegalTransition):
            p.step(record, EVENTS[event], T0 + 10)
        return
    new, actions = p.step(record, EVENTS[event], T0 + 10)
    assert (new is record) == (expected == "noop")
    assert [type(a) for a in actions] == ([] if expected == "noop" else [p.WriteSplice])


@pytest.mark.parametrize("final", ["refused", "abandoned"])
def test_a_refused_or_abandoned_change_makes_room_and_repeats_quietly(final: str) -> None:
    claimed = _splice_in(SpliceClaimed)
    if final == "refused":
        record, _ = p.step(claimed, p.Refuse("the trainer already reads exp.filtered"), T0)
        assert isinstance(record, SpliceRefused)
    else:
        record, _ = p.step(_requested_splice(), p.Abandon("no trainer answered"), T0)
        assert isinstance(record, SpliceAbandoned) and record.reason == "no trainer answered"
        assert p.step(record, p.Abandon("again"), T0 + 1) == (record, [])  # already
    assert not p.in_flight(record) and p.replaceable(record, T0)
    for name in ("claim", "cut", "drained", "close", "refuse"):
        with pytest.raises(p.IllegalTransition):
            p.step(record, EVENTS[name], T0 + 1)
    new, _ = p.step(record, EVENTS["request"], T0 + 1)
    assert isinstance(new, SpliceRequested) and new.id == "s9"


def test_with_no_record_only_a_new_change_starts() -> None:
    for name, event in EVENTS.items():
        if name in ("request", "ask", "parked"):
            new, actions = p.step(None, event, T0)
            assert new is not None and actions == [p.WriteSplice(new)]
        else:
            with pytest.raises(p.IllegalTransition, match="no change"):
                p.step(None, event, T0)


def test_a_stale_ask_may_be_replaced_on_the_fake_clock() -> None:
    asked = _asked()  # at T0
    request = p.RequestSplice("s2", "op", "other", OWNER)
    for now in (T0 + 1, T0 + TIMING.asked_stale_s):
        assert not p.replaceable(asked, now, TIMING)
        with pytest.raises(p.IllegalTransition):
            p.step(asked, request, now, TIMING)
    late = T0 + TIMING.asked_stale_s + 0.1
    new, _ = p.step(asked, request, late, TIMING)
    assert isinstance(new, SpliceRequested) and new.id == "s2" and new.ts == late
    # a stale ask of another id is replaced by an owner's own unsplice too
    mine = p.OwnerParked("u7", "op", "train", "other", 3)
    assert p.step(asked, mine, late, TIMING)[0].id == "u7"  # type: ignore[union-attr]
    # a short patience is configuration, not a constant
    quick = replace(TIMING, asked_stale_s=0.5)
    assert p.step(asked, request, T0 + 1, quick)[0].id == "s2"  # type: ignore[union-attr]


def test_a_requested_or_claimed_change_is_never_replaced() -> None:
    for record in (_requested_splice(), _splice_in(SpliceClaimed), _unsplice_in(SpliceCut)):
        assert not p.replaceable(record, T0 + 10_000)
        with pytest.raises(p.IllegalTransition):
            p.step(record, EVENTS["request"], T0 + 10_000)


def test_a_splice_cut_without_its_sequence_is_illegal() -> None:
    with pytest.raises(p.IllegalTransition, match="from_stage and start_seq"):
        p.step(_splice_in(SpliceClaimed), p.TrainerCut(consumer="c"), T0)


def test_the_owner_cannot_take_up_its_own_request_twice() -> None:
    requested = _unsplice_in(SpliceRequested)
    with pytest.raises(p.IllegalTransition):
        p.step(requested, EVENTS["parked"], T0)


def test_unsplice_in_flight_names_the_stage() -> None:
    cut = _unsplice_in(SpliceCut)
    assert p.unsplice_in_flight(cut) and p.unsplice_in_flight(cut, "filtered")
    assert not p.unsplice_in_flight(cut, "other")
    assert not p.unsplice_in_flight(_requested_splice())
    assert not p.unsplice_in_flight(None) and not p.in_flight(None)


def test_trainer_to_act() -> None:
    assert p.trainer_to_act(_requested_splice()) == p.Claim()
    assert p.trainer_to_act(_splice_in(SpliceClaimed)) == p.Claim()  # claimed, then died
    assert p.trainer_to_act(_unsplice_in(SpliceDrained)) == p.Close()
    for record in (None, _asked(), _splice_in(SpliceCut), _unsplice_in(SpliceDone)):
        assert p.trainer_to_act(record) is None


# ------------------------------------------------------------------ the trainer's answer


def test_trainer_plan_splice() -> None:
    claimed = _splice_in(SpliceClaimed)
    assert isinstance(claimed, SpliceClaimed)
    assert p.trainer_plan(claimed, "train", None) == p.SwitchIn("filtered")
    refused = p.trainer_plan(claimed, "filtered", None)
    assert refused == p.Refuse("the trainer already reads exp.filtered")
    # the trainer switched, then died (or its poll failed) before answering
    switched = TrainerInput(
        stage="filtered", consumer="trainer_filtered", splice_id="s1", from_stage="train",
        start_seq=5,
    )  # fmt: skip
    assert p.trainer_plan(claimed, "filtered", switched) == p.AnswerAgain("train", 5)
    # an earlier switch of another id is no reason to answer again
    other = msgspec.structs.replace(switched, splice_id="old")
    assert isinstance(p.trainer_plan(claimed, "filtered", other), p.Refuse)


def test_trainer_plan_unsplice() -> None:
    claimed = _unsplice_in(SpliceClaimed)
    assert isinstance(claimed, SpliceClaimed)
    assert p.trainer_plan(claimed, "filtered", None) == p.SwitchBack("train", 10)
    plan = p.trainer_plan(claimed, "f2", None)
    assert plan == p.Refuse("the trainer reads exp.f2, not exp.filtered")
    switched = TrainerInput(stage="train", consumer="trainer", splice_id="u1")
    assert p.trainer_plan(claimed, "train", switched) == p.AnswerAgain("filtered", 10)
    broken = msgspec.structs.replace(claimed, cut_seq=None)
    assert isinstance(p.trainer_plan(broken, "filtered", None), p.Refuse)


def test_with_edge_records_each_change_once() -> None:
    edge = TopologyEdge(
        op="splice", from_stage="train", to_stage="f", by="op", seq=5, ts=T0, splice_id="s1"
    )
    edges = p.with_edge([], edge)
    assert edges == [edge]
    assert p.with_edge(edges, replace_edge(edge, seq=6)) is None  # a retried answer
    back = replace_edge(edge, op="unsplice", splice_id="u1")
    assert p.with_edge(edges, back) == [edge, back]
    anonymous = replace_edge(edge, splice_id=None)
    assert p.with_edge([anonymous], anonymous) == [anonymous, anonymous]


def replace_edge(edge: TopologyEdge, **fields: Any) -> TopologyEdge:
    return msgspec.structs.replace(edge, **fields)


# ------------------------------------------------------------------ who serves a stage


def _stage(owner: Owner = OWNER) -> StageRecord:
    return StageRecord(
        operator="reward_filter",
        args={"threshold": 0.5},
        from_stage="train",
        to_stage="filtered",
        durable="op_train_to_filtered",
        start_seq=5,
        owner=owner,
    )


def test_owner_alive_by_pid_here_and_by_age_elsewhere() -> None:
    assert o.owner_alive(OWNER, T0 + 1, None, TIMING)
    assert not o.owner_alive(OWNER, T0 + TIMING.owner_stale_s, None, TIMING)
    assert not o.owner_alive(OWNER, T0 + 1, False, TIMING)  # its pid is gone on this host
    assert o.owner_alive(OWNER, T0 + 1, True, TIMING)
    assert not o.owner_alive(None, T0)


def test_claim_owner_takes_a_stale_or_dead_stage_over() -> None:
    me = Owner(actor="filter-b", pid=8, host="h2", ts=T0 + 100, token="b")
    with pytest.raises(o.StageTaken, match="already served by 'filter'"):
        o.claim_owner(_stage(), me, T0 + 1, None, TIMING)
    stale = o.claim_owner(_stage(), me, T0 + TIMING.owner_stale_s + 1, None, TIMING)
    assert stale.owner == me and stale.durable == "op_train_to_filtered"
    dead = o.claim_owner(_stage(), me, T0 + 1, False, TIMING)  # its pid is gone
    assert dead.owner == me
    same_process = msgspec.structs.replace(me, pid=OWNER.pid, host=OWNER.host, token="new")
    assert o.claim_owner(_stage(), same_process, T0 + 1, True, TIMING).owner == same_process


def test_refresh_owner_stops_when_taken_over_or_unspliced() -> None:
    refreshed = o.refresh_owner(_stage(), OWNER, T0 + 2, TIMING)
    assert refreshed is not None and refreshed.owner.ts == T0 + 2
    assert refreshed.owner.token == OWNER.token
    other = Owner(actor="filter-b", pid=8, host="elsewhere", ts=T0, token="b")
    with pytest.raises(o.TakenOver, match="'filter-b' \\(pid 8 on elsewhere\\) took the stage"):
        o.refresh_owner(_stage(other), OWNER, T0 + 2, TIMING)
    new_token = msgspec.structs.replace(OWNER, token="other claim")
    with pytest.raises(o.TakenOver):  # the same process's later claim is another claim
        o.refresh_owner(_stage(new_token), OWNER, T0 + 2, TIMING)
    assert o.refresh_owner(None, OWNER, T0 + 2, TIMING) is None


def test_restart_hint_and_dead_stage_message() -> None:
    hint = o.restart_hint(_stage())
    assert hint == (
        "rftstream operator reward_filter --args '{\"threshold\": 0.5}' --splice --to filtered"
        " --config C --nats-url U"
    )
    message = o.dead_stage_message(_stage(), T0 + 42)
    assert "last seen 42s ago" in message and hint in message
    assert "--unsplice filtered" in message
    never = _stage(Owner(actor="filter"))
    assert "never started" in o.dead_stage_message(never, T0)


# ------------------------------------------------------------------ the waiting sides

ALIVE = w.Health("running", ended=False, trainer_alive=True)
NO_TRAINER = w.Health("running", ended=False, trainer_alive=False)


def test_answer_watch_waits_for_the_answer() -> None:
    requested = _requested_splice()
    watch = w.AnswerWatch.start("splice x", "s1", (SpliceCut,), T0, TIMING)
    assert watch.health_due(T0)
    watch, verdict = watch.step(requested, T0, ALIVE)
    assert verdict == w.KeepWaiting() and not watch.health_due(T0 + TIMING.check_every_s)
    assert watch.health_due(T0 + TIMING.check_every_s + 0.1)
    cut = _splice_in(SpliceCut)
    assert watch.step(cut, T0 + 1)[1] == w.Answered(cut)


def test_answer_watch_gives_up_after_its_patience_on_the_fake_clock() -> None:
    requested = _requested_splice()
    watch = w.AnswerWatch.start("splice x", "s1", (SpliceCut,), T0, TIMING, patience=10.0)
    now = T0
    while now <= T0 + 10.0:
        watch, verdict = watch.step(requested, now, NO_TRAINER)
        assert verdict == w.KeepWaiting(), now
        now += 4.0
    watch, verdict = watch.step(requested, now, NO_TRAINER)
    assert isinstance(verdict, w.NoTrainer) and "for 10s" in verdict.message
    # a live trainer in between restarts the patience
    watch = w.AnswerWatch.start("splice x", "s1", (SpliceCut,), T0, TIMING, patience=10.0)
    watch, _ = watch.step(requested, T0 + 8, ALIVE)
    assert watch.step(requested, T0 + 17, NO_TRAINER)[1] == w.KeepWaiting()
    assert isinstance(watch.step(requested, T0 + 18.5, NO_TRAINER)[1], w.NoTrainer)
    # without a health reading, time alone decides nothing
    assert watch.step(requested, T0 + 1000)[1] == w.KeepWaiting()


def test_answer_watch_fails_when_replaced_refused_or_the_run_ended() -> None:
    watch = w.AnswerWatch.start("splice x", "s1", (SpliceCut,), T0, TIMING)
    for record in (None, _asked()):
        verdict = watch.step(record, T0)[1]
        assert isinstance(verdict, w.Failed) and "replaced by another" in verdict.message
    refused, _ = p.step(_splice_in(SpliceClaimed), p.Refuse("it reads it"), T0)
    assert watch.step(refused, T0)[1] == w.Failed("splice x: it reads it")
    ended = w.Health("finished", ended=True, trainer_alive=True)
    assert watch.step(_requested_splice(), T0, ended)[1] == w.Failed(
        "splice x: the run is finished"
    )


def _unsplice_watch(patience: float = 10.0) -> w.UnspliceWatch:
    return w.UnspliceWatch.start("filtered", "u1", T0, TIMING, patience)


def test_unsplice_watch_answers_when_drained() -> None:
    for state in (SpliceDrained, SpliceDone):
        record = _unsplice_in(state)
        assert _unsplice_watch().step(record, None, T0)[1] == w.Answered(record)


@pytest.mark.parametrize("state", [SpliceRequested, SpliceClaimed, SpliceCut])
def test_unsplice_watch_gives_up_when_the_owner_died_after_taking_the_request(
    state: type,
) -> None:
    record = _unsplice_in(state)
    verdict = _unsplice_watch().step(record, _stage(), T0 + 1, owner_pid_alive=False)[1]
    assert isinstance(verdict, w.OwnerGone) and not verdict.abandon_first
    message = verdict.message()
    assert "stopped in the middle of removing itself" in message
    assert repr(p.state_of(record)) in message and "--splice --to filtered" in message
    # the same owner, silent for too long on another host
    stale = T0 + TIMING.owner_stale_s + 1
    assert isinstance(_unsplice_watch().step(record, _stage(), stale)[1], w.OwnerGone)


def test_unsplice_watch_abandons_an_ask_whose_owner_died() -> None:
    verdict = _unsplice_watch().step(_asked(), _stage(), T0 + 1, owner_pid_alive=False)[1]
    assert isinstance(verdict, w.OwnerGone) and verdict.abandon_first
    assert verdict.message().endswith("then retry")
    assert verdict.message("abandoned").endswith("then retry")
    taken = verdict.message("requested")  # the owner took it up before it could be abandoned
    assert "'requested'" in taken and "resumes the removal" in taken


def test_unsplice_watch_reports_a_missing_trainer_only_while_the_request_waits_for_one() -> None:
    for state, gives_up in [(SpliceRequested, True), (SpliceClaimed, True), (SpliceCut, False)]:
        record = _unsplice_in(state)
        watch = _unsplice_watch(patience=10.0)
        watch, verdict = watch.step(record, _stage(), T0 + 1, True, NO_TRAINER)
        assert verdict == w.KeepWaiting()
        verdict = watch.step(record, _stage(), T0 + 11, True, NO_TRAINER)[1]
        if gives_up:
            assert isinstance(verdict, w.NoTrainer) and "restarted trainer" in verdict.message
        else:  # the owner drains: no trainer needed for that
            assert verdict == w.KeepWaiting()


def test_unsplice_watch_gives_up_when_the_run_ended() -> None:
    ended = w.Health("stopped", ended=True, trainer_alive=False)
    verdict = _unsplice_watch().step(_unsplice_in(SpliceCut), _stage(), T0 + 1, True, ended)[1]
    assert verdict == w.Failed("--unsplice filtered: the run is stopped; the stage was not removed")
    replaced = _unsplice_watch().step(_requested_splice(), _stage(), T0 + 1)[1]
    assert isinstance(replaced, w.Failed) and "replaced" in replaced.message


def test_a_final_trainer_heartbeat_is_not_a_live_trainer() -> None:
    hb = Heartbeat(actor="t", role="trainer", ts=T0)
    assert w.trainer_alive({"t": hb}, T0 + 29, TIMING)
    assert not w.trainer_alive({"t": hb}, T0 + 30, TIMING)
    last = Heartbeat(actor="t", role="trainer", ts=T0, status="finished")
    assert not w.trainer_alive({"t": last}, T0 + 1, TIMING)
    explorer = Heartbeat(actor="e", role="explorer", ts=T0)
    assert not w.trainer_alive({"e": explorer}, T0 + 1, TIMING)
    assert not w.trainer_alive({}, T0, TIMING)


# ------------------------------------------------------------------ the stage chain


def test_input_of_and_durable_names() -> None:
    assert p.input_of(None) == ("train", "trainer")
    assert p.input_of(TrainerInput(stage="my-stage", consumer="")) == (
        "my-stage",
        "trainer_my_stage",
    )
    assert p.trainer_durable("train") == "trainer"


def test_stage_chain_walks_back_from_the_trainer() -> None:
    def stage(op: str, src: str, dst: str) -> StageRecord:
        return StageRecord(
            operator=op, from_stage=src, to_stage=dst, durable="d", owner=Owner(actor=op)
        )

    stages = {"b": stage("opb", "a", "b"), "a": stage("opa", "train", "a")}
    chain = p.stage_chain(TrainerInput(stage="b", consumer="trainer_b"), stages)
    assert [(c["stage"], c["operator"]) for c in chain] == [
        ("raw", None),
        ("train", None),
        ("a", "opa"),
        ("b", "opb"),
    ]
    loop = {"x": stage("o", "x", "x")}
    looped = p.stage_chain(TrainerInput(stage="x", consumer="t"), loop)
    assert [c["stage"] for c in looped] == ["raw", "train", "x"]  # no hang


# ------------------------------------------------------------------ on the wire


def test_records_read_what_nats_kv_get_showed_before() -> None:
    """The JSON written before the typed records (extra timestamps and all) still decodes."""
    old = {
        "id": "u1",
        "kind": "unsplice",
        "state": "drained",
        "operator": "reward_filter",
        "from_stage": "train",
        "to_stage": "filtered",
        "cut_seq": 9,
        "drain_until": 20,
        "ts": T0,
        "ts_requested": T0,
        "ts_drained": T0,
    }
    record = msgspec.json.decode(msgspec.json.encode(old), type=SPLICE.type)
    assert isinstance(record, SpliceDrained) and record.drain_until == 20
    assert SPLICE.convert(old) == record
    encoded = msgspec.json.decode(msgspec.json.encode(record))
    assert encoded == {  # every field written, as `nats kv get` shows it
        **{k: v for k, v in old.items() if not k.startswith("ts_")},
        "args": {},
        "owner": None,
        "consumer": None,
        "ts_changed": 0.0,
    }
    assert SPLICE.convert({"state": "cut"}) is None  # no id: not a record
    assert SPLICE.convert({"id": "x", "state": "weird"}) is None
    edge = TopologyEdge(op="splice", from_stage="a", to_stage="b", by="op", seq=1, ts=T0)
    assert msgspec.json.decode(msgspec.json.encode(edge))["from"] == "a"
    assert TOPOLOGY.convert([{"op": "unsplice", "from": "b", "to": "a", "by": None, "seq": 2,
                              "ts": T0}])[0].to_stage == "a"  # type: ignore[index]  # fmt: skip
    ti = TRAINER_INPUT.convert(
        {"stage": "f", "consumer": "trainer_f", "retired": [{"consumer": "trainer"}]}
    )
    assert ti is not None and ti.retired == [RetiredConsumer(consumer="trainer")]


def test_key_templates() -> None:
    key = STAGE.of(stage="filtered")
    assert key == Key("stage.filtered", StageRecord) and STAGE.name == "stage.{stage}"


@pytest.mark.anyio
async def test_run_state_typed_records() -> None:
    from rftstream.bus.memory import MemoryTransport
    from rftstream.bus.state import RunState

    state = RunState(await MemoryTransport().kv("rft_t_state", create=True))
    assert await state.get(SPLICE) is None and await state.entry(SPLICE) == (None, None)
    requested = _requested_splice()
    rev = await state.cas(SPLICE, requested, None)
    assert rev is not None and await state.cas(SPLICE, requested, None) is None  # exists
    record, got_rev = await state.entry(SPLICE)
    assert record == requested and got_rev == rev
    claimed, _ = p.step(record, p.Claim(), T0)
    assert await state.cas(SPLICE, claimed, rev) is not None
    assert await state.cas(SPLICE, claimed, rev) is None  # moved on
    assert isinstance(await state.get(SPLICE), SpliceClaimed)
    await state.put(STAGE.of(stage="f"), _stage())
    assert await state.get(STAGE.of(stage="f")) == _stage()
    await write_json(state, TRAINER_INPUT.name, {"stage": 3})
    with pytest.raises(SchemaError, match="trainer.input"):
        await state.get(TRAINER_INPUT)
