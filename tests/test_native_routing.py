"""The native decode step's MoE routing rules (kernels/csrc/decode.cpp route_row, set_moe's `method`)
against the modules': models/moe.Router and models/deepseek.DeepSeekRouter.select.

DeepSeek's rules (DeepSeek-V2, arXiv 2405.04434, §2.2; DeepSeek-V3, arXiv 2412.19437, §2.1.2):
"greedy" (softmax, top-k), "group_limited_greedy" (softmax; only the topk_group groups with the best
expert), "noaux_tc" (sigmoid; the choice adds a bias, a group scores its two best choices; the
weights are the unbiased scores), each optionally renormalized, then times routed_scaling_factor.
`DecodeStep.route` applies a layer's rule to given logits, so crafted rows test it alone: random
logits, near-ties (gaps of 1e-5, far above either side's rounding), exact ties between experts and
between whole groups, and a group whose best expert is not in the best group by sum (noaux_tc's
top-2 sum against group_limited_greedy's max). 64 experts in 8 groups of 8, top-6 (DeepSeek-V3's
256 / 8 / top-8 in miniature).

Exact ties: torch.topk leaves the order of equal values to its selection algorithm (measured: not
the index order), the step takes the lower expert (or group) first. Rows without exact ties must
equal the module's choice as it is; every row must equal it with torch.topk replaced by a stable
sort (`stable_topk`: the lower index first among equals), the module's code otherwise unchanged.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tiered import kernels
from tiered.models.deepseek import DeepSeekRouter
from tiered.models.moe import Router

pytestmark = pytest.mark.skipif(not kernels.available(), reason="tiered/kernels is not built")

D, E, K, F = 64, 64, 6, 32  # hidden, experts, top-k, expert width
SCALING = 2.5


def experts(n: int = E):
    """BoundExperts of n random bf16 SwiGLU experts of width D (set_moe needs them; route reads none)."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(*shape, generator=g).to(torch.bfloat16) for _ in range(n) for shape in ((F, D), (F, D), (D, F))]
    return kernels.load().bf16_experts_bind(ws)


def step_with_moe(**moe):
    """A one-layer DecodeStep (plain attention) whose FFN is a MoE block with set_moe's `moe` arguments."""
    from tiered.kernels.linear import kernel_for

    ext = kernels.load()
    H, hd = 4, 16
    step = ext.DecodeStep(D, H, H, hd, hd ** -0.5)
    lin = (lambda out: [kernel_for(torch.nn.Linear(D, out, bias=False))])
    step.add_layer(torch.ones(D), torch.ones(D), 1e-6, lin(3 * H * hd), lin(D), [], [])
    args = dict(router=torch.zeros(E, D), top_k=K, norm_topk_prob=True, experts=experts())
    step.set_moe(0, **{**args, **moe})
    return step


