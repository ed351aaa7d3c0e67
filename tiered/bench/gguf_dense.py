"""A dummy-weight dense Llama GGUF at real layer widths, quantized as llama.cpp's Q4_K_M, for
comparing engines on the file type most people download.

Q4_K_M is llama.cpp's default recommendation: Q4_K super-blocks (256 weights: fp16 d and dmin,
eight 6-bit sub-block scales and mins, 4-bit codes; w = d*sc*q - dmin*m) for most matrices, and
Q6_K (256 weights: 16 int8 sub-scales, 6-bit codes; w = d*sc*(q - 32)) for the output matrix and
for attn_v and ffn_down in the layers `use_more_bits` picks (llama.cpp's llama_tensor_get_type:
the first and last eighth of the layers and every third one between). Real 8B files are ~5 GB and
nothing is downloaded here, so this writes N layers of Llama-3-8B's widths (hidden 4096, FFN
14336, 32 query / 8 KV heads of 128) with random blocks, as tiered/bench/gguf_moe.py does for MoE.

Blocks are drawn directly, centred and with weights of std about 0.02 (the embedding's about 1,
attn_output's 0.004, as gguf_moe.py explains): Q4_K with every sub-block scale and min 8, dmin =
7.5 d, so w = 8 d (q - 7.5) over uniform 4-bit codes; Q6_K with every sub-scale 8, w = 8 d (q - 32)
over uniform 6-bit codes; d per super-block times a uniform factor in [0.5, 1.5]. The tokenizer is
copied from another GGUF (SmolLM2's), so llama.cpp loads the file as a real model. The mixes (MIXES): Q4_K_M,
Q5_K_M (Q5_K where Q4_K_M has Q4_K) and IQ4_XS (llama.cpp's i-quant: every tensor IQ4_XS but the output's Q6_K,
uniform codebook indices, every group's scale 8 d).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tiered.bench.gguf_moe import _STD, add_tokenizer, read_tokenizer, write_tensors
from tiered.checkpoint.handle import BLOCK_FORMATS

K_BLOCK_BYTES = {t: BLOCK_FORMATS[t][1] for t in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS")}  # bytes per super-block of 256
# std of w / d: 8 (q - 7.5), q in 0..15; 8 (q - 15.5), q in 0..31; 8 (q - 32), q in 0..63; IQ4_XS: 8 v, v a uniform
# draw of kvalues_iq4nl's 16 values (std 67.2)
_K_CODE_STD = {"Q4_K": 8 * 4.61, "Q5_K": 8 * 9.23, "Q6_K": 8 * 18.47, "IQ4_XS": 8 * 67.2}
# llama.cpp's file types (LLAMA_FTYPE_MOSTLY_*) and main block type of the mixes write_dummy_dense_gguf writes
MIXES = {"Q4_K_M": (15, "Q4_K"), "Q5_K_M": (17, "Q5_K"), "IQ4_XS": (30, "IQ4_XS")}


@dataclass(frozen=True)
class DenseShape:
    """The widths of a Llama decoder (elements unless noted): layers [count], hidden D, FFN F,
    heads / kv_heads of head_dim, vocab (when no tokenizer is copied)."""

    layers: int = 8
    hidden: int = 4096
    ffn: int = 14336
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 32000

    def tag(self, scheme: str, arch: str = "llama") -> str:
        """A file-name tag of this shape, architecture and quantization scheme."""
        return f"{arch}-L{self.layers}-D{self.hidden}-F{self.ffn}-H{self.heads}x{self.head_dim}kv{self.kv_heads}-{scheme}"


def llama3_8b(layers: int = 8) -> DenseShape:
    """Llama-3-8B's layer widths (32 layers in the real model), `layers` of them."""
    return DenseShape(layers=layers)


