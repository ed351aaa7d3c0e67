"""A KV cache in RAM whose sliding layers forget what lies behind their window (Plan.kv_window,
EngineConfig.sliding_kv "window": models/layers.KVCache.forget).

Gemma 2 / 3's local layers, gpt-oss's sliding ones and Mistral / Phi-3's windowed models never read a
sequence's positions more than a window before its next query again; the cache hands their pages back to the
OS and the budget counts only the window. Checked: the pages go (mincore) and nothing a later query reads
does; generate, long prompts prefilled chunk by chunk, prompt logprobs and a server's slots give the tokens of
a cache keeping every position (sliding_kv "full"); a slot's forgotten floor and its prompt-end checkpoint bound
its prefix reuse and travel with lent KV; the budget and the planner count the windows (a Gemma 3 27B context
window that did not fit now does); attention is priced over the windows, and a sliding layer's eager attention
reads its window only. Also here: the CPU engine's lazy RoPE tables, `tiered info`'s windows and KV bytes.

The tiny checkpoints' caches are smaller than a lazily committed mapping (memory/host.LAZY_ZEROS_BYTES) and
their sequences shorter than the released hysteresis, so the end-to-end tests lower both (`forgetting`).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from fixtures import copy_dir, prompt_ids
from tiered import SamplingParams
from tiered.checkpoint import open_checkpoint
from tiered.checkpoint.model_config import ModelConfig
from tiered.engine.scheduler import Scheduler
from tiered.errors import BudgetError
from tiered.hardware.budget import format_bytes
from tiered.memory import host, sizes
from tiered.models import layers
from tiered.models.layers import KVCache

GREEDY = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.fixture
def forgetting(monkeypatch):
    """Tiny caches lazily committed, forgetting every 16 positions with nothing kept behind the window; returns a
    list collecting the bytes each KVCache._release hands back."""
    monkeypatch.setattr(host, "LAZY_ZEROS_BYTES", 0)
    monkeypatch.setattr(layers, "KV_FORGET_SLACK", 0)
    monkeypatch.setattr(layers, "KV_FORGET_STEP", 16)
    freed: list[int] = []
    release = KVCache._release

    def counted(self, *args):
        n = release(self, *args)
        freed.append(n)
        return n
    monkeypatch.setattr(KVCache, "_release", counted)
    return freed


@pytest.fixture(scope="module")
def wide(zoo, tmp_path_factory):
    """name -> a copy of the tiny checkpoint `name` sliding over 48 positions: wider than the 32 positions of a
    page of its fp32 rows, so a window forgotten by mistake is whole pages the test's queries would read."""
    made = {}

    def get(name: str):
        if name not in made:
            path = copy_dir(zoo, name, tmp_path_factory.mktemp(name))
            cfg = json.loads((path / "config.json").read_text())
            cfg["sliding_window"] = 48
            (path / "config.json").write_text(json.dumps(cfg))
            made[name] = path
        return made[name]
    return get


def _config(zoo, name: str = "gemma3") -> ModelConfig:
    return open_checkpoint(zoo.dir(name)).config


def _filled(cfg: ModelConfig, slots: int, max_len: int, written: int, advance: int | None = 64) -> KVCache:
    """An fp32 cache whose every slot's positions 0..written-1 hold position + 1 in every layer."""
    cache = KVCache(cfg, slots, max_len, torch.float32, advance=advance)
    values = torch.arange(1, written + 1, dtype=torch.float32).view(1, 1, 1, written, 1)
    for t in (cache.k, cache.v):
        t[:, :, :, :written] = values
    return cache


def _resident(cache: KVCache, layer: int, slot: int) -> int:
    return sum(host.resident_bytes(t[layer, slot]) for t in (cache.k, cache.v))


