#!/usr/bin/env bash
# Keep what a device call of scripts/gpu_checks.sh brought back, in the repo: shared/gpu-runs is
# read-only to sessions, and the device tool's files go when the session ends.
#   bash scripts/gpu_unpack.sh /work/.device/1/gpu_results.tgz benchmarks/results/gpu/2026-11-27/call1
# Extracts the tgz and copies its tables (.md, .json), logs and machine files into DIR, the stall
# probe's summaries into DIR/stall, and leaves the large chrome traces (*.trace.json.gz, traces/) out.
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: gpu_unpack.sh GPU_RESULTS_TGZ DIR" >&2; exit 2; }
tgz=$1 dir=$2
[ -f "$tgz" ] || { echo "gpu_unpack: no such file: $tgz" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tar xzf "$tgz" -C "$tmp"
mkdir -p "$dir"
find "$tmp" -maxdepth 1 -type f \( -name '*.md' -o -name '*.json' -o -name '*.log' -o -name '*.csv' -o -name '*.txt' \) \
  -exec cp {} "$dir"/ \;
for sub in stall stall_passive ab graphs pinned memory kernelprobe uniform; do
  if [ -d "$tmp/$sub" ]; then
    mkdir -p "$dir/$sub"
    find "$tmp/$sub" -maxdepth 1 -type f \( -name '*.md' -o -name '*.txt' -o -name '*.json' \) -exec cp {} "$dir/$sub"/ \;
  fi
done
echo "gpu_unpack: $(find "$dir" -type f | wc -l) files in $dir ($(du -sh "$dir" | cut -f1))"
