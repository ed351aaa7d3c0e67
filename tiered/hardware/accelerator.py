"""The accelerator interface, and its host stand-in.

The GPU path of tiered is written against `Accelerator`: memory on the device under a byte budget,
named streams (copy, compute) that run tasks in order, and asynchronous host-to-device copies.
`HostAccelerator` implements it with CPU memory and worker threads, optionally throttling copies
to a link bandwidth (bytes/s) to emulate PCIe, so every control path (placement, cache, dispatch,
overlap) runs and is tested on machines without a GPU. `CudaAccelerator` (hardware/cuda.py) is the
real one.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from contextlib import contextmanager

import torch

from tiered.hardware.budget import MemoryBudget


class Accelerator(ABC):
    """A device that computes and has its own memory.

    Attributes:
        device: torch device where its tensors live.
        budget: MemoryBudget of its memory; every `alloc` reserves against it.
        is_host: True for the host stand-in (its memory is CPU memory).
    """

    device: torch.device
    budget: MemoryBudget
    is_host: bool = False

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype, what: str = "") -> torch.Tensor:
        """An uninitialized tensor on the device, reserved against the budget (raises BudgetError)."""
        nbytes = _nbytes(shape, dtype)
        self.budget.reserve(nbytes, what)
        try:
            return torch.empty(shape, dtype=dtype, device=self.device)
        except Exception:
            self.budget.release(nbytes)
            raise

    def free(self, t: torch.Tensor) -> None:
        """Return a tensor's bytes to the budget (the caller drops its references)."""
        self.budget.release(t.numel() * t.element_size())

    @abstractmethod
    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy host `src` into device `dst` on the calling stream (H2D); blocks until done."""

    @abstractmethod
    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host staging tensor for H2D copies (pinned memory on CUDA)."""

    @contextmanager
    def stream(self, name: str):
        """Run the enclosed work on the device stream `name` ("copy", "compute"), then wait for it."""
        yield

    def synchronize(self) -> None:
        """Wait for all device work."""

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """H2D: `t` on the device (asynchronous from pinned memory on CUDA)."""
        return t.to(self.device, non_blocking=t.is_pinned())

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """D2H: `t` in host memory (waits for the work that produces it)."""
        return t.to("cpu")

    def record_event(self):
        """A marker after the work issued so far on the calling thread's stream (None: nothing to wait for)."""
        return None

    def wait_event(self, event) -> None:
        """Make the current stream wait for `event` (from record_event) without blocking the host."""


def _nbytes(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


class HostAccelerator(Accelerator):
    """Stand-in accelerator: CPU memory with its own byte budget and an optional throttled link.

    Args:
        capacity: bytes of "device" memory (None = unlimited).
        link_bandwidth: bytes/s of the emulated H2D link (None = memcpy speed). A copy of n bytes
            then takes max(memcpy time, n / link_bandwidth) and does not hold the CPU while
            waiting (it sleeps, as a DMA engine would leave the CPU free).
    """

    is_host = True

    def __init__(self, capacity: int | None = None, link_bandwidth: float | None = None) -> None:
        self.device = torch.device("cpu")
        self.budget = MemoryBudget("gpu", capacity)
        self.link_bandwidth = link_bandwidth

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        t0 = time.perf_counter()
        dst.copy_(src)
        if self.link_bandwidth:
            wait = src.numel() * src.element_size() / self.link_bandwidth - (time.perf_counter() - t0)
            if wait > 0:
                time.sleep(wait)

    def host_buffer(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)


def make_accelerator(kind: str, capacity: int | None, link_bandwidth: float | None = None) -> Accelerator | None:
    """'none' -> None (CPU only); 'host' -> HostAccelerator; 'cuda' -> CudaAccelerator; 'auto' picks CUDA if present."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "none"
    if kind == "none":
        return None
    if kind == "host":
        return HostAccelerator(capacity, link_bandwidth)
    from tiered.hardware.cuda import CudaAccelerator
    return CudaAccelerator(capacity)
