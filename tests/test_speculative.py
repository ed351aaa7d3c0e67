"""Speculative decoding (engine/speculative.py, LLM._propose / _verify_drafts): prompt lookup proposes drafts,
one step verifies them as rows, and the tokens are the model's own: a greedy request's output equals the one
without speculation whatever the drafts (right, wrong or partly right), through the native step's rows (any
batch) and the modules' forward (a lone sequence on the host stand-in); a sampled request's tokens keep the
model's distribution (speculative sampling with a point-mass draft)."""

from __future__ import annotations

import pytest
import torch

from fixtures import prompt_ids
from runtime_fixtures import engine_config, rt  # noqa: F401

from tiered import LLM, EngineConfig, SamplingParams
from tiered.engine import llm as llm_module
from tiered.engine.sampling import SamplingParams as SP
from tiered.engine.speculative import NgramDrafter, draft_length, draw_probs, expected_tokens, verify_draw
from tiered.errors import ConfigError


# ----------------------------------------------------------------------------- prompt lookup
def test_lookup_proposes_what_followed_the_latest_occurrence_longest_ngram_first():
    d = NgramDrafter(2, 4)
    #        0  1  2  3  4  5  6  7  8  9
    prompt = [1, 2, 3, 4, 9, 2, 3, 5, 6, 7]
    # the last two tokens (2, 3) occurred at 1-2 (then 4) and 5-6 (then 5): the latest wins
    assert d.propose(prompt, [2, 3], 3) == [5, 6, 7]
    # a longer match beats a later shorter one: (9, 2, 3) occurred once, then 5; (2, 3) also after the output
    d = NgramDrafter(2, 4)
    assert d.propose([1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3, 8], [9, 2, 3], 2) == [5, 6]
    # the continuation runs on into the output, and stops at the context's end
    d = NgramDrafter(2, 4)
    assert d.propose([4, 5, 6], [7, 4, 5], 5) == [6, 7, 4, 5]
    assert NgramDrafter(2, 4).propose([1, 2, 3], [4, 5], 4) == []  # (4, 5) never occurred before
    assert NgramDrafter(1, 1).propose([1, 2, 3], [1], 2) == [2, 3]
    assert NgramDrafter(2, 4).propose([1, 2, 1, 2], [], 0) == []
    with pytest.raises(ValueError):
        NgramDrafter(3, 2)


def test_the_growing_index_proposes_what_one_built_at_once_proposes():
    """Tokens appended a few at a time (steps, bursts, accepted drafts) index as a context given whole."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (300,), generator=g).tolist()  # a small alphabet: many repeats
    grown = NgramDrafter(2, 4)
    P, at = 40, 40
    sizes = torch.randint(1, 5, (200,), generator=g).tolist()
    for n in sizes:
        at = min(len(tokens), at + n)
        fresh = NgramDrafter(2, 4)
        assert grown.propose(tokens[:P], tokens[P:at], 5) == fresh.propose(tokens[:P], tokens[P:at], 5)
    # a cut context is indexed anew
    grown.reset()
    assert grown.propose(tokens[:P], tokens[P:P + 7], 5) == NgramDrafter(2, 4).propose(tokens[:P], tokens[P:P + 7], 5)


def test_acceptance_follows_verifications_and_undrafted_guesses():
    d = NgramDrafter(2, 4)
    assert d.acceptance == pytest.approx(0.5)
    d.record(4, 0)
    low = d.acceptance
    assert low < 0.2
    # a proposal left undrafted is scored against the tokens that came: all four matched
    d.guess(10, [5, 6, 7, 8])
    d.propose(list(range(10)), [5, 6, 7, 8], 0)
    assert d.acceptance > low and (d.total_drafted, d.total_accepted) == (0, 0)  # counted by the verifier only


def test_draft_length_weighs_expected_tokens_against_the_priced_rows():
    assert expected_tokens(0.5, 0) == 1 and expected_tokens(0.5, 2) == pytest.approx(1.75)
    flat = [1.0, 1.05, 1.1, 1.15, 1.2]  # a memory-bound step: rows nearly free
    steep = [1.0, 1.3, 1.6, 1.9, 2.2]  # a small model's step: each row ~30% more
    assert draft_length(0.9, flat, 4) == 4
    assert draft_length(0.2, steep, 4) == 0
    assert 0 < draft_length(0.7, steep, 4) < 4
    assert draft_length(0.1, None, 3) == 3  # unpriced: the whole proposal
    assert draft_length(0.9, flat, 2) == 2  # never past what was proposed


def test_a_sampled_draft_keeps_the_models_distribution():
    """Speculative sampling with a point-mass draft: accepted with p(d), else a draw from p without d; the
    token is distributed as p, with top-k / top-p / temperature and a repetition penalty applied."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    seen = torch.tensor([0])
    for params in (SP(temperature=1.0), SP(temperature=0.7, top_k=4, repetition_penalty=1.3),
                   SP(temperature=1.2, top_p=0.8)):
        p = draw_probs(logits, params, seen if params.repetition_penalty != 1 else torch.empty(0, dtype=torch.long))
        g = torch.Generator().manual_seed(1)
        for draft in (0, 2, 5):
            n = 20000
            counts = torch.zeros(6)
            for _ in range(n):
                counts[verify_draw(logits, params, seen if params.repetition_penalty != 1 else
                                   torch.empty(0, dtype=torch.long), g, draft)] += 1
            assert (counts / n - p).abs().max() < 0.015, (params, draft, counts / n, p)
            assert counts[p == 0].sum() == 0  # a filtered-out token never comes, drafted or not
    # greedy: the argmax after the penalty, whatever the draft
    assert verify_draw(logits, SP(temperature=0), torch.empty(0, dtype=torch.long), None, 3) == 0
    assert verify_draw(logits, SP(temperature=0, repetition_penalty=3.0), torch.tensor([0]), None, 0) == 1


