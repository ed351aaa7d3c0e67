"""Peak memory per tier over a block of work: the GPU and the process's resident set.

    with PeakMemory() as peak:
        ...                      # load a model, generate
    peak.gpu_bytes, peak.rss_bytes

GPU: torch.cuda.max_memory_allocated after reset_peak_memory_stats (the caching allocator's
live tensors; reserved-but-free blocks and CUDA context are not counted), less what was allocated
when the block began: what an earlier engine in the process left allocated is not the block's.
What the block itself leaves allocated is `gpu_left_bytes`. CPU: the process's
RSS high-water mark (VmHWM), reset at the start through /proc/self/clear_refs where Linux allows
it; elsewhere the peak since the process started (ru_maxrss), which can only overstate.
"""

from __future__ import annotations

import re
import resource
from pathlib import Path


class PeakMemory:
    """Context manager measuring peak GPU bytes and peak RSS bytes over its block.

    Attributes (set on exit):
        gpu_bytes: peak bytes allocated by torch on the current CUDA device beyond those allocated at
            the start (gpu_start_bytes); None without CUDA.
        gpu_start_bytes: bytes allocated at the start (an earlier engine's leftovers, say).
        gpu_left_bytes: bytes allocated at the end beyond gpu_start_bytes (negative when the block
            freed earlier allocations): what a block that closes its engine leaked.
        rss_bytes: peak resident set of this process [bytes] (includes python, torch and
            anything loaded before the block).
        rss_reset: True when the RSS peak was reset at the start (it covers the block only).
    """

    def __init__(self, cuda: bool | None = None) -> None:
        import torch

        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.gpu_bytes: int | None = None
        self.gpu_start_bytes: int | None = None
        self.gpu_left_bytes: int | None = None
        self.rss_bytes: int | None = None
        self.rss_reset = False

    def __enter__(self) -> "PeakMemory":
        if self.cuda:
            import torch
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.gpu_start_bytes = torch.cuda.memory_allocated()
        self.rss_reset = _reset_rss_peak()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            import torch
            torch.cuda.synchronize()
            self.gpu_bytes = torch.cuda.max_memory_allocated() - self.gpu_start_bytes
            self.gpu_left_bytes = torch.cuda.memory_allocated() - self.gpu_start_bytes
        self.rss_bytes = _rss_peak()


def _reset_rss_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _rss_peak() -> int:
    try:
        m = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
        if m:
            return int(m.group(1)) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
