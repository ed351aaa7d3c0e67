"""GGUF k-quants decoded from their own bits: Q6KLinear ("q6k"), Q5KLinear ("q5k") and IQ4XSLinear ("iq4xs"),
tiered's decode copies of llama.cpp's Q6_K, Q5_K and IQ4_XS tensors.

Q6_K stores 256 weights in 210 bytes: 6-bit codes u (0..63), an int8 scale per 16 weights and an fp16 scale d per 256,
w = d sc (u - 32): 6.5625 bits a weight. Q5_K stores them in 176: 5-bit codes u (0..31), 6-bit scales sc and mins m per
32 weights and fp16 d and dmin per 256, w = d sc u - dmin m: 5.5 bits (the copy 5.625: sc and m a byte each). A Q4_K_M file keeps its head, and attn_v and
ffn_down in about half its layers, in Q6_K; a Q5_K_M file is Q5_K but for those; a Q6_K file is all Q6_K. tiered had
decoded both from int8 copies per group of 32 (quant/int8.Int8G32Linear, the codes re-quantized: 8.5 bits a weight,
30% / 55% more bytes a token than the file); these keep the file's codes and scales bit for bit in the native kernels'
tiled layouts (gemv.cpp "q6k", "q5k"), per tile of 16 rows and group of 32 columns:

    q6k  qt uint8 [N/16, K/32, 384]  the codes' low nibbles (256 bytes) and high 2 bits (128), arranged so that each
                                     4-column chunk is one 64-byte vector of u bytes after a shift and a ternary op
         sc int8 [N/16, K/16, 16]    Q6_K's scale per 16 weights, a tile's 16 rows side by side
         d fp16 [N/16, K/256, 16]    its scale per super-block of 256
    q5k  qt uint8 [N/16, K/32, 320]  the low nibbles as q6k's and the fifth bits (64)
         sm uint8 [N/16, K/32, 2, 16]   sc, then m, per group
         dd fp16 [N/16, K/256, 2, 16]   d, then dmin, per super-block
    iq4xs qt uint8 [N/16, K/32, 256] IQ4_XS's 4-bit codebook indices, placed as q6k's low nibbles
         sc int8 [N/16, K/32, 16]    ls - 32 per group of 32 (IQ4_XS's 6-bit scale, centred)
         d fp16 [N/16, K/256, 16]    its scale per super-block

IQ4_XS (llama.cpp's i-quant at 4.25 bits a weight: 136 bytes per 256) maps each index i to v = kvalues_iq4nl[i], 16
int8 values from -127 to 113, and w = d (ls - 32) v; tiered had read it as int8-g32 copies of those values (8.5 bits).

The kernels multiply u against the activations quantized per group of 32 as the int8-g32 kernel's are (int16 at one
row: batch-1 numerics; int8 in calls of 2+ rows where batch_act is "q8"), and take the offset out with the
activations' sums (Q6_K's 32 per 16 weights, Q5_K's mins per 32, IQ4_XS's 128 per 32: u = v + 128 through a table).
"""

from __future__ import annotations

import numpy as np
import torch

from tiered.checkpoint.handle import BLOCK_FORMATS
from tiered.kernels.linear import NativeLinear

GGUF_FORMAT = {"q6k": "Q6_K", "q5k": "Q5_K", "iq4xs": "IQ4_XS"}
BLOCK_BYTES = {k: BLOCK_FORMATS[f][1] for k, f in GGUF_FORMAT.items()}  # the file's bytes per super-block of 256
# the copy's: Q6_K's exactly; Q5_K's with its 6-bit sc and m a byte each (4 bytes more per super-block), IQ4_XS's with
# its 6-bit ls a byte each (2 more)
COPY_BYTES = {"q6k": 210, "q5k": 180, "iq4xs": 138}
KIND_OF_FORMAT = {f: k for k, f in GGUF_FORMAT.items()}


def bytes_per_weight(kind: str) -> float:
    """Bytes a weight of a "q6k" / "q5k" / "iq4xs" copy holds: 0.8203125 (the file's) / 0.703125 (the file's 0.6875
    and its 6-bit scales and mins a byte each) / 0.5390625 (the file's 0.53125 and its 6-bit scales a byte each)."""
    return COPY_BYTES[kind] / 256


