"""Datasets the trainer reads directly: SFT / DPO data and MIX's expert data.

A :class:`~rftstream.config.schema.StorageConfig` names a local jsonl (or json
list) file, another data file (parquet, csv, arrow) or a dataset directory (shards,
a ``save_to_disk`` copy; ``split`` and ``subset_name`` pick within it, as for a
taskset). :func:`load_dataset_experiences` tokenises every row into
:class:`Experience` objects:

* ``sft`` schema: a chat list (``format.messages_key``, default ``messages``;
  the last message must be the assistant's reply, which becomes the response)
  or a plaintext ``prompt_key`` / ``response_key`` pair;
* ``cpt`` rows: plain text under ``prompt_key`` (else ``text``), trained on every token;
* ``dpo`` schema: ``prompt_key`` (a string or a chat list) with ``chosen_key``
  and ``rejected_key`` (strings, or chat lists whose last message is the
  reply); each row gives two experiences, chosen then rejected, which the
  trainer keeps adjacent (``info["dpo"] = "chosen" | "rejected"``).

Prompts are rendered with the tokenizer's chat template (``format.chat_template``
overrides it) and ``add_generation_prompt``; the response ends with the eos
token. :class:`DatasetSource` serves them to a sample strategy through the
``ExperienceSource`` interface. Loading blocks (file I/O, tokenising); reading
never blocks.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from rftstream.config.schema import FormatConfig, StorageConfig
from rftstream.errors import ConfigError
from rftstream.experience import EID, Experience


def read_rows(path: str | Path, key_path: str) -> list[dict[str, Any]]:
    """The rows of a jsonl file (or a json list). Errors name ``key_path``, the file and the line."""
    return [row for _where, row in read_numbered_rows(path, key_path)]


def dataset_rows(storage: StorageConfig, key_path: str) -> list[tuple[str, dict[str, Any]]]:
    """``(where, row)`` of every row of the dataset ``storage`` names: a jsonl/json file
    (``where`` names its line or item), or any other data file or a dataset directory,
    found and read as a taskset's (:func:`rftstream.tasksets.taskset_files`: shards,
    ``save_to_disk`` copies, ``split``, ``subset_name``; ``where`` names the file and
    row). Errors name ``key_path``. Blocks (file I/O)."""
    from rftstream.tasksets import read_data_file, taskset_files

    p = Path(storage.path).expanduser()
    if p.is_file() and p.suffix in (".jsonl", ".json") and not storage.subset_name:
        return read_numbered_rows(p, f"{key_path}.path")
    numbered = [
        (f"{f} row {i + 1}", row)
        for f in taskset_files(storage, key_path)
        for i, row in enumerate(read_data_file(f, key_path))
    ]
    return _objects(numbered, p, f"{key_path}.path", value=storage.path)


def _objects(
    numbered: list[tuple[str, Any]], source: Path, key_path: str, *, value: str | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """``numbered`` when it is not empty and every row is an object; a
    :class:`ConfigError` at ``key_path`` naming the row (or ``source``, and ``value``)
    otherwise."""
    for where, row in numbered:
        if not isinstance(row, dict):
            raise ConfigError(key_path, f"{where}: a {type(row).__name__}, not an object")
    if not numbered:
        raise ConfigError(key_path, f"{source}: the dataset is empty", value=value)
    return numbered


def read_numbered_rows(path: str | Path, key_path: str) -> list[tuple[str, dict[str, Any]]]:
    """``(where, row)`` pairs: ``where`` is ``"<file> line N"`` (jsonl) or ``"<file> item N"`` (json)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(key_path, f"no such dataset file {str(p)!r}", value=str(path))
    text = p.read_text(encoding="utf-8")
    numbered: list[tuple[str, Any]] = []
    if p.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(key_path, f"{p}: not valid JSON: {exc}") from exc
        if not isinstance(rows, list):
            raise ConfigError(key_path, f"{p}: expected a JSON list of objects")
        numbered = [(f"{p} item {i + 1}", row) for i, row in enumerate(rows)]
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                numbered.append((f"{p}:{lineno}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ConfigError(key_path, f"{p}:{lineno}: not valid JSON: {exc}") from exc
    return _objects(numbered, p, key_path)


class _Renderer:
    """Tokenises prompts and replies with one tokenizer and format."""

    def __init__(
        self, tokenizer: Any, fmt: FormatConfig, max_prompt: int | None, max_response: int | None
    ) -> None:
        self.tok = tokenizer
        self.fmt = fmt
        self.max_prompt = max_prompt
        self.max_response = max_response
        eos = tokenizer.eos_token_id
        self.eos = [int(eos)] if eos is not None else []

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        if self.fmt.system_prompt and not (messages and messages[0].get("role") == "system"):
            messages = [{"role": "system", "content": self.fmt.system_prompt}, *messages]
        kwargs: dict[str, Any] = {"add_generation_prompt": True, "tokenize": False}
        if self.fmt.chat_template:
            kwargs["chat_template"] = self.fmt.chat_template
        text = self.tok.apply_chat_template(messages, **kwargs)
        ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
        if self.max_prompt is not None and len(ids) > self.max_prompt:
            ids = ids[-self.max_prompt :]
        return ids

    def reply_ids(self, text: str) -> list[int]:
        ids = list(self.tok(text, add_special_tokens=False)["input_ids"]) + self.eos
        if self.max_response is not None:
            ids = ids[: self.max_response]
        return ids

    def text_experience(self, text: str, eid: EID) -> Experience:
        """Plain text for continued pre-training: every token but the first is trained on
        (the first has nothing to be predicted from), at most max_prompt + max_response
        tokens, EOS appended."""
        ids = list(self.tok(text, add_special_tokens=False)["input_ids"]) + self.eos
        limit = (self.max_prompt or 0) + (self.max_response or 0)
        if limit > 0:
            ids = ids[:limit]
        if len(ids) < 2:
            raise ValueError("the text has fewer than 2 tokens: nothing to predict")
        return self.experience(ids[:1], ids[1:], eid, {})

    def experience(
        self, prompt: list[int], reply: list[int], eid: EID, info: dict[str, Any]
    ) -> Experience:
        return Experience(
            tokens=prompt + reply,
            prompt_length=len(prompt),
            reward=0.0,
            eid=eid,
            info=info,
            prompt_text=None,
            response_text=None,
        )


def _plain_text(row: dict[str, Any], fmt: FormatConfig) -> str:
    """A continued-pre-training row's text: ``format.prompt_key`` when the row has it, else
    ``text`` (the usual name of a corpus column)."""
    for key in (fmt.prompt_key, "text"):
        value = row.get(key)
        if isinstance(value, str):
            return value
    raise ValueError(f"has no text under {fmt.prompt_key!r} or 'text' (format.prompt_key)")


def _as_messages(value: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
        return list(value)
    raise ValueError(
        f"{where} must be a string or a list of chat messages, got {type(value).__name__}"
    )


def _split_reply(messages: list[dict[str, Any]], where: str) -> tuple[list[dict[str, Any]], str]:
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError(f"{where}: the last message must be the assistant's reply")
    return messages[:-1], str(messages[-1].get("content") or "")


def _reply_text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return _split_reply(_as_messages(value, where), where)[1]
    if isinstance(value, dict) and "content" in value:
        return str(value["content"])
    raise ValueError(f"{where} must be a string or a chat list, got {type(value).__name__}")


def load_dataset_experiences(
    storage: StorageConfig,
    tokenizer: Any,
    *,
    schema: str,
    key_path: str,
    max_prompt: int | None = None,
    max_response: int | None = None,
) -> list[Experience]:
    """Tokenise every row of ``storage.path`` into experiences (see the module docstring).

    ``schema`` is ``sft`` (one experience per row; also MIX's expert data) or
    ``dpo`` (two per row). Raises :class:`ConfigError` at ``key_path`` naming
    the file and row of the first bad row. Blocks.
    """
    if schema not in ("sft", "dpo", "cpt"):
        raise ConfigError(
            key_path, f"cannot read a dataset for schema {schema!r} (sft, dpo or cpt)"
        )
    rows = dataset_rows(storage, key_path)
    fmt = storage.format
    render = _Renderer(tokenizer, fmt, max_prompt, max_response)
    messages_key = fmt.messages_key or "messages"
    out: list[Experience] = []
    for i, (where, row) in enumerate(rows):
        try:
            if schema == "cpt":
                out.append(
                    render.text_experience(_plain_text(row, fmt), EID(batch="dataset", task=i))
                )
            elif schema == "sft":
                use_messages = fmt.prompt_type == "messages" or (
                    fmt.prompt_type in ("", None) and messages_key in row
                )
                if use_messages:
                    if messages_key not in row:
                        raise ValueError(f"has no {messages_key!r} key")
                    context, reply = _split_reply(
                        _as_messages(row[messages_key], messages_key), messages_key
                    )
                else:
                    for k in (fmt.prompt_key, fmt.response_key):
                        if k not in row:
                            raise ValueError(f"has no {k!r} key (format.prompt_key/response_key)")
                    context, reply = (
                        _as_messages(row[fmt.prompt_key], fmt.prompt_key),
                        str(row[fmt.response_key]),
                    )
                out.append(
                    render.experience(
                        render.prompt_ids(context),
                        render.reply_ids(reply),
                        EID(batch="dataset", task=i),
                        {},
                    )
                )
            else:
                for k in (fmt.chosen_key, fmt.rejected_key):
                    if k not in row:
                        raise ValueError(f"has no {k!r} key (format.chosen_key/rejected_key)")
                if fmt.prompt_key in row:
                    context = _as_messages(row[fmt.prompt_key], fmt.prompt_key)
                elif isinstance(row[fmt.chosen_key], list):
                    context = _split_reply(
                        _as_messages(row[fmt.chosen_key], fmt.chosen_key), fmt.chosen_key
                    )[0]
                else:
                    raise ValueError(f"has no {fmt.prompt_key!r} key (format.prompt_key)")
                prompt = render.prompt_ids(context)
                for run, (key, tag) in enumerate(
                    ((fmt.chosen_key, "chosen"), (fmt.rejected_key, "rejected"))
                ):
                    reply = render.reply_ids(_reply_text(row[key], key))
                    out.append(
                        render.experience(
                            prompt, reply, EID(batch="dataset", task=i, run=run), {"dpo": tag}
                        )
                    )
        except Exception as exc:  # noqa: BLE001 - template errors too: name the row
            raise ConfigError(key_path, f"{where}: {type(exc).__name__}: {exc}") from exc
    return out


class DatasetSource:
    """An ``ExperienceSource`` over a list of experiences, read in order.

    ``epochs`` passes (``None``: cycle forever, as for MIX's expert data); with
    ``shuffle`` the order is reshuffled each pass (seeded). ``unit`` keeps
    groups of that many consecutive experiences together (2 for DPO pairs):
    a read never splits one. :meth:`read` returns copies, so a strategy may
    modify what it gets; fewer than ``n`` only when the last epoch ends.
    """

    def __init__(
        self,
        exps: list[Experience],
        *,
        epochs: int | None = 1,
        shuffle: bool = False,
        seed: int = 42,
        unit: int = 1,
    ) -> None:
        if not exps:
            raise ValueError("DatasetSource: no experiences")
        if len(exps) % unit:
            raise ValueError(
                f"DatasetSource: {len(exps)} experiences do not split into units of {unit}"
            )
        self._units = [exps[i : i + unit] for i in range(0, len(exps), unit)]
        self.unit = unit
        self.epochs = epochs
        self.shuffle = shuffle
        self._rng = random.Random(seed)
        self.epoch = 0
        self._order: list[int] = []
        self._pos = 0
        self.served = 0
        self._start_epoch()

    def __len__(self) -> int:
        return len(self._units) * self.unit

    def _start_epoch(self) -> None:
        self._order = list(range(len(self._units)))
        if self.shuffle:
            self._rng.shuffle(self._order)
        self._pos = 0

    async def read(self, n: int) -> list[Experience]:
        """The next ``n`` experiences (rounded down to whole units, at least one unit)."""
        import copy

        want = max(1, n // self.unit)
        out: list[Experience] = []
        while want > 0:
            if self._pos >= len(self._order):
                self.epoch += 1
                if self.epochs is not None and self.epoch >= self.epochs:
                    break
                self._start_epoch()
            out.extend(copy.deepcopy(e) for e in self._units[self._order[self._pos]])
            self._pos += 1
            want -= 1
        self.served += len(out)
        return out
