"""CUDA accelerator: torch.cuda streams and events, pinned host buffers, non-blocking H2D copies."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from tiered.errors import ConfigError
from tiered.hardware.accelerator import Accelerator
from tiered.hardware.budget import MemoryBudget


class CudaAccelerator(Accelerator):
    """One CUDA device with a byte budget (default: its free memory), a copy and a compute stream.

    Raises:
        ConfigError: CUDA is not available.
    """

    def __init__(self, capacity: int | None = None, index: int = 0) -> None:
        if not torch.cuda.is_available():
            raise ConfigError("no CUDA device is available", "use --accelerator none or host")
        self.device = torch.device("cuda", index)
        free, _total = torch.cuda.mem_get_info(self.device)
        self.budget = MemoryBudget("gpu", capacity if capacity is not None else free)
        self._streams = {"copy": torch.cuda.Stream(self.device), "compute": torch.cuda.Stream(self.device)}

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=src.is_pinned())

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=t.is_pinned())

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu")

    def host_buffer(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    @contextmanager
    def stream(self, name: str):
        s = self._streams[name]
        with torch.cuda.stream(s):
            yield
        s.synchronize()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def record_event(self):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait_event(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
