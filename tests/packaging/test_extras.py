"""A command that needs an extra the install lacks (a server-only ``pip install mpcache``) says
which extra in one line and exits 2, instead of ending in the missing module's traceback.

The missing module is made missing for real: a meta-path finder ahead of the others answers
``No module named ...`` for it, as an environment without the distribution would."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

from mpcache.bench import bench_cli

REPO = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

# runs the console script's target (pyproject's [project.scripts]) with some modules missing
RUNNER = """
import importlib, sys
missing = set(sys.argv[1].split(","))
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in missing:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Missing())
module, _, func = sys.argv[2].partition(":")
sys.argv = [sys.argv[3], *sys.argv[4:]]
sys.exit(getattr(importlib.import_module(module), func)())
"""


def run_without(missing: str, command: str, *argv: str) -> subprocess.CompletedProcess[str]:
    target = PYPROJECT["project"]["scripts"][command]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", RUNNER, missing, target, command, *argv],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)


def extra_installs(extra: str, module: str) -> bool:
    names = {re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower().replace("_", "-")
             for req in PYPROJECT["project"]["optional-dependencies"][extra]}
    return module.lower().replace("_", "-") in names


@pytest.mark.parametrize(("command", "argv"), [("mpcache-sim", ["--help"]), ("mpcache-sim", ["run", "--seeds", "1"]),
                                               ("mpcache-bench", ["sim"])])
def test_a_missing_sim_extra_is_one_line_and_exit_2(command: str, argv: list[str]) -> None:
    out = run_without("trio", command, *argv)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(command) and "pip install 'mpcache[sim]'" in out.stderr and "trio" in out.stderr
    assert extra_installs("sim", "trio")


def test_the_commands_run_with_the_extra() -> None:
    out = run_without("no_such_module", "mpcache-sim", "--help")
    assert out.returncode == 0 and "usage: mpcache-sim" in out.stdout, out.stderr


def test_the_bench_extras_table_names_pyproject_extras() -> None:
    for module, extra in bench_cli.EXTRA_OF.items():
        assert extra in PYPROJECT["project"]["optional-dependencies"], extra
        assert extra_installs(extra, module), f"the `{extra}` extra does not install {module}"


def test_a_missing_module_that_is_no_extra_still_raises() -> None:
    out = run_without("attrs", "mpcache-bench", "sim")  # a base dependency: a broken install
    assert out.returncode == 1 and "Traceback" in out.stderr
