"""Offloading at real layer width on one GPU: every tiered mode against transformers + accelerate.

Reproduces section 2 of shared/gpu-runs/2026-11-22-h200/README.md on any CUDA machine. Two
shapes, dummy bf16 weights with skewed routing (tiered/bench/checkpoint.py):
    moe    4 Mixtral-8x7B layers (hidden 4096, FFN 14336, 8 experts top-2, GQA 32/8, vocab 32000,
           11.3 GiB), --gpu-mem 4GiB
    dense  8 Llama-3-8B layers (hidden 4096, FFN 14336, GQA 32/8, vocab 32000, 3.7 GiB), --gpu-mem 2GiB
Rows, each in its own engine (closed after): tiered with plan auto (the default), plan off, every
expert miss copied to the GPU, every miss run on the CPU (MoE only), no GPU, an unconstrained GPU;
transformers + accelerate with the same GPU budget (device_map="auto"), transformers all on the
GPU. Each: warm-up, TTFT of a 512-token prompt, decode tok/s = (N-1)/(t(N)-t(1)) for N = 32 new
tokens after a 32-token prompt (greedy, EOS ignored), medians of --repeats; peak GPU memory
(torch.cuda.max_memory_allocated) and the plan's predicted decode tok/s and TTFT. A row that
fails (a BudgetError, out of memory) is recorded with its error. Writes
benchmarks/results/gpu_offload.{json,md} (gpu_offload_moe / _dense for one shape).

    python benchmarks/gpu_offload.py --profile PROFILE.json        # a CUDA machine, both shapes
    python benchmarks/gpu_offload.py --shape moe --repeats 1       # one shape, quicker
    python benchmarks/gpu_offload.py --smoke                       # no GPU needed, < 1 min
    python benchmarks/gpu_offload.py --shape moe --routing uniform # MoE routed like the plans price it

--routing uniform writes the MoE checkpoint without its skew (ModelShape.routing): each token routes
by its own hidden state, as the plans' i.i.d. pricing assumes, and an expert cache hits about as often
as they price it (the skewed weights send ~98% of a layer's tokens to its top 2-3 experts, so an LRU
of 7 slots hit ~80% where 16% was priced, and such rows are not comparable with the plans).

--smoke runs the same rows at tiny shapes (a few MB) with the host stand-in accelerator (CPU
memory under its own byte budget, a throttled link) in place of the GPU, budgets scaled so that
experts really are offloaded, and the transformers baselines on the CPU (accelerate offloads to
disk there). It checks that the script works, not how fast anything is; results go to a temp
directory unless --out is given.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from tiered import EngineConfig, SamplingParams  # noqa: E402
from tiered.bench import Column, ModelShape, PeakMemory, llama3_8b, machine_info, mixtral_8x7b, write_report  # noqa: E402
from tiered.bench.runners import HFRunner, TieredRunner, free_memory, measure_latency  # noqa: E402
from tiered.bench.checkpoint import ROUTINGS, write_dummy_checkpoint  # noqa: E402

GiB = 2**30
SHAPES = {"moe": (mixtral_8x7b(layers=4), 4 * GiB), "dense": (llama3_8b(layers=8), 2 * GiB)}
# --smoke: the real layer counts at width 256 (a few MB), so budgets scale with the same proportions
SMOKE_SHAPES = {"moe": ModelShape(layers=4, hidden=256, ffn=768, heads=4, kv_heads=2, vocab=2048, experts=8),
                "dense": ModelShape(layers=8, hidden=256, ffn=1024, heads=4, kv_heads=2, vocab=2048)}
ROW_IDS = ("plan_auto", "plan_auto_eager", "plan_auto_cuda_pinned", "plan_auto_huge_pinned", "plan_auto_worker_issue", "plan_off",
           "plan_auto_profiled", "forced_copy",
           "forced_cpu", "forced_split", "forced_priced", "no_gpu", "unconstrained", "unconstrained_eager", "hf_accelerate", "hf_all_gpu")
SMOKE_LINK = 2e9  # bytes/s of the stand-in's emulated PCIe link in --smoke


@dataclass(frozen=True)
class Setup:
    """What one shape's run measures (tokens, bytes, counts)."""

    shape_name: str
    shape: ModelShape
    gpu_memory: int           # the GPU budget of the offloading rows [bytes]
    accelerator: str          # "cuda", or "host" (the stand-in) in --smoke
    link_bandwidth: float | None
    ttft_tokens: int
    decode_prompt_tokens: int
    new_tokens: int
    repeats: int
    profile: str | None
    trace_dir: Path | None
    smoke: bool
    workspace: int = 0        # of gpu_memory, the activation room tiered's plan keeps (smoke: not given to accelerate)
    expert_profile: Path | None = None  # MoE: `tiered profile-experts`' JSON for the plan_auto_profiled row
    bandwidth: str = "off"    # what --bandwidth-check found (checked_profile)


