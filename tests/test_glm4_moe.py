"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 MoE (transformers' glm4_moe) against transformers.

GLM-4.5's MoE decoder is Llama-style grouped-query attention (q/k/v biases, optional per-head q/k
RMSNorm) with a partial RoPE (each head's first head_dim * partial_rotary_factor features rotated,
rotate-half, the rest passed through) and DeepSeek-V3's MoE block (sigmoid router with a
score-correction bias and group-limited choice, renormalized, routed scaling, ungated shared
experts), the first first_k_dense_replace layers dense (transformers' modeling_glm4_moe.py).

Checkpoints are tests/moe_fixtures.py's "glm4_moe" (head_dim 32, 16 features rotated, biases, q/k
norms, best 1 of 2 groups, 2 shared experts, scaling 2.5) and "glm4_moe_air" (head_dim 16, 8
rotated, no biases nor q/k norms, best 2 of 4 groups, 1 shared expert), written by transformers.
Checked: the config and parameter count; prefill logits (model code alone, and the engine with its
expert runtime: experts in RAM, on disk behind a small cache, in CPU RAM behind the host stand-in
accelerator); step-by-step decode logits of the CPU's native C++ step and of its torch-op step
against transformers' at each position (lossless fp32 within 1e-4; bf16 / int4 modes against the
same engine's modules, within their rounding); greedy tokens, batched decode; that the native step
runs every layer itself; that each option changes the logits (so the parity covers it); and that
multi-token-prediction layers stored past num_hidden_layers are ignored.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from moe_fixtures import VOCAB  # noqa: E402
from runtime_fixtures import GREEDY, REL_TOL, decode_logits, engine_config, prompt, rel_err, rt  # noqa: E402,F401

from tiered import LLM, EngineConfig, SamplingParams, kernels  # noqa: E402
from tiered.checkpoint import open_checkpoint  # noqa: E402
from tiered.checkpoint.model_config import ModelConfig  # noqa: E402
from tiered.memory.materialize import materialize  # noqa: E402
from tiered.models import build_model  # noqa: E402
from tiered.models.deepseek import DeepSeekRouter  # noqa: E402
from tiered.models.layers import KVCache, Rotary, apply_rotary  # noqa: E402
from tiered.models.moe import LocalExperts, MoEBlock, moe_blocks  # noqa: E402
from tiered.planner.placement import DISK, FAST  # noqa: E402
from tiered.runtime.cpu_decode import CPUDecodeStep  # noqa: E402

KINDS = ("glm4_moe", "glm4_moe_air")
native_only = pytest.mark.skipif(not kernels.available(), reason="tiered/kernels is not built")
_engines: dict = {}


def engine(rt, kind: str, **kw) -> LLM:  # noqa: F811
    """The CPU engine (no accelerator) over `kind`, lossless fp32 unless `kw` says otherwise; kept open."""
    key = (kind, tuple(sorted(kw.items())))
    if key not in _engines:
        _engines[key] = LLM(rt.dir(kind), engine_config(**{"accelerator": "none", **kw}))
    return _engines[key]


def teardown_module():
    for llm in _engines.values():
        llm.close()
    _engines.clear()


def hf_logits(rt, kind: str, ids: list[int]) -> torch.Tensor:  # noqa: F811
    """transformers' fp32 logits [T, V] of one prompt."""
    with torch.no_grad():
        return rt.hf(kind)(torch.tensor([ids])).logits[0].float()


def local_model(rt, kind: str, max_positions: int = 64):  # noqa: F811
    """The model code alone: built on meta, every tensor (experts too) materialized in fp32."""
    ckpt = open_checkpoint(rt.dir(kind))
    with torch.device("meta"):
        model = build_model(ckpt.config, max_positions)
    model.rotary = Rotary(ckpt.config, max_positions)
    materialize(model, ckpt, torch.float32)
    return model.eval()


