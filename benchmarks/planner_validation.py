"""Planner validation on this machine (CPU + disk tiers): predicted vs measured decode times.

For several plans — a Mixtral-shaped MoE (dummy weights, bf16) with all experts in RAM, with
popular experts resident + an LRU cache + read-ahead, with an LRU cache only, fully on demand from
disk; and SmolLM2-135M dense in bf16 and fp32 — the planner's CPU + disk model
(tiered/planner/cpu_predict.py, priced by this machine's HardwareProfile) predicts each MoE layer's
time and the whole decode step; the runtime measures them (executor trace spans per MoE layer,
inter-token latency end to end, from a second run without the trace's instrumentation). Expert hit rates come from replaying the measured run's routing
trace through the cache simulator, so the comparison tests the timing model, not a routing
forecast. Each row is priced with the profile scaled to the memory's and the cores' speed just before it runs,
as the engine plans with this machine's profile (planner/auto.speed_now; TIERED_BANDWIDTH_CHECK=0
prices every row with the profile as measured), and with its disk reads timed on the checkpoint's
own expert reads, as the engine prices a plan that reads experts from disk (hardware/disk_reads). Writes benchmarks/results/planner_validation.{json,md}.

    python benchmarks/planner_validation.py [--profile F] [--quick] [--out DIR]
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
from tiered.checkpoint import open_checkpoint  # noqa: E402
from tiered.hardware.disk_reads import fit_expert_reads  # noqa: E402  (as the engine prices disk reads)
from tiered.hardware.profile import HardwareProfile  # noqa: E402
from tiered.hardware.profiler import DISK_READERS  # noqa: E402
from tiered.planner.auto import speed_now  # noqa: E402  (as the engine plans)
from tiered.memory.expert_store import drop_page_cache  # noqa: E402
from tiered.planner.cpu_predict import predict_decode, predict_prefill, simulate_hits  # noqa: E402
from tiered.runtime.expert_profile import ExpertProfiler  # noqa: E402


def measure(model: Path, config: EngineConfig, prompt: list[int], new_tokens: int, files: list[str]) -> dict:
    """Run one plan twice from a cold page cache, the same greedy tokens each time: once as the engine
    runs it (the end-to-end ITL), once instrumented (the trace's per-layer decode spans, the routing
    trace and the resident set). The instrumented run is not the production path: tracing swaps the
    lean CPU decode step for the modules (runtime/install) and the expert profiler hooks every
    router, together ~2.5 ms per token on the quick shape's 4 layers (4.3 vs 6.8 ms measured)."""
    from dataclasses import replace

    drop_page_cache(files)
    llm = LLM(model, replace(config, trace=False))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))[0]
    res = {"itl_s": out.stats.itl_s, "decode_tokens_per_s": out.stats.decode_tokens_per_s}
    llm.close()
    drop_page_cache(files)
    llm = LLM(model, config)
    prof = ExpertProfiler.attach(llm.model, llm.config, keep_trace=True) if llm.config.is_moe else None
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))[0]
    res["instrumented_itl_s"] = out.stats.itl_s
    if llm.experts is not None:
        events = llm.experts.executor.events
        L = len([e for e in events if e.stream == "main" and e.name.startswith("moe layer")])
        # each MoE block's whole span (router and block code included, as predict_decode prices the
        # layer's MoE part), from the trace's "ffn L<i>" spans; the first of each layer is the prefill's
        spans: dict[int, list[float]] = {}
        for e in events:
            if e.stream == "main" and e.name.startswith("ffn L"):
                spans.setdefault(e.layer, []).append(e.end - e.start)
        res["layer_s"] = {l: median(v[1:]) for l, v in spans.items() if len(v) > 1}
        res["trace"] = prof.trace
        res["popularity"] = prof.tokens.copy()  # tokens routed per expert, as `tiered profile-experts` records
        res["resident"] = set(llm.experts.store.resident)
        res["slots"] = llm.experts.cache.num_slots
        res["read_ahead"] = config.read_ahead
        res["hit_rate"] = llm.experts.fast_hit_rate
        res["spans"] = L
    res["config"] = llm.config
    llm.close()
    return res


# runs on lent GPUs, each priced from its machine's profile: the first H200 run, the third (cc9c1b1), the H100's,
GPU_REFERENCES = {"h200-2026-11-22": ROOT / "reference" / "h200-2026-11-22" / "measured.json",
                  "h200-2026-11-26b": ROOT / "reference" / "h200-2026-11-26b" / "measured.json",
                  "h100-2026-11-26": ROOT / "reference" / "h100-2026-11-26" / "measured.json",
                  "h100-2026-11-26-uniform": ROOT / "reference" / "h100-2026-11-26-uniform" / "measured.json",
                  "h100-2026-11-28-uniform": ROOT / "reference" / "h100-2026-11-28-uniform" / "measured.json"}


