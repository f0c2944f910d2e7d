"""`mpcache-sim`: run seeds, replay one, list profiles, check determinism.

    mpcache-sim run --seeds N [--start S] [--profile P] [--jobs K]
    mpcache-sim replay SEED [--profile P] [--request ID] [--width N] [--chart FILE.svg] [--quiet]
    mpcache-sim replay --tape FILE [--in-explorer]
    mpcache-sim explore [--world ci] [--engines E --servers S --faults F ...] [--profile P] [--tape FILE]
    mpcache-sim list-profiles
    mpcache-sim profiles --seeds N [--jobs K] [--profile P ...]
    mpcache-sim check-determinism [--seeds N] [--profile P]
    mpcache-sim fleet --seeds N [--servers S] [--engines E] [--tier-nodes T]
    mpcache-sim sweep TRACE --l1-size-gb 1,2,4,8 [--plot OUT.png]

`run` exits 1 if any seed found a violation and prints, per failing seed, its reason and the
one command that replays it.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import textwrap
import time
from collections import Counter
from typing import Any, TextIO

try:  # the `sim` extra: without it (a server-only install) one line, not trio's traceback
    import trio  # noqa: F401
except ModuleNotFoundError as _missing:
    sys.stderr.write(f"mpcache-sim: needs the `sim` extra (no module {_missing.name!r}): pip install 'mpcache[sim]'\n")
    raise SystemExit(2) from None

from mpcache.sim.oracles import FAILURES, is_known_race
from mpcache.sim.plot import output_path
from mpcache.sim.profiles import PROFILES, get_profile
from mpcache.sim.runner import SeedResult, run_many, run_scenario
from mpcache.sim.scenario import draw_scenario


def _clock(seconds: float) -> str:
    seconds = max(0, round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60:02d}:{rest % 60:02d}"


class Progress:
    """Seeds done out of `total` on stderr, with the failing count, the rate and the time left.

    tqdm draws it when it is importable; a server-only install has no tqdm, and then one line is
    redrawn in place (at most every 0.2 s, and at the end)."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total, self.stream = total, stream
        self.done = self.failing = 0
        self.started = self.drawn = time.perf_counter()
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar: Any = None
        else:
            self.bar = tqdm(total=total, unit="seed", file=stream, dynamic_ncols=True)

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failing += not ok
        if self.bar is not None:
            self.bar.set_postfix(failing=self.failing, refresh=False)
            self.bar.update(1)
            return
        now = time.perf_counter()
        if self.done == 1 or self.done == self.total or now - self.drawn >= 0.2:
            self.drawn = now
            self.stream.write("\r" + self.line(now))
            self.stream.flush()

    def line(self, now: float) -> str:
        width = 30
        filled = width * self.done // max(self.total, 1)
        elapsed = max(now - self.started, 1e-9)
        rate = self.done / elapsed
        left = (self.total - self.done) / rate if self.done else 0.0
        return (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} seeds  {self.failing} failing  "
                f"{rate:.1f} seeds/s  elapsed {_clock(elapsed)}  ETA {_clock(left)}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            self.stream.write("\n")
            self.stream.flush()


def table(rows: list[tuple[str, str]]) -> str:
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