# ----------------------------------------------------------------------------- the engine
class _Oracle(NgramDrafter):
    """Proposes the reference continuation, its 2nd token wrong in every other proposal (a partly right draft)
    and its 1st in every third (all wrong); counts its proposals."""

    ref: dict[int, list[int]] = {}  # first prompt token -> the reference output
    calls = 0

    def propose(self, prompt, output, k):
        type(self).calls += 1
        got = list(self.ref[prompt[0]][len(output):len(output) + k])
        if got and self.calls % 3 == 0:
            got[0] = got[0] + 1
        elif len(got) > 1 and self.calls % 2 == 0:
            got[1] = got[1] + 1
        return got


def _speculating(llm, monkeypatch, tokens: int = 4) -> None:
    monkeypatch.setattr(llm.plan, "speculative", "ngram")
    monkeypatch.setattr(llm.plan, "speculative_tokens", tokens)
    monkeypatch.setattr(llm.plan, "speculative_costs", None)  # every proposal drafted whole
    monkeypatch.setattr(llm_module, "NgramDrafter", _Oracle)
    _Oracle.calls = 0


def _same_with_drafts(llm, monkeypatch, prompts, rejected: bool = True, **params):
    """The outputs of `prompts` without speculation, then with oracle drafts (right, partly and wholly wrong):
    the same tokens, and drafts were accepted (and rejected, where `rejected`)."""
    sp = SamplingParams(**params)
    want = llm.generate(prompts, sp)
    _Oracle.ref = {p[0]: o.token_ids for p, o in zip(prompts, want)}
    _speculating(llm, monkeypatch)
    got = llm.generate(prompts, sp)
    monkeypatch.undo()
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
    drafted = sum(o.stats.draft_tokens for o in got)
    accepted = sum(o.stats.accepted_draft_tokens for o in got)
    assert _Oracle.calls and 0 < accepted and (accepted < drafted or not rejected)
    return got


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=0, repetition_penalty=1.3),
                                    dict(temperature=0, logprobs=2), dict(temperature=0, presence_penalty=0.5)])
