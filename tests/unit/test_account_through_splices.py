"""The run's account through spliced operators: the ``topology`` list says which stream
sequences of a stage the trainer read and which a spliced operator read, so a filter
spliced in front of the trainer (and out again, or still in at the end, or nested) is
counted as filtering, not as lost experience or experience trained twice.

The streams are built by hand; every expected number is worked out in the comments.
Common to all: exp.raw seq 1-6 holds 6 groups of 2, the operator host passed them all to
exp.train (seq 7-12, the same groups in order).
"""

from __future__ import annotations

from rich.console import Console

from rftstream.account_cli import print_account, verdict
from rftstream.operations.account import Durable, StoredMessage, reconcile
from rftstream.retention.purged import PurgedPrefix, extend
from rftstream.retention.reader_history import TRAINED, Segment, cut_seqs, reader_segments
from rftstream.wire import TopologyEdge


def _ids(group: int) -> tuple[str, ...]:
    return (f"b/{group}/0/0/", f"b/{group}/1/0/")


def _streams() -> list[StoredMessage]:
    raw = [StoredMessage(seq, "raw", _ids(seq)) for seq in range(1, 7)]
    train = [StoredMessage(seq, "train", _ids(seq - 6)) for seq in range(7, 13)]
    return raw + train


def _edge(op: str, from_stage: str, to_stage: str, seq: int) -> TopologyEdge:
    return TopologyEdge(op=op, from_stage=from_stage, to_stage=to_stage, by="f", seq=seq, ts=0.0)


SPLICE = _edge("splice", "train", "filtered", 9)  # exp.train from seq 9 on: the filter's
UNSPLICE = _edge("unsplice", "filtered", "train", 11)  # exp.train from seq 11 on: the trainer's
OP_HOST = Durable("op_raw_to_train", "raw", "train", 6, 0, delivered=6, ack_pending=0)


def _trainer(name: str, stage: str, floor: int, delivered: int | None = None, unacked: int = 0):
    return Durable(
        name,
        stage,
        "trained",
        floor,
        unacked,
        trainer=True,
        delivered=floor if delivered is None else delivered,
        ack_pending=unacked,
    )


def test_reader_segments_follow_the_topology() -> None:
    readers = reader_segments({("raw", "train")}, "train", [SPLICE, UNSPLICE])
    assert readers == {
        ("raw", "train"): [Segment("raw", "train", 0)],
        ("train", TRAINED): [Segment("train", TRAINED, 0, 9), Segment("train", TRAINED, 11)],
        ("train", "filtered"): [Segment("train", "filtered", 9, 11)],
        ("filtered", TRAINED): [Segment("filtered", TRAINED, 9)],
    }
    # no splice: the trainer reads its durable's stage from the start
    assert reader_segments({("raw", "train")}, "train", []) == {
        ("raw", "train"): [Segment("raw", "train", 0)],
        ("train", TRAINED): [Segment("train", TRAINED, 0)],
    }
    assert cut_seqs([SPLICE, UNSPLICE], "train") == [9, 11]
    assert cut_seqs([SPLICE, UNSPLICE], "raw") == []


def test_spliced_in_and_out_balances() -> None:
    """The filter read exp.train seq 9-10: it passed seq 9's group (exp.filtered seq 13) and
    dropped seq 10's. The trainer read seq 7-8, then exp.filtered, then seq 11-12 again: it
    trained 4 + 2 + 4 = 10. explored 12 = trained 10 + filtered 2. Its durables on
    exp.filtered and the filter's are gone (drained and deleted); a new ``trainer`` durable
    reads exp.train from seq 11."""
    msgs = [*_streams(), StoredMessage(13, "filtered", _ids(3))]
    durables = [OP_HOST, _trainer("trainer", "train", 12)]
    acc = reconcile("r", msgs, [], durables, trained=10, topology=[SPLICE, UNSPLICE])
    assert acc.balanced and acc.settled and not acc.problems, acc.problems
    rows = {(s.from_stage, s.to_stage): s for s in acc.stages}
    assert list(rows) == [
        ("raw", "train"),
        ("train", "filtered"),
        ("train", "trained"),
        ("filtered", "trained"),
    ]
    f = rows[("train", "filtered")]
    assert (f.experiences_in, f.out, f.filtered, f.pending, f.durable) == (4, 2, 2, 0, "-")
    assert rows[("train", "trained")].experiences_in == 8
    assert rows[("train", "trained")].sequences() == "1-8, 11-"
    assert rows[("filtered", "trained")].out == 2
    assert (acc.explored, acc.trained, acc.filtered) == (12, 10, 2)
    console = Console(record=True, width=200)
    print_account(acc, console, title="r")
    text = console.export_text()
    assert "train -> filtered" in text and "9-10" in text
    assert "explored 12 = trained 10 + filtered 2 + dead-lettered 0 + pending 0" in text
    assert verdict(acc) == "BALANCED"
    assert "exp.train sequences 9-10: read by the operator writing exp.filtered" in str(acc)


