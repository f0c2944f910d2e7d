"""Actor runtime on trio: nodes host core_sm machines and interpret their effects.

Protocol-free: see `node.Node` (mailbox + interpreter + timer), `transport` (Transport,
executors), `clock` (virtual time with deadlock detection). Runs on trio's real clock for an
in-process cluster, or under `clock.VirtualClock` for the simulator.
"""
from mpcache.runtime_trio.clock import DeadlockError, VirtualClock, run_virtual
from mpcache.runtime_trio.node import Delivery, Machine, Node, TimerTick
from mpcache.runtime_trio.transport import Address, Executor, LocalTransport, TaskExecutor, Transport

__all__ = [
    "Address", "DeadlockError", "Delivery", "Executor", "LocalTransport", "Machine", "Node",
    "TaskExecutor", "TimerTick", "Transport", "VirtualClock", "run_virtual",
]
