"""The run's account (:func:`rftstream.operations.account.reconcile`), the purge ledger's arithmetic
and :func:`rftstream.experience.experience_problem`: pure, with expected numbers worked out
here by hand from the streams each test builds."""

from __future__ import annotations

import math

import pytest
import torch
from rich.console import Console

from rftstream.account_cli import print_account, verdict
from rftstream.experience import EID, Experience, experience_problem
from rftstream.operations.account import DeadLetter, Durable, StoredMessage, TaskAccount, reconcile
from rftstream.retention.purged import PurgedPrefix, extend

RAW_OP = Durable("op_raw_to_train", "raw", "train", ack_floor=0, pending_messages=0)
TRAINER = Durable("trainer", "train", "trained", ack_floor=0, pending_messages=0, trainer=True)


def _ids(*n: int) -> tuple[str, ...]:
    return tuple(f"b/{i}/0/0/" for i in n)


def _durables(raw_floor: int, train_floor: int) -> list[Durable]:
    return [
        Durable("op_raw_to_train", "raw", "train", raw_floor, 0),
        Durable("trainer", "train", "trained", train_floor, 0, trainer=True),
    ]


def _pipeline() -> list[StoredMessage]:
    """exp.raw: 3 groups of 2 (seq 1-3) and one malformed (seq 4); exp.train: the groups of
    seq 1 and 3 (seq 5, 6): the group of seq 2 was filtered."""
    return [
        StoredMessage(1, "raw", _ids(1, 2)),
        StoredMessage(2, "raw", _ids(3, 4)),
        StoredMessage(3, "raw", _ids(5, 6)),
        StoredMessage(4, "raw", None, "not a rft.experience.v1 message"),
        StoredMessage(5, "train", _ids(1, 2)),
        StoredMessage(6, "train", _ids(5, 6)),
    ]


MALFORMED_DEAD = DeadLetter("raw", "rft.r.exp.raw", 4, "not a rft.experience.v1 message")


def test_a_finished_run_balances() -> None:
    acc = reconcile("r", _pipeline(), [MALFORMED_DEAD], _durables(4, 6), trained=4)
    assert acc.balanced and acc.settled and not acc.problems
    raw, train = acc.stages
    # 6 explored: 4 went on to exp.train, 2 (ids 3, 4) filtered; the malformed one dead
    assert (raw.experiences_in, raw.out, raw.filtered, raw.dead, raw.pending) == (6, 4, 2, 0, 0)
    assert (raw.malformed_in, raw.malformed_dead) == (1, 1)
    assert (train.experiences_in, train.out, train.dead, train.pending) == (4, 4, 0, 0)
    assert (acc.explored, acc.malformed, acc.filtered, acc.trained) == (6, 1, 2, 4)
    assert verdict(acc) == "BALANCED"


def test_an_experience_the_trainer_never_trained_is_lost() -> None:
    acc = reconcile("r", _pipeline(), [MALFORMED_DEAD], _durables(4, 6), trained=3)
    assert not acc.balanced
    assert acc.problems == [
        "1 experience(s) on exp.train were neither trained, dead-lettered nor pending: lost"
    ]
    assert verdict(acc).startswith("NOT BALANCED: 1 experience(s) on exp.train")


def test_training_more_than_arrived_is_trained_twice() -> None:
    acc = reconcile("r", _pipeline(), [MALFORMED_DEAD], _durables(4, 6), trained=6)
    assert not acc.balanced
    assert len(acc.problems) == 1 and "2 trained twice" in acc.problems[0]


def test_an_experience_stored_twice_on_a_stage_is_a_problem() -> None:
    msgs = [*_pipeline(), StoredMessage(7, "train", _ids(1))]  # id 1 again on exp.train
    acc = reconcile("r", msgs, [MALFORMED_DEAD], _durables(4, 7), trained=4)
    assert "1 experience(s) stored twice on exp.train (e.g. b/1/0/0/)" in acc.problems
    assert not acc.balanced


def test_an_experience_from_nowhere_is_a_problem() -> None:
    msgs = [*_pipeline(), StoredMessage(7, "train", _ids(99))]  # never on exp.raw
    acc = reconcile("r", msgs, [MALFORMED_DEAD], _durables(4, 7), trained=5)
    assert acc.problems == ["1 experience(s) on exp.train were never on exp.raw (e.g. b/99/0/0/)"]


