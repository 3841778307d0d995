"""Assembling a run: config → algorithm → pipeline → actors.

:func:`prepare_run` resolves everything that needs no NATS (algorithm preset,
batch sizes, model path, run directory, pipeline) and fails early with a
:class:`ConfigError` naming the key. :func:`run_actors` connects each actor to
NATS with its own connection and runs the requested roles in one anyio task
group (``rftstream up`` runs all three; ``rftstream explorer|operator|trainer``
runs one). Actors never call each other: they share only the bus.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec

from rftstream.bus.client import Bus
from rftstream.bus.state import END_STATUSES, RunState
from rftstream.config.resolve import (
    fill_loss_batch_args,
    prefer_decoupled_ppo,
    resolve_run,
    with_train_batch_size,
)
from rftstream.config.resolved import ResolvedAlgorithmProtocol, ResolvedRun, names_missing
from rftstream.config.schema import TRAINER_MODES, AlgorithmConfig, BufferConfig, Config
from rftstream.config.secrets import redact_url
from rftstream.config.validate import (
    eval_tasksets,
    placeholder_hint,
    run_id_from_name,
    training_tasksets,
    validate_config,
)
from rftstream.errors import ConfigError, RegistryError, RftError, RunNotFoundError, StreamNotFound
from rftstream.experience_pipeline import EXPERIENCE_OPERATORS, ExperiencePipeline, create_operators
from rftstream.monitors import check_monitor_packages
from rftstream.plugins.registries import ALGORITHM_RESOLVERS, ALGORITHM_TYPE, REWARD_FUNCTIONS
from rftstream.retention import purge_on_full
from rftstream.run_inputs import check_run_inputs
from rftstream.subjects import KV_EXPLORER_DONE, RunNames
from rftstream.training.schedule import lr_schedule
from rftstream.utils.malloc import tune_malloc
from rftstream.wire import TRAINER_DONE
from rftstream.workflow import WORKFLOWS

log = logging.getLogger(__name__)

ROLES = ("explorer", "operator", "trainer")


@dataclass
class PreparedRun:
    """A config with every derived value filled in, ready for actors."""

    cfg: Config
    names: RunNames
    resolved: ResolvedRun  # derived once; the actors read it, not the config again
    model_path: str
    run_dir: Path
    plugin_dirs: tuple[str, ...] = ()  # --plugin-dir, for actors started in other processes
    log_dir: Path | None = None  # where this process logs (the CLI sets it; <run_dir>/logs)

    @property
    def algorithm(self) -> ResolvedAlgorithmProtocol:
        """The algorithm's components (the plugin's ``algorithms.ResolvedAlgorithm``)."""
        return self.resolved.algorithm

    @property
    def stages(self) -> list[tuple[str, str]]:
        p = self.cfg.data_processor.experience_pipeline
        return [(p.input_stage, p.output_stage)]

    def build_pipeline(self) -> ExperiencePipeline:
        """The operator pipeline of ``data_processor.experience_pipeline``, plus the
        algorithm's group advantage when it is not computed in the trainer."""
        ops = list(create_operators(self.cfg.data_processor.experience_pipeline.operators))
        algo = self.algorithm
        if not algo.compute_advantage_in_trainer and (algo.config.advantage_fn or "none") != "none":
            group_advantage = EXPERIENCE_OPERATORS.get("group_advantage")
            ops.append(
                group_advantage(algo.config.advantage_fn, **(algo.config.advantage_fn_args or {}))
            )
        return ExperiencePipeline(ops)


def _resolve_algorithm(
    algorithm: AlgorithmConfig, buffer: BufferConfig
) -> ResolvedAlgorithmProtocol:
    """The ``algorithm:`` section as instantiated components (an ``algorithms.ResolvedAlgorithm``),
    by the resolver the algorithms package registers. ConfigError naming the key; a
    resolver that returns something without the core's attributes is named too."""
    resolved = ALGORITHM_RESOLVERS.get("default")(algorithm, buffer)
    missing = names_missing(resolved)
    if missing:
        raise ConfigError(
            "algorithm.algorithm_type",
            f"the algorithm resolver returned {type(resolved).__name__} without "
            f"{', '.join(missing)} (see rftstream.config.resolved.ResolvedAlgorithmProtocol)",
            value=algorithm.algorithm_type,
        )
    return resolved


