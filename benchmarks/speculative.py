"""Speculative decoding by prompt lookup (engine/speculative.py, `--speculative ngram`): decode speed with and
without it on tasks whose answers copy their prompts (a paragraph quoted, code edited, an extraction) and on one
that does not, whether the outputs are the same, and what a step of 1 + k rows costs against the plan's price.

Part 1 loads the default model (SmolLM2-135M-Instruct, a real model writing real text) twice, without and with
speculation, and decodes each task's chat prompt greedily (`--tokens` at most), the two engines alternated for
`--rounds` rounds in one process (this VM's speed moves within minutes). The baseline runs as `generate` runs
(a lone request in native bursts, LLM._burst). Reported: median decode tok/s of each, the speed-up, the draft
acceptance, and whether the tokens equal the baseline's (greedy speculation keeps the model's argmax; the rows
of a verification round their int8 activations as a batch's do, so a near tie may differ).

Part 2 times the native decode step over 1 + k rows of one sequence (its last token and k drafts, every row's
logits), k = 0..`--max-draft`, at a 256-token context, for SmolLM2 and, with `--dense-layers N`, the dummy
Llama-3-8B-width Q4_K_M file of N layers (benchmarks/cpu_dense_q4km.py's; random weights, so only its step
costs are reported), with `--moe-layers N` the dummy Qwen3-30B-A3B-width Q4_0 file (benchmarks/cpu_moe.py's:
each draft row routes to experts of its own), beside the plan's priced ratios (Plan.speculative_costs). Writes
speculative.{json,md}.

    python benchmarks/speculative.py --dense-layers 8 --moe-layers 8 --out benchmarks/results/<machine-date>/speculative
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
from tiered.bench import Column, write_report  # noqa: E402

PARAGRAPH = ("Offloading engines keep the weights of a model that does not fit on the GPU in CPU memory or on "
             "disk and stream them to the device as each layer runs. The link between the two is the bottleneck: "
             "a PCIe 4.0 x16 link moves about 25 GB/s, so a 40 GB model takes well over a second a token. Mixture-"
             "of-Experts models help, since each token reads only the experts its router picks, and caching the "
             "popular experts on the GPU helps further.")
CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''
TASKS = {
    "quote a paragraph": f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    "edit code": f"Rename the function to rolling_mean and return the result as a tuple. Write the whole "
                 f"code:\n\n{CODE}",
    "extract sentences": f"From the text below, list every sentence that mentions the GPU:\n\n{PARAGRAPH}",
    "open question": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def _part1(args) -> list[dict]:
    engines = {"off": LLM(config=EngineConfig(speculative="off")),
               "ngram": LLM(config=EngineConfig(speculative="ngram", num_speculative_tokens=args.max_draft))}
    params = SamplingParams(max_tokens=args.tokens, temperature=0)
    speed = {(t, m): [] for t in TASKS for m in engines}
    drafts = {t: [0, 0] for t in TASKS}
    same = {t: [] for t in TASKS}
    tokens = {t: [] for t in TASKS}
    for llm in engines.values():  # warm-up
        llm.generate([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=8, temperature=0))
    for _ in range(args.rounds):
        for task, prompt in TASKS.items():
            outs = {}
            for mode, llm in engines.items():
                out = llm.generate([[{"role": "user", "content": prompt}]], params)[0]
                outs[mode] = out
                speed[task, mode].append(out.stats.decode_tokens_per_s)
            st = outs["ngram"].stats
            drafts[task][0] += st.draft_tokens
            drafts[task][1] += st.accepted_draft_tokens
            same[task].append(outs["ngram"].token_ids == outs["off"].token_ids)
            tokens[task].append(len(outs["off"].token_ids))
    rows = []
    for task in TASKS:
        off, on = (statistics.median(speed[task, m]) for m in engines)
        d, a = drafts[task]
        rows.append({"task": task, "median_tokens": statistics.median(tokens[task]), "off_tokens_per_s": off,
                     "ngram_tokens_per_s": on, "speedup": on / off, "draft_tokens": d, "accepted": a,
                     "acceptance": a / d if d else None, "same_tokens": f"{sum(same[task])}/{len(same[task])}"})
    costs = engines["ngram"].plan.speculative_costs
    for llm in engines.values():
        llm.close()
    return rows, costs


def _step_costs(llm: LLM, most: int, rounds: int, past: int = 256) -> list[float]:
    """Median seconds of the native step over 1 + k rows of one sequence at `past` cached positions, every row's
    logits, k = 0..most (rounds alternated)."""
    step = llm.runtime.cpu_decode
    cache = llm.kv_cache(1)
    g = torch.Generator().manual_seed(0)
    times: dict[int, list[float]] = {k: [] for k in range(most + 1)}
    with torch.inference_mode():
        ids = torch.randint(100, 1000, (past,), generator=g)
        step(ids.unsqueeze(1), torch.arange(past).unsqueeze(1), torch.zeros(past, dtype=torch.long), cache,
             rows=torch.tensor([past - 1]))
        for _ in range(rounds):
            for k in range(most + 1):
                t = torch.randint(100, 1000, (k + 1,), generator=g)
                t0 = time.perf_counter()
                step(t.unsqueeze(1), torch.arange(past, past + k + 1).unsqueeze(1), torch.zeros(k + 1, dtype=torch.long),
                     cache, rows=torch.arange(k + 1))
                times[k].append(time.perf_counter() - t0)
    return [statistics.median(times[k]) for k in range(most + 1)]


def _part2(args) -> list[dict]:
    models = {"SmolLM2-135M int4 (default)": None}
    if args.dense_layers:
        from cpu_dense_q4km import model_file

        models[f"Llama-3-8B width, {args.dense_layers} layers, Q4_K_M (dummy)"] = str(model_file(args.dense_layers))
    if args.moe_layers:
        from cpu_moe import model_file as moe_file

        models[f"Qwen3-30B-A3B width, {args.moe_layers} layers, Q4_0 (dummy)"] = str(moe_file(args.moe_layers))
    rows = []
    for name, path in models.items():
        llm = LLM(path, EngineConfig(speculative="ngram", num_speculative_tokens=args.max_draft))
        seconds = _step_costs(llm, args.max_draft, args.step_rounds)
        priced = llm.plan.speculative_costs or [None] * (args.max_draft + 1)
        for k, s in enumerate(seconds):
            rows.append({"model": name, "draft_tokens": k, "rows": k + 1, "step_ms": 1e3 * s,
                         "measured_ratio": s / seconds[0], "priced_ratio": priced[k] if k < len(priced) else None,
                         "breakeven_acceptance": _breakeven(s / seconds[0], k)})
        llm.close()
    return rows


def _breakeven(ratio: float, k: int) -> float | None:
    """The per-token acceptance a at which k drafts give as many tokens a second as none: 1 + a + .. + a^k = ratio."""
    if k == 0:
        return None
    lo, hi = 0.0, 1.0
    if sum(hi ** i for i in range(k + 1)) < ratio:
        return None  # never pays
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(k + 1)) < ratio else (lo, mid)
    return hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200, help="most tokens a request (greedy)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of part 1 (both engines, every task)")
    ap.add_argument("--max-draft", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--step-rounds", type=int, default=9, help="rounds of part 2's step timings")
    ap.add_argument("--dense-layers", type=int, default=0, help="also time the dummy Llama-3-8B-width file's steps")
    ap.add_argument("--moe-layers", type=int, default=0,
                    help="also time the dummy Qwen3-30B-A3B-width Q4_0 file's steps (benchmarks/cpu_moe.py's)")
    ap.add_argument("--skip-tasks", action="store_true", help="part 2 only")
    ap.add_argument("--out", default=str(ROOT / "results" / "speculative"))
    args = ap.parse_args()

    rows, costs = _part1(args) if not args.skip_tasks else ([], None)
    steps = _part2(args)
    tasks_cols = [Column("task", "task"), Column("median tokens", "median_tokens"),
                  Column("off tok/s", "off_tokens_per_s", "{:.1f}"), Column("ngram tok/s", "ngram_tokens_per_s", "{:.1f}"),
                  Column("speed-up", "speedup", "{:.2f}x"), Column("drafts", "draft_tokens"),
                  Column("accepted", "accepted"), Column("acceptance", "acceptance", "{:.0%}"),
                  Column("same tokens", "same_tokens")]
    step_cols = [Column("model", "model"), Column("rows (1 + drafts)", "rows"), Column("step ms", "step_ms", "{:.2f}"),
                 Column("measured vs 1 row", "measured_ratio", "{:.2f}"), Column("priced vs 1 row", "priced_ratio", "{:.2f}"),
                 Column("acceptance to break even", "breakeven_acceptance", "{:.2f}")]
    from tiered.bench import markdown_table

    body = ("## Decode with and without prompt lookup (SmolLM2-135M-Instruct, greedy)\n\n"
            + (markdown_table(rows, tasks_cols) if rows else "(skipped)")
            + "\n\n## A step of 1 + k rows of one sequence\n\n" + markdown_table(steps, step_cols))
    json_path, md_path = write_report(
        "speculative", args.out, title="Speculative decoding by prompt lookup",
        settings=vars(args) | {"tasks": list(TASKS)}, rows=rows + steps, body=body,
        extra={"plan_speculative_costs": costs},
        notes=["Part 1: decode tok/s is (tokens - 1) / (last token - first token) of each request, medians over the "
               "rounds; the engines alternate in one process. acceptance: accepted draft tokens / draft tokens "
               "verified; each accepted token is one without a step of its own, and every verification step gives "
               "one more token.",
               "Part 2: the native decode step (runtime/cpu_decode) over 1 + k rows of one sequence at 256 cached "
               "positions, every row's logits computed, medians of the rounds; priced: the plan's "
               "Plan.speculative_costs (latency_cpu.speculative_costs). Break-even: the acceptance a per draft token "
               "at which 1 + a + ... + a^k equals the step's cost ratio (the plan drafts only where the sequence's "
               "recent acceptance beats it)."])
    print(md_path.read_text())


if __name__ == "__main__":
    main()
