"""Routing traces (`tiered profile-experts --trace`) and the cache simulator (`tiered cache-sim`):
a trace recorded from a tiny MoE fixture, replayed through every policy, checked against an
independent LRU and against the counts that capacity 0 and unlimited capacity force."""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np
import pytest
from typer.testing import CliRunner

from runtime_fixtures import engine_config, prompt, rt  # noqa: F401

from tiered import LLM, SamplingParams
from tiered.cli import app
from tiered.errors import ConfigError
from tiered.memory.cache_sim import HIGH, LOW, SKIP, precisions, replay, unimportance
from tiered.memory.expert_cache import POLICIES
from tiered.runtime.routing_trace import RoutingRecorder, RoutingTrace, prediction_accuracy

SEQS, PROMPT, NEW = 3, 10, 6


@pytest.fixture(scope="module")
def mixtral_trace(rt, tmp_path_factory):
    """A trace of 3 sequences (10 prompt tokens, 6 generated) on the mixtral fixture, written by the CLI."""
    d = tmp_path_factory.mktemp("trace")
    prompts = d / "prompts.txt"
    prompts.write_text("\n".join(" ".join(map(str, prompt(PROMPT, seed=s))) for s in range(SEQS)) + "\n")
    res = CliRunner().invoke(app, ["profile-experts", str(prompts), "-m", str(rt.dir("mixtral")), "-o",
                                   str(d / "p.json"), "-n", str(NEW), "--trace", str(d / "t.npz"), "--lookahead", "1"])
    assert res.exit_code == 0, res.output
    assert "prediction recall 1 layer ahead" in res.output
    return d / "t.npz"


def test_trace_records_every_token_and_layer(rt, mixtral_trace):
    tr = RoutingTrace.load(mixtral_trace)
    steps = 1 + (NEW - 1)  # the prefill, then one decode step per further token
    assert len(tr) == SEQS * (PROMPT + NEW - 1) * 2  # every token's row at both MoE layers
    assert tr.meta["moe_layers"] == [0, 1] and tr.meta["top_k"] == 2 and tr.meta["lookahead"] == 1
    assert tr.experts.shape == tr.weights.shape == (len(tr), 2) and tr.predicted.shape == (len(tr), 1, 2)
    assert np.allclose(tr.weights.sum(axis=1), 1, atol=1e-5)  # Mixtral normalises over its top-2
    assert (tr.weights[:, 0] >= tr.weights[:, 1]).all()  # top-k order, largest gate first
    assert (tr.predicted[tr.layer == 0] >= 0).all() and (tr.predicted[tr.layer == 1] == -1).all()
    assert len(list(tr.groups())) == SEQS * steps * 2
    first = tr.seq == 0
    assert tr.pos[first].max() == PROMPT + NEW - 2
    # the rows hold the model's routing: the first prefill step's layer-0 rows equal the router's choice
    llm = LLM(rt.dir("mixtral"), engine_config())
    try:
        seen = []
        llm.model.model.layers[0].mlp.on_route = lambda l, i, w: seen.append(i.clone())
        llm.generate([prompt(PROMPT, seed=0)], SamplingParams(temperature=0, max_tokens=1))
        assert np.array_equal(seen[0].cpu().numpy(), tr.experts[(tr.seq == 0) & (tr.layer == 0)][:PROMPT])
    finally:
        llm.close()


def test_trace_round_trips_and_refuses_other_files(mixtral_trace, tmp_path):
    tr = RoutingTrace.load(mixtral_trace)
    tr.save(tmp_path / "copy.npz")
    back = RoutingTrace.load(tmp_path / "copy.npz")
    assert back.meta == tr.meta and all(np.array_equal(getattr(back, k), getattr(tr, k))
                                        for k in ("seq", "pos", "step", "layer", "experts", "weights", "predicted"))
    with pytest.raises(ConfigError, match="no routing trace"):
        RoutingTrace.load(tmp_path / "none.npz")
    (tmp_path / "bad.npz").write_text("not a trace")
    with pytest.raises(ConfigError, match="not a routing trace"):
        RoutingTrace.load(tmp_path / "bad.npz")


