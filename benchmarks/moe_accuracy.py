"""Accuracy of the MoE runtime's expert precisions (issue 9 §4): KL divergence to the lossless model
of high-only (bf16), HOBBIT mixed bf16+int4 (T1=0.6, T2=0.9) and low-only (int4) experts, with the
share of expert loads at each precision, on the tiny MoE fixtures of the test suite. int4 experts
run twice: on bf16 activations and on int8 ones per group of 32 (`--expert-activations q8`,
llama.cpp's Q4_0 x Q8_0 numerics, the default on AVX-512), so the KL that the faster kernel adds shows.

Each fixture (tests/moe_fixtures.py: transformers' own Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE
classes at a tiny size, random weights, saved as safetensors) runs under an expert budget: every expert on
disk, a RAM cache of `--slots` slots (fewer than a layer's experts), so most expert uses are misses
and the mixed-precision loader decides their precision. The lossless reference keeps every weight
in fp32 with no budget. Scoring is teacher-forced decode (tiered.eval.decode_compare): the same
token sequence through both, prefill then one token per step, KL(P_ref || P) per step. Non-expert
weights stay fp32 in every setting, so the KL is the experts' alone. Deterministic: one run.

    python benchmarks/moe_accuracy.py                    # results/moe_accuracy.{json,md}
    python benchmarks/moe_accuracy.py --steps 16 --out /tmp/x
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT.parent / "tests"))

from moe_fixtures import MOE_KINDS, VOCAB, make_moe_checkpoint  # noqa: E402

from tiered import LLM, EngineConfig  # noqa: E402
from tiered.bench import Column, write_report  # noqa: E402
from tiered.eval import decode_compare  # noqa: E402

SETTINGS = {  # name -> (expert_weights, expert_low_weights, mixed_thresholds, expert_activations)
    "high-only (bf16)": ("bf16", None, None, "bf16"),
    "mixed bf16+int4 (T1=0.6, T2=0.9)": ("bf16", "int4", (0.6, 0.9), "bf16"),
    "low-only (int4)": ("int4", None, None, "bf16"),
    "low-only (int4, q8 activations)": ("int4", None, None, "q8"),
}


def budget_config(weights: str, low: str | None, thresholds, act: str, slots: int, context: int,
                  offload: str) -> EngineConfig:
    """Every expert on disk, `slots` RAM cache slots, the rest of the model fp32 (the runtime's rules);
    act: int4 experts' batch-1 activations."""
    return EngineConfig(dtype="float32", decode_weights="fp32", accelerator="none", plan="off", max_context=context,
                        expert_weights=weights, expert_low_weights=low, mixed_thresholds=thresholds or (0.6, 0.9),
                        expert_activations=act, batch_activations=act,
                        resident_experts=0, expert_cache_slots=slots, offload_dir=offload)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--steps", type=int, default=56, help="decode steps scored per fixture")
    ap.add_argument("--slots", type=int, default=2, help="expert cache slots (high precision)")
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in MOE_KINDS:
            path = make_moe_checkpoint(kind, Path(tmp) / kind)
            context = args.prompt_tokens + args.steps
            ref = LLM(path, EngineConfig(dtype="float32", decode_weights="fp32", accelerator="none", plan="off",
                                         max_context=context))
            ids = torch.randint(2, VOCAB, (context,), generator=torch.Generator().manual_seed(1)).tolist()
            others = {name: LLM(path, budget_config(*spec, args.slots, context, str(Path(tmp) / f"off-{kind}")))
                      for name, spec in SETTINGS.items()}
            kls = decode_compare(ref, others, ids, args.prompt_tokens)
            for name, llm in others.items():
                counts = dict(llm.experts.precision_counts)
                loads = counts.get("high", 0) + counts.get("low", 0) + counts.get("low hit", 0) + counts.get("skip", 0)
                one = SETTINGS[name][0]  # high-only / low-only: every miss in this one format
                k = kls[name]
                rows.append({"fixture": kind, "setting": name, "kl_mean": k.mean, "kl_max": k.max, "top1": k.top1,
                             "steps": k.tokens, "hit_rate": llm.experts.fast_hit_rate, "precision_counts": counts,
                             "high_share": counts.get("high", 0) / loads if loads else float(one == "bf16"),
                             "low_share": (counts.get("low", 0) + counts.get("low hit", 0)) / loads if loads
                             else float(one == "int4"),
                             "skip_share": counts.get("skip", 0) / loads if loads else 0.0})
                llm.close()
            ref.close()
            n = len(SETTINGS)
            trio = [r["kl_mean"] for r in rows[-n:-n + 3]]  # high-only, mixed, low-only on bf16 activations
            rows[-n + 1]["between"] = trio[0] <= trio[1] <= trio[2]
            print(kind, ", ".join(f"{r['setting']}: KL {r['kl_mean']:.2e}" for r in rows[-n:]), flush=True)
    columns = [Column("fixture", "fixture"), Column("experts", "setting"), Column("KL mean [nats]", "kl_mean", "{:.2e}"),
               Column("KL max [nats]", "kl_max", "{:.2e}"), Column("top-1 agree", "top1", "{:.1%}"),
               Column("misses loaded high / low / skipped", lambda r: f"{r['high_share']:.0%} / {r['low_share']:.0%} / "
                                                                       f"{r['skip_share']:.0%}"),
               Column("mixed between high and low", lambda r: ("yes" if r["between"] else "NO") if "between" in r else "")]
    settings = {"fixtures": list(MOE_KINDS), "prompt_tokens": args.prompt_tokens, "steps": args.steps,
                "cache_slots": args.slots}
    notes = ["Tiny MoE fixtures (tests/moe_fixtures.py, random weights), every expert on disk and "
             f"{args.slots} RAM cache slots; teacher-forced decode of {args.steps} steps after a "
             f"{args.prompt_tokens}-token prompt; KL(P_fp32 || P) per step against every weight in fp32 with no budget. "
             "Non-expert weights are fp32 in every setting. Activations: what the native kernels multiply int4 "
             "experts by (bf16: bf16 on AVX-512 with VBMI, int16 on AVX2 or where tuning picks it; q8: int8 per group of "
             "32), prompt and decode alike.",
             "Shares are of the expert uses that missed the high-precision tier: loaded at high precision, served at "
             "low precision (loaded, or a hit in the low pool), or skipped (HOBBIT Eq. 2 above T2). High-only and "
             "low-only load every miss in their one format. With mixed precision a hit in the high cache is served "
             "at high precision whatever the token's score."]
    _, md = write_report("moe_accuracy", args.out, title="MoE expert precisions: KL to lossless", settings=settings,
                         rows=rows, columns=columns, notes=notes)
    print(md.read_text())


if __name__ == "__main__":
    main()
