"""``mode: explore`` and ``mode: bench`` on a real nats-server, no trainer.

The ``openai`` rollout engine talks to the project's own OpenAI-compatible
server on loopback (a transformers engine on the tiny model), through the
real explorer: in explore mode it publishes experience groups that the
operator pipeline carries to ``exp.train`` for someone else to train on; in
bench mode it evaluates the eval tasksets (and, with an engine that can load
weights, each saved checkpoint) into ``eval.jsonl``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from safetensors.torch import load_file, save_file

from rftstream.config import config_from_dict
from rftstream.experience import decode_group
from rftstream.runtime import prepare_run, roles_for, run_actors
from tests.integration._util import read_kv, read_stream
from tests.integration.test_openai_api import served

pytestmark = pytest.mark.integration

ROWS = [
    {"question": f"{a}+{b}=", "answer": str(a + b)}
    for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (0, 7)]
]


def _config(tmp_path: Path, tiny_model_path: str, mode: str, **over: Any) -> dict[str, Any]:
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg: dict[str, Any] = {
        "mode": mode,
        "name": f"m_{mode}",
        "model": {"model_path": tiny_model_path, "max_response_tokens": 6},
        "buffer": {
            "batch_size": 2,
            "explorer_input": {
                "taskset": {"path": str(data), "rollout_args": {"max_tokens": 6}},
            },
        },
        "explorer": {"runner_num": 2, "max_retry_times": 0, "max_timeout": 120},
        "algorithm": {"algorithm_type": "grpo", "repeat_times": 3},
        "run_dir": str(tmp_path / "run"),
    }
    for section, values in over.items():
        if isinstance(values, dict):
            cfg.setdefault(section, {}).update(values)
        else:
            cfg[section] = values
    return cfg


def _evals(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]


def test_roles_by_mode(tmp_path: Path, tiny_model_path: str) -> None:
    for mode, roles in [
        ("both", ("explorer", "operator", "trainer")),
        ("explore", ("explorer", "operator")),
        ("bench", ("explorer",)),
    ]:
        over = {"buffer": {"explorer_input": {"eval_tasksets": [{"name": "e"}]}}}
        cfg = config_from_dict(_config(tmp_path, tiny_model_path, mode, **over))
        assert roles_for(cfg) == roles, mode


def test_explore_mode_with_the_openai_engine(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    """Explorer (openai engine against our loopback server) + operator pipeline, no trainer:
    ends at buffer.total_steps, groups reach exp.train with GRPO advantages."""
    out: dict[str, Any] = {}

    async def main() -> None:
        async with served(tiny_model_path) as (model, engine):
            base_url = await model.start_openai_server()
            data = _config(
                tmp_path,
                tiny_model_path,
                "explore",
                buffer={"total_steps": 2},
                explorer={"rollout_model": {"engine_type": "openai", "base_url": base_url}},
            )
            data["buffer"]["explorer_input"]["taskset"]["rollout_args"]["temperature"] = 0.7
            run = prepare_run(config_from_dict(data))
            assert roles_for(run.cfg) == ("explorer", "operator")
            with anyio.fail_after(240):
                await run_actors(run, nats_url)
            out["raw"] = await read_stream(nats_url, run.names.exp_subject("raw"))
            out["train"] = await read_stream(nats_url, run.names.exp_subject("train"))
            out["kv"] = await read_kv(nats_url, run.names.kv_bucket)
            out["requests"] = engine.stats["requests"]
            # what the server's model gives those tokens, for the logprob check
            out["scores"] = []
            for msg in out["raw"]:
                for e in decode_group(msg.data):
                    scored = await engine.score(
                        e.tokens.tolist(), start=e.prompt_length, temperature=0.7
                    )
                    out["scores"].append((e.logprobs.tolist(), scored.logprobs))

    anyio.run(main, backend="asyncio")
    raw, train, kv = out["raw"], out["train"], out["kv"]
    # two explorer steps of two tasks, one group of repeat_times 3 each; one HTTP request each
    assert len(raw) == 4 and out["requests"] == 4
    groups = [decode_group(m.data) for m in raw]
    for group in groups:
        assert [e.eid.run for e in group] == [0, 1, 2]
        assert all(e.model_version == 0 and 0 < e.response_length <= 6 for e in group)
    for ours, theirs in out["scores"]:  # sampled by the server's model, at temperature 0.7
        assert ours == pytest.approx(theirs, abs=1e-4)
    # the operator pipeline carried every group to exp.train, with GRPO's group advantages
    assert len(train) == 4
    for msg in train:
        group = decode_group(msg.data)
        assert len(group) == 3 and all(e.advantages is not None for e in group)
        if len({e.reward for e in group}) == 1:  # no signal in the group
            assert all(float(e.advantages.abs().max()) == 0.0 for e in group)
    # no trainer, no weights: the explorer ended the run at total_steps
    assert kv["status"] == "finished"
    assert kv["explorer.explorer.step"] == 2
    assert kv["explorer.explorer.done"]["why"] == "total_steps"
    assert not any(k.startswith(("trainer.", "weights.")) for k in kv)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_explore_mode_ends_when_the_taskset_is_done(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    """The embedded engine in explore mode: 5 tasks, batch 2 -> 3 steps, then the run ends."""
    run = prepare_run(config_from_dict(_config(tmp_path, tiny_model_path, "explore")))
    steps: list[dict[str, Any]] = []

    async def main() -> dict[str, Any]:
        with anyio.fail_after(240):
            await run_actors(run, nats_url, on_progress=steps.append)
        return {
            "raw": await read_stream(nats_url, run.names.exp_subject("raw")),
            "train": await read_stream(nats_url, run.names.exp_subject("train")),
            "kv": await read_kv(nats_url, run.names.kv_bucket),
        }

    out = anyio.run(main, backend="asyncio")
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert len(out["raw"]) == len(out["train"]) == len(ROWS)
    indices = sorted(e.info["task_index"] for m in out["raw"] for e in decode_group(m.data)[:1])
    assert indices == list(range(len(ROWS)))  # every row once
    assert out["kv"]["status"] == "finished"
    assert out["kv"]["explorer.explorer.done"]["why"] == "drained"
    assert "weights.latest" not in out["kv"]


def _eval_config(tmp_path: Path, tiny_model_path: str, **over: Any) -> dict[str, Any]:
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:4]))
    cfg = _config(tmp_path, tiny_model_path, "bench", **over)
    cfg["buffer"]["explorer_input"]["eval_tasksets"] = [
        {
            "name": "arith",
            "path": str(data),
            "repeat_times": 2,
            "rollout_args": {"max_tokens": 6, "temperature": 0.0},
        }
    ]
    return cfg


def _checkpoint(src: str, dest: Path, transform: Any = None) -> None:
    dest.mkdir(parents=True)
    for f in Path(src).iterdir():
        if f.is_file():
            shutil.copy(f, dest / f.name)
    if transform is not None:
        state = load_file(str(dest / "model.safetensors"))
        save_file({k: transform(v) for k, v in state.items()}, str(dest / "model.safetensors"))


def test_bench_mode_with_the_openai_engine(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    """The given model behind our loopback server is evaluated once; a saved checkpoint
    cannot be loaded into an external server, so it is skipped (no weight load, no crash)."""
    _checkpoint(tiny_model_path, tmp_path / "run" / "checkpoints" / "global_step_5")
    out: dict[str, Any] = {}

    async def main() -> None:
        async with served(tiny_model_path) as (model, engine):
            base_url = await model.start_openai_server()
            data = _eval_config(
                tmp_path,
                tiny_model_path,
                explorer={"rollout_model": {"engine_type": "openai", "base_url": base_url}},
            )
            run = prepare_run(config_from_dict(data))
            with anyio.fail_after(240):
                await run_actors(run, nats_url)
            out["raw"] = await read_stream(nats_url, run.names.exp_subject("raw"))
            out["kv"] = await read_kv(nats_url, run.names.kv_bucket)
            out["metrics"] = await read_stream(nats_url, run.names.metrics_wildcard)
            out["requests"] = engine.stats["requests"]
            out["version"] = engine.model_version

    anyio.run(main, backend="asyncio")
    (record,) = _evals(tmp_path / "run")
    assert record["step"] == 0 and record["bench"] is True and record["checkpoint"] is None
    assert record["eval/arith/tasks"] == 4 and record["eval/arith/failed_tasks"] == 0
    assert 0.0 <= record["eval/arith/accuracy/mean"] <= 1.0
    assert "eval/arith/accuracy/best@2" in record
    assert out["requests"] == 4 and out["version"] == 0  # one request per eval row
    assert out["raw"] == []  # evaluation never reaches exp.raw
    assert out["kv"]["status"] == "finished"
    assert not any(k.startswith(("trainer.", "taskset.")) for k in out["kv"])
    published = [json.loads(m.data) for m in out["metrics"]]
    assert any(m["values"].get("eval/arith/tasks") == 4 for m in published)


def test_bench_mode_evaluates_each_checkpoint(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    """The embedded engine loads global_step_1 (the same weights) and global_step_2 (all
    zeros): greedy decoding, one task at a time, so step 1 repeats step 0 exactly."""
    ckpts = tmp_path / "run" / "checkpoints"
    _checkpoint(tiny_model_path, ckpts / "global_step_1")
    _checkpoint(tiny_model_path, ckpts / "global_step_2", torch.zeros_like)
    (ckpts / "global_step_3.tmp").mkdir()  # an unfinished save is not a checkpoint
    (ckpts / "weights").mkdir()
    data = _eval_config(tmp_path, tiny_model_path, explorer={"runner_num": 1})
    run = prepare_run(config_from_dict(data))
    seen: list[dict[str, Any]] = []

    async def main() -> None:
        with anyio.fail_after(240):
            await run_actors(run, nats_url, on_eval=seen.append)

    anyio.run(main, backend="asyncio")
    records = _evals(tmp_path / "run")
    assert records == seen
    assert [r["step"] for r in records] == [0, 1, 2]
    assert [r["eval/model_version"] for r in records] == [0, 1, 2]
    assert [r["checkpoint"] for r in records] == [
        None,
        str(ckpts / "global_step_1"),
        str(ckpts / "global_step_2"),
    ]
    base, same, zeros = records
    for key in ("eval/arith/reward/mean", "eval/arith/response_length/mean"):
        assert same[key] == base[key], key
    # all-zero weights: every logit equal, so no answer, and every reply runs to max_tokens
    assert zeros["eval/arith/accuracy/mean"] == 0.0
    assert zeros["eval/arith/response_length/mean"] == 6.0
    assert base["eval/arith/response_length/mean"] < 6.0  # the trained model stops early

    # bench_on_latest_checkpoint: only the newest one
    (tmp_path / "run" / "eval.jsonl").unlink()
    data["name"] = "m_bench2"
    data["explorer"]["bench_on_latest_checkpoint"] = True
    run = prepare_run(config_from_dict(data))
    anyio.run(main, backend="asyncio")
    assert [r["step"] for r in _evals(tmp_path / "run")] == [2]


def test_a_cancelled_bench_releases_its_step_so_a_later_explorer_evaluates_it(
    tmp_path: Path, tiny_model_path: str, nats_url: str
) -> None:
    from rftstream.actors.explorer import Explorer
    from rftstream.bus.client import Bus
    from rftstream.runtime import provision
    from workflows import WORKFLOWS, MathWorkflow

    started = anyio.Event()
    gate = {"closed": True}

    @WORKFLOWS.register_module("gated_eval")
    class GatedEval(MathWorkflow):
        async def run_async(self):  # type: ignore[no-untyped-def]
            while gate["closed"]:
                started.set()
                await anyio.sleep(0.05)
            return await super().run_async()

    data = _eval_config(tmp_path, tiny_model_path)
    data["buffer"]["explorer_input"]["eval_tasksets"][0]["default_workflow_type"] = "gated_eval"
    run = prepare_run(config_from_dict(data))

    async def main() -> tuple[Any, dict[str, Any]]:
        await provision(run, nats_url)
        async with await Bus.connect(nats_url, run.names, run.cfg.nats, "explorer") as bus:
            with anyio.fail_after(240):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(
                        Explorer(run.cfg, bus, resolved=run.resolved, model_path=run.model_path).run
                    )
                    await started.wait()  # step 0 is claimed and under way
                    tg.cancel_scope.cancel()
                released = await read_kv(nats_url, run.names.kv_bucket)
                gate["closed"] = False
                await Explorer(
                    run.cfg, bus, resolved=run.resolved, model_path=run.model_path, name="later"
                ).run()
        return released, await read_kv(nats_url, run.names.kv_bucket)

    released, after = anyio.run(main, backend="asyncio")
    assert "bench.step.0" not in released  # the cancelled bench let go of it
    assert after["bench.step.0"]["by"] == "later"
    (record,) = _evals(tmp_path / "run")
    assert record["step"] == 0 and record["explorer"] == "later" and record["bench"] is True
    assert record["eval/arith/tasks"] == 4
