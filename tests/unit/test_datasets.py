"""Trainer datasets (SFT / DPO / MIX expert data): tokenising rows and serving them.

Expected token ids are built here from the tiny tokenizer's character-level
vocabulary and its chat template, never from the code under test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rftstream.config.schema import FormatConfig, StorageConfig
from rftstream.errors import ConfigError
from rftstream.experience import EID, Experience
from rftstream.tiny_model import build_tokenizer
from rftstream.training.datasets import DatasetSource, load_dataset_experiences, read_rows

KP = "buffer.trainer_input.experience_buffer"


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer()


def ids(tok: Any, text: str) -> list[int]:
    """Token ids of ``text``: one per character (the tiny tokenizer is character-level)."""
    out: list[int] = []
    for ch in text:
        one = tok(ch, add_special_tokens=False)["input_ids"]
        assert len(one) == 1, ch
        out.extend(one)
    return out


def chat_prompt(messages: list[dict[str, str]]) -> str:
    """The tiny model's (Qwen-like) chat template with the generation prompt, by hand."""
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return body + "<|im_start|>assistant\n"


def prompt_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    """Special tokens are single ids; everything else one id per character."""
    text = chat_prompt(messages)
    out: list[int] = []
    i = 0
    specials = ("<|im_start|>", "<|im_end|>")
    while i < len(text):
        for sp in specials:
            if text.startswith(sp, i):
                out.append(tok.convert_tokens_to_ids(sp))
                i += len(sp)
                break
        else:
            out.extend(ids(tok, text[i]))
            i += 1
    return out


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def storage(path: Path, **fmt: Any) -> StorageConfig:
    return StorageConfig(path=str(path), format=FormatConfig(**fmt))


def split(exp: Experience) -> tuple[list[int], list[int]]:
    t = exp.tokens.tolist()
    return t[: exp.prompt_length], t[exp.prompt_length :]


def user(c: str) -> dict[str, str]:
    return {"role": "user", "content": c}


def assistant(c: str) -> dict[str, str]:
    return {"role": "assistant", "content": c}


# ----------------------------------------------------------------------- tokenizer sanity


def test_hand_built_prompt_matches_the_tokenizer_chat_template(tok: Any) -> None:
    msgs = [user("1+2=")]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == chat_prompt(msgs)
    assert tok(text, add_special_tokens=False)["input_ids"] == prompt_ids(tok, msgs)
    assert tok.eos_token == "<|im_end|>"


# ----------------------------------------------------------------------- sft


def test_sft_messages_last_assistant_is_the_response(tmp_path: Path, tok: Any) -> None:
    rows = [
        {"messages": [user("1+2="), assistant("3")]},
        {"messages": [user("hi"), assistant("yo"), user("9+9="), assistant("18")]},
    ]
    exps = load_dataset_experiences(
        storage(write_jsonl(tmp_path / "d.jsonl", rows)), tok, schema="sft", key_path=KP
    )
    assert len(exps) == 2
    eos = tok.eos_token_id
    for exp, row in zip(exps, rows, strict=True):
        context, reply = row["messages"][:-1], row["messages"][-1]["content"]
        p, r = split(exp)
        text = tok.apply_chat_template(context, add_generation_prompt=True, tokenize=False)
        assert p == tok(text, add_special_tokens=False)["input_ids"]
        assert p == prompt_ids(tok, context)
        assert r == ids(tok, reply) + [eos]
        assert exp.prompt_length == len(p)
        assert exp.reward == 0.0
        assert "dpo" not in exp.info
    # the multi-turn context keeps the earlier assistant turn inside the prompt
    assert prompt_ids(tok, [user("hi"), assistant("yo"), user("9+9=")]) == split(exps[1])[0]
    assert [e.eid.task for e in exps] == [0, 1]


def test_sft_messages_key_from_format(tmp_path: Path, tok: Any) -> None:
    rows = [{"conv": [user("a"), assistant("b")]}]
    exps = load_dataset_experiences(
        storage(write_jsonl(tmp_path / "d.jsonl", rows), messages_key="conv"),
        tok,
        schema="sft",
        key_path=KP,
    )
    assert split(exps[0]) == (prompt_ids(tok, [user("a")]), ids(tok, "b") + [tok.eos_token_id])


