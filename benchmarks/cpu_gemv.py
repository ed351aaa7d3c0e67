"""CPU GEMV micro-benchmark: torch's weight kernels vs tiered's own (tiered/kernels/csrc/gemv.cpp).

Per format (bf16, int8 per-row, int4 group 32) and decode shape [N, K] (SmolLM2, Mixtral and OLMoE
projections), one call y [B, N] = x [B, K] W^T at batch B, both kernels behind the same C++ Kernel
call (kernels.cpp's wrappers of torch's ops: `dense_kernel` = at::linear on bf16,
`int8pack_kernel` = aten._weight_int8pack_mm, `int4pack_kernel` = aten._weight_int4pack_mm_for_cpu;
ours: `bf16_kernel`, `int8_kernel`, `int4_kernel` on bf16 activations (format int4) and on int8-quantized
activations (format int4q8, act="q8")). Each timed sweep calls the next of `n`
distinct copies of the weight so that a sweep reads more than the last-level cache (DRAM figures, not
cache hits). GB/s = weight bytes / time; bandwidth is measured in the same run
(cpu_experts.Bandwidth, median of `repeats` readings).

Usage:
    .venv/bin/python benchmarks/cpu_gemv.py [--batches 1 4 8] [--repeats 5]
Results: benchmarks/results/cpu_gemv.json and .md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from benchmarks.cpu_experts import Bandwidth  # noqa: E402
from tiered.bench import Column, median, write_report  # noqa: E402
from tiered.kernels import load  # noqa: E402
from tiered.kernels.linear import int4_kernel, int4_tiled_kernel, plain_codes, tiled_codes, tiled_scales  # noqa: E402

SHAPES = {  # name -> (N out, K in)
    "smollm2 gate_up": (3072, 576), "smollm2 down": (576, 1536), "smollm2 qkv": (960, 576),
    "smollm2 o": (576, 576), "smollm2 lm_head": (49152, 576),
    "mixtral gate/up": (14336, 4096), "mixtral down": (4096, 14336),
    "olmoe gate/up": (1024, 2048), "olmoe down": (2048, 1024),
}
# int4 / int4q8: our kernel over the plain layout on bf16 / int8 activations; int4t / int4tq8: the same
# over the tiled layout (16 rows per SIMD vector)
FORMATS = ("bf16", "int8", "int4", "int4q8", "int4t", "int4tq8")
SWEEP_BYTES = 300e6  # > a 260 MB LLC


def kernels(ext, fmt: str, N: int, K: int, g: torch.Generator):
    """(torch-op kernel, our kernel) over one random weight [N, K] in `fmt` (same bytes)."""
    if fmt == "bf16":
        w = (torch.randn(N, K, generator=g) * 0.02).bfloat16()
        return ext.dense_kernel(w), ext.bf16_kernel(w)
    if fmt == "int8":
        q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
        s = (torch.rand(N, generator=g) * 1e-3).bfloat16()
        return ext.int8pack_kernel(q, s), ext.int8_kernel(q, s)
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.int32)
    sz = (torch.rand(K // 32, N, 2, generator=g) * 1e-2).bfloat16()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)

    act = "q8" if fmt.endswith("q8") else "bf16"
    if fmt.startswith("int4t"):
        return (ext.int4pack_kernel(packed, 32, sz, K, N),
                int4_tiled_kernel(tiled_codes(codes), tiled_scales(sz), act=act))
    return ext.int4pack_kernel(packed, 32, sz, K, N), int4_kernel(plain_codes(codes), sz, act=act)


def time_sweep(ks, x, repeats: int) -> float:
    """Median seconds per call over sweeps through the distinct kernels `ks`."""
    def sweep() -> float:
        t = time.perf_counter()
        for k in ks:
            k(x)
        return (time.perf_counter() - t) / len(ks)
    sweep(), sweep()  # first touches of fresh copies are page faults
    return median([sweep() for _ in range(repeats)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="names from SHAPES")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), help="names from FORMATS")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    ext = load()
    if ext is None:
        print("native extension unavailable: nothing to compare")
        return 1
    reading = Bandwidth(1 << 30)
    bw = median([reading() for _ in range(args.repeats)])
    del reading
    print(f"memory bandwidth (torch sum, 1 GiB, {torch.get_num_threads()} threads): {bw:.1f} GB/s; "
          f"ISA {ext.gemv_isa()} ({ext.cpu_isa()})")
    rows = []
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name in args.shapes:
            N, K = SHAPES[name]
            for fmt in args.formats:
                first = kernels(ext, fmt, N, K, g)
                nbytes = first[1].weight_bytes()
                n = max(2, int(SWEEP_BYTES // nbytes) + 1)
                pairs = [first] + [kernels(ext, fmt, N, K, g) for _ in range(n - 1)]
                theirs, ours = [p[0] for p in pairs], [p[1] for p in pairs]
                for B in args.batches:
                    x = torch.randn(B, K, generator=g)
                    st, so = time_sweep(theirs, x, args.repeats), time_sweep(ours, x, args.repeats)
                    row = {"shape": name, "N": N, "K": K, "format": fmt, "B": B, "weight_MB": nbytes / 1e6,
                           "copies": n, "torch_ms": st * 1e3, "torch_GBps": nbytes / st / 1e9,
                           "ours_ms": so * 1e3, "ours_GBps": nbytes / so / 1e9, "speedup": st / so,
                           "ours_pct": 100 * nbytes / so / 1e9 / bw}
                    rows.append(row)
                    print(f"{name:16s} {fmt} B={B}: torch {row['torch_ms']:.3f} ms {row['torch_GBps']:.1f} GB/s, "
                          f"ours {row['ours_ms']:.3f} ms {row['ours_GBps']:.1f} GB/s ({row['speedup']:.2f}x)")
                del theirs, ours, pairs, first  # free before the next format's copies
    cols = [Column("shape", "shape"), Column("N x K", "N", "{}"), Column("format", "format"), Column("B", "B", "{}"),
            Column("MB", "weight_MB", "{:.2f}"), Column("torch ms", "torch_ms", "{:.3f}"),
            Column("torch GB/s", "torch_GBps", "{:.1f}"), Column("ours ms", "ours_ms", "{:.3f}"),
            Column("ours GB/s", "ours_GBps", "{:.1f}"), Column("ours % of bw", "ours_pct", "{:.0f}%"),
            Column("speedup", "speedup", "{:.2f}x")]
    for r in rows:
        r["N"] = f"{r['N']} x {r['K']}"
    write_report("cpu_gemv", args.out, title="CPU GEMV: torch's weight kernels vs tiered's own (gemv.cpp)",
                 settings={"threads": torch.get_num_threads(), "repeats": args.repeats, "bandwidth_GBps": bw,
                           "isa": ext.gemv_isa(), "cpu_isa": ext.cpu_isa(), "sweep_bytes": SWEEP_BYTES},
                 rows=rows, columns=cols,
                 notes=[f"Memory bandwidth measured in the same run: {bw:.1f} GB/s (torch sum over 1 GiB).",
                        f"Our kernels ran the {ext.gemv_isa()} path (CPU: {ext.cpu_isa()}). Each timed sweep reads "
                        f"> {SWEEP_BYTES / 1e6:.0f} MB of distinct weight copies (DRAM, not cache).",
                        "int4: our kernel on bf16 activations (vdpbf16ps per group of 32); int4q8: the same weights, "
                        "our kernel on int8-quantized activations (vpdpbusd per 4 groups); int4t / int4tq8: the "
                        "same two over the tiled layout (16 rows per vector: vpmultishiftqb + vdpbf16ps / vpdpbusd); "
                        "all against torch's _weight_int4pack_mm_for_cpu (bf16 activations)."])
    return 0


if __name__ == "__main__":
    sys.exit(main())