def kquant_fits(shape) -> bool:
    """Whether a Q6_K / Q5_K / IQ4_XS weight of `shape` [N, K] can take its copy as stored: tiered's kernels are built, N % 16
    == 0 (the layouts' tiles) and K % 256 == 0 (the super-blocks: always, for such a tensor)."""
    from tiered.kernels import load

    return len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % 256 == 0 and load() is not None


class KQuantLinear(NativeLinear):
    """y = x @ W^T (+ b) with W a GGUF k-quant weight as stored (the module docstring's layouts; subclasses name the
    format: KIND, PARTS).

    x [..., K] any float dtype -> [..., N] in x's dtype through the native kernel (`dense`: a prompt's rows through the
    weight dequantized to bf16 and oneDNN's GEMM). `batch_act`: what calls of two or more rows multiply
    (Plan.batch_act), as Int8G32Linear's: "bf16" the int16-quantized x of one row, "q8" x quantized to int8 per group
    of 32.

    Raises:
        ValueError: batch_act other than "bf16" or "q8".
    """

    KIND = ""
    PARTS: tuple[str, str, str] = ("qt", "", "")
    PACK = ""  # the native repacking pass from the file's blocks

    def __init__(self, qt: torch.Tensor, scales: torch.Tensor, supers: torch.Tensor, bias: torch.Tensor | None = None,
                 batch_act: str = "bf16") -> None:
        super().__init__()
        if batch_act not in ("bf16", "q8"):
            raise ValueError(f"batch_act must be 'bf16' or 'q8', got {batch_act!r}")
        for name, t in zip(self.PARTS, (qt, scales, supers)):
            self.register_buffer(name, t.contiguous())
        self.bias = None if bias is None else torch.nn.Parameter(bias.float(), requires_grad=False)
        self.out_features, self.in_features = qt.shape[0] * 16, qt.shape[1] * 32
        self.batch_act = batch_act

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layout's three tensors (qt, the scales per 16 or 32 weights, those per super-block)."""
        return tuple(getattr(self, n) for n in self.PARTS)

    @staticmethod
    def layout(tiles: int, K: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The (shape, dtype) of the layout's three tensors for `tiles` tiles of 16 rows and K columns."""
        raise NotImplementedError

    @classmethod
    def from_blocks(cls, blocks: list[np.ndarray | torch.Tensor], bias: torch.Tensor | None = None,
                    batch_act: str = "bf16") -> "KQuantLinear":
        """The blocks of one or more weights of this format (uint8 [N_i, K/256 * block bytes] each, N_i % 16 == 0; a
        fused group's parts, rows side by side) in its layout: one native pass each, written straight into its own
        tiles of the layout's tensors, which large weights get on huge pages (hardware/budget.host_empty, as the
        int4 copies': move_to_huge_pages then leaves them where they are). Repacked into new tensors, concatenated
        and then copied onto huge pages, the 8-layer Llama-3-8B-width Q5_K_M file's copies had taken 5.5 of its
        8.2 s load (2-core Zen 4 VM, 2026-12-07).

        Raises:
            RuntimeError: the native extension is unavailable.
            ValueError: blocks of different widths, or rows not a multiple of 16."""
        return cls(*cls.pack_blocks(blocks), bias, batch_act)

    @classmethod
    def pack_blocks(cls, blocks: list[np.ndarray | torch.Tensor],
                    out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """`from_blocks`' tensors (PARTS' order): the blocks repacked into `out` (the layout's tensors for all their
        rows, written in place: an expert slot's segment views) or into new ones (host_empty).

        Raises:
            RuntimeError: the native extension is unavailable.
            ValueError: blocks of different widths, or rows not a multiple of 16."""
        from tiered.hardware.budget import host_empty
        from tiered.kernels import load
        from tiered.quant.gguf_dequant import blocks_tensor

        ext = load()
        if ext is None:
            raise RuntimeError(f"{cls.__name__} needs tiered/kernels built")
        raws = [b if isinstance(b, torch.Tensor) else blocks_tensor(b) for b in blocks]
        if len({r.shape[1] for r in raws}) != 1 or any(r.shape[0] % 16 for r in raws):
            raise ValueError(f"{cls.__name__}.from_blocks: parts of one width and N % 16 == 0 rows each, got "
                             f"{[tuple(r.shape) for r in raws]}")
        K = raws[0].shape[1] // BLOCK_BYTES[cls.KIND] * 256
        if out is None:
            out = [host_empty(shape, dtype) for shape, dtype in cls.layout(sum(r.shape[0] for r in raws) // 16, K)]
        pack = getattr(ext, cls.PACK)
        t = 0
        for r in raws:
            n = r.shape[0] // 16
            pack(r, *(o[t:t + n] for o in out))
            t += n
        return out

    def _build(self, ext, bias):
        return getattr(ext, f"{self.KIND}_kernel")(*self.parts(), bias, self.batch_act)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] in fp32 with gguf's order of operations (equal to gguf.quants.dequantize's), or that rounded to
        bf16 (dtype torch.bfloat16)."""
        from tiered.kernels import load

        return getattr(load(), f"{self.KIND}_tiled_dequantize")(*self.parts(), dtype == torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.kernel()(x.reshape(-1, self.in_features))
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The prefill path: x [..., K] -> [..., N] in x's dtype; as Int8G32Linear.dense, beyond
        quant/int4.dequantize_rows(batch_act) rows (None: never) where quant/int4.dequantize_dtype() is bf16 the weight
        dequantized to bf16 (in row chunks of whole tiles, kernels/linear.kquant_dequantize) for oneDNN's GEMM, else
        the native kernel. On the 2-core Zen 4 VM, whose tuning runs int8 rows at every count, a 14336 x 4096 q5k
        weight on 256 / 1024 q8 rows took 66 / 275 ms in the kernel against 103 / 339 dequantized (2026-12-07)."""
        import tiered.quant.int4 as int4
        from tiered.kernels.linear import kquant_dequantize

        x2 = x.reshape(-1, self.in_features)
        limit = int4.dequantize_rows(self.batch_act)
        if limit is None or x2.shape[0] <= limit or int4.dequantize_dtype() != torch.bfloat16:
            return self.forward(x)
        bias = None if self.bias is None else self.bias.to(torch.bfloat16)
        parts = self.parts()
        y = int4.gemm_by_row_chunks(x2.to(torch.bfloat16), self.out_features, bias=bias, weight_rows=lambda n0, n1:
                                    kquant_dequantize(self.KIND, *(p[n0 // 16:n1 // 16] for p in parts)))
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class Q6KLinear(KQuantLinear):
    """A GGUF Q6_K weight as stored (qt, sc, d: the module docstring's "q6k"): w = d sc (u - 32). On the 2-core Zen 4
    VM a 4096 x 14336 weight at batch 1 took 1.70 ms a call against 2.06-2.27 for its int8-g32 copy (2026-12-07,
    weights past the L3)."""

    KIND = "q6k"
    PARTS = ("qt", "sc", "d")
    PACK = "q6k_blocks_q6t"

    @staticmethod
    def layout(tiles: int, K: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [((tiles, K // 32, 384), torch.uint8), ((tiles, K // 16, 16), torch.int8),
                ((tiles, K // 256, 16), torch.float16)]


class Q5KLinear(KQuantLinear):
    """A GGUF Q5_K weight as stored (qt, sm, dd: the module docstring's "q5k"): w = d sc u - dmin m."""

    KIND = "q5k"
    PARTS = ("qt", "sm", "dd")
    PACK = "q5k_blocks_q5t"

    @staticmethod
    def layout(tiles: int, K: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [((tiles, K // 32, 320), torch.uint8), ((tiles, K // 32, 2, 16), torch.uint8),
                ((tiles, K // 256, 2, 16), torch.float16)]


class IQ4XSLinear(KQuantLinear):
    """A GGUF IQ4_XS weight as stored (qt, sc, d: the module docstring's "iq4xs"): w = d (ls - 32) v, v =
    kvalues_iq4nl[i] of its 4-bit index (the kernels take v + 128 through a table, one vpshufb a chunk)."""

    KIND = "iq4xs"
    PARTS = ("qt", "sc", "d")
    PACK = "iq4xs_blocks_q4t"

    @staticmethod
    def layout(tiles: int, K: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [((tiles, K // 32, 256), torch.uint8), ((tiles, K // 32, 16), torch.int8),
                ((tiles, K // 256, 16), torch.float16)]


LINEAR_OF_KIND = {"q6k": Q6KLinear, "q5k": Q5KLinear, "iq4xs": IQ4XSLinear}
KQUANT_KINDS = tuple(LINEAR_OF_KIND)  # the decode-copy kinds this module holds
