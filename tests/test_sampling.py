"""The sampler's pure functions (tiered/engine/sampling.py), alone and against transformers'
logits processors, and seeded determinism through the engine."""

from __future__ import annotations


import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from fixtures import prompt_ids
from runtime_fixtures import rt  # noqa: F401  (a fixture)
from tiered import SamplingParams, kernels
from tiered.engine.sampling import (GREEDY_TEMPERATURE, apply_repetition_penalty, filter_min_p, filter_top_k,
                                    filter_top_p, sample_token)

# Logit rows of distinct values at least 1/16 apart in [-20, 20] (ties, or values closer than
# fp32 softmax resolves, make "the k largest" and "the argmax" ambiguous).
logit_rows = st.lists(st.integers(-320, 320), min_size=2, max_size=64, unique=True).map(
    lambda xs: torch.tensor(xs, dtype=torch.float32) / 16)
FAST = settings(max_examples=60, deadline=None)


def kept(x: torch.Tensor) -> set[int]:
    return set(torch.isfinite(x).nonzero().flatten().tolist())


# -------------------------------------------------------------------------- repetition penalty
def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.0, -1.0])
    out = apply_repetition_penalty(logits, torch.tensor([0, 1, 3, 0]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0, 0.0, -1.0]  # token 0 seen twice: penalized once
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.0, -1.0]  # input untouched
    assert apply_repetition_penalty(logits, torch.tensor([0]), 1.0) is logits
    assert apply_repetition_penalty(logits, torch.tensor([], dtype=torch.long), 2.0) is logits


@FAST
@given(logit_rows, st.floats(0.5, 3.0), st.data())
def test_repetition_penalty_matches_transformers(logits, penalty, data):
    from transformers import RepetitionPenaltyLogitsProcessor

    seen = data.draw(st.lists(st.integers(0, len(logits) - 1), max_size=20))
    seen_t = torch.tensor(seen, dtype=torch.long)
    ours = apply_repetition_penalty(logits, seen_t, penalty)
    if seen:
        ref = RepetitionPenaltyLogitsProcessor(penalty)(seen_t[None], logits[None].clone())[0]
    else:
        ref = logits
    assert torch.equal(ours, ref)


# ------------------------------------------------------------------------------------ top-k
@FAST
@given(logit_rows, st.integers(0, 80))
def test_top_k_keeps_the_k_largest(logits, k):
    out = filter_top_k(logits, k)
    n = len(logits)
    expect = n if k == 0 or k >= n else k
    keep = kept(out)
    assert len(keep) == expect
    assert keep == set(torch.topk(logits, expect).indices.tolist())
    assert torch.equal(out[list(keep)], logits[list(keep)])  # kept values unchanged


def test_top_k_keeps_ties_at_the_kth_value():
    out = filter_top_k(torch.tensor([3.0, 1.0, 3.0, 2.0]), 1)
    assert kept(out) == {0, 2}


# ------------------------------------------------------------------------------------ top-p
@FAST
@given(logit_rows, st.floats(0.01, 1.0))
def test_top_p_keeps_the_smallest_nucleus(logits, p):
    out = filter_top_p(logits, p)
    probs = logits.softmax(-1)
    keep = kept(out)
    order = torch.argsort(logits, descending=True).tolist()
    assert order[0] in keep  # the most likely token always survives
    assert keep == set(order[:len(keep)])  # a prefix of the descending order
    mass = float(probs[list(keep)].sum())
    if p < 1.0:
        smallest = float(probs[order[len(keep) - 1]])
        # Enough mass, and one token fewer would not have been enough (up to fp32 rounding).
        assert mass >= p - 1e-5 or len(keep) == len(logits)
        assert mass - smallest < p + 1e-5
    else:
        assert len(keep) == len(logits)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8, 0.95])
def test_top_p_matches_transformers(p):
    from transformers import TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = 3 * torch.randn(100, generator=g)
        ref = TopPLogitsWarper(p)(None, logits[None].clone())[0]
        assert kept(filter_top_p(logits, p)) == kept(ref)


