"""tiered.bench: dummy checkpoints, decode-speed arithmetic, reports and peak memory."""

from __future__ import annotations

import json

import pytest
import torch

from tiered.bench import (Column, ModelShape, PeakMemory, decode_tokens_per_s, llama3_8b, markdown_table,
                          mixtral_8x7b, write_dummy_checkpoint, write_report)

TINY_MOE = ModelShape(layers=2, hidden=64, ffn=96, heads=4, kv_heads=2, vocab=128, experts=8)
TINY_DENSE = ModelShape(layers=2, hidden=64, ffn=96, heads=4, kv_heads=2, vocab=128)


def test_real_shapes_have_the_sizes_of_the_h200_run():
    # shared/gpu-runs/2026-11-22-h200/README.md: 336 MiB experts, 11.3 GiB MoE, 3.7 GiB dense
    assert mixtral_8x7b(4).expert_params() * 2 == 336 * 2**20
    assert round(mixtral_8x7b(4).params() * 2 / 2**30, 1) == 11.3
    assert round(llama3_8b(8).params() * 2 / 2**30, 1) == 3.7


@pytest.mark.parametrize("shape", [TINY_MOE, TINY_DENSE], ids=["moe", "dense"])
def test_dummy_checkpoint_is_what_safetensors_and_transformers_read(tmp_path, shape):
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    path = write_dummy_checkpoint(tmp_path / "ck", shape)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    total = 0
    for file in sorted(set(index.values())):
        tensors = load_file(path / file)
        assert {k for k, f in index.items() if f == file} == set(tensors)
        assert all(t.dtype == torch.bfloat16 for t in tensors.values())
        total += sum(t.numel() for t in tensors.values())
        save_file(tensors, tmp_path / "ref.safetensors")  # the streamed file is safetensors' own bytes
        assert (path / file).read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert total == shape.params()
    cfg = AutoConfig.from_pretrained(path)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == \
        (shape.hidden, shape.ffn, shape.layers, shape.kv_heads)
    assert getattr(cfg, "num_local_experts", 0) == shape.experts


def test_dummy_checkpoint_is_deterministic_and_reused(tmp_path):
    a = write_dummy_checkpoint(tmp_path / "a", TINY_MOE)
    b = write_dummy_checkpoint(tmp_path / "b", TINY_MOE)
    assert (a / "layer001.safetensors").read_bytes() == (b / "layer001.safetensors").read_bytes()
    mtime = (a / "layer001.safetensors").stat().st_mtime_ns
    write_dummy_checkpoint(a, TINY_MOE)
    assert (a / "layer001.safetensors").stat().st_mtime_ns == mtime



def test_uniform_routing_spreads_the_tokens_and_skewed_stays_as_it_was(tmp_path):
    """ModelShape.routing: the skewed default keeps its config.json (earlier directories are reused) and
    sends a layer's prompt tokens to a few experts; "uniform" says so in config.json (never reused for the
    other), leaves the tensors' shapes and every non-routing draw alone, and spreads a 256-token prompt's
    routing over all 8 experts of every layer, as the plans' i.i.d. pricing assumes."""
    import dataclasses

    import numpy as np
    from safetensors.torch import load_file

    from tiered import LLM, EngineConfig
    from tiered.runtime.expert_profile import ExpertProfiler

    shape = ModelShape(layers=3, hidden=256, ffn=128, heads=4, kv_heads=2, vocab=2048, experts=8)
    uniform = dataclasses.replace(shape, routing="uniform")
    assert "tiered_dummy_routing" not in shape.config_json()
    assert uniform.config_json()["tiered_dummy_routing"] == "uniform"
    with pytest.raises(ValueError, match="routing"):
        dataclasses.replace(shape, routing="zipf")
    shares = {}
    for s in (shape, uniform):
        path = write_dummy_checkpoint(tmp_path / s.routing, s)
        llm = LLM(str(path), EngineConfig(accelerator="none", max_context=512))
        prof = ExpertProfiler.attach(llm.model, llm.config)
        llm.logits(torch.randint(3, s.vocab, (256,), generator=torch.Generator().manual_seed(0)).tolist())
        shares[s.routing] = prof.tokens / prof.tokens.sum(1, keepdims=True)  # [L, E]
    top2 = np.sort(shares["skewed"], 1)[:, -2:].sum(1)
    assert (top2 > 0.9).all(), shares["skewed"]
    assert (shares["uniform"] > 0.04).all() and (shares["uniform"] < 0.25).all(), shares["uniform"]
    a, b = (load_file(tmp_path / r / "layer001.safetensors") for r in ("skewed", "uniform"))
    assert all(torch.equal(a[k], b[k]) for k in a if ".gate." not in k)  # the experts and attention: the same draws

def test_decode_speed_excludes_the_first_token():
    assert decode_tokens_per_s([10.0, 10.5, 11.0, 11.5]) == pytest.approx(3 / 1.5)
    with pytest.raises(ValueError):
        decode_tokens_per_s([1.0])


def test_report_rows_with_errors_and_missing_values(tmp_path):
    rows = [{"config": "a", "tok_s": 12.345}, {"config": "b", "tok_s": None},
            {"config": "c", "error": "BudgetError: too | small"}]
    cols = [Column("configuration", "config"), Column("tok/s", "tok_s", "{:.1f}"), Column("x", "x")]
    table = markdown_table(rows, cols).splitlines()
    assert table[2] == "| a | 12.3 | – |" and table[3] == "| b | – | – |"
    assert table[4] == "| c | BudgetError: too / small |  |"
    j, m = write_report("t", tmp_path, title="T", settings={"n": 1}, rows=rows, columns=cols, machine={
        "cpu": "x", "cores": 1, "cpu_flags": [], "ram_bytes": None, "gpus": [], "versions": {"torch": "t",
                                                                                              "transformers": "y"},
        "git": {"commit": None, "dirty": None}})
    doc = json.loads(j.read_text())
    assert doc["benchmark"] == "t" and doc["rows"][2]["error"].startswith("BudgetError") and doc["settings"] == {"n": 1}
    assert "| a | 12.3 | – |" in m.read_text()


def test_peak_memory_sees_a_block_allocation():
    with PeakMemory(cuda=False) as peak:
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        del x
    assert peak.gpu_bytes is None
    assert peak.rss_bytes >= 64 * 2**20
