"""Architecture math only: nn.Modules with Hugging Face parameter names. Never sees a tier or stream."""

from tiered.checkpoint.model_config import DENSE_TYPES, MOE_TYPES
from tiered.checkpoint.model_config import ModelConfig
from tiered.models.llama import CausalLM


def build_model(config: ModelConfig, max_positions: int) -> CausalLM:
    """Build the module tree for `config` (call under torch.device('meta') to allocate nothing).

    Dense Llama-family types get models/llama.py's layers; MoE types (Mixtral, Qwen2-MoE,
    Qwen3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4.5) get models/moe.py's MoEBlock layers; gpt-oss
    models/gpt_oss.py's (attention sinks, a biased router, biased clamped-GLU experts).

    Raises:
        UnsupportedModelError: an architecture with no implementation yet.
    """
    if config.model_type in DENSE_TYPES:
        return CausalLM(config, max_positions)
    if config.model_type == "gpt_oss":
        from tiered.models.gpt_oss import build_gpt_oss_model
        return build_gpt_oss_model(config, max_positions)
    if config.model_type in MOE_TYPES:
        from tiered.models.moe import build_moe_model
        return build_moe_model(config, max_positions)
    from tiered.errors import UnsupportedModelError
    raise UnsupportedModelError(f"architecture {config.model_type!r} is not implemented yet",
                                "use a dense Llama-family or an MoE (Mixtral, Qwen-MoE, OLMoE) model")
