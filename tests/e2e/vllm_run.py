"""How the e2e tests run a driver script (``tiny_llama.py``, ``vllm_driver.py``, ...) in the
vLLM venv: one subprocess per driver, its output in a log whose tail a failure shows."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

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
