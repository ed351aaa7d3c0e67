"""The dispatcher against Fiddler's Algorithm 1 (ALGORITHMS.md 2.b):

    resident                                  -> run where the weights are
    cpu_lat(s) > gpu_lat(s) + trans_lat()     -> copy the weights, run on the accelerator
    else                                      -> run on the CPU
    equivalently: CPU iff s <= s* = (L_gpu + L_xfer - a_cpu) / (c_cpu - c_gpu)
"""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tiered.runtime.dispatcher import COPY, CPU, RESIDENT, LatencyModel, choose_path

EXPERT_BYTES = 3 * 4096 * 14336 * 2  # one Mixtral-8x7B expert in 16 bit (ALGORITHMS.md 2.b)


def fiddler(c_cpu: float, l_gpu: float, l_xfer_bytes_per_s: float) -> LatencyModel:
    """Fiddler's model: gpu_lat constant, cpu_lat proportional to s, transfer = bytes / bandwidth."""
    return LatencyModel(cpu_alpha=0.0, cpu_beta=c_cpu, gpu_alpha=l_gpu, gpu_beta=0.0, h2d_alpha=0.0,
                        h2d_bandwidth=l_xfer_bytes_per_s)


# Env-1-like numbers: CPU expert 3 ms/token, GPU expert 1 ms, PCIe 3 at ~12 GB/s (352 MB -> ~29 ms).
ENV1 = fiddler(c_cpu=3e-3, l_gpu=1e-3, l_xfer_bytes_per_s=12e9)


@pytest.mark.parametrize("tokens", [1, 2, 100, 10_000])
def test_resident_expert_runs_resident(tokens):
    """Case (a): weights on the accelerator, whatever the latencies."""
    assert choose_path(tokens, True, EXPERT_BYTES, ENV1) == RESIDENT
    cpu_always_wins = LatencyModel(0.0, 0.0, 1.0, 1.0, 1.0, 1.0)
    assert choose_path(tokens, True, EXPERT_BYTES, cpu_always_wins) == RESIDENT


def test_few_tokens_run_on_cpu_many_are_copied():
    """Decode (s = 1) stays on the CPU; a long prefill (many tokens per expert) copies the weights."""
    assert choose_path(1, False, EXPERT_BYTES, ENV1) == CPU
    assert choose_path(1000, False, EXPERT_BYTES, ENV1) == COPY


def test_copy_iff_cpu_slower_than_gpu_plus_transfer():
    lat = LatencyModel(cpu_alpha=1e-3, cpu_beta=2e-3, gpu_alpha=4e-3, gpu_beta=1e-4, h2d_alpha=5e-4,
                       h2d_bandwidth=1e9)
    nbytes = 10**7  # 10 ms on the link
    for s in range(1, 50):
        cpu, gpu_plus_copy = lat.cpu_lat(s), lat.gpu_lat(s) + lat.transfer_lat(nbytes)
        want = COPY if cpu > gpu_plus_copy else CPU
        assert choose_path(s, False, nbytes, lat) == want
    assert choose_path(1, False, nbytes, lat) == CPU
    assert choose_path(49, False, nbytes, lat) == COPY


def test_tie_goes_to_cpu():
    """Algorithm 1 copies only when the CPU is strictly slower."""
    lat = LatencyModel(cpu_alpha=0.0, cpu_beta=1.0, gpu_alpha=1.0, gpu_beta=0.0, h2d_alpha=1.0,
                       h2d_bandwidth=float("inf"))
    assert lat.cpu_lat(2) == lat.gpu_lat(2) + lat.transfer_lat(123)
    assert choose_path(2, False, 123, lat) == CPU
    assert choose_path(3, False, 123, lat) == COPY


