"""CPU expert micro-benchmark: one token through one SwiGLU expert, bf16 / int8 / int4, at batch 1.

Fiddler's CPU experts are a batch-1 GEMV over the expert's three matrices: bound by memory
bandwidth. This measures how close each weight format's kernel comes to that bound, on the calling
thread (where the engine runs CPU experts: runtime/install.py) and on a worker thread.

Expert forward, two paths:
  torch (the engine's decode kernels, runtime/cpu_decode.Kernel):
    gu = W_gate_up x   (one fused [2F, D] kernel);  y = W_down (silu(g) * u)
    bf16: F.linear on bf16 weights; int8: aten._weight_int8pack_mm (per-row scales);
    int4: aten._weight_int4pack_mm_for_cpu (group 32, bf16 scales and zeros).
  native (what ExpertFormat.forward runs on the CPU when the extension is loaded): the fused SwiGLU
    expert of tiered/kernels/csrc/gemv.cpp, one call from the expert's stored form (bf16 tensors,
    or the flat int8 / int4 "plain" slot with the zero residual), no Python between projections;
    int4 on int8-quantized activations (kernels/linear.EXPERT_INT4_ACT = "q8": vpdpbusd).
Each timed call goes to the next of `n` distinct experts so that the weights read exceed the
last-level cache (the numbers are DRAM figures, not cache hits). GB/s = weight bytes / time.
Bandwidth is measured in the same run (torch sum over a buffer of 4x the weights of one expert
set, or 1 GiB, whichever is larger, same thread count).

Usage:
    .venv/bin/python benchmarks/cpu_experts.py             # Mixtral-8x7B and OLMoE widths
    .venv/bin/python benchmarks/cpu_experts.py --quick     # OLMoE width only, fewer repeats
Results: benchmarks/results/cpu_experts.json and .md.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tiered.bench import Column, median, write_report  # noqa: E402
from tiered.quant.int4 import Int4Linear  # noqa: E402
from tiered.quant.int8 import Int8Linear  # noqa: E402
from tiered.kernels import load  # noqa: E402
from tiered.quant.experts import ExpertFormat  # noqa: E402
from tiered.runtime.cpu_decode import Kernel  # noqa: E402

WIDTHS = {"mixtral": (4096, 14336), "olmoe": (2048, 1024)}  # (hidden D, expert intermediate F)
FORMATS = ("bf16", "int8", "int4")
PATHS = ("torch", "native")


def make_native(gu: torch.Tensor, dn: torch.Tensor, Fi: int, fmt: str):
    """(x -> y callable, weight bytes) of the native fused expert over gate/up [2F, D], down [D, F]."""
    D = dn.shape[0]
    ef = ExpertFormat(fmt, ((Fi, D), (Fi, D), (D, Fi)), "tiled")  # the host layout with the extension built
    if ef.is_dense:
        slot = (gu[:Fi].bfloat16().contiguous(), gu[Fi:].bfloat16().contiguous(), dn.bfloat16().contiguous())
    else:
        slot = ef.empty()
        ef.quantize([gu[:Fi], gu[Fi:], dn], slot)
    return (lambda x: ef.forward(x, slot)), ef.nbytes


def make_expert(D: int, Fi: int, fmt: str, g: torch.Generator, path: str = "torch"):
    """(gate_up kernel [2F, D], down kernel [D, F], weight bytes) of one random expert in `fmt`;
    path "native": (fused expert callable, None, weight bytes)."""
    gu = torch.randn(2 * Fi, D, generator=g) * 0.02
    dn = torch.randn(D, Fi, generator=g) * 0.02
    if path == "native":
        fn, nbytes = make_native(gu, dn, Fi, fmt)
        return fn, None, nbytes
    if fmt == "bf16":
        mods = [torch.nn.Linear(D, 2 * Fi, bias=False), torch.nn.Linear(Fi, D, bias=False)]
        mods[0].weight.data, mods[1].weight.data = gu.bfloat16(), dn.bfloat16()
    elif fmt == "int8":
        mods = [Int8Linear.from_dense(gu), Int8Linear.from_dense(dn)]
    else:
        mods = [Int4Linear.from_dense(gu), Int4Linear.from_dense(dn)]
    nbytes = sum(t.numel() * t.element_size() for m in mods for t in list(m.parameters()) + list(m.buffers()))
    return Kernel(mods[0]), Kernel(mods[1]), nbytes


def expert_forward(gate_up, down, x: torch.Tensor, Fi: int) -> torch.Tensor:
    if down is None:  # the native fused expert
        return gate_up(x)
    gu = gate_up(x)
    return down(F.silu(gu[:, :Fi]) * gu[:, Fi:])


def bandwidth_gbps(nbytes: int, repeats: int) -> float:
    buf = torch.ones(nbytes // 4)
    buf.sum()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        ts.append(time.perf_counter() - t)
    return buf.numel() * 4 / median(ts) / 1e9


def measure(width: str, fmt: str, n_experts: int, repeats: int, pool: cf.ThreadPoolExecutor, path: str = "torch") -> dict:
    D, Fi = WIDTHS[width]
    g = torch.Generator().manual_seed(0)
    experts = [make_expert(D, Fi, fmt, g, path) for _ in range(n_experts)]
    nbytes = experts[0][2]
    x = torch.randn(1, D)
    row = {"width": width, "D": D, "F": Fi, "format": fmt, "path": path, "expert_MB": nbytes / 1e6,
           "experts_cycled": n_experts}
    with torch.inference_mode():
        def sweep() -> float:  # seconds per expert over one pass through all experts
            t = time.perf_counter()
            for gu, dn, _ in experts:
                expert_forward(gu, dn, x, Fi)
            return (time.perf_counter() - t) / len(experts)
        sweep()
        for where, run in (("calling", sweep), ("worker", lambda: pool.submit(sweep).result())):
            run()
            s = median([run() for _ in range(repeats)])
            row[f"{where}_ms"] = s * 1e3
            row[f"{where}_GBps"] = nbytes / s / 1e9
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="OLMoE width only, 3 repeats")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else args.repeats
    widths = ["olmoe"] if args.quick else list(WIDTHS)
    paths = PATHS if load() is not None else ("torch",)
    bw = bandwidth_gbps(1 << 30, repeats)
    print(f"memory bandwidth (torch sum, 1 GiB, {torch.get_num_threads()} threads): {bw:.1f} GB/s")
    rows = []
    with cf.ThreadPoolExecutor(1) as pool:
        pool.submit(torch.get_num_threads).result()
        for width in widths:
            D, Fi = WIDTHS[width]
            for fmt in FORMATS:
                per = 3 * D * Fi * {"bf16": 2, "int8": 1, "int4": 0.5625}[fmt]
                n = max(2, int(4 * 260e6 // per) + 1) if width == "olmoe" else 4  # > 4x a 260 MB LLC
                n = min(n, 256)
                for path in paths:
                    row = measure(width, fmt, n, repeats, pool, path)
                    for where in ("calling", "worker"):
                        row[f"{where}_pct"] = 100 * row[f"{where}_GBps"] / bw
                    rows.append(row)
                    print(f"{width} {fmt} {path}: {row['expert_MB']:.1f} MB, calling thread {row['calling_ms']:.2f} ms "
                          f"({row['calling_pct']:.0f}% of bw), worker {row['worker_ms']:.2f} ms ({row['worker_pct']:.0f}%)")
    best = {}
    for r in rows:
        key = (r["width"], r["format"])
        best[key] = max(best.get(key, 0), min(r["calling_pct"], r["worker_pct"]))
    met = all(v >= 80 for v in best.values())
    cols = [Column("width", "width"), Column("format", "format"), Column("path", "path"),
            Column("expert MB", "expert_MB", "{:.1f}"),
            Column("calling ms", "calling_ms", "{:.2f}"), Column("calling GB/s", "calling_GBps", "{:.1f}"),
            Column("calling % of bw", "calling_pct", "{:.0f}%"), Column("worker ms", "worker_ms", "{:.2f}"),
            Column("worker GB/s", "worker_GBps", "{:.1f}"), Column("worker % of bw", "worker_pct", "{:.0f}%")]
    write_report("cpu_experts", args.out, title="CPU expert forward at batch 1 (one token, one SwiGLU expert)",
                 settings={"threads": torch.get_num_threads(), "repeats": repeats, "bandwidth_GBps": bw,
                           "widths": {w: WIDTHS[w] for w in widths}, "paths": list(paths),
                           "native_isa": load().gemv_isa() if load() is not None else None},
                 rows=rows, columns=cols,
                 notes=[f"Memory bandwidth measured in the same run: {bw:.1f} GB/s (torch sum over 1 GiB).",
                        "Target (issue 11): every format >= 80% of the bandwidth on either thread (best path): "
                        + ("MET" if met else "NOT met") + "."])
    return 0


if __name__ == "__main__":
    sys.exit(main())
