"""Continuous batching: the Scheduler's slots and queue, and LLM.step over it.

Greedy tokens of each request must equal LLM.generate of that prompt alone, whatever joins or
leaves the batch around it (requests that arrive while others decode, different prompt lengths,
slots reused after a request finishes or is cancelled).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from fixtures import prompt_ids
from tiered import SamplingParams
from tiered.engine.scheduler import SHARED_PREFIX_TOKENS, QueueFullError, Scheduler, rows_groups
from tiered.engine.sequence import Sequence


def _seq(i: int) -> Sequence:
    return Sequence(index=i, prompt="", prompt_ids=[1, 2], params=SamplingParams(), max_tokens=4, slot=-1,
                    generator=None)


def test_slots_are_handed_out_lowest_first_and_reused():
    sched = Scheduler(max_batch=2, max_queue=3)
    a, b, c = _seq(0), _seq(1), _seq(2)
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule()
    assert plan.prefill == [a, b] and plan.running == [a, b] and (a.slot, b.slot) == (0, 1)
    assert list(sched.waiting) == [c] and c.slot == -1
    sched.finish(a)
    plan = sched.schedule()
    assert plan.prefill == [c] and c.slot == 0 and plan.running == [b, c]


def test_queue_is_bounded():
    sched = Scheduler(max_batch=1, max_queue=2)
    for i in range(3):  # one for the free slot, two more in the queue
        sched.add(_seq(i))
    with pytest.raises(QueueFullError):
        sched.add(_seq(3))
    sched.schedule()  # one leaves the queue for the slot: the slot is taken, two wait
    with pytest.raises(QueueFullError):
        sched.add(_seq(4))
    with pytest.raises(ValueError):
        Scheduler(max_batch=0, max_queue=1)


def test_a_request_of_several_choices_is_queued_all_or_none():
    """add(*seqs) (a request's `n` choices) takes them all when they fit, else none."""
    sched = Scheduler(max_batch=2, max_queue=1)
    first = [_seq(0), _seq(1)]
    sched.add(*first)
    with pytest.raises(QueueFullError):
        sched.add(_seq(2), _seq(3))  # one place left, two asked
    assert list(sched.waiting) == first
    last = _seq(4)
    sched.add(last)
    assert list(sched.waiting) == first + [last]

def test_max_queue_counts_only_requests_beyond_the_free_slots():
    """max_queue 0: an idle scheduler still takes a request per free slot (it used to refuse every
    one), and refuses only when no slot is free."""
    sched = Scheduler(max_batch=2, max_queue=0)
    a, b = _seq(0), _seq(1)
    sched.add(a)
    sched.add(b)
    with pytest.raises(QueueFullError):
        sched.add(_seq(2))
    assert sched.schedule().prefill == [a, b]
    with pytest.raises(QueueFullError):
        sched.add(_seq(3))
    sched.finish(a)  # a slot frees: room for one again
    c = _seq(4)
    sched.add(c)
    assert sched.schedule().prefill == [c]


def test_cancel_frees_the_slot_or_the_queue_place_at_the_next_boundary():
    sched = Scheduler(max_batch=1, max_queue=3)
    a, b, c = _seq(0), _seq(1), _seq(2)
    for s in (a, b, c):
        sched.add(s)
    sched.schedule()
    sched.cancel(a)
    sched.cancel(c)  # still waiting
    assert sched.running == [a]  # nothing changes before the boundary
    plan = sched.schedule()
    assert plan.cancelled == [c, a] and a.slot == -1
    assert plan.prefill == [b] and b.slot == 0 and not sched.waiting


@pytest.fixture(scope="module")
def llm(zoo):
    return zoo.llm(zoo.dir("llama"))


def test_a_cancel_names_its_own_request_only():
    """A cancel that comes after its request finished (a client gone at its last token) must not drop
    a later request: keyed by id(), a new sequence allocated at the finished one's address was
    dropped in its place. Two requests with equal fields stay two."""
    sched = Scheduler(max_batch=2, max_queue=2)
    done = _seq(0)
    gone = id(done)
    sched.cancel(done)
    del done
    for _ in range(200):  # CPython hands a freed block out again: find the address if it is free
        new = _seq(0)
        if id(new) == gone:
            break
    twin = _seq(0)
    sched.add(new)
    sched.add(twin)
    plan = sched.schedule()
    assert plan.cancelled == [] and plan.prefill == [new, twin] and new.slot == 0 and twin.slot == 1
    sched.cancel(twin)
    assert sched.schedule().cancelled == [twin] and sched.running == [new]


@pytest.mark.parametrize("mixed_rows", [None, 0])
def test_requests_joining_a_running_batch_match_generate(llm, zoo, monkeypatch, mixed_rows):
    """Three slots, five requests of different lengths arriving at different steps. By default a
    request admitted while others decode runs its prompt as rows of their step (Plan.mixed_rows);
    with mixed_rows 0 every prompt prefills on its own."""
    lengths, max_tokens = (5, 11, 3, 8, 14), (12, 6, 9, 15, 4)
    prompts = [prompt_ids(zoo.vocab_size, n, seed=40 + n) for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    if mixed_rows is not None:
        monkeypatch.setattr(llm.plan, "mixed_rows", mixed_rows)
    expected = [llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]
    joined = []  # (prompts, decoding sequences) of each mixed step
    mixed = type(llm)._forward_mixed
    monkeypatch.setattr(type(llm), "_forward_mixed",
                        lambda self, p, d, c: joined.append((len(p), len(d))) or mixed(self, p, d, c))

    sched = Scheduler(max_batch=3, max_queue=8)
    cache = llm.kv_cache(3)
    arrivals = {0: [0, 1], 2: [2], 3: [3, 4]}  # step -> requests that arrive before it
    seqs, outs, batch_sizes, step = {}, {}, [], 0
    while step <= max(arrivals) or sched.has_work():
        for i in arrivals.get(step, []):
            seqs[i] = llm.make_sequence(prompts[i], params[i], index=i)
            sched.add(seqs[i])
        for seq, _, out in llm.step(sched, cache):
            if out is not None:
                outs[seq.index] = out
        batch_sizes.append(sched.num_running)
        step += 1
    assert [outs[i].token_ids for i in range(5)] == expected
    assert max(batch_sizes) == 3  # the slots were shared, and the batch really ran together
    if llm.plan.native_decode and mixed_rows is None:
        assert any(p and d for p, d in joined), joined  # prompts really joined a decoding batch
    if mixed_rows == 0:
        assert not joined


def _computed_prompt_tokens(llm, monkeypatch, mixed_rows: int | None) -> list[int]:
    """The prompt tokens each prefill forward or mixed step will compute (a list filled as they run),
    with Plan.mixed_rows set to `mixed_rows` (None: the plan's)."""
    if mixed_rows is not None:
        monkeypatch.setattr(llm.plan, "mixed_rows", mixed_rows)
    computed = []
    prefill, mixed = type(llm)._prefill, type(llm)._forward_mixed
    monkeypatch.setattr(type(llm), "_prefill", lambda self, seqs, cache: computed.extend(
        len(s.prompt_ids) - s.cached_tokens for s in seqs) or prefill(self, seqs, cache))
    monkeypatch.setattr(type(llm), "_forward_mixed", lambda self, pre, d, c: computed.extend(
        len(s.prompt_ids) - s.cached_tokens for s in pre) or mixed(self, pre, d, c))
    return computed


def _admitted_together(llm, prompts: list[list[int]], sp: SamplingParams | list[SamplingParams]):
    """Every prompt admitted at the first step of one Scheduler, stepped to the end: (their sequences,
    each one's tokens in prompt order). `sp`: every prompt's parameters, or each one's."""
    sched, cache = Scheduler(max_batch=len(prompts), max_queue=0), llm.kv_cache(len(prompts))
    sps = sp if isinstance(sp, list) else [sp] * len(prompts)
    seqs = [llm.make_sequence(x, p, index=i) for i, (x, p) in enumerate(zip(prompts, sps))]
    sched.add(*seqs)
    outs = {}
    while sched.has_work():
        outs.update({s.index: o for s, _, o in llm.step(sched, cache) if o is not None})
    return seqs, [outs[i].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("mixed_rows", [None, 0])
def test_equal_prompts_admitted_together_are_prefilled_once(llm, zoo, monkeypatch, mixed_rows):
    """A prompt admitted several times at one step (a request's `n` choices) is prefilled once
    (scheduler.PromptTwins): the others take its KV and its last logits, and each draws the tokens
    it draws alone, greedy or with its own seed, whether the prompt prefills on its own or as rows
    of a decode step (Plan.mixed_rows)."""
    p, q = prompt_ids(zoo.vocab_size, 9, seed=90), prompt_ids(zoo.vocab_size, 6, seed=91)
    prompts = [p, q, p, p]
    params = [SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True, seed=5)]
    computed = _computed_prompt_tokens(llm, monkeypatch, mixed_rows)
    for sp in params:
        expected = [llm.generate(x, replace(sp, seed=None if sp.seed is None else sp.seed + i))[0].token_ids
                    for i, x in enumerate(prompts)]
        computed.clear()
        seqs, tokens = _admitted_together(llm, prompts, sp)
        assert tokens == expected
        assert sorted(computed) == [len(q), len(p)]  # p once, not three times
        assert [s.cached_tokens for s in seqs] == [0, 0, len(p), len(p)]

@pytest.mark.parametrize("mixed_rows", [None, 0])
def test_prompts_sharing_a_prefix_admitted_together_prefill_it_once(llm, zoo, monkeypatch, mixed_rows):
    """Prompts admitted at one step that share a prefix of SHARED_PREFIX_TOKENS+ tokens with an earlier
    one's (a system prompt) prefill it once (scheduler.SharedPrefixes): the leader prefills first, the
    others take its KV of the prefix and compute the rest only (on their own, or as rows of the decode
    step: Plan.mixed_rows), and each draws the tokens it draws alone. A prompt that is the leader's
    own prefix computes its last token; one sharing too little prefills whole; a follower's twin takes
    the follower's KV."""
    assert llm.plan.weights_stay_put()
    system = prompt_ids(zoo.vocab_size, SHARED_PREFIX_TOKENS + 6, seed=92)
    lead, other = system + prompt_ids(zoo.vocab_size, 5, seed=93), prompt_ids(zoo.vocab_size, 7, seed=94)
    follower = system + prompt_ids(zoo.vocab_size, 3, seed=95)
    prompts = [lead, other, follower, system[:-2], lead[:20] + other, follower]  # the last: the follower's twin
    computed = _computed_prompt_tokens(llm, monkeypatch, mixed_rows)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [llm.generate(x, sp)[0].token_ids for x in prompts]
    computed.clear()
    seqs, tokens = _admitted_together(llm, prompts, sp)
    assert tokens == expected
    shared = [0, 0, len(system), len(system) - 3, 0, len(follower)]
    assert [s.cached_tokens for s in seqs] == shared
    assert sorted(computed) == sorted(len(x) - n for x, n in zip(prompts[:-1], shared))
    monkeypatch.setenv("TIERED_SHARED_PREFIX", "0")  # off: each prefills its prompt (the twin still shares)
    computed.clear()
    assert _admitted_together(llm, prompts, sp)[1] == expected
    assert sorted(computed) == sorted(len(x) for x in prompts[:-1])


@pytest.mark.parametrize("mixed_rows", [None, 0])
def test_a_prompt_whose_logprobs_are_asked_computes_every_token(llm, zoo, monkeypatch, mixed_rows):
    """A prompt asking prompt logprobs (SamplingParams.prompt_logprobs) computes its whole prompt, in a
    forward of its own: it takes no leader's shared prefix, no KV a slot held from an earlier request,
    and never runs as rows of the decode step; its twin asking as many alternatives takes its KV and
    its logprobs. Each one's logprobs and tokens are those it gets generated alone."""
    system = prompt_ids(zoo.vocab_size, SHARED_PREFIX_TOKENS + 6, seed=96)
    lead, follower = system + prompt_ids(zoo.vocab_size, 5, seed=97), system + prompt_ids(zoo.vocab_size, 3, seed=98)
    short = prompt_ids(zoo.vocab_size, 4, seed=99)  # would join the decode rows where the plan takes rows
    plain = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    scored = replace(plain, prompt_logprobs=2)
    prompts, sps = [lead, follower, lead, short, lead], [plain, scored, scored, scored, replace(plain, prompt_logprobs=1)]
    computed = _computed_prompt_tokens(llm, monkeypatch, mixed_rows)
    alone = [llm.generate(x, p)[0] for x, p in zip(prompts, sps)]
    computed.clear()
    seqs, tokens = _admitted_together(llm, prompts, sps)
    assert tokens == [o.token_ids for o in alone]
    # the scored twin of a plain leader and the one asking 1 alternative compute their own; none follows
    assert [s.cached_tokens for s in seqs] == [0, 0, 0, 0, 0]
    assert sorted(computed) == sorted(len(x) for x in prompts)
    assert [s.prompt_logprobs for s in seqs] == [None] + [o.prompt_logprobs for o in alone[1:]]
    assert len(seqs[1].prompt_logprobs) == len(follower) and seqs[1].prompt_logprobs[0] is None
    computed.clear()
    seqs, tokens = _admitted_together(llm, [lead, lead], [scored, scored])  # twins asking as many
    assert [s.cached_tokens for s in seqs] == [0, len(lead)] and computed == [len(lead)]
    assert seqs[1].prompt_logprobs == seqs[0].prompt_logprobs == alone[2].prompt_logprobs
    # a slot holding the prompt's KV (prefix reuse) is not reused for it
    sched, cache = Scheduler(max_batch=1, max_queue=2, prefix_reuse=True), llm.kv_cache(1)
    first, again = llm.make_sequence(lead, plain), llm.make_sequence(lead, scored)
    sched.add(first, again)
    outs = []
    while sched.has_work():
        outs += [o for _, _, o in llm.step(sched, cache) if o is not None]
    assert again.cached_tokens == 0 and outs[1].prompt_logprobs == alone[2].prompt_logprobs


def test_a_cancelled_request_gives_its_slot_to_a_waiting_one(llm, zoo):
    prompts = [prompt_ids(zoo.vocab_size, n, seed=60 + n) for n in (4, 7)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    sched, cache = Scheduler(max_batch=1, max_queue=4), llm.kv_cache(1)
    a, b = (llm.make_sequence(p, sp) for p in prompts)
    sched.add(a)
    sched.add(b)
    llm.step(sched, cache)
    llm.step(sched, cache)
    sched.cancel(a)
    outs = []
    while sched.has_work():
        outs += [out for _, _, out in llm.step(sched, cache) if out is not None]
    assert a.slot == -1 and not a.finished  # dropped, never finished
    assert [o.token_ids for o in outs] == [llm.generate(prompts[1], sp)[0].token_ids]


def test_rows_groups_pack_prompts_in_order_within_the_bound():
    # in admission order; a group grows while its tokens stay within 64; a prompt over the bound is its own group
    assert rows_groups([3, 16, 7, 11], 64) == [[0, 1, 2, 3]]
    assert rows_groups([10] * 7, 64) == [[0, 1, 2, 3, 4, 5], [6]]
    assert rows_groups([100, 10], 64) == [[0], [1]]
    assert rows_groups([30, 40, 20, 5], 64) == [[0], [1, 2], [3]]
    assert rows_groups([], 64) == []
    groups = rows_groups([5, 1, 30, 6, 6, 29, 2], 32)
    assert sorted(i for g in groups for i in g) == list(range(7))
    assert all(sum([5, 1, 30, 6, 6, 29, 2][i] for i in g) <= 32 for g in groups)


def test_prefix_reuse_takes_the_slot_sharing_the_longest_prefix():
    sched = Scheduler(max_batch=3, max_queue=8, prefix_reuse=True)
    seqs = [Sequence(index=i, prompt="", prompt_ids=p, params=SamplingParams(), max_tokens=4, slot=-1, generator=None)
            for i, p in enumerate([[1, 2, 3, 4], [1, 2, 9], [7, 8]])]
    for s in seqs:
        sched.add(s)
    sched.schedule()
    assert [s.slot for s in seqs] == [0, 1, 2] and all(s.cached_tokens == 0 for s in seqs)
    seqs[0].output_ids, seqs[1].output_ids = [5, 6], [10]  # slot 0 now holds 1 2 3 4 5; slot 1 holds 1 2 9
    sched.finish(seqs[0])
    sched.finish(seqs[1])
    new = [Sequence(index=9, prompt="", prompt_ids=p, params=SamplingParams(), max_tokens=4, slot=-1, generator=None)
           for p in ([1, 2, 9, 9, 9], [1, 2, 3, 4, 5])]
    for s in new:
        sched.add(s)
    sched.schedule()
    assert (new[0].slot, new[0].cached_tokens) == (1, 3)  # 1 2 9 of slot 1
    assert (new[1].slot, new[1].cached_tokens) == (0, 4)  # all but its last token: prefill computes that
    # without prefix reuse, the lowest free slot and nothing cached
    plain = Scheduler(max_batch=2, max_queue=2)
    plain.add(new[0])
    plain.schedule()
    assert (new[0].slot, new[0].cached_tokens) == (0, 0)


def test_prefix_reuse_gives_the_tokens_of_generate(llm, zoo):
    """Requests sharing a prefix with an earlier one in their slot prefill only the rest, alone or
    in a padded group, and their greedy tokens are those of generate() on the whole prompt."""
    system = prompt_ids(zoo.vocab_size, 12, seed=70)
    prompts = [system + prompt_ids(zoo.vocab_size, n, seed=71 + n) for n in (3, 5, 4, 9)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [llm.generate(p, sp)[0].token_ids for p in prompts]
    sched, cache = Scheduler(max_batch=2, max_queue=8, prefix_reuse=True), llm.kv_cache(2)
    seqs = [llm.make_sequence(p, sp, index=i) for i, p in enumerate(prompts)]
    outs = {}
    for first in (seqs[:2], seqs[2:]):  # the second pair finds the system prompt in both slots
        for s in first:
            sched.add(s)
        while sched.has_work():
            outs.update({s.index: o for s, _, o in llm.step(sched, cache) if o is not None})
    assert [outs[i].token_ids for i in range(4)] == expected
    assert [s.cached_tokens for s in seqs] == [0, 0, 12, 12]
    assert outs[3].stats.cached_tokens == 12


@pytest.mark.parametrize("mixed_rows", [None, 0])
def test_prefix_reuse_copies_a_running_slots_kv(llm, zoo, monkeypatch, mixed_rows):
    """A request arriving while another that shares its system prompt still decodes takes that
    prefix's KV from the running slot (copied into its own, Sequence.kv_source) and prefills only
    the rest; both draw the greedy tokens of generate() alone. A sequence cancelled before its step
    copied anything leaves its slot holding no tokens for reuse."""
    system = prompt_ids(zoo.vocab_size, 12, seed=80)
    a, b = system + prompt_ids(zoo.vocab_size, 3, seed=81), system + prompt_ids(zoo.vocab_size, 5, seed=82)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    computed = _computed_prompt_tokens(llm, monkeypatch, mixed_rows)
    expected = [llm.generate(p, sp)[0].token_ids for p in (a, b)]
    computed.clear()
    sched, cache = Scheduler(max_batch=3, max_queue=4, prefix_reuse=True), llm.kv_cache(3)
    sa, sb = llm.make_sequence(a, sp, index=0), llm.make_sequence(b, sp, index=1)
    sched.add(sa)
    outs = {}
    for _ in range(3):  # a prefills and decodes a few tokens
        outs.update({s.index: o for s, _, o in llm.step(sched, cache) if o is not None})
    sched.add(sb)
    while sched.has_work():
        outs.update({s.index: o for s, _, o in llm.step(sched, cache) if o is not None})
    assert [outs[0].token_ids, outs[1].token_ids] == expected
    assert sb.cached_tokens == 12 and computed == [len(a), len(b) - 12]
    # admitted (kv_source set) but cancelled before any step copied the prefix in
    sched, cache = Scheduler(max_batch=2, max_queue=4, prefix_reuse=True), llm.kv_cache(2)
    sched.add(sa := llm.make_sequence(a, sp, index=2))
    llm.step(sched, cache)
    sched.add(sc := llm.make_sequence(b, sp, index=3))
    sched.schedule()
    slot = sc.slot
    assert sc.kv_source == sa.slot and sc.cached_tokens == 12
    sched.cancel(sc)
    sched.schedule()
    assert sched._slot_tokens[slot] == []

def test_seen_ids_follow_the_tokens_as_they_are_appended():
    """Sequence.seen_ids (the repetition penalty's operand) is the prompt's and the generated ids
    so far after every append, as the buffer it keeps grows past its first 64 entries."""
    import torch

    seq = Sequence(index=0, prompt="", prompt_ids=list(range(50)), params=SamplingParams(), max_tokens=200, slot=0,
                   generator=None)
    assert seq.seen_ids().tolist() == list(range(50))
    for t in range(150):
        seq.output_ids.append(1000 + t)
        if t % 3:  # some steps do not ask (no penalty): the next call catches up
            continue
        seen = seq.seen_ids()
        assert seen.dtype == torch.long and seen.tolist() == seq.prompt_ids + seq.output_ids
    seq.output_ids += [7, 8]
    assert seq.seen_ids().tolist() == seq.prompt_ids + seq.output_ids
    seq.truncate(100)  # a rollback (serve/engine's _Saved.restore), then other tokens
    seq.output_ids += [5, 6, 9]
    assert seq.seen_ids().tolist() == seq.prompt_ids + seq.output_ids
