"""Write GGUF files from tiny transformers models the way llama.cpp's converter does.

This is an independent re-statement of `convert_hf_to_gguf.py` (llama.cpp) for the dense Llama
family, kept in tests/ so tiered's reader is checked against a writer it does not share code with:
the tensor-name table here is written out separately from tiered/checkpoint/gguf_file.py, and
q/k rows of "llama"-architecture models are permuted exactly as LlamaModel.permute does.

Norms and biases (1-D tensors) are always written F32, as llama.cpp does; 2-D weights are
written in the requested type (F32, F16, BF16, Q8_0, Q4_0, Q4_1) through gguf.quants.quantize; Q4_K, Q5_K, Q6_K
and the IQ4 types, which gguf cannot quantize, through tiered/quant/gguf_encode.py's fits (what a reader gets back is
still gguf's dequantization of the bytes written).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import dequantize, quantize

from tiered.quant.gguf_encode import quantize_iq4_nl, quantize_iq4_xs, quantize_q4_k, quantize_q5_k, quantize_q6_k

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name for an HF parameter name of a dense Llama-family model."""
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    parts = hf_name.split(".")  # model.layers.N.<module...>.<weight|bias>
    assert parts[:2] == ["model", "layers"], hf_name
    return f"blk.{parts[2]}.{_BLOCK['.'.join(parts[3:-1])]}.{parts[-1]}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF rotate-half rows -> llama.cpp interleaved rows."""
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_K_TYPES = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)