def test_sft_plaintext_prompt_and_response_keys(tmp_path: Path, tok: Any) -> None:
    rows = [{"q": "2+2=", "a": "4"}, {"q": "what?", "a": "that"}]
    exps = load_dataset_experiences(
        storage(write_jsonl(tmp_path / "d.jsonl", rows), prompt_key="q", response_key="a"),
        tok,
        schema="sft",
        key_path=KP,
    )
    for exp, row in zip(exps, rows, strict=True):
        assert split(exp) == (
            prompt_ids(tok, [user(row["q"])]),
            ids(tok, row["a"]) + [tok.eos_token_id],
        )


def test_sft_plaintext_default_keys(tmp_path: Path, tok: Any) -> None:
    rows = [{"question": "x", "answer": "y"}]
    (exp,) = load_dataset_experiences(
        storage(write_jsonl(tmp_path / "d.jsonl", rows)), tok, schema="sft", key_path=KP
    )
    assert split(exp) == (prompt_ids(tok, [user("x")]), ids(tok, "y") + [tok.eos_token_id])


def test_system_prompt_is_inserted_unless_the_chat_has_one(tmp_path: Path, tok: Any) -> None:
    sys_msg = {"role": "system", "content": "be brief"}
    own = {"role": "system", "content": "mine"}
    rows = [
        {"messages": [user("q1"), assistant("r1")]},
        {"messages": [own, user("q2"), assistant("r2")]},
        {"question": "q3", "answer": "r3"},
    ]
    exps = load_dataset_experiences(
        storage(write_jsonl(tmp_path / "d.jsonl", rows), system_prompt="be brief"),
        tok,
        schema="sft",
        key_path=KP,
    )
    assert split(exps[0])[0] == prompt_ids(tok, [sys_msg, user("q1")])
    assert split(exps[1])[0] == prompt_ids(tok, [own, user("q2")])
    assert split(exps[2])[0] == prompt_ids(tok, [sys_msg, user("q3")])


def test_max_prompt_keeps_the_last_tokens_and_max_response_cuts(tmp_path: Path, tok: Any) -> None:
    rows = [{"messages": [user("a long question"), assistant("a long answer")]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    full_p = prompt_ids(tok, [user("a long question")])
    full_r = ids(tok, "a long answer") + [tok.eos_token_id]
    (exp,) = load_dataset_experiences(
        storage(path), tok, schema="sft", key_path=KP, max_prompt=7, max_response=5
    )
    p, r = split(exp)
    assert p == full_p[-7:]
    assert r == full_r[:5]
    assert exp.prompt_length == 7
    # limits larger than the row change nothing
    (exp2,) = load_dataset_experiences(
        storage(path), tok, schema="sft", key_path=KP, max_prompt=10_000, max_response=10_000
    )
    assert split(exp2) == (full_p, full_r)


# ----------------------------------------------------------------------- dpo


def test_dpo_string_rows_give_chosen_then_rejected_pairs(tmp_path: Path, tok: Any) -> None:
    rows = [
        {"question": "1+1=", "chosen": "2", "rejected": "3"},
        {"question": "say hi", "chosen": "hi", "rejected": "no"},
    ]
    exps = load_dataset_experiences(
        storage(write_jsonl(tmp_path / "d.jsonl", rows)), tok, schema="dpo", key_path=KP
    )
    assert len(exps) == 4
    eos = tok.eos_token_id
    for j, row in enumerate(rows):
        chosen, rejected = exps[2 * j], exps[2 * j + 1]
        want_p = prompt_ids(tok, [user(row["question"])])
        assert split(chosen) == (want_p, ids(tok, row["chosen"]) + [eos])
        assert split(rejected) == (want_p, ids(tok, row["rejected"]) + [eos])
        assert chosen.info == {"dpo": "chosen"}
        assert rejected.info == {"dpo": "rejected"}
        assert chosen.eid.task == rejected.eid.task == j


def test_dpo_chat_lists_without_prompt_key(tmp_path: Path, tok: Any) -> None:
    context = [user("pick one")]
    rows = [
        {
            "chosen": [*context, assistant("good")],
            "rejected": [*context, assistant("bad")],
        }
    ]
    exps = load_dataset_experiences(
        storage(write_jsonl(tmp_path / "d.jsonl", rows)), tok, schema="dpo", key_path=KP
    )
    assert [e.info["dpo"] for e in exps] == ["chosen", "rejected"]
    want_p = prompt_ids(tok, context)
    assert split(exps[0]) == (want_p, ids(tok, "good") + [tok.eos_token_id])
    assert split(exps[1]) == (want_p, ids(tok, "bad") + [tok.eos_token_id])


def test_dpo_chat_prompt_with_string_replies_and_custom_keys(tmp_path: Path, tok: Any) -> None:
    rows = [{"p": [user("u")], "yes": "A", "no": "B"}]
    exps = load_dataset_experiences(
        storage(
            write_jsonl(tmp_path / "d.jsonl", rows),
            prompt_key="p",
            chosen_key="yes",
            rejected_key="no",
        ),
        tok,
        schema="dpo",
        key_path=KP,
    )
    want_p = prompt_ids(tok, [user("u")])
    assert split(exps[0]) == (want_p, ids(tok, "A") + [tok.eos_token_id])
    assert split(exps[1]) == (want_p, ids(tok, "B") + [tok.eos_token_id])


# ----------------------------------------------------------------------- errors


def test_unknown_schema_is_a_config_error(tmp_path: Path, tok: Any) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "b"}])
    with pytest.raises(ConfigError) as ei:
        load_dataset_experiences(storage(path), tok, schema="ppo", key_path=KP)
    assert ei.value.key_path == KP


