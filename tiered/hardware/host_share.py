"""CPU expert compute and H2D copies at once: does the host's memory serve both at their own speed?

Offloaded MoE decode can run both out of host RAM in one layer: the CPU computes some missing experts
while the copy engine ships others over the link. Measured on the H100's 16-core host (2026-11-26,
benchmarks/gpu_dram_share.py): a Mixtral-width CPU expert streamed 82.8 GB/s alone and 73.4 beside
the copies, the copies 52.7 GB/s alone and 47.5 beside the CPU: each ~10% slower. `host_share` times
that on the machine (profiler: meta["host_share"]); the dispatcher prices a layer whose misses go both
ways with it (runtime/dispatcher.LatencyModel.together).
"""

from __future__ import annotations

import statistics
import threading
import time

import torch

from tiered import kernels
from tiered.models.moe import expert_forward

GB = 1e9


class CpuLoop:
    """Runs expert forwards over the experts in turn until stopped; counts bytes and calls.

    `tokens` 1: a decode step's expert, tiered's native bf16 kernel where built. More: a prompt's
    expert as the runtime computes a dense bf16 one past its native rows (quant/experts.ExpertFormat.
    forward: three torch GEMMs, oneDNN on the CPU)."""

    def __init__(self, experts, hidden: int, tokens: int = 1) -> None:
        self.experts = experts
        self.x = torch.randn(tokens, hidden).to(torch.bfloat16)
        ext = kernels.load()
        self.fn = ext.bf16_expert_forward if ext is not None and tokens == 1 else None
        self.bytes_per = sum(t.numel() * t.element_size() for t in experts[0])
        self.ms_per_expert = None

    def one(self, e) -> None:
        if self.fn is not None:
            self.fn(*e, self.x)
        else:
            expert_forward(self.x, *e)

    def rate(self, seconds: float) -> float:
        """GB/s of weights over `seconds` of back-to-back expert forwards on the calling thread (at least
        3 forwards); ms_per_expert is set to their mean."""
        n, t0 = 0, time.perf_counter()
        while n < 3 or time.perf_counter() - t0 < seconds:
            self.one(self.experts[n % len(self.experts)])
            n += 1
        elapsed = time.perf_counter() - t0
        self.ms_per_expert = 1e3 * elapsed / n
        return n * self.bytes_per / elapsed / GB


class CopyLoop(threading.Thread):
    """A thread copying `src` (pinned host) into `dst` (device) until stopped, waiting on each copy
    with a blocking event (`blocking=True`) or a spinning Stream.synchronize."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, blocking: bool) -> None:
        super().__init__(daemon=True)
        self.src, self.dst, self.blocking = src, dst, blocking
        self.stop = threading.Event()
        self.copied = 0
        self.t0 = self.t1 = 0.0

    def run(self) -> None:
        from tiered.runtime.executor import one_cpu_thread

        one_cpu_thread()  # as the runtime's copy worker: this thread alone, torch's default for others kept
        cuda = self.dst.is_cuda
        stream = torch.cuda.Stream() if cuda else None
        self.t0 = time.perf_counter()
        while not self.stop.is_set():
            if cuda:
                with torch.cuda.stream(stream):
                    self.dst.copy_(self.src, non_blocking=True)
                if self.blocking:
                    ev = torch.cuda.Event(blocking=True)
                    ev.record(stream)
                    ev.synchronize()
                else:
                    stream.synchronize()
            else:
                self.dst.copy_(self.src)
            self.copied += self.src.numel() * self.src.element_size()
        self.t1 = time.perf_counter()

    def rate(self) -> float:
        return self.copied / max(self.t1 - self.t0, 1e-9) / GB


def measure(cpu: CpuLoop | None, src, dst, seconds: float, blocking: bool = True,
            threads: int | None = None) -> dict:
    """One window: CPU GB/s and/or copy GB/s while both (or one) run."""
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        copier = CopyLoop(src, dst, blocking) if src is not None else None
        if copier is not None:
            copier.start()
            time.sleep(0.05)
        if cpu is not None:
            cpu_rate = cpu.rate(seconds)
        else:
            time.sleep(seconds)
            cpu_rate = None
        if copier is not None:
            copier.stop.set()
            copier.join()
        return {"cpu_GBps": cpu_rate, "h2d_GBps": copier.rate() if copier is not None else None,
                "cpu_ms": cpu.ms_per_expert if cpu is not None else None}
    finally:
        torch.set_num_threads(old)


def host_share(cpu: CpuLoop, src: torch.Tensor, dst: torch.Tensor, seconds: float = 0.3,
               repeats: int = 3) -> dict:
    """How much CPU expert compute (`cpu`) and copies of `src` into `dst` (pinned host -> device: H2D) slow
    each other when they run together: medians over `repeats` windows of `seconds` each, alone and both at
    once (the copy thread waits on blocking events, as the runtime's issued copies do).

    Returns:
        {"cpu": CPU seconds together / alone (>= 1), "h2d": copy seconds together / alone (>= 1),
         "cpu_GBps": [alone, together], "h2d_GBps": [alone, together]}.
    """
    runs = {name: [measure(seconds=seconds, **kw) for _ in range(repeats)] for name, kw in (
        ("cpu", dict(cpu=cpu, src=None, dst=None)), ("h2d", dict(cpu=None, src=src, dst=dst)),
        ("both", dict(cpu=cpu, src=src, dst=dst, blocking=True)))}

    def med(name, key):
        return statistics.median(r[key] for r in runs[name])
    cpu_rates, h2d_rates = (med("cpu", "cpu_GBps"), med("both", "cpu_GBps")), (med("h2d", "h2d_GBps"), med("both", "h2d_GBps"))
    return {"cpu": max(1.0, cpu_rates[0] / cpu_rates[1]), "h2d": max(1.0, h2d_rates[0] / h2d_rates[1]),
            "cpu_GBps": list(cpu_rates), "h2d_GBps": list(h2d_rates)}
