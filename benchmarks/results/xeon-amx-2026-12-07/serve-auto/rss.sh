# $1 = PYTHONPATH root, $2 = port, rest = serve flags
root=$1; port=$2; shift 2
t0=$(date +%s.%N)
PYTHONPATH=$root /work/main/.venv/bin/python -m tiered.cli serve --port $port "$@" > /tmp/s96/serve_$port.log 2>&1 &
pid=$!
until curl -s localhost:$port/health >/dev/null; do sleep 0.2; done
t1=$(date +%s.%N)
echo "$root $*: ready $(echo "$t1 - $t0" | bc) s, $(grep VmRSS /proc/$pid/status)"; grep -o "batch [0-9]* x [0-9]* tokens, KV cache [0-9]* MiB" /tmp/s96/serve_$port.log
kill $pid; wait $pid 2>/dev/null
