"""Write GGUF files from tiny transformers models the way llama.cpp's converter does.

This is an independent re-statement of `convert_hf_to_gguf.py` (llama.cpp) for the dense Llama
family, kept in tests/ so tiered's reader is checked against a writer it does not share code with:
the tensor-name table here is written out separately from tiered/checkpoint/gguf_file.py, and
q/k rows of "llama"-architecture models are permuted exactly as LlamaModel.permute does.

Norms and biases (1-D tensors) are always written F32, as llama.cpp does; 2-D weights are
written in the requested type (F32, F16, BF16, Q8_0, Q4_0, Q4_1) through gguf.quants.quantize.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

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


def write_gguf(model, path: Path, arch: str, qtype: GGMLQuantizationType = GGMLQuantizationType.F32) -> Path:
    """Write a transformers dense Llama-family model as a GGUF file.

    Args:
        model: a LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM (fp32).
        path: the .gguf file to write.
        arch: GGUF architecture name: "llama", "qwen2" or "qwen3".
        qtype: type of the 2-D weights; 1-D tensors are always F32.
    """
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    assert rope.get("rope_type", "default") == "default", "the writer only handles plain RoPE"

    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(theta))
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(int(qtype))

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
        else:
            w.add_tensor(gguf_name(name), encode(t, qtype), raw_dtype=qtype)
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
    """Valid random Q4_K / Q6_K blocks uint8 [rows, cols / 256 * block_bytes] (gguf cannot quantize K types).

    Every byte is random except the fp16 super-block scales, which are set to small finite values.
    """
    rng = np.random.default_rng(seed)
    block = {GGMLQuantizationType.Q4_K: 144, GGMLQuantizationType.Q6_K: 210}[qtype]
    nb = cols // 256
    b = rng.integers(0, 256, size=(rows, nb, block), dtype=np.uint8)
    if qtype == GGMLQuantizationType.Q4_K:  # d, dmin (f16) then scales[12], qs[128]
        b[..., 0:4] = rng.uniform(0.001, 0.01, size=(rows, nb, 2)).astype(np.float16).view(np.uint8)
    else:  # ql[128], qh[64], scales[16] (int8), d (f16)
        b[..., 208:210] = rng.uniform(0.001, 0.01, size=(rows, nb, 1)).astype(np.float16).view(np.uint8)
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
