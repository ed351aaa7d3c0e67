"""Memory budgets: hard byte limits per tier, checked at every allocation."""

from __future__ import annotations

import mmap
import os
import re
import threading
from typing import Callable

from tiered.errors import BudgetError, ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str | int | float | None) -> int | None:
    """'12GiB' / '512MB' / '1.5g' / 1024 -> bytes (int); None -> None.

    Raises:
        ConfigError: the text is not a size.
    """
    if text is None or isinstance(text, (int, float)):
        return None if text is None else int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read {text!r} as a memory size", "write e.g. 12GiB, 512MB or 1073741824")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: int | float) -> str:
    """Bytes as a short human string (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
HUGE_PAGES_FROM = 2 * HUGE_PAGE  # host tensors from this size on are backed by huge pages where they can be


def huge_pages_enabled() -> bool:
    """Whether large host tensors ask for transparent huge pages (Linux; TIERED_HUGEPAGES=0 turns it off)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("TIERED_HUGEPAGES", "1") not in ("0", "false", "no", "off")


def nbytes_of(shape, dtype) -> int:
    """Bytes of a tensor [shape] of `dtype`."""
    import torch

    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class _Mapping(mmap.mmap):
    """An anonymous mapping that runs `release` (when set) as the last tensor viewing it is freed,
    before it is unmapped (a page-locked range is unregistered first)."""

    release = None

    def __del__(self) -> None:
        release, self.release = self.release, None
        if release is not None:
            release()


