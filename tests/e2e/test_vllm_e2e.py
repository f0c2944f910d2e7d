"""Real vLLM (CPU) end to end through mpcache: ``make e2e`` (``.ci/e2e``) runs it in ``.venv-vllm``.

Two vLLM processes on the tiny random Llama, prefix caching off: a baseline with no connector,
and one with ``MPCacheConnector`` against a real ``mpcache-server`` process
(``tests/e2e/vllm_driver.py`` drives both and reports JSON; this module checks the reports).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from vllm_run import HERE, free_port, have_vllm, run_driver

# The first test also pays for the fixtures: two vLLM starts (~30 s each alone, minutes on a
# busy 2-core box), hence a timeout above the project's default 300 s.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not have_vllm():
        pytest.skip("vLLM is not installed here: run `make e2e` (it builds .venv-vllm)")
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def baseline(model: str, workdir: Path) -> dict[str, Any]:
    out = workdir / "baseline.json"
    run_driver([str(HERE / "vllm_driver.py"), "baseline", "--model", model, "--out", str(out)], workdir / "baseline.log", 600)
    report: dict[str, Any] = json.loads(out.read_text())
    return report


@pytest.fixture(scope="module")
def connector(model: str, workdir: Path, baseline: dict[str, Any]) -> dict[str, Any]:
    out = workdir / "connector.json"
    args = [str(HERE / "vllm_driver.py"), "connector", "--model", model, "--out", str(out), "--port", str(free_port())]
    run_driver(args, workdir / "connector.log", 600)
    report: dict[str, Any] = json.loads(out.read_text())
    timings = {
        "baseline init s": baseline["init_s"],
        "connector init s": report["init_s"],
        "server start s": report["server_start_s"],
        "server restart s": report["server_restart_s"],
        "per request s (hit phase)": {k: v["seconds"] for k, v in report["phases"]["hit"].items()},
        "per request s (miss phase)": {k: v["seconds"] for k, v in report["phases"]["miss"].items()},
        "per request s (baseline)": {k: v["seconds"] for k, v in baseline["results"].items()},
    }
    print("e2e timings:", json.dumps(timings))
    return report


def _expected(baseline: dict[str, Any], name: str) -> list[int]:
    ids: list[int] = baseline["results"][name]["output_ids"]
    return ids


def test_first_run_misses_and_stores(connector: dict[str, Any], baseline: dict[str, Any]) -> None:
    phases = connector["phases"]
    for name, result in phases["miss"].items():
        assert result["num_cached_tokens"] == 0, name
        assert result["output_ids"] == _expected(baseline, name), name
    # p300 stores one chunk of 256 tokens, p520 two.
    assert phases["miss_stats"]["objects"] == 3
    assert phases["miss_stats"]["hit_chunks"] == 0


def test_second_run_is_served_from_mpcache_with_identical_output(connector: dict[str, Any], baseline: dict[str, Any]) -> None:
    phases = connector["phases"]
    hit = phases["hit"]
    assert hit["p300"]["num_cached_tokens"] == 256
    assert hit["p520"]["num_cached_tokens"] == 512
    for name in ("p300", "p520"):
        assert hit[name]["output_ids"] == _expected(baseline, name), name
    assert phases["hit_stats"]["hit_chunks"] >= phases["miss_stats"]["hit_chunks"] + 3
    assert phases["hit_stats"]["transfers_failed"] == 0


def test_partial_hit_loads_the_shared_chunk_only(connector: dict[str, Any], baseline: dict[str, Any]) -> None:
    tail = connector["phases"]["hit"]["p300_tail"]
    assert tail["num_cached_tokens"] == 256
    assert tail["output_ids"] == _expected(baseline, "p300_tail")


def test_aborts_leave_no_leases(connector: dict[str, Any]) -> None:
    stats = connector["phases"]["abort_stats"]
    assert stats["lookups"] >= connector["phases"]["hit_stats"]["lookups"] + 2
    assert stats["leases_held"] == 0
    assert stats["jobs"] == 0
    assert stats["errors"] == 0


def test_server_restart_degrades_to_recompute_then_hits_again(connector: dict[str, Any], baseline: dict[str, Any]) -> None:
    phases = connector["phases"]
    expected = _expected(baseline, "p300")
    assert phases["down"]["p300"]["num_cached_tokens"] == 0
    assert phases["down"]["p300"]["output_ids"] == expected
    assert phases["restart_first"]["p300"]["num_cached_tokens"] == 0  # the new server is empty
    assert phases["restart_first"]["p300"]["output_ids"] == expected
    # re-registered, stored, hit (the server's counters say which step failed if not)
    first = {k: phases["restart_first_stats"][k] for k in ("instances", "lookups", "objects", "transfers_started",
                                                             "transfers_failed", "errors", "wire_requests")}
    assert phases["restart_second"]["p300"]["num_cached_tokens"] == 256, first
    assert phases["restart_second"]["p300"]["output_ids"] == expected
    stats = phases["restart_stats"]
    assert stats["instances"] == 1
    assert stats["leases_held"] == 0


def test_corrupted_l1_changes_the_output(connector: dict[str, Any], baseline: dict[str, Any]) -> None:
    """Negative control: if loads were not really used, noise in L1 would change nothing."""
    corrupt = connector["phases"]["corrupt"]["p300"]
    assert corrupt["num_cached_tokens"] == 256
    assert corrupt["output_ids"] != _expected(baseline, "p300")


def test_the_servers_trace_replays_through_the_simulators_machines(connector: dict[str, Any]) -> None:
    """The restarted server's trace (a hit, a miss and the corrupted-L1 request of real vLLM)
    replays through the simulator's server machine with the simulator's oracles: same effects for
    every event, no oracle finding (issue "One seam": a recorded production run, replayed)."""
    from mpcache.sim.cli import main as sim_main

    (path,) = connector["traces"]["stopped"]
    with open(path, encoding="utf-8") as f:
        kinds = {json.loads(line)[1]["$"] for line in list(f)[1:]}
    # a registration, lookups, a store and retrieves of a real run
    assert {"RegisterInstance", "Lookup", "PrepareStore", "PrepareRetrieve", "CommitTransfer"} <= kinds, kinds
    assert sim_main(["replay-trace", path]) == 0
