"""benchmarks/bus.py's pure parts: sizes, run lengths, fetch batches, the verdict, and
that the raw client's hand-written codec moves exactly rftstream's bytes and arrays."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from rftstream.experience import decode_group
from tests.unit._util import load_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script(ROOT / "benchmarks" / "bus.py", "bus_bench")


def test_sizes_parse_and_label(bench: ModuleType) -> None:
    assert bench.parse_sizes("8K, 64k,256KiB,1M") == [8192, 65536, 262144, 1 << 20]
    assert bench.parse_sizes("4096") == [4096]
    for bad in ("", "512", "5M", "x"):
        with pytest.raises(ValueError):
            bench.parse_sizes(bad)
    assert [bench.size_label(s) for s in (8192, 262144, 1 << 20, 1500)] == [
        "8 KiB",
        "256 KiB",
        "1 MiB",
        "1500 B",
    ]


def test_run_length_and_fetch_batch(bench: ModuleType) -> None:
    # small messages: bounded by the message rate; large ones: by the byte rate
    assert bench.messages_per_run(8192, 1.0) == bench.GUESS_MSGS
    mib = bench.GUESS_MIB
    assert bench.messages_per_run(1 << 20, 2.0) == 2 * mib
    assert bench.messages_per_run(1 << 20, 0.01) == 40  # never below the floor
    assert bench.fetch_batch(8192, 256, 16 << 20) == 256
    assert bench.fetch_batch(1 << 20, 256, 16 << 20) == 16
    assert bench.fetch_batch(4 << 20, 256, 1 << 20) == 1


def test_verdict_needs_every_size(bench: ModuleType) -> None:
    ok = bench.Verdict({8192: 0.93, 1 << 20: 0.81}, 0.8)
    assert ok.passed and ok.worst == (1 << 20, 0.81)
    assert (
        ok.lines()[0]
        == "bus, arrays read, 8 KiB: rftstream / tuned raw = 0.93x (target >= 0.8x): PASS"
    )
    assert ok.lines()[-1] == (
        "bus, arrays read, 1 MiB (worst of 2 sizes): rftstream / tuned raw = 0.81x "
        "(target >= 0.8x at every size): PASS"
    )
    miss = bench.Verdict({8192: 1.2, 65536: 0.79}, 0.8)
    assert not miss.passed
    assert miss.lines()[1].endswith("0.79x (target >= 0.8x): MISS")
    assert miss.lines()[-1].startswith("bus, arrays read, 64 KiB (worst of 2 sizes)")
    assert miss.lines()[-1].endswith(": MISS")


@pytest.mark.parametrize("size", [8 << 10, 256 << 10])
def test_groups_hit_their_size(bench: ModuleType, size: int) -> None:
    length = bench.tokens_for(size, 8)
    body, headers = bench.encoded(8, length)
    assert 0.97 * size <= len(body) <= size
    assert "Nats-Msg-Id" not in headers and headers["Rft-Count"] == "8"


def test_raw_codec_moves_rftstream_bytes_and_arrays(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench._quiet_torch()  # read-only bodies: torch's one warning, silenced
    group = bench.make_group(8, 300)
    body, _ = bench.encoded(8, 300)
    raw = bench.raw_encode(group, group[0].group_id, bench.ACTOR)
    assert raw == body  # the same bytes on the wire

    seen: list[torch.Tensor] = []
    real = bench._from_numpy
    monkeypatch.setattr(bench, "_from_numpy", lambda a: seen.append(real(a)) or seen[-1])
    assert bench.raw_read_arrays(body) == 8
    assert len(seen) == 4 * 8
    for k, e in enumerate(decode_group(body)):
        tokens, logprobs, advantages, mask = seen[4 * k : 4 * k + 4]
        assert torch.equal(tokens, e.tokens) and tokens.dtype == torch.int32
        assert torch.equal(logprobs, e.logprobs) and torch.equal(advantages, e.advantages)
        assert torch.equal(mask, e.action_mask) and mask.dtype == torch.bool
        assert torch.equal(e.tokens, group[k].tokens)
    assert bench.rft_read_arrays(body) == 8
