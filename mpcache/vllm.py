"""The vLLM connector's module path: ``kv_connector_module_path="mpcache.vllm"``.

vLLM imports this module and takes ``MPCacheConnector`` from it (and, for its stats,
``MPCacheConnectorStats``); both live in ``mpcache.runtime_zmq.vllm_connector``.
"""
from mpcache.runtime_zmq.vllm_connector import *  # noqa: F401,F403
from mpcache.runtime_zmq.vllm_connector import MPCacheConnector

__all__ = ["MPCacheConnector"]
