"""What of a vLLM request, besides its tokens and cache salt, goes into mpcache's chunk keys.

``RequestKeyer.from_vllm_config(vllm_config, model_identity)`` runs once at connector start and
refuses (``UnkeyableConfig``, a ``ValueError`` naming the setting) a configuration whose KV it
cannot key: KV that two requests would then share although it differs is a wrong answer and a
cross-tenant leak, so a start-time error is the only safe outcome. ``keyer.extras(request)``
then gives each request's ``mpcache.core_sm.keys.KeyExtras``:

* ``identity`` (every chunk): the KV cache dtype (``auto`` resolved to the model dtype), the
  model revision, dtype and quantization, ``mpcache.model_identity``, the engine's KV-cache
  groups when it has several (their objects are laid out group after group), and the request's
  LoRA adapter (name and path, as vLLM's own prefix cache keys it);
* ``chunk_extras`` (per prompt chunk): vLLM's own block extra keys for the chunk's token range
  (multimodal input hashes with their offsets, prompt-embedding hashes), computed by vLLM's
  ``generate_block_hash_extra_keys`` so mpcache keys exactly what vLLM's prefix cache keys.
  Its LoRA and cache-salt entries are left out: those are keyed already.

``extras`` raises ``UnkeyableRequest`` for a request whose extra keys it cannot encode; the
connector then neither loads nor stores that request. Nothing here imports vLLM at module
level: requests and configs are read by attribute, so tests drive it with plain objects.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpcache.core_sm.keys import NO_EXTRAS, KeyExtras, chunk_extra_digest, request_identity

ExtraKeysFn = Callable[[Any, int, int, int], "tuple[tuple[Any, ...] | None, int]"]
# vLLM's own tags for entries keyed separately (identity / cache_salt).
_KEYED_ELSEWHERE = ("lora", "cache_salt")


class UnkeyableConfig(ValueError):
    """The engine's configuration produces KV that mpcache cannot key."""


class UnkeyableRequest(ValueError):
    """One request carries an input mpcache cannot key (it is neither loaded nor stored)."""


def _vllm_extra_keys_fn() -> ExtraKeysFn | None:
    try:
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
    except ImportError:
        return None
    fn: ExtraKeysFn = generate_block_hash_extra_keys
    return fn


def _text(value: object) -> str:
    return "" if value is None else str(value)


class RequestKeyer:
    """Builds each request's ``KeyExtras`` for a given engine configuration (module doc)."""

    def __init__(self, base: dict[str, str], chunk_size: int, extra_keys_fn: ExtraKeysFn | None) -> None:
        self._base = base
        self.chunk_size = chunk_size
        self._extra_keys_fn = extra_keys_fn
        self._identities: dict[tuple[str, str], str] = {}

    @classmethod
    def from_vllm_config(
        cls,
        vllm_config: Any,
        chunk_size: int,
        model_identity: str = "",
        extra_keys_fn: ExtraKeysFn | None | bool = True,
        kv_layout: str = "",
    ) -> RequestKeyer:
        """The keyer for ``vllm_config``; raises ``UnkeyableConfig`` (see the module doc).
        ``extra_keys_fn``: True = vLLM's own function (None when this vLLM has none).
        ``kv_layout``: ``core_sm.kv_groups.layout_identity`` of the engine's KV-cache groups."""
        model = vllm_config.model_config
        cache = vllm_config.cache_config
        fn = _vllm_extra_keys_fn() if extra_keys_fn is True else (extra_keys_fn or None)
        multimodal = bool(getattr(model, "is_multimodal_model", False))
        prompt_embeds = bool(getattr(model, "enable_prompt_embeds", False))
        if (multimodal or prompt_embeds) and fn is None:
            what = "a multimodal model" if multimodal else "enable_prompt_embeds"
            raise UnkeyableConfig(
                f"mpcache cannot key {what} with this vLLM (no generate_block_hash_extra_keys): "
                "requests with the same placeholder tokens would share KV; refusing to start"
            )
        if getattr(model, "hf_overrides", None) and not model_identity:
            raise UnkeyableConfig(
                "mpcache cannot key hf_overrides (they may change the model's KV under the same model "
                "name); set kv_connector_extra_config mpcache.model_identity to a name for the "
                "overridden model"
            )
        model_dtype = _text(getattr(model, "dtype", "")).removeprefix("torch.")
        kv_dtype = _text(getattr(cache, "cache_dtype", "")) or "auto"
        if kv_dtype == "auto":
            kv_dtype = model_dtype or "auto"
        base = {
            "kv_cache_dtype": kv_dtype,
            "model_revision": _text(getattr(model, "revision", None)),
            "model_dtype": model_dtype,
            "quantization": _text(getattr(model, "quantization", None)),
            "model_identity": model_identity,
            "kv_layout": kv_layout,
        }
        return cls(base, chunk_size, fn if (multimodal or prompt_embeds) else None)

    def identity(self, lora_name: str = "", lora_path: str = "") -> str:
        key = (lora_name, lora_path)
        found = self._identities.get(key)
        if found is None:
            if len(self._identities) >= 4096:
                self._identities.clear()
            found = self._identities[key] = request_identity(lora_name=lora_name, lora_path=lora_path, **self._base)
        return found

    def extras(self, request: Any) -> KeyExtras:
        """The request's ``KeyExtras``; raises ``UnkeyableRequest``."""
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            identity = self.identity(_text(getattr(lora, "lora_name", "")), _text(getattr(lora, "lora_path", "")))
        else:
            identity = self.identity()
        chunk_extras: tuple[bytes, ...] = ()
        if self._extra_keys_fn is not None and (
            getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None
        ):
            chunk_extras = self._chunk_extras(request)
        if not identity and not chunk_extras:
            return NO_EXTRAS
        return KeyExtras(identity, chunk_extras)

    def _chunk_extras(self, request: Any) -> tuple[bytes, ...]:
        assert self._extra_keys_fn is not None
        C = self.chunk_size
        out: list[bytes] = []
        mm_index = 0
        for i in range(int(request.num_prompt_tokens) // C):
            keys, mm_index = self._extra_keys_fn(request, i * C, (i + 1) * C, mm_index)
            own = [k for k in keys or () if not (isinstance(k, tuple) and k and k[0] in _KEYED_ELSEWHERE)]
            try:
                out.append(chunk_extra_digest(own))
            except TypeError as exc:
                raise UnkeyableRequest(f"request {request.request_id}: {exc}") from exc
        while out and not out[-1]:
            out.pop()
        return tuple(out)
