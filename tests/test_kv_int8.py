"""The int8 KV cache (EngineConfig.kv_cache_dtype "int8", Plan.dtypes["kv_cache"]).

Each (position, KV head) row holds head_dim int8 values and its fp32 scale (models/layers.quantize_kv_rows). The
native decode step writes rows with the same bits as the modules' KVCache.update and attends over them as the
modules do over the dequantized rows (decode rows, a prompt's rows together, split between threads); whole rows
move with their scales (beam search, shared prefixes); the plan and the budget count the cache's bytes; the
outputs stay close to a 16-bit cache's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fixtures import prompt_ids

from tiered import LLM, EngineConfig, kernels
from tiered.engine.llm import dense_weights
from tiered.errors import ConfigError
from tiered.memory import sizes
from tiered.models.layers import KVCache, dequantize_kv_rows, quantize_kv_rows
from tiered.runtime.cpu_decode import CPUDecodeStep

NATIVE = [False, pytest.param(True, marks=pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built"))]


def test_rows_round_trip_within_half_a_step_and_carry_their_scale():
    """quantize_kv_rows: |x - q s| <= s / 2 with s = max|x| / 127 a row; the row's last 4 bytes are s's fp32
    bits; a zero row is zeros with scale 0; the largest value maps to +-127."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 64) * torch.tensor([0.01, 1.0, 30.0]).view(3, 1, 1)
    x[1, 2] = 0
    rows = quantize_kv_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (3, 5, 68)
    s = rows[..., 64:].contiguous().view(torch.float32)
    assert torch.equal(s, x.abs().amax(-1, keepdim=True) / 127)
    back = dequantize_kv_rows(rows, torch.float32)
    assert bool(((back - x).abs() <= s / 2 * (1 + 1e-6)).all())
    assert float(s[1, 2]) == 0 and not bool(rows[1, 2].any())
    assert int(rows[..., :64].abs().amax()) == 127
    assert dequantize_kv_rows(rows, torch.bfloat16).dtype == torch.bfloat16


def test_bytes_count_the_scales_and_latent_attention_is_refused(zoo):
    """kv_bytes_per_token: Hkv (2 hd + 8) bytes for int8 (scales included), against 2 Hkv hd x 2 for bf16; the
    KVCache allocates exactly that; latent attention refuses int8 with a clear error."""
    llm = zoo.llm(zoo.dir("llama"), dtype="float32", max_context=64, accelerator="none")
    cfg = llm.config
    hkv, hd = cfg.num_key_value_heads, cfg.head_dim
    assert sizes.kv_bytes_per_token(cfg, "int8") == hkv * (2 * hd + 8)
    assert sizes.kv_bytes_per_token(cfg, "bf16") == hkv * 2 * hd * 2
    cache = KVCache(cfg, 3, 10, torch.int8)
    assert cache.quantized and cache.nbytes == sizes.kv_cache_bytes(cfg, 3, 10, "int8")
    with pytest.raises(ConfigError, match="unknown KV cache format"):
        sizes.kv_bytes_per_token(cfg, "int4")
    mla = dataclasses.replace(cfg, kv_lora_rank=32, num_key_value_heads=1)  # latent attention's cache: one shared row a position
    assert mla.is_mla
    with pytest.raises(ConfigError, match="latent attention"):
        KVCache(mla, 1, 4, torch.int8)
    with pytest.raises(ConfigError, match="latent attention"):
        sizes.kv_cache_bytes(mla, 1, 4, "int8")


def _prefill(model, cache, prompts):
    with dense_weights(model):
        for slot, ids in enumerate(prompts):
            model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), torch.tensor([slot]), cache)


def _close_rows(a: torch.Tensor, b: torch.Tensor, bf16: bool = False) -> None:
    """Two int8 caches hold nearly the same bytes and values: in fp32 within one quantization step of each row
    (the paths' fp32 sums before quantizing can fall either side of a rounding boundary), 99% of the int8
    values equal; in bf16 the keys themselves differ by the paths' bf16 roundings (test_cpu_decode's 2e-2 of
    the cache's largest value), 90% of the values equal."""
    da, db = dequantize_kv_rows(a, torch.float32), dequantize_kv_rows(b, torch.float32)
    step = b[..., -4:].contiguous().view(torch.float32)
    tol = 2e-2 * float(db.abs().max()) if bf16 else step * 1.01 + 1e-6
    assert bool(((da - db).abs() <= tol).all())
    values = a[..., :-4] == b[..., :-4]  # (a scale's last bit moves with its row's largest value's)
    assert float(values.float().mean()) >= (0.9 if bf16 else 0.99)


@pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")
@pytest.mark.parametrize("kind", ["llama", "qwen3", "llama_gqa7", "mistral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_step_over_an_int8_cache_matches_the_modules(zoo, kind, dtype):
    """A batch of sequences of different lengths decoding over an int8 cache: the native step writes the rows
    the modules write (quantize_row = quantize_kv_rows) and its attention over them gives the modules'
    logits (fp32: to fp32 rounding; bf16: the modules round the dequantized rows to bf16)."""
    llm = zoo.llm(zoo.dir(kind), dtype=dtype, max_context=64, accelerator="none")
    step = CPUDecodeStep(llm.model, native=True)
    prompts = [prompt_ids(zoo.vocab_size, 21), prompt_ids(zoo.vocab_size, 9, seed=3)]
    caches = [KVCache(llm.config, 2, 40, torch.int8) for _ in range(2)]
    assert step.native_cache(caches[0]) and step.takes_prefill_rows(caches[0])
    tol = 1e-4 if dtype == "float32" else 3e-2
    with torch.inference_mode():
        for c in caches:
            _prefill(llm.model, c, prompts)
        g = torch.Generator().manual_seed(1)
        for t in range(6):
            ids = torch.randint(2, llm.config.vocab_size, (2, 1), generator=g)
            pos = torch.tensor([[len(p) + t] for p in prompts])
            native = step(ids, pos, torch.arange(2), caches[0]).float()
            ref = llm.model(ids, pos, torch.arange(2), caches[1]).float()
            assert float((native - ref).abs().max()) <= tol * float(ref.abs().max())
    _close_rows(caches[0].k, caches[1].k, dtype == "bfloat16")
    _close_rows(caches[0].v, caches[1].v, dtype == "bfloat16")


@pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")
@pytest.mark.parametrize("threads", [1, 2])
def test_native_prompt_rows_and_long_contexts_over_an_int8_cache(zoo, threads):
    """A prompt's rows in one native step (attention_runs: keys dequantized as transposed, values into their
    own buffer) and decode rows over 200 cached positions (parts split between threads): the modules' logits."""
    llm = zoo.llm(zoo.dir("llama"), dtype="float32", max_context=256, accelerator="none")
    step = CPUDecodeStep(llm.model, native=True)
    n = 200
    ids = prompt_ids(zoo.vocab_size, n)
    caches = [KVCache(llm.config, 1, n + 4, torch.int8) for _ in range(2)]
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            rows = step(torch.tensor(ids).unsqueeze(1), torch.arange(n).unsqueeze(1), torch.zeros(n, dtype=torch.long),
                        caches[0], rows=torch.tensor([n - 1])).float()
            with dense_weights(llm.model):
                ref = llm.model(torch.tensor([ids]), torch.arange(n).unsqueeze(0), torch.tensor([0]),
                                caches[1]).float()  # the last position's [1, V]
            assert rows.shape == ref.shape
            assert float((rows - ref).abs().max()) <= 1e-4 * float(ref.abs().max())
            _close_rows(caches[0].k, caches[1].k)
            for t in range(3):
                x, p = torch.tensor([[7 + t]]), torch.tensor([[n + t]])
                a = step(x, p, torch.tensor([0]), caches[0]).float()
                b = llm.model(x, p, torch.tensor([0]), caches[1]).float()
                assert float((a - b).abs().max()) <= 1e-4 * float(b.abs().max())
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("native", NATIVE)
def test_an_int8_cache_stays_close_to_a_16_bit_one(zoo, native):
    """Teacher-forced logits over an int8 cache against an fp32 one on the tiny Llama: the KL stays small
    (a key's or value's error at most half a step of its row's scale) but is not zero (the cache is read)."""
    from tiered.eval import kl_divergence

    llm = zoo.llm(zoo.dir("llama"), dtype="float32", max_context=64, accelerator="none")
    step = CPUDecodeStep(llm.model, native=native)
    ids = prompt_ids(zoo.vocab_size, 40)
    out = {}
    with torch.inference_mode():
        for kv in (torch.float32, torch.int8):
            cache = KVCache(llm.config, 1, 48, kv)
            _prefill(llm.model, cache, [ids[:8]])
            out[kv] = torch.cat([step(torch.tensor([[t]]), torch.tensor([[8 + i]]), torch.tensor([0]), cache)
                                 for i, t in enumerate(ids[8:])])
    kl = float(kl_divergence(out[torch.float32], out[torch.int8]).mean())
    assert 0 < kl < 1e-3


def test_the_engine_plans_counts_and_generates_with_an_int8_cache(zoo):
    """EngineConfig(kv_cache_dtype="int8"): the plan's KV format, a cache of int8 rows accounted at its bytes
    against the budget, greedy generation close to the 16-bit cache's (its first tokens the same), and whole
    rows copied with their scales where sequences share KV (n choices of one prompt: the same greedy text)."""
    from tiered.engine.sampling import SamplingParams

    base = dict(dtype="float32", decode_weights="int4", max_context=64, accelerator="none")
    ref = LLM(zoo.dir("llama"), EngineConfig(**base))
    llm = LLM(zoo.dir("llama"), EngineConfig(kv_cache_dtype="int8", **base))
    assert ref.plan.dtypes["kv_cache"] == "bf16" and llm.plan.dtypes["kv_cache"] == "int8"
    used = llm.fast_budget.used
    cache = llm._cache_for(2, 32)
    assert cache.k.dtype == torch.int8 and llm.fast_budget.used - used == cache.nbytes
    hd = llm.config.head_dim  # (hd + 4) bytes a row against bf16's 2 hd
    assert cache.nbytes * 2 * hd == sizes.kv_cache_bytes(llm.config, 2, 32, "bf16") * (hd + 4)
    del cache
    ids = prompt_ids(zoo.vocab_size, 12)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = llm.generate([ids], greedy)[0].token_ids
    b = ref.generate([ids], greedy)[0].token_ids
    assert a[:2] == b[:2]
    twins = llm.generate([ids, ids, ids], greedy)
    assert all(o.token_ids == a for o in twins)


def test_an_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")


def test_the_plan_prices_an_int8_cache_at_its_bytes():
    """The native step's attention over an int8 cache is priced at attn_decode/cpu/int8 a byte where profiled
    (its rows' bytes, scales included), and at the bf16 cache's rate a value where a profile predates it; the
    memory's rate bounds both; the GPU's modules dequantize the cache (int8 read, bf16 written and read again)."""
    from tiered.checkpoint.model_config import ModelConfig
    from tiered.hardware.profile import HardwareProfile, LinearModel
    from tiered.planner.common import attention_time
    from tiered.planner.cpu_predict import _attention

    cfg = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    models = {"gemv/cpu/bf16": LinearModel(0.0, 1 / 40e9, 0.99), "memory/bandwidth/cpu": LinearModel(0.0, 1 / 40e9, 0.99),
              "attn_decode/cpu/bf16": LinearModel(0.0, 1 / 14e9, 0.99)}
    meta = {"native_kernels": True}
    old = HardwareProfile("box", "test", dict(models), meta=meta)
    new = HardwareProfile("box", "test", dict(models, **{"attn_decode/cpu/int8": LinearModel(0.0, 1 / 10e9, 0.99)}),
                          meta=meta)
    bf16, int8 = 3 * 2 * 64 * 1024 * 2, 3 * 2 * 68 * 1024  # a layer's keys and values at 1024 positions
    proj = _attention(cfg, old, "int4", 1024, kv_format="bf16") - bf16 / 14e9
    assert _attention(cfg, old, "int4", 1024, kv_format="int8") == pytest.approx(proj + bf16 / 14e9)
    assert _attention(cfg, new, "int4", 1024, kv_format="int8") == pytest.approx(proj + int8 / 10e9)
    gpu = HardwareProfile("gpu", "test", {"gemm/gpu/bf16": LinearModel(0.0, 1e-15, 0.99),
                                          "memory/bandwidth/gpu": LinearModel(0.0, 1 / 1e12, 0.99),
                                          "attn/gpu/bf16": LinearModel(0.0, 1e-15, 0.99)})
    base = attention_time(cfg, gpu, "gpu", "bf16", 1, 1024, "bf16") - bf16 / 1e12
    assert attention_time(cfg, gpu, "gpu", "bf16", 1, 1024, "int8") == pytest.approx(base + (int8 + 2 * bf16) / 1e12)
