"""Profiler (hardware/profiler.py), presets, op_time roofline, Fiddler thresholds, `tiered profile` core."""

from __future__ import annotations

import json
from dataclasses import replace
import math
import statistics
import time

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings, strategies as st

from tiered import kernels
from tiered.errors import ConfigError
from tiered.hardware import contention, op_time
from tiered.hardware.presets import PRESETS, get_preset
from tiered.hardware.profile import HardwareProfile, LinearModel
from tiered.hardware.profiler import fit_affine, median_time, median_times, profile_machine
from tiered.planner.fiddler import ExpertLatency, ExpertShape, dispatch_latency
from tiered.runtime.dispatcher import CPU, choose_path

MIXTRAL_EXPERT = ExpertShape(4096, 14336)


# ---- fitting ------------------------------------------------------------------------------------

def test_fit_affine_recovers_a_line():
    m = fit_affine([1, 2, 4, 8], [3e-6 + 2e-9 * n for n in (1, 2, 4, 8)])
    assert m.alpha == pytest.approx(3e-6) and m.beta == pytest.approx(2e-9) and m.r2 == pytest.approx(1.0)


def test_fit_affine_never_returns_a_negative_intercept():
    m = fit_affine([1, 2, 3], [0.5, 2.0, 3.0])  # least squares would give alpha = -0.33
    assert m.alpha == 0.0 and m.beta > 0 and m.r2 is not None
    m = fit_affine([1, 2, 3], [3.0, 2.0, 1.5])  # ... or a negative slope: the best constant instead
    assert m.beta == 0.0 and m.alpha == pytest.approx(6.5 / 3)
    assert fit_affine([4.0], [2.0]) == LinearModel(0.0, 0.5, None)
    with pytest.raises(ValueError):
        fit_affine([], [])


def test_fit_gemm_separates_a_calls_weight_bytes_from_its_multiply_adds():
    """fit_gemm: t = alpha + beta n + gamma w recovered from GEMMs whose rows vary over two weights (the affine
    fit over n alone bends: its slope above beta, R^2 below 1); fit_affine's line and no weight term where the
    points cannot separate it (3 points, one weight, or weights proportional to the multiply-adds)."""
    from tiered.hardware.profiler import fit_gemm, pack_key

    shapes = [(64, 1024, 1024), (256, 1024, 1024), (128, 2048, 1024), (512, 1024, 1024), (64, 4096, 2048)]
    n = [T * K * N for T, K, N in shapes]
    w = [2.0 * K * N for _, K, N in shapes]
    t = [5e-5 + 8e-13 * a + 5e-11 * b for a, b in zip(n, w)]
    line, pack = fit_gemm(n, w, t)
    assert (line.alpha, line.beta, pack.beta) == pytest.approx((5e-5, 8e-13, 5e-11), rel=1e-6)
    assert pack.alpha == 0.0 and line.r2 == pack.r2 == pytest.approx(1.0)
    affine = fit_affine(n, t)
    assert affine.beta > 1.1 * line.beta and affine.r2 < 0.99
    assert fit_gemm(n[:3], w[:3], t[:3]) == (fit_affine(n[:3], t[:3]), None)
    one = [(T, 1024, 1024) for T in (64, 128, 256, 512)]
    assert fit_gemm([T * K * N for T, K, N in one], [2.0 * K * N for _, K, N in one], [1e-3, 2e-3, 4e-3, 8e-3])[1] is None
    with pytest.raises(ValueError):
        fit_gemm([1, 2], [1], [1, 2])
    assert pack_key("gemm/cpu/bf16") == "gemm_pack/cpu/bf16"
    assert pack_key("gemm_amx/cpu/int4") == "gemm_amx_pack/cpu/int4"
    with pytest.raises(ValueError):
        pack_key("gemm_big/cpu/bf16")


def test_a_prompt_gemm_pays_its_weights_bytes_at_the_pack_rate():
    """op_time.gemm_line: a GEMM of GEMM_ROWS rows or more under BIG_GEMM_BYTES pays gemm_pack's rate on its
    weight's bytes a call beside the fit's intercept (per byte of the dtype asked, through find's fallback);
    fewer rows, unknown rows, big weights with gemm_big, and profiles without the key price as before."""
    fit = LinearModel(1e-4, 1e-12, 0.99)
    hw = HardwareProfile("box", "test", {"gemm/cpu/bf16": fit, "gemm_pack/cpu/bf16": LinearModel(0.0, 5e-11, 0.99),
                                         "gemm_big/cpu/bf16": LinearModel(2e-3, 9e-13, 0.99)})
    w = 7.0 * 2**20
    assert op_time.gemm_line(hw, "cpu", "bf16", w, fit, 512) == LinearModel(1e-4 + 5e-11 * w, 1e-12, 0.99)
    assert op_time.gemm_line(hw, "cpu", "fp16", w, fit, 512) == LinearModel(1e-4 + 5e-11 * w, 1e-12, 0.99)
    for tokens in (None, 1, op_time.GEMM_ROWS - 1):
        assert op_time.gemm_line(hw, "cpu", "bf16", w, fit, tokens) is fit
    assert op_time.gemm_line(hw, "cpu", "bf16", 32 * 2**20, fit, 512) == hw.models["gemm_big/cpu/bf16"]
    plain = replace(hw, models={k: m for k, m in hw.models.items() if not k.startswith("gemm_pack/")})
    assert op_time.gemm_line(plain, "cpu", "bf16", w, fit, 512) is fit
    macs = 512 * w / 2
    assert op_time.gemm_time(hw, "cpu", "bf16", macs, w) == pytest.approx(
        op_time.gemm_time(plain, "cpu", "bf16", macs, w) + 5e-11 * w)


def test_a_gemm_keys_weight_term_is_the_kept_runs():
    """_Bench.attempt with weights: a GEMM key timed again (R^2 below GEMM_STALL_R2) keeps the best run's line
    and weight term together, and the weight term carries the key's compute-probe readings."""
    from tiered.hardware.profiler import _Bench

    shapes = [(64, 1024, 1024), (256, 1024, 1024), (128, 2048, 1024), (512, 1024, 1024)]
    n = [T * K * N for T, K, N in shapes]
    w = [2.0 * K * N for _, K, N in shapes]
    good = [(a, 5e-5 + 8e-13 * a + 5e-11 * b) for a, b in zip(n, w)]
    stalled = [(a, t * (3.0 if i == 1 else 1.0)) for i, (a, t) in enumerate(good)]
    runs = iter([stalled, good])
    b = _Bench(True, None, None)
    b.compute = _Readings([1.0, 1.2])
    b.attempt("gemm/cpu/bf16", lambda: next(runs), weights=w)
    assert b.models["gemm_pack/cpu/bf16"].beta == pytest.approx(5e-11, rel=1e-6)
    assert b.models["gemm/cpu/bf16"].beta == pytest.approx(8e-13, rel=1e-6)
    assert b.compute_seconds == {"gemm/cpu/bf16": [1.0, 1.2], "gemm_pack/cpu/bf16": [1.0, 1.2]}


@pytest.mark.parametrize("n", [1, 1000, (1 << 16) + 7, 3 * (1 << 16) + 5])
def test_fill_random_fills_every_element_with_normal_draws(n):
    from tiered.hardware.profiler import RANDOM_BLOCK, fill_random_, random_normal

    t = torch.full((n,), float("nan"))
    g = torch.Generator().manual_seed(3)
    fill_random_(t, 0.5, g)
    assert torch.isfinite(t).all()  # the doubling copies reached the tail
    block = min(n, RANDOM_BLOCK)
    assert torch.equal(t[:block], torch.randn(block, generator=torch.Generator().manual_seed(3)).mul_(0.5))
    if n > RANDOM_BLOCK:  # the block repeated through the rest
        assert torch.equal(t[RANDOM_BLOCK:2 * RANDOM_BLOCK][:n - RANDOM_BLOCK], t[:min(RANDOM_BLOCK, n - RANDOM_BLOCK)])
    if n >= 1000:
        assert 0.45 < float(t.std()) < 0.55
    w = random_normal(64, 300)
    assert w.shape == (64, 300) and w.dtype == torch.float32 and w.is_contiguous()
    assert 0.015 < float(w.std()) < 0.025


def test_module_copies_hold_memory_of_their_own():
    from tiered.hardware.profiler import _module_copies

    template = torch.nn.Linear(8, 4, bias=True)
    copies = _module_copies(template, 3)
    assert len(copies) == 3 and all(c is not template for c in copies)
    ptrs = {template.weight.data_ptr()} | {c.weight.data_ptr() for c in copies}
    assert len(ptrs) == 4  # every copy streams its own bytes
    assert all(torch.equal(c.weight, template.weight) and torch.equal(c.bias, template.bias) for c in copies)


def test_a_meta_build_skips_parameter_init_and_a_cpu_build_keeps_it():
    from torch import nn

    from tiered.checkpoint.model_config import ModelConfig
    from tiered.models import build_model

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    linear_init, embedding_init = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    calls = []
    nn.Linear.reset_parameters = lambda self: calls.append(self)
    try:
        with torch.device("meta"):
            build_model(cfg, 8)
        assert calls == []  # skipped on the meta device ...
        assert nn.Linear.reset_parameters is not linear_init  # ... and the class's own method put back
        build_model(cfg, 8)
        assert len(calls) == 2 * 7 + 1  # on the CPU each projection and the head initialized as before
    finally:
        nn.Linear.reset_parameters = linear_init
    assert nn.Embedding.reset_parameters is embedding_init
    model = build_model(cfg, 8)
    assert all(float(m.weight.detach().abs().sum()) > 0 for m in model.modules() if type(m) is nn.Linear)
    # a module another thread builds while a meta tree is built keeps its initialization
    import threading

    from tiered import models

    inside, done, built = threading.Event(), threading.Event(), []

    def other():
        inside.wait()
        torch.manual_seed(7)
        built.append(nn.Linear(16, 16))
        done.set()

    worker = threading.Thread(target=other)
    worker.start()
    with models._no_parameter_init(), torch.device("meta"):
        inside.set()
        assert done.wait(10)
    worker.join()
    torch.manual_seed(7)
    assert torch.equal(built[0].weight, nn.Linear(16, 16).weight)


def test_median_time_is_positive():
    assert median_time(lambda: sum(range(100)), 3) > 0


def test_a_fit_with_no_slope_takes_the_points_median_rate():
    """_Bench.fit: three points whose least-squares slope clamps to 0 (one stalled: the fresh machine's
    gemv_dram/cpu/bf16, 2026-11-26) give the median of their rates through the origin, with a note; a
    sound set of points keeps its affine fit."""
    from tiered.hardware.profiler import _Bench

    b = _Bench(True, None, None)
    stalled = [(8388608.0, 1.37e-4), (16777216.0, 4.28e-3), (33554432.0, 5.0e-4)]
    b.fit("gemv_dram/cpu/bf16", stalled)
    m = b.models["gemv_dram/cpu/bf16"]
    assert m.alpha == 0.0 and m.beta == pytest.approx(1.37e-4 / 8388608.0)
    assert isinstance(m.r2, float) and m.r2 <= 1.0  # that line's R^2, as every fitted key has one
    assert b.notes and "gemv_dram/cpu/bf16" in b.notes[0]
    b.fit("gemv/cpu/bf16", [(1e6, 2e-5 + 1e-5), (2e6, 2e-5 + 2e-5), (4e6, 2e-5 + 4e-5)])
    assert b.models["gemv/cpu/bf16"].alpha == pytest.approx(2e-5) and len(b.notes) == 1


def test_a_stalled_bandwidth_key_is_timed_again_and_its_best_run_kept():
    """_Bench.attempt: gemv/cpu/int4 as a loaded machine timed it (2026-11-27: 2.6 MB at 2.5 ms, R^2
    0.02, a 0.6 ms intercept that priced SmolLM2's decode 27x slow) is timed again and the sound run
    kept, with a note; a key that is not a memory stream keeps its one run; one that stalls every
    time keeps its best run."""
    from tiered.hardware.profiler import STALL_RETRIES, _Bench

    stalled = [(163840.0, 1.41e-5), (655360.0, 3.57e-4), (2621440.0, 2.53e-3), (5242880.0, 1.56e-4)]
    sound = [(163840.0, 7.4e-6), (655360.0, 2.19e-5), (2621440.0, 7.5e-5), (5242880.0, 1.47e-4)]
    runs = iter([stalled, sound])
    b = _Bench(True, None, None)
    b.attempt("gemv/cpu/int4", lambda: next(runs))
    m = b.models["gemv/cpu/int4"]
    assert m.r2 > 0.99 and m.alpha < 5e-6 and b.points["gemv/cpu/int4"] == sound
    assert len(b.notes) == 1 and "gemv/cpu/int4: timed 2 times" in b.notes[0]
    calls = []
    b.attempt("attn/cpu/fp32", lambda: calls.append(1) or stalled)
    assert len(calls) == 1 and b.models["attn/cpu/fp32"].r2 < 0.5
    worse = [(163840.0, 1e-3), (655360.0, 1e-5), (2621440.0, 1e-3), (5242880.0, 1e-5)]  # R^2 ~0
    runs = iter([worse, stalled, worse])
    b.attempt("gemv_dram/cpu/int4", lambda: next(runs))
    assert b.points["gemv_dram/cpu/int4"] == stalled and f"timed {STALL_RETRIES + 1} times" in b.notes[-1]


def test_the_row_keys_are_timed_three_times_through_the_profile_and_fitted_on_each_points_median():
    """_Bench.again / settle: the compute-bound row keys (SECOND_PASS_KEYS) are timed twice more later in the profile
    and fitted on each point's median of the three timings, with a note where that moved them. These points are the
    native bf16 expert's on 2 Zen 3 cores (2026-12-01): a neighbour's second slowed every point alike (R^2 0.96, not
    a stall the retries see), and another second ran it fast; the faster of two timings had kept the fast one. Other
    keys, a timing that fails, or one of other points are left out."""
    from tiered.hardware.profiler import SECOND_PASS_KEYS, _Bench

    macs = 3 * 1024 * 3584
    slow = [(r * macs, t * 1e-3) for r, t in ((1, 1.18), (2, 1.39), (4, 2.05), (8, 4.88))]
    usual = [(r * macs, t * 1e-3) for r, t in ((1, 0.92), (2, 1.03), (4, 1.42), (8, 2.99))]
    fast = [(r * macs, t * 1e-3) for r, t in ((1, 0.67), (2, 0.72), (4, 1.05), (8, 1.80))]
    assert "expert_rows/cpu/bf16".startswith(SECOND_PASS_KEYS) and "decode_rows/cpu/int4q8".startswith(SECOND_PASS_KEYS)
    b = _Bench(True, None, None)
    runs = iter([slow, fast, usual])
    b.attempt("expert_rows/cpu/bf16", lambda: next(runs))
    assert b.points["expert_rows/cpu/bf16"] == slow
    calls = []
    b.attempt("attn/cpu/fp32", lambda: calls.append(1) or usual)  # not a row key: timed once
    b.attempt("decode_rows/cpu/int4", lambda: calls.append(2) or usual)
    fails = iter([usual])
    b.attempt("decode_rows/cpu/bf16", lambda: next(fails))  # its later timings raise StopIteration
    first = b.models["expert_rows/cpu/bf16"]
    b.again()
    b.again()
    b.settle()
    assert b.points["expert_rows/cpu/bf16"] == usual and b.models["expert_rows/cpu/bf16"].beta < 0.7 * first.beta
    assert len(b.notes) == 1 and b.notes[0].startswith("expert_rows/cpu/bf16: timed 3 times")
    assert calls == [1, 2, 2, 2] and b.points["decode_rows/cpu/bf16"] == usual
    up = [(n, 1.01 * t) for n, t in usual]
    down = [(n, 0.99 * t) for n, t in usual]
    runs = iter([[usual[0], up[1], down[2], up[3]], [up[0], usual[1], usual[2], down[3]], [down[0], down[1], up[2],
                                                                                          usual[3]]])
    b.attempt("expert_rows/cpu/int4q8", lambda: next(runs))
    b.again()
    b.again()
    b.settle()  # point by point, the median
    assert b.points["expert_rows/cpu/int4q8"] == usual
    runs = iter([slow, usual[:3], fast[:3]])
    b.attempt("expert_rows/cpu/bf16", lambda: next(runs))
    b.again()
    b.again()
    b.settle()  # other points: the first timing stands
    assert b.points["expert_rows/cpu/bf16"] == slow


def test_a_stalled_small_row_gemm_key_is_timed_again():
    """gemm_rows/cpu/bf16 (torch's GEMM at 8 rows over cold weights, GEMM_ROWS_SHAPES from SmolLM2's 1.8 MB
    FFN matrix up) is timed again like the memory streams: a full profile on 2 AMX cores (2026-11-29) timed
    its 7 MB weight at 2.2 ms for ~0.6 (R^2 0.02, a 1.75 ms intercept that priced each of SmolLM2's prompt
    GEMMs 1.75 ms and its 512-token bf16 TTFT 0.47 s where it took 0.21); these points are that machine's."""
    from tiered.hardware.profiler import GEMM_ROWS_SHAPES, RETIMED_KEYS, _Bench

    assert all(k.startswith(RETIMED_KEYS) for k in ("gemm_rows/cpu/bf16", "gemm/cpu/fp32", "gemm_big/cpu/bf16"))
    assert min(n * k for n, k in GEMM_ROWS_SHAPES) * 2 < 2 * 2**20
    stalled = [(1769472.0, 6.27e-4), (7340032.0, 1.668e-3), (16777216.0, 1.339e-3), (33554432.0, 2.1e-3)]
    sound = [(1769472.0, 1.76e-4), (7340032.0, 6.92e-4), (16777216.0, 9.07e-4), (33554432.0, 1.643e-3)]
    runs = iter([stalled, sound])
    b = _Bench(True, None, None)
    b.attempt("gemm_rows/cpu/bf16", lambda: next(runs))
    m = b.models["gemm_rows/cpu/bf16"]
    assert b.points["gemm_rows/cpu/bf16"] == sound and m.alpha < 3e-4 and "timed 2 times" in b.notes[0]