def test_forget_hands_back_the_pages_behind_each_sliding_window(zoo):
    cfg = _config(zoo)  # layer 0 slides over 8 positions, layer 1 attends to everything
    assert [cfg.window_of(i) for i in range(2)] == [8, None]
    cache = _filled(cfg, 2, 16384, 8000)  # a position of a head's row: 128 bytes
    assert cache.advance == 64 and cache.windows == [(0, 8)]
    before = [_resident(cache, i, 0) for i in range(2)]
    freed = cache.forget(0, 8000)
    horizon = 8000 - sizes.KV_FORGET_SLACK
    assert cache.forgotten == [horizon, 0] and freed > 0.95 * 2 * 2 * (horizon - 8) * 128
    sliding, full = (_resident(cache, i, 0) for i in range(2))
    assert full == before[1] and before[0] - sliding == freed
    assert sliding <= 2 * 2 * (8000 - horizon + 8 + 2 * 32) * 128  # the window, the slack and a page each end
    # what a query from position 8000 on reads is whole; what lies behind the window reads 0
    k = cache.k[0, 0, 0, :, 0]
    assert torch.equal(k[horizon - 8:8000], torch.arange(horizon - 7, 8001, dtype=torch.float32))
    assert not k[:horizon - 8 - 32].any()
    assert torch.equal(cache.k[1, 0, 0, :8000, 0], torch.arange(1, 8001, dtype=torch.float32))
    assert _resident(cache, 0, 1) == before[0]  # the other slot keeps its own
    # within KV_FORGET_STEP of the last forget nothing more goes; keeps() bounds a reuse by the floor
    assert cache.forget(0, 8000 + sizes.KV_FORGET_STEP - 1) == 0
    assert cache.keeps(0, horizon) and not cache.keeps(0, horizon - 1) and cache.keeps(0, 0)
    cache.restart(0)
    assert cache.forgotten[0] == 0 and cache.keeps(0, 1)


def test_a_cache_that_keeps_every_position_forgets_nothing(zoo):
    cfg = _config(zoo)
    for cache in (_filled(cfg, 1, 16384, 4000, advance=None),  # sliding_kv "full" (no advance)
                  _filled(_config(zoo, "llama"), 1, 16384, 4000),  # no sliding layer
                  KVCache(cfg, 1, 64, torch.float32, advance=64)):  # too small to be lazily committed
        assert cache.advance is None and cache.forget(0, 4000) == 0 and cache.forgotten == [0]
        assert cache.held_bytes == cache.nbytes


def test_lent_kv_carries_the_forgotten_floor_and_copies_only_what_is_kept(zoo):
    cfg = _config(zoo)
    cache = _filled(cfg, 3, 16384, 6000)
    cache.forget(0, 6000)
    floor = cache.forgotten[0]
    cache.k[:, 1:, :, :6000].fill_(7)  # slot 1 held another sequence, whose old pages are resident
    cache.v[:, 1:, :, :6000].fill_(7)
    cache.lend({1: 0}, 6000)
    assert cache.forgotten[1] == floor
    for t in (cache.k, cache.v):
        assert torch.equal(t[1, 1, :, :6000], t[1, 0, :, :6000])  # the global layer whole
        assert torch.equal(t[0, 1, :, floor - 8:6000], t[0, 0, :, floor - 8:6000])  # the sliding one's window
    # the slot's own positions behind the floor were handed back, not filled with the source's zeros
    assert _resident(cache, 0, 1) <= _resident(cache, 0, 0) + 2 * 2 * 2 * 4096
    # a slot written from 0 again (a new sequence) keeps everything anew; copies between unforgotten slots as ever
    cache.restart(2)
    cache.copy_slots([0, 1, 1], 6000)
    assert cache.forgotten == [floor, floor, floor]