def huge_mapping(n: int) -> tuple[_Mapping, "torch.Tensor"]:
    """A fresh anonymous mapping with n bytes starting on a 2 MiB boundary, its whole 2 MiB runs
    advised MADV_HUGEPAGE before the first touch: (mapping, uint8 [n] view at that boundary). Fresh, so every
    byte reads 0 until written (memory/host.lazy_zeros takes it so)."""
    import torch

    m = _Mapping(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = torch.frombuffer(m, dtype=torch.uint8)  # holds `m` while any view of it lives
    start = -buf.data_ptr() % HUGE_PAGE
    try:
        m.madvise(mmap.MADV_HUGEPAGE, start, n // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # THP "never", or an old kernel: plain pages
        pass
    return m, buf[start:start + n]


def host_empty(shape: tuple[int, ...], dtype, lock: Callable[[int, int], Callable[[], None] | None] | None = None):
    """An uninitialized CPU tensor [shape] of `dtype`; from HUGE_PAGES_FROM bytes on, its whole 2 MiB
    runs backed by transparent huge pages (an anonymous mapping aligned to 2 MiB, madvise
    MADV_HUGEPAGE on those runs only, so the tail stays in 4 KiB pages and nothing is resident
    beyond the tensor's own bytes).

    Why: decode streams weights at the memory's rate, and with 4 KiB pages every 4 KiB of a weight
    costs a TLB miss. Measured on the 2-core AVX2 EPYC (THP "madvise"): an OLMoE-width int4 expert
    (4.3 MB) at batch 1, cycled over 64, took 0.305 ms on huge pages vs 0.334 ms on 4 KiB pages,
    interleaved (int8: 0.390 vs 0.395). On the 2-core AVX-512 EPYC (2026-11-26), a Mixtral-width
    bf16 expert (352 MB) through the native GEMV, interleaved 30 times in one process, three
    processes: 26.6 / 34.5 / 27.5 GB/s on 4 KiB pages, 32.8 / 44.4 / 31.3 on huge pages.
    Elsewhere, or with TIERED_HUGEPAGES=0: torch.empty.

    Args:
        lock: page-locks a range in place, lock(address, nbytes) -> its unlock function, or None
            when it could not (CudaAccelerator: cudaHostRegister / cudaHostUnregister). Given, the
            huge-page tensor is locked, and unlocked as its last view is freed; None is returned
            (nothing kept) when huge pages are off, the tensor is small or the lock fails.
    Returns:
        The tensor (or None with `lock`, as above).
    """
    import torch

    n = nbytes_of(shape, dtype)
    if n < HUGE_PAGES_FROM or not huge_pages_enabled():
        return torch.empty(shape, dtype=dtype) if lock is None else None
    m, buf = huge_mapping(n)
    if lock is not None:
        m.release = lock(buf.data_ptr(), _round_up(n, mmap.PAGESIZE))
        if m.release is None:
            return None
    return buf.view(dtype).view(shape)


class HostSlab:
    """Host tensors carved from one buffer, each starting on a page: `alloc`'s (Accelerator.host_buffer:
    pinned on CUDA) or host_empty's, so many tensors too small for huge pages of their own (a MoE
    model's CPU experts: Qwen3-30B-A3B's are ~3 MB each in int4) stream from huge pages as a large
    one does. Measured on the 2-core EPYC (2026-11-26), the cpu_moe benchmark's Qwen3-width int4
    model (1024 experts of 3.1 MB), two engines in one process alternated: experts allocated one by
    one 72.0 tok/s, moved into one huge-page arena 108.2 (74.4 vs 108.9 in the other order); this
    slab on 4 KiB pages (TIERED_HUGEPAGES=0) 92.9, on huge pages 108.9. The price is in the load on
    that VM: faulting huge pages in runs at ~0.75-1.5 GB/s there (4 KiB pages ~4 GB/s), so that
    model loads in 10.5-12.5 s instead of ~9 (the slab is touched in one pass first).

    Args:
        nbytes: capacity (use `bytes_for`).
        alloc: alloc((nbytes,), torch.uint8) -> the buffer (default host_empty).
        prefault: touch host_empty's huge pages in one pass now (False: as the tensors are written).
    """

    ALIGN = 4096

    def __init__(self, nbytes: int, alloc: Callable | None = None, prefault: bool = True) -> None:
        import torch

        raw = (alloc or host_empty)((nbytes + self.ALIGN,), torch.uint8)  # a small one may start off a page
        start = -raw.data_ptr() % self.ALIGN
        self.buf = raw[start:start + nbytes]
        self.used = 0
        if prefault and alloc is None and nbytes >= HUGE_PAGES_FROM and huge_pages_enabled():
            # fault the huge pages in now, in one pass: faulted inside the experts' parallel repacking
            # (two threads on one huge page) the cpu_moe model loaded in 14.9 s, touched first in 10.7-12.5
            self.buf.zero_()

    @classmethod
    def bytes_for(cls, count: int, shapes, dtype) -> int:
        """Bytes `count` groups of tensors of `shapes` (each tensor page-aligned) take in a slab."""
        return count * sum(_round_up(nbytes_of(s, dtype), cls.ALIGN) for s in shapes)

    def take(self, shape, dtype):
        """The next uninitialized [shape] tensor of `dtype` in the slab.

        Raises:
            MemoryError: the slab is full (it was sized for fewer tensors).
        """
        n = nbytes_of(shape, dtype)
        if self.used + n > self.buf.numel():
            raise MemoryError(f"host slab of {self.buf.numel()} bytes is full")
        out = self.buf[self.used:self.used + n].view(dtype).view(tuple(shape))
        self.used += _round_up(n, self.ALIGN)
        return out


# Storages from this size on join move_to_huge_pages' arena [bytes]: a small model's projections
# (SmolLM2's int4 decode copies: 0.1-1 MB each) stream from RAM every token as a large one's do.
ARENA_FROM = 64 << 10
TRIM_EVERY = 16 << 20  # bytes moved between heap trims (glibc keeps freed chunks resident until one)


def move_to_huge_pages(module, skip: Callable | None = None, min_bytes: int = ARENA_FROM) -> int:
    """Move `module`'s CPU tensors (parameters, buffers and tensor attributes of every submodule)
    onto transparent huge pages in place: every torch-allocated storage of at least `min_bytes` is
    copied into one HostSlab arena (each at a page boundary) and every tensor viewing it is
    re-pointed (Tensor.set_, same offsets and strides), so the modules, and anything holding those
    tensor objects, see the new memory. Why: host_empty's (decode streams the weights every token,
    and with 4 KiB pages each 4 KiB costs a TLB miss); one arena puts a small model's many small
    matrices on huge pages too, as a large model's.

    A storage is left where it is when something outside the module also holds it (its use count
    exceeds the module's tensors: moving it would keep both copies), when torch did not allocate
    it (a file or numpy mapping: not resizable; host_empty's own memory), or when huge pages are
    off or the arena would be under HUGE_PAGES_FROM. Call it before native kernels take pointers
    to these tensors.

    Args:
        skip: skip(submodule, attribute name) -> True for tensors to leave where they are (the
            dense weights of projections that decode through their own copies: read by prompts
            only, where the GEMMs are compute-bound).
        min_bytes: the smallest storage moved.
    Returns:
        Bytes moved.
    """
    import torch

    if not huge_pages_enabled():
        return 0
    groups: dict[int, dict[int, torch.Tensor]] = {}
    for m in module.modules():
        found = list(m._parameters.items()) + list(m._buffers.items()) + \
            [(k, v) for k, v in vars(m).items() if isinstance(v, torch.Tensor) and not k.startswith("_")]
        for name, t in found:
            if t is None or (skip is not None and skip(m, name)):
                continue
            if t.device.type == "cpu" and type(t) in (torch.Tensor, torch.nn.Parameter):
                group = groups.setdefault(t.untyped_storage().data_ptr(), {})
                group[id(t)] = t
                if t._base is not None:  # a view keeps its base tensor alive: it moves too
                    group[id(t._base)] = t._base
    todo = []
    for tensors in groups.values():
        storage = next(iter(tensors.values())).untyped_storage()
        n = storage.nbytes()
        # one reference per tensor found, plus `storage` itself: nobody else holds this memory
        if n >= min_bytes and storage.resizable() and torch._C._storage_Use_Count(storage._cdata) == len(tensors) + 1:
            todo.append((n, tensors))
        del storage
    total = HostSlab.bytes_for(1, [(n,) for n, _ in todo], torch.uint8)
    if total < HUGE_PAGES_FROM:
        return 0
    from tiered.memory.host import trim_heap

    # not prefaulted: each old copy is freed as its new one fills in (peak RSS)
    arena = HostSlab(total, prefault=False)
    since_trim = 0
    for n, tensors in todo:
        dst = arena.take((n,), torch.uint8)
        first = next(iter(tensors.values()))
        dst.copy_(torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage(), 0, (n,), (1,)))
        base, target = dst.storage_offset(), dst.untyped_storage()  # bytes into the mapping: whole pages
        with torch.no_grad():
            for t in tensors.values():
                size = t.element_size()
                t.set_(target, (base + t.storage_offset() * size) // size, t.shape, t.stride())
        since_trim += n
        if since_trim >= TRIM_EVERY:  # the old copies go back to the OS as the arena fills: peak RSS
            trim_heap()
            since_trim = 0
    trim_heap()
    return sum(n for n, _ in todo)


class MemoryBudget:
    """A tier's byte budget. Thread-safe; `reserve` raises before the limit is crossed.

    Args:
        name: tier name for messages ("gpu", "cpu").
        capacity: limit in bytes; None = unlimited.
    """

    def __init__(self, name: str, capacity: int | None) -> None:
        self.name, self.capacity = name, capacity
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()

    @property
    def free(self) -> float:
        return float("inf") if self.capacity is None else self.capacity - self.used

    def fits(self, nbytes: int) -> bool:
        return self.capacity is None or self.used + nbytes <= self.capacity

    def reserve(self, nbytes: int, what: str = "") -> None:
        """Account `nbytes` more. Raises BudgetError (nothing reserved) if it would exceed capacity."""
        with self._lock:
            if self.capacity is not None and self.used + nbytes > self.capacity:
                raise BudgetError(
                    f"{self.name} budget exceeded: {what or 'allocation'} needs {format_bytes(nbytes)}, "
                    f"{format_bytes(self.capacity - self.used)} of {format_bytes(self.capacity)} left",
                    f"raise --{self.name}-mem or place more on a slower tier")
            self.used += nbytes
            self.peak = max(self.peak, self.used)

    def empty(self, shape: tuple[int, ...], dtype, what: str = "", alloc: Callable | None = None):
        """An uninitialized host tensor reserved against this budget: alloc(shape, dtype) where
        given (Accelerator.host_buffer: memory the link copies from, pinned on CUDA), else
        `host_empty` (transparent huge pages when large).

        Raises BudgetError (nothing reserved) when it does not fit.
        """
        n = nbytes_of(shape, dtype)
        self.reserve(n, what)
        try:
            return (alloc or host_empty)(shape, dtype)
        except BaseException:
            self.release(n)
            raise

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes
            assert self.used >= 0, f"{self.name} budget released more than reserved"
