"""Executor: the worker threads' torch CPU ops stay on one thread, nobody else's thread count moves."""

from __future__ import annotations

import threading

import torch

from tiered.hardware.accelerator import HostAccelerator
from tiered.runtime.executor import Executor


def test_workers_run_their_cpu_ops_alone_and_leave_other_threads_be():
    """A copy / compute / disk worker with torch's default thread count grows a second OpenMP team
    that fights the calling thread's (executor.one_cpu_thread). Its own count is 1; the calling
    thread's, and the default of a thread that starts afterwards (a server's engine thread), stay."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    ex = Executor(HostAccelerator(None), disk_readers=2, inline=("cpu",))
    try:
        # a parallel op first: torch's per-thread set-up must not undo the worker's count at it
        work = lambda: (torch.randn(4096, 256).sum(dim=1), torch.get_num_threads())[1]  # noqa: E731
        assert ex.submit("copy", work).result() == 1
        assert ex.submit("compute", work).result() == 1
        assert ex.submit("disk", work).result() == 1
        assert ex.submit("cpu", work).result() == 2  # inline: the calling thread's team does the CPU compute
        assert torch.get_num_threads() == 2
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert seen == [2]
    finally:
        ex.close()
        torch.set_num_threads(before)
