"""Tokenizers, through transformers.

GGUF files embed their vocabulary; transformers converts it to a fast tokenizer, which takes a few
seconds, so the converted tokenizer is cached under the user cache directory keyed by the file's
path, size and modification time.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path


def cache_dir() -> Path:
    """tiered's cache directory ($TIERED_CACHE, else $XDG_CACHE_HOME/tiered, else ~/.cache/tiered)."""
    root = os.environ.get("TIERED_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tiered")
    return Path(root)


def load_hf_tokenizer(path: Path):
    """AutoTokenizer of a model directory, or None when it has no tokenizer files."""
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))


def _load_cached(cached: Path):
    """A converted tokenizer from the cache: its saved class straight from transformers when that is
    the generic TokenizersBackend (importing AutoTokenizer's class registry costs ~0.3 s of every
    start), else through AutoTokenizer."""
    import json

    import transformers

    cls = json.loads((cached / "tokenizer_config.json").read_text()).get("tokenizer_class")
    if cls == "TokenizersBackend" and hasattr(transformers, cls):
        return transformers.TokenizersBackend.from_pretrained(str(cached))
    return transformers.AutoTokenizer.from_pretrained(str(cached))


def load_gguf_tokenizer(path: Path):
    """The fast tokenizer embedded in a GGUF file (converted once, then cached)."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_dir() / "tokenizers" / key
    if (cached / "tokenizer_config.json").is_file():
        try:
            return _load_cached(cached)
        except Exception:
            pass  # a damaged cache entry: convert again
    from transformers import AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        cached.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(cached))
    except OSError:
        pass  # a read-only cache only costs speed
    return tok
