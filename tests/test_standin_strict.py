"""The host stand-in is strict about devices, as CUDA is, so device bugs fail on CPU-only CI.

DESIGN.md "The accelerator on machines without one", point 4. The first GPU run
(gpu-runs/2026-11-22-h200) found two bugs that every CPU test had passed: attention-mask keys made
on the host while positions were on the device (models/layers.py build_attention_metadata), and
Fiddler's CPU-expert path indexing host activations with device indices (runtime/moe_runner.py).
(a) checks that the stand-in refuses those mixes with a clear error; (b) runs the engine's own
code paths where they occurred on the stand-in, so reverting either fix fails here.
"""

from __future__ import annotations

import threading

import pytest
import torch

from fixtures import hf_greedy, prompt_ids
from runtime_fixtures import GREEDY as MOE_GREEDY
from runtime_fixtures import engine_config, prompt, rt  # noqa: F401  (rt is a fixture)
from test_planned_run import box  # noqa: F401  (a fixture)
from test_runtime_parity import check_parity

from tiered import LLM, EngineConfig, SamplingParams
from tiered.hardware.accelerator import HostAccelerator
from tiered.hardware.standin import STANDIN_DEVICE, StandinDeviceError, StandinTensor
from tiered.models.layers import KVCache
from tiered.quant.linear import PhaseLinear

SAME_DEVICE = "Expected all tensors to be on the same device"
INDICES = "indices should be either on cpu or on the same device as the indexed tensor"


@pytest.fixture
def acc():
    return HostAccelerator()


# ------------------------------------------------------------------ (a) the stand-in refuses mixes
def test_host_arange_mask_against_device_positions_is_refused(acc):
    """The H200 bug of build_attention_metadata, reduced: keys from torch.arange on the host."""
    positions = acc.to_device(torch.tensor([[14], [6]]))
    q = positions.unsqueeze(-1)
    with pytest.raises(StandinDeviceError, match=SAME_DEVICE) as err:
        _ = torch.arange(15) <= q
    assert "host (cpu, shape (15,))" in str(err.value) and "Accelerator.to_device" in str(err.value)
    with acc.scope():  # the fix: made on positions.device, which is the stand-in's device
        keys = torch.arange(15, device=positions.device)
    assert type(keys) is StandinTensor and keys.device == STANDIN_DEVICE
    mask = keys <= q
    assert type(mask) is StandinTensor and mask.shape == (2, 1, 15) and int(mask.sum()) == 15 + 7


def test_host_tensor_indexed_by_device_indices_is_refused(acc):
    """The H200 bug of the CPU-expert path, reduced: x_host[tok] with tok on the device."""
    x_host = torch.randn(5, 4)
    tok = acc.to_device(torch.tensor([0, 3]))
    with pytest.raises(StandinDeviceError, match=INDICES):
        x_host[tok]
    with pytest.raises(StandinDeviceError, match=INDICES):
        x_host[tok, 1:]
    with pytest.raises(StandinDeviceError, match=INDICES):
        x_host[tok] = 0.0
    assert torch.equal(x_host[acc.to_host(tok)], x_host[[0, 3]])  # the fix: host indices


def test_device_tensor_indexed_by_host_indices_is_refused(acc):
    x = acc.to_device(torch.randn(5, 4))
    with pytest.raises(StandinDeviceError, match=SAME_DEVICE):
        x[torch.tensor([0, 3])]
    with pytest.raises(StandinDeviceError, match=SAME_DEVICE):
        x.index_add_(0, torch.tensor([1]), acc.to_device(torch.ones(1, 4)))
    rows = x[acc.to_device(torch.tensor([0, 3]))]
    assert type(rows) is StandinTensor and torch.equal(rows.cpu(), x.cpu()[[0, 3]])


@pytest.mark.parametrize("op", ["add", "matmul", "cat", "inplace", "linear", "where"])
def test_ops_mixing_device_and_host_are_refused(acc, op):
    d, h = acc.to_device(torch.randn(3, 3)), torch.randn(3, 3)
    run = {"add": lambda: d + h, "matmul": lambda: h @ d, "cat": lambda: torch.cat([d, h]),
           "inplace": lambda: h.add_(d), "linear": lambda: torch.nn.functional.linear(d, h),
           "where": lambda: torch.where(d > 0, d, h)}[op]
    with pytest.raises(StandinDeviceError, match=SAME_DEVICE):
        run()


