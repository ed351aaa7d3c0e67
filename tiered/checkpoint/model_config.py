"""ModelConfig: a model's hyperparameters, from an HF config.json or GGUF metadata.

Only what the math needs lives here; it is read once and never mutated (llama2.c's `Config`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tiered.errors import CheckpointError, UnsupportedModelError

# HF `model_type` -> family. Dense families share one implementation (models/llama.py); MoE
# families share models/moe.py.
DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
QWEN_MOE_TYPES = ("qwen2_moe", "qwen3_moe")  # read decoder_sparse_step / mlp_only_layers
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Hyperparameters of a decoder-only transformer (dense or MoE).

    Attributes (units in brackets):
        model_type: HF model_type, e.g. "llama", "qwen3", "mixtral".
        vocab_size, hidden_size, intermediate_size: [elements].
        num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim: [count]/[elements].
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base; rope_scaling: None or a dict with "rope_type" in ROPE_TYPES.
        max_position_embeddings: trained context window [tokens].
        tie_word_embeddings: lm_head shares embed_tokens' weight.
        attention_bias: q/k/v projections carry a bias (Qwen2, Qwen2-MoE).
        o_proj_bias: the output projection carries a bias too (HF Llama, Qwen3, Qwen3-MoE and OLMoE
            tie it to `attention_bias`; Qwen2 and Mistral never have one).
        qk_norm: RMSNorm on q and k before RoPE (Qwen3, Qwen3-MoE, OLMoE).
        qk_norm_scope: "head" = over each head's hd elements (Qwen3), weights [hd]; "proj" = over
            the whole projection before splitting into heads (OLMoE), weights [H*hd] / [Hkv*hd].
        clip_qkv: q, k, v are clamped to [-clip_qkv, clip_qkv] after the q/k norm (OLMoE), or None.
        sliding_window: keys older than this many positions are masked (Mistral), or None.
        num_experts, num_experts_per_tok: routed experts E and top-k (0 when dense).
        moe_intermediate_size: F of each routed expert [elements]; dense layers of an MoE model
            (see `is_moe_layer`) use `intermediate_size`.
        shared_expert_intermediate_size: F of the always-on shared expert (Qwen2-MoE), 0 = none.
        norm_topk_prob: renormalize the top-k router probabilities to sum 1 (always for Mixtral).
        decoder_sparse_step, mlp_only_layers: which layers are MoE (Qwen-MoE): layer i is MoE when
            i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
        bos_token_id, eos_token_ids: special tokens from the checkpoint.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    qk_norm_scope: str = "head"  # "head" (Qwen3) | "proj" (OLMoE)
    clip_qkv: float | None = None
    sliding_window: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.model_type not in DENSE_TYPES + MOE_TYPES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.model_type!r}",
                "tiered runs " + ", ".join(DENSE_TYPES + MOE_TYPES))
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"{self.num_attention_heads} attention heads are not a multiple of "
                f"{self.num_key_value_heads} KV heads", "check the checkpoint's config.json")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(f"unsupported RoPE scaling {rope_type!r}",
                                        "tiered supports " + ", ".join(ROPE_TYPES))
        if self.qk_norm_scope not in ("head", "proj"):
            raise UnsupportedModelError(f"unknown q/k norm scope {self.qk_norm_scope!r}",
                                        "use 'head' (Qwen3) or 'proj' (OLMoE)")
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModelError(
                f"top-{self.num_experts_per_tok} routing over {self.num_experts} experts",
                "check num_experts_per_tok in the checkpoint's config.json")
        if self.decoder_sparse_step < 1:
            raise UnsupportedModelError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}",
                                        "check the checkpoint's config.json")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Layer `layer_idx` has a routed-expert block (else a dense MLP of intermediate_size)."""
        return (self.is_moe and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def num_parameters(self) -> int:
        """Exact parameter count [elements]: weights, biases and norms; MoE counts every expert."""
        d, L = self.hidden_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = d * q * 2 + d * kv * 2
        attn += (q + 2 * kv) * self.attention_bias + d * self.o_proj_bias
        if self.qk_norm:
            attn += q + kv if self.qk_norm_scope == "proj" else 2 * self.head_dim
        total = 0
        for i in range(L):
            if self.is_moe_layer(i):
                mlp = self.num_experts * 3 * d * self.moe_intermediate_size + d * self.num_experts
                if self.shared_expert_intermediate_size:
                    mlp += 3 * d * self.shared_expert_intermediate_size + d  # + shared_expert_gate
            else:
                mlp = 3 * d * self.intermediate_size
            total += attn + mlp + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return total + emb + d

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: object = "config.json") -> "ModelConfig":
        """Build from a parsed HF config.json (transformers 4.x or 5.x layout).

        Args:
            cfg: the parsed JSON.
            source: the file it came from, named in errors.
        Raises:
            CheckpointError: the config is not a JSON object, lacks a required field, or gives a
                field a value of the wrong type or range (`_check_hf_fields`).
            UnsupportedModelError: unknown model_type or RoPE scaling, MLP biases, or a mix of
                sliding-window and full-attention layers.
        """
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{source} is a JSON {type(cfg).__name__}, not an object of model settings",
                                  "restore the checkpoint's config.json")
        model_type = cfg.get("model_type", "")
        if model_type not in DENSE_TYPES + MOE_TYPES:
            archs = ", ".join(cfg.get("architectures") or []) or model_type or "unknown"
            raise UnsupportedModelError(f"unsupported architecture {archs!r}",
                                        "tiered runs " + ", ".join(DENSE_TYPES + MOE_TYPES))
        _check_hf_fields(cfg, model_type, source)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        # transformers 5 nests RoPE settings in rope_parameters; 4.x has rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling") or (rope or None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.pop("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = None
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window = _sliding_window(cfg, model_type)
        if cfg.get("mlp_bias"):  # HF Llama's mlp_bias: gate/up/down biases our MLP does not have
            raise UnsupportedModelError("MLP biases (mlp_bias=true in config.json) are not supported",
                                        "use a checkpoint without MLP biases")
        moe = model_type in MOE_TYPES
        n_exp = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        if model_type == "qwen2_moe":  # Qwen2-MoE names its q/k/v bias flag qkv_bias
            bias = bool(cfg.get("qkv_bias", cfg.get("attention_bias", True)))
        else:
            bias = bool(cfg.get("attention_bias", model_type == "qwen2"))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size", 0),
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bias,
            o_proj_bias=bias and model_type in ("llama", "qwen3", "qwen3_moe", "olmoe"),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "olmoe"),
            qk_norm_scope="proj" if model_type == "olmoe" else "head",
            clip_qkv=cfg.get("clip_qkv") if model_type == "olmoe" else None,
            sliding_window=window,
            num_experts=n_exp if moe else 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) if moe else 0,
            moe_intermediate_size=(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size", 0)) if moe else 0,
            shared_expert_intermediate_size=(cfg.get("shared_expert_intermediate_size") or 0)
            if model_type == "qwen2_moe" else 0,
            # Mixtral always renormalizes; the others read the flag (HF default False).
            norm_topk_prob=model_type == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=(cfg.get("decoder_sparse_step") or 1) if model_type in QWEN_MOE_TYPES else 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()) if model_type in QWEN_MOE_TYPES else (),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
        )


