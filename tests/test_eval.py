"""Accuracy measurement (tiered/eval, `tiered eval`): sliding-window perplexity against transformers,
window bookkeeping, KL to the lossless weights, and the CLI's one-line errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from typer.testing import CliRunner

from fixtures import CORPUS, prompt_ids
from tiered import LLM
from tiered.cli import app
from tiered.errors import ConfigError, ContextLengthError
from tiered.eval import compare, default_text_path, kl_run, perplexity, sliding_windows, text_ids, weights_config
from tiered.eval.kl import kl_divergence
from tiered.quant.linear import PhaseLinear


# ------------------------------------------------------------------------------ window bookkeeping
@settings(max_examples=300, deadline=None)
@given(n=st.integers(2, 400), window=st.integers(2, 64), data=st.data())
def test_windows_score_every_token_once(n, window, data):
    stride = data.draw(st.integers(1, window - 1))
    ws = sliding_windows(n, window, stride)
    scored = [t for w in ws for t in range(w.first, w.end)]
    assert scored == list(range(1, n))  # each token after the first, once, in order
    assert ws[0].begin == 0 and ws[-1].end == n
    for i, w in enumerate(ws):
        assert w.begin == i * stride and 0 < w.end - w.begin <= window and w.begin < w.first < w.end
        if i:  # after the first window every scored token sees window - stride tokens of context or more
            assert w.first - w.begin >= window - stride


@pytest.mark.parametrize("n,window,stride", [(1, 8, 4), (10, 8, 8), (10, 8, 0), (10, 8, 9)])
def test_bad_windows_refused(n, window, stride):
    with pytest.raises(ConfigError):
        sliding_windows(n, window, stride)


# ------------------------------------------------------------------------- perplexity and KL
def hf_strided_perplexity(model, ids: list[int], window: int, stride: int) -> float:
    """Hugging Face's strided-perplexity recipe (docs/transformers perplexity), written from the
    labels: positions not to score are -100, and the loss counts the labels left after the shift."""
    x = torch.tensor([ids])
    nll_sum, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        target = x[:, begin:end].clone()
        target[:, :-(end - prev_end)] = -100
        with torch.no_grad():
            loss = model(x[:, begin:end], labels=target).loss
        valid = int((target[:, 1:] != -100).sum())
        nll_sum, count, prev_end = nll_sum + float(loss) * valid, count + valid, end
        if end == len(ids):
            break
    return math.exp(nll_sum / count)


@pytest.fixture(scope="module")
def fp32(zoo):
    return LLM(zoo.dir("llama"), weights_config("fp32"))


@pytest.fixture(scope="module")
def int4(zoo):
    return LLM(zoo.dir("llama"), weights_config("int4"))


@pytest.mark.parametrize("window,stride", [(32, 12), (24, 23), (200, 50)])
def test_perplexity_equals_transformers(zoo, fp32, window, stride):
    ids = prompt_ids(zoo.vocab_size, 100)
    r = perplexity(fp32, ids, window, stride)
    assert r.tokens == 99 and r.windows == len(sliding_windows(100, window, stride))
    assert r.ppl == pytest.approx(hf_strided_perplexity(zoo.hf("llama"), ids, window, stride), rel=1e-5)
    assert r.nll == pytest.approx(math.log(r.ppl))


def test_window_longer_than_context_refused(zoo, fp32):
    with pytest.raises(ContextLengthError, match="context window 256"):
        perplexity(fp32, prompt_ids(zoo.vocab_size, 10), 257, 8)


def test_every_linear_takes_the_format(int4):
    """weights_config's EngineConfig puts every linear layer, lm_head included, on the format's copy
    for any step size; nothing is left as a plain nn.Linear."""
    linears = {n: m for n, m in int4.model.named_modules() if isinstance(m, (torch.nn.Linear, PhaseLinear))}
    assert "lm_head" in linears and len(linears) == 2 * 7 + 1
    assert all(type(m) is PhaseLinear and m.threshold >= 10**9 for m in linears.values())


def test_kl_zero_for_lossless_positive_for_int4(zoo, fp32, int4):
    ids = prompt_ids(zoo.vocab_size, 80, seed=3)
    ref, kls = compare(fp32, {"fp32": LLM(zoo.dir("llama"), weights_config("fp32")), "int4": int4}, ids, 32, 16)
    assert ref.ppl == pytest.approx(perplexity(fp32, ids, 32, 16).ppl, rel=1e-12)
    assert kls["fp32"].mean == 0 and kls["fp32"].max == 0 and kls["fp32"].top1 == 1
    assert kls["fp32"].ppl == ref.ppl and kls["fp32"].tokens == 79
    k = kls["int4"]
    assert 0 < k.mean <= k.max and k.ppl != ref.ppl
    # the same numbers from the int4 model's logits, token by token
    p = torch.cat([fp32.logits(ids[w.begin:w.end])[w.first - 1 - w.begin:w.end - 1 - w.begin]
                   for w in sliding_windows(80, 32, 16)])
    q = torch.cat([int4.logits(ids[w.begin:w.end], lossless=False)[w.first - 1 - w.begin:w.end - 1 - w.begin]
                   for w in sliding_windows(80, 32, 16)])
    assert k.mean == pytest.approx(float(kl_divergence(p, q).double().mean()), rel=1e-5)
    assert k.top1 == pytest.approx(float((p.argmax(-1) == q.argmax(-1)).float().mean()))
    # the lossless flag is what routes scoring to the dense weights
    assert torch.equal(int4.logits(ids[:32]), fp32.logits(ids[:32]))


def test_kl_run_takes_two_configs(zoo):
    ids = prompt_ids(zoo.vocab_size, 40, seed=4)
    ref, k = kl_run(zoo.dir("llama"), weights_config("fp32"), weights_config("bf16"), ids, 16, 8)
    assert ref.tokens == k.tokens == 39 and 0 < k.mean < 0.01


def test_kl_divergence_values():
    p = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    assert torch.equal(kl_divergence(p, p), torch.zeros(2))
    a, b = torch.tensor([math.log(0.75), math.log(0.25)]), torch.tensor([math.log(0.5), math.log(0.5)])
    expect = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert float(kl_divergence(a, b)) == pytest.approx(expect, rel=1e-6)


def test_unknown_weights_refused():
    with pytest.raises(ConfigError, match="int3"):
        weights_config("int3")


# ------------------------------------------------------------------------------------- text
def test_default_text_is_scipys_license():
    path = default_text_path()
    assert path.name == "LICENSE.txt" and path.parent.name.startswith("scipy-")
    assert "GNU GENERAL PUBLIC LICENSE" in path.read_text()


def test_text_ids(zoo, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(CORPUS)
    ids = text_ids(zoo.tokenizer, f)
    assert ids == zoo.tokenizer(CORPUS, add_special_tokens=False)["input_ids"] and len(ids) > 20
    assert text_ids(zoo.tokenizer, f, 7) == ids[:7]
    with pytest.raises(ConfigError, match="does not exist"):
        text_ids(zoo.tokenizer, tmp_path / "missing.txt")
    f.write_text("a")
    with pytest.raises(ConfigError, match="at least 2"):
        text_ids(zoo.tokenizer, f)


# -------------------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("text") / "corpus.txt"
    f.write_text(CORPUS)
    return f


def test_cli_ppl_and_kl(zoo, fp32, corpus_file):
    model = str(zoo.dir("llama"))
    res = CliRunner().invoke(app, ["eval", "ppl", "--model", model, "--text", str(corpus_file), "--window", "16",
                                   "--stride", "8", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    ids = text_ids(zoo.tokenizer, corpus_file)
    assert out["ppl"] == pytest.approx(perplexity(fp32, ids, 16, 8).ppl, rel=1e-9)
    assert out["tokens"] == len(ids) - 1 and out["weights"] == "fp32"
    res = CliRunner().invoke(app, ["eval", "kl", "--model", model, "--text", str(corpus_file), "--window", "16",
                                   "--stride", "8", "--weights", "int4"])
    assert res.exit_code == 0, res.output
    assert "KL(fp32 || int4): mean" in res.output and "top-1 agreement" in res.output


def _bad(args, expect):
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    lines = [l for l in res.output.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and " — " in lines[0], res.output
    assert expect in lines[0] and "Traceback" not in res.output


@pytest.mark.parametrize("cmd", [["eval", "ppl"], ["eval", "kl", "--weights", "int8"]])
def test_cli_errors(zoo, corpus_file, tmp_path, cmd):
    model = ["--model", str(zoo.dir("llama"))]
    _bad(cmd + model + ["--text", str(tmp_path / "missing.txt")], "does not exist")
    _bad(cmd + model + ["--text", str(corpus_file), "--window", "300"], "context window 256")
    _bad(cmd + model + ["--text", str(corpus_file), "--window", "16", "--stride", "16"], "stride 16")