# ------------------------------------------------------------------------------------ min-p
@FAST
@given(logit_rows, st.floats(0.0, 1.0))
def test_min_p_drops_tokens_below_a_fraction_of_the_top(logits, min_p):
    out = filter_min_p(logits, min_p)
    probs = logits.softmax(-1)
    keep = kept(out)
    assert int(torch.argmax(logits)) in keep
    for i, q in enumerate(probs.tolist()):
        if q >= min_p * float(probs.max()) * (1 + 1e-6):
            assert i in keep
        elif q < min_p * float(probs.max()) * (1 - 1e-6):
            assert i not in keep


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.5])
def test_min_p_matches_transformers(min_p):
    from transformers import MinPLogitsWarper

    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        logits = 3 * torch.randn(100, generator=g)
        ref = MinPLogitsWarper(min_p)(None, logits[None].clone())[0]
        assert kept(filter_min_p(logits, min_p)) == kept(ref)


def test_filters_that_are_off_return_their_input():
    x = torch.randn(10)
    assert filter_top_k(x, 0) is x and filter_top_k(x, 10) is x
    assert filter_top_p(x, 1.0) is x
    assert filter_min_p(x, 0.0) is x


# ---------------------------------------------------------------------------- sample_token
def test_greedy_is_argmax_after_repetition_penalty():
    logits = torch.tensor([1.0, 3.0, 2.5, -1.0])
    none = torch.tensor([], dtype=torch.long)
    assert sample_token(logits, SamplingParams(temperature=0), none, None) == 1
    # 3.0 / 2 = 1.5 < 2.5: the penalty moves the argmax to token 2.
    assert sample_token(logits, SamplingParams(temperature=0, repetition_penalty=2.0), torch.tensor([1]), None) == 2


@FAST
@given(logit_rows, st.integers(0, 2**31 - 1))
def test_sampling_respects_the_filters(logits, seed):
    g = torch.Generator().manual_seed(seed)
    none = torch.tensor([], dtype=torch.long)
    assert sample_token(logits, SamplingParams(top_k=1), none, g) == int(torch.argmax(logits))
    assert sample_token(logits, SamplingParams(min_p=1.0), none, g) == int(torch.argmax(logits))
    tok = sample_token(logits, SamplingParams(top_k=3, top_p=0.9, temperature=0.7), none, g)
    assert tok in kept(filter_top_p(filter_top_k(logits / 0.7, 3), 0.9))


@FAST
@given(logit_rows, st.integers(0, 2**31 - 1))
def test_seeded_sampling_is_deterministic(logits, seed):
    none = torch.tensor([], dtype=torch.long)
    params = SamplingParams(temperature=1.3, top_p=0.95)
    draw = lambda: [sample_token(logits, params, none, g) for g in [torch.Generator().manual_seed(seed)]
                    for _ in range(5)]
    assert draw() == draw()