# HF config.json fields read as ints: (required, smallest value). A field given as null counts as
# absent (configs write e.g. "head_dim": null), so required ones must hold a number.
_INT_FIELDS = {
    "vocab_size": (True, 1), "hidden_size": (True, 1), "num_hidden_layers": (True, 1),
    "num_attention_heads": (True, 1), "num_key_value_heads": (False, 1), "head_dim": (False, 1),
    "intermediate_size": (False, 0), "max_position_embeddings": (False, 1), "sliding_window": (False, 0),
    "max_window_layers": (False, 0), "num_local_experts": (False, 0), "num_experts": (False, 0),
    "num_experts_per_tok": (False, 0), "moe_intermediate_size": (False, 0),
    "shared_expert_intermediate_size": (False, 0), "decoder_sparse_step": (False, 1),
    "bos_token_id": (False, 0),
}
# fields read as numbers (int or float, finite): each must be above this value
_FLOAT_FIELDS = {"rms_norm_eps": 0.0, "rope_theta": 0.0, "clip_qkv": 0.0}
# RoPE scaling factors each rope_type reads (rope_inv_freq)
_ROPE_FACTORS = {"linear": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def is_int(x) -> bool:
    """x is an int of JSON (a bool is not)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_hf_fields(cfg: dict[str, Any], model_type: str, source: object) -> None:
    """Check that an HF config holds every field tiered reads, with values of the right type and
    range: the model's sizes are ints (a bool is not), positive where a zero makes no model.

    Raises:
        CheckpointError: a required field is missing, or a field has a value of the wrong type or
            range; the message names the field and `source`.
    """
    hint = "fix or restore the checkpoint's config.json"

    def bad(field: str, why: str) -> CheckpointError:
        return CheckpointError(f"{source}: {field} {why}", hint)

    for field, (required, least) in _INT_FIELDS.items():
        v = cfg.get(field)
        if v is None:
            if required:
                raise bad(field, "is missing")
            continue
        if not is_int(v):
            raise bad(field, f"must be an integer, got {v!r}")
        if v < least:
            raise bad(field, f"must be {'positive' if least == 1 else '>= 0'}, got {v}")
    if cfg.get("intermediate_size") is None and (model_type in DENSE_TYPES or not cfg.get("moe_intermediate_size")):
        raise bad("intermediate_size", "is missing")
    if model_type in DENSE_TYPES and cfg["intermediate_size"] < 1:
        raise bad("intermediate_size", f"must be positive, got {cfg['intermediate_size']}")
    if cfg.get("head_dim") is None and cfg["hidden_size"] % cfg["num_attention_heads"]:
        raise bad("hidden_size", f"{cfg['hidden_size']} is not a multiple of num_attention_heads "
                                 f"{cfg['num_attention_heads']} (and no head_dim is given)")
    for field, above in _FLOAT_FIELDS.items():
        v = cfg.get(field)
        if v is not None and not (_is_number(v) and v > above):
            raise bad(field, f"must be a positive number, got {v!r}")
    eos = cfg.get("eos_token_id")
    if eos is not None and not all(is_int(i) and i >= 0 for i in (eos if isinstance(eos, list) else [eos])):
        raise bad("eos_token_id", f"must be a token id or a list of them, got {eos!r}")
    layers = cfg.get("mlp_only_layers")
    if layers is not None and not (isinstance(layers, list) and all(is_int(i) for i in layers)):
        raise bad("mlp_only_layers", f"must be a list of layer indices, got {layers!r}")
    types = cfg.get("layer_types")
    if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        raise bad("layer_types", f"must be a list of strings, got {types!r}")
    for field in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(field)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise bad(field, f"must be an object, got {rope!r}")
        theta = rope.get("rope_theta")
        if theta is not None and not (_is_number(theta) and theta > 0):
            raise bad(f"{field}.rope_theta", f"must be a positive number, got {theta!r}")
        for k in _ROPE_FACTORS.get(rope.get("rope_type", rope.get("type")), ()):
            if not (_is_number(rope.get(k)) and rope[k] > 0):
                raise bad(f"{field}.{k}",
                          "is missing" if k not in rope else f"must be a positive number, got {rope[k]!r}")


def _sliding_window(cfg: dict[str, Any], model_type: str) -> int | None:
    """The attention window shared by every layer of an HF config, or None when no layer slides.

    Mistral and Mixtral slide in every layer; Qwen2/Qwen3 (and their MoE variants) only in layers
    >= max_window_layers (HF default 28), which transformers 5 writes out as `layer_types`.

    Raises:
        UnsupportedModelError: some layers slide and others attend to the full context.
    """
    window = cfg.get("sliding_window")
    if window is None or not cfg.get("use_sliding_window", model_type in ("mistral", "mixtral")):
        return None
    types = cfg.get("layer_types")
    if types is None:
        first = cfg.get("max_window_layers", 28) if model_type.startswith("qwen") else 0
        types = ["full_attention" if i < first else "sliding_attention" for i in range(cfg["num_hidden_layers"])]
    sliding = {t == "sliding_attention" for t in types}
    if sliding == {False}:
        return None
    if sliding == {True}:
        return window
    raise UnsupportedModelError("models that mix sliding-window and full-attention layers are not supported",
                                "use a checkpoint whose layers all use the same attention")


def rope_inv_freq(config: ModelConfig) -> "torch.Tensor":
    """RoPE inverse frequencies [head_dim // 2] fp32, with linear or llama3 scaling applied.

    The llama3 rule (Llama 3.1 report): wavelengths longer than original_ctx / low_freq_factor are
    divided by `factor`, shorter than original_ctx / high_freq_factor are kept, and the band
    between is interpolated smoothly.
    """
    import torch

    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = config.rope_scaling
    if s is None:
        return inv
    if s["rope_type"] == "linear":
        return inv / s["factor"]
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return torch.where(medium, smoothed, scaled)
