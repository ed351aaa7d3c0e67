"""Sliced execution of a SwiGLU MLP (or expert) across CPU and accelerator (ScheInfer §III).

The intermediate dimension F is split by rows into three parts (ALGORITHMS.md 1.a, Eq. 1-2):
    CC  rows [0, f_cc)              stored in CPU memory, computed on the CPU
    CG  rows [f_cc, f_cc + f_cg)    stored in CPU memory, copied H2D at every use, computed on the accelerator
    GG  rows [f_cc + f_cg, F)       stored on the accelerator, computed there
gate/up are split by output rows and down by the matching input columns, so the parts' outputs
sum to the unsliced result exactly (like tensor parallelism). In prefill the last n_g of the T
tokens take the CG' path: the CC weights are shipped to the accelerator for those tokens, and the
CPU computes the CC part of only the first T - n_g tokens (token assignment, Eq. 15).

The three parts run concurrently: CC on the calling thread (the executor's inline "cpu" stream,
torch's own OpenMP team), "copy" then "compute" (CG, CG'), "compute" (GG); the device streams wait
for x through an event, not a device-wide synchronize; the results are summed on the accelerator.
Dimension legend: N = T tokens, D = hidden, F = intermediate.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from tiered import kernels
from tiered.models.moe import expert_forward
from tiered.quant.experts import bf16_native_rows
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


class SliceStaging:
    """Accelerator buffers for the copied parts of sliced MLPs, shared by all layers (they run one
    after another): `cg` holds a CG part, `cc` the CC part shipped for the CG' tokens; each is a
    (gate [rows, D], up [rows, D], down [D * rows] flat) triple sized for the largest layer, or None.
    The down buffer is flat so that a smaller layer's [D, rows] view of it is contiguous (`_rows`):
    a column slice of a [D, max rows] buffer made each H2D copy into it go through a temporary.
    """

    def __init__(self, accelerator, d_model: int, cg_rows: int, cc_rows: int, dtype: torch.dtype) -> None:
        def triple(rows: int, what: str):
            if not rows:
                return None
            return (accelerator.alloc((rows, d_model), dtype, what), accelerator.alloc((rows, d_model), dtype, what),
                    accelerator.alloc((d_model * rows,), dtype, what))
        self.cg = triple(cg_rows, "CG staging")
        self.cc = triple(cc_rows, "CG' staging")


def _rows(buf, rows: int):
    """A staging triple's views for a part of `rows` rows: gate and up [rows, D], down [D, rows], each
    contiguous (the down matrix from the front of its flat buffer)."""
    d_model = buf[0].shape[1]
    return (buf[0][:rows], buf[1][:rows], buf[2][:d_model * rows].view(d_model, rows))


class SlicedMLP(nn.Module):
    """A SwiGLU MLP whose weights are sliced into CC / CG / GG parts.

    Args:
        w_gate, w_up: [F, D]; w_down: [D, F] (any device; copied to their parts' tiers).
        r_cc, r_cg: slicing rates (fractions of F); r_gg = 1 - r_cc - r_cg.
        accelerator: the Accelerator holding GG and the CG staging buffer.
        executor: streams to run the parts on.
        n_g: prompt tokens that take the CG' path: a count, or a function of the step's token
            count T (ScheInfer Eq. 15 re-solved per prompt); capped at T.
        staging: shared SliceStaging (None = this layer allocates its own).
        host_budget: MemoryBudget the CPU-side parts (CC and CG) are reserved against (None = not counted).
        device_issue: Plan.device_issue: "thread" issues the CG / CG' copies (where the slices are
            page-locked, `_copy`) and the GG / CG / CG' GEMMs from the forward's own thread, before its
            CC slice takes every core (Executor.issue); "worker" leaves them to the streams' workers.
    Forward: x [..., D] on the accelerator -> [..., D].
    Raises:
        BudgetError: the accelerator or host budget cannot hold the parts.
    """

    def __init__(self, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, r_cc: float, r_cg: float,
                 accelerator, executor: Executor, n_g: int | Callable[[int], int] = 0,
                 staging: SliceStaging | None = None, host_budget=None, device_issue: str = "thread",
                 act: str = "silu") -> None:
        super().__init__()
        self.act = act  # the GLU's activation (models/layers.glu_activation)
        F, D = w_gate.shape
        self.f_cc, self.f_cg, self.f_gg = split_rows(F, r_cc, r_cg)
        a, b = self.f_cc, self.f_cc + self.f_cg
        if host_budget is not None:
            host_budget.reserve(3 * b * D * w_gate.element_size(), "CPU-side MLP slices")

        def host(t: torch.Tensor) -> torch.Tensor:  # pinned on CUDA, huge pages when large
            return accelerator.pin(accelerator.to_host(t.detach()))
        self.cc = (host(w_gate[:a]), host(w_up[:a]), host(w_down[:, :a]))
        self.cg = (host(w_gate[a:b]), host(w_up[a:b]), host(w_down[:, a:b]))
        self.gg = tuple(self._to_device(accelerator, t, "GG slice") for t in (w_gate[b:], w_up[b:], w_down[:, b:]))
        self.staging = staging or SliceStaging(accelerator, D, self.f_cg, self.f_cc, w_gate.dtype)
        # this layer's views of the (shared) staging buffers, made once
        self._cg_stage = _rows(self.staging.cg, self.f_cg) if self.f_cg else None
        self._cc_stage = _rows(self.staging.cc, self.f_cc) if self.f_cc else None
        self.accelerator, self.executor, self.n_g = accelerator, executor, n_g
        # who issues this layer's device work (Executor.issue), known now: the GEMMs by the forward's thread
        # under "thread", and each part's copies too where its slices (which never move) are page-locked
        self._gemms_here = device_issue == "thread"
        self._cc_copy_here, self._cg_copy_here = (self._gemms_here and all(accelerator.page_locked(t) for t in part)
                                                  for part in (self.cc, self.cg))

    @staticmethod
    def _to_device(acc, t: torch.Tensor, what: str) -> torch.Tensor:
        out = acc.alloc(tuple(t.shape), t.dtype, what)
        acc.copy_to_device(out, t)
        return out

    def _copy(self, dst, src, name: str, here: bool):
        """H2D copy of the slices `src` into the staging views `dst` on the copy stream; issued from this
        thread (Executor.issue) where `here` (device_issue "thread" and the slices page-locked), so the
        link starts before this thread's CC slice takes every core."""
        def run():
            for d, s in zip(dst, src):
                self.accelerator.copy_to_device(d, s)
        nbytes = sum(s.numel() * s.element_size() for s in src)
        return self.executor.submit("copy", run, name=name, nbytes=nbytes, issue_here=here)

    def _cc_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The CC slice on the CPU: x [n, D] (host) -> [n, D] in x's dtype. Decode-sized steps (at most
        NATIVE_ROWS rows, fewer where this machine's kernel tuning says: quant/experts.bf16_native_rows) of
        bf16 slices run tiered's fused GEMV expert (kernels: ~93 GB/s on the
        H200's host, where torch's bf16 F.linear streamed the CC slices at ~47 GB/s, 2026-11-26);
        prompts, other dtypes and machines without the kernels take torch's GEMMs."""
        ext = (kernels.load() if x.shape[0] <= bf16_native_rows() and self.cc[0].dtype == torch.bfloat16
               and self.act == "silu" else None)
        if ext is None:
            return expert_forward(x, *self.cc, self.act)
        y = ext.bf16_expert_forward(*self.cc, x)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def tokens_on_gpu(self, T: int) -> int:
        """n_g for a step of T tokens: prompt tokens whose CC part runs on the accelerator (CG')."""
        if not self.f_cc:
            return 0
        n_g = self.n_g(T) if callable(self.n_g) else self.n_g
        return max(0, min(int(n_g), T))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (T, D)
        T = x2.shape[0]
        n_g = self.tokens_on_gpu(T)
        ex, acc = self.executor, self.accelerator
        ready = acc.record_event()  # device streams wait for x on the device, the host does not
        futures = []
        if self.f_gg:
            futures.append(ex.submit("compute", lambda: expert_forward(x2, *self.gg, self.act), name="GG", after_event=ready,
                                     issue_here=self._gemms_here))
        if self.f_cg:
            cg = self._cg_stage
            copy = self._copy(cg, self.cg, "H2D CG", self._cg_copy_here)
            futures.append(ex.submit("compute", lambda: expert_forward(x2, *cg, self.act), deps=[copy], name="CG",
                                     after_event=ready, issue_here=self._gemms_here))
        cc_rows = T - n_g
        cgp_fut = None
        if n_g:
            cc = self._cc_stage
            copy = self._copy(cc, self.cc, "H2D CG'", self._cc_copy_here)
            cgp_fut = ex.submit("compute", lambda: expert_forward(x2[cc_rows:], *cc, self.act), deps=[copy], name="CG'",
                                after_event=ready, issue_here=self._gemms_here)
        y_cc = None
        if self.f_cc and cc_rows:  # CC on the CPU: on this thread (inline stream), while the streams work
            x_host = acc.to_host(x2[:cc_rows])
            y_cc = ex.submit("cpu", lambda: self._cc_forward(x_host), name="CC").result()
        # the parts' sum, in place in the first part's (fresh) output: no zeros_like and one add fewer
        y = None
        for f in futures:
            part = ex.join(f)
            y = part if y is None else y.add_(part)
        if y is None:
            y = torch.zeros_like(x2)
        if y_cc is not None:
            y[:cc_rows] += acc.to_device(y_cc)
        if cgp_fut is not None:
            y[cc_rows:] += ex.join(cgp_fut)
        return y.reshape(shape)


