"""benchmarks/kv_lossy.py's simulated schemes (FlexGen's 4-bit KV cache and top-K sparse attention), which
docs/accuracy.md's numbers rest on: each does what it says on small random tensors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import kv_lossy  # noqa: E402
from tiered.models import layers  # noqa: E402


@pytest.mark.parametrize("group", [16, 32, 64])
def test_int4_rows_are_16_levels_between_each_groups_min_and_max(group):
    x = torch.randn(2, 3, 5, 64) * torch.linspace(0.1, 4.0, 64)  # channels of different ranges
    y = kv_lossy.int4_rows(x, group)
    xs, ys = x.unflatten(-1, (64 // group, group)), y.unflatten(-1, (64 // group, group))
    lo, hi = xs.amin(-1, keepdim=True), xs.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    assert torch.all((ys - xs).abs() <= step / 2 + 1e-5)  # rounded to the nearest level
    levels = torch.round((ys - lo) / step)
    assert torch.allclose(ys, lo + levels * step, atol=1e-5) and levels.min() >= 0 and levels.max() <= 15
    assert torch.equal(kv_lossy.int8_rows(x), layers.dequantize_kv_rows(layers.quantize_kv_rows(x), x.dtype, 64))


def test_sparse_attention_keeps_each_querys_own_key_and_its_top_share():
    torch.manual_seed(0)
    B, H, Hkv, T, hd = 1, 4, 2, 40, 16
    q, k, v = torch.randn(B, H, T, hd), torch.randn(B, Hkv, T, hd), torch.randn(B, Hkv, T, hd)
    scale = hd ** -0.5
    real = layers.attend
    exact = real(q, k, v, None, True, scale, True)
    with kv_lossy.sparse_attention(1.0, False):  # every key kept: the exact attention
        assert torch.allclose(layers.attend(q, k, v, None, True, scale, True), exact, atol=1e-5)
    # keep 10%: query t attends to itself and round(0.1 t) (at least 1) of its t earlier keys, the heaviest
    kk = k.repeat_interleave(H // Hkv, 1)
    p = ((q @ kk.transpose(-1, -2)) * scale).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    p = p.softmax(-1)
    want = torch.zeros_like(p)
    for t in range(T):
        n = max(1, round(0.1 * t))
        earlier = p[..., t, :t] if t else p[..., t, :0]
        keep = earlier.topk(min(n, t), -1).indices if t else None
        want[..., t, t] = p[..., t, t]
        if keep is not None:
            want[..., t, :t].scatter_(-1, keep, earlier.gather(-1, keep))
    vv = v.repeat_interleave(H // Hkv, 1)
    for renorm in (False, True):
        w = want / want.sum(-1, keepdim=True) if renorm else want
        with kv_lossy.sparse_attention(0.1, renorm):
            assert torch.allclose(layers.attend(q, k, v, None, True, scale, True), w @ vv, atol=1e-5)
    assert layers.attend is real  # restored on leaving


def test_sparse_attention_runs_through_an_engines_prompt(zoo):
    """The engine calls layers.attend with the chunk's `past` and a sliding layer's `window` beside the seven
    arguments: sparse_attention's stand-in takes them (it had taken seven), places the queries at `past` (a CPU
    prompt's keys widened to an aligned count end past its last query), and keeping every key is the exact
    attention: LLM.logits (what the benchmark reads) unchanged."""
    from fixtures import prompt_ids

    llm = zoo.llm(zoo.dir("llama"))
    ids = prompt_ids(zoo.vocab_size, 40, seed=3)
    exact = llm.logits(ids)
    with kv_lossy.sparse_attention(1.0, False):
        kept = llm.logits(ids)
    with kv_lossy.sparse_attention(0.1, False):
        sparse = llm.logits(ids)
    assert torch.allclose(kept, exact, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(sparse, exact, atol=1e-2, rtol=1e-2)
