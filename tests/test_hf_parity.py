"""The lossless oracle on tiny HF checkpoints: tiered == transformers, logits and greedy tokens.

DESIGN.md "Correctness oracle": max relative logit error <= 1e-4 in float32 and identical greedy
tokens, for every supported dense architecture, loaded from a real config.json + safetensors.
"""

from __future__ import annotations

import pytest
import torch

from fixtures import TINY_SPECS, hf_greedy, max_rel_err, prompt_ids
from tiered import SamplingParams
from tiered.checkpoint import HFDirCheckpoint, open_checkpoint

ARCHS = list(TINY_SPECS)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
REL_TOL = 1e-4


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("name", ARCHS)
def test_logits_match_transformers(zoo, name):
    ids = prompt_ids(zoo.vocab_size, 16)
    with torch.no_grad():
        ref = zoo.hf(name)(torch.tensor([ids])).logits[0].float()
    got = zoo.llm(zoo.dir(name)).logits(ids)
    assert got.dtype == torch.float32 and got.shape == ref.shape == (16, zoo.vocab_size)
    assert ref.abs().max() > 1.0, "random weights too small for a meaningful comparison"
    assert rel_err(got, ref) <= REL_TOL


@pytest.mark.parametrize("name", ARCHS)
def test_greedy_matches_transformers(zoo, name):
    ids = prompt_ids(zoo.vocab_size, 16, seed=1)
    ref = hf_greedy(zoo.hf(name), ids, 16)
    out = zoo.llm(zoo.dir(name)).generate(ids, GREEDY)
    assert len(out) == 1
    assert out[0].token_ids == ref
    assert out[0].finish_reason == "length"
    assert out[0].prompt_token_ids == ids
    assert out[0].stats.generated_tokens == 16 and out[0].stats.prompt_tokens == 16


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen3"])
def test_batched_generation_equals_one_at_a_time(zoo, name):
    llm = zoo.llm(zoo.dir(name))
    prompts = [prompt_ids(zoo.vocab_size, n, seed=10 + n) for n in (3, 16, 7, 11)]
    batched = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    single = [llm.generate(p, GREEDY)[0].token_ids for p in prompts]
    assert batched == single
    # And each equals transformers, so batching did not merely repeat one mistake.
    assert batched[1] == hf_greedy(zoo.hf(name), prompts[1], 16)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_packed_prefill_equals_one_at_a_time(zoo, name, monkeypatch):
    """Every admitted prompt prefilled in one packed forward (models/layers.build_packed_metadata; mistral: its
    window of 8 is shorter than the longest prompt) gives each prompt's own greedy tokens."""
    import tiered.engine.llm as engine_llm

    calls = []
    build = engine_llm.build_packed_metadata

    def spy(rotary, positions, spans, slots, window):
        calls.append([b - a for a, b in spans])
        return build(rotary, positions, spans, slots, window)

    monkeypatch.setattr(engine_llm, "build_packed_metadata", spy)
    llm = zoo.llm(zoo.dir(name))
    monkeypatch.setattr(llm.plan, "mixed_rows", 0)  # short prompts would run as decode-step rows
    prompts = [prompt_ids(zoo.vocab_size, n, seed=20 + n) for n in (2, 19, 9)]
    batched = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert calls == [[2, 19, 9]]  # really one packed forward, in admission order
    single = [llm.generate(p, GREEDY)[0].token_ids for p in prompts]
    assert batched == single


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2_sliding", "qwen3"])
def test_packed_prompts_attend_to_their_own_slots(zoo, name, kv):
    """Prompts packed into one row (one from position 0, one after 6 cached positions, one of a single token, each
    its own slot) give the last-token logits each gives alone, and each slot then decodes as after its prompt
    alone: each wrote its own slot's KV and attended to it only (fixtures.packed_prefill_gaps)."""
    from fixtures import local_model, packed_prefill_gaps

    prefill, decode = packed_prefill_gaps(local_model(zoo.dir(name)), zoo.vocab_size, getattr(torch, kv))
    assert prefill <= 1e-5 and decode <= 1e-5, (prefill, decode)


