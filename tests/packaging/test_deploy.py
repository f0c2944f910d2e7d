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
import subprocess
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


def test_dockerfile_runs_non_root_with_the_documented_ports() -> None:
    with open(os.path.join(DEPLOY, "Dockerfile")) as f:
        text = f.read()
    final = text[text.rindex("\nFROM "):]
    user = re.search(r"^USER (\S+)", final, re.M)
    assert user is not None and user.group(1) not in ("0", "root")
    assert re.search(r"^EXPOSE 5555 9555$", final, re.M)
    assert "/healthz" in final and "--shm-size" in text
    assert "torch" not in final and "[redis]" in final


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
