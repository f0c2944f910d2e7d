"""Capacity planning: re-run a captured server trace at other L1 sizes and count hits.

``mpcache-sim sweep FILE --l1-size-gb 1,2,4,8`` feeds the events of an ``mpcache-server --trace``
file (``mpcache.core_sm.trace``) to a fresh server machine per size, with ``num_slots`` = size / the
trace's ``slot_bytes``, and counts what the machine answers. At another size the effects differ
from the recorded ones by design (other hits, other slots, other transfers), so nothing is
compared with the record; instead every oracle that holds for any size is checked:

* SAFETY: ``LookupServer.check_invariants`` after every event;
* CRASH: an event the machine raises on;
* F11: a request answered twice, or recorded as answered and never answered in the replay;
* HIT: a lookup answered with a chunk no committed store of this replay ever wrote;
* bounds: a hit larger than the chunks the lookup asked for.

The engine's side is what was recorded: it cannot react to the new answers. A transfer the
replayed machine planned gets the recorded commit (ids are mapped recorded -> replayed from the
replies, position by position); a commit or completion for a transfer the replay never planned
(a retrieve of chunks that are not there at this size) is skipped and counted. The sweep is of
L1 alone: L2 is turned off and the runtime's L2 completions are skipped (their read ids belong
to the recorded run).

Hit rate per lookup: the first count a status query answers for the lookup's request id after
the ``Lookup`` (in chunks), over the chunks it asked for; tokens: hit chunks x chunk size
(at most the tokens asked) over the tokens asked.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from mpcache.core_sm.effects import ErrorReply, Reply
from mpcache.core_sm.keys import PrehashedTokens
from mpcache.core_sm.trace import FORMAT, TraceCodec

GiB = 1 << 30


@attrs.define
class SweepRow:
    """What the machine answered at one L1 size."""

    size_gb: float
    num_slots: int
    lookups: int = 0
    chunks_asked: int = 0
    chunks_hit: int = 0
    tokens_asked: int = 0
    tokens_hit: int = 0
    evictions: int = 0
    skipped: int = 0  # recorded events for transfers the replay never planned
    violations: list[str] = attrs.Factory(list)

    @property
    def chunk_hit_rate(self) -> float:
        return self.chunks_hit / self.chunks_asked if self.chunks_asked else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.tokens_hit / self.tokens_asked if self.tokens_asked else 0.0


def read_trace(path: str) -> tuple[dict[str, Any], list[Any]]:
    with open(path, encoding="utf-8") as f:
        head = json.loads(f.readline())
        if head.get("mpcache_trace") != FORMAT:
            raise ValueError(f"{path}: not an mpcache trace of format {FORMAT}")
        return head, [json.loads(line) for line in f if line.strip()]


def recorded_hit_rate(head: dict[str, Any], records: Sequence[Any]) -> SweepRow:
    """The hit counts the live server answered (the trace's own row; no replay)."""
    codec = TraceCodec(keep_tokens=bool(head.get("keep_tokens")))
    config = codec.decode(head["config"])
    row = SweepRow(config.num_slots * config.slot_bytes / GiB, config.num_slots)
    counter = _HitCounter(row, config.chunk_size)
    for _now, event, effects in records:
        counter.before(codec.decode(event))
        counter.after(codec.decode(effects))
    return row


def sweep(head: dict[str, Any], records: Sequence[Any], sizes_gb: Iterable[float],
          check_every: int = 1) -> list[SweepRow]:
    return [run_size(head, records, size, check_every) for size in sizes_gb]


def run_size(head: dict[str, Any], records: Sequence[Any], size_gb: float, check_every: int = 1) -> SweepRow:
    from mpcache.core_sm import messages as m
    from mpcache.core_sm.server import LookupServer

    codec = TraceCodec(keep_tokens=bool(head.get("keep_tokens")))
    recorded_config = codec.decode(head["config"])
    num_slots = int(size_gb * GiB) // recorded_config.slot_bytes
    if num_slots < 1:
        raise ValueError(f"{size_gb:g} GB holds no slot of {recorded_config.slot_bytes} bytes")
    config = attrs.evolve(recorded_config, num_slots=num_slots, l2_enabled=False, l2_probe=False,
                          write_behind=False)
    if recorded_config.l1_bytes:  # slots that follow the objects registered: cut this size's L1
        align = recorded_config.slot_align
        config = attrs.evolve(config, l1_bytes=int(size_gb * GiB) // align * align)
    server = LookupServer(config)
    row = SweepRow(size_gb, num_slots)
    counter = _HitCounter(row, config.chunk_size)
    ids: dict[int, int] = {}  # recorded transfer id -> replayed one
    stores: dict[int, Any] = {}  # replayed store transfer id -> its key
    written: set[tuple[str, bytes]] = set()  # (model, chunk hash) a committed store wrote
    answered: set[Any] = set()
    expected: set[Any] = set()
    l2_events = (m.L2ReadFinished, m.L2ProbeFinished, m.L2WriteFinished)
    for n, (now, event_json, recorded) in enumerate(records):
        event = codec.decode(event_json)
        if isinstance(event, l2_events):
            row.skipped += 1
            continue
        tid = getattr(event, "transfer_id", None)
        if isinstance(tid, int) and tid >= 0:
            if tid not in ids:
                row.skipped += 1
                continue
            event = attrs.evolve(event, transfer_id=ids.pop(tid))
        rt = getattr(event, "reply_to", None)
        if rt is not None and any(e.get("$") in ("Reply", "ErrorReply") for e in recorded if isinstance(e, dict)):
            expected.add(rt)
        counter.before(event)
        try:
            effects = server.handle(event, float(now))
        except Exception as exc:  # the machine must answer every event it is given
            row.violations.append(f"CRASH event {n} ({type(event).__name__}): {exc!r}")
            break
        for rec, got in zip(recorded, effects):
            rec_tid = _transfer_id(rec)
            got_tid = _transfer_id_of(got)
            if rec_tid is not None and got_tid is not None and rec_tid >= 0 and got_tid >= 0:
                ids[rec_tid] = got_tid
        for eff in effects:
            if not isinstance(eff, (Reply, ErrorReply)):
                continue
            if eff.reply_to in answered and eff.reply_to is not None:
                row.violations.append(f"F11 event {n}: a second reply to {eff.reply_to!r}")
            answered.add(eff.reply_to)
            if not isinstance(eff, Reply):
                continue
            result = eff.result
            if isinstance(result, m.TransferPlan) and result.ok and isinstance(event, m.PrepareStore):
                stores[result.transfer_id] = (event.key, result.placements)
            if isinstance(event, m.CommitTransfer) and event.transfer_id in stores:
                key, placements = stores.pop(event.transfer_id)
                if event.ok and getattr(result, "ok", False):
                    hashes = _hashes(key)
                    for chunk, _slot in placements:
                        if chunk < len(hashes):
                            written.add((key.model_name, hashes[chunk]))
        if isinstance(event, m.Clear) and event.force:
            written.clear()
        for msg in counter.after(effects, written):
            row.violations.append(f"event {n}: {msg}")
        if check_every and n % check_every == 0:
            try:
                server.check_invariants()
            except AssertionError as exc:
                row.violations.append(f"SAFETY event {n} ({type(event).__name__}): {exc}")
                break
    missing = expected - answered
    if missing and not row.violations:
        row.violations.append(f"F11 {len(missing)} request(s) answered in the recording, never in the replay")
    row.evictions = int(server.stats().get("evictions", 0))
    row.num_slots = server.index.num_slots  # as the registrations cut it
    return row


def _transfer_id(recorded: Any) -> int | None:
    if not isinstance(recorded, dict):
        return None
    if isinstance(recorded.get("transfer_id"), int):
        return int(recorded["transfer_id"])
    result = recorded.get("result")
    if isinstance(result, dict) and isinstance(result.get("transfer_id"), int):
        return int(result["transfer_id"])
    return None


def _transfer_id_of(effect: Any) -> int | None:
    tid = getattr(effect, "transfer_id", None)
    if isinstance(tid, int):
        return tid
    tid = getattr(getattr(effect, "result", None), "transfer_id", None)
    return tid if isinstance(tid, int) else None


def _hashes(key: Any) -> tuple[bytes, ...]:
    tokens = key.token_ids
    return tokens.hashes if isinstance(tokens, PrehashedTokens) else ()


class _HitCounter:
    """Counts each lookup's first resolved answer (in chunks) into ``row``: the count in its ack
    (``Lookup.answer_in_ack``) or in the first status reply that resolves it."""

    def __init__(self, row: SweepRow, chunk_size: int) -> None:
        self.row = row
        self.chunk_size = chunk_size
        self.open: dict[str, Any] = {}  # request id -> its lookup's key, until a count answers
        self.queries: dict[Any, str] = {}  # status query reply_to -> request id

    def before(self, event: Any) -> None:
        from mpcache.core_sm import messages as m

        if isinstance(event, m.Lookup):
            self.open[event.key.request_id] = event.key
            if event.answer_in_ack:  # its ack may carry the count (an int), else a status query will
                self.queries[event.reply_to] = event.key.request_id
        elif isinstance(event, (m.QueryPrefetchStatus, m.WaitPrefetchStatus)) and event.request_id in self.open:
            self.queries[event.reply_to] = event.request_id

    def after(self, effects: Sequence[Any], written: set[tuple[str, bytes]] | None = None) -> list[str]:
        problems: list[str] = []
        for eff in effects:
            rid = self.queries.pop(getattr(eff, "reply_to", None), None) if hasattr(eff, "result") else None
            if rid is None or not isinstance(eff.result, int) or isinstance(eff.result, bool):
                continue
            key = self.open.pop(rid, None)
            if key is None:
                continue
            asked = max(0, key.end // self.chunk_size - key.start // self.chunk_size)
            hit = eff.result
            if hit > asked:
                problems.append(f"lookup {rid} answered {hit} chunks of {asked} asked")
            if written is not None:
                hashes = _hashes(key)
                first = key.start // self.chunk_size
                for c in range(first, min(first + hit, len(hashes))):
                    if (key.model_name, hashes[c]) not in written:
                        problems.append(f"HIT lookup {rid} hit chunk {c}, which no store of this replay wrote")
                        break
            tokens = max(0, key.end - key.start)
            self.row.lookups += 1
            self.row.chunks_asked += asked
            self.row.chunks_hit += min(hit, asked)
            self.row.tokens_asked += tokens
            self.row.tokens_hit += min(hit * self.chunk_size, tokens)
        return problems


def table(rows: Sequence[SweepRow], recorded: SweepRow | None = None) -> str:
    lines = [f"{'L1 size':>10}  {'slots':>7}  {'lookups':>7}  {'token hit':>9}  {'chunk hit':>9}  "
             f"{'evictions':>9}  {'skipped':>7}  oracles"]
    for r in rows:
        lines.append(f"{r.size_gb:>8.4g}GB  {r.num_slots:>7}  {r.lookups:>7}  {100 * r.token_hit_rate:>8.1f}%  "
                     f"{100 * r.chunk_hit_rate:>8.1f}%  {r.evictions:>9}  {r.skipped:>7}  "
                     f"{'ok' if not r.violations else f'{len(r.violations)} VIOLATION(S)'}")
    if recorded is not None:
        lines.append(f"{recorded.size_gb:>8.4g}GB  {recorded.num_slots:>7}  {recorded.lookups:>7}  "
                     f"{100 * recorded.token_hit_rate:>8.1f}%  {100 * recorded.chunk_hit_rate:>8.1f}%  "
                     f"{'-':>9}  {'-':>7}  (recorded: what the live server answered)")
    return "\n".join(lines)


def figure(rows: Sequence[SweepRow], recorded: SweepRow | None = None, source: str = "") -> Any:
    """Token and chunk hit rate vs L1 size as a matplotlib Figure (`plot.save` writes it); the
    recorded run is a star at its own size. Sizes usually double, so x is logarithmic (base 2)
    when they span 4x or more, with a tick at every size swept."""
    from mpcache.sim.plot import pyplot, wrap

    if not rows:
        raise ValueError("nothing to plot")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = [r.size_gb for r in rows]
    ax.plot(sizes, [100 * r.token_hit_rate for r in rows], "o-", label="token hit rate")
    ax.plot(sizes, [100 * r.chunk_hit_rate for r in rows], "s--", label="chunk hit rate", alpha=0.7)
    if recorded is not None:
        ax.plot([recorded.size_gb], [100 * recorded.token_hit_rate], "*", ms=14, color="#c00",
                label=f"recorded: the live server at {recorded.size_gb:g} GB")
    for r in rows:
        if r.violations:
            ax.annotate(f"{len(r.violations)} violation(s)", (r.size_gb, 100 * r.token_hit_rate),
                        textcoords="offset points", xytext=(0, 8), ha="center", color="#c00", fontsize=8)
    if max(sizes) >= 4 * min(sizes):
        ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [f"{s:g}" for s in sizes], rotation=30 if len(sizes) > 6 else 0)
    ax.minorticks_off()
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("L1 size (GB)")
    ax.set_ylabel("hit rate (%) of the lookups in the trace")
    title = "mpcache-sim sweep: hit rate vs L1 size" + (f" ({source})" if source else "")
    ax.set_title(wrap(title, 70), fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    return fig


def parse_sizes(text: str) -> list[float]:
    try:
        sizes = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--l1-size-gb {text!r}: not a comma-separated list of numbers") from None
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"--l1-size-gb {text!r}: sizes must be positive")
    return sorted(set(sizes))


def main_sweep(args: Any) -> int:
    """``mpcache-sim sweep``: exit 1 if a size broke an oracle, 2 on a bad argument or file."""
    if args.plot:
        from mpcache.sim.plot import MatplotlibMissing, require

        try:
            require(args.plot)
        except MatplotlibMissing as exc:
            print(f"mpcache-sim sweep: {exc}")
            return 2
    try:
        sizes = parse_sizes(args.l1_size_gb)
        head, records = read_trace(args.file)
        if head.get("part", 0):
            print(f"note: part {head['part']} of a rotated trace starts mid-run: its first requests may miss")
        rows = sweep(head, records, sizes)
    except (OSError, ValueError) as exc:
        print(f"mpcache-sim sweep: {exc}")
        return 2
    recorded = recorded_hit_rate(head, records)
    print(table(rows, recorded))
    for r in rows:
        for v in r.violations[:5]:
            print(f"  {r.size_gb:g}GB: {v}")
    if args.plot:
        from mpcache.sim.plot import save

        save(figure(rows, recorded, os.path.basename(args.file)), args.plot)
        print(f"plot of hit rate vs L1 size ({', '.join(f'{r.size_gb:g}' for r in rows)} GB) written to {args.plot}")
    return 1 if any(r.violations for r in rows) else 0
