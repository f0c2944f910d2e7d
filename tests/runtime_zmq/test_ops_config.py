"""mpcache-server configuration: every bad value is one ``cannot start:`` line (no traceback),
flag > env > file precedence, the effective config line, and docs/configuration.md in sync."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable

import pytest

from live_server import REPO, ServerProcess
from mpcache.runtime_zmq import cli
from mpcache.runtime_zmq import config as cfg
from mpcache.runtime_zmq.client import MPCacheClient


def parse(argv: list[str], env: dict[str, str] | None = None) -> tuple[object, dict[str, str]]:
    parser = cli.build_parser()
    return cfg.parse(parser, argv, env or {})


def refused(argv: list[str], env: dict[str, str] | None, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        args, _ = parse(argv, env)
        problem = cli.check(args)  # type: ignore[arg-type]
        if problem is not None:
            raise SystemExit(problem)
    err = capsys.readouterr().err.strip() or str(exit_info.value.code)
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["--chunk-size", "0"], None, "--chunk-size: must be a positive multiple of 16"),
        (["--chunk-size", "100"], None, "multiple of 16"),
        (["--l1-size-gb", "-1"], None, "--l1-size-gb: must be > 0"),
        (["--slot-mb", "0"], None, "--slot-mb: must be > 0"),
        (["--port", "99999"], None, "a port is 0-65535"),
        (["--metrics-port", "-1"], None, "a port is 0-65535"),
        (["--lease-ttl", "-5"], None, "must be > 0"),
        (["--job-ttl", "0"], None, "must be > 0"),
        (["--tombstone-ttl", "nan"], None, "not a finite number"),
        (["--log-level", "loud"], None, "not a log level"),
        (["--max-tokens", "0"], None, "must be > 0"),
        (["--slot-mb", "2048", "--l1-size-gb", "1"], None, "larger than --l1-size-gb"),
        (["--l2", "disk:cache?max_gb=1"], None, f"a relative disk path depends on the directory the server starts in; give an absolute one, e.g. disk:{os.getcwd()}/cache?max_gb=1"),
        ([], {"MPCACHE_L2": "disk:/ok,disk:~/c"}, f"--l2 disk:~/c: a relative disk path depends on the directory the server starts in; give an absolute one, e.g. disk:{os.path.expanduser('~')}/c"),
        ([], {"MPCACHE_PORT": "abc"}, "MPCACHE_PORT=abc: not an integer"),
        ([], {"MPCACHE_CHUNK_SIZE": "-16"}, "MPCACHE_CHUNK_SIZE=-16: must be a positive multiple of 16"),
        ([], {"MPCACHE_L2_PROBE": "maybe"}, "MPCACHE_L2_PROBE=maybe: not a boolean"),
        ([], {"MPCACHE_GPU": "sometimes"}, "MPCACHE_GPU=sometimes: use one of auto, on, off"),
    ],
)
def test_bad_values_are_one_line(argv: list[str], env: dict[str, str] | None, expected: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(argv, env, capsys)
    assert expected in err, err


def test_log_levels_and_choices_are_case_insensitive() -> None:
    args, _ = parse(["--log-level", "debug", "--gpu", "OFF"], {"MPCACHE_LOG_FORMAT": "JSON"})
    assert (args.log_level, args.gpu, args.log_format) == ("DEBUG", "off", "json")  # type: ignore[attr-defined]
    args, _ = parse([], {"MPCACHE_LOG_LEVEL": "info"})
    assert args.log_level == "INFO"  # type: ignore[attr-defined]


def test_flag_beats_env_beats_file(capsys: pytest.CaptureFixture[str]) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write('chunk-size = 512\nport = 6000\nlease_ttl = 10\nl2 = ["disk:/tmp/a", "disk:/tmp/b"]\nl2-probe = false\n')
    try:
        args, src = parse(["--config", f.name, "--port", "6001"], {"MPCACHE_CHUNK_SIZE": "1024", "MPCACHE_LEASE_TTL": "20"})
        assert args.port == 6001 and src["port"] == "flag"  # type: ignore[attr-defined]
        assert args.chunk_size == 1024 and src["chunk_size"] == "env"  # type: ignore[attr-defined]
        assert args.lease_ttl == 20.0 and src["lease_ttl"] == "env"  # type: ignore[attr-defined]
        assert args.l2 == ["disk:/tmp/a", "disk:/tmp/b"] and src["l2"] == "file"  # type: ignore[attr-defined]
        assert args.l2_probe is False and src["l2_probe"] == "file"  # type: ignore[attr-defined]
        assert src["job_ttl"] == "default"
        # the env var names the file too
        args, _ = parse([], {"MPCACHE_CONFIG": f.name})
        assert args.chunk_size == 512  # type: ignore[attr-defined]
        # a bad value or an unknown key in the file is one line, naming the file and the key
        with open(f.name, "w") as g:
            g.write("chunk_size = 7\n")
        assert f"{f.name}: chunk_size=7: must be a positive multiple of 16" in refused(["--config", f.name], None, capsys)
        with open(f.name, "w") as g:
            g.write("chunk_sise = 256\n")
        assert "unknown key 'chunk_sise'" in refused(["--config", f.name], None, capsys)
        with open(f.name, "w") as g:
            g.write("chunk_size = \n")
        assert "not valid TOML" in refused(["--config", f.name], None, capsys)
    finally:
        os.unlink(f.name)
    assert "No such file" in refused(["--config", "/nonexistent/mpcache.toml"], None, capsys)


def test_env_lists_are_comma_separated() -> None:
    args, src = parse([], {"MPCACHE_L2": "disk:/tmp/x,redis://127.0.0.1:6379"})
    assert args.l2 == ["disk:/tmp/x", "redis://127.0.0.1:6379"] and src["l2"] == "env"  # type: ignore[attr-defined]


def test_effective_config_redacts_passwords() -> None:
    args, src = parse(["--l2", "redis://:hunter2@127.0.0.1:6379/0?ttl=60"])
    line = cfg.effective_line(args, src)  # type: ignore[arg-type]
    assert "hunter2" not in line
    assert "redis://:***@127.0.0.1:6379/0?ttl=60" in line
    assert "chunk_size=256 " in line and "l2=['redis://:***@127.0.0.1:6379/0?ttl=60'](flag)" in line


def run_cli(*argv: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = REPO
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "mpcache.runtime_zmq.cli", *argv], capture_output=True, text=True,
                          cwd=REPO, env=e, timeout=timeout)


def test_process_refuses_with_one_line_and_no_traceback() -> None:
    out = run_cli("--port", "0", env={"MPCACHE_PORT": "abc"})  # the env value is bad even if a flag overrides it
    assert out.returncode == 2
    assert out.stderr.strip() == "mpcache-server: cannot start: MPCACHE_PORT=abc: not an integer"
    out = run_cli("--chunk-size", "0")
    assert out.returncode == 2 and "Traceback" not in out.stderr and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "cannot start: argument --chunk-size: must be a positive multiple of 16" in out.stderr


def test_busy_metrics_port_is_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        out = run_cli("--port", "0", "--metrics-port", str(busy), "--l1-size-gb", "0.06", "--slot-mb", "1")
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert f"cannot start: HTTP port 127.0.0.1:{busy} is in use" in out.stderr


def test_version_on_every_command() -> None:
    version = cfg.version()
    for module in ("mpcache.runtime_zmq.cli", "mpcache.runtime_zmq.admin_cli", "mpcache.sim.cli"):
        out = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert out.returncode == 0, (module, out.stderr)
        assert version in out.stdout, (module, out.stdout)
    from mpcache.bench import bench_cli

    assert bench_cli.main(["--version"]) == 0


def test_start_log_has_version_and_effective_config(start_server: Callable[..., ServerProcess]) -> None:
    sp = start_server("--chunk-size", "128", env={"MPCACHE_JOB_TTL": "30"})
    text = "\n".join(sp.log)
    assert f"mpcache-server {cfg.version()} (python" in text
    config_line = next(line for line in sp.log if " config: " in line)
    assert "chunk_size=128(flag)" in config_line and "job_ttl=30.0(env)" in config_line
    with MPCacheClient(sp.url) as c:
        assert c.health()["version"] == cfg.version()


def test_configuration_doc_is_generated_from_the_parsers() -> None:
    with open(os.path.join(REPO, "docs", "configuration.md")) as f:
        on_disk = f.read()
    from mpcache.runtime_zmq import config_doc

    assert on_disk == config_doc.render_markdown(), (
        "docs/configuration.md is out of date: run `python -m mpcache.runtime_zmq.config_doc > docs/configuration.md`"
    )
    for flag in ("--chunk-size", "--metrics-host", "--config", "MPCACHE_PORT", "rediss://", "max_gb", "mpcache-cli bench"):
        assert flag in on_disk, flag
