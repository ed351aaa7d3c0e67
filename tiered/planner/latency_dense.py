"""Latency goal, dense model, with a GPU: ScheInfer's slicing (ALGORITHMS.md 1).

Greedy GPU-memory assignment of r_GG per layer (Eq. 14), optimal r_CG per layer by edge points
(Eq. 5-13), token assignment n_g for the prompt (Eq. 15). Byte counts are the engine's own
(memory/sizes.py): non-FFN weights, the KV cache of one `context_tokens` sequence, and the
double-buffered CG staging of the largest FFN.
"""

from __future__ import annotations

from dataclasses import replace

from tiered.checkpoint.model_config import ModelConfig
from tiered.hardware import op_time
from tiered.hardware.budget import format_bytes
from tiered.hardware.profile import HardwareProfile
from tiered.memory import sizes
from tiered.planner.common import attention_time, head_time
from tiered.planner.plan import LayerPlan, Plan


def is_mlp_param(name: str) -> bool:
    """Parameters of a decoder layer's dense MLP."""
    return ".mlp." in name


def plan_dense_latency(plan: Plan, cfg: ModelConfig, profile: HardwareProfile, gpu: int, cpu: int | None,
                       graphs: bool = False) -> Plan:
    """Fill `plan` for a dense model on a GPU of `gpu` bytes. `graphs`: the engine may graph decode
    steps (make.settle_gpu_decode): decode is priced with the graphed step's host cost.

    Raises:
        BudgetError: the GPU cannot hold the non-FFN weights, KV cache and staging.
    """
    from tiered.planner.cost_model import (LayerShape, cost_params, decode_layer_time, prompt_layer_time,
                                           shared_dram_time)
    from tiered.planner.scheinfer import ffn_gpu_budget, solve_n_g, solve_r_cg

    fmt = plan.dtypes["weights"]
    bpe = sizes.bytes_per_element(fmt)
    M, H, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    ctx = plan.prompt_tokens + plan.gen_tokens
    non_ffn = sizes.weight_bytes(cfg, fmt, is_mlp_param) + sizes.rotary_bytes(cfg, plan.context_tokens)
    kv = sizes.kv_cache_bytes(cfg, plan.kv_slots, plan.context_tokens, plan.dtypes["kv_cache"])
    fixed = dict(non_ffn_bytes=non_ffn, kv_cache_bytes=kv, activation_bytes=plan.workspace_bytes, margin=0.0)
    room = ffn_gpu_budget(gpu, **fixed)  # GPU bytes for FFN weights and, when sliced, their staging
    decode_shape = LayerShape(1, M, H, 3, bpe)
    ffn_total = L * 3 * M * H * bpe
    # what the CPU streams per decode step is at most every FFN weight: beyond the LLC, at DRAM speed
    params = cost_params(profile, fmt, decode_shape, cpu_working_set=ffn_total)
    staging = 0.0
    if room >= ffn_total:
        # every FFN fits: none is sliced. ScheInfer slices what the GPU cannot hold; a split layer also
        # pays host syncs and thread hops that the cost model leaves out (a tiny model's FFNs, split
        # "for speed" on an idle H200, lost its CUDA graphs)
        layer_rates = [solve_r_cg(decode_shape, 1.0, params).rates] * L
        budget = room
    else:
        layer_rates, staging = _sliced_rates(decode_shape, L, params, gpu, fixed, sizes.ffn_bytes(cfg, fmt))
        budget = room - staging
    prompt_shape = LayerShape(plan.prompt_tokens, M, H, 3, bpe)
    pparams = cost_params(profile, fmt, prompt_shape, cpu_working_set=ffn_total)
    # the model code's host cost per layer and per step (module calls, small ops, their launches):
    # decode's graphed as the engine will graph it (every FFN on the GPU: the whole step; else
    # piecewise), prefill's always eager
    graphed = None if not graphs else "whole" if room >= ffn_total else "piecewise"
    # a graphed step's GEMVs (the attention's, and in a whole-step graph the FFNs' and the head's) at the
    # rate the profile timed them replayed in a graph, where it did (op_time.graph_gemv)
    attn_dec = attention_time(cfg, profile, "gpu", fmt, 1, ctx, plan.dtypes["kv_cache"], graphed=graphed is not None)
    attn_pre = attention_time(cfg, profile, "gpu", fmt, plan.prompt_tokens, plan.prompt_tokens, plan.dtypes["kv_cache"])
    g = op_time.graph_gemv(profile, "gpu", fmt) if graphed == "whole" else None
    dparams = params if g is None else replace(params, alpha_gpu=g.alpha, beta_gpu=g.beta * bpe, t_launch=0.0)
    per_step, per_layer = op_time.step_overhead(profile, fmt, "gpu", graphed=graphed)
    per_step_prefill, per_layer_prefill = op_time.step_overhead(profile, fmt, "gpu")
    act_bpe = sizes.bytes_per_element(sizes.kv_compute_format(plan.dtypes["kv_cache"]))  # activations: 16-bit, fp32 with fp32 weights
    ffn_gpu_bytes = 0.0
    for i, rates in enumerate(layer_rates):
        tok = solve_n_g(prompt_shape, rates, pparams)
        prefill = prompt_layer_time(prompt_shape, rates, tok.n_g, pparams) + attn_pre
        prefill += sliced_layer_syncs(profile, M * act_bpe, plan.prompt_tokens - tok.n_g) if rates.r_cc > 0 else 0.0
        # the model code's host cost adds to the layer's GPU work, a layer wholly on the GPU too: priced
        # as overlapped (the host issuing while the GPU runs the GEMMs), a 512-token prompt through 8
        # Llama-3-8B-width layers was priced at 4.3-4.5 ms on the H100 and the H200 and ran in 5-9 ms;
        # added, 7.3 and 7.9 ms
        prefill += per_layer_prefill
        plan.layers.append(LayerPlan(i, "dense", fmt, rates.r_cc, rates.r_cg, rates.r_gg, tok.n_g,
                                     decode_s=decode_layer_time(decode_shape, rates, dparams) + attn_dec + per_layer
                                     + (sliced_layer_syncs(profile, M * act_bpe, 1) if rates.r_cc > 0 else 0.0),
                                     prefill_s=prefill))
        ffn_gpu_bytes += rates.r_gg * 3 * M * H * bpe
    head = head_time(cfg, profile, "gpu", fmt)
    head_dec = head_time(cfg, profile, "gpu", fmt, graphed=graphed == "whole")
    plan.predicted_decode_tokens_per_s = 1.0 / (sum(l.decode_s for l in plan.layers) + head_dec + per_step)
    plan.predicted_ttft_s = sum(l.prefill_s for l in plan.layers) + head + per_step_prefill
    sliced = ffn_gpu_bytes < ffn_total - 1
    plan.memory = {"gpu": non_ffn + kv + plan.workspace_bytes + (staging if sliced else 0) + ffn_gpu_bytes,
                   "cpu": ffn_total - ffn_gpu_bytes}
    mean_cc = sum(l.r_cc for l in plan.layers) / L
    # the host memory binds where the CC reads and CG copies together take longer than either side
    dram = sum(shared_dram_time(decode_shape, r.r_cc + r.r_cg, params) for r in layer_rates)
    ffn = sum(decode_layer_time(decode_shape, r, params) for r in layer_rates)
    if not sliced:
        plan.binding = "GPU compute: every FFN fits on the GPU"
    elif dram >= ffn * (1 - 1e-9):
        plan.binding = (f"host memory: {format_bytes(budget)} for FFN weights holds {ffn_gpu_bytes / ffn_total:.0%} of "
                        f"them; the CPU's reads of the CC rows ({mean_cc:.0%}) and the link's copies of the CG rows "
                        f"share ~{1e-9 / params.beta_dram:.0f} GB/s of DRAM")
    elif mean_cc > 0.5:
        plan.binding = (f"GPU memory: {format_bytes(budget)} for FFN weights holds {ffn_gpu_bytes / ffn_total:.0%} of them; "
                        f"the CPU computes {mean_cc:.0%} of the rest's rows (CPU GEMM bound)")
    else:
        plan.binding = (f"GPU memory and PCIe: {ffn_gpu_bytes / ffn_total:.0%} of FFN weights resident, "
                        f"the rest split between CPU compute and H2D copies")
    return plan


