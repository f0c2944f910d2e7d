"""Metrics: names and help generated from one list (docs/metrics.md in sync), `promtool check
metrics` clean, hit tokens counted once per lookup with bounded labels, and a real Prometheus
scraping a live server and answering a query for the hit-token counter."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable

import pytest

from live_server import REPO, ServerProcess, wait_for
from mpcache.runtime_zmq import metrics
from mpcache.runtime_zmq.client import MPCacheClient
from test_ops_http import get, http_url
from test_server_ops import key, register, store_chunks, tokens


def scrape(sp: ServerProcess) -> str:
    code, body = get(http_url(sp) + "/metrics")
    assert code == 200
    return body


def hit_once(c: MPCacheClient, salt: str = "") -> None:
    """Store 2 chunks, then a lookup of them (512 tokens) from another request."""
    register(c, 1)
    toks = tokens(2, seed=11)
    store_chunks(c, toks, "store-1")
    c.lookup(key(toks, "hit-1", salt=salt)).result(5)
    assert c.wait_prefetch_status("hit-1", 1.0).result(5) == 2


def families(body: str) -> set[str]:
    return {line.split()[2].removesuffix("_total") for line in body.splitlines() if line.startswith("# TYPE ")}


def test_metrics_doc_is_generated_from_the_list() -> None:
    with open(os.path.join(REPO, "docs", "metrics.md")) as f:
        assert f.read() == metrics.render_markdown(), (
            "docs/metrics.md is out of date: run `python -m mpcache.runtime_zmq.metrics > docs/metrics.md`")


def test_exposition_matches_the_list_and_passes_promtool(start_server: Callable[..., ServerProcess]) -> None:
    sp = start_server()
    with MPCacheClient(sp.url) as c:
        hit_once(c)
        c.lookup(key(tokens(1, seed=99), "miss-1")).result(5)
        assert c.wait_prefetch_status("miss-1", 1.0).result(5) == 0
        assert c.wait_prefetch_status("hit-1", 1.0).result(5) == 2  # a repeated status counts no new hit
    time.sleep(1.2)  # gauges refresh once a second
    body = scrape(sp)
    declared = {name.removesuffix("_total") for name, *_ in metrics.METRICS}
    assert {f for f in families(body) if not f.startswith(metrics.STANDARD_FAMILIES)} == declared
    assert 'mpcache_lookup_hit_tokens_total{cache_salt_hash="",model_name="m"} 512.0' in body
    assert 'mpcache_lookup_requested_tokens_total{cache_salt_hash="",model_name="m"} 768.0' in body
    assert 'mpcache_lookups_total{cache_salt_hash="",model_name="m"} 2.0' in body
    assert 'mpcache_l1_objects 2.0' in body and "mpcache_l1_capacity_bytes 2.68435456e+08" in body
    assert 'mpcache_stores_total{outcome="ok"} 1.0' in body
    assert 'mpcache_registered_instances 1.0' in body
    assert "mpcache_build_info{" in body and "mpcache_up 1.0" in body
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool is not installed (apt-get install prometheus)"
    out = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr


def test_label_cardinality_is_bounded(start_server: Callable[..., ServerProcess]) -> None:
    sp = start_server()
    with MPCacheClient(sp.url) as c:
        futures = [c.lookup(key(tokens(1, seed=i), f"r{i}", salt=f"tenant-{i}")) for i in range(metrics.LABEL_BUDGET + 20)]
        for f in futures:
            f.result(5)
    body = scrape(sp)
    series = [line for line in body.splitlines() if line.startswith("mpcache_lookups_total{")]
    assert len(series) == metrics.LABEL_BUDGET + 1
    assert 'mpcache_lookups_total{cache_salt_hash="other",model_name="other"} 20.0' in body


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_real_prometheus_scrapes_the_hit_token_counter(start_server: Callable[..., ServerProcess]) -> None:
    prometheus = shutil.which("prometheus")
    assert prometheus is not None, "prometheus is not installed (apt-get install prometheus)"
    sp = start_server()
    target = http_url(sp).removeprefix("http://")
    d = tempfile.mkdtemp(prefix="mpcache-prom-")
    with open(os.path.join(d, "prometheus.yml"), "w") as f:
        f.write(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            f"scrape_configs:\n  - job_name: mpcache\n    static_configs:\n      - targets: ['{target}']\n"
        )
    port = free_port()
    proc = subprocess.Popen(
        [prometheus, f"--config.file={d}/prometheus.yml", f"--storage.tsdb.path={d}/data",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        with MPCacheClient(sp.url) as c:
            hit_once(c)
        api = f"http://127.0.0.1:{port}/api/v1/query?query="

        def query(expr: str) -> list[dict[str, object]]:
            try:
                with urllib.request.urlopen(api + urllib.parse.quote(expr), timeout=5) as r:
                    answer = json.loads(r.read())
            except OSError:
                return []
            return list(answer["data"]["result"]) if answer.get("status") == "success" else []

        def hit_tokens() -> float | None:
            rows = query('mpcache_lookup_hit_tokens_total{model_name="m"}')
            return float(rows[0]["value"][1]) if rows else None  # type: ignore[index]

        assert wait_for(lambda: hit_tokens() == 512.0, timeout=30.0), query("up")
        up = query('up{job="mpcache"}')
        assert up and up[0]["value"][1] == "1"  # type: ignore[index]
        ratio = query("sum(mpcache_lookup_hit_tokens_total) / sum(mpcache_lookup_requested_tokens_total)")
        assert ratio and float(ratio[0]["value"][1]) == 1.0  # type: ignore[index]
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("stat", ["jobs", "leases_held", "tombstones", "l2_in_flight", "objects", "tenants", "reap_queue"])
def test_live_sizes_are_gauges(stat: str) -> None:
    assert metrics._is_gauge(stat)


@pytest.mark.parametrize("stat", ["lookups", "hit_chunks", "evictions", "reaped_jobs", "evictions_for_others",
                                  "instances_failed", "instances_reaped"])
def test_monotonic_counts_are_counters(stat: str) -> None:
    assert not metrics._is_gauge(stat)


def test_dashboard_names_standard_collectors_and_no_duplicate_series(start_server: Callable[..., ServerProcess]) -> None:
    # "Operable" item 4: vLLM's and LMCache's label name, the process_/python_ collectors every
    # exporter has, and the catch-all families holding only what no first-class family shows
    sp = start_server()
    with MPCacheClient(sp.url) as c:
        hit_once(c)
    time.sleep(1.2)
    body = scrape(sp)
    assert 'mpcache_lookups_total{cache_salt_hash="",model_name="m"} 1.0' in body
    assert "model=" not in body.replace("model_name=", "")
    for standard in ("process_resident_memory_bytes", "process_open_fds", "python_info", "python_gc_objects_collected_total"):
        assert f"\n{standard}" in body, standard
    for duplicate in ("objects", "evictions", "leases_held", "instances", "l1_num_slots", "free_slots", "malformed",
                      "dropped_replies", "l2_reads", "l2_read_hits", "block_allocation_records"):
        assert f'{{name="{duplicate}"}}' not in body and f'{{counter="{duplicate}"}}' not in body, duplicate
    assert 'mpcache_state{name="jobs"}' in body and 'mpcache_sm_total{counter="lookups"}' in body  # only there