def _check_components(cfg: Config) -> None:
    """Names that only resolve at run time, and the operators' arguments, checked now so
    the error names the key."""
    inp = cfg.buffer.explorer_input
    for key, ts in [*training_tasksets(inp), *eval_tasksets(inp)]:
        try:
            WORKFLOWS.get(ts.default_workflow_type)
        except RegistryError as exc:
            raise ConfigError(
                f"{key}.default_workflow_type", str(exc), value=ts.default_workflow_type
            ) from exc
        if ts.default_reward_fn_type:
            try:
                REWARD_FUNCTIONS.get(ts.default_reward_fn_type)
            except RegistryError as exc:
                raise ConfigError(
                    f"{key}.default_reward_fn_type", str(exc), value=ts.default_reward_fn_type
                ) from exc
    # built now (constructors check their arguments and files; the work starts in
    # prepare()), so a bad argument fails here, not in the operator host after it started
    create_operators(cfg.data_processor.experience_pipeline.operators)
    if cfg.synchronizer.sync_method == "nccl":
        raise ConfigError(
            "synchronizer.sync_method",
            "`nccl` (GPU broadcast to vLLM engines) is not available yet; use `jetstream` "
            "(weights over NATS), `checkpoint` or `memory`",
            value="nccl",
        )


def _preset_policy_loss_fn(cfg: Config) -> str | None:
    """The ``policy_loss_fn`` of the preset's ``default_config()`` (None: unknown preset,
    which :func:`resolve_algorithm` reports)."""

    try:
        preset = ALGORITHM_TYPE.get(cfg.algorithm.algorithm_type).default_config()
    except RegistryError:
        return None
    return preset.get("policy_loss_fn")


def _fill_batch_args(
    cfg: Config, algorithm: ResolvedAlgorithmProtocol
) -> tuple[Config, ResolvedAlgorithmProtocol]:
    """:func:`~rftstream.config.resolve.fill_loss_batch_args` for the resolved algorithm's
    policy loss (MIX's weighting): returns ``(cfg, algorithm)``, the algorithm resolved
    again when something was filled, carrying the loss's verl batch arithmetic in
    ``batch_shape`` (computed here, once; the trainer applies it)."""
    import dataclasses

    ratio = algorithm.sample_strategy_args.get("expert_data_ratio")
    if ratio is None:  # the strategy's own default (the guide's MIX reads 0.5 when unset)
        ratio = (algorithm.sample_strategy_cls.default_args() or {}).get("expert_data_ratio", 0.5)
    filled, shape = fill_loss_batch_args(
        cfg,
        type(algorithm.policy_loss_fn),
        repeat_times=algorithm.repeat_times,
        expert_ratio=float(ratio),
    )
    if filled is not cfg:
        cfg = filled
        algorithm = _resolve_algorithm(cfg.algorithm, cfg.buffer)
    return cfg, dataclasses.replace(algorithm, batch_shape=shape)


def _preset_check_config(cfg: Config) -> Config:
    """The preset's ``check_config`` (Trinity-RFT's hook) on a copy of ``cfg``; returns the copy.

    Keys it sets take effect (the algorithm is resolved afterwards); a
    ValueError becomes a ConfigError at ``algorithm.algorithm_type``. An
    unknown preset is left for :func:`resolve_algorithm` to report.
    """
    import copy

    eb = cfg.buffer.trainer_input.experience_buffer
    if cfg.trainer_reads_dataset and (eb is None or not eb.path):
        raise ConfigError(
            "buffer.trainer_input.experience_buffer.path",
            "is required in mode: train (the dataset the trainer reads; with storage_type: "
            "queue the trainer reads the run's experience stream instead)",
        )
    try:
        algo_cls = ALGORITHM_TYPE.get(cfg.algorithm.algorithm_type)
    except RegistryError:
        return cfg
    cfg = copy.deepcopy(cfg)
    try:
        algo_cls.check_config(cfg)
    except ValueError as exc:
        raise ConfigError(
            "algorithm.algorithm_type", str(exc), value=cfg.algorithm.algorithm_type
        ) from exc
    return cfg


