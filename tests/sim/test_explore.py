"""The explorer over the production machines: a one-engine, one-server world is explored
completely with no violation, and every row it reports reached is a real table row."""
from mpcache.sim.explore import Explorer, XWorld


def test_tiny_world_explored_completely() -> None:
    ex = Explorer(XWorld("tiny", engines=1, servers=1, requests=1)).run()
    assert ex.violation is None
    assert ex.complete
    assert ex.states > 5 and ex.depth > 5
    rows = set(ex.all_rows())
    assert ex.reached and ex.reached <= rows
    assert len(ex.unreached()) == len(rows) - len(ex.reached)
