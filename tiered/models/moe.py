# N = tokens, E = experts, D = hidden, F = expert intermediate, k = top-k
"""Mixture-of-Experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE (and the MoE blocks of
DeepSeek-V2/V3 and GLM-4.5, whose router is models/deepseek.DeepSeekRouter).

Each layer's MLP is a `MoEBlock`: a router picks the top-k of E SwiGLU experts per token, the
chosen experts' outputs are summed with the router weights, and Qwen2-MoE adds an always-on shared
expert scaled by sigmoid(shared_expert_gate(x)). Some Qwen-MoE layers keep a dense MLP
(`ModelConfig.is_moe_layer`). Attention is the dense family's (models/layers.py).

Who computes the experts is an object, not a flag: `MoEBlock.runner` is an `ExpertRunner`.
`LocalExperts` (the default) runs them from the weights in `block.experts`; an offloading runtime
assigns its own runner (experts on other tiers, on the CPU, in low precision) and may leave
`block.experts` on the meta device, so the block itself never reads an expert weight.

Parameter names equal Hugging Face's checkpoint (Hub) names:
    Mixtral:   model.layers.N.block_sparse_moe.gate.weight [E, D],
               model.layers.N.block_sparse_moe.experts.J.{w1, w3, w2}.weight (gate, up, down)
    Qwen/OLMoE model.layers.N.mlp.gate.weight [E, D],
               model.layers.N.mlp.experts.J.{gate_proj, up_proj, down_proj}.weight
    Qwen2-MoE  + model.layers.N.mlp.shared_expert.{gate_proj, up_proj, down_proj}.weight,
               model.layers.N.mlp.shared_expert_gate.weight [1, D]
Sources: Mixtral of Experts (Jiang et al. 2024), Qwen1.5-MoE / Qwen2 report (2024), Qwen3 report
(2025), OLMoE (Muennighoff et al. 2024), as implemented by transformers' modeling_{mixtral,
qwen2_moe, qwen3_moe, olmoe}.py.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tiered.checkpoint.model_config import ModelConfig
from tiered.hardware.cpu_gemm import linear
from tiered.models.layers import MLP, glu_activation
from tiered.models.llama import CausalLM, DecoderLayer

# HF names of one expert's (gate, up, down) projections.
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")
SWIGLU_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def swiglu_hidden(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """silu(x @ w_gate.T) * (x @ w_up.T): x [n, D], w_gate / w_up [r, D] (all of an expert's rows,
    or some) -> [n, r] in x's dtype; weights cast to x's dtype when they differ. `act`: the GLU's
    activation (layers.glu_activation; Gemma's dense MLPs sliced: "gelu_tanh")."""
    dt = x.dtype
    w_gate, w_up = (w if w.dtype == dt else w.to(dt) for w in (w_gate, w_up))
    return glu_activation(linear(x, w_gate), act) * linear(x, w_up)


def expert_forward(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """One SwiGLU expert: (silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T (or the GLU of `act`, swiglu_hidden).

    Args:
        x: [n, D] tokens routed to this expert.
        w_gate, w_up: [F, D]; w_down: [D, F]. Cast to x's dtype when they differ.
    Returns:
        [n, D] in x's dtype.
    """
    return linear(swiglu_hidden(x, w_gate, w_up, act), w_down if w_down.dtype == x.dtype else w_down.to(x.dtype))


class Expert(nn.Module):
    """One routed expert with its architecture's HF names (w1/w3/w2 or gate/up/down_proj).

    Args:
        hidden, intermediate: D and F.
        names: attribute names of the (gate, up, down) projections.
    """

    def __init__(self, hidden: int, intermediate: int, names: tuple[str, str, str] = SWIGLU_EXPERT_NAMES) -> None:
        super().__init__()
        self.names = names
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden, intermediate, bias=False))
        setattr(self, up, nn.Linear(hidden, intermediate, bias=False))
        setattr(self, down, nn.Linear(intermediate, hidden, bias=False))

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w_gate [F, D], w_up [F, D], w_down [D, F]): the dense weights, as stored."""
        return tuple(getattr(self, n).weight for n in self.names)  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, D] -> [n, D]."""
        return expert_forward(x, *self.weights())


