"""rftstream against TRL's synchronous ``GRPOTrainer``, configured as its best users would.

The work (the embedded default, ``rftstream up``): the tiny model from rftstream's
cache (:mod:`rftstream.tiny_model`), the 100 built-in arithmetic prompts in the same
chat format, 8 prompts x 8 generations = 64 completions per step, learning rate 2e-4
constant, no KL (TRL ``beta=0``), temperature 1, the same reward. Three workloads:

* ``default``: 6 new tokens, ``math_reward`` (1 for the right number).
* ``longtail``: the same with a verifier that takes 20-200 ms per task
  (``benchmarks/plugins/longtail.py``; TRL's reward function waits for the slowest
  task of its batch, as a parallel verifier would).
* ``genheavy``: replies of 32-48 tokens (no end token before 32), rewarded with the
  share of their characters that are letters (``benchmarks/plugins/genheavy.py``):
  generation dominates, as it does on a GPU with real models.

Fairness (what a reviewer who distrusts the speed-up would check):

* TRL trains as we do: fp32 (``bf16=False``; TRL 1.x turns bf16 autocast on by
  default), gradient checkpointing off (TRL 1.x's default is on), one process using
  every core (``torch.set_num_threads``, printed; ``--trl-threads``). rftstream runs
  ``rftstream up`` as it ships: trainer, explorer and operator host in their own
  processes, torch threads set per process by ``up`` (printed).
* Where the two algorithms differ: tokens drawn under ``min_tokens`` (generation-heavy
  only). rftstream trains the log-probs of the distribution the sampler drew them from,
  the end tokens left out (``algorithm.logprobs_of: sampler``, its default); TRL those of
  the model over the whole vocabulary, and has no option for the other.
  ``--rft-set algorithm.logprobs_of=model`` runs rftstream with TRL's (printed at the
  top); without bans the two take the same step (``tests/integration/test_trl_parity.py``).
* The model is built, and both sides run once untimed (``--no-warmup`` skips it),
  before any timed run: every timed run starts on a warm cache.
* Both clocks start in this (the parent) process just before the child starts; every
  time below counts from there, start-up included.
* Seeds 1-5 per workload, 1-9 where generation dominates (``--seeds`` sets one list for
  all); per seed and workload both sides run back to back, the order alternating
  between seeds. Figures are medians with the interquartile range; a ratio is the
  median of ours over the median of TRL's. Why nine there: TRL is deterministic per
  seed, and on that workload its steps to 0.7 spread from 439 to 1225 over seeds 1-9
  (median 643; 778 over seeds 10-18), its seeds 1-5 quick (median 523); rftstream's steps on a
  seed vary from run to run over a like spread. On five seeds the verdict said more
  about which runs were lucky than about either side; every seed's figures are
  printed, so the five-seed verdict can be read off as well. Each ratio comes with a
  95% bootstrap interval over the seeds (:func:`ratio_interval`): how far the choice of
  seeds alone could move it.
* A run stops at a trailing mean reward of 0.9, ``--after-s`` seconds after it reached
  0.7, or at the cap (``--budget-s``; by default the workload's, 240 s, generation-heavy
  480 s), whichever comes first: long enough to show what happens after the threshold,
  and for TRL's seeds to get there on a slow hour (a TRL run that never does counts as
  reaching it where it stopped, and the ratio is printed as a bound).

Figure of merit: the trailing mean of 20 steps' reward (TRL: the mean reward of the
step's completions; rftstream: ``reward/mean``, the mean reward of the rollouts
published since the previous trainer step): the first step where it reaches 0.7, and
the seconds to it. Where the time goes: rollout ms per step (TRL: generating and
scoring the step's completions; rftstream: the explorers' busy time per trainer step,
which overlaps training) and train ms per step.

Evaluation both sides share: every ``--eval-every`` seconds the current policy is
saved (TRL: its model, from a callback; rftstream: the newest weight version on the
run's weights stream, fetched by an observer in this process as an explorer would),
and after all runs every snapshot is scored by one function (greedy, and temperature 1
with 4 samples per prompt, over the 100 prompts, with the workload's token limits and
reward: for ``genheavy`` the letter share, not an accuracy). ``accuracy.png`` in ``--out`` plots accuracy against wall-clock seconds for
every run.

Targets (median of the seeds): seconds to 0.7 at most 0.6x TRL's and steps at most 1.1x
(default), seconds at most 0.35x (long tail) and 0.5x (generation-heavy); start-up
(the parent's clock to the first trainer step, default workload) at most TRL's.

Needs the ``bench`` extra (``pip install -e '.[bench]'``: TRL). Usage:
``python benchmarks/vs_trl.py [--workload default|longtail|genheavy|all] [--seeds 1,2,3,4,5]
[--out DIR] [--trl-metrics]``. Exits 0 when every target passes, 1 on a MISS, 2 when a
run failed, 130 when interrupted. ``--trl-metrics`` keeps TRL's own metrics of every step
(entropy, gradient norm, reply lengths) in each TRL run's ``trl.jsonl.metrics.jsonl``, to
set beside rftstream's ``metrics.jsonl`` (for curves: TRL then logs every step).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# printed at the top: where the two sides' algorithms differ (the generation-heavy workload)
LOGPROBS_NOTE = (
    "tokens drawn under min_tokens (generation-heavy): rftstream trains the log-probs of the "
    "distribution they were drawn from, the end tokens left out (algorithm.logprobs_of: "
    "sampler, its default); TRL the model's over the whole vocabulary "
    "(--rft-set algorithm.logprobs_of=model: the same as TRL's)"
)
PLUGINS = ROOT / "benchmarks" / "plugins"
THRESHOLD = 0.7
STOP_AT = 0.9
WINDOW = 20
EVAL_SAMPLES = 4  # temperature-1 samples per prompt in the shared evaluation
GENHEAVY_MIN_TOKENS, GENHEAVY_MAX_TOKENS = 32, 48  # as benchmarks/plugins/genheavy.py


# ------------------------------------------------------------------ workloads


@dataclass(frozen=True)
class Workload:
    """One workload: its token limits, its reward and how each side is told about them."""

    name: str
    title: str
    max_tokens: int = 6
    min_tokens: int = 0
    longtail: bool = False
    reward: str = "math"  # "math" (math_reward) or "letter_share" (genheavy)
    targets: dict[str, float] = field(default_factory=dict)
    # the cap per run (--budget-s overrides it): long enough for TRL's seeds to get there
    # on a slow hour, so that its median is measured, not bounded (see median_at_least)
    budget_s: float = 240.0
    seeds: int = 5  # seeds 1..seeds unless --seeds names them

    def seed_list(self, override: Sequence[int] | None = None) -> list[int]:
        """The seeds this workload runs: ``override`` (``--seeds``) or ``1..seeds``."""
        return list(override) if override else list(range(1, self.seeds + 1))

    def overrides(self) -> list[str]:
        """``--set`` overrides of ``rftstream up`` for this workload."""
        out: list[str] = []
        ts = "buffer.explorer_input.taskset"
        if self.longtail:
            out.append(f"{ts}.default_workflow_type=longtail_math_workflow")
        if self.reward == "letter_share":
            out.append(f"{ts}.default_reward_fn_type=letter_share_reward")
        if self.max_tokens != 6:
            out += [f"{ts}.rollout_args.max_tokens={self.max_tokens}"]
            out += [f"model.max_response_tokens={self.max_tokens}"]
        if self.min_tokens:
            out.append(f"{ts}.rollout_args.min_tokens={self.min_tokens}")
        return out

    @property
    def plugins(self) -> bool:
        return self.longtail or self.reward != "math"


WORKLOADS = {
    "default": Workload(
        "default", "default workload", targets={"seconds": 0.6, "steps": 1.1, "startup": 1.0}
    ),
    "longtail": Workload(
        "longtail", "long tail (20-200 ms verifier)", longtail=True, targets={"seconds": 0.35}
    ),
    "genheavy": Workload(
        "genheavy",
        "generation-heavy (32-48 new tokens)",
        max_tokens=GENHEAVY_MAX_TOKENS,
        min_tokens=GENHEAVY_MIN_TOKENS,
        reward="letter_share",
        targets={"seconds": 0.5},
        budget_s=480.0,  # TRL needs about 1200 steps on some seeds, at 7 steps/s
        seeds=9,  # TRL's steps to 0.7 spread 439-1225 over seeds 1-9 (module docstring)
    ),
}


def plugins_importable() -> None:
    """Make ``benchmarks/plugins`` importable as top-level modules (once per process)."""
    if str(PLUGINS) not in sys.path:
        sys.path.insert(0, str(PLUGINS))


def reward_fn(workload: Workload) -> Callable[[str, str], float]:
    """The workload's reward of one reply, as both sides and the evaluation compute it."""
    if workload.reward == "letter_share":
        plugins_importable()
        from genheavy import letter_share

        return lambda response, truth: letter_share(response)
    from workflows.rewards import MathReward

    math_reward = MathReward()
    return lambda response, truth: float(math_reward(response=response, truth=truth)["accuracy"])


