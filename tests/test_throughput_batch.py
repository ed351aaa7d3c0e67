"""The throughput goal (planner/throughput.plan_batch, EngineConfig.goal) and offline batches (`tiered batch`,
serve/batch.py): the plan's batch priced and bounded by the budget, generate() running many prompts through that
many slots, and a batch file answered line for line through the server's API."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tiered import EngineConfig, LLM, SamplingParams, kernels
from tiered.cli import app
from tiered.engine.prompt import encode_prompt
from tiered.errors import BudgetError, ConfigError
from tiered.memory import sizes
from tiered.planner.plan import Plan
from tiered.planner.throughput import NEAR_BEST, UNPRICED_MOST, block_throughput, plan_batch
from tiered.planner.batch_sim import PromptPrefixes
from tiered.serve.batch import read_batch, request_lengths

GREEDY = SamplingParams(temperature=0, max_tokens=12)
PROMPTS = ["the quick brown fox", "memory is a tier", "one two three four five six", "hello", "a longer prompt "
           "about disks and caches and experts", "tiered", "seven eight", "fox and dog", "nine", "ten eleven"]


def _plan(B: int, step_s: float, ttft: float = 0.1, gen: int = 32, batched: bool = True) -> Plan:
    p = Plan("m", "latency", "hw", None, None, 512, gen, "bf16")
    p.kv_slots, p.predicted_ttft_s, p.predicted_decode_tokens_per_s = B, ttft, 1 / step_s
    p.predicted_batch_decode_tokens_per_s = B / step_s if batched and B > 1 else None
    return p


def test_block_throughput_is_flexgens_objective():
    # 4 prompts prefilled one by one (0.1 s each), then 32 steps of 4 sequences at 20 ms a step
    assert block_throughput(_plan(4, 0.02)) == pytest.approx(4 * 32 / (4 * 0.1 + 32 * 0.02))
    assert block_throughput(_plan(1, 0.01)) == pytest.approx(32 / (0.1 + 32 * 0.01))
    assert block_throughput(_plan(4, 0.02, batched=False)) is None
    grouped = _plan(4, 0.02)  # the 4 prompts prefilled together (Plan.predicted_block_prefill_s)
    grouped.predicted_block_prefill_s = 0.15
    assert block_throughput(grouped) == pytest.approx(4 * 32 / (0.15 + 32 * 0.02))


@pytest.mark.parametrize("B, P, mixed, chunk, context, moe", [
    (10, 64, 256, 256, 512, False), (16, 64, 1024, 1024, 128, True), (3, 300, 256, 256, 400, False),
    (7, 100, 1024, 1024, 600, True), (9, 48, 96, 1024, 512, False), (9, 48, 96, 1024, 512, True),
    (5, 700, 96, 1024, 800, False), (12, 100, 0, 1024, 300, True)])
def test_block_prefill_groups_are_the_engines(B, P, mixed, chunk, context, moe):
    """The throughput plan prices a block's prompts in the groups LLM._prefill_groups forms of B prompts of P
    tokens admitted together (dense or MoE alike): native-step rows packed up to Plan.most_prompt_rows
    (engine/llm._rows_groups) where whole chunks run as rows, else forwards packed within the prefill chunk; each
    group priced once for its prompts (rows(g P, prompts=g) / modules(g P, 0, prompts=g)), a lone prompt at its
    TTFT."""
    from types import SimpleNamespace

    from tiered.engine.llm import _rows_groups
    from tiered.planner.latency_cpu import block_prefill_groups, block_prefill_time

    plan = Plan("m", "throughput", "hw", None, None, P, 32, "int4")
    plan.kv_slots, plan.mixed_rows, plan.prefill_chunk, plan.context_tokens = B, mixed, chunk, context
    groups, as_rows = block_prefill_groups(plan)
    assert as_rows == plan.chunks_as_rows()
    seqs = [SimpleNamespace(prompt_ids=[0] * P, cached_tokens=0) for _ in range(B)]
    # (the engine's bounds: LLM._prefill_groups)
    engine = [len(g) for g in _rows_groups(seqs, plan.most_prompt_rows() if as_rows else chunk)]
    assert groups == engine and sum(groups) == B
    calls = []
    rows = lambda T, past=0, logit_rows=1, prompts=1: calls.append(("rows", T, prompts)) or 1e-3 * T  # noqa: E731
    modules = lambda T, chunk=0, ffn_only=False, prompts=1, past=0: calls.append(("modules", T, prompts)) or 2e-3 * T  # noqa: E731
    total = block_prefill_time(plan, rows, modules)
    lone = (1e-3 if P <= plan.most_prompt_rows() or as_rows else 2e-3) * P
    assert total == pytest.approx(sum(lone if g == 1 else (1e-3 if as_rows else 2e-3) * g * P for g in groups))
    assert all(n == T // P for _, T, n in calls if n > 1)


def test_disk_experts_of_a_block_are_read_once_for_its_prompts():
    """A throughput plan of an MoE model whose experts are mostly on disk prices its block's prefill as the engine
    runs it, the prompts together (each expert read once a group), not one prompt's TTFT a prompt: it is what
    block_throughput uses, and far below kv_slots TTFTs (16 prompts of 64 tokens of the 8-layer Qwen3-30B-A3B-width
    file, 766 of its 1024 experts on disk: 5.1 s measured together, 40.6 s priced as one after another, 2 Zen 4
    cores, 2026-12-04)."""
    from test_plan import cpu_only_profile

    from tiered.checkpoint.model_config import ModelConfig
    from tiered.planner.make import make_plan

    cfg = ModelConfig.from_hf({"model_type": "qwen3_moe", "vocab_size": 32000, "hidden_size": 1024,
                               "intermediate_size": 2048, "moe_intermediate_size": 384, "num_hidden_layers": 4,
                               "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
                               "num_experts": 64, "num_experts_per_tok": 8, "max_position_embeddings": 4096})
    hw = cpu_only_profile()
    whole = make_plan(cfg, hw, goal="latency", prompt_tokens=64, gen_tokens=32, cpu_memory=64 * 2**30, context_tokens=1024)
    plan = make_plan(cfg, hw, goal="throughput", prompt_tokens=64, gen_tokens=32, context_tokens=1024,
                     cpu_memory=whole.memory["cpu"] // 3, max_resident=0)
    assert any(l.experts_disk for l in plan.layers) and plan.kv_slots > 1
    assert plan.predicted_block_prefill_s < 0.5 * plan.kv_slots * plan.predicted_ttft_s
    B, G = plan.kv_slots, plan.gen_tokens
    assert plan.predicted_throughput_tokens_per_s == pytest.approx(
        B * G / (plan.predicted_block_prefill_s + G * B / plan.predicted_batch_decode_tokens_per_s))


def test_plan_batch_takes_the_smallest_batch_near_the_best_and_stops_at_the_budget():
    made = []

    def step(B):  # 10 ms, and more a sequence the larger the batch (attention over more caches): a peak
        return 0.010 + 0.0002 * B + 0.00001 * B * B

    def make(B):
        made.append(B)
        if B > 64:
            raise BudgetError("the KV cache does not fit")
        return _plan(B, step(B), ttft=0.0)

    plan = plan_batch(make)
    assert made == [1, 2, 4, 8, 16, 32, 64, 128]  # tried until the budget refused one
    scores = {B: B / step(B) for B in made[:-1]}
    best = max(scores.values())
    expected = min(B for B, s in scores.items() if s >= NEAR_BEST * best)
    assert plan.kv_slots == expected < 64 and plan.goal == "throughput"
    assert plan.predicted_throughput_tokens_per_s == pytest.approx(scores[expected])
    assert "batch 128: the KV cache does not fit" in plan.notes[-1]
    # a cap below the list's batches is tried itself
    made.clear()
    assert plan_batch(make, most=6).kv_slots <= 6 and made == [1, 2, 4, 6]


def test_plan_batch_for_a_server_keeps_one_requests_decode_within_its_share():
    """lone_share (a server's, EngineConfig.lone_decode_share): each batch's KV cache takes room that made one
    request decode faster (fewer experts cached); from the first batch whose lone request is priced under that share
    of batch 1's, none is taken, though its block is faster."""
    def make(B):  # the block's step shares the weights' reads; the lone request's step slows with the batch's room
        p = _plan(B, 0.010 + 0.001 * B, ttft=0.0)
        p.predicted_decode_tokens_per_s = 100.0 / (1 + 0.02 * (B - 1))
        return p

    assert plan_batch(make, most=32).kv_slots == 32  # the fastest block, one request at 61 tok/s
    plan = plan_batch(make, most=32, lone_share=0.9)  # 4: 94.3 tok/s alone; 8: 87.7, under 90
    assert plan.kv_slots == 4 and plan.predicted_decode_tokens_per_s >= 90.0
    assert "from batch 8 one request would decode at 87.7 tok/s, under 90% of batch 1's 100.0" in plan.notes[-1]
    assert "16: " in plan.notes[-1]  # the batches past the share are still priced in the note
    assert plan_batch(make, most=32, lone_share=0.5).kv_slots == 32  # 32: 61.7 tok/s alone, within half


def test_plan_batch_without_room_for_one_sequence_raises_and_unpriced_plans_take_the_largest_fit():
    def none_fit(B):
        raise BudgetError("no room")
    with pytest.raises(BudgetError):
        plan_batch(none_fit)
    plan = plan_batch(lambda B: _plan(B, 0.01, batched=False))
    assert plan.kv_slots == UNPRICED_MOST and "do not price batches" in plan.notes[-1]
    # a server's (most 8, lone share): the largest that fits up to `most`, below the first batch whose one request
    # is priced under the share (the KV cache of each slot takes an accelerator's expert room)
    assert plan_batch(lambda B: _plan(B, 0.01, batched=False), most=8).kv_slots == 8

    def slowing(B):
        return _plan(B, 0.010 * (1 + 0.05 * (B - 1)), batched=False)  # alone: 100, 95.2, 87.0, 74.1 tok/s
    plan = plan_batch(slowing, most=8, lone_share=0.9)
    assert plan.kv_slots == 2 and "up to 8" in plan.notes[-1]
    assert "from batch 4 one request would decode at 87.0 tok/s, under 90% of batch 1's 100.0" in plan.notes[-1]

    def refusing(B):  # the budget holds 2 slots' KV cache
        if B > 2:
            raise BudgetError("no room for the KV cache")
        return _plan(B, 0.01, batched=False)
    plan = plan_batch(refusing, most=8, lone_share=0.9)
    assert plan.kv_slots == 2 and "batch 4: no room for the KV cache" in plan.notes[-1]


def test_engine_throughput_goal_plans_the_batch_within_the_cpu_budget(zoo):
    path = zoo.dir("llama")
    free = LLM(path, EngineConfig(goal="throughput", max_context=256, decode_weights="fp32", accelerator="none"))
    assert free.plan.goal == "throughput" and free.plan.kv_slots > 1
    # FlexGen's (512, 32) within the 256-token context: the 32 generated tokens kept, the prompt the rest
    assert (free.plan.prompt_tokens, free.plan.gen_tokens) == (224, 32)
    (note,) = [n for n in free.plan.notes if n.startswith("throughput goal: batch")]
    priced = dict(pair.split(": ") for pair in note.split("by batch: ")[1].rstrip(")").split(", "))
    assert float(priced["1"]) < free.plan.predicted_throughput_tokens_per_s == pytest.approx(
        float(priced[str(free.plan.kv_slots)]), rel=1e-3)
    assert free.plan.predicted_batch_decode_tokens_per_s > free.plan.predicted_decode_tokens_per_s
    # a RAM budget with room for the model and only a few sequences' KV cache bounds the batch
    kv = sizes.kv_cache_bytes(free.config, 1, 256, free.plan.dtypes["kv_cache"])
    tight = free.plan.memory["cpu"] - (free.plan.kv_slots - 3) * kv
    small = LLM(path, EngineConfig(goal="throughput", max_context=256, decode_weights="fp32", accelerator="none",
                                   cpu_memory=tight))
    assert 1 <= small.plan.kv_slots <= 3
    assert small.plan.memory["cpu"] <= tight


def test_generate_runs_many_prompts_through_the_plans_slots_with_the_same_tokens(zoo, monkeypatch):
    path = zoo.dir("llama")
    llm = LLM(path, EngineConfig(goal="throughput", max_batch=3, max_context=128, decode_weights="fp32",
                                 accelerator="none"))
    assert llm.plan.kv_slots <= 3
    slots = []
    make = llm._cache_for
    monkeypatch.setattr(llm, "_cache_for", lambda n, length: slots.append(n) or make(n, length))
    outs = llm.generate(PROMPTS, GREEDY, chat=False)
    assert slots == [llm.plan.kv_slots]  # 10 prompts through the plan's slots, not 10 slots
    alone = zoo.llm(path)
    for p, out in zip(PROMPTS, outs):
        assert out.token_ids == alone.generate(p, GREEDY, chat=False)[0].token_ids


def test_latency_goal_generate_of_more_prompts_than_the_budget_holds_waits_for_slots(zoo):
    path = zoo.dir("llama")
    probe = LLM(path, EngineConfig(max_context=64, decode_weights="fp32", accelerator="none"))
    kv = sizes.kv_cache_bytes(probe.config, 1, 64, probe.plan.dtypes["kv_cache"])
    llm = LLM(path, EngineConfig(max_context=64, decode_weights="fp32", accelerator="none",
                                 cpu_memory=max(probe.plan.memory["cpu"], probe.cpu_budget.used) + 4 * kv))
    params = SamplingParams(temperature=0, max_tokens=8)
    assert llm._batch_slots(len(PROMPTS), 64) < len(PROMPTS)
    outs = llm.generate(PROMPTS, params, chat=False)  # before: BudgetError for 10 slots' KV cache
    assert [o.token_ids for o in outs] == [probe.generate(p, params, chat=False)[0].token_ids for p in PROMPTS]


def test_latency_goal_generate_of_many_prompts_steps_them_through_the_native_step(zoo, monkeypatch):
    """generate of more prompts than the latency plan's kv_slots and decode_threshold steps them together: steps of
    up to Plan.native_step_rows sequences (the prompt rows the plan runs there, when more) go through the CPU decode
    step as a server's batch does, not through the modules (SmolLM2's 32 sequences: 551-584 generated tok/s there
    against 406 through the modules, 2 AMX cores)."""
    llm = LLM(zoo.dir("llama"), EngineConfig(max_context=64, accelerator="none"))
    step = llm.runtime.cpu_decode
    if step is None or not llm.plan.most_prompt_rows():
        pytest.skip("no native step taking rows (tiered/kernels not built)")
    assert llm.plan.kv_slots == 1 and llm.plan.decode_threshold < len(PROMPTS) <= llm.plan.native_step_rows()
    rows = []
    call = type(step).__call__
    # (rows_call, a step of prompt rows, calls it with `rows`: counted here are the decode steps of LLM._forward)
    monkeypatch.setattr(type(step), "__call__", lambda self, ids, *a, **k: (
        rows.append(len(ids)) if len(a) == 3 and "rows" not in k else None) or call(self, ids, *a, **k))
    monkeypatch.setattr(llm, "bursts", False)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), chat=False)
    assert max(rows) == len(PROMPTS) and all(len(o.token_ids) == 6 for o in outs)


