"""HOBBIT mixed-precision experts (runtime/precision.py, the runner's low pool): the Eq. 2 scores
and thresholds as a pure function, then the engine's loads at each precision on a tiny MoE."""

from __future__ import annotations

import pytest
import torch

from runtime_fixtures import GREEDY, prompt, rt  # noqa: F401  (rt: shared checkpoints)
from tiered import LLM, EngineConfig
from tiered.checkpoint import open_checkpoint
from tiered.errors import ConfigError
from tiered.memory import sizes
from tiered.runtime.precision import HIGH, LOW, SKIP, MixedPrecision


def test_unimportance_score_and_thresholds():
    m = MixedPrecision("bf16", "int4", 0.6, 0.9)
    w = torch.tensor([[0.5, 0.5], [0.7, 0.3], [0.95, 0.05], [0.3, 0.7], [0.35, 0.15]])
    # s of the second expert = the top-1's normalised weight: 0.5 high, 0.7 low, 0.95 skip;
    # slots in any order; weights that do not sum to 1 (norm_topk_prob False) are normalised first
    assert m.slot_precisions(w).tolist() == [[HIGH, HIGH], [HIGH, LOW], [HIGH, SKIP], [LOW, HIGH], [HIGH, LOW]]
    top4 = torch.tensor([[0.4, 0.3, 0.2, 0.1]])  # s = 0, 0.4, 0.7, 0.9
    assert m.slot_precisions(top4).tolist() == [[HIGH, HIGH, LOW, LOW]]
    assert MixedPrecision("bf16", "int4", 0.0, 0.0).slot_precisions(top4).tolist() == [[HIGH, SKIP, SKIP, SKIP]]
    idx = torch.tensor([[0, 1], [2, 1], [3, 0]])
    needs = m.expert_needs(idx, torch.tensor([[0.7, 0.3], [0.95, 0.05], [0.8, 0.2]]), 5)
    assert needs.tolist() == [HIGH, LOW, HIGH, HIGH, SKIP]  # expert 1: low for token 0, skip for 1 -> low
    with pytest.raises(ConfigError, match="T1 <= T2"):
        MixedPrecision("bf16", "int4", 0.9, 0.6)


def _run(rt, tmp_path, low, thresholds, **kw):  # noqa: F811
    kw = {**dict(max_context=32, decode_weights="fp32", plan="off", expert_weights="bf16", expert_cache_slots=4,
                 resident_experts=0, offload_dir=str(tmp_path / "off"), accelerator="none"), **kw}
    llm = LLM(rt.dir("qwen3_moe"), EngineConfig(expert_low_weights=low, mixed_thresholds=thresholds, **kw))
    out = llm.generate(prompt(), GREEDY)[0].token_ids
    ex = llm.experts
    result = out, dict(ex.precision_counts), ex.bytes_read / len(out), llm.plan
    llm.close()
    return result


def test_thresholds_decide_the_loads(rt, tmp_path):  # noqa: F811
    high_only, counts, high_bytes, _ = _run(rt, tmp_path, None, (0.6, 0.9))
    assert counts == {}
    out, counts, _, plan = _run(rt, tmp_path, "int4", (1.0, 1.0))  # every score <= T1: all high
    assert out == high_only and set(counts) == {"high"}
    assert plan.mixed_precision == {"high": "bf16", "low": "int4", "t1": 1.0, "t2": 1.0}
    cfg = open_checkpoint(rt.dir("qwen3_moe")).config
    hb, lb = (sizes.expert_bytes(cfg, f) for f in ("bf16", "int4"))
    assert plan.expert_cache_slots == 3 and plan.expert_cache_slots_low == hb // lb  # one bf16 slot's bytes
    _, counts, b_low, _ = _run(rt, tmp_path, "int4", (0.0, 1.0))  # only top-1 high, the rest low
    assert counts.get("skip", 0) == 0 and counts["low"] + counts.get("low hit", 0) > 0 and counts["high"] > 0
    assert b_low < high_bytes  # the same cache bytes as high-only's 4 bf16 slots
    _, counts, b_skip, _ = _run(rt, tmp_path, "int4", (0.0, 0.0))  # top-1 high, the others skipped
    assert set(counts) == {"high", "skip"} and b_skip < b_low


@pytest.mark.parametrize("path", ["copy", "cpu"])
def test_mixed_precision_behind_the_stand_in_accelerator(rt, tmp_path, path):  # noqa: F811
    """Low copies in RAM (unlimited CPU budget) or on disk, copied to low slots or computed on the CPU."""
    for cpu in (None, 2**30):
        _, counts, _, plan = _run(rt, tmp_path, "int4", (0.0, 1.0), accelerator="host", gpu_memory="64MiB",
                                  cpu_memory=cpu, force_expert_path=path)
        assert counts["low"] > 0 and counts["high"] > 0 and plan.dtypes["experts_low"] == "int4"


def test_mixed_kl_sits_between_high_only_and_low_only(rt, tmp_path):  # noqa: F811
    """Issue 9 §4 on a fixture: teacher-forced decode KL to the lossless fp32 model, every expert
    on disk behind a 2-slot cache: bf16 experts < HOBBIT mixed bf16+int4 (0.6, 0.9) < int4 experts,
    with both precisions loaded in the mixed run (benchmarks/moe_accuracy.py runs every fixture)."""
    from tiered.eval import decode_compare

    kind, ctx = "mixtral", 32
    kw = dict(dtype="float32", decode_weights="fp32", accelerator="none", plan="off", max_context=ctx)
    budget = dict(kw, resident_experts=0, expert_cache_slots=2, offload_dir=str(tmp_path / "off"))
    ref = LLM(rt.dir(kind), EngineConfig(**kw))
    others = {"high": LLM(rt.dir(kind), EngineConfig(**budget, expert_weights="bf16")),
              "mixed": LLM(rt.dir(kind), EngineConfig(**budget, expert_weights="bf16", expert_low_weights="int4",
                                                      mixed_thresholds=(0.6, 0.9))),
              "low": LLM(rt.dir(kind), EngineConfig(**budget, expert_weights="int4"))}
    try:
        kl = decode_compare(ref, others, prompt(ctx, seed=1), 8)
        counts = others["mixed"].experts.precision_counts
    finally:
        for llm in [ref, *others.values()]:
            llm.close()
    assert kl["high"].tokens == ctx - 8 + 1
    assert 0 < kl["high"].mean < kl["mixed"].mean < kl["low"].mean
    assert counts["high"] > 0 and counts["low"] + counts["low hit"] > 0