def test_a_checkpoint_keeps_the_window_before_a_prompts_end(zoo):
    cfg = _config(zoo)  # layer 0 slides over 8 positions
    cache = _filled(cfg, 2, 16384, 8000)
    cache.protect(0, 3000)  # a prompt of 3000 positions, then 5000 generated
    lo = 3000 - sizes.KV_FORGET_SLACK
    assert cache.checkpoint[0] == (lo, 3000)
    cache.forget(0, 8000)
    horizon = 8000 - sizes.KV_FORGET_SLACK
    assert _resident(cache, 0, 0) <= 2 * 2 * (8000 - horizon + 3000 - lo + 2 * 8 + 4 * 32) * 128
    k = cache.k[0, 0, 0, :, 0]
    assert torch.equal(k[lo - 8:3000], torch.arange(lo - 7, 3001, dtype=torch.float32))  # kept
    assert torch.equal(k[horizon - 8:8000], torch.arange(horizon - 7, 8001, dtype=torch.float32))
    assert not k[:lo - 8 - 32].any() and not k[3000 + 32:horizon - 8 - 32].any()  # the rest handed back
    # what a later prompt sharing n positions reuses: all past the floor, up to the prompt's end from lo on
    assert [cache.reusable(0, n) for n in (0, 100, lo, 3000, 3005, horizon - 1, horizon, 7000 + 1000)] == \
        [0, 0, lo, 3000, 3000, 3000, horizon, 8000]
    # lent from within the checkpoint: the window before it, its floor, no checkpoint
    cache.lend({1: 0}, 3000)
    assert (cache.forgotten[1], cache.checkpoint[1]) == (lo, None)
    assert torch.equal(cache.k[0, 1, 0, lo - 8:3000, 0], k[lo - 8:3000]) and not cache.k[0, 1, 0, :lo - 8 - 32, 0].any()
    assert torch.equal(cache.k[1, 1, 0, :3000, 0], cache.k[1, 0, 0, :3000, 0])  # the global layer whole
    # a new sequence resuming slot 0 within the checkpoint takes its floor; forgetting goes on from there
    cache.resume(0, 3000)
    assert (cache.forgotten[0], cache.checkpoint[0]) == (lo, None) and cache.keeps(0, 3000)


def test_the_scheduler_reuses_what_the_slot_still_holds():
    """Scheduler.kv_reusable (KVCache.reusable) decides how much of a slot's shared prefix a new prompt takes."""
    sched = Scheduler(max_batch=2, max_queue=4, prefix_reuse=True)
    from tiered.engine.sequence import Sequence

    def seq(ids):
        return Sequence(index=0, prompt="", prompt_ids=list(ids), params=SamplingParams(), max_tokens=4, slot=-1,
                        generator=None)
    first = seq(range(100))
    sched.add(first)
    sched.schedule()
    first.output_ids = [7, 8]
    sched.finish(first)  # slot 0 holds 101 positions' KV
    asked = []

    def reusable(slot, n):  # slot 0 holds the window before 60 and after, and before 30..40 (a checkpoint)
        asked.append((slot, n))
        return n if n >= 60 else min(n, 40) if n >= 30 else 0
    sched.kv_reusable = reusable
    for shared, reused in ((20, 0), (50, 40), (80, 80)):
        new = seq(list(range(shared)) + [999])
        sched.add(new)
        sched.schedule()
        assert (new.slot, new.cached_tokens) == (0, reused) and (0, shared) in asked
        sched.finish(new)
        sched._slot_tokens[0] = list(range(100))


@pytest.mark.parametrize("name, kv", [("gemma3", "auto"), ("mistral", "auto"), ("gemma2", "auto"), ("phi3", "auto"),
                                      ("gemma3", "int8")])
def test_generate_forgetting_gives_the_tokens_of_a_full_cache(zoo, wide, forgetting, name, kv):
    """200 greedy tokens after a 40-token prompt, decoded by the native step (in bursts where it bursts): the same
    tokens with the sliding layers forgetting as with every position kept (Gemma 3's local layers, Mistral's and
    Phi-3's every-layer window, Gemma 2's soft-capped alternate ones; an int8 cache's rows and scales, on the
    model's own window of 8: its 36-byte rows put a whole page behind a window of 48 only past 256 positions)."""
    ids = prompt_ids(zoo.vocab_size, 40, seed=9)
    path = zoo.dir(name) if kv == "int8" else wide(name)
    full = zoo.llm(path, sliding_kv="full", kv_cache_dtype=kv)
    assert not full.plan.kv_window
    want = full.generate(ids, GREEDY)[0].token_ids
    assert not forgetting
    llm = zoo.llm(path, kv_cache_dtype=kv)
    assert llm.plan.kv_window
    assert llm.generate(ids, GREEDY)[0].token_ids == want
    assert sum(forgetting) > 0


