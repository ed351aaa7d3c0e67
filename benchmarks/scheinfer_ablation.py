"""ScheInfer's ablation (§V-E2..E4) reproduced in kind with tiered's planner and simulator.

No GPU is used: the machine is ScheInfer's testbed A as published (Table I fitted constants, the
`scheinfer-a` preset), the models are the real layer shapes of Mixtral-8x7B and LLaMA-2-70B in
4-bit, and every time is the discrete-event simulation of the whole FFN stack (tiered.planner.
simulator), cross-checked against the closed forms (Eq. 10-12). Three ablations, as in the paper:

  slicing rates      decode, r_GG = 0: optimal r_CG vs fixed 0 / 0.25 / 0.5 / 0.75, CPU threads 16/8/4/2
                     (Mixtral-8x7B @ 12 GB and LLaMA-2-70B @ 24 GB)                           §V-E2
  memory assignment  decode: greedy r_GG per layer (Eq. 14) vs whole layers (r_GG in {0, 1}),
                     Mixtral @ 12/16/20 GB, LLaMA-2-70B @ 24/28/32 GB                         §V-E3
  token assignment   prefill of 64 / 256 / 1024 tokens at the decode-optimal rates: n_g* vs n_g = 0,
                     Mixtral @ 12 GB, LLaMA-2-70B @ 24 GB                                     §V-E4

Each is run under two readings of Table I's PCIe beta (ALGORITHMS.md S3): per byte as printed, and
per weight element (2 INT4 elements per byte). The token-assignment ablation is also run with a
roofline prefill regime (S2; `roofline_params`), since Table I's GEMM lines are decode (GEMV) fits.

    python benchmarks/scheinfer_ablation.py          # writes benchmarks/results/scheinfer_ablation.{json,md}
                                                     # and the generated block of docs/scheinfer_ablation.md
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from tiered.bench import write_report  # noqa: E402
from tiered.hardware.profile import HardwareProfile, LinearModel  # noqa: E402
from tiered.planner.cost_model import (CostParams, LayerShape, SliceRates, cost_params, gemm_times,  # noqa: E402
                                       layer_time, moe_layer_shape, prompt_gemm_times, roofline_params)
from tiered.planner.scheinfer import assign_gpu_memory, ffn_gpu_budget, solve_n_g, solve_r_cg  # noqa: E402
from tiered.planner.simulator import simulate_stack  # noqa: E402

GiB = 2**30
INT4 = 0.5                      # bytes per weight element (payload only; ScheInfer does not name its format, S8)
TABLE_I_THREADS = 16            # assumption: Table I's CPU line was fitted with the most threads the ablation used
N_V = 16                        # r_GG grid size (not reported; S6 suggests 16 or 32)
MAX_CONTEXT = 2048              # tokens the KV cache is sized for when computing the FFN budget (S5)

# Paper figures (ScheInfer §V-E, ALGORITHMS.md 1.d-1.e).
PAPER_FIXED_RATE_SPEEDUP = {0.0: 1.7, 0.25: 1.4, 0.5: 1.6, 0.75: 2.1}
PAPER_OPT_RCG_LLAMA = {16: 0.18, 8: 0.25, 4: 0.42, 2: 0.71}
PAPER_MEMORY = {("mixtral-8x7b", 12): 1.07, ("mixtral-8x7b", 16): 1.10, ("mixtral-8x7b", 20): 1.15,
                ("llama-2-70b", 24): 1.08, ("llama-2-70b", 28): 1.09, ("llama-2-70b", 32): 1.12}
PAPER_TOKENS = {("mixtral-8x7b", 64): 1.9, ("mixtral-8x7b", 256): 5.6, ("mixtral-8x7b", 1024): 19.1,
                ("llama-2-70b", 64): 6.9, ("llama-2-70b", 256): 27.6, ("llama-2-70b", 1024): 45.6}

# Prefill compute peaks for the roofline regime (S2), testbed A. Assumed: 50% of vendor peak.
#   RTX A6000 datasheet: 154.8 TFLOPS dense FP16 tensor = 77.4 T MAC/s; weight-only INT4 kernels
#   dequantize into FP16 tensor-core GEMMs.  Xeon Platinum 8358: 2.6 GHz, 2 AVX-512 FMA units
#   = 64 FP32 FLOP/cycle/core; 16 threads -> 1.33 T MAC/s.
GPU_PREFILL_MACS = 0.5 * 77.4e12
CPU_PREFILL_MACS_16T = 0.5 * 16 * 2.6e9 * 32

# Architectures (Hugging Face config.json of mistralai/Mixtral-8x7B-v0.1 and meta-llama/Llama-2-70b-hf).
MODELS = {
    "mixtral-8x7b": dict(layers=32, d_model=4096, d_ff=14336, experts=8, top_k=2, kv_heads=8, head_dim=128,
                         attn_params=4096 * (4096 + 1024 + 1024 + 4096), vocab=32000, budget_gb=12),
    "llama-2-70b": dict(layers=80, d_model=8192, d_ff=28672, experts=1, top_k=1, kv_heads=8, head_dim=128,
                        attn_params=8192 * (8192 + 1024 + 1024 + 8192), vocab=32000, budget_gb=24),
}


def testbed_a() -> tuple[HardwareProfile, str]:
    """The scheinfer-a preset, or Table I's testbed-A figures when presets.py is not there."""
    try:
        from tiered.hardware.presets import get_preset
        return get_preset("scheinfer-a"), "tiered.hardware.presets: scheinfer-a"
    except ImportError:
        m = {"gemm/gpu/int4": LinearModel(4.7e-6, 8.1e-13, 0.999), "gemm/cpu/int4": LinearModel(1.1e-5, 5.4e-12, 0.998),
             "copy/h2d_pinned": LinearModel(3.0e-6, 2.6e-11, 0.985), "launch/gpu": LinearModel(4.4e-5, 0.0)}
        return HardwareProfile("scheinfer-a", "ScheInfer Table I, testbed A", m), "ScheInfer Table I (built in script)"