@dataclass(frozen=True)
class Row:
    """One configuration: a tiered EngineConfig, or a transformers baseline (hf = "accelerate" | "all")."""

    id: str
    label: str
    config: EngineConfig | None = None
    hf: str | None = None


def rows_for(s: Setup) -> list[Row]:
    """The configurations of section 2: tiered's modes, then the transformers baselines."""
    base = EngineConfig(dtype="bfloat16", accelerator=s.accelerator, gpu_memory=s.gpu_memory,
                        link_bandwidth=s.link_bandwidth, max_context=2 * s.ttft_tokens, profile=s.profile,
                        trace=s.trace_dir is not None,
                        graphs="on" if s.accelerator == "host" else "auto")  # --smoke: the stand-in's graphs too
    hf_budget = (f'max_memory={{0: "{s.gpu_memory / GiB:.3g}GiB"}}' if s.accelerator == "cuda" else
                 f'max_memory={{"cpu": "{s.gpu_memory / 2**20:.3g}MiB"}}, the rest on disk')
    rows = [Row("plan_auto", "tiered, plan auto (default)", base),
            Row("plan_auto_eager", "tiered, plan auto, decode not graphed (--graphs off)", replace(base, graphs="off")),
            Row("plan_auto_cuda_pinned", 'tiered, plan auto, RAM weights pinned by cudaHostAlloc (pinned="cuda", '
                '4 KiB pages)', replace(base, pinned="cuda")),
            Row("plan_auto_huge_pinned", 'tiered, plan auto, RAM weights in registered huge pages (pinned="huge")',
                replace(base, pinned="huge")),
            Row("plan_auto_worker_issue", 'tiered, plan auto, every H2D copy issued by the copy worker '
                '(device_issue="worker")', replace(base, device_issue="worker")),
            Row("plan_off", "tiered, plan off", replace(base, plan="off"))]
    if s.shape.is_moe:
        # the plan a user gets after `tiered profile-experts`: popularity-led residents, and a predicted hit
        # rate from the profile's routing (the plans above price i.i.d. routing; the dummy weights are skewed)
        rows += [Row("plan_auto_profiled", "tiered, plan auto with an expert profile (--expert-profile)",
                     replace(base, expert_profile=str(s.expert_profile)) if s.expert_profile else base)]
        rows += [Row("forced_copy", 'tiered, every miss copied (force_expert_path="copy")',
                     replace(base, force_expert_path="copy")),
                 Row("forced_cpu", 'tiered, every miss on the CPU (force_expert_path="cpu")',
                     replace(base, force_expert_path="cpu")),
                 Row("forced_split", 'tiered, every miss split by rows between the CPU and the link '
                     '(force_expert_path="split")', replace(base, force_expert_path="split")),
                 # the balanced dispatch without its margins (dispatcher.MIX_GAIN, SPLIT_GAIN): a decode layer's
                 # misses both ways wherever the latency model prices that faster, which the margins, set from
                 # copies that started late on a worker thread, now forbid on the H100 host's profiles
                 Row("forced_priced", 'tiered, misses where the latency model prices them fastest, no margins '
                     '(force_expert_path="priced")', replace(base, force_expert_path="priced"))]
    rows += [Row("no_gpu", 'tiered, no GPU (accelerator="none")', replace(base, accelerator="none", gpu_memory=None,
                                                                          link_bandwidth=None)),
             Row("unconstrained", "tiered, unconstrained GPU (gpu_memory=None)", replace(base, gpu_memory=None)),
             Row("unconstrained_eager", "tiered, unconstrained GPU, decode not graphed (--graphs off)",
                 replace(base, gpu_memory=None, graphs="off")),
             Row("hf_accelerate", f"transformers + accelerate, {hf_budget}", hf="accelerate"),
             Row("hf_all_gpu", "transformers, all on GPU" if s.accelerator == "cuda" else
                 "transformers, all on the CPU (for all on GPU)", hf="all")]
    return rows


