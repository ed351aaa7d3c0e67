"""Expert prefetch (HOBBIT §3.2) in the runtime, CPU + disk: decode with an LRU expert cache, without
prefetch and with prefetch 1 and 2 MoE layers ahead, at the same cache size and RAM budget.

The model is benchmarks/moe_offload.py's Mixtral-shaped dummy checkpoint (skewed routing, bf16,
3.2x bigger than --cpu-mem); every expert lives on disk and the cache holds as many as the budget
leaves room for (no resident experts, so the cache and the prefetcher do all the work). The page
cache is dropped before each run. Same process, same machine, median of the repeats; results go to
benchmarks/results/moe_prefetch.{json,md}.

    python benchmarks/moe_prefetch.py
    python benchmarks/moe_prefetch.py --quick --out /tmp/x
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from moe_offload import write_checkpoint  # noqa: E402

from tiered import LLM, EngineConfig, SamplingParams  # noqa: E402
from tiered.bench import Column, median, write_report  # noqa: E402
from tiered.hardware.budget import format_bytes, parse_bytes  # noqa: E402
from tiered.memory import sizes  # noqa: E402
from tiered.memory.expert_store import drop_page_cache  # noqa: E402


def run(model: Path, config: EngineConfig, prompt: list[int], new_tokens: int) -> dict:
    drop_page_cache([str(p) for p in model.glob("*.safetensors")])
    llm = LLM(model, config)
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))[0]
        rt = llm.runtime_stats()
    finally:
        llm.close()
    n = len(prompt) + out.stats.generated_tokens
    pf = rt["prefetch"] or {}
    return {"decode_tokens_per_s": out.stats.decode_tokens_per_s, "ttft_s": out.stats.ttft_s,
            "disk_bytes_per_token": (rt["bytes_read"] + (rt["prefetch"] or {}).get("bytes", 0)) / n, "hit_rate": rt["hit_rate"], "misses": rt["misses"],
            "miss_penalty_bytes": rt["miss_penalty_bytes"], "prefetch_issued": pf.get("issued", 0),
            "prefetch_useful": pf.get("useful", 0), "recall": pf.get("accuracy", {}), "tokens": out.token_ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4-layer model, one repeat")
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/tiered/bench"))
    ap.add_argument("--cpu-mem", default=None, help="RAM budget (default: the checkpoint's size / 3.2)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args()
    shape = dict(layers=4, hidden=512, ffn=1792, experts=8, vocab=4096) if args.quick else \
        dict(layers=8, hidden=1024, ffn=3584, experts=8, vocab=8192)
    repeats = args.repeats or (1 if args.quick else 3)
    model = write_checkpoint(Path(args.workdir) / ("mixtral-dummy-quick" if args.quick else "mixtral-dummy"),
                             dtype=torch.bfloat16, **shape)
    ckpt_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    cpu_mem = parse_bytes(args.cpu_mem) if args.cpu_mem else int(ckpt_bytes / 3.2)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, shape["vocab"], (args.prompt_tokens,), generator=g).tolist()
    base = dict(dtype="bfloat16", decode_weights="bf16", accelerator="none", cpu_memory=cpu_mem, plan="off",
                max_context=args.prompt_tokens + args.new_tokens + 16, resident_experts=0, read_ahead=True)
    probe = LLM(model, EngineConfig(**base, expert_cache_slots=0))
    eb, free = probe.experts.store.expert_bytes, cpu_mem - probe.fast_budget.used
    free -= sizes.kv_cache_bytes(probe.config, 1, base["max_context"], "bf16")
    probe.close()
    slots = max(1, int(free // eb))
    configs = {"LRU cache, no prefetch": EngineConfig(**base, expert_cache_slots=slots),
               "LRU cache + prefetch p=1": EngineConfig(**base, expert_cache_slots=slots, prefetch=True, prefetch_lookahead=1),
               "LRU cache + prefetch p=2": EngineConfig(**base, expert_cache_slots=slots, prefetch=True, prefetch_lookahead=2)}
    runs: dict[str, list] = {}
    for rep in range(repeats):
        for name, cfg in configs.items():
            t0 = time.perf_counter()
            r = run(model, cfg, prompt, args.new_tokens)
            runs.setdefault(name, []).append(r)
            print(f"[{rep}] {name}: decode {r['decode_tokens_per_s']:.2f} tok/s, hit {r['hit_rate']:.1%}, "
                  f"prefetch {r['prefetch_issued']} ({r['prefetch_useful']} useful), recall {r['recall']} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    ref = runs["LRU cache, no prefetch"][0]["tokens"]
    rows = []
    for name, rs in runs.items():
        row = {"config": name, "runs": len(rs), "same_tokens": all(r["tokens"] == ref for r in rs)}
        for k in ("decode_tokens_per_s", "ttft_s", "disk_bytes_per_token", "hit_rate", "misses", "miss_penalty_bytes",
                  "prefetch_issued", "prefetch_useful"):
            row[k] = median([r[k] for r in rs])
        row["recall"] = rs[0]["recall"]
        rows.append(row)
    basev = rows[0]["decode_tokens_per_s"]
    for row in rows:
        row["speedup"] = row["decode_tokens_per_s"] / basev if basev else None
    columns = [Column("configuration", "config"), Column("decode tok/s", "decode_tokens_per_s", "{:.2f}"),
               Column("speedup", "speedup", "{:.2f}x"), Column("TTFT s", "ttft_s", "{:.2f}"),
               Column("hit rate", "hit_rate", "{:.1%}"), Column("demand misses", "misses", "{:.0f}"),
               Column("disk bytes/token", lambda r: format_bytes(r["disk_bytes_per_token"])),
               Column("prefetches (useful)", lambda r: f"{r['prefetch_issued']:.0f} ({r['prefetch_useful']:.0f})"),
               Column("recall r=1, 2", lambda r: ", ".join(f"{a:.0%}" for a in r["recall"].values()) or None),
               Column("same tokens", lambda r: "yes" if r["same_tokens"] else "NO")]
    settings = {"shape": shape, "checkpoint_bytes": ckpt_bytes, "cpu_mem_bytes": cpu_mem, "cache_slots": slots,
                "expert_bytes": eb, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                "repeats": repeats}
    notes = [f"Mixtral-shaped dummy {shape}, bf16, {format_bytes(ckpt_bytes)} on disk, `--cpu-mem` {format_bytes(cpu_mem)}; "
             f"{slots} cache slots of {format_bytes(eb)}, no resident experts, read-ahead on, plan off (runtime rules), "
             f"page cache dropped before each run; median of {repeats}.",
             "Prefetches are disk reads on the executor's reader threads (at most one in flight, so a demand read "
             "always finds a free reader); hit rate counts a prefetched expert's use as a hit; disk bytes/token "
             "include the prefetch reads. The machine is shared with other jobs: decode speeds are noisy."]
    stem = "moe_prefetch_quick" if args.quick else "moe_prefetch"
    _, md = write_report(stem, args.out, title="Expert prefetch in the runtime (CPU + disk)", settings=settings,
                         rows=rows, columns=columns, notes=notes, extra={"runs": {k: [{kk: vv for kk, vv in r.items()
                                                                                        if kk != "tokens"} for r in v]
                                                                                  for k, v in runs.items()}})
    print(md.read_text())


if __name__ == "__main__":
    main()
