"""L1 is never larger than what the host (or the pod's memory cgroup) can give: a too-large
``--l1-size-gb`` refuses to start, with one ``cannot start:`` line, before anything is reserved;
``--l1-clamp`` asks for the clamp instead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpcache.runtime_zmq.l1_pool import L1_MARGIN_BYTES, L1TooLarge, SharedMemoryPool, fit_l1, memory_room

GiB = 1 << 30
MEMINFO = "MemTotal:       8388608 kB\nMemFree:        1048576 kB\nMemAvailable:   6291456 kB\n"  # 8 GiB, 6 available


def _cgroup(root: Path, path: str, limit: str, usage: int) -> None:
    d = root / path.strip("/")
    d.mkdir(parents=True, exist_ok=True)
    (d / "memory.max").write_text(limit + "\n")
    (d / "memory.current").write_text(f"{usage}\n")


def test_the_tightest_limit_names_itself(tmp_path: Path) -> None:
    # a pod: 4 GiB memory.max on its cgroup (the parent has none), 1 GiB already used
    _cgroup(tmp_path, "", "max", 0)
    _cgroup(tmp_path, "kubepods/pod1", str(4 * GiB), 1 * GiB)
    room = memory_room(str(tmp_path), meminfo=MEMINFO, cgroup_root=str(tmp_path), self_cgroup="0::/kubepods/pod1\n")
    by_what = {what.split(" ")[1]: fits for what, fits in room}
    assert by_what["host"] == 6 * GiB - max(L1_MARGIN_BYTES, 8 * GiB // 20)
    assert by_what["memory"] == 3 * GiB - L1_MARGIN_BYTES  # "the memory cgroup allows ..."
    with pytest.raises(L1TooLarge) as e:
        fit_l1(32 * GiB, str(tmp_path), clamp=False, room=room)  # the DaemonSet example's old numbers
    assert "memory cgroup allows 4.0 GiB" in str(e.value) and "--l1-clamp" in str(e.value)
    assert fit_l1(32 * GiB, str(tmp_path), clamp=True, room=room) == 3 * GiB - L1_MARGIN_BYTES
    assert fit_l1(1 * GiB, str(tmp_path), clamp=False, room=room) == 1 * GiB


def test_cgroup_v1_and_no_limit(tmp_path: Path) -> None:
    mem = tmp_path / "memory" / "docker" / "c1"
    mem.mkdir(parents=True)
    (mem / "memory.limit_in_bytes").write_text(f"{2 * GiB}\n")
    (mem / "memory.usage_in_bytes").write_text(f"{GiB // 2}\n")
    room = memory_room(str(tmp_path), meminfo=MEMINFO, cgroup_root=str(tmp_path),
                       self_cgroup="5:memory:/docker/c1\n3:cpu,cpuacct:/docker/c1\n")
    assert min(fits for _, fits in room) == 2 * GiB - GiB // 2 - L1_MARGIN_BYTES
    # v2 with memory.max "max" everywhere: no cgroup limit, only the host's and the filesystem's
    _cgroup(tmp_path / "v2", "a", "max", 5)
    room = memory_room(str(tmp_path), meminfo=MEMINFO, cgroup_root=str(tmp_path / "v2"), self_cgroup="0::/a\n")
    assert not any(what.startswith("the memory cgroup") for what, _ in room)


def test_the_pool_refuses_before_it_creates_anything(tmp_path: Path) -> None:
    with pytest.raises(L1TooLarge):
        SharedMemoryPool(1 << 50, 1 << 20, directory=str(tmp_path))  # a petabyte
    assert list(tmp_path.iterdir()) == []
    pool = SharedMemoryPool(1 << 50, 1 << 20, directory=str(tmp_path), clamp=True, reserve=False)
    assert 0 < pool.size < 1 << 50
    pool.close()


def test_a_too_large_l1_size_gb_refuses_to_start_without_reserving(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "mpcache.runtime_zmq.cli", "--port", "0", "--no-metrics", "--shm-dir", str(shm),
         "--l1-size-gb", "100000"],
        capture_output=True, text=True, timeout=60, env=env, cwd=repo,
    )
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "cannot start" in line]
    assert proc.returncode != 0 and len(lines) == 1, proc.stdout + proc.stderr
    assert "does not fit" in lines[0] and "--l1-clamp" in lines[0]
    assert list(shm.iterdir()) == []  # nothing reserved, not even created