def smoke_budget(shape: ModelShape, kv: int, real: ModelShape, real_budget: int) -> int:
    """A GPU budget for `shape` [bytes] that leaves its experts (MoE) or MLPs (dense) the share
    `real_budget` leaves them in `real` after the other weights (~30% of the experts for 4 Mixtral
    layers in 4 GiB, ~34% of the MLPs for 8 Llama-3 layers in 2 GiB), plus `kv` bytes of KV cache
    and the activation workspace every GPU plan keeps (memory/sizes.workspace_bytes)."""

    def split(m: ModelShape) -> tuple[int, int]:  # bf16 bytes: (other weights, experts or MLPs)
        return 2 * m.nonexpert_params(), 2 * (m.params() - m.nonexpert_params())

    fixed, rest = split(real)
    share = (real_budget - fixed) / rest
    fixed, rest = split(shape)
    return int(fixed + kv + smoke_workspace(shape) + share * rest)


def smoke_workspace(shape: ModelShape) -> int:
    """The activation workspace tiered's GPU plans keep for `shape` [bytes] (memory/sizes.py)."""
    from tiered.checkpoint.model_config import ModelConfig
    from tiered.memory import sizes

    return sizes.workspace_bytes(ModelConfig.from_hf(shape.config_json()), "bf16")


