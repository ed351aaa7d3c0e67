"""4-bit weight checkpoints in safetensors: GPTQ, AWQ and compressed-tensors' "pack-quantized" (W4A16)
releases, read into tiered's own int4 form.

Each quantized projection is stored as int32 words of eight 4-bit codes with per-group scales (and
zero points), laid out differently by each producer:

  GPTQ (quant_method "gptq", AutoGPTQ / GPTQModel, Frantar et al. 2022)
      X.qweight int32 [K/8, N]: code of input k, output n in word [k // 8, n], bits 4 (k % 8)
      X.qzeros  int32 [G, N/8]: zero of group g, output n in word [g, n // 8], bits 4 (n % 8); stored
                as zero - 1 in the original format (checkpoint_format "gptq"), as is in "gptq_v2"
      X.scales  fp16  [G, N];  X.g_idx int32 [K] (the group of each input; act-order permutes it)
      w[n, k] = (q[n, k] - zero[g(k), n]) * scale[g(k), n]
  AWQ (quant_method "awq", version "gemm", AutoAWQ, Lin et al. 2024)
      X.qweight int32 [K, N/8]: nibble i (bits 4i) of word [k, c] holds output 8c + AWQ_ORDER[i]
      X.qzeros  int32 [G, N/8] in the same order;  X.scales fp16 [G, N]
      w[n, k] = (q - zero) * scale, groups of group_size consecutive inputs
  compressed-tensors "pack-quantized" (llm-compressor's W4A16, e.g. RedHatAI's *-quantized.w4a16)
      X.weight_packed int32 [N, K/8]: nibble j of word [n, c] holds input 8c + j, as q + 8 (q in
                [-8, 7]);  X.weight_scale [N, G] (or [N, 1]: per channel);  X.weight_shape [2]
      X.weight_zero_point (asymmetric schemes only): int32 [ceil(N/8), G], nibble j of word [r, g] holding
                output 8r + j as zp + 8 (compressors/pack_quantized.pack_to_int32 along dim 0, compressed-
                tensors >= 0.9.4), or int8 [N, G] unpacked (earlier releases)
      X.weight_g_idx int32 [K] (activation order "group": the group of each input)
      w[n, k] = (q - zp) * scale  (zp = 0 when symmetric)

All three become tiered's int4 convention, w = (c - 8) * s + z with c in 0..15 and one (s, z) per group
of `group` inputs: GPTQ / AWQ z = (8 - zero) * s, compressed-tensors z = -zp * s (0 when symmetric).
8-bit GPTQ and compressed-tensors weights are read by checkpoint/int8_packed.py. Groups of a multiple of 32
inputs map exactly onto tiered's groups of 32 (quant/int4.py; the scales repeated), so the CPU's int4
decode copies and int4 experts keep the checkpoint's codes: `int4_parts` gives them, `load` the weight
dequantized in fp32 (the product of the fp16/bf16 scale and the code, exact). GPTQ with act-order
(`desc_act`: g_idx assigns inputs to groups in the order of a permutation; compressed-tensors'
weight_g_idx) has no runs of consecutive inputs per group: such weights load dequantized through g_idx
(int4_group 0), and "auto" gives them bf16 decode copies.
"""

from __future__ import annotations

import torch

from tiered.checkpoint.handle import TensorHandle
from tiered.errors import CheckpointError, UnsupportedModelError

INT4_FORMAT = "INT4"  # TensorHandle.format of a weight folded here
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's GEMM packing: nibble i holds column AWQ_ORDER[i] of its 8


def fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [..., W] -> their `bits`-bit fields [..., W * 32 / bits] (field j of a word at bits
    bits * j), int32 in 0..2^bits - 1. bits: 4 or 8 (2 also works; 3 does not divide a word)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(*words.shape[:-1], -1)


def nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., W] -> their 4-bit fields [..., W * 8] (field j of a word at bits 4j), int32 0..15."""
    return fields(words, 4)


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, v2: bool = False):
    """GPTQ's tensors -> (codes int32 [N, K], zero int32 [G, N], scale fp32 [G, N])."""
    codes = nibbles(qweight.T.contiguous()).contiguous()  # [N, K]: word [k // 8, n], field k % 8
    zero = nibbles(qzeros)  # [G, N]
    if not v2:
        zero = (zero + 1) & 0xF  # the original format stores zero - 1 (a 4-bit wrap, as its kernels read it)
    return codes, zero, scales.float()


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor):
    """AWQ's GEMM tensors -> (codes int32 [N, K], zero int32 [G, N], scale fp32 [G, N])."""
    inverse = torch.tensor([AWQ_ORDER.index(c) for c in range(8)])

    def columns(words):  # [R, N/8] -> [R, N], each word's fields put back in column order
        f = nibbles(words).reshape(words.shape[0], -1, 8)
        return f[..., inverse].reshape(words.shape[0], -1)
    return columns(qweight).T.contiguous(), columns(qzeros), scales.float()


