"""tiered's AMX GEMM over a tiled int4 weight (kernels' int4_tiled_gemm, csrc/gemv.cpp): a prompt's rows against
the weight as int4_tiled_dequantize rounds it to bf16, products summed in fp32, for every layout the tiled kernels
read (scales inline or apart, a zero residual, MXFP4 codes), row and column tails, a bias; and Int4Linear.dense
taking it within AMX_ROWS. Runs where the CPU has AMX (Sapphire Rapids and later); skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tiered import kernels
from tiered.kernels.linear import tiled_codes, tiled_inline, tiled_scales
from tiered.quant import int4
from tiered.quant.int4 import Int4Linear, quantize_int4

from runtime_fixtures import engine_config, rt  # noqa: F401

ext = kernels.load()
pytestmark = pytest.mark.skipif(ext is None or not ext.amx_available(), reason="no AMX here (or tiered/kernels unbuilt)")


def _weight(N: int, K: int, g: torch.Generator, inline: bool, residual: bool):
    """(codes, sz, residual) of a random tiled int4 weight [N, K], in the form int4_tiled_kernel takes."""
    codes, scale, zero = quantize_int4(torch.randn(N, K, generator=g) / 8)
    sz = tiled_scales(torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16))
    packed = tiled_codes(codes)
    res = (torch.randn(N // 16, K // 32, 16, generator=g) / 64).to(torch.bfloat16) if residual else None
    return (tiled_inline(packed, sz), None, res) if inline else (packed, sz, res)


@pytest.mark.parametrize("M,N,K", [(1, 16, 32), (15, 48, 64), (16, 32, 96), (17, 64, 64), (33, 80, 128),
                                   (100, 96, 576),
                                   # past one K chunk (4096 columns; the second chunk 64) and one panel of 4 blocks
                                   # of W on each of 2 threads, with an odd x tile and a 16-row W tail
                                   (35, 400, 4160)])
@pytest.mark.parametrize("inline,residual", [(True, False), (False, False), (True, True)])
def test_amx_gemm_is_the_dequantized_weights_product(M, N, K, inline, residual):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    codes, sz, res = _weight(N, K, g, inline, residual)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    bias = torch.randn(N, generator=g)
    w = ext.int4_tiled_dequantize(codes, sz, res, fp32=False)  # bf16 [N, K]
    ref = F.linear(x.double(), w.double()) + bias.double()
    got = ext.int4_tiled_gemm(codes, sz, res, x, bias, True)  # fp32 out
    assert got.shape == (M, N) and got.dtype == torch.float32
    # the same bf16 products summed in fp32 (in another order): within a few fp32 roundings of the sum's terms
    tol = 1e-5 * (x.double().abs() @ w.double().abs().t() + bias.double().abs())
    assert ((got.double() - ref).abs() <= tol).all()
    got_bf16 = ext.int4_tiled_gemm(codes, sz, res, x, bias)  # bf16 out: the fp32 sum rounded once
    assert got_bf16.dtype == torch.bfloat16 and torch.equal(got_bf16, got.to(torch.bfloat16))


@pytest.mark.parametrize("inline,residual,e2m1", [(True, False, False), (False, False, False), (True, True, False),
                                                  (False, True, False), (True, False, True)])
def test_amx_gemm_weights_are_the_dequantized_ones_bit_for_bit(inline, residual, e2m1):
    """One-hot rows read W's columns out: y[k] = W[:, k] * 1, one exact product a sum. The AMX GEMM's tile layout
    (scales gathered, weights converted and rounded to bf16 in its own code) against int4_tiled_dequantize's bf16
    weights, bit for bit: signed zeros, the zero residual's add and the MXFP4 table included."""
    g = torch.Generator().manual_seed(7 + inline + 2 * residual + 4 * e2m1)
    N, K = 48, 96
    codes, sz, res = _weight(N, K, g, inline, residual)
    if e2m1:  # any MXFP4 nibbles, the weight's own inline (scale, zero) pairs kept
        codes = codes.clone()
        codes[..., :256] = torch.randint(0, 256, (N // 16, K // 32, 256), dtype=torch.uint8, generator=g)
    w = ext.int4_tiled_dequantize(codes, sz, res, fp32=False, e2m1=e2m1)  # bf16 [N, K]
    eye = torch.eye(K, dtype=torch.bfloat16)
    got = ext.int4_tiled_gemm(codes, sz, res, eye, None, True, e2m1)  # fp32 [K, N]
    assert torch.equal(got.t().contiguous().view(torch.int32), w.float().view(torch.int32))


def test_amx_gemm_reads_mxfp4_codes_and_strided_rows():
    g = torch.Generator().manual_seed(5)
    N, K, M = 48, 96, 21
    codes = torch.randint(0, 256, (N // 16, K // 32, 320), dtype=torch.uint8, generator=g)
    codes[..., 256:] = torch.stack([torch.rand(N // 16, K // 32, 16, generator=g) / 4,  # (scale, zero) pairs
                                    torch.randn(N // 16, K // 32, 16, generator=g) / 16], -1) \
        .to(torch.bfloat16).view(torch.uint8).reshape(N // 16, K // 32, 64)
    wide = torch.randn(M, K + 40, generator=g).to(torch.bfloat16)
    x = wide[:, 8:8 + K]  # rows K + 40 apart
    w = ext.int4_tiled_dequantize(codes, None, None, fp32=False, e2m1=True)
    ref = F.linear(x.double(), w.double())
    got = ext.int4_tiled_gemm(codes, None, None, x, None, True, True)
    assert ((got.double() - ref).abs() <= 1e-5 * (x.double().abs() @ w.double().abs().t())).all()


def test_amx_gemm_refuses_what_it_cannot_read():
    codes, sz, _ = _weight(32, 64, torch.Generator().manual_seed(0), True, False)
    with pytest.raises(RuntimeError, match="x must be a CPU bf16"):
        ext.int4_tiled_gemm(codes, None, None, torch.zeros(4, 64), None)  # fp32 x
    with pytest.raises(RuntimeError, match="x must be a CPU bf16"):
        ext.int4_tiled_gemm(codes, None, None, torch.zeros(4, 32, dtype=torch.bfloat16), None)  # wrong K
    assert ext.int4_tiled_gemm(codes, None, None, torch.zeros(0, 64, dtype=torch.bfloat16), None).shape == (0, 32)


def test_int4_linear_prompt_rows_take_the_amx_gemm_within_amx_rows(monkeypatch):
    """Int4Linear.dense past dequantize_rows: the AMX GEMM up to AMX_ROWS rows (within without_amx, and past them,
    the dequantized weight's oneDNN GEMM); both the same products within fp32 summation order, rounded to bf16."""
    g = torch.Generator().manual_seed(7)
    lin = Int4Linear.from_codes(*quantize_int4(torch.randn(64, 128, generator=g) / 8), layout="tiled",
                                batch_act="q8")
    monkeypatch.setattr(int4, "dequantize_rows", lambda *a, **k: 8)  # every call here past the kernel's rows
    monkeypatch.setattr(int4, "AMX_ROWS", 40)
    calls = []
    real = int4.amx_kernels
    monkeypatch.setattr(int4, "amx_kernels", lambda: calls.append(1) or real())
    w = ext.int4_tiled_dequantize(lin.packed, None, None, fp32=False).double()
    for rows, amx in ((33, True), (41, False)):
        calls.clear()
        x = torch.randn(rows, 128, generator=g).to(torch.bfloat16)
        got = lin.dense(x)
        with int4.without_amx():
            onednn = lin.dense(x)
        assert bool(calls) == amx
        ref = F.linear(x.double(), w)
        tol = 2 ** -8 * ref.abs() + 1e-4 * (x.double().abs() @ w.abs().t())
        assert ((got.double() - ref).abs() <= tol).all() and ((onednn.double() - ref).abs() <= tol).all()


@pytest.mark.parametrize("e2m1", [False, True])
def test_expert_projection_rows_take_the_amx_gemm(e2m1, monkeypatch):
    """quant/experts.tiled_int4_dequantized (an int4 / mxfp4 expert's prompt rows past its kernel's): the AMX GEMM
    within AMX_ROWS, the same products as the dequantized weight's oneDNN GEMM within fp32 summation order."""
    from tiered.quant.experts import tiled_int4_dequantized

    g = torch.Generator().manual_seed(9)
    codes, _, res = _weight(64, 128, g, True, not e2m1)
    v = {"gw": codes} if res is None else {"gw": codes, "zr": res}
    calls = []
    real = int4.amx_kernels
    monkeypatch.setattr(int4, "amx_kernels", lambda: calls.append(1) or real())
    x = torch.randn(37, 128, generator=g)
    got = tiled_int4_dequantized(x, x.to(torch.bfloat16), v, e2m1)
    assert calls and got.dtype == torch.float32 and got.shape == (37, 64)
    with int4.without_amx():
        onednn = tiled_int4_dequantized(x, x.to(torch.bfloat16), v, e2m1)
    w = ext.int4_tiled_dequantize(codes, None, res, fp32=False, e2m1=e2m1).double()
    tol = 2 ** -8 * onednn.double().abs() + 1e-4 * (x.to(torch.bfloat16).double().abs() @ w.abs().t())
    assert ((got.double() - onednn.double()).abs() <= tol).all()


@pytest.mark.parametrize("groups", [True, False])
def test_a_tiled_int8_weight_takes_the_amx_gemm_in_the_steps_calls_from_24_rows(groups):
    """Int8Gemv::run_step (the native step's calls: a Q8_0 / Q6_K head over a batch's rows) runs the AMX GEMM from
    quant/int4.STEP_AMX_ROWS rows over a tiled int8 weight, int8-g32 (an fp16 scale a row and group of 32) or one
    scale a row: the rows and the weights (u - 128) s rounded to bf16, products summed in fp32, a bias added (checked
    against that product: fails if a tile's columns, rows or scales are misplaced); below it, and through `run` (the
    kernel's __call__: every other caller) at any rows, the int8-row kernels, whose bits differ."""
    from tiered.kernels.linear import tiled_group_scales, tiled_int8

    STEP_AMX_ROWS = int4.STEP_AMX_ROWS
    g = torch.Generator().manual_seed(3)
    N, K = 160, 96
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    bias = torch.randn(N, generator=g)
    if groups:
        sc = (torch.rand(N, K // 32, generator=g) * 0.01 + 0.001).half()
        k = ext.int8g32_tiled_kernel(tiled_int8(q), tiled_group_scales(sc), bias, "q8")
        w = (q.float().reshape(N, K // 32, 32) * sc.float().unsqueeze(-1)).reshape(N, K)
    else:
        sc = torch.rand(N, generator=g) * 0.01 + 0.001
        k = ext.int8_tiled_kernel(tiled_int8(q), sc, bias, "q8")
        w = q.float() * sc.unsqueeze(1)
    for M in (STEP_AMX_ROWS, 41):
        x = torch.randn(M, K, generator=g)
        ref = x.bfloat16().float() @ w.bfloat16().float().T + bias
        got = k.step(x)
        assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-5, M
        assert not torch.equal(got, k(x))
    x = torch.randn(STEP_AMX_ROWS - 1, K, generator=g)
    assert torch.equal(k.step(x), k(x))


def test_native_step_rows_take_the_amx_gemm_from_24_rows(zoo, monkeypatch):
    """The native decode step's int4 projections over 24+ rows (quant/int4.STEP_AMX_ROWS, csrc kAmxStepRows: a batch's
    sequences, a prompt's rows: here a prompt as rows) run the AMX GEMM on bf16-rounded rows (Int4TGemv::run_step),
    fewer rows the q8 row kernels: the AMX rows' logits differ from the q8 kernels' (another rounding of the
    activations) and stay as close to the modules' fp32 prompt as the q8 rows; 23 rows are the q8 kernels' whatever
    amx_rows says. Fails if the step stops calling run_step, or the threshold moves. The modules' prompt multiplies
    the int4 weights dequantized to fp32 (dequantize_rows and dequantize_dtype pinned): by the kernel tuning it would
    run the q8 kernels or the AMX GEMM itself, and the reference was then one of the two compared (the q8 rows' 0.006
    and the AMX rows' 0.031 on a build without a tuning, 0.031 and 0.010 with one)."""
    from tiered import LLM, EngineConfig
    from tiered.quant import int4
    from tiered.runtime.cpu_decode import CPUDecodeStep

    monkeypatch.setattr(int4, "dequantize_rows", lambda *a, **k: 1)
    monkeypatch.setattr(int4, "dequantize_dtype", lambda: torch.float32)
    llm = LLM(zoo.dir("llama"), EngineConfig(decode_weights="int4", max_context=128, accelerator="none"))
    step = CPUDecodeStep(llm.model, native=True)
    V = llm.config.vocab_size

    def rows(n: int, amx: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ids = [(i * 37 + 11) % (V - 3) + 3 for i in range(n)]
        was = ext.amx_rows(amx)
        try:
            with torch.inference_mode():
                cache = llm._kv_cache(1, 128)
                got = step(torch.tensor(ids).unsqueeze(1), torch.arange(n).unsqueeze(1), torch.zeros(n, dtype=torch.long),
                           cache, rows=torch.tensor([n - 1])).float()
                ref = llm.model(torch.tensor([ids]), torch.arange(n).unsqueeze(0), torch.tensor([0]),
                                llm._kv_cache(1, 128)).float().reshape(-1, V)[-1:]
        finally:
            ext.amx_rows(was)
        return got, ref

    STEP_AMX_ROWS = int4.STEP_AMX_ROWS
    assert STEP_AMX_ROWS == 24
    q8, ref = rows(STEP_AMX_ROWS, False)
    amx, _ = rows(STEP_AMX_ROWS, True)
    assert not torch.equal(q8, amx)
    err = lambda got: float((got - ref).abs().max() / ref.abs().max())  # noqa: E731
    assert err(amx) <= max(2 * err(q8), 1e-2)
    assert torch.equal(rows(STEP_AMX_ROWS - 1, True)[0], rows(STEP_AMX_ROWS - 1, False)[0])


@pytest.mark.parametrize("experts", ["int4", "int8"])
def test_native_step_moe_rows_take_the_amx_gemm_from_group_rows(rt, experts):  # noqa: F811
    """A MoE prompt as rows of the native step whose experts average ExpertFormat.group_rows rows or more (past
    which the modules' prefill computes an expert on the AMX GEMM) runs its int4 experts on the AMX GEMM
    (gemv.cpp's moe_experts_amx, DecodeStep.set_moe's amx_rows): its logits differ from the row kernels' (amx_rows
    off) and stay as close to the modules' prefill as theirs; a prompt whose experts average fewer rows runs the
    row kernels whatever amx_rows says, and so do experts whose kernels have no AMX path (int8) at any rows. Fails
    if the step's MoE blocks stop passing amx_rows or the rule moves."""
    import math

    from tiered import LLM
    from tiered.models.moe import MoEBlock
    from tiered.runtime.cpu_decode import CPUDecodeStep

    llm = LLM(rt.dir("qwen3_moe"), engine_config(dtype="float32", expert_weights=experts, decode_weights="fp32",
                                                 accelerator="none", max_context=512))
    step = CPUDecodeStep(llm.model, native=True)
    assert step.moe_blocks
    runner = next(m.runner for m in llm.model.modules() if isinstance(m, MoEBlock))
    cfg, rows = llm.config, runner.fmt.group_rows
    V = cfg.vocab_size

    def logits(n: int, amx: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ids = [(i * 37 + 11) % (V - 3) + 3 for i in range(n)]
        was = ext.amx_rows(amx)
        try:
            with torch.inference_mode():
                got = step(torch.tensor(ids).unsqueeze(1), torch.arange(n).unsqueeze(1), torch.zeros(n, dtype=torch.long),
                           llm._kv_cache(1, 512), rows=torch.tensor([n - 1])).float()
                ref = llm.model(torch.tensor([ids]), torch.arange(n).unsqueeze(0), torch.tensor([0]),
                                llm._kv_cache(1, 512)).float().reshape(-1, V)[-1:]
        finally:
            ext.amx_rows(was)
        return got, ref

    if experts == "int8":  # tiled int8 kernels: the row kernels at 48 rows an expert, amx_rows or not
        n = 48 * cfg.num_experts // cfg.num_experts_per_tok
        assert torch.equal(logits(n, True)[0], logits(n, False)[0])
        return
    if rows * cfg.num_experts / cfg.num_experts_per_tok > 400:
        pytest.skip(f"experts here take the AMX GEMM from {rows} rows: a prompt past max_context")
    n = math.ceil(rows * cfg.num_experts / cfg.num_experts_per_tok) + 8  # the average past group_rows
    q8, ref = logits(n, False)
    amx, _ = logits(n, True)
    assert not torch.equal(q8, amx)
    err = lambda got: float((got - ref).abs().max() / ref.abs().max())  # noqa: E731
    assert err(amx) <= max(2 * err(q8), 1e-2)
    fewer = rows * cfg.num_experts // cfg.num_experts_per_tok - 8
    assert torch.equal(logits(fewer, True)[0], logits(fewer, False)[0])