def kv_bytes(shape: ModelShape, tokens: int) -> int:
    """bf16 KV cache of one `tokens`-token sequence [bytes]."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * tokens * 2


def probe_engine(shape_name: str, profile: str | None, smoke: bool) -> tuple[ModelShape, Path, EngineConfig]:
    """A GPU probe's model and default engine (gpu_stall_probe.py, gpu_memory_probe.py): the shape's dummy
    checkpoint (written once) and the default plan's EngineConfig under the shape's GPU budget, max
    context 1024; with `smoke`, the stand-in at width 256 with a budget of the same proportions."""
    shape, budget = SHAPES[shape_name]
    if smoke:  # the host stand-in at width 256: checks that the probe runs, not where time goes
        budget = smoke_budget(SMOKE_SHAPES[shape_name], kv_bytes(SMOKE_SHAPES[shape_name], 128), shape, budget)
        shape = SMOKE_SHAPES[shape_name]
    workdir = Path(tempfile.gettempdir()) / "tiered_stall_probe" if smoke else Path.home() / ".cache" / "tiered" / "bench"
    model = write_dummy_checkpoint(workdir / f"{shape_name}-{shape.layers}L-{shape.hidden}", shape, torch.bfloat16)
    cfg = EngineConfig(dtype="bfloat16", accelerator="host" if smoke else "cuda", gpu_memory=budget,
                       max_context=128 if smoke else 1024, profile=profile, link_bandwidth=SMOKE_LINK if smoke else None)
    return shape, model, cfg


def prompts(s: Setup) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(1)
    draw = lambda n: torch.randint(3, s.shape.vocab, (n,), generator=g).tolist()  # noqa: E731
    return {"ttft": draw(s.ttft_tokens), "warmup": draw(s.ttft_tokens), "decode": draw(s.decode_prompt_tokens)}


def record_expert_profile(s: Setup, model: Path, out: Path) -> Path:
    """Tokens routed per (layer, expert) over 4 prompts other than the measured ones, recorded as
    `tiered profile-experts` records them (runtime/expert_profile.ExpertProfiler), with every weight
    on the accelerator: out/expert_profile_SHAPE.json."""
    from tiered import LLM
    from tiered.runtime.expert_profile import ExpertProfiler

    g = torch.Generator().manual_seed(7)
    lines = [torch.randint(3, s.shape.vocab, (s.decode_prompt_tokens,), generator=g).tolist() for _ in range(4)]
    llm = LLM(model, EngineConfig(dtype="bfloat16", accelerator=s.accelerator, link_bandwidth=s.link_bandwidth,
                                  max_context=2 * s.ttft_tokens, plan="off"))
    try:
        profiler = ExpertProfiler.attach(llm.model, llm.config)
        llm.generate(lines, SamplingParams(temperature=0, max_tokens=s.new_tokens, ignore_eos=True))
        path = out / f"expert_profile_{s.shape_name}.json"
        profiler.save(path, model=str(model), prompts=len(lines))
        return path
    finally:
        llm.close()


def measure(row: Row, s: Setup, model: Path, p: dict, offload_dir: Path) -> dict:
    """One configuration in its own engine: load, warm up, measure, close. Errors become the row's."""
    out: dict = {"shape": s.shape_name, "id": row.id, "config": row.label}
    if row.config is not None:
        out["engine_config"] = repr(row.config)
    cuda = s.accelerator == "cuda"
    try:
        with PeakMemory(cuda=cuda) as peak:
            runner = TieredRunner(model, row.config) if row.config is not None else hf_runner(row, s, model, offload_dir)
            try:
                out.update(measure_latency(runner, p["ttft"], p["decode"], s.new_tokens, s.repeats, p["warmup"]))
                out.update(runner.info())
                if isinstance(runner, HFRunner):
                    out["device"] = str(runner.device)
                elif s.trace_dir is not None:
                    path = s.trace_dir / f"trace_{s.shape_name}_{row.id}.json"
                    if runner.write_trace(path):
                        out["trace"] = str(path)
            finally:
                runner.close()
                del runner
    except Exception as e:  # recorded, not fatal: BudgetError, out of memory, an unsupported path
        out["error"] = f"{type(e).__name__}: {e}".strip()
        out["traceback"] = traceback.format_exc()[-3000:]
    if "error" in out:
        free_memory()  # what a failed constructor allocated (its frames died with the exception)
        return out
    out["peak_rss_gib"] = peak.rss_bytes / GiB
    if cuda:
        out["peak_gpu_gib"] = peak.gpu_bytes / GiB
        out["left_gpu_gib"] = peak.gpu_left_bytes / GiB  # still allocated after the engine closed
    elif row.config is not None and row.config.accelerator == "host" and "peak_fast_bytes" in out:
        out["peak_gpu_gib"] = out["peak_fast_bytes"] / GiB  # the stand-in's budget high-water mark
    elif row.config is not None and row.config.accelerator == "none":
        out["peak_gpu_gib"] = 0.0
    return out


def hf_runner(row: Row, s: Setup, model: Path, offload_dir: Path) -> HFRunner:
    """The transformers baselines. On CUDA: accelerate with {0: budget, "cpu": most free RAM}, or
    the whole model on cuda:0. In --smoke (no GPU): accelerate with {"cpu": budget} offloading the
    rest to disk, or the whole model on the CPU."""
    if row.hf == "all":
        return HFRunner(model, torch.bfloat16, device="cuda" if s.accelerator == "cuda" else "cpu")
    if s.accelerator == "cuda":
        import psutil
        max_memory = {0: s.gpu_memory, "cpu": int(0.8 * psutil.virtual_memory().available)}
    else:
        max_memory = {"cpu": s.gpu_memory - s.workspace}  # the weights' share, as tiered places them
    return HFRunner(model, torch.bfloat16, max_memory=max_memory, offload_folder=offload_dir)


