"""Native decode bursts (CPUDecodeStep.burst, LLM._burst): a lone sequence decodes several tokens in one
native call, each on the token the one before drew, and gives exactly the tokens, stops and finish
reasons one step a token gives (LLM.bursts False), for every way a token is drawn."""

from __future__ import annotations

import pytest
import torch

from fixtures import prompt_ids
from runtime_fixtures import engine_config, rt  # noqa: F401

from tiered import LLM, SamplingParams, kernels
from tiered.quant.embedding import BlockEmbedding

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")

DRAWS = [dict(temperature=0), dict(temperature=0, repetition_penalty=1.3), dict(temperature=0.8, seed=3),
         dict(temperature=0.7, top_p=0.9, top_k=20, min_p=0.02, repetition_penalty=1.2, seed=5)]


def _run(llm, monkeypatch, burst: bool, prompts, **params):
    """(outputs, burst calls) of llm.generate(prompts) with bursts on or off (LLM.bursts)."""
    monkeypatch.setattr(llm, "bursts", burst)
    step = llm.runtime.cpu_decode
    calls = []
    real = step.burst
    monkeypatch.setattr(step, "burst", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    try:
        return llm.generate(prompts, SamplingParams(**params)), calls
    finally:
        monkeypatch.setattr(step, "burst", real)


def _same_as_steps(llm, monkeypatch, prompt, **params) -> list:
    got, calls = _run(llm, monkeypatch, True, [prompt], **params)
    want, none = _run(llm, monkeypatch, False, [prompt], **params)
    assert calls and not none  # the burst path ran, and only with bursts on
    assert got[0].token_ids == want[0].token_ids and got[0].finish_reason == want[0].finish_reason
    assert got[0].text == want[0].text
    times = got[0].stats
    assert times.itl_s > 0 and times.decode_s > 0
    return got


@pytest.mark.parametrize("params", DRAWS)
def test_a_burst_draws_the_tokens_one_step_a_token_draws(zoo, monkeypatch, params):
    """A dense model (fp32 lossless, its embedding an nn.Embedding): 40 tokens in bursts (4, then as
    many as ~50 ms hold, at most 32) equal the per-step path's for greedy, greedy after a repetition
    penalty, a seeded temperature draw and a seeded draw through every filter (one uniform a token
    from the request's generator either way)."""
    llm = zoo.llm(zoo.dir("llama"), accelerator="none")
    assert llm.runtime.cpu_decode.can_burst(llm._kv_cache(1, 16))
    _same_as_steps(llm, monkeypatch, prompt_ids(zoo.vocab_size, 12), max_tokens=40, ignore_eos=True, **params)


@pytest.mark.parametrize("params", DRAWS[:2] + DRAWS[3:])
def test_a_burst_reads_a_q8_0_embedding_from_its_blocks(zoo, monkeypatch, params):
    """A GGUF's Q8_0 token embedding stays in its blocks (BlockEmbedding, the one-copy mode): the burst
    looks its rows up natively (q8_0_row) as the step a token does (q8_0_rows), over int8 decode copies."""
    llm = zoo.llm(zoo.gguf("llama", "Q8_0"), decode_weights="auto", accelerator="none")
    assert isinstance(llm.model.model.embed_tokens, BlockEmbedding)
    assert llm.runtime.cpu_decode.can_burst(llm._kv_cache(1, 16))
    _same_as_steps(llm, monkeypatch, prompt_ids(zoo.vocab_size, 9), max_tokens=30, ignore_eos=True, **params)


def test_a_burst_stops_where_one_step_a_token_stops(zoo, monkeypatch):
    """A stop token ends the burst in C++; a stop string is found afterwards, and the burst's tokens past
    it are dropped: the same tokens, text and finish reason as one step a token. max_tokens is kept."""
    llm = zoo.llm(zoo.dir("llama"), accelerator="none")
    prompt = prompt_ids(zoo.vocab_size, 10, seed=4)
    free, _ = _run(llm, monkeypatch, False, [prompt], temperature=0, max_tokens=30, ignore_eos=True)
    ids = free[0].token_ids
    got = _same_as_steps(llm, monkeypatch, prompt, temperature=0, max_tokens=30, ignore_eos=True,
                         stop_token_ids=[ids[13]])
    assert got[0].finish_reason == "stop" and len(got[0].token_ids) == ids.index(ids[13]) + 1
    text = free[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    if stop.strip():
        got = _same_as_steps(llm, monkeypatch, prompt, temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
        assert got[0].finish_reason == "stop" and stop not in got[0].text
    got = _same_as_steps(llm, monkeypatch, prompt, temperature=0, max_tokens=7, ignore_eos=True)
    assert len(got[0].token_ids) == 7 and got[0].finish_reason == "length"


def test_a_moe_model_with_resident_experts_bursts_and_counts_its_uses(rt, monkeypatch):  # noqa: F811
    """Every expert resident in RAM: the native step runs the MoE blocks itself, so the burst does too,
    and the runner counts the same resident expert uses as one step a token."""
    llm = LLM(rt.dir("mixtral"), engine_config(dtype="float32", expert_weights="int4", decode_weights="auto",
                                               accelerator="none"))
    step = llm.runtime.cpu_decode
    assert step.moe_blocks and step.can_burst(llm._kv_cache(1, 16))
    runner = step.moe_blocks[0].runner
    uses = []
    for burst in (True, False):
        before = runner.resident_hits
        out, _ = _run(llm, monkeypatch, burst, [list(range(2, 14))], temperature=0, max_tokens=20, ignore_eos=True)
        uses.append((out[0].token_ids, runner.resident_hits - before))
    assert uses[0] == uses[1] and uses[0][1] > 0


def test_no_burst_where_not_asked_or_logprobs_are_asked(zoo, monkeypatch):
    """LLM.step without burst=True (generate, stream and the server's loop ask for bursts) and a request
    for logprobs decode one step a token, and so do two sequences together."""
    llm = zoo.llm(zoo.dir("llama"), accelerator="none")
    _, calls = _run(llm, monkeypatch, True, [prompt_ids(zoo.vocab_size, 8)], temperature=0, max_tokens=12,
                    ignore_eos=True, logprobs=2)
    assert not calls
    _, calls = _run(llm, monkeypatch, True, [prompt_ids(zoo.vocab_size, 8), prompt_ids(zoo.vocab_size, 5)],
                    temperature=0, max_tokens=12, ignore_eos=True)
    assert not calls  # two sequences decode together, one step a token (both to 12 tokens)
    from tiered.engine.scheduler import Scheduler

    monkeypatch.setattr(llm, "bursts", True)
    seq = llm.make_sequence(prompt_ids(zoo.vocab_size, 8), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    sched = Scheduler(max_batch=1, max_queue=1)
    sched.add(seq)
    cache = llm._cache_for(1, 32)
    step = llm.runtime.cpu_decode
    monkeypatch.setattr(step, "burst", lambda *a, **k: pytest.fail("a burst where step was not asked for one"))
    with torch.inference_mode():
        while sched.has_work():
            llm.step(sched, cache)
    assert len(seq.output_ids) == 12


def test_the_plan_decides_bursts(zoo, monkeypatch):
    """Plan.decode_bursts (the native CPU step's plans) is what lets the runtime burst: a plan without it, as a
    GPU plan or one replayed from before the field, decodes one step a token."""
    llm = zoo.llm(zoo.dir("llama"), accelerator="none")
    assert llm.plan.decode_bursts and llm.plan.native_decode
    monkeypatch.setattr(llm.plan, "decode_bursts", False)
    _, calls = _run(llm, monkeypatch, True, [prompt_ids(zoo.vocab_size, 8)], temperature=0, max_tokens=12,
                    ignore_eos=True)
    assert not calls
    assert not LLM(zoo.dir("llama"), engine_config(accelerator="host")).plan.decode_bursts


def test_tiered_burst_0_turns_bursts_off(zoo, monkeypatch):
    """TIERED_BURST=0 (to compare) decodes one step a token in every engine."""
    llm = zoo.llm(zoo.dir("llama"), accelerator="none")
    monkeypatch.setenv("TIERED_BURST", "0")
    _, calls = _run(llm, monkeypatch, True, [prompt_ids(zoo.vocab_size, 8)], temperature=0, max_tokens=12,
                    ignore_eos=True)
    assert not calls


def test_an_interrupt_ends_a_burst_after_its_token_in_flight(zoo):
    """CPUDecodeStep.burst's `interrupt` (int32 [1], the server's flag): nonzero, the burst stops after the
    token being computed; zero, it runs its n tokens; any other tensor is refused."""
    llm = zoo.llm(zoo.dir("llama"), accelerator="none")
    step, cache = llm.runtime.cpu_decode, llm._kv_cache(1, 32)
    params = SamplingParams(temperature=0)
    args = (5, 0, 0, 6, cache, [], torch.zeros(0, dtype=torch.long), params, torch.zeros(6, dtype=torch.float64))
    with torch.inference_mode():
        free, _ = step.burst(*args, interrupt=torch.zeros(1, dtype=torch.int32))
        stopped, seconds = step.burst(*args, interrupt=torch.ones(1, dtype=torch.int32))
        with pytest.raises(RuntimeError, match="interrupt must be a CPU int32"):
            step.burst(*args, interrupt=torch.ones(1, dtype=torch.int64))
    assert len(free) == 6 and stopped == free[:1] and len(seconds) == 1