def test_a_gemm_key_below_its_stricter_r2_is_timed_again(monkeypatch):
    """torch's GEMM keys are timed again below GEMM_STALL_R2 (0.99), not the streams' 0.95: a compute-bound
    line fits at 0.997+ in sound runs. One full profile on 2 AVX2 cores timed gemm/cpu/bf16 at R^2 0.966,
    every point 10-60% slow (these points), and priced a 512-token bf16 MoE prompt 12.8 s for 9.8. Not the
    bf16 keys where the CPU has no bf16 GEMM: each call converts its weight there (no line of MACs), and
    convert/cpu/bf16 prices those GEMMs."""
    from tiered.hardware import cpu_gemm
    from tiered.hardware.profiler import GEMM_STALL_R2, STALL_R2, _Bench

    monkeypatch.setattr(cpu_gemm, "_BF16_NATIVE", True)

    burst = [(67108864.0, 10.51e-3), (134217728.0, 16.16e-3), (268435456.0, 29.6e-3), (536870912.0, 54.07e-3),
             (536870912.0, 68.4e-3), (1073741824.0, 135.37e-3), (536870912.0, 81.26e-3)]
    sound = [(67108864.0, 6.53e-3), (134217728.0, 12.93e-3), (268435456.0, 25.78e-3), (536870912.0, 51.58e-3),
             (536870912.0, 50.19e-3), (1073741824.0, 100.88e-3), (536870912.0, 48.7e-3)]
    b = _Bench(True, None, None)
    b.attempt("gemm/cpu/bf16", lambda: burst)  # timed 3 times, all alike: kept, with a note
    assert STALL_R2 < b.models["gemm/cpu/bf16"].r2 < GEMM_STALL_R2 and "timed 3 times" in b.notes[-1]
    runs = iter([burst, sound])
    b.attempt("gemm/cpu/bf16", lambda: next(runs))
    assert b.points["gemm/cpu/bf16"] == sound and b.models["gemm/cpu/bf16"].beta < 1e-10
    runs = iter([burst])
    b.attempt("gemv/cpu/bf16", lambda: next(runs))  # a stream key keeps 0.95: timed once
    assert b.points["gemv/cpu/bf16"] == burst
    monkeypatch.setattr(cpu_gemm, "_BF16_NATIVE", False)
    runs = iter([burst])
    b.attempt("gemm/cpu/bf16", lambda: next(runs))  # timed once
    assert b.points["gemm/cpu/bf16"] == burst
    runs = iter([burst, sound])
    b.attempt("gemm/cpu/fp32", lambda: next(runs))  # fp32's line is still a line
    assert b.points["gemm/cpu/fp32"] == sound


@pytest.mark.parametrize("native", [True, False])
def test_the_bf16_gemm_keys_time_the_runtimes_gemm(monkeypatch, native):
    """gemm/cpu/bf16 (and gemm_big, gemm_rows) time hardware/cpu_gemm.linear, as the runtime's bf16
    projections and experts call it: torch's bf16 GEMM where the CPU has one, else an fp32 GEMM over the
    converted weight (AVX2 only). _prefill_code_points' empty matmuls leave a weight's conversion out too:
    the GEMM's key has it."""
    import torch.nn.functional as F

    import tiered.hardware.cpu_gemm as cg
    from tiered.hardware.profiler import _EmptyMatmuls, _linear_kernel

    monkeypatch.setattr(cg, "_BF16_NATIVE", native)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(32, 64, generator=g), torch.randn(16, 64, generator=g)
    fn, xdtype, bpe = _linear_kernel("cpu", "bf16", w)
    xb, wb = x.to(xdtype), w.bfloat16()
    want = F.linear(xb, wb) if native else F.linear(xb.float(), wb.float()).bfloat16()
    assert (xdtype, bpe) == (torch.bfloat16, 2) and torch.equal(fn(xb), want)
    p = torch.nn.Parameter(wb, requires_grad=False)
    with _EmptyMatmuls():
        assert p.float().dtype == torch.float32 and cg.linear(xb, p).shape == (16, 32)


def test_memory_points_interleave_their_samples():
    """median_times: one warm-up call each, then every repeat samples each function in turn (so points
    timed while the memory's bandwidth drifts see the same moments), one median per function."""
    calls = []
    fns = [lambda i=i: calls.append(i) for i in range(3)]
    out = median_times(fns, 4, min_sample=0.0)  # one call a sample
    assert calls == [0, 1, 2] + [0, 1, 2] * 4 and len(out) == 3 and all(t >= 0 for t in out)
    slow = median_times([lambda: time.sleep(2e-3), lambda: None], 3, min_sample=0.0)
    assert slow[0] >= 2e-3 > slow[1]


def test_the_step_rows_code_is_the_median_of_each_rounds_difference(monkeypatch):
    """_step_rows_points: each row count's point is the median over rounds of (the step's seconds a layer - its
    projections' alone, timed back to back in that round: interleaved_samples), not the difference of the two
    medians, so a round where the cores ran slow for both cancels; a negative difference reads 0."""
    from tiered.hardware import profiler

    if not kernels.available():
        pytest.skip("the native step needs tiered/kernels")
    run = profiler.DECODE_LAYER_RUN
    # per row count: 3 rounds of (step, projections); the slow round (x3) is slow for both
    rounds = {0: [(2e-3, 1e-4), (6e-3, 3e-4), (2.2e-3, 4e-4)], 1: [(4e-3, 2e-4), (4e-3, 2e-4), (12e-3, 6e-4)],
              2: [(1e-4, 1e-3)] * 3}
    samples = []
    for i in range(len(profiler.STEP_ROWS_TOKENS)):
        samples += [[s for s, _ in rounds[i]], [a for _, a in rounds[i]]]
    monkeypatch.setattr(profiler, "interleaved_samples", lambda calls, repeats, *a, **k: samples)
    pts = profiler._step_rows_points(3)
    D, F_ = profiler.DECODE_LAYER_SHAPES[0][:2]
    assert [n for n, _ in pts] == [float(T * (D + F_)) for T in profiler.STEP_ROWS_TOKENS]
    want = [sorted(s / run - a for s, a in rounds[i])[1] for i in range(2)]
    assert [t for _, t in pts[:2]] == pytest.approx(want) and pts[2][1] == 0.0
    import statistics
    medians = statistics.median(s for s, _ in rounds[0]) / run - statistics.median(a for _, a in rounds[0])
    assert pts[0][1] != pytest.approx(medians)  # not the medians' difference


def test_cpu_memory_keys_read_huge_page_buffers(monkeypatch):
    """memory/bandwidth/cpu, memory/bandwidth_dram/cpu and memory/copy/cpu time buffers from host_empty (huge
    pages where the OS gives them), as the engine's CPU weights and experts sit: every CPU GEMV's price is
    floored by these keys, and on 4 KiB pages the AMX VM's reads ran 16-18 GB/s against 26."""
    from tiered.hardware import budget, profiler

    made, real = [], budget.host_empty

    def host_empty(shape, dtype, *a, **k):
        t = real(shape, dtype, *a, **k)
        made.append((tuple(shape), dtype, t.data_ptr()))
        return t
    monkeypatch.setattr(budget, "host_empty", host_empty)
    reads = profiler._memory_points("cpu", [1, 2], lambda: None, 3, copy=False)
    assert [n for n, _ in reads] == [2**20, 2**21] and all(t > 0 for _, t in reads)
    assert [(sh, dt) for sh, dt, _ in made] == [((2**18,), torch.float32), ((2**19,), torch.float32)]
    made.clear()
    copies = profiler._memory_points("cpu", [1], lambda: None, 3, copy=True)
    assert len(copies) == 1 and len(made) == 2 and made[0][2] != made[1][2]  # source and destination


# ---- the quick profiler on this machine -------------------------------------------------------

@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> HardwareProfile:
    return profile_machine(quick=True, disk_dir=tmp_path_factory.mktemp("disk"), cuda=False)


def test_quick_profile_structure(measured):
    p = measured
    for key in ("gemm/cpu/fp32", "gemv/cpu/fp32", "attn/cpu/fp32", "memory/bandwidth/cpu", "memory/copy/cpu",
                "disk/read_cold", "disk/read_cold_parallel", "disk/write"):
        assert key in p.models, key
    for dtype in ("bf16", "int8", "int4"):  # present, or skipped with a reason
        assert f"gemm/cpu/{dtype}" in p.models or f"gemm/cpu/{dtype}" in p.meta["skipped"]
    assert "gemm_pack/cpu/fp32" in p.models  # the weight term beside the multiply-adds' line (fit_gemm)
    if kernels.available():  # the native kernels' own keys: int4 experts on int8 x, int8 per group of 32
        assert "gemv/cpu/int4q8" in p.models and "gemv/cpu/int8-g32" in p.models
        if p.meta.get("llc_bytes"):  # the native step's attention from DRAM, a bf16 cache cheaper a position
            assert "attn_decode/cpu/bf16" in p.models and "attn_decode/cpu/fp32" in p.models
            bf16, fp32 = (p.meta["points"][f"attn_decode/cpu/{k}"] for k in ("bf16", "fp32"))
            assert [n for n, _ in fp32] == [2 * n for n, _ in bf16]  # the same positions, twice the bytes
            int8 = p.meta["points"]["attn_decode/cpu/int8"]  # an int8 cache: 64 values and two 4-byte scales a row
            assert [n * 128 for n, _ in int8] == [72 * n for n, _ in bf16]
        assert op_time.find(p, "gemv", "cpu", "int8-g32") is p.models["gemv/cpu/int8-g32"]
        # the native step's int4 layers at real widths, per byte through the origin (profiler 32)
        assert p.models["runtime/decode_layer/int4"].alpha == 0.0 < p.models["runtime/decode_layer/int4"].beta
        from tiered.hardware.profiler import KQUANT_LAYER_SHAPES, _layer_elements
        from tiered.memory.sizes import bytes_per_element
        for kind in ("q6k", "q5k", "iq4xs"):  # ... and with a GGUF file's k-quant copies as stored (profiler 69)
            key = f"runtime/decode_layer/{kind}"
            assert p.models[key].alpha == 0.0 < p.models[key].beta
            assert [n for n, _ in p.meta["points"][key]] == [
                _layer_elements(s) * bytes_per_element(kind) for s in KQUANT_LAYER_SHAPES]
        assert "runtime/burst_token" in p.models  # a decode burst's token (profiler 33)
        for kind in ("int8-g32", "q6k", "q5k", "iq4xs"):  # a GGUF file's expert kinds' rows in layer calls (70)
            assert [n for n, _ in p.meta["points"][f"expert_rows/cpu/{kind}q8"]] == [r * 3 * 2048 * 1024 for r in (2, 4, 8)]
        # a one-copy int4 weight's dequantization per element, through the origin; gemm/cpu/int4 net of it (40)
        assert p.models["dequantize/cpu/int4"].alpha == 0.0 < p.models["dequantize/cpu/int4"].beta
        for kv in ("bf16", "fp32", "int8"):  # the native step's attention over a prompt as its rows, through the origin
            from tiered.hardware.profiler import ATTN_ROWS_TOKENS
            assert [n for n, _ in p.meta["points"][f"attn_rows/cpu/{kv}"]] == [
                2 * 12 * 64 * T * (T + 1) / 2 for T in ATTN_ROWS_TOKENS]
            assert p.models[f"attn_rows/cpu/{kv}"].alpha == 0.0 < p.models[f"attn_rows/cpu/{kv}"].beta
        from tiered.hardware.profiler import DECODE_LAYER_SHAPES, STEP_ROWS_TOKENS
        D, F_ = DECODE_LAYER_SHAPES[0][:2]  # the step's layer code at prompt rows beyond their kernel calls
        assert [n for n, _ in p.meta["points"]["runtime/step_rows/int4"]] == [T * (D + F_) for T in STEP_ROWS_TOKENS]
        assert p.models["runtime/step_rows/int4"].alpha == 0.0
    assert "runtime/engine_token" in p.models
    for dtype in ("fp32", "bf16"):  # a prompt's model code beyond its GEMMs and attention, per layer
        from tiered.hardware.profiler import PREFILL_CODE_SHAPES, PREFILL_CODE_TOKENS
        assert [n for n, _ in p.meta["points"][f"runtime/prefill_code/{dtype}"]] == [
            T * (d + f) for d, f in PREFILL_CODE_SHAPES for T in PREFILL_CODE_TOKENS]
    for key, m in p.models.items():
        assert m.alpha >= 0 and m.beta >= 0, key
        if key.startswith("launch/") or key == "runtime/task":  # constants: alpha only, no fit
            assert m.alpha > 0 and m.r2 is None
        elif key in ("runtime/engine_token", "runtime/burst_token"):  # a token's loop: a constant, 0 at the least
            assert m.beta == 0.0 and m.r2 is None
        elif key == "runtime/decode_ws/int4":  # seconds a byte by working set: the cold set's rate (profiler 47)
            points = p.meta["points"][key]
            assert m.alpha == 0.0 and m.r2 is None and m.beta == points[-1][1] > 0, key
            assert len(points) >= 2 and [n for n, _ in points] == sorted(n for n, _ in points), key
        elif key.startswith(("gemm_pack/", "gemm_amx_pack/")):
            # a GEMM call's weight bytes, fitted with its key's points (profiler 41; the AMX GEMM's: profiler 55)
            line_key = key.replace("_pack/", "/", 1)
            assert m.alpha == 0.0 and m.r2 == p.models[line_key].r2 and len(p.meta["points"][line_key]) >= 4
            if key.startswith("gemm_amx_pack/"):  # at each of AMX_FIT_ROWS rows, for the pack term to separate
                from tiered.hardware.profiler import AMX_FIT_ROWS
                assert len(p.meta["points"][line_key]) % len(AMX_FIT_ROWS) == 0
        elif key == "gemm_amx_floor/cpu/int4":  # one of gemm_amx/cpu/int4's points, a byte (profiler 56)
            (nbytes, t), = p.meta["points"][key]
            assert m.alpha == 0.0 and m.r2 is None and m.beta == t / nbytes > 0
            assert t in [pt for _, pt in p.meta["points"]["gemm_amx/cpu/int4"]]
        elif key == "runtime/step_rows/int4" or key.startswith(("attn_rows/", "runtime/batch_rows/")):
            # a difference of two timings, 0 where it is within their noise (2 Zen 3 cores, 2026-12-01: step_rows 0,
            # 0.40 ms and 0 a layer at 64 / 128 / 256 rows; batch_rows 0 at 4 rows against 1 in CI, 2026-12-03)
            points = p.meta["points"][key]
            assert len(points) >= len(STEP_ROWS_TOKENS) and all(t >= 0 for _, t in points), key
        else:  # noisy machines may flatten a slope to 0, but every predicted time is positive
            assert isinstance(m.r2, float) and m.r2 <= 1.0, key
            points = p.meta["points"][key]
            assert len(points) >= 3 and all(m(n) > 0 and t > 0 for n, t in points), key
    assert p.gpu_memory is None and p.cpu_memory > 0 and p.meta["disk_memory"] > 0
    for field in ("cpu", "threads", "torch", "disk_note"):
        assert p.meta[field] not in (None, "")
    assert p.meta["torch"] == torch.__version__
    if kernels.available():  # step_rows net of the AMX GEMM where the step runs it (profiler 57)
        from tiered.quant.int4 import amx_kernels
        assert p.meta["step_rows_amx"] == (amx_kernels() is not None)
    assert p.source.startswith("measured on")
    # how much of the cores other processes took meanwhile (hardware/contention.record; Linux's /proc/stat)
    assert p.meta["attempts"] == 1 and isinstance(p.meta["contended"], bool)
    assert p.meta["others_share"] is None or 0.0 <= p.meta["others_share"] <= 1.05
    assert p.meta["contended"] == (p.meta["others_share"] is not None
                                   and p.meta["others_share"] > contention.CONTENDED_SHARE)


def test_quick_profile_round_trips_json(measured, tmp_path):
    measured.save(tmp_path / "hw.json")
    again = HardwareProfile.load(tmp_path / "hw.json")
    assert again.models == measured.models and again.meta == json.loads(json.dumps(measured.meta))
    # and it prices the engine's kernels
    assert op_time.gemm_time(again, "cpu", "fp32", 1e9, 4e6) > 0


# ---- presets ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_load_and_round_trip(name, tmp_path):
    p = get_preset(name)
    assert p.name == name and p.gpu_memory > 0 and p.source.startswith("preset from")
    assert set(p.meta["key_sources"]) == set(p.models)
    assert p.has("copy/h2d_pinned") and any(k.startswith("gemm/gpu/") for k in p.models)
    assert any(k.startswith("gemm/cpu/") for k in p.models)
    p.save(tmp_path / "p.json")
    assert HardwareProfile.load(tmp_path / "p.json") == p
    assert HardwareProfile.from_dict(json.loads(p.to_json())) == p


def test_scheinfer_table_one_numbers_as_reported():
    a, c = get_preset("scheinfer-a"), get_preset("scheinfer-c")
    assert a.models["gemm/gpu/fp16"] == LinearModel(1.0e-7, 3.2e-12, 0.997)
    assert a.models["gemm/cpu/int4"] == LinearModel(1.1e-5, 5.4e-12, 0.998)
    assert a.models["launch/gpu"].alpha == 4.4e-5 and a.meta["launch_sigma"] == 3.4e-6
    assert c.models["copy/h2d_pinned"] == LinearModel(3.7e-6, 4.1e-11, 0.999)
    assert get_preset("scheinfer-b").models["gemm/gpu/int4"] == LinearModel(4.6e-6, 6.5e-13, 0.996)


