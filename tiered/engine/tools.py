"""Tool calling in /v1/chat/completions (OpenAI's `tools` and `tool_choice`).

The tools go to the model's chat template (transformers' `apply_chat_template(tools=...)`, which renders
them as the model was trained to read them). What the model writes becomes `tool_calls` by `tool_choice`:

- "none": text, as without tools.
- a named function (`{"type": "function", "function": {"name": ...}}`): the output is constrained to that
  function's `parameters` schema (engine/structured.py) and is the call's `arguments`, written as
  json.dumps writes it (CALL_JSON).
- "required": the output is constrained to a JSON list of one or more calls (`{"name", "arguments"}`,
  each tool's own parameters; one call where `parallel_tool_calls` is false), as vLLM does.
- "auto" (the default with tools): unconstrained; calls are parsed out of the text in the format the chat
  template teaches (`call_format`): Hermes (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`:
  Qwen2.5 / Qwen3 / Qwen3-MoE, Hermes, SmolLM3), GLM-4.5 / 4.6's tags (`<tool_call>NAME<arg_key>k</arg_key>
  <arg_value>v</arg_value>...</tool_call>`, strings as they are, other values as JSON), Qwen3-Coder's XML
  (`<tool_call><function=NAME><parameter=k>v</parameter>...</function></tool_call>`, typed the same way), or a bare JSON answer
  (Llama 3.1-3.3's `{"name": ...,
  "parameters": {...}}`, several joined by ";", after `<|python_tag|>` where it is kept; Mistral's
  `[TOOL_CALLS] [{"name": ..., "arguments": ...}]`), or DeepSeek's (`<｜tool▁calls▁begin｜>` then per call
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and its arguments in a ```json fence (V3, R1), or
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS` (V3.1), each to `<｜tool▁call▁end｜>`; non-special tokens of its
  tokenizer, so they stay in the text); with any other template the answer is text. gpt-oss's harmony
  calls (`commentary to=functions.NAME` messages) are told apart with its reasoning (engine/reasoning.py), not here.

A choice with calls finishes "tool_calls" and its message's `content` is the text before the first call
(null when there is none).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from tiered.engine.reasoning import reasoning_format
from tiered.engine.structured import StructuredOutputsParams
from tiered.errors import ConfigError

OPEN, CLOSE = "<tool_call>", "</tool_call>"  # the Hermes format's call tags
# DeepSeek's (V3 / R1 / V3.1): the calls' opening, each call's opening, name-arguments separator and end
DS_CALLS, DS_CALL, DS_SEP, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
HINT = "fix tools / tool_choice"
# the JSON of constrained calls: json.dumps' separators and no other whitespace, as chat templates render calls
# (jinja's tojson) and as models were trained on them; a tool's own "x-guidance" whitespace options win
CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def call_id() -> str:
    """A new tool call's id ("call_" and 24 hex digits, as OpenAI's look)."""
    return "call_" + uuid.uuid4().hex[:24]


_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a function's name (protocol.ToolFunction's pattern)
_GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
# Qwen3-Coder's call body: <function=NAME> then <parameter=KEY>VALUE</parameter> each (VALUE between newlines)
XML_FUNCTION = "<function="
_XML_CALL = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
# the leading markers of a bare-JSON answer (Llama 3's <|python_tag|>, Mistral's [TOOL_CALLS]) where the text keeps
# them (they are special tokens: a detokenizer that skips those drops them)
JSON_MARKERS = ("<|python_tag|>", "[TOOL_CALLS]")


def call_format(tokenizer) -> str | None:
    """The call format the model's chat template teaches: "deepseek" (`<｜tool▁calls▁begin｜>`), "glm" (`<tool_call>`
    with `<arg_key>` / `<arg_value>` pairs), "xml" (`<tool_call>` with `<function=NAME>` and `<parameter=KEY>`:
    Qwen3-Coder's), "hermes" (it writes the `<tool_call>` tag), "json"
    (Llama 3's "Respond in the format {"name": function name, "parameters": ...}", Mistral's [TOOL_CALLS]),
    or None (no calls parsed)."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    if DS_CALLS in template:
        return "deepseek"
    if OPEN in template and "<arg_key>" in template:
        return "glm"
    if OPEN in template and XML_FUNCTION in template:
        return "xml"
    if OPEN in template:
        return "hermes"
    if '"parameters": dictionary of argument name' in template or "[TOOL_CALLS]" in template:
        return "json"
    return None


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
        format: the call format "auto" parses ("hermes", "glm", "xml", "deepseek" or "json", `call_format`; None:
            none).
        harmony: the template is gpt-oss's harmony (its calls are messages of their own: `structured`).
    """

    mode: str
    tools: list[dict] = field(default_factory=list)
    name: str | None = None
    parallel: bool = True
    format: str | None = None
    harmony: bool = False

    @classmethod
    def of(cls, tools: list[dict] | None, tool_choice, parallel: bool, tokenizer) -> "ToolPlan":
        """The plan of a request's `tools` and `tool_choice` (None: "auto" with tools, "none" without).

        Raises:
            ConfigError: tool_choice asks a call with no tools given, or names a function not among them."""
        tools = tools or []
        harmony = reasoning_format(tokenizer) == "harmony"
        if isinstance(tool_choice, dict):
            name = tool_choice.get("function", {}).get("name")
            if name not in {t["function"]["name"] for t in tools}:
                raise ConfigError(f"tool_choice names function {name!r}, which is not among the tools", HINT)
            return cls("named", tools, name=name, parallel=parallel, harmony=harmony)
        mode = tool_choice or ("auto" if tools else "none")
        if mode == "required" and not tools:
            raise ConfigError('tool_choice "required" needs tools', HINT)
        return cls(mode, tools, parallel=parallel, format=call_format(tokenizer) if mode == "auto" and tools else None,
                   harmony=harmony)

    @property
    def calls(self) -> bool:
        """Whether the output may hold tool calls (they are parsed, and a stream holds them back)."""
        return self.mode in ("named", "required") or self.format is not None

    def structured(self) -> StructuredOutputsParams | None:
        """The constraint of "named" and "required" (None for the others). A harmony model (gpt-oss) calls in its
        own format: after its optional analysis message, one `commentary to=functions.NAME <|constrain|>json` message
        whose body follows that tool's parameters (`harmony_call`); the engine reads it as a call
        (engine/reasoning.py)."""
        if self.harmony and self.mode in ("named", "required"):
            return harmony_call([t for t in self.tools if self.mode == "required" or t["function"]["name"] == self.name])
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
            if self.mode == "named":  # the arguments as written (a stream sends them so), checked to be JSON
                json.loads(text)
                return None, [tool_call(self.name, text)]
            if self.mode == "required":
                return None, [tool_call(c["name"], c["arguments"]) for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return text, []
        if self.format == "json":
            return _json_calls(text)
        if self.format == "deepseek":
            return _deepseek_calls(text)
        head, sep, rest = text.partition(OPEN)
        calls = []
        while sep:
            body, closed, rest = rest.partition(CLOSE)
            try:
                if self.format == "glm":
                    calls.append(self._glm_call(body))
                elif self.format == "xml":
                    calls.append(self._xml_call(body))
                else:
                    obj = json.loads(body)
                    calls.append(tool_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
            except (ValueError, TypeError, KeyError):
                return text, []  # not a call after all: the whole text is the answer
            _, sep, rest = rest.partition(OPEN)
        return (head.strip() or None) if calls else text, calls

    def answer(self, out) -> tuple[str | None, list[dict]]:
        """(content, calls) of a chat's RequestOutput `out`: harmony's calls where the engine read them
        (RequestOutput.tool_calls), else the calls `parse` finds in its content (its reasoning apart)."""
        if out.tool_calls:
            return out.content or None, [tool_call(name, args) for name, args in out.tool_calls]
        return self.parse(out.content, out.finish_reason)

    def _typed(self, name: str, key: str, value: str):
        """A parameter written as text, typed by the tool's schema: as written where it says string (or the tool has
        no such property and it is not JSON), else its JSON (the text where it is not JSON)."""
        tool = next((t for t in self.tools if t["function"]["name"] == name), None)
        if (_parameters(tool).get("properties", {}) if tool else {}).get(key, {}).get("type") == "string":
            return value
        try:
            return json.loads(value)
        except ValueError:
            return value

    def _xml_call(self, body: str) -> dict:
        """A Qwen3-Coder call's body: `<function=NAME>`, its `<parameter=KEY>` values (typed as `_typed` says), then
        `</function>`.

        Raises:
            ValueError: no function or a name that is not one (ToolFunction's pattern), or text beside its parts."""
        m = _XML_CALL.fullmatch(body)
        if m is None or not _NAME.fullmatch(m.group(1).strip()):
            raise ValueError("not a Qwen3-Coder tool call")
        name, params = m.group(1).strip(), m.group(2)
        args = {k.strip(): self._typed(name, k.strip(), v) for k, v in _XML_PARAM.findall(params)}
        if _XML_PARAM.sub("", params).strip():
            raise ValueError("text beside a Qwen3-Coder call's parameters")
        return tool_call(name, args)

    def _glm_call(self, body: str) -> dict:
        """A GLM-4.5 call's body: its function's name, then <arg_key> / <arg_value> pairs; a value is the text
        where the tool's schema says string (or has no such property and it is not JSON), else its JSON.

        Raises:
            ValueError: no function name (ToolFunction's pattern), or text between the pairs."""
        name, _, pairs = body.partition("<arg_key>")
        name, pairs = name.strip(), "<arg_key>" + pairs if pairs else ""
        args, rest = {}, pairs
        for m in _GLM_PAIR.finditer(pairs):
            key = m.group(1).strip()
            args[key] = self._typed(name, key, m.group(2))
            rest = rest.replace(m.group(0), "", 1)
        if not _NAME.fullmatch(name) or rest.strip():
            raise ValueError("not a GLM tool call")
        return tool_call(name, args)

    @property
    def opening(self) -> str | None:
        """The tag that opens the calls in the text ("auto" of a tagged format), None for bare-JSON calls."""
        return {"hermes": OPEN, "glm": OPEN, "xml": OPEN, "deepseek": DS_CALLS}.get(self.format)

    def content_end(self, text: str) -> int:
        """Where the text before a choice's calls ends in its `text` (which `parse` found calls in): the first
        call's opening tag; 0 where the calls are the whole answer."""
        return max(text.find(self.opening), 0) if self.opening else 0

    def held(self, text: str) -> int:
        """How many characters at the end of a streamed "auto" text to hold back: from a call's opening tag
        on, or a tail that could begin one (everything, for "named" and "required", whose text is calls)."""
        if not self.calls:
            return 0
        if self.mode != "auto":
            return len(text)
        if self.format == "json":  # a call is the whole answer: held while the answer may be one
            head = text.lstrip()
            for marker in JSON_MARKERS:
                if marker.startswith(head) or head.startswith(marker):
                    return len(text)
            return len(text) if not head or head[0] in "{[" else 0
        tag = self.opening
        at = text.find(tag)
        if at >= 0:
            return len(text) - at
        for k in range(min(len(tag) - 1, len(text)), 0, -1):
            if tag.startswith(text[-k:]):
                return k
        return 0


def _json_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, calls) of a bare-JSON answer: a call object (Llama 3: "parameters"), several joined by ";",
    or a list of them (Mistral: "arguments"), after a leading marker; anything else is text."""
    body = text.strip()
    for marker in JSON_MARKERS:
        body = body.removeprefix(marker).lstrip()
    if not body or body[0] not in "{[":
        return text, []
    decoder, objs, at = json.JSONDecoder(), [], 0
    try:
        while at < len(body):
            obj, at = decoder.raw_decode(body, at)
            objs += obj if isinstance(obj, list) else [obj]
            at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        calls = [tool_call(o["name"], o["arguments"] if "arguments" in o else o["parameters"]) for o in objs]
    except (ValueError, TypeError, KeyError):
        return text, []
    return None, calls


def harmony_call(tools: list[dict]) -> StructuredOutputsParams:
    """A harmony model's (gpt-oss's) output constrained to one call of one of `tools`, as its chat template teaches
    calls: its optional analysis message, then `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`
    and the arguments following NAME's parameters (CALL_JSON's separators); the model's `<|call|>` ends it."""
    from tiered.engine.structured import HARMONY_ANALYSIS

    calls = " | ".join(f"call{i}" for i in range(len(tools)))
    rules = [f'call{i}: <|channel|> {json.dumps("commentary to=functions." + t["function"]["name"] + " ")} '
             f'<|constrain|> "json" <|message|> %json {json.dumps({"x-guidance": CALL_JSON, **_parameters(t)})}'
             for i, t in enumerate(tools)]
    return StructuredOutputsParams(grammar="\n".join([f"start: analysis? ({calls})", HARMONY_ANALYSIS, *rules]),
                                   whole=True)


