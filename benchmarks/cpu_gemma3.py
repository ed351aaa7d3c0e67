"""CPU benchmark of Gemma 3: tiered against llama.cpp on one gemma3 GGUF at batch 1.

Gemma 3 (Google, 2025) is the dense family people run quantized on small machines (its QAT Q4_0 files). This
writes a dummy-weight file at Gemma 3 4B's layer widths (tiered/bench/gguf_dense.py: hidden 2560, FFN 10240, 8 /
4 heads of 256; Q4_0 projections, the tied embedding Q6_K; 5 of every 6 layers sliding over 1024 positions; N
layers of the real 34; SmolLM2's tokenizer copied in so that both engines load it as a real model file, which
makes the output matrix 49152 rows where Gemma's has 262208), then runs benchmarks/cpu_dense.py's side-by-side
harness on it: every engine in its own worker process, interleaved rounds, prefill at 32 / 128 / 512 tokens,
decode tok/s over 128 greedy tokens after a 32-token prompt, peak RSS, and the bandwidth bound.

    tiered-int4   tiered, EngineConfig() (the default engine): Q4_0 blocks as int4 decode copies, Gemma's layers in
                  the native decode step (sandwich norms, GeGLU, the sliding layers' own RoPE)
    llama.cpp     llama-cpp-python on the same file (mmap), same thread count

Usage:
    .venv/bin/python benchmarks/cpu_gemma3.py                 # 6 layers (~0.5 GB file)
    .venv/bin/python benchmarks/cpu_gemma3.py --layers 2 --quick --out /tmp/gemma3
Results: benchmarks/results/cpu_gemma3.json and .md. The GGUF is cached under ~/.cache/tiered/bench/ (written
once).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

import cpu_dense  # noqa: E402

from tiered.bench.gguf_dense import cached_dummy, gemma3_4b, write_dummy_gemma3_gguf  # noqa: E402


def model_file(layers: int) -> Path:
    """The cached dummy Gemma 3 4B-width Q4_0 GGUF of `layers` layers (written when missing)."""
    shape = gemma3_4b(layers)
    return cached_dummy(shape.tag("Q4_0", "gemma3"), lambda path, **kw: write_dummy_gemma3_gguf(path, shape, **kw))


def main(argv=None) -> int:
    return cpu_dense.dummy_main(argv, doc=__doc__, layers=6, real=34, widths="Gemma 3 4B", weights="Q4_0",
                                out=str(HERE / "results" / "cpu_gemma3"), title="CPU Gemma 3 benchmark",
                                model_file=model_file)


if __name__ == "__main__":
    sys.exit(main())
