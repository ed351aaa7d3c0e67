"""Reasoning models' output: what the model thinks apart from what it answers.

Two formats, told apart by the chat template (`reasoning_format`):

- "think": the reasoning between `<think>` and `</think>`, the answer after (Qwen3 / Qwen3-MoE, DeepSeek-R1 and
  V3.1 in thinking mode, GLM-4.5 / 4.6, SmolLM3). Templates that open the block themselves (the generation prompt
  ends with `<think>`: DeepSeek-R1's, Qwen3's thinking-only releases) leave the model to write only `</think>`:
  `prompt_opens_thinking` says so, and the text before `</think>` is then reasoning. A template that closes it in
  the prompt (Qwen3 with `enable_thinking: false`: an empty `<think>\\n\\n</think>`) leaves an answer only.
- "harmony": gpt-oss's messages (OpenAI's harmony format): `<|channel|>analysis<|message|>...<|end|>` is
  reasoning, `<|start|>assistant<|channel|>final<|message|>...` the answer, a `commentary` message addressed
  `to=functions.NAME` a tool call whose body is its arguments, a `commentary` message to no one (a preamble)
  answer text. The markers are special tokens, which decoding would drop (leaving "analysis...assistantfinal..."):
  the engine decodes a harmony model's output with its special tokens (`LLM.keeps_special_tokens`, `marks_special`:
  also a "think" model whose tokenizer makes `</think>` special), as llama.cpp renders them; its stop tokens (`<|return|>`, `<|call|>`) end the output and are not part of it.

`split` parses a whole text; `ReasoningStream` does it as text streams in, holding back a tail that may be the
start of a marker, so a stream's deltas add up to `split`'s parts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# harmony's markers (OpenAI harmony, "Special tokens")
H_START, H_CHANNEL, H_MESSAGE, H_END, H_CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>"
H_RETURN, H_CALL = "<|return|>", "<|call|>"
HARMONY_MARKERS = (H_START, H_CHANNEL, H_MESSAGE, H_END, H_CONSTRAIN, H_RETURN, H_CALL)
_RECIPIENT = re.compile(r"to=([^\s<]+)")


def reasoning_format(tokenizer) -> str | None:
    """The reasoning format the model's chat template teaches: "harmony" (it writes `<|channel|>`), "think" (it
    writes `</think>`), or None (no reasoning is told apart: the whole output is the answer)."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    if H_CHANNEL in template and H_MESSAGE in template:
        return "harmony"
    if THINK_CLOSE in template:
        return "think"
    return None


