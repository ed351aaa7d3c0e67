"""Expert prefetch (HOBBIT §3.2): stacked next-layer gates, prefetched experts are hits holding the
right weights, accuracy per look-ahead distance, and greedy tokens unchanged by prefetch."""

from __future__ import annotations

import pytest
import torch

from runtime_fixtures import GREEDY, engine_config, prompt, rt  # noqa: F401

from tiered import LLM
from tiered.memory.expert_store import expert_tensor_names
from tiered.models.moe import moe_blocks
from tiered.planner.plan import Plan
from tiered.runtime.precision import HIGH, SKIP
from tiered.runtime.prefetch import StackedGates


@pytest.fixture
def close_after():
    llms = []
    yield llms.append
    for llm in llms:
        llm.close()


def disk_llm(rt, kind, slots=4, **kw) -> LLM:
    """No accelerator; every expert on disk, `slots` cache slots in RAM (less than a layer's experts)."""
    s = rt.sizes(kind)
    return LLM(rt.dir(kind), engine_config(accelerator="none", cpu_memory=s.fast(cache_slots=slots, accelerator=False),
                                           expert_cache_slots=slots, **kw))


def test_stacked_gates_are_the_next_routers(rt, close_after):
    """Without norm folding, the stacked prediction for layer l+1 is layer l+1's own routing of x."""
    llm = LLM(rt.dir("qwen2_moe"), engine_config())
    close_after(llm)
    blocks = moe_blocks(llm.model)  # qwen2_moe fixture: MoE layers 0 and 2 (layer 1 dense)
    gates = StackedGates(llm.model, lookahead=2, fold_norms=False)
    assert list(gates.stacks) == [0] and gates.stacks[0][1] == [2]
    x = torch.randn(5, llm.config.hidden_size).to(blocks[1].gate.weight.device)  # the routers' device (CUDA too)
    ((target, idx, w),) = gates.predict(0, x)
    want_idx, want_w = blocks[1].gate.route(x)
    assert target == 2 and torch.equal(idx, want_idx) and torch.allclose(w, want_w.float())
    assert gates.predict(2, x) == []


@pytest.mark.parametrize("accelerator", ["none", "host"])
def test_prefetch_keeps_greedy_tokens_and_reports_accuracy(rt, accelerator, close_after):
    kind = "mixtral"
    s = rt.sizes(kind)
    if accelerator == "none":
        on, off = disk_llm(rt, kind, prefetch=True, prefetch_lookahead=1), disk_llm(rt, kind)
    else:  # experts in CPU RAM behind the host stand-in: prefetches are H2D copies
        kw = dict(accelerator="host", gpu_memory=s.fast(cache_slots=4), cpu_memory="64MiB", expert_cache_slots=4)
        on, off = LLM(rt.dir(kind), engine_config(prefetch=True, prefetch_lookahead=1, **kw)), LLM(rt.dir(kind), engine_config(**kw))
    close_after(on)
    close_after(off)
    assert on.plan.prefetch and on.experts.prefetcher is not None and off.experts.prefetcher is None
    ids = prompt()
    tokens_on = on.generate([ids], GREEDY)[0].token_ids
    assert tokens_on == off.generate([ids], GREEDY)[0].token_ids == rt.reference(kind)[1]
    st = on.runtime_stats()["prefetch"]
    assert st["issued"] > 0 and 0 < st["useful"] <= st["issued"]
    assert set(st["accuracy"]) == {1} and 0 < st["accuracy"][1] <= 1
    assert on.runtime_stats()["miss_penalty_bytes"] == on.experts.cache.stats.misses * s.expert


def test_a_prefetched_expert_is_a_hit_with_its_weights(rt, close_after):
    kind = "mixtral"
    llm = disk_llm(rt, kind, slots=4, prefetch=True, prefetch_lookahead=1)
    close_after(llm)
    pf, cache = llm.experts.prefetcher, llm.experts.cache
    x = torch.randn(1, llm.config.hidden_size)
    ((_, idx, _),) = pf.gates.predict(0, x)
    predicted = sorted(set(idx.flatten().tolist()))
    pf.on_layer(0, x, used=[0], pinned={(0, 0)})
    assert pf.issued == min(len(predicted), pf.max_inflight) >= 1
    loaded = [key for key, low in pf.inflight if not low]
    assert len(loaded) == len(pf.inflight)  # no low side: every prefetch loads the high copy
    assert set(loaded) <= {(1, e) for e in predicted} and set(loaded) <= cache.protected
    pf.on_layer(1, x, used=predicted, pinned={(1, e) for e in predicted})  # never waits for the loads
    assert pf.useful == len(loaded)
    for key in loaded:  # still landing: protected, and what computing it must wait for
        for fut in pf.loading(key):
            assert key in cache.protected
            fut.result()
        assert pf.loading(key) == []
    for key in loaded:
        slot = cache.lookup(key)
        assert slot is not None  # a hit
        names = expert_tensor_names(llm.config.model_type, *key)
        for t, n in zip(slot, names):
            assert torch.equal(t, llm.checkpoint.handle(n).load(t.dtype))