def test_a_long_prompt_forgets_between_its_chunks(zoo, wide, forgetting):
    """A 220-token prompt prefilled in chunks of 64: its chunks forget behind the window, and its first tokens and
    prompt logprobs are a full cache's."""
    ids = prompt_ids(zoo.vocab_size, 220, seed=10)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    outs = []
    for llm in (zoo.llm(wide("gemma3"), sliding_kv="full"), zoo.llm(wide("gemma3"))):
        chunk = llm.plan.prefill_chunk
        llm.plan.prefill_chunk = 64
        try:
            outs.append(llm.generate(ids, replace(sp, prompt_logprobs=None))[0])
            freed = sum(forgetting)
            outs.append(llm.generate(ids, sp)[0])
        finally:
            llm.plan.prefill_chunk = chunk
    assert freed > 0 and sum(forgetting) > freed
    assert outs[0].token_ids == outs[2].token_ids and outs[1].token_ids == outs[3].token_ids
    for a, b in zip(outs[1].prompt_logprobs[1:], outs[3].prompt_logprobs[1:]):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_server_slots_reuse_what_they_still_hold(zoo, wide, forgetting):
    """A server's slots (prefix reuse): a request continuing a long finished conversation reuses all of it, one
    sharing its first prompt and a little of the answer reuses that prompt (KVCache.protect: a template dropping
    the answer's reasoning), one sharing less prefills whole (the window before it was forgotten); each gives
    generate's tokens alone."""
    llm = zoo.llm(wide("gemma3"))
    sp = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    sched, cache = Scheduler(max_batch=1, max_queue=2, prefix_reuse=True), llm.kv_cache(1)
    ids = prompt_ids(zoo.vocab_size, 30, seed=11)
    first = llm.make_sequence(ids, sp)
    sched.add(first)
    while sched.has_work():
        llm.step(sched, cache)
    held = first.kv_tokens()
    assert cache.forgotten[0] > 32
    follow = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    # the first prompt and a little of its answer (the checkpoint's), then all of that conversation, then less
    # than its first prompt
    for kind in ("turn", "later", "early"):
        prompt, reused = {"turn": (held[:len(ids) + 3] + [5, 6], len(ids)), "later": (held + [5, 6], len(held)),
                          "early": (held[:20] + [5, 6], 0)}[kind]
        seq = llm.make_sequence(prompt, follow)
        sched.add(seq)
        outs = []
        while sched.has_work():
            outs += [o for _, _, o in llm.step(sched, cache) if o is not None]
        assert seq.cached_tokens == reused
        alone = llm.generate(prompt, follow)[0]
        assert outs[0].token_ids == alone.token_ids
        assert [a.logprob for a in outs[0].logprobs] == pytest.approx([a.logprob for a in alone.logprobs], abs=1e-5)
        held = seq.kv_tokens()


