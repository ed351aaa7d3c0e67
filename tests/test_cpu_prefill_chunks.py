"""A CPU plan's prefill in chunks: a long prompt's activations stay within the workspace its RAM budget keeps.

The CPU-only engine (no accelerator) prefills a prompt longer than Plan.prefill_chunk chunk by chunk, as a GPU
plan does (engine/llm.LLM._prefill), and its plans count that chunk's activations (Plan.workspace_bytes) in the
RAM budget, both the planner's (planner/latency_cpu) and the runtime rules' (planner/rules).
"""

from __future__ import annotations

import pytest

from runtime_fixtures import engine_config, rt  # noqa: F401  (rt is a fixture)
from test_planned_run import box  # noqa: F401  (a fixture)

from tiered import LLM, EngineConfig, SamplingParams, kernels
from tiered.errors import BudgetError
from tiered.memory import sizes
from tiered.planner.cpu_predict import chunk_spans, predict_prefill, predict_prompt_rows, prefill_attention_pairs

CTX = 48
CHUNK = 16


def _run(path, config):
    """(greedy tokens of a prompt of most of the context, the plan's chunk, the prefill forwards' spans, the
    most tokens one prefill forward took, the plan) on the CPU engine."""
    llm = LLM(path, config)
    spans, most, paths = [], [0], []
    forward, mixed = llm._forward, llm._forward_mixed

    def count(seqs, span, path):
        a, b = span or (seqs[0].cached_tokens, len(seqs[0].prompt_ids))
        spans.append((a, b))
        paths.append(path)
        most[0] = max(most[0], b - a)

    def counted(seqs, cache, prefill, span=None):
        if prefill:
            count(seqs, span, "modules")
        return forward(seqs, cache, prefill, span)

    def counted_rows(prefill, decode, cache, span=None):
        if prefill:
            count(prefill, span, "rows")
        return mixed(prefill, decode, cache, span)
    llm._forward, llm._forward_mixed = counted, counted_rows
    try:
        long = [2 + (7 * i) % 90 for i in range(llm.max_context - 8)]
        out = llm.generate([long], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].token_ids
        return out, llm.plan.prefill_chunk, spans, len(long), most[0], llm.plan, paths
    finally:
        llm.close()


@pytest.mark.parametrize("kind,plan", [("llama", "auto"), ("llama", "off"), ("mixtral", "auto"), ("mixtral", "off")])
def test_a_long_prompt_prefills_in_chunks_on_the_cpu(zoo, rt, monkeypatch, kind, plan):  # noqa: F811
    """With the chunk made 16 tokens, a 40-token prompt prefills in 3 forwards of at most 16 tokens (each
    attending to the KV the earlier ones cached) and decodes the same greedy tokens as in one forward; the
    plan keeps a workspace of the chunk's tokens in RAM (smaller than the whole context's), counted in its
    CPU memory and reserved in the engine's CPU budget. Its chunks run as rows of the native step where its
    plan's mixed rows reach a whole chunk (LLM._prefill), an MoE model's too (its blocks over all the rows)."""
    from tiered.planner import auto

    path = zoo.dir("llama") if kind == "llama" else rt.dir("mixtral")
    config = engine_config(accelerator="none", max_context=CTX, plan=plan)
    with monkeypatch.context() as m:  # the reference in one forward, not as rows of the native decode step
        m.setattr(auto, "mixed_rows", lambda isa, act, dequantize=0: 0)
        ref, ref_chunk, ref_spans, n, ref_most, ref_plan, ref_paths = _run(path, config)
    assert ref_chunk == sizes.CPU_PREFILL_TOKENS and ref_spans == [(0, n)] and ref_most == n
    assert ref_paths == ["modules"]
    monkeypatch.setattr(sizes, "CPU_PREFILL_TOKENS", CHUNK)
    out, chunk, spans, _, most, p, paths = _run(path, config)
    assert chunk == CHUNK and spans == [(a, min(a + CHUNK, n)) for a in range(0, n, CHUNK)] and len(spans) == 3
    assert most <= CHUNK
    assert paths == ["rows" if p.mixed_rows >= CHUNK else "modules"] * 3
    assert (p.mixed_rows >= CHUNK) == kernels.available()  # the rules' and the plan's floor, MoE models too
    assert out == ref
    # the workspace: one chunk's activations (the whole context's before), in the plan's RAM figure
    assert p.workspace_bytes == sizes.workspace_bytes(p_cfg(path), p.dtypes["weights"], CHUNK) > 0
    assert ref_plan.workspace_bytes == sizes.workspace_bytes(p_cfg(path), p.dtypes["weights"], CTX) > p.workspace_bytes
    assert ref_plan.memory["cpu"] - p.memory["cpu"] == ref_plan.workspace_bytes - p.workspace_bytes


def p_cfg(path):
    from tiered.checkpoint import open_checkpoint

    return open_checkpoint(path).config


def test_the_cpu_budget_holds_the_workspace(zoo, monkeypatch):
    """The CPU engine's budget reserves the plan's workspace (allocated by torch as a prefill runs, not by
    tiered), and a budget that holds the weights and KV cache but not a chunk's activations is a BudgetError
    that names them, before anything is read."""
    from tiered.hardware.budget import MemoryBudget

    reserved, real = [], MemoryBudget.reserve

    def reserve(self, nbytes, what=""):
        reserved.append((self.name, what, nbytes))
        real(self, nbytes, what)
    monkeypatch.setattr(MemoryBudget, "reserve", reserve)
    path = zoo.dir("llama")
    llm = LLM(path, EngineConfig(accelerator="none", max_context=CTX, decode_weights="fp32"))
    try:
        assert llm.plan.workspace_bytes > 0
        assert ("cpu", "the activation workspace", llm.plan.workspace_bytes) in reserved
        need = llm.plan.memory["cpu"]
    finally:
        llm.close()
    short = need - llm.plan.workspace_bytes // 2
    with pytest.raises(BudgetError, match="a prefill chunk's activations"):
        LLM(path, EngineConfig(accelerator="none", max_context=CTX, decode_weights="fp32", cpu_memory=short))


