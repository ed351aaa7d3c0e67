"""The planner as the engine's default: profiles, plans applied by LLM, replay, and `run`'s output."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from runtime_fixtures import (GREEDY, MAX_CONTEXT, engine_config, kv_bytes, prompt, rel_err, rt,  # noqa: F401
                              stored_elements)

from tiered import LLM, EngineConfig, SamplingParams
from tiered.checkpoint import open_checkpoint
from tiered.cli import app
from tiered.errors import BudgetError, ConfigError
from tiered.hardware.presets import get_preset
from tiered.hardware.profile import HardwareProfile, LinearModel
from tiered.memory import sizes
from tiered.planner.placement import FAST
from tiered.planner.auto import engine_profile, standin_profile, token_assignment
from tiered.planner.cost_model import LayerShape, SliceRates, cost_params
from tiered.planner.plan import Plan
from tiered.planner.cpu_predict import routing_trace
from tiered.planner.plan import Plan
from tiered.planner.scheinfer import solve_n_g
from tiered.runtime.sliced import SlicedMLP, split_rows

CTX = 64


@pytest.fixture(scope="module")
def box(tmp_path_factory) -> str:
    """A made-up fp32 machine, saved as JSON: a CPU (20 GB/s GEMV, 100 GFLOP/s GEMM, 2 GB/s cold
    reads) and a GPU 20x faster behind a 10 GB/s link, launch 1 us (the stand-in runs its plans)."""
    m = {"gemm/gpu/fp32": LinearModel(1e-6, 1e-12, 1.0), "gemv/gpu/fp32": LinearModel(0.0, 2.5e-12, 1.0),
         "copy/h2d_pinned": LinearModel(1e-6, 1e-10, 1.0), "launch/gpu": LinearModel(1e-6, 0.0),
         "memory/bandwidth/gpu": LinearModel(0.0, 2.5e-12, 1.0),"gemm/cpu/fp32": LinearModel(1e-5, 2e-11, 1.0), "gemv/cpu/fp32": LinearModel(0.0, 5e-11, 1.0),
         "attn/cpu/fp32": LinearModel(0.0, 1e-10, 1.0), "memory/bandwidth/cpu": LinearModel(0.0, 5e-11, 1.0),
         "memory/copy/cpu": LinearModel(0.0, 1e-10, 1.0), "disk/read_cold": LinearModel(1e-4, 5e-10, 1.0),
         "launch/cpu": LinearModel(1e-6, 0.0), "runtime/task": LinearModel(5e-5, 0.0)}
    path = tmp_path_factory.mktemp("hw") / "box.json"
    HardwareProfile("box", "test", m, 8 * 2**30, 16 * 2**30).save(path)
    return str(path)


def dense_sizes(path, max_context: int = CTX) -> tuple[int, int, int, int]:
    """(non-FFN weight bytes, one layer's FFN bytes, KV cache of one sequence, layers), fp32."""
    cfg = open_checkpoint(path).config
    non_ffn = 4 * stored_elements(path, lambda n: ".mlp." not in n)
    rotary = sizes.rotary_bytes(cfg, max_context)  # RoPE cos/sin tables, fp32 (Gemma 3: two pairs)
    room = kv_bytes(cfg, max_context) + rotary + sizes.workspace_bytes(cfg, "fp32")  # + the accelerator's activations
    return non_ffn, 3 * cfg.hidden_size * cfg.intermediate_size * 4, room, cfg.num_hidden_layers


# ------------------------------------------------------------------ dense: ScheInfer slicing in the engine
@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: sliced GeGLU MLPs (SlicedMLP.act)
def test_dense_plan_slices_ffns_and_matches_transformers(zoo, box, arch):
    path = zoo.dir(arch)
    non_ffn, layer, kv, L = dense_sizes(path)
    gpu = non_ffn + kv + layer + layer * L // 4  # staging (one FFN) + a quarter of the FFN weights
    llm = LLM(path, EngineConfig(decode_weights="fp32", accelerator="host", gpu_memory=gpu, max_context=CTX,
                                 profile=box, trace=True))
    try:
        sliced = [l for l in llm.plan.layers if l.r_gg < 1]
        assert sliced and len(llm.sliced) == len(sliced)
        # the staging the runtime allocates (the largest CG and the largest CC rows) is what the plan kept
        # room for: at most one FFN's bytes and two rows, not two FFNs
        staging = llm.model.model.layers[sliced[0].layer].mlp.staging
        staged = sum(t.numel() * t.element_size() for part in (staging.cg, staging.cc) if part for t in part)
        F = llm.config.intermediate_size
        assert staged <= layer * (F + 2) / F
        assert llm.plan.memory["gpu"] <= gpu and gpu - llm.fast_budget.peak < layer  # the rest went to GG rows
        assert llm.plan.pinned == "cuda" and llm.accelerator.pinned == "cuda"  # sliced: cudaHostAlloc (Plan.pinned)
        for lp in sliced:  # each planned layer runs as a SlicedMLP with the plan's row split
            mlp = llm.model.model.layers[lp.layer].mlp
            assert isinstance(mlp, SlicedMLP)
            assert (mlp.f_cc, mlp.f_cg, mlp.f_gg) == split_rows(llm.config.intermediate_size, lp.r_cc, lp.r_cg)
        assert sum(l.r_gg for l in llm.plan.layers) < L  # not everything fits: the plan had to slice
        ids = list(range(2, 18))
        hf = zoo.hf(arch)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
            want = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12, eos_token_id=None,
                               pad_token_id=0)[0, len(ids):].tolist()
        assert rel_err(llm.logits(ids), ref) <= 1e-4
        out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        assert out.token_ids == want
        assert llm.fast_budget.peak <= gpu
        streams = {e.stream for e in llm.trace_events()}
        assert "compute" in streams and ("cpu" in streams or all(l.r_cc == 0 for l in sliced))
    finally:
        llm.close()


def test_dense_plan_without_room_for_non_ffn_weights_is_a_budget_error(zoo, box):
    path = zoo.dir("llama")
    non_ffn, layer, kv, L = dense_sizes(path)
    with pytest.raises(BudgetError, match="non-FFN weights"):
        LLM(path, EngineConfig(decode_weights="fp32", accelerator="host", gpu_memory=non_ffn // 2, max_context=CTX,
                               profile=box))


def test_dense_model_that_fits_is_not_sliced(zoo, box):
    llm = LLM(zoo.dir("llama"), EngineConfig(decode_weights="fp32", accelerator="host", max_context=CTX,
                                             profile=box))
    assert llm.plan is not None and not llm.sliced and all(l.r_gg == 1 for l in llm.plan.layers)
    llm.close()


