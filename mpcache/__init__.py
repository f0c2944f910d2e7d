"""mpcache: a KV-cache offload server for LLM inference engines.

The repository keeps its parts as top-level folders (core_sm, runtime_trio, sim, runtime_zmq,
kernels, tools); installed, they live under this one package (``mpcache.core_sm``, ...), so
mpcache never installs a generic top-level name (``kernels``, ``sim``, ``tools``) that another
distribution also uses. In a source checkout the entries of this folder are links to those
folders. The vLLM connector's module path is ``mpcache.vllm``.
"""
