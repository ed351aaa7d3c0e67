"""CPU dense benchmark on llama.cpp's Q4_K_M: tiered against llama.cpp on one Llama GGUF at batch 1.

Q4_K_M is the GGUF most people download. This writes a dummy-weight file at Llama-3-8B's layer
widths (tiered/bench/gguf_dense.py: hidden 4096, FFN 14336, 32 / 8 heads of 128; Q4_K matrices,
Q6_K for the output matrix and for attn_v / ffn_down in the layers llama.cpp's use_more_bits picks;
N layers of the real 32; SmolLM2's tokenizer copied in so that both engines load it as a real
model file), then runs benchmarks/cpu_dense.py's side-by-side harness on it: every engine in its
own worker process, interleaved rounds, prefill at 32 / 128 / 512 tokens, decode tok/s over 128
greedy tokens after a 32-token prompt, peak RSS, and the bandwidth bound from the bytes a token
reads.

    tiered-int4   tiered, EngineConfig() (the default engine): the Q4_K blocks repacked as int4
                  groups of 32, the Q6_K (Q5_K) tensors as stored (quant/kquant.py; see
                  quant/linear.GGUF_DECODE_KIND), decode in the native step
    llama.cpp     llama-cpp-python on the same file (mmap), same thread count

Usage:
    .venv/bin/python benchmarks/cpu_dense_q4km.py                 # 8 layers (~1.3 GB file)
    .venv/bin/python benchmarks/cpu_dense_q4km.py --layers 2 --quick --out /tmp/q4km
    .venv/bin/python benchmarks/cpu_dense_q4km.py --mix Q5_K_M    # llama.cpp's Q5_K_M mix of the same widths
    .venv/bin/python benchmarks/cpu_dense_q4km.py --mix IQ4_XS    # IQ4_XS (the output Q6_K): tiered's int8-g32 copies
Results: benchmarks/results/cpu_dense_q4km.json and .md (cpu_dense_q5km.* for Q5_K_M, cpu_dense_iq4xs.* for IQ4_XS).
The GGUF is cached under
~/.cache/tiered/bench/ (written once).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

import cpu_dense  # noqa: E402

from tiered.bench.gguf_dense import cached_dummy, llama3_8b, write_dummy_dense_gguf  # noqa: E402


def model_file(layers: int, mix: str = "Q4_K_M") -> Path:
    """The cached dummy Llama GGUF of `layers` layers in `mix` (Q4_K_M, or Q5_K_M: Q5_K where it has Q4_K; written
    when missing)."""
    shape = llama3_8b(layers)
    return cached_dummy(shape.tag(mix), lambda path, **kw: write_dummy_dense_gguf(path, shape, mix=mix, **kw))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mix = "Q4_K_M"
    if "--mix" in argv:  # Q5_K_M: the same widths in llama.cpp's next mix (Q5_K, Q6_K where Q4_K_M has it)
        i = argv.index("--mix")
        mix = argv[i + 1]
        del argv[i:i + 2]
    stem = "cpu_dense_q4km" if mix == "Q4_K_M" else f"cpu_dense_{mix.lower().replace('_', '')}"
    return cpu_dense.dummy_main(argv, doc=__doc__, layers=8, real=32, widths="Llama-3-8B", weights=mix,
                                out=str(HERE / "results" / stem), title=f"CPU dense benchmark on {mix}",
                                model_file=lambda layers: model_file(layers, mix))


if __name__ == "__main__":
    sys.exit(main())
