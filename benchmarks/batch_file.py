"""A batch file of varied lengths through `tiered batch`: the throughput the plan prices for the file's own requests
(EngineConfig.requests: their run replayed step by step, planner/batch_sim) and for one block of their mean lengths
(the FlexGen block model, planner/throughput.block_throughput, which `tiered batch` priced before), against what
`tiered batch` measures, at the batch the plan picks and at batches capped by --max-batch.

The file: `--requests` completions of token-id prompts (ids 100..vocab-1, seeded) whose lengths are drawn
log-normally (a median of --median-prompt tokens, clipped to 15..500) and whose max_tokens likewise (a median of
--median-gen, clipped to 16..128), each with vLLM's ignore_eos so that every request generates its max_tokens, as
the plan prices it. With --shared-prefix N every prompt starts with the same N tokens (a system prompt), which the
server's prefix reuse prefills once a slot (or once for the prompts admitted together) and the replay reuses too
(EngineConfig.request_prefixes); the table then also gives the replay's price of every prompt prefilled whole (what
it priced before it knew the prefixes). Each configuration runs `tiered batch` in its own process (`--rounds` times, alternated); the
table gives the median of the generated tokens a second its summary line reports (the batch's wall time, the model's
load left out), the batch it ran, and both prices.

    python benchmarks/batch_file.py --out benchmarks/results/<machine-date>/batch_file
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from tiered.bench import Column, markdown_table, write_report  # noqa: E402

SUMMARY = re.compile(r"\| (\d+) prompt tokens, (\d+) generated in ([\d.]+) s \| ([\d.]+) generated tok/s"
                     r"(?: \(plan: ([\d.]+)\))?")
SLOTS = re.compile(r"\), (\d+) at a time x")


def write_file(path: Path, n: int, median_prompt: int, median_gen: int, vocab: int, model: str, seed: int = 0,
               shared_prefix: int = 0):
    """`n` completion requests of log-normal lengths (sigma 0.9 prompts, 0.7 max_tokens), each prompt after the same
    `shared_prefix` tokens, to `path`; returns their (prompt tokens, max_tokens)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(100, vocab) for _ in range(shared_prefix)]
    lengths = []
    with path.open("w") as f:
        for i in range(n):
            p = min(500, max(15, round(median_prompt * math.exp(rng.gauss(0, 0.9)))))
            g = min(128, max(16, round(median_gen * math.exp(rng.gauss(0, 0.7)))))
            body = {"model": model, "prompt": prefix + [rng.randrange(100, vocab) for _ in range(p)], "max_tokens": g,
                    "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
            lengths.append((shared_prefix + p, g))
    return lengths


def run_batch(path: Path, model: str, cap: int) -> dict:
    """One `tiered batch` of `path` with --max-batch `cap` (0: the plan's): its summary line's figures."""
    cmd = [sys.executable, "-m", "tiered.cli", "batch", str(path), "--model", model, "--output",
           str(path.with_suffix(f".{cap}.out.jsonl"))] + (["--max-batch", str(cap)] if cap else [])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    m, s = SUMMARY.search(res.stderr), SLOTS.search(res.stderr)
    if res.returncode or m is None or s is None:
        raise RuntimeError(f"tiered batch failed ({res.returncode}): {res.stderr[-2000:]}")
    return {"slots": int(s.group(1)), "generated": int(m.group(2)), "seconds": float(m.group(3)),
            "tokens_per_s": float(m.group(4)), "priced": float(m.group(5)) if m.group(5) else None}


def plan_price(model: str, lengths: list[tuple[int, int]], slots: int, whole: bool = False) -> float | None:
    """The throughput plan's price of `slots` sequences, made in this process without the file's prompts: the block
    model's of the requests' mean lengths (what `tiered batch` priced before the replay), or with `whole` the replay
    of the requests with every prompt prefilled whole (no request_prefixes)."""
    from throughput import priced_by_batch

    from tiered import LLM, EngineConfig

    n = len(lengths)
    means = (round(sum(p for p, _ in lengths) / n), round(sum(g for _, g in lengths) / n))
    llm = LLM(model, EngineConfig(goal="throughput", max_batch=slots, max_context=max(p + g for p, g in lengths),
                                  **({"requests": tuple(lengths)} if whole else {"workload": means})))
    try:
        return priced_by_batch(llm.plan).get(slots)
    finally:
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48, help="requests in the file")
    ap.add_argument("--median-prompt", type=int, default=115, help="the prompts' median length [tokens]")
    ap.add_argument("--median-gen", type=int, default=32, help="the max_tokens' median")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="tokens every prompt starts with (a system prompt), before its drawn length")
    ap.add_argument("--caps", type=lambda t: [int(x) for x in t.split(",")], default=[4, 8, 16, 32],
                    help="--max-batch values to run beside the plan's own choice (comma-separated)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each configuration, alternated")
    ap.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct's GGUF)")
    ap.add_argument("--out", default=str(ROOT / "results" / "batch_file"))
    args = ap.parse_args()

    from tiered.checkpoint import default_model_path, open_checkpoint

    model = str(args.model or default_model_path())
    ck = open_checkpoint(model)
    name = Path(model).stem
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "requests.jsonl"
        lengths = write_file(path, args.requests, args.median_prompt, args.median_gen, ck.config.vocab_size, name,
                             shared_prefix=args.shared_prefix)
        caps = [0] + [c for c in args.caps if c <= args.requests]
        runs: dict[int, list[dict]] = {c: [] for c in caps}
        for _ in range(args.rounds):
            for c in caps:
                runs[c].append(run_batch(path, model, c))
    rows = []
    for c in caps:
        got = runs[c]
        slots = got[0]["slots"]
        rows.append({"engine": "tiered batch, the plan's batch" if not c else f"tiered batch --max-batch {c}",
                     "batch": slots, "generated": got[0]["generated"],
                     "seconds": statistics.median(r["seconds"] for r in got),
                     "tokens_per_s": statistics.median(r["tokens_per_s"] for r in got),
                     "runs_tokens_per_s": [r["tokens_per_s"] for r in got],
                     "priced_tokens_per_s": got[0]["priced"], "block_priced_tokens_per_s": plan_price(model, lengths, slots),
                     "whole_priced_tokens_per_s": plan_price(model, lengths, slots, whole=True) if args.shared_prefix
                     else None})
    for r in rows:
        for error, price in (("priced_error", r["priced_tokens_per_s"]), ("block_error", r["block_priced_tokens_per_s"]),
                             ("whole_error", r["whole_priced_tokens_per_s"])):
            r[error] = price / r["tokens_per_s"] - 1 if price else None
    prompts, gens = [p for p, _ in lengths], [g for _, g in lengths]
    cols = [Column("engine", "engine"), Column("batch", "batch"), Column("seconds", "seconds", "{:.2f}"),
            Column("generated tok/s", "tokens_per_s", "{:.1f}"),
            Column("priced (replay)", "priced_tokens_per_s", "{:.1f}"), Column("off", "priced_error", "{:+.0%}"),
            Column("priced (block model)", "block_priced_tokens_per_s", "{:.1f}"),
            Column("off", "block_error", "{:+.0%}")]
    if args.shared_prefix:
        cols += [Column("priced (replay, prompts whole)", "whole_priced_tokens_per_s", "{:.1f}"),
                 Column("off", "whole_error", "{:+.0%}")]
    body = (f"## {args.requests} completions: prompts {min(prompts)}-{max(prompts)} tokens"
            f"{f' (the first {args.shared_prefix} of every one the same)' if args.shared_prefix else ''} (median "
            f"{statistics.median(prompts):.0f}, mean {statistics.fmean(prompts):.0f}), max_tokens {min(gens)}-"
            f"{max(gens)} (median {statistics.median(gens):.0f}, mean {statistics.fmean(gens):.0f}), greedy, "
            f"ignore_eos\n\n" + markdown_table(rows, cols))
    json_path, md_path = write_report(
        "batch_file", args.out, title=f"A batch file of varied lengths ({name})", settings=vars(args), rows=rows,
        body=body, extra={"requests": lengths},
        notes=["generated tok/s: `tiered batch`'s summary (completion tokens over the batch's wall time, the "
               "model's load left out), the median of the rounds; each run its own process, the configurations "
               "alternated.",
               "priced (replay): the plan's price of the file's requests at that batch (planner/batch_sim), what "
               "`tiered batch` prints as (plan: X). priced (block model): the plan made for one block of the "
               "requests' mean lengths at that batch (planner/throughput.block_throughput)."])
    print(md_path.read_text())


if __name__ == "__main__":
    main()
