"""core_sm's placement of worker ranks on servers, which the connector's adapters and the
simulator both use: a rank stores to and loads from one server, and a lookup asks each server
about the ranks it holds."""
from __future__ import annotations

import pytest

from mpcache.core_sm.client_config import ConnectorSettings, lookup_client_config, ranks_per_server, server_for_rank
from mpcache.core_sm.lookup_client import LookupClient
from mpcache.core_sm.messages import Lookup, SubmitLookup


@pytest.mark.parametrize("world_size,num_servers", [(1, 1), (1, 3), (2, 2), (2, 3), (4, 2), (8, 3)])
def test_every_rank_has_one_server_in_order(world_size: int, num_servers: int) -> None:
    placed = [server_for_rank(r, world_size, num_servers) for r in range(world_size)]
    assert placed == sorted(placed) and all(0 <= s < num_servers for s in placed)
    rps = ranks_per_server(world_size, num_servers)
    assert len(rps) == num_servers and sorted(r for ranks in rps for r in ranks) == list(range(world_size))
    assert all(server_for_rank(r, world_size, num_servers) == s for s, ranks in enumerate(rps) for r in ranks)
    with pytest.raises(ValueError):
        server_for_rank(world_size, world_size, num_servers)


def test_a_lookup_asks_each_server_for_the_ranks_it_holds() -> None:
    """Each worker stores only to its rank's server: a lookup asking a server for every rank would
    miss on every world with two servers or more."""
    config = lookup_client_config(ConnectorSettings(), num_servers=3, model_name="m", world_size=2, chunk_size=16)
    assert config.ranks_per_server == ((0,), (1,), ())
    effects = LookupClient(config).handle(SubmitLookup("r", tuple(range(1, 33))), 0.0)
    asked = {e.server: e.request.ranks for e in effects if isinstance(getattr(e, "request", None), Lookup)}
    assert asked == {0: (0,), 1: (1,)}
    assert lookup_client_config(ConnectorSettings(), num_servers=1, model_name="m", world_size=2,
                                chunk_size=16).ranks_per_server is None
