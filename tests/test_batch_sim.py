"""The replay of a known workload under the engine's continuous batching (planner/batch_sim), which the throughput
goal prices a batch file's requests with: its steps are LLM.step's, its prices the step prices' sums, and the
plan's batch is chosen on it."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from tiered import EngineConfig, LLM, SamplingParams
from tiered.engine.scheduler import Scheduler
from tiered.errors import ConfigError
from tiered.planner.batch_sim import PromptPrefixes, StepPrices, simulate_requests
from tiered.planner.throughput import block_throughput


def _prices(most: int = 0, as_rows: bool = False, group: int = 1024) -> StepPrices:
    # a decode step 10 ms + 1 ms a sequence + 1 us a cached position of each; prompts 1 ms a token (+ 5 ms a forward,
    # + 1 us a token for each cached position before it)
    return StepPrices(decode=lambda n, c: 0.010 + 0.001 * n + 1e-6 * n * c,
                      rows=lambda T, k, past=0: 0.005 + 0.001 * T + 1e-6 * T * past,
                      alone=lambda T, past=0: 0.005 + 0.001 * T + 1e-6 * T * past,
                      packed=lambda lengths, past=0: 0.005 + 0.001 * sum(lengths) + 1e-6 * sum(lengths) * past,
                      most_rows=most, chunks_as_rows=as_rows, group_tokens=group)


def test_one_request_is_its_prefill_then_a_step_for_each_later_token():
    run = simulate_requests([(10, 5)], 1, _prices())
    steps = [0.011 + 1e-6 * c for c in (11, 12, 13, 14)]  # its first token from the prefill; 4 steps after
    assert run.seconds == pytest.approx(0.015 + sum(steps)) and run.generated == 5 and run.steps == 4
    assert (run.prefilled, run.joined, run.occupancy) == (1, 0, 1.0)
    # within the mixed rows the prompt's rows are the first step, its first token their last row's
    run = simulate_requests([(10, 5)], 1, _prices(most=16))
    assert run.seconds == pytest.approx(0.015 + sum(steps)) and run.steps == 5 and run.joined == 1


def test_slots_bound_the_step_and_a_finished_request_frees_its_slot():
    log: list = []
    run = simulate_requests([(4, 3), (4, 1), (4, 2), (4, 2)], 2, _prices(), log)
    # step 1: two prompts prefilled (one packed forward), the one wanting 1 token done; the other decodes
    # step 2: the freed slot's prompt prefilled beside it; ... every step decodes at most 2 sequences
    assert log[0] == (((4, 4),), (), 1) and all(n <= 2 for _, _, n in log)
    assert run.generated == 8 and sum(len(g) for p, _, _ in log for g in p) == 4
    with pytest.raises(ValueError):
        simulate_requests([(0, 3)], 1, _prices())
    with pytest.raises(ValueError):
        simulate_requests([(3, 3)], 0, _prices())
    assert simulate_requests([], 4, _prices()).seconds == 0


def test_shortest_prompts_join_the_step_within_the_mixed_rows_and_the_rest_prefill_first():
    log: list = []
    simulate_requests([(30, 4), (5, 4), (12, 4), (200, 4)], 4, _prices(most=20), log)
    # 5 and 12 tokens fit 20 rows (shortest first); 30 and 200 prefill first, packed into one forward, then decode
    # beside the joining rows
    assert log[0] == (((30, 200),), (5, 12), 2)
    log.clear()  # within a prefill chunk of 64 tokens they are two forwards
    simulate_requests([(30, 4), (5, 4), (12, 4), (200, 4)], 4, _prices(most=20, group=64), log)
    assert log[0] == (((30,), (200,)), (5, 12), 2)
    log.clear()  # where whole chunks run as rows, the others pack into native steps of at most 20 rows
    run = simulate_requests([(8, 2), (9, 2), (6, 2), (7, 2)], 4, _prices(most=10, as_rows=True), log)
    assert log[0] == (((7,), (8,), (9,)), (6,), 3) and run.prefill_s == pytest.approx(3 * 0.005 + 0.024)


def test_steps_nothing_changes_between_are_priced_at_once_as_one_by_one():
    """Where no request can join or finish, the replay prices the steps up to the next finish at once (at their mean
    positions): the same seconds, steps and tokens as one step at a time (what it runs when it logs its steps)."""
    rng = random.Random(2)
    requests = [(rng.randrange(2, 300), rng.randrange(1, 90)) for _ in range(60)]
    for slots, most in ((1, 0), (4, 64), (16, 0), (64, 128)):
        fast, slow = (simulate_requests(requests, slots, _prices(most), log) for log in (None, []))
        assert fast.seconds == pytest.approx(slow.seconds, rel=1e-9)
        assert (fast.steps, fast.generated, fast.occupancy) == pytest.approx((slow.steps, slow.generated, slow.occupancy))


def test_prompt_prefixes_answer_the_tokens_any_two_prompts_share():
    """PromptPrefixes keeps only each prompt's sorted rank and its neighbours' shared tokens, and answers any pair as
    comparing their tokens does (prompts from a few prefixes, equal ones and prefixes of others among them)."""
    from tiered.engine.scheduler import _common_prefix

    rng = random.Random(5)
    stems = [[rng.randrange(4) for _ in range(rng.randrange(1, 12))] for _ in range(4)]
    prompts = [rng.choice(stems)[:rng.randrange(1, 13)] + [rng.randrange(4) for _ in range(rng.randrange(0, 5))]
               for _ in range(60)] + [[1, 2, 3]] * 2
    prompts = [p for p in prompts if p]
    prefixes = PromptPrefixes.of(prompts)
    table = PromptPrefixes.Table(prefixes)
    for i in range(len(prompts)):
        for j in range(len(prompts)):
            if i != j:
                assert table.common(i, j) == _common_prefix(prompts[i], prompts[j])
    assert prefixes.check(len(prompts)) == prefixes and prefixes.any_shared()
    with pytest.raises(ValueError):
        prefixes.check(len(prompts) + 1)
    with pytest.raises(ValueError):
        PromptPrefixes.of([[1], []])
    with pytest.raises(ValueError, match="prefixes rank"):
        simulate_requests([(3, 2)] * (len(prompts) - 1), 2, _prices(), prefixes=prefixes)


def test_a_prefix_a_slot_holds_is_not_prefilled_again_and_its_suffix_attends_to_it():
    """Through one slot, a prompt sharing 50 tokens with the one before prefills its 20 others, priced after 50 cached
    positions; twins admitted together prefill once; without the prefixes every prompt is priced whole."""
    system = list(range(1000, 1050))
    prompts = [system + list(range(10)), system + list(range(100, 120))]
    requests = [(60, 2), (70, 2)]
    run = simulate_requests(requests, 1, _prices(), prefixes=PromptPrefixes.of(prompts))
    assert run.prefill_s == pytest.approx((0.005 + 0.060) + (0.005 + 0.020 + 1e-6 * 20 * 50)) and run.reused == 50
    assert simulate_requests(requests, 1, _prices()).prefill_s == pytest.approx(0.065 + 0.075)
    log: list = []
    run = simulate_requests([(60, 3)] * 3, 4, _prices(), log, PromptPrefixes.of([prompts[0]] * 3))
    assert log[0] == (((60,),), (), 3) and run.prefill_s == pytest.approx(0.065) and run.reused == 120


def _engine_log(llm, requests, slots, prompts=None):
    """LLM.step's steps over `requests` as (each prefill forward's uncached prompt tokens, those of the prompts
    joining as rows, sequences decoded), as simulate_requests logs them. `prompts`: their token ids, run with the
    server's prefix reuse (Scheduler prefix_reuse); None: random ones, without."""
    rng = random.Random(0)
    V = llm.config.vocab_size
    ids = prompts or [[rng.randrange(3, V) for _ in range(p)] for p, _ in requests]
    seqs = [llm.make_sequence(ids[i], SamplingParams(max_tokens=g, temperature=0, ignore_eos=True), False, index=i)
            for i, (p, g) in enumerate(requests)]
    sched = Scheduler(max_batch=slots, max_queue=len(seqs), prefix_reuse=prompts is not None)
    for s in seqs:
        sched.add(s)
    cache = llm._cache_for(slots, max(p + g for p, g in requests))
    log, step = [], {}
    mixed, groups, fwd_mixed, prefill = llm._mixed_prefills, llm._prefill_groups, llm._forward_mixed, llm._prefill
    fwd = llm._forward

    def on_mixed(admitted, decoding, cache):
        out = mixed(admitted, decoding, cache)
        step["joined"] = [len(s.prompt_ids) - s.cached_tokens for s in out]
        return out

    def on_groups(seqs, cache, twins):
        step["grouping"] = True
        try:
            return groups(seqs, cache, twins)
        finally:
            step["grouping"] = False

    def on_prefill(seqs, cache):  # a group through the modules (or chunk by chunk)
        step["prefilled"].append(tuple(sorted(len(s.prompt_ids) - s.cached_tokens for s in seqs)))
        return prefill(seqs, cache)

    def on_fwd_mixed(seqs, decode, cache, span=None):
        if step["grouping"] and span is None:  # a group of prompts as rows of one native step
            step["prefilled"].append(tuple(sorted(len(s.prompt_ids) - s.cached_tokens for s in seqs)))
        step["decoded"] += len(decode)
        return fwd_mixed(seqs, decode, cache, span)

    def on_fwd(seqs, cache, prefill, span=None):
        step["decoded"] += 0 if prefill else len(seqs)
        return fwd(seqs, cache, prefill=prefill, span=span)

    llm._mixed_prefills, llm._prefill_groups, llm._forward_mixed = on_mixed, on_groups, on_fwd_mixed
    llm._prefill, llm._forward = on_prefill, on_fwd
    while sched.has_work():
        step.update(joined=[], prefilled=[], decoded=0, grouping=False)
        llm.step(sched, cache)
        log.append((tuple(sorted(step["prefilled"])), tuple(sorted(step["joined"])), step["decoded"]))
    assert sum(len(s.output_ids) for s in seqs) == sum(g for _, g in requests)
    return log


