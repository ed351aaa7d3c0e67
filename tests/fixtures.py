"""Tiny deterministic checkpoints for tests, written with transformers (never committed).

Every checkpoint is a real Hugging Face model directory: config.json written by transformers'
own config class, safetensors with the Hub tensor names (`save_pretrained`), and a small
byte-level BPE tokenizer trained on a fixed paragraph, so the loading code under test is the
code that reads real checkpoints. Weights are random (torch.manual_seed(0)); norm weights and
biases are randomized too, so a loader that dropped them or a model that ignored them would be
caught (transformers initializes them to exactly 1 and 0).

Sizes: hidden 64, 2 layers, 4 query heads, 2 KV heads, MLP 128, vocab = the tokenizer's size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

# A fixed paragraph the tokenizer is trained on: its merges decide the vocabulary.
CORPUS = (
    "The quick brown fox jumps over the lazy dog. Memory is a hierarchy: registers, caches, "
    "RAM, disks. A model that does not fit on the GPU can still run when its weights stream "
    "from the CPU and the disk, layer by layer, overlapping transfers with compute. "
    "Tokens are generated one at a time; each new token attends to every token before it. "
    "Caf\u00e9, na\u00efve, \u00fcber, \u65e5\u672c\u8a9e, \U0001f600 and other characters take several bytes in UTF-8."
)
SPECIAL_TOKENS = ("<s>", "</s>")  # ids 0 (bos) and 1 (eos)
TOKENIZER_VOCAB = 320

TINY_DIMS = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-6,
                 # std 0.02 (the Hub default) gives max |logit| ~0.5 and near-ties between the top
                 # tokens; 0.1 keeps greedy choices well separated from fp32 rounding noise.
                 initializer_range=0.1)


@dataclass(frozen=True)
class TinySpec:
    """One tiny architecture variant: transformers config/model class names and overrides."""

    config_cls: str
    model_cls: str
    overrides: dict = field(default_factory=dict)


TINY_SPECS: dict[str, TinySpec] = {
    "llama": TinySpec("LlamaConfig", "LlamaForCausalLM"),
    "llama3_rope": TinySpec("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama_linear_rope": TinySpec("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
    # YaRN (Qwen2.5's long-context setting): a short original context so the ramp bends frequencies, and
    # its attention factor (0.1 ln(factor) + 1) scales the tables
    "qwen2_yarn_rope": TinySpec("Qwen2Config", "Qwen2ForCausalLM", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32})),
    "llama_tied": TinySpec("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    # HF Llama's attention_bias puts biases on q/k/v and on o_proj.
    "llama_attn_bias": TinySpec("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True)),
    # A window shorter than prompt + output, so the sliding-window mask is exercised.
    "mistral": TinySpec("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "qwen2": TinySpec("Qwen2Config", "Qwen2ForCausalLM"),  # q/k/v bias
    # Qwen2 slides only from layer max_window_layers on; 0 makes every layer slide.
    "qwen2_sliding": TinySpec("Qwen2Config", "Qwen2ForCausalLM", dict(
        use_sliding_window=True, sliding_window=8, max_window_layers=0)),
    # q/k norm; head_dim 32 != hidden / heads, so head_dim must come from config.json.
    "qwen3": TinySpec("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    # rows of 256: GGUF's K-quant super-blocks (Q4_K, Q6_K) fit every projection
    "llama_wide": TinySpec("LlamaConfig", "LlamaForCausalLM", dict(hidden_size=256, intermediate_size=512)),
    # Gemma 3: sandwich norms, GeGLU, a scaled embedding, q/k norms, logits scaled by query_pre_attn_scalar ** -0.5
    # (24, not head_dim 32), one sliding layer (window 8, its own RoPE base) and one global (linear RoPE scaling)
    "gemma3": TinySpec("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=8, pad_token_id=None,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # Gemma 2: soft caps small enough to bend these logits (the released 50 / 30 would hardly touch a tiny model's),
    # every other layer sliding over 8 positions, one RoPE
    "gemma2": TinySpec("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=32, query_pre_attn_scalar=32, sliding_window=8, pad_token_id=None, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0)),
    # Gemma 3 as llama.cpp's files describe it: query_pre_attn_scalar = head_dim (GGUF has no key for it)
    "gemma3_gguf": TinySpec("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, query_pre_attn_scalar=32, sliding_window=8, pad_token_id=None,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # Phi-3 / Phi-4: fused qkv_proj and gate_up_proj (split on reading), a partial RoPE (3/4 of each head rotated),
    # every layer sliding over 8 positions
    "phi3": TinySpec("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=8, pad_token_id=None, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75})),
    # Phi-3.5 / Phi-4-mini's LongRoPE: short and long factors per rotated pair, an original context of 32 positions
    # and a window of 32 (the short factors: transformers' for prompts within the original context), factor 4 (its
    # attention factor sqrt(1 + ln 4 / ln 32)); test_phi3.py widens the window past it for the long factors
    "phi3_longrope": TinySpec("Phi3Config", "Phi3ForCausalLM", dict(
        pad_token_id=None, original_max_position_embeddings=32, max_position_embeddings=32, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75, "factor": 4.0,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 12.0]})),
    # 7 query heads on one KV head of 32: the native attention's vector path scores and weighs 4 + 3 heads
    "llama_gqa7": TinySpec("LlamaConfig", "LlamaForCausalLM", dict(hidden_size=224, num_attention_heads=7,
                                                                  num_key_value_heads=1, intermediate_size=256)),
}


def build_tokenizer():
    """A byte-level BPE PreTrainedTokenizerFast (deterministic), bos "<s>" = 0, eos "</s>" = 1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL_TOKENS[0],
                                   eos_token=SPECIAL_TOKENS[1])


