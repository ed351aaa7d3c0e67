"""8-bit integer weight checkpoints in safetensors: GPTQ Int8 and compressed-tensors' integer schemes
(llm-compressor's W8A8 "int-quantized" and W8A16 8-bit "pack-quantized"), read into tiered's int8.

Each quantized projection W [N, K] (outputs x inputs) is stored as 8-bit codes with scales (and zero
points) per output channel, per tensor or per group of inputs, laid out by each producer as:

  GPTQ, bits 8 (quant_method "gptq": Qwen's *-GPTQ-Int8; AutoGPTQ / GPTQModel `pack`, Frantar et al. 2022)
      X.qweight int32 [K/4, N]: code (0..255) of input k, output n in word [k // 4, n], bits 8 (k % 4)
      X.qzeros  int32 [G, N/4]: zero of group g, output n in word [g, n // 4], bits 8 (n % 4); stored as
                zero - 1 (an 8-bit wrap) in checkpoint_format "gptq", as is in "gptq_v2"
      X.scales  fp16  [G, N];  X.g_idx int32 [K] (the group of each input; act-order permutes it)
      w[n, k] = (q[n, k] - zero[g(k), n]) * scale[g(k), n]
  compressed-tensors "int-quantized" (W8A8 int8: RedHatAI's *-quantized.w8a8; also "naive-quantized"
  with integer weights: the same compressor)
      X.weight int8 [N, K] (q in -128..127);  X.weight_scale [N, 1] (strategy "channel"), [1] ("tensor")
      or [N, G] ("group", group_size inputs each);  X.weight_zero_point int8 shaped as the scale (only
      asymmetric schemes write it);  X.weight_g_idx int32 [K] (activation order "group")
      w[n, k] = (q[n, k] - zp[n, g(k)]) * scale[n, g(k)]   (compressed_tensors.quantization.lifecycle.
      forward._dequantize; it computes in the scale's dtype, tiered in fp32: the exact product)
  compressed-tensors "pack-quantized", num_bits 8 (W8A16; compressors/pack_quantized.pack_to_int32)
      X.weight_packed int32 [N, ceil(K/4)]: byte j of word [n, c] holds input 4c + j as q + 128;
      X.weight_shape [2];  X.weight_scale as above;  X.weight_zero_point (asymmetric "group" / "channel")
      int32 [ceil(N/4), G], byte j of word [r, g] holding output 4r + j as zp + 128 (compressed-tensors
      >= 0.9.4; earlier releases wrote it unpacked, int8 [N, G])

Activation quantization (W8A8's `input_scale` / `input_zero_point`, static or dynamic) and KV-cache
scales are dropped: tiered computes with activations in the compute dtype, as transformers'
dequantizing load does.

Every such weight becomes one TensorHandle of format "INT8" whose `load` gives the weight dequantized in
fp32 (the code times a fp16 / bf16 scale is exact there). Symmetric weights with one scale per output
channel or per tensor are tiered's own per-row int8 (quant/int8.py: w = q * s[n]), so their
`int8_parts` give the checkpoint's codes as stored (GPTQ's q - 128): "auto" decode copies and routed
experts keep them bit for bit (the scale rounded to bf16 by the int8 kernels). Grouped or asymmetric
ones have no such parts: the engine holds them dequantized, and "auto" decode copies re-quantize them
per row.
"""

from __future__ import annotations

import torch

from tiered.checkpoint.handle import TensorHandle
from tiered.checkpoint.int4_packed import fields, input_groups, take
from tiered.errors import CheckpointError, UnsupportedModelError

INT8_FORMAT = "INT8"  # TensorHandle.format of a weight folded here
# per-layer tensors of the compressed-tensors schemes that tiered does not use: activation and KV-cache
# quantization parameters
DROPPED = ("input_scale", "input_zero_point", "output_scale", "output_zero_point", ".k_scale", ".v_scale",
           ".k_zero_point", ".v_zero_point")
CT_FORMATS = ("int-quantized", "naive-quantized", "pack-quantized")
STRATEGIES = ("tensor", "channel", "group")
SCALE_FORMATS = ("F32", "F16", "BF16")


