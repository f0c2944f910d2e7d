"""Instances and registrations: F13 missed restart, F19 live instance reaped, and the transport's
LIVENESS after not_registered (parked requests, refused resends).

A pure judgement (see ``mpcache.sim.checks``): shared by the random simulator and the explorer."""
from __future__ import annotations

from typing import Any

from mpcache.sim.checks.finding import Finding


def worker_unregistered(worker: str, instance_id: int, server: str, incarnation: int, reaped: bool) -> Finding:
    """F13 / F19: after quiescence a live worker is not registered with a server that is up -- a
    restart left it unknown there (F13), or the server reaped it and it never registered again
    (F19): its stores and retrieves are refused not_registered."""
    if reaped:
        return "F19", (f"{worker} (instance {instance_id}) was reaped by {server} and never registered again: "
                       f"its retrieves are refused not_registered forever")
    return "F13", (f"{worker} (instance {instance_id}) is not registered with {server} (incarnation "
                   f"{incarnation}) after heal: its stores and retrieves are refused not_registered")


def reaped_while_live(worker: str, instance_id: int, server: str, seen: float | None, ttl: float | None,
                      now: float) -> Finding | None:
    """F19 (LMCache #4715): a server may reap a live instance only after ``instance_ttl`` without
    a heartbeat from it -- one whose heartbeat it handled (at ``seen``) less than that ago was live
    (compared as the server does, ``seen + ttl > now``: ``now - seen`` may round below it)."""
    if seen is not None and ttl is not None and seen + ttl > now:
        return "F19", (f"{worker} (instance {instance_id}) reaped although its heartbeat reached {server} "
                       f"{now - seen:.3f}s ago (instance_ttl {ttl:g}s): a live idle instance; its retrieves "
                       f"are refused not_registered from now on")
    return None


def parked_request(request: str, correlation: int, server: int) -> Finding:
    """LIVENESS: after quiescence, a request refused not_registered still waits on a registration
    (it must have been resent once, or failed with a reason)."""
    return "LIVENESS", (f"{request} #{correlation} to server{server}, refused not_registered, still waits "
                        f"for a registration")


def resend_refused(request: str, correlation: int, server: int, named: Any, current: Any,
                   reaped: bool) -> Finding | None:
    """LIVENESS: a resend naming registration ``named`` was refused not_registered by the same
    server incarnation, where ``current`` is the instance's registration now (None: none) and
    ``reaped`` whether the server reaped the instance meanwhile. Refused while ``named`` is still
    the instance's (registration ids are never reused within one incarnation): refused by a record
    of its original, not for a lost registration. Refused while another registration of the same
    instance replaced it and nothing dropped the instance: a second registration of the same
    fields (the worker's and the link's crossing) orphaned the resend."""
    if current == named:
        return "LIVENESS", (f"{request} #{correlation} resent to server{server} naming registration {named}, "
                            f"still the instance's, was refused not_registered again")
    if current is not None and not reaped:
        return "LIVENESS", (f"{request} #{correlation} resent to server{server} naming registration {named} "
                            f"was refused not_registered: registration {current} of the same instance "
                            f"replaced it meanwhile, orphaning the resend")
    return None
