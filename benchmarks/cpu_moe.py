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
layer 0 dense; 8.9 GB in Q4_0), llama.cpp's current deepseek2 layout. With `--arch glm4moe` it is
GLM-4.5-Air's widths (tiered/bench/gguf_moe.glm45_air: hidden 4096, 96 / 8 heads of 128 with q/k/v
biases, RoPE over 64 features, layer 0 a dense FFN of 10944, the others 128 experts of 1408 top-8 with
sigmoid routing plus 1 shared expert; untied Q8_0 output), 4 of its 46 layers by default (1 dense + 3
MoE, 4.5 GB in Q4_0), llama.cpp's glm4moe layout. With `--arch gpt-oss` it is gpt-oss-20b's widths
(tiered/bench/gguf_moe.gpt_oss_20b: hidden 2880, 64 / 8 heads of 64 with q/k/v/o biases and sinks, a
window of 128 on the even layers, YaRN factor 32 over 4096, 32 experts of 2880 top-4 with a biased
router and biased experts; untied output) with ggml-org/gpt-oss-20b-GGUF's tensor types (Q8_0 attention,
embedding and output, MXFP4 experts, F32 router, norms and biases; --qtype Q4_0 makes the attention
Q4_0, the experts stay MXFP4), 4 of its 24 layers by default (2.1 GB), llama.cpp's gpt-oss layout; tiered's
default engine keeps the MXFP4 experts exactly (the mxfp4 kind where its kernels are built, else
int8-g32; the row is still named tiered-int4, the harness's name for EngineConfig()).

Usage:
    .venv/bin/python benchmarks/cpu_moe.py                 # 8 layers (2.9 GB file), ~6 min
    .venv/bin/python benchmarks/cpu_moe.py --arch deepseek2   # DeepSeek-V2-Lite (27 layers, 8.9 GB, ~7 min)
    .venv/bin/python benchmarks/cpu_moe.py --layers 4 --quick --out /tmp/cpu_moe
    .venv/bin/python benchmarks/cpu_moe.py --qtype Q8_0    # Q8_0 attention and experts (5.4 GB)
    .venv/bin/python benchmarks/cpu_moe.py --qtype Q4_K_M  # llama.cpp's Q4_K_M mix (also Q5_K_M, Q6_K, IQ4_XS)
    .venv/bin/python benchmarks/cpu_moe.py --arch glm4moe  # GLM-4.5-Air, 4 of 46 layers (4.5 GB)
    .venv/bin/python benchmarks/cpu_moe.py --arch gpt-oss  # gpt-oss-20b, 4 of 24 layers (2.1 GB)
Results: benchmarks/results/cpu_moe.json and cpu_moe.md (cpu_moe_q8_0.* with --qtype Q8_0; cpu_moe_deepseek.*,
cpu_moe_glm_air.*, cpu_moe_gpt_oss.* with --arch). The GGUF is cached under
~/.cache/tiered/bench/ (written once, ~20 s for 8 layers).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, NamedTuple

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

import cpu_dense  # noqa: E402

from tiered.bench.gguf_deepseek import deepseek_v2_lite, write_dummy_deepseek_gguf  # noqa: E402
from tiered.bench.gguf_moe import glm45_air, gpt_oss_20b, qwen3_30b_a3b, write_dummy_moe_gguf  # noqa: E402


class Arch(NamedTuple):
    """One --arch: the shape of N layers, its writer, the default layer count, the real model's name
    and layer count, the results stem, the default block type and the experts' own block type (None:
    the block type's)."""
    make: Callable
    write: Callable
    default_layers: int
    model: str
    real_layers: int
    stem: str
    qtype: str = "Q4_0"
    expert_qtype: str | None = None


ARCHS = {"qwen3moe": Arch(qwen3_30b_a3b, write_dummy_moe_gguf, 8, "Qwen3-30B-A3B", 48, "cpu_moe"),
         "deepseek2": Arch(deepseek_v2_lite, write_dummy_deepseek_gguf, 27, "DeepSeek-V2-Lite", 27, "cpu_moe_deepseek"),
         "glm4moe": Arch(glm45_air, write_dummy_moe_gguf, 4, "GLM-4.5-Air", 46, "cpu_moe_glm_air"),
         "gpt-oss": Arch(gpt_oss_20b, write_dummy_moe_gguf, 4, "gpt-oss-20b", 24, "cpu_moe_gpt_oss", "Q8_0", "MXFP4")}


def model_file(layers: int, qtype: str | None = None, arch: str = "qwen3moe") -> Path:
    """The cached dummy GGUF of `layers` layers of ARCHS[arch]'s model (written when missing); `qtype`
    None: the arch's default block type."""
    from tiered.checkpoint import default_model_path

    A = ARCHS[arch]
    qtype = qtype or A.qtype
    shape = A.make(layers)
    types = qtype if A.expert_qtype is None else f"{qtype}-{A.expert_qtype}"
    path = Path.home() / ".cache" / "tiered" / "bench" / f"{shape.tag(types)}-smollm2-tok-v3.gguf"
    if not path.exists():
        print(f"writing {path} ...", flush=True)
        tmp = path.with_suffix(".part")
        kw = {} if A.expert_qtype is None else {"expert_qtype": A.expert_qtype}
        A.write(tmp, shape, qtype=qtype, tokenizer_from=default_model_path(), **kw)
        tmp.rename(path)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3moe", choices=list(ARCHS),
                    help="qwen3moe: Qwen3-30B-A3B's widths; deepseek2: DeepSeek-V2-Lite's (latent attention); "
                         "glm4moe: GLM-4.5-Air's; gpt-oss: gpt-oss-20b's (MXFP4 experts)")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers (default: 8 of Qwen3-30B-A3B's 48; all 27 of DeepSeek-V2-Lite's, the only "
                         "count llama.cpp reads its layout at; 4 of GLM-4.5-Air's 46; 4 of gpt-oss-20b's 24)")
    ap.add_argument("--engines", default="tiered-int4,llama.cpp")
    ap.add_argument("--qtype", default=None, choices=["Q4_0", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS"],
                    help="block type of attention and experts (default Q4_0; gpt-oss: of attention, default Q8_0, "
                         "the experts MXFP4); qwen3moe also takes llama.cpp's k-quant mixes Q4_K_M, Q5_K_M, Q6_K and "
                         "IQ4_XS (tiered/bench/gguf_moe.K_MIXES: each tensor by llama.cpp's rule)")
    ap.add_argument("--out", default=None, help="output path stem (.json / .md added; default results/cpu_moe, "
                                                 "results/cpu_moe_q8_0 for Q8_0, results/cpu_moe_deepseek, "
                                                 "results/cpu_moe_glm_air, results/cpu_moe_gpt_oss by --arch)")
    a, rest = ap.parse_known_args(argv)
    A = ARCHS[a.arch]
    a.layers = a.layers or A.default_layers
    a.qtype = a.qtype or A.qtype
    path = model_file(a.layers, a.qtype, a.arch)
    types = a.qtype if A.expert_qtype is None else f"{a.qtype} attention, {A.expert_qtype} experts"
    name = f"{A.model} widths, {a.layers} of {A.real_layers} layers (dummy {types} weights)"
    a.out = a.out or str(HERE / "results" / (A.stem if a.qtype == A.qtype else f"{A.stem}_{a.qtype.lower()}"))
    return cpu_dense.main(["--model", str(path), "--name", name, "--engines", a.engines, "--out", a.out,
                           "--title", f"CPU MoE benchmark: {name}, at batch 1"] + rest)


if __name__ == "__main__":
    sys.exit(main())
