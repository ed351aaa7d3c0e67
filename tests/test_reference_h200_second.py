"""The planner against the second H200 run (benchmarks/reference/h200-2026-11-26: gpu_offload.py's
rows at 7b56371 as data, planned with that machine's quick profile, as the benchmark planned).
Rows whose runtime the models cannot price are marked not comparable in the data (the 34 ms per-step
stall of the default plans, the cache's locality); comparable rows the models miss are strict xfails
with the reason: if one starts to hold, the test says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from reference_cases import assert_within_tolerance, cases, rows_fixture
from tiered.planner.reference import load_reference

REF = Path(__file__).resolve().parents[1] / "benchmarks" / "reference" / "h200-2026-11-26" / "measured.json"

CUDNN = ("measured before cc9c1b1, while cuDNN attention built an execution plan for every new shape (0.011-0.012 s; "
         "0.008 s in the third run, after the fix, which the same prices hold to 25%)")

UNMET = {
    ("MoE, every miss copied", "ttft_s"): "the dummy weights route a 512-token prompt to ~2 experts a layer (0.063 s); "
                                          "the plan draws routing i.i.d. and copies every expert (0.167 s)",
    ("MoE, every miss on the CPU", "ttft_s"): "CPU prefill GEMMs on 112 MiB expert matrices run below the profile's GEMM fit",
    ("MoE, no GPU", "ttft_s"): "CPU prefill GEMMs on 112 MiB expert matrices run below the profile's GEMM fit",
    ("dense, no GPU", "ttft_s"): "CPU prefill GEMMs on 112 MiB matrices run below the profile's GEMM fit",
    ("MoE, unconstrained GPU", "ttft_s"): CUDNN,
    ("dense, unconstrained GPU", "ttft_s"): CUDNN,
    ("MoE, unconstrained GPU", "decode_tokens_per_s"): "an eager MoE step on that host: 8.1 ms against 4.3 priced "
                                                       "(runtime/decode_step_gpu is timed on a dense step)",
    ("dense, unconstrained GPU", "decode_tokens_per_s"): "the step runs as a CUDA graph (2.1 ms); the plan prices "
                                                         "the eager step's host overhead",
}


rows = rows_fixture(REF)


@pytest.mark.parametrize("name, metric", cases(REF, UNMET))
def test_prediction_within_25_percent_of_the_second_h200_run(rows, name, metric):
    assert_within_tolerance(rows, name, metric)


def test_cpu_experts_are_priced_at_the_dram_rate(rows):
    """The quick profile's bf16 GEMV (221 GB/s) is timed on operands a 300 MiB cache holds; a decode
    step's CPU experts stream from DRAM (98 GB/s): the forced-CPU row was predicted at 72 tok/s
    (2.3x its 31.0) before ExpertLatency.working_set."""
    r = rows["MoE, every miss on the CPU"]
    assert r["predicted"]["decode_tokens_per_s"] < 1.25 * r["measured"]["decode_tokens_per_s"]


def test_cpu_slices_are_priced_at_the_dram_rate():
    """ScheInfer's CPU side (CC slices) streams a decode step's FFN weights from DRAM: cost_params
    floors its memory term by memory/bandwidth_dram/cpu once the step's bytes exceed the LLC, which
    moves the 8-layer Llama-3 plan under a 2 GiB budget from 77% of FFN rows on the CPU (predicted
    62 tok/s against 8.6 measured, most of it the step's stall) to about 60%."""
    from tiered.planner.cost_model import LayerShape, cost_params
    from tiered.planner.make import make_plan
    from tiered.planner.reference import model_config

    ref, hw = load_reference(REF)
    shape = LayerShape(1, 4096, 14336, 3, 2)
    llc = hw.meta["llc_bytes"]
    cached, streamed = cost_params(hw, "bf16", shape), cost_params(hw, "bf16", shape, cpu_working_set=2 * llc)
    dram = hw.models["memory/bandwidth_dram/cpu"].beta
    assert streamed.beta_cpu >= dram * 2 > cached.beta_cpu  # per MAC at one token: 2 bytes per weight
    assert cost_params(hw, "bf16", shape, cpu_working_set=llc / 2) == cached
    plan = make_plan(model_config(ref, "Llama-3-8B, 8 layers"), hw, gpu_memory=2 * 2**30, prompt_tokens=32,
                     gen_tokens=32, context_tokens=1024)
    assert 0.4 < sum(l.r_cc for l in plan.layers) / len(plan.layers) < 0.7
