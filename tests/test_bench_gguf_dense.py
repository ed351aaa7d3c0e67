"""tiered/bench/gguf_dense.py: the dummy Llama GGUF in llama.cpp's Q4_K_M mix that
benchmarks/cpu_dense_q4km.py compares engines on.

At tiny widths: the file is a real "llama" GGUF with llama.cpp's Q4_K_M types (Q6_K for the output
matrix and for attn_v / ffn_down in the use_more_bits layers), its K-quant blocks are well formed
(weights of the asked std, about centred), and tiered decodes it from int4 copies of the Q4_K
blocks beside the Q6_K ones as stored (quant/kquant.Q6KLinear), priced as a mix.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from tiered import LLM, EngineConfig, SamplingParams, kernels
from tiered.bench.gguf_dense import DenseShape, q4_k_m_type, random_k_blocks, write_dummy_dense_gguf
from tiered.quant.int4 import Int4Linear
from tiered.quant.int8 import Int8G32Linear
from tiered.quant.kquant import Q6KLinear


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_random_k_blocks_have_the_asked_spread(qtype):
    rng = np.random.default_rng(0)
    w = dequantize(random_k_blocks(rng, 64, 512, qtype, 0.02), GGMLQuantizationType[qtype]).reshape(64, 512)
    assert np.isfinite(w).all()
    assert abs(float(w.std()) - 0.02) < 0.002
    assert abs(float(w.mean())) < 0.02 * 0.05  # Q6_K's codes minus 32 lean -0.5 of 18.5: ~3% of the std
    with pytest.raises(ValueError, match="multiple of 256"):
        random_k_blocks(rng, 4, 96, qtype, 0.02)


def test_q4_k_m_types_follow_llama_cpp():
    """llama_tensor_get_type's use_more_bits for 8 layers: layers 0, 3, 6 and 7 get Q6_K attn_v / ffn_down."""
    more = [i for i in range(8) if q4_k_m_type(f"blk.{i}.ffn_down.weight", i, 8) == "Q6_K"]
    assert more == [0, 3, 6, 7]
    assert [q4_k_m_type(f"blk.{i}.attn_v.weight", i, 8) for i in (0, 1)] == ["Q6_K", "Q4_K"]
    assert q4_k_m_type("blk.0.ffn_up.weight", 0, 8) == "Q4_K" and q4_k_m_type("output.weight", -1, 8) == "Q6_K"


