"""The server against another revision of itself, for a change to its jobs (core_sm/server_jobs.py
and what it needs) that must not change behaviour: random input sequences run through the
production ``LookupServer`` and every legacy profile's server subclass of both revisions, the
effects of every event and the jobs' state after it compared byte for byte.

``--rev`` names the commit whose server is the reference: its ``mpcache`` package is taken from
git (``git archive``) into a temporary directory and run in a process of its own, beside one
running the working tree's (each side imports only its own tree: the legacy subclasses are each
revision's ``mpcache.sim.profiles``). After every event a record is made of: the effects, in
order; every request's ``job_state``, its job's hit count, tombstone, lookup count and waiters;
the deferred work (an accepted lookup, the sliced walks); and ``stats()`` but
``table_violations`` (a checking table counted a legacy server's departures there; an assigning
one has none to count). Each side prints a digest per event; the first sequence whose digests
differ is run again on both sides with the records themselves, and the first event that differs
is shown.

Inputs (besides a directed sequence per server, tombstone cap and ``ack_first``: ``run_script``): lookups (new, duplicate, answered in the ack, refused: bad ranks, a key not starting at
0, the repeat and job caps), stores that fill L1, status queries, waits (some with no number for
a timeout, some past ``max_waiters``), frees (some malformed), end sessions, L2 reads and probes
finishing, and time passing (reaps, L2 timeouts, waiter deadlines, tombstone expiry), from two
peers on three request ids. A share of the sequences cut the lease and L2 slice sizes (both
sides alike) so that lookups lease and walk in slices, and a share make the server's
``_lease_prefix_for_lookup`` raise now and then (and in the work of some lookups answered in
their ack), so that a lookup's work fails (``LookupWorkFailed``).

    PYTHONPATH=$PWD python tools/server_jobs_differential.py --rev <commit> [--sequences 3000]

Exit status 0 when every trace is equal; else the first event whose record differs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
C = 4
PEERS: list[Any] = [None, "p1"]
RIDS = ["a", "b", "c"]
SEQS = [tuple(range(16)), tuple(range(8)) + tuple(range(100, 108)), tuple(range(200, 232))]
SERVER_NAMES = ["LookupServer", "UnknownNoneServer", "PopOnceServer", "OverwriteDupServer", "ReleaseAllServer",
                "SilentErrorsServer", "NoReaperServer", "TrustAllServer"]


def _server_types() -> list[type]:
    from mpcache.core_sm.server import LookupServer
    from mpcache.sim import profiles
    return [LookupServer if name == "LookupServer" else getattr(profiles, name) for name in SERVER_NAMES]


def _config(r: random.Random) -> Any:
    from mpcache.core_sm.server import ServerConfig
    return ServerConfig(
        chunk_size=C, num_slots=r.choice([3, 12, 40]), slot_bytes=64, lease_ttl=r.choice([8.0, 30.0]),
        l2_enabled=r.random() < 0.6, l2_probe=r.random() < 0.3, l2_read_timeout=r.choice([2.0, 30.0]),
        tombstone_ttl=r.choice([3.0, 60.0]), tombstone_cap=r.choice([0, 1, 100]),
        abandoned_job_ttl=r.choice([4.0, 60.0]), ack_first=r.random() < 0.3, instance_ttl=None,
        l1_bytes=0, slot_align=16, max_jobs=r.choice([2, 100]), max_jobs_per_peer=r.choice([1, 100]),
        max_lookups_per_request=r.choice([2, 64]), max_waiters=r.choice([1, 100]))


class _Faults:
    """Makes the server's ``_lease_prefix_for_lookup`` raise every ``every``-th call (a lookup's
    work then fails)."""

    def __init__(self, inner: Any, every: int) -> None:
        self.inner, self.every, self.calls = inner, every, 0
        self.armed = False  # raise at the next call (the sequence armed it for a lookup)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.armed or self.calls % self.every == 0:
            self.armed = False
            raise MemoryError("injected")
        return self.inner(*args, **kwargs)


def record(server: Any, effects: list[Any]) -> str:
    """What is compared after an event (module doc)."""
    from mpcache.core_sm.server_core import RequestKey
    jobs = server.jobs
    per_request = []
    for peer in PEERS:
        for rid in RIDS:
            key = RequestKey(peer, rid)
            job = jobs.jobs.get(key)
            per_request.append((peer, rid, server.job_state(rid, peer).name,
                                None if job is None else (job.hits, job.serial, job.read_id, job.probe_id,
                                                          job.l1_prefix if job.work is not None else None),
                                jobs.tombstones.get(key), jobs.repeats.get(key),
                                sorted(jobs.waiters.get(key, {}))))
    stats = {k: v for k, v in server.stats().items() if k != "table_violations"}
    deferred = (None if jobs.accepted is None else jobs.accepted[0].key,
                [(type(c).__name__, c.job.key if c.job is not None else None) for c in jobs.continuing])
    return repr((effects, per_request, list(jobs.tombstones), deferred, sorted(stats.items())))


def run_sequence(server_type: type, seed: int, steps: int, records: list[str] | None = None) -> list[str]:
    """Digests of every event's record (and, ``records`` given, the records)."""
    from mpcache.core_sm import server_jobs, server_l2
    from mpcache.core_sm.effects import ProbeL2, ReadL2
    from mpcache.core_sm.messages import (CacheKey, EndSession, FreeLookupLocks, L2ProbeFinished, L2ReadFinished,
                                          Lookup, QueryPrefetchStatus, Store, TimerFired, WaitPrefetchStatus)
    r = random.Random(seed)
    sliced = r.random() < 0.3
    server_jobs.LEASE_SLICE_OBJECTS = 2 if sliced else 2048
    if hasattr(server_l2, "L2_SLICE_OBJECTS"):
        server_l2.L2_SLICE_OBJECTS = 2 if sliced else _L2_SLICE
    server = server_type(_config(r))
    trace: list[Any] = []
    server.jobs.dispatch.trace = trace
    faults = None
    if r.random() < 0.3:
        faults = server._lease_prefix_for_lookup = _Faults(server._lease_prefix_for_lookup, r.choice([2, 3, 5, 1000]))
    reads: list[int] = []
    probes: list[int] = []
    now = 0.0
    digests: list[str] = []
    # a share of the sequences name one request of one peer: duplicates, waiters and answers meet
    # (and wait long, their L2 steps finishing seldom: lookups meet jobs with waiters)
    focused = r.random() < 0.25
    rids, peers = (RIDS[:1], PEERS[:1]) if focused else (RIDS, PEERS)

    def key(worker: bool) -> Any:
        a, b = sorted((r.randint(0, 4) * C, r.randint(1, 6) * C))
        if not worker and r.random() < 0.05:
            a = C  # a lookup must start at 0: refused
        return CacheKey("m", 2 if r.random() < 0.2 else 1, 0 if worker else None, r.choice(SEQS),
                        a if worker else (a if a == C else 0), b, r.choice(rids), "")

    for n in range(steps):
        rt, peer, pick = ("r", n), r.choice(peers), r.randrange(13)
        ev: Any
        if pick <= 2:
            k = key(False)
            ranks = None if r.random() < 0.8 else r.choice([(0,), (1,), (0, 0), ()])
            in_ack = r.random() < 0.3
            ev = Lookup(k, r.choice([0, 1, 1, 2]), ranks=ranks, answer_in_ack=in_ack, reply_to=rt, peer=peer)
            if faults is not None:
                faults.armed = in_ack and r.random() < 0.3
        elif pick == 3:
            k = key(True)
            ev = Store(k, r.randrange(k.world_size), tuple(range(k.end // C * 2 + 2)), reply_to=rt, peer=peer)
        elif pick == 4:
            ev = QueryPrefetchStatus(r.choice(rids), reply_to=rt, peer=peer)
        elif pick == 5:
            timeout: Any = 40.0 if focused else r.choice([0.5, 5.0, 40.0, 0.0, float("nan"), "x"])
            ev = WaitPrefetchStatus(r.choice(rids), timeout, reply_to=rt, peer=peer)
        elif pick == 6:
            k = key(True)
            k = CacheKey("m", k.world_size, None, k.token_ids, k.start, k.end, k.request_id, "")
            if r.random() < 0.1:
                k = CacheKey("m", 1, 0, k.token_ids, 1, 2 * C + 1, k.request_id, "")  # a worker's: refused
            ev = FreeLookupLocks(k, reply_to=rt, peer=peer)
        elif pick == 7:
            ev = EndSession(r.choice(rids), reply_to=rt, peer=peer)
        elif (pick == 8 or pick == 9 and not focused) and (reads or probes):
            if reads and (not probes or r.random() < 0.5):
                ev = L2ReadFinished(reads.pop(r.randrange(len(reads))), tuple(r.random() < 0.7 for _ in range(64)))
            else:
                ev = L2ProbeFinished(probes.pop(r.randrange(len(probes))), tuple(r.random() < 0.7 for _ in range(64)))
        else:
            ev = TimerFired()
        now += r.choice([0.0, 0.5, 1.0, 3.0, 7.0])
        effects = server.handle(ev, now)
        if r.random() < 0.7:
            effects += server.run_deferred()
        for e in effects:
            if isinstance(e, ReadL2):
                reads.append(e.read_id)
            elif isinstance(e, ProbeL2):
                probes.append(e.probe_id)
        _note(server, effects, digests, records)
    return _tally(server, trace, digests)


def _note(server: Any, effects: list[Any], digests: list[str], records: list[str] | None) -> None:
    """One event's outcome: the server's effects and job states, as a digest (and in full)."""
    rec = record(server, effects)
    digests.append(hashlib.sha1(rec.encode()).hexdigest()[:16])
    if records is not None:
        records.append(rec)


def _tally(server: Any, trace: list[Any], digests: list[str]) -> list[str]:
    """A sequence's end: the rows it ran and the internal errors it met join the totals."""
    _ROWS.update(f"{s.name} x {e.__name__} -> {a.name}" for s, e, a in trace)
    _ERRORS[0] += server.stats()["internal_errors"]
    return digests


def run_script(server_type: type, cap: int, ack_first: bool, records: list[str] | None = None) -> list[str]:
    """A directed sequence for what random ones seldom reach: a job waits on L2 with a waiter, a
    duplicate lookup answered in its ack comes (its work failing at once), then time passes
    (the L2 timeout, the tombstone's expiry, the reap)."""
    from mpcache.core_sm.messages import CacheKey, Lookup, QueryPrefetchStatus, TimerFired, WaitPrefetchStatus
    from mpcache.core_sm.server import ServerConfig
    server = server_type(ServerConfig(chunk_size=C, num_slots=12, slot_bytes=64, l2_enabled=True,
                                      l2_read_timeout=2.0, tombstone_cap=cap, tombstone_ttl=5.0,
                                      abandoned_job_ttl=20.0, ack_first=ack_first, instance_ttl=None, l1_bytes=0,
                                      slot_align=16))
    trace: list[Any] = []
    server.jobs.dispatch.trace = trace
    faults = server._lease_prefix_for_lookup = _Faults(server._lease_prefix_for_lookup, 1000)
    key = CacheKey("m", 1, None, SEQS[0], 0, 3 * C, "a", "")
    steps: list[tuple[float, Any, bool]] = [
        (0.0, Lookup(key, 1, reply_to=1), False), (0.0, WaitPrefetchStatus("a", 40.0, reply_to=2), False),
        (0.0, Lookup(key, 1, answer_in_ack=True, reply_to=3), True), (0.0, QueryPrefetchStatus("a", reply_to=4), False),
        (1.0, Lookup(key, 1, reply_to=5), False), (1.0, WaitPrefetchStatus("a", 40.0, reply_to=6), False),
        (4.0, TimerFired(), False), (4.0, Lookup(key, 1, answer_in_ack=True, reply_to=7), False),
        (12.0, TimerFired(), False), (12.0, QueryPrefetchStatus("a", reply_to=8), False),
        (40.0, TimerFired(), False), (40.0, QueryPrefetchStatus("a", reply_to=9), False)]
    digests: list[str] = []
    for now, ev, fail in steps:
        faults.armed = fail
        effects = server.handle(ev, now) + server.run_deferred()
        _note(server, effects, digests, records)
    return _tally(server, trace, digests)


SCRIPTS = [(name, cap, ack) for name in SERVER_NAMES for cap in (100, 0) for ack in (False, True)]
_L2_SLICE = 0
_ROWS: set[str] = set()  # the jobs rows run (state x event -> state after), over all sequences
_ERRORS = [0]  # internal errors, over all sequences


def worker(sequences: int, steps: int, only: tuple[str, int] | None) -> None:
    """One side: print the digests (or, ``only``: the records of one sequence), as JSON."""
    global _L2_SLICE
    from mpcache.core_sm import server_l2
    _L2_SLICE = getattr(server_l2, "L2_SLICE_OBJECTS", 0)
    types_ = dict(zip(SERVER_NAMES, _server_types()))
    if only is not None:
        recs: list[str] = []
        if only[0].startswith("script/"):
            name, cap, ack = SCRIPTS[only[1]]
            run_script(types_[name], cap, ack, recs)
        else:
            run_sequence(types_[only[0]], only[1], steps, recs)
        json.dump(recs, sys.stdout)
        return
    out: dict[str, list[str]] = {}
    for seed in range(sequences):
        name = SERVER_NAMES[seed % len(SERVER_NAMES)]
        out[f"{name}:{seed}"] = run_sequence(types_[name], seed, steps)
    for i, (name, cap, ack) in enumerate(SCRIPTS):
        out[f"script/{name}/cap{cap}/{'ack_first' if ack else 'at_once'}:{i}"] = run_script(types_[name], cap, ack)
    json.dump({"digests": out, "rows": sorted(_ROWS), "internal_errors": _ERRORS[0]}, sys.stdout)


def _side(root: Path, args: list[str]) -> Any:
    env = dict(os.environ, PYTHONPATH=str(root))
    text = subprocess.check_output([sys.executable, str(Path(__file__).resolve()), "--worker", *args], env=env,
                                   cwd=str(root))
    return json.loads(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="ff1956e", help="the reference revision (default: %(default)s)")
    parser.add_argument("--sequences", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--only", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        only = None
        if args.only:
            name, seed = args.only.rsplit(":", 1)
            only = (name, int(seed))
        worker(args.sequences, args.steps, only)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        old_root = Path(tmp)
        archive = subprocess.check_output(["git", "archive", "--format=tar", args.rev, "mpcache"], cwd=ROOT)
        archive_path = old_root / "rev.tar"
        archive_path.write_bytes(archive)
        with tarfile.open(archive_path) as tar:
            tar.extractall(old_root, filter="data")
        common = ["--sequences", str(args.sequences), "--steps", str(args.steps)]
        old_side, new_side = _side(old_root, common), _side(ROOT, common)
        old, new = old_side["digests"], new_side["digests"]
        events = sum(len(v) for v in new.values())
        for name, digests in new.items():
            if old[name] != digests:
                first = next(i for i, (a, b) in enumerate(zip(old[name], digests)) if a != b)
                old_recs = _side(old_root, [*common, "--only", name])
                new_recs = _side(ROOT, [*common, "--only", name])
                print(f"{name}: event {first} differs\n  {args.rev}: {old_recs[first]}\n  "
                      f"working tree: {new_recs[first]}")
                return 1
        per_server = {s: sum(1 for k in new if k.startswith(s + ":")) for s in SERVER_NAMES}
        scripts = sum(1 for k in new if k.startswith("script/"))
        print(f"{len(new) - scripts} random sequences and {scripts} directed ones, {events} events: effects and job states equal after every event "
              f"({', '.join(f'{s} {n}' for s, n in per_server.items())}); internal errors: "
              f"{args.rev} {old_side['internal_errors']}, working tree {new_side['internal_errors']}")
        from mpcache.core_sm.server_jobs import JOB_TABLE
        rows = {f"{s.name} x {e.__name__}" for s, e in JOB_TABLE.rows}
        ran = {row.split(" -> ")[0] for row in new_side["rows"]}
        print(f"working tree's jobs rows run: {len(rows & ran)} of {len(rows)}"
              + (f"; never: {sorted(rows - ran)}" if rows - ran else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
