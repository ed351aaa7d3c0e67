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
gate / up [F, D + 1] and down [D, F + 1], each projection's bias as its last column
(ModelConfig.expert_shapes). A handle reads only its expert's slice of the fused tensors and loads
it dequantized (MXFP4 values are exact in bf16 and fp32); it is not readable raw (offset None), so
disk-tier experts are read from a converted copy in the offload directory (memory/expert_store).
Keeping MXFP4 experts packed as an expert format of their own is not done (a later step).
"""

from __future__ import annotations

from typing import Callable

import torch

from tiered.checkpoint.handle import TensorHandle
from tiered.errors import CheckpointError

# the 16 FP4 e2m1 values by code (sign bit 3): transformers' integrations/mxfp4.FP4_VALUES
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # inputs per scale
FUSED = ("gate_up_proj", "down_proj")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 weights -> fp32 [R, G * 32].

    Args:
        blocks: uint8 [R, G, 16]: per row and group of 32 inputs, 16 bytes of two e2m1 codes each,
            input 2j in the low nibble of byte j, input 2j + 1 in the high one.
        scales: uint8 [R, G]: E8M0 exponents, the group's scale 2^(byte - 127).
    Returns:
        fp32 [R, G * 32], each value FP4_E2M1[code] * scale (exact).
    """
    R, G, _ = blocks.shape
    codes = torch.stack((blocks & 0x0F, blocks >> 4), -1).reshape(R, G, MXFP4_GROUP)  # (R, G, 32)
    values = torch.tensor(FP4_E2M1, dtype=torch.float32)[codes.long()]
    scale = torch.exp2(scales.float() - 127.0)  # (R, G)
    return (values * scale[..., None]).reshape(R, G * MXFP4_GROUP)


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
        for e in range(E):
            # (this layer's readers bound as defaults: the loop rebinds the names)
            loads = (
                lambda e=e, w=gate_up, b=gb_get: _with_bias(w(e)[0::2], b(e)[0::2]),  # (F, D + 1)
                lambda e=e, w=gate_up, b=gb_get: _with_bias(w(e)[1::2], b(e)[1::2]),
                lambda e=e, w=down, b=db_get: _with_bias(w(e), b(e)),  # (D, F + 1)
            )
            shapes = ((F, D + 1), (F, D + 1), (D, F + 1))
            for name, load, shape, n, b, f in zip(expert_names(layer, e), loads, shapes, parts_bytes, bias_bytes,
                                                  files):
                handles[name] = TensorHandle(name=name, shape=shape, format=fmt, nbytes=n + b, path=f, _load=load)
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


def _with_bias(w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """w [N, K], b [N] -> [N, K + 1] (w's dtype where both are floats of one dtype, else fp32)."""
    dt = w.dtype if w.dtype == b.dtype else torch.float32
    return torch.cat((w.to(dt), b.to(dt)[:, None]), 1)
