"""SPLIT: a missing dense expert divided by gate/up rows between the CPU and the H2D link
(runtime/dispatcher.LatencyModel.split_share, moe_runner._split): the share that balances both
sides, when balanced dispatch picks it, and parity with transformers through the engine."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime_fixtures import GREEDY, REL_TOL, engine_config, prompt, rel_err, rt  # noqa: F401

from tiered import LLM
from tiered.runtime.dispatcher import (COPY, CPU, GATE_UP_SHARE, MIX_GAIN, PRICED, SPLIT, SPLIT_GAIN, LatencyModel,
                                       dispatch_misses, split_misses)
from tiered.runtime.moe_runner import SPLIT_ROW_ALIGN, split_rows_of, swiglu_rows

MB = 2**20


def _lat(cpu_s: float, link_s: float, nbytes: int, alpha: float = 0.0) -> LatencyModel:
    """One expert of `nbytes`: cpu_s seconds on the CPU, link_s over the link, the GPU instant."""
    return LatencyModel(alpha, cpu_s - alpha, 0.0, 0.0, alpha, nbytes / link_s)


@settings(max_examples=50, deadline=None)
@given(cpu=st.floats(1e-3, 1e-2), link=st.floats(1e-3, 1e-2), alpha=st.floats(0, 1e-4))
def test_split_share_makes_cpu_and_link_finish_together(cpu, link, alpha):
    nbytes = 352 * MB
    lat = _lat(cpu + alpha, link, nbytes, alpha)
    a, t = lat.split_share(1, nbytes)
    g = GATE_UP_SHARE
    t_cpu = a * g * (cpu + alpha)  # the CPU's part: its share of the whole expert's time, intercept included
    t_link = alpha + (1 - a * g) * link
    assert t == pytest.approx(max(t_cpu, t_link))
    if a < 1:  # interior: balanced, and faster than either whole path
        assert t_cpu == pytest.approx(t_link, abs=1e-9)
        assert t <= min(cpu + alpha, link + alpha) + 1e-12


def test_balanced_dispatch_splits_a_single_miss_only_when_it_pays():
    nbytes = 352 * MB
    even = _lat(4.7e-3, 7.0e-3, nbytes)  # the H200 host: CPU expert 4.7 ms, its copy 7 ms
    assert split_misses([1], even, nbytes, splittable=True) == [SPLIT]
    assert split_misses([1], even, nbytes) == [CPU]  # not splittable: Fiddler's better side
    assert split_misses([1, 1], even, nbytes) == [CPU, COPY]  # two, whole: one each way
    two = dispatch_misses([1, 1], even, nbytes, splittable=True)  # two: one on the CPU, the other split
    assert two.paths == [CPU, SPLIT] and two.shares[0] is None
    assert two.seconds == pytest.approx(5.6e-3, rel=0.01)  # 4.7 ms + a third of what is left, not 7
    assert split_misses([1, 1], _lat(1e-3, 1e-3, nbytes), nbytes, splittable=True) == [CPU, COPY]  # nothing to gain
    lopsided = _lat(40e-3, 2e-3, nbytes)  # a link 20x faster: splitting saves under SPLIT_GAIN
    assert split_misses([1], lopsided, nbytes, splittable=True) == [COPY]
    assert split_misses([1, 3], even, nbytes, "split") == [SPLIT, SPLIT]


@settings(max_examples=80, deadline=None)
@given(cpu=st.floats(1e-3, 1e-2), link=st.floats(1e-3, 1e-2), cpu_busy=st.floats(0, 2e-2),
       link_busy=st.floats(0, 2e-2))
def test_split_share_balances_the_work_each_side_already_has(cpu, link, cpu_busy, link_busy):
    nbytes = 352 * MB
    lat = _lat(cpu, link, nbytes)
    a, t = lat.split_share(1, nbytes, cpu_busy, link_busy)
    t_cpu, t_link = cpu_busy + a * GATE_UP_SHARE * cpu, link_busy + (1 - a * GATE_UP_SHARE) * link
    assert t == pytest.approx(max(t_cpu, t_link))
    if 1e-3 < a < 1:  # interior: both sides end together
        assert t_cpu == pytest.approx(t_link, abs=1e-9)


def _lanes(tokens, d, lat, nbytes):
    """The makespan of a LayerDispatch run as the runner runs it: the CPU's whole experts and split
    rows in turn on one lane, the copies (whole, and a split's rest) in turn on the link."""
    cpu = link = 0.0
    for s, p, a in zip(tokens, d.paths, d.shares):
        if p == CPU:
            cpu += lat.cpu_lat(s)
        elif p == COPY:
            link += lat.transfer_lat(nbytes)
        else:
            cpu += a * GATE_UP_SHARE * lat.cpu_lat(s)  # its share of the whole expert (split_share)
            link += lat.h2d_alpha + (1 - a * GATE_UP_SHARE) * nbytes / lat.h2d_bandwidth
    return max(cpu, link)


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(1, 4), min_size=1, max_size=6), cpu=st.floats(1e-3, 1e-2),
       link=st.floats(1e-3, 1e-2))
