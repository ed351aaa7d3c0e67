"""FlexGen policy search (planner/flexgen.py): feasibility, corners, budgets, shapes."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tiered.checkpoint.model_config import ModelConfig
from tiered.errors import BudgetError, ConfigError
from tiered.hardware.presets import get_preset
from tiered.hardware.profile import HardwareProfile, LinearModel
from tiered.planner.flexgen import (COMPRESSED_BYTES, FlexGenModel, FlexGenOptions, evaluate_policy,
                                    search_policy)

GiB = 2**30
T4 = get_preset("t4-pcie3")
OPT30 = FlexGenModel.opt("30b")
OPT67 = FlexGenModel.opt("6.7b")
SMALL_GRID = FlexGenOptions(gpu_batch_sizes=(1, 4, 8, 16, 32), max_num_gpu_batches=4)
ALL_CPU = ((0, 1, 0), (0, 1, 0), (0, 1, 0))
ALL_GPU = ((1, 0, 0), (1, 0, 0), (1, 0, 0))


def mixtral_config(**kw) -> ModelConfig:
    d = dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336)
    d.update(kw)
    return ModelConfig(**d)


def check_feasible(p) -> None:
    for frac in (p.weights, p.cache, p.activations):
        assert sum(frac) == pytest.approx(1.0, abs=1e-6)
        assert all(-1e-9 <= f <= 1 + 1e-9 for f in frac)
    for tier in ("gpu", "cpu", "disk"):
        cap = p.capacity[tier]
        if cap is not None:
            assert p.peak_memory[tier] <= cap * (1 + 1e-6), tier
        else:
            assert p.peak_memory[tier] == pytest.approx(0.0, abs=1.0)
    assert p.throughput > 0 and p.block_time > 0


def test_opt30b_on_t4_respects_every_limit():
    p = search_policy(OPT30, T4, 512, 32, SMALL_GRID, gpu_memory=16 * GiB, cpu_memory=200 * GiB)
    check_feasible(p)
    # weights do not fit the 16 GB GPU: most of them stream from the CPU, as in the paper's policy
    assert p.weights[0] < 0.5
    assert p.throughput == pytest.approx(p.block_size * 32 / p.block_time)
    json.dumps(p.to_dict())  # serializable
    assert p.describe().startswith(f"({p.gpu_batch_size}x{p.num_gpu_batches},")


def test_everything_fits_on_gpu_goes_there_and_beats_all_cpu():
    # OPT-6.7B 4-bit (3.8 GB) on a 16 GB GPU: the paper's (.., 100,0, 100,0, 100,0) policy
    opt = FlexGenOptions(compress_weight=True, compress_cache=True, gpu_batch_sizes=(4, 8, 16, 32),
                         max_num_gpu_batches=2)
    p = search_policy(OPT67, T4, 512, 32, opt, gpu_memory=16 * GiB, cpu_memory=200 * GiB)
    check_feasible(p)
    assert p.weights[0] == pytest.approx(1.0) and p.cache[0] == pytest.approx(1.0)
    assert p.activations[0] == pytest.approx(1.0)
    cpu = evaluate_policy(OPT67, T4, 512, 32, p.gpu_batch_size, p.num_gpu_batches, *ALL_CPU, opt,
                          gpu_memory=16 * GiB, cpu_memory=200 * GiB)
    assert p.throughput >= cpu.throughput


def test_tiny_gpu_uses_cpu_and_disk():
    p = search_policy(OPT30, T4, 512, 32, SMALL_GRID, gpu_memory=4 * GiB, cpu_memory=40 * GiB)
    check_feasible(p)
    assert p.weights[0] < 0.1
    assert p.weights[2] > 0.1  # 60 GB of weights cannot all sit in 40 GB of RAM
    assert p.peak_memory["disk"] > 0


@pytest.mark.parametrize("gbs,num_gb", [(4, 1), (8, 2), (16, 1)])
def test_lp_beats_the_corners_at_its_batch(gbs, num_gb):
    opt = FlexGenOptions(gpu_batch_sizes=(gbs,), max_num_gpu_batches=num_gb)
    caps = dict(gpu_memory=16 * GiB, cpu_memory=200 * GiB)
    best = search_policy(OPT67, T4, 256, 16, opt, **caps)
    fixed = FlexGenOptions(gpu_batch_sizes=(gbs,), max_num_gpu_batches=num_gb)
    for corner in (ALL_CPU, ALL_GPU):
        try:
            c = evaluate_policy(OPT67, T4, 256, 16, gbs, num_gb, *corner, fixed, **caps)
        except BudgetError:
            continue  # all-GPU does not fit OPT-6.7B fp16 plus its working set: nothing to beat
        assert best.throughput >= c.throughput * (1 - 1e-9)


@functools.lru_cache(maxsize=None)
def best_at_8x2():
    opt = FlexGenOptions(gpu_batch_sizes=(8,), max_num_gpu_batches=2)
    return opt, search_policy(OPT30, T4, 512, 32, opt, gpu_memory=16 * GiB, cpu_memory=200 * GiB)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.floats(0.01, 1.0), min_size=9, max_size=9))
def test_lp_optimum_beats_random_feasible_placements(raw):
    w = np.array(raw).reshape(3, 3)
    w[:, 2] *= 0.1  # keep the disk shares small so most draws fit
    w[2, 2] = 0.0  # no activations on disk (the default)
    w[0, 0] *= 0.3  # 60 GB of weights: only a small share fits the 16 GB GPU
    w = w / w.sum(axis=1, keepdims=True)
    opt, best = best_at_8x2()
    try:
        p = evaluate_policy(OPT30, T4, 512, 32, 8, 2, tuple(w[0]), tuple(w[1]), tuple(w[2]), opt,
                            gpu_memory=16 * GiB, cpu_memory=200 * GiB)
    except BudgetError:
        return
    check_feasible(p)
    assert best.throughput >= p.throughput * (1 - 1e-9)


def test_infeasible_budgets_raise_budget_error():
    with pytest.raises(BudgetError, match="no FlexGen policy fits"):
        search_policy(OPT30, T4, 512, 32, SMALL_GRID, gpu_memory=2**20, cpu_memory=200 * GiB)
    no_disk = HardwareProfile("nodisk", "test", {k: v for k, v in T4.models.items() if not k.startswith("disk/")},
                              16 * GiB, 8 * GiB)
    with pytest.raises(BudgetError, match="weights"):
        search_policy(OPT30, no_disk, 512, 32, SMALL_GRID)
    with pytest.raises(BudgetError):
        evaluate_policy(OPT30, T4, 512, 32, 8, 1, *ALL_GPU, SMALL_GRID)


def test_no_disk_tier_keeps_disk_fractions_zero():
    no_disk = HardwareProfile("nodisk", "test", {k: v for k, v in T4.models.items() if not k.startswith("disk/")},
                              16 * GiB, 200 * GiB)
    p = search_policy(OPT30, no_disk, 512, 32, SMALL_GRID)
    check_feasible(p)
    assert p.weights[2] == p.cache[2] == p.activations[2] == 0.0
    assert p.capacity["disk"] is None


def test_compression_shrinks_bytes_and_does_not_hurt():
    assert OPT30.weight_bytes(True) / OPT30.weight_bytes(False) == pytest.approx(COMPRESSED_BYTES / 2)
    caps = dict(gpu_memory=16 * GiB, cpu_memory=200 * GiB)
    plain = search_policy(OPT30, T4, 512, 32, SMALL_GRID, **caps)
    small = search_policy(OPT30, T4, 512, 32, FlexGenOptions(compress_weight=True, gpu_batch_sizes=(1, 4, 8, 16, 32),
                                                             max_num_gpu_batches=4), **caps)
    assert small.compress_weight and small.weights[0] > plain.weights[0]
    assert small.throughput >= plain.throughput


def test_delegation_rule_and_overlap_option():
    assert FlexGenOptions().delegation and not FlexGenOptions(compress_cache=True).delegation
    caps = dict(gpu_memory=16 * GiB, cpu_memory=200 * GiB)
    serial = search_policy(OPT30, T4, 512, 32, SMALL_GRID, **caps)
    overlap = search_policy(OPT30, T4, 512, 32, FlexGenOptions(overlap_cpu_gpu=True, gpu_batch_sizes=(1, 4, 8, 16, 32),
                                                               max_num_gpu_batches=4), **caps)
    assert overlap.throughput >= serial.throughput  # max(gpu, cpu) <= gpu + cpu


def test_budget_overrides_and_margin():
    caps = dict(gpu_memory=16 * GiB, cpu_memory=200 * GiB)
    p = search_policy(OPT30, T4, 512, 32, FlexGenOptions(memory_margin=0.8, gpu_batch_sizes=(8, 16),
                                                         max_num_gpu_batches=3), **caps)
    assert p.capacity["gpu"] == pytest.approx(0.8 * 16 * GiB)
    assert p.peak_memory["gpu"] <= 0.8 * 16 * GiB * (1 + 1e-6)
    with pytest.raises(ConfigError):
        FlexGenOptions(memory_margin=1.5)


def test_profile_without_gpu_or_capacity_is_a_config_error():
    cpu_only = HardwareProfile("cpu", "test", {"gemm/cpu/fp32": LinearModel(0.0, 1e-11)}, None, 64 * GiB)
    with pytest.raises(ConfigError):
        search_policy(OPT67, cpu_only, 128, 8, SMALL_GRID)
    with pytest.raises(ConfigError, match="CPU memory"):
        search_policy(OPT67, get_preset("scheinfer-a"), 128, 8, SMALL_GRID)
    p = search_policy(OPT67, get_preset("scheinfer-a"), 128, 8, SMALL_GRID, cpu_memory=128 * GiB)
    check_feasible(p)


def test_model_from_config_matches_parameter_count():
    cfg = mixtral_config()
    m = FlexGenModel.from_config(cfg, "mixtral-8x7b")
    total = m.layer_params * m.num_layers + m.embed_params + cfg.hidden_size
    assert total == pytest.approx(cfg.num_parameters(), rel=1e-6)
    assert m.active_params < m.layer_params / 2  # top-2 of 8 experts
    assert m.kv_elements == 2 * 8 * 128
    assert m.mlp_inner == 2 * 14336
    p = search_policy(m, T4, 512, 32, SMALL_GRID, gpu_memory=16 * GiB, cpu_memory=200 * GiB)
    check_feasible(p)
    with pytest.raises(ConfigError):
        FlexGenModel.opt("13b")
