"""core_sm.trace's codec for the client machines' recordings: their messages round-trip, a name
two modules use is told apart, and an object a link carries opaquely keeps one number."""
from __future__ import annotations

from concurrent.futures import Future

import pytest

from mpcache.core_sm.effects import Reply as ServerReply
from mpcache.core_sm.health import Connected
from mpcache.core_sm.planner_ops import MatchRequest, ScheduledRequest, StepScheduled
from mpcache.core_sm.server_link import SERVER, Completed, Reply, Role, Submit
from mpcache.core_sm.trace import Opaque, OpaqueNumbers, TraceCodec


def test_the_client_machines_messages_round_trip() -> None:
    codec = TraceCodec(keep_tokens=True)
    for value in (MatchRequest("r", (1, 2, 3), 3, 0), StepScheduled((ScheduledRequest("r", 0, 3, (1,), True),)),
                  Connected(SERVER), Reply(7, True, {"epoch": "e1", "chunk": 2})):
        assert codec.decode(codec.encode(value)) == value
    # a decoded reply's lists come back as tuples: they encode as the lists they were
    reply = Reply(7, True, {"chunks": [1, 2]})
    assert codec.encode(codec.decode(codec.encode(reply))) == codec.encode(reply)
    # the server trace's Reply keeps its name (format 1); the link's is told apart
    assert codec.encode(Reply(1, True))["$"] == "server_link.Reply"
    assert codec.encode(ServerReply(("c", 1), 2))["$"] == "Reply"


def test_an_opaque_object_keeps_its_number_and_replays_as_it() -> None:
    with pytest.raises(TypeError):
        TraceCodec().encode(Submit(Future(), object()))
    codec = TraceCodec(opaque=OpaqueNumbers())
    token, frames = Future(), object()
    submit = codec.encode(Submit(token, frames, 5.0, Role.REQUEST))
    done = codec.encode(Completed(token, None))
    assert submit["token"] == done["token"] == {"o": 0} and submit["request"] == {"o": 1}
    assert codec.encode(Completed(Future(), None))["token"] == {"o": 2}  # another object, another number
    replayed = TraceCodec().decode(submit)
    assert replayed.token == Opaque(0) and TraceCodec().encode(replayed) == submit
