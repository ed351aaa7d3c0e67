"""CUDA path: the same parity checks with the real accelerator (torch.cuda streams, pinned memory).

Marked `cuda`: skipped on machines without a GPU (conftest.py), run when one is lent.
"""

from __future__ import annotations

import pytest
import torch

from runtime_fixtures import MOE_KINDS, cuda_library, engine_config, rt  # noqa: F401  (rt is a fixture)
from test_planned_run import box  # noqa: F401  (a fixture)
from test_runtime_parity import check_parity

from tiered import LLM

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_parity_all_on_gpu(rt, kind):  # noqa: F811
    llm = LLM(rt.dir(kind), engine_config(accelerator="cuda"))
    assert llm.device.type == "cuda"
    check_parity(rt, kind, llm)
    llm.close()


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_moe_parity_experts_in_pinned_cpu_ram(rt, kind):  # noqa: F811
    """Experts in pinned host memory, a 2-slot GPU cache: the dispatcher copies or runs on the CPU."""
    from tiered.hardware.cuda import page_locked

    s = rt.sizes(kind)
    llm = LLM(rt.dir(kind), engine_config(accelerator="cuda", gpu_memory=s.fast(cache_slots=2, library=cuda_library()),
                                          cpu_memory="64MiB", expert_cache_slots=2))
    assert llm.experts.placement.count("cpu") == s.total_experts
    assert all(page_locked(t) for w in llm.experts.store.host.values() for t in w)
    check_parity(rt, kind, llm)
    paths = llm.experts.path_counts
    assert paths["copy"] + paths["cpu"] > 0
    assert llm.fast_budget.peak <= llm.fast_budget.capacity
    llm.close()


def test_dense_llama_on_gpu(zoo):
    from tiered import EngineConfig

    llm = LLM(zoo.dir("llama"), EngineConfig(decode_weights="fp32", accelerator="cuda"))
    ids = list(range(2, 18))
    with torch.no_grad():
        ref = zoo.hf("llama")(torch.tensor([ids])).logits[0]
    out = llm.logits(ids)
    assert (out - ref).abs().max() / ref.abs().max() <= 1e-4


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_real_device_allocations_stay_inside_the_gpu_budget(rt, kind):  # noqa: F811
    """torch.cuda.max_memory_allocated over load and generation stays under --gpu-mem: the plan keeps
    room for the activation workspace, not only for what tiered allocates itself."""
    s = rt.sizes(kind)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    budget = s.fast(cache_slots=2, library=cuda_library())  # the plan's workspace: a 512-token step, cuBLAS
    llm = LLM(rt.dir(kind), engine_config(accelerator="cuda", gpu_memory=budget, cpu_memory="64MiB"))
    check_parity(rt, kind, llm)
    assert torch.cuda.max_memory_allocated() - base <= budget
    llm.close()


def test_attention_on_cuda_skips_cudnn_and_restores_the_flag():
    """tiered's attention on CUDA runs with cuDNN attention off (its per-shape plan cost 33-36 ms of
    host time per decode step, 2026-11-26) and gives back the process's setting; same values as math."""
    from tiered.models.layers import attend

    q = torch.randn(1, 8, 1, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 37, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    before = torch.backends.cuda.cudnn_sdp_enabled()
    out = attend(q, k, v, None, False, 0.125, True)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(4, 1),
                                                           v.float().repeat_interleave(4, 1), scale=0.125)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_stream_waits_sleep_on_a_blocking_event():
    """A worker's wait for its CUDA stream is a blocking event (no spinning core beside the CPU experts'
    OpenMP team); the work is done when the context exits."""
    from tiered.hardware.cuda import CudaAccelerator

    acc = CudaAccelerator()
    src = torch.ones(1 << 20, pin_memory=True)
    dst = torch.empty(1 << 20, device="cuda")
    with acc.stream("copy"):
        acc.copy_to_device(dst, src)
    assert acc._streams["copy"].query() and float(dst.sum()) == float(1 << 20)