def gpu_table(path: Path) -> tuple[dict, list[str]]:
    """One GPU run's rows (tiered measured on a lent GPU machine): predicted from that machine's profile
    through the real make_plan (planner/reference.py) vs the measured values, which are data cited in
    the reference file (they cannot be re-measured here).

    Returns:
        (the table for the results JSON, its markdown lines).
    """
    from tiered.planner.reference import METRICS, compare, load_reference

    ref, hw = load_reference(path)
    rows = compare(ref, hw)
    errs = [r["error"][m] for r in rows for m in METRICS if r["error"][m] is not None]
    table = {"source": ref["source"], "machine": ref["machine"], "profile": ref["profile_source"],
             "method": ref["method"], "context": ref["context"], "rows": rows,
             "median_abs_error": median(errs), "within_25_percent": sum(e <= 0.25 for e in errs),
             "comparisons": len(errs)}

    def err(r, m):
        return f"{r['error'][m]:.0%}" if r["error"][m] is not None else "not comparable"
    lines = ["", f"## GPU rows ({path.parent.name}): predicted from `{ref['profile']}` vs measured", "",
             f"Measured: {ref['source']}. Machine: {ref['machine']}. Method: {ref['method']}. {ref['context']}",
             "", "| row | measured tok/s | predicted tok/s | error | measured TTFT s | predicted TTFT s | error |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        (md, mt), (pd, pt) = ((x["decode_tokens_per_s"], x["ttft_s"]) for x in (r["measured"], r["predicted"]))
        lines.append(f"| {r['name']} ({r['config']}) | {md:.1f} | {pd:.1f} | {err(r, 'decode_tokens_per_s')} | "
                     f"{mt:.3f} | {pt:.3f} | {err(r, 'ttft_s')} |")
    lines += [""] + [f"- {r['name']}: {r['note']}" for r in rows if r["note"]]
    lines += ["", f"{table['within_25_percent']} of {len(errs)} comparable predictions within 25%; median absolute "
              f"error {table['median_abs_error']:.0%}."]
    return table, lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", help="HardwareProfile JSON (default: profile this machine now, full run)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/tiered/bench"))
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--out", default=str(ROOT / "results"), help="results directory (also gets this machine's profile)")
    ap.add_argument("--gpu-only", action="store_true", help="print the GPU runs' tables only (no measurement)")
    ap.add_argument("--dense-only", action="store_true", help="only the SmolLM2 rows (no MoE checkpoint)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads for profiling and every run (default: torch's); on a shared machine "
                         "1 keeps other processes from stalling OpenMP teams")
    args = ap.parse_args()
    if args.gpu_only:
        for path in GPU_REFERENCES.values():
            print("\n".join(gpu_table(path)[1]))
        return
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:
        hw = HardwareProfile.load(args.profile)
    else:
        from tiered.hardware.profiler import profile_machine
        hw = profile_machine(quick=args.quick, threads=args.threads,
                             progress=lambda m: print("  profile:", m, flush=True))
        hw.save(out_dir / "hardware_profile_this_machine.json")
    shape = dict(layers=4, hidden=512, ffn=1792, experts=8, vocab=4096) if args.quick else \
        dict(layers=8, hidden=1024, ffn=3584, experts=8, vocab=8192)
    rows, errors, short, disk_prompt = [], [], [], None
    if not args.dense_only:
        moe_rows(args, hw, shape, rows, errors)
        short, uniform_model = prompt_rows(args, hw, shape)
        disk_prompt = disk_prompt_row(uniform_model)
    dense_rows(args, hw, rows, errors)
    batch_files = [r for r in (batch_file_row(), batch_file_row(shared_prefix=200)) if r is not None]
    med = median(errors)
    settings = {"profile": hw.name, "profile_source": hw.source, "model_shape": None if args.dense_only else shape,
                "new_tokens": args.new_tokens, "threads": torch.get_num_threads(), "target": 0.20}
    columns = [Column("plan", "plan"), Column("predicted ms/token", lambda r: r["predicted_step_s"] * 1e3, "{:.1f}"),
               Column("measured ms/token", lambda r: r["measured_itl_s"] * 1e3, "{:.1f}"),
               Column("error", "e2e_error", "{:.0%}"),
               Column("traced run ms/token", lambda r: r.get("instrumented_itl_s") and r["instrumented_itl_s"] * 1e3, "{:.1f}"),
               Column("per-layer median error", "layer_median_error", "{:.0%}"),
               Column("fast hit rate", "hit_rate", "{:.0%}"),
               Column("predicted TTFT s", "predicted_ttft_s", "{:.3f}"),
               Column("measured TTFT s", "measured_ttft_s", "{:.3f}"),
               Column("TTFT error", "ttft_error", "{:.0%}"),
               Column("speed at planning (memory, cores; disk reads)", "speed")]
    notes = [f"Profile `{hw.name}` ({hw.source})."] + [r.pop("note") for r in rows if "note" in r] + \
        [f"Median absolute error over all per-layer and end-to-end comparisons: **{med:.0%}** (target < 20%)."]
    ttft_errors = [r["ttft_error"] for r in rows if r.get("ttft_error") is not None]
    if ttft_errors:
        notes.append(f"TTFT of a {TTFT_TOKENS}-token prompt (SmolLM2 rows and the all-in-RAM MoE row, median of 3; the "
                     f"MoE one priced with the expert profile its decode row recorded, as `--expert-profile` gives a plan): "
                     f"median absolute error "
                     f"**{median(ttft_errors):.0%}**, largest {max(ttft_errors):.0%}."
                     + "".join(f" The {r['plan']} row's TTFT was priced at its own speed check: {r['ttft_speed']}."
                               for r in rows if r.get("ttft_speed") and r["ttft_speed"] != r.get("speed")))
    for r in rows:
        lt = r.get("long_ttft")
        if lt and lt["predicted_s"] is not None:
            notes.append(f"TTFT of the {lt['tokens']}-token prompt ({r['plan']}; prefilled in chunks of {lt['chunk']} "
                         f"tokens, median of 3): {lt['predicted_s']:.3f} s priced (LLM.predicted_ttft_at) against "
                         f"{lt['measured_s']:.3f} (**{lt['error']:.0%}**).")
    if short:
        notes.append("TTFT of short prompts on the MoE shape routed uniformly, every expert in RAM (median of "
                     f"{SHORT_REPEATS} rounds, the lengths in turn): "
                     + ", ".join(f"{r['tokens']} tokens {r['predicted_ttft_s'] * 1e3:.1f} ms priced against "
                                 f"{r['measured_ttft_s'] * 1e3:.1f} ({r['error']:.0%}; {r['speed']})" for r in short)
                     + f"; largest error **{max(r['error'] for r in short):.0%}**.")
    if disk_prompt is not None:
        r = disk_prompt
        notes.append(f"TTFT of a {r['tokens']}-token prompt on that shape with most experts on disk (the engine's "
                     f"auto plan at --cpu-mem = the checkpoint / 3.2, page cache dropped, median of 3): "
                     f"{r['predicted_ttft_s']:.3f} s priced against {r['measured_ttft_s']:.3f} (**{r['error']:.0%}**; "
                     f"speed at planning: {r['speed']}).")
    for r in batch_files:
        shared = f", every prompt after the same {r['shared_prefix']} tokens" if r["shared_prefix"] else ""
        notes.append(f"`tiered batch` of {r['requests']} SmolLM2 completions of varied lengths (benchmarks/batch_file.py's "
                     f"file: prompts {r['prompts']}{shared}, max_tokens {r['max_tokens']}, ignore_eos), the plan's batch "
                     f"{r['batch']}, median of {r['rounds']}: {r['predicted_tokens_per_s']:.1f} generated tok/s priced "
                     f"(the file's requests replayed, planner/batch_sim) against {r['measured_tokens_per_s']:.1f} "
                     f"(**{r['error']:.0%}**).")
    gpu = {}
    for name, path in GPU_REFERENCES.items():
        gpu[name], lines = gpu_table(path)
        notes.append("\n".join(lines))  # one block: its table's rows must stay adjacent
    stem = "planner_validation_quick" if args.quick else "planner_validation_dense" if args.dense_only else "planner_validation"
    _, md = write_report(stem, out_dir, title="Planner validation", settings=settings, rows=rows, columns=columns,
                         notes=notes, extra={"median_abs_error": med, "gpu": gpu, "short_prompts": short,
                                "disk_prompt": disk_prompt, "batch_files": batch_files})
    print(md.read_text())


def moe_rows(args, hw, shape, rows: list, errors: list) -> None:
    """The Mixtral-shaped dummy under four explicit placements: predicted vs measured per layer and end to end."""
    model = write_checkpoint(Path(args.workdir) / ("mixtral-dummy-quick" if args.quick else "mixtral-dummy"),
                             dtype=torch.bfloat16, **shape)
    files = [str(p) for p in model.glob("*.safetensors")]
    ckpt_bytes = sum(os.path.getsize(f) for f in files)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, shape["vocab"], (32,), generator=g).tolist()
    cpu_mem = int(ckpt_bytes / 3.2)
    from dataclasses import replace
    # the disk reads as the engine prices them when its plan reads experts from disk (hardware/disk_reads):
    # timed on the checkpoint's own expert reads, one reader and the runtime's two, right before each row that
    # reads experts from disk, as the memory's and the cores' speed are read before each row: this VM's disk read
    # a checkpoint's experts at 0.36 GB/s at one run's start and 0.61-0.78 in five fits minutes later
    # (2026-12-02), and that run's three disk rows, priced with the first, came out 20-86% slow
    ck = open_checkpoint(model)
    hw_disk_beta = hw.models["disk/read_cold"].beta

    def disk_fit(hw):
        reads = fit_expert_reads(ck, ck.config, torch.bfloat16)
        par_reads = fit_expert_reads(ck, ck.config, torch.bfloat16, readers=DISK_READERS)
        print(f"disk/read_cold: profile {1 / hw_disk_beta / 1e9:.2f} GB/s, this checkpoint's expert reads "
              f"{1 / max(reads.beta, 1e-15) / 1e9:.2f} GB/s (R^2 {reads.r2:.2f}), {DISK_READERS} readers "
              f"{1 / max(par_reads.beta, 1e-15) / 1e9:.2f} GB/s (R^2 {par_reads.r2:.2f})", flush=True)
        return replace(hw, models={**hw.models, "disk/read_cold": reads, "disk/read_cold_parallel": par_reads})

    # explicit placements (plan="off"): this validates the timing model, not the planner's choices
    base = dict(dtype="bfloat16", decode_weights="bf16", accelerator="none", trace=True, max_context=256, plan="off")
    plans = {
        "MoE, all experts in RAM": EngineConfig(**base),
        "MoE, popular resident + cache + read-ahead": EngineConfig(**base, cpu_memory=cpu_mem, expert_cache_slots=4),
        # (--quick's 4 x 512 shape: 6 slots of 5.5 MB do not fit beside its non-expert weights in a third of it)
        "MoE, LRU cache only": EngineConfig(**base, cpu_memory=cpu_mem, expert_cache_slots=4 if args.quick else 6,
                                            resident_experts=0, read_ahead=False),
        "MoE, on demand from disk": EngineConfig(**base, cpu_memory=cpu_mem, expert_cache_slots=0, resident_experts=0,
                                                 read_ahead=False),
    }
    popularity = None
    for name, cfg in plans.items():
        if cfg.cpu_memory is not None:  # a row that reads experts from disk: the disk's speed of this moment too
            hw = disk_fit(hw)
        now = speed_now(hw)  # as the engine plans: the memory's and the cores' speed of this moment
        m = measure(model, cfg, prompt, args.new_tokens, files)
        if popularity is None:  # the first row's expert profile prices the TTFT row below
            popularity = m["popularity"]
        mc = m["config"]
        hits = simulate_hits(m["trace"], m["resident"], m["slots"])
        layers, step = predict_decode(mc, now, "bf16", context=len(prompt) + args.new_tokens // 2, hits=hits,
                                      read_ahead=m["read_ahead"])
        per_layer = []
        for l, meas in sorted(m["layer_s"].items()):
            pred = layers[l][1]
            per_layer.append({"layer": l, "predicted_s": pred, "measured_s": meas, "error": abs(pred - meas) / meas})
            errors.append(abs(pred - meas) / meas)
        e2e_err = abs(step - m["itl_s"]) / m["itl_s"]
        errors.append(e2e_err)
        rows.append({"plan": name, "predicted_step_s": step, "measured_itl_s": m["itl_s"], "e2e_error": e2e_err,
                     "layer_median_error": median([p["error"] for p in per_layer]), "layers": per_layer,
                     "hit_rate": m["hit_rate"], "instrumented_itl_s": m["instrumented_itl_s"],
                     "speed": speed_found(now) + (f"; disk {disk_rates(now)}" if cfg.cpu_memory is not None else "")})
        print(f"{name}: predicted {step * 1e3:.1f} ms/token, measured {m['itl_s'] * 1e3:.1f} ms "
              f"({e2e_err:.0%}); per-layer median error {rows[-1]['layer_median_error']:.0%}", flush=True)
    # the time to first token of the all-in-RAM placement (no disk in it) against cpu_predict.predict_prefill: an
    # engine with room for the TTFT_TOKENS-token prompt (the decode rows keep max_context 256)
    now = speed_now(hw)
    llm = LLM(str(model), EngineConfig(**dict(base, trace=False, max_context=2 * TTFT_TOKENS)))
    try:
        long_prompt = [(i * 7) % (shape["vocab"] - 10) + 10 for i in range(TTFT_TOKENS)]
        first_token_s(llm, long_prompt)  # warm-up
        ttft = median([first_token_s(llm, long_prompt) for _ in range(3)])
        # the checkpoint routes skewed (nearly every token to the same 2 experts a layer): priced with the expert
        # profile of the first row's prompt and decode, as a plan given `--expert-profile` prices it
        # (every expert in RAM: with the native step its layers run the experts and weighted sum in one call)
        p_ttft = predict_prefill(llm.config, now, "bf16", TTFT_TOKENS, act_dtype="bf16", popularity=popularity,
                                 native_moe=llm.plan.native_decode)
    finally:
        llm.close()
    # the speed check before this TTFT, apart from the decode row's (its price moves with it)
    rows[0].update(predicted_ttft_s=p_ttft, measured_ttft_s=ttft, ttft_error=abs(p_ttft - ttft) / ttft,
                   ttft_speed=speed_found(now))
    print(f"{rows[0]['plan']}: TTFT {TTFT_TOKENS} tokens predicted {p_ttft:.3f} s, measured {ttft:.3f} s "
          f"({rows[0]['ttft_error']:.0%})", flush=True)
    rows[0]["note"] = (f"MoE: Mixtral-shaped dummy {shape}, bf16; `--cpu-mem` {cpu_mem / 2**20:.0f} MiB where limited. "
                       f"Decode at batch 1, page cache dropped. disk/read_cold timed on the checkpoint's own expert reads, "
                       f"as the engine does when its plan reads experts from disk (hardware/disk_reads; the profiler's "
                       f"fresh temp file read at {1 / hw_disk_beta / 1e9:.2f} GB/s), and so was disk/read_cold_parallel, "
                       f"{DISK_READERS} readers at once as read-ahead issues them: both again right before each row that "
                       f"reads experts from disk (their rates in its speed column).")


def disk_rates(hw) -> str:
    """The expert reads' rates `hw` prices with, one reader and DISK_READERS, e.g. "0.65 / 1.21 GB/s (1 / 2 readers)"."""
    rate = lambda key: 1 / max(hw.models[key].beta, 1e-15) / 1e9  # noqa: E731
    return f"{rate('disk/read_cold'):.2f} / {rate('disk/read_cold_parallel'):.2f} GB/s (1 / {DISK_READERS} readers)"


def speed_found(hw) -> str:
    """What the speed checks at planning (planner/auto.speed_now) found in the profile `hw` a row was priced with:
    the memory's and the cores' speed against the profile's minutes (the median over the keys they scaled: the GEMV
    keys each by its own minute's probe where any was, else the other bandwidth-bound costs' ratio), e.g.
    "memory 0.85x, cores 1.00x"; 1.00x where a check left the keys as measured."""
    mem = hw.meta.get("cpu_key_ratios") or {}
    keys = [r for k, r in mem.items() if k != "*"]  # the GEMV keys each scaled by its own minute's probe
    ratio = median(keys) if keys else mem.get("*") or hw.meta.get("cpu_bandwidth_ratio") or 1.0
    cores = hw.meta.get("cpu_compute_ratios") or {}
    return f"memory {1 / ratio:.2f}x, cores {1 / (median(cores.values()) if cores else 1.0):.2f}x"


TTFT_TOKENS = 512  # the prompt the plans price TTFT for (planner/auto: min(512, max_context / 2))
BATCH = 8  # sequences of the batched SmolLM2 row (a server's --max-batch 8 step)
# the prompt of the long-context SmolLM2 row: its decode step reads ~47 MB of KV beside ~100 MB of weights (a
# 2-layer attn_decode key had priced SmolLM2's default decode at 640 positions 2.5x slow on the AMX VM)
LONG_PROMPT = 2048
SHORT_REPEATS = 5  # rounds over SHORT_PROMPTS, each length once a round (prompt_rows)
SHORT_PROMPTS = (8, 16, 64, 128)  # prompt_rows' lengths: 2, 4, 16 and 32 rows an expert, uniformly routed


def prompt_rows(args, hw, shape) -> tuple[list[dict], Path]:
    """The TTFT of short prompts on the MoE dummy's shape routed uniformly (ModelShape.routing, as the
    plans draw routing: the skewed dummy sends most tokens to 2-3 experts a layer), every expert in RAM,
    against the price of the path the engine runs each on (planner/latency_cpu.prompt_time): within
    Plan.mixed_rows as rows of the native decode step (cpu_predict.predict_prompt_rows, their FFNs as
    predict_prefill's ffn_only), past them through the modules (predict_prefill); a few rows an expert run
    tiered's native kernel, more torch's GEMMs (quant/experts.bf16_native_rows), each priced by its own profile
    key (expert_rows, gemm_rows). Medians of SHORT_REPEATS rounds, the lengths in turn, after a warm-up."""
    from dataclasses import replace

    from moe_offload import mixtral_like
    from tiered.bench.checkpoint import write_dummy_checkpoint

    uniform = replace(mixtral_like(**shape), routing="uniform")
    model = write_dummy_checkpoint(Path(args.workdir) / ("mixtral-dummy-uniform-quick" if args.quick else
                                                         "mixtral-dummy-uniform"), uniform, torch.bfloat16)
    llm = LLM(str(model), EngineConfig(dtype="bfloat16", decode_weights="bf16", accelerator="none", plan="off",
                                       max_context=2 * max(SHORT_PROMPTS)))
    out = []
    try:
        prompts = {n: [(i * 7) % (shape["vocab"] - 10) + 10 for i in range(n)] for n in SHORT_PROMPTS}
        for prompt in prompts.values():
            first_token_s(llm, prompt)  # warm-up
        # the lengths timed in turn, SHORT_REPEATS rounds (as the profiler's median_times): a VM's drift then
        # moves every length's samples together (one length after the other, median of 3, a 16-token prompt
        # once measured 342 ms where the 64-token one took 179)
        samples = {n: [] for n in SHORT_PROMPTS}
        for _ in range(SHORT_REPEATS):
            for n, prompt in prompts.items():
                samples[n].append(first_token_s(llm, prompt))
        for n in SHORT_PROMPTS:
            measured = median(samples[n])
            now = speed_now(hw)
            predicted = engine_prompt_time(llm, now, n)
            out.append({"tokens": n, "predicted_ttft_s": predicted, "measured_ttft_s": measured,
                        "error": abs(predicted - measured) / measured, "speed": speed_found(now)})
            print(f"uniform MoE, {n}-token prompt: TTFT predicted {predicted * 1e3:.1f} ms, measured "
                  f"{measured * 1e3:.1f} ms ({out[-1]['error']:.0%})", flush=True)
    finally:
        llm.close()
    return out, model


def engine_prompt_time(llm: LLM, hw: HardwareProfile, tokens: int) -> float:
    """Seconds of a `tokens`-token prompt of `llm` (every expert in RAM, plan off: no plan of its own to price it
    again) on the path its plan runs it, priced by `hw` as the CPU planner prices its two paths
    (latency_cpu.prompt_paths, prompt_time)."""
    from tiered.planner.latency_cpu import prompt_paths, prompt_time

    return prompt_time(llm.plan, tokens, *prompt_paths(llm.plan, llm.config, hw))


def disk_prompt_row(model: Path) -> dict:
    """The TTFT of the engine's own auto plan on the uniformly routed checkpoint with most experts on
    disk (--cpu-mem = the checkpoint / 3.2, max_context 256: the plan prices a 128-token prompt), the
    page cache dropped before each prompt (median of 3), against the plan's predicted_ttft_s: what
    `tiered run` prints, with the disk reads the engine timed on the checkpoint (hardware/disk_reads), timed
    anew now: the engine caches its fit per device and profile, and a fit of another day priced this row 1.117 s in
    two runs that measured 1.247 and 1.598 (this VM's disk read 0.88-1.14 GB/s one day, 0.82-0.99 the next)."""
    from tiered.hardware.disk_reads import cache_path

    cache_path().unlink(missing_ok=True)  # a cache: the engine times the checkpoint's reads again and refills it
    files = [str(p) for p in model.glob("*.safetensors")]
    cpu_mem = int(sum(os.path.getsize(f) for f in files) / 3.2)
    llm = LLM(str(model), EngineConfig(dtype="bfloat16", accelerator="none", max_context=256, cpu_memory=cpu_mem))
    try:
        n = llm.plan.prompt_tokens
        times = []
        for rep in range(3):
            prompt = [(i * 7 + rep * 131) % (llm.config.vocab_size - 10) + 10 for i in range(n)]
            drop_page_cache(files)
            times.append(first_token_s(llm, prompt))
        measured, predicted, speed = median(times), llm.plan.predicted_ttft_s, speed_found(llm._profile)
    finally:
        llm.close()
    row = {"tokens": n, "predicted_ttft_s": predicted, "measured_ttft_s": measured,
           "error": abs(predicted - measured) / measured, "speed": speed}
    print(f"uniform MoE, {n}-token prompt, experts on disk (auto plan): TTFT predicted {predicted:.3f} s, "
          f"measured {measured:.3f} s ({row['error']:.0%})", flush=True)
    return row


def first_token_s(llm: LLM, prompt: list[int]) -> float:
    """The time to first token of `prompt` [s]: one greedy token generated."""
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0].stats.ttft_s