def lru_reference(tr: RoutingTrace, capacity: int) -> int:
    """Hits of a textbook LRU (OrderedDict) with the layer's experts pinned, on the trace's routing calls."""
    cache: OrderedDict = OrderedDict()
    hits = 0
    for _, _, layer, rows in tr.groups():
        keys = [(layer, e) for e in sorted(set(tr.experts[rows].ravel().tolist()))]
        for k in keys:
            if k in cache:
                hits += 1
                cache.move_to_end(k)
        for k in keys:
            if k not in cache:
                victims = [v for v in cache if v not in keys]
                if len(cache) >= capacity:
                    if not victims:
                        continue
                    del cache[victims[0]]
                cache[k] = True
    return hits


@pytest.mark.parametrize("capacity", [1, 3, 6])
def test_lru_replay_matches_a_reference_lru(mixtral_trace, capacity):
    tr = RoutingTrace.load(mixtral_trace)
    r = replay(tr, capacity, "lru")
    assert r.hits == lru_reference(tr, capacity)
    assert r.uses == sum(len(set(tr.experts[rows].ravel().tolist())) for *_, rows in tr.groups())


def test_capacity_bounds_and_penalty(mixtral_trace):
    tr = RoutingTrace.load(mixtral_trace)
    eb = tr.meta["expert_bytes"]["bf16"]
    distinct = len({(int(l), int(e)) for l, row in zip(tr.layer, tr.experts) for e in row})
    for name in POLICIES:
        none = replay(tr, 0, name, bandwidth=1e9, latency=1e-4)
        assert none.hits == 0 and none.misses == none.uses and none.penalty_bytes == none.uses * eb
        assert none.penalty_s == pytest.approx(none.uses * 1e-4 + none.uses * eb / 1e9)
        full = replay(tr, 16, name)  # room for every expert: only compulsory misses
        assert full.misses == distinct and full.hit_rate > 0.5
    small = {n: replay(tr, 4, n) for n in POLICIES}
    assert all(0 < r.hits < r.uses for r in small.values())


def test_mixed_precision_pools(mixtral_trace):
    tr = RoutingTrace.load(mixtral_trace)
    eb = tr.meta["expert_bytes"]
    r = replay(tr, 4, "hobbit", low_capacity=2, t1=0.0, t2=1.0)  # every second expert is low precision
    assert r.misses_low > 0 and r.misses_high > 0 and r.skipped == 0
    assert r.penalty_bytes == r.misses_high * eb["bf16"] + r.misses_low * eb["int4"]
    skip = replay(tr, 4, "hobbit", low_capacity=2, t1=0.0, t2=0.0)  # every second expert skipped on a miss
    assert skip.skipped > 0 and skip.misses_low == 0
    with pytest.raises(ConfigError, match="low-precision pool"):
        replay(tr, 4, "lru", t1=0.5, t2=0.9)
    with pytest.raises(ConfigError, match="T1 <= T2"):
        replay(tr, 4, "lru", low_capacity=1, t1=0.9, t2=0.5)


def test_prefetch_replay_and_accuracy(mixtral_trace):
    tr = RoutingTrace.load(mixtral_trace)
    acc = prediction_accuracy(tr)
    assert set(acc) == {1} and acc[1] > 0.25  # better than a blind top-2 guess of 8 experts
    r = replay(tr, 6, "lru", prefetch=True)
    assert r.accuracy == acc and 0 < r.prefetch_useful <= r.prefetch_loads
    assert r.prefetch_bytes == r.prefetch_loads * tr.meta["expert_bytes"]["bf16"]