def test_sampling_follows_the_distribution():
    """Frequencies of 20k seeded draws match softmax(logits / T) (chi-square, p ~ 1e-6 bound)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    T = 0.8
    probs = (logits / T).softmax(-1)
    g = torch.Generator().manual_seed(0)
    none = torch.tensor([], dtype=torch.long)
    n = 20_000
    counts = torch.zeros(5)
    for _ in range(n):
        counts[sample_token(logits, SamplingParams(temperature=T), none, g)] += 1
    chi2 = float(((counts - n * probs) ** 2 / (n * probs)).sum())
    assert chi2 < 35.0  # 4 degrees of freedom: P(chi2 > 35) ~ 5e-7


def test_top_k_sampling_never_leaves_the_top_k():
    logits = torch.linspace(0, 1, 50)
    g = torch.Generator().manual_seed(0)
    none = torch.tensor([], dtype=torch.long)
    draws = {sample_token(logits, SamplingParams(top_k=5, temperature=5.0), none, g) for _ in range(500)}
    assert draws == set(range(45, 50))


# ---------------------------------------------------------------------------- through the engine
def test_engine_seeded_sampling_is_deterministic(zoo):
    llm = zoo.llm(zoo.dir("llama"))
    prompts = [prompt_ids(zoo.vocab_size, 5, seed=s) for s in range(3)]
    params = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    a = [o.token_ids for o in llm.generate(prompts, params)]
    b = [o.token_ids for o in llm.generate(prompts, params)]
    assert a == b
    # Prompt i of a batch draws from seed + i: the same as running it alone with that seed.
    from dataclasses import replace
    for i, p in enumerate(prompts):
        assert llm.generate(p, replace(params, seed=1234 + i))[0].token_ids == a[i]
    other = [o.token_ids for o in llm.generate(prompts, replace(params, seed=99))]
    assert other != a
    # Temperature sampling actually samples: not the greedy continuation.
    greedy = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert greedy.token_ids != a[0]


def test_engine_repetition_penalty_discourages_repeats(zoo):
    """The tiny Llama repeats a token 9 times greedily (fixture seed); a penalty breaks the run."""
    llm = zoo.llm(zoo.dir("llama_tied"))
    ids = prompt_ids(zoo.vocab_size, 16, seed=0)
    plain = llm.generate(ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].token_ids
    penal = llm.generate(ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                             repetition_penalty=5.0))[0].token_ids
    assert len(set(plain)) < len(plain) // 2
    assert len(set(penal)) > len(set(plain))


def test_sample_categorical_draws_each_token_at_its_probability():
    from tiered.engine.sampling import sample_categorical

    probs = torch.tensor([0.1, 0.0, 0.55, 0.3, 0.05])
    g = torch.Generator().manual_seed(7)
    n = 40000
    counts = torch.zeros(5)
    for _ in range(n):
        counts[sample_categorical(probs, g)] += 1
    assert counts[1] == 0  # a zero-probability token is never drawn
    # each frequency within 5 standard errors of its probability
    se = (probs * (1 - probs) / n).sqrt()
    assert bool(((counts / n - probs).abs() <= 5 * se + 1e-9).all()), counts / n
    # unnormalized mass and a one-hot row
    assert sample_categorical(torch.tensor([0.0, 0.0, 2.0]), g) == 2
    assert sample_categorical(torch.tensor([0.0, 3.0, 0.0]), g) == 1


@pytest.mark.parametrize("scale", [0.3, 3.0, 15.0, 60.0])
def test_top_p_fast_path_equals_the_full_sort(scale):
    """On a large vocabulary filter_top_p takes the top 256 when they hold mass p: the same kept set
    as sorting all V (peaked rows take the fast path, flat rows the sort)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(49152, generator=g) * scale
    for p in (0.5, 0.9, 0.99):
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = torch.zeros(49152, dtype=torch.bool).scatter(0, order, probs.cumsum(-1) - probs >= p)
        assert torch.equal(filter_top_p(logits, p), logits.masked_fill(drop, float("-inf")))


# ------------------------------------------------------------------ the batched native sampler
def _native():
    from tiered.kernels import load

    ext = load()
    if ext is None:
        pytest.skip("native kernels unavailable")
    return ext


def test_sample_rows_inverts_the_cdf():
    """ext.sample_rows = the first token whose float64 CDF of softmax(l / T) exceeds u * total, for
    vocabularies spanning several of its 256-token blocks (ties only at fp32 rounding of a boundary)."""
    ext = _native()
    g = torch.Generator().manual_seed(5)
    for V, T in ((1000, 0.7), (49152, 1.0), (300, 3.0), (7, 0.5)):
        logits = torch.randn(16, V, generator=g) * 4
        u = torch.rand(16, generator=g, dtype=torch.float64)
        temps = torch.full((16,), T)
        got = ext.sample_rows(logits, temps, u)
        cdf = (logits.double() / T).softmax(-1).cumsum(-1)
        for b in range(16):
            ref = int(torch.searchsorted(cdf[b], u[b] * cdf[b, -1], right=True))
            i = int(got[b])
            if i != ref:  # only where u sits within fp32 rounding of the boundary between them
                assert abs(i - ref) == 1 and abs(float(cdf[b, min(i, ref)] - u[b] * cdf[b, -1])) < 1e-5, (V, b, i, ref)


