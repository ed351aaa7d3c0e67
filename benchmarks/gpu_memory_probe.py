"""What the GPU holds beyond tiered's budget: the peak of torch.cuda.max_memory_allocated, by allocation site.

On the H100 (benchmarks/results/gpu/2026-11-26-h100) the dense default plan under a 2 GiB budget peaked
at 2.37 GiB of allocated device memory, and the MoE default plan under 4 GiB at 4.09-4.14 GiB. The budget
counts every tensor tiered allocates (the stand-in's meter, hardware/standin.device_memory, says so);
what exceeds it is below tiered's Python code. This probe runs each configuration in its own process
(fresh allocator statistics) through a load, a 512-token TTFT and a 16-token decode, with the CUDA
caching allocator recording every allocation and its Python stack
(torch.cuda.memory._record_memory_history). It then replays the recorded events, finds the moment of
the peak, and groups the blocks live at that moment by their allocation site: the innermost frame
in tiered's own code, else the innermost Python frame.

    python benchmarks/gpu_memory_probe.py --out DIR [--profile PROFILE.json]
    python benchmarks/gpu_memory_probe.py --smoke --out DIR   # the host stand-in: its meter's peak only

Reuses benchmarks/gpu_offload.py's dummy checkpoints (written there first if missing). Writes
DIR/memory_probe.md and DIR/memory_probe.json.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

GiB = 2**30
MiB = 2**20
CONFIGS = {"dense_default": "dense", "moe_default": "moe"}


def site(frames: list[dict]) -> str:
    """An allocation's site: the innermost frame in tiered's code (file:line function), else the innermost
    Python frame, else "(no Python frame)". `frames` innermost first, as the allocator records them."""
    py = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    ours = [f for f in py if "/tiered/" in str(f.get("filename", "")) or "/benchmarks/" in str(f.get("filename", ""))]
    f = (ours or py or [None])[0]
    if f is None:
        return "(no Python frame)"
    name = str(f["filename"])
    short = name[name.rfind("/tiered/") + 1:] if "/tiered/" in name else Path(name).name
    return f"{short}:{f.get('line')} {f.get('name')}"


def peak_sites(events: list[dict], top: int = 15) -> dict:
    """Replay allocator events (alloc / free_completed, else free_requested) in order: the peak of live
    bytes and the live blocks at that moment grouped by `site` and stream, largest first."""
    free_action = "free_completed" if any(e.get("action") == "free_completed" for e in events) else "free_requested"
    live: dict[int, tuple[int, str, int]] = {}
    cur = peak = 0
    at_peak: dict[int, tuple[int, str, int]] = {}
    for e in events:
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = (e["size"], site(e.get("frames", [])), e.get("stream", 0))
            cur += e["size"]
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif action == free_action and e["addr"] in live:
            cur -= live.pop(e["addr"])[0]
    groups: dict[tuple[str, int], list[int]] = {}
    for size, where, stream in at_peak.values():
        g = groups.setdefault((where, stream), [0, 0])
        g[0] += size
        g[1] += 1
    rows = sorted(((b, n, w, s) for (w, s), (b, n) in groups.items()), reverse=True)[:top]
    return {"peak_bytes": peak, "events": len(events),
            "sites": [{"bytes": b, "blocks": n, "site": w, "stream": s} for b, n, w, s in rows]}


def child(name: str, a) -> dict:
    """One configuration's run in this process (a: the probe's options: profile, smoke)."""
    import torch

    from gpu_offload import probe_engine
    from tiered.bench.runners import TieredRunner

    smoke = a.smoke
    shape, model, cfg = probe_engine(CONFIGS[name], a.profile, smoke)
    budget = cfg.gpu_memory
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, shape.vocab, (32,), generator=g).tolist()
    long = torch.randint(3, shape.vocab, (64 if smoke else 512,), generator=g).tolist()
    cuda = torch.cuda.is_available() and not smoke
    result: dict = {"config": name, "budget_bytes": budget}
    if cuda:
        try:  # Python stacks of allocations only: C++ unwinding at every allocation would slow the run
            torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                     max_entries=500_000)
        except TypeError:  # an older signature
            torch.cuda.memory._record_memory_history(max_entries=500_000)
        torch.cuda.reset_peak_memory_stats()
    with contextlib.ExitStack() as stack:
        if not cuda:
            from tiered.hardware.standin import device_memory
            meter = stack.enter_context(device_memory())
        runner = TieredRunner(model, cfg)
        stack.callback(runner.close)
        llm = runner.llm
        if cuda:
            torch.cuda.synchronize()
            result["after_load"] = {"allocated": torch.cuda.memory_allocated(), "peak": torch.cuda.max_memory_allocated(),
                                    "reserved": torch.cuda.memory_reserved()}
        result["ttft_s"] = runner.ttft_s(long)
        result["decode_tokens_per_s"] = runner.decode_tokens_per_s(prompt, 16)
        result["budget"] = {"capacity": llm.fast_budget.capacity, "used": llm.fast_budget.used,
                            "peak": llm.fast_budget.peak, "workspace": llm.plan.workspace_bytes,
                            "plan_gpu": llm.plan.memory.get("gpu")}
        result["plan"] = llm.plan.summary()
        if cuda:
            torch.cuda.synchronize()
            result["max_memory_allocated"] = torch.cuda.max_memory_allocated()
            result["max_memory_reserved"] = torch.cuda.max_memory_reserved()
            snap = torch.cuda.memory._snapshot()
            events = [e for dev in snap.get("device_traces", []) for e in dev]
            result["replay"] = peak_sites(events)
            torch.cuda.memory._record_memory_history(enabled=None)
        else:
            result["max_memory_allocated"] = meter.peak
            result["replay"] = {"peak_bytes": meter.peak, "events": 0,
                                "sites": [{"bytes": b, "blocks": 1, "site": what, "stream": 0} for b, what in meter.largest]}
    if cuda:  # the engine closed (LLM.close: its cuBLAS workspaces dropped) and collected: what it left
        del runner, llm
        gc.collect()
        torch.cuda.synchronize()
        result["left_after_close"] = torch.cuda.memory_allocated()
    return result


def section(r: dict) -> list[str]:
    """The report's lines for one configuration's result."""
    b = r["budget"]
    lines = [f"plan: {r['plan']}", "",
             f"- budget {b['capacity'] / MiB:.1f} MiB; reserved at most {b['peak'] / MiB:.1f} MiB (workspace "
             f"{b['workspace'] / MiB:.1f}); peak allocated {r['max_memory_allocated'] / MiB:.1f} MiB "
             f"({(r['max_memory_allocated'] - b['capacity']) / MiB:+.1f} MiB against the budget)",
             f"- TTFT {r['ttft_s']:.3f} s, decode {r['decode_tokens_per_s']:.1f} tok/s"]
    if "after_load" in r:
        al = r["after_load"]
        lines += [f"- after the load: allocated {al['allocated'] / MiB:.1f} MiB, peak {al['peak'] / MiB:.1f}, "
                  f"reserved {al['reserved'] / MiB:.1f}; max reserved over the run "
                  f"{r['max_memory_reserved'] / MiB:.1f} MiB; still allocated after close "
                  f"{r.get('left_after_close', 0) / MiB:.1f} MiB"]
    rp = r["replay"]
    lines += ["", f"live at the replayed peak ({rp['peak_bytes'] / MiB:.1f} MiB, {rp['events']} events), by site:", "",
              "| MiB | blocks | stream | site |", "|---|---|---|---|"]
    return lines + [f"| {s['bytes'] / MiB:.1f} | {s['blocks']} | {s['stream']} | {s['site']} |" for s in rp["sites"]]


def main(argv: list[str] | None = None) -> int:
    from tiered.bench.child import probe_main

    return probe_main(__file__, __doc__, CONFIGS, child, "GPU memory beyond the budget: the allocator's peak by "
                      "allocation site", section, "memory_probe", argv)


if __name__ == "__main__":
    sys.exit(main())