def sliced_layer_syncs(profile: HardwareProfile, row_bytes: float, rows: int) -> float:
    """Seconds a sliced layer's host round trip adds to its critical path when its CC part has `rows`
    rows (runtime/sliced.SlicedMLP.forward): the activations' D2H to the CPU, which waits for the
    GPU's work before it (copy/d2h_pageable), the CC output's H2D back (copy/h2d_pageable), and the
    hop of the GPU parts' results to the calling thread (runtime/task); `row_bytes` per row. Not in
    ScheInfer's model (S4: the D2H of X1 and the H2D of Y^CC are left out). On the H100's host
    (2026-11-26) these keys give ~0.21 ms a layer: the dense default plan, priced 40.6 tok/s
    without them, decoded at 29.5-31.1."""
    from tiered.planner.latency_moe import LayerCosts

    if rows <= 0:
        return 0.0
    costs, n = LayerCosts.of(profile), rows * row_bytes
    return sum(k(n) for k in (costs.d2h, costs.h2d) if k is not None) + costs.task


def _staging_share(rates) -> float:
    """The GPU staging the runtime allocates for sliced FFNs, as a share of one FFN's bytes: a CG buffer
    of the largest layer's CG rows and a CG' buffer of the largest CC (runtime/sliced.SliceStaging)."""
    return max(r.r_cg for r in rates) + max(r.r_cc for r in rates)


def _staging_bytes(share: float, ffn_bytes: int, rows: int) -> float:
    """Bytes of `share` of an FFN of `rows` rows, and two rows more: the runtime rounds each part's
    rows (runtime/sliced.split_rows)."""
    return share * ffn_bytes + 2 * ffn_bytes / rows


def _sliced_rates(shape, layers: int, params, gpu: int, fixed: dict, ffn_bytes: int) -> tuple[list, float]:
    """ScheInfer's stage 2 under a GPU budget less the slices' staging, which depends on the rates it
    chooses: first one FFN's bytes (the CG and CC rows of one layer add up to at most its rows), then,
    when the layers' largest CG and largest CC rows add up to more, that much, until it holds (the
    engine used to keep two whole FFNs: on the dense bench shape at 2 GiB, 352 MB of GPU memory that
    holds 12% of the FFN weights). Returns (the layers' rates, the staging bytes the runtime allocates
    for them).

    Raises BudgetError: the GPU cannot hold the fixed parts and the staging.
    """
    from tiered.planner.scheinfer import assign_gpu_memory, ffn_gpu_budget

    for share in (1.0, None, None, None, 2.0):  # None: what the last rates need; 2.0: the bound
        if share is None:
            share = need
        budget = ffn_gpu_budget(gpu, staging_bytes=_staging_bytes(share, ffn_bytes, shape.d_ff), **fixed)
        rates = list(assign_gpu_memory([shape] * layers, params, budget).rates)
        need = _staging_share(rates)
        if need <= share + 1e-9:
            break
    return rates, _staging_bytes(need, ffn_bytes, shape.d_ff)