def test_a_malformed_message_not_dead_lettered_unbalances_once_acked() -> None:
    acc = reconcile("r", _pipeline(), [], _durables(4, 6), trained=4)
    # acked (floor 4) yet no dead letter: it vanished
    assert acc.malformed == 1 and acc.malformed_dead == 0 and acc.malformed_pending == 0
    assert not acc.balanced and not acc.problems
    assert "1 malformed raw message(s) neither dead-lettered nor pending" in verdict(acc)


def test_pending_experience_keeps_the_account_balanced_but_unsettled() -> None:
    # the operator acked up to seq 2 (seq 3 and the malformed seq 4 pending); the trainer
    # acked seq 5 only, and trained those 2: the group of seq 6 is pending at the trainer
    msgs = _pipeline()[:4] + [StoredMessage(5, "train", _ids(1, 2))]
    acc = reconcile("r", msgs, [], _durables(2, 5), trained=2)
    raw, train = acc.stages
    assert (raw.pending, raw.malformed_pending, raw.filtered, raw.out) == (2, 1, 2, 2)
    assert (train.pending, train.out) == (0, 2)
    # explored 6 = trained 2 + filtered 2 (ids 3, 4) + dead 0 + pending 2 (ids 5, 6)
    assert acc.balanced and not acc.settled
    assert verdict(acc) == "BALANCED (messages still pending)"


def test_an_ack_floor_that_lags_its_acks_counts_only_the_unacked_as_pending() -> None:
    """After a server restart the trainer's floor stays at 4 (a gap it never closes) though
    it acked seq 5-8 and 11: the server says 1 delivered message is unacked (seq 12, the
    latest delivered) and seq 13 is not delivered yet. Pending: those 2 groups (4
    experiences), not the 6 groups past the floor."""
    raw = [StoredMessage(i, "raw", _ids(2 * i, 2 * i + 1)) for i in range(1, 5)]
    train = [
        StoredMessage(s, "train", _ids(2 * i, 2 * i + 1))
        for i, s in zip(range(1, 5), (5, 6, 7, 8), strict=True)
    ]
    raw += [StoredMessage(s, "raw", _ids(2 * s, 2 * s + 1)) for s in (9, 10)]
    train += [StoredMessage(s, "train", _ids(2 * s, 2 * s + 1)) for s in (11, 12, 13)]
    raw += [StoredMessage(s + 100, "raw", _ids(2 * s, 2 * s + 1)) for s in (11, 12, 13)]
    durables = [
        Durable("op_raw_to_train", "raw", "train", 200, 0, delivered=200, ack_pending=0),
        Durable("trainer", "train", "trained", 4, 2, trainer=True, delivered=12, ack_pending=1),
    ]
    acc = reconcile("r", raw + train, [], durables, trained=10)
    trainer = acc.stages[1]
    assert (trainer.experiences_in, trainer.out, trainer.pending) == (14, 10, 4)
    assert trainer.acked_above_floor == 5  # seq 5-8 and 11
    assert acc.balanced and not acc.settled and not acc.problems
    assert "5 message(s) past durable trainer's ack floor are acked" in str(acc)
    assert acc.trained_held == 0
    # the same floor taken at its word: 14 pending, so 10 of them would have to be trained
    # and held unacked (as a trainer with resumable checkpoints does until its next one)
    blind = [
        durables[0],
        Durable("trainer", "train", "trained", 4, 2, trainer=True),
    ]
    acc = reconcile("r", raw + train, [], blind, trained=10)
    assert acc.stages[1].pending == 14 and acc.trained_held == 10 and not acc.settled


