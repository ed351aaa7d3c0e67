# N = tokens, k = top-k, E = experts, D = hidden, F = expert intermediate
"""A MoE layer's routed experts with no host sync: every expert resident on the accelerator, its
weights stacked per layer (memory/expert_store.ExpertStore.stacks).

The general expert path reads the routing to the host (which experts, how many tokens each) and
launches one expert at a time: a host sync per layer, which no CUDA graph can hold, and ~10 launches
per expert. Here the routing stays on the device:

- "grouped": the N*k routing slots sorted by expert, the per-expert counts and their running sum
  (the group offsets) made on the device, and each projection one grouped GEMM over all experts
  (`torch._grouped_mm`: a CUTLASS kernel for bf16 on Hopper and later, which reads only the
  experts that have rows; torchtitan's and vLLM's MoE recipe). Other dtypes on CUDA fall back to a
  loop that reads the offsets on the host, so they take the next method.
- "gather": the routed experts' weights gathered by index ([N*k, F, D] each) and multiplied as a
  batched GEMV (gpt-fast's Mixtral): three times the expert bytes through memory, so only for a
  decode step's few slots (at most GATHER_SLOTS).

Each token's k outputs are summed in ascending expert order, as the general path's index_add_
sums them. Both methods use no op whose output shape depends on tensor values, so a decode step
built on them can be captured as one CUDA graph (runtime/graphs.DecodeGraphs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Most routing slots (N * k) of a step the "gather" method takes: a decode step of up to 8
# sequences at top-2 (it copies each slot's expert weights once more).
GATHER_SLOTS = 16


def grouped_method(x: torch.Tensor, slots: int) -> str | None:
    """Which sync-free method computes `slots` routing slots for activations `x` [N, D]: "grouped"
    (bf16 on CUDA; any dtype on the CPU and the stand-in, whose grouped GEMM is a plain loop),
    "gather" (other dtypes on CUDA, up to GATHER_SLOTS slots), or None (the general path)."""
    if not hasattr(torch, "_grouped_mm"):
        return "gather" if slots <= GATHER_SLOTS else None
    if not x.is_cuda or x.dtype == torch.bfloat16:
        return "grouped"
    return "gather" if slots <= GATHER_SLOTS else None


def grouped_experts_forward(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                            gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                            method: str = "grouped") -> torch.Tensor:
    """sum_j topk_weight[n, j] * expert_{topk_idx[n, j]}(x[n]) for every token, with no host sync.

    Args:
        x: [N, D] activations (the stacks' dtype).
        topk_idx: int64 [N, k] routed experts (distinct per token); topk_weight: [N, k].
        gate, up: [E, F, D]; down: [E, D, F]: one layer's experts stacked (SwiGLU:
            down(silu(gate x) * up x)).
        method: "grouped" (torch._grouped_mm) or "gather" (weights gathered, batched GEMV).
    Returns:
        [N, D] in x's dtype.
    Raises:
        ValueError: an unknown method.
    """
    N, k = topk_idx.shape
    D = x.shape[1]
    flat = topk_idx.reshape(-1)  # (N*k,) slot n*k + j: token n's j-th expert
    if method == "grouped":
        order = torch.argsort(flat, stable=True)  # slots grouped by expert, token order within
        counts = torch.zeros(gate.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)  # (E,) end row of each expert's group
        xs = x[order // k]  # (N*k, D)
        h = F.silu(torch._grouped_mm(xs, gate.transpose(1, 2), offs=offs)) * \
            torch._grouped_mm(xs, up.transpose(1, 2), offs=offs)  # (N*k, F)
        ys = torch._grouped_mm(h, down.transpose(1, 2), offs=offs)  # (N*k, D), grouped order
        y = torch.empty_like(ys)
        y[order] = ys  # back to slot order
    elif method == "gather":
        xs = x.unsqueeze(1).expand(N, k, D).reshape(N * k, D, 1)
        h = F.silu(torch.bmm(gate[flat], xs)) * torch.bmm(up[flat], xs)  # (N*k, F, 1)
        y = torch.bmm(down[flat], h).squeeze(-1)  # (N*k, D)
    else:
        raise ValueError(f"unknown grouped-experts method {method!r}")
    # each token's k terms in ascending expert order, as the general path's index_add_ adds them
    idx, perm = torch.sort(topk_idx, dim=1, stable=True)
    y = y.view(N, k, D).gather(1, perm.unsqueeze(-1).expand(N, k, D))
    w = topk_weight.gather(1, perm).to(y.dtype)
    out = y[:, 0] * w[:, 0, None]
    for j in range(1, k):
        out = out + y[:, j] * w[:, j, None]
    return out