COLUMNS = [Column("configuration", "config"), Column("TTFT s", "ttft_s", "{:.3f}"),
           Column("decode tok/s", "decode_tokens_per_s", "{:.1f}"), Column("peak GPU GiB", "peak_gpu_gib", "{:.2f}"),
           Column("left GPU GiB", "left_gpu_gib", "{:.2f}"), Column("peak RSS GiB", "peak_rss_gib", "{:.2f}"),
           Column("predicted tok/s", "predicted_decode_tokens_per_s", "{:.1f}"),
           Column("predicted TTFT s", "predicted_ttft_s", "{:.3f}"),
           Column("expert hit rate", "hit_rate", "{:.0%}")]


# Issue 8's targets on the README's shapes, with a real GPU (the smoke run checks the arithmetic only).
TARGET_DECODE = {"moe": 40.0, "dense": 30.0}  # tok/s of the default plan (sections 3 and 4)
TARGET_TTFT = {"dense": 0.15}  # s at 512 tokens (section 4)
BEST_OF = {"moe": ("forced_copy", "forced_cpu", "no_gpu")}  # the default within 5% of their best (section 3)
PREDICTION_TOLERANCE = 0.25  # section 6
PREDICTED_ROWS = ("plan_auto", "forced_copy", "forced_cpu", "no_gpu")


def targets(shape: str, rows: list[dict]) -> list[dict]:
    """Issue 8's checks on one shape's measured rows: {"check", "measured", "target", "met"} each; "met"
    None where a row it needs is missing or failed. Section 3 (MoE): the default plan decodes at 40 tok/s
    or more and is never more than 5% slower than the best of every miss copied, every miss on the CPU
    and no GPU, in decode tok/s and in TTFT. Section 4 (dense): 30 tok/s or more and TTFT at most 0.15 s.
    Section 5: all on the GPU at least as fast as transformers all on the GPU. Section 6: each of the
    default, forced and no-GPU rows' predicted decode tok/s and TTFT within 25% of what was measured."""
    ok = {r["id"]: r for r in rows if "error" not in r}
    out = []

    def add(check, measured, target, met):
        out.append({"check": check, "measured": measured, "target": target, "met": met})
    auto = ok.get("plan_auto")
    if shape in TARGET_DECODE:
        v = auto and auto["decode_tokens_per_s"]
        add("default plan decode tok/s", v, f">= {TARGET_DECODE[shape]:.0f}", None if v is None else v >= TARGET_DECODE[shape])
    if shape in TARGET_TTFT:
        v = auto and auto["ttft_s"]
        add("default plan TTFT s", v, f"<= {TARGET_TTFT[shape]}", None if v is None else v <= TARGET_TTFT[shape])
    others = [ok[i] for i in BEST_OF.get(shape, ()) if i in ok]
    if shape in BEST_OF:
        for key, label, faster in (("decode_tokens_per_s", "decode tok/s", max), ("ttft_s", "TTFT s", min)):
            best = faster((r[key] for r in others), default=None)
            v = auto and auto[key]
            bound = None if best is None else (0.95 * best if faster is max else best / 0.95)
            met = None if v is None or bound is None else (v >= bound if faster is max else v <= bound)
            add(f"default plan {label} within 5% of the best of {', '.join(BEST_OF[shape])}", v,
                None if bound is None else f"{'>=' if faster is max else '<='} {bound:.3g}", met)
    gpu, hf = ok.get("unconstrained"), ok.get("hf_all_gpu")
    if gpu is not None or hf is not None:
        v, h = gpu and gpu["decode_tokens_per_s"], hf and hf["decode_tokens_per_s"]
        add("all on the GPU: decode tok/s at least transformers'", v, None if h is None else f">= {h:.1f}",
            None if v is None or h is None else v >= h)
    for rid in PREDICTED_ROWS:
        r = ok.get(rid)
        for key, pred, label in (("decode_tokens_per_s", "predicted_decode_tokens_per_s", "decode"),
                                 ("ttft_s", "predicted_ttft_s", "TTFT")):
            if r is None or not r.get(pred) or not r.get(key):
                continue
            err = abs(r[pred] - r[key]) / r[key]
            add(f"{rid}: {label} prediction's error (|predicted - measured| / measured)", round(err, 3),
                f"<= {PREDICTION_TOLERANCE}", err <= PREDICTION_TOLERANCE)
    return out


