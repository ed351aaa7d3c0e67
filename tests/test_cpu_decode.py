"""The lean CPU decode step (runtime/cpu_decode.py) against the model's own modules.

In the lossless fp32 mode it must give the modules' logits and KV cache to fp32 rounding, for every
dense architecture (q/k/v bias, sliding window, tied embeddings, Qwen3's per-head q/k norms) and
for MoE blocks through the FFN fallback, at batch 1 and for a batch of
sequences of different lengths (the masked path). With int4 decode copies it runs the same kernels:
only the bf16 rounding of activations between kernels differs. And it issues few ops per layer.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fixtures import prompt_ids
from runtime_fixtures import engine_config, rt  # noqa: F401

from tiered import LLM
from tiered.engine.llm import dense_weights
from tiered.eval import kl_divergence
from tiered import kernels
from tiered.runtime.cpu_decode import CPUDecodeStep

NATIVE = [False, pytest.param(True, marks=pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built"))]
# the lean step is the CPU-only engine's decode path (Plan.cpu_decode_step): every engine here has no
# accelerator, also on a CUDA machine
DENSE = ["llama", "llama_tied", "llama_attn_bias", "mistral", "qwen2", "qwen3"]


def _prefill(llm, cache, prompts: list[list[int]]) -> None:
    """Each prompt through the modules into its slot of `cache`, its attention torch's SDPA (quant/int4.without_amx: not
    tiered's bf16 kernels, whose rounding of a bf16 model's prompt moved the states these tests decode from: qwen3's
    lean step then differed from the modules by 0.0204 of the 0.02 its test allows, 0.0156 before)."""
    from tiered.quant.int4 import without_amx

    with dense_weights(llm.model), without_amx():
        for slot, ids in enumerate(prompts):
            llm.model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), torch.tensor([slot]), cache)


def _compare(llm, prompts: list[list[int]], steps: int, tol: float, native: bool = False,
             kv: str | None = None) -> float:
    """Decode `steps` tokens for every prompt at once through the lean step (torch ops, or the native
    C++ step) and through the modules, each over its own cache (in format `kv`, default the plan's);
    returns the largest relative logits difference (asserting caches match)."""
    step = CPUDecodeStep(llm.model, native=native)
    lengths = [len(p) for p in prompts]
    caches = [llm._kv_cache(len(prompts), max(lengths) + steps, kv) for _ in range(2)]
    worst = 0.0
    with torch.inference_mode():
        for c in caches:
            _prefill(llm, c, prompts)
        g = torch.Generator().manual_seed(1)
        for t in range(steps):
            ids = torch.randint(2, llm.config.vocab_size, (len(prompts), 1), generator=g)
            pos = torch.tensor([[n + t] for n in lengths])
            slots = torch.arange(len(prompts))
            lean = step(ids, pos, slots, caches[0]).float()
            ref = llm.model(ids, pos, slots, caches[1]).float()
            worst = max(worst, float((lean - ref).abs().max() / ref.abs().max()))
    for a, b in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
        assert float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()))
    return worst


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("kind", DENSE)
def test_lean_step_equals_modules_fp32(zoo, kind, native):
    llm = zoo.llm(zoo.dir(kind), dtype="float32", max_context=64, accelerator="none")
    ids = prompt_ids(zoo.vocab_size, 12)
    assert _compare(llm, [ids], steps=12, tol=1e-5, native=native) <= 1e-5  # batch 1: the in-place KV write
    # two sequences of different lengths: the masked path (past mistral's window of 8 too)
    assert _compare(llm, [ids, prompt_ids(zoo.vocab_size, 5, seed=3)], steps=6, tol=1e-5, native=native) <= 1e-5


@pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_attention_splits_long_contexts_between_threads(zoo, threads):
    """Past DecodeStep::kSplitKeys key rows (x KV heads, over the batch) the native step cuts the
    keys into one run a thread and merges the runs' partial softmaxes (split-K). Two sequences of
    150 and 40 prompt tokens: on 2 and 3 threads runs cut one sequence's keys, and hold parts of
    several (row, KV head) items; the logits and KV cache equal the modules' as on one thread."""
    llm = zoo.llm(zoo.dir("llama"), dtype="float32", max_context=256, accelerator="none")
    assert (150 + 40) * llm.config.num_key_value_heads >= 256  # DecodeStep::kSplitKeys
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        worst = _compare(llm, [prompt_ids(zoo.vocab_size, 150), prompt_ids(zoo.vocab_size, 40, seed=2)],
                         steps=3, tol=1e-5, native=True)
    finally:
        torch.set_num_threads(before)
    assert worst <= 1e-5


@pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")
@pytest.mark.parametrize("kv", ["fp32", "bf16"])
def test_native_attention_gives_a_row_the_same_bits_in_any_batch_on_any_thread_count(zoo, kv):
    """How the native step cuts a row's keys (split-K) depends on that row's keys alone: a row's
    logits are the same bits at any row of a batch, beside any other rows, on 1, 2 or 3 threads.
    Cut as one run a thread over the whole batch, the middle one of three equal rows differed from the
    others (three equal greedy prompts gave two texts) and a row changed with the thread count."""
    llm = zoo.llm(zoo.dir("llama"), dtype="float32", max_context=256, accelerator="none")
    step = CPUDecodeStep(llm.model, native=True)
    a, b = prompt_ids(zoo.vocab_size, 150), prompt_ids(zoo.vocab_size, 40, seed=2)

    def logits(prompts: list[list[int]], threads: int) -> torch.Tensor:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            cache = llm._kv_cache(len(prompts), 160, kv)
            with torch.inference_mode():
                _prefill(llm, cache, prompts)
                ids = torch.tensor([[p[-1]] for p in prompts])
                pos = torch.tensor([[len(p)] for p in prompts])
                return step(ids, pos, torch.arange(len(prompts)), cache).float()
        finally:
            torch.set_num_threads(before)

    alone = logits([a, a], 1)[0]  # two rows: the step's multi-row projections, as every batch below
    for threads in (1, 2, 3):
        for batch, rows in (([a, a, a], (0, 1, 2)), ([b, a, b, a], (1, 3)), ([a, b], (0,))):
            out = logits(batch, threads)
            for r in rows:
                assert torch.equal(out[r], alone), (threads, len(batch), r)


@pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")
@pytest.mark.parametrize("n", [8, 80])
def test_native_step_glue_gives_the_modules_rows_on_any_thread_count(zoo, n):
    """DecodeStep::each_row runs a step's glue (norms, RoPE, the KV write, SwiGLU) across the threads from
    parallel_rows() rows (4, and kParallelElems = 4608 residual elements: 72 rows of this D 64 model) and on the
    calling thread below it: a prompt of 8 (one thread) or 80 rows (row-parallel) through the step gives the
    modules' logits and KV cache, the same bits on 1, 2 and 3 threads."""
    llm = zoo.llm(zoo.dir("llama"), dtype="float32", max_context=128, accelerator="none")
    step = CPUDecodeStep(llm.model, native=True)
    prompt = prompt_ids(zoo.vocab_size, n, seed=5)
    ids, pos = torch.tensor(prompt).unsqueeze(1), torch.arange(n).unsqueeze(1)
    cache = llm._kv_cache(1, n, None)
    with torch.inference_mode():
        ref = llm.model(torch.tensor([prompt]), torch.arange(n).unsqueeze(0), torch.tensor([0]), cache).float()
    ref = ref.reshape(-1, ref.shape[-1])[-1:]
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            mine = llm._kv_cache(1, n, None)
            with torch.inference_mode():
                outs.append(step(ids, pos, torch.zeros(n, dtype=torch.long), mine, rows=torch.tensor([n - 1])).float())
            assert float((mine.k - cache.k).abs().max()) <= 1e-5 * max(1.0, float(cache.k.abs().max()))
    finally:
        torch.set_num_threads(before)
    assert float((outs[0] - ref).abs().max() / ref.abs().max()) <= 1e-5
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")
def test_a_moe_row_gets_the_same_bits_whatever_its_neighbours_route_to(rt):  # noqa: F811
    """expert_activations "bf16" (batch 1 on bf16 / int16 activations, batched steps on int8: Plan.batch_act):
    in a native MoE step of two or more tokens an int4 expert's rows read int8 activations however many
    of them the expert has (swiglu_group's format rows: the step's tokens), so a row's logits are the
    same bits beside rows routed to its experts or to others. An expert taking one row of the step read
    the batch-1 activations and one taking two int8, so a row's logits changed with its neighbours'
    routing. A step of one token keeps the batch-1 numerics."""
    llm = LLM(rt.dir("mixtral"), engine_config(expert_weights="int4", decode_weights="auto", accelerator="none",
                                               expert_activations="bf16"))  # q8 ("auto") reads int8 at every size
    step = CPUDecodeStep(llm.model, native=True)
    assert step.moe_blocks
    a = prompt_ids(llm.config.vocab_size, 9, seed=5)
    others = [prompt_ids(llm.config.vocab_size, 6 + i, seed=10 + i) for i in range(6)]

    def logits(prompts: list[list[int]]) -> torch.Tensor:
        cache = llm._kv_cache(len(prompts), 32)
        with torch.inference_mode():
            _prefill(llm, cache, prompts)
            ids = torch.tensor([[p[-1]] for p in prompts])
            pos = torch.tensor([[len(p)] for p in prompts])
            return step(ids, pos, torch.arange(len(prompts)), cache).float()

    alone = logits([a, a])[0]  # a with itself: every expert of a takes two rows
    for other in others:
        for batch, row in (([a, other], 0), ([other, a], 1), ([other, a, others[0]], 1)):
            assert torch.equal(logits(batch)[row], alone), (other, row)


@pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")
@pytest.mark.parametrize("kv", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["qwen3", "llama_wide", "llama_gqa7"])
def test_native_attention_vector_path_matches_the_modules(zoo, kind, kv):
    """head_dim 32 or 64 (qwen3, llama_gqa7; llama_wide): the native attention's vector loops, keys 8
    at a time then one by one (prompts of 21 and 13 tokens), keys scored and values weighed for
    query-head groups of 2 and of 7 (4 + 3), over an fp32 or a bf16 cache (its rows widened as even
    and odd columns, the queries split to match): the modules' logits and cache."""
    llm = zoo.llm(zoo.dir(kind), dtype="float32", max_context=64, accelerator="none")
    assert llm.config.head_dim % 32 == 0
    # bf16: a key's rounding can fall either side between the paths' fp32 sums (one bf16 step)
    tol, logits = (1e-5, 1e-5) if kv == "fp32" else (1e-2, 1e-3)
    assert _compare(llm, [prompt_ids(zoo.vocab_size, 21), prompt_ids(zoo.vocab_size, 13, seed=3)],
                    steps=5, tol=tol, native=True, kv=kv) <= logits


def _random_attention_model(heads: int, kv_heads: int, head_dim: int, window: int | None, slots: int, max_len: int,
                            cached: int, kv: torch.dtype):
    """A random 2-layer llama (attention-heavy: hidden 128, vocab 64; weights N(0, 0.1), norms 1) and three
    KV caches of `slots` x `max_len` in `kv` holding the same random cache, the third with the values of its
    first cached // 2 positions flipped (a result that reads them must move)."""
    from tiered.checkpoint.model_config import ModelConfig
    from tiered.models import build_model
    from tiered.models.layers import KVCache

    torch.manual_seed(0)
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      sliding_window=window)
    model = build_model(cfg, max_len).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.1)
    caches = [KVCache(cfg, slots, max_len, kv) for _ in range(3)]
    caches[0].k.normal_()
    caches[0].v.normal_()
    for c in caches[1:]:
        c.k.copy_(caches[0].k)
        c.v.copy_(caches[0].v)
    caches[2].v[:, :, :, : cached // 2].mul_(-1)
    return model, caches


@pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")
@pytest.mark.parametrize("heads,kv_heads,head_dim,cached", [
    (4, 4, 64, 45), (5, 1, 64, 300), (8, 1, 32, 45), (12, 3, 64, 45), (72, 1, 64, 300), (8, 2, 128, 45)])
def test_native_attention_over_a_bf16_cache_for_every_group(heads, kv_heads, head_dim, cached):
    """The native step's attention over a bf16 cache for query-head groups of 1, 5 (4 + 1), 8 (4 + 4), 3, 72
    (its split queries beyond the step's stack buffer) and 4 of 128: keys scored 8 at a time then one by
    one (45 = 5 x 8 + 5 cached positions), 300 split between the threads: the modules' logits to fp32
    rounding, on a random 2-layer model (attention-heavy: hidden 128) over a random cache whose values move
    the logits well beyond that tolerance."""
    model, caches = _random_attention_model(heads, kv_heads, head_dim, None, 1, cached + 1, cached, torch.bfloat16)
    ids, pos, slot = torch.tensor([[5]]), torch.tensor([[cached]]), torch.tensor([0])
    with torch.inference_mode():
        native = CPUDecodeStep(model, native=True)(ids, pos, slot, caches[0]).float()
        ref = model(ids, pos, slot, caches[1]).float()
        flipped = model(ids, pos, slot, caches[2]).float()
    scale = float(ref.abs().max())
    assert float((native - ref).abs().max()) <= 2e-5 * scale
    assert float((flipped - ref).abs().max()) >= 1e-2 * scale


@pytest.mark.parametrize("native", NATIVE)
def test_a_bf16_kv_cache_beside_fp32_activations(zoo, native):
    """Lossy decode copies keep a bf16 KV cache (the plan's dtypes["kv_cache"], memory/sizes.
    kv_cache_format) beside fp32 activations: the lean and native steps read and write it as the
    modules do (keys and values rounded to bf16 as written), and prompt rows still join the native
    step over it; the engine's caches and its budget follow the plan, and the lossless mode keeps fp32."""
    from tiered import EngineConfig
    from tiered.memory import sizes

    lossless = zoo.llm(zoo.dir("llama"), dtype="float32", max_context=64, accelerator="none")
    assert lossless.plan.dtypes["kv_cache"] == "fp32" and lossless._cache_for(1, 8).k.dtype == torch.float32
    # bf16's rounding of a key can fall either side between the two paths' fp32 sums: one bf16 step
    assert _compare(lossless, [prompt_ids(zoo.vocab_size, 12), prompt_ids(zoo.vocab_size, 5, seed=3)],
                    steps=6, tol=1e-2, native=native, kv="bf16") <= 1e-3
    if native:
        assert CPUDecodeStep(lossless.model, native=True).takes_prefill_rows(lossless._kv_cache(1, 8, "bf16"))
    # dtype float32 keeps the dense weights beside the int4 decode copies (Plan.dense_copies)
    lossy = LLM(zoo.dir("llama"), EngineConfig(decode_weights="int4", dtype="float32", max_context=64,
                                               accelerator="none"))
    assert lossy.plan.dtypes["kv_cache"] == "bf16" and lossy.plan.dense_copies
    used = lossy.fast_budget.used
    cache = lossy._cache_for(2, 32)
    assert cache.k.dtype == cache.v.dtype == torch.bfloat16
    assert lossy.fast_budget.used - used == cache.nbytes == sizes.kv_cache_bytes(lossy.config, 2, 32, "bf16")
    # scoring with the dense weights keeps its cache in the compute dtype (eval's lossless reference)
    ids = prompt_ids(zoo.vocab_size, 16)
    assert torch.equal(lossy.logits(ids), lossless.logits(ids))


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_lean_step_in_bf16_matches_the_modules(zoo, native, kind):
    """A bf16 model (--dtype bfloat16): RoPE's fp32 tables must not leak fp32 into attention; qwen3's
    per-head q/k norms round as the module's do (DecodeStep.set_qk)."""
    llm = zoo.llm(zoo.dir(kind), dtype="bfloat16", max_context=64, accelerator="none")
    if native:
        assert CPUDecodeStep(llm.model, native=True).schedule == [("native", 0, llm.config.num_hidden_layers)]
    assert _compare(llm, [prompt_ids(zoo.vocab_size, 10), prompt_ids(zoo.vocab_size, 4, seed=2)],
                    steps=4, tol=2e-2, native=native) <= 2e-2


@pytest.mark.parametrize("native", NATIVE)
def test_lean_step_runs_moe_blocks_through_their_ffn(rt, native):  # noqa: F811
    llm = LLM(rt.dir("mixtral"), engine_config(accelerator="none"))
    step = CPUDecodeStep(llm.model, native=native)
    assert all(L.ffn is not None for L, _ in step.layers)  # the MoE block is the layer's FFN
    if native:
        assert [s[0] for s in step.schedule] == ["attn"] * len(step.layers)
    assert _compare(llm, [list(range(2, 14))], steps=4, tol=1e-5, native=native) <= 1e-5


@pytest.mark.parametrize("native", NATIVE)
def test_lean_step_with_int4_copies_matches_the_modules(zoo, native):
    llm = LLM(zoo.dir("llama"), __import__("tiered").EngineConfig(decode_weights="int4", max_context=64, accelerator="none"))
    step = CPUDecodeStep(llm.model, native=native)
    assert type(step.layers[0][0].qkv).__name__ == "Kernel"  # the fused int4 kernel, not three
    if native:
        assert step.schedule == [("native", 0, llm.config.num_hidden_layers)]
    ids = prompt_ids(zoo.vocab_size, 12)
    caches = [llm._kv_cache(1, 32) for _ in range(2)]
    kls = []
    with torch.inference_mode():
        for c in caches:
            _prefill(llm, c, [ids])
        for t, tok in enumerate(prompt_ids(zoo.vocab_size, 8, seed=5)):
            x, pos, slot = torch.tensor([[tok]]), torch.tensor([[12 + t]]), torch.tensor([0])
            kls.append(kl_divergence(llm.model(x, pos, slot, caches[1]).float(), step(x, pos, slot, caches[0]).float()))
    # measured ~1e-6 nats: only the bf16 rounding of activations between the kernels differs
    assert float(torch.cat(kls).max()) < 1e-3


@pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")
@pytest.mark.parametrize("heads,kv_heads,head_dim,window,kv,cap", [
    (9, 3, 64, None, torch.bfloat16, None), (9, 3, 64, None, torch.float32, None),
    (4, 4, 64, None, torch.bfloat16, None), (5, 1, 64, None, torch.bfloat16, None),
    (8, 2, 128, 20, torch.bfloat16, None), (8, 1, 32, None, torch.float32, None),
    (28, 4, 64, None, torch.bfloat16, None), (28, 4, 64, None, torch.bfloat16, 40_000)])
def test_native_attention_takes_a_prompts_rows_together(heads, kv_heads, head_dim, window, kv, cap):
    """A prompt's rows in the native step (runs of 8+ consecutive positions of one sequence: the
    attention's row tasks, each KV head's keys transposed once) for query-head groups of 3 (4 rows a task:
    12 queries), 1, 5, 4 of 128 with a 20-key sliding window, 8 of 32 (fp32 cache) and 7 (also with the
    transposed keys capped at 40 kB: the 4 KV heads in batches of 1, and the second sequence's 11 rows a second
    run): 37 rows after 45 cached positions (tasks past the last row, key blocks past the last key), beside a
    5-row run and a decoding row of two other sequences (the per-row path): the modules' logits and cache to
    fp32 rounding, on a random 2-layer model over a random cache whose values move the logits well beyond it."""
    cached, n = 45, 37
    model, caches = _random_attention_model(heads, kv_heads, head_dim, window, 3, 96, cached, kv)
    cfg = model.config
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(2, 64, (n,), generator=g)
    m = 5 if cap is None else 11  # the second sequence's rows: a short run, or a second run of its own
    short = torch.randint(2, 64, (m,), generator=g)
    ids = torch.cat([prompt, short, torch.tensor([7])]).unsqueeze(1)
    pos = torch.cat([torch.arange(cached, cached + n), torch.arange(10, 10 + m), torch.tensor([30])]).unsqueeze(1)
    slots = torch.tensor([0] * n + [1] * m + [2])
    with torch.inference_mode():
        step = CPUDecodeStep(model, native=True)
        assert step.takes_prefill_rows(caches[0])
        if cap is not None:  # (96 + 32) keys x 64 x 4 bytes a head: 32.8 kB
            step.native.set_max_transposed_bytes(cap)
        got = step(ids, pos, slots, caches[0]).float()
        outs = {}
        for i in (1, 2):
            outs[i] = torch.cat([model(prompt.unsqueeze(0), pos[:n].T, torch.tensor([0]), caches[i], False)[0],
                                 model(short.unsqueeze(0), pos[n:n + m].T, torch.tensor([1]), caches[i], False)[0],
                                 model(torch.tensor([[7]]), torch.tensor([[30]]), torch.tensor([2]), caches[i],
                                       False)[0]]).float()
    got = got.reshape(-1, cfg.vocab_size)
    outs = {i: o.reshape(-1, cfg.vocab_size) for i, o in outs.items()}
    scale = float(outs[1].abs().max())
    # bf16: the modules attend over the prompt's own keys before the cache rounds them (the per-row path: up to 1.8e-4)
    tol = 2e-5 if kv == torch.float32 else 5e-4
    assert float((got - outs[1]).abs().max()) <= tol * scale
    assert float((outs[2] - outs[1]).abs().max()) >= 1e-2 * scale
    for x, y in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
        assert float((x.float() - y.float()).abs().max()) <= 1e-2 * max(1.0, float(y.float().abs().max()))


@pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_native_step_takes_prompt_rows_beside_decode_rows(zoo, kind):
    """Prompt tokens as rows of the native step (LLM.step's mixed prefill): two prompts of
    different lengths, one of them a suffix after a cached prefix, beside a sequence decoding one
    token, in one call. Logits of the selected rows and the KV cache equal the modules' prefill
    and decode in fp32 (mistral: the 8-token window inside the prompt rows)."""
    llm = zoo.llm(zoo.dir(kind), dtype="float32", max_context=64, accelerator="none")
    _rows_against_modules(llm, CPUDecodeStep(llm.model, native=True), 1e-5)


def _rows_against_modules(llm, step, tol: float, kv: str | None = None) -> None:
    """Two prompts (one a suffix after a cached prefix) and a decoding sequence's token in one call of `step`:
    the selected rows' logits and the KV cache (format `kv`, default the plan's) equal the modules' prefill
    and decode within `tol` relative."""
    V = llm.config.vocab_size
    a, b, c = (prompt_ids(V, n, seed=s) for n, s in ((11, 1), (14, 2), (6, 3)))
    caches = [llm._kv_cache(3, 32, kv) for _ in range(2)]
    assert step.takes_prefill_rows(caches[0])
    with torch.inference_mode():
        for cache in caches:
            _prefill(llm, cache, [a, b[:5]])  # slot 0 decodes; slot 1 holds b's first 5 tokens
        tok = 7
        # the modules: b's suffix, c whole, then slot 0's one decode token
        ref = [llm.model(torch.tensor([b[5:]]), torch.arange(5, 14).unsqueeze(0), torch.tensor([1]), caches[1]),
               llm.model(torch.tensor([c]), torch.arange(6).unsqueeze(0), torch.tensor([2]), caches[1]),
               llm.model(torch.tensor([[tok]]), torch.tensor([[11]]), torch.tensor([0]), caches[1])]
        ref = torch.cat([r.float().reshape(-1, r.shape[-1]) for r in ref])
        ids = torch.tensor(b[5:] + c + [tok]).unsqueeze(1)
        pos = torch.tensor(list(range(5, 14)) + list(range(6)) + [11]).unsqueeze(1)
        slots = torch.tensor([1] * 9 + [2] * 6 + [0])
        got = step(ids, pos, slots, caches[0], rows=torch.tensor([8, 14, 15])).float()
    assert got.shape == ref.shape
    assert float((got - ref).abs().max() / ref.abs().max()) <= tol
    for x, y in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
        if y.numel():  # (a latent-attention cache keeps its latents in k, v empty)
            assert float((x.float() - y.float()).abs().max()) <= tol * max(1.0, float(y.float().abs().max()))


@pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "glm4_moe"])
@pytest.mark.parametrize("hooked", [False, True])
def test_native_step_takes_an_moe_models_prompt_rows(rt, kind, hooked):  # noqa: F811
    """An MoE model's prompt tokens as rows of the native step (Plan.mixed_rows), beside a decoding
    sequence: the step runs their attention (DeepSeek's latent attention too) and its MoE blocks over all
    the rows (grouped by expert, as the prefill groups them), or with a routing hook the blocks' modules
    (the fallback schedule's "attn" segments). The selected rows' logits and the KV cache equal the modules'
    prefill and decode: fp32 attention projections and cache, int4 experts on int8 activations in both (the same
    kernels), measured 3-5e-7 apart. (With int4 attention projections the step's rows read int16 or int8
    activations where the modules' prompt GEMMs read bf16 ones, ~3e-3 apart: rounding, not the rows.)"""
    from tiered.models.moe import MoEBlock

    llm = LLM(rt.dir(kind), engine_config(dtype="float32", expert_weights="int4", decode_weights="fp32",
                                          accelerator="none"))
    step = CPUDecodeStep(llm.model, native=True)
    assert llm.plan.mixed_rows > 0  # planner/auto.planned_mixed_rows: MoE models join the native step too
    blocks = [m for m in llm.model.modules() if isinstance(m, MoEBlock)]
    seen = []
    for blk in blocks:
        blk.on_route = (lambda layer, idx, w: seen.append(int(idx.shape[0]))) if hooked else None
    try:
        _rows_against_modules(llm, step, 1e-4, kv="fp32")
    finally:
        for blk in blocks:
            blk.on_route = None
    if hooked:  # the modules ran each MoE block once over all 16 rows of the step (and over each prefill)
        assert 16 in seen


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def test_lean_step_issues_few_ops_per_layer(zoo):
    """The point of the lean step: ops per token. Counted at the dispatcher (views included); per
    layer = the count with every layer minus the count with the first layer alone."""
    llm = LLM(zoo.dir("llama"), __import__("tiered").EngineConfig(decode_weights="int4", max_context=64, accelerator="none"))
    cache = llm._kv_cache(1, 32)
    counts = {}
    with torch.inference_mode():
        _prefill(llm, cache, [prompt_ids(zoo.vocab_size, 8)])
        full, first = CPUDecodeStep(llm.model), CPUDecodeStep(llm.model)
        first.layers = first.layers[:1]
        for name, fn in (("lean", full), ("lean, first layer", first), ("modules", llm.model)):
            with _CountOps() as c:
                fn(torch.tensor([[5]]), torch.tensor([[8]]), torch.tensor([0]), cache)
            counts[name] = c.n
    per_layer = (counts["lean"] - counts["lean, first layer"]) / (llm.config.num_hidden_layers - 1)
    # measured 45 with torch's int4 kernel, 51 with tiered's tiled one (its call allocates the fp32
    # output as one more dispatched op per projection); views and selects included
    assert per_layer <= 55, counts
    assert counts["lean"] < counts["modules"], counts


