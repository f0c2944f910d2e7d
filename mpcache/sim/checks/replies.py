"""F11: every request handled gets exactly one reply.

A pure judgement (see ``mpcache.sim.checks``): shared by the random simulator and the explorer."""
from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from typing import Any

from mpcache.core_sm.effects import ErrorReply, Reply
from mpcache.sim.checks.finding import Finding
from mpcache.sim.trace import short

# Replies to requests whose answer may legitimately come later than the handling event.
DEFERRED_REPLIES = ("Store", "Retrieve", "WaitPrefetchStatus", "CommitTransfer", "RegisterInstance")


def reply_accounting(awaiting: MutableMapping[Any, Any], event: Any, via: Any, effects: Iterable[Any],
                     deferred: Iterable[str] = DEFERRED_REPLIES) -> Finding | None:
    """F11: every request handled gets exactly one reply. ``awaiting`` maps the reply_to of each
    request handled and not yet answered (this incarnation) to anything; ``via`` is the event's
    reply_to when it is a request the oracle counts (already entered in ``awaiting``), else None.
    Entries answered are removed."""
    for effect in effects:
        t = type(effect)
        if t is Reply or t is ErrorReply:
            if effect.reply_to not in awaiting:
                return "F11", f"second reply to one request: {short(effect)}"
            del awaiting[effect.reply_to]
    if via is not None and via in awaiting and type(event).__name__ not in deferred:
        return "F11", f"{short(event, 120)} handled without a reply"
    return None