@pytest.mark.parametrize("pinned", ["huge", "cuda"])
def test_large_host_buffers_are_pinned_and_copy_asynchronously(pinned):
    """CudaAccelerator.host_buffer: a large buffer is page-locked (registered huge-page memory with
    "huge", cudaHostAlloc with "cuda"), copies from it run on the copy stream without blocking,
    and what lands equals what was written; freeing it unregisters it (a second buffer reuses
    nothing stale)."""
    import gc

    from tiered.hardware.budget import HUGE_PAGE, HUGE_PAGES_FROM, huge_pages_enabled
    from tiered.hardware.cuda import CudaAccelerator, page_locked

    acc = CudaAccelerator(pinned=pinned)
    for _ in range(2):
        h = acc.host_buffer((HUGE_PAGES_FROM // 2 + 3,), torch.bfloat16)
        assert page_locked(h)
        if pinned == "huge" and huge_pages_enabled():
            assert h.data_ptr() % HUGE_PAGE == 0  # tiered's own memory, not torch's pinned allocator
        h.copy_(torch.arange(h.numel()).to(torch.bfloat16))
        d = acc.alloc(tuple(h.shape), h.dtype, "test")
        with acc.stream("copy"):
            acc.copy_to_device(d, h)
        assert torch.equal(d.cpu(), h)
        del h, d
        gc.collect()


def test_captures_leave_no_cublas_workspace_behind():
    """CudaAccelerator.capture warms up and captures on one stream of its own and clears cuBLAS's
    workspaces around each capture: 16 captures of a GEMM add their outputs and at most one workspace to
    what is allocated. A fresh side stream per capture had left one workspace (32 MiB on Hopper) per
    capture, up to torch's 32 pooled streams (H100, 2026-11-26: ~1 GiB left after the engines closed)."""
    from tiered.hardware.cuda import CudaAccelerator, cublas_workspace_bytes

    acc = CudaAccelerator()
    a = torch.randn(256, 256, device="cuda")
    ref = a @ a
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    pool = acc.graph_pool()
    graphs = [acc.capture(lambda: a @ a, pool) for _ in range(16)]
    for replay, out in graphs:
        replay()
    torch.cuda.synchronize()
    assert all(torch.allclose(out, ref) for _, out in graphs)
    workspace = cublas_workspace_bytes(torch.cuda.get_device_capability()[0])
    grown = torch.cuda.memory_allocated() - base
    assert grown <= 16 * ref.numel() * 4 + workspace, (grown, workspace)


def test_a_closed_engine_leaves_nothing_allocated(zoo, box):
    """Issue 8 §8: an engine that sliced its FFNs and captured piecewise decode graphs, once closed and
    collected, leaves the device's allocated bytes where they were (LLM.close -> Accelerator.release
    drops the cuBLAS workspaces of its streams); its peak stayed inside its budget, library workspaces
    included (the plan keeps room for them: memory/sizes.device_workspace_bytes)."""
    import gc

    from test_planned_run import CTX, dense_sizes

    from tiered import EngineConfig, SamplingParams

    path = zoo.dir("llama")
    non_ffn, layer, kv, L = dense_sizes(path)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    budget = non_ffn + kv + layer + layer * L // 4 + cuda_library()
    llm = LLM(path, EngineConfig(decode_weights="fp32", accelerator="cuda", gpu_memory=budget, max_context=CTX,
                                 graphs="on", profile=box))  # the made-up machine: it slices (a real one may not)
    assert any(0 < l.r_gg < 1 for l in llm.plan.layers)
    llm.generate(list(range(2, 40)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert torch.cuda.max_memory_allocated() - base <= budget
    llm.close()
    del llm
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= base


@pytest.mark.parametrize("kind", ["mixtral", "deepseek_v2"])
def test_packed_prompts_attend_to_their_own_slots_on_cuda(rt, kind):  # noqa: F811
    """Prompts packed into one row on the GPU (models/layers.build_packed_metadata: each segment's mask made on the
    device, one SDPA call a segment) give each one's logits alone and leave each slot its own KV
    (fixtures.packed_prefill_gaps), MoE and DeepSeek's latent attention alike; fp32, so the bound is tight."""
    from fixtures import local_model, packed_prefill_gaps
    from moe_fixtures import VOCAB

    model = local_model(rt.dir(kind)).to("cuda")
    prefill, decode = packed_prefill_gaps(model, VOCAB, torch.float32, "cuda")
    assert prefill <= 1e-4 and decode <= 1e-4, (prefill, decode)


def test_packed_prefill_on_cuda_equals_one_at_a_time(rt, monkeypatch):  # noqa: F811
    """The engine on a GPU packs prompts admitted together into one forward (LLM._prefill_groups) and each decodes
    the greedy tokens it decodes alone (test_standin_strict's packed test runs the same on the host stand-in)."""
    import tiered.engine.llm as engine_llm
    from runtime_fixtures import GREEDY, prompt

    calls = []
    build = engine_llm.build_packed_metadata
    monkeypatch.setattr(engine_llm, "build_packed_metadata", lambda *a: calls.append(a[2]) or build(*a))
    prompts = [prompt(n, seed=n) for n in (5, 12, 9)]
    with LLM(rt.dir("mixtral"), engine_config(accelerator="cuda")) as llm:
        batched = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert calls == [[(0, 5), (0, 12), (0, 9)]]
        assert batched == [llm.generate(p, GREEDY)[0].token_ids for p in prompts]