def cmd_run(args: argparse.Namespace) -> int:
    get_profile(args.profile)
    seeds = list(range(args.start, args.start + args.seeds))
    started = time.perf_counter()
    failing: list[SeedResult] = []
    progress = Progress(len(seeds), sys.stderr) if sys.stderr.isatty() or args.progress else None

    def on_result(r: SeedResult) -> None:
        if not r.ok:
            failing.append(r)
        if progress is not None:
            progress.update(r.ok)

    results = run_many(seeds, args.profile, jobs=args.jobs, on_result=on_result)
    if progress is not None:
        progress.close()
    wall = time.perf_counter() - started
    events = sum(r.events for r in results)
    virtual = sum(r.virtual_time for r in results)
    cpu = sum(r.cpu_time for r in results)
    kinds = Counter(r.violation.code for r in results if r.violation is not None)
    rows = [
        ("profile", args.profile),
        ("seeds", f"{len(results)} ({args.start}..{args.start + len(results) - 1})"),
        ("passed / failed", f"{len(results) - len(failing)} / {len(failing)}"),
        ("events handled", f"{events} ({events / max(len(results), 1):.0f} per seed)"),
        ("virtual time", f"{virtual:.1f} s ({virtual / max(len(results), 1):.1f} s per seed)"),
        ("wall time", f"{wall:.2f} s with {args.jobs} job(s) = {len(results) / wall:.1f} seeds/s"),
        ("CPU time", f"{cpu:.1f} s ({len(results) / max(cpu, 1e-9):.1f} seeds per CPU-second)"),
        ("virtual : real", f"{virtual / max(cpu, 1e-9):.0f} : 1 (virtual s per CPU s)"),
    ]
    print(table(rows))
    if kinds:
        print("violations by kind:")
        print(table([(k, f"{n}  {FAILURES.get(k, '')}") for k, n in sorted(kinds.items())]))
    for r in sorted(failing, key=lambda r: r.seed)[: args.show]:
        assert r.violation is not None
        known = " [known core_sm race, see docs/simulator.md]" if is_known_race(r.violation) else ""
        print(f"seed {r.seed}: {r.violation.reason()[:400]}{known}")
        print(f"  replay: mpcache-sim replay {r.seed} --profile {args.profile} --chart seed{r.seed}.svg")
    if len(failing) > args.show:
        print(f"... and {len(failing) - args.show} more failing seeds")
    return 1 if failing else 0


_CUT_ITEM = re.compile(r"\.\.\., (?=[A-Z]\w*\()")  # trace.short cut an item here, brackets left open


def _split_effects(text: str) -> list[str]:
    """`[A(x, y), B()]` -> `["A(x, y)", "B()"]`: the top-level items of one effect list. An item
    the trace shortened ends in `...` with its brackets open; the next item starts after it."""
    inner = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    items, depth, quote, start, i = [], 0, "", 0, 0
    while i < len(inner):
        c = inner[i]
        cut = _CUT_ITEM.match(inner, i)
        if cut:
            items.append(inner[start:i + 3].strip())
            start = i = cut.end()
            depth, quote = 0, ""
            continue
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(inner[start:i].strip())
            start = i + 1
        i += 1
    if inner[start:].strip():
        items.append(inner[start:].strip())
    return items


def _cut(text: str, width: int) -> str:
    if width <= 0 or len(text) <= width:
        return text
    kept = max(width - 12, 20)  # room for " ...(+NNNNN)"
    return f"{text[:kept]} ...(+{len(text) - kept})"


def display_lines(line: str, width: int) -> list[str]:
    """One trace line as the terminal shows it: whole when it fits `width` (or width is 0); else
    the event on the first line and one effect per line below it, each cut to `width` with the
    count of characters left out. The trace itself (and its hash) is not changed."""
    if width <= 0 or len(line) <= width:
        return [line]
    head, arrow, effects = line.partition(" -> [")
    if not arrow:
        return [_cut(line, width)]
    indent = " " * 25  # under the event: 12 columns of time, node in 11, a space after each
    return [_cut(head, width)] + [_cut(f"{indent}-> {e}", width) for e in _split_effects("[" + effects)]


def mentions(request_id: str) -> re.Pattern[str]:
    """Matches a line that names `request_id` as a whole id (r7, not r70 or adv-r7)."""
    return re.compile(rf"(?<![\w-]){re.escape(request_id)}(?![\w-])")