def decode_shape(m: dict) -> LayerShape:
    if m["experts"] > 1:
        return moe_layer_shape(1, m["d_model"], m["d_ff"], m["experts"], m["top_k"], INT4)
    return LayerShape(1, m["d_model"], m["d_ff"], 3, INT4)


def prefill_shape(m: dict, tokens: int) -> LayerShape:
    if m["experts"] > 1:
        return moe_layer_shape(tokens, m["d_model"], m["d_ff"], m["experts"], m["top_k"], INT4)
    return LayerShape(tokens, m["d_model"], m["d_ff"], 3, INT4)


def ffn_budget(m: dict, gb: float) -> float:
    """GPU bytes for FFN weights under a cap of `gb` GiB (ALGORITHMS.md S5): minus the non-FFN
    weights (4-bit), the fp16 KV cache for MAX_CONTEXT tokens, activations and CG staging, minus 5%."""
    non_ffn = (m["layers"] * m["attn_params"] + 2 * m["vocab"] * m["d_model"]) * INT4
    kv = 2 * 2 * m["kv_heads"] * m["head_dim"] * MAX_CONTEXT * m["layers"]
    act = 3 * 1024 * m["d_ff"] * 2
    staging = 2 * m["d_model"] * m["d_ff"] * INT4
    return ffn_gpu_budget(gb * GiB, non_ffn_bytes=non_ffn, kv_cache_bytes=kv, activation_bytes=act,
                          staging_bytes=staging)


def threads(p: CostParams, n: int) -> CostParams:
    """CPU GEMM with n threads: beta_C scaled by TABLE_I_THREADS / n (linear scaling, an assumption)."""
    return dataclasses.replace(p, beta_cpu=p.beta_cpu * TABLE_I_THREADS / n)


def stack_time(per_layer: list[tuple]) -> float:
    """Simulated time of a stack of (StageTimes, n_l), checked against the closed forms."""
    sim = simulate_stack(per_layer)
    closed = sum(layer_time(t, n) for t, n in per_layer)
    assert abs(sim - closed) <= 1e-9 * closed, (sim, closed)
    return sim