# ---------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kind", KINDS)
def test_model_config(rt, kind):  # noqa: F811
    cfg = open_checkpoint(rt.dir(kind)).config
    common = dict(model_type="glm4_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  intermediate_size=96, topk_method="noaux_tc", shared_expert_gated=False, norm_topk_prob=True,
                  first_k_dense_replace=1, o_proj_bias=False, partial_rotary_factor=0.5, is_mla=False)
    expect = {
        "glm4_moe": dict(head_dim=32, rotary_dim=16, attention_bias=True, qk_norm=True, qk_norm_scope="head",
                         n_group=2, topk_group=1, routed_scaling_factor=2.5, shared_expert_intermediate_size=64),
        "glm4_moe_air": dict(head_dim=16, rotary_dim=8, attention_bias=False, qk_norm=False, n_group=4,
                             topk_group=2, routed_scaling_factor=1.0, shared_expert_intermediate_size=32),
    }[kind]
    for k, v in {**common, **expect}.items():
        assert getattr(cfg, k) == v, k
    assert [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)] == [1, 2]
    # every tensor transformers holds (the score-correction bias is a buffer there)
    assert cfg.num_parameters() == sum(t.numel() for t in rt.hf(kind).state_dict().values())
    assert cfg.rope_scaling is None  # rope_parameters' partial_rotary_factor is not a scaling
    from typer.testing import CliRunner

    from tiered.cli import app

    res = CliRunner().invoke(app, ["info", str(rt.dir(kind))])
    assert res.exit_code == 0, res.output
    assert f"partial: {expect['rotary_dim']} of {expect['head_dim']} features a head rotated" in res.output


def test_config_as_released(rt, tmp_path):  # noqa: F811
    """The released config.json layout (transformers 4.x: rope_theta and partial_rotary_factor at the
    top level, rope_scaling null, num_nextn_predict_layers) reads as transformers 5's does; a missing
    factor is transformers' 0.5; a bad one is refused."""
    from tiered.errors import CheckpointError, UnsupportedModelError

    hf = json.loads((rt.dir("glm4_moe") / "config.json").read_text())
    rope = hf.pop("rope_parameters")
    released = dict(hf, rope_theta=rope["rope_theta"], partial_rotary_factor=0.5, rope_scaling=None,
                    num_nextn_predict_layers=1)
    assert ModelConfig.from_hf(released) == ModelConfig.from_hf({**hf, "rope_parameters": rope})
    no_factor = dict(released)
    del no_factor["partial_rotary_factor"]
    assert ModelConfig.from_hf(no_factor).rotary_dim == 16
    assert ModelConfig.from_hf(dict(released, partial_rotary_factor=1.0)).rotary_dim == 32
    for bad in (0, 1.5, "half"):
        with pytest.raises(CheckpointError, match="partial_rotary_factor"):
            ModelConfig.from_hf(dict(released, partial_rotary_factor=bad))
    with pytest.raises(UnsupportedModelError, match="rotary width"):
        ModelConfig.from_hf(dict(released, partial_rotary_factor=0.03))  # int(32 * 0.03) = 0
    with pytest.raises(UnsupportedModelError, match="activation"):
        ModelConfig.from_hf(dict(released, hidden_act="gelu"))


