"""GGUF files: metadata -> ModelConfig, tensor names and q/k un-permutation, block formats, int4 path.

GGUF files are written from the tiny transformers models by tests/gguf_writer.py (llama.cpp's
converter restated), so the reader is checked against the real HF weights.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from fixtures import hf_greedy, prompt_ids
from gguf_writer import dequantized_model, random_k_blocks, write_tensors_gguf
from tiered import SamplingParams
from tiered.checkpoint import GGUFCheckpoint, open_checkpoint
from tiered.checkpoint.gguf_file import qk_row_permutation
from tiered.quant.int4 import Int4Linear
from tiered.quant.linear import PhaseLinear

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
REL_TOL = 1e-4
GGUF_ARCHS = ["llama", "llama_tied", "qwen2", "qwen3"]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


# ------------------------------------------------------------------------------------ F32 files
@pytest.mark.parametrize("name", GGUF_ARCHS)
def test_f32_gguf_logits_and_greedy_match_transformers(zoo, name):
    path = zoo.gguf(name, "F32")
    llm = zoo.llm(path)
    assert isinstance(llm.checkpoint, GGUFCheckpoint) and llm.checkpoint.format_name == "gguf"
    ids = prompt_ids(zoo.vocab_size, 16)
    assert rel_err(llm.logits(ids), hf_logits(zoo.hf(name), ids)) <= REL_TOL
    ids = prompt_ids(zoo.vocab_size, 16, seed=1)
    assert llm.generate(ids, GREEDY)[0].token_ids == hf_greedy(zoo.hf(name), ids, 16)


@pytest.mark.parametrize("name", GGUF_ARCHS)
def test_gguf_config_equals_config_json(zoo, name):
    """GGUF metadata gives the same ModelConfig as config.json (special tokens aside)."""
    from dataclasses import replace

    g = open_checkpoint(zoo.gguf(name, "F32")).config
    h = open_checkpoint(zoo.dir(name)).config
    # The tiny GGUF files carry no tokenizer, hence no bos/eos ids; GGUF stores eps as float32.
    assert g.rms_norm_eps == pytest.approx(h.rms_norm_eps, rel=1e-6)
    # norm_topk_prob only matters to MoE models.
    same = dict(bos_token_id=None, eos_token_ids=(), rms_norm_eps=h.rms_norm_eps, norm_topk_prob=True)
    assert replace(g, **same) == replace(h, **same)


def test_gguf_sampling_keys_are_the_models_generation_defaults(zoo, tmp_path):
    """A file's general.sampling.* keys (llama.cpp's converter writes a generation_config.json's there) are its
    generation defaults, as a directory's generation_config.json is: the server's values for requests that leave
    them out; float32 values read back as written (0.95, not 0.949999988); none where the file names none."""
    from gguf_writer import write_gguf

    path = write_gguf(zoo.hf("llama"), tmp_path / "sampled.gguf", "llama",
                      sampling={"temp": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "penalty_repeat": 1.05,
                                "penalty_last_n": 64})
    assert open_checkpoint(path).generation_defaults() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                          "min_p": 0.0, "repetition_penalty": 1.05}
    assert open_checkpoint(zoo.gguf("llama", "F32")).generation_defaults() == {}


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_gguf_tensors_equal_hf_tensors(zoo, name):
    """Every HF tensor is found under its HF name, in HF layout (q/k permutation undone)."""
    hf = open_checkpoint(zoo.dir(name))
    gg = open_checkpoint(zoo.gguf(name, "F32"))
    assert sorted(gg.names()) == sorted(hf.names())
    for n in hf.names():
        assert gg.handle(n).shape == hf.handle(n).shape, n
        assert torch.equal(gg.handle(n).load(), hf.handle(n).load()), n


def test_qk_row_permutation_inverts_llama_cpp():
    from gguf_writer import llama_cpp_permute

    for rows, heads in [(64, 4), (32, 2), (576, 9), (192, 3)]:
        w = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
        assert np.array_equal(llama_cpp_permute(w, heads)[qk_row_permutation(rows, heads)], w)


# ------------------------------------------------------------------------------ quantized files
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_quantized_gguf_equals_dequantized_hf_model(zoo, name, qtype):
    """A block-quantized GGUF scores exactly like transformers with the round-tripped weights."""
    llm = zoo.llm(zoo.gguf(name, qtype), dtype="float32")  # lossless on any device ("auto" is bf16 on CUDA)
    ref_model = dequantized_model(zoo.hf(name), Q[qtype])
    ids = prompt_ids(zoo.vocab_size, 16)
    assert rel_err(llm.logits(ids), hf_logits(ref_model, ids)) <= REL_TOL
    ids = prompt_ids(zoo.vocab_size, 16, seed=1)
    assert llm.generate(ids, GREEDY)[0].token_ids == hf_greedy(ref_model, ids, 16)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantized_handles_dequantize_like_gguf(zoo, qtype):
    """handle.load() == gguf.quants.dequantize of the stored blocks (in HF row order)."""
    from gguf import GGUFReader

    from gguf_writer import gguf_name

    path = zoo.gguf("llama", qtype)
    ckpt = open_checkpoint(path)
    raw = {t.name: t for t in GGUFReader(path).tensors}
    perm_q = qk_row_permutation(64, 4)
    for n in ckpt.names():
        h = ckpt.handle(n)
        t = raw[gguf_name(n)]
        ref = dequantize(np.asarray(t.data), t.tensor_type).reshape(h.shape)
        if n.endswith("q_proj.weight"):
            ref = ref[perm_q]
        elif n.endswith("k_proj.weight"):
            ref = ref[qk_row_permutation(32, 2)]
        assert h.format == (qtype if len(h.shape) == 2 else "F32"), n
        assert h.is_quantized == (len(h.shape) == 2)
        assert np.array_equal(h.load().numpy(), ref), n
        if h.is_quantized:
            assert h.nbytes == t.n_bytes
            blocks = h.blocks()
            assert blocks.dtype == np.uint8 and blocks.shape[0] == h.shape[0]
            # blocks() are in HF row order: they dequantize to load() directly.
            assert np.array_equal(dequantize(blocks, Q[qtype]).reshape(h.shape), ref), n


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_from_gguf_matches_dequantized_matmul(zoo, qtype):
    """Int4Linear.from_gguf(blocks) computes x @ dequant(W).T within bf16 rounding."""
    ckpt = open_checkpoint(zoo.gguf("qwen2", qtype))
    g = torch.Generator().manual_seed(0)
    for n in ckpt.names():
        h = ckpt.handle(n)
        if not h.is_quantized:
            continue
        w = h.load()  # [N, K] fp32
        x = torch.randn(5, w.shape[1], generator=g)
        lin = Int4Linear.from_gguf(h.blocks(), h.format)
        y = lin(x)
        assert y.dtype == torch.float32 and y.shape == (5, w.shape[0])
        ref = x @ w.T
        # bf16 activations and bf16 scale/zero: a few bf16 ulps of the |x| @ |W| magnitude.
        bound = 2 ** -7 * (x.abs() @ w.abs().T) + 1e-6
        assert bool(((y - ref).abs() <= bound).all()), n
        assert rel_err(y, ref) < 1e-2, n


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_int8_decode_weights_are_int8_per_group_of_32(zoo, qtype):
    """--decode-weights int8 makes int8 copies per group of 32 in the tiled layout (Int8G32Linear, fp16 scales)
    where tiered's kernels take the shape: a Q8_0 file's blocks as stored (the very codes and scales "auto"
    keeps), other weights re-quantized per 32. Per-row int8 (Int8Linear) without the kernels. The plan's
    precision is the copies' (quant/linear.copy_kind), and decode steps stay close to fp32."""
    from fixtures import stepwise_logits
    from tiered import kernels
    from tiered.eval.kl import kl_divergence
    from tiered.quant.int8 import Int8G32Linear, Int8Linear

    path = zoo.gguf("llama", qtype)
    int8 = zoo.llm(path, decode_weights="int8", accelerator="none")
    kind = Int8G32Linear if kernels.available() else Int8Linear
    copies = [m for m in int8.model.modules() if isinstance(m, (Int8G32Linear, Int8Linear))]
    assert len(copies) == 2 * 4 + 1 and all(type(m) is kind for m in copies)  # q/k/v, o, gate/up, down; the head
    assert int8.plan.precision == ("int8-g32" if kernels.available() else "int8")
    assert "lm_head" not in int8.plan.dtypes and int8.plan.precision_mix is None
    if qtype == "Q8_0" and kernels.available():
        auto = zoo.llm(path, decode_weights="auto", accelerator="none")
        same = [m for m in auto.model.modules() if isinstance(m, Int8G32Linear)]
        assert len(same) == len(copies)
        assert all(torch.equal(a.qt, b.qt) and torch.equal(a.st, b.st) for a, b in zip(same, copies))
    fp32 = zoo.llm(path, accelerator="none")
    ids = prompt_ids(zoo.vocab_size, 24)
    kl = kl_divergence(fp32.logits(ids)[7:], stepwise_logits(int8, ids, 8))
    assert float(kl.max()) < 1e-3


