"""Beam search (engine/beam.py, LLM.beam_search) against transformers' generate(num_beams=...):
the same hypotheses, scores and lengths in the lossless fp32 mode, on a dense model and on MoE models
whose experts run behind the host stand-in or stream from disk (a step's beams are rows of the
expert runtime's dispatch)."""

from __future__ import annotations

import json

import pytest
import torch

from fixtures import hf_greedy, prompt_ids
from runtime_fixtures import engine_config, prompt, rt  # noqa: F401
from tiered import LLM, BeamSearchParams, SamplingParams
from tiered.engine.beam import BeamSearch
from tiered.errors import ConfigError
from tiered.models.layers import KVCache


def hf_beams(model, ids: list[int], p: BeamSearchParams) -> tuple[list[list[int]], list[float]]:
    """transformers' hypotheses (generated tokens, cut after a stop token) and their scores."""
    x = torch.tensor([ids])
    stop = list(p.stop_token_ids)
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), num_beams=p.width, do_sample=False,
                             max_new_tokens=p.max_tokens, num_return_sequences=p.width, pad_token_id=0,
                             eos_token_id=stop or None, length_penalty=p.length_penalty,
                             early_stopping=p.early_stopping, output_scores=True, return_dict_in_generate=True)
    seqs = []
    for row in out.sequences[:, len(ids):].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
        seqs.append(row[:cut])
    return seqs, out.sequences_scores.tolist()


def liked_tokens(model, ids: list[int], width: int, n: int) -> tuple[int, ...]:
    """`n` tokens the unconstrained beams generate early: as stop tokens they end beams mid-search."""
    free, _ = hf_beams(model, ids, BeamSearchParams(width=width, max_tokens=6))
    return tuple(dict.fromkeys(t for row in free for t in row[1:]))[:n]


def assert_same(out, ref) -> None:
    seqs, scores = ref
    assert [h.token_ids for h in out.hypotheses] == seqs
    assert [h.score for h in out.hypotheses] == pytest.approx(scores, abs=1e-4)


@pytest.mark.parametrize("width, stops, length_penalty, early_stopping", [
    (4, 0, 1.0, False),
    (3, 3, 1.0, False),  # several stop tokens: more candidates a step, hypotheses of different lengths
    (4, 3, 2.0, True),
    (2, 2, 0.0, "never"),
    (4, 1, -0.5, False),
], ids=["plain", "stops", "early", "never", "short-favoured"])
def test_beam_search_matches_transformers(zoo, width, stops, length_penalty, early_stopping):
    hf, llm = zoo.hf("llama"), zoo.llm(zoo.dir("llama"))
    ids = prompt_ids(zoo.vocab_size, 10, seed=5)
    stop = liked_tokens(hf, ids, width, stops) if stops else ()
    p = BeamSearchParams(width=width, max_tokens=12, length_penalty=length_penalty, early_stopping=early_stopping,
                         stop_token_ids=stop, ignore_eos=True)
    out = llm.beam_search(ids, p)
    ref = hf_beams(hf, ids, p)
    assert_same(out, ref)
    if stops:  # the stop tokens really ended hypotheses early
        assert any(h.finish_reason == "stop" for h in out.hypotheses)
    assert out.stats.generated_tokens >= max(len(s) for s in ref[0])  # steps run, the longest hypothesis' tokens
    assert out.best is out.hypotheses[0] and out.stats.prompt_tokens == len(ids)


def test_width_one_is_greedy_decoding(zoo):
    hf, llm = zoo.hf("qwen3"), zoo.llm(zoo.dir("qwen3"))
    ids = prompt_ids(zoo.vocab_size, 9, seed=3)
    out = llm.beam_search(ids, BeamSearchParams(width=1, max_tokens=10, ignore_eos=True))
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert out.best.token_ids == llm.generate(ids, greedy)[0].token_ids == hf_greedy(hf, ids, 10)


def test_text_leaves_out_the_stop_token(zoo):
    llm = zoo.llm(zoo.dir("llama"))
    ids = prompt_ids(zoo.vocab_size, 10, seed=5)
    stop = liked_tokens(zoo.hf("llama"), ids, 3, 3)
    out = llm.beam_search(ids, BeamSearchParams(width=3, max_tokens=12, stop_token_ids=stop, ignore_eos=True))
    h = next(h for h in out.hypotheses if h.finish_reason == "stop")
    assert h.token_ids[-1] in stop
    assert h.text == llm.tokenizer.decode(h.token_ids[:-1], skip_special_tokens=True)


def moe_params(rt, kind: str) -> tuple[list[int], BeamSearchParams]:
    ids = prompt(12, seed=4)
    stop = liked_tokens(rt.hf(kind), ids, 4, 2)
    return ids, BeamSearchParams(width=4, max_tokens=10, stop_token_ids=stop, ignore_eos=True)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_moe_beams_behind_the_host_accelerator_match_transformers(rt, kind):
    """Experts in CPU RAM behind the strict host stand-in, 2 cache slots: a step's 4 beams are rows of
    the dispatch (CPU or copied), and the KV rows move between slots on the device (DeepSeek's: the
    latent attention's one latent row per position)."""
    s = rt.sizes(kind)
    ids, p = moe_params(rt, kind)
    with LLM(rt.dir(kind), engine_config(accelerator="host", max_batch=p.width, expert_cache_slots=2,
                                         gpu_memory=s.fast(cache_slots=2) + (p.width - 1) * s.kv,
                                         cpu_memory="64MiB")) as llm:
        out = llm.beam_search(ids, p)
        paths = llm.experts.path_counts
    assert_same(out, hf_beams(rt.hf(kind), ids, p))
    assert paths["copy"] + paths["cpu"] > 0