def test_dummy_q4_k_m_gguf_loads_and_decodes(tmp_path):
    shape = DenseShape(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, head_dim=64, vocab=512)
    path = write_dummy_dense_gguf(tmp_path / "tiny.gguf", shape)
    r = GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert r.fields["general.architecture"].contents() == "llama"
    # of 2 layers, use_more_bits picks layer 1 (the last eighth)
    assert types["blk.1.ffn_down.weight"] == types["blk.1.attn_v.weight"] == types["output.weight"] == "Q6_K"
    assert types["blk.0.ffn_down.weight"] == types["blk.0.ffn_gate.weight"] == types["token_embd.weight"] == "Q4_K"

    llm = LLM(path, EngineConfig(max_context=64, accelerator="none"))
    six = "q6k" if kernels.available() else "bf16"  # Q6_K's copies as stored (quant/linear.auto_kind)
    mix = llm.plan.precision_mix
    assert set(mix) == {"int4", six} and 0 < mix[six] < 0.5 and llm.plan.dtypes.get("lm_head") == six
    assert sum(isinstance(m, Int4Linear) for m in llm.model.modules()) >= 4
    # Q6_K v_proj and down_proj of layer 1, and the head
    assert sum(isinstance(m, Q6KLinear) for m in llm.model.modules()) == (3 if kernels.available() else 0)
    assert not any(isinstance(m, Int8G32Linear) for m in llm.model.modules())
    out = llm.generate([list(range(10, 30))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and all(0 <= t < 512 for t in out.token_ids)
    llm.close()


def test_dummy_q5_k_m_gguf_takes_its_blocks_as_stored(tmp_path):
    """The Q5_K_M mix (benchmarks/cpu_dense_q4km.py --mix Q5_K_M): Q5_K where Q4_K_M has Q4_K, its Q6_K tensors the
    same; tiered decodes both as stored (Q5KLinear, Q6KLinear), priced as a mix of q5k and q6k."""
    from tiered.quant.kquant import Q5KLinear

    shape = DenseShape(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, head_dim=64, vocab=512)
    path = write_dummy_dense_gguf(tmp_path / "tiny.gguf", shape, mix="Q5_K_M")
    r = GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.ffn_down.weight"] == types["token_embd.weight"] == "Q5_K" and types["output.weight"] == "Q6_K"
    assert int(r.fields["general.file_type"].contents()) == 17  # LLAMA_FTYPE_MOSTLY_Q5_K_M
    with pytest.raises(ValueError, match="mix must be"):
        write_dummy_dense_gguf(tmp_path / "x.gguf", shape, mix="Q3_K_S")
    llm = LLM(path, EngineConfig(max_context=64, accelerator="none"))
    if kernels.available():
        assert set(llm.plan.precision_mix) == {"q5k", "q6k"} and llm.plan.dtypes.get("lm_head") == "q6k"
        assert sum(isinstance(m, Q5KLinear) for m in llm.model.modules()) >= 4
        assert sum(isinstance(m, Q6KLinear) for m in llm.model.modules()) == 3
    out = llm.generate([list(range(10, 30))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and all(0 <= t < 512 for t in out.token_ids)
    llm.close()


def test_dummy_iq4_xs_gguf_takes_its_blocks_as_stored(tmp_path):
    """The IQ4_XS mix (benchmarks/cpu_dense_q4km.py --mix IQ4_XS): IQ4_XS but for the output's Q6_K, its groups' scales
    8 d over uniform codebook indices (weights of std ~0.02); tiered decodes the IQ4_XS tensors as stored
    (quant/kquant.IQ4XSLinear), its head as q6k."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    from tiered.quant.kquant import IQ4XSLinear

    shape = DenseShape(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, head_dim=64, vocab=512)
    path = write_dummy_dense_gguf(tmp_path / "tiny.gguf", shape, mix="IQ4_XS")
    r = GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.1.ffn_down.weight"] == types["token_embd.weight"] == "IQ4_XS" and types["output.weight"] == "Q6_K"
    assert int(r.fields["general.file_type"].contents()) == 30  # LLAMA_FTYPE_MOSTLY_IQ4_XS
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_up.weight")
    assert 0.01 < float(np.std(dequantize(t.data, Q.IQ4_XS))) < 0.04
    llm = LLM(path, EngineConfig(max_context=64, accelerator="none"))
    if kernels.available():
        from tiered.quant.linear import decode_precision

        assert decode_precision(llm.checkpoint, "auto") == "iq4xs" and llm.plan.precision_mix is None
        assert llm.plan.dtypes.get("lm_head") == "q6k"
        assert sum(isinstance(m, IQ4XSLinear) for m in llm.model.modules()) == 2 * 4
    out = llm.generate([list(range(10, 30))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and all(0 <= t < 512 for t in out.token_ids)
    llm.close()


def test_dummy_gemma3_gguf_loads_and_decodes_in_the_native_step(tmp_path):
    """benchmarks/cpu_gemma3.py's file at tiny widths: a "gemma3" GGUF (Q4_0 projections, the tied embedding Q6_K,
    the sandwich norms' names) read as Gemma 3 with llama.cpp's every-6th rule, decoded by the native step."""
    from tiered.bench.gguf_dense import gemma3_4b, write_dummy_gemma3_gguf

    shape = DenseShape(layers=7, hidden=256, ffn=512, heads=2, kv_heads=1, head_dim=256, vocab=512)
    assert gemma3_4b(6).hidden == 2560 and gemma3_4b(6).head_dim == 256
    path = write_dummy_gemma3_gguf(tmp_path / "g.gguf", shape, window=16)
    r = GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert r.fields["general.architecture"].contents() == "gemma3" and "output.weight" not in types
    assert types["token_embd.weight"] == "Q6_K" and types["blk.0.ffn_gate.weight"] == "Q4_0"
    llm = LLM(path, EngineConfig(max_context=64, accelerator="none"))
    cfg = llm.config
    assert (cfg.model_type, cfg.local_layers, cfg.local_window, cfg.sandwich_norms) == \
        ("gemma3_text", (0, 1, 2, 3, 4, 6), 16, True)
    if kernels.available():
        assert llm.runtime.cpu_decode.schedule == [("native", 0, 7)]
    out = llm.generate([list(range(10, 40))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and all(0 <= t < 512 for t in out.token_ids)
    llm.close()
