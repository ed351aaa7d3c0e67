"""Hugging Face model directories: config.json + one or many safetensors files.

Tensors are opened with `safetensors.safe_open` (memory-mapped; one tensor read at a time, as
nano-vllm's loader does). Sharded checkpoints are found through model.safetensors.index.json.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from tiered.checkpoint.handle import DENSE_BYTES, HandleTable, TensorHandle
from tiered.checkpoint.model_config import MULTIMODAL_TEXT, ModelConfig, fused_projections, is_int
from tiered.errors import CheckpointError, UnsupportedModelError

INDEX = "model.safetensors.index.json"


# Bits per element of every dtype the safetensors format defines (its Dtype enum): a header naming
# another dtype is corrupt (or from a newer writer), and the library refuses it at the first load.
SAFETENSORS_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16,
    "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
MAX_HEADER = 100_000_000  # bytes: the largest header the safetensors library reads


def _is_count(x) -> bool:
    """x is a non-negative int (a bool is not)."""
    return is_int(x) and x >= 0


def _check_safetensors_file(path: Path) -> tuple[dict, int]:
    """Parse a safetensors header and check it the way the safetensors library will at the first load.

    Every tensor must name a known dtype, a shape of non-negative ints and data_offsets [begin, end]
    with prod(shape) x dtype size == end - begin; the tensors' byte ranges must follow each other
    with no gap or overlap from offset 0, and the file must hold exactly the bytes they cover.

    Returns:
        The header dict (tensor name -> {dtype, shape, data_offsets}) and the header's length.
    Raises:
        CheckpointError: the file is truncated, its header is not valid JSON, or a tensor's entry
            is inconsistent (named in the message).
    """
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError("header longer than file")
            if n > MAX_HEADER:
                raise ValueError(f"header of {n} bytes, the format allows {MAX_HEADER}")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError(f"header is a JSON {type(header).__name__}, not an object")
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not a valid safetensors file ({e})",
                              "re-download or re-convert the checkpoint") from None
    spans = []
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        spans.append((_tensor_span(path, key, meta), key))
    end = 0
    for (begin, stop), key in sorted(spans):
        if begin != end:
            what = f"a gap of {begin - end} bytes" if begin > end else f"an overlap of {end - begin} bytes"
            raise CheckpointError(f"{path} is corrupt: tensor {key!r} starts at byte {begin} of the data, "
                                  f"leaving {what} after the tensor before it",
                                  "re-download or re-convert the checkpoint")
        end = stop
    if 8 + n + end > size:
        raise CheckpointError(f"{path} is truncated: {size} bytes on disk, {8 + n + end} expected",
                              "re-download or re-copy the file")
    if 8 + n + end < size:
        raise CheckpointError(f"{path} is corrupt: {size - 8 - n - end} bytes past its last tensor "
                              f"({size} bytes on disk, {8 + n + end} expected)", "re-download or re-copy the file")
    return header, n


def _tensor_span(path: Path, key: str, meta) -> tuple[int, int]:
    """(begin, end) of tensor `key`'s bytes in the data section, after checking its header entry.

    Raises:
        CheckpointError: the entry lacks a field, names an unknown dtype, or its byte range does
            not hold prod(shape) elements of its dtype.
    """
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path} is corrupt: tensor {key!r} {why}", "re-download or re-convert the checkpoint")

    if not isinstance(meta, dict) or not {"dtype", "shape", "data_offsets"} <= meta.keys():
        raise bad("has no dtype, shape and data_offsets in the header")
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPE_BITS:
        raise bad(f"has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
        raise bad(f"has invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise bad(f"has invalid data_offsets {offsets!r}")
    bits = SAFETENSORS_DTYPE_BITS[dtype]
    for s in shape:
        bits *= s
    begin, end = offsets
    if bits % 8 or bits // 8 != end - begin:
        raise bad(f"of dtype {dtype} and shape {tuple(shape)} needs {bits / 8:g} bytes, but its data_offsets "
                  f"[{begin}, {end}] hold {end - begin}")
    return begin, end


def _read_index(index: Path) -> list[str]:
    """The shard files named by a model.safetensors.index.json, sorted.

    Raises:
        CheckpointError: the index is not valid JSON or has no weight_map of tensor -> file names.
    """
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index} is not valid JSON ({e})",
                              "restore the file, or delete it if the directory holds one model.safetensors") from None
    except AttributeError:  # valid JSON, but not an object
        weight_map = None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(v, str) and v for v in weight_map.values()):
        raise CheckpointError(f"{index} has no \"weight_map\" of tensor names to shard files",
                              "restore the file, or delete it if the directory holds one model.safetensors")
    return sorted(set(weight_map.values()))


def _exponent_scales(h: TensorHandle) -> TensorHandle:
    """Block scales stored as UE8M0 exponent bytes (safetensors U8 or F8_E8M0): a handle that loads
    them as fp32 2^(byte - 127), as transformers reads them (never read raw: offset None)."""
    def load(h=h):
        return (h.load(None).view(torch.uint8).float() - 127.0).exp2()
    return TensorHandle(name=h.name, shape=h.shape, format="F32", nbytes=h.nbytes, path=h.path, _load=load)


# a multimodal checkpoint's language-model prefixes (transformers 4.x's Gemma3ForConditionalGeneration files,
# then 5.x's) -> a causal LM's
_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."))


def _language_model(handles: dict[str, TensorHandle]) -> dict[str, TensorHandle]:
    """The language model's tensors of a multimodal checkpoint (model_config.MULTIMODAL_TEXT), renamed as a causal
    LM's (`_TEXT_PREFIXES`); the vision tower's and the projector's are left out."""
    out = {}
    for key, h in handles.items():
        for old, new in _TEXT_PREFIXES:
            if key.startswith(old):
                name = new + key[len(old):]
                out[name] = replace(h, name=name)
                break
        else:
            if key == "lm_head.weight":
                out[key] = h
    return out