# ------------------------------------------------------------------ pure helpers


@dataclass
class Curve:
    """One run: per step ``(step, seconds since the parent's clock started, reward)``."""

    label: str
    points: list[tuple[int, float, float]] = field(default_factory=list)
    wall_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    error: str = ""
    snapshots: list[tuple[float, Path]] = field(default_factory=list)  # (seconds, file)
    accuracy: list[tuple[float, float, float]] = field(default_factory=list)  # (s, greedy, t1)

    def first_step_s(self) -> float | None:
        return self.points[0][1] if self.points else None

    def reached(self, threshold: float, window: int = WINDOW) -> tuple[int, float] | None:
        """``(step, seconds)`` where the trailing mean of ``window`` rewards first reaches
        ``threshold``; None if it never does."""
        return steps_to_threshold(self.points, threshold, window)

    def steps_per_s(self) -> float | None:
        if len(self.points) < 2:
            return None
        (s0, t0, _), (s1, t1, _) = self.points[0], self.points[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None


def seed_range(seeds: Sequence[int]) -> str:
    """``1-9`` for consecutive seeds, else ``1,3,7``."""
    if len(seeds) > 2 and list(seeds) == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ",".join(str(x) for x in seeds)


def steps_to_threshold(
    points: Sequence[tuple[int, float, float]], threshold: float, window: int = WINDOW
) -> tuple[int, float] | None:
    """The first ``(step, seconds)`` at which the mean reward of the last ``window`` points
    is >= ``threshold`` (needs ``window`` points); None if never."""
    total = 0.0
    for i, (_step, _t, reward) in enumerate(points):
        total += reward
        if i >= window:
            total -= points[i - window][2]
        if i + 1 >= window and total / window >= threshold - 1e-12:
            return points[i][0], points[i][1]
    return None


def should_stop(
    points: Sequence[tuple[int, float, float]], now_s: float, after_s: float, budget_s: float
) -> bool:
    """The stop rule of every run: the trailing mean reached :data:`STOP_AT`, or ``after_s``
    seconds passed since it reached :data:`THRESHOLD`, or ``now_s`` >= ``budget_s``."""
    if now_s >= budget_s or steps_to_threshold(points, STOP_AT) is not None:
        return True
    hit = steps_to_threshold(points, THRESHOLD)
    return hit is not None and now_s - hit[1] >= after_s


def ratio(ours: float | None, base: float | None) -> float | None:
    if ours is None or base is None or base <= 0:
        return None
    return ours / base


def quartiles(values: Sequence[float]) -> tuple[float, float, float] | None:
    """``(q1, median, q3)`` of ``values`` (linear interpolation, as numpy's default);
    None when empty."""
    if not values:
        return None
    xs = sorted(values)

    def q(p: float) -> float:
        pos = p * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return q(0.25), q(0.5), q(0.75)


def median_or_none(values: Sequence[float | None]) -> float | None:
    """The median of the values that are not None (None when there are none)."""
    xs = [v for v in values if v is not None]
    return median(xs) if xs else None


def median_at_least(
    values: Sequence[float | None], lower_bounds: Sequence[float | None]
) -> tuple[float | None, bool]:
    """The median of ``values`` where a missing value (a run that never got there) is
    known only to exceed its ``lower_bounds`` entry (how far that run went; None: no
    bound, infinity). Returns ``(median, exact)``: the median of the values with each
    missing one replaced by its bound, a lower bound of the true median, and whether it
    is the true median (every bound lies at or above the middle values, so the missing
    values cannot move them). ``(None, True)`` when there are no values."""
    if not values:
        return None, True
    # (value, is a bound), a known value before a bound of the same size
    pairs = sorted(
        (v, False) if v is not None else (b if b is not None else float("inf"), True)
        for v, b in zip(values, lower_bounds, strict=True)
    )
    n = len(pairs)
    middle = pairs[(n - 1) // 2 : n // 2 + 1]
    top = max(m for m, _ in middle)
    exact = not any(bound for _, bound in middle) and all(x >= top for x, bound in pairs if bound)
    return float(sum(m for m, _ in middle) / len(middle)), exact


def ratio_interval(
    ours: Sequence[float | None],
    theirs: Sequence[float | None],
    their_bounds: Sequence[float | None],
    *,
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float] | None:
    """A percentile bootstrap interval of the ratio of medians, ``median(ours) /
    median(theirs)``, at confidence ``level``: each side's seeds are drawn again with
    replacement (independently: rftstream's runs of a seed differ from run to run, so
    seeds do not pair), ``resamples`` times, with a fixed generator (the same figures
    give the same interval). Missing values count as :func:`median_at_least` counts them
    (ours: never, infinity; theirs: where the run stopped). None when a side has no
    value. It says how far the seeds alone could move the ratio: a verdict whose
    interval straddles its target was decided by which seeds ran."""
    import random

    if not ours or not theirs:
        return None
    rng = random.Random(seed)
    mine_bounds = [None] * len(ours)
    pairs = list(zip(theirs, their_bounds, strict=True))
    ratios = []
    for _ in range(resamples):
        mine, _ = median_at_least(rng.choices(list(ours), k=len(ours)), mine_bounds)
        drawn = rng.choices(pairs, k=len(pairs))
        base, _ = median_at_least([v for v, _ in drawn], [b for _, b in drawn])
        if mine is None or base is None or base <= 0 or base == float("inf"):
            continue
        ratios.append(mine / base)
    if not ratios:
        return None
    ratios.sort()
    tail = (1.0 - level) / 2
    lo = ratios[int(tail * (len(ratios) - 1))]
    hi = ratios[int(round((1.0 - tail) * (len(ratios) - 1)))]
    return lo, hi


def verdict(value: float | None, target: float, *, at_least: bool = False) -> str:
    """``PASS`` or ``MISS`` of ``value`` against ``target`` (``<=``, or ``>=`` with
    ``at_least``); a missing value is a MISS."""
    if value is None:
        return "MISS"
    ok = value >= target if at_least else value <= target
    return "PASS" if ok else "MISS"


def rftstream_points(
    records: Sequence[dict[str, Any]], start_ts: float
) -> list[tuple[int, float, float]]:
    """``(step, seconds since start_ts, reward/mean)`` of a ``metrics.jsonl``; steps without
    new rollouts (``reward/mean`` null) are left out."""
    out = []
    for r in records:
        reward = r.get("reward/mean")
        if reward is None:
            continue
        out.append((int(r["step"]), float(r["ts"]) - start_ts, float(reward)))
    return out


def rftstream_ms_per_step(records: Sequence[dict[str, Any]]) -> tuple[float | None, float | None]:
    """``(rollout, train)`` median milliseconds per trainer step of a ``metrics.jsonl``
    after the first step: the explorers' busy time in the step's period (``1 -
    explorer/idle_share`` of it) and ``time/train_step``."""
    rollout, train = [], []
    for r in records[1:]:
        period, idle = r.get("time/trainer_step_period"), r.get("explorer/idle_share")
        if isinstance(period, (int, float)) and isinstance(idle, (int, float)):
            rollout.append(1000.0 * period * (1.0 - idle))
        if isinstance(r.get("time/train_step"), (int, float)):
            train.append(1000.0 * float(r["time/train_step"]))
    return median_or_none(rollout), median_or_none(train)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                break
    return out


# ------------------------------------------------------------------ TRL child


def trl_grpo_config(workload: Workload, output_dir: str, max_steps: int, seed: int) -> Any:
    """TRL's ``GRPOConfig`` for ``workload``, configured as rftstream's default run trains:
    batch 64 (8 prompts x 8 completions, one optimizer step per generation batch, so fully
    on-policy), lr 2e-4 constant, no weight decay, beta 0 (no reference model), fp32,
    gradient checkpointing off, temperature 1, clip 0.2, grad norm 1.0, TRL's default
    ``loss_type`` (``dapo``: the token mean over the batch, as rftstream's ``token-mean``).
    ``tests/integration/test_trl_parity.py`` checks that one step of it on a batch equals
    one step of rftstream's trainer on the same batch."""
    from trl import GRPOConfig

    generation_kwargs = {"min_new_tokens": workload.min_tokens} if workload.min_tokens else None
    return GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=64,
        num_generations=8,
        learning_rate=2e-4,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        beta=0.0,
        max_completion_length=workload.max_tokens,
        temperature=1.0,
        generation_kwargs=generation_kwargs,
        max_steps=max_steps,
        logging_steps=10**9,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,  # train in fp32, as rftstream does (TRL 1.x defaults to bf16)
        gradient_checkpointing=False,  # as rftstream trains (TRL 1.x defaults to on)
        seed=seed,
        disable_tqdm=True,
    )


def trl_child(args: argparse.Namespace) -> int:
    """Run TRL's GRPOTrainer on the workload: one JSON line per step to ``args.out``
    (absolute times; the parent subtracts its clock), a state-dict snapshot every
    ``args.eval_every`` s to ``args.snapshots``."""
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from rftstream.tiny_model import arithmetic_problems, ensure_tiny_model

    plugins_importable()
    from longtail import verifier_delay

    workload = WORKLOADS[args.workload]
    score = reward_fn(workload)
    path = str(ensure_tiny_model())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    rows = [
        {"prompt": [{"role": "user", "content": q}], "answer": a, "task_index": i}
        for i, (q, a) in enumerate(arithmetic_problems())
    ]
    rewards: list[float] = []
    log = Path(args.out).open("w")
    snapshots = Path(args.snapshots)
    snapshots.mkdir(parents=True, exist_ok=True)
    timing = {"rollout": 0.0, "step_start": 0.0, "last_snapshot": 0.0}

    def reward(
        completions: list[Any], answer: list[str], task_index: list[int], **_: Any
    ) -> list[float]:
        if workload.longtail:  # the batch's tasks are verified in parallel: the slowest counts
            time.sleep(max(verifier_delay(int(i)) for i in set(task_index)))
        scores = [score(c[0]["content"], a) for c, a in zip(completions, answer, strict=True)]
        rewards.append(sum(scores) / len(scores))
        return scores

    def snapshot(now: float) -> None:
        torch.save(model.state_dict(), snapshots / f"{now:.3f}.pt")
        timing["last_snapshot"] = now

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, targs: Any, state: Any, control: Any, **kw: Any) -> Any:
            timing["step_start"] = time.time()
            timing["rollout"] = 0.0

        def on_step_end(self, targs: Any, state: Any, control: Any, **kw: Any) -> Any:
            now = time.time()
            step_s = now - timing["step_start"]
            record = {
                "step": len(rewards),
                "t": now,
                "reward": rewards[-1],
                "rollout_s": timing["rollout"],
                "train_s": step_s - timing["rollout"],
            }
            log.write(json.dumps(record) + "\n")
            log.flush()
            if now - timing["last_snapshot"] >= args.eval_every:
                snapshot(now)
            points = [(i + 1, 0.0, r) for i, r in enumerate(rewards)]
            hit = steps_to_threshold(points, THRESHOLD)
            if hit is not None and "reached" not in timing:
                timing["reached"] = now
            done = (
                now - args.t0 >= args.budget_s
                or steps_to_threshold(points, STOP_AT) is not None
                or ("reached" in timing and now - timing["reached"] >= args.after_s)
            )
            if done:
                control.should_training_stop = True
            return control

        def on_log(self, targs: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> Any:
            if metrics_log is not None and logs:
                metrics_log.write(json.dumps({"step": state.global_step, **logs}) + "\n")
                metrics_log.flush()
            return control

    class TimedGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
        def _generate_and_score_completions(self, *a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return super()._generate_and_score_completions(*a, **kw)
            finally:
                timing["rollout"] += time.perf_counter() - t

    config = trl_grpo_config(
        workload, str(Path(args.out).parent / "trl_output"), args.max_steps, args.seed
    )
    metrics_log = None
    if args.log_metrics:  # TRL's metrics of every step, beside the clock's
        config.logging_steps = 1
        metrics_log = Path(f"{args.out}.metrics.jsonl").open("w")
    trainer = TimedGRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        callbacks=[Clock()],
    )
    print(
        f"TRL {__import__('trl').__version__}: torch threads {torch.get_num_threads()}, "
        f"bf16 {config.bf16}, gradient checkpointing {config.gradient_checkpointing}",
        flush=True,
    )
    trainer.train()
    snapshot(time.time())
    log.close()
    if metrics_log is not None:
        metrics_log.close()
    return 0


# ------------------------------------------------------------------ runners


def _quiet_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return env


@dataclass
class Settings:
    """What every run of one benchmark invocation shares."""

    out: Path
    max_steps: int
    eval_every: float
    after_s: float
    budget_s: float | None  # None: each workload's own (Workload.budget_s)
    trl_threads: int
    trl_metrics: bool = False  # TRL's own metrics of every step, to trl.jsonl.metrics.jsonl
    rft_overrides: tuple[str, ...] = ()  # --rft-set: more ``up --set`` overrides, every run

    def budget_for(self, workload: Workload) -> float:
        """The cap per run of ``workload``'s runs, s."""
        return self.budget_s if self.budget_s is not None else workload.budget_s


def run_trl(s: Settings, workload: Workload, seed: int, name: str) -> Curve:
    """One TRL run (a child process of this script); blocks until it ends."""
    workdir = s.out / name
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "trl.jsonl"
    t0 = time.time()
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "_trl",
        *("--out", str(out), "--snapshots", str(workdir / "snapshots")),
        *("--workload", workload.name, "--seed", str(seed), "--max-steps", str(s.max_steps)),
        *("--t0", repr(t0), "--threads", str(s.trl_threads)),
        *("--eval-every", str(s.eval_every), "--after-s", str(s.after_s)),
        *("--budget-s", str(s.budget_for(workload))),
        *(("--log-metrics",) if s.trl_metrics else ()),
    ]
    with (workdir / "trl.log").open("w") as logf:
        proc = subprocess.run(argv, stdout=logf, stderr=subprocess.STDOUT, env=_quiet_env())
    curve = Curve("TRL", wall_s=time.time() - t0)
    records = _read_jsonl(out)
    curve.points = [(r["step"], r["t"] - t0, r["reward"]) for r in records]
    steady = records[1:]
    curve.extra["rollout ms"] = median_or_none([1000 * r["rollout_s"] for r in steady]) or 0.0
    curve.extra["train ms"] = median_or_none([1000 * r["train_s"] for r in steady]) or 0.0
    curve.snapshots = _snapshot_files(workdir / "snapshots", t0)
    if proc.returncode != 0:
        curve.error = f"exit {proc.returncode}; see {workdir / 'trl.log'}"
    return curve


