"""The dead-letter verdict (rftstream.actors.dead_letters.DeadLetterWindow) and its config keys."""

from __future__ import annotations

import pytest

from rftstream.actors.dead_letters import DeadLetterWindow, reason_kind
from rftstream.config import config_from_dict, validate_config
from rftstream.config.explain import explain_lines
from rftstream.errors import ConfigError

VOCAB = "trainer: experience {}: token ids outside the model's vocabulary (0..259)"


def test_all_of_a_full_window_dead_fails_naming_stage_and_reason() -> None:
    w = DeadLetterWindow(4, 1.0)
    for i in range(3):
        w.dead("train", VOCAB.format(f"9f{i}a77c01d2e3"))
    assert w.verdict() is None  # 3 of 4: not full yet
    w.dead("train", VOCAB.format("0b1c2d3e4f5a6b"))
    assert w.verdict() == (
        "the last 4 groups were all dead-lettered at stage train; most common reason (4x): "
        + VOCAB.format("9f0a77c01d2e3")
    )


def test_one_group_passing_in_the_window_keeps_the_run_going() -> None:
    w = DeadLetterWindow(4, 1.0)
    w.dead("tasks", "task 0/1: boom")
    w.passed()
    for _ in range(3):
        w.dead("tasks", "task 0/2: boom")
    assert w.verdict() is None
    w.dead("tasks", "task 0/3: boom")  # the passed group leaves the window
    assert w.verdict() is not None and w.verdict().startswith("the last 4 groups were all")


def test_share_below_one_and_mixed_stages() -> None:
    w = DeadLetterWindow(10, 0.5)
    for _ in range(6):
        w.passed()
    for _ in range(3):
        w.dead("raw", "reward_filter: ValueError: bad")
    w.dead("train", "trainer: decode failed")
    assert w.verdict() is None  # 4 of 10 < 0.5
    w.dead("train", "trainer: decode failed")  # 5 of the last 10
    assert w.verdict() == (
        "5 of the last 10 groups were dead-lettered at stages raw (3), train (2); "
        "most common reason (3x): reward_filter: ValueError: bad"
    )


def test_the_most_common_reason_counts_instances_of_one_cause_together() -> None:
    w = DeadLetterWindow(5, 1.0)
    for n in (23, 31):
        w.dead("tasks", f"task 0/{n}: prompt has {n} tokens, more than model.max_prompt_tokens=2")
    for n in range(3):
        w.dead("tasks", f"task 1/{n}: TimeoutError after {n + 60}.0 s")
    assert w.verdict().endswith("most common reason (3x): task 1/0: TimeoutError after 60.0 s")
    assert reason_kind("experience 'a-b': x=3") == reason_kind("experience 'c': x=41")


def test_a_run_that_ends_with_only_dead_letters_fails_even_before_the_window_fills() -> None:
    w = DeadLetterWindow(64, 1.0)
    for i in range(5):
        w.dead("tasks", f"task 0/{i}: boom")
    assert w.verdict() is None
    assert w.final_verdict(trained_steps=0) == (
        "no trainer step: all 5 groups of the run were dead-lettered at stage tasks; "
        "most common reason (5x): task 0/0: boom"
    )
    assert w.final_verdict(trained_steps=1) is None  # it trained: a short run, not a failure
    w.passed()
    assert w.final_verdict(trained_steps=0) is None  # a group reached the trainer


def test_window_zero_turns_it_off() -> None:
    w = DeadLetterWindow(0, 1.0)
    for _ in range(100):
        w.dead("train", "x")
    assert w.verdict() is None and w.final_verdict(0) is None


def test_config_keys_are_validated_and_explained() -> None:
    cfg = config_from_dict({"monitor": {"dead_letter_window": 16, "max_dead_letter_share": 0.5}})
    assert (cfg.monitor.dead_letter_window, cfg.monitor.max_dead_letter_share) == (16, 0.5)
    default = config_from_dict({})
    assert (default.monitor.dead_letter_window, default.monitor.max_dead_letter_share) == (64, 1.0)
    validate_config(cfg)  # raises nothing
    for key, bad in (
        ("max_dead_letter_share", 1.5),
        ("max_dead_letter_share", 0),
        ("dead_letter_window", -1),
    ):
        with pytest.raises(ConfigError, match=rf"monitor\.{key}.*got {bad}"):
            validate_config(config_from_dict({"monitor": {key: bad}}), "run.yaml")
    with pytest.raises(ConfigError, match=r"monitor\.dead_letter_windows"):
        config_from_dict({"monitor": {"dead_letter_windows": 3}})
    lines = explain_lines({"monitor": {"dead_letter_window": 16, "max_dead_letter_share": 0.5}}, [])
    assert lines == ["monitor.dead_letter_window = 16", "monitor.max_dead_letter_share = 0.5"]
