"""Real vLLM (CPU) on a tiny random sliding-window model (Mistral, window 128 tokens), with or
without mpcache, reported as JSON for ``tests/e2e/test_vllm_sliding_window.py``.

* ``build``: writes the model (``tiny_llama.py``'s tokenizer and size, a Mistral config with
  ``sliding_window``) into ``--model``.
* ``baseline``: no connector, prefix caching off: the greedy outputs to match.
* ``connector``: an ``mpcache-server`` on its default slot sizing (no ``--slot-mb``: L1's slots
  follow the objects registered), vLLM with ``MPCacheConnector`` (not SupportsHMA: vLLM runs the
  model with one KV-cache group), the prompts twice: a miss that stores, then a hit that loads.
  The report carries vLLM's log lines about the hybrid KV-cache manager and the server's L1.

Usage: python tests/e2e/vllm_swa_driver.py MODE --model DIR --out REPORT.json [--port N]
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
from vllm_driver import generate, make_llm, prompts, transfer_config  # noqa: E402

WINDOW = 128


def build(out: Path) -> None:
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    import tiny_llama

    tiny_llama.build(out)  # the tokenizer (and a Llama config, replaced below)
    dims = tiny_llama.TINY
    config = MistralConfig(vocab_size=len(tiny_llama.SPECIAL_TOKENS) + tiny_llama.VOCAB_WORDS,
                           hidden_size=dims["hidden"], intermediate_size=dims["intermediate"],
                           num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"],
                           num_key_value_heads=dims["kv_heads"], head_dim=dims["hidden"] // dims["heads"],
                           max_position_embeddings=dims["max_len"], sliding_window=WINDOW, bos_token_id=1,
                           eos_token_id=2, pad_token_id=3, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(out, safe_serialization=True)
    (out / "mpcache_tiny.json").unlink(missing_ok=True)  # not tiny_llama's model any more


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = ("p300", "p520")
    if args.mode == "baseline":
        llm = make_llm(args.model, None)
        return {"results": {n: generate(llm, prompts()[n]) for n in names}}
    from mpcache.runtime_zmq.client import MPCacheClient

    url = f"tcp://127.0.0.1:{args.port}"
    exe = Path(sys.executable).with_name("mpcache-server")
    log = open(Path(args.out).with_suffix(".server.log"), "ab")
    server = subprocess.Popen([str(exe), "--host", "127.0.0.1", "--port", str(args.port), "--chunk-size", "256",
                               "--l1-size-gb", "0.0625", "--no-l1-reserve"], stdout=log, stderr=subprocess.STDOUT)
    try:
        with MPCacheClient(url, request_timeout=2.0, wait_connected=False) as client:
            assert client.wait_healthy(30.0), "mpcache-server did not start"
        llm = make_llm(args.model, transfer_config(url))
        phases = {phase: {n: generate(llm, prompts()[n]) for n in names} for phase in ("miss", "hit")}
        with MPCacheClient(url, request_timeout=5.0) as client:
            stats, l1 = dict(client.stats()), dict(client.l1_info())
        return {"phases": phases, "objects": stats.get("objects"), "l1": l1}
    finally:
        server.terminate()
        server.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("build", "baseline", "connector"))
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", default="")
    parser.add_argument("--port", type=int, default=15556)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.mode == "build":
        build(Path(args.model))
        return 0
    t0 = time.perf_counter()
    report = run(args)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
