"""The one configuration builder: a connector's settings -> the configs of its client machines.

The vLLM adapters (``mpcache.runtime_zmq.adapters``) and the simulator (``mpcache.sim.profiles``)
both build their machines' configs here, so the simulated world runs production's defaults; a
simulator profile varies from them by name. Inputs are the connector's settings in core_sm's units
(seconds); outputs are the machines' own frozen configs.

* ``ConnectorSettings``: the settings that decide a machine's behaviour (not where it connects).
* ``lookup_client_config``: the scheduler's ``LookupClient`` -- its whole lookup bounded by two
  request timeouts, status by ``WAIT_PREFETCH_STATUS`` (answered within half a request timeout,
  at most 1 s) unless ``lookup_status_wait`` is off; with ``lookup_answer_in_ack`` each LOOKUP
  asks for its hit count in the ack (a server that knows it then saves the status round trip).
* ``transfer_op_timeout``: a worker op's own timeout (the request timeout).
* ``link_config``: every connection's ``ServerLink`` (``server_link.client_link_config``).
* ``server_for_rank`` / ``ranks_per_server``: where a worker rank's KV lives -- the one server
  it stores to and loads from, and so the ranks each server is asked about in a lookup.
"""
from __future__ import annotations

import attrs

from mpcache.core_sm.lookup_ops import LookupClientConfig
from mpcache.core_sm.server_link import ServerLinkConfig, client_link_config


@attrs.frozen
class ConnectorSettings:
    request_timeout: float = 5.0  # a request with no reply after this long fails
    lookup_status_wait: bool = True  # WAIT_PREFETCH_STATUS instead of polling
    # an L1 hit answered in the LOOKUP's ack: one round trip instead of two (Lookup.answer_in_ack);
    # a server that predates it acks nil and is asked for the status as before. The connector
    # (ConnectorConfig) and the simulator (a draw per world) name it; a world that names nothing
    # (the exhaustive explorer's) keeps the two-step lookup it explores.
    lookup_answer_in_ack: bool = False
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 3.0

    def __attrs_post_init__(self) -> None:
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0, not {self.request_timeout!r}")


def server_for_rank(rank: int, world_size: int, num_servers: int) -> int:
    """The server worker ``rank`` of ``world_size`` stores to and loads from: the ranks spread in
    order over the servers, ``rank * num_servers // world_size`` (with more servers than ranks,
    some hold none). ``ValueError`` on a rank outside the world or no server."""
    if not 0 <= rank < world_size or num_servers < 1:
        raise ValueError(f"rank {rank} outside world size {world_size}, or {num_servers} servers")
    return rank * num_servers // world_size


def ranks_per_server(world_size: int, num_servers: int) -> tuple[tuple[int, ...], ...]:
    """Entry s: the ranks whose KV server s holds (``server_for_rank``), what a lookup asks it
    about; an empty entry is a server no rank uses."""
    held: list[list[int]] = [[] for _ in range(num_servers)]
    for rank in range(world_size):
        held[server_for_rank(rank, world_size, num_servers)].append(rank)
    return tuple(tuple(ranks) for ranks in held)


def lookup_client_config(settings: ConnectorSettings, *, num_servers: int, model_name: str, world_size: int,
                         chunk_size: int) -> LookupClientConfig:
    """Each server is asked about the ranks it holds (``ranks_per_server``): a server holds only
    its ranks' KV, so asking it for every rank would miss every lookup."""
    return LookupClientConfig(
        num_servers=num_servers,
        model_name=model_name,
        world_size=world_size,
        chunk_size=chunk_size,
        # every request has its own timeout; this bounds the whole lookup too
        lookup_timeout=2 * settings.request_timeout,
        use_wait=settings.lookup_status_wait,
        answer_in_ack=settings.lookup_answer_in_ack,
        # a waiting status query is answered within its wait, well inside the request timeout
        wait_timeout=min(1.0, settings.request_timeout / 2),
        ranks_per_server=ranks_per_server(world_size, num_servers) if num_servers > 1 else None,
    )


def transfer_op_timeout(settings: ConnectorSettings) -> float:
    return settings.request_timeout


def link_config(settings: ConnectorSettings, *, heartbeat_backoff_max: float | None = None,
                reconnect_ivl_max: float = 1.0) -> ServerLinkConfig:
    return client_link_config(request_timeout=settings.request_timeout,
                              heartbeat_interval=settings.heartbeat_interval,
                              heartbeat_timeout=settings.heartbeat_timeout,
                              heartbeat_backoff_max=heartbeat_backoff_max, reconnect_ivl_max=reconnect_ivl_max)
