"""Perplexity with a sliding window (Hugging Face's strided-perplexity recipe).

A text longer than the model's window is scored in windows of `window` tokens that start `stride`
tokens apart; each window scores only the tokens no earlier window scored, so every token from the
second on is scored exactly once, and every token after the first window sees at least
`window - stride` tokens of context (https://huggingface.co/docs/transformers/perplexity).

The default text is real English prose shipped by a package tiered depends on: SciPy's
LICENSE.txt (its BSD licence, the list of bundled libraries and the full GNU GPL v3 text,
~10.5k SmolLM2 tokens), found through importlib.metadata at run time.
"""

from __future__ import annotations

import importlib.metadata as md
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from tiered.errors import ConfigError, ContextLengthError

TEXT_PACKAGE, TEXT_FILE = "scipy", "LICENSE.txt"


@dataclass(frozen=True)
class Window:
    """One scoring window: tokens [begin, end) are fed; tokens [first, end) are scored."""

    begin: int
    end: int
    first: int


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """The windows that score tokens 1..num_tokens-1 once each (token 0 has no context).

    Raises:
        ConfigError: num_tokens < 2, or not 1 <= stride < window (stride == window would leave the
            first token of each window without context).
    """
    if num_tokens < 2:
        raise ConfigError(f"{num_tokens} tokens to score", "pass a text of at least 2 tokens")
    if not 1 <= stride < window:
        raise ConfigError(f"stride {stride} does not fit window {window}", "pass 1 <= stride < window")
    out, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        out.append(Window(begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == num_tokens:
            break
    return out


def window_logits(llm, ids: Sequence[int], window: int, stride: int,
                  lossless: bool = False) -> Iterator[tuple[Window, torch.Tensor, torch.Tensor]]:
    """Score `ids` window by window.

    Args:
        llm: a loaded LLM.
        ids: token ids [N].
        lossless: passed to LLM.logits: False scores with the weight format the LLM's EngineConfig
            gives steps of `window` tokens (see weights_config); True with its dense weights.
    Yields:
        (window, logits fp32 [end - first, V], targets int64 [end - first]): row j predicts
        targets[j] = ids[first + j].
    Raises:
        ContextLengthError: window exceeds the LLM's context window.
    """
    if window > llm.max_context:
        raise ContextLengthError(f"window {window} exceeds the model's context window {llm.max_context}",
                                 f"pass --window {llm.max_context} or less")
    for w in sliding_windows(len(ids), window, stride):
        logits = llm.logits(ids[w.begin:w.end], lossless=lossless)  # [end - begin, V]
        yield w, logits[w.first - 1 - w.begin:w.end - 1 - w.begin], torch.tensor(ids[w.first:w.end])


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood [nats] of each target. logits [T, V], targets int64 [T] -> fp64 [T]."""
    return -logits.double().log_softmax(-1).gather(-1, targets[:, None])[:, 0]


@dataclass(frozen=True)
class Perplexity:
    """exp(mean NLL) over `tokens` scored tokens, in `windows` windows."""

    ppl: float
    nll: float  # mean negative log-likelihood [nats/token]
    tokens: int
    windows: int


def perplexity(llm, ids: Sequence[int], window: int, stride: int, lossless: bool = False,
               on_window: Callable[[int, int], None] | None = None) -> Perplexity:
    """Perplexity of token ids `ids` [N] under `llm` (see window_logits for the arguments);
    on_window(windows done, windows in all) is called after each window."""
    total, count, n = 0.0, 0, 0
    num_windows = len(sliding_windows(len(ids), window, stride))
    for _, logits, targets in window_logits(llm, ids, window, stride, lossless):
        total += float(token_nll(logits, targets).sum())
        count += len(targets)
        n += 1
        if on_window is not None:
            on_window(n, num_windows)
    return Perplexity(math.exp(total / count), total / count, count, n)


def default_text_path() -> Path:
    """SciPy's LICENSE.txt (English prose: licences incl. the GNU GPL v3), located at run time.

    Raises:
        ConfigError: SciPy or its licence file is not installed.
    """
    try:
        files = md.files(TEXT_PACKAGE) or []
    except md.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == TEXT_FILE and f.parent.name.endswith((".dist-info", "licenses")):
            return Path(f.locate()).resolve()
    raise ConfigError(f"the default text ({TEXT_PACKAGE}'s {TEXT_FILE}) is not installed",
                      "run `make setup` or pass --text FILE")


def text_ids(tokenizer, path: Path, max_tokens: int | None = None) -> list[int]:
    """The token ids of a UTF-8 text file (no special tokens), the first `max_tokens` of them.

    Raises:
        ConfigError: the file does not exist, the checkpoint has no tokenizer, or the text has
            fewer than 2 tokens.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"text file {path} does not exist", "pass --text FILE (UTF-8 text)")
    if tokenizer is None:
        raise ConfigError("this checkpoint has no tokenizer", "score a checkpoint that ships one")
    ids = tokenizer(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
    ids = ids if max_tokens is None else ids[:max_tokens]
    if len(ids) < 2:
        raise ConfigError(f"{path} has {len(ids)} tokens", "pass a text of at least 2 tokens")
    return ids
