"""CUDA accelerator: torch.cuda streams and events, pinned host buffers, non-blocking H2D copies."""

from __future__ import annotations

import bisect
import re
import threading
from contextlib import contextmanager

import torch

from tiered.errors import ConfigError
from tiered.hardware.accelerator import Accelerator, _building_graph
from tiered.hardware.budget import MemoryBudget, host_empty


MiB = 2**20
BLAS_WORKSPACES = 3
"""cuBLAS workspaces a CUDA engine holds at once: the calling thread's on its current stream (attention,
the head, eager GEMMs), the compute worker's on the "compute" stream (GG and CG slices, GPU experts),
and, while a graph is captured, the one its GEMMs are captured with (`CudaAccelerator.capture`)."""


def cublas_workspace_bytes(major: int, config: str | None = None) -> int:
    """Bytes of one cuBLAS workspace as torch sizes it (aten/src/ATen/cuda/CublasHandlePool.cpp): the
    ":SIZE:COUNT" pairs of CUBLAS_WORKSPACE_CONFIG (`config`; SIZE in KiB) summed, else 32 MiB on
    compute capability 9.x, 10.x and 12.x (Hopper, Blackwell) and ":4096:2:16:8" (8.125 MiB) before.
    torch allocates one per (thread, stream) that runs a GEMM, from its caching allocator
    (counted by torch.cuda.memory_allocated), and keeps it until its workspaces are cleared.
    cuBLASLt shares it (TORCH_CUBLASLT_UNIFIED_WORKSPACE, on by default)."""
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return 32 * MiB if major in (9, 10, 12) else 4096 * 1024 * 2 + 16 * 1024 * 8


