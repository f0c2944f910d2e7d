"""`mpcache-sim`: placeholder until the simulator issue lands."""
import sys


def main(argv: list[str] | None = None) -> int:
    print("mpcache-sim: not implemented yet (delivered by the simulator issue)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
