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
from tiered.models.layers import KVCache, dequantize_kv_rows, kv_row_bytes, quantize_kv_rows
from tiered.runtime.cpu_decode import CPUDecodeStep

NATIVE = [False, pytest.param(True, marks=pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built"))]


def test_rows_round_trip_within_half_a_step_and_carry_their_scales():
    """quantize_kv_rows: |x - q s| <= s / 2 with s = max|x| / 127 over each block of 32 values; a row's last
    bytes are its blocks' fp32 scales; a zero block is zeros with scale 0; each block's largest value maps to
    +-127; a head size that 32 does not divide takes one block a row."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 64) * torch.tensor([0.01, 1.0, 30.0]).view(3, 1, 1)
    x[1, 2, :32] = 0
    rows = quantize_kv_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (3, 5, 72) and kv_row_bytes(64) == 72
    s = rows[..., 64:].contiguous().view(torch.float32)  # [3, 5, 2]
    assert torch.equal(s, x.unflatten(-1, (2, 32)).abs().amax(-1) / 127)
    back = dequantize_kv_rows(rows, torch.float32, 64)
    assert bool(((back - x).abs() <= s.repeat_interleave(32, -1) / 2 * (1 + 1e-6)).all())
    assert float(s[1, 2, 0]) == 0 and not bool(rows[1, 2, :32].any()) and float(s[1, 2, 1]) > 0
    assert bool((rows[..., :64].unflatten(-1, (2, 32)).abs().amax(-1) == 127)[s > 0].all())
    assert dequantize_kv_rows(rows, torch.bfloat16, 64).dtype == torch.bfloat16
    odd = torch.randn(4, 48)
    assert kv_row_bytes(48) == 52 and quantize_kv_rows(odd).shape == (4, 52)
    assert float((dequantize_kv_rows(quantize_kv_rows(odd), torch.float32, 48) - odd).abs().max()) <= (
        float(odd.abs().max()) / 254 * 1.01)


def test_bytes_count_the_scales_and_latent_attention_is_refused(zoo):
    """kv_bytes_per_token: Hkv (2 hd + 8) bytes for int8 (a scale a row of the tiny Llama's 16 values), against
    2 Hkv hd x 2 for bf16; the KVCache allocates exactly that; latent attention refuses int8 with a clear error."""
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


def _close_rows(a: torch.Tensor, b: torch.Tensor, hd: int, bf16: bool = False) -> None:
    """Two int8 caches hold nearly the same bytes and values: in fp32 within one quantization step of each block
    (the paths' fp32 sums before quantizing can fall either side of a rounding boundary), 99% of the int8
    values equal; in bf16 the keys themselves differ by the paths' bf16 roundings (up to 5e-2 of the cache's
    largest value: llama_wide's bf16 step drifts ~2% from its modules over a bf16 cache too), 90% equal."""
    da, db = dequantize_kv_rows(a, torch.float32, hd), dequantize_kv_rows(b, torch.float32, hd)
    ones = b.clone()
    ones[..., :hd] = 1
    step = dequantize_kv_rows(ones, torch.float32, hd)  # each value's block scale
    tol = 5e-2 * float(db.abs().max()) if bf16 else step * 1.01 + 1e-6
    assert bool(((da - db).abs() <= tol).all())
    values = a[..., :hd] == b[..., :hd]  # (a scale's last bit moves with its block's largest value's)
    assert float(values.float().mean()) >= (0.9 if bf16 else 0.99)


@pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")
@pytest.mark.parametrize("kind", ["llama", "qwen3", "llama_gqa7", "mistral", "llama_wide"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_step_over_an_int8_cache_matches_the_modules(zoo, kind, dtype):
    """A batch of sequences of different lengths decoding over an int8 cache: the native step writes the rows
    the modules write (quantize_row = quantize_kv_rows) and its attention over them gives the modules'
    logits (fp32: to fp32 rounding; bf16: the modules round the dequantized rows to bf16). Heads of 16 values
    (one block, read through fp32 scratch), 32 (the 8-wide vector loops) and 64 (two blocks a row, 16 wide on
    AVX-512)."""
    llm = zoo.llm(zoo.dir(kind), dtype=dtype, max_context=64, accelerator="none")
    step = CPUDecodeStep(llm.model, native=True)
    prompts = [prompt_ids(zoo.vocab_size, 21), prompt_ids(zoo.vocab_size, 9, seed=3)]
    caches = [KVCache(llm.config, 2, 40, torch.int8) for _ in range(2)]
    assert step.native_cache(caches[0]) and step.takes_prefill_rows(caches[0])
    # bf16: the native step and the modules drift ~2% apart over a bf16 cache already (llama_wide 2.2%, qwen3
    # 1.9% in 6 steps), and the modules round the dequantized rows to bf16 where the step keeps them in fp32
    tol = 1e-4 if dtype == "float32" else 5e-2
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
    _close_rows(caches[0].k, caches[1].k, llm.config.head_dim, dtype == "bfloat16")
    _close_rows(caches[0].v, caches[1].v, llm.config.head_dim, dtype == "bfloat16")


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
            _close_rows(caches[0].k, caches[1].k, llm.config.head_dim)
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
    hd = llm.config.head_dim  # (hd + 4) bytes a row (16 values: one block) against bf16's 2 hd
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
    bf16, int8 = 3 * 2 * 64 * 1024 * 2, 3 * 2 * 72 * 1024  # a layer's keys and values at 1024 positions
    proj = _attention(cfg, old, "int4", 1024, kv_format="bf16") - bf16 / 14e9
    assert _attention(cfg, old, "int4", 1024, kv_format="int8") == pytest.approx(proj + bf16 / 14e9)
    assert _attention(cfg, new, "int4", 1024, kv_format="int8") == pytest.approx(proj + int8 / 10e9)
    gpu = HardwareProfile("gpu", "test", {"gemm/gpu/bf16": LinearModel(0.0, 1e-15, 0.99),
                                          "memory/bandwidth/gpu": LinearModel(0.0, 1 / 1e12, 0.99),
                                          "attn/gpu/bf16": LinearModel(0.0, 1e-15, 0.99)})
    base = attention_time(cfg, gpu, "gpu", "bf16", 1, 1024, "bf16") - bf16 / 1e12
    assert attention_time(cfg, gpu, "gpu", "bf16", 1, 1024, "int8") == pytest.approx(base + (int8 + 2 * bf16) / 1e12)


@pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 128), (12, 3, 64), (5, 1, 96)])
def test_native_decode_over_a_long_int8_cache_for_wide_heads(heads, kv_heads, head_dim):
    """Heads of 128 (four blocks a row), 64 and 96 (three) over 300 random cached positions (split between the
    threads, keys 8 at a time then one by one): the native step's logits equal the modules' over the same int8
    cache to fp32 rounding, and a cache whose older values are flipped moves them well beyond that."""
    from tiered.checkpoint.model_config import ModelConfig
    from tiered.models import build_model

    torch.manual_seed(0)
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    cached = 301
    model = build_model(cfg, cached + 1).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.1)
    caches = [KVCache(cfg, 1, cached + 1, torch.int8) for _ in range(3)]
    for t in ("k", "v"):
        rows = quantize_kv_rows(torch.randn(*getattr(caches[0], t).shape[:-1], head_dim))
        for c in caches:
            getattr(c, t).copy_(rows)
    flipped = quantize_kv_rows(-torch.randn(2, 1, kv_heads, cached // 2, head_dim))
    caches[2].v[:, :, :, : cached // 2].copy_(flipped)
    ids, pos, slot = torch.tensor([[5]]), torch.tensor([[cached]]), torch.tensor([0])
    with torch.inference_mode():
        native = CPUDecodeStep(model, native=True)(ids, pos, slot, caches[0]).float()
        ref = model(ids, pos, slot, caches[1]).float()
        moved = model(ids, pos, slot, caches[2]).float()
    scale = float(ref.abs().max())
    assert float((native - ref).abs().max()) <= 2e-5 * scale
    assert float((moved - ref).abs().max()) >= 1e-2 * scale


def test_an_int8_cache_on_the_accelerator_stand_in_with_and_without_graphs(zoo):
    """The device path (the host stand-in, strict about devices as CUDA is): the int8 cache lives on the device,
    accounted against its budget, the modules quantize and dequantize it there, and a graphed decode step
    (--graphs on: static metadata, KV written by index) gives the eager step's tokens."""
    from tiered.engine.sampling import SamplingParams

    ids = prompt_ids(zoo.vocab_size, 12)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = {}
    for graphs in ("off", "on"):
        llm = LLM(zoo.dir("llama"), EngineConfig(accelerator="host", gpu_memory="64MiB", kv_cache_dtype="int8",
                                                 max_context=64, decode_weights="fp32", graphs=graphs))
        assert llm.plan.dtypes["kv_cache"] == "int8" and (llm.runtime.graphs is not None) == (graphs == "on")
        used = llm.fast_budget.used
        cache = llm._kv_cache(2, 16)
        assert cache.k.dtype == torch.int8 and cache.k.device == llm.device
        assert llm.fast_budget.used - used == cache.nbytes == sizes.kv_cache_bytes(llm.config, 2, 16, "int8")
        del cache
        out[graphs] = llm.generate([ids], greedy)[0].token_ids
    assert out["on"] == out["off"] and len(out["on"]) == 6
