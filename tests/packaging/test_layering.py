"""The folders' dependency direction (docs: DESIGN "Layout"): core_sm <- runtime_trio <- sim;
core_sm <- runtime_zmq -> kernels. core_sm never imports another folder, sim never imports
runtime_zmq, kernels never imports core_sm. Every import of mpcache's own code goes through the
one ``mpcache.`` namespace: a bare ``import core_sm`` would work in a source checkout and fail
once installed."""
from __future__ import annotations

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
FOLDERS = ("core_sm", "runtime_trio", "sim", "runtime_zmq", "kernels", "bench")
MAY_IMPORT = {
    "core_sm": {"core_sm"},
    "runtime_trio": {"core_sm", "runtime_trio"},
    "sim": {"core_sm", "runtime_trio", "sim"},
    "runtime_zmq": {"core_sm", "runtime_zmq", "kernels"},
    "kernels": {"kernels"},
    "bench": set(FOLDERS),
}


def _own_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``path``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def check_folder(folder: str) -> list[str]:
    problems = []
    for path in sorted((REPO / "mpcache" / folder).rglob("*.py")):
        for line, module in _own_imports(path):
            parts = module.split(".")
            where = f"{path.relative_to(REPO)}:{line}"
            if parts[0] in FOLDERS:
                problems.append(f"{where}: imports {module} outside the mpcache namespace")
            elif parts[0] == "mpcache" and len(parts) > 1 and parts[1] in FOLDERS:
                if parts[1] not in MAY_IMPORT[folder]:
                    problems.append(f"{where}: {folder} imports {module}")
    return problems


@pytest.mark.parametrize("folder", FOLDERS)
def test_folder_imports_follow_the_layout(folder: str) -> None:
    assert check_folder(folder) == []


def test_tests_import_through_the_namespace() -> None:
    bad = [f"{p.relative_to(REPO)}:{line}: {m}" for p in sorted((REPO / "tests").rglob("*.py"))
           for line, m in _own_imports(p) if m.split(".")[0] in FOLDERS]
    assert bad == []


def test_the_parts_are_real_folders_with_one_name() -> None:
    """No links anywhere in the package: a linked folder makes each module importable under two
    names (mypy sees both, ``a.X is mpcache.a.X`` is False) and hides the imports from tools."""
    package = REPO / "mpcache"
    links = [str(p.relative_to(REPO)) for p in package.rglob("*") if p.is_symlink()]
    assert links == []
    for folder in FOLDERS:
        assert (package / folder).is_dir() and (package / folder / "__init__.py").is_file(), folder
        assert not (REPO / folder).exists(), f"{folder}/ at the top would shadow mpcache.{folder}"


def test_checkout_tools_do_not_import_tests() -> None:
    """tools/ holds checkout-only scripts; they use the package, never the test suite."""
    bad = [f"{p.relative_to(REPO)}:{line}: {m}" for p in sorted((REPO / "tools").rglob("*.py"))
           for line, m in _own_imports(p) if m.split(".")[0] == "tests"]
    assert bad == []
