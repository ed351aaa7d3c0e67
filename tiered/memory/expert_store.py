"""ExpertStore: the home copy of every expert on its tier (fast, CPU RAM or disk).

Fast-tier experts are materialized directly in accelerator memory (or, with no accelerator, in
RAM under the RAM budget), CPU-tier experts in host memory (pinned when a GPU exists), and
disk-tier experts stay where they are in the checkpoint: they are read on demand with pread
straight into a cache slot or staging buffer, never mapped or copied whole into RAM. A checkpoint
whose experts are not stored in the compute dtype gets a converted copy in `offload_dir`.

Experts are kept in the plan's expert format (quant/experts.py ExpertFormat) on every tier: a
quantized expert is one flat byte buffer, written once into the fast tier, host RAM or an offload
file, and `read` moves those bytes (never a dequantized copy). GGUF blocks that map exactly onto a
kernel format are repacked without dequantizing (quant/gguf_experts.py says which do).
"""

from __future__ import annotations

import os
import shutil
import threading
import weakref
from pathlib import Path

import torch

from tiered.checkpoint.handle import STORED_DTYPES, TensorHandle, _fd, hold_file, release_file
from tiered.checkpoint.hf_dir import _check_safetensors_file
from tiered.errors import CheckpointError, ConfigError
from tiered.hardware.budget import HostSlab, MemoryBudget, format_bytes
from tiered.memory.host import release_load_memory
from tiered.planner.placement import CPU, DISK, FAST, ExpertPlacement
from tiered.quant.experts import ExpertFormat

# Encoding experts from a mapped file (GGUF blocks) touches its pages, which count in RSS until
# released: every this many bytes of encoded experts, the load hands them back (memory/host.py), so
# a Q8_0 Qwen3-MoE file of 5.4 GB peaks at about its slots' size, not twice it.
RELEASE_EVERY = 256 << 20
_TORCH_TO_ST = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def expert_tensor_names(model_type: str, layer: int, expert: int) -> tuple[str, str, str]:
    """HF names of one expert's (gate, up, down) weights."""
    if model_type == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
        return f"{p}.w1.weight", f"{p}.w3.weight", f"{p}.w2.weight"
    p = f"model.layers.{layer}.mlp.experts.{expert}"
    return f"{p}.gate_proj.weight", f"{p}.up_proj.weight", f"{p}.down_proj.weight"


def moe_layers(checkpoint, config) -> list[int]:
    """Indices of layers whose checkpoint holds routed experts."""
    return [l for l in range(config.num_hidden_layers)
            if checkpoint.has(expert_tensor_names(config.model_type, l, 0)[0])]


