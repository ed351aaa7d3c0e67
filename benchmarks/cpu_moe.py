"""CPU MoE benchmark: tiered against llama.cpp on one Qwen3-MoE GGUF at batch 1.

Users run fine-grained MoE models such as Qwen3-30B-A3B on CPUs with llama.cpp. This writes a
dummy-weight GGUF at Qwen3-30B-A3B's layer widths (tiered/bench/gguf_moe.py: hidden 2048, 32 / 4
heads of 128, per-head q/k norms, 128 experts of 768, top-8; Q4_0 attention and experts, the Q8_0
tied embedding; N layers of the real 48; SmolLM2's tokenizer copied in so that both engines load
it as a real model file), then runs benchmarks/cpu_dense.py's side-by-side harness on it: every
engine in its own worker process, interleaved rounds, prefill at 32 / 128 / 512 tokens, decode
tok/s over 128 greedy tokens after a 32-token prompt, peak RSS, and the bandwidth bound from the
weight bytes a token reads (top-8 of 128 experts per layer, the attention, the router, the output
matrix).

    tiered-int4   tiered, EngineConfig() (the default engine): experts kept as the file's blocks
                  repacked to the native kernels' tiled layout (Q4_0 -> int4, with --qtype Q8_0
                  -> int8-g32), all resident in RAM, decode in the native step
    llama.cpp     llama-cpp-python on the same file (mmap), same thread count

transformers is left out: it dequantizes a GGUF to fp32 / bf16 at load (4.8 GB of Q4_0 experts
would be 17 GB in bf16) and its MoE block loops over experts in Python.

With `--arch deepseek2` the file is DeepSeek-V2-Lite at its real widths and all 27 layers
(tiered/bench/gguf_deepseek.py: multi-head latent attention, 64 experts of 1408 top-6 plus 2 shared,
layer 0 dense; 8.9 GB in Q4_0), llama.cpp's current deepseek2 layout.

Usage:
    .venv/bin/python benchmarks/cpu_moe.py                 # 8 layers (2.9 GB file), ~6 min
    .venv/bin/python benchmarks/cpu_moe.py --arch deepseek2   # DeepSeek-V2-Lite (27 layers, 8.9 GB, ~7 min)
    .venv/bin/python benchmarks/cpu_moe.py --layers 4 --quick --out /tmp/cpu_moe
    .venv/bin/python benchmarks/cpu_moe.py --qtype Q8_0    # Q8_0 attention and experts (5.4 GB)
Results: benchmarks/results/cpu_moe.json and cpu_moe.md (cpu_moe_q8_0.* with --qtype Q8_0). The GGUF is cached under
~/.cache/tiered/bench/ (written once, ~20 s for 8 layers).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

import cpu_dense  # noqa: E402

from tiered.bench.gguf_deepseek import deepseek_v2_lite, write_dummy_deepseek_gguf  # noqa: E402
from tiered.bench.gguf_moe import qwen3_30b_a3b, write_dummy_moe_gguf  # noqa: E402


def model_file(layers: int, qtype: str = "Q4_0", arch: str = "qwen3moe") -> Path:
    """The cached dummy GGUF of `layers` layers: Qwen3-MoE, or DeepSeek-V2-Lite for arch "deepseek2"
    (written when missing)."""
    from tiered.checkpoint import default_model_path

    shape = deepseek_v2_lite(layers) if arch == "deepseek2" else qwen3_30b_a3b(layers)
    write = write_dummy_deepseek_gguf if arch == "deepseek2" else write_dummy_moe_gguf
    path = Path.home() / ".cache" / "tiered" / "bench" / f"{shape.tag(qtype)}-smollm2-tok-v3.gguf"
    if not path.exists():
        print(f"writing {path} ...", flush=True)
        tmp = path.with_suffix(".part")
        write(tmp, shape, qtype=qtype, tokenizer_from=default_model_path())
        tmp.rename(path)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3moe", choices=["qwen3moe", "deepseek2"],
                    help="qwen3moe: Qwen3-30B-A3B's widths; deepseek2: DeepSeek-V2-Lite's (latent attention)")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers (default: 8 of Qwen3-30B-A3B's 48; all 27 of DeepSeek-V2-Lite's, the only "
                         "count llama.cpp reads its layout at)")
    ap.add_argument("--engines", default="tiered-int4,llama.cpp")
    ap.add_argument("--qtype", default="Q4_0", choices=["Q4_0", "Q8_0"], help="block type of attention and experts")
    ap.add_argument("--out", default=None, help="output path stem (.json / .md added; default results/cpu_moe, "
                                                 "results/cpu_moe_q8_0 for Q8_0)")
    a, rest = ap.parse_known_args(argv)
    deepseek = a.arch == "deepseek2"
    a.layers = a.layers or (27 if deepseek else 8)
    path = model_file(a.layers, a.qtype, a.arch)
    name = (f"DeepSeek-V2-Lite widths, {a.layers} of 27 layers (dummy {a.qtype} weights)" if deepseek else
            f"Qwen3-30B-A3B widths, {a.layers} of 48 layers (dummy {a.qtype} weights)")
    stem = "cpu_moe_deepseek" if deepseek else "cpu_moe"
    a.out = a.out or str(HERE / "results" / (stem if a.qtype == "Q4_0" else f"{stem}_{a.qtype.lower()}"))
    return cpu_dense.main(["--model", str(path), "--name", name, "--engines", a.engines, "--out", a.out,
                           "--title", f"CPU MoE benchmark: {name}, at batch 1"] + rest)


if __name__ == "__main__":
    sys.exit(main())