def _write(path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def _request(cid, url, body):
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def test_batch_file_is_answered_line_for_line_through_the_api(zoo, chat_llama, tmp_path):
    rows = [_request(f"c{i}", "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": p}], "max_tokens": 10, "temperature": 0})
            for i, p in enumerate(PROMPTS[:5])]
    rows += [_request(f"t{i}", "/v1/completions", {"prompt": p, "max_tokens": 7, "temperature": 0})
             for i, p in enumerate(PROMPTS[5:])]
    rows += ["{not json", _request("e1", "/v1/embeddings", {"input": "x"}),
             _request("c0", "/v1/completions", {"prompt": "again"}),  # a custom_id seen before
             _request("s1", "/v1/completions", {"prompt": "x", "stream": True}),
             _request("bad-temp", "/v1/completions", {"prompt": "x", "temperature": -1})]  # the API refuses it
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(src, rows)
    res = CliRunner().invoke(app, ["batch", str(src), "-o", str(dst), "--model", str(chat_llama),
                                   "--decode-weights", "fp32", "--accelerator", "none", "--max-batch", "4"])
    assert res.exit_code == 0, res.output
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert len(out) == len(rows)  # every line answered
    by_id = {}
    for o in out:
        assert o["id"].startswith("batch_req_")
        by_id.setdefault(o["custom_id"], []).append(o)
    llm = zoo.llm(chat_llama)
    for i, p in enumerate(PROMPTS[:5]):
        o = next(x for x in by_id[f"c{i}"] if x["response"] is not None)
        assert o["response"]["status_code"] == 200 and o["error"] is None
        body = o["response"]["body"]
        want = llm.generate([{"role": "user", "content": p}], SamplingParams(temperature=0, max_tokens=10), chat=True)[0]
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == want.text
        assert body["usage"]["completion_tokens"] == len(want.token_ids)
    for i, p in enumerate(PROMPTS[5:]):
        (o,) = by_id[f"t{i}"]
        want = llm.generate(p, SamplingParams(temperature=0, max_tokens=7), chat=False)[0]
        assert o["response"]["body"]["choices"][0]["text"] == want.text
    errors = [o for o in out if o["response"] is None]
    assert sorted(e["error"]["line"] for e in errors) == [11, 12, 13, 14]
    assert "not JSON" in errors[0]["error"]["message"]
    assert any("used by an earlier line" in (x["error"] or {}).get("message", "") for x in by_id["c0"])
    assert by_id["bad-temp"][0]["response"]["status_code"] == 400
    assert "10 succeeded, 5 failed (1 x 400, 4 invalid lines)" in res.output
    # the prompt tokens the server's prefix reuse did not compute (each answer's usage says how many of its own)
    cached = sum(o["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for o in out
                 if o["response"] is not None and o["response"]["status_code"] == 200)
    assert cached > 0 and f"| {cached} prompt tokens reused]" in res.output


def test_batch_refuses_another_models_name_and_an_empty_file_before_loading(chat_llama, tmp_path):
    src = tmp_path / "in.jsonl"
    _write(src, [_request("a", "/v1/completions", {"model": "gpt-4o-mini", "prompt": "x"})])
    res = CliRunner().invoke(app, ["batch", str(src), "--model", str(chat_llama)])
    assert res.exit_code == 2 and "requests name 'gpt-4o-mini' (1 line)" in res.output
    assert "--served-model-name gpt-4o-mini" in res.output and not (tmp_path / "in.results.jsonl").exists()
    res = CliRunner().invoke(app, ["batch", str(src), "--model", str(chat_llama), "--served-model-name", "gpt-4o-mini",
                                   "--accelerator", "none"])
    assert res.exit_code == 0, res.output
    (o,) = [json.loads(line) for line in (tmp_path / "in.results.jsonl").read_text().splitlines()]
    assert o["response"]["status_code"] == 200 and o["response"]["body"]["model"] == "gpt-4o-mini"
    src.write_text("\n\n")
    with pytest.raises(ConfigError, match="holds no requests"):
        read_batch(src)


def test_request_lengths_price_the_files_requests(chat_llama, tmp_path):
    llm_tok = LLM(chat_llama, EngineConfig(decode_weights="fp32", accelerator="none")).tokenizer
    src = tmp_path / "in.jsonl"
    _write(src, [_request("a", "/v1/completions", {"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 10}),
                 _request("b", "/v1/completions", {"prompt": [1, 2]}),  # 16 tokens: the server's default
                 _request("c", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "max_completion_tokens": 30})])
    lines = read_batch(src)
    p, g, longest, requests, prefixes = request_lengths(lines, llm_tok, 1000)
    chat = len(encode_prompt(llm_tok, [{"role": "user", "content": "hi"}], True))  # through the template
    assert (p, g) == (round((6 + 2 + chat) / 3), round((10 + 16 + 30) / 3)) and longest == max(16, 18, chat + 30)
    assert requests == ((6, 10), (2, 16), (chat, 30))  # each line's, in file order: the plan replays them
    # which prompts share how many leading tokens (the replay reuses them): the first two share [1, 2]
    table = PromptPrefixes.Table(prefixes)
    assert table.common(0, 1) == 2 and table.common(0, 2) == table.common(1, 2) < 2
    # a request of n choices, or a batched completion of several prompts, is that many sequences
    _write(src, [_request("e", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 5, "n": 3}),
                 _request("f", "/v1/completions", {"prompt": [[1, 2], [3, 4]], "max_tokens": 7, "n": 2})])
    lengths = request_lengths(read_batch(src), llm_tok, 1000)
    assert lengths.requests == ((3, 5),) * 3 + ((2, 7),) * 4
    table = PromptPrefixes.Table(lengths.prefixes)  # a request's choices: twins; its prompts: each its own
    assert [table.common(0, i) for i in (1, 2, 3, 5)] == [3, 3, 2, 0] and [table.common(i, j) for i, j in
                                                                         ((3, 4), (3, 5), (5, 6))] == [2, 0, 2]
    # a chat without max_tokens may fill the context window: the KV cache is sized for it
    _write(src, [_request("d", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
    assert request_lengths(read_batch(src), llm_tok, 1000)[2] == 1000
    # bodies the server refuses (400, nothing generated) are no sequences of the plan's
    bad = [_request("g", "/v1/chat/completions", {"messages": "hi", "max_tokens": 900}),
           _request("h", "/v1/completions", {"prompt": [1, 2], "max_tokens": "many"}),
           _request("i", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 5, "temperature": "hot"})]
    _write(src, [_request("e", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 5})] + bad)
    lengths = request_lengths(read_batch(src), llm_tok, 1000)
    assert lengths.requests == ((3, 5),) and lengths.longest == 8


def test_prompts_admitted_together_prefill_as_rows_of_native_steps(smollm2_path, monkeypatch):
    """Where the plan runs whole prefill chunks as rows of the native step (SmolLM2's default CPU plan), prompts
    admitted together beyond the decode step's rows prefill as rows too, packed into steps (LLM._rows_groups), not
    through the modules' padded forward; each prompt's first token and its most likely alternatives are those it
    gets alone, those clear of the cut by more than rounding among its alternatives too. (Their log-probabilities
    agree to rounding: the int4 x int8 rows kernel sums a row's groups in
    1, 2 or 4 chains by how many rows share its tile of 4, so a row's float sums depend on where in the step it
    falls; SmolLM2's first-token log-probabilities moved by up to ~0.06 nats, 2026-12-04.)"""
    llm = LLM(smollm2_path, EngineConfig(accelerator="none", max_context=1024))
    if not llm.plan.chunks_as_rows() or llm.runtime.cpu_decode is None:
        pytest.skip("this machine's plan prefills through the modules")
    monkeypatch.setattr(llm.plan, "prefill_chunk", 128)  # steps of at most 128 prompt rows
    monkeypatch.setattr(llm.plan, "mixed_rows", 128)
    text = "Offloading engines keep the weights of a model that does not fit in memory on a slower tier. "
    prompts = [llm.encode(f"{i}. " + text * n, chat=False) for i, n in enumerate((1, 2, 3, 2, 1, 3))]  # ~260 rows
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    # the int8-row kernels at every step size: on a CPU with AMX a step of 24+ rows runs the int4 projections on the
    # AMX GEMM over bf16 rows (Int4TGemv::run_step), and a prompt's rows alone and packed then took either path by
    # how its steps fell, ~0.1-0.17 nats apart (2026-12-06): the packing is what this test is about
    ext = kernels.load()
    was = ext.amx_rows(False)
    try:
        alone = [llm.generate(p, params, chat=False)[0].logprobs[0] for p in prompts]
        calls = []
        real = llm._forward_mixed
        monkeypatch.setattr(llm, "_forward_mixed", lambda pre, dec, cache, span=None: calls.append(
            sum(len(s.prompt_ids) for s in pre)) or real(pre, dec, cache, span))
        together = [o.logprobs[0] for o in llm.generate(prompts, params, chat=False)]
    finally:
        ext.amx_rows(was)
    for a, b in zip(alone, together):
        assert a.token == b.token
        # each alternative clear of the other's last one by more than that rounding is among its alternatives, at
        # its log-probability within it (a strict order of all five failed in a fresh clone's CI on a near-tie:
        # the fifth -3.589 against the sixth -3.565, 2026-12-06)
        for x, y in ((a, b), (b, a)):
            other = dict(y.top)
            for t, v in x.top:
                if v > y.top[-1][1] + 0.15:
                    assert t in other and other[t] == pytest.approx(v, abs=0.15), (t, x.top, y.top)
    # the decode step's rows took what fit, and the rest ran as one more native step, not through the modules
    assert len(calls) >= 2 and sum(calls) == sum(len(p) for p in prompts) and max(calls) <= 128


def test_make_plan_throughput_goal_without_a_gpu_is_the_engines_batch_plan():
    """`tiered plan --goal throughput` on a machine without a GPU: the CPU plan at the batch plan_batch picks (not
    FlexGen's LP, which places tensors across a GPU), within the RAM budget; with a GPU, FlexGen's policy."""
    from tiered.checkpoint.model_config import ModelConfig
    from tiered.hardware.presets import get_preset
    from tiered.planner.make import make_plan

    cfg = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
                               "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                               "num_key_value_heads": 8, "max_position_embeddings": 8192})
    from test_plan import cpu_only_profile

    hw = cpu_only_profile()
    free = make_plan(cfg, hw, goal="throughput", prompt_tokens=256, gen_tokens=256, cpu_memory=64 * 2**30)
    assert free.goal == "throughput" and free.flexgen is None and free.kv_slots > 1
    assert free.predicted_throughput_tokens_per_s > 0 and free.memory["cpu"] <= 64 * 2**30
    tight = make_plan(cfg, hw, goal="throughput", prompt_tokens=256, gen_tokens=256, cpu_memory=free.memory["cpu"] - sizes.kv_cache_bytes(cfg, free.kv_slots // 2, 512, "bf16"))
    assert tight.kv_slots < free.kv_slots
    # a budget that bounds the lossless cache to a small batch: the plan says what the lossy int8 cache would fit
    # (56% of the bytes a position) where that pays 10%; not where the cache is int8 already, nor where it barely pays
    room = free.memory["cpu"] - sizes.kv_cache_bytes(cfg, free.kv_slots - 5, 512, "bf16")
    small = make_plan(cfg, hw, goal="throughput", prompt_tokens=256, gen_tokens=256, cpu_memory=room)
    (hint,) = [n for n in small.notes if n.startswith("an int8 KV cache")]
    assert small.kv_slots == 4 and "would fit batch 8 in the budget" in hint
    assert not any(n.startswith("an int8 KV cache") for n in
                   make_plan(cfg, hw, goal="throughput", prompt_tokens=256, gen_tokens=256, cpu_memory=room,
                             kv_cache="int8").notes + tight.notes)
    assert "over" in free.render() and "sequences at once" in free.render()
    gpu = make_plan(cfg, get_preset("t4-pcie3"), goal="throughput", precision="int4", gen_tokens=32)
    assert gpu.flexgen is not None