def test_balanced_dispatch_with_splits_never_loses_to_whole_experts(tokens, cpu, link):
    """At most one miss is split, its share counts what the others load on each side, and the
    result beats the best whole assignment by SPLIT_GAIN or is that assignment."""
    nbytes = 352 * MB
    lat = LatencyModel(0.0, cpu, 0.0, 0.0, 0.0, nbytes / link)  # cpu seconds per token, link per expert
    whole = dispatch_misses(tokens, lat, nbytes)
    split = dispatch_misses(tokens, lat, nbytes, splittable=True)
    assert SPLIT not in whole.paths and split.paths.count(SPLIT) <= 1
    assert whole.seconds == pytest.approx(_lanes(tokens, whole, lat, nbytes))
    assert split.seconds == pytest.approx(_lanes(tokens, split, lat, nbytes))
    if SPLIT in split.paths:
        assert split.seconds < SPLIT_GAIN * whole.seconds
    else:
        assert split == whole


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(1, 64), min_size=1, max_size=8), cpu=st.floats(1e-4, 1e-3),
       link=st.floats(1e-3, 1e-2))
def test_a_layer_sends_misses_both_ways_only_when_that_beats_one_side_by_mix_gain(tokens, cpu, link):
    """Whole misses go both ways only when the best such mix (a prefix by token count on the CPU)
    beats the better of all-CPU and all-copied by MIX_GAIN; otherwise one side takes them all."""
    nbytes = 352 * MB
    lat = LatencyModel(0.0, cpu, 0.0, 0.0, 0.0, nbytes / link)
    got = dispatch_misses(tokens, lat, nbytes)
    one = min(dispatch_misses(tokens, lat, nbytes, mode).seconds for mode in (CPU, COPY))
    order = sorted(range(len(tokens)), key=lambda i: tokens[i])
    mixes = [max(cpu * sum(tokens[i] for i in order[:j]), (len(tokens) - j) * link) for j in range(1, len(tokens))]
    if mixes and min(mixes) < MIX_GAIN * one - 1e-12:
        assert CPU in got.paths and COPY in got.paths and got.seconds == pytest.approx(min(mixes))
    else:
        assert len(set(got.paths)) == 1 and got.seconds == pytest.approx(one)


