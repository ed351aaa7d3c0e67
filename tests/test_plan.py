"""Plan: construction for each goal and machine kind, budgets respected, JSON round trip, render."""

from __future__ import annotations

import dataclasses

import pytest

from tiered import kernels
from tiered.checkpoint.model_config import ModelConfig
from tiered.errors import BudgetError
from tiered.hardware.presets import get_preset
from tiered.hardware.profile import HardwareProfile, LinearModel
from tiered.planner import Plan, make_plan

MIXTRAL_HF = {
    "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rope_theta": 1e6}
MIXTRAL = ModelConfig.from_hf(MIXTRAL_HF)
LLAMA70B = ModelConfig.from_hf({
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 4096})
GiB = 2**30


def cpu_only_profile() -> HardwareProfile:
    """A made-up CPU + disk machine: 20 GB/s GEMV, 2 GB/s cold reads."""
    m = {"gemm/cpu/bf16": LinearModel(0.0, 1e-11, 1.0), "gemv/cpu/bf16": LinearModel(0.0, 5e-11, 1.0),
         "attn/cpu/bf16": LinearModel(0.0, 1e-10, 1.0), "memory/bandwidth/cpu": LinearModel(0.0, 5e-11, 1.0),
         "disk/read_cold": LinearModel(1e-4, 5e-10, 1.0), "launch/cpu": LinearModel(1e-6, 0.0)}
    return HardwareProfile("cpu-box", "test", m, None, 64 * GiB)


def test_mixtral_testbed_b_24gb_fits_one_screen():
    p = make_plan(MIXTRAL, get_preset("scheinfer-b"), model_name="Mixtral-8x7B", gpu_memory=24 * GiB)
    text = p.render()
    assert len(text.splitlines()) <= 25
    assert "binding:" in text and "dispatch:" in text
    assert p.memory["gpu"] <= 24 * GiB
    assert 0 < sum(l.experts_gpu for l in p.layers) < 32 * 8
    assert p.predicted_decode_tokens_per_s > 0 and p.predicted_ttft_s > 0


def test_dense_latency_plan_uses_scheinfer_rates():
    p = make_plan(LLAMA70B, get_preset("scheinfer-a"), gpu_memory=24 * GiB, precision="int4")
    for l in p.layers:
        assert abs(l.r_cc + l.r_cg + l.r_gg - 1) < 1e-6
    assert p.memory["gpu"] <= 24 * GiB
    assert any(l.r_gg < 1 for l in p.layers)  # 70B does not fit in 24 GB


def test_throughput_plan_is_flexgen():
    p = make_plan(MIXTRAL, get_preset("t4-pcie3"), goal="throughput", gen_tokens=32)
    assert p.flexgen is not None and p.predicted_throughput_tokens_per_s > 0
    assert p.memory["gpu"] <= get_preset("t4-pcie3").gpu_memory


def test_cpu_only_plan_places_experts_within_ram(tmp_path):
    hw = cpu_only_profile()
    p = make_plan(MIXTRAL, hw, cpu_memory=48 * GiB)
    assert p.memory["cpu"] <= 48 * GiB and p.memory["disk"] > 0
    assert all(l.experts_gpu == 0 for l in p.layers)
    more = make_plan(MIXTRAL, hw, cpu_memory=64 * GiB)
    assert more.predicted_decode_tokens_per_s > p.predicted_decode_tokens_per_s  # more RAM, fewer reads
    p.save(tmp_path / "plan.json")
    q = Plan.load(tmp_path / "plan.json")
    assert q.render() == p.render()
    with pytest.raises(BudgetError):
        make_plan(MIXTRAL, hw, cpu_memory=1 * GiB)


# ---- the CPU + disk decode model (planner/cpu_predict.py) -------------------------------------------
def _disk_box(parallel: bool) -> HardwareProfile:
    m = {"gemv/cpu/bf16": LinearModel(0.0, 5e-11, 1.0), "attn/cpu/bf16": LinearModel(0.0, 1e-10, 1.0),
         "disk/read_cold": LinearModel(1e-4, 1e-9, 1.0), "runtime/task": LinearModel(2e-4, 0.0)}
    if parallel:
        m["disk/read_cold_parallel"] = LinearModel(1e-4, 4e-10, 1.0)
    return HardwareProfile("disk-box", "test", m, None, None)


@pytest.mark.parametrize("read_ahead, parallel", [(False, False), (True, False), (True, True)])
def test_moe_layer_time_follows_the_read_mode(read_ahead, parallel):
    from tiered.planner.cpu_predict import HitStats, predict_decode

    hw = _disk_box(parallel)
    hits = HitStats(resident={i: 1 for i in range(32)}, cache={i: 1 for i in range(32)}, miss={i: 2 for i in range(32)})
    layers, step = predict_decode(MIXTRAL, hw, "bf16", context=64, hits=hits, read_ahead=read_ahead)
    eb = 3 * 4096 * 14336 * 2
    compute = 5e-11 * eb  # three GEMVs over the expert's bytes, inline on the calling thread (no task hop)
    router = 5e-11 * 4096 * 8 * 2
    misses = 2 * 0.5  # top-2, half of the layer's expert uses miss
    read = 1e-4 + 1e-9 * eb
    if not read_ahead:
        want = 2 * compute + misses * (read + 2e-4)
    elif parallel:
        want = max(1e-4 + 4e-10 * misses * eb + misses * 2e-4 + compute, 2 * compute)
    else:
        want = max(misses * (read + 2e-4) + compute, 2 * compute)
    assert layers[0][1] == pytest.approx(router + want, rel=1e-9)
    assert step > sum(f for _, f in layers)


def test_cpu_experts_are_priced_in_their_stored_format():
    """Experts read in their own format (int4 slots are ~1/3.5 of bf16's bytes, at the int4 GEMV's
    rate), and a layer whose experts are all in RAM, with the native kernels, is one call of two
    parallel regions for its top-k (runtime/moe_runner._all_on_fast), not three GEMVs per expert."""
    from dataclasses import replace

    from tiered.memory import sizes
    from tiered.planner.cpu_predict import predict_decode

    m = {"gemv/cpu/bf16": LinearModel(1e-5, 5e-11, 1.0), "gemv/cpu/int4": LinearModel(1e-5, 8e-11, 1.0),
         "attn/cpu/bf16": LinearModel(0.0, 1e-10, 1.0)}
    hw = HardwareProfile("cpu-box", "test", m, None, None, meta={"native_kernels": True})
    router = 5e-11 * 4096 * 8 * 2  # inside the native step: bytes alone, no call's intercept (memory_time)
    for fmt, key in (("bf16", "gemv/cpu/bf16"), ("int4", "gemv/cpu/int4")):
        layers, _ = predict_decode(MIXTRAL, hw, "bf16", context=64, experts_format=fmt)
        fit = m[key]
        assert layers[0][1] == pytest.approx(router + fit.beta * 2 * sizes.expert_bytes(MIXTRAL, fmt))
    per_task, _ = predict_decode(MIXTRAL, replace(hw, meta={}), "bf16", context=64, experts_format="int4")
    assert per_task[0][1] > layers[0][1]  # torch ops: 3 calls per expert
    # int4 experts on int8 activations (Plan.expert_act "q8"): gemv/cpu/int4q8's rate, int4's without it
    q8 = LinearModel(1e-5, 5e-11, 1.0)
    with_q8 = replace(hw, models={**m, "gemv/cpu/int4q8": q8})
    layers_q8, _ = predict_decode(MIXTRAL, with_q8, "bf16", context=64, experts_format="int4", expert_act="q8")
    assert layers_q8[0][1] == pytest.approx(router + q8.beta * 2 * sizes.expert_bytes(MIXTRAL, "int4"))
    assert predict_decode(MIXTRAL, hw, "bf16", context=64, experts_format="int4", expert_act="q8")[0] == layers
    assert predict_decode(MIXTRAL, with_q8, "bf16", context=64, experts_format="int4")[0] == layers  # bf16 x: int4's


def test_routed_expert_activations_price_the_fiddler_cpu_side():
    """ExpertLatency's CPU side streams int4 experts on int8 activations at gemv/cpu/int4q8's rate
    when the profile has it (the memory floor of op_time.memory_time), int4's otherwise."""
    from dataclasses import replace

    from tiered.planner.fiddler import ExpertLatency, ExpertShape

    m = {"gemm/cpu/int4": LinearModel(1e-5, 1e-12, 1.0), "gemv/cpu/int4": LinearModel(0.0, 8e-11, 1.0),
         "memory/bandwidth/cpu": LinearModel(0.0, 1e-11, 1.0)}
    hw = HardwareProfile("cpu-box", "test", m, None, None)
    shape = ExpertShape.from_config(MIXTRAL)
    slow = ExpertLatency(hw, shape, "int4", "int4", "q8").cpu_lat(1)
    assert slow == ExpertLatency(hw, shape, "int4", "int4", "bf16").cpu_lat(1)
    fast = ExpertLatency(replace(hw, models={**m, "gemv/cpu/int4q8": LinearModel(0.0, 4e-11, 1.0)}), shape, "int4",
                         "int4", "q8").cpu_lat(1)
    assert fast < 0.6 * slow


def test_the_engines_loop_is_priced_once_a_step():
    """runtime/engine_token (the engine's loop around a decode step: scheduling, inputs, sampling, output; a tiny
    model's ITL less its step) joins every step's fixed cost (op_time.step_overhead), CPU and GPU, decode and
    prefill, once a step whatever the layers; without the key nothing moves."""
    from dataclasses import replace

    from tiered.hardware import op_time
    from tiered.planner.cpu_predict import predict_decode

    m = {"gemv/cpu/bf16": LinearModel(1e-5, 5e-11, 1.0), "attn/cpu/bf16": LinearModel(0.0, 1e-10, 1.0),
         "runtime/decode_step/bf16": LinearModel(5e-5, 1e-5, 1.0), "runtime/decode_step_gpu/bf16": LinearModel(2e-4, 3e-5, 1.0)}
    hw = HardwareProfile("cpu-box", "test", m, None, None, meta={"native_kernels": True})
    loop = replace(hw, models={**m, "runtime/engine_token": LinearModel(9e-5, 0.0, None)})
    for device in ("cpu", "gpu"):
        (step, layer), (step_loop, layer_loop) = (op_time.step_overhead(p, "int4", device) for p in (hw, loop))
        assert (step_loop - step, layer_loop) == (pytest.approx(9e-5), layer)
    assert op_time.step_overhead(HardwareProfile("cpu-box", "test", {}, None, None), "bf16") == (0.0, 0.0)
    base_layers, base = predict_decode(MIXTRAL, hw, "bf16", context=64)
    layers, step = predict_decode(MIXTRAL, loop, "bf16", context=64)
    assert (layers, step - base) == (base_layers, pytest.approx(9e-5))


def test_a_lone_sequences_decode_bursts_are_priced_by_their_token():
    """Where the engine decodes a lone sequence in native bursts (one KV slot, batch 1, the native step running
    every layer: every expert resident), runtime/burst_token replaces the step's fixed cost and the loop's
    (op_time.step_overhead's `burst`); batches, a CPU without the native kernels, experts that may miss RAM,
    and a GPU step keep them, as does a profile without the key."""
    from dataclasses import replace

    from tiered.hardware import op_time
    from tiered.planner.cpu_predict import HitStats, predict_decode

    m = {"gemv/cpu/bf16": LinearModel(1e-5, 5e-11, 1.0), "attn/cpu/bf16": LinearModel(0.0, 1e-10, 1.0),
         "runtime/decode_step/bf16": LinearModel(5e-5, 1e-5, 1.0), "runtime/engine_token": LinearModel(9e-5, 0.0, None),
         "runtime/burst_token": LinearModel(3e-5, 0.0, None), "gemm/cpu/bf16": LinearModel(1e-5, 1e-11, 1.0)}
    hw = HardwareProfile("cpu-box", "test", m, None, None, meta={"native_kernels": True})
    assert op_time.step_overhead(hw, "bf16", burst=True) == (3e-5, 1e-5)
    assert op_time.step_overhead(hw, "bf16") == (pytest.approx(1.4e-4), 1e-5)
    assert op_time.step_overhead(hw, "bf16", "gpu", burst=True) == (pytest.approx(1.4e-4), 1e-5)
    without = replace(hw, models={k: v for k, v in m.items() if k != "runtime/burst_token"})
    assert op_time.step_overhead(without, "bf16", burst=True) == op_time.step_overhead(hw, "bf16")
    _, step = predict_decode(MIXTRAL, hw, "bf16", context=64)
    _, burst = predict_decode(MIXTRAL, hw, "bf16", context=64, bursts=True)
    assert step - burst == pytest.approx(1.1e-4)
    assert predict_decode(MIXTRAL, hw, "bf16", context=64, bursts=True, batch=4)[1] == \
        predict_decode(MIXTRAL, hw, "bf16", context=64, batch=4)[1]
    plain = replace(hw, meta={})  # no native step: no bursts
    assert predict_decode(MIXTRAL, plain, "bf16", context=64, bursts=True) == predict_decode(MIXTRAL, plain, "bf16", context=64)
    misses = HitStats({i: 6 for i in range(MIXTRAL.num_hidden_layers)}, {}, {i: 2 for i in range(MIXTRAL.num_hidden_layers)})
    assert predict_decode(MIXTRAL, hw, "bf16", context=64, hits=misses, bursts=True) == \
        predict_decode(MIXTRAL, hw, "bf16", context=64, hits=misses)


def test_an_moe_layer_adds_its_blocks_fixed_cost():
    """runtime/moe_step's slope (a tiny MoE model's step per layer) less runtime/decode_step's (a dense
    layer's) is what each MoE layer adds to a CPU decode step: router module, top-k, the runner's
    grouping and combine. Dense layers and the per-step cost stay as runtime/decode_step prices them;
    without the key nothing is added."""
    from dataclasses import replace

    from tiered.planner.cpu_predict import predict_decode

    m = {"gemv/cpu/bf16": LinearModel(1e-5, 5e-11, 1.0), "attn/cpu/bf16": LinearModel(0.0, 1e-10, 1.0),
         "runtime/decode_step/bf16": LinearModel(5e-5, 1e-5, 1.0)}
    hw = HardwareProfile("cpu-box", "test", m, None, None, meta={"native_kernels": True})
    with_key = replace(hw, models={**m, "runtime/moe_step/bf16": LinearModel(4e-5, 3.3e-4, 1.0)})
    base_layers, base = predict_decode(MIXTRAL, hw, "bf16", context=64)
    layers, step = predict_decode(MIXTRAL, with_key, "bf16", context=64)
    assert step - base == pytest.approx(MIXTRAL.num_hidden_layers * 3.2e-4)
    assert [a for a, _ in layers] == [a for a, _ in base_layers]  # the attention part keeps the dense per-layer cost
    assert layers[0][1] - base_layers[0][1] == pytest.approx(3.2e-4)


def test_the_native_steps_projections_pay_their_bytes_not_a_calls_intercept():
    """Inside the native decode step the projections run back to back in C++: each pays its bytes at the
    GEMV fit's slope, not the fit's intercept (what a call issued alone from Python pays; the step's fixed
    cost a layer is runtime/decode_step's), fused (bf16 copies: q/k/v and gate/up) or not (fp32's dense
    weights). Without the native kernels each torch call pays the intercept: fp32's 7 a layer (q, k, v, o;
    gate, up, down), as does each of the lm_head's and the layer's calls."""
    from dataclasses import replace

    from tiered.planner.cpu_predict import native_fused_projections, predict_decode

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    m = {f"gemv/cpu/{d}": LinearModel(1e-4, 1e-10, 1.0) for d in ("fp32", "bf16")}
    hw = HardwareProfile("cpu-box", "test", {**m, "attn/cpu/fp32": LinearModel(0.0, 0.0, 1.0)}, None, None,
                         meta={"native_kernels": True})
    assert native_fused_projections(hw, "bf16") and not native_fused_projections(hw, "fp32")
    attn_elems, mlp_elems = 256 * (256 + 2 * 128) + 256 * 256, 3 * 256 * 512
    for dtype, bpe in (("fp32", 4), ("bf16", 2)):
        layers, step = predict_decode(cfg, hw, dtype, context=0)
        assert layers == [(pytest.approx(1e-10 * attn_elems * bpe), pytest.approx(1e-10 * mlp_elems * bpe))]
        assert step == pytest.approx(1e-10 * (attn_elems + mlp_elems + 256 * 64) * bpe)
    (attn, ffn), = predict_decode(cfg, replace(hw, meta={}), "fp32", context=0)[0]
    assert (attn, ffn) == (pytest.approx(4e-4 + 1e-10 * attn_elems * 4), pytest.approx(3e-4 + 1e-10 * mlp_elems * 4))


