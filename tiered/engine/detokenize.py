"""Incremental detokenization and stop strings for streaming output."""

from __future__ import annotations

from tiered.engine.sequence import Sequence

try:  # tokenizers >= 0.21: the window rule below, incrementally in Rust
    from tokenizers.decoders import DecodeStream
except ImportError:
    DecodeStream = None


# tokens before the newest that the window rule decodes again where DecodeStream gave up (append_token_text)
STREAM_FALLBACK_WINDOW = 5


def append_token_text(tokenizer, seq: Sequence) -> None:
    """Extend seq.text with the text of its newest output token.

    Decodes a short window (prefix_offset..end) so multi-token characters and leading-space rules
    come out right; text ending in U+FFFD (an incomplete UTF-8 sequence) waits for the next token.
    With a `tokenizers` backend (transformers' fast tokenizers) the same window rule runs in Rust,
    one call a token (tokenizers.decoders.DecodeStream): two `decode` calls cost ~50 us a token
    inside a CPU decode loop, whose weights leave the interpreter's caches cold. Special tokens are dropped
    unless seq.keep_special (a harmony model's channel markers: engine/reasoning.py).
    """
    skip = not seq.keep_special
    backend = getattr(tokenizer, "_tokenizer", None)
    if seq.decode_stream is None and DecodeStream is not None and backend is not None and len(seq.output_ids) == 1:
        seq.decode_stream = DecodeStream(skip_special_tokens=skip)  # from the first token on
    if seq.decode_stream is not None:
        try:
            piece = seq.decode_stream.step(backend, seq.output_ids[-1])
        except Exception:  # noqa: BLE001 - tokenizers' stream refuses some byte sequences (below)
            # tokenizers' DecodeStream raises "Invalid prefix encountered while decoding stream" after byte-fallback
            # tokens that are no valid UTF-8 together (a stray continuation byte, <0x9E>, between ASCII bytes: a
            # SentencePiece vocabulary through a space-prefix decoder; tokenizers 0.23): the window rule below takes
            # over for the rest of the sequence, from the few tokens before this one
            seq.decode_stream = None
            seq.read_offset = len(seq.output_ids) - 1
            seq.prefix_offset = max(0, seq.read_offset - STREAM_FALLBACK_WINDOW)
        else:
            if piece:
                seq.text += piece
            return
    ids = seq.output_ids
    prefix = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        seq.text += full[len(prefix):]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(ids)


def apply_stop_strings(seq: Sequence) -> None:
    """Cut seq.text at the first stop string and mark the sequence finished ("stop"), the string in
    seq.stop_string (of two starting at the same place, the one listed first)."""
    stops = seq.params.stop
    if not stops:
        return
    longest = max(len(s) for s in stops)
    start = max(0, seq.emitted - longest)
    hits = [(i, k) for k, i in enumerate(seq.text.find(s, start) for s in stops) if i >= 0]
    if hits:
        at, k = min(hits)
        seq.text = seq.text[:at]
        seq.finish_reason, seq.stop_string = "stop", stops[k]


def take_stream_delta(seq: Sequence) -> str:
    """Text not yet streamed that can no longer turn into a stop string; advances seq.emitted."""
    end = len(seq.text)
    if not seq.finished and seq.params.stop:
        end = max(seq.emitted, end - max(len(s) for s in seq.params.stop) + 1)
    delta = seq.text[seq.emitted:end]
    seq.emitted = end
    return delta
