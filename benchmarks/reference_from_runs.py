"""A reference file (tiered/planner/reference.py) from benchmarks/gpu_offload.py results: the rows a lent GPU
measured, as data the plans' predictions are replayed against (planner_validation.py's GPU tables,
tests/test_reference_*.py).

    python benchmarks/reference_from_runs.py RESULTS.json [RESULTS.json ...] --profile PROFILE.json \\
        --out benchmarks/reference/h100-2026-11-27/measured.json --source "..." --machine "..."

Each tiered row whose configuration make_plan can replay becomes a row: the default plan (graphed or
not), every miss forced one way, no GPU, the GPU unconstrained (graphed or not). The make_plan
arguments come from the run's own settings (its GPU budget, its prompt and generation lengths, its KV
room of twice the TTFT prompt), and the measured values are the row's medians. Rows the plans cannot
replay are left out and listed: plan off (the runtime's rules, no prediction), the pinning variants
(the same plan), the expert-profile row (its routing profile would have to be copied beside the file),
the transformers baselines and rows that failed. Rows of one configuration measured in several
results files keep the median of their medians, with the runs listed. The profile is copied beside the
file (`profile_quick.json`) unless it is there already. Every row is written comparable; mark the ones
the plans cannot price (a skewed routing's cache hits, a planner change since) by hand, with a note.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from tiered.bench.checkpoint import ModelShape  # noqa: E402

# row id -> (name suffix, make_plan arguments beyond the budget, keeps the GPU budget, accelerator)
REPLAYABLE = {
    "plan_auto": ("default plan", {"graphs": True}, True, None),
    "plan_auto_eager": ("default plan, eager (--graphs off)", {}, True, None),
    "forced_copy": ("every miss copied", {"dispatch_mode": "copy", "graphs": True}, True, None),
    "forced_cpu": ("every miss on the CPU", {"dispatch_mode": "cpu", "graphs": True}, True, None),
    "forced_split": ("every miss split by rows", {"dispatch_mode": "split", "graphs": True}, True, None),
    "forced_priced": ("misses as priced, no margins", {"dispatch_mode": "priced", "graphs": True}, True, None),
    "no_gpu": ("no GPU", {}, False, "none"),
    "unconstrained": ("unconstrained GPU", {"graphs": True}, False, None),
    "unconstrained_eager": ("unconstrained GPU, eager", {}, False, None),
}


def model_entry(shape: dict) -> tuple[str, dict]:
    """(the model's name in the reference, its config.json fields) from a results file's model_shapes entry."""
    s = ModelShape(**shape)
    cfg = {k: v for k, v in s.config_json().items() if k not in ("architectures", "torch_dtype")}
    name = (f"Mixtral-8x7B, {s.layers} layers" if s.is_moe else f"Llama-3-8B, {s.layers} layers")
    if s.hidden != 4096:
        name += f", hidden {s.hidden}"
    if s.is_moe and s.routing != "skewed":
        name += f", {s.routing} routing"
    return name, cfg


def build(results: list[dict], profile_name: str, source: str, machine: str) -> tuple[dict, list[str]]:
    """The reference file's content from gpu_offload.py results, and a line per row left out.

    Raises:
        ValueError: the results disagree on the prompt and generation lengths (one reference prices one
            method), or hold no replayable row.
    """
    methods = {(r["settings"]["ttft_tokens"], r["settings"]["decode_prompt_tokens"], r["settings"]["new_tokens"])
               for r in results}
    if len(methods) != 1:
        raise ValueError(f"the results were measured with different lengths {sorted(methods)}: one reference each")
    ttft, prompt, new = methods.pop()
    models, rows, skipped = {}, {}, []
    for res in results:
        settings = res["settings"]
        for r in res["rows"]:
            rid, shape = r.get("id"), r.get("shape")
            if rid not in REPLAYABLE or "error" in r or r.get("decode_tokens_per_s") is None:
                skipped.append(f"{shape} / {r.get('config', rid)}: " + ("failed" if "error" in r else "not replayable"))
                continue
            name, cfg = model_entry(res["model_shapes"][shape])
            models[name] = cfg
            label, extra, budget, accelerator = REPLAYABLE[rid]
            plan = dict(extra)
            if budget:
                plan["gpu_memory"] = settings["gpu_memory_bytes"][shape]
            key = (name, rid)
            row = rows.setdefault(key, {"name": f"{'MoE' if 'Mixtral' in name else 'dense'}, {label}", "model": name,
                                        "config": r.get("config", rid), "plan": plan, "runs": []})
            if accelerator:
                row["accelerator"] = accelerator
            row["runs"].append(r)
    if not rows:
        raise ValueError("no row of these results can be replayed")
    out_rows = []
    for row in rows.values():
        runs = row.pop("runs")
        decode = [r["decode_tokens_per_s"] for r in runs]
        ttfts = [r["ttft_s"] for r in runs]
        measured = {"decode_tokens_per_s": median(decode), "ttft_s": median(ttfts)}
        if len(runs) > 1:
            measured.update(decode_runs=decode, ttft_runs=ttfts)
        peak = [r["peak_gpu_gib"] for r in runs if r.get("peak_gpu_gib") is not None]
        if peak:
            measured["peak_gpu_gib"] = max(peak)
        hits = [r["hit_rate"] for r in runs if r.get("hit_rate") is not None]
        row["measured"] = measured
        row["note"] = (f"hit rate {', '.join(f'{h:.0%}' for h in hits)} measured; the plan: {runs[0].get('plan', '')}"
                       if hits else f"the plan: {runs[0].get('plan', '')}")
        out_rows.append(row)
    ref = {"source": source, "machine": machine, "profile": profile_name,
           "profile_source": "the profile the rows were planned with (gpu_offload.py --profile), copied beside this file",
           "method": (f"benchmarks/gpu_offload.py: each configuration in its own LLM in one process; warm-up, then TTFT "
                      f"of a {ttft}-token prompt, and decode = (N-1) / (t(N) - t(1)) for N = {new} new tokens after "
                      f"a {prompt}-token prompt (prefill excluded); bf16 dummy weights"),
           "context": f"max_context = {2 * ttft} (gpu_offload.py: 2 x the TTFT prompt), the engine's KV room",
           "plans": {"decode": {"prompt_tokens": prompt, "gen_tokens": new},
                     "ttft": {"prompt_tokens": ttft, "gen_tokens": new},
                     "all": {"context_tokens": 2 * ttft, "precision": "bf16", "goal": "latency"}},
           "library_workspace": None, "models": models, "rows": out_rows}
    return ref, skipped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", help="gpu_offload.py results JSON files (one machine, one method)")
    ap.add_argument("--profile", required=True, help="the HardwareProfile JSON the rows were planned with")
    ap.add_argument("--out", required=True, help="where to write measured.json (its folder gets the profile)")
    ap.add_argument("--source", required=True, help="where the numbers come from (device call, commit)")
    ap.add_argument("--machine", required=True, help="the machine, in words")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    profile = out.parent / "profile_quick.json"
    if Path(a.profile).resolve() != profile.resolve():
        shutil.copyfile(a.profile, profile)
    ref, skipped = build([json.loads(Path(p).read_text()) for p in a.results], profile.name, a.source, a.machine)
    out.write_text(json.dumps(ref, indent=1) + "\n")
    print(f"wrote {out}: {len(ref['rows'])} rows of {len(ref['models'])} models")
    for line in skipped:
        print(f"  left out: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