def test_copy_kind_is_the_decode_copy_a_shape_and_format_get():
    """quant/linear.copy_kind, the precision the planner prices per tensor: "int8" is int8-g32 where the
    tiled layout takes the shape (N % 16, K % 32) and tiered's kernels are built, per-row int8 elsewhere and
    for a GPTQ checkpoint's int8 codes (kept per row as stored); "int4" falls back to bf16 on shapes no int4
    kernel takes; "auto" follows the storage format."""
    from types import SimpleNamespace

    from tiered import kernels
    from tiered.quant.linear import copy_kind

    g32 = "int8-g32" if kernels.available() else "int8"
    h = lambda fmt, shape: SimpleNamespace(format=fmt, shape=shape, int8_per_row=True)  # noqa: E731
    assert copy_kind(h("F32", (48, 64)), "int8") == g32
    assert copy_kind(h("Q4_1", (48, 64)), "int8") == g32
    assert copy_kind(h("F32", (40, 64)), "int8") == "int8"  # 40 rows: no whole 16-row tile
    assert copy_kind(h("F32", (48, 80)), "int8") == "int8"  # K = 80: no whole groups of 32
    assert copy_kind(h("INT8", (48, 64)), "int8") == "int8"
    assert copy_kind(h("F32", (48, 64)), "int4") == "int4"
    assert copy_kind(h("F32", (40, 64)), "int4") == "bf16"
    assert copy_kind(h("F32", (48, 64)), "bf16") == "bf16"
    assert copy_kind(h("Q8_0", (48, 64)), "auto") == g32
    assert copy_kind(h("Q8_0", (40, 64)), "auto") == "int8"
    assert copy_kind(h("Q4_0", (40, 64)), "auto") == "bf16"
    assert copy_kind(h("F32", (48, 64)), "auto") == "bf16"


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_decode_path_on_gguf(zoo, qtype):
    """Without an accelerator, decode_weights="auto" on a Q4 file decodes with packed int4 weights
    (Q8_0: its blocks as int8-g32 where tiered's kernels are built, else per-row int8), close to fp32
    decoding. The decode copies are a CPU kernel choice: with an accelerator (CUDA, or the stand-in that
    takes CUDA's decisions) none are installed."""
    from fixtures import stepwise_logits
    from tiered import kernels
    from tiered.eval.kl import kl_divergence
    from tiered.quant.int8 import Int8G32Linear, Int8Linear

    path = zoo.gguf("llama", qtype)
    auto = zoo.llm(path, decode_weights="auto", accelerator="none")
    kernel = (Int8G32Linear if kernels.available() else Int8Linear) if qtype == "Q8_0" else Int4Linear
    assert any(isinstance(m, kernel) for m in auto.model.modules())
    assert auto.decode_weight_bytes > 0
    behind = zoo.llm(path, decode_weights="auto", accelerator="host", plan="off")
    assert behind.decode_weight_bytes == 0
    assert not any(isinstance(m, (PhaseLinear, kernel)) for m in behind.model.modules())
    fp32 = zoo.llm(path, accelerator="none")
    assert not any(isinstance(m, (PhaseLinear, Int4Linear)) for m in fp32.model.modules())
    ids = prompt_ids(zoo.vocab_size, 24)
    # One copy per weight by default: no dense projection is kept, scoring runs on the packed copies.
    assert not auto.plan.dense_copies
    assert all(m.weight is None for m in auto.model.modules() if isinstance(m, PhaseLinear))
    assert float(kl_divergence(fp32.logits(ids), auto.logits(ids)).max()) < 1e-3
    # --dtype float32 asks for the lossless mode: dense weights kept, scoring identical to fp32's.
    lossless = zoo.llm(path, decode_weights="auto", accelerator="none", dtype="float32")
    assert lossless.plan.dense_copies and lossless.decode_weight_bytes > 0
    assert torch.equal(lossless.logits(ids), fp32.logits(ids))
    # Decode steps: the int4 kernel on the stored blocks vs the same blocks dequantized to fp32.
    # The only differences are the activations' rounding and bf16 scales/zeros (Q8_0: the blocks' codes
    # and fp16 scales as stored, int16 activations). Measured on this tiny model (2026-12-05): max KL
    # 1.3e-4 / 1.1e-4 / 1.1e-4 nats and max |dlogit| / max |logit| 1.4% / 1.8% / 1.4% for Q4_0 / Q4_1 / Q8_0.
    ref = fp32.logits(ids)[7:]
    got = stepwise_logits(auto, ids, 8)
    assert rel_err(stepwise_logits(fp32, ids, 8), ref) <= REL_TOL
    kl = kl_divergence(ref, got)
    assert float(kl.max()) < 1e-3
    assert rel_err(got, ref) < 5e-2


