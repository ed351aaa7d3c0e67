"""Expert-cache policies on recorded routing traces: random, LRU, LFU, LHU, FLD and HOBBIT's
weighted priority (Eq. 3), without and with prefetch, at a cache of a quarter of the experts.

Traces are recorded in this run (runtime/routing_trace.RoutingRecorder, the code behind
`tiered profile-experts --trace`) from the tiny MoE fixtures of tests/moe_fixtures.py (random
weights, 8 experts, top-2) and from the 4-layer Mixtral-shaped dummy checkpoint of
benchmarks/moe_offload.py --quick (skewed routing), each over 8 sequences of random prompt tokens.
They are replayed with tiered/memory/cache_sim.replay, the code behind `tiered cache-sim`, on the
held-out second half of the sequences; HOBBIT's weights are either uniform (0.25 each) or tuned on
the first half by grid search over the simplex (step 0.1, 286 points: gap H7). The baseline is LRU
on the same sequences; random is the median of 5 seeds. Miss penalty in bytes of the
bf16 experts, in seconds over the PCIe 4.0 H2D link of HOBBIT's testbed (preset rtx4090-pcie4).
Results: benchmarks/results/cache_sim.{json,md}; docs/cache_policies.md discusses them.

    python benchmarks/cache_sim.py
    python benchmarks/cache_sim.py --out /tmp/x      # without touching results/
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT.parent / "tests"))

from tiered import LLM, EngineConfig, SamplingParams  # noqa: E402
from tiered.bench import Column, write_report  # noqa: E402
from tiered.hardware.budget import format_bytes  # noqa: E402
from tiered.hardware.presets import get_preset  # noqa: E402
from tiered.memory.cache_sim import replay, tune_weights  # noqa: E402
from tiered.memory.expert_cache import POLICIES  # noqa: E402
from tiered.runtime.routing_trace import RoutingRecorder, prediction_accuracy  # noqa: E402

PRESET, LINK = "rtx4090-pcie4", "copy/h2d_pinned"


def record(model: Path, vocab: int, seqs: int, prompt_tokens: int, new_tokens: int, lookahead: int, dtype: str):
    """A routing trace of `seqs` sequences of random prompt tokens, decoded greedily one at a time."""
    llm = LLM(model, EngineConfig(dtype=dtype, decode_weights="fp32" if dtype == "float32" else "bf16", plan="off",
                                  max_context=prompt_tokens + new_tokens + 1))
    try:
        rec = RoutingRecorder(llm.model, llm.config, lookahead)
        rng = random.Random(0)
        for i in range(seqs):
            if i:
                rec.new_sequence()
            ids = [rng.randrange(2, vocab) for _ in range(prompt_tokens)]
            llm.generate([ids], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
        return rec.trace(model=model.name)
    finally:
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--lookahead", type=int, default=2)
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/tiered/bench"))
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args()
    from moe_fixtures import MOE_KINDS, VOCAB, make_moe_checkpoint

    from tiered.bench import write_dummy_checkpoint
    from moe_offload import mixtral_like

    link = get_preset(PRESET).model(LINK)
    bandwidth, latency = 1.0 / link.beta, link.alpha
    models = {}
    tmp = Path(tempfile.mkdtemp(prefix="cache_sim_"))
    for kind in MOE_KINDS:
        models[f"fixture {kind}"] = (make_moe_checkpoint(kind, tmp / kind), VOCAB, "float32")
    shape = mixtral_like(layers=4, hidden=512, ffn=1792, experts=8, vocab=4096)
    models["mixtral-dummy (4 layers, skewed)"] = (
        write_dummy_checkpoint(Path(args.workdir) / "mixtral-dummy-quick", shape, torch.bfloat16, 0), 4096, "bfloat16")
    rows, traces = [], {}
    for name, (path, vocab, dtype) in models.items():
        full = record(path, vocab, args.seqs, args.prompt_tokens, args.new_tokens, args.lookahead, dtype)
        calib, tr = full.select(range(args.seqs // 2)), full.select(range(args.seqs // 2, args.seqs))
        m = tr.meta
        total = len(m["moe_layers"]) * m["num_experts"]
        capacity = max(1, total // 4)
        acc = prediction_accuracy(tr)
        tuned, _ = tune_weights(calib, capacity)
        traces[name] = {"rows": len(full), "moe_layers": m["moe_layers"], "experts": m["num_experts"],
                        "capacity": capacity, "expert_bytes_bf16": m["expert_bytes"]["bf16"], "recall": acc,
                        "hobbit_tuned_weights": tuned}
        print(f"{name}: {len(full)} rows, capacity {capacity} of {total} experts, recall {acc}, tuned {tuned}", flush=True)
        base = None
        variants = [(p, p, None) for p in POLICIES] + [("hobbit", "hobbit (tuned)", tuned)]
        for policy, label, weights in variants:
            runs = {}
            for prefetch in (False, True):
                seeds = range(5) if policy == "random" else range(1)
                rs = [replay(tr, capacity, policy, prefetch=prefetch, bandwidth=bandwidth, latency=latency, seed=s,
                             weights=weights) for s in seeds]
                rs.sort(key=lambda r: r.penalty_bytes)
                runs[prefetch] = rs[len(rs) // 2]  # the median run (of 5 seeds for random)
            r, p = runs[False], runs[True]
            if policy == "lru":
                base = r.penalty_bytes
            rows.append({"model": name, "policy": label, "capacity": capacity, "uses": r.uses,
                         "hit_rate": r.hit_rate, "misses": r.misses, "penalty_bytes": r.penalty_bytes,
                         "penalty_s": r.penalty_s, "prefetch_hit_rate": p.hit_rate, "prefetch_misses": p.misses,
                         "prefetch_loads": p.prefetch_loads, "prefetch_useful": p.prefetch_useful,
                         "recall_1": acc.get(1), "recall_2": acc.get(2), "weights": weights})
        for row in rows:
            if row["model"] == name:
                row["penalty_vs_lru"] = row["penalty_bytes"] / base if base else None
    shutil.rmtree(tmp, ignore_errors=True)  # the fixture checkpoints
    columns = [Column("trace", "model"), Column("policy", "policy"), Column("slots", "capacity"),
               Column("hit rate", "hit_rate", "{:.1%}"), Column("misses", "misses"),
               Column("penalty", lambda r: format_bytes(r["penalty_bytes"])),
               Column("penalty ms", lambda r: r["penalty_s"] * 1e3, "{:.3f}"),
               Column("vs LRU", "penalty_vs_lru", "{:.2f}x"),
               Column("hit rate + prefetch", "prefetch_hit_rate", "{:.1%}"),
               Column("prefetch loads (useful)", lambda r: f"{r['prefetch_loads']} ({r['prefetch_useful']})")]
    settings = {"sequences": args.seqs, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                "lookahead": args.lookahead, "link": f"{PRESET} {LINK} ({bandwidth / 1e9:.1f} GB/s, {latency * 1e6:.1f} us)",
                "capacity": "a quarter of the model's experts", "split": "tuned on the first half of the sequences, "
                "measured on the second"}
    notes = ["Prediction recall per look-ahead distance (share of the experts a layer used that the stacked gates "
             "named r MoE layers earlier): " + "; ".join(
                 f"{n}: " + ", ".join(f"r={r} {a:.0%}" for r, a in t["recall"].items()) for n, t in traces.items()) + ".",
             "Prefetch columns assume a prefetched expert lands before its layer runs (an upper bound); the runtime "
             "(runtime/prefetch.py) keeps at most one load in flight per spare disk reader.",
             "HOBBIT weights (w_lru, w_lfu, w_lhu, w_fld) tuned on the calibration half: " + "; ".join(
                 f"{n}: {t['hobbit_tuned_weights']}" for n, t in traces.items()) + ".",
             "The policies' usage records reset per sequence (HOBBIT); the cached experts carry over."]
    _, md = write_report("cache_sim", args.out, title="Expert-cache policies on routing traces (cache-sim)",
                         settings=settings, rows=rows, columns=columns, notes=notes, extra={"traces": traces})
    print(md.read_text())


if __name__ == "__main__":
    main()
