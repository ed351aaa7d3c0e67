"""The runtime's trace (copies overlap compute on the stand-in accelerator; Chrome JSON round trip;
Gantt PNG) and the CLI around the expert runtime: profile-experts, run with budgets, trace."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from runtime_fixtures import GREEDY, engine_config, prompt, rt, sizes_of  # noqa: F401

from tiered import LLM
from tiered.cli import app
from tiered.planner.placement import FAST
from tiered.runtime.dispatcher import LatencyModel
from tiered.runtime.trace import load_chrome, overlap_seconds

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LINK = 2e8  # bytes/s of the emulated H2D link: one 36 KiB Mixtral-fixture expert takes ~0.18 ms


def run_traced(rt, force_expert_path=None, latency=None, link=LINK) -> LLM:
    """Mixtral fixture behind the host accelerator with a throttled link; experts in CPU RAM."""
    s = rt.sizes("mixtral")
    llm = LLM(rt.dir("mixtral"), engine_config(accelerator="host", gpu_memory=s.fast(cache_slots=4),
                                               cpu_memory="64MiB", expert_cache_slots=4, link_bandwidth=link,
                                               trace=True, force_expert_path=force_expert_path))
    assert llm.experts.placement.count(FAST) == 0
    if latency is not None:
        llm.experts.latency = latency
    try:
        llm.generate([prompt()], GREEDY)
    finally:
        llm.experts.executor.close()
    return llm


@pytest.fixture(scope="module")
def copy_run(rt) -> LLM:
    return run_traced(rt, force_expert_path="copy")


def test_copies_overlap_accelerator_compute(copy_run, rt):
    """While one expert computes on the compute stream, the next one's weights are copied."""
    ev = copy_run.experts.executor.events
    copies = [e for e in ev if e.stream == "copy"]
    computes = [e for e in ev if e.stream == "launch"]
    eb = rt.sizes("mixtral").expert
    assert copies and computes
    assert len(copies) == copy_run.experts.path_counts["copy"]
    assert all(e.nbytes == eb and e.layer is not None and e.expert is not None for e in copies)
    assert sum(e.nbytes for e in copies) == copy_run.experts.bytes_h2d
    # each copy takes at least bytes / link bandwidth (the emulated PCIe)
    assert min(e.end - e.start for e in copies) >= 0.9 * eb / LINK
    # an expert computes only after its weights arrived
    for c in copies:
        assert any(k.layer == c.layer and k.expert == c.expert and k.start >= c.end - 1e-6 for k in computes)
    assert overlap_seconds(ev, "copy", "launch") > 0


def test_mixed_run_overlaps_copy_with_cpu_experts(rt, monkeypatch):
    """The plan's balanced dispatch splits a layer's misses: the experts with the fewest tokens run on
    the CPU (the calling thread) while the others' weights cross the link. The link is slow here
    (2 ms per expert) and each CPU expert takes at least 0.5 ms (a tiny fixture's would take 0.1 ms,
    less than the copy thread's wake-up), so the CPU's share surely falls inside the copies."""
    import time

    from tiered.quant.experts import ExpertFormat

    real = ExpertFormat.forward
    def slow_on_the_cpu(self, x, slot):  # the stand-in's device experts keep their speed
        if x.device.type == "cpu":
            time.sleep(5e-4)
        return real(self, x, slot)
    monkeypatch.setattr(ExpertFormat, "forward", slow_on_the_cpu)
    lat = LatencyModel(0.0, 1e-3, 0.0, 0.0, 2.5e-3, float("inf"))
    assert 2 < lat.cpu_threshold(rt.sizes("mixtral").expert) < 3
    llm = run_traced(rt, latency=lat, link=LINK / 10)
    paths = llm.experts.path_counts
    assert paths["copy"] > 0 and paths["cpu"] > 0
    ev = llm.experts.executor.events
    assert {"copy", "launch", "cpu"} <= {e.stream for e in ev}
    assert overlap_seconds(ev, "copy", "launch") > 0
    assert overlap_seconds(ev, "copy", "cpu") > 0


