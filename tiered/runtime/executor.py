"""Executor: runs tasks on named streams with explicit dependencies, and traces each one.

Streams are worker threads, one per stream name, so tasks on one stream run in submission order
and tasks on different streams overlap: "cpu" (CPU expert compute), "copy" (H2D copies),
"compute" (accelerator compute), "disk:N" (N reader threads). On CUDA the "copy" and "compute"
workers issue their work inside the matching torch.cuda stream and wait for it, so a task's end
time is when the device finished it. Dependencies are the futures of earlier tasks.

Inline streams run on the submitting thread when it asks for the result (DeferredTask): "cpu"
(torch's OpenMP team belongs to that thread) and "launch": accelerator work issued on the calling
thread's current stream without waiting for it (a task's trace span is its launch). A "launch"
task records a device event after its work; device-stream tasks that depend on it wait for that
event on the device (e.g. a copy into a buffer that a launched kernel still reads). A copy from
page-locked memory may instead be issued by the submitting thread itself (`Executor.issue`, CUDA):
its future is done at once and carries the event of its end, which the tasks after it wait for on
the device.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable

from tiered.runtime.trace import TraceEvent

DEVICE_STREAMS = ("copy", "compute")


class DeferredTask:
    """A task of an inline stream: it runs on the thread that submitted it, when that thread first
    asks for its result (after its dependencies). Other threads asking wait until it has run.

    Used for CPU compute when there is no accelerator: torch's OpenMP thread team belongs to the
    calling thread, and a second team on a worker thread fights the idle-spinning first one for the
    cores (measured: one expert 1.7 ms inline vs 3.2 ms on a worker thread on 2 cores).
    """

    def __init__(self, job: Callable[[], Any]) -> None:
        self._job, self._owner = job, threading.get_ident()
        self._event, self._ran = threading.Event(), False
        self._value: Any = None
        self._error: BaseException | None = None
        self.event = None  # device event after a "launch" task's work

    def result(self) -> Any:
        if threading.get_ident() == self._owner and not self._ran:
            self._ran = True
            try:
                self._value = self._job()
            except BaseException as e:  # handed to every waiter
                self._error = e
            finally:
                self._event.set()
        else:
            self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def done(self) -> bool:
        return self._event.is_set()


def one_cpu_thread() -> None:
    """Thread initializer of the copy / compute / disk workers: their torch CPU ops (a staging copy,
    a gather of weight rows) run on the worker alone. With torch's default a worker grows a second
    OpenMP team of every core, whose threads spin after each of its ops and fight the team of the
    calling thread, which does the CPU compute: on the host stand-in's 2 cores each index_add_ of an
    MoE layer's combine took 0.23 ms instead of 0.013 once the copy worker had run one, and the
    balanced MoE path decoded at 68 tok/s against 137 with this (benchmarks/gpu_stall_probe.py --smoke).

    Only this thread's OpenMP thread count changes (omp_set_num_threads; OpenMP keeps it per thread).
    torch.set_num_threads would also set torch's default for threads that start later, such as a
    server's engine thread. torch's own per-thread set-up runs first (get_num_threads), so that it
    does not reset the count at this thread's first parallel op."""
    import torch

    torch.get_num_threads()
    set_threads = _omp_set_num_threads()
    if set_threads is not None:
        set_threads(1)


def _omp_set_num_threads():
    """omp_set_num_threads of the OpenMP runtime torch loaded, or None when none is visible."""
    import ctypes

    try:
        return ctypes.CDLL(None).omp_set_num_threads
    except (AttributeError, OSError):
        return None


