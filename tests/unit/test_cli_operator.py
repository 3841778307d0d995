"""`rftstream operator NAME|module:Class --args JSON`: every failure is one line naming the
operator and its args; a class that is not an ExperienceOperator is refused."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import pytest

from operators import ExperiencePipeline, RewardFilter
from rftstream.cli import _operator_pipeline
from rftstream.errors import RftError
from rftstream.wire import Heartbeat

MODULE = """
from operators import ExperienceOperator


class NotAnOperator:
    def process(self, exps):
        return exps, {}


class Grumpy(ExperienceOperator):
    def __init__(self, mood: str = "bad") -> None:
        raise RuntimeError(f"refusing to start:\\n  mood is {mood}\\n  (really)")

    def process(self, exps):
        return exps, {}


class NoProcess(ExperienceOperator):
    pass


def make_filter():
    return None
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_ops_cli.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_ops_cli"
    sys.modules.pop("user_ops_cli", None)


def ns(operator: str, args: str = "{}", to: str | None = "out") -> argparse.Namespace:
    return argparse.Namespace(operator=operator, args=args, to_stage=to)


def error_of(namespace: argparse.Namespace) -> str:
    with pytest.raises(RftError) as info:
        _operator_pipeline(namespace)
    text = str(info.value)
    assert "\n" not in text, text  # one line
    return text


def test_registered_operator_builds_a_pipeline() -> None:
    pipe = _operator_pipeline(ns("reward_filter", '{"threshold": 0.3}'))
    assert isinstance(pipe, ExperiencePipeline)
    [op] = pipe.operators
    assert isinstance(op, RewardFilter) and op.threshold == 0.3
    assert _operator_pipeline(argparse.Namespace(operator=None)) is None  # the configured one


def test_constructor_errors_name_the_operator_and_args(user_module: str) -> None:
    text = error_of(ns("staleness_filter", '{"max_staleness": -1}'))
    assert "operator 'staleness_filter' (StalenessFilter)" in text
    assert '--args {"max_staleness": -1}' in text and "ValueError" in text
    text = error_of(ns("reward_filter", '{"treshold": 1}'))  # a typo: TypeError
    assert "operator 'reward_filter'" in text and "TypeError" in text and "treshold" in text
    text = error_of(ns(f"{user_module}:Grumpy", '{"mood": "awful"}'))
    assert f"operator '{user_module}:Grumpy' (Grumpy)" in text
    assert "RuntimeError: refusing to start: mood is awful (really)" in text
    text = error_of(ns(f"{user_module}:NoProcess"))  # abstract: cannot be built
    assert "NoProcess" in text and "abstract" in text


def test_a_class_that_is_not_an_operator_is_refused(user_module: str) -> None:
    text = error_of(ns(f"{user_module}:NotAnOperator"))
    assert "NotAnOperator is not an ExperienceOperator" in text
    assert "operators.ExperienceOperator" in text
    text = error_of(ns(f"{user_module}:make_filter"))
    assert "is not an ExperienceOperator" in text and "function" in text


def test_bad_names_and_args() -> None:
    assert "registered:" in error_of(ns("no_such_operator"))
    assert "cannot import module" in error_of(ns("no_such_module_xyz:Op"))
    assert "not valid JSON" in error_of(ns("reward_filter", "{threshold: 1}"))
    assert "expected a JSON object" in error_of(ns("reward_filter", "[1]"))
    assert "--to" in error_of(ns("reward_filter", to=None))


def test_an_actors_error_inside_a_task_group_is_one_line(monkeypatch, capsys) -> None:
    import anyio

    from rftstream import cli

    async def actors() -> None:
        async with anyio.create_task_group() as tg:

            async def fail() -> None:
                raise RftError("splice reward_filter -> exp.f: no trainer [is running]")

            tg.start_soon(fail)
            tg.start_soon(anyio.sleep, 10)

    monkeypatch.setattr(cli, "cmd_status", lambda args: anyio.run(actors) or 0)
    assert cli.main(["status", "--nats-url", "nats://127.0.0.1:9"]) == 2
    out = capsys.readouterr().out
    assert out.strip() == "error: splice reward_filter -> exp.f: no trainer [is running]"

    async def bug() -> None:
        async with anyio.create_task_group() as tg:

            async def fail() -> None:
                raise KeyError("a bug")

            tg.start_soon(fail)

    monkeypatch.setattr(cli, "cmd_status", lambda args: anyio.run(bug) or 0)
    with pytest.raises(BaseException, match="unhandled errors"):  # a bug keeps its traceback
        cli.main(["status", "--nats-url", "nats://127.0.0.1:9"])


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (["operator", "reward_filter", "--splice", "--to", "filtered"], "reward_filter-filtered"),
        (["operator", "my_ops:DropFlat", "--splice", "--to", "flat"], "dropflat-flat"),
        (["operator", "my.ops.DropFlat", "--unsplice", "flat"], "dropflat-flat"),
        (["operator"], "operator"),  # the configured pipeline: up's operator host's name
        (["explorer"], "explorer"),
        (["operator", "reward_filter", "--splice", "--to", "f", "--name", "mine"], "mine"),
    ],
)
def test_a_spliced_operators_default_name_is_its_operator_and_stage(
    argv: list[str], name: str
) -> None:
    """Not `operator`, the name of up's operator host: a spliced stage's heartbeat, status
    row and messages' producer would be taken for the host's."""
    from rftstream.cli import build_parser, default_actor_name

    args = build_parser().parse_args([*argv, "--nats-url", "nats://127.0.0.1:4222"])
    if getattr(args, "unsplice", None) and args.operator:
        args.to_stage = args.unsplice  # as cmd_actor sets it
    assert (args.name or default_actor_name(args)) == name


def _beat(actor: str, **fields: Any) -> Heartbeat:
    return Heartbeat(actor=actor, role=actor, ts=time.time(), **fields)


def test_a_name_a_live_actor_has_is_refused_and_a_killed_ones_is_free() -> None:
    import anyio

    from rftstream.bus.memory import MemoryTransport
    from rftstream.bus.state import RunState
    from rftstream.control.liveness import refuse_a_live_name

    async def main() -> None:
        server = MemoryTransport()
        state = RunState(await server.connection().kv("KV_test", create=True))
        await refuse_a_live_name(state, "operator", "operator")  # nobody has it
        # a live actor: its heartbeat is written again while the newcomer watches
        await state.heartbeat(_beat("operator", messages_in=3))

        async def beating() -> None:
            while True:
                await anyio.sleep(0.1)
                await state.heartbeat(_beat("operator", messages_in=4))

        async with anyio.create_task_group() as tg:
            tg.start_soon(beating)
            with pytest.raises(RftError, match="actor name 'operator' is taken") as info:
                await refuse_a_live_name(state, "operator", "operator", watch_s=1.0)
            tg.cancel_scope.cancel()
        assert "another --name" in str(info.value)
        # killed: its last heartbeat is young but never written again; the name is free
        await state.heartbeat(_beat("explorer"))
        with anyio.fail_after(5):
            await refuse_a_live_name(state, "explorer", "explorer", watch_s=0.5)

    anyio.run(main)