def _targets_table(checks: list[dict]) -> str:
    def fmt(v):
        return "–" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| check | measured | target | met |", "|---|---|---|---|"]
    for c in checks:
        met = "not measured" if c["met"] is None else "yes" if c["met"] else "**no**"
        lines.append(f"| {c['check']} | {fmt(c['measured'])} | {fmt(c['target'])} | {met} |")
    return "\n".join(lines)


def report(name: str, out_dir: Path, setups: list[Setup], rows: list[dict], machine: dict) -> tuple[Path, Path]:
    parts, notes, checks = [], [], {}
    from tiered.bench.report import markdown_table
    for s in setups:
        mine = [r for r in rows if r["shape"] == s.shape_name]
        sh = s.shape
        what = (f"{sh.layers} Mixtral-8x7B-shaped layers ({sh.experts} experts top-{sh.top_k}, {sh.routing} routing"
                if sh.is_moe else f"{sh.layers} Llama-3-8B-shaped layers (dense") + \
            f", hidden {sh.hidden}, FFN {sh.ffn}, GQA {sh.heads}/{sh.kv_heads}, vocab {sh.vocab}, " \
            f"{2 * sh.params() / GiB:.3g} GiB bf16)"
        parts.append(f"**{s.shape_name}: {what}**, GPU budget {s.gpu_memory / GiB:.3g} GiB"
                     f"{' (host stand-in)' if s.smoke else ''}:\n\n" + markdown_table(mine, COLUMNS))
        checks[s.shape_name] = targets(s.shape_name, mine)
        if checks[s.shape_name]:
            parts.append(f"Issue 8's targets, {s.shape_name}{' (smoke: the arithmetic only)' if s.smoke else ''}:\n\n"
                         + _targets_table(checks[s.shape_name]))
    s0 = setups[0]
    notes.append(f"TTFT of a {s0.ttft_tokens}-token prompt; decode = (N-1)/(t(N)-t(1)) for N = {s0.new_tokens} new "
                 f"tokens after a {s0.decode_prompt_tokens}-token prompt, greedy, EOS ignored; medians of "
                 f"{s0.repeats} after a warm-up; every configuration in its own engine. Peak GPU: "
                 + ("torch.cuda.max_memory_allocated less what was allocated when the row began; left: what "
                    "was still allocated after its engine closed (a leak)." if s0.accelerator == "cuda" else
                    "the host stand-in's budget high-water mark (MoE rows; – where the runtime does not report it)."))
    if s0.smoke:
        notes.append("SMOKE run: tiny shapes, the host stand-in accelerator for the GPU (link "
                     f"{SMOKE_LINK / 1e9:.0f} GB/s), transformers on the CPU (accelerate offloads to disk there). "
                     "It shows that the benchmark runs, not how fast anything is.")
    settings = {"shapes": [s.shape_name for s in setups], "gpu_memory_bytes": {s.shape_name: s.gpu_memory for s in setups},
                "accelerator": s0.accelerator, "link_bandwidth": s0.link_bandwidth, "ttft_tokens": s0.ttft_tokens,
                "decode_prompt_tokens": s0.decode_prompt_tokens, "new_tokens": s0.new_tokens, "repeats": s0.repeats,
                "profile": s0.profile, "bandwidth_check": s0.bandwidth, "smoke": s0.smoke, "dtype": "bfloat16",
                "routing": {s.shape_name: s.shape.routing for s in setups if s.shape.is_moe},
                "torch_threads": torch.get_num_threads()}
    extra = {"model_shapes": {s.shape_name: vars(s.shape) for s in setups}, "targets": checks}
    return write_report(name, out_dir, title="GPU offloading at real layer width" + (" (smoke)" if s0.smoke else ""),
                        settings=settings, rows=rows, body="\n\n".join(parts), notes=notes, machine=machine, extra=extra)