@pytest.mark.parametrize(
    ("schema", "row", "needle"),
    [
        ("sft", {"question": "only a prompt"}, "answer"),
        ("sft", {"answer": "only a reply"}, "question"),
        ("dpo", {"question": "q", "chosen": "c"}, "rejected"),
        ("dpo", {"chosen": "c", "rejected": "r"}, "question"),
    ],
)
def test_missing_key_names_file_row_and_key(
    tmp_path: Path, tok: Any, schema: str, row: dict, needle: str
) -> None:
    good = (
        {"question": "q", "answer": "a"}
        if schema == "sft"
        else {"question": "q", "chosen": "c", "rejected": "r"}
    )
    path = write_jsonl(tmp_path / "d.jsonl", [good, good, row])
    with pytest.raises(ConfigError) as ei:
        load_dataset_experiences(storage(path), tok, schema=schema, key_path=KP)
    msg = str(ei.value)
    assert ei.value.key_path == KP
    assert str(path) in msg
    assert f"{path}:3:" in msg  # the file's line
    assert repr(needle) in msg


def test_last_message_not_assistant(tmp_path: Path, tok: Any) -> None:
    rows = [{"messages": [user("a"), assistant("b")]}, {"messages": [user("a"), user("b")]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ConfigError) as ei:
        load_dataset_experiences(storage(path), tok, schema="sft", key_path="my.key")
    msg = str(ei.value)
    assert ei.value.key_path == "my.key"
    assert f"{path}:2:" in msg
    assert "assistant" in msg


def test_messages_not_a_chat_list(tmp_path: Path, tok: Any) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": 5}])
    with pytest.raises(ConfigError) as ei:
        load_dataset_experiences(storage(path), tok, schema="sft", key_path=KP)
    assert f"{path}:1:" in str(ei.value)


def test_bad_json_line_names_file_and_line(tmp_path: Path, tok: Any) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"question": "a", "answer": "b"}) + "\n\n" + "{not json\n", encoding="utf-8"
    )
    with pytest.raises(ConfigError) as ei:
        read_rows(path, "a.b")
    assert ei.value.key_path == "a.b"
    assert f"{path}:3" in str(ei.value)  # the file line (blank line 2 counted)
    with pytest.raises(ConfigError) as ei2:
        load_dataset_experiences(storage(path), tok, schema="sft", key_path=KP)
    # file-level errors point at the storage's `path` key
    assert ei2.value.key_path == f"{KP}.path"
    assert f"{path}:3" in str(ei2.value)


