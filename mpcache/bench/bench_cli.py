"""`mpcache-bench NAME [args]`: runs the benchmark module `mpcache/bench/bench_NAME.py` (its `main(argv)`).

Each benchmark prints a table; results worth keeping go in docs/benchmarks.md.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

import mpcache.bench as bench

# A third-party module a benchmark may need -> the extra of pyproject.toml that installs it (a
# server-only install has none of them; tests/packaging/test_extras.py checks the names).
EXTRA_OF = {"trio": "sim", "hypothesis": "sim", "matplotlib": "plot", "torch": "vllm", "redis": "redis",
            "numba_cuda": "cuda"}


def available() -> list[str]:
    return sorted(
        m.name[len("bench_"):]
        for m in pkgutil.iter_modules(bench.__path__)
        if m.name.startswith("bench_") and m.name != "bench_cli"
    )


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    names = available()
    if args[:1] == ["--version"]:
        from mpcache.runtime_zmq.config import version

        print(f"mpcache-bench {version()}")
        return 0
    if not args or args[0] in ("-h", "--help"):
        print("usage: mpcache-bench {all|" + "|".join(names) + "} [args...]")
        print("each benchmark prints a results table; see docs/benchmarks.md")
        return 0 if args else 2
    name, rest = args[0].replace("-", "_"), args[1:]  # `mpcache-bench gpu-server` runs mpcache/bench/bench_gpu_server.py
    if name == "all":
        if {"-h", "--help"} & set(rest):
            print("usage: mpcache-bench all [args...]")
            print(f"runs every benchmark in turn ({', '.join(names)}), passing each the same args;")
            print("exit status: nonzero if any benchmark failed. Help for one: mpcache-bench NAME --help")
            return 0
        rc = 0
        for n in names:
            print(f"== mpcache-bench {n}", flush=True)
            rc |= _run(n, rest)
        return rc
    if name not in names:
        print(f"mpcache-bench: unknown benchmark {name!r}; choose from: {', '.join(names)}", file=sys.stderr)
        return 2
    return _run(name, rest)


def _run(name: str, argv: list[str]) -> int:
    try:
        module = importlib.import_module(f"mpcache.bench.bench_{name}")
        return int(module.main(argv) or 0)
    except ModuleNotFoundError as e:
        extra = EXTRA_OF.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"mpcache-bench {name}: needs the `{extra}` extra (no module {e.name!r}): pip install 'mpcache[{extra}]'",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
