"""Decode steps captured as CUDA graphs: the static-shape step they replay (checked here on the CPU
against the engine's own step) and, on a GPU, the captured graphs themselves."""

from __future__ import annotations

import pytest
import torch

from tiered import LLM, EngineConfig, SamplingParams
from tiered.models.layers import KVCache, build_static_decode_metadata
from tiered.runtime.graphs import kv_bucket


def test_kv_bucket_is_a_capped_power_of_two():
    assert [kv_bucket(n, 4096) for n in (1, 256, 257, 1000, 4096)] == [256, 256, 512, 1024, 4096]
    assert kv_bucket(70, 64) == 64 and kv_bucket(3000, 2500) == 2500


@pytest.mark.parametrize("name,accelerator", [("llama", "none"), ("mistral", "none"), ("qwen3", "none"),
                                              ("mistral", "host")])
def test_static_decode_step_matches_the_engines_step(zoo, name, accelerator):
    """The step a graph replays (attention over a whole bucket with a device mask, KV written by index)
    gives the logits of the engine's step (attention over exactly the cached positions). On the strict
    stand-in every tensor of the step is a device tensor, as on CUDA: the device mask is checked too."""
    llm = LLM(zoo.dir(name), EngineConfig(accelerator=accelerator, decode_weights="fp32", dtype="float32",
                                          max_context=48, plan="off"))
    model, cfg, dev = llm.model, llm.config, llm._to_device
    ids = list(range(3, 23))  # 20 prompt tokens: past the tiny Mistral's sliding window
    slots = dev(torch.tensor([0]))
    with llm._device_scope():
        caches = [KVCache(cfg, 1, 48, torch.float32, llm.device) for _ in range(2)]
    with torch.inference_mode(), llm._device_scope():
        for c in caches:
            model(dev(torch.tensor([ids])), dev(torch.arange(len(ids)).unsqueeze(0)), slots, c)
        tok = ids[-1]
        for pos in range(len(ids), len(ids) + 8):
            x, p = dev(torch.tensor([[tok]])), dev(torch.tensor([[pos]]))
            eager = model(x, p, slots, caches[0])
            meta = build_static_decode_metadata(model.rotary, p, slots, 48, cfg.sliding_window, True)
            static = model(x, p, slots, caches[1], meta=meta)
            assert torch.allclose(static.cpu(), eager.cpu(), rtol=1e-5, atol=1e-5)
            tok = int(eager.argmax())
    llm.close()


def test_graphs_are_planned_only_on_a_real_gpu(zoo):
    for acc in ("none", "host"):
        llm = LLM(zoo.dir("llama"), EngineConfig(accelerator=acc, max_context=32, plan="off"))
        assert not llm.plan.decode_graphs and llm.runtime.graphs is None
        llm.close()


@pytest.mark.cuda
def test_cuda_graph_decode_equals_eager_decode(zoo):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    graphed = LLM(zoo.dir("llama"), EngineConfig(accelerator="cuda", max_context=64, decode_weights="fp32",
                                                 dtype="float32"))
    assert graphed.plan.decode_graphs and graphed.runtime.graphs is not None
    eager = LLM(zoo.dir("llama"), EngineConfig(accelerator="cuda", max_context=64, decode_weights="fp32",
                                               dtype="float32", trace=True))  # tracing runs steps eagerly
    assert eager.runtime.graphs is None
    prompt = list(range(2, 18))
    for _ in range(2):  # the second call replays the graphs captured over the same static cache
        assert graphed.generate([prompt], params)[0].token_ids == eager.generate([prompt], params)[0].token_ids
    assert graphed.runtime.graphs.disabled is None and graphed.runtime.graphs.captures == 1