def test_the_native_steps_int4_layers_run_no_faster_than_the_step_ran_them():
    """runtime/decode_layer/int4 (profiler 32: the native step over dense int4 layers at real widths, the layer
    code taken out, per weight byte) floors a one-token step's int4 projections (op_time.step_stream): on 2 Zen 3
    cores SmolLM2's layers ran at 27-29 GB/s where the int4 GEMV fit read 38.6. A faster key leaves the GEMV
    fit's price, at any rows (a batched step's rows add their multiply-adds to that stream); routed experts (their
    own keys) and the int8 head keep theirs; without the key nothing moves."""
    from dataclasses import replace

    from tiered.memory.sizes import bytes_per_element
    from tiered.planner.cpu_predict import predict_decode

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    m = {"gemv/cpu/int4": LinearModel(1e-4, 1e-11, 1.0), "gemv/cpu/int8": LinearModel(1e-4, 1e-11, 1.0),
         "attn/cpu/bf16": LinearModel(0.0, 0.0, 1.0)}
    hw = HardwareProfile("cpu-box", "test", m, None, None, meta={"native_kernels": True})
    attn_b, mlp_b = (256 * (256 + 2 * 128) + 256 * 256) * bytes_per_element("int4"), 3 * 256 * 512 * bytes_per_element("int4")
    base, base_step = predict_decode(cfg, hw, "int4", context=0, head_dtype="int8")
    assert base[0] == (pytest.approx(1e-11 * attn_b), pytest.approx(1e-11 * mlp_b))
    slow = replace(hw, models={**m, "runtime/decode_layer/int4": LinearModel(0.0, 3e-11, 1.0)})
    layers, step = predict_decode(cfg, slow, "int4", context=0, head_dtype="int8")
    assert layers[0] == (pytest.approx(3e-11 * attn_b), pytest.approx(3e-11 * mlp_b))
    assert step - base_step == pytest.approx(2 * 2e-11 * (attn_b + mlp_b))  # the head's price unchanged
    fast = replace(hw, models={**m, "runtime/decode_layer/int4": LinearModel(0.0, 0.5e-11, 1.0)})
    assert predict_decode(cfg, fast, "int4", context=0, head_dtype="int8") == (base, base_step)
    # a batched step streams each weight no faster than one row does: the rows past the first add to that stream
    head_b = 256 * 64 * bytes_per_element("int4")
    assert predict_decode(cfg, slow, "int4", context=0, batch=4)[1] - predict_decode(cfg, hw, "int4", context=0,
                                                                                     batch=4)[1] == \
        pytest.approx(2e-11 * (2 * (attn_b + mlp_b) + head_b))
    # an MoE model of int4 layers: its attention and router are floored, its int4q8 experts keep their rate
    moe = replace(hw, models={**m, "gemv/cpu/int4q8": LinearModel(1e-4, 1e-11, 1.0)})
    moe_slow = replace(moe, models={**moe.models, "runtime/decode_layer/int4": LinearModel(0.0, 3e-11, 1.0)})
    (a, f), (a_slow, f_slow) = [predict_decode(MIXTRAL, p, "int4", context=0, experts_format="int4",
                                               expert_act="q8")[0][0] for p in (moe, moe_slow)]
    router_b = MIXTRAL.hidden_size * MIXTRAL.num_experts * bytes_per_element("int4")
    assert a_slow - a == pytest.approx(2e-11 * MIXTRAL.attention_weight_elements() * bytes_per_element("int4"))
    assert f_slow - f == pytest.approx(2e-11 * router_b)
    # int8-g32 copies (a Q8_0 file's, --decode-weights int8's; profiler 50) by their own key, the head included
    g32 = {**m, "gemv/cpu/int8-g32": LinearModel(1e-4, 1e-11, 1.0)}
    g32_slow = replace(hw, models={**g32, "runtime/decode_layer/int8-g32": LinearModel(0.0, 3e-11, 1.0)})
    layers, step = predict_decode(cfg, g32_slow, "int8-g32", context=0)
    attn_b, mlp_b, head_b = [b / bytes_per_element("int4") * bytes_per_element("int8-g32")
                             for b in (attn_b, mlp_b, 256 * 64 * bytes_per_element("int4"))]
    assert layers[0] == (pytest.approx(3e-11 * attn_b), pytest.approx(3e-11 * mlp_b))
    assert step - predict_decode(cfg, replace(hw, models=g32), "int8-g32", context=0)[1] == \
        pytest.approx(2e-11 * (2 * (attn_b + mlp_b) + head_b))


def test_a_small_layers_calls_run_slower_a_byte_as_the_step_timed_them():
    """op_time.layer_shape: runtime/decode_layer/int4's points (meta["points"]: a layer's seconds at three widths)
    against the key's fit through the origin: a dense layer of the model's size is priced at its own width's rate,
    interpolated between the timed widths and held beyond them (on 2 Zen 4 cores SmolLM2's 2.2 MB layers ran at 23
    GB/s where the fit read 30.6); relative, so planning's scaling of the key to the memory's speed carries over;
    profiles without the points price as before."""
    from dataclasses import replace

    from tiered.hardware.op_time import layer_shape, step_stream
    from tiered.memory.sizes import bytes_per_element
    from tiered.planner.cpu_predict import predict_decode

    key = "runtime/decode_layer/int4"
    pts = [[2e6, 100e-6], [4e6, 140e-6], [8e6, 260e-6]]  # 20, 28.6, 30.8 GB/s
    slope = sum(x * t for x, t in pts) / sum(x * x for x, _ in pts)
    models = {key: LinearModel(0.0, slope, 1.0), "gemv/cpu/int4": LinearModel(0.0, 1e-12, 1.0),
              "gemv/cpu/int8": LinearModel(0.0, 1e-12, 1.0)}
    hw = HardwareProfile("cpu-box", "test", models, None, None, meta={"native_kernels": True, "points": {key: pts}})
    assert layer_shape(hw, key, 2e6) * slope * 2e6 == pytest.approx(100e-6)  # each timed width at its own time
    assert layer_shape(hw, key, 8e6) * slope * 8e6 == pytest.approx(260e-6)
    assert layer_shape(hw, key, 3e6) == pytest.approx((layer_shape(hw, key, 2e6) + layer_shape(hw, key, 4e6)) / 2)
    assert layer_shape(hw, key, 1e6) == layer_shape(hw, key, 2e6)
    assert layer_shape(hw, key, 1e9) == layer_shape(hw, key, 8e6)
    assert layer_shape(hw, key, None) == 1.0 == layer_shape(replace(hw, meta={"native_kernels": True}), key, 2e6)
    scaled = replace(hw, models={**hw.models, key: LinearModel(0.0, 2 * slope, 1.0)})  # a memory half as fast
    assert step_stream(scaled, "int4", 2e6) == pytest.approx(2 * step_stream(hw, "int4", 2e6))
    # a k-quant copy without a decode_layer key of its own: int8-g32's, scaled by their kernels' own streams where the
    # profile timed both (profiler 67), else as int8-g32's
    g32 = {"runtime/decode_layer/int8-g32": LinearModel(0.0, 40e-12, 1.0), "gemv/cpu/int8-g32": LinearModel(0.0, 36e-12, 1.0)}
    kq = replace(hw, models={**hw.models, **g32})
    assert step_stream(kq, "iq4xs") == pytest.approx(40e-12) == step_stream(kq, "int8-g32")
    kq = replace(kq, models={**kq.models, "gemv/cpu/iq4xs": LinearModel(0.0, 27e-12, 1.0)})
    assert step_stream(kq, "iq4xs") == pytest.approx(40e-12 * 27 / 36) and step_stream(kq, "q5k") == pytest.approx(40e-12)
    # ... and its own key once the profile has it (profiler 69): no scaling
    kq = replace(kq, models={**kq.models, "runtime/decode_layer/iq4xs": LinearModel(0.0, 21e-12, 1.0)})
    assert step_stream(kq, "iq4xs") == pytest.approx(21e-12) and step_stream(kq, "q5k") == pytest.approx(40e-12)
    # SmolLM2's widths: a layer of ~2 MB priced at the 2 MB point's rate (slower than the fit's), its head not
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    lb = (cfg.attention_weight_elements() + 3 * 576 * 1536) * bytes_per_element("int4")
    layers, step = predict_decode(cfg, hw, "int4", context=0, head_dtype="int8")
    assert sum(layers[0]) == pytest.approx(lb * slope * layer_shape(hw, key, lb))
    plain, plain_step = predict_decode(cfg, replace(hw, meta={"native_kernels": True}), "int4", context=0,
                                       head_dtype="int8")
    assert sum(plain[0]) == pytest.approx(lb * slope) and sum(plain[0]) < sum(layers[0])
    assert step - plain_step == pytest.approx(2 * (sum(layers[0]) - sum(plain[0])))


def test_one_sequences_draft_rows_read_its_cache_once():
    """predict_decode's `sequences`: a step of one sequence's 1 + k rows (speculative decoding's) reads that
    sequence's KV cache once, its later rows passing over keys the caches hold at attn_rows' rate, where 1 + k
    sequences read 1 + k caches (SmolLM2's steps of 2-5 rows had been priced 1.39-2.55x one row, measured
    1.15-2.03x on the AMX VM); at no context, or one row a sequence, the two are the same step."""
    from tiered.memory import sizes
    from tiered.planner.cpu_predict import predict_decode

    stream = 1 / 20e9  # seconds a KV byte, the native attention's
    models = {"gemv/cpu/int4": LinearModel(0.0, 1e-12, 1.0), "gemv/cpu/int8": LinearModel(0.0, 1e-12, 1.0),
              "attn_decode/cpu/bf16": LinearModel(0.0, stream, 1.0), "attn_rows/cpu/bf16": LinearModel(0.0, 1e-12, 1.0)}
    hw = HardwareProfile("cpu-box", "test", models, None, None, meta={"native_kernels": True})
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64)

    def step(batch, sequences=None, context=256):
        return predict_decode(cfg, hw, "int4", context=context, head_dtype="int8", kv_format="bf16", batch=batch,
                              sequences=sequences)[1]

    kv = 256 * sizes.kv_bytes_per_token(cfg, "bf16")  # a layer's cache of one sequence
    again = 256 * cfg.attention_macs_per_pair(True) * 1e-12  # a row's pass over it from the caches
    assert step(4) - step(4, 1) == pytest.approx(cfg.num_hidden_layers * 3 * (kv * stream - again))
    assert step(1) < step(4, 1) < step(4) and step(4, 4) == step(4) and step(4, 1, context=0) == step(4, context=0)


def test_a_step_the_caches_partly_hold_streams_at_the_rate_timed_at_its_working_set():
    """op_time.cache_factor: runtime/decode_ws/int4's points (working set bytes, seconds a byte) over its cold set's
    rate, interpolated in log bytes, held below the smallest set, 1 from the cold set on and where not profiled. A
    native step at one row whose weight bytes the caches hold streams its dense layers and head at that factor of
    their price from memory (2 AMX cores, 480 MiB L3 reported: SmolLM2's 89 MB step priced 3.9 ms, ran 2.5), its
    working set the weights and the rows' KV caches; a batched step's one stream too, not its rows' multiply-adds
    nor routed experts."""
    from dataclasses import replace

    from tiered.hardware.op_time import cache_factor
    from tiered.planner.cpu_predict import predict_decode, step_weight_bytes

    MiB = 1 << 20
    key = "runtime/decode_ws/int4"
    pts = [[16 * MiB, 20e-12], [64 * MiB, 20e-12], [256 * MiB, 40e-12], [1024 * MiB, 40e-12]]
    models = {"runtime/decode_layer/int4": LinearModel(0.0, 40e-12, 1.0), "gemv/cpu/int4": LinearModel(0.0, 1e-12, 1.0),
              "gemv/cpu/int8": LinearModel(0.0, 1e-12, 1.0), key: LinearModel(0.0, 40e-12, None)}
    hw = HardwareProfile("cpu-box", "test", models, None, None, meta={"native_kernels": True, "points": {key: pts}})
    assert cache_factor(hw, 8 * MiB) == cache_factor(hw, 64 * MiB) == 0.5
    assert cache_factor(hw, 128 * MiB) == pytest.approx(0.75)  # halfway in log bytes
    assert cache_factor(hw, 256 * MiB) == cache_factor(hw, 4096 * MiB) == 1.0
    plain = replace(hw, meta={"native_kernels": True})
    assert cache_factor(hw, 0) == cache_factor(plain, 8 * MiB) == 1.0
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    assert step_weight_bytes(cfg, "int4") < 16 * MiB
    (layers, step), (plain_layers, plain_step) = [predict_decode(cfg, p, "int4", context=0, head_dtype="int8")
                                                  for p in (hw, plain)]
    assert step < plain_step
    assert layers[0][1] == pytest.approx(plain_layers[0][1] / 2)  # the MLP's stream at half its price
    # the rows' caches pass between two reads of a weight too: past 256 MiB of them, the weights' price from memory
    long = [predict_decode(cfg, p, "int4", context=200_000, head_dtype="int8")[0][0][1] for p in (hw, plain)]
    assert long[0] == long[1] == plain_layers[0][1]
    # a batched step streams the same bytes once: at the factor too, its rows' multiply-adds beside it as before
    batched, plain_batched = [predict_decode(cfg, p, "int4", context=0, batch=4, head_dtype="int8")[0][0][1]
                              for p in (hw, plain)]
    assert batched == pytest.approx(plain_batched / 2)
    rows_key = {"decode_rows/cpu/int4": LinearModel(0.0, 1e-12, 1.0)}  # a row's multiply-adds: not a stream
    with_rows, plain_rows = [predict_decode(cfg, replace(p, models={**p.models, **rows_key}), "int4", context=0,
                                            batch=4, head_dtype="int8")[0][0][1] for p in (hw, plain)]
    assert with_rows - batched == pytest.approx(plain_rows - plain_batched) and with_rows - batched > 0
    # a model whose step is beyond the timed sets: as before
    big = replace(cfg, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=128, num_hidden_layers=8)
    assert step_weight_bytes(big, "int4") > 256 * MiB
    assert predict_decode(big, hw, "int4", context=0) == predict_decode(big, plain, "int4", context=0)


@pytest.mark.skipif(not __import__("tiered.kernels", fromlist=["available"]).available(), reason="needs tiered/kernels")
def test_the_profile_times_the_native_step_over_working_sets():
    """profiler._decode_ws_points: the native step's int4 layers cycled over each working set and over the cold one
    (seconds a weight byte, the sets ascending, the cold one last and largest); Bench.fit keeps the cold set's rate
    as the key's model and the points for op_time.cache_factor."""
    from tiered.hardware.profiler import DECODE_LAYER_SHAPES, MiB, _Bench, _decode_ws_points

    pts = _decode_ws_points(3, None, DECODE_LAYER_SHAPES[0], sets_mib=(8, 16), cold=48 * MiB)  # 8 MB a run of layers
    assert len(pts) == 3 and [n for n, _ in pts] == sorted(n for n, _ in pts)
    assert pts[0][0] == pytest.approx(8 * MiB, rel=0.3) and pts[-1][0] >= 48 * MiB
    assert all(1e-13 < t < 1e-8 for _, t in pts)  # 0.1-10,000 GB/s: a real stream's rate
    b = _Bench(True, None, None)
    b.fit("runtime/decode_ws/int4", pts)
    assert b.models["runtime/decode_ws/int4"] == LinearModel(0.0, pts[-1][1], None)
    assert b.points["runtime/decode_ws/int4"] == pts


def test_cpu_moe_prefill_prices_experts_in_the_activations_dtype():
    """Experts of a prefill (more than 8 rows each) compute in the activations' dtype: the expert's
    weights are converted or dequantized to it once per call. On AVX2, fp32 GEMMs are ~6x faster than
    bf16 ones, so pricing them in the bf16 decode copies' format put an OLMoE-like prefill at 13.9 s
    against 4.5 s measured (4.4 s as priced now)."""
    from tiered.planner.cpu_predict import predict_prefill

    m = {"gemm/cpu/fp32": LinearModel(0.0, 1e-11, 1.0), "gemm/cpu/bf16": LinearModel(0.0, 6e-11, 1.0)}
    hw = HardwareProfile("cpu-box", "test", m, None, None)
    by_copies = predict_prefill(MIXTRAL, hw, "bf16", 64)
    by_acts = predict_prefill(MIXTRAL, hw, "bf16", 64, experts_dtype="fp32")
    experts = MIXTRAL.num_hidden_layers * 64 * 2 * 3 * 4096 * 14336  # every token's top-2, in MACs
    assert by_copies - by_acts == pytest.approx(experts * 5e-11, rel=1e-6)


