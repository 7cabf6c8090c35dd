#!/usr/bin/env bash
# Installs Horovod 0.28.1 with gloo (CPU, no MPI) into its own venv, benchmarks/.hvd-venv,
# as a baseline for benchmarks/peers.py. Never run by the package or the tests.
#
# Horovod 0.28.1 predates TensorFlow 2.21; it still builds with three adjustments,
# none of which edits Horovod's files (see docs/dependencies.md):
#   1. cmake < 3.28 (cmake 4 refuses gloo's cmake_minimum_required),
#   2. two TensorFlow-bundled include folders on the compiler path,
#   3. a forwarding header for xla_builder.h, which TensorFlow moved.
#
# Usage: benchmarks/setup_horovod.sh [--python python3] [--tf-spec "tensorflow-cpu==2.21.*"]
# About 4 minutes on 2 loaded cores. Re-running with Horovod already importable is a no-op.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.hvd-venv"
PYTHON=python3
TF_SPEC="tensorflow-cpu==2.21.*"
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PYTHON="$2"; shift 2 ;;
    --tf-spec) TF_SPEC="$2"; shift 2 ;;
    *) echo "setup_horovod.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import horovod.tensorflow" 2>/dev/null; then
  echo "Horovod already installed in $VENV"
  exit 0
fi

"$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "$TF_SPEC" numpy "cmake<3.28" packaging wheel psutil cloudpickle pyyaml setuptools
# matplotlib is optional for peers.py's plot; a failure here is not fatal.
"$PY" -m pip install -q matplotlib || echo "setup_horovod.sh: matplotlib not installed (no plots)" >&2

TFI="$("$PY" -c "import tensorflow as tf; print(tf.sysconfig.get_include())")"
for d in "$TFI/external/highwayhash" "$TFI/external/farmhash_archive/src"; do
  [ -d "$d" ] || { echo "setup_horovod.sh: $d missing from this TensorFlow" >&2; exit 1; }
done
SHIM="$VENV/xla-shim"
mkdir -p "$SHIM/tensorflow/compiler/xla/client"
echo '#include "xla/hlo/builder/xla_builder.h"' > "$SHIM/tensorflow/compiler/xla/client/xla_builder.h"

export PATH="$VENV/bin:$PATH"
HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 \
HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS=-j2 \
CXXFLAGS="-I$TFI/external/highwayhash -I$TFI/external/farmhash_archive/src -I$SHIM" \
  "$PY" -m pip install --no-cache-dir --no-build-isolation horovod==0.28.1

"$PY" -c "import horovod, horovod.tensorflow as hvd; print('horovod', horovod.__version__, 'gloo built:', hvd.gloo_built())"
echo "Horovod installed in $VENV; run benchmarks with: $VENV/bin/horovodrun -np 2 -H localhost:2 --gloo ..."
