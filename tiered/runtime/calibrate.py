"""Start-up calibration of the dispatcher's latency model on this machine and this expert shape.

Measures (medians of a few repeats): CPU expert time at several token counts (fit a + c*s),
accelerator expert time (fit a + c*s), an H2D copy of one expert, and a disk read of one expert.
The planner's HardwareProfile replaces this when present; nothing here is a constant in source.
"""

from __future__ import annotations

import torch

from tiered.hardware.profiler import fit_affine, median_time

from tiered.models.moe import expert_forward
from tiered.runtime.dispatcher import LatencyModel


def _median_time(fn, repeats: int = 5) -> float:
    return median_time(fn, repeats, min_sample=0.0)


def _fit(xs, ys) -> tuple[float, float]:
    m = fit_affine(xs, ys)
    return m.alpha, m.beta


def calibrate(shapes, dtype: torch.dtype, accelerator, hidden: int, dev_w=None, staged=None,
              tokens=(1, 2, 4, 8, 16), cpu_forward=None) -> LatencyModel:
    """Fit the dispatcher's LatencyModel for experts of `shapes` ((F, D), (F, D), (D, F)) in `dtype`.

    Args:
        dev_w, staged: an expert-sized buffer on the accelerator and a host staging buffer to
            measure with (the runtime's own staging buffers, so calibration needs no extra memory).
        cpu_forward: cpu_forward(x [s, hidden], (gate, up, down)) -> [s, hidden]: the CPU expert the
            runtime will run (ExpertFormat.forward: tiered's native kernel at few rows); None = torch's
            GEMMs (models/moe.expert_forward). Timed with torch's bf16 GEMV where the runtime runs the
            native kernel at about twice its speed, the CPU side was priced slow and the rules sent
            misses to the link: `--plan off` once decoded at 18.4 tok/s where its CPU path ran 33
            (H100, 2026-11-26).
    """
    host_w = tuple(torch.randn(s, dtype=dtype) * 0.02 for s in shapes)
    forward = cpu_forward or (lambda x, w: expert_forward(x, *w))
    cpu = [_median_time(lambda s=s: forward(torch.randn(s, hidden, dtype=dtype), host_w)) for s in tokens]
    cpu_a, cpu_b = _fit(tokens, cpu)
    if accelerator is None:
        return LatencyModel(cpu_a, cpu_b, cpu_a, cpu_b, 0.0, float("inf"))
    for d, h in zip(dev_w, host_w):
        accelerator.copy_to_device(d, h)
    gpu = []
    for s in tokens:
        x = accelerator.to_device(torch.randn(s, hidden, dtype=dtype))

        def run(x=x):
            with accelerator.stream("compute"):
                expert_forward(x, *dev_w)
        gpu.append(_median_time(run))
    gpu_a, gpu_b = _fit(tokens, gpu)
    for h, w in zip(staged, host_w):
        h.copy_(w)

    def copy():
        with accelerator.stream("copy"):
            for d, h in zip(dev_w, staged):
                accelerator.copy_to_device(d, h)
    nbytes = sum(t.numel() * t.element_size() for t in host_w)
    t_copy = _median_time(copy, 3)
    half = [w[: max(1, w.shape[0] // 4)] for w in dev_w]
    t_small = _median_time(lambda: [accelerator.copy_to_device(d, h[: d.shape[0]]) for d, h in zip(half, staged)], 3)
    small_bytes = sum(t.numel() * t.element_size() for t in half)
    # two-point fit; when timing noise makes the small copy as slow as the full one, fall back to
    # the full copy's average rate rather than an absurd bandwidth
    bw = (nbytes - small_bytes) / (t_copy - t_small) if t_copy > t_small * 1.05 else nbytes / t_copy
    h2d_a = max(t_copy - nbytes / bw, 0.0)
    return LatencyModel(cpu_a, cpu_b, gpu_a, gpu_b, h2d_a, bw)