def batch_file_row(rounds: int = 2, shared_prefix: int = 0) -> dict | None:
    """`tiered batch` of benchmarks/batch_file.py's seeded file (48 SmolLM2 completions, log-normal prompt and
    max_tokens lengths, each prompt after the same `shared_prefix` tokens: a system prompt) at the plan's own batch,
    each run its own process: the median generated tok/s against what the plan priced for the file's requests (their
    run replayed, planner/batch_sim, shared prefixes reused). None without SmolLM2."""
    import tempfile

    from batch_file import run_batch, write_file

    from tiered.checkpoint import default_model_path
    from tiered.errors import CheckpointError

    try:
        model = str(default_model_path())
    except CheckpointError:  # no SmolLM2 package: no row
        return None
    vocab = open_checkpoint(model).config.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "requests.jsonl"
        lengths = write_file(path, 48, 115, 32, vocab, Path(model).stem, shared_prefix=shared_prefix)
        runs = [run_batch(path, model, 0) for _ in range(rounds)]
    measured = median([r["tokens_per_s"] for r in runs])
    priced = runs[0]["priced"]
    row = {"requests": len(lengths), "prompts": f"{min(p for p, _ in lengths)}-{max(p for p, _ in lengths)}",
           "max_tokens": f"{min(g for _, g in lengths)}-{max(g for _, g in lengths)}", "batch": runs[0]["slots"],
           "rounds": rounds, "shared_prefix": shared_prefix, "measured_tokens_per_s": measured, "predicted_tokens_per_s": priced,
           "error": abs(priced - measured) / measured if priced else None}
    print(f"batch file (shared prefix {shared_prefix}): predicted {priced} tok/s, measured {measured:.1f}", flush=True)
    return row if priced else None


