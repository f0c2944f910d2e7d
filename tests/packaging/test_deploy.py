"""deploy/: the Kubernetes manifests validate against the Kubernetes schemas (kubernetes-validate,
strict), agree with the server (the ConfigMap's TOML is accepted by mpcache-server's own parser,
probes hit /healthz and /readyz on the metrics port), the Grafana dashboard queries only metrics
the server exposes, and the Dockerfile runs non-root with the documented ports. Building the image
needs a container registry: `test_image_builds` (slow) does it with podman when one answers."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from typing import Any

import pytest
import yaml

from mpcache.runtime_zmq import cli
from mpcache.runtime_zmq import config as cfg
from mpcache.runtime_zmq.metrics import METRICS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
DEPLOY = os.path.join(REPO, "deploy")
K8S = os.path.join(DEPLOY, "kubernetes")


def manifests() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for name in sorted(os.listdir(K8S)):
        with open(os.path.join(K8S, name)) as f:
            out.extend((name, doc) for doc in yaml.safe_load_all(f) if doc)
    return out


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _name, doc in manifests() if doc["kind"] == kind]


def test_manifests_validate_against_the_kubernetes_schemas() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    checked = 0
    for name, doc in manifests():
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: checked below
        kubernetes_validate.validate(doc, version, strict=True)
        checked += 1
    assert checked >= 6


def test_service_monitor_selects_the_metrics_service() -> None:
    (monitor,) = by_kind("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    services = [s for s in by_kind("Service") if s["metadata"]["name"] == "mpcache-metrics"]
    assert services and services[0]["metadata"]["labels"].items() >= monitor["spec"]["selector"]["matchLabels"].items()
    port_names = {p["name"] for p in services[0]["spec"]["ports"]}
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"] and "metrics" in port_names
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def test_configmap_is_accepted_by_the_server_and_matches_the_probes() -> None:
    (config_map,) = by_kind("ConfigMap")
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(config_map["data"]["mpcache.toml"])
    try:
        args, sources = cfg.parse(cli.build_parser(), ["--config", f.name], {})
        assert cli.check(args) is None
    finally:
        os.unlink(f.name)
    assert sources["ipc"] == "file" and args.metrics_host == "0.0.0.0"
    (daemonset,) = by_kind("DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["hostIPC"] is True and pod["securityContext"]["runAsNonRoot"] is True
    (server,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert ports["metrics"] == args.metrics_port
    assert server["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert server["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    socket_dir = os.path.dirname(args.ipc)
    assert any(m["mountPath"] == socket_dir for m in server["volumeMounts"])
    # the engines' side of the same socket
    for deployment in by_kind("Deployment") + by_kind("Pod"):
        spec = deployment["spec"]["template"]["spec"] if deployment["kind"] == "Deployment" else deployment["spec"]
        vllm = next(c for c in spec["containers"] if c["name"] == "vllm")
        transfer = json.loads(vllm["args"][vllm["args"].index("--kv-transfer-config") + 1])
        assert transfer["kv_connector"] == "MPCacheConnector"
        assert transfer["kv_connector_extra_config"]["mpcache.server_urls"] == "ipc://" + args.ipc
        assert spec["securityContext"]["runAsUser"] == pod["securityContext"]["runAsUser"]  # same uid: the L1 segment is 0600
        shm_shared = spec.get("hostIPC") or any(
            v.get("emptyDir", {}).get("medium") == "Memory" for v in spec.get("volumes", []))
        assert shm_shared, deployment["metadata"]["name"]


def _gib(quantity: str) -> float:
    units = {"Ki": 2**-20, "Mi": 2**-10, "Gi": 1.0, "Ti": 2**10}
    m = re.fullmatch(r"([0-9.]+)(Ki|Mi|Gi|Ti)", quantity)
    assert m is not None, quantity
    return float(m.group(1)) * units[m.group(2)]


def test_every_mpcache_container_has_memory_for_its_l1() -> None:
    # tmpfs pages are charged to the memory cgroup that reserves them: a limit below L1 is an OOM
    # kill at start (the server refuses to start instead, but the example must work as shipped)
    toml = yaml.safe_load(open(os.path.join(K8S, "mpcache-config.yaml")))["data"]["mpcache.toml"]
    config_l1 = float(re.search(r"^\s*l1-size-gb\s*=\s*([0-9.]+)", toml, re.M).group(1))  # type: ignore[union-attr]
    checked = 0
    for _name, doc in manifests():
        spec = doc.get("spec", {})
        pod = spec.get("template", {}).get("spec", spec)
        for c in pod.get("containers", []) if isinstance(pod, dict) else []:
            if not str(c.get("image", "")).startswith("mpcache"):
                continue
            args = c.get("args", [])
            l1 = float(args[args.index("--l1-size-gb") + 1]) if "--l1-size-gb" in args else config_l1
            limit = c.get("resources", {}).get("limits", {}).get("memory")
            assert limit is not None and _gib(limit) >= l1 + 1, (c["name"], limit, l1)
            checked += 1
    assert checked >= 2


def test_dashboard_queries_only_exposed_metrics() -> None:
    with open(os.path.join(DEPLOY, "grafana", "mpcache.json")) as f:
        dashboard = json.load(f)
    exposed = set()
    for name, kind, _labels, _help in METRICS:
        base = name.removesuffix("_total")
        exposed |= {base + "_total"} if kind == "counter" else (
            {base + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {base})
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used |= set(re.findall(r"\bmpcache_[a-z0-9_]+", target["expr"]))
    assert used and used <= exposed, used - exposed
    for needed in ("mpcache_lookup_hit_tokens_total", "mpcache_l1_used_bytes", "mpcache_request_latency_seconds_bucket"):
        assert needed in used, needed


def _dockerfile() -> tuple[str, str]:
    """(the whole Dockerfile, its final stage)."""
    with open(os.path.join(DEPLOY, "Dockerfile")) as f:
        text = f.read()
    return text, text[text.rindex("\nFROM "):]


def test_dockerfile_runs_non_root_with_the_documented_ports() -> None:
    text, final = _dockerfile()
    user = re.search(r"^USER (\S+)", final, re.M)
    # numeric and not 0: Kubernetes' runAsNonRoot can only check a numeric USER
    assert user is not None and user.group(1).isdigit() and int(user.group(1)) != 0
    assert re.search(r"^EXPOSE 5555 9555$", final, re.M)
    assert "--shm-size" in text
    assert "torch" not in final and "[redis]" in final


def _healthcheck() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("mpcache_healthcheck", os.path.join(DEPLOY, "healthcheck.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_healthcheck_asks_the_configured_port_not_a_fixed_one() -> None:
    _text, final = _dockerfile()
    m = re.search(r"^HEALTHCHECK\b.*?\bCMD\s+(.*)$", final, re.M | re.S)
    assert m is not None
    command = json.loads(m.group(1).splitlines()[0])  # exec form: no shell
    assert not re.search(r"\b\d{4,5}\b", m.group(1)), "a port number in the HEALTHCHECK"
    script = command[-1]
    assert re.search(rf"^COPY deploy/healthcheck\.py {re.escape(script)}$", final, re.M), script
    hc = _healthcheck()
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write('metrics-port = 9100\nmetrics-host = "0.0.0.0"\n')
    try:
        assert hc.health_url([], {}) == "http://127.0.0.1:9555/healthz"
        assert hc.health_url(["--metrics-port", "9000"], {}) == "http://127.0.0.1:9000/healthz"
        assert hc.health_url([], {"MPCACHE_METRICS_PORT": "9001"}) == "http://127.0.0.1:9001/healthz"
        assert hc.health_url(["--config", f.name], {}) == "http://127.0.0.1:9100/healthz"
        assert hc.health_url([], {"MPCACHE_CONFIG": f.name, "MPCACHE_METRICS_PORT": "9002"}).endswith(":9002/healthz")
        assert hc.health_url(["--metrics-host", "::"], {}) == "http://[::1]:9555/healthz"
        assert hc.health_url(["--no-metrics"], {}) is None
    finally:
        os.unlink(f.name)
    # the server's arguments as /proc/PID/cmdline has them, whichever way it was started
    assert hc.server_args(b"/usr/local/bin/python\0/usr/local/bin/mpcache-server\0--metrics-port\x009000\0") == [
        "--metrics-port", "9000"]
    assert hc.server_args(b"mpcache-server\0") == []
    assert hc.server_args(b"python\0-m\0mpcache.runtime_zmq.cli\0--ipc\0\0") == ["--ipc", ""]
    assert hc.server_args(b"python\0-c\0pass\0") is None


def test_healthcheck_against_a_running_server(tmp_path: Any) -> None:
    # the port comes from the server's environment only: a check that assumed 9555 would fail
    from mpcache.bench.server_process import ServerProcess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MPCACHE_METRICS_PORT=str(port))
    server = ServerProcess(["--ipc", str(tmp_path / "s.sock"), "--l1-size-gb", "0.25", "--slot-mb", "1"],
                           env=env, ready_timeout=60)
    script = os.path.join(DEPLOY, "healthcheck.py")
    check_env = dict(os.environ, PYTHONPATH=REPO)
    check_env.pop("MPCACHE_METRICS_PORT", None)
    try:
        out = subprocess.run([sys.executable, script, str(server.proc.pid)], capture_output=True, text=True,
                             env=check_env, timeout=60)
        assert out.returncode == 0, out.stderr
    finally:
        server.stop()
    out = subprocess.run([sys.executable, script, str(os.getpid())], capture_output=True, text=True,
                         env=check_env, timeout=60)
    assert out.returncode == 1 and "no mpcache-server" in out.stderr


# --------------------------------------------------------------------------- the build context

def _dockerignore_rules() -> list[tuple[bool, re.Pattern[str], str]]:
    """.dockerignore as Docker reads it: (exception, pattern, literal prefix) in file order."""
    rules = []
    with open(os.path.join(REPO, ".dockerignore")) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            exception = line.startswith("!")
            pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
            out, i = "", 0
            while i < len(pattern):
                if pattern.startswith("**/", i):
                    out, i = out + "(?:.*/)?", i + 3
                elif pattern.startswith("**", i):
                    out, i = out + ".*", i + 2
                elif pattern[i] == "*":
                    out, i = out + "[^/]*", i + 1
                elif pattern[i] == "?":
                    out, i = out + "[^/]", i + 1
                elif pattern[i] == "[":
                    j = pattern.index("]", i)
                    out, i = out + pattern[i:j + 1], j + 1
                else:
                    out, i = out + re.escape(pattern[i]), i + 1
            prefix = re.split(r"[*?\[]", pattern)[0]
            rules.append((exception, re.compile(out), prefix))
    return rules


def _ignored(path: str, rules: list[tuple[bool, re.Pattern[str], str]]) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parent folders wins."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for exception, pattern, _prefix in rules:
        if any(pattern.fullmatch(c) for c in candidates):
            ignored = not exception
    return ignored


def _build_context() -> dict[str, int]:
    """Files of this checkout that `docker build .` sends, with their sizes (ignored folders are
    not walked unless an exception may re-include something below them, as Docker does)."""
    rules = _dockerignore_rules()
    sent: dict[str, int] = {}
    for root, dirs, files in os.walk(REPO):
        rel_root = os.path.relpath(root, REPO)
        rel = (lambda name: name) if rel_root == "." else (lambda name: f"{rel_root}/{name}")
        dirs[:] = [d for d in dirs if not _ignored(rel(d), rules)
                   or any(e and p.startswith(rel(d) + "/") for e, _pattern, p in rules)]
        for name in files:
            path = rel(name)
            if not _ignored(path, rules) and os.path.isfile(os.path.join(root, name)):
                sent[path] = os.path.getsize(os.path.join(root, name))
    return sent


def test_dockerignore_keeps_the_build_context_to_what_the_image_copies() -> None:
    rules = _dockerignore_rules()
    for heavy in (".git/HEAD", ".venv/bin/python", ".venv-vllm/lib/x.so", "dist/mpcache-0.1.0.whl",
                  "build/lib/mpcache/__init__.py", "mpcache.egg-info/PKG-INFO", ".mypy_cache/3.11/x.json",
                  ".pytest_cache/v", ".hypothesis/examples/x", "mpcache/core_sm/__pycache__/x.cpython-311.pyc",
                  "tests/core_sm/test_x.py", "docs/metrics.md"):
        assert _ignored(heavy, rules), heavy
    sent = _build_context()
    # everything the Dockerfile copies from the context is in it
    _text, _final = _dockerfile()
    copied = [m.split()[:-1] for m in re.findall(r"^COPY (?!--from)(.+)$", _text, re.M)]
    for sources in copied:
        for source in sources:
            source = source.rstrip("/")
            assert source in sent or any(p.startswith(source + "/") for p in sent), source
    package = [p for p in sent if p.startswith("mpcache/")]
    assert "mpcache/runtime_zmq/cli.py" in package and "mpcache/bench/rpc_client.c" in package
    assert not [p for p in sent if "__pycache__" in p or p.endswith(".pyc")]
    total = sum(sent.values())
    assert total < 16 << 20, f"build context {total / 2**20:.1f} MiB: {sorted(sent, key=sent.get)[-5:]}"


@pytest.mark.slow
def test_image_builds() -> None:
    podman = shutil.which("podman") or shutil.which("docker")
    if podman is None:
        pytest.skip("neither podman nor docker is installed")
    out = subprocess.run([podman, "build", "-f", "deploy/Dockerfile", "-t", "localhost/mpcache:test", "."], cwd=REPO,
                         capture_output=True, text=True, timeout=1200)
    if "pinging container registry" in out.stderr or "no such host" in out.stderr:
        pytest.skip("no container registry reachable for the base image: " + out.stderr.strip().splitlines()[-1])
    assert out.returncode == 0, out.stderr[-3000:]
    run = subprocess.run([podman, "run", "--rm", "localhost/mpcache:test", "--version"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("mpcache-server ")


# ------------------------------------------------------------------------------------ secrets

def _config_toml(redis: bool) -> str:
    """The ConfigMap's TOML as shipped, or its Redis variant: the commented `l2 = ...` line on."""
    (config_map,) = by_kind("ConfigMap")
    toml = config_map["data"]["mpcache.toml"]
    if redis:
        toml, n = re.subn(r"^(\s*)#\s*(l2\s*=\s*\[\"redis://)", r"\1\2", toml, flags=re.M)
        assert n == 1, "the ConfigMap has no commented Redis line to turn on"
    return toml


