"""Which durable of an experience stream is a trainer's (``reads_for_trainer``): the one
rule the run's account and the purge rules share (a trainer's durable forwards nothing, so
the purge need not keep what it has yet to ack for deduplication)."""

from __future__ import annotations

import pytest

from rftstream.subjects import RunNames, reads_for_trainer

NAMES = RunNames("r")
TRAIN, RAW = NAMES.exp_subject("train"), NAMES.exp_subject("raw")


@pytest.mark.parametrize(
    ("name", "subject", "meta", "trainer"),
    [
        ("trainer", TRAIN, {"rft.role": "trainer"}, True),
        ("trainer_next", TRAIN, {"rft.role": "trainer"}, True),  # a splice's new trainer durable
        ("trainer", TRAIN, {}, True),  # an older release's, without metadata
        ("mine", TRAIN, {}, True),  # a user's own durable on exp.train, no role: a trainer's
        ("op_raw_to_train", RAW, {"rft.role": "operator"}, False),
        ("op_filter_to_train", TRAIN, {}, False),  # an operator's, by its name
        ("audit", TRAIN, {"rft.role": "operator"}, False),  # a role says so, whatever it reads
        ("watch", RAW, {}, False),
    ],
)
def test_which_durable_is_a_trainers(
    name: str, subject: str, meta: dict[str, str], trainer: bool
) -> None:
    assert reads_for_trainer(name, subject, meta) is trainer


def test_the_run_names_its_trainer_durable_as_the_rule_does() -> None:
    assert reads_for_trainer(NAMES.trainer_consumer, NAMES.exp_subject("train"), {})