# ------------------------------------------------------------------ MoE: the plan -> runtime hand-off
def _budgets(s, accelerator, cache_slots, resident, cpu_experts=4):
    fast = s.fast(cache_slots=cache_slots, resident=resident, accelerator=accelerator != "none")
    return dict(cpu_memory=fast) if accelerator == "none" else dict(gpu_memory=fast, cpu_memory=s.cpu(experts=cpu_experts))


@pytest.mark.parametrize("accelerator", ["none", "host"])
def test_runtime_applies_a_hand_edited_plan_bit_for_bit(rt, box, accelerator, tmp_path):
    """A plan edited by hand (the resident set moved to other experts, another cache size, a forced
    dispatch) is what the runtime does: nothing re-derives a decision. The replayed plan is the saved
    one, field for field, and greedy output still matches transformers."""
    s = rt.sizes("mixtral")
    kw = _budgets(s, accelerator, cache_slots=2, resident=5)
    first = LLM(rt.dir("mixtral"), engine_config(accelerator=accelerator, profile=box, expert_cache_slots=2, **kw))
    plan = first.plan
    first.close()
    assert plan.source == "planner" and plan.resident_experts() == 5
    # the planner fills the resident set in layer order: reverse each layer's tiers instead, move a
    # resident expert's room into a cache slot, and (with an accelerator) send every miss to the CPU
    for l in plan.layers:
        l.expert_tiers = l.expert_tiers[::-1]
    moved = next((l, e) for l in plan.layers for e, t in enumerate(l.expert_tiers) if t == FAST)
    moved[0].expert_tiers[moved[1]] = "disk"
    plan.expert_cache_slots += 1
    if accelerator == "host":
        plan.dispatch_mode = "cpu"
    path = tmp_path / "edited.json"
    plan.save(path)
    llm = LLM(rt.dir("mixtral"), engine_config(accelerator=accelerator, plan=str(path), offload_dir=str(tmp_path), **kw))
    try:
        assert llm.plan.to_json() == path.read_text()
        want = {(l.layer, e): t for l in plan.layers for e, t in enumerate(l.expert_tiers)}
        assert llm.experts.placement.tiers == want
        assert set(llm.experts.store.resident) == {k for k, t in want.items() if t == FAST}
        assert llm.experts.cache.num_slots == plan.expert_cache_slots
        assert llm.fast_budget.peak <= llm.fast_budget.capacity
        assert llm.generate(prompt(), GREEDY)[0].token_ids == rt.reference("mixtral")[1]
        if accelerator == "host":
            assert llm.experts.latency == plan.latency_model() and set(llm.experts.path_counts) == {"resident", "cpu"}
    finally:
        llm.close()


def test_a_plans_expert_group_rows_reach_the_experts_format_and_the_native_step(rt, tmp_path):
    """Plan.expert_group_rows (the rows of a tiled int4 CPU expert's groups before the AMX GEMM, priced per model:
    planner/make.expert_group_rows) is what the runtime applies: the experts' format caps its groups there and the
    native step's MoE blocks take it as their AMX bound; a plan of 0 keeps the kernel tuning's rows."""
    from tiered.kernels import available
    from tiered.models.moe import MoEBlock
    from tiered.quant.experts import NATIVE_ROWS

    if not available():
        pytest.skip("tiered/kernels is not built: no tiled int4 experts")
    kw = dict(dtype="float32", expert_weights="int4", accelerator="none", max_context=512)
    first = LLM(rt.dir("qwen3_moe"), engine_config(**kw))
    plan = first.plan
    runner = next(m.runner for m in first.model.modules() if isinstance(m, MoEBlock))
    tuned = runner.fmt.grouped_rows if plan.expert_group_rows == 0 else None
    out = first.generate(prompt(), GREEDY)[0].token_ids
    first.close()
    plan.expert_group_rows = NATIVE_ROWS + 4
    plan.save(tmp_path / "p.json")
    llm = LLM(rt.dir("qwen3_moe"), engine_config(plan=str(tmp_path / "p.json"), **kw))
    try:
        runner = next(m.runner for m in llm.model.modules() if isinstance(m, MoEBlock))
        assert runner.fmt.group_rows_limit == NATIVE_ROWS + 4
        assert runner.fmt.grouped_rows == (NATIVE_ROWS + 4 if tuned is None else min(tuned, NATIVE_ROWS + 4))
        assert llm.generate(prompt(), GREEDY)[0].token_ids == out  # a short prompt: groups either way
    finally:
        llm.close()


def _balanced_engine(rt, tmp_path, cpu_s: float, link_s: float):
    """An engine on the stand-in from a saved plan of no resident experts and no cache, its misses
    dispatched "balanced" with a latency model of cpu_s seconds an expert on the CPU and link_s over
    the link (the GPU instant)."""
    s = rt.sizes("mixtral")
    kw = dict(gpu_memory=s.fast(cache_slots=0), cpu_memory="64MiB")
    llm = LLM(rt.dir("mixtral"), engine_config(accelerator="host", plan="off", **kw))
    plan = llm.plan
    llm.close()
    assert plan.resident_experts() == 0 and plan.dispatch_mode == "per-expert"
    plan.expert_cache_slots = 0
    plan.dispatch_mode = "balanced"
    plan.dispatch_latency = {"cpu_alpha": cpu_s, "cpu_beta": 0.0, "gpu_alpha": 0.0, "gpu_beta": 0.0,
                             "h2d_alpha": link_s, "h2d_bandwidth": float("inf"), "disk_alpha": 0.0,
                             "disk_bandwidth": float("inf")}
    plan.save(tmp_path / "p.json")
    return LLM(rt.dir("mixtral"), engine_config(accelerator="host", plan=str(tmp_path / "p.json"), **kw)), plan


def test_balanced_dispatch_splits_a_layers_misses(rt, tmp_path):
    """The production dispatch path: with CPU and link equally fast, two misses of a decode step go one
    to the CPU and one over the link (Fiddler's per-expert rule would send both the same way)."""
    from tiered.runtime.dispatcher import LatencyModel

    llm, plan = _balanced_engine(rt, tmp_path, 1e-3, 1e-3)
    try:
        assert llm.experts.latency == LatencyModel(**plan.dispatch_latency)
        one_token = [p for p in _decode_paths(llm)]
        assert one_token and all(sorted(p) == ["copy", "cpu"] for p in one_token)
        assert llm.experts.host_syncs > 0
    finally:
        llm.close()


def test_balanced_dispatch_keeps_both_misses_on_the_cpu_where_a_mix_gains_little(rt, tmp_path):
    """The H100 host's rates (CPU 3.47 ms, link 6.41 ms an expert): one miss each way is priced 6.41 ms
    against 6.94 for both on the CPU, less than MIX_GAIN's 10%, and measured slower there (10.1 ms a layer
    against 8.7). The engine's decode layers with two misses run both on the CPU, with the same tokens."""
    llm, _ = _balanced_engine(rt, tmp_path, 3.47e-3, 6.41e-3)
    try:
        one_token = [p for p in _decode_paths(llm)]
        assert one_token and all(p == ["cpu", "cpu"] for p in one_token)
    finally:
        llm.close()


