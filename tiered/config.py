"""Engine configuration: frozen dataclasses validated on creation."""

from __future__ import annotations

from dataclasses import dataclass

from tiered.errors import ConfigError

WEIGHT_FORMATS = ("auto", "fp32", "bf16", "int4")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine loads and runs a model.

    Attributes:
        dtype: activation / dense-weight dtype for prefill and scoring, "float32" or "bfloat16".
            float32 is the lossless mode that matches transformers to 1e-4.
        decode_weights: weight format of the decode path (one or a few tokens per step):
            "auto" keeps GGUF 4-bit blocks (Q4_0/Q4_1) as packed int4 with bf16 activations and
            other tensors in bf16; "fp32" / "bf16" use dense weights; "int4" also re-quantizes
            dense weights to group-wise int4 (group 32). Only "fp32" is lossless.
        decode_weights_threshold: steps with at most this many tokens use the decode weights;
            larger steps (prefill) use the dense `dtype` weights.
        max_context: context window in tokens; None uses the model's max_position_embeddings.
        num_threads: CPU threads for torch; None keeps torch's default (one per core).
    """

    dtype: str = "float32"
    decode_weights: str = "auto"
    decode_weights_threshold: int = 8
    max_context: int | None = None
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype must be float32 or bfloat16, got {self.dtype!r}",
                              "pass dtype='float32' (lossless) or 'bfloat16'")
        if self.decode_weights not in WEIGHT_FORMATS:
            raise ConfigError(f"decode_weights must be one of {WEIGHT_FORMATS}, got {self.decode_weights!r}",
                              "pass one of " + ", ".join(WEIGHT_FORMATS))
        if self.decode_weights_threshold < 1:
            raise ConfigError("decode_weights_threshold must be >= 1", "pass a positive token count")
        if self.max_context is not None and self.max_context < 1:
            raise ConfigError("max_context must be >= 1 token", "pass a positive token count or None")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError("num_threads must be >= 1", "pass a positive thread count or None")
