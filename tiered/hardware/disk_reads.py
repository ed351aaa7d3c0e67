"""Disk reads of experts, timed on the files the runtime will read them from.

The profiler times `disk/read_cold` on a temp file it has just written in the temp directory. Two
things can make that the wrong disk for a plan that keeps experts on disk:

- the checkpoint may live on another device than the temp directory (a second drive, a network
  mount);
- a VM's host may still cache a file its guest has just written: on the 2-core EPYC (2026-11-27)
  the profiler's fresh temp file read at 3.3-3.5 GB/s, the first read of a checkpoint's layer
  file at 0.7-1.4 GB/s (then 3.1 once the host had it), and a 22 MiB expert of the validation
  checkpoint, read as the runtime reads it, at ~1.0 GB/s. A plan priced with the temp file's rate
  put a disk-bound decode step at about half its time.

So when a plan reads experts from disk, the engine times a few expert reads from the checkpoint
itself, the way `ExpertStore.read` does them (memory/expert_store.read_uncached: an expert's adjacent
tensors in one preadv into buffers already in memory, read-ahead off, its pages dropped after), one
reader and the runtime's parallel readers, and plans again with those fits (`with_disk_reads`). The fit is cached per
device and expert layout in <cache dir>/disk_reads.json, keyed also by the profile it refines, so
a new `tiered profile` measures it again. TIERED_DISK_FIT=0 turns it off. Experts the runtime reads from converted
copies in the offload directory (quantized formats) are timed the same way on the copies an earlier load wrote there
(`fitted_offload_reads`); a first load has none and keeps the profile's rate.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from tiered.checkpoint.handle import release_file
from tiered.hardware.profile import HardwareProfile, LinearModel

SAMPLE_BYTES = 1 << 30  # at most about this many bytes read by one fit (reads of 1-4 experts)
# how ExpertStore.read reads, in the cache key: a fit of another way of reading is measured again
# (2: an expert's adjacent tensors in one preadv; 3: medians of three repeats; 4: read-ahead off; 5: parallel samples advised, up to 8 experts)
READ_VERSION = 5


def _first_expert(checkpoint, config) -> list | None:
    """The TensorHandles of the first MoE layer's expert 0 (gate, up, down), or None without experts."""
    from tiered.memory.expert_store import expert_tensor_names, moe_layers

    layers = moe_layers(checkpoint, config)
    return [checkpoint.handle(n) for n in expert_tensor_names(config.model_type, layers[0], 0)] if layers else None


def expert_reads_direct(checkpoint, config, dtype: torch.dtype) -> bool:
    """Whether a disk-tier expert of `checkpoint` in `dtype` is read straight from the checkpoint's
    files (ExpertStore: dense experts stored in `dtype` at a known offset), so that timing reads of
    those files times the runtime's; else the experts would be converted to an offload directory."""
    from tiered.checkpoint.handle import STORED_DTYPES

    hs = _first_expert(checkpoint, config)
    return hs is not None and all(h.offset is not None and STORED_DTYPES.get(h.format) == dtype for h in hs)


def fit_expert_reads(checkpoint, config, dtype: torch.dtype, readers: int = 1,
                     budget_bytes: int = SAMPLE_BYTES) -> LinearModel:
    """disk/read_cold (readers=1) or disk/read_cold_parallel (readers > 1) of `checkpoint`'s experts:
    t [s] = alpha + beta * bytes, fitted on reads of whole experts (1-4 a sample on one reader), each
    read as ExpertStore.read reads one (read_uncached: its adjacent gate, up and down tensors in one
    preadv with the kernel's read-ahead off, their pages dropped from the page cache after) into host
    buffers filled once before (the runtime reads into cache slots and staging buffers that exist
    already). With several readers the sample's experts are
    spread over that many threads at once after each was advised (posix_fadvise WILLNEED), as the
    runtime's read-ahead issues a layer's misses (samples of 2, 4 and 8 experts); n = all bytes of the
    sample. Each sample reads experts no earlier sample read (spread over layers) while the checkpoint
    has any left, their pages dropped first (the files written back before: `write_back`). The sizes are
    interleaved, three repeats each, and the line is fitted through each size's median (one slow read
    does not tilt it: four single samples of two sizes once fitted 2 readers at 27.9 ms + 2.6 GB/s,
    R^2 0.42). At most about `budget_bytes` are read (big experts: fewer repeats, then fewer sizes, never
    under two sizes once); the buffers take `readers` experts of RAM while the fit runs.

    Raises:
        ValueError: the checkpoint has no routed experts stored in `dtype` (expert_reads_direct).
    """
    from tiered.memory.expert_store import expert_tensor_names, moe_layers

    if not expert_reads_direct(checkpoint, config, dtype):
        raise ValueError("the checkpoint's experts are not stored in the compute dtype: the runtime reads them "
                         "from a converted copy, not from these files")
    names = lambda layer, e: expert_tensor_names(config.model_type, layer, e)  # noqa: E731
    keys = [(layer, e) for e in range(config.num_experts) for layer in moe_layers(checkpoint, config)]
    handles = {k: [checkpoint.handle(n) for n in names(*k)] for k in keys}
    return fit_handle_reads(handles, readers, budget_bytes)