def _decode_paths(llm):
    """Paths the runner chose for each decode-step layer with two misses (a spy on dispatch_misses)."""
    import tiered.runtime.moe_runner as mr

    seen, real = [], mr.dispatch_misses

    def spy(tokens, *a, **kw):
        out = real(tokens, *a, **kw)
        if tokens == [1, 1]:
            seen.append(out.paths)
        return out
    mr.dispatch_misses = spy
    try:
        assert llm.generate(prompt(), GREEDY)[0].token_ids == llm_reference(llm)
    finally:
        mr.dispatch_misses = real
    return seen


def llm_reference(llm):
    from runtime_fixtures import _ZOO
    return _ZOO.reference("mixtral")[1]


def test_no_host_copy_of_activations_when_no_expert_takes_the_cpu(rt):
    """Every miss copied: the activations never cross to the host (no D2H, no device-wide sync)."""
    s = rt.sizes("mixtral")
    llm = LLM(rt.dir("mixtral"), engine_config(accelerator="host", gpu_memory=s.fast(cache_slots=2),
                                               cpu_memory="64MiB", force_expert_path="copy"))
    try:
        assert llm.plan.dispatch_mode == "copy"
        assert llm.generate(prompt(), GREEDY)[0].token_ids == rt.reference("mixtral")[1]
        assert llm.experts.path_counts["copy"] > 0 and llm.experts.host_syncs == 0
    finally:
        llm.close()


def test_explicit_settings_win_over_the_plan(rt, box):
    s = rt.sizes("mixtral")
    llm = LLM(rt.dir("mixtral"), engine_config(cpu_memory=s.fast(cache_slots=4, resident=4, accelerator=False), profile=box,
                                               expert_cache_slots=1, resident_experts=3))
    assert (llm.experts.placement.cache_slots, llm.experts.placement.count(FAST)) == (1, 3)
    assert (llm.plan.expert_cache_slots, llm.plan.resident_experts()) == (1, 3)
    llm.close()


def test_plan_off_and_bad_plan_file(rt, tmp_path):
    llm = LLM(rt.dir("mixtral"), engine_config(plan="off"))
    assert llm.plan.source == "rules" and llm.plan.dispatch_mode == "per-expert"
    llm.close()
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read plan"):
        LLM(rt.dir("mixtral"), engine_config(plan=str(tmp_path / "bad.json")))


@pytest.mark.parametrize("weights", ["bfloat16", "float32"])
def test_plan_off_calibrates_the_cpu_side_through_the_runtimes_own_cpu_expert(rt, monkeypatch, weights):
    """`--plan off` times its CPU experts with the path the runtime will run (ExpertFormat.forward: the
    native kernel at few bf16 rows), not torch's GEMMs: timed with torch's bf16 GEMV, at about half the
    native kernel's speed on the H100's host, the rules once sent every miss to the link (18.4 tok/s
    against 33 with the CPU path)."""
    from tiered.quant.experts import ExpertFormat
    import tiered.runtime.calibrate as calib

    seen = []
    real = ExpertFormat.forward

    def spy(self, x, slot):
        seen.append((self.name, x.shape[0]))
        return real(self, x, slot)
    monkeypatch.setattr(ExpertFormat, "forward", spy)
    torn, gemms = [], calib.expert_forward
    monkeypatch.setattr(calib, "expert_forward", lambda x, *w: torn.append(x.device.type) or gemms(x, *w))
    s = rt.sizes("mixtral")
    llm = LLM(rt.dir("mixtral"), engine_config(plan="off", accelerator="host", dtype=weights, cpu_memory="64MiB",
                                               gpu_memory=s.fast(cache_slots=2)))
    try:
        fmt = "bf16" if weights == "bfloat16" else "fp32"
        assert llm.plan.dtypes["experts"] == fmt and llm.plan.dispatch_latency is not None
        assert {n for n, _ in seen} == {fmt} and {t for _, t in seen} >= {1, 16}
        assert torn and "cpu" not in torn  # torch's GEMMs time the accelerator's side only
    finally:
        llm.close()


# ------------------------------------------------------------------ profiles
def test_engine_profile_sources(tmp_path, monkeypatch):
    assert engine_profile("scheinfer-b").name == "scheinfer-b"
    saved = tmp_path / "hw.json"
    get_preset("t4-pcie3").save(saved)
    assert engine_profile(str(saved)).name == "t4-pcie3"
    with pytest.raises(ConfigError, match="neither a file nor a preset"):
        engine_profile("no-such-machine")
    # nothing cached: measured once, saved, then read back without measuring again
    monkeypatch.setenv("TIERED_CACHE", str(tmp_path / "cache"))
    calls = []
    from tiered.hardware.profiler import PROFILER_VERSION
    from tiered.kernels import available as native_kernels
    from tiered.kernels import build_name
    from tiered.kernels import tuning as kernel_tuning
    build = build_name() if native_kernels() else None
    tuning = kernel_tuning()  # the extension's switches and the Python-side bf16_native_rows
    fake = HardwareProfile("measured", "test", {"gemm/cpu/fp32": LinearModel(0.0, 1e-11, 1.0)},
                           meta={"profiler_version": PROFILER_VERSION, "native_kernels": native_kernels(),
                                 "kernels_build": build, "kernel_tuning": tuning})
    monkeypatch.setattr("tiered.hardware.profiler.profile_machine", lambda **kw: calls.append(kw) or fake)
    said = []
    assert engine_profile(None, progress=said.append).name == "measured"
    assert (tmp_path / "cache" / "hardware_profile.json").is_file() and len(calls) == 1 and said
    assert engine_profile(None).name == "measured" and len(calls) == 1
    # a cached profile measured by an older profiler (other meanings of its keys) is measured again
    HardwareProfile("old", "test", {"gemm/cpu/fp32": LinearModel(0.0, 1e-11, 1.0)}).save(
        tmp_path / "cache" / "hardware_profile.json")
    assert engine_profile(None).name == "measured" and len(calls) == 2
    # ... and so is one measured with other kernels than this machine now runs (native or not)
    HardwareProfile("other", "test", {"gemm/cpu/fp32": LinearModel(0.0, 1e-11, 1.0)},
                    meta={"profiler_version": PROFILER_VERSION, "native_kernels": not native_kernels()}).save(
        tmp_path / "cache" / "hardware_profile.json")
    assert engine_profile(None).name == "measured" and len(calls) == 3
    if native_kernels():  # ... and one whose native keys timed an earlier build of the kernels
        HardwareProfile("stale", "test", {"gemm/cpu/fp32": LinearModel(0.0, 1e-11, 1.0)},
                        meta={"profiler_version": PROFILER_VERSION, "native_kernels": True,
                              "kernels_build": "tiered_kernels_0000000000000000"}).save(
            tmp_path / "cache" / "hardware_profile.json")
        assert engine_profile(None).name == "measured" and len(calls) == 4
        # ... and one measured under another kernel tuning of this machine (tiered/kernels/tune.py)
        other = {k: not v for k, v in tuning.items()}
        HardwareProfile("retuned", "test", {"gemm/cpu/fp32": LinearModel(0.0, 1e-11, 1.0)},
                        meta={"profiler_version": PROFILER_VERSION, "native_kernels": True,
                              "kernels_build": build, "kernel_tuning": other}).save(
            tmp_path / "cache" / "hardware_profile.json")
        assert engine_profile(None).name == "measured" and len(calls) == 5



