"""gpt-oss (OpenAI's gpt-oss-20b / -120b, transformers' gpt_oss) against transformers.

gpt-oss's decoder: grouped-query attention with q/k/v/o biases, YaRN RoPE and a learned sink logit
per head in every softmax, layers alternating a sliding window and full attention (layer_types); an
MoE block in every layer: a biased router whose top-k logits are softmaxed, experts with biases and
a clamped GLU (gate <= limit, up in [-limit, limit], (up + 1) * gate * sigmoid(1.702 gate)), stored
fused per layer (gate and up interleaved by column) and, as released, MXFP4-quantized
(transformers' modeling_gpt_oss.py, integrations/mxfp4.py).

Checkpoints (written here, deterministic): transformers' GptOssForCausalLM at hidden 64, 4 heads of
16 (2 KV heads), 4 layers sliding (window 4: every prompt is longer) / full alternating, 8 experts of
F 32 top-4, YaRN (factor 4 over 64 positions, truncate false), random biases and sinks, swiglu_limit
1.0 so the clamps act. Layouts:
    fp32   transformers' save_pretrained (fused experts, fp32);
    bf16   the same model saved in bf16 (the reference: transformers reading that file in fp32);
    mxfp4  the released layout (gate_up_proj_blocks / _scales, down_proj_blocks / _scales, bf16 biases,
           quantization_config mxfp4) written by this file's own quantizer (no code shared with
           tiered's reader); the reference: the model with its experts replaced by the values this
           quantizer meant, which transformers' own MXFP4 loader reproduces (checked).
Checked: the config and parameter count, prefill logits (model code alone; the engine with experts
in RAM, on disk behind a 3-slot cache, in CPU RAM behind the host stand-in accelerator), step-by-step
decode past the window through the CPU decode step's torch-op and native forms (the native step runs
gpt-oss's attention, router and experts itself: sinks merged across split keys, windows per layer,
biased clamped-GLU experts), greedy tokens, that each feature changes the logits, and damaged MXFP4 files; the
default CPU engine's mxfp4 experts (the e2m1 codes as stored, bit for bit the MXFP4 weights; int8-g32
where the kernels are not built), behind the host stand-in accelerator too, --weights int4.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from fixtures import local_model, packed_prefill_gaps  # noqa: E402
from runtime_fixtures import GREEDY, REL_TOL, decode_logits, engine_config, prompt, rel_err, stored_elements  # noqa: E402

from tiered import LLM, EngineConfig, SamplingParams, kernels  # noqa: E402
from tiered.checkpoint import open_checkpoint  # noqa: E402
from tiered.checkpoint.model_config import ModelConfig  # noqa: E402
from tiered.errors import CheckpointError  # noqa: E402
from tiered.memory import sizes  # noqa: E402
from tiered.models import build_model  # noqa: E402
from tiered.models.layers import KVCache  # noqa: E402
from tiered.models.moe import LocalExperts, moe_blocks  # noqa: E402
from tiered.planner.placement import CPU, DISK, FAST  # noqa: E402
from tiered.runtime.cpu_decode import CPUDecodeStep  # noqa: E402

VOCAB = 256
WINDOW = 4
LAYOUTS = ("fp32", "bf16", "mxfp4")
native_only = pytest.mark.skipif(not kernels.available(), reason="tiered/kernels is not built")
CONFIG = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
              num_local_experts=8, num_experts_per_tok=4, num_hidden_layers=4, vocab_size=VOCAB,
              sliding_window=WINDOW, max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-5,
              swiglu_limit=1.0, bos_token_id=0, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})


# ----------------------------------------------------------------------------- the test's own MXFP4
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # magnitudes of codes 0..7; bit 3 = sign


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w fp32 [..., R, K] (K % 32 == 0) -> (blocks uint8 [..., R, K/32, 16], scales uint8 [..., R, K/32],
    the values they encode fp32 [..., R, K]): per group of 32 the smallest power of two 2^x with
    max|w| / 2^x <= 6, each weight the nearest e2m1 value times it; byte j holds elements 2j (low
    nibble) and 2j + 1 (high)."""
    *lead, K = w.shape
    g = w.reshape(*lead, K // 32, 32)
    amax = g.abs().amax(-1).clamp(min=2.0 ** -120)
    x = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # (..., G)
    q = g / torch.exp2(x)[..., None]
    mag = (q.abs()[..., None] - E2M1).abs().argmin(-1)  # (..., G, 32): nearest magnitude
    code = mag | ((q < 0).long() << 3)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)  # (..., G, 16)
    values = (torch.where(q < 0, -1.0, 1.0) * E2M1[mag] * torch.exp2(x)[..., None]).reshape(*lead, K)
    return blocks, (x + 127).to(torch.uint8), values


# ------------------------------------------------------------------------------------ checkpoints
def build_hf(changes: dict | None = None):
    """transformers' tiny GptOssForCausalLM (fp32, eval): seeded weights, random biases, sinks, norms."""
    import transformers

    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**CONFIG, **(changes or {})})).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.3 * torch.randn_like(p))
    return model


