"""TensorHandle: a named tensor that is not in memory yet.

A handle knows where its bytes are (file, offset, format) and how to turn them into a tensor in
the Hugging Face layout. Nothing is read until `load()` (or `blocks()`) is called, and both read
through a memory map, so opening a 100 GB checkpoint costs only its header.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

# Bytes per element of dense formats; block formats give (elements per block, bytes per block).
DENSE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "U8": 1, "BOOL": 1}
BLOCK_FORMATS = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
    # llama.cpp's i-quants: IQ4_NL / IQ4_XS a 16-value non-linear codebook (kvalues_iq4nl) times a scale per 32,
    # the others lattice codebooks (2-3 bits a weight); read through gguf's dequantization where dequantized
    **{"IQ4_NL": (32, 18), "IQ4_XS": (256, 136), "IQ3_XXS": (256, 98), "IQ3_S": (256, 110), "IQ2_XXS": (256, 66),
       "IQ2_XS": (256, 74), "IQ2_S": (256, 82), "IQ1_S": (256, 50), "IQ1_M": (256, 56)},
}


STORED_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "U8": torch.uint8}
_FDS: dict[tuple[str, bool, int | None], int] = {}  # (path, random_access, inode or None) -> descriptor
_FD_LOCK = threading.Lock()


def _open(path: str, random_access: bool, inode: int | None) -> int:
    fd = os.open(path, os.O_RDONLY)
    if inode is not None and os.fstat(fd).st_ino != inode:
        os.close(fd)
        raise OSError(f"{path} was replaced after this engine wrote it (another engine converting experts "
                      "into the same offload directory?)")
    if random_access:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def _fd(path: str, random_access: bool = False, inode: int | None = None) -> int:
    """A read-only descriptor per file, opened once and shared by reader threads (pread is positional).
    random_access: a second descriptor of the file with the kernel's read-ahead off
    (POSIX_FADV_RANDOM, which holds per open file), for reads of exactly the bytes asked
    (memory/expert_store.read_uncached); the plain one keeps read-ahead for loads. inode: the file
    must be that one (TensorHandle.inode: a file this process wrote and holds, `hold_file`), whatever
    now sits at `path`.

    Raises:
        OSError: the file cannot be opened, or `path` is no longer the file of `inode` and no
            descriptor of that file is held."""
    with _FD_LOCK:
        key = (path, random_access, inode)
        if key not in _FDS:
            _FDS[key] = _open(path, random_access, inode)
        return _FDS[key]


_HOLDS: dict[tuple[str, int], int] = {}  # (path, inode) -> holders (hold_file, release_file)


def hold_file(path: str) -> int:
    """Open `path`'s descriptors now (the plain one and the random-access one, `_fd`) and return its inode,
    for handles that must read this very file (TensorHandle.inode): a converted offload file that a later
    conversion (another engine, in this process or another, into the same directory) replaces by rename.
    POSIX keeps a replaced file's data while a descriptor of it is open, so the engine that wrote it reads
    its own bytes to the end. Holds are counted per file: engines reading the same file (a later load reusing
    it) each hold it, and `release_file` closes its descriptors when the last lets go.

    Raises:
        OSError: the file cannot be opened, or was replaced between the two opens."""
    fd = os.open(path, os.O_RDONLY)
    inode = os.fstat(fd).st_ino
    with _FD_LOCK:
        if _HOLDS.get((path, inode), 0) > 0:  # held already: its descriptors are this file's
            _HOLDS[path, inode] += 1
            os.close(fd)
            return inode
    try:
        ra = _open(path, True, inode)
    except BaseException:
        os.close(fd)
        raise
    with _FD_LOCK:
        for key, d in (((path, False, inode), fd), ((path, True, inode), ra)):
            old = _FDS.pop(key, None)
            if old is not None:
                os.close(old)
            _FDS[key] = d
        _HOLDS[path, inode] = _HOLDS.get((path, inode), 0) + 1
    return inode


def held_paths() -> set[str]:
    """The paths of the files hold_file holds now (as it was given them)."""
    with _FD_LOCK:
        return {path for path, _ in _HOLDS}


def is_held(path: str, inode: int) -> bool:
    """Whether hold_file holds the file `inode` at `path` now."""
    with _FD_LOCK:
        return (path, inode) in _HOLDS


def release_file(path: str, inode: int) -> None:
    """Let go of one hold_file(path) of `inode`; the last closes its descriptors (the file's data is freed then
    if the path was replaced meanwhile), and handles with that inode cannot be read afterwards."""
    with _FD_LOCK:
        left = _HOLDS.get((path, inode), 0) - 1
        if left > 0:
            _HOLDS[path, inode] = left
            return
        _HOLDS.pop((path, inode), None)
        for ra in (False, True):
            fd = _FDS.pop((path, ra, inode), None)
            if fd is not None:
                os.close(fd)


@dataclass(frozen=True, eq=False)
class TensorHandle:
    """A lazily loaded tensor.

    Attributes:
        name: Hugging Face parameter name, e.g. "model.layers.0.self_attn.q_proj.weight".
        shape: logical shape in the HF (PyTorch) layout, e.g. (out_features, in_features).
        format: storage format: a dense dtype ("F32", "F16", "BF16", ...), a GGUF block format
            ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", ...) or "F8_E4M3": an fp8 weight with block
            scales (quant/fp8.py; `load` dequantizes, `scaled_fp8` gives the stored form), "INT4": a
            GPTQ / AWQ / compressed-tensors 4-bit weight (checkpoint/int4_packed.py; `int4_parts`), or
            "INT8": a GPTQ / compressed-tensors 8-bit integer weight (checkpoint/int8_packed.py;
            `int8_parts` where it is symmetric per output channel or tensor) or a bitsandbytes LLM.int8
            one (checkpoint/bnb.py), or "BNB_NF4" / "BNB_FP4": a bitsandbytes 4-bit weight (checkpoint/
            bnb.py; `load` dequantizes), or "MXFP4": one gpt-oss expert projection, its bias a padded
            input column (checkpoint/gpt_oss.py; `load` dequantizes, `int8_g32_parts` gives the codes
            as int8-g32 where offered: 16-bit biases in safetensors, always in GGUF files;
            `mxfp4_parts` the raw blocks, E8M0 bytes and bias for the mxfp4 kind where offered: bf16
            biases in safetensors, F32 / BF16 ones in GGUF files). A GGUF
            gpt-oss expert stored as Q8_0 has that padded layout too: no `blocks`, `int8_g32_parts`.
        nbytes: bytes the tensor occupies in its file (an fp8 weight's with its scales).
        path: the file holding it.
    """

    name: str
    shape: tuple[int, ...]
    format: str
    nbytes: int
    path: str
    _load: Callable[[], torch.Tensor]
    _blocks: Callable[[], np.ndarray] | None = None
    offset: int | None = None  # byte offset of raw dense data in `path` (None: not readable raw)
    # F8_E4M3: () -> (q float8_e4m3fn [N, K], scales fp32 [N / br, K / bc] (ceil)) as stored, and (br, bc)
    _fp8: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None
    fp8_block: tuple[int, int] | None = None
    # F8_E4M3: (the e4m3 bytes as a "U8" handle, the scales' handle), each readable raw where its file
    # holds it: what a disk-tier fp8 expert is read through, segment by segment
    fp8_parts: tuple["TensorHandle", "TensorHandle"] | None = None
    # INT4 (a GPTQ / AWQ / compressed-tensors 4-bit weight, checkpoint/int4_packed.py): () -> (codes int32
    # [N, K] 0..15, scale fp32 [N, K / int4_group], zero fp32 [N, K / int4_group]), w = (c - 8) s + z
    _int4: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    int4_group: int | None = None
    # INT8 (a GPTQ / compressed-tensors 8-bit integer weight, checkpoint/int8_packed.py): () -> (q int8
    # [N, K], scale fp32 [N]), w = q * scale, where the checkpoint's codes are that (symmetric, one scale
    # per output channel or per tensor); None for grouped or asymmetric ones (they load dequantized)
    _int8: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None
    int8_group: int | None = None  # INT8: inputs per scale (K: per channel or tensor; 0: act-order groups)
    # gpt-oss's MXFP4 (or GGUF Q8_0) experts, checkpoint/gpt_oss.py: () -> (q int8 [N, K], scale fp16
    # [N, K / 32]), w = q * scale per group of 32 inputs, tiered's int8-g32 exactly; None where not offered
    _int8_g32: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None
    # gpt-oss's MXFP4 experts: () -> (blocks uint8 [N, K0 / 32, 16], e8m0 uint8 [N, K0 / 32], bias [N]) as
    # stored (K0 = the unpadded in-features), blocks in the checkpoint's nibble order: `mxfp4_halves`
    # False: input 2j in byte j's low nibble, 2j + 1 in its high one (OpenAI's); True: j low, 16 + j high
    # (ggml's block_mxfp4). None where not offered.
    _mxfp4: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    mxfp4_halves: bool = False
    # the inode of the very file `path` names for this handle (hold_file), where a later writer may replace
    # the path: a converted offload file (memory/expert_store); None: whatever file `path` names
    inode: int | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def is_quantized(self) -> bool:
        return self.format in BLOCK_FORMATS

    def load(self, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """Read (and dequantize) the tensor into a new CPU tensor of `shape`.

        Args:
            dtype: result dtype; None keeps the stored dense dtype (block formats give float32).
        Returns:
            A contiguous CPU tensor of shape `self.shape` that owns its memory.
        """
        t = self._load()
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        return t.contiguous()

    def read_into(self, out: torch.Tensor) -> None:
        """Fill `out` (contiguous CPU tensor of `shape`) with the tensor, converting if needed.

        When the stored dtype equals out's dtype the bytes go straight from the file into `out`
        with pread (no intermediate copy, no memory map left behind): how disk-tier experts are
        read into cache slots.
        """
        if self.offset is not None and STORED_DTYPES.get(self.format) == out.dtype and out.is_contiguous():
            buf = memoryview(out.view(-1).view(torch.uint8).numpy())
            fd = _fd(self.path, inode=self.inode)
            done = 0
            while done < self.nbytes:
                n = os.preadv(fd, [buf[done:]], self.offset + done)
                if n <= 0:
                    raise OSError(f"short read from {self.path} at {self.offset + done}")
                done += n
            return
        out.copy_(self._load())

    def scaled_fp8(self) -> tuple[torch.Tensor, torch.Tensor]:
        """An fp8 weight as stored: (q float8_e4m3fn [N, K], block scales fp32 [ceil(N/br), ceil(K/bc)])
        with w = q * s per block of (br, bc) = `fp8_block` (quant/fp8.py).

        Raises:
            ValueError: the tensor is not stored as block-scaled fp8.
        """
        if self._fp8 is None:
            raise ValueError(f"{self.name} is stored as {self.format}, not as block-scaled fp8")
        return self._fp8()

    def int4_parts(self, group: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A 4-bit weight as stored (format "INT4"), in groups of `group` inputs: (codes int32 [N, K]
        in 0..15, scale fp32 [N, K/group], zero fp32 [N, K/group]) with w = (codes - 8) * scale + zero,
        tiered's int4 convention (quant/int4.py). Exact for a `group` dividing the stored one.

        Raises:
            ValueError: not a 4-bit weight, or `group` does not divide its groups.
        """
        if self._int4 is None or not self.int4_group:
            raise ValueError(f"{self.name} is stored as {self.format}, not as a 4-bit weight in runs of groups")
        if self.int4_group % group:
            raise ValueError(f"{self.name}'s groups of {self.int4_group} cannot be split into groups of {group}")
        codes, scale, zero = self._int4()
        r = self.int4_group // group
        return codes, scale.repeat_interleave(r, 1), zero.repeat_interleave(r, 1)

    @property
    def int8_per_row(self) -> bool:
        """An INT8 weight whose codes are tiered's per-row int8 as stored (`int8_parts` gives them)."""
        return self._int8 is not None

    def int8_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """An 8-bit integer weight as stored (format "INT8"), symmetric with one scale per output channel
        (a per-tensor scale repeated per row): (q int8 [N, K], scale fp32 [N]) with w = q * scale,
        tiered's per-row int8 (quant/int8.py), exactly.

        Raises:
            ValueError: not an 8-bit weight, or one quantized per group or asymmetrically.
        """
        if self._int8 is None:
            raise ValueError(f"{self.name} is stored as {self.format}, not as symmetric int8 per output channel")
        return self._int8()

    @property
    def int8_g32_exact(self) -> bool:
        """A weight whose stored form is tiered's int8-g32 exactly (`int8_g32_parts` gives it)."""
        return self._int8_g32 is not None

    def int8_g32_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight as tiered's int8-g32 straight from its stored codes (gpt-oss's MXFP4 experts, a
        GGUF file's Q8_0 ones, checkpoint/gpt_oss.py): (q int8 [N, K], scale fp16 [N, K/32]) with
        w = q * scale[group], bit for bit what `load` gives.

        Raises:
            ValueError: the weight offers no such form.
            CheckpointError: a scale or bias the form cannot hold exactly (checkpoint/gpt_oss.py).
        """
        if self._int8_g32 is None:
            raise ValueError(f"{self.name} is stored as {self.format}, with no exact int8-g32 form")
        return self._int8_g32()

    @property
    def mxfp4_exact(self) -> bool:
        """An MXFP4 weight whose raw parts the mxfp4 expert kind holds (`mxfp4_parts` gives them)."""
        return self._mxfp4 is not None

    def mxfp4_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """gpt-oss's MXFP4 expert projection as stored: (blocks uint8 [N, K0/32, 16] in the checkpoint's
        nibble order (`mxfp4_halves`), E8M0 scale bytes uint8 [N, K0/32], bias [N] as stored), K0 the
        in-features before the bias column (shape[1] = biased_width(K0)); checkpoint/gpt_oss.mxfp4_codes
        turns them into the mxfp4 kind's codes and scales.

        Raises:
            ValueError: the weight offers no such form.
        """
        if self._mxfp4 is None:
            raise ValueError(f"{self.name} is stored as {self.format}, with no raw MXFP4 parts offered")
        return self._mxfp4()

    def blocks(self) -> np.ndarray:
        """Raw quantized blocks in HF row order: uint8 [rows, bytes_per_row] (block formats only).

        Raises:
            ValueError: the tensor is stored in a dense format.
        """
        if self._blocks is None:
            raise ValueError(f"{self.name} is stored as {self.format}, not in blocks")
        return self._blocks()


class HandleTable:
    """What every checkpoint offers over its `_handles` (HF name -> TensorHandle) and `path`.

    Subclasses set `format_name` and `missing_hint` (the fix to suggest when a tensor is absent).
    """

    _handles: dict[str, TensorHandle]
    path: object
    format_name = ""
    missing_hint = "the checkpoint is incomplete or not of the architecture its config names"

    def generation_defaults(self) -> dict:
        """The sampling its authors ship for the model (a directory's generation_config.json: hf_dir); {} here."""
        return {}

    def names(self) -> list[str]:
        """Every tensor name, HF naming."""
        return list(self._handles)

    def handle(self, name: str) -> TensorHandle:
        """The lazy handle of `name`. Raises CheckpointError if the checkpoint lacks it."""
        from tiered.errors import CheckpointError

        try:
            return self._handles[name]
        except KeyError:
            raise CheckpointError(f"{self.path} lacks tensor {name!r}", self.missing_hint) from None

    def has(self, name: str) -> bool:
        return name in self._handles

    def release_pages(self) -> int:
        """Drop this process's resident pages of the checkpoint's file mapping, once its tensors
        are loaded: they stay in the OS page cache and fault back in if read again (a block
        embedding's rows). Returns the bytes of mapping released (0 when nothing is mapped)."""
        return 0

    def tokenizer(self):
        """The checkpoint's tokenizer (a transformers tokenizer), or None when it has none; loaded
        on the first call and kept, so every user of this checkpoint object shares one."""
        if "_tokenizer" not in self.__dict__:
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    def _load_tokenizer(self):
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes of all tensors on disk."""
        return sum(h.nbytes for h in self._handles.values())