def test_new_sequence_resets_predictions_and_protection(rt, close_after):
    llm = disk_llm(rt, "mixtral", prefetch=True, prefetch_lookahead=1)
    close_after(llm)
    pf = llm.experts.prefetcher
    pf.on_layer(0, torch.randn(1, llm.config.hidden_size), used=[0], pinned=set())
    assert pf.pending and llm.experts.cache.protected
    llm.runtime.new_sequence()
    assert not pf.pending and not pf.inflight and not llm.experts.cache.protected
    assert llm.experts.cache.policy.tokens == 0


def test_plan_round_trips_prefetch_fields(rt, tmp_path, close_after):
    llm = disk_llm(rt, "mixtral", prefetch=True, prefetch_lookahead=3, cache_policy="hobbit")
    close_after(llm)
    llm.plan.save(tmp_path / "plan.json")
    back = Plan.load(tmp_path / "plan.json")
    assert back == llm.plan and (back.prefetch, back.prefetch_lookahead, back.cache_policy) == (True, 3, "hobbit")
    assert back.to_json() == llm.plan.to_json()
    assert "prefetch 3 MoE layers ahead" in back.render()
    # the runtime under HOBBIT's policy and prefetch keeps the reference's greedy tokens
    assert llm.generate([prompt()], GREEDY)[0].token_ids == rt.reference("mixtral")[1]
    assert llm.experts.cache.stats.evictions > 0


@pytest.mark.parametrize("accelerator", ["none", "host"])
def test_mixed_precision_prefetches_at_the_predicted_precision(rt, tmp_path, close_after, accelerator):
    """HOBBIT §3.2 "prefetches use mixed precision": with T1 = 0 and T2 = 1 a predicted top-1 expert
    is loaded into the high pool and the others into the low pool (fewer bytes), and the layer they
    were predicted for finds them there. Without an accelerator the loads are disk reads into RAM
    slots; behind the strict host stand-in they are H2D copies of each precision's host copy."""
    kind = "mixtral"
    cfg = dict(max_context=32, decode_weights="fp32", plan="off", expert_weights="bf16", expert_cache_slots=6,
               resident_experts=0, offload_dir=str(tmp_path / "off"), accelerator=accelerator,
               expert_low_weights="int4", mixed_thresholds=(0.0, 1.0), prefetch=True, prefetch_lookahead=1)
    if accelerator == "host":  # every expert in CPU RAM (both precisions), the cache slots on the "device"
        cfg.update(gpu_memory="64MiB", cpu_memory=None, force_expert_path="copy")  # unlimited RAM: low copies there too
    llm = LLM(rt.dir(kind), engine_config(**cfg))
    close_after(llm)
    pf, ex = llm.experts.prefetcher, llm.experts
    assert pf.low is not None and pf.low.cache is ex.low.cache
    pf.max_inflight = 64  # issue every predicted miss at once
    first = min(pf.gates.stacks)
    with llm._device_scope():
        # one token: its top-1 expert high, its second low (T1 = 0): one load into each pool
        x = llm._to_device(torch.randn(1, llm.config.hidden_size, generator=torch.Generator().manual_seed(0)))
        ((target, idx, w),) = pf.gates.predict(first, x)
        needs = pf.low.mixed.expert_needs(idx, w, pf.gates.num_experts).tolist()
        pf.on_layer(first, x, used=[0], pinned={(first, 0)})
    want = {((target, e), need != HIGH) for e, need in enumerate(needs) if need != SKIP}
    assert set(pf.inflight) == want and any(low for _, low in want) and any(not low for _, low in want)
    hb, lb = ex.store.expert_bytes, ex.low.store.expert_bytes
    assert pf.bytes == sum(lb if low else hb for _, low in want) < len(want) * hb
    for (key, low), fut in list(pf.inflight.items()):
        assert key in ex.cache.protected and key in ex.low.cache.protected
        assert pf.loading(key, low) == [fut] or fut.done()
        assert pf.loading(key, not low) == []
        fut.result()
        pool = ex.low.cache if low else ex.cache
        slot = pool.lookup(key)
        assert slot is not None and (key in ex.cache) == (not low)
        if accelerator == "host":  # the copy of that precision's host copy, on the stand-in device
            host = (ex.low if low else ex).store.host[key]
            assert all(torch.equal(llm.accelerator.to_host(t), h) for t, h in zip(slot, host))
    out = llm.generate(prompt(), GREEDY)[0].token_ids  # the whole path runs, low prefetches served as low hits
    assert len(out) == GREEDY.max_tokens and ex.precision_counts["low hit"] > 0
