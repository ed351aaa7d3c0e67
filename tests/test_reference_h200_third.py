"""The planner against the third H200 run (benchmarks/reference/h200-2026-11-26b: gpu_offload.py's rows
at cc9c1b1, after attention left cuDNN and copy waits stopped spinning, planned with that machine's
quick profile, as the benchmark planned). Rows priced on a workload property the plans do not model
(the dummy weights' routing locality in an LRU cache) are marked not comparable in the data;
comparable rows the models miss are strict xfails with the reason: if one starts to hold, the test
says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from reference_cases import assert_within_tolerance, cases, rows_fixture

REF = Path(__file__).resolve().parents[1] / "benchmarks" / "reference" / "h200-2026-11-26b" / "measured.json"
GEMM = "CPU prefill GEMMs on 112 MiB weight matrices ran at ~1.0e12 MAC/s; the quick profile's GEMM fit says 2.9e12"

UNMET = {
    ("MoE, every miss copied", "ttft_s"): "the dummy weights route a 512-token prompt to ~2 experts a layer (0.091 s); "
                                          "the plan draws routing i.i.d. and copies every expert (0.211 s)",
    ("MoE, every miss on the CPU", "ttft_s"): GEMM,
    ("MoE, no GPU", "ttft_s"): GEMM,
    ("dense, no GPU", "ttft_s"): GEMM,
    ("dense, no GPU", "decode_tokens_per_s"): "20.5 tok/s here, 28.7 an hour earlier on the same image (call 1): the "
                                              "host's DRAM rate swings; the profile's 98 GB/s gives 26.1",
    ("dense, default plan (sliced)", "decode_tokens_per_s"): "the CC slices (61% of FFN rows, in pinned memory) streamed "
                                                             "~39 GB/s in the stall probe, priced at the DRAM rate",
    ("dense, default plan (sliced)", "ttft_s"): "0.114 s against 0.064: the sliced prefill's CPU GEMMs (" + GEMM + ")",
    ("MoE, unconstrained GPU", "decode_tokens_per_s"): "an eager MoE step on that host: 6.6 ms against 4.3 priced "
                                                       "(runtime/decode_step_gpu is timed on a dense step)",
    ("dense, unconstrained GPU", "decode_tokens_per_s"): "the step runs as a CUDA graph (2.5 ms); the plan prices "
                                                         "the eager step's host overhead",
}


rows = rows_fixture(REF)


@pytest.mark.parametrize("name, metric", cases(REF, UNMET))
def test_prediction_within_25_percent_of_the_third_h200_run(rows, name, metric):
    assert_within_tolerance(rows, name, metric)