def output_stops(tokenizer, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The token ids that end a model's output, from the checkpoint's end-of-sequence ids `eos_ids`: for a harmony
    model `<|return|>` (the answer is complete) and `<|call|>` (a tool call waits for its result) join them, and
    `<|end|>` leaves them (it ends one message, the reasoning, and the answer follows), as llama.cpp's vocabulary
    loader has them for gpt-oss; a GGUF whose end-of-turn id is `<|end|>` stopped after the reasoning. Others:
    `eos_ids` as they are."""
    if reasoning_format(tokenizer) != "harmony":
        return eos_ids
    vocab = tokenizer.get_vocab()
    end = vocab.get(H_END)
    return tuple(dict.fromkeys([i for i in eos_ids if i != end] + [vocab[m] for m in (H_RETURN, H_CALL) if m in vocab]))


def marks_special(tokenizer, fmt: str | None) -> bool:
    """Whether a model's output text must keep its special tokens for its reasoning format `fmt` to be read: always
    for harmony (its markers are special tokens); for "think" where the tokenizer makes `</think>` a special token
    (Qwen3 and DeepSeek ship it as a plain added token, which decoding keeps), else the answer of a prompt that
    opened thinking would read as reasoning to its end."""
    if fmt == "harmony":
        return True
    if fmt != "think" or tokenizer is None:
        return False
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return any(t.content == THINK_CLOSE and getattr(t, "special", False) for t in added.values())


def prompt_opens_thinking(tokenizer, prompt_ids: list[int]) -> bool:
    """Whether a "think" prompt ends inside an open `<think>` block (the template opened it for the model): the
    last few prompt tokens' text ends with `<think>` and whitespace."""
    if tokenizer is None or not prompt_ids:
        return False
    tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
    return tail.rstrip().endswith(THINK_OPEN)


@dataclass
class Parsed:
    """A reasoning model's output in parts.

    Attributes:
        reasoning: the reasoning text (None where the model wrote none).
        content: the answer text.
        calls: harmony tool calls, (function name, arguments text) each, in order.
    """

    reasoning: str | None
    content: str
    calls: list[tuple[str, str]] = field(default_factory=list)


def split(text: str, fmt: str | None, opened: bool = False) -> Parsed:
    """`text` (a whole output) in parts by format `fmt` (`reasoning_format`; None: all answer); `opened`: the prompt
    opened a think block (`prompt_opens_thinking`). The reasoning and the answer lose their outer whitespace."""
    reasoning, content, calls = _parts(text, fmt, opened, final=True)
    return Parsed((reasoning or "").strip() or None, content.strip(), calls)


def _parts(text: str, fmt: str | None, opened: bool, final: bool) -> tuple[str | None, str, list[tuple[str, str]]]:
    """(reasoning or None, content, calls) of `text`, unstripped; reasoning grows and content grows as text is
    appended (their leading whitespace is dropped as it comes). Not `final`: a call still being written is left
    out (its arguments may be cut)."""
    if fmt == "think":
        start = text.lstrip()
        if opened or start.startswith(THINK_OPEN):
            head, closed, rest = start.removeprefix(THINK_OPEN).partition(THINK_CLOSE)
            return head.lstrip(), rest.lstrip(), []
        if not final and THINK_OPEN.startswith(start):  # maybe `<think>` still coming
            return None, "", []
        return None, start, []  # no reasoning: a `</think>` later is answer text
    if fmt == "harmony":
        return _harmony(text, final)
    return None, text, []


def _harmony(text: str, final: bool) -> tuple[str | None, str, list[tuple[str, str]]]:
    """Harmony messages (`<|start|>` role header `<|channel|>` channel [to=recipient] [`<|constrain|>`...]
    `<|message|>` body, ended by `<|end|>`, `<|call|>`, `<|return|>` or the text's end) sorted into reasoning,
    answer and calls. Text before any header is answer (a model that wrote no channel)."""
    reasoning, content, calls = None, "", []
    for k, part in enumerate(text.split(H_START)):
        head, sep, body = part.partition(H_MESSAGE)
        if k == 0:  # plain text before the first message's header
            content += head.partition(H_CHANNEL)[0] if sep or H_CHANNEL in head else head
        if not sep:
            continue
        ended = any(m in body for m in (H_END, H_CALL, H_RETURN))
        for m in (H_END, H_CALL, H_RETURN):
            body = body.split(m, 1)[0]
        channel = head.partition(H_CHANNEL)[2].split(H_CONSTRAIN)[0].split()
        recipient = _RECIPIENT.search(head)
        if recipient is not None and recipient.group(1).startswith("functions."):
            if final or ended:
                calls.append((recipient.group(1).removeprefix("functions."), body.strip()))
        elif channel and channel[0] == "analysis":
            reasoning = (reasoning or "") + body
        elif recipient is None:  # final, or a commentary preamble to no one
            content += body
    return reasoning, content, calls


def held_tail(text: str, markers) -> int:
    """Characters at the end of `text` that may be the start of one of `markers` (held back from a stream)."""
    if not any(markers):
        return 0
    for k in range(min(max(len(m) for m in markers) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0


class ReasoningStream:
    """`split` as text streams in: `feed(delta)` -> (reasoning delta, content delta) of what can be told apart so
    far; `finish()` the rest and the calls. The deltas add up to `_parts`' whole texts (leading whitespace of each
    part dropped; a trailing one kept: it streamed before the part ended)."""

    def __init__(self, fmt: str | None, opened: bool = False) -> None:
        self.fmt, self.opened = fmt, opened
        self.text = ""
        self.sent_reasoning = self.sent_content = 0
        self.markers = {"think": (THINK_OPEN, THINK_CLOSE), "harmony": HARMONY_MARKERS}.get(fmt, ("",))

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        upto = len(self.text) - held_tail(self.text, self.markers)
        return self._deltas(*_parts(self.text[:upto], self.fmt, self.opened, final=False)[:2])

    def finish(self) -> tuple[str, str, list[tuple[str, str]]]:
        reasoning, content, calls = _parts(self.text, self.fmt, self.opened, final=True)
        return (*self._deltas(reasoning, content), calls)

    def _deltas(self, reasoning: str | None, content: str) -> tuple[str, str]:
        r = (reasoning or "")[self.sent_reasoning:]
        c = content[self.sent_content:]
        self.sent_reasoning += len(r)
        self.sent_content += len(c)
        return r, c
