"""The stateful tests with many more, longer walks (slow: `make soak` or `pytest -m slow`)."""
from __future__ import annotations

import pytest
from hypothesis import settings

from test_pair_stateful import PairMachine
from test_server_stateful import ServerMachine

DEEP = settings(max_examples=1500, stateful_step_count=80, deadline=None)


class DeepServerMachine(ServerMachine):
    pass


class DeepPairMachine(PairMachine):
    pass


DeepServerMachine.TestCase.settings = DEEP
DeepPairMachine.TestCase.settings = DEEP
TestDeepServerMachine = pytest.mark.slow(DeepServerMachine.TestCase)
TestDeepPairMachine = pytest.mark.slow(DeepPairMachine.TestCase)
