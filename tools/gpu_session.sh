#!/usr/bin/env bash
# One GPU session on a CUDA host: versions, the mpcache-server GPU benchmark (this checkout, and
# optionally an older server checkout for before/after), then `make test-gpu`. Logs and JSON go
# to $OUT (default ./out). Usage, from the repo root:
#   [WHEELS=DIR] [BEFORE_REPO=DIR] [STEPS="pyspy profile kernels bench before test"] bash tools/gpu_session.sh
# WHEELS: a folder of wheels to install first (e.g. pyzmq where the host python lacks it).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
STEPS=${STEPS:-"bench before test"}
export PYTHONUNBUFFERED=1
if [ -n "${WHEELS:-}" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mpcache-site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/mpcache-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, numba, numpy, zmq, msgpack; from importlib.metadata import version as v; print('torch', torch.__version__, 'numba', numba.__version__, 'numba-cuda', v('numba-cuda'), 'cuda-bindings', v('cuda-bindings'), 'numpy', numpy.__version__, 'pyzmq', zmq.__version__)"
rc=0
for step in $STEPS; do
    case $step in
    bench)
        timeout 240 python3 -m mpcache.tools.bench_cli gpu-server --label after --out "$OUT" 2>&1 | tee "$OUT/bench_after.log" || rc=1 ;;
    before)
        if [ -n "${BEFORE_REPO:-}" ]; then
            timeout 150 python3 -m mpcache.tools.bench_cli gpu-server --server-repo "$BEFORE_REPO" --label before --engines 1 \
                --shapes 1x8,32x1,16x8 --rounds 4 --out "$OUT" 2>&1 | tee "$OUT/bench_before.log" || rc=1
        fi ;;
    pyspy)
        # Where the server's CPU goes per GPU request: the benchmark under py-spy (all processes,
        # on-CPU samples only), then the server's functions by self and inclusive share.
        if command -v py-spy >/dev/null || [ -x /tmp/mpcache-site/bin/py-spy ]; then
            spy=$(command -v py-spy || echo /tmp/mpcache-site/bin/py-spy)
            timeout 300 "$spy" record --subprocesses --threads --rate 500 --format raw -o "$OUT/gpu_server_profile.txt" -- \
                python3 -m mpcache.tools.bench_cli gpu-server --label profiled --engines 1 --shapes "${PYSPY_SHAPES:-1x8,32x1}" \
                --rounds 6 --out "$OUT" 2>&1 | tee "$OUT/bench_profiled.log" || rc=1
            python3 -m mpcache.tools.folded_top "$OUT/gpu_server_profile.txt" --match runtime_zmq.cli --top 30 \
                2>&1 | tee "$OUT/gpu_server_profile_top.log" || rc=1
        else
            echo "py-spy not found (put its wheel in WHEELS)"; rc=1
        fi ;;
    profile)
        timeout 150 python3 -m mpcache.tools.host_profile_kernels 2>&1 | tee "$OUT/host_profile.log" || rc=1 ;;
    kernels)
        timeout 200 python3 -m mpcache.tools.bench_cli kernels --out "$OUT" 2>&1 | tee "$OUT/bench_kernels.log" || rc=1 ;;
    test)
        if command -v make >/dev/null; then cmd=(make test-gpu PY=python3); else cmd=(env MPCACHE_REQUIRE_GPU=1 python3 -m pytest -q -m "gpu or cuda" tests/kernels tests/runtime_zmq); fi
        timeout 300 "${cmd[@]}" 2>&1 | tee "$OUT/test_gpu.log" | tail -40 || rc=1 ;;
    esac
done
exit $rc
