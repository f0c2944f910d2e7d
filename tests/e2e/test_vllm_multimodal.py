"""Real vLLM (CPU) on a tiny random multimodal model (Idefics3: a 2-layer vision encoder, a 2-layer
Llama) through ``MPCacheConnector`` (``make e2e``).

The prompt is 150 words, an image (19 tokens: 16 image tokens between Idefics3's markers), 231
words: 400 tokens, chunks of 128, so chunk 0 is text only and chunks 1 and 2 hold or follow the
image. Run 1 (``tests/e2e/vllm_multimodal_driver.py``) computes the prompt with image A and with
image B opted out of mpcache (the baselines), then with A normally: a miss that stores 3 chunks.
Run 2, a fresh vLLM on the same server: the prompt with A loads all 3 chunks with A's baseline
output; with B only chunk 0 (the text before the image) hits, B's chunks from the image on are
computed and stored apart (5 objects), and its output is B's baseline, not A's."""
from __future__ import annotations

from typing import Any

import pytest
from vllm_run import HERE, build_model, driver_report, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
DRIVER = str(HERE / "vllm_multimodal_driver.py")
CHUNK = 128


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work, model = build_model(tmp_path_factory, DRIVER, "multimodal")
    out: dict[str, Any] = driver_report(DRIVER, "connector", work, model, "connector", 1100,
                                        "--port", str(free_port()), "--chunk", str(CHUNK))
    print("multimodal e2e seconds:", out["seconds"], {run: out["runs"][run]["seconds"] for run in out["runs"]})
    return out


def test_both_runs_use_this_checkout_and_key_images(report: dict[str, Any]) -> None:
    for run in ("store", "load"):
        log = report["runs"][run]["log"]
        assert f"mpcache imported from {HERE.parents[1] / 'mpcache' / '__init__.py'}" in log
    store = report["runs"]["store"]["results"]
    # one prompt text; the image's tokens sit at 150..168 (markers included)
    assert store["A"]["prompt_ids"] == store["B_base"]["prompt_ids"] and len(store["A"]["prompt_ids"]) == 400
    # the two images give different outputs: an image's KV served for the other would show
    assert store["A_base"]["output_ids"] != store["B_base"]["output_ids"]


def test_run_one_misses_and_stores_image_a(report: dict[str, Any]) -> None:
    store = report["runs"]["store"]
    for name in ("A_base", "B_base", "A"):
        assert store["results"][name]["num_cached_tokens"] == 0, name
    assert store["results"]["A"]["output_ids"] == store["results"]["A_base"]["output_ids"]
    assert store["objects"] == 400 // CHUNK  # A's whole chunks; the opted-out requests stored nothing


def test_same_image_hits_every_chunk_with_the_baseline_output(report: dict[str, Any]) -> None:
    run1, run2 = report["runs"]["store"]["results"], report["runs"]["load"]["results"]
    assert run2["A"]["num_cached_tokens"] == (400 - 1) // CHUNK * CHUNK  # before, across and after the image
    assert run2["A"]["output_ids"] == run1["A_base"]["output_ids"]


def test_another_image_shares_only_the_text_before_it(report: dict[str, Any]) -> None:
    run1, load = report["runs"]["store"]["results"], report["runs"]["load"]
    assert load["results"]["B"]["num_cached_tokens"] == CHUNK  # chunk 0: 128 words, no image token
    assert load["results"]["B"]["output_ids"] == run1["B_base"]["output_ids"]
    assert load["objects"] == 400 // CHUNK + 2  # B's chunks 1 and 2 are keys of their own
