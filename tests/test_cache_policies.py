"""Expert-cache eviction policies (HOBBIT §3.3, Eq. 3): each policy's victim on hand-made use sequences,
cache invariants under random access streams, per-sequence reset and miss-penalty accounting."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tiered.errors import ConfigError
from tiered.memory.expert_cache import (POLICIES, ExpertCache, FLDPolicy, HobbitPolicy, LFUPolicy, LHUPolicy,
                                        LRUPolicy, RandomPolicy, make_policy)


def sim_cache(slots: int, policy, high: bool = True, item_bytes: int = 100) -> ExpertCache:
    """A cache of empty slots (no tensors worth the name): policy and accounting only."""
    return ExpertCache(slots, ((0,),), torch.float32, lambda s, d, w: torch.empty(s), policy, high=high,
                       item_bytes=item_bytes)


def use(cache: ExpertCache, key, tokens: int = 1, pinned=()):
    """The runtime's order for one expert: lookup, then claim a slot on a miss."""
    if cache.lookup(key, tokens) is None:
        assert cache.claim(key, set(pinned) | {key}, tokens) is not None


def test_every_policy_is_named_and_made():
    assert set(POLICIES) == {"random", "lru", "lfu", "lhu", "fld", "hobbit"}
    assert isinstance(make_policy("fld", 4), FLDPolicy) and make_policy("fld", 4).num_layers == 4
    with pytest.raises(ConfigError, match="unknown cache policy 'mru'"):
        make_policy("mru")
    with pytest.raises(ConfigError, match="sum"):
        HobbitPolicy(2, (0.5, 0.5, 0.5, 0.0))


def test_engine_config_checks_policy_and_lookahead():
    from tiered import EngineConfig

    assert EngineConfig(cache_policy="hobbit", prefetch=True, prefetch_lookahead=3).prefetch_lookahead == 3
    with pytest.raises(ConfigError, match="cache_policy must be one of"):
        EngineConfig(cache_policy="mru")
    with pytest.raises(ConfigError, match="prefetch_lookahead"):
        EngineConfig(prefetch_lookahead=0)


def test_lfu_counts_tokens_not_lookups():
    """F_t counts the tokens that used an expert (gap H6): one prefill lookup by 5 tokens outweighs 3 decode uses."""
    cache = sim_cache(2, LFUPolicy(2))
    cache.begin_layer(0, 5)
    use(cache, (0, 1), tokens=5)
    for _ in range(3):
        cache.begin_layer(0, 1)
        use(cache, (0, 2))
    cache.begin_layer(0, 1)
    use(cache, (0, 3))
    assert set(cache.where) == {(0, 1), (0, 3)}


def test_lhu_evicts_the_expert_least_used_at_high_precision():
    """One policy shared by a high and a low pool: uses from the low pool do not count for LHU."""
    pol = LHUPolicy(2)
    hi, lo = sim_cache(2, pol, high=True), sim_cache(4, pol, high=False)
    pol.begin_layer(0, 1)
    use(hi, (0, 1))
    use(hi, (0, 2))
    for _ in range(3):  # expert 2 used often, but only in low precision
        pol.begin_layer(0, 1)
        use(lo, (0, 2))
    pol.begin_layer(0, 1)
    use(hi, (0, 1))  # high uses: expert 1 two, expert 2 one
    use(hi, (0, 3))
    assert set(hi.where) == {(0, 1), (0, 3)}
    assert pol.uses[(0, 2)] == 4 and pol.high_uses[(0, 2)] == 1
    lfu = LFUPolicy(2)  # the same stream under LFU keeps expert 2 (4 uses in all)
    hi2, lo2 = sim_cache(2, lfu), sim_cache(4, lfu, high=False)
    lfu.begin_layer(0, 1)
    use(hi2, (0, 1)); use(hi2, (0, 2))
    for _ in range(3):
        lfu.begin_layer(0, 1); use(lo2, (0, 2))
    lfu.begin_layer(0, 1)
    use(hi2, (0, 1)); use(hi2, (0, 3))
    assert set(hi2.where) == {(0, 2), (0, 3)}


def test_fld_evicts_the_layer_just_finished():
    """l_n = 4, layer in flight 2: distances 0 (L2), 1 (L3), 2 (L0), 3 (L1) -> L1 goes first, then L0."""
    pol = FLDPolicy(4)
    cache = sim_cache(4, pol)
    for layer in range(4):
        pol.begin_layer(layer, 1)
        use(cache, (layer, 0))
    pol.begin_layer(0, 1)
    pol.begin_layer(1, 1)
    pol.begin_layer(2, 1)
    assert [pol.fld((l, 0)) for l in range(4)] == [0.5, 0.25, 1.0, 0.75]
    use(cache, (2, 5))
    assert (1, 0) not in cache
    use(cache, (2, 6))
    assert (0, 0) not in cache and set(cache.where) == {(2, 0), (3, 0), (2, 5), (2, 6)}