def test_flexgen_t4_preset_figures():
    t4 = get_preset("t4-pcie3")
    assert t4.gpu_memory == 16 * 2**30 and t4.cpu_memory == 208 * 2**30 and t4.meta["disk_memory"] == 1.5e12
    assert 1 / t4.models["disk/read_cold"].beta == pytest.approx(1.6e9)
    assert 2 / t4.models["gemm/gpu/fp16"].beta == pytest.approx(21.24e12)
    with pytest.raises(ConfigError, match="t4-pcie3"):
        get_preset("t4")


# ---- op_time -------------------------------------------------------------------------------------

def test_gemm_time_is_the_roofline_of_compute_and_weight_streaming():
    p = HardwareProfile("x", "test", {"gemm/gpu/fp16": LinearModel(1e-5, 1e-12), "gemv/gpu/fp16": LinearModel(0, 1e-9)})
    assert op_time.gemm_time(p, "gpu", "fp16", 1e6, 1e6) == pytest.approx(1e-3)  # memory-bound
    assert op_time.gemm_time(p, "gpu", "fp16", 1e10, 1e6) == pytest.approx(1e-5 + 1e-2)  # compute-bound
    assert op_time.gemm_time(p, "gpu", "bf16", 1e10) == pytest.approx(1e-5 + 1e-2)  # bf16 falls back to fp16
    with pytest.raises(ConfigError, match="gemm/cpu/int4"):
        op_time.gemm_time(p, "cpu", "int4", 1.0)
    assert op_time.bytes_per_element("int4", 64) == pytest.approx(4.5 / 8)


# ---- Fiddler ------------------------------------------------------------------------------------

def brute_force_threshold(lat: ExpertLatency, s_max: int = 4096) -> int:
    """The largest s such that the CPU wins for every s' in 1..s (0 if it never does)."""
    s = 0
    while s < s_max and lat.cpu_lat(s + 1) <= lat.gpu_lat(s + 1) + lat.transfer_lat():
        s += 1
    return s


@pytest.mark.parametrize("name", list(PRESETS))
def test_fiddler_threshold_matches_brute_force_on_presets(name):
    lat = ExpertLatency(get_preset(name), MIXTRAL_EXPERT, "fp16", "fp16")
    s_star = lat.threshold()
    assert math.floor(s_star) == brute_force_threshold(lat)
    lm = lat.latency_model()
    nbytes = int(lat.transfer_bytes)
    assert lm.cpu_threshold(nbytes) == pytest.approx(s_star)
    for s in range(1, 600):
        assert (choose_path(s, False, nbytes, lm) == CPU) == lat.cpu_wins(s), s


@settings(max_examples=40, deadline=None)
@given(cpu_beta=st.floats(2e-12, 1e-10), gpu_beta=st.floats(1e-15, 1e-12), cpu_bw=st.floats(1e-11, 1e-9),
       gpu_bw=st.floats(1e-13, 1e-11), h2d=st.floats(1e-11, 1e-9), launch=st.floats(0, 1e-4),
       alpha=st.floats(0, 1e-4))
def test_fiddler_threshold_matches_brute_force_on_random_machines(cpu_beta, gpu_beta, cpu_bw, gpu_bw, h2d, launch,
                                                                    alpha):
    assume(gpu_bw / gpu_beta >= cpu_bw / cpu_beta)  # the GPU's ridge point is the higher one, as on real machines
    hw = HardwareProfile("r", "test", {
        "gemm/cpu/bf16": LinearModel(alpha, cpu_beta), "gemv/cpu/bf16": LinearModel(0, cpu_bw),
        "gemm/gpu/bf16": LinearModel(alpha, gpu_beta), "gemv/gpu/bf16": LinearModel(0, gpu_bw),
        "copy/h2d_pinned": LinearModel(1e-5, h2d), "launch/gpu": LinearModel(launch, 0)})
    lat = ExpertLatency(hw, ExpertShape(1024, 2816))
    # threshold()'s stated assumption: the CPU wins on a prefix of token counts. Start-up costs
    # (alpha, launch) can break it even with the GPU's ridge point higher (the CPU then wins only
    # on a middle interval), so such machines are left out.
    wins = [lat.cpu_wins(s) for s in range(1, 2049)]
    assume(False not in wins or True not in wins[wins.index(False):])
    s_star, brute = lat.threshold(2048), brute_force_threshold(lat, 2048)
    if math.isinf(s_star):
        assert brute == 2048
    else:
        assert math.floor(s_star) == brute or (s_star == brute)
    lm = lat.latency_model(2048)
    for s in (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 1597):
        assert (choose_path(s, False, int(lat.transfer_bytes), lm) == CPU) == lat.cpu_wins(s), s


def test_fiddler_affine_case_is_the_closed_form():
    hw = HardwareProfile("affine", "test", {"gemm/cpu/bf16": LinearModel(0, 2e-11), "gemm/gpu/bf16": LinearModel(0, 0),
                                            "copy/h2d_pinned": LinearModel(0, 4e-11)})
    lat = ExpertLatency(hw, MIXTRAL_EXPERT)
    c_cpu = 2e-11 * MIXTRAL_EXPERT.macs_per_token
    assert lat.threshold() == pytest.approx(lat.transfer_lat() / c_cpu)  # s* = L_xfer / c_cpu (Fiddler 2.b)


def test_fiddler_without_gpu_always_runs_on_cpu():
    hw = HardwareProfile("cpu", "test", {"gemm/cpu/bf16": LinearModel(1e-5, 1e-11),
                                         "disk/read_cold": LinearModel(1e-4, 1e-9)})
    lat = ExpertLatency(hw, MIXTRAL_EXPERT)
    assert lat.threshold() == math.inf
    lm = lat.latency_model()
    assert lm.h2d_bandwidth == math.inf and lm.disk_bandwidth == pytest.approx(1e9)


def test_dispatch_latency_from_config():
    from tiered.checkpoint.model_config import ModelConfig

    cfg = ModelConfig(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336)
    hw = get_preset("rtx4090-pcie4")
    lm = dispatch_latency(hw, cfg)
    lat = ExpertLatency(hw, MIXTRAL_EXPERT, "bf16", "bf16")
    assert lm.cpu_threshold(int(lat.transfer_bytes)) == pytest.approx(lat.threshold())
    assert lm.cpu_lat(1) == pytest.approx(3e-3)  # HOBBIT: Fiddler runs one Mixtral expert in ~3 ms


# ---- CLI core -------------------------------------------------------------------------------------

def test_profile_command_lists_presets_and_writes(monkeypatch, tmp_path, capsys):
    import tiered.hardware.profiler as profiler
    from tiered import profile_cli

    assert profile_cli.profile_command(True, tmp_path / "x.json", preset_list=True) == tmp_path / "x.json"
    out = capsys.readouterr().out
    assert all(name in out for name in PRESETS) and not (tmp_path / "x.json").exists()
    monkeypatch.setattr(profiler, "profile_machine", lambda **kw: get_preset("t4-pcie3"))
    path = profile_cli.profile_command(True, tmp_path / "hw.json", preset_list=False)
    assert HardwareProfile.load(path) == get_preset("t4-pcie3")
    out = capsys.readouterr().out
    assert "gemm/gpu/fp16" in out and "GFLOP/s" in out and "wrote" in out
    # a profile other processes disturbed (hardware/contention) is measured again, RETRIES times at most
    from tiered.hardware import contention

    calls = []

    def contended(**kw):
        calls.append(kw["previous"])
        prev = kw["previous"].meta["attempts"] if kw["previous"] is not None else 0
        hw = get_preset("t4-pcie3")
        return HardwareProfile(hw.name, hw.source, hw.models, hw.gpu_memory, hw.cpu_memory,
                               meta={"others_share": 0.6, "contended": True, "attempts": prev + 1})
    monkeypatch.setattr(profiler, "profile_machine", contended)
    said = []
    profile, _ = profile_cli.run_profile(True, tmp_path / "busy.json", progress=said.append)
    assert len(calls) == contention.RETRIES and calls[0] is None and calls[1].meta["attempts"] == 1
    assert profile.meta["attempts"] == contention.RETRIES and HardwareProfile.load(tmp_path / "busy.json") == profile
    assert sum("took 60% of the cores while profiling: measuring again" in s for s in said) == contention.RETRIES - 1


def test_the_profile_table_gives_rates_where_n_is_bytes_or_macs_and_the_host_share():
    """format_profile: a GB/s or GFLOP/s rate only where n is bytes or multiply-adds (runtime/* keys are
    seconds a layer), and a CUDA profile's host share."""
    from tiered.profile_cli import format_profile

    hw = HardwareProfile("box", "test", {"runtime/moe_cpu_layer_gpu/bf16": LinearModel(3e-4, 1.2e-3, 0.99),
                                         "expert_dram/cpu/bf16": LinearModel(0.0, 1 / 90e9, 0.99),
                                         "expert_rows/cpu/bf16": LinearModel(2e-4, 1e-11, 0.9)},
                         meta={"host_share": {"cpu": 1.13, "h2d": 1.11, "cpu_GBps": [82.8, 73.4], "h2d_GBps": [52.7, 47.5]}})
    rows = {line.split()[0]: line for line in format_profile(hw).splitlines()[2:]}
    assert "GB/s" not in rows["runtime/moe_cpu_layer_gpu/bf16"] and "90.00 GB/s" in rows["expert_dram/cpu/bf16"]
    assert "GFLOP/s" in rows["expert_rows/cpu/bf16"]
    assert "host share: CPU experts 82.8 -> 73.4 GB/s (x1.13), H2D 52.7 -> 47.5 GB/s (x1.11)" in format_profile(hw)


# ---- the memory's speed at planning -----------------------------------------------------------

def test_scaling_the_cpu_bandwidth_moves_only_bandwidth_bound_cpu_terms():
    """A profile without DRAM floors (no last-level cache size, a preset) moves every bandwidth-bound
    CPU key."""
    from tiered.hardware.profile import scale_cpu_bandwidth

    hw = HardwareProfile("box", "test", {k: LinearModel(1e-6, 2e-11, 0.9) for k in (
        "gemv/cpu/bf16", "attn/cpu/fp32", "memory/bandwidth/cpu", "memory/copy/cpu", "gemm/cpu/bf16", "gemv/gpu/bf16", "runtime/decode_step/bf16", "copy/h2d_pinned")})
    slow = scale_cpu_bandwidth(hw, 1.5, "why")
    for key, m in slow.models.items():
        moved = key.split("/")[1] == "cpu" and not key.startswith(("gemm/", "runtime/")) or key.endswith("/cpu")
        assert m.alpha == 1e-6 and m.beta == pytest.approx(2e-11 * (1.5 if moved else 1.0)), key
    assert slow.meta["cpu_bandwidth_ratio"] == 1.5 and slow.meta["notes"] == ["why"] and "notes" not in hw.meta
    with pytest.raises(ValueError):
        scale_cpu_bandwidth(hw, 0.0)


def test_the_bandwidth_check_reads_beyond_the_cache_against_the_profile():
    from tiered.hardware.profiler import cpu_bandwidth_ratio

    hw = HardwareProfile("box", "test", {"memory/bandwidth/cpu": LinearModel(0.0, 1 / 20e9, None)},
                         meta={"llc_bytes": 32 * 2**20})
    ratio, now = cpu_bandwidth_ratio(hw, seconds=0.01)
    assert ratio > 0 and now > 1e8 and ratio == pytest.approx(20e9 / now)
    assert cpu_bandwidth_ratio(HardwareProfile("box", "test", {})) is None


def test_where_the_decode_kernel_was_timed_from_dram_the_check_times_it_again(monkeypatch):
    """With gemv_dram/cpu/bf16 in the profile (tiered/kernels built) the check times the bf16 decode kernel
    the way the profile did (a 4096 x 4096 weight cycled over 3 x the cache), not torch's sum(): on the
    2-core EPYC the two swung 1.1-1.9x apart from minute to minute, and SmolLM2's native step follows
    the kernel."""
    from tiered import kernels
    from tiered.hardware import profiler

    calls = []

    def points(device, dtype, shapes, sync, repeats, by_bytes, cold_bytes=None):
        calls.append((device, dtype, shapes, by_bytes, cold_bytes))
        return [(32 * 2**20, 2e-3)]
    monkeypatch.setattr(profiler, "_gemm_points", points)
    monkeypatch.setattr(kernels, "available", lambda: True)
    hw = HardwareProfile("box", "test", {"gemv_dram/cpu/bf16": LinearModel(0.0, 1 / 32e9, None),
                                         "memory/bandwidth_dram/cpu": LinearModel(0.0, 1 / 20e9, None)},
                         meta={"llc_bytes": 32 * 2**20})
    ratio, now = profiler.cpu_bandwidth_ratio(hw)
    assert calls == [("cpu", "bf16", [(1, 4096, 4096)], True, 3 * 32 * 2**20)]
    assert ratio == pytest.approx(2e-3 / (32 * 2**20 / 32e9)) and now == pytest.approx(32 * 2**20 / 2e-3)


def test_a_gemv_key_cycles_over_cold_weight_bytes_however_many_copies_it_takes(monkeypatch):
    """The CPU GEMV keys' small weights are timed over copies that fill COLD_WEIGHT_BYTES: stopped at 32
    copies, a 512 x 512 int4 weight's 5 MiB sat in a 32 MiB cache and the fit priced SmolLM2's cold int4
    matrices 1.35-2x fast."""
    from tiered.hardware import profiler

    made = []
    monkeypatch.setattr(profiler, "_native_gemv_format", lambda *a: False)
    real = profiler._linear_kernel

    def kernel(device, dtype, w, gemv=False):
        made.append(w.shape)
        return real(device, dtype, w, gemv)
    monkeypatch.setattr(profiler, "_linear_kernel", kernel)
    weight = 64 * 32 * 4  # bytes of one fp32 [64, 32] weight
    monkeypatch.setattr(profiler, "COLD_WEIGHT_BYTES", 100 * weight)
    (n, t), = profiler._gemm_points("cpu", "fp32", [(1, 32, 64)], lambda: None, 3, True)
    assert n == weight and t > 0 and len(made) == 100


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8", "int4"])
def test_each_copy_of_a_timed_gemv_has_memory_of_its_own(dtype):
    """A cycled GEMV's copies must not share the weight's memory: fp32's had (nn.Linear over w itself,
    and F.linear over w.to(cpu, float32), which is w), so gemv/cpu/fp32 was timed in the cache at
    147-163 GB/s on a machine whose DRAM reads 40-80."""
    from tiered.hardware import profiler

    w = torch.randn(64, 32)
    ptrs = {w.untyped_storage().data_ptr()}
    for _ in range(2):
        module, _ = profiler._native_gemv_module(dtype, w)
        ptrs |= {t.untyped_storage().data_ptr() for t in list(module.parameters()) + list(module.buffers())
                 + [v for v in vars(module).values() if isinstance(v, torch.Tensor)]}
    assert len(ptrs) >= 3
    if dtype == "fp32":  # torch's GEMV (no native kernels): its weight is a copy too
        fn, _, _ = profiler._linear_kernel("cpu", dtype, w)
        (wd,) = [c.cell_contents for c in fn.__closure__ if isinstance(c.cell_contents, torch.Tensor)]
        assert wd.data_ptr() != w.data_ptr() and torch.equal(wd, w)


@pytest.mark.parametrize("kind", ["q6k", "q5k", "iq4xs"])
def test_k_quant_gemv_keys_time_the_copies_as_stored(kind):
    """gemv/cpu/<kind> and decode_rows/cpu/<kind>q8 (profiler 67) time quant/kquant's copies as the native step calls
    them: a weight of the shape asked for in the kind's layout (random blocks: the speed does not depend on the
    values) at its bytes a weight, through the kernel the step runs (on int8 rows for the q8 key)."""
    from tiered import kernels
    from tiered.hardware import profiler
    from tiered.quant.kquant import LINEAR_OF_KIND, bytes_per_weight

    if not kernels.available():
        pytest.skip("needs tiered/kernels")
    w = torch.randn(64, 512)
    module, bpe = profiler._native_gemv_module(kind, w)
    assert isinstance(module, LINEAR_OF_KIND[kind]) and (module.out_features, module.in_features) == (64, 512)
    assert bpe == bytes_per_weight(kind) and profiler._native_gemv_format("cpu", kind, True)
    fn, dt, b = profiler._linear_kernel("cpu", kind, w, gemv=True)
    x = torch.randn(1, 512)
    assert b == bpe and torch.allclose(fn(x.to(dt)), x @ module.dequantize().T, rtol=1e-3, atol=1e-4)
    # decode_rows/cpu/<kind>q8: the same copy's batched calls on int8 activations (Plan.batch_act "q8")
    rows, bpe8 = profiler._native_gemv_module(kind + "q8", w)
    assert rows.batch_act == "q8" and module.batch_act == "bf16" and bpe8 == bpe
    assert profiler._native_gemv_format("cpu", kind + "q8", True)


