"""ScheInfer planner: cost model (Eq. 4-12, 15), solvers (Eq. 13-15) and the four-stream simulator.

The brute-force references here are written independently of tiered.planner (numpy recurrence of
Eq. 5 over a grid), so they check the closed forms, not just re-run them.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiered.errors import BudgetError, ConfigError
from tiered.hardware.profile import HardwareProfile, LinearModel
from tiered.planner.cost_model import (CostParams, LayerShape, SliceRates, StageTimes, completion_times, cost_params,
                                       decode_layer_time, gemm_times, gpu_finish_closed_form, gpu_finish_pipeline,
                                       layer_time, moe_layer_shape, prompt_gemm_times, prompt_layer_time,
                                       roofline_params, schedule_case)
from tiered.planner.scheinfer import assign_gpu_memory, ffn_gpu_budget, rgg_grid, solve_n_g, solve_r_cg
from tiered.planner.simulator import (CPU, GPU, H2D, LAUNCH, SimulationError, Task, layer_tasks, simulate,
                                      simulate_layer, simulate_stack, stack_tasks)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ScheInfer Table I, testbed A, INT4 (alpha_G, beta_G, alpha_C, beta_C, alpha_C2G, beta_C2G, t_launch).
TESTBED_A_INT4 = CostParams(4.7e-6, 8.1e-13, 1.1e-5, 5.4e-12, 3.0e-6, 2.6e-11, 4.4e-5)
LLAMA70B = LayerShape(tokens=1, d_model=8192, d_ff=28672, n_gemms=3, bytes_per_weight=0.5)


def log_uniform(lo: float, hi: float, zero: bool = False):
    s = st.floats(math.log10(lo), math.log10(hi)).map(lambda e: 10.0 ** e)
    return st.one_of(st.just(0.0), s) if zero else s


params_st = st.builds(CostParams, alpha_gpu=log_uniform(1e-8, 1e-4, zero=True), beta_gpu=log_uniform(1e-14, 1e-10),
                      alpha_cpu=log_uniform(1e-8, 1e-4, zero=True), beta_cpu=log_uniform(1e-13, 1e-9),
                      alpha_c2g=log_uniform(1e-7, 1e-4, zero=True), beta_c2g=log_uniform(1e-12, 1e-9),
                      t_launch=log_uniform(1e-6, 1e-4, zero=True))
shape_st = st.builds(LayerShape, tokens=st.sampled_from([1, 2, 4, 16, 64, 256, 1024]),
                     d_model=st.sampled_from([256, 1024, 4096, 8192]), d_ff=st.sampled_from([512, 2816, 14336, 28672]),
                     n_gemms=st.sampled_from([1, 2, 3, 6, 24]), bytes_per_weight=st.sampled_from([0.5, 1.0, 2.0]))
times_st = st.builds(StageTimes, *(st.one_of(st.just(0.0), st.floats(1e-7, 1e-2)) for _ in range(4)))


def grid_times(shape: LayerShape, r_gg: float, p: CostParams, r: np.ndarray) -> np.ndarray:
    """t_fin over an array of r_CG by the Eq. 5 recurrence, vectorized; an independent reference."""
    r_cc = np.clip(1.0 - r_gg - r, 0.0, None)
    s = lambda x: (np.asarray(x) > 0).astype(float)  # noqa: E731
    n, w = shape.macs_per_gemm, shape.weight_bytes
    tl = (2 * s(r) + s(r_gg)) * p.t_launch
    tc2g = p.alpha_c2g * s(r) + r * w * p.beta_c2g
    tg = p.alpha_gpu * (s(r) + s(r_gg)) + (r + r_gg) * n * p.beta_gpu
    tc = p.alpha_cpu * s(r_cc) + r_cc * n * p.beta_cpu
    tau_l = tau_c = tau_g = np.zeros_like(r)
    for _ in range(shape.n_gemms):
        tau_l = tau_l + tl
        tau_c = np.maximum(tau_l, tau_c) + tc2g
        tau_g = np.maximum(tau_c, tau_g) + tg
    return np.maximum(tau_g, shape.n_gemms * tc)


# ---------------------------------------------------------------- cost model (Eq. 4-12, 15)

def test_gemm_times_follow_eq4_by_hand():
    p, sh = TESTBED_A_INT4, LLAMA70B
    n, w = 1 * 8192 * 28672, 8192 * 28672 * 0.5
    t = gemm_times(sh, SliceRates(0.5, 0.3, 0.2), p)
    assert t.launch == pytest.approx(3 * 4.4e-5)
    assert t.copy == pytest.approx(3.0e-6 + 0.3 * w * 2.6e-11)
    assert t.gpu == pytest.approx(2 * 4.7e-6 + 0.5 * n * 8.1e-13)
    assert t.cpu == pytest.approx(1.1e-5 + 0.5 * n * 5.4e-12)
    # sgn form: no CG, no copy start-up and one launch (GG kernel) only
    t0 = gemm_times(sh, SliceRates(0.8, 0.0, 0.2), p)
    assert t0.copy == 0.0 and t0.launch == pytest.approx(4.4e-5)
    assert gemm_times(sh, SliceRates(1.0, 0.0, 0.0), p) == StageTimes(0.0, 0.0, 0.0, 1.1e-5 + n * 5.4e-12)


@given(shape_st, params_st, st.floats(0, 1), st.floats(0, 1))
@FAST
def test_prompt_times_with_no_moved_tokens_are_decode_times(shape, p, a, b):
    rates = SliceRates.from_gg_cg(a * b, (1 - a * b) * a)
    assert prompt_gemm_times(shape, rates, 0, p) == gemm_times(shape, rates, p)


def test_prompt_times_eq15_resolutions():
    p, sh = TESTBED_A_INT4, LLAMA70B.with_tokens(100)
    rates = SliceRates(0.5, 0.25, 0.25)
    t = prompt_gemm_times(sh, rates, 40, p)
    mh = 8192 * 28672
    assert t.launch == pytest.approx(5 * 4.4e-5)                               # 2 (CG) + 2 (CG') + 1 (GG)
    assert t.copy == pytest.approx(2 * 3.0e-6 + 0.75 * mh * 0.5 * 2.6e-11)   # CG + CG' bytes, not n_W
    assert t.gpu == pytest.approx(3 * 4.7e-6 + (100 * 0.5 + 40 * 0.5) * mh * 8.1e-13)
    assert t.cpu == pytest.approx(1.1e-5 + 60 * 0.5 * mh * 5.4e-12)
    assert prompt_gemm_times(sh, rates, 100, p).cpu == 0.0
    with pytest.raises(ConfigError):
        prompt_gemm_times(sh, rates, 101, p)


@given(times_st, st.integers(1, 30))
@FAST
def test_recurrence_pipeline_and_case_forms_agree(times, n):
    tau_g = completion_times(times, n).gpu[-1]
    assert gpu_finish_pipeline(times, n) == pytest.approx(tau_g, rel=1e-12, abs=1e-18)
    assert gpu_finish_closed_form(times, n) == pytest.approx(tau_g, rel=1e-12, abs=1e-18)
    assert layer_time(times, n) == pytest.approx(max(tau_g, completion_times(times, n).cpu[-1]), rel=1e-12, abs=1e-18)


def test_moe_layer_shape_s1():
    dec = moe_layer_shape(1, 4096, 14336, n_experts=8, top_k=2, bytes_per_weight=0.5)
    assert (dec.tokens, dec.n_gemms, dec.n_matrices) == (1, 6, 24)
    assert dec.layer_bytes == 24 * 4096 * 14336 * 0.5
    pre = moe_layer_shape(1024, 4096, 14336, 8, 2, 0.5)
    assert (pre.tokens, pre.n_gemms) == (256, 24)
    with pytest.raises(ConfigError):
        moe_layer_shape(4, 64, 64, 2, 3, 2.0)


def test_cost_params_from_profile_and_presets():
    prof = HardwareProfile("t", "hand-built", {
        "gemm/gpu/int4": LinearModel(4.7e-6, 8.1e-13), "gemm/cpu/int4": LinearModel(1.1e-5, 5.4e-12),
        "copy/h2d_pinned": LinearModel(3.0e-6, 2.6e-11), "launch/gpu": LinearModel(4.4e-5, 0.0)})
    assert cost_params(prof, "int4") == TESTBED_A_INT4
    with pytest.raises(ConfigError):
        cost_params(prof, "fp16")
    # a two-regime profile (gemm fitted at many tokens, gemv at one): decode is priced by the bytes
    both = HardwareProfile("t2", "hand-built", dict(prof.models, **{
        "gemm/gpu/int4": LinearModel(1e-5, 2e-14), "gemv/gpu/int4": LinearModel(2e-6, 1 / 600e9)}))
    dec, pre = cost_params(both, "int4", LLAMA70B), cost_params(both, "int4", LLAMA70B.with_tokens(1024))
    assert dec.beta_gpu == pytest.approx(0.5 / 600e9) and dec.alpha_gpu == 1e-5
    assert pre.beta_gpu == pytest.approx(2e-14)
    assert dec.beta_cpu == pre.beta_cpu == 5.4e-12            # no gemv on the CPU side: the line alone
    presets = pytest.importorskip("tiered.hardware.presets")
    a = presets.get_preset("scheinfer-a")
    assert cost_params(a, "int4") == TESTBED_A_INT4
    for T in (1, 1024):  # Table I's lines lie above the spec-sheet bandwidth floors: unchanged
        assert cost_params(a, "int4", LLAMA70B.with_tokens(T)) == TESTBED_A_INT4


def test_roofline_params_amortize_the_gemv_line():
    p = roofline_params(TESTBED_A_INT4, 64, gpu_peak_macs=2e13, cpu_peak_macs=5e11)
    assert p.beta_gpu == pytest.approx(max(1 / 2e13, 8.1e-13 / 64))
    assert p.beta_cpu == pytest.approx(1 / 5e11)
    assert roofline_params(TESTBED_A_INT4, 1, 1e15, 1e15) == TESTBED_A_INT4


# ---------------------------------------------------------------- simulator vs closed forms

CASES = {  # (shape, rates) chosen to land in each of ScheInfer's schedules, Table I testbed A INT4
    1: (LLAMA70B, SliceRates(0.7, 0.3, 0.0)),                               # decode, big CG: copy dominates
    2: (LLAMA70B.with_tokens(512), SliceRates(0.2, 0.05, 0.75)),            # prefill: GPU GEMM dominates
    3: (LayerShape(1, 512, 1024, 3, 0.5), SliceRates(0.0, 0.02, 0.98)),      # small decode: launches dominate
}


@pytest.mark.parametrize("case", [1, 2, 3])
def test_simulator_equals_closed_form_in_each_case(case):
    shape, rates = CASES[case]
    t = gemm_times(shape, rates, TESTBED_A_INT4)
    n = shape.n_gemms
    assert schedule_case(t) == case
    eq = {1: t.launch + n * t.copy + t.gpu,              # Eq. 10
          2: t.launch + t.copy + n * t.gpu,              # Eq. 11
          3: n * t.launch + t.copy + t.gpu}[case]        # Eq. 12
    tl = simulate(layer_tasks(t, n))
    assert tl.end(f"gpu{n}") == pytest.approx(eq, rel=1e-12)
    assert gpu_finish_closed_form(t, n) == pytest.approx(eq, rel=1e-12)
    rec = completion_times(t, n)
    for i in range(n):  # every timestamp of Eq. 5, not just the last
        assert tl.end(f"launch{i + 1}") == pytest.approx(rec.launch[i], rel=1e-12)
        assert tl.end(f"copy{i + 1}") == pytest.approx(rec.copy[i], rel=1e-12)
        assert tl.end(f"gpu{i + 1}") == pytest.approx(rec.gpu[i], rel=1e-12)
        assert tl.end(f"cpu{i + 1}") == pytest.approx(rec.cpu[i], rel=1e-12)
    assert tl.end("join") == pytest.approx(decode_layer_time(shape, rates, TESTBED_A_INT4), rel=1e-12)
    assert tl.busy(H2D) == pytest.approx(n * t.copy) and tl.busy(CPU) == pytest.approx(n * t.cpu)


@given(times_st, st.integers(1, 12))
@FAST
def test_simulator_equals_recurrence_for_any_stage_times(times, n):
    assert simulate_layer(times, n) == pytest.approx(layer_time(times, n), rel=1e-12, abs=1e-18)


@given(st.lists(st.tuples(times_st, st.integers(1, 6)), min_size=1, max_size=5), st.floats(0, 1e-4))
@FAST
def test_stack_of_layers_is_the_sum_of_layers(layers, join):
    want = sum(max(gpu_finish_pipeline(t, n) + join, n * t.cpu + join) if join else layer_time(t, n)
               for t, n in layers)
    assert simulate_stack(layers, join) == pytest.approx(want, rel=1e-12, abs=1e-15)
    tl = simulate(stack_tasks(layers, join))
    for j in range(1, len(layers)):  # layer j starts after layer j-1's join, on every stream
        first = [tl.spans[f"L{j}.{k}1"].start for k in ("launch", "copy", "gpu", "cpu")]
        assert min(first) >= tl.end(f"L{j - 1}.join")


def test_simulator_rejects_bad_graphs():
    with pytest.raises(SimulationError, match="unknown"):
        simulate([Task("a", GPU, 1.0, ("b",))])
    with pytest.raises(SimulationError, match="duplicate"):
        simulate([Task("a", GPU, 1.0), Task("a", CPU, 1.0)])
    with pytest.raises(SimulationError, match="deadlock"):   # b waits on c, which is behind b on its stream
        simulate([Task("b", GPU, 1.0, ("c",)), Task("c", GPU, 1.0)])
    tl = simulate([Task("x", LAUNCH, 1.0), Task("y", H2D, 2.0, ("x",)), Task("z", H2D, 1.0)])
    assert (tl.spans["y"].start, tl.spans["z"].start, tl.makespan) == (1.0, 3.0, 4.0)  # in order per stream


# ---------------------------------------------------------------- stage 1: edge points (Eq. 13)

@given(shape_st, params_st, st.sampled_from([0.0, 0.0, 0.125, 0.25, 0.5, 0.9375, 1.0]))
@FAST
def test_edge_point_solver_matches_brute_force(shape, p, r_gg):
    sol = solve_r_cg(shape, r_gg, p)
    hi = 1.0 - r_gg
    assert sol.rates.r_gg == r_gg and 0.0 <= sol.rates.r_cg <= hi + 1e-12
    assert sol.time == pytest.approx(decode_layer_time(shape, sol.rates, p), rel=1e-12)
    assert sol.time == pytest.approx(grid_times(shape, r_gg, p, np.array([sol.rates.r_cg]))[0], rel=1e-9)
    grid = np.linspace(0.0, hi, 2001)
    brute = grid_times(shape, r_gg, p, grid)
    # never worse than the grid, and the grid gets within one step's worth of slope of it
    assert sol.time <= brute.min() * (1 + 1e-9) + 1e-18
    slope = shape.n_gemms * (shape.weight_bytes * p.beta_c2g + shape.macs_per_gemm * (p.beta_gpu + p.beta_cpu))
    assert brute.min() <= (sol.time + slope * (hi / 2000) * 1.0001) * (1 + 1e-9)


def test_edge_point_solver_balances_cpu_and_copy_on_testbed_a():
    sol = solve_r_cg(LLAMA70B, 0.0, TESTBED_A_INT4)
    assert 0.0 < sol.rates.r_cg < 1.0 and sol.case == 1          # decode: PCIe-bound GPU side
    t = gemm_times(LLAMA70B, sol.rates, TESTBED_A_INT4)
    assert gpu_finish_pipeline(t, 3) == pytest.approx(3 * t.cpu, rel=1e-9)   # optimum at the crossing x1
    for fixed in (0.0, 0.25, 0.5, 0.75):
        assert sol.time <= decode_layer_time(LLAMA70B, SliceRates.from_gg_cg(0.0, fixed), TESTBED_A_INT4)


# ---------------------------------------------------------------- stage 2: greedy GPU memory (Eq. 14)

layers_st = st.lists(st.builds(LayerShape, tokens=st.sampled_from([1, 2, 8]), d_model=st.sampled_from([1024, 4096]),
                               d_ff=st.sampled_from([2816, 14336]), n_gemms=st.sampled_from([3, 6]),
                               bytes_per_weight=st.sampled_from([0.5, 2.0])), min_size=1, max_size=6)


@given(layers_st, params_st, st.floats(0, 1.2), st.floats(0, 1), st.sampled_from([1, 4, 8, (0.25, 0.5, 1.0)]))
@FAST
def test_greedy_fits_budget_and_is_monotone_in_it(layers, p, frac, shrink, grid):
    total = sum(s.layer_bytes for s in layers)
    b_big = frac * total
    b_small = shrink * b_big
    big, small = (assign_gpu_memory(layers, p, b, grid) for b in (b_big, b_small))
    values = set(rgg_grid(grid)) | {0.0}
    for a, b in ((big, b_big), (small, b_small)):
        used = sum(r.r_gg * s.layer_bytes for r, s in zip(a.rates, layers))
        assert used == pytest.approx(a.used_bytes) and used <= b * (1 + 1e-12) + 1e-6
        assert all(r.r_gg in values for r in a.rates)
        for r, s, t in zip(a.rates, layers, a.times):  # r_CG is stage 1's optimum at the chosen r_GG
            assert t == pytest.approx(solve_r_cg(s, r.r_gg, p).time) == pytest.approx(decode_layer_time(s, r, p))
    assert big.total_time <= small.total_time * (1 + 1e-9)


@given(layers_st, params_st)
@FAST
def test_greedy_edge_budgets(layers, p):
    none = assign_gpu_memory(layers, p, 0.0)
    assert all(r.r_gg == 0.0 for r in none.rates) and none.used_bytes == 0.0
    assert none.total_time == pytest.approx(sum(solve_r_cg(s, 0.0, p).time for s in layers))
    full = assign_gpu_memory(layers, p, 10 * sum(s.layer_bytes for s in layers), grid=8)
    for r, s, t in zip(full.rates, layers, full.times):   # unlimited: no higher grid value would still help
        assert all(solve_r_cg(s, v, p).time >= t * (1 - 1e-12) for v in rgg_grid(8) if v > r.r_gg)


def test_greedy_spends_memory_where_it_saves_most_per_byte():
    big, small = LLAMA70B, LayerShape(1, 4096, 11008, 3, 0.5)
    a = assign_gpu_memory([small, big], TESTBED_A_INT4, budget_bytes=0.5 * big.layer_bytes, grid=16)
    assert a.used_bytes <= 0.5 * big.layer_bytes
    assert a.total_time < assign_gpu_memory([small, big], TESTBED_A_INT4, 0.0).total_time
    with pytest.raises(BudgetError):
        assign_gpu_memory([small], TESTBED_A_INT4, -1.0)


def test_ffn_gpu_budget_s5():
    assert ffn_gpu_budget(24e9, non_ffn_bytes=6e9, kv_cache_bytes=1e9, activation_bytes=0.5e9,
                          staging_bytes=0.5e9, margin=0.05) == pytest.approx(24e9 * 0.95 - 8e9)
    with pytest.raises(BudgetError):
        ffn_gpu_budget(4e9, non_ffn_bytes=6e9)


# ---------------------------------------------------------------- token assignment (Eq. 15)

@given(shape_st.map(lambda s: s.with_tokens(min(s.tokens, 300))), params_st,
       st.floats(0, 1), st.floats(0, 1))
@FAST
def test_token_assignment_equals_brute_force(shape, p, a, b):
    rates = SliceRates.from_gg_cg(a * (1 - b), b * (1 - a * (1 - b)))
    ta = solve_n_g(shape, rates, p)
    brute = [prompt_layer_time(shape, rates, k, p) for k in range(shape.tokens + 1)]
    assert ta.time == pytest.approx(min(brute), rel=1e-12)
    assert ta.time == pytest.approx(brute[ta.n_g], rel=1e-15)


def test_token_assignment_beats_both_ends_when_the_model_says_so():
    prompt = LLAMA70B.with_tokens(256)
    rates = SliceRates(0.2, 0.05, 0.75)                         # a decode optimum at 24 GB, testbed A
    ta = solve_n_g(prompt, rates, TESTBED_A_INT4)
    t0, tT = (prompt_layer_time(prompt, rates, k, TESTBED_A_INT4) for k in (0, 256))
    assert 0 < ta.n_g < 256 and ta.time < t0 and ta.time < tT
    # GPU far faster than the CPU at prefill (roofline regime, S2), so that even one token's CPU
    # GEMMs outlast the whole GPU side: move every token
    fast_gpu = roofline_params(TESTBED_A_INT4, 256, gpu_peak_macs=4e13, cpu_peak_macs=2e10)
    assert solve_n_g(prompt, SliceRates(0.7, 0.3, 0.0), fast_gpu).n_g == 256
    # nothing on the CPU, or a copy too slow to pay for: keep every token where it is
    assert solve_n_g(prompt, SliceRates(0.0, 0.5, 0.5), TESTBED_A_INT4).n_g == 0
    slow_link = dataclasses.replace(TESTBED_A_INT4, beta_c2g=1e-7)
    assert solve_n_g(LLAMA70B.with_tokens(4), SliceRates(0.7, 0.0, 0.3), slow_link).n_g == 0


# ------------------------------------------------------------------ beyond the paper: the host's shared DRAM
def test_shared_dram_floors_a_layer_and_leaves_scheinfers_model_without_it():
    """CostParams.beta_dram: a layer takes at least (CC + CG bytes) * beta_dram, since the CPU's CC
    reads and the link's CG copies draw on one host memory; at 0 the layer time is Eq. 4-5's. The
    floor does not depend on how the host rows split, so stage 1 keeps its edge-point optimum."""
    from tiered.planner.cost_model import shared_dram_time

    shape = LayerShape(1, 4096, 14336, 3, 2.0)
    p = CostParams(2e-5, 3e-13, 1e-5, 1e-11, 7e-6, 1.8e-11, 1e-6)           # CPU 100 GB/s, link 55 GB/s
    shared = dataclasses.replace(p, beta_dram=1 / 105e9)                      # both from one 105 GB/s DRAM
    rates = SliceRates.from_gg_cg(0.16, 0.29)
    assert decode_layer_time(shape, rates, p) == layer_time(gemm_times(shape, rates, p), 3)
    host = 0.84 * 3 * shape.weight_bytes
    assert shared_dram_time(shape, 0.84, shared) == pytest.approx(host / 105e9)
    assert decode_layer_time(shape, rates, shared) == pytest.approx(max(decode_layer_time(shape, rates, p),
                                                                        host / 105e9))
    assert decode_layer_time(shape, rates, shared) > 1.1 * decode_layer_time(shape, rates, p)  # it binds here
    # a prompt: the CPU reads the CC rows for its tokens and the link ships CG, plus CC for CG'
    T = shape.with_tokens(64)
    assert prompt_layer_time(T, rates, 0, shared) >= shared_dram_time(T, rates.r_cc + rates.r_cg, shared)
    assert prompt_layer_time(T, rates, 8, shared) >= shared_dram_time(T, 2 * rates.r_cc + rates.r_cg, shared)
    assert roofline_params(shared, 8, 1e15, 1e12).beta_dram == shared.beta_dram
    sol = solve_r_cg(shape, 0.16, shared)
    assert sol.time == pytest.approx(min(decode_layer_time(shape, SliceRates.from_gg_cg(0.16, r), shared)
                                         for r in np.linspace(0, 0.84, 169)), rel=1e-6)


def test_cost_params_share_dram_only_beyond_the_llc():
    models = {"gemm/gpu/bf16": LinearModel(2e-5, 2e-15, 1.0), "gemm/cpu/bf16": LinearModel(0.0, 1e-12, 1.0),
              "copy/h2d_pinned": LinearModel(7e-6, 1.8e-11, 1.0), "launch/gpu": LinearModel(5e-6, 0.0),
              "memory/bandwidth_dram/cpu": LinearModel(0.0, 1 / 105e9, 1.0)}
    hw = HardwareProfile("h", "test", models, 80 * 2**30, 128 * 2**30, meta={"llc_bytes": 64 * 2**20})
    shape = LayerShape(1, 4096, 14336, 3, 2.0)
    assert cost_params(hw, "bf16", shape, cpu_working_set=2.8e9).beta_dram == pytest.approx(1 / 105e9)
    assert cost_params(hw, "bf16", shape, cpu_working_set=32 * 2**20).beta_dram == 0.0
    assert cost_params(hw, "bf16", shape).beta_dram == 0.0


def test_a_sliced_dense_plan_prices_its_host_round_trip_and_keeps_one_ffn_of_staging():
    """latency_dense: each sliced layer with CC rows pays the activations' D2H, the CC output's H2D
    and a task hop (sliced_layer_syncs); the staging the plan keeps is the runtime's, the largest CG
    plus the largest CC rows (at most one FFN and two rows), and the rest of the budget holds GG rows."""
    from tiered.checkpoint.model_config import ModelConfig
    from tiered.memory import sizes
    from tiered.planner.latency_dense import sliced_layer_syncs
    from tiered.planner.make import make_plan

    cfg = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
                               "intermediate_size": 14336, "num_hidden_layers": 8, "num_attention_heads": 32,
                               "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096})
    from pathlib import Path

    hw = HardwareProfile.load(Path(__file__).resolve().parents[1] / "benchmarks" / "reference" / "h100-2026-11-26"
                              / "profile_quick.json")
    plan = make_plan(cfg, hw, gpu_memory=2 * 2**30, prompt_tokens=32, gen_tokens=32, context_tokens=1024,
                     precision="bf16", graphs=True)
    sliced = [l for l in plan.layers if l.r_gg < 1]
    assert sliced and plan.memory["gpu"] <= 2 * 2**30
    ffn = sizes.ffn_bytes(cfg, "bf16")
    share = max(l.r_cg for l in sliced) + max(l.r_cc for l in sliced)
    assert share <= 1 + 1e-9
    gg = sum(l.r_gg for l in plan.layers) * ffn
    assert gg > 0.3 * ffn  # the second FFN of staging the plan used to keep holds GG rows now
    free = dataclasses.replace(hw, models={k: v for k, v in hw.models.items()
                                           if k not in ("copy/d2h_pageable", "copy/h2d_pageable", "runtime/task")})
    base = make_plan(cfg, free, gpu_memory=2 * 2**30, prompt_tokens=32, gen_tokens=32, context_tokens=1024,
                     precision="bf16", graphs=True)
    syncs = sum(sliced_layer_syncs(hw, 4096 * 2, 1) for l in plan.layers if l.r_cc > 0)
    assert syncs > 0
    assert 1 / plan.predicted_decode_tokens_per_s == pytest.approx(1 / base.predicted_decode_tokens_per_s + syncs,
                                                                   rel=1e-6)
