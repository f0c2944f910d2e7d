"""mpcache-bench pairsplit's matching of the server's stamps to the client's pairs."""
from __future__ import annotations

import array

from mpcache.bench.bench_pairsplit import _DECODED, _DEFERRED, _HANDLED, _RECV, _SENT, LEGS, split


def _stamps(*events: tuple[int, int]) -> array.array[int]:
    out: array.array[int] = array.array("q")
    for kind, t in events:
        out.extend((kind, t))
    return out


def test_each_leg_is_cut_at_its_own_stamps() -> None:
    client = array.array("q", [1000, 5000, 9000, 20_000, 24_000, 28_000])
    stamps = _stamps(
        # pair 1: lookup, its ack, its deferred work; the status; the end_session after the pair
        (_RECV, 1500), (_DECODED, 2000), (_SENT, 2500), (_DEFERRED, 3000), (_HANDLED, 3000),
        (_RECV, 6000), (_DECODED, 6200), (_HANDLED, 6500), (_SENT, 7000),
        (_RECV, 9500), (_DECODED, 9600), (_HANDLED, 9700), (_SENT, 9800),
        # pair 2: the status arrives while the lookup's deferred work still runs (received after it)
        (_RECV, 20_100), (_DECODED, 20_300), (_SENT, 20_400), (_DEFERRED, 25_000), (_HANDLED, 25_000),
        (_RECV, 25_100), (_DECODED, 25_200), (_HANDLED, 25_300), (_SENT, 25_400),
    )
    legs = split(client, stamps)
    assert [legs[k][0] for k in LEGS] == [500, 500, 500, 2500, 1000, 200, 300, 500, 2000, 8000, 500]
    assert [legs[k][1] for k in LEGS] == [100, 200, 100, 3600, 1100, 100, 100, 100, 2600, 8000, 4600]


def test_a_pair_missing_a_stamp_is_left_out() -> None:
    client = array.array("q", [1000, 5000, 9000])
    stamps = _stamps((_RECV, 1500), (_DECODED, 2000), (_SENT, 2500), (_HANDLED, 3000),
                     (_RECV, 6000), (_DECODED, 6200), (_HANDLED, 6500), (_SENT, 7000))  # no deferred stamp
    assert all(v == [] for v in split(client, stamps).values())
