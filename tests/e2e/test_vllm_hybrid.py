"""Real vLLM (CPU) on a model that mixes full-attention and sliding-window layers, with vLLM's
hybrid KV-cache manager on, through ``MPCacheHMAConnector`` (``make e2e``).

The tiny Gemma3 (``tests/e2e/vllm_hybrid_driver.py``: sliding / full / sliding / full, a window
of 200 tokens, vLLM's CPU block of 128) runs with two KV-cache groups. Run 1 stores every
prompt's chunks; run 2, a fresh vLLM on the same server, loads every group of the chunk-aligned
prefix (the full group all of it, the window group its window: core_sm.kv_groups) and must
give the greedy output of a run without mpcache. Twice: chunks of 256 tokens (the window
within one chunk or two) and of 128 (the window spans two or three chunks). Prompts of 180
tokens (shorter than the window), 300, 520 and 700."""
from __future__ import annotations

from typing import Any

import pytest
from vllm_run import HERE, build_model, driver_report, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]
DRIVER = str(HERE / "vllm_hybrid_driver.py")
CHUNKS = (256, 128)


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    work, model = build_model(tmp_path_factory, DRIVER, "hybrid", "--window", "200")
    out: dict[Any, Any] = {"baseline": driver_report(DRIVER, "baseline", work, model, "baseline", 900)}
    for chunk in CHUNKS:
        out[chunk] = driver_report(DRIVER, "connector", work, model, f"chunk{chunk}", 1500,
                                   "--port", str(free_port()), "--chunk", str(chunk))
    print("hybrid e2e seconds:", {k: out[k]["seconds"] for k in ("baseline", *CHUNKS)})
    return out


@pytest.mark.parametrize("chunk", CHUNKS)
def test_hybrid_manager_stays_on_with_two_groups(reports: dict[Any, Any], chunk: int) -> None:
    for run in ("store", "load"):
        log = reports[chunk]["runs"][run]["log"]
        assert "Turning off hybrid kv cache manager" not in log
        assert "kv cache group sizes (128, 128)" in log  # two KV-cache groups of 128-token blocks
        assert "0 external tokens" not in log  # the groups are not refused
        # the connector (and its server) ran this checkout's mpcache
        assert f"mpcache imported from {HERE.parents[1] / 'mpcache' / '__init__.py'}" in log


@pytest.mark.parametrize("chunk", CHUNKS)
def test_run_two_loads_every_group_with_the_baseline_output(reports: dict[Any, Any], chunk: int) -> None:
    base, runs = reports["baseline"]["results"], reports[chunk]["runs"]
    for name, expected in base.items():
        length = int(name[1:])
        store, load = runs["store"]["results"][name], runs["load"]["results"][name]
        assert store["num_cached_tokens"] == 0 and store["output_ids"] == expected["output_ids"], name
        # the chunk-aligned prefix short of the last prompt token (which the engine computes)
        assert load["num_cached_tokens"] == (length - 1) // chunk * chunk, name
        assert load["output_ids"] == expected["output_ids"], name


def test_objects_hold_every_group_per_chunk(reports: dict[Any, Any]) -> None:
    """One object per chunk for both groups: as many as the prompts' whole chunks."""
    for chunk in CHUNKS:
        assert reports[chunk]["objects"] == sum(length // chunk for length in (180, 300, 520, 700))