@pytest.mark.parametrize("content", ["", "\n  \n\n"])
def test_empty_file(tmp_path: Path, tok: Any, content: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError) as ei:
        read_rows(path, "x.y")
    assert ei.value.key_path == "x.y"
    assert str(path) in str(ei.value) and "empty" in str(ei.value)
    with pytest.raises(ConfigError) as ei2:
        load_dataset_experiences(storage(path), tok, schema="sft", key_path=KP)
    assert ei2.value.key_path == f"{KP}.path"


def test_missing_file(tmp_path: Path, tok: Any) -> None:
    path = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigError) as ei:
        read_rows(path, "x.y")
    assert ei.value.key_path == "x.y"
    assert str(path) in str(ei.value)
    with pytest.raises(ConfigError) as ei2:
        load_dataset_experiences(storage(path), tok, schema="dpo", key_path=KP)
    assert ei2.value.key_path == f"{KP}.path"
    assert str(path) in str(ei2.value)


def test_json_list_file_works(tmp_path: Path, tok: Any) -> None:
    rows = [{"question": "a", "answer": "b"}, {"messages": [user("c"), assistant("d")]}]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(rows, indent=2), encoding="utf-8")
    assert read_rows(path, "k") == rows
    exps = load_dataset_experiences(storage(path), tok, schema="sft", key_path=KP)
    eos = tok.eos_token_id
    assert split(exps[0]) == (prompt_ids(tok, [user("a")]), ids(tok, "b") + [eos])
    assert split(exps[1]) == (prompt_ids(tok, [user("c")]), ids(tok, "d") + [eos])


def test_json_file_errors(tmp_path: Path) -> None:
    not_list = tmp_path / "a.json"
    not_list.write_text('{"question": "a"}', encoding="utf-8")
    with pytest.raises(ConfigError) as ei:
        read_rows(not_list, "k")
    assert str(not_list) in str(ei.value) and "list" in str(ei.value)
    bad_row = tmp_path / "b.json"
    bad_row.write_text('[{"question": "a"}, 3]', encoding="utf-8")
    with pytest.raises(ConfigError) as ei:
        read_rows(bad_row, "k")
    assert f"{bad_row} item 2" in str(ei.value)
    broken = tmp_path / "c.json"
    broken.write_text("[{", encoding="utf-8")
    with pytest.raises(ConfigError) as ei:
        read_rows(broken, "k")
    assert ei.value.key_path == "k" and str(broken) in str(ei.value)


def test_jsonl_row_that_is_not_an_object(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "a"}, [1, 2]])
    with pytest.raises(ConfigError) as ei:
        read_rows(path, "k")
    assert ":2:" in str(ei.value) and "list" in str(ei.value)


# ----------------------------------------------------------------------- DatasetSource


def mk(i: int, pair: str | None = None) -> Experience:
    return Experience(
        tokens=[1, 2, 3 + i],
        prompt_length=2,
        reward=0.0,
        eid=EID(batch="t", task=i),
        info={"i": i, **({"dpo": pair} if pair else {})},
    )


def tags(exps: list[Experience]) -> list[int]:
    return [e.info["i"] for e in exps]


@pytest.mark.anyio
async def test_reads_in_order_and_one_epoch_ends_short_then_empty() -> None:
    src = DatasetSource([mk(i) for i in range(5)], epochs=1)
    assert len(src) == 5
    assert tags(await src.read(2)) == [0, 1]
    assert tags(await src.read(2)) == [2, 3]
    assert tags(await src.read(2)) == [4]
    assert await src.read(2) == []
    assert await src.read(3) == []
    assert src.served == 5


@pytest.mark.anyio
async def test_several_epochs_then_end() -> None:
    src = DatasetSource([mk(i) for i in range(3)], epochs=2)
    assert tags(await src.read(2)) == [0, 1]
    assert tags(await src.read(2)) == [2, 0]  # a read spans the epoch boundary
    assert tags(await src.read(5)) == [1, 2]
    assert await src.read(1) == []


