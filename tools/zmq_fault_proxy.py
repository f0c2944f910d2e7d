"""A loopback ZMQ proxy between mpcache clients and an mpcache-server, whose faults the caller
names (``tools/record_production.py`` drives production's machines through it).

Clients connect their DEALER to the proxy's ROUTER; each client gets its own DEALER to the
backend server, so the server sees one peer per client as it would without the proxy. Frames go
through unchanged, but for what the caller asks:

* ``hold_heartbeats()`` / ``release_heartbeats()``: the clients' ``health`` requests and instance
  pings wait in the proxy (a heartbeat's reply carries the server's epoch, a ping's tells whether
  the server knows the instance: a link that learns either registers again);
* ``switch(url)``: every client's traffic goes to another server from now on (for the clients the
  server at the proxy's address was replaced: a new epoch, instances unknown), their connection to
  the proxy untouched;
* ``drop_next_reply()``: the server's reply to the next request that is neither a heartbeat nor an
  instance ping is dropped (the server stays alive and answers everything else).

The proxy is a thread; ``close()`` stops it.
"""
from __future__ import annotations

import threading
from typing import Any

import msgpack  # type: ignore[import-untyped]
import zmq

_HEALTH, _PING = msgpack.packb("health"), msgpack.packb("ping")


class FaultProxy:
    def __init__(self, backend: str) -> None:
        self._ctx = zmq.Context()
        self._front = self._ctx.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        port = self._front.bind_to_random_port("tcp://127.0.0.1")
        self.url = f"tcp://127.0.0.1:{port}"
        self._backend = backend
        self._backs: dict[bytes, Any] = {}  # client identity -> its DEALER to the backend
        self._lock = threading.Lock()
        self._hold = False
        self._held: list[tuple[bytes, list[bytes]]] = []
        self._drop_armed = False
        self._dropping: set[tuple[bytes, bytes]] = set()  # (identity, uid frame) whose reply is dropped
        self.dropped: list[str] = []  # the ops whose reply was dropped
        self.held_count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ controls (any thread)
    def hold_heartbeats(self) -> None:
        with self._lock:
            self._hold = True

    def release_heartbeats(self) -> None:
        with self._lock:
            self._hold = False

    def switch(self, backend: str) -> None:
        """Returns once the proxy's thread sends to ``backend`` (a reply the old server sends
        after that is lost, as a replaced server's would be)."""
        switched = threading.Event()
        with self._lock:
            self._backend = backend
            self._switched = switched
        if not switched.wait(5):
            raise RuntimeError("the proxy did not switch its backend")

    def drop_next_reply(self) -> None:
        with self._lock:
            self._drop_armed = True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    # ------------------------------------------------------------------ the proxy's thread
    _switched: threading.Event | None = None

    def _back(self, identity: bytes) -> Any:
        sock = self._backs.get(identity)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._backend)
            self._backs[identity] = sock
        return sock

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._lock:
                    switched, self._switched = self._switched, None
                    if switched is not None:
                        for sock in self._backs.values():
                            sock.close()
                        self._backs.clear()
                        switched.set()
                    hold = self._hold
                    if not hold and self._held:
                        held, self._held = self._held, []
                    else:
                        held = []
                for identity, frames in held:
                    self._back(identity).send_multipart(frames)
                poller = zmq.Poller()
                poller.register(self._front, zmq.POLLIN)
                backs = dict(self._backs)
                for sock in backs.values():
                    poller.register(sock, zmq.POLLIN)
                ready = dict(poller.poll(5))
                if self._front in ready:
                    while int(self._front.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                        identity, *frames = self._front.recv_multipart()
                        self._forward(identity, frames, hold)
                for identity, sock in backs.items():
                    if sock in ready:
                        while int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                            frames = sock.recv_multipart()
                            if (identity, frames[0]) in self._dropping:
                                self._dropping.discard((identity, frames[0]))
                                continue
                            self._front.send_multipart([identity, *frames])
        finally:
            for sock in self._backs.values():
                sock.close()
            self._front.close()
            self._ctx.term()

    def _forward(self, identity: bytes, frames: list[bytes], hold: bool) -> None:
        op = frames[1] if len(frames) > 1 else b""
        if op in (_HEALTH, _PING) and hold:
            self.held_count += 1
            with self._lock:
                self._held.append((identity, frames))
            return
        if op not in (_HEALTH, _PING):
            with self._lock:
                drop, self._drop_armed = self._drop_armed, False
            if drop:
                self._dropping.add((identity, frames[0]))
                self.dropped.append(str(msgpack.unpackb(op)))
        self._back(identity).send_multipart(frames)
