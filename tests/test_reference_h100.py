"""The planner against the first H100 run (benchmarks/reference/h100-2026-11-26: gpu_offload.py's rows at
c629b84, planned with that machine's quick profile, measured in the same device call). Rows priced on a
workload property the plans do not model (the dummy weights' routing locality in an LRU cache) or
planned before a planner change are marked not comparable in the data; comparable rows the models miss
are strict xfails with the reason: if one starts to hold, the test says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from reference_cases import assert_within_tolerance, cases, rows_fixture

REF = Path(__file__).resolve().parents[1] / "benchmarks" / "reference" / "h100-2026-11-26" / "measured.json"
ROUTING = "the dummy weights' routing: "
GPU_PREFILL = ("the same 512-token prompt on the GPU ran in 5-9 ms over six runs of the two unconstrained rows "
               "(prefill is not graphed in either); this row's median of 3 is 5 ms, priced 7.3")

UNMET = {
    ("MoE, every miss copied", "decode_tokens_per_s"): ROUTING + "the LRU slots hit 42% of expert uses, 10% priced",
    ("MoE, every miss copied", "ttft_s"): ROUTING + "a 512-token prompt routes to ~2 experts a layer (0.092 s); the "
                                          "plan draws routing i.i.d. and copies every expert (0.216 s)",
    ("MoE, unconstrained GPU, eager", "decode_tokens_per_s"): "an eager grouped-expert step on that host: 8 ms "
                                                              "against 3.9 priced (runtime/decode_step_gpu is timed "
                                                              "on a dense step)",
    ("dense, no GPU", "ttft_s"): "0.573 s (median of 3) against 0.420: 72 ms a layer measured, 52 priced (prompt "
                                 "GEMMs at the gemm_big line; the attention's 512 x 512 causal SDPA in bf16)",
    ("dense, unconstrained GPU, eager", "decode_tokens_per_s"): "128, 229 and 268 tok/s in three runs (median 229 "
                                                                "against 162 priced): the eager step's host cost swings",
    ("dense, unconstrained GPU", "decode_tokens_per_s"): "411 tok/s as one CUDA graph against 294 priced: the GEMVs' "
                                                         "per-call start-up (gemv/gpu alpha 18 us) is priced inside "
                                                         "the graph, which has none",
    ("dense, unconstrained GPU, eager", "ttft_s"): GPU_PREFILL,
    ("dense, default plan (sliced, one FFN of staging, cudaHostAlloc)", "ttft_s"):
        "0.083 s (median of 4) against 0.052: ~10 ms a layer where the copies of the CG rows and of the CC rows for "
        "the CG' tokens (296 MB at 47-55 GB/s) take ~6; the sliced prompt's copies and GEMMs are priced as "
        "overlapping in ScheInfer's pipeline",
}


rows = rows_fixture(REF)


@pytest.mark.parametrize("name, metric", cases(REF, UNMET))
def test_prediction_within_25_percent_of_the_first_h100_run(rows, name, metric):
    assert_within_tolerance(rows, name, metric)