def test_a_cpu_moe_prompts_router_is_priced_as_the_decode_kernels_rows_not_by_the_gemm_fit():
    """An MoE layer's router (E x hidden: a weight that stays in cache) is priced as the decode kernels' rows
    (`_gemv`), not by the GEMM fit, whose intercept comes from MiB-sized weights: on 2 Zen 3 cores
    gemm/cpu/bf16's 1.7 ms had priced the router of every layer of an 8-token prompt of the uniformly routed
    Mixtral-width dummy at that, where torch's bf16 router took 18 us (66% slow in all)."""
    from pathlib import Path

    from tiered.planner.cpu_predict import predict_prefill

    # (Zen 3's: bf16 experts on the native kernel up to 32 rows, so no expert of these prompts runs torch's GEMM)
    base = HardwareProfile.load(Path(__file__).parents[1] / "benchmarks/results/zen3-2026-12-01/at-97730b0/"
                                "hardware_profile_this_machine.json")
    cfg = ModelConfig.from_hf({  # the validation's Mixtral-width dummy
        "model_type": "mixtral", "vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 3584,
        "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2, "num_local_experts": 8,
        "num_experts_per_tok": 2, "max_position_embeddings": 4096})
    gemm = base.models["gemm/cpu/bf16"]
    big = HardwareProfile(base.name, base.source, {**base.models, "gemm/cpu/bf16": LinearModel(1.0, gemm.beta, 1.0)},
                          None, None, meta=base.meta)
    for T in (8, 16, 32):
        ffn = predict_prefill(cfg, base, "bf16", T, act_dtype="bf16", ffn_only=True)
        assert predict_prefill(cfg, big, "bf16", T, act_dtype="bf16", ffn_only=True) == pytest.approx(ffn), T


def test_torch_gemms_of_few_rows_pay_the_profiled_small_row_gemm():
    """gemm_rows/cpu/bf16 (torch's GEMM at 8 rows over cold weights) floors a torch GEMM: its time for the
    weights plus the rows past 8 at the GEMM slope. On 2 Zen 4 cores a 3584 x 1024 bf16 weight took 321 /
    713 us at 8 / 64 rows, where max(compute, stream) priced 155 / 508. Without the key, gemm_time."""
    from tiered.hardware import op_time
    from tiered.planner.cpu_predict import GEMM_ROWS, torch_gemm_time

    m = {"gemm/cpu/bf16": LinearModel(0.0, 1e-12, 1.0), "gemv/cpu/bf16": LinearModel(0.0, 1 / 45e9, 1.0)}
    plain = HardwareProfile("cpu-box", "test", m, None, None)
    rows_key = LinearModel(2e-6, 2 / 45e9, 1.0)  # two streams of the weight a call
    hw = HardwareProfile("cpu-box", "test", {**m, "gemm_rows/cpu/bf16": rows_key}, None, None)
    n, k = 3584, 1024
    w = n * k * 2
    for rows in (1, GEMM_ROWS, 64, 512):
        macs = rows * n * k
        old = op_time.gemm_time(plain, "cpu", "bf16", macs, w)
        assert torch_gemm_time(plain, "bf16", macs, w) == old
        want = rows_key(w) + max(0, rows - GEMM_ROWS) * n * k * 1e-12
        assert torch_gemm_time(hw, "bf16", macs, w) == pytest.approx(max(old, want))
    assert torch_gemm_time(hw, "bf16", 64 * n * k, w) > 1.3 * op_time.gemm_time(hw, "cpu", "bf16", 64 * n * k, w)
    assert torch_gemm_time(hw, "bf16", 3 * 16 * n * k, 3 * w, calls=3) == pytest.approx(
        3 * torch_gemm_time(hw, "bf16", 16 * n * k, w))


def test_cpu_moe_prefill_prices_bf16_experts_past_their_native_rows_as_torch_gemms():
    """A CPU MoE prefill's bf16 experts run tiered's native kernel up to the machine's tuned rows and
    torch's GEMMs past them (quant/experts.bf16_native_rows, recorded in the profile's kernel tuning):
    only the latter pay the small-row GEMM key. Quantized experts keep their kernels' price."""
    from tiered.planner.cpu_predict import expert_native_rows, predict_prefill

    m = {"gemm/cpu/bf16": LinearModel(0.0, 1e-12, 1.0), "gemv/cpu/bf16": LinearModel(0.0, 1 / 45e9, 1.0)}
    meta = {"native_kernels": True, "kernel_tuning": {"bf16_native_rows": 4}}
    plain = HardwareProfile("cpu-box", "test", m, None, None, meta=meta)
    hw = HardwareProfile("cpu-box", "test", {**m, "gemm_rows/cpu/bf16": LinearModel(0.0, 3 / 45e9, 1.0)}, None, None,
                         meta=meta)
    assert expert_native_rows(hw, "bf16") == 4 and expert_native_rows(hw, "int4") > 4096
    # 4 tokens top-2 of 8: at most 4 rows an expert (native), 4 rows a projection; 64 tokens: 16 +- 3.5 rows (torch)
    assert predict_prefill(MIXTRAL, hw, "bf16", 4) == predict_prefill(MIXTRAL, plain, "bf16", 4)
    assert predict_prefill(MIXTRAL, hw, "bf16", 8) > predict_prefill(MIXTRAL, plain, "bf16", 8)  # 3% past 4 rows
    assert predict_prefill(MIXTRAL, hw, "bf16", 64) > 1.3 * predict_prefill(MIXTRAL, plain, "bf16", 64)
    assert predict_prefill(MIXTRAL, hw, "bf16", 64, experts_format="int4") < predict_prefill(MIXTRAL, hw, "bf16", 64)


def test_cpu_prompt_experts_are_priced_over_the_rows_the_routing_draws():
    """A prompt's expert costs are averaged over each expert's rows as the routing draws them (Binomial(T,
    k/E)), not taken at the mean rows: where the runtime changes path at the native kernel's rows (bf16
    experts to torch's GEMM, ~6x slower a row on AVX2-only cores) half of a 128-token prompt's experts (32
    +- 5 rows of 8 top-2) take the slow path. The native kernel's rows cost its own slope (expert_rows), not
    the GEMM fit's: torch's bf16 GEMM on AVX2 runs ~10 GMAC/s, the native kernel ~60."""
    from scipy.stats import binom

    from tiered.hardware import op_time
    from tiered.planner.cpu_predict import RowCosts, native_expert_time, predict_prefill

    calls = []
    rows = RowCosts(lambda r: calls.append(r) or float(r > 32), 128)
    assert rows.expected([0.25, 1.0, 0.0]) == pytest.approx([binom.sf(32, 128, 0.25), 1.0, 0.0])
    assert len(calls) == len(set(calls)) and max(calls) == 128  # each row count once
    assert RowCosts(lambda r: 1.0, 128).expected(0.25)[0] == pytest.approx(1.0)  # r = 0 has mass 4e-17
    linear = RowCosts(lambda r: 2.0 * r, 4096)  # past EXACT_ROWS rows rounded to ~3%: a line's mean holds
    assert linear.expected([0.1, 0.5]) == pytest.approx([2 * 409.6, 2 * 2048], rel=2e-3)
    assert len(set(linear.rounded(range(129, 4097)).tolist())) < 200  # 32 a doubling
    m = {"gemm/cpu/bf16": LinearModel(2.7e-4, 9.3e-11, 1.0), "gemv/cpu/bf16": LinearModel(0.0, 1 / 30e9, 1.0),
         "gemm_rows/cpu/bf16": LinearModel(2.7e-4, 3.6e-10, 1.0), "expert_rows/cpu/bf16": LinearModel(0.0, 1.7e-11, 1.0)}
    def box(rows: int) -> HardwareProfile:
        return HardwareProfile("avx2-box", "test", m, None, None,
                               meta={"native_kernels": True, "kernel_tuning": {"bf16_native_rows": rows}})
    hw = box(32)
    d, F = MIXTRAL.hidden_size, MIXTRAL.moe_intermediate_size
    wb, macs = 3 * d * F * 2, 3 * d * F
    stream = 3 * op_time.memory_time(hw, "cpu", "bf16", wb / 3, "gemv", expert=True)
    assert native_expert_time(hw, "bf16", 8, wb, macs) == pytest.approx(stream + 7 * 1.7e-11 * macs)
    assert native_expert_time(hw, "bf16", 8, wb, macs) < op_time.gemm_time(hw, "cpu", "bf16", 8 * macs, wb, 3)
    # 128 tokens: at the mean (32 rows) every expert is native, as where the kernel takes 64 rows; drawn, ~45%
    # run torch's GEMMs
    assert predict_prefill(MIXTRAL, hw, "bf16", 128) > 1.5 * predict_prefill(MIXTRAL, box(64), "bf16", 128)


def test_bf16_projections_within_the_native_rows_are_priced_as_the_kernel_where_the_cpu_has_no_bf16_gemm():
    """Where the profile says torch has no bf16 GEMM (meta["bf16_gemm_native"] False: AVX2 only), a bf16
    engine's projections are CastLinears (runtime/install), whose calls of up to the native rows run the
    native kernel: a short prompt's projections are priced as its rows, not as torch's GEMM. Past those rows,
    and with a bf16 GEMM (or profiles without the flag), torch's GEMM prices them."""
    from dataclasses import replace

    from tiered.planner.cpu_predict import predict_prefill

    m = {"gemm/cpu/bf16": LinearModel(3e-4, 9e-11, 1.0), "gemv/cpu/bf16": LinearModel(0.0, 1 / 30e9, 1.0),
         "decode_rows/cpu/bf16": LinearModel(0.0, 2e-11, 1.0), "gemm_rows/cpu/bf16": LinearModel(3e-4, 3e-10, 1.0)}
    meta = {"native_kernels": True, "kernel_tuning": {"bf16_native_rows": 32}}
    amx = HardwareProfile("box", "test", m, None, None, meta=meta)
    avx2 = replace(amx, meta=dict(meta, bf16_gemm_native=False))
    dense = replace(MIXTRAL, num_experts=0, num_experts_per_tok=0, model_type="llama")
    for T in (8, 16, 32):
        assert predict_prefill(dense, avx2, "bf16", T) < 0.8 * predict_prefill(dense, amx, "bf16", T)
    assert predict_prefill(dense, avx2, "bf16", 64) == predict_prefill(dense, amx, "bf16", 64)


def test_bf16_gemms_where_the_cpu_has_none_are_priced_as_fp32_gemms_plus_the_conversion():
    """Where the profile says torch has no bf16 GEMM (meta["bf16_gemm_native"] False) and timed convert/cpu/bf16,
    a torch bf16 GEMM is priced as hardware/cpu_gemm.linear runs it: the fp32 GEMM over the converted weight
    (twice the bytes) plus each call's conversion (convert_big/cpu/bf16 past 32 MiB of fp32); the bf16 GEMM keys (timed through that helper, conversion
    and GEMM in one line) price nothing there. Without the key, or with a bf16 GEMM, the bf16 keys price it."""
    from dataclasses import replace

    from tiered.hardware import op_time
    from tiered.planner.cpu_predict import torch_gemm_time

    m = {"gemm/cpu/bf16": LinearModel(2e-3, 1.5e-11, 0.34), "gemm/cpu/fp32": LinearModel(3e-4, 1.6e-11, 1.0),
         "gemv/cpu/bf16": LinearModel(0.0, 1 / 30e9, 1.0), "gemv/cpu/fp32": LinearModel(0.0, 1 / 30e9, 1.0),
         "gemm_rows/cpu/bf16": LinearModel(3e-4, 3e-10, 1.0)}
    conv = LinearModel(2e-5, 8e-10, 1.0)
    native = HardwareProfile("box", "test", m, None, None, meta={"bf16_gemm_native": True})
    avx2 = replace(native, models={**m, "convert/cpu/bf16": conv}, meta={"bf16_gemm_native": False})
    unknown = replace(avx2, meta={})
    n, k = 1536, 576
    for rows, calls in ((64, 1), (512, 1), (512, 4)):
        macs, w = calls * rows * n * k, calls * n * k * 2
        fp32 = op_time.gemm_time(avx2, "cpu", "fp32", macs, 2 * w, calls=calls)
        assert torch_gemm_time(avx2, "bf16", macs, w, calls) == pytest.approx(fp32 + calls * conv(n * k))
        assert torch_gemm_time(native, "bf16", macs, w, calls) == torch_gemm_time(unknown, "bf16", macs, w, calls)
        assert torch_gemm_time(native, "bf16", macs, w, calls) != torch_gemm_time(avx2, "bf16", macs, w, calls)
    # past 32 MiB of fp32 a call, convert_big/cpu/bf16: the copy's fresh pages fault in every call
    big = LinearModel(0.0, 1.4e-9, 1.0)
    both = replace(avx2, models={**avx2.models, "convert_big/cpu/bf16": big})
    for (n, k), key in (((1536, 576), conv), ((3584, 1024), conv), ((4096, 2048), big), ((14336, 4096), big)):
        macs, w = 256 * n * k, n * k * 2
        fp32 = op_time.gemm_time(both, "cpu", "fp32", macs, 2 * w)
        assert torch_gemm_time(both, "bf16", macs, w) == pytest.approx(fp32 + key(n * k))


def test_a_cpu_moe_prompt_is_priced_on_the_expert_profiles_routing():
    """With an expert profile (popularity, tokens routed per expert) a CPU MoE prefill prices the experts the
    profile makes active and their rows (latency_moe.prompt_experts' counting): a prompt whose tokens all go to
    the same 2 of 8 experts a layer runs 2 experts of every row, not 8 of a quarter of them, and the plan on
    the CPU prices its TTFT so (latency_cpu hands the profile on). Uniform counts price as no profile does."""
    from dataclasses import replace

    import numpy as np

    from tiered.planner.cpu_predict import predict_prefill, torch_gemm_time

    m = {"gemm/cpu/bf16": LinearModel(0.0, 1e-12, 1.0), "gemv/cpu/bf16": LinearModel(0.0, 1 / 45e9, 1.0),
         "gemm_rows/cpu/bf16": LinearModel(4e-4, 3 / 45e9, 1.0)}
    hw = HardwareProfile("cpu-box", "test", m, None, None,
                         meta={"native_kernels": True, "kernel_tuning": {"bf16_native_rows": 4}})
    small = replace(MIXTRAL, num_hidden_layers=4)
    skew = np.zeros((4, 8))
    skew[:, 2:4] = 100.0
    T = 512
    uniform = predict_prefill(small, hw, "bf16", T)
    assert predict_prefill(small, hw, "bf16", T, popularity=np.ones((4, 8))) == pytest.approx(uniform, rel=1e-6)
    skewed = predict_prefill(small, hw, "bf16", T, popularity=skew)
    # the experts' part: 8 experts of 128 rows a layer against 2 of 512; all else the same
    d, F = small.hidden_size, small.moe_intermediate_size
    expert = lambda rows: torch_gemm_time(hw, "bf16", 3 * rows * d * F, 3 * d * F * 2, 3)  # noqa: E731
    # (the uniform draw's 128 +- 10 rows priced over the draw, rounded to ~3% past 128 rows: a line's mean holds)
    assert uniform - skewed == pytest.approx(4 * (8 * expert(128) - 2 * expert(512)), rel=2e-3)
    assert skewed < 0.9 * uniform
    plain = make_plan(small, hw, cpu_memory=48 * GiB)
    profiled = make_plan(small, hw, cpu_memory=48 * GiB, popularity=skew)
    assert profiled.predicted_ttft_s == pytest.approx(plain.predicted_ttft_s - (uniform - skewed), rel=1e-6)