def stable_topk(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """torch.topk with equal values in index order (a stable descending sort): the step's tie rule."""
    assert largest and sorted and dim == -1
    v, i = x.sort(dim=-1, descending=True, stable=True)
    return torch.return_types.topk((v[..., :k], i[..., :k]))


def deepseek_router(method: str, n_group: int, topk_group: int, norm: bool, bias: torch.Tensor | None):
    """The module's router with these rules over E experts, top-K, SCALING."""
    cfg = SimpleNamespace(hidden_size=D, num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm,
                          topk_method=method, n_group=n_group, topk_group=topk_group, routed_scaling_factor=SCALING)
    router = DeepSeekRouter(cfg)
    if bias is not None:
        router.e_score_correction_bias.data.copy_(bias)
    return router


def crafted_logits() -> torch.Tensor:
    """Rows of logits fp32 [N, E] (see the module docstring). Experts 2i and 2i + 1 share a bias in
    the noaux_tc tests, so rows equal in pairs tie in the choice too."""
    g = torch.Generator().manual_seed(1)
    rows = [torch.randn(E, generator=g) * s for s in (0.1, 1.0, 3.0) for _ in range(6)]
    for _ in range(6):  # near-ties: a few values 1e-5 apart at the top and around the k-th
        r = torch.randn(E, generator=g)
        top = r.argsort(descending=True)[:K + 2]
        r[top] = 2.0 + 1e-5 * torch.arange(K + 2, dtype=torch.float32)[torch.randperm(K + 2, generator=g)]
        rows.append(r)
    for _ in range(4):  # exact ties: equal values at the k-th place
        r = torch.randn(E, generator=g)
        r[torch.randperm(E, generator=g)[:K + 3]] = 1.5
        rows.append(r)
    for _ in range(4):  # experts equal in pairs, one above them all: the k-th place between a pair
        r = torch.randn(E // 2, generator=g).repeat_interleave(2)
        r[int(torch.randint(E, (1,), generator=g))] = 4.0
        rows.append(r)
    r = torch.randn(E, generator=g)  # two whole groups equal (groups 2 and 5) and best
    r[40:48] = r[16:24]
    r[16:24] += 4.0
    r[40:48] += 4.0
    rows.append(r)
    r = torch.full((E,), -2.0)  # group 0: one strong expert (best max); group 3: two good ones (best top-2 sum)
    r[3] = 3.0
    r[26], r[29] = 2.0, 2.0
    rows.append(r)
    return torch.stack(rows)


ROUTINGS = {
    "greedy": ("greedy", 1, 1, False),
    "greedy-norm": ("greedy", 1, 1, True),
    "group_limited": ("group_limited_greedy", 8, 3, False),
    "group_limited-norm": ("group_limited_greedy", 8, 1, True),
    "noaux_tc": ("noaux_tc", 8, 4, True),
    "noaux_tc-nonorm": ("noaux_tc", 8, 2, False),
    "noaux_tc-one-group": ("noaux_tc", 1, 1, True),
}


RANDOM_ROWS = 24  # crafted_logits' rows without exact ties (random, near-ties)


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_native_routing_equals_deepseek_router(name, monkeypatch):
    """The step's experts, in order, equal DeepSeekRouter.select's: as it is on the rows without exact
    ties, with stable_topk on every crafted row; the weights to fp32 rounding (the exponentials differ
    by an ulp or two)."""
    method, n_group, topk_group, norm = ROUTINGS[name]
    bias = None
    if method == "noaux_tc":
        bias = 0.3 * torch.randn(E // 2, generator=torch.Generator().manual_seed(2)).repeat_interleave(2)
        bias[16:24] = bias[40:48]  # the tied groups stay tied with the bias
    step = step_with_moe(norm_topk_prob=norm, method=method, n_group=n_group, topk_group=topk_group,
                         scaling=SCALING, bias=bias)
    logits = crafted_logits()
    idx, wt = step.route(0, logits)
    router = deepseek_router(method, n_group, topk_group, norm, bias)
    ref_idx, ref_wt = router.select(logits)
    assert idx.dtype == torch.int64 and wt.dtype == torch.float32 and idx.shape == (len(logits), K)
    assert torch.equal(idx[:RANDOM_ROWS], ref_idx[:RANDOM_ROWS])
    torch.testing.assert_close(wt[:RANDOM_ROWS], ref_wt[:RANDOM_ROWS], rtol=2e-6, atol=1e-7)
    monkeypatch.setattr(torch.Tensor, "topk", stable_topk)
    ref_idx, ref_wt = router.select(logits)
    monkeypatch.undo()
    assert torch.equal(idx, ref_idx), (idx != ref_idx).any(-1).nonzero().flatten().tolist()
    torch.testing.assert_close(wt, ref_wt, rtol=2e-6, atol=1e-7)
    if n_group > 1:  # every row's experts lie in at most topk_group groups
        assert max(len(set((row // (E // n_group)).tolist())) for row in idx) <= topk_group


@pytest.mark.parametrize("norm", [False, True])
def test_native_softmax_routing_equals_router(norm, monkeypatch):
    """The default method is models/moe.Router's: softmax, top-k, renormalized when norm_topk_prob; no scaling."""
    step = step_with_moe(norm_topk_prob=norm)
    logits = crafted_logits()
    idx, wt = step.route(0, logits)
    ref_idx, ref_wt = Router(D, E, K, norm).select(logits)
    assert torch.equal(idx[:RANDOM_ROWS], ref_idx[:RANDOM_ROWS])
    monkeypatch.setattr(torch, "topk", lambda x, k, dim=-1: stable_topk(x, k, dim))
    ref_idx, ref_wt = Router(D, E, K, norm).select(logits)
    monkeypatch.undo()
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(wt, ref_wt, rtol=2e-6, atol=1e-7)


def test_set_moe_checks_its_arguments():
    """Routing arguments the rule cannot take are refused with what was wrong."""
    bias = torch.zeros(E)
    bad = [
        (dict(method="topk"), "unknown routing method"),
        (dict(method="group_limited_greedy", n_group=7, topk_group=1), "do not split into n_group = 7"),
        (dict(method="group_limited_greedy", n_group=8, topk_group=9), "topk_group must be in \\[1, 8\\]"),
        (dict(method="group_limited_greedy", n_group=8, topk_group=0), "topk_group must be in"),
        (dict(method="noaux_tc", n_group=32, topk_group=1, bias=bias), "top_k = 6 exceeds the 2 experts"),
        (dict(method="noaux_tc", n_group=64, topk_group=8, bias=bias), "groups need 2 or more"),
        (dict(method="noaux_tc", n_group=8, topk_group=4), "noaux_tc takes a bias"),
        (dict(method="noaux_tc", n_group=8, topk_group=4, bias=torch.zeros(E - 1)), "the bias must be \\[64\\]"),
        (dict(method="greedy", bias=bias), "noaux_tc takes a bias"),
        (dict(method="greedy", n_group=8, topk_group=2), "takes no groups"),
        (dict(method="greedy", scaling=0.0), "routed scaling must be > 0"),
        (dict(scaling=2.0), "'softmax' has no routed scaling"),
    ]
    for args, match in bad:
        with pytest.raises(RuntimeError, match=match):
            step_with_moe(**args)
    from tiered.kernels.linear import kernel_for

    def lin(out, inp):
        return [kernel_for(torch.nn.Linear(inp, out, bias=False))]

    step_with_moe(method="greedy", shared_gate_up=lin(2 * F, D), shared_down=lin(D, F))  # ungated (DeepSeek)
    step_with_moe(shared_gate_up=lin(2 * F, D), shared_down=lin(D, F), shared_gate=lin(1, D))  # gated (Qwen-MoE)
    with pytest.raises(RuntimeError, match="shared expert's kernels"):
        step_with_moe(shared_gate_up=lin(2 * F, D), shared_down=lin(D, F), shared_gate=lin(2, D))
    with pytest.raises(RuntimeError, match="without shared_gate_up"):
        step_with_moe(shared_down=lin(D, F))