def test_a_profile_whose_cpu_timings_raised_is_measured_again(tmp_path, monkeypatch):
    """A cached profile that skipped a key every plan needs because its timing raised (profiler.failed_cpu_keys:
    once an error inside the kernel tuning left one without gemm/cpu/int8, and every plan of an int8 model then
    raised ConfigError) is measured again, told to the user, SKIP_RETRIES profiles in a row at most; a skip
    of a key the machine may lack (the GPU's, the host-share probe) keeps it."""
    from tiered.hardware import profiler
    from tiered.kernels import available as native_kernels
    from tiered.kernels import build_name
    from tiered.kernels import tuning as kernel_tuning

    monkeypatch.setenv("TIERED_CACHE", str(tmp_path))
    base = {"profiler_version": profiler.PROFILER_VERSION, "native_kernels": native_kernels(),
            "kernels_build": build_name() if native_kernels() else None, "kernel_tuning": kernel_tuning()}
    failing = {"skipped": {"gemm/cpu/int8": "RuntimeError: Inplace update to inference tensor"}}
    outcome = {}
    calls = []

    def measure(**kw):  # the new profile fails as `outcome` says, counted as the profiler counts it
        calls.append(kw)
        meta = {**base, **outcome}
        return HardwareProfile("again", "test", {"gemm/cpu/fp32": LinearModel(0.0, 1e-11, 1.0)},
                               meta={**meta, **profiler.failure_record(meta, kw["previous"].meta)})
    monkeypatch.setattr(profiler, "profile_machine", measure)
    path = tmp_path / "hardware_profile.json"
    HardwareProfile("cached", "test", {}, meta={**base, **failing, "failed_attempts": 1}).save(path)
    said = []
    outcome.update(failing)  # it fails again: counted on, then kept
    assert engine_profile(None, progress=said.append).name == "again" and len(calls) == 1
    assert "failed to time gemm/cpu/int8" in said[0]
    assert HardwareProfile.load(path).meta["failed_attempts"] == 2 == profiler.SKIP_RETRIES
    assert engine_profile(None).name == "again" and len(calls) == 1  # SKIP_RETRIES in a row: kept
    HardwareProfile("cached", "test", {}, meta={**base, **failing, "failed_attempts": 1}).save(path)
    outcome.clear()  # ... or it succeeds: counted from 0
    assert engine_profile(None).name == "again" and HardwareProfile.load(path).meta["failed_attempts"] == 0
    for skipped in ({"host_share": "RuntimeError: no GPU"}, {}):  # nothing every plan needs: kept
        HardwareProfile("cached", "test", {}, meta={**base, "skipped": skipped}).save(path)
        assert engine_profile(None).name == "cached"
    assert profiler.failure_record({"skipped": {"gemv/cpu/int4": "x"}}, None) == {"failed_attempts": 1}


def test_a_profile_measured_while_other_processes_took_the_cores_is_measured_again(tmp_path, monkeypatch):
    """A cached profile whose meta says other processes took more than CONTENDED_SHARE of the cores
    while it was measured (hardware/contention.record) is measured again when the engine plans on a
    quiet machine (contention.quiet_now), told to the user, its attempts counted on; on a busy machine,
    or without /proc/stat, it is kept (a new one would be disturbed too), whatever its attempts; an
    uncontended one and one saved before the fields existed are kept."""
    from tiered.hardware import contention
    from tiered.hardware.profiler import PROFILER_VERSION
    from tiered.kernels import available as native_kernels
    from tiered.kernels import build_name
    from tiered.kernels import tuning as kernel_tuning

    monkeypatch.setenv("TIERED_CACHE", str(tmp_path))
    base = {"profiler_version": PROFILER_VERSION, "native_kernels": native_kernels(),
            "kernels_build": build_name() if native_kernels() else None, "kernel_tuning": kernel_tuning()}
    calls = []

    def measure(**kw):
        calls.append(kw)
        prev = kw["previous"]
        return HardwareProfile("again", "test", {"gemm/cpu/fp32": LinearModel(0.0, 1e-11, 1.0)},
                               meta={**base, **contention.record(contention.start(), prev and prev.meta)})
    monkeypatch.setattr("tiered.hardware.profiler.profile_machine", measure)
    path = tmp_path / "hardware_profile.json"
    busy = dict(others_share=0.55, contended=True)
    for fields, quiet, kept in ((dict(others_share=0.1, contended=False, attempts=1), True, True),
                                (dict(busy, attempts=1), True, False),
                                (dict(busy, attempts=contention.RETRIES), True, False),
                                (dict(busy, attempts=1), False, True),
                                (dict(busy, attempts=2), None, True),
                                ({}, True, True)):
        monkeypatch.setattr(contention, "quiet_now", lambda q=quiet: q)
        HardwareProfile("cached", "test", {"gemm/cpu/fp32": LinearModel(0.0, 1e-11, 1.0)},
                        meta={**base, **fields}).save(path)
        said, n = [], len(calls)
        hw = engine_profile(None, progress=said.append)
        assert (hw.name == "cached") is kept and len(calls) == n + (not kept), (fields, quiet)
        if not kept:
            assert calls[-1]["previous"].meta["attempts"] == fields["attempts"]
            assert "other processes took 55% of the cores" in said[0]
            assert HardwareProfile.load(path).meta["attempts"] == fields["attempts"] + 1  # counted on


def test_standin_profile_mirrors_cpu_keys_and_link():
    cpu = HardwareProfile("box", "test", {"gemm/cpu/fp32": LinearModel(1e-4, 1e-11, 1.0),
                                          "gemv/cpu/fp32": LinearModel(0.0, 5e-11, 1.0),
                                          "runtime/task": LinearModel(2e-4, 0.0)}, None, 8 * 2**30)
    hw = standin_profile(cpu, link_bandwidth=4e9)
    assert hw.models["gemm/gpu/fp32"] == cpu.models["gemm/cpu/fp32"]
    assert hw.models["gemv/gpu/fp32"] == cpu.models["gemv/cpu/fp32"]
    assert hw.models["copy/h2d_pinned"].beta == pytest.approx(1 / 4e9)
    assert hw.models["launch/gpu"].alpha == 2e-4 and hw.gpu_memory == 8 * 2**30


