"""Tenant-safe keys and per-request load caps through the adapters, in vLLM's call order, against
a real ``mpcache-server`` (no vLLM): salt, LoRA identity and per-chunk extras reach the worker's
stores and retrieves; ``max_load_tokens`` / ``max_offload_tokens`` cap what moves."""
from __future__ import annotations

import random
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from mpcache.core_sm.keys import KeyExtras, chunk_extra_digest, request_identity
from mpcache.runtime_zmq.client import MPCacheClient
from mpcache.runtime_zmq.vllm_keys import RequestKeyer, UnkeyableConfig, UnkeyableRequest
from adapter_driver import CHUNK, Engine

SERVER_FLAGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.0625", "--slot-mb", "1")
LORA_A = KeyExtras(request_identity(lora_name="a", lora_path="/adapters/a"))
LORA_B = KeyExtras(request_identity(lora_name="b", lora_path="/adapters/b"))


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def objects(url: str) -> int:
    with MPCacheClient(url, request_timeout=5.0) as client:
        return int(client.stats()["objects"])


@pytest.fixture
def engine(start_server: Callable[..., Any]) -> Iterator[tuple[Engine, str]]:
    server = start_server(*SERVER_FLAGS)
    eng = Engine([server.url])
    yield eng, server.url
    eng.close()


def run(eng: Engine, rid: str, prompt: list[int], **keyed: Any) -> int:
    req = eng.add(rid, prompt, **keyed)
    eng.run_all()
    assert req.external == 0 or req.checked
    return req.external


def test_two_adapters_on_one_prompt_never_share_and_each_hits_its_own(engine: tuple[Engine, str]) -> None:
    eng, url = engine
    prompt = tokens(3 * CHUNK + 5, 1)
    assert run(eng, "a1", prompt, extras=LORA_A) == 0
    assert run(eng, "b1", prompt, extras=LORA_B) == 0  # same tokens, other adapter: a miss
    assert run(eng, "base", prompt) == 0  # no adapter: a miss too
    assert objects(url) == 9
    assert run(eng, "a2", prompt, extras=LORA_A) == 3 * CHUNK
    assert run(eng, "b2", prompt, extras=LORA_B) == 3 * CHUNK


def test_cache_salt_reaches_the_worker_store(engine: tuple[Engine, str]) -> None:
    eng, _ = engine
    prompt = tokens(2 * CHUNK + 3, 2)
    assert run(eng, "t1-a", prompt, cache_salt="tenant-1") == 0
    assert run(eng, "t1-b", prompt, cache_salt="tenant-1") == 2 * CHUNK
    assert run(eng, "t2", prompt, cache_salt="tenant-2") == 0


def test_an_image_chunk_shares_only_the_text_before_it(engine: tuple[Engine, str]) -> None:
    eng, _ = engine
    prompt = tokens(3 * CHUNK + 1, 3)
    img1 = KeyExtras("", (b"", chunk_extra_digest([("mm", "img-1", 7)])))
    img2 = KeyExtras("", (b"", chunk_extra_digest([("mm", "img-2", 7)])))
    assert run(eng, "i1", prompt, extras=img1) == 0
    assert run(eng, "i2", prompt, extras=img2) == CHUNK  # chunk 0 holds no image
    assert run(eng, "i1-again", prompt, extras=img1) == 3 * CHUNK


def test_max_load_tokens_caps_and_zero_opts_out(engine: tuple[Engine, str]) -> None:
    eng, _ = engine
    prompt = tokens(4 * CHUNK + 2, 4)
    run(eng, "w", prompt)
    assert run(eng, "cap", prompt, max_load_tokens=2 * CHUNK + 10) == 2 * CHUNK
    assert run(eng, "zero", prompt, max_load_tokens=0) == 0
    assert run(eng, "full", prompt) == 4 * CHUNK


def test_max_offload_tokens_caps_the_store(engine: tuple[Engine, str]) -> None:
    eng, url = engine
    prompt = tokens(4 * CHUNK + 2, 5)
    run(eng, "w", prompt, max_offload_tokens=CHUNK + 1)
    assert objects(url) == 1
    assert run(eng, "r", prompt) == CHUNK


# ------------------------------------------------------------------ the vLLM-side keyer


def _config(**model: Any) -> Any:
    fields = dict(dtype="torch.bfloat16", revision=None, quantization=None, hf_overrides=None,
                  is_multimodal_model=False, enable_prompt_embeds=False)
    fields.update(model)
    return types.SimpleNamespace(model_config=types.SimpleNamespace(**fields),
                                 cache_config=types.SimpleNamespace(cache_dtype="auto"))


def _request(rid: str, lora: tuple[str, str] | None = None, **kw: Any) -> Any:
    lora_request = None if lora is None else types.SimpleNamespace(lora_name=lora[0], lora_path=lora[1])
    return types.SimpleNamespace(request_id=rid, lora_request=lora_request, mm_features=kw.get("mm"),
                                 prompt_embeds=None, num_prompt_tokens=kw.get("n", 4 * CHUNK))