def _snapshot_files(directory: Path, t0: float) -> list[tuple[float, Path]]:
    """``(seconds since t0, file)`` of the snapshots ``<absolute time>.pt`` in ``directory``."""
    if not directory.exists():
        return []
    return sorted((float(p.stem) - t0, p) for p in directory.glob("*.pt"))


def run_rftstream(s: Settings, workload: Workload, seed: int, name: str) -> Curve:
    """One ``rftstream up`` (a child process), stopped with Ctrl-C by :func:`should_stop`,
    its weights sampled by a :class:`WeightsObserver`; blocks until it ends."""
    workdir = s.out / name
    workdir.mkdir(parents=True, exist_ok=True)
    run_dir = workdir / "run"
    argv = [
        *(sys.executable, "-m", "rftstream.cli", "up"),
        *("--steps", str(s.max_steps), "--run-dir", str(run_dir), "--fresh"),
        *("--set", f"seed={seed}"),
    ]
    for o in (*workload.overrides(), *s.rft_overrides):
        argv += ["--set", o]
    if workload.plugins:
        argv += ["--plugin-dir", str(PLUGINS)]
    metrics = run_dir / "metrics.jsonl"
    stopped = False
    t0 = time.time()
    observer = WeightsObserver(run_dir, workdir / "snapshots", t0, s.eval_every)
    observer.start()
    with (workdir / "up.log").open("w") as logf:
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=_quiet_env())
        while proc.poll() is None:
            time.sleep(0.5)
            points = rftstream_points(_read_jsonl(metrics), t0)
            if not stopped and should_stop(
                points, time.time() - t0, s.after_s, s.budget_for(workload)
            ):
                observer.stop()  # its last snapshot first: the weights the run ends with
                proc.send_signal(signal.SIGINT)  # Ctrl-C: everything shuts down
                stopped = True
        proc.wait()
    observer.stop()
    records = _read_jsonl(metrics)
    curve = Curve("rftstream", points=rftstream_points(records, t0), wall_s=time.time() - t0)
    if proc.returncode not in (0, 130) or (proc.returncode == 130 and not stopped):
        curve.error = f"exit {proc.returncode}; see {workdir / 'up.log'}"
    if observer.error:
        curve.error = (curve.error + "; " if curve.error else "") + observer.error
    rollout_ms, train_ms = rftstream_ms_per_step(records)
    curve.extra["rollout ms"] = rollout_ms or 0.0
    curve.extra["train ms"] = train_ms or 0.0
    curve.snapshots = _snapshot_files(workdir / "snapshots", t0)
    return curve


