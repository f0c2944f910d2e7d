"""Sequence fields of events take any iterable (typed converters), so mypy accepts the calls
the runtimes make with lists and generators."""
from __future__ import annotations

import pytest

from mpcache.core_sm.messages import EngineFinished, L2ProbeFinished, L2ReadFinished


def test_iterables_become_tuples() -> None:
    assert EngineFinished(["a", "b"]).request_ids == ("a", "b")
    assert EngineFinished(r for r in ("x",)).request_ids == ("x",)
    assert L2ReadFinished(1, [True, False]).loaded == (True, False)
    assert L2ProbeFinished(2, [False]).present == (False,)
    assert EngineFinished(["a"]) == EngineFinished(("a",))


def test_a_lone_request_id_string_is_refused() -> None:
    with pytest.raises(TypeError):
        EngineFinished("abc")


def test_mypy_accepts_lists_and_rejects_wrong_items() -> None:
    api = pytest.importorskip("mypy.api")
    program = (
        "from mpcache.core_sm.messages import EngineFinished, L2ProbeFinished, L2ReadFinished\n"
        "EngineFinished(['a'])\n"
        "L2ReadFinished(1, [True])\n"
        "L2ProbeFinished(1, (b for b in [True]))\n"
        "EngineFinished([1])\n"
    )
    stdout, _stderr, status = api.run(["--strict", "--no-incremental", "-c", program])
    errors = [line for line in stdout.splitlines() if ": error:" in line]
    assert status == 1 and len(errors) == 1, stdout
    assert errors[0].startswith("<string>:5:"), stdout
