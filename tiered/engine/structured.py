"""Structured outputs: generation constrained to a JSON schema, any JSON object, a regular expression,
one of a list of strings, or a context-free grammar (vLLM's `StructuredOutputsParams`; OpenAI's
`response_format`).

Before each draw of a constrained sequence, the tokens its grammar cannot continue with get logit -inf
(after the logit bias and penalties, before the repetition penalty, temperature and filters, so a
greedy or sampled token is always one the grammar allows); each drawn token then advances the
grammar's parser. The sequence finishes ("stop") when the grammar is complete and takes no more
tokens, or at the EOS the grammar allows once it is complete. The grammar engine is llguidance
(Microsoft's, the one llama.cpp and vLLM use): an Earley parser over the tokenizer's trie that computes
the allowed-token mask in ~0.1-2 ms on a 49k vocabulary. Placement, scheduling and kernels are what
tiered is about; this is not, so the library does it.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

import numpy as np
import torch

from tiered.errors import ConfigError

HINT = "fix the structured output (response_format / structured_outputs)"
# JSON's whitespace between tokens: one space, or a newline and at most 20 spaces or tabs (llama.cpp's JSON-schema
# grammars' `space` rule). llguidance's default allows any run, and a model that ranks whitespace first (a small
# or random one) then writes it until max_tokens: vLLM's "any whitespace" problem. A pretty-printed object
# (2-space indents, 10 levels) fits. A schema's own "x-guidance" options override it.
JSON_WHITESPACE = r"(?:\x20|\x0A[\x20\x09]{0,20})"


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """What a constrained sequence must produce: exactly one of these (vLLM's StructuredOutputsParams).

    Attributes:
        json: a JSON schema (dict, or its JSON text; kept as canonical text): the output is one JSON
            value that validates against it (llguidance's JSON-schema compiler: types, properties,
            required, enum, const, anyOf, $ref, string formats and lengths, numeric bounds; properties
            are written in the schema's order; whitespace between tokens is one space or a newline and
            at most 20 spaces or tabs, JSON_WHITESPACE, unless the schema's "x-guidance" says otherwise).
        json_object: any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
        regex: the output matches this regular expression whole (Rust regex syntax, no lookaround).
        choice: the output is one of these strings.
        grammar: a context-free grammar in Lark syntax (llguidance's dialect), starting at rule
            `start`, or in llama.cpp's GBNF (any grammar without a `start:` rule), starting at `root`.
        whole: the constraint covers a reasoning model's whole output, its reasoning included (a harmony tool
            call's grammar: engine/tools.py); False: it constrains the answer after the reasoning
            (`after_reasoning`).

    Raises:
        ConfigError: none or several given, a schema that is not JSON or not an object, an empty
            regex, grammar or choice list.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    whole: bool = False

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.dumps(self.json))  # key order kept: properties come in it
            except (TypeError, ValueError) as e:
                raise ConfigError(f"structured output json: not a JSON schema ({e})", HINT) from None
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise ConfigError(f"structured output json: not valid JSON ({e})", HINT) from None
            if not isinstance(schema, (dict, bool)):
                raise ConfigError("structured output json: a schema is a JSON object", HINT)
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ConfigError("structured output choice: give a list of non-empty strings", HINT)
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ConfigError("structured output: give exactly one of json, json_object, regex, choice, grammar"
                              + (f" (got {', '.join(given)})" if given else ""), HINT)
        if (self.regex is not None and not self.regex) or (self.grammar is not None and not self.grammar.strip()):
            raise ConfigError(f"structured output {given[0]}: empty", HINT)

    @property
    def kind(self) -> str:
        """Which constraint it is: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None) \
            if not self.json_object else "json_object"

    def grammar_text(self) -> str:
        """The constraint as an llguidance grammar (the text LLMatcher compiles)."""
        return _grammar_text(self)


@functools.lru_cache(maxsize=64)
def _grammar_text(p: StructuredOutputsParams) -> str:
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    options = {"whitespace_pattern": JSON_WHITESPACE}
    if p.json is not None:
        schema = json.loads(p.json)
        own = schema.get("x-guidance") if isinstance(schema, dict) else None
        if not isinstance(schema, dict) or isinstance(own, dict) and {"whitespace_flexible", "whitespace_pattern"} & set(own):
            options = {}  # the schema says its own whitespace (a pattern would win over its whitespace_flexible);
            # a boolean schema (true: any JSON value) takes no options
        return LLMatcher.grammar_from_json_schema(p.json, defaults=options or None)
    if p.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if p.regex is not None:
        return LLMatcher.grammar_from_regex(p.regex)
    if p.choice is not None:  # one literal alternative per choice (Lark strings are JSON-escaped)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in p.choice))
    try:  # Lark (a `start:` rule) as it is, else llama.cpp's GBNF converted
        lark = any_to_lark(p.grammar)
    except Exception as e:  # noqa: BLE001  (the converter's GbnfToLarkError, and plain errors on odd input)
        raise ConfigError(f"structured output grammar: neither Lark (no `start:` rule) nor valid GBNF ({e})",
                          HINT) from None
    return LLMatcher.grammar_from_lark(lark)


# A reasoning model's constrained output (engine/reasoning.py): its reasoning first, free, then the constraint as
# the answer (grammar "answer", referenced as @answer), as llguidance's docs put a thinking model's grammar
# ("Reasoning/thinking"): the model thinks as it would, and only its answer follows the schema. Without it, the
# constraint starts at the first token and a model trained to think first answers cold (vLLM applies its grammars
# after the reasoning parser's end of thinking in the same way). `think` ends at `</think>` (a plain string, so
# `suffix`, not a special token), then whitespace; harmony's analysis message ends at its `<|end|>` (special tokens
# end a terminal), and the answer is the final channel's message.
# harmony's optional analysis message (its reasoning), ended by <|end|> and the next message's opening
HARMONY_ANALYSIS = 'analysis: <|channel|> "analysis" <|message|> /(?s:.*)/ <|end|> <|start|> "assistant"'
REASONING_GRAMMARS = {
    ("think", True): 'start: thought WS @answer\nthought[suffix="</think>"]: /(?s:.*)/\nWS: /[ \\t\\r\\n]*/',
    ("think", False): 'start: "<think>" thought WS @answer | @answer\nthought[suffix="</think>"]: /(?s:.*)/\n'
                      'WS: /[ \\t\\r\\n]*/',
    ("harmony", False): 'start: analysis? <|channel|> "final" <|message|> @answer\n' + HARMONY_ANALYSIS,
}


def after_reasoning(grammar: str, fmt: str | None, opened: bool = False) -> str:
    """`grammar` (an llguidance grammar: a TopLevelGrammar's JSON, or Lark text) as the answer of a reasoning model's
    output in format `fmt` (engine/reasoning.py; `opened`: its prompt opened a think block): REASONING_GRAMMARS'
    wrapper as the start grammar, `grammar`'s first grammar named "answer" (its others kept). `grammar` itself
    where `fmt` is None."""
    wrapper = REASONING_GRAMMARS.get((fmt, opened and fmt == "think"))
    if wrapper is None:
        return grammar
    top = json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}
    top["grammars"][0]["name"] = "answer"
    top["grammars"].insert(0, {"lark_grammar": wrapper})
    return json.dumps(top)


def _one_line(message: str) -> str:
    """llguidance's multi-line compile error on one line: its source excerpts ("   1 | start: ...") and caret
    lines dropped, the rest joined."""
    lines = [ln.strip() for ln in message.splitlines()]
    return " ".join(ln for ln in lines if ln and set(ln) - set("^~ ") and not re.match(r"\d+ \|", ln))


def grammar_tokenizer(tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """llguidance's view of a Hugging Face fast tokenizer (its token trie; ~0.4 s for SmolLM2's 49k
    tokens: build once per model), with `vocab_size` logits (the model's rows; tokens past the
    tokenizer's are never allowed) and the model's EOS ids.

    Raises:
        ConfigError: no tokenizer, or one llguidance cannot read (a slow, non-`tokenizers` one)."""
    if tokenizer is None:
        raise ConfigError("structured outputs need the model's tokenizer, and this checkpoint has none",
                          "use a checkpoint with a tokenizer (tokenizer.json or a GGUF's vocabulary)")
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
    except Exception as e:  # noqa: BLE001  (ValueError for a slow tokenizer; the Rust side's errors)
        raise ConfigError(f"structured outputs cannot use this tokenizer ({type(e).__name__}: {e})",
                          "use a checkpoint with a fast (tokenizers) tokenizer") from None


class TokenMatcher:
    """One sequence's parser state for its grammar: the allowed next tokens, advanced by each token.

    Args:
        tokenizer: `grammar_tokenizer`'s.
        params: the constraint.
        vocab_size: V, the logits' width.
        reasoning, opened: a reasoning model's output format and whether its prompt opened a think block
            (engine/reasoning.py): the constraint then applies to the answer after the reasoning (`after_reasoning`).
    Raises:
        ConfigError: the grammar does not compile (a bad regex, a bad grammar, an unsupported schema).
    """

    def __init__(self, tokenizer, params: StructuredOutputsParams, vocab_size: int, reasoning: str | None = None,
                 opened: bool = False) -> None:
        from llguidance import LLMatcher

        self.params = params
        self.vocab_size = vocab_size
        try:
            grammar = params.grammar_text()
            grammar = grammar if params.whole else after_reasoning(grammar, reasoning, opened)
        except ValueError as e:  # the JSON compiler's refusals of a schema's shape
            raise ConfigError(f"structured output {params.kind}: {e}", HINT) from None
        self.matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ConfigError(f"structured output {params.kind}: {_one_line(self.matcher.get_error())}", HINT)
        self.consumed = 0  # tokens consumed: rollback undoes them (Sequence.truncate)

    @property
    def done(self) -> bool:
        """Whether the grammar takes no more tokens (complete, or its parser failed)."""
        return self.matcher.is_stopped()

    def allowed(self) -> np.ndarray:
        """Which tokens may come next: bool [V] (numpy)."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        if len(bits) < self.vocab_size:
            bits = np.concatenate([bits, np.zeros(self.vocab_size - len(bits), dtype=np.uint8)])
        return bits[:self.vocab_size].view(bool)

    def constrain(self, logits: torch.Tensor) -> torch.Tensor:
        """logits fp32 [V] (CPU) with every token the grammar forbids next at -inf (a new tensor; ~40 us on
        a 49k vocabulary). Where the parser allows nothing (its error state), the row is left as it is:
        `accept` then ends the sequence."""
        allowed = self.allowed()
        if not allowed.any():
            return logits
        return torch.from_numpy(np.where(allowed, logits.numpy(), np.float32(-np.inf)))

    def forced(self) -> list[int]:
        """The tokens the grammar forces next, whatever the model would rank (llguidance's fast-forward tokens;
        it holds back a last token that a longer one could replace), [] where there is a choice."""
        return self.matcher.compute_ff_tokens()

    def accept(self, token: int) -> bool:
        """Advance by the drawn `token`. Returns False where the grammar refuses it (then `done`)."""
        self.consumed += 1
        return self.matcher.consume_token(token)

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (a sequence truncated back)."""
        n = min(n, self.consumed)
        if n > 0:
            self.matcher.rollback(n)
            self.consumed -= n