def test_sample_rows_never_draws_masked_tokens_and_checks_input():
    ext = _native()
    logits = torch.full((3, 600), float("-inf"))
    logits[0, 5], logits[1, 599], logits[2, 300] = 1.0, -3.0, 0.0
    logits[2, 301] = 0.0
    u = torch.tensor([0.0, 0.999999999, 0.9999999999999], dtype=torch.float64)
    assert ext.sample_rows(logits, torch.ones(3), u).tolist() == [5, 599, 301]
    with pytest.raises(RuntimeError, match="temperatures must be > 0"):
        ext.sample_rows(logits, torch.zeros(3), u)
    with pytest.raises(RuntimeError, match="float32"):
        ext.sample_rows(logits.double(), torch.ones(3), u)


def test_sample_tokens_batches_plain_rows_and_keeps_filtered_ones_exact():
    """Rows with only a temperature are drawn natively (the distribution holds, chi-square); greedy
    and filtered rows take sample_token unchanged; seeded draws repeat."""
    from tiered.engine.sampling import sample_tokens

    _native()
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]).repeat(4, 1)
    none = torch.tensor([], dtype=torch.long)
    T = 0.8
    plain, greedy, topk = SamplingParams(temperature=T), SamplingParams(temperature=0), SamplingParams(top_k=2)
    gens = [torch.Generator().manual_seed(s) for s in range(4)]
    n, counts = 5000, torch.zeros(5)
    for _ in range(n):
        t = sample_tokens(logits, [plain, greedy, topk, plain], [none] * 4, gens)
        assert t[1] == 0 and t[2] in (0, 1)
        counts[t[0]] += 1
        counts[t[3]] += 1
    probs = (logits[0] / T).softmax(-1)
    chi2 = float(((counts - 2 * n * probs) ** 2 / (2 * n * probs)).sum())
    assert chi2 < 35.0  # 4 degrees of freedom: P(chi2 > 35) ~ 5e-7
    draw = lambda: sample_tokens(logits, [plain] * 4, [none] * 4, [torch.Generator().manual_seed(9)] * 4)
    assert draw() == draw()


def test_categorical_draw_is_the_full_vocabularys_cdf_inverse():
    """sample_categorical sums only the tokens with mass (a nucleus of a 49k vocabulary): the same
    token, for the same uniform number, as inverting the float64 CDF over every token."""
    from tiered.engine.sampling import sample_categorical

    g = torch.Generator().manual_seed(3)
    for trial in range(50):
        logits = torch.randn(5000, generator=g) * 3
        logits[torch.rand(5000, generator=g) < 0.9] = float("-inf")
        probs = logits.softmax(-1)
        cdf = probs.double().cumsum(-1)
        u = torch.rand((), generator=torch.Generator().manual_seed(trial), dtype=torch.float64) * cdf[-1]
        want = min(int(torch.searchsorted(cdf, u, right=True)), int(torch.nonzero(probs)[-1]))
        assert sample_categorical(probs, torch.Generator().manual_seed(trial)) == want


@pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")
@pytest.mark.parametrize("params", [dict(temperature=0.2, top_p=0.9, repetition_penalty=1.1),
                                    dict(temperature=0.8, top_k=40), dict(temperature=1.3, min_p=0.05),
                                    dict(temperature=0.7, top_k=200, top_p=0.95, min_p=0.01, repetition_penalty=1.3)])
def test_sample_filtered_draws_from_the_torch_filters_distribution(params):
    """ext.sample_filtered (sample_tokens' path for rows with filters) draws only tokens the torch
    filters keep (filtered_logits: penalty, / T, top-k, top-p, min-p), each at its probability
    (a CDF inversion at u: a grid of u covers the kept tokens in proportion), and a seeded request
    stays reproducible."""
    from tiered.engine.sampling import sample_tokens

    ext = kernels.load()
    sp = SamplingParams(**params)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(49152, generator=g) * 3
    seen = torch.randint(0, 49152, (64,), generator=g)
    ref = apply_repetition_penalty(logits, seen, sp.repetition_penalty) / sp.temperature
    ref = filter_min_p(filter_top_p(filter_top_k(ref, sp.top_k), sp.top_p), sp.min_p)
    probs = ref.softmax(-1)
    n = 4000
    counts = torch.zeros(49152)
    for j in range(n):
        t = ext.sample_filtered(logits, seen, sp.repetition_penalty, sp.temperature, sp.top_k, sp.top_p, sp.min_p,
                                (j + 0.5) / n)
        counts[t] += 1
    assert float(probs[counts > 0].min()) > 0  # never a token the filters drop
    assert float((counts / n - probs).abs().sum()) < 0.02  # total variation of the u-grid's draws
    draw = lambda s: sample_tokens(logits[None], [sp], [seen], [torch.Generator().manual_seed(s)])
    assert draw(7) == draw(7)


