"""Building blocks shared by every architecture: RMSNorm, rotary embedding, attention, SwiGLU MLP.

Dimension legend:
    B = batch (sequences), T = new tokens per sequence this step, S = cached positions,
    D = hidden size, H = query heads, Hkv = KV heads, hd = head dim, F = MLP intermediate size.

Source: the Llama architecture (Touvron et al. 2023) as implemented by Hugging Face transformers;
parameter names are HF's so checkpoints load without renaming.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from tiered.checkpoint.model_config import ModelConfig, rope_attention_factor, rope_inv_freq
from tiered.hardware.accelerator import building_graph
from tiered.memory.host import lazily_committed, lazy_zeros, release_pages
from tiered.memory.sizes import (KV_ALIGN, KV_FORGET_SLACK, KV_FORGET_STEP, PAGE_BYTES, format_of,  # noqa: F401
                                 kv_block, kv_cache_bytes, kv_cache_widths, kv_row_bytes,  # (kv_row_bytes: the row's bytes)
                                 tensor_bytes, window_key_start)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 like HF. weight [D]."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [..., D] -> the normalized x [..., D] in `dtype` (None: x's; `residual`'s y)."""
        return self.residual(x, None, dtype)[1]

    def residual(self, x: torch.Tensor, delta: torch.Tensor | None,
                 dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A pre-norm block's residual add and the next norm: x [..., D], delta [..., D] or None -> (h, y), h = x +
        delta (x itself without delta; a delta of another dtype is promoted, as torch's add) and y = norm(h) [..., D]
        in `dtype` (None: h's).

        fp32 rows on the CPU take one native pass (tiered/kernels' rms_norm: the add, the norm in fp32 as the native
        decode step computes it, and the cast, rounded once) where torch runs the add, F.rms_norm's five ops and the
        cast. Elsewhere torch's ops:
        F.rms_norm for fp32, HF's order for lower-precision x (the fp32 result rounded to x's dtype before the
        weight), then the cast."""
        w = self.weight
        if (x.dtype == torch.float32 and w.dtype == torch.float32 and w.device == x.device
                and (dtype is None or dtype in (torch.float32, torch.bfloat16))
                and (delta is None or (delta.shape == x.shape and delta.device == x.device
                                       and delta.dtype in (torch.float32, torch.bfloat16)))):
            native = _glue_kernels(x)
            if native is not None and not (torch.is_grad_enabled() and w.requires_grad) and (
                    delta is None or not delta.requires_grad):
                return native.rms_norm(x, w, self.eps, dtype or x.dtype, delta)
        h = x if delta is None else x + delta
        if h.dtype == torch.float32 and w.dtype == torch.float32:
            y = F.rms_norm(h, w.shape, w, self.eps)  # one fused op, same math
        else:  # fp32 math, the result rounded to h's dtype before the weight (HF's order)
            y = w * F.rms_norm(h.float(), w.shape, None, self.eps).to(h.dtype)
        return h, y if dtype is None or y.dtype == dtype else y.to(dtype)


class Rotary(nn.Module):
    """RoPE cos/sin tables [max_positions, rd] (fp32), rotate-half convention (HF Llama); rd =
    config.rotary_dim, hd unless a partial RoPE (GLM-4.5) rotates only each head's first rd features.
    Where the model's local layers rotate by a RoPE of their own (Gemma 3's sliding layers:
    ModelConfig.local_rope), `local_cos` / `local_sin` hold its tables (else None).

    `lazy` (a CPU engine's: LLM._place): the tables are lazily committed (memory/host.lazy_zeros) and their rows
    computed ROPE_ROWS at a time as positions reach them (`ensure`; `forward` and `local` ensure what they gather,
    and every reader of the whole tables, the native decode step's, ensures first): Gemma 3 4B's two pairs of
    tables at its 131072 positions are 537 MB, computed at load (~0.5 s, ~1 GB at its peak) where a conversation
    reaches a few thousand positions. Only a CPU engine's tables are lazy (LLM._place: no accelerator; an
    accelerator's Rotary is built whole before Accelerator.module_to_device, which moves buffers as they are);
    `.to()` / `_apply` fills a lazy table whole before copying it."""

    def __init__(self, config: ModelConfig, max_positions: int, lazy: bool = False) -> None:
        super().__init__()
        self.max_positions = max_positions
        self._configs = [(prefix, cfg) for prefix, cfg in (("", config), ("local_", config.local_rope()))]
        lazy = lazy and torch.get_default_device().type == "cpu"
        for prefix, cfg in self._configs:
            if cfg is None:
                cos = sin = None
            elif lazy:
                cos, sin = (lazy_zeros((max_positions, cfg.rotary_dim), torch.float32) for _ in range(2))
            else:
                cos, sin = _rope_tables(cfg, max_positions)
            self.register_buffer(prefix + "cos", cos, persistent=False)
            self.register_buffer(prefix + "sin", sin, persistent=False)
        self.filled = 0 if lazy else max_positions  # rows computed: positions below it

    def ensure(self, end: int) -> None:
        """Compute the tables' rows up to position `end` (exclusive) where a lazy table has not yet: ROPE_ROWS
        rows at a time, each row as the whole table would hold it (_rope_tables over its positions)."""
        if end <= self.filled:
            return
        top = min(self.max_positions, -(-end // ROPE_ROWS) * ROPE_ROWS)
        for prefix, cfg in self._configs:
            if cfg is not None:
                cos, sin = _rope_tables(cfg, self.max_positions, self.filled, top)
                getattr(self, prefix + "cos")[self.filled:top] = cos
                getattr(self, prefix + "sin")[self.filled:top] = sin
        self.filled = top

    def cover(self, positions: torch.Tensor) -> None:
        """`ensure` the rows of `positions` (int64, any shape); nothing to compute (no host read of the positions)
        once the tables are whole."""
        if self.filled < self.max_positions:
            self.ensure(int(positions.max()) + 1)

    def _apply(self, fn, recurse: bool = True):
        self.ensure(self.max_positions)  # a copy (another device, dtype) of the whole tables
        return super()._apply(fn, recurse)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [B, T] -> (cos, sin), each [B, 1, T, rd] fp32."""
        self.cover(positions)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def local(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """positions int64 [B, T] -> the local layers' (cos, sin), each [B, 1, T, rd] fp32; None where every
        layer rotates by the same RoPE."""
        if self.local_cos is None:
            return None
        self.cover(positions)
        return self.local_cos[positions].unsqueeze(1), self.local_sin[positions].unsqueeze(1)

    @staticmethod
    def signed(sin: torch.Tensor) -> torch.Tensor:
        """sin [..., hd] -> sin with its first half negated (`apply_rotary`); made once per step, for
        every layer, so no third table sits beside cos and sin."""
        half = sin.shape[-1] // 2
        return torch.cat((-sin[..., :half], sin[..., half:]), -1)


# rows a lazy Rotary computes at a time (Rotary.ensure): 4096 positions of Gemma 3's head_dim 256, 4 MiB a table
ROPE_ROWS = 4096


def _rope_tables(config: ModelConfig, max_positions: int, start: int = 0,
                 end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's (cos, sin) tables of `config` for a window of `max_positions` positions, rows start..end-1 (default
    all) [end - start, rotary_dim] fp32 (empty on the meta device: RoPE math there would run Python decompositions
    that import torch._dynamo)."""
    end = max_positions if end is None else end
    if torch.get_default_device().type == "meta":
        shape = (end - start, config.rotary_dim)
        return torch.empty(shape), torch.empty(shape)
    inv_freq = rope_inv_freq(config, max_positions)  # (LongRoPE's factors by the window, not by the rows)
    freqs = torch.outer(torch.arange(start, end, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    factor = rope_attention_factor(config)  # YaRN's: scales q . k through both rotated vectors
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos, sin


def _glue_kernels(x: torch.Tensor):
    """tiered/kernels' module where it runs `x`'s elementwise glue (a CPU tensor in fp32 or bf16: its rope and
    swiglu, one pass each where torch's ops take several), else None."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.requires_grad:
        return None
    from tiered import kernels

    return kernels.load()


def _norm_rope_kernels(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: RMSNorm):
    """tiered/kernels' module where its rope normalizes x's rows with `norm` on the way (`apply_rotary`): a prompt's
    rows (x [B, H, T, hd], T > 1, rows contiguous) on the CPU, a full RoPE (cos / sin [B, 1, T, hd]) and an fp32
    norm weight [hd]; else None."""
    B, _, T, hd = x.shape
    w = norm.weight
    if (T < 2 or x.stride(-1) != 1 or cos.shape != (B, 1, T, hd) or sin.shape != cos.shape
            or w.dtype != torch.float32 or w.shape != (hd,) or w.device != x.device
            or (torch.is_grad_enabled() and w.requires_grad)):
        return None
    return _glue_kernels(x)


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation of a fused gate/up projection's output: gu [..., 2F] (gate, then up) -> silu(gate) * up
    [..., F] in gu's dtype (`glu` with SiLU)."""
    return _glu(gu, "silu")


def glu_activation(gate: torch.Tensor, act: str) -> torch.Tensor:
    """A GLU's activation of its gate [..., F] (ModelConfig.HIDDEN_ACTS): SiLU, or GELU's tanh approximation
    (Gemma's gelu_pytorch_tanh), in gate's dtype."""
    return F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")


def glu(gu: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """A fused gate/up projection's output gu [..., 2F] (gate, then up) -> act(gate) * up [..., F] in gu's dtype
    (`act` a ModelConfig.HIDDEN_ACTS name; `swiglu` for SiLU)."""
    return swiglu(gu) if act == "silu" else _glu(gu, act)


def _glu(gu: torch.Tensor, act: str) -> torch.Tensor:
    """`glu`'s computation. On the CPU in one pass (tiered/kernels' swiglu: computed in fp32, rounded once, where
    torch's ops round the activation's output and then the product, and read the two strided halves in two passes:
    ~0.9 ms a layer of a 941-token SmolLM2 prompt in bf16 on 2 AMX cores, 2026-12-05; GeGLU ~5 ms a
    Gemma-3-4B-width layer of a 512-token prompt), also where gu is the transposed view a big one-copy weight's
    GEMM returns (quant/int4.gemm_by_row_chunks past AMX_ROWS rows: each half of its [2F, T] storage in one piece,
    the result [T, F] a transposed view too, which the down projection's GEMM reads as it is): a Gemma-3-4B-width
    1024-token prompt's GeGLU through torch's ops over those halves took 77 ms of its 863; else torch's ops."""
    native = _glue_kernels(gu)
    if native is not None and gu.stride(-1) == 1:
        return native.swiglu(gu, act=act)
    t = _transposed_rows(gu)
    if native is not None and t is not None:
        half = t.shape[0] // 2
        out = native.swiglu(t[:half], up=t[half:], act=act).mT  # [T, F]
        return out.view(*gu.shape[:-1], half)
    gate, up = gu.chunk(2, -1)
    return glu_activation(gate, act) * up


def _transposed_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x [1.., T, N] stored transposed (its [N, T] contiguous: a GEMM that wrote y^T) -> that [N, T] view; else None."""
    if x.dim() < 2 or any(n != 1 for n in x.shape[:-2]) or x.shape[-1] % 2:
        return None
    t = x.reshape(x.shape[-2:]).mT if x.dim() > 2 else x.mT
    return t if t.is_contiguous() and t.data_ptr() == x.data_ptr() else None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 sin_signed: torch.Tensor | None = None, norm: RMSNorm | None = None) -> torch.Tensor:
    """x [B, H, T, hd]; cos/sin [B, 1, T, rd] fp32 (rd <= hd) -> rotated x in x's dtype; with `norm` (an RMSNorm
    over hd: Qwen3's per-head q/k norm) each head's row is normalized first, the norm and the rotation in fp32 and
    the result rounded once to x's dtype (on the CPU one native pass for a prompt's rows: tiered/kernels' rope with
    the norm's weight; the separate fp32 passes bit for bit, without the normalized rows in memory).

    A partial RoPE (rd < hd: GLM-4.5's partial_rotary_factor) rotates each head's first rd features
    (rotate-half over those) and passes the other hd - rd through unchanged, as transformers'
    apply_rotary_pos_emb with tables narrower than the head.

    With sin_signed (`Rotary.signed`: sin with its first half negated), rotate_half(x) * sin is
    computed as roll(x, hd/2) * sin_signed: one op for chunk, neg and cat, the same values bit for
    bit (a sign moves from a factor to the other). Each op is a kernel launch on a GPU, where a
    decode step's host time is mostly such launches.
    """
    rd = cos.shape[-1]
    if norm is not None:
        native = _norm_rope_kernels(x, cos, sin, norm)
        if native is not None:  # the norm and RoPE in one pass, fp32 inside, rounded once: RMSNorm's fp32 values
            return native.rope(x, cos, sin, norm.weight, norm.eps)
        out = apply_rotary(norm(x.float()), cos, sin, sin_signed)
        return out if x.dtype == torch.float32 else out.to(x.dtype)
    if rd != x.shape[-1]:  # partial RoPE: rotate the first rd features, pass the rest through
        return torch.cat((apply_rotary(x[..., :rd], cos, sin, sin_signed), x[..., rd:]), -1)
    if x.shape[2] > 1 and x.stride(-1) == 1 and cos.shape == (x.shape[0], 1, x.shape[2], rd) and sin.shape == cos.shape:
        native = _glue_kernels(x)
        if native is not None:
            return native.rope(x, cos, sin)  # a prompt's rows in one pass: the same values
    dtype = x.dtype
    xf = x.float() if dtype != torch.float32 else x
    if sin_signed is None:
        out = xf * cos + _rotate_half(xf) * sin
    else:
        out = xf * cos + xf.roll(x.shape[-1] // 2, -1) * sin_signed
    return out if dtype == torch.float32 else out.to(dtype)


class AttentionMetadata:
    """Per-step inputs shared by all layers (plain data; built once per step by the engine).

    Attributes:
        positions: int64 [B, T] absolute position of each new token.
        slots: int64 [B] KV-cache row of each sequence.
        cos, sin: RoPE tables gathered for `positions`, [B, 1, T, rd] fp32 (rd = config.rotary_dim);
            sin_signed the same for Rotary.signed (or None: apply_rotary then takes the three-op
            rotate-half).
        mask: bool [B, 1, T, S] (True = attend), or None when `causal` or one sequence's single
            newest token needs no mask.
        causal: a single sequence's prefill from position 0 (SDPA's built-in causal mask).
        kv_len: S, the number of cache positions attended to.
        single: (slot, start) as ints when B == 1 and the new tokens take positions start..start+T-1
            (every prefill and single-sequence decode): the KV write is then a plain slice copy.
        segments: prompts packed into one row (build_packed_metadata: B == 1, T their tokens one after
            another), each (offset, length, its own metadata): its columns offset..offset+length-1 of the
            row write their KV to its slot and attend to its slot's cache alone. None: every row one sequence.
        windowed: the model's sliding window (config.sliding_window, every layer's) cuts keys some query
            would see causally: `mask` has it. False: the mask (or `causal`) is plain causal.
    """

    __slots__ = ("positions", "slots", "cos", "sin", "mask", "causal", "kv_len", "contiguous_slots", "single",
                 "sin_signed", "local", "segments", "aligned", "windowed", "local_rope", "local_meta")

    def __init__(self, positions, slots, cos, sin, mask, causal, kv_len, contiguous_slots, single=None,
                 sin_signed=None, windowed=False) -> None:
        self.positions, self.slots, self.cos, self.sin = positions, slots, cos, sin
        self.mask, self.causal, self.kv_len, self.contiguous_slots = mask, causal, kv_len, contiguous_slots
        self.single = single  # (slot, first position) when one sequence writes consecutive positions
        self.sin_signed = sin_signed  # sin, first half negated (Rotary.signed), or None
        self.windowed = windowed  # the mask cuts keys by the model's sliding window
        self.local = None  # window_mask's (window, mask, causal), made by the first layer with that window
        self.aligned = None  # KVCache.aligned's (mask, that mask widened), made by the first layer that widens it
        self.segments: tuple[tuple[int, int, "AttentionMetadata"], ...] | None = None  # build_packed_metadata's
        self.local_rope = None  # the local layers' (cos, sin) where they rotate by their own RoPE (Rotary.local)
        self.local_meta = None  # local_rope_metadata's, made by the first layer that asks

    def with_rope(self, rotary: "Rotary") -> "AttentionMetadata":
        """Sets local_rope from `rotary` (Rotary.local at these positions); returns self."""
        self.local_rope = rotary.local(self.positions)
        return self


def local_rope_metadata(meta: AttentionMetadata) -> AttentionMetadata:
    """The metadata a local layer with a RoPE of its own reads (Gemma 3's sliding layers): `meta` with cos, sin
    and sin_signed of meta.local_rope, the rest shared (made once per step, kept in meta.local_meta); meta
    itself where there is no local RoPE."""
    if meta.local_rope is None:
        return meta
    if meta.local_meta is None:
        m = copy.copy(meta)
        m.cos, m.sin = meta.local_rope
        m.sin_signed = Rotary.signed(m.sin) if meta.sin_signed is not None else None
        m.local_rope = m.local_meta = None
        m.local = m.aligned = None
        meta.local_meta = m
    return meta.local_meta


def window_mask(meta: AttentionMetadata, window: int) -> tuple[torch.Tensor | None, bool]:
    """(mask, causal) of a layer that attends only to its last `window` positions (gpt-oss's sliding
    layers, ModelConfig.local_window) in a step whose own mask (`meta.mask`, `meta.causal`) has no
    window: the step's own while no query sees more than `window` positions (kv_len <= window), else
    attention_mask's with the window. Made once per step (kept in meta.local)."""
    if meta.kv_len <= window:
        return meta.mask, meta.causal
    if meta.local is None or meta.local[0] != window:
        meta.local = (window, attention_mask(meta.positions, meta.kv_len, window), False)
    return meta.local[1], meta.local[2]


def attention_mask(positions: torch.Tensor, kv_len: int, sliding_window: int | None) -> torch.Tensor:
    """bool [B, 1, T, kv_len] on positions' device: True where query position positions[b, t] may
    attend to cache position s (s <= position, and within the sliding window when there is one)."""
    keys = torch.arange(kv_len, device=positions.device)
    q = positions.unsqueeze(-1)  # [B, T, 1]
    mask = keys <= q
    if sliding_window is not None:
        mask &= keys > q - sliding_window
    return mask.unsqueeze(1)  # [B, 1, T, S]


def build_attention_metadata(rotary: Rotary, positions: torch.Tensor, slots: torch.Tensor,
                             sliding_window: int | None) -> AttentionMetadata:
    """Masks and RoPE tables for one step. positions int64 [B, T]; slots int64 [B]."""
    B, T = positions.shape
    kv_len = int(positions.max()) + 1
    cos, sin = rotary(positions)
    in_window = sliding_window is None or kv_len <= sliding_window
    causal = B == 1 and T == kv_len and in_window
    newest = B == 1 and T == 1 and in_window
    mask = None if causal or newest else attention_mask(positions, kv_len, sliding_window)
    contiguous = bool(slots[0] == 0 and (B == 1 or bool((slots.diff() == 1).all())))
    single = None
    if B == 1 and kv_len - T == int(positions[0, 0]):  # positions are start .. kv_len - 1
        single = (int(slots[0]), kv_len - T)
    return AttentionMetadata(positions, slots, cos, sin, mask, causal, kv_len, contiguous, single,
                             rotary.signed(sin), windowed=not in_window).with_rope(rotary)


def build_packed_metadata(rotary: Rotary, positions: torch.Tensor, spans: list[tuple[int, int]], slots: list[int],
                          sliding_window: int | None) -> AttentionMetadata:
    """Metadata of one step over prompts packed into one row (varlen prefill, as vLLM packs a batch's prompts):
    prompt i's positions spans[i] = (start, end) of slot slots[i], its tokens the row's next end - start
    columns. The row's projections, norms and FFN run over every prompt's tokens at once, with no padded
    position; each prompt writes its KV to its own slot and attends only to that slot's cache
    (Attention._attend's `segments`): causally over its own tokens from position 0, or through an explicit
    mask after `start` cached positions (a reused prefix).

    Args:
        positions: int64 [1, N] on the model's device, N = the spans' tokens: each span's start..end-1 in turn.
        spans: (start, end) cache positions of each prompt's tokens, end > start >= 0.
        slots: each prompt's KV-cache slot.
    Returns:
        AttentionMetadata with `segments` set; its own mask None (each segment has its own).
    Raises:
        ValueError: spans and slots of different lengths, an empty span, or positions not of their tokens.
    """
    if len(spans) != len(slots) or any(b <= a or a < 0 for a, b in spans):
        raise ValueError(f"packed prompts need one slot and a non-empty span each: {spans}, {slots}")
    N = sum(b - a for a, b in spans)
    if tuple(positions.shape) != (1, N):
        raise ValueError(f"positions {tuple(positions.shape)} are not the spans' {N} tokens in one row")
    cos, sin = rotary(positions)
    device = positions.device
    slot_t = torch.tensor(slots, dtype=torch.long, device=device)
    segments, offset = [], 0
    for i, ((a, b), slot) in enumerate(zip(spans, slots)):
        pos = positions[:, offset:offset + b - a]
        in_window = sliding_window is None or b <= sliding_window
        causal = a == 0 and in_window
        mask = None if causal else attention_mask(pos, b, sliding_window)
        one = AttentionMetadata(pos, slot_t[i:i + 1], None, None, mask, causal, b, slot == 0, single=(slot, a),
                                windowed=not in_window)
        segments.append((offset, b - a, one))
        offset += b - a
    meta = AttentionMetadata(positions, slot_t, cos, sin, None, False, max(b for _, b in spans), False,
                             sin_signed=rotary.signed(sin)).with_rope(rotary)
    meta.segments = tuple(segments)
    return meta


def build_static_decode_metadata(rotary: Rotary, positions: torch.Tensor, slots: torch.Tensor, kv_len: int,
                                 sliding_window: int | None, contiguous_slots: bool) -> AttentionMetadata:
    """Decode metadata with no host sync (gpt-fast's static-shape recipe, for CUDA-graph capture):
    attention over a fixed `kv_len` cache positions with a mask built on the device, KV writes by
    index at `positions`. positions int64 [B, 1] (each < kv_len); slots int64 [B] (0..B-1 when
    `contiguous_slots`). Gives the same attention as `build_attention_metadata`: masked positions
    carry no weight."""
    cos, sin = rotary(positions)
    mask = attention_mask(positions, kv_len, sliding_window)
    return AttentionMetadata(positions, slots, cos, sin, mask, False, kv_len, contiguous_slots, None,
                             rotary.signed(sin), windowed=sliding_window is not None and kv_len > sliding_window
                             ).with_rope(rotary)


def quantize_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows of an int8 KV cache: x [..., hd] (any float dtype) -> int8 [..., kv_row_bytes(hd)], each row's hd
    values q = round(x / s) and then the bytes of its blocks' fp32 scales, s = max|x| / 127 over each block of
    32 values (kv_block; 0 for a zero block). The native step's rule (kernels/csrc/decode.cpp quantize_row), the
    same bits; llama.cpp's q8_0 cache has the same blocks with fp16 scales. 1.125 bytes a value against bf16's 2;
    on SmolLM2 a scale per head row of 64 (1.06 bytes) had 2.2x the KL to an fp32 cache (0.0047 against 0.0022
    nats over 1024 tokens of prose)."""
    hd = x.shape[-1]
    bs = kv_block(hd)
    xf = x.float().unflatten(-1, (hd // bs, bs))
    s = xf.abs().amax(-1, keepdim=True) / 127.0
    q = torch.round(xf / torch.where(s > 0, s, torch.ones_like(s))).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q.flatten(-2), s.squeeze(-1).contiguous().view(torch.int8)], -1)


def dequantize_kv_rows(rows: torch.Tensor, dtype: torch.dtype, hd: int) -> torch.Tensor:
    """int8 KV cache rows [..., kv_row_bytes(hd)] of hd values (quantize_kv_rows) -> values [..., hd] in `dtype`
    (q x s in fp32, then rounded to `dtype`)."""
    bs = kv_block(hd)
    s = rows[..., hd:].contiguous().view(torch.float32).unsqueeze(-1)  # [..., blocks, 1]
    return (rows[..., :hd].float().unflatten(-1, (hd // bs, bs)) * s).flatten(-2).to(dtype)


def forgetting_advance(config: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype,
                       device: torch.device | str, advance: int | None) -> int | None:
    """`advance` where a KVCache of these arguments forgets behind its sliding layers' windows (KVCache.forget: the
    model has sliding layers and its tensors are lazily committed in RAM: memory/host.lazily_committed), else None.
    What it holds at most, and the budget reserves: memory/sizes.kv_cache_bytes(..., advance=this)."""
    if advance is None or not config.windowed:
        return None
    return advance if lazily_committed(tensor_bytes(_kv_shape(config, num_slots, max_len, dtype)[0], dtype), device) \
        else None


def _kv_shape(config: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype) -> tuple[tuple, tuple]:
    """The shapes of a KVCache's k and v tensors: [L, num_slots, Hkv, max_len, width] each (kv_cache_widths')."""
    heads, kw, vw = kv_cache_widths(config, "int8" if dtype == torch.int8 else None)
    return tuple((config.num_hidden_layers, num_slots, heads, max_len, w) for w in (kw, vw))


class KVCache:
    """Keys and values of every layer for up to `num_slots` sequences of `max_len` positions.

    Tensors k, v: [L, num_slots, Hkv, max_len, hd] in `dtype`; mutable run state, kept apart from
    the weights (llama2.c's RunState). Under latent attention (ModelConfig.is_mla) k is
    [L, num_slots, 1, max_len, kv_lora_rank + qk_rope_head_dim] (the latent and the RoPE key, see
    models/deepseek.py) and v is empty ([..., 0]): ModelConfig.kv_widths.

    With `dtype` torch.int8 the cache is int8 (Plan.dtypes["kv_cache"] "int8"; `quantized`): each
    (position, KV head) row holds hd int8 values and an fp32 scale per block of 32, k, v [L, num_slots, Hkv,
    max_len, kv_row_bytes(hd)] (quantize_kv_rows); `update` writes rows quantized and returns them dequantized in the
    activations' dtype, and the native decode step reads them itself. Whole rows move as they are (copy_slots,
    lend), scales and all.

    Sliding layers forget (`advance`, Plan.kv_window): a layer attending to its last `window` positions
    (ModelConfig.window_of: Gemma 2 / 3's local layers, gpt-oss's sliding ones, Mistral's and Phi-3's windowed
    models) never reads a sequence's positions more than `window` before its next query again, so `forget` hands
    their pages back to the OS as the sequence advances (the tensors stay [.., max_len, ..]: every reader indexes
    them as before, and a forgotten position reads 0 behind every reader's window mask). Gemma 3 27B's 52 local
    layers of 62 then hold ~2.5k positions each, not the 128k of its context window: what llama.cpp's SWA cache
    keeps. A slot whose positions were forgotten serves a prefix reuse from its `forgotten` floor on, or ending
    within its checkpoint (`reusable`): `protect` keeps the window before a sequence's prompt end (llama.cpp's SWA
    checkpoint), so the next turn of a conversation whose template drops the last answer's reasoning (gpt-oss's
    harmony, Qwen3's thinking) still reuses the whole earlier prompt. `lend` / `copy_slots` carry the floor with the
    KV. Only a lazily committed CPU cache forgets
    (memory/host.lazily_committed): elsewhere `advance` is ignored. On 2 MiB pages (`huge_pages`, a generate
    call's cache) the kernel splits a huge page whose part is handed back; its freed 4 KiB pages return to the OS
    when the kernel's deferred split runs (under memory pressure), while the process's RSS drops at once.
    `advance`: the most positions a sequence writes between two forgets (Plan.kv_advance); None: no forgetting.

    Raises:
        ConfigError: an int8 cache of latent attention (its rows are shared by every head: not quantized).
    """

    def __init__(self, config: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", huge_pages: bool = False, advance: int | None = None) -> None:
        self.quantized = dtype == torch.int8
        self.config = config
        # on the CPU committed as positions are written (memory/host.lazy_zeros): a server's slots of max_context
        # positions cost the RAM its sequences use; `huge_pages` (a cache its call fills): 2 MiB pages, whose
        # attention reads miss the TLB less
        self.k, self.v = (lazy_zeros(shape, dtype, device, huge_pages)
                          for shape in _kv_shape(config, num_slots, max_len, dtype))
        self.max_len = max_len
        # (layer, window) of the sliding layers this cache forgets behind; none where it cannot hand pages back
        self.advance = forgetting_advance(config, num_slots, max_len, dtype, device, advance)
        self.windows = [(i, w) for i in range(config.num_hidden_layers)
                        if (w := config.window_of(i)) is not None] if self.advance is not None else []
        # per slot: the horizon of its last forget [positions] (0: nothing forgotten). A sliding layer of window w
        # has handed back the slot's positions before forgotten[slot] - w; a prefix of n >= forgotten[slot]
        # positions is whole for every query from n on (`keeps`)
        self.forgotten = [0] * num_slots
        # per slot: (lo, end) where `protect` keeps each sliding layer's positions lo - w .. end - 1 (a prompt's end:
        # a reuse of lo..end positions is whole), or None
        self.checkpoint: list[tuple[int, int] | None] = [None] * num_slots
        self.hold: dict[int, int] = {}  # slot -> positions its forgets keep whatever its length (`forget`)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors k and v (every slot's max_len positions; virtual where lazily committed)."""
        return (self.k.numel() + self.v.numel()) * self.k.element_size()

    @property
    def held_bytes(self) -> int:
        """The most bytes this cache holds [bytes]: `nbytes`, or for a forgetting cache (`advance`) its sliding
        layers' positions counted as memory/sizes.kv_layer_positions counts them. What the budget reserves."""
        if self.advance is None:
            return self.nbytes
        fmt = "int8" if self.quantized else format_of(self.k.dtype)
        return kv_cache_bytes(self.config, self.k.shape[1], self.max_len, fmt, self.advance)

    def reusable(self, slot: int, n: int) -> int:
        """The most of `slot`'s first `n` positions a sequence continuing after them reuses (a prefix reuse): all n
        where every sliding layer still holds the window before n (n >= forgotten[slot]); up to the checkpoint's
        end where n reaches into it (`protect`); else none."""
        floor = self.forgotten[slot]
        if n >= floor:
            return n
        cp = self.checkpoint[slot]
        return min(n, cp[1]) if cp is not None and n >= cp[0] else 0

    def keeps(self, slot: int, n: int) -> bool:
        """Whether a sequence continuing at position n reuses all of `slot`'s first `n` positions (`reusable`)."""
        return self.reusable(slot, n) == n

    def restart(self, slot: int) -> None:
        """`slot` is written again from position 0 (a sequence reusing none of it): nothing is forgotten."""
        self.forgotten[slot] = 0
        self.checkpoint[slot] = None

    def resume(self, slot: int, n: int) -> None:
        """A new sequence continues `slot` after its first `n` positions (a reuse `reusable` allowed): the floor is
        the one serving n (the checkpoint's where n ends within it), and a checkpoint below it hands its pages
        back (the new sequence's own follows at its prompt's end)."""
        if self.advance is None:
            return
        floor, cp = self._floor_for(slot, n), self.checkpoint[slot]
        if cp is not None and floor != cp[0]:  # the old checkpoint's positions below the kept window
            for i, w in self.windows:
                self._release(slot, i, max(0, cp[0] - w), min(cp[1], floor - w))
        self.forgotten[slot], self.checkpoint[slot] = floor, None

    def protect(self, slot: int, end: int) -> None:
        """Keep each sliding layer's window before position `end` of `slot` (its sequence's prompt end, written or
        being written) through later forgets, from KV_FORGET_SLACK before `end` (or the floor, where higher): a later
        prompt sharing the first n positions, n in that range, reuses them (`reusable`). One checkpoint a slot, the
        latest. What it keeps counts in memory/sizes.kv_layer_positions."""
        if self.advance is not None and (self.checkpoint[slot] is None or self.checkpoint[slot][1] != end):
            self.checkpoint[slot] = (min(end, max(end - KV_FORGET_SLACK, self.forgotten[slot])), end)

    def forget(self, slot: int, length: int) -> int:
        """Hand back the pages of `slot`'s positions that no later query of its sequence reads: with the first
        `length` positions written (its KV), each sliding layer of window w forgets the positions before
        length - KV_FORGET_SLACK - w (memory/host.release_pages over each head's row of keys and of values),
        once that horizon is KV_FORGET_STEP past the last (`forgotten`), all but the checkpoint's positions
        (`protect`); a `hold` on the slot caps `length` (a leader whose prefix its followers take this step:
        LLM.step). Returns the bytes handed back."""
        if self.advance is None:
            return 0
        horizon = min(length, self.hold.get(slot, length)) - KV_FORGET_SLACK
        last = self.forgotten[slot]
        if horizon - last < KV_FORGET_STEP:
            return 0
        self.forgotten[slot] = horizon
        cp = self.checkpoint[slot]
        freed = 0
        for i, w in self.windows:  # positions last - w .. horizon - w - 1, but the checkpoint's
            a, b = max(0, last - w), horizon - w
            for x, y in [(a, b)] if cp is None else [(a, min(b, cp[0] - w)), (max(a, cp[1]), b)]:
                if y > x:
                    freed += self._release(slot, i, x, y, cp[1] if cp is not None and cp[1] <= x else 0)
        return freed

    def _release(self, slot: int, layer: int, start: int, end: int, kept_below: int = 0) -> int:
        """release_pages over positions start..end-1 of every head's keys and values of `slot` in `layer`, and the
        page holding `start` too where it lies within the row and after `kept_below` (the positions before start
        are forgotten but for those from kept_below on: a checkpoint's). Returns the bytes handed back."""
        freed = 0
        if end <= start:
            return 0
        for t in (self.k, self.v):
            rows = t[layer, slot]  # [Hkv, max_len, width]
            step = rows.stride(1) * rows.element_size()  # bytes a position takes in a head's row
            if step == 0:
                continue
            for h in range(rows.shape[0]):
                base = rows[h].data_ptr()
                lo = max(base + kept_below * step, (base + start * step) // PAGE_BYTES * PAGE_BYTES)
                freed += release_pages(lo, base + end * step - lo)
        return freed

    def _carry_floor(self, dst: int, floor: int) -> None:
        """Slot dst, taking another slot's KV (copy_slots), takes the `floor` that serves it; its own positions
        before it hand their pages back (a former sequence's, read by no query of the new one)."""
        if floor > self.forgotten[dst]:
            for i, w in self.windows:
                if floor > w:
                    self._release(dst, i, 0, floor - w)
        self.forgotten[dst] = floor

    def resident_bytes(self) -> int | None:
        """Of `nbytes`, the bytes in RAM now [bytes] (memory/host.resident_bytes: on the CPU the cache is committed as
        positions are written); None off the CPU."""
        from tiered.memory.host import resident_bytes

        k, v = resident_bytes(self.k), resident_bytes(self.v)
        return None if k is None or v is None else k + v

    def copy_slots(self, parents: list[int], length: int, start: int = 0) -> None:
        """Slot j takes over slot parents[j]'s positions start..length-1 in every layer (beam search:
        a beam continuing another beam inherits its KV; positions before `start` are the same in
        every slot, the shared prompt's). Slots with parents[j] == j keep theirs; the sources are read
        before any slot is written, so slots may swap.

        Args:
            parents: for each slot 0..len(parents)-1, the slot whose KV it takes.
            length: end of the positions copied (<= max_len); start: their first.
        """
        moved = [j for j, p in enumerate(parents) if p != j]
        if not moved or length <= start:
            return
        sources = list(dict.fromkeys(parents[j] for j in moved))
        if any(self.forgotten[p] for p in sources):  # a forgetting cache's sliding layers: their kept positions only
            self._copy_kept(parents, moved, sources, length, start)
            return
        for t in (self.k, self.v):
            # each source slot's positions cloned first (a slice each), then a slice copy per slot. index_select over
            # the slots of the positions' view took 100x longer on the CPU (a strided gather: SmolLM2, 48 slots of 828
            # positions, one slot's 200 lent: 24.8 ms against 0.2; 8 beams of 60 positions 1.2 against 0.3), and
            # LLM.step lends a shared prefix a follower at a time (SharedPrefixes: 47 followers took 2.5 s)
            parts = {p: t[:, p, :, start:length].clone() for p in sources}
            for j in moved:
                t[:, j, :, start:length].copy_(parts[parents[j]])
        for j in moved:  # its positions from `start` on are the source's, whole
            self.forgotten[j], self.checkpoint[j] = (self.forgotten[j] if start else 0), None

    def _copy_kept(self, parents: list[int], moved: list[int], sources: list[int], length: int, start: int) -> None:
        """copy_slots where a source slot has forgotten positions: layer by layer, each sliding layer from the
        source's first kept position before `length` (its floor's window, or where `length` ends within its
        checkpoint the checkpoint's: what lies before it reads 0 there, and copied it would commit the destination's
        pages for nothing); each destination then takes that floor (`_carry_floor`; with `start` > 0, the higher of
        the two: its positions before start are its own) and no checkpoint."""
        windows = dict(self.windows)
        floors = {p: self._floor_for(p, length) for p in sources}
        for t in (self.k, self.v):
            for i in range(t.shape[0]):
                w = windows.get(i)
                lo = {p: start if w is None else max(start, min(length, floors[p] - w)) for p in sources}
                parts = {p: t[i, p, :, lo[p]:length].clone() for p in sources}
                for j in moved:
                    t[i, j, :, lo[parents[j]]:length].copy_(parts[parents[j]])
        for j in moved:
            mine = self.forgotten[j]
            self._carry_floor(j, floors[parents[j]])
            self.checkpoint[j] = None
            if start:
                self.forgotten[j] = max(self.forgotten[j], mine)

    def _floor_for(self, slot: int, length: int) -> int:
        """The floor from which `slot` holds the window before `length` (`reusable`'s): its own, or its
        checkpoint's where `length` ends within the checkpoint."""
        cp = self.checkpoint[slot]
        if length < self.forgotten[slot] and cp is not None and cp[0] <= length <= cp[1]:
            return cp[0]
        return self.forgotten[slot]

    def lend(self, moves: dict[int, int], length: int) -> None:
        """Slot dst takes slot moves[dst]'s positions 0..length-1 in every layer (a prompt's KV shared
        by its twins, or a prefix lent by a running slot: engine/scheduler.py); copy_slots for a few slots.

        Args:
            moves: {destination slot: source slot}; length: positions copied (<= max_len).
        """
        parents = list(range(self.k.shape[1]))
        for dst, src in moves.items():
            parents[dst] = src
        self.copy_slots(parents, length)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
        """Write new k/v [B, Hkv, T, hd] at meta.positions; return cached k/v [B, Hkv, S, hd] (an int8
        cache's dequantized in k's dtype)."""
        if self.quantized:
            ck, cv = self._update(layer, quantize_kv_rows(k), quantize_kv_rows(v), meta)
            return dequantize_kv_rows(ck, k.dtype, k.shape[-1]), dequantize_kv_rows(cv, v.dtype, v.shape[-1])
        return self._update(layer, k, v, meta)

    def _update(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
        ck, cv = self.k[layer], self.v[layer]
        S = meta.kv_len
        if meta.single is not None:  # one sequence, consecutive positions: a slice copy
            slot, start = meta.single
            ck[slot, :, start:S].copy_(k[0])
            cv[slot, :, start:S].copy_(v[0])
            return ck[slot:slot + 1, :, :S], cv[slot:slot + 1, :, :S]
        rows = meta.slots.unsqueeze(1)  # [B, 1]
        ck[rows, :, meta.positions] = k.transpose(1, 2).to(ck.dtype)  # [B, T, Hkv, hd]
        cv[rows, :, meta.positions] = v.transpose(1, 2).to(cv.dtype)
        if meta.contiguous_slots:
            B = meta.slots.shape[0]
            return ck[:B, :, :S], cv[:B, :, :S]
        return ck[meta.slots, :, :S], cv[meta.slots, :, :S]

    def aligned(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A CPU prompt's cached k/v [1, Hkv, S, hd] (`update`'s, one sequence: meta.single) widened to the next
        multiple of KV_ALIGN positions of its slot, and its `mask` [1, 1, T, S] (None under SDPA's causal mask)
        widened to match with False: the positions past S are never attended to (a causal prompt from position 0
        has its T == S queries before them, and SDPA's causal mask is top-left aligned). Else k, v and mask as
        given: another device, an int8 cache (update's dequantized copies), no room in the slot, or S aligned.
        A widened mask is made once a step and mask (kept in meta.aligned: a windowed layer's own, window_mask's,
        beside the step's).

        torch's CPU flash attention (2.13) runs key counts that are not a multiple of 16 far slower: on 2
        Sapphire Rapids cores, SmolLM2's heads (9 on 3 KV heads of 64, bf16) over 446 keys took 1.36-1.57 ms
        where 448 took 0.67-0.74, and the keys widened to 16 took 0.46-0.92x the time at every length tried
        (195-1000, causal or masked after cached positions; fp32 0.75-1.03x) (2026-12-05)."""
        S = k.shape[2]
        P = -(-S // KV_ALIGN) * KV_ALIGN
        if P == S or P > self.max_len or meta.single is None or self.quantized or k.device.type != "cpu":
            return k, v, mask
        slot = meta.single[0]
        if mask is not None:  # (the step's own mask, or a windowed layer's: window_mask)
            if meta.aligned is None or meta.aligned[0] is not mask:
                meta.aligned = (mask, F.pad(mask, (0, P - S), value=False))
            mask = meta.aligned[1]
        return self.k[layer][slot:slot + 1, :, :P], self.v[layer][slot:slot + 1, :, :P], mask


def _window_keys(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, start: int, window: int):
    """One sequence's cached k / v [1, Hkv, S, hd] and its windowed layer's `mask` [1, 1, T, S] for queries at
    positions start.. without the leading keys no query sees (memory/sizes.window_key_start: those before
    start - window + 1, from a multiple of KV_ALIGN): a sliding layer then attends over its window, O(T (T +
    window)), not the whole context, and never reads the positions a forgetting cache handed back (KVCache.forget:
    reading them would map the zero page into the cache's range)."""
    lo = window_key_start(start, window)
    if lo == 0:
        return k, v, mask
    return k[:, :, lo:], v[:, :, lo:], mask[..., lo:]


def set_prompt_attention(model: nn.Module, dtype: torch.dtype | None) -> int:
    """Make every Attention layer of `model` attend steps of 2+ tokens (prompts, prefill chunks) in `dtype`
    where the KV cache holds its keys and values in it (Attention.prompt_dtype; None: in the activations'
    dtype, as before). The plan's choice (Plan.dtypes["prompt_attention"], planner/latency_cpu.prompt_attention):
    fp32 activations over a bf16 KV cache attend in bf16, the queries rounded to bf16 and the keys and values
    read as cached instead of upcast, where torch's bf16 attention is the faster (AVX-512 BF16 / AMX). On 2
    Sapphire Rapids cores SmolLM2's default 512-token prompt took 161 ms against 206 (2026-12-02). A step
    whose cache is in another format (LLM.logits' lossless fp32 cache) is untouched. Returns the layers set."""
    return _set_prompt_dtype(model, Attention, dtype)


def set_prompt_ffn(model: nn.Module, dtype: torch.dtype | None) -> int:
    """Make every dense MLP of `model` run a prompt's intermediate in `dtype` where its projections compute that
    call in it (MLP.prompt_dtype; None: in the activations' dtype). The plan's choice (Plan.dtypes["prompt_ffn"],
    planner/latency_cpu.prompt_ffn): bf16 between one-copy int4 projections that dequantize for bf16 GEMMs.
    Returns the MLPs set."""
    return _set_prompt_dtype(model, MLP, dtype)


def input_dtype(block: nn.Module, x: torch.Tensor, cache: KVCache) -> torch.dtype | None:
    """The dtype in which `block` (a layer's attention or FFN) computes a call on x [B, T, D] without casting x
    itself (its `input_dtype`: Attention's and MLP's prompt dtypes), or None: x's dtype, as any other block takes
    it. A DecoderLayer makes the norm before `block` in it (one rounding, where the block's projections would
    cast the norm's fp32 output)."""
    fn = getattr(block, "input_dtype", None)
    return fn(x, cache) if fn is not None else None


def _set_prompt_dtype(model: nn.Module, kind: type, dtype: torch.dtype | None) -> int:
    """`prompt_dtype` = `dtype` on every `kind` module of `model`; returns how many."""
    found = [m for m in model.modules() if isinstance(m, kind)]
    for m in found:
        m.prompt_dtype = dtype
    return len(found)


def _bf16_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int = 0):
    """tiered/kernels' module where its bf16 attention (csrc/gemv.cpp bf16_prompt_attention) computes a CPU prompt's
    causal attention: bf16 q [B, H, T, hd] (T > 1) at positions past.. and k / v [B, Hkv, S >= past + T, hd] with
    contiguous rows, hd a multiple of 32 up to 256, on AMX tiles or AVX512-BF16 (quant/int4.bf16_attention_kernels:
    AMX not with TIERED_AMX=0); else None."""
    B, H, T, hd = q.shape
    if (T < 2 or q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16
            or hd % 32 or hd > 256 or k.shape != v.shape or k.shape[0] != B or k.shape[2] < past + T
            or k.shape[3] != hd
            or H % k.shape[1] or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1
            or k.stride(2) != v.stride(2) or q.requires_grad):
        return None
    from tiered.quant.int4 import bf16_attention_kernels

    return bf16_attention_kernels()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
           scale: float, gqa: bool, past: int | None = None, window: int = 0) -> torch.Tensor:
    """torch's scaled_dot_product_attention, without the cuDNN backend on CUDA; a CPU prompt's causal attention
    in bf16 on tiered's kernel where it runs (`_bf16_attention`: 32 queries x 64 keys of scores in AMX tiles, or by
    AVX512-BF16's vdpbf16ps without AMX, an online softmax in fp32, the probabilities in bf16 against V; within
    torch's own bf16 error of an fp32 reference): from position 0 (mask None, `causal`: query i over keys 0..i), or a prefill chunk after `past`
    cached positions (query i over keys 0..past + i: what `mask` then says; the caller vouches for it), and with a
    sliding `window` (> 0, with `past`) over keys past + i - window + 1..past + i only (a sliding layer's mask,
    window_mask's / attention_mask's; the kernel skips the key blocks no query of a block sees).
    Against torch's flash attention on 2 AMX cores (2026-12-06, session 94): SmolLM2's 9 x 64 heads at 512 / 2048
    tokens 0.31 / 3.99 ms against 0.83 / 7.22, Qwen3's 32 x 128 (kv 4) at 512 1.92 against 3.52.

    q [B, H, T, hd], k/v [B, Hkv, S, hd] (any float dtype) -> [B, H, T, hd] in q's dtype.
    On a GPU torch (2.5+) ranks cuDNN attention first for Hopper, and cuDNN builds an execution plan
    for every new (T, S): a decode step grows S by one, so the first attention of every step paid
    33-36 ms of host time for the plan (H200, torch 2.11, 2026-11-26: ~10 ms per call on average
    over the offloaded MoE and dense decode; `benchmarks/gpu_stall_probe.py`). Flash and
    memory-efficient attention have no per-shape plan. While a CUDA graph is captured (static
    shapes, a mask: runtime/graphs.py) cuDNN stays allowed, and in the warm-up runs before it
    (hardware/accelerator.building_graph), so its plan is built once, outside the capture; it beat
    memory-efficient attention with a mask there (graphed dense decode 486 vs 398 tok/s).
    The flag is process-wide; it is restored before returning, so other users of torch in the
    process keep their choice.
    """
    if (past is not None or (mask is None and causal)) and q.device.type == "cpu":
        native = _bf16_attention(q, k, v, past or 0)
        if native is not None:
            return native.bf16_prompt_attention(q, k, v, scale, past or 0, window if past is not None else 0)
    if (not (q.is_cuda and torch.backends.cuda.cudnn_sdp_enabled()) or torch.cuda.is_current_stream_capturing()
            or building_graph()):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=gqa)
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=gqa)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


def _fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One weight [sum(out), in] (and bias) holding `linears`' weights one after another, on their
    device; each linear's parameters become views of it (no second copy stays). None when a weight
    is not materialized (meta) or they differ in device or dtype."""
    ws = [l.weight for l in linears]
    if any(w.is_meta for w in ws) or len({(w.device, w.dtype) for w in ws}) != 1:
        return None
    biases = [l.bias for l in linears]
    has_bias = all(b is not None for b in biases)
    if not has_bias and any(b is not None for b in biases):
        return None

    def fuse(parts: list[torch.Tensor]) -> torch.Tensor:
        out = parts[0].detach().new_empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]))
        start = 0
        for p in parts:
            out[start:start + p.shape[0]].copy_(p.detach())
            start += p.shape[0]
        return out
    weight, bias = fuse(ws), fuse(biases) if has_bias else None
    start = 0
    for l in linears:
        n = l.weight.shape[0]
        l.weight = nn.Parameter(weight[start:start + n], requires_grad=False)
        if has_bias:
            l.bias = nn.Parameter(bias[start:start + n], requires_grad=False)
        start += n
    return weight, bias


class Attention(nn.Module):
    """Grouped-query attention with RoPE, optional q/k/v bias (Qwen2), q/k RMSNorm per head (Qwen3)
    or over the whole projection (OLMoE), and optional q/k/v clipping (OLMoE)."""

    # a CPU prompt's keys widened to an aligned count (KVCache.aligned; windowed layers too, their masks widened):
    # `attend` reads SDPA's top-left causal mask
    aligns_keys = True

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        D, H, Hkv, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.layer_idx, self.H, self.Hkv, self.hd = layer_idx, H, Hkv, hd
        bias = config.attention_bias
        self.q_proj = nn.Linear(D, H * hd, bias=bias)
        self.k_proj = nn.Linear(D, Hkv * hd, bias=bias)
        self.v_proj = nn.Linear(D, Hkv * hd, bias=bias)
        self.o_proj = nn.Linear(H * hd, D, bias=config.o_proj_bias)
        # q/k RMSNorm over each head's hd elements (Qwen3) or over the whole projection (OLMoE).
        self.qk_norm_per_head = config.qk_norm_scope == "head"
        if config.qk_norm:
            q_dim, k_dim = (hd, hd) if self.qk_norm_per_head else (H * hd, Hkv * hd)
            self.q_norm = RMSNorm(q_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(k_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.clip_qkv = config.clip_qkv  # OLMoE: clamp q, k, v to [-clip, clip], or None
        # a window of this layer's own (gpt-oss's sliding layers), or None: the step's mask (meta.mask)
        self.local_window = config.local_window if layer_idx in config.local_layers else None
        self.window = config.window_of(layer_idx)  # this layer's window, its own or every layer's (None: none)
        self.scale = config.attn_scale  # hd ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fuse_qkv's (weight, bias)
        # steps of 2+ tokens attend in this dtype where the KV cache holds it (Plan.dtypes["prompt_attention"],
        # set_prompt_attention); None: in the activations' dtype
        self.prompt_dtype: torch.dtype | None = None

    def fuse_qkv(self) -> bool:
        """Compute q, k and v with one GEMM: their weights (and biases) concatenated into one tensor
        [(H + 2 Hkv) hd, D], of which q/k/v_proj's parameters become views (same bytes). Without
        q/k norms, RoPE then rotates q and k in one pass. Fewer kernels per layer: what a GPU decode
        step, graphed or not, is made of (gpt-fast's fused wqkv). Returns whether it fused (not when
        a weight is not materialized)."""
        if self.qkv is None:
            self.qkv = _fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        return self.qkv is not None

    def input_dtype(self, x: torch.Tensor, cache: KVCache) -> torch.dtype | None:
        """The dtype this attention takes a step's x [B, T, D] in without a cast (`layers.input_dtype`): its
        prompt_dtype (Plan.dtypes["prompt_attention"]) for a step of 2+ tokens of another dtype whose KV cache holds
        that dtype (not int8) and whose q, k, v and o projections each compute the step's rows in it
        (quant/linear.dense_dtype: one-copy int4 weights dequantized for bf16 GEMMs); else None. q, k and v then
        come out of their GEMM in that dtype, RoPE rounds once to it as the cache write would, and attention and o
        run in it: the values of x's path bit for bit, which casts x before each GEMM and each GEMM's output back,
        and q to it and attention's output back around attention. Qwen3's per-head q/k norms run in fp32 on the way
        into RoPE (`apply_rotary`'s norm) either way. Not with whole-projection q/k norms or a clip (they run on the
        GEMM's fp32 output), nor fused dense q/k/v weights."""
        dt = self.prompt_dtype
        if (dt is None or x.dim() != 3 or x.shape[1] < 2 or dt == x.dtype or self.qkv is not None
                or (self.q_norm is not None and not self.qk_norm_per_head) or self.clip_qkv is not None
                or cache.quantized or cache.k.dtype != dt):
            return None
        from tiered.quant.linear import dense_dtype

        rows = x.shape[0] * x.shape[1]
        if any(dense_dtype(m, rows) != dt for m in (self.q_proj, self.k_proj, self.v_proj, self.o_proj)):
            return None
        return dt

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; writes this step's k/v into `cache`. x of `input_dtype` stays in it throughout
        (the output too)."""
        B, T, _ = x.shape
        qd, kd = self.H * self.hd, self.Hkv * self.hd
        if self.qkv is not None and self.q_norm is None and self.clip_qkv is None:
            qkv = F.linear(x, *self.qkv)  # (B, T, (H + 2 Hkv) hd)
            # q and k rotated together: their heads side by side, one pass of apply_rotary's ops
            qk = qkv[..., :qd + kd].view(B, T, self.H + self.Hkv, self.hd).transpose(1, 2)
            qk = apply_rotary(qk, meta.cos, meta.sin, meta.sin_signed)  # (B, H + Hkv, T, hd)
            q, k = qk[:, :self.H], qk[:, self.H:]
            v = qkv[..., qd + kd:].view(B, T, self.Hkv, self.hd)
            return self._attend(q, k, v, meta, cache, B, T)
        if self.qkv is not None:
            q, k, v = F.linear(x, *self.qkv).split((qd, kd, kd), -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (B, T, H*hd), (B, T, Hkv*hd) x2
        if self.q_norm is not None and not self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.view(B, T, self.H, self.hd)  # (B, T, H, hd)
        k = k.view(B, T, self.Hkv, self.hd)
        v = v.view(B, T, self.Hkv, self.hd)
        q_norm, k_norm = (self.q_norm, self.k_norm) if self.qk_norm_per_head else (None, None)
        if q_norm is not None and x.dtype != torch.float32 and x.dtype != self.prompt_dtype:
            q, k = q_norm(q), k_norm(k)  # a lower-precision model's norm, in HF's order (RMSNorm.residual)
            q_norm = k_norm = None
        q = apply_rotary(q.transpose(1, 2), meta.cos, meta.sin, meta.sin_signed, q_norm)  # (B, H, T, hd)
        k = apply_rotary(k.transpose(1, 2), meta.cos, meta.sin, meta.sin_signed, k_norm)  # (B, Hkv, T, hd)
        return self._attend(q, k, v, meta, cache, B, T)

    def _attend(self, q, k, v, meta: AttentionMetadata, cache: KVCache, B: int, T: int) -> torch.Tensor:
        """q [B, H, T, hd] and k [B, Hkv, T, hd] rotated, v [B, T, Hkv, hd]: write this step's k/v,
        attend over the cache, project out -> [B, T, D]. Prompts packed into one row (meta.segments) each
        write and attend on their own (`_cached_attend` a segment), their outputs side by side again."""
        v = v.transpose(1, 2)
        if meta.segments is None:
            out = self._cached_attend(q, k, v, meta, cache, T > 1)
        else:
            out = torch.cat([self._cached_attend(q[:, :, o:o + n], k[:, :, o:o + n], v[:, :, o:o + n], one, cache,
                                                 T > 1) for o, n, one in meta.segments], 2)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.H * self.hd))

    def _cached_attend(self, q, k, v, meta: AttentionMetadata, cache: KVCache, prompt: bool) -> torch.Tensor:
        """q [B, H, T, hd], k and v [B, Hkv, T, hd] of one step (or segment): write k/v to the cache at
        meta's positions, attend q over the cache -> [B, H, T, hd]; `prompt`: the step's 2+ tokens attend in
        Attention.prompt_dtype where the cache holds it."""
        k, v = cache.update(self.layer_idx, k, v, meta)  # (B, Hkv, S, hd)
        mask, causal = (meta.mask, meta.causal) if self.local_window is None else window_mask(meta, self.local_window)
        if prompt and self.aligns_keys:  # the keys widened to an aligned count (CPU: KVCache.aligned)
            k, v, mask = cache.aligned(self.layer_idx, k, v, meta, mask)
        lo = 0  # the first key the (trimmed) k / v hold
        if self.window is not None and mask is not None and meta.single is not None:
            lo = window_key_start(meta.single[1], self.window)
            k, v, mask = _window_keys(k, v, mask, meta.single[1], self.window)
        # a chunk of one sequence's consecutive positions: its mask is attend's `past` pattern, over the window its
        # mask has (0: none; None: a local layer's window beside the model's, left to torch's SDPA under the mask)
        if self.local_window is not None:
            window = None if meta.windowed else self.local_window
        else:
            window = self.window if meta.windowed else 0
        past = meta.single[1] - lo if prompt and meta.single is not None and window is not None else None
        if prompt and k.dtype == self.prompt_dtype and q.dtype != k.dtype:  # a prompt in the cache's format
            out = self.attend(q.to(k.dtype), k, v, mask, causal, past, window).to(q.dtype)
        else:
            if k.dtype != q.dtype:  # an fp8 / other KV cache format
                k, v = k.to(q.dtype), v.to(q.dtype)
            out = self.attend(q, k, v, mask, causal, past, window)
        return out

    def attend(self, q, k, v, mask: torch.Tensor | None, causal: bool, past: int | None = None,
               window: int = 0) -> torch.Tensor:
        """q [B, H, T, hd], cached k/v [B, Hkv, S, hd], the layer's mask -> [B, H, T, hd] (`attend`; `past`: the
        queries' first position in k / v where they are one sequence's consecutive positions, `window` the sliding
        window its mask has, 0 for none)."""
        return attend(q, k, v, mask, causal, self.scale, self.H != self.Hkv, past, window)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), or another GLU: down(act(gate(x)) * up(x)) (`act`, a
    ModelConfig.HIDDEN_ACTS name: Gemma's GeGLU "gelu_tanh"). x [..., D] -> [..., D]; F = intermediate size."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        self.act = act
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up: torch.Tensor | None = None  # fuse_gate_up's weight [2F, D]
        # the plan's dtype for a prompt's intermediate (Plan.dtypes["prompt_ffn"], set_prompt_ffn); None: x's
        self.prompt_dtype: torch.dtype | None = None

    def fuse_gate_up(self) -> bool:
        """Compute gate and up with one GEMM: their weights concatenated [2F, D], gate/up_proj's
        parameters views of it (same bytes). Returns whether it fused (not for meta weights)."""
        if self.gate_up is None:
            fused = _fuse_linears([self.gate_proj, self.up_proj])
            self.gate_up = None if fused is None else fused[0]
        return self.gate_up is not None

    def input_dtype(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.dtype | None:
        """The dtype this FFN takes x [..., D] in without a cast (`layers.input_dtype`): `_prompt_dtype`'s, in which
        its projections compute x's rows (the output then in it too); else None."""
        return None if self.gate_up is not None else self._prompt_dtype(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            return self.down_proj(glu(F.linear(x, self.gate_up), self.act))
        dt = self._prompt_dtype(x)
        if dt is not None:  # x cast once; gate, up, their product and down stay in the GEMMs' dtype
            return self._swiglu_down(x.to(dt)).to(x.dtype)
        return self._swiglu_down(x)

    def _swiglu_down(self, h: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(h)) * up(h)); where gate and up are the two halves of one fused projection's output
        (quant/linear.fused_pair: one-copy int4 / int8 weights, whose prompt GEMM computes both at once) that
        output goes to `swiglu` whole: one native pass on the CPU (a SmolLM2 prompt's default path)."""
        from tiered.quant.linear import fused_pair

        gu = fused_pair(self.gate_proj, self.up_proj, h)
        if gu is not None:
            return self.down_proj(glu(gu, self.act))
        return self.down_proj(glu_activation(self.gate_proj(h), self.act) * self.up_proj(h))

    def _prompt_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        """The plan's prompt dtype (self.prompt_dtype: Plan.dtypes["prompt_ffn"], set by set_prompt_ffn) where this
        call's rows take it: x is in another dtype and all three projections compute a call of x's rows in it
        without a cast of their own (quant/linear.dense_dtype: one-copy int4 weights past their kernel's rows
        dequantized for bf16 GEMMs on AVX-512); else None (x's dtype throughout: decode steps, the kernel's rows,
        nn.Linear projections, no plan for it). Their outputs are in that dtype already: casting gate and up back
        to x's dtype for the product and the product to it again for down cost SmolLM2's fp32 512-token prompt
        ~0.7 ms a layer of its 6.9 (206 -> 186 ms over its 30 layers, 2 Sapphire Rapids cores, 2026-12-02); the
        product now rounds to it twice (SiLU, then the product) where it had once (the product, for down's GEMM)."""
        dt = self.prompt_dtype
        if dt is None or dt == x.dtype:
            return None
        from tiered.quant.linear import dense_dtype

        rows = x.numel() // x.shape[-1]
        if any(dense_dtype(m, rows) != dt for m in (self.down_proj, self.gate_proj, self.up_proj)):
            return None  # (a decode step's rows: down says None, the other two not asked)
        return dt
