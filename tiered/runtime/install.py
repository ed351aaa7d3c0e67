"""INSTALL: hand a placed model its runtime — the executor, the expert runner, the sliced FFNs and
the CPU threads, all as the Plan says.

Nothing here chooses: dispatch uses the plan's latency model and mode, sliced FFNs the plan's rates
and n_g, the CPU its planned thread count. CPU compute always runs on the calling thread (the
executor's inline "cpu" stream): torch's OpenMP team belongs to that thread, and a worker thread's
second team is slower and fights it for the cores (5.3 vs 7.0 ms per Mixtral expert on the H200's
16-core host; 1.7 vs 3.2 ms on 2 cores).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tiered.memory.apply import PlacedExperts
from tiered.models.moe import moe_blocks
from tiered.planner.plan import Plan
from tiered.runtime.executor import Executor


@dataclass
class Runtime:
    """What runs a placed model: the executor, the expert runner (MoE) and the sliced FFNs (dense)."""

    executor: Executor
    experts: object = None  # TieredExperts
    sliced: list = field(default_factory=list)
    graphs: object = None  # DecodeGraphs / PiecewiseGraphs: graphed decode steps (plan.decode_graphs / piecewise_graphs)
    cpu_decode: object = None  # CPUDecodeStep: the lean CPU decode step (plan.cpu_decode_step)

    def new_sequence(self) -> None:
        """A new sequence starts: the expert cache's usage records and the prefetcher's predictions reset."""
        if self.experts is not None:
            if self.experts.prefetcher is not None:
                self.experts.prefetcher.new_sequence()
            self.experts.cache.new_sequence()
            if self.experts.low is not None:  # HOBBIT: both precision pools reset their usage per sequence
                self.experts.low.cache.new_sequence()


def install_runtime(plan: Plan, model, accelerator, *, placed: PlacedExperts | None = None, sliced_weights=None,
                    n_g=None, host_budget=None, trace: bool = False) -> Runtime:
    """Install the plan's runtime on `model`.

    Args:
        placed: the experts as memory/apply.place_experts built them (MoE models).
        sliced_weights: layer -> (gate [F, D], up [F, D], down [D, F]) on the CPU, for the layers
            the plan slices (read from the checkpoint; never materialized whole on the device).
        n_g: n_g(layer, T) for the sliced layers (planner/auto.token_assignment).
        host_budget: MemoryBudget for the CPU-side slices.
        trace: record a timeline of every task, plus attention and FFN spans of each layer.
    Raises:
        BudgetError: the sliced parts do not fit their budgets.
    """
    if plan.cpu_threads:
        torch.set_num_threads(plan.cpu_threads)
    readers = max(2, plan.staging_buffers)
    executor = Executor(accelerator, disk_readers=readers, trace=trace, inline=("cpu",))
    rt = Runtime(executor)
    if placed is not None:
        from tiered.runtime.moe_runner import TieredExperts
        rt.experts = TieredExperts(placed, executor, plan.latency_model(), accelerator, plan.dispatch_mode,
                                   read_ahead=plan.read_ahead, group_layers=plan.native_decode,
                                   device_issue=plan.device_issue)
        for block in moe_blocks(model):
            block.runner = rt.experts
        if plan.prefetch:
            from tiered.runtime.prefetch import Prefetcher, StackedGates
            rt.experts.prefetcher = Prefetcher(StackedGates(model, plan.prefetch_lookahead), placed.cache, placed.store,
                                               executor, accelerator, max_inflight=readers - 1, low=placed.low)
    sliced = plan.sliced_layers() if accelerator is not None else {}
    if sliced:
        from tiered.runtime.sliced import install_sliced_mlps
        rt.sliced = install_sliced_mlps(model, sliced, accelerator, executor, n_g=n_g or 0, weights=sliced_weights,
                                        host_budget=host_budget, device_issue=plan.device_issue)
    if plan.fused_projections and accelerator is not None:
        fuse_projections(model, trim=accelerator.trim)
    if (plan.decode_graphs or plan.piecewise_graphs) and accelerator is not None and not trace:
        from tiered.runtime.graphs import DecodeGraphs, PiecewiseGraphs
        rt.graphs = (DecodeGraphs if plan.decode_graphs else PiecewiseGraphs)(model, accelerator,
                                                                              model.config.sliding_window)
    if accelerator is None:
        from tiered.hardware.cpu_gemm import bf16_gemm_native

        if not bf16_gemm_native():  # AVX2 only: a bf16 engine's plain projections upcast their prompts' GEMMs
            from tiered.runtime.cpu_decode import cast_bf16_linears

            cast_bf16_linears(model)  # (on 2 Zen 3 cores SmolLM2's 512-token bf16 prompt: 5.8 s in torch's bf16 GEMM)
    # prompts attend in the KV cache's format, and keep their FFN's intermediate in its GEMMs', where the plan says
    from tiered.memory.sizes import torch_dtype
    from tiered.models.layers import set_prompt_attention, set_prompt_ffn

    for part, apply in (("prompt_attention", set_prompt_attention), ("prompt_ffn", set_prompt_ffn)):
        dtype = plan.dtypes.get(part)
        if dtype and dtype != plan.dtypes.get("weights"):
            apply(model, torch_dtype(dtype))
    if plan.cpu_decode_step and accelerator is None and not trace:  # the trace wants the modules' spans
        from tiered.runtime.cpu_decode import CPUDecodeStep
        rt.cpu_decode = CPUDecodeStep(model, native=plan.native_decode)
    if trace:
        _trace_layers(model, executor)
    if accelerator is not None:  # what the load freed (placement's temporaries, fused parts) goes back
        accelerator.trim()
    return rt


def fuse_projections(model, trim: Callable[[], None] | None = None) -> int:
    """Give each attention one q/k/v GEMM and each dense MLP on the device one gate/up GEMM
    (Attention.fuse_qkv, MLP.fuse_gate_up: the parameters become views of the fused weight, no
    second copy). A layer then launches 3 GEMMs and 6 RoPE ops fewer (gpt-fast's wqkv): a GPU
    decode step is made of such launches. Sliced FFNs and experts keep their own weights.
    `trim` (Accelerator.trim) runs after each module fused: the parts it freed go back to the driver
    instead of staying reserved (no later fused weight fits in them), so the load reserves at most one
    module's fused weight beyond what it allocates. Returns the number of modules fused."""
    from tiered.models.layers import MLP, Attention

    n = 0
    for m in model.modules():
        fused = m.fuse_qkv() if isinstance(m, Attention) else m.fuse_gate_up() if isinstance(m, MLP) else False
        if fused and trim is not None:
            trim()
        n += fused
    return n


def _trace_layers(model, executor: Executor) -> None:
    """Record each layer's attention and FFN / MoE block (router included) as "main" spans of the trace
    (host time while the work is issued), so the gaps between the runtime's own tasks are visible."""
    import time

    def span(name: str, layer: int):
        def pre(_m, _args):
            _m.__dict__["_t0"] = time.perf_counter()

        def post(_m, _args, _out):
            executor.record(name, "main", _m.__dict__.pop("_t0"), time.perf_counter(), layer=layer)
        return pre, post

    for i, layer in enumerate(model.model.layers):
        for name, mod in (("attention", layer.self_attn), ("ffn", layer.mlp)):
            if isinstance(mod, torch.nn.Module):
                pre, post = span(f"{name} L{i}", i)
                mod.register_forward_pre_hook(pre)
                mod.register_forward_hook(post)
