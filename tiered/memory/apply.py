"""PLACE: apply a Plan — materialize each weight on the tier the plan gives it.

`place_weights` fills the model's non-expert (and unsliced) parameters on the compute tier and the
decode-format copies the plan asks for; `place_experts` builds the experts' home copies (fast tier,
CPU RAM or disk, as `Plan.layers[i].expert_tiers` says), the expert cache with the plan's slots and
policy, and the staging rings. Every byte is reserved against its tier's budget before it is
allocated; nothing here decides where anything goes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiered.hardware.budget import MemoryBudget, move_to_huge_pages
from tiered.memory import sizes
from tiered.memory.expert_cache import ExpertCache, make_policy
from tiered.memory.expert_store import ExpertStore, expert_tensor_names
from tiered.memory.materialize import materialize
from tiered.planner.plan import Plan
from tiered.quant.experts import ExpertFormat, fit_format, parse_kinds


def expert_format(name: str, checkpoint, layer: int, accelerator, batch_act: str = "bf16",
                  act: str = "bf16", group_rows: int = 0) -> ExpertFormat:
    """The ExpertFormat of plan format `name` for the checkpoint's expert shapes. int4 codes are
    kept in the portable layout when a CUDA device computes them, else in the tiled layout of the
    native CPU kernel (torch's CPU kernel layout when the extension is not built). Native int4
    calls read `act` activations at one row (Plan.expert_act), `batch_act` from two (Plan.batch_act);
    `group_rows` > 0 caps the rows of the kernel's groups (Plan.expert_group_rows)."""
    from tiered.kernels import available

    shapes = [tuple(checkpoint.handle(n).shape) for n in expert_tensor_names(checkpoint.config.model_type, layer, 0)]
    cuda = accelerator is not None and getattr(accelerator.device, "type", "") == "cuda"
    fitted = fit_format(name, shapes)
    cfg = checkpoint.config
    return ExpertFormat(fitted, shapes, "plain" if cuda else "tiled" if available() else "cpu", batch_act, act,
                        exact_int4_zeros(checkpoint, parse_kinds(fitted)), cfg.swiglu_limit, cfg.swiglu_alpha,
                        group_rows)


def exact_int4_zeros(checkpoint, kinds) -> bool:
    """Whether every int4 projection of every routed expert comes from GGUF Q4_0 blocks (w = d (q - 8):
    zero 0, exact in bf16, so every zero residual is 0: ExpertFormat.exact_zeros). Expert tensors
    are stored per layer, so expert 0's handles of each MoE layer say it for the layer."""
    from tiered.memory.expert_store import moe_layers

    if "int4" not in kinds:
        return False
    cfg = checkpoint.config
    for layer in moe_layers(checkpoint, cfg):
        names = expert_tensor_names(cfg.model_type, layer, 0)
        if any(k == "int4" and checkpoint.handle(n).format != "Q4_0" for n, k in zip(names, kinds)):
            return False
    return True


class StagingBuffer(tuple):
    """One expert's staging tensors (a tuple, as a slot is) carved from one flat byte buffer
    `flat`, so a smaller low-precision expert can use the same memory."""

    flat: torch.Tensor


def staging_buffer(alloc, fmt: ExpertFormat, what: str) -> StagingBuffer:
    """A StagingBuffer for one expert of `fmt`: one uint8 allocation of fmt.nbytes, viewed as the
    format's slot tensors."""
    flat = alloc((fmt.nbytes,), torch.uint8, what)
    views, off = [], 0
    for shape in fmt.slot_shapes:
        n = torch.Size(shape).numel() * torch.empty((), dtype=fmt.slot_dtype).element_size()
        views.append(flat[off:off + n].view(fmt.slot_dtype).view(shape))
        off += n
    buf = StagingBuffer(views)
    buf.flat = flat
    return buf


class StagingPool:
    """A ring of expert-sized buffers; each use waits for the previous user's completion future."""

    def __init__(self, buffers: list[tuple[torch.Tensor, ...]]) -> None:
        self.buffers = buffers
        self.busy: list = [None] * len(buffers)
        self.next = 0

    def take(self):
        """(buffer tuple, future it must wait for or None, index to `release_after`)."""
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        return self.buffers[i], self.busy[i], i

    def release_after(self, i: int, fut) -> None:
        self.busy[i] = fut


@dataclass
class LowPrecision:
    """HOBBIT's low-precision side: the low copies of offloaded experts, their own cache pool, and
    the view of a (shared) staging buffer that holds one low expert."""

    mixed: object  # runtime/precision.MixedPrecision
    store: ExpertStore
    cache: ExpertCache

    def view(self, buffers: StagingBuffer) -> tuple[torch.Tensor, ...]:
        """The first `store.expert_bytes` bytes of a high-precision staging buffer, as a low slot."""
        return (buffers.flat[:self.store.expert_bytes],)


@dataclass
class PlacedExperts:
    """The experts as placed: home copies, the fast-tier cache and the staging rings (and, with
    mixed precision, the low-precision copies and cache)."""

    store: ExpertStore
    cache: ExpertCache
    fast_staging: StagingPool
    host_staging: StagingPool | None
    low: LowPrecision | None = None

    def close(self) -> None:
        """Close the stores' converted files (ExpertStore.close; LLM.close)."""
        self.store.close()
        if self.low is not None:
            self.low.store.close()


def place_weights(plan: Plan, model, checkpoint, accelerator, fast_budget: MemoryBudget,
                  on_tensor=None) -> tuple[int, int]:
    """Materialize the model's parameters that live in the model (not routed experts, not the FFNs
    of sliced layers) in plan.dtypes["weights"] on the accelerator (the CPU when None), and the
    decode-format copies when plan.dtypes["decode"] names a format.

    Returns:
        (bytes of dense weights, bytes of decode copies).
    Raises:
        BudgetError: the fast tier cannot hold them (checked from byte counts before any read).
        CheckpointError: a tensor is missing or mis-shaped.
    """
    cfg = checkpoint.config
    fmt = plan.dtypes["weights"]
    sliced = plan.sliced_layers()
    skip = sizes.skip_params(cfg, sliced)
    decode = plan.dtypes.get("decode", "none")
    one_copy = decode not in ("none", None) and not plan.dense_copies
    embed = "model.embed_tokens.weight"
    blocks = one_copy and checkpoint.handle(embed).is_quantized
    dense_skip = skip
    if one_copy:  # the projections' one copy is their decode copy; a block-quantized embedding stays in blocks
        copied = sizes.decode_copied(cfg)
        dense_skip = lambda n: (skip is not None and skip(n)) or n in copied or (blocks and n == embed)  # noqa: E731
    what = "the non-expert weights" if cfg.is_moe else "the non-FFN weights" if sliced else "the model's weights"
    fast_budget.reserve(sizes.weight_bytes(cfg, fmt, dense_skip), what)
    if plan.workspace_bytes:  # kept free for a prefill chunk's activations (and cuBLAS): allocated by torch, not by us
        fast_budget.reserve(plan.workspace_bytes, "the activation workspace")
    nbytes = materialize(model, checkpoint, sizes.torch_dtype(fmt), on_tensor=on_tensor, skip=dense_skip,
                         accelerator=accelerator)
    extra = 0
    if blocks:
        from tiered.quant.embedding import BlockEmbedding
        model.model.embed_tokens = BlockEmbedding(checkpoint.handle(embed), sizes.torch_dtype(fmt))
        extra += model.model.embed_tokens.nbytes
    if decode not in ("none", None):
        from tiered.kernels import available
        from tiered.quant.linear import install_decode_weights
        if plan.int4_layout == "tiled" and not available():  # a replayed plan from a machine with them
            from tiered.errors import ConfigError
            raise ConfigError("the plan keeps int4 decode copies in the tiled layout, which needs tiered/kernels "
                              "built", "build them (python -m tiered.kernels) or re-plan (--plan auto)")
        extra += install_decode_weights(model, checkpoint, decode, plan.decode_threshold, dense=not one_copy,
                                        skip=skip, int4_layout=plan.int4_layout, batch_act=plan.batch_act)
        fast_budget.reserve(extra, "the decode-format weight copies")
    if accelerator is None and cfg.is_mla and plan.native_decode and (one_copy or fmt == "bf16"):
        # latent attention's absorbed halves as bf16 per-head kernels, where the decode copies are lossy
        # (one copy) or the weights bf16 already (nothing lost): the lossless fp32 mode keeps fp32 ones
        from tiered.kernels import load
        from tiered.models.deepseek import LatentAttention
        absorbed = sum(m.install_absorbed(load()) for m in model.modules() if isinstance(m, LatentAttention))
        fast_budget.reserve(absorbed, "latent attention's absorbed bf16 kernels")
        extra += absorbed
    if accelerator is None:  # CPU decode streams these from RAM every token: onto huge pages (TLB)
        from tiered.memory.host import release_load_memory
        from tiered.quant.linear import PhaseLinear
        release_load_memory(checkpoint)  # first the file pages and temporaries the load left: peak RSS
        # (not the dense weights prompts alone read, nor embedding tables: one row per token)
        move_to_huge_pages(model, skip=lambda m, name: (isinstance(m, PhaseLinear) and name == "weight")
                           or isinstance(m, torch.nn.Embedding))
    return nbytes, extra


def place_experts(plan: Plan, checkpoint, accelerator, fast_budget: MemoryBudget, cpu_budget: MemoryBudget,
                  offload_dir: str | None) -> PlacedExperts:
    """Build the experts' home copies, cache slots and staging rings exactly as `plan` says.

    Raises:
        BudgetError: a tier cannot hold what the plan puts there (the plan was made for other budgets).
        ConfigError: disk-tier experts need conversion and there is no offload directory.
    """
    cfg = checkpoint.config
    first = next(l.layer for l in plan.layers if l.kind == "moe")
    fmt = expert_format(plan.dtypes["experts"], checkpoint, first, accelerator, plan.batch_act, plan.expert_act,
                        plan.expert_group_rows)
    shapes, dtype = fmt.slot_shapes, fmt.slot_dtype
    n_stage = plan.staging_buffers

    def fast_alloc(shape, dt, what):
        if accelerator is not None:
            return accelerator.alloc(shape, dt, what)
        return fast_budget.empty(shape, dt, what)

    def host_alloc(shape, dt, what):
        return cpu_budget.empty(shape, dt, what, alloc=accelerator.host_buffer)

    fast_staging = StagingPool([staging_buffer(fast_alloc, fmt, "staging") for _ in range(n_stage)])
    host_staging = None
    if accelerator is not None:
        host_staging = StagingPool([staging_buffer(host_alloc, fmt, "host staging") for _ in range(n_stage)])
    store = ExpertStore(checkpoint, plan.expert_placement(), fmt, accelerator, fast_budget, cpu_budget, offload_dir)
    cache = ExpertCache(plan.expert_cache_slots, shapes, dtype, fast_alloc,
                        make_policy(plan.cache_policy, cfg.num_hidden_layers), precision=fmt.name)
    low = None
    if plan.mixed_precision:
        low = _place_low(plan, checkpoint, first, accelerator, fast_budget, cpu_budget, offload_dir, store, fast_alloc)
    return PlacedExperts(store, cache, fast_staging, host_staging, low)


def _place_low(plan: Plan, checkpoint, first: int, accelerator, fast_budget, cpu_budget, offload_dir, store,
               fast_alloc) -> LowPrecision:
    """Low-precision copies of every expert not resident on the fast tier (in RAM when it is their
    home and the CPU budget is unlimited, else in offload files), and their cache pool.

    Raises:
        ConfigError: the low format is not smaller than the high one (low loads share the high
            staging ring).
    """
    from tiered.errors import ConfigError
    from tiered.planner.placement import CPU, DISK, FAST, ExpertPlacement
    from tiered.runtime.precision import MixedPrecision

    m = plan.mixed_precision
    fmt = expert_format(plan.dtypes["experts_low"], checkpoint, first, accelerator, plan.batch_act, plan.expert_act,
                        plan.expert_group_rows)
    if fmt.nbytes > store.expert_bytes:
        raise ConfigError(f"low-precision experts ({fmt.name}, {fmt.nbytes} B) must be smaller than the high "
                          f"ones ({store.fmt.name}, {store.expert_bytes} B)", "use a smaller low format, e.g. int4")
    tiers = {k: (CPU if t == CPU and cpu_budget.capacity is None and accelerator is not None else DISK)
             for k, t in store.placement.tiers.items() if t != FAST}
    low_store = ExpertStore(checkpoint, ExpertPlacement(tiers, 0, fmt.nbytes), fmt, accelerator, fast_budget,
                            cpu_budget, offload_dir)
    cache = ExpertCache(plan.expert_cache_slots_low, fmt.slot_shapes, fmt.slot_dtype, fast_alloc,
                        make_policy(plan.cache_policy, checkpoint.config.num_hidden_layers), precision=fmt.name,
                        high=False)  # HOBBIT's LHU counts only high-precision uses
    return LowPrecision(MixedPrecision(m["high"], m["low"], m["t1"], m["t2"]), low_store, cache)