def _check_algorithm(cfg: Config, algorithm: ResolvedAlgorithmProtocol) -> None:
    """Run-level checks of the resolved algorithm against the trainer's inputs and the mode."""
    from rftstream.training.batch import trainer_tensors
    from rftstream.training.masked_reductions import check_loss_agg_mode

    schema = str(getattr(algorithm.algorithm_type, "schema", "experience"))
    if cfg.trainer_reads_dataset and schema not in ("sft", "dpo", "cpt"):
        raise ConfigError(
            "mode",
            f"`train` reads a dataset, which only the sft, dpo and cpt presets train on; "
            f"{algorithm.name} learns from rollouts (use mode: both, or mode: train with "
            "buffer.trainer_input.experience_buffer.storage_type: queue beside a mode: explore "
            "run of the same name)",
            value=cfg.mode,
        )
    if not algorithm.use_reference:
        if (algorithm.config.kl_loss_fn or "none") != "none":
            raise ConfigError(
                "algorithm.kl_loss_fn",
                f"{algorithm.name} has no reference model (use_reference is False), so a KL "
                f"loss cannot be computed; set kl_loss_fn: none",
                value=algorithm.config.kl_loss_fn,
            )
    algorithm.check_loss_inputs(trainer_tensors(algorithm))
    adv_fn = algorithm.advantage_fn
    if (
        not algorithm.compute_advantage_in_trainer
        and (algorithm.config.advantage_fn or "none") != "none"
        and adv_fn is not None
        and type(adv_fn).compute_in_trainer()
    ):
        raise ConfigError(
            "algorithm.advantage_fn",
            f"{algorithm.config.advantage_fn} is computed in the trainer (it needs trainer "
            f"state: critic values or the policy's token entropies), but algorithm_type "
            f"{algorithm.name} computes advantages in the experience pipeline; use an "
            f"algorithm_type that computes them in the trainer (grpo_verl, ppo)",
            value=algorithm.config.advantage_fn,
        )
    if algorithm.use_critic:
        try:
            check_loss_agg_mode(cfg.trainer.critic.loss_agg_mode)
        except ValueError as exc:
            raise ConfigError(
                "trainer.critic.loss_agg_mode", str(exc), value=cfg.trainer.critic.loss_agg_mode
            ) from exc
        if not cfg.trainer.critic.cliprange_value > 0:
            raise ConfigError(
                "trainer.critic.cliprange_value",
                "must be > 0",
                value=cfg.trainer.critic.cliprange_value,
            )
    if (algorithm.config.kl_penalty_fn or "none") != "none":
        if not algorithm.compute_advantage_in_trainer:
            raise ConfigError(
                "algorithm.kl_penalty_fn",
                f"a KL penalty on rewards needs the advantage computed in the trainer, but "
                f"{algorithm.name} computes it in the experience pipeline (use kl_loss_fn instead)",
                value=algorithm.config.kl_penalty_fn,
            )
        if not algorithm.use_reference:
            raise ConfigError(
                "algorithm.kl_penalty_fn",
                f"{algorithm.name} has no reference model (use_reference is False)",
                value=algorithm.config.kl_penalty_fn,
            )


def roles_for(cfg: Config) -> tuple[str, ...]:
    """The actors a run needs, by ``mode``.

    ``both``: all three. ``train``: the trainer (it reads a dataset).
    ``explore``: explorers and the operator pipeline, no trainer (experience
    waits on ``exp.train`` for someone else to train on). ``bench``: an
    explorer that evaluates (see :mod:`rftstream.actors.bench`).
    """
    return {
        "train": ("trainer",),
        "explore": ("explorer", "operator"),
        "bench": ("explorer",),
    }.get(cfg.mode, ROLES)