# ----------------------------------------------------------------------- format round trips
FORMATS = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]
# Largest |w - roundtrip(w)| relative to max |w| expected of each format on N(0, 1) data.
ROUNDTRIP_TOL = {"F32": 0.0, "F16": 1e-3, "BF16": 4e-3, "Q8_0": 1e-2, "Q4_0": 0.1, "Q4_1": 0.1}


@pytest.fixture(scope="module")
def formats_file(tmp_path_factory):
    """One GGUF holding a [8, 512] tensor in each format, plus the fp32 source of each."""
    rng = np.random.default_rng(0)
    tensors, source = {}, {}
    for i, fmt in enumerate(FORMATS):
        name = f"blk.{i}.ffn_up.weight"
        qt = Q[fmt]
        if fmt in ("Q4_K", "Q6_K"):
            arr = random_k_blocks(8, 512, qt, seed=i)
            source[fmt] = None
        else:
            w = rng.standard_normal((8, 512)).astype(np.float32)
            source[fmt] = w
            arr = w if fmt == "F32" else (w.astype(np.float16) if fmt == "F16" else quantize(w, qt))
        tensors[name] = (arr, qt)
    path = write_tensors_gguf(tmp_path_factory.mktemp("formats") / "formats.gguf", tensors,
                              dims=dict(block_count=len(FORMATS), feed_forward_length=8, embedding_length=512))
    return path, tensors, source