@pytest.mark.anyio
async def test_epochs_none_cycles_forever() -> None:
    src = DatasetSource([mk(i) for i in range(3)], epochs=None)
    got: list[int] = []
    for _ in range(20):
        got += tags(await src.read(4))
    assert got == [i % 3 for i in range(80)]
    assert src.served == 80


@pytest.mark.anyio
async def test_shuffle_is_a_deterministic_permutation_per_epoch() -> None:
    n = 20

    async def order(seed: int, shuffle: bool = True) -> list[int]:
        src = DatasetSource([mk(i) for i in range(n)], epochs=2, shuffle=shuffle, seed=seed)
        out: list[int] = []
        while batch := await src.read(3):
            out += tags(batch)
        return out

    a, b, c = await order(7), await order(7), await order(8)
    plain = await order(7, shuffle=False)
    assert a == b
    assert a != c
    assert plain == list(range(n)) * 2
    assert len(a) == 2 * n
    for epoch in (a[:n], a[n:]):
        assert sorted(epoch) == list(range(n))
        assert epoch != list(range(n))


@pytest.mark.anyio
async def test_unit_two_never_splits_a_pair() -> None:
    exps = []
    for i in range(5):
        exps += [mk(2 * i, "chosen"), mk(2 * i + 1, "rejected")]
    src = DatasetSource(exps, epochs=None, shuffle=True, seed=3, unit=2)
    sizes = [1, 2, 3, 4, 5, 7, 1]
    for n in sizes:
        got = await src.read(n)
        assert len(got) == max(2, n - n % 2)  # whole units, at least one
        for k in range(0, len(got), 2):
            c, r = got[k], got[k + 1]
            assert (c.info["dpo"], r.info["dpo"]) == ("chosen", "rejected")
            assert r.info["i"] == c.info["i"] + 1


@pytest.mark.anyio
async def test_unit_two_last_epoch_ends_on_a_pair_boundary() -> None:
    exps = [mk(i, "chosen" if i % 2 == 0 else "rejected") for i in range(6)]
    src = DatasetSource(exps, epochs=1, unit=2)
    assert tags(await src.read(4)) == [0, 1, 2, 3]
    assert tags(await src.read(4)) == [4, 5]
    assert await src.read(4) == []


def test_source_rejects_empty_and_ragged_units() -> None:
    with pytest.raises(ValueError):
        DatasetSource([])
    with pytest.raises(ValueError):
        DatasetSource([mk(i) for i in range(3)], unit=2)


@pytest.mark.anyio
async def test_reads_are_copies() -> None:
    src = DatasetSource([mk(0), mk(1)], epochs=None)
    first = await src.read(2)
    first[0].info["i"] = 99
    first[0].info["extra"] = True
    first[0].tokens[0] = 77
    first[0].reward = 5.0
    again = await src.read(2)
    assert tags(again) == [0, 1]
    assert "extra" not in again[0].info
    assert again[0].tokens.tolist() == [1, 2, 3]
    assert again[0].reward == 0.0
    assert again[0] is not first[0]


def test_blank_lines_do_not_shift_the_reported_line(tmp_path: Path, tok: Any) -> None:
    path = tmp_path / "d.jsonl"
    good = json.dumps({"messages": [user("a"), assistant("b")]})
    path.write_text("\n" + good + "\n\n" + json.dumps({"messages": [user("a")]}) + "\n")
    with pytest.raises(ConfigError) as ei:
        load_dataset_experiences(storage(str(path)), tok, schema="sft", key_path=KP)
    assert f"{path}:4:" in str(ei.value)


def test_a_template_failure_names_the_row(tmp_path: Path, tok: Any) -> None:
    rows = [
        {"messages": [user("a"), assistant("b")]},
        {"messages": [{"role": "user", "content": 5}, assistant("b")]},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ConfigError) as ei:
        load_dataset_experiences(storage(path), tok, schema="sft", key_path=KP)
    assert ei.value.key_path == KP and f"{path}:2:" in str(ei.value)