class WeightsObserver:
    """Saves the newest weight version of a running ``rftstream up`` every ``every`` s.

    A thread of this process: waits for the run's lock record (its server's URL) and
    credential, connects as an explorer would and, every ``every`` seconds, reads the
    weights pointer and fetches that version with rftstream's own
    :class:`~rftstream.weights.fetcher.WeightFetcher` (deltas on the version it fetched
    before); the snapshot is stamped with the time the pointer was read. Between
    snapshots it fetches nothing, so it takes little from the run.
    """

    def __init__(self, run_dir: Path, out: Path, t0: float, every: float) -> None:
        self.run_dir, self.out, self.t0, self.every = run_dir, out, t0, every
        self.error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="weights-observer", daemon=True)

    def start(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self._thread.start()

    def stop(self) -> None:
        """Take one last snapshot, then end (blocks up to 30 s)."""
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(timeout=30)

    def _main(self) -> None:
        import anyio

        try:
            anyio.run(self._observe)
        except Exception as exc:  # noqa: BLE001 - reported with the run
            self.error = f"weights observer: {type(exc).__name__}: {exc}"

    async def _observe(self) -> None:
        import anyio
        import torch

        from rftstream.bus.client import Bus
        from rftstream.bus.state import RunState
        from rftstream.config.loader import load_config
        from rftstream.config.validate import run_id_from_name
        from rftstream.inspect_target import inspect_target
        from rftstream.run_lock import live_owner
        from rftstream.subjects import RunNames
        from rftstream.weights.fetcher import WeightFetcher

        while not _server_url(live_owner(self.run_dir)):  # wait for the run's server
            if self._stop.is_set():
                return
            await anyio.sleep(0.2)
        # the run's name; its nats settings are the defaults (the credential is the
        # embedded server's, which inspect_target reads from the run directory)
        import yaml

        run_cfg = yaml.safe_load((self.run_dir / "config.yaml").read_text()) or {}
        cfg = load_config(None, [f"name={run_cfg.get('name', 'default')}"], validate=False)
        engine = _SnapshotEngine()
        with inspect_target(cfg, None, str(self.run_dir)) as (url, target):
            names = RunNames(run_id_from_name(cfg.name), name=cfg.name)
            bus = await Bus.connect(url, names, target.nats, actor="bench-observer")
            try:
                state = RunState(await bus.kv())
                fetcher = WeightFetcher(bus, state, engine, name="bench-observer")
                last = False
                while not last:
                    with anyio.move_on_after(self.every):
                        while not self._stop.is_set():
                            await anyio.sleep(0.1)
                    last = self._stop.is_set()
                    read_at = time.time()
                    ptr = await state.latest_weights()
                    if ptr is None or ptr.version == 0:
                        continue
                    want = (ptr.incarnation, ptr.version)
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(fetcher.run)
                        got = await fetcher.wait_staged(want, timeout=20)
                        tg.cancel_scope.cancel()
                    if got and engine.weights:
                        torch.save(dict(engine.weights), self.out / f"{read_at:.3f}.pt")
                    await fetcher.swap()
            finally:
                await bus.close()


def _server_url(owner: Any) -> str:
    """The NATS URL of a run's lock record (empty while there is none)."""
    return str(getattr(owner, "url", "") or "")


class _SnapshotEngine:
    """The rollout-engine side :class:`WeightFetcher` stages into: keeps the newest full
    set of tensors (a partial version updates the tensors it carries)."""

    def __init__(self) -> None:
        self.weights: dict[str, Any] = {}

    async def stage_weights(
        self, state_dict: dict[str, Any], version: int, *, partial: bool = False
    ) -> None:
        if not partial:
            self.weights = {}
        self.weights.update({k: v.detach().clone() for k, v in state_dict.items()})

    async def swap_staged(self, *, wait: bool = True) -> float | None:
        return 0.0


# ------------------------------------------------------------------ evaluation


class Evaluator:
    """Scores a policy snapshot: greedy and temperature-1 accuracy on the 100 prompts,
    with a workload's token limits and reward (one function for both sides)."""

    def __init__(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rftstream.tiny_model import arithmetic_problems, ensure_tiny_model

        path = str(ensure_tiny_model())
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        self.initial = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.tasks = arithmetic_problems()
        self.prompts = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
                ),
                add_special_tokens=False,
            )
            for q, _ in self.tasks
        ]
        self.rewards: dict[str, Callable[[str, str], float]] = {}  # workload name -> reward

    def score(self, state: dict[str, Any] | None, workload: Workload) -> tuple[float, float]:
        """``(greedy, temperature 1)`` accuracy of ``state`` (None: the initial model)."""
        import torch

        from rftstream.engines.transformers_engine import SequenceSpec, sample_sequences

        weights = self.initial if state is None else state
        result = self.model.load_state_dict(weights, strict=False)
        if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
            raise RuntimeError(f"snapshot does not fit the model: {result}")
        score = self.rewards.get(workload.name)
        if score is None:
            score = self.rewards[workload.name] = reward_fn(workload)
        out = []
        for temperature, n in ((0.0, 1), (1.0, EVAL_SAMPLES)):
            seqs, truths = [], []
            for ids, (_, truth) in zip(self.prompts, self.tasks, strict=True):
                for _ in range(n):
                    seqs.append(
                        SequenceSpec(
                            prompt=ids,
                            max_new_tokens=workload.max_tokens,
                            min_new_tokens=workload.min_tokens,
                            temperature=temperature,
                        )
                    )
                    truths.append(truth)
            comps = sample_sequences(
                self.model,
                seqs,
                eos_token_ids={int(self.tokenizer.eos_token_id)},
                pad_token_id=int(self.tokenizer.pad_token_id),
                generator=torch.Generator().manual_seed(0),
            )
            correct = sum(
                score(self.tokenizer.decode(c.token_ids, skip_special_tokens=True), t)
                for c, t in zip(comps, truths, strict=True)
            )
            out.append(correct / len(seqs))
        return out[0], out[1]


