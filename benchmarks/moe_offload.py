"""MoE offloading on CPU + disk: on-demand loading vs LRU expert cache vs cache + popularity
placement + read-ahead, and expert formats at the same cache bytes (bf16 high-only, int4, HOBBIT
mixed bf16+int4), on a Mixtral-shaped checkpoint with dummy weights bigger than --cpu-mem.

The checkpoint is written once (safetensors, HF Mixtral names, bf16 by default) with dummy weights
whose router prefers some experts over others (real MoE routing is skewed: Fiddler Fig. 8), so
popularity placement has something to find. Before every run the page cache is dropped for the
checkpoint files (posix_fadvise DONTNEED), so expert reads come from disk. All configurations run
in the same process on the same machine; results go to benchmarks/results/moe_offload.{json,md}.

    python benchmarks/moe_offload.py                 # full run
    python benchmarks/moe_offload.py --quick         # smoke run (smaller model, 1 repeat)
    python benchmarks/moe_offload.py --quick --out /tmp/x    # ... without touching results/
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

from tiered import LLM, EngineConfig, SamplingParams  # noqa: E402
from tiered.bench import Column, ModelShape, median, write_dummy_checkpoint, write_report  # noqa: E402
from tiered.hardware.budget import format_bytes, parse_bytes  # noqa: E402
from tiered.memory.expert_store import drop_page_cache  # noqa: E402
from tiered.runtime.expert_profile import ExpertProfiler  # noqa: E402


def mixtral_like(layers: int, hidden: int, ffn: int, experts: int, vocab: int) -> ModelShape:
    """The Mixtral layout at a reduced width: 128-wide heads, a KV head per 4 query heads (at
    least one), top-2, context 4096 (this benchmark's and planner_validation.py's model)."""
    return ModelShape(layers=layers, hidden=hidden, ffn=ffn, heads=max(hidden // 128, 1),
                      kv_heads=max(hidden // 512, 1), vocab=vocab, experts=experts, top_k=2,
                      max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-5)


def write_checkpoint(path: Path, layers: int, hidden: int, ffn: int, experts: int, vocab: int, dtype: torch.dtype,
                     seed: int = 0) -> Path:
    """A Mixtral-layout checkpoint with skewed routing (tiered.bench.checkpoint), reused when present."""
    return write_dummy_checkpoint(path, mixtral_like(layers, hidden, ffn, experts, vocab), dtype, seed)


def run_config(model: Path, name: str, config: EngineConfig, prompt: list[int], new_tokens: int) -> dict:
    files = [str(p) for p in model.glob("*.safetensors")]
    drop_page_cache(files)
    t0 = time.perf_counter()
    llm = LLM(model, config)
    load_s = time.perf_counter() - t0
    rt0 = llm.runtime_stats()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))[0]
    rt = llm.runtime_stats()
    llm.close()
    n = out.stats.generated_tokens
    return {"config": name, "load_s": load_s, "ttft_s": out.stats.ttft_s, "decode_tokens_per_s": out.stats.decode_tokens_per_s,
            "itl_s": out.stats.itl_s, "generated": n, "disk_bytes_per_token": (rt["bytes_read"] - rt0["bytes_read"] + (rt["prefetch"] or {}).get("bytes", 0)
                                     - (rt0["prefetch"] or {}).get("bytes", 0)) / (len(prompt) + n),
            "hit_rate": rt["hit_rate"], "placement": rt["placement"], "paths": rt["paths"],
            "expert_format": rt["expert_format"], "precision_loads": rt["precision"],
            "peak_ram_budget_bytes": rt["peak_fast_bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model, one repeat")
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/tiered/bench"))
    ap.add_argument("--cpu-mem", default=None, help="RAM budget (default: the checkpoint's size / 3.2)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "results"), help="results directory")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = dict(layers=4, hidden=512, ffn=1792, experts=8, vocab=4096) if args.quick else \
        dict(layers=8, hidden=1024, ffn=3584, experts=8, vocab=8192)
    repeats = args.repeats or (1 if args.quick else 3)
    dtype = torch.bfloat16
    model = write_checkpoint(Path(args.workdir) / ("mixtral-dummy-quick" if args.quick else "mixtral-dummy"), dtype=dtype, **shape)
    ckpt_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    cpu_mem = parse_bytes(args.cpu_mem) if args.cpu_mem else int(ckpt_bytes / 3.2)
    expert_bytes = 3 * shape["hidden"] * shape["ffn"] * 2
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, shape["vocab"], (args.prompt_tokens,), generator=g).tolist()

    # calibration profile for popularity placement: other prompts than the measured one
    base = dict(dtype="bfloat16", decode_weights="bf16", accelerator="none", cpu_memory=cpu_mem,
                max_context=args.prompt_tokens + args.new_tokens + 16)
    llm = LLM(model, EngineConfig(**base, expert_cache_slots=0, resident_experts=0))
    prof = ExpertProfiler.attach(llm.model, llm.config)
    calib = [torch.randint(0, shape["vocab"], (48,), generator=g).tolist() for _ in range(4)]
    llm.generate(calib, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    profile_path = Path(args.workdir) / "expert_profile.json"
    prof.save(profile_path)
    kv = 2 * shape["layers"] * max(shape["hidden"] // 512, 1) * 128 * base["max_context"] * 2
    free = cpu_mem - llm.fast_budget.used - kv  # bytes left for experts after weights, staging and KV
    model_cfg = llm.config
    llm.close()
    del llm
    lru_slots = max(1, int(free // expert_bytes))
    from tiered.memory.sizes import expert_bytes as format_bytes_of
    int4_slots = lru_slots * expert_bytes // format_bytes_of(model_cfg, "int4")  # the same cache bytes
    offload = str(Path(args.workdir) / "offload")
    configs = {
        "on-demand (no cache)": EngineConfig(**base, expert_cache_slots=0, resident_experts=0, read_ahead=False),
        "LRU cache": EngineConfig(**base, expert_cache_slots=lru_slots, resident_experts=0, read_ahead=False),
        "cache + popularity + read-ahead": EngineConfig(**base, expert_cache_slots=2,
                                                        expert_profile=str(profile_path), read_ahead=True),
        "int4 experts (LRU, same cache bytes)": EngineConfig(**base, expert_cache_slots=int4_slots, resident_experts=0,
                                                             read_ahead=False, expert_weights="int4", offload_dir=offload),
        "mixed bf16+int4 T1=0.6 T2=0.9 (LRU, same bytes)": EngineConfig(
            **base, expert_cache_slots=lru_slots, resident_experts=0, read_ahead=False, expert_low_weights="int4",
            mixed_thresholds=(0.6, 0.9), offload_dir=offload),
        "mixed + prefetch p=1 (LRU, same bytes)": EngineConfig(
            **base, expert_cache_slots=lru_slots, resident_experts=0, read_ahead=False, expert_low_weights="int4",
            mixed_thresholds=(0.6, 0.9), offload_dir=offload, prefetch=True, prefetch_lookahead=1),
    }
    rows = {}
    for rep in range(repeats):
        for name, cfg in configs.items():
            r = run_config(model, name, cfg, prompt, args.new_tokens)
            rows.setdefault(name, []).append(r)
            print(f"[{rep}] {name}: decode {r['decode_tokens_per_s']:.2f} tok/s, TTFT {r['ttft_s']:.2f} s, "
                  f"hit {r['hit_rate']:.1%}, disk {format_bytes(r['disk_bytes_per_token'])}/token", flush=True)
    # one more run of the last configuration (mixed + prefetch) with the executor's trace on: the
    # timeline shows disk reads (reader threads, prefetches among them) overlapping expert compute
    import dataclasses
    from tiered.runtime.trace import draw_gantt, overlap_seconds
    full = dataclasses.replace(list(configs.values())[-1], trace=True)
    drop_page_cache([str(p) for p in model.glob("*.safetensors")])
    llm = LLM(model, full)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    trace_json = out / ("moe_offload_trace_quick.json" if args.quick else "moe_offload_trace.json")
    llm.write_trace(trace_json)
    events = llm.experts.executor.events
    draw_gantt(events, trace_json.with_suffix(".png"), title="moe_offload: mixed bf16+int4 + prefetch p=1 (8 tokens)")
    disk_streams = sorted({e.stream for e in events if e.stream.startswith("disk")})
    trace_overlap = sum(overlap_seconds(events, d, "cpu") for d in disk_streams)
    llm.close()
    summary = []
    for name, rs in rows.items():
        med = {k: median([r[k] for r in rs]) for k in ("decode_tokens_per_s", "ttft_s", "itl_s",
                                                        "disk_bytes_per_token", "hit_rate", "load_s")}
        summary.append({"config": name, **med, "placement": rs[0]["placement"], "paths": rs[0]["paths"],
                        "expert_format": rs[0]["expert_format"], "precision_loads": rs[0]["precision_loads"], "runs": len(rs)})
    basev = summary[0]["decode_tokens_per_s"]
    lru = next(s for s in summary if s["config"] == "LRU cache")
    for s in summary:
        s["speedup_vs_on_demand"] = s["decode_tokens_per_s"] / basev if basev else float("nan")
        s["speedup_vs_bf16_lru"] = s["decode_tokens_per_s"] / lru["decode_tokens_per_s"] if lru["decode_tokens_per_s"] else float("nan")
    settings = {"shape": shape, "dtype": "bfloat16", "checkpoint_bytes": ckpt_bytes, "expert_bytes": expert_bytes,
                "cpu_mem_bytes": cpu_mem, "checkpoint_over_cpu_mem": round(ckpt_bytes / cpu_mem, 3),
                "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "repeats": repeats}
    columns = [Column("configuration", "config"), Column("decode tok/s", "decode_tokens_per_s", "{:.2f}"),
               Column("TTFT s", "ttft_s", "{:.2f}"), Column("disk bytes/token", lambda r: format_bytes(r["disk_bytes_per_token"])),
               Column("hit rate", "hit_rate", "{:.1%}"), Column("speedup", "speedup_vs_on_demand", "{:.2f}x"),
               Column("vs bf16 LRU", "speedup_vs_bf16_lru", "{:.2f}x"), Column("experts", "expert_format"),
               Column("misses high/low/skip/low-hit", lambda r: "/".join(str(r["precision_loads"].get(k, 0))
                                                                  for k in ("high", "low", "skip", "low hit"))
                      if r["precision_loads"] else "-"),
               Column("placement", "placement")]
    notes = [f"Model: Mixtral-shaped dummy weights {shape}, bf16, {format_bytes(ckpt_bytes)} on disk; `--cpu-mem` "
             f"{format_bytes(cpu_mem)} ({ckpt_bytes / cpu_mem:.1f}x smaller). Prompt {args.prompt_tokens} tokens, "
             f"{args.new_tokens} new tokens, page cache dropped before each run, median of {repeats}.",
             f"Expert formats at the same cache bytes as `LRU cache` ({lru_slots} bf16 slots): int4 gets "
             f"{int4_slots} slots; mixed keeps {lru_slots - max(1, lru_slots // 4) if lru_slots >= 2 else lru_slots} bf16 slots "
             "and turns the rest into int4 slots (HOBBIT: misses load bf16, int4 or nothing by the router's "
             "unimportance score, Eq. 2). int4 and mixed are lossy; the experts are re-quantized from bf16 at load. "
             "Prefetch (HOBBIT §3.2) predicts the next MoE layer's experts from this layer's gate input and reads "
             "the predicted misses on a disk reader while this layer computes, each at the precision its predicted "
             "router weights ask for; its reads are counted in disk bytes/token.",
             f"Trace of the full configuration: `{trace_json.name}` (Chrome trace events) and "
             f"`{trace_json.with_suffix('.png').name}` (mixed + prefetch); disk reads overlapped expert compute for "
             f"{trace_overlap * 1e3:.0f} ms over 8 generated tokens."]
    stem = "moe_offload_quick" if args.quick else "moe_offload"
    _, md = write_report(stem, out, title="MoE offload benchmark", settings=settings, rows=summary, columns=columns,
                         notes=notes, extra={"runs": rows, "trace": {"file": trace_json.name,
                                                                     "disk_cpu_overlap_s": trace_overlap}})
    print(md.read_text())


if __name__ == "__main__":
    main()