class Router(nn.Linear):
    """The router (HF's `gate`): logits = x @ weight.T with weight [E, D], then top-k.

    It is an nn.Linear subclass so its parameter keeps the HF name `...gate.weight`; being a
    subclass (not `nn.Linear` itself) also keeps it out of the decode-weight swap
    (quant/linear.py), so routing always uses the dense weight: the router is tiny and a
    lower-precision copy would flip expert choices.

    Rule (all four architectures): probs = softmax(logits in fp32); top-k of probs; divide by their
    sum when `norm_topk_prob` (Mixtral always; Qwen-MoE and OLMoE per config); cast to the
    activation dtype.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__(hidden, num_experts, bias=False)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (topk_idx int64 [N, k], topk_weight [N, k] in x's dtype)."""
        logits = F.linear(x, self.weight.to(x.dtype))  # (N, E), activation dtype like HF
        topk_idx, topk_weight = self.select(logits.float())
        return topk_idx, topk_weight.to(x.dtype)

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing rule on router logits fp32 [N, E] -> (topk_idx int64 [N, k], topk_weight fp32
        [N, k]); runtime/prefetch applies it to predicted logits."""
        topk_weight, topk_idx = torch.topk(logits.softmax(dim=-1), self.top_k, dim=-1)  # (N, k)
        if self.norm_topk_prob:
            topk_weight = topk_weight / topk_weight.sum(dim=-1, keepdim=True)
        return topk_idx, topk_weight


class ExpertRunner(Protocol):
    """Computes the routed experts of one MoE layer; the block's only way to reach expert weights.

    Any object with this __call__ qualifies (structural typing); subclassing is optional.
    A runner is a plain object (not an nn.Module, which the block would register as a child and
    whose parameters would join the model's). It is called as
        runner(layer_idx, x [N, D], topk_idx int64 [N, k], topk_weight [N, k], block) -> [N, D]
    and returns, per token, sum over its k slots of topk_weight * expert_{topk_idx}(x), in x's
    dtype: the routed experts only (the block adds the shared expert). `block` is the calling
    MoEBlock (its `experts` may live on the meta device when the runner keeps weights elsewhere).
    """

    def __call__(self, layer_idx: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                 block: "MoEBlock") -> torch.Tensor: ...


class LocalExperts(ExpertRunner):
    """The default ExpertRunner: every expert that received tokens runs from `block.experts`.

    Tokens are grouped by expert (one GEMM per active expert), in ascending expert order like
    transformers, and accumulated with index_add_.
    """

    def __call__(self, layer_idx: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                 block: "MoEBlock") -> torch.Tensor:
        out = torch.zeros_like(x)  # (N, D)
        for e in torch.unique(topk_idx).tolist():
            rows, slot = torch.where(topk_idx == e)  # (n,), (n,): tokens routed to e, their k slot
            y = block.experts[e](x[rows])  # (n, D): the expert's own math (Expert.forward: expert_forward)
            out.index_add_(0, rows, y * topk_weight[rows, slot, None])
        return out


class ExpertsElsewhere(ExpertRunner):
    """The runner of a block built without its experts (build_model(..., experts=False)): the engine's
    expert runtime replaces it (runtime/install.py); calling it means none was installed."""

    def __call__(self, layer_idx, x, topk_idx, topk_weight, block):
        raise RuntimeError(f"MoE layer {layer_idx} was built without its experts (the expert runtime serves "
                           "them) and no ExpertRunner was installed")


class MoEBlock(nn.Module):
    """Routed experts (+ optional shared expert): x [B, T, D] -> [B, T, D].

    Children (HF names): `gate` (Router; DeepSeek's: models/deepseek.DeepSeekRouter), `experts`
    (ModuleList of Expert), and for Qwen2-MoE `shared_expert` (MLP) and `shared_expert_gate`
    (nn.Linear D -> 1), whose sigmoid scales the shared expert's output; for DeepSeek the shared
    experts (one MLP of n_shared_experts x moe_intermediate_size, HF name `shared_experts`, reached
    as `shared_expert` too) are added ungated and `shared_expert_gate` is None; else both are None.

    `experts=False` builds no expert modules (`experts` is empty and the runner ExpertsElsewhere): the
    engine's model, whose experts the expert runtime holds (building a 128-expert layer's 384 meta
    nn.Linear cost ~50 ms a layer, twice a start); memory/sizes counts their parameters from one.

    Attributes:
        layer_idx: index of the decoder layer that owns the block.
        runner: the ExpertRunner computing the routed experts (default LocalExperts()); assign
            another to change where and how experts run.
        on_route: None, or a callable (layer_idx, topk_idx [N, k], topk_weight [N, k]) called after
            each routing decision (e.g. an expert-popularity profiler).
    """

    def __init__(self, config: ModelConfig, layer_idx: int,
                 expert_names: tuple[str, str, str] = SWIGLU_EXPERT_NAMES, experts: bool = True) -> None:
        super().__init__()
        D, E = config.hidden_size, config.num_experts
        self.layer_idx = layer_idx
        if config.topk_method != "softmax":
            from tiered.models.deepseek import DeepSeekRouter

            self.gate = DeepSeekRouter(config)
        else:
            self.gate = Router(D, E, config.num_experts_per_tok, config.norm_topk_prob)
        self.experts = nn.ModuleList(Expert(D, config.moe_intermediate_size, expert_names) for _ in range(E)
                                     if experts)
        self.shared_expert_gate = None
        if not config.shared_expert_intermediate_size:
            self.shared_expert = None
        elif config.shared_expert_gated:
            self.shared_expert = MLP(D, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(D, 1, bias=False)
        else:  # DeepSeek's HF name; `shared_expert` (__getattr__) stays the one attribute other code reads
            self.shared_experts = MLP(D, config.shared_expert_intermediate_size)
        self.runner: ExpertRunner = LocalExperts() if experts else ExpertsElsewhere()
        self.on_route: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        h = x.reshape(B * T, D)  # (N, D)
        topk_idx, topk_weight = self.gate.route(h)  # (N, k), (N, k)
        if self.on_route is not None:
            self.on_route(self.layer_idx, topk_idx, topk_weight)
        out = self.runner(self.layer_idx, h, topk_idx, topk_weight, self)  # (N, D)
        shared = self.shared_expert
        if shared is not None:
            out = out + (shared(h) if self.shared_expert_gate is None
                         else torch.sigmoid(self.shared_expert_gate(h)) * shared(h))
        return out.view(B, T, D)

    def __getattr__(self, name: str):
        if name == "shared_expert" and "shared_experts" in self._modules:  # DeepSeek's shared experts
            return self._modules["shared_experts"]
        return super().__getattr__(name)


class MixtralDecoderLayer(DecoderLayer):
    """DecoderLayer whose MoE child carries Mixtral's HF name `block_sparse_moe`.

    `layer.mlp` still returns the block, so code that walks layers sees one attribute for every
    architecture; parameters appear only under `block_sparse_moe.*`.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, moe: MoEBlock) -> None:
        super().__init__(config, layer_idx, mlp=moe)
        self.block_sparse_moe = self._modules.pop("mlp")

    @property
    def mlp(self) -> MoEBlock:  # type: ignore[override]
        return self.block_sparse_moe