def test_apply_rotary_partial_equals_transformers():
    """models/layers.apply_rotary with tables narrower than the head equals transformers'
    apply_rotary_pos_emb of glm4_moe (both sin forms)."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 5, 32), torch.randn(2, 2, 5, 32)
    ang = torch.randn(2, 5, 8)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()  # [B, T, 16]
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    for signed in (None, Rotary.signed(s)):
        torch.testing.assert_close(apply_rotary(q, c, s, signed), ref_q)
        torch.testing.assert_close(apply_rotary(k, c, s, signed), ref_k)
    assert torch.equal(apply_rotary(q, c, s)[..., 16:], q[..., 16:])


# ---------------------------------------------------------------------------------- prefill parity
@pytest.mark.parametrize("kind", KINDS)
def test_local_model_equals_transformers(rt, kind):  # noqa: F811
    """The model code alone (LocalExperts, every weight resident): logits and parameter names."""
    model = local_model(rt, kind)
    assert all(type(b.runner) is LocalExperts and type(b.gate) is DeepSeekRouter for b in moe_blocks(model))
    assert {n for n, _ in model.named_parameters()} == set(open_checkpoint(rt.dir(kind)).names())
    ids = prompt()
    cache = KVCache(model.config, 1, len(ids), torch.float32)
    with torch.inference_mode():
        got = model(torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([0]), cache, last_only=False)[0]
    assert rel_err(got, hf_logits(rt, kind, ids)) <= REL_TOL


@pytest.mark.parametrize("kind", KINDS)
def test_engine_logits_and_greedy_equal_transformers(rt, kind):  # noqa: F811
    """The lossless engine (experts in RAM, its expert runtime): prompt logits and 16 greedy tokens."""
    ref_logits, ref_tokens = rt.reference(kind)
    llm = engine(rt, kind)
    assert llm.experts.placement.count(FAST) == len(llm.experts.placement.tiers)
    ids = prompt()
    assert rel_err(llm.logits(ids), ref_logits) <= REL_TOL
    out = llm.generate([ids], GREEDY)[0].token_ids
    assert out == ref_tokens and len(set(out)) > 1


@pytest.mark.parametrize("kind", KINDS)
def test_experts_on_disk_small_cache(rt, kind):  # noqa: F811
    """No accelerator, RAM for the non-expert weights and a 3-slot expert cache: every expert is read
    from the checkpoint on disk, the logits and greedy tokens stay transformers'."""
    s = rt.sizes(kind)
    llm = LLM(rt.dir(kind), engine_config(accelerator="none", cpu_memory=s.fast(cache_slots=3, accelerator=False),
                                          expert_cache_slots=3))
    try:
        assert llm.experts.placement.count(DISK) == s.total_experts
        ref_logits, ref_tokens = rt.reference(kind)
        ids = prompt()
        assert rel_err(llm.logits(ids), ref_logits) <= REL_TOL
        assert llm.generate([ids], GREEDY)[0].token_ids == ref_tokens
        rtm = llm.experts
        assert rtm.bytes_read > 0 and rtm.cache.stats.evictions > 0
        assert llm.cpu_budget.peak <= llm.cpu_budget.capacity
    finally:
        llm.close()


@pytest.mark.parametrize("kind", KINDS)
def test_experts_in_cpu_ram_behind_host_accelerator(rt, kind):  # noqa: F811
    """The accelerator's path (the host stand-in: fused q/k/v projections, the GPU step's RoPE)
    holds the non-expert weights and a 2-slot expert cache, the experts live in CPU RAM and go
    through the dispatcher: logits and greedy tokens stay transformers'."""
    from tiered.planner.placement import CPU

    s = rt.sizes(kind)
    llm = LLM(rt.dir(kind), engine_config(accelerator="host", gpu_memory=s.fast(cache_slots=2), cpu_memory="64MiB",
                                          expert_cache_slots=2))
    try:
        assert llm.experts.placement.count(CPU) == s.total_experts
        ref_logits, ref_tokens = rt.reference(kind)
        ids = prompt()
        assert rel_err(llm.logits(ids), ref_logits) <= REL_TOL
        assert llm.generate([ids], GREEDY)[0].token_ids == ref_tokens
        assert llm.experts.path_counts["copy"] + llm.experts.path_counts["cpu"] > 0
    finally:
        llm.close()


# ----------------------------------------------------------------------------------- decode parity
@pytest.mark.parametrize("native", [False, pytest.param(True, marks=native_only)], ids=["torch_ops", "native"])
@pytest.mark.parametrize("kind", KINDS)
def test_decode_steps_equal_transformers(rt, kind, native):  # noqa: F811
    """Lossless fp32: a 6-token prompt, then 14 tokens fed one a step through the CPU decode step (its
    torch-op form or the native C++ step): each step's logits equal transformers' at that position."""
    llm = engine(rt, kind)
    ids = prompt(20, seed=4)
    got = decode_logits(llm, CPUDecodeStep(llm.model, native=native), ids, 6)
    assert rel_err(got, hf_logits(rt, kind, ids)[6:]) <= REL_TOL