def _moe_steps(llm, step, prompts: list[list[int]], steps: int, hooked: bool):
    """Logits [steps, B, V] fp32 of `steps` decode steps of `prompts` through the native `step`, with a
    routing hook on every MoE block (the modules run them: the step's fallback schedule) or without
    (the step runs them), the runner's resident uses they added, and (hooked) bool [steps, B]: the
    rows whose routing had a tie at the top-k boundary in some layer (equal probabilities, which
    the step breaks by the lower expert id and torch.topk by its own order)."""
    from tiered.models.moe import MoEBlock

    blocks = [m for m in llm.model.modules() if isinstance(m, MoEBlock)]
    lengths = [len(p) for p in prompts]
    cache = llm._kv_cache(len(prompts), max(lengths) + steps)
    runner, out, seen = blocks[0].runner, [], []
    ties = torch.zeros(steps, len(prompts), dtype=torch.bool)

    # a router's top-k boundary within this much probability: a near tie, which the paths' last-bit differences
    # (the shared expert's bf16 rounding: 3.7e-3 of qwen2_moe's logits) may flip. Seen: a gap of 6.9e-5 in
    # qwen2_moe's int8 run on a profile whose plan gives prompts bf16 attention (2026-12-05)
    TIE = 1e-4

    def tie_checked(gate):
        def route(x):
            p = F.linear(x, gate.weight.to(x.dtype)).float().softmax(-1).topk(gate.top_k + 1, dim=-1).values
            ties[t] |= p[:, -2] - p[:, -1] <= TIE
            return type(gate).route(gate, x)
        return route

    with torch.inference_mode():
        _prefill(llm, cache, prompts)
        for b in blocks:
            b.on_route = (lambda layer, idx, w: seen.append(layer)) if hooked else None
            if hooked:
                b.gate.route = tie_checked(b.gate)
        before = runner.resident_hits
        g = torch.Generator().manual_seed(1)
        for t in range(steps):
            ids = torch.randint(2, llm.config.vocab_size, (len(prompts), 1), generator=g)
            pos = torch.tensor([[n + t] for n in lengths])
            out.append(step(ids, pos, torch.arange(len(prompts)), cache).float())
    for b in blocks:
        b.on_route = None
        b.gate.__dict__.pop("route", None)
    assert len(seen) == (steps * len(blocks) if hooked else 0)
    return torch.stack(out), runner.resident_hits - before, ties


@pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
@pytest.mark.parametrize("dtype,weights,tol", [("float32", "int4", 1e-3), ("float32", "int8", 3e-3),
                                               ("bfloat16", "bf16", 3e-2), ("bfloat16", "int4", 3e-2)])
def test_native_step_runs_resident_moe_layers_itself(rt, kind, dtype, weights, tol):  # noqa: F811
    """With every expert resident in RAM (the runner's one-call layers), the native step runs each MoE
    block itself (DecodeStep.set_moe: router, top-k, experts, weighted sum): one call for all layers.
    Its logits equal the modules' path (a routing hook forces it) to rounding: the post-attention
    norm and the router's logits are the step's own loops (fp32: summation order, ~1 ulp, which can
    flip the int16 rounding of an activation in the int8 / int4 kernels: measured 2e-4 relative for
    int8 on the 2-core EPYC, 1.7e-3 for olmoe on the H100 host's Xeon (2026-11-26), 0 for int4; bf16: then one bf16 rounding of each), at batch 1 and for 10
    sequences (some expert then has more than 8 rows: split into groups of 8), and it counts the
    same resident expert uses. qwen2_moe: a shared expert scaled by its sigmoid gate, and a dense
    MLP layer between MoE layers. In fp32 its shared expert has bf16 decode copies, whose outputs the
    modules round to bf16 (CastLinear) and the step keeps in fp32, as for dense layers: measured
    3.7e-3, allowed 1e-2. qwen3_moe: per-head q/k norms and a dense first layer; olmoe: q/k norms
    over the whole projection and clip_qkv (DecodeStep.set_qk). A row whose router probabilities tie (or
    come within 1e-4) at the top-k boundary may take the other expert (the step breaks ties by the lower id,
    torch.topk by its own order): such rows are left out (bf16: qwen2_moe one of 6 at
    batch 1, olmoe one of 30 at 10 sequences, the rest bit-equal; none seen in fp32)."""
    if kind == "qwen2_moe" and dtype == "float32":
        tol = 1e-2
    llm = LLM(rt.dir(kind), engine_config(dtype=dtype, expert_weights=weights, decode_weights="auto", accelerator="none"))
    step = CPUDecodeStep(llm.model, native=True)
    assert step.schedule == [("native", 0, llm.config.num_hidden_layers)]
    assert step.fallback == [("attn", L.idx) if L.ffn is not None else ("native", L.idx, L.idx + 1)
                             for L, _ in step.layers]
    assert step.takes_prefill_rows(llm._kv_cache(1, 16))  # prompts may join as rows (Plan.mixed_rows)
    for prompts, steps in (([list(range(2, 14))], 6), ([prompt_ids(llm.config.vocab_size, 3 + i, seed=i) for i in range(10)], 3)):
        got, uses, _ = _moe_steps(llm, step, prompts, steps, hooked=False)
        ref, ref_uses, ties = _moe_steps(llm, step, prompts, steps, hooked=True)
        assert float(((got - ref).abs().amax(-1) / ref.abs().max())[~ties].max()) <= tol
        assert float(ties.float().mean()) <= 0.5, ties  # measured: at most 1 row of 6 (qwen2_moe bf16)
        assert uses > 0 and (uses == ref_uses or ties.any())


@pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")
def test_moe_layers_stay_modules_unless_every_layer_can_run_in_the_step(rt):  # noqa: F811
    """fp32 experts (no native expert kernel), or one layer with an expert outside RAM (not one of
    the runner's one-call layers): every MoE block runs as its module, so that the expert cache's
    policy sees each step's layers."""
    llm = LLM(rt.dir("mixtral"), engine_config(accelerator="none"))  # fp32 experts
    modules = [("attn", i) for i in range(llm.config.num_hidden_layers)]
    step = CPUDecodeStep(llm.model, native=True)
    assert step.schedule == step.fallback == modules and not step.moe_blocks
    llm = LLM(rt.dir("mixtral"), engine_config(expert_weights="int4", decode_weights="auto", accelerator="none"))
    assert CPUDecodeStep(llm.model, native=True).schedule == [("native", 0, len(modules))]
    llm.runtime.experts._layer_calls.discard(1)
    step = CPUDecodeStep(llm.model, native=True)
    assert step.schedule == step.fallback == modules and not step.moe_blocks


@pytest.mark.parametrize("native", [True, False])
def test_bf16_projections_past_the_kernel_take_fp32_where_the_cpu_has_no_bf16_gemm(monkeypatch, native):
    """CastLinear's bf16 weight past its native kernel's rows (fp32 or bf16 activations): torch's bf16 GEMM
    where this CPU has one (hardware/cpu_gemm.bf16_gemm_native: oneDNN's), else torch's fp32 GEMM over the
    weight converted for the call, rounded to the activations' dtype (AVX2 only: the bf16 GEMM there ran
    ~10 GMAC/s, SmolLM2's 512-token bf16 prompt 5.8 s against ~1.0). Checked to the bit."""
    import tiered.hardware.cpu_gemm as cg
    from tiered.quant.linear import CastLinear

    monkeypatch.setattr(cg, "_BF16_NATIVE", native)
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 64, generator=g).bfloat16(), torch.randn(48, generator=g).bfloat16()
    x = torch.randn(3, 40, 64, generator=g)  # 120 rows: past any native rows
    m = CastLinear(w, b)
    want = F.linear(x.bfloat16(), w, b).float() if native else F.linear(x, w.float(), b.float())
    assert m(x).dtype == torch.float32 and torch.equal(m(x), want)
    xb = x.bfloat16()
    want = F.linear(xb, w, b) if native else F.linear(xb.float(), w.float(), b.float()).bfloat16()
    assert torch.equal(m(xb), want)