@settings(max_examples=60, deadline=None)
@given(cpu=st.floats(1e-4, 2e-2), link=st.floats(1e-4, 2e-2), fc=st.floats(1.0, 1.5), fl=st.floats(1.0, 1.5))
@example(cpu=0.013822588857481373, link=0.003, fc=1.0, fl=1.0)  # CI found c_end an ulp below cpu here
def test_cpu_work_and_copies_together_each_slow_while_both_run(cpu, link, fc, fl):
    """LatencyModel.together: while both run each goes at its shared rate (1 / factor of its own), then the
    one left finishes alone; with no slowdown each ends at its own time."""
    lat = LatencyModel(0.0, cpu, 0.0, 0.0, 0.0, 1e9, cpu_shared=fc, link_shared=fl)
    c_end, l_end = lat.together(cpu, link)
    first = min(c_end, l_end)
    assert first == pytest.approx(min(cpu * fc, link * fl))
    # the work done: each side's share at the shared rate until the first ends, alone after
    assert min(c_end, first) / fc + max(0.0, c_end - first) == pytest.approx(cpu)
    assert min(l_end, first) / fl + max(0.0, l_end - first) == pytest.approx(link)
    eps = 1e-12  # rounding: with no slowdown an end can come out an ulp below its own time
    assert cpu * (1 - eps) <= c_end <= cpu * fc * (1 + eps) and link * (1 - eps) <= l_end <= link * fl * (1 + eps)
    plain = LatencyModel(0.0, cpu, 0.0, 0.0, 0.0, 1e9)
    assert plain.together(cpu, link) == pytest.approx((cpu, link))
    assert lat.together(cpu, 0.0) == (cpu, 0.0) and lat.together(0.0, link) == (0.0, link)


def test_a_mix_is_priced_with_the_host_memory_the_two_sides_share():
    """The H100 host measured alone and together (gpu_dram_share: CPU expert 82.8 -> 73.4 GB/s, H2D 52.7 ->
    47.5): a decode layer's two misses, one on the CPU (3.9 ms) beside one copied (6.4 ms), end at 6.9 ms
    once the copy's slower start is priced, not 6.4; the choice between that and 7.8 ms on the CPU alone is
    then made on the shared figure."""
    nbytes = 352 * MB
    alone = LatencyModel(3.9e-3, 0.0, 0.0, 0.0, 0.0, nbytes / 6.4e-3)
    shared = LatencyModel(3.9e-3, 0.0, 0.0, 0.0, 0.0, nbytes / 6.4e-3, cpu_shared=82.8 / 73.4, link_shared=52.7 / 47.5)
    c, l = shared.together(3.9e-3, 6.4e-3)
    assert c == pytest.approx(3.9e-3 * 82.8 / 73.4) and l == pytest.approx(6.4e-3 + c * (1 - 47.5 / 52.7))
    mix = dispatch_misses([1, 1], shared, nbytes, mode="balanced")  # 6.84 ms still beats 7.8 by MIX_GAIN
    assert sorted(mix.paths) == [COPY, CPU] and mix.seconds == pytest.approx(l) and l < MIX_GAIN * 7.8e-3
    assert dispatch_misses([1, 1], alone, nbytes).seconds == pytest.approx(6.4e-3)  # the mix, unshared
    heavier = LatencyModel(3.9e-3, 0.0, 0.0, 0.0, 0.0, nbytes / 6.4e-3, cpu_shared=1.3, link_shared=1.3)
    assert split_misses([1, 1], alone, nbytes) != [CPU, CPU] and split_misses([1, 1], heavier, nbytes) == [CPU, CPU]


def test_a_split_runs_both_sides_together_at_their_shared_rates():
    """split_share with the host-share factors balances and prices the CPU's rows and the link's bytes at
    their shared rates (both run from start to end): the same as a model whose CPU and link are that
    much slower; without factors it is unchanged."""
    nbytes = 352 * MB
    plain = LatencyModel(1e-4, 3.9e-3, 0.0, 0.0, 7e-6, nbytes / 6.4e-3)
    shared = LatencyModel(1e-4, 3.9e-3, 0.0, 0.0, 7e-6, nbytes / 6.4e-3, cpu_shared=1.13, link_shared=1.11)
    slower = LatencyModel(1e-4 * 1.13, 3.9e-3 * 1.13, 0.0, 0.0, 7e-6, nbytes / (6.4e-3 * 1.11))
    for busy in ((0.0, 0.0), (2e-3, 0.0), (0.0, 6.4e-3)):  # the busy sides' work beside each other too
        assert shared.split_share(1, nbytes, *busy) == pytest.approx(
            slower.split_share(1, nbytes, busy[0] * 1.13, busy[1] * 1.11))
        a, t = shared.split_share(1, nbytes, *busy)
        assert t > plain.split_share(1, nbytes, *busy)[1]