def encode(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """w fp32 [rows, cols] -> the array GGUFWriter stores for `qtype` (F32/F16 dense, else bytes)."""
    if qtype == GGMLQuantizationType.F32:
        return w.astype(np.float32)
    return quantize(w.astype(np.float32), qtype)


def roundtrip(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """What a reader gets back for w written as qtype: dequantize(quantize(w)), fp32, same shape."""
    if qtype == GGMLQuantizationType.F32:
        return w.astype(np.float32)
    return dequantize(encode(w, qtype), qtype).reshape(w.shape).astype(np.float32)


def _header(cfg, path: Path, arch: str, name: str) -> GGUFWriter:
    """A GGUFWriter with the hyperparameters every Llama-family file carries."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{name}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    return w


def write_gguf(model, path: Path, arch: str, qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
               sampling: dict | None = None) -> Path:
    """Write a transformers dense Llama-family model as a GGUF file.

    Args:
        model: a LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM (fp32).
        path: the .gguf file to write.
        arch: GGUF architecture name: "llama", "qwen2" or "qwen3".
        qtype: type of the 2-D weights; 1-D tensors are always F32.
        sampling: general.sampling.* keys to write ({"temp": 0.6, "top_k": 20, ...}: the GGUFWriter's
            add_sampling_<key>, as llama.cpp's converter writes a generation_config.json's).
    """
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    assert rope.get("rope_type", "default") == "default", "the writer only handles plain RoPE"
    w = _header(cfg, path, arch, arch)
    w.add_file_type(int(qtype))
    for key, value in (sampling or {}).items():
        getattr(w, f"add_sampling_{key}")(value)

    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if getattr(cfg, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # llama.cpp omits output.weight for tied models
    for name, t in state.items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n_head = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            t = llama_cpp_permute(t, n_head)
        if t.ndim == 1:
            w.add_tensor(gguf_name(name), t.astype(np.float32))
        elif qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w.add_tensor(gguf_name(name), t.astype(np.float32 if qtype == GGMLQuantizationType.F32 else np.float16))
        else:  # K types through encode_any (gguf cannot quantize them; rows they cannot split: F16)
            arr, qt = encode_any(t, qtype) if qtype in _K_TYPES + _IQ4_TYPES else (encode(t, qtype), qtype)
            w.add_tensor(gguf_name(name), arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tensors_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]],
                       arch: str = "qwen2", dims: dict | None = None) -> Path:
    """A GGUF file holding given raw tensors (already encoded) plus minimal `arch` metadata.

    Args:
        tensors: GGUF name -> (array as GGUFWriter takes it, its type).
        dims: block_count, embedding_length, feed_forward_length, head_count, head_count_kv.
    """
    d = dict(block_count=1, embedding_length=64, feed_forward_length=128, head_count=4, head_count_kv=2)
    d.update(dims or {})
    w = GGUFWriter(str(path), arch)
    w.add_block_count(d["block_count"])
    w.add_context_length(128)
    w.add_embedding_length(d["embedding_length"])
    w.add_feed_forward_length(d["feed_forward_length"])
    w.add_head_count(d["head_count"])
    w.add_head_count_kv(d["head_count_kv"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(256)
    for name, (arr, qt) in tensors.items():
        if qt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def random_k_blocks(rows: int, cols: int, qtype: GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """Valid random Q4_K / Q5_K / Q6_K blocks uint8 [rows, cols / 256 * block_bytes] (gguf cannot quantize K types).

    Every byte is random except the fp16 super-block scales, which are set to small finite values.
    """
    rng = np.random.default_rng(seed)
    block = {GGMLQuantizationType.Q4_K: 144, GGMLQuantizationType.Q5_K: 176, GGMLQuantizationType.Q6_K: 210}[qtype]
    nb = cols // 256
    b = rng.integers(0, 256, size=(rows, nb, block), dtype=np.uint8)
    if qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):  # d, dmin (f16) then scales[12], (qh[32],) qs
        b[..., 0:4] = rng.uniform(0.001, 0.01, size=(rows, nb, 2)).astype(np.float16).view(np.uint8)
    else:  # ql[128], qh[64], scales[16] (int8), d (f16)
        b[..., 208:210] = rng.uniform(0.001, 0.01, size=(rows, nb, 1)).astype(np.float16).view(np.uint8)
    return b.reshape(rows, nb * block)


# where the fp16 scales sit in the other block types random_blocks fills (byte offset, count): the rest of a block
# (codebook / lattice indices, signs, sub-block scales) is valid whatever its bits
_SCALE_BYTES = {GGMLQuantizationType.Q2_K: (80, 2), GGMLQuantizationType.Q3_K: (108, 1),
                **{getattr(GGMLQuantizationType, t): (0, 1)
                   for t in ("IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S")}}


def random_blocks(rows: int, cols: int, qtype: GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """Valid random blocks of a Q2_K / Q3_K / i-quant type, uint8 [rows, cols / block weights * block bytes]: every
    byte random but the fp16 scales (small, finite)."""
    from gguf.quants import GGML_QUANT_SIZES

    rng = np.random.default_rng(seed)
    per, block = GGML_QUANT_SIZES[qtype]
    nb = cols // per
    b = rng.integers(0, 256, size=(rows, nb, block), dtype=np.uint8)
    at, n = _SCALE_BYTES[qtype]
    b[..., at:at + 2 * n] = rng.uniform(0.001, 0.01, size=(rows, nb, n)).astype(np.float16).view(np.uint8)
    return b.reshape(rows, nb * block)


def dequantized_model(model, qtype: GGMLQuantizationType):
    """A deep copy of `model` whose 2-D weights are replaced by their `qtype` round trip."""
    import copy

    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.from_numpy(roundtrip(p.detach().numpy(), qtype)))
    return m


# ----------------------------------------------------------------------------------- K-quants
# gguf.quants dequantizes Q4_K / Q5_K / Q6_K but cannot quantize them: these are plain (no search)
# restatements of ggml's block layouts, checked against gguf.quants.dequantize in the tests.

_IQ4_TYPES = (GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS)


def encode_any(w: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType]:
    """w fp32 [..., cols] -> (array GGUFWriter stores, the type written). Like llama.cpp's converter,
    a tensor whose rows the block type cannot split is written F16 instead."""
    from gguf.quants import GGML_QUANT_SIZES

    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return w.astype(np.float32 if qtype == GGMLQuantizationType.F32 else np.float16), qtype
    if w.shape[-1] % GGML_QUANT_SIZES[qtype][0]:
        return w.astype(np.float16), GGMLQuantizationType.F16
    k = {GGMLQuantizationType.Q4_K: quantize_q4_k, GGMLQuantizationType.Q5_K: quantize_q5_k,
         GGMLQuantizationType.Q6_K: quantize_q6_k, GGMLQuantizationType.IQ4_NL: quantize_iq4_nl,
         GGMLQuantizationType.IQ4_XS: quantize_iq4_xs}.get(qtype)
    if k is None:
        return quantize(w.astype(np.float32), qtype), qtype
    flat = k(w.reshape(-1, w.shape[-1]))
    return flat.reshape(*w.shape[:-1], -1), qtype


def roundtrip_any(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """What a reader gets back for w written by `encode_any` as qtype (fp32, same shape)."""
    arr, qt = encode_any(w, qtype)
    if qt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return arr.astype(np.float32)
    return dequantize(arr, qt).reshape(w.shape).astype(np.float32)


_MOE_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def _moe_tensors(model):
    """(HF-style name, fp32 array) of a transformers MoE model, stacked experts split into
    gate / up / down [E, F, D] / [E, D, F] (transformers fuses gate and up as gate_up_proj)."""
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy()
        if name.endswith("experts.gate_up_proj"):
            f = a.shape[1] // 2
            yield name.replace("gate_up_proj", "gate_exps"), a[:, :f]
            yield name.replace("gate_up_proj", "up_exps"), a[:, f:]
        elif name.endswith("experts.down_proj"):
            yield name.replace("down_proj", "down_exps"), a
        else:
            yield name, a


def _moe_gguf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".")
    layer, rest = parts[2], ".".join(parts[3:-1])
    table = {**_BLOCK, "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
             "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
             "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
    if rest == "mlp.experts":  # stacked experts: ...mlp.experts.{gate,up,down}_exps
        return f"blk.{layer}.ffn_{parts[-1]}.weight"
    return f"blk.{layer}.{table[rest]}.{parts[-1]}"


def _kept_f32(name: str, a: np.ndarray) -> bool:
    """Tensors llama.cpp's converter keeps in F32: 1-D ones and the routers."""
    return a.ndim == 1 or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))