# ------------------------------------------------------------------ per-prompt token assignment, routing traces
def test_token_assignment_is_eq15_per_prompt_length():
    from tiered.planner.plan import LayerPlan

    hw = get_preset("scheinfer-a")
    plan = Plan("m", "latency", hw.name, 1, None, 256, 16, "fp16",
                layers=[LayerPlan(0, "dense", "fp16", r_cc=0.4, r_cg=0.2, r_gg=0.4, n_g=40)])

    class Cfg:
        hidden_size, intermediate_size = 4096, 11008
    n_g = token_assignment(plan, Cfg, hw)
    for T in (1, 64, 256, 1024):
        shape = LayerShape(T, 4096, 11008, 3, 2.0)
        assert n_g(0, T) == solve_n_g(shape, SliceRates(0.4, 0.2, 0.4), cost_params(hw, "fp16", shape)).n_g
    replay = token_assignment(plan, Cfg, None)  # no profile: the planned n_g scaled to the prompt
    assert replay(0, 512) == 80 and replay(0, 256) == 40 and replay(1, 256) == 0


def test_routing_trace_follows_popularity():
    pop = np.ones((2, 8))
    pop[1, 3] = 50.0
    trace = routing_trace([0, 1], 8, 2, 400, pop)
    assert trace == routing_trace([0, 1], 8, 2, 400, pop)  # seeded
    assert all(len(set(e)) == 2 and all(0 <= x < 8 for x in e) for _, _, e in trace)
    hot = sum(3 in e for l, _, e in trace if l == 1) / 400
    cold = sum(3 in e for l, _, e in trace if l == 0) / 400
    assert hot > 0.9 and cold < 0.5


def test_routing_trace_opens_with_the_prompt_whose_copies_fill_the_cache():
    """The prompt's prefill heads the trace (its active experts per layer, as many tokens as the prompt)
    and leaves the decode draws as they were; its copied misses fill the cache, so a decode whose
    misses all run on the CPU still hits what the prompt brought in, and one with no copies at all
    hits nothing (the runtime's rule: only copied misses claim a slot)."""
    from tiered.planner.cpu_predict import simulate_hits

    plain = routing_trace([0, 1], 8, 2, 100)
    trace = routing_trace([0, 1], 8, 2, 100, prompt_tokens=512)
    assert [t for t in trace if t[1] == 1] == plain
    assert trace[:2] == [(0, 512, list(range(8))), (1, 512, list(range(8)))]  # 512 tokens touch every expert
    short = routing_trace([0, 1], 8, 2, 100, prompt_tokens=2)[:2]
    assert all(t == 2 and 2 <= len(e) <= 4 for _, t, e in short)

    def prompt_copies(tokens):  # prefill misses (many tokens) are copied, decode's (one token) run on the CPU
        return [s > 1 for s in tokens]

    warm = simulate_hits(trace, set(), 4, copied=prompt_copies)
    cold = simulate_hits(plain, set(), 4, copied=prompt_copies)
    assert sum(cold.cache.values()) == 0
    assert 0.15 < warm.fast_share() < 0.35  # 4 of 16 experts, drawn uniformly
    assert sum(simulate_hits(trace, set(), 4, copied=lambda tokens: [False] * len(tokens)).cache.values()) == 0



def test_decode_is_priced_again_at_a_runs_context(zoo, box, monkeypatch):
    """LLM.predicted_decode_at (planner/auto.decode_at): the plan made again with the same arguments at
    another context. At the plan's own priced positions it gives the plan's figure; fewer cached
    positions price faster (the attention reads less KV cache); a plan of the runtime's rules, a
    replayed plan, or one the planner would decide differently at that context gives None."""
    from tiered.planner import auto

    path = zoo.dir("llama")
    llm = LLM(path, EngineConfig(accelerator="none", max_context=CTX, profile=box))
    plan = llm.plan
    priced = plan.prompt_tokens + plan.gen_tokens
    assert llm.predicted_decode_at(priced) == pytest.approx(plan.predicted_decode_tokens_per_s, rel=1e-9)
    assert llm.predicted_decode_at(4) > llm.predicted_decode_at(priced)
    assert LLM(path, EngineConfig(accelerator="none", max_context=CTX, plan="off")).predicted_decode_at(4) is None
    saved = zoo.root / "decode_at_plan.json"
    plan.save(saved)
    assert LLM(path, EngineConfig(accelerator="none", max_context=CTX, plan=str(saved))).predicted_decode_at(4) is None
    real = auto.make_plan

    def one_more_slot(*a, **kw):  # the same plan but another decision: not a prediction for this engine
        p = real(*a, **kw)
        p.expert_cache_slots += 1
        return p
    monkeypatch.setattr(auto, "make_plan", one_more_slot)
    assert llm.predicted_decode_at(4) is None

    def other_prompt_path(*a, **kw):  # a short prompt attended in another dtype, run as more rows: decode as before
        p = real(*a, **kw)
        p.dtypes["prompt_attention"] = "fp32" if p.dtypes.get("prompt_attention") != "fp32" else "bf16"
        p.dtypes["prompt_ffn"] = "fp32" if p.dtypes.get("prompt_ffn") != "fp32" else "bf16"
        p.mixed_rows += 64
        p.prefill_chunk += 1
        return p
    monkeypatch.setattr(auto, "make_plan", real)
    expected = llm.predicted_decode_at(4)
    monkeypatch.setattr(auto, "make_plan", other_prompt_path)
    assert llm.predicted_decode_at(4) == pytest.approx(expected, rel=1e-9)
    assert llm.predicted_ttft_at(4) is None  # ... but a prompt's price is for the prompt path it runs


def test_a_given_profile_of_the_other_cpu_step_is_said(zoo, box, tmp_path, monkeypatch):
    """A given profile measured with(out) tiered's native kernels while this process runs without
    (with) them prices a step other than the one that runs: the plan says so; a profile of the step
    that runs says nothing of it (this machine's own profile is measured again instead:
    test_engine_profile_sources)."""
    from tiered.planner import auto

    path = zoo.dir("llama")
    with_kernels = tmp_path / "native.json"
    hw = HardwareProfile.load(box)
    replace(hw, meta={"native_kernels": True}).save(with_kernels)
    note = "this process runs with{} them"
    for available in (True, False):
        monkeypatch.setattr(auto.kernels, "available", lambda a=available: a)
        for profile, native in ((box, False), (str(with_kernels), True)):
            plan = LLM(path, EngineConfig(accelerator="none", max_context=CTX, profile=profile,
                                          decode_weights="fp32")).plan
            said = [n for n in plan.notes if "native kernels" in n]
            assert plan.native_decode == available
            if native == available:
                assert not said
            else:
                assert len(said) == 1 and note.format("" if available else "out") in said[0]

