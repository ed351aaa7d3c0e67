# E = experts, D = hidden, F = expert intermediate, G = 32-weight groups per row
"""gpt-oss checkpoints: each layer's fused (and, as released, MXFP4-quantized) experts as one set of
lazy handles per expert.

A gpt-oss safetensors checkpoint stores a layer's routed experts as a few fused tensors, in one of
two layouts:

  transformers' own save (save_pretrained of GptOssForCausalLM, any float dtype):
    mlp.experts.gate_up_proj       [E, D, 2F]   x @ W: gate in the even columns, up in the odd ones
    mlp.experts.gate_up_proj_bias  [E, 2F]      the same interleaving
    mlp.experts.down_proj          [E, F, D]
    mlp.experts.down_proj_bias     [E, D]
  OpenAI's release (quantization_config {"quant_method": "mxfp4"}):
    mlp.experts.gate_up_proj_blocks  uint8 [E, 2F, G, 16]  nn.Linear layout [out, in]: rows 2i gate, 2i+1 up;
                                                            each byte two FP4 (e2m1) codes of a group of 32
                                                            inputs, the even input in the low nibble
    mlp.experts.gate_up_proj_scales  uint8 [E, 2F, G]      one E8M0 scale per group: 2^(byte - 127)
    mlp.experts.down_proj_blocks     uint8 [E, D, F/32, 16], down_proj_scales uint8 [E, D, F/32]
    the biases as above (bf16)
  (transformers' integrations/mxfp4.py: FP4_VALUES, _convert_moe_packed_tensors, whose result it
  transposes into the first layout.)

`fold` replaces them with three handles per expert, named as the model's parameters
(models/gpt_oss.GptOssExpert): `model.layers.N.mlp.experts.J.{gate_proj,up_proj,down_proj}.weight`,
gate / up [F, Db] and down [D, Fb], each projection's bias as its input column D (F), zeros after it
up to a multiple of 32 (Db = biased_width(D), Fb = biased_width(F): ModelConfig.expert_shapes). A
handle reads only its expert's slice of the fused tensors and loads it dequantized (MXFP4 values are
exact in bf16 and fp32); it is not readable raw (offset None), so disk-tier experts are read from a
converted copy in the offload directory (memory/expert_store).

MXFP4 as int8-g32, exactly: an e2m1 value times 2 is an integer in {0, +-1, +-2, +-3, +-4, +-6, +-8,
+-12}, so with code q = 2 * value and scale 2^(e - 127) / 2 = 2^(e - 128) per group of 32 inputs,
q * scale is the MXFP4 weight bit for bit wherever that scale is an fp16 number: e in [104, 143]
(2^-24, the smallest fp16 subnormal, .. 2^15). The bias group holds q = 1 at column D (F) with the
bias as its fp16 scale (zeros after it): exact for bf16 / fp16 biases of magnitude 2^-17 .. 65504
(fp16 keeps bf16's 8 significant bits there; smaller bf16 biases round to fp16's subnormal grid,
an error of at most 2^-25). An MXFP4 handle whose biases are bf16 / fp16 (as released) offers this
form (`TensorHandle.int8_g32_parts`, `mxfp4_int8_g32`), straight from the codes and scales without
dequantizing: tiered's int8-g32 expert kind (1.0625 bytes a weight against bf16's 2) then holds the
experts as stored (quant/gguf_experts.stored_kind). A group of non-zero codes whose scale lies
outside that range, or a bias fp16 cannot hold (beyond 65504; an fp32 bias of more significant bits),
is refused (CheckpointError) when the expert is read.

MXFP4 as tiered's mxfp4 kind (quant/mxfp4.py), exactly and in 4 bits: the e2m1 codes as stored, each
group's scale 2^(e - 128) as bf16 (exact for every E8M0 byte), the kernels mapping a code to 12 + 2 *
its value and centring on 12. The bias group holds code 1 (2 * 0.5 = 1) at column D (F) with the bias as
its bf16 scale, codes 0 after it: exact for bf16 biases, refused (CheckpointError on read) for others.
A handle offers the raw parts for it (`TensorHandle.mxfp4_parts`: blocks, E8M0 bytes and bias; `mxfp4_codes`
converts them) where its biases are bf16 (as released); quant/gguf_experts.stored_kind takes it over
int8-g32 where tiered's kernels are built (0.625 bytes a weight against 1.0625).

llama.cpp's GGUF files (architecture "gpt-oss", read by checkpoint/gguf_file.py) hold the same experts
stacked per layer with gate and up apart (convert_hf_to_gguf.py GptOssModel: `ffn_gate_exps` /
`ffn_up_exps` the even / odd rows of gate_up_proj, [E, F, D]; `ffn_down_exps` [E, D, F]; the biases
`ffn_*_exps.bias` [E, F] / [E, D], written F32 as every converted bias), MXFP4 as ggml's block_mxfp4
(ggml-common.h): per 32 inputs one E8M0 byte e, then 16 bytes with input j in byte j's low nibble and
16 + j in its high one (`halves`; the converter's transform_nibble_layout reorders OpenAI's nibbles and
copies e), valued kvalues_mxfp4[code] (= FP4_E2M1_X2) * GGML_E8M0_TO_FP32_HALF(e) = 2^(e - 128)
(ggml-quants.c dequantize_row_mxfp4, ggml-impl.h): the int8-g32 form above, byte for byte the same
scales. Their experts offer it whatever the biases' storage (`int8_g32_with_bias` checks each bias on
read; F32 biases converted from OpenAI's bf16 release hold bf16 values), and the mxfp4 form where the
biases are F32 or BF16 (`mxfp4_codes` checks each on read: the converter's F32 ones are bf16 values).
"""