@pytest.mark.parametrize("kind", ["q6k", "q5k", "iq4xs"])
def test_k_quant_decode_layers_run_the_copies_as_stored(kind):
    """runtime/decode_layer/<kind> (profiler 69) times the native step over dense layers whose every projection holds
    quant/kquant's copy as a GGUF file's "auto" makes it (random blocks of the kind's format; q/k/v and gate/up fused),
    one copy each: the step's result is the torch step's over those copies' weights, and the points are (a layer's
    bytes in the kind, seconds)."""
    from tiered import kernels
    from tiered.hardware import profiler
    from tiered.memory.sizes import bytes_per_element
    from tiered.models.layers import KVCache
    from tiered.quant.kquant import LINEAR_OF_KIND
    from tiered.quant.linear import PhaseLinear
    from tiered.runtime.cpu_decode import CPUDecodeStep

    if not kernels.available():
        pytest.skip("needs tiered/kernels")
    shape = (256, 512, 4, 2)  # every width a multiple of 256
    cfg = profiler._dense_config(shape, 2)
    model, step = profiler._dense_decode_step(cfg, 8, distinct=1, fmt=kind)
    decode = [m.decode for m in model.model.layers.modules() if isinstance(m, PhaseLinear)]
    assert len(decode) == 2 * 7 and all(m.weight is None for m in model.modules() if isinstance(m, PhaseLinear))
    copies = {id(getattr(d, "shared", d)) for d in decode}  # q/k/v and gate/up one copy each: 4 a layer
    assert len(copies) == 2 * 4
    assert all(isinstance(getattr(getattr(d, "shared", None), "fused", d), LINEAR_OF_KIND[kind]) for d in decode)
    assert step.native is not None  # the layers run in the native step
    x = (torch.tensor([[5]]), torch.tensor([[3]]), torch.tensor([0]))
    with torch.inference_mode():
        native = step(*x, KVCache(cfg, 1, 8, torch.bfloat16)).float()
        plain = CPUDecodeStep(model, native=False)(*x, KVCache(cfg, 1, 8, torch.bfloat16)).float()
    torch.testing.assert_close(native, plain, rtol=0.05, atol=0.05 * plain.abs().max().item())
    pts = profiler._decode_layer_points(1, (shape,), cold_bytes=1 << 20, fmt=kind)
    assert len(pts) == 1 and pts[0][0] == profiler._layer_elements(shape) * bytes_per_element(kind) and pts[0][1] > 0
    assert all(s[0] % 256 == 0 and s[1] % 256 == 0 for s in profiler.KQUANT_LAYER_SHAPES)


def _spy_linear_kernels(monkeypatch) -> tuple[list, list]:
    """profiler._linear_kernel wrapped: (made: each kernel's `gemv` flag, in order; seen: (kernel index,
    rows) of every call)."""
    from tiered.hardware import profiler

    made, seen = [], []
    real = profiler._linear_kernel

    def kernel(device, dtype, w, gemv=False):
        fn, xdtype, bpe = real(device, dtype, w, gemv)
        made.append(gemv)

        def call(x, fn=fn, i=len(made) - 1):
            seen.append((i, x.shape[0]))
            return fn(x)
        return call, xdtype, bpe
    monkeypatch.setattr(profiler, "_linear_kernel", kernel)
    return made, seen


def test_a_cpu_keys_shapes_are_timed_interleaved(monkeypatch):
    """_gemm_points times a CPU key's shapes in turn, repeat after repeat (median_times), not one shape's
    samples and then the next's: on a VM whose memory bandwidth drifts, shapes timed one after the other
    moved the quick int4 fit's intercept 0.38-6 us. Each shape keeps its own weight size."""
    from tiered.hardware import profiler

    monkeypatch.setattr(profiler, "_native_gemv_format", lambda *a: False)
    made, seen = _spy_linear_kernels(monkeypatch)
    monkeypatch.setattr(profiler, "COLD_WEIGHT_BYTES", 1)  # one copy each: kernel index = shape
    points = profiler._gemm_points("cpu", "fp32", [(1, 32, 64), (1, 64, 64), (1, 64, 128)], lambda: None, 3, True)
    assert [n for n, _ in points] == [32 * 64 * 4, 64 * 64 * 4, 64 * 128 * 4] and all(t > 0 for _, t in points)
    order = [i for i, _ in seen]
    switches = sum(a != b for a, b in zip(order, order[1:]))
    assert set(order) == {0, 1, 2} and switches >= 3 * 3 - 1  # warm-ups, then every repeat visits each shape


def test_a_prompts_gemms_on_big_weights_are_timed_cold(monkeypatch):
    """gemm_big's GEMMs (cold_bytes) cycle over as many weight copies as fill that many bytes, as a prompt
    meets each of a model's FFN matrices once: one matrix timed again and again sat in the H100 host's
    300 MiB last-level cache. Without cold_bytes a GEMM times its one weight."""
    from tiered.hardware import profiler

    made, seen = _spy_linear_kernels(monkeypatch)
    weight = 64 * 32 * 4  # bytes of one fp32 [64, 32] weight
    (n, t), = profiler._gemm_points("cpu", "fp32", [(8, 32, 64)], lambda: None, 6, False, cold_bytes=5 * weight)
    assert n == 8 * 32 * 64 and t > 0
    assert sorted({i for i, _ in seen}) == [0, 1, 2, 3, 4]  # five copies, each called in turn
    seen.clear()
    profiler._gemm_points("cpu", "fp32", [(8, 32, 64)], lambda: None, 6, False)
    assert len({i for i, _ in seen}) == 1 and len(made) == 6


def test_a_plan_follows_the_memory_speed_of_its_moment(monkeypatch):
    """bandwidth_now scales the machine's cached profile when the memory reads slower or faster than
    the profile says (beyond 15%), and the CPU plan's predicted decode follows; a small difference,
    TIERED_BANDWIDTH_CHECK=0 and a profile already checked are left as they are."""
    from tiered.hardware import profiler
    from tiered.planner import auto
    from tiered.planner.make import make_plan
    from test_plan import LLAMA70B

    monkeypatch.setattr(auto.contention, "others_share", lambda *a: 0.0)  # a quiet machine (a busy one: below)
    hw = get_preset("scheinfer-a")
    ratio = {"value": 1.6}
    monkeypatch.setattr(profiler, "cpu_bandwidth_ratio", lambda p: (ratio["value"], 10e9))
    slow = auto.bandwidth_now(hw)
    assert slow.meta["cpu_bandwidth_ratio"] == 1.6 and auto.bandwidth_now(slow) is slow
    cpu_only = lambda p: make_plan(LLAMA70B, replace(p, gpu_memory=None), precision="int4",  # noqa: E731
                                   cpu_memory=10**12).predicted_decode_tokens_per_s
    assert cpu_only(slow) < 0.8 * cpu_only(hw)
    ratio["value"] = 1.1
    assert auto.bandwidth_now(hw) is hw
    ratio["value"] = 1.6
    monkeypatch.setenv("TIERED_BANDWIDTH_CHECK", "0")
    assert auto.bandwidth_now(hw) is hw


def test_a_memory_speed_read_while_other_processes_took_the_cores_is_not_applied(monkeypatch):
    """bandwidth_now's readings time the neighbours as much as the memory when other processes take more
    than CONTENDED_SHARE of the cores meanwhile (a 2-core EPYC at the end of a CI run scaled a profile
    20x slow): the profile's speeds stand, with a note; a quiet machine's readings are applied."""
    from tiered.hardware import profiler
    from tiered.planner import auto

    hw = get_preset("scheinfer-a")
    monkeypatch.setattr(profiler, "cpu_bandwidth_ratio", lambda p: (20.0, 1e9))
    monkeypatch.setattr(auto.contention, "others_share", lambda *a: 0.6)
    got = auto.bandwidth_now(hw)
    assert got.models == hw.models and "cpu_bandwidth_ratio" not in got.meta
    assert "not applied: other processes took 60% of the cores" in got.meta["notes"][-1]
    monkeypatch.setattr(auto.contention, "others_share", lambda *a: 0.1)
    assert auto.bandwidth_now(hw).meta["cpu_bandwidth_ratio"] == 20.0
    monkeypatch.setattr(auto.contention, "others_share", lambda *a: None)  # no /proc/stat: applied
    assert auto.bandwidth_now(hw).meta["cpu_bandwidth_ratio"] == 20.0


def test_the_bandwidth_check_scales_only_on_two_readings_that_agree(monkeypatch):
    """Two readings on the same side beyond 15%: scaled by the one nearer the profile; readings either
    side of it, or one within 15%, leave the profile as it is (the 2-core EPYC's read flapped between
    ~45 and ~80 GB/s from one minute to the next)."""
    from tiered.hardware import profiler
    from tiered.planner import auto

    monkeypatch.setattr(auto.contention, "others_share", lambda *a: 0.0)  # a quiet machine (a busy one: below)
    hw = get_preset("scheinfer-a")
    monkeypatch.setattr(auto, "SWING_PAUSE_S", 0.0)
    # beyond 3x either way, a third reading must agree too (a stall of a second is not the memory's speed)
    for seen, want in (([1.6, 1.3], 1.3), ([0.5, 0.7], 0.7), ([0.5, 1.4], None), ([1.6, 1.05], None),
                       ([1.05, 1.6], None), ([14.0, 13.0, 1.0], None), ([14.0, 13.0, 5.0], 5.0),
                       ([0.2, 0.25, 0.3], 0.3), ([0.2, 0.25, 2.0], None)):
        readings = iter(seen)
        monkeypatch.setattr(profiler, "cpu_bandwidth_ratio", lambda p: (next(readings), 10e9))
        got = auto.bandwidth_now(hw)
        assert (got is hw) if want is None else got.meta["cpu_bandwidth_ratio"] == want, seen


def test_a_faster_memory_moves_only_the_dram_floors_a_slower_one_every_key():
    """With DRAM-floor keys (gemv_dram, bandwidth_dram, attn_decode), a faster memory moves only them: a
    read beyond the cache costs max(kernel rate, floor), so each kernel keeps its measured rate. A
    slower memory moves every bandwidth-bound key, and the read's price with it."""
    from tiered.hardware.profile import BANDWIDTH_BOUND_CPU, DRAM_BOUND_CPU, scale_cpu_bandwidth

    keys = ("gemv/cpu/int4", "gemv_dram/cpu/bf16", "expert_dram/cpu/bf16", "attn/cpu/fp32", "attn_decode/cpu/bf16",
            "memory/bandwidth/cpu", "memory/bandwidth_dram/cpu", "memory/copy/cpu", "gemm/cpu/bf16")
    hw = HardwareProfile("box", "test", {k: LinearModel(1e-6, 2e-11, 0.9) for k in keys},
                         meta={"llc_bytes": 32 * 2**20})
    for ratio, moved in ((0.5, DRAM_BOUND_CPU), (2.0, BANDWIDTH_BOUND_CPU)):
        scaled = scale_cpu_bandwidth(hw, ratio)
        for key, m in scaled.models.items():
            assert m.alpha == 1e-6 and m.beta == pytest.approx(2e-11 * (ratio if key.startswith(moved) else 1.0)), key
    step = 64 * 2**20  # a decode step's int4 weights, twice the cache
    then = op_time.memory_time(hw, "cpu", "int4", 2**20, "gemv", step)
    assert op_time.memory_time(scale_cpu_bandwidth(hw, 0.5), "cpu", "int4", 2**20, "gemv", step) == pytest.approx(then)
    assert op_time.memory_time(scale_cpu_bandwidth(hw, 2.0), "cpu", "int4", 2**20, "gemv", step) > 1.9 * then


def test_bandwidth_keys_price_bytes_at_their_rate_alone():
    """A memory read's time is its bytes at the fitted rate: the profiler fits memory/* keys through the
    origin, and op_time ignores an intercept an older profile's bandwidth fit carries (a 0.46 ms one
    priced every small read of SmolLM2's bf16 decode step: 23 ms predicted against 10.5 measured)."""
    from tiered.hardware.profiler import fit_proportional

    m = fit_proportional([1e7, 2e7, 4e7], [1e-3, 2.2e-3, 3.9e-3])
    assert m.alpha == 0.0 and m.beta == pytest.approx(1e-10) and m.r2 > 0.9
    noisy = HardwareProfile("box", "test", {"memory/bandwidth/cpu": LinearModel(4.6e-4, 2e-11, 0.96)})
    assert op_time.memory_time(noisy, "cpu", "bf16", 1e6) == pytest.approx(2e-5)
    assert op_time.attention_time(noisy, "cpu", "fp32", 0.0, 1e6) == 0.0
    with pytest.raises(ValueError):
        fit_proportional([], [])


@pytest.mark.skipif(not kernels.available(), reason="attn_decode times the native decode step")
def test_the_attention_key_times_steps_whose_kv_bytes_outweigh_their_fixed_costs(monkeypatch):
    """attn_decode/cpu/<kv>'s steps read 32-128 MiB of KV each, alternating between two sequences' caches:
    its slope is the attention's, not the step's fixed costs' (a 2-layer model over 0.25-4 MiB a step had
    fitted 1 GB/s with R^2 -133 and priced SmolLM2 at 640 positions 2.5x slow)."""
    from tiered.hardware import profiler
    from tiered.runtime import cpu_decode

    slots = []

    def times(fns, repeats, *a, **k):  # each step run twice: which caches' slots it reads
        for fn in fns:
            for _ in range(2):
                fn()
        return [1e-3 * (i + 1) for i in range(len(fns))]

    real = cpu_decode.CPUDecodeStep.__call__

    def call(self, ids, pos, slot, cache):
        assert self.native_cache(cache)  # the native step's attention, as the engine's
        slots.append((int(slot), int(pos), cache.k.shape))
        return real(self, ids, pos, slot, cache)

    monkeypatch.setattr(profiler, "median_times", times)
    monkeypatch.setattr(cpu_decode.CPUDecodeStep, "__call__", call)
    points = profiler._attn_decode_points("bf16", 1)
    nbytes = [n for n, _ in points]
    assert nbytes[0] >= 32 * 2**20 and nbytes == [nbytes[0], 2 * nbytes[0], 4 * nbytes[0]]
    assert [s for s, _, _ in slots] == [0, 1] * 3  # two sequences' caches in turn
    assert [p for _, p, _ in slots][::2] == list(profiler.ATTN_DECODE_CONTEXTS)
    assert all(shape[1] == profiler.ATTN_DECODE_SLOTS for _, _, shape in slots)


def test_the_native_steps_attention_is_priced_at_its_measured_rate():
    """A CPU decode step's native attention costs its KV bytes at attn_decode/cpu/<kv> where profiled
    (measured ~14 GB/s on 2 Zen 4 cores), never less than the memory's rate, and the memory's rate
    alone without the key: SmolLM2 after 1024 positions with a bf16 cache."""
    from tiered.checkpoint.model_config import ModelConfig
    from tiered.planner.cpu_predict import _attention

    cfg = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    models = {"gemv/cpu/bf16": LinearModel(0.0, 1 / 40e9, 0.99), "memory/bandwidth/cpu": LinearModel(0.0, 1 / 40e9, 0.99)}
    meta = {"native_kernels": True}
    plain = HardwareProfile("box", "test", dict(models), meta=meta)
    slow = HardwareProfile("box", "test", dict(models, **{"attn_decode/cpu/bf16": LinearModel(1e-4, 1 / 14e9, 0.99)}),
                           meta=meta)
    fast = HardwareProfile("box", "test", dict(models, **{"attn_decode/cpu/bf16": LinearModel(0.0, 1 / 80e9, 0.99)}),
                           meta=meta)
    kv = 2 * 3 * 64 * 1024 * 2  # a layer's cached keys and values, bf16
    base = _attention(cfg, plain, "int4", 1024)
    proj = base - kv / 40e9
    assert _attention(cfg, slow, "int4", 1024) == pytest.approx(proj + kv / 14e9)
    assert _attention(cfg, fast, "int4", 1024) == pytest.approx(base)  # never faster than the memory


def test_the_native_steps_latent_attention_is_priced_at_its_reads_and_fp32_multiply_adds():
    """DeepSeek's latent attention in the native step (DecodeStep.set_latent): each cached latent row is
    read once for every head, and each position costs H (2 R + r) multiply-adds in fp32 loops, at the
    fp32 GEMM fit's slope: V2-Lite's 27 layers after 1040 positions priced 24.0 tok/s against 22.6
    measured (2 Zen 4 cores), where torch's attention key (attn/cpu, the module path) had priced 8.3."""
    from tiered.checkpoint.model_config import ModelConfig
    from tiered.planner.cpu_predict import _attention

    cfg = ModelConfig(model_type="deepseek_v2", vocab_size=1000, hidden_size=2048, intermediate_size=4096,
                      num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=1, head_dim=64,
                      kv_lora_rank=512, qk_nope_head_dim=128, v_head_dim=128)
    models = {"gemv/cpu/int4": LinearModel(0.0, 1 / 40e9, 0.99), "memory/bandwidth/cpu": LinearModel(0.0, 1 / 40e9, 0.99),
              "gemm/cpu/fp32": LinearModel(1e-5, 2e-11, 0.99), "attn/cpu/bf16": LinearModel(0.0, 3e-10, 0.99)}
    native = HardwareProfile("box", "test", dict(models), meta={"native_kernels": True})
    proj = _attention(cfg, native, "int4", 0)
    kv = (512 + 64) * 1024 * 2  # one layer's latent rows, bf16
    macs = 1024 * 16 * (2 * 512 + 64)
    assert _attention(cfg, native, "int4", 1024, kv_format="bf16") == pytest.approx(proj + max(kv / 40e9, 2e-11 * macs))
    assert _attention(cfg, native, "int4", 1024, kv_format="bf16", rows=4) == pytest.approx(
        _attention(cfg, native, "int4", 0, rows=4) + 4 * 2e-11 * macs)
    module = HardwareProfile("box", "test", dict(models), meta={})  # no kernels: the module path's attention
    assert _attention(cfg, module, "int4", 1024, kv_format="bf16") == pytest.approx(
        _attention(cfg, module, "int4", 0) + 3e-10 * macs)


def test_a_decode_gemv_beyond_the_cache_streams_at_the_kernels_own_dram_rate():
    """Beyond the last-level cache a GEMV's floor is the slower of plain DRAM reads and the kernel's own
    DRAM rate (gemv_dram/cpu/<dtype>, when profiled): on the H200's host a bf16 expert streamed 81 GB/s
    where plain reads did 98, and the dense plan's CPU slices ran at 65-70 priced at 98."""
    llc = 300 * 2**20
    models = {"gemv/cpu/bf16": LinearModel(0.0, 1 / 221e9, 0.99),  # timed on weights the cache holds
              "memory/bandwidth/cpu": LinearModel(0.0, 1 / 216e9, 0.99),
              "memory/bandwidth_dram/cpu": LinearModel(0.0, 1 / 98e9, 0.99)}
    plain = HardwareProfile("box", "test", dict(models), meta={"llc_bytes": llc})
    kernel = HardwareProfile("box", "test", dict(models, **{"gemv_dram/cpu/bf16": LinearModel(2e-5, 1 / 80e9, 0.99)}),
                             meta={"llc_bytes": llc})
    n = 100e6
    assert op_time.memory_time(plain, "cpu", "bf16", n, working_set=2 * llc) == pytest.approx(n / 98e9)
    assert op_time.memory_time(kernel, "cpu", "bf16", n, working_set=2 * llc) == pytest.approx(n / 80e9)
    assert op_time.memory_time(kernel, "cpu", "bf16", n, working_set=llc / 2) == pytest.approx(n / 216e9)
    assert op_time.dram_floor(kernel, "cpu", 2 * llc) == pytest.approx(1 / 98e9)  # plain reads, no dtype