def test_greedy_outputs_equal_the_unspeculated_ones_through_the_native_rows(zoo, monkeypatch, params):
    """A lone sequence (the burst path's place) and a batch of two of different lengths, the drafts verified as
    rows of the native step; logprobs are each row's own."""
    llm = zoo.llm(zoo.dir("llama"), accelerator="none")
    assert llm.runtime.cpu_decode is not None and llm.runtime.cpu_decode.takes_prefill_rows(llm._kv_cache(1, 16))
    one = [prompt_ids(zoo.vocab_size, 9, seed=1)]
    two = [prompt_ids(zoo.vocab_size, 6, seed=2), prompt_ids(zoo.vocab_size, 11, seed=3)]
    for prompts in (one, two):
        got = _same_with_drafts(llm, monkeypatch, prompts, max_tokens=24, ignore_eos=True, **params)
        if "logprobs" in params:
            want = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True, **params))
            for g, w in zip(got, want):
                assert [e.token for e in g.logprobs] == g.token_ids
                assert max(abs(a.logprob - b.logprob) for a, b in zip(g.logprobs, w.logprobs)) < 1e-4


def test_stops_end_a_verification_where_they_end_a_step(zoo, monkeypatch):
    """A stop token among accepted drafts ends the output there; max_tokens is never passed."""
    llm = zoo.llm(zoo.dir("llama"), accelerator="none")
    prompt = [prompt_ids(zoo.vocab_size, 8, seed=4)]
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].token_ids
    got = _same_with_drafts(llm, monkeypatch, prompt, temperature=0, max_tokens=30, ignore_eos=True,
                            stop_token_ids=[free[13]])
    assert got[0].finish_reason == "stop" and len(got[0].token_ids) == free.index(free[13]) + 1
    for n in (5, 6, 7):
        got = _same_with_drafts(llm, monkeypatch, prompt, rejected=False, temperature=0, max_tokens=n, ignore_eos=True)
        assert len(got[0].token_ids) == n and got[0].finish_reason == "length"


def test_a_structured_output_verifies_drafts_under_its_grammar(zoo, monkeypatch):
    """A JSON schema's grammar masks each verified row after the tokens accepted before it: a draft token it
    forbids is rejected, the tokens it forces (LLM._force) end a verification and go in as rows of the next
    step beside the next draft; the output is the unspeculated one, and follows the schema."""
    import json

    from test_structured import COMPACT, _valid

    llm = zoo.llm(zoo.dir("llama"))
    ids = llm.encode("the quick brown fox", chat=False)
    got = _same_with_drafts(llm, monkeypatch, [ids], temperature=0, max_tokens=200,
                            structured_outputs={"json": COMPACT})
    assert got[0].finish_reason == "stop" and _valid(json.loads(got[0].text))


def test_the_modules_forward_verifies_a_lone_sequences_drafts(zoo, monkeypatch):
    """Without the native rows (the host stand-in: the modules' forward, as on a GPU) a lone sequence's drafts
    are verified by one forward over its last token and drafts (LLM._forward_draft)."""
    llm = zoo.llm(zoo.dir("llama"), accelerator="host")
    assert llm.runtime.cpu_decode is None
    calls = []
    real = llm._forward_draft
    monkeypatch.setattr(llm, "_forward_draft", lambda *a: calls.append(len(a[0].draft)) or real(*a))
    _same_with_drafts(llm, monkeypatch, [prompt_ids(zoo.vocab_size, 9, seed=5)], temperature=0, max_tokens=20,
                      ignore_eos=True)
    assert calls and max(calls) > 1


def test_a_moe_models_drafts_route_as_rows(rt, monkeypatch):  # noqa: F811
    """Every expert resident in RAM: the native step routes each draft row to its own experts."""
    llm = LLM(rt.dir("mixtral"), engine_config(dtype="float32", expert_weights="int4", decode_weights="auto",
                                               accelerator="none"))
    _same_with_drafts(llm, monkeypatch, [list(range(2, 14))], temperature=0, max_tokens=16, ignore_eos=True)


