"""OpenAI's Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`) over the chat machinery of
the server: clients written for it (OpenAI's SDKs' `responses.create`, agents such as Codex) run the local model.
vLLM's server answers the same endpoint.

A request becomes a chat completion (`ResponsesRequest.chat_request`): `instructions` the system message; `input` a
text (one user turn) or a list of items: messages (user / system / developer / assistant, their content a text or
input_text / output_text parts), `function_call` items (an assistant's calls) and `function_call_output` items
(tool turns), earlier `reasoning` items (the next assistant turn's reasoning, which templates that keep
interleaved thinking render); `tools` (type function; OpenAI's built-in ones, BUILT_IN_TOOLS, are left out of
what the model sees: nothing here runs them) and `tool_choice`; `parallel_tool_calls`;
`max_output_tokens`; `temperature` / `top_p`; `reasoning.effort` (the chat template's reasoning_effort, "none"
its enable_thinking false); `text.format` (json_object or json_schema: structured outputs). With
`previous_response_id` the conversation of that response (its input and output, kept in memory for the last
RESPONSES_KEPT responses stored, `store` true as OpenAI's default) comes first. Image, file and other items are
refused (400).

The answer (`response_object`) is a Response: a `reasoning` item (a reasoning model's reasoning), a `message`
item with one output_text part, a `function_call` item per call; status completed, or incomplete with
incomplete_details.reason max_output_tokens; usage with cached_tokens (prompt tokens a slot's KV held). A stream
(`ResponseStream`) sends the Responses events: response.created, response.in_progress, each item's
output_item.added, its deltas (reasoning_text, output_text with content_part.added / done, function_call_arguments)
and output_item.done, then response.completed (or response.incomplete), each with its sequence_number.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, Literal

from pydantic import BaseModel, Field

from tiered.serve.protocol import ChatCompletionRequest, text_of

RESPONSES_KEPT = 256  # stored responses the server keeps for previous_response_id (the oldest dropped first)
# OpenAI's built-in tools, which its servers run (an agent such as Codex lists web_search with its functions on every
# request): nothing here runs them, so the model is not shown them (a request listing one is not refused for it)
BUILT_IN_TOOLS = frozenset({"web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation",
                            "computer_use_preview", "local_shell", "mcp"})


class FunctionTool(BaseModel):
    """A function tool of the Responses API (name, description and parameters at the top level)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Reasoning(BaseModel):
    """`reasoning`: its effort ("none" turns a hybrid model's thinking off; "minimal" is taken as low)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None


class TextOptions(BaseModel):
    """`text`: the output's format (text, json_object, or json_schema with its name, schema and strict)."""

    format: dict[str, Any] | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses (fields the Responses API has and this server does not use, such as metadata's meaning,
    user or include, are ignored)."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    reasoning: Reasoning | None = None
    text: TextOptions | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None

    def chat_request(self, model: str, messages: list[dict]) -> ChatCompletionRequest:
        """The chat completion this request asks for, of the served `model`, over `messages` (the conversation of
        previous_response_id, then `input_messages`). Raises ValueError (answered 400) for a tool or an option this
        server cannot take."""
        funcs = []
        for k, t in enumerate(self.tools or []):
            if t.type in BUILT_IN_TOOLS:
                continue
            if t.type != "function" or not t.name:
                raise ValueError(f"tools.{k}: only function tools (type function, with a name) are run here, got "
                                 f"{t.type!r} (OpenAI's built-in tools are left out of what the model sees)")
            funcs.append({"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.parameters or {"type": "object"}}})
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not choice.get("name"):
                raise ValueError("tool_choice: a function's choice is {\"type\": \"function\", \"name\": ...}")
            choice = {"type": "function", "function": {"name": choice["name"]}}
        elif choice is not None and choice not in ("auto", "none", "required"):
            raise ValueError(f"tool_choice: auto, none, required or a function, got {choice!r}")
        effort = self.reasoning.effort if self.reasoning else None
        fmt = (self.text.format or {}) if self.text else {}
        if fmt.get("type") == "json_schema":
            response_format = {"type": "json_schema", "json_schema": {
                "name": fmt.get("name", "answer"), "schema": fmt.get("schema", {}), "strict": fmt.get("strict")}}
        elif fmt.get("type") in ("json_object", "text", None):
            response_format = {"type": fmt["type"]} if fmt.get("type") else None
        else:
            raise ValueError(f"text.format: text, json_object or json_schema, got {fmt.get('type')!r}")
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return ChatCompletionRequest(
            model=model, messages=system + messages, max_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, stream=self.stream, tools=funcs or None,
            tool_choice=choice if funcs else None, parallel_tool_calls=self.parallel_tool_calls,
            response_format=response_format,
            reasoning_effort={"minimal": "low", "xhigh": "high", "none": None}.get(effort, effort),
            chat_template_kwargs={"enable_thinking": False} if effort == "none" else None)

    def input_messages(self) -> list[dict]:
        """The chat messages of `input` (function calls joined to the assistant turn before them, or a turn of their
        own; an earlier reasoning item kept for the next assistant turn). `instructions` are not among them: they
        come first, and a response that goes on from this one (previous_response_id) does not inherit them, as
        OpenAI's does not."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out, thought = [], None
        for k, item in enumerate(self.input):
            kind, at = item.get("type", "message"), f"input.{k}"
            try:
                if kind == "message":
                    role = item["role"]
                    if role not in ("user", "system", "developer", "assistant"):
                        raise ValueError(f"{at}: a message's role is user, system, developer or assistant, not {role!r}")
                    msg = {"role": role, "content": _text(item.get("content"), at + ".content")}
                    if role == "assistant" and thought is not None:
                        msg["reasoning_content"], thought = thought, None
                    out.append(msg)
                elif kind == "function_call":
                    call = {"id": item["call_id"], "type": "function",
                            "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
                    last = out[-1] if out else None
                    if last is not None and last["role"] == "assistant":  # the calls of the turn before
                        last.setdefault("tool_calls", []).append(call)
                    else:
                        out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                    if thought is not None:
                        out[-1]["reasoning_content"], thought = thought, None
                elif kind == "function_call_output":
                    output = item["output"]
                    out.append({"role": "tool", "tool_call_id": item["call_id"],
                                "content": output if isinstance(output, str) else _text(output, at + ".output")})
                elif kind == "reasoning":
                    thought = "".join(p.get("text", "") for p in item.get("content") or item.get("summary") or [])
                else:
                    raise ValueError(f"{at}: items of type {kind!r} are not taken here (message, function_call, "
                                     "function_call_output and reasoning are)")
            except KeyError as e:
                raise ValueError(f"{at}: a {kind} item needs {e.args[0]!r}") from None
        return out


def _text(content, where: str) -> str:
    """The text of a message's content: a string, or input_text / output_text parts (others refused)."""
    return text_of(content, where, ("input_text", "output_text", "text"), "text parts (input_text, output_text)")


def new_id(prefix: str) -> str:
    """A new id: `prefix`, an underscore and 24 hex digits (resp_, msg_, rs_, fc_ as OpenAI's look)."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    """A reasoning output item of `text` (no content part where it is empty), its id `item_id` or a new one."""
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else [], "status": status}


def message_item(text: str | None, status: str = "completed", item_id: str | None = None) -> dict:
    """An assistant message output item with one output_text part of `text` (none where it is None), its id
    `item_id` or a new one."""
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text is not None
            else []}


def call_item(call: dict, status: str = "completed", item_id: str | None = None) -> dict:
    """The function_call item of an OpenAI chat tool call."""
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def usage(out) -> dict:
    """The Responses usage of a finished RequestOutput."""
    n_in, n_out = len(out.prompt_token_ids), len(out.token_ids)
    return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": out.stats.cached_tokens},
            "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}


def response_object(rid: str, created: int, model: str, body: ResponsesRequest, status: str = "in_progress",
                    output: list[dict] | None = None, out=None) -> dict:
    """The Response object: the request's settings echoed, `output` items, status (completed / incomplete with
    max_output_tokens as the reason / in_progress), usage once `out` (the RequestOutput) is finished."""
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output or [], "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning.model_dump() if body.reasoning else {"effort": None, "summary": None},
            "store": body.store, "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": (body.text.format if body.text and body.text.format else {"type": "text"})},
            "tool_choice": body.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []], "truncation": "disabled",
            "metadata": body.metadata or {}, "usage": usage(out) if out is not None else None,
            **({"completed_at": int(time.time())} if status != "in_progress" else {})}


def status(out, calls: list[dict]) -> str:
    """A finished answer's status: "incomplete" where max_output_tokens cut it (and it made no call), else
    "completed"."""
    return "completed" if out.finish_reason != "length" or calls else "incomplete"


def output_items(reasoning: str | None, content: str | None, calls: list[dict], finished: bool) -> list[dict]:
    """The output items of an answer told apart into reasoning, content and calls (`finished` False: cut by
    max_output_tokens, the message incomplete)."""
    return ([reasoning_item(reasoning)] if reasoning else []) + \
        ([message_item(content, "completed" if finished else "incomplete")] if content or not calls else []) + \
        [call_item(c) for c in calls]


def answer_message(reasoning: str | None, content: str | None, calls: list[dict]) -> dict:
    """The assistant message of an answer, as the conversation goes on from it (previous_response_id)."""
    msg = {"role": "assistant", "content": content or ""}
    if calls:
        msg["tool_calls"] = calls
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg


class ResponseStore:
    """The conversations of the last RESPONSES_KEPT stored responses (their input and answer as chat messages) and
    their Response objects, for previous_response_id and GET /v1/responses/{id}. In memory: a restart forgets them."""

    def __init__(self, most: int = RESPONSES_KEPT) -> None:
        self.most = most
        self._kept: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, obj: dict, conversation: list[dict]) -> None:
        """Keep Response `obj` and its `conversation` (chat messages, the answer last), forgetting the oldest."""
        self._kept[obj["id"]] = (obj, conversation)
        while len(self._kept) > self.most:
            self._kept.popitem(last=False)

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        """(the Response, its conversation) kept for id `rid`, or None."""
        return self._kept.get(rid)

    def delete(self, rid: str) -> bool:
        """Forget response `rid`; whether it was kept."""
        return self._kept.pop(rid, None) is not None


class ResponseStream:
    """The Responses API's events of one streamed answer, fed its parts as they come: each output item opened as
    its first part arrives (reasoning, then the message, then the calls) and closed before the next one opens; every
    event numbered (sequence_number)."""

    def __init__(self) -> None:
        self.seq, self.index = 0, -1
        self.item: dict | None = None  # the open item (its text so far in "text")
        self.items: list[dict] = []  # the finished ones

    def event(self, kind: str, data: dict) -> str:
        """One server-sent event of `kind` with `data`, numbered (sequence_number)."""
        out = f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq, **data})}\n\n"
        self.seq += 1
        return out

    def _open(self, item: dict) -> str:
        out = self.close()
        self.index += 1
        self.item = {**item, "text": ""}
        head = self.event("response.output_item.added", {"output_index": self.index, "item": item})
        if item["type"] == "message":
            head += self.event("response.content_part.added", {
                "item_id": item["id"], "output_index": self.index, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})
        return out + head

    def close(self, status: str = "completed") -> str:
        """The open item's done events ("" where none is open)."""
        if self.item is None:
            return ""
        item, self.item = self.item, None
        at = {"item_id": item["id"], "output_index": self.index}
        text = item.pop("text")
        if item["type"] == "reasoning":
            done = reasoning_item(text, status, item["id"])
            out = self.event("response.reasoning_text.done", {**at, "content_index": 0, "text": text})
        else:
            done = message_item(text, status, item["id"])
            part = done["content"][0]
            out = self.event("response.output_text.done", {**at, "content_index": 0, "text": text, "logprobs": []})
            out += self.event("response.content_part.done", {**at, "content_index": 0, "part": part})
        self.items.append(done)
        return out + self.event("response.output_item.done", {"output_index": self.index, "item": done})

    def reasoning(self, text: str) -> str:
        """A reasoning_text delta (opening a reasoning item first)."""
        return self._delta(text, "reasoning", lambda: reasoning_item("", "in_progress"), "response.reasoning_text.delta",
                           {})

    def text(self, text: str) -> str:
        """An output_text delta (opening a message item first)."""
        return self._delta(text, "message", lambda: message_item(None, "in_progress"), "response.output_text.delta",
                           {"logprobs": []})

    def _delta(self, text: str, kind: str, new_item, name: str, extra: dict) -> str:
        """Event `name` of `text` (its fields and `extra`) in the open item of `kind`, opened first (new_item())
        where another is open."""
        if not text:
            return ""
        head = "" if self.item and self.item["type"] == kind else self._open(new_item())
        self.item["text"] += text
        return head + self.event(name, {"item_id": self.item["id"], "output_index": self.index, "content_index": 0,
                                        "delta": text, **extra})

    def call(self, call: dict) -> str:
        """One function_call item: added (no arguments yet), its arguments as one delta, done."""
        out = self.close()
        self.index += 1
        item = call_item(call, "in_progress")
        at = {"item_id": item["id"], "output_index": self.index}
        out += self.event("response.output_item.added", {"output_index": self.index, "item": {**item, "arguments": ""}})
        out += self.event("response.function_call_arguments.delta", {**at, "delta": item["arguments"]})
        out += self.event("response.function_call_arguments.done", {**at, "arguments": item["arguments"],
                                                                     "name": item["name"]})
        done = {**item, "status": "completed"}
        self.items.append(done)
        return out + self.event("response.output_item.done", {"output_index": self.index, "item": done})
