"""The pair harness: client machines wired to server machines back to back, no runtime.

The "network" is two explicit queues a test controls (deliver in order, reorder, duplicate,
drop); server completions (transfers, L2 reads/writes) and engine copies are completed by the
harness when asked (``complete``/``run``)."""
from __future__ import annotations

from typing import Any

import attrs

from mpcache.core_sm.effects import (
    AttachInstance,
    CopyBlocks,
    ErrorReply,
    ProbeL2,
    ReadL2,
    Reply,
    SendRequest,
    StartTransfer,
    WriteL2,
)
from mpcache.core_sm.lookup_client import LookupClient, LookupClientConfig
from mpcache.core_sm.messages import (
    CopyFinished,
    L2ProbeFinished,
    L2ReadFinished,
    L2WriteFinished,
    ReplyReceived,
    RequestFailed,
    ServerHealth,
    SubmitStore,
    TimerFired,
    TransferFinished,
)
from mpcache.core_sm.server import LookupServer, ServerConfig
from mpcache.core_sm.transfer_client import TransferClient, TransferClientConfig
from sm_helpers import C


@attrs.define
class Msg:
    client: str
    server: int
    correlation: int
    request: Any = None  # to a server
    reply: Any = None  # to a client: a Reply or ErrorReply effect


class Pair:
    def __init__(self, num_servers: int = 1, server_cls: type[LookupServer] = LookupServer,
                 lookup_cls: type[LookupClient] = LookupClient, engine: bool = False,
                 world_size: int = 1, ranks_per_server: tuple[tuple[int, ...], ...] | None = None,
                 answer_in_ack: bool = False, **server_kw: Any) -> None:
        """One lookup client over ``num_servers`` servers and one worker per server (worker s
        talks to server s; with ``ranks_per_server`` it is the worker of rank
        ``ranks_per_server[s][0]``, else of rank 0)."""
        cfg = ServerConfig(chunk_size=C, num_slots=64, slot_bytes=100, **server_kw)
        self.server_cls, self.cfg = server_cls, cfg
        self.servers = [server_cls(cfg) for _ in range(num_servers)]
        self.lookup = lookup_cls(LookupClientConfig(num_servers=num_servers, model_name="m",
                                                    world_size=world_size, chunk_size=C,
                                                    poll_interval=0.01, lookup_timeout=5.0,
                                                    ranks_per_server=ranks_per_server,
                                                    answer_in_ack=answer_in_ack))
        self.workers = [TransferClient(TransferClientConfig(
            instance_id=s + 1, model_name="m", world_size=world_size,
            worker_id=0 if ranks_per_server is None else ranks_per_server[s][0], chunk_size=C,
            object_bytes=10, engine_driven=engine, server=s)) for s in range(num_servers)]
        self.now = 0.0
        self.up: list[Msg] = []  # to servers
        self.down: list[Msg] = []  # to clients
        self.internal: list[tuple[int, Any]] = []  # server completions
        self.copies: list[tuple[int, CopyBlocks]] = []
        self.l2_has: set[Any] = set()
        for s, w in enumerate(self.workers):
            self.client(f"w{s}", ServerHealth(s, True))
        self.run()

    def machine(self, name: str) -> Any:
        return self.lookup if name == "lookup" else self.workers[int(name[1:])]

    def client(self, name: str, event: Any) -> None:
        for e in self.machine(name).handle(event, self.now):
            if isinstance(e, SendRequest):
                self.up.append(Msg(name, e.server, e.correlation, request=e.request))
            elif isinstance(e, CopyBlocks):
                self.copies.append((int(name[1:]), e))

    def to_server(self, i: int = 0, duplicate: bool = False) -> None:
        m = self.up[i] if duplicate else self.up.pop(i)
        rt = (m.client, m.server, m.correlation)
        self._server_effects(m.server, self.servers[m.server].handle(
            attrs.evolve(m.request, reply_to=rt), self.now))

    def _server_effects(self, s: int, effects: list[Any]) -> None:
        for e in effects:
            if isinstance(e, (Reply, ErrorReply)):
                client, server, corr = e.reply_to
                self.down.append(Msg(client, server, corr, reply=e))
            elif isinstance(e, AttachInstance):  # as a runtime: attached before any other event
                from mpcache.core_sm.messages import InstanceAttached

                self._server_effects(s, self.servers[s].handle(
                    InstanceAttached(e.instance_id, e.registration_id, None, reply_to=e.reply_to), self.now))
            elif isinstance(e, StartTransfer):
                self.internal.append((s, TransferFinished(e.transfer_id, True)))
            elif isinstance(e, ProbeL2):
                self.internal.append((s, L2ProbeFinished(e.probe_id, tuple(k in self.l2_has for k in e.keys))))
            elif isinstance(e, ReadL2):
                self.internal.append((s, L2ReadFinished(e.read_id, tuple(k in self.l2_has for k, _ in e.items))))
            elif isinstance(e, WriteL2):
                self.l2_has.update(k for k, _ in e.items)
                self.internal.append((s, L2WriteFinished(e.write_id, True)))
        self.servers[s].check_invariants()

    def reregister(self, s: int = 0) -> None:
        """Worker ``s``'s connection registers its instance again (what its ``ServerLink``, not
        modelled here, decides on a new epoch, a not_registered or a lost registration): the
        worker's registration, its answer the link's own."""
        self.up.append(Msg(f"link{s}", s, 0, request=self.workers[s].registration_request()))

    def to_client(self, i: int = 0, duplicate: bool = False) -> None:
        m = self.down[i] if duplicate else self.down.pop(i)
        if m.client.startswith("link"):
            return
        if isinstance(m.reply, Reply):
            ev: Any = ReplyReceived(m.server, m.correlation, m.reply.result)
        else:
            ev = RequestFailed(m.server, m.correlation, m.reply.error)
        self.client(m.client, ev)
        self.machine(m.client).check_invariants()

    def complete(self) -> None:
        while self.internal:
            s, ev = self.internal.pop(0)
            self._server_effects(s, self.servers[s].handle(ev, self.now))
        while self.copies:
            s, cp = self.copies.pop(0)
            self.client(f"w{s}", CopyFinished(cp.op, True))

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if self.up:
                self.to_server()
            elif self.down:
                self.to_client()
            elif self.internal or self.copies:
                self.complete()
            else:
                return
        raise AssertionError("the pair did not go quiet")

    def tick(self, dt: float) -> None:
        self.now += dt
        for s, srv in enumerate(self.servers):
            self._server_effects(s, srv.handle(TimerFired(), self.now))
        self.client("lookup", TimerFired())
        for s in range(len(self.workers)):
            self.client(f"w{s}", TimerFired())

    def settle(self, dt: float = 0.01, rounds: int = 50) -> None:
        for _ in range(rounds):
            self.run()
            self.tick(dt)
        self.run()

    def store(self, toks: tuple[int, ...], end: int | None = None, rid: str = "writer") -> None:
        end = len(toks) // C * C if end is None else end
        for s in range(len(self.workers)):
            self.client(f"w{s}", SubmitStore(rid, toks, 0, end, tuple(range(end // 2))))
        self.run()

    def restart_server(self, s: int = 0) -> None:
        """Server ``s`` crashes and comes back empty: requests on their way to it and its
        pending completions are lost; replies it already sent may still arrive."""
        self.servers[s] = self.server_cls(self.cfg)
        self.up = [m for m in self.up if m.server != s]
        self.internal = [(i, ev) for i, ev in self.internal if i != s]

    def leases(self, owner: str) -> int:
        return sum(srv.leases_of(owner) for srv in self.servers)
