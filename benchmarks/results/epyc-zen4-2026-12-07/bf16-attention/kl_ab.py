"""SmolLM2 default engine, 1024 / 2048 tokens of SciPy's licence prose: next-token KL of the prompt path with a bf16
prompt's attention on AVX512-BF16 against the same engine without it (fp32 attention over the bf16 cache), and of
each against the lossless fp32 engine; argmax agreement."""
import os, sys, json
import torch
from tiered import LLM, EngineConfig, kernels
from tiered.eval import default_text_path, text_ids
from tiered.eval.kl import kl_divergence
ext = kernels.load()
prof = os.environ["PROFILE"]
from tiered.checkpoint import open_checkpoint, default_model_path
ids = text_ids(open_checkpoint(default_model_path()).tokenizer(), default_text_path())[:2048]
ref = LLM(None, EngineConfig(dtype="float32", decode_weights="fp32", max_context=4096, profile=prof))
llm = LLM(None, EngineConfig(max_context=4096, profile=prof))
print(llm.plan.dtypes)
res = {}
for n in (1024, 2048):
    p = ref.logits(ids[:n])
    out = {}
    for on in (True, False):
        ext.bf16_attention_avx512(on)
        out[on] = llm.logits(ids[:n], lossless=False)
    ext.bf16_attention_avx512(True)
    r = {"kl_on_vs_off": float(kl_divergence(out[False], out[True]).mean()),
         "kl_ref_on": float(kl_divergence(p, out[True]).mean()), "kl_ref_off": float(kl_divergence(p, out[False]).mean()),
         "top1_on_vs_off": float((out[True].argmax(-1) == out[False].argmax(-1)).float().mean())}
    res[n] = r
    print(n, r, flush=True)
json.dump(res, open("/tmp/s101/kl_ab.json", "w"), indent=1)
