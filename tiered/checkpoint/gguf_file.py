"""GGUF files (llama.cpp's format): metadata -> ModelConfig, tensors -> HF names and layout.

Tensors stay in the file's memory map until loaded. Block formats (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K,
...) are dequantized by the `gguf` package; Q4_0/Q4_1 blocks can also be handed to the int4
kernels untouched (`TensorHandle.blocks`). llama.cpp's converter permutes the rows of q/k
projections of "llama"-architecture models for its interleaved RoPE; we undo that permutation so
the result equals the Hugging Face layout exactly.

MoE files (Mixtral as "llama" with `llama.expert_count`, Qwen2-MoE "qwen2moe", Qwen3-MoE
"qwen3moe", DeepSeek-V2/V3 "deepseek2") store each layer's routed experts stacked: `blk.N.ffn_{gate,up,down}_exps.weight`
[E, F, D] / [E, D, F]. Each expert becomes its own handle with the HF per-expert name, a view of
its rows of the stacked tensor: its blocks are handed to the expert formats as stored
(quant/gguf_experts.py), nothing is dequantized at load.

"deepseek2" files (llama.cpp's DeepSeek-V2/V3 converter) hold multi-head latent attention: the
latent's up-projection kv_b_proj [H (n + v), R] either as one tensor `attn_kv_b` (files converted
before llama.cpp's MLA support, April 2025) or split per head into `attn_k_b` (torch [H, R, n], the
key half transposed) and `attn_v_b` ([H, v, R]); the split pair is read back as one kv_b_proj. The
RoPE rows are in DeepSeek's interleaved-pair order (llama.cpp's NORM RoPE, no permutation). The
router's scoring function is `expert_gating_func` (1 softmax: DeepSeek-V2; 2 sigmoid with the
`exp_probs_b` selection bias: DeepSeek-V3), YaRN's mscale is `yarn_log_multiplier` / 0.1.

"glm4moe" files (llama.cpp's Glm4MoeModel converter: GLM-4.5, 4.5-Air, 4.6) are read as
transformers' glm4_moe: q/k rows as they are (llama.cpp's NEOX RoPE is HF's rotate-half, so no
permutation), `rope.dimension_count` the rotated features per head (head_dim * partial_rotary_factor),
the pre-MLP norm named `post_attention_norm`, DeepSeek-V3's router (sigmoid, `exp_probs_b`, expert
groups when `expert_group_count` > 1, `expert_weights_norm` / `_scale`) after
`leading_dense_block_count` dense layers, `expert_shared_count` ungated shared experts of
`expert_feed_forward_length`. `block_count` counts the multi-token-prediction layers too: the last
`nextn_predict_layers` blocks (their `nextn.*` tensors and their ordinary ones) are not read.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import torch

from tiered.checkpoint.handle import BLOCK_FORMATS, HandleTable, TensorHandle
from tiered.checkpoint.model_config import ModelConfig
from tiered.errors import CheckpointError, UnsupportedModelError

# GGUF architecture -> HF model_type ("deepseek2": deepseek_v3 when its router is sigmoid, else v2).
ARCH_TO_MODEL_TYPE = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                      "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "deepseek2": "deepseek_v2",
                      "glm4moe": "glm4_moe"}
# top-k weights renormalized to sum 1 (llama.cpp's expert_weights_norm default per architecture)
NORM_TOPK = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True}
# Architectures whose converter permutes q/k rows (llama.cpp convert_hf_to_gguf.py LlamaModel).
PERMUTED_QK = ("llama", "mistral")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# DeepSeek's names (latent attention, the router's selection bias, the ungated shared experts)
_DEEPSEEK_NAMES = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# GLM-4.5's names: its pre-MLP norm is llama.cpp's ATTN_POST_NORM, its shared experts DeepSeek's
_GLM4_MOE_NAMES = {"post_attention_norm": "post_attention_layernorm",
                   **{k: v for k, v in _DEEPSEEK_NAMES.items() if k.endswith("_shexp")}}
# stacked expert tensors -> the per-expert projection name (Qwen / OLMoE style, Mixtral style)
_EXPERT_NAMES = {"ffn_gate_exps": ("gate_proj", "w1"), "ffn_up_exps": ("up_proj", "w3"),
                 "ffn_down_exps": ("down_proj", "w2")}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


_READER = None


def fast_reader(path: str | os.PathLike):
    """The `gguf` package's GGUFReader over `path` (read-only), parsing 5-10x faster: the same fields
    and tensors (same values; arrays are plain ndarray views of the file's numpy memmap instead of
    memmap objects). GGUFReader reads every metadata element through `_get`, which for a native
    byte order builds a memmap slice and a byte-order view per call: ~98k calls for SmolLM2's
    tokenizer arrays, 6 s of the default model's start. The subclass's `_get` slices a plain
    ndarray view of the map in that case and defers to GGUFReader's otherwise."""
    global _READER
    if _READER is None:
        from gguf import GGUFReader

        class FastGGUFReader(GGUFReader):
            def _get(self, offset, dtype, count=1, override_order=None):
                if (self.byte_order if override_order is None else override_order) != "I":
                    return super()._get(offset, dtype, count, override_order)
                raw = self.__dict__.get("_plain")
                if raw is None:
                    raw = self._plain = self.data.view(np.ndarray)
                dt = np.dtype(dtype)
                count = int(count)
                return raw[offset:offset + dt.itemsize * count].view(dt)[:count]

            def _get_field_parts(self, orig_offs, raw_type):
                # arrays of strings (a tokenizer's tokens and merges: ~98k for SmolLM2) walked in one
                # loop, each length read from the bytes: the same parts, data indices and types as
                # GGUFReader's recursion, which costs ~1.2 s of the default model's start
                if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
                    return super()._get_field_parts(orig_offs, raw_type)
                raw = self.__dict__.get("_plain")
                if raw is None:
                    raw = self._plain = self.data.view(np.ndarray)
                itype = raw[orig_offs:orig_offs + 4].view(np.uint32)
                alen = raw[orig_offs + 4:orig_offs + 12].view(np.uint64)
                offs, count = orig_offs + 12, int(alen[0])
                scalar = self.gguf_scalar_to_np.get(GGUFValueType(int(itype[0])))
                if scalar is not None:  # one 1-element view per item, as the recursion gives
                    n = np.dtype(scalar).itemsize * count
                    items = raw[offs:offs + n].view(scalar)
                    types = [GGUFValueType.ARRAY] + ([GGUFValueType(int(itype[0]))] if count else [])
                    return 12 + n, [itype, alen, *(items[i:i + 1] for i in range(count))], list(range(2, 2 + count)), types
                if itype[0] != GGUFValueType.STRING:
                    return super()._get_field_parts(orig_offs, raw_type)
                mv = memoryview(raw)
                parts, idxs = [itype, alen], []
                for _ in range(count):
                    n = int.from_bytes(mv[offs:offs + 8], "little")
                    parts += (raw[offs:offs + 8].view(np.uint64), raw[offs + 8:offs + 8 + n])
                    idxs.append(len(parts) - 1)
                    offs += 8 + n
                types = [GGUFValueType.ARRAY] + ([GGUFValueType.STRING] if idxs else [])
                return offs - orig_offs, parts, idxs, types

        from gguf import GGUFValueType
        _READER = FastGGUFReader
    return _READER(path, "r")