def dense_rows(args, hw, rows: list, errors: list) -> None:
    """SmolLM2-135M from its GGUF, end to end: explicit bf16 and fp32 weights (plan off, priced by the
    cost model with `hw`), and the default engine (one int4/int8 copy, the native decode step when
    built) as its own auto plan predicts it at the measured positions (LLM.predicted_decode_at, what
    `tiered run` prints beside its measured speed; the plan's own predicted_decode_tokens_per_s is at its
    prompt + generation length), and the default engine stepping BATCH sequences together against
    its plan's batch figure (predicted_batch_decode_tokens_per_s, priced again there). Each row also
    compares the TTFT of a TTFT_TOKENS-token prompt with the prefill prediction (the plan's
    predicted_ttft_s; cpu_predict.predict_prefill for the plan-off rows); those errors are reported
    apart from the decode median."""
    cases = (("SmolLM2-135M dense, bf16 weights", EngineConfig(dtype="bfloat16", decode_weights="bf16", plan="off"), "bf16"),
             ("SmolLM2-135M dense, fp32 weights", EngineConfig(dtype="float32", decode_weights="fp32", plan="off"), "fp32"),
             ("SmolLM2-135M default (auto plan: one int4/int8 copy, native step)", EngineConfig(), None),
             (f"SmolLM2-135M default, {BATCH} sequences at once (ms per token of the step)",
              EngineConfig(max_batch=BATCH), "batch"),
             (f"SmolLM2-135M default, after a {LONG_PROMPT}-token prompt",
              EngineConfig(max_context=2 * LONG_PROMPT), "long"))
    def spread(n: int) -> list[int]:  # n token ids over SmolLM2's vocabulary
        return [(i * 7) % 40000 + 100 for i in range(n)]
    long_prompt = spread(TTFT_TOKENS)
    for name, cfg, dw in cases:
        now = speed_now(hw)  # as the engine plans (the default row's engine checks on its own)
        llm = LLM(None, cfg)
        ids = spread(LONG_PROMPT) if dw == "long" else list(range(100, 132))
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        positions = len(ids) + args.new_tokens // 2
        if dw == "batch":  # BATCH prompts decoded together: the step's time over its BATCH tokens, from the moment
            # every prompt has its first token (all prefilled) to the end, over the steps between. The longest decode_s
            # over n - 1 steps had counted the steps that prefilled the prompts admitted after the first ones (32-token
            # prompts: 6 joined the first step's rows, 2 prefilled after): 20.5 ms a step on 2 AVX2 cores, where a step
            # took 13.2. The difference of 2n and n new tokens (the prefill cancelling) then read 1.16-1.61 ms a token
            # in three rounds on 2 Zen 4 cores where the 8-row native step took 10.6-10.9 ms (1.33-1.36) in each: the
            # 256-row prefill's own swing (408-472 ms) landed in the difference (2026-12-04)
            prompts = [[i + 7 * b for i in ids] for b in range(BATCH)]

            def run(n: int) -> float:
                outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                start = max(o.stats.ttft_s for o in outs)  # the last prompt's first token (from the call's start)
                end = max(o.stats.ttft_s + o.stats.decode_s for o in outs)
                return (end - start) / (n - 1) / BATCH
            itl = median([run(2 * args.new_tokens) for _ in range(3)])
        else:
            itl = median([llm.generate([ids], SamplingParams(temperature=0, max_tokens=args.new_tokens,
                                                             ignore_eos=True))[0].stats.itl_s for _ in range(3)])
        if dw == "batch":  # the plan's batch figure priced again at the positions its steps span (mean: prompt + N)
            step = 1.0 / llm.predicted_decode_at(len(ids) + args.new_tokens, batch=True)
        elif dw in (None, "long"):  # the plan priced again at this run's positions (its own figure is at prompt + generation:
            # 640 positions, where attention reads 10x the KV bytes), as `tiered run` reports it
            step = 1.0 / (llm.predicted_decode_at(positions) or llm.plan.predicted_decode_tokens_per_s)
        else:
            _, step = predict_decode(llm.config, now, dw, context=positions)
        err = abs(step - itl) / itl
        errors.append(err)
        ttft = median([first_token_s(llm, long_prompt) for _ in range(3)])
        long_ttft = None
        if dw == "long":  # the LONG_PROMPT-token prompt itself: prefilled in the plan's chunks (Plan.prefill_chunk)
            measured = median([first_token_s(llm, ids) for _ in range(3)])
            priced = llm.predicted_ttft_at(len(ids))
            long_ttft = {"tokens": len(ids), "chunk": llm.plan.prefill_chunk, "measured_s": measured,
                         "predicted_s": priced, "error": None if priced is None else abs(priced - measured) / measured}
        if dw in (None, "batch", "long"):
            assert llm.plan.prompt_tokens == TTFT_TOKENS, llm.plan.prompt_tokens
            p_ttft = llm.plan.predicted_ttft_s
        else:  # plan off: weights and activations in dw, no decode copies
            p_ttft = predict_prefill(llm.config, now, dw, TTFT_TOKENS, act_dtype=dw)
        engine_profile = llm._profile  # what the engine's own plan was priced with (its speed checks)
        llm.close()
        rows.append({"plan": name, "predicted_step_s": step, "measured_itl_s": itl, "e2e_error": err,
                     "layer_median_error": None, "layers": [], "predicted_ttft_s": p_ttft, "measured_ttft_s": ttft,
                     "ttft_error": abs(p_ttft - ttft) / ttft, **({"long_ttft": long_ttft} if long_ttft else {}),
                     "speed": speed_found(engine_profile if dw in (None, "batch", "long") else now)})
        print(f"{name}: predicted {step * 1e3:.1f} ms/token, measured {itl * 1e3:.1f} ms ({err:.0%}); "
              f"TTFT {TTFT_TOKENS} tokens predicted {p_ttft:.3f} s, measured {ttft:.3f} s "
              f"({rows[-1]['ttft_error']:.0%})", flush=True)
        if long_ttft and long_ttft["predicted_s"] is not None:
            print(f"{name}: TTFT of the {len(ids)}-token prompt (chunks of {long_ttft['chunk']}) predicted "
                  f"{long_ttft['predicted_s']:.3f} s, measured {long_ttft['measured_s']:.3f} s "
                  f"({long_ttft['error']:.0%})", flush=True)


if __name__ == "__main__":
    main()
