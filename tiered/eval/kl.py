"""KL divergence of a lossy setting's next-token distributions against the lossless ones.

Both models score the same sliding windows (eval/ppl.py); on every scored token we take
KL(P_ref || P) in nats, P = softmax of the logits, and whether the two argmaxes agree. The runner
takes any two EngineConfigs (weight formats here; expert precisions for the MoE runtime), and
`compare` takes loaded LLMs, so one reference pass serves several settings.

`decode_logits` / `decode_compare` score the decode path instead: teacher-forced, one token per
step through the engine's runtime (the MoE runner's expert cache, mixed-precision loads and
prefetch act as they do in generation).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from tiered.config import EngineConfig
from tiered.errors import ConfigError
from tiered.eval.ppl import Perplexity, sliding_windows, token_nll, window_logits

WEIGHTS = ("fp32", "bf16", "int8", "int4", "auto")
ALL_STEPS = sys.maxsize  # a decode_weights_threshold no step exceeds: every step uses the format


def weights_config(weights: str, **overrides) -> EngineConfig:
    """An EngineConfig that runs every linear layer (q/k/v/o, gate/up/down and lm_head) in weight
    format `weights` on every step, prefill included, on the CPU: the decode-format copies with a
    decode_weights_threshold no step exceeds, each row with batch-1 decode numerics (bf16
    activations on int4 weights; batch_activations="q8" scores the batched-decode ones).
    Activations, norms, attention and the KV cache stay
    float32 and the embedding table stays dense float32. "fp32" is the lossless reference.

    Args:
        weights: one of WEIGHTS ("auto" keeps a GGUF's Q4_0/Q4_1 blocks as int4 and Q8_0 as int8 per group of 32).
        overrides: other EngineConfig fields.
    Raises:
        ConfigError: an unknown format or override value.
    """
    if weights not in WEIGHTS:
        raise ConfigError(f"unknown weight format {weights!r}", "pass one of " + ", ".join(WEIGHTS))
    fields = dict(dtype="float32", decode_weights=weights, decode_weights_threshold=ALL_STEPS,
                  batch_activations="bf16", accelerator="none", plan="off")
    return EngineConfig(**{**fields, **overrides})


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) per row [nats], P = softmax(p_logits) the reference. [..., V] -> fp32 [...]."""
    lp, lq = p_logits.float().log_softmax(-1), q_logits.float().log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


@dataclass(frozen=True)
class KL:
    """One setting against the reference, over `tokens` scored tokens."""

    mean: float  # mean KL(P_ref || P) [nats/token]
    max: float  # largest per-token KL [nats]
    top1: float  # share of tokens whose argmax equals the reference's
    ppl: float  # this setting's perplexity on the same tokens
    tokens: int


def compare(ref, others: dict, ids: Sequence[int], window: int, stride: int,
            on_window: Callable[[int, int], None] | None = None) -> tuple[Perplexity, dict[str, KL]]:
    """Score `ids` [N] with the reference LLM and each LLM of `others` (name -> LLM), window by window.

    Each LLM scores in the format its EngineConfig gives a step of `window` tokens (lossless=False);
    on_window(windows done, windows in all) is called after each window.
    Returns:
        (the reference's Perplexity, name -> KL of that LLM against the reference).
    Raises:
        ContextLengthError, ConfigError: as window_logits.
    """
    stats = {name: [0.0, 0.0, 0, 0.0] for name in others}  # sum KL, max KL, argmax agreements, sum NLL
    ref_nll, count, n = 0.0, 0, 0
    num_windows = len(sliding_windows(len(ids), window, stride))
    streams = {name: window_logits(llm, ids, window, stride) for name, llm in others.items()}
    for _, p, targets in window_logits(ref, ids, window, stride):
        ref_nll += float(token_nll(p, targets).sum())
        count, n = count + len(targets), n + 1
        for name, stream in streams.items():
            _, q, _ = next(stream)
            kl, s = kl_divergence(p, q), stats[name]
            s[0] += float(kl.double().sum())
            s[1] = max(s[1], float(kl.max()))
            s[2] += int((p.argmax(-1) == q.argmax(-1)).sum())
            s[3] += float(token_nll(q, targets).sum())
        if on_window is not None:
            on_window(n, num_windows)
    ref_ppl = Perplexity(math.exp(ref_nll / count), ref_nll / count, count, n)
    return ref_ppl, {name: KL(s[0] / count, s[1], s[2] / count, math.exp(s[3] / count), count)
                     for name, s in stats.items()}


def kl_run(model, ref_config: EngineConfig, config: EngineConfig, ids: Sequence[int], window: int,
           stride: int, on_window: Callable[[int, int], None] | None = None) -> tuple[Perplexity, KL]:
    """Load `model` (a path, an opened checkpoint, or None for the default model) under both configs
    and compare them (see compare).

    Returns:
        (the reference's Perplexity, the KL of `config` against `ref_config`).
    """
    from tiered import LLM

    with LLM(model, ref_config) as ref, LLM(model, config) as other:
        ref_ppl, kl = compare(ref, {"other": other}, ids, window, stride, on_window)
    return ref_ppl, kl["other"]


def decode_logits(llm, ids: Sequence[int], n_prompt: int, step=None) -> torch.Tensor:
    """Teacher-forced logits through the engine's two paths: prefill ids[:n_prompt] (dense
    weights), then feed ids[n_prompt:] one token per step (decode weights) through the model's
    modules (for an MoE, the runtime's expert runner), or through `step` (e.g. the engine's own CPU
    decode step, llm.runtime.cpu_decode). A step that takes prompt rows prefills too, as LLM.step
    does for a prompt of at most Plan.mixed_rows tokens: the prompt's tokens as rows of one step.

    Args:
        llm: an LLM; ids: token ids [N] (N <= the plan's context); n_prompt: 1 <= n_prompt <= N.
    Returns:
        fp32 [N - n_prompt + 1, V] on the CPU: row j predicts ids[n_prompt + j] (like llm.logits rows
        n_prompt - 1 onward).
    """
    from tiered.engine.llm import dense_weights

    cache = llm._kv_cache(1, len(ids))  # the engine's own cache, on its compute device
    dev = llm._to_device  # inputs go to the device as the engine sends them
    slot = dev(torch.tensor([0]))
    if llm.runtime is not None:
        llm.runtime.new_sequence()
    rows = []
    with torch.inference_mode(), llm._device_scope():
        if step is not None and n_prompt <= llm.plan.most_prompt_rows() and step.takes_prefill_rows(cache):
            rows.append(step(torch.tensor(ids[:n_prompt]).unsqueeze(1), torch.arange(n_prompt).unsqueeze(1),
                             slot.repeat(n_prompt), cache, rows=torch.tensor([n_prompt - 1])))
        else:
            with dense_weights(llm.model):
                rows.append(llm.model(dev(torch.tensor([ids[:n_prompt]])),
                                      dev(torch.arange(n_prompt).unsqueeze(0)), slot, cache))
        for t in range(n_prompt, len(ids)):
            rows.append((step or llm.model)(dev(torch.tensor([[ids[t]]])), dev(torch.tensor([[t]])), slot, cache))
    return torch.cat([r.float().reshape(-1, r.shape[-1]) for r in rows]).cpu()


def decode_compare(ref, others: dict, ids: Sequence[int], n_prompt: int) -> dict[str, KL]:
    """KL of each LLM of `others` (name -> LLM) against the reference LLM on the decode path
    (decode_logits: prefill ids[:n_prompt], then one token per step), over the N - n_prompt + 1
    predictions; `ppl` is over the N - n_prompt predictions that have a target.

    Returns:
        name -> KL of that LLM's next-token distributions against the reference's.
    """
    p = decode_logits(ref, ids, n_prompt)
    targets = torch.tensor(ids[n_prompt:])
    out = {}
    for name, llm in others.items():
        q = decode_logits(llm, ids, n_prompt)
        kl = kl_divergence(p, q)
        nll = float(token_nll(q[:-1], targets).mean()) if len(targets) else float("nan")
        out[name] = KL(float(kl.double().mean()), float(kl.max()), float((p.argmax(-1) == q.argmax(-1)).float().mean()),
                       math.exp(nll), len(kl))
    return out
