"""Where an offloaded decode step's host time goes on a CUDA machine: the 34 ms stall of 2026-11-26.

On the H200 (shared/gpu-runs/2026-11-26-h200, section 3) every decode step of the default MoE and
dense plans spent 33-36 ms of host time inside layer 0's attention, and the dense plan's first two
CPU slices ran 3-4x slower than the rest; forcing every MoE miss onto the CPU (the same placement)
showed no such stall. This probe runs each configuration in its own process (so that OpenMP and
CUDA settings from the environment apply) and, for a few decode steps of each:

  * torch.profiler (CPU + CUDA activities): the ops and CUDA runtime calls with the most host time;
  * samples of every Python thread's innermost frame every 5 ms (Sampler): where the main thread
    waits, what the other threads do meanwhile, and late samples (a thread holding the GIL);
  * decode tok/s, with and without the profiler.

    python benchmarks/gpu_stall_probe.py --out DIR            # MoE and dense, default environment
    python benchmarks/gpu_stall_probe.py --env OMP_WAIT_POLICY=PASSIVE --out DIR

It reuses benchmarks/gpu_offload.py's dummy checkpoints (written there first if missing). Writes
DIR/stall_probe.md (the summary) and .json, DIR/stall_<config>.txt (the profiler table, the samples) and
DIR/stall_<config>.trace.json.gz (the profiled steps' timeline, every op and CUDA runtime call).
"""

from __future__ import annotations

import collections
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

GiB = 2**30
CONFIGS = {  # name -> (shape, EngineConfig fields beyond the base)
    "moe_resident_balanced": ("moe", dict(resident_experts=7, expert_cache_slots=0)),  # 7b56371's default plan
    "moe_resident_cpu": ("moe", dict(resident_experts=7, expert_cache_slots=0, force_expert_path="cpu")),
    "moe_default": ("moe", {}),
    "dense_default": ("dense", {}),
}


def child(name: str, a) -> dict:
    """One configuration's run in this process (a: the probe's options: out, profile, smoke)."""
    import torch
    from dataclasses import replace

    from gpu_offload import probe_engine
    from tiered.bench.runners import TieredRunner

    shape_name, extra = CONFIGS[name]
    out, smoke = Path(a.out), a.smoke
    shape, model, cfg = probe_engine(shape_name, a.profile, smoke)
    if smoke:
        extra = {k: (min(v, 2) if k == "resident_experts" else v) for k, v in extra.items()}
    cfg = replace(cfg, **extra)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, shape.vocab, (32,), generator=g).tolist()
    runner = TieredRunner(model, cfg)
    result = {"config": name}
    try:
        runner.ttft_s(torch.randint(3, shape.vocab, (512 if not smoke else 64,), generator=g).tolist())  # warm-up
        runner.decode_tokens_per_s(prompt, 4)
        result["decode_tokens_per_s"] = runner.decode_tokens_per_s(prompt, 16)
        # stack samples of every thread, every 5 ms, over one 16-token decode
        sampler = Sampler(0.005)
        with sampler:
            runner.decode_tokens_per_s(prompt, 16)
        result["samples"], result["gaps"] = sampler.summary()
        from torch.profiler import ProfilerActivity, profile as tprofile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with tprofile(activities=acts) as prof:
            result["decode_tokens_per_s_profiled"] = runner.decode_tokens_per_s(prompt, 9)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        trace = out / f"stall_{name}.trace.json"  # the profiled steps' timeline (chrome://tracing, Perfetto)
        prof.export_chrome_trace(str(trace))
        import gzip
        import shutil

        with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()
        (out / f"stall_{name}.txt").write_text(
            f"{json.dumps({k: v for k, v in result.items() if k not in ('samples', 'gaps')})}\n\n{table}\n\n"
            "stack samples (innermost frame per thread, every 5 ms):\n"
            + "\n".join(f"{n:5d}  {k}" for k, n in result["samples"])
            + "\n\nlate samples (the GIL held elsewhere), ms and each thread's frame after:\n"
            + "\n".join(f"{g:7.1f}  {json.dumps(w)}" for g, w in result["gaps"]) + "\n")
        result["top_ops"] = [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in
                             sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]]
        result["plan"] = runner.info().get("plan", "")
    finally:
        runner.close()
    return result


class Sampler:
    """Samples every Python thread's innermost frame from a thread of its own (sys._current_frames,
    under the GIL, so it is safe; faulthandler's watchdog dumps crashed the stand-in runs). A sample
    that comes late says that some thread held the GIL meanwhile: `gaps` lists those over 15 ms,
    with what each thread was doing right after."""

    def __init__(self, period: float) -> None:
        import threading

        self.period, self.samples = period, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-sampler", daemon=True)

    def _run(self) -> None:
        import threading

        me = threading.get_ident()
        main = threading.main_thread().ident
        names = {}
        last = time.perf_counter()
        while not self._stop.is_set():
            now = time.perf_counter()
            frames = sys._current_frames()
            if len(names) != len(frames):
                names = {t.ident: t.name for t in threading.enumerate()}
            where = {}
            for ident, f in frames.items():
                if ident == me:
                    continue
                who = "main" if ident == main else names.get(ident, hex(ident))
                where[who] = f"{Path(f.f_code.co_filename).name}:{f.f_lineno} in {f.f_code.co_name}"
            self.samples.append((now, now - last, where))
            last = now
            time.sleep(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, top: int = 25) -> tuple[list, list]:
        counts = collections.Counter(f"{who}: {frame}" for _, _, where in self.samples for who, frame in where.items()
                                     if not who.startswith("ThreadPoolExecutor") or "wait" not in frame)
        gaps = [(round(gap * 1e3, 1), where) for _, gap, where in self.samples if gap > 0.015]
        return counts.most_common(top), gaps[:20]


def section(r: dict) -> list[str]:
    """The report's lines for one configuration's result."""
    lines = [f"plan: {r.get('plan', '')}", "",
             f"decode {r['decode_tokens_per_s']:.1f} tok/s, under the profiler {r['decode_tokens_per_s_profiled']:.1f}",
             "", "ops with the most host time (ms over 9 tokens, calls):", ""]
    lines += [f"- {k}: {ms:.1f} ms, {n}" for k, ms, n in r["top_ops"]]
    lines += ["", "stack samples (innermost frame per thread, every 5 ms):", ""]
    lines += [f"- {n} x {k}" for k, n in r["samples"][:12]] + [""]
    lines += ["late samples (ms late: each thread's frame after):", ""]
    return lines + [f"- {g} ms: {w}" for g, w in r["gaps"][:8]]


def main(argv: list[str] | None = None) -> int:
    from tiered.bench.child import probe_main

    return probe_main(__file__, __doc__, CONFIGS, child, "Decode-step stall probe", section, "stall_probe", argv,
                      env_option=True)


if __name__ == "__main__":
    sys.exit(main())