def fit_handle_reads(handles: dict, readers: int = 1, budget_bytes: int = SAMPLE_BYTES) -> LinearModel:
    """fit_expert_reads' timing over `handles` ({expert key: [TensorHandle, ...]}, each readable raw: an offset and
    a stored dtype, every expert of the first's sizes), in the keys' order."""
    from tiered.checkpoint.handle import STORED_DTYPES, _fd
    from tiered.hardware.profiler import fit_affine
    from tiered.memory.expert_store import advise, read_uncached, write_back

    keys = list(handles)
    expert_bytes = sum(h.nbytes for h in handles[keys[0]])
    write_back(sorted({h.path for hs in handles.values() for h in hs}))  # dirty pages would not drop
    # experts per sample: a decode layer's few misses (up to top-k: 8 for Qwen-MoE widths)
    sizes = [1, 2, 3, 4] if readers == 1 else [2, 4, 8]
    reps = 3
    while sum(sizes) * reps * expert_bytes > budget_bytes and (reps > 1 or len(sizes) > 2):
        if reps > 1 and (reps > 2 or len(sizes) == 2):  # big experts: fewer repeats, then fewer sizes
            reps -= 1
        else:
            sizes.pop()
    outs = [[torch.zeros(h.shape, dtype=STORED_DTYPES[h.format]) for h in handles[keys[0]]] for _ in range(readers)]
    times: dict[int, list[float]] = {}
    at = 0
    with ThreadPoolExecutor(readers) as pool:
        for _ in range(reps):
            for n in sizes:  # the sizes interleaved, repeat after repeat
                if at + n > len(keys):
                    at = 0
                sample = keys[at:at + n]
                at += n
                for k in sample:  # cold: none of the sample's pages in the page cache
                    for h in handles[k]:
                        os.posix_fadvise(_fd(h.path, inode=h.inode), h.offset, h.nbytes, os.POSIX_FADV_DONTNEED)
                parts = [sample[i::readers] for i in range(readers)]

                def read_part(i: int) -> None:
                    for k in parts[i]:
                        read_uncached(handles[k], outs[i])

                t = time.perf_counter()
                if readers > 1:  # read-ahead: the runtime advises every miss of the layer first
                    for k in sample:
                        advise(handles[k])
                list(pool.map(read_part, range(readers)))
                times.setdefault(len(sample) * expert_bytes, []).append(time.perf_counter() - t)
    nbytes = sorted(times)
    return fit_affine(nbytes, [statistics.median(times[n]) for n in nbytes])


def cache_path() -> Path:
    """The file the engine keeps its disk-read fits in (per device, expert layout and profile): <cache dir>/disk_reads.json."""
    from tiered.checkpoint.tokenizer import cache_dir
    return cache_dir() / "disk_reads.json"


def fitted_disk_reads(profile: HardwareProfile, checkpoint, config, dtype: torch.dtype,
                      readers: int) -> dict[str, LinearModel] | None:
    """{"disk/read_cold", "disk/read_cold_parallel"} fitted on `checkpoint`'s expert reads
    (fit_expert_reads), from the cache when this device, expert layout and profile were fitted before;
    None when the experts are not read from these files, or TIERED_DISK_FIT=0."""
    if os.environ.get("TIERED_DISK_FIT", "1") == "0" or not expert_reads_direct(checkpoint, config, dtype):
        return None
    hs = _first_expert(checkpoint, config)
    key = (f"reads v{READ_VERSION}; dev {os.stat(hs[0].path).st_dev}; expert {[list(h.shape) for h in hs]} {dtype}; readers {readers}; "
           f"profile {profile.source}")
    return _cached_fits(key, lambda n: fit_expert_reads(checkpoint, config, dtype, readers=n), readers)


