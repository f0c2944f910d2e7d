"""`mpcache-bench`: placeholder; each benchmark arrives with its issue."""
import sys


def main(argv: list[str] | None = None) -> int:
    print("mpcache-bench: not implemented yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