def resolve_model_path(cfg: Config, progress: Callable[[str], None] | None = None) -> str:
    """``model.model_path``, or a builtin model: the embedded tiny model (empty or
    ``builtin:tiny``) or a shaped one (``builtin:qwen2.5-0.5b-shape``: see
    :mod:`rftstream.shaped_models`), built and cached on first use."""
    from rftstream.shaped_models import resolve_builtin

    path = cfg.model.model_path
    built = resolve_builtin(path, "model.model_path", progress)
    if built is not None:
        return built
    if not Path(path).exists():
        raise ConfigError(
            "model.model_path",
            "no such directory (models are loaded from local paths only)" + placeholder_hint(path),
            value=path,
        )
    return path


def prepare_run(
    cfg: Config,
    *,
    steps: int | None = None,
    run_dir: str | None = None,
    nats_url: str | None = None,
    progress: Callable[[str], None] | None = None,
    source: str | None = None,
    roles: Sequence[str] | None = None,
) -> PreparedRun:
    """Validate ``cfg``, resolve it (:mod:`rftstream.config.resolve`: the command line's
    ``steps``, ``run_dir``, ``nats_url``, the algorithm preset's defaults, the train
    batch size), run the checks that need the plugins, and build (or find) the model.
    ``roles``: the actors this process will run (None: all of the mode's), for the checks
    of the files they read. Blocks (model build)."""

    validate_config(cfg, source=source)
    cfg = resolve_run(cfg, steps=steps, run_dir=run_dir, nats_url=nats_url)
    run = run_id_from_name(cfg.name)
    if cfg.mode != "train":
        _check_components(cfg)
    if cfg.mode in TRAINER_MODES:  # the trainer opens them: fail before the model loads
        check_monitor_packages(cfg.monitor.monitor_type)
    cfg = _preset_check_config(cfg)
    corrected = prefer_decoupled_ppo(cfg, _preset_policy_loss_fn(cfg))
    if corrected is not cfg:
        log.info(
            "algorithm.policy_loss_fn: decoupled_ppo (experience can be stale in this run; "
            "set policy_loss_fn: ppo to train without the correction)"
        )
    cfg = corrected
    algorithm = _resolve_algorithm(cfg.algorithm, cfg.buffer)
    cfg, algorithm = _fill_batch_args(cfg, algorithm)
    _check_algorithm(cfg, algorithm)
    if cfg.mode in TRAINER_MODES:  # the trainer's lr schedules, before any model loads
        lr_schedule(cfg.algorithm.optimizer, cfg.buffer.total_steps, key="algorithm.optimizer")
        if algorithm.use_critic:
            lr_schedule(
                cfg.trainer.critic.optim, cfg.buffer.total_steps, key="trainer.critic.optim"
            )
    cfg = with_train_batch_size(
        msgspec.structs.replace(cfg, algorithm=algorithm.config), algorithm.repeat_times
    )
    rdir = Path(cfg.run_dir)
    model_path = resolve_model_path(cfg, progress)
    _run_task_pipeline(cfg, progress)  # writes the taskset the checks below look for
    check_run_inputs(cfg, model_path, source=source, roles=roles)  # data files, model context
    return PreparedRun(
        cfg=cfg,
        names=RunNames(run, name=cfg.name),
        resolved=ResolvedRun.of(cfg, algorithm),
        model_path=model_path,
        run_dir=rdir,
    )


def _run_task_pipeline(cfg: Config, progress: Callable[[str], None] | None) -> None:
    """``data_processor.task_pipeline``, when set (:mod:`rftstream.task_pipeline`); says
    what it did through ``progress``. Blocks."""
    from rftstream.task_pipeline import run_task_pipeline

    if cfg.data_processor.task_pipeline is None:
        return
    if progress is not None:
        progress("running the task pipeline (data_processor.task_pipeline)")
    result = run_task_pipeline(cfg)
    if result is None:
        return
    what = (
        f"task pipeline: {result.output} made earlier from the same inputs ({result.rows_out} "
        "tasks)"
        if result.reused
        else f"task pipeline: {result.rows_out} of {result.rows_in} tasks kept in {result.output}"
    )
    log.info("%s", what)
    if progress is not None:
        progress(what)