def random_k_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: str, std: float) -> np.ndarray:
    """uint8 [rows, cols / 256 * block bytes]: random Q4_K / Q5_K / Q6_K / IQ4_XS super-blocks of centred weights
    with about `std` (module docstring; IQ4_XS: uniform codebook indices, every group's scale 8 d).

    Raises:
        ValueError: another block type, or cols not a multiple of 256.
    """
    if qtype not in K_BLOCK_BYTES or cols % 256:
        raise ValueError(f"random_k_blocks: {qtype} with {cols} columns (Q4_K / Q5_K / Q6_K / IQ4_XS, a multiple of 256)")
    nb, bs = cols // 256, K_BLOCK_BYTES[qtype]
    b = np.frombuffer(rng.bytes(rows * nb * bs), np.uint8).reshape(rows, nb, bs).copy()
    d = (std / _K_CODE_STD[qtype] * rng.uniform(0.5, 1.5, (rows, nb, 1))).astype(np.float16)
    if qtype in ("Q4_K", "Q5_K"):  # d, dmin (fp16), scales[12] (6-bit sc and m of 8 sub-blocks), (qh[32],) qs[128]
        b[..., 0:2] = d.view(np.uint8)
        b[..., 2:4] = (d.astype(np.float32) * (7.5 if qtype == "Q4_K" else 15.5)).astype(np.float16).view(np.uint8)
        # sub-blocks 0-3: sc = scales[j] & 63, m = scales[j + 4] & 63; 4-7: the low nibbles of
        # scales[j + 4] and the top bits of scales[j - 4] / scales[j] (zero here): sc = m = 8
        b[..., 4:8], b[..., 8:12], b[..., 12:16] = 8, 8, 8 | (8 << 4)
    elif qtype == "IQ4_XS":  # d (fp16), scales_h (uint16), scales_l[4], qs[128]: every group's ls 40 (ls - 32 = 8)
        b[..., 0:2] = d.view(np.uint8)
        b[..., 2:4], b[..., 4:8] = 0xAA, 0x88  # the 2 high bits (2) and 4 low bits (8) of each group's ls
    else:  # ql[128], qh[64], scales[16] (int8), d (fp16)
        b[..., 192:208] = 8
        b[..., 208:210] = d.view(np.uint8)
    return b.reshape(rows, nb * bs)


def q4_k_m_type(name: str, layer: int, layers: int, main: str = "Q4_K") -> str:
    """The block type llama.cpp's Q4_K_M (Q5_K_M: `main` "Q5_K") gives a tensor (llama_tensor_get_type,
    use_more_bits); the IQ4_XS mix (`main` "IQ4_XS"): IQ4_XS but for the output matrix's Q6_K."""
    if main == "IQ4_XS":
        return "Q6_K" if name == "output.weight" else main
    more = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
    if name == "output.weight" or (name.split(".")[-2] in ("attn_v", "ffn_down") and more):
        return "Q6_K"
    return main