def gguf_to_hf_name(name: str, model_type: str = "") -> str | None:
    """HF parameter name of a GGUF tensor name, or None when tiered has no use for it. Stacked
    expert tensors give the name pattern with "{e}" for the expert index."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.match(name)
    if not m:
        return None
    layer, part, kind = m.groups()
    mlp = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    if part in _EXPERT_NAMES:
        proj = _EXPERT_NAMES[part][model_type == "mixtral"]
        return f"model.layers.{layer}.{mlp}.experts.{{e}}.{proj}.{kind}"
    if model_type.startswith("deepseek") or model_type == "glm4_moe":
        if part == "exp_probs_b":  # llama.cpp's `exp_probs_b.bias`: the router's selection bias
            return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        names = _GLM4_MOE_NAMES if model_type == "glm4_moe" else _DEEPSEEK_NAMES
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{kind}"
    if part in _BLOCK_NAMES:
        hf = _BLOCK_NAMES[part]
        if model_type == "mixtral" and hf == "mlp.gate":
            hf = "block_sparse_moe.gate"
        return f"model.layers.{layer}.{hf}.{kind}"
    return None


def qk_row_permutation(rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation: hf[i] = gguf[perm[i]]. int64 [rows]."""
    half = rows // n_head // 2
    return np.arange(rows).reshape(n_head, half, 2).swapaxes(1, 2).reshape(-1)


_TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                     "tokenizer.ggml.scores")


def _header_error(path: Path, size: int, e: Exception) -> CheckpointError:
    """The CheckpointError for a GGUF file whose header the gguf package failed to parse with `e`:
    no GGUF magic, a version its reader does not handle, else a file cut short or damaged (the reader then fails
    with whatever reading past the end or garbage gives: a reshape, an index, an unpack error)."""
    from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] != b"GGUF":
        return CheckpointError(f"{path} does not start with the GGUF magic bytes", "re-download the file")
    if len(head) == 8:
        version = int.from_bytes(head[4:], "little")
        if not version & 0xFFFF:  # written on a big-endian machine (the reader handles those)
            version = int.from_bytes(head[4:], "big")
        if version not in READER_SUPPORTED_VERSIONS:
            return CheckpointError(f"{path} is GGUF version {version}; tiered reads versions "
                                   + ", ".join(map(str, READER_SUPPORTED_VERSIONS)),
                                   "re-convert the file with a current llama.cpp, or re-download it if it is damaged")
    return CheckpointError(f"{path} is truncated or corrupt: its GGUF header cannot be read "
                           f"({size} bytes on disk; {type(e).__name__}: {e})", "re-download or re-convert the file")


class GGUFCheckpoint(HandleTable):
    """One .gguf file read as a checkpoint with HF tensor names.

    Args:
        path: the .gguf file.
    Raises:
        CheckpointError: not a GGUF file, of a GGUF version the reader does not handle, or
            truncated or corrupt.
        UnsupportedModelError: an architecture tiered does not run.
    """

    format_name = "gguf"
    missing_hint = "the GGUF file is incomplete or of another architecture"

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        try:
            self.reader = fast_reader(self.path)
        except Exception as e:  # the gguf package raises ValueError/struct errors/IndexError
            raise _header_error(self.path, size, e) from None
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise CheckpointError(f"{self.path} is truncated: tensor {t.name} ends past the file's "
                                      f"{size} bytes", "re-download or re-copy the file")
        self.metadata = {k: self._field(k) for k in self.reader.fields}
        self.config = self._model_config()
        for key in _TOKENIZER_ARRAYS:  # ~90 MB of parsed views for a 49k vocabulary; the tokenizer re-reads the file
            self.reader.fields.pop(key, None)
        self._handles: dict[str, TensorHandle] = {}
        split: dict[int, dict[str, object]] = {}  # layer -> {"k": attn_k_b, "v": attn_v_b} (latent attention)
        for t in self.reader.tensors:
            m = _BLOCK_RE.match(t.name)
            if self.arch == "deepseek2" and m and m.group(2) in ("attn_k_b", "attn_v_b"):
                split.setdefault(int(m.group(1)), {})[m.group(2)[5]] = t
                continue
            hf = gguf_to_hf_name(t.name, self.config.model_type)
            if hf is None or (m and int(m.group(1)) >= self.config.num_hidden_layers):
                continue  # unused, or a multi-token-prediction layer past the model's (glm4moe)
            if "{e}" in hf:  # stacked experts: one handle per expert, a view of its rows
                for e in range(int(t.shape[-1])):
                    self._handles[hf.format(e=e)] = self._make_handle(hf.format(e=e), t, expert=e)
            else:
                self._handles[hf] = self._make_handle(hf, t)
        for layer, parts in split.items():
            if set(parts) != {"k", "v"}:
                raise CheckpointError(f"{self.path}: layer {layer} has only one of attn_k_b / attn_v_b",
                                      "re-convert the file")
            name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
            self._handles[name] = self._kv_b_handle(name, self._make_handle(name + ".k", parts["k"]),
                                                    self._make_handle(name + ".v", parts["v"]))

    def release_pages(self) -> int:
        """The GGUF file is one numpy memmap: MADV_DONTNEED on it drops the pages the load read
        (the whole file: ~94 MB of RSS for SmolLM2) while the mapping stays valid."""
        mm = getattr(self.reader.data, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise"):
            return 0
        import mmap

        mm.madvise(mmap.MADV_DONTNEED)
        return len(mm)

    def _field(self, key: str):
        f = self.reader.fields[key]
        if key in _TOKENIZER_ARRAYS:
            return len(f.data)  # big arrays: only their length is kept here
        try:
            return f.contents()
        except Exception:
            return None

    def _kv_b_handle(self, name: str, k: TensorHandle, v: TensorHandle) -> TensorHandle:
        """kv_b_proj [H (n + v), R] read back from llama.cpp's split pair: attn_k_b torch [H, R, n]
        (each head's key rows, transposed) and attn_v_b [H, v, R]."""
        (H, R, n), (_, dv, _) = k.shape, v.shape

        def load() -> torch.Tensor:
            kb, vb = k.load(torch.float32), v.load(torch.float32)
            return torch.cat((kb.transpose(1, 2), vb), 1).reshape(H * (n + dv), R).contiguous()

        fmt = k.format if k.format == v.format else "F32"
        return TensorHandle(name=name, shape=(H * (n + dv), R), format=fmt, nbytes=k.nbytes + v.nbytes,
                            path=str(self.path), _load=load)

    def _deepseek_config(self, g, names: set[str], common: dict) -> ModelConfig:
        """The ModelConfig of a "deepseek2" file (see the module docstring for the layout).

        Raises:
            UnsupportedModelError: softmax routing within expert groups (llama.cpp scores a group
                by its two best experts, which no transformers DeepSeek router does), or YaRN
                without its yarn_log_multiplier.
        """
        r = int(g("rope.dimension_count"))
        kr = int(g("attention.kv_lora_rank"))
        mla = bool(g("attention.key_length_mla") and g("attention.value_length_mla"))
        k_len = g("attention.key_length_mla") if mla else g("attention.key_length")
        v_len = g("attention.value_length_mla") if mla else g("attention.value_length")
        sigmoid = g("expert_gating_func") == 2 or any(n.endswith("exp_probs_b.bias") for n in names)
        groups, used = int(g("expert_group_count") or 1), int(g("expert_group_used_count") or 1)
        if groups > 1 and not sigmoid:
            raise UnsupportedModelError("deepseek2 GGUF with softmax routing within expert groups is not read",
                                        "load the Hugging Face safetensors directory instead")
        scaling = None
        if g("rope.scaling.type") == "yarn":
            log_mul = g("rope.scaling.yarn_log_multiplier")
            if not log_mul:
                raise UnsupportedModelError("deepseek2 GGUF with YaRN but no rope.scaling.yarn_log_multiplier",
                                            "re-convert the file with a current llama.cpp")
            m = float(log_mul) / 0.1  # llama.cpp takes mscale = mscale_all_dim
            scaling = {"rope_type": "yarn", "factor": float(g("rope.scaling.factor")),
                       "original_max_position_embeddings": int(g("rope.scaling.original_context_length")
                                                               or common["max_position_embeddings"]),
                       "beta_fast": float(g("rope.scaling.yarn_beta_fast") or 32),
                       "beta_slow": float(g("rope.scaling.yarn_beta_slow") or 1), "mscale": m, "mscale_all_dim": m}
        elif g("rope.scaling.type") not in (None, "none"):
            raise UnsupportedModelError(f"unsupported GGUF RoPE scaling {g('rope.scaling.type')!r} for deepseek2",
                                        "tiered reads YaRN deepseek2 files")
        shared = int(g("expert_shared_count") or 0)
        Ie = int(g("expert_feed_forward_length"))
        return ModelConfig(
            **common, model_type="deepseek_v3" if sigmoid else "deepseek_v2", num_key_value_heads=1, head_dim=r,
            rope_scaling=scaling, q_lora_rank=int(g("attention.q_lora_rank") or 0) if "blk.0.attn_q_a.weight" in names else 0,
            kv_lora_rank=kr, qk_nope_head_dim=int(k_len) - r, v_head_dim=int(v_len), rope_interleave=True,
            num_experts=int(g("expert_count")), num_experts_per_tok=int(g("expert_used_count")),
            moe_intermediate_size=Ie, shared_expert_intermediate_size=shared * Ie, shared_expert_gated=False,
            norm_topk_prob=bool(g("expert_weights_norm") or False), topk_method="noaux_tc" if sigmoid else "greedy",
            n_group=groups if sigmoid else 1, topk_group=used if sigmoid and groups > 1 else 1,
            routed_scaling_factor=float(g("expert_weights_scale") or 1.0),
            first_k_dense_replace=int(g("leading_dense_block_count") or 0))

    def _glm4_moe_config(self, g, names: set[str], common: dict) -> ModelConfig:
        """The ModelConfig of a "glm4moe" file (GLM-4.5 / 4.5-Air / 4.6; see the module docstring).

        `common`: the fields every architecture reads (vocabulary, RoPE base and scaling, tokens).
        Raises:
            CheckpointError: a key llama.cpp requires of glm4moe files is missing (block_count,
                embedding_length, attention.head_count, attention.layer_norm_rms_epsilon,
                expert_count, expert_used_count, expert_shared_count, expert_feed_forward_length;
                feed_forward_length when leading_dense_block_count > 0), expert groups without
                expert_group_used_count, nextn_predict_layers leaving no layer, nextn tensors in a
                main layer, or a rope.dimension_count the head does not hold.
            UnsupportedModelError: a router other than sigmoid (expert_gating_func 2, or absent:
                llama.cpp's default for glm4moe), or M-RoPE sections (GLM-4.5V's vision files).
        """
        arch = self.arch

        def need(key: str):
            value = g(key)
            if value is None:
                raise CheckpointError(f"{self.path}: the {arch} GGUF metadata lacks {arch}.{key}",
                                      "re-convert the file with a current llama.cpp")
            return value

        if g("expert_gating_func") not in (None, 0, 2):
            raise UnsupportedModelError(f"{arch} GGUF with expert_gating_func {g('expert_gating_func')} "
                                        "(GLM-4.5 routes by sigmoid, 2)",
                                        "re-convert the file with a current llama.cpp")
        if any(g("rope.dimension_sections") or ()):
            raise UnsupportedModelError(f"{arch} GGUF with M-RoPE sections (a vision-language model) is not read",
                                        "tiered runs GLM-4.5 / 4.5-Air / 4.6 text models")
        heads, hidden = int(need("attention.head_count")), int(need("embedding_length"))
        head_dim = int(g("attention.key_length") or hidden // heads)
        rot = int(g("rope.dimension_count") or head_dim)  # llama.cpp's n_rot: the rotated features per head
        factor = rot / head_dim
        if not 0 < rot <= head_dim or int(head_dim * factor) != rot:
            raise CheckpointError(f"{self.path}: {arch}.rope.dimension_count {rot} does not fit head_dim {head_dim}",
                                  "re-convert the file with a current llama.cpp")
        nextn = int(g("nextn_predict_layers") or 0)  # MTP layers, stored after the model's
        layers = int(need("block_count")) - nextn
        if layers < 1:
            raise CheckpointError(f"{self.path}: {arch}.nextn_predict_layers {nextn} leaves no layer",
                                  "re-convert the file with a current llama.cpp")
        if any(n.startswith("blk.") and ".nextn." in n and int(n.split(".")[1]) < layers for n in names):
            raise CheckpointError(f"{self.path}: nextn (multi-token-prediction) tensors in one of the {layers} "
                                  f"main layers: {arch}.nextn_predict_layers is {nextn}", "re-convert the file")
        groups = int(g("expert_group_count") or 1)
        used = int(g("expert_group_used_count") or 0) if groups > 1 else 1
        if not used:
            raise CheckpointError(f"{self.path}: the {arch} GGUF metadata has {groups} expert groups but lacks "
                                  f"{arch}.expert_group_used_count", "re-convert the file with a current llama.cpp")
        dense = int(g("leading_dense_block_count") or 0)
        moe_ff = int(need("expert_feed_forward_length"))
        return ModelConfig(
            **common, model_type="glm4_moe", hidden_size=hidden, num_hidden_layers=layers,
            intermediate_size=int(need("feed_forward_length") if dense else g("feed_forward_length") or 0),
            num_attention_heads=heads, num_key_value_heads=int(g("attention.head_count_kv") or heads),
            head_dim=head_dim, partial_rotary_factor=factor,
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            attention_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
            qk_norm_scope="head", num_experts=int(need("expert_count")),
            num_experts_per_tok=int(need("expert_used_count")), moe_intermediate_size=moe_ff,
            shared_expert_intermediate_size=int(need("expert_shared_count")) * moe_ff, shared_expert_gated=False,
            norm_topk_prob=bool(g("expert_weights_norm") or False), topk_method="noaux_tc", n_group=groups,
            topk_group=used, routed_scaling_factor=float(g("expert_weights_scale") or 1.0),
            first_k_dense_replace=dense)

    def _model_config(self) -> ModelConfig:
        md = self.metadata
        arch = md.get("general.architecture")
        if arch not in ARCH_TO_MODEL_TYPE:
            raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r}",
                                        "tiered reads GGUF files of " + ", ".join(ARCH_TO_MODEL_TYPE))
        self.arch = arch

        def g(key, default=None):
            return md.get(f"{arch}.{key}", default)

        heads = g("attention.head_count")
        hidden = g("embedding_length")
        names = {t.name for t in self.reader.tensors}
        vocab = g("vocab_size") or md.get("tokenizer.ggml.tokens")
        if not vocab:
            emb = next(t for t in self.reader.tensors if t.name == "token_embd.weight")
            vocab = int(emb.shape[1])
        eos = md.get("tokenizer.ggml.eos_token_id")
        eot = md.get("tokenizer.ggml.eot_token_id")
        eos_ids = tuple(dict.fromkeys(i for i in (eos, eot) if i is not None))
        if arch == "deepseek2":
            return self._deepseek_config(g, names, dict(
                vocab_size=int(vocab), hidden_size=hidden, intermediate_size=g("feed_forward_length") or 0,
                num_hidden_layers=g("block_count"), num_attention_heads=heads,
                rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
                rope_theta=float(g("rope.freq_base", 10000.0)), max_position_embeddings=g("context_length", 2048),
                tie_word_embeddings="output.weight" not in names, bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
                eos_token_ids=eos_ids))
        scaling = None
        if g("rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": g("rope.scaling.factor")}
        elif g("rope.scaling.type") not in (None, "none"):
            raise UnsupportedModelError(f"unsupported GGUF RoPE scaling {g('rope.scaling.type')!r}",
                                        "tiered supports linear scaling in GGUF files")
        if "rope_freqs.weight" in names:
            raise UnsupportedModelError("GGUF files with rope_freqs (Llama 3.1 scaling) are not read yet",
                                        "load the Hugging Face safetensors directory instead")
        if arch == "glm4moe":
            return self._glm4_moe_config(g, names, dict(
                vocab_size=int(vocab), rope_theta=float(g("rope.freq_base", 10000.0)), rope_scaling=scaling,
                max_position_embeddings=g("context_length", 2048), tie_word_embeddings="output.weight" not in names,
                bos_token_id=md.get("tokenizer.ggml.bos_token_id"), eos_token_ids=eos_ids))
        moe = {}
        n_exp = g("expert_count") or 0
        if n_exp:
            model_type = "mixtral" if arch == "llama" else ARCH_TO_MODEL_TYPE[arch]
            if model_type not in NORM_TOPK:
                raise UnsupportedModelError(f"GGUF architecture {arch!r} with experts is not read",
                                            "tiered reads Mixtral (llama), qwen2moe and qwen3moe GGUF files")
            dense = tuple(i for i in range(g("block_count")) if f"blk.{i}.ffn_gate_inp.weight" not in names)
            norm = g("expert_weights_norm")
            moe = dict(num_experts=int(n_exp), num_experts_per_tok=int(g("expert_used_count")),
                       moe_intermediate_size=int(g("expert_feed_forward_length") or g("feed_forward_length")),
                       shared_expert_intermediate_size=int(g("expert_shared_feed_forward_length") or 0),
                       norm_topk_prob=NORM_TOPK[model_type] if norm is None else bool(norm), mlp_only_layers=dense)
        else:
            model_type = ARCH_TO_MODEL_TYPE[arch]
            if model_type.endswith("_moe"):
                raise CheckpointError(f"{self.path}: {arch} file without {arch}.expert_count", "re-convert the file")
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=g("feed_forward_length"),
            num_hidden_layers=g("block_count"),
            num_attention_heads=heads,
            num_key_value_heads=g("attention.head_count_kv") or heads,
            head_dim=g("attention.key_length") or hidden // heads,
            rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(g("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=g("context_length", 2048),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            sliding_window=g("attention.sliding_window"),
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids,
            **moe,
        )

    def _make_handle(self, hf: str, t, expert: int | None = None) -> TensorHandle:
        """The handle of tensor `t` (of expert `expert`'s rows when `t` is a stacked expert tensor)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        from tiered.quant.gguf_dequant import dequantize_blocks

        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists ne0 first
        data, offset, nbytes = t.data, int(t.data_offset), int(t.n_bytes)  # numpy memmap
        if expert is not None:  # [E, rows, cols] -> this expert's [rows, cols]
            shape = shape[1:]
            nbytes //= int(t.shape[-1])
            data, offset = data[expert], offset + expert * nbytes
        elif hf.endswith("shared_expert_gate.weight") and len(shape) == 1:
            shape = (1, shape[0])  # GGUF stores the D -> 1 gate as a vector
        fmt = t.tensor_type.name
        perm = None
        if self.arch in PERMUTED_QK and (".q_proj." in hf or ".k_proj." in hf):
            n_head = self.config.num_attention_heads if ".q_proj." in hf else self.config.num_key_value_heads
            perm = qk_row_permutation(shape[0], n_head)
        qtype = GGMLQuantizationType[fmt]
        if fmt not in BLOCK_FORMATS and fmt not in ("F32", "F16", "BF16"):
            raise UnsupportedModelError(f"GGUF tensor {t.name} has unsupported type {fmt}",
                                        "re-quantize with F32/F16/BF16/Q4_0/Q4_1/Q5_x/Q8_0/Qk_K types")

        def load() -> torch.Tensor:
            t = dequantize_blocks(np.asarray(data), fmt)  # torch, threaded (None: a format it leaves to gguf)
            if t is not None:
                t = t.reshape(shape)
                return (t[torch.from_numpy(perm)] if perm is not None else t).contiguous()
            arr = dequantize(np.asarray(data), qtype).reshape(shape)
            if perm is not None:
                arr = arr[perm]
            return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))

        def blocks() -> np.ndarray:
            raw = np.asarray(data).reshape(shape[0] if len(shape) > 1 else 1, -1)
            return raw[perm] if perm is not None else raw

        return TensorHandle(name=hf, shape=shape, format=fmt, nbytes=nbytes, path=str(self.path),
                            _load=load, _blocks=blocks if fmt in BLOCK_FORMATS else None,
                            offset=offset if fmt in ("F32", "F16", "BF16") and perm is None else None)

    def _load_tokenizer(self):
        """The tokenizer embedded in the GGUF (converted by transformers, cached), or None."""
        if self.metadata.get("tokenizer.ggml.model") in (None, "none"):  # "none": llama.cpp's vocabulary-only files
            return None
        from tiered.checkpoint.tokenizer import load_gguf_tokenizer
        return load_gguf_tokenizer(self.path)