ACTIVE_HEARTBEAT_S = 30.0
FINAL_EVAL_GRACE_S = 300.0  # how long `up` waits for the final evaluation after training


async def _run_status(bus: Bus) -> str:
    """The run's status in its KV bucket ("" when there is no bucket or no status)."""
    try:
        state = await bus.state(create=False)
    except RunNotFoundError:
        return ""
    return str(await state.status() or "")


async def start_fresh(
    run: PreparedRun, url: str, *, continuing: bool = False, own_store: bool = False
) -> str | None:
    """Make the server's side of the run match how ``up`` starts it: remove what an
    earlier run with the same run id left (a new run), or keep it (``continuing``).

    A new run: without this, a second ``up`` against the same server would find the
    old run finished and do nothing. ``continuing`` (:func:`rftstream.run_start.claim_run_dir`
    decided the earlier run goes on): its streams, consumers and KV bucket stay, a
    ``stopped`` or ``failed`` status becomes ``running`` again and the trainer's end
    record goes; a ``finished`` run is replaced like for a new run.

    Refuses (:class:`RftError`) while an actor of that run sent a heartbeat in the
    last 30 s, unless ``own_store``: the caller knows the earlier ``up`` of the run is
    dead (the run dir's lock: the embedded server on that dir's store, or a run that
    continues; heartbeats of a killed run are still young, and actors elsewhere that
    outlived it keep working in the continued run). Returns a note of what was removed
    or kept, or None.

    The halves of an explorer/trainer pair (``mode: explore``, and ``mode: train``
    on the experience stream; Trinity-RFT's asynchronous setup) join a run of
    their name that has not ended instead: the half started first made it.
    """
    import time

    names = run.names

    half_of_a_pair = run.cfg.mode == "explore" or (
        run.cfg.mode == "train" and not run.cfg.trainer_reads_dataset
    )
    async with await Bus.connect(url, names, run.cfg.nats, "starter") as bus:
        if half_of_a_pair:
            status = await _run_status(bus)
            if status not in END_STATUSES:
                # the other half (mode: train / explore) started it, or is provisioning it
                # right now (streams made, status not yet written): join, never replace
                return None
            if run.cfg.mode == "train" and status == "finished":
                joined = await _join_a_finished_explorer(bus)
                if joined:
                    return joined
        present = []
        for stream in names.streams:
            try:
                await bus.stream_state(stream)
                present.append(stream)
            except StreamNotFound:
                pass
        try:
            state: RunState | None = await bus.state(create=False)
        except RunNotFoundError:
            state = None
        if not present and state is None:
            return None
        status = ""
        if state is not None:
            status = await state.status()
            beats = [beat.ts for beat in (await state.heartbeats()).values()]
            age = time.time() - max(beats) if beats else None
            if (
                not own_store
                and status == "running"
                and age is not None
                and age < ACTIVE_HEARTBEAT_S
            ):
                raise RftError(
                    f"run {names.run!r} is active on {redact_url(url)} (last heartbeat "
                    f"{age:.0f}s ago); stop it or choose another `name`"
                )
            if continuing and status != "finished":
                if status in END_STATUSES:
                    await state.set_status("running")
                await state.delete(TRAINER_DONE)
                return (
                    f"kept run {names.run!r} on the server (status {status or 'unknown'}, "
                    f"{len(present)} streams)"
                )
            await bus.delete_state()
        elif continuing:
            return None
        for stream in present:
            await bus.delete_stream(stream)
    return f"replaced the earlier run {names.run!r} on this server (status {status or 'unknown'})"


async def _join_a_finished_explorer(bus: Bus) -> str | None:
    """A trainer half started after its explorer half finished (Trinity-RFT's ``run.sh``
    starts the explorer first): the run is ``finished`` with every explorer's done record
    and no trainer's, and its experience waits on the stream. Sets the status back to
    ``running`` and returns a note; None (replace the run) when a trainer already ended
    it or no explorer finished it."""
    state = await bus.state(create=False)
    values = await state.all()
    head, _, tail = KV_EXPLORER_DONE.partition("{name}")
    done = [k for k in values if k.startswith(head) and k.endswith(tail)]
    if not done or TRAINER_DONE.name in values:
        return None
    await state.set_status("running")
    return (
        f"joined run {bus.names.run!r}: its explorer finished before this trainer started; "
        "training on the experience it left on the stream"
    )


