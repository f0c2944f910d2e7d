"""Real vLLM (CPU) with two LoRA adapters on one prompt through mpcache, reported as JSON.

Run inside the vLLM venv (``.venv-vllm``); ``tests/e2e/test_vllm_lora.py`` checks the report.
Two tiny random adapters are written in PEFT's layout (``adapter_config.json`` +
``adapter_model.safetensors`` with ``q_proj``/``v_proj`` ``lora_A``/``lora_B``; no hub, no
peft), then one vLLM with ``enable_lora`` (prefix caching off, so every hit comes from mpcache)
runs the same prompt as: adapter A, adapter B, no adapter (each must miss: different KV), then
A and B again (each must hit its own KV and reproduce its own first output).

Usage: python tests/e2e/vllm_lora_driver.py --model DIR --out REPORT.json [--port N]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from vllm_driver import ServerProcess  # beside this script (run as a script, its folder is on sys.path)

RANK = 8
MAX_TOKENS = 12


def write_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    """A random rank-8 LoRA on every layer's q_proj and v_proj, large enough to change outputs."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden = config["hidden_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for proj, width in (("q_proj", heads * head_dim), ("v_proj", kv_heads * head_dim)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, hidden, generator=gen) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(width, RANK, generator=gen) * 0.5
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0, "bias": "none", "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": str(model_dir), "fan_in_fan_out": False, "modules_to_save": None,
    }))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--port", type=int, default=15556)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    model = Path(args.model)
    work = Path(args.out).parent
    adapters = {name: write_adapter(model, work / f"lora_{name}", seed) for name, seed in (("a", 1), ("b", 2))}
    requests = {name: LoRARequest(f"adapter-{name}", i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
    import random

    rng = random.Random(7)
    prompt = [4 + rng.randrange(508) for _ in range(300)]
    server = ServerProcess(args.port, Path(args.out).with_suffix(".server.log"))
    report: dict[str, Any] = {"server_start_s": round(server.start(), 3), "runs": {}}
    try:
        transfer = {
            "kv_connector": "MPCacheConnector",
            "kv_connector_module_path": "mpcache.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"mpcache.server_urls": server.url, "mpcache.chunk_size": 256},
        }
        t0 = time.perf_counter()
        llm = LLM(model=str(model), tokenizer=str(model), dtype="float32", enforce_eager=True, max_model_len=1024,
                  max_num_seqs=4, seed=0, enable_prefix_caching=False, enable_lora=True, max_lora_rank=RANK,
                  max_loras=2, kv_transfer_config=transfer)
        report["init_s"] = round(time.perf_counter() - t0, 2)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        for run, lora in (("a1", "a"), ("b1", "b"), ("base1", None), ("a2", "a"), ("b2", "b")):
            (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False,
                                     lora_request=None if lora is None else requests[lora])
            report["runs"][run] = {
                "output_ids": list(output.outputs[0].token_ids),
                "num_cached_tokens": int(output.num_cached_tokens or 0),
                "objects": server.stats()["objects"],
            }
        del llm
    finally:
        server.stop()
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
