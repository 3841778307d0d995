"""The published JSON Schema of the experience message (``rftstream schema``) is the one the
msgspec structs give, every field described, and real encoded bodies validate against it."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import msgspec
import pytest

from rftstream import wire_schema
from rftstream.experience import EID, Experience, ExperienceRecord, encode_group
from rftstream.wire_schema import experience_schema, json_view, published_schema, schema_text


def test_the_published_file_is_what_the_structs_give() -> None:
    assert published_schema() == schema_text(), (
        "rftstream/schemas/rft.experience.v1.json is stale: regenerate it with "
        "python -c 'from rftstream.wire_schema import schema_text; "
        'open("rftstream/schemas/rft.experience.v1.json", "w").write(schema_text())\''
    )


def test_every_field_has_a_description_and_arrays_their_dtype() -> None:
    record = experience_schema()["$defs"]["ExperienceRecord"]["properties"]
    assert set(record) == set(ExperienceRecord.__struct_fields__)
    for name, prop in record.items():
        assert prop.get("description"), name
    tokens = record["tokens"]
    assert (tokens["x-msgpack"], tokens["x-dtype"], tokens["x-length"]) == (
        "bin",
        "<i4",
        "len(tokens)",
    )
    logprobs = record["logprobs"]["anyOf"][0]
    assert (logprobs["x-dtype"], logprobs["x-length"]) == ("<f4", "len(tokens) - prompt_length")
    assert record["action_mask"]["anyOf"][0]["x-dtype"] == "u1"
    assert "Rft-Count" in experience_schema()["x-headers"]


def test_a_field_without_a_description_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fields = dict(wire_schema._FIELDS)
    del fields["model_version"]
    monkeypatch.setattr(wire_schema, "_FIELDS", fields)
    with pytest.raises(KeyError, match="model_version"):
        experience_schema()


def test_an_encoded_group_validates_and_a_wrong_one_does_not() -> None:
    exps = [
        Experience(
            tokens=[1, 2, 3, 4],
            prompt_length=2,
            logprobs=[-0.5, -1.0],
            reward=1.0,
            advantages=[0.5, 0.5],
            eid=EID(batch=0, task=3, run=i),
        )
        for i in range(2)
    ]
    body = msgspec.msgpack.decode(encode_group(exps, producer="explorer"))
    validator = jsonschema.Draft202012Validator(experience_schema())
    validator.validate(json_view(body))
    body["schema"] = "rft.experience.v2"
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(json_view(body))


def test_rftstream_schema_prints_it() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rftstream.cli", "schema"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["title"] == "rft.experience.v1"