def cmd_replay(args: argparse.Namespace) -> int:
    if args.tape:
        if args.in_explorer:
            return replay_tape_file(args.tape, args.quiet)
        return replay_tape_in_world(args.tape, args.quiet, args.width)
    if args.seed is None:
        print("mpcache-sim replay: give a SEED or --tape FILE", file=sys.stderr)
        return 2
    get_profile(args.profile)
    if args.chart:
        from mpcache.sim.plot import MatplotlibMissing, require

        try:
            require(args.chart)
        except MatplotlibMissing as exc:
            print(f"mpcache-sim replay: {exc}", file=sys.stderr)
            return 2
    result, world = run_scenario(draw_scenario(args.seed), args.profile, keep_lines=True, chart=bool(args.chart))
    violation = result.violation
    if not args.quiet:
        width = args.width if args.width is not None else shutil.get_terminal_size((160, 24)).columns
        print(f"# mpcache-sim replay {args.seed} --profile {args.profile}"
              + (f" --request {args.request}" if args.request else ""))
        print("\n".join(textwrap.wrap(f"# scenario: {world.scenario.config}", width or 10**9,
                                       subsequent_indent="#   ", break_on_hyphens=False)))
        # the violation's own trace line is the outcome printed below: say it once
        skip = f"{violation.t:12.6f} {violation.node:<11} VIOLATION {violation.reason()}" if violation else None
        wanted = mentions(args.request) if args.request else None
        shown = 0
        for line in result.lines:
            if line == skip or (wanted is not None and not wanted.search(line)):
                continue
            shown += 1
            for part in display_lines(line, width):
                print(part)
        if wanted is not None:
            print(f"# {shown} of {len(result.lines)} trace lines mention {args.request}")
    print(f"# events {result.events}  virtual time {result.virtual_time:.6f} s  trace hash {result.trace_hash}")
    if args.chart:
        from mpcache.sim.chart import figure, requests_in
        from mpcache.sim.plot import save

        rids = requests_in(violation.message) if violation is not None else set()
        if args.request:
            rids = {args.request}
        save(figure(world, rids or None), args.chart)
        print(f"# chart written to {args.chart}" + (f" (requests {', '.join(sorted(rids))})" if rids else ""))
    if violation is not None:
        print(f"VIOLATION {violation.reason()}  (at {violation.t:.6f} s on {violation.node})")
        return 1
    print("no violation")
    return 0


def _tape_outcome(violation: Any, recorded: str, same: str, differs: str, none: str) -> int:
    """Print a replayed tape's outcome against the code it recorded (``differs`` and ``none``
    name it with ``{recorded}``); exit 1 when it shows a violation."""
    if violation is None:
        print(f"no violation ({none.format(recorded=recorded)})")
        return 0
    said = same if violation.code == recorded else differs.format(recorded=recorded)
    print(f"VIOLATION {violation.reason()}  (at {violation.t:.6f} s on {violation.node}; {said})")
    return 1


def replay_tape_in_world(path: str, quiet: bool, width: int | None) -> int:
    """Run an explore tape's ``sim_world`` actions in the simulated world (``sim.World``, its
    engines and oracles); print the world's timeline and the violation; exit 1 when it shows."""
    from mpcache.sim.explore import load_tape, replay_world_tape

    tape = load_tape(path)
    if "sim_world" not in tape:
        print(f"mpcache-sim replay: {path} has no sim.World part (an older tape): replay it with --in-explorer",
              file=sys.stderr)
        return 2
    recorded = tape["violation"]["code"]
    violation, world = replay_world_tape(tape, get_profile(tape["profile"]))
    if not quiet:
        width = width if width is not None else shutil.get_terminal_size((160, 24)).columns
        print(f"# mpcache-sim replay --tape {path}  (in sim.World; profile {tape['profile']}, world "
              f"{tape['world']['name']}, {len(tape['sim_world']['actions'])} actions)")
        skip = f"{violation.t:12.6f} {violation.node:<11} VIOLATION {violation.reason()}" if violation else None
        for line in world.trace.lines:
            if line != skip:
                for part in display_lines(line, width):
                    print(part)
    return _tape_outcome(violation, recorded, "the explorer's", "NOT the explorer's {recorded}",
                         "the explorer recorded {recorded}")


def replay_tape_file(path: str, quiet: bool) -> int:
    """Run an explore tape again on the explorer's fresh machines; exit 1 when it shows its violation."""
    from mpcache.sim.explore import load_tape, replay_tape

    tape = load_tape(path)
    violation, lines = replay_tape(tape, get_profile(tape["profile"]))
    recorded = tape["violation"]["code"]
    if not quiet:
        print(f"# mpcache-sim replay --tape {path}  (profile {tape['profile']}, world {tape['world']['name']}, "
              f"{len(tape['actions'])} actions)")
        for line in lines:
            print(line)
    return _tape_outcome(violation, recorded, "the recorded one", "NOT the recorded {recorded}",
                         "the tape recorded {recorded}")