@pytest.mark.parametrize("rows, chunk", [(0, 0), (24, 0), (24, 24)])
def test_the_replay_runs_the_steps_llm_step_runs(zoo, rows, chunk):
    """The replay's steps are the engine's, step for step: which admitted prompts prefill first and which join the
    decode step's rows (Plan.mixed_rows: none, a few beside the prefills, or every prompt as rows of native steps
    where whole chunks run so), and how many sequences each step decodes, over requests of varied lengths through
    fewer slots than requests. Where the native step cannot take rows (no kernels) no prompt joins, the replay too."""
    from tiered.planner.latency_cpu import request_prices

    llm = LLM(zoo.dir("llama"), EngineConfig(max_context=96, max_batch=4, accelerator="none"))
    takes_rows = llm.runtime.cpu_decode is not None and llm.runtime.cpu_decode.takes_prefill_rows(
        llm._cache_for(4, 96))
    llm.plan.mixed_rows = rows if takes_rows else 0
    llm.plan.prefill_chunk = chunk or llm.plan.prefill_chunk
    rng = random.Random(1)
    # the first step's rows: 6 + 18 = 24, the most (an equal count joins); then lengths at random
    requests = [(6, 5), (18, 3), (30, 2), (40, 6)] + [(rng.randrange(2, 40), rng.randrange(1, 12)) for _ in range(9)]
    unpriced = lambda *a, **k: 0.0  # noqa: E731
    want: list = []
    simulate_requests(requests, 4, request_prices(llm.plan, unpriced, unpriced, unpriced), want)
    assert _engine_log(llm, requests, 4) == want
    assert any(j for _, j, _ in want) == bool(llm.plan.most_prompt_rows())