def test_device_ops_stay_on_the_device_and_host_scalars_mix(acc):
    d = acc.to_device(torch.arange(6.0).reshape(2, 3))
    for out in (d * 2, d.sum(-1), d[0], torch.topk(d, 2).indices, d + torch.tensor(1.0), torch.zeros_like(d),
                d.new_zeros(4), d.to(torch.float64), d.T.contiguous()):
        assert type(out) is StandinTensor and out.device == STANDIN_DEVICE
    assert not d.is_cpu and d.device != torch.device("cpu")
    assert float((d + torch.tensor(1.0)).sum()) == 21.0  # a 0-dim host tensor mixes, as CUDA allows
    assert int(d.argmax()) == 5 and d[1].tolist() == [3.0, 4.0, 5.0]  # scalar reads are D2H copies


def test_crossing_only_through_the_accelerators_copies(acc):
    h = torch.arange(4.0)
    d = acc.to_device(h)
    assert type(d) is StandinTensor and torch.equal(d.cpu(), h)
    h[0] = 9.0
    assert float(d[0]) == 0.0  # to_device copied
    back = d.cpu()
    assert type(back) is torch.Tensor and back.data_ptr() != d.data_ptr()  # .cpu() copies (D2H)
    for host in (acc.to_host(d), d.to("cpu"), d.to(torch.device("cpu"), torch.float64)):
        assert type(host) is torch.Tensor and host.device.type == "cpu"
    out = torch.empty(4)
    out.copy_(d)  # D2H into a host buffer
    assert torch.equal(out, back)
    with pytest.raises(StandinDeviceError, match="copy_to_device"):
        d.copy_(torch.ones(4))  # H2D outside the accelerator
    with pytest.raises(TypeError, match="numpy"):
        d.numpy()
    with acc.scope(), pytest.raises(StandinDeviceError, match="Accelerator.to_device"):
        torch.ones(4).to(d.device)
    with pytest.raises(StandinDeviceError, match="host tensor"):
        acc.copy_to_device(torch.empty(4), h)
    dst = acc.alloc((4,), torch.float32, "test")
    assert type(dst) is StandinTensor
    acc.copy_to_device(dst, h)
    assert torch.equal(dst.cpu(), h)
    acc.free(dst)


def test_parameters_and_modules_keep_the_device(acc):
    lin = acc.module_to_device(torch.nn.Linear(4, 2))
    assert isinstance(lin.weight, torch.nn.Parameter) and type(lin.weight) is StandinTensor
    x = acc.to_device(torch.randn(3, 4))
    assert type(lin(x)) is StandinTensor
    with pytest.raises(StandinDeviceError, match=SAME_DEVICE):
        lin(x.cpu())


def test_checks_hold_on_worker_threads_outside_the_scope(acc):
    """Executor tasks on the "cpu" stream run without the scope: the tensor type still checks."""
    x_host, tok = torch.randn(4, 2), acc.to_device(torch.tensor([1]))
    errors = []

    def job():
        try:
            x_host[tok]
        except StandinDeviceError as e:
            errors.append(e)
    t = threading.Thread(target=job)
    t.start()
    t.join()
    assert len(errors) == 1 and INDICES in str(errors[0])


def test_factories_make_device_tensors_only_inside_the_scope(acc):
    with acc.scope():
        assert type(torch.zeros(2, device=acc.device)) is StandinTensor
        assert type(torch.tensor([1, 2], device=acc.device)) is StandinTensor
        assert type(torch.arange(3)) is torch.Tensor  # no device: the host, as on CUDA
        cache = KVCache(_TinyCfg, 2, 8, torch.float32, acc.device)
        assert type(cache.k) is StandinTensor and type(cache.v) is StandinTensor
    with acc.stream("compute"):  # a device stream is stand-in code too
        assert type(torch.ones(1, device=acc.device)) is StandinTensor


class _TinyCfg:
    num_hidden_layers = 2
    kv_widths = staticmethod(lambda: (1, 4, 4))  # ModelConfig's: KV heads, key and value widths