def reads(qc) -> bool:
    """Whether a config.json's quantization_config `qc` names 8-bit integer weights that `fold` reads (or
    refuses with a reason): GPTQ with bits 8, compressed-tensors "int-quantized", "naive-quantized" with
    integer weights, or "pack-quantized" with 8-bit weights."""
    if not isinstance(qc, dict):
        return False
    method = qc.get("quant_method")
    if method == "gptq":
        return qc.get("bits") == 8
    if method != "compressed-tensors" or qc.get("format") not in CT_FORMATS:
        return False
    weights = _ct_weights(qc)
    if qc.get("format") == "pack-quantized":
        return any(w.get("num_bits") == 8 for w in weights)
    return qc.get("format") == "int-quantized" or any(w.get("type") == "int" for w in weights)


def _ct_weights(qc: dict) -> list[dict]:
    """The `weights` quantization args of every compressed-tensors config group that quantizes weights."""
    groups = qc.get("config_groups")
    if not isinstance(groups, dict):
        return []
    return [g["weights"] for g in groups.values() if isinstance(g, dict) and isinstance(g.get("weights"), dict)]


def fold(handles: dict[str, TensorHandle], qc: dict, where) -> None:
    """Replace each 8-bit integer projection in `handles` (name -> TensorHandle, in place) by one INT8
    handle named `<module>.weight` of shape [N, K], per `qc` (the config's quantization_config), and drop
    the activation / KV-cache quantization tensors.

    Raises:
        UnsupportedModelError: a scheme tiered does not read (GPTQ in another packing or word size;
            compressed-tensors integer weights of another width, strategy "block", mixed bit widths,
            sparse).
        CheckpointError: a tensor of the scheme is missing, mis-shaped or of the wrong dtype, or the
            config contradicts the tensors.
    """
    if qc.get("quant_method") == "gptq":
        fmt = qc.get("checkpoint_format", qc.get("format"))
        if fmt not in (None, "gptq", "gptq_v2") or qc.get("is_marlin_format"):
            raise UnsupportedModelError(f"{where}: GPTQ checkpoint_format {fmt!r}; tiered reads the \"gptq\" and "
                                        "\"gptq_v2\" packings",
                                        "use the model's plain GPTQ release or a GGUF conversion")
        if str(qc.get("pack_dtype", "int32")).replace("torch.", "") != "int32":
            raise UnsupportedModelError(f"{where}: GPTQ words of {qc.get('pack_dtype')}; tiered reads int32 words",
                                        "use a release packed in int32 words or a GGUF conversion")
        for base in [k[:-len(".qweight")] for k in handles if k.endswith(".qweight")]:
            _fold_gptq(handles, base, qc, where)
        return
    symmetric = _check_ct(qc, where)
    if qc.get("format") == "pack-quantized":
        for base in [k[:-len(".weight_packed")] for k in handles if k.endswith(".weight_packed")]:
            _fold_ct(handles, base, symmetric, where, packed=True)
    else:
        for base in [k[:-len(".weight")] for k in handles if k.endswith(".weight") and handles[k].format == "I8"]:
            _fold_ct(handles, base, symmetric, where, packed=False)
    for key in [k for k in handles if k.endswith(DROPPED)]:
        del handles[key]


def _check_ct(qc: dict, where) -> bool:
    """Check a compressed-tensors config's weight schemes; True when every group is symmetric.

    Raises:
        UnsupportedModelError: not 8-bit integer weights per tensor, channel or group; sparse."""
    sparse = qc.get("sparsity_config")
    if isinstance(sparse, dict) and sparse.get("format") not in (None, "dense"):
        raise UnsupportedModelError(f"{where} is sparse ({sparse.get('format')!r})", "use the model's dense release")
    weights = _ct_weights(qc)
    if len({w.get("num_bits") for w in weights}) > 1:
        raise UnsupportedModelError(f"{where}: compressed-tensors groups mix weights of "
                                    f"{sorted({str(w.get('num_bits')) for w in weights})} bits; tiered reads one width",
                                    "use the model's bf16 release or a GGUF conversion")
    for w in weights:
        if w.get("type") != "int" or w.get("num_bits") != 8 or w.get("strategy") not in STRATEGIES:
            raise UnsupportedModelError(
                f"{where}: compressed-tensors {qc.get('format')!r} quantizes weights as {w!r}; tiered reads 8-bit "
                "integer weights per tensor, channel or group (and 4-bit pack-quantized ones)",
                "use the model's bf16 release or a GGUF conversion")
    return all(w.get("symmetric", True) is not False for w in weights)