def test_the_budget_counts_a_forgetting_cache_by_its_windows():
    # google/gemma-3-27b-it's text model: 62 layers, 52 of them sliding over 1024 positions, 16 KV heads of 128
    cfg = ModelConfig.from_hf({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                               "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
                               "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
                               "query_pre_attn_scalar": 168, "sliding_window": 1024,
                               "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "vocab_size": 262208})
    assert sum(cfg.window_of(i) is not None for i in range(62)) == 52 and cfg.windowed
    full = sizes.kv_cache_bytes(cfg, 1, 131072, "bf16")
    window = sizes.kv_cache_bytes(cfg, 1, 131072, "bf16", advance=1024)
    per_position = sizes.kv_bytes_per_token(cfg, "bf16")
    assert full == 62 * 131072 * per_position  # 66.6 GB
    # the window, the slack behind it, a step and a chunk ahead, the checkpoint's window and slack, 4 pages of 16
    kept = 2 * (1024 + sizes.KV_FORGET_SLACK) + sizes.KV_FORGET_STEP + 1024 + 4 * 16
    assert window == (10 * 131072 + 52 * kept) * per_position  # 12.4 GB
    assert sizes.kv_cache_bytes(cfg, 1, 2000, "bf16", advance=1024) == sizes.kv_cache_bytes(cfg, 1, 2000, "bf16")


def test_a_cpu_plan_fits_the_window_the_full_cache_did_not(zoo):
    """The CPU planner counts the forgetting cache (Plan.kv_window): a budget holding the plan with its sliding
    layers' windows but not their whole context plans with sliding_kv "window" and refuses with "full"."""
    from test_plan import cpu_only_profile
    from tiered.planner.make import make_plan

    cfg = _six_layers(zoo)
    profile, context = cpu_only_profile(), 1 << 16
    plan = make_plan(cfg, profile, context_tokens=context, precision="bf16")
    assert plan.kv_window and plan.kv_advance() == plan.prefill_chunk
    full = sizes.kv_cache_bytes(cfg, 1, context, "bf16")
    window = sizes.kv_cache_bytes(cfg, 1, context, "bf16", plan.kv_advance())
    assert window < full / 3
    cpu = plan.memory["cpu"] + (full - window) // 2
    assert make_plan(cfg, profile, cpu_memory=cpu, context_tokens=context, precision="bf16").memory["cpu"] <= cpu
    with pytest.raises(BudgetError):
        make_plan(cfg, profile, cpu_memory=cpu, context_tokens=context, precision="bf16", sliding_kv="full")


def _six_layers(zoo) -> ModelConfig:
    """The tiny Gemma 3 with 6 layers, 5 of them sliding over 8 positions (Gemma 3's pattern)."""
    return replace(_config(zoo), local_layers=(0, 1, 2, 3, 4), num_hidden_layers=6)


def test_decode_attention_is_priced_over_the_window(zoo):
    from test_plan import cpu_only_profile
    from tiered.planner.cpu_predict import predict_decode

    cfg, profile = _six_layers(zoo), cpu_only_profile()
    windowed = predict_decode(cfg, profile, "bf16", 65536)[1]
    unwindowed = predict_decode(replace(cfg, sliding_window=None, local_window=None, local_layers=(), local_rope_theta=None),
                                profile, "bf16", 65536)[1]
    short = predict_decode(cfg, profile, "bf16", 8)[1]
    assert short < windowed < unwindowed / 3


@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_a_sliding_layer_attends_over_its_window_only(zoo, wide, monkeypatch, name):
    """A prompt's chunks after cached positions: each sliding layer's eager attention reads the keys from its
    window's start on (layers._window_keys), and the hidden states are the whole prompt's in one forward."""
    llm = zoo.llm(wide(name), sliding_kv="full")
    ids = torch.tensor([prompt_ids(zoo.vocab_size, 200, seed=12)])
    read = []
    trim = layers._window_keys

    def spy(k, v, mask, start, window):
        out = trim(k, v, mask, start, window)
        read.append((start, k.shape[2], out[0].shape[2]))
        return out
    monkeypatch.setattr(layers, "_window_keys", spy)
    slots, model = torch.tensor([0]), llm.model
    with torch.inference_mode():
        whole = model.hidden_states(ids, torch.arange(200).unsqueeze(0), slots, llm._kv_cache(1, 256))[0, -1]
        cache = llm._kv_cache(1, 256)
        for a, b in ((0, 64), (64, 128), (128, 200)):
            h = model.hidden_states(ids[:, a:b], torch.arange(a, b).unsqueeze(0), slots, cache)
    assert torch.allclose(h[0, -1], whole, rtol=1e-4, atol=1e-5)
    chunks = [(s, n, kept) for s, n, kept in read if s > 0]
    assert chunks and all(kept == n - sizes.window_key_start(s, 48) and kept < n for s, n, kept in chunks)


@pytest.mark.parametrize("name", ["gemma3", "qwen3"])
def test_a_sliding_layers_bf16_prompt_attends_on_the_amx_kernel_over_its_window(zoo, monkeypatch, tmp_path, name):
    """A bf16 prompt's sliding layers (Gemma 3's local one; every layer of a Qwen3 copy sliding over 8, the step's
    own mask windowed) attend on
    the AMX kernel with their window (layers.attend's `window`, csrc/gemv.cpp attn_block: keys past + i - window +
    1..past + i), a first chunk of 64 from position 0 and the chunks after it, where torch's SDPA under the window's
    mask had taken them: the hidden states within the error SDPA's bf16 attention makes against an fp32 cache's
    forward. On a Gemma-3-4B-width file's 8192-token prompt the later chunks' local layers spent 83 ms a chunk in
    torch's flash attention (2 AMX cores, 2026-12-07)."""
    from fixtures import local_model
    from tiered.models.layers import _bf16_attention, set_prompt_attention

    path = zoo.dir(name)
    if name == "qwen3":  # (head_dim 32: the kernel's; the tiny Mistral's and Qwen2's are 16)
        path = copy_dir(zoo, name, tmp_path)
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(use_sliding_window=True, sliding_window=8, max_window_layers=0, layer_types=None)
        (path / "config.json").write_text(json.dumps(cfg))
    model = local_model(path, 256)
    assert all(model.config.window_of(i) == 8 for i in range(1 if name == "gemma3" else 2))
    hd = model.config.head_dim or model.config.hidden_size // model.config.num_attention_heads
    probe = torch.zeros(1, 1, 2, hd, dtype=torch.bfloat16)
    if _bf16_attention(probe, probe, probe) is None:
        pytest.skip("no bf16 attention kernel here (head_dim or CPU)")
    ids = torch.tensor([prompt_ids(zoo.vocab_size, 200, seed=13)])
    calls = []

    def hidden(kv_dtype, prompt_dtype):
        set_prompt_attention(model, prompt_dtype)
        cache, slots = KVCache(model.config, 1, 256, kv_dtype), torch.tensor([0])
        with torch.inference_mode():
            for a, b in ((0, 64), (64, 128), (128, 200)):
                h = model.hidden_states(ids[:, a:b], torch.arange(a, b).unsqueeze(0), slots, cache)
        return h[0].float()

    ref = hidden(torch.float32, None)
    real = layers._bf16_attention

    def spy(q, k, v, past=0):
        ext = real(q, k, v, past)
        if ext is None:
            return None

        class Seen:
            def bf16_prompt_attention(self, *args):
                calls.append(args[4:])  # (past, window)
                return ext.bf16_prompt_attention(*args)
        return Seen()
    monkeypatch.setattr(layers, "_bf16_attention", spy)
    got = hidden(torch.bfloat16, torch.bfloat16)
    windowed = [c for c in calls if c[1] == 8]
    assert {c[0] > 0 for c in windowed} == {False, True}  # the first chunk and the later ones
    assert all(c[0] <= 8 + sizes.KV_ALIGN for c in windowed if c[0] > 0)  # past counted from the trimmed keys
    monkeypatch.setattr(layers, "_bf16_attention", lambda *a, **k: None)
    sdpa = hidden(torch.bfloat16, torch.bfloat16)
    err, sdpa_err = (got - ref).abs().max().item(), (sdpa - ref).abs().max().item()
    assert err <= 1.5 * sdpa_err + 1e-3
    assert (got - ref).abs().mean() <= 1.5 * (sdpa - ref).abs().mean() + 1e-4


def test_prompts_are_priced_over_the_windows(zoo):
    from test_plan import cpu_only_profile
    from tiered.planner.cpu_predict import layer_pairs, predict_prefill, predict_prompt_rows

    assert layer_pairs(64, 0, None) == layer_pairs(64, 0, 128) == 64 * 65 / 2  # within the window: causal
    assert layer_pairs(256, 0, 128) == 256 * 256  # the window cuts keys: every pair under the mask
    assert layer_pairs(64, 4096, 128) == 64 * (4096 - 3968 + 64) and layer_pairs(64, 4096, None) == 64 * 4160
    cfg, hw = _six_layers(zoo), cpu_only_profile()
    unwindowed = replace(cfg, sliding_window=None, local_window=None, local_layers=(), local_rope_theta=None)
    for price in (lambda c: predict_prefill(c, hw, "bf16", 8192, chunk=1024),
                  lambda c: predict_prompt_rows(c, hw, "bf16", 256, past=8192)):
        assert price(cfg) < price(unwindowed)


def test_info_shows_the_windows_and_what_the_cache_keeps(zoo):
    from typer.testing import CliRunner

    from tiered.cli import app

    for name, window in (("gemma3", "window 8 on layers [0], full on the others"), ("mistral", "window 8 on every layer")):
        res = CliRunner().invoke(app, ["info", str(zoo.dir(name))])
        assert res.exit_code == 0, res.output
        cfg = _config(zoo, name)
        full = sizes.kv_cache_bytes(cfg, 1, cfg.max_position_embeddings, "bf16")
        assert f"attention:   {window}" in res.output and "mlp:         128" in res.output
        assert "with the sliding layers keeping their windows" in res.output and "kv cache:" in res.output
        assert f"positions: {format_bytes(full)}" in res.output
    assert "keeping their windows" not in CliRunner().invoke(app, ["info", str(zoo.dir("llama"))]).output


@pytest.mark.parametrize("name", ["gemma3", "phi3_longrope", "llama"])
def test_lazy_rope_tables_compute_rows_as_positions_reach_them(zoo, monkeypatch, name):
    """A CPU engine's RoPE tables (Rotary(lazy=True)) hold rows only up to the positions used, each row the whole
    table's; moved to another device or dtype they are filled whole."""
    monkeypatch.setattr(layers, "ROPE_ROWS", 32)
    cfg = _config(zoo, name)
    eager, lazy = layers.Rotary(cfg, 256), layers.Rotary(cfg, 256, lazy=True)
    assert lazy.filled == 0 and eager.filled == 256
    positions = torch.tensor([[3, 40]])
    for got, want in zip(lazy(positions), eager(positions)):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    assert lazy.filled == 64 and not lazy.cos[64:].any()
    if cfg.local_rope() is not None:
        assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(lazy.local(positions),
                                                                               eager.local(positions)))
    lazy.to(torch.float32)
    assert lazy.filled == 256 and torch.allclose(lazy.cos, eager.cos, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["gemma3", "llama"])  # the native step's rows and local tables; its bursts
def test_a_cpu_engine_computes_the_rope_rows_it_reaches(zoo, monkeypatch, name):
    monkeypatch.setattr(layers, "ROPE_ROWS", 32)
    from tiered import LLM, EngineConfig

    llm = LLM(zoo.dir(name), EngineConfig(decode_weights="fp32"))
    rotary = llm.model.rotary
    assert rotary.filled == 0 and rotary.max_positions == llm.max_context > 96
    ids = prompt_ids(zoo.vocab_size, 40, seed=13)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    lazy = llm.generate(ids, sp)[0].token_ids  # decode past the first 64 rows
    assert rotary.filled == 96 and (llm.last_burst > 0) == (name == "llama")
    llm.model.rotary = layers.Rotary(llm.config, llm.max_context)
    assert llm.generate(ids, sp)[0].token_ids == lazy


def test_a_leader_keeps_what_its_followers_take(zoo, wide, forgetting):
    """Two prompts admitted together sharing their first 100 tokens (SharedPrefixes): the leader's 220-token prompt,
    prefilled in chunks of 64, forgets behind its window only up to the shared prefix (KVCache.hold) until the
    follower took it; each gives generate's tokens alone."""
    llm = zoo.llm(wide("gemma3"))
    assert llm.plan.shared_prefixes
    shared = prompt_ids(zoo.vocab_size, 100, seed=14)
    lead, follow = shared + prompt_ids(zoo.vocab_size, 120, seed=15), shared + prompt_ids(zoo.vocab_size, 5, seed=16)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    chunk = llm.plan.prefill_chunk
    llm.plan.prefill_chunk = 64
    try:
        sched, cache = Scheduler(max_batch=2, max_queue=2, prefix_reuse=True), llm.kv_cache(2)
        seqs = [llm.make_sequence(p, sp) for p in (lead, follow)]
        sched.add(*seqs)
        outs = {}
        while sched.has_work():
            outs.update({id(s): o for s, _, o in llm.step(sched, cache) if o is not None})
        assert seqs[1].cached_tokens == 100 and sum(forgetting) > 0
        for seq, prompt in zip(seqs, (lead, follow)):
            alone = llm.generate(prompt, sp)[0]
            assert outs[id(seq)].token_ids == alone.token_ids
            assert [a.logprob for a in outs[id(seq)].logprobs] == pytest.approx([a.logprob for a in alone.logprobs],
                                                                                 abs=1e-5)
    finally:
        llm.plan.prefill_chunk = chunk