def test_a_run_that_ends_spliced_balances() -> None:
    """No removal: the filter read exp.train seq 9-12, passed seq 9 and 11 (exp.filtered seq
    13, 14), dropped 10 and 12. Trained: seq 7-8 (4) + exp.filtered (4) = 8; filtered 4.
    The trainer's old durable was drained and deleted; the filter's and the trainer's on
    exp.filtered are live and settled."""
    msgs = [
        *_streams(),
        StoredMessage(13, "filtered", _ids(3)),
        StoredMessage(14, "filtered", _ids(5)),
    ]
    durables = [
        OP_HOST,
        Durable("op_train_to_filtered", "train", "filtered", 12, 0, delivered=12, ack_pending=0),
        _trainer("trainer_filtered", "filtered", 14),
    ]
    acc = reconcile("r", msgs, [], durables, trained=8, topology=[SPLICE])
    assert acc.balanced and acc.settled and not acc.problems, acc.problems
    assert (acc.trained, acc.filtered) == (8, 4)
    # the same, counted by the durables alone (as before the topology was read): the
    # trainer looks as if it trained exp.train's 12 experiences it never read
    blind = reconcile("r", msgs, [], durables, trained=8)
    assert not blind.balanced


def test_a_running_splice_counts_what_is_in_flight_as_pending() -> None:
    """While spliced: the filter acked seq 9-10 (passed 9), holds seq 11 unacked and has not
    been given seq 12. The trainer's retired durable on exp.train still has seq 8 unacked
    (it is draining up to its cut, seq 8). Trained: seq 7 (2) + exp.filtered seq 13 (2) = 4.
    Pending: seq 8 at the trainer (2) + seq 11, 12 at the filter (4); filtered 2."""
    msgs = [*_streams(), StoredMessage(13, "filtered", _ids(3))]
    durables = [
        OP_HOST,
        _trainer("trainer", "train", 7, delivered=8, unacked=1),
        Durable("op_train_to_filtered", "train", "filtered", 10, 2, delivered=11, ack_pending=1),
        _trainer("trainer_filtered", "filtered", 13),
    ]
    acc = reconcile("r", msgs, [], durables, trained=4, topology=[SPLICE])
    rows = {(s.from_stage, s.to_stage): s for s in acc.stages}
    assert rows[("train", "trained")].pending == 2
    f = rows[("train", "filtered")]
    assert (f.out, f.filtered, f.pending) == (2, 2, 4)
    assert acc.balanced and not acc.settled and not acc.problems, acc.problems
    assert verdict(acc) == "BALANCED (messages still pending)"


def test_an_experience_lost_through_a_splice_is_not_balanced() -> None:
    """As in the in-and-out run, but the trainer trained only 8: one group (2) the filter
    passed, or the trainer read again, never got trained."""
    msgs = [*_streams(), StoredMessage(13, "filtered", _ids(3))]
    durables = [OP_HOST, _trainer("trainer", "train", 12)]
    acc = reconcile("r", msgs, [], durables, trained=8, topology=[SPLICE, UNSPLICE])
    assert not acc.balanced
    assert acc.problems == [
        "2 experience(s) on exp.train and exp.filtered were neither trained, dead-lettered "
        "nor pending: lost"
    ]
    twice = reconcile("r", msgs, [], durables, trained=12, topology=[SPLICE, UNSPLICE])
    assert not twice.balanced and "2 trained twice" in twice.problems[0]


def test_nested_splices_balance() -> None:
    """Splice a filter A in front of the trainer at exp.train seq 9 (it passes all: exp.a
    seq 13-16), then a filter B in front of it at seq 15 (B reads exp.a 15-16, passes 15 as
    exp.b seq 17, drops 16). Trained: exp.train 7-8 (4) + exp.a 13-14 (4) + exp.b 17 (2) =
    10; filtered 2."""
    msgs = [
        *_streams(),
        *(StoredMessage(seq, "a", _ids(seq - 10)) for seq in (13, 14, 15, 16)),
        StoredMessage(17, "b", _ids(5)),
    ]
    topology = [_edge("splice", "train", "a", 9), _edge("splice", "a", "b", 15)]
    durables = [
        OP_HOST,
        Durable("op_train_to_a", "train", "a", 12, 0, delivered=12, ack_pending=0),
        Durable("op_a_to_b", "a", "b", 16, 0, delivered=16, ack_pending=0),
        _trainer("trainer_b", "b", 17),
    ]
    acc = reconcile("r", msgs, [], durables, trained=10, topology=topology)
    assert acc.balanced and not acc.problems, acc.problems
    rows = {(s.from_stage, s.to_stage): s for s in acc.stages}
    assert [k for k in rows if k[1] != "trained"] == [("raw", "train"), ("train", "a"), ("a", "b")]
    assert (rows[("train", "a")].out, rows[("a", "b")].filtered) == (8, 2)
    assert rows[("a", "trained")].sequences() == "9-14"


