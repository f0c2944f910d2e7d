"""Build a tiny random Llama (weights + word-level tokenizer) in a local folder, offline.

The real-vLLM end-to-end test needs a model vLLM's CPU backend can load without any hub access.
Two layers, hidden 64, two KV heads of 32 (the smallest head size the CPU attention backend
accepts), 512-word vocabulary: about 150k parameters, built in seconds, deterministic for a seed.

Usage: python tests/e2e/tiny_llama.py OUT_DIR [--seed N] [--hidden H --layers L --heads N
--kv-heads K --intermediate I --max-len T] (the size flags build a larger random model, as
``mpcache-bench ttft`` does; the defaults are the tiny one).
Prompts for it are space-separated words ``w0 .. w507`` (see ``prompt_words``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

VOCAB_WORDS = 508
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")


def prompt_words(n: int, seed: int) -> str:
    """A deterministic prompt of ``n`` vocabulary words (one token each) for a given seed."""
    import random

    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(n))


TINY = {"hidden": 64, "layers": 2, "heads": 2, "kv_heads": 2, "intermediate": 128, "max_len": 2048}


def build(out_dir: Path, seed: int = 0, **size: int) -> Path:
    """Write config, safetensors weights and tokenizer files into ``out_dir``; return it.

    ``size`` overrides the tiny model's dimensions (``TINY``'s keys). Reuses an existing folder
    built with the same seed and size (a ``mpcache_tiny.json`` stamp says which).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dims = {**TINY, **size}
    stamp = out_dir / "mpcache_tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()) == {"seed": seed, **dims}:
        return out_dir

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    words = list(SPECIAL_TOKENS) + [f"w{i}" for i in range(VOCAB_WORDS)]
    vocab = {word: index for index, word in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # A decoder that joins words with spaces, so decoded text round-trips through the tokenizer.
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    ).save_pretrained(out_dir)

    config = LlamaConfig(
        vocab_size=len(words),
        hidden_size=dims["hidden"],
        intermediate_size=dims["intermediate"],
        num_hidden_layers=dims["layers"],
        num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"],
        max_position_embeddings=dims["max_len"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    stamp.write_text(json.dumps({"seed": seed, **dims}))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    for name, default in TINY.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    args = parser.parse_args(argv)
    print(build(args.out_dir, args.seed, **{name: getattr(args, name) for name in TINY}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
