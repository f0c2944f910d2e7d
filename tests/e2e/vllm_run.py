"""How the e2e tests run a driver script (``tiny_llama.py``, ``vllm_driver.py``, ...) in the
vLLM venv: one subprocess per driver, its output in a log whose tail a failure shows."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent  # the driver scripts


def have_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def run_driver(args: list[str], log: Path, timeout: float) -> None:
    """Run ``python ARGS`` from the repository root, offline, with the checkout on the path;
    raises ``AssertionError`` with the log's last 40 lines if it fails."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(REPO))
    with open(log, "wb") as out:
        proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-40:]
        raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}):\n" + "\n".join(tail))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_model(factory: Any, driver: str, name: str, *build_args: str) -> tuple[Path, Path]:
    """A fresh work folder ``name`` and the driver's tiny random model built in it (``work``,
    ``model``); skips the test where vLLM is not installed."""
    if not have_vllm():
        pytest.skip("vLLM is not installed here: run `make e2e` (it builds .venv-vllm)")
    work: Path = factory.mktemp(name)
    model = work / "model"
    run_driver([driver, "build", "--model", str(model), *build_args], work / "build.log", 300)
    return work, model


def driver_report(driver: str, mode: str, work: Path, model: Path, run: str, timeout: float, *args: str) -> Any:
    """``driver MODE --model MODEL --out WORK/RUN.json ARGS``, its log in ``WORK/RUN.log``: the
    JSON report it wrote."""
    path = work / f"{run}.json"
    run_driver([driver, mode, "--model", str(model), "--out", str(path), *args], work / f"{run}.log", timeout)
    return json.loads(path.read_text())
