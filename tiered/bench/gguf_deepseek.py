"""A dummy-weight DeepSeek-V2-Lite GGUF (llama.cpp's "deepseek2" architecture) at the real widths.

DeepSeek-V2-Lite is the MoE people run from GGUF on CPUs and small GPUs (15.7 B parameters, 2.4 B
active): 27 layers of hidden 2048, multi-head latent attention (16 heads, KV latent 512 + a shared
RoPE key of 64, per-head no-RoPE key 128 and value 128, no query low rank), layer 0 a dense FFN of
10944, the others 64 routed experts of 1408 (top-6, softmax, no renormalization) plus 2 shared
experts, YaRN RoPE (factor 40 over 4096 positions, mscale 0.707). This writes it as llama.cpp's
current converter does (tiered/checkpoint/gguf_file.py reads it): kv_b_proj split per head into
attn_k_b / attn_v_b, head_count_kv 1 with the _mla key and value lengths, the experts stacked.

Blocks are drawn as tiered/bench/gguf_moe.py draws them (random Q4_0 / Q8_0 codes and scales, std
0.02; the embedding about 1 and o_proj 0.004 so that tokens spread over the experts); routers F32
Gaussian, norms 1. The kv_b halves are F16 (llama.cpp's converter keeps them at least that wide),
the output matrix Q8_0. llama.cpp picks the no-query-low-rank ("lite") layout by the layer count
(26 or 27), so a file llama.cpp reads has all 27 layers. The tokenizer is copied from another GGUF
(SmolLM2's: its 49,152-token vocabulary sizes the embedding and output; DeepSeek's has 102,400).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tiered.bench.gguf_moe import _BLOCK_BYTES, add_tokenizer, random_blocks, read_tokenizer, write_tensors

_STD = {"token_embd": 1.0, "attn_output": 0.004}


@dataclass(frozen=True)
class MLAShape:
    """The widths of a DeepSeek-V2 decoder with latent attention (elements unless noted)."""

    layers: int = 27
    hidden: int = 2048
    heads: int = 16
    kv_rank: int = 512
    rope_dim: int = 64
    nope_dim: int = 128
    v_dim: int = 128
    dense_layers: int = 1
    dense_ffn: int = 10944
    experts: int = 64
    top_k: int = 6
    expert_ffn: int = 1408
    shared: int = 2
    vocab: int = 102400

    def tag(self, qtype: str) -> str:
        """A file-name tag of this shape and block type."""
        return (f"deepseek2-L{self.layers}-D{self.hidden}-H{self.heads}-kv{self.kv_rank}r{self.rope_dim}-"
                f"E{self.experts}k{self.top_k}F{self.expert_ffn}s{self.shared}-{qtype}")


def deepseek_v2_lite(layers: int = 27) -> MLAShape:
    """DeepSeek-V2-Lite's widths (27 layers in the real model)."""
    return MLAShape(layers=layers)


def write_dummy_deepseek_gguf(path: str | os.PathLike, shape: MLAShape, qtype: str = "Q4_0", embed_qtype: str = "Q8_0",
                              tokenizer_from: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """Write `shape` as a llama.cpp "deepseek2" GGUF at `path` (see the module docstring).

    Args:
        qtype: block type of the attention projections (but kv_b), the FFNs and the experts.
        embed_qtype: block type of the token embedding and the output matrix.
        tokenizer_from: a GGUF whose tokenizer is copied (its vocabulary sets the rows), or None.
    Returns the path. Raises ValueError for block types other than Q4_0 / Q8_0.
    """
    import gguf
    from gguf import GGMLQuantizationType, GGUFWriter

    for q in (qtype, embed_qtype):
        if q not in _BLOCK_BYTES:
            raise ValueError(f"write_dummy_deepseek_gguf: block type {q!r} (Q4_0 or Q8_0)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok, vocab = read_tokenizer(tokenizer_from, shape.vocab)
    s = shape
    D, H, R, r, n, v = s.hidden, s.heads, s.kv_rank, s.rope_dim, s.nope_dim, s.v_dim
    w = GGUFWriter(str(path), "deepseek2")
    w.add_name(f"dummy {s.tag(qtype)}")
    w.add_block_count(s.layers)
    w.add_context_length(163840)
    w.add_embedding_length(D)
    w.add_feed_forward_length(s.dense_ffn)
    w.add_head_count(H)
    w.add_head_count_kv(1)
    w.add_key_length(R + r)
    w.add_value_length(R)
    w.add_key_length_mla(n + r)
    w.add_value_length_mla(v)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(r)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(40.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_rope_scaling_yarn_log_mul(0.0707)
    w.add_leading_dense_block_count(s.dense_layers)
    w.add_vocab_size(vocab)
    w.add_kv_lora_rank(R)
    w.add_expert_feed_forward_length(s.expert_ffn)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.top_k)
    w.add_expert_shared_count(s.shared)
    w.add_expert_weights_scale(1.0)
    w.add_expert_weights_norm(False)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_file_type(int(GGMLQuantizationType[qtype]))
    add_tokenizer(w, tok)
    E, F, Fs = s.experts, s.expert_ffn, s.expert_ffn * s.shared
    specs = [("token_embd.weight", (vocab, D), embed_qtype)]
    for i in range(s.layers):
        p = f"blk.{i}."
        specs += [(p + "attn_norm.weight", (D,), "ONES"), (p + "attn_q.weight", (H * (n + r), D), qtype),
                  (p + "attn_kv_a_mqa.weight", (R + r, D), qtype), (p + "attn_kv_a_norm.weight", (R,), "ONES"),
                  (p + "attn_k_b.weight", (H, R, n), "F16"), (p + "attn_v_b.weight", (H, v, R), "F16"),
                  (p + "attn_output.weight", (D, H * v), qtype), (p + "ffn_norm.weight", (D,), "ONES")]
        if i < s.dense_layers:
            specs += [(p + "ffn_gate.weight", (s.dense_ffn, D), qtype), (p + "ffn_up.weight", (s.dense_ffn, D), qtype),
                      (p + "ffn_down.weight", (D, s.dense_ffn), qtype)]
        else:
            specs += [(p + "ffn_gate_inp.weight", (E, D), "F32"), (p + "ffn_gate_exps.weight", (E, F, D), qtype),
                      (p + "ffn_up_exps.weight", (E, F, D), qtype), (p + "ffn_down_exps.weight", (E, D, F), qtype),
                      (p + "ffn_gate_shexp.weight", (Fs, D), qtype), (p + "ffn_up_shexp.weight", (Fs, D), qtype),
                      (p + "ffn_down_shexp.weight", (D, Fs), qtype)]
    specs += [("output_norm.weight", (D,), "ONES"), ("output.weight", (vocab, D), embed_qtype)]

    def blocks(rng, name, shp, kind):
        std = _STD.get(name.split(".")[-2], 0.02)
        if kind == "F16":
            return (rng.standard_normal(shp, np.float32) * np.float32(std)).astype(np.float16).view(np.uint8)
        return random_blocks(rng, int(np.prod(shp[:-1])), shp[-1], kind, std).reshape(shp[:-1] + (-1,))
    write_tensors(w, specs, {**{k: (32, b) for k, b in _BLOCK_BYTES.items()}, "F16": (1, 2)}, blocks, seed)
    return path
