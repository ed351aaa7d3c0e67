"""bitsandbytes checkpoints in safetensors (quant_method "bitsandbytes"): 4-bit NF4 / FP4 (QLoRA's
`load_in_4bit`, e.g. unsloth's `*-bnb-4bit` releases) and 8-bit LLM.int8 (`load_in_8bit`), read into
one handle per quantized Linear.

transformers replaces every nn.Linear not in `llm_int8_skip_modules` (the lm_head, as a rule) by a
bitsandbytes module and saves its state (bitsandbytes' Linear4bit._save_to_state_dict with
QuantState.as_dict(packed=True); Linear8bitLt._save_to_state_dict):

  4-bit (Linear4bit: Dettmers et al. 2023, "QLoRA", sections 3 and 4)
      X.weight        uint8 [ceil(N K / 2), 1] (another dtype's bytes under bnb_4bit_quant_storage):
                      the weight [N, K] flattened row-major, two 4-bit codes a byte, element 2i in the
                      HIGH nibble (bits 4-7) and element 2i + 1 in the low one
      X.weight.absmax fp32 [ceil(N K / blocksize)]: one absmax per run of `blocksize` (64 by default)
                      consecutive elements of the flat weight (runs may cross rows; the last is partial)
      X.weight.quant_map          fp32 [16]: the code table (bitsandbytes decodes with the table its
                      quant_type names, get_4bit_type, not with this copy; so does this reader)
      X.weight.quant_state.bitsandbytes__nf4 (or __fp4)  uint8 [bytes]: UTF-8 JSON of the rest,
                      {"quant_type", "blocksize", "dtype" (the weight's dtype before quantization),
                      "shape": [N, K], and with double quantization "nested_blocksize",
                      "nested_dtype", "nested_offset"}
      double quantization (bnb_4bit_use_double_quant): absmax is stored as uint8 codes [B] of
      bitsandbytes' 8-bit dynamic map, in blocks of nested_blocksize (256) with their own absmax:
      X.weight.nested_absmax      fp32 [ceil(B / nested_blocksize)]
      X.weight.nested_quant_map   fp32 [256]: the dynamic map (create_dynamic_map), used as stored
      absmax[b] = nested_quant_map[absmax_code[b]] * nested_absmax[b // nested_blocksize] + nested_offset
      w[i] = table[code_i] * absmax[i // blocksize] for flat index i, table = NF4 or FP4 below
  8-bit (Linear8bitLt: Dettmers et al. 2022, "LLM.int8()", section 3)
      X.weight int8 [N, K]; X.SCB fp32 [N]: each row's absmax; X.weight_format uint8 [] (0: "row",
      the only layout bitsandbytes still reads; 1-3 were GPU tile layouts of old versions)
      w = q * SCB / 127 (bitsandbytes: (q * SCB) * 7.874015718698502e-3 in fp32)

Each quantized projection becomes one handle `X.weight` of shape [N, K] whose `load()` gives the
weight dequantized in fp32 exactly as bitsandbytes computes it before rounding to `dtype` (its
dequantize_4bit / int8_vectorwise_dequant). The 4-bit formats BNB_NF4 and BNB_FP4 are dense weights
to the rest of the engine (decode copies and experts take the compute dtype, or bf16: re-quantized).
LLM.int8 is tiered's own per-row int8 (quant/int8.py, scale = SCB / 127 in fp32), the form of a
symmetric per-channel 8-bit GPTQ / compressed-tensors weight: its handle has their format "INT8"
(checkpoint/int8_packed.py), and its `int8_parts` give the checkpoint's codes to the int8 decode
copies and int8 experts, bit for bit (the scale rounded to bf16 there). `nbytes` is the module's bytes
in the files (codes, scales, maps and JSON), what a read of it costs.

Sources: bitsandbytes (functional.py: QuantState.from_dict / as_dict, quantize_4bit, dequantize_4bit,
get_4bit_type, create_dynamic_map; backends/default/ops.py: the torch reference of the kernels;
nn/modules.py: the state dict layouts; utils.py: pack_dict_to_tensor), transformers
(integrations/bitsandbytes.py, quantizers/quantizer_bnb_4bit.py, quantizer_bnb_8bit.py).
"""

from __future__ import annotations

import json
import math
import re

import torch

from tiered.checkpoint.handle import TensorHandle
from tiered.checkpoint.int4_packed import take
from tiered.checkpoint.int8_packed import INT8_FORMAT
from tiered.errors import CheckpointError, UnsupportedModelError

