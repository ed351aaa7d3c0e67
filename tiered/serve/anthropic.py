"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the chat machinery of
the OpenAI-compatible server: clients written for Anthropic's API (its SDKs, Claude Code with ANTHROPIC_BASE_URL
pointed here) run a local model. llama.cpp's server answers the same endpoints.

A request becomes a chat completion (`MessagesRequest.chat_request`): `system` the system message; a message's
text blocks its content, an assistant's `tool_use` blocks its tool calls, a user's `tool_result` blocks tool
messages (before the user's own text), earlier `thinking` blocks the assistant's reasoning (templates that keep
interleaved thinking render it); `tools` (name, description, input_schema) functions; `tool_choice` auto / any /
tool / none as auto / required / the named function / none, `disable_parallel_tool_use` as parallel_tool_calls
false; `thinking` enabled / disabled as the chat template's enable_thinking (Qwen3's and GLM-4.5's templates read
it; left out: the template's default); `stop_sequences` stop strings; `max_tokens` is required, as Anthropic's is.
A conversation ending with an assistant turn is a prefilled answer: the model continues it (the template's
continue_final_message), and the answer holds what it added.
The answer (`message`) holds a thinking block (a reasoning model's reasoning), a text block and a tool_use block
per call; stop_reason end_turn, max_tokens, stop_sequence (with the string) or tool_use. A stream
(`message_events`) sends Anthropic's events: message_start, each block's content_block_start, its deltas
(thinking_delta, text_delta, input_json_delta) and content_block_stop, message_delta with the stop reason and the
output tokens, message_stop. Image and document blocks are refused (400): the models served here read text.
Errors take Anthropic's shape ({"type": "error", "error": {"type", "message"}}: `error_body`), and the API key
may come as `x-api-key` (Anthropic's header) as well as `Authorization: Bearer`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from tiered.serve.protocol import ChatCompletionRequest, text_of

# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, message: str, code: str | None = None) -> dict:
    """Anthropic's error object for an HTTP status: {"type": "error", "error": {"type", "message"}}. A prompt over
    the context window (`code` context_length_exceeded) reads "prompt is too long: ..." as Anthropic's does, for
    clients that look for those words."""
    if code == "context_length_exceeded" and not message.startswith("prompt is too long"):
        message = f"prompt is too long: {message}"
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class ToolChoice(BaseModel):
    """`tool_choice`: auto (the model decides), any (some tool must be called), tool (the named one), none."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class AnthropicTool(BaseModel):
    """A client tool: its name, what it does and its input's JSON schema. Server tools (web search and the like,
    which carry a `type`) are refused: nothing here runs them."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None


class Thinking(BaseModel):
    """`thinking`: {"type": "enabled", "budget_tokens": N} or {"type": "disabled"} (the budget is not enforced:
    max_tokens bounds thinking and answer together)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class AnthropicMessage(BaseModel):
    """One turn: a user's or an assistant's, its content a string or a list of content blocks."""

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    """POST /v1/messages (Anthropic's Messages API; fields it has and this server does not use, such as metadata
    or service_tier, are ignored)."""

    model: str
    max_tokens: int = Field(..., ge=1)
    messages: list[AnthropicMessage] = Field(..., min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    structured_outputs: dict[str, Any] | None = Field(None, description="vLLM's constraint of the output (json, "
                                                      "regex, choice, grammar), as /v1/chat/completions takes it")

    def chat_request(self, model: str) -> ChatCompletionRequest:
        """The chat completion this request asks for, of the served `model`. Raises ValueError (answered 400)
        for a content block this server cannot take (an image, a document) or a malformed one."""
        if any(t.type not in (None, "custom") for t in self.tools or []):
            raise ValueError("tools: server tools (those with a type, such as web search) are not run here; send "
                             "client tools (name, description, input_schema)")
        messages = [{"role": "system", "content": _text(self.system, "system")}] if self.system else []
        for i, m in enumerate(self.messages):
            messages += _turn(m, f"messages.{i}")
        choice, parallel = None, True
        if self.tool_choice is not None:
            c = self.tool_choice
            if c.type == "tool" and not c.name:
                raise ValueError("tool_choice: type tool needs the tool's name")
            choice = ({"type": "function", "function": {"name": c.name}} if c.type == "tool" else
                      {"auto": "auto", "any": "required", "none": "none"}[c.type])
            parallel = not c.disable_parallel_tool_use
        kwargs = None if self.thinking is None else {"enable_thinking": self.thinking.type != "disabled"}
        prefill = self.messages[-1].role == "assistant"  # a prefilled answer: the model continues it
        return ChatCompletionRequest(
            model=model, messages=messages, max_tokens=self.max_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, stop=self.stop_sequences, stream=self.stream,
            tools=[{"type": "function", "function": {"name": t.name, "description": t.description,
                                                     "parameters": t.input_schema}} for t in self.tools or []] or None,
            tool_choice=choice if self.tools else None, parallel_tool_calls=parallel, chat_template_kwargs=kwargs,
            structured_outputs=self.structured_outputs, add_generation_prompt=not prefill,
            continue_final_message=prefill)


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages request without max_tokens."""

    max_tokens: int = Field(1, ge=1)


def _text(content, where: str) -> str:
    """The text of a string or of a list of text blocks (the system prompt, a tool result)."""
    return text_of(content, where, ("text",), "text blocks")


def _turn(m: AnthropicMessage, where: str) -> list[dict]:
    """The chat messages of one turn: a user's tool results first (one tool message each), then its text; an
    assistant's text, tool calls and earlier thinking in one message."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts, calls, results, thoughts = [], [], [], []
    for k, b in enumerate(m.content):
        kind, at = b.get("type"), f"{where}.content.{k}"
        try:
            if kind == "text":
                texts.append(str(b["text"]))
            elif kind == "tool_use" and m.role == "assistant":
                calls.append({"id": b.get("id"), "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}})
            elif kind == "tool_result" and m.role == "user":
                text = _text(b.get("content"), at + ".content")
                results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                                "content": ("Error: " + text) if b.get("is_error") else text})
            elif kind == "thinking" and m.role == "assistant":
                thoughts.append(str(b.get("thinking", "")))
            elif kind == "redacted_thinking" and m.role == "assistant":
                continue  # encrypted by Anthropic's servers: nothing a local model can read
            else:
                raise ValueError(f"{at}: content blocks of type {kind!r} are not taken in a {m.role} turn here "
                                 "(text, tool_use and thinking from the assistant, text and tool_result from the "
                                 "user)")
        except KeyError as e:
            raise ValueError(f"{at}: a {kind} block needs {e.args[0]!r}") from None
    out = list(results)
    if texts or calls or thoughts or not results:
        msg = {"role": m.role, "content": "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        if thoughts:
            msg["reasoning_content"] = "".join(thoughts)
        out.append(msg)
    return out


def message_id() -> str:
    """A new message's id ("msg_" and 24 hex digits, as Anthropic's look)."""
    return "msg_" + uuid.uuid4().hex[:24]


def tool_use(call: dict) -> dict:
    """The tool_use block of an OpenAI tool call (its arguments as the input object; text that is not a JSON
    object goes in as {"input": text})."""
    args = call["function"]["arguments"]
    try:
        value = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        value = {"input": args}
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": value if isinstance(value, dict) else {"input": value}}


def stop_reason(finish_reason: str, stop_string: str | None, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an answer: tool_use where it called tools, max_tokens where it ran out,
    stop_sequence with the string that ended it, else end_turn (the model's end of turn)."""
    if called:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    return ("stop_sequence", stop_string) if stop_string is not None else ("end_turn", None)


def usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    """Anthropic's usage: input_tokens those computed for the prompt, cache_read_input_tokens those whose KV a
    slot already held (prefix reuse), output_tokens those generated."""
    return {"input_tokens": prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": output_tokens}


def message(mid: str, model: str, out, reasoning: str | None, content: str | None, calls: list[dict]) -> dict:
    """The Message object of a finished answer `out` (RequestOutput) told apart into its reasoning, content
    and tool calls."""
    blocks = ([{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []) + \
        ([{"type": "text", "text": content}] if content else []) + [tool_use(c) for c in calls]
    reason, sequence = stop_reason(out.finish_reason, out.stop_string, bool(calls))
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(len(out.prompt_token_ids), out.stats.cached_tokens, len(out.token_ids))}


def event(kind: str, data: dict) -> str:
    """One server-sent event of Anthropic's stream (its `event:` line names the data's type)."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


class MessageStream:
    """The events of one streamed answer, fed its text as it comes: blocks opened as their first text arrives
    (a thinking block before the text one, a text block before the tool_use ones) and each closed before the next
    one opens."""

    def __init__(self) -> None:
        self.index, self.open = -1, None  # the current block's index and kind (None: none open)

    def _start(self, kind: str, block: dict) -> str:
        out = self.close()
        self.index, self.open = self.index + 1, kind
        return out + event("content_block_start", {"index": self.index, "content_block": block})

    def close(self) -> str:
        """content_block_stop of the open block ("" where none is)."""
        if self.open is None:
            return ""
        self.open = None
        return event("content_block_stop", {"index": self.index})

    def thinking(self, text: str) -> str:
        """A thinking_delta of `text` (opening a thinking block first)."""
        return self._delta("thinking", text)

    def text(self, text: str) -> str:
        """A text_delta of `text` (opening a text block first)."""
        return self._delta("text", text)

    def _delta(self, kind: str, text: str) -> str:
        """A `kind`_delta of `text` in a `kind` block ("thinking" or "text"; opened first where another is open)."""
        if not text:
            return ""
        head = self._start(kind, {"type": kind, kind: ""}) if self.open != kind else ""
        return head + event("content_block_delta", {"index": self.index, "delta": {"type": f"{kind}_delta", kind: text}})

    def tool(self, call: dict) -> str:
        """One tool_use block: its start (empty input), its input as one input_json_delta, its stop."""
        block = tool_use(call)
        out = self._start("tool_use", {**block, "input": {}})
        out += event("content_block_delta", {"index": self.index, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
        return out + self.close()