def build_moe_model(config: ModelConfig, max_positions: int, experts: bool = True) -> CausalLM:
    """The CausalLM of an MoE architecture (config.model_type in MOE_TYPES); `experts`: MoEBlock's."""
    layers: list[nn.Module] = []
    for i in range(config.num_hidden_layers):
        if config.model_type == "mixtral":
            layers.append(MixtralDecoderLayer(config, i, MoEBlock(config, i, MIXTRAL_EXPERT_NAMES, experts)))
        elif config.is_moe_layer(i):
            layers.append(DecoderLayer(config, i, mlp=MoEBlock(config, i, experts=experts)))
        else:  # a dense layer of a Qwen-MoE model (mlp_only_layers / decoder_sparse_step)
            layers.append(DecoderLayer(config, i))
    return CausalLM(config, max_positions, layers)


def expert_module(config: ModelConfig) -> nn.Module:
    """One routed expert of `config`'s architecture, as its MoEBlock builds each (HF names; build it on the
    meta device for names and shapes only)."""
    if config.model_type == "gpt_oss":
        from tiered.models.gpt_oss import GptOssExpert
        return GptOssExpert(config.hidden_size, config.moe_intermediate_size, config.swiglu_alpha, config.swiglu_limit)
    names = MIXTRAL_EXPERT_NAMES if config.model_type == "mixtral" else SWIGLU_EXPERT_NAMES
    return Expert(config.hidden_size, config.moe_intermediate_size, names)


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """Every MoEBlock of `model`, in layer order."""
    return [m for m in model.modules() if isinstance(m, MoEBlock)]