def test_decode_misses_stay_on_the_cpu_where_a_mix_gains_little():
    """The H100 host's rates (session 28: CPU 3.47 ms, link 6.41 ms per Mixtral expert): a mix of a
    decode step's two misses priced 5% faster than both on the CPU, and measured 16% slower. Both
    stay on the CPU; a prompt's eight misses still go both ways; on the H200 host's rates (CPU 4.7 ms,
    link 7 ms) two misses are worth mixing (7.0 against 9.4 ms)."""
    nbytes = 352 * MB
    h100 = LatencyModel(3.46e-3, 9.4e-6, 2.0e-4, 0.0, 7e-6, 54.9e9)
    assert split_misses([1, 1], h100, nbytes) == [CPU, CPU]
    paths = split_misses([4] * 8, h100, nbytes)
    assert CPU in paths and COPY in paths
    h200 = LatencyModel(4.7e-3, 0.0, 0.0, 0.0, 0.0, nbytes / 7e-3)
    assert sorted(split_misses([1, 1], h200, nbytes)) == [COPY, CPU]


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(1, 64), min_size=1, max_size=8), cpu=st.floats(1e-4, 1e-3),
       link=st.floats(1e-3, 1e-2), splittable=st.booleans())
def test_priced_dispatch_takes_the_fastest_priced_assignment_without_margins(tokens, cpu, link, splittable):
    """"priced" is balanced without MIX_GAIN and SPLIT_GAIN: never slower as priced than balanced, the
    same paths wherever balanced's choice was also the fastest, and a mix or split wherever one is priced
    faster at all (the H100 host's decode pair, 5% faster mixed, which balanced keeps on the CPU)."""
    nbytes = 352 * MB
    lat = LatencyModel(0.0, cpu, 0.0, 0.0, 0.0, nbytes / link)
    priced = dispatch_misses(tokens, lat, nbytes, PRICED, splittable=splittable)
    balanced = dispatch_misses(tokens, lat, nbytes, "balanced", splittable=splittable)
    assert priced.seconds <= balanced.seconds + 1e-12
    one = min(dispatch_misses(tokens, lat, nbytes, mode).seconds for mode in (CPU, COPY))
    assert priced.seconds <= one + 1e-12
    if priced.paths != balanced.paths:  # only where the margins gave up a priced gain
        assert priced.seconds < balanced.seconds
    h100 = LatencyModel(3.46e-3, 9.4e-6, 2.0e-4, 0.0, 7e-6, 54.9e9)
    assert split_misses([1, 1], h100, nbytes) == [CPU, CPU]
    assert sorted(split_misses([1, 1], h100, nbytes, PRICED)) == [COPY, CPU]


