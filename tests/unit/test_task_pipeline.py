"""Trinity-RFT's task pipeline (data_processor.task_pipeline) with real Data-Juicer ops:
filters drop tasks, mappers rewrite the target fields, the output lands where the
explorer reads its taskset, an identical second run reuses it, a foreign directory is
not overwritten, and what cannot run here is refused naming its key."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

import operators  # noqa: F401 - registers the data_juicer operator the pipeline runs
from rftstream.config import config_from_dict
from rftstream.default_run import DEFAULT_CONFIG
from rftstream.errors import ConfigError
from rftstream.task_pipeline import OUTPUT_FILE, run_task_pipeline
from rftstream.tasksets import load_taskset

ROWS = [
    {"question": "1+1=", "answer": "2", "id": 1},
    {"question": "What is three plus four?", "answer": "7", "id": 2},
    {"question": "What is five plus six?", "answer": "11", "id": 3},
]


def _config(tmp_path: Path, **pipeline: Any) -> Any:
    (tmp_path / "raw.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    data = copy.deepcopy(DEFAULT_CONFIG)
    data["buffer"]["explorer_input"]["taskset"]["path"] = str(tmp_path / "out")
    data["buffer"]["explorer_input"]["taskset"]["format"] = {
        "prompt_key": "question",
        "response_key": "answer",
    }
    spec = {
        "inputs": [str(tmp_path / "raw.jsonl")],
        "target_fields": ["question", "answer"],
        "operators": [
            {"name": "text_length_filter", "args": {"min_len": 10}},
            {
                "name": "remove_specific_chars_mapper",
                "args": {"chars_to_remove": "?", "text_key": "question"},
            },
        ],
        **pipeline,
    }
    data["data_processor"] = {"task_pipeline": spec}
    return config_from_dict(data)


def test_the_ops_run_over_the_raw_tasks_into_the_taskset(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    result = run_task_pipeline(cfg)
    assert result is not None and not result.reused
    assert (result.rows_in, result.rows_out) == (3, 2)
    assert result.metrics["text_length_filter/filtered_count"] == 1
    written = [json.loads(line) for line in (tmp_path / "out" / OUTPUT_FILE).open()]
    assert written == [
        {"question": "What is three plus four", "answer": "7"},
        {"question": "What is five plus six", "answer": "11"},
    ]
    # the explorer's taskset reads the directory (the pipeline's record is not a task)
    assert load_taskset(cfg.buffer.explorer_input.taskset) == written
    again = run_task_pipeline(cfg)
    assert again is not None and again.reused and again.rows_out == 2


def test_an_existing_output_that_is_not_the_pipelines_is_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.jsonl").write_text('{"question": "keep me"}\n')
    with pytest.raises(ConfigError) as info:
        run_task_pipeline(_config(tmp_path))
    assert info.value.key_path == "buffer.explorer_input.taskset.path"
    assert "not overwritten" in str(info.value)
    assert (tmp_path / "out" / "mine.jsonl").read_text() == '{"question": "keep me"}\n'


def test_a_changed_input_is_not_mistaken_for_the_earlier_output(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    run_task_pipeline(cfg)
    (tmp_path / "raw.jsonl").write_text(json.dumps(ROWS[1]) + "\n")
    with pytest.raises(ConfigError, match="not this task pipeline's output"):
        run_task_pipeline(cfg)


@pytest.mark.parametrize(
    ("pipeline", "key"),
    [
        ({"top_k": 10}, "data_processor.task_pipeline.top_k"),
        (
            {"priority_weights": {"difficulty": 1.0}},
            "data_processor.task_pipeline.priority_weights",
        ),
        ({"inputs": []}, "data_processor.task_pipeline.inputs"),
        ({"inputs": ["/nope/raw.jsonl"]}, "data_processor.task_pipeline.inputs[0]"),
        ({"target_fields": ["problem"]}, "data_processor.task_pipeline.target_fields"),
        ({"operators": []}, "data_processor.task_pipeline.operators"),
    ],
)
def test_what_cannot_run_is_refused_naming_its_key(
    tmp_path: Path, pipeline: dict[str, Any], key: str
) -> None:
    with pytest.raises(ConfigError) as info:
        run_task_pipeline(_config(tmp_path, **pipeline))
    assert info.value.key_path == key
    assert f"`{key}.path`" not in str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [("raw.txt", "x\n", "expected a"), ("bad.jsonl", "{not json\n", "invalid JSON")],
)
def test_an_input_that_cannot_be_read_is_named_by_its_item(
    tmp_path: Path, name: str, text: str, says: str
) -> None:
    """An item of ``inputs`` is the path itself: an error names ``inputs[i]``, not a
    ``inputs[i].path`` that no config has."""
    bad = tmp_path / "inputs" / name
    bad.parent.mkdir()
    bad.write_text(text)
    with pytest.raises(ConfigError, match=says) as info:
        run_task_pipeline(_config(tmp_path, inputs=[str(bad)]))
    assert info.value.key_path == "data_processor.task_pipeline.inputs[0]"
    assert ".path`" not in str(info.value)


def test_an_unknown_op_fails_before_anything_is_written(tmp_path: Path) -> None:
    from rftstream.errors import RftError

    with pytest.raises(RftError, match="text_lenght_filter"):
        run_task_pipeline(_config(tmp_path, operators=[{"name": "text_lenght_filter", "args": {}}]))
    assert not (tmp_path / "out").exists()
