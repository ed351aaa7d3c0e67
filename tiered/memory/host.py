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