def evaluate_runs(runs: list[tuple[Workload, int, Curve]], console: Any) -> None:
    """Score every snapshot of every run (fills ``Curve.accuracy``); blocks."""
    import torch

    evaluator = Evaluator()
    base: dict[str, tuple[float, float]] = {}
    total = sum(len(c.snapshots) for _, _, c in runs)
    done = 0
    with console.status("scoring snapshots…") as status:
        for workload, _seed, curve in runs:
            if workload.name not in base:
                base[workload.name] = evaluator.score(None, workload)
            curve.accuracy = [(0.0, *base[workload.name])]
            for t, path in curve.snapshots:
                state = torch.load(path, map_location="cpu", weights_only=True)
                curve.accuracy.append((t, *evaluator.score(state, workload)))
                done += 1
                status.update(f"scoring snapshots… {done}/{total}")


def plot_accuracy(runs: list[tuple[Workload, int, Curve]], path: Path) -> None:
    """Greedy and temperature-1 accuracy against seconds, a column per workload, a line
    per run (TRL orange, rftstream blue)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(w.name for w, _, _ in runs))
    fig, axes = plt.subplots(2, len(names), figsize=(5 * len(names), 7), squeeze=False)
    colors = {"TRL": "tab:orange", "rftstream": "tab:blue"}
    for col, name in enumerate(names):
        for row, kind in enumerate(("greedy", "temperature 1")):
            ax = axes[row][col]
            seen = set()
            for w, _seed, c in runs:
                if w.name != name or not c.accuracy:
                    continue
                xs = [a[0] for a in c.accuracy]
                ys = [a[1 + row] for a in c.accuracy]
                label = c.label if c.label not in seen else None
                seen.add(c.label)
                ax.plot(xs, ys, color=colors.get(c.label, "gray"), alpha=0.7, label=label)
            ax.axhline(THRESHOLD, color="gray", lw=0.5, ls="--")
            ax.set_title(f"{WORKLOADS[name].title}: {kind}", fontsize=9)
            ax.set_xlabel("seconds from process start")
            ax.set_ylabel(
                "letter share (the reward)"
                if WORKLOADS[name].reward == "letter_share"
                else "accuracy"
            )
            ax.set_ylim(0, 1)
            if row == 0:
                ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ report


def _fmt(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def _iqr(values: Sequence[float | None], spec: str) -> str:
    xs = [v for v in values if v is not None]
    q = quartiles(xs)
    if q is None:
        return "—"
    missing = len(values) - len(xs)
    tail = f" ({missing} never)" if missing else ""
    return f"{format(q[1], spec)} [{format(q[0], spec)}–{format(q[2], spec)}]{tail}"


def report(
    workload: Workload, trl: list[Curve], ours: list[Curve], console: Any
) -> tuple[list[str], bool]:
    """Print the table of one workload; return its target lines and whether all passed."""
    from rich.table import Table

    table = Table(title=f"{workload.title}: median [IQR] of {len(trl)} seeds")
    for col in (
        "side",
        "s to 0.7",
        "steps to 0.7",
        "start-up s",
        "rollout ms/step",
        "train ms/step",
        "steps/s",
        "final greedy / T=1",
    ):
        table.add_column(col, justify="left" if col == "side" else "right")
    for label, curves in (("TRL GRPOTrainer", trl), ("rftstream up", ours)):
        hits = [c.reached(THRESHOLD) for c in curves]
        finals = [c.accuracy[-1] for c in curves if c.accuracy]
        table.add_row(
            label,
            _iqr([h[1] if h else None for h in hits], ".1f"),
            _iqr([float(h[0]) if h else None for h in hits], ".0f"),
            _iqr([c.first_step_s() for c in curves], ".1f"),
            _iqr([c.extra.get("rollout ms") for c in curves], ".0f"),
            _iqr([c.extra.get("train ms") for c in curves], ".0f"),
            _iqr([c.steps_per_s() for c in curves], ".1f"),
            f"{_fmt(median_or_none([f[1] for f in finals]), '.2f')} / "
            f"{_fmt(median_or_none([f[2] for f in finals]), '.2f')}",
        )
    console.print(table)

    def secs(c: Curve) -> float | None:
        hit = c.reached(THRESHOLD)
        return hit[1] if hit else None

    def steps(c: Curve) -> float | None:
        hit = c.reached(THRESHOLD)
        return float(hit[0]) if hit else None

    def ran_secs(c: Curve) -> float | None:
        return c.points[-1][1] if c.points else None

    def ran_steps(c: Curve) -> float | None:
        return float(c.points[-1][0]) if c.points else None

    lines, ok = [], True
    checks = [
        ("seconds", "seconds to 0.7", secs, ran_secs),
        ("steps", "steps to 0.7", steps, ran_steps),
        ("startup", "start-up (to the first trainer step)", lambda c: c.first_step_s(), None),
    ]
    for key, what, pick, ran in checks:
        if key not in workload.targets:
            continue
        target = workload.targets[key]
        # a run of ours that never got there counts as never (infinity): the median is honest
        mine, _ = median_at_least([pick(c) for c in ours], [None] * len(ours))
        theirs, exact = median_at_least(
            [pick(c) for c in trl], [ran(c) if ran else None for c in trl]
        )
        note = ""
        if mine == float("inf"):  # rftstream never got there (in most seeds): a MISS
            r, v = None, "MISS"
        elif theirs is None or theirs == float("inf"):  # TRL runs without a single step
            r, v = None, "UNDECIDED (TRL ran no step)"
        else:
            r = ratio(mine, theirs)
            v = verdict(r, target)
            if not exact and r is not None:
                # a TRL run that never got there counts as reaching it where it stopped, so
                # TRL's median is at least ``theirs`` and the ratio at most ``r``
                never = sum(pick(c) is None for c in trl)
                note = (
                    f"; at most: {never} TRL run(s) never got there and count as reaching it"
                    " where they stopped"
                )
                if v != "PASS":
                    v = "UNDECIDED (raise --budget-s)"
        ok &= v == "PASS"
        at_most = "" if exact or r is None else "<= "
        spread = ""
        if r is not None:
            bounds = [ran(c) if ran else None for c in trl]
            interval = ratio_interval([pick(c) for c in ours], [pick(c) for c in trl], bounds)
            if interval is not None:
                lo, hi = (_fmt(x, ".2f") if x != float("inf") else "∞" for x in interval)
                spread = f"; 95% bootstrap interval over seeds {lo}-{hi}x"
        lines.append(
            f"{workload.title}: {what}, rftstream / TRL = {at_most}{_fmt(r, '.2f')}x "
            f"(median of {len(ours)} seeds{note}{spread}; target <= {target}x): {v}"
        )
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    child = sub.add_parser("_trl", help=argparse.SUPPRESS)
    for flag, kind in (
        ("--out", str),
        ("--snapshots", str),
        ("--workload", str),
        ("--seed", int),
        ("--max-steps", int),
        ("--t0", float),
        ("--threads", int),
        ("--eval-every", float),
        ("--after-s", float),
        ("--budget-s", float),
    ):
        child.add_argument(flag, type=kind, required=True)
    child.add_argument(
        "--log-metrics",
        action="store_true",
        help="also write TRL's own metrics of every step (entropy, grad_norm, lengths, "
        "clip ratios) to <out>.metrics.jsonl: for comparing curves, not for timing",
    )
    ap.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all")
    ap.add_argument(
        "--seeds",
        default="",
        help="comma-separated, for every workload (default: 1-5, generation-heavy 1-9)",
    )
    ap.add_argument("--max-steps", type=int, default=5000, help="cap per run (default 5000)")
    ap.add_argument("--eval-every", type=float, default=5.0, help="snapshot period, s (5)")
    ap.add_argument("--after-s", type=float, default=15.0, help="run on after 0.7, s (15)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="cap per run, s (default: the workload's, 240; generation-heavy 480)",
    )
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ap.add_argument(
        "--trl-threads", type=int, default=cpus or 1, help="TRL's torch threads (all cores)"
    )
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up runs")
    ap.add_argument(
        "--trl-metrics",
        action="store_true",
        help="also keep TRL's own metrics of every step (entropy, grad_norm, lengths) in "
        "each TRL run's trl.jsonl.metrics.jsonl (TRL then logs every step: compare curves "
        "with it, not seconds)",
    )
    ap.add_argument(
        "--rft-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another `rftstream up --set` for every rftstream run (repeatable), e.g. "
        "algorithm.logprobs_of=model: TRL's log-probs under min_tokens",
    )
    ap.add_argument("--out", default="benchmarks/results/vs_trl", help="runs, plot, results")
    args = ap.parse_args(argv)
    if args.cmd == "_trl":
        return trl_child(args)

    from rich.console import Console

    console = Console(width=max(150, Console().width))
    try:
        import trl
    except ImportError:
        console.print("[red]TRL is not installed: pip install -e '.[bench]'[/]")
        return 2
    from rftstream.launch.actor_process import torch_threads_per_process
    from rftstream.tiny_model import ensure_tiny_model

    override = [int(x) for x in args.seeds.split(",") if x.strip()]
    workloads = list(WORKLOADS.values()) if args.workload == "all" else [WORKLOADS[args.workload]]
    plan = {w.name: w.seed_list(override) for w in workloads}
    # --seeds runs in the order given, as before; else every workload's seeds, ascending
    seeds = override or sorted({seed for listed in plan.values() for seed in listed})
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    s = Settings(
        out,
        args.max_steps,
        args.eval_every,
        args.after_s,
        args.budget_s,
        args.trl_threads,
        args.trl_metrics,
        tuple(args.rft_set),
    )
    console.print(
        f"TRL {trl.__version__} GRPOTrainer: one process, torch threads {s.trl_threads}, fp32, "
        "gradient checkpointing off, batch 64 = 8 prompts x 8, lr 2e-4, beta 0\n"
        f"rftstream up: trainer + explorer + operator host processes, torch threads "
        f"{torch_threads_per_process(2)} per trainer/explorer process, operator 1"
        + "".join(f"; --set {o}" for o in s.rft_overrides)
        + "\n"
        + LOGPROBS_NOTE
        + "\n"
        f"{cpus} cores; seeds "
        + ", ".join(f"{w.name} {seed_range(plan[w.name])}" for w in workloads)
        + f"; stop at trailing {STOP_AT}, {s.after_s:.0f} s after "
        f"{THRESHOLD}, or at the cap ("
        + ", ".join(f"{w.name} {s.budget_for(w):.0f} s" for w in workloads)
        + f"); snapshots every {s.eval_every:.0f} s; runs in {out}"
    )
    ensure_tiny_model()  # built before any timed run
    runs: list[tuple[Workload, int, Curve]] = []
    try:
        if not args.no_warmup:
            warm = Settings(out / "warmup", 5000, 1e9, 0.0, 8.0, s.trl_threads)
            with console.status("warm-up (untimed): TRL, then rftstream up…"):
                run_trl(warm, WORKLOADS["default"], 0, "trl")
                run_rftstream(warm, WORKLOADS["default"], 0, "rftstream")
        for i, seed in enumerate(seeds):
            for workload in workloads:
                if seed not in plan[workload.name]:
                    continue
                order = (run_trl, run_rftstream) if i % 2 == 0 else (run_rftstream, run_trl)
                for runner in order:
                    side = "trl" if runner is run_trl else "rftstream"
                    with console.status(f"seed {seed}, {workload.name}: {side}…"):
                        curve = runner(s, workload, seed, f"{workload.name}/seed{seed}/{side}")
                    hit = curve.reached(THRESHOLD)
                    console.print(
                        f"seed {seed}, {workload.name}, {curve.label}: "
                        + (f"0.7 at {hit[1]:.1f} s (step {hit[0]})" if hit else "never 0.7")
                        + f", {len(curve.points)} steps in {curve.wall_s:.0f} s"
                        + (f" [red]{curve.error}[/]" if curve.error else "")
                    )
                    runs.append((workload, seed, curve))
    except KeyboardInterrupt:
        return 130
    evaluate_runs(runs, console)
    plot_accuracy(runs, out / "accuracy.png")
    lines: list[str] = []
    all_ok = True
    for workload in workloads:
        mine = [c for w, _, c in runs if w is workload]
        trl_curves = [c for c in mine if c.label == "TRL"]
        ours = [c for c in mine if c.label == "rftstream"]
        got, ok = report(workload, trl_curves, ours, console)
        lines += got
        all_ok &= ok
    (out / "results.json").write_text(
        json.dumps(
            [
                {
                    "workload": w.name,
                    "seed": seed,
                    "side": c.label,
                    "points": c.points,
                    "accuracy": c.accuracy,
                    "extra": c.extra,
                    "error": c.error,
                }
                for w, seed, c in runs
            ]
        )
    )
    for line in lines:
        console.print(line)
    console.print(f"accuracy against wall-clock seconds: {out / 'accuracy.png'}")
    errors = [c.error for _, _, c in runs if c.error]
    if errors:
        console.print(f"[red]{len(errors)} run(s) failed[/]: " + "; ".join(errors))
        return 2
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