def test_an_operator_whose_floor_lags_keeps_its_in_flight_message_pending() -> None:
    """The operator's floor lags at 0; seq 1 went on to exp.train, seq 2 was filtered (acked),
    seq 3 is in flight (the one unacked delivered message): it, not seq 2, is pending."""
    msgs = [
        StoredMessage(1, "raw", _ids(1, 2)),
        StoredMessage(2, "raw", _ids(3, 4)),
        StoredMessage(3, "raw", _ids(5, 6)),
        StoredMessage(4, "train", _ids(1, 2)),
    ]
    durables = [
        Durable("op_raw_to_train", "raw", "train", 0, 1, delivered=3, ack_pending=1),
        Durable("trainer", "train", "trained", 4, 0, trainer=True, delivered=4, ack_pending=0),
    ]
    acc = reconcile("r", msgs, [], durables, trained=2)
    op = acc.stages[0]
    assert (op.out, op.filtered, op.pending, op.acked_above_floor) == (2, 2, 2, 2)
    assert acc.balanced and not acc.problems


def test_dead_letters_count_at_the_stage_that_gave_up() -> None:
    dead = [
        MALFORMED_DEAD,
        DeadLetter("train", "rft.r.exp.train", 6, "trainer: reward is not finite"),
    ]
    acc = reconcile("r", _pipeline(), dead, _durables(4, 6), trained=2)
    raw, train = acc.stages
    assert (train.dead, train.out, train.dead_reasons["trainer: reward is not finite"]) == (2, 2, 1)
    assert acc.balanced and acc.dead_lettered == 2 and acc.dead_letters == 2


def test_a_purged_prefix_is_counted_from_its_record() -> None:
    # before these, raw had seq 1-10 purged: 9 groups of 2 experiences and 1 malformed message;
    # of those, 1 group was dead-lettered at raw (seq 3), the malformed (seq 7) too; train had
    # seq 11-14 purged: 4 groups, 8 experiences (all trained)
    purged = {
        "raw": PurgedPrefix(below_seq=11, messages=10, experiences=18, malformed=1),
        "train": PurgedPrefix(below_seq=15, messages=4, experiences=8, malformed=0),
    }
    msgs = [
        StoredMessage(9, "raw", _ids(90, 91)),  # below the record: counted there, ignored here
        StoredMessage(15, "raw", _ids(1, 2)),
        StoredMessage(16, "raw", _ids(3, 4)),
        StoredMessage(17, "train", _ids(1, 2)),
        StoredMessage(18, "train", _ids(40, 41)),  # from the purged prefix of exp.raw
    ]
    dead = [
        DeadLetter("raw", "rft.r.exp.raw", 3, "op: reward is not finite", experiences=2),
        DeadLetter("raw", "rft.r.exp.raw", 7, "not a rft.experience.v1 message"),
    ]
    acc = reconcile("r", msgs, dead, _durables(16, 18), trained=12, purged=purged)
    raw, train = acc.stages
    # raw: in 18 + 4 = 22; out: train's 4 stored + 8 purged = 12; dead 2; filtered 22-12-2 = 8
    assert (raw.experiences_in, raw.out, raw.dead, raw.filtered, raw.pending) == (22, 12, 2, 8, 0)
    assert (raw.malformed_in, raw.malformed_dead, raw.purged_messages) == (1, 1, 10)
    assert raw.checked_from_seq == 11
    # train: in 8 + 4 = 12, all trained
    assert (train.experiences_in, train.out, train.dead, train.pending) == (12, 12, 0, 0)
    assert acc.explored == 22 and acc.balanced, acc.problems
    assert "purged below sequence 11" in str(acc)


def test_a_purge_past_a_durables_ack_floor_is_reported() -> None:
    purged = {"train": PurgedPrefix(below_seq=10, messages=3, experiences=6)}
    msgs = _pipeline()
    acc = reconcile("r", msgs, [MALFORMED_DEAD], _durables(4, 6), trained=10, purged=purged)
    assert any("had acked only up to 6: unacked experience purged" in p for p in acc.problems)


def test_tasks_are_accounted_and_an_impossible_count_is_a_problem() -> None:
    tasks = TaskAccount(published=10, queued=3, failed=2)
    assert tasks.explored == 5 and tasks.problems() == []
    acc = reconcile("r", _pipeline(), [MALFORMED_DEAD], _durables(4, 6), 4, tasks=tasks)
    assert acc.balanced and acc.as_dict()["tasks"] == {
        "published": 10,
        "explored": 5,
        "failed": 2,
        "queued": 3,
    }
    bad = TaskAccount(published=4, queued=2, failed=3)
    acc = reconcile("r", _pipeline(), [MALFORMED_DEAD], _durables(4, 6), 4, tasks=bad)
    assert acc.problems == ["3 task(s) on dlq.tasks but only 2 left the tasks queue"]


