#!/usr/bin/env bash
# Creates a separate venv with LMCache 0.5.6 (CPU torch) so `mpcache-bench rpc --lmcache-venv PATH`
# can start LMCache's own MP server and measure it in the same run as mpcache.
#
#   bash tools/lmcache_venv.sh [PATH]        # default PATH: .venv-lmcache
#
# LMCache is kept out of mpcache's venv on purpose: it pins numpy<=2.2.6, setuptools<81 and
# pulls CUDA packages that mpcache does not need.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-lmcache}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# CPU torch first, pinned to the one mpcache uses, so LMCache's unpinned `torch` does not
# pull a CUDA build.
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q "lmcache==0.5.6" "torch==2.13.0"
"$VENV/bin/python" -c "import lmcache, torch; print('lmcache', getattr(lmcache, '__version__', '0.5.6'), 'torch', torch.__version__)"
