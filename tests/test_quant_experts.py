"""Quantized experts (quant/experts.py, quant/gguf_experts.py): kernels against their dequantized
reference, GGUF MoE files in each block type against the transformers model with the same
dequantized weights, and the bytes an int4 expert saves on every tier."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

sys.path.insert(0, str(Path(__file__).parent))

from gguf_writer import dequantized_moe_model, quantize_q4_k, quantize_q6_k, write_moe_gguf  # noqa: E402
from moe_fixtures import build_hf_moe_model  # noqa: E402

from tiered import LLM, EngineConfig, SamplingParams  # noqa: E402
from tiered.errors import ConfigError  # noqa: E402
from tiered.memory import sizes  # noqa: E402
from tiered.quant.experts import ExpertFormat, fit_format, pricing_precision  # noqa: E402
from tiered.quant.gguf_experts import unpack_q4k_blocks, unpack_q8_blocks  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPT = torch.randint(2, 256, (16,), generator=torch.Generator().manual_seed(0)).tolist()


def _weights(F=48, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [0.1 * torch.randn(F, D, generator=g), 0.1 * torch.randn(F, D, generator=g), 0.1 * torch.randn(D, F, generator=g)]


@pytest.mark.parametrize("name", ["bf16", "int8", "int8-g32", "int4", "int4,int4,int8"])
@pytest.mark.parametrize("layout", ["cpu", "plain"])
def test_expert_kernels_match_their_dequantized_weights(name, layout):
    """Each format's kernel path gives the SwiGLU of its own dequantized weights (bf16 activations
    bound the difference), and those weights are near the originals."""
    ws = _weights(F=64)
    fmt = ExpertFormat(name, [w.shape for w in ws], layout)
    slot = fmt.empty()
    fmt.quantize(ws, slot)
    assert [tuple(t.shape) for t in slot] == [tuple(s) for s in fmt.slot_shapes]
    assert sum(t.numel() * t.element_size() for t in slot) == fmt.nbytes
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    deq = fmt.dequantize(slot)
    ref = ExpertFormat("fp32", fmt.shapes).forward(x, deq)
    y = fmt.forward(x, slot)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert (y - ref).abs().max() <= 0.02 * ref.abs().max()
    tol = {"bf16": 0.01, "int8": 0.01, "int8-g32": 0.01}.get(name, 0.1)
    for w, d in zip(ws, deq):
        assert (w - d).abs().max() <= tol * w.abs().max()


@pytest.mark.parametrize("name", ["int4", "int4,int4,int8"])
@pytest.mark.parametrize("rows", [40, 600])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_dequantized_expert_takes_the_native_swiglu_in_bf16(name, rows, dtype):
    """Past the kernels' rows a tiled int4 expert's gate and up run in bf16 (the AMX GEMM within AMX_ROWS, one bf16
    GEMM past them) and meet in the native SwiGLU (one rounding), where quant/int4.dequantize_dtype() is bf16:
    the SwiGLU of the dequantized weights within bf16's rounding, in x's dtype; a down projection of another kind
    (a Q4_K_M file's Q6_K as int8) takes the activations in x's dtype."""
    from tiered.kernels import load
    from tiered.quant.int4 import dequantize_dtype

    if load() is None:
        pytest.skip("the native kernels are not built")
    ws = _weights(F=96)
    fmt = ExpertFormat(name, [w.shape for w in ws], "tiled", batch_act="q8", act="q8")
    slot = fmt.empty()
    fmt.quantize(ws, slot)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    assert fmt._bf16_glu(x) == (dequantize_dtype() == torch.bfloat16)
    assert not fmt._bf16_glu(x[:8])  # the kernels' rows
    ref = ExpertFormat("fp32", fmt.shapes).forward(x.float(), fmt.dequantize(slot))
    y = fmt.dequantized(x, slot)
    assert y.dtype == dtype and y.shape == x.shape
    assert (y.float() - ref).abs().max() <= 0.03 * ref.abs().max()


@pytest.mark.parametrize("name", ["int4", "int4,int4,int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_experts_rows_past_its_groups_take_the_amx_gemm_in_one_native_call(name, dtype):
    """On a CPU with AMX a tiled int4 expert's rows past `group_rows` (its `amx_rows`) run in one native call
    (ExpertSpec.forward_amx: gate and up over the rows in bf16, SwiGLU in fp32, down; a Q6_K-like int8 down by its
    own kernel): `forward` gives it in x's dtype, the SwiGLU of the dequantized weights within bf16's rounding, and
    `layer_call` with the format's amx_rows computes the same rows to the bit; past AMX_ROWS, and within
    `without_amx` (amx_rows 0), `forward` is `dequantized`'s torch ops."""
    from tiered.kernels import load
    from tiered.quant.int4 import AMX_ROWS, amx_kernels, without_amx

    if load() is None or amx_kernels() is None:
        pytest.skip("no AMX GEMM here")
    ws = _weights(F=96)
    fmt = ExpertFormat(name, [w.shape for w in ws], "tiled", batch_act="q8", act="q8")
    slot = fmt.empty()
    fmt.quantize(ws, slot)
    assert fmt.amx_rows == fmt.group_rows > 0
    rows = fmt.group_rows + 9
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    ref = ExpertFormat("fp32", fmt.shapes).forward(x.float(), fmt.dequantize(slot))
    y = fmt.forward(x, slot)
    assert y.dtype == dtype and torch.equal(y, fmt.native.forward_amx(slot[0], x).to(dtype))
    assert (y.float() - ref).abs().max() <= 0.03 * ref.abs().max()
    idx, wt = torch.zeros(rows, 1, dtype=torch.long), torch.ones(rows, 1, dtype=dtype)  # every row to expert 0
    call = fmt.layer_call(x, [slot])
    assert torch.equal(call(idx, wt, [0], (), fmt.amx_rows), y)
    assert not torch.equal(call(idx, wt, [0]), y)  # without amx_rows: the kernels' groups
    past = torch.randn(AMX_ROWS + 8, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    assert torch.equal(fmt.forward(past, slot), fmt.dequantized(past, slot))
    with without_amx():
        assert fmt.amx_rows == 0 and torch.equal(fmt.forward(x, slot), fmt.dequantized(x, slot))
    was = load().amx_rows(False)  # the kernels' own switch (TIERED_AMX=0): no AMX path in the native call
    try:
        assert fmt.native.forward_amx(slot[0], x) is None
        assert torch.equal(call(idx, wt, [0], (), fmt.group_rows), call(idx, wt, [0]))
    finally:
        load().amx_rows(was)


@pytest.mark.parametrize("name", ["bf16", "int8", "int4", "int4,int4,int8"])
@pytest.mark.parametrize("layout", ["plain", "tiled"])
@pytest.mark.parametrize("act", ["bf16", "q8"])
def test_expert_group_gives_each_experts_own_outputs(name, layout, act):
    """forward_group (a layer's experts in one native call) returns exactly what forward returns
    for each expert on its rows, experts with no rows included; more than the format's native_rows
    for an expert -> groups of NATIVE_ROWS rows, more than its grouped_rows -> None (the caller
    runs experts one at a time); malformed bounds -> a clear error. act: int4's activations at one
    row and from two (the plan gives MoE models q8 for both)."""
    from tiered.kernels import load
    from tiered.quant.experts import NATIVE_ROWS

    if load() is None:
        pytest.skip("the native kernels are not built")
    if act == "q8" and "int4" not in name:
        pytest.skip("activations only change int4 kernels")
    fmt = ExpertFormat(name, [w.shape for w in _weights(F=64)], layout, batch_act=act, act=act)
    slots = []
    for seed in range(4):
        ws = _weights(F=64, seed=seed)
        if fmt.is_dense:
            slots.append(tuple(w.bfloat16().contiguous() for w in ws))
        else:
            slots.append(fmt.empty())
            fmt.quantize(ws, slots[-1])
    r = fmt.native_rows  # NATIVE_ROWS; bf16: no more than this machine's kernel tuning gives it
    assert 1 <= r <= NATIVE_ROWS
    bounds = [0, 1, 1, 1 + r, 1 + r + min(2, r)]
    xs = torch.randn(bounds[-1], 64, generator=torch.Generator().manual_seed(1))
    ys = fmt.forward_group(xs, slots, bounds)
    assert ys.dtype == xs.dtype and ys.shape == xs.shape
    for slot, a, b in zip(slots, bounds, bounds[1:]):
        if b > a:
            assert torch.equal(ys[a:b], fmt.forward(xs[a:b], slot))
    if fmt.grouped_rows > NATIVE_ROWS:
        n = NATIVE_ROWS + 3  # a prompt's expert: groups of NATIVE_ROWS rows, each as one call of its rows
        x = torch.randn(n, 64, generator=torch.Generator().manual_seed(2))
        big = fmt.forward_group(x, slots[:1], [0, n])
        assert torch.equal(big, fmt.forward(x, slots[0]))
        assert torch.equal(big[:NATIVE_ROWS], fmt.forward(x[:NATIVE_ROWS], slots[0]))
        assert torch.equal(big[NATIVE_ROWS:], fmt.forward(x[NATIVE_ROWS:], slots[0]))
    if fmt.grouped_rows < 1024:  # more: dequantized for one matmul (bf16: torch's GEMMs), expert by expert
        m = max(r, fmt.grouped_rows) + 1
        assert fmt.forward_group(torch.randn(m, 64), slots[:1], [0, m]) is None
    with pytest.raises(RuntimeError, match="bounds"):
        fmt.forward_group(xs, slots, bounds[:-1])
    with pytest.raises(RuntimeError, match="xs must be"):
        fmt.forward_group(xs[:-1], slots, bounds)


@pytest.mark.parametrize("name", ["q6k", "q5k", "iq4xs", "int4,int4,q6k", "q5k,q5k,q6k"])
def test_k_quant_experts_compute_their_blocks_as_stored(name):
    """The k-quant kinds (a GGUF file's Q6_K / Q5_K / IQ4_XS experts as stored, quant/kquant's layouts): a slot
    written from a file's blocks holds them bit for bit (dequantized: gguf's values); the native calls (one expert, a
    layer's experts in one call, rows past NATIVE_ROWS in groups) give the SwiGLU of those weights, each expert's
    rows its own outputs; rows from two read int8 activations where batch_act is "q8"; the portable layout (a CUDA
    device's) refuses them and shapes they cannot tile take int8-g32."""
    from tiered.kernels import load
    from tiered.quant.experts import NATIVE_ROWS, dequantize_projection, kquant_segments, quantize_projection
    from tiered.quant.gguf_encode import quantize_iq4_xs, quantize_q5_k, quantize_q6_k

    if load() is None:
        pytest.skip("the native kernels are not built")
    enc = {"q6k": (quantize_q6_k, Q.Q6_K), "q5k": (quantize_q5_k, Q.Q5_K), "iq4xs": (quantize_iq4_xs, Q.IQ4_XS)}
    F, D = 512, 256
    shapes = [(F, D), (F, D), (D, F)]
    fmts = {act: ExpertFormat(name, shapes, "tiled", batch_act=act, act=act) for act in ("bf16", "q8")}
    fmt = fmts["bf16"]
    assert fmt.native is not None and fmt.nbytes == sizes.expert_bytes(
        type("C", (), dict(hidden_size=D, moe_intermediate_size=F))(), name)
    slots, stored = [], []
    for seed in range(3):
        ws, slot, blocks = _weights(F=F, D=D, seed=seed), fmt.empty(), {}
        parts = []
        for i, (w, kind) in enumerate(zip(ws, fmt.kinds)):
            if kind in enc:
                blocks[i] = enc[kind][0](w.numpy())
                parts.append(kquant_segments(kind, [torch.from_numpy(blocks[i])]))
            else:
                parts.append(quantize_projection(w, kind, "tiled"))
        fmt.encode(parts, slot)
        for i, raw in blocks.items():  # the file's weights, bit for bit
            v = fmt.views(slot)[i]
            want = dequantize(raw, enc[fmt.kinds[i]][1]).reshape(fmt.shapes[i])
            assert np.array_equal(dequantize_projection(v, fmt.kinds[i], *fmt.shapes[i], "tiled").numpy(), want)
        slots.append(slot)
        stored.append(fmt.dequantize(slot))
    x = torch.randn(NATIVE_ROWS + 3, D, generator=torch.Generator().manual_seed(1))
    ref = [ExpertFormat("fp32", shapes).forward(x, deq) for deq in stored]
    for act, f in fmts.items():
        tol = 0.003 if act == "bf16" and "int4" not in name else 0.03  # int16 rows; int8 ones (and int4's q8)
        one = f.forward(x[:1], slots[0])
        assert (one - ref[0][:1]).abs().max() <= (0.03 if "int4" in name and act == "q8" else 0.003) * ref[0].abs().max()
        for rows in (3, NATIVE_ROWS + 3):  # one call; groups of NATIVE_ROWS
            y = f.forward(x[:rows], slots[0])
            assert (y - ref[0][:rows]).abs().max() <= tol * ref[0].abs().max(), (act, rows)
        bounds = [0, 1, 4, NATIVE_ROWS + 3]
        ys = f.forward_group(x, slots, bounds)
        for slot, a, b in zip(slots, bounds, bounds[1:]):
            if b > a:
                assert torch.equal(ys[a:b], f.forward(x[a:b], slot))
    with pytest.raises(ConfigError, match="host layout"):
        ExpertFormat(name, shapes, "plain")
    assert fit_format("q6k", [(F, 96), (F, 96), (96, F)]) == "int8-g32,int8-g32,q6k"  # (down: [96, 512] tiles)


def test_a_mixed_k_quant_file_re_quantizes_the_other_layers_into_its_kinds(tmp_path):
    """Experts take one format, chosen from the first MoE layer's tensors: a file whose ffn_down is Q6_K there and
    Q4_K in the next (llama.cpp's Q4_K_M) keeps int4,int4,q6k, fits the Q4_K layer's down projection to Q6_K blocks
    (quant/gguf_encode.py) near its weights, and says so in the plan's note; the CPU engine's tokens follow the
    file's dequantized weights. With an accelerator (the host stand-in) the experts keep int8-g32 copies: no
    device reads the k-quant kinds."""
    from tiered.kernels import available

    if not available():
        pytest.skip("the native kernels are not built")
    model = build_hf_moe_model("qwen3_moe", hidden_size=256, moe_intermediate_size=256, num_hidden_layers=4)
    types = {"blk.1.ffn_down_exps.weight": Q.Q6_K}  # MoE layers 1 and 3 (decoder_sparse_step 2)
    path = write_moe_gguf(model, tmp_path / "mix.gguf", Q.Q4_K, types=types)
    llm = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", accelerator="none", **EXACT_ACT))
    assert llm.plan.dtypes["experts"] == "int4,int4,q6k"
    assert any("re-quantized on load: Q4_K -> q6k" in n for n in llm.plan.notes)
    from tiered.memory.expert_store import expert_tensor_names
    from tiered.quant.gguf_experts import encode_expert

    fmt, slot = llm.experts.fmt, llm.experts.fmt.empty()
    hs = [llm.checkpoint.handle(n) for n in expert_tensor_names(llm.config.model_type, 3, 0)]
    assert hs[2].format == "Q4_K"
    encode_expert(fmt, hs, slot)
    w, got = hs[2].load(torch.float32), fmt.dequantize(slot)[2]
    assert (got - w).abs().max() <= w.abs().max() / 40  # 6 bits a weight, a scale per 16
    out = llm.generate(PROMPT, GREEDY)[0].token_ids
    llm.close()
    host = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", accelerator="host", **EXACT_ACT))
    assert host.plan.dtypes["experts"] == "int4,int4,int8-g32"
    assert host.generate(PROMPT, GREEDY)[0].token_ids[:4] == out[:4]
    host.close()


@pytest.mark.parametrize("name", ["mxfp4", "int4", "int8", "bf16"])
def test_biased_experts_run_their_clamped_glu_inside_the_native_calls(name, monkeypatch):
    """gpt-oss's experts (swiglu_limit: a bias column on each projection's input, the clamped GLU between
    them) run the native kernels with both inside: forward_group and forward up to the format's biased_rows
    (mxfp4: the ISA's one-call kernel rows; tiled int4: 8; int8: any; bf16: its native rows) agree with
    torch's projection-by-projection path (_biased_glu, models/gpt_oss.clamped_glu) to float rounding
    (bf16: the activations rounded to bf16 in the kernel), the clamps acting; layer_call equals forward per
    expert and index_add_ bit for bit; past biased_rows forward_group declines and forward is torch's path.
    A biased format's spec without the GLU, or a SiLU one with it, is refused. bf16's native rows are pinned to 8: the
    layer call's experts take 2 rows each, which a machine's tuning may hand to torch's GEMMs (a build that measured
    bf16_native_rows 1 failed the bit-for-bit check, 2026-12-07)."""
    from tiered import kernels
    from tiered.checkpoint.model_config import biased_width
    from tiered.kernels import load

    if load() is None:
        pytest.skip("the native kernels are not built")
    monkeypatch.setattr(kernels, "bf16_native_rows", lambda: 8)
    D = F = 64
    Db, Fb = biased_width(D), biased_width(F)
    fmt = ExpertFormat(name, ((F, Db), (F, Db), (D, Fb)), "tiled", swiglu_limit=1.0, swiglu_alpha=1.702)
    g = torch.Generator().manual_seed(0)
    slots = []
    for _ in range(3):
        ws = [0.3 * torch.randn(s, generator=g) for s in fmt.shapes]
        if fmt.is_dense:
            slots.append(tuple(w.bfloat16().contiguous() for w in ws))
        else:
            slots.append(fmt.empty())
            fmt.quantize(ws, slots[-1])
    limit = fmt.biased_rows
    assert limit == {"mxfp4": fmt.group_rows, "int4": 8, "int8": 1 << 30, "bf16": fmt.native_rows}[name] >= 1
    tol = 1e-2 if name == "bf16" else 1e-5
    rows = [1, 0, min(limit, 40)]
    bounds = [0, *torch.tensor(rows).cumsum(0).tolist()]
    xs = 2 * torch.randn(bounds[-1], D, generator=g)
    ys = fmt.forward_group(xs, slots, bounds)
    assert ys.shape == xs.shape and ys.dtype == xs.dtype
    for slot, a, b in zip(slots, bounds, bounds[1:]):
        if b > a:
            ref = fmt._biased_glu(xs[a:b], slot)
            assert (ys[a:b] - ref).abs().max() <= tol * ref.abs().max(), (a, b)
            assert torch.equal(fmt.forward(xs[a:b], slot), ys[a:b])
    loose = dataclasses.replace(fmt, swiglu_limit=100.0)  # the clamps act on these inputs: unclamped differs
    assert not torch.allclose(loose.forward_group(xs, slots, bounds), ys, rtol=0.05, atol=0)
    # the layer call (a decode step's layer): bit for bit forward per expert, then index_add_ in expert order
    x = torch.randn(3, D, generator=g)
    idx = torch.tensor([[0, 2], [2, 1], [0, 1]])
    wt = torch.rand(3, 2, generator=g)
    out = fmt.layer_call(x, slots)(idx, wt, [0, 1, 2])
    want = torch.zeros_like(x)
    for e in range(3):
        tok, j = (idx == e).nonzero(as_tuple=True)
        want.index_add_(0, tok, fmt.forward(x[tok], slots[e]) * wt[tok, j, None])
    assert torch.equal(out, want)
    if limit < 1024:
        n = limit + 1
        x = torch.randn(n, D, generator=g)
        assert fmt.forward_group(x, slots[:1], [0, n]) is None
        ref = fmt._biased_glu(x, slots[0])
        if fmt.amx_rows:  # a CPU with AMX: past biased_rows one native call on the AMX GEMM, the clamped GLU inside
            assert fmt.amx_rows == limit and name in ("mxfp4", "int4")
            y = fmt.forward(x, slots[0])
            assert torch.equal(y, fmt.native.forward_amx(slots[0][0], x, **fmt.glu_args))
            assert (y - ref).abs().max() <= 2e-2 * ref.abs().max()
            # ... and the layer call computes such an expert so: every row to expert 0, with weight 1
            idx, wt = torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1)
            assert torch.equal(fmt.layer_call(x, slots[:1])(idx, wt, [0], (), fmt.amx_rows), y)
        else:
            assert torch.equal(fmt.forward(x, slots[0]), ref)
    if not fmt.is_dense:
        codes = [s[0] for s in slots[:1]]
        with pytest.raises(RuntimeError, match="need swiglu_limit"):
            fmt.native.forward_group(codes, xs[:1], [0, 1])
        silu = ExpertFormat(name, ((F, D), (F, D), (D, F)), "tiled")
        slot = silu.empty()
        silu.quantize([0.3 * torch.randn(s, generator=g) for s in silu.shapes], slot)
        with pytest.raises(RuntimeError, match="clamped GLU is for"):
            silu.native.forward_group([slot[0]], xs[:1], [0, 1], swiglu_limit=7.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("experts", ["int4", "bf16"])
def test_cpu_moe_layer_runs_its_experts_in_one_call(tmp_path, monkeypatch, dtype, experts):
    """Without an accelerator, a layer whose experts are all in RAM computes them and their weighted
    sum in one native call (ExpertFormat.layer_call): a decode step's (runtime/moe_runner._resident_layer)
    and a prompt's, more rows than a decode step (_all_on_fast), with the same logits, bit for bit, and
    the same tokens as one task per expert. In bfloat16 the native sum rounds as torch's ops do: each
    product, then each add in expert order."""
    from moe_fixtures import make_moe_checkpoint

    from tiered.kernels import load
    from tiered.runtime import moe_runner

    if load() is None:
        pytest.skip("the native kernels are not built")
    llm = LLM(make_moe_checkpoint("qwen3_moe", tmp_path / "m"),
              EngineConfig(max_context=48, dtype=dtype, decode_weights="fp32" if dtype == "float32" else "bf16",
                           accelerator="none", expert_weights=experts))
    assert llm.experts.placement.count("fast") == len(llm.experts.placement.tiers)
    from tiered.models.moe import MoEBlock
    for block in (m for m in llm.model.modules() if isinstance(m, MoEBlock)):
        block.on_route = lambda *a: None  # the native decode step then runs the blocks as modules: their runner is tested
    layer_calls, tokens = [], []  # experts and tokens of each layer call
    real_call = ExpertFormat.layer_call

    def counted(self, x, slots):
        call = real_call(self, x, slots)
        layer_calls.append(len(slots))
        return call and (lambda idx, *a: tokens.append(idx.shape[0]) or call(idx, *a))

    monkeypatch.setattr(ExpertFormat, "layer_call", counted)
    logits = llm.logits(PROMPT[:4])  # 4 tokens x top-k: more entries than a decode step's call (_all_on_fast's)
    assert max(tokens) == 4
    out = llm.generate(PROMPT, GREEDY)[0].token_ids
    moe_layers = len({layer for layer, _ in llm.experts.placement.tiers})
    assert len(layer_calls) >= moe_layers * (len(out) - 1) and max(layer_calls) > 1  # every decode step
    monkeypatch.setattr(moe_runner.TieredExperts, "_resident_layer", lambda *a, **k: None)
    assert torch.equal(llm.logits(PROMPT[:4]), logits)
    assert llm.generate(PROMPT, GREEDY)[0].token_ids == out
    monkeypatch.setattr(moe_runner.TieredExperts, "_all_on_fast", lambda *a, **k: None)
    assert torch.equal(llm.logits(PROMPT[:4]), logits)
    assert llm.generate(PROMPT, GREEDY)[0].token_ids == out
    monkeypatch.undo()
    for n in (1, 2, 3):  # the one-call layer itself against the per-expert path, at decode sizes
        one = llm.logits(PROMPT[:n])
        monkeypatch.setattr(moe_runner.TieredExperts, "_resident_layer", lambda *a, **k: None)
        monkeypatch.setattr(moe_runner.TieredExperts, "_all_on_fast", lambda *a, **k: None)
        assert torch.equal(llm.logits(PROMPT[:n]), one), n
        monkeypatch.undo()
    llm.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["int4", "bf16"])
def test_a_prompts_layer_call_equals_the_group_call_and_index_add(name, dtype):
    """A prompt's layer call (ExpertFormat.layer_call: experts of more than NATIVE_ROWS rows, in groups of 8)
    equals the grouped native call (forward_group's) on the rows gathered by expert, then index_add_ of
    ys * weight in expert order, bit for bit; an expert's outputs `given` by the caller (here `forward`'s,
    as _all_on_fast gives an expert past group_rows) join the sum in its place; a given output of the wrong
    rows is refused."""
    from tiered.kernels import load

    if load() is None:
        pytest.skip("the native kernels are not built")
    ws = _weights(F=64)
    fmt = ExpertFormat(name, [w.shape for w in ws], "tiled")
    g = torch.Generator().manual_seed(3)
    slots = []
    for e in range(4):
        w = [t + 0.01 * e for t in ws]
        if fmt.is_dense:
            slots.append(tuple(t.bfloat16().contiguous() for t in w))
        else:
            slots.append(fmt.empty())
            fmt.quantize(w, slots[-1])
    N, k = 24, 2
    idx = torch.stack([torch.randperm(3, generator=g)[:k] for _ in range(N)])  # experts 0-2 of 4: ~16 rows each
    idx[0, 1] = 3 if idx[0, 0] != 3 else 2  # expert 3 on one row
    x = torch.randn(N, ws[0].shape[1], generator=g).to(dtype)
    wt = torch.rand(N, k, generator=g).to(dtype)
    experts = sorted(set(idx.flatten().tolist()))
    order = torch.argsort(idx.flatten(), stable=True)
    tok, slot = order // k, order % k
    counts = [int((idx == e).sum()) for e in experts]
    assert max(counts) > 8
    bounds = [0, *np.cumsum(counts).tolist()]
    ys = fmt.grouped(x[tok], [slots[e] for e in experts], bounds)
    call = fmt.layer_call(x, [slots[e] for e in experts])
    assert torch.equal(call(idx, wt, experts), torch.zeros_like(x).index_add_(0, tok, ys * wt[tok, slot, None]))
    given = [None] * len(experts)
    given[0] = fmt.forward(x[tok[:bounds[1]]], slots[experts[0]])
    ys[:bounds[1]] = given[0]
    assert torch.equal(call(idx, wt, experts, given), torch.zeros_like(x).index_add_(0, tok, ys * wt[tok, slot, None]))
    given[0] = 2 * given[0]  # the given rows are what the sum takes, not the expert's own
    ys[:bounds[1]] = given[0]
    assert torch.equal(call(idx, wt, experts, given), torch.zeros_like(x).index_add_(0, tok, ys * wt[tok, slot, None]))
    given[0] = given[0][1:]
    with pytest.raises(RuntimeError, match="given"):
        call(idx, wt, experts, given)


@pytest.mark.parametrize("amx", [False, True], ids=["torch", "amx"])
def test_a_prompts_experts_past_the_group_rows_run_beside_the_group_call(tmp_path, monkeypatch, amx):
    """A CPU-only prompt layer whose experts are all in RAM (_all_on_fast) where some experts have more rows
    than the grouped kernels take (ExpertFormat.group_rows, made 2 here). Without the AMX GEMM (`amx_rows` 0)
    those run each by `forward` on this thread first, then the others and the weighted sum of all in one call
    (ExpertFormat.layer_call's `given`); with it (a CPU with AMX) the call computes them too, on the AMX GEMM
    (its amx_rows), and nothing runs beside it. Either way the logits are bit for bit those of one task per
    expert (each by `forward`, on the AMX GEMM past the group rows where it runs)."""
    from moe_fixtures import make_moe_checkpoint

    from tiered.kernels import load
    from tiered.quant.int4 import amx_kernels
    from tiered.runtime import moe_runner

    if load() is None:
        pytest.skip("the native kernels are not built")
    if amx and amx_kernels() is None:
        pytest.skip("no AMX GEMM here")
    llm = LLM(make_moe_checkpoint("qwen3_moe", tmp_path / "m"),
              EngineConfig(max_context=48, accelerator="none", expert_weights="int4"))
    try:
        monkeypatch.setattr(ExpertFormat, "group_rows", property(lambda self: 2))
        if amx:  # `forward` past 2 rows on the AMX GEMM too, as the call computes them
            for rows in ("native_rows", "grouped_rows"):
                monkeypatch.setattr(ExpertFormat, rows, property(lambda self: 2))
        else:
            monkeypatch.setattr(ExpertFormat, "amx_rows", property(lambda self: 0))
        split, alone, amx_forwards = [], [], []  # (computed in the call, given, amx_rows) per call; forwards' rows
        real_call, real_forward, real_amx = ExpertFormat.layer_call, ExpertFormat.forward, ExpertFormat._amx_forward

        def counted(self, x, slots):
            call = real_call(self, x, slots)

            def run(idx, wt, experts, given=(), amx_rows=0):
                done = sum(g is not None for g in given)
                split.append((len(experts) - done, done, amx_rows))
                return call(idx, wt, experts, given, amx_rows)
            return call and run

        monkeypatch.setattr(ExpertFormat, "layer_call", counted)
        monkeypatch.setattr(ExpertFormat, "forward", lambda self, x, slot: alone.append(x.shape[0])
                            or real_forward(self, x, slot))
        monkeypatch.setattr(ExpertFormat, "_amx_forward", lambda self, x, slot: amx_forwards.append(x.shape[0])
                            or real_amx(self, x, slot))
        logits = llm.logits(PROMPT)
        if amx:  # every expert in the call, those past the group rows on the AMX GEMM
            assert split and all(done == 0 and rows == 2 for _, done, rows in split) and not alone
        else:  # both sides of the split ran
            assert any(n and done for n, done, _ in split) and alone and min(alone) > 2
            assert all(rows == 0 for _, _, rows in split)
        alone.clear()
        monkeypatch.setattr(moe_runner.TieredExperts, "_all_on_fast", lambda *a, **k: None)
        amx_forwards.clear()
        assert torch.equal(llm.logits(PROMPT), logits)
        assert max(alone) > 2 and (max(amx_forwards) > 2 if amx else not amx_forwards)
    finally:
        llm.close()


def test_cpu_and_plain_int4_layouts_hold_the_same_weights():
    ws = _weights(F=64)
    a, b = (ExpertFormat("int4", [w.shape for w in ws], lay) for lay in ("cpu", "plain"))
    sa, sb = a.empty(), b.empty()
    a.quantize(ws, sa)
    b.quantize(ws, sb)
    for wa, wb in zip(a.dequantize(sa), b.dequantize(sb)):
        torch.testing.assert_close(wa, wb, rtol=2**-8, atol=1e-6)  # the kernel decodes to bf16


def test_int4_is_smaller_and_formats_fit_odd_shapes():
    shapes = [(48, 64), (48, 64), (64, 48)]  # Mixtral fixture: down's 48 inputs are not a 32-group multiple
    assert fit_format("int4", shapes) == "int4,int4,int8"
    assert ExpertFormat("int4,int4,int8", shapes).nbytes < ExpertFormat("bf16", shapes).nbytes / 2.2
    square = [(256, 256)] * 3  # int4: 0.5 B codes + bf16 scale, zero and zero residual per 32 = 0.6875 B
    assert ExpertFormat("int4", square).nbytes == 3 * 256 * 256 * 0.6875 == sizes.expert_bytes(
        type("C", (), dict(hidden_size=256, moe_intermediate_size=256))(), "int4")
    assert pricing_precision("int4,int4,int8") == "int8" and pricing_precision("int8-g32") == "int8"
    with pytest.raises(ConfigError, match="divisible by 32"):
        ExpertFormat("int4", shapes)
    with pytest.raises(ConfigError, match="unknown expert format"):
        ExpertFormat("int3", shapes)


def test_gguf_block_unpacking_is_exact():
    """Q8_0 and Q4_K blocks become (codes, scales, zeros) that reproduce gguf's dequantization."""
    from gguf.quants import quantize

    w = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    q, d = unpack_q8_blocks(quantize(w, Q.Q8_0))
    ref = dequantize(quantize(w, Q.Q8_0), Q.Q8_0).reshape(w.shape)
    np.testing.assert_array_equal((q.float().reshape(4, -1, 32) * d.float()[..., None]).reshape(4, -1).numpy(), ref)
    blocks = quantize_q4_k(w)
    codes, scale, zero = unpack_q4k_blocks(blocks)
    mine = ((codes.float() - 8).reshape(4, -1, 32) * scale[..., None] + zero[..., None]).reshape(4, -1)
    np.testing.assert_allclose(mine.numpy(), dequantize(blocks, Q.Q4_K).reshape(w.shape), atol=1e-6)
    for qt, f, half_step in ((Q.Q4_K, quantize_q4_k, 1 / 30), (Q.Q6_K, quantize_q6_k, 1 / 62)):
        r = dequantize(f(w), qt).reshape(w.shape)  # the tests' block writers are read back by gguf
        assert np.abs(r - w).max() <= 1.05 * half_step * (w.max() - min(w.min(), 0))


NEAR_TIE = 0.015  # logits: a reference step whose top two are closer than this may go either way
# The reference-token tests check the stored formats, on bf16 activations (expert_activations
# "bf16"): int8 ones (the default on AVX-512) move these random fixtures' logits by a few hundredths
# (the wide Q4_K Mixtral's token 14, a top-2 gap of 0.035, flips), which would leave too few tokens
# before the first such gap. Their numerics are checked against a torch emulation in
# test_native_kernels.py, and their KL by benchmarks/moe_accuracy.py.
EXACT_ACT = dict(expert_activations="bf16")


def _assert_reference_tokens(out, model, qtype):
    """`out` is the dequantized reference's greedy continuation, up to its first near tie (top-2
    logit gap < NEAR_TIE: bf16 or int8 activations may pick either; the reference is fp32), the
    tied token excluded, which must not come before the 5th token, so that the check keeps its
    teeth."""
    ref = dequantized_moe_model(model, qtype)
    with torch.no_grad():
        res = ref.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, output_scores=True,
                           return_dict_in_generate=True)
    toks = res.sequences[0, 16:].tolist()
    gaps = [float(s[0].float().topk(2).values.diff().abs()) for s in res.scores]
    upto = next((i for i, gap in enumerate(gaps) if gap < NEAR_TIE), len(toks))
    assert upto >= 4, f"the fixture has a near tie at token {upto - 1}: not a useful reference"
    assert out[:upto] == toks[:upto], (out, toks, gaps)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_moe_gguf_keeps_experts_quantized_with_reference_tokens(kind, qtype, tmp_path):
    model = build_hf_moe_model(kind)
    path = write_moe_gguf(model, tmp_path / f"{kind}.gguf", qtype)
    llm = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", accelerator="none", **EXACT_ACT))
    kept = {Q.Q8_0: "int8-g32", Q.Q4_0: "int4", Q.Q4_1: "int4"}[qtype]
    assert llm.plan.dtypes["experts"].split(",")[0] == kept  # Mixtral's down (48 wide) is written F16
    assert llm.experts.store.expert_bytes == sizes.expert_bytes(llm.config, llm.plan.dtypes["experts"])
    _assert_reference_tokens(llm.generate(PROMPT, GREEDY)[0].token_ids, model, qtype)
    llm.close()