def test_the_table_names_every_stage_and_the_verdict() -> None:
    acc = reconcile("r", _pipeline(), [MALFORMED_DEAD], _durables(4, 6), trained=4)
    console = Console(record=True, width=160)
    print_account(acc, console, title="r")
    text = console.export_text()
    assert "raw -> train" in text and "train -> trained" in text and "BALANCED" in text
    assert "explored 6 = trained 4 + filtered 2 + dead-lettered 0 + pending 0" in text


def test_extend_adds_only_the_new_part_of_a_prefix() -> None:
    rows = [(3, 2), (5, None), (8, 4), (12, 2)]  # (seq, Rft-Count) of one subject
    first = extend(PurgedPrefix(), rows, 6)  # seq 3 and 5
    assert first == PurgedPrefix(below_seq=6, messages=2, experiences=2, malformed=1)
    second = extend(first, rows, 13)  # seq 8 and 12 added, 3 and 5 not again
    assert second == PurgedPrefix(below_seq=13, messages=4, experiences=8, malformed=1)
    assert extend(second, rows, 9) is second  # an older point changes nothing


def _exp(**over: object) -> Experience:
    fields: dict = {
        "tokens": [5, 6, 7, 8],
        "prompt_length": 2,
        "reward": 0.5,
        "logprobs": [-1.0, -1.0],
        "eid": EID("b", 1, 0),
    }
    fields.update(over)
    return Experience(**fields)


@pytest.mark.parametrize(
    ("over", "expected"),
    [
        ({}, None),
        ({"reward": None}, None),
        ({"prompt_length": 4}, None),  # a prompt with no response: still inside its tokens
        ({"reward": math.nan}, "reward is not finite (nan)"),
        ({"reward": math.inf}, "reward is not finite (inf)"),
        ({"reward": -math.inf}, "reward is not finite (-inf)"),
        ({"prompt_length": 5}, "prompt_length 5 outside its 4 tokens"),
        ({"prompt_length": -1}, "prompt_length -1 outside its 4 tokens"),
    ],
)
def test_experience_problem(over: dict, expected: str | None) -> None:
    exp = _exp(**over)
    got = experience_problem(exp)
    if expected is None:
        assert got is None
    else:
        assert got == f"experience {exp.eid.uid}: {expected}"
    assert torch.is_tensor(exp.tokens)


def _info(name: str, subject: str, meta: dict[str, str] | None = None) -> object:
    from rftstream.bus.transport import ConsumerState

    return ConsumerState(
        name=name,
        filter_subject=subject,
        metadata=meta or {},
        ack_floor=7,
        num_pending=1,
        num_ack_pending=2,
    )


def test_a_durables_stages_come_from_its_filter_and_metadata_not_its_name() -> None:
    from types import SimpleNamespace

    from rftstream.operations.account import _durable
    from rftstream.subjects import RunNames

    bus = SimpleNamespace(names=RunNames("r"))
    # a stage named with "_to_" and one with "-": the name alone is ambiguous
    meta = {"rft.role": "operator", "rft.to_stage": "keep-best"}
    d = _durable(_info("op_a_to_b_to_keep_best", "rft.r.exp.a_to_b", meta), bus, set())
    assert (d.from_stage, d.to_stage, d.ack_floor, d.pending_messages) == (
        "a_to_b",
        "keep-best",
        7,
        3,
    )
    # created before the metadata existed: the name after op_<from>_to_, matched to a stage
    d = _durable(_info("op_a_to_b_to_keep_best", "rft.r.exp.a_to_b"), bus, {"keep-best", "raw"})
    assert (d.from_stage, d.to_stage, d.trainer) == ("a_to_b", "keep-best", False)
    t = _durable(_info("trainer_x", "rft.r.exp.x", {"rft.role": "trainer"}), bus, set())
    assert t.trainer and t.from_stage == "x"
    assert _durable(_info("op_x", "rft.other.exp.raw"), bus, set()) is None