def build_hf_model(name: str, vocab_size: int):
    """The tiny transformers model `name` (a TINY_SPECS key), fp32, eval mode, seeded weights."""
    import transformers

    spec = TINY_SPECS[name]
    config = getattr(transformers, spec.config_cls)(
        **{**TINY_DIMS, **spec.overrides}, vocab_size=vocab_size, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = getattr(transformers, spec.model_cls)(config).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            perturb_norm_or_bias(pname, p)
    return model


def perturb_norm_or_bias(name: str, p: torch.Tensor) -> bool:
    """Give a norm weight (HF starts them at 1) or a bias (at 0) random values, so a test can see
    whether they are used. Returns False, leaving `p` alone, for any other parameter."""
    if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
    elif name.endswith(".bias"):
        p.copy_(0.2 * torch.randn_like(p))
    else:
        return False
    return True


def write_tiny_checkpoint(name: str, out_dir: Path, tokenizer=None) -> Path:
    """Save tiny model `name` (config.json + model.safetensors + tokenizer) into out_dir."""
    tokenizer = tokenizer or build_tokenizer()
    model = build_hf_model(name, len(tokenizer))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def load_hf_model(path: Path):
    """Reload a saved tiny checkpoint with transformers (fp32, eager attention, eval)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one token-id prompt, EOS disabled."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def prompt_ids(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """A fixed pseudo-random token-id prompt that avoids the special tokens 0 and 1."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab_size, (length,), generator=g).tolist()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits for one prompt: float32 [len(ids), V]."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def max_rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|."""
    return float((a - ref).abs().max() / ref.abs().max())


def stepwise_logits(llm, ids: list[int], n_prompt: int, step=None) -> torch.Tensor:
    """Teacher-forced logits, prefill then one token per step: tiered.eval.decode_logits."""
    from tiered.eval import decode_logits

    return decode_logits(llm, ids, n_prompt, step)


def decode_matches_transformers(zoo, name: str, rel_tol: float = 1e-4) -> None:
    """Asserts, for the tiny checkpoint `name` in the lossless engine: the native decode step runs every layer itself
    and, token by token for 24 positions past a 12-token prompt (past the tiny models' windows of 8), gives
    transformers' logits at every position, as do the modules and the torch-op step; a 14-token prompt's rows
    through the native step (Plan.mixed_rows) give transformers' prefill logits."""
    from tiered.runtime.cpu_decode import CPUDecodeStep

    ids = prompt_ids(zoo.vocab_size, 36, seed=4)
    ref = hf_logits(zoo.hf(name), ids)
    llm = zoo.llm(zoo.dir(name))  # fp32 decode weights: lossless
    step = llm.runtime.cpu_decode
    assert step.native is not None and step.schedule == [("native", 0, llm.config.num_hidden_layers)]
    for s in (step, None, CPUDecodeStep(llm.model, native=False)):  # native, the modules, the torch-op step
        assert max_rel_err(stepwise_logits(llm, ids, 12, s), ref[11:]) <= rel_tol
    with torch.inference_mode():
        rows = step.rows_call([(ids[:14], 0, 0, 14)], llm._kv_cache(1, 14))
    assert max_rel_err(rows, ref[:14]) <= rel_tol


def gguf_matches_transformers(zoo, name: str, path: Path, rel_tol: float = 1e-4) -> None:
    """Asserts that the GGUF file at `path`, written from the tiny checkpoint `name` without a tokenizer, reads the
    config.json's config (special tokens aside; eps as the file's float32) and gives transformers' logits and greedy
    tokens in the lossless mode."""
    from dataclasses import replace

    from tiered import SamplingParams
    from tiered.checkpoint import open_checkpoint

    g, h = open_checkpoint(path).config, open_checkpoint(zoo.dir(name)).config
    same = dict(bos_token_id=None, eos_token_ids=(), rms_norm_eps=h.rms_norm_eps, norm_topk_prob=True)
    assert replace(g, **same) == replace(h, **same)
    llm = zoo.llm(path, dtype="float32")
    ids = prompt_ids(zoo.vocab_size, 20, seed=1)
    assert max_rel_err(llm.logits(ids), hf_logits(zoo.hf(name), ids)) <= rel_tol
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert llm.generate(ids, greedy)[0].token_ids == hf_greedy(zoo.hf(name), ids, 16)


def copy_dir(zoo, name: str, tmp_path: Path) -> Path:
    """A copy of the tiny checkpoint `name` under tmp_path, to corrupt without touching the shared one."""
    import shutil

    dst = tmp_path / name
    shutil.copytree(zoo.dir(name), dst)
    return dst


def check(excinfo, *words) -> None:
    """The error is user-facing: every word in its message, and a non-empty hint."""
    from tiered.errors import TieredError

    err = excinfo.value
    assert isinstance(err, TieredError)
    for w in words:
        assert w in err.message, (w, err.message)
    assert err.hint and err.hint in str(err)


def local_model(path: Path, max_positions: int = 64):
    """The model code alone over the checkpoint at `path`: built on meta, every tensor (experts too) materialized
    in fp32, RoPE tables for `max_positions`, eval mode."""
    from tiered.checkpoint import open_checkpoint
    from tiered.memory.materialize import materialize
    from tiered.models import build_model
    from tiered.models.layers import Rotary

    ckpt = open_checkpoint(path)
    with torch.device("meta"):
        model = build_model(ckpt.config, max_positions)
    model.rotary = Rotary(ckpt.config, max_positions)
    materialize(model, ckpt, torch.float32)
    return model.eval()


def packed_prefill_gaps(model, vocab_size: int, kv_dtype: torch.dtype = torch.float32,
                        device: str = "cpu") -> tuple[float, float]:
    """(prefill, decode) largest relative gaps between prompts packed into one row (models/layers.
    build_packed_metadata) and each prompt run alone, on `model` (a CausalLM in fp32 on `device`): prompt A (9
    tokens, slot 0, from position 0), prompt B's last 8 tokens after its first 6 cached in slot 1 (an explicit
    mask), a 1-token prompt C (slot 2), packed into one forward; then one decode step of each slot against the
    same token decoded after its prompt alone. The decode gap shows each prompt's KV written to its own slot only."""
    from tiered.models.layers import KVCache, build_packed_metadata

    a, b, c = (prompt_ids(vocab_size, n, seed=60 + n) for n in (9, 14, 1))
    spans, slots = [(0, 9), (6, 14), (0, 1)], [0, 1, 2]
    gaps = []

    def step(cache, ids, start, slot, meta=None, last=None):
        pos = torch.arange(start, start + len(ids), device=device)[None] if meta is None else meta.positions
        return model(torch.tensor([ids], device=device), pos,
                     torch.tensor([slot] if meta is None else slots, device=device), cache, meta=meta, last=last)

    with torch.inference_mode():
        packed = KVCache(model.config, 3, 32, kv_dtype, device)
        step(packed, b[:6], 0, 1)
        positions = torch.cat([torch.arange(s, e, device=device) for s, e in spans])[None]
        meta = build_packed_metadata(model.rotary, positions, spans, slots, model.config.sliding_window)
        got = step(packed, a + b[6:] + c, 0, 0, meta, torch.tensor([8, 16, 17], device=device)).cpu()
        alone = []
        for ids, slot in ((a, 0), (b, 1), (c, 2)):
            cache = KVCache(model.config, 3, 32, kv_dtype, device)
            alone.append((cache, step(cache, ids, 0, slot)[0].cpu()))
        gaps.append(max(max_rel_err(got[i], ref) for i, (_, ref) in enumerate(alone)))
        nxt = prompt_ids(vocab_size, 1, seed=70)
        gaps.append(max(max_rel_err(step(packed, nxt, len(ids), slot)[0].cpu(), step(cache, nxt, len(ids), slot)[0].cpu())
                        for (ids, slot), (cache, _) in zip(((a, 0), (b, 1), (c, 2)), alone)))
    return gaps[0], gaps[1]


def sentencepiece_model(root: Path, name: str, dummy_prefix: bool, specials: tuple[str, ...]) -> Path:
    """A SentencePiece BPE model trained on CORPUS as Gemma's / Llama's are built (byte fallback, digits split,
    whitespace kept, pad / eos / bos / unk 0-3, `specials` user-defined): Gemma's without a dummy prefix, Llama's and
    Phi-3's with one. Written to root/name.model once; returns its path."""
    import sentencepiece as spm

    path = root / f"{name}.model"
    if not path.exists():
        (root / "corpus.txt").write_text("\n".join([CORPUS] * 4))
        spm.SentencePieceTrainer.train(
            input=str(root / "corpus.txt"), model_prefix=str(root / name), vocab_size=400, model_type="bpe",
            byte_fallback=True, add_dummy_prefix=dummy_prefix, split_digits=True, remove_extra_whitespaces=False,
            normalization_rule_name="identity", pad_id=0, eos_id=1, bos_id=2, unk_id=3,
            user_defined_symbols=list(specials), allow_whitespace_only_pieces=True, character_coverage=1.0,
            minloglevel=2)
    return path


def gguf_tokenizer_encodes_as_sentencepiece(zoo, name: str, model_file: Path, write, path: Path,
                                            texts: list[str], specials: tuple[str, ...]) -> None:
    """Asserts that the tiny checkpoint `name` written as GGUF by `write(model, path, sentencepiece=model_file)` with
    a 400-piece vocabulary encodes each of `texts` through tiered (transformers' GGUF conversion) as llama.cpp does
    with that vocabulary: <bos>, then each piece of the text between `specials` as SentencePiece encodes it alone
    (a dummy prefix, where the model has one, at the start of each: llama.cpp's space prefix after every special
    token), the specials as their ids; decodes a text without specials back to it; and generates from a prompt."""
    import copy
    import re

    import sentencepiece as spm

    from tiered import SamplingParams

    import torch

    model = copy.deepcopy(zoo.hf(name))
    torch.manual_seed(0)  # the new embedding rows: the same model, the same generated tokens, every run
    model.resize_token_embeddings(400, mean_resizing=False)
    write(model, path, sentencepiece=model_file)
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    llm = zoo.llm(path)
    split = re.compile("(" + "|".join(map(re.escape, specials)) + ")")
    for text in texts:
        want = [sp.bos_id()]
        for part in (p for p in split.split(text) if p):
            want += [sp.piece_to_id(part)] if part in specials else sp.encode(part)
        assert llm.encode(text, chat=False) == want, text
        if not split.search(text):
            assert llm.tokenizer.decode(want, skip_special_tokens=True) == text, text
    out = llm.generate(texts[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and isinstance(out.text, str)