def test_overlap_seconds():
    from tiered.runtime.trace import TraceEvent as E
    ev = [E("a", "copy", 0.0, 1.0), E("b", "copy", 2.0, 3.0), E("c", "compute", 0.5, 2.5), E("d", "cpu", 5, 6)]
    assert overlap_seconds(ev, "copy", "compute") == pytest.approx(1.0)
    assert overlap_seconds(ev, "compute", "copy") == pytest.approx(1.0)
    assert overlap_seconds(ev, "copy", "cpu") == 0.0


def test_write_trace_round_trip_and_png(copy_run, tmp_path):
    path = tmp_path / "trace.json"
    copy_run.write_trace(path)
    data = json.loads(path.read_text())
    assert {e["ph"] for e in data["traceEvents"]} == {"M", "X"}
    back = load_chrome(path)
    ev = copy_run.experts.executor.events
    assert len(back) == len(ev)
    for a, b in zip(ev, back):
        assert (a.name, a.stream, a.nbytes, a.layer, a.expert) == (b.name, b.stream, b.nbytes, b.layer, b.expert)
        assert b.start == pytest.approx(a.start, abs=1e-9) and b.end == pytest.approx(a.end, abs=1e-9)
    assert overlap_seconds(back, "copy", "launch") == pytest.approx(overlap_seconds(ev, "copy", "launch"), abs=1e-6)

    png = tmp_path / "trace.png"
    result = CliRunner().invoke(app, ["trace", str(path), "--png", str(png)])
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert f"{len(ev)} tasks" in result.stdout and "overlap copy with launch" in result.stdout


def test_trace_cli_missing_file(tmp_path):
    result = CliRunner().invoke(app, ["trace", str(tmp_path / "nope.json"), "--png", str(tmp_path / "x.png")])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "Traceback" not in result.output


# ------------------------------------------------------------------ CLI with a tokenizer
VOCAB = 49152  # SmolLM2's


@pytest.fixture(scope="module")
def tok_model(smollm2_path, tmp_path_factory) -> Path:
    """A tiny Mixtral (2 layers, 8 experts, top-2) with SmolLM2's vocabulary and tokenizer beside it."""
    import transformers

    from tiered.checkpoint import open_checkpoint

    tok = open_checkpoint(smollm2_path).tokenizer()
    assert len(tok) <= VOCAB
    path = tmp_path_factory.mktemp("mixtral-smollm2-vocab")
    config = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-6,
        initializer_range=0.1, vocab_size=VOCAB, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id or 0)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


