"""mpcache: a KV-cache offload server for LLM inference engines.

The parts are the folders of this package: ``core_sm`` (the pure protocol machines),
``runtime_trio``, ``sim``, ``runtime_zmq``, ``kernels`` and ``bench`` (the benchmarks behind
``mpcache-bench``). Installed under this one name, mpcache never installs a generic top-level name
(``kernels``, ``sim``) that another distribution also uses. The vLLM connector's module path is
``mpcache.vllm``.
"""
