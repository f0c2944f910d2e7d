"""core_sm imports only the stdlib (minus clocks, randomness, OS, threads, sockets, asyncio)
and attrs, and never calls time.* or random.*."""
from __future__ import annotations

import ast
import pathlib
import sys

import pytest

CORE_SM = pathlib.Path(__file__).resolve().parents[2] / "mpcache" / "core_sm"
FORBIDDEN = {"time", "random", "uuid", "os", "threading", "socket", "asyncio", "secrets",
             "subprocess", "multiprocessing", "datetime", "concurrent", "signal", "select",
             "_thread", "selectors"}
ALLOWED_THIRD_PARTY = {"attrs", "xxhash"}  # xxhash: chunk hashing, pure


def _sources() -> list[pathlib.Path]:
    files = sorted(CORE_SM.rglob("*.py"))
    assert files, "no core_sm sources found"
    return files


def _imports(tree: ast.AST) -> list[str]:
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                names.append(node.module)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("__import__", "exec", "eval"):
                names.append(f"<dynamic {node.func.id}>")
    return names


def check_source(text: str) -> list[str]:
    """The purity violations in one module's source."""
    problems = []
    tree = ast.parse(text)
    for name in _imports(tree):
        top = name.split(".")[0]
        if name == "mpcache.core_sm" or name.startswith("mpcache.core_sm."):
            continue  # core_sm itself
        if name.startswith("<dynamic"):
            problems.append(f"dynamic import/exec {name}")
        elif top in FORBIDDEN:
            problems.append(f"imports {name}")
        elif top not in ALLOWED_THIRD_PARTY and top not in sys.stdlib_module_names:
            problems.append(f"imports non-stdlib {name}")
        elif top == "importlib":
            problems.append("imports importlib")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in ("time", "random", "os", "uuid"):
                problems.append(f"uses {node.value.id}.{node.attr}")
    return problems


@pytest.mark.parametrize("path", _sources(), ids=lambda p: p.name)
def test_core_sm_module_is_pure(path: pathlib.Path) -> None:
    assert check_source(path.read_text()) == []


@pytest.mark.parametrize(
    "snippet",
    ["import time", "from random import choice", "import numpy", "import os.path",
     "x = time.monotonic()", "__import__('socket')", "from asyncio import sleep", "import uuid",
     "from mpcache.runtime_zmq import wire", "import mpcache.sim"],
)
def test_checker_catches_violations(snippet: str) -> None:
    assert check_source(snippet) != []


def test_checker_accepts_allowed() -> None:
    assert check_source("import attrs\nimport hashlib\nfrom mpcache.core_sm.chunks import ObjectKey\n") == []
