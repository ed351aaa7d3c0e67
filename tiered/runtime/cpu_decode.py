"""A lean decode step for dense layers on the CPU: the fewest torch ops per token (llama2.c's loop).

Batch-1 decode on the CPU is bound by memory bandwidth only when the weight kernels are nearly all
of the step. Through the model's modules, a SmolLM2 decode step issued ~4,500 torch ops per token
(casts, slices, reshapes, rotate-half, KV indexing), two-thirds of its time. `CPUDecodeStep` runs the
same math from the same weights with ~30 ops per layer:

    h = rms_norm(x)                                 1 op
    qkv = W_qkv h          (one fused kernel)       2 (cast to the kernel's dtype, kernel)
    q, k = rope(qkv[:, :q+k]) on the fused output   3 (mul, matmul by the rotate-half matrix, addcmul)
    KV write in place at (slot, position)           2
    o = sdpa(q, K[:S], V[:S])                       1
    x += W_o o                                      3
    h = rms_norm(x); gu = W_gu h                    3
    x += W_down (silu(g) * u)                       4

Weights are the decode copies `quant/linear.install_decode_weights` made (int4 / int8 / bf16
kernels, q/k/v and gate/up fused), or the dense weights in the lossless mode (each projection's
own kernel, outputs concatenated): the step only calls their kernels, without the modules'
per-call reshapes and casts. Activations between kernels
stay in the kernel's dtype (bf16 for the packed kernels); the residual stream, norms, RoPE, the KV
cache and attention stay in the model's dtype, as in the module path.

Layers it cannot run (q/k norms, q/k/v clipping, an FFN that is not a plain SwiGLU MLP: MoE blocks,
sliced FFNs) are handled by the lean attention plus the layer's own FFN module, or wholly by the
layer's own forward; the result is the same model.

With `native=True` (Plan.native_decode: tiered/kernels built), the same step runs in C++
(tiered/kernels/csrc/decode.cpp): one call per run of consecutive plain layers, the glue as plain
loops and only the weight kernels left, so a SmolLM2 step issues a handful of Python calls instead
of ~1,400 torch ops. MoE blocks whose experts are all resident run there too (`_native_moe`: the
router, the top-k experts, the shared expert), with the standard router or DeepSeek's (DeepSeek-V2
§2.2, DeepSeek-V3 §2.1.2). DeepSeek's latent-attention layers (models/deepseek.LatentAttention) run
their attention half there, in the absorbed form (DeepSeek-V2 §2.1, Appendix C; `_native_latent`),
and their MoE block or dense MLP after it; the torch-op step runs them whole as modules.
A partial RoPE (GLM-4.5: ModelConfig.rotary_dim < head_dim) rotates each head's first rotary_dim
features in both steps and passes the rest through (DecodeStep's rotary_dim; the torch-op step's
rotate-half matrix is 0 there, its cos 1 and sin 0).
Gemma 2 / 3's layers (models/gemma.py) run in the native step too: their output norms before each residual add
(DecodeStep.set_sandwich), GeGLU (set_activation), the sliding layers' own RoPE tables (set_local_rope: the
engine's Rotary.local_cos / local_sin at the step's positions), query_pre_attn_scalar's scale and Gemma 2's soft
caps (set_softcap on the attention logits, CausalLM.softcap on the output's); the torch-op step runs them whole as
modules.
TIERED_NATIVE_MLA=0 keeps latent layers whole as modules in the native step as well, and
TIERED_NATIVE_MOE=0 every MoE block its module (to compare; the native parts are the default).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from tiered.kernels.linear import NativeLinear, kernel_for
from tiered.models.layers import MLP, Attention, AttentionMetadata, KVCache, build_attention_metadata
from tiered.quant.int4 import Int4Linear
from tiered.quant.int8 import Int8Linear, int8pack_mm
from tiered.quant.linear import CastLinear, PhaseLinear, Slice
from tiered.runtime.dispatcher import RESIDENT

_int4mm = torch.ops.aten._weight_int4pack_mm_for_cpu
_int8mm = int8pack_mm


class Kernel:
    """One decode-path weight as a bare call: y [B, N] = kernel(x [B, K] in `dtype`), no reshapes.

    Built from an Int4Linear, Int8Linear, Int8G32Linear, Fp8Linear, CastLinear or nn.Linear (the last in its
    own dtype).
    The output is in the kernel's dtype (bf16 for the packed kernels) with the bias added.
    """

    __slots__ = ("fn", "dtype", "out_features")

    def __init__(self, m: nn.Module) -> None:
        bias = getattr(m, "bias", None)
        if isinstance(m, Int4Linear) and m.layout == "tiled" or isinstance(m, NativeLinear):
            # tiered's kernels: fp32 out, bias added
            self.fn, self.dtype, self.out_features = m.kernel(), torch.float32, m.out_features
        elif isinstance(m, Int4Linear):
            packed, group, sz = m.packed, m.group, m.scales_zeros
            self.fn = (lambda x: _int4mm(x, packed, group, sz)) if bias is None else \
                (lambda x: _int4mm(x, packed, group, sz).add_(bias))
            self.dtype, self.out_features = torch.bfloat16, m.out_features
        elif isinstance(m, Int8Linear):
            q, scale = m.q, m.scale
            self.fn = (lambda x: _int8mm(x, q, scale)) if bias is None else (lambda x: _int8mm(x, q, scale).add_(bias))
            self.dtype, self.out_features = torch.bfloat16, m.out_features
        elif isinstance(m, (CastLinear, nn.Linear)):
            w, b = m.weight, (None if bias is None else bias.to(m.weight.dtype))
            self.fn = lambda x: F.linear(x, w, b)
            self.dtype, self.out_features = w.dtype, w.shape[0]
        else:
            raise TypeError(f"no decode kernel for {type(m).__name__}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x.to(self.dtype))


def _decode_module(m: nn.Module) -> nn.Module:
    """The module a decode step runs for projection `m` (a PhaseLinear's decode copy, or m itself)."""
    return m.decode if isinstance(m, PhaseLinear) else m


class _Side:
    """Separate kernels run side by side with outputs concatenated: the lossless fp32 mode, whose
    q/k/v and gate/up weights have no fused decode copy (one more op, no second copy of them)."""

    __slots__ = ("kernels", "dtype", "out_features")

    def __init__(self, kernels: list[Kernel]) -> None:
        self.kernels = kernels
        self.dtype = kernels[0].dtype
        self.out_features = sum(k.out_features for k in kernels)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([k(x) for k in self.kernels], dim=-1)


def _group_modules(parent: nn.Module, names: tuple[str, ...]) -> list[nn.Module]:
    """The decode module(s) computing projections `names` of `parent` side by side: [their shared
    fused module] when there is one, else each projection's own."""
    mods = [_decode_module(getattr(parent, n)) for n in names]
    if all(isinstance(m, Slice) for m in mods) and len({id(m.shared) for m in mods}) == 1:
        return [mods[0].shared.fused]
    return mods


def _group(parent: nn.Module, names: tuple[str, ...]) -> Kernel | _Side:
    """The kernel(s) computing projections `names` of `parent` side by side (_group_modules)."""
    mods = _group_modules(parent, names)
    return Kernel(mods[0]) if len(mods) == 1 else _Side([Kernel(m) for m in mods])


def _rotate_half_matrix(hd: int, dtype: torch.dtype, rd: int | None = None) -> torch.Tensor:
    """R [hd, hd] with x @ R = rotate_half(x) = cat(-x2, x1) (HF Llama's RoPE convention) over x's
    first rd features (default hd) and 0 over the rest, which a partial RoPE passes through."""
    h = (hd if rd is None else rd) // 2
    r = torch.zeros(hd, hd, dtype=dtype)
    r[torch.arange(h) + h, torch.arange(h)] = -1.0  # out[j] = -x[j + h] for j < h
    r[torch.arange(h), torch.arange(h) + h] = 1.0  # out[j + h] = x[j]
    return r


class _Layer:
    """One layer's weights as the lean step uses them (plain attributes: no module machinery)."""

    __slots__ = ("idx", "in_norm", "post_norm", "eps", "qkv", "o", "gate_up", "down", "ffn", "F", "whole", "attn",
                 "module_attn")


def supported_attention(attn, native: bool = False) -> bool:
    """Whether the lean step can run this attention module: models/layers.Attention with any of its
    options (q/k/v bias, sliding window, q/k norms per head or over the projection, q/k/v clip). A
    window of the layer's own (gpt-oss's sliding layers, ModelConfig.local_window) and gpt-oss's
    attention sinks (models/gpt_oss.SinkAttention) only in the native step (`native`:
    DecodeStep.set_attention); the torch-op step runs such layers as their modules."""
    from tiered.models.gemma import GemmaAttention
    from tiered.models.gpt_oss import SinkAttention

    if type(attn) is Attention and attn.local_window is None:
        return True
    return native and type(attn) in (Attention, SinkAttention, GemmaAttention)


def _qk_extras(attn, qkv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q, k, v [B, (H + 2 Hkv) hd] (one row per sequence) as models/layers.Attention has them
    before RoPE: in the model's `dtype`, q/k normalized over the whole projection (OLMoE), clipped
    (clip_qkv), normalized per head (Qwen3). A copy when any applies, else qkv itself."""
    if attn.q_norm is None and attn.clip_qkv is None:
        return qkv
    B, H, Hkv, hd = qkv.shape[0], attn.H, attn.Hkv, attn.hd
    q, k, v = qkv.to(dtype).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
    if attn.q_norm is not None and not attn.qk_norm_per_head:
        q, k = attn.q_norm(q), attn.k_norm(k)
    if attn.clip_qkv is not None:
        c = attn.clip_qkv
        q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
    if attn.q_norm is not None and attn.qk_norm_per_head:
        q, k = attn.q_norm(q.reshape(B, H, hd)).view(B, -1), attn.k_norm(k.reshape(B, Hkv, hd)).view(B, -1)
    return torch.cat([q, k, v], dim=-1)


def _native_group(parent: nn.Module, names: tuple[str, ...]) -> list:
    """The native kernels (kernels/linear.kernel_for) of _group_modules(parent, names)."""
    return [kernel_for(m) for m in _group_modules(parent, names)]


def _native_moe(block, dtype: torch.dtype) -> dict | None:
    """DecodeStep.set_moe's keyword arguments after the layer for a MoE block the native step can run
    whole, or None: the block then runs as its module. They are the router's weight [E, D] (fp32 or
    the model's dtype, widened exactly), top_k, norm_topk_prob, ext.BoundExperts (every expert's
    kernels), the shared expert's gate/up and down kernels and its gate's ([1, D]; none for DeepSeek's
    ungated shared experts), or empty lists, and DeepSeek's routing (models/deepseek.DeepSeekRouter):
    method (its topk_method: "greedy", "group_limited_greedy" or "noaux_tc"), n_group, topk_group,
    scaling (routed_scaling_factor) and bias (noaux_tc's e_score_correction_bias fp32 [E]), and amx_rows (the
    rows an expert averages in a call from which the step's experts take the AMX GEMM: ExpertFormat.group_rows,
    0 for none); from
    DeepSeek-V2 (arXiv 2405.04434) §2.2 and, for noaux_tc, DeepSeek-V3 (arXiv 2412.19437) §2.1.2.

    It can when the block has the standard router (models/moe.Router) or DeepSeek's (no other
    subclass), a plain SwiGLU shared expert with a bias-free gate or none (if any), the model computes
    in float32 or bfloat16, and its runner (runtime/moe_runner.TieredExperts) keeps every expert of the
    layer resident in RAM in one format (its one-call layers, `_layer_calls`), with no accelerator,
    prefetcher or mixed-precision copies: nothing it would decide per step. TIERED_NATIVE_MOE=0: None
    (every MoE block its module, to compare the two)."""
    from tiered.models.deepseek import DeepSeekRouter
    from tiered.models.gpt_oss import GptOssRouter
    from tiered.models.moe import MoEBlock, Router
    from tiered.runtime.moe_runner import TieredExperts

    if (not isinstance(block, MoEBlock) or type(block.gate) not in (Router, DeepSeekRouter, GptOssRouter)
            or os.environ.get("TIERED_NATIVE_MOE", "1") in ("0", "false", "no", "off")):
        return None
    gate = block.gate
    args = dict(router=gate.weight, top_k=gate.top_k, norm_topk_prob=gate.norm_topk_prob)
    if type(gate) is GptOssRouter:  # its bias; its top-k softmax is the full softmax's top k renormalized
        args.update(router_bias=gate.bias.detach())
    if type(gate) is DeepSeekRouter:
        grouped = gate.method != "greedy" and gate.n_group > 1
        if grouped and gate.top_k > gate.topk_group * (gate.out_features // gate.n_group):
            return None  # fewer experts in the kept groups than top_k: torch.topk's pick among masked ties
        bias = gate.e_score_correction_bias
        args.update(method=gate.method, n_group=gate.n_group if grouped else 1,
                    topk_group=gate.topk_group if grouped else 1, scaling=gate.scaling,
                    bias=None if bias is None else bias.detach())
    if block.shared_expert is not None:
        gated = block.shared_expert_gate is not None
        if type(block.shared_expert) is not MLP or (gated and block.shared_expert_gate.bias is not None):
            return None
        se = block.shared_expert
        args.update(shared_gate_up=_native_group(se, ("gate_proj", "up_proj")),
                    shared_down=[kernel_for(_decode_module(se.down_proj))],
                    shared_gate=[kernel_for(_decode_module(block.shared_expert_gate))] if gated else [])
    r = block.runner
    if (dtype not in (torch.float32, torch.bfloat16) or not isinstance(r, TieredExperts) or r.accelerator is not None
            or r.prefetcher is not None or r.low is not None or block.layer_idx not in r._layer_calls):
        return None
    bound = r.fmt.bind_layer([r.store.resident[(block.layer_idx, e)] for e in range(r.num_experts)])
    if bound is None:
        return None
    # the rows an expert averages from which the step computes its experts on the AMX GEMM where their kernels have
    # it (tiled int4 and mxfp4: gemv.cpp's moe_experts_amx), as the modules' prefill does past group_rows; 0 where
    # they have none (the step then gathers no rows for it)
    return dict(args, experts=bound, amx_rows=r.fmt.amx_rows, **r.fmt.glu_args)  # gpt-oss's: their clamped GLU


def _native_latent(layer: nn.Module, dtype: torch.dtype) -> dict | None:
    """DecodeStep.set_latent's keyword arguments for a DeepSeek layer whose latent attention the native
    step runs (its absorbed decode form: models/deepseek.LatentAttention, DeepSeek-V2 arXiv 2405.04434
    §2.1 and Appendix C), or None: the layer then runs whole as its modules.

    It runs when the model computes in float32 or bfloat16 and the absorbed products have weights the
    step reads: install_absorbed's bf16 per-head kernels (W_UK^T [R, n], W_UV [v, R]: one-copy mode,
    bf16 engines), or else kv_b_proj's own fp32 weight [H (n + v), R] read in place (the lossless fp32
    mode: no copy, the module's fp32 products). The projections are their decode kernels
    (kernels/linear.kernel_for), the norms' weights widened to fp32. TIERED_NATIVE_MLA=0: None."""
    from tiered.models.deepseek import LatentAttention

    attn = layer.self_attn
    if (type(attn) is not LatentAttention or dtype not in (torch.float32, torch.bfloat16)
            or os.environ.get("TIERED_NATIVE_MLA", "1") in ("0", "false", "no", "off")):
        return None
    w = attn.kv_b_proj.weight
    if attn.absorbed is not None:
        uk, uv, kv_b = attn.absorbed[0], attn.absorbed[1], torch.empty(0)
    elif w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous():
        uk, uv, kv_b = [], [], w.detach()
    else:
        return None

    def k(m):
        return [kernel_for(_decode_module(m))]

    lora = attn.q_proj is None  # q_a_proj -> q_a_layernorm -> q_b_proj (DeepSeek-V3, V2), else q_proj (V2-Lite)
    return dict(q=[] if lora else k(attn.q_proj), q_a=k(attn.q_a_proj) if lora else [],
                q_a_norm=attn.q_a_layernorm.weight if lora else torch.empty(0),
                q_a_eps=attn.q_a_layernorm.eps if lora else 0.0, q_b=k(attn.q_b_proj) if lora else [],
                kv_a=k(attn.kv_a_proj_with_mqa), kv_a_norm=attn.kv_a_layernorm.weight, kv_a_eps=attn.kv_a_layernorm.eps,
                uk=uk, uv=uv, kv_b=kv_b, scale=attn.scale, interleave=attn.interleave)