NF4_FORMAT, FP4_FORMAT = "BNB_NF4", "BNB_FP4"  # TensorHandle.format of a folded 4-bit weight (8-bit: "INT8")
FORMATS = (NF4_FORMAT, FP4_FORMAT)

# NF4: the 16 quantiles of N(0, 1) scaled to [-1, 1] (QLoRA section 3; bitsandbytes' get_4bit_type "nf4")
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
       0.7229568362236023, 1.0)
# FP4 as bitsandbytes defines it: 1 sign bit (bit 3), 2 exponent bits, 1 mantissa bit with an exponent
# bias of 2, listed by code and divided by the largest magnitude (12); not OCP's e2m1
FP4 = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)
TABLES = {"nf4": NF4, "fp4": FP4}
FORMAT_OF = {"nf4": NF4_FORMAT, "fp4": FP4_FORMAT}
INV127 = 7.874015718698502e-3  # bitsandbytes' 1 / 127 (int8_vectorwise_dequant), applied in fp32
ROW_LAYOUTS = {0: "row", 1: "col32", 2: "col_turing", 3: "col_ampere"}  # X.weight_format values
_PIECES = re.compile(r"^(.+)\.weight\.(absmax|quant_map|nested_absmax|nested_quant_map"
                     r"|quant_state\.bitsandbytes__\w+)$")
_FIX = "re-download the checkpoint's shards"


def code_table(quant_type: str) -> torch.Tensor:
    """The 4-bit code table of `quant_type` ("nf4" or "fp4"): fp32 [16], code c -> value in [-1, 1],
    computed as bitsandbytes' get_4bit_type does (the listed values in fp32, over their largest magnitude).

    Raises:
        UnsupportedModelError: another quant_type.
    """
    if quant_type not in TABLES:
        raise UnsupportedModelError(f"bitsandbytes 4-bit quant_type {quant_type!r}; tiered reads nf4 and fp4",
                                    "use the model's bf16 release or a GGUF conversion")
    t = torch.tensor(TABLES[quant_type], dtype=torch.float32)
    return t / t.abs().max()


def dequantize_absmax(codes: torch.Tensor, nested_absmax: torch.Tensor, nested_map: torch.Tensor,
                      nested_blocksize: int, offset: float) -> torch.Tensor:
    """Double-quantized absmax: codes uint8 [B], nested_absmax fp32 [ceil(B / nested_blocksize)],
    nested_map fp32 [256] -> fp32 [B] = nested_map[code] * nested_absmax[b // nested_blocksize] + offset."""
    return _blockwise(nested_map[codes.int()], nested_absmax.float(), nested_blocksize) + torch.tensor(
        offset, dtype=torch.float32)


def dequantize_4bit(packed: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor, blocksize: int,
                    shape: tuple[int, int]) -> torch.Tensor:
    """bitsandbytes' packed 4-bit weight -> fp32 `shape` [N, K].

    Args:
        packed: uint8 [ceil(N K / 2)]: flat element 2i in byte i's high nibble, 2i + 1 in its low one.
        absmax: fp32 [ceil(N K / blocksize)], one per run of `blocksize` flat elements.
        table: fp32 [16], the code table (`code_table`).
    Returns:
        fp32 [N, K], w[i] = table[code_i] * absmax[i // blocksize] (one fp32 product, as bitsandbytes).
    """
    n = math.prod(shape)
    by_byte = torch.stack([table.repeat_interleave(16), table.repeat(16)], dim=-1)  # (256, 2): byte -> (high, low)
    return _blockwise(by_byte[packed.int()].reshape(-1)[:n], absmax.float(), blocksize).reshape(shape)