@pytest.mark.parametrize("rows, chunk, shared", [(0, 0, True), (24, 0, True), (24, 0, False), (24, 24, True)])
def test_the_replay_reuses_the_prefixes_the_server_reuses(zoo, rows, chunk, shared):
    """With the prompts' prefixes (PromptPrefixes), the replay's steps are those of LLM.step under the server's
    prefix reuse, step for step: a prompt prefills only what no free slot's last prompt (or a running one's) holds,
    a prompt equal to one admitted with it is not prefilled (a request's n choices), and where the plan shares
    prefixes (Plan.shared_prefixes) one sharing 64 tokens more with an earlier admitted prompt takes them from it
    after that leader prefilled alone. Requests of two system prompts, twins and prompts sharing nothing, through
    fewer slots than requests."""
    from tiered.planner.latency_cpu import request_prices

    llm = LLM(zoo.dir("llama"), EngineConfig(max_context=256, max_batch=4, accelerator="none"))
    takes_rows = llm.runtime.cpu_decode is not None and llm.runtime.cpu_decode.takes_prefill_rows(
        llm._cache_for(4, 256))
    llm.plan.mixed_rows = rows if takes_rows else 0
    llm.plan.prefill_chunk = chunk or llm.plan.prefill_chunk
    llm.plan.shared_prefixes = shared
    rng = random.Random(4)
    V = llm.config.vocab_size
    draw = lambda n: [rng.randrange(3, V) for _ in range(n)]  # noqa: E731
    system = [draw(90), draw(64)]  # the second exactly the fewest tokens a follower takes
    prompts, gens = [], []
    for k in range(24):
        kind = rng.randrange(4)
        prompt = (system[kind] + draw(rng.randrange(1, 30)) if kind < 2 else
                  list(prompts[-1]) if kind == 2 and prompts else draw(rng.randrange(2, 40)))
        prompts.append(prompt)
        gens.append(rng.randrange(1, 10))
    requests = [(len(p), g) for p, g in zip(prompts, gens)]
    unpriced = lambda *a, **k: 0.0  # noqa: E731
    want: list = []
    run = simulate_requests(requests, 4, request_prices(llm.plan, unpriced, unpriced, unpriced), want,
                            PromptPrefixes.of(prompts))
    assert _engine_log(llm, requests, 4, prompts) == want
    # prompts took prefixes from slots and twins; sharing prompts admitted together, more (some step admitted two
    # of one system prompt)
    alone = simulate_requests(requests, 4, replace(request_prices(llm.plan, unpriced, unpriced, unpriced),
                                                   shared_prefixes=False), prefixes=PromptPrefixes.of(prompts))
    assert 0 < alone.reused < run.reused if shared else 0 < alone.reused == run.reused