def test_unimportance_is_hobbit_eq2():
    w = np.array([[0.7, 0.3], [0.3, 0.7], [0.95, 0.05], [0.55, 0.45], [0.5, 0.3, 0.2][:2]])
    assert np.allclose(unimportance(np.array([[0.2, 0.5, 0.3]])), [[0.8, 0.0, 0.5]])
    assert np.allclose(unimportance(w)[:4], [[0, 0.7], [0.7, 0], [0, 0.95], [0, 0.55]])
    assert precisions(w[:4], 0.6, 0.9).tolist() == [[HIGH, LOW], [LOW, HIGH], [HIGH, SKIP], [HIGH, HIGH]]


def test_cache_sim_cli(mixtral_trace):
    res = CliRunner().invoke(app, ["cache-sim", "--trace", str(mixtral_trace), "--capacity", "4", "--policy", "all",
                                   "--bandwidth", "1GB", "--prefetch"])
    assert res.exit_code == 0, res.output
    for name in POLICIES:
        assert f"│ {name}" in res.output
    assert "prediction recall: 1 ahead" in res.output and "priced by --bandwidth 1GB" in res.output
    js = CliRunner().invoke(app, ["cache-sim", "--trace", str(mixtral_trace), "--capacity", "4", "--policy", "fld",
                                  "--json"])
    out = json.loads(js.output)
    assert [r["policy"] for r in out["results"]] == ["fld"]
    assert out["results"][0]["hits"] == replay(RoutingTrace.load(mixtral_trace), 4, "fld").hits
    tuned = CliRunner().invoke(app, ["cache-sim", "--trace", str(mixtral_trace), "--capacity", "4", "--policy", "hobbit",
                                     "--weights", "0.7,0.1,0.1,0.1", "--tune"])
    assert tuned.exit_code == 0, tuned.output
    assert "hobbit (tuned)" in tuned.output and "tuned hobbit weights" in tuned.output
    bad_w = CliRunner().invoke(app, ["cache-sim", "--trace", str(mixtral_trace), "--capacity", "4", "--weights", "1,1"])
    assert bad_w.exit_code == 2 and "sum" in bad_w.output
    bad = CliRunner().invoke(app, ["cache-sim", "--trace", str(mixtral_trace) + ".missing", "--capacity", "4"])
    assert bad.exit_code == 2 and "no routing trace" in bad.output


def test_tuned_hobbit_weights_minimise_the_penalty(mixtral_trace):
    from tiered.memory.cache_sim import simplex, tune_weights

    tr = RoutingTrace.load(mixtral_trace)
    calib = tr.select([0, 1])
    assert set(calib.seq.tolist()) == {0, 1} and len(calib) == 2 * len(tr) // 3
    grid = simplex(0.5)
    assert len(grid) == 10 and all(abs(sum(w) - 1) < 1e-9 for w in grid)
    w, best = tune_weights(calib, 3, step=0.5)
    assert w in grid
    assert all(best.penalty_bytes <= replay(calib, 3, "hobbit", weights=g).penalty_bytes for g in grid)


@pytest.mark.parametrize("policy", ["lru", "fld"])
def test_replay_reproduces_the_runtime_cache(rt, policy):
    """The simulator replays the runtime's own order: a trace recorded while the runtime (experts on
    disk, a 3-slot RAM cache) generates gives exactly the runtime cache's hits and misses."""
    s = rt.sizes("mixtral")
    llm = LLM(rt.dir("mixtral"), engine_config(accelerator="none", cpu_memory=s.fast(cache_slots=3, accelerator=False),
                                               expert_cache_slots=3, cache_policy=policy))
    try:
        rec = RoutingRecorder(llm.model, llm.config, lookahead=0)
        llm.generate([prompt(PROMPT)], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
        st = llm.experts.cache.stats
        r = replay(rec.trace(), 3, policy)
        assert (r.hits, r.misses) == (st.hits, st.misses) and st.evictions > 0
    finally:
        llm.close()
