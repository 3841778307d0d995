"""The "Write your own operator" tutorial (docs/operators.md): its code is
examples/operators/equal_rewards_filter.py, shown in the page verbatim, loaded here as
``--plugin-dir`` loads it and run through the same pipeline the operator host runs."""

from __future__ import annotations

from pathlib import Path

import anyio

from operators import EXPERIENCE_OPERATORS
from rftstream.experience import EID, Experience
from rftstream.experience_pipeline import ExperiencePipeline
from rftstream.plugins.loader import load_plugins

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "examples" / "operators" / "equal_rewards_filter.py"


def _group(task: int, rewards: list[float]) -> list[Experience]:
    return [
        Experience(tokens=[1, 2, 3], prompt_length=1, reward=r, eid=EID(batch=0, task=task, run=i))
        for i, r in enumerate(rewards)
    ]


def test_the_page_shows_the_plugin_file_verbatim() -> None:
    page = (ROOT / "docs" / "operators.md").read_text()
    code = PLUGIN.read_text()
    body = code[code.index("from __future__") :]
    assert body in page


def test_the_tutorial_operator_drops_groups_of_equal_rewards() -> None:
    load_plugins([PLUGIN.parent])
    op = EXPERIENCE_OPERATORS.get("equal_rewards_filter")(tolerance=0.0)
    # one call, three tasks' groups, their experiences interleaved as a batch may hold them
    a, b, c = _group(1, [1.0, 0.0, 1.0]), _group(2, [1.0, 1.0, 1.0]), _group(3, [0.0, 0.0, 0.5])
    exps = [e for trio in zip(a, b, c, strict=True) for e in trio]
    kept, metrics = op.process(exps)
    assert {e.eid.task for e in kept} == {1, 3} and len(kept) == 6
    assert metrics == {"groups_dropped_count": 1, "groups_seen_count": 3}
    # as the operator host runs it: metrics prefixed by its name, what it dropped counted
    pipeline = ExperiencePipeline([op], names=["equal_rewards_filter"])
    out, merged = anyio.run(pipeline.process, exps)
    assert len(out) == 6
    assert merged["equal_rewards_filter/groups_dropped_count"] == 1
    assert merged["filtered/equal_rewards_filter"] == 3.0
