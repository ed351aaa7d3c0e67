"""Architecture math only: nn.Modules with Hugging Face parameter names. Never sees a tier or stream."""

import contextlib
import threading

import torch
from torch import nn

from tiered.checkpoint.model_config import DENSE_TYPES, MOE_TYPES
from tiered.checkpoint.model_config import ModelConfig
from tiered.models.llama import CausalLM

_NO_INIT = threading.Lock()
_BUILDING = threading.local()  # .meta: this thread builds a meta tree inside _no_parameter_init


@contextlib.contextmanager
def _no_parameter_init():
    """nn.Linear and nn.Embedding built without their random initialization (reset_parameters) while inside,
    for module trees on the meta device, where values do not exist: on 2 Zen 3 cores (2026-12-01) the init
    took half of building an 8-layer, 128-expert Qwen3-MoE tree (0.55 -> 0.26 s; 3105 nn.Linear), which
    the engine builds twice at each start (memory/sizes, then the model it places). The classes' methods
    are swapped for the duration, under a lock (one such build at a time), for ones that skip only in this
    thread and only for meta weights: a module another thread builds meanwhile is initialized as always."""
    with _NO_INIT:
        saved = {cls: cls.__dict__["reset_parameters"] for cls in (nn.Linear, nn.Embedding)}

        def skipping(init):
            def reset_parameters(self):
                if getattr(_BUILDING, "meta", False) and self.weight.is_meta:
                    return None
                return init(self)
            return reset_parameters

        for cls, init in saved.items():
            cls.reset_parameters = skipping(init)
        _BUILDING.meta = True
        try:
            yield
        finally:
            _BUILDING.meta = False
            for cls, fn in saved.items():
                cls.reset_parameters = fn


def build_model(config: ModelConfig, max_positions: int, experts: bool = True) -> CausalLM:
    """Build the module tree for `config` (call under torch.device('meta') to allocate nothing; there its
    nn.Linear and nn.Embedding layers skip their random initialization). `experts=False`: MoE blocks
    without their routed experts' modules (models/moe.MoEBlock), for a runtime that holds them itself.

    Dense Llama-family types get models/llama.py's layers, Gemma 3 models/gemma.py's; MoE types (Mixtral, Qwen2-MoE,
    Qwen3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4.5) get models/moe.py's MoEBlock layers; gpt-oss
    models/gpt_oss.py's (attention sinks, a biased router, biased clamped-GLU experts).

    Raises:
        UnsupportedModelError: an architecture with no implementation yet.
    """
    if torch.get_default_device().type == "meta":
        with _no_parameter_init():
            return _build(config, max_positions, experts)
    return _build(config, max_positions, experts)


def _build(config: ModelConfig, max_positions: int, experts: bool) -> CausalLM:
    if config.sandwich_norms:  # Gemma 3
        from tiered.models.gemma import GemmaDecoderLayer
        return CausalLM(config, max_positions, [GemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
    if config.model_type in DENSE_TYPES:
        return CausalLM(config, max_positions)
    if config.model_type == "gpt_oss":
        from tiered.models.gpt_oss import build_gpt_oss_model
        return build_gpt_oss_model(config, max_positions, experts)
    if config.model_type in MOE_TYPES:
        from tiered.models.moe import build_moe_model
        return build_moe_model(config, max_positions, experts)
    from tiered.errors import UnsupportedModelError
    raise UnsupportedModelError(f"architecture {config.model_type!r} is not implemented yet",
                                "use a dense Llama-family or an MoE (Mixtral, Qwen-MoE, OLMoE) model")
