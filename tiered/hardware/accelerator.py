"""The accelerator interface, and its host stand-in.

The GPU path of tiered is written against `Accelerator`: memory on the device under a byte budget,
named streams (copy, compute) that run tasks in order, and the copies between host and device
(`to_device`, `copy_to_device`, `to_host`): every tensor the engine moves to or from the device
goes through them. `HostAccelerator` implements it with CPU memory and worker threads, optionally
throttling copies to a link bandwidth (bytes/s) to emulate PCIe, so every control path (placement,
cache, dispatch, overlap) runs and is tested on machines without a GPU. Its tensors are
`StandinTensor`s (hardware/standin.py): mixing them with host tensors outside these copies raises,
as CUDA does. `CudaAccelerator` (hardware/cuda.py) is the real one.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Callable

import torch

from tiered.hardware.budget import MemoryBudget, host_empty, nbytes_of
from tiered.hardware.standin import (STANDIN_DEVICE, StandinDeviceError, StandinScope, StandinTensor, ThreadFlag,
                                     capturing, made_on_device)


class Accelerator(ABC):
    """A device that computes and has its own memory.

    Attributes:
        device: torch device where its tensors live.
        budget: MemoryBudget of its memory; every `alloc` reserves against it.
        is_host: True for the host stand-in (its memory is CPU memory).
        pinned: how `host_buffer` pins on CUDA ("huge" or "cuda": EngineConfig.pinned, set from
            Plan.pinned before anything is placed); the stand-in's buffers are ordinary memory.
        async_streams: work issued on its streams (kernels, H2D copies from page-locked memory)
            returns at once while the device runs it (CUDA), so the thread that issues it need not
            wait (Executor.submit's `issue_here`); the stand-in's work runs on the calling thread.
    """

    device: torch.device
    budget: MemoryBudget
    is_host: bool = False
    pinned: str = "huge"
    async_streams: bool = False

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype, what: str = "") -> torch.Tensor:
        """An uninitialized tensor `shape` of `dtype` on the device, reserved against the budget.

        Raises:
            BudgetError: it does not fit (nothing is reserved).
        """
        nbytes = nbytes_of(shape, dtype)
        self.budget.reserve(nbytes, what)
        try:
            return self._empty(shape, dtype)
        except Exception:
            self.budget.release(nbytes)
            raise

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def free(self, t: torch.Tensor) -> None:
        """Return a tensor's bytes to the budget (the caller drops its references)."""
        self.budget.release(t.numel() * t.element_size())

    @abstractmethod
    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy `src` (host, or device) into device tensor `dst` of the same shape on the calling
        stream (H2D); blocks until done unless `src` is pinned (CUDA orders it on the stream)."""

    @abstractmethod
    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A device copy of host tensor `t` (same shape, dtype and values); `t` itself when it is
        already on the device. Not counted against the budget (callers reserve what they keep).
        Non-blocking on CUDA when `t` is pinned: do not reuse `t` before the stream has run."""

    @abstractmethod
    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of device tensor `t` (same shape, dtype and values), blocking; `t` itself
        when it is already on the host."""

    def module_to_device(self, module: torch.nn.Module) -> torch.nn.Module:
        """Move every parameter and buffer of `module` (in place) with `to_device`; returns it."""
        for m in module.modules():
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = self.to_device(b)
            for name, p in m._parameters.items():
                if p is not None:
                    m._parameters[name] = torch.nn.Parameter(self.to_device(p.detach()), requires_grad=False)
        return module

    @abstractmethod
    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized host tensor that H2D copies read from: staging buffers, and weights kept
        in RAM for the link and the CPU alike (pinned memory on CUDA; huge pages when large)."""

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of host tensor `t` in a host_buffer (contiguous)."""
        out = self.host_buffer(tuple(t.shape), t.dtype)
        out.copy_(t)
        return out

    @contextmanager
    def stream(self, name: str, wait: bool = True):
        """Run the enclosed work on the device stream `name` ("copy", "compute"), then wait for it
        (`wait` False: return once it is issued; record_event inside marks its end)."""
        yield

    def page_locked(self, t: torch.Tensor) -> bool:
        """Whether an H2D copy from host tensor `t` can run asynchronously (CUDA: page-locked memory);
        False for the stand-in."""
        return False

    def synchronize(self) -> None:
        """Wait for all device work."""

    def library_workspace_bytes(self) -> int:
        """Device bytes that libraries under torch hold for the engine beyond its tensors (cuBLAS
        workspaces on CUDA); the plan keeps them inside the budget. 0 for the stand-in."""
        return 0

    def release(self) -> None:
        """Free what the device keeps for this engine beyond its tensors (at LLM.close, after its
        worker threads stopped); the stand-in keeps nothing."""

    def trim(self) -> None:
        """Give the device memory that the allocator caches but no tensor uses back to the driver: a
        load's temporaries (a fused projection replacing its parts) would otherwise stay reserved
        beyond the budget for the life of the process; the stand-in caches nothing."""

    def record_event(self, blocking: bool = False):
        """A marker after the work issued so far on the calling thread's stream (None: nothing to wait
        for). `blocking`: a host waiting for it (wait_event_host) sleeps instead of spinning."""
        return None

    def wait_event_host(self, event) -> None:
        """Block the calling thread until `event` (from record_event) has passed on the device."""

    def wait_event(self, event) -> None:
        """Make the current stream wait for `event` (from record_event) without blocking the host."""

    def graph_pool(self):
        """A memory pool for graphs captured to replay one after another, always in the order they
        were captured (`capture(..., pool=)`); None where there are no graph pools (the stand-in)."""
        return None

    def capture(self, fn: Callable[[], object], pool=None) -> tuple[Callable[[], None], object]:
        """Capture `fn()` as a graph: device work only, with no host sync and no shape that depends
        on tensor values. Every `replay()` then recomputes fn's outputs in place from the values the
        tensors fn read hold at that moment, on the calling stream (CUDA graphs, gpt-fast's and
        vLLM's decode recipe: one launch instead of one per kernel).

        Here (the host stand-in) fn runs once now and again at every replay, with host syncs
        refused as CUDA refuses them during capture (standin.capturing), and its new outputs are
        copied into the first ones: what CUDA's replay does, checked for what breaks a capture.

        Args:
            fn: () -> a tensor or a tuple of tensors on the device.
            pool: graph_pool() shared by graphs that replay in capture order, or None.
        Returns:
            (replay, outputs): outputs are fn's tensors; keep them, they are rewritten by replay().
        Raises:
            StandinDeviceError (stand-in) or torch's RuntimeError (CUDA): fn synced with the host.
        """
        with capturing(), _building_graph():
            out = fn()

        def replay() -> None:
            with capturing(), _building_graph():
                new = fn()
            for o, n in zip(_flat(out), _flat(new)):
                with torch._C.DisableTorchFunctionSubclass():
                    o.copy_(n)
        return replay, out

    @contextmanager
    def scope(self):
        """Run the enclosed code as the engine's device code on this thread: on the host stand-in,
        tensor factories given the device (`torch.arange(n, device=x.device)`) then make device
        tensors; CUDA needs nothing."""
        yield


# On while this thread warms up or captures a graph (Accelerator.capture): `with _building_graph():`.
_building_graph = ThreadFlag()


def building_graph() -> bool:
    """True while this thread warms up or captures a graph (Accelerator.capture): code whose choice
    of kernels must be the same in the warm-up runs and in the capture asks (models/layers.attend
    keeps cuDNN attention then, so its plan is built in the warm-up, never inside the capture)."""
    return bool(_building_graph)


def _flat(out) -> tuple:
    """A captured function's outputs as a tuple of tensors."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)




class HostAccelerator(Accelerator):
    """Stand-in accelerator: CPU memory with its own byte budget and an optional throttled link.

    Its device is STANDIN_DEVICE ("privateuseone:0"); its tensors are StandinTensors, strict about
    devices as CUDA is (hardware/standin.py): `alloc`, `to_device` and factories inside `scope()` or
    a stream make them, `copy_to_device` fills them, `to_host` / `.cpu()` copy them back.

    Args:
        capacity: bytes of "device" memory (None = unlimited).
        link_bandwidth: bytes/s of the emulated H2D link (None = memcpy speed). A copy of n bytes
            then takes max(memcpy time, n / link_bandwidth) and does not hold the CPU while
            waiting (it sleeps, as a DMA engine would leave the CPU free).
    """

    is_host = True

    def __init__(self, capacity: int | None = None, link_bandwidth: float | None = None) -> None:
        self.device = STANDIN_DEVICE
        self.budget = MemoryBudget("gpu", capacity)
        self.link_bandwidth = link_bandwidth

    def _empty(self, shape, dtype) -> torch.Tensor:
        return made_on_device(torch.empty(shape, dtype=dtype).as_subclass(StandinTensor))

    def _throttle(self, t0: float, nbytes: int) -> None:
        if self.link_bandwidth:
            wait = nbytes / self.link_bandwidth - (time.perf_counter() - t0)
            if wait > 0:
                time.sleep(wait)

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Raises StandinDeviceError when `dst` is not a tensor on the stand-in's device."""
        if type(dst) is not StandinTensor:
            raise StandinDeviceError(f"copy_to_device: the destination is a host tensor, not one on the "
                                     f"accelerator ({STANDIN_DEVICE}); allocate it with Accelerator.alloc")
        t0 = time.perf_counter()
        with torch._C.DisableTorchFunctionSubclass():
            dst.copy_(src)
        self._throttle(t0, src.numel() * src.element_size())

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        if type(t) is StandinTensor:
            return t
        t0 = time.perf_counter()
        out = made_on_device(t.detach().clone().as_subclass(StandinTensor))
        self._throttle(t0, t.numel() * t.element_size())
        return out

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.cpu() if type(t) is StandinTensor else t

    def host_buffer(self, shape, dtype) -> torch.Tensor:
        return host_empty(shape, dtype)

    @contextmanager
    def scope(self):
        with StandinScope():
            yield

    @contextmanager
    def stream(self, name: str, wait: bool = True):
        """The stand-in's streams are the executor's worker threads; this makes the task's
        factories land on the device (see `scope`). Its work is done when issued (`wait` is moot)."""
        with StandinScope():
            yield


def accelerator_kind(kind: str) -> str:
    """EngineConfig.accelerator with "auto" resolved: "cuda" where CUDA is present, else "none"; others as given."""
    return ("cuda" if torch.cuda.is_available() else "none") if kind == "auto" else kind


def make_accelerator(kind: str, capacity: int | None, link_bandwidth: float | None = None,
                     pinned: str = "huge") -> Accelerator | None:
    """'none' -> None (CPU only); 'host' -> HostAccelerator; 'cuda' -> CudaAccelerator (its host
    buffers pinned as `pinned` says: EngineConfig.pinned); 'auto' picks CUDA if present (accelerator_kind)."""
    kind = accelerator_kind(kind)
    if kind == "none":
        return None
    if kind == "host":
        return HostAccelerator(capacity, link_bandwidth)
    from tiered.hardware.cuda import CudaAccelerator
    return CudaAccelerator(capacity, pinned="huge" if pinned == "auto" else pinned)  # "auto": the plan's, at PLACE
