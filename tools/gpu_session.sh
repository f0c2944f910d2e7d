#!/usr/bin/env bash
# One GPU session on a CUDA host: versions, the mpcache-server GPU benchmark (this checkout, and
# optionally an older server checkout for before/after), then `make test-gpu`. Logs and JSON go
# to $OUT (default ./out). Usage, from the repo root:
#   [WHEELS=DIR] [BEFORE_REPO=DIR] [STEPS="pyspy profile kernels bench lone completions before test repeat"] bash tools/gpu_session.sh
# lone: only the lone-transfer table of the gpu-server benchmark (LONE_STARTS fresh servers, default 5).
# repeat: the GIL/CUDA-pressure test file REPEAT times in a row (default 10): it must never flake
#   (REPEAT_K: a pytest -k filter; REPEAT_SECONDS: start no run after that many seconds).
# completions: the gpu-server benchmark with --gpu-completions waiter / lane, alternating pairs.
# testrepeat: the whole `make test-gpu` REPEAT times in a row (~90 s each; REPEAT_SECONDS as above).
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
        timeout 240 python3 -m mpcache.bench.bench_cli gpu-server --label after --out "$OUT" 2>&1 | tee "$OUT/bench_after.log" || rc=1 ;;
    lone)
        timeout 300 python3 -m mpcache.bench.bench_cli gpu-server --engines "" --lone-starts "${LONE_STARTS:-5}" --label lone \
            --out "$OUT" 2>&1 | tee "$OUT/bench_lone.log" || rc=1 ;;
    repeat)
        t_repeat=$(date +%s)
        for i in $(seq 1 "${REPEAT:-10}"); do
            if [ $(( $(date +%s) - t_repeat )) -gt "${REPEAT_SECONDS:-100000}" ]; then echo "repeat: time is up after $((i - 1)) runs"; break; fi
            if timeout 260 env MPCACHE_REQUIRE_GPU=1 python3 -m pytest -q -p no:cacheprovider -m "gpu or cuda" ${REPEAT_K:+-k "$REPEAT_K"} tests/runtime_zmq/test_gpu_transfer.py \
                >"$OUT/repeat_$i.log" 2>&1; then echo "repeat $i: $(tail -1 "$OUT/repeat_$i.log")"
            else echo "repeat $i FAILED: $(tail -1 "$OUT/repeat_$i.log")"; cat "$OUT/repeat_$i.log" >>"$OUT/repeat_failures.log"; rc=1; fi
            rm -f "$OUT/repeat_$i.log"
        done ;;
    testrepeat)
        t_repeat=$(date +%s)
        for i in $(seq 1 "${REPEAT:-10}"); do
            if [ $(( $(date +%s) - t_repeat )) -gt "${REPEAT_SECONDS:-100000}" ]; then echo "testrepeat: time is up after $((i - 1)) runs"; break; fi
            # -v names each test as it starts; faulthandler_timeout: a test still running after 120 s prints every thread's stack
            # (into the log kept on failure) long before the run's own limit kills it silently.
            if timeout 420 env MPCACHE_REQUIRE_GPU=1 python3 -m pytest -v -p no:cacheprovider -o faulthandler_timeout=120 --durations=5 \
                -m "gpu or cuda" tests/kernels tests/runtime_zmq \
                >"$OUT/testrepeat_$i.log" 2>&1; then echo "test-gpu run $i: $(tail -1 "$OUT/testrepeat_$i.log")"
            else echo "test-gpu run $i FAILED: $(tail -1 "$OUT/testrepeat_$i.log")"; cat "$OUT/testrepeat_$i.log" >>"$OUT/testrepeat_failures.log"; rc=1; fi
            rm -f "$OUT/testrepeat_$i.log"
        done ;;
    completions)
        # who sees a GPU copy end: each engine's waiter thread, or its copy lane with the loop
        # reporting (--gpu-completions), in alternating pairs (COMPLETIONS_PAIRS, default 2)
        for i in $(seq 1 "${COMPLETIONS_PAIRS:-2}"); do
            for c in waiter lane; do
                timeout 240 python3 -m mpcache.bench.bench_cli gpu-server --server-args "--gpu-completions $c" \
                    --label "completions_${c}_$i" --engines 1,2,4 --shapes 1x8,32x1 --multi-shapes 32x1,16x8 --rounds 4 \
                    --lone-starts 1 --out "$OUT" 2>&1 | tee "$OUT/bench_completions_${c}_$i.log" || rc=1
            done
        done ;;
    before)
        if [ -n "${BEFORE_REPO:-}" ]; then
            timeout 150 python3 -m mpcache.bench.bench_cli gpu-server --server-repo "$BEFORE_REPO" --label before --engines 1 \
                --shapes 1x8,32x1,16x8 --rounds 4 --out "$OUT" 2>&1 | tee "$OUT/bench_before.log" || rc=1
        fi ;;
    pyspy)
        # Where the server's CPU goes per GPU request: py-spy attached (non-blocking, on-CPU
        # samples only) to each server the benchmark starts; start-up compiles are left out of
        # the summary (--exclude warm_up).
        spy=$(command -v py-spy || echo /tmp/mpcache-site/bin/py-spy)
        if [ ! -x "$spy" ]; then echo "py-spy not found (put its wheel in WHEELS)"; rc=1; continue; fi
        # PYSPY_ENGINES="1,4": also four engines' loaded rounds (PYSPY_MULTI shapes), the loop under load
        python3 -m mpcache.bench.bench_cli gpu-server --label profiled --engines "${PYSPY_ENGINES:-1}" \
            --shapes "${PYSPY_SHAPES:-1x8,32x1}" --multi-shapes "${PYSPY_MULTI:-32x1}" \
            --rounds "${PYSPY_ROUNDS:-12}" --out "$OUT" >"$OUT/bench_profiled.log" 2>&1 &
        bench=$!
        seen=" "
        while kill -0 $bench 2>/dev/null; do
            for pid in $(pgrep -f "mpcache.runtime_zmq.cli --gpu on" || true); do
                case "$seen" in *" $pid "*) continue ;; esac
                seen="$seen$pid "
                "$spy" record --pid "$pid" --nonblocking --threads --rate "${PYSPY_RATE:-250}" --format raw \
                    -o "$OUT/prof_$pid.txt" >/dev/null 2>&1 &
            done
            sleep 0.2
        done
        wait
        tail -20 "$OUT/bench_profiled.log"
        for f in "$OUT"/prof_*.txt; do
            [ -f "$f" ] || continue
            python3 tools/folded_top.py "$f" --exclude warm_up --exclude _compile_for_args --top 40 | tee -a "$OUT/gpu_server_profile_top.log"
            gzip -f "$f"
        done ;;
    profile)
        timeout 150 python3 tools/host_profile_kernels.py 2>&1 | tee "$OUT/host_profile.log" || rc=1 ;;
    kernels)
        timeout 200 python3 -m mpcache.bench.bench_cli kernels --out "$OUT" 2>&1 | tee "$OUT/bench_kernels.log" || rc=1 ;;
    test)
        if command -v make >/dev/null; then cmd=(make test-gpu PY=python3); else cmd=(env MPCACHE_REQUIRE_GPU=1 python3 -m pytest -q -m "gpu or cuda" tests/kernels tests/runtime_zmq); fi
        timeout 300 "${cmd[@]}" 2>&1 | tee "$OUT/test_gpu.log" | tail -40 || rc=1 ;;
    esac
done
exit $rc