def _parse_toml(toml: str) -> Any:
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(toml)
    try:
        args, _sources = cfg.parse(cli.build_parser(), ["--config", f.name], {})
        assert cli.check(args) is None
    finally:
        os.unlink(f.name)
    return args


def _daemonset_pod() -> dict[str, Any]:
    (daemonset,) = by_kind("DaemonSet")
    return daemonset["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def _mount_of(container: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The volume mount a path lies under (the deepest), or None: the image's own root."""
    under = [m for m in container.get("volumeMounts", [])
             if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    return max(under, key=lambda m: len(m["mountPath"])) if under else None


def test_redis_variant_validates_and_reads_its_secrets_from_a_secret() -> None:
    # Turning on the Redis line must not make a server that writes its own secrets: the read-only
    # root refuses the file (a crash loop), and per-pod secrets could not share one L2.
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    (config_map,) = by_kind("ConfigMap")
    variant = json.loads(json.dumps(config_map))
    variant["data"]["mpcache.toml"] = _config_toml(redis=True)
    kubernetes_validate.validate(variant, kubernetes_validate.latest_version(), strict=True)
    args = _parse_toml(variant["data"]["mpcache.toml"])
    assert args.l2 and args.l2[0].startswith("redis://")
    pod = _daemonset_pod()
    (server,) = pod["containers"]
    assert server["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    for option in ("l2_secret_file", "chunk_key_file"):
        path = getattr(args, option)
        assert path, f"--{option.replace('_', '-')} is not set: each pod would make its own"
        mount = _mount_of(server, path)
        assert mount is not None, f"{path} is on the image's read-only root"
        assert mount.get("readOnly") is True, f"{path}: the server's secrets are mounted read-only"
        volume = volumes[mount["name"]]
        name = os.path.basename(path)
        if "secret" in volume:
            continue  # straight from a Secret (the server would refuse its symlinks: see below)
        # else a memory emptyDir an init container fills from a Secret volume, file by file
        assert volume.get("emptyDir", {}).get("medium") == "Memory", f"{path}: secrets stay off disk"
        fillers = [c for c in pod.get("initContainers", [])
                   if any(m["name"] == mount["name"] and not m.get("readOnly") for m in c["volumeMounts"])]
        assert len(fillers) == 1, f"{path}: no init container fills {mount['name']}"
        (filler,) = fillers
        sources = [m for m in filler["volumeMounts"] if "secret" in volumes[m["name"]]]
        assert sources and all(m.get("readOnly") is True for m in sources)
        assert any(os.path.join(m["mountPath"], name) in filler["command"] for m in sources), (name, filler["command"])


def test_the_shipped_config_parses_without_redis_too() -> None:
    args = _parse_toml(_config_toml(redis=False))
    assert not args.l2 and args.chunk_key_file


def _secret_volume_layout(root: str, files: dict[str, str]) -> None:
    """What the kubelet makes of a Secret volume: root-owned 0400 files in a timestamped
    directory, reached through the symlinks ``..data`` and ``NAME -> ..data/NAME``."""
    stamp = os.path.join(root, "..2026_12_03_00_00_00.000000000")
    os.mkdir(stamp)
    for name, text in files.items():
        with open(os.path.join(stamp, name), "w") as f:
            f.write(text)
        os.chmod(os.path.join(stamp, name), 0o400)
    os.symlink(os.path.basename(stamp), os.path.join(root, "..data"))
    for name in files:
        os.symlink(os.path.join("..data", name), os.path.join(root, name))


def _as_uid(uid: int, fn: Any) -> tuple[bool, str]:
    """``fn()`` in a forked child running as ``uid`` (and gid): (ok, its result or error)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            try:
                out = "ok " + str(fn())
            except Exception as e:
                out = "error " + str(e)
            os.write(write, out.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        text = f.read().decode()
    os.waitpid(pid, 0)
    return text.startswith("ok "), text.partition(" ")[2]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("install") is None,
                    reason="runs the init container's command as root and the server's reads as its uid")
def test_the_server_uid_reads_the_secrets_the_init_container_copies() -> None:
    from mpcache.runtime_zmq.l2_seal import load_or_create_secret

    pod = _daemonset_pod()
    uid = pod["securityContext"]["runAsUser"]
    (server,) = pod["containers"]
    (filler,) = [c for c in pod["initContainers"] if c["name"] == "secrets"]
    keys = {"l2.secret": "ab" * 32, "chunk.key": "cd" * 32}
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        # the pod's volumes as directories here; the command runs with its mount paths mapped
        paths = {v["name"]: os.path.join(tmp, v["name"]) for v in pod["volumes"]}
        for p in paths.values():
            os.mkdir(p, 0o777)
            os.chmod(p, 0o777)  # an emptyDir is world-writable
        secret_volume = next(n for n, v in {v["name"]: v for v in pod["volumes"]}.items() if "secret" in v)
        _secret_volume_layout(paths[secret_volume], keys)
        mapping = {m["mountPath"]: paths[m["name"]] for m in filler["volumeMounts"]}

        def local(arg: str) -> str:
            for mount_path, here in sorted(mapping.items(), key=lambda kv: -len(kv[0])):
                if arg == mount_path or arg.startswith(mount_path.rstrip("/") + "/"):
                    return here + arg[len(mount_path.rstrip("/")):]
            return arg

        out = subprocess.run([local(a) for a in filler["command"]], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        # the server, as its uid, reads each file where its own mounts put them
        args = _parse_toml(_config_toml(redis=True))
        for option, name in (("l2_secret_file", "l2.secret"), ("chunk_key_file", "chunk.key")):
            mount = _mount_of(server, getattr(args, option))
            assert mount is not None
            here = paths[mount["name"]] + getattr(args, option)[len(mount["mountPath"].rstrip("/")):]
            ok, text = _as_uid(uid, lambda: load_or_create_secret(here).hex())
            assert ok and text == keys[name], text
        # and the Secret volume as the kubelet lays it out is refused: why the copy exists
        ok, text = _as_uid(uid, lambda: load_or_create_secret(os.path.join(paths[secret_volume], "l2.secret")))
        assert not ok, text