PROMPTS = ["The capital of France is", "Experts are spread over tiers.", "", "def fib(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def profile(tok_model, tmp_path_factory) -> tuple[Path, dict, CliRunner]:
    d = tmp_path_factory.mktemp("profile")
    prompts = d / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out, png = d / "prof.json", d / "heat.png"
    result = CliRunner().invoke(app, ["profile-experts", str(prompts), "--model", str(tok_model), "--out", str(out),
                                      "--png", str(png), "-n", "4"])
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == PNG_MAGIC
    return out, json.loads(out.read_text()), result


def test_profile_experts_counts(tok_model, profile):
    path, prof, result = profile
    L, E, k = 2, 8, 2
    assert (prof["layers"], prof["experts"], prof["prompts"]) == (L, E, 4)  # the blank line is skipped
    tokens, mass = np.asarray(prof["tokens"]), np.asarray(prof["gate_mass"])
    assert tokens.shape == mass.shape == (L, E)
    assert (tokens >= 0).all() and (tokens == tokens.round()).all()
    # the same generation in-process: every fed token (prompt + generated but the last) is routed
    # to top-k experts in every MoE layer
    from tiered import EngineConfig, SamplingParams

    llm = LLM(tok_model, EngineConfig(decode_weights="fp32"))
    outs = llm.generate([p for p in PROMPTS if p], SamplingParams(max_tokens=4, temperature=0))
    llm.experts.executor.close()
    processed = sum(len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in outs)
    assert tokens.sum(axis=1).tolist() == [processed * k] * L
    # Mixtral renormalizes the top-k weights: each token brings gate mass 1 to each layer
    assert mass.sum(axis=1) == pytest.approx([processed] * L, rel=1e-6)
    assert f"{processed * k * L} routed token-slots" in result.stdout


def test_run_with_expert_profile_places_popular_experts_first(tok_model, profile, monkeypatch):
    import tiered

    path, prof, _ = profile
    tokens = np.asarray(prof["tokens"])
    ctx, slots, resident = 64, 2, 4
    s = sizes_of(tok_model, ctx)
    created = []

    class Spy(tiered.LLM):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            created.append(self)

    monkeypatch.setattr(tiered, "LLM", Spy)
    result = CliRunner().invoke(app, [
        "run", "The capital of France is", "--model", str(tok_model), "--expert-profile", str(path),
        "--accelerator", "none", "--cpu-mem", str(s.fast(cache_slots=slots, resident=resident, accelerator=False)),
        "--cache-slots", str(slots), "--max-context", str(ctx), "--no-chat", "-n", "4", "-t", "0",
        "--decode-weights", "fp32", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert len(out["token_ids"]) >= 1
    assert out["runtime"]["placement"].startswith(f"experts: {resident} resident on the fast tier, 0 in CPU RAM, "
                                                  f"{s.total_experts - resident} on disk")
    assert out["runtime"]["paths"].get("disk", 0) > 0 and out["runtime"]["bytes_read"] > 0
    (llm,) = created
    llm.experts.executor.close()
    pl = llm.experts.placement
    fast = [k for k, t in pl.tiers.items() if t == FAST]
    rest = [k for k, t in pl.tiers.items() if t != FAST]
    assert len(fast) == resident
    assert min(tokens[k] for k in fast) >= max(tokens[k] for k in rest)
    assert pl.expected_hit_rate == pytest.approx(sum(tokens[k] for k in fast) / tokens.sum())


def test_run_budget_too_small_is_one_line_error(tok_model):
    result = CliRunner().invoke(app, ["run", "hi", "--model", str(tok_model), "--gpu-mem", "1KiB",
                                      "--accelerator", "host"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "non-expert weights" in result.stderr and "--gpu-mem" in result.stderr
    assert "Traceback" not in result.output and result.stdout == ""


def test_run_trace_then_draw(tok_model, tmp_path):
    """`tiered run --trace` on the stand-in accelerator, then `tiered trace` draws it."""
    s = sizes_of(tok_model, 64)
    trace = tmp_path / "run.json"
    result = CliRunner().invoke(app, [
        "run", "Once upon a time", "--model", str(tok_model), "--accelerator", "host",
        "--gpu-mem", str(s.fast(cache_slots=2)), "--cpu-mem", "64MiB", "--cache-slots", "2",
        "--max-context", "64", "--no-chat", "-n", "3", "-t", "0", "--decode-weights", "fp32",
        "--trace", str(trace), "--json"])
    assert result.exit_code == 0, result.output
    events = load_chrome(trace)
    assert events and {"copy", "cpu"} & {e.stream for e in events}
    result = CliRunner().invoke(app, ["trace", str(trace), "--png", str(tmp_path / "run.png")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run.png").read_bytes()[:8] == PNG_MAGIC


def test_run_replays_a_plan_from_tiered_plan(tok_model, tmp_path):
    """`tiered plan --json` then `tiered run --plan FILE`: the run keeps the plan's resident experts."""
    from tiered.planner.plan import Plan

    s = sizes_of(tok_model, 64)
    out = CliRunner().invoke(app, ["plan", "--model", str(tok_model), "--preset", "scheinfer-b",
                                   "--gpu-mem", "1GiB", "--json"])
    assert out.exit_code == 0, out.output
    plan = tmp_path / "plan.json"
    plan.write_text(out.stdout)
    res = CliRunner().invoke(app, ["run", "--model", str(tok_model), "--plan", str(plan), "--accelerator",
                                   "host", "--max-context", "64", "--decode-weights", "fp32",
                                   "-n", "2", "-t", "0", "--no-chat", "--json", "1 2 3"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout.strip().splitlines()[-1])
    resident = Plan.load(plan).resident_experts()
    assert data["runtime"]["placement"].startswith(f"experts: {min(resident, s.total_experts)} resident")
