"""``data_juicer``: real Data-Juicer ops on experiences, expected sets computed by hand.

The first build in a process imports Data-Juicer (a few seconds); later builds are fast.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading

import pytest

from operators import EXPERIENCE_OPERATORS, ExperiencePipeline, create_operators
from operators.data_juicer import (
    INSTALL_HINT,
    DataJuicerNotInstalledError,
    DataJuicerOperator,
    _import_data_juicer,
)
from rftstream.config.schema import OperatorConfig
from rftstream.errors import ConfigError, OperatorError, RftError
from rftstream.experience import EID, Experience

pytestmark = pytest.mark.anyio

RESPONSES = [
    "ok",  # 2 chars, 1 word
    "the answer is 42",  # 16 chars, 3 words (digits are not words)
    "yes",  # 3 chars
    "one two three four five six seven",  # 33 chars, 7 words
    "%%%% $$$$ ####",  # 14 chars, no alphanumerics, no words after stripping specials
    "forty two",  # 9 chars, 2 words
]


def mk(response: str | None, run: int = 0, prompt: str | None = "What is 6 times 7?") -> Experience:
    return Experience(
        tokens=[1, 2, 3, 4],
        prompt_length=2,
        reward=1.0,
        response_text=response,
        prompt_text=prompt,
        eid=EID(task="t", run=run),
    )


def batch() -> list[Experience]:
    return [mk(r, run=i) for i, r in enumerate(RESPONSES)]


def n_words(text: str) -> int:
    """Data-Juicer's word count without tokenization: split on whitespace, strip punctuation
    and digits from each word, drop the empty ones (so "42" is not a word)."""
    return sum(any(c.isalpha() for c in w) for w in text.split())


async def run_pipeline(op, exps):
    async with ExperiencePipeline([op]) as pipe:
        return await pipe.process(exps)


# ------------------------------------------------------------------ filters


async def test_length_and_word_filters_keep_the_expected_set(anyio_backend):
    op = DataJuicerOperator(
        operators=[
            {"text_length_filter": {"min_len": 5, "max_len": 30}},
            {"words_num_filter": {"min_num": 2, "max_num": 5}},
        ]
    )
    exps = batch()
    by_len = [e for e in exps if 5 <= len(e.response_text) <= 30]
    expected = [e for e in by_len if 2 <= n_words(e.response_text) <= 5]
    kept, m = await run_pipeline(op, exps)
    assert [e.response_text for e in kept] == ["the answer is 42", "forty two"]
    assert kept == expected  # the same objects, in order
    assert m["data_juicer/text_length_filter/filtered_count"] == len(exps) - len(by_len) == 3
    assert m["data_juicer/words_num_filter/filtered_count"] == len(by_len) - len(expected) == 1
    assert m["data_juicer/filtered_count"] == m["filtered/data_juicer"] == 4
    assert m["data_juicer/kept_count"] == 2
    assert m["data_juicer/text_length_filter/time"] >= 0
    # stats: text_len over all 6 samples, num_words over the 3 that reached words_num_filter
    assert m["data_juicer/stats/text_len/mean"] == pytest.approx(
        sum(len(r) for r in RESPONSES) / len(RESPONSES)
    )
    assert m["data_juicer/stats/num_words/mean"] == pytest.approx((3 + 0 + 2) / 3)
    # the kept experiences carry their Data-Juicer stats in info, as in Trinity-RFT
    assert kept[0].info == {"text_len": 16, "num_words": 3}
    assert kept[1].info == {"text_len": 9, "num_words": 2}


async def test_alphanumeric_filter(anyio_backend):
    op = DataJuicerOperator(operators=[{"alphanumeric_filter": {"min_ratio": 0.85}}])
    exps = batch()

    def ratio(text: str) -> float:
        return sum(c.isalnum() for c in text) / len(text)

    expected = [e for e in exps if ratio(e.response_text) >= 0.85]
    kept, m = await run_pipeline(op, exps)
    assert kept == expected
    assert [e.response_text for e in kept] == ["ok", "yes", "forty two"]
    assert m["data_juicer/alphanumeric_filter/filtered_count"] == 3
    assert kept[2].info["alnum_ratio"] == pytest.approx(8 / 9)


async def test_text_key_prompt_and_prompt_response(anyio_backend):
    exps = [
        mk("a", run=0, prompt="short?"),  # prompt 6 chars
        mk("b", run=1, prompt="a much longer prompt here"),  # 25 chars
        mk("ccccccccc", run=2, prompt="medium prompt"),  # 13 chars; with response: 13+1+9
    ]
    op = DataJuicerOperator(
        operators=[{"text_length_filter": {"min_len": 10, "max_len": 20}}], text_key="prompt"
    )
    kept, _ = await run_pipeline(op, exps)
    assert kept == [exps[2]]

    op = DataJuicerOperator(
        operators=[{"text_length_filter": {"min_len": 10, "max_len": 22}}],
        text_key="prompt_response",
        separator=" | ",
    )
    lengths = [len(f"{e.prompt_text} | {e.response_text}") for e in exps]
    assert lengths == [10, 29, 25]
    kept, m = await run_pipeline(op, exps)
    assert kept == [exps[0]]
    assert kept[0].info["text_len"] == 10

    # an op may read the response column directly, whatever text_key is
    op = DataJuicerOperator(
        operators=[{"text_length_filter": {"min_len": 5, "text_key": "response_text"}}],
        text_key="prompt",
    )
    kept, _ = await run_pipeline(op, exps)
    assert kept == [exps[2]]


async def test_mapper_feeds_later_filters_but_never_rewrites_the_experience(anyio_backend):
    responses = ["   abc   ", "\t  abcdef \n", "  abcdefgh"]
    exps = [mk(r, run=i) for i, r in enumerate(responses)]
    op = DataJuicerOperator(
        operators=[
            {"whitespace_normalization_mapper": None},  # strips (and normalises) whitespace
            {"text_length_filter": {"min_len": 6}},
        ]
    )
    kept, m = await run_pipeline(op, exps)
    assert [len(r.strip()) for r in responses] == [3, 6, 8]
    assert kept == exps[1:]
    assert [e.response_text for e in kept] == responses[1:]  # untouched
    assert [e.info["text_len"] for e in kept] == [6, 8]  # measured on the mapped text
    assert m["data_juicer/whitespace_normalization_mapper/mapped_count"] == 3
    assert m["data_juicer/text_length_filter/filtered_count"] == 1


async def test_recipe_file_and_repeated_op_names(anyio_backend, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "project_name: demo\n"
        "dataset_path: /nowhere.jsonl\n"  # ignored: batches come from the pipeline
        "np: 8\n"
        "text_keys: response_text\n"
        "process:\n"
        "  - text_length_filter:\n"
        "      min_len: 3\n"
        "  - text_length_filter:\n"  # Data-Juicer's default min_len is 10: set it
        "      min_len: 1\n"
        "      max_len: 16\n"
        "  - words_num_filter:\n"
        "      min_num: 1\n"
    )
    op = DataJuicerOperator(config_path=str(recipe), text_key="prompt")
    exps = batch()
    kept, m = await run_pipeline(op, exps)  # text_keys -> every op reads response_text
    assert [e.response_text for e in kept] == ["the answer is 42", "yes", "forty two"]
    assert m["data_juicer/text_length_filter/filtered_count"] == 1  # "ok"
    assert m["data_juicer/text_length_filter#2/filtered_count"] == 1  # the 33-char one
    assert m["data_juicer/words_num_filter/filtered_count"] == 1  # "%%%% $$$$ ####": no words

    as_json = tmp_path / "recipe.json"
    as_json.write_text(json.dumps({"process": [{"text_length_filter": {"min_len": 16}}]}))
    kept, _ = DataJuicerOperator(config_path=str(as_json)).process(batch())
    assert [e.response_text for e in kept] == ["the answer is 42", RESPONSES[3]]


async def test_from_config_empty_batch_and_sync_use(anyio_backend):
    cfg = OperatorConfig(
        name="data_juicer",
        args={"operators": [{"text_length_filter": {"min_len": 3}}], "stats_to_info": False},
    )
    assert EXPERIENCE_OPERATORS.get("data_juicer") is DataJuicerOperator
    pipe = ExperiencePipeline.from_config([cfg])
    async with pipe:
        kept, m = await pipe.process([])
        assert kept == [] and m["data_juicer/filtered_count"] == 0
        assert m["data_juicer/text_length_filter/filtered_count"] == 0
        kept, m = await pipe.process(batch())
        assert len(kept) == 5 and all(e.info == {} for e in kept)
    # the synchronous Trinity-RFT interface builds on first use
    kept, m = DataJuicerOperator(operators=[{"text_length_filter": {"min_len": 3}}]).process(
        batch()
    )
    assert len(kept) == 5 and m == {
        "text_length_filter/filtered_count": 1.0,
        "text_length_filter/time": m["text_length_filter/time"],
        "stats/text_len/mean": pytest.approx(sum(map(len, RESPONSES)) / 6),
        "filtered_count": 1.0,
        "kept_count": 5.0,
    }


async def test_process_runs_in_a_worker_thread(anyio_backend):
    op = DataJuicerOperator(operators=[{"text_length_filter": {"min_len": 3}}])
    await op.prepare()
    threads = []
    inner = op._process

    def spy(exps):
        threads.append(threading.current_thread())
        return inner(exps)

    op._process = spy
    kept, _ = await run_pipeline(op, batch())
    assert len(kept) == 5
    assert threads and threads[0] is not threading.main_thread()


# ------------------------------------------------------------------ errors


def test_config_shape_errors():
    ok = [{"text_length_filter": {}}]
    with pytest.raises(ValueError, match="exactly one of"):
        DataJuicerOperator()
    with pytest.raises(ValueError, match="exactly one of"):
        DataJuicerOperator(operators=ok, config_path="x.yaml")
    with pytest.raises(ValueError, match="text_key"):
        DataJuicerOperator(operators=ok, text_key="reward")
    with pytest.raises(ValueError, match="np"):
        DataJuicerOperator(operators=ok, np=0)
    with pytest.raises(ValueError, match="one-key mapping"):
        DataJuicerOperator(operators=[{"a_filter": {}, "b_filter": {}}])
    with pytest.raises(ValueError, match="args must be a mapping"):
        DataJuicerOperator(operators=[{"text_length_filter": [1, 2]}])
    with pytest.raises(ValueError, match="no such file"):
        DataJuicerOperator(config_path="/no/such/recipe.yaml")
    with pytest.raises(ConfigError, match=r"operators\[0\]\.args.*one-key mapping"):
        create_operators([OperatorConfig(name="data_juicer", args={"operators": [{}]})])


async def test_op_errors_name_the_op(anyio_backend, tmp_path, caplog):
    async def prepare(ops):
        async with ExperiencePipeline([DataJuicerOperator(operators=ops)]):
            pass

    with pytest.raises(OperatorError, match="txt_length_filter.*did you mean 'text_length_filter'"):
        await prepare([{"txt_length_filter": {}}])
    with pytest.raises(OperatorError, match="unknown argument 'min_lenn'; did you mean 'min_len'"):
        await prepare([{"text_length_filter": {"min_lenn": 3}}])
    with pytest.raises(OperatorError, match="only Data-Juicer filters and mappers"):
        await prepare([{"document_deduplicator": {}}])
    with caplog.at_level("WARNING", logger="operators.data_juicer"):
        await prepare([{"text_length_filter": {"extra_thing": 1}}])
    assert "'extra_thing' is not a named parameter" in caplog.text

    op = DataJuicerOperator(operators=[{"text_length_filter": {"min_len": 1}}])
    with pytest.raises(OperatorError, match="has no response_text"):
        await run_pipeline(op, [mk("fine", run=0), mk(None, run=1)])
    op = DataJuicerOperator(operators=[{"text_length_filter": {}}], text_key="prompt_response")
    with pytest.raises(ValueError, match="has no prompt_text"):
        op.process([mk("fine", prompt=None)])


def test_run_time_pip_install_is_refused():
    DataJuicerOperator(operators=[{"text_length_filter": {}}])._build()
    from data_juicer.utils.lazy_loader import LazyLoader

    # what Data-Juicer's LazyLoader calls for a missing optional package (e.g. ftfy)
    with pytest.raises(ImportError, match="auto_install"):
        LazyLoader._install_package("rftstream-no-such-package-for-tests")


def test_data_juicer_logging_is_quiet_by_default():
    from loguru import logger

    _import_data_juicer(verbose=False, auto_install=False)  # its import resets loguru's sinks
    lines: list[str] = []
    sink = logger.add(lambda msg: lines.append(str(msg)), level="DEBUG")
    try:
        # cpu_required makes Data-Juicer's base op log a deprecation warning
        DataJuicerOperator(operators=[{"text_length_filter": {"cpu_required": 1}}])._build()
        assert not [x for x in lines if "cpu_required" in x]
        DataJuicerOperator(
            operators=[{"text_length_filter": {"cpu_required": 1}}], verbose=True
        )._build()
        assert [x for x in lines if "cpu_required" in x]
    finally:
        logger.remove(sink)
        logger.disable("data_juicer")


def test_missing_extra_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "data_juicer", None)  # as if not installed
    with pytest.raises(DataJuicerNotInstalledError) as info:
        DataJuicerOperator(operators=[{"text_length_filter": {}}])
    assert INSTALL_HINT == "pip install 'rftstream[data-juicer]'"
    assert INSTALL_HINT in str(info.value) and "data_juicer" in str(info.value)
    assert isinstance(info.value, ImportError) and isinstance(info.value, RftError)
    # through the config path: a ConfigError naming the operator entry
    with pytest.raises(ConfigError, match=r"operators\[0\]\.args.*rftstream\[data-juicer\]"):
        create_operators(
            [OperatorConfig(name="data_juicer", args={"operators": [{"text_length_filter": {}}]})]
        )
    # and at build time (installed when constructed, gone when imported)
    with pytest.raises(DataJuicerNotInstalledError, match=r"rftstream\[data-juicer\]"):
        _import_data_juicer(verbose=False, auto_install=False)


def test_fresh_process_lazy_import_and_quiet_logs():
    """In a fresh interpreter: ``import operators`` does not import Data-Juicer, constructing
    does not either, and building + processing prints nothing and leaves stdlib logging as it was."""
    code = """
import json, logging, sys
import operators
from rftstream.experience import Experience
assert "data_juicer" not in sys.modules
op = operators.DataJuicerOperator(operators=[{"text_length_filter": {"min_len": 3}}])
assert "data_juicer" not in sys.modules
kept, m = op.process([Experience(tokens=[1, 2], prompt_length=1, response_text=t) for t in ("ab", "abc")])
root = logging.getLogger()
print(json.dumps({"kept": len(kept), "handlers": len(root.handlers), "level": root.level}))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout) == {"kept": 1, "handlers": 0, "level": logging.WARNING}
    assert out.stderr == ""