def _deepseek_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, calls) of a DeepSeek answer: the text before `<｜tool▁calls▁begin｜>`, then each call's name and
    arguments (V3 / R1: `function<｜tool▁sep｜>NAME`, a newline, the JSON in a ```json fence; V3.1:
    `NAME<｜tool▁sep｜>JSON`); anything that is not such a call leaves the whole text as the answer."""
    head, sep, rest = text.partition(DS_CALLS)
    calls = []
    for body in rest.split(DS_CALL)[1:] if sep else []:
        body = body.split(DS_END, 1)[0]
        first, tagged, args = body.partition(DS_SEP)
        if first.strip() == "function":  # V3 / R1: the name on the separator's line, the arguments fenced below
            name, _, args = args.partition("\n")
            args = args.strip()
            if args.startswith("```"):
                args = args.partition("\n")[2].rstrip().removesuffix("```")
        else:
            name = first
        name, args = name.strip(), args.strip()
        try:
            json.loads(args)
        except ValueError:
            return text, []
        if not tagged or not _NAME.fullmatch(name):
            return text, []
        calls.append(tool_call(name, args))
    return ((head.strip() or None), calls) if calls else (text, [])


def tool_call(name: str, arguments) -> dict:
    """An OpenAI tool call of `name` with `arguments` (a dict, or its JSON text)."""
    if not isinstance(name, str):
        raise TypeError("a call's name is a string")
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}