@pytest.mark.parametrize("i,fmt", list(enumerate(FORMATS)))
def test_format_dequantizes_through_handle(formats_file, i, fmt):
    path, tensors, source = formats_file
    arr, qt = tensors[f"blk.{i}.ffn_up.weight"]
    h = open_checkpoint(path).handle(f"model.layers.{i}.mlp.up_proj.weight")
    assert h.shape == (8, 512) and h.format == fmt
    got = h.load()
    assert got.dtype == torch.float32 and got.shape == (8, 512) and got.is_contiguous()
    ref = dequantize(arr, qt).reshape(8, 512).astype(np.float32)
    assert np.isfinite(ref).all()
    assert np.array_equal(got.numpy(), ref)
    if source[fmt] is not None:  # the round trip from the original fp32 values
        w = source[fmt]
        assert np.abs(got.numpy() - w).max() <= ROUNDTRIP_TOL[fmt] * np.abs(w).max()
    if h.is_quantized:
        assert np.array_equal(h.blocks(), arr.reshape(8, -1))
    else:
        with pytest.raises(ValueError):
            h.blocks()
    if fmt in ("F16", "BF16"):
        assert h.load(torch.bfloat16).dtype == torch.bfloat16


def test_q8_0_embedding_rows_equal_the_gguf_packages():
    """BlockEmbedding's Q8_0 lookup (quant/embedding.q8_0_rows, numpy on the looked-up rows) gives
    the gguf package's dequantized values bit for bit, repeated rows and all."""
    from tiered.quant.embedding import q8_0_rows

    x = np.random.default_rng(0).standard_normal((40, 576)).astype(np.float32) * 3
    blocks = quantize(x, Q.Q8_0)
    rows = blocks[[3, 7, 7, 39, 0]]
    ref = dequantize(rows, Q.Q8_0).reshape(-1, 576)
    got = q8_0_rows(rows, 576)
    assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(ref))
    from tiered import kernels

    ext = kernels.load()
    if ext is None:
        pytest.skip("tiered/kernels not built: the native lookup")
    # the native lookup BlockEmbedding takes when the kernels are built: the same bits
    native = ext.q8_0_rows(torch.from_numpy(blocks), torch.tensor([3, 7, 7, 39, 0]), 576)
    assert torch.equal(native, torch.from_numpy(ref))
    with pytest.raises(RuntimeError, match="outside the table of 40 rows"):
        ext.q8_0_rows(torch.from_numpy(blocks), torch.tensor([40]), 576)


def test_q8_0_decode_copies_equal_quantizing_the_dequantized_weight():
    """quantize_int8_blocks' Q8_0 path (each row's amax from its blocks, then q d / scale: natively,
    kernels' q8_rows_int8, or in torch, _q8_0_per_row) gives quant/int8.quantize_int8 of the dequantized
    weight bit for bit, in chunks of rows, with codes of -128, all-zero rows and a row of one tiny block
    among zeros."""
    from types import SimpleNamespace

    from tiered.kernels import load
    from tiered.quant.int8 import quantize_int8
    from tiered.quant.linear import _q8_0_per_row, quantize_int8_blocks

    x = np.random.default_rng(1).standard_normal((37, 96)).astype(np.float32) * 3
    x[5] = 0
    x[6] = 0
    x[6, 40] = 1e-6
    blocks = quantize(x, Q.Q8_0).copy()
    blocks.reshape(37, 3, 34)[2, 1, 2 + 7] = 0x80  # a -128 code (the gguf package never writes one)
    ref = quantize_int8(torch.from_numpy(dequantize(blocks, Q.Q8_0).reshape(37, 96)))
    handle = SimpleNamespace(format="Q8_0", shape=(37, 96), blocks=lambda: blocks)
    for rows in (4096, 8):
        q, scale = quantize_int8_blocks(handle, rows=rows)
        assert torch.equal(q, ref[0]) and torch.equal(scale, ref[1])
    for i in range(0, 37, 8):  # the torch path, where the native one is built too
        q, scale = _q8_0_per_row(blocks[i:i + 8], 96)
        assert torch.equal(q, ref[0][i:i + 8]) and torch.equal(scale, ref[1][i:i + 8])
    ext = load()
    if ext is not None:  # every ISA path of the native one
        big = quantize(np.random.default_rng(2).standard_normal((300, 2048)).astype(np.float32), Q.Q8_0)
        want = quantize_int8(torch.from_numpy(dequantize(big, Q.Q8_0).reshape(300, 2048)))
        for isa in ("scalar", ext.best_gemv_isa()):
            ext.set_isa(isa)
            try:
                got = ext.q8_rows_int8(torch.from_numpy(big))
                small = ext.q8_rows_int8(torch.from_numpy(blocks))
            finally:
                ext.reset_isa()
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), isa
            assert torch.equal(small[0], ref[0]) and torch.equal(small[1], ref[1]), isa