@native_only
@pytest.mark.parametrize("mode", ["fp32", "bf16_experts", "int4_experts", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_native_step_runs_every_layer(rt, kind, mode, monkeypatch):  # noqa: F811
    """The engine's native decode step runs the partial-RoPE attention of every layer itself (no
    ("whole", i) module call), the MoE blocks too where its experts have native kernels (bf16 or
    int4 ones: the whole step one native segment); fp32 experts run as their modules after the
    step's attention. Lossless fp32: each decode step's logits within 1e-4 of transformers'. Lossy
    modes against the same engine's modules (the same weights): within bf16 rounding at most
    positions; sigmoid routing among near-tied experts flips at a few (as for DeepSeek-V3: measured
    ~1% typical, 8-25% at 1-2 of 14 positions, the torch-op step likewise)."""
    kw = {"fp32": {}, "bf16_experts": dict(expert_weights="bf16"),
          "int4_experts": dict(decode_weights="auto", expert_weights="int4"),
          "bf16": dict(dtype="bfloat16", decode_weights="auto")}[mode]
    llm = engine(rt, kind, **kw)
    step = llm.runtime.cpu_decode
    assert llm.plan.native_decode and step.native is not None
    in_step = mode != "fp32"
    assert step.schedule == ([("native", 0, 3)] if in_step else [("native", 0, 1), ("attn", 1), ("attn", 2)])
    calls, forward = [], MoEBlock.forward

    def spy(self, x):
        if x.shape[:2] == (1, 1):
            calls.append(self.layer_idx)
        return forward(self, x)

    monkeypatch.setattr(MoEBlock, "forward", spy)
    ids = prompt(20, seed=4)
    got = decode_logits(llm, step, ids, 6)
    assert calls == ([] if in_step else [1, 2] * 14)
    if mode == "fp32":
        assert rel_err(got, hf_logits(rt, kind, ids)[6:]) <= REL_TOL
        return
    ref = decode_logits(llm, lambda *a: llm.model(*a), ids, 6)
    errs = sorted(rel_err(a, b) for a, b in zip(got, ref))
    assert errs[len(errs) // 2] <= 3e-2 and errs[-4] <= 5e-2 and errs[-1] <= 0.4, errs
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.85


@native_only
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_native_step_equals_torch_op_step_batched(rt, kind, mode):  # noqa: F811
    """Batches of 3 rows in slots 2, 0, 3 at positions 1.., 6.., 17.. (a server's step): the native
    step's logits and KV cache equal the torch-op step's (the same math in torch ops) over the same
    weights: fp32 within 1e-4, bf16 within its rounding with the same argmax."""
    from tiered.memory import sizes

    llm = engine(rt, kind, **({} if mode == "fp32" else dict(dtype="bfloat16", decode_weights="auto")))
    g = torch.Generator().manual_seed(3)
    lens, slots = [1, 6, 17], [2, 0, 3]
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lens]
    feed = torch.randint(2, VOCAB, (10, 3, 1), generator=g)
    results = []
    for native in (True, False):
        step = CPUDecodeStep(llm.model, native=native)
        cache = KVCache(llm.config, 4, 32, sizes.torch_dtype(llm.plan.dtypes["kv_cache"]))
        out = []
        with torch.inference_mode():
            for p, s in zip(prompts, slots):
                llm.model(torch.tensor([p]), torch.arange(len(p))[None], torch.tensor([s]), cache)
            pos = torch.tensor(lens).view(-1, 1)
            for t in range(10):
                out.append(step(feed[t], pos + t, torch.tensor(slots), cache).float())
        results.append((torch.stack(out), cache))
    (got, cache), (ref, ref_cache) = results
    tol = 1e-4 if mode == "fp32" else 2e-2
    assert rel_err(got, ref) <= tol
    assert float((cache.k.float() - ref_cache.k.float()).abs().max()) <= tol * float(ref_cache.k.abs().max())
    if mode != "fp32":
        assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9


@pytest.mark.parametrize("kind", KINDS)
def test_batched_generation_equals_transformers(rt, kind):  # noqa: F811
    """Prompts of 16 and 9 tokens decoded together: each gets transformers' greedy tokens."""
    from fixtures import hf_greedy

    a, b = prompt(16, seed=2), prompt(9, seed=3)
    outs = engine(rt, kind).generate([a, b], GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(rt.hf(kind), p, GREEDY.max_tokens) for p in (a, b)]


# ------------------------------------------------------------------------- the options are exercised
@pytest.mark.parametrize("kind, change", [
    ("glm4_moe", "partial_rope"), ("glm4_moe_air", "partial_rope"), ("glm4_moe", "groups"),
    ("glm4_moe", "bias"), ("glm4_moe", "qk_norm"), ("glm4_moe", "shared"), ("glm4_moe", "attention_bias")])
def test_options_are_exercised(rt, kind, change):  # noqa: F811
    """Each option of the fixtures changes the logits, so the parity tests cover it: RoPE over the
    whole head instead of its first half, routing among every group, the score-correction bias, the
    q/k norms, the shared experts, the q/k/v biases."""
    model = local_model(rt, kind)
    cfg = model.config
    blocks = moe_blocks(model)
    attns = [layer.self_attn for layer in model.model.layers]
    if change == "partial_rope":
        full = ModelConfig(**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__} | {"partial_rotary_factor": 1.0})
        model.rotary = Rotary(full, 64)
    for b in blocks:
        if change == "groups":
            b.gate.topk_group = b.gate.n_group
        elif change == "bias":
            b.gate.e_score_correction_bias.data.zero_()
        elif change == "shared":
            b.shared_experts.down_proj.weight.data.zero_()
    for a in attns:
        if change == "qk_norm":
            a.q_norm = a.k_norm = None
        elif change == "attention_bias":
            for p in (a.q_proj, a.k_proj, a.v_proj):
                p.bias.data.zero_()
    ids = prompt()
    cache = KVCache(cfg, 1, len(ids), torch.float32)
    with torch.inference_mode():
        got = model(torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([0]), cache, last_only=False)[0]
    assert rel_err(got, hf_logits(rt, kind, ids)) > 1e-3


def test_multi_token_prediction_layer_is_ignored(rt, tmp_path):  # noqa: F811
    """A checkpoint that stores its MTP layer (model.layers.<num_hidden_layers>.*: eh_proj, enorm,
    hnorm, shared_head, a full decoder layer, as GLM-4.5's files do) loads and gives the same logits."""
    from safetensors.torch import save_file

    src = rt.dir("glm4_moe")
    d = tmp_path / "with_mtp"
    shutil.copytree(src, d)
    cfg = open_checkpoint(src).config
    L, D = cfg.num_hidden_layers, cfg.hidden_size
    p = f"model.layers.{L}."
    extra = {p + "eh_proj.weight": torch.randn(D, 2 * D), p + "enorm.weight": torch.ones(D),
             p + "hnorm.weight": torch.ones(D), p + "shared_head.norm.weight": torch.ones(D),
             p + "self_attn.q_proj.weight": torch.randn(cfg.num_attention_heads * cfg.head_dim, D),
             p + "mlp.experts.0.gate_proj.weight": torch.randn(cfg.moe_intermediate_size, D),
             p + "mlp.gate.weight": torch.randn(cfg.num_experts, D)}
    save_file(extra, str(d / "mtp.safetensors"))
    ids = prompt()
    llm = LLM(d, engine_config(accelerator="none"))
    try:
        assert len(llm.model.model.layers) == L
        assert rel_err(llm.logits(ids), rt.reference("glm4_moe")[0]) <= REL_TOL
    finally:
        llm.close()


def test_default_engine_generates(rt):  # noqa: F811
    """EngineConfig() defaults on the CPU (bf16 decode copies, a bf16 KV cache) generate text whose
    prompt logits stay within bf16 rounding of transformers'; the routers stay fp32 DeepSeek routers."""
    llm = LLM(rt.dir("glm4_moe"), EngineConfig(max_context=32, accelerator="none"))
    try:
        assert all(type(b.gate) is DeepSeekRouter and b.gate.weight.dtype == torch.float32
                   for b in moe_blocks(llm.model))
        ids = prompt()
        assert rel_err(llm.logits(ids), rt.reference("glm4_moe")[0]) <= 3e-2
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
        assert len(out) == 8
    finally:
        llm.close()