def _plus_one(h: TensorHandle) -> TensorHandle:
    """A Gemma RMSNorm weight w (its norm multiplies by 1 + w): a handle that loads 1 + w in fp32, as llama.cpp's
    converter stores Gemma's norms (never read raw: offset None)."""
    def load(h=h):
        return h.load(torch.float32) + 1.0
    return TensorHandle(name=h.name, shape=h.shape, format="F32", nbytes=h.nbytes, path=h.path, _load=load)


# quantization_config.quant_method values whose fp8 weights tiered reads (HFDirCheckpoint._scaled_fp8)
FP8_METHODS = ("fp8", "compressed-tensors", "fbgemm_fp8")
# per-layer tensors of those schemes that tiered does not use: activation and KV-cache scales, zero points
FP8_DROPPED = ("activation_scale", "input_scale", "input_scale_ub", "input_zero_point", "weight_zero_point",
               ".k_scale", ".v_scale", "output_scale")


def _scale_block(shape: tuple[int, ...], scale_shape: tuple[int, ...], block: tuple[int, int] | None) -> tuple[int, int]:
    """The block (rows, columns) one scale of an fp8 weight `shape` [N, K] covers: the config's `block`
    where it names one; else (N, K) for a single scale (per tensor), (1, K) for one per row ([N] or
    [N, 1]: per output channel), else 128 x 128 (transformers' default)."""
    if block is not None or len(shape) != 2:
        return block or (128, 128)
    N, K = shape
    if _numel(scale_shape) == 1:
        return N, K
    if tuple(scale_shape) in ((N,), (N, 1)):
        return 1, K
    return 128, 128