def test_fiddler_threshold_formula():
    """s* = (L_gpu + L_xfer) / c_cpu for Fiddler's model (no CPU intercept, flat GPU time)."""
    l_xfer = EXPERT_BYTES / 12e9
    assert ENV1.cpu_threshold(EXPERT_BYTES) == pytest.approx((1e-3 + l_xfer) / 3e-3)
    assert ENV1.transfer_lat(EXPERT_BYTES) == pytest.approx(l_xfer)


def test_threshold_when_cpu_time_does_not_grow_faster_than_gpu_time():
    """With equal slopes the choice does not depend on s: the threshold is +inf (always CPU) or -inf
    (never CPU), and must agree with choose_path."""
    cheap_cpu = LatencyModel(1e-3, 0.0, 1e-3, 0.0, 1e-3, 1e9)
    assert cheap_cpu.cpu_threshold(100) == math.inf
    assert all(choose_path(s, False, 100, cheap_cpu) == CPU for s in (1, 10, 10**6))
    slow_cpu = LatencyModel(1.0, 0.0, 1e-3, 0.0, 1e-3, 1e9)  # CPU has a large fixed cost
    assert slow_cpu.cpu_threshold(100) == -math.inf
    assert all(choose_path(s, False, 100, slow_cpu) == COPY for s in (1, 10, 10**6))


_pos = st.floats(min_value=0.0, max_value=1.0, allow_nan=False, allow_infinity=False)
_slope = st.one_of(st.just(0.0), st.floats(min_value=1e-7, max_value=1e-1))


@st.composite
def latency_models(draw) -> LatencyModel:
    """Random fitted models with cpu_beta >= gpu_beta (the CPU's time per token is not below the
    accelerator's: the regime Algorithm 1 describes, and calibration's non-negative fitted slopes can be equal),
    some with a prompt's per-call intercept on the CPU from some row count on (ExpertLatency's gemm_big step)."""
    gpu_beta = draw(_slope)
    cpu_beta = gpu_beta + draw(_slope)
    step = draw(st.one_of(st.just((0.0, math.inf)), st.tuples(_pos, st.integers(min_value=1, max_value=10_000))))
    prompt_beta = draw(st.one_of(st.none(), _slope.map(lambda d: gpu_beta + d)))  # past the step, >= the GPU's
    return LatencyModel(cpu_alpha=draw(_pos), cpu_beta=cpu_beta, gpu_alpha=draw(_pos), gpu_beta=gpu_beta,
                        h2d_alpha=draw(_pos), h2d_bandwidth=draw(st.floats(min_value=1e6, max_value=1e12)),
                        disk_alpha=draw(_pos), disk_bandwidth=draw(st.floats(min_value=1e6, max_value=1e12)),
                        cpu_prompt_alpha=step[0], cpu_prompt_rows=step[1], cpu_prompt_beta=prompt_beta)


@settings(max_examples=300, deadline=None)
@given(lat=latency_models(), s=st.integers(min_value=1, max_value=100_000),
       nbytes=st.integers(min_value=1, max_value=10**10))
def test_threshold_equivalent_to_algorithm_1(lat, s, nbytes):
    """choose_path(s) == CPU  <=>  s <= cpu_threshold(nbytes), away from float rounding at the boundary."""
    s_star = lat.cpu_threshold(nbytes)
    if math.isfinite(s_star):
        assume(abs(s - s_star) > 1e-9 * max(1.0, abs(s_star)))
    cpu, gpu_plus_copy = lat.cpu_lat(s), lat.gpu_lat(s) + lat.transfer_lat(nbytes)
    assume(abs(cpu - gpu_plus_copy) > 1e-12 * max(cpu, gpu_plus_copy))  # not a tie up to rounding
    got = choose_path(s, False, nbytes, lat)
    assert (got == CPU) == (s <= s_star)
    assert choose_path(s, True, nbytes, lat) == RESIDENT