def cast_bf16_linears(module: nn.Module) -> None:
    """Swap the plain bf16 nn.Linear layers under `module` (a part the decode step runs as modules:
    DeepSeek's latent-attention layers, module-run MoE blocks' shared experts) for CastLinears over the
    same tensors, whose one-token calls take tiered's native bf16 kernel instead of torch's bf16 GEMV
    (~47 against ~27 GB/s on 2 Zen 4 cores; with the absorbed kernels a bf16 engine now also gets, a
    4-layer DeepSeek-V2-Lite-shaped bf16 model decoded 27.7 -> 37.6 tok/s, benchmarks/deepseek_moe.py).
    On a CPU without a bf16 GEMM the whole model's (runtime/install): their prompts then run torch's fp32
    GEMM over the converted weight (hardware/cpu_gemm.linear). No copy: the parameters are shared."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            w = getattr(child, "weight", None)
            if type(child) is nn.Linear and w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.is_contiguous():
                setattr(parent, name, CastLinear(w, child.bias))


def _native_step(native, model: nn.Module, layers: list) -> tuple[object, list, list]:
    """The C++ DecodeStep for `model` and its schedules: ("native", first, last) runs of layers the
    step runs whole, ("attn", i) for a layer whose FFN is a module, ("whole", i) for one the step
    cannot run. The first schedule runs MoE blocks in the step (DecodeStep.set_moe) where every MoE
    layer allows it (_native_moe), else equals the second, which runs every MoE block as its module
    (routing hooks: MoEBlock.on_route). Latent-attention layers (_native_latent) are step layers
    (DecodeStep.set_latent) like plain ones: "native" with a dense MLP or a MoE block the step runs,
    "attn" with a MoE block it does not."""
    cfg = model.config
    dtype = model.model.norm.weight.dtype  # the residual stream's (the final norm keeps the model dtype)
    # latent attention: one cache "head" of R + r per layer (ModelConfig.kv_widths), r = head_dim
    step = native.DecodeStep(cfg.hidden_size, cfg.num_attention_heads, 1 if cfg.is_mla else cfg.num_key_value_heads,
                             cfg.head_dim, cfg.attn_scale, cfg.sliding_window or 0, cfg.rotary_dim)
    step.set_activation(cfg.hidden_act)
    # a prompt's rows over a bf16 cache attend in bf16 where the modules' prompts do (Plan.dtypes["prompt_attention"]
    # through layers.set_prompt_attention, or a bf16 model): on the AMX attention where it runs
    if dtype == torch.bfloat16 or any(getattr(layer.self_attn, "prompt_dtype", None) == torch.bfloat16
                                      for _, layer in layers):
        step.set_prompt_attention_bf16(True)
    latent = {}  # layer -> _native_latent's arguments
    moe = {}  # layer -> _native_moe's arguments
    for L, layer in layers:
        if L.whole and (args := _native_latent(layer, dtype)) is not None:
            latent[L.idx] = args
        if L.ffn is not None and (not L.whole or L.idx in latent):  # an FFN after the step's attention
            moe[L.idx] = _native_moe(L.ffn, dtype)
    if not moe or None in moe.values():  # all MoE layers in the step, or none (one token count per step)
        moe = {}
    schedule: list = []
    fallback: list = []
    for L, layer in layers:
        i = L.idx
        attn = layer.self_attn
        if i in latent:  # the attention half in the step, the FFN too when it is a plain MLP
            plain = type(layer.mlp) is MLP
            step.add_layer(L.in_norm, L.post_norm, L.eps, [], [kernel_for(_decode_module(attn.o_proj))],
                           _native_group(layer.mlp, ("gate_proj", "up_proj")) if plain else [],
                           [kernel_for(_decode_module(layer.mlp.down_proj))] if plain else [])
            step.set_latent(i, **latent[i])
        elif L.whole:
            schedule.append(("whole", i))
            fallback.append(("whole", i))
            step.add_layer(L.in_norm, L.post_norm, L.eps, [], [], [], [])  # a placeholder: never run
            continue
        else:
            plain = L.ffn is None
            step.add_layer(L.in_norm, L.post_norm, L.eps, _native_group(attn, ("q_proj", "k_proj", "v_proj")),
                           [kernel_for(_decode_module(attn.o_proj))],
                           _native_group(layer.mlp, ("gate_proj", "up_proj")) if plain else [],
                           [kernel_for(_decode_module(layer.mlp.down_proj))] if plain else [])
        if i not in latent and (attn.local_window is not None or getattr(attn, "sinks", None) is not None):
            step.set_attention(i, -1 if attn.local_window is None else attn.local_window,
                               getattr(attn, "sinks", torch.empty(0)).detach())
        if i not in latent and cfg.sandwich_norms:  # Gemma: the blocks' outputs normalized before their adds
            step.set_sandwich(i, layer.post_attention_layernorm.weight, layer.post_feedforward_layernorm.weight)
        if i not in latent and getattr(attn, "local_rope", False):  # Gemma 3's sliding layers: their own RoPE
            step.set_local_rope(i)
        if i not in latent and getattr(attn, "softcap", None) is not None:  # Gemma 2's capped attention logits
            step.set_softcap(i, attn.softcap)
        if i not in latent and (attn.q_norm is not None or attn.clip_qkv is not None):
            qn, kn = ((attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm is not None
                      else (torch.empty(0), torch.empty(0)))
            step.set_qk(i, qn, kn, attn.q_norm.eps if attn.q_norm is not None else 0.0, attn.qk_norm_per_head,
                        attn.clip_qkv or 0.0)
        if i in moe:
            step.set_moe(i, **moe[i])
        for sched, whole in ((schedule, plain or i in moe), (fallback, plain)):
            if whole and sched and sched[-1][0] == "native" and sched[-1][2] == i:
                sched[-1] = ("native", sched[-1][1], i + 1)
            else:
                sched.append(("native", i, i + 1) if whole else ("attn", i))
    step.set_head(model.model.norm.weight, model.model.norm.eps, kernel_for(_decode_module(model.lm_head)))
    return step, schedule, fallback


class CPUDecodeStep:
    """Decode step (T = 1 new token per sequence) of a dense or MoE CausalLM on the CPU.

    Args:
        model: a placed CausalLM (models/llama.py or models/moe.py) on the CPU, its decode copies
            installed (or not: the fp32 lossless mode).
        native: run the step in C++ (tiered/kernels: Plan.native_decode); raises RuntimeError when
            the extension is not available.
    Call:
        (input_ids int64 [B, 1], positions int64 [B, 1], slots int64 [B], cache KVCache, rows=None)
        -> logits [B, V] in the lm_head kernel's dtype (fp32 when native), equal to `model(...)`
        up to the rounding of the kernel-dtype activations between fused kernels. `rows` (int64
        [R], optional) computes the lm_head for those rows only: logits [R, V].

    Rows are (slot, position) pairs. Where `takes_prefill_rows(cache)`, several rows may belong to
    one sequence at consecutive positions (a prompt's uncached tokens joining a decode step,
    Sarathi's chunked prefill / vLLM's mixed batches): every row's K and V are written before any
    row attends, and a row at position p attends to positions <= p of its slot. Elsewhere each
    slot appears at most once.
    """

    def __init__(self, model: nn.Module, native: bool = False) -> None:
        cfg = model.config
        self.model = model
        self.H, self.Hkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rd = cfg.rotary_dim  # RoPE's width (< hd: a partial RoPE's, GLM-4.5)
        self.scale = self.hd ** -0.5
        self.gqa = self.H != self.Hkv
        self.sliding_window = cfg.sliding_window
        self.layers = []
        for i, layer in enumerate(model.model.layers):
            L = _Layer()
            L.idx, L.whole = i, not supported_attention(layer.self_attn, native)
            L.module_attn = not supported_attention(layer.self_attn)  # the torch-op step runs the layer whole
            L.in_norm, L.post_norm = layer.input_layernorm.weight, layer.ffn_norm.weight
            L.eps = layer.input_layernorm.eps
            L.qkv = L.o = L.gate_up = L.down = L.ffn = L.attn = None
            L.F = 0
            if L.whole and type(layer.mlp) is not MLP:  # the FFN module of a latent layer the native step runs
                L.ffn = layer.mlp
            if not L.whole:
                attn = L.attn = layer.self_attn
                L.qkv = _group(attn, ("q_proj", "k_proj", "v_proj"))
                L.o = Kernel(_decode_module(attn.o_proj))
                if type(layer.mlp) is MLP:
                    L.gate_up = _group(layer.mlp, ("gate_proj", "up_proj"))
                    L.down = Kernel(_decode_module(layer.mlp.down_proj))
                    L.F = L.gate_up.out_features // 2
                else:
                    L.ffn = layer.mlp
            self.layers.append((L, layer))
        self.final_norm = model.model.norm.weight
        self.final_eps = model.model.norm.eps
        self.embed = model.model.embed_tokens
        self.lm_head = Kernel(_decode_module(model.lm_head))
        self.rot = _rotate_half_matrix(self.hd, torch.float32, self.rd)
        self.native = self.schedule = self.fallback = None
        self.moe_blocks: list = []
        if native:
            from tiered import kernels

            ext = kernels.load()
            if ext is None:
                raise RuntimeError(f"native decode step: tiered/kernels unavailable ({kernels.failure() or 'TIERED_NATIVE=0'})")
            self.native, self.schedule, self.fallback = _native_step(ext, model, self.layers)
            for L, layer in self.layers:  # what the step runs as modules: their bf16 projections on our kernel
                if L.whole or L.ffn is not None:
                    cast_bf16_linears(layer if L.whole else L.ffn)
            # MoE blocks the step runs itself (no module call: their runner's counters are kept here)
            self.moe_blocks = [layer.mlp for L, layer in self.layers if L.ffn is not None] \
                if self.schedule != self.fallback else []
        self._burst_embed = self._burst_table() if self.native is not None else None

    def takes_prefill_rows(self, cache: KVCache) -> bool:
        """Whether a call over `cache` may carry several rows of one sequence (see the class): the
        native step running every layer's attention itself (no "whole" layer modules, whose attention
        assumes one token per slot; _native_step puts them in both schedules alike), over a cache it reads
        (native_cache). An MoE layer's FFN may be its module ("attn" segments: experts outside RAM,
        a routing hook), which takes any rows, as in a prefill."""
        return self.native_cache(cache) and all(seg[0] != "whole" for seg in self.fallback)

    def native_cache(self, cache: KVCache) -> bool:
        """Whether the native step runs over `cache`: in the model's dtype, bf16 beside an fp32 model (the
        plan's KV cache under lossy decode copies, memory/sizes.kv_cache_format), or int8 (KVCache.quantized)
        beside an fp32 or bf16 one."""
        kv, model = cache.k.dtype, self.final_norm.dtype
        return self.native is not None and (kv == model or (kv == torch.bfloat16 and model == torch.float32)
                                            or (kv == torch.int8 and model in (torch.float32, torch.bfloat16)))

    def rows_call(self, feed, cache: KVCache) -> torch.Tensor:
        """One call over rows of (token, position, slot) built from `feed`: each entry (tokens, first position,
        slot, kept) puts its tokens at consecutive positions of its slot (a prompt or its chunk, a decode token
        after its forced ones and before its drafts, a draft model's catch-up); returns the logits [sum of kept, V]
        of each entry's last `kept` rows, in order (LLM._forward_mixed, speculative.DraftModel)."""
        ids, positions, slots, last = [], [], [], []
        for toks, start, slot, kept in feed:
            ids += toks
            positions += range(start, start + len(toks))
            slots += [slot] * len(toks)
            last += range(len(ids) - kept, len(ids))
        return self(torch.tensor(ids).unsqueeze(1), torch.tensor(positions).unsqueeze(1), torch.tensor(slots), cache,
                    rows=torch.tensor(last))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 cache: KVCache, rows: torch.Tensor | None = None) -> torch.Tensor:
        if self.native_cache(cache):
            return self._native_call(input_ids, positions, slots, cache, rows)
        meta = build_attention_metadata(self.model.rotary, positions, slots, self.sliding_window)
        B = input_ids.shape[0]
        x = self.model.embed(input_ids).view(B, -1)  # [B, D] residual stream, model dtype
        cos, sin = meta.cos.view(B, 1, self.rd), meta.sin.view(B, 1, self.rd)
        if self.rd != self.hd:  # partial RoPE: cos 1 and sin 0 past rd (self.rot is 0 there) pass those through
            cos, sin = F.pad(cos, (0, self.hd - self.rd), value=1.0), F.pad(sin, (0, self.hd - self.rd))
        for L, layer in self.layers:
            if L.whole or L.module_attn:
                x = layer(x.view(B, 1, -1), meta, cache).view(B, -1)
                continue
            x.add_(self._attention(L, x, meta, cache, cos, sin))  # in place: the residual keeps its dtype
            h = F.rms_norm(x, x.shape[-1:], L.post_norm, L.eps)
            if L.ffn is not None:
                x = x + L.ffn(h.view(B, 1, -1)).view(B, -1)
                continue
            gu = L.gate_up(h)
            x.add_(L.down(F.silu(gu[:, :L.F]) * gu[:, L.F:]))
        h = F.rms_norm(x if rows is None else x[rows], x.shape[-1:], self.final_norm, self.final_eps)
        return self.model.softcap(self.lm_head(h))

    def _native_call(self, input_ids, positions, slots, cache: KVCache, rows=None) -> torch.Tensor:
        B = input_ids.shape[0]
        pos = positions.view(B)
        x = self.model.embed(input_ids).view(B, -1).contiguous()  # [B, D] residual stream, model dtype
        rot = self.model.rotary
        rot.cover(pos)  # (a lazy table's rows: Rotary.ensure)
        cos, sin = rot.cos[pos], rot.sin[pos]  # [B, rd] fp32
        # the local layers' own RoPE (Gemma 3's sliding layers), or none
        local = {} if rot.local_cos is None else dict(local_cos=rot.local_cos[pos], local_sin=rot.local_sin[pos])
        meta = None
        schedule = self.schedule
        if self.moe_blocks and any(b.on_route is not None for b in self.moe_blocks):
            schedule = self.fallback  # a routing hook sees every layer's routing: the modules run
        for seg in schedule:
            if seg[0] == "native":
                self.native.forward(x, cos, sin, slots, pos, cache.k, cache.v, seg[1], seg[2], **local)
                continue
            i = seg[1]
            L, layer = self.layers[i]
            if seg[0] == "attn":  # the step's attention, its post-attention norm, then the FFN module
                h = torch.empty_like(x)
                self.native.forward(x, cos, sin, slots, pos, cache.k, cache.v, i, i + 1, moe=False, post_norm=h, **local)
                x = (x + L.ffn(h.view(B, 1, -1)).view(B, -1)).contiguous()
            else:
                if meta is None:
                    meta = build_attention_metadata(self.model.rotary, positions, slots, self.sliding_window)
                x = layer(x.view(B, 1, -1), meta, cache).view(B, -1).contiguous()
        if schedule is self.schedule:
            self._count_moe_uses()
        return self.model.softcap(self.native.logits(x if rows is None else x[rows]))

    def _count_moe_uses(self) -> None:
        """Add the resident expert uses of the native step's MoE layers since the last call (DecodeStep
        .take_moe_uses) to their runner's counters: those layers used resident experts only."""
        if self.moe_blocks:
            runner = self.moe_blocks[0].runner
            uses = self.native.take_moe_uses()
            runner.resident_hits += uses
            runner.path_counts[RESIDENT] += uses

    def _burst_table(self) -> tuple[torch.Tensor, bool] | None:
        """(the embedding table the native burst reads, whether it is GGUF Q8_0 blocks), or None where
        the burst cannot read it (a BlockEmbedding of another block format)."""
        from tiered.quant.embedding import BlockEmbedding

        if self.model.config.embed_scale != 1.0:  # the burst reads the table's rows unscaled
            return None
        if isinstance(self.embed, BlockEmbedding):
            return None if self.embed._table is None else (self.embed._table, True)
        if type(self.embed) is nn.Embedding and self.embed.weight.is_contiguous():
            return self.embed.weight.detach(), False
        return None

    def can_burst(self, cache: KVCache) -> bool:
        """Whether `burst` runs over `cache`: the native step runs every layer itself (one segment, no
        module fallbacks, no routing hooks on its MoE blocks), over a cache it reads, from an embedding
        table it reads."""
        return (self._burst_embed is not None and self.native_cache(cache)
                and self.schedule == [("native", 0, len(self.layers))]
                and not any(b.on_route is not None for b in self.moe_blocks))

    def burst(self, token: int, slot: int, position: int, n: int, cache: KVCache, stop: list[int],
              seen: torch.Tensor, params, uniforms: torch.Tensor,
              interrupt: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
        """Up to `n` decode steps of one sequence in one native call (DecodeStep.burst), each on the
        token the one before drew: `token` at `position` of `slot` first. The draw is
        engine/sampling.sample_tokens': greedy (after the repetition penalty on `seen` int64 and the
        tokens drawn), the temperature alone, or the filters, at uniforms float64 [n] (one per token, from
        the request's generator). Stops after a token in `stop`, or after the token during which another
        thread made `interrupt` (int32 [1]) nonzero. Only where `can_burst(cache)`.

        Returns:
            (the tokens drawn, each token's seconds since the call began), at most n of each.
        """
        from tiered.engine.sampling import MIN_TOP_P, plain_draw

        table, q8_0 = self._burst_embed
        dtype = self.embed.dtype if q8_0 else table.dtype
        x = torch.empty(1, self.final_norm.shape[-1], dtype=dtype)
        rot = self.model.rotary
        rot.ensure(position + n)  # the burst reads the tables' rows of its positions
        greedy = params.greedy
        tokens, seconds = self.native.burst(
            token, slot, position, n, table, q8_0, x, rot.cos, rot.sin, cache.k, cache.v,
            torch.tensor(stop, dtype=torch.long), seen, params.repetition_penalty,
            0.0 if greedy else params.temperature, params.top_k, max(params.top_p, MIN_TOP_P), params.min_p,
            plain_draw(params), uniforms, interrupt)
        self._count_moe_uses()
        return tokens.tolist(), seconds.tolist()

    def _attention(self, L: _Layer, x, meta: AttentionMetadata, cache: KVCache, cos, sin) -> torch.Tensor:
        B, H, Hkv, hd = x.shape[0], self.H, self.Hkv, self.hd
        h = F.rms_norm(x, x.shape[-1:], L.in_norm, L.eps)
        qkv = _qk_extras(L.attn, L.qkv(h), x.dtype)  # [B, (H + 2 Hkv) hd] kernel dtype (model dtype with q/k norms or clip)
        # RoPE on q and k at once, [B, H + Hkv, hd], in fp32 like the tables (a tiny bf16 matmul costs
        # ~4x an fp32 one on the CPU), then in the model's dtype
        qk = qkv[:, :(H + Hkv) * hd].view(B, H + Hkv, hd).float()
        qk = torch.addcmul(qk * cos, qk @ self.rot, sin).to(x.dtype)
        q = qk[:, :H].unsqueeze(2)  # [B, H, 1, hd]
        k = qk[:, H:].unsqueeze(2)  # [B, Hkv, 1, hd]
        v = qkv[:, (H + Hkv) * hd:].view(B, Hkv, 1, hd)
        if meta.single is not None and not cache.quantized:  # one sequence: write its position, read the slot's prefix
            slot, pos = meta.single
            S = pos + 1
            ck, cv = cache.k[L.idx, slot], cache.v[L.idx, slot]  # [Hkv, max_len, hd]
            ck[:, pos].copy_(k[0, :, 0])
            cv[:, pos].copy_(v[0, :, 0])
            k, v = ck[None, :, :S], cv[None, :, :S]
        else:
            k, v = cache.update(L.idx, k, v, meta)
        if k.dtype != q.dtype:  # a bf16 cache beside fp32 activations (memory/sizes.kv_cache_format)
            k, v = k.to(q.dtype), v.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.mask,
                                             scale=self.scale, enable_gqa=self.gqa)
        return L.o(out.view(B, H * hd))