WIDE = dict(hidden_size=256, intermediate_size=512, num_local_experts=16)  # K-quant super-blocks are 256 wide


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS])
def test_quantized_moe_gguf_runs_under_a_budget_smaller_than_the_file(qtype, tmp_path):
    """A 16-expert Mixtral GGUF runs with RAM for less than half its bytes (3/4 where its experts take int8-g32 copies
    of IQ4 blocks; experts read from the offload files as stored bytes) and gives the dequantized reference's greedy
    tokens. With tiered's kernels built, Q5_K / Q6_K / IQ4_XS experts keep their blocks (the q5k / q6k / iq4xs kinds:
    the CPU engine has no accelerator), noted exact; without them, and IQ4_NL's always, int8 / int8-g32 copies
    (IQ4's from their codebook values and scales, quant/gguf_experts.unpack_iq4_blocks, noted exact)."""
    from tiered.kernels import available

    kquant = {Q.Q5_K: "q5k", Q.Q6_K: "q6k", Q.IQ4_XS: "iq4xs"}.get(qtype) if available() else None
    model = build_hf_moe_model("mixtral", **WIDE)
    path = write_moe_gguf(model, tmp_path / "wide.gguf", qtype)
    # (an IQ4 expert as int8-g32 in RAM holds ~2x its stored bytes, 1.06 against 0.53 a weight: its staging needs 3/4
    # of the file; as iq4xs 0.54)
    budget = path.stat().st_size * (3 if qtype in (Q.IQ4_NL, Q.IQ4_XS) and kquant is None else 2) // 4
    llm = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", accelerator="none", cpu_memory=budget, **EXACT_ACT,
                                 offload_dir=str(tmp_path / "off")))
    assert llm.experts.placement.count("disk") > 0
    out = llm.generate(PROMPT, GREEDY)[0].token_ids
    assert llm.experts.bytes_read > 0 and llm.cpu_budget.peak <= budget
    assert any("experts stored as" in n for n in llm.plan.notes)
    if kquant is not None:
        assert llm.plan.dtypes["experts"] == kquant and any("mapped exactly" in n for n in llm.plan.notes)
        assert llm.experts.store.expert_bytes == sizes.expert_bytes(llm.config, kquant)
    elif qtype in (Q.Q5_K, Q.Q6_K):
        assert any(f"re-quantized on load: {qtype.name} -> int8" in n for n in llm.plan.notes)
    if qtype == Q.IQ4_NL or (qtype == Q.IQ4_XS and kquant is None):
        assert llm.plan.dtypes["experts"] == "int8-g32" and any("mapped exactly" in n for n in llm.plan.notes)
    _assert_reference_tokens(out, model, qtype)
    llm.close()


