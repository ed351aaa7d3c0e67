"""tiered/bench/gguf_moe.py: the dummy Qwen3-MoE GGUF that benchmarks/cpu_moe.py compares engines on.

At tiny widths: the file is a real "qwen3moe" GGUF (tiered's reader takes it as such: per-head q/k
norms, experts kept as Q4_0 blocks), its blocks are well formed (weights of the asked std, 4-bit
codes symmetric about 0), the engine decodes it in the native step, and the active bytes a token
reads count top_k / E of the experts. The "glm4moe" variant (GLM-4.5-Air's layout) is read as glm4_moe,
and the "gpt-oss" one (gpt-oss-20b's: Q8_0 attention, MXFP4 experts, biases, sinks, sliding windows,
YaRN) as gpt_oss with its MXFP4 experts kept exactly (tiered's mxfp4 kind where its kernels are built,
else int8-g32); llama.cpp, where importable, loads both and
decodes the same greedy tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize

from tiered import LLM, EngineConfig, SamplingParams
from tiered import kernels
from tiered.bench.gguf_moe import MoEShape, active_bytes_per_token, random_blocks, write_dummy_moe_gguf

TINY = MoEShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=32, experts=8, top_k=2, expert_ffn=32, vocab=256)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "MXFP4"])
def test_random_blocks_have_the_asked_spread_and_no_bias(qtype):
    rng = np.random.default_rng(0)
    raw = random_blocks(rng, 64, 256, qtype, 0.02)
    from gguf import GGMLQuantizationType
    w = dequantize(raw, GGMLQuantizationType[qtype]).reshape(64, 256)
    assert abs(float(w.std()) - 0.02) < 0.002
    assert abs(float(w.mean())) < 0.02 * 0.02  # uniform 4-bit codes minus 8 would give -d/2 on every weight
    with pytest.raises(ValueError, match="Q4_0 / Q8_0 / MXFP4"):
        random_blocks(rng, 4, 48, qtype, 0.02)
    if qtype == "MXFP4":  # power-of-two scales 2^(e - 128) around the target 0.02 / 5.85 * [0.5, 1.5]
        e = raw.reshape(64, 8, 17)[:, :, 0]
        assert set(np.unique(e)) <= {118, 119, 120, 121}


def test_dummy_qwen3_moe_gguf_loads_and_decodes(tmp_path):
    path = write_dummy_moe_gguf(tmp_path / "tiny.gguf", TINY, qtype="Q4_0")
    r = GGUFReader(str(path))
    assert r.fields["general.architecture"].contents() == "qwen3moe"
    shapes = {t.name: (t.tensor_type.name, [int(s) for s in t.shape]) for t in r.tensors}
    assert shapes["blk.1.ffn_gate_exps.weight"] == ("Q4_0", [64, 32, 8])  # ggml order: [D, F, E]
    assert shapes["blk.0.attn_q_norm.weight"] == ("F32", [32])
    assert "output.weight" not in shapes  # tied: the embedding is the output matrix

    llm = LLM(path, EngineConfig(max_context=64, accelerator="none"))
    cfg = llm.config
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.head_dim,
            cfg.qk_norm) == ("qwen3_moe", 8, 2, 32, 32, True)
    assert llm.plan.dtypes["experts"].startswith("int4")  # the Q4_0 blocks kept as int4
    # a MoE prompt's expert groups read int8 activations by default (batch_activations="auto")
    assert llm.plan.batch_act == "q8" and llm.runtime.experts.fmt.batch_act == "q8"
    if kernels.load() is not None:  # q/k norms and MoE layers run in the native step
        assert llm.runtime.cpu_decode.schedule == [("native", 0, 2)]
    out = llm.generate([list(range(10, 30))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and all(0 <= t < 256 for t in out.token_ids)
    llm.close()
    llm = LLM(path, EngineConfig(max_context=64, accelerator="none", batch_activations="bf16"))
    assert llm.plan.batch_act == "bf16" and llm.runtime.experts.fmt.batch_act == "bf16"
    llm.close()

    act = active_bytes_per_token(path)
    experts = sum(int(t.n_bytes) for t in r.tensors if "_exps." in t.name)
    assert act["breakdown"]["experts (top-k of E)"] == experts * 2 // 8
    assert act["bytes"] == sum(int(t.n_bytes) for t in r.tensors) - experts + experts * 2 // 8


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M", "IQ4_XS"])
def test_dummy_qwen3_moe_gguf_in_a_k_quant_mix(mix, tmp_path):
    """The k-quant mixes (K_MIXES): each tensor llama.cpp's type (ffn_down_exps Q6_K in the use_more_bits layers, the
    tied embedding Q6_K), and the CPU engine keeps the experts' blocks as its k-quant kinds where its kernels are
    built (the first MoE layer's types choose the format) and decodes."""
    shape = MoEShape(layers=8, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=8, top_k=2, expert_ffn=256,
                     vocab=256)
    path = write_dummy_moe_gguf(tmp_path / "mix.gguf", shape, qtype=mix)
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}
    main = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "IQ4_XS": "IQ4_XS"}[mix]
    downs = [types[f"blk.{i}.ffn_down_exps.weight"] for i in range(8)]
    assert downs == ([main] * 8 if mix == "IQ4_XS" else ["Q6_K", main, main, "Q6_K", main, main, "Q6_K", "Q6_K"])
    assert types["token_embd.weight"] == "Q6_K" and types["blk.1.ffn_gate_exps.weight"] == main
    llm = LLM(path, EngineConfig(max_context=64, accelerator="none"))
    if kernels.load() is not None:
        want = {"Q4_K_M": "int4,int4,q6k", "Q5_K_M": "q5k,q5k,q6k", "IQ4_XS": "iq4xs"}[mix]
        assert llm.plan.dtypes["experts"] == want
        assert any(("re-quantized on load: " + main + " -> q6k") in n if mix != "IQ4_XS" else "mapped exactly" in n
                   for n in llm.plan.notes)
    out = llm.generate([list(range(10, 30))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    llm.close()
    with pytest.raises(ValueError, match="qwen3moe"):
        write_dummy_moe_gguf(tmp_path / "x.gguf", shape, qtype=mix, expert_qtype="Q4_0")


def test_dummy_glm4_moe_gguf_loads_and_matches_llama_cpp(tmp_path):
    from tiered.checkpoint import default_model_path

    shape = MoEShape(arch="glm4moe", layers=3, hidden=128, heads=4, kv_heads=2, head_dim=32, experts=8, top_k=2,
                     expert_ffn=64, dense_layers=1, dense_ffn=192, shared=1, rope_dim=16)
    path = write_dummy_moe_gguf(tmp_path / "glm.gguf", shape, tokenizer_from=default_model_path())
    r = GGUFReader(str(path))
    assert r.fields["general.architecture"].contents() == "glm4moe"
    assert r.fields["glm4moe.rope.dimension_count"].contents() == 16
    names = {t.name for t in r.tensors}
    assert {"blk.0.ffn_gate.weight", "blk.1.exp_probs_b.bias", "blk.2.ffn_up_shexp.weight", "blk.0.attn_q.bias",
            "output.weight"} <= names and "blk.0.attn_q_norm.weight" not in names and "blk.0.ffn_norm.weight" not in names

    llm = LLM(path, EngineConfig(max_context=64, accelerator="none"))
    c = llm.config
    assert (c.model_type, c.attention_bias, c.qk_norm, c.partial_rotary_factor, c.first_k_dense_replace,
            c.shared_expert_intermediate_size, c.intermediate_size, c.norm_topk_prob) == (
        "glm4_moe", True, False, 0.5, 1, 64, 192, True)
    prompt = list(range(10, 30))
    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    ref = llama_cpp_greedy(path, prompt, 8)
    logits = llm.logits(prompt + ref[:-1])[len(prompt) - 1:].float()  # ours, teacher-forced on llama.cpp's tokens
    llm.close()
    # equal up to a near tie of dummy weights, where the two engines' roundings may pick either token: the
    # 8th here, 0.0003-0.0008 logits between its top two (the Q8_0 copies held as stored since 2026-12-05)
    part = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref))
    assert part >= 6, (ours, ref)
    if part < len(ref):
        assert float(logits[part].max() - logits[part, ref[part]]) < 2e-3, (part, ours, ref)


