"""Tenant-safe chunk keys: LoRA / KV dtype / model identity and per-chunk extras never share KV."""
from __future__ import annotations

import attrs
import pytest

from mpcache.core_sm.chunks import chunk_hashes, identity_root
from mpcache.core_sm.errors import ErrorKind
from mpcache.core_sm.keys import (
    MAX_IDENTITY_LEN,
    NO_EXTRAS,
    KeyExtras,
    chunk_extra_digest,
    keyed_chunk_hashes,
    keyed_root,
    request_identity,
    validate_extras,
)
from mpcache.core_sm.messages import Lookup, QueryPrefetchStatus, Store

from sm_helpers import C, ServerHarness, key, tokens

ROOT = identity_root("m", 1, "")
TOKS = tokens(4)


def test_no_extras_hash_exactly_as_before() -> None:
    assert keyed_root(ROOT, "") == ROOT
    assert keyed_chunk_hashes(TOKS, C, ROOT, 4) == chunk_hashes(TOKS, C, ROOT)
    assert keyed_chunk_hashes(TOKS, C, ROOT, 4, (b"", b"")) == chunk_hashes(TOKS, C, ROOT)


def test_identity_changes_every_chunk() -> None:
    a = keyed_chunk_hashes(TOKS, C, keyed_root(ROOT, request_identity(lora_name="a", lora_path="/a")), 4)
    b = keyed_chunk_hashes(TOKS, C, keyed_root(ROOT, request_identity(lora_name="b", lora_path="/b")), 4)
    plain = chunk_hashes(TOKS, C, ROOT)
    assert all(x != y and x != z for x, y, z in zip(a, b, plain))


def test_chunk_extra_changes_its_chunk_and_every_later_one_only() -> None:
    plain = chunk_hashes(TOKS, C, ROOT)
    img = keyed_chunk_hashes(TOKS, C, ROOT, 4, (b"", chunk_extra_digest([("mm", "img-1", 0)])))
    other = keyed_chunk_hashes(TOKS, C, ROOT, 4, (b"", chunk_extra_digest([("mm", "img-2", 0)])))
    assert img[0] == plain[0] == other[0]
    assert all(x != y and x != z for x, y, z in zip(img[1:], plain[1:], other[1:]))
    # num_chunks limits the work exactly as chunk_hashes does
    assert keyed_chunk_hashes(TOKS, C, ROOT, 2, (b"", chunk_extra_digest([("mm", "img-1", 0)]))) == img[:2]


def test_identity_fields_are_unambiguous() -> None:
    assert request_identity() == ""
    ids = {
        request_identity(lora_name="a;b"),
        request_identity(lora_name="a", lora_path="b"),
        request_identity(lora_name="ab"),
        request_identity(kv_cache_dtype="fp8"),
        request_identity(model_dtype="fp8"),
        request_identity(quantization="fp8"),
        request_identity(model_revision="fp8"),
        request_identity(model_identity="fp8"),
    }
    assert len(ids) == 8


def test_chunk_extra_digest_is_unambiguous_and_refuses_what_it_cannot_encode() -> None:
    assert chunk_extra_digest(None) == b"" == chunk_extra_digest([])
    forms = [[("ab",)], [("a", "b")], [("a",), ("b",)], [(1,)], [("1",)], [(b"1",)], [(True,)], [(None,)]]
    assert len({chunk_extra_digest(f) for f in forms}) == len(forms)
    with pytest.raises(TypeError):
        chunk_extra_digest([("x", 1.5)])
    with pytest.raises(TypeError):
        chunk_extra_digest([object()])


def test_validate_extras_bounds() -> None:
    assert validate_extras(NO_EXTRAS, 4) is None
    assert validate_extras(KeyExtras("x" * MAX_IDENTITY_LEN, (b"1",) * 4), 4) is None
    assert validate_extras(KeyExtras("x" * (MAX_IDENTITY_LEN + 1)), 4) is not None
    assert validate_extras(KeyExtras("", (b"1",) * 5), 4) is not None
    assert validate_extras(KeyExtras("", (b"1" * 65,)), 4) is not None
    assert validate_extras(KeyExtras("", ("str",)), 4) is not None  # type: ignore[arg-type]
    assert validate_extras("nope", 4) is not None


def _hits(h: ServerHarness, rid: str, extras: KeyExtras) -> object:
    assert h.call(Lookup(attrs.evolve(key(rid, TOKS), extras=extras), 1)) is None
    return h.call(QueryPrefetchStatus(rid))


def _store(h: ServerHarness, extras: KeyExtras, rid: str) -> None:
    rt = h.send(Store(attrs.evolve(key(rid, TOKS, worker_id=0), extras=extras), 1))
    h.finish_all_transfers()
    assert h.result(rt) is not None


def test_server_two_adapters_on_the_same_tokens_never_share_and_each_hits_its_own() -> None:
    h = ServerHarness()
    h.register()
    lora_a = KeyExtras(request_identity(lora_name="a", lora_path="/a"))
    lora_b = KeyExtras(request_identity(lora_name="b", lora_path="/b"))
    _store(h, lora_a, "store-a")
    assert _hits(h, "b-1", lora_b) == 0
    assert _hits(h, "plain-1", NO_EXTRAS) == 0
    assert _hits(h, "a-1", lora_a) == 4
    _store(h, lora_b, "store-b")
    assert _hits(h, "b-2", lora_b) == 4
    img = KeyExtras(lora_a.identity, (b"", b"", chunk_extra_digest([("mm", "img", 0)])))
    assert _hits(h, "img-1", img) == 2  # shares chunks 0-1 with lora_a, not the image chunks


def test_server_refuses_oversized_extras_with_a_validation_error() -> None:
    h = ServerHarness()
    h.register()
    rt = h.send(Lookup(attrs.evolve(key("r", TOKS), extras=KeyExtras("x" * (MAX_IDENTITY_LEN + 1))), 1))
    assert h.error_kind(rt) is ErrorKind.VALIDATION
