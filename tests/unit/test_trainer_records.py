"""The JSON-lines helpers the trainer (metrics.jsonl) and the explorer's evaluation
(eval.jsonl) share."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rftstream.actors.common import append_line, nan_to_none


def test_nan_to_none_replaces_only_non_finite_floats() -> None:
    record = {
        "step": 3,
        "loss": 0.5,
        "nan": float("nan"),
        "inf": float("inf"),
        "-inf": -float("inf"),
        "name": "x",
        "none": None,
    }
    out = nan_to_none(record)
    assert out == {
        "step": 3,
        "loss": 0.5,
        "nan": None,
        "inf": None,
        "-inf": None,
        "name": "x",
        "none": None,
    }
    assert math.isnan(record["nan"])  # the input is left as it was
    assert json.loads(json.dumps(out, allow_nan=False)) == out


def test_append_line_creates_the_directory_and_appends(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "eval.jsonl"
    append_line(path, '{"step": 1}')
    append_line(path, '{"step": 2}')
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