def _spike_over_flat() -> torch.Tensor:
    x = torch.randn(49152, generator=torch.Generator().manual_seed(0)) * 0.1  # no ties (their order is the sort's)
    x[123] = 10.0  # e^10 against 49151 tokens of weight ~1: the candidates (weight >= 1e-4 of the top) miss p
    return x


def _ties_at_the_kth() -> torch.Tensor:
    x = torch.full((3000,), -5.0)
    x[:40] = torch.linspace(4.0, 1.0, 40)
    x[40:60] = 1.0  # the 40th largest value, tied by 20 more tokens: top-k keeps every tie
    return x


@pytest.mark.skipif(kernels.load() is None, reason="tiered/kernels not built")
@pytest.mark.parametrize("make,params", [
    (_spike_over_flat, dict(temperature=1.0, top_p=0.9)),
    (_spike_over_flat, dict(temperature=1.0, top_p=0.5, min_p=1e-5)),
    (_ties_at_the_kth, dict(temperature=1.0, top_k=40, top_p=0.8, min_p=0.2)),
    (_ties_at_the_kth, dict(temperature=0.5, min_p=0.3, repetition_penalty=0.8)),
])
def test_sample_filtered_on_rows_that_take_its_rare_paths(make, params):
    """The native draw's one-pass filters on rows that take their rare paths: a top-p whose
    candidates (weight >= 1e-4 of the top token's) miss p, so every token competes; min-p after
    top-p (a ratio to the top token's weight, unchanged by top-p's renormalization); top-k with ties
    at the k-th value; a penalty below 1 that raises the seen tokens above the unpenalized maximum.
    At each u of a grid the draw is a token where the torch filters' distribution's CDF, in token
    order as the native draw inverts it, passes u, within 0.005 (where many tokens of ~1e-5 each sit
    at top-p's cut, the two keep sets may differ by a few of them, float against double sums)."""
    ext = kernels.load()
    sp = SamplingParams(**params)
    logits = make()
    seen = torch.arange(0, 60, 7)
    ref = apply_repetition_penalty(logits, seen, sp.repetition_penalty) / sp.temperature
    probs = filter_min_p(filter_top_p(filter_top_k(ref, sp.top_k), sp.top_p), sp.min_p).softmax(-1).double()
    cdf = probs.cumsum(-1) / probs.sum()
    n = 2000
    exact = 0
    for j in range(n):
        u = (j + 0.5) / n
        got = ext.sample_filtered(logits, seen, sp.repetition_penalty, sp.temperature, sp.top_k, sp.top_p,
                                  sp.min_p, u)
        assert probs[got] > 0  # never a token the filters drop
        before, upto = float(cdf[got] - probs[got] / probs.sum()), float(cdf[got])
        assert before - 0.005 <= u <= upto + 0.005
        exact += before <= u < upto
    assert exact >= 0.5 * n


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan")]), min_size=1, max_size=40))
def test_greedy_token_is_torch_argmax(values):
    """The numpy argmax greedy decoding takes on the CPU picks what torch.argmax picks: the first of
    equal maxima, a NaN as the maximum, all -inf rows at 0."""
    from tiered.engine.sampling import greedy_token, sample_tokens

    x = torch.tensor(values, dtype=torch.float32)
    assert greedy_token(x) == int(torch.argmax(x))
    # rows of a batch, all greedy: sample_tokens' one numpy argmax over the rows
    rows = torch.stack([x, x.flip(0)])
    greedy = SamplingParams(temperature=0.0)
    assert sample_tokens(rows, [greedy, greedy], [torch.empty(0, dtype=torch.long)] * 2, [None, None]) == \
        [int(torch.argmax(r)) for r in rows]


