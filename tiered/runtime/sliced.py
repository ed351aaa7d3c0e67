"""Sliced execution of a SwiGLU MLP (or expert) across CPU and accelerator (ScheInfer §III).

The intermediate dimension F is split by rows into three parts (ALGORITHMS.md 1.a, Eq. 1-2):
    CC  rows [0, f_cc)              stored in CPU memory, computed on the CPU
    CG  rows [f_cc, f_cc + f_cg)    stored in CPU memory, copied H2D at every use, computed on the accelerator
    GG  rows [f_cc + f_cg, F)       stored on the accelerator, computed there
gate/up are split by output rows and down by the matching input columns, so the parts' outputs
sum to the unsliced result exactly (like tensor parallelism). In prefill the last n_g of the T
tokens take the CG' path: the CC weights are shipped to the accelerator for those tokens, and the
CPU computes the CC part of only the first T - n_g tokens (token assignment, Eq. 15).

The three parts run concurrently on the executor's streams: "cpu" (CC), "copy" then "compute"
(CG, CG'), "compute" (GG); the results are summed on the accelerator.
Dimension legend: N = T tokens, D = hidden, F = intermediate.
"""

from __future__ import annotations

import torch
from torch import nn

from tiered.models.moe import expert_forward
from tiered.runtime.executor import Executor


def split_rows(F: int, r_cc: float, r_cg: float) -> tuple[int, int, int]:
    """Row counts (f_cc, f_cg, f_gg) of a slicing, rounding to whole rows; they sum to F.

    Raises:
        ValueError: rates outside [0, 1] or summing above 1.
    """
    if not (0 <= r_cc <= 1 and 0 <= r_cg <= 1 and r_cc + r_cg <= 1 + 1e-9):
        raise ValueError(f"slicing rates r_cc={r_cc}, r_cg={r_cg} must be in [0, 1] with r_cc + r_cg <= 1")
    f_cc = int(round(r_cc * F))
    f_cg = min(int(round(r_cg * F)), F - f_cc)
    return f_cc, f_cg, F - f_cc - f_cg


class SlicedMLP(nn.Module):
    """A SwiGLU MLP whose weights are sliced into CC / CG / GG parts.

    Args:
        w_gate, w_up: [F, D]; w_down: [D, F] (any device; copied to their parts' tiers).
        r_cc, r_cg: slicing rates (fractions of F); r_gg = 1 - r_cc - r_cg.
        accelerator: the Accelerator holding GG and the CG staging buffer.
        executor: streams to run the parts on.
        n_g: prompt tokens that take the CG' path (0 in decode).
    Forward: x [..., D] on the accelerator -> [..., D].
    """

    def __init__(self, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, r_cc: float, r_cg: float,
                 accelerator, executor: Executor, n_g: int = 0) -> None:
        super().__init__()
        F = w_gate.shape[0]
        self.f_cc, self.f_cg, self.f_gg = split_rows(F, r_cc, r_cg)
        a, b = self.f_cc, self.f_cc + self.f_cg
        pin = not accelerator.is_host
        host = lambda t: t.detach().to("cpu").contiguous().pin_memory() if pin else t.detach().to("cpu").contiguous()  # noqa: E731
        self.cc = (host(w_gate[:a]), host(w_up[:a]), host(w_down[:, :a]))
        self.cg = (host(w_gate[a:b]), host(w_up[a:b]), host(w_down[:, a:b]))
        self.gg = tuple(self._to_device(accelerator, t, "GG slice") for t in (w_gate[b:], w_up[b:], w_down[:, b:]))
        # one staging buffer on the accelerator, big enough for the CG part or the CC part (CG')
        rows = max(self.f_cg, self.f_cc)
        D = w_gate.shape[1]
        self.staging = (accelerator.alloc((rows, D), w_gate.dtype, "CG staging"),
                        accelerator.alloc((rows, D), w_gate.dtype, "CG staging"),
                        accelerator.alloc((D, rows), w_gate.dtype, "CG staging")) if rows else None
        self.stage_cc = (accelerator.alloc((self.f_cc, D), w_gate.dtype, "CG' staging"),
                         accelerator.alloc((self.f_cc, D), w_gate.dtype, "CG' staging"),
                         accelerator.alloc((D, self.f_cc), w_gate.dtype, "CG' staging")) if self.f_cc else None
        self.accelerator, self.executor, self.n_g = accelerator, executor, n_g

    @staticmethod
    def _to_device(acc, t: torch.Tensor, what: str) -> torch.Tensor:
        out = acc.alloc(tuple(t.shape), t.dtype, what)
        out.copy_(t)
        return out

    def _copy(self, dst, src, rows: int, name: str):
        def run():
            for d, s, is_down in zip(dst, src, (False, False, True)):
                view = d[:, :rows] if is_down else d[:rows]
                self.accelerator.copy_to_device(view, s)
        nbytes = sum(s.numel() * s.element_size() for s in src)
        return self.executor.submit("copy", run, name=name, nbytes=nbytes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (T, D)
        T = x2.shape[0]
        n_g = min(self.n_g, T) if self.f_cc else 0
        ex = self.executor
        self.accelerator.synchronize()
        futures = []
        if self.f_gg:
            futures.append(ex.submit("compute", lambda: expert_forward(x2, *self.gg), name="GG"))
        if self.f_cg:
            copy = self._copy(self.staging, self.cg, self.f_cg, "H2D CG")
            cg = tuple(t[:, :self.f_cg] if i == 2 else t[:self.f_cg] for i, t in enumerate(self.staging))
            futures.append(ex.submit("compute", lambda: expert_forward(x2, *cg), deps=[copy], name="CG"))
        cc_rows = T - n_g
        cpu_fut = None
        if self.f_cc and cc_rows:
            x_host = x2[:cc_rows].to("cpu")
            cpu_fut = ex.submit("cpu", lambda: expert_forward(x_host, *self.cc), name="CC")
        cgp_fut = None
        if n_g:
            copy = self._copy(self.stage_cc, self.cc, self.f_cc, "H2D CG'")
            cgp_fut = ex.submit("compute", lambda: expert_forward(x2[cc_rows:], *self.stage_cc), deps=[copy], name="CG'")
        y = torch.zeros_like(x2)
        for f in futures:
            y += f.result()
        if cpu_fut is not None:
            y[:cc_rows] += cpu_fut.result().to(y.device)
        if cgp_fut is not None:
            y[cc_rows:] += cgp_fut.result()
        return y.reshape(shape)


def install_sliced_mlps(model: nn.Module, rates: list[tuple[float, float]], accelerator, executor: Executor,
                        n_g: int = 0) -> list[SlicedMLP]:
    """Replace each dense layer's `mlp` by a SlicedMLP with that layer's (r_cc, r_cg). Returns them."""
    from tiered.models.layers import MLP

    out = []
    for layer, (r_cc, r_cg) in zip(model.model.layers, rates):
        mlp = layer.mlp
        if not isinstance(mlp, MLP):
            continue
        sliced = SlicedMLP(_dense(mlp.gate_proj), _dense(mlp.up_proj), _dense(mlp.down_proj), r_cc, r_cg,
                           accelerator, executor, n_g)
        layer.mlp = sliced
        out.append(sliced)
    return out


def _dense(linear: nn.Module) -> torch.Tensor:
    return linear.weight.detach()