def _scale_grid(scale_shape: tuple[int, ...], block: tuple[int, int], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scales' shape as the grid [ceil(N/br), ceil(K/bc)] where they are that grid stored flat (a
    per-tensor [] or [1] scale, a per-channel [N]), else as stored (check_scales names a mismatch)."""
    from tiered.quant.fp8 import scale_shape as grid_of

    if len(shape) != 2 or len(scale_shape) > 1:
        return tuple(scale_shape)
    want = grid_of(*shape, block)
    return want if _numel(scale_shape) == want[0] * want[1] and 1 in want else tuple(scale_shape)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# generation_config.json's sampling fields that a server's request may leave out (vLLM's --generation-config auto)
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_config(path: Path) -> dict:
    """The directory's generation_config.json as a dict; {} without the file or where it is unreadable (it only
    adds stops and defaults)."""
    try:
        cfg = json.loads((path / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def generation_defaults(path: Path) -> dict:
    """The sampling generation_config.json recommends (`SAMPLING_DEFAULTS` present with numbers: Qwen3's temperature
    0.6, top_p 0.95, top_k 20), as vLLM's server applies it to requests that leave them out; {} without the file,
    where it is unreadable, or where it sets do_sample false (its values then describe no sampling)."""
    cfg = generation_config(path)
    if cfg.get("do_sample") is False:
        return {}
    return {k: cfg[k] for k in SAMPLING_DEFAULTS
            if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg.get(k), bool)}


def generation_eos(path: Path) -> tuple[int, ...]:
    """The end-of-sequence ids generation_config.json names beside config.json's (transformers' generate stops at
    them): Llama 3.1's <|eom_id|> / <|eot_id|>, gpt-oss's <|call|> (a tool call ends its output) and
    <|endoftext|>. () without the file, or where it is unreadable or names none (it only adds stops)."""
    eos = generation_config(path).get("eos_token_id")
    eos = eos if isinstance(eos, list) else [eos]
    return tuple(int(e) for e in eos if isinstance(e, int) and not isinstance(e, bool))


class HFDirCheckpoint(HandleTable):
    """A model directory in the Hugging Face layout.

    Args:
        path: directory with config.json and *.safetensors (optionally sharded with an index).
    Raises:
        CheckpointError: no config.json, or one that is not valid JSON or lacks a field (or gives it
            a value of the wrong type); no safetensors; a malformed index; a shard missing,
            truncated or with an inconsistent header.
        UnsupportedModelError: the architecture is not one tiered runs.
    """

    format_name = "safetensors"

    def generation_defaults(self) -> dict:
        """generation_config.json's sampling (`generation_defaults`)."""
        return generation_defaults(self.path)

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{self.path} has no config.json",
                                  "pass a Hugging Face model directory or a .gguf file")
        try:
            self.hf_config = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{cfg_path} is not valid JSON ({e})", "restore the file") from None
        self.config = ModelConfig.from_hf(self.hf_config, source=cfg_path)
        more = generation_eos(self.path)
        if more:
            self.config = replace(self.config, eos_token_ids=tuple(dict.fromkeys(self.config.eos_token_ids + more)))
        index = self.path / INDEX
        if index.is_file():
            files = _read_index(index)
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path} has no *.safetensors weights",
                                  "convert the checkpoint to safetensors (pytorch .bin is not read)")
        self._handles: dict[str, TensorHandle] = {}
        for name in files:
            f = self.path / name
            if not f.is_file():
                raise CheckpointError(f"shard {f} named in {INDEX} is missing", "download every shard")
            header, header_len = _check_safetensors_file(f)
            for key, meta in header.items():
                if key == "__metadata__":
                    continue
                begin, end = meta["data_offsets"]
                self._handles[key] = TensorHandle(
                    name=key, shape=tuple(meta["shape"]), format=meta["dtype"], nbytes=end - begin,
                    path=str(f), _load=self._loader(str(f), key), offset=8 + header_len + begin)
        if self.hf_config.get("model_type") in MULTIMODAL_TEXT:
            self._handles = _language_model(self._handles)
        if self.config.model_type == "phi3":  # fused q/k/v and gate/up -> Llama's projections
            self._handles = self._split_fused(self._handles)
        if self.config.sandwich_norms:  # Gemma's RMSNorm multiplies by (1 + weight): stored as 1 + weight
            self._handles = {k: _plus_one(h) if k.endswith("norm.weight") else h for k, h in self._handles.items()}
        self._open: dict[str, object] = {}
        qc = self.hf_config.get("quantization_config")
        if self.config.model_type == "gpt_oss":  # fused (MXFP4) experts -> per-expert handles
            from tiered.checkpoint import gpt_oss

            gpt_oss.fold(self._handles, self.config, qc, self.path, self._expert_slice)
            if isinstance(qc, dict) and qc.get("quant_method") == "mxfp4":
                qc = None  # the rest (attention, router, embeddings, head) is stored unquantized
        self._scaled_fp8(qc)

    def _scaled_fp8(self, qc) -> None:
        """Fold scaled fp8 weights into one handle each: `X.weight` (F8_E4M3) and its scales become an
        F8_E4M3 handle that loads dequantized (quant/fp8.dequantize_fp8, as transformers does: the
        product in fp32) and gives its stored form through `scaled_fp8` with its block (`fp8_block`):

          quant_method "fp8"      transformers' fine-grained FP8 (DeepSeek-V3, Qwen3-FP8):
                                  `X.weight_scale_inv` per weight_block_size block (128 x 128); AutoFP8's
                                  per-tensor `X.weight_scale` (Neural Magic's older FP8 releases)
          "compressed-tensors"    float-quantized 8-bit float weights, strategy "channel" (`X.weight_scale`
                                  [N, 1]: RedHatAI's Llama-3.1-70B-Instruct-FP8), "tensor" ([1]) or
                                  "block" (block_structure)
          "fbgemm_fp8"            `X.weight_scale` [N, 1] per output channel (Meta's Llama-3.1-405B-FP8)

        A scale per channel is the block (1, K), per tensor (N, K). Activation scales (static schemes'
        `input_scale`, fbgemm's bound) and KV-cache scales are dropped: weights are dequantized or
        computed as stored against activations in the compute dtype (transformers' dequantizing loads
        do the same).

        Raises:
            UnsupportedModelError: another quantization method or scheme (float weights of other widths,
                asymmetric, grouped or sparse; integer ones: checkpoint/int4_packed.py, int8_packed.py), or
                fp8 other than e4m3.
            CheckpointError: an fp8 tensor without quantization_config or without its scales, or
                scales of the wrong shape or dtype.
        """
        from tiered.quant.fp8 import check_scales, dequantize_fp8

        fp8 = [k for k, h in self._handles.items() if h.format == "F8_E4M3"]
        if qc is None:
            if fp8:
                raise CheckpointError(f"{self.path} stores float8 tensor {fp8[0]!r} but its config.json has no "
                                      "quantization_config", "restore the checkpoint's config.json")
            return
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        from tiered.checkpoint import bnb, int4_packed, int8_packed

        if int8_packed.reads(qc):  # 8-bit integer weights: GPTQ Int8, compressed-tensors W8A8 / W8A16 int8
            fold = int8_packed.fold
        elif method in ("gptq", "awq") or (method == "compressed-tensors" and qc.get("format") == "pack-quantized"):
            fold = int4_packed.fold
        elif method == "bitsandbytes":  # 4-bit NF4 / FP4 and 8-bit LLM.int8 (checkpoint/bnb.py)
            fold = bnb.fold
        else:
            fold = None
        if fold is not None:  # integer weights: no fp8 tensor belongs beside them
            if fp8:
                raise UnsupportedModelError(f"{self.path} mixes fp8 tensors into a {method} checkpoint",
                                            "use the model's bf16 release")
            fold(self._handles, qc, self.path)
            return
        if method not in FP8_METHODS:
            raise UnsupportedModelError(
                f"{self.path} is quantized with {method!r}; tiered reads fp8 safetensors (quant_method "
                "\"fp8\", \"fbgemm_fp8\" or float-quantized \"compressed-tensors\"), 4-bit GPTQ, AWQ and "
                "pack-quantized compressed-tensors ones, 8-bit GPTQ and int-quantized compressed-tensors ones, "
                "bitsandbytes 4-bit (nf4, fp4) and 8-bit ones, GGUF files and unquantized safetensors",
                "use the model's bf16 release or a GGUF conversion")
        block = self._fp8_scheme(qc, method)
        if qc.get("fmt", "e4m3") != "e4m3" or any(h.format.startswith("F8_") and h.format != "F8_E4M3"
                                                   for h in self._handles.values()):
            raise UnsupportedModelError(f"{self.path} stores fp8 weights as {qc.get('fmt')!r}; tiered reads e4m3",
                                        "use the model's bf16 release")
        for key in fp8:
            scale_key = next((key + s for s in ("_scale_inv", "_scale") if key + s in self._handles), None)
            if scale_key is None:
                raise CheckpointError(f"{self.path} lacks tensor {key + '_scale_inv'!r} (or {key + '_scale'!r}), the "
                                      f"scales of fp8 weight {key!r}", "re-download the checkpoint's shards")
            w, sc = self._handles[key], self._handles.pop(scale_key)
            wblock = _scale_block(w.shape, sc.shape, block)
            grid = _scale_grid(sc.shape, wblock, w.shape)
            check_scales(key, w.shape, grid, wblock)
            if sc.format in ("U8", "F8_E8M0"):  # power-of-two scales (UE8M0, "MXFP8"): 2^(byte - 127)
                sc = _exponent_scales(sc)
            elif sc.format not in ("F32", "BF16", "F16"):
                raise CheckpointError(f"{self.path}: the scales {scale_key!r} are stored as {sc.format}",
                                      "re-convert the checkpoint (scales in F32, BF16, F16 or UE8M0)")

            def stored(w=w, sc=sc, grid=grid):
                return w.load(None), sc.load(torch.float32).reshape(grid)

            def dequantized(stored=stored, wblock=wblock):
                return dequantize_fp8(*stored(), torch.float32, wblock)

            raw = TensorHandle(name=key, shape=w.shape, format="U8", nbytes=w.nbytes, path=w.path,
                               _load=lambda w=w: w.load(None).view(torch.uint8), offset=w.offset)
            self._handles[key] = TensorHandle(name=key, shape=w.shape, format="F8_E4M3", nbytes=w.nbytes + sc.nbytes,
                                              path=w.path, _load=dequantized, _fp8=stored, fp8_block=wblock,
                                              fp8_parts=(raw, sc))
        for key in [k for k in self._handles if k.endswith(FP8_DROPPED)]:
            del self._handles[key]

    def _fp8_scheme(self, qc: dict, method: str) -> tuple[int, int] | None:
        """The block (rows, columns) `qc` gives the weights' scales, or None where their shapes say it
        (per channel or per tensor). Raises UnsupportedModelError for compressed-tensors schemes other
        than symmetric 8-bit float weights, CheckpointError for a malformed block size."""
        where = self.path / "config.json"
        block, what = None, "quantization_config.weight_block_size"
        if method == "fp8":
            block = qc.get("weight_block_size")
        elif method == "compressed-tensors":
            fmt = qc.get("format")
            groups = qc.get("config_groups")
            if fmt not in ("float-quantized", "naive-quantized") or not isinstance(groups, dict) or not groups:
                raise UnsupportedModelError(
                    f"{self.path} is compressed-tensors {fmt!r}; tiered reads its float-quantized 8-bit float "
                    "weights (FP8), int-quantized 8-bit integer and pack-quantized 4- and 8-bit integer ones, not "
                    "other or sparse ones", "use the model's bf16 release")
            sparse = qc.get("sparsity_config")
            if isinstance(sparse, dict) and sparse.get("format") not in (None, "dense"):
                raise UnsupportedModelError(f"{self.path} is sparse ({sparse.get('format')!r})",
                                            "use the model's dense bf16 release")
            for name, g in groups.items():
                wq = g.get("weights") if isinstance(g, dict) else None
                if not isinstance(wq, dict) or wq.get("type") != "float" or wq.get("num_bits") != 8 or \
                        wq.get("symmetric") is False or wq.get("strategy") not in ("tensor", "channel", "block"):
                    raise UnsupportedModelError(
                        f"{self.path}: compressed-tensors group {name!r} quantizes weights as {wq!r}; tiered reads "
                        "symmetric 8-bit float weights per tensor, channel or block", "use the model's bf16 release")
                if wq.get("strategy") == "block":
                    block, what = wq.get("block_structure"), f"quantization_config.config_groups.{name}.weights.block_structure"
        if block is None:
            return None
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(is_int(b) and b > 0 for b in block)):
            raise CheckpointError(f"{where}: {what} is {block!r}, two positive ints expected",
                                  "restore the checkpoint's config.json")
        return int(block[0]), int(block[1])

    def _file(self, path: str):
        """The safetensors file at `path`, opened once (safe_open: a memory map; release_pages closes them)."""
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path]

    def _loader(self, file: str, key: str):
        def load():
            # safe_open tensors alias the memory map; clone so callers own their memory.
            return self._file(file).get_tensor(key).clone()
        return load

    def _split_fused(self, handles: dict[str, TensorHandle]) -> dict[str, TensorHandle]:
        """Phi-3's fused projections as Llama's (model_config._phi3_fields): each `self_attn.qkv_proj.weight`
        [(H + 2 Hkv) hd, D] becomes q_proj / k_proj / v_proj handles of its H hd, Hkv hd and Hkv hd rows, each
        `mlp.gate_up_proj.weight` [2F, D] gate_proj and up_proj of its halves (`_row_slice`: read alone, raw
        where the file's bytes are the tensor's).

        Raises:
            UnsupportedModelError: a fused projection stored quantized (its rows do not split by bytes here).
            CheckpointError: a fused projection of another row count than the config's heads / sizes give.
        """
        c = self.config
        parts = {f"{fused}.weight": tuple((f"{name}.weight", n) for name, n in rows)
                 for fused, rows in fused_projections(c).items()}
        out = {}
        for key, h in handles.items():
            suffix = next((s for s in parts if key.endswith("." + s)), None)
            if suffix is None:
                out[key] = h
                continue
            if h.format not in DENSE_BYTES:
                raise UnsupportedModelError(f"{key} is a fused projection stored as {h.format}",
                                            "use the checkpoint's bf16 / fp16 / fp32 safetensors")
            rows = sum(n for _, n in parts[suffix])
            if len(h.shape) != 2 or h.shape[0] != rows:
                raise CheckpointError(f"{self.path}: {key} has shape {list(h.shape)}, expected [{rows}, "
                                      f"{c.hidden_size}] from config.json", "restore the checkpoint")
            prefix, at = key[:-len(suffix)], 0
            for name, n in parts[suffix]:
                out[prefix + name] = self._row_slice(h, prefix + name, at, at + n)
                at += n
        return out

    def _row_slice(self, h: TensorHandle, name: str, a: int, b: int) -> TensorHandle:
        """Rows a..b-1 of the dense 2-D tensor `h`, named `name`: loaded alone (safetensors' get_slice), read raw
        from their bytes in the file (contiguous rows) where `h` is."""
        per_row = h.shape[1] * DENSE_BYTES[h.format]

        def load(h=h, a=a, b=b):
            return self._file(h.path).get_slice(h.name)[a:b].contiguous()
        return TensorHandle(name=name, shape=(b - a, h.shape[1]), format=h.format, nbytes=(b - a) * per_row,
                            path=h.path, _load=load, offset=None if h.offset is None else h.offset + a * per_row)

    def _expert_slice(self, h: TensorHandle):
        """e -> h[e], read alone from its file (safetensors' get_slice): one expert of a fused [E, ...] tensor."""
        def get(e: int) -> torch.Tensor:
            return self._file(h.path).get_slice(h.name)[e]
        return get

    def release_pages(self) -> int:
        """Close the files' memory maps (safe_open handles): their pages leave this process, so the
        OS can drop them from its page cache (posix_fadvise DONTNEED skips mapped pages), and a later
        load maps the file again. Returns the bytes of the files that were mapped."""
        mapped = sum(os.path.getsize(f) for f in self._open)
        self._open.clear()
        return mapped

    def _load_tokenizer(self):
        """The HF tokenizer saved beside the weights, or None when the directory has none."""
        from tiered.checkpoint.tokenizer import load_hf_tokenizer
        return load_hf_tokenizer(self.path)


__all__ = ["HFDirCheckpoint", "DENSE_BYTES"]