class Executor:
    """Task runner over streams.

    Args:
        accelerator: the Accelerator whose "copy"/"compute" streams device tasks use (None = CPU only).
        disk_readers: reader threads for disk reads (stream names disk:0 .. disk:N-1).
        trace: record a TraceEvent per task.
        inline: stream names whose tasks run deferred on the submitting thread (DeferredTask).
    """

    def __init__(self, accelerator=None, disk_readers: int = 2, trace: bool = False,
                 inline: tuple[str, ...] = ()) -> None:
        self.accelerator = accelerator
        self.inline = set(inline) | {"launch"}  # "launch" always issues from the submitting thread
        names = ["cpu"] + (list(DEVICE_STREAMS) if accelerator is not None else [])
        self._pools = {n: ThreadPoolExecutor(1, thread_name_prefix=f"tiered-{n}",
                                             initializer=None if n == "cpu" else one_cpu_thread) for n in names}
        self._disk = ThreadPoolExecutor(max(1, disk_readers), thread_name_prefix="tiered-disk",
                                        initializer=one_cpu_thread)
        self._disk_ids: dict[int, int] = {}
        self.tracing = trace
        self.events: list[TraceEvent] = []
        self._lock = threading.Lock()
        self.t0 = time.perf_counter()

    def submit(self, stream: str, fn: Callable[[], Any], deps: Iterable[Future] = (), name: str = "",
               nbytes: int = 0, layer: int | None = None, expert: int | None = None, after_event=None,
               issue_here: bool = False) -> Future:
        """Run `fn()` on `stream` after every future in `deps` is done. Returns its Future.

        `after_event` (from Accelerator.record_event) makes a device stream wait, on the device, for
        the work that event marks (e.g. the router's output) instead of the host waiting for it.

        `issue_here`: a device-stream task whose dependencies are all done, on an accelerator whose
        streams run asynchronously (Accelerator.async_streams; the caller vouches that `fn` issues
        nothing that blocks: kernels, copies from page-locked memory), is issued on this thread at
        once (`issue`) instead of by the stream's worker: see there. Take its result with `join`.

        Raises (through the future): whatever `fn` or a dependency raised.
        """
        deps = tuple(deps)
        if (issue_here and stream in DEVICE_STREAMS and self.accelerator.async_streams
                and all(d.done() for d in deps)):
            return self.issue(stream, fn, deps, name, nbytes, layer, expert, after_event)

        task: list = []

        def job():
            for d in deps:
                d.result()
            if stream in DEVICE_STREAMS:  # a copy issued by another thread: sleep until it lands (see `issue`)
                for d in deps:
                    if getattr(d, "issued", False):
                        self.accelerator.wait_event_host(d.event)
            start = time.perf_counter()
            if stream in DEVICE_STREAMS:
                with self.accelerator.stream(stream):
                    self.accelerator.wait_event(after_event)
                    for d in deps:
                        self.accelerator.wait_event(getattr(d, "event", None))
                    out = fn()
            else:
                if stream == "launch":  # after copies issued here (`issue`): their end, on the device
                    for d in deps:
                        self.accelerator.wait_event(getattr(d, "event", None))
                out = fn()
                if stream == "launch":
                    task[0].event = self.accelerator.record_event()
            end = time.perf_counter()
            if self.tracing:
                label = stream if stream != "disk" else f"disk:{self._disk_id()}"
                with self._lock:
                    self.events.append(TraceEvent(name or stream, label, start - self.t0, end - self.t0,
                                                  nbytes, layer, expert))
            return out

        if stream in self.inline:
            task.append(DeferredTask(job))
            return task[0]  # type: ignore[return-value]
        pool = self._disk if stream == "disk" else self._pools[stream]
        return pool.submit(job)

    def issue(self, stream: str, fn: Callable[[], Any], deps: tuple = (), name: str = "", nbytes: int = 0,
              layer: int | None = None, expert: int | None = None, after_event=None) -> Future:
        """Issue `fn()` on device stream `stream` from this thread, without waiting for the device: a
        done Future whose `.event` marks the work's end, which "launch" and device-stream tasks that
        depend on it wait for on the device (`join` for this thread's own stream). Its result (a
        kernel's output tensor) may still be computing until that event. `deps` must be done.

        Why: a stream's worker needs a core to issue its work, and while this thread's OpenMP team
        computes CPU experts or a CC slice it has none. On the H100's 16-core host (2026-11-26) a
        layer's H2D copy beside a CPU expert started up to 3.6 ms late. Issued here, before the CPU
        work, a copy or a GEMM costs this thread microseconds and the device starts at once. Traced,
        the worker still waits for the event and records the span from issue to the work's end.

        The event is a blocking one: a device-stream task that depends on the work (a sliced FFN's
        CG GEMM issued by the compute worker after a copy issued here) sleeps on it before issuing
        its kernels, as it slept on the copy worker's future before, instead of spinning in its
        stream's synchronize for the whole copy (a core taken from the CPU's OpenMP team)."""
        start = time.perf_counter()
        done: Future = Future()
        done.event, done.issued = None, True  # type: ignore[attr-defined]
        try:
            with self.accelerator.stream(stream, wait=False):
                self.accelerator.wait_event(after_event)
                for d in deps:
                    d.result()
                    self.accelerator.wait_event(getattr(d, "event", None))
                out = fn()
                done.event = event = self.accelerator.record_event(blocking=True)  # type: ignore[attr-defined]
        except BaseException as e:  # through the future, as a worker's task raises
            done.set_exception(e)
            return done
        done.set_result(out)
        if self.tracing:
            def landed():
                self.accelerator.wait_event_host(event)
                with self._lock:
                    self.events.append(TraceEvent(name or stream, stream, start - self.t0, time.perf_counter() - self.t0,
                                                  nbytes, layer, expert))
            self._pools[stream].submit(landed)
        return done

    def join(self, fut: Future) -> Any:
        """`fut`'s result for work on the calling thread's current stream: where `fut` was issued here
        (`issue`: its result may still be computing on a device stream) the current stream first waits
        for its event, on the device; a worker's device task has finished on its stream already."""
        out = fut.result()
        if getattr(fut, "issued", False):
            self.accelerator.wait_event(fut.event)
        return out

    def _disk_id(self) -> int:
        ident = threading.get_ident()
        with self._lock:
            return self._disk_ids.setdefault(ident, len(self._disk_ids))

    def record(self, name: str, stream: str, start: float, end: float, **kw) -> None:
        """Add an event measured elsewhere (e.g. the main thread's attention) to the trace."""
        if self.tracing:
            with self._lock:
                self.events.append(TraceEvent(name, stream, start - self.t0, end - self.t0, **kw))

    def close(self) -> None:
        for p in list(self._pools.values()) + [self._disk]:
            p.shutdown(wait=True)