def decode_time(m: dict, rates: list[SliceRates], p: CostParams) -> float:
    shape = decode_shape(m)
    return stack_time([(gemm_times(shape, r, p), shape.n_gemms) for r in rates])


def implied_cpu_scale(shape: LayerShape, p: CostParams, r_target: float) -> float:
    """The factor on Table I's beta_C at which the optimal r_CG (r_GG = 0) equals r_target (bisection
    in log space; r_CG* grows with beta_C)."""
    lo, hi = -3.0, 3.0
    for _ in range(60):
        mid = (lo + hi) / 2
        r = solve_r_cg(shape, 0.0, dataclasses.replace(p, beta_cpu=p.beta_cpu * 10**mid)).rates.r_cg
        lo, hi = (mid, hi) if r < r_target else (lo, mid)
    return 10 ** ((lo + hi) / 2)


def ablation_slicing(p0: CostParams) -> dict:
    rows = []
    for name, m in MODELS.items():
        for th in (16, 8, 4, 2):
            p = threads(p0, th)
            opt = solve_r_cg(decode_shape(m), 0.0, p)
            t_opt = decode_time(m, [opt.rates] * m["layers"], p)
            fixed = {r: decode_time(m, [SliceRates.from_gg_cg(0.0, r)] * m["layers"], p)
                     for r in PAPER_FIXED_RATE_SPEEDUP}
            rows.append({"model": name, "threads": th, "opt_r_cg": opt.rates.r_cg, "case": opt.case,
                         "t_opt_ms": 1e3 * t_opt, "t_fixed_ms": {str(r): 1e3 * t for r, t in fixed.items()},
                         "speedup": {str(r): t / t_opt for r, t in fixed.items()}})
    avg = {str(r): statistics.mean(x["speedup"][str(r)] for x in rows) for r in PAPER_FIXED_RATE_SPEEDUP}
    llama = decode_shape(MODELS["llama-2-70b"])
    implied = {th: implied_cpu_scale(llama, p0, r) for th, r in PAPER_OPT_RCG_LLAMA.items()}
    by_threads = {th: statistics.mean(statistics.mean(x["speedup"].values()) for x in rows if x["threads"] == th)
                  for th in (16, 8, 4, 2)}
    return {"rows": rows, "avg_speedup_by_fixed_rate": avg, "avg_speedup_by_threads": by_threads,
            "implied_cpu_beta_scale": implied}


def ablation_memory(p: CostParams) -> dict:
    rows = []
    for (name, gb), paper in PAPER_MEMORY.items():
        m = MODELS[name]
        budget = ffn_budget(m, gb)
        layers = [decode_shape(m)] * m["layers"]
        greedy = assign_gpu_memory(layers, p, budget, N_V)
        whole = assign_gpu_memory(layers, p, budget, (1.0,))
        tg, tw = decode_time(m, list(greedy.rates), p), decode_time(m, list(whole.rates), p)
        rows.append({"model": name, "gpu_gb": gb, "ffn_budget_gb": budget / GiB, "paper": paper,
                     "t_greedy_ms": 1e3 * tg, "t_whole_ms": 1e3 * tw, "speedup": tw / tg,
                     "greedy_r_gg": sorted({r.r_gg for r in greedy.rates}),
                     "greedy_mean_r_gg": statistics.mean(r.r_gg for r in greedy.rates),
                     "greedy_mean_r_cg": statistics.mean(r.r_cg for r in greedy.rates),
                     "whole_layers_on_gpu": sum(r.r_gg == 1.0 for r in whole.rates)})
    return {"rows": rows}