def test_a_bf16_cpu_engine_on_a_cpu_without_a_bf16_gemm_runs_its_projections_as_cast_linears(monkeypatch):
    """runtime/install: on a CPU without a bf16 GEMM a bf16 engine's plain nn.Linear projections become
    CastLinears over the same tensors (their prompts upcast; their few-row calls take the native kernel);
    with a bf16 GEMM they stay nn.Linear."""
    from torch import nn

    import tiered.hardware.cpu_gemm as cg
    from tiered.quant.linear import CastLinear

    for native in (True, False):
        monkeypatch.setattr(cg, "_BF16_NATIVE", native)
        llm = LLM(None, engine_config(dtype="bfloat16", decode_weights="bf16", plan="off"))
        try:
            kinds = {type(m) for n, m in llm.model.named_modules() if n.endswith(("q_proj", "down_proj"))}
            assert kinds == ({nn.Linear} if native else {CastLinear})
        finally:
            llm.close()


@pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")
@pytest.mark.parametrize("heads,kv_heads,head_dim,cached,window", [
    (9, 3, 64, 45, None), (8, 2, 128, 100, None), (4, 4, 32, 0, None), (8, 2, 128, 45, 20), (4, 2, 64, 150, 20)])
def test_prompt_rows_attend_in_bf16_as_the_modules_prompts_do(heads, kv_heads, head_dim, cached, window):
    """Where a plan has prompts attend in bf16 (layers.set_prompt_attention: fp32 activations over a bf16 cache), a
    prompt's rows in the native step do too (DecodeStep.set_prompt_attention_bf16, set by CPUDecodeStep from the
    modules): on AMX or AVX512-BF16 (gemv::bf16_runs_attention: the queries rounded to bf16, the probabilities in
    bf16) a run of 70
    rows after `cached` positions and one of 40 from position 0, beside a decoding row. Their logits are as close
    to the fp32 attention's (the same step with it off) as the modules' bf16 prompts are to the modules' fp32 ones,
    and differ from them (the path is taken), a 20-key window's too (its rows past the window on keys packed from
    their window's block). Without either (AVX2) the rows keep the fp32 attention."""
    from tiered.models.layers import set_prompt_attention
    from tiered.quant.int4 import bf16_attention_kernels

    n, m = 70, 40
    model, caches = _random_attention_model(heads, kv_heads, head_dim, window, 3, cached + n + 8, cached,
                                            torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(2, 64, (n,), generator=g), torch.randint(2, 64, (m,), generator=g)
    ids = torch.cat([a, b, torch.tensor([7])]).unsqueeze(1)
    pos = torch.cat([torch.arange(cached, cached + n), torch.arange(m), torch.tensor([30])]).unsqueeze(1)
    slots = torch.tensor([0] * n + [1] * m + [2])
    fresh = [c.k.clone() for c in caches[:1]] + [caches[0].v.clone()]

    def rows(bf16: bool) -> torch.Tensor:
        caches[0].k.copy_(fresh[0])
        caches[0].v.copy_(fresh[1])
        set_prompt_attention(model, torch.bfloat16 if bf16 else None)
        step = CPUDecodeStep(model, native=True)
        return step(ids, pos, slots, caches[0]).float().reshape(-1, 64)

    def modules(bf16: bool) -> torch.Tensor:
        caches[1].k.copy_(fresh[0])
        caches[1].v.copy_(fresh[1])
        set_prompt_attention(model, torch.bfloat16 if bf16 else None)
        out = [model(a.unsqueeze(0), pos[:n].T, torch.tensor([0]), caches[1], False)[0],
               model(b.unsqueeze(0), pos[n:n + m].T, torch.tensor([1]), caches[1], False)[0],
               model(torch.tensor([[7]]), torch.tensor([[30]]), torch.tensor([2]), caches[1], False)[0]]
        return torch.cat(out).float().reshape(-1, 64)

    with torch.inference_mode():
        got, fp32 = rows(True), rows(False)
        ref_bf16, ref_fp32 = modules(True), modules(False)
    scale = float(ref_fp32.abs().max())
    if bf16_attention_kernels() is None:
        assert torch.equal(got, fp32)
        return
    err, torch_err = float((got - fp32).abs().max()), float((ref_bf16 - ref_fp32).abs().max())
    assert err > 0  # the bf16 attention ran
    assert err <= max(2 * torch_err, 1e-3 * scale), (err, torch_err, scale)
    assert float((got[-1] - fp32[-1]).abs().max()) == 0  # the decoding row keeps the per-row attention
