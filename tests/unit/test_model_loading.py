"""pad_token_id_from_files: the trainer's pad id from the tokenizer's files, as AutoTokenizer
gives it, or None where the files do not settle it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from rftstream.model_loading import pad_token_id_from_files


def _trainer_pad(path: str) -> int:
    """What the trainer pads with when it loads the tokenizer: its pad id, else its eos id."""
    tok = AutoTokenizer.from_pretrained(path)
    return int(tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0))


def _copy(tiny_model_path: str, tmp_path: Path, **config: Any) -> Path:
    """The tiny model's tokenizer files with ``config`` merged into tokenizer_config.json
    (a value None removes the key)."""
    out = tmp_path / "tok"
    out.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(tiny_model_path) / name).exists():
            shutil.copy(Path(tiny_model_path) / name, out / name)
    data = json.loads((out / "tokenizer_config.json").read_text())
    for key, value in config.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    (out / "tokenizer_config.json").write_text(json.dumps(data))
    return out


def test_the_tiny_tokenizer(tiny_model_path: str) -> None:
    got = pad_token_id_from_files(tiny_model_path)
    assert got is not None and got == _trainer_pad(tiny_model_path)


@pytest.mark.parametrize(
    "config",
    [
        {"pad_token": "<|im_end|>"},  # another added token
        {"pad_token": "a"},  # a plain vocabulary token
    ],
)
def test_a_named_pad_token_gives_autotokenizers_id(
    tiny_model_path: str, tmp_path: Path, config: dict[str, Any]
) -> None:
    path = _copy(tiny_model_path, tmp_path, **config)
    got = pad_token_id_from_files(str(path))
    assert got is not None and got == _trainer_pad(str(path))


def test_a_pad_token_written_as_an_added_token(tiny_model_path: str, tmp_path: Path) -> None:
    """The older file format's ``{"__type": "AddedToken", "content": ...}`` (transformers 5
    reads only the plain string; the id is the token's all the same)."""
    path = _copy(tiny_model_path, tmp_path)
    data = json.loads((path / "tokenizer_config.json").read_text())
    data["pad_token"] = {"__type": "AddedToken", "content": "<|im_start|>", "special": True}
    (path / "tokenizer_config.json").write_text(json.dumps(data))
    want = AutoTokenizer.from_pretrained(tiny_model_path).convert_tokens_to_ids("<|im_start|>")
    assert pad_token_id_from_files(str(path)) == want


def test_without_a_pad_token_the_eos_token(tiny_model_path: str, tmp_path: Path) -> None:
    data = json.loads((Path(tiny_model_path) / "tokenizer_config.json").read_text())
    path = _copy(tiny_model_path, tmp_path)
    data["pad_token"] = None
    (path / "tokenizer_config.json").write_text(json.dumps(data))
    got = pad_token_id_from_files(str(path))
    assert got is not None and got == _trainer_pad(str(path))
    assert got == AutoTokenizer.from_pretrained(str(path)).eos_token_id


@pytest.mark.parametrize(
    "case", ["no pad_token key", "special_tokens_map", "unknown token", "no file"]
)
def test_what_the_files_do_not_settle_is_left_to_the_tokenizer(
    tiny_model_path: str, tmp_path: Path, case: str
) -> None:
    path = _copy(tiny_model_path, tmp_path)
    if case == "no pad_token key":
        path = _copy(tiny_model_path, tmp_path / "x", pad_token=None)
    elif case == "special_tokens_map":
        (path / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<|im_end|>"}))
    elif case == "unknown token":
        path = _copy(tiny_model_path, tmp_path / "y", pad_token="<|not a token|>")
    else:
        (path / "tokenizer_config.json").unlink()
    assert pad_token_id_from_files(str(path)) is None