def test_the_throughput_goal_chooses_a_batch_files_batch_on_its_replayed_requests(zoo):
    """With the requests' lengths (EngineConfig.requests: `tiered batch`'s), each batch's price is their replay
    (Plan.predicted_requests_tokens_per_s) and the plan's throughput is its batch's; the workload defaults to their
    means. Bad requests are refused with the config."""
    requests = ((40, 8), (5, 30), (60, 4), (12, 12), (3, 20), (50, 6))
    llm = LLM(zoo.dir("llama"), EngineConfig(goal="throughput", max_context=96, accelerator="none", requests=requests))
    plan = llm.plan
    assert (plan.prompt_tokens, plan.gen_tokens) == (round(170 / 6), round(80 / 6))
    assert plan.predicted_requests_tokens_per_s > 0
    assert plan.predicted_throughput_tokens_per_s == block_throughput(plan) == plan.predicted_requests_tokens_per_s
    (note,) = [n for n in plan.notes if n.startswith("throughput goal: batch")]
    assert "the workload's requests" in note
    # the latency goal and a re-pricing at other positions ignore them
    assert LLM(zoo.dir("llama"), EngineConfig(max_context=96, accelerator="none", requests=requests)
               ).plan.predicted_requests_tokens_per_s is None
    for bad in (((0, 3),), (), ((3,),), (("x", 2),)):
        with pytest.raises(ConfigError, match="requests"):
            EngineConfig(requests=bad)
    # their prompts' prefixes describe as many prompts, with the requests
    prefixes = PromptPrefixes.of([[1, 2, 3]] * len(requests))
    assert EngineConfig(requests=requests, request_prefixes=tuple(prefixes)).request_prefixes == prefixes
    for requests_, bad in ((requests, PromptPrefixes.of([[1]] * 3)), (None, prefixes), (requests, ((0,) * 6, ()))):
        with pytest.raises(ConfigError, match="request_prefixes"):
            EngineConfig(requests=requests_, request_prefixes=bad)
