"""Throughput over a batch of prompts (DESIGN.md scenario (d), FlexGen's setting): generated tokens a second
when N prompts of P tokens each generate G tokens (greedy, EOS ignored), by how many decode together.

tiered loads the model under the throughput goal (EngineConfig(goal="throughput", workload=(P, G)):
planner/throughput.plan_batch prices each batch and picks one), once with the plan's own batch and once each
with the batch capped at `--caps` (EngineConfig.max_batch); `LLM.generate` runs the N prompts through that many
KV-cache slots (continuous batching: a finished sequence's slot is taken by the next prompt). The baseline of
one request at a time is the latency goal's engine, a generate call a prompt (as `tiered run` answers them); the
latency goal's engine also runs one generate call of all N (as many together as its budget's room holds). The engines alternate for `--rounds` rounds
in one process; the table gives the median and the plan's priced throughput. The baseline is transformers'
`generate` on the same GGUF (the N prompts as one batch: equal lengths, no padding), timed the same way.

With `--moe-layers N` the dummy Qwen3-30B-A3B-width Q4_0 file of benchmarks/cpu_moe.py is measured too (random
weights: tiered only), with `--moe-cpu-mem` as the RAM budget (experts beyond it read from disk per use, so a
batch shares each expert read). The dummy's greedy decode repeats one token forever (each token's own embedding
row dominates its logits), so a lone sequence would route to the same experts every step and hit its cache
throughout: its rows draw with `--moe-repetition-penalty` (default 1000), which makes every step's token new and
routes the steps as the plans price them (independent draws). Writes throughput.{json,md}.

    python benchmarks/throughput.py --out benchmarks/results/<machine-date>/throughput
    python benchmarks/throughput.py --skip-dense --moe-layers 8 --moe-cpu-mem 2GiB --prompts 16 --prompt-tokens 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from tiered import LLM, EngineConfig, SamplingParams  # noqa: E402
from tiered.bench import Column, markdown_table, write_report  # noqa: E402


def prompts_of(vocab: int, n: int, tokens: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `tokens` token ids each, drawn uniformly from ids 100..vocab-1 (fixed seed)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (tokens,), generator=g).tolist() for _ in range(n)]


def priced_by_batch(plan) -> dict[int, float]:
    """The generated tok/s a throughput plan priced for each batch it tried (its note)."""
    for note in plan.notes:
        if note.startswith("throughput goal: batch") and "by batch: " in note:
            pairs = note.split("by batch: ")[1].split(")")[0].split(", ")
            return {int(b): float(v) for b, v in (p.split(": ") for p in pairs)}
    return {}


def tiered_rows(name: str, path: str | None, args, cpu_memory: str | None = None, penalty: float = 1.0) -> list[dict]:
    """Generated tok/s of `args.prompts` prompts: one request at a time (a latency-goal engine, a generate call
    per prompt, as `tiered run` answers them), and throughput-goal engines with the plan's own batch and with
    the batch capped at each of `args.caps` (EngineConfig.max_batch: the plan's batch within the cap)."""
    P, G, N = args.prompt_tokens, args.gen_tokens, args.prompts
    caps = [0, 1, -1] + [b for b in args.caps if 1 < b <= N]

    # experts past the RAM budget are read from disk in the engine's layout: converted once to an offload directory
    offload = str(Path.home() / ".cache" / "tiered" / "bench" / "offload-throughput") if cpu_memory else None

    def engine(cap: int) -> LLM:
        if cap in (1, -1):  # the latency goal's engine: a prompt a call, or one generate call of them all (-1)
            return LLM(path, EngineConfig(max_context=P + G, cpu_memory=cpu_memory, offload_dir=offload))
        return LLM(path, EngineConfig(goal="throughput", workload=(P, G), max_context=P + G, offload_dir=offload,
                                      max_batch=cap or N, cpu_memory=cpu_memory))  # (never past the prompts)
    engines = {cap: engine(cap) for cap in dict.fromkeys(caps)}
    first = engines[0]
    prompts = prompts_of(first.config.vocab_size, N, P)
    params = SamplingParams(temperature=0, max_tokens=G, ignore_eos=True, repetition_penalty=penalty)
    for llm in engines.values():  # warm-up
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), chat=False)
    times: dict[int, list[float]] = {cap: [] for cap in engines}
    for _ in range(args.rounds):
        for cap, llm in engines.items():
            t0 = time.perf_counter()
            outs = ([llm.generate(p, params, chat=False)[0] for p in prompts] if cap == 1 else
                    llm.generate(prompts, params, chat=False))
            times[cap].append(time.perf_counter() - t0)
            assert all(len(o.token_ids) == G for o in outs)
    one = statistics.median(times[1])
    rows = []
    for cap, llm in engines.items():
        s = statistics.median(times[cap])
        label = {0: "tiered, the plan's batch", 1: "tiered, one request at a time",
                 -1: "tiered, latency goal, one generate call of all"}.get(cap, f"tiered, batch capped at {cap}")
        # one at a time: what the throughput plan priced for a batch of 1 (its note of the batches it priced); the
        # latency goal's engine prices no batch
        priced = (llm.plan.predicted_throughput_tokens_per_s if cap not in (1, -1) else
                  priced_by_batch(first.plan).get(1) if cap == 1 else None)
        rows.append({"model": name, "engine": label, "batch": llm.plan.kv_slots, "seconds": s,
                     "tokens_per_s": N * G / s, "priced_tokens_per_s": priced, "vs_one_at_a_time": one / s})
        llm.close()
    return rows


