#!/usr/bin/env bash
# What a session with a lent CUDA machine runs there. Stages run in the order given, in one device call:
#   bash scripts/gpu_checks.sh tests moe dense     # e.g.; `all` = kernels profile cuda moe dense suite trace
#   kernels  build the native CPU kernels (and their tuning) first, so no test or row pays for it
#   cuda     the CUDA-marked tests (the first engine without a profile measures a quick one, ~2 min on the H100,
#            unless the `profile` stage ran before)
#   suite    the whole suite with CUDA present (pytest-xdist, 8 workers, where installed)
#   tests    cuda, then the rest of the suite (-m "not cuda"; together the whole suite, each test once)
#   profile  `tiered profile --quick` of this machine (results/profile_quick.json, and the engine's default
#            profile path); moe/dense and the tests after it plan with it
#   moe      benchmarks/gpu_offload.py, 4 Mixtral layers, --gpu-mem 4GiB (no transformers + accelerate row:
#            0.57 tok/s, section 2 of shared/gpu-runs/2026-11-22-h200 has it); the default plan graphed
#            piecewise and with --graphs off (plan_auto_eager), every miss split (forced_split), all on
#            the GPU as one graph (grouped experts) and eager (unconstrained_eager), and the default plan with
#            torch's pinned memory (plan_auto_cuda_pinned: 4 KiB pages) instead of registered huge pages
#   dense    the same, 8 Llama-3-8B layers, --gpu-mem 2GiB
#   pinned   both shapes' default plan (Plan.pinned: "cuda" where dense FFNs are sliced, else "huge") beside
#            either pinning forced, and no GPU, 3 repeats each: the A/B of the plan's pinned-memory choice
#   moe_uniform  the MoE shape with --routing uniform (each token routed by its own hidden state, as the plans
#            price it; the skewed weights' LRU hit ~80% where 16% was priced): the default plan, its dispatch
#            without margins (forced_priced: a decode layer's misses both ways where priced faster, which
#            dispatcher.MIX_GAIN forbids since copies started late on a worker thread; now the thread issues
#            them), every miss copied, every miss on the CPU, so the default plan's prediction is comparable (§6)
#   threads  the default plan, every miss on the CPU and plan off with uniform routing on all cores but one
#            (--threads nproc-1): beside moe_uniform (torch's default, every core), the A/B of the CPU team
#            leaving a core to the copy and launch workers (session 28: copies started up to 3.6 ms late
#            beside a 16-thread CPU expert; gpu_dram_share: 15 threads streamed 95 GB/s against 83 on 16)
#   issue    both shapes (MoE with uniform routing), the default plan against the same with its device work issued
#            by the stream workers (plan_auto_worker_issue, device_issue="worker"), 3 repeats each: the A/B of
#            Executor.issue (H2D copies from page-locked RAM and a sliced FFN's GPU GEMMs issued by the thread
#            that needs them, before its CPU work)
#   moe_ab   plan off, then the default plan, 3 repeats each (the default ran first and 17% slower than plan
#            off with the same paths and hit rate on 2026-11-26: order, or the plan?)
#   graphs   the CUDA graph tests, then both shapes' graphed rows beside their eager twins only
#            (plan_auto, plan_auto_eager, plan_auto_cuda_pinned, unconstrained, unconstrained_eager): the short A/B
#   trace    the MoE default plan and every miss on the CPU (uniform routing: where the default's dispatch is
#            decided), and the dense default plan, once more with EngineConfig(trace=True) (timelines)
#   stall    benchmarks/gpu_stall_probe.py: where an offloaded decode step's host time goes (profiler
#            ops, thread samples, late samples); stall_passive: the same with OMP_WAIT_POLICY=PASSIVE
#   memory   benchmarks/gpu_memory_probe.py: both default plans' peak allocated GPU memory against their budget,
#            the blocks live at the peak by allocation site (the caching allocator's recorded history)
#   kernelprobe  benchmarks/gpu_kernel_probe.py: both shapes wholly on the GPU, graphed and eager decode tok/s, the
#            eager step's kernels by category (device us a step) and the GEMMs' bandwidth over the weights (§5)
#   share    benchmarks/gpu_dram_share.py: CPU expert GB/s beside H2D copies (shared DRAM? spinning waits?)
#   fullprofile  the full `tiered profile` (several minutes)
# GPU_DEADLINE (seconds, default 540) bounds the whole call: each stage gets at most its own cap and
# what is left, so the call ends inside the device tool's limit with its partial results.
# It uses the machine's own torch (never installs one). Python packages the machine lacks (gguf,
# fastapi, pydantic, uvicorn, and openai with distro, jiter and sniffio for the serving tests) travel as
# wheels in .whl/ (scripts/gpu_wheels.sh fetches them; carry .whl); they go to /tmp/site.
# Everything goes to one folder, packed into $OUT/gpu_results.tgz after every stage (the device
# tool brings back at most 8 files), with the console in $OUT/run.log; without $OUT, to
# benchmarks/results/gpu. Back here, `scripts/gpu_unpack.sh TGZ benchmarks/results/gpu/DATE/callN`
# keeps its tables and logs in the repo (shared/gpu-runs is read-only to sessions).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# GPU_CHECKS_SMOKE=1: the benchmarks' --smoke (host stand-in, tiny shapes), no installs: this script's own
# plumbing checked on a CPU machine (tests/test_gpu_checks_script.py), with PYTHON naming the interpreter
smoke=${GPU_CHECKS_SMOKE:+--smoke}
[ $# -gt 0 ] || { echo "usage: gpu_checks.sh STAGE... (kernels cuda suite tests profile moe dense graphs pinned memory kernelprobe trace stall stall_passive share moe_uniform threads moe_ab fullprofile all)" >&2; exit 2; }
start=$(date +%s)
deadline=$((start + ${GPU_DEADLINE:-540}))
out=${OUT:-benchmarks/results/gpu}
res=${OUT:+/tmp/gpu_res}; res=${GPU_RES:-${res:-$out/res}}  # not under $OUT: only its packed copy travels back
mkdir -p "$res"
exec > >(tee -a "$out/run.log") 2>&1
export PYTHONUNBUFFERED=1
if [ -z "$smoke" ] && compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -n "$smoke" ] || $PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$res/gpu.csv" 2>&1
lscpu > "$res/lscpu.txt" 2>&1
grep -H . /sys/kernel/mm/transparent_hugepage/{enabled,defrag} > "$res/thp.txt" 2>&1
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" | tee "$res/versions.txt"
# a quick profile of this machine kind (GPU_PROFILE; default the 2026-11-26 H100's), until the `profile`
# stage measures this machine's
prof=${GPU_PROFILE:-benchmarks/reference/h100-2026-11-26/profile_quick.json}
[ -z "$smoke" ] || prof=  # the stand-in's tiny shapes: the profile of this machine
# the benchmarks plan with that profile scaled to this minute's CPU memory speed, as an engine does with its own
# (gpu_offload --bandwidth-check: the scaled profile is saved beside each report); GPU_BANDWIDTH_CHECK=0: as given
check=--bandwidth-check
[ "${GPU_BANDWIDTH_CHECK:-1}" = 1 ] || check=