from __future__ import annotations

from typing import Callable

import torch

from tiered.checkpoint.handle import TensorHandle
from tiered.checkpoint.model_config import biased_width
from tiered.errors import CheckpointError
from tiered.quant.mxfp4 import e8m0_scales

# the 16 FP4 e2m1 values by code (sign bit 3): transformers' integrations/mxfp4.FP4_VALUES
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # inputs per scale
# 2 * FP4_E2M1 by code: the int8-g32 codes of an MXFP4 group whose scale is halved
FP4_E2M1_X2 = tuple(int(2 * v) for v in FP4_E2M1)
# E8M0 bytes e whose halved scale 2^(e - 128) is an fp16 number (subnormals down to 2^-24)
INT8_G32_EXPONENTS = (128 - 24, 128 + 15)
FUSED = ("gate_up_proj", "down_proj")


def _codes(blocks: torch.Tensor, halves: bool) -> torch.Tensor:
    """MXFP4 blocks uint8 [R, G, 16] -> their e2m1 codes uint8 [R, G, 32]: input 2j in byte j's low
    nibble and 2j + 1 in its high one (OpenAI's / transformers' order), or with `halves` input j in the
    low nibble and 16 + j in the high one (ggml's block_mxfp4, as its Q4_0)."""
    R, G, _ = blocks.shape
    lo, hi = blocks & 0x0F, blocks >> 4
    return torch.cat((lo, hi), -1) if halves else torch.stack((lo, hi), -1).reshape(R, G, MXFP4_GROUP)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, halves: bool = False) -> torch.Tensor:
    """MXFP4 weights -> fp32 [R, G * 32].

    Args:
        blocks: uint8 [R, G, 16]: per row and group of 32 inputs, 16 bytes of two e2m1 codes each,
            input 2j in the low nibble of byte j, input 2j + 1 in the high one; with `halves` (ggml's
            block_mxfp4 qs, GGUF type MXFP4) input j in the low nibble, 16 + j in the high one.
        scales: uint8 [R, G]: E8M0 exponents, the group's scale 2^(byte - 127) (ggml's
            GGML_E8M0_TO_FP32_HALF(byte) = 2^(byte - 128) times its doubled values kvalues_mxfp4 =
            2 * FP4_E2M1: the same weights).
    Returns:
        fp32 [R, G * 32], each value FP4_E2M1[code] * scale (exact).
    """
    R, G, _ = blocks.shape
    values = torch.tensor(FP4_E2M1, dtype=torch.float32)[_codes(blocks, halves).long()]  # (R, G, 32)
    scale = torch.exp2(scales.float() - 127.0)  # (R, G)
    return (values * scale[..., None]).reshape(R, G * MXFP4_GROUP)