def ablation_tokens(p: CostParams, roofline: bool) -> dict:
    rows = []
    for (name, T), paper in PAPER_TOKENS.items():
        m = MODELS[name]
        rates = assign_gpu_memory([decode_shape(m)] * m["layers"], p, ffn_budget(m, m["budget_gb"]), N_V).rates
        shape = prefill_shape(m, T)
        pp = roofline_params(p, shape.tokens, GPU_PREFILL_MACS, CPU_PREFILL_MACS_16T) if roofline else p
        ng = [solve_n_g(shape, r, pp) for r in rates]
        t_off = stack_time([(prompt_gemm_times(shape, r, 0, pp), shape.n_gemms) for r in rates])
        t_on = stack_time([(prompt_gemm_times(shape, r, a.n_g, pp), shape.n_gemms) for r, a in zip(rates, ng)])
        rows.append({"model": name, "prompt": T, "tokens_per_gemm": shape.tokens, "n_gemms": shape.n_gemms,
                     "paper": paper, "t_off_ms": 1e3 * t_off, "t_on_ms": 1e3 * t_on, "speedup": t_off / t_on,
                     "mean_n_g_fraction": statistics.mean(a.n_g / shape.tokens for a in ng),
                     "mean_r_cc": statistics.mean(r.r_cc for r in rates)})
    return {"rows": rows}


def run(profile: HardwareProfile) -> dict:
    p_bytes = cost_params(profile, "int4")
    p_elems = dataclasses.replace(p_bytes, beta_c2g=p_bytes.beta_c2g / INT4)   # S3: beta per INT4 element
    out = {}
    for unit, p in (("bytes", p_bytes), ("elements", p_elems)):
        out[unit] = {"params": dataclasses.asdict(p), "slicing": ablation_slicing(p), "memory": ablation_memory(p),
                     "tokens_table_i": ablation_tokens(p, roofline=False),
                     "tokens_roofline": ablation_tokens(p, roofline=True)}
    return out


def f2(x: float) -> str:
    return f"{x:.2f}"


def render(res: dict, source: str) -> str:
    b, e = res["bytes"], res["elements"]
    L = [f"Machine: ScheInfer testbed A (RTX A6000, Xeon Platinum 8358, PCIe 4.0 x16) from {source}, INT4 "
         f"constants; 4-bit weights ({INT4} B/element); times are simulated FFN stacks (all layers), "
         "matching the closed forms to 1e-9. 'bytes' / 'elements': Table I's PCIe beta read per byte "
         "(as printed) or per INT4 element (ALGORITHMS.md S3).", ""]
    L += ["**Slicing rates (§V-E2)**: decode, r_GG = 0, speedup of the optimal r_CG over a fixed r_CG, "
          "averaged over Mixtral-8x7B and LLaMA-2-70B and 16/8/4/2 CPU threads.", "",
          "| fixed r_CG | paper | ours (bytes) | ours (elements) |", "|---|---|---|---|"]
    for r, paper in PAPER_FIXED_RATE_SPEEDUP.items():
        L.append(f"| {r} | {paper}x | {f2(b['slicing']['avg_speedup_by_fixed_rate'][str(r)])}x | "
                 f"{f2(e['slicing']['avg_speedup_by_fixed_rate'][str(r)])}x |")
    L += ["", "Optimal r_CG for LLaMA-2-70B at r_GG = 0 by CPU threads (CPU beta scaled 16/threads), and the "
          "factor on Table I's CPU beta that would reproduce the paper's r_CG:", "",
          "| threads | paper | ours (bytes) | ours (elements) | implied beta_C factor (bytes) | "
          "implied beta_C factor (elements) |", "|---|---|---|---|---|---|"]
    for th, paper in PAPER_OPT_RCG_LLAMA.items():
        gb = next(x for x in b["slicing"]["rows"] if x["model"] == "llama-2-70b" and x["threads"] == th)
        ge = next(x for x in e["slicing"]["rows"] if x["model"] == "llama-2-70b" and x["threads"] == th)
        ib, ie = (res[u]["slicing"]["implied_cpu_beta_scale"][th] for u in ("bytes", "elements"))
        L.append(f"| {th} | {paper} | {f2(gb['opt_r_cg'])} | {f2(ge['opt_r_cg'])} | {f2(ib)} | {f2(ie)} |")
    L += ["", "Per thread count (the other reading of the paper's four averages), mean over the four fixed rates:",
          "", "| threads | ours (bytes) | ours (elements) |", "|---|---|---|"]
    for th in (16, 8, 4, 2):
        L.append(f"| {th} | {f2(b['slicing']['avg_speedup_by_threads'][th])}x | "
                 f"{f2(e['slicing']['avg_speedup_by_threads'][th])}x |")
    L += ["", f"**GPU memory assignment (§V-E3)**: decode, greedy r_GG (N_v = {N_V}) vs whole layers "
          "(r_GG in {0, 1}, as many as fit).", "",
          "| model | GPU cap | FFN budget | paper | ours (bytes) | ours (elements) | greedy mean r_GG / r_CG (bytes) |",
          "|---|---|---|---|---|---|---|"]
    for xb, xe in zip(b["memory"]["rows"], e["memory"]["rows"]):
        L.append(f"| {xb['model']} | {xb['gpu_gb']} GiB | {xb['ffn_budget_gb']:.1f} GiB | {xb['paper']}x | "
                 f"{f2(xb['speedup'])}x | {f2(xe['speedup'])}x | "
                 f"{xb['greedy_mean_r_gg']:.2f} / {xb['greedy_mean_r_cg']:.2f} |")
    L += ["", "**Token assignment (§V-E4)**: prefill at the decode-optimal rates (greedy at 12 / 24 GiB), "
          "speedup of n_g* over n_g = 0. 'Table I' prices prefill GEMMs with Table I's lines; 'roofline' "
          "with beta' = max(1/peak, beta/T) (S2; assumed peaks: GPU 38.7 T MAC/s, CPU 0.67 T MAC/s).", "",
          "| model | prompt | paper | Table I (bytes) | Table I (elements) | roofline (bytes) | roofline (elements) | "
          "n_g*/T (roofline, bytes) |", "|---|---|---|---|---|---|---|---|"]
    for i, x in enumerate(b["tokens_table_i"]["rows"]):
        cols = [res[u][k]["rows"][i]["speedup"]
                for k in ("tokens_table_i", "tokens_roofline") for u in ("bytes", "elements")]
        L.append(f"| {x['model']} | {x['prompt']} | {x['paper']}x | " + " | ".join(f"{f2(c)}x" for c in cols)
                 + f" | {b['tokens_roofline']['rows'][i]['mean_n_g_fraction']:.2f} |")
    return "\n".join(L) + "\n"