def _writer(path, arch: str, s: DenseShape, tag: str, tokenizer_from, context: int, eps: float, theta: float,
            file_type: int):
    """(a GGUFWriter at `path` for architecture `arch` with `s`'s sizes, the context, norm eps, RoPE base, file type
    and the tokenizer copied from `tokenizer_from`; the vocabulary size: the tokenizer's, else s.vocab)."""
    from gguf import GGUFWriter

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok, vocab = read_tokenizer(tokenizer_from, s.vocab)
    w = GGUFWriter(str(path), arch)
    w.add_name(f"dummy {tag}")
    w.add_block_count(s.layers)
    w.add_context_length(context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_freq_base(theta)
    w.add_vocab_size(vocab)
    w.add_file_type(file_type)
    add_tokenizer(w, tok)
    return w, vocab


def write_dummy_dense_gguf(path: str | os.PathLike, shape: DenseShape, tokenizer_from: str | os.PathLike | None = None,
                           seed: int = 0, mix: str = "Q4_K_M") -> Path:
    """Write `shape` as a llama.cpp "llama" GGUF in the Q4_K_M mix (`mix` "Q5_K_M": Q5_K where Q4_K_M has Q4_K) at
    `path` (module docstring).

    Args:
        tokenizer_from: a GGUF whose tokenizer metadata is copied (its vocabulary sets the
            embedding's and output's rows), or None: no tokenizer, `shape.vocab` rows.
    Returns the path.
    Raises:
        ValueError: a mix other than MIXES'.
    """
    if mix not in MIXES:
        raise ValueError(f"write_dummy_dense_gguf: mix must be one of {sorted(MIXES)}, got {mix!r}")
    s = shape
    file_type, main = MIXES[mix]
    w, vocab = _writer(path, "llama", s, s.tag(mix), tokenizer_from, context=8192, eps=1e-5, theta=500000.0,
                       file_type=file_type)
    w.add_rope_dimension_count(s.head_dim)
    D, F, hd = s.hidden, s.ffn, s.head_dim
    specs = [("token_embd.weight", (vocab, D), main, -1)]  # (name, torch-order shape, type, layer)
    for i in range(s.layers):
        p = f"blk.{i}."
        specs += [(p + "attn_norm.weight", (D,), "ONES", i), (p + "attn_q.weight", (s.heads * hd, D), None, i),
                  (p + "attn_k.weight", (s.kv_heads * hd, D), None, i), (p + "attn_v.weight", (s.kv_heads * hd, D), None, i),
                  (p + "attn_output.weight", (D, s.heads * hd), None, i), (p + "ffn_norm.weight", (D,), "ONES", i),
                  (p + "ffn_gate.weight", (F, D), None, i), (p + "ffn_up.weight", (F, D), None, i),
                  (p + "ffn_down.weight", (D, F), None, i)]
    specs += [("output_norm.weight", (D,), "ONES", -1), ("output.weight", (vocab, D), "Q6_K", -1)]
    specs = [(n, shp, kind or q4_k_m_type(n, i, s.layers, main)) for n, shp, kind, i in specs]
    write_tensors(w, specs, {k: (256, b) for k, b in K_BLOCK_BYTES.items()},
                  lambda rng, name, shp, kind: random_k_blocks(rng, shp[0], shp[1], kind, _STD.get(name.split(".")[-2], 0.02)),
                  seed)
    return path


def gemma3_4b(layers: int = 6) -> DenseShape:
    """Gemma 3 4B's layer widths (34 layers in the real model; hidden 2560, FFN 10240, 8 query / 4 KV heads of
    256), `layers` of them."""
    return DenseShape(layers=layers, hidden=2560, ffn=10240, heads=8, kv_heads=4, head_dim=256, vocab=262_208)


def write_dummy_gemma3_gguf(path: str | os.PathLike, shape: DenseShape, tokenizer_from: str | os.PathLike | None = None,
                            seed: int = 0, window: int = 1024) -> Path:
    """Write `shape` as a llama.cpp "gemma3" GGUF quantized as Google's QAT files and llama.cpp's Q4_0 are: Q4_0
    projections, the tied embedding (the output matrix too) Q6_K, F32 norms of ones (stored as Gemma's 1 + weight:
    weights of zero); 5 of every 6 layers sliding over `window` positions, llama.cpp's gemma3 rule.

    Args:
        tokenizer_from: a GGUF whose tokenizer metadata is copied (its vocabulary sets the embedding's rows; SmolLM2's
            49152 against Gemma's 262208 makes the output matrix 5x smaller than the real model's), or None.
    Returns the path.
    """
    from gguf import RopeScalingType

    from tiered.bench.gguf_moe import _BLOCK_BYTES, random_blocks

    s = shape
    w, vocab = _writer(path, "gemma3", s, s.tag("Q4_0", "gemma3"), tokenizer_from, context=131072,
                       eps=1e-6, theta=1_000_000.0, file_type=2)  # LLAMA_FTYPE_MOSTLY_Q4_0
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_scaling_type(RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(8.0)
    w.add_sliding_window(window)
    D, F, hd = s.hidden, s.ffn, s.head_dim
    specs = [("token_embd.weight", (vocab, D), "Q6_K")]  # (name, torch-order shape, type)
    for i in range(s.layers):
        p = f"blk.{i}."
        specs += [(p + "attn_norm.weight", (D,), "ONES"), (p + "attn_q.weight", (s.heads * hd, D), "Q4_0"),
                  (p + "attn_q_norm.weight", (hd,), "ONES"), (p + "attn_k.weight", (s.kv_heads * hd, D), "Q4_0"),
                  (p + "attn_k_norm.weight", (hd,), "ONES"), (p + "attn_v.weight", (s.kv_heads * hd, D), "Q4_0"),
                  (p + "attn_output.weight", (D, s.heads * hd), "Q4_0"), (p + "post_attention_norm.weight", (D,), "ONES"),
                  (p + "ffn_norm.weight", (D,), "ONES"), (p + "ffn_gate.weight", (F, D), "Q4_0"),
                  (p + "ffn_up.weight", (F, D), "Q4_0"), (p + "ffn_down.weight", (D, F), "Q4_0"),
                  (p + "post_ffw_norm.weight", (D,), "ONES")]
    specs += [("output_norm.weight", (D,), "ONES")]
    sizes = {k: (256, b) for k, b in K_BLOCK_BYTES.items()} | {"Q4_0": (32, _BLOCK_BYTES["Q4_0"])}

    def blocks(rng, name, shp, kind):
        std = _STD.get(name.split(".")[-2], 0.02)
        if kind == "Q4_0":
            return random_blocks(rng, shp[0], shp[1], kind, std)
        return random_k_blocks(rng, shp[0], shp[1], kind, std)
    write_tensors(w, specs, sizes, blocks, seed)
    return path


def cached_dummy(tag: str, write) -> Path:
    """The benchmark file ~/.cache/tiered/bench/<tag>-smollm2-tok-v1.gguf, written once by write(path,
    tokenizer_from=SmolLM2's GGUF) (through a .part file renamed when complete) where missing."""
    from tiered.checkpoint import default_model_path

    path = Path.home() / ".cache" / "tiered" / "bench" / f"{tag}-smollm2-tok-v1.gguf"
    if not path.exists():
        print(f"writing {path} ...", flush=True)
        tmp = path.with_suffix(".part")
        write(tmp, tokenizer_from=default_model_path())
        tmp.rename(path)
    return path