def test_keyer_identity_has_dtype_and_lora() -> None:
    keyer = RequestKeyer.from_vllm_config(_config(), CHUNK)
    plain = keyer.extras(_request("p"))
    a = keyer.extras(_request("a", ("a", "/a")))
    b = keyer.extras(_request("b", ("b", "/b")))
    moved = keyer.extras(_request("a2", ("a", "/elsewhere")))
    assert "bfloat16" in plain.identity and not plain.chunk_extras
    assert len({plain.identity, a.identity, b.identity, moved.identity}) == 4
    fp8 = RequestKeyer.from_vllm_config(types.SimpleNamespace(
        model_config=_config().model_config, cache_config=types.SimpleNamespace(cache_dtype="fp8")), CHUNK)
    assert fp8.extras(_request("p")).identity != plain.identity
    other = RequestKeyer.from_vllm_config(_config(), CHUNK, model_identity="sha256:abc")
    assert other.extras(_request("p")).identity != plain.identity


def test_keyer_refuses_configs_it_cannot_key() -> None:
    with pytest.raises(UnkeyableConfig, match="multimodal"):
        RequestKeyer.from_vllm_config(_config(is_multimodal_model=True), CHUNK, extra_keys_fn=None)
    with pytest.raises(UnkeyableConfig, match="prompt_embeds"):
        RequestKeyer.from_vllm_config(_config(enable_prompt_embeds=True), CHUNK, extra_keys_fn=None)
    with pytest.raises(UnkeyableConfig, match="hf_overrides"):
        RequestKeyer.from_vllm_config(_config(hf_overrides={"rope_theta": 1.0}), CHUNK)
    RequestKeyer.from_vllm_config(_config(hf_overrides={"rope_theta": 1.0}), CHUNK, model_identity="tuned")


def test_keyer_per_chunk_extras_from_the_engines_extra_keys() -> None:
    def extra_keys(request: Any, start: int, end: int, mm_index: int) -> tuple[Any, int]:
        # vLLM's shape: LoRA and salt entries (keyed elsewhere) plus the chunk's mm entries.
        keys: list[Any] = [("lora", "a", "/a")]
        for ident, offset in request.mm_features:
            if start <= offset < end:
                keys.append(("mm", ident, offset - start))
        return tuple(keys), mm_index

    keyer = RequestKeyer.from_vllm_config(_config(is_multimodal_model=True), CHUNK, extra_keys_fn=extra_keys)
    one = keyer.extras(_request("1", mm=[("img-1", CHUNK + 3)]))
    two = keyer.extras(_request("2", mm=[("img-2", CHUNK + 3)]))
    assert len(one.chunk_extras) == 2 and one.chunk_extras[0] == b"" and one.chunk_extras[1]
    assert one.chunk_extras[1] != two.chunk_extras[1]
    assert keyer.extras(_request("t")).chunk_extras == ()  # text only: no per-chunk extras
    with pytest.raises(UnkeyableRequest):
        keyer.extras(_request("bad", mm=[(1.5, 0)]))


# ------------------------------------------------------------------ wire


def test_wire_key_extras_round_trip_and_lmcache_keys_carry_none() -> None:
    from mpcache.core_sm.keys import NO_EXTRAS
    from mpcache.core_sm.messages import CacheKey
    from mpcache.runtime_zmq.wire import Limits, _Bad, decode_key, encode_key

    limits = Limits()
    plain = CacheKey("m", 1, None, list(range(8)), 0, 8, "r")
    lmcache_map = encode_key(plain)
    assert "key_identity" not in lmcache_map and "chunk_extras" not in lmcache_map
    assert decode_key(lmcache_map, limits).extras == NO_EXTRAS
    extras = KeyExtras("lora=1:a", (b"", b"\x01" * 16))
    keyed = CacheKey("m", 1, None, list(range(8)), 0, 8, "r", "", extras)
    assert decode_key(encode_key(keyed), limits).extras == extras
    for bad in ({"key_identity": 5}, {"chunk_extras": "x"}, {"chunk_extras": ["str"]}):
        with pytest.raises(_Bad):
            decode_key({**lmcache_map, **bad}, limits)


# ------------------------------------------------------------------ store admission (--store-threshold)


def test_store_threshold_stores_a_prompt_at_its_second_lookup(start_server: Callable[..., Any]) -> None:
    server = start_server(*SERVER_FLAGS, "--store-threshold", "2")
    eng = Engine([server.url])
    try:
        prompt = tokens(2 * CHUNK + 1, 9)
        assert run(eng, "first", prompt) == 0
        assert objects(server.url) == 0  # one lookup so far: not admitted
        assert run(eng, "second", prompt) == 0
        assert objects(server.url) == 2
        assert run(eng, "third", prompt) == 2 * CHUNK
    finally:
        eng.close()