def test_split_rows_are_aligned_and_never_empty():
    assert split_rows_of(14336, 0.9) % SPLIT_ROW_ALIGN == 0 and split_rows_of(14336, 0.9) == 12928
    assert split_rows_of(14336, 1e-3) == SPLIT_ROW_ALIGN and split_rows_of(14336, 1.0) == 14336
    assert split_rows_of(48, 0.5) == 48


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_rows_are_the_experts_hidden_rows(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g).to(dtype)
    wg, wu = (torch.randn(128, 64, generator=g).to(dtype) / 8 for _ in range(2))
    want = torch.nn.functional.silu(x.float() @ wg.float().T) * (x.float() @ wu.float().T)
    got = swiglu_rows(x, wg[:64], wu[:64])
    assert got.dtype == dtype and got.shape == (3, 64)
    assert torch.allclose(got.float(), want[:, :64], rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_forced_split_matches_transformers(rt, kind):  # noqa: F811
    s = rt.sizes(kind)
    ref_logits, want = rt.reference(kind)
    llm = LLM(rt.dir(kind), engine_config(accelerator="host", gpu_memory=s.fast(cache_slots=2), cpu_memory="64MiB",
                                          force_expert_path="split"))
    try:
        assert llm.generate([prompt()], GREEDY)[0].token_ids == want
        assert set(llm.experts.path_counts) <= {"split", "resident"} and llm.experts.path_counts["split"] > 0
        assert rel_err(llm.logits(prompt()), ref_logits) <= REL_TOL
        assert llm.experts.cache.stats.bytes_in == 0  # a split expert never fills a cache slot
    finally:
        llm.close()


def test_balanced_plan_splits_single_misses_in_the_engine(rt, tmp_path):  # noqa: F811
    """The production path: a replayed balanced plan whose latency model prices the CPU and the
    link alike; decode layers with one miss take SPLIT, two misses one each way, same tokens."""
    s = rt.sizes("mixtral")
    kw = dict(gpu_memory=s.fast(cache_slots=2), cpu_memory="64MiB")
    llm = LLM(rt.dir("mixtral"), engine_config(accelerator="host", plan="off", **kw))
    plan = llm.plan
    llm.close()
    plan.expert_cache_slots, plan.dispatch_mode = 2, "balanced"  # cache hits leave layers with one miss
    nbytes = s.expert
    plan.dispatch_latency = {"cpu_alpha": 0.0, "cpu_beta": 1e-3, "gpu_alpha": 0.0, "gpu_beta": 0.0,
                             "h2d_alpha": 0.0, "h2d_bandwidth": nbytes / 1e-3, "disk_alpha": 0.0,
                             "disk_bandwidth": float("inf")}
    plan.save(tmp_path / "p.json")
    llm = LLM(rt.dir("mixtral"), engine_config(accelerator="host", plan=str(tmp_path / "p.json"), **kw))
    try:
        assert llm.generate([prompt()], GREEDY)[0].token_ids == rt.reference("mixtral")[1]
        paths = llm.experts.path_counts
        assert paths["split"] > 0 and paths["cpu"] + paths["copy"] > 0
    finally:
        llm.close()


@pytest.mark.parametrize("cpu_alpha", [0.0, 0.99e-3], ids=["slope", "intercept"])
def test_balanced_plan_splits_one_of_two_misses_in_the_engine(rt, tmp_path, cpu_alpha):  # noqa: F811
    """With no cache slots every decode layer misses both experts; with the link twice the CPU's
    time, one goes to the CPU whole and the other is split (its share counting the CPU's expert);
    the tokens are transformers'. "intercept": the CPU's 1 ms a decode expert almost all in the line's
    intercept, as a fitted profile has it (its weight stream): the same split, the CPU's part its share
    of that 1 ms (priced as a fixed cost, it had made the split as slow as the whole expert)."""
    import tiered.runtime.moe_runner as mr

    s = rt.sizes("mixtral")
    kw = dict(gpu_memory=s.fast(cache_slots=0), cpu_memory="64MiB")
    llm = LLM(rt.dir("mixtral"), engine_config(accelerator="host", plan="off", **kw))
    plan = llm.plan
    llm.close()
    plan.expert_cache_slots, plan.dispatch_mode = 0, "balanced"
    plan.dispatch_latency = {"cpu_alpha": cpu_alpha, "cpu_beta": 1e-3 - cpu_alpha, "gpu_alpha": 0.0, "gpu_beta": 0.0,
                             "h2d_alpha": 0.0, "h2d_bandwidth": s.expert / 2e-3, "disk_alpha": 0.0,
                             "disk_bandwidth": float("inf")}
    plan.save(tmp_path / "p.json")
    llm = LLM(rt.dir("mixtral"), engine_config(accelerator="host", plan=str(tmp_path / "p.json"), **kw))
    seen, real = [], mr.dispatch_misses

    def spy(tokens, *a, **k):
        out = real(tokens, *a, **k)
        if tokens == [1, 1]:
            seen.append(out)
        return out
    mr.dispatch_misses = spy
    try:
        assert llm.generate([prompt()], GREEDY)[0].token_ids == rt.reference("mixtral")[1]
    finally:
        mr.dispatch_misses = real
        llm.close()
    assert seen and all(d.paths == [CPU, SPLIT] and d.shares[1] == pytest.approx(0.5) for d in seen)
    assert llm.experts.path_counts["split"] >= len(seen) and llm.experts.path_counts["cpu"] >= len(seen)


def test_bf16_cpu_experts_past_the_native_rows_on_the_standin(rt, monkeypatch):  # noqa: F811
    """bf16 experts on the CPU path of an offloading engine on the strict stand-in: a prompt's experts
    past the machine's native rows (kernels.bf16_native_rows) take torch's GEMMs on the host copies of
    the activations, with no device mixing, and give the logits the native kernel gives (bf16 rounding)."""
    from tiered import kernels
    from tiered.quant.experts import ExpertFormat

    if kernels.load() is None:
        pytest.skip("the native kernels are not built")
    s = rt.sizes("mixtral")
    # no expert resident (explicitly: the budget is the fp32 model's, where bf16 experts all fit beside the rest
    # whenever the plan's workspace leaves room, so the CPU path had run or not by the machine's profile)
    cfg = engine_config(accelerator="host", gpu_memory=s.fast(cache_slots=0), cpu_memory="64MiB", dtype="bfloat16",
                        decode_weights="bf16", expert_weights="bf16", force_expert_path="cpu", resident_experts=0,
                        expert_cache_slots=0)
    calls, real = [], ExpertFormat.forward
    monkeypatch.setattr(ExpertFormat, "forward", lambda self, x, slot: calls.append(
        (self.name, x.shape[0], x.device.type, self.native_rows)) or real(self, x, slot))
    logits = {}
    for rows in (2, 32):  # torch's GEMMs from 3 rows, and the native kernel (8-row groups) throughout
        monkeypatch.setattr(kernels, "bf16_native_rows", lambda rows=rows: rows)
        llm = LLM(rt.dir("mixtral"), cfg)
        try:
            logits[rows] = llm.logits(prompt()).float()
        finally:
            llm.close()
    assert any(name == "bf16" and n > native and dev == "cpu" for name, n, dev, native in calls if native == 2)
    assert all(dev == "cpu" for _, _, dev, _ in calls)
    assert rel_err(logits[2], logits[32]) <= 2e-2


def test_a_prompts_expert_is_never_split():
    """Balanced dispatch splits a decode-sized miss where that pays, never one with a prompt's tokens
    (SPLIT_ROWS_NOTE: the latency model's cpu_prompt_rows, at most PROMPT_GEMM_ROWS where it has none),
    however the latency model prices the split."""
    from tiered.hardware.op_time import PROMPT_GEMM_ROWS

    nbytes = 352 * MB
    flat = LatencyModel(0.0, 4e-3 / 64, 0.0, 0.0, 0.0, nbytes / 4e-3)  # no prompt piece: cpu_prompt_rows inf
    assert split_misses([PROMPT_GEMM_ROWS - 1], flat, nbytes, splittable=True) == [SPLIT]
    assert SPLIT not in split_misses([PROMPT_GEMM_ROWS], flat, nbytes, splittable=True)
    stepped = LatencyModel(0.0, 4e-3 / 16, 0.0, 0.0, 0.0, nbytes / 4e-3, cpu_prompt_rows=16)
    assert split_misses([15], stepped, nbytes, splittable=True) == [SPLIT]
    assert SPLIT not in split_misses([16], stepped, nbytes, splittable=True)
    assert SPLIT not in split_misses([3, 200], stepped, nbytes, splittable=True)[1:]
