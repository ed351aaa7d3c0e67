"""Where an all-on-GPU decode step's device time goes, against the HBM bound (issue 8 §5).

On the H100 (benchmarks/results/gpu/2026-11-26-h100) the README's shapes decoded wholly on the GPU as one
CUDA graph at ~414 tok/s (dense, ~50% of the HBM bound) and ~402 tok/s (MoE, ~41%). Half the bound
is the aim. Whether the missing time is in the kernels themselves (the GEMVs, the grouped expert
GEMMs at one row per expert) or between them (launch gaps, small routing kernels) decides what to
change. This probe runs each configuration in its own process and, for each:

  * decode tok/s as the engine runs it (the whole step as one CUDA graph) and eager (--graphs off);
  * under torch.profiler (CUDA activity), the eager decode steps' kernels: N + 1 generated tokens
    less one (the prompt's prefill and first token), per decode step: the kernels by category
    (GEMM / grouped GEMM, attention, routing and sort, elementwise, copies), their count and device
    microseconds, and the weight bytes a step reads against the GEMM kernels' time (the bandwidth
    they reach) and against the graphed step's time (the bandwidth the engine reaches).

    python benchmarks/gpu_kernel_probe.py --out DIR [--profile PROFILE.json]
    python benchmarks/gpu_kernel_probe.py --smoke --out DIR   # the host stand-in: that the probe runs

Reuses benchmarks/gpu_offload.py's dummy checkpoints. Writes DIR/kernel_probe.md and
DIR/kernel_probe.json.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

CONFIGS = {"moe_all_gpu": "moe", "dense_all_gpu": "dense"}
DECODE_TOKENS = 16
# kernel name fragments -> category, first match wins (lower case)
CATEGORIES = (
    ("grouped", ("grouped", "ptr_array", "group")),
    ("gemm", ("gemm", "gemv", "cutlass", "sm90", "xmma", "cublas", "aten::mm", "addmm", "bmm", "linear", "matmul")),
    ("attention", ("flash", "attention", "fmha", "sdpa", "softmax")),
    ("routing", ("sort", "scatter", "gather", "index", "cumsum", "scan", "topk", "radix", "nonzero")),
    ("copy", ("memcpy", "memset", "copy")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "silu", "mul", "add", "norm", "rsqrt", "pow", "mean")),
)
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}


def category(name: str) -> str:
    """A kernel's category by its name (CATEGORIES), "other" when none matches."""
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def step_weight_bytes(shape) -> int:
    """Weight bytes one bf16 decode step reads: every layer's attention and dense MLP, or its router and
    top-k experts, the final norm and the lm_head (the embedding reads one row)."""
    from tiered.checkpoint.model_config import ModelConfig
    from tiered.planner.cpu_predict import step_weight_bytes as cpu_step_bytes

    cfg = ModelConfig.from_hf(shape.config_json())
    return int(cpu_step_bytes(cfg, "bf16"))


def kernel_totals(prof, cuda: bool) -> dict[str, list]:
    """{kernel name: [calls, us]} over a profiler run's CUDA kernels and copies (their device time); without
    CUDA (the stand-in), over its aten ops' self CPU time, so that the rest of the probe runs."""
    import torch

    out: dict[str, list] = {}
    for e in prof.events():
        if cuda and getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        if not cuda and not e.name.startswith("aten::"):
            continue
        t = out.setdefault(e.name, [0, 0.0])
        t[0] += 1
        t[1] += e.time_range.elapsed_us() if cuda else e.self_cpu_time_total
    return out