def cmd_explore(args: argparse.Namespace) -> int:
    """Explore every interleaving of small worlds; exit 1 on a violation or an incomplete search."""
    import attrs

    from mpcache.sim.explore import PROFILE_WORLDS, WORLDS, Explorer, XWorld, report, report_coverage, save_tape

    profile = get_profile(args.profile)
    custom = {k: getattr(args, k) for k in ("engines", "servers", "requests", "faults", "restarts", "aborts", "crashes")
              if getattr(args, k) is not None}
    if args.world is not None:
        if args.world not in WORLDS:
            print(f"mpcache-sim explore: unknown world {args.world!r}; choose from: {', '.join(WORLDS)}",
                  file=sys.stderr)
            return 2
        worlds = [attrs.evolve(w, **custom) for w in WORLDS[args.world]]
    elif args.profile in PROFILE_WORLDS and not custom:
        worlds = [PROFILE_WORLDS[args.profile]]
    elif custom:
        worlds = [XWorld("custom", **custom)]
    else:
        worlds = WORLDS["ci"]
    status = 0
    for world in worlds:
        world = attrs.evolve(world, symmetry=not args.no_symmetry, **(
            {"max_states": args.max_states} if args.max_states else {}))
        progress = (lambda line: print(line, file=sys.stderr, flush=True)) if args.progress else None
        ex = Explorer(world, profile).run(dfs=args.dfs, progress=progress)
        report(ex)
        if ex.violation is not None:
            status = 1
            tape = args.tape or f"explore-{profile.name}-{world.name}.tape.json"
            save_tape(ex, tape)
            _v, lines = _replayed(ex, profile)
            for line in lines:
                print(f"    {line}")
            in_world = ex.tape()["sim_world"]
            shown = in_world["violation"]
            print(f"  in sim.World ({len(in_world['actions'])} actions): "
                  + (f"VIOLATION {shown['code']}" if shown else "no violation"))
            print(f"  tape saved: {tape}  (mpcache-sim replay --tape {tape}; --in-explorer: the explorer's machines)")
        elif not ex.complete:
            status = 1
        report_coverage(ex)
    return status


def _replayed(ex: Any, profile: Any) -> tuple[Any, list[str]]:
    from mpcache.sim.explore import replay_tape

    return replay_tape(ex.tape(), profile)


def cmd_list(args: argparse.Namespace) -> int:
    w = max(len(n) for n in PROFILES)
    for name, p in PROFILES.items():
        failure = f"[{p.failure}] " if p.failure else ""
        print(f"{name:<{w}}  {failure}{p.description}")
    return 0


def cmd_profiles(args: argparse.Namespace) -> int:
    """How strongly the seeds catch each legacy profile: per profile, the seeds whose violation
    carries the profile's F-code, the first of them, and the seeds that failed with another code."""
    from mpcache.sim.profiles import LEGACY

    names = args.profile or LEGACY
    for name in names:
        get_profile(name)
    seeds = list(range(args.start, args.start + args.seeds))
    started = time.perf_counter()
    rows = []
    thin = []
    for name in names:
        expected = PROFILES[name].failure
        t0 = time.perf_counter()
        results = run_many(seeds, name, jobs=args.jobs)
        caught = [r.seed for r in results if r.violation is not None and r.violation.code == expected]
        other = Counter(r.violation.code + ("*" if r.violation.code in PROFILES[name].also else "")
                        for r in results if r.violation is not None and r.violation.code != expected)
        share = len(caught) / max(len(seeds), 1)
        first = str(caught[0]) if caught else "-"
        if not caught or share < args.min_share:
            thin.append(name)
        rows.append((name, expected, f"{len(caught)}/{len(seeds)}", f"{100 * share:.1f}%", first,
                     ", ".join(f"{k} {n}" for k, n in sorted(other.items())) or "-",
                     f"{time.perf_counter() - t0:.1f}"))
    head = ("profile", "code", "caught", "share", "first", "other violations", "wall s")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(f"{str(c):<{w}}" for c, w in zip(r, widths)).rstrip())
    print(f"seeds {args.start}..{args.start + len(seeds) - 1}, {args.jobs} job(s), "
          f"wall {time.perf_counter() - started:.1f} s (*: a consequence the profile declares, Profile.also)")
    if thin:
        print(f"caught on fewer than {100 * args.min_share:g}% of seeds: {', '.join(thin)}")
    return 1 if thin else 0