def test_sampled_requests_speculate_and_stay_seeded(zoo, monkeypatch):
    """A seeded sampled request with speculation gives the same tokens run after run with the same drafts (its
    generator draws the acceptances too), within the vocabulary and max_tokens, and its drafts were verified."""
    llm = zoo.llm(zoo.dir("llama"), accelerator="none")
    prompt = [prompt_ids(zoo.vocab_size, 9, seed=6)]
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=20, ignore_eos=True)
    _Oracle.ref = {prompt[0][0]: llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20,
                                                                        ignore_eos=True))[0].token_ids}
    _speculating(llm, monkeypatch)
    a = llm.generate(prompt, sp)[0]
    _Oracle.calls = 0  # the same drafts again
    b = llm.generate(prompt, sp)[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 20
    assert a.stats.draft_tokens > 0 and all(0 <= t < zoo.vocab_size for t in a.token_ids)


def test_prompt_lookup_speeds_a_repeating_text_without_changing_it(zoo):
    """The real drafter on a text that repeats itself: a greedy output the model loops in is proposed from its
    own earlier tokens, drafts are accepted, and the output is the unspeculated one."""
    base = zoo.llm(zoo.dir("llama"), accelerator="none")
    spec = zoo.llm(zoo.dir("llama"), accelerator="none", speculative="ngram")
    assert spec.plan.speculative == "ngram" and spec.plan.speculative_tokens == 4
    pattern = prompt_ids(zoo.vocab_size, 7, seed=7)
    prompt = pattern * 4
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want, got = base.generate([prompt], sp)[0], spec.generate([prompt], sp)[0]
    assert got.token_ids == want.token_ids
    assert got.stats.draft_tokens > 0


# ----------------------------------------------------------------------------- plan and config
def test_the_plan_prices_draft_rows_and_replays_them(zoo, tmp_path):
    llm = zoo.llm(zoo.dir("llama"), accelerator="none", speculative="ngram", num_speculative_tokens=3)
    plan = llm.plan
    assert plan.speculative_tokens == 3 and plan.prompt_lookup == [2, 4]
    costs = plan.speculative_costs
    assert costs is not None and len(costs) == 4 and costs[0] == 1.0
    assert all(b >= a for a, b in zip(costs, costs[1:]))  # more rows never cheaper
    path = tmp_path / "plan.json"
    plan.save(path)
    from tiered.planner.plan import Plan

    assert Plan.load(path) == plan
    replayed = LLM(zoo.dir("llama"), EngineConfig(decode_weights="fp32", accelerator="none", plan=str(path)))
    assert replayed.plan.speculative_costs == costs
    with pytest.raises(ConfigError, match="speculative"):
        EngineConfig(speculative="eagle")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="n-gram"):
        EngineConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    off = zoo.llm(zoo.dir("llama"), accelerator="none", plan="off", speculative="ngram")
    assert off.plan.speculative_tokens == 4 and off.plan.speculative_costs is None  # rules: unpriced


def test_a_server_speculates_for_concurrent_requests_and_counts_drafts(zoo, chat_llama, monkeypatch):
    """`tiered serve --speculative ngram`: three requests at once decode together, their drafts verified as rows
    of the batch's steps; the greedy texts are the unspeculated engine's, and /metrics counts the drafts."""
    import httpx
    from concurrent.futures import ThreadPoolExecutor

    pytest.importorskip("openai")
    from test_serve import MODEL, running_server

    from tiered.serve.engine import ServingEngine

    base = zoo.llm(chat_llama, accelerator="none")
    llm = zoo.llm(chat_llama, accelerator="none", speculative="ngram")
    monkeypatch.setattr(llm.plan, "speculative_costs", None)  # every proposal drafted whole
    prompts = ["one two three one two three one two three", "fox dog fox dog fox dog fox", "tiered tiers tiered tiers"]
    want = [o.text for o in base.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                          chat=False)]
    engine = ServingEngine(llm, max_batch=4, max_queue=4)
    with running_server(engine, None) as url:
        def ask(p):
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 24,
                                                          "temperature": 0, "ignore_eos": True}, timeout=60)
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(ask, prompts))
        metrics = {line.split(" ")[0]: float(line.split(" ")[1]) for line in httpx.get(url + "/metrics").text.splitlines()
                   if not line.startswith("#")}
    assert got == want
    drafted, accepted = (metrics["tiered_spec_decode_draft_tokens_total"],
                         metrics["tiered_spec_decode_accepted_tokens_total"])
    assert drafted > 0 and 0 <= accepted <= drafted


