"""EngineConfig.dtype="auto": the checkpoint's dtype on a CUDA accelerator, float32 on the CPU and
the host stand-in (the lossless mode); explicit dtypes are kept everywhere."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from tiered import LLM, EngineConfig
from tiered.checkpoint import open_checkpoint
from tiered.engine.dtype import checkpoint_dtype, resolve_dtype
from tiered.hardware.accelerator import HostAccelerator

CUDA_LIKE = SimpleNamespace(is_host=False)  # what resolve_dtype reads of a CudaAccelerator


@pytest.fixture(scope="module")
def bf16_dir(zoo, tmp_path_factory):
    """The tiny Llama checkpoint with its tensors stored as BF16."""
    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("bf16") / "llama"
    shutil.copytree(zoo.dir("llama"), d)
    f = d / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    return d


def test_checkpoint_dtype_from_storage_formats(zoo, bf16_dir):
    assert checkpoint_dtype(open_checkpoint(zoo.dir("llama"))) == torch.float32
    assert checkpoint_dtype(open_checkpoint(bf16_dir)) == torch.bfloat16
    assert checkpoint_dtype(open_checkpoint(zoo.gguf("llama", "F32"))) == torch.float32
    # GGUF blocks (norms stay F32, but most elements are quantized) and fp16 files: bf16
    assert checkpoint_dtype(open_checkpoint(zoo.gguf("llama", "Q4_0"))) == torch.bfloat16
    assert checkpoint_dtype(open_checkpoint(zoo.gguf("llama", "F16"))) == torch.bfloat16


def test_resolve_dtype(zoo, bf16_dir):
    fp32_ckpt, bf16_ckpt = open_checkpoint(zoo.dir("llama")), open_checkpoint(bf16_dir)
    auto = EngineConfig()
    assert auto.dtype == "auto"
    for acc in (None, HostAccelerator()):  # the CPU and the stand-in: lossless float32
        assert resolve_dtype(auto, acc, bf16_ckpt) == torch.float32
    assert resolve_dtype(auto, CUDA_LIKE, bf16_ckpt) == torch.bfloat16
    assert resolve_dtype(auto, CUDA_LIKE, fp32_ckpt) == torch.float32
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        for acc in (None, HostAccelerator(), CUDA_LIKE):
            assert resolve_dtype(EngineConfig(dtype=name), acc, bf16_ckpt) == dt


@pytest.mark.parametrize("accelerator", ["none", "host"])
def test_engine_computes_in_the_resolved_dtype(bf16_dir, accelerator):
    base = dict(accelerator=accelerator, plan="off", decode_weights="fp32", max_context=32)
    auto = LLM(bf16_dir, EngineConfig(**base))
    assert auto.dtype == torch.float32 and all(p.dtype == torch.float32 for p in auto.model.parameters())
    bf16 = LLM(bf16_dir, EngineConfig(dtype="bfloat16", **base))
    assert bf16.dtype == torch.bfloat16
    assert {p.dtype for n, p in bf16.model.named_parameters() if ".decode." not in n} == {torch.bfloat16}
    ids = list(range(2, 12))
    assert (bf16.logits(ids) - auto.logits(ids)).abs().max() / auto.logits(ids).abs().max() < 0.05


@pytest.mark.cuda
def test_auto_is_the_checkpoints_dtype_on_cuda(zoo, bf16_dir):
    cfg = EngineConfig(accelerator="cuda", plan="off", max_context=32)
    llm = LLM(bf16_dir, cfg)
    assert llm.dtype == torch.bfloat16 and llm.model.lm_head.weight.dtype == torch.bfloat16
    assert llm.decode_weight_bytes == 0
    assert LLM(zoo.dir("llama"), cfg).dtype == torch.float32
