"""Shared fixtures of the tiered-runtime tests: tiny MoE checkpoints, their transformers references,
and the byte arithmetic that sizes budgets to get a wanted expert placement.

`rt` is a session fixture over one process-wide RuntimeZoo, so every test module that imports it
(`from runtime_fixtures import rt`) shares the same checkpoints and references.

Budget recipe (what the planner counts, tiered/memory/sizes.py):
    fast tier = non-expert weights + KV cache of one max_context sequence + RoPE tables
                + staging_buffers * expert_bytes + cache_slots * expert_bytes + resident experts
    CPU tier (with an accelerator) = staging_buffers * expert_bytes (host staging) + CPU experts
Tests pass max_context=MAX_CONTEXT so the KV share is small and exact.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from moe_fixtures import MOE_KINDS, VOCAB, load_hf_moe_model, make_moe_checkpoint  # noqa: E402

from tiered import EngineConfig, SamplingParams  # noqa: E402

MAX_CONTEXT = 32  # prompt 16 + 16 generated
PROMPT_LEN = 16
NEW_TOKENS = 16
STAGING = 2  # EngineConfig.staging_buffers default
REL_TOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

__all__ = ["MOE_KINDS", "MAX_CONTEXT", "GREEDY", "REL_TOL", "STAGING", "RuntimeZoo", "Sizes", "rt", "prompt",
           "rel_err", "engine_config", "sizes_of"]


def prompt(length: int = PROMPT_LEN, seed: int = 0) -> list[int]:
    """Token ids in [2, VOCAB): no BOS / EOS."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (length,), generator=g).tolist()