def test_int4_experts_move_fewer_bytes_per_token(tmp_path):
    """Same RAM cache (slots), experts on disk: int4 reads ~3x fewer bytes per token than bf16."""
    from moe_fixtures import make_moe_checkpoint

    ckpt = make_moe_checkpoint("qwen3_moe", tmp_path / "m")
    read = {}
    for fmt in ("bf16", "int4"):
        llm = LLM(ckpt, EngineConfig(max_context=32, decode_weights="fp32", accelerator="none", plan="off",
                                     expert_weights=fmt, expert_cache_slots=2, resident_experts=0,
                                     offload_dir=str(tmp_path / fmt)))
        out = llm.generate(PROMPT, GREEDY)[0]
        read[fmt] = llm.experts.bytes_read / len(out.token_ids)
        assert llm.experts.store.expert_bytes == sizes.expert_bytes(llm.config, fmt)
        llm.close()
    assert read["int4"] * 2.5 < read["bf16"]


def test_engines_sharing_an_offload_dir_read_their_own_experts(tmp_path):
    """Engines of one checkpoint whose placements differ convert their disk experts into the same offload directory:
    each conversion replaces the files at the same paths (other experts, other offsets), and every engine still reads
    its own converted bytes (checkpoint/handle.hold_file), whichever read first: each disk expert read back equals
    its encoding and the greedy tokens equal an engine's alone. Before, descriptors were cached by path: an engine
    that had not read yet read the other's file at its own offsets (wrong experts, or a short read), and one created
    after another had read got the first's file."""
    from moe_fixtures import make_moe_checkpoint

    from tiered.checkpoint.handle import _FDS
    from tiered.memory.expert_store import expert_tensor_names
    from tiered.quant.gguf_experts import encode_expert

    ckpt = make_moe_checkpoint("qwen3_moe", tmp_path / "m")

    def engine(resident: int, where: str) -> LLM:
        return LLM(ckpt, EngineConfig(max_context=32, decode_weights="fp32", accelerator="none", plan="off",
                                      expert_weights="int4", expert_cache_slots=2, resident_experts=resident,
                                      offload_dir=str(tmp_path / where)))

    def check(llm: LLM, tokens: list[int]) -> None:
        store = llm.experts.store
        disk = [k for k in store.placement.tiers if store.tier(k) == "disk"]
        assert disk and all(h.inode is not None for k in disk for h in store.handles[k])
        for key in disk:
            bufs = tuple(torch.empty(s, dtype=store.dtype) for s in store.shapes)
            store.read(key, bufs)
            stored = encode_expert(store.fmt, tuple(llm.checkpoint.handle(n) for n in
                                                    expert_tensor_names(llm.config.model_type, *key)))
            assert all(torch.equal(a, b) for a, b in zip(bufs, stored))
        assert llm.generate(PROMPT, GREEDY)[0].token_ids == tokens

    alone = {}
    for r in (0, 3):
        with engine(r, f"alone{r}") as llm:
            alone[r] = llm.generate(PROMPT, GREEDY)[0].token_ids
    a, b = engine(0, "shared"), engine(3, "shared")  # b's files replace a's before a reads anything
    assert a.experts.placement.count("disk") != b.experts.placement.count("disk")
    check(a, alone[0])
    check(b, alone[3])
    c = engine(0, "shared")  # replaces b's files after b (and a) read
    check(c, alone[0])
    check(b, alone[3])
    check(a, alone[0])
    d = engine(0, "shared")  # reads c's files as they are: both hold them
    assert d.experts.store.reused_files and not d.experts.store.written_files
    c.close()  # d's hold keeps them open
    e = engine(3, "shared")  # replaces the paths again
    check(d, alone[0])
    check(e, alone[3])
    for llm in (a, b, d, e):
        llm.close()
    assert not any(k[2] is not None and k[0].startswith(str(tmp_path)) for k in _FDS)  # closed with their engines