def test_a_cpu_experts_weights_beyond_the_cache_stream_at_the_expert_kernels_own_rate():
    """An expert's weights beyond the cache are floored by expert_dram/cpu/<dtype> where profiled (the native
    expert kernel on real-width experts: ~90 GB/s on the H100's host where the decode GEMV's 8-32 MiB
    matrices read 69), by gemv_dram's without it; dense projections keep gemv_dram's. A kernel's own rate
    stands even where it beats the plain DRAM reads (torch's sum: another kernel's stream, 21.5 GB/s on 2 Zen 3
    cores where the native expert streamed 26.9); a dtype without its own DRAM key is floored by those reads.
    The CPU side of a Mixtral expert's dispatch latency follows, and so does a CPU-only MoE step's price."""
    from tiered.checkpoint.model_config import ModelConfig
    from tiered.planner.cpu_predict import predict_decode
    from tiered.planner.fiddler import ExpertLatency

    llc = 300 * 2**20
    models = {"gemv/cpu/bf16": LinearModel(2e-5, 1 / 200e9, 0.99), "gemm/cpu/bf16": LinearModel(0.0, 1e-12, 0.99),
              "memory/bandwidth/cpu": LinearModel(0.0, 1 / 150e9, 0.99),
              "memory/bandwidth_dram/cpu": LinearModel(0.0, 1 / 92e9, 0.99),
              "gemv_dram/cpu/bf16": LinearModel(0.0, 1 / 69e9, 0.99)}
    gemv_only = HardwareProfile("box", "test", dict(models), meta={"llc_bytes": llc})
    with_key = HardwareProfile("box", "test", dict(models, **{"expert_dram/cpu/bf16": LinearModel(1e-5, 1 / 90e9, 0.99)}),
                               meta={"llc_bytes": llc})
    faster = HardwareProfile("box", "test", dict(models, **{"expert_dram/cpu/bf16": LinearModel(0.0, 1 / 120e9, 0.9)}),
                               meta={"llc_bytes": llc})
    n, ws = 117e6, 2 * llc
    assert op_time.memory_time(with_key, "cpu", "bf16", n, working_set=ws, expert=True) == pytest.approx(n / 90e9)
    assert op_time.memory_time(with_key, "cpu", "bf16", n, working_set=ws) == pytest.approx(n / 69e9)  # a projection
    assert op_time.memory_time(gemv_only, "cpu", "bf16", n, working_set=ws, expert=True) == pytest.approx(n / 69e9)
    assert op_time.memory_time(faster, "cpu", "bf16", n, working_set=ws, expert=True) == pytest.approx(n / 120e9)
    assert op_time.memory_time(with_key, "cpu", "int4", n, working_set=ws, expert=True) == pytest.approx(n / 92e9)
    lat = {name: ExpertLatency(hw, MIXTRAL_EXPERT, working_set=ws).cpu_lat(1) for name, hw in
           (("gemv", gemv_only), ("expert", with_key))}
    expert_bytes = 3 * 4096 * 14336 * 2
    assert lat["gemv"] == pytest.approx(expert_bytes / 69e9, rel=0.02)
    assert lat["expert"] == pytest.approx(expert_bytes / 90e9, rel=0.02)
    cfg = ModelConfig.from_hf({"model_type": "mixtral", "vocab_size": 1000, "hidden_size": 4096,
                               "intermediate_size": 14336, "num_hidden_layers": 2, "num_attention_heads": 32,
                               "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 8,
                               "num_experts_per_tok": 2})
    steps = {name: predict_decode(cfg, hw, "bf16", 64)[1] for name, hw in (("gemv", gemv_only), ("expert", with_key))}
    experts = 2 * 2 * expert_bytes  # two layers of two experts
    assert steps["gemv"] - steps["expert"] == pytest.approx(experts / 69e9 - experts / 90e9, rel=0.02)


