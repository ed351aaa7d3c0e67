"""Tool calling in /v1/chat/completions (OpenAI's `tools` and `tool_choice`).

The tools go to the model's chat template (transformers' `apply_chat_template(tools=...)`, which renders
them as the model was trained to read them). What the model writes becomes `tool_calls` by `tool_choice`:

- "none": text, as without tools.
- a named function (`{"type": "function", "function": {"name": ...}}`): the output is constrained to that
  function's `parameters` schema (engine/structured.py) and is the call's `arguments`, written as
  json.dumps writes it (CALL_JSON).
- "required": the output is constrained to a JSON list of one or more calls (`{"name", "arguments"}`,
  each tool's own parameters; one call where `parallel_tool_calls` is false), as vLLM does.
- "auto" (the default with tools): unconstrained; calls are parsed out of the text in the Hermes format
  (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, what Qwen2.5 / Qwen3 / Qwen3-MoE, Hermes
  and SmolLM3 templates teach) where the chat template speaks it; elsewhere the answer is text.

A choice with calls finishes "tool_calls" and its message's `content` is the text before the first call
(null when there is none).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from tiered.engine.structured import StructuredOutputsParams
from tiered.errors import ConfigError

OPEN, CLOSE = "<tool_call>", "</tool_call>"  # the Hermes format's call tags
HINT = "fix tools / tool_choice"
# the JSON of constrained calls: json.dumps' separators and no other whitespace, as chat templates render calls
# (jinja's tojson) and as models were trained on them; a tool's own "x-guidance" whitespace options win
CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def call_id() -> str:
    """A new tool call's id ("call_" and 24 hex digits, as OpenAI's look)."""
    return "call_" + uuid.uuid4().hex[:24]


def speaks_hermes(tokenizer) -> bool:
    """Whether the model's chat template teaches the Hermes call format (it writes the `<tool_call>` tag)."""
    return OPEN in str(getattr(tokenizer, "chat_template", None) or "")


def _parameters(tool: dict) -> dict:
    """A tool's parameters schema (an object with no properties where it gives none)."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """How one request's output becomes tool calls.

    Attributes:
        mode: "none", "auto", "required" or "named".
        tools: the request's tools, as OpenAI sends them ({"type": "function", "function": {...}}).
        name: the named function ("named" mode).
        parallel: more than one call allowed ("required" mode).
        hermes: "auto" parses the Hermes format (the template speaks it).
    """

    mode: str
    tools: list[dict] = field(default_factory=list)
    name: str | None = None
    parallel: bool = True
    hermes: bool = False

    @classmethod
    def of(cls, tools: list[dict] | None, tool_choice, parallel: bool, tokenizer) -> "ToolPlan":
        """The plan of a request's `tools` and `tool_choice` (None: "auto" with tools, "none" without).

        Raises:
            ConfigError: tool_choice asks a call with no tools given, or names a function not among them."""
        tools = tools or []
        if isinstance(tool_choice, dict):
            name = tool_choice.get("function", {}).get("name")
            if name not in {t["function"]["name"] for t in tools}:
                raise ConfigError(f"tool_choice names function {name!r}, which is not among the tools", HINT)
            return cls("named", tools, name=name, parallel=parallel)
        mode = tool_choice or ("auto" if tools else "none")
        if mode == "required" and not tools:
            raise ConfigError('tool_choice "required" needs tools', HINT)
        return cls(mode, tools, parallel=parallel, hermes=mode == "auto" and bool(tools) and speaks_hermes(tokenizer))

    @property
    def calls(self) -> bool:
        """Whether the output may hold tool calls (they are parsed, and a stream holds them back)."""
        return self.mode in ("named", "required") or self.hermes

    def structured(self) -> StructuredOutputsParams | None:
        """The constraint of "named" and "required" (None for the others)."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t["function"]["name"] == self.name)
            return StructuredOutputsParams(json={"x-guidance": CALL_JSON, **_parameters(tool)})
        if self.mode != "required":
            return None
        one = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                           "arguments": _parameters(t)},
                          "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]}
        return StructuredOutputsParams(json={"x-guidance": CALL_JSON, "type": "array", "items": one, "minItems": 1,
                                             **({} if self.parallel else {"maxItems": 1})})

    def parse(self, text: str, finish_reason: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a choice's text. An output cut by max_tokens, or one that is not the
        calls' JSON, stays text; "auto" keeps the text before the first call as the content (None when
        blank)."""
        if not self.calls or finish_reason == "length":
            return text, []
        try:
            if self.mode == "named":
                return None, [_call(self.name, json.loads(text))]
            if self.mode == "required":
                return None, [_call(c["name"], c["arguments"]) for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return text, []
        head, sep, rest = text.partition(OPEN)
        calls = []
        while sep:
            body, closed, rest = rest.partition(CLOSE)
            try:
                obj = json.loads(body)
                calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
            except (ValueError, TypeError, KeyError):
                return text, []  # not a call after all: the whole text is the answer
            _, sep, rest = rest.partition(OPEN)
        return (head.strip() or None) if calls else text, calls

    def held(self, text: str) -> int:
        """How many characters at the end of a streamed "auto" text to hold back: from a call's opening tag
        on, or a tail that could begin one (everything, for "named" and "required", whose text is calls)."""
        if not self.calls:
            return 0
        if self.mode != "auto":
            return len(text)
        at = text.find(OPEN)
        if at >= 0:
            return len(text) - at
        for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
            if OPEN.startswith(text[-k:]):
                return k
        return 0


def _call(name: str, arguments) -> dict:
    """An OpenAI tool call of `name` with `arguments` (a dict, or its JSON text)."""
    if not isinstance(name, str):
        raise TypeError("a call's name is a string")
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}
