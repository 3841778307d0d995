"""Pure logic of bounded streams: purge points, loss accounting, fill, and the config keys."""

from __future__ import annotations

import warnings

import msgspec
import pytest
from nats.js.api import DiscardPolicy

from rftstream.bus.jetstream.records import stream_config
from rftstream.bus.transport import StreamSpec
from rftstream.config import config_from_dict
from rftstream.config.schema import NatsConfig, StreamLimitsConfig, StreamsConfig
from rftstream.config.stream_limits import StreamLimitWarning, limit_warnings, stream_limits
from rftstream.config.validate import validate_config
from rftstream.errors import ConfigError
from rftstream.retention.limits import (
    ConsumerFloor,
    experience_full,
    fill_ratio,
    first_forwardable,
    lost_below_head,
    purge_points,
    removed_by_limits,
)

RAW, TRAIN = "rft.r.exp.raw", "rft.r.exp.train"


def _brute_force_purgeable(stream: dict[int, str], consumers, keep: int) -> set[int]:
    """Sequences every durable consumer of their subject has acked, outside the keep window,
    on subjects some consumer reads: computed message by message."""
    last = max(stream)
    read = {c.filter for c in consumers}
    out = set()
    for seq, subject in stream.items():
        if subject not in read or seq > last - keep:
            continue
        if all(c.outstanding == 0 or seq <= c.ack_floor for c in consumers if c.filter == subject):
            out.add(seq)
    return out


@pytest.mark.parametrize("keep", [0, 3, 50])
def test_purge_points_remove_exactly_what_every_reader_acked(keep: int) -> None:
    # raw and train interleave; the operator acked raw up to 14, the trainer train up to 9
    stream = {seq: (RAW if seq % 3 else TRAIN) for seq in range(1, 31)}
    stream.update({31: "rft.r.exp.unread"})  # a stage nobody reads yet
    consumers = [
        ConsumerFloor("op_raw_to_train", RAW, 14, 10),
        ConsumerFloor("trainer", TRAIN, 9, 4),
    ]
    points = purge_points(1, 31, consumers, keep)
    purged = {seq for seq, subj in stream.items() if subj in points and seq < points[subj]}
    assert purged == _brute_force_purgeable(stream, consumers, keep)


def test_a_consumer_with_nothing_outstanding_bounds_nothing() -> None:
    consumers = [ConsumerFloor("trainer", TRAIN, 4, 0), ConsumerFloor("op", RAW, 7, 2)]
    assert purge_points(1, 20, consumers, 0) == {TRAIN: 21, RAW: 8}


def test_a_wildcard_reader_bounds_every_subject() -> None:
    consumers = [
        ConsumerFloor("trainer", TRAIN, 15, 1),
        ConsumerFloor("audit", "rft.r.exp.>", 5, 3),
    ]
    assert purge_points(1, 20, consumers, 0) == {TRAIN: 6}
    assert purge_points(8, 20, consumers, 0) == {}  # nothing below the head to purge
    assert purge_points(5, 4, consumers, 0) == {}  # an empty stream


def test_purges_are_batched() -> None:
    consumers = [ConsumerFloor("trainer", TRAIN, 15, 1), ConsumerFloor("op", RAW, 7, 2)]
    # train may go below 16 (15 above the head), raw below 8 (7 above it)
    assert purge_points(1, 20, consumers, 0, min_batch=8) == {TRAIN: 16}
    assert purge_points(1, 20, consumers, 0, min_batch=7) == {TRAIN: 16, RAW: 8}
    assert purge_points(1, 20, consumers, 0, min_batch=16) == {}


def test_a_subject_read_ahead_of_the_head_waits_for_a_batch_of_its_own() -> None:
    # the head (1) is train's, which the trainer holds back; the operator read all of raw,
    # which holds 3 messages: far above the head, but 3 messages are no batch of 8
    consumers = [ConsumerFloor("trainer", TRAIN, 0, 5), ConsumerFloor("op", RAW, 20, 0)]
    assert purge_points(1, 20, consumers, 0, min_batch=8) == {RAW: 21}  # stream-wide
    assert purge_points(1, 20, consumers, 0, 8, stored={RAW: 3, TRAIN: 17}) == {}
    assert purge_points(1, 20, consumers, 0, 8, stored={RAW: 8, TRAIN: 12}) == {RAW: 21}


def test_nothing_an_operator_may_forward_again_is_purged_after_its_source() -> None:
    # the operator's ack of raw 15 was lost: it may forward 15 again, and the first copy
    # (stored after 15) must stay for the server to recognise the repeat's Nats-Msg-Id
    consumers = [
        ConsumerFloor("op_raw_to_train", RAW, 14, 2),
        ConsumerFloor("trainer", TRAIN, 30, 1, forwards=False),
    ]
    hold = first_forwardable(consumers)
    assert hold == 15
    assert purge_points(1, 31, consumers, 0) == {RAW: 15, TRAIN: 31}
    assert purge_points(1, 31, consumers, 0, hold_from=hold) == {RAW: 15, TRAIN: 15}
    # the trainer publishes nothing: what it holds unacked holds nothing back
    assert first_forwardable([ConsumerFloor("trainer", TRAIN, 3, 5, forwards=False)]) is None
    # an operator that acked all it read forwards nothing again
    assert first_forwardable([ConsumerFloor("op", RAW, 3, 0)]) is None


