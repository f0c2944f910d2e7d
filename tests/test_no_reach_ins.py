"""No module reaches into another's privates (docs: STYLE's "No reach-ins"). A name with one
leading underscore is its module's own: read on ``self`` / ``cls``, on a class of the module, or
on an object whose class the module defines (the name is then assigned or defined in it). What
else reads one -- ``obj._name`` or ``getattr(obj, "_name")`` -- is a circle waiting to happen:
pass a public method, property or hooks object instead. ``THIRD_PARTY`` lists the few reads of
another library's internals, each with the reason there is no public way."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (module path, the expression as written): another library's private, with no public way.
THIRD_PARTY: dict[tuple[str, str], str] = {
    ("mpcache/runtime_zmq/config.py", "parser._actions"): "argparse: the parser's options, to document them",
    ("mpcache/runtime_zmq/config.py", "parser._action_groups"): "argparse: option groups, to document them",
    ("mpcache/runtime_zmq/config.py", "g._group_actions"): "argparse: a group's options",
    ("mpcache/runtime_zmq/admin_cli.py", "p._actions"): "argparse: the subcommands, for --help",
    ("mpcache/runtime_zmq/protocol_doc.py", "cli.build_parser()._actions"): "argparse: the server's options",
    ("mpcache/kernels/gpu.py", "kernel._codelibrary"): "numba-cuda: a kernel's CUfunction for raw launches",
    ("mpcache/kernels/gpu.py", "dst._ary"): "numba-cuda's simulator: the numpy array behind a fake device array",
    ("mpcache/kernels/gpu.py", "src._ary"): "numba-cuda's simulator: the numpy array behind a fake device array",
    ("mpcache/kernels/gpu.py", "getattr(mapped, '_ary')"): "numba-cuda's simulator: as above",
    ("mpcache/bench/bench_jobs.py", "sys._debugmallocstats"): "CPython: the allocator's arenas",
}
# Names every object of their kind has, public by their library's convention.
PUBLIC_BY_CONVENTION = {"_replace", "_make", "_fields", "_asdict", "_value_", "_name_", "_exit"}
# Modules of the standard library whose underscore names are documented API.
STDLIB_PRIVATE_OK = {"argparse", "os", "sys", "copy"}


def _defined(tree: ast.AST) -> set[str]:
    """The underscore names a module makes its own: attributes it assigns, functions and
    classes it defines, names it binds, and the names it lists as strings (``__slots__``,
    ``STATE_FIELDS``)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            # the names a class lists as its own (``__slots__``, ``STATE_FIELDS``)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and (t.id == "__slots__" or t.id.endswith("_FIELDS")) for t in targets):
                out.update(c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return out


def _reach_ins(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    own = _defined(tree)
    classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mpcache"):
            package = ROOT.joinpath(*(node.module or "").split("."))
            for alias in node.names:  # a private name of another module (a private module is fine)
                if alias.name.startswith("_") and not (package / f"{alias.name}.py").exists():
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
            continue
        if isinstance(node, ast.Attribute):
            base, name = node.value, node.attr
            text = ast.unparse(node)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            base, name = node.args[0], node.args[1].value
            text = f"getattr({ast.unparse(base)}, {name!r})"
        else:
            continue
        if not name.startswith("_") or name.startswith("__") or name in PUBLIC_BY_CONVENTION:
            continue
        if isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in classes):
            continue
        if isinstance(base, ast.Name) and base.id in STDLIB_PRIVATE_OK and name in ("_exit",):
            continue
        if ast.unparse(base) in ("type(self)", "super()") or name in own:
            continue
        found.append((node.lineno, text))
    return found


def test_no_module_reaches_into_another_modules_privates() -> None:
    found, allowed = [], set()
    for path in sorted((ROOT / "mpcache").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for line, text in _reach_ins(path):
            if (rel, text) in THIRD_PARTY:
                allowed.add((rel, text))
            elif not (text.startswith("argparse._") and rel.endswith(("config.py", "admin_cli.py"))):
                found.append(f"{rel}:{line}: {text}")
    assert not found, "reads of another module's private names:\n" + "\n".join(found)
    assert allowed == set(THIRD_PARTY), f"listed but no longer read (take them off): {set(THIRD_PARTY) - allowed}"


def test_the_check_finds_a_reach_in(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("class A:\n    def __init__(self):\n        self._mine = 1\n\n"
                      "def f(a, server):\n    from mpcache.core_sm.table import _copy_dispatcher\n"
                      "    return a._mine, server._theirs, getattr(server, '_also')\n")
    assert sorted(t for _l, t in _reach_ins(module)) == [
        "from mpcache.core_sm.table import _copy_dispatcher", "getattr(server, '_also')", "server._theirs"]
