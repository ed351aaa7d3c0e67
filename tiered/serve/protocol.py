"""Request bodies of the OpenAI-compatible API (the fields tiered honours; unknown ones are ignored),
and the logprobs objects of its answers.

Field bounds are checked by pydantic; a body that breaks them is answered 400 with an OpenAI-style
error (tiered/serve/app.py). OpenAI parameters that would change what the answer means but that
tiered does not implement (best_of, suffix, the deprecated `functions`) are refused the same way unless they
carry their neutral value, which common clients send: an answer that silently ignored them would be wrong.
Chat's `tools` and `tool_choice` are engine/tools.py's.
Structured outputs are taken in OpenAI's form (`response_format` json_object / json_schema) and in
vLLM's (`structured_outputs`, and its older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tiered.engine.sampling import LOGIT_BIAS_RANGE, MAX_LOGPROBS, PENALTY_RANGE, SEED_RANGE, SamplingParams
from tiered.engine.sequence import TokenLogprob
from tiered.engine.structured import StructuredOutputsParams
from tiered.errors import ConfigError
from tiered.engine.tools import ToolPlan

MAX_CHOICES = 128  # the most choices (`n`) one request may ask for; the server's slots and queue bound it too


def _neutral_only(*fields: str, neutral: str, is_neutral=lambda v: not v):
    """A validator of OpenAI parameters tiered does not implement: each of `fields` passes when absent
    (None) or when is_neutral(value) (default: falsy: false, 0, {} or []), else it is refused with a
    pydantic error saying it is not supported (`neutral`: the values accepted, for the message)."""
    def check(cls, v):
        if v is not None and not is_neutral(v):
            raise PydanticCustomError("unsupported_parameter", "not supported by this server (send {neutral} or "
                                      "leave it out)", {"neutral": neutral})
        return v
    return field_validator(*fields)(classmethod(check))


class StreamOptions(BaseModel):
    """`stream_options`: include_usage adds a last chunk with the usage and no choices."""

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: OpenAI's named schema (`strict` is always what tiered does: the
    output follows the schema)."""

    model_config = {"populate_by_name": True}

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(..., alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: plain text, any JSON object, or JSON following `json_schema.schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('response_format of type "json_schema" needs json_schema: {"name", "schema"}')
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extra: one of these (engine/structured.StructuredOutputsParams)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


# apply_chat_template's own arguments, which chat_template_kwargs may not set (the server sets them)
TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                "add_generation_prompt", "continue_final_message", "return_dict", "padding",
                                "truncation", "max_length", "return_tensors", "return_assistant_tokens_mask"})


class _Generation(BaseModel):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1, description="most tokens to generate (default: 16 for "
                                   "completions, the rest of the context for chat)")
    # sampling left out: the model's generation_config.json where it gives it (vLLM's --generation-config auto),
    # else OpenAI's defaults (temperature 1, top_p 1); top_k, min_p and repetition_penalty are vLLM's extras
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="vLLM's: keep the k most likely tokens (0 or -1: off)")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="vLLM's: drop tokens below min_p x the top one's "
                                "probability")
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0, description="vLLM's: divides the logits of "
                                             "tokens seen so far (1: off)")
    stop: str | list[str] | None = None
    ignore_eos: bool = Field(False, description="vLLM's: generate past the end-of-sequence token, up to max_tokens "
                             "(benchmarks: every request generates its max_tokens)")
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1], description="a signed 64-bit integer")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices to generate for the prompt (each one "
                   "sequence of the batch; a seeded request's choice i samples with seed + i)")
    frequency_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1], description=
                                           "subtracted from a token's logit once per time it was generated")
    presence_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1], description=
                                          "subtracted from the logit of every token generated so far")
    logit_bias: dict[str, float] | None = Field(None, description="token id (a string of digits) -> bias in "
                                                "-100..100 added to its logit")

    @field_validator("logit_bias")
    @classmethod
    def _bias_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (v or {}).items():
            if not token.isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {token!r}")
            if not LOGIT_BIAS_RANGE[0] <= bias <= LOGIT_BIAS_RANGE[1]:
                raise ValueError(f"logit_bias values must be in {LOGIT_BIAS_RANGE[0]:g}..{LOGIT_BIAS_RANGE[1]:g}, "
                                 f"got {bias} for token {token}")
        return v

    # structured outputs (engine/structured.py): OpenAI's response_format, vLLM's structured_outputs and
    # its older guided_* fields; one of them at most
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self, tokenizer=None) -> StructuredOutputsParams | None:
        """The structured output asked (None: plain text). Raises ConfigError where several are given
        or the one given is refused (StructuredOutputsParams). `tokenizer`: the model's (chat's tool calls
        take their format from its template)."""
        asked: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None and rf.type != "text":
            asked.append(("response_format", {"json_object": True} if rf.type == "json_object"
                          else {"json": rf.json_schema.schema_}))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            asked.append(("structured_outputs", {k: v for k, v in (("json", so.json_), ("json_object", so.json_object),
                                                                   ("regex", so.regex), ("choice", so.choice),
                                                                   ("grammar", so.grammar)) if v}))
        guided = {k: v for k, v in (("json", self.guided_json), ("regex", self.guided_regex),
                                    ("choice", self.guided_choice), ("grammar", self.guided_grammar)) if v is not None}
        asked += [(f"guided_{k}", {k: v}) for k, v in guided.items()]
        if not asked:
            return None
        if len(asked) > 1:
            raise ConfigError(f"give one structured output, got {', '.join(name for name, _ in asked)}",
                              "send one of response_format, structured_outputs or a guided_* field")
        return StructuredOutputsParams(**asked[0][1])

    def sampling(self, default_max_tokens: int, defaults: dict | None = None, tokenizer=None) -> SamplingParams:
        """The engine's SamplingParams; a sampling field the request leaves out takes `defaults`' value (the model's
        generation_config.json: Checkpoint.generation_defaults), else OpenAI's; `tokenizer`: the model's, for the
        constraint (`structured`). Raises ConfigError for values it refuses (e.g. an empty stop, a structured output
        that is not one well-formed constraint)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        given = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                 if getattr(self, k) is not None}
        sample = {"temperature": 1.0, "top_p": 1.0, **(defaults or {}), **given}
        sample["top_k"] = max(0, int(sample.get("top_k", 0)))  # vLLM's -1: off
        return SamplingParams(max_tokens=self.max_tokens or default_max_tokens, **sample,
                              seed=self.seed, stop=stop, logprobs=self.logprob_count(), ignore_eos=self.ignore_eos,
                              presence_penalty=self.presence_penalty or 0.0,
                              frequency_penalty=self.frequency_penalty or 0.0,
                              logit_bias={int(t): b for t, b in (self.logit_bias or {}).items()},
                              structured_outputs=self.structured(tokenizer))

    def logprob_count(self) -> int | None:
        """Alternatives to record per token (None: no logprobs asked)."""
        return None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Generation):
    """POST /v1/completions: text prompts (no chat template), or token ids; one prompt or a batch.

    `echo` puts each prompt before its choice's text, and with `logprobs` its tokens' log-probabilities
    (the first one's null) before the completion's: SamplingParams.prompt_logprobs, what
    lm-eval-harness's local-completions model scores with (echo, logprobs 1, max_tokens 1). With echo,
    max_tokens may be 0: the prompt alone is scored and nothing generated.
    """

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="a text, token ids, or a batch of texts or of token-id lists (a choice for each)")
    max_tokens: int | None = Field(None, ge=0, description="most tokens to generate (default 16; 0 only with echo)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="log-probabilities of the generated "
                                 "tokens (and with echo of the prompt's) with this many most likely alternatives each")
    echo: bool = Field(False, description="the prompt before the completion, in text and logprobs")
    # accepted only at their neutral values (_neutral_only)
    best_of: int | None = None
    suffix: str | None = None
    _no_best_of = _neutral_only("best_of", neutral="1", is_neutral=lambda v: v == 1)
    _no_suffix = _neutral_only("suffix", neutral="null")

    @model_validator(mode="after")
    def _zero_needs_echo(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be >= 1 (0 only with echo: true, to score the prompt)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt: an empty list")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch's prompts: a text or token ids each."""
        p = self.prompt
        return [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)

    @property
    def scores_only(self) -> bool:
        """echo with max_tokens 0: the prompt is scored, one token generated and left out of the answer."""
        return self.echo and self.max_tokens == 0

    def logprob_count(self) -> int | None:
        return self.logprobs

    def sampling(self, default_max_tokens: int, defaults: dict | None = None, tokenizer=None) -> SamplingParams:
        """As for chat, with prompt_logprobs where echo asks logprobs, and one token where max_tokens is 0."""
        prompt = self.logprobs if self.echo else None
        body = self.model_copy(update={"max_tokens": 1}) if self.scores_only else self
        return replace(super(CompletionRequest, body).sampling(default_max_tokens, defaults, tokenizer),
                       prompt_logprobs=prompt)


class TextPart(BaseModel):
    """One text part of a message's content list (other part types are refused)."""

    type: Literal["text"]
    text: str


class ToolFunction(BaseModel):
    """A tool's function: its name, what it does, and its parameters' JSON schema."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """One entry of `tools` (OpenAI's: functions only)."""

    type: Literal["function"]
    function: ToolFunction


class CalledFunction(BaseModel):
    """A tool call's function: its name and arguments (JSON text, as OpenAI sends them)."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """A tool call in an assistant message of the conversation so far."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class NamedToolChoice(BaseModel):
    """`tool_choice` naming one function: {"type": "function", "function": {"name": ...}}."""

    type: Literal["function"]
    function: dict[str, str]


class ChatMessage(BaseModel):
    """One chat message; `developer` is treated as `system`. An assistant message may carry the tool calls it
    made, and a `tool` message answers one (`tool_call_id`)."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None  # an earlier answer's reasoning (vLLM's name; reasoning_content DeepSeek's)
    reasoning_content: str | None = None

    def as_dict(self) -> dict:
        """{"role", "content"} with text parts joined, as the tokenizer's chat template expects; an assistant's
        tool calls with their arguments as objects (what templates render; text that is not JSON stays
        text), a tool answer's tool_call_id and name; an assistant's earlier reasoning (sent as `reasoning` or
        `reasoning_content`) as `reasoning_content` (Qwen3's, GLM-4.5's templates) and `thinking` (gpt-oss's),
        which templates that keep interleaved thinking render and others leave out."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        out = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        out.update({k: v for k, v in (("tool_call_id", self.tool_call_id), ("name", self.name)) if v is not None})
        thought = self.reasoning if self.reasoning is not None else self.reasoning_content
        if thought is not None and self.role == "assistant":
            out["reasoning_content"] = out["thinking"] = thought
        return out


def _arguments(text: str):
    """A call's arguments as the chat template reads them: the JSON object, or the text where it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


class ChatCompletionRequest(_Generation):
    """POST /v1/chat/completions: messages through the model's chat template."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name of max_tokens")
    logprobs: bool = Field(False, description="return the generated tokens' log-probabilities")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="most likely alternatives per token "
                                     "(needs logprobs: true)")
    tools: list[Tool] | None = Field(None, description="functions the model may call (tools/tool_choice: engine/tools.py)")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="more variables for the chat template "
                                                        "(vLLM's; Qwen3's enable_thinking: false turns thinking off)")
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        None, description="OpenAI's: the chat template's reasoning_effort (gpt-oss's templates read it)")
    include_reasoning: bool = Field(True, description="vLLM's: false leaves a reasoning model's reasoning (content) "
                                    "out of the answer (it is still told apart from the content)")
    add_generation_prompt: bool = Field(True, description="vLLM's: end the prompt with the assistant's turn opening")
    continue_final_message: bool = Field(False, description="vLLM's: the last message (an assistant's prefill) left "
                                         "open for the answer to continue; needs add_generation_prompt false")
    # accepted only at its neutral value (_neutral_only): the deprecated form of tools
    functions: list[Any] | None = None
    _no_functions = _neutral_only("functions", neutral="[] or null")

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false (the last message is "
                             "continued, no new turn opened)")
        return self

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling(self, default_max_tokens: int, defaults: dict | None = None, tokenizer=None) -> SamplingParams:
        """As for completions, with max_completion_tokens standing in for an absent max_tokens."""
        if self.max_completion_tokens is not None and self.max_tokens is None:
            return self.model_copy(update={"max_tokens": self.max_completion_tokens}).sampling(default_max_tokens,
                                                                                              defaults, tokenizer)
        return super().sampling(default_max_tokens, defaults, tokenizer)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_kwargs(cls, v: dict | None) -> dict | None:
        taken = sorted(set(v or ()) & TEMPLATE_ARGUMENTS)
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}: the server sets "
                             f"{'it' if len(taken) == 1 else 'them'}")
        return v

    def template_kwargs(self) -> dict:
        """The chat template's extra variables: chat_template_kwargs, and reasoning_effort where given."""
        return {**(self.chat_template_kwargs or {}),
                **({"reasoning_effort": self.reasoning_effort} if self.reasoning_effort else {})}

    def tool_plan(self, tokenizer) -> ToolPlan:
        """How the output becomes tool calls (engine/tools.ToolPlan). Raises ConfigError for a tool_choice the
        tools do not allow."""
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        return ToolPlan.of([t.model_dump(exclude_none=True) for t in self.tools or []], choice,
                           self.parallel_tool_calls, tokenizer)

    def structured(self, tokenizer=None) -> StructuredOutputsParams | None:
        """A structured output asked, or the tool call constraint of tool_choice "required" or a named
        function (ToolPlan.structured, in the call format of `tokenizer`'s template: gpt-oss's harmony has its
        own); not both."""
        own = super().structured()
        tools = self.tool_plan(tokenizer).structured() if self.tools else None
        if own is not None and tools is not None:
            raise ConfigError("a structured output and a required or named tool_choice are two constraints",
                              "send one of them")
        return own or tools


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's; lm-eval-harness's remote tokenizer): a text, or chat messages through the
    chat template; `model` optional."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = Field(True, description="a text's BOS where the tokenizer adds one, as a "
                                     "completion's prompt gets it")
    add_generation_prompt: bool = Field(True, description="messages: end with the assistant's turn opening")
    tools: list[Tool] | None = Field(None, description="messages: the tools the chat template renders, as a chat "
                                     "completion's prompt gets them")

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give one of prompt or messages")
        if self.tools and self.messages is None:
            raise ValueError("tools go with messages")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids -> their text; `model` optional."""

    model: str | None = None
    tokens: list[int]


def _token_text(tokenizer, token: int) -> str:
    """A token's text as it decodes alone (special tokens kept; a piece of a multi-byte character
    decodes to U+FFFD, as OpenAI's bytes field exists to repair)."""
    return tokenizer.decode([token]) if tokenizer is not None else str(token)


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2, Llama 3, Qwen, SmolLM2): the character each byte 0..255 is
    written as in the vocabulary -> that byte (transformers' bytes_to_unicode, inverted)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def _decoder_types(tokenizer) -> set[str]:
    """The types of a fast tokenizer's decoder and of its parts ("ByteLevel", "ByteFallback", ...)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return set()
    state = json.loads(decoder.__getstate__())
    return {state.get("type")} | {d.get("type") for d in state.get("decoders", [])}


def token_bytes(tokenizer, token: int, text: str | None = None) -> bytes:
    """A token's UTF-8 bytes for a chat logprob's `bytes` field: its text's (`text`: its
    _token_text, where the caller has it), or, for a token that holds part of a multi-byte character
    (its text alone is U+FFFD), its own raw bytes, read from its vocabulary piece: byte-level BPE's
    alphabet (`_byte_level_alphabet`) or SentencePiece's byte fallback pieces "<0xNN>". The bytes of
    a character's tokens then join to the character, as OpenAI's field is for. Other vocabularies
    keep the U+FFFD bytes."""
    text = _token_text(tokenizer, token) if text is None else text
    if "\ufffd" not in text or tokenizer is None:
        return text.encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(token)
    types = _decoder_types(tokenizer)
    alphabet = _byte_level_alphabet()
    if "ByteLevel" in types and piece and all(c in alphabet for c in piece):
        return bytes(alphabet[c] for c in piece)
    if "ByteFallback" in types and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece or ""):
        return bytes([int(piece[3:5], 16)])
    return text.encode("utf-8")


def chat_logprobs(tokenizer, entries: list[TokenLogprob]) -> dict:
    """A chat choice's `logprobs`: {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}; a
    token's bytes are its own raw bytes where its text alone is part of a character (`token_bytes`)."""
    def item(token: int, logprob: float) -> dict:
        text = _token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(token_bytes(tokenizer, token, text))}
    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


class CompletionLogprobs:
    """A completion choice's `logprobs`, over one call (a whole answer) or several (a stream's
    chunks, in order): {"tokens", "token_logprobs", "top_logprobs", "text_offset"}.

    A token's text is the text it adds to the completion, decoded after the tokens before it by the
    window rule of engine/detokenize.py (the rule the completion's text is built with): a token
    that ends inside a multi-byte character adds "" and the token completing the character carries
    all of it; a special token, which the completion's text leaves out, adds "". So the tokens' texts
    join to the completion's text (up to where a stop string cut it), and a token's text_offset is
    the completion's length in characters before it. top_logprobs maps the text each alternative
    would have added in the sampled token's place to its log-probability (of alternatives adding the
    same text, the most likely).

    An echoed prompt's tokens go through an instance of their own (skip_special False: special tokens
    keep their text, as the echoed prompt of token ids does); its first token has no log-probability
    (`add` with `tokens`: null, and so are its top_logprobs).

    Args:
        tokenizer: the model's tokenizer (None: a token's text is its id, and offsets count those).
        offset: the characters before the first token (an echoed prompt's, before a completion).
        skip_special: leave special tokens' texts out (a completion's) or keep them (an echoed prompt's).
    """

    def __init__(self, tokenizer, offset: int = 0, skip_special: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []  # the completion's tokens so far
        self.prefix_offset = self.read_offset = 0  # the decoding window, as Sequence's
        self.offset = offset  # the characters so far

    def add(self, entries: list[TokenLogprob | None], tokens: list[int] | None = None) -> dict:
        """The logprobs of the next tokens `entries` (the next chunk's, in a stream); `tokens`: their
        ids, where an entry may be None (a prompt's first token: logprob and top_logprobs null)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for k, e in enumerate(entries):
            token = e.token if e is not None else tokens[k]
            window = self.ids[self.prefix_offset:]
            done = self._decode(self.ids[self.prefix_offset:self.read_offset])
            text = self._piece(window, done, token)
            top: dict[str, float] | None = None
            if e is not None:
                top = {}
                for t, lp in e.top:
                    top.setdefault(self._piece(window, done, t), lp)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if e is None else e.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.ids.append(token)
            self.offset += len(text)
            if text and self.tokenizer is not None:  # the window moves on past a token with text
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _piece(self, window: list[int], done: str, token: int) -> str:
        """The text `token` adds after `window`, whose first `done` text came out already: "" while
        the decoded text ends inside a character (U+FFFD)."""
        if self.tokenizer is None:
            return str(token)
        full = self._decode(window + [token])
        return full[len(done):] if len(full) > len(done) and not full.endswith("\ufffd") else ""


def text_of(content, where: str, kinds: tuple[str, ...], what: str) -> str:
    """The text of another API's message content (serve/anthropic.py, serve/responses.py): a string (None: ""), or
    a list of parts whose type is one of `kinds`, each with a string "text", joined.

    Raises:
        ValueError: a part of another kind (an image, a file), named by `where` and its index (`what`: how the
            message names the parts taken)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}.{k}: only {what} are taken here, got {kind!r}")
        parts.append(part["text"])
    return "".join(parts)
