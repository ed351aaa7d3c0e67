"""Host (CPU RAM) housekeeping: returning memory the process freed to the OS."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.lru_cache(maxsize=1)
def _libc():
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None


def release_load_memory(checkpoint) -> None:
    """Hand the pages of `checkpoint`'s file mapping that a load read (checkpoint.release_pages),
    and the heap's freed temporaries (trim_heap), back to the OS. Objects without release_pages
    (the profiler's stand-in checkpoint) release only the heap."""
    release = getattr(checkpoint, "release_pages", None)
    if release is not None:
        release()
    trim_heap()


def trim_heap() -> bool:
    """glibc's malloc_trim(0): hand the heap's free pages back to the OS.

    glibc keeps freed memory for reuse, and after large frees it raises its mmap threshold, so a
    load's freed temporaries (dequantized blocks, repacking buffers) stay in the resident set
    (~40 MB on SmolLM2). Returns True when memory was released; False off glibc (a no-op).
    """
    lib = _libc()
    return bool(lib.malloc_trim(0)) if lib is not None else False


# below this many bytes a zeroed tensor comes from torch's allocator (a page or two gains nothing)
LAZY_ZEROS_BYTES = 1 << 20


def lazy_zeros(shape: tuple[int, ...], dtype, device="cpu", huge_pages: bool = False):
    """A zeroed tensor of `shape` and `dtype` whose host pages are committed on first write: on the CPU,
    from `LAZY_ZEROS_BYTES` bytes up, an anonymous private mapping (the kernel's zero pages, page-aligned),
    where torch.zeros writes every byte up front. A server's KV cache of max_batch slots x max_context
    positions then costs the RAM of what its sequences have written, not the whole reservation (SmolLM2's 32
    slots x 8192 positions: 5.8 GiB and 2.1 s of zeroing with torch.zeros, nothing at first). The bytes still
    count against the plan's budget (they are reserved, not yet resident). Other devices (CUDA, the
    stand-in accelerator) and small tensors: torch.zeros.

    `huge_pages`: from hardware/budget.HUGE_PAGES_FROM bytes, where huge_pages_enabled() (TIERED_HUGEPAGES=0 turns
    it off), hardware/budget.huge_mapping's (host_empty's) mapping: 2 MiB-aligned, its whole runs advised
    MADV_HUGEPAGE, each committed whole at its first write, and reads of it miss the TLB 512x less often. For a KV
    cache its call fills (generate's, sized to its prompts and max_tokens): SmolLM2's decode after a 1024 / 2048 /
    4096-token prompt, KV caches from torch.zeros, from this mapping on 4 KiB pages and on huge pages, alternated in
    one process (8-12 rounds, 2 AMX cores, 2026-12-07): 233 / 178 / 116-131 tok/s, 225 / 170 / 103-107 and 246 /
    192 / 127-133 (4 KiB pages faulted in as the positions are written read 4-10% slower than torch.zeros' pages,
    written in one sweep). Not for a server's or a chat's slots of max_context positions: a huge page's first write cost
    ~1.3 ms there (the kernel compacting memory for it), so SmolLM2's first prompt in a slot of 4096 positions took
    150 ms instead of 16 (90 MiB of huge pages), and a used slot commits whole.

    Returns:
        Tensor [*shape] of `dtype` on `device`, every element 0.
    """
    import mmap

    import torch

    from tiered.hardware.budget import HUGE_PAGES_FROM, huge_mapping, huge_pages_enabled, nbytes_of

    nbytes = nbytes_of(shape, dtype)
    if not lazily_committed(nbytes, device):
        return torch.zeros(shape, dtype=dtype, device=device)
    if huge_pages and nbytes >= HUGE_PAGES_FROM and huge_pages_enabled():
        return huge_mapping(nbytes)[1].view(dtype).view(shape)  # fresh: the kernel's zero pages
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _map_noreserve())
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor's storage keeps `buf` mapped


def lazily_committed(nbytes: int, device="cpu") -> bool:
    """Whether lazy_zeros of `nbytes` bytes on `device` is an anonymous private mapping (committed on first
    write, its pages handed back by release_pages): on the CPU from LAZY_ZEROS_BYTES up, where mmap has
    MAP_PRIVATE (not Windows)."""
    import mmap

    import torch

    return torch.device(device).type == "cpu" and nbytes >= LAZY_ZEROS_BYTES and hasattr(mmap, "MAP_PRIVATE")


# madvise(2)'s MADV_DONTNEED (Linux, every architecture): the range's private anonymous pages are dropped and read 0
MADV_DONTNEED = 4


def release_pages(address: int, nbytes: int) -> int:
    """Hand back to the OS the whole pages inside the byte range [address, address + nbytes) of a lazily
    committed mapping (lazy_zeros'): madvise MADV_DONTNEED, after which they read 0 and cost no RAM until written
    again. The pages the range's ends cut are kept. The caller vouches that nothing in the range is read as it
    was (KVCache.forget: keys and values behind a sliding window). Returns the bytes handed back (0 where
    nothing whole is inside, off Linux / glibc, or where madvise refuses)."""
    import mmap

    lib = _libc()
    page = mmap.PAGESIZE
    lo = -(-address // page) * page
    hi = (address + nbytes) // page * page
    if hi <= lo or lib is None or not hasattr(lib, "madvise"):
        return 0
    return hi - lo if lib.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED) == 0 else 0


def _map_noreserve() -> int:
    """MAP_NORESERVE where Linux defines it as 0x4000 (x86-64, arm64; Python's mmap names it from 3.12): the
    mapping is not charged to the commit limit up front, so a reservation larger than RAM + swap is not refused
    under the kernel's heuristic overcommit (the plan's budget, --cpu-mem, is what bounds the pages written)."""
    import mmap
    import platform
    import sys

    if hasattr(mmap, "MAP_NORESERVE"):
        return mmap.MAP_NORESERVE
    return 0x4000 if sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64") else 0


def resident_bytes(t) -> int | None:
    """Bytes of CPU tensor `t`'s storage range that are resident in RAM [bytes], by mincore(2) over its pages
    (a page partly inside counted whole, the total capped at the tensor's bytes): what a lazily committed tensor
    (lazy_zeros: a server's KV cache) holds of its reservation. None off the CPU, for an empty tensor, or where
    mincore is unavailable (not Linux / glibc) or refuses the range."""
    import ctypes
    import mmap

    import numpy as np

    nbytes = t.numel() * t.element_size()
    lib = _libc()
    if t.device.type != "cpu" or nbytes == 0 or lib is None or not hasattr(lib, "mincore"):
        return None
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    pages = -(-(t.data_ptr() + nbytes - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    if lib.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) != 0:
        return None
    return min(nbytes, int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1)) * page)