def test_chunked_prefill_prices_each_chunk_over_the_cache(zoo, box):  # noqa: F811
    """predict_prefill with a chunk: one forward when the prompt fits it; else a forward per chunk, each
    chunk's attention over the cache before it with an explicit mask (every pair computed), so a chunked
    prompt costs more attention than one causal forward and the rest again per chunk."""
    from tiered.hardware.profile import HardwareProfile

    assert chunk_spans(40, 16) == [(16, 0), (16, 16), (8, 32)]
    assert chunk_spans(40, 0) == chunk_spans(40, 64) == [(40, 0)]
    assert prefill_attention_pairs(16) == 16 * 17 / 2 and prefill_attention_pairs(16, 32) == 16 * 48
    cfg, hw = p_cfg(zoo.dir("llama")), HardwareProfile.load(box)
    whole = predict_prefill(cfg, hw, "fp32", 40)
    assert predict_prefill(cfg, hw, "fp32", 40, chunk=64) == whole
    chunked = predict_prefill(cfg, hw, "fp32", 40, chunk=16)
    parts = sum(predict_prefill(cfg, hw, "fp32", t) for t, _ in chunk_spans(40, 16))
    assert chunked > parts and chunked > whole
    # a prompt after a reused prefix (`past`) is priced as a chunk after it: the chunks' sum is the first chunk's and
    # the 24 tokens after it
    first = predict_prefill(cfg, hw, "fp32", 16)
    assert predict_prefill(cfg, hw, "fp32", 24, chunk=16, past=16) == pytest.approx(chunked - first)
    assert predict_prefill(cfg, hw, "fp32", 24, past=16) > predict_prefill(cfg, hw, "fp32", 24)


def test_a_chunk_after_the_cache_is_priced_by_its_own_key(box):  # noqa: F811
    """A chunk's attention over the cache (an explicit mask: every pair) is priced by attn_prefill_past where
    profiled, else by the causal key: torch's SDPA ran it ~2.8x faster a MAC than 512-token causal prompts."""
    from dataclasses import replace

    from tiered.hardware import op_time
    from tiered.hardware.profile import HardwareProfile, LinearModel

    hw = HardwareProfile.load(box)
    causal, past = LinearModel(1e-4, 3e-11, 1.0), LinearModel(2e-4, 2e-11, 1.0)
    only_causal = replace(hw, models={**hw.models, "attn_prefill/cpu/fp32": causal})
    both = replace(hw, models={**only_causal.models, "attn_prefill_past/cpu/fp32": past})
    macs = 4e9
    assert op_time.prefill_attention_time(both, "cpu", "fp32", macs) == causal.alpha + causal.beta * macs
    assert op_time.prefill_attention_time(both, "cpu", "fp32", macs, past=True) == past.alpha + past.beta * macs
    assert op_time.prefill_attention_time(only_causal, "cpu", "fp32", macs, past=True) == causal.alpha + causal.beta * macs


def test_the_plan_prices_a_long_prompt_chunk_by_chunk(zoo, box, monkeypatch):  # noqa: F811
    """LLM.predicted_ttft_at re-prices the plan for another prompt length (planner/auto.ttft_at): its own prompt's
    TTFT again, and a prompt past the chunk chunk by chunk: as rows of the native step where the plan's mixed rows
    reach a whole chunk (cpu_predict.predict_prompt_rows, each chunk after the cache the earlier ones wrote),
    else as predict_prefill prices the modules' chunks."""
    monkeypatch.setattr(sizes, "CPU_PREFILL_TOKENS", CHUNK)
    llm = LLM(zoo.dir("llama"), EngineConfig(accelerator="none", max_context=CTX, decode_weights="fp32", profile=box))
    try:
        plan, fmt = llm.plan, llm.plan.dtypes["weights"]
        assert plan.prefill_chunk == CHUNK
        assert llm.predicted_ttft_at(plan.prompt_tokens) == pytest.approx(plan.predicted_ttft_s)
        held = fmt if plan.dense_copies else plan.precision
        modules = predict_prefill(llm.config, llm._profile, held, 40, None, 0.0, experts_dtype=fmt, act_dtype=fmt,
                                  experts_format=plan.dtypes["experts"], batch_act=plan.batch_act, chunk=CHUNK)
        assert modules > predict_prefill(llm.config, llm._profile, held, 40, None, 0.0, experts_dtype=fmt,
                                         act_dtype=fmt, experts_format=plan.dtypes["experts"], batch_act=plan.batch_act)
        rows = sum(predict_prompt_rows(llm.config, llm._profile, plan.precision, n, plan.precision_mix,
                                       plan.dtypes["kv_cache"], plan.dtypes.get("lm_head"), plan.batch_act, past)
                   for n, past in chunk_spans(40, CHUNK))
        assert (plan.mixed_rows >= CHUNK) == kernels.available()  # the rules' floor (planner/auto.mixed_rows)
        assert llm.predicted_ttft_at(40) == pytest.approx(rows if plan.mixed_rows >= CHUNK else modules)
    finally:
        llm.close()