def write_mxfp4(model, path: Path) -> None:
    """Save `model` in the released layout; its experts' weights become the values MXFP4 encodes, their
    biases bf16 (as released: the model's become their bf16 values)."""
    model.save_pretrained(path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias"))]:
        tensors[key] = tensors[key].to(torch.bfloat16)
        with torch.no_grad():
            model.get_parameter(key).copy_(tensors[key].float())
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(key).transpose(1, 2).contiguous()  # (E, out, in): nn.Linear's layout
        blocks, scales, values = quantize_mxfp4(w)
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
        with torch.no_grad():
            model.get_parameter(key).copy_(values.transpose(1, 2))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg))


class Zoo:
    """The checkpoints of every layout, their transformers references, cached per session."""

    def __init__(self, root: Path) -> None:
        self.root, self._dirs, self._hf, self._engines = root, {}, {}, {}

    def dir(self, layout: str) -> Path:
        if layout not in self._dirs:
            path, model = self.root / layout, build_hf()
            if layout == "mxfp4":
                write_mxfp4(model, path)
                self._hf[layout] = model  # its experts are the MXFP4 values now
            else:
                (model.to(torch.bfloat16) if layout == "bf16" else model).save_pretrained(path)
            self._dirs[layout] = path
        return self._dirs[layout]

    def hf(self, layout: str):
        from transformers import AutoModelForCausalLM

        path = self.dir(layout)
        if layout not in self._hf:
            self._hf[layout] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                    attn_implementation="eager").eval()
        return self._hf[layout]

    def logits(self, layout: str, ids: list[int]) -> torch.Tensor:
        """transformers' fp32 logits [T, V] of one prompt."""
        with torch.no_grad():
            return self.hf(layout)(torch.tensor([ids])).logits[0].float()

    def engine(self, layout: str, **kw) -> LLM:
        key = (layout, tuple(sorted(kw.items())))
        if key not in self._engines:
            self._engines[key] = LLM(self.dir(layout), engine_config(**{"accelerator": "none", **kw}))
        return self._engines[key]

    def close(self) -> None:
        for llm in self._engines.values():
            llm.close()
        self._engines.clear()


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    z = Zoo(tmp_path_factory.mktemp("gpt_oss"))
    yield z
    z.close()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    t = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def model_logits(model, ids: list[int]) -> torch.Tensor:
    cache = KVCache(model.config, 1, len(ids), torch.float32)
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([0]), cache, last_only=False)[0]


def fast_bytes(path: Path, cache_slots: int, accelerator: bool) -> int:
    """A fast-tier budget that holds the non-expert weights, one 32-token sequence's KV cache, the RoPE
    tables, 2 staging buffers and `cache_slots` cache slots, no resident expert (fp32; behind an
    accelerator a 512-token step's activation workspace, in RAM a 32-token one's): counted from the files' headers
    and the config."""
    cfg = open_checkpoint(path).config
    nonexpert = 4 * stored_elements(path, lambda n: ".experts." not in n)
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 32 * cfg.head_dim * 4
    extra = sizes.workspace_bytes(cfg, "fp32", None if accelerator else 32)
    return nonexpert + kv + 2 * 32 * cfg.head_dim * 4 + extra + (2 + cache_slots) * sizes.expert_bytes(cfg, "fp32")