def test_moe_beams_with_experts_on_disk_match_transformers(rt):
    kind = "mixtral"
    s = rt.sizes(kind)
    ids, p = moe_params(rt, kind)
    budget = s.fast(cache_slots=3, accelerator=False) + (p.width - 1) * s.kv + s.cpu_slots(p.width)
    with LLM(rt.dir(kind), engine_config(accelerator="none", max_batch=p.width, expert_cache_slots=3,
                                         cpu_memory=budget)) as llm:
        out = llm.beam_search(ids, p)
        read = llm.experts.bytes_read
    assert_same(out, hf_beams(rt.hf(kind), ids, p))
    assert read > 0


def test_copy_slots_moves_each_slot_its_parents_rows():
    class Cfg:
        num_hidden_layers = 2
        kv_widths = staticmethod(lambda: (1, 2, 2))  # ModelConfig's: KV heads, key and value widths
    cache = KVCache(Cfg, 3, 5, torch.float32)
    for t, base in ((cache.k, 0), (cache.v, 100)):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape) + base)
    k0, v0 = cache.k.clone(), cache.v.clone()
    cache.copy_slots([1, 0, 0], 3)  # slots 0 and 1 swap, slot 2 takes slot 0's
    for t, old in ((cache.k, k0), (cache.v, v0)):
        assert torch.equal(t[:, 0, :, :3], old[:, 1, :, :3]) and torch.equal(t[:, 1, :, :3], old[:, 0, :, :3])
        assert torch.equal(t[:, 2, :, :3], old[:, 0, :, :3])
        assert torch.equal(t[:, :, :, 3:], old[:, :, :, 3:])  # positions past `length` untouched
    k1 = cache.k.clone()
    cache.copy_slots([0, 0, 2], 4, start=2)  # slot 1 takes slot 0's positions 2 and 3 only
    assert torch.equal(cache.k[:, 1, :, 2:4], k1[:, 0, :, 2:4]) and torch.equal(cache.k[:, 1, :, :2], k1[:, 1, :, :2])


def test_selection_keeps_the_best_continuations_of_all_beams():
    search = BeamSearch(BeamSearchParams(width=2, max_tokens=3), stop_ids={0})
    # one running beam at first: its two best tokens (3, then 2) start the beams; token 0 (stop) ranks
    # third, outside the best `width`, so it finishes nothing
    assert search.advance(torch.tensor([[0.5, -9.0, 1.0, 2.0]])) == [0, 0]
    assert search.running == [[3], [2]] and not search.pool
    # beam 1's token 0 (a stop) ranks second, inside the best `width`: it finishes; beam 0's 1 and beam 1's 3 run on
    parents = search.advance(torch.tensor([[-9.0, 3.0, -9.0, 0.0], [9.0, -9.0, -9.0, 8.0]]))
    assert search.pool[0].token_ids == [2, 0] and search.pool[0].finish_reason == "stop"
    assert sorted(zip(parents, map(tuple, search.running))) == [(0, (3, 1)), (1, (2, 3))]
    assert search.advance(torch.zeros(2, 4)) == [] and search.done  # max_tokens reached
    assert len(search.result()) == 2
    with pytest.raises(ValueError):
        search.advance(torch.zeros(2, 4))


@pytest.mark.parametrize("bad", [dict(width=0), dict(max_tokens=0), dict(early_stopping="sometimes"),
                                 dict(width=2, num_return=3)])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(ConfigError):
        BeamSearchParams(**bad)


def test_a_width_beyond_the_vocabulary_is_refused(zoo):
    llm = zoo.llm(zoo.dir("llama"))
    with pytest.raises(ConfigError, match="vocabulary"):
        llm.beam_search([5, 6], BeamSearchParams(width=zoo.vocab_size + 1, max_tokens=2))


def test_cli_beams(zoo, tmp_path):
    from typer.testing import CliRunner

    from tiered.cli import app

    res = CliRunner().invoke(app, ["run", "--model", str(zoo.dir("llama")), "--no-chat", "--beams", "3",
                                   "--max-tokens", "5", "--json", "hello"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert len(doc["hypotheses"]) == 3 and doc["text"] == doc["hypotheses"][0]["text"]
    scores = [h["score"] for h in doc["hypotheses"]]
    assert scores == sorted(scores, reverse=True)


def test_beams_beyond_the_planned_batch_say_how_to_plan_for_them(rt):
    """A budget planned for one sequence has no room for 4 beams' KV: the error says to plan for them."""
    from tiered.errors import BudgetError

    kind = "mixtral"
    s = rt.sizes(kind)
    with LLM(rt.dir(kind), engine_config(accelerator="none", expert_cache_slots=3,
                                         cpu_memory=s.fast(cache_slots=3, accelerator=False))) as llm:
        with pytest.raises(BudgetError, match="max_batch=4"):
            llm.beam_search(prompt(12), BeamSearchParams(width=4, max_tokens=10))
