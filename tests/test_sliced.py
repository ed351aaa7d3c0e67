"""Sliced execution (ScheInfer CC/CG/GG + token assignment) equals the unsliced MLP, on the stand-in."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered.hardware.accelerator import HostAccelerator
from tiered.models.moe import expert_forward
from tiered.runtime.executor import Executor
from tiered.runtime.sliced import SlicedMLP, install_sliced_mlps, split_rows

D, F = 32, 80
torch.manual_seed(0)
W = (torch.randn(F, D), torch.randn(F, D), torch.randn(D, F))


@pytest.fixture(scope="module")
def stand_in():
    acc = HostAccelerator(capacity=64 * 2**20)
    ex = Executor(acc, trace=True)
    yield acc, ex
    ex.close()


def test_split_rows_sums_and_rejects_bad_rates():
    assert sum(split_rows(101, 0.33, 0.33)) == 101
    assert split_rows(10, 0.0, 0.0) == (0, 0, 10)
    assert split_rows(10, 1.0, 0.0) == (10, 0, 0)
    with pytest.raises(ValueError):
        split_rows(10, 0.8, 0.5)


@settings(max_examples=40, deadline=None)
@given(r_cc=st.floats(0, 1), frac_cg=st.floats(0, 1), tokens=st.integers(1, 9), n_g=st.integers(0, 9))
def test_sliced_equals_unsliced_for_any_rates(stand_in, r_cc, frac_cg, tokens, n_g):
    acc, ex = stand_in
    r_cg = (1 - r_cc) * frac_cg
    x = torch.randn(tokens, D)
    ref = expert_forward(x, *W)
    used = acc.budget.used
    m = SlicedMLP(*W, r_cc, r_cg, acc, ex, n_g=n_g)
    y = acc.to_host(m(acc.to_device(x)))  # x and y live on the accelerator
    assert (y - ref).abs().max() / ref.abs().max() <= 1e-4
    assert acc.budget.used > used or m.f_gg == 0  # GG rows live in the accelerator's budget
    for t in m.gg + (m.staging.cg or ()) + (m.staging.cc or ()):
        acc.free(t)


def test_a_smaller_layer_stages_into_contiguous_views(stand_in):
    """Layers share one staging sized for the largest; a layer with fewer CG / CC rows gets
    contiguous [rows, D] and [D, rows] views of it (an H2D copy into a strided view goes through a
    device temporary), and computes what the unsliced MLP does."""
    from tiered.runtime.sliced import SliceStaging

    acc, ex = stand_in
    big = SliceStaging(acc, D, 40, 40, torch.float32)
    m = SlicedMLP(*W, 0.3, 0.2, acc, ex, n_g=2, staging=big)
    assert m.f_cg < 40 and m.f_cc < 40
    for view in m._cg_stage + m._cc_stage:
        assert view.is_contiguous()
    assert m._cg_stage[2].shape == (D, m.f_cg) and m._cc_stage[2].shape == (D, m.f_cc)
    x = torch.randn(5, D)
    ref = expert_forward(x, *W)
    y = acc.to_host(m(acc.to_device(x)))
    assert (y - ref).abs().max() / ref.abs().max() <= 1e-4
    for t in m.gg + big.cg + big.cc:
        acc.free(t)


def test_parts_run_on_their_streams(stand_in):
    acc, ex = stand_in
    ex.events.clear()
    m = SlicedMLP(*W, 0.4, 0.3, acc, ex, n_g=2)
    m(acc.to_device(torch.randn(6, D)))
    names = {(e.name, e.stream) for e in ex.events}
    assert {("CC", "cpu"), ("GG", "compute"), ("CG", "compute"), ("H2D CG", "copy"),
            ("H2D CG'", "copy"), ("CG'", "compute")} <= names


def test_sliced_model_logits_match_transformers(zoo):
    from tiered import LLM, EngineConfig

    llm = LLM(zoo.dir("llama"), EngineConfig(decode_weights="fp32", accelerator="host"))
    ids = list(range(2, 18))
    hf = zoo.hf("llama")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ex = Executor(llm.accelerator)
    rates = [(0.5, 0.25), (0.2, 0.6)]
    install_sliced_mlps(llm.model, rates, llm.accelerator, ex, n_g=4)
    out = llm.logits(ids)
    ex.close()
    assert (out - ref).abs().max() / ref.abs().max() <= 1e-4


@pytest.mark.skipif(__import__("tiered").kernels.load() is None, reason="tiered/kernels not built")
def test_bf16_cc_slices_decode_through_the_native_fused_expert(stand_in, monkeypatch):
    """A decode step's CC slice of bf16 weights runs tiered's fused GEMV expert (torch's bf16 F.linear
    streamed it at half the speed on the H200's host); a prompt's takes torch's GEMMs. Both match."""
    from tiered import kernels

    acc, ex = stand_in
    ext = kernels.load()
    calls = []

    class Spy:
        def __getattr__(self, name):
            return getattr(ext, name)

        def bf16_expert_forward(self, *a):
            calls.append(a[-1].shape[0])
            return ext.bf16_expert_forward(*a)

    monkeypatch.setattr(kernels, "load", lambda *a, **k: Spy())
    # the native kernel's bf16 rows are each build's tuning (2 to 32): pinned at 8, so the 3-token step takes it
    monkeypatch.setattr(kernels, "bf16_native_rows", lambda: 8)
    Wb = tuple(w.to(torch.bfloat16) for w in W)
    m = SlicedMLP(*Wb, 0.6, 0.2, acc, ex)
    for tokens in (1, 3, 20):
        x = torch.randn(tokens, D).to(torch.bfloat16)
        ref = expert_forward(x.float(), *(w.float() for w in Wb))
        y = acc.to_host(m(acc.to_device(x))).float()
        assert (y - ref).abs().max() / ref.abs().max() <= 3e-2
    assert calls == [1, 3]  # the 20-token prompt's CC ran torch's GEMMs
    for t in m.gg + (m.staging.cg or ()) + (m.staging.cc or ()):
        acc.free(t)