def test_without_an_offload_dir_the_converted_experts_go_to_the_cache(tmp_path, monkeypatch):
    """No offload directory given: experts that need converting go to one for the checkpoint under tiered's cache
    (default_offload_dir: named by its real path), and the next load reads them from there as they are."""
    from moe_fixtures import make_moe_checkpoint

    from tiered.memory.expert_store import default_offload_dir

    monkeypatch.setenv("TIERED_CACHE", str(tmp_path / "cache"))
    ckpt = make_moe_checkpoint("qwen3_moe", tmp_path / "m")
    config = EngineConfig(max_context=32, decode_weights="fp32", accelerator="none", plan="off", expert_weights="int4",
                          expert_cache_slots=2, resident_experts=0)
    where = default_offload_dir(ckpt)
    assert where.parent == tmp_path / "cache" / "offload" and where.name.startswith("m-")
    tokens = []
    for written, reused in ((1, 0), (0, 1)):
        with LLM(ckpt, config) as llm:
            store = llm.experts.store
            assert store.offload_dir == where and all(f.startswith(str(where)) for f in store.disk_files())
            assert (store.written_files, store.reused_files) == (written, reused)
            tokens.append(llm.generate(PROMPT, GREEDY)[0].token_ids)
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("weights", ["int4", "bf16"])
def test_a_later_load_reads_the_offload_files_an_earlier_one_wrote(tmp_path, weights):
    """A second load of the same checkpoint with the same disk experts reads the converted files the first wrote
    (their metadata names the experts, the format and the checkpoint file's size and time) instead of converting
    again; a file whose first expert no longer reads back as converted, or written for other experts, is
    converted anew. Greedy tokens the same every time."""
    import os

    from moe_fixtures import make_moe_checkpoint

    ckpt = make_moe_checkpoint("qwen3_moe", tmp_path / "m")
    off = tmp_path / "off"

    def load(resident: int = 0) -> tuple[LLM, list[int]]:
        llm = LLM(ckpt, EngineConfig(max_context=32, decode_weights="fp32", accelerator="none", plan="off",
                                     expert_weights=weights, expert_cache_slots=2, resident_experts=resident,
                                     offload_dir=str(off)))
        return llm, llm.generate(PROMPT, GREEDY)[0].token_ids

    def inodes() -> dict[str, int]:
        return {f.name: f.stat().st_ino for f in sorted(off.iterdir())}

    first, tokens = load()
    files = inodes()
    assert files and first.experts.bytes_read > 0
    again, same = load()
    assert same == tokens and inodes() == files  # read as written: no file replaced
    # the first expert's bytes of one file changed (its metadata as before): that file is converted again
    name = sorted(files)[0]
    store = again.experts.store
    h = next(store.handles[k] for k in store.placement.tiers if store.tier(k) == "disk" and
             store.handles[k][0].path.endswith(name))[0]
    for llm in (first, again):
        llm.close()
    with open(off / name, "r+b") as f:
        f.seek(h.offset + 100)
        byte = f.read(1)
        f.seek(h.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    third, tokens3 = load()
    now = inodes()
    assert tokens3 == tokens and now[name] != files[name]
    assert all(now[n] == files[n] for n in files if n != name)
    third.close()
    other, tokens4 = load(resident=3)  # other disk experts: every file written for them
    assert tokens4 == tokens and not set(inodes().values()) & set(now.values())
    other.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["bf16", "int8", "int8-g32", "int4"])