# ---------------------------------------------------------------------------------------- config
def test_model_config(zoo):
    cfg = open_checkpoint(zoo.dir("fp32")).config
    expect = dict(model_type="gpt_oss", num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32, head_dim=16,
                  attention_bias=True, o_proj_bias=True, attention_sinks=True, expert_bias=True, swiglu_limit=1.0,
                  swiglu_alpha=1.702, norm_topk_prob=True, sliding_window=None, local_window=WINDOW,
                  local_layers=(0, 2), rms_norm_eps=1e-5, rope_theta=150000.0)
    for k, v in expect.items():
        assert getattr(cfg, k) == v, k
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    assert [cfg.window_of(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert all(cfg.is_moe_layer(i) for i in range(4))
    hf = zoo.hf("fp32")
    assert cfg.num_parameters() == sum(t.numel() for t in hf.state_dict().values())
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())
    D, F = 64, 32  # an expert: its weights and biases, as every tier holds it (bias column, zeros to 32s)
    Db, Fb = 96, 64
    assert cfg.expert_shapes() == ((F, Db), (F, Db), (D, Fb))
    assert sizes.expert_bytes(cfg, "fp32") == 4 * (2 * F * Db + D * Fb)
    assert sizes.expert_bytes(cfg, "bf16") == 2 * (2 * F * Db + D * Fb)
    # int8-g32: codes and fp16 scales per 32 inputs, each segment 64-byte aligned (2 * 3072 + 192 + 2 * 4096 + 256)
    assert sizes.expert_bytes(cfg, "int8-g32") == 2 * (F * Db + F * Db // 16) + D * Fb + D * Fb // 16
    assert sizes.expert_bytes(cfg, "int4") < sizes.expert_bytes(cfg, "int8-g32")  # int4 holds K % 32 == 0
    with torch.device("meta"):  # what the planner counts for the non-expert weights is the model's
        model = build_model(cfg, 8)
    nonexpert = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    assert sizes.weight_bytes(cfg, "fp32", sizes.skip_params(cfg)) == 4 * nonexpert
    assert nonexpert + 4 * 8 * (3 * D * F + 2 * F + D) == cfg.num_parameters()


def test_parameter_counts_without_experts_equal_the_whole_tree(zoo):
    """memory/sizes counts gpt-oss's expert parameters (biased widths) from one GptOssExpert: the whole tree's."""
    from test_sizes import assert_counts_without_experts_equal_the_whole_tree

    assert_counts_without_experts_equal_the_whole_tree(zoo.dir("fp32"))


def test_config_as_released(zoo):
    """The released config.json layout (transformers 4.x: rope_scaling and rope_theta at the top level,
    no swiglu_alpha, experts_per_token, quantization_config) reads as transformers 5's does; missing
    fields take GptOssConfig's defaults; malformed ones are refused."""
    hf = json.loads((zoo.dir("fp32") / "config.json").read_text())
    rope = dict(hf.pop("rope_parameters"))
    theta = rope.pop("rope_theta")
    released = dict(hf, rope_theta=theta, rope_scaling=rope, experts_per_token=4,
                    quantization_config={"quant_method": "mxfp4"})
    del released["swiglu_alpha"]
    as_saved = {**hf, "rope_parameters": {**rope, "rope_theta": theta}}
    assert ModelConfig.from_hf(released) == ModelConfig.from_hf(as_saved)
    bare = {k: v for k, v in released.items() if k not in ("rope_theta", "rope_scaling", "layer_types",
                                                             "sliding_window", "swiglu_limit", "head_dim")}
    cfg = ModelConfig.from_hf(bare)
    assert cfg.rope_theta == 150000.0 and cfg.rope_scaling == {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}
    assert cfg.local_window == 128 and cfg.local_layers == (0, 2) and cfg.swiglu_limit == 7.0 and cfg.head_dim == 64
    for bad in (dict(layer_types=["sliding_attention"]), dict(layer_types=["full_attention", "chunked"] * 2),
                dict(swiglu_limit=-1), dict(swiglu_alpha="x")):
        with pytest.raises(CheckpointError):
            ModelConfig.from_hf({**released, **bad})
    full = ModelConfig.from_hf(dict(released, layer_types=["full_attention"] * 4))
    assert full.local_window is None and full.local_layers == ()


def test_mxfp4_dequantization_equals_transformers():
    """checkpoint/gpt_oss.dequantize_mxfp4 equals transformers' convert_moe_packed_tensors (before its
    transpose) on random bytes and scales, and this file's quantizer encodes what it means."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tiered.checkpoint.gpt_oss import dequantize_mxfp4

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 6, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (3, 6, 2), dtype=torch.uint8, generator=g)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # (E, R, K)
    got = dequantize_mxfp4(blocks.reshape(18, 2, 16), scales.reshape(18, 2)).reshape(3, 6, 64)
    assert torch.equal(got, ref)
    w = torch.randn(5, 64, generator=g)
    b, s, values = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(b, s), values)
    assert float((values - w).abs().max()) <= 0.25 * float(w.abs().max())


def test_mxfp4_writer_equals_transformers_loader(zoo):
    """transformers' own MXFP4 loader (dequantizing on the CPU) reads this file's MXFP4 checkpoint as
    the model whose experts are the encoded values: the reference the mxfp4 tests use."""
    from transformers import AutoModelForCausalLM

    try:
        loaded = AutoModelForCausalLM.from_pretrained(zoo.dir("mxfp4"), dtype=torch.float32,
                                                      attn_implementation="eager").eval()
    except Exception as e:  # noqa: BLE001 (an optional cross-check: transformers' loader needs its extras)
        pytest.skip(f"transformers cannot load MXFP4 here ({type(e).__name__}: {e})")
    ids = prompt()
    with torch.no_grad():
        got = loaded(torch.tensor([ids])).logits[0].float()
    assert rel_err(got, zoo.logits("mxfp4", ids)) <= 1e-2  # (its loader may round the experts to bf16)


# ---------------------------------------------------------------------------------- prefill parity

def test_packed_prompts_attend_to_their_own_slots(zoo):
    """Prompts packed into one row give each one's logits alone and leave each slot its own KV
    (fixtures.packed_prefill_gaps): every segment's softmax takes the sinks, and the sliding layers' window
    (WINDOW) is shorter than the prompts."""
    prefill, decode = packed_prefill_gaps(local_model(zoo.dir("fp32")), VOCAB)
    assert prefill <= 1e-5 and decode <= 1e-5, (prefill, decode)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_local_model_equals_transformers(zoo, layout):
    """The model code alone (LocalExperts, every weight resident): a 16-token prompt (4 windows)."""
    model = local_model(zoo.dir(layout))
    assert all(type(b.runner) is LocalExperts for b in moe_blocks(model))
    assert {n for n, _ in model.named_parameters()} == set(open_checkpoint(zoo.dir(layout)).names())
    ids = prompt()
    assert rel_err(model_logits(model, ids), zoo.logits(layout, ids)) <= REL_TOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_logits_and_greedy_equal_transformers(zoo, layout):
    """The lossless engine (experts in RAM, its expert runtime): prompt logits and 16 greedy tokens."""
    llm = zoo.engine(layout)
    assert llm.experts.placement.count(FAST) == len(llm.experts.placement.tiers) == 32
    ids = prompt()
    assert rel_err(llm.logits(ids), zoo.logits(layout, ids)) <= REL_TOL
    out = llm.generate([ids], GREEDY)[0].token_ids
    assert out == hf_greedy(zoo.hf(layout), ids, 16) and len(set(out)) > 2


@pytest.mark.parametrize("layout", ["fp32", "mxfp4"])
def test_experts_on_disk_small_cache(zoo, layout, tmp_path):
    """No accelerator, RAM for the non-expert weights and a 3-slot expert cache: every expert is read
    from disk (a converted copy in the offload directory: fused experts are not readable in place),
    the logits and greedy tokens stay transformers'."""
    path = zoo.dir(layout)
    llm = LLM(path, engine_config(accelerator="none", cpu_memory=fast_bytes(path, 3, False), expert_cache_slots=3,
                                  offload_dir=str(tmp_path / "offload")))
    try:
        assert llm.experts.placement.count(DISK) == 32
        ids = prompt()
        assert rel_err(llm.logits(ids), zoo.logits(layout, ids)) <= REL_TOL
        assert llm.generate([ids], GREEDY)[0].token_ids == hf_greedy(zoo.hf(layout), ids, 16)
        assert llm.experts.bytes_read > 0 and llm.experts.cache.stats.evictions > 0
        assert llm.cpu_budget.peak <= llm.cpu_budget.capacity
    finally:
        llm.close()


def test_prefetch_predicts_with_the_routers_biases(zoo, tmp_path):
    """HOBBIT's stacked next-layer routers (runtime/prefetch.StackedGates) include gpt-oss's router biases:
    without norm folding each target layer's predicted routing of x is that router's own routing (the
    weights alone had missed the bias, which moves its top-k); an engine prefetching experts from disk
    keeps transformers' greedy tokens."""
    from tiered.runtime.prefetch import StackedGates

    model = local_model(zoo.dir("fp32"))
    blocks = moe_blocks(model)
    gates = StackedGates(model, lookahead=2, fold_norms=False)
    x = torch.randn(7, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    preds = gates.predict(blocks[0].layer_idx, x)
    assert [t for t, _, _ in preds] == [b.layer_idx for b in blocks[1:3]]
    for (t, idx, w), b in zip(preds, blocks[1:3]):
        assert b.gate.bias.abs().max() > 0
        want_idx, want_w = b.gate.select(torch.nn.functional.linear(x, b.gate.weight, b.gate.bias))
        assert torch.equal(idx, want_idx) and torch.allclose(w, want_w)
    path = zoo.dir("fp32")
    llm = LLM(path, engine_config(accelerator="none", cpu_memory=fast_bytes(path, 3, False), expert_cache_slots=3,
                                  offload_dir=str(tmp_path / "offload"), prefetch=True, prefetch_lookahead=1))
    try:
        assert llm.experts.prefetcher is not None
        ids = prompt()
        assert llm.generate([ids], GREEDY)[0].token_ids == hf_greedy(zoo.hf("fp32"), ids, 16)
    finally:
        llm.close()


def test_prefetch_with_biased_routers_behind_the_host_stand_in(zoo):
    """The stacked routers and their biases live on the routers' device: behind the strict host stand-in
    (its device refuses tensors made outside its scope) a prefetching engine predicts with them and keeps
    transformers' greedy tokens."""
    path = zoo.dir("fp32")
    llm = LLM(path, engine_config(accelerator="host", gpu_memory=fast_bytes(path, 2, True), cpu_memory="64MiB",
                                  expert_cache_slots=2, prefetch=True, prefetch_lookahead=1))
    try:
        gates = llm.experts.prefetcher.gates
        assert gates.biases and all(b.device == llm.device for b in gates.biases.values())
        ids = prompt()
        assert llm.generate([ids], GREEDY)[0].token_ids == hf_greedy(zoo.hf("fp32"), ids, 16)
    finally:
        llm.close()


@native_only
@pytest.mark.parametrize("where", ["device", "copies"])
def test_mxfp4_experts_behind_host_accelerator(zoo, where, monkeypatch):
    """The MXFP4 checkpoint behind the host stand-in accelerator (bf16 compute): experts held as mxfp4,
    all resident on the device ("device") or in CPU RAM behind a 2-slot device cache ("copies": a fast
    budget of the bf16 non-expert weights, KV cache, workspace and 4 mxfp4 experts; every miss copied,
    force_expert_path "copy": which side the dispatcher picks depends on the machine's timings), computed
    on the device by torch ops (quant/mxfp4.dequantize: the e2m1 table applied there, as a GPU does after
    its copy). On the device the weights are the int8-g32 form's bit for bit, so the logits equal that
    engine's exactly; with copies within 2e-2 of them; the same next tokens as transformers either way (whose logits
    this bf16 accelerator path, of either kind, keeps within ~0.15 on this tiny random model)."""
    path = zoo.dir("mxfp4")
    cfg = open_checkpoint(path).config
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 32 * cfg.head_dim * 2
    fixed = (2 * stored_elements(path, lambda n: ".experts." not in n) + kv + 2 * 32 * cfg.head_dim * 4
             + sizes.workspace_bytes(cfg, "bf16"))
    ids = prompt()
    logits = {}
    for kind in ("mxfp4", "int8-g32"):
        if kind == "int8-g32":  # stored_kind without the kernels: MXFP4 as int8-g32
            monkeypatch.setattr("tiered.quant.gguf_experts.load", lambda: None)
        gpu = fast_bytes(path, 2, True) if where == "device" else fixed + 4 * sizes.expert_bytes(cfg, kind)
        llm = LLM(path, EngineConfig(accelerator="host", dtype="bfloat16", max_context=32, cpu_memory="64MiB",
                                     gpu_memory=gpu, expert_cache_slots=2,
                                     force_expert_path="copy" if where == "copies" else None))
        try:
            assert llm.experts.store.fmt.name == kind
            assert llm.experts.placement.count(FAST if where == "device" else CPU) == 32, llm.experts.placement
            logits[kind] = llm.logits(ids)
            if kind == "mxfp4":
                assert len(llm.generate([ids], GREEDY)[0].token_ids) == 16
                if where == "copies":
                    assert llm.experts.path_counts["copy"] > 0 and not llm.experts.path_counts["cpu"], \
                        llm.experts.path_counts
        finally:
            llm.close()
    got, ref = logits["mxfp4"], zoo.logits("mxfp4", ids)
    if where == "device":
        assert torch.equal(got, logits["int8-g32"])
    else:
        assert rel_err(got, logits["int8-g32"]) <= 2e-2
    assert torch.equal(got.argmax(-1), ref.argmax(-1)) and rel_err(got, ref) <= 0.15


def test_experts_in_cpu_ram_behind_host_accelerator(zoo):
    """The accelerator's path (the host stand-in) holds the non-expert weights and a 2-slot cache, the
    experts live in CPU RAM and go through the dispatcher (copies or CPU compute; no grouped or split
    path, which compute SwiGLU): logits and greedy tokens stay transformers'."""
    path = zoo.dir("fp32")
    llm = LLM(path, engine_config(accelerator="host", gpu_memory=fast_bytes(path, 2, True), cpu_memory="64MiB",
                                  expert_cache_slots=2))
    try:
        assert llm.experts.placement.count(CPU) == 32 and not llm.experts.grouped
        ids = prompt()
        assert rel_err(llm.logits(ids), zoo.logits("fp32", ids)) <= REL_TOL
        assert llm.generate([ids], GREEDY)[0].token_ids == hf_greedy(zoo.hf("fp32"), ids, 16)
        assert llm.experts.path_counts["copy"] + llm.experts.path_counts["cpu"] > 0
    finally:
        llm.close()


# ----------------------------------------------------------------------------------- decode parity
@pytest.mark.parametrize("native", [False, pytest.param(True, marks=native_only)], ids=["torch_ops", "native"])
@pytest.mark.parametrize("layout", ["fp32", "mxfp4"])
def test_decode_steps_equal_transformers(zoo, layout, native):
    """Lossless fp32: a 3-token prompt, then 17 tokens fed one a step (past the window) through the CPU
    decode step: each step's logits equal transformers' at that position. The torch-op step runs gpt-oss's
    layers as their modules; the native one runs their attention (sinks, the sliding layers' windows:
    DecodeStep.set_attention) and the MoE block as its module (the lossless mode's fp32 experts)."""
    llm = zoo.engine(layout)
    step = CPUDecodeStep(llm.model, native=native)
    if native:
        assert step.schedule == step.fallback == [("attn", i) for i in range(4)]
        assert llm.plan.native_decode and llm.runtime.cpu_decode.native is not None
    ids = prompt(20, seed=4)
    assert rel_err(decode_logits(llm, step, ids, 3), zoo.logits(layout, ids)[3:]) <= REL_TOL


@native_only
def test_native_sink_attention_split_over_threads(zoo):
    """Past 256 cached (key, KV head) pairs the native step splits each sequence's keys over the threads
    and merges the parts (split-K); the sinks join the merged denominator: a 140-token prompt, then 10
    decode steps, each within REL_TOL of transformers (full layers read 140+ keys, sliding ones 4)."""
    llm = zoo.engine("fp32", max_context=160)
    step = CPUDecodeStep(llm.model, native=True)
    ids = prompt(150, seed=5)
    assert rel_err(decode_logits(llm, step, ids, 140), zoo.logits("fp32", ids)[140:]) <= REL_TOL


@native_only
@pytest.mark.parametrize("dtype", [None, "bfloat16"], ids=["default", "bfloat16"])
def test_default_engine_runs_the_whole_step_natively(zoo, dtype):
    """The default CPU engine (mxfp4 experts straight from MXFP4, all resident) runs every layer whole
    in the native step: its attention with sinks and windows, the biased router, and the experts' biases
    and clamped GLU (DecodeStep.set_moe's router_bias, swiglu_limit; the experts' projections the tiled
    int4 kernels through the e2m1 table). Its decode logits equal the same engine's step with the MoE
    blocks run as modules (the fallback schedule) within 1e-3 (fp32 activations, the default; bf16:
    1e-2), and transformers' within the quantized experts' tolerance of 2e-2 (fp32); the step counts
    its resident expert uses."""
    llm = LLM(zoo.dir("mxfp4"), EngineConfig(max_context=32, accelerator="none", **({"dtype": dtype} if dtype else {})))
    try:
        assert llm.experts.store.fmt.name == "mxfp4"
        step = llm.runtime.cpu_decode
        assert step.schedule == [("native", 0, 4)] and step.fallback == [("attn", i) for i in range(4)]
        ids = prompt(20, seed=4)
        assert router_gap(zoo.dir("mxfp4"), ids) > 1e-3
        runner = step.moe_blocks[0].runner
        hits = runner.resident_hits
        native = decode_logits(llm, step, ids, 3)
        assert runner.resident_hits - hits >= 17 * 4 * 4  # 17 steps, 4 layers, top-4 distinct experts each
        step.schedule = step.fallback
        try:
            modules = decode_logits(llm, step, ids, 3)
        finally:
            step.schedule = [("native", 0, 4)]
        assert rel_err(native, modules) <= (1e-3 if dtype is None else 1e-2)
        if dtype is None:
            assert rel_err(native, zoo.logits("mxfp4", ids)[3:]) <= 2e-2
    finally:
        llm.close()


def test_batched_generation_equals_transformers(zoo):
    """Prompts of 16 and 9 tokens decoded together: each gets transformers' greedy tokens."""
    a, b = prompt(16, seed=2), prompt(9, seed=3)
    outs = zoo.engine("fp32").generate([a, b], GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(zoo.hf("fp32"), p, 16) for p in (a, b)]


def router_gap(path: Path, ids: list[int]) -> float:
    """The smallest gap between the k-th and (k+1)-th router logit over every layer and token of `ids`
    in the exact fp32 model: below ~1e-4, activations rounded anywhere (int8-g32's int16 ones) may
    flip a token's expert choice, so such a prompt cannot test a lossy mode's tolerance."""
    model, gaps = local_model(path), []
    for block in moe_blocks(model):
        select = block.router.select

        def hooked(logits, select=select, k=block.router.top_k):
            top = logits.topk(k + 1, -1).values  # (N, k + 1)
            gaps.append(float((top[:, k - 1] - top[:, k]).min()))
            return select(logits)
        block.router.select = hooked
    model_logits(model, ids)
    return min(gaps)


def expected_expert(hf, layer: int, e: int) -> list[torch.Tensor]:
    """transformers' expert e of `layer` as tiered holds it: (gate, up, down) fp32 [out, padded in],
    each weight, its bias as column D (F), zeros after it (ModelConfig.expert_shapes)."""
    ex = hf.model.layers[layer].mlp.experts
    gu, gub = ex.gate_up_proj[e].T.float(), ex.gate_up_proj_bias[e].float()  # (2F, D), (2F,)
    dn, dnb = ex.down_proj[e].T.float(), ex.down_proj_bias[e].float()  # (D, F), (D,)
    out = []
    for w, b, width in ((gu[0::2], gub[0::2], 96), (gu[1::2], gub[1::2], 96), (dn, dnb, 64)):
        t = torch.zeros(w.shape[0], width)
        t[:, :w.shape[1]], t[:, w.shape[1]] = w, b
        out.append(t)
    return out


@pytest.mark.parametrize("kind", [pytest.param("mxfp4", marks=native_only), "int8-g32"])
def test_default_engine_holds_mxfp4_experts_exactly(zoo, kind, monkeypatch):
    """EngineConfig() defaults on the CPU over the MXFP4 checkpoint: every expert held as mxfp4 (the
    e2m1 codes as stored; int8-g32 where tiered's kernels are not built, as quant/gguf_experts.stored_kind
    is made to see here) straight from its codes (the plan says mapped exactly, not re-quantized), whose
    dequantized values equal the MXFP4 weights and bf16 biases transformers computes with, bit for bit;
    RAM per expert is sizes.expert_bytes'; prompt logits within the quantized expert tests' 2e-2 of
    transformers' (bf16 KV cache and decode copies, int8 / int16 activations), the same next tokens;
    greedy generation runs."""
    if kind == "int8-g32":
        monkeypatch.setattr("tiered.quant.gguf_experts.load", lambda: None)
    llm = LLM(zoo.dir("mxfp4"), EngineConfig(max_context=32, accelerator="none"))
    try:
        assert llm.plan.dtypes["experts"] == kind and llm.experts.store.fmt.name == kind
        assert any(f"experts stored as {kind}" in n and "mapped exactly" in n for n in llm.plan.notes), llm.plan.notes
        assert not any("re-quantized" in n for n in llm.plan.notes)
        nbytes = sizes.expert_bytes(llm.config, kind)
        assert llm.experts.store.expert_bytes == llm.experts.store.fmt.nbytes == llm.plan.expert_bytes == nbytes
        assert nbytes < (0.35 if kind == "mxfp4" else 0.6) * sizes.expert_bytes(llm.config, "bf16")
        hf, fmt = zoo.hf("mxfp4"), llm.experts.store.fmt
        for layer in range(4):
            for e in range(8):
                slot = llm.experts.store.resident[(layer, e)]
                assert sum(t.numel() * t.element_size() for t in slot) == nbytes
                for got, want in zip(fmt.dequantize(slot), expected_expert(hf, layer, e)):
                    assert torch.equal(got, want), (layer, e)
        ids = prompt(16, seed=4)
        assert router_gap(zoo.dir("mxfp4"), ids) > 1e-3  # no near-tied expert choice the activations could flip
        ref = zoo.logits("mxfp4", ids)
        got = llm.logits(ids)
        assert rel_err(got, ref) <= 2e-2 and torch.equal(got.argmax(-1), ref.argmax(-1))
        assert len(llm.generate([ids], GREEDY)[0].token_ids) == 16
    finally:
        llm.close()


def test_mxfp4_int8_g32_refuses_what_fp16_cannot_hold():
    """checkpoint/gpt_oss.mxfp4_int8_g32: q * scale is the MXFP4 weight bit for bit across the exact
    scale range (2^-23 .. 2^16 per group), an all-zero group takes any scale, a group of non-zero
    codes beyond that range or a bias beyond fp16's is refused (ValueError)."""
    from tiered.checkpoint.gpt_oss import INT8_G32_EXPONENTS, dequantize_mxfp4, mxfp4_int8_g32

    g = torch.Generator().manual_seed(1)
    lo, hi = INT8_G32_EXPONENTS
    blocks = torch.randint(0, 256, (hi - lo + 1, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.arange(lo, hi + 1, dtype=torch.uint8)[:, None].repeat(1, 2)  # every exact exponent
    bias = (torch.randn(hi - lo + 1, generator=g)).to(torch.bfloat16)
    q, s = mxfp4_int8_g32(blocks, scales, bias, 96)
    w = (q.float().reshape(-1, 3, 32) * s.float()[..., None]).reshape(-1, 96)
    assert torch.equal(w[:, :64], dequantize_mxfp4(blocks, scales)) and torch.equal(w[:, 64], bias.float())
    assert not w[:, 65:].any()
    zero = torch.zeros(1, 2, 16, dtype=torch.uint8)
    mxfp4_int8_g32(zero, torch.tensor([[0, 255]], dtype=torch.uint8), bias[:1], 96)  # all-zero groups: fine
    for e in (lo - 1, hi + 1):
        with pytest.raises(ValueError, match="scale"):
            mxfp4_int8_g32(blocks[:1], torch.tensor([[e, 127]], dtype=torch.uint8), bias[:1], 96)
    with pytest.raises(ValueError, match="bias"):
        mxfp4_int8_g32(blocks[:1], scales[:1], torch.tensor([1e5], dtype=torch.bfloat16), 96)


def test_int4_experts_run(zoo):
    """--weights int4 (lossy) holds gpt-oss's experts as int4 (every in-features a multiple of 32: no
    fallback to int8) at sizes.expert_bytes', the plan notes the re-quantization, generation runs and
    the logits stay near transformers'."""
    llm = LLM(zoo.dir("mxfp4"), EngineConfig(max_context=32, accelerator="none", expert_weights="int4",
                                             decode_weights="int4"))
    try:
        assert llm.plan.dtypes["experts"] == "int4" and llm.experts.store.fmt.kinds == ("int4",) * 3
        assert llm.experts.store.expert_bytes == sizes.expert_bytes(llm.config, "int4")
        assert any("re-quantized on load: MXFP4 -> int4" in n for n in llm.plan.notes), llm.plan.notes
        ids = prompt()
        assert rel_err(llm.logits(ids), zoo.logits("mxfp4", ids)) <= 0.5
        assert len(llm.generate([ids], GREEDY)[0].token_ids) == 16
    finally:
        llm.close()


# ------------------------------------------------------------------------- the features are exercised
@pytest.mark.parametrize("change", ["sinks", "window", "clamp", "expert_bias", "router_bias"])
def test_features_are_exercised(zoo, change):
    """Each gpt-oss feature changes the logits, so the parity tests cover it: the sinks (a sink of
    -inf takes no weight), the sliding layers' window, the GLU's clamps, the experts' and router's biases."""
    model = local_model(zoo.dir("fp32"))
    for layer in model.model.layers:
        attn, block = layer.self_attn, layer.mlp
        if change == "sinks":
            attn.sinks.data.fill_(-float("inf"))
        elif change == "window":
            attn.local_window = None
        elif change == "router_bias":
            block.router.bias.data.zero_()
        for e in block.experts:
            if change == "clamp":
                e.limit = 1e4
            elif change == "expert_bias":  # the bias columns, D for gate / up, F for down
                for w, k in zip(e.weights(), (64, 64, 32)):
                    w.data[:, k] = 0
    ids = prompt()
    assert rel_err(model_logits(model, ids), zoo.logits("fp32", ids)) > 1e-3


@pytest.mark.parametrize("T, S, window, dtype", [(37, 37, None, torch.float32), (5, 37, None, torch.float32),
                                                  (37, 37, 4, torch.float32), (20, 20, None, torch.bfloat16)])
def test_sink_attention_on_cpu_flash_equals_eager(monkeypatch, T, S, window, dtype):
    """models/gpt_oss.attend_with_sinks on the CPU (torch's flash attention and its logsumexp, the sink
    applied after) equals the eager softmax with the sink column: a prompt (T = S, causal), a chunk
    after cached positions (T < S: the last T queries), a sliding-window mask, bf16 (to its rounding)."""
    from tiered.models import gpt_oss

    if gpt_oss._FLASH_CPU is None:
        pytest.skip("this torch has no _scaled_dot_product_flash_attention_for_cpu")
    g = torch.Generator().manual_seed(T + S)
    q, k, v = (torch.randn(2, h, n, 64, generator=g).to(dtype) for h, n in ((8, T), (2, S), (2, S)))
    sinks = 2 * torch.randn(8, generator=g)
    mask, causal = None, True
    if window is not None:
        pos, keys = torch.arange(S - T, S), torch.arange(S)
        mask, causal = ((keys <= pos[:, None]) & (keys > pos[:, None] - window))[None, None].expand(2, 1, T, S), False
    got = gpt_oss.attend_with_sinks(q, k, v, mask, causal, 0.125, sinks)
    monkeypatch.setattr(gpt_oss, "_FLASH_CPU", None)
    want = gpt_oss.attend_with_sinks(q, k, v, mask, causal, 0.125, sinks)
    assert got.dtype == want.dtype == dtype
    assert (got.float() - want.float()).abs().max() <= (1e-5 if dtype == torch.float32 else 2e-2)


# ------------------------------------------------------------------------------- damaged checkpoints
@pytest.mark.parametrize("damage", ["no_scales", "blocks_shape", "scales_shape", "no_bias", "no_quant_config"])
def test_damaged_mxfp4_checkpoint_is_refused(zoo, tmp_path, damage):
    """An MXFP4 checkpoint missing an expert tensor, with one of the wrong shape, or whose config.json
    does not say mxfp4 raises CheckpointError when opened, naming the tensor."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / damage
    shutil.copytree(zoo.dir("mxfp4"), d)
    tensors = load_file(str(d / "model.safetensors"))
    key = "model.layers.1.mlp.experts.gate_up_proj"
    if damage == "no_scales":
        del tensors[key + "_scales"]
    elif damage == "blocks_shape":
        tensors[key + "_blocks"] = tensors[key + "_blocks"][:, :, :1].contiguous()
    elif damage == "scales_shape":
        tensors[key + "_scales"] = tensors[key + "_scales"][:4].contiguous()
    elif damage == "no_bias":
        del tensors["model.layers.1.mlp.experts.down_proj_bias"]
    else:
        cfg = json.loads((d / "config.json").read_text())
        del cfg["quantization_config"]
        (d / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="layers.1.mlp.experts|mxfp4"):
        open_checkpoint(d)


def test_tokenizer_json_through_transformers(tmp_path):
    """A checkpoint's tokenizer.json loads through transformers (checkpoint/tokenizer.py): a text prompt
    encodes as transformers' tokenizer encodes it and decodes to transformers' greedy tokens."""
    from fixtures import build_tokenizer

    tok = build_tokenizer()
    model = build_hf({"vocab_size": len(tok)})
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    llm = LLM(tmp_path, engine_config(accelerator="none"))
    try:
        text = "the quick brown fox"
        ids = tok(text)["input_ids"]
        assert llm.encode(text, chat=False) == ids
        out = llm.generate(text, GREEDY, chat=False)[0]
        assert out.token_ids == hf_greedy(model, ids, 16)
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    finally:
        llm.close()


def test_sliding_layers_forgetting_decode_as_a_full_cache(zoo, monkeypatch):
    """gpt-oss's sliding layers (a window of 4 here, beside the sinks) in a cache that forgets behind them
    (Plan.kv_window; tests/test_kv_window.py has the mechanism): 180 greedy tokens after a 20-token prompt, the
    tokens of a cache keeping every position, pages handed back on the way. The tiny cache made lazily committed and
    forgetting every 16 positions, nothing kept behind the window."""
    from tiered.memory import host
    from tiered.models import layers

    monkeypatch.setattr(host, "LAZY_ZEROS_BYTES", 0)
    monkeypatch.setattr(layers, "KV_FORGET_SLACK", 0)
    monkeypatch.setattr(layers, "KV_FORGET_STEP", 16)
    freed: list[int] = []
    release = layers.KVCache._release
    monkeypatch.setattr(layers.KVCache, "_release", lambda self, *a: freed.append(release(self, *a)) or freed[-1])
    ids, sp = prompt(20, seed=5), SamplingParams(temperature=0, max_tokens=180, ignore_eos=True)
    full = LLM(zoo.dir("bf16"), engine_config(accelerator="none", max_context=256, sliding_kv="full"))
    want = full.generate(ids, sp)[0].token_ids
    assert not freed and not full.plan.kv_window
    llm = LLM(zoo.dir("bf16"), engine_config(accelerator="none", max_context=256))
    assert llm.plan.kv_window and llm.generate(ids, sp)[0].token_ids == want and sum(freed) > 0