def _cached_fits(key: str, fit, readers: int) -> dict[str, LinearModel]:
    """The fits cached under `key` in cache_path(), else `fit(1)` (and `fit(readers)` for several readers) measured
    and cached."""
    path = cache_path()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key in cached:
        try:
            return {k: LinearModel(**v) for k, v in cached[key].items()}
        except TypeError:
            pass  # malformed entry: fit again
    fits = {"disk/read_cold": fit(1)}
    if readers > 1:
        fits["disk/read_cold_parallel"] = fit(readers)
    cached[key] = {k: {"alpha": m.alpha, "beta": m.beta, "r2": m.r2} for k, m in fits.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, indent=1))
    except OSError:
        pass  # a read-only cache directory: fit again next time
    return fits


def offload_expert_handles(directory) -> tuple[dict, list] | None:
    """The converted quantized experts an earlier load wrote into offload `directory` (memory/expert_store:
    layer files `experts-layer*.safetensors` of uint8 tensors "expert.N"), as ({(n, file): [its U8 TensorHandle]},
    [(path, inode) held]): every file held open while the fit reads them (handle.hold_file; release_file each
    after), the experts of the commonest size, interleaved across the files. None where there are none."""
    from pathlib import Path

    from tiered.checkpoint.handle import TensorHandle, hold_file
    from tiered.checkpoint.hf_dir import _check_safetensors_file
    from tiered.errors import CheckpointError

    found, held = {}, []
    for path in sorted(Path(directory).glob("experts-layer*.safetensors")):
        try:
            inode = hold_file(str(path))
        except OSError:
            continue
        held.append((str(path), inode))
        try:
            header, n = _check_safetensors_file(path)
        except (CheckpointError, OSError):
            continue
        for name, meta in header.items():
            if name.startswith("expert.") and isinstance(meta, dict) and meta.get("dtype") == "U8":
                begin, end = meta["data_offsets"]
                found[(int(name.split(".")[1]), path.name)] = [TensorHandle(
                    name, (end - begin,), "U8", end - begin, str(path), lambda: None, offset=8 + n + begin, inode=inode)]
    if not found:
        for path, inode in held:
            release_file(path, inode)
        return None
    sizes = [hs[0].nbytes for hs in found.values()]
    common = max(set(sizes), key=sizes.count)
    return {k: found[k] for k in sorted(found) if found[k][0].nbytes == common}, held


def fitted_offload_reads(profile: HardwareProfile, directory, readers: int) -> dict[str, LinearModel] | None:
    """fitted_disk_reads for experts the runtime reads from an offload directory's converted copies (quantized
    formats): fitted on the copies an earlier load wrote there (offload_expert_handles), cached per device, expert
    size and profile; None where the directory holds none yet (a first load: the profile's rate), or
    TIERED_DISK_FIT=0."""
    if os.environ.get("TIERED_DISK_FIT", "1") == "0" or not os.path.isdir(directory):
        return None
    found = offload_expert_handles(directory)
    if found is None:
        return None
    handles, held = found
    try:
        nbytes = next(iter(handles.values()))[0].nbytes
        key = (f"offload reads v{READ_VERSION}; dev {os.stat(directory).st_dev}; expert {nbytes} bytes; "
               f"readers {readers}; profile {profile.source}")
        return _cached_fits(key, lambda n: fit_handle_reads(handles, readers=n), readers)
    finally:
        for path, inode in held:
            release_file(path, inode)


def with_disk_reads(profile: HardwareProfile, fits: dict[str, LinearModel], where: str) -> HardwareProfile:
    """`profile` with its disk read models replaced by `fits` (fitted_disk_reads), and a note in
    meta["notes"] giving both rates."""
    old, new = profile.models.get("disk/read_cold"), fits["disk/read_cold"]
    rate = lambda m: f"{1 / m.beta / 1e9:.2f} GB/s" if m is not None and m.beta > 0 else "?"  # noqa: E731
    note = (f"disk reads of experts timed on {where}: {rate(new)} (alpha {new.alpha * 1e3:.1f} ms), where the "
            f"profile's temp file read {rate(old)}; the plan prices its disk reads with the former")
    meta = dict(profile.meta, notes=list(profile.meta.get("notes", [])) + [note], disk_reads_fitted=where)
    return replace(profile, models={**profile.models, **fits}, meta=meta)