def task_ack_wait(cfg: Config) -> float:
    """The tasks durable's ack wait: how long a task held by an explorer that died stays
    invisible to the others.

    An explorer keeps every task it holds alive with in-progress acks every
    ``nats.ack_wait / 3`` s (:class:`~rftstream.actors.common.InProgressTicker`), from
    its fetch until its ack, however long the rollout takes; so three ``nats.ack_wait``
    (at least 10 s) leave room for a few late ticks, and a killed explorer's tasks go
    to another explorer that soon. Never more than the whole retry budget of a task.
    """
    budget = cfg.explorer.max_timeout * (cfg.explorer.max_retry_times + 1) + 60
    return min(max(3 * cfg.nats.ack_wait, 10.0), budget, 3600.0)


async def provision(run: PreparedRun, url: str) -> None:
    """Create the run's streams, consumers and KV bucket (idempotent)."""
    async with await Bus.connect(url, run.names, run.cfg.nats, "provisioner") as bus:
        await bus.provision(stages=run.stages, task_ack_wait=task_ack_wait(run.cfg))
        state = RunState(await bus.kv())
        if not await state.status():
            await state.set_status("running")


async def run_explorer(
    run: PreparedRun,
    url: str,
    name: str = "explorer",
    engine: Any = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    on_eval: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """One explorer until it is done (``mode: bench``: the benchmark). ``engine``: a
    ready rollout engine instead of the configured one. The process gets the actors'
    ``malloc`` settings first (:func:`tune_malloc`), as for every actor."""
    from rftstream.actors.explorer import Explorer

    tune_malloc()

    async with await Bus.connect(
        url, run.names, run.cfg.nats, name, on_stream_full=purge_on_full
    ) as bus:
        explorer = Explorer(
            run.cfg,
            bus,
            resolved=run.resolved,
            model_path=run.model_path,
            name=name,
            on_progress=on_progress,
            on_eval=on_eval,
        )
        await explorer.run(engine=engine)


async def run_operator(
    run: PreparedRun,
    url: str,
    name: str = "operator",
    *,
    pipeline: Any = None,
    from_stage: str | None = None,
    to_stage: str | None = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    start_seq: int | None = None,
    control: Any = None,
) -> None:
    """One operator host of ``run`` (``pipeline`` None: the configured one); see
    :func:`~rftstream.actors.operator_host.run_hosts`."""
    await run_operator_replicas(
        run,
        url,
        [pipeline],
        name=name,
        from_stage=from_stage,
        to_stage=to_stage,
        on_progress=on_progress,
        start_seq=start_seq,
        control=control,
    )


async def run_operator_replicas(
    run: PreparedRun,
    url: str,
    pipelines: Sequence[Any],
    *,
    name: str = "operator",
    **host_args: Any,
) -> None:
    """One operator host per pipeline (None: the configured one, each its own), concurrently,
    sharing the stage's durable: named ``name`` (one pipeline) or ``<name>-<i>``;
    ``host_args`` go to every host (see :func:`~rftstream.actors.operator_host.run_hosts`).
    Returns when all hosts have returned; cancelling cancels them all.
    """
    from rftstream.actors.operator_host import run_hosts

    tune_malloc()
    built = [p if p is not None else run.build_pipeline() for p in pipelines]
    await run_hosts(url, run.names, run.cfg, built, name=name, **host_args)


async def splice_in(run: PreparedRun, url: str, operator: str, to_stage: str) -> Any:
    """Ask the running trainer to read ``exp.<to_stage>`` from now on (see :mod:`rftstream.control.splice`).

    Returns the trainer's :class:`~rftstream.wire.SpliceCut`: run the operator from
    ``cut.from_stage`` to ``cut.to_stage`` with ``start_seq=cut.start_seq``.
    Blocks until the trainer answered; raises :class:`RftError` if none does.
    """
    from rftstream.control.splice.operator_side import request_splice

    async with await Bus.connect(url, run.names, run.cfg.nats, f"splice-{operator}") as bus:
        state = RunState(await bus.kv())
        return await request_splice(state, operator, to_stage)


async def run_trainer(
    run: PreparedRun,
    url: str,
    name: str = "trainer",
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """The trainer until the run ends (the process's ``malloc`` settings first)."""
    from rftstream.actors.trainer import Trainer

    tune_malloc()
    async with await Bus.connect(url, run.names, run.cfg.nats, name) as bus:
        await Trainer(
            run.cfg,
            bus,
            model_path=run.model_path,
            resolved=run.resolved,
            run_dir=run.run_dir,
            name=name,
            on_step=on_step,
        ).run()


def explorer_names(cfg: Config) -> list[str]:
    """The explorers ``rftstream up`` runs: one per rollout engine
    (``explorer.rollout_model.engine_num``), named ``explorer``, ``explorer-2``, ... as
    ``rftstream explorer --name`` would name them; ``mode: bench`` runs one (a benchmark
    evaluates each taskset once)."""
    n = 1 if cfg.mode == "bench" else max(1, int(cfg.explorer.rollout_model.engine_num))
    return ["explorer"] + [f"explorer-{i}" for i in range(2, n + 1)]


async def run_actors(
    run: PreparedRun,
    url: str,
    roles: Sequence[str] | None = None,
    *,
    explorers: Sequence[str] | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    on_eval: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Provision, then run ``roles`` concurrently until the run ends.

    When the trainer is among the roles, its end (the run's end) cancels the
    other actors. Without a trainer, actors stop when the run status says so:
    in ``mode: explore`` the explorers set it when their tasks run out (or at
    ``buffer.total_steps``), the operator drains what they published, then all
    return; in ``mode: bench`` the explorer returns after its last evaluation.
    ``roles`` None: :func:`roles_for` the config. ``explorers``: the names of
    the explorers to run for role ``explorer`` (None: :func:`explorer_names`,
    one per rollout engine; they share the task queue). ``on_step``: each
    trainer step record; ``on_progress``: each step of the first explorer;
    ``on_eval``: each evaluation record (whichever explorer claimed it).
    Each actor gives the process the actors' ``malloc`` settings (:func:`tune_malloc`).
    """
    if roles is None:
        roles = roles_for(run.cfg)
    unknown = [r for r in roles if r not in ROLES]
    if unknown:
        raise ConfigError("roles", f"unknown actor roles {unknown}; expected some of {list(ROLES)}")
    names = list(explorers) if explorers is not None else explorer_names(run.cfg)
    if "explorer" in roles and (not names or len(set(names)) != len(names)):
        raise ConfigError("explorers", f"need distinct explorer names, got {names}")
    await provision(run, url)
    if (
        run.cfg.synchronizer.sync_method == "memory"
        and len(roles) < len(ROLES)
        and run.cfg.mode == "both"
    ):
        raise ConfigError(
            "synchronizer.sync_method",
            "`memory` moves weights inside one process; actors started separately need "
            "`jetstream` (or `checkpoint`)",
            value="memory",
        )
    explorers_done = [anyio.Event() for _ in names]

    async def explorer(index: int) -> None:
        try:
            await run_explorer(
                run,
                url,
                name=names[index],
                on_progress=on_progress if index == 0 else None,
                on_eval=on_eval,
            )
        finally:
            explorers_done[index].set()

    async with anyio.create_task_group() as tg:
        if "operator" in roles:
            tg.start_soon(run_operator, run, url)
        if "explorer" in roles:
            for index in range(len(names)):
                tg.start_soon(explorer, index)
        if "trainer" in roles:
            await run_trainer(run, url, on_step=on_step)
            if "explorer" in roles and run.cfg.buffer.explorer_input.eval_tasksets:
                # the explorers see the run finished; one evaluates the final weights
                with anyio.move_on_after(FINAL_EVAL_GRACE_S):
                    for done in explorers_done:
                        await done.wait()
            tg.cancel_scope.cancel()
