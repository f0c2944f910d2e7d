"""docs/protocol.md's tables of error kinds and limits, generated from the code.

    python -m mpcache.runtime_zmq.protocol_doc docs/protocol.md    # rewrite the tables in place
    python -m mpcache.runtime_zmq.protocol_doc                     # print them

The rest of docs/protocol.md is prose; each generated table sits between ``<!-- BEGIN
GENERATED: NAME -->`` and ``<!-- END GENERATED: NAME -->``, and tests/runtime_zmq/test_docs_protocol.py
checks that what is there is what this module renders. The values come from where the server
takes them: ``core_sm.errors.ErrorKind`` (every member, by its wire name), the defaults of
``mpcache-server``'s limit flags (``runtime_zmq.cli``), ``wire.Limits`` for the bounds without a
flag, core_sm's key-field bounds, and the factor the server sets ZMQ's ``MAXMSGSIZE`` to. A
member or field added without a sentence here makes the render fail, so the doc cannot go
quietly stale.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
from collections.abc import Callable

import attrs

from mpcache.core_sm import chunks, keys
from mpcache.core_sm.errors import ErrorKind
from mpcache.runtime_zmq import wire

# when each kind is answered (the client-side ones are never on the wire)
WHEN: dict[ErrorKind, str] = {
    ErrorKind.UNKNOWN_OP: "op name or id not served (LMCache ids mpcache does not serve are named in the message)",
    ErrorKind.BAD_ARITY: "wrong number of payload frames, or no op frame at all",
    ErrorKind.UNDECODABLE: "a frame is not msgpack, or a payload has the wrong type / missing key fields",
    ErrorKind.VALIDATION: "a value out of range: bad `cache_salt`, token id outside uint32, misaligned or inverted "
    "range, … (core_sm)",
    ErrorKind.TOO_LARGE: "a frame, a message, a key's tokens or another count over its limit (below), or an "
    "object larger than a slot",
    ErrorKind.NOT_REGISTERED: "store/retrieve/prepare for an instance that is not registered",
    ErrorKind.NOT_READABLE: "an object of the range is missing or being written (where a typed error is used "
    "instead of `ok=false`)",
    ErrorKind.OUT_OF_MEMORY: "no L1 slot could be freed for a reservation",
    ErrorKind.UNKNOWN_TRANSFER: "a commit for a transfer id the server does not hold (never prepared, committed, "
    "or expired)",
    ErrorKind.TIMEOUT: "a `store`, `retrieve` or `prepare_store` handled after its `not_after` (below): nothing "
    "was reserved, leased or copied. Client side: no reply within the request's timeout",
    ErrorKind.UNHEALTHY: "client side only: the heartbeat declared the server gone; every pending request fails "
    "at that moment",
    ErrorKind.NOT_SENT: "client side only: the request could not be sent (no connection to the server, or its "
    "queue full); the server never saw it",
    ErrorKind.INTERNAL: "a bug: the server caught an exception; it keeps serving",
    ErrorKind.SHUTTING_DOWN: "the server stopped before it could answer (SIGTERM)",
    ErrorKind.FORBIDDEN: "the request names state (a request id, lease, plan, transfer) another instance or "
    "connection owns, or needs the admin credential (`clear`); nothing changed",
    ErrorKind.ILLEGAL_STATE: "the request is not allowed in the state of what it addresses; nothing changed",
}

# the server's limit flags: (flag, unit of the flag's value, what it bounds)
FLAGS = (
    ("--max-frame-mb", "MiB", "one payload frame"),
    ("--max-message-mb", "MiB", "one request, all its frames (counted as they are read)"),
    ("--max-tokens", "tokens", "token ids in one key"),
)
# wire.Limits fields without a flag: what each bounds (the fields the flags set are left out)
FIELDS = {
    "max_frames": "payload frames in one request",
    "max_list_tokens": "token ids sent as a msgpack list (the packed bin form is bounded by `--max-tokens` only)",
    "max_block_ids": "block ids in one `store` / `retrieve`",
    "max_name_bytes": "model name, request id (UTF-8 bytes)",
    "max_salt_bytes": "`cache_salt` on the wire (UTF-8 bytes), before core_sm's own bound below",
    "max_world_size": "a key's `world_size`, `num_kv_readers` and `tp_size`",
    "max_chunk_ranks": "chunks a key covers times the ranks it names",
    "max_deadline_s": "seconds a `not_after` may lie past the server's clock (further is clamped to it)",
    "max_containers": "maps and arrays in one payload frame",
    "max_layout_bytes": "the bytes of a `register_instance` layout",
}
NOT_LIMITS = {"max_frame_bytes", "max_message_bytes", "max_tokens", "chunk_size"}
# core_sm's bounds on key fields: (constant, field, unit)
KEY_BOUNDS = (
    (chunks, "MAX_CACHE_SALT_LEN", "`cache_salt`", "characters"),
    (keys, "MAX_IDENTITY_LEN", "`key_identity`", "characters"),
    (keys, "MAX_CHUNK_EXTRA_LEN", "each `chunk_extras` entry", "bytes"),
)


def _n(value: float) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def _bytes(n: int) -> str:
    return f"{n:,} B ({n / (1 << 20):g} MiB)" if n >= 1 << 20 else f"{n:,} B"


def maxmsgsize_factor() -> int:
    """The multiple of the frame limit the server sets ZMQ's MAXMSGSIZE to, read from the call
    in ``Server`` (so that a change there changes the doc, or fails its test)."""
    source = pathlib.Path(__file__).with_name("server.py").read_text(encoding="utf-8")  # not imported: heavy
    m = re.search(r"zmq\.MAXMSGSIZE,\s*(\d+)\s*\*\s*self\.limits\.max_frame_bytes\)", source)
    if m is None:
        raise LookupError("runtime_zmq/server.py no longer sets MAXMSGSIZE to N * max_frame_bytes: update protocol_doc")
    return int(m.group(1))


def render_error_kinds() -> str:
    missing = [k.name for k in ErrorKind if k not in WHEN]
    if missing:
        raise LookupError(f"ErrorKind members without a sentence in protocol_doc.WHEN: {', '.join(missing)}")
    lines = ["| kind | when |", "|---|---|"]
    lines += [f"| `{k.value}` | {WHEN[k]} |" for k in ErrorKind]
    return "\n".join(lines)


def render_limits() -> str:
    from mpcache.runtime_zmq import cli

    actions = {a.option_strings[0]: a for a in cli.build_parser()._actions if a.option_strings}
    defaults = {f.name: f.default for f in attrs.fields(wire.Limits)}
    unknown = sorted(set(defaults) - set(FIELDS) - NOT_LIMITS)
    if unknown:
        raise LookupError(f"wire.Limits fields without a sentence in protocol_doc.FIELDS: {', '.join(unknown)}")
    lines = ["| limit | default | bounds |", "|---|---|---|"]
    for flag, unit, what in FLAGS:
        action: argparse.Action = actions[flag]
        lines.append(f"| `{flag}` | {_n(action.default)} {unit} | {what} |")
    frame = int(actions["--max-frame-mb"].default * (1 << 20))
    factor = maxmsgsize_factor()
    lines.append(f"| ZMQ `MAXMSGSIZE` | {factor} × `--max-frame-mb` = {_bytes(factor * frame)} | one frame, checked by "
                 "ZMQ before the server reads it: a peer sending a larger one is disconnected, with no reply |")
    for name, what in FIELDS.items():
        value = defaults[name]
        assert isinstance(value, (int, float)), name
        shown = _bytes(int(value)) if name.endswith("_bytes") else _n(value)
        lines.append(f"| `wire.Limits.{name}` (fixed) | {shown} | {what} |")
    for module, const, field, unit in KEY_BOUNDS:
        lines.append(f"| `{module.__name__.rsplit('.', 1)[-1]}.{const}` (fixed) | {_n(getattr(module, const))} {unit} | {field} |")
    return "\n".join(lines)


TABLES: dict[str, Callable[[], str]] = {"error kinds": render_error_kinds, "limits": render_limits}


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- BEGIN GENERATED: {name} (python -m mpcache.runtime_zmq.protocol_doc docs/protocol.md) -->\n", \
        f"\n<!-- END GENERATED: {name} -->"


def embedded(doc: str, name: str) -> str:
    """The text between ``name``'s markers in ``doc`` (LookupError when they are missing)."""
    begin, end = _markers(name)
    if begin not in doc or end not in doc:
        raise LookupError(f"docs/protocol.md has no generated {name!r} table markers")
    return doc[doc.index(begin) + len(begin):doc.index(end)]


def rewrite(doc: str) -> str:
    """``doc`` with every generated table replaced by its render."""
    for name, render in TABLES.items():
        begin, _ = _markers(name)
        old = embedded(doc, name)
        start = doc.index(begin) + len(begin)
        doc = doc[:start] + render() + doc[start + len(old):]
    return doc


def main(argv: list[str]) -> int:
    if not argv:
        for name, render in TABLES.items():
            sys.stdout.write(f"{name}:\n\n{render()}\n\n")
        return 0
    path = argv[0]
    with open(path, encoding="utf-8") as f:
        doc = f.read()
    new = rewrite(doc)
    if new != doc:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return 0


if __name__ == "__main__":
    # through the imported module, as config.py does: one copy of the tables
    from mpcache.runtime_zmq import protocol_doc as _self

    sys.exit(_self.main(sys.argv[1:]))