def dequantize_int8(q: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    """LLM.int8 weight: q int8 [N, K], SCB [N] (row absmax) -> fp32 [N, K] = (q * SCB) * (1 / 127), in
    fp32 as bitsandbytes' int8_vectorwise_dequant computes it."""
    return (q.float() * scb.float()[:, None]) * torch.tensor(INV127, dtype=torch.float32)


def _blockwise(values: torch.Tensor, absmax: torch.Tensor, blocksize: int) -> torch.Tensor:
    """values fp32 [n] times absmax[i // blocksize] (fp32 [ceil(n / blocksize)]) -> fp32 [n]."""
    n = values.numel()
    pad = -n % blocksize
    v = (torch.nn.functional.pad(values, (0, pad)) if pad else values).view(-1, blocksize)  # (blocks, blocksize)
    return (v * absmax[:, None]).reshape(-1)[:n]


def fold(handles: dict[str, TensorHandle], qc: dict, where) -> None:
    """Replace each bitsandbytes-quantized Linear's tensors in `handles` (name -> TensorHandle, in place)
    by one handle `X.weight` of format BNB_NF4, BNB_FP4 (4-bit) or INT8 (LLM.int8), shape [N, K],
    loading fp32 dequantized. Reads each 4-bit weight's quant_state JSON (a few hundred bytes) now;
    the codes and scales are read by `load`. Modules left dense (llm_int8_skip_modules) stay as they are.

    Args:
        qc: the config's quantization_config (quant_method "bitsandbytes"); the tensors present say
            which modules are quantized and how, each 4-bit one by its own quant_state.
        where: the checkpoint's path, for messages.
    Raises:
        UnsupportedModelError: a 4-bit quant_type other than nf4 / fp4, an 8-bit weight in an old GPU
            tile layout (weight_format col32 / col_turing / col_ampere).
        CheckpointError: a piece missing (absmax, quant_map, quant_state, nested map or absmax, SCB),
            a quant_state that is not JSON or gives a shape, blocksize or type the tensors contradict,
            a packed weight without its quant_state, a piece of the wrong size or dtype.
    """
    fourbit = sorted({m.group(1) for k in handles if (m := _PIECES.match(k))})
    eightbit = sorted(k[:-len(".SCB")] for k in handles if k.endswith(".SCB"))
    for base in fourbit:
        _fold_4bit(handles, base, where)
    for base in eightbit:
        _fold_int8(handles, base, where)
    for key, h in handles.items():  # a quantized weight whose state is gone
        if key.endswith(".weight") and h.format == "I8":
            raise CheckpointError(f"{where} lacks tensor {key[:-len('.weight')] + '.SCB'!r}, the row scales of "
                                  f"LLM.int8 weight {key!r}", _FIX)
        if key.endswith(".weight") and h.format == "U8" and len(h.shape) == 2 and h.shape[1] == 1 and \
                qc.get("load_in_4bit", qc.get("_load_in_4bit")):
            raise CheckpointError(f"{where} lacks the quant_state of packed 4-bit weight {key!r} (tensor "
                                  f"{key + '.quant_state.bitsandbytes__nf4'!r} or __fp4)", _FIX)


def _quant_state(handles, base, where) -> tuple[dict, TensorHandle]:
    """The JSON of `base`'s 4-bit quant_state and its handle (taken out of `handles`), checked against
    the quant_type its tensor name gives."""
    keys = [k for k in handles if k.startswith(base + ".weight.quant_state.")]
    if len(keys) != 1:
        what = "no" if not keys else f"{len(keys)}"
        raise CheckpointError(f"{where}: {base}.weight has {what} quant_state tensors "
                              f"({base + '.weight.quant_state.bitsandbytes__nf4'!r} or __fp4), one expected", _FIX)
    h = handles.pop(keys[0])
    named = keys[0].rsplit("__", 1)[-1]
    try:
        state = json.loads(bytes(h.load(None).view(torch.uint8).reshape(-1).tolist()).decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: {keys[0]} is not a bitsandbytes quant_state (JSON: {e})", _FIX) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: {keys[0]} holds a JSON {type(state).__name__}, not a quant_state object", _FIX)
    qt = state.get("quant_type", named)
    code_table(qt)  # refuses an unknown type
    if qt != named:
        raise CheckpointError(f"{where}: {keys[0]} names quant_type {named!r} but its JSON says {qt!r}", _FIX)
    return state, h


def _positive(state, key, base, where, default=None) -> int:
    v = state.get(key, default)
    if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
        raise CheckpointError(f"{where}: {base}.weight's quant_state gives {key} {v!r}, a positive int expected", _FIX)
    return v


def _fold_4bit(handles, base, where) -> None:
    state, qs = _quant_state(handles, base, where)
    quant_type = state.get("quant_type", qs.name.rsplit("__", 1)[-1])
    w = take(handles, base + ".weight", where)
    absmax = take(handles, base + ".weight.absmax", where)
    qmap = take(handles, base + ".weight.quant_map", where)
    shape = state.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) and d > 0 for d in shape)):
        raise CheckpointError(f"{where}: {base}.weight's quant_state gives shape {shape!r}; a Linear weight "
                              "[out_features, in_features] expected", _FIX)
    N, K = shape
    n = N * K
    if w.nbytes != (n + 1) // 2:
        raise CheckpointError(f"{where}: {base}.weight holds {w.nbytes} bytes of 4-bit codes but its quant_state "
                              f"gives shape {shape} ({(n + 1) // 2} bytes)", _FIX)
    blocksize = _positive(state, "blocksize", base, where, 64)
    blocks = -(-n // blocksize)
    if math.prod(qmap.shape) != 16:
        raise CheckpointError(f"{where}: {base}.weight.quant_map has shape {tuple(qmap.shape)}, 16 values expected",
                              _FIX)
    nested = base + ".weight.nested_absmax" in handles or base + ".weight.nested_quant_map" in handles
    pieces = [w, absmax, qmap, qs]
    if nested:
        nabs = take(handles, base + ".weight.nested_absmax", where)
        nmap = take(handles, base + ".weight.nested_quant_map", where)
        nb = _positive(state, "nested_blocksize", base, where, 256)
        offset = state.get("nested_offset")
        if not isinstance(offset, (int, float)) or isinstance(offset, bool):
            raise CheckpointError(f"{where}: {base}.weight's quant_state gives nested_offset {offset!r}, a number "
                                  "expected", _FIX)
        if math.prod(nmap.shape) != 256 or math.prod(nabs.shape) != -(-blocks // nb):
            raise CheckpointError(f"{where}: {base}.weight's nested_quant_map {tuple(nmap.shape)} or nested_absmax "
                                  f"{tuple(nabs.shape)} does not fit {blocks} absmax codes in blocks of {nb} "
                                  "(256 and ceil(codes / blocks) values expected)", _FIX)
        pieces += [nabs, nmap]
    want = "U8" if nested else "F32"
    if math.prod(absmax.shape) != blocks or absmax.format not in ((want,) if nested else ("F32", "F16", "BF16")):
        raise CheckpointError(f"{where}: {base}.weight.absmax is {absmax.format} {tuple(absmax.shape)}; a "
                              f"{shape} weight in blocks of {blocksize} needs {blocks} {want} values", _FIX)
    table = code_table(quant_type)

    def scales(absmax=absmax):  # fp32 [blocks]
        a = absmax.load(None).reshape(-1)
        if not nested:
            return a.float()
        return dequantize_absmax(a, nabs.load(torch.float32).reshape(-1), nmap.load(torch.float32).reshape(-1),
                                 nb, float(offset))

    def load(w=w):
        return dequantize_4bit(w.load(None).view(torch.uint8).reshape(-1), scales(), table, blocksize, (N, K))
    handles[base + ".weight"] = TensorHandle(name=base + ".weight", shape=(N, K), format=FORMAT_OF[quant_type],
                                             nbytes=sum(p.nbytes for p in pieces), path=w.path, _load=load)


def _fold_int8(handles, base, where) -> None:
    w = take(handles, base + ".weight", where)
    scb = handles.pop(base + ".SCB")
    layout = handles.pop(base + ".weight_format", None)
    pieces = [w, scb] + ([layout] if layout is not None else [])
    if layout is not None:
        code = int(layout.load(None).reshape(-1)[0]) if math.prod(layout.shape) == 1 else None
        if code != 0:
            raise UnsupportedModelError(f"{where}: {base}'s LLM.int8 weight is stored in layout "
                                        f"{ROW_LAYOUTS.get(code, code)!r}; tiered reads row-major ones (0, \"row\")",
                                        "re-save the checkpoint with a current bitsandbytes, or use the bf16 release")
    if w.format != "I8" or len(w.shape) != 2:
        raise CheckpointError(f"{where}: {base}.weight is {w.format} {tuple(w.shape)} beside {base}.SCB; LLM.int8 "
                              "stores int8 [out_features, in_features]", _FIX)
    N, K = w.shape
    if math.prod(scb.shape) != N or scb.format not in ("F32", "F16", "BF16"):
        raise CheckpointError(f"{where}: {base}.SCB is {scb.format} {tuple(scb.shape)}; {N} float row scales "
                              "expected", _FIX)

    def rows(w=w, scb=scb):  # (q int8 [N, K], scale fp32 [N]): w ~ q * scale
        return w.load(None), scb.load(torch.float32).reshape(-1) * torch.tensor(INV127, dtype=torch.float32)

    def load(w=w, scb=scb):
        return dequantize_int8(w.load(None), scb.load(torch.float32).reshape(-1))
    handles[base + ".weight"] = TensorHandle(name=base + ".weight", shape=(N, K), format=INT8_FORMAT,
                                             nbytes=sum(p.nbytes for p in pieces), path=w.path, _load=load,
                                             _int8=rows, int8_group=K)