def test_expert_kernels_on_cuda(name):
    """The portable int4 layout through tinygemm (or the fallback), int8 through torch's kernel, on
    the device, against the same format's dequantized weights."""
    ws = _weights(F=64, D=128)
    fmt = ExpertFormat(name, [w.shape for w in ws], "plain")
    slot = fmt.empty()
    fmt.quantize(ws, slot)
    dev = tuple(t.cuda() for t in slot)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    y = fmt.forward(x.cuda(), dev).float().cpu()
    ref = ExpertFormat("fp32", fmt.shapes).forward(x.float(), fmt.dequantize(slot))
    assert (y - ref).abs().max() <= 0.03 * ref.abs().max()


def test_run_options_map_to_the_engine_config():
    from tiered.cli import _engine_config

    common = dict(dtype="auto", decode_weights="auto", batch_activations="auto", expert_activations="auto", max_context=None, threads=None, gpu_mem=None, cpu_mem=None,
                  offload_dir=None, accelerator="none", cache_slots=None, cache_policy="lru", expert_profile=None,
                  read_ahead=True, plan="auto", profile_file=None, prefetch=False, prefetch_lookahead=2,
                  weights="auto", low_weights=None, mixed_thresholds="0.6,0.9", graphs="auto", speculative="off",
                  draft_model=None, num_speculative_tokens=4, kv_cache_dtype="auto", sliding_kv="window")
    assert _engine_config({**common, "graphs": "off"}).graphs == "off"
    assert _engine_config({**common, "sliding_kv": "full"}).sliding_kv == "full"
    with pytest.raises(ConfigError, match="sliding_kv"):
        _engine_config({**common, "sliding_kv": "half"})
    assert _engine_config({**common, "kv_cache_dtype": "int8"}).kv_cache_dtype == "int8"
    ec = _engine_config({**common, "speculative": "ngram", "num_speculative_tokens": 6})
    assert (ec.speculative, ec.num_speculative_tokens) == ("ngram", 6)
    ec = _engine_config({**common, "draft_model": "small.gguf"})
    assert (ec.speculative, ec.draft_model) == ("draft", "small.gguf")
    ec = _engine_config({**common, "weights": "int4", "low_weights": None})
    assert ec.expert_weights == "int4" and ec.decode_weights == "int4"
    ec = _engine_config({**common, "weights": "bf16", "low_weights": "int4", "mixed_thresholds": "0.5,0.8"})
    assert (ec.expert_weights, ec.expert_low_weights, ec.mixed_thresholds) == ("bf16", "int4", (0.5, 0.8))
    with pytest.raises(ConfigError, match="mixed-thresholds"):
        _engine_config({**common, "mixed_thresholds": "0.5"})
    with pytest.raises(ConfigError, match="expert_weights"):
        EngineConfig(expert_weights="int3")
    assert _engine_config({**common, "expert_activations": "bf16"}).expert_activations == "bf16"
    with pytest.raises(ConfigError, match="expert_activations"):
        EngineConfig(expert_activations="int16")