def cmd_check_determinism(args: argparse.Namespace) -> int:
    from mpcache.sim.determinism import check

    seeds = list(range(args.start, args.start + args.seeds))
    found = check(seeds, args.profile)
    for d in found:
        print(d.describe())
    print(f"determinism: {len(seeds) - len(found)}/{len(seeds)} seeds give identical traces under another "
          f"PYTHONHASHSEED")
    return 1 if found else 0


def cmd_shrink(args: argparse.Namespace) -> int:
    """Let Hypothesis find and shrink a world that fails under a legacy profile; save it."""
    from hypothesis import HealthCheck, find, settings

    from mpcache.sim.corpus import CORPUS_DIR, to_json
    from mpcache.sim.strategies import scenarios

    profile = get_profile(args.profile)
    code = args.code or profile.failure

    def fails(scenario: object) -> bool:
        result, _ = run_scenario(scenario, args.profile)  # type: ignore[arg-type]
        return result.violation is not None and result.violation.code == code

    from hypothesis.errors import NoSuchExample

    from mpcache.sim.corpus import reduce_scenario

    try:
        if args.from_seeds:
            raise NoSuchExample("skipped")
        found = find(scenarios(), fails, settings=settings(
            max_examples=args.max_examples, deadline=None, database=None,
            suppress_health_check=list(HealthCheck)))
    except NoSuchExample:
        # Hypothesis's generator did not reach it: start from the first failing seed instead.
        seed = next((s for s in range(args.seeds) if fails(draw_scenario(s))), None)
        if seed is None:
            print(f"no failing world found ({args.max_examples} examples, {args.seeds} seeds)")
            return 1
        print(f"reducing seed {seed}")
        found = reduce_scenario(draw_scenario(seed), fails)
    result, _ = run_scenario(found, args.profile)
    assert result.violation is not None
    print(f"shrunk to {len(found.requests)} request(s), {len(found.faults)} fault(s), "
          f"{found.config.num_servers} server(s), {found.config.num_engines} engine(s): "
          f"{result.violation.reason()[:300]}")
    if args.save:
        CORPUS_DIR.mkdir(parents=True, exist_ok=True)
        path = CORPUS_DIR / f"{args.profile}.json"
        path.write_text(to_json(found, args.profile, code, result.violation.reason()[:300]) + "\n")
        print(f"saved {path}")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mpcache")
    except PackageNotFoundError:
        return "unknown"


def cmd_replay_trace(args: argparse.Namespace) -> int:
    """Feed the simulator's own server machine (the default profile's, built from the trace's
    ServerConfig) the recorded events at their times; any record whose effects differ from the
    recorded ones is a divergence, and so is an event after which one of the simulator's server
    oracles (core_sm's invariants, L1 bytes accounting) finds a fault."""
    from mpcache.core_sm.trace import replay
    from mpcache.sim import checks
    from mpcache.sim.profiles import PROFILES

    server_class = PROFILES["default"].server_class

    def judge(server: Any) -> str | None:
        finding = checks.core_invariants(server, "replayed") or checks.bytes_accounting(server)
        return None if finding is None else f"{finding[0]}: {finding[1]}"

    with open(args.file, encoding="utf-8") as f:
        head = json.loads(f.readline())
        if head.get("part", 0):
            print(f"note: part {head['part']} of a rotated trace starts mid-run: divergences are expected")
        t0 = time.perf_counter()
        chain_key = None
        if args.chunk_key_file:  # 64 hex digits, as mpcache-server's --chunk-key-file holds
            with open(args.chunk_key_file, encoding="ascii") as kf:
                chain_key = bytes.fromhex(kf.read().strip())
        try:
            count, divergences = replay(head, (json.loads(line) for line in f if line.strip()),
                                        chain_key=chain_key, make_server=server_class, judge=judge)
        except ValueError as e:
            print(f"cannot replay {args.file}: {e}")
            return 2
    print(f"replayed {count} events in {time.perf_counter() - t0:.2f} s: "
          f"{'no divergence' if not divergences else f'{len(divergences)} divergence(s)'}")
    for d in divergences:
        print(f"  event {d.index} ({d.event}):\n    recorded {json.dumps(d.recorded)[:300]}\n"
              f"    replayed {json.dumps(d.replayed)[:300]}")
    return 1 if divergences else 0