def write_back(paths, drop: bool = False) -> None:
    """Write any dirty page cache pages of `paths` to the disk (fdatasync), so that a later
    posix_fadvise DONTNEED can drop them: it drops clean pages only. A checkpoint written just before
    (a conversion, a benchmark's dummy) otherwise stays in the page cache through every drop, and its
    "cold" reads run at memory speed: the validation checkpoint's expert reads were fitted at 6.9 GB/s
    a minute after it was written, where cold ones ran 1.4 (2-core EPYC, 2026-11-30). Files that refuse
    (no such call on their file system) are skipped. `drop`: then drop each file's pages (DONTNEED)
    through the same descriptor."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            try:
                os.fdatasync(fd)
            except OSError:
                pass
            if drop:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_page_cache(paths) -> None:
    """Ask the kernel to drop cached pages of `paths` (written back first, `write_back`; then
    posix_fadvise DONTNEED): the next read is cold."""
    write_back(paths, drop=True)


def read_uncached(handles, out) -> None:
    """Read each tensor of `handles` into the host tensor of `out` beside it (pread, no mapping), then drop
    the pages read from the OS page cache (posix_fadvise DONTNEED): what tiered keeps in RAM is what its
    budget and cache hold, not a second, unaccounted copy in the page cache (real offloading engines
    read with O_DIRECT for the same reason). So a re-read of an evicted expert costs a real disk read,
    as it would for a model bigger than RAM. How a disk-tier expert is read (ExpertStore.read).

    Tensors stored next to each other in one file (an expert's gate, up and down weights, as
    safetensors writers lay them out) are read with one preadv into their several buffers and dropped
    with one call, through a descriptor with the kernel's read-ahead off (POSIX_FADV_RANDOM). With
    read-ahead on, one 22 MiB read left the next 11 MiB of the file in the page cache, outside every
    budget (155 MiB over a run of the validation checkpoint), and decode on demand from disk ran at
    244-297 ms a token against 376-416 with a read per tensor, helped by what the kernel had read
    past each expert outside the budget. With read-ahead off the two ways ran alike on the 2-core EPYC
    (407-425 against 420 ms a token, interleaved runs; one expert alone 17-23 ms either way). A tensor
    not stored in its buffer's dtype, or not beside the others, is read alone (TensorHandle.read_into).
    The drop costs ~2 ms a 22 MiB expert there; queued as a disk task of its own after the read, so an
    expert's compute need not wait for it, it did not pay (LRU decode
    446 against 456 ms a token, read-ahead decode 311 against 295: the drops then compete with the
    reads).

    Raises:
        OSError: the file cannot be read.
    """
    runs: list[list] = []  # [path, offset, bytes, [(handle, out)], inode]: contiguous bytes of one file
    alone = []
    for h, t in sorted(zip(handles, out), key=lambda p: (p[0].path, p[0].offset if p[0].offset is not None else -1)):
        if not (h.offset is not None and STORED_DTYPES.get(h.format) == t.dtype and t.is_contiguous()
                and t.nbytes == h.nbytes):
            alone.append((h, t))
        elif runs and runs[-1][0] == h.path and runs[-1][4] == h.inode and runs[-1][1] + runs[-1][2] == h.offset:
            runs[-1][2] += h.nbytes
            runs[-1][3].append((h, t))
        else:
            runs.append([h.path, h.offset, h.nbytes, [(h, t)], h.inode])
    for path, offset, nbytes, members, inode in runs:
        fd = _fd(path, random_access=True, inode=inode)
        if os.preadv(fd, [_bytes_of(t) for _, t in members], offset) != nbytes:
            for h, t in members:  # a short read (a run over 2 GiB): each by itself (read_into retries)
                h.read_into(t)
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
    for h, t in alone:
        h.read_into(t)
        if h.offset is not None:
            os.posix_fadvise(_fd(h.path, inode=h.inode), h.offset, h.nbytes, os.POSIX_FADV_DONTNEED)


def advise(handles) -> None:
    """Hint the kernel to start reading the tensors of `handles` now (posix_fadvise WILLNEED): how
    read-ahead issues a layer's disk reads before its reader threads read them (read_uncached)."""
    for h in handles:
        if h.offset is not None:
            os.posix_fadvise(_fd(h.path, inode=h.inode), h.offset, h.nbytes, os.POSIX_FADV_WILLNEED)


