"""Do CPU expert compute and H2D copies share the host's memory bandwidth? (CUDA machines)

Offloaded decode runs two streams out of host RAM at once: the CPU computes some experts (or a
dense FFN's CC slice) while the copy engine ships others over the link. The planner prices them as
independent. On the H200 (2026-11-26) a CC slice that streams ~93 GB/s alone ran at ~49 GB/s while
CG slices were copied beside it; this probe separates the two suspects:

  * the copy engine's reads take DRAM bandwidth from the cores (a shared ceiling), or
  * the thread waiting for the copy spins (`Stream.synchronize`) on a core the OpenMP team needs.

Rows, each over ~`--seconds` (medians of `--repeats` windows):
  cpu alone             native bf16 expert GEMV (batch 1) over `--experts` Mixtral-width experts
  h2d alone             pinned H2D copies of one expert-sized buffer, waited on a blocking event
  cpu + h2d (blocking)  both at once; the copy thread sleeps on a blocking event
  cpu + h2d (spin)      both at once; the copy thread waits with Stream.synchronize
  cpu (n-1 threads) + h2d (spin)   the OpenMP team one thread smaller
  cpu alone / cpu + h2d, pinned weights   the experts in pinned host memory, as tiered holds them (a CC
                        slice in pinned memory streamed ~39 GB/s in the 2026-11-26 dense run: 4 KiB pages?)
  ... huge-page weights pinned by cudaHostRegister   ordinary (THP-advised) memory page-locked in place:
                        the candidate fix, if the pinned rows are slow
  prompt expert (T tokens) ...   a prefill's CPU expert (--prompt-tokens, default 128): one expert again
                        (its weights hot, as gemm_big times them) or cycling (cold), alone and beside H2D
                        copies, on every thread and on all but one; ms an expert beside the GB/s

    python benchmarks/gpu_dram_share.py --out DIR     # a CUDA machine
    python benchmarks/gpu_dram_share.py --smoke --out DIR   # no GPU: host copies stand in for H2D

Writes DIR/gpu_dram_share.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

import torch

from tiered.bench.report import Column, write_report
from tiered.hardware.host_share import CpuLoop, measure
from tiered.hardware.profiler import random_expert


def make_experts(n: int, hidden: int, ffn: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """n experts (gate [F, D], up [F, D], down [D, F], bf16, small random values: profiler.random_expert)."""
    return [random_expert(hidden, ffn, torch.Generator().manual_seed(i)) for i in range(n)]


def registered_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of CPU tensor t in ordinary memory advised to transparent huge pages (MADV_HUGEPAGE
    before the first touch), then page-locked in place with cudaHostRegister: pinned like
    `pin_memory()`'s, but in the pages the CPU's own allocations get."""
    import ctypes
    import mmap

    nbytes = t.numel() * t.element_size()
    huge = 2 << 20
    raw = torch.empty(nbytes + huge, dtype=torch.uint8)
    start = (-raw.data_ptr()) % huge
    buf = raw[start:start + nbytes]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(nbytes), getattr(mmap, "MADV_HUGEPAGE", 14))
    out = buf.view(t.dtype).view(t.shape)
    out.copy_(t)
    err = torch.cuda.cudart().cudaHostRegister(out.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")
    out._keep = raw  # the allocation the view lives in
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--experts", type=int, default=6, help="Mixtral-width bf16 experts the CPU cycles through")
    ap.add_argument("--prompt-tokens", type=int, default=128,
                    help="tokens a layer's prompt expert gets in the prompt rows (a 512-token prompt, top-2 of 8: 128)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; host copies stand in for H2D")
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available() and not args.smoke
    hidden, ffn = (4096, 14336) if not args.smoke else (256, 512)
    if args.smoke:
        args.seconds, args.repeats, args.experts = 0.05, 1, 2
    experts = make_experts(args.experts, hidden, ffn)
    cpu = CpuLoop(experts, hidden)
    nbytes = cpu.bytes_per
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=cuda)
    src.fill_(1)
    dst = torch.empty_like(src, device="cuda") if cuda else torch.empty_like(src)
    cpu.rate(min(args.seconds, 0.5))  # warm-up: pages, kernels, clocks
    threads = torch.get_num_threads()
    configs = [
        ("cpu alone", dict(cpu=cpu, src=None, dst=None)),
        ("h2d alone", dict(cpu=None, src=src, dst=dst)),
        ("cpu + h2d, blocking wait", dict(cpu=cpu, src=src, dst=dst, blocking=True)),
        ("cpu + h2d, spinning wait", dict(cpu=cpu, src=src, dst=dst, blocking=False)),
        (f"cpu on {max(threads - 1, 1)} threads + h2d, spinning wait",
         dict(cpu=cpu, src=src, dst=dst, blocking=False, threads=max(threads - 1, 1))),
        (f"cpu on {max(threads - 1, 1)} threads alone", dict(cpu=cpu, src=None, dst=None, threads=max(threads - 1, 1))),
    ]
    # a prompt's CPU experts (the H100 of session 28: 14-33 ms at ~128 tokens in a forced-CPU prefill, 21-36 beside
    # copies, where the profile priced 12.5): the weights again and again (what gemm_big times) or cycled (as a
    # prefill meets them: beyond the last-level cache), alone and beside the copies of a balanced prefill
    T = args.prompt_tokens
    hot, cold = CpuLoop(experts[:1], hidden, T), CpuLoop(experts, hidden, T)
    cold.rate(0.0)  # warm-up: oneDNN's kernels for this shape
    configs += [(f"prompt expert ({T} tokens), one expert again", dict(cpu=hot, src=None, dst=None)),
                (f"prompt expert ({T} tokens), cycling the experts", dict(cpu=cold, src=None, dst=None)),
                (f"prompt expert ({T} tokens), cycling + h2d, blocking wait",
                 dict(cpu=cold, src=src, dst=dst, blocking=True)),
                (f"prompt expert ({T} tokens), cycling, {max(threads - 1, 1)} threads + h2d, blocking wait",
                 dict(cpu=cold, src=src, dst=dst, blocking=True, threads=max(threads - 1, 1)))]
    if cuda:  # the weights as tiered holds offloaded experts and CC slices: pinned (page-locked) host memory
        pinned = CpuLoop([tuple(t.pin_memory() for t in e) for e in experts], hidden)
        registered = CpuLoop([tuple(registered_copy(t) for t in e) for e in experts], hidden)
        configs += [("cpu alone, pinned weights", dict(cpu=pinned, src=None, dst=None)),
                    ("cpu + h2d, blocking wait, pinned weights", dict(cpu=pinned, src=src, dst=dst, blocking=True)),
                    ("cpu alone, huge-page weights pinned by cudaHostRegister", dict(cpu=registered, src=None, dst=None))]
        reg_src = registered_copy(src)
        configs += [("h2d alone from huge-page cudaHostRegister memory", dict(cpu=None, src=reg_src, dst=dst))]
    rows = []
    for name, kw in configs:
        runs = [measure(seconds=args.seconds, **kw) for _ in range(args.repeats)]
        row = {"config": name}
        for key in ("cpu_GBps", "h2d_GBps", "cpu_ms"):
            vals = [r[key] for r in runs if r[key] is not None]
            row[key] = statistics.median(vals) if vals else None
        row["total_GBps"] = (row["cpu_GBps"] or 0) + (row["h2d_GBps"] or 0)
        rows.append(row)
        print(f"{name}: cpu {row['cpu_GBps']}, h2d {row['h2d_GBps']}", flush=True)
    write_report("gpu_dram_share", args.out, title="CPU expert compute beside H2D copies: host bandwidth shared?",
                 settings={"hidden": hidden, "ffn": ffn, "experts": args.experts, "seconds": args.seconds,
                           "prompt_tokens": T,
                           "repeats": args.repeats, "torch_threads": threads, "cuda": cuda,
                           "native_kernels": cpu.fn is not None, "smoke": args.smoke},
                 rows=rows,
                 columns=[Column("configuration", "config"), Column("CPU expert GB/s", "cpu_GBps", "{:.1f}"),
                          Column("H2D GB/s", "h2d_GBps", "{:.1f}"), Column("sum GB/s", "total_GBps", "{:.1f}"),
                          Column("CPU ms an expert", "cpu_ms", "{:.2f}")],
                 notes=["CPU: single-token bf16 expert forwards (tiered's native kernel where built) cycling over "
                        "the experts (beyond the LLC); H2D: one expert-sized pinned buffer copied again and again "
                        "from another thread. Medians of the windows.",
                        f"Prompt rows: {T}-token bf16 expert forwards as the runtime runs them past its native rows "
                        "(three torch GEMMs); 'one expert again' keeps its weights in the last-level cache where they "
                        "fit, as the profile's gemm_big key times them, 'cycling' reads them from DRAM as a prefill "
                        "does."])


if __name__ == "__main__":
    main()
