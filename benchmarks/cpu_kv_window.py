"""CPU benchmark of the sliding layers' KV window (EngineConfig.sliding_kv): "window" against "full".

Gemma 3's local layers (5 of every 6) attend to their last 1024 positions only. With sliding_kv "window"
(the default) a KV cache in RAM hands the pages behind each sequence's window back to the OS
(models/layers.KVCache.forget) and the budget counts only the windows (memory/sizes.kv_cache_bytes); "full"
keeps every position (llama.cpp's --swa-full). On benchmarks/cpu_gemma3.py's dummy file (Gemma 3 4B's widths,
6 of its 34 layers, Q4_0), each mode in a process of its own:

  long prompt   a slot of a server's cache (LLM.kv_cache, prefix reuse as `tiered serve` runs it): a prompt of
                --prompt tokens, then --new-tokens greedy tokens: TTFT and decode tok/s (beside the plan's prices
                of them: LLM.predicted_ttft_at / predicted_decode_at), the cache's resident bytes
                at the end (mincore), the bytes its budget reserved, the process's peak RSS, and whether both
                modes drew the same tokens
  fitted        the context window the engine fits in each --budgets CPU budget when none is given
                (LLM._fitted_context halves the model's 131072 positions until the plan fits)

Usage:
    .venv/bin/python benchmarks/cpu_kv_window.py                 # 8192-token prompt, 64 new tokens
    .venv/bin/python benchmarks/cpu_kv_window.py --prompt 1024 --new-tokens 16 --budgets 2GiB --out /tmp/w
Results: benchmarks/results/cpu_kv_window.json and .md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

from tiered.bench import Column, PeakMemory, decode_tokens_per_s, write_report  # noqa: E402

MODES = ("full", "window")


def child(spec: dict) -> dict:
    """One mode's measurements (`spec`: the parent's settings and "mode")."""
    import torch

    import cpu_gemma3
    from tiered import LLM, EngineConfig, SamplingParams
    from tiered.engine.scheduler import Scheduler
    from tiered.hardware.budget import parse_bytes

    path, mode = cpu_gemma3.model_file(spec["layers"]), spec["mode"]
    P, N = spec["prompt"], spec["new_tokens"]
    torch.manual_seed(0)
    out = {"mode": mode}
    llm = LLM(path, EngineConfig(sliding_kv=mode, max_context=P + N + 64))
    ids = torch.randint(100, 40000, (P,)).tolist()
    with PeakMemory(cuda=False) as peak:
        sched, cache = Scheduler(max_batch=1, max_queue=1, prefix_reuse=True), llm.kv_cache(1)
        seq = llm.make_sequence(ids, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))
        sched.add(seq)
        t0 = time.perf_counter()
        while sched.has_work():
            llm.step(sched, cache, burst=True)
    out.update(ttft_s=seq.token_times[0] - t0, decode_tok_s=decode_tokens_per_s(seq.token_times),
               kv_resident_bytes=cache.resident_bytes(), kv_reserved_bytes=cache.held_bytes,
               kv_mapped_bytes=cache.nbytes, peak_rss_bytes=peak.rss_bytes, kv_window=llm.plan.kv_window,
               predicted_ttft_s=llm.predicted_ttft_at(P), predicted_decode_tok_s=llm.predicted_decode_at(P + N // 2),
               tokens_sha=hashlib.sha1(json.dumps(seq.output_ids).encode()).hexdigest()[:12])
    del cache, sched, llm
    fitted = {}
    for budget in spec["budgets"]:
        llm = LLM(path, EngineConfig(sliding_kv=mode, cpu_memory=parse_bytes(budget)))
        fitted[budget] = llm.max_context
        del llm
    out["fitted_context"] = fitted
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6, help="decoder layers at Gemma 3 4B's widths (real: 34)")
    ap.add_argument("--prompt", type=int, default=8192, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--budgets", default="1.5GiB,2GiB,3GiB", help="comma list of CPU budgets for the fitted context")
    ap.add_argument("--out", default=str(HERE / "results" / "cpu_kv_window"), help="output path stem")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        Path(a.child[1]).write_text(json.dumps(child(json.loads(Path(a.child[0]).read_text()))))
        return 0
    import cpu_gemma3

    cpu_gemma3.model_file(a.layers)  # written once, before the children time anything
    settings = {"model": f"Gemma 3 4B widths, {a.layers} of 34 layers (dummy Q4_0)", "prompt": a.prompt,
                "new_tokens": a.new_tokens, "budgets": a.budgets.split(",")}
    rows = []
    for mode in MODES:
        spec = Path(f"{a.out}.{mode}.spec.json")
        result = Path(f"{a.out}.{mode}.result.json")
        spec.parent.mkdir(parents=True, exist_ok=True)
        spec.write_text(json.dumps(dict(settings, layers=a.layers, mode=mode)))
        p = subprocess.run([sys.executable, __file__, "--child", str(spec), str(result)], capture_output=True, text=True)
        rows.append(json.loads(result.read_text()) if p.returncode == 0 and result.exists()
                    else {"mode": mode, "error": (p.stderr or p.stdout)[-2000:]})
        spec.unlink(missing_ok=True)
        result.unlink(missing_ok=True)
    same = len({r.get("tokens_sha") for r in rows}) == 1 and all("error" not in r for r in rows)
    mib = "{:.0f} MiB"
    columns = [Column("sliding_kv", "mode"),
               Column("TTFT (s)", "ttft_s", "{:.2f}"),
               Column("priced", "predicted_ttft_s", "{:.2f}"),
               Column("decode tok/s", "decode_tok_s", "{:.1f}"),
               Column("priced", "predicted_decode_tok_s", "{:.1f}"),
               Column("KV resident", lambda r: r.get("kv_resident_bytes") and r["kv_resident_bytes"] / 2**20, mib),
               Column("KV reserved", lambda r: r.get("kv_reserved_bytes") and r["kv_reserved_bytes"] / 2**20, mib),
               Column("peak RSS", lambda r: r.get("peak_rss_bytes") and r["peak_rss_bytes"] / 2**20, mib)] + \
        [Column(f"context in {b}", lambda r, b=b: r.get("fitted_context", {}).get(b)) for b in settings["budgets"]]
    notes = [f"Greedy tokens {'identical' if same else 'DIFFER'} between the modes. KV resident: the cache's pages in "
             "RAM at the end (mincore); reserved: what the budget counts (KVCache.held_bytes); context in B: the "
             "context window the engine fits in a CPU budget of B when none is given (of the file's 131072)."]
    write_report(Path(a.out).name, Path(a.out).parent, title="KV cache of the sliding layers: window against full",
                 settings=settings, rows=rows, columns=columns, notes=notes)
    print(Path(f"{a.out}.md").read_text())
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
