"""A DeepSeek-V2-Lite-shaped MoE (multi-head latent attention, 64 routed experts of 1408, top-6, 2 shared
experts) on the CPU: tiered against transformers on the same checkpoint, same process.

The checkpoint is a dummy of DeepSeek-V2-Lite's real widths (hidden 2048, 16 heads, KV latent 512 + RoPE
key 64, vocabulary 102400, YaRN RoPE as the released config) with the first `--layers` of its 27 layers
(layer 0 dense, FFN 10944, as `first_k_dense_replace` 1), written once in bf16 as transformers'
`deepseek_v2` names it (config.json + model.safetensors; random weights, std 0.02; routers 0.1 so tokens
spread over the experts). Rows:

- tiered in bf16 (`dtype="bfloat16"`: the checkpoint's experts as they are, bf16 decode copies of the
  attention and dense FFN projections, the native CPU kernels), every weight in RAM;
- tiered, experts on disk: `cpu_memory` = twice the non-expert bf16 bytes + a third of the experts'
  bytes, the rest read per step (page cache dropped before each run);
- transformers `generate` in bf16 (its default eager MoE loop), the same prompt;
- tiered on the checkpoint converted to DeepSeek-V3's release format, block-scaled fp8
  (`tiered.bench.checkpoint.write_fp8_checkpoint`: every decoder projection e4m3 with a scale per
  128 x 128 block): the routed experts kept in fp8 as stored (tiered's native fp8 kernel), the rest
  dequantized to bf16. Against the transformers row: transformers on a CPU dequantizes an fp8
  checkpoint to bf16 at load, so it computes what that row computes (and it refuses this one: its
  dequantization derives the block from the scale grid, and V2-Lite's 576-row kv_a_proj_with_mqa and
  10944-wide dense FFN are not whole blocks).

Each: TTFT of a `--prompt-tokens` prompt, decode tokens/s over `--new-tokens` (median of `--repeats`), peak
KV-cache bytes per token, and whether the greedy tokens equal transformers'. Results:
benchmarks/results/deepseek_moe.{json,md}.

    python benchmarks/deepseek_moe.py
    python benchmarks/deepseek_moe.py --quick --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from tiered import LLM, EngineConfig, SamplingParams  # noqa: E402
from tiered.bench import Column, median, write_report  # noqa: E402
from tiered.bench.checkpoint import DEEPSEEK_V2_LITE, write_dummy_deepseek_checkpoint  # noqa: E402
from tiered.bench.runners import free_memory  # noqa: E402
from tiered.hardware.budget import format_bytes  # noqa: E402
from tiered.memory.expert_store import drop_page_cache  # noqa: E402

QUICK = dict(hidden_size=512, intermediate_size=2048, moe_intermediate_size=352, num_attention_heads=4,
             num_key_value_heads=4, n_routed_experts=16, vocab_size=8192, kv_lora_rank=128, qk_nope_head_dim=32,
             qk_rope_head_dim=16, v_head_dim=32, bos_token_id=0, eos_token_id=1)


def write_checkpoint(path: Path, layers: int, quick: bool) -> Path:
    """The dummy DeepSeek-V2-Lite-shaped checkpoint in `path` (written once; bf16, transformers' names)."""
    return write_dummy_deepseek_checkpoint(path, {**DEEPSEEK_V2_LITE, **(QUICK if quick else {}),
                                                  "num_hidden_layers": layers})


def fp8_checkpoint(path: Path) -> Path:
    """`path` converted to block-scaled fp8 beside it (written once)."""
    from tiered.bench.checkpoint import write_fp8_checkpoint

    return write_fp8_checkpoint(path, path.with_name(path.name + "-fp8"))


def run_tiered(path: Path, config: EngineConfig, prompt: list[int], new_tokens: int, repeats: int,
               before=None) -> dict:
    llm = LLM(path, config)
    try:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        llm.generate([prompt[:8]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # warm-up
        ttft, decode, tokens = [], [], None
        for _ in range(repeats):
            if before is not None:
                before()
            out = llm.generate([prompt], params)[0]
            ttft.append(out.stats.ttft_s)
            decode.append(out.stats.decode_tokens_per_s)
            tokens = out.token_ids
        kv = llm.config.kv_elements_per_token() * llm.config.num_hidden_layers * 2  # bf16 cache
        return {"ttft_s": median(ttft), "decode_tokens_per_s": median(decode), "ttft_runs": ttft,
                "decode_runs": decode, "tokens": tokens, "kv_bytes_per_token": kv,
                "predicted_decode_tokens_per_s": llm.plan.predicted_decode_tokens_per_s}
    finally:
        llm.close()
        free_memory()


def run_hf(path: Path, prompt: list[int], new_tokens: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    x = torch.tensor([prompt])
    try:
        ttft, decode, tokens = [], [], None

        def gen(k):  # seconds of a k-token greedy generate, and its tokens
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=k,
                                     min_new_tokens=k, eos_token_id=None, pad_token_id=0)
                return time.perf_counter() - t0, out[0, len(prompt):].tolist()

        gen(2)  # warm-up
        short = max(1, new_tokens // 4)
        for _ in range(repeats):
            t1, _ = gen(1)  # TTFT: the prompt's forward and its first token
            ts, _ = gen(short)
            tn, tokens = gen(new_tokens)
            ttft.append(t1)
            decode.append((new_tokens - short) / max(tn - ts, 1e-9))  # the same prefill in both
        cfg = model.config
        kv = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2  # its cache holds the latents too
        return {"ttft_s": median(ttft), "decode_tokens_per_s": median(decode), "ttft_runs": ttft, "decode_runs": decode,
                "tokens": tokens, "kv_bytes_per_token": kv}
    finally:
        del model
        free_memory()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="narrow widths (16 experts of 352), 3 layers, one repeat")
    ap.add_argument("--layers", type=int, default=None, help="layers of the 27 (default 4: one dense, three MoE)")
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/tiered/bench"))
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 64)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--engines", default="tiered,tiered_disk,transformers,tiered_fp8")
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args()
    layers = args.layers or (3 if args.quick else 4)
    new_tokens = args.new_tokens or (16 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 3)
    engines = args.engines.split(",")
    name = f"deepseek-v2-lite-dummy-L{layers}" + ("-quick" if args.quick else "")
    t0 = time.perf_counter()
    path = write_checkpoint(Path(args.workdir) / name, layers, args.quick)
    print(f"checkpoint {path} ready in {time.perf_counter() - t0:.1f} s", flush=True)
    size = (path / "model.safetensors").stat().st_size
    cfg = json.loads((path / "config.json").read_text())
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, min(cfg["vocab_size"], 100000), (args.prompt_tokens,), generator=g).tolist()
    context = args.prompt_tokens + new_tokens + 8
    experts = (3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * cfg["n_routed_experts"] * 2
               * (layers - cfg["first_k_dense_replace"]))
    # room for every non-expert weight (twice its bf16 bytes: the CPU computes the embedding and norms in
    # fp32 beside the decode copies) and a third of the experts' bytes
    cpu_mem = 2 * (size - experts) + experts // 3
    rows: list[dict] = []
    if "tiered" in engines:
        rows.append({"engine": "tiered", "setting": "bf16, every weight in RAM",
                     **run_tiered(path, EngineConfig(dtype="bfloat16", max_context=context), prompt, new_tokens,
                                 repeats)})
        print(rows[-1]["engine"], rows[-1]["setting"], rows[-1]["decode_tokens_per_s"], flush=True)
    if "tiered_disk" in engines:
        rows.append({"engine": "tiered", "setting": f"experts on disk, --cpu-mem {format_bytes(cpu_mem)}",
                     **run_tiered(path, EngineConfig(dtype="bfloat16", max_context=context, cpu_memory=cpu_mem,
                                                           accelerator="none"),
                                  prompt, new_tokens, repeats, before=lambda: drop_page_cache([str(path / "model.safetensors")]))})
        print(rows[-1]["engine"], rows[-1]["setting"], rows[-1]["decode_tokens_per_s"], flush=True)
    if "transformers" in engines:
        rows.append({"engine": "transformers", "setting": "bf16, every weight in RAM",
                     **run_hf(path, prompt, new_tokens, repeats)})
        print(rows[-1]["engine"], rows[-1]["setting"], rows[-1]["decode_tokens_per_s"], flush=True)
    fp8 = fp8_checkpoint(path) if "tiered_fp8" in engines else None
    if fp8 is not None:
        rows.append({"engine": "tiered", "checkpoint": "fp8", "setting": "experts fp8 as stored, every weight in RAM",
                     **run_tiered(fp8, EngineConfig(dtype="bfloat16", max_context=context), prompt, new_tokens,
                                 repeats)})
        print(rows[-1]["engine"], rows[-1]["setting"], rows[-1]["decode_tokens_per_s"], flush=True)
    hf = next((r for r in rows if r["engine"] == "transformers"), None)
    for r in rows:
        r.setdefault("checkpoint", "bf16")
        if r["engine"] == "tiered" and hf is not None:
            r["decode_speedup"] = r["decode_tokens_per_s"] / hf["decode_tokens_per_s"]
            r["ttft_speedup"] = hf["ttft_s"] / r["ttft_s"]
            same = 0
            for a, b in zip(r["tokens"], hf["tokens"]):
                if a != b:
                    break
                same += 1
            r["same_tokens"] = same
    columns = [Column("engine", "engine"), Column("checkpoint", "checkpoint"), Column("setting", "setting"),
               Column("decode tok/s", "decode_tokens_per_s", "{:.2f}"), Column("vs transformers", "decode_speedup", "{:.2f}x"),
               Column("plan's prediction", "predicted_decode_tokens_per_s", "{:.1f}"),
               Column(f"TTFT s ({args.prompt_tokens} tokens)", "ttft_s", "{:.3f}"),
               Column("TTFT vs transformers", "ttft_speedup", "{:.2f}x"),
               Column("KV bytes/token", "kv_bytes_per_token", "{:,}"),
               Column("greedy tokens equal to transformers' (first)", "same_tokens")]
    shape = {**DEEPSEEK_V2_LITE, **(QUICK if args.quick else {}), "num_hidden_layers": layers}
    settings = {"shape": shape, "checkpoint_bytes": size, "prompt_tokens": args.prompt_tokens,
                "fp8_checkpoint_bytes": sum(f.stat().st_size for f in fp8.glob("*.safetensors")) if fp8 else None,
                "new_tokens": new_tokens, "repeats": repeats, "cpu_memory_disk_row": cpu_mem,
                "threads": torch.get_num_threads()}
    notes = [f"Checkpoint: DeepSeek-V2-Lite's widths, {layers} of its 27 layers (layer 0 dense), dummy bf16 weights, "
             f"{format_bytes(size)}" + (f"; its fp8 conversion {format_bytes(settings['fp8_checkpoint_bytes'])}" if fp8 else "")
             + ". Both engines in this process, one after the other. transformers on a CPU dequantizes an fp8 "
             "checkpoint to bf16 at load: its bf16 row is what it would compute from the fp8 one.",
             "decode tok/s: tokens after the first over their time (tiered: its RequestStats; transformers: "
             f"the extra tokens of a {new_tokens}-token generate over a {max(1, new_tokens // 4)}-token one, both "
             f"with the same prefill); TTFT: the prompt's prefill and first token; median of {repeats}.",
             "KV bytes/token: the bf16 KV cache per position over all layers; both engines cache MLA's latent "
             "(512 + 64 per layer), not per-head keys and values (16 x (192 + 128)).",
             "Greedy tokens: how many of the first generated tokens equal transformers' (both bf16; the "
             "kernels round differently, so they may part). The fp8 row's weights are the bf16 ones rounded to "
             "fp8, so its tokens are not expected to match."]
    for r in rows:
        r.pop("tokens", None)
    _, md = write_report("deepseek_moe_quick" if args.quick else "deepseek_moe", args.out,
                         title="DeepSeek-V2-Lite-shaped MoE on the CPU", settings=settings, rows=rows,
                         columns=columns, notes=notes)
    print(md.read_text())


if __name__ == "__main__":
    main()