pack() { tar czf "$out/gpu_results.tgz" -C "$res" . 2>/dev/null; }
# run CAP NAME CMD...: the command under `timeout min(CAP, time left - 10 s)`, its output in res/NAME.log
run() {
  local cap=$1 name=$2; shift 2
  local left=$((deadline - $(date +%s) - 10))
  local t=$(( cap < left ? cap : left ))
  if [ "$t" -lt 15 ]; then echo "== $name: skipped, ${left}s left"; return 0; fi
  echo "== $name (at $(( $(date +%s) - start ))s, up to ${t}s): $*"
  local s0=$(date +%s)
  timeout --kill-after=5 "$t" "$@" 2>&1 | tee "$res/$name.log" | tail -25
  echo "== $name: rc ${PIPESTATUS[0]} in $(( $(date +%s) - s0 ))s"
  pack
}
bench() {  # bench SHAPE CAP [extra args]
  local shape=$1 cap=$2; shift 2
  local rows=plan_auto,plan_auto_eager,plan_auto_cuda_pinned,plan_auto_profiled,plan_off,forced_copy,forced_cpu,forced_split,no_gpu,unconstrained,unconstrained_eager,hf_all_gpu
  run "$cap" "gpu_offload_$shape" $PY benchmarks/gpu_offload.py $smoke $check --shape "$shape" --repeats 1 --rows "$rows" \
    --out "$res" ${prof:+--profile "$prof"} "$@"
}
xdist=""
$PY -c "import xdist" 2>/dev/null && xdist="-n 8"

