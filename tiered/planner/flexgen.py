"""FlexGen's throughput-mode policy search: an LP over tensor placement per (GPU batch, #batches).

Source: FlexGen (Sheng et al., ICML 2023) §4.3 and App. A.3; ALGORITHMS.md 4.b (cost model), 4.c
(policy search), 4.f (gaps). For each GPU batch size `gbs` and number of GPU batches `num_gb` in a
block (bls = gbs * num_gb sequences, zig-zag schedule), a linear program chooses the placement
fractions p = (wg, wc, wd, cg, cc, cd, hg, hc, hd) of weights, KV cache and activations over
GPU / CPU / disk that minimise the time per generated token

    T / bls,  T = l * T_pre + (n - 1) * l * T_gen
    T_pre >= ctog^p, gtoc^p, dtoc^p, ctod^p, comp^p          (perfect overlap: max of the terms)
    T_gen >= ctog^g, gtoc^g, dtoc^g, ctod^g, comp^g
    gpu_peak^p, gpu_peak^g <= gpu budget;  cpu_peak^p, cpu_peak^g <= cpu budget;  disk_peak <= disk
    wg+wc+wd = cg+cc+cd = hg+hc+hd = 1,  0 <= p <= 1

with each max (the time terms and the GPU working-memory term) linearised by an auxiliary variable.
Constants come from a HardwareProfile: bandwidths from copy/h2d_pinned, copy/d2h_pinned,
disk/read_cold, disk/write (beta only; the per-copy alpha is ignored); GPU GEMM and attention times
from gemm/gpu, attn/gpu, attn/cpu with the roofline of hardware/op_time.py, computed per
(gbs, num_gb) outside the LP so it stays linear (gap G2).

Deviations from the paper's formulas (each a resolution in ALGORITHMS.md 4.f):
* GQA/MoE shapes: KV bytes per token use n_kv_heads * head_dim; weights per layer include every
  expert, MACs per token only the top-k; embeddings and LM head are spread evenly over the layers.
* G4: decode writes of the new KV entries to CPU/disk are in gtoc^g; delegation traffic (query
  out, attention output back; G12) is counted.
* G5: without CPU delegation (the default when the KV cache is compressed, as in the paper) the
  off-GPU KV cache is streamed to the GPU and attended there.
* G6: `overlap_cpu_gpu=True` prices comp^g as max(gpu, cpu) instead of their sum.
* decode GPU working memory uses the decode activation (2*h1*gbs), not the prefill one (TYPO?);
  prefill attention always runs on the GPU, so its working memory is not scaled by cg.
* no dequantization time for compressed tensors; percentages are the LP's relaxed values (no G8
  rounding to whole tensors).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
from scipy.optimize import linprog

from tiered.checkpoint.model_config import ModelConfig
from tiered.errors import BudgetError, ConfigError
from tiered.hardware import op_time
from tiered.hardware.budget import format_bytes
from tiered.hardware.profile import HardwareProfile

GiB = 2**30
COMPRESSED_BYTES = 0.5 + 4 / 64  # 4-bit codes + fp16 min and scale per group of 64 (4.5 bits)
VARS = ("wg", "wc", "wd", "cg", "cc", "cd", "hg", "hc", "hd")
_TP, _TG, _WP, _WG = 9, 10, 11, 12  # auxiliary variables: T_pre, T_gen [s], working memory [GiB]
_NVARS = 13


@dataclass(frozen=True)
class FlexGenModel:
    """The model shapes FlexGen's cost model needs (per layer averages; elements, not bytes).

    Attributes:
        layer_params: weight elements of one decoder layer (every expert of an MoE layer).
        active_params: weight elements one token multiplies with in one layer (top-k experts only).
        embed_params: embedding + LM head elements (spread over the layers by the planner).
        mlp_inner: MLP inner width one token activates (top-k x expert width), for working memory.
        mlp_matrices: 2 (OPT: fc1, fc2) or 3 (SwiGLU gate, up, down).
        num_experts, experts_per_token: 0 for dense models.
        bytes_per_element: uncompressed weight / KV / activation width (fp16 = 2).
    """

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    layer_params: int
    active_params: int
    embed_params: int
    mlp_inner: int
    mlp_matrices: int = 2
    num_experts: int = 0
    experts_per_token: int = 0
    bytes_per_element: float = 2.0

    @classmethod
    def from_config(cls, cfg: ModelConfig, name: str = "", bytes_per_element: float = 2.0) -> "FlexGenModel":
        """Shapes of a ModelConfig (dense or MoE; SwiGLU MLPs)."""
        d, L = cfg.hidden_size, cfg.num_hidden_layers
        embed = cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2)
        per_layer = (cfg.num_parameters() - embed - d) / L
        active = 0.0
        inner = 0.0
        for i in range(L):
            attn = cfg.attention_weight_elements()
            if cfg.is_moe_layer(i):
                f = cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size
                active += attn + 3 * d * f + d * cfg.num_experts
            else:
                f = cfg.intermediate_size
                active += attn + 3 * d * f
            inner += f
        # latent attention (MLA) as one KV "head" whose K and V halves hold the latent and RoPE key
        kv_heads, hd = (1, -(-cfg.kv_elements_per_token() // 2)) if cfg.is_mla else (cfg.num_key_value_heads, cfg.head_dim)
        return cls(name or cfg.model_type, L, d, cfg.num_attention_heads, kv_heads, hd,
                   cfg.vocab_size, round(per_layer), round(active / L), embed, round(inner / L), 3,
                   cfg.num_experts, cfg.num_experts_per_tok, bytes_per_element)

    @classmethod
    def opt(cls, size: str) -> "FlexGenModel":
        """OPT-6.7B / 30B / 175B (FlexGen's evaluation models): ReLU MLP of 4*h1, MHA, vocab 50272."""
        shapes = {"6.7b": (32, 4096, 32), "30b": (48, 7168, 56), "175b": (96, 12288, 96)}
        try:
            l, h1, nh = shapes[size.lower()]
        except KeyError:
            raise ConfigError(f"unknown OPT size {size!r}", "use 6.7b, 30b or 175b") from None
        h2, vocab = 4 * h1, 50272
        per_layer = 4 * h1 * h1 + 2 * h1 * h2  # FlexGen's (8 h1^2 + 4 h1 h2) bytes in fp16
        return cls(f"opt-{size.lower()}", l, h1, nh, nh, h1 // nh, vocab, per_layer, per_layer,
                   vocab * h1 + 2048 * h1, h2, 2)

    @property
    def kv_elements(self) -> int:
        """KV-cache elements per token per layer (K and V)."""
        return 2 * self.num_kv_heads * self.head_dim

    def weight_bytes(self, compressed: bool = False) -> float:
        """All weights [bytes]."""
        return (self.layer_params * self.num_layers + self.embed_params) * \
            (COMPRESSED_BYTES if compressed else self.bytes_per_element)


@dataclass(frozen=True)
class FlexGenOptions:
    """Search options.

    Attributes:
        compress_weight, compress_cache: store weights / KV cache as 4-bit groups of 64 (§5).
        cpu_delegation: compute attention over off-GPU KV on the CPU (§4.2); None = the paper's
            rule: on unless the KV cache is compressed.
        overlap_cpu_gpu: price decode compute as max(GPU, CPU) instead of the paper's sum (G6).
        gpu_batch_sizes: candidate gbs; None = 1, 2, then multiples of 4 up to `max_gpu_batch`.
        max_gpu_batch: largest gbs tried when gpu_batch_sizes is None.
        max_num_gpu_batches: largest #GPU batches per block (the paper's "< 20", G1).
        gpu_dtype, cpu_dtype: dtypes whose fitted GEMM / attention models price compute.
        memory_margin: usable fraction of each capacity (FlexGen's code relaxes by 0.8).
        disk_activations: allow activations on disk (hd > 0). Off by default, as in FlexGen's
            runtime and its released cost model ("hidden on disk not supported").
    """

    compress_weight: bool = False
    compress_cache: bool = False
    cpu_delegation: bool | None = None
    overlap_cpu_gpu: bool = False
    gpu_batch_sizes: tuple[int, ...] | None = None
    max_gpu_batch: int = 256
    max_num_gpu_batches: int = 19
    gpu_dtype: str = "fp16"
    cpu_dtype: str = "fp32"
    memory_margin: float = 1.0
    disk_activations: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.memory_margin <= 1:
            raise ConfigError(f"memory_margin must be in (0, 1], got {self.memory_margin}", "use e.g. 0.8")
        if self.max_num_gpu_batches < 1 or self.max_gpu_batch < 1:
            raise ConfigError("batch limits must be >= 1", "pass positive limits")

    @property
    def delegation(self) -> bool:
        return (not self.compress_cache) if self.cpu_delegation is None else self.cpu_delegation

    def batch_sizes(self) -> tuple[int, ...]:
        if self.gpu_batch_sizes is not None:
            return tuple(sorted(set(self.gpu_batch_sizes)))
        return tuple(b for b in (1, 2, *range(4, self.max_gpu_batch + 1, 4)) if b <= self.max_gpu_batch)


@dataclass(frozen=True)
class FlexGenPolicy:
    """A placement and block schedule with its predicted cost.

    Attributes:
        weights, cache, activations: fractions on (GPU, CPU, disk), each summing to 1.
        throughput: predicted generation throughput [generated tokens/s] = bls * n / block_time.
        block_time: seconds for one block (prefill + n-1 decode steps over all layers).
        prefill_layer_time, decode_layer_time: T_pre and T_gen [s per layer per block].
        peak_memory: predicted peak bytes per tier ("gpu", "cpu", "disk").
        capacity: the budgets the LP used [bytes] (None: tier absent).
        binding: the memory constraint(s) that limit the solution ("none" when none is tight).
        bottleneck: the cost terms that attain T_pre and T_gen.
    """

    prompt_len: int
    gen_len: int
    gpu_batch_size: int
    num_gpu_batches: int
    weights: tuple[float, float, float]
    cache: tuple[float, float, float]
    activations: tuple[float, float, float]
    throughput: float
    block_time: float
    prefill_layer_time: float
    decode_layer_time: float
    peak_memory: dict[str, float]
    capacity: dict[str, float | None]
    binding: str
    bottleneck: tuple[str, str]
    cpu_delegation: bool
    compress_weight: bool = False
    compress_cache: bool = False
    terms: dict[str, float] = field(default_factory=dict)

    @property
    def block_size(self) -> int:
        return self.gpu_batch_size * self.num_gpu_batches

    def describe(self) -> str:
        """FlexGen's tuple notation: (gbs x #gb, wg, wc, cg, cc, hg, hc) in percent."""
        pct = lambda x: f"{abs(100 * x):.0f}"  # noqa: E731
        w, c, h = self.weights, self.cache, self.activations
        return (f"({self.gpu_batch_size}x{self.num_gpu_batches}, {pct(w[0])},{pct(w[1])}, "
                f"{pct(c[0])},{pct(c[1])}, {pct(h[0])},{pct(h[1])})")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["block_size"] = self.block_size
        d["policy"] = self.describe()
        return d


# ---------------------------------------------------------------------------------------------
# The LP for one (gbs, num_gb)

@dataclass
class _Sizes:
    """Byte sizes of one layer for one block (the LP's constants)."""

    w: float  # weights of one layer (incl. its share of the embeddings) [bytes, stored format]
    act: float  # activation of one token [bytes]
    kv: float  # KV cache of one token in one layer [bytes, stored format]


class _Row:
    """A linear expression coef . x + const over the LP variables."""

    def __init__(self, const: float = 0.0, **coef: float) -> None:
        self.c = np.zeros(_NVARS)
        self.const = const
        for name, v in coef.items():
            self.c[VARS.index(name)] += v

    def add(self, other: "_Row", scale: float = 1.0) -> "_Row":
        r = _Row(self.const + scale * other.const)
        r.c = self.c + scale * other.c
        return r

    def value(self, x: np.ndarray) -> float:
        return float(self.c @ x + self.const)


def _bandwidth_beta(hw: HardwareProfile, *keys: str) -> float | None:
    for k in keys:
        if hw.has(k):
            return hw.models[k].beta
    return None


def _cpu_attention_dtype(hw: HardwareProfile, preferred: str) -> str:
    for d in (preferred, "fp32", "bf16", "fp16"):
        if op_time.find(hw, "attn", "cpu", d) or op_time.find(hw, "gemm", "cpu", d):
            return d
    raise ConfigError(f"hardware profile {hw.name!r} prices no CPU attention or GEMM",
                      "re-run `tiered profile` or pass cpu_delegation=False")


class _BlockLP:
    """Cost terms and memory rows of FlexGen's model for one (gbs, num_gb), as linear rows."""

    def __init__(self, m: FlexGenModel, hw: HardwareProfile, s: int, n: int, gbs: int, num_gb: int,
                 opt: FlexGenOptions, caps: dict[str, float | None]) -> None:
        self.m, self.hw, self.s, self.n, self.gbs, self.num_gb, self.opt, self.caps = m, hw, s, n, gbs, num_gb, opt, caps
        bls = gbs * num_gb
        self.bls = bls
        a = m.bytes_per_element
        w_elems = m.layer_params + m.embed_params / m.num_layers
        z = _Sizes(w=w_elems * (COMPRESSED_BYTES if opt.compress_weight else a), act=m.hidden * a,
                   kv=m.kv_elements * (COMPRESSED_BYTES if opt.compress_cache else a))
        self.z = z
        deleg = opt.delegation
        h2d = _bandwidth_beta(hw, "copy/h2d_pinned", "copy/h2d_pageable")
        if h2d is None:
            raise ConfigError(f"hardware profile {hw.name!r} has no CPU-to-GPU copy model",
                              "FlexGen's search needs a GPU profile: run `tiered profile` on a GPU machine or "
                              "pick a preset")
        self.h2d = h2d
        d2h = _bandwidth_beta(hw, "copy/d2h_pinned", "copy/d2h_pageable") or h2d
        dread = _bandwidth_beta(hw, "disk/read_cold") or 0.0
        dwrite = _bandwidth_beta(hw, "disk/write", "disk/read_cold") or 0.0
        ctx = s + n / 2  # average cached tokens during decode

        # compute constants [s per layer per block]
        gdt = opt.gpu_dtype
        weight_read = w_elems * a  # fp16 weights the GPU kernels read (compressed ones are dequantized first)
        calls = lambda tokens: 4 + m.mlp_matrices * (min(m.num_experts, tokens * m.experts_per_token)  # noqa: E731
                                                    if m.num_experts else 1)  # GEMM launches per layer
        macs_tok = m.active_params + m.vocab * m.hidden / m.num_layers
        comp_p = num_gb * (op_time.gemm_time(hw, "gpu", gdt, gbs * s * macs_tok, weight_read, calls(gbs * s))
                           + op_time.gemm_time(hw, "gpu", gdt, 2 * gbs * s * s * m.num_heads * m.head_dim, 0, 2))
        gpu_mm_g = num_gb * op_time.gemm_time(hw, "gpu", gdt, gbs * macs_tok, self._touched(weight_read, gbs),
                                              calls(gbs))
        attn_macs = 2 * gbs * m.num_heads * m.head_dim * ctx
        gpu_attn = num_gb * op_time.attention_time(hw, "gpu", gdt, attn_macs, gbs * ctx * z.kv, 2)
        cpu_attn = 0.0
        if deleg:
            cdt = _cpu_attention_dtype(hw, opt.cpu_dtype)
            cpu_attn = num_gb * op_time.attention_time(hw, "cpu", cdt, attn_macs, gbs * ctx * z.kv, 2)

        # time terms (seconds per layer per block), linear in p
        P = {}
        P["ctog^p"] = _Row(wc=z.w, wd=z.w, hc=s * z.act * bls, hd=s * z.act * bls)
        P["gtoc^p"] = _Row(cc=(s + 1) * z.kv * bls, cd=(s + 1) * z.kv * bls, hc=s * z.act * bls, hd=s * z.act * bls)
        P["dtoc^p"] = _Row(wd=z.w, hd=s * z.act * bls)
        P["ctod^p"] = _Row(cd=(s + 1) * z.kv * bls, hd=s * z.act * bls)
        for k, beta in (("ctog^p", h2d), ("gtoc^p", d2h), ("dtoc^p", dread), ("ctod^p", dwrite)):
            P[k] = _Row().add(P[k], beta)
        P["comp^p"] = _Row(comp_p)
        G = {}
        deleg_io = z.act * bls if deleg else 0.0  # query out, attention output back (G12)
        kv_in = 0.0 if deleg else ctx * z.kv * bls  # G5: stream off-GPU KV to the GPU
        G["ctog^g"] = _Row(wc=z.w, wd=z.w, hc=z.act * bls, hd=z.act * bls, cc=deleg_io + kv_in, cd=deleg_io + kv_in)
        G["gtoc^g"] = _Row(hc=z.act * bls, hd=z.act * bls, cc=z.kv * bls + deleg_io, cd=z.kv * bls + deleg_io)
        G["dtoc^g"] = _Row(cd=ctx * z.kv * bls, wd=z.w, hd=z.act * bls)
        G["ctod^g"] = _Row(cd=z.kv * bls, hd=z.act * bls)
        for k, beta in (("ctog^g", h2d), ("gtoc^g", d2h), ("dtoc^g", dread), ("ctod^g", dwrite)):
            G[k] = _Row().add(G[k], beta)
        gpu_comp = _Row(gpu_mm_g, cg=gpu_attn) if deleg else _Row(gpu_mm_g + gpu_attn)
        cpu_comp = _Row(cc=cpu_attn, cd=cpu_attn)
        if opt.overlap_cpu_gpu:
            G["gpu_comp^g"], G["cpu_comp^g"] = gpu_comp, cpu_comp
        else:
            G["comp^g"] = gpu_comp.add(cpu_comp)
        self.prefill, self.decode = P, G
        self._memory_rows()

    def _touched(self, weight_bytes: float, tokens: int) -> float:
        """Weight bytes a GPU batch of `tokens` reads: every expert only when enough tokens route to it."""
        m = self.m
        if not m.num_experts:
            return weight_bytes
        frac = min(1.0, tokens * m.experts_per_token / m.num_experts)
        mlp = (m.layer_params - (2 * m.hidden * m.num_heads * m.head_dim + m.hidden * m.kv_elements))
        return weight_bytes - mlp * m.bytes_per_element * (1 - frac)

    def _memory_rows(self) -> None:
        m, z, s, n, gbs, bls, L = self.m, self.z, self.s, self.n, self.gbs, self.bls, self.m.num_layers
        a = m.bytes_per_element
        deleg = self.opt.delegation
        q, kvd = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        f_extra = (m.mlp_matrices - 1) * m.mlp_inner
        kv_all = (s + n) * z.kv * bls * L
        # GPU working memory (FlexGen A.3), prefill: attention always on the GPU
        self.work_p = {
            "qkv": _Row(gbs * s * a * (m.hidden + q + 2 * kvd)),
            "att1": _Row(gbs * a * (s * q + s * kvd + m.num_heads * s * s)),
            "att2": _Row(gbs * a * (m.num_heads * s * s + s * kvd + s * m.hidden)),
            "embed": _Row(gbs * a * (2 * s * m.hidden + m.vocab)),
            "mlp": _Row(gbs * s * a * (m.hidden + f_extra)),
        }
        att1 = gbs * a * (q + (s + n) * kvd + m.num_heads * (s + n))
        att2 = gbs * a * (m.num_heads * (s + n) + (s + n) * kvd + m.hidden)
        self.work_g = {
            "qkv": _Row(gbs * a * (m.hidden + q + 2 * kvd)),
            "att1": _Row(cg=att1) if deleg else _Row(att1),
            "att2": _Row(cg=att2) if deleg else _Row(att2),
            "embed": _Row(gbs * a * (2 * m.hidden + m.vocab)),
            "mlp": _Row(gbs * a * (m.hidden + f_extra)),
        }
        # peaks (bytes); the working-memory max enters as the auxiliary variable W
        home_w = z.w * L
        gpu_p = _Row(wg=home_w, hg=s * z.act * bls, cg=kv_all).add(
            _Row(2 * z.w + s * z.act * gbs, wg=-2 * z.w, hg=-s * z.act * gbs))
        gpu_g = _Row(wg=home_w, hg=z.act * bls, cg=kv_all).add(
            _Row(2 * z.w + z.act * gbs, wg=-2 * z.w, hg=-z.act * gbs))
        if not deleg:  # double buffer of one GPU batch's streamed KV for one layer
            gpu_g = gpu_g.add(_Row(cc=2 * (s + n) * z.kv * gbs, cd=2 * (s + n) * z.kv * gbs))
        cpu_p = _Row(wc=home_w, hc=s * z.act * bls, cc=kv_all).add(
            _Row(z.w + s * z.act * gbs, wg=-z.w, hg=-s * z.act * gbs))
        scores = 2 * m.num_heads * (s + n) * gbs if deleg else 0.0
        cpu_g = _Row(wc=home_w, hc=z.act * bls, cc=kv_all).add(
            _Row(scores + z.act * gbs, wd=z.w, hd=2 * z.act * gbs, cd=2 * (s + n) * z.kv * gbs))
        disk = _Row(wd=home_w, hd=s * z.act * bls, cd=kv_all)
        self.peaks = {"gpu_peak^p": (gpu_p, "gpu", _WP), "gpu_peak^g": (gpu_g, "gpu", _WG),
                      "cpu_peak^p": (cpu_p, "cpu", None), "cpu_peak^g": (cpu_g, "cpu", None),
                      "disk_peak": (disk, "disk", None)}

    def solve(self, fixed: dict[str, float] | None = None):
        """Solve the LP; returns (x, result) or None when infeasible."""
        A, b, names = [], [], []

        def le(row: _Row, extra: dict[int, float], name: str, scale: float = 1.0) -> None:
            c = row.c.copy()
            for i, v in extra.items():
                c[i] += v
            A.append(c / scale)
            b.append(-row.const / scale)
            names.append(name)

        for k, r in self.prefill.items():
            le(r, {_TP: -1.0}, k)
        for k, r in self.decode.items():
            le(r, {_TG: -1.0}, k)
        for k, r in self.work_p.items():
            le(r, {_WP: -GiB}, "work^p/" + k, GiB)
        for k, r in self.work_g.items():
            le(r, {_WG: -GiB}, "work^g/" + k, GiB)
        for k, (r, tier, w) in self.peaks.items():
            cap = self.caps[tier]
            if cap is None:
                continue
            le(r.add(_Row(-cap)), {w: GiB} if w is not None else {}, k, cap)
        A_eq = np.zeros((3, _NVARS))
        for i in range(3):
            A_eq[i, 3 * i: 3 * i + 3] = 1.0
        bounds = [(0.0, 1.0)] * 9 + [(0.0, None)] * 4
        if self.caps["disk"] is None:
            for v in ("wd", "cd", "hd"):
                bounds[VARS.index(v)] = (0.0, 0.0)
        if not self.opt.disk_activations:
            bounds[VARS.index("hd")] = (0.0, 0.0)
        for v, val in (fixed or {}).items():
            bounds[VARS.index(v)] = (val, val)
        L = self.m.num_layers
        c = np.zeros(_NVARS)
        c[_TP], c[_TG] = L / self.bls, (self.n - 1) * L / self.bls
        c[_WP] = c[_WG] = 1e-9  # keep the working-memory variables at their max, not above
        # Ties (several placements with the same bottleneck time) go to the faster tier: a penalty
        # far below any real time difference on CPU (1e-6) and disk (1e-5) fractions.
        t_ref = c[_TG] * self.z.w * self.h2d  # decode time of streaming one layer's weights, per token
        for v, eps in (("wc", 1e-6), ("cc", 1e-6), ("hc", 1e-6), ("wd", 1e-5), ("cd", 1e-5), ("hd", 1e-5)):
            c[VARS.index(v)] = eps * t_ref
        res = linprog(c, A_ub=np.array(A), b_ub=np.array(b), A_eq=A_eq, b_eq=np.ones(3), bounds=bounds,
                      method="highs")
        if res.status != 0:
            return None
        return res.x, res, names

    def policy(self, x: np.ndarray, res, names: list[str]) -> FlexGenPolicy:
        L, n = self.m.num_layers, self.n
        tp = max(r.value(x) for r in self.prefill.values())
        tg = max(r.value(x) for r in self.decode.values())
        block = L * tp + (n - 1) * L * tg
        wp = max(r.value(x) for r in self.work_p.values())
        wgk = max(r.value(x) for r in self.work_g.values())
        peak_vals = {k: r.value(x) + (wp if w == _WP else wgk if w == _WG else 0.0)
                     for k, (r, _, w) in self.peaks.items()}
        peaks = {"gpu": max(peak_vals["gpu_peak^p"], peak_vals["gpu_peak^g"]),
                 "cpu": max(peak_vals["cpu_peak^p"], peak_vals["cpu_peak^g"]), "disk": peak_vals["disk_peak"]}
        binding = [k for k, (_, tier, _) in self.peaks.items()
                   if self.caps[tier] is not None and peak_vals[k] >= self.caps[tier] * (1 - 1e-6)]
        top = lambda terms, t: "+".join(k for k, r in terms.items() if r.value(x) >= t * (1 - 1e-6))  # noqa: E731
        rnd = lambda i: tuple(float(np.clip(round(v, 9), 0.0, 1.0)) + 0.0 for v in x[3 * i: 3 * i + 3])  # noqa: E731
        terms = {k: r.value(x) for k, r in {**self.prefill, **self.decode}.items()}
        return FlexGenPolicy(
            prompt_len=self.s, gen_len=n, gpu_batch_size=self.gbs, num_gpu_batches=self.num_gb,
            weights=rnd(0), cache=rnd(1), activations=rnd(2), throughput=self.bls * n / block, block_time=block,
            prefill_layer_time=tp, decode_layer_time=tg, peak_memory=peaks, capacity=dict(self.caps),
            binding=", ".join(binding) or "none", bottleneck=(top(self.prefill, tp), top(self.decode, tg)),
            cpu_delegation=self.opt.delegation, compress_weight=self.opt.compress_weight,
            compress_cache=self.opt.compress_cache, terms=terms)


# ---------------------------------------------------------------------------------------------
# Search

def _capacities(hw: HardwareProfile, opt: FlexGenOptions, gpu_memory, cpu_memory, disk_memory) -> dict:
    gpu = gpu_memory if gpu_memory is not None else hw.gpu_memory
    cpu = cpu_memory if cpu_memory is not None else hw.cpu_memory
    disk = disk_memory if disk_memory is not None else hw.meta.get("disk_memory")
    if gpu is None:
        raise ConfigError(f"hardware profile {hw.name!r} has no GPU memory size", "pass a GPU budget (--gpu-mem)")
    if cpu is None:
        raise ConfigError(f"hardware profile {hw.name!r} has no CPU memory size", "pass a CPU budget (--cpu-mem)")
    if not hw.has("disk/read_cold") or (disk is not None and disk <= 0):
        disk = None  # no disk tier
    mg = opt.memory_margin
    return {"gpu": gpu * mg, "cpu": cpu * mg, "disk": None if disk is None else disk * mg}


def evaluate_policy(model: FlexGenModel, hw: HardwareProfile, prompt_len: int, gen_len: int,
                    gpu_batch_size: int, num_gpu_batches: int, weights, cache, activations,
                    options: FlexGenOptions = FlexGenOptions(), gpu_memory: float | None = None,
                    cpu_memory: float | None = None, disk_memory: float | None = None) -> FlexGenPolicy:
    """The cost of a fixed placement (e.g. all-GPU or all-CPU corners).

    Raises:
        BudgetError: the placement does not fit the budgets.
    """
    caps = _capacities(hw, options, gpu_memory, cpu_memory, disk_memory)
    lp = _BlockLP(model, hw, prompt_len, gen_len, gpu_batch_size, num_gpu_batches, options, caps)
    fixed = dict(zip(VARS, (*weights, *cache, *activations)))
    out = lp.solve(fixed)
    if out is None:
        raise BudgetError(f"policy {fixed} with batch {gpu_batch_size}x{num_gpu_batches} does not fit "
                          f"GPU {_fmt(caps['gpu'])}, CPU {_fmt(caps['cpu'])}, disk {_fmt(caps['disk'])}",
                          "place more on a slower tier or use a smaller batch")
    return lp.policy(*out)


def search_policy(model: FlexGenModel, hw: HardwareProfile, prompt_len: int, gen_len: int,
                  options: FlexGenOptions = FlexGenOptions(), gpu_memory: float | None = None,
                  cpu_memory: float | None = None, disk_memory: float | None = None) -> FlexGenPolicy:
    """FlexGen's policy search (ALGORITHMS.md 4.c): the best (gbs, #gb, placement) by predicted throughput.

    Args:
        model: shapes (FlexGenModel.from_config or FlexGenModel.opt).
        hw: cost models; GPU/CPU capacities from hw.gpu_memory / hw.cpu_memory and the disk from
            hw.meta["disk_memory"] (no disk tier when the profile has no disk/read_cold model).
        prompt_len, gen_len: s and n [tokens].
        gpu_memory, cpu_memory, disk_memory: budgets [bytes] overriding the profile's capacities.
    Returns:
        The FlexGenPolicy of highest predicted throughput.
    Raises:
        BudgetError: no batch size and placement fits the budgets.
        ConfigError: the profile lacks a GPU, its memory size, or a needed cost model.
    """
    if prompt_len < 1 or gen_len < 1:
        raise ConfigError("prompt and generation lengths must be >= 1", "pass positive lengths")
    caps = _capacities(hw, options, gpu_memory, cpu_memory, disk_memory)
    best: FlexGenPolicy | None = None
    for gbs in options.batch_sizes():
        feasible_any = False
        for num_gb in range(1, options.max_num_gpu_batches + 1):
            lp = _BlockLP(model, hw, prompt_len, gen_len, gbs, num_gb, options, caps)
            out = lp.solve()
            if out is None:
                break  # memory only grows with the block size
            feasible_any = True
            pol = lp.policy(*out)
            if best is None or pol.throughput > best.throughput * (1 + 1e-9):
                best = pol
        if not feasible_any:
            break  # and with the GPU batch size
    if best is None:
        kv_seq = (prompt_len + gen_len) * model.kv_elements * model.num_layers * \
            (COMPRESSED_BYTES if options.compress_cache else model.bytes_per_element)
        raise BudgetError(
            f"no FlexGen policy fits GPU {_fmt(caps['gpu'])}, CPU {_fmt(caps['cpu'])}, disk {_fmt(caps['disk'])}: "
            f"{model.name} needs {_fmt(model.weight_bytes(options.compress_weight))} of weights, "
            f"{_fmt(kv_seq)} of KV cache per sequence and a working set per GPU batch",
            "raise the GPU/CPU budgets, add a disk tier, or compress weights / KV cache to 4 bits")
    return best


def _fmt(n: float | None) -> str:
    return "none" if n is None else format_bytes(n)
