"""Real vLLM (CPU) on a tiny random model that mixes full-attention and sliding-window layers
(Gemma3, ``layer_types``), with vLLM's hybrid KV-cache manager on, reported as JSON for
``tests/e2e/test_vllm_hybrid.py``.

* ``build``: writes the model (``tiny_llama.py``'s tokenizer, a Gemma3 config of 4 layers,
  sliding / full / sliding / full, window ``--window`` tokens) into ``--model``.
* ``baseline``: no connector, prefix caching off: the greedy outputs to match.
* ``connector``: an ``mpcache-server`` (chunk ``--chunk``), then two fresh vLLM processes
  (``phase``) with ``MPCacheHMAConnector`` on it, one after the other: run 1 stores, run 2 loads.
  The report carries each run's outputs and log, and the server's object count.
* ``phase``: one vLLM run with the connector (``--url``), every prompt once.

Usage: python tests/e2e/vllm_hybrid_driver.py MODE --model DIR [--out REPORT.json] [--port N]
[--chunk N] [--window N] [--url URL]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_driver import generate, make_llm  # noqa: E402

# name -> (length, seed): shorter than the window, and longer (one chunk, several chunks)
PROMPTS = {"p180": (180, 11), "p300": (300, 12), "p520": (520, 13), "p700": (700, 14)}
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def prompts() -> dict[str, list[int]]:
    import random

    out = {}
    for name, (length, seed) in PROMPTS.items():
        rng = random.Random(seed)
        out[name] = [4 + rng.randrange(508) for _ in range(length)]
    return out


def build(out: Path, window: int) -> None:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    import tiny_llama

    tiny_llama.build(out)  # the tokenizer (and a Llama config, replaced below)
    dims = tiny_llama.TINY
    head_dim = dims["hidden"] // dims["heads"]
    config = Gemma3TextConfig(vocab_size=len(tiny_llama.SPECIAL_TOKENS) + tiny_llama.VOCAB_WORDS,
                              hidden_size=dims["hidden"], intermediate_size=dims["intermediate"],
                              num_hidden_layers=len(LAYER_TYPES), num_attention_heads=dims["heads"],
                              num_key_value_heads=dims["kv_heads"], head_dim=head_dim, query_pre_attn_scalar=head_dim,
                              max_position_embeddings=dims["max_len"], sliding_window=window, layer_types=LAYER_TYPES,
                              bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=True,
                              torch_dtype="float32")
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    (out / "mpcache_tiny.json").unlink(missing_ok=True)  # not tiny_llama's model any more


def transfer_config(url: str, chunk: int) -> dict[str, Any]:
    return {
        "kv_connector": "MPCacheHMAConnector",
        "kv_connector_module_path": "mpcache.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"mpcache.server_urls": url, "mpcache.request_timeout_s": 5.0,
                                      "mpcache.chunk_size": chunk},
    }


def phase(args: argparse.Namespace) -> dict[str, Any]:
    import mpcache

    print("mpcache imported from", mpcache.__file__, flush=True)
    llm = make_llm(args.model, transfer_config(args.url, args.chunk))
    return {"results": {name: generate(llm, ids) for name, ids in prompts().items()}}


def connector(args: argparse.Namespace) -> dict[str, Any]:
    from mpcache.runtime_zmq.client import MPCacheClient

    url = f"tcp://127.0.0.1:{args.port}"
    out = Path(args.out)
    exe = Path(sys.executable).with_name("mpcache-server")
    log = open(out.with_suffix(".server.log"), "ab")
    # the server is a console script of this venv: it must import this checkout's mpcache too
    server = subprocess.Popen([str(exe), "--host", "127.0.0.1", "--port", str(args.port), "--chunk-size",
                               str(args.chunk), "--l1-size-gb", "0.0625", "--no-l1-reserve"],
                              stdout=log, stderr=subprocess.STDOUT)
    report: dict[str, Any] = {"runs": {}}
    try:
        with MPCacheClient(url, request_timeout=2.0, wait_connected=False) as client:
            assert client.wait_healthy(30.0), "mpcache-server did not start"
        for run in ("store", "load"):  # a fresh vLLM each: run 2 has only mpcache to load from
            path = out.with_suffix(f".{run}.json")
            run_log = out.with_suffix(f".{run}.log")
            with open(run_log, "wb") as sink:
                subprocess.run([sys.executable, __file__, "phase", "--model", args.model, "--out", str(path),
                                "--url", url, "--chunk", str(args.chunk)], stdout=sink, stderr=subprocess.STDOUT,
                               check=True, timeout=600)
            report["runs"][run] = json.loads(path.read_text())
            report["runs"][run]["log"] = run_log.read_text(errors="replace")
        with MPCacheClient(url, request_timeout=5.0) as client:
            report["objects"] = dict(client.stats()).get("objects")
        return report
    finally:
        server.terminate()
        server.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("build", "baseline", "connector", "phase"))
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", default="")
    parser.add_argument("--port", type=int, default=15557)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--window", type=int, default=200)
    parser.add_argument("--url", default="")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.mode == "build":
        build(Path(args.model), args.window)
        return 0
    t0 = time.perf_counter()
    if args.mode == "baseline":
        llm = make_llm(args.model, None)
        report = {"results": {name: generate(llm, ids) for name, ids in prompts().items()}}
    elif args.mode == "phase":
        report = phase(args)
    else:
        report = connector(args)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