def test_one_copy_int4_prompts_are_priced_on_the_path_their_rows_take():
    """A one-copy int4 weight's prompt GEMM runs the int4 kernel up to quant/int4.dequantize_rows() rows and a
    dequantized GEMM past them; the profile records that row count (meta["int4_dequantize_rows"]) and times
    gemm/cpu/int4 past it. Up to it a prompt's projections cost one stream of the weights and each row past
    the first at decode_rows/cpu/int4's slope, whatever gemm/cpu/int4 says; past it gemm/cpu/int4 prices
    them. (On 2 AMX cores both paths in one fit priced SmolLM2's default 512-token TTFT 0.75 s for 0.32.)"""
    from tiered.planner.cpu_predict import predict_prefill

    m = {"gemm/cpu/int4": LinearModel(1e-3, 2e-12, 1.0), "gemv/cpu/int4": LinearModel(0.0, 1 / 30e9, 1.0),
         "decode_rows/cpu/int4": LinearModel(0.0, 1.2e-11, 1.0), "gemm/cpu/fp32": LinearModel(0.0, 7e-12, 1.0)}
    meta = {"native_kernels": True, "int4_dequantize_rows": 96}
    hw = HardwareProfile("cpu-box", "test", m, None, None, meta=meta)
    slow = HardwareProfile("cpu-box", "test", {**m, "gemm/cpu/int4": LinearModel(5e-3, 2e-11, 1.0)}, None, None,
                           meta=meta)
    faster_rows = HardwareProfile("cpu-box", "test", {**m, "decode_rows/cpu/int4": LinearModel(0.0, 6e-12, 1.0)},
                                  None, None, meta=meta)
    def ttft(profile, tokens):  # one-copy int4 weights, fp32 activations (the planner's act_dtype)
        return predict_prefill(LLAMA70B, profile, "int4", tokens, act_dtype="fp32")

    assert ttft(hw, 64) == ttft(slow, 64)
    assert ttft(faster_rows, 64) < 0.7 * ttft(hw, 64)
    assert ttft(slow, 512) > 3 * ttft(hw, 512)
    assert ttft(faster_rows, 512) == ttft(hw, 512)
    older = HardwareProfile("cpu-box", "test", m, None, None, meta={"native_kernels": True})  # before the key
    assert ttft(older, 64) != ttft(hw, 64)
    # on int8 activations (Plan.batch_act "q8", the default) the rows cost decode_rows/cpu/int4q8's slope
    q8 = HardwareProfile("cpu-box", "test", {**m, "gemv/cpu/int4q8": m["gemv/cpu/int4"],
                                             "decode_rows/cpu/int4q8": LinearModel(0.0, 4e-12, 1.0)}, None, None, meta=meta)
    on_q8 = lambda p, tokens: predict_prefill(LLAMA70B, p, "int4", tokens, act_dtype="fp32", batch_act="q8")  # noqa: E731
    assert on_q8(q8, 64) < 0.7 * ttft(q8, 64) and ttft(q8, 64) == ttft(hw, 64)
    assert on_q8(q8, 512) == ttft(q8, 512)  # past the kernel's rows: the dequantized GEMM either way
    # AVX2's kernel on int8 rows outruns its dequantized fp32 GEMM at every row count (quant/int4.DEQUANTIZE_ROWS_Q8):
    # a 512-token prompt's rows there take the kernel, priced at its rows' slope, not gemm/cpu/int4
    avx2 = HardwareProfile("cpu-box", "test", q8.models, None, None, meta={**meta, "kernel_isa": "avx2"})
    avx2_slow_gemm = HardwareProfile("cpu-box", "test", {**q8.models, "gemm/cpu/int4": LinearModel(5e-3, 2e-11, 1.0)},
                                     None, None, meta={**meta, "kernel_isa": "avx2"})
    assert on_q8(avx2, 512) == on_q8(avx2_slow_gemm, 512) != on_q8(q8, 512)
    assert ttft(avx2, 512) == ttft(q8, 512) and ttft(avx2_slow_gemm, 512) > ttft(avx2, 512)  # bf16 rows: past 256
    # a profile whose kernel tuning measured the q8 choice (kernels/tune.py, as on 2 Zen 5 cores: never) is priced
    # by it on any ISA: the kernel's rows at 512 tokens, as AVX2's; a tuned 256 dequantizes the 512-token GEMMs
    tuned = {**meta, "kernel_isa": "avx512", "kernel_tuning": {"q8_dequantize_rows": 0}}
    never = HardwareProfile("cpu-box", "test", q8.models, None, None, meta=tuned)
    never_slow_gemm = HardwareProfile("cpu-box", "test", avx2_slow_gemm.models, None, None, meta=tuned)
    assert on_q8(never, 512) == on_q8(never_slow_gemm, 512) == on_q8(avx2, 512)
    past_256 = HardwareProfile("cpu-box", "test", q8.models, None, None,
                               meta={**tuned, "kernel_tuning": {"q8_dequantize_rows": 256}})
    assert on_q8(past_256, 512) == on_q8(q8, 512) and on_q8(past_256, 128) == on_q8(never, 128)


def test_quantized_prompt_experts_are_priced_on_the_paths_their_rows_take():
    """A CPU prompt's quantized experts run their native kernels (mxfp4: in one call up to the ISA's kernel
    rows; int4: one call up to 8 rows, groups of 8 up to 128, gpt-oss's biased ones one call up to 8; int8-g32:
    groups at any rows), past them a dequantized GEMM (gemm/cpu/int4), as quant/experts.prompt_rows says for
    the profiled machine's kernel ISA (meta["kernel_isa"], else read off meta["int4_dequantize_rows"]). Priced
    as fp32 GEMMs before, a gpt-oss-20b-width 512-token prompt's experts cost 5.0 s of a TTFT of 1.9."""
    from tiered.hardware import op_time
    from tiered.planner.cpu_predict import kernel_isa, predict_prefill, prompt_expert_time

    stream, row, deq = 1 / 30e9, 4e-12, LinearModel(1e-3, 2e-12, 1.0)
    m = {"gemv/cpu/int4q8": LinearModel(0.0, stream, 1.0), "decode_rows/cpu/int4q8": LinearModel(0.0, row, 1.0),
         "gemv/cpu/int8-g32": LinearModel(0.0, stream, 1.0), "decode_rows/cpu/int8": LinearModel(0.0, row, 1.0),
         "gemm/cpu/int4": deq, "gemm/cpu/fp32": LinearModel(0.0, 7e-12, 1.0)}
    def box(**meta):
        return HardwareProfile("cpu-box", "test", m, None, None, meta={"native_kernels": True, **meta})
    avx512, avx2 = box(kernel_isa="avx512"), box(kernel_isa="avx2")
    assert (kernel_isa(box(int4_dequantize_rows=96)), kernel_isa(box(int4_dequantize_rows=256))) == ("avx512", "avx2")
    assert kernel_isa(HardwareProfile("cpu-box", "test", m, None, None)) is None
    wb, macs = 3 * 2880 * 2912 * 0.625, 3 * 2880 * 2912
    kernel = lambda r, groups=1: groups * wb * stream + (r - groups) * row * macs  # noqa: E731
    dequantized = lambda r: op_time.gemm_time(avx512, "cpu", "int4", r * macs, wb, calls=3)  # noqa: E731
    for r in (1, 16, 96):
        assert prompt_expert_time(avx512, "mxfp4", r, wb, macs) == pytest.approx(kernel(r))
    assert prompt_expert_time(avx512, "mxfp4", 128, wb, macs) == pytest.approx(dequantized(128))
    assert prompt_expert_time(avx2, "mxfp4", 128, wb, macs) == pytest.approx(kernel(128))  # AVX2: 512 rows
    assert prompt_expert_time(avx512, "int4", 8, wb, macs, "q8") == pytest.approx(kernel(8))
    assert prompt_expert_time(avx512, "int4", 20, wb, macs, "q8") == pytest.approx(kernel(20, 3))  # 3 groups
    assert prompt_expert_time(avx512, "int4", 20, wb, macs, "q8", biased=True) == pytest.approx(dequantized(20))
    assert prompt_expert_time(avx512, "int4", 200, wb, macs, "q8") == pytest.approx(dequantized(200))
    # AVX2 on int8 rows: groups at any rows (quant/experts.GROUPED_ROWS_Q8: 1.6-3x the dequantized matmul's speed)
    assert prompt_expert_time(avx2, "int4", 200, wb, macs, "q8") == pytest.approx(kernel(200, 25))
    assert prompt_expert_time(avx2, "int4", 20, wb, macs, "q8", biased=True) == pytest.approx(dequantized(20))
    # a profile whose kernel tuning measured the choice (kernels/tune.py's q8_expert_grouped_rows; 0: groups at
    # any rows, as on 2 Zen 5 cores) prices by it on any ISA
    def tuned(rows):
        return HardwareProfile("cpu-box", "test", m, None, None,
                               meta={**avx512.meta, "kernel_tuning": {"q8_expert_grouped_rows": rows}})
    assert prompt_expert_time(tuned(0), "int4", 200, wb, macs, "q8") == pytest.approx(kernel(200, 25))
    assert prompt_expert_time(tuned(64), "int4", 100, wb, macs, "q8") == pytest.approx(dequantized(100))
    assert prompt_expert_time(tuned(64), "int4", 60, wb, macs, "q8") == pytest.approx(kernel(60, 8))
    assert prompt_expert_time(tuned(0), "int4", 200, wb, macs, "bf16") == pytest.approx(dequantized(200))  # the table's
    # ... and an mxfp4 projection's one-call rows (mxfp4_kernel_rows; 0: at any rows, as on 2 Zen 5 cores)
    mx = HardwareProfile("cpu-box", "test", m, None, None, meta={**avx512.meta, "kernel_tuning": {"mxfp4_kernel_rows": 0}})
    assert prompt_expert_time(mx, "mxfp4", 128, wb, macs) == pytest.approx(kernel(128))
    assert prompt_expert_time(avx512, "int8-g32", 1000, wb, macs) == pytest.approx(kernel(1000, 125))
    assert prompt_expert_time(avx512, "int4", 20, wb, macs, "bf16") is None  # no int4 (bf16 rows) keys
    # profiled expert_groups (profiler 45): an expert the cache holds twice over re-streams its groups past the first
    # from it, their rows at that key's slope; one too big for the cache (here: llc 4 x its bytes, then 1.5 x) keeps a
    # stream a group
    grouped = 2.5e-12

    def groups(llc):
        return HardwareProfile("cpu-box", "test", {**m, "expert_groups/cpu/int4q8": LinearModel(0.0, grouped, 1.0)},
                               None, None, meta={**avx512.meta, "llc_bytes": llc})
    first = wb * stream + 7 * row * macs
    # (20 rows: 3 groups, the later two paid whole: 16 rows at the slope; the kernel streams the expert once a group)
    assert prompt_expert_time(groups(4 * wb), "int4", 20, wb, macs, "q8") == pytest.approx(first + 16 * grouped * macs)
    assert prompt_expert_time(groups(4 * wb), "int4", 8, wb, macs, "q8") == pytest.approx(kernel(8))
    assert prompt_expert_time(groups(1.5 * wb), "int4", 20, wb, macs, "q8") == pytest.approx(kernel(20, 3))
    assert prompt_expert_time(groups(4 * wb), "mxfp4", 20, wb, macs) == pytest.approx(kernel(20))  # its own key
    assert prompt_expert_time(HardwareProfile("cpu-box", "test", m, None, None), "mxfp4", 16, wb, macs) is None
    # a Mixtral-width prompt of 64 tokens (16 rows an expert) with mxfp4 experts: the kernel's rows, not the
    # dequantized GEMM nor the fp32 GEMM it was priced as; at 512 tokens (128 rows) the dequantized GEMM
    ttft = lambda p, tokens: predict_prefill(MIXTRAL, p, "fp32", tokens, experts_format="mxfp4")  # noqa: E731
    slow_deq = HardwareProfile("cpu-box", "test", {**m, "gemm/cpu/int4": LinearModel(1e-2, 2e-11, 1.0)}, None,
                               None, meta=avx512.meta)
    slow_rows = HardwareProfile("cpu-box", "test", {**m, "decode_rows/cpu/int4q8": LinearModel(0.0, 2 * row, 1.0)},
                                None, None, meta=avx512.meta)
    assert ttft(slow_deq, 64) == ttft(avx512, 64) < ttft(slow_rows, 64)
    # 128 +- 10 rows an expert: the dequantized GEMM's, but for the draw's ~1e-4 below the kernel's 96 rows
    assert ttft(slow_rows, 512) == pytest.approx(ttft(avx512, 512), rel=1e-3)
    assert ttft(avx512, 512) < ttft(slow_deq, 512)
    fp32 = HardwareProfile("cpu-box", "test", m, None, None)  # no kernels: the fp32 GEMMs
    assert ttft(fp32, 64) > 1.3 * ttft(avx512, 64)
    # where the profile timed the int4 expert's own rows (expert_rows/cpu/int4q8, profiler 31) they price an int4
    # expert's rows past each call's first; the decode kernels' rows (decode_rows) no longer do, nor for mxfp4
    expert_rows = HardwareProfile("cpu-box", "test", {**m, "expert_rows/cpu/int4q8": LinearModel(0.0, 3 * row, 1.0)},
                                  None, None, meta=avx512.meta)
    expert_kernel = lambda r, groups=1: groups * wb * stream + (r - groups) * 3 * row * macs  # noqa: E731
    assert prompt_expert_time(expert_rows, "int4", 20, wb, macs, "q8") == pytest.approx(expert_kernel(20, 3))
    assert prompt_expert_time(expert_rows, "mxfp4", 16, wb, macs) == pytest.approx(kernel(16))
    # a GGUF file's k-quant experts (q6k / q5k / iq4xs): their kernels' groups at any rows, as int8-g32's; a format
    # of mixed kinds (a Q4_K_M file's int4,int4,q6k) by its first kind's paths, as its decode is priced, not the fp32
    # GEMMs it had fallen to (no key prices the mix itself)
    kq = HardwareProfile("cpu-box", "test", {**m, "gemv/cpu/q6k": LinearModel(0.0, stream, 1.0),
                                             "decode_rows/cpu/q6kq8": LinearModel(0.0, row, 1.0),
                                             "gemm/cpu/fp32": LinearModel(0.0, 1e-10, 1.0)}, None, None,
                         meta=avx512.meta)  # (fp32 GEMMs slow enough to show where they would price the experts)
    assert prompt_expert_time(kq, "q6k", 1000, wb, macs, "q8") == pytest.approx(kernel(1000, 125))
    moe = dataclasses.replace(MIXTRAL, hidden_size=2048, moe_intermediate_size=768)
    mixed = predict_prefill(moe, kq, "fp32", 64, experts_format="int4,int4,q6k", batch_act="q8")
    plain = predict_prefill(moe, kq, "fp32", 64, experts_format="int4", batch_act="q8")
    assert mixed == pytest.approx(plain, rel=0.05)  # (the mix's bytes: 6% more than int4's)
    assert prompt_expert_time(kq, "int4,int4,q6k", 16, wb, macs, "q8") is None  # (the caller's first kind, then)


def test_biased_prompt_experts_pay_torchs_glu_only_past_their_native_rows(monkeypatch):
    """gpt-oss's experts (expert_bias) run their bias columns and clamped GLU inside the native calls up to
    their one-call rows (ExpertFormat.biased_rows: mxfp4's kernel rows on AVX-512), so a prompt's layer code
    is priced over each routed row's hidden width only and no per-expert hop; past those rows torch computes
    the GLU over the intermediate width too, each expert a hop (cpu_predict.biased_native_rows), but where the
    profile prices the AMX GEMM, whose native call computes them inside (cpu_predict.amx_experts)."""
    import dataclasses

    from tiered.hardware import op_time
    from tiered.planner.cpu_predict import biased_native_rows, predict_prefill

    m = {"gemv/cpu/int4q8": LinearModel(0.0, 1 / 30e9, 1.0), "decode_rows/cpu/int4q8": LinearModel(0.0, 4e-12, 1.0),
         "gemm/cpu/int4": LinearModel(1e-3, 2e-12, 1.0), "gemm/cpu/fp32": LinearModel(0.0, 7e-12, 1.0)}
    hw = HardwareProfile("cpu-box", "test", m, None, None, meta={"native_kernels": True, "kernel_isa": "avx512"})
    gpt_oss = dataclasses.replace(MIXTRAL, expert_bias=True, swiglu_limit=7.0)
    assert biased_native_rows(hw, "mxfp4") == 96 and biased_native_rows(hw, "int4") == 8
    assert biased_native_rows(HardwareProfile("cpu-box", "test", m, None, None), "mxfp4") == 0  # no kernels
    widths = []
    real = op_time.prefill_code_time
    monkeypatch.setattr(op_time, "prefill_code_time", lambda hw_, dt, n: widths.append(n) or real(hw_, dt, n))
    d, F, k = gpt_oss.hidden_size, gpt_oss.moe_intermediate_size, gpt_oss.num_experts_per_tok
    short = predict_prefill(gpt_oss, hw, "fp32", 64, experts_format="mxfp4")  # 16 rows an expert: native
    assert set(widths) == {64 * (d + k * d)}
    widths.clear()
    long = predict_prefill(gpt_oss, hw, "fp32", 512, experts_format="mxfp4")  # 128 rows: torch's GLU
    assert set(widths) == {512 * (d + k * (d + F))}
    # on a CPU with AMX the experts past those rows take one native call each, the GLU inside (ExpertFormat.amx_rows)
    amx = HardwareProfile("cpu-box", "test", {**m, "gemm_amx/cpu/int4": LinearModel(1e-5, 1e-12, 1.0)}, None, None,
                          meta=hw.meta)
    widths.clear()
    predict_prefill(gpt_oss, amx, "fp32", 512, experts_format="mxfp4")
    assert set(widths) == {512 * (d + k * d)}
    widths.clear()
    # each expert past its rows also pays a hop (task_overhead): a slower hop moves only the long prompt
    monkeypatch.setattr(op_time, "task_overhead", lambda hw_: 0.1)
    assert predict_prefill(gpt_oss, hw, "fp32", 64, experts_format="mxfp4") == short
    assert predict_prefill(gpt_oss, hw, "fp32", 512, experts_format="mxfp4") > long + 0.1 * MIXTRAL.num_hidden_layers