def test_packed_metadata_refuses_spans_that_do_not_match(zoo):
    """build_packed_metadata refuses spans without a slot each, an empty span, and positions of other tokens."""
    from fixtures import local_model
    from tiered.models.layers import build_packed_metadata

    model = local_model(zoo.dir("llama"))
    pos = torch.arange(5)[None]
    with pytest.raises(ValueError, match="one slot and a non-empty span"):
        build_packed_metadata(model.rotary, pos, [(0, 2), (0, 3)], [0], None)
    with pytest.raises(ValueError, match="one slot and a non-empty span"):
        build_packed_metadata(model.rotary, pos, [(0, 5), (3, 3)], [0, 1], None)
    with pytest.raises(ValueError, match="not the spans' 6 tokens"):
        build_packed_metadata(model.rotary, pos, [(0, 3), (0, 3)], [0, 1], None)
    meta = build_packed_metadata(model.rotary, torch.tensor([[0, 1, 4, 5, 6]]), [(0, 2), (4, 7)], [3, 1], None)
    assert [(o, n, one.single, one.causal, one.mask is None) for o, n, one in meta.segments] == \
        [(0, 2, (3, 0), True, True), (2, 3, (1, 4), False, False)]


def test_prefill_then_decode_logits_equal_full_scoring(zoo):
    """Decoding token by token through the KV cache gives the logits of one full forward."""
    from fixtures import stepwise_logits

    llm = zoo.llm(zoo.dir("qwen2"))
    ids = prompt_ids(zoo.vocab_size, 12, seed=3)
    assert rel_err(stepwise_logits(llm, ids, 4), llm.logits(ids)[3:]) <= REL_TOL


def test_sliding_window_is_exercised(zoo):
    """Sanity of the Mistral fixture: its window (8) changes the logits of a 16-token prompt."""
    from fixtures import load_hf_model

    ids = prompt_ids(zoo.vocab_size, 16)
    windowed = zoo.hf("mistral")
    full = load_hf_model(zoo.dir("mistral"))
    full.config.sliding_window = None
    with torch.no_grad():
        a = windowed(torch.tensor([ids])).logits[0]
        b = full(torch.tensor([ids])).logits[0]
    assert torch.allclose(a[:8], b[:8], atol=1e-5)
    assert (a[8:] - b[8:]).abs().max() > 1e-2
    assert zoo.llm(zoo.dir("mistral")).config.sliding_window == 8