def test_a_cpu_expert_is_priced_at_its_own_kernels_rate_where_the_gemv_fit_is_slower():
    """Where the decode GEMV's fit streams slower than the native expert kernel does from DRAM (2 AMX cores,
    2026-11-29: 19 GB/s against 27), an expert is priced at the expert kernel's rate, beyond the cache and
    within it (beyond it its own rate is the floor, though plain DRAM reads took 25: dram_floor), never faster
    than plain reads within the cache; a dense projection keeps the GEMV fit, and an expert
    whose GEMV fit is the faster keeps that within the cache. A CPU-only MoE step's price follows, and so
    does a prompt's expert in the native kernel (cpu_predict.native_expert_time)."""
    from tiered.checkpoint.model_config import ModelConfig
    from tiered.planner.cpu_predict import native_expert_time, predict_decode

    llc = 480 * 2**20
    models = {"gemv/cpu/bf16": LinearModel(0.0, 1 / 19e9, 0.99), "gemm/cpu/bf16": LinearModel(0.0, 1e-12, 0.99),
              "memory/bandwidth/cpu": LinearModel(0.0, 1 / 30e9, 0.99),
              "memory/bandwidth_dram/cpu": LinearModel(0.0, 1 / 25e9, 0.99),
              "gemv_dram/cpu/bf16": LinearModel(0.0, 1 / 17e9, 0.99)}
    gemv_only = HardwareProfile("box", "test", dict(models), meta={"llc_bytes": llc, "native_kernels": True})
    with_key = HardwareProfile("box", "test", dict(models, **{"expert_dram/cpu/bf16": LinearModel(2e-3, 1 / 27e9, 0.98)}),
                               meta={"llc_bytes": llc, "native_kernels": True})
    n = 44e6
    for ws in (llc // 2, 2 * llc):  # 27 GB/s, not the GEMV's 19, within the cache and beyond it
        assert op_time.memory_time(with_key, "cpu", "bf16", n, working_set=ws, expert=True) == pytest.approx(n / 27e9)
    assert op_time.memory_time(gemv_only, "cpu", "bf16", n, working_set=llc // 2, expert=True) == pytest.approx(n / 19e9)
    assert op_time.memory_time(with_key, "cpu", "bf16", n, working_set=llc // 2) == pytest.approx(n / 19e9)  # dense
    faster = HardwareProfile("box", "test", dict(with_key.models, **{"gemv/cpu/bf16": LinearModel(0.0, 1 / 40e9, 0.99)}),
                             meta=with_key.meta)
    # within the cache the faster GEMV fit stands, floored by plain reads (30 GB/s), not by the expert kernel's 27
    assert op_time.memory_time(faster, "cpu", "bf16", n, working_set=llc // 2, expert=True) == pytest.approx(n / 30e9)
    # a prompt's expert in the native kernel (a few rows): floored by the same stream
    eb, macs = 3 * 1024 * 3584 * 2, 3 * 1024 * 3584
    assert native_expert_time(with_key, "bf16", 1, eb, macs) == pytest.approx(eb / 27e9)
    assert native_expert_time(gemv_only, "bf16", 1, eb, macs) == pytest.approx(eb / 19e9)
    cfg = ModelConfig.from_hf({"model_type": "mixtral", "vocab_size": 1000, "hidden_size": 1024,
                               "intermediate_size": 3584, "num_hidden_layers": 2, "num_attention_heads": 16,
                               "num_key_value_heads": 4, "head_dim": 64, "num_local_experts": 8,
                               "num_experts_per_tok": 2})
    steps = {name: predict_decode(cfg, hw, "bf16", 64)[1] for name, hw in (("gemv", gemv_only), ("expert", with_key))}
    experts = 2 * 2 * 3 * 1024 * 3584 * 2  # two layers of two experts, all in RAM: one native call a layer
    assert steps["gemv"] - steps["expert"] == pytest.approx(experts / 19e9 - experts / 27e9, rel=0.02)


def test_the_dispatch_latency_carries_the_profiles_host_share():
    """ExpertLatency.latency_model takes the slowdowns of CPU experts and H2D copies run together from
    meta["host_share"] (the profiler's, CUDA machines), 1.0 without it; a plan's saved dispatch latency
    without the fields loads as unshared."""
    from dataclasses import asdict

    from tiered.planner.fiddler import ExpertLatency
    from tiered.runtime.dispatcher import LatencyModel

    hw = get_preset("rtx4090-pcie4")
    plain = ExpertLatency(hw, MIXTRAL_EXPERT).latency_model()
    assert (plain.cpu_shared, plain.link_shared) == (1.0, 1.0)
    shared_hw = replace(hw, meta=dict(hw.meta or {}, host_share={"cpu": 1.13, "h2d": 1.11}))
    shared = ExpertLatency(shared_hw, MIXTRAL_EXPERT).latency_model()
    assert (shared.cpu_shared, shared.link_shared) == (1.13, 1.11)
    assert replace(shared, cpu_shared=1.0, link_shared=1.0) == plain  # nothing else moves
    old = {k: v for k, v in asdict(shared).items() if k not in ("cpu_shared", "link_shared")}
    assert LatencyModel(**old) == plain


def test_host_share_times_cpu_experts_and_copies_alone_and_together():
    """profiler._host_share (hardware/host_share): rates alone and together, and each side's slowdown
    (>= 1), here with host copies standing in for H2D and tiny experts."""
    from tiered.hardware.profiler import _host_share

    share = _host_share(0, 0.02, hidden=64, ffn=128, device="cpu")
    assert share["cpu"] >= 1.0 and share["h2d"] >= 1.0
    assert len(share["cpu_GBps"]) == 2 and len(share["h2d_GBps"]) == 2
    assert all(r > 0 for r in share["cpu_GBps"] + share["h2d_GBps"])
    assert share["cpu"] == pytest.approx(max(1.0, share["cpu_GBps"][0] / share["cpu_GBps"][1]))


@pytest.mark.skipif(not kernels.available(), reason="tiered/kernels not built")
def test_the_expert_dram_key_times_the_native_expert_on_slab_copies_interleaved(monkeypatch):
    """expert_dram/cpu/bf16: the native bf16 expert at one row, n = an expert's weight bytes, each shape over
    as many copies as fill `cold_bytes`, every copy in one HostSlab (page-aligned, as the runtime's CPU
    experts), the shapes timed in turn."""
    from tiered.hardware import budget, profiler

    ext, calls, slabs = kernels.load(), [], []

    class Spy:
        def bf16_expert_forward(self, g, u, d, x):
            calls.append((g.data_ptr(), x.shape))
            return ext.bf16_expert_forward(g, u, d, x)
    monkeypatch.setattr(kernels, "load", lambda: Spy())
    real = budget.HostSlab

    class Slab(real):
        def __init__(self, nbytes, *a, **k):
            super().__init__(nbytes, *a, **k)
            slabs.append(self)
    monkeypatch.setattr(budget, "HostSlab", Slab)
    shapes = ((64, 128), (128, 256))
    small, large = (3 * d * f * 2 for d, f in shapes)
    points = profiler._expert_dram_points(3, 4 * small, shapes)
    assert [n for n, _ in points] == [small, large] and all(t > 0 for _, t in points)
    assert len(slabs) == 2 and slabs[0].used == 4 * small and slabs[1].used == 2 * large  # at least 2 copies
    ptrs = [p for p, _ in calls]
    assert all(any(s.buf.data_ptr() <= p < s.buf.data_ptr() + s.buf.numel() for s in slabs) for p in ptrs)
    assert len(set(ptrs)) == 6 and {x[0] for _, x in calls} == {1}
    widths = [x[1] for _, x in calls]
    assert sum(a != b for a, b in zip(widths, widths[1:])) >= 5  # warm-ups, then each repeat visits both


def test_the_small_row_gemm_key_times_torch_over_cold_copies_in_one_slab(monkeypatch):
    """gemm_rows/cpu/<dtype>: torch's GEMM (as the runtime calls it, hardware/cpu_gemm.linear) of GEMM_ROWS
    rows, n = weight bytes, over as many copies of each weight as fill `cold_bytes` (each called in turn), the
    copies carved from one huge-page slab per shape (slab_copies: clones on 4 KiB pages gave fits of R^2
    0.1-0.8), the shapes timed interleaved."""
    from tiered.hardware import budget, cpu_gemm, profiler

    real_linear, real_slab, calls, slabs = torch.nn.functional.linear, budget.HostSlab, [], []

    def linear(x, w, *a):
        calls.append((w.data_ptr(), tuple(w.shape), x.shape[0], x.dtype))
        return cpu_gemm.linear(x, w, *a)

    class Slab(real_slab):
        def __init__(self, nbytes, *a, **k):
            super().__init__(nbytes, *a, **k)
            slabs.append(self)
    monkeypatch.setattr(profiler, "linear", linear)
    monkeypatch.setattr(budget, "HostSlab", Slab)
    # oneDNN's first bf16 GEMM of a process builds its kernels (~8-12 ms here): a warm-up call that slow gets one
    # call a sample (median_times), too few to reach every copy
    real_linear(torch.ones(profiler.GEMM_ROWS, 32).bfloat16(), torch.ones(64, 32).bfloat16())
    small, large = 64 * 32 * 2, 128 * 64 * 2  # bytes of the bf16 [64, 32] and [128, 64] weights
    points = profiler._gemm_rows_points("bf16", [(64, 32), (128, 64)], 3, 6 * small)
    assert [n for n, _ in points] == [small, large] and all(t > 0 for _, t in points)
    assert len(slabs) == 2 and slabs[0].used == 6 * 4096 and slabs[1].used == 2 * large  # page-aligned, at least 2
    inside = lambda p: any(s.buf.data_ptr() <= p < s.buf.data_ptr() + s.buf.numel() for s in slabs)  # noqa: E731
    assert all(inside(p) for p, *_ in calls)
    assert len({p for p, sh, *_ in calls if sh == (64, 32)}) == 6 and len({p for p, sh, *_ in calls if sh == (128, 64)}) == 2
    assert {(r, dt) for *_, r, dt in calls} == {(profiler.GEMM_ROWS, torch.bfloat16)}
    shapes = [sh for _, sh, *_ in calls]
    assert sum(a != b for a, b in zip(shapes, shapes[1:])) >= 5  # warm-ups, then each repeat visits both
    with pytest.raises(ValueError, match="int4"):
        profiler._gemm_rows_points("int4", [(64, 32)], 3, None)


def test_an_int4_prompt_gemm_is_priced_as_its_gemm_plus_its_weights_dequantization(monkeypatch):
    """A one-copy int4 weight's prompt GEMM past the kernel's rows dequantizes the weight, then multiplies
    (Int4Linear.dequantized). dequantize/cpu/int4 times the first per element; gemm/cpu/int4's points are fitted
    net of it (over multiply-adds alone at 192-384 rows, where the dequantization is a larger share, the key
    priced SmolLM2's 512-row projections 18-29% slow). torch_gemm_time and prompt_expert_time add it back per
    weight element; gemm_time does not (an int4 head's decode GEMV runs the kernel), nor does a profile without it."""
    from tiered.hardware import op_time, profiler
    from tiered.planner.cpu_predict import prompt_expert_time, torch_gemm_time

    shapes = [(128, 64, 32), (256, 64, 32), (128, 128, 32)]
    dq = LinearModel(0.0, 2e-10, 1.0)
    net = profiler._net_of_dequantize([(128 * 64 * 32, 1e-3), (256 * 64 * 32, 2e-3), (128 * 128 * 32, 5e-7)], shapes, dq)
    assert net == [(128 * 64 * 32, pytest.approx(1e-3 - 2e-10 * 2048)), (256 * 64 * 32, pytest.approx(2e-3 - 2e-10 * 2048)),
                   (128 * 128 * 32, pytest.approx(5e-8))]  # at least a tenth of each point stays
    assert profiler._net_of_dequantize([(1.0, 1e-3)], shapes, None) == [(1.0, 1e-3)]
    if kernels.available():  # the tiled layout's dequantization of each weight, and a 4096 x 2048 one
        from tiered.kernels import linear

        seen = []
        real = linear.tiled_dequantize
        monkeypatch.setattr(linear, "tiled_dequantize", lambda *a, **k: seen.append(k["rows"]) or real(*a, **k))
        points = profiler._dequantize_points(shapes, 3)
        assert [n for n, _ in points] == [64 * 32, 128 * 32, 2048 * 4096] and all(t > 0 for _, t in points)
        assert {r for r in seen} == {(0, 32), (0, 4096)}
    base = {"gemm/cpu/int4": LinearModel(1e-4, 1.5e-12, 1.0), "gemm/cpu/bf16": LinearModel(1e-4, 1e-12, 1.0)}
    plain = HardwareProfile("box", "test", base)
    hw = HardwareProfile("box", "test", {**base, "dequantize/cpu/int4": dq})
    K, N, T = 576, 3072, 512
    w = K * N * op_time.bytes_per_element("int4")
    assert torch_gemm_time(hw, "int4", T * K * N, w) == pytest.approx(torch_gemm_time(plain, "int4", T * K * N, w)
                                                                      + 2e-10 * K * N)
    assert torch_gemm_time(hw, "bf16", T * K * N, 2 * K * N) == torch_gemm_time(plain, "bf16", T * K * N, 2 * K * N)
    assert op_time.gemm_time(hw, "cpu", "int4", K * N, w) == op_time.gemm_time(plain, "cpu", "int4", K * N, w)
    meta = {"native_kernels": True, "kernel_isa": "avx512"}
    rows = {"gemv/cpu/int4q8": LinearModel(0.0, 1 / 30e9, 1.0), "decode_rows/cpu/int4q8": LinearModel(0.0, 4e-12, 1.0)}
    e_plain = HardwareProfile("box", "test", {**base, **rows}, meta=meta)
    e_hw = HardwareProfile("box", "test", {**base, **rows, "dequantize/cpu/int4": dq}, meta=meta)
    eb, macs = 3 * w, 3 * K * N  # an expert of three such projections, at 1024 rows: dequantized
    assert prompt_expert_time(e_hw, "int4", 1024, eb, macs, "q8") == pytest.approx(
        prompt_expert_time(e_plain, "int4", 1024, eb, macs, "q8") + 2e-10 * 3 * K * N)


@pytest.mark.skipif(not kernels.available(), reason="tiered/kernels not built")
def test_the_native_expert_rows_key_times_1_to_8_rows_over_cold_copies(monkeypatch):
    """expert_rows/cpu/bf16: the native bf16 expert at 1, 2, 4 and 8 rows, n = MACs, each call on the next
    of the copies that fill `cold_bytes`."""
    from tiered.hardware import profiler

    ext, calls = kernels.load(), []

    class Spy:
        def bf16_expert_forward(self, g, u, d, x):
            calls.append((g.data_ptr(), x.shape[0]))
            return ext.bf16_expert_forward(g, u, d, x)
    monkeypatch.setattr(kernels, "load", lambda: Spy())
    expert = 3 * 1024 * 3584 * 2
    points = profiler._expert_rows_points(3, 3 * expert)
    assert [n for n, _ in points] == [r * 3 * 1024 * 3584 for r in (1, 2, 4, 8)] and all(t > 0 for _, t in points)
    assert {r for _, r in calls} == {1, 2, 4, 8} and len({p for p, _ in calls}) == 3


@pytest.mark.skipif(not kernels.available(), reason="tiered/kernels not built")
def test_the_int4_expert_rows_key_times_the_engines_q8_expert_over_cold_copies(monkeypatch):
    """expert_rows/cpu/int4q8: tiled int4 experts on int8 activations (what a prompt's Q4_0 experts run) at 2, 4
    and 8 rows each, EXPERT_Q8_GROUP of them in one layer call (ExpertFormat.forward_group, as the MoE layer runs
    them), n = an expert's MACs, seconds a call over its experts, each call on the next copies of those that fill
    `cold_bytes`; expert_groups/cpu/int4q8 the same at 8-32 rows (groups past the first); both retimed on a poor fit
    and timed in the second pass like the other row keys."""
    from tiered.hardware import profiler
    from tiered.quant.experts import ExpertFormat

    calls, real = [], ExpertFormat.forward_group
    G, (D, F) = profiler.EXPERT_Q8_GROUP, profiler.EXPERT_Q8_SHAPE

    def spy(self, xs, slots, bounds):
        calls.append(({s[0].data_ptr() for s in slots}, xs.shape[0], bounds, self.kinds, self.int4_layout,
                      self.batch_act, self.exact_zeros))
        return real(self, xs, slots, bounds)
    monkeypatch.setattr(ExpertFormat, "forward_group", spy)
    nbytes = ExpertFormat("int4", ((F, D), (F, D), (D, F)), "tiled").nbytes
    for fn, rows in ((profiler._expert_rows_q8_points, (2, 4, 8)),
                     (profiler._expert_groups_int4q8_points, (8, 16, 24, 32))):
        calls.clear()
        points = fn(3, 3 * nbytes)
        assert [n for n, _ in points] == [r * 3 * D * F for r in rows] and all(t > 0 for _, t in points)
        assert {c[1] for c in calls} == {r * G for r in rows}
        assert all(c[2] == [i * c[1] // G for i in range(G + 1)] and len(c[0]) == G for c in calls)
        assert {c[3:] for c in calls} == {(("int4",) * 3, "tiled", "q8", True)}
    for key in ("expert_rows/cpu/int4q8", "expert_groups/cpu/int4q8"):
        assert key.startswith(profiler.RETIMED_KEYS) and key.startswith(profiler.SECOND_PASS_KEYS)
        assert key.startswith(profiler.COMPUTE_KEYS)
    # profiler 70: a GGUF file's other expert kinds as stored, in the same layer calls (k-quants from random blocks)
    for kind in profiler.EXPERT_ROWS_KINDS:
        calls.clear()
        points = profiler._expert_rows_q8_points(3, None, (2, 8), kind=kind)
        assert [n for n, _ in points] == [r * 3 * D * F for r in (2, 8)] and all(t > 0 for _, t in points)
        assert {c[3:] for c in calls} == {((kind,) * 3, "tiled", "q8", False)} and len(calls[0][0]) == G


@pytest.mark.skipif(not kernels.available(), reason="tiered/kernels not built")
@pytest.mark.parametrize("fmt,kind", [("int4", "Int4Linear"), ("int8-g32", "Int8G32Linear")])
def test_the_decode_layer_key_times_the_native_steps_int4_layers_from_memory(monkeypatch, fmt, kind):
    """runtime/decode_layer/<fmt>: the native step's forward over DECODE_LAYER_RUN dense layers at a time of a
    model with the engine's tiled int4 (or int8-g32) copies alone (one copy: no dense weight kept), the next run
    each call, as many runs for every shape, enough that `cold_bytes` pass between two reads of one weight (the
    shapes' calls interleaved); n = a layer's bytes in that format, seconds a layer less `layer_code`; fitted
    through the origin, retimed on a poor fit."""
    from tiered.hardware import profiler
    from tiered.memory.sizes import bytes_per_element
    from tiered.quant.linear import PhaseLinear
    from tiered.runtime import cpu_decode

    runs, steps = [], []

    class Spy(cpu_decode.CPUDecodeStep):
        def __init__(self, model, native):
            super().__init__(model, native)
            phases = [m for m in model.modules() if isinstance(m, PhaseLinear)]
            steps.append((len(model.model.layers), all(m.weight is None for m in phases),
                          {type(m.decode).__name__ for m in phases}, native))
            real, index = self.native, len(steps)

            class Recorder:
                def forward(self, *a, **k):
                    runs.append((index, a[-2], a[-1]))
                    return real.forward(*a, **k)
            self.native = Recorder()
    monkeypatch.setattr(cpu_decode, "CPUDecodeStep", Spy)
    shapes = ((64, 128, 2, 1), (128, 256, 2, 2))
    sizes = [(D * (H + 2 * Hkv) * 64 + H * 64 * D + 3 * D * F) * bytes_per_element(fmt) for D, F, H, Hkv in shapes]
    run = profiler.DECODE_LAYER_RUN
    points = profiler._decode_layer_points(3, shapes, cold_bytes=int(2 * run * sizes[1]), fmt=fmt)
    assert [n for n, _ in points] == pytest.approx(sizes) and all(t > 0 for _, t in points)
    # as many runs of layers for every shape: `cold_bytes` or more between two reads of one weight, for each alike
    runs_each = -(-2 * run * sizes[1] // (run * sum(sizes)))
    assert runs_each == 2 and [s[0] for s in steps] == [runs_each * run] * len(sizes)
    assert all(one_copy and native and kinds == {kind, "Slice"} for _, one_copy, kinds, native in steps)
    assert all(b - a == run for _, a, b in runs)
    assert {a for s, a, _ in runs if s == 2} == {0, run}  # the second model's two runs, in turn
    assert profiler._decode_layer_points(1, shapes[:1], cold_bytes=1, layer_code=1.0, fmt=fmt)[0][1] == 1e-9
    b = profiler._Bench(True, None, None)
    b.fit(f"runtime/decode_layer/{fmt}", [(1e6, 3e-5), (2e6, 6.2e-5)])
    assert b.models[f"runtime/decode_layer/{fmt}"].alpha == 0.0
    assert f"runtime/decode_layer/{fmt}".startswith(profiler.RETIMED_KEYS)


def test_the_engine_token_key_is_a_tiny_engines_itl_less_its_step(monkeypatch):
    """runtime/engine_token: the median ITL of a tiny engine's greedy tokens less its model step's median time,
    at least 0 (a step timed slower than the whole loop's tokens says nothing of the loop)."""
    from tiered.hardware import profiler

    loop = profiler._engine_token_seconds(3)
    assert 0.0 < loop < 0.05
    monkeypatch.setattr(profiler, "median_time", lambda fn, repeats, *a, **k: 1.0)  # a step slower than any ITL
    assert profiler._engine_token_seconds(1) == 0.0


@pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")
def test_the_burst_token_key_is_a_tiny_engines_burst_itl_less_its_layers(monkeypatch):
    """runtime/burst_token: the median ITL of a tiny engine's greedy tokens in decode bursts (which must run:
    the engine's burst is spied on) less its 2 layers' code, at least 0."""
    from tiered.hardware import profiler
    from tiered.runtime.cpu_decode import CPUDecodeStep

    calls = []
    real = CPUDecodeStep.burst
    monkeypatch.setattr(CPUDecodeStep, "burst", lambda self, *a, **k: calls.append(a[3]) or real(self, *a, **k))
    assert 0.0 < profiler._burst_token_seconds(5, 0.0) < 0.05 and calls
    assert profiler._burst_token_seconds(1, 1.0) == 0.0  # layers slower than any ITL: 0


def test_the_cpu_path_moe_layer_probe_times_tiny_engines_with_every_expert_on_the_cpu(monkeypatch):
    """_moe_cpu_layer_points: decode ITL of tiny MoE engines of 2, 4 and 8 layers on the accelerator given (the
    host stand-in here; CUDA in a profile), no expert on it, every miss on the CPU path."""
    from tiered.engine import llm as llm_module
    from tiered.hardware import profiler

    made = []
    real = llm_module.LLM

    class Spy(real):
        def __init__(self, path, config):
            super().__init__(path, config)
            made.append((config, self.runtime_stats()["placement"]))
    monkeypatch.setattr(llm_module, "LLM", Spy)
    points = profiler._moe_cpu_layer_points(1, "host")
    assert [n for n, _ in points] == [2.0, 4.0, 8.0] and all(t > 0 for _, t in points)
    assert points[2][1] > points[0][1]  # six more layers cost something
    for config, placement in made:
        assert (config.accelerator, config.force_expert_path, config.resident_experts, config.expert_cache_slots) == \
            ("host", "cpu", 0, 0)
        assert "0 resident on the fast tier" in placement


@pytest.mark.cuda
def test_on_cuda_the_host_share_and_the_cpu_path_layer_probe_measure():
    """The CUDA-only profile measurements run on a real GPU: CPU experts in page-locked memory beside H2D
    copies (both sides' rates, slowdowns >= 1), and the tiny MoE engines with every miss on the CPU path
    (three positive points, more layers costing more)."""
    from tiered.hardware.profiler import _host_share, _moe_cpu_layer_points

    share = _host_share(0, 0.05, hidden=1024, ffn=3584, device="cuda")
    assert share["cpu"] >= 1.0 and share["h2d"] >= 1.0 and all(r > 0 for r in share["cpu_GBps"] + share["h2d_GBps"])
    points = _moe_cpu_layer_points(1, "cuda")
    assert [n for n, _ in points] == [2.0, 4.0, 8.0] and all(t > 0 for _, t in points) and points[2][1] > points[0][1]


# ---- the memory-speed probe beside each CPU GEMV key ------------------------------------------------

def test_the_probe_is_timed_among_a_keys_samples(monkeypatch):
    """_gemm_points times a Probe's call interleaved with the key's shapes and leaves its median in
    probe.last; the key's points are the shapes' alone."""
    from types import SimpleNamespace

    from tiered.hardware import profiler

    monkeypatch.setattr(profiler, "_native_gemv_format", lambda *a: False)
    calls = []
    probe = SimpleNamespace(fn=lambda: calls.append(1) or time.sleep(2e-4), last=None, samples=None)
    points = profiler._gemm_points("cpu", "fp32", [(1, 64, 64), (1, 128, 64)], lambda: None, 3, True, probe=probe)
    assert [n for n, _ in points] == [64 * 64 * 4, 128 * 64 * 4]
    assert probe.last is not None and probe.last >= 2e-4 and len(calls) >= 4  # warm-up + 3 samples
    # its samples in the order taken, one a round (probe_swing's halves), the median theirs
    assert len(probe.samples) == 3 and probe.last == pytest.approx(sorted(probe.samples)[1])


@pytest.mark.skipif(not kernels.available(), reason="tiered/kernels not built")
def test_the_batched_steps_rows_are_timed_in_the_step_at_each_width(monkeypatch):
    """_batch_rows_points: for each of the decode layer shapes and BATCH_ROWS rows, (the layer's weight elements,
    the seconds a layer each row past the first adds in the native step against one row); a profile that gets
    it prices batched steps by it (predict_decode)."""
    from tiered.hardware import profiler

    monkeypatch.setattr(profiler, "COLD_WEIGHT_BYTES", 8 * 2**20)
    shapes = profiler.DECODE_LAYER_SHAPES[:2]
    points = profiler._batch_rows_points(1, shapes=shapes)
    k = len(profiler.BATCH_ROWS)
    assert len(points) == len(shapes) * k
    for i, (D, F_, H, Hkv) in enumerate(shapes):
        n = D * (H + 2 * Hkv + H) * 64 + 3 * D * F_
        assert [p[0] for p in points[i * k:(i + 1) * k]] == [float(n)] * k
    # each point a finite time, never negative (_batch_rows_points floors a median difference lost in a noisy
    # VM's swings at 0: 4 rows against 1 came out <= 0 once in CI); the most rows cost more than one
    assert all(math.isfinite(t) and t >= 0 for _, t in points)
    assert all(t > 0 for _, t in points[len(profiler.BATCH_ROWS) - 1::len(profiler.BATCH_ROWS)])
    assert "runtime/batch_rows/".startswith(profiler.COMPUTE_KEYS)  # read with the compute probe


def test_the_memory_probes_swing_is_kept_from_the_halves_of_each_keys_samples():
    """_Bench.attempt keeps, for each GEMV key timed with the memory probe among its samples, the probe's median over
    the first and the second half of them (halves; from the run kept where a stalled key is timed again), and the
    profile's meta["probe"]["swing"] is probe_swing over those pairs."""
    from types import SimpleNamespace

    from tiered.hardware.profiler import _Bench, halves, probe_swing

    assert halves([1.0, 2.0, 3.0, 4.0]) == (1.5, 3.5) and halves([1.0, 9.0, 2.0]) == (1.0, 2.0)
    assert halves([1.0]) is None and halves(None) is None
    b = _Bench(True, None, None)
    b.probe = SimpleNamespace(last=None, samples=None)
    runs = iter([[1.0, 1.0, 1.2, 1.2], [2.0, 2.0, 2.0, 2.0], [1.0, 1.0, 0.5, 0.5]])

    def timing(points):
        b.probe.samples = next(runs)
        b.probe.last = statistics.median(b.probe.samples)
        return points
    line = [(1e6, 1e-3), (2e6, 2e-3), (4e6, 4e-3)]
    b.attempt("gemv/cpu/bf16", lambda: timing(line))
    b.attempt("gemv/cpu/int4", lambda: timing(line))
    b.attempt("gemv/cpu/int8", lambda: timing(line))
    assert not b.skipped, b.skipped
    assert b.probe_pairs == [(1.0, 1.2), (2.0, 2.0), (1.0, 0.5)]
    assert b.probes == {"gemv/cpu/bf16": 1.1, "gemv/cpu/int4": 2.0, "gemv/cpu/int8": 0.75}
    assert probe_swing(b.probe_pairs) == pytest.approx((math.log(1.2) + math.log(2.0)) / 3)


@pytest.mark.skipif(not kernels.available(), reason="tiered/kernels not built")
def test_the_probe_is_timed_among_the_cpu_experts_samples():
    """expert_dram/cpu/bf16 (the native expert from DRAM, which prices an all-in-RAM MoE's decode experts) carries
    the memory-speed probe of its minutes like every GEMV key: _expert_dram_points times the probe among its
    shapes and leaves its median in probe.last; the key's points are the experts' alone. Without it a profile
    timed in a slow minute priced that MoE's decode 13-34% slow on 2 Zen 3 cores (2026-12-01; 8 rounds, each priced,
    then measured)."""
    from types import SimpleNamespace

    from tiered.hardware import profiler

    calls = []
    probe = SimpleNamespace(fn=lambda: calls.append(1) or time.sleep(2e-4), last=None)
    shapes = ((64, 128), (128, 256))
    points = profiler._expert_dram_points(3, 2**20, shapes, probe=probe)
    assert [n for n, _ in points] == [3 * 64 * 128 * 2, 3 * 128 * 256 * 2]
    assert all(t > 0 for _, t in points)
    assert probe.last is not None and probe.last >= 2e-4 and len(calls) >= 4  # warm-up + 3 samples


def test_the_probe_cycles_over_three_caches_up_to_its_cap(monkeypatch):
    """The memory-speed probe's copies fill 3 x the last-level cache, at most PROBE_MAX_COLD_BYTES: every
    engine builds it at planning, and 3 x a VM's sysfs L3 of 480 MiB (1.4 GiB of copies) had doubled
    SmolLM2's engine start and made its peak RSS 4x its steady RSS."""
    from tiered.hardware import profiler

    made = []
    monkeypatch.setattr(profiler, "_native_gemv_module", lambda fmt, w: (made.append(torch.nn.Linear(1, 1)) or
                                                                         made[-1], None))
    monkeypatch.setattr(profiler, "move_to_huge_pages", lambda m: None)
    monkeypatch.setattr(profiler, "_native_gemv", lambda fmt, m: (lambda x: x))
    weight = 4096 * 4096 * 2
    assert len(profiler.Probe(32 * 2**20)._keep) * weight == 96 * 2**20  # 3 x a 32 MiB cache
    keep = profiler.Probe(480 * 2**20)._keep
    assert len(keep) * weight == profiler.PROBE_MAX_COLD_BYTES == 256 * 2**20
    # the module built is the first of the copies (no spare template beside them), each copy its own memory
    assert keep[0] is made[-1] and len({m.weight.data_ptr() for m in keep}) == len(keep)


def _probed_profile():
    keys = ("gemv/cpu/bf16", "gemv/cpu/int4", "gemv_dram/cpu/bf16", "memory/bandwidth/cpu",
            "memory/bandwidth_dram/cpu", "attn_decode/cpu/bf16", "gemm/cpu/bf16")
    # gemv/cpu/bf16 measured in a slow minute (its probe 1.5x the others')
    seconds = {"gemv/cpu/bf16": 6e-4, "gemv/cpu/int4": 4e-4, "gemv_dram/cpu/bf16": 4e-4}
    return HardwareProfile("box", "test", {k: LinearModel(1e-6, 2e-11, 0.9) for k in keys},
                           meta={"llc_bytes": 32 * 2**20, "probe": {"shape": [1, 4096, 4096], "bytes": 2**25,
                                                                    "seconds": seconds}})


def test_each_gemv_key_follows_its_own_minutes_speed(monkeypatch):
    """With probe times in the profile, planning scales each GEMV key by the probe's time now against the
    probe's time among that key's samples (slower, or faster up to the profile's median minute), when two
    readings agree beyond 15%: a key measured in a slow minute is not slowed again by a reference measured
    in a fast one."""
    from tiered.hardware import profiler
    from tiered.planner import auto

    monkeypatch.setattr(auto.contention, "others_share", lambda *a: 0.0)  # a quiet machine (a busy one: below)
    hw = _probed_profile()
    monkeypatch.setattr(profiler, "Probe", lambda llc: object())
    now = iter([6e-4, 5.8e-4])  # the memory now as slow as gemv/cpu/bf16's minute

    def ratios(profile, probe=None, repeats=5):
        t = next(now)
        got = {k: t / s for k, s in profile.meta["probe"]["seconds"].items()}
        got["*"] = t / 4e-4
        return got
    monkeypatch.setattr(profiler, "cpu_probe_ratios", ratios)
    got = auto.bandwidth_now(hw)
    m = got.models
    assert m["gemv/cpu/bf16"].beta == pytest.approx(2e-11)  # 1.0 / 0.97: within 15%, kept
    assert m["gemv/cpu/int4"].beta == pytest.approx(2e-11 * 5.8 / 4) and m["gemv/cpu/int4"].alpha == 1e-6
    assert m["gemv_dram/cpu/bf16"].beta == pytest.approx(2e-11 * 5.8 / 4)
    assert m["memory/bandwidth/cpu"].beta == pytest.approx(2e-11 * 5.8 / 4)  # "*": slower moves every key
    assert m["gemm/cpu/bf16"].beta == 2e-11  # compute-bound: never
    assert got.meta["cpu_key_ratios"]["gemv/cpu/int4"] == pytest.approx(1.45)
    assert "gemv/cpu/bf16" not in got.meta["cpu_key_ratios"] and auto.bandwidth_now(got) is got
    # faster now than every key's minute: a key of a slower minute than the profile's median is brought to the
    # median minute's speed, no further; keys of that minute, and the rest, keep their rates (a short probe read
    # after an idle moment is faster than a loaded minute's engines run)
    now = iter([2.5e-4, 2.6e-4])
    got = auto.bandwidth_now(hw)
    assert got.models["gemv/cpu/bf16"].beta == pytest.approx(2e-11 * 4 / 6)
    assert got.models["gemv/cpu/int4"].beta == 2e-11 and got.models["gemv_dram/cpu/bf16"].beta == 2e-11
    assert got.models["memory/bandwidth/cpu"].beta == 2e-11
    assert got.models["memory/bandwidth_dram/cpu"].beta == 2e-11 and got.models["attn_decode/cpu/bf16"].beta == 2e-11
    assert set(got.meta["cpu_key_ratios"]) == {"gemv/cpu/bf16"}
    # readings either side of a key's minute: nothing to follow
    now = iter([3e-4, 7.5e-4])
    assert auto.bandwidth_now(hw) is hw


def test_the_memory_check_stands_down_where_the_memory_swung_within_single_timings(monkeypatch):
    """A profile whose memory probe moved beyond MEMORY_SWING within single keys' timings (meta["probe"]["swing"])
    is planned with as measured: no reading is taken, a note says why (once), and a steady profile is checked."""
    from tiered.hardware import profiler
    from tiered.planner import auto

    monkeypatch.setattr(auto.contention, "others_share", lambda *a: 0.0)
    monkeypatch.setattr(profiler, "Probe", lambda llc: object())
    read = []

    def ratios(profile, probe=None, repeats=5):
        read.append(1)
        return dict({k: 1.6 for k in profile.meta["probe"]["seconds"]}, **{"*": 1.6})
    monkeypatch.setattr(profiler, "cpu_probe_ratios", ratios)
    hw = _probed_profile()
    swings = replace(hw, meta=dict(hw.meta, probe=dict(hw.meta["probe"], swing=auto.MEMORY_SWING * 1.5)))
    got = auto.bandwidth_now(swings)
    assert got.models == hw.models and not read and "cpu_key_ratios" not in got.meta
    assert "memory-speed check at planning not applied" in got.meta["notes"][-1] and f"{auto.MEMORY_SWING * 1.5:.0%}" in got.meta["notes"][-1]
    assert auto.bandwidth_now(got).meta["notes"] == got.meta["notes"]  # said once
    steady = replace(hw, meta=dict(hw.meta, probe=dict(hw.meta["probe"], swing=auto.MEMORY_SWING / 2)))
    got = auto.bandwidth_now(steady)
    assert read and got.models["gemv/cpu/int4"].beta == pytest.approx(2e-11 * 1.6)
    n = len(read)
    assert auto.bandwidth_now(hw).meta["cpu_key_ratios"] and len(read) > n  # a profile without a swing: checked


def test_a_memory_speed_beyond_3x_of_the_profiles_is_read_a_third_time_before_it_is_followed(monkeypatch):
    """Two probe readings 14x slow in a row (the 2026-11-28 H100 host at planning: a stall, every miss on
    the CPU then ran at the profile's speed) are not followed when a third, a second later, reads the
    profile's speed; three such readings are (the one nearest the profile's)."""
    from tiered.hardware import profiler
    from tiered.planner import auto

    monkeypatch.setattr(auto.contention, "others_share", lambda *a: 0.0)
    monkeypatch.setattr(auto, "SWING_PAUSE_S", 0.0)
    monkeypatch.setattr(profiler, "Probe", lambda llc: object())
    hw = _probed_profile()
    seconds = hw.meta["probe"]["seconds"]
    calls = []

    def ratios(profile, probe=None, repeats=5):
        t = next(now)
        calls.append(t)
        return dict({k: t / s for k, s in seconds.items()}, **{"*": t / 4e-4})
    monkeypatch.setattr(profiler, "cpu_probe_ratios", ratios)
    now = iter([56e-4, 55e-4, 4.1e-4])  # 14x, 14x, then the profile's speed
    assert auto.bandwidth_now(hw) is hw and len(calls) == 3
    calls.clear()
    now = iter([56e-4, 55e-4, 50e-4])  # slow three times: followed, by the reading nearest the profile's
    got = auto.bandwidth_now(hw)
    assert len(calls) == 3 and got.models["gemv/cpu/int4"].beta == pytest.approx(2e-11 * 50 / 4)
    assert "timed three times" in " ".join(got.meta["notes"])
    calls.clear()
    now = iter([5.8e-4, 6e-4])  # 1.45x: within the swing, two readings as before
    assert auto.bandwidth_now(hw).models["gemv/cpu/int4"].beta == pytest.approx(2e-11 * 5.8 / 4) and len(calls) == 2


def test_a_batched_decode_step_streams_the_weights_once_and_adds_each_rows_multiply_adds():
    """predict_decode(batch=B): each projection's weights stream once a step and each row past the
    first adds its multiply-adds at decode_rows/cpu/<dtype>'s slope (SmolLM2's default engine on 2 Zen
    4 cores: 2.42 / 4.17 / 6.99 ms a step at 1 / 4 / 8 rows); each row attends over its own cache.
    An MoE step runs each expert its rows choose once: E (1 - (1 - k/E)^B) under uniform routing."""
    from tiered.checkpoint.model_config import ModelConfig
    from tiered.memory import sizes
    from tiered.planner.cpu_predict import predict_decode

    cfg = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    models = {"gemv/cpu/int4": LinearModel(0.0, 1 / 30e9, 0.99), "memory/bandwidth/cpu": LinearModel(0.0, 1 / 40e9, 0.99),
              "gemm/cpu/int4": LinearModel(0.0, 1e-11, 0.99)}
    rows = HardwareProfile("box", "test", dict(models, **{"decode_rows/cpu/int4": LinearModel(2e-6, 4e-12, 0.99)}),
                           meta={"native_kernels": True})
    one = predict_decode(cfg, rows, "int4", context=64)[1]
    assert predict_decode(cfg, rows, "int4", context=64, batch=1)[1] == one
    macs = cfg.num_hidden_layers * (cfg.attention_weight_elements() + 3 * 576 * 1536) + 576 * 49152  # one row's
    kv_row = cfg.num_hidden_layers * cfg.kv_elements_per_token() * 64 * 2 / 40e9  # a bf16 cache at the memory's rate
    for B in (2, 4, 8):
        got = predict_decode(cfg, rows, "int4", context=64, batch=B)[1]
        assert got == pytest.approx(one + (B - 1) * (4e-12 * macs + kv_row), rel=1e-6)
    # without the key a row's multiply-adds cost the GEMM fit's compute
    plain = HardwareProfile("box", "test", dict(models), meta={"native_kernels": True})
    assert predict_decode(cfg, plain, "int4", context=64, batch=4)[1] == pytest.approx(
        one + 3 * (1e-11 * macs + kv_row), rel=1e-6)
    # int8 activations in batched steps (Plan.batch_act "q8", a server's): the int4q8 keys where measured
    # (int4 rows on 2 AMX cores: 3.4 ps a multiply-add on int8 activations, 11.5 on bf16 ones), int4's before
    assert predict_decode(cfg, rows, "int4", context=64, batch=4, batch_act="q8")[1] == pytest.approx(
        predict_decode(cfg, rows, "int4", context=64, batch=4)[1], rel=1e-12)
    q8 = HardwareProfile("box", "test", dict(rows.models, **{"decode_rows/cpu/int4q8": LinearModel(2e-6, 1e-12, 0.99),
                                                             "gemv/cpu/int4q8": LinearModel(0.0, 1 / 35e9, 0.99)}),
                         meta={"native_kernels": True})
    assert predict_decode(cfg, q8, "int4", context=64, batch=1, batch_act="q8")[1] == one  # batch 1 reads bf16
    stream = macs * sizes.bytes_per_element("int4") * (1 / 35e9 - 1 / 30e9)  # the same bytes at int4q8's rate
    for B in (2, 8):
        assert predict_decode(cfg, q8, "int4", context=64, batch=B, batch_act="q8")[1] == pytest.approx(
            one + stream + (B - 1) * (1e-12 * macs + kv_row), rel=1e-6)
    # with the batched step's own rows measured (runtime/batch_rows/int4q8: a row's fixed cost a layer and its cost
    # a weight element, in the step at the layers' widths), each dense layer is one row's stream plus those rows;
    # the lm_head's rows keep decode_rows' price (the key is the layers'); bf16 activations, or a mix of precisions,
    # keep the kernels' keys
    key = LinearModel(10e-6, 6e-12, 0.95)
    batched = HardwareProfile("box", "test", dict(q8.models, **{"runtime/batch_rows/int4q8": key}),
                              meta={"native_kernels": True})
    layer = cfg.attention_weight_elements() + 3 * 576 * 1536
    head_rows = 1e-12 * 576 * 49152
    # the layers' one row as the key's own difference had it (one row on bf16 activations, int4's stream); the
    # head's stream at int4q8's rate
    head_stream = 576 * 49152 * sizes.bytes_per_element("int4") * (1 / 35e9 - 1 / 30e9)
    for B in (2, 8):
        assert predict_decode(cfg, batched, "int4", context=64, batch=B, batch_act="q8")[1] == pytest.approx(
            one + head_stream + (B - 1) * (cfg.num_hidden_layers * key(layer) + head_rows + kv_row), rel=1e-6)
        parts = predict_decode(cfg, batched, "int4", context=64, batch=B, batch_act="q8")[0][0]  # split by weight
        alone = predict_decode(cfg, q8, "int4", context=64, batch=1, batch_act="q8")[0][0]
        assert parts[1] - alone[1] == pytest.approx((B - 1) * key(layer) * 3 * 576 * 1536 / layer, rel=1e-6)
    assert predict_decode(cfg, batched, "int4", context=64, batch=4)[1] == \
        predict_decode(cfg, q8, "int4", context=64, batch=4)[1]  # bf16 activations: no such key
    mix = {"int4": 0.75, "bf16": 0.25}
    assert predict_decode(cfg, batched, "int4", context=64, batch=4, batch_act="q8", mix=mix)[1] == \
        predict_decode(cfg, q8, "int4", context=64, batch=4, batch_act="q8", mix=mix)[1]
    assert predict_decode(cfg, batched, "int4", context=64, batch=1, batch_act="q8")[1] == one
    # with the key's points (a row's cost at each width, for each timed batch in turn: profiler 44), each timed batch
    # prices its own rows, fitted over the widths: here a row costs 0 at 4 rows, 5 us a layer at 8 and 10 at 16
    # (the AMX VM's shape: the first rows ride the stream), and more rows cost what the last segment's rows did
    from tiered.hardware.op_time import batch_rows_time
    BATCH_ROWS = (4, 8, 16)  # a profile's timed batches (meta["batch_rows"]; profiles before profiler 54: these)
    widths = (layer, 2 * layer, 4 * layer)
    per_b = {4: lambda n: 0.0, 8: lambda n: 5e-6 * n / layer, 16: lambda n: 10e-6 * n / layer}
    pts = [[n, per_b[b](n)] for n in widths for b in BATCH_ROWS]
    shaped = replace(batched, meta={"native_kernels": True, "points": {"runtime/batch_rows/int4q8": pts}})
    # the same points recorded with their batches, and at 4 / 8 / 16 / 32 rows with a cheaper row from 32 on (the AMX
    # GEMM's rows): 32 rows priced at its own point, not the 16-row segment's slope
    assert batch_rows_time(replace(shaped, meta={**shaped.meta, "batch_rows": [4, 8, 16]}), "runtime/batch_rows/int4q8",
                           32, layer) == pytest.approx(15 * 10e-6 + 16 * (15 * 10e-6 - 7 * 5e-6) / 8)
    per_b[32] = lambda n: 6e-6 * n / layer
    amx = replace(batched, meta={"native_kernels": True, "batch_rows": [4, 8, 16, 32], "points": {
        "runtime/batch_rows/int4q8": [[n, per_b[b](n)] for n in widths for b in (4, 8, 16, 32)]}})
    assert batch_rows_time(amx, "runtime/batch_rows/int4q8", 32, layer) == pytest.approx(31 * 6e-6)
    assert batch_rows_time(amx, "runtime/batch_rows/int4q8", 16, layer) == pytest.approx(15 * 10e-6)
    k = "runtime/batch_rows/int4q8"
    assert batch_rows_time(shaped, k, 1, layer) == 0.0 == batch_rows_time(shaped, k, 4, layer)
    assert batch_rows_time(shaped, k, 8, layer) == pytest.approx(7 * 5e-6)
    assert batch_rows_time(shaped, k, 16, layer) == pytest.approx(15 * 10e-6)
    assert batch_rows_time(shaped, k, 12, layer) == pytest.approx((7 * 5e-6 + 15 * 10e-6) / 2)
    assert batch_rows_time(shaped, k, 32, layer) == pytest.approx(15 * 10e-6 + 16 * (15 * 10e-6 - 7 * 5e-6) / 8)
    assert batch_rows_time(shaped, k, 16, 2 * layer) == pytest.approx(15 * 20e-6)  # a wider layer's rows
    assert batch_rows_time(batched, k, 8, layer) == pytest.approx(7 * key(layer))  # no points: the key's fit
    assert batch_rows_time(shaped, "runtime/batch_rows/int8", 8, layer) == 0.0  # not profiled
    for B in (8, 32):
        assert predict_decode(cfg, shaped, "int4", context=64, batch=B, batch_act="q8")[1] == pytest.approx(
            one + head_stream + cfg.num_hidden_layers * batch_rows_time(shaped, k, B, layer)
            + (B - 1) * (head_rows + kv_row), rel=1e-6)
    # MoE: 8 experts top-2, 8 rows choose 8 * (1 - 0.75^8) = 7.2 experts of 16 / 7.2 rows each
    moe = ModelConfig(model_type="mixtral", vocab_size=32000, hidden_size=1024, intermediate_size=3584,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=3584)
    bf = HardwareProfile("box", "test", {"gemv/cpu/int4": LinearModel(0.0, 1 / 30e9, 0.99),
                                         "gemv/cpu/bf16": LinearModel(0.0, 1 / 30e9, 0.99),
                                         "memory/bandwidth/cpu": LinearModel(0.0, 1 / 40e9, 0.99),
                                         "gemm/cpu/int4": LinearModel(0.0, 1e-11, 0.99),
                                         "gemm/cpu/bf16": LinearModel(0.0, 1e-11, 0.99),
                                         "decode_rows/cpu/int4": LinearModel(0.0, 4e-12, 0.99)},
                     meta={"native_kernels": True})
    layers1 = predict_decode(moe, bf, "bf16", context=64, experts_format="int4")[0]
    layers8 = predict_decode(moe, bf, "bf16", context=64, experts_format="int4", batch=8)[0]
    eb = sizes.expert_bytes(moe, "int4")  # an int4 expert's bytes (its multiply-adds: 3 x 1024 x 3584 a row)
    active = 8 * (1 - 0.75 ** 8)
    expert = eb / 30e9 + (16 / active - 1) * 4e-12 * 3 * 1024 * 3584
    ffn8 = layers8[0][1] - (layers1[0][1] - 2 * eb / 30e9)  # the layer's experts at 8 rows (router etc. aside)
    router_rows = 7 * 1e-11 * 1024 * 8  # the router's rows at the bf16 GEMM rate (no decode_rows/cpu/bf16)
    assert ffn8 == pytest.approx(active * expert + router_rows, rel=1e-6)


def test_the_prompt_code_key_times_the_modules_prefill_never_the_native_steps_rows(monkeypatch):
    """_prefill_code_points times prompts through the modules' prefill, whose F.linear calls _EmptyMatmuls
    empties: with Plan.mixed_rows 256 (AVX-512 kernels that never dequantize int8 rows) its 256-token prompts
    ran as rows of the native step, matmuls and all, and took longer than its 1024-token ones (the fit's
    R^2 -2.1 priced SmolLM2's 512-token TTFT 0.39 s where it took 0.24-0.32, 2 Zen 5 cores). A shape whose
    longer prompt takes less time than its shorter one is refused rather than fitted."""
    from tiered.engine.llm import LLM
    from tiered.hardware import profiler
    from tiered.planner import auto

    # the plain rules' mixed rows as on such a machine (wherever the kernels are built), so that a prompt
    # could join the native step if the profiler let it
    monkeypatch.setattr(auto, "mixed_rows", lambda *a, **k: 4096 if kernels.available() else 0)
    joined, real = [], LLM._mixed_prefills
    monkeypatch.setattr(LLM, "_mixed_prefills", lambda self, *a: joined.extend(real(self, *a)) or real(self, *a))
    monkeypatch.setattr(profiler, "PREFILL_CODE_SHAPES", ((128, 256),))
    points = profiler._prefill_code_points("fp32", 1)
    assert [n for n, _ in points] == [T * (128 + 256) for T in profiler.PREFILL_CODE_TOKENS]
    assert joined == []  # no prompt ran as rows of the native step

    times = iter([2e-3, 1e-3])  # the longer prompt "faster": another path than the one timed
    monkeypatch.setattr(profiler, "median_time", lambda *a, **k: next(times))
    with pytest.raises(RuntimeError, match="not the modules' prefill"):
        profiler._prefill_code_points("fp32", 1)


def test_a_prompts_model_code_is_timed_without_its_matmuls_and_priced_per_layer():
    """runtime/prefill_code/<dtype> times a prefill with every F.linear and attention call an empty result
    of its shape (_EmptyMatmuls), and predict_prefill charges each layer its fit over the prompt's tokens x
    the layer's width (hidden + intermediate; an MoE layer's k routed copies of each token at the hidden
    size and its shared expert's intermediate) where the decode step's per-layer cost stood before:
    SmolLM2's 512-token bf16 prefill spent 59 of its 170 ms there on 2 AMX cores, its TTFT priced 29-36% fast."""
    from tiered.checkpoint.model_config import ModelConfig
    from tiered.hardware.profiler import _EmptyMatmuls
    from tiered.planner.cpu_predict import predict_prefill

    x, w = torch.randn(5, 8, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16)
    q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 6)
    with _EmptyMatmuls():
        y = F.linear(x, w)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        z = torch.nn.functional.silu(x)  # everything else runs
    assert (y.shape, y.dtype, o.shape) == ((5, 3), torch.bfloat16, (1, 2, 5, 6))
    assert torch.equal(z, F.silu(x))
    # a bf16 prompt's attention on the AMX kernel (a C++ call no TorchFunctionMode sees) is emptied too, as SDPA
    from tiered.models import layers

    amx = layers._bf16_attention
    qb, kb, vb = (torch.randn(1, 2, 40, 32, dtype=torch.bfloat16) for _ in range(3))
    with _EmptyMatmuls():
        assert layers._bf16_attention(qb, kb, vb) is None
        assert layers.attend(qb, kb, vb, None, True, 0.2, False).shape == (1, 2, 40, 32)
    assert layers._bf16_attention is amx
    with pytest.raises(ValueError), _EmptyMatmuls():
        raise ValueError
    assert layers._bf16_attention is amx

    cfg = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    base = {"gemm/cpu/bf16": LinearModel(0.0, 1e-12, 1.0), "gemv/cpu/bf16": LinearModel(0.0, 1 / 30e9, 1.0),
            "runtime/decode_step/bf16": LinearModel(2e-5, 4e-6, 1.0)}
    plain = HardwareProfile("box", "test", base)
    code = HardwareProfile("box", "test", dict(base, **{"runtime/prefill_code/bf16": LinearModel(7e-4, 1.5e-9, 0.9)}))
    for T in (128, 512):
        per_layer = 7e-4 + 1.5e-9 * T * (576 + 1536) - 4e-6  # in place of the decode step's per-layer cost
        assert predict_prefill(cfg, code, "bf16", T) == pytest.approx(predict_prefill(cfg, plain, "bf16", T)
                                                                      + 30 * per_layer, rel=1e-9)
    # fp32 activations take bf16's fit where only it is profiled
    assert op_time.prefill_code_time(code, "fp32", 1e6) == pytest.approx(7e-4 + 1.5e-3)
    assert op_time.prefill_code_time(plain, "bf16", 1e6) is None
    moe = ModelConfig(model_type="qwen2_moe", vocab_size=1000, hidden_size=256, intermediate_size=1024,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                      shared_expert_intermediate_size=512)
    gap = predict_prefill(moe, code, "bf16", 64) - predict_prefill(moe, plain, "bf16", 64)
    # (no native kernels: torch runs the experts, their GLU over the k routed rows' intermediate at the fit's slope)
    assert gap == pytest.approx(2 * (7e-4 + 1.5e-9 * 64 * (256 + 2 * 256 + 512 + 2 * 128) - 4e-6), rel=1e-9)


class _Readings:
    """A ComputeProbe stand-in: seconds() returns the next of `values`."""

    def __init__(self, values):
        self.values = iter(values)

    def seconds(self, repeats: int = 9) -> float:
        return next(self.values)


def test_the_compute_probe_is_read_around_each_compute_bound_keys_timings():
    """_Bench reads the compute-speed probe (ComputeProbe) before and after each COMPUTE_KEYS key's timing, and
    around the row keys' two later timings (_Bench.again), so each key carries the cores' speed of its own minutes;
    bandwidth-bound keys and a later timing that fails or times other points add no reading."""
    from tiered.hardware.profiler import COMPUTE_KEYS, _Bench

    assert "gemv/cpu/bf16".startswith(COMPUTE_KEYS) is False and "attn/cpu/fp32".startswith(COMPUTE_KEYS) is False
    pts = [(1e6, 1e-3), (2e6, 2e-3), (4e6, 4e-3)]
    b = _Bench(True, None, None)
    b.compute = _Readings([1.0, 1.2, 2.0, 2.2, 3.0, 3.2, 5.0, 5.2, 9.0, 9.2])
    b.attempt("gemv/cpu/bf16", lambda: pts)  # bandwidth-bound: no reading
    b.attempt("gemm/cpu/fp32", lambda: pts)
    b.attempt("decode_rows/cpu/int4q8", lambda: pts)
    runs = iter([pts, pts[:2]])
    b.attempt("expert_rows/cpu/bf16", lambda: next(runs))
    assert b.compute_seconds == {"gemm/cpu/fp32": [1.0, 1.2], "decode_rows/cpu/int4q8": [2.0, 2.2],
                                 "expert_rows/cpu/bf16": [3.0, 3.2]}
    b.again()  # decode_rows: 5.0, 5.2; expert_rows times other points: its readings left out
    assert b.compute_seconds["decode_rows/cpu/int4q8"] == [2.0, 2.2, 5.0, 5.2]
    assert b.compute_seconds["expert_rows/cpu/bf16"] == [3.0, 3.2]
    # each timing's (before, after), once (gemm_pack/cpu/<dtype> shares gemm's readings, not its own pair)
    assert b.compute_pairs == [(1.0, 1.2), (2.0, 2.2), (3.0, 3.2), (5.0, 5.2)]


def test_the_probe_swing_is_how_far_the_probe_moves_within_a_timing():
    """probe_swing: the mean |log(after / before)| of a speed probe across single timings; a machine that
    switches between two speeds within seconds swings by its switches (the mean, not the median); fewer than 3
    pairs say nothing."""
    from tiered.hardware.profiler import probe_swing

    steady = [(1.0, 1.01), (1.0, 0.99), (1.2, 1.2), (0.8, 0.81)]
    assert probe_swing(steady) == pytest.approx(sum(abs(math.log(a / b)) for b, a in steady) / len(steady))
    assert probe_swing(steady) < 0.01
    switching = steady + [(0.28, 0.5), (0.5, 0.28)]  # two of six straddle a switch
    assert probe_swing(switching) == pytest.approx((2 * math.log(0.5 / 0.28) + 4 * probe_swing(steady)) / 6)
    assert probe_swing(switching) > 0.15
    assert probe_swing(steady[:2]) is None and probe_swing([]) is None


def test_the_compute_ratios_are_the_probe_now_against_each_keys_minutes(monkeypatch):
    """cpu_compute_ratios: the probe's seconds now over each key's median reading (meta["compute_probe"]); None
    for a profile without those readings."""
    from tiered.hardware import profiler

    hw = HardwareProfile("box", "test", {"gemm/cpu/fp32": LinearModel(0.0, 1e-11, 0.99)},
                         meta={"compute_probe": {"seconds": {"gemm/cpu/fp32": 1e-3, "decode_rows/cpu/int4q8": 2e-3}}})
    monkeypatch.setattr(profiler.kernels, "available", lambda: True)
    assert profiler.cpu_compute_ratios(hw, _Readings([1.5e-3])) == pytest.approx(
        {"gemm/cpu/fp32": 1.5, "decode_rows/cpu/int4q8": 0.75})
    assert profiler.cpu_compute_ratios(replace(hw, meta={}), _Readings([1.5e-3])) is None


def test_a_plan_follows_the_cores_speed_of_its_moment(monkeypatch):
    """compute_now scales each compute-bound key's per-unit term by the compute probe's two readings (each the median
    of COMPUTE_SAMPLES timings) when both fall beyond 30% of that key's minutes on the same side (the one nearer 1),
    slower or faster, and a CPU plan's prompt price follows; readings that disagree or fall within 30%, a profile
    without the probe's readings, TIERED_COMPUTE_CHECK=0 and a profile already checked are left as they are;
    readings taken while other processes took the cores are not applied, with a note; a profile whose cores
    changed speed within single timings (its swing above COMPUTE_SWING) is not read at all, with a note."""
    from tiered.hardware import profiler
    from tiered.planner import auto
    from tiered.planner.cpu_predict import predict_prefill
    from test_plan import LLAMA70B

    monkeypatch.setattr(auto.contention, "others_share", lambda *a: 0.0)
    monkeypatch.setattr(auto, "COMPUTE_PAUSE_S", 0.0)
    monkeypatch.setattr(auto, "SWING_PAUSE_S", 0.0)
    monkeypatch.setattr(profiler, "ComputeProbe", lambda: None)
    base = get_preset("scheinfer-a")
    keys = [k for k in base.models if k.startswith(profiler.COMPUTE_KEYS)]
    assert "gemm/cpu/fp16" in keys
    hw = replace(base, meta=dict(base.meta, compute_probe={"seconds": {k: 1e-3 for k in keys}}))
    monkeypatch.setattr(auto, "COMPUTE_SAMPLES", 3)
    for seen, want in (([1.6, 1.4], 1.4), ([0.5, 0.6], 0.6), ([1.6, 0.6], None), ([1.6, 1.25], None),
                       ([5.0, 4.0, 1.0], None), ([5.0, 4.0, 3.5], 3.5)):
        # each reading the median of three timings: one outlier a reading moves nothing
        values = [x for r in seen for x in (r, 9.0 if r > 1 else 0.1, r)]
        monkeypatch.setattr(profiler, "cpu_compute_ratios", lambda p, probe=None: dict.fromkeys(keys, values.pop(0)))
        got = auto.compute_now(hw)
        if want is None:
            assert got is hw, seen
            continue
        assert got.meta["cpu_compute_ratios"] == dict.fromkeys(keys, want), seen
        for k in keys:
            assert got.models[k].beta == pytest.approx(hw.models[k].beta * want)
            assert got.models[k].alpha == hw.models[k].alpha
        assert all(got.models[k] == hw.models[k] for k in hw.models if k not in keys)
        assert auto.compute_now(got) is got  # checked once
        ttft = [predict_prefill(LLAMA70B, p, "bf16", 512, act_dtype="bf16") for p in (hw, got)]
        assert (ttft[1] > ttft[0]) == (want > 1)
    monkeypatch.setattr(profiler, "cpu_compute_ratios", lambda p, probe=None: dict.fromkeys(keys, 1.5))
    assert auto.compute_now(base) is base  # no probe readings in the profile
    monkeypatch.setenv("TIERED_COMPUTE_CHECK", "0")
    assert auto.compute_now(hw) is hw
    monkeypatch.delenv("TIERED_COMPUTE_CHECK")
    monkeypatch.setattr(auto.contention, "others_share", lambda *a: 0.6)
    got = auto.compute_now(hw)
    assert got.models == hw.models and "compute-speed check at planning not applied" in got.meta["notes"][-1]
    monkeypatch.setattr(auto.contention, "others_share", lambda *a: 0.0)
    # a profile whose cores changed speed within single timings (meta["compute_probe"]["swing"]): no reading taken
    read = []
    monkeypatch.setattr(profiler, "cpu_compute_ratios",
                        lambda p, probe=None: read.append(1) or dict.fromkeys(keys, 1.5))
    swings = replace(hw, meta=dict(hw.meta, compute_probe=dict(hw.meta["compute_probe"], swing=auto.COMPUTE_SWING * 2)))
    got = auto.compute_now(swings)
    assert got.models == hw.models and not read and "cpu_compute_ratios" not in got.meta
    assert "changed speed by" in got.meta["notes"][-1] and auto.compute_now(got).meta["notes"] == got.meta["notes"]
    monkeypatch.setenv("TIERED_COMPUTE_CHECK", "0")  # turned off: nothing said
    assert auto.compute_now(swings) is swings
    monkeypatch.delenv("TIERED_COMPUTE_CHECK")
    steady = replace(hw, meta=dict(hw.meta, compute_probe=dict(hw.meta["compute_probe"], swing=auto.COMPUTE_SWING / 2)))
    got = auto.compute_now(steady)  # the probe steady within timings: checked
    assert read and got.meta["cpu_compute_ratios"] == dict.fromkeys(keys, 1.5)


def test_speed_now_reads_the_cores_before_and_after_the_memory_check(monkeypatch):
    """speed_now takes compute_now's first reading before bandwidth_now and its second after it (whose ~0.35 s
    spaces them, where compute_now alone sleeps COMPUTE_PAUSE_S), and scales the memory-checked profile."""
    from tiered.hardware import profiler
    from tiered.planner import auto

    monkeypatch.setattr(auto.contention, "others_share", lambda *a: 0.0)
    monkeypatch.setattr(profiler, "ComputeProbe", lambda: None)
    monkeypatch.setattr(auto, "COMPUTE_SAMPLES", 1)
    monkeypatch.setattr(auto.time, "sleep", lambda s: pytest.fail("speed_now slept between its readings"))
    base = get_preset("scheinfer-a")
    keys = [k for k in base.models if k.startswith(profiler.COMPUTE_KEYS)]
    hw = replace(base, meta=dict(base.meta, compute_probe={"seconds": {k: 1e-3 for k in keys}}))
    order = []
    monkeypatch.setattr(profiler, "cpu_compute_ratios",
                        lambda p, probe=None: order.append("cores") or dict.fromkeys(keys, 2.0))
    memory = replace(hw, meta=dict(hw.meta, cpu_bandwidth_ratio=1.5))
    monkeypatch.setattr(auto, "bandwidth_now", lambda p: order.append("memory") or memory)
    got = auto.speed_now(hw)
    assert order == ["cores", "memory", "cores"]
    assert got.meta["cpu_bandwidth_ratio"] == 1.5 and got.meta["cpu_compute_ratios"] == dict.fromkeys(keys, 2.0)


def test_the_dequantized_int4_gemm_is_timed_at_the_rows_that_take_it():
    """gemm/cpu/int4's shapes (profiler.int4_gemm_shapes): the fit's first two weights at 2 and 4 x the rows past
    which a one-copy int4 prompt GEMM dequantizes; on a CPU with AMX only calls past quant/int4.AMX_ROWS do (the AMX
    GEMM takes those within), so there at 2 and 4 x AMX_ROWS: timed at 64 and 128 rows and extrapolated, oneDNN's
    GEMM priced a Gemma-3-4B-width file's 1024-token chunks' projections ~12% fast (2 AMX cores, 2026-12-07)."""
    from tiered.hardware.profiler import int4_gemm_shapes
    from tiered.quant.int4 import AMX_ROWS, dequantize_rows

    shapes = [(64, 1024, 1024), (128, 1024, 1024), (256, 2048, 2048), (64, 4096, 2048)]
    d = dequantize_rows()
    if d is None:
        pytest.skip("this machine's int4 kernel never dequantizes")
    assert int4_gemm_shapes(shapes) == [(2 * d, 1024, 1024), (4 * d, 1024, 1024), (2 * d, 2048, 2048),
                                        (4 * d, 2048, 2048)]
    rows = max(d, AMX_ROWS)
    assert int4_gemm_shapes(shapes, amx=True) == [(2 * rows, 1024, 1024), (4 * rows, 1024, 1024),
                                                  (2 * rows, 2048, 2048), (4 * rows, 2048, 2048)]
