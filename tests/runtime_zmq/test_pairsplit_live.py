"""mpcache-bench pairsplit against a live server: the stamps it puts on the server's loop still
land on every pair (a renamed loop step would leave the pairs unmatched and the table empty)."""
from __future__ import annotations

import re

import pytest

from mpcache.bench.bench_pairsplit import LEGS, main


def test_every_pair_is_split_into_its_legs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--pairs", "60", "--warmup", "20", "--l1-size-gb", "0.0625", "--form", "list"]) == 0
    out = capsys.readouterr().out
    assert "60 pairs after 20, 60 matched" in out
    # a leg may read below zero: the server stamps "sent" after its send call returns, and on a
    # loaded box the client can hold the reply before that
    for leg in LEGS:
        assert re.search(rf"\| {re.escape(leg)} \| -?\d+\.\d \|", out), leg