def test_prompt_experts_run_by_torch_pay_its_glu_over_their_rows():
    """Past the native kernels' rows a CPU expert runs torch's GEMMs (bf16) or dequantized GEMMs (int4), and
    torch's SiLU and product over its rows' intermediate width between them: priced at runtime/prefill_code's
    slope per element (the Mixtral-width dummy's 512-token prompt, 16 experts of 512 rows, spent 24 ms of
    0.193 s there and was priced 0.147 without it). Within the kernels' rows the GLU is fused: no charge."""
    from tiered.planner.cpu_predict import predict_prefill

    base = {"gemm/cpu/bf16": LinearModel(0.0, 1e-12, 1.0), "gemm/cpu/int4": LinearModel(0.0, 2e-12, 1.0),
            "gemm/cpu/fp32": LinearModel(0.0, 4e-12, 1.0), "gemv/cpu/bf16": LinearModel(0.0, 1 / 45e9, 1.0),
            "gemv/cpu/int4q8": LinearModel(0.0, 1 / 30e9, 1.0), "decode_rows/cpu/int4q8": LinearModel(0.0, 4e-12, 1.0)}
    meta = {"native_kernels": True, "kernel_isa": "avx512", "kernel_tuning": {"bf16_native_rows": 16}}

    def price(beta: float, T: int, fmt: str | None = None, ffn_only: bool = False) -> float:
        hw = HardwareProfile("cpu-box", "test", {**base, "runtime/prefill_code/fp32": LinearModel(1e-4, beta, 1.0)},
                             None, None, meta=meta)
        return predict_prefill(MIXTRAL, hw, "bf16", T, act_dtype="fp32", experts_format=fmt, ffn_only=ffn_only)

    d, F, k, L = MIXTRAL.hidden_size, MIXTRAL.moe_intermediate_size, MIXTRAL.num_experts_per_tok, 32
    b = 1e-9
    code = lambda T: L * b * T * (d + k * d)  # noqa: E731  (the layers' own code over their widths)
    # 16 tokens: 4 rows an expert, in the native kernel (its GLU fused)
    assert price(b, 16) - price(0.0, 16) == pytest.approx(code(16))
    # 1024 tokens: 256 rows an expert, torch's GEMMs and GLU over every routed row's F
    for fmt in (None, "int4"):
        # (RowCosts.expected sums a truncated draw: within 0.1%)
        assert price(b, 1024, fmt) - price(0.0, 1024, fmt) == pytest.approx(code(1024) + L * b * 1024 * k * F, rel=1e-3)
        # a prompt as rows of the native step (predict_prompt_rows' `ffn`) counts every routed row's SwiGLU in
        # the rows' own layer code: its FFNs alone pay no GLU here
        assert price(b, 1024, fmt, ffn_only=True) == price(0.0, 1024, fmt, ffn_only=True)


def test_a_native_experts_rows_past_the_first_cost_the_profiled_slope():
    """expert_rows/cpu/bf16 (the native bf16 expert at 1-8 rows): a native expert of r rows costs one
    stream of its weights plus r - 1 rows at the key's slope (a 1024 x 3584 expert on 2 Zen 4 cores: 414
    / 725 / 942 us at 1 / 4 / 8 rows, where one stream priced ~490 whatever the rows); one row, or no
    key, gemm_time. A CPU MoE prefill of 16 tokens (4 rows an expert) pays it."""
    from tiered.hardware import op_time
    from tiered.planner.cpu_predict import native_expert_time, predict_prefill

    m = {"gemm/cpu/bf16": LinearModel(0.0, 1e-12, 1.0), "gemv/cpu/bf16": LinearModel(0.0, 1 / 45e9, 1.0)}
    meta = {"native_kernels": True, "kernel_tuning": {"bf16_native_rows": 8}}
    plain = HardwareProfile("cpu-box", "test", m, None, None, meta=meta)
    hw = HardwareProfile("cpu-box", "test", {**m, "expert_rows/cpu/bf16": LinearModel(3e-4, 7e-12, 1.0)}, None, None,
                         meta=meta)
    macs, w = 3 * 1024 * 3584, 3 * 1024 * 3584 * 2
    for rows in (1, 4, 8):
        old = op_time.gemm_time(plain, "cpu", "bf16", rows * macs, w, calls=3)
        assert native_expert_time(plain, "bf16", rows, w, macs) == old
        want = old if rows == 1 else max(old, w / 45e9 + 7e-12 * (rows - 1) * macs)
        assert native_expert_time(hw, "bf16", rows, w, macs) == pytest.approx(want)
    assert native_expert_time(hw, "bf16", 4, w, macs) > 1.4 * native_expert_time(plain, "bf16", 4, w, macs)
    assert predict_prefill(MIXTRAL, hw, "bf16", 16) > predict_prefill(MIXTRAL, plain, "bf16", 16)


def test_parallel_reads_make_read_ahead_faster():
    from tiered.planner.cpu_predict import HitStats, predict_decode

    hits = HitStats(miss={i: 4 for i in range(32)})
    _, seq = predict_decode(MIXTRAL, _disk_box(False), "bf16", context=64, hits=hits)
    _, par = predict_decode(MIXTRAL, _disk_box(True), "bf16", context=64, hits=hits)
    _, one = predict_decode(MIXTRAL, _disk_box(True), "bf16", context=64, hits=hits, readers=1)
    _, one_seq = predict_decode(MIXTRAL, _disk_box(False), "bf16", context=64, hits=hits, readers=1)
    assert par < seq < one and one == pytest.approx(one_seq)  # one reader: the parallel fit does not apply


def test_weights_beyond_the_last_level_cache_stream_at_dram_speed():
    """A decode step whose weights exceed the cache reads them at memory/bandwidth_dram; one that
    fits keeps the GEMV fit (timed on weights the cache may hold); the plain read bandwidth floors both."""
    from tiered.hardware import op_time

    m = {"gemv/cpu/fp32": LinearModel(0.0, 1e-11), "memory/bandwidth/cpu": LinearModel(0.0, 2e-11),
         "memory/bandwidth_dram/cpu": LinearModel(1e-3, 5e-11)}
    hw = HardwareProfile("llc-box", "test", m, None, None, {"llc_bytes": 256 * 2**20})
    n = 64 * 2**20
    assert op_time.memory_time(hw, "cpu", "fp32", n) == pytest.approx(2e-11 * n)  # read-bandwidth floor
    assert op_time.memory_time(hw, "cpu", "fp32", n, working_set=200 * 2**20) == pytest.approx(2e-11 * n)
    assert op_time.memory_time(hw, "cpu", "fp32", n, working_set=300 * 2**20) == pytest.approx(5e-11 * n)
    no_llc = HardwareProfile("x", "test", m, None, None, {})
    assert op_time.memory_time(no_llc, "cpu", "fp32", n, working_set=1e12) == pytest.approx(2e-11 * n)


def test_a_routed_expert_is_read_again_only_after_e_over_k_steps():
    """Between two reads of one routed expert pass E / k decode steps under uniform routing, not one: where the
    step's weights fit the last-level cache but E / k steps of them do not, the experts stream at DRAM's rate while
    the attention (read every step) keeps the cache's. The Qwen3-30B-A3B-width 8-layer file (E / k = 16, a 370 MB
    step) on a VM reporting a 480 MiB L3 had its decode priced 18% fast (2 AMX cores, 2026-12-06)."""
    from tiered.planner.cpu_predict import predict_decode, step_weight_bytes

    m = {"gemv/cpu/bf16": LinearModel(0.0, 1e-11), "gemm/cpu/bf16": LinearModel(0.0, 1e-12),
         "memory/bandwidth/cpu": LinearModel(0.0, 1e-11), "memory/bandwidth_dram/cpu": LinearModel(0.0, 5e-11)}
    ws = step_weight_bytes(MIXTRAL, "bf16")  # E / k = 4 steps of it between an expert's reads

    def layers(llc):
        hw = HardwareProfile("llc-box", "test", m, None, None, {"llc_bytes": int(llc)})
        return predict_decode(MIXTRAL, hw, "bf16", context=64)[0]

    within, between, beyond = layers(8 * ws), layers(2 * ws), layers(ws / 2)
    expert = 3 * MIXTRAL.hidden_size * MIXTRAL.moe_intermediate_size * 2
    assert between[0][0] == pytest.approx(within[0][0], rel=1e-3)  # attention: the step's own working set fits
    assert between[0][1] - within[0][1] == pytest.approx(2 * expert * 4e-11, rel=0.01)  # its 2 experts at DRAM's
    assert beyond[0][1] == pytest.approx(between[0][1], rel=1e-3) and beyond[0][0] > between[0][0]


def test_cpu_path_misses_never_fill_the_cache():
    """The runtime claims a cache slot only for a miss it copies: replaying a trace with every miss
    on the CPU leaves the cache empty, with every miss copied it fills as without an accelerator."""
    from tiered.planner.cpu_predict import routing_trace, simulate_hits

    trace = routing_trace([0, 1], 8, 2, 200)
    assert sum(simulate_hits(trace, set(), 4, copied=lambda t: [False] * len(t)).cache.values()) == 0
    copied = simulate_hits(trace, set(), 4, copied=lambda t: [True] * len(t))
    assert copied == simulate_hits(trace, set(), 4) and sum(copied.cache.values()) > 0


def test_the_lm_head_is_priced_in_its_own_decode_format():
    """A GGUF Q4 file often keeps its token embedding (the tied lm_head) as Q8_0: the decode copies
    are int4 layers and an int8(-g32) head (quant/linear.head_precision), and the CPU prediction reads the
    head's bytes at its GEMV's rate. The plan records it as dtypes["lm_head"]."""
    from types import SimpleNamespace

    from tiered.hardware import op_time
    from tiered.planner.cpu_predict import predict_decode
    from tiered.quant.linear import head_precision

    class Ckpt:
        def __init__(self, formats):
            self.formats = formats

        def has(self, name):
            return name in self.formats

        def handle(self, name):  # (a K-quant's rows are whole super-blocks of 256)
            return SimpleNamespace(format=self.formats[name], shape=(49152, 768 if self.formats[name] == "Q6_K" else 576))

    # tied; Q8_0: its blocks as int8-g32 where tiered's kernels are built (quant/int8.Int8G32Linear), else per-row int8
    assert head_precision(Ckpt({"model.embed_tokens.weight": "Q8_0"}), "auto") == ("int8-g32" if kernels.available() else "int8")
    assert head_precision(Ckpt({"lm_head.weight": "Q4_1", "model.embed_tokens.weight": "Q8_0"}), "auto") == "int4"
    # Q6_K: as stored where tiered's kernels are built (quant/kquant.Q6KLinear), else bf16
    assert head_precision(Ckpt({"lm_head.weight": "Q6_K"}), "auto") == ("q6k" if kernels.available() else "bf16")
    # a lattice i-quant: int4 re-quantized per 32 (quant/linear.GGUF_DECODE_KIND); a 16-bit one: bf16
    assert head_precision(Ckpt({"lm_head.weight": "IQ2_XS"}), "auto") == "int4"
    assert head_precision(Ckpt({"lm_head.weight": "F16"}), "auto") == "bf16"
    assert head_precision(Ckpt({"model.embed_tokens.weight": "Q8_0"}), "int4") == "int4"
    cfg = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    m = {"gemv/cpu/int4": LinearModel(1e-5, 5e-11, 1.0), "gemv/cpu/int8": LinearModel(1e-5, 6e-11, 1.0),
         "attn/cpu/fp32": LinearModel(0.0, 1e-10, 1.0), "gemm/cpu/fp32": LinearModel(1e-4, 1e-11, 1.0)}
    hw = HardwareProfile("cpu-box", "test", m, None, None)
    _, same = predict_decode(cfg, hw, "int4", context=64)
    _, int8 = predict_decode(cfg, hw, "int4", context=64, head_dtype="int8")
    n = 576 * 49152
    assert int8 - same == pytest.approx(6e-11 * n * op_time.bytes_per_element("int8") - 5e-11 * n * op_time.bytes_per_element("int4"))
    plan = make_plan(cfg, hw, precision="int4", weights_format="fp32", head_precision="int8")
    assert plan.dtypes["lm_head"] == "int8"
    assert "lm_head" not in make_plan(cfg, hw, precision="int4", weights_format="fp32", head_precision="int4").dtypes


def test_mixed_decode_copies_are_priced_at_each_precision():
    """A Q4_K_M file decodes its Q4_K projections from int4 copies and its Q6_K ones (attn_v, ffn_down
    in half the layers) from bf16 copies. quant/linear.decode_mix gives the shares by elements; the
    plan records them (Plan.precision_mix, replayed with the plan) and the CPU prediction prices each
    share at its own GEMV rate and bytes: between all-int4 and all-bf16, and in one-copy mode the
    held bytes too."""
    from types import SimpleNamespace

    from tiered.planner.cpu_predict import predict_decode
    from tiered.quant.linear import decode_mix, decode_precision

    D, F = 576, 1536
    shapes = {"q_proj": (D, D), "k_proj": (192, D), "v_proj": (192, D), "o_proj": (D, D), "gate_proj": (F, D),
              "up_proj": (F, D), "down_proj": (D, F)}
    formats = {f"model.layers.{i}.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}.weight":
               ("Q6_K" if p in ("v_proj", "down_proj") and i % 2 == 0 else "Q4_K", n * k)
               for i in range(2) for p, (n, k) in shapes.items()}

    class Ckpt:
        def names(self):
            return list(formats)

        def handle(self, name):
            return SimpleNamespace(format=formats[name][0], numel=formats[name][1], shape=(16, 256))

    q6 = sum(n for f, n in formats.values() if f == "Q6_K") / sum(n for _, n in formats.values())
    mix = decode_mix(Ckpt(), "auto")
    six = "q6k" if kernels.available() else "bf16"  # Q6_K's copies (quant/linear.auto_kind)
    assert mix == pytest.approx({six: q6, "int4": 1 - q6})
    mix = {"bf16": q6, "int4": 1 - q6}  # priced below as bf16 copies, whatever this machine builds
    assert decode_precision(Ckpt(), "auto") == "int4" and decode_mix(Ckpt(), "int4") is None
    cfg = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=D, intermediate_size=F, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    m = {"gemv/cpu/int4": LinearModel(0.0, 5e-11, 1.0), "gemv/cpu/bf16": LinearModel(0.0, 4e-11, 1.0),
         "attn/cpu/fp32": LinearModel(0.0, 1e-10, 1.0), "gemm/cpu/fp32": LinearModel(1e-4, 1e-11, 1.0),
         "gemm/cpu/int4": LinearModel(1e-4, 1e-11, 1.0)}
    hw = HardwareProfile("cpu-box", "test", m, None, None)  # no per-call cost: the bytes alone
    _, int4 = predict_decode(cfg, hw, "int4", context=64, head_dtype="int4")
    _, bf16 = predict_decode(cfg, hw, "bf16", context=64, head_dtype="int4")
    _, mixed = predict_decode(cfg, hw, "int4", context=64, head_dtype="int4", mix=mix)
    assert int4 < mixed < bf16
    # the layers' weight bytes are read at each precision's rate: the share of the difference is the mix's
    assert (mixed - int4) / (bf16 - int4) == pytest.approx(mix["bf16"])
    one = make_plan(cfg, hw, precision="int4", weights_format="bf16", dense_copies=False, precision_mix=mix)
    plain = make_plan(cfg, hw, precision="int4", weights_format="bf16", dense_copies=False)
    assert one.precision_mix == mix and plain.precision_mix is None
    assert Plan.from_json(one.to_json()).precision_mix == mix
    assert one.predicted_decode_tokens_per_s < plain.predicted_decode_tokens_per_s
    assert one.memory["cpu"] > plain.memory["cpu"]  # the bf16 copies held beside the int4 ones


def test_a_dense_model_that_fits_the_gpu_is_not_sliced():
    """ScheInfer slices what the GPU cannot hold. On a host whose CPU GEMVs look as fast as the GPU's
    (here: the H200 host's profile with CPU rates made 100x faster), splitting a layer that fits
    would still pay host syncs the cost model leaves out, and costs the step its CUDA graphs."""
    from dataclasses import replace
    from pathlib import Path

    hw = HardwareProfile.load(Path(__file__).resolve().parents[1] / "benchmarks" / "reference" / "h200-2026-11-26"
                              / "profile_quick.json")
    fast = {k: (replace(m, alpha=m.alpha / 100, beta=m.beta / 100) if k.startswith(("gemv/cpu", "gemm/cpu")) else m)
            for k, m in hw.models.items()}
    hw = replace(hw, models=fast)
    tiny = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "max_position_embeddings": 64})
    p = make_plan(tiny, hw, gpu_memory=100 * GiB, prompt_tokens=32, gen_tokens=32, precision="fp32")
    assert not p.sliced_layers() and all(l.r_gg == 1.0 for l in p.layers)
    # the same machine under a budget that holds only part of the FFNs slices them
    big = ModelConfig.from_hf({"model_type": "llama",
                               "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                               "num_hidden_layers": 8, "num_attention_heads": 32, "num_key_value_heads": 8,
                               "max_position_embeddings": 4096})
    assert make_plan(big, hw, gpu_memory=2 * GiB, prompt_tokens=32, gen_tokens=32).sliced_layers()