# ----------------------------------------------------------------------- cpt (plain text)


def test_cpt_rows_train_every_token_but_the_first(tmp_path: Path, tok: Any) -> None:
    path = write_jsonl(
        tmp_path / "corpus.jsonl", [{"text": "1+2=3"}, {"question": "ab", "text": "ignored"}]
    )
    a, b = load_dataset_experiences(storage(path), tok, schema="cpt", key_path=KP)
    eos = [tok.eos_token_id]
    # no chat template: the text's own characters, then eos; the first token is the context
    assert split(a) == (ids(tok, "1")[:1], ids(tok, "+2=3") + eos)
    assert split(b) == (ids(tok, "a"), ids(tok, "b") + eos)  # format.prompt_key first
    assert a.action_mask.tolist() == [True] * 5


def test_cpt_text_is_cut_at_prompt_plus_response_tokens(tmp_path: Path, tok: Any) -> None:
    path = write_jsonl(tmp_path / "corpus.jsonl", [{"text": "abcdefgh"}])
    (e,) = load_dataset_experiences(
        storage(path), tok, schema="cpt", key_path=KP, max_prompt=2, max_response=3
    )
    assert e.tokens.tolist() == ids(tok, "abcde")


def test_cpt_row_without_text_names_the_row(tmp_path: Path, tok: Any) -> None:
    path = write_jsonl(tmp_path / "corpus.jsonl", [{"text": "ok"}, {"body": "no text key"}])
    with pytest.raises(ConfigError, match=r"corpus.jsonl:2.*'text'"):
        load_dataset_experiences(storage(path), tok, schema="cpt", key_path=KP)


def _sft_rows(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [{"messages": [user(f"{i}+1="), assistant(str(i + 1))]} for i in range(start, start + n)]


def test_a_dataset_directory_is_read_as_a_taskset_directory_is(tmp_path: Path, tok: Any) -> None:
    """A folder of jsonl/parquet shards, a split picked by file name, and a ``save_to_disk``
    DatasetDict with ``subset_name``/``split`` (Trinity's SFT and DPO examples point there)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    one_file = load_dataset_experiences(
        storage(write_jsonl(tmp_path / "all.jsonl", _sft_rows(6))), tok, schema="sft", key_path=KP
    )
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "train-00000.jsonl", _sft_rows(3))
    pq.write_table(pa.Table.from_pylist(_sft_rows(3, start=3)), shards / "train-00001.parquet")
    write_jsonl(shards / "test-00000.jsonl", _sft_rows(2, start=50))
    from_shards = load_dataset_experiences(storage(shards), tok, schema="sft", key_path=KP)
    assert [e.tokens.tolist() for e in from_shards] == [e.tokens.tolist() for e in one_file]

    saved = tmp_path / "hub_copy"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(_sft_rows(6)),
            "test": datasets.Dataset.from_list(_sft_rows(1)),
        }
    ).save_to_disk(str(saved / "main"))
    cfg = StorageConfig(path=str(saved), subset_name="main", split="train")
    from_disk = load_dataset_experiences(cfg, tok, schema="sft", key_path=KP)
    assert [e.tokens.tolist() for e in from_disk] == [e.tokens.tolist() for e in one_file]
    with pytest.raises(ConfigError) as ei:
        load_dataset_experiences(
            StorageConfig(path=str(saved), subset_name="main", split="validation"),
            tok,
            schema="sft",
            key_path=KP,
        )
    assert ei.value.key_path == f"{KP}.split" and "has no split 'validation'" in str(ei.value)


def test_a_bad_row_in_a_shard_names_the_file_and_row(tmp_path: Path, tok: Any) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = tmp_path / "d"
    shards.mkdir()
    pq.write_table(pa.Table.from_pylist([{"text": "x"}, {"text": "y"}]), shards / "train.parquet")
    with pytest.raises(ConfigError) as ei:
        load_dataset_experiences(storage(shards), tok, schema="sft", key_path=KP)
    assert "train.parquet row 1" in str(ei.value)
