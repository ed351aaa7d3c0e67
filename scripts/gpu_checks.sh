#!/usr/bin/env bash
# What a session with a lent CUDA machine runs there, one stage per device call (each < 10 min):
#   bash scripts/gpu_checks.sh tests    # the CUDA-marked tests, then the whole suite with CUDA present
#   bash scripts/gpu_checks.sh moe      # benchmarks/gpu_offload.py, 4 Mixtral layers, --gpu-mem 4GiB
#   bash scripts/gpu_checks.sh dense    # benchmarks/gpu_offload.py, 8 Llama-3-8B layers, --gpu-mem 2GiB
#   bash scripts/gpu_checks.sh profile  # `tiered profile` of the machine (full run)
# It uses the machine's own torch (never installs one). Python packages the machine lacks (gguf)
# travel as wheels in .whl/ (see the device tool's README); they are installed to /tmp/site.
# Logs and results go to $OUT (the device tool brings that folder back), else benchmarks/results/gpu.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?usage: gpu_checks.sh tests|moe|dense|profile}
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1
case "$stage" in
  tests)
    python3 -m pytest -q -p no:cacheprovider -m cuda tests/ 2>&1 | tee "$out/pytest_cuda_marked.log" | tail -5
    python3 -m pytest -q -p no:cacheprovider tests/ 2>&1 | tee "$out/pytest_cuda_all.log" | tail -5 ;;
  moe|dense)
    python3 benchmarks/gpu_offload.py --shape "$stage" --repeats 1 --out "$out" 2>&1 \
      | tee "$out/gpu_offload_$stage.log" | tail -20 ;;
  profile)
    python3 -m tiered.cli profile --out "$out/profile.json" 2>&1 | tail -5 ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