def test_a_graphed_all_resident_moe_step_is_priced_without_the_runners_syncs():
    """Every expert resident and graphs on (the engine's grouped GEMMs in one CUDA graph): a decode
    layer costs its small kernels or attention, then its k experts from GPU memory; no host sync, no
    per-expert launches. An offloading plan keeps the runner's costs either way."""
    from dataclasses import replace

    from tiered.hardware import op_time

    hw = get_preset("scheinfer-b")
    small = replace(MIXTRAL, num_hidden_layers=4)
    eager = make_plan(small, hw, gpu_memory=80 * GiB, precision="bf16")
    graphed = make_plan(small, hw, gpu_memory=80 * GiB, precision="bf16", graphs=True)
    assert eager.all_experts_resident() and graphed.all_experts_resident()
    assert graphed.predicted_decode_tokens_per_s > eager.predicted_decode_tokens_per_s
    _, per_layer = op_time.step_overhead(hw, "bf16", "gpu", graphed="whole")
    for l in graphed.layers:
        assert per_layer <= l.decode_s < min(e.decode_s for e in eager.layers)
    offload = make_plan(small, hw, gpu_memory=4 * GiB, precision="bf16", graphs=True)
    offload_eager = make_plan(small, hw, gpu_memory=4 * GiB, precision="bf16")
    assert not offload.all_experts_resident()
    # the preset has no graphed-step key: the host cost per layer falls back to the eager step's
    assert "runtime/decode_step_graphed_gpu/bf16" not in hw.models
    assert offload.predicted_decode_tokens_per_s == pytest.approx(offload_eager.predicted_decode_tokens_per_s)


def test_prefill_attention_is_priced_by_its_own_key_in_the_activations_dtype():
    """A prompt's causal attention runs in the activations' dtype through torch's SDPA, several times
    slower per MAC than a GEMM on 2 CPU cores: attn_prefill/cpu/<dtype> prices it where profiled (else
    the GEMM fit, two calls), and predict_prefill asks for the activations' dtype."""
    from dataclasses import replace

    from tiered.hardware import op_time
    from tiered.planner.cpu_predict import predict_prefill

    hw = cpu_only_profile()
    macs = 1e9
    assert op_time.prefill_attention_time(hw, "cpu", "bf16", macs) == pytest.approx(2 * 0.0 + 1e-11 * macs)
    slow = replace(hw, models={**hw.models, "attn_prefill/cpu/fp32": LinearModel(1e-4, 2.5e-11, 1.0),
                               "gemm/cpu/fp32": LinearModel(0.0, 1e-11, 1.0)})
    assert op_time.prefill_attention_time(slow, "cpu", "fp32", macs) == pytest.approx(1e-4 + 2.5e-11 * macs)
    small = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
                                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})
    base = predict_prefill(small, slow, "bf16", 256)
    assert predict_prefill(small, slow, "bf16", 256, act_dtype="fp32") > base  # the fp32 SDPA, not the bf16 GEMM


def test_a_cpu_plan_attends_prompts_in_the_kv_caches_bf16_where_that_is_priced_faster():
    """latency_cpu.prompt_attention: fp32 activations over a bf16 KV cache (lossy decode copies) attend a prompt in
    bf16 where attn_prefill/cpu/bf16 prices the plan's prompt below attn_prefill/cpu/fp32 (AVX-512 BF16 / AMX),
    and the plan's TTFT prices that attention; where the bf16 key is the slower (AVX2), where the cache is fp32
    (the lossless mode), for latent attention (its own code) or without both keys, the activations' dtype."""
    from dataclasses import replace

    from tiered.planner.cpu_predict import predict_prefill

    small = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 1000, "hidden_size": 256,
                                 "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                                 "num_key_value_heads": 2})
    base = cpu_only_profile()

    def profile(bf16: float | None, fp32: float | None = 2e-11) -> HardwareProfile:
        keys = {"gemm/cpu/fp32": LinearModel(0.0, 1e-11, 1.0), "gemv/cpu/fp32": LinearModel(0.0, 5e-11, 1.0),
                "gemv/cpu/int4": LinearModel(0.0, 5e-11, 1.0), "gemm/cpu/int4": LinearModel(0.0, 1e-11, 1.0),
                "attn/cpu/fp32": LinearModel(0.0, 1e-10, 1.0)}
        for d, beta in (("bf16", bf16), ("fp32", fp32)):
            if beta is not None:
                keys[f"attn_prefill/cpu/{d}"] = LinearModel(1e-5, beta, 1.0)
        return replace(base, models={**base.models, **keys})

    def plan(hw, cfg=small, precision="int4"):
        return make_plan(cfg, hw, prompt_tokens=512, precision=precision, weights_format="fp32", dense_copies=False)

    fast = plan(profile(5e-12))
    assert fast.dtypes["kv_cache"] == "bf16" and fast.dtypes["prompt_attention"] == "bf16"
    assert fast.predicted_ttft_s == pytest.approx(predict_prefill(
        small, profile(5e-12), "int4", 512, None, experts_dtype="fp32", act_dtype="fp32", experts_format="fp32",
        chunk=fast.prefill_chunk, attn_dtype="bf16"))
    assert fast.predicted_ttft_s < predict_prefill(  # fp32's SDPA at 4x bf16's time a multiply-add
        small, profile(5e-12), "int4", 512, None, experts_dtype="fp32", act_dtype="fp32", experts_format="fp32",
        chunk=fast.prefill_chunk)
    assert "prompt_attention bf16" in fast.render()
    assert plan(profile(5e-11)).dtypes["prompt_attention"] == "fp32"  # bf16 the slower (no bf16 compute)
    assert plan(profile(5e-12), precision="fp32").dtypes["prompt_attention"] == "fp32"  # an fp32 cache: lossless
    assert plan(profile(None)).dtypes["prompt_attention"] == "fp32"  # no bf16 key: nothing to compare
    mla = ModelConfig.from_hf({"model_type": "deepseek_v2", "vocab_size": 1000, "hidden_size": 256,
                               "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 4, "kv_lora_rank": 64, "qk_rope_head_dim": 16,
                               "qk_nope_head_dim": 32, "v_head_dim": 32, "q_lora_rank": None,
                               "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                               "first_k_dense_replace": 1})
    assert mla.is_mla and plan(profile(5e-12), cfg=mla).dtypes["prompt_attention"] == "fp32"


def test_prompt_gemms_on_big_weights_are_priced_by_gemm_big():
    """The GEMM fit is timed on 2-4 MiB weights; a call over BIG_GEMM_BYTES or more of weights is
    priced by gemm_big's line (timed on 32-112 MiB FFN matrices), slower or faster than the fit (the
    H200's host: 3x slower; the H100's: 28x faster, where the fit's R^2 was 0.25), in op_time, in
    ScheInfer's cost parameters and in Fiddler's expert model; smaller calls and profiles without the
    key keep the fit."""
    from dataclasses import replace

    from tiered.hardware import op_time
    from tiered.planner.cost_model import LayerShape, cost_params

    hw = get_preset("scheinfer-b")
    fit = op_time.find(hw, "gemm", "cpu", "bf16")
    macs, big, small = 512 * 4096 * 14336, 4096 * 14336 * 2, 1024 * 1024 * 2
    prompt = LayerShape(512, 4096, 14336, 3, 2.0)
    for scale in (3.0, 1 / 28):
        line = LinearModel(2e-4, scale * fit.beta, 1.0)
        big_hw = replace(hw, models={**hw.models, "gemm_big/cpu/bf16": line})
        assert op_time.gemm_time(big_hw, "cpu", "bf16", macs, big) == pytest.approx(
            max(line.alpha + line.beta * macs, op_time.memory_time(hw, "cpu", "bf16", big, "gemv")))
        assert op_time.gemm_time(big_hw, "cpu", "bf16", macs, small) == op_time.gemm_time(hw, "cpu", "bf16", macs, small)
        # four calls over the same bytes: 4 MiB each, the fit's size
        assert op_time.gemm_time(big_hw, "cpu", "bf16", macs, small * 4, calls=4) == \
            op_time.gemm_time(hw, "cpu", "bf16", macs, small * 4, calls=4)
        # the memory floor alone: a free big GEMM
        floor = cost_params(replace(hw, models={**hw.models, "gemm_big/cpu/bf16": LinearModel(0.0, 0.0, 1.0)}),
                            "bf16", prompt).beta_cpu
        assert cost_params(big_hw, "bf16", prompt).beta_cpu == pytest.approx(max(line.beta, floor))
        small_shape = LayerShape(512, 512, 1024, 3, 2.0)
        assert cost_params(big_hw, "bf16", small_shape) == cost_params(hw, "bf16", small_shape)
    assert op_time.gemm_time(hw, "cpu", "bf16", macs, big) == pytest.approx(
        max(fit.alpha + fit.beta * macs, op_time.memory_time(hw, "cpu", "bf16", big, "gemv")))


def test_step_overhead_follows_how_the_step_is_graphed():
    """Each way the engine runs a GPU decode step has its own profiled tiny-model step; a profile
    without a key falls back to the next (whole graph -> piecewise -> eager)."""
    from dataclasses import replace

    from tiered.hardware import op_time

    hw = get_preset("scheinfer-b")
    keys = {"runtime/decode_step_gpu/bf16": LinearModel(3e-4, 4e-4, 1.0),
            "runtime/decode_step_graphed_gpu/bf16": LinearModel(2e-4, 1e-4, 1.0),
            "runtime/decode_step_graph_gpu/bf16": LinearModel(1e-4, 2e-5, 1.0)}
    full = replace(hw, models={**hw.models, **keys})
    assert op_time.step_overhead(full, "bf16", "gpu") == (3e-4, 4e-4)
    assert op_time.step_overhead(full, "bf16", "gpu", graphed="piecewise") == (2e-4, 1e-4)
    assert op_time.step_overhead(full, "bf16", "gpu", graphed="whole") == (1e-4, 2e-5)
    no_whole = replace(hw, models={**hw.models, **{k: v for k, v in keys.items() if "graph_gpu" not in k}})
    assert op_time.step_overhead(no_whole, "bf16", "gpu", graphed="whole") == (2e-4, 1e-4)



def test_graphed_gemvs_are_priced_by_their_graph_key_where_profiled():
    """gemv_graph/gpu/<dtype> (op_time.graph_gemv): a whole-step graph's GEMVs (attention, FFN, head) and a
    piecewise graph's attention projections at the rate the profile timed GEMVs replayed in a captured
    graph. A profile without it (every reference profile so far) prices them as before, and an eager
    step never takes it."""
    from dataclasses import replace
    from pathlib import Path

    from tiered.hardware import op_time
    from tiered.planner.common import attention_time

    root = Path(__file__).resolve().parents[1] / "benchmarks" / "reference" / "h100-2026-11-26"
    hw = HardwareProfile.load(root / "profile_quick.json")
    graph = LinearModel(4e-6, 3.3e-13, 1.0)  # a few us a kernel, the GEMV's bytes at ~3 TB/s
    keyed = replace(hw, models={**hw.models, "gemv_graph/gpu/bf16": graph})
    n = 4096 * 14336
    assert op_time.gemm_time(keyed, "gpu", "bf16", n, 2 * n, graphed=True) == pytest.approx(4e-6 + 3.3e-13 * 2 * n)
    assert op_time.gemm_time(keyed, "gpu", "bf16", 512 * n, 2 * n, graphed=True) == \
        op_time.gemm_time(hw, "gpu", "bf16", 512 * n, 2 * n)  # a prompt's GEMM is not a GEMV
    assert op_time.gemm_time(hw, "gpu", "bf16", n, 2 * n, graphed=True) == op_time.gemm_time(hw, "gpu", "bf16", n, 2 * n)
    dense = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
                                 "intermediate_size": 14336, "num_hidden_layers": 8, "num_attention_heads": 32,
                                 "num_key_value_heads": 8, "max_position_embeddings": 4096})
    assert attention_time(dense, keyed, "gpu", "bf16", 1, 64, graphed=True) < attention_time(dense, keyed, "gpu", "bf16", 1, 64)
    kw = dict(prompt_tokens=32, gen_tokens=32, context_tokens=1024, library_workspace=0)
    for graphs in (True, False):
        before, after = (make_plan(dense, h, graphs=graphs, **kw) for h in (hw, keyed))
        assert after.predicted_ttft_s == before.predicted_ttft_s  # prompts run eager
        if graphs:  # the whole step as one graph: 2.42 ms a step measured on the H100, 3.4 priced without the key
            assert 1 / after.predicted_decode_tokens_per_s < 1 / before.predicted_decode_tokens_per_s - 0.5e-3
        else:
            assert after.predicted_decode_tokens_per_s == before.predicted_decode_tokens_per_s

def test_a_routing_profile_prices_the_prompt_on_the_experts_it_routes_to():
    """planner/latency_moe.prompt_experts: a prompt's tokens pick experts as the profile's did. A profile
    that routes a layer to two experts makes a 512-token prompt touch two, and those resident ones cost no
    copy: the prefill is priced well under the uniform draw's, where it touches all eight and most miss
    (H100, 2026-11-26: 0.051 s measured, 0.103 priced uniformly, 0.045 now)."""
    from dataclasses import replace

    import numpy as np

    from tiered.planner.latency_moe import prompt_experts

    assert prompt_experts([1] * 8, set(), 512, 2) == (8, 0.0)
    active, h = prompt_experts([50, 50, 0, 0, 0, 0, 0, 0], {0, 1}, 512, 2)
    assert active == 2 and h == pytest.approx(1.0)
    active, h = prompt_experts([6, 1, 1, 1, 1, 1, 1, 1], {0}, 1, 2)
    assert active == 2 and h == pytest.approx(0.92 / 2, rel=0.01)  # one token: the popular one, 92% sure, of two

    from pathlib import Path

    # the H100's quick profile (its GEMM fits: the presets price a many-token expert as GEMVs)
    hw = HardwareProfile.load(Path(__file__).resolve().parents[1] / "benchmarks" / "reference" / "h100-2026-11-26"
                              / "profile_quick.json")
    small = replace(MIXTRAL, num_hidden_layers=4)
    skew = np.zeros((4, 8))
    skew[:, :2] = 100.0
    uniform = make_plan(small, hw, gpu_memory=4 * GiB, precision="bf16")
    profiled = make_plan(small, hw, gpu_memory=4 * GiB, precision="bf16", popularity=skew)
    assert not profiled.all_experts_resident() and profiled.layers[0].experts_gpu >= 2
    assert profiled.predicted_ttft_s < 0.7 * uniform.predicted_ttft_s


def test_a_gpu_plan_keeps_room_for_the_profile_gpus_cublas_workspaces():
    """memory/sizes.library_workspace_bytes: a plan made on a CUDA machine's profile (`tiered plan`) keeps
    three cuBLAS workspaces of that GPU's size beside one step's activations, as the engine does with its
    accelerator's; 0 where the profile names no CUDA device (presets) or when told (the references measured
    before the engine kept them)."""
    from pathlib import Path

    from tiered.memory import sizes

    hw = HardwareProfile.load(Path(__file__).resolve().parents[1] / "benchmarks" / "reference" / "h100-2026-11-26"
                              / "profile_quick.json")
    assert hw.meta["gpu_capability"] == "9.0"
    small = LLAMA70B.__class__.from_hf({**{"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
                                          "intermediate_size": 14336, "num_hidden_layers": 8,
                                          "num_attention_heads": 32, "num_key_value_heads": 8}})
    act = sizes.workspace_bytes(small, "bf16")
    assert sizes.library_workspace_bytes("9.0") == sizes.library_workspace_bytes(9) == 3 * 32 * 2**20
    assert make_plan(small, hw, gpu_memory=2 * GiB).workspace_bytes == act + 3 * 32 * 2**20
    assert make_plan(small, hw, gpu_memory=2 * GiB, library_workspace=0).workspace_bytes == act
    assert make_plan(small, get_preset("scheinfer-b"), gpu_memory=2 * GiB).workspace_bytes == act


