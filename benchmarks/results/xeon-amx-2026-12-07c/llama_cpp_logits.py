"""tiered against llama.cpp itself on a gemma3 GGUF: the tiny `gemma3_gguf` checkpoint (tests/fixtures.py) written as
llama.cpp's converter writes it (tests/gguf_writer.write_gemma3_gguf, no sliding_window_pattern key: llama.cpp's
every-6th rule), scored by both engines in fp32 (llama.cpp: its f16 KV cache), then tiered's model code with each
Gemma feature changed, to show how far a wrong reading would land. Run from the repository root:
    .venv/bin/python benchmarks/results/xeon-amx-2026-12-07c/llama_cpp_logits.py
"""
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, "tests")
import llama_cpp  # noqa: E402
import transformers  # noqa: E402

from fixtures import prompt_ids, write_tiny_checkpoint  # noqa: E402
from gguf_writer import write_gemma3_gguf  # noqa: E402
from test_gemma3 import _local_model_of  # noqa: E402
from tiered import LLM, EngineConfig  # noqa: E402
from tiered.checkpoint import open_checkpoint  # noqa: E402
from tiered.models.layers import KVCache, build_attention_metadata  # noqa: E402

tmp = Path(tempfile.mkdtemp())
hf_dir = write_tiny_checkpoint("gemma3_gguf", tmp / "hf")
hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
path = write_gemma3_gguf(hf, tmp / "g.gguf", pattern=False)
ids = prompt_ids(hf.config.vocab_size, 14, seed=7)
ours = LLM(str(path), EngineConfig(accelerator="none", dtype="float32", decode_weights="fp32")).logits(ids)
lm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
lm.eval(ids)
theirs = torch.tensor(np.array(lm.scores[:len(ids)]))
print("tiered engine vs llama.cpp: max rel", float((ours - theirs).abs().max() / theirs.abs().max()))


def logits(m) -> torch.Tensor:
    x = torch.tensor([ids])
    pos = torch.arange(x.shape[1])[None]
    meta = build_attention_metadata(m.rotary, pos, torch.tensor([0]), None)
    with torch.no_grad():
        return m(x, pos, torch.tensor([0]), KVCache(m.config, 1, 64, torch.float32), last_only=False, meta=meta)[0]


ck = open_checkpoint(path)
base = ck.config
for change in [dict(), dict(embed_scale=1.0), dict(query_pre_attn_scalar=24.0), dict(hidden_act="silu"),
               dict(local_rope_theta=1e6, rope_scaling=None), dict(local_layers=(0,))]:
    ck.config = replace(base, **change)
    got = logits(_local_model_of(ck))
    print("model code", change or "as read", "vs llama.cpp: max rel", float((got - theirs).abs().max() / theirs.abs().max()))
