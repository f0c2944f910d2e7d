"""Hit rates on synthetic hashed-block traces (mpcache.sim.trace_hits): the bounds hold, the
synthetic Bailian-shaped trace is as concentrated as the paper says, and evicting a request's
tail first keeps its prefix where evicting its head first loses all of it."""
from __future__ import annotations

from mpcache.sim.cli import main
from mpcache.sim.trace_hits import TRACES, replay, reuse_concentration, synthesize


def test_bounds_hold_on_both_synthetic_traces() -> None:
    for name in ("mooncake", "bailian"):
        trace = synthesize(TRACES[name], 300, seed=1)
        distinct = len({b for p in trace for b in p})
        infinite = replay(trace, 0, "infinite")
        for cap in (distinct // 20, distinct // 4):
            belady = replay(trace, cap, "belady")
            assert belady <= infinite
            for policy in ("lru", "lru-tail", "lru+admit2"):
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
