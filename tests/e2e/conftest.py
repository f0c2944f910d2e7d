"""Fixtures shared by the real-vLLM tests."""
from __future__ import annotations

from pathlib import Path

import pytest
from vllm_run import HERE, have_vllm, run_driver


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random Llama (``tiny_llama.py``'s default size and seed), built once for every
    e2e module: it is deterministic, and the drivers only read it. Skips without vLLM."""
    if not have_vllm():
        pytest.skip("vLLM is not installed here: run `make e2e` (it builds .venv-vllm)")
    work = tmp_path_factory.mktemp("tiny_llama")
    out = work / "model"
    run_driver([str(HERE / "tiny_llama.py"), str(out)], work / "tiny_llama.log", 300)
    return str(out)