def unpack_compressed(packed: torch.Tensor, scale: torch.Tensor, K: int):
    """compressed-tensors' pack-quantized tensors -> (codes int32 [N, K] 0..15, scale fp32 [N, G]);
    w = (codes - 8) * scale."""
    return nibbles(packed)[:, :K].contiguous(), scale.float()


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> torch.Tensor:
    """w fp32 [N, K] = (codes - 8) * scale + zero, scale and zero fp32 [N, K/group]."""
    N, K = codes.shape
    c = (codes.float() - 8).view(N, K // group, group)
    return (c * scale[..., None] + zero[..., None]).view(N, K)


def _handle(w: TensorHandle, shape, nbytes: int, parts, group: int) -> TensorHandle:
    """A handle of format INT4 for a weight [N, K] whose `parts()` gives (codes int32 [N, K], scale fp32
    [N, K/group], zero fp32 [N, K/group]) in tiered's convention."""
    return TensorHandle(name=w.name, shape=tuple(shape), format=INT4_FORMAT, nbytes=nbytes, path=w.path,
                        _load=lambda: dequantize(*parts(), group), _int4=parts, int4_group=group)


def _act_order_handle(w: TensorHandle, shape, nbytes: int, parts) -> TensorHandle:
    """A handle of format INT4 for an act-order GPTQ weight: `parts()` gives (codes int32 [N, K], scale fp32
    [N, G], zero fp32 [N, G], g_idx int64 [K]); its groups are not runs of consecutive inputs, so it has
    no int4 parts (int4_group 0) and loads dequantized, w[n, k] = (c - 8) s[n, g_idx[k]] + z[n, g_idx[k]]."""
    def load():
        codes, scale, zero, g = parts()
        return (codes.float() - 8) * scale[:, g] + zero[:, g]
    return TensorHandle(name=w.name, shape=tuple(shape), format=INT4_FORMAT, nbytes=nbytes, path=w.path,
                        _load=load, int4_group=0)


def fold(handles: dict[str, TensorHandle], qc: dict, where) -> None:
    """Replace each packed 4-bit projection in `handles` (name -> TensorHandle, in place) by one INT4
    handle named `<module>.weight`, per `qc` (the config's quantization_config) and its method.

    Raises:
        UnsupportedModelError: not 4 bits (GPTQ's 8 bits: checkpoint/int8_packed.py), AWQ's GEMV packing.
        CheckpointError: a tensor of the scheme is missing or mis-shaped.
    """
    method = qc.get("quant_method")
    if method in ("gptq", "awq"):
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            reads = "4- and 8-bit ones" if method == "gptq" else "4-bit ones"
            raise UnsupportedModelError(f"{where}: {method} with {bits}-bit weights; tiered reads {reads}",
                                        "use a 4-bit or 8-bit release or a GGUF conversion")
        if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            raise UnsupportedModelError(f"{where}: AWQ version {qc.get('version')!r}; tiered reads the GEMM packing",
                                        "use the model's GEMM AWQ release or a GGUF conversion")
        for base in [k[:-len(".qweight")] for k in handles if k.endswith(".qweight")]:
            _fold_gptq_awq(handles, base, method, qc, where)
    else:  # compressed-tensors pack-quantized
        for base in [k[:-len(".weight_packed")] for k in handles if k.endswith(".weight_packed")]:
            _fold_compressed(handles, base, where)


def take(handles: dict[str, TensorHandle], name: str, where) -> TensorHandle:
    """handles.pop(name) (a quantized weight's piece, folded into its weight's handle). Raises
    CheckpointError naming `where` when the checkpoint lacks it."""
    if name not in handles:
        raise CheckpointError(f"{where} lacks tensor {name!r}", "re-download the checkpoint's shards")
    return handles.pop(name)


def input_groups(gi: TensorHandle, K: int, G: int, where, unset_ok: bool = False) -> torch.Tensor:
    """The group of each of K inputs, int64 [K] in 0..G-1, from a GPTQ `g_idx` / compressed-tensors
    `weight_g_idx` handle. `unset_ok`: a compressed-tensors index holding -1 (not set) means the groups
    in column order. Raises CheckpointError for another shape or a group out of range."""
    g = gi.load(None).long()
    if unset_ok and tuple(g.shape) == (K,) and bool((g == -1).any()):
        return torch.arange(K) // (K // G)
    if tuple(g.shape) != (K,) or int(g.min()) < 0 or int(g.max()) >= G:
        raise CheckpointError(f"{where}: {gi.name} is not a group per input", "re-download the checkpoint")
    return g


def _fold_gptq_awq(handles, base, method, qc, where) -> None:
    qw = take(handles, base + ".qweight", where)
    qz = take(handles, base + ".qzeros", where)
    sc = take(handles, base + ".scales", where)
    gi = handles.pop(base + ".g_idx", None)
    if method == "gptq":
        K, N = qw.shape[0] * 8, qw.shape[1]
    else:
        K, N = qw.shape[0], qw.shape[1] * 8
    G = sc.shape[0] if len(sc.shape) == 2 else 0
    if len(sc.shape) != 2 or sc.shape[1] != N or G < 1 or K % G or tuple(qz.shape) != (G, N // 8):
        raise CheckpointError(f"{where}: {base}'s {method} tensors disagree (qweight {tuple(qw.shape)}, qzeros "
                              f"{tuple(qz.shape)}, scales {tuple(sc.shape)})", "re-download the checkpoint")
    group = K // G
    v2 = method == "gptq" and qc.get("checkpoint_format") == "gptq_v2"
    # act-order (GPTQ's desc_act): the groups follow a permutation of the inputs, g_idx [K]
    act_order = method == "gptq" and bool(qc.get("desc_act")) and gi is not None

    def parts(qw=qw, qz=qz, sc=sc, gi=gi):
        if method == "gptq":
            codes, zero, scale = unpack_gptq(qw.load(None), qz.load(None), sc.load(None), v2)
        else:
            codes, zero, scale = unpack_awq(qw.load(None), qz.load(None), sc.load(None))
        s = scale.T.contiguous()  # [N, G]
        z = (8 - zero.T.float()) * s
        if act_order:
            return codes, s, z, input_groups(gi, K, G, where)
        if gi is not None and not torch.equal(gi.load(None).long(), torch.arange(K) // group):
            raise CheckpointError(f"{where}: {base}.g_idx permutes the groups but the config has no desc_act",
                                  "restore the checkpoint's config.json (desc_act: true)")
        return codes, s, z
    nbytes = qw.nbytes + qz.nbytes + sc.nbytes + (gi.nbytes if gi is not None else 0)
    handles[base + ".weight"] = (_act_order_handle(qw, (N, K), nbytes, parts) if act_order
                                 else _handle(qw, (N, K), nbytes, parts, group))


def _fold_compressed(handles, base, where) -> None:
    wp = take(handles, base + ".weight_packed", where)
    sc = take(handles, base + ".weight_scale", where)
    shape = handles.pop(base + ".weight_shape", None)
    zp = handles.pop(base + ".weight_zero_point", None)
    gi = handles.pop(base + ".weight_g_idx", None)
    N = wp.shape[0]
    K = int(shape.load(None).reshape(-1)[1]) if shape is not None else wp.shape[1] * 8
    G = sc.shape[1] if len(sc.shape) == 2 else 0
    if wp.shape[1] * 8 < K or len(sc.shape) != 2 or sc.shape[0] != N or G < 1 or K % G:
        raise CheckpointError(f"{where}: {base}'s pack-quantized tensors disagree (weight_packed "
                              f"{tuple(wp.shape)}, weight_scale {tuple(sc.shape)}, {K} inputs)",
                              "re-download the checkpoint")
    if zp is not None and not ((zp.format == "I32" and tuple(zp.shape) == (-(-N // 8), G))
                               or (zp.format == "I8" and tuple(zp.shape) == (N, G))):
        raise CheckpointError(f"{where}: {base}.weight_zero_point is {zp.format} {tuple(zp.shape)}, not zero points "
                              f"of [{N}, {G}] packed along the outputs (int32 [{-(-N // 8)}, {G}]) or int8 [{N}, {G}]",
                              "re-download the checkpoint")
    act_order = gi is not None and G > 1

    def parts(wp=wp, sc=sc, zp=zp, K=K):
        codes, s = unpack_compressed(wp.load(None), sc.load(None), K)
        if zp is None:
            return codes, s, torch.zeros_like(s)
        z = zp.load(None)
        if z.dtype == torch.int32:  # packed: nibble j of word [r, g] is output 8r + j, as zp + 8
            zq = nibbles(z.T.contiguous())[:, :N].T.float() - 8
        else:
            zq = z.float()
        return codes, s, -zq * s  # (c - 8 - zp) s = (c - 8) s + z

    def act_parts(parts=parts, gi=gi):
        return (*parts(), input_groups(gi, K, G, where, unset_ok=True))
    nbytes = sum(h.nbytes for h in (wp, sc, shape, zp, gi) if h is not None)  # every tensor of the weight
    handles[base + ".weight"] = (_act_order_handle(wp, (N, K), nbytes, act_parts) if act_order
                                 else _handle(wp, (N, K), nbytes, parts, K // G))
