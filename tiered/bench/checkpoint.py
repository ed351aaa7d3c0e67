"""Dummy-weight checkpoints at real layer shapes, written tensor by tensor.

FlexGen benchmarked OPT-175B with dummy weights of the real shapes; we do the same for slices of
Mixtral-8x7B and Llama-3-8B (N decoder layers at full width). The result is a real Hugging Face
directory: config.json (loadable by transformers), one safetensors shard for the embedding, final
norm and lm_head, one shard per layer, and model.safetensors.index.json. Weights are random
(seeded, std 0.02, norms 1). Each tensor is drawn, written at its offset and dropped, so memory
stays at one tensor and its fp32 draw (at most ~750 MiB: the 32000 x 4096 embedding) whatever the
model's size. The files are byte-identical to safetensors' own `save_file` of the same tensors.

Routing is skewed, as real MoE routing is (Fiddler Fig. 8), and strongly: every embedding row
shares one direction `common`, and each layer's router gives its experts graded affinities for it
(a different order per layer). At hidden 4096 the top 2-3 experts of a layer take about 98% of its
routed tokens (random prompt tokens), so popularity placement and expert caches have something to
find. These are the weights benchmarks/moe_offload.py has always written (same seed, same draws).

`ModelShape.routing = "uniform"` writes the same draws without that shared direction (no `common` in
the embedding rows, no graded affinities in the routers): each token then routes by its own random
hidden state, close to the independent, uniform routing the plans price (cpu_predict.routing_trace
without a popularity), the expert cache's worst case. Its config.json says so
(`tiered_dummy_routing`), so a directory of the other routing is never reused for it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
ROUTINGS = ("skewed", "uniform")
_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only model (dense Llama, or Mixtral when experts > 0).

    Attributes (elements unless noted):
        layers: decoder layers [count].
        hidden, ffn: model width and MLP / expert intermediate width.
        heads, kv_heads: query and key/value heads [count]; head_dim = hidden // heads.
        vocab: vocabulary size; the lm_head is untied.
        experts, top_k: routed experts per layer and experts per token (experts 0 = dense).
        max_position_embeddings [tokens], rope_theta, rms_norm_eps: written to config.json.
        routing: the dummy weights' routing, "skewed" (the top 2-3 experts of a layer take ~98% of
            its tokens) or "uniform" (each token by its own hidden state); see the module's doc.
    """

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    experts: int = 0
    top_k: int = 2
    max_position_embeddings: int = 4096
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-5
    routing: str = "skewed"

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, not {self.routing!r}")

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def expert_params(self) -> int:
        """Elements of one expert (or of one dense MLP): gate, up and down projections."""
        return 3 * self.hidden * self.ffn

    def attention_params(self) -> int:
        """Elements of one layer's q, k, v and o projections."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return 2 * self.hidden * q + 2 * self.hidden * kv

    def nonexpert_params(self) -> int:
        """Elements outside the routed experts (for a dense model: outside the MLPs)."""
        per_layer = self.attention_params() + 2 * self.hidden + self.experts * self.hidden
        return 2 * self.vocab * self.hidden + self.hidden + self.layers * per_layer

    def params(self) -> int:
        """Elements of the whole checkpoint."""
        return self.nonexpert_params() + self.layers * max(self.experts, 1) * self.expert_params()

    def config_json(self, dtype: torch.dtype = torch.bfloat16) -> dict:
        """The Hugging Face config.json of this shape (MixtralForCausalLM or LlamaForCausalLM)."""
        cfg = {"vocab_size": self.vocab, "hidden_size": self.hidden, "intermediate_size": self.ffn,
               "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
               "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
               "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": self.rms_norm_eps,
               "rope_theta": self.rope_theta, "tie_word_embeddings": False, "torch_dtype": str(dtype)[6:]}
        if self.is_moe:
            routing = {} if self.routing == "skewed" else {"tiered_dummy_routing": self.routing}  # skewed: as ever
            return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **cfg,
                    "num_local_experts": self.experts, "num_experts_per_tok": self.top_k, **routing}
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **cfg,
                "bos_token_id": 1, "eos_token_id": 2}


def mixtral_8x7b(layers: int = 4) -> ModelShape:
    """`layers` layers of Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1 config.json): hidden 4096,
    expert FFN 14336, 8 experts top-2, GQA 32/8, vocab 32000; 336 MiB per bf16 expert."""
    return ModelShape(layers=layers, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=32000, experts=8,
                      top_k=2, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5)


def llama3_8b(layers: int = 8, vocab: int = 32000) -> ModelShape:
    """`layers` layers of Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json): hidden 4096, FFN
    14336, GQA 32/8. Its real vocabulary is 128256; the default 32000 is what the 2026-11-22 H200
    run used (8 layers: 3.74 GiB bf16, its "3.7 GiB"; 128256 would make 5.2 GiB)."""
    return ModelShape(layers=layers, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=vocab,
                      max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5)


def write_dummy_checkpoint(path: str | os.PathLike, shape: ModelShape, dtype: torch.dtype = torch.bfloat16,
                           seed: int = 0) -> Path:
    """Write (or reuse) a dummy-weight checkpoint of `shape` in `path`; return the directory.

    An existing directory with the same config.json and a complete index is reused as is (the
    index is written last). Disk use: shape.params() * dtype size [bytes].
    """
    path = Path(path)
    cfg = shape.config_json(dtype)
    if (path / _INDEX).is_file() and (path / "config.json").is_file() \
            and json.loads((path / "config.json").read_text()) == cfg:
        return path
    path.mkdir(parents=True, exist_ok=True)
    (path / _INDEX).unlink(missing_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    weight_map: dict[str, str] = {}
    for file, layout, tensors in _shards(shape, dtype, seed):
        with _ShardWriter(path / file, layout) as w:
            for name, t in tensors:
                w.write(name, t)
        weight_map.update(dict.fromkeys(layout, file))
    (path / _INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def _shards(shape: ModelShape, dtype: torch.dtype, seed: int) -> Iterator[tuple[str, dict, Iterator]]:
    """(file name, {tensor name: (shape, dtype)}, lazy (name, tensor) pairs) for each shard.

    The random draws happen in a fixed order from one generator: the same seed gives the same
    weights (and benchmarks/moe_offload.py's checkpoints of earlier runs)."""
    g = torch.Generator().manual_seed(seed)
    h, f, E = shape.hidden, shape.ffn, shape.experts
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim

    def rnd(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=g) * 0.02).to(dtype)

    common = torch.randn(h, generator=g)       # a direction every hidden state shares
    skew = torch.linspace(1.0, -1.0, max(E, 1))  # expert e's affinity for it
    embed_std = 0.02
    if shape.is_moe and shape.routing == "uniform":  # drawn all the same, so the other draws stay as they were
        # and each token's own embedding row, not what attention averages over the prompt, leads its
        # hidden state through the layers (at std 0.02 the attention outputs, alike for every token, did)
        common, skew, embed_std = torch.zeros(h), torch.zeros(max(E, 1)), 1.0

    glob = {"model.embed_tokens.weight": (shape.vocab, h), "model.norm.weight": (h,), "lm_head.weight": (shape.vocab, h)}

    def glob_tensors():
        yield "model.embed_tokens.weight", (torch.randn(shape.vocab, h, generator=g) * embed_std + 0.05 * common).to(dtype)
        yield "model.norm.weight", torch.ones(h, dtype=dtype)
        yield "lm_head.weight", rnd(shape.vocab, h)

    yield "globals.safetensors", {k: (s, dtype) for k, s in glob.items()}, glob_tensors()
    for l in range(shape.layers):
        p = f"model.layers.{l}"
        layout = {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                  f"{p}.self_attn.q_proj.weight": (q, h), f"{p}.self_attn.k_proj.weight": (kv, h),
                  f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, q)}
        if shape.is_moe:
            layout[f"{p}.block_sparse_moe.gate.weight"] = (E, h)
            for e in range(E):
                x = f"{p}.block_sparse_moe.experts.{e}"
                layout.update({f"{x}.w1.weight": (f, h), f"{x}.w3.weight": (f, h), f"{x}.w2.weight": (h, f)})
        else:
            layout.update({f"{p}.mlp.gate_proj.weight": (f, h), f"{p}.mlp.up_proj.weight": (f, h),
                           f"{p}.mlp.down_proj.weight": (h, f)})
        yield f"layer{l:03d}.safetensors", {k: (s, dtype) for k, s in layout.items()}, _layer_tensors(
            shape, p, g, rnd, common, skew, dtype)


