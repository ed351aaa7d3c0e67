"""bf16 CPU experts past one row: the native kernel or torch's GEMMs (kernels/tune.py's bf16_native_rows).

Two tables, in one process:
  experts  one bf16 SwiGLU expert at 1-64 rows (Mixtral and OLMoE widths), cycled over enough distinct
           experts to exceed the last-level cache: the native kernel (one call up to 8 rows, then
           8-row groups, as quant/experts.ExpertFormat.forward_group runs them) against torch's three
           GEMMs (models/moe.expert_forward), ms an expert, medians of `--repeats` sweeps.
  prefill  a CPU-only bf16 MoE (the planner_validation dummy: 8 Mixtral-shaped layers at hidden 1024,
           every expert in RAM) two engines alike but for the rows their ExpertFormat gives the native
           kernel: this machine's tuning (kernels.bf16_native_rows) and the built-in 32; the time to
           first token of 16-512-token prompts, alternated, medians of `--repeats`. The dummy's routing is
           skewed (a layer's top 2-3 experts take most tokens), so a 16-token prompt gives them ~10 rows each.

    .venv/bin/python benchmarks/cpu_expert_rows.py [--quick] [--out DIR]

Writes DIR/cpu_expert_rows.{json,md} (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

import torch  # noqa: E402

from moe_offload import write_checkpoint  # noqa: E402
from tiered import LLM, EngineConfig, SamplingParams, kernels  # noqa: E402
from tiered.bench import Column, median, write_report  # noqa: E402
from tiered.hardware.profiler import cold_copies, last_level_cache_bytes, random_expert  # noqa: E402
from tiered.kernels import tune  # noqa: E402
from tiered.models.moe import expert_forward  # noqa: E402

WIDTHS = {"Mixtral": (4096, 14336), "OLMoE": (2048, 1024)}
MOE_SHAPE = dict(layers=8, hidden=1024, ffn=3584, experts=8, vocab=8192)  # planner_validation's dummy


def expert_rows(ext, width: str, rows_list, repeats: int) -> list[dict]:
    """ms an expert, native and torch, at each row count over cold bf16 experts of `width`."""
    D, F = WIDTHS[width]
    nbytes = 3 * D * F * 2
    n = cold_copies(max(256 << 20, 3 * (last_level_cache_bytes() or 32 << 20)), nbytes)
    first = random_expert(D, F, torch.Generator().manual_seed(0))
    slots = [tuple(t.clone() for t in first) for _ in range(n)]
    out = []
    for rows in rows_list:
        x = torch.randn(rows, D).to(torch.bfloat16)
        bounds = list(range(0, rows, 8)) + [rows]

        def native(s) -> None:
            if rows <= 8:
                ext.bf16_expert_forward(*s, x)
            else:
                ext.bf16_experts_forward_group([w for _ in bounds[1:] for w in s], x, bounds)

        times = {"native": [], "torch": []}
        with torch.inference_mode():
            for r in range(repeats + 1):  # the first sweep of each: a warm-up
                for name, fn in (("native", native), ("torch", lambda s: expert_forward(x, *s))):
                    t = time.perf_counter()
                    for s in slots:
                        fn(s)
                    if r:
                        times[name].append((time.perf_counter() - t) / len(slots))
        nat, tor = median(times["native"]), median(times["torch"])
        out.append({"table": "experts", "width": width, "rows": rows, "native_ms": 1e3 * nat, "torch_ms": 1e3 * tor,
                    "speedup": nat / tor})
        print(f"{width} {rows} rows: native {1e3 * nat:.2f} ms, torch {1e3 * tor:.2f} ms", flush=True)
    return out


def prefill_rows(workdir: Path, prompts, repeats: int) -> list[dict]:
    """TTFT of each prompt length with the tuned rows and with the built-in 32, engines alternated."""
    model = write_checkpoint(workdir / "mixtral-dummy", dtype=torch.bfloat16, **MOE_SHAPE)
    cfg = EngineConfig(dtype="bfloat16", decode_weights="bf16", accelerator="none", max_context=1024, plan="off")
    tuned = kernels.bf16_native_rows()
    engines = {}
    for rows in (tuned, tune.DEFAULTS["bf16_native_rows"]):
        kernels._applied["bf16_native_rows"] = rows  # this process's tuning, as load() applied it
        llm = LLM(str(model), cfg)
        fmt = llm.experts.fmt  # its rows read now (cached per format): each engine keeps its own
        assert (fmt.native_rows, fmt.grouped_rows) == (min(8, rows), rows if rows > 8 else 0)
        engines[rows] = llm
    kernels._applied["bf16_native_rows"] = tuned
    out = []
    try:
        for T in prompts:
            p = [(i * 7) % (MOE_SHAPE["vocab"] - 10) + 10 for i in range(T)]
            ttft = {r: [] for r in engines}
            for _ in range(repeats):
                for r, llm in engines.items():
                    llm.generate([p], SamplingParams(temperature=0, max_tokens=1))  # warm-up
                    ttft[r].append(llm.generate([p], SamplingParams(temperature=0, max_tokens=1))[0].stats.ttft_s)
            t_tuned, t_default = median(ttft[tuned]), median(ttft[tune.DEFAULTS["bf16_native_rows"]])
            out.append({"table": "prefill", "rows": T, "tuned_rows": tuned, "tuned_ms": 1e3 * t_tuned,
                        "default_ms": 1e3 * t_default, "speedup": t_default / t_tuned})
            print(f"prefill {T} tokens: tuned ({tuned} rows) {1e3 * t_tuned:.1f} ms, built-in 32 {1e3 * t_default:.1f} ms",
                  flush=True)
    finally:
        for llm in engines.values():
            llm.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--workdir", default=str(Path.home() / ".cache" / "tiered" / "bench"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="OLMoE width only, prompts of 16 and 32 tokens")
    args = ap.parse_args(argv)
    ext = kernels.load()
    if ext is None:
        sys.exit("cpu_expert_rows: the native kernels are not built (python -m tiered.kernels)")
    widths = ["OLMoE"] if args.quick else list(WIDTHS)
    rows = [r for w in widths for r in expert_rows(ext, w, (1, 2, 4, 8, 16, 32, 64), args.repeats)]
    rows += prefill_rows(Path(args.workdir), (16, 32) if args.quick else (16, 32, 64, 128, 512), args.repeats)
    write_report("cpu_expert_rows", args.out, title="bf16 CPU experts past one row: native kernel or torch GEMMs",
                 settings={"repeats": args.repeats, "quick": args.quick, "moe_shape": MOE_SHAPE,
                           "bf16_native_rows": kernels.bf16_native_rows(), "threads": torch.get_num_threads()},
                 rows=rows,
                 columns=[Column("table", "table"), Column("width", "width"), Column("rows / prompt tokens", "rows"),
                          Column("native ms", "native_ms", "{:.2f}"), Column("torch ms", "torch_ms", "{:.2f}"),
                          Column("tuned ms", "tuned_ms", "{:.1f}"), Column("built-in 32 ms", "default_ms", "{:.1f}"),
                          Column("speed-up", "speedup", "{:.2f}x")],
                 notes=["experts: native / torch time (above 1: torch faster); prefill: built-in / tuned time "
                        "(above 1: the tuned rows faster). Medians; the two sides alternate in one process."])


if __name__ == "__main__":
    main()