def mxfp4_int8_g32(blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor, width: int,
                   halves: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One MXFP4 projection and its bias as tiered's int8-g32 (module docstring), exactly.

    Args:
        blocks: uint8 [R, G, 16], scales: uint8 [R, G], halves: as `dequantize_mxfp4` takes them
            (K = G * 32).
        bias: [R], any float dtype (`int8_g32_with_bias`).
        width: the padded in-features, biased_width(K) (> K, a multiple of 32).
    Returns:
        (q int8 [R, width], scale fp16 [R, width / 32]): columns < K the MXFP4 weight (q = 2 * e2m1
        value, ggml's kvalues_mxfp4; scale 2^(e - 128) per group), column K q = 1 with the bias as its
        group's scale, zeros after; q * scale equals `with_bias(dequantize_mxfp4(...), bias, width)`
        bit for bit but for biases below 2^-17 in magnitude (rounded to fp16's subnormal grid: error
        <= 2^-25).
    Raises:
        ValueError: a group with a non-zero code whose scale byte lies outside INT8_G32_EXPONENTS, or a
            bias fp16 cannot hold (`int8_g32_with_bias`; the caller names the expert).
    """
    R, G, _ = blocks.shape
    codes = _codes(blocks, halves)  # (R, G, 32)
    q = torch.tensor(FP4_E2M1_X2, dtype=torch.int8)[codes.long()].reshape(R, G * MXFP4_GROUP)
    e = scales.to(torch.int32)  # (R, G)
    lo, hi = INT8_G32_EXPONENTS
    live = (codes & 7).any(-1)  # (R, G): groups with a non-zero value (an all-zero group takes any scale)
    bad = live & ((e < lo) | (e > hi))
    if bool(bad.any()):
        r, g = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"row {r} group {g} has MXFP4 scale 2^{int(e[r, g]) - 127}, which int8-g32's fp16 "
                         f"scales hold exactly only within 2^{lo - 127} .. 2^{hi - 127}")
    scale = torch.exp2((e.clamp(lo, hi) - 128).float()).to(torch.float16)
    return int8_g32_with_bias(q, scale, bias, width)


def mxfp4_codes(blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor, width: int,
                halves: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One MXFP4 projection and its bias as tiered's mxfp4 kind (quant/mxfp4.py, module docstring), exactly.

    Args:
        blocks: uint8 [R, G, 16], scales: uint8 [R, G] (E8M0), halves: as `dequantize_mxfp4` takes them
            (K = G * 32).
        bias: [R], any float dtype whose values are bf16 numbers.
        width: the padded in-features, biased_width(K) (> K, a multiple of 32).
    Returns:
        (codes uint8 [R, width] e2m1 codes, scale bf16 [R, width / 32]): columns < K the stored codes
        with 2^(e - 128) per group, column K code 1 (2 * 0.5) with the bias as its group's scale, codes
        0 after it; (2 * FP4_E2M1[code]) * scale equals `with_bias(dequantize_mxfp4(...), bias, width)`
        bit for bit.
    Raises:
        ValueError: a group with a non-zero code whose scale byte is 255 (NaN in E8M0), or a bias that
            is no bf16 number (more significant bits, or not finite); the caller names the expert.
    """
    R, G, _ = blocks.shape
    K = G * MXFP4_GROUP
    codes = _codes(blocks, halves)  # (R, G, 32)
    checked_scales(codes, scales)
    b16 = checked_bias(bias)
    out_c = torch.zeros(R, width, dtype=torch.uint8)
    out_c[:, :K], out_c[:, K] = codes.reshape(R, K), 1
    out_s = torch.zeros(R, width // MXFP4_GROUP, dtype=torch.bfloat16)
    out_s[:, :G], out_s[:, G] = e8m0_scales(scales), b16
    return out_c, out_s


def checked_scales(codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Raises ValueError where a group of e2m1 `codes` uint8 [R, G, 32] with a non-zero value has the
    E8M0 byte 255 (NaN) in `scales` uint8 [R, G]."""
    nan = scales == 255
    if not bool(nan.any()):
        return
    bad = (codes & 7).any(-1) & nan
    if bool(bad.any()):
        r, g = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"row {r} group {g} has MXFP4 scale byte 255 (NaN in E8M0)")


def checked_bias(bias: torch.Tensor) -> torch.Tensor:
    """A bias [R] (any float dtype) as bf16 [R]. Raises ValueError where a value is no bf16 number (more
    significant bits, or not finite): the mxfp4 kind holds a bias as a bf16 scale."""
    b = bias.float()
    b16 = b.to(torch.bfloat16)
    wrong = ~torch.isfinite(b) | (b16.float() != b)
    if bool(wrong.any()):
        i = int(wrong.nonzero()[0])
        raise ValueError(f"bias {float(b[i]):.9g} (row {i}) is not a bf16 number (mxfp4 holds a bias as a bf16 scale)")
    return b16


def int8_g32_with_bias(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
                       width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8-g32 weight and its bias as one int8-g32 weight over the input with a 1 appended
    (ModelConfig.expert_shapes): the bias is a group of its own, q = 1 at column K with the bias as
    its fp16 scale, zeros after.

    Args:
        q: int8 [R, K], scale: fp16 [R, K / 32] (w = q * scale per group of 32 inputs; K % 32 == 0).
        bias: [R], any float dtype; width: biased_width(K).
    Returns:
        (q int8 [R, width], scale fp16 [R, width / 32]).
    Raises:
        ValueError: a bias fp16 does not hold to within 2^-25: beyond 65504 in magnitude, or with more
            significant bits than fp16 keeps (an fp32 bias that is no bf16 / fp16 value); bf16 and
            fp16 biases always fit but for rounding below 2^-17 (error <= 2^-25).
    """
    R, K = q.shape
    b = bias.float()
    b16 = b.to(torch.float16)
    err = (b16.float() - b).abs()
    if bool((~torch.isfinite(err) | (err > 2.0 ** -25)).any()):
        i = int((~torch.isfinite(err) | (err > 2.0 ** -25)).nonzero()[0])
        raise ValueError(f"bias {float(b[i]):.9g} (row {i}) is not an fp16 number (beyond 65504 in magnitude, "
                         "or more significant bits than fp16 keeps)")
    out_q = torch.zeros(R, width, dtype=torch.int8)
    out_q[:, :K], out_q[:, K] = q, 1
    out_s = torch.zeros(R, width // MXFP4_GROUP, dtype=torch.float16)
    out_s[:, :K // MXFP4_GROUP], out_s[:, K // MXFP4_GROUP] = scale, b16
    return out_q, out_s


def expert_names(layer: int, expert: int) -> tuple[str, str, str]:
    """The folded handles' names of one expert: (gate, up, down)."""
    p = f"model.layers.{layer}.mlp.experts.{expert}"
    return f"{p}.gate_proj.weight", f"{p}.up_proj.weight", f"{p}.down_proj.weight"


def fold(handles: dict[str, TensorHandle], config, quantization_config, path,
         expert_slice: Callable[[TensorHandle], Callable[[int], torch.Tensor]]) -> None:
    """Replace every layer's fused expert tensors in `handles` by per-expert handles (module docstring).

    Args:
        handles: the checkpoint's HF name -> handle table, changed in place.
        config: its ModelConfig (gpt_oss).
        quantization_config: config.json's quantization_config, None or {"quant_method": "mxfp4", ...}.
        path: the checkpoint, named in errors.
        expert_slice: handle -> (e -> expert e's slice of that [E, ...] tensor, as stored).
    Raises:
        CheckpointError: a layer's experts are missing or partly missing (blocks without scales, a
            bias absent), a tensor has the wrong shape or dtype for the config, or MXFP4 blocks are
            stored without quant_method "mxfp4" in config.json.
    """
    E, D, F = config.num_experts, config.hidden_size, config.moe_intermediate_size
    mxfp4 = isinstance(quantization_config, dict) and quantization_config.get("quant_method") == "mxfp4"

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: {why}", "re-download the checkpoint's shards (or restore its config.json)")

    def take(name: str, shape: tuple, formats: tuple[str, ...] | None = None) -> TensorHandle:
        h = handles.pop(name, None)
        if h is None:
            raise bad(f"lacks tensor {name!r}")
        if tuple(h.shape) != shape:
            raise bad(f"tensor {name!r} has shape {tuple(h.shape)}, the config implies {shape}")
        if formats is not None and h.format not in formats:
            raise bad(f"tensor {name!r} is stored as {h.format}, expected {' or '.join(formats)}")
        return h

    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts."
        packed = p + "gate_up_proj_blocks" in handles or p + "down_proj_blocks" in handles
        if packed and not mxfp4:
            raise bad(f"stores MXFP4 expert blocks ({p}*_blocks) but config.json's quantization_config is not "
                      "quant_method \"mxfp4\"")
        floats = ("F32", "BF16", "F16")
        gate_b = take(p + "gate_up_proj_bias", (E, 2 * F), floats)
        down_b = take(p + "down_proj_bias", (E, D), floats)
        if packed:
            if D % MXFP4_GROUP or F % MXFP4_GROUP:
                raise bad(f"MXFP4 experts need hidden and intermediate sizes divisible by {MXFP4_GROUP}, got {D}, {F}")
            gu = (take(p + "gate_up_proj_blocks", (E, 2 * F, D // MXFP4_GROUP, 16), ("U8",)),
                  take(p + "gate_up_proj_scales", (E, 2 * F, D // MXFP4_GROUP), ("U8", "F8_E8M0")))
            dn = (take(p + "down_proj_blocks", (E, D, F // MXFP4_GROUP, 16), ("U8",)),
                  take(p + "down_proj_scales", (E, D, F // MXFP4_GROUP), ("U8", "F8_E8M0")))
            fmt = "MXFP4"
            gate_up = _mxfp4_rows(gu, expert_slice)  # e -> W [2F, D], nn.Linear layout
            down = _mxfp4_rows(dn, expert_slice)  # e -> W [D, F]
            gu_raw, dn_raw = _mxfp4_raw(gu, expert_slice), _mxfp4_raw(dn, expert_slice)  # the int8-g32 form
            parts_bytes = [sum(h.nbytes for h in gu) // (2 * E)] * 2 + [sum(h.nbytes for h in dn) // E]
            files = (gu[0].path, gu[0].path, dn[0].path)
        else:
            gu_w = take(p + "gate_up_proj", (E, D, 2 * F), floats)
            dn_w = take(p + "down_proj", (E, F, D), floats)
            fmt = gu_w.format
            gu_get, dn_get = expert_slice(gu_w), expert_slice(dn_w)
            gate_up = lambda e, get=gu_get: get(e).T  # noqa: E731  (2F, D)
            down = lambda e, get=dn_get: get(e).T  # noqa: E731  (D, F)
            parts_bytes = [gu_w.nbytes // (2 * E)] * 2 + [dn_w.nbytes // E]
            files = (gu_w.path, gu_w.path, dn_w.path)
        gb_get, db_get = expert_slice(gate_b), expert_slice(down_b)
        bias_bytes = (gate_b.nbytes // (2 * E), gate_b.nbytes // (2 * E), down_b.nbytes // E)
        Db, Fb = biased_width(D), biased_width(F)
        shapes = ((F, Db), (F, Db), (D, Fb))  # ModelConfig.expert_shapes
        for e in range(E):
            # (this layer's readers bound as defaults: the loop rebinds the names)
            loads = (
                lambda e=e, w=gate_up, b=gb_get: with_bias(w(e)[0::2], b(e)[0::2], Db),  # (F, Db)
                lambda e=e, w=gate_up, b=gb_get: with_bias(w(e)[1::2], b(e)[1::2], Db),
                lambda e=e, w=down, b=db_get: with_bias(w(e), b(e), Fb),  # (D, Fb)
            )
            int8s = (None,) * 3  # offered for MXFP4 with 16-bit biases (fp32 ones: fp16 cannot hold them)
            if packed and gate_b.format in ("BF16", "F16") and down_b.format in ("BF16", "F16"):
                names = expert_names(layer, e)
                int8s = (
                    lambda e=e, r=gu_raw, b=gb_get, n=names[0]: checked_form(
                        n, mxfp4_int8_g32, *r(e, 0), b(e)[0::2], Db),
                    lambda e=e, r=gu_raw, b=gb_get, n=names[1]: checked_form(
                        n, mxfp4_int8_g32, *r(e, 1), b(e)[1::2], Db),
                    lambda e=e, r=dn_raw, b=db_get, n=names[2]: checked_form(
                        n, mxfp4_int8_g32, *r(e, None), b(e), Fb),
                )
            raws = (None,) * 3  # the raw MXFP4 parts, offered with bf16 biases (the mxfp4 kind's bias scales)
            if packed and gate_b.format == "BF16" and down_b.format == "BF16":
                raws = (
                    lambda e=e, r=gu_raw, b=gb_get: (*r(e, 0), b(e)[0::2]),
                    lambda e=e, r=gu_raw, b=gb_get: (*r(e, 1), b(e)[1::2]),
                    lambda e=e, r=dn_raw, b=db_get: (*r(e, None), b(e)),
                )
            for name, load, shape, n, b, f, i8, mx in zip(expert_names(layer, e), loads, shapes, parts_bytes,
                                                          bias_bytes, files, int8s, raws):
                handles[name] = TensorHandle(name=name, shape=shape, format=fmt, nbytes=n + b, path=f, _load=load,
                                             _int8_g32=i8, _mxfp4=mx)
    leftover = sorted(k for k in handles if ".mlp.experts." in k and k.split(".mlp.experts.")[1].split(".")[0] in
                      {"gate_up_proj", "down_proj"} | {f"{n}_{s}" for n in FUSED for s in ("blocks", "scales", "bias")})
    if leftover:
        raise bad(f"holds expert tensor {leftover[0]!r} of no layer the config has")


def _mxfp4_rows(parts: tuple[TensorHandle, TensorHandle], expert_slice) -> Callable[[int], torch.Tensor]:
    """e -> expert e's dequantized fp32 weight [R, G * 32] from its (blocks, scales) handles."""
    blocks, scales = expert_slice(parts[0]), expert_slice(parts[1])

    def load(e: int) -> torch.Tensor:
        s = scales(e)
        return dequantize_mxfp4(blocks(e), s.view(torch.uint8) if s.dtype != torch.uint8 else s)
    return load


def _mxfp4_raw(parts: tuple[TensorHandle, TensorHandle], expert_slice) -> Callable:
    """(e, rows) -> expert e's (blocks uint8 [R, G, 16], scales uint8 [R, G]) as stored, rows 0::2
    (rows 0: gate of gate_up), 1::2 (up) or all (None)."""
    blocks, scales = expert_slice(parts[0]), expert_slice(parts[1])

    def raw(e: int, rows: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        b, s = blocks(e), scales(e)
        s = s.view(torch.uint8) if s.dtype != torch.uint8 else s
        return (b, s) if rows is None else (b[rows::2], s[rows::2])
    return raw


def checked_form(name: str, convert: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                 *args) -> tuple[torch.Tensor, torch.Tensor]:
    """`convert(*args)` (`mxfp4_int8_g32`, `int8_g32_with_bias` or `mxfp4_codes`) of one expert projection,
    its ValueError (a scale or bias the form cannot hold exactly) a CheckpointError naming the tensor."""
    try:
        return convert(*args)
    except ValueError as e:
        raise CheckpointError(f"{name}: {e}", "hold gpt-oss's experts dequantized (--weights bf16 or fp32) "
                              "or re-quantized (--weights int8)") from None


def with_bias(w: torch.Tensor, b: torch.Tensor, width: int) -> torch.Tensor:
    """w [N, K], b [N] -> [N, width]: w, b as column K, zeros after it (width > K; w's dtype where both
    are floats of one dtype, else fp32)."""
    dt = w.dtype if w.dtype == b.dtype else torch.float32
    out = torch.zeros(w.shape[0], width, dtype=dt)
    out[:, :w.shape[1]] = w
    out[:, w.shape[1]] = b
    return out