@pytest.mark.parametrize("act", ["q8", "bf16", "auto"])
def test_expert_activations_reach_the_expert_kernels(act, tmp_path):
    """Plan.expert_act (auto: q8) is the stored experts' ExpertFormat.act, and their native kernels
    compute on it: a one-token expert forward equals the kernel on those activations and differs
    from the other one."""
    model = build_hf_moe_model("mixtral", **WIDE)
    path = write_moe_gguf(model, tmp_path / "wide.gguf", Q.Q4_0)
    llm = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", accelerator="none", expert_activations=act))
    want = act if act != "auto" else "q8"
    fmt = llm.experts.store.fmt
    assert llm.plan.expert_act == want and fmt.act == want and fmt.kinds[0] == "int4"
    if fmt.native is not None:
        slot = llm.experts.store.encode(next(iter(llm.experts.store.handles)))
        x = torch.randn(1, fmt.shapes[0][1])
        other = dataclasses.replace(fmt, act="bf16" if want == "q8" else "q8")
        y, y_other = fmt.forward(x, slot), other.forward(x, slot)
        assert torch.equal(y, dataclasses.replace(fmt).forward(x, slot)) and not torch.equal(y, y_other)
    llm.close()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_q4_0_experts_skip_their_all_zero_residuals(qtype, tmp_path):
    """Q4_0 experts (zero 0: every zero residual is 0) are marked exact_zeros, and their native
    kernels skip the residual segment: the same outputs, bit for bit, as reading it. Q4_1 experts
    (zero m + 8 d, rounded to bf16) keep reading theirs."""
    model = build_hf_moe_model("mixtral", **WIDE)
    path = write_moe_gguf(model, tmp_path / "wide.gguf", qtype)
    llm = LLM(path, EngineConfig(max_context=32, decode_weights="fp32", accelerator="none"))
    fmt = llm.experts.store.fmt
    assert fmt.kinds[0] == "int4" and fmt.exact_zeros == (qtype == Q.Q4_0)
    if fmt.native is not None:
        slot = llm.experts.store.encode(next(iter(llm.experts.store.handles)))
        x = torch.randn(3, fmt.shapes[0][1])
        if qtype == Q.Q4_0:  # skipped or read, the residuals add nothing
            assert torch.equal(fmt.forward(x, slot), dataclasses.replace(fmt, exact_zeros=False).forward(x, slot))
        else:  # nonzero residuals: skipping them (the flag reaches the kernels) changes the result
            assert not torch.equal(dataclasses.replace(fmt, exact_zeros=True).forward(x, slot), fmt.forward(x, slot))
    llm.close()