def _scale_dtype(sc: TensorHandle, where) -> None:
    """Raises CheckpointError when scales `sc` are not stored as a float dtype."""
    if sc.format not in SCALE_FORMATS:
        raise CheckpointError(f"{where}: the scales {sc.name!r} are stored as {sc.format}",
                              "re-convert the checkpoint (scales in F32, F16 or BF16)")


def _scales(sc: TensorHandle, N: int, where) -> int:
    """The groups per row G of scales `sc` for a weight of N rows ([N, G]; [N] per channel; [1] / [] per tensor).

    Raises:
        CheckpointError: another shape, or not a float dtype."""
    _scale_dtype(sc, where)
    if sc.numel == 1 or tuple(sc.shape) == (N,):  # per tensor, or per channel stored flat
        return 1
    if len(sc.shape) != 2 or sc.shape[0] != N or sc.shape[1] < 1:
        raise CheckpointError(f"{where}: the scales {sc.name!r} have shape {tuple(sc.shape)}, not [{N}, groups] "
                              "or one per tensor", "re-download the checkpoint")
    return sc.shape[1]


def _handle(w: TensorHandle, shape, nbytes: int, parts, group: int, g_idx, row: bool) -> TensorHandle:
    """An INT8 handle for a weight [N, K] whose `parts()` gives (q int16 [N, K], scale fp32 [N, G], zero
    int16 [N, G]) with w = (q - zero) * scale per group of `group` consecutive inputs, or per input's group
    g_idx() (int64 [K]; `group` 0) when act-ordered. `row`: symmetric with G = 1, so q - zero is int8."""
    N, K = shape

    def load():
        q, scale, zero = parts()
        if group == 0:
            g = g_idx()
            return (q - zero[:, g]).float() * scale[:, g]
        G = K // group
        return ((q.view(N, G, group) - zero[..., None]).float() * scale[..., None]).view(N, K)

    def int8():
        q, scale, zero = parts()
        d = q - zero
        if int(d.min()) < -128 or int(d.max()) > 127:
            raise CheckpointError(f"{w.name}: symmetric 8-bit codes minus their zero points leave -128..127",
                                  "check quantization_config (sym / symmetric) against the checkpoint")
        return d.to(torch.int8), scale[:, 0].contiguous()
    return TensorHandle(name=w.name, shape=tuple(shape), format=INT8_FORMAT, nbytes=nbytes, path=w.path,
                        _load=load, _int8=int8 if row else None, int8_group=group)


