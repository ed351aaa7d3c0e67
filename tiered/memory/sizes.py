"""Byte accounting: the one place that says how many bytes a weight, an expert, the KV cache or a
staging buffer takes. The planner and the engine both count with it, so a plan that fits is exactly
what the runtime can hold.

Formats are named as the planner names precisions: "fp32", "bf16", "fp16", "int8", "int8-g32",
"int4", "fp8", "mxfp4" (gpt-oss's experts as stored, quant/mxfp4.py), "q6k", "q5k" and "iq4xs" (GGUF Q6_K / Q5_K /
IQ4_XS as stored, quant/kquant.py).
Weight counts come from the model's own module tree built on the meta device (nothing allocated),
so they match `materialize` parameter for parameter.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from tiered.checkpoint.model_config import ModelConfig, expert_shapes
from tiered.errors import ConfigError

INT4_GROUP = 32  # tiered's int4 (quant/int4.py): one fp16 scale and zero per 32 weights

_DENSE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0}
_TORCH_FORMAT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "int8"}
_FORMAT_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DENSE_FORMATS = frozenset(_FORMAT_TORCH)  # the formats with a torch dtype (torch_dtype)


def bytes_per_element(fmt: str, group: int = INT4_GROUP) -> float:
    """Storage bytes per weight element in format `fmt`; int4 counts its per-group scale and zero
    (2 x 16 bit per `group` weights: 0.625 B at tiered's group 32, 0.5625 B at FlexGen's group 64).

    Raises:
        ConfigError: an unknown format.
    """
    if fmt == "int4":
        return 0.5 + 4.0 / group
    if fmt == "mxfp4":  # e2m1 codes and a (scale, zero) bf16 pair per 32, as int4 at group 32 (quant/mxfp4.py)
        return 0.5 + 4.0 / 32
    if fmt == "int8-g32":  # int8 and an fp16 scale per 32 (quant/int8.Int8G32Linear)
        return 1.0 + 2.0 / 32
    if fmt == "q6k":  # GGUF Q6_K as stored: 210 bytes per 256 weights (quant/kquant.Q6KLinear)
        return 210 / 256
    if fmt == "q5k":  # GGUF Q5_K as stored, its 6-bit scales a byte each: 180 bytes per 256 (quant/kquant.Q5KLinear)
        return 180 / 256
    if fmt == "iq4xs":  # GGUF IQ4_XS as stored, its 6-bit scales a byte each: 138 bytes per 256 (quant/kquant)
        return 138 / 256
    if fmt == "fp8":  # e4m3 and an fp32 scale per 128 x 128 block (quant/fp8.py)
        from tiered.quant.fp8 import BLOCK
        return 1.0 + 4.0 / (BLOCK * BLOCK)
    try:
        return _DENSE_BYTES[fmt]
    except KeyError:
        raise ConfigError(f"unknown weight format {fmt!r}",
                          "use fp32, bf16, fp16, int8, int8-g32, q6k, q5k, fp8, mxfp4 or int4") from None


def format_of(dtype: torch.dtype) -> str:
    """The format name of a torch dtype: torch.float32 -> "fp32", torch.bfloat16 -> "bf16"."""
    return _TORCH_FORMAT[dtype]


def torch_dtype(fmt: str) -> torch.dtype:
    """The torch dtype of a dense format: "fp32" -> torch.float32, "bf16" -> torch.bfloat16.

    Raises:
        ConfigError: `fmt` has no dense torch dtype (int8, int4).
    """
    try:
        return _FORMAT_TORCH[fmt]
    except KeyError:
        raise ConfigError(f"{fmt!r} is not a dense compute format", "use fp32 or bf16") from None


def is_expert_param(name: str) -> bool:
    """True for parameters of routed experts (served by the expert runtime, not the model)."""
    return ".experts." in name


def ffn_param(layer: int) -> Callable[[str], bool]:
    """Predicate: the parameter belongs to the MLP of decoder layer `layer`."""
    prefix = f"model.layers.{layer}.mlp."
    return lambda name: name.startswith(prefix)


_TREES: dict[str, tuple[tuple[tuple[str, int], ...], frozenset[str]]] = {}


def _tree(cfg: ModelConfig) -> tuple[tuple[tuple[str, int], ...], frozenset[str]]:
    """The meta-device module tree of `cfg`, read once: ((name, elements) of every parameter
    `materialize` fills, names of the weights that get a decode copy)."""
    key = repr(cfg)  # configs hold dicts (rope_scaling): not hashable, but their repr is exact
    if key not in _TREES:
        from torch import nn

        from tiered.models import build_model
        from tiered.models.moe import MoEBlock, expert_module

        with torch.device("meta"):  # the routed experts' parameters from one expert: E of them a MoE layer
            model = build_model(cfg, 1, experts=False)
            one = tuple((n, p.numel()) for n, p in expert_module(cfg).named_parameters()) if cfg.is_moe else ()
        tied = cfg.tie_word_embeddings
        counts = tuple((n, p.numel()) for n, p in model.named_parameters() if not (tied and n == "lm_head.weight"))
        blocks = [name for name, m in model.named_modules() if isinstance(m, MoEBlock)]
        counts += tuple((f"{block}.experts.{e}.{n}", k) for block in blocks for e in range(cfg.num_experts)
                        for n, k in one)
        copied = frozenset(f"{name}.weight" for name, m in model.named_modules()
                           if type(m) is nn.Linear and not is_expert_param(f"{name}.weight"))
        _TREES[key] = counts, copied
    return _TREES[key]


def _param_counts(cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
    """(name, elements) of every parameter `materialize` fills, from the meta-device module tree."""
    return _tree(cfg)[0]


def decode_copied(cfg: ModelConfig) -> frozenset[str]:
    """Names of the weights that get a decode-format copy: those of the model's plain nn.Linear layers,
    which quant/linear.install_decode_weights swaps (attention and FFN projections, a shared expert's
    gate, the lm_head; not the routers nor latent attention's kv_b_proj, which are nn.Linear
    subclasses, nor routed experts, which the expert runtime holds). In the CPU's one-copy mode these
    are held only as their copies (memory/apply.place_weights)."""
    return _tree(cfg)[1]


def decode_copy_bytes(cfg: ModelConfig, copies: dict[str, float], head: str | None = None,
                      skip: Callable[[str], bool] | None = None, dense: str | None = None) -> float:
    """Bytes of the decode copies quant/linear.install_decode_weights makes: every `decode_copied`
    weight not `skip`ped (routed experts), in `copies`' formats by share of their elements (format ->
    share, e.g. {"int4": 1.0}), the lm_head in `head`'s format where given (a GGUF file's head often
    has another: quant/linear.head_precision). A tied lm_head (cfg.tie_word_embeddings) gets a copy
    of its own, of the embedding's [vocab, hidden] elements.

    `dense`: the format the dense weights are held in beside the copies (Plan.dense_copies): a weight
    whose copy would be in that format gets none (quant/linear.decode_weight keeps the module). None
    (the one-copy mode) counts every copied weight: there its copy is its only copy."""
    counts = dict(_param_counts(cfg))
    per = lambda fmts: sum(share * bytes_per_element(k) for k, share in fmts.items() if k != dense)  # noqa: E731
    total = 0.0
    for name in decode_copied(cfg):
        if skip is not None and skip(name):
            continue
        n = counts.get(name)
        if n is None:  # the tied lm_head, counted once as the embedding: its copy is its own
            n = cfg.vocab_size * cfg.hidden_size
        total += n * (per({head: 1.0}) if head is not None and name == "lm_head.weight" else per(copies))
    return total


def one_copy_weight_bytes(cfg: ModelConfig, fmt: str, copies: dict[str, float],
                          skip: Callable[[str], bool] | None = None, head: str | None = None,
                          embedding: int | None = None) -> float:
    """Bytes of the model's parameters in the CPU's one-copy mode (Plan.dense_copies False): those with a
    decode copy (`decode_copied`) as the copy (decode_copy_bytes: `copies`' formats, the lm_head's
    `head` where given), every other (embedding, norms, routers, kv_b_proj) in the dense format `fmt`,
    latent attention's kv_b_proj also as its bf16 decode copy (LatentAttention.install_absorbed);
    `skip`ped names (routed experts) left out. `embedding`: the token embedding's bytes where it is kept
    in its file's blocks (quant/embedding.BlockEmbedding: a GGUF file's), else None (dense)."""
    copies_of = decode_copied(cfg)
    embed = "model.embed_tokens.weight"
    dense = sum(n for name, n in _param_counts(cfg) if name not in copies_of and not (skip is not None and skip(name))
                and not (embedding is not None and name == embed))
    # (the one-copy mode computes in fp32: kept_fp32 weights are at fmt's bytes)
    return (dense * bytes_per_element(fmt) + (embedding or 0) + absorbed_bytes(cfg)
            + decode_copy_bytes(cfg, copies, head, skip))


def absorbed_bytes(cfg: ModelConfig) -> int:
    """Bytes of latent attention's absorbed kernels (LatentAttention.install_absorbed: kv_b_proj's two
    halves as bf16 per-head copies) over every layer, which the CPU's native decode step holds beside
    the dense kv_b_proj (memory/apply.place_weights: in the one-copy mode and in a bf16 engine); 0
    for other attention."""
    return sum(n for name, n in _param_counts(cfg) if name.endswith(".self_attn.kv_b_proj.weight")) * 2


def kept_fp32(cfg: ModelConfig, name: str) -> bool:
    """Whether parameter `name` is held in fp32 whatever the model's dtype: DeepSeek's routers and
    their score-correction biases, which transformers keeps in fp32 (`_keep_in_fp32_modules_strict`;
    sigmoid scores plus a bias choose among close experts) and `materialize` loads so."""
    return cfg.topk_method != "softmax" and name.endswith((".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"))


def weight_bytes(cfg: ModelConfig, fmt: str, skip: Callable[[str], bool] | None = None) -> int:
    """Bytes `materialize` allocates for the model's parameters in dense format `fmt`, leaving out
    those for which `skip(name)` is True (tied lm_head counted once; `kept_fp32` ones at 4 bytes).
    Exact, in bytes."""
    n = f32 = 0
    for name, k in _param_counts(cfg):
        if skip is None or not skip(name):
            if kept_fp32(cfg, name):
                f32 += k
            else:
                n += k
    return int(n * bytes_per_element(fmt) + f32 * 4)


def skip_params(cfg: ModelConfig, sliced_layers=()) -> Callable[[str], bool] | None:
    """The parameters that stay off the model (on the meta device): routed experts, which the
    expert runtime serves, and the FFNs of ScheInfer-sliced layers, built into their tiers."""
    prefixes = tuple(f"model.layers.{i}.mlp." for i in sliced_layers)
    if not prefixes:
        return is_expert_param if cfg.is_moe else None
    return lambda name: name.startswith(prefixes) or (cfg.is_moe and is_expert_param(name))


def rotary_bytes(cfg: ModelConfig, max_positions: int) -> int:
    """Bytes of the RoPE cos and sin tables (fp32 [max_positions, rotary_dim] each: head_dim, or
    fewer under a partial RoPE), on the compute tier; twice that where the local layers rotate by a RoPE of
    their own (Gemma 3: models/layers.Rotary's local tables)."""
    return 2 * max_positions * cfg.rotary_dim * 4 * (2 if cfg.local_rope_theta is not None else 1)


def expert_bytes(cfg: ModelConfig, fmt: str) -> int:
    """Bytes of one routed expert (gate, up [F, D] and down [D, F]; with gpt-oss's biases as padded
    input columns [F, Db], [F, Db], [D, Fb], Db = D + 1 and Fb = F + 1 rounded up to multiples of 32:
    ModelConfig.expert_shapes) in expert format `fmt`: the
    exact slot size of quant/experts.ExpertFormat (quantized formats count their scales, zeros and
    64-byte segment alignment; projections the format cannot hold are counted as it falls back)."""
    from tiered.quant.experts import ExpertFormat, fit_format

    # ModelConfig.expert_shapes (of any config-like object)
    shapes = expert_shapes(cfg.hidden_size, cfg.moe_intermediate_size, bool(getattr(cfg, "expert_bias", False)))
    if fmt in _FORMAT_TORCH:
        return int(sum(n * k for n, k in shapes) * bytes_per_element(fmt))
    return ExpertFormat(fit_format(fmt, shapes), shapes).nbytes


def ffn_bytes(cfg: ModelConfig, fmt: str) -> int:
    """Bytes of one dense SwiGLU MLP (3 matrices of D x F) in format `fmt`."""
    return int(3 * cfg.hidden_size * cfg.intermediate_size * bytes_per_element(fmt))


def kv_cache_format(weights: str, decode: str | None = None, asked: str = "auto") -> str:
    """The KV cache's format (Plan.dtypes["kv_cache"]) for weights computing in `weights` ("fp32",
    "bf16", "fp16") with decode copies in `decode` (their precision; None or "none": no copies).

    The weights' 16-bit format; with fp32 weights, fp32 only in the lossless mode (no decode copies,
    or fp32 ones), else bf16: lossy decode copies (int4, int8, bf16) keep a bf16 cache, as llama.cpp
    keeps an f16 one, so each CPU decode step streams half the keys and values (SmolLM2 at 1024
    positions: 24 MB of its 47 MB a token). `asked`: EngineConfig.kv_cache_dtype, which decides unless "auto".
    """
    if asked != "auto":
        return asked
    if weights != "fp32":
        return weights if weights in ("bf16", "fp16") else "bf16"
    return "fp32" if decode in (None, "none", "fp32") else "bf16"


# KV cache formats (EngineConfig.kv_cache_dtype, Plan.dtypes["kv_cache"]): the dense ones, and "int8": each
# (position, KV head) row as head_dim int8 values and an fp32 scale per KV_BLOCK of them
# (models/layers.quantize_kv_rows)
KV_FORMATS = ("fp32", "bf16", "fp16", "int8")
KV_BLOCK = 32  # values an int8 KV cache's scale covers (a whole head row where head_dim is no multiple of it)


def kv_block(head_dim: int) -> int:
    """Values per scale of an int8 KV cache row: KV_BLOCK where it divides head_dim, else head_dim."""
    return KV_BLOCK if head_dim % KV_BLOCK == 0 else head_dim


def kv_row_bytes(head_dim: int) -> int:
    """Bytes of one int8 KV cache row of head_dim values: the values, then an fp32 scale per block."""
    return head_dim + 4 * (head_dim // kv_block(head_dim))


def kv_cache_widths(cfg: ModelConfig, fmt: str | None = None) -> tuple[int, int, int]:
    """(heads, key row width, value row width) of one layer's KVCache per position, in elements of its tensors:
    ModelConfig.kv_widths, or for `fmt` "int8" each row's packed bytes (kv_row_bytes).

    Raises:
        ConfigError: an unknown format, or int8 for latent attention (its latent rows serve every head)."""
    heads, kw, vw = cfg.kv_widths()
    if fmt == "int8":
        if cfg.is_mla:
            raise ConfigError("an int8 KV cache is not built for latent attention (DeepSeek's MLA)",
                              "use --kv-cache-dtype auto")
        return heads, kv_row_bytes(kw), kv_row_bytes(vw)
    if fmt is not None and fmt not in KV_FORMATS:
        raise ConfigError(f"unknown KV cache format {fmt!r}", f"use one of {', '.join(KV_FORMATS)}")
    return heads, kw, vw


def kv_bytes_per_token(cfg: ModelConfig, fmt: str) -> float:
    """Bytes one position takes in one layer's KV cache (keys and values) in format `fmt` (KV_FORMATS): an int8
    row of head_dim values carries an fp32 scale per 32 of them (1.125 bytes a value against bf16's 2).

    Raises:
        ConfigError: kv_cache_widths'."""
    heads, kw, vw = kv_cache_widths(cfg, fmt)
    return heads * (kw + vw) * (1.0 if fmt == "int8" else bytes_per_element(fmt))


def kv_compute_format(fmt: str) -> str:
    """The dense format a KV cache in `fmt` is attended in where a key or a byte count needs one: an int8
    cache's rows are dequantized to the activations' (16-bit) format, the others as they are."""
    return "bf16" if fmt == "int8" else fmt


def kv_torch_dtype(fmt: str) -> torch.dtype:
    """The torch dtype of a KVCache in format `fmt` (KV_FORMATS): torch.int8 for "int8", else torch_dtype's."""
    return torch.int8 if fmt == "int8" else torch_dtype(fmt)


def kv_cache_bytes(cfg: ModelConfig, slots: int, tokens: int, fmt: str, advance: int | None = None) -> int:
    """Bytes of a KVCache of `slots` sequences x `tokens` positions (keys and values of every layer) in
    format `fmt` (KV_FORMATS). `advance`: a cache whose sliding layers forget what is behind their window
    (KVCache(advance=...), Plan.kv_window), each sliding layer counted at kv_layer_positions' positions; None:
    every position of every layer."""
    if advance is None:
        return int(cfg.num_hidden_layers * slots * tokens * kv_bytes_per_token(cfg, fmt))
    positions = sum(kv_layer_positions(cfg, i, tokens, fmt, advance) for i in range(cfg.num_hidden_layers))
    return int(slots * positions * kv_bytes_per_token(cfg, fmt))


# KVCache.forget's hysteresis [positions]: a sequence keeps KV_FORGET_SLACK positions before its last (a step rolled
# back, a next request whose prompt ends a little before the conversation's last token: prefix reuse) beyond each
# sliding layer's window, and forgets once it is KV_FORGET_STEP positions past the last forget
KV_FORGET_SLACK = 256
KV_FORGET_STEP = 256


def kv_layer_positions(cfg: ModelConfig, layer: int, tokens: int, fmt: str, advance: int) -> int:
    """The most positions of one sequence's `tokens` whose KV layer `layer` of a forgetting cache holds
    (KVCache.forget) [positions]: all of them in a layer attending to the whole context; in a sliding layer its
    window, KV_FORGET_SLACK + KV_FORGET_STEP behind it, `advance` ahead (the most a sequence writes between two
    forgets: a prefill chunk), the window and KV_FORGET_SLACK before its prompt's end (KVCache.protect) and the
    pages each row's kept ranges leave at their ends, at most `tokens`."""
    window = cfg.window_of(layer)
    if window is None:
        return tokens
    _, kw, vw = kv_cache_widths(cfg, fmt)
    row = min(kw, vw) * (1 if fmt == "int8" else bytes_per_element(fmt))  # bytes a position takes in a head's row
    pages = 4 * -(-PAGE_BYTES // max(1, int(row)))
    return min(tokens, 2 * (window + KV_FORGET_SLACK) + KV_FORGET_STEP + advance + pages)


# the key counts a CPU prompt's attention reads are widened to a multiple of this (models/layers.KVCache.aligned)
KV_ALIGN = 16


def window_key_start(start: int, window: int) -> int:
    """The first cache position a sliding layer's eager attention reads for queries from position `start` on
    (models/layers._window_keys): the first its window holds, start - window + 1, down to a multiple of KV_ALIGN."""
    return max(0, start - window + 1) // KV_ALIGN * KV_ALIGN


PAGE_BYTES = 4096  # a host page (x86-64, most arm64 kernels): what the OS hands back whole


def tensor_bytes(shape, dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of `shape` in torch `dtype`."""
    return torch.Size(tuple(shape)).numel() * torch.empty((), dtype=dtype).element_size()


WORKSPACE_TOKENS = 512  # prefill steps the device workspace is sized for
# prompt tokens a CPU plan's prefill forward takes at most (Plan.prefill_chunk; its RAM workspace is sized for
# them): a longer prompt prefills chunk by chunk, so its activations stay bounded. On 2 Zen 3 cores (AVX2,
# 2026-11-30) chunks of 1024 against one forward: SmolLM2's 4096-token prompt peaked at 625 MB RSS against 780
# (11.6-12.2 s against 11.0-11.5), the Mixtral-width bf16 dummy's 2048-token prompt 6.0 s either way (chunks of
# 512: 6.7, its bf16 experts converted once a chunk), the 8-layer Qwen3-30B-A3B-width Q4_0 one 26.6 s against 37.2
CPU_PREFILL_TOKENS = 1024


def workspace_bytes(cfg: ModelConfig, fmt: str, tokens: int | None = None) -> int:
    """Bytes of one step's activations of `tokens` tokens on the fast tier (room the GPU budget keeps, or
    a CPU plan's RAM budget).

    Counts the live tensors of a decoder layer at its widest: hidden states and residual (4 x D),
    q/k/v and the attention output ((2H + 2Hkv) x hd), their fp32 rotary copies, the MLP's gate, up
    and product (3 x F, the wider of the dense and expert FFN), plus the last token's fp32 logits;
    then 25% for the caching allocator's rounding. `tokens`: WORKSPACE_TOKENS when None; a plan with
    a workspace prefills longer prompts in chunks of that many tokens (Plan.prefill_chunk).
    """
    tokens = WORKSPACE_TOKENS if tokens is None else tokens
    return int(1.25 * (tokens * _activation_bytes_per_token(cfg, fmt) + 4 * cfg.vocab_size))


def _activation_bytes_per_token(cfg: ModelConfig, fmt: str) -> float:
    """Bytes of a decoder layer's live activations per token at its widest (workspace_bytes)."""
    elem = bytes_per_element(fmt)
    qkv = (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    rot = (cfg.num_attention_heads + cfg.num_key_value_heads) * cfg.head_dim * 4 * 2
    if cfg.is_mla:  # a prefill expands the latents: per head q and k (n + r), k_nope + v, the output v
        H, n, r, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.head_dim, cfg.v_head_dim
        qkv = H * (2 * (n + r) + (n + v) + v) + cfg.kv_lora_rank + r
    ffn = max(cfg.intermediate_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size)
    return (4 * cfg.hidden_size + qkv + 3 * ffn) * elem + rot


def score_rows(cfg: ModelConfig, fmt: str, tokens: int) -> int:
    """Prompt positions whose logits one lm_head call computes when a prompt is scored
    (SamplingParams.prompt_logprobs, LLM._prefill_scored), after a forward of `tokens` tokens: as many
    as the room its layers' activations took (workspace_bytes, free again once the layers are done)
    holds, a row's logits taking V x (elem + 8) bytes (in `fmt`, their fp32 copy, its log-softmax);
    at least 1."""
    per_row = cfg.vocab_size * (bytes_per_element(fmt) + 8)
    return max(1, int(tokens * _activation_bytes_per_token(cfg, fmt) // per_row))


def cpu_workspace_bytes(cfg: ModelConfig, fmt: str, context: int, slots: int = 1) -> int:
    """A CPU plan's RAM for one prefill forward's activations in `fmt` (Plan.workspace_bytes): a chunk of
    CPU_PREFILL_TOKENS tokens (Plan.prefill_chunk), or `slots` prompts of the whole `context` where that is
    fewer (a forward packs at most one prompt a KV-cache slot: LLM._prefill_groups)."""
    return workspace_bytes(cfg, fmt, cpu_prefill_tokens(context, slots))


def cpu_prefill_tokens(context: int, slots: int = 1) -> int:
    """The most tokens a CPU plan's prefill forward takes (cpu_workspace_bytes' room): a chunk of CPU_PREFILL_TOKENS,
    or `slots` prompts of `context` tokens where that is fewer."""
    return min(CPU_PREFILL_TOKENS, max(1, slots) * context)


def library_workspace_bytes(capability: str | int | None) -> int:
    """GPU bytes libraries under torch hold for one engine on a CUDA device of compute `capability`
    ("9.0" or its major, 9): hardware/cuda.BLAS_WORKSPACES cuBLAS workspaces of that device's size
    (96 MiB on Hopper, ~24 MiB before it). 0 when None (no CUDA device: the stand-in, presets)."""
    if capability is None:
        return 0
    from tiered.hardware.cuda import BLAS_WORKSPACES, cublas_workspace_bytes

    major = int(str(capability).split(".")[0])
    return BLAS_WORKSPACES * cublas_workspace_bytes(major, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))


def device_workspace_bytes(cfg: ModelConfig, fmt: str, library: int) -> int:
    """Device bytes a GPU plan keeps free beyond its tensors (Plan.workspace_bytes): one step's activations
    (`workspace_bytes`) plus the `library` bytes libraries hold for the engine (Accelerator.
    library_workspace_bytes, or `library_workspace_bytes` of a profile's GPU: three cuBLAS workspaces,
    96 MiB on Hopper)."""
    return workspace_bytes(cfg, fmt) + library