def test_a_windowed_prompt_in_chunks_passes_past_and_the_window_once_it_cuts_keys(zoo, monkeypatch):
    """A 16-token prompt prefilled in chunks of 4 (Plan.prefill_chunk) through the modules on the Mistral fixture
    (window 8): a chunk of consecutive positions gives attention its `past` (the mask pattern of layers.attend's
    AMX route), and once a query's window cuts keys (AttentionMetadata.windowed: kv_len > 8) the window too (the
    kernel's window), and the chunked prompt's log-probabilities (SamplingParams.prompt_logprobs) are
    transformers' windowed ones."""
    from tiered import LLM, EngineConfig
    from tiered.models.layers import Attention

    ids = prompt_ids(zoo.vocab_size, 16, seed=2)
    with torch.no_grad():
        ref = zoo.hf("mistral")(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    llm = LLM(zoo.dir("mistral"), EngineConfig(decode_weights="fp32"))
    try:
        llm.plan.prefill_chunk, llm.plan.mixed_rows = 4, 0
        seen, real = [], Attention.attend
        monkeypatch.setattr(Attention, "attend", lambda self, q, k, v, mask, causal, past=None, window=0: (
            seen.append((self.layer_idx, q.shape[2], past, window)) or real(self, q, k, v, mask, causal, past, window)))
        out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
        got = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
        want = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
        assert out.token_ids == [int(ref[-1].argmax())]
        # layer 0's chunks: from position 0, after 4 cached positions (keys 0..7: in the window), after 8 and 12
        # (windowed; their keys from 0 still, sizes.window_key_start's multiple of 16)
        assert [(T, past, w) for layer, T, past, w in seen if layer == 0] == [(4, 0, 0), (4, 4, 0), (4, 8, 8),
                                                                              (4, 12, 8)]
    finally:
        llm.close()


def test_rope_scaling_is_exercised(zoo):
    """Sanity of the llama3 fixture: its scaled inverse frequencies differ from plain RoPE."""
    from dataclasses import replace

    from tiered.checkpoint.model_config import rope_inv_freq

    cfg = open_checkpoint(zoo.dir("llama3_rope")).config
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_theta == 500000.0
    assert not torch.allclose(rope_inv_freq(cfg), rope_inv_freq(replace(cfg, rope_scaling=None)))


@pytest.mark.parametrize("name,expect", [
    ("llama", dict(tie_word_embeddings=False, attention_bias=False, qk_norm=False, head_dim=16)),
    ("llama_tied", dict(tie_word_embeddings=True)),
    ("llama_attn_bias", dict(attention_bias=True, o_proj_bias=True)),
    ("llama_linear_rope", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    ("mistral", dict(sliding_window=8)),
    ("qwen2_sliding", dict(sliding_window=8)),
    ("qwen2", dict(attention_bias=True, o_proj_bias=False, qk_norm=False, sliding_window=None)),
    ("qwen3", dict(qk_norm=True, attention_bias=False, head_dim=32)),
])
def test_model_config_from_config_json(zoo, name, expect):
    ckpt = open_checkpoint(zoo.dir(name))
    assert isinstance(ckpt, HFDirCheckpoint) and ckpt.format_name == "safetensors"
    cfg = ckpt.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (64, 2, 4, 2, 128, zoo.vocab_size)
    assert cfg.eos_token_ids == (1,) and cfg.bos_token_id == 0
    for k, v in expect.items():
        assert getattr(cfg, k) == v, k


def test_handles_are_lazy_and_match_safetensors(zoo):
    from safetensors.torch import load_file

    ckpt = open_checkpoint(zoo.dir("qwen2"))
    ref = load_file(str(zoo.dir("qwen2") / "model.safetensors"))
    assert sorted(ckpt.names()) == sorted(ref)
    assert ckpt.nbytes() == sum(t.numel() * t.element_size() for t in ref.values())
    h = ckpt.handle("model.layers.0.self_attn.q_proj.bias")
    assert h.shape == (64,) and h.format == "F32" and not h.is_quantized and h.numel == 64
    assert torch.equal(h.load(), ref["model.layers.0.self_attn.q_proj.bias"])
    assert h.load(torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        h.blocks()
    # Tied checkpoints store no lm_head; the model still has one (the embedding).
    tied = zoo.llm(zoo.dir("llama_tied"))
    assert not open_checkpoint(zoo.dir("llama_tied")).has("lm_head.weight")
    assert tied.model.lm_head.weight is tied.model.model.embed_tokens.weight


@pytest.mark.parametrize("name", ARCHS)
def test_parameter_count(zoo, name):
    """ModelConfig.num_parameters() is exact: weights, biases and norms (tied embeddings once)."""
    assert open_checkpoint(zoo.dir(name)).config.num_parameters() == sum(p.numel() for p in zoo.hf(name).parameters())


def test_batch_with_early_finishers_equals_one_at_a_time(zoo):
    """Sequences that stop early leave the batch; the rest decode from non-contiguous cache slots."""
    llm = zoo.llm(zoo.dir("qwen2"))
    prompts = [prompt_ids(zoo.vocab_size, n, seed=30 + n) for n in (5, 9, 3, 12)]
    first = llm.generate(prompts[0], GREEDY)[0].token_ids
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[first[2]])
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    single = [llm.generate(p, params)[0].token_ids for p in prompts]
    assert batched == single
    assert len(batched[0]) <= 3 and max(len(t) for t in batched) > 3  # someone did finish early


def test_sharded_checkpoint(zoo, tmp_path):
    """A checkpoint split into shards with model.safetensors.index.json loads the same."""
    hf = zoo.hf("qwen3")
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    from tiered import LLM, EngineConfig

    llm = LLM(tmp_path, EngineConfig(decode_weights="fp32"))
    ids = prompt_ids(zoo.vocab_size, 16)
    assert torch.equal(llm.logits(ids), zoo.llm(zoo.dir("qwen3")).logits(ids))


def test_bf16_checkpoint_loads_exactly(zoo, tmp_path):
    """BF16 safetensors widen to fp32 exactly: logits equal transformers' fp32 run of the same weights."""
    from fixtures import load_hf_model
    from tiered import LLM, EngineConfig

    import copy

    copy.deepcopy(zoo.hf("llama")).to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    assert open_checkpoint(tmp_path).handle("model.layers.0.mlp.up_proj.weight").format == "BF16"
    ref_model = load_hf_model(tmp_path)  # fp32 copy of the bf16 weights
    ids = prompt_ids(zoo.vocab_size, 16)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    llm = LLM(tmp_path, EngineConfig(decode_weights="fp32", dtype="float32"))  # a GPU's default is bf16 compute
    assert rel_err(llm.logits(ids), ref) <= REL_TOL
    assert llm.generate(ids, GREEDY)[0].token_ids == hf_greedy(ref_model, ids, 16)


# Measured max KL (nats) over 17 decode steps of the tiny Llama: bf16 everything 1.6e-4, bf16
# decode weights 4e-5, int4 re-quantized decode weights 0.032 (random Gaussian weights are the
# worst case for 4-bit min/max groups). Bounds leave ~3-6x room.
@pytest.mark.parametrize("config,bound", [(dict(dtype="bfloat16"), 1e-3), (dict(decode_weights="bf16"), 1e-3),
                                          (dict(decode_weights="auto"), 1e-3), (dict(decode_weights="int4"), 0.1)])
def test_lossy_modes_stay_close(zoo, config, bound):
    """bf16 / int4 weights: decode logits close to the lossless ones."""
    from fixtures import stepwise_logits
    from tiered.eval.kl import kl_divergence

    ref_llm = zoo.llm(zoo.dir("llama"))
    llm = zoo.llm(zoo.dir("llama"), **config)
    ids = prompt_ids(zoo.vocab_size, 24, seed=5)
    ref = ref_llm.logits(ids)[7:]
    got = stepwise_logits(llm, ids, 8)
    assert float(kl_divergence(ref, got).max()) < bound


def test_transformers_4_config_layout_reads_the_same(zoo):
    """config.json as transformers 4.x wrote it (rope_theta + rope_scaling with "type") gives the
    same ModelConfig as the 5.x layout (rope_parameters)."""
    import json

    from tiered.checkpoint import ModelConfig

    for name in ("llama", "llama3_rope", "llama_linear_rope"):
        v5 = json.loads((zoo.dir(name) / "config.json").read_text())
        v4 = dict(v5)
        rope = dict(v4.pop("rope_parameters"))
        v4["rope_theta"] = rope.pop("rope_theta")
        rope_type = rope.pop("rope_type")
        v4["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
        assert ModelConfig.from_hf(v4) == ModelConfig.from_hf(v5), name


@pytest.mark.parametrize("overrides,window", [
    (dict(use_sliding_window=True, sliding_window=8, max_window_layers=28), None),  # no layer reaches 28
    (dict(use_sliding_window=True, sliding_window=8, max_window_layers=0), 8),
    (dict(use_sliding_window=False, sliding_window=8, max_window_layers=0), None),
    (dict(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention"] * 2), 8),
])
def test_qwen_sliding_window_follows_layer_types(zoo, overrides, window):
    """Qwen2/Qwen3 slide only in layers >= max_window_layers (HF's layer_types)."""
    import json

    from tiered.checkpoint import ModelConfig

    cfg = json.loads((zoo.dir("qwen2") / "config.json").read_text())
    cfg.pop("layer_types", None)
    cfg.update(overrides)
    assert ModelConfig.from_hf(cfg).sliding_window == window


def test_attention_turns_cudnn_off_only_for_cuda_tensors(monkeypatch):
    """`attend` calls torch's attention with the cuDNN backend off for tensors on a CUDA device (it built
    a plan per new KV length: 33-36 ms per decode step on the H200), restores the flag, even when
    attention raises, and leaves CPU tensors' calls and CUDA-graph captures (static shapes) as they are."""
    import types

    from tiered.models import layers

    seen = []

    def sdpa(q, k, v, **kw):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        if kw["scale"] < 0:
            raise RuntimeError("boom")
        return "out"

    monkeypatch.setattr(layers.F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    torch.backends.cuda.enable_cudnn_sdp(True)
    fake_cuda = types.SimpleNamespace(is_cuda=True)
    assert layers.attend(fake_cuda, None, None, None, False, 1.0, False) == "out"
    assert layers.attend(torch.zeros(1), None, None, None, False, 1.0, False) == "out"
    with pytest.raises(RuntimeError):
        layers.attend(fake_cuda, None, None, None, False, -1.0, False)
    assert seen == [False, True, False] and torch.backends.cuda.cudnn_sdp_enabled()
    from tiered.hardware.accelerator import _building_graph

    with _building_graph():  # a graph's warm-up runs: the kernels the capture will use
        layers.attend(fake_cuda, None, None, None, False, 1.0, False)
    assert seen[-1] is True
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # a CUDA graph's capture
    layers.attend(fake_cuda, None, None, None, False, 1.0, False)
    assert seen[-1] is True


def test_the_lm_head_of_a_prefill_gets_the_last_token_with_plain_strides(zoo):
    """A prefill's last-token hidden state reaches the lm_head as a [1, 1, D] tensor with plain strides:
    the bare slice keeps the prompt's batch stride, and torch's matmul then ran the head as a bmm over
    a copy of the whole [V, D] weight (51 ms of a SmolLM2 prefill's 0.7 s on 2 cores)."""
    from tiered import LLM, EngineConfig

    llm = LLM(zoo.dir("llama"), EngineConfig(accelerator="none", decode_weights="fp32", max_context=32, plan="off"))
    seen = []
    hook = llm.model.lm_head.register_forward_pre_hook(lambda m, args: seen.append((args[0].shape, args[0].stride())))
    try:
        with torch.inference_mode():
            llm.model(torch.tensor([list(range(2, 14))]), torch.arange(12).unsqueeze(0), torch.tensor([0]),
                      llm._kv_cache(1, 32))
    finally:
        hook.remove()
        llm.close()
    D = llm.config.hidden_size
    assert seen == [(torch.Size([1, 1, D]), (D, D, 1))]


@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral", "qwen2_sliding"])
def test_prompt_keys_widened_to_an_aligned_count_attend_as_the_exact_count(zoo, name, kv, monkeypatch):
    """A CPU prompt's attention reads its slot's keys widened to a multiple of KV_ALIGN (KVCache.aligned: torch's CPU
    flash attention is up to 2x slower at other counts): a prompt from position 0 (SDPA's causal mask) and a chunk
    after 6 cached positions (an explicit mask) give the logits of the exact key count, the slot's positions past the
    prompt holding large stale values that must not leak in; windowed layers (mistral's window of 8, qwen2_sliding's
    windowed and full layers) with their window masks widened."""
    import tiered.models.layers as layers
    from fixtures import local_model

    model = local_model(zoo.dir(name))
    ids = prompt_ids(zoo.vocab_size, 21, seed=3)
    read = []
    attend = layers.attend
    monkeypatch.setattr(layers, "attend", lambda q, k, *a: read.append(k.shape[2]) or attend(q, k, *a))

    def logits(cached: int) -> torch.Tensor:
        cache = layers.KVCache(model.config, 2, 48, getattr(torch, kv))
        for t in (cache.k, cache.v):  # stale values of an earlier sequence in every position
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(5)) * 100)
        with torch.inference_mode():
            if cached:
                model(torch.tensor([ids[:cached]]), torch.arange(cached)[None], torch.tensor([1]), cache)
            return model(torch.tensor([ids[cached:]]), torch.arange(cached, len(ids))[None], torch.tensor([1]),
                         cache)[0]

    for cached in (0, 6):
        read.clear()
        got = logits(cached)
        assert read and all(n % layers.KV_ALIGN == 0 for n in read[-model.config.num_hidden_layers:]), read
        monkeypatch.setattr(layers, "KV_ALIGN", 1)
        read.clear()
        exact = logits(cached)
        assert read[-1] == len(ids)
        monkeypatch.setattr(layers, "KV_ALIGN", 16)
        assert max_rel_err(got, exact) <= (1e-5 if kv == "float32" else 1e-2), (cached, max_rel_err(got, exact))