def checked_profile(profile: str, dest: Path) -> tuple[str, str]:
    """(the profile to plan with, what the check found) for --bandwidth-check: `profile` (a JSON path or
    a preset) scaled to the CPU memory's speed now by planner/auto.bandwidth_now, as an engine scales its
    own cached profile, and saved to `dest` (for the replays) where it was scaled; else `profile` as is.
    On the H100 host two quick profiles of the same machine kind read the bf16 decode kernel from DRAM at
    69.4 and 101.7 GB/s (2026-11-26), and every miss on the CPU decoded at 31.1 tok/s where the faster
    one priced 39.9."""
    from tiered.planner.auto import bandwidth_now, engine_profile

    hw = engine_profile(profile)
    now = bandwidth_now(hw)
    if now is hw:
        return profile, "within 15% of the profile (or not checked: TIERED_BANDWIDTH_CHECK=0, no DRAM key)"
    dest.parent.mkdir(parents=True, exist_ok=True)
    now.save(dest)
    ratio = now.meta["cpu_bandwidth_ratio"]
    return str(dest), f"memory {1 / ratio:.2f}x the profile's speed: planned with {dest.name}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=("moe", "dense", "both"), default="both")
    ap.add_argument("--profile", help="hardware profile JSON (or preset) the planner uses; default: the engine's own")
    ap.add_argument("--out", help="results directory (default benchmarks/results; --smoke: a new temp directory)")
    ap.add_argument("--name", help="report name (default gpu_offload, or gpu_offload_SHAPE for one shape)")
    ap.add_argument("--trace-dir", help="record each tiered row's timeline (EngineConfig(trace=True)) here")
    ap.add_argument("--workdir", help="where the dummy checkpoints are written (default ~/.cache/tiered/bench; "
                                      "--smoke: a temp directory, removed after)")
    ap.add_argument("--repeats", type=int, help="medians of this many runs (default 3; --smoke 1)")
    ap.add_argument("--rows", help="comma list of row ids to run, in that order (default all): " + ", ".join(ROW_IDS))
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own; --smoke: 1, since "
                                                "OpenMP slows down 10-30x on a shared machine when oversubscribed)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the host stand-in: no GPU needed, < 1 min")
    ap.add_argument("--routing", choices=ROUTINGS, default="skewed",
                    help="the MoE dummy weights' routing (default skewed: the runs before 2026-11-26 all were)")
    ap.add_argument("--bandwidth-check", action="store_true",
                    help="plan with --profile scaled to this minute's CPU memory speed (planner/auto.bandwidth_now), "
                         "as an engine plans with its own cached profile; the scaled profile is saved beside the report")
    a = ap.parse_args(argv)
    threads = a.threads or (1 if a.smoke else None)
    if threads:
        torch.set_num_threads(threads)
    if not a.smoke and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (use --smoke to check the script on the host stand-in)")
    shapes = ["moe", "dense"] if a.shape == "both" else [a.shape]
    name = a.name or ("gpu_offload" if a.shape == "both" else f"gpu_offload_{a.shape}") + ("_smoke" if a.smoke else "")
    out_dir = Path(a.out) if a.out else (Path(tempfile.mkdtemp(prefix="gpu_offload_smoke_")) if a.smoke
                                         else ROOT / "results")
    temp_work = a.smoke and not a.workdir
    workdir = Path(a.workdir) if a.workdir else (Path(tempfile.mkdtemp(prefix="gpu_offload_ckpt_")) if a.smoke
                                                 else Path.home() / ".cache" / "tiered" / "bench")
    trace_dir = Path(a.trace_dir) if a.trace_dir else None
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
    order = list(dict.fromkeys(a.rows.split(","))) if a.rows else None  # in the order given
    if order is not None and set(order) - set(ROW_IDS):
        ap.error(f"unknown rows {sorted(set(order) - set(ROW_IDS))}; pick from {', '.join(ROW_IDS)}")
    repeats = a.repeats or (1 if a.smoke else 3)
    profile, bandwidth = a.profile, "off"
    if a.bandwidth_check and a.profile:
        profile, bandwidth = checked_profile(a.profile, out_dir / f"{name}_profile.json")
    setups = []
    for sn in shapes:
        real, budget = SHAPES[sn]
        real = replace(real, routing=a.routing) if real.is_moe else real
        if a.smoke:
            shape = replace(SMOKE_SHAPES[sn], routing=real.routing)
            setups.append(Setup(sn, shape, smoke_budget(shape, kv_bytes(shape, 128), real, budget), "host", SMOKE_LINK,
                                ttft_tokens=64, decode_prompt_tokens=16, new_tokens=8, repeats=repeats,
                                profile=profile, trace_dir=trace_dir, smoke=True, bandwidth=bandwidth,
                                workspace=smoke_workspace(shape)))
        else:
            setups.append(Setup(sn, real, budget, "cuda", None, ttft_tokens=512, decode_prompt_tokens=32,
                                new_tokens=32, repeats=repeats, profile=profile, trace_dir=trace_dir, smoke=False,
                                bandwidth=bandwidth))
    machine = machine_info()
    rows: list[dict] = []
    json_path = md_path = None
    try:
        for s in setups:
            print(f"== {s.shape_name}: writing / reusing the dummy checkpoint ({2 * s.shape.params() / GiB:.3g} GiB) ...",
                  flush=True)
            tag = "smoke-" if s.smoke else ""
            routed = "" if s.shape.routing == "skewed" else f"-{s.shape.routing}"
            model = write_dummy_checkpoint(workdir / f"{tag}{s.shape_name}-{s.shape.layers}L-{s.shape.hidden}{routed}",
                                           s.shape, torch.bfloat16)
            p = prompts(s)
            if s.shape.is_moe and (order is None or "plan_auto_profiled" in order):
                print(f"-- {s.shape_name}: recording an expert profile (4 other prompts)", flush=True)
                s = replace(s, expert_profile=record_expert_profile(s, model, out_dir))
            offload = workdir / "accelerate_offload"
            by_id = {row.id: row for row in rows_for(s)}
            for row in (by_id.values() if order is None else [by_id[i] for i in order if i in by_id]):
                print(f"-- {s.shape_name} / {row.label}", flush=True)
                r = measure(row, s, model, p, offload)
                shutil.rmtree(offload, ignore_errors=True)
                rows.append(r)
                print("   " + (r["error"].splitlines()[0] if "error" in r else
                               f"TTFT {r['ttft_s']:.3f} s, decode {r['decode_tokens_per_s']:.1f} tok/s"
                               + (f", peak GPU {r['peak_gpu_gib']:.2f} GiB" if r.get("peak_gpu_gib") is not None else "")
                               + (f", predicted {r['predicted_decode_tokens_per_s']:.1f} tok/s"
                                  if r.get("predicted_decode_tokens_per_s") else "")), flush=True)
                json_path, md_path = report(name, out_dir, setups, rows, machine)  # after every row: partial runs count
    finally:
        if temp_work:
            shutil.rmtree(workdir, ignore_errors=True)
    if md_path is None:
        print("no rows selected")
        return 2
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