BEGIN, END = "<!-- BEGIN GENERATED (benchmarks/scheinfer_ablation.py) -->", "<!-- END GENERATED -->"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--doc", default=str(ROOT.parent / "docs" / "scheinfer_ablation.md"),
                    help="update the generated block of this Markdown file (if it has the markers)")
    args = ap.parse_args()
    profile, source = testbed_a()
    t0 = time.perf_counter()
    res = run(profile)
    md = render(res, source)
    elapsed = time.perf_counter() - t0
    settings = {"profile": profile.name, "profile_source": profile.source, "source": source, "int4_bytes": INT4,
                "table_i_threads": TABLE_I_THREADS, "n_v": N_V, "max_context": MAX_CONTEXT,
                "gpu_prefill_macs": GPU_PREFILL_MACS, "cpu_prefill_macs_16t": CPU_PREFILL_MACS_16T}
    paper = {"fixed_rate": PAPER_FIXED_RATE_SPEEDUP, "opt_r_cg_llama": PAPER_OPT_RCG_LLAMA,
             "memory": {f"{m} @ {gb} GiB": v for (m, gb), v in PAPER_MEMORY.items()},
             "tokens": {f"{m} @ {t} tokens": v for (m, t), v in PAPER_TOKENS.items()}}
    # one row per reading of Table I's PCIe beta; the simulation uses no measured number of this machine
    rows = [{"pcie_beta_per": unit, **res[unit]} for unit in ("bytes", "elements")]
    write_report("scheinfer_ablation", args.out, title="ScheInfer ablation (simulated)", settings=settings, rows=rows,
                 body=md.rstrip("\n"), extra={"paper": paper, "seconds": elapsed})
    doc = Path(args.doc)
    if doc.is_file() and BEGIN in (text := doc.read_text()) and END in text:
        head, rest = text.split(BEGIN, 1)
        doc.write_text(head + BEGIN + "\n" + md + END + rest.split(END, 1)[1])
    print(md)
    print(f"({elapsed:.1f} s)")


if __name__ == "__main__":
    main()
