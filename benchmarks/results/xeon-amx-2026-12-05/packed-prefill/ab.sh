#!/bin/bash
# A/B: tiered batch on a file, old (worktree) vs new, alternated; $1 file, $2 model, $3 rounds, extra args after
F=$1; M=$2; R=$3; shift 3
for r in $(seq 1 $R); do
  for side in old new; do
    if [ $side = old ]; then PP=/tmp/x/old; else PP=/work/main; fi
    line=$(cd /tmp && PYTHONPATH=$PP /work/main/.venv/bin/python -m tiered.cli batch $F --model $M --output /tmp/s84/ab-$side.jsonl "$@" 2>&1 | grep "succeeded")
    echo "$side $line"
  done
done