def test_hobbit_priority_is_eq3():
    """p_t = w_lru R_t/T + w_lfu F_t/T + w_lhu H_t/T + w_fld p^fld, evaluated by hand."""
    w = (0.4, 0.3, 0.2, 0.1)
    pol = HobbitPolicy(2, w)
    hi, lo = sim_cache(8, pol), sim_cache(8, pol, high=False)
    pol.begin_layer(0, 3)  # prefill, 3 tokens: T = 3
    use(hi, (0, 0), tokens=3)
    use(lo, (0, 1), tokens=1)
    pol.begin_layer(1, 3)
    use(hi, (1, 0), tokens=2)
    pol.begin_layer(0, 1)  # decode token: T = 4, R = 4 for what it uses
    use(lo, (0, 1))
    pol.begin_layer(1, 1)  # layer in flight 1: p^fld(L0) = 1/2, p^fld(L1) = 1
    want = {(0, 0): 0.4 * 3 / 4 + 0.3 * 3 / 4 + 0.2 * 3 / 4 + 0.1 * 0.5,
            (0, 1): 0.4 * 4 / 4 + 0.3 * 2 / 4 + 0.2 * 0 / 4 + 0.1 * 0.5,
            (1, 0): 0.4 * 3 / 4 + 0.3 * 2 / 4 + 0.2 * 2 / 4 + 0.1 * 1.0}
    for k, p in want.items():
        assert pol.score(k) == pytest.approx(p)
    assert pol.victim(list(want)) == min(want, key=want.get) == (0, 1)


def test_new_sequence_resets_usage_but_keeps_contents():
    pol = LFUPolicy(1)
    cache = sim_cache(2, pol)
    for _ in range(3):
        pol.begin_layer(0, 1)
        use(cache, (0, 1))
    cache.protected.add((0, 1))
    cache.new_sequence()
    assert pol.uses == {} and pol.tokens == 0 and not cache.protected and (0, 1) in cache
    pol.begin_layer(0, 1)
    use(cache, (0, 2))
    use(cache, (0, 2))  # a hit: expert 2 now has 2 uses, expert 1 none this sequence
    use(cache, (0, 3))
    assert set(cache.where) == {(0, 2), (0, 3)}


def test_random_policy_is_seeded_and_picks_a_candidate():
    picks = [RandomPolicy(1, seed=3).victim(list("abcdef")) for _ in range(3)]
    assert len(set(picks)) == 1 and picks[0] in "abcdef"
    pol = RandomPolicy(1, seed=0)
    assert {pol.victim(list("abcd")) for _ in range(200)} == set("abcd")


def test_miss_penalty_in_bytes_and_seconds():
    cache = sim_cache(1, LRUPolicy(), item_bytes=1000)
    for k in [(0, 1), (0, 2), (0, 2), (0, 1)]:
        use(cache, k)
    st_ = cache.stats
    assert (st_.hits, st_.misses, st_.miss_bytes) == (1, 3, 3000)
    assert st_.miss_seconds(bandwidth=1e3, latency=0.5) == pytest.approx(3 * 0.5 + 3.0)


def test_protected_keys_are_not_evicted():
    for name in POLICIES:
        cache = sim_cache(2, make_policy(name, 2))
        use(cache, (0, 1))
        use(cache, (1, 1))
        cache.protected = {(0, 1), (1, 1)}
        assert cache.claim((0, 2), {(0, 2)}) is None
        cache.protected = {(0, 1)}
        use(cache, (0, 2))
        assert set(cache.where) == {(0, 1), (0, 2)}, name


ACCESSES = st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True)),
                    min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(ACCESSES, st.integers(1, 6))
def test_lru_matches_an_ordered_dict_reference(steps, slots):
    """The cache under LRU hits exactly where a textbook OrderedDict LRU (with the layer's experts
    pinned while it runs) hits."""
    cache = sim_cache(slots, LRUPolicy(4))
    ref: OrderedDict = OrderedDict()
    hits = ref_hits = 0
    for layer, experts in steps:
        keys = [(layer, e) for e in experts]
        cache.begin_layer(layer, 1)
        missing = []
        for k in keys:
            if cache.lookup(k) is not None:
                hits += 1
            else:
                missing.append(k)
            if k in ref:
                ref_hits += 1
                ref.move_to_end(k)
        for k in missing:
            cache.claim(k, set(keys))
            if k not in ref:
                if len(ref) >= slots:
                    victim = next((v for v in ref if v not in keys), None)
                    if victim is None:
                        continue
                    del ref[victim]
                ref[k] = True
        assert set(cache.where) == set(ref)
    assert hits == ref_hits


@settings(max_examples=40, deadline=None)
@given(ACCESSES, st.integers(1, 5), st.sampled_from(sorted(POLICIES)))
def test_any_policy_keeps_capacity_and_pinned_keys(steps, slots, name):
    cache = sim_cache(slots, make_policy(name, 4))
    lookups = 0
    for layer, experts in steps:
        keys = {(layer, e) for e in experts}
        cache.begin_layer(layer, 1)
        resident_before = set(cache.where)
        for k in sorted(keys):
            lookups += 1
            if cache.lookup(k) is None:
                cache.claim(k, keys)
        assert len(cache.where) <= slots
        assert (resident_before & keys) <= set(cache.where)  # a key of the layer in flight is never evicted
    assert cache.stats.hits + cache.stats.misses == lookups