def test_a_cpu_plan_prices_a_servers_full_step(zoo, box):
    """With max_batch sequences (serve's --max-batch) a CPU plan also prices their steps together
    (cpu_predict.predict_decode's batch): more tokens/s than one sequence, fewer than max_batch
    separate ones; the summary and the rendered plan say it; one sequence prices none."""
    path = zoo.dir("llama")
    one = LLM(path, EngineConfig(accelerator="none", max_context=CTX, profile=box, decode_weights="fp32")).plan
    four = LLM(path, EngineConfig(accelerator="none", max_context=CTX, profile=box, decode_weights="fp32",
                                  max_batch=4)).plan
    assert one.predicted_batch_decode_tokens_per_s is None and "sequences at once" not in one.summary()
    batch = four.predicted_batch_decode_tokens_per_s
    assert four.kv_slots == 4 and one.predicted_decode_tokens_per_s < batch < 4 * one.predicted_decode_tokens_per_s
    assert f"{batch:.1f} tok/s over 4 sequences at once" in four.summary() and "over 4 sequences" in four.render()
    assert Plan.from_json(four.to_json()) == four


def test_a_servers_step_is_priced_on_the_activations_its_int4_rows_read(zoo, box, tmp_path):
    """Plan.batch_act reaches the batched step's price: int4 decode copies in a server's steps read int8
    activations ("auto" with max_batch > 1), priced by decode_rows/cpu/int4q8 (on 2 AMX cores 3.4x cheaper
    a row than bf16 activations' decode_rows/cpu/int4, which had priced an 8-sequence SmolLM2 step 43% slow)."""
    hw = HardwareProfile.load(box)
    m = dict(hw.models, **{"gemv/cpu/int4": LinearModel(0.0, 5e-11, 1.0), "gemv/cpu/int4q8": LinearModel(0.0, 5e-11, 1.0),
                           "gemm/cpu/int4": LinearModel(1e-5, 2e-11, 1.0),
                           "decode_rows/cpu/int4": LinearModel(0.0, 4e-11, 1.0),
                           "decode_rows/cpu/int4q8": LinearModel(0.0, 1e-11, 1.0)})
    rows = tmp_path / "rows.json"
    HardwareProfile("rows", "test", m, hw.gpu_memory, hw.cpu_memory, meta={"native_kernels": True}).save(rows)
    path = zoo.dir("llama")

    def plan(**kw):
        return LLM(path, EngineConfig(accelerator="none", max_context=CTX, profile=str(rows), decode_weights="int4",
                                      max_batch=4, **kw)).plan
    auto, q8, bf16 = plan(), plan(batch_activations="q8"), plan(batch_activations="bf16")
    assert (auto.batch_act, q8.batch_act, bf16.batch_act) == ("q8", "q8", "bf16")
    assert auto.predicted_batch_decode_tokens_per_s == q8.predicted_batch_decode_tokens_per_s
    assert q8.predicted_batch_decode_tokens_per_s > 1.2 * bf16.predicted_batch_decode_tokens_per_s
    assert q8.predicted_decode_tokens_per_s == bf16.predicted_decode_tokens_per_s  # one row reads bf16