def test_a_plan_prices_prompts_within_its_mixed_rows_as_rows_and_extends_them_where_rows_are_cheaper():
    """A CPU plan of a dense model records make_plan's mixed_rows (planner/auto.planned_mixed_rows: the ISA's
    measured floor), extends it past that floor to the longest of PRICED_MIXED_ROWS (within the prefill chunk)
    up to which a prompt is priced no slower as rows of the native step (cpu_predict.predict_prompt_rows, its
    attention at attn_rows/cpu/<kv>) than through the modules' prefill (predict_prefill), and prices a prompt within
    its rows as those rows. A profile without the rows' attention key keeps the floor. An MoE plan's rows run its
    FFNs as its prefill does (predict_prefill's ffn_only)."""
    from pathlib import Path

    from tiered.checkpoint.model_config import ModelConfig
    from tiered.hardware.profile import HardwareProfile, LinearModel
    from tiered.planner.cpu_predict import predict_prefill, predict_prompt_rows
    from tiered.planner.latency_cpu import PRICED_MIXED_ROWS

    cfg = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      max_position_embeddings=8192)
    base = HardwareProfile.load(Path(__file__).parents[1] / "benchmarks/results/zen5-2026-12-01/"
                                "hardware_profile_this_machine.json")
    assert base.meta.get("native_kernels") and "attn_rows/cpu/bf16" not in base.models

    def plan(rate: float | None, prompt: int = 512, rows: int = 256, model=cfg):
        hw = HardwareProfile(base.name, base.source, dict(base.models), base.gpu_memory, base.cpu_memory,
                             meta=base.meta)
        if rate is not None:
            hw.models["attn_rows/cpu/bf16"] = LinearModel(0.0, rate, 1.0)
        return hw, make_plan(model, hw, prompt_tokens=prompt, precision="int4", weights_format="fp32",
                             dense_copies=False, batch_act="q8", head_precision="int8", context_tokens=8192,
                             mixed_rows=rows)

    from tiered.planner.latency_cpu import priced_mixed_rows

    # each length past the floor in turn, up to the first priced slower as rows; none past the prefill chunk
    assert priced_mixed_rows(96, 0, lambda T: T, lambda T: 150) == 128
    assert priced_mixed_rows(96, 0, lambda T: T, lambda T: 100) == 96
    assert priced_mixed_rows(96, 256, lambda T: T, lambda T: 1e9) == 256
    hw, fast = plan(1e-11)  # the native attention at ~100 GMAC/s (2 Zen 5 cores' 9-10 ps a multiply-add)
    assert fast.mixed_rows == max(PRICED_MIXED_ROWS) == fast.prefill_chunk
    assert fast.predicted_ttft_s == pytest.approx(predict_prompt_rows(cfg, hw, "int4", 512, None, "bf16", "int8", "q8"))
    hw, slow = plan(1e-9)  # rows' attention 100x slower: their quadratic term loses past the floor
    assert slow.mixed_rows == 256
    assert slow.predicted_ttft_s == pytest.approx(predict_prefill(
        cfg, hw, "int4", 512, None, 0.0, experts_dtype="fp32", act_dtype="fp32", experts_format="fp32",
        batch_act="q8", chunk=slow.prefill_chunk))
    hw, within = plan(1e-9, prompt=128)  # within the floor: rows, however their attention is priced
    assert within.predicted_ttft_s == pytest.approx(predict_prompt_rows(cfg, hw, "int4", 128, None, "bf16", "int8",
                                                                        "q8"))
    assert plan(None)[1].mixed_rows == 256  # no attn_rows key: no comparison, the floor
    # a chunk after `past` cached positions: each of its rows attends to them too (causally within the chunk)
    extra = predict_prompt_rows(cfg, hw, "int4", 128, None, "bf16", "int8", "q8", past=1000) - \
        predict_prompt_rows(cfg, hw, "int4", 128, None, "bf16", "int8", "q8")
    assert extra == pytest.approx(30 * 1e-9 * 128 * 1000 * cfg.attention_macs_per_pair(False))
    # the rows' layer code (runtime/step_rows/int4) over rows x (hidden + intermediate), each layer
    hw.models["runtime/step_rows/int4"] = LinearModel(0.0, 5e-10, 1.0)
    assert predict_prompt_rows(cfg, hw, "int4", 128, None, "bf16", "int8", "q8") == pytest.approx(
        within.predicted_ttft_s + 30 * 5e-10 * 128 * (576 + 1536))
    assert plan(1e-11, rows=0)[1].mixed_rows == 0  # no native step to join
    moe = ModelConfig(model_type="qwen2_moe", vocab_size=1000, hidden_size=256, intermediate_size=1024,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
    # an MoE plan prices its rows too: the attention side as a dense model's, its FFNs as the prefill computes them
    # (the same expert groups), so the rows' attention decides as above
    assert plan(1e-11, model=moe)[1].mixed_rows == max(PRICED_MIXED_ROWS)
    hw, moe_slow = plan(1e-9, model=moe)
    assert moe_slow.mixed_rows == 256
    ffn = predict_prefill(moe, hw, "int4", 128, None, ffn_only=True)
    assert 0 < ffn < predict_prefill(moe, hw, "int4", 128, None)
    assert predict_prompt_rows(moe, hw, "int4", 128, ffn=lambda T: 2 * ffn) == pytest.approx(
        predict_prompt_rows(moe, hw, "int4", 128, ffn=lambda T: ffn) + ffn)
    with pytest.raises(ValueError, match="ffn"):
        predict_prompt_rows(moe, hw, "int4", 128)


def test_mixed_rows_follow_the_isa_and_whether_prompt_rows_dequantize():
    """planner/auto.mixed_rows: a prompt joins the native step's rows up to MIXED_ROWS by ISA and activations,
    and on AVX-512 up to MIXED_ROWS_UNDEQUANTIZED where the kernel tuning found int8 prompt rows never dequantize
    (quant/int4.dequantize_rows("q8") None: 2 Zen 5 cores ran SmolLM2's rows at 0.66-0.75x the modules'
    prefill to 1024 tokens); no kernels, no rows."""
    from tiered.planner.auto import MIXED_ROWS, MIXED_ROWS_UNDEQUANTIZED, mixed_rows

    assert mixed_rows("avx512", "q8", 96) == MIXED_ROWS["avx512"]["q8"] < mixed_rows("avx512", "q8", None) == \
        MIXED_ROWS_UNDEQUANTIZED
    assert mixed_rows("avx512", "bf16", None) == MIXED_ROWS["avx512"]["bf16"]  # bf16 rows: the table
    assert mixed_rows("avx2", "q8", None) == MIXED_ROWS["avx2"]["q8"]  # AVX2's own measurement
    assert mixed_rows(None, "q8", None) == 0


def test_16_bit_weights_join_the_native_steps_rows_for_few_tokens_where_the_cpu_has_a_bf16_gemm(monkeypatch):
    """planner/auto.planned_mixed_rows: where the step's projections are bf16 / fp16 and the CPU has a bf16 GEMM
    (oneDNN on AVX-512 BF16 / AMX), prompts join the native step as rows up to MIXED_ROWS_BF16_GEMM tokens (its
    bf16 row kernel ~10x the GEMM's time a multiply-add there: SmolLM2's 96-token bf16 prompt 128 ms as rows, 50
    through the modules); int4 / int8 / fp32 steps, and CPUs without a bf16 GEMM, keep the ISA's rows; no kernels
    or an accelerator, none."""
    from tiered.hardware import cpu_gemm
    from tiered.planner import auto

    monkeypatch.setattr(auto.kernels, "available", lambda: True)
    monkeypatch.setattr(auto.kernels, "isa", lambda: "avx512")
    monkeypatch.setattr(auto, "dequantize_rows", lambda act: 96)
    isa_rows = auto.mixed_rows("avx512", "q8", 96)
    assert isa_rows > auto.MIXED_ROWS_BF16_GEMM
    for native, expected in ((True, auto.MIXED_ROWS_BF16_GEMM), (False, isa_rows)):
        monkeypatch.setattr(cpu_gemm, "bf16_gemm_native", lambda n=native: n)
        assert auto.planned_mixed_rows(MIXTRAL, None, "q8", "bf16") == expected
        assert auto.planned_mixed_rows(MIXTRAL, None, "q8", "fp16") == expected
        for fmt in ("int4", "int8", "fp32", None):
            assert auto.planned_mixed_rows(MIXTRAL, None, "q8", fmt) == isa_rows
    assert auto.planned_mixed_rows(MIXTRAL, object(), "q8", "bf16") == 0  # an accelerator: no native step
    monkeypatch.setattr(auto.kernels, "available", lambda: False)
    assert auto.planned_mixed_rows(MIXTRAL, None, "q8", "bf16") == 0


def test_a_prompts_int4_ffn_is_priced_in_the_dtype_it_runs_its_intermediate_in():
    """predict_prefill: a dense FFN of one-copy int4 projections that a prompt dequantizes for bf16 GEMMs (AVX-512,
    past dequantize_rows) where the plan keeps its intermediate in bf16 (ffn_dtype, Plan.dtypes["prompt_ffn"]): its
    tokens x intermediate are priced at runtime/prefill_code/bf16's slope, the rest of the layer's width at the
    activations' (fp32); fewer rows (the kernel's), bf16 activations and a plan keeping fp32 price as before."""
    from pathlib import Path

    from tiered.checkpoint.model_config import ModelConfig
    from tiered.hardware.profile import HardwareProfile, LinearModel
    from tiered.planner.cpu_predict import kernel_isa, predict_prefill
    from dataclasses import replace

    from tiered.quant.int4 import dequantize_rows

    hw = HardwareProfile.load(Path(__file__).parents[1] / "benchmarks/results/sapphire-rapids-2026-12-02/at-c994c2e/"
                              "hardware_profile_this_machine.json")
    assert kernel_isa(hw) == "avx512"
    rows = dequantize_rows("q8", "avx512", tuning=hw.meta.get("kernel_tuning") or {})
    assert rows is not None and rows < 512
    cfg = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      max_position_embeddings=8192)

    def priced(profile, T, act="fp32", ffn="bf16"):
        return predict_prefill(cfg, profile, "int4", T, act_dtype=act, batch_act="q8", ffn_dtype=ffn)

    def slower(key):
        m = hw.models[key]
        return replace(hw, models=dict(hw.models, **{key: LinearModel(m.alpha, m.beta + 1e-9, m.r2)}))
    assert priced(slower("runtime/prefill_code/bf16"), 512) - priced(hw, 512) == pytest.approx(30 * 512 * 1536e-9)
    assert priced(slower("runtime/prefill_code/fp32"), 512) - priced(hw, 512) == pytest.approx(30 * 512 * 576e-9)
    # a plan keeping the activations' dtype (prompt_ffn fp32, or none given): its whole width at the fp32 rate
    for ffn in ("fp32", None):
        assert priced(slower("runtime/prefill_code/fp32"), 512, ffn=ffn) - priced(hw, 512, ffn=ffn) == \
            pytest.approx(30 * 512 * (576 + 1536) * 1e-9)
        assert priced(slower("runtime/prefill_code/bf16"), 512, ffn=ffn) == priced(hw, 512, ffn=ffn)
    # a profile without the kernels (a replayed plan priced elsewhere): no kernel rows known, the fp32 rate
    bare = replace(hw, meta={})
    assert priced(bare, 512) == priced(bare, 512, ffn="fp32")
    few = max(1, int(rows))  # the kernel's rows: fp32 throughout
    assert priced(slower("runtime/prefill_code/fp32"), few) - priced(hw, few) == pytest.approx(
        30 * few * (576 + 1536) * 1e-9)
    assert priced(slower("runtime/prefill_code/bf16"), 512, "bf16") - priced(hw, 512, "bf16") == pytest.approx(
        30 * 512 * (576 + 1536) * 1e-9)


def test_a_native_moe_layers_gather_and_weighted_sum_are_priced_at_the_native_steps_rate(monkeypatch):
    """predict_prefill's `native_moe` (a CPU plan's MoE layers with every expert in RAM run their experts and
    weighted sum in one native call: moe_runner._all_on_fast, ExpertFormat.layer_call): the k routed copies of
    each token (gathered at the hidden size, then summed) move from torch's code rate (runtime/prefill_code) to
    the native step's row code (runtime/step_rows/int4); the rest of the layer's width stays at torch's. And the
    CPU plan's modules path (latency_cpu.prompt_paths) prices with it exactly where the runtime takes that call:
    native decode, no expert read from disk."""
    from dataclasses import replace
    from pathlib import Path

    from tiered.planner.cpu_predict import predict_prefill
    from tiered.planner.latency_cpu import prompt_paths

    hw = HardwareProfile.load(Path(__file__).parents[1] / "benchmarks/results/sapphire-rapids-2026-12-02/at-c994c2e/"
                              "hardware_profile_this_machine.json")
    assert "runtime/step_rows/int4" in hw.models

    def slower(key):
        m = hw.models[key]
        return replace(hw, models=dict(hw.models, **{key: LinearModel(m.alpha, m.beta + 1e-9, m.r2)}))

    def priced(profile, native):
        return predict_prefill(MIXTRAL, profile, "int4", 512, experts_format="int4", act_dtype="fp32", batch_act="q8",
                               native_moe=native)
    L, d, k = MIXTRAL.num_hidden_layers, MIXTRAL.hidden_size, MIXTRAL.num_experts_per_tok
    step, code = slower("runtime/step_rows/int4"), slower("runtime/prefill_code/fp32")
    assert priced(step, True) - priced(hw, True) == pytest.approx(L * 512 * k * d * 1e-9)
    assert priced(code, True) - priced(hw, True) == pytest.approx(L * 512 * d * 1e-9)
    assert priced(step, False) == priced(hw, False)
    assert priced(code, False) - priced(hw, False) == pytest.approx(L * 512 * (d + k * d) * 1e-9)
    # the plan's hand-off: native_moe where its engine runs the layer call, not with experts on disk
    calls = []
    import tiered.planner.cpu_predict as cp
    real = cp.predict_prefill
    plan = Plan(model="m", goal="latency", profile="p", gpu_memory=None, cpu_memory=None, prompt_tokens=512,
                gen_tokens=8, precision="int4", layers=[], native_decode=True,
                dtypes={"weights": "fp32", "experts": "int4", "kv_cache": "bf16"})
    monkeypatch.setattr(cp, "predict_prefill", lambda *a, **kw: calls.append(kw["native_moe"]) or real(*a, **kw))
    for disk_share, native in ((0.0, True), (0.3, False)):
        calls.clear()
        prompt_paths(plan, MIXTRAL, hw, disk_share=disk_share)[1](512)
        assert calls == [native], disk_share
    plan.native_decode = False
    calls.clear()
    prompt_paths(plan, MIXTRAL, hw)[1](512)
    assert calls == [False]


def test_weights_stay_put_where_one_more_forward_moves_no_weights():
    """Plan.weights_stay_put (LLM.step's shared prefixes take one more forward): a CPU plan without
    disk, a GPU plan with every dense FFN whole and every expert on the GPU; not with experts on disk,
    a sliced FFN, experts off the GPU, or FlexGen's streaming."""
    from tiered.planner.plan import LayerPlan

    def plan(tier, layers, memory, flexgen=None):
        return Plan(model="m", goal="latency", profile="p", gpu_memory=None, cpu_memory=None, prompt_tokens=512,
                    gen_tokens=8, precision="int4", layers=layers, fast_tier=tier, memory=memory, flexgen=flexgen)

    dense = [LayerPlan(0, "dense", "bf16")]
    moe = lambda gpu, cpu, disk: [LayerPlan(0, "moe", "bf16", experts_gpu=gpu, experts_cpu=cpu, experts_disk=disk)]
    assert plan("cpu", dense, {"cpu": 1}).weights_stay_put()
    assert plan("cpu", moe(0, 8, 0), {"cpu": 1, "disk": 0}).weights_stay_put()
    assert not plan("cpu", moe(0, 6, 2), {"cpu": 1, "disk": 2}).weights_stay_put()
    assert plan("gpu", dense, {"gpu": 1}).weights_stay_put()
    assert not plan("gpu", [LayerPlan(0, "dense", "bf16", r_cc=0.3, r_gg=0.7)], {"gpu": 1}).weights_stay_put()
    assert plan("gpu", moe(8, 0, 0), {"gpu": 1}).weights_stay_put()
    assert not plan("gpu", moe(6, 2, 0), {"gpu": 1, "cpu": 2}).weights_stay_put()
    assert not plan("gpu", dense, {"gpu": 1}, flexgen={"policy": 1}).weights_stay_put()


