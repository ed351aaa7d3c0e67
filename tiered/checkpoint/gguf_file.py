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

"gpt-oss" files (llama.cpp's GptOssModel converter: OpenAI's gpt-oss-20b / -120b, e.g.
ggml-org/gpt-oss-20b-GGUF) are read as transformers' gpt_oss (`_gpt_oss_config`): q/k rows as they are
(NEOX RoPE), `post_attention_norm` the pre-MLP norm, `attn_sinks.weight` the sinks, `ffn_gate_inp`
the router (weight and bias), the even layers sliding (`attention.sliding_window_pattern`, default
2). The experts' stacked weights and biases (`ffn_{gate,up,down}_exps.{weight,bias}`, gate and up
apart) become per-expert handles of gpt-oss's biased layout (checkpoint/gpt_oss.py), MXFP4 blocks
read in ggml's layout and offered as int8-g32 and as the mxfp4 kind exactly (`_biased_experts`).

"phi3" files (Phi-3 / Phi-4) hold q/k/v fused (`attn_qkv`) and gate/up fused (`ffn_up`, the gate first): each
becomes Llama's projections, handles of its rows (`_fused_rows`); `rope.dimension_count` the partial RoPE's width;
LongRoPE files (Phi-3.5 / Phi-4-mini) hold their factors as `rope_factors_long` / `_short` (`_longrope`).