def _save_whole(tensors: dict, path: Path, hint: str, metadata: dict[str, str] | None = None) -> None:
    """save_file `tensors` (and `metadata`) to `path` whole or not at all: written under a temporary name beside it
    and renamed, so a failed write (disk full, permission denied) leaves no partial file.

    Raises:
        ConfigError: the file cannot be written; names the directory and why.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    # a name of this writer's own: two loads converting into one directory at once each write their own file
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.partial")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    except (OSError, SafetensorError) as e:
        tmp.unlink(missing_ok=True)
        why = getattr(e, "strerror", None) or str(e).removeprefix("Error while serializing: ")
        raise ConfigError(f"offload directory {path.parent}: writing {path.name} failed ({why})", hint) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def default_offload_dir(source) -> Path:
    """Where a checkpoint's converted disk experts go when no offload directory is given (EngineConfig.offload_dir
    None): <tiered's cache>/offload/<its name>-<a hash of its real path>, so that later loads of it find them
    (ExpertStore._convert reads a file written for the same experts instead of converting again)."""
    import hashlib

    from tiered.checkpoint.tokenizer import cache_dir

    real = os.path.realpath(source)
    return cache_dir() / "offload" / f"{Path(real).stem}-{hashlib.sha1(real.encode()).hexdigest()[:12]}"


def evict_offload_files(root: Path, need: int, keep) -> tuple[int, int]:
    """Delete the least recently used converted layer files under tiered's default offload root (`root`:
    <cache>/offload, one directory per checkpoint, default_offload_dir) until `need` more bytes are free: files of
    other checkpoints, and of this one's earlier placements or formats, oldest modification time first (a load
    that reads a file as it is touches it, ExpertStore._convert). Files in `keep` (the ones this load writes or
    reads) and files an engine of this process holds open (handle.hold_file) are never deleted; an engine of
    another process that has one open goes on reading it (POSIX keeps an unlinked file's data while it is open).
    Directories left empty are removed. Returns (bytes freed, files deleted); (0, 0), nothing deleted, where all
    the files it may delete would not free `need` bytes (the load fails then, and the cache loses nothing)."""
    from tiered.checkpoint.handle import held_paths

    held = held_paths()
    keep = {os.path.realpath(p) for p in keep}
    candidates = []
    for path in root.glob("*/experts-layer*.safetensors"):
        real = os.path.realpath(path)
        if real in keep or str(path) in held or real in held:
            continue
        try:
            st = path.stat()
        except OSError:
            continue  # gone meanwhile (another process evicted it)
        candidates.append((st.st_mtime_ns, str(path), st.st_size))
    if sum(size for _, _, size in candidates) < need:
        return 0, 0
    freed = deleted = 0
    for _, path, size in sorted(candidates):
        if freed >= need:
            break
        try:
            os.unlink(path)
        except OSError:
            continue
        freed += size
        deleted += 1
        try:
            os.rmdir(os.path.dirname(path))
        except OSError:
            pass  # other files left there
    return freed, deleted


def _held_here(path: Path) -> bool:
    """Whether an engine of this process holds the file now at `path` open (handle.hold_file)."""
    from tiered.checkpoint.handle import is_held

    try:
        return is_held(str(path), path.stat().st_ino)
    except OSError:
        return False


def _written_for(path: Path, meta: dict[str, str]) -> bool:
    """Whether the converted layer file `path` exists with metadata `meta` (ExpertStore._file_meta: the same
    experts of the same checkpoint file in the same format), a valid safetensors file."""
    if not path.is_file():
        return False
    try:
        header, _ = _check_safetensors_file(path)
    except (CheckpointError, OSError):
        return False
    return header.get("__metadata__") == meta


def _release_files(held: list[tuple[str, int]]) -> None:
    """release_file each (path, inode) of `held` and empty it (ExpertStore.close, its finalizer)."""
    while held:
        release_file(*held.pop())


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, writable in place."""
    return memoryview(t.view(-1).view(torch.uint8).numpy())


class ExpertStore:
    """Home copies of all experts.

    Args:
        checkpoint: the opened checkpoint.
        placement: home tier of each (layer, expert).
        fmt: the experts' storage format (an ExpertFormat; a torch dtype means that dense format).
        accelerator: Accelerator or None (then the fast tier is CPU RAM).
        fast_budget: budget of the fast tier when there is no accelerator (CPU RAM).
        cpu_budget: budget of CPU RAM for CPU-tier experts.
        offload_dir: where converted disk-tier experts are written when the checkpoint's format
            cannot be read directly in `fmt` (always, for quantized formats); None: default_offload_dir's
            directory for the checkpoint in tiered's cache.
    Raises:
        BudgetError: a tier overflows (budgets are checked at each allocation).
        ConfigError: disk-tier experts need conversion and the offload directory cannot be written
            (`_convert`).
    """

    def __init__(self, checkpoint, placement: ExpertPlacement, fmt: ExpertFormat | torch.dtype, accelerator,
                 fast_budget: MemoryBudget, cpu_budget: MemoryBudget, offload_dir: str | None = None) -> None:
        cfg = checkpoint.config
        self.model_type = cfg.model_type
        self.num_experts = cfg.num_experts
        self.checkpoint = checkpoint
        if isinstance(fmt, torch.dtype):
            shapes = [checkpoint.handle(n).shape for n in expert_tensor_names(cfg.model_type, *next(iter(placement.tiers)))]
            fmt = ExpertFormat({torch.float32: "fp32", torch.bfloat16: "bf16"}[fmt], shapes,
                               swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha)
        self.fmt = fmt
        dtype = fmt.slot_dtype
        self.placement, self.dtype, self.accelerator = placement, dtype, accelerator
        self.fast_budget, self.cpu_budget = fast_budget, cpu_budget
        self.handles: dict = {}
        self.resident: dict = {}  # FAST: tensors on the compute device
        self.host: dict = {}  # CPU: host tensors
        # layer -> (gate [E, F, D], up [E, F, D], down [E, D, F]) on the accelerator, for layers whose
        # every expert is resident there at full precision: resident[key] are views of them, and the
        # runtime computes such a layer with grouped GEMMs and no host sync (moe_runner._grouped)
        self.stacks: dict = {}
        if fmt.is_dense and accelerator is not None:
            by_layer: dict = {}
            for (layer, e), tier in placement.tiers.items():
                by_layer.setdefault(layer, []).append(tier == FAST)
            for layer, fast in by_layer.items():
                if all(fast) and len(fast) == self.num_experts:
                    names = expert_tensor_names(cfg.model_type, layer, 0)
                    self.stacks[layer] = tuple(
                        accelerator.alloc((self.num_experts, *checkpoint.handle(n).shape), dtype,
                                          f"resident experts of layer {layer}") for n in names)
        # the experts kept in host RAM come from one slab per tier, page-aligned, on huge pages
        # (hardware/budget.HostSlab: small experts stream as fast as large ones)
        tiers = list(placement.tiers.values())
        self._fast_slab = self._host_slab = None
        if accelerator is None and FAST in tiers:
            self._fast_slab = HostSlab(HostSlab.bytes_for(tiers.count(FAST), fmt.slot_shapes, dtype))
        if CPU in tiers:
            self._host_slab = HostSlab(HostSlab.bytes_for(tiers.count(CPU), fmt.slot_shapes, dtype),
                                       accelerator.host_buffer if accelerator is not None else None)
        from tiered.quant.gguf_experts import stored_segments

        needs_conversion = []
        # disk-tier experts whose segments the checkpoint holds as the format stores them (fp8): read
        # segment by segment from its files (`read`), no converted copy
        self.raw: dict = {}
        filled = 0  # quantized expert bytes encoded since the file's pages were last released
        for key, tier in placement.tiers.items():
            hs = tuple(checkpoint.handle(n) for n in expert_tensor_names(cfg.model_type, *key))
            self.handles[key] = hs
            if not fmt.is_dense:
                if tier == FAST:
                    self.resident[key] = tuple(self._alloc_fast(s, f"resident expert {key}") for s in fmt.slot_shapes)
                    self._fill_quantized(self.resident[key], key, on_device=accelerator is not None)
                elif tier == CPU:
                    self.host[key] = tuple(self._alloc_host(s, f"expert {key}") for s in fmt.slot_shapes)
                    self._fill_quantized(self.host[key], key, on_device=False)
                else:
                    raw = stored_segments(fmt, hs)
                    if raw is None:
                        needs_conversion.append(key)
                    else:
                        self.raw[key] = raw
                    continue
                filled += fmt.nbytes
                if filled >= RELEASE_EVERY:  # else the file's pages read so far stay in RSS until the load ends
                    release_load_memory(checkpoint)
                    filled = 0
                continue
            if tier == FAST:
                stack = self.stacks.get(key[0])
                self.resident[key] = (tuple(w[key[1]] for w in stack) if stack is not None else
                                      tuple(self._alloc_fast(h.shape, f"resident expert {h.name}") for h in hs))
                for h, t in zip(hs, self.resident[key]):
                    self._fill(t, h)
            elif tier == CPU:
                self.host[key] = tuple(self._alloc_host(h.shape, h.name) for h in hs)
                for h, t in zip(hs, self.host[key]):
                    h.read_into(t)
            elif not all(h.offset is not None and STORED_DTYPES.get(h.format) == dtype for h in hs):
                needs_conversion.append(key)
        self._held: list[tuple[str, int]] = []  # converted files this store reads (path, inode): hold_file
        self.offload_dir: Path | None = None  # where its converted disk experts are (_convert), if any
        self.reused_files = 0  # converted layer files an earlier load wrote that this one reads as they are
        self.written_files = 0  # converted layer files this load wrote
        self.evicted = (0, 0)  # (bytes, files) of other conversions deleted from the default offload root to make room
        if needs_conversion:
            self._convert(checkpoint, needs_conversion, offload_dir)
            weakref.finalize(self, _release_files, self._held)
        self.shapes = tuple(fmt.slot_shapes)
        self.expert_bytes = fmt.nbytes

    def _alloc_fast(self, shape, what: str) -> torch.Tensor:
        if self.accelerator is not None:
            return self.accelerator.alloc(tuple(shape), self.dtype, what)
        return self.fast_budget.empty(tuple(shape), self.dtype, what, alloc=self._fast_slab.take)

    def _alloc_host(self, shape, what: str) -> torch.Tensor:
        # from the slab of Accelerator.host_buffer's memory (pinned on CUDA), or host_empty's
        return self.cpu_budget.empty(tuple(shape), self.dtype, what, alloc=self._host_slab.take)

    def encode(self, key, slot: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
        """Expert `key` in the store's format, built from the checkpoint (GGUF blocks repacked where
        exact, else quantized from the dense weights), written into the host `slot` or a new one."""
        from tiered.quant.gguf_experts import encode_expert

        return encode_expert(self.fmt, self.handles[key], slot)

    def _fill_quantized(self, dst: tuple[torch.Tensor, ...], key, on_device: bool) -> None:
        if not on_device:  # host memory: encoded in place, no second copy
            self.encode(key, dst)
            return
        for d, s in zip(dst, self.encode(key)):
            self.accelerator.copy_to_device(d, s)

    def _fill(self, dst: torch.Tensor, h: TensorHandle) -> None:
        if self.accelerator is None:  # the fast tier is RAM: read straight into it
            h.read_into(dst)
        else:
            self.accelerator.copy_to_device(dst, h.load(self.dtype))

    def _convert(self, checkpoint, keys, offload_dir) -> None:
        """Write disk-tier experts in the store's format to offload_dir (one safetensors file per
        layer): in the compute dtype (dense), or as flat format buffers (quantized, one uint8
        tensor per expert), which `read` then preads into a slot.

        A layer's file that an earlier load wrote for the same experts of the same checkpoint file (path, size
        and modification time) in the same format, per its metadata, is read as it is, not written again, where
        its first expert reads back as this store converts it (a check that catches a file of another version's
        conversion); else it is replaced (by rename: an engine reading the old one goes on reading its own,
        handle.hold_file). In tiered's default offload directory (`offload_dir` None), where the disk has too
        little room, the least recently used conversions of other checkpoints and placements are deleted first
        (evict_offload_files; `evicted` counts them); a directory the user gave is never cleared.

        Raises:
            ConfigError: the directory cannot be created or written (not a directory, permission denied,
                too little free space); no file of this call is left behind then.
        """
        out = Path(offload_dir) if offload_dir else default_offload_dir(checkpoint.path)
        self.offload_dir = out
        tag = (_TORCH_TO_ST[self.dtype] if self.fmt.is_dense
               else f"{self.fmt.name.replace(',', '-')}-{self.fmt.int4_layout}")
        by_layer: dict[int, list] = {}
        for key in keys:
            by_layer.setdefault(key[0], []).append(key)
        files = {layer: out / f"experts-layer{layer:03d}-{tag}.safetensors" for layer in by_layer}
        metas = {layer: self._file_meta(ks, tag) for layer, ks in by_layer.items()}
        kept = {layer for layer in by_layer if _written_for(files[layer], metas[layer])}
        need = sum(len(ks) for layer, ks in by_layer.items() if layer not in kept) * self.fmt.nbytes
        hint = f"pass a writable --offload-dir with room for {format_bytes(need)} (or EngineConfig(offload_dir=...))"
        written, created = [], False
        try:
            try:
                if out.exists() and not out.is_dir():
                    raise ConfigError(f"offload directory {out} is a file, not a directory", hint)
                created = not out.exists()
                out.mkdir(parents=True, exist_ok=True)
                # files of an earlier run that this one replaces give their room back, unless an engine of this
                # process still reads them (handle.hold_file: their data stays until it closes)
                free = shutil.disk_usage(out).free + sum(f.stat().st_size for layer, f in files.items()
                                                         if f.is_file() and layer not in kept and not _held_here(f))
            except OSError as e:
                raise ConfigError(f"offload directory {out} cannot be used ({e.strerror or e})", hint) from None
            if free < need and not offload_dir:  # tiered's own cache: older conversions make room
                self.evicted = evict_offload_files(out.parent, need - free, files.values())
                free += self.evicted[0]
            if free < need:
                raise ConfigError(f"offload directory {out} has {format_bytes(free)} free, the {len(keys)} converted "
                                  f"experts need {format_bytes(need)}", hint)
            for layer, ks in by_layer.items():
                path = files[layer]
                if layer in kept and self._point_handles(path, ks, check=True):
                    self.reused_files += 1
                    try:
                        os.utime(path)  # used now: the last to go when the cache makes room (evict_offload_files)
                    except OSError:
                        pass  # a read-only directory: kept as it is
                    continue
                if self.fmt.is_dense:
                    tensors = {h.name: h.load(self.dtype) for k in ks for h in self.handles[k]}
                else:
                    tensors = {f"expert.{e}": self.encode((l, e))[0] for l, e in ks}
                _save_whole(tensors, path, hint, metas[layer])
                del tensors
                written.append(path)
                self.written_files += 1
                self._point_handles(path, ks)
        except BaseException:
            _release_files(self._held)
            for path in written:  # half a conversion is of no use to a later run: leave nothing behind
                path.unlink(missing_ok=True)
            if created:
                try:
                    out.rmdir()
                except OSError:
                    pass  # not empty: something else was written there meanwhile
            raise

    def _file_meta(self, ks, tag: str) -> dict[str, str]:
        """The metadata a converted layer file of experts `ks` carries (_convert): the experts, the format, and
        the checkpoint files they come from (real path, size, modification time)."""
        sources = sorted({h.path for k in ks for h in self.handles[k]})
        stats = [(os.path.realpath(p), os.stat(p)) for p in sources]
        return {"tiered_experts": ",".join(f"{l}.{e}" for l, e in ks), "tiered_format": tag,
                "tiered_source": ";".join(f"{p}:{st.st_size}:{st.st_mtime_ns}" for p, st in stats)}

    def _point_handles(self, path: Path, ks, check: bool = False) -> bool:
        """Point experts `ks`' handles at their converted file `path`, held open by inode (hold_file: a later
        conversion into the directory, another engine's, replaces the path and this store goes on reading its
        own bytes). `check`: first read the first expert back and compare it with its conversion from the
        checkpoint: False (the handles as they were, nothing held) where they differ or the file does not hold
        the experts."""
        originals = {k: self.handles[k] for k in ks}
        inode = hold_file(str(path))
        self._held.append((str(path), inode))
        try:
            header, n = _check_safetensors_file(path)
            for l, e in ks:
                if self.fmt.is_dense:
                    new = []
                    for h in self.handles[(l, e)]:
                        begin, end = header[h.name]["data_offsets"]
                        new.append(TensorHandle(h.name, h.shape, _TORCH_TO_ST[self.dtype], end - begin, str(path),
                                                h._load, offset=8 + n + begin, inode=inode))
                    self.handles[(l, e)] = tuple(new)
                else:
                    name = f"expert.{e}"
                    begin, end = header[name]["data_offsets"]
                    self.handles[(l, e)] = (TensorHandle(f"layer {l} {name}", (end - begin,), "U8", end - begin,
                                                         str(path), lambda: None, offset=8 + n + begin,
                                                         inode=inode),)
            if check:
                key = ks[0]
                if self.fmt.is_dense:
                    stored = tuple(h.load(self.dtype) for h in originals[key])
                    got = tuple(torch.empty(h.shape, dtype=self.dtype) for h in originals[key])
                else:
                    from tiered.quant.gguf_experts import encode_expert

                    stored = (encode_expert(self.fmt, originals[key])[0],)
                    got = (torch.empty_like(stored[0]),)
                read_uncached(self.handles[key], got)
                if not all(torch.equal(a.flatten().view(torch.uint8), b.flatten().view(torch.uint8))
                           for a, b in zip(got, stored)):
                    raise ValueError("the file's first expert differs from its conversion")
            return True
        except (KeyError, ValueError, OSError, CheckpointError):
            if not check:
                raise
            self.handles.update(originals)
            release_file(str(path), inode)
            self._held.remove((str(path), inode))
            return False

    def tier(self, key) -> str:
        return self.placement.tiers[key]

    def close(self) -> None:
        """Close the descriptors of the converted files this store reads its disk-tier experts from
        (handle.release_file; LLM.close): a file another engine's conversion has replaced meanwhile is freed
        then. Disk-tier experts cannot be read afterwards."""
        _release_files(self._held)

    def disk_files(self) -> list[str]:
        """Files that disk-tier experts are read from."""
        return sorted({h.path for k, hs in self.handles.items() if self.tier(k) == DISK
                       for h in self.raw.get(k, hs)})

    def read(self, key, out: tuple[torch.Tensor, ...]) -> int:
        """Read a disk-tier expert into host tensors `out` (read_uncached; one read per segment for
        an expert read as the checkpoint stores it). Returns bytes read."""
        if key in self.raw:
            read_uncached(self.raw[key], self.fmt.segment_views(out))
        else:
            read_uncached(self.handles[key], out)
        return self.expert_bytes

    def advise(self, key) -> None:
        """Hint the kernel to start reading a disk-tier expert now (`advise`)."""
        advise(self.raw.get(key, self.handles[key]))

