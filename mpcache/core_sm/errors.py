"""Typed protocol errors.

Illegal input never raises out of a machine's ``handle``: the machine returns an
``ErrorReply(reply_to, ProtocolError(kind, message))`` effect, which the runtime encodes as
the error frame of the reply. ``ErrorKind`` values are stable names on the wire (the runtime
sends ``kind.value``); add members, never rename or reuse them.
"""
from __future__ import annotations

import enum

import attrs


class ErrorKind(enum.Enum):
    """Why a request was refused. The value is the wire name."""

    UNKNOWN_OP = "unknown_op"  # the runtime could not map the op to a request type
    BAD_ARITY = "bad_arity"  # wrong number of payload frames
    UNDECODABLE = "undecodable"  # a payload that does not decode / build the request
    VALIDATION = "validation"  # a field out of range: alignment, cache_salt, worker_id...
    TOO_LARGE = "too_large"  # object bigger than an L1 slot, too many waiters
    NOT_REGISTERED = "not_registered"  # STORE/RETRIEVE for an unknown instance
    NOT_READABLE = "not_readable"  # an object of the range is missing or being written
    OUT_OF_MEMORY = "out_of_memory"  # no L1 slot could be freed for a reservation
    UNKNOWN_TRANSFER = "unknown_transfer"  # COMMIT for a transfer id the server does not hold
    TIMEOUT = "timeout"  # a client gave up waiting (client-side only)
    UNHEALTHY = "unhealthy"  # the client marked the server unhealthy (client-side only)
    NOT_SENT = "not_sent"  # the transport would not take it (no connection): the server never saw it (client-side only)
    INTERNAL = "internal"  # a bug: the runtime caught an exception it should not have seen
    SHUTTING_DOWN = "shutting_down"  # the server is closing: the request was not handled
    FORBIDDEN = "forbidden"  # the request names state another instance/connection owns, or needs admin
    ILLEGAL_STATE = "illegal_state"  # the request is not allowed in the state of what it addresses


@attrs.frozen
class ProtocolError:
    """One refusal: what kind, and a message for humans (never parsed)."""

    kind: ErrorKind = attrs.field(validator=attrs.validators.instance_of(ErrorKind))
    message: str = attrs.field(default="", validator=attrs.validators.instance_of(str))


def refusal(kind: str, message: str) -> ProtocolError:
    """A failed request's error as the protocol machines take it, from the kind its transport
    named -- the server's refusal or the link's own verdict (``timeout``, ``unhealthy``,
    ``not_sent``): a kind mpcache does not know is ``INTERNAL``."""
    try:
        return ProtocolError(ErrorKind(kind), message)
    except ValueError:
        return ProtocolError(ErrorKind.INTERNAL, message)