def test_loss_and_removed_counts() -> None:
    floors = [
        ConsumerFloor("op", RAW, 3, 5),
        ConsumerFloor("trainer", TRAIN, 12, 0),  # caught up: not a loss
        ConsumerFloor("late", RAW, 10, 1),
    ]
    # head at 11: sequences 4..10 went under `op` (7 of them), none under `late`
    assert lost_below_head(11, floors) == [("op", 7)]
    assert removed_by_limits(first_seq=41, last_seq=60) == 40
    assert removed_by_limits(first_seq=0, last_seq=0) == 0


def test_fill_and_high_water() -> None:
    limits = StreamLimitsConfig(max_bytes=1000, max_msgs=10)
    assert fill_ratio(500, 9, limits) == pytest.approx(0.9)
    assert fill_ratio(700, 2, limits) == pytest.approx(0.7)
    assert experience_full(800, 1, limits) and experience_full(10, 8, limits)
    assert not experience_full(799, 7, limits)
    assert not experience_full(10**12, 10**9, StreamLimitsConfig())  # unlimited


def test_stream_limits_map_to_stream_spec_fields() -> None:
    out = stream_limits(StreamLimitsConfig(max_bytes=5, max_msgs=6, max_age=7.5, discard="old"))
    assert out == {"max_bytes": 5, "max_msgs": 6, "max_age": 7.5, "discard": "old"}
    spec = StreamSpec(name="S", subjects=("s",), **out)
    assert stream_config(spec).discard == DiscardPolicy.OLD  # as NATS gets it


def test_defaults_bound_every_stream_without_discarding_unread_work() -> None:
    s = StreamsConfig()
    for name in ("tasks", "experience", "dead_letter", "metrics"):
        assert getattr(s, name).max_bytes > 0, name
    assert s.tasks.discard == s.experience.discard == "new"
    assert s.experience.purge_acked
    assert limit_warnings(s) == []


def _cfg(**streams: dict):
    return config_from_dict({"nats": {"streams": streams}}, source="t.yaml")


@pytest.mark.parametrize(
    ("streams", "key"),
    [
        ({"experience": {"discard": "oldest"}}, "nats.streams.experience.discard"),
        ({"tasks": {"max_bytes": 0}}, "nats.streams.tasks.max_bytes"),
        ({"metrics": {"max_msgs": -5}}, "nats.streams.metrics.max_msgs"),
        ({"dead_letter": {"max_age": -1}}, "nats.streams.dead_letter.max_age"),
        ({"experience": {"keep_acked_msgs": -1}}, "nats.streams.experience.keep_acked_msgs"),
        ({"experience": {"keep_acked_s": -0.5}}, "nats.streams.experience.keep_acked_s"),
        ({"experience": {"keep_acked_s": float("nan")}}, "nats.streams.experience.keep_acked_s"),
        ({"experience": {"max_bytes": 1000}}, "nats.streams.experience.max_bytes"),
        ({"weights": {"max_msgs": 0}}, "nats.streams.weights.max_msgs"),
    ],
)
def test_bad_limits_name_their_key(streams: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=f"`{key}`"):
        validate_config(_cfg(**streams))


def test_unknown_stream_key_is_reported() -> None:
    with pytest.raises((ConfigError, msgspec.ValidationError), match="max_byte"):
        msgspec.convert({"streams": {"experience": {"max_byte": 1}}}, NatsConfig)


def test_lossy_settings_warn_naming_the_key() -> None:
    cfg = _cfg(experience={"discard": "old", "max_age": 60}, tasks={"discard": "old"})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        validate_config(cfg)
    texts = [str(w.message) for w in seen if issubclass(w.category, StreamLimitWarning)]
    assert any("`nats.streams.experience.discard`" in t for t in texts)
    assert any("`nats.streams.experience.max_age`" in t and "60s" in t for t in texts)
    assert any("`nats.streams.tasks.discard`" in t for t in texts)


def test_a_partial_table_keeps_that_streams_defaults() -> None:
    cfg = _cfg(tasks={"discard": "old"}, dead_letter={"max_msgs": 10})
    assert cfg.nats.streams.tasks.max_bytes == StreamsConfig().tasks.max_bytes > 0
    assert cfg.nats.streams.dead_letter.discard == "old"
    assert cfg.nats.streams.dead_letter.max_bytes == 256 * 1024**2


def test_a_limit_on_the_weights_stream_warns_naming_the_key() -> None:
    """The trainer bounds the weights stream itself; a limit of the user's can remove a
    chain explorers still need."""
    assert StreamsConfig().weights.max_bytes == -1
    cfg = _cfg(weights={"max_bytes": 10**9})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        validate_config(cfg)
    texts = [str(w.message) for w in seen if issubclass(w.category, StreamLimitWarning)]
    assert any("`nats.streams.weights`" in t and "keyframe" in t for t in texts), texts