def cmd_replay_recording(args: argparse.Namespace) -> int:
    """Feed the connector's machines as the simulator builds them a production recording's
    events (MPCACHE_RECORD); exit 1 at the first step whose effects differ."""
    from mpcache.sim.prod_replay import report

    return report(args.file, args.profile)


def cmd_fleet(args: argparse.Namespace) -> int:
    """Seeds of a fleet world (sim/fleet.py): N servers x M engines over a cluster L2 tier."""
    from mpcache.sim.fleet import run_fleet_seed

    started = time.perf_counter()
    failing, totals = [], Counter()  # type: ignore[var-annotated]
    for seed in range(args.start, args.start + args.seeds):
        r = run_fleet_seed(seed, args.servers, args.engines, args.tier_nodes)
        totals.update(r.tier)
        if not r.ok:
            failing.append(r)
    n = args.seeds
    rows = [
        ("fleet", f"{args.servers} servers x {args.engines} engines, tier of {args.tier_nodes} nodes"),
        ("seeds", f"{n} ({args.start}..{args.start + n - 1})"),
        ("passed / failed", f"{n - len(failing)} / {len(failing)}"),
        ("tier faults", f"{totals['tier_crashes']} crashes ({totals['tier_objects_lost']} objects lost), "
                        f"{totals['tier_partitions']} partitions"),
        ("tier reads", f"{totals['tier_reads']} ({totals['tier_read_faults']} missed on a fault)"),
        ("tier probes", f"{totals['tier_probes']} ({totals['tier_probe_faults']} absent on a fault)"),
        ("tier writes", f"{totals['tier_writes']} ({totals['tier_write_faults']} failed on a fault)"),
        ("wall time", f"{time.perf_counter() - started:.2f} s"),
    ]
    print(table(rows))
    for r in failing[: args.show]:
        print(f"seed {r.seed}: {r.violation.reason()[:400]}")
    return 1 if failing else 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from mpcache.sim.sweep import main_sweep

    return main_sweep(args)


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1 (a count of seeds, jobs, servers)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def non_negative_int(text: str) -> int:
    """argparse type: a whole number of at least 0 (how many lines to print)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mpcache-sim", description="mpcache deterministic simulator")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("run", help="run many seeds; exit 1 on any violation",
                       description="Run many seeds; exit 1 on any violation, printing per failing seed its "
                                   "reason and the command that replays it.")
    p.add_argument("--seeds", type=positive_int, default=100, help="how many seeds to run (default: %(default)s)")
    p.add_argument("--start", type=int, default=0, help="first seed (default: %(default)s)")
    p.add_argument("--profile", default="default",
                   help="the honest world or a legacy-bug profile, see list-profiles (default: %(default)s)")
    p.add_argument("--jobs", type=positive_int, default=1, help="worker processes (default: %(default)s)")
    p.add_argument("--show", type=non_negative_int, default=10, help="failing seeds to print (default: %(default)s)")
    p.add_argument("--progress", action="store_true",
                   help="progress bar even when stderr is not a terminal (default: only on a terminal)")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("replay", help="replay one seed with its full trace",
                       description="Replay one seed: one line per event (virtual time, node, event -> effects), "
                                   "then the outcome; exit 1 on a violation.")
    p.add_argument("seed", type=int, nargs="?", help="the seed to replay")
    p.add_argument("--tape", metavar="FILE", help="replay a counterexample tape `mpcache-sim explore` saved "
                                                   "instead of a seed, in the simulated world (sim.World: its "
                                                   "engines, network and oracles; the default) or, with "
                                                   "--in-explorer, in the explorer's own machines")
    p.add_argument("--in-explorer", action="store_true",
                   help="with --tape: run the explorer's actions on its own machines instead of sim.World")
    p.add_argument("--profile", default="default", help="profile the seed ran under (default: %(default)s)")
    p.add_argument("--request", metavar="ID", help="only the events that mention this request id, e.g. r7 "
                                                  "(default: every event)")
    p.add_argument("--width", type=non_negative_int, default=None, metavar="COLUMNS",
                   help="cut trace lines at this many columns, one effect per line; 0: whole lines "
                        "(default: the terminal's width, or 160 when not a terminal)")
    p.add_argument("--chart", metavar="FILE", type=output_path,
                   help="draw the message-sequence chart of the violation's requests (or --request's) into "
                        "FILE.png, .svg or .pdf (needs matplotlib: pip install 'mpcache[plot]')")
    p.add_argument("--quiet", action="store_true", help="no trace lines, only the outcome")
    p.set_defaults(func=cmd_replay)
    p = sub.add_parser("explore", help="every interleaving of small worlds (bounded model checking); exit 1 "
                                       "on a violation or an incomplete search",
                       description="Explore every interleaving of small worlds over the production core_sm "
                                   "machines: deliver, drop, duplicate any frame in flight, fire timers, run each "
                                   "request's script, restart servers. Prints states, transitions, states/s, "
                                   "memory per state and the table rows never reached; a violation is printed "
                                   "as a timeline and saved as a tape for `replay --tape`.")
    p.add_argument("--world", default=None, help="a named set of worlds: ci, tiny, medium, large (default: ci, or "
                                                 "the profile's own world with --profile)")
    for name, what in (("engines", "engines"), ("servers", "servers"), ("requests", "requests per engine"),
                       ("faults", "drops + duplicates + slow frames in total"),
                       ("restarts", "server crash + restarts in total"),
                       ("aborts", "requests aborted while their lookup is pending"),
                       ("crashes", "engine crashes in total")):
        p.add_argument(f"--{name}", type=non_negative_int, default=None, help=f"{what} (default: the world's)")
    p.add_argument("--profile", default="default", help="the honest machines or a legacy-bug profile "
                                                      "(default: %(default)s)")
    p.add_argument("--dfs", action="store_true", help="depth first (default: breadth first, shortest traces)")
    p.add_argument("--max-states", type=positive_int, default=None, help="stop after this many distinct states")
    p.add_argument("--no-symmetry", action="store_true", help="no symmetry reduction over engines")
    p.add_argument("--tape", metavar="FILE", help="where to save a counterexample "
                                                  "(default: explore-PROFILE-WORLD.tape.json)")
    p.add_argument("--progress", action="store_true", help="a progress line every 10,000 states on stderr")
    p.set_defaults(func=cmd_explore)
    p = sub.add_parser("list-profiles", help="the default and the legacy-bug profiles")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("profiles", help="catch table: per legacy profile, how many seeds catch it with its "
                                        "F-code and the first that does; exit 1 if one is caught too rarely")
    p.add_argument("--seeds", type=positive_int, default=200, help="seeds per profile (default: %(default)s)")
    p.add_argument("--start", type=int, default=0, help="first seed (default: %(default)s)")
    p.add_argument("--jobs", type=positive_int, default=1, help="worker processes (default: %(default)s)")
    p.add_argument("--profile", action="append", help="only this legacy profile (repeatable; default: all of them)")
    p.add_argument("--min-share", type=float, default=0.0,
                   help="exit 1 if a profile is caught on fewer than this share of seeds (0..1; default: never caught)")
    p.set_defaults(func=cmd_profiles)
    p = sub.add_parser("check-determinism", help="same trace hash under another PYTHONHASHSEED")
    p.add_argument("--seeds", type=positive_int, default=20, help="how many seeds (default: %(default)s)")
    p.add_argument("--start", type=int, default=0, help="first seed (default: %(default)s)")
    p.add_argument("--profile", default="default", help="profile to run them under (default: %(default)s)")
    p.set_defaults(func=cmd_check_determinism)
    p = sub.add_parser("shrink", help="find + shrink a failing world for a legacy profile (Hypothesis)")
    p.add_argument("--profile", required=True, help="the legacy profile whose failure to find")
    p.add_argument("--code", help="violation code to look for (default: the profile's failure)")
    p.add_argument("--max-examples", type=positive_int, default=2000,
                   help="worlds Hypothesis may try (default: %(default)s)")
    p.add_argument("--seeds", type=positive_int, default=200,
                   help="seeds to try when Hypothesis finds nothing (default: %(default)s)")
    p.add_argument("--from-seeds", action="store_true", help="skip Hypothesis: reduce the first failing seed")
    p.add_argument("--save", action="store_true", help="write it to tests/sim/corpus/PROFILE.json")
    p.set_defaults(func=cmd_shrink)
    p = sub.add_parser("replay-trace", help="re-run the simulator's server machine on a trace from mpcache-server "
                                            "--trace, its oracles judging every event; exit 1 on a divergence")
    p.add_argument("file", help="the trace file mpcache-server --trace wrote")
    p.add_argument("--chunk-key-file", default=None, metavar="PATH",
                   help="the traced server's chunk key (needed for a --trace-tokens trace, which is hashed again)")
    p.set_defaults(func=cmd_replay_trace)
    p = sub.add_parser("replay-recording", help="replay a connector recording (MPCACHE_RECORD) through the "
                                                "simulator's client machines; exit 1 at the first step that differs")
    p.add_argument("file", help="the file MPCACHE_RECORD named (tools/record_production.py makes one)")
    p.add_argument("--profile", default="default", choices=sorted(PROFILES),
                   help="whose machines replay it (a legacy profile's differ)")
    p.set_defaults(func=cmd_replay_recording)
    p = sub.add_parser("fleet", help="seeds of a fleet: servers x engines over a cluster L2 tier with node "
                                     "crashes and partitions; exit 1 on any violation")
    p.add_argument("--seeds", type=positive_int, default=100, help="how many seeds to run (default: %(default)s)")
    p.add_argument("--start", type=int, default=0, help="first seed (default: %(default)s)")
    p.add_argument("--servers", type=positive_int, default=3, help="mpcache servers (default: %(default)s)")
    p.add_argument("--engines", type=positive_int, default=4, help="vLLM engines (default: %(default)s)")
    p.add_argument("--tier-nodes", type=positive_int, default=3,
                   help="nodes of the cluster L2 tier (default: %(default)s)")
    p.add_argument("--show", type=non_negative_int, default=10, help="failing seeds to print (default: %(default)s)")
    p.set_defaults(func=cmd_fleet)
    p = sub.add_parser("sweep", help="re-run a server trace at each L1 size: hit rate and evictions per size")
    p.add_argument("file", help="the trace file mpcache-server --trace wrote")
    p.add_argument("--l1-size-gb", required=True, help="comma-separated sizes, e.g. 1,2,4,8")
    p.add_argument("--plot", "--png", dest="plot", metavar="FILE", type=output_path,
                   help="plot hit rate vs L1 size into FILE.png, .svg or .pdf "
                        "(needs matplotlib: pip install 'mpcache[plot]')")
    p.set_defaults(func=cmd_sweep)
    p = sub.add_parser("trace-hits", help="hit rate of L1's eviction vs Belady and an infinite cache on "
                                          "Mooncake's published traces and synthetic Mooncake- and Bailian-shaped "
                                          "ones (mpcache.sim.trace_hits)")
    p.add_argument("--traces", default="mooncake,bailian",
                   help="synthetic shapes, comma-separated, or '' for none (default: %(default)s)")
    p.add_argument("--file", action="append", default=[], metavar="PATH",
                   help="a Mooncake-format trace (JSONL with hash_ids, .gz allowed), e.g. "
                        "data/traces/mooncake_conversation.jsonl.gz in the checkout; repeatable")
    p.add_argument("--requests", type=positive_int, default=1500, help="requests per trace (default: %(default)s)")
    p.add_argument("--capacities", default="0.02,0.05,0.2",
                   help="L1 sizes as fractions of a trace's distinct blocks (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.set_defaults(func=_cmd_trace_hits)
    return parser


def _cmd_trace_hits(args: argparse.Namespace) -> int:
    from mpcache.sim.trace_hits import TRACES, table

    names = [n for n in args.traces.split(",") if n]
    unknown = [n for n in names if n not in TRACES]
    if unknown:
        print(f"mpcache-sim trace-hits: unknown trace shape(s) {unknown}; known: {sorted(TRACES)}", file=sys.stderr)
        return 2
    try:
        rows = table(names, args.requests, [float(f) for f in args.capacities.split(",")], args.seed, args.file)
    except (OSError, ValueError) as e:
        print(f"mpcache-sim trace-hits: {e}", file=sys.stderr)
        return 2
    print("\n".join(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:  # `mpcache-sim replay N | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