def llama_cpp_greedy(path, prompt: list[int], n: int) -> list[int]:
    """llama.cpp's greedy continuation of `prompt` (skips the test where llama-cpp-python is missing)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    m = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, verbose=False)
    out = []
    for t in m.generate(prompt, temp=0, top_k=1):
        out.append(t)
        if len(out) == n:
            return out


def test_dummy_gpt_oss_gguf_loads_and_matches_llama_cpp(tmp_path):
    from collections import Counter

    from tiered.checkpoint import default_model_path

    L = 2
    shape = MoEShape(arch="gpt-oss", layers=L, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2,
                     expert_ffn=64, rope_base=150000.0, sliding_window=4, yarn=(32.0, 4096))
    path = write_dummy_moe_gguf(tmp_path / "oss.gguf", shape, qtype="Q8_0", expert_qtype="MXFP4",
                                tokenizer_from=default_model_path())
    r = GGUFReader(str(path))
    f = {k: r.fields[k].contents() for k in r.fields if k.startswith(("gpt-oss.", "general.file_type"))}
    assert (f["gpt-oss.attention.sliding_window"], f["gpt-oss.rope.scaling.type"], f["gpt-oss.rope.scaling.factor"],
            f["gpt-oss.rope.scaling.original_context_length"], f["general.file_type"]) == (4, "yarn", 32.0, 4096, 38)
    # ggml-org/gpt-oss-20b-GGUF's split, per layer: 12 F32 (norms, biases, sinks, router), 4 Q8_0, 3 MXFP4
    assert Counter(t.tensor_type.name for t in r.tensors) == {"F32": 12 * L + 1, "Q8_0": 4 * L + 2, "MXFP4": 3 * L}
    bias = next(t for t in r.tensors if t.name == "blk.1.ffn_down_exps.bias").data
    assert np.array_equal(bias.view(np.uint32) & 0xFFFF, np.zeros_like(bias.view(np.uint32)))  # bf16 values
    with pytest.raises(ValueError, match="gpt-oss's"):
        MoEShape(sliding_window=4)

    llm = LLM(path, EngineConfig(max_context=64, accelerator="none"))
    c = llm.config
    assert (c.model_type, c.local_window, c.local_layers, c.attention_sinks, c.expert_bias, c.o_proj_bias,
            c.rope_scaling["factor"], c.tie_word_embeddings) == ("gpt_oss", 4, (0,), True, True, True, 32.0, False)
    # the MXFP4 blocks kept exactly: as their codes where the kernels are built, else as int8-g32
    assert llm.plan.dtypes["experts"] == ("mxfp4" if kernels.load() is not None else "int8-g32")
    if kernels.load() is not None:  # sinks, windows and biased experts in the native step
        assert llm.runtime.cpu_decode.schedule == [("native", 0, L)]
    prompt = list(range(10, 30))
    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    llm.close()
    assert len(ours) == 8
    assert ours == llama_cpp_greedy(path, prompt, 8)


def test_dense_file_has_no_active_bytes(tmp_path):
    from gguf import GGUFWriter
    w = GGUFWriter(str(tmp_path / "d.gguf"), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert active_bytes_per_token(tmp_path / "d.gguf") is None