def _layer_tensors(shape: ModelShape, p: str, g: torch.Generator, rnd, common: torch.Tensor, skew: torch.Tensor,
                   dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    h, f, E = shape.hidden, shape.ffn, shape.experts
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    if shape.is_moe:  # each layer favours different experts
        perm = torch.randperm(E, generator=g)
        router = torch.randn(E, h, generator=g) * 0.02 + 0.5 * skew[perm, None] * common / common.norm().clamp_min(1e-12)
    yield f"{p}.input_layernorm.weight", torch.ones(h, dtype=dtype)
    yield f"{p}.post_attention_layernorm.weight", torch.ones(h, dtype=dtype)
    yield f"{p}.self_attn.q_proj.weight", rnd(q, h)
    yield f"{p}.self_attn.k_proj.weight", rnd(kv, h)
    yield f"{p}.self_attn.v_proj.weight", rnd(kv, h)
    yield f"{p}.self_attn.o_proj.weight", rnd(h, q)
    if not shape.is_moe:
        yield f"{p}.mlp.gate_proj.weight", rnd(f, h)
        yield f"{p}.mlp.up_proj.weight", rnd(f, h)
        yield f"{p}.mlp.down_proj.weight", rnd(h, f)
        return
    yield f"{p}.block_sparse_moe.gate.weight", router.to(dtype)
    for e in range(E):
        x = f"{p}.block_sparse_moe.experts.{e}"
        yield f"{x}.w1.weight", rnd(f, h)
        yield f"{x}.w3.weight", rnd(f, h)
        yield f"{x}.w2.weight", rnd(h, f)


class _ShardWriter:
    """One safetensors file written tensor by tensor: the header first (offsets from the layout,
    tensors sorted by name as safetensors' writer orders one dtype), then each tensor at its offset."""

    def __init__(self, path: Path, layout: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        if len({dt for _, dt in layout.values()}) > 1:
            raise ValueError("a shard holds one dtype (safetensors orders mixed dtypes by alignment)")
        header, offset = {}, 0
        for name in sorted(layout):
            shape, dt = layout[name]
            n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
            header[name] = {"dtype": _ST_DTYPES[dt], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.base = 8 + len(blob)
        self.header, self.pending = header, set(header)
        self.file = open(path, "wb")
        self.file.write(len(blob).to_bytes(8, "little") + blob)
        self.file.truncate(self.base + offset)

    def write(self, name: str, t: torch.Tensor) -> None:
        """Write tensor `name` (its shape and dtype must match the layout)."""
        meta = self.header[name]
        if list(t.shape) != meta["shape"] or _ST_DTYPES[t.dtype] != meta["dtype"]:
            raise ValueError(f"{name}: {tuple(t.shape)} {t.dtype} does not match the layout {meta}")
        self.file.seek(self.base + meta["data_offsets"][0])
        self.file.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self.pending.discard(name)

    def __enter__(self) -> "_ShardWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.file.close()
        if exc_type is None and self.pending:
            raise ValueError(f"tensors never written: {sorted(self.pending)[:3]}")


# DeepSeek-V2-Lite's config.json (deepseek-ai/DeepSeek-V2-Lite) as transformers' deepseek_v2 reads it
DEEPSEEK_V2_LITE = dict(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], vocab_size=102400,
                        hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
                        num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
                        num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1, kv_lora_rank=512,
                        q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        topk_method="greedy", n_group=None, topk_group=None, routed_scaling_factor=1.0,
                        norm_topk_prob=False, max_position_embeddings=163840, rms_norm_eps=1e-6,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                         "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                                         "mscale": 0.707, "mscale_all_dim": 0.707},
                        bos_token_id=100000, eos_token_id=100001, tie_word_embeddings=False, hidden_act="silu",
                        attention_bias=False, dtype="bfloat16")


def write_dummy_deepseek_checkpoint(path: str | os.PathLike, config: dict, dtype: torch.dtype = torch.bfloat16,
                                    seed: int = 0) -> Path:
    """A transformers `deepseek_v2` directory (config.json + model.safetensors) with random weights.

    Args:
        config: config.json's fields (e.g. DEEPSEEK_V2_LITE, or it with fewer layers / narrower widths);
            q_lora_rank must be None (a full q_proj).
        dtype: the tensors' dtype. Weights are Gaussian, std 0.02; routers 0.1 (tokens spread over the
            experts); norms 1.
    Returns the directory (written once: an existing complete one is kept). Holds every tensor in
    memory until it is written (4.5 GB for 4 of V2-Lite's layers in bf16).
    """
    import json

    from safetensors.torch import save_file

    path = Path(path)
    done = path / "model.safetensors"
    if done.is_file() and (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    c = config
    D, V, H = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    n, r, v, R = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    F, Fe, E = c["intermediate_size"], c["moe_intermediate_size"], c["n_routed_experts"]
    Fs = Fe * c["n_shared_experts"]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    t = {"model.embed_tokens.weight": rnd(V, D), "lm_head.weight": rnd(V, D), "model.norm.weight": torch.ones(D, dtype=dtype)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t.update({f"{p}.input_layernorm.weight": torch.ones(D, dtype=dtype),
                  f"{p}.post_attention_layernorm.weight": torch.ones(D, dtype=dtype),
                  f"{p}.self_attn.q_proj.weight": rnd(H * (n + r), D),
                  f"{p}.self_attn.kv_a_proj_with_mqa.weight": rnd(R + r, D),
                  f"{p}.self_attn.kv_a_layernorm.weight": torch.ones(R, dtype=dtype),
                  f"{p}.self_attn.kv_b_proj.weight": rnd(H * (n + v), R),
                  f"{p}.self_attn.o_proj.weight": rnd(D, H * v)})
        if i < c["first_k_dense_replace"]:
            t.update({f"{p}.mlp.{k}_proj.weight": rnd(*((F, D) if k != "down" else (D, F))) for k in ("gate", "up", "down")})
            continue
        t[f"{p}.mlp.gate.weight"] = rnd(E, D, std=0.1)
        t.update({f"{p}.mlp.shared_experts.{k}_proj.weight": rnd(*((Fs, D) if k != "down" else (D, Fs)))
                  for k in ("gate", "up", "down")})
        for e in range(E):
            t.update({f"{p}.mlp.experts.{e}.{k}_proj.weight": rnd(*((Fe, D) if k != "down" else (D, Fe)))
                      for k in ("gate", "up", "down")})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_file(t, str(path / "model.safetensors.partial"), metadata={"format": "pt"})
    os.replace(path / "model.safetensors.partial", done)
    return path


# the linear layers fine-grained FP8 releases store in fp8 (DeepSeek-V3's: every projection of the
# decoder layers, their experts' too); embeddings, norms, routers and the lm_head stay as they are
FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
               "kv_a_proj_with_mqa", "kv_b_proj", "w1", "w2", "w3")


# The FP8 layouts write_fp8_checkpoint writes: how each release names and shapes its scales, and its config.
FP8_SCHEMES = {
    # transformers' fine-grained FP8 (DeepSeek-V3, Qwen3-FP8): fp32 scales per 128 x 128 block
    "block": dict(block=(128, 128), suffix="_scale_inv", scale_dtype=torch.float32, shape=None,
                  config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                          "weight_block_size": [128, 128]}),
    # compressed-tensors float-quantized, per output channel, dynamic per-token activations (RedHatAI's
    # Llama-3.1-70B-Instruct-FP8): bf16 scales [N, 1]
    "channel": dict(block="channel", suffix="_scale", scale_dtype=torch.bfloat16, shape="column",
                    config={"quant_method": "compressed-tensors", "format": "float-quantized",
                            "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
                            "config_groups": {"group_0": {
                                "targets": ["Linear"],
                                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                            "dynamic": False, "group_size": None, "block_structure": None},
                                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                      "symmetric": True, "dynamic": True}}}}),
    # compressed-tensors per tensor with static activation scales (input_scale, dropped by tiered)
    "tensor": dict(block="tensor", suffix="_scale", scale_dtype=torch.float32, shape="one", static=True,
                   config={"quant_method": "compressed-tensors", "format": "float-quantized",
                           "quantization_status": "compressed", "ignore": ["lm_head"],
                           "config_groups": {"group_0": {
                               "targets": ["Linear"],
                               "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
                                           "dynamic": False},
                               "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                     "symmetric": True, "dynamic": False}}}}),
    # fbgemm_fp8 (Meta's Llama-3.1-405B-Instruct-FP8): fp32 scales [N, 1]
    "fbgemm": dict(block="channel", suffix="_scale", scale_dtype=torch.float32, shape="column",
                   config={"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                           "modules_to_not_convert": ["lm_head"]}),
    # AutoFP8 (Neural Magic's older FP8 releases): quant_method "fp8" without a block, a 0-d scale per tensor
    "autofp8": dict(block="tensor", suffix="_scale", scale_dtype=torch.float32, shape="scalar", static=True,
                    config={"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}),
}


def write_fp8_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, scheme: str = "block") -> Path:
    """A Hugging Face directory converted to FP8 as the releases ship it: every decoder layer's
    projection weight (FP8_LINEARS) becomes float8_e4m3fn `X.weight` with its scales in `scheme`'s
    layout (FP8_SCHEMES: "block" = DeepSeek-V3 / Qwen3-FP8's fp32 `X.weight_scale_inv` [ceil(N/128),
    ceil(K/128)]; "channel" = compressed-tensors' bf16 `X.weight_scale` [N, 1]; "tensor" = its [1] with a
    static `X.input_scale`; "fbgemm" = fbgemm_fp8's fp32 [N, 1]; "autofp8" = a 0-d per-tensor scale),
    quantized by quant/fp8.quantize_fp8, and config.json gets the scheme's `quantization_config`.
    Other files (tokenizer) are copied. One shard in memory at a time.

    Returns the directory (written once: an existing complete one is kept).
    Raises:
        ValueError: an unknown scheme.
    """
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from tiered.quant.fp8 import quantize_fp8

    if scheme not in FP8_SCHEMES:
        raise ValueError(f"unknown fp8 scheme {scheme!r}: one of {sorted(FP8_SCHEMES)}")
    sch = FP8_SCHEMES[scheme]
    src, dst = Path(src), Path(dst)
    if (dst / "config.json").is_file():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for f in sorted(src.iterdir()):
        if f.suffix == ".safetensors":
            out = {}
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    t = st.get_tensor(name)
                    parts = name.split(".")
                    if ".layers." in name and parts[-1] == "weight" and parts[-2] in FP8_LINEARS and t.dim() == 2:
                        N, K = t.shape
                        block = {"channel": (1, K), "tensor": (N, K)}.get(sch["block"], sch["block"])
                        q, s = quantize_fp8(t, block)
                        if sch["shape"] in ("scalar", "one"):  # the per-tensor scale, 0-d or [1]
                            s = s.reshape(() if sch["shape"] == "scalar" else (1,))
                        s = s.to(sch["scale_dtype"])
                        out[name], out[name + sch["suffix"]] = q.view(torch.float8_e4m3fn), s.contiguous()
                        if sch.get("static"):  # an activation scale, as calibration writes one
                            out[name[:-len("weight")] + "input_scale"] = torch.tensor(0.02).reshape(s.shape)
                    else:
                        out[name] = t
            save_file(out, str(dst / f.name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(out, f.name))
        elif f.is_file() and f.name not in ("config.json", _INDEX):
            shutil.copy(f, dst / f.name)
    if (src / _INDEX).is_file():
        (dst / _INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = json.loads(json.dumps(sch["config"]))
    (dst / "config.json.partial").write_text(json.dumps(config, indent=1))
    os.replace(dst / "config.json.partial", dst / "config.json")
    return dst