def child(name: str, a) -> dict:
    """One configuration's run in this process (a: the probe's options: profile, smoke)."""
    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile

    from gpu_offload import probe_engine
    from tiered.bench.runners import TieredRunner

    smoke = a.smoke
    shape, model, cfg = probe_engine(CONFIGS[name], a.profile, smoke)
    cfg = replace(cfg, gpu_memory=None)  # the whole model on the device
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, shape.vocab, (32,), generator=g).tolist()
    cuda = torch.cuda.is_available() and not smoke
    result: dict = {"config": name, "step_weight_bytes": step_weight_bytes(shape),
                    "device": torch.cuda.get_device_name() if cuda else "host stand-in"}
    for graphs in ("auto", "off"):
        runner = TieredRunner(model, replace(cfg, graphs=graphs))
        try:
            runner.decode_tokens_per_s(prompt, 4)  # warm-up (and the graphs' capture)
            best = max(runner.decode_tokens_per_s(prompt, 32) for _ in range(3))
            result[f"decode_tokens_per_s_graphs_{graphs}"] = best
            if graphs == "off":
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                totals = []
                for n in (1, DECODE_TOKENS + 1):
                    with tprofile(activities=acts) as prof:
                        t0 = time.perf_counter()
                        runner.decode_tokens_per_s(prompt, n)
                        if cuda:
                            torch.cuda.synchronize()
                        wall = time.perf_counter() - t0
                    totals.append((kernel_totals(prof, cuda), wall))
                (base, w1), (full, wn) = totals
                per_step = {}  # the decode steps' share: the N + 1 token run less the 1 token one
                for k, (c, us) in full.items():
                    c0, us0 = base.get(k, [0, 0.0])
                    per_step[k] = [(c - c0) / DECODE_TOKENS, (us - us0) / DECODE_TOKENS]
                result["kernels"] = sorted(([k, c, us] for k, (c, us) in per_step.items() if c > 0 or us > 0),
                                           key=lambda r: -r[2])
                result["profiled_step_s"] = (wn - w1) / DECODE_TOKENS
            result["plan"] = runner.info().get("plan", "")
        finally:
            runner.close()
    return result


def summarize(r: dict) -> list[str]:
    """The report's lines for one configuration's result: the device, the plan, decode speeds against the
    HBM bound, the kernels by category and the top kernels."""
    cats: dict[str, list] = {}
    for name, calls, us in r.get("kernels", []):
        c = cats.setdefault(category(name), [0.0, 0.0])
        c[0] += calls
        c[1] += us
    busy = sum(us for _, us in cats.values())
    step_graphed = 1.0 / r["decode_tokens_per_s_graphs_auto"]
    step_eager = 1.0 / r["decode_tokens_per_s_graphs_off"]
    nbytes = r["step_weight_bytes"]
    hbm = next((bw for key, bw in HBM_BYTES_PER_S.items() if key in r.get("device", "")), None)
    gemm_us = sum(cats.get(c, [0, 0.0])[1] for c in ("gemm", "grouped"))
    lines = [f"on {r['device']}; plan: {r['plan']}", "",
             f"decode: graphed {r['decode_tokens_per_s_graphs_auto']:.1f} tok/s ({step_graphed * 1e3:.3f} ms a step), "
             f"eager {r['decode_tokens_per_s_graphs_off']:.1f} tok/s ({step_eager * 1e3:.3f} ms)",
             f"weights a step reads: {nbytes / 1e9:.3f} GB: {nbytes / step_graphed / 1e12:.2f} TB/s graphed"
             + (f", {nbytes / step_graphed / hbm:.0%} of the HBM bound ({hbm / 1e12:.2f} TB/s; half: "
                f"{hbm / 2 / nbytes:.0f} tok/s)" if hbm else ""),
             f"eager step's kernels: {busy / 1e3:.3f} ms of device time a step ({busy / 1e6 / step_graphed:.0%} of the "
             f"graphed step)" + (f"; GEMM kernels {gemm_us / 1e3:.3f} ms: "
                                 f"{nbytes / (gemm_us / 1e6) / 1e12:.2f} TB/s over the weights" if gemm_us else ""),
             "", "| category | kernels a step | device us a step | share |", "|---|---|---|---|"]
    lines += [f"| {c} | {n:.1f} | {us:.1f} | {us / busy:.0%} |" for c, (n, us) in
              sorted(cats.items(), key=lambda kv: -kv[1][1])] if busy else ["| (no device kernels recorded) | | | |"]
    lines += ["", "top kernels (per decode step):", "", "| kernel | calls | us |", "|---|---|---|"]
    lines += [f"| {name[:110]} | {calls:.1f} | {us:.1f} |" for name, calls, us in r.get("kernels", [])[:15]]
    return lines


def main(argv: list[str] | None = None) -> int:
    from tiered.bench.child import probe_main

    return probe_main(__file__, __doc__, CONFIGS, child, "All-on-GPU decode: where a step's device time goes",
                      summarize, "kernel_probe", argv)


if __name__ == "__main__":
    sys.exit(main())