def _fold_gptq(handles, base, qc, where) -> None:
    qw = take(handles, base + ".qweight", where)
    qz = take(handles, base + ".qzeros", where)
    sc = take(handles, base + ".scales", where)
    gi = handles.pop(base + ".g_idx", None)
    K, N = qw.shape[0] * 4, (qw.shape[1] if len(qw.shape) == 2 else 0)
    G = sc.shape[0] if len(sc.shape) == 2 else 0
    if len(qw.shape) != 2 or len(sc.shape) != 2 or sc.shape[1] != N or G < 1 or K % G or \
            tuple(qz.shape) != (G, N // 4) or N % 4 or qw.format != "I32" or qz.format != "I32":
        raise CheckpointError(f"{where}: {base}'s 8-bit gptq tensors disagree (qweight {tuple(qw.shape)} {qw.format}, "
                              f"qzeros {tuple(qz.shape)} {qz.format}, scales {tuple(sc.shape)})",
                              "re-download the checkpoint")
    _scale_dtype(sc, where)
    group = K // G
    v2 = qc.get("checkpoint_format", qc.get("format")) == "gptq_v2"
    act_order = bool(qc.get("desc_act")) and gi is not None and G > 1

    def g_idx(gi=gi):
        return input_groups(gi, K, G, where)

    def parts(qw=qw, qz=qz, sc=sc):
        if gi is not None and not act_order and G > 1 and not torch.equal(g_idx(), torch.arange(K) // group):
            raise CheckpointError(f"{where}: {base}.g_idx permutes the groups but the config has no desc_act",
                                  "restore the checkpoint's config.json (desc_act: true)")
        q = fields(qw.load(None).T.contiguous(), 8).to(torch.int16)  # [N, K]: word [k // 4, n], field k % 4
        zero = fields(qz.load(None), 8)  # [G, N]
        if not v2:
            zero = (zero + 1) & 0xFF  # the original format stores zero - 1 (an 8-bit wrap, as its kernels read it)
        return q, sc.load(torch.float32).T.contiguous(), zero.T.contiguous().to(torch.int16)

    row = G == 1 and qc.get("sym", True) is not False
    nbytes = qw.nbytes + qz.nbytes + sc.nbytes + (gi.nbytes if gi is not None else 0)
    handles[base + ".weight"] = _handle(qw, (N, K), nbytes, parts, 0 if act_order else group, g_idx, row)


def _zero_points(zp: TensorHandle, N: int, G: int, where):
    """compressed-tensors' weight_zero_point as a loader of int16 [N, G] (signed, as quantized): int8 [N, G]
    (or one per tensor) as written unpacked, or int32 [ceil(N/4), G] packed along the outputs (zp + 128
    per byte). Raises CheckpointError for another shape or dtype."""
    if zp.format == "I8" and (tuple(zp.shape) == (N, G) or (G == 1 and zp.numel == 1)):
        return lambda: zp.load(None).to(torch.int16).reshape(-1, G).expand(N, G)
    if zp.format == "I32" and tuple(zp.shape) == (-(-N // 4), G):
        return lambda: (fields(zp.load(None).T.contiguous(), 8)[:, :N].T.contiguous() - 128).to(torch.int16)
    raise CheckpointError(f"{where}: {zp.name!r} is {zp.format} {tuple(zp.shape)}, not the zero points of a "
                          f"[{N}, {G}] grid", "re-download the checkpoint")


def _fold_ct(handles, base, symmetric: bool, where, packed: bool) -> None:
    w = take(handles, base + (".weight_packed" if packed else ".weight"), where)
    sc = take(handles, base + ".weight_scale", where)
    shape = handles.pop(base + ".weight_shape", None)
    zp = handles.pop(base + ".weight_zero_point", None)
    gi = handles.pop(base + ".weight_g_idx", None)
    if len(w.shape) != 2 or w.format != ("I32" if packed else "I8"):
        raise CheckpointError(f"{where}: {w.name!r} is {w.format} {tuple(w.shape)}, not a matrix of "
                              + ("int32 words" if packed else "int8 codes"), "re-download the checkpoint")
    N = w.shape[0]
    K = int(shape.load(None).reshape(-1)[1]) if packed and shape is not None else w.shape[1] * (4 if packed else 1)
    G = _scales(sc, N, where)
    if K % G or (packed and -(-K // 4) != w.shape[1]):
        raise CheckpointError(f"{where}: {base}'s int8 tensors disagree ({w.name.rsplit('.', 1)[1]} {tuple(w.shape)}, "
                              f"weight_scale {tuple(sc.shape)}, {K} inputs)", "re-download the checkpoint")
    zeros = _zero_points(zp, N, G, where) if zp is not None else None
    act_order = gi is not None and G > 1

    def parts(w=w, sc=sc):
        if packed:
            q = (fields(w.load(None), 8)[:, :K] - 128).to(torch.int16)  # byte j of word [n, c]: input 4c + j
        else:
            q = w.load(None).to(torch.int16)
        scale = sc.load(torch.float32).reshape(-1, G).expand(N, G).contiguous()
        zero = zeros() if zeros is not None else torch.zeros(N, G, dtype=torch.int16)
        return q, scale, zero

    def g_idx(gi=gi):
        return input_groups(gi, K, G, where, unset_ok=True)

    row = G == 1 and symmetric
    nbytes = sum(h.nbytes for h in (w, sc, shape, zp, gi) if h is not None)  # every tensor of the weight
    handles[base + ".weight"] = _handle(w, (N, K), nbytes, parts, 0 if act_order else K // G, g_idx, row)
