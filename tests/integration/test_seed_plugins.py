"""The seeds' ExampleWorkflow and RewardFilter, adapted only in their imports,
run as plugins from a --plugin-dir through the real actors and NATS."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import anyio
import pytest

from rftstream.config import config_from_dict
from rftstream.plugins.loader import load_plugins
from rftstream.runtime import prepare_run
from tests.integration._util import read_experiences, read_stream, run_actors_to_end, small_config

pytestmark = pytest.mark.integration

# Seeds 004 (the "Full Code Example" workflow) and 003 (the operator section's
# RewardFilter), verbatim apart from the imports.
SEED_PLUGINS = Path(__file__).parents[1] / "seed_plugins"


def test_seed_workflow_and_filter_as_plugins(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    from workflows import WORKFLOWS

    WORKFLOWS.unregister("example_workflow")  # the unit tests register the same seed class
    # a fresh directory: the loader executes a directory's files once per process, and the
    # registries are restored after every test
    plugin_dir = tmp_path / "plugins"
    plugin_dir.mkdir()
    for seed in SEED_PLUGINS.glob("[!_]*.py"):
        shutil.copy(seed, plugin_dir / seed.name)
    loaded = load_plugins([plugin_dir])
    assert len(loaded) == 2
    from operators import EXPERIENCE_OPERATORS

    assert EXPERIENCE_OPERATORS.get("reward_filter").__module__.endswith("reward_filter")
    assert "rftstream_plugins" in EXPERIENCE_OPERATORS.get("reward_filter").__module__

    cfg = small_config(tmp_path, tiny_model_path, buffer__train_batch_size=2, buffer__total_steps=2)
    cfg["buffer"]["explorer_input"]["taskset"]["default_workflow_type"] = "example_workflow"
    cfg["data_processor"] = {
        "experience_pipeline": {
            "operators": [{"name": "reward_filter", "args": {"threshold": 0.5}}]
        }
    }
    cfg["buffer"]["batch_size"] = 8
    run = prepare_run(config_from_dict(cfg))
    steps = run_actors_to_end(run, nats_url, timeout=300)
    assert [r["step"] for r in steps] == [1, 2]

    async def check() -> None:
        raw = await read_experiences(nats_url, "rft.itest.exp.raw")
        train = await read_experiences(nats_url, "rft.itest.exp.train")
        assert raw and train
        # the ExampleWorkflow ran: its prompt format, exact-match rewards
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tiny_model_path)
        assert all("Question:\n" in tok.decode(e.tokens[: e.prompt_length].tolist()) for e in raw)
        assert {e.reward for e in raw} <= {0.0, 1.0}
        assert any(e.reward == 0.0 for e in raw)
        # the RewardFilter ran in the operator host: only rewards >= 0.5 reach the trainer
        assert all(e.reward >= 0.5 for e in train)
        passed = {e.eid.uid for e in raw if e.reward >= 0.5}
        assert {e.eid.uid for e in train} <= passed

    anyio.run(check, backend="asyncio")


def _run_seed_example(
    name: str, tmp_path: Path, tiny_model_path: str, nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[dict], object]:
    """Load examples/<name>/ as a --plugin-dir and run its yaml for 2 steps."""
    from rftstream.config import load_config

    root = Path(__file__).resolve().parents[2]
    example = root / "examples" / name
    monkeypatch.chdir(root)  # the yaml names its dataset relative to the project root
    monkeypatch.setenv("RFTSTREAM_CACHE", str(Path(tiny_model_path).parent))
    loaded = load_plugins([example])  # logs that each class replaces the built-in
    assert len(loaded) == 1
    cfg = load_config(
        next(example.glob("*.yaml")),
        [
            "buffer.batch_size=2",
            "algorithm.repeat_times=4",
            "explorer.runner_num=2",
            "trainer.ppo_micro_batch_size_per_gpu=4",
        ],
    )
    run = prepare_run(cfg, steps=2, run_dir=str(tmp_path / "run"))
    steps = run_actors_to_end(run, nats_url, timeout=300)
    assert [r["step"] for r in steps] == [1, 2]
    return steps, run


def test_seed_opmd_algorithm_as_plugin(
    tmp_path: Path, tiny_model_path: str, nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps, run = _run_seed_example("seed_opmd", tmp_path, tiny_model_path, nats_url, monkeypatch)
    from algorithms import ADVANTAGE_FN, ALGORITHM_TYPE, POLICY_LOSS_FN

    for registry in (ADVANTAGE_FN, POLICY_LOSS_FN, ALGORITHM_TYPE):
        assert "rftstream_plugins" in registry.get("opmd").__module__
    assert "rftstream_plugins" in type(run.algorithm.policy_loss_fn).__module__
    for record in steps:
        assert math.isfinite(record["actor/opmd_loss"])

    # the seed advantage ran in the operator host: its figures are on the metrics stream
    async def operator_values() -> list[dict]:
        msgs = await read_stream(nats_url, f"rft.{run.names.run}.metrics.>")
        bodies = [json.loads(m.data) for m in msgs]
        return [b["values"] for b in bodies if b["role"] == "operator"]

    ops = anyio.run(operator_values, backend="asyncio")
    baselines = [
        v["group_advantage/group_baseline"] for v in ops if "group_advantage/group_baseline" in v
    ]
    assert baselines and all(math.isfinite(b) and 0.0 <= b <= 1.0 for b in baselines)
    # the seed's metrics only: it reports no reward_mean (the built-in opmd does)
    assert not any("group_advantage/reward_mean" in v for v in ops)


def test_seed_mix_algorithm_as_plugin(
    tmp_path: Path, tiny_model_path: str, nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps, run = _run_seed_example("seed_mix", tmp_path, tiny_model_path, nats_url, monkeypatch)
    from algorithms import POLICY_LOSS_FN, SAMPLE_STRATEGY

    assert "rftstream_plugins" in SAMPLE_STRATEGY.get("mix").__module__
    assert "rftstream_plugins" in POLICY_LOSS_FN.get("mix").__module__
    # the seed's loss got the batch shape filled in: 8 per step, ceil(0.25 * 8) = 2 expert
    args = run.algorithm.config.policy_loss_fn_args
    assert args["train_batch_size_expert"] == 2 and args["train_batch_size_usual"] == 6
    for record in steps:
        # the seed's strategy ran (its Timer keys) and its loss saw both kinds of rows
        assert "read_time" in record and "gather_time" in record
        assert "actor/usual/pg_loss" in record and "actor/expert/sft_loss" in record
        assert record["experience/trained"] == 8
