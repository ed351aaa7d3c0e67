"""Lossless parity of the tiered MoE runtime with transformers under every expert placement.

For each MoE architecture the logits of a 16-token prompt must equal transformers' (max |d| / max
|logit| <= 1e-4, fp32) and the 16-token greedy continuation must be identical, whether the experts
are (a) all on the fast tier, (b) all in CPU RAM behind the stand-in accelerator, (c) on disk
behind a cache smaller than one layer, or (d) spread over fast / CPU / disk so that the dispatcher
uses all three paths (resident, copy, cpu) in one run.
"""

from __future__ import annotations

import pytest
import torch

from runtime_fixtures import GREEDY, MOE_KINDS, REL_TOL, engine_config, prompt, rel_err, rt  # noqa: F401

from tiered import LLM
from tiered.planner.placement import CPU, DISK, FAST
from tiered.runtime.dispatcher import LatencyModel


def check_parity(rt, kind: str, llm: LLM) -> None:
    ref_logits, ref_tokens = rt.reference(kind)
    ids = prompt()
    err = rel_err(llm.logits(ids), ref_logits)
    assert err <= REL_TOL, f"{kind}: logits differ from transformers by {err:.2e} (relative)"
    out = llm.generate([ids], GREEDY)[0].token_ids
    assert out == ref_tokens


def load(rt, kind: str, **kw) -> LLM:
    llm = LLM(rt.dir(kind), engine_config(**kw))
    return llm


@pytest.fixture
def close_after():
    """Collects LLMs and shuts their executors' threads down after the test."""
    llms = []
    yield llms.append
    for llm in llms:
        if llm.experts is not None:
            llm.experts.executor.close()


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_all_experts_fast(rt, kind, close_after):
    """(a) Default budgets: every expert resident on the fast tier, every dispatch "resident"."""
    llm = load(rt, kind)
    close_after(llm)
    pl, n = llm.experts.placement, rt.sizes(kind).total_experts
    assert pl.count(FAST) == n == len(pl.tiers)
    check_parity(rt, kind, llm)
    assert set(llm.experts.path_counts) == {"resident"}
    assert llm.experts.bytes_read == 0 and llm.experts.bytes_h2d == 0


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_all_experts_in_cpu_ram_behind_host_accelerator(rt, kind, close_after):
    """(b) The accelerator holds non-expert weights, KV, staging and a 2-slot cache; experts live in CPU RAM."""
    s = rt.sizes(kind)
    llm = load(rt, kind, accelerator="host", gpu_memory=s.fast(cache_slots=2), cpu_memory="64MiB",
               expert_cache_slots=2)
    close_after(llm)
    pl = llm.experts.placement
    assert pl.count(FAST) == 0
    assert pl.count(CPU) == s.total_experts == len(pl.tiers)
    assert pl.cache_slots == 2
    check_parity(rt, kind, llm)
    paths = llm.experts.path_counts
    assert paths["copy"] + paths["cpu"] > 0  # non-resident experts went through the dispatcher
    assert llm.experts.bytes_read == 0  # nothing on disk
    assert llm.fast_budget.peak <= llm.fast_budget.capacity