def test_expert_spec_offsets_are_checked():
    """A native ExpertSpec refuses segment offsets outside the slot, and -1 anywhere but an int4
    projection's residual (exact_zeros: not read)."""
    from tiered.kernels import load

    ext = load()
    if ext is None:
        pytest.skip("the native kernels are not built")
    fmt = ExpertFormat("int4", ((64, 64), (64, 64), (64, 64)), "tiled")
    offs = [[segs[0][1], segs[0][1] + 256, segs[1][1]] for segs in fmt._layout]  # the scales inline
    spec = lambda o: ext.expert_spec(["int4"] * 3, [[64, 64]] * 3, o, fmt.nbytes, "q8", "tiled", "q8")  # noqa: E731
    assert spec([o[:2] + [-1] for o in offs]) is not None
    with pytest.raises(RuntimeError, match="out of the slot"):
        spec([[o[0], -1, o[2]] for o in offs])
    with pytest.raises(RuntimeError, match="out of the slot"):
        spec([[o[0], o[1], fmt.nbytes] for o in offs])


def test_bf16_experts_take_torch_gemms_past_the_machines_native_rows(monkeypatch):
    """kernels.bf16_native_rows (this machine's kernel tuning: oneDNN's bf16 GEMM beat the native kernel
    from 8 rows on the Zen 4 VM, 12 against 19 ms for a Mixtral-width expert): a bf16 expert runs the
    native kernel up to those rows and torch's GEMMs past them, with the same values within bf16
    rounding; at the built-in 32 it runs 8-row groups up to 32 rows, as before the tuning."""
    from tiered import kernels

    if kernels.load() is None:
        pytest.skip("the native kernels are not built")
    ws = _weights(F=64)
    slot = tuple(w.bfloat16().contiguous() for w in ws)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))
    wg, wu, wd = (w.float() for w in slot)
    ref = (torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)) @ wd.T
    calls = []
    for rows, native_at_6 in ((4, False), (32, True)):
        monkeypatch.setattr(kernels, "bf16_native_rows", lambda rows=rows: rows)
        fmt = ExpertFormat("bf16", [w.shape for w in ws], "plain")
        assert fmt.native_rows == min(8, rows) and fmt.grouped_rows == (rows if rows > 8 else 0)
        monkeypatch.setattr(ExpertFormat, "_native_forward", lambda self, *a, real=ExpertFormat._native_forward:
                            calls.append(a[0].shape[0]) or real(self, *a))
        calls.clear()
        y = fmt.forward(x, slot)
        assert (calls == [6]) == native_at_6 and torch.allclose(y, ref, rtol=2e-2, atol=2e-3)
        assert fmt.forward(x[:4], slot) is not None and calls[-1] == 4  # 4 rows: native either way
        monkeypatch.undo()


@pytest.mark.parametrize("K", [8, 24, 33, 40, 48])
def test_int8_weights_of_any_width(K):
    """torch's `_weight_int8pack_mm` needs K % 16 == 0 on the CPU (torch 2.13: K = 24, a small query
    rank's q_b_proj, segfaults; K = 8 or 40 returns wrong rows). Int8Linear past its native rows, the
    decode step's Kernel and an int8 expert projection give the dequantized product at every width."""
    from tiered.quant.experts import project
    from tiered.quant.int8 import Int8Linear
    from tiered.runtime.cpu_decode import Kernel

    torch.manual_seed(K)
    m = Int8Linear.from_dense(torch.randn(40, K))
    wq = m.q.float() * m.scale.float()[:, None]
    for rows in (1, 9, 48):  # 48: the bf16 GEMM over the codes where the ISA GEMMs bf16 (Int8Linear.DEQUANTIZE_ROWS)
        x = torch.randn(rows, K)
        ref = x @ wq.T
        for got in (m(x), Kernel(m)(x), project(x, {"q": m.q, "scale": m.scale}, "int8", "cpu")):
            assert float((got.float() - ref).abs().max() / ref.abs().max()) < 2e-2


def test_int8_prompt_rows_take_one_bf16_gemm_over_the_codes(monkeypatch):
    """Int8Linear from DEQUANTIZE_ROWS rows, where the native kernels' ISA GEMMs in bf16: the codes converted
    to bf16 (exact) for oneDNN's GEMM, then the row scales: the same bits in one chunk or several
    (quant/int4.DEQUANTIZE_CHUNK), as close to the exact product as _weight_int8pack_mm (both round x to
    bf16), which fewer rows, and every row count where the ISA GEMMs in fp32, still take."""
    from tiered.quant import int4, int8
    from tiered.quant.int8 import DEQUANTIZE_ROWS, Int8Linear, int8pack_mm

    g = torch.Generator().manual_seed(5)
    m = Int8Linear.from_dense(torch.randn(96, 160, generator=g), bias=torch.randn(96, generator=g))
    wq = m.q.double() * m.scale.double()[:, None]
    x = torch.randn(DEQUANTIZE_ROWS + 8, 160, generator=g)
    exact = x.double() @ wq.T + m.bias.double()
    packed = int8pack_mm(x.bfloat16(), m.q, m.scale).float() + m.bias
    calls = []
    monkeypatch.setattr(int8, "int8pack_mm", lambda *a: calls.append(a[0].shape[0]) or int8pack_mm(*a))
    monkeypatch.setattr(int4, "dequantize_dtype", lambda: torch.bfloat16)
    one = m(x)
    want = (torch.nn.functional.linear(x.bfloat16(), m.q.bfloat16()).float() * m.scale.float() + m.bias)
    assert calls == [] and torch.equal(one, want)
    monkeypatch.setattr(int4, "DEQUANTIZE_CHUNK", 32 * 160)  # 2 rows of 16-row tiles a chunk: 3 GEMMs
    assert torch.equal(m(x), one)
    rel = lambda y: float((y.double() - exact).norm() / exact.norm())
    assert rel(one) < 1.5 * rel(packed) + 1e-6 and rel(one) < 5e-3
    m(x[:DEQUANTIZE_ROWS - 1])
    assert calls == [DEQUANTIZE_ROWS - 1]  # fewer rows: torch's int8 kernel
    monkeypatch.setattr(int4, "dequantize_dtype", lambda: torch.float32)
    assert torch.equal(m(x), packed) and calls[-1] == x.shape[0]


def test_f16_gguf_experts_run_as_bf16_on_the_cpus_default_engine(tmp_path):
    """An F16 GGUF's experts on the CPU's default (lossy) engine: rounded to bf16, as its dense tensors'
    decode copies are, and noted as re-quantized, not widened to fp32 (twice the RAM, run as modules);
    the lossless mode keeps them exact in fp32. Logits near transformers' on the F16 weights."""
    from fixtures import hf_logits, max_rel_err, prompt_ids
    from gguf_writer import dequantized_moe_model

    model = build_hf_moe_model("qwen3_moe")
    path = write_moe_gguf(model, tmp_path / "f16.gguf", Q.F16)
    ids = prompt_ids(model.config.vocab_size, 12, 0)
    ref = hf_logits(dequantized_moe_model(model, Q.F16), ids)
    auto = LLM(path, EngineConfig(max_context=32, accelerator="none"))
    assert auto.plan.dtypes["experts"] == "bf16" and any("F16 -> bf16" in n for n in auto.plan.notes)
    assert max_rel_err(auto.logits(ids), ref) < 2e-2
    auto.close()
    exact = LLM(path, EngineConfig(max_context=32, accelerator="none", dtype="float32", decode_weights="fp32"))
    assert exact.plan.dtypes["experts"] == "fp32" and max_rel_err(exact.logits(ids), ref) < 1e-4
    exact.close()