def test_a_prompts_cpu_intercept_moves_the_threshold_to_its_step():
    """LatencyModel.cpu_prompt_alpha: from cpu_prompt_rows tokens the CPU side pays it once more (a prompt's
    GEMMs packing big weights, gemm_big's intercept); where the line alone would keep the CPU past that
    step and the step makes it lose, s* lies just below the step; a step it still wins past changes nothing."""
    line = LatencyModel(cpu_alpha=1e-3, cpu_beta=1e-5, gpu_alpha=1e-4, gpu_beta=0.0, h2d_alpha=1e-4, h2d_bandwidth=1e9)
    nbytes = 5_000_000  # 5 ms over the link: the line alone keeps the CPU up to ~420 tokens
    assert line.cpu_threshold(nbytes) == pytest.approx((1e-4 + 1e-4 + 5e-3 - 1e-3) / 1e-5)
    stepped = LatencyModel(**{**line.__dict__, "cpu_prompt_alpha": 4.5e-3, "cpu_prompt_rows": 64})
    assert stepped.cpu_lat(63) == line.cpu_lat(63) and stepped.cpu_lat(64) == pytest.approx(line.cpu_lat(64) + 4.5e-3)
    assert 63 < stepped.cpu_threshold(nbytes) < 64
    assert choose_path(63, False, nbytes, stepped) == CPU and choose_path(64, False, nbytes, stepped) == COPY
    small = LatencyModel(**{**line.__dict__, "cpu_prompt_alpha": 1e-4, "cpu_prompt_rows": 64})
    assert small.cpu_threshold(nbytes) == pytest.approx(line.cpu_threshold(nbytes) - 10)  # the step costs 10 tokens
    assert choose_path(64, False, nbytes, small) == CPU


def test_past_the_step_the_cpu_line_is_the_prompts_own():
    """LatencyModel.cpu_prompt_beta: from the step on, the CPU side is its own prompt piece (ExpertLatency.cpu:
    the GEMMs' compute slope), not the secant's memory-bound slope continued. On the H100 host's profile the
    secant continued priced a 128-token Mixtral expert at 9.2 ms; the piece gives 12.5. Below the step and
    at s* nothing moves."""
    from pathlib import Path

    from tiered.checkpoint.model_config import ModelConfig
    from tiered.hardware.profile import HardwareProfile
    from tiered.planner.fiddler import ExpertLatency, ExpertShape

    ref = Path(__file__).resolve().parents[1] / "benchmarks" / "reference" / "h100-2026-11-26"
    hw = HardwareProfile.load(ref / "profile_quick.json")
    cfg = ModelConfig.from_hf({"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
                               "intermediate_size": 14336, "num_hidden_layers": 4, "num_attention_heads": 32,
                               "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2})
    expert = ExpertLatency(hw, ExpertShape.from_config(cfg), working_set=4 * 2 * 352_321_536)
    lm = expert.latency_model()
    assert lm.cpu_prompt_rows == 64 and lm.cpu_prompt_beta > 5 * lm.cpu_beta
    for s in (64, 128, 512, 4096):
        assert lm.cpu_lat(s) == pytest.approx(expert.cpu_lat(s), rel=1e-9)
    assert lm.cpu_lat(128) > 1.3 * LatencyModel(**{**lm.__dict__, "cpu_prompt_beta": None}).cpu_lat(128)
    assert lm.cpu_lat(1) == pytest.approx(expert.cpu_lat(1), rel=1e-9)
    assert lm.cpu_threshold(int(expert.transfer_bytes)) == pytest.approx(expert.threshold(), rel=1e-6)


@settings(max_examples=100, deadline=None)
@given(lat=latency_models(), nbytes=st.integers(min_value=1, max_value=10**10))
def test_cpu_share_shrinks_as_tokens_grow(lat, nbytes):
    """Monotone in s: once copying wins for s tokens it wins for every larger s."""
    paths = [choose_path(s, False, nbytes, lat) for s in (1, 2, 4, 8, 16, 64, 256, 4096)]
    first_copy = paths.index(COPY) if COPY in paths else len(paths)
    assert all(p == COPY for p in paths[first_copy:])