def test_fast_reader_parses_what_gguf_parses(tmp_path):
    """gguf_file.fast_reader (GGUFReader with a cheaper `_get`) gives GGUFReader's fields and tensors:
    names, types, every part's values and dtype, contents, tensor shapes, offsets and data; on a
    file with a tokenizer-sized string array (where the speed matters) and quantized tensors."""
    from gguf import GGUFReader, GGUFWriter

    from tiered.checkpoint.gguf_file import fast_reader

    path = tmp_path / "t.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_token_list([f"tok{i}" for i in range(3000)])
    w.add_token_types([1] * 3000)
    w.add_array("test.empty_strings", [])
    w.add_array("test.strings", ["", "é", "a" * 300])
    w.add_array("test.floats", [0.5, -1.0, 3.25])
    w.add_array("test.bools", [True, False])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_rope_freq_base(10000.0)
    w.add_tensor("token_embd.weight", quantize(np.random.default_rng(0).standard_normal((8, 64), np.float32), Q.Q8_0),
                 raw_dtype=Q.Q8_0)
    w.add_tensor("output_norm.weight", np.arange(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    a, b = GGUFReader(str(path)), fast_reader(path)
    assert list(a.fields) == list(b.fields)
    for k, fa in a.fields.items():
        fb = b.fields[k]
        assert (fa.types, fa.data, fa.offset) == (fb.types, fb.data, fb.offset), k
        assert len(fa.parts) == len(fb.parts), k
        assert all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(fa.parts, fb.parts)), k
        assert fa.contents() == fb.contents(), k
    assert len(a.tensors) == len(b.tensors) == 2
    for ta, tb in zip(a.tensors, b.tensors):
        assert (ta.name, ta.tensor_type, list(ta.shape), ta.data_offset, ta.n_bytes) == \
            (tb.name, tb.tensor_type, list(tb.shape), tb.data_offset, tb.n_bytes)
        assert ta.data.dtype == tb.data.dtype and np.array_equal(ta.data, tb.data)


def test_lean_reader_skips_only_tokenizer_sized_arrays(tmp_path):
    """fast_reader(lean=True) steps over arrays of LEAN_ITEMS items or more (strings and numbers) and parses
    the rest as GGUFReader does: the fields after a skipped array and the tensors read the same, a skipped
    field keeps its item count."""
    from gguf import GGUFReader, GGUFWriter

    from tiered.checkpoint.gguf_file import LEAN_ITEMS, fast_reader

    n = LEAN_ITEMS + 5
    path = tmp_path / "t.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_token_list([f"t{i}" + "x" * (i % 7) for i in range(n)])
    w.add_token_scores([float(i) for i in range(n)])
    w.add_token_merges([f"a{i} b" for i in range(n)])
    w.add_array("test.short", ["x"] * (LEAN_ITEMS - 1))
    w.add_rope_freq_base(10000.0)
    w.add_tensor("output_norm.weight", np.arange(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    a, b = GGUFReader(str(path)), fast_reader(path, lean=True)
    assert list(a.fields) == list(b.fields)
    skipped = {"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.merges"}
    for k, fa in a.fields.items():
        fb = b.fields[k]
        if k in skipped:
            assert fb.data == [] and int(fb.parts[-1][0]) == n and fb.types == fa.types[:2], k
            continue
        assert (fa.types, fa.data, fa.offset) == (fb.types, fb.data, fb.offset), k
        assert fa.contents() == fb.contents(), k
    (ta,), (tb,) = a.tensors, b.tensors
    assert (ta.name, ta.data_offset) == (tb.name, tb.data_offset) and np.array_equal(ta.data, tb.data)


def _mapped_rss(path) -> int:
    """Resident bytes of this process's mappings of file `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # a mapping's first line
            inside = line.rstrip().endswith(str(path))
        elif inside and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_READ is Linux's")
def test_block_reads_map_their_pages_at_once(tmp_path):
    """A GGUF handle's `blocks()` (what the native repacking passes read) maps the tensor's pages of the file
    into the process in one call (GGUFCheckpoint.prefault: MADV_POPULATE_READ) before anything reads them,
    where page by page faults had cost an expert's repacking about as much as the repacking itself."""
    from tiered.bench.gguf_moe import MoEShape, write_dummy_moe_gguf
    from tiered.checkpoint import open_checkpoint
    from tiered.checkpoint.gguf_file import _POPULATE

    shape = MoEShape(layers=1, hidden=1024, heads=8, kv_heads=2, head_dim=128, experts=4, top_k=2, expert_ffn=256,
                     vocab=256)
    path = write_dummy_moe_gguf(tmp_path / "m.gguf", shape, qtype="Q4_0")
    ckpt = open_checkpoint(path)
    h = ckpt.handle("model.layers.0.mlp.experts.2.up_proj.weight")
    assert h.format == "Q4_0" and h.nbytes == 256 * 1024 // 32 * 18
    ckpt.release_pages()
    before = _mapped_rss(path)
    raw = h.blocks()  # a view: nothing read yet
    if not _POPULATE["ok"]:
        pytest.skip("this kernel has no MADV_POPULATE_READ (Linux < 5.14)")
    assert _mapped_rss(path) - before >= h.nbytes - 4096
    assert raw.shape == (256, 1024 // 32 * 18)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_decode_copies(zoo, qtype):
    """A Q4_K_M / Q5_K_M file's types on the CPU's decode path ("auto"): Q4_K projections decode as int4 from
    their blocks (scale d*sc and zero 8*scale - dmin*m per group of 32, rounded to bf16: no
    re-quantization); Q5_K and Q6_K ones from their own codes and scales (Q5KLinear, Q6KLinear, with tiered's
    kernels; bf16 copies without); all close to the same file dequantized to fp32."""
    from tiered import kernels
    from tiered.quant.kquant import LINEAR_OF_KIND, KIND_OF_FORMAT
    from tiered.quant.linear import decode_precision

    path = zoo.gguf("llama_wide", qtype)
    auto = zoo.llm(path, decode_weights="auto", accelerator="none")
    stored = KIND_OF_FORMAT.get(qtype)
    kind = "int4" if qtype == "Q4_K" else stored if kernels.available() else "bf16"
    assert decode_precision(auto.checkpoint, "auto") == kind
    # every projection and the head: qkv, o, gate_up, down in each of 2 layers, + 1
    cls = Int4Linear if qtype == "Q4_K" else LINEAR_OF_KIND[stored]
    assert sum(isinstance(m, cls) for m in auto.model.modules()) == (2 * 4 + 1 if kind != "bf16" else 0)
    # measured on this model (sharp logits: initializer_range 0.1), the 8-token prompt's rows on the default
    # int8 activations (Plan.batch_act "q8", llama.cpp's Q8_0 rounding), 2026-12-05: max KL 1.8e-3 (Q4_K),
    # 6.2e-3 (Q6_K as int8-g32: its weights' error is as small as the activations' rounding, which then
    # doubles it); on int16 activations ("bf16": batch-1 numerics) 3.7e-4 / 2.2e-3. Earlier: Q6_K 6e-4 as
    # bf16 copies, 3.9e-3 as per-row int8 (the default int4 SmolLM2: 5e-3). Q6_K as stored (q6k: the file's
    # weights exactly, the activations' rounding alone; 2026-12-07): 1.8e-3 on q8 rows, 1.6e-4 on int16
    _assert_copies_track_the_fp32_file(zoo, path, auto, kind == "bf16")


def _assert_copies_track_the_fp32_file(zoo, path, auto, bf16: bool) -> None:
    """`auto`'s stepwise logits (the decode copies, on the default q8 rows and on int16 ones) and its prefill within
    the copies' bounds of the same file dequantized to fp32 (`bf16`: the copies are bf16, without tiered's kernels)."""
    from fixtures import stepwise_logits
    from tiered.eval.kl import kl_divergence

    fp32 = zoo.llm(path, accelerator="none")
    ids = prompt_ids(zoo.vocab_size, 24)
    ref = fp32.logits(ids)[7:]
    got = stepwise_logits(auto, ids, 8)
    assert float(kl_divergence(ref, got).max()) < (1e-2 if bf16 else 5e-3)
    assert rel_err(got, ref) < 8e-2
    exact = stepwise_logits(zoo.llm(path, decode_weights="auto", accelerator="none", batch_activations="bf16"), ids, 8)
    assert float(kl_divergence(ref, exact).max()) < (3e-3 if bf16 else 1e-3)
    assert rel_err(fp32.logits(ids), auto.logits(ids)) < 8e-2  # prefill through the copies' dense paths (q8 rows)


@pytest.mark.parametrize("qtype", ["IQ4_NL", "IQ4_XS"])
def test_iq4_decode_copies(zoo, qtype):
    """An IQ4_NL / IQ4_XS file (llama.cpp's 16-value codebook times a scale per 32) loads, and its projections
    decode ("auto") with tiered's kernels as IQ4_XS's indices and scales as stored (quant/kquant.IQ4XSLinear: the
    file's weights exactly) or IQ4_NL's int8-g32 copies of its codebook values and scales (exactly too), bf16 without
    the kernels; the logits close to the same file dequantized to fp32, as the k-quant copies'
    (test_k_quant_decode_copies). They had been refused at load ("unsupported type")."""
    from tiered import kernels
    from tiered.quant.int8 import Int8G32Linear
    from tiered.quant.kquant import IQ4XSLinear
    from tiered.quant.linear import decode_precision

    path = zoo.gguf("llama_wide", qtype)
    auto = zoo.llm(path, decode_weights="auto", accelerator="none")
    kind = ("iq4xs" if qtype == "IQ4_XS" else "int8-g32") if kernels.available() else "bf16"
    assert decode_precision(auto.checkpoint, "auto") == kind
    if kind != "bf16":  # every projection of the 2 layers (qkv, o, gate_up, down) and the head
        cls = IQ4XSLinear if kind == "iq4xs" else Int8G32Linear
        assert sum(isinstance(m, cls) for m in auto.model.modules()) == 2 * 4 + 1
        h = auto.checkpoint.handle("model.layers.0.mlp.down_proj.weight")
        down = auto.model.model.layers[0].mlp.down_proj.decode
        assert torch.equal(down.dequantize(), h.load())  # the file's weights, exactly
    # measured (2026-12-07): max KL 2.8e-3 (IQ4_NL) / 1.2e-3 (IQ4_XS) on the default q8 rows, 1.5e-4 / 1.1e-4 on
    # int16 ones: the weights exact, the activations' rounding alone (as the k-quants as stored)
    _assert_copies_track_the_fp32_file(zoo, path, auto, kind == "bf16")


@pytest.mark.parametrize("qtype", ["IQ4_NL", "IQ4_XS"])
def test_iq4_blocks_unpack_to_ggufs_weights(qtype):
    """unpack_iq4_blocks: q * scale is gguf.quants.dequantize's weight (IQ4_NL exactly; IQ4_XS with its scale per 32
    rounded to fp16), q the codebook's int8 values; the native pass (iq4_blocks_tiled) gives those tiled, bit for bit;
    other formats and ragged rows are refused."""
    from gguf_writer import random_blocks
    from tiered.quant.gguf_experts import IQ4_VALUES, unpack_iq4_blocks

    raw = random_blocks(32, 512, getattr(Q, qtype), seed=3)
    q, scale = unpack_iq4_blocks(raw, qtype)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and q.shape == (32, 512) and scale.shape == (32, 16)
    assert set(np.unique(q.numpy())) <= set(IQ4_VALUES.tolist())
    ref = torch.from_numpy(dequantize(raw, getattr(Q, qtype)).reshape(32, 512))
    w = q.float() * scale.float().repeat_interleave(32, 1)
    if qtype == "IQ4_NL":
        assert torch.equal(w, ref)
    else:
        assert torch.allclose(w, ref, rtol=2 ** -11, atol=0)
    from tiered.kernels import load
    from tiered.kernels.linear import tiled_group_scales, tiled_int8

    ext = load()
    if ext is not None:  # the native pass: the same tiled bytes
        qt, st = ext.iq4_blocks_tiled(torch.from_numpy(raw), qtype == "IQ4_XS")
        assert torch.equal(qt, tiled_int8(q)) and torch.equal(st, tiled_group_scales(scale))
        with pytest.raises(RuntimeError, match="N % 16"):
            ext.iq4_blocks_tiled(torch.from_numpy(raw[:8]), qtype == "IQ4_XS")
    with pytest.raises(ValueError, match="not an IQ4"):
        unpack_iq4_blocks(raw, "Q4_0")
    with pytest.raises(ValueError, match="whole"):
        unpack_iq4_blocks(raw[:, :-1], qtype)


def test_threaded_dequantization_is_the_packages():
    """gguf_dequant.dequantize_rows_threaded: the rows in chunks on a thread pool give gguf.quants.dequantize's
    values exactly (any row count, more threads than chunks of 16 rows); a tensor that is not 2-D is refused."""
    from gguf_writer import random_blocks
    from tiered.quant.gguf_dequant import dequantize_rows_threaded

    for qt in (Q.IQ3_XXS, Q.Q3_K, Q.IQ4_NL):
        raw = random_blocks(37, 512, qt, seed=5)
        ref = dequantize(raw, qt).reshape(37, 512)
        for threads in (1, 2, 3, 8):
            got = dequantize_rows_threaded(raw, qt, threads)
            assert got.dtype == np.float32 and np.array_equal(got, ref), (qt, threads)
    with pytest.raises(ValueError, match="rows"):
        dequantize_rows_threaded(raw.reshape(-1), Q.IQ4_NL)


@pytest.mark.parametrize("qtype", ["Q3_K", "Q2_K", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S"])
def test_low_bit_types_take_int4_copies(tmp_path, qtype):
    """A Q2_K / Q3_K / lattice i-quant projection loads (through gguf's dequantization) and takes an int4 decode copy
    re-quantized per 32 from its weights (0.625 bytes a weight, where "auto" had given them bf16 copies: 2), within
    int4's rounding of them; its experts' kind is int4 too."""
    from tiered.checkpoint import open_checkpoint
    from tiered.quant.gguf_experts import stored_kind
    from tiered.quant.linear import copy_kind, decode_weight

    from gguf_writer import random_blocks

    qt = getattr(Q, qtype)
    raw = random_blocks(64, 256, qt, seed=4)
    path = write_tensors_gguf(tmp_path / f"{qtype}.gguf", {"blk.0.ffn_down.weight": (raw, qt)},
                              dims=dict(embedding_length=64, feed_forward_length=256))
    h = open_checkpoint(str(path)).handle("model.layers.0.mlp.down_proj.weight")
    assert h.format == qtype and h.shape == (64, 256) and h.is_quantized
    w = h.load()
    assert torch.equal(w, torch.from_numpy(dequantize(raw, qt).reshape(64, 256)))
    assert copy_kind(h, "auto") == "int4" and stored_kind(h) == "int4"
    lin = torch.nn.Linear(256, 64, bias=False, device="meta")
    d = decode_weight(lin, h, "auto")
    assert d.kind == "int4" and d.blocks is None
    back = ((d.codes.reshape(64, 8, 32) - 8) * d.scale[..., None] + d.zero[..., None]).reshape(64, 256)
    step = (w.reshape(64, 8, 32).amax(-1) - w.reshape(64, 8, 32).amin(-1)) / 15  # one int4 step of each group
    assert ((back - w).abs().reshape(64, 8, 32) <= step[..., None] / 2 + 1e-6).all()


def test_int8_g32_linear_is_its_dequantized_weight():
    """Int8G32Linear: one row and many (a prompt) through the native kernel compute x @ dequantize().T
    up to the kernel's int16 activations; the weight is within half a group scale of the source."""
    from tiered import kernels
    from tiered.quant.int8 import Int8G32Linear

    if not kernels.available():
        pytest.skip("needs tiered/kernels")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=g) * 0.05
    w[3, 7] = 2.0  # an outlier: only its own group's scale grows
    bias = torch.randn(48, generator=g)
    lin = Int8G32Linear.from_dense(w, bias)
    deq = lin.dequantize()
    step = (w.abs().reshape(48, 8, 32).amax(-1) / 127).repeat_interleave(32, 1)
    assert bool(((deq - w).abs() <= step / 2 * 1.01 + 1e-6).all())
    assert float((deq - w)[4:].abs().max()) < 0.05 * 5 / 127  # other rows keep their own fine scales
    x = torch.randn(9, 256, generator=g)
    ref = x @ deq.T + bias
    assert rel_err(lin(x), ref) < 2e-3 and rel_err(lin(x[:1]), ref[:1]) < 2e-3
    assert lin(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_int8_g32_prompts_through_bf16_gemm(monkeypatch):
    """Int8G32Linear.dense: beyond quant/int4.dequantize_rows() rows where dequantize_dtype() is bf16,
    the weight dequantized natively to bf16 ((qt - 128) * s rounded to nearest even: dequantize()'s
    values, rounded) for one bf16 GEMM; otherwise, and below the rows, the kernel."""
    import tiered.quant.int4 as I
    from tiered import kernels
    from tiered.kernels.linear import tiled_int8_g32_dequantize
    from tiered.quant.int8 import Int8G32Linear

    if not kernels.available():
        pytest.skip("needs tiered/kernels")
    g = torch.Generator().manual_seed(1)
    lin = Int8G32Linear.from_dense(torch.randn(64, 256, generator=g) * 0.05, torch.randn(64, generator=g))
    assert torch.equal(tiled_int8_g32_dequantize(lin.qt, lin.st).view(torch.int16),
                       lin.dequantize().to(torch.bfloat16).view(torch.int16))
    with pytest.raises(RuntimeError, match="N % 16"):
        kernels.load().int8g32_tiled_dequantize(lin.qt[:8], lin.st)
    x = torch.randn(40, 256, generator=g)
    ref = x @ lin.dequantize().T + lin.bias
    monkeypatch.setattr(I, "DEQUANTIZE_ROWS", {kernels.isa(): 16})
    monkeypatch.setattr(I, "DEQUANTIZE_DTYPE", {kernels.isa(): torch.bfloat16})
    calls = []
    monkeypatch.setattr(Int8G32Linear, "forward", lambda self, t: calls.append(t.shape) or torch.zeros(*t.shape[:-1], 64))
    y = lin.dense(x)
    assert calls == [] and y.dtype == x.dtype and rel_err(y, ref) < 1e-2
    monkeypatch.setattr(I, "DEQUANTIZE_CHUNK", 16 * 256)  # 16-row chunks: the same product up to the bias add
    assert rel_err(lin.dense(x), y) < 1e-2 and calls == []
    lin.dense(x[:16])  # 16 rows: the kernel
    monkeypatch.setattr(I, "DEQUANTIZE_DTYPE", {})  # fp32 machines: the kernel at every row count
    lin.dense(x)
    assert calls == [(16, 256), (40, 256)]


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_torch_dequantize_is_the_gguf_packages_bit_for_bit(fmt):
    """quant/gguf_dequant.dequantize_blocks (torch, threaded) gives gguf.quants.dequantize's fp32
    values exactly, on blocks with every byte random except finite fp16 scales."""
    from tiered.quant.gguf_dequant import dequantize_blocks

    if fmt == "Q8_0":
        raw = quantize(np.random.default_rng(0).standard_normal((24, 256)).astype(np.float32) * 3, Q.Q8_0)
    else:
        raw = random_k_blocks(24, 512, Q[fmt], seed=3)
    got = dequantize_blocks(raw, fmt)
    ref = dequantize(raw, Q[fmt]).reshape(24, -1)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert np.array_equal(got.numpy().view(np.int32), ref.astype(np.float32).view(np.int32))
    assert dequantize_blocks(raw[:1], fmt).shape == (1, ref.shape[1])
    assert dequantize_blocks(raw, "Q3_K") is None
