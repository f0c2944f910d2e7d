"""`mpcache-server`: placeholder until the runtime_zmq issue lands."""
import sys


def main(argv: list[str] | None = None) -> int:
    print("mpcache-server: not implemented yet (delivered by the runtime_zmq issue)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