def write_moe_gguf(model, path: Path, qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
                   types: dict | None = None) -> Path:
    """Write a transformers Mixtral / Qwen2-MoE / Qwen3-MoE model as llama.cpp does.

    Routed experts are stacked per layer (`blk.N.ffn_{gate,up,down}_exps.weight`, [E, F, D] /
    [E, D, F]); routers, norms and biases are F32; other weights and the experts are `qtype` (F16
    for tensors whose rows the block type cannot split), or `types[gguf name]` where given (a llama.cpp
    mix's per-tensor types: Q4_K_M's Q6_K ffn_down in some layers).
    """
    cfg = model.config
    mt = cfg.model_type
    arch = _MOE_ARCH[mt]
    w = _header(cfg, path, arch, mt)
    n_exp = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    w.add_expert_count(n_exp)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if mt != "mixtral":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_file_type(int(qtype))
    for name, a in _moe_tensors(model):
        if mt == "mixtral" and name.endswith(("q_proj.weight", "k_proj.weight")):
            a = llama_cpp_permute(a, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        g = _moe_gguf_name(name)
        if _kept_f32(name, a):
            w.add_tensor(g, a.reshape(-1) if name.endswith("shared_expert_gate.weight") else a.astype(np.float32))
            continue
        arr, qt = encode_any(a, (types or {}).get(g, qtype))
        if qt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w.add_tensor(g, arr)
        else:
            w.add_tensor(g, arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantized_moe_model(model, qtype: GGMLQuantizationType, kept=None):
    """A deep copy of the transformers MoE `model` whose weights are what `write_moe_gguf` stores
    for them, read back (the lossless reference of a quantized MoE GGUF). `kept(name, array)`: the
    tensors the writer keeps in F32 (default: write_moe_gguf's)."""
    import copy

    kept = kept or _kept_f32
    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in m.named_parameters():
            a = p.detach().numpy()
            if kept(name, a):
                continue
            if name.endswith("experts.gate_up_proj"):  # gate and up are written as separate tensors
                f = a.shape[1] // 2
                a = np.concatenate([roundtrip_any(a[:, :f], qtype), roundtrip_any(a[:, f:], qtype)], axis=1)
            else:
                a = roundtrip_any(a, qtype)
            p.copy_(torch.from_numpy(a))
    return m


def write_deepseek_gguf(model, path: Path, legacy: bool = False,
                        experts_qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
                        tokenizer_from: Path | None = None) -> Path:
    """Write a transformers DeepSeek-V2/V3 model as llama.cpp's deepseek2 converter does.

    Restated from llama.cpp's converter (not from tiered's reader), and loaded by llama.cpp itself
    (ec98e2002, early 2026) with logits equal to transformers' up to its f16 KV cache:
    - MLA layout (`legacy` False, llama.cpp since April 2025): head_count_kv 1, key_length R + r,
      value_length R, key_length_mla n + r, value_length_mla v, and kv_b_proj split per head into
      attn_k_b (numpy [H, R, n]: each head's key rows transposed) and attn_v_b ([H, v, R]);
      legacy: one attn_kv_b, head_count_kv = heads, key_length n + r, value_length v.
    - RoPE rows as they are (llama.cpp's NORM RoPE rotates DeepSeek's interleaved pairs).
    - expert_gating_func 2 (sigmoid) for V3, with exp_probs_b.bias and the group counts; 1 (softmax)
      for V2; expert_weights_scale / _norm; YaRN's yarn_log_multiplier = 0.1 mscale_all_dim.
    - tokenizer.ggml.model "none" (the fixtures have no tokenizer) with deepseek2.vocab_size, or
      the tokenizer keys of another GGUF file (`tokenizer_from`).
    Routed experts (stacked) in `experts_qtype`, everything else F32.
    """
    import gguf

    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    L, H, nh = c.num_hidden_layers, c.hidden_size, c.num_attention_heads
    dn, dr, dv, kr, qr = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank, c.q_lora_rank
    rp = dict(c.rope_parameters or {})
    w = GGUFWriter(str(path), "deepseek2")
    w.add_name(f"tiny-{c.model_type}")
    w.add_block_count(L)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(H)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(nh)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(float(rp.get("rope_theta", 10000.0)))
    w.add_rope_dimension_count(dr)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_vocab_size(c.vocab_size)
    w.add_q_lora_rank(qr or 0)
    w.add_kv_lora_rank(kr)
    if legacy:
        w.add_head_count_kv(nh)
        w.add_key_length(dn + dr)
        w.add_value_length(dv)
    else:
        w.add_head_count_kv(1)
        w.add_key_length(kr + dr)
        w.add_value_length(kr)
        w.add_key_length_mla(dn + dr)
        w.add_value_length_mla(dv)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(float(c.routed_scaling_factor))
    v3 = c.model_type == "deepseek_v3"
    w.add_expert_weights_norm(bool(v3 and c.norm_topk_prob))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if v3 and (c.n_group or 1) > 1:
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
    if rp.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rp["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rp["original_max_position_embeddings"]))
        w.add_rope_scaling_yarn_log_mul(0.1 * float(rp["mscale_all_dim"]))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if tokenizer_from is None:
        w.add_tokenizer_model("none")
    else:  # the tokenizer keys as tiered's benchmark writers copy them
        from tiered.bench.gguf_moe import add_tokenizer, read_tokenizer

        add_tokenizer(w, read_tokenizer(tokenizer_from, c.vocab_size)[0])

    def put(name: str, a: np.ndarray, qtype: GGMLQuantizationType = GGMLQuantizationType.F32) -> None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        if qtype == GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, encode(a, qtype), raw_dtype=qtype)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    put("output.weight", sd["lm_head.weight"])
    for i in range(L):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        if qr:
            put(b + "attn_q_a.weight", sd[p + "self_attn.q_a_proj.weight"])
            put(b + "attn_q_a_norm.weight", sd[p + "self_attn.q_a_layernorm.weight"])
            put(b + "attn_q_b.weight", sd[p + "self_attn.q_b_proj.weight"])
        else:
            put(b + "attn_q.weight", sd[p + "self_attn.q_proj.weight"])
        put(b + "attn_kv_a_mqa.weight", sd[p + "self_attn.kv_a_proj_with_mqa.weight"])
        put(b + "attn_kv_a_norm.weight", sd[p + "self_attn.kv_a_layernorm.weight"])
        kvb = sd[p + "self_attn.kv_b_proj.weight"]  # [nh (dn + dv), kr]
        if legacy:
            put(b + "attn_kv_b.weight", kvb)
        else:
            kv = kvb.reshape(nh, dn + dv, kr)
            put(b + "attn_k_b.weight", kv[:, :dn, :].transpose(0, 2, 1))
            put(b + "attn_v_b.weight", kv[:, dn:, :])
        put(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        if i < c.first_k_dense_replace:
            for n in ("gate", "up", "down"):
                put(b + f"ffn_{n}.weight", sd[p + f"mlp.{n}_proj.weight"])
            continue
        put(b + "ffn_gate_inp.weight", sd[p + "mlp.gate.weight"])
        if p + "mlp.gate.e_score_correction_bias" in sd:
            put(b + "exp_probs_b.bias", sd[p + "mlp.gate.e_score_correction_bias"])
        gu = sd[p + "mlp.experts.gate_up_proj"]  # [E, 2 Ie, H], gate first
        Ie = c.moe_intermediate_size
        put(b + "ffn_gate_exps.weight", gu[:, :Ie, :], experts_qtype)
        put(b + "ffn_up_exps.weight", gu[:, Ie:, :], experts_qtype)
        put(b + "ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"], experts_qtype)
        for n in ("gate", "up", "down"):
            put(b + f"ffn_{n}_shexp.weight", sd[p + f"mlp.shared_experts.{n}_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _finish_metadata(w, vocab_size: int, tokenizer_from, drop, extra) -> None:
    """The metadata every MoE test writer ends with: the vocabulary size, the tokenizer (none, or copied
    from `tokenizer_from`'s GGUF as tiered's benchmark writers copy it), `drop`'s keys removed and
    `extra(w)` (a test's own additions)."""
    w.add_vocab_size(vocab_size)
    if tokenizer_from is None:
        w.add_tokenizer_model("none")
    else:
        from tiered.bench.gguf_moe import add_tokenizer, read_tokenizer

        add_tokenizer(w, read_tokenizer(tokenizer_from, vocab_size)[0])
    for key in drop:
        del w.kv_data[0][key]
    if extra is not None:
        extra(w)


def write_glm4_moe_gguf(model, path: Path, qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
                        mtp: bool = False, tokenizer_from: Path | None = None, drop: tuple[str, ...] = (),
                        extra=None) -> Path:
    """Write a transformers GLM-4.5 MoE model (glm4_moe) as llama.cpp's glm4moe converter does.

    Restated from llama.cpp's convert_hf_to_gguf.py (Glm4MoeModel and its TextModel base, early
    2026) and its loader (src/models/glm4-moe.cpp), not from tiered's reader; llama.cpp itself
    (llama-cpp-python 0.3.36) scores the F32 files as transformers does, to 1e-6:
    - TextModel's keys (context_length, embedding_length, feed_forward_length, head_count(_kv),
      rope.freq_base, layer_norm_rms_epsilon, expert_used_count, expert_group_count /
      expert_group_used_count from n_group / topk_group, key_length / value_length only when the
      config has a head_dim), then Glm4MoeModel's: rope.dimension_count int(head_dim *
      partial_rotary_factor), expert_count, expert_feed_forward_length, expert_shared_count,
      leading_dense_block_count, expert_gating_func 2 (sigmoid), expert_weights_scale / _norm.
    - q/k rows as they are (no llama permutation: llama.cpp runs glm4moe with NEOX RoPE);
      post_attention_layernorm is `post_attention_norm`; the score-correction bias
      `exp_probs_b.bias`; routed experts stacked; shared experts `ffn_*_shexp`.
    - `mtp`: one multi-token-prediction layer appended as llama.cpp writes GLM-4.5's
      (block_count = num_hidden_layers + 1, nextn_predict_layers 1): an ordinary MoE block
      (here a copy of the last layer's tensors, scaled) plus its nextn.* tensors (random).
    - tokenizer.ggml.model "none" with vocab_size, or the tokenizer keys of `tokenizer_from`.
    1-D tensors and the routers F32, the other 2-D tensors and the experts `qtype` (F16 where the
    block type cannot split a row). `drop`: metadata keys left out; then `extra(writer)` adds any.
    """
    import gguf

    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    L, H = c.num_hidden_layers, c.hidden_size
    head_dim = getattr(c, "head_dim", None)
    rp = dict(c.rope_parameters or {})
    w = GGUFWriter(str(path), "glm4moe")
    w.add_name(f"tiny-{c.model_type}")
    w.add_block_count(L + mtp)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(H)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(rp.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_group_count(c.n_group)
    w.add_expert_group_used_count(c.topk_group)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(int(qtype))
    hd = head_dim or H // c.num_attention_heads
    w.add_rope_dimension_count(int(hd * rp.get("partial_rotary_factor", 0.5)))
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(float(c.routed_scaling_factor))
    w.add_expert_weights_norm(bool(c.norm_topk_prob))
    if mtp:
        w.add_nextn_predict_layers(1)
    _finish_metadata(w, c.vocab_size, tokenizer_from, drop, extra)

    def put(name: str, a: np.ndarray, router: bool = False) -> None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        if a.ndim == 1 or router:
            w.add_tensor(name, a)
            return
        arr, qt = encode_any(a, qtype)
        if qt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=qt)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    put("output.weight", sd["lm_head.weight"])
    Ie = c.moe_intermediate_size
    for i in range(L + mtp):
        src = min(i, L - 1)
        p, b = f"model.layers.{src}.", f"blk.{i}."
        scale = 0.5 if i >= L else 1.0  # the MTP layer: other weights than any main layer's
        put(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(b + "post_attention_norm.weight", sd[p + "post_attention_layernorm.weight"])
        for n in ("q", "k", "v"):
            put(b + f"attn_{n}.weight", scale * sd[p + f"self_attn.{n}_proj.weight"])
            if p + f"self_attn.{n}_proj.bias" in sd:
                put(b + f"attn_{n}.bias", sd[p + f"self_attn.{n}_proj.bias"])
        if p + "self_attn.q_norm.weight" in sd:
            put(b + "attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"])
            put(b + "attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"])
        put(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        if src < c.first_k_dense_replace:
            for n in ("gate", "up", "down"):
                put(b + f"ffn_{n}.weight", sd[p + f"mlp.{n}_proj.weight"])
        else:
            put(b + "ffn_gate_inp.weight", sd[p + "mlp.gate.weight"], router=True)
            put(b + "exp_probs_b.bias", sd[p + "mlp.gate.e_score_correction_bias"])
            gu = sd[p + "mlp.experts.gate_up_proj"]  # [E, 2 Ie, H], gate first
            put(b + "ffn_gate_exps.weight", scale * gu[:, :Ie, :])
            put(b + "ffn_up_exps.weight", gu[:, Ie:, :])
            put(b + "ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"])
            for n in ("gate", "up", "down"):
                put(b + f"ffn_{n}_shexp.weight", sd[p + f"mlp.shared_experts.{n}_proj.weight"])
        if i >= L:
            rng = np.random.default_rng(i)
            put(b + "nextn.eh_proj.weight", rng.standard_normal((H, 2 * H)).astype(np.float32))
            put(b + "nextn.enorm.weight", np.ones(H, np.float32))
            put(b + "nextn.hnorm.weight", np.ones(H, np.float32))
            put(b + "nextn.shared_head_norm.weight", np.ones(H, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantized_glm4_moe_model(model, qtype: GGMLQuantizationType):
    """A deep copy of the transformers glm4_moe `model` whose weights are what
    `write_glm4_moe_gguf` stores for them (qtype), read back: its lossless reference."""
    return dequantized_moe_model(model, qtype, kept=lambda name, a: a.ndim == 1 or name.endswith("mlp.gate.weight"))


# ------------------------------------------------------------------------------------------ gpt-oss
def quantize_mxfp4_ggml(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w fp32 [..., K] (K % 32 == 0) -> (ggml MXFP4 blocks uint8 [..., K / 32 * 17], the values they
    encode fp32 [..., K]), restated from ggml's quantize_row_mxfp4_ref and block_mxfp4: per 32 inputs
    the byte e = floor(log2(amax)) - 2 + 127, then 16 bytes, input j in byte j's low nibble and 16 + j
    in its high one; a value is kvalues_mxfp4[code] (the doubled e2m1 table) * 2^(e - 128), the code the
    nearest (the first of equals)."""
    kvalues = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)
    *lead, K = w.shape
    g = w.astype(np.float32).reshape(-1, 32)  # (blocks, 32)
    amax = np.abs(g).max(-1)
    e = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 2.0 ** -126))) - 2 + 127, 0).astype(np.uint8)
    d = np.ldexp(np.float32(1), e.astype(np.int32) - 128).astype(np.float32)  # (blocks,)
    code = np.abs(g[..., None] / d[:, None, None] - kvalues).argmin(-1).astype(np.uint8)  # (blocks, 32)
    qs = code[:, :16] | (code[:, 16:] << 4)
    values = (kvalues[code] * d[:, None]).reshape(*lead, K)
    return np.concatenate([e[:, None], qs], 1).reshape(*lead, K // 32 * 17), values


def mxfp4_experts(model) -> dict:
    """The MXFP4 encoding of every expert weight of a transformers GptOssForCausalLM, as llama.cpp's file
    holds it: HF name -> (ggml blocks of gate [E, F, K/32*17], of up, their values fp32 as the HF
    parameter's layout) for gate_up_proj, (blocks [E, D, F/32*17], values) for down_proj."""
    out = {}
    for name, p in model.named_parameters():
        if name.endswith("experts.gate_up_proj"):
            a = p.detach().float().numpy().transpose(0, 2, 1)  # (E, 2F, D)
            (gb, gv), (ub, uv) = quantize_mxfp4_ggml(a[:, 0::2]), quantize_mxfp4_ggml(a[:, 1::2])
            values = np.empty_like(a)
            values[:, 0::2], values[:, 1::2] = gv, uv
            out[name] = (gb, ub, values.transpose(0, 2, 1))
        elif name.endswith("experts.down_proj"):
            blocks, values = quantize_mxfp4_ggml(p.detach().float().numpy().transpose(0, 2, 1))  # (E, D, F)
            out[name] = (blocks, values.transpose(0, 2, 1))
    return out


def write_gpt_oss_gguf(model, path: Path, experts: str = "F32", qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
                       drop: tuple[str, ...] = (), extra=None, tokenizer_from: Path | None = None,
                       skip_tensors: tuple[str, ...] = (), swap_tensors: dict | None = None) -> Path:
    """Write a transformers GptOssForCausalLM as llama.cpp's gpt-oss converter does.

    Restated from llama.cpp's convert_hf_to_gguf.py (TextModel.set_gguf_parameters, GptOssModel; its
    conversion/gpt_oss.py, 2026) and its loader (src/models/openai-moe.cpp), not from tiered's reader:
    - arch "gpt-oss"; TextModel's keys: block_count, context_length, embedding_length,
      feed_forward_length (intermediate_size), head_count(_kv), YaRN's rope.scaling.{type, factor,
      original_context_length, yarn_beta_fast, yarn_beta_slow}, rope.freq_base,
      attention.layer_norm_rms_epsilon, expert_count, expert_used_count, key_length / value_length
      (head_dim), file_type; GptOssModel's attention.sliding_window and expert_feed_forward_length.
    - names: attn_norm, post_attention_norm (the pre-MLP norm), attn_{q,k,v,output}.{weight,bias}
      (rows as they are), attn_sinks.weight, ffn_gate_inp.{weight,bias} (the router), and the experts
      stacked with gate and up apart: gate_up_proj transposed to [E, 2F, D], its even rows
      ffn_gate_exps, odd rows ffn_up_exps, the bias split alike; down_proj transposed to [E, D, F].
    - types: 1-D tensors, every bias and the router F32; the other 2-D tensors `qtype` (F16 where the
      block type cannot split a row); the experts `experts`: "MXFP4" (ggml's block_mxfp4 from
      `quantize_mxfp4_ggml`, as the converter repacks OpenAI's MXFP4 experts) or a GGML type name.
    - tokenizer.ggml.model "none" with vocab_size, or the tokenizer keys of `tokenizer_from`.
    Malformed files for the refusal tests: `drop` metadata keys, then `extra(writer)`; `skip_tensors`
    GGUF names left out; `swap_tensors` GGUF name -> (array, type) written instead.
    """
    import gguf

    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    rp = dict(c.rope_parameters or {})
    w = GGUFWriter(str(path), "gpt-oss")
    w.add_name("tiny-gpt-oss")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    if rp.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rp["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rp["original_max_position_embeddings"]))
        w.add_rope_scaling_yarn_beta_fast(float(rp["beta_fast"]))
        w.add_rope_scaling_yarn_beta_slow(float(rp["beta_slow"]))
    w.add_rope_freq_base(float(rp["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_file_type(int(qtype))
    w.add_sliding_window(c.sliding_window)
    w.add_expert_feed_forward_length(c.intermediate_size)
    _finish_metadata(w, c.vocab_size, tokenizer_from, drop, extra)
    mx = mxfp4_experts(model) if experts == "MXFP4" else {}

    def put(name: str, a: np.ndarray, qt: GGMLQuantizationType | None = qtype) -> None:
        if name in skip_tensors:
            return
        if name in (swap_tensors or {}):
            a, qt = swap_tensors[name]
        elif qt is None:  # already ggml blocks (MXFP4)
            qt = GGMLQuantizationType.MXFP4
        elif a.ndim == 1 or qt == GGMLQuantizationType.F32:
            a, qt = np.ascontiguousarray(a, dtype=np.float32), GGMLQuantizationType.F32
        else:
            a, qt = encode_any(np.ascontiguousarray(a, dtype=np.float32), qt)
        if qt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, a, raw_dtype=qt)

    F32 = GGMLQuantizationType.F32
    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    put("output.weight", sd["lm_head.weight"])
    ex = GGMLQuantizationType.F32 if experts == "MXFP4" else GGMLQuantizationType[experts]
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(b + "post_attention_norm.weight", sd[p + "post_attention_layernorm.weight"])
        for n, hf in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj")):
            put(b + f"attn_{n}.weight", sd[p + f"self_attn.{hf}.weight"])
            put(b + f"attn_{n}.bias", sd[p + f"self_attn.{hf}.bias"], F32)
        put(b + "attn_sinks.weight", sd[p + "self_attn.sinks"], F32)
        put(b + "ffn_gate_inp.weight", sd[p + "mlp.router.weight"], F32)
        put(b + "ffn_gate_inp.bias", sd[p + "mlp.router.bias"], F32)
        gu = sd[p + "mlp.experts.gate_up_proj"].transpose(0, 2, 1)  # (E, 2F, D): gate the even rows
        gub = sd[p + "mlp.experts.gate_up_proj_bias"]
        if experts == "MXFP4":
            gate_blocks, up_blocks, _ = mx[p + "mlp.experts.gate_up_proj"]
            put(b + "ffn_gate_exps.weight", gate_blocks, None)
            put(b + "ffn_up_exps.weight", up_blocks, None)
            put(b + "ffn_down_exps.weight", mx[p + "mlp.experts.down_proj"][0], None)
        else:
            put(b + "ffn_gate_exps.weight", gu[:, 0::2], ex)
            put(b + "ffn_up_exps.weight", gu[:, 1::2], ex)
            put(b + "ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"].transpose(0, 2, 1), ex)
        put(b + "ffn_gate_exps.bias", gub[:, 0::2], F32)
        put(b + "ffn_up_exps.bias", gub[:, 1::2], F32)
        put(b + "ffn_down_exps.bias", sd[p + "mlp.experts.down_proj_bias"], F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantized_gpt_oss_model(model, experts: str = "F32", qtype: GGMLQuantizationType = GGMLQuantizationType.F32):
    """A deep copy of the transformers GptOssForCausalLM `model` whose weights are what
    `write_gpt_oss_gguf(model, ..., experts, qtype)` stores for them, read back: its lossless reference."""
    import copy

    m = copy.deepcopy(model)
    mx = mxfp4_experts(model) if experts == "MXFP4" else {}
    ex = None if experts == "MXFP4" else GGMLQuantizationType[experts]
    with torch.no_grad():
        for name, p in m.named_parameters():
            a = p.detach().numpy()
            if name in mx:
                a = mx[name][-1]
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # written as [E, out, in]
                t = a.transpose(0, 2, 1)
                if name.endswith("gate_up_proj"):  # gate and up apart
                    t = np.stack([roundtrip_any(t[:, 0::2], ex), roundtrip_any(t[:, 1::2], ex)], 2).reshape(t.shape)
                else:
                    t = roundtrip_any(t, ex)
                a = t.transpose(0, 2, 1)
            elif a.ndim == 2 and not name.endswith("mlp.router.weight"):
                a = roundtrip_any(a, qtype)
            else:
                continue
            p.copy_(torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)))
    return m


_GEMMA3_BLOCK = {**_BLOCK, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}


def write_gemma3_gguf(model, path: Path, qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
                      pattern: bool = True, sentencepiece: Path | None = None) -> Path:
    """write_gemma_gguf for a Gemma3ForCausalLM."""
    return write_gemma_gguf(model, path, qtype, pattern, sentencepiece)


def write_gemma_gguf(model, path: Path, qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
                     pattern: bool = True, sentencepiece: Path | None = None) -> Path:
    """Write a transformers Gemma3ForCausalLM or Gemma2ForCausalLM (fp32) as llama.cpp's Gemma3Model /
    Gemma2Model converter does (Gemma 2: its soft caps as keys, one RoPE): every norm
    stored as 1 + weight (Gemma's RMSNorm multiplies by it), `post_attention_norm` / `ffn_norm` /
    `post_ffw_norm` the sandwich norms, no output.weight (tied), q/k rows as they are, the global layers' RoPE
    scaling as rope.scaling.*, the window as attention.sliding_window. `pattern`: also write the model's
    sliding layers as attention.sliding_window_pattern flags (else a reader takes llama.cpp's every-6th rule).
    2-D weights in `qtype`, 1-D tensors F32; tokenizer.ggml.model "none", or `sentencepiece`'s vocabulary (a
    SentencePiece .model file) as the converter writes Gemma's (add_sentencepiece_vocab)."""
    cfg = model.config
    arch = "gemma2" if cfg.model_type == "gemma2" else "gemma3"
    full = cfg.rope_parameters if arch == "gemma2" else cfg.rope_parameters["full_attention"]
    w = _header(cfg, path, arch, arch)
    for key in ("key_length", "value_length"):
        w.kv_data[0].pop(f"{arch}.attention.{key}", None)
    w.kv_data[0].pop(f"{arch}.rope.freq_base")
    if arch == "gemma2":  # the converter's soft caps
        w.add_float32("gemma2.attn_logit_softcapping", cfg.attn_logit_softcapping)
        w.add_float32("gemma2.final_logit_softcapping", cfg.final_logit_softcapping)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(float(full["rope_theta"]))
    if full.get("rope_type", "default") == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(full["factor"]))
    w.add_sliding_window(cfg.sliding_window)
    if pattern:
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    w.add_file_type(int(qtype))
    if sentencepiece is None:
        w.add_tokenizer_model("none")
    else:
        add_sentencepiece_vocab(w, sentencepiece, ("<start_of_turn>", "<end_of_turn>"))
        w.add_add_space_prefix(False)  # Gemma3Model.set_vocab's
    state = {k: v.detach().float().numpy() + (1.0 if k.endswith("norm.weight") else 0.0)
             for k, v in model.state_dict().items() if k != "lm_head.weight"}
    return _write_state(w, state, _GEMMA3_BLOCK, qtype, path)


def add_sentencepiece_vocab(w, model_file: Path, special: tuple[str, ...] = ()) -> None:
    """The tokenizer keys llama.cpp's converter writes for a SentencePiece vocabulary (_set_vocab_sentencepiece):
    tokenizer.ggml.model "llama", every piece as spelled (with its U+2581 spaces), its score and its type (normal,
    unknown, control, unused or byte by the processor; `special`'s pieces control, as tokenizer_config.json's special
    added tokens make them: Gemma's <start_of_turn> / <end_of_turn>), the bos / eos / unk / pad ids, add_bos_token."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    n = sp.get_piece_size()
    pieces = [sp.id_to_piece(i) for i in range(n)]

    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i) or pieces[i] in special:
            return 3
        return 5 if sp.is_unused(i) else 6 if sp.is_byte(i) else 1
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([p.encode("utf-8") for p in pieces])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types([kind(i) for i in range(n)])
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_pad_token_id(sp.pad_id())
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)


def _write_state(w, state: dict, block: dict, qtype: GGMLQuantizationType, path: Path) -> Path:
    """Write HF tensors `state` (name -> fp32 array) under llama.cpp's names (`block`: a layer's HF module path ->
    its GGUF name; _GLOBAL's outside the layers), 2-D ones in `qtype` and 1-D F32, then close `w`."""
    for name, a in state.items():
        parts = name.split(".")
        gname = (_GLOBAL[name] if parts[:2] != ["model", "layers"]
                 else f"blk.{parts[2]}.{block['.'.join(parts[3:-1])]}.{parts[-1]}")
        if a.ndim == 1 or qtype == GGMLQuantizationType.F32:
            w.add_tensor(gname, a.astype(np.float32))
        else:
            w.add_tensor(gname, encode(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_PHI3_BLOCK = {**_BLOCK, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


def write_phi3_gguf(model, path: Path, qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
                    sentencepiece: Path | None = None) -> Path:
    """Write a transformers Phi3ForCausalLM (fp32) as llama.cpp's Phi3MiniModel converter does: q/k/v fused as
    `attn_qkv`, gate/up fused as `ffn_up` (the gate first), rope.dimension_count the partial RoPE's width,
    attention.sliding_window where the config sets one. 2-D weights in `qtype`, 1-D F32; tokenizer "none", or
    `sentencepiece`'s vocabulary (add_sentencepiece_vocab; Phi-3's chat markers control tokens)."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    w = _header(cfg, path, "phi3", "phi3")
    w.kv_data[0].pop("phi3.rope.dimension_count")
    w.kv_data[0].pop("phi3.rope.freq_base")
    w.add_rope_dimension_count(int(head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0)))
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    if cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "longrope":  # the converter's LongRoPE: the factors as tensors, the attention factor
        import math

        orig = cfg.original_max_position_embeddings
        w.add_rope_scaling_orig_ctx_len(orig)
        scale = rope.get("factor") or cfg.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    w.add_file_type(int(qtype))
    if sentencepiece is None:
        w.add_tokenizer_model("none")
    else:
        add_sentencepiece_vocab(w, sentencepiece, ("<|user|>", "<|assistant|>", "<|end|>"))
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    return _write_state(w, state, _PHI3_BLOCK, qtype, path)