def test_a_purged_prefix_is_split_at_the_cuts() -> None:
    """exp.train was purged below seq 11 (seq 7-10: 4 groups), its record keeping the count
    below the cut at seq 9 (2 groups, the trainer's). So of the purged 8 experiences, 4 were
    the trainer's and 4 the filter's; the filter's output (exp.filtered seq 13, seq 9's
    group) comes from its purged part. Trained 4 + 2 + 4 = 10, filtered 2."""
    rows = [(seq, 2) for seq in range(7, 13)]
    purged = {"train": extend(PurgedPrefix(), rows, 11, cuts=[9, 11])}
    assert purged["train"].splits == {9: (2, 4, 0), 11: (4, 8, 0)}
    msgs = [*_streams(), StoredMessage(13, "filtered", _ids(3))]
    durables = [OP_HOST, _trainer("trainer", "train", 12)]
    acc = reconcile("r", msgs, [], durables, 10, purged=purged, topology=[SPLICE, UNSPLICE])
    assert acc.balanced and not acc.problems and not acc.notes, acc.problems
    rows_by = {(s.from_stage, s.to_stage): s for s in acc.stages}
    f = rows_by[("train", "filtered")]
    assert (f.experiences_in, f.purged_experiences, f.out, f.filtered) == (4, 4, 2, 2)
    assert rows_by[("train", "trained")].experiences_in == 8  # 4 purged + seq 11-12


def test_a_purge_record_without_the_split_says_so() -> None:
    """A record written before its cut was known (an older release) counts the purged part
    at the stage's first reader, with a note; the totals still add up."""
    purged = {"train": PurgedPrefix(below_seq=11, messages=4, experiences=8)}
    msgs = [*_streams(), StoredMessage(13, "filtered", _ids(3))]
    durables = [OP_HOST, _trainer("trainer", "train", 12)]
    acc = reconcile("r", msgs, [], durables, 10, purged=purged, topology=[SPLICE, UNSPLICE])
    assert any("purged past a splice's cut" in n for n in acc.notes)
    assert acc.explored == 12


def test_a_purged_prefix_of_the_stage_a_splice_made_counts_at_its_reader() -> None:
    """The run of test_a_run_that_ends_spliced_balances, with exp.filtered purged below seq
    14 once the trainer acked seq 13 (seq 9's group). The trainer's reading of exp.filtered
    begins at the splice's seq 9, so the purged group (2 experiences) lies in it: trained
    4 (exp.train seq 7-8) + 2 purged + 2 (seq 14) = 8, filtered 4. The purge record keeps
    the count below seq 9 (none): the splice gave exp.filtered its first reader there."""
    assert cut_seqs([SPLICE, UNSPLICE], "filtered") == [9]
    msgs = [*_streams(), StoredMessage(14, "filtered", _ids(5))]
    durables = [
        OP_HOST,
        Durable("op_train_to_filtered", "train", "filtered", 12, 0, delivered=12, ack_pending=0),
        _trainer("trainer_filtered", "filtered", 14),
    ]
    recorded = extend(PurgedPrefix(), [(13, 2), (14, 2)], 14, cut_seqs([SPLICE], "filtered"))
    assert recorded.splits == {9: (0, 0, 0)}
    # a record without that split (written before the splice counted as a cut) is read alike
    older = PurgedPrefix(below_seq=14, messages=1, experiences=2)
    for record in (recorded, older):
        acc = reconcile(
            "r", msgs, [], durables, trained=8, purged={"filtered": record}, topology=[SPLICE]
        )
        assert acc.balanced and acc.settled and not acc.problems, acc.problems
        assert not acc.notes, acc.notes
        rows = {(s.from_stage, s.to_stage): s for s in acc.stages}
        f = rows[("filtered", "trained")]
        assert (f.experiences_in, f.purged_experiences, f.out) == (4, 2, 4)
        assert (acc.trained, acc.filtered) == (8, 4)


def test_trained_messages_held_until_a_checkpoint_are_not_trained_twice() -> None:
    """A running account: the trainer trained exp.train seq 7-8 and 11-12 and exp.filtered
    seq 13 (10) but holds seq 11-12 unacked until its next resumable checkpoint (its floor
    10, 2 delivered unacked). Those 4 are pending at its stage and trained: counted once, as
    trained. One more than pending can cover is trained twice."""
    msgs = [*_streams(), StoredMessage(13, "filtered", _ids(3))]
    durables = [OP_HOST, _trainer("trainer", "train", 10, delivered=12, unacked=2)]
    acc = reconcile("r", msgs, [], durables, trained=10, topology=[SPLICE, UNSPLICE])
    assert acc.balanced and not acc.settled and not acc.problems, acc.problems
    assert (acc.trained_held, acc.pending) == (4, 0)
    assert any("trained already" in n for n in acc.notes)
    over = reconcile("r", msgs, [], durables, trained=12, topology=[SPLICE, UNSPLICE])
    assert not over.balanced and "2 trained twice" in over.problems[0]
