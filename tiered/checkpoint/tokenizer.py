"""Tokenizers, through transformers.

GGUF files embed their vocabulary; transformers converts it to a fast tokenizer, which takes a few
seconds, so the converted tokenizer is cached under the user cache directory keyed by the file's
path, size and modification time, with the rule by which it reads back as converted (_cache_rule).
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
    import transformers

    mark = _hf_mark(path)
    try:
        if mark is not None and mark.is_file() and json.loads(mark.read_text()).get("load") == "generic":
            return transformers.TokenizersBackend.from_pretrained(str(path))
        tok = transformers.AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers/tokenizers raise JSON, Key, Value and their own errors
        raise _tokenizer_error(path, e) from None
    if mark is not None and not mark.is_file():
        _record_rule(mark, tok, [("generic", lambda: transformers.TokenizersBackend.from_pretrained(str(path))),
                                 ("class", lambda: tok)])
    return tok


def _hf_mark(path: Path) -> Path | None:
    """The GENERIC_MARK of a model directory's tokenizer, in the cache (keyed by the directory and its
    tokenizer files' sizes and modification times), where its tokenizer.json could be read through the
    generic TokenizersBackend: None where there is no tokenizer.json, the saved class is that already, or
    transformers has no such class. AutoTokenizer imports a model-specific class's module, and with it
    transformers.models' import structure (~1.1 s of every start); the rule, checked once on the tokenizer
    AutoTokenizer gives (_same_tokenizer), lets later starts skip that."""
    import transformers

    if not (path / "tokenizer.json").is_file() or not hasattr(transformers, "TokenizersBackend"):
        return None
    try:
        cls = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None  # no config, or a corrupt one (AutoTokenizer reports it)
    if cls in (None, "TokenizersBackend"):
        return None
    stamp = [f"{path.resolve()}"] + [f"{f}:{(path / f).stat().st_size}:{(path / f).stat().st_mtime_ns}"
                                     for f in TOKENIZER_FILES + ("special_tokens_map.json", "chat_template.jinja")
                                     if (path / f).is_file()]
    return cache_dir() / "tokenizers" / hashlib.sha256("|".join(stamp).encode()).hexdigest()[:16] / GENERIC_MARK


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


GENERIC_MARK = "tiered.json"  # in a cached tokenizer's directory: {"load": rule}, how it is read back (_cache_rule)
# texts a cached tokenizer must encode, decode and template identically through the generic class
_PROBES = ("Hello world", " leading space and  two  spaces", "Héllo wörld, naïve café; 東京 の 天気 ✓ 🙂",
           "line one\nline two\r\n\tindented\n\n\nend", "numbers 12345 3.14159 1,000,000 0x1F",
           "don't can't I'm we'll they've she'd", "def f(x):\n    return x**2  # comment", "")


def _same_tokenizer(a, b) -> bool:
    """True when tokenizers `a` and `b` give the same ids, tokens and text on _PROBES and on every special
    or added token, the same special-token ids, vocabulary size and chat template rendering: what tiered
    reads from a tokenizer (engine/prompt, engine/detokenize, serve/protocol)."""
    specials = sorted(set(a.all_special_tokens) | set(a.get_added_vocab()))
    texts = list(_PROBES) + ["".join(specials), " ".join(f"x{t}y" for t in specials[:64])]
    for text in texts:
        ids = a(text).input_ids
        if ids != b(text).input_ids or a.encode(text, add_special_tokens=False) != b.encode(text, add_special_tokens=False):
            return False
        if a.convert_ids_to_tokens(ids) != b.convert_ids_to_tokens(ids):
            return False
        if any(a.decode(ids, skip_special_tokens=s) != b.decode(ids, skip_special_tokens=s) for s in (False, True)):
            return False
    keys = ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id", "all_special_ids", "chat_template")
    if any(getattr(a, k, None) != getattr(b, k, None) for k in keys) or len(a) != len(b):
        return False
    if a.get_added_vocab() != b.get_added_vocab():
        return False
    if getattr(a, "chat_template", None):
        msgs = [{"role": "system", "content": _PROBES[0]}, {"role": "user", "content": _PROBES[2]},
                {"role": "assistant", "content": _PROBES[3]}, {"role": "user", "content": _PROBES[6]}]
        for conversation in (msgs, msgs[1:]):  # without the system turn where a template refuses one
            try:
                text = a.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
            except Exception:
                continue
            try:
                return text == b.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
            except Exception:
                return False
    return True


def _record_rule(mark: Path, reference, candidates) -> str:
    """The first of `candidates` ((rule, load) pairs) whose tokenizer reads as `reference` does
    (_same_tokenizer), else "convert", written to `mark` (a read-only cache: not written)."""
    rule = "convert"
    for name, load in candidates:
        try:
            if _same_tokenizer(reference, load()):
                rule = name
                break
        except Exception:  # a tokenizer this class cannot read back
            continue
    try:
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text(json.dumps({"load": rule}))
    except OSError:
        pass  # a read-only cache: checked again next time
    return rule


def _cache_rule(cached: Path, converted) -> str:
    """How later loads read the tokenizer cached in `cached` so that they tokenize as `converted` (the
    tokenizer transformers built from the GGUF file) does, written to its GENERIC_MARK: "generic" (the
    generic TokenizersBackend reads the saved pipeline back the same), "class" (the saved class does:
    transformers' Qwen2Tokenizer, for one, rebuilds its pipeline from the vocabulary and merges with its own
    pre-tokenizer, which a GGUF file's need not be) or "convert" (neither: convert the file each time)."""
    import transformers

    candidates = [("class", lambda: transformers.AutoTokenizer.from_pretrained(str(cached)))]
    if hasattr(transformers, "TokenizersBackend"):
        candidates.insert(0, ("generic", lambda: transformers.TokenizersBackend.from_pretrained(str(cached))))
    return _record_rule(cached / GENERIC_MARK, converted, candidates)


def _load_cached(cached: Path):
    """A converted tokenizer from the cache, read by its GENERIC_MARK's rule: through the generic
    TokenizersBackend ("generic": importing a model-specific class such as Qwen2Tokenizer imports
    transformers.models, whose import structure costs ~1.1 s of every start, and its rebuild ~0.3 s)
    or its saved class ("class"); None where the file must be converted again ("convert", or an entry
    cached before the marks, whose reload may tokenize differently from the conversion)."""
    import transformers

    mark = cached / GENERIC_MARK
    rule = json.loads(mark.read_text()).get("load") if mark.is_file() else None
    if rule is None and json.loads((cached / "tokenizer_config.json").read_text()).get("tokenizer_class") == "TokenizersBackend":
        rule = "generic"  # saved by the generic class itself
    if rule == "generic" and hasattr(transformers, "TokenizersBackend"):
        return transformers.TokenizersBackend.from_pretrained(str(cached))
    if rule == "class":
        return transformers.AutoTokenizer.from_pretrained(str(cached))
    return None


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
            tok = _load_cached(cached)
            if tok is not None:
                return tok
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
        return tok  # a read-only cache only costs speed
    _cache_rule(cached, tok)
    return tok
