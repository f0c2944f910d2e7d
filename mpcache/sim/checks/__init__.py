"""The simulator's oracles, one per module, apart from the world they watch (as TigerBeetle's
simulator keeps its checkers apart from the cluster).

Two kinds:

* **judgements** -- pure functions of what a shell observed, shared by the random simulator
  (``sim/world.py``, ``sim/engine.py``) and the exhaustive explorer (``sim/explore.py``). Each
  returns ``(code, message)`` for a violation (the code a failure of ``reference/lmcache_mp.md``
  §F, see ``sim/oracles.py``) or None. The shells keep their own bookkeeping (what was sent,
  handled, delivered) and raise the violation their own way; the judgement -- what counts as the
  failure, and its words -- is here once, so a counterexample the explorer finds is the
  violation the simulator reports. They are re-exported here: ``checks.reply_accounting``.

  ``replies`` (F11), ``core`` (SAFETY: core_sm's invariants, L1 accounting), ``leases`` (F4, F8,
  F9, F20, F21), ``status`` (F5), ``hits`` (F2), ``drained`` (F12), ``instances`` (F13, F19,
  the transport's LIVENESS), ``mapping`` (F23); F24 lives with the KV-cache groups' model
  (``sim/groups.py``) and is named here too.

* **the random world's oracles** -- what reads a ``World``'s bookkeeping and its servers to call
  those judgements (imported by the world, not re-exported): ``server_event`` (after every event
  a server handles), ``admission`` (store admission), ``hit_history`` (HIT), ``slots`` (F10: a
  copy or L2 transfer landing in a slot given away), ``quiescence`` (after heal: replies owed,
  leases left, registrations, and the drained servers).
"""
from __future__ import annotations

from mpcache.sim.checks.core import bytes_accounting as bytes_accounting
from mpcache.sim.checks.core import core_invariants as core_invariants
from mpcache.sim.checks.drained import drained as drained
from mpcache.sim.checks.finding import Finding as Finding
from mpcache.sim.checks.hits import lost_hit as lost_hit
from mpcache.sim.checks.hits import misplaced_load as misplaced_load
from mpcache.sim.checks.instances import parked_request as parked_request
from mpcache.sim.checks.instances import reaped_while_live as reaped_while_live
from mpcache.sim.checks.instances import resend_refused as resend_refused
from mpcache.sim.checks.instances import worker_unregistered as worker_unregistered
from mpcache.sim.checks.leases import duplicate_lookup_leases as duplicate_lookup_leases
from mpcache.sim.checks.leases import free_released_others as free_released_others
from mpcache.sim.checks.leases import lease_span as lease_span
from mpcache.sim.checks.leases import leases_after_end as leases_after_end
from mpcache.sim.checks.leases import leases_unaccounted as leases_unaccounted
from mpcache.sim.checks.leases import load_planned_again as load_planned_again
from mpcache.sim.checks.leases import retrieve_on_expired_leases as retrieve_on_expired_leases
from mpcache.sim.checks.mapping import copy_through_other_registration as copy_through_other_registration
from mpcache.sim.checks.replies import DEFERRED_REPLIES as DEFERRED_REPLIES
from mpcache.sim.checks.replies import reply_accounting as reply_accounting
from mpcache.sim.checks.status import status_before_lookup as status_before_lookup
# F24, the KV-cache groups' judgements, live with the groups' model (sim/groups.py); named here so
# that the explorer and the random simulator take every judgement from one module.
from mpcache.sim.groups import partial_restore as partial_restore
from mpcache.sim.groups import unrestorable_hit as unrestorable_hit