"gemma3" files (llama.cpp's Gemma3Model converter: Google's Gemma 3 1B-27B, their QAT Q4_0 files too) are
read as transformers' gemma3_text (`_gemma_config`, models/gemma.py): the norms as stored (the converter
wrote Gemma's 1 + weight), `post_attention_norm` / `ffn_norm` / `post_ffw_norm` the sandwich norms, q/k
rows as they are, the lm_head the embedding; as llama.cpp's loader reads them, 5 of every 6 layers slide
(`attention.sliding_window_pattern` where given) with a RoPE of base 10000 (`rope.freq_base_swa` where
given), and logits scale by 1 / sqrt(head_dim), or by 1 / sqrt(hidden / heads) for the 62-layer 27B. "gemma2"
files (Gemma 2) the same way, with their soft caps (`attn_logit_softcapping`, `final_logit_softcapping`), every other
layer sliding, one RoPE, no q/k norms, the 46-layer 27B's scale by hidden / heads.
"""

from __future__ import annotations

import os
import re
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch

from tiered.checkpoint.handle import BLOCK_FORMATS, HandleTable, TensorHandle
from tiered.checkpoint.model_config import ModelConfig, fused_projections, longrope_scaling
from tiered.errors import CheckpointError, UnsupportedModelError

# GGUF architecture -> HF model_type ("deepseek2": deepseek_v3 when its router is sigmoid, else v2).
ARCH_TO_MODEL_TYPE = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                      "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "deepseek2": "deepseek_v2",
                      "glm4moe": "glm4_moe", "gpt-oss": "gpt_oss",
                      "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3"}
# top-k weights renormalized to sum 1 (llama.cpp's expert_weights_norm default per architecture)
NORM_TOPK = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True}
# The sampling a file's authors recommend (llama.cpp's general.sampling.* keys, which its converter fills from
# generation_config.json since ggml-org/llama.cpp#17120) -> SamplingParams' names (hf_dir.SAMPLING_DEFAULTS)
GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                 "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                 "general.sampling.penalty_repeat": "repetition_penalty"}
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
# gpt-oss's names: the pre-MLP norm is ATTN_POST_NORM, the router's weight and bias FFN_GATE_INP
_GPT_OSS_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router"}
# Gemma 3's sandwich norms: ffn_norm is the FFN's own pre-norm, post_attention_norm / post_ffw_norm the blocks'
# output norms
_GEMMA3_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3 / Phi-4's fused projections -> their HF modules (model_config.fused_projections; GGUFCheckpoint._fused_rows)
_PHI3_FUSED = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# stacked expert tensors -> the per-expert projection name (Qwen / OLMoE style, Mixtral style)
_EXPERT_NAMES = {"ffn_gate_exps": ("gate_proj", "w1"), "ffn_up_exps": ("up_proj", "w3"),
                 "ffn_down_exps": ("down_proj", "w2")}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


_READER = None
LEAN_ITEMS = 4096  # fast_reader(lean=True) skips arrays this long


def fast_reader(path: str | os.PathLike, lean: bool = False):
    """The `gguf` package's GGUFReader over `path` (read-only), parsing 5-10x faster: the same fields
    and tensors (same values; arrays are plain ndarray views of the file's numpy memmap instead of
    memmap objects). GGUFReader reads every metadata element through `_get`, which for a native
    byte order builds a memmap slice and a byte-order view per call: ~98k calls for SmolLM2's
    tokenizer arrays, 6 s of the default model's start. The subclass's `_get` slices a plain
    ndarray view of the map in that case and defers to GGUFReader's otherwise.

    lean=True: arrays of LEAN_ITEMS or more items (a tokenizer's tokens, merges, types and scores;
    nothing else in a GGUF file is that long) are skipped over, not parsed: their field keeps only
    the element type and length parts (`parts[-1][0]` is the item count; `data` is empty). Parsing
    a 151k-token vocabulary's item views cost ~1 s of each start; GGUFCheckpoint keeps only the
    counts (the tokenizer is converted, once, by transformers from the file itself)."""
    global _READER
    if _READER is None:
        from gguf import GGUFReader

        class FastGGUFReader(GGUFReader):
            def __init__(self, path, lean: bool):
                self.lean = lean
                super().__init__(path, "r")

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
                if self.lean and count >= LEAN_ITEMS and (scalar is not None or itype[0] == GGUFValueType.STRING):
                    if scalar is not None:
                        n = np.dtype(scalar).itemsize * count
                    else:  # each string's length, read from its 8 bytes, to step over it
                        mv, n = memoryview(raw), 0
                        for _ in range(count):
                            n += 8 + int.from_bytes(mv[offs + n:offs + n + 8], "little")
                    return 12 + n, [itype, alen], [], [GGUFValueType.ARRAY, GGUFValueType(int(itype[0]))]
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
    return _READER(path, lean)


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
    if model_type == "gpt_oss":
        if part == "attn_sinks":  # llama.cpp's `attn_sinks.weight` is HF's bare `self_attn.sinks`
            return f"model.layers.{layer}.self_attn.sinks"
        if part in _GPT_OSS_NAMES:
            return f"model.layers.{layer}.{_GPT_OSS_NAMES[part]}.{kind}"
    if model_type in ("gemma2", "gemma3_text") and part in _GEMMA3_NAMES:
        return f"model.layers.{layer}.{_GEMMA3_NAMES[part]}.{kind}"
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


# MADV_POPULATE_READ (Linux >= 5.14; Python 3.11's mmap module lacks the name): GGUFCheckpoint.prefault
_POPULATE = {"ok": sys.platform == "linux", "advice": 22}

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

    def generation_defaults(self) -> dict:
        """The sampling the file recommends (its general.sampling.* keys: GGUF_SAMPLING), as a model directory's
        generation_config.json gives it (hf_dir.generation_defaults); float32 values read back at 7 significant
        digits (0.95, not 0.949999988). {} where it names none."""
        out = {}
        for key, name in GGUF_SAMPLING.items():
            v = self.metadata.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[name] = int(v) if name == "top_k" else float(f"{float(v):.7g}")
        return out

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        try:
            self.reader = fast_reader(self.path, lean=True)
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
        biased: dict[int, dict[tuple[str, str], object]] = {}  # gpt-oss: layer -> {(part, kind): stacked tensor}
        for t in self.reader.tensors:
            m = _BLOCK_RE.match(t.name)
            if m and m.group(2) == "ffn_gate_up_exps":
                raise UnsupportedModelError(f"{self.path}: fused gate/up experts ({t.name}) are not read",
                                            "re-convert the file without --fuse-gate-up-exps")
            if self.arch == "deepseek2" and m and m.group(2) in ("attn_k_b", "attn_v_b"):
                split.setdefault(int(m.group(1)), {})[m.group(2)[5]] = t
                continue
            if self.arch == "gpt-oss" and m and m.group(2) in _EXPERT_NAMES:
                biased.setdefault(int(m.group(1)), {})[m.group(2), m.group(3)] = t
                continue
            if self.arch == "phi3" and m and m.group(2) in _PHI3_FUSED:  # q/k/v, gate/up: Llama's projections
                if int(m.group(1)) < self.config.num_hidden_layers:
                    self._handles.update(self._fused_rows(int(m.group(1)), m.group(2), t))
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
        for layer, parts in biased.items():
            if layer < self.config.num_hidden_layers:
                self._handles.update(self._biased_experts(layer, parts))

    def prefault(self, offset: int, nbytes: int) -> bool:
        """Map the file's pages of bytes [offset, offset + nbytes) into this process at once (Linux >= 5.14's
        MADV_POPULATE_READ), before a native pass reads them: faulted in one by one, the pages of a Qwen3-30B-A3B
        expert's Q4_0 projection (0.9 MB, in the page cache) cost its repacking ~2x its time. Returns False
        where the kernel does not offer it (then the pass faults them in as it reads)."""
        if not _POPULATE["ok"]:
            return False
        mm = getattr(self.reader.data, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise"):
            return False
        import mmap

        start = offset - offset % mmap.PAGESIZE
        try:
            mm.madvise(_POPULATE["advice"], start, offset + nbytes - start)
        except (OSError, ValueError):  # EINVAL before Linux 5.14: not asked again
            _POPULATE["ok"] = False
            return False
        return True

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
        if key in _TOKENIZER_ARRAYS:  # big arrays: only their length is kept here (a lean reader skipped them)
            return int(f.parts[-1][0]) if not f.data else len(f.data)
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

    def _need(self, g, key: str):
        """The value of metadata key `{arch}.key` (`g`: key -> value or None), which the architecture's
        llama.cpp loader requires.

        Raises:
            CheckpointError: the file lacks the key.
        """
        value = g(key)
        if value is None:
            raise CheckpointError(f"{self.path}: the {self.arch} GGUF metadata lacks {self.arch}.{key}",
                                  "re-convert the file with a current llama.cpp")
        return value

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
        need = partial(self._need, g)
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

    def _gpt_oss_config(self, g, names: set[str], common: dict) -> ModelConfig:
        """The ModelConfig of a "gpt-oss" file (gpt-oss-20b / -120b): what transformers' GptOssConfig
        gives for the config.json llama.cpp converted (convert_hf_to_gguf.py GptOssModel), read as
        llama.cpp loads it (src/models/openai-moe.cpp, llama-model.cpp's common keys):
        - sizes: block_count, embedding_length, attention.head_count(_kv), attention.key_length (else
          embedding_length / head_count; value_length and rope.dimension_count, where given, must
          equal it: llama.cpp's graph rotates and attends over whole heads), expert_count,
          expert_used_count, expert_feed_forward_length (GptOssConfig's intermediate_size: every
          expert's F), context_length, attention.layer_norm_rms_epsilon;
        - the sliding layers: attention.sliding_window_pattern, a period n (default 2) sliding layer i
          when n == 0 or i % n < n - 1 (llama_hparams::set_swa_pattern: the even layers, transformers'
          default layer_types) or one flag per layer; their window attention.sliding_window;
        - RoPE: rope.freq_base (llama.cpp's default 10000); YaRN from rope.scaling.type "yarn" with
          factor, original_context_length (default context_length), yarn_beta_fast / _slow (default
          32 / 1) and OpenAI's truncate false (ggml_rope_yarn_corr_dims rounds YaRN's correction range
          outwards; transformers, and so tiered, keep it unrounded);
        - fixed in llama.cpp's graph as in transformers: a sink logit per head, o_proj, router and
          expert biases (q/k/v biases where the file has them), the softmax over the router's top-k
          logits (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT), the clamped GLU of alpha 1.702 and
          limit 7.0 (llama-graph.cpp LLM_FFN_SWIGLU_OAI_MOE); no tied output.

        `common`: vocab_size, bos_token_id, eos_token_ids.
        Raises:
            CheckpointError: a key llama.cpp requires is missing (block_count, context_length,
                embedding_length, attention.head_count, attention.layer_norm_rms_epsilon,
                attention.sliding_window, expert_count, expert_used_count, expert_feed_forward_length),
                or a sliding-window pattern of another length than block_count.
            UnsupportedModelError: what tiered's gpt_oss model does not compute: sizes that differ per
                layer, a value_length or rope.dimension_count other than the head size, fused q/k/v
                (attn_qkv), a RoPE base of the sliding layers' own (rope.freq_base_swa), RoPE scaling
                other than YaRN or none, YaRN attention / extrapolation factors other than llama.cpp's
                defaults.
        """
        arch = self.arch
        need = partial(self._need, g)

        def size(key: str, value) -> int:  # llama.cpp reads these as a value or one per layer
            if isinstance(value, list):
                if len(set(value)) != 1:
                    raise UnsupportedModelError(f"{arch} GGUF with {arch}.{key} per layer ({value}) is not read",
                                                "tiered's gpt_oss layers share one size")
                value = value[0]
            return int(value)

        L = int(need("block_count"))
        heads, hidden = size("attention.head_count", need("attention.head_count")), int(need("embedding_length"))
        kv = size("attention.head_count_kv", g("attention.head_count_kv") or heads)
        head_dim = int(g("attention.key_length") or hidden // heads)
        for key in ("attention.value_length", "rope.dimension_count"):
            if g(key) not in (None, head_dim):
                raise UnsupportedModelError(f"{arch} GGUF with {arch}.{key} {g(key)} other than the head size "
                                            f"{head_dim}", "llama.cpp's gpt-oss graph rotates and attends whole heads")
        if "blk.0.attn_qkv.weight" in names:
            raise UnsupportedModelError(f"{arch} GGUF with fused q/k/v projections (attn_qkv) is not read",
                                        "re-convert the file with llama.cpp's convert_hf_to_gguf.py")
        if g("rope.freq_base_swa") not in (None, g("rope.freq_base")):
            raise UnsupportedModelError(f"{arch} GGUF with a RoPE base of the sliding layers' own "
                                        f"(rope.freq_base_swa {g('rope.freq_base_swa')}) is not read",
                                        "tiered's gpt_oss layers share one RoPE base")
        window = int(need("attention.sliding_window"))
        local = self._sliding_layers(g, L, 2) if window else ()
        context = int(need("context_length"))
        stype = g("rope.scaling.type")
        scaling = None
        if stype == "yarn":
            for key, neutral in (("attn_factor", 1.0), ("yarn_attn_factor", 1.0), ("yarn_ext_factor", 1.0),
                                 ("yarn_log_multiplier", 0.0)):
                if g(f"rope.scaling.{key}") not in (None, neutral):
                    raise UnsupportedModelError(f"{arch} GGUF with {arch}.rope.scaling.{key} "
                                                f"{g(f'rope.scaling.{key}')} is not read",
                                                "gpt-oss's YaRN takes llama.cpp's default factors")
            scaling = {"rope_type": "yarn", "factor": float(g("rope.scaling.factor") or 1.0),
                       "beta_fast": float(g("rope.scaling.yarn_beta_fast") or 32.0),
                       "beta_slow": float(g("rope.scaling.yarn_beta_slow") or 1.0), "truncate": False,
                       "original_max_position_embeddings": int(g("rope.scaling.original_context_length") or context)}
        elif stype not in (None, "none"):
            raise UnsupportedModelError(f"unsupported GGUF RoPE scaling {stype!r} for {arch}",
                                        "tiered reads gpt-oss files with YaRN or no RoPE scaling")
        ff = size("expert_feed_forward_length", need("expert_feed_forward_length"))
        return ModelConfig(
            **common, model_type="gpt_oss", hidden_size=hidden, intermediate_size=ff, num_hidden_layers=L,
            num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=float(g("rope.freq_base") or 10000.0), rope_scaling=scaling, max_position_embeddings=context,
            tie_word_embeddings=False, attention_bias="blk.0.attn_q.bias" in names, o_proj_bias=True,
            local_window=window if local else None, local_layers=local, attention_sinks=True,
            num_experts=int(need("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
            moe_intermediate_size=ff, norm_topk_prob=True, expert_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702)

    def _longrope(self, g, names: set[str], pairs: int) -> dict:
        """{"rope_scaling": LongRoPE's} of a "phi3" file holding `rope_factors_long` / `rope_factors_short` (F32
        [pairs], Phi-3.5 / Phi-4-mini), with `rope.scaling.original_context_length` and the attention factor
        llama.cpp's converter wrote (`rope.scaling.attn_factor`); {} for a file without them.

        Raises:
            CheckpointError: one of the two factor tensors, one of another length than the rotated pairs, or no
                original context length.
        """
        have = [n in names for n in ("rope_factors_short.weight", "rope_factors_long.weight")]
        if not any(have):
            return {}
        tensors = {t.name: t for t in self.reader.tensors if t.name.startswith("rope_factors_")}
        factors = [np.asarray(tensors[n].data, dtype=np.float32).reshape(-1).tolist() if ok else []
                   for n, ok in zip(("rope_factors_short.weight", "rope_factors_long.weight"), have)]
        if any(len(f) != pairs for f in factors):
            raise CheckpointError(f"{self.path}: rope_factors_short / _long must hold {pairs} values each, got "
                                  f"{[len(f) for f in factors]}", "re-convert the file with llama.cpp")
        orig = g("rope.scaling.original_context_length")
        if not orig:
            raise CheckpointError(f"{self.path}: LongRoPE factors without {self.arch}.rope.scaling.original_context_"
                                  "length", "re-convert the file with llama.cpp")
        return {"rope_scaling": longrope_scaling(factors[0], factors[1], int(orig), int(g("context_length") or orig),
                                                 None, g("rope.scaling.attn_factor"))}

    def _sliding_layers(self, g, L: int, period: int) -> tuple[int, ...]:
        """The layers that slide, by `attention.sliding_window_pattern` as llama.cpp reads it: one flag per layer,
        or a period n (all but every n-th layer slide; 0: every layer), `period` where the file gives none (the
        architecture's rule: gpt-oss 2, Gemma 3 6).

        Raises:
            CheckpointError: a list of flags of another length than `L` layers.
        """
        pattern = g("attention.sliding_window_pattern", period)
        if isinstance(pattern, list):
            if len(pattern) != L:
                raise CheckpointError(f"{self.path}: {self.arch}.attention.sliding_window_pattern has {len(pattern)} "
                                      f"flags for {L} layers", "re-convert the file with a current llama.cpp")
            return tuple(i for i in range(L) if pattern[i])
        return tuple(i for i in range(L) if pattern == 0 or i % pattern < pattern - 1)

    def _gemma_config(self, g, names: set[str], common: dict) -> ModelConfig:
        """The ModelConfig of a "gemma3" or "gemma2" file (Gemma 3 / Gemma 2; see the module docstring), as llama.cpp's
        loader reads it: Gemma 2 with its soft caps (`attn_logit_softcapping`, `final_logit_softcapping`), every
        other layer sliding, one RoPE, no q/k norms, the 46-layer 27B's scale 1 / sqrt(hidden / heads); Gemma 3's
        final cap where a file gives one.

        `common`: the vocabulary, the (global layers') RoPE scaling and the tokens.
        Raises:
            CheckpointError: a key llama.cpp requires of these files is missing (block_count,
                embedding_length, feed_forward_length, attention.head_count,
                attention.layer_norm_rms_epsilon), or a sliding-window pattern of another length than
                block_count.
            UnsupportedModelError: fused q/k/v (attn_qkv), sizes per layer.
        """
        arch = self.arch
        need = partial(self._need, g)
        two = arch == "gemma2"
        caps = [float(g(k)) if g(k) else None for k in ("attn_logit_softcapping", "final_logit_softcapping")]
        if "blk.0.attn_qkv.weight" in names:
            raise UnsupportedModelError(f"{arch} GGUF with fused q/k/v projections (attn_qkv) is not read",
                                        "re-convert the file with llama.cpp's convert_hf_to_gguf.py")
        L, hidden = int(need("block_count")), int(need("embedding_length"))
        sizes = {k: g(k) for k in ("attention.head_count", "attention.head_count_kv", "feed_forward_length")}
        for key, value in sizes.items():
            if isinstance(value, list):
                raise UnsupportedModelError(f"{arch} GGUF with {arch}.{key} per layer is not read",
                                            "tiered's Gemma layers share one size")
        heads = int(need("attention.head_count"))
        head_dim = int(g("attention.key_length") or hidden // heads)
        window = int(g("attention.sliding_window") or 0)
        local = self._sliding_layers(g, L, 2 if two else 6) if window else ()
        # llama.cpp's f_attention_scale: 1 / sqrt(hidden / heads) for the 27Bs (Gemma 2's 46 layers, Gemma 3's 62),
        # else 1 / sqrt(head_dim)
        scalar = hidden // heads if L == (46 if two else 62) else head_dim
        return ModelConfig(
            **common, model_type="gemma2" if two else "gemma3_text", hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")), num_hidden_layers=L, num_attention_heads=heads,
            num_key_value_heads=int(g("attention.head_count_kv") or heads), head_dim=head_dim,
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=float(g("rope.freq_base") or (1e4 if two else 1e6)),
            max_position_embeddings=int(g("context_length") or (8192 if two else 131072)),
            tie_word_embeddings="output.weight" not in names, qk_norm=not two, qk_norm_scope="head",
            hidden_act="gelu_tanh", embed_scale=float(hidden) ** 0.5, sandwich_norms=True,
            query_pre_attn_scalar=float(scalar), local_window=window if local else None, local_layers=local,
            local_rope_theta=float(g("rope.freq_base_swa") or 10000.0) if local and not two else None,
            attn_softcap=caps[0], final_softcap=caps[1])

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
        if arch == "gpt-oss":
            return self._gpt_oss_config(g, names, dict(vocab_size=int(vocab), eos_token_ids=eos_ids,
                                                       bos_token_id=md.get("tokenizer.ggml.bos_token_id")))
        scaling = None
        if g("rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": g("rope.scaling.factor")}
        elif g("rope.scaling.type") not in (None, "none"):
            raise UnsupportedModelError(f"unsupported GGUF RoPE scaling {g('rope.scaling.type')!r}",
                                        "tiered supports linear scaling in GGUF files")
        if "rope_freqs.weight" in names:
            raise UnsupportedModelError("GGUF files with rope_freqs (Llama 3.1 scaling) are not read yet",
                                        "load the Hugging Face safetensors directory instead")
        family = {}
        if arch == "phi3":  # Phi-3 / Phi-4: a partial RoPE of rope.dimension_count features, LongRoPE's factors
            head_dim = g("attention.key_length") or hidden // heads
            rotated = g("rope.dimension_count") or head_dim
            family["partial_rotary_factor"] = rotated / head_dim
            family.update(self._longrope(g, names, rotated // 2))
        if arch in ("gemma3", "gemma2"):
            return self._gemma_config(g, names, dict(
                vocab_size=int(vocab), rope_scaling=scaling, bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
                eos_token_ids=eos_ids))
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
        fields = dict(
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
            sliding_window=g("attention.sliding_window") or None,
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids,
            **moe,
        )
        return ModelConfig(**{**fields, **family})

    def _make_handle(self, hf: str, t, expert: int | None = None, rows: tuple[int, int] | None = None) -> TensorHandle:
        """The handle of tensor `t` (of expert `expert`'s rows when `t` is a stacked expert tensor; of rows
        rows[0]..rows[1]-1 of a 2-D tensor: a fused projection's part)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        from tiered.quant.gguf_dequant import dequantize_blocks, dequantize_rows_threaded

        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists ne0 first
        data, offset, nbytes = t.data, int(t.data_offset), int(t.n_bytes)  # numpy memmap
        if expert is not None:  # [E, rows, cols] -> this expert's [rows, cols]
            shape = shape[1:]
            nbytes //= int(t.shape[-1])
            data, offset = data[expert], offset + expert * nbytes
        elif rows is not None:  # [R, cols] -> rows a..b-1 (whole rows of blocks: contiguous bytes)
            a, b = rows
            per_row = nbytes // shape[0]
            shape, nbytes = (b - a,) + shape[1:], (b - a) * per_row
            data, offset = data[a:b], offset + a * per_row
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
                                        "re-quantize with F32/F16/BF16/Q4_0/Q4_1/Q5_x/Q8_0/Qk_K/IQ types")

        def load() -> torch.Tensor:
            t = dequantize_blocks(np.asarray(data), fmt)  # torch, threaded (None: a format it leaves to gguf)
            if t is not None:
                t = t.reshape(shape)
                return (t[torch.from_numpy(perm)] if perm is not None else t).contiguous()
            if fmt in BLOCK_FORMATS and len(shape) > 1:  # rows on a thread pool (the package's numpy code: ~40-60 M
                # weights a second a thread for the i-quants); a new fp32 array of its own
                arr = dequantize_rows_threaded(np.asarray(data).reshape(int(np.prod(shape[:-1])), -1), qtype)
                arr = arr.reshape(shape)
                return torch.from_numpy(arr[perm] if perm is not None else arr)
            arr = dequantize(np.asarray(data), qtype).reshape(shape)
            if perm is not None:
                arr = arr[perm]
            return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))

        def blocks() -> np.ndarray:
            self.prefault(offset, nbytes)
            raw = np.asarray(data).reshape(shape[0] if len(shape) > 1 else 1, -1)
            return raw[perm] if perm is not None else raw

        return TensorHandle(name=hf, shape=shape, format=fmt, nbytes=nbytes, path=str(self.path),
                            _load=load, _blocks=blocks if fmt in BLOCK_FORMATS else None,
                            offset=offset if fmt in ("F32", "F16", "BF16") and perm is None else None)

    def _fused_rows(self, layer: int, part: str, t) -> dict[str, TensorHandle]:
        """A "phi3" file's fused projection of layer `layer` as Llama's (model_config._phi3_fields): `attn_qkv`
        [(H + 2 Hkv) hd, D] as q_proj / k_proj / v_proj, `ffn_up` [2F, D] as gate_proj (its first F rows) and
        up_proj, each a handle of its rows (their blocks as stored: whole rows of blocks).

        Raises:
            CheckpointError: the tensor's rows are not what the config's heads / sizes give.
        """
        parts = fused_projections(self.config)[_PHI3_FUSED[part]]
        rows = int(t.shape[-1]) if len(t.shape) == 2 else -1
        if rows != sum(n for _, n in parts):
            raise CheckpointError(f"{self.path}: tensor {t.name} has {rows} rows, the config implies "
                                  f"{sum(n for _, n in parts)}", "re-convert the file with llama.cpp")
        out, at = {}, 0
        for name, n in parts:
            hf = f"model.layers.{layer}.{name}.weight"
            out[hf] = self._make_handle(hf, t, rows=(at, at + n))
            at += n
        return out

    def _biased_experts(self, layer: int, parts: dict) -> dict[str, TensorHandle]:
        """Layer `layer`'s per-expert handles of a "gpt-oss" file from its stacked `ffn_{gate,up,down}_exps`
        weights [E, F, D] / [E, D, F] and biases [E, F] / [E, D] (`parts`: (part, "weight" | "bias") ->
        tensor): gate / up [F, Db] and down [D, Fb], each projection's bias as its input column D (F),
        zeros after it (checkpoint/gpt_oss.py, ModelConfig.expert_shapes), reading only expert e's rows.

        Weights stored as MXFP4 (ggml's block_mxfp4) or Q8_0 load dequantized (exact in fp32) and offer
        int8-g32 (`TensorHandle.int8_g32_parts`): MXFP4's codes and scales (checkpoint/gpt_oss.
        mxfp4_int8_g32, ggml's nibble order), Q8_0's int8 codes and fp16 scales as stored; the bias a group
        of its own (int8_g32_with_bias: refused on read where fp16 cannot hold it). MXFP4 with F32 / BF16
        biases also offers its raw parts (`TensorHandle.mxfp4_parts`, halves: ggml's nibble order) for the
        mxfp4 kind (gpt_oss.mxfp4_codes refuses on read a bias that is no bf16 number). F32 / F16 / BF16
        weights load as stored.

        Raises:
            CheckpointError: a stacked weight or bias missing, or of another shape than the config's.
            UnsupportedModelError: experts stored in another type (K-quants, Q4_x, ...: their blocks
                cannot carry the bias column), biases in a type other than F32 / F16 / BF16.
        """
        cfg = self.config
        E, D, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        out: dict[str, TensorHandle] = {}
        for part, (rows, cols) in (("ffn_gate_exps", (F, D)), ("ffn_up_exps", (F, D)), ("ffn_down_exps", (D, F))):
            w, b = parts.get((part, "weight")), parts.get((part, "bias"))
            for kind, t, shape in (("weight", w, (E, rows, cols)), ("bias", b, (E, rows))):
                name = f"blk.{layer}.{part}.{kind}"
                if t is None:
                    raise CheckpointError(f"{self.path} lacks tensor {name}", "re-convert the file with llama.cpp")
                if tuple(int(n) for n in reversed(t.shape.tolist())) != shape:
                    raise CheckpointError(f"{self.path}: tensor {name} has shape "
                                          f"{tuple(int(n) for n in reversed(t.shape.tolist()))}, the config implies "
                                          f"{shape}", "re-convert the file with llama.cpp")
            fmt = w.tensor_type.name
            if fmt not in ("MXFP4", "Q8_0", "F32", "F16", "BF16") or b.tensor_type.name not in ("F32", "F16", "BF16"):
                raise UnsupportedModelError(f"gpt-oss GGUF experts stored as {fmt} with {b.tensor_type.name} biases "
                                            f"(blk.{layer}.{part}) are not read",
                                            "use a file whose experts are MXFP4, Q8_0, F32, F16 or BF16")
            proj = _EXPERT_NAMES[part][0]
            for e in range(E):
                hf = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                out[hf] = self._biased_expert(hf, w, b, e)
        return out

    def _biased_expert(self, hf: str, w, b, e: int) -> TensorHandle:
        """Expert `e`'s handle `hf` [rows, biased_width(cols)] from the stacked weight `w` [E, rows, cols]
        and bias `b` [E, rows] of a "gpt-oss" file (`_biased_experts`)."""
        from tiered.checkpoint.gpt_oss import (MXFP4_GROUP, checked_form, dequantize_mxfp4, int8_g32_with_bias,
                                               mxfp4_int8_g32, with_bias)
        from tiered.checkpoint.model_config import biased_width
        from tiered.quant.gguf_dequant import blocks_tensor
        from tiered.quant.gguf_experts import unpack_q8_blocks

        E, rows, cols = (int(n) for n in reversed(w.shape.tolist()))
        width, fmt = biased_width(cols), w.tensor_type.name
        bias = self._make_handle(hf, b, expert=e)  # [rows]
        int8 = mxfp4 = None
        if fmt == "MXFP4":
            def raw() -> tuple[torch.Tensor, torch.Tensor]:  # (blocks uint8 [rows, G, 16], e8m0 uint8 [rows, G])
                r = blocks_tensor(w.data[e]).reshape(rows, cols // MXFP4_GROUP, 1 + MXFP4_GROUP // 2)  # e, then qs
                return r[..., 1:], r[..., 0]

            def load() -> torch.Tensor:
                return with_bias(dequantize_mxfp4(*raw(), halves=True), bias.load(), width)

            def int8() -> tuple[torch.Tensor, torch.Tensor]:
                return checked_form(hf, mxfp4_int8_g32, *raw(), bias.load(), width, True)

            if b.tensor_type.name in ("F32", "BF16"):  # F16 biases: int8-g32's fp16 scales hold them, bf16 may not
                def mxfp4() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                    return (*raw(), bias.load(None))
        else:
            weight = self._make_handle(hf, w, expert=e)  # [rows, cols]

            def load() -> torch.Tensor:
                return with_bias(weight.load(), bias.load(), width)

            if fmt == "Q8_0":
                def int8() -> tuple[torch.Tensor, torch.Tensor]:
                    return checked_form(hf, int8_g32_with_bias, *unpack_q8_blocks(weight.blocks()), bias.load(),
                                        width)
        return TensorHandle(name=hf, shape=(rows, width), format=fmt, nbytes=(int(w.n_bytes) + int(b.n_bytes)) // E,
                            path=str(self.path), _load=load, _int8_g32=int8, _mxfp4=mxfp4, mxfp4_halves=True)

    def _load_tokenizer(self):
        """The tokenizer embedded in the GGUF (converted by transformers, cached), or None."""
        if self.metadata.get("tokenizer.ggml.model") in (None, "none"):  # "none": llama.cpp's vocabulary-only files
            return None
        from tiered.checkpoint.tokenizer import load_gguf_tokenizer
        return load_gguf_tokenizer(self.path)
