"""Which CUDA the tests get, chosen explicitly for the whole run (never by a folder's conftest):

* ``MPCACHE_CUDASIM=1`` (``make test`` sets it; CI has no GPU): numba's CUDA simulator. Tests
  marked ``cuda`` (the kernel tests) run on it; tests marked ``gpu`` (real device, other
  processes, CUDA IPC) are skipped, since the simulator cannot run them.
* otherwise real CUDA: ``cuda`` and ``gpu`` tests run on the device, and are skipped where
  there is none. ``make test-gpu`` also sets ``MPCACHE_REQUIRE_GPU=1``, which turns "no
  device" into an error instead of a skip.

numba reads NUMBA_ENABLE_CUDASIM when numba.cuda is first imported, so the choice is made here,
before any test module is collected.
"""
from __future__ import annotations

import os
import sys
from typing import Any

import pytest


def cudasim_selected() -> bool:
    return os.environ.get("MPCACHE_CUDASIM") == "1"


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "cuda: runs on a CUDA device, or on numba's CUDA simulator with MPCACHE_CUDASIM=1")
    if cudasim_selected():
        if "numba.cuda" in sys.modules and not os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
            raise pytest.UsageError("MPCACHE_CUDASIM=1, but numba.cuda was imported before the simulator could be chosen")
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        if "numba" in sys.modules:  # numba read its config already: tell it too
            sys.modules["numba"].config.ENABLE_CUDASIM = 1
    elif os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        raise pytest.UsageError("NUMBA_ENABLE_CUDASIM=1 without MPCACHE_CUDASIM=1: choose the simulator with MPCACHE_CUDASIM=1")


def _real_device() -> bool:
    try:
        from numba import cuda

        return bool(cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    wants_cuda = [i for i in items if i.get_closest_marker("cuda") or i.get_closest_marker("gpu")]
    if not wants_cuda:
        return
    if cudasim_selected():
        skip = pytest.mark.skip(reason="the CUDA simulator is on (MPCACHE_CUDASIM=1); real-GPU tests run with make test-gpu")
        for item in wants_cuda:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)
        return
    if _real_device():
        return
    if os.environ.get("MPCACHE_REQUIRE_GPU") == "1":
        raise pytest.UsageError("MPCACHE_REQUIRE_GPU=1 but numba finds no CUDA device")
    skip = pytest.mark.skip(reason="no CUDA device (MPCACHE_CUDASIM=1 runs the kernel tests on numba's simulator)")
    for item in wants_cuda:
        item.add_marker(skip)