def test_int4_experts_on_int8_rows_keep_their_groups_at_any_rows_on_avx2(monkeypatch):
    """quant/experts.GROUPED_ROWS_Q8: on AVX2 a tiled int4 expert on int8 activations (batch_act "q8") runs its
    rows in groups of NATIVE_ROWS at any count (a Qwen3-30B-A3B expert on 2 Zen 3 cores: 20.4 ms at 512 rows
    against 33.4 dequantized for an fp32 matmul); on bf16 activations, and on AVX-512, up to GROUPED_ROWS."""
    from tiered import kernels as kmod
    from tiered.quant import experts as ex

    monkeypatch.setattr(kmod, "q8_expert_grouped_rows", lambda: None)  # this machine untuned: the tables
    assert ex.prompt_rows("int4", "avx2", batch_act="q8") == (ex.NATIVE_ROWS, 1 << 30)
    assert ex.prompt_rows("int4", "avx2") == ex.prompt_rows("int4", "avx512", batch_act="q8") == \
        (ex.NATIVE_ROWS, ex.GROUPED_ROWS["int4"])
    assert ex.prompt_rows("int8-g32", "avx2", batch_act="q8") == (ex.NATIVE_ROWS, ex.GROUPED_ROWS["int8-g32"])
    shapes = ((64, 96), (64, 96), (96, 64))
    for isa, act, want in (("avx2", "q8", 1 << 30), ("avx2", "bf16", 128), ("avx512", "q8", 128)):
        monkeypatch.setattr(kmod, "isa", lambda isa=isa: isa)
        fmt = ex.ExpertFormat("int4", shapes, "tiled", batch_act=act)
        assert fmt.grouped_rows == want and fmt.group_rows == max(fmt.native_rows, want)
    # a measured tuning (kernels/tune.py's q8_expert_grouped_rows; 0: groups at any rows) decides int4 on int8
    # rows on any ISA, this machine's through kernels.q8_expert_grouped_rows
    for tuned, want in ((0, 1 << 30), (64, 64)):
        assert ex.prompt_rows("int4", "avx512", batch_act="q8", tuning={"q8_expert_grouped_rows": tuned})[1] == want
        monkeypatch.setattr(kmod, "q8_expert_grouped_rows", lambda tuned=tuned: tuned)
        assert ex.ExpertFormat("int4", shapes, "tiled", batch_act="q8").grouped_rows == want
        assert ex.ExpertFormat("int4", shapes, "tiled", batch_act="bf16").grouped_rows == ex.GROUPED_ROWS["int4"]
    assert ex.prompt_rows("int8-g32", "avx512", batch_act="q8", tuning={"q8_expert_grouped_rows": 64})[1] == \
        ex.GROUPED_ROWS["int8-g32"]  # only int4's is measured


@pytest.mark.skipif(not __import__("tiered").kernels.available(), reason="native extension unavailable")
def test_int4_projections_past_the_kernel_rows_dequantize_in_the_isas_gemm_dtype(monkeypatch):
    """A tiled int4 expert projection of more rows than its kernel takes (quant/experts.NATIVE_ROWS in one
    call; ExpertFormat.forward groups rows up to GROUPED_ROWS["int4"]) is dequantized once for one GEMM in
    quant/int4.dequantize_dtype(): bf16 where the kernels' ISA is AVX-512 (oneDNN's bf16 GEMM, as a one-copy
    int4 weight's prompt and an mxfp4 projection take), fp32 for fp32 activations elsewhere (exact)."""
    import torch.nn.functional as F

    from tiered import kernels as kmod
    from tiered.quant import experts as ex
    from tiered.quant.int4 import quantize_int4

    N, K = 48, 96
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(3)) * 0.05
    v = ex.int4_segments(*quantize_int4(w), "tiled")
    wq = ex.dequantize_projection(v, "int4", N, K, "tiled")  # fp32 [N, K]
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(kmod, "isa", lambda: "avx512")
    assert torch.equal(ex.project(x, v, "int4", "tiled"), F.linear(x.bfloat16(), wq.bfloat16()).float())
    monkeypatch.setattr(kmod, "isa", lambda: "avx2")
    assert torch.equal(ex.project(x, v, "int4", "tiled"), F.linear(x, wq))
    within = ex.project(x[:ex.NATIVE_ROWS], v, "int4", "tiled")  # the kernel (bf16 activations) either way
    assert (within - F.linear(x[:ex.NATIVE_ROWS], wq)).abs().max() < 2e-2 * F.linear(x, wq).abs().max()


def test_the_default_offload_dir_deletes_the_least_recently_used_conversions_for_room(tmp_path, monkeypatch):
    """Without --offload-dir, a load whose conversions do not fit the disk's free space deletes other checkpoints'
    converted files under tiered's cache, least recently used first (a load reading a file as it is counts as a
    use), never files an engine holds; where even those would not make room it fails with a ConfigError and
    deletes nothing."""
    import shutil

    from moe_fixtures import make_moe_checkpoint

    from tiered.errors import ConfigError
    from tiered.memory.expert_store import default_offload_dir

    monkeypatch.setenv("TIERED_CACHE", str(tmp_path / "cache"))
    ckpts = {n: make_moe_checkpoint("qwen3_moe", tmp_path / n) for n in ("m1", "m2", "m3")}
    config = EngineConfig(max_context=32, decode_weights="fp32", accelerator="none", plan="off", expert_weights="int4",
                          expert_cache_slots=2, resident_experts=0)

    def files(name: str) -> list:
        return sorted(default_offload_dir(ckpts[name]).glob("*.safetensors"))

    tokens = {}
    for name in ("m1", "m2", "m1"):  # m1 loaded again after m2: read as it is, and now the more recently used
        with LLM(ckpts[name], config) as llm:
            tokens.setdefault(name, llm.generate(PROMPT, GREEDY)[0].token_ids)
            assert llm.generate(PROMPT, GREEDY)[0].token_ids == tokens[name]
    size = sum(f.stat().st_size for f in files("m1"))
    assert size > 0 and size == sum(f.stat().st_size for f in files("m2"))
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=0))  # a full disk
    m3 = LLM(ckpts["m3"], config)  # needs one checkpoint's conversions: m2's, the older, are deleted
    assert m3.experts.store.evicted == (size, 1) and m3.experts.store.written_files == 1
    assert not default_offload_dir(ckpts["m2"]).exists() and files("m1") and files("m3")
    assert m3.generate(PROMPT, GREEDY)[0].token_ids == tokens["m1"]  # the same generated weights
    m2 = LLM(ckpts["m2"], config)  # m3's files are held by its engine: m1's go
    assert m2.experts.store.evicted == (size, 1) and not files("m1")
    assert m2.generate(PROMPT, GREEDY)[0].token_ids == tokens["m2"]
    with pytest.raises(ConfigError, match="free"):  # only held files left: nothing deleted, a clear error
        LLM(ckpts["m1"], config)
    assert files("m2") and files("m3") and not default_offload_dir(ckpts["m1"]).exists()
    for llm in (m2, m3):
        llm.close()


def test_replacing_offload_files_an_engine_still_reads_frees_no_room(tmp_path, monkeypatch):
    """The free-space check counts the files a conversion replaces as room given back only where no engine of this
    process still reads them (their data stays on disk until it closes): on a full disk a load that would replace
    an open engine's files is refused with a ConfigError, and once that engine closed the same load fits."""
    import shutil

    from moe_fixtures import make_moe_checkpoint

    from tiered.errors import ConfigError

    ckpt = make_moe_checkpoint("qwen3_moe", tmp_path / "m")

    def config(resident: int) -> EngineConfig:
        return EngineConfig(max_context=32, decode_weights="fp32", accelerator="none", plan="off",
                            expert_weights="int4", expert_cache_slots=2, resident_experts=resident,
                            offload_dir=str(tmp_path / "off"))

    first = LLM(ckpt, config(0))
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=0))  # a full disk
    with pytest.raises(ConfigError, match="free"):
        LLM(ckpt, config(3))  # other disk experts: every file of the first replaced
    assert first.generate(PROMPT, GREEDY)[0].token_ids  # still reads its own files
    first.close()
    with LLM(ckpt, config(3)) as other:
        assert other.experts.store.written_files > 0