def clear_blas_workspaces() -> None:
    """Drop the cuBLAS workspaces torch keeps per (thread, stream) (all threads' on torch versions that
    keep one map; the calling thread's where the maps are thread-local). Each is allocated again at
    its next GEMM. A graph captured while one existed would replay into freed memory, so `capture`
    clears them around its captures (its graphs' own come from their pool)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


class CudaAccelerator(Accelerator):
    """One CUDA device with a byte budget (default: its free memory), a copy and a compute stream.

    Raises:
        ConfigError: CUDA is not available.
    """

    async_streams = True  # kernels and cudaMemcpyAsync from page-locked memory return once issued

    def __init__(self, capacity: int | None = None, index: int = 0, pinned: str = "huge") -> None:
        if not torch.cuda.is_available():
            raise ConfigError("no CUDA device is available", "use --accelerator none or host")
        self.device = torch.device("cuda", index)
        free, _total = torch.cuda.mem_get_info(self.device)
        self.budget = MemoryBudget("gpu", capacity if capacity is not None else free)
        self._streams = {"copy": torch.cuda.Stream(self.device), "compute": torch.cuda.Stream(self.device)}
        self._graph_stream = None  # every warm-up and capture of this engine's graphs (`capture`)
        self.pinned = pinned  # host_buffer's kind: "huge" (registered huge pages) or "cuda" (cudaHostAlloc)

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=page_locked(src))

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=page_locked(t))

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu")

    def host_buffer(self, shape, dtype) -> torch.Tensor:
        """Pinned host memory. With `pinned` "huge" (the default), a large buffer is tiered's own
        huge-page memory (budget.host_empty) page-locked in place by cudaHostRegister, and
        unregistered as its last view is freed; small ones, or where huge pages are off or the
        registration fails, come from torch's pinned allocator (cudaHostAlloc, 4 KiB pages).

        Why: the CPU computes from these weights too (CPU experts, CC slices). On the H200 host
        (2026-11-26) a CC slice in cudaHostAlloc memory streamed ~39 GB/s where the same kernel
        read ~80-93 GB/s from ordinary memory (benchmarks/gpu_dram_share.py compares the two);
        with 4 KiB pages every 4 KiB read is a TLB miss."""
        if self.pinned == "huge":
            out = host_empty(shape, dtype, lock=_register)
            if out is not None:
                return out
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    @contextmanager
    def stream(self, name: str, wait: bool = True):
        """Run the body's CUDA work on stream `name`, then wait for it: on a blocking event for "copy"
        (`wait` False: return as soon as it is issued).

        `Stream.synchronize` spin-waits on a 16-core host (CUDA's default schedule spins while cores
        outnumber contexts), so a worker waiting on its copy took a core from the OpenMP team that
        computes CPU experts and CC slices at the same moment (H200 host, 2026-11-26: copy worker
        in `synchronize` for most samples while the CC slice ran at ~49 GB/s of ~93;
        benchmarks/gpu_dram_share.py: a CPU expert streamed 24 GB/s beside a spinning copy wait and
        75 beside a blocking one, of 81 alone). A blocking event sleeps in the driver instead, at the
        price of a wake-up: copies take milliseconds, so they wait that way; the compute stream's
        kernels (tens to hundreds of microseconds) keep the spin.
        """
        s = self._streams[name]
        with torch.cuda.stream(s):
            yield
        if not wait:
            return
        if name != "copy":  # kernels: sub-millisecond, a spin ends soonest and steals a core that long
            s.synchronize()
            return
        done = torch.cuda.Event(blocking=True)
        done.record(s)
        done.synchronize()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def library_workspace_bytes(self) -> int:
        """memory/sizes.library_workspace_bytes of this device: BLAS_WORKSPACES cuBLAS workspaces, 96 MiB on
        an H100 or H200."""
        from tiered.memory.sizes import library_workspace_bytes

        return library_workspace_bytes(torch.cuda.get_device_capability(self.device)[0])

    def trim(self) -> None:
        """torch.cuda.empty_cache(): the caching allocator's free blocks back to the driver. On the H100
        (session 28's memory probe) the dense default's q/k/v parts, freed as each layer's fused weight
        replaced them, kept 420 MiB reserved beyond what was allocated after the load (2230 MiB reserved
        against a 2048 MiB budget)."""
        torch.cuda.empty_cache()

    def release(self) -> None:
        """Wait for the device, then drop the cuBLAS workspaces (clear_blas_workspaces): a closed engine's
        would otherwise stay allocated for the life of the process."""
        torch.cuda.synchronize(self.device)
        clear_blas_workspaces()

    def graph_pool(self):
        return torch.cuda.graph_pool_handle()

    def capture(self, fn, pool=None):
        """torch.cuda.CUDAGraph capture of fn (see Accelerator.capture): two warm-up runs first, as torch
        requires (lazy cuBLAS / cuDNN set-up must not happen in a capture).
        The capture is thread-local: the executor's copy and prefetch workers may still be waiting
        on their own streams' events, which a global capture would refuse them.

        Warm-ups and captures run on one stream per accelerator, passed to every capture that shares
        `pool` (as torch.cuda.graph asks). cuBLAS keeps a workspace per (thread, stream) until cleared:
        a fresh side stream per capture left one 32 MiB workspace per capture, up to torch's 32 pooled
        streams (H100, 2026-11-26: the dense default plan's peak exceeded its 2 GiB budget by 0.37 GiB,
        and ~1 GiB stayed allocated after its engines closed). The workspaces are also cleared around
        each capture, as torch inductor's CUDA graph trees do: the workspace the captured GEMMs use is
        then allocated in the capture, from the graphs' pool, and no workspace a graph uses can be
        freed under it by a later clear (`release`, another engine's or inductor's)."""
        current = torch.cuda.current_stream(self.device)
        if self._graph_stream is None:
            self._graph_stream = torch.cuda.Stream(self.device)
        side = self._graph_stream
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        with _building_graph():  # the warm-ups pick the kernels the capture will (cuDNN attention)
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn()
            current.wait_stream(side)
            clear_blas_workspaces()
            try:
                with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                    out = fn()
            finally:
                clear_blas_workspaces()
        return graph.replay, out

    def record_event(self, blocking: bool = False):
        event = torch.cuda.Event(blocking=blocking)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait_event_host(self, event) -> None:
        if event is not None:
            event.synchronize()

    def page_locked(self, t: torch.Tensor) -> bool:
        return page_locked(t)

    def wait_event(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


# Host ranges this process page-locked in place (`_register`): start address -> end address, and the
# starts sorted. Whether to issue a copy non-blocking is then our own record, not torch's
# Tensor.is_pinned() (cudaPointerGetAttributes): on the H100 host (torch 2.11, 2026-11-26) that answered
# False for a registered huge-page buffer in one pytest-xdist worker of the suite, so its copies would
# have been issued blocking; in a plain process it answered True. Why it differed is not known.
_LOCKED: dict[int, int] = {}
_LOCKED_STARTS: list[int] = []
_LOCKED_MUTEX = threading.Lock()  # loader threads register buffers while others copy from theirs


def page_locked(t: torch.Tensor) -> bool:
    """Whether CPU tensor `t`'s bytes are page-locked, so an H2D copy from them can run asynchronously:
    inside a range `_register` locked (tiered's registered huge pages), or pinned by torch's
    allocator (Tensor.is_pinned, cudaHostAlloc)."""
    ptr = t.data_ptr()
    span = (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size() if t.numel() else 0
    with _LOCKED_MUTEX:
        i = bisect.bisect_right(_LOCKED_STARTS, ptr) - 1
        end = _LOCKED[_LOCKED_STARTS[i]] if i >= 0 else 0
    if ptr + span <= end:  # the bytes the view spans (a strided one spans more than its elements)
        return True
    return t.is_pinned()


def _register(address: int, nbytes: int):
    """Page-lock [address, address + nbytes) in place for DMA (cudaHostRegister) and record the range
    for `page_locked`: its unlock function (cudaHostUnregister, forgetting the range), or None when
    the driver refuses."""
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(address, nbytes, 0)) != 0:
        _clear_last_error()  # else torch's next launch check on this thread reports it
        return None
    with _LOCKED_MUTEX:
        _LOCKED[address] = address + nbytes
        bisect.insort(_LOCKED_STARTS, address)

    def unlock() -> None:
        with _LOCKED_MUTEX:
            _LOCKED.pop(address, None)
            i = bisect.bisect_left(_LOCKED_STARTS, address)
            if i < len(_LOCKED_STARTS) and _LOCKED_STARTS[i] == address:
                del _LOCKED_STARTS[i]
        cudart.cudaHostUnregister(address)

    return unlock


def _clear_last_error() -> None:
    """cudaGetLastError() in the CUDA runtime this process loaded (torch's bindings lack it)."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            path = next(line.split()[-1] for line in f if "libcudart.so" in line)
        ctypes.CDLL(path).cudaGetLastError()
    except (OSError, StopIteration, AttributeError):  # statically linked runtime, or not Linux
        pass