@pytest.mark.parametrize("read_ahead", [True, False], ids=["read_ahead", "no_read_ahead"])
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_experts_on_disk_small_cache(rt, kind, read_ahead, close_after):
    """(c) No accelerator; RAM holds the non-expert weights, KV, staging and a 3-slot cache (less than
    one layer's experts); every expert is read from the checkpoint on disk."""
    s = rt.sizes(kind)
    slots = 3
    assert slots < s.num_experts
    llm = load(rt, kind, accelerator="none", cpu_memory=s.fast(cache_slots=slots, accelerator=False), expert_cache_slots=slots,
               read_ahead=read_ahead)
    close_after(llm)
    pl = llm.experts.placement
    assert pl.count(FAST) == 0
    assert pl.count(DISK) == s.total_experts
    assert llm.experts.cache.num_slots == slots
    check_parity(rt, kind, llm)
    rtm = llm.experts
    assert rtm.bytes_read > 0 and rtm.bytes_read % s.expert == 0
    assert rtm.path_counts["disk"] == rtm.bytes_read // s.expert
    assert rtm.cache.stats.evictions > 0  # the cache really was too small
    assert llm.cpu_budget.peak <= llm.cpu_budget.capacity


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_mixed_placement_uses_all_three_paths(rt, kind, tmp_path, close_after):
    """(d) Some experts resident on the accelerator, some in CPU RAM, the rest on disk; with a latency
    model whose CPU threshold s* = 1.5 tokens, experts with one token (decode) run on the CPU and
    experts with several (prefill) are copied."""
    s = rt.sizes(kind)
    resident, in_cpu = 3, 5
    llm = load(rt, kind, accelerator="host", gpu_memory=s.fast(cache_slots=2, resident=resident),
               cpu_memory=s.cpu(in_cpu), expert_cache_slots=2, offload_dir=str(tmp_path / "offload"))
    close_after(llm)
    pl = llm.experts.placement
    assert (pl.count(FAST), pl.count(CPU), pl.count(DISK)) == (resident, in_cpu, s.total_experts - resident - in_cpu)
    lat = LatencyModel(cpu_alpha=0.0, cpu_beta=1e-3, gpu_alpha=0.0, gpu_beta=0.0, h2d_alpha=1.5e-3,
                       h2d_bandwidth=float("inf"))
    assert 1 < lat.cpu_threshold(s.expert) < 2
    llm.experts.latency = lat
    check_parity(rt, kind, llm)
    paths = llm.experts.path_counts
    assert paths["resident"] > 0 and paths["copy"] > 0 and paths["cpu"] > 0, dict(paths)
    assert llm.experts.bytes_read > 0  # disk-tier experts were read
    assert llm.experts.bytes_h2d == paths["copy"] * s.expert


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_a_decode_token_on_resident_gpu_experts_takes_the_one_token_path(rt, kind, close_after, monkeypatch):
    """Every expert resident behind the (stand-in) accelerator, the grouped path off: a decode step's
    MoE layer runs _one_token_on_fast (no argsort, per-expert tasks or index_add_), and its logits
    equal the general path's bit for bit."""
    from fixtures import stepwise_logits
    from tiered.runtime.moe_runner import TieredExperts

    llm = load(rt, kind, accelerator="host")
    close_after(llm)
    assert llm.experts.placement.count(FAST) == rt.sizes(kind).total_experts
    llm.experts.grouped = False
    calls = []
    real = TieredExperts._one_token_on_fast
    monkeypatch.setattr(TieredExperts, "_one_token_on_fast", lambda self, *a: calls.append(1) or real(self, *a))
    ids = prompt()
    fast = stepwise_logits(llm, ids, 8)
    n_fast = len(calls)
    assert n_fast >= (len(ids) - 8) * llm.config.num_hidden_layers // 2  # decode steps x MoE layers
    llm.experts.one_token_path = False
    general = stepwise_logits(llm, ids, 8)
    assert len(calls) == n_fast and torch.equal(fast, general)
    assert set(llm.experts.path_counts) == {"resident"}


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_layers_of_resident_stacked_experts_take_the_sync_free_grouped_path(rt, kind, close_after, monkeypatch):
    """Every expert resident behind the (stand-in) accelerator: each layer's experts are views of one
    stack per projection, every MoE layer of prefill and decode runs _grouped (grouped GEMMs, the
    routing kept on the device), and the logits equal the general path's to fp32 rounding (on the
    CPU the grouped GEMM is a loop of the same GEMMs, written into slices of one output: BLAS may
    block them differently)."""
    from fixtures import stepwise_logits
    from tiered.runtime.moe_runner import TieredExperts

    llm = load(rt, kind, accelerator="host")
    close_after(llm)
    store = llm.experts.store
    assert sorted(store.stacks) == sorted({l for l, _ in store.placement.tiers})
    for (layer, e), ws in store.resident.items():
        assert all(w.data_ptr() == s[e].data_ptr() for w, s in zip(ws, store.stacks[layer]))
    calls = []
    real = TieredExperts._grouped
    monkeypatch.setattr(TieredExperts, "_grouped", lambda self, *a: calls.append(a[-2]) or real(self, *a))
    ids = prompt()
    grouped = stepwise_logits(llm, ids, 8)
    moe_layers = len(store.stacks)
    assert len(calls) == (1 + len(ids) - 8) * moe_layers and set(calls) == {"grouped"}
    llm.experts.grouped = False
    general = stepwise_logits(llm, ids, 8)
    assert len(calls) == (1 + len(ids) - 8) * moe_layers
    assert rel_err(grouped, general) <= 1e-6