# ----------------------------------------------------------------------------- a draft model
def _drafting(llm, monkeypatch):
    """Every step drafts as long as it may (the rows and the draft model's tokens unpriced)."""
    monkeypatch.setattr(llm.plan, "speculative_costs", None)
    monkeypatch.setattr(llm.drafts, "cost", 0.0)


@pytest.mark.parametrize("draft", ["llama", "qwen2"])
def test_a_draft_models_tokens_are_verified_into_the_models_own_output(zoo, monkeypatch, draft):
    """The tiny Llama drafted for by itself (nearly every draft accepted) and by the tiny Qwen2 of the same tokenizer
    (other weights: drafts accepted and rejected): greedy outputs equal the unspeculated ones, for a lone
    sequence and a batch of two, the draft model's cache catching up with what each verification accepted."""
    base = zoo.llm(zoo.dir("llama"), accelerator="none")
    llm = zoo.llm(zoo.dir("llama"), accelerator="none", draft_model=str(zoo.dir(draft)))
    assert llm.plan.speculative == "draft" and llm.drafts is not None and llm.drafts.cost > 0
    _drafting(llm, monkeypatch)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for prompts in ([prompt_ids(zoo.vocab_size, 9, seed=1)],
                    [prompt_ids(zoo.vocab_size, 6, seed=2), prompt_ids(zoo.vocab_size, 13, seed=3)]):
        want, got = base.generate(prompts, sp), llm.generate(prompts, sp)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        drafted = sum(o.stats.draft_tokens for o in got)
        accepted = sum(o.stats.accepted_draft_tokens for o in got)
        # (the draft model runs the engine's default int4 decode copies, the target here fp32: a near tie may part)
        assert drafted > 0 and (accepted >= 0.9 * drafted if draft == "llama" else 0 <= accepted < drafted)


def test_a_draft_model_drafts_for_the_modules_forward_and_sampled_requests(zoo, monkeypatch):
    """The host stand-in's target (its modules' forward verifies a lone sequence) with a CPU draft model; a seeded
    sampled request keeps its tokens run after run and within max_tokens."""
    base = zoo.llm(zoo.dir("llama"), accelerator="host")
    llm = zoo.llm(zoo.dir("llama"), accelerator="host", draft_model=str(zoo.dir("llama")))
    _drafting(llm, monkeypatch)
    prompt = [prompt_ids(zoo.vocab_size, 9, seed=4)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    got = llm.generate(prompt, sp)[0]
    assert got.token_ids == base.generate(prompt, sp)[0].token_ids and got.stats.accepted_draft_tokens > 0
    sp = SamplingParams(temperature=0.9, seed=5, max_tokens=20, ignore_eos=True)
    a, b = llm.generate(prompt, sp)[0], llm.generate(prompt, sp)[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 20 and a.stats.draft_tokens > 0


def test_a_draft_model_of_another_vocabulary_or_none_is_refused(zoo, tmp_path):
    with pytest.raises(ConfigError, match="draft model"):
        EngineConfig(speculative="draft")
    assert EngineConfig(draft_model="x").speculative == "draft"
    with pytest.raises(ConfigError, match="vocabulary"):  # a generated GGUF file carries no tokenizer
        LLM(zoo.dir("llama"), EngineConfig(decode_weights="fp32", accelerator="none",
                                           draft_model=str(zoo.gguf("llama", "F32"))))
    from tiered.errors import CheckpointError

    with pytest.raises((CheckpointError, OSError)):
        LLM(zoo.dir("llama"), EngineConfig(decode_weights="fp32", accelerator="none",
                                           draft_model=str(tmp_path / "missing")))


def test_a_cut_context_rewrites_the_draft_cache_from_the_start():
    from tiered.engine.speculative import ModelDrafter

    d = ModelDrafter()
    d.base, d.pos = 40, 40
    d.record(4, 2)
    assert d.pos == 42  # the two accepted draft tokens it fed are the context's
    d.base = 50
    d.record(3, 3)
    assert d.pos == 52  # it fed two of the three
    d.reset()
    assert d.pos == 0
    low = ModelDrafter()
    low.record(4, 0)
    a = low.acceptance
    low.idle_step()
    assert a < low.acceptance < 0.5  # back toward the prior while it drafts nothing
