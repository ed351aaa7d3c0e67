"""MoE architectures (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against transformers, plus the
expert / router / runner contract of tiered/models/moe.py.

Two ways in: `tiered.LLM` (the engine, whose expert runtime serves the experts) and a "local"
model, every tensor materialized and the default LocalExperts runner, which tests the model
code alone. Checkpoints come from tests/moe_fixtures.py, generated once per session into a tmp dir.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from fixtures import local_model, packed_prefill_gaps  # noqa: E402
from moe_fixtures import MOE_KINDS, VOCAB  # noqa: E402
from runtime_fixtures import rt  # noqa: E402,F401  (the shared checkpoint zoo fixture)

from tiered import LLM, EngineConfig, SamplingParams  # noqa: E402
from tiered.checkpoint import open_checkpoint  # noqa: E402
from tiered.checkpoint.model_config import rope_attention_factor  # noqa: E402
from tiered.models.layers import KVCache  # noqa: E402
from tiered.quant.int4 import Int4Linear  # noqa: E402
from tiered.models.moe import (  # noqa: E402
    Expert, LocalExperts, MoEBlock, Router, expert_forward, moe_blocks)

REL_TOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


class MoEZoo:
    """Models over the session's tiny MoE checkpoints (written once, shared with the runtime tests
    through runtime_fixtures.RuntimeZoo)."""

    def __init__(self, checkpoints) -> None:
        self.checkpoints = checkpoints
        self._llm: dict[tuple, LLM] = {}
        self._local: dict[str, torch.nn.Module] = {}

    def dir(self, kind: str) -> Path:
        return self.checkpoints.dir(kind)

    def hf(self, kind: str):
        return self.checkpoints.hf(kind)

    def llm(self, kind: str, **config) -> LLM:
        config.setdefault("decode_weights", "fp32")
        key = (kind, tuple(sorted(config.items())))
        if key not in self._llm:
            self._llm[key] = LLM(self.dir(kind), EngineConfig(**config))
        return self._llm[key]

    def local(self, kind: str) -> torch.nn.Module:
        """The model alone: built on meta, every tensor (experts too) materialized in fp32."""
        if kind not in self._local:
            self._local[kind] = local_model(self.dir(kind))
        return self._local[kind]


@pytest.fixture(scope="session")
def moe(rt) -> MoEZoo:  # noqa: F811
    return MoEZoo(rt)


def prompt(length: int = 16, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (length,), generator=g).tolist()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    t = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def local_logits(model, ids: list[int]) -> torch.Tensor:
    """[T, V] logits of the local model (one prefill step)."""
    T = len(ids)
    cache = KVCache(model.config, 1, T, torch.float32)
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.arange(T).unsqueeze(0), torch.tensor([0]), cache,
                     last_only=False)[0]


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_packed_prompts_attend_to_their_own_slots(moe, kind):
    """Prompts packed into one row (models/layers.build_packed_metadata) give each one's logits alone and leave
    each slot its own KV (fixtures.packed_prefill_gaps): their tokens routed together, each prompt's attention
    on its own (DeepSeek's latent attention expanded a segment at a time); the int8 cache's rows too (not
    latent attention's, which has none)."""
    model = moe.local(kind)
    for kv in (torch.float32,) + (() if model.config.is_mla else (torch.int8,)):
        prefill, decode = packed_prefill_gaps(model, VOCAB, kv)
        assert prefill <= 1e-5 and decode <= 1e-5, (kv, prefill, decode)


# ------------------------------------------------------------------ against transformers
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_logits_equal_transformers(moe, kind):
    ids = prompt()
    assert rel_err(moe.llm(kind).logits(ids), hf_logits(moe.hf(kind), ids)) <= REL_TOL


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_local_experts_logits_equal_transformers(moe, kind):
    """The model code alone (LocalExperts runner, all weights resident)."""
    model = moe.local(kind)
    assert all(type(b.runner) is LocalExperts for b in moe_blocks(model))
    ids = prompt()
    assert rel_err(local_logits(model, ids), hf_logits(moe.hf(kind), ids)) <= REL_TOL


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_greedy_equals_transformers(moe, kind):
    ids = prompt(seed=1)
    out = moe.llm(kind).generate([ids], GREEDY)[0].token_ids
    assert out == hf_greedy(moe.hf(kind), ids, 16)
    assert len(set(out)) > 1  # not a degenerate repeat of one token


@pytest.mark.parametrize("kind", ["qwen2_moe", "deepseek_v3"])
def test_batched_decode_equals_transformers(moe, kind):
    """Two sequences decoded together (B = 2 through the MoE block; for DeepSeek through latent
    attention's masked decode over slots of different lengths) match one-by-one HF."""
    a, b = prompt(16, seed=2), prompt(9, seed=3)
    outs = moe.llm(kind).generate([a, b], GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(moe.hf(kind), p, 16) for p in (a, b)]


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_parameter_names_equal_checkpoint(moe, kind):
    """The module tree has exactly the checkpoint's tensors (nothing missing, nothing ignored)."""
    names = {n for n, _ in moe.local(kind).named_parameters()}
    assert names == set(open_checkpoint(moe.dir(kind)).names())


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_model_config(moe, kind):
    cfg = open_checkpoint(moe.dir(kind)).config
    assert cfg.is_moe and (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)
    expect = {
        "mixtral": dict(moe_intermediate_size=48, norm_topk_prob=True, moe_layers=[0, 1], qk_norm=False),
        "qwen2_moe": dict(moe_intermediate_size=32, shared_expert_intermediate_size=64, intermediate_size=96,
                          norm_topk_prob=False, attention_bias=True, moe_layers=[0, 2], qk_norm=False),
        "qwen3_moe": dict(moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=True, head_dim=32,
                          qk_norm=True, qk_norm_scope="head", moe_layers=[1]),
        "olmoe": dict(moe_intermediate_size=32, norm_topk_prob=False, qk_norm=True, qk_norm_scope="proj",
                      clip_qkv=1.5, moe_layers=[0, 1]),
        "deepseek_v2": dict(moe_intermediate_size=32, intermediate_size=96, shared_expert_intermediate_size=64,
                            shared_expert_gated=False, norm_topk_prob=False, kv_lora_rank=32, q_lora_rank=0,
                            head_dim=8, num_key_value_heads=1, topk_method="group_limited_greedy", n_group=2,
                            topk_group=1, routed_scaling_factor=1.5, rope_interleave=True, moe_layers=[1, 2]),
        "deepseek_v3": dict(moe_intermediate_size=32, shared_expert_intermediate_size=64, norm_topk_prob=True,
                            kv_lora_rank=32, q_lora_rank=24, topk_method="noaux_tc", n_group=2, topk_group=1,
                            routed_scaling_factor=2.5, moe_layers=[1, 2]),
    }[kind]
    assert [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)] == expect.pop("moe_layers")
    for k, v in expect.items():
        assert getattr(cfg, k) == v, k
    # every tensor the checkpoint stores (DeepSeek-V3's score-correction bias is a buffer in transformers)
    assert cfg.num_parameters() == sum(t.numel() for t in moe.hf(kind).state_dict().values())


def test_olmoe_clip_qkv_is_exercised(moe):
    """The fixture's clip_qkv changes the logits, so the parity test covers the clamp."""
    llm = moe.llm("olmoe")
    ids = prompt()
    attns = [layer.self_attn for layer in llm.model.model.layers]
    try:
        for a in attns:
            a.clip_qkv = None
        unclipped = llm.logits(ids)
    finally:
        for a in attns:
            a.clip_qkv = 1.5
    assert rel_err(unclipped, hf_logits(moe.hf("olmoe"), ids)) > 1e-3


@pytest.mark.parametrize("kind, change", [
    ("deepseek_v2", "groups"), ("deepseek_v3", "groups"), ("deepseek_v3", "bias"), ("deepseek_v3", "yarn")])
def test_deepseek_options_are_exercised(moe, kind, change):
    """Each DeepSeek option of the fixtures changes the logits, so the parity tests cover it: routing
    within the best groups, V3's score-correction bias, YaRN's attention factor on the RoPE tables."""
    llm = moe.llm(kind)
    ids = prompt()
    routers = [b.gate for b in moe_blocks(llm.model)]
    saved = [(r.topk_group, r.e_score_correction_bias) for r in routers]
    rotary = llm.model.rotary
    tables = rotary.cos, rotary.sin
    try:
        for r in routers:
            if change == "groups":
                r.topk_group = r.n_group
            elif change == "bias":
                r.e_score_correction_bias = torch.nn.Parameter(torch.zeros_like(r.e_score_correction_bias))
        if change == "yarn":
            f = rope_attention_factor(llm.config)
            assert f != 1.0
            rotary.cos, rotary.sin = tables[0] / f, tables[1] / f
        changed = llm.logits(ids)
    finally:
        for r, (g, b) in zip(routers, saved):
            r.topk_group, r.e_score_correction_bias = g, b
        rotary.cos, rotary.sin = tables
    assert rel_err(changed, hf_logits(moe.hf(kind), ids)) > 1e-3


# ---------------------------------------------------------------- routing is not degenerate
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_routing_spreads_tokens_and_hook_sees_it(moe, kind):
    llm = moe.llm(kind)
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    blocks = moe_blocks(llm.model)
    for b in blocks:
        b.on_route = lambda layer, idx, w: seen.append((layer, idx.clone(), w.clone()))
    try:
        llm.logits(prompt())
    finally:
        for b in blocks:
            b.on_route = None
    cfg = llm.config
    assert [s[0] for s in seen] == [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    for _, idx, w in seen:
        assert idx.shape == w.shape == (16, 2) and idx.dtype == torch.int64 and w.dtype == torch.float32
        assert len(idx.unique()) >= 4  # most of the 8 experts receive tokens
        if cfg.norm_topk_prob:  # w is on the engine's device; DeepSeek scales the normalized weights
            torch.testing.assert_close(w.sum(-1).cpu(), torch.full((16,), cfg.routed_scaling_factor))


# -------------------------------------------------------------------------- pure functions
def test_expert_forward_is_swiglu():
    torch.manual_seed(0)
    x = torch.randn(5, 64)
    wg, wu, wd = 0.1 * torch.randn(32, 64), 0.1 * torch.randn(32, 64), 0.1 * torch.randn(64, 32)
    ref = (torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)) @ wd.T
    torch.testing.assert_close(expert_forward(x, wg, wu, wd), ref)
    # Weights in another dtype are cast to the activations'.
    out = expert_forward(x.bfloat16(), wg, wu, wd)
    assert out.dtype == torch.bfloat16 and out.shape == (5, 64)
    assert rel_err(out.float(), ref) < 0.02
    # Expert names and weights() order: (gate, up, down).
    e = Expert(64, 32, ("w1", "w3", "w2"))
    assert [n for n, _ in e.named_parameters()] == ["w1.weight", "w3.weight", "w2.weight"]
    assert e.weights()[1] is e.w3.weight
    torch.testing.assert_close(e(x), expert_forward(x, e.w1.weight, e.w3.weight, e.w2.weight))


@pytest.mark.parametrize("hf_cls,norm", [
    ("mixtral.modeling_mixtral.MixtralTopKRouter", True),
    ("qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter", False),
    ("qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter", True),
    ("qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter", True),
    ("olmoe.modeling_olmoe.OlmoeTopKRouter", False),
])
def test_router_equals_transformers_rule(hf_cls, norm):
    import importlib
    from types import SimpleNamespace

    module, cls = hf_cls.rsplit(".", 1)
    cfg = SimpleNamespace(hidden_size=64, num_local_experts=8, num_experts=8, num_experts_per_tok=2,
                          norm_topk_prob=norm)
    ref_router = getattr(importlib.import_module(f"transformers.models.{module}"), cls)(cfg)
    torch.manual_seed(0)
    ours = Router(64, 8, 2, norm)
    torch.nn.init.normal_(ours.weight, std=0.3)
    ref_router.weight.data.copy_(ours.weight.data)
    x = torch.randn(40, 64)
    idx, w = ours.route(x)
    _, ref_w, ref_idx = ref_router(x)
    assert idx.dtype == torch.int64 and torch.equal(idx, ref_idx)
    torch.testing.assert_close(w, ref_w.to(x.dtype))
    if norm:
        torch.testing.assert_close(w.sum(-1), torch.ones(40))
    else:
        assert bool((w.sum(-1) < 1).all())
    # bf16 activations: weights come back in bf16 (softmax still in fp32).
    assert ours.to(torch.bfloat16).route(x.bfloat16())[1].dtype == torch.bfloat16


# --------------------------------------------------------------------------- runner contract
class RecordingRunner:
    """Delegates to LocalExperts and records every call; optionally scales the result."""

    def __init__(self, scale: float = 1.0) -> None:
        self.calls: list[tuple[int, tuple, tuple, tuple]] = []
        self.outputs: list[torch.Tensor] = []
        self.scale = scale

    def __call__(self, layer_idx, x, topk_idx, topk_weight, block):
        self.calls.append((layer_idx, tuple(x.shape), tuple(topk_idx.shape), tuple(topk_weight.shape)))
        out = LocalExperts()(layer_idx, x, topk_idx, topk_weight, block) * self.scale
        self.outputs.append(out)
        return out


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_swapped_runner_is_used(moe, kind):
    model = moe.local(kind)
    ids = prompt()
    ref = local_logits(model, ids)
    blocks = moe_blocks(model)
    runners = [RecordingRunner() for _ in blocks]
    try:
        for b, r in zip(blocks, runners):
            b.runner = r
        torch.testing.assert_close(local_logits(model, ids), ref, rtol=0, atol=0)
        for b, r in zip(blocks, runners):
            assert r.calls == [(b.layer_idx, (16, 64), (16, 2), (16, 2))]
        # The runner's output is what the block returns (plus the shared expert, if any).
        block, runner = blocks[0], RecordingRunner(scale=0.5)
        block.runner = runner
        x = torch.randn(2, 3, 64)
        with torch.inference_mode():
            y = block(x)
            shared = 0
            if block.shared_expert is not None:
                h = x.view(6, 64)
                shared = torch.sigmoid(block.shared_expert_gate(h)) * block.shared_expert(h)
        torch.testing.assert_close(y, (runner.outputs[0] + shared).view(2, 3, 64))
        assert not torch.equal(local_logits(model, ids), ref)
    finally:
        for b in blocks:
            b.runner = LocalExperts()


def test_block_runs_with_experts_on_meta(moe):
    """A runner holding its own weights lets the block run with `block.experts` on meta."""
    src = moe_blocks(moe.local("olmoe"))[0]
    cfg = moe.local("olmoe").config
    with torch.device("meta"):
        block = MoEBlock(cfg, src.layer_idx)
    block.gate.weight = torch.nn.Parameter(src.gate.weight.detach().clone(), requires_grad=False)
    held = [tuple(w.detach().clone() for w in e.weights()) for e in src.experts]

    class HeldRunner:
        def __call__(self, layer_idx, x, topk_idx, topk_weight, block):
            out = torch.zeros_like(x)
            for e in topk_idx.unique().tolist():
                rows, slot = torch.where(topk_idx == e)
                out.index_add_(0, rows, expert_forward(x[rows], *held[e]) * topk_weight[rows, slot, None])
            return out

    block.runner = HeldRunner()
    assert all(p.is_meta for p in block.experts.parameters())
    x = torch.randn(1, 5, 64)
    with torch.inference_mode():
        torch.testing.assert_close(block(x), src(x))


def test_mixtral_layer_names_its_block(moe):
    layer = moe.local("mixtral").model.layers[0]
    assert isinstance(layer.mlp, MoEBlock) and layer.mlp is layer.block_sparse_moe
    assert "mlp" not in dict(layer.named_children())


# ------------------------------------------------------------------------- default engine
def test_default_decode_weights_generate(moe):
    """EngineConfig() (decode_weights="auto": bf16 decode copies) loads and generates; the router
    stays a dense Router."""
    llm = moe.llm("qwen2_moe", decode_weights="auto")
    assert all(type(b.gate) is Router for b in moe_blocks(llm.model))
    out = llm.generate([prompt(seed=1)], GREEDY)[0].token_ids
    assert len(out) == 16
    # One copy per weight: prefill runs on the bf16 copies of the attention projections too (the
    # experts and the router stay fp32); --dtype float32 keeps the dense weights, lossless.
    ids = prompt()
    ref = hf_logits(moe.hf("qwen2_moe"), ids)
    assert rel_err(llm.logits(ids), ref) <= 3e-2
    lossless = moe.llm("qwen2_moe", decode_weights="auto", dtype="float32")
    assert rel_err(lossless.logits(ids), ref) <= REL_TOL


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_int4_decode_weights_keep_rows_no_int4_kernel_takes_dense(moe, kind):
    """decode_weights="int4" on an HF MoE checkpoint: Qwen2-MoE's shared-expert gate, one row (N % 16
    != 0, which neither int4 layout takes: torch's int4pack raised mid-load, the real Qwen1.5-MoE's
    too), keeps a dense decode weight; the projections take int4, the routers stay Routers, and the
    engine generates (the tiny random weights lose ~25-40% of the logits' scale to int4: only a
    bound that a broken kernel would miss)."""
    llm = moe.llm(kind, decode_weights="int4")
    assert all(type(b.gate) is Router for b in moe_blocks(llm.model))
    assert any(isinstance(m, Int4Linear) for m in llm.model.modules())
    assert len(llm.generate([prompt(seed=1)], GREEDY)[0].token_ids) == 16
    ids = prompt()
    assert rel_err(llm.logits(ids, lossless=False), hf_logits(moe.hf(kind), ids)) <= 0.6


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_latent_attention_decodes_through_native_absorbed_kernels(moe, kind):
    """The CPU's default engine gives each latent attention bf16 per-head copies of kv_b_proj's halves,
    run by tiered's kernels in a decode step; its logits stay those of the fp32 matmuls up to bf16
    rounding, and the planner's byte count holds what the engine holds."""
    from tiered import kernels
    from tiered.models.deepseek import LatentAttention

    if not kernels.available():
        pytest.skip("tiered/kernels is not built")
    llm = LLM(moe.dir(kind), EngineConfig(max_context=64, accelerator="none"))
    attns = [m for m in llm.model.modules() if isinstance(m, LatentAttention)]
    assert attns and all(a.absorbed is not None for a in attns)
    ids = prompt(12, seed=5)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    native = llm.generate([ids], sp)[0]
    saved = [a.absorbed for a in attns]
    for a in attns:
        a.absorbed = None
    try:
        plain = llm.generate([ids], sp)[0]
    finally:
        for a, s in zip(attns, saved):
            a.absorbed = s
    assert native.token_ids[:3] == plain.token_ids[:3]
    assert llm.fast_budget.peak <= llm.plan.memory["cpu"]
    llm.close()


def test_bf16_latent_layers_decode_on_native_kernels(moe, monkeypatch):
    """A bf16 engine (no decode copies: the weights are bf16 already) on the CPU: the latent layers,
    which the decode step runs as modules, get the absorbed bf16 kernels and their plain bf16
    projections (attention, the shared experts) become CastLinears over the same tensors, whose
    one-token calls take tiered's bf16 kernel; the decode steps' logits stay those of the torch
    path up to bf16 rounding."""
    from tiered import kernels
    from tiered.memory import sizes
    from tiered.models.deepseek import LatentAttention
    from tiered.quant.linear import CastLinear

    if not kernels.available():
        pytest.skip("tiered/kernels is not built")
    from fixtures import stepwise_logits
    from tiered.eval.kl import kl_divergence

    # the rows up to which bf16 calls take the native kernel come from each build's tuning (2 to 32 rows); a
    # 6-token prompt past them runs torch's bf16 GEMMs, whose bf16-rounded outputs put one later position
    # 7e-3 nats from the fp32 engine (measured with a tuning of 2 rows): pinned, as the tunings of 8+ decide
    monkeypatch.setattr(kernels, "bf16_native_rows", lambda: 8)
    llm = LLM(moe.dir("deepseek_v2"), EngineConfig(max_context=64, dtype="bfloat16", accelerator="none"))
    assert llm.plan.native_decode and llm.plan.dense_copies
    attns = [m for m in llm.model.modules() if isinstance(m, LatentAttention)]
    ids = prompt(12, seed=5)
    got = stepwise_logits(llm, ids, 6)  # decode steps through the native path (generate warms the step up)
    assert all(a.absorbed is not None for a in attns)
    layer = llm.model.model.layers[1]
    assert type(layer.self_attn.q_proj) is CastLinear and type(layer.mlp.shared_experts.down_proj) is CastLinear
    held = sum(p.numel() * p.element_size() for p in llm.model.parameters() if not p.is_meta)
    assert held == sizes.weight_bytes(llm.config, "bf16", sizes.is_expert_param)  # shared, not copied
    ref = moe.llm("deepseek_v2").logits(ids)[5:]  # the lossless fp32 engine
    assert float(kl_divergence(ref, got).max()) < 2e-3
    llm.close()


@pytest.mark.parametrize("kind", ["deepseek_v3", "mixtral"])
def test_deepseek_routers_stay_fp32_in_a_bf16_engine(moe, kind):
    """DeepSeek's routers and correction biases load in fp32 in a bf16 engine, as transformers keeps
    them; the byte count the budgets use (memory/sizes.weight_bytes) counts them so. Other routers
    follow the model's dtype."""
    from tiered.memory import sizes

    llm = LLM(moe.dir(kind), EngineConfig(max_context=32, dtype="bfloat16", decode_weights="fp32",
                                          accelerator="none"))
    gates = [b.gate for b in moe_blocks(llm.model)]
    want = torch.float32 if kind.startswith("deepseek") else torch.bfloat16
    assert all(g.weight.dtype == want for g in gates)
    if kind == "deepseek_v3":
        assert all(g.e_score_correction_bias.dtype == torch.float32 for g in gates)
    held = sum(p.numel() * p.element_size() for n, p in llm.model.named_parameters()
               if not p.is_meta and ".decode." not in n)  # the model's own weights, not the decode copies
    assert held == sizes.weight_bytes(llm.config, "bf16", sizes.is_expert_param)
    llm.close()


def test_bf16_experts_stay_bf16_on_the_cpus_default_engine(tmp_path):
    """A checkpoint whose experts are stored in bf16 keeps them in bf16 on the CPU's default engine
    (its decode path is lossy anyway: compact decode copies), on tiered's native expert kernels in the
    decode step, not widened to fp32 (twice the RAM; a Mixtral-shaped bf16 checkpoint decoded at 41
    ms a token that way, 8.4 with them as stored). The lossless modes (--dtype float32, fp32 decode
    weights) keep fp32 experts. Logits stay those of transformers on the same bf16 weights."""
    from fixtures import hf_logits, max_rel_err, prompt_ids
    from moe_fixtures import build_hf_moe_model, load_hf_moe_model

    from tiered.memory import sizes

    model = build_hf_moe_model("qwen3_moe", VOCAB).to(torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True)
    ids = prompt_ids(VOCAB, 12, 0)
    ref = hf_logits(load_hf_moe_model(tmp_path), ids)  # the stored bf16 weights, computed in fp32
    auto = LLM(tmp_path, EngineConfig(max_context=32, accelerator="none"))
    cfg = auto.config
    assert auto.plan.dtypes["experts"] == "bf16" and auto.experts.fmt.name == "bf16"
    held = auto.plan.memory["cpu"] - auto.plan.workspace_bytes  # the weights, KV cache and staging
    assert held < sizes.weight_bytes(cfg, "fp32")  # experts at 2 bytes a weight
    assert ("native", 0, cfg.num_hidden_layers) in auto.runtime.cpu_decode.schedule  # the MoE blocks in the step
    assert max_rel_err(auto.logits(ids), ref) < 2e-2
    for asked, tol in ((dict(dtype="float32"), 2e-2), (dict(decode_weights="fp32"), 1e-4),
                       (dict(dtype="float32", decode_weights="fp32"), 1e-4)):
        llm = LLM(tmp_path, EngineConfig(max_context=32, accelerator="none", **asked))
        assert llm.plan.dtypes["experts"] == "fp32"
        assert max_rel_err(llm.logits(ids), ref) < tol
        llm.close()
    auto.close()