def test_prompts_attend_in_the_plans_format_and_decode_steps_as_before(zoo, box, tmp_path, monkeypatch):
    """Plan.dtypes["prompt_attention"] reaches the model (runtime/install -> models/layers.set_prompt_attention):
    with int4 decode copies (fp32 activations, a bf16 KV cache) and a profile pricing torch's bf16 attention
    below its fp32 one, the prompt's forward attends in bf16 over the cache as held, its decode steps and the
    lossless scoring (an fp32 cache) in fp32; the logits stay within bf16 rounding of the fp32 attention's.
    A profile pricing bf16 the slower keeps every step in fp32."""
    from tiered.models import layers

    hw = HardwareProfile.load(box)

    def engine(bf16: float) -> LLM:
        m = dict(hw.models, **{"gemv/cpu/int4": LinearModel(0.0, 5e-11, 1.0),
                               "gemm/cpu/int4": LinearModel(1e-5, 2e-11, 1.0),
                               "attn_prefill/cpu/fp32": LinearModel(1e-5, 2e-11, 1.0),
                               "attn_prefill/cpu/bf16": LinearModel(1e-5, bf16, 1.0)})
        path = tmp_path / f"attn{bf16}.json"
        HardwareProfile("attn", "test", m, hw.gpu_memory, hw.cpu_memory).save(path)
        return LLM(zoo.dir("llama"), EngineConfig(accelerator="none", max_context=CTX, profile=str(path),
                                                  decode_weights="int4"))

    seen = []
    real = layers.attend
    monkeypatch.setattr(layers, "attend", lambda q, k, *a: seen.append((q.shape[2], q.dtype, k.dtype)) or
                        real(q, k, *a))
    ids = torch.randint(2, zoo.vocab_size, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    fast, slow = engine(5e-12), engine(5e-11)
    assert (fast.plan.dtypes["prompt_attention"], slow.plan.dtypes["prompt_attention"]) == ("bf16", "fp32")
    assert fast.plan.dtypes["kv_cache"] == "bf16" and fast.dtype == torch.float32
    seen.clear()
    got = fast.logits(ids, lossless=False)  # one forward of the prompt over the plan's cache
    assert set(seen) == {(len(ids), torch.bfloat16, torch.bfloat16)}
    seen.clear()
    ref = slow.logits(ids, lossless=False)
    assert set(seen) == {(len(ids), torch.float32, torch.float32)}
    # bf16 rounds the queries and the probabilities to 2^-9; the tiny random model's logits moved 3.1% (max
    # over the vocabulary, relative to the largest), as far from the lossless fp32 cache's as the fp32 attention's
    lossless = slow.logits(ids)
    assert 0 < rel_err(got, ref) < 6e-2 and rel_err(got, lossless) < 1.5 * rel_err(ref, lossless)
    seen.clear()
    fast.logits(ids)  # lossless: an fp32 cache, attended in fp32
    assert {s[1:] for s in seen} == {(torch.float32, torch.float32)}
    with monkeypatch.context() as m:  # the modules' decode steps (not the native step's rows)
        m.setattr(fast.plan, "mixed_rows", 0)
        seen.clear()
        fast.generate([ids], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert (len(ids), torch.bfloat16, torch.bfloat16) in seen
    assert all(q_dtype == torch.float32 for T, q_dtype, _ in seen if T == 1)


def test_per_head_qk_norms_attend_in_the_plans_format_with_the_fp32_paths_values(zoo, box, tmp_path, monkeypatch):
    """Qwen3's per-head q/k norms no longer keep a prompt's attention off the plan's format (Attention.input_dtype):
    with one-copy int4 projections computing the prompt in bf16 and a bf16 cache, q, k and v come out of their
    GEMM in bf16 and the norm runs in fp32 on the way into RoPE (apply_rotary's norm, one native pass), so the
    logits equal, bit for bit, those of the route through fp32 activations (q/k norm, then RoPE, in fp32 passes)."""
    from tiered import kernels
    from tiered.models import layers

    if not kernels.available():
        pytest.skip("one-copy int4 weights need tiered/kernels")
    hw = HardwareProfile.load(box)
    m = dict(hw.models, **{"gemv/cpu/int4": LinearModel(0.0, 5e-11, 1.0),
                           "gemm/cpu/int4": LinearModel(1e-5, 2e-11, 1.0),
                           "attn_prefill/cpu/fp32": LinearModel(1e-5, 2e-11, 1.0),
                           "attn_prefill/cpu/bf16": LinearModel(1e-5, 5e-12, 1.0)})
    path = tmp_path / "attn.json"
    HardwareProfile("attn", "test", m, hw.gpu_memory, hw.cpu_memory,
                    meta={"native_kernels": True, "kernel_isa": "avx512"}).save(path)
    llm = LLM(zoo.dir("qwen3"), EngineConfig(accelerator="none", max_context=CTX, profile=str(path),
                                             decode_weights="int4"))
    assert llm.plan.dtypes["prompt_attention"] == "bf16" and llm.dtype == torch.float32
    attn = [a for a in llm.model.modules() if isinstance(a, layers.Attention)]
    assert attn and all(a.q_norm is not None and a.qk_norm_per_head for a in attn)
    from tiered.quant import int4
    monkeypatch.setattr(int4, "dequantize_rows", lambda *a, **k: 1)  # prompt rows dequantize here
    ids = torch.randint(2, zoo.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    seen, norms = [], []
    real, real_rope = layers.attend, layers.apply_rotary
    monkeypatch.setattr(layers, "attend", lambda q, k, v, *a: seen.append((q.dtype, v.dtype)) or real(q, k, v, *a))
    monkeypatch.setattr(layers, "apply_rotary", lambda x, *a: norms.append((x.dtype, a[-1] is not None)) or
                        real_rope(x, *a))
    from tiered.quant.linear import dense_dtype
    if dense_dtype(attn[0].q_proj, len(ids)) != torch.bfloat16:  # AVX2: prompt rows dequantize for fp32 GEMMs
        pytest.skip("this machine's int4 projections compute a prompt in fp32")
    got = llm.logits(ids, lossless=False)
    assert set(seen) == {(torch.bfloat16, torch.bfloat16)}
    assert set(norms) == {(torch.bfloat16, True)}  # q and k from their GEMM in bf16, normalized in RoPE's pass
    seen.clear(), norms.clear()
    with monkeypatch.context() as mp:  # the fp32 activations' route, the norm and RoPE as torch's fp32 passes
        mp.setattr(layers.Attention, "input_dtype", lambda self, x, cache: None)
        mp.setattr(layers, "_norm_rope_kernels", lambda *a: None)
        ref = llm.logits(ids, lossless=False)
    assert {n[0] for n in norms} == {torch.float32} and set(seen) == {(torch.bfloat16, torch.bfloat16)}
    assert torch.equal(got, ref)


def test_a_plans_prompt_ffn_dtype_reaches_the_mlps(zoo, box, tmp_path):
    """Plan.dtypes["prompt_ffn"] (planner/latency_cpu.prompt_ffn) reaches every MLP (runtime/install ->
    models/layers.set_prompt_ffn): bf16 where the plan's projections are one-copy int4 weights that a profiled
    AVX-512 machine's kernels dequantize for bf16 GEMMs past their rows; the activations' dtype (MLP.prompt_dtype
    None) on AVX2 (fp32 dequantization), for fp32 weights, and under the runtime's rules (--plan off); a saved
    plan replays its choice."""
    from tiered import kernels
    from tiered.models.layers import MLP

    if not kernels.available():
        pytest.skip("one-copy int4 weights need tiered/kernels")
    hw = HardwareProfile.load(box)

    def engine(isa: str, **kw) -> LLM:
        path = tmp_path / f"ffn-{isa}.json"
        replace(hw, meta={"native_kernels": True, "kernel_isa": isa}).save(path)
        return LLM(zoo.dir("llama"), EngineConfig(**dict(dict(accelerator="none", max_context=CTX, profile=str(path),
                                                               decode_weights="int4"), **kw)))

    def set_on(llm: LLM) -> set:
        mlps = [m for m in llm.model.modules() if isinstance(m, MLP)]
        assert len(mlps) == llm.config.num_hidden_layers
        return {m.prompt_dtype for m in mlps}
    bf16 = engine("avx512")
    assert not bf16.plan.dense_copies and bf16.plan.dtypes["prompt_ffn"] == "bf16"
    assert set_on(bf16) == {torch.bfloat16} and "prompt_ffn bf16" in bf16.plan.render()
    saved = tmp_path / "ffn_plan.json"
    bf16.plan.save(saved)
    assert set_on(LLM(zoo.dir("llama"), EngineConfig(accelerator="none", max_context=CTX, plan=str(saved)))) == \
        {torch.bfloat16}
    avx2 = engine("avx2")
    assert avx2.plan.dtypes["prompt_ffn"] == "fp32" and set_on(avx2) == {None}
    lossless = engine("avx512", decode_weights="fp32")
    assert lossless.plan.dtypes["prompt_ffn"] == "fp32" and set_on(lossless) == {None}
    rules = engine("avx512", plan="off")
    assert "prompt_ffn" not in rules.plan.dtypes and set_on(rules) == {None}


def test_a_bf16_engines_prompts_join_the_native_step_for_few_tokens_where_the_cpu_has_a_bf16_gemm(zoo, box,
                                                                                                   monkeypatch):
    """The engine hands planned_mixed_rows the format its step's projections hold: a bf16 engine's plan (auto or
    the rules) joins prompts as rows up to MIXED_ROWS_BF16_GEMM where the CPU has a bf16 GEMM, an fp32 one keeps
    the ISA's rows."""
    from tiered import kernels
    from tiered.hardware import cpu_gemm
    from tiered.planner import auto

    if not kernels.available():
        pytest.skip("no native kernels: no native step to join")
    monkeypatch.setattr(cpu_gemm, "bf16_gemm_native", lambda: True)
    isa_rows = auto.mixed_rows(kernels.isa(), "q8", auto.dequantize_rows("q8"))
    for plan in ("auto", "off"):
        kw = dict(accelerator="none", max_context=CTX, plan=plan, profile=box if plan == "auto" else None)
        bf16 = LLM(zoo.dir("llama"), EngineConfig(dtype="bfloat16", decode_weights="bf16", **kw)).plan
        fp32 = LLM(zoo.dir("llama"), EngineConfig(dtype="float32", decode_weights="fp32", **kw)).plan
        assert bf16.mixed_rows == min(isa_rows, auto.MIXED_ROWS_BF16_GEMM) and fp32.mixed_rows >= isa_rows


# ------------------------------------------------------------------ the CLI
def test_run_prints_the_plan_and_its_prediction(zoo, box):
    path = zoo.dir("llama")
    non_ffn, layer, kv, L = dense_sizes(path)
    gpu = non_ffn + kv + layer + layer * L // 4
    args = ["run", "--model", str(path), "--no-chat", "-n", "4", "-t", "0", "--decode-weights", "fp32",
            "--max-context", str(CTX), "--accelerator", "host", "--gpu-mem", str(gpu), "--profile", box]
    res = CliRunner().invoke(app, [*args, "1 2 3"])
    assert res.exit_code == 0, res.output
    assert "[plan (box): " in res.output and "FFNs sliced" in res.output
    assert "predicted decode" in res.output and "(measured " in res.output
    # the positions each figure is at: the plan's priced context (prompt + generated), the plan priced again
    # at the run's mean context (LLM.predicted_decode_at), and the run's measured speed there
    assert re.search(r"tok/s at \d+ positions, [\d.]+ at (\d+) \(measured [\d.]+ at \1\)", res.output), res.output
    shown = CliRunner().invoke(app, [*args, "--show-plan", "1 2 3"])
    assert shown.exit_code == 0 and "r_CC  r_CG  r_GG" in shown.output
    off = CliRunner().invoke(app, [*args[:-4], "--plan", "off", "1 2 3"])
    assert off.exit_code == 0 and "[plan (runtime rules): " in off.output and "predicted nothing" in off.output
    js = CliRunner().invoke(app, [*args, "--json", "1 2 3"])
    data = json.loads(js.stdout.strip().splitlines()[-1])
    assert data["plan"]["predicted_decode_tokens_per_s"] > 0 and "sliced" in data["plan"]["summary"]
    assert data["plan"]["run_positions"] == data["stats"]["prompt_tokens"] + data["stats"]["generated_tokens"] // 2
    assert data["plan"]["predicted_decode_tokens_per_s_at_run"] > 0 and data["plan"]["priced_positions"] > 0
    graphed = CliRunner().invoke(app, [*args, "--graphs", "on", "--show-plan", "1 2 3"])  # the stand-in's graphs
    assert graphed.exit_code == 0, graphed.output
    assert "decode: piecewise CUDA graphs" in graphed.output and "decode: " not in shown.output
    assert graphed.stdout.strip() == res.stdout.strip()  # greedy: the same text graphed or not


def test_a_failing_expert_raises_and_leaves_the_engine_closable(rt, monkeypatch, tmp_path):
    """An error inside one expert's task reaches the caller; the tasks queued behind it still finish,
    so close() returns instead of waiting on a worker forever. Every expert is on disk and read
    through the 2-buffer host staging ring, so later reads wait on earlier CPU experts."""
    from tiered.quant.experts import ExpertFormat

    s = rt.sizes("mixtral")
    llm = LLM(rt.dir("mixtral"), engine_config(accelerator="host", gpu_memory=s.fast(cache_slots=2),
                                               cpu_memory=s.cpu(0), force_expert_path="cpu",
                                               offload_dir=str(tmp_path)))
    assert llm.experts.placement.count("disk") >= s.total_experts - 2
    real = ExpertFormat.forward

    def broken(self, x, slot):
        if x.device.type == "cpu":
            raise RuntimeError("expert failed")
        return real(self, x, slot)
    monkeypatch.setattr(ExpertFormat, "forward", broken)
    with pytest.raises(RuntimeError, match="expert failed"):
        llm.generate(prompt(), GREEDY)
    llm.close()


def _saved_plan(rt, kind: str, tmp_path, **kw) -> str:
    with LLM(rt.dir(kind), engine_config(accelerator="none", **kw)) as llm:
        path = tmp_path / f"{kind}.json"
        llm.plan.save(path)
    return str(path)


def test_a_plan_for_another_model_is_refused(rt, zoo, tmp_path):
    """A replayed plan must fit the model's structure: a MoE plan on a dense model, a 2-layer plan on a
    3-layer model and a dense plan on a MoE model each fail with one error naming the mismatch."""
    moe = _saved_plan(rt, "mixtral", tmp_path)
    with pytest.raises(ConfigError, match="layers|layer 0"):
        LLM(zoo.dir("llama"), EngineConfig(plan=moe, decode_weights="fp32"))
    with pytest.raises(ConfigError, match="layers"):
        LLM(rt.dir("qwen2_moe"), engine_config(plan=moe))
    doc = json.loads(open(moe).read())
    doc["layers"][0]["expert_tiers"] = doc["layers"][0]["expert_tiers"][:3]
    few = tmp_path / "few.json"
    few.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="places 3 experts"):
        LLM(rt.dir("mixtral"), engine_config(plan=str(few)))
    doc = json.loads(open(moe).read())
    doc["expert_cache_slots"] = -3
    neg = tmp_path / "neg.json"
    neg.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="expert_cache_slots -3"):
        LLM(rt.dir("mixtral"), engine_config(plan=str(neg)))


def test_settings_that_contradict_a_replayed_plan_are_refused(rt, tmp_path):
    path = _saved_plan(rt, "mixtral", tmp_path, expert_cache_slots=2)
    with LLM(rt.dir("mixtral"), engine_config(plan=path, expert_cache_slots=2)) as llm:  # agreeing: fine
        assert llm.plan.expert_cache_slots == 2
    for kw, flag in ((dict(expert_cache_slots=5), "--cache-slots 5"), (dict(cache_policy="lfu"), "--cache-policy lfu"),
                     (dict(prefetch=True), "--prefetch")):
        with pytest.raises(ConfigError, match=flag):
            LLM(rt.dir("mixtral"), engine_config(plan=path, **kw))


def test_raising_the_cpu_budget_by_the_amount_asked_is_enough(rt):
    """The first budget check counts what the placement needs (non-expert weights, KV cache and the
    expert staging buffers): raising --cpu-mem by what it asks for gets past it (it had left the
    staging out, so the next check asked for ~2 experts more)."""
    from tiered.hardware.budget import parse_bytes

    cpu = 64 * 2**10
    with pytest.raises(BudgetError) as err:
        LLM(rt.dir("mixtral"), engine_config(accelerator="none", cpu_memory=cpu))
    short = parse_bytes(re.search(r"by ([\d.]+ \w+)", err.value.hint).group(1).replace(" ", ""))
    with LLM(rt.dir("mixtral"), engine_config(accelerator="none", cpu_memory=cpu + short + 1024)) as llm:
        assert llm.experts.placement.count(FAST) == 0  # every expert on disk, the staging in the budget
