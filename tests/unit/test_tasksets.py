"""Tasksets: every file format, HF layouts, split/subset selection, errors, and the task plan."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rftstream.config import config_from_dict
from rftstream.config.resolve import resolve_config
from rftstream.config.schema import ExplorerInput, FormatConfig, TasksetConfig
from rftstream.config.validate import eval_tasksets, training_tasksets, validate_config
from rftstream.errors import ConfigError
from rftstream.tasksets import (
    TasksetPlan,
    builtin_arithmetic_tasks,
    epoch_order,
    load_taskset,
    plan_tasks,
    taskset_files,
)
from rftstream.wire import TaskMsg, decode_json, encode_json

ROWS = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]


def _table(rows: list[dict]) -> object:
    return pa.Table.from_pylist(rows)


def _write_arrow_stream(path: Path, rows: list[dict]) -> None:
    table = _table(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def _ts(path: Path | str, **kw: object) -> TasksetConfig:
    return TasksetConfig(path=str(path), **kw)


# ---------------------------------------------------------------- single files


def test_jsonl_and_json_files(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    assert load_taskset(_ts(f)) == ROWS
    j = tmp_path / "t.json"
    j.write_text(json.dumps(ROWS))
    assert load_taskset(_ts(j)) == ROWS
    j.write_text(json.dumps({"data": ROWS}))
    assert load_taskset(_ts(j)) == ROWS
    j.write_text("\n".join(json.dumps(r) for r in ROWS))  # JSON lines under .json
    assert load_taskset(_ts(j)) == ROWS


def test_parquet_file_with_nested_columns(tmp_path: Path) -> None:
    rows = [
        {"question": "1+1=", "answer": "2", "messages": [{"role": "user", "content": "hi"}]},
        {"question": "2+2=", "answer": "4", "messages": [{"role": "user", "content": "yo"}]},
    ]
    f = tmp_path / "t.parquet"
    pq.write_table(_table(rows), f)
    assert load_taskset(_ts(f)) == rows


def test_csv_file_infers_types(tmp_path: Path) -> None:
    f = tmp_path / "t.csv"
    f.write_text('question,answer\n"1+1=",2\n"what, then?",x\n')
    assert load_taskset(_ts(f)) == [
        {"question": "1+1=", "answer": "2"},
        {"question": "what, then?", "answer": "x"},
    ]
    f.write_text("question,answer\n1+1=,2\n2+2=,4\n")
    assert load_taskset(_ts(f)) == [
        {"question": "1+1=", "answer": 2},
        {"question": "2+2=", "answer": 4},
    ]


def test_arrow_file_stream_and_file_format(tmp_path: Path) -> None:
    s = tmp_path / "s.arrow"
    _write_arrow_stream(s, ROWS)
    assert load_taskset(_ts(s)) == ROWS
    f = tmp_path / "f.arrow"
    table = _table(ROWS)
    with pa.OSFile(str(f), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    assert load_taskset(_ts(f)) == ROWS


# ---------------------------------------------------------------- HF layouts


def test_save_to_disk_dataset_reads_shards_in_state_order(tmp_path: Path) -> None:
    from datasets import Dataset

    d = tmp_path / "ds"
    Dataset.from_list(ROWS).save_to_disk(str(d), num_shards=2)
    assert load_taskset(_ts(d)) == ROWS
    # the shards state.json lists, in its order
    state = json.loads((d / "state.json").read_text())
    assert (
        [f.name for f in taskset_files(_ts(d))]
        == [f["filename"] for f in state["_data_files"]]
        == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    )
    # a shuffled dataset keeps its row order (the indices mapping is applied on save)
    shuffled = Dataset.from_list(ROWS).shuffle(seed=3)
    expected = shuffled.to_list()
    assert expected != ROWS
    shuffled.save_to_disk(str(tmp_path / "shuffled"))
    assert load_taskset(_ts(tmp_path / "shuffled")) == expected


def test_save_to_disk_dataset_dict_picks_the_split(tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    d = tmp_path / "dd"
    DatasetDict(
        {"train": Dataset.from_list(ROWS[:3]), "test": Dataset.from_list(ROWS[3:])}
    ).save_to_disk(str(d))
    assert (d / "dataset_dict.json").is_file()
    assert load_taskset(_ts(d)) == ROWS[:3]
    assert load_taskset(_ts(d, split="test")) == ROWS[3:]
    with pytest.raises(ConfigError, match=r"taskset\.split.*no split 'validation'.*'train'"):
        load_taskset(_ts(d, split="validation"))


def test_save_to_disk_nested_columns(tmp_path: Path) -> None:
    from datasets import Dataset

    rows = [
        {"question": "q1", "answer": "1", "messages": [{"role": "user", "content": "hi"}]},
        {"question": "q2", "answer": "2", "messages": [{"role": "user", "content": "yo"}]},
    ]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "nested"))
    assert load_taskset(_ts(tmp_path / "nested")) == rows


def test_directory_of_sharded_parquet_split_files(tmp_path: Path) -> None:
    d = tmp_path / "hub" / "data"
    d.mkdir(parents=True)
    pq.write_table(_table(ROWS[:2]), d / "train-00000-of-00002.parquet")
    pq.write_table(_table(ROWS[2:4]), d / "train-00001-of-00002.parquet")
    pq.write_table(_table(ROWS[4:]), d / "test-00000-of-00001.parquet")
    root = tmp_path / "hub"
    assert load_taskset(_ts(root)) == ROWS[:4]
    assert load_taskset(_ts(root, split="test")) == ROWS[4:]
    with pytest.raises(ConfigError, match=r"split 'dev'.*\['test', 'train'\]"):
        load_taskset(_ts(root, split="dev"))


def test_split_subdirectory_alias_and_mixed_formats(tmp_path: Path) -> None:
    d = tmp_path / "mixed"
    (d / "train").mkdir(parents=True)
    (d / "train" / "a.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    pq.write_table(_table(ROWS[1:3]), d / "train" / "b.parquet")
    (d / "dev.csv").write_text("question,answer\nq,a\n")
    assert load_taskset(_ts(d)) == ROWS[:3]
    # `validation` finds the `dev` file, as with Hugging Face datasets
    assert load_taskset(_ts(d, split="validation")) == [{"question": "q", "answer": "a"}]


def test_directory_without_split_names_is_one_taskset(tmp_path: Path) -> None:
    d = tmp_path / "plain"
    d.mkdir()
    (d / "part1.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    (d / "part2.json").write_text(json.dumps(ROWS[1:2]))
    (d / ".hidden.jsonl").write_text("not json\n")
    assert load_taskset(_ts(d, split="anything")) == ROWS[:2]


def test_subset_name(tmp_path: Path) -> None:
    root = tmp_path / "multi"
    for subset, rows in (("easy", ROWS[:2]), ("hard", ROWS[2:])):
        (root / subset).mkdir(parents=True)
        (root / subset / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_taskset(_ts(root, subset_name="hard")) == ROWS[2:]
    with pytest.raises(ConfigError, match=r"taskset\.subset_name.*'medium'.*\['easy', 'hard'\]"):
        load_taskset(_ts(root, subset_name="medium"))


def test_builtin(tmp_path: Path) -> None:
    assert load_taskset(TasksetConfig()) == builtin_arithmetic_tasks()
    assert len(load_taskset(_ts("builtin:arithmetic"))) == 100
    with pytest.raises(ConfigError, match="unknown built-in"):
        load_taskset(_ts("builtin:nope"))


# ---------------------------------------------------------------- errors


def test_errors_name_the_key_path_and_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok"}\n[1, 2]\n')
    key = "buffer.explorer_input.tasksets[1]"
    with pytest.raises(
        ConfigError, match=r"tasksets\[1\]\.path.*bad\.jsonl, line 2: expected a JSON object"
    ):
        load_taskset(_ts(bad), key)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match=r"eval_tasksets\[0\]\.path.*cannot read .*broken"):
        load_taskset(_ts(broken), "buffer.explorer_input.eval_tasksets[0]")
    with pytest.raises(ConfigError, match=r"no such file.*hub dataset ids are not downloaded"):
        load_taskset(_ts("openai/gsm8k"))
    txt = tmp_path / "t.txt"
    txt.write_text("x")
    with pytest.raises(ConfigError, match=r"expected a \.jsonl/"):
        load_taskset(_ts(txt))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="has no rows"):
        load_taskset(_ts(empty))
    d = tmp_path / "nodata"
    d.mkdir()
    (d / "readme.md").write_text("x")
    with pytest.raises(ConfigError, match="holds no"):
        load_taskset(_ts(d))


def test_missing_prompt_column_is_reported_with_the_columns(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"problem": "1+1=", "solution": "2"}) + "\n")
    with pytest.raises(
        ConfigError, match=r"format\.prompt_key.*'question'.*\['problem', 'solution'\]"
    ):
        load_taskset(_ts(f))
    fmt = FormatConfig(prompt_key="problem", response_key="solution")
    assert load_taskset(_ts(f, format=fmt))[0]["problem"] == "1+1="
    # a custom workflow reads what it likes
    assert load_taskset(_ts(f, default_workflow_type="my_workflow"))


# ---------------------------------------------------------------- planning


def test_shuffle_is_deterministic_and_reshuffled_per_epoch() -> None:
    a = epoch_order(50, 0, shuffle=True, seed=7)
    assert a == epoch_order(50, 0, shuffle=True, seed=7)
    assert sorted(a) == list(range(50)) and a != list(range(50))
    b = epoch_order(50, 1, shuffle=True, seed=7)
    assert sorted(b) == list(range(50)) and b != a
    assert epoch_order(50, 0, shuffle=True, seed=8) != a
    assert epoch_order(5, 3, shuffle=False, seed=7) == [0, 1, 2, 3, 4]


def test_plan_one_taskset_epochs_in_order() -> None:
    plan = plan_tasks([TasksetPlan(name="t", rows=10, epochs=3, seed=1)])
    assert [p.seq for p in plan] == list(range(30))
    assert [p.epoch for p in plan] == [0] * 10 + [1] * 10 + [2] * 10
    for e in range(3):
        assert [p.index for p in plan if p.epoch == e] == epoch_order(10, e, shuffle=True, seed=1)
    assert plan == plan_tasks([TasksetPlan(name="t", rows=10, epochs=3, seed=1)])


def test_plan_mixes_tasksets_in_proportion() -> None:
    plans = [
        TasksetPlan(name="big", rows=30, epochs=2),
        TasksetPlan(name="small", rows=10, epochs=1, shuffle=False),
    ]
    plan = plan_tasks(plans)
    assert len(plan) == 70 and [p.seq for p in plan] == list(range(70))
    assert Counter((p.taskset, p.epoch, p.index) for p in plan) == Counter(
        [("big", e, i) for e in range(2) for i in range(30)] + [("small", 0, i) for i in range(10)]
    )
    # every window of 7 tasks holds exactly one of `small` (10 of 70), in its own order
    for lo in range(0, 70, 7):
        assert sum(p.taskset == "small" for p in plan[lo : lo + 7]) == 1
    assert [p.index for p in plan if p.taskset == "small"] == list(range(10))
    # each taskset keeps its own epoch order
    big = [p for p in plan if p.taskset == "big"]
    assert [p.epoch for p in big] == [0] * 30 + [1] * 30
    assert plan == plan_tasks(plans)


# ---------------------------------------------------------------- config


def test_which_tasksets_train_and_eval() -> None:
    extra = TasksetConfig(name="extra", path="x.jsonl")
    inp = ExplorerInput(tasksets=[extra])
    assert training_tasksets(inp) == [("buffer.explorer_input.tasksets[0]", extra)]
    main = TasksetConfig(name="main", path="builtin:arithmetic")
    inp = ExplorerInput(taskset=main, tasksets=[extra])
    assert [k for k, _ in training_tasksets(inp)] == [
        "buffer.explorer_input.taskset",
        "buffer.explorer_input.tasksets[0]",
    ]
    assert training_tasksets(ExplorerInput()) == [
        ("buffer.explorer_input.taskset", TasksetConfig())
    ]
    ev = TasksetConfig(name="ev")
    assert eval_tasksets(ExplorerInput(eval_tasksets=[ev])) == [
        ("buffer.explorer_input.eval_tasksets[0]", ev)
    ]


def _cfg(explorer_input: dict, **over: object) -> object:
    cfg = config_from_dict({"buffer": {"explorer_input": explorer_input}, **over})
    validate_config(cfg)
    return resolve_config(cfg)


def test_validation_of_tasksets() -> None:
    cfg = _cfg({"eval_tasksets": [{"name": "a"}, {"name": "b", "repeat_times": 4}]})
    assert all(ts.is_eval for ts in cfg.buffer.explorer_input.eval_tasksets)
    with pytest.raises(ConfigError, match=r"eval_tasksets\[1\]\.name.*unique.*eval_tasksets\[0\]"):
        _cfg({"eval_tasksets": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(ConfigError, match=r"tasksets\[0\]\.name.*unique.*explorer_input\.taskset"):
        _cfg({"taskset": {"path": "builtin:arithmetic"}, "tasksets": [{"path": "x.jsonl"}]})
    with pytest.raises(ConfigError, match=r"taskset\.name"):
        _cfg({"taskset": {"name": "has space"}})
    with pytest.raises(ConfigError, match=r"tasksets\[0\]\.total_epochs"):
        _cfg({"tasksets": [{"name": "x", "total_epochs": 0}]})
    with pytest.raises(ConfigError, match=r"eval_tasksets\[0\]\.repeat_times"):
        _cfg({"eval_tasksets": [{"repeat_times": 0}]})
    with pytest.raises(ConfigError, match=r"taskset\.is_eval"):
        _cfg({"taskset": {"is_eval": True}})
    with pytest.raises(ConfigError, match=r"explorer\.eval_interval"):
        _cfg({}, explorer={"eval_interval": 0})
    # the eval taskset may reuse a training taskset's name: metrics are eval/<name>/...
    _cfg({"eval_tasksets": [{"name": "taskset"}]})


def test_task_message_from_before_task_id_still_decodes() -> None:
    old = msgspec.json.encode(
        {"taskset": "t", "index": 3, "epoch": 1, "seq": 9, "raw_task": {"question": "q"}}
    )
    msg = decode_json(old, TaskMsg, "task")
    assert msg.task_id is None and msg.index == 3
    new = TaskMsg(taskset="t", index=3, epoch=1, seq=9, raw_task={}, task_id="t:3")
    assert decode_json(encode_json(new), TaskMsg, "task").task_id == "t:3"
