"""``rftstream up`` for a config with Trinity-RFT ``stages``: each stage a run, in order.

Every stage is prepared once before the first starts (so an error in the last
stage's algorithm stops the command before hours of the first stage's work),
then each runs as a whole ``rftstream up`` (:func:`rftstream.launch.up.run_up`, with its
own embedded nats-server and run directory ``<run_dir>/<stage_name>``). A stage
after the first starts from the previous stage's final checkpoint
(``checkpoints/global_step_<N>``, the highest N) unless it set
``model.model_path`` itself, as ``trinity run`` does; a stage without a trainer
(``mode: explore``/``bench``) passes its own model on. A stage that fails stops
the run: an :class:`~rftstream.errors.RftError` is re-raised naming the stage, a
signal returns its exit code.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
from rich.console import Console
from rich.markup import escape

from rftstream.config.schema import TRAINER_MODES, Config
from rftstream.config.stages import StageConfig
from rftstream.errors import RftError, first_leaf
from rftstream.runtime import PreparedRun
from rftstream.weights import checkpoint_dir

if sys.version_info < (3, 11):  # pragma: no cover - anyio depends on the backport there
    from exceptiongroup import BaseExceptionGroup

__all__ = ["StageFailed", "final_checkpoint", "run_stages"]

_STEP_DIR_RE = re.compile(r"global_step_(\d+)")

Prepare = Callable[[Config, StageConfig], PreparedRun]
StartLogging = Callable[[PreparedRun], Callable[[], None]]


class StageFailed(RftError):
    """A stage of a staged run failed; the message names the stage and why."""


def final_checkpoint(run: PreparedRun) -> Path | None:
    """The run's last HF checkpoint: ``global_step_<N>`` with the highest N that holds a
    ``config.json``, under the run's checkpoint directory; None when there is none.
    Reads the directory listing."""
    root = checkpoint_dir(run.cfg, run.run_dir)
    if not root.is_dir():
        return None
    found: list[tuple[int, Path]] = []
    for entry in root.iterdir():
        m = _STEP_DIR_RE.fullmatch(entry.name)
        if m and (entry / "config.json").is_file():
            found.append((int(m.group(1)), entry))
    return max(found)[1] if found else None


def _stage_error(stage: StageConfig, what: str, exc: BaseException) -> StageFailed:
    return StageFailed(f"stage {stage.label} {what}: {exc}")


def _only_rft_errors(group: BaseExceptionGroup) -> RftError | None:
    """The first RftError of ``group`` when every leaf is one, else None."""
    errors, rest = group.split(RftError)
    if errors is None or rest is not None:
        return None
    leaf = first_leaf(errors)
    return leaf if isinstance(leaf, RftError) else None


def _with_model(cfg: Config, model_path: str) -> Config:
    return msgspec.structs.replace(
        cfg, model=msgspec.structs.replace(cfg.model, model_path=model_path)
    )


def run_stages(
    stages: list[StageConfig],
    *,
    prepare: Prepare,
    run_up: Callable[[PreparedRun], int],
    console: Console,
    start_logging: StartLogging | None = None,
) -> int:
    """Run ``stages`` in order; return 0 when all finished, or the exit code of a stage that
    a signal stopped (the later stages do not run).

    ``prepare(cfg, stage)`` turns a stage's config into a :class:`PreparedRun` (``--steps``,
    run directory, NATS url); it is called for every stage before the first runs, and again
    for each stage when it starts, with its model path set. ``run_up`` runs one prepared
    stage (blocks until it ends). ``start_logging(run)`` (optional) starts the stage's log
    and returns what stops it. Raises :class:`StageFailed` naming the stage when preparing
    or running it raises an :class:`RftError` (or a group of them); any other exception
    propagates after a console line naming the stage.
    """
    count = len(stages)
    for stage in stages:  # every stage's algorithm, batch sizes, model, before any work
        try:
            prepare(stage.config, stage)
        except RftError as exc:
            raise _stage_error(stage, "cannot start", exc) from exc
    previous: tuple[StageConfig, Path, str] | None = None  # stage, its model, what it is
    for stage in stages:
        cfg = stage.config
        origin = "its own model.model_path" if stage.sets_model_path else "the base model"
        if previous is not None and not stage.sets_model_path:
            cfg = _with_model(cfg, str(previous[1]))
            origin = f"stage `{previous[0].stage_name}`'s {previous[2]}"
        console.rule(f"stage {stage.index + 1}/{count}: {escape(stage.stage_name)}")
        try:
            run = prepare(cfg, stage)
        except RftError as exc:
            raise _stage_error(stage, "cannot start", exc) from exc
        console.print(
            f"[bold]stage {stage.index + 1}/{count}[/] [cyan]{escape(stage.stage_name)}[/] "
            f"starting: run {escape(run.names.display)}, mode {cfg.mode}, "
            f"algorithm {run.algorithm.name}, model {escape(run.model_path)} ({origin})",
            soft_wrap=True,
        )
        stop_logging = start_logging(run) if start_logging is not None else None
        try:
            code = run_up(run)
        except RftError as exc:
            raise _stage_error(stage, "failed", exc) from exc
        except BaseExceptionGroup as group:
            first = _only_rft_errors(group)
            if first is None:
                console.print(f"[bold red]stage {stage.label} failed[/]")
                raise
            raise _stage_error(stage, "failed", first) from group
        except Exception:
            console.print(f"[bold red]stage {stage.label} failed[/]")
            raise
        finally:
            if stop_logging is not None:
                stop_logging()
        if code:
            console.print(
                f"[yellow]stage {stage.label} stopped (exit {code}); the later stages do not run[/]"
            )
            return code
        checkpoint = final_checkpoint(run)
        if run.cfg.mode in TRAINER_MODES:
            if checkpoint is None:
                raise StageFailed(
                    f"stage {stage.label} trained but left no checkpoint under "
                    f"{checkpoint_dir(run.cfg, run.run_dir)} for the next stage"
                )
            previous = (stage, checkpoint, "final checkpoint")
        else:  # no trainer: the next stage starts from the model this one used
            previous = (stage, Path(run.model_path), "model (it trained nothing)")
        console.print(
            f"[bold green]stage {stage.index + 1}/{count}[/] [cyan]{escape(stage.stage_name)}[/] "
            f"finished: final model {escape(str(previous[1]))}",
            soft_wrap=True,
        )
    console.print(f"[bold green]all {count} stages finished[/]")
    return 0