def decode_logits(llm, step, ids: list[int], n_prompt: int, kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Prefill ids[:n_prompt] through `llm`'s modules, then feed ids[n_prompt:] one token a step through
    `step` (a runtime/cpu_decode.CPUDecodeStep, or any callable of the model's forward arguments): each
    decode step's logits fp32 [len(ids) - n_prompt, V], those of positions n_prompt .. len(ids) - 1. The
    KV cache holds `kv_dtype` (default: the plan's)."""
    from tiered.memory import sizes
    from tiered.models.layers import KVCache

    cache = KVCache(llm.config, 1, len(ids), kv_dtype or sizes.torch_dtype(llm.plan.dtypes["kv_cache"]))
    out = []
    with torch.inference_mode():
        llm.model(torch.tensor([ids[:n_prompt]]), torch.arange(n_prompt)[None], torch.tensor([0]), cache)
        for p in range(n_prompt, len(ids)):
            out.append(step(torch.tensor([[ids[p]]]), torch.tensor([[p]]), torch.tensor([0]), cache)[0].float())
    return torch.stack(out)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max())


def engine_config(**kw) -> EngineConfig:
    """EngineConfig of the lossless fp32 mode with the tests' context window."""
    kw.setdefault("decode_weights", "fp32")
    kw.setdefault("max_context", MAX_CONTEXT)
    return EngineConfig(**kw)


@dataclass(frozen=True)
class Sizes:
    """Byte counts of a checkpoint in fp32 [bytes], and its expert layout."""

    nonexpert: int
    expert: int
    kv: int  # KV cache of one max_context-token sequence
    num_experts: int
    moe_layers: int
    rotary: int = 0  # RoPE cos/sin tables for max_context positions, fp32
    workspace: int = 0  # activation room the plan keeps on an accelerator (memory/sizes.workspace_bytes)
    cpu_workspace: int = 0  # a CPU plan's room in RAM for a prefill chunk's activations (of max_context tokens at most)
    cpu_token: int = 0  # ... for each more prompt token a packed forward of several slots' prompts takes

    @property
    def total_experts(self) -> int:
        return self.num_experts * self.moe_layers

    def fast(self, cache_slots: int, resident: int = 0, staging: int = STAGING, accelerator: bool = True,
             library: int = 0) -> int:
        """Fast-tier budget that yields exactly `resident` fast-resident experts with `cache_slots` slots
        (behind an accelerator, or in RAM without one), and the tier's activation workspace. `library`: the
        bytes the plan keeps for libraries' workspaces on a real GPU (`cuda_library()`; 0 on the stand-in)."""
        fixed = self.nonexpert + self.kv + self.rotary + (self.workspace + library if accelerator else self.cpu_workspace)
        return fixed + (staging + cache_slots + resident) * self.expert

    def cpu_slots(self, slots: int, context: int = 0) -> int:
        """The RAM a CPU plan of `slots` KV-cache slots keeps for its prefill workspace beyond one slot's
        (`cpu_workspace`): a packed forward takes up to a chunk of CPU_PREFILL_TOKENS, `slots` prompts of
        `context` (default MAX_CONTEXT) tokens where that is fewer (memory/sizes.cpu_prefill_tokens)."""
        from tiered.memory import sizes

        context = context or MAX_CONTEXT
        return self.cpu_token * (sizes.cpu_prefill_tokens(context, slots) - sizes.cpu_prefill_tokens(context))

    def cpu(self, experts: int, staging: int = STAGING) -> int:
        """CPU-tier budget (behind an accelerator) for `experts` CPU-resident experts."""
        return (staging + experts) * self.expert


def cuda_library() -> int:
    """Bytes a CUDA engine's plan keeps for cuBLAS workspaces on this machine's GPU
    (CudaAccelerator.library_workspace_bytes: 96 MiB on Hopper), for budgets of tests marked `cuda`."""
    from tiered.hardware.cuda import CudaAccelerator

    return CudaAccelerator(1).library_workspace_bytes()


class RuntimeZoo:
    """Lazily written, cached tiny MoE checkpoints, transformers twins and reference outputs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._dirs: dict[str, Path] = {}
        self._hf: dict[str, object] = {}
        self._ref: dict[str, tuple[torch.Tensor, list[int]]] = {}
        self._sizes: dict[str, Sizes] = {}

    def dir(self, kind: str) -> Path:
        if kind not in self._dirs:
            self._dirs[kind] = make_moe_checkpoint(kind, self.root / kind)
        return self._dirs[kind]

    def hf(self, kind: str):
        if kind not in self._hf:
            self._hf[kind] = load_hf_moe_model(self.dir(kind))
        return self._hf[kind]

    def reference(self, kind: str) -> tuple[torch.Tensor, list[int]]:
        """transformers' fp32 logits [16, V] of prompt() and its 16-token greedy continuation (EOS off)."""
        if kind not in self._ref:
            model, ids = self.hf(kind), prompt()
            t = torch.tensor([ids])
            with torch.no_grad():
                logits = model(t).logits[0].float()
                out = model.generate(t, attention_mask=torch.ones_like(t), do_sample=False,
                                     max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
            greedy = out[0, len(ids):].tolist()
            assert len(greedy) == NEW_TOKENS
            self._ref[kind] = (logits, greedy)
        return self._ref[kind]

    def sizes(self, kind: str) -> Sizes:
        if kind not in self._sizes:
            self._sizes[kind] = sizes_of(self.dir(kind))
        return self._sizes[kind]


def stored_elements(path: Path, keep) -> int:
    """Elements of the tensors stored in a safetensors checkpoint directory whose names `keep(name)`
    accepts, read from the files' own headers: an count independent of the engine's byte accounting."""
    from safetensors import safe_open

    n = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if keep(name):
                    shape = st.get_slice(name).get_shape()
                    n += int(torch.Size(shape).numel())
    return n


def kv_bytes(cfg, max_context: int, elem: int = 4) -> int:
    """Keys and values of every layer for one sequence: 2 x L x Hkv x max_context x head_dim x elem
    (latent attention: L x max_context x (kv_lora_rank + qk_rope_head_dim) x elem)."""
    if cfg.is_mla:
        return cfg.num_hidden_layers * max_context * (cfg.kv_lora_rank + cfg.head_dim) * elem
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * max_context * cfg.head_dim * elem


def sizes_of(path: Path, max_context: int = MAX_CONTEXT) -> Sizes:
    """Byte counts of an MoE checkpoint in fp32, from its files' headers and its config."""
    from tiered.checkpoint import open_checkpoint
    from tiered.memory import sizes

    cfg = open_checkpoint(path).config
    return Sizes(nonexpert=4 * stored_elements(path, lambda n: ".experts." not in n),
                 expert=3 * cfg.hidden_size * cfg.moe_intermediate_size * 4,
                 kv=kv_bytes(cfg, max_context),
                 num_experts=cfg.num_experts,
                 moe_layers=sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)),
                 rotary=2 * max_context * cfg.rotary_dim * 4,
                 workspace=sizes.workspace_bytes(cfg, "fp32"),
                 cpu_workspace=sizes.cpu_workspace_bytes(cfg, "fp32", max_context),
                 cpu_token=sizes.workspace_bytes(cfg, "fp32", 1) - sizes.workspace_bytes(cfg, "fp32", 0))


def live_device_bytes() -> int:
    """Bytes of every distinct storage held by a live StandinTensor: what the host stand-in's
    "device" really holds, counted from the tensors themselves, not from any budget."""
    import gc
    import warnings

    from tiered.hardware.standin import StandinTensor

    seen = {}
    with warnings.catch_warnings():  # isinstance on torch.distributed.reduce_op (a gc object) warns it is deprecated
        warnings.simplefilter("ignore", FutureWarning)
        objects = [obj for obj in gc.get_objects() if isinstance(obj, StandinTensor)]
    for obj in objects:
        with torch._C.DisableTorchFunctionSubclass():
            st = obj.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


_ZOO: RuntimeZoo | None = None


@pytest.fixture(scope="session")
def rt(tmp_path_factory) -> RuntimeZoo:
    global _ZOO
    if _ZOO is None:
        _ZOO = RuntimeZoo(tmp_path_factory.mktemp("runtime"))
    return _ZOO