@pytest.mark.parametrize("temperature", [GREEDY_TEMPERATURE / 2, 1e-40, 1e-44, 5e-324])
def test_tiny_temperatures_are_greedy_and_spare_the_batch(temperature):
    """A temperature whose 1/T overflows fp32, or that rounds to 0 there, samples the argmax on every
    path (native plain rows, native filtered rows, torch): the native samplers used to refuse it,
    failing every row of the batch, or to draw garbage."""
    from tiered.engine.sampling import sample_tokens

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 5000, generator=g) * 3
    none = torch.tensor([], dtype=torch.long)
    tiny = [SamplingParams(temperature=temperature), SamplingParams(temperature=temperature, top_p=0.5),
            SamplingParams(temperature=temperature, repetition_penalty=1.1)]
    assert all(p.greedy for p in tiny) and not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    other = SamplingParams(temperature=1.0)  # a neighbour in the batch still samples
    tokens = sample_tokens(logits, tiny + [other], [none] * 4, [torch.Generator().manual_seed(s) for s in range(4)])
    assert tokens[:3] == logits[:3].argmax(-1).tolist() and 0 <= tokens[3] < 5000
    for row, p in zip(logits, tiny):
        assert sample_token(row, p, none, None) == int(row.argmax())


def test_a_tiny_top_p_keeps_the_most_likely_token():
    """top_p = 1e-320 (0 in fp32) keeps the top token alone on the native and torch paths, as any
    top_p below the top token's probability does; it used to keep none and draw token 0."""
    from tiered.engine.sampling import sample_tokens

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5000, generator=g) * 3
    none = torch.tensor([], dtype=torch.long)
    params = [SamplingParams(temperature=1.0, top_p=1e-320), SamplingParams(temperature=0.7, top_p=1e-45),
              SamplingParams(temperature=1.0, top_p=1e-320, repetition_penalty=1.0, top_k=10)]
    for seed in range(5):
        gens = [torch.Generator().manual_seed(seed + i) for i in range(3)]
        assert sample_tokens(logits, params, [none] * 3, gens) == logits.argmax(-1).tolist()
    assert sample_token(logits[0], params[0], none, None) == int(logits[0].argmax())


def test_sampling_params_refuse_what_the_sampler_cannot_take():
    from tiered.errors import ConfigError

    for bad in (dict(temperature=float("inf")), dict(temperature=float("nan")), dict(seed=2**63),
                dict(seed=-2**63 - 1), dict(repetition_penalty=float("inf"))):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1 and SamplingParams(seed=-2**63).seed == -2**63


def test_logit_bias_and_openai_penalties_adjust_the_row():
    """OpenAI's formula: logits + bias - presence * (count > 0) - frequency * count, counts over the
    generated tokens; a dict bias is kept as sorted pairs; out-of-range values are refused."""
    from tiered.engine.sampling import adjust_logits
    from tiered.errors import ConfigError

    logits = torch.randn(10)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={7: 3.0, 2: -100})
    assert p.logit_bias == ((2, -100.0), (7, 3.0)) and p.adjusts_logits and not SamplingParams().adjusts_logits
    out = adjust_logits(logits, p, [4, 4, 1, 4])
    want = logits.clone()
    want[2] -= 100
    want[7] += 3
    want[4] -= 0.5 + 3 * 0.25
    want[1] -= 0.5 + 0.25
    assert torch.allclose(out, want) and not torch.equal(out, logits)  # a new row: the raw one stays
    assert adjust_logits(logits, SamplingParams(), [4]) is logits
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(logit_bias={5: 101}),
                dict(logit_bias={-1: 1}), dict(logit_bias={"x": 1}), dict(presence_penalty=float("nan"))):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)


