"""memory/sizes.py, the one byte count of the planner and the engine, against counts it does not
make itself: the checkpoint files' own headers and the tensors the engine really allocates."""

from __future__ import annotations

import pytest
import torch

from runtime_fixtures import MOE_KINDS, engine_config, kv_bytes, rt, stored_elements  # noqa: F401

from tiered import LLM
from tiered.checkpoint import open_checkpoint
from tiered.memory import sizes
from tiered.models.layers import KVCache


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_non_expert_and_expert_bytes_match_the_files_and_the_engine(rt, kind):  # noqa: F811
    cfg = open_checkpoint(rt.dir(kind)).config
    stored = stored_elements(rt.dir(kind), lambda n: ".experts." not in n)
    routers = stored_elements(rt.dir(kind), lambda n: sizes.kept_fp32(cfg, n))  # DeepSeek's stay fp32
    assert sizes.weight_bytes(cfg, "fp32", sizes.is_expert_param) == 4 * stored
    assert sizes.weight_bytes(cfg, "bf16", sizes.is_expert_param) == 2 * (stored - routers) + 4 * routers
    first = min(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    one = stored_elements(rt.dir(kind), lambda n: n.startswith(f"model.layers.{first}.") and ".experts.0." in n)
    assert sizes.expert_bytes(cfg, "fp32") == 4 * one
    llm = LLM(rt.dir(kind), engine_config(accelerator="none"))
    try:
        real = sum(p.numel() * p.element_size() for n, p in llm.model.named_parameters() if not p.is_meta)
        assert llm.weight_bytes == real == sizes.weight_bytes(cfg, "fp32", sizes.is_expert_param)
    finally:
        llm.close()


@pytest.mark.parametrize("fmt,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_kv_cache_bytes_match_an_allocated_cache(rt, fmt, dtype):  # noqa: F811
    cfg = open_checkpoint(rt.dir("mixtral")).config
    assert sizes.kv_cache_bytes(cfg, 3, 17, fmt) == KVCache(cfg, 3, 17, dtype).nbytes
    assert sizes.kv_cache_bytes(cfg, 1, 32, "fp32") == kv_bytes(cfg, 32)


def test_int4_counts_its_group_scales():
    assert sizes.bytes_per_element("int4") == pytest.approx(0.625)  # tiered's group 32
    assert sizes.bytes_per_element("int4", 64) == pytest.approx(0.5625)  # FlexGen's group 64


@pytest.mark.parametrize("name,qtype,config", [
    ("llama_tied", "Q8_0", dict(decode_weights="auto")),  # one copy: the Q8_0 embedding in its blocks, the tied head's int8 copy
    ("llama_tied", "Q4_0", dict(decode_weights="int4")),  # one copy: int4 layers and head
    ("llama_tied", "Q4_0", dict(decode_weights="int8")),  # one copy: int8-g32 layers and head (per row without kernels)
    ("llama", "Q4_0", dict(decode_weights="int4", dtype="bfloat16")),  # bf16 weights and int4 copies beside them
    ("llama_tied", "Q4_0", dict(decode_weights="bf16", dtype="float32")),  # fp32 weights and bf16 copies beside them
])
def test_cpu_plan_counts_what_the_engine_holds(zoo, name, qtype, config):
    """The CPU plan's RAM (plan.memory["cpu"]) is what the engine reserves for its weights and decode
    copies plus the KV cache it reserves at the first generate: before, the planner left out the tied
    lm_head's decode copy and, with the dense weights kept, every decode copy (a budget the plan
    accepted then failed at load), and counted a GGUF file's block-quantized embedding dense."""
    from tiered import EngineConfig

    path = zoo.gguf(name, qtype)
    llm = LLM(path, EngineConfig(accelerator="none", max_context=64, **config))
    try:
        plan = llm.plan
        assert plan.dense_copies == ("dtype" in config)
        kv = sizes.kv_cache_bytes(llm.config, plan.kv_slots, plan.context_tokens, plan.dtypes["kv_cache"])
        held = llm.cpu_budget.used + kv
        assert llm.decode_weight_bytes > 0
        # per-row int8 scales (4 bytes a row) are the planner's only omission
        rows = sum(m.out_features for m in llm.model.modules() if isinstance(m, torch.nn.Linear) or hasattr(m, "out_features"))
        assert held <= plan.memory["cpu"] + 4 * rows
        assert plan.memory["cpu"] <= held * 1.001
    finally:
        llm.close()


def assert_counts_without_experts_equal_the_whole_tree(path):
    """sizes' parameter counts of `path`'s config (its tree built without experts, they counted from one)
    against the whole tree's named_parameters; the engine's model without expert modules, every MoE block
    served by its expert runtime; a block built without experts and left without a runner saying so."""
    from tiered.models import build_model
    from tiered.models.moe import moe_blocks

    cfg = open_checkpoint(path).config
    sizes._TREES.clear()
    with torch.device("meta"):
        whole = build_model(cfg, 1)
        bare = build_model(cfg, 1, experts=False)
    tied = cfg.tie_word_embeddings
    assert dict(sizes._param_counts(cfg)) == {n: p.numel() for n, p in whole.named_parameters()
                                              if not (tied and n == "lm_head.weight")}
    assert sum(".experts." in n for n, _ in sizes._param_counts(cfg)) == \
        sum(".experts." in n for n, _ in whole.named_parameters()) > 0
    block = moe_blocks(bare)[0]
    with pytest.raises(RuntimeError, match="built without its experts"):
        block.runner(block.layer_idx, torch.zeros(1, cfg.hidden_size), torch.zeros(1, 1, dtype=torch.long),
                     torch.ones(1, 1), block)
    llm = LLM(path, engine_config(accelerator="none"))
    try:
        blocks = moe_blocks(llm.model)
        assert blocks and all(len(b.experts) == 0 and b.runner is llm.runtime.experts for b in blocks)
    finally:
        llm.close()


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_parameter_counts_of_a_tree_without_experts_equal_the_whole_tree(rt, kind):  # noqa: F811
    """sizes builds MoE trees without their experts' modules (build_model(experts=False)) and counts those
    parameters from one expert (models/moe.expert_module): the same names and elements as the whole tree's
    named_parameters (tests/test_gpt_oss.py checks gpt-oss's)."""
    assert_counts_without_experts_equal_the_whole_tree(rt.dir(kind))