def install_sliced_mlps(model: nn.Module, rates: Sequence[tuple[float, float]] | Mapping[int, tuple[float, float]],
                        accelerator, executor: Executor, n_g: int | Callable[[int, int], int] = 0,
                        weights: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
                        host_budget=None, device_issue: str = "thread") -> list[SlicedMLP]:
    """Replace dense layers' `mlp` by SlicedMLPs sharing one SliceStaging. Returns them in layer order.

    Args:
        rates: (r_cc, r_cg) per layer: a sequence (layer i gets rates[i]) or {layer: rates}.
        n_g: prompt tokens on the CG' path: a count for every layer, or n_g(layer, T).
        weights: weights(layer) -> (gate [F, D], up [F, D], down [D, F]) on the CPU; default: the
            layer's dense MLP weights (which must then be materialized).
        host_budget: MemoryBudget the CPU-side slices are reserved against.
        device_issue: Plan.device_issue (SlicedMLP's).
    Raises:
        BudgetError: the accelerator (GG parts and staging) or the host budget is too small.
    """
    from tiered.models.layers import MLP

    chosen = dict(enumerate(rates)) if not isinstance(rates, Mapping) else dict(rates)
    layers = model.model.layers
    if weights is None:
        def weights(i: int):
            mlp = layers[i].mlp
            return tuple(lin.weight.detach() for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    todo = {i: r for i, r in chosen.items() if isinstance(layers[i].mlp, MLP)}
    if not todo:
        return []
    D = model.config.hidden_size
    F = model.config.intermediate_size
    splits = {i: split_rows(F, *r) for i, r in todo.items()}
    dtype = next(p.dtype for p in model.parameters() if p.device.type != "meta")
    staging = SliceStaging(accelerator, D, max(s[1] for s in splits.values()), max(s[0] for s in splits.values()),
                           dtype)
    out = []
    for i in sorted(todo):
        per_layer = (lambda T, i=i: n_g(i, T)) if callable(n_g) else n_g
        w_gate, w_up, w_down = weights(i)
        sliced = SlicedMLP(w_gate.to(dtype), w_up.to(dtype), w_down.to(dtype), *todo[i], accelerator, executor,
                           per_layer, staging, host_budget, device_issue, layers[i].mlp.act)
        layers[i].mlp = sliced
        out.append(sliced)
    return out