def hf_row(name: str, path: str, args) -> dict:
    """transformers' generate, bf16, the prompts as one batch, on the same GGUF."""
    import transformers
    from transformers import AutoModelForCausalLM

    p = Path(path)
    # transformers 5 keeps a GGUF's blocks packed and computes in float32 ("fastest in float32", its loader says)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    model.eval()
    P, G, N = args.prompt_tokens, args.gen_tokens, args.prompts
    ids = torch.tensor(prompts_of(model.config.vocab_size, N, P))
    times = []
    with torch.inference_mode():
        model.generate(ids[:2, :16], max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=G, min_new_tokens=G,
                                 do_sample=False)
            times.append(time.perf_counter() - t0)
            assert out.shape == (N, P + G)
    s = statistics.median(times)
    del model
    return {"model": name, "engine": f"transformers {transformers.__version__} generate (fp32)", "batch": N, "seconds": s, "tokens_per_s": N * G / s,
            "priced_tokens_per_s": None, "vs_one_at_a_time": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64, help="N: prompts in the batch")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="P: tokens of each prompt")
    ap.add_argument("--gen-tokens", type=int, default=32, help="G: tokens each generates")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each batch, alternated")
    ap.add_argument("--caps", type=lambda t: [int(x) for x in t.split(",")], default=[4, 16, 64],
                    help="batch caps to measure beside one at a time and the plan's own (comma-separated)")
    ap.add_argument("--skip-dense", action="store_true", help="leave SmolLM2 out")
    ap.add_argument("--skip-hf", action="store_true", help="leave transformers out")
    ap.add_argument("--moe-layers", type=int, default=0, help="also the dummy Qwen3-30B-A3B-width Q4_0 file")
    ap.add_argument("--moe-cpu-mem", default=None, help="RAM budget of the MoE run (experts beyond it on disk)")
    ap.add_argument("--moe-repetition-penalty", type=float, default=1000.0,
                    help="the MoE rows' repetition penalty (the dummy's greedy decode repeats its token: see above)")
    ap.add_argument("--out", default=str(ROOT / "results" / "throughput"))
    args = ap.parse_args()

    rows: list[dict] = []
    if not args.skip_dense:
        from tiered.checkpoint import default_model_path

        rows += tiered_rows("SmolLM2-135M-Instruct Q4_1", None, args)
        if not args.skip_hf:
            rows.append(hf_row("SmolLM2-135M-Instruct Q4_1", str(default_model_path()), args))
    if args.moe_layers:
        from cpu_moe import model_file

        name = f"Qwen3-30B-A3B width, {args.moe_layers} layers, Q4_0 (dummy)" + (
            f", --cpu-mem {args.moe_cpu_mem}" if args.moe_cpu_mem else "")
        rows += tiered_rows(name, str(model_file(args.moe_layers)), args, args.moe_cpu_mem, args.moe_repetition_penalty)
    cols = [Column("model", "model"), Column("engine", "engine"), Column("batch", "batch"),
            Column("seconds", "seconds", "{:.2f}"), Column("generated tok/s", "tokens_per_s", "{:.1f}"),
            Column("priced tok/s", "priced_tokens_per_s", "{:.1f}"),
            Column("vs one at a time", "vs_one_at_a_time", "{:.2f}x")]
    body = (f"## {args.prompts} prompts of {args.prompt_tokens} tokens, {args.gen_tokens} generated each (greedy)\n\n"
            + markdown_table(rows, cols))
    json_path, md_path = write_report(
        "throughput", args.out, title="Throughput over a batch of prompts", settings=vars(args), rows=rows, body=body,
        notes=["generated tok/s: prompts x generated tokens / the wall time of one generate call over all the prompts "
               "(their prefills included), the median of the rounds; the batches alternate in one process.",
               "priced: what the throughput plan (planner/throughput.plan_batch) priced for that batch; the plan's "
               "batch is the one it chose (the smallest within 3% of the best it priced).",
               "transformers: generate() on the whole batch at once, from the same GGUF (float32 compute)."])
    print(md_path.read_text())


if __name__ == "__main__":
    main()
