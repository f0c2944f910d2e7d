"""Hit rates on synthetic hashed-block traces (mpcache.sim.trace_hits): the bounds hold, the
synthetic Bailian-shaped trace is as concentrated as the paper says, and evicting a request's
tail first keeps its prefix where evicting its head first loses all of it."""
from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from mpcache.sim.cli import main
from mpcache.sim.trace_hits import TRACES, load_trace, replay, reuse_concentration, synthesize

DATA = Path(__file__).resolve().parents[2] / "data" / "traces"


def test_bounds_hold_on_both_synthetic_traces() -> None:
    for name in ("mooncake", "bailian"):
        trace = synthesize(TRACES[name], 300, seed=1)
        distinct = len({b for p in trace for b in p})
        infinite = replay(trace, 0, "infinite")
        for cap in (distinct // 20, distinct // 4):
            belady = replay(trace, cap, "belady")
            assert belady <= infinite
            for policy in ("lru", "lru-tail", "lru+admit2", "slru-tail"):
                assert 0.0 <= replay(trace, cap, policy) <= belady + 1e-9, (name, cap, policy)
        assert replay(trace, distinct, "lru") == infinite  # room for everything: no eviction


def test_the_bailian_shape_concentrates_reuse_as_published() -> None:
    # the paper: 10% of blocks take 77% of reuses
    assert 0.6 <= reuse_concentration(synthesize(TRACES["bailian"], 1000, seed=0)) <= 0.9


def test_tail_first_keeps_a_prefix_that_head_first_loses() -> None:
    # a 4-block prompt in 3 slots, then the same prompt: head first evicts block 0 (all lost);
    # tail first evicts block 3 and hits the first three
    trace = [(0, 1, 2, 3), (0, 1, 2, 3)]
    assert replay(trace, 3, "lru") == 0.0
    assert replay(trace, 3, "lru-tail") == 3 / 8


def test_the_cli_prints_a_row_per_trace_and_capacity(capsys: object) -> None:
    assert main(["trace-hits", "--requests", "100", "--capacities", "0.1,0.5"]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert sum(line.startswith("| mooncake") for line in out.splitlines()) == 2
    assert sum(line.startswith("| bailian") for line in out.splitlines()) == 2


def test_a_mooncake_format_file_loads_in_order_and_refuses_what_is_not_one(tmp_path: Path) -> None:
    good = tmp_path / "t.jsonl.gz"
    with gzip.open(good, "wt") as f:
        f.write('{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]}\n\n')
        f.write('{"timestamp": 5, "input_length": 1536, "output_length": 1, "hash_ids": [0, 1, 2]}\n')
    assert load_trace(good) == [(0, 1), (0, 1, 2)]
    assert load_trace(good, requests=1) == [(0, 1)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hash_ids": [0, "x"]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_trace(bad)
    assert main(["trace-hits", "--traces", "", "--file", str(bad)]) == 2
    assert main(["trace-hits", "--traces", "nope"]) == 2


def test_the_published_mooncake_traces_replay_within_the_bounds(capsys: object) -> None:
    path = DATA / "mooncake_conversation.jsonl.gz"
    assert len(load_trace(path)) == 12031  # the whole published trace is in the checkout
    trace = load_trace(path, requests=600)
    distinct = len({b for p in trace for b in p})
    cap = distinct // 10
    belady, infinite = replay(trace, cap, "belady"), replay(trace, 0, "infinite")
    assert 0 < belady <= infinite
    for policy in ("lru", "lru-tail", "lru+admit2", "slru-tail"):
        assert 0.0 <= replay(trace, cap, policy) <= belady + 1e-9, policy
    assert main(["trace-hits", "--traces", "", "--file", str(path), "--requests", "200", "--capacities", "0.1"]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert sum(line.startswith("| mooncake_conversation, real") for line in out.splitlines()) == 1


def test_slru_protects_what_is_read_again_from_one_off_blocks() -> None:
    # block 0 is read twice (protected), then a stream of one-off prompts passes through a
    # 3-block cache: LRU loses block 0, the segmented LRU keeps it
    trace = [(0,), (0,), (10,), (11,), (12,), (13,), (0,)]
    assert replay(trace, 3, "lru") == 1 / 7
    assert replay(trace, 3, "slru-tail") == 2 / 7