def test_tiled_int8_experts_batched_rows_are_priced_on_int8_activations():
    """Routed int8 / int8-g32 experts (tiled on the host) read int8 activations in calls of 2+ rows where
    Plan.batch_act is "q8" (ExpertSpec's int8_q8_from, since 2026-12-05): a batched step's and a prompt's expert
    rows are priced at decode_rows/cpu/int8-g32q8's slope (op_time.gemv_dtype; per-row int8's "int8q8" falls back to
    it for rows and to gemv/cpu/int8 for its stream), one row as before; "bf16" keeps the int16 slopes."""
    from tiered.hardware import op_time
    from tiered.planner.cpu_predict import predict_decode, prompt_expert_time

    assert [op_time.gemv_dtype(k, "q8") for k in ("int4", "int8-g32", "int8", "bf16")] == \
        ["int4q8", "int8-g32q8", "int8q8", "bf16"]
    assert op_time.gemv_dtype("int8-g32", "bf16") == "int8-g32"
    m = {"gemv/cpu/int8": LinearModel(1e-5, 1e-11, 1.0), "gemv/cpu/int8-g32": LinearModel(1e-5, 1e-11, 1.0),
         "decode_rows/cpu/int8": LinearModel(0.0, 12e-12, 1.0), "decode_rows/cpu/int8-g32q8": LinearModel(0.0, 4e-12, 1.0),
         "attn/cpu/bf16": LinearModel(0.0, 0.0, 1.0)}
    hw = HardwareProfile("cpu-box", "test", m, None, None, meta={"native_kernels": True})
    assert op_time.find(hw, "decode_rows", "cpu", "int8q8") is m["decode_rows/cpu/int8-g32q8"]
    assert op_time.find(hw, "gemv", "cpu", "int8q8") is m["gemv/cpu/int8"]
    for kind in ("int8-g32", "int8"):
        price = {act: predict_decode(MIXTRAL, hw, kind, context=0, batch=16, batch_act=act, experts_format=kind)[1]
                 for act in ("q8", "bf16")}
        assert price["q8"] < price["bf16"], kind
        one = [predict_decode(MIXTRAL, hw, kind, context=0, batch_act=act, experts_format=kind)[1] for act in ("q8", "bf16")]
        assert one[0] == one[1], kind
    rows = {act: prompt_expert_time(hw, "int8-g32", 8, 1e6, 1e6, batch_act=act) for act in ("q8", "bf16")}
    assert rows["bf16"] - rows["q8"] == pytest.approx(7 * 1e6 * (12e-12 - 4e-12))


def test_batched_experts_are_priced_on_the_activations_their_kernels_read():
    """A batched step's expert rows are priced on what the kernels multiply in calls of 2+ rows
    (quant/experts.rows_activations, the tiled kernels' q8_from): int4 experts on int8 activations where either
    Plan.expert_act (from one row) or Plan.batch_act (from two) is "q8" (with --expert-activations bf16 the
    batched rows had been priced on bf16 ones, which only their one-row calls read), tiled int8 where batch_act
    is; mxfp4 always."""
    from tiered.planner.cpu_predict import predict_decode
    from tiered.quant.experts import rows_activations

    assert [rows_activations("int4", a, b) for a, b in (("q8", "bf16"), ("bf16", "q8"), ("bf16", "bf16"))] == \
        ["q8", "q8", "bf16"]
    assert [rows_activations(k, "bf16", "q8") for k in ("int8-g32", "int8", "bf16")] == ["q8", "q8", "bf16"]
    assert rows_activations("int8-g32", "q8", "bf16") == "q8"  # (its one-row calls read int16 whatever act says)
    assert rows_activations("mxfp4", "bf16", "bf16") == rows_activations("int4,int4,mxfp4", "bf16", "bf16") == "q8"
    m = {"gemv/cpu/int4": LinearModel(1e-5, 1e-11, 1.0), "decode_rows/cpu/int4": LinearModel(0.0, 12e-12, 1.0),
         "decode_rows/cpu/int4q8": LinearModel(0.0, 4e-12, 1.0), "attn/cpu/bf16": LinearModel(0.0, 0.0, 1.0)}
    hw = HardwareProfile("cpu-box", "test", m, None, None, meta={"native_kernels": True})
    price = {(a, b): predict_decode(MIXTRAL, hw, "int4", context=0, batch=16, expert_act=a, batch_act=b,
                                    experts_format="int4")[1] for a in ("bf16", "q8") for b in ("bf16", "q8")}
    # at batch_act q8 the batched rows read q8 whatever expert_act says: the same price
    assert price["bf16", "q8"] == price["q8", "q8"]
    assert price["q8", "bf16"] < price["bf16", "bf16"]  # expert_act q8 alone: q8 from one row


def test_one_copy_int4_prompt_gemms_within_amx_rows_are_priced_by_the_amx_key():
    """On AMX a one-copy int4 weight's prompt GEMM of up to quant/int4.AMX_ROWS rows runs tiered's AMX GEMM, past
    them the dequantized oneDNN GEMM: gemm_amx/cpu/int4 prices the former (projections and int4 / mxfp4 experts
    alike), gemm/cpu/int4 the latter, and a profile without the key (no AMX, before profiler 51) prices both by
    gemm/cpu/int4."""
    from tiered.planner.cpu_predict import predict_prefill, prompt_expert_time
    from tiered.quant.int4 import AMX_ROWS

    m = {"gemm/cpu/int4": LinearModel(1e-3, 2e-12, 1.0), "gemv/cpu/int4": LinearModel(0.0, 1 / 30e9, 1.0),
         "decode_rows/cpu/int4": LinearModel(0.0, 1.2e-11, 1.0), "gemm/cpu/fp32": LinearModel(0.0, 7e-12, 1.0),
         "dequantize/cpu/int4": LinearModel(0.0, 1e-10, 1.0)}
    meta = {"native_kernels": True, "int4_dequantize_rows": 96, "kernel_isa": "avx512"}
    hw = HardwareProfile("cpu-box", "test", m, None, None, meta=meta)
    amx = HardwareProfile("cpu-box", "test", {**m, "gemm_amx/cpu/int4": LinearModel(5e-3, 2e-11, 1.0)}, None, None,
                          meta=meta)

    def ttft(profile, tokens):
        return predict_prefill(LLAMA70B, profile, "int4", tokens, act_dtype="fp32")

    assert ttft(amx, AMX_ROWS) > 3 * ttft(hw, AMX_ROWS)  # within AMX_ROWS: the AMX key's (slow) line
    assert ttft(amx, AMX_ROWS + 64) == ttft(hw, AMX_ROWS + 64)  # past them: gemm/cpu/int4 either way
    w = 3 * 4096 * 14336 * 0.5625
    macs = 3 * 4096 * 14336
    for kind in ("int4", "mxfp4"):
        assert prompt_expert_time(amx, kind, 300, w, macs) > 3 * prompt_expert_time(hw, kind, 300, w, macs)
        assert prompt_expert_time(amx, kind, AMX_ROWS + 1, w, macs) == prompt_expert_time(hw, kind, AMX_ROWS + 1, w, macs)


def _group_profile(amx: bool) -> HardwareProfile:
    """A 2-core AMX CPU's profile with the native kernels (the AMX VM's quick profile of 2026-12-06, rounded): int4
    experts' groups on q8 rows and, with `amx`, the AMX GEMM (its line and weight term, profiler 55)."""
    m = {"gemv/cpu/int4q8": LinearModel(6.5e-6, 3.1e-11, 1.0), "decode_rows/cpu/int4q8": LinearModel(1.3e-4, 3.3e-12, 1.0),
         "expert_groups/cpu/int4q8": LinearModel(8.8e-5, 3.0e-12, 1.0), "gemv/cpu/int4": LinearModel(1e-5, 3.3e-11, 1.0),
         "memory/bandwidth/cpu": LinearModel(0.0, 3.25e-11, 1.0), "memory/bandwidth_dram/cpu": LinearModel(0.0, 3.5e-11, 1.0),
         "gemm/cpu/int4": LinearModel(0.0, 1.0e-12, 1.0),
         "dequantize/cpu/int4": LinearModel(0.0, 1e-10, 1.0)}
    if amx:
        m |= {"gemm_amx/cpu/int4": LinearModel(4.9e-5, 1.03e-12, 1.0),
              "gemm_amx_pack/cpu/int4": LinearModel(0.0, 6.2e-11, 1.0),
              "gemm_amx_floor/cpu/int4": LinearModel(0.0, 1.38e-10, None)}
    # the native step's stream by working set (runtime/decode_ws/int4): 1.9x faster over 15-30 MB than from memory,
    # 1.2x at 135 MB, no faster from 525 MB, though sysfs says 480 MB of L3
    ws = [[15e6, 2.25e-11], [31e6, 2.3e-11], [63e6, 2.6e-11], [142e6, 3.68e-11], [550e6, 4.37e-11]]
    meta = {"native_kernels": True, "kernel_isa": "avx512", "kernel_tuning": {"q8_expert_grouped_rows": 32},
            "llc_bytes": 480 * 2**20, "points": {"runtime/decode_ws/int4": ws}}
    return HardwareProfile("cpu-box", "test", m, None, None, meta=meta)


def test_the_native_steps_int4_rows_from_step_amx_rows_are_priced_on_the_amx_gemm_where_timed_so():
    """cpu_predict.step_amx_time: the native step's int4 projections over quant/int4.STEP_AMX_ROWS rows or more run
    the AMX GEMM (run_step), priced by op_time.amx_gemm_time (in AMX_ROWS pieces past it) where the profile's
    runtime/step_rows/int4 was timed net of it (meta["step_rows_amx"], profiler 57); fewer rows, int8 copies, and
    profiles whose step code was timed net of the row kernels keep the row kernels' price."""
    from tiered.hardware import op_time
    from tiered.planner.cpu_predict import _projections, step_amx_time
    from tiered.quant.int4 import AMX_ROWS, STEP_AMX_ROWS

    amx = _group_profile(True)
    old = HardwareProfile("cpu-box", "test", amx.models, None, None, meta=amx.meta)
    new = HardwareProfile("cpu-box", "test", amx.models, None, None, meta={**amx.meta, "step_rows_amx": True})
    el, nb = 3 * 576 * 1536, 3 * 576 * 1536 * op_time.bytes_per_element("int4")
    assert step_amx_time(new, "int4", 128, el, nb, 2) == op_time.amx_gemm_time(new, 128 * el, nb, 2)
    assert step_amx_time(new, "int4", 1024, el, nb, 2) == op_time.amx_gemm_time(new, 1024 * el, 2 * nb, 4)
    for hw, kind, rows in ((new, "int4", STEP_AMX_ROWS - 1), (new, "int8", 128), (old, "int4", 128)):
        assert step_amx_time(hw, kind, rows, el, nb, 2) is None
    assert _projections(new, "int4", None, el, 2, 0.0, 128, "q8") == step_amx_time(new, "int4", 128, el, nb, 2)
    assert _projections(old, "int4", None, el, 2, 0.0, 128, "q8") != _projections(new, "int4", None, el, 2, 0.0, 128, "q8")
    assert AMX_ROWS >= STEP_AMX_ROWS


def test_how_much_of_a_set_the_caches_hold_is_the_native_steps_measure_not_the_llcs_size():
    """op_time.cache_held: 1 where the native step streams a working set as fast as its smallest timed one, 0 where
    as from memory, linear between (runtime/decode_ws/int4); a profile without those points goes by the last-level
    cache's size."""
    from tiered.hardware import op_time

    hw = _group_profile(True)
    assert op_time.cache_held(hw, 6e6) == 1.0 and op_time.cache_held(hw, 600e6) == 0.0
    held = [op_time.cache_held(hw, n) for n in (40e6, 100e6, 231e6, 400e6)]
    assert held == sorted(held, reverse=True) and 0.0 < held[2] < 0.4  # two Mixtral-width experts: mostly memory
    bare = HardwareProfile("cpu-box", "test", hw.models, None, None, meta={**hw.meta, "points": {}})
    assert op_time.cache_held(bare, 231e6) == 1.0 and op_time.cache_held(bare, 600e6) == 0.0  # 480 MB of L3


def test_a_big_int4_experts_prompt_rows_leave_the_kernels_groups_where_the_amx_gemm_is_priced_below_them():
    """Plan.expert_group_rows (cpu_predict.priced_group_rows): a Mixtral-width int4 expert's groups of 8 rows each
    re-stream ~99 MB, so the AMX GEMM (one stream, converted in its tiles) is priced below them well before the
    kernel tuning's 32 rows (measured on a 2048 x 768 expert); the plan caps the expert format's groups there, and
    prompt_expert_time prices those rows on the AMX path. Without the AMX GEMM priced: the tuning's rows, 0 in the
    plan."""
    from tiered.hardware import op_time
    from tiered.memory import sizes
    from tiered.planner.cpu_predict import priced_group_rows, prompt_expert_time
    from tiered.planner.make import expert_group_rows
    from tiered.quant.experts import NATIVE_ROWS, ExpertFormat

    amx, plain = _group_profile(True), _group_profile(False)
    eb, macs = sizes.expert_bytes(MIXTRAL, "int4"), 3 * 4096 * 14336
    rows = priced_group_rows(amx, eb, macs, "q8")
    assert 12 <= rows < 24  # measured: the groups ahead at 16 rows, the AMX GEMM at 20
    assert priced_group_rows(plain, eb, macs, "q8") == 32
    # the boundary: groups priced no dearer than the AMX GEMM up to `rows`, dearer from the next row
    for r, amx_path in ((rows, False), (rows + 1, True), (32, True)):
        t = prompt_expert_time(amx, "int4", r, eb, macs, batch_act="q8")
        assert (t == op_time.amx_gemm_time(amx, r * macs, eb, calls=3)) == amx_path, r
    assert expert_group_rows(MIXTRAL, amx, "int4", "q8") == rows
    assert expert_group_rows(MIXTRAL, plain, "int4", "q8") == 0
    assert expert_group_rows(MIXTRAL, amx, "bf16", "q8") == 0
    # a small expert (2048 x 768: 3 MB, the tuning's) re-reads its groups from the cache: no fewer rows in groups
    small = ModelConfig.from_hf({**MIXTRAL_HF, "hidden_size": 2048, "intermediate_size": 768})
    assert expert_group_rows(small, amx, "int4", "q8") in (0, *range(rows, 32))
    fmt = ExpertFormat("int4", ((14336, 4096), (14336, 4096), (4096, 14336)), "tiled", "q8", "q8")
    capped = ExpertFormat("int4", fmt.shapes, "tiled", "q8", "q8", group_rows_limit=rows)
    assert capped.grouped_rows == min(fmt.grouped_rows, rows)


def test_the_amx_gemm_pays_its_weights_conversion_at_the_pack_rate_not_a_dequantization():
    """Profiler 55 fits gemm_amx/cpu/int4 with its weight term gemm_amx_pack/cpu/int4 (the weight converted into the
    AMX GEMM's tiles, ~0.03 ns a weight on 2 AMX cores): such a profile prices a call as its line plus the weight at
    that rate, never dequantize/cpu/int4's (a dequantization into memory, 0.1-0.4 ns a weight, which priced a
    Mixtral-width expert projection at 128 rows 23 ms for 7-9); a profile of 51-54 (no pack key) still adds it."""
    from tiered.hardware import op_time

    line = LinearModel(2e-5, 1e-12, 1.0)
    m = {"gemm_amx/cpu/int4": line, "dequantize/cpu/int4": LinearModel(0.0, 3e-10, 1.0),
         "gemv/cpu/int4": LinearModel(0.0, 1 / 30e9, 1.0), "memory/bandwidth/cpu": LinearModel(0.0, 1 / 30e9, 1.0)}
    old = HardwareProfile("cpu-box", "test", m, None, None, meta={"native_kernels": True})
    new = HardwareProfile("cpu-box", "test", {**m, "gemm_amx_pack/cpu/int4": LinearModel(0.0, 5e-11, 1.0)}, None,
                          None, meta={"native_kernels": True})
    K, N, rows = 4096, 14336, 128
    w = K * N * op_time.bytes_per_element("int4")
    macs = rows * K * N
    assert op_time.amx_gemm_time(new, macs, w, calls=1) == pytest.approx(2e-5 + 1e-12 * macs + 5e-11 * w)
    assert op_time.amx_gemm_time(old, macs, w, calls=1) == pytest.approx(2e-5 + 1e-12 * macs + 3e-10 * K * N)
    # a call of few rows over a big weight: one stream of it floors the time, at the AMX GEMM's own rate where profiled
    assert op_time.amx_gemm_time(new, 1 * K * N, w) == pytest.approx(max(2e-5 + 1e-12 * K * N + 5e-11 * w, w / 30e9))
    floored = HardwareProfile("cpu-box", "test", {**new.models, "gemm_amx_floor/cpu/int4": LinearModel(0.0, 1.2e-10, None)},
                              None, None, meta={"native_kernels": True})
    assert op_time.amx_gemm_time(floored, 16 * K * N, w) == pytest.approx(1.2e-10 * w)
    assert op_time.amx_gemm_time(floored, macs, w) == op_time.amx_gemm_time(new, macs, w)  # 128 rows: the line