stages=("$@")
[ "${stages[*]}" = all ] && stages=(kernels profile cuda moe dense suite trace stall)
for stage in "${stages[@]}"; do
  case "$stage" in
    kernels) run 180 kernels $PY -m tiered.kernels ;;
    cuda) run 300 pytest_cuda_marked $PY -m pytest -q -p no:cacheprovider -m cuda -rfEs tests/ ;;
    suite) run 300 pytest_cuda_all $PY -m pytest -q -p no:cacheprovider $xdist -rfE --durations=15 tests/ ;;
    tests) run 300 pytest_cuda_marked $PY -m pytest -q -p no:cacheprovider -m cuda -rfEs tests/
           run 300 pytest_cuda_rest $PY -m pytest -q -p no:cacheprovider $xdist -m "not cuda" -rfE --durations=15 tests/ ;;
    profile) run 240 profile_quick $PY -m tiered.cli profile --quick --out "$res/profile_quick.json"
             # also where engines look for this machine's profile (hardware/profile.default_profile_path), so
             # the tests and benchmarks after this stage plan with it instead of measuring their own (~2 min)
             [ -s "$res/profile_quick.json" ] && prof=$res/profile_quick.json && [ -z "$smoke" ] && \
               cp "$prof" "$($PY -c 'from tiered.hardware.profile import default_profile_path as p; print(p())')" ;;
    stall) run 200 stall_probe $PY benchmarks/gpu_stall_probe.py $smoke --out "$res/stall" ${prof:+--profile "$prof"} ;;
    stall_passive) run 200 stall_probe_passive $PY benchmarks/gpu_stall_probe.py $smoke --out "$res/stall_passive" \
             --env OMP_WAIT_POLICY=PASSIVE ${prof:+--profile "$prof"} ;;
    memory) run 150 memory_probe $PY benchmarks/gpu_memory_probe.py $smoke --out "$res/memory" ${prof:+--profile "$prof"} ;;
    kernelprobe) run 150 kernel_probe $PY benchmarks/gpu_kernel_probe.py $smoke --out "$res/kernelprobe" ${prof:+--profile "$prof"} ;;
    share) run 90 dram_share $PY benchmarks/gpu_dram_share.py $smoke --out "$res" ;;
    fullprofile) run 540 profile_full $PY -m tiered.cli profile --out "$res/profile_full.json" ;;
    pinned) mkdir -p "$res/pinned"
            for shape in dense moe; do
              run 150 "pinned_$shape" $PY benchmarks/gpu_offload.py $smoke $check --shape "$shape" --repeats 3 \
                --rows plan_auto,plan_auto_cuda_pinned,plan_auto_huge_pinned,no_gpu --out "$res/pinned" \
                --name "pinned_$shape" ${prof:+--profile "$prof"}
            done ;;
    moe) bench moe 240 ;;
    dense) bench dense 150 ;;
    moe_uniform) mkdir -p "$res/uniform"
            run 300 gpu_offload_moe_uniform $PY benchmarks/gpu_offload.py $smoke $check --shape moe --routing uniform --repeats 3 \
              --rows plan_auto,forced_priced,forced_copy,forced_cpu --out "$res/uniform" --name gpu_offload_moe_uniform \
              ${prof:+--profile "$prof"} ;;
    threads) mkdir -p "$res/uniform"
            run 200 gpu_offload_moe_uniform_t15 $PY benchmarks/gpu_offload.py $smoke $check --shape moe --routing uniform \
              --repeats 3 --threads $(( $(nproc) > 2 ? $(nproc) - 1 : 1 )) --rows plan_auto,forced_cpu,plan_off \
              --out "$res/uniform" --name gpu_offload_moe_uniform_t15 ${prof:+--profile "$prof"} ;;
    issue) mkdir -p "$res/issue"  # device work issued by the thread that needs it (default) against by the workers
            for shape in moe dense; do
              run 200 "issue_$shape" $PY benchmarks/gpu_offload.py $smoke $check --shape "$shape" --routing uniform --repeats 3 \
                --rows plan_auto,plan_auto_worker_issue --out "$res/issue" --name "issue_$shape" ${prof:+--profile "$prof"}
            done ;;
    moe_ab) mkdir -p "$res/ab"
            run 240 gpu_offload_moe_ab $PY benchmarks/gpu_offload.py $smoke $check --shape moe --repeats 3 --rows plan_off,plan_auto \
              --out "$res/ab" --name gpu_offload_moe_ab ${prof:+--profile "$prof"} ;;
    graphs) mkdir -p "$res/graphs"
            run 150 pytest_graphs $PY -m pytest -q -p no:cacheprovider -m cuda -rfEs tests/test_piecewise_graphs.py \
              tests/test_grouped_experts.py tests/test_graphs.py tests/test_split_dispatch.py
            for shape in moe dense; do
              run 150 "graphs_$shape" $PY benchmarks/gpu_offload.py $smoke $check --shape "$shape" --repeats 1 \
                --rows plan_auto,plan_auto_eager,plan_auto_cuda_pinned,unconstrained,unconstrained_eager --out "$res/graphs" \
                --name "graphs_$shape" ${prof:+--profile "$prof"}
            done ;;
    trace) mkdir -p "$res/traces"
           run 150 trace_moe $PY benchmarks/gpu_offload.py $smoke $check --shape moe --routing uniform --repeats 1 \
             --rows plan_auto,forced_cpu --out "$res/traces" --name trace_moe ${prof:+--profile "$prof"} --trace-dir "$res/traces"
           run 90 trace_dense $PY benchmarks/gpu_offload.py $smoke $check --shape dense --repeats 1 --rows plan_auto \
             --out "$res/traces" --name trace_dense ${prof:+--profile "$prof"} --trace-dir "$res/traces" ;;
    *) echo "unknown stage $stage" >&2 ;;
  esac
done
pack
echo "== done in $(( $(date +%s) - start ))s"
