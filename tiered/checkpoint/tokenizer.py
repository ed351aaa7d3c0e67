"""Tokenizers, through transformers.

GGUF files embed their vocabulary; transformers converts it to a fast tokenizer, which takes a few
seconds, so the converted tokenizer is cached under the user cache directory keyed by the file's
path, size and modification time.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

from tiered.errors import CheckpointError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def cache_dir() -> Path:
    """tiered's cache directory ($TIERED_CACHE, else $XDG_CACHE_HOME/tiered, else ~/.cache/tiered)."""
    root = os.environ.get("TIERED_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tiered")
    return Path(root)


def load_hf_tokenizer(path: Path):
    """AutoTokenizer of a model directory, or None when it has no tokenizer files.

    Raises:
        CheckpointError: the tokenizer files cannot be loaded (tokenizer.json or
            tokenizer_config.json is not valid JSON, or transformers rejects them).
    """
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers/tokenizers raise JSON, Key, Value and their own errors
        raise _tokenizer_error(path, e) from None


def _tokenizer_error(path: Path, e: Exception) -> CheckpointError:
    """The CheckpointError for tokenizer files in `path` that transformers failed to load with `e`,
    naming the file at fault where one can be found."""
    hint = "restore the tokenizer files from the model's source, or pass prompts as token ids"
    for name in ("tokenizer_config.json", "tokenizer.json"):
        f = path / name
        if not f.is_file():
            continue
        try:
            json.loads(f.read_text())
        except (ValueError, OSError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            return CheckpointError(f"{f} is corrupt: not valid JSON ({err})", hint)
    f = path / "tokenizer.json"
    if f.is_file():
        try:
            from tokenizers import Tokenizer
            Tokenizer.from_file(str(f))
        except Exception as err:
            return CheckpointError(f"{f} is corrupt: the tokenizers library rejects it "
                                   f"({type(err).__name__}: {err})", hint)
    return CheckpointError(f"the tokenizer in {path} cannot be loaded ({type(e).__name__}: {e})", hint)


def _load_cached(cached: Path):
    """A converted tokenizer from the cache: its saved class straight from transformers when that is
    the generic TokenizersBackend (importing AutoTokenizer's class registry costs ~0.3 s of every
    start), else through AutoTokenizer."""
    import transformers

    cls = json.loads((cached / "tokenizer_config.json").read_text()).get("tokenizer_class")
    if cls == "TokenizersBackend" and hasattr(transformers, cls):
        return transformers.TokenizersBackend.from_pretrained(str(cached))
    return transformers.AutoTokenizer.from_pretrained(str(cached))


def _gguf_tokenizer_of_any_architecture(path: Path):
    """The GGUF file's tokenizer built by transformers' GGUF tokenizer converters directly, for an
    architecture whose model transformers does not load from GGUF (AutoTokenizer then refuses the
    file, e.g. llama.cpp's "deepseek2", although its tokenizer is an ordinary gpt2-style BPE)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer, config = get_gguf_tokenizer(str(path))
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


def load_gguf_tokenizer(path: Path):
    """The fast tokenizer embedded in a GGUF file (converted once, then cached).

    Raises:
        CheckpointError: transformers cannot convert the file's tokenizer metadata.
    """
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
        try:
            try:
                tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            except (ValueError, TypeError) as e:
                # an architecture transformers does not load from GGUF ("not supported"), or one whose model
                # settings its GGUF reader fails on (transformers 5's gpt-oss rope.scaling reader: TypeError)
                if isinstance(e, ValueError) and "not supported" not in str(e):
                    raise
                tok = _gguf_tokenizer_of_any_architecture(path)
        except Exception as e:  # corrupt or unsupported tokenizer metadata
            raise CheckpointError(f"the tokenizer embedded in {path} cannot be loaded ({type(e).__name__}: {e})",
                                  "re-convert the file, or pass prompts as token ids") from None
    try:
        cached.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(cached))
    except OSError:
        pass  # a read-only cache only costs speed
    return tok