def test_engine_applies_logit_bias_and_penalties_in_every_decode_path(zoo):
    """generate (whose lone request decodes in native bursts elsewhere) and a batch: a +100 bias makes a
    token every greedy pick, -100 bans the greedy token, a frequency penalty breaks the tiny Llama's
    repeats; logprobs stay the raw model's; a bias on a token past the vocabulary is refused."""
    from dataclasses import replace

    from tiered.errors import ConfigError

    llm = zoo.llm(zoo.dir("llama_tied"))
    ids = prompt_ids(zoo.vocab_size, 16, seed=0)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = llm.generate(ids, greedy)[0].token_ids
    forced = replace(greedy, logit_bias={5: 100.0})
    for outs in (llm.generate(ids, forced), llm.generate([ids, prompt_ids(zoo.vocab_size, 9, seed=1)], forced)):
        assert all(o.token_ids == [5] * 16 for o in outs)
    raw = llm.generate(ids, replace(greedy, logprobs=0, max_tokens=1))[0].logprobs[0]
    biased = llm.generate(ids, replace(forced, logprobs=0, max_tokens=1))[0].logprobs[0]
    assert biased.token == 5 and biased.logprob < raw.logprob  # the raw model's log-probability of token 5
    banned = llm.generate(ids, replace(greedy, logit_bias={plain[0]: -100.0}))[0].token_ids
    assert plain[0] not in banned
    penal = llm.generate(ids, replace(greedy, frequency_penalty=2.0))[0].token_ids
    assert len(set(plain)) < len(plain) // 2 and len(set(penal)) > len(set(plain))
    with pytest.raises(ConfigError, match="logit_bias has token id"):
        llm.generate(ids, replace(greedy, logit_bias={zoo.vocab_size: 1.0}))


@pytest.mark.parametrize("name", ["llama_tied", "mixtral"])
def test_prompt_logprobs_are_the_models_scores_of_each_prompt_token(zoo, rt, monkeypatch, name):
    """SamplingParams.prompt_logprobs: None for the first prompt token, then each token's log-softmax
    under the model given the tokens before it (LLM.logits of the prompt, within 1e-5; transformers'
    too) with the k most likely alternatives; the generated tokens are those of a plain generate. Every
    path scores the same: the prompt as rows of the native step (where the plan runs it so), through
    the modules in one forward or chunk by chunk, and either with the logits a few positions at a time
    (sizes.score_rows); a one-token prompt has only the None."""
    from dataclasses import replace

    from tiered import LLM, EngineConfig
    from tiered.memory import sizes

    path = zoo.dir(name) if name == "llama_tied" else rt.dir(name)
    hf = zoo.hf(name) if name == "llama_tied" else rt.hf(name)
    config = EngineConfig(decode_weights="fp32", max_context=48, accelerator="none")
    ids = prompt_ids(min(zoo.vocab_size, 256), 40, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(path, config) as llm:
        want = llm.logits(ids).log_softmax(-1)
        plain = llm.generate(ids, sp)[0].token_ids
    ref = torch.nn.functional.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    rows = torch.arange(len(ids) - 1)
    assert torch.allclose(want[rows, ids[1:]], ref[rows, ids[1:]], atol=1e-5)

    def scored(native: bool, chunk: int | None = None, span: int | None = None) -> None:
        with monkeypatch.context() as m:
            if chunk:
                m.setattr(sizes, "CPU_PREFILL_TOKENS", chunk)
            if span:
                m.setattr(sizes, "score_rows", lambda cfg, fmt, tokens: span)
            with LLM(path, config) as llm:
                assert llm.plan.prefill_chunk == (chunk or sizes.CPU_PREFILL_TOKENS)
                if not native:
                    llm.plan.mixed_rows = 0
                elif kernels.available():  # the native step takes the whole prompt as rows
                    assert llm.runtime.cpu_decode is not None and llm.plan.most_prompt_rows() >= len(ids)
                out, one = llm.generate([ids, ids[:1]], replace(sp, prompt_logprobs=3))
        assert out.token_ids == plain and one.prompt_logprobs == [None]
        entries = out.prompt_logprobs
        assert len(entries) == len(ids) and entries[0] is None and [e.token for e in entries[1:]] == ids[1:]
        got = torch.tensor([e.logprob for e in entries[1:]])
        assert torch.allclose(got, want[rows, ids[1:]], atol=1e-5), (native, chunk, span)
        for i, e in enumerate(entries[1:]):
            values, top = want[i].topk(3)
            assert [t for t, _ in e.top] == top.tolist()
            assert torch.allclose(torch.tensor([v for _, v in e.top]), values, atol=1e-5)

    scored(native=True)
    scored(native=True, span=7)  # native steps of 7 rows
    scored(native=False)
    scored(native=False, chunk=16, span=5)  # chunks of 16 tokens, the lm_head 5 rows a call
