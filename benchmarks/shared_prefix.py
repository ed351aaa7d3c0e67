"""Prompts sharing a system prompt, admitted together: one prefill of the prefix (scheduler.SharedPrefixes)
against each prompt prefilling it (the same engine, the sharing turned off by its threshold).

Loads the default model (SmolLM2-135M-Instruct) once, builds `--prompts` prompts of one system prompt
(~`--prefix` tokens) and a distinct question each, and times `LLM.generate` of all of them at once for one
token (the batch's prefill: its last TTFT), the two modes alternated for `--rounds` rounds in one process
(this VM's speed moves within minutes). Each mode's 8-token greedy texts must equal each prompt's alone.
Writes shared_prefix.{json,md} to --out; quote the medians.

    python benchmarks/shared_prefix.py --out benchmarks/results/<machine-date>/shared_prefix
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from tiered import LLM, SamplingParams  # noqa: E402
from tiered.bench import Column, write_report  # noqa: E402
from tiered.engine import scheduler  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name a prime number.", "What color is the sky?",
             "Who wrote Hamlet?", "What is 12 times 7?", "Name a sea animal.", "What is a CPU cache?",
             "Give me a word that rhymes with light."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prefix", type=int, default=768, help="system prompt tokens (about)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "results" / "shared_prefix"))
    args = ap.parse_args()

    llm = LLM()
    rule = "Answer briefly and politely, citing facts where you can. "
    system = ""
    while len(llm.tokenizer.encode(system)) < args.prefix:
        system += rule
    prompts = [f"{system}\nQuestion: {QUESTIONS[i % len(QUESTIONS)]} ({i})" for i in range(args.prompts)]
    lengths = [len(llm.tokenizer.encode(p)) for p in prompts]
    check = SamplingParams(max_tokens=8, temperature=0.0)
    alone = [llm.generate([p], check)[0].token_ids for p in prompts]
    modes = {"shared prefix": scheduler.SHARED_PREFIX_TOKENS, "each prefills it": 10 ** 9}
    times: dict[str, list[float]] = {m: [] for m in modes}
    same: dict[str, bool] = {}
    default = scheduler.SHARED_PREFIX_TOKENS
    try:
        for _ in range(args.rounds):
            for mode, threshold in modes.items():
                scheduler.SHARED_PREFIX_TOKENS = threshold
                t = time.perf_counter()
                llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
                times[mode].append(time.perf_counter() - t)
                if mode not in same:
                    same[mode] = [o.token_ids for o in llm.generate(prompts, check)] == alone
    finally:
        scheduler.SHARED_PREFIX_TOKENS = default
    rows = [{"mode": m, "prompts": args.prompts, "prompt_tokens": sum(lengths), "median_s": statistics.median(t),
             "runs_s": [round(x, 4) for x in t], "tokens_as_alone": same[m]} for m, t in times.items()]
    base = rows[1]["median_s"]
    for r in rows:
        r["speedup"] = base / r["median_s"]
    columns = [Column("mode", "mode"), Column("prompts", "prompts"), Column("prompt tokens", "prompt_tokens"),
               Column("median s", "median_s", "{:.3f}"), Column("vs each prefilling", "speedup", "{:.2f}x"),
               Column("tokens as alone", "tokens_as_alone")]
    json_path, md_path = write_report(
        "shared_prefix", args.out, title="Prompts sharing a system prompt, admitted together",
        settings=vars(args) | {"prompt_lengths": lengths}, rows=rows, columns=columns,
        notes=["`LLM.generate` of all prompts for one token (their prefill), the modes alternated in one process; "
               "median of the rounds. tokens as alone: every prompt's 8 greedy tokens equal its generate alone."])
    print(md_path.read_text())


if __name__ == "__main__":
    main()