# ------------------------------------------------- (b) the engine's own paths, on the stand-in
def test_engine_state_lives_on_the_standin_device(zoo):
    llm = LLM(zoo.dir("llama"), EngineConfig(accelerator="host", plan="off", max_context=64))
    assert llm.device == STANDIN_DEVICE
    assert all(type(p) is StandinTensor for p in llm.model.parameters())
    assert type(llm.model.rotary.cos) is StandinTensor
    assert type(llm._kv_cache(1, 4).k) is StandinTensor
    assert llm.dtype == torch.float32  # dtype "auto" on the stand-in: the lossless mode
    assert llm.decode_weight_bytes == 0 and not any(isinstance(m, PhaseLinear) for m in llm.model.modules())


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_batched_generation_with_masks_on_the_standin(zoo, name):
    """Batched decode builds an attention mask (B > 1; Mistral also a sliding window) from the
    step's positions: build_attention_metadata's mask path, on the stand-in's device."""
    llm = LLM(zoo.dir(name), EngineConfig(accelerator="host", plan="off", decode_weights="fp32", max_context=64))
    prompts = [prompt_ids(zoo.vocab_size, n, seed=10 + n) for n in (3, 16, 7)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    cpu = zoo.llm(zoo.dir(name))
    assert batched == [o.token_ids for o in cpu.generate(prompts, params)]
    assert batched[1] == hf_greedy(zoo.hf(name), prompts[1], 12)


def test_packed_prefill_on_the_standin(zoo, monkeypatch):
    """Prompts of 7, 8 and 3 tokens are prefilled in one packed forward (models/layers.build_packed_metadata):
    the row's positions, its prompts' slots and last-token indices go to the device with the step's other
    inputs, and each prompt's own mask is made there."""
    import tiered.engine.llm as engine_llm

    calls = []
    build = engine_llm.build_packed_metadata
    monkeypatch.setattr(engine_llm, "build_packed_metadata", lambda *a: calls.append(a[2]) or build(*a))
    llm = LLM(zoo.dir("llama"), EngineConfig(accelerator="host", plan="off", decode_weights="fp32", max_context=64))
    prompts = [prompt_ids(zoo.vocab_size, n, seed=30 + n) for n in (7, 8, 3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    assert calls == [[(0, 7), (0, 8), (0, 3)]]
    assert batched == [o.token_ids for o in zoo.llm(zoo.dir("llama")).generate(prompts, params)]


def test_prompts_sharing_kv_between_slots_on_the_standin(zoo, monkeypatch):
    """Equal prompts (PromptTwins), prompts sharing a prefix (SharedPrefixes) and a prefix lent by a
    running slot (Scheduler prefix reuse) copy KV between the stand-in cache's slots (KVCache.lend) and
    a leader's logits rows: every prompt's tokens are those it draws alone on the host."""
    from tiered.engine import scheduler
    from tiered.engine.scheduler import Scheduler

    monkeypatch.setattr(scheduler, "SHARED_PREFIX_TOKENS", 8)
    llm = LLM(zoo.dir("llama"), EngineConfig(accelerator="host", plan="off", decode_weights="fp32", max_context=64))
    assert llm.plan.weights_stay_put()
    system = prompt_ids(zoo.vocab_size, 12, seed=40)
    prompts = [system + prompt_ids(zoo.vocab_size, 3, seed=41), system + prompt_ids(zoo.vocab_size, 4, seed=42)]
    prompts.append(prompts[0])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cpu = zoo.llm(zoo.dir("llama"))
    expected = [cpu.generate(p, params)[0].token_ids for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    sched, cache = Scheduler(max_batch=2, max_queue=1, prefix_reuse=True), llm.kv_cache(2)
    first, second = (llm.make_sequence(p, params, index=i) for i, p in enumerate(prompts[:2]))
    sched.add(first)
    llm.step(sched, cache)
    sched.add(second)  # admitted while `first` decodes: its slot lends the system prompt
    outs = {}
    while sched.has_work():
        outs.update({s.index: o.token_ids for s, _, o in llm.step(sched, cache) if o is not None})
    assert second.cached_tokens == len(system) and outs == {0: expected[0], 1: expected[1]}


def test_prompt_logprobs_on_the_standin(zoo, monkeypatch):
    """A prompt scored on the stand-in (SamplingParams.prompt_logprobs: LLM._prefill_scored) in chunks of
    8 tokens (the workspace's), its lm_head 3 positions a call, and its twin taking them: the host
    engine's figures, the device peak inside the budget."""
    from dataclasses import replace

    from tiered.hardware.standin import device_memory
    from tiered.memory import sizes

    monkeypatch.setattr(sizes, "WORKSPACE_TOKENS", 8)
    monkeypatch.setattr(sizes, "score_rows", lambda cfg, fmt, tokens: 3)
    ids = prompt_ids(zoo.vocab_size, 21, seed=43)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    want = zoo.llm(zoo.dir("llama")).generate(ids, params)[0]
    config = EngineConfig(accelerator="host", plan="off", decode_weights="fp32", max_context=64)
    with LLM(zoo.dir("llama"), config) as llm:
        need = llm.plan.memory["gpu"]  # the budget the plan needs, to the byte
    with device_memory() as m:
        llm = LLM(zoo.dir("llama"), replace(config, gpu_memory=need))
        assert llm.plan.prefill_chunk == 8 and llm.fast_budget.capacity == need
        outs = llm.generate([ids, ids], params)
        assert 0 < m.peak <= llm.fast_budget.capacity
        llm.close()
    for out in outs:
        assert out.token_ids == want.token_ids and out.prompt_logprobs[0] is None
        got, ref = ([(e.token, round(e.logprob, 4), [t for t, _ in e.top]) for e in o.prompt_logprobs[1:]]
                    for o in (out, want))
        assert got == ref


def test_cpu_expert_path_behind_the_standin(rt):  # noqa: F811
    """Fiddler's CPU path (experts in host RAM computed by the CPU behind an accelerator), forced
    for every non-resident expert, with a batch of two prompts: rows of host activations picked by
    routing indices that the router made on the device."""
    s = rt.sizes("mixtral")
    llm = LLM(rt.dir("mixtral"), engine_config(accelerator="host", gpu_memory=s.fast(cache_slots=2) + s.kv,
                                               cpu_memory="64MiB", expert_cache_slots=2, resident_experts=0,
                                               force_expert_path="cpu"))
    try:
        assert all(type(t) is StandinTensor for slot in llm.experts.cache.slots for t in slot)
        assert all(type(t) is torch.Tensor for w in llm.experts.store.host.values() for t in w)
        check_parity(rt, "mixtral", llm)
        pair = llm.generate([prompt(), prompt(seed=1)], MOE_GREEDY)
        assert pair[0].token_ids == rt.reference("mixtral")[1]
        assert set(llm.experts.path_counts) == {"cpu"} and llm.experts.path_counts["cpu"] > 0
        assert llm.experts.bytes_h2d == 0
    finally:
        llm.close()


def test_device_tensors_outside_the_scope_fail_clearly(acc):
    """Without the scope (e.g. on a CPU worker thread), torch cannot make a stand-in tensor: it says so."""
    with pytest.raises(StandinDeviceError, match="outside its scope"):
        torch.zeros(2, device=acc.device)
    with pytest.raises(StandinDeviceError, match="outside its scope"):
        torch.ones(2).to(acc.device)
    assert not torch.privateuseone.is_available()  # no real device claims the slot


def test_prefill_then_decode_through_the_standin_cache(zoo):
    """Single-sequence decode (no mask, the KV cache's slice-copy path) on the stand-in equals scoring."""
    from fixtures import stepwise_logits

    llm = LLM(zoo.dir("qwen2"), EngineConfig(accelerator="host", plan="off", max_context=32))
    ids = prompt_ids(zoo.vocab_size, 12, seed=3)
    full = llm.logits(ids)[3:]
    assert float((stepwise_logits(llm, ids, 4) - full).abs().max() / full.abs().max()) <= 1e-4


# ------------------------------------------------------------ real allocations vs the budget
def test_standin_allocations_are_exactly_what_the_budget_counts(rt, tmp_path):  # noqa: F811
    """After loading under a GPU budget (experts resident, cached, in CPU RAM and on disk), the bytes
    the stand-in's device really holds equal what its budget reserved, and stay within it."""
    import gc

    from runtime_fixtures import engine_config, live_device_bytes

    gc.collect()
    before = live_device_bytes()
    s = rt.sizes("mixtral")
    llm = LLM(rt.dir("mixtral"), engine_config(accelerator="host", gpu_memory=s.fast(cache_slots=2, resident=3),
                                               cpu_memory=s.cpu(5), expert_cache_slots=2,
                                               offload_dir=str(tmp_path)))
    try:
        held = live_device_bytes() - before
        # the budget also keeps the plan's activation workspace, which torch allocates per step
        assert held == llm.fast_budget.used - llm.plan.workspace_bytes
        assert held + llm.plan.workspace_bytes <= llm.fast_budget.capacity
    finally:
        llm.close()


def test_device_memory_meter_counts_storages_and_their_peak(acc):
    """device_memory() counts each storage once, from its first device tensor to its last, and keeps
    the peak: what torch.cuda.max_memory_allocated reports on CUDA."""
    import gc

    from tiered.hardware.standin import device_memory

    with device_memory() as m:
        a = acc.alloc((1024,), torch.float32)           # 4 KiB
        view = a[:10]                                   # the same storage
        with acc.scope():
            b = (a * 2).sum()                           # a transient [1024] product, then a scalar
        assert m.bytes == 4096 + 4 and m.peak == 2 * 4096 + 4  # the product lived until the sum was made
        del a
        gc.collect()
        assert m.bytes == 4096 + 4                      # the view keeps the storage
        del view, b
        gc.collect()
        assert m.bytes == 0
    with pytest.raises(RuntimeError, match="already open"):
        with device_memory(), device_memory():
            pass


def test_what_the_engine_holds_on_the_device_stays_inside_its_budget(zoo, rt, box):  # noqa: F811
    """Issue 8: real device allocations stay inside the budget. Metered on the stand-in through a
    load, a prompt of most of the context and decode: a sliced dense plan and an offloaded MoE
    plan (resident experts, cache slots, misses copied and computed on the CPU). After the load the
    device holds exactly what the budget reserved but the activation workspace (GG rows and staging,
    or resident experts and slots, all counted); the peak it held, transients included, is at most
    the budget's capacity."""
    import gc

    from test_planned_run import CTX, dense_sizes

    from tiered.hardware.standin import device_memory

    non_ffn, layer, kv, L = dense_sizes(zoo.dir("llama"))
    s = rt.sizes("mixtral")
    cases = [(zoo.dir("llama"), EngineConfig(decode_weights="fp32", accelerator="host", max_context=CTX, profile=box,
                                             gpu_memory=non_ffn + kv + layer + layer * L // 4)),
             (rt.dir("mixtral"), engine_config(accelerator="host", gpu_memory=s.fast(cache_slots=2, resident=1)))]
    for path, config in cases:
        gc.collect()
        with device_memory() as m:
            llm = LLM(path, config)
            try:
                # offloaded either way: GG rows beside CC / CG ones, or experts beside cache slots
                assert any(0 < l.r_gg < 1 for l in llm.plan.layers) or llm.experts.cache.num_slots
                gc.collect()
                assert m.bytes == llm.fast_budget.used - llm.plan.workspace_bytes, path.name
                llm.generate(list(range(2, llm.max_context - 10)), SamplingParams(temperature=0, max_tokens=8,
                                                                                  ignore_eos=True))
                assert 0 < m.peak <= llm.fast_budget.capacity, (path.name, m.peak, llm.fast_budget.capacity,
                                                                m.largest)
            finally:
                llm.close()


def test_library_workspaces_stay_inside_the_budget_and_nothing_outlives_close(zoo, box, monkeypatch):  # noqa: F811
    """Issue 8 §8, what the H100 showed (benchmarks/results/gpu/2026-11-26-h100): cuBLAS's workspaces, which
    torch allocates beside the engine's tensors, took the dense default plan 0.37 GiB past its budget and
    stayed allocated after its engine closed. The plan keeps the accelerator's library workspaces inside
    the budget (memory/sizes.device_workspace_bytes): here a stand-in whose libraries hold half the GG rows'
    bytes gets fewer GG rows, and what it held at its peak plus the libraries' bytes fits. After close, nothing the engine
    made on the device is still alive."""
    import gc

    from test_planned_run import CTX, dense_sizes

    from tiered.hardware.standin import device_memory
    from tiered.memory import sizes

    path = zoo.dir("llama")
    non_ffn, layer, kv, L = dense_sizes(path)
    gpu = non_ffn + kv + layer + layer * L // 4
    config = EngineConfig(decode_weights="fp32", accelerator="host", max_context=CTX, profile=box, gpu_memory=gpu)
    gg_rows = {}
    for library in (0, layer * L // 8):
        monkeypatch.setattr(HostAccelerator, "library_workspace_bytes", lambda self, b=library: b)
        gc.collect()
        with device_memory() as m:
            llm = LLM(path, config)
            try:
                assert llm.plan.workspace_bytes == sizes.workspace_bytes(llm.config, "fp32") + library
                gg_rows[library] = sum(mlp.f_gg for mlp in llm.sliced)
                llm.generate(list(range(2, llm.max_context - 10)),
                             SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
                assert 0 < m.peak + library <= llm.fast_budget.capacity, (m.peak, library, m.largest)
            finally:
                llm.close()
            del llm
            gc.collect()
            assert m.bytes == 0, m.largest
    assert gg_rows[layer * L // 8] < gg_rows[0]


def test_cublas_workspace_size_follows_torch():
    """hardware/cuda.cublas_workspace_bytes: CUBLAS_WORKSPACE_CONFIG's ":KiB:count" pairs, else 32 MiB from
    Hopper on and 8.125 MiB before (as aten/src/ATen/cuda/CublasHandlePool.cpp sizes them)."""
    from tiered.hardware.cuda import cublas_workspace_bytes

    assert cublas_workspace_bytes(9) == cublas_workspace_bytes(10) == 32 * 2**20
    assert cublas_workspace_bytes(8) == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert cublas_workspace_bytes(9, ":4096:8") == 32 * 2**20
    assert cublas_workspace_bytes(8, ":4096:2:16:8") == cublas_workspace_bytes(8)
    assert cublas_workspace_bytes(9, ":16:8") == 128 * 1024


def test_a_prompt_longer_than_the_workspace_prefills_in_chunks(zoo, rt, box, monkeypatch):  # noqa: F811
    """Issue 8 §8: the plan keeps device room for one prefill step of WORKSPACE_TOKENS tokens, so a longer
    prompt prefills in chunks of that many (Plan.prefill_chunk, LLM._prefill): each writes its KV and attends
    to the cache the earlier ones wrote; and admitted prompts are grouped only while a group's padded tokens
    fit the chunk. Here the workspace is made for 16 tokens: a prompt of most of the context takes 2 (MoE)
    or 4 (dense) chunks and three 12-token prompts admitted with it (dense) go one by one; the greedy tokens are the unchunked
    engine's, every prefill forward takes at most 16 tokens, and the device peak stays inside the budget,
    sized with the smaller workspace."""
    import gc

    from test_planned_run import CTX, dense_sizes

    from tiered.hardware.standin import device_memory
    from tiered.memory import sizes

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(path, config):
        gc.collect()
        with device_memory() as m:
            llm = LLM(path, config)
            spans, tokens = [], []
            forward = llm._forward

            def counted(seqs, cache, prefill, span=None):
                if prefill:
                    spans.append(span)
                    a, b = zip(*[span or (s.cached_tokens, len(s.prompt_ids)) for s in seqs])
                    tokens.append(len(seqs) * max(e - s for s, e in zip(a, b)))
                return forward(seqs, cache, prefill, span)
            monkeypatch.setattr(llm, "_forward", counted)
            try:
                long = list(range(2, llm.max_context - 7))
                shorts = [list(range(100 + 20 * i, 112 + 20 * i)) for i in range(llm.engine_config.max_batch - 1)]
                out = [r.token_ids for r in llm.generate([long] + shorts, params)]
                assert 0 < m.peak <= llm.fast_budget.capacity, (m.peak, llm.fast_budget.capacity)
                return out, llm.plan.prefill_chunk, [s for s in spans if s is not None], len(long), max(tokens)
            finally:
                llm.close()

    def cases():
        non_ffn, layer, kv, L = dense_sizes(zoo.dir("llama"))
        s = rt.sizes("mixtral")
        return [(zoo.dir("llama"), EngineConfig(decode_weights="fp32", accelerator="host", max_context=CTX, max_batch=4,
                                                profile=box, gpu_memory=non_ffn + 4 * kv + layer + layer * L // 4)),
                (rt.dir("mixtral"), engine_config(accelerator="host", max_batch=1,
                                                  gpu_memory=s.fast(cache_slots=2, resident=1)))]

    whole = [run(path, config) for path, config in cases()]
    monkeypatch.setattr(sizes, "WORKSPACE_TOKENS", 16)
    chunked = [run(path, config) for path, config in cases()]
    for (tokens, chunk, spans, n, most), (ref, ref_chunk, ref_spans, _, _) in zip(chunked, whole):
        assert ref_chunk == 512 and not ref_spans
        assert chunk == 16 and spans == [(a, min(a + 16, n)) for a in range(0, n, 16)] and len(spans) > 1
        assert most <= 16
        assert tokens == ref
