"""The OpenAI-compatible HTTP API over a ServingEngine (FastAPI).

Endpoints: GET /v1/models, GET /v1/models/{model}, POST /v1/completions, POST
/v1/chat/completions (JSON or SSE stream, `data: [DONE]` last), vLLM's POST /tokenize, POST /detokenize
and GET /tokenizer_info (lm-eval-harness's remote tokenizer: it needs no local copy of the model's),
GET /health, GET /metrics (Prometheus text), GET /state (the tiers, JSON) and GET / (a chat page with
the live tiers). With an API key, /v1/* and the tokenizer's endpoints need `Authorization: Bearer
KEY` (401 otherwise). Errors are OpenAI's JSON shape
{"error": {"message", "type", "param", "code"}}: 400 for a bad body, an unknown model, an
unsupported parameter or a prompt over the context window, 401 for a wrong key, 404 / 405 for an
unknown path or method, 413 for a body larger than any prompt that fits, 500 for a failure, 503
with Retry-After when the queue is full and 503 when the server shuts down (a stream ends with an
error event and `data: [DONE]` instead).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from tiered.engine.prompt import encode_prompt
from tiered.engine.reasoning import ReasoningStream
from tiered.engine.sequence import RequestOutput
from tiered.errors import ContextLengthError, TieredError
from tiered.serve import anthropic, responses
from tiered.serve.engine import Handle, QueueFullError, ServerShuttingDownError, ServingEngine
from tiered.serve.metrics import ServerMetrics, tier_state
from tiered.serve.protocol import (ChatCompletionRequest, CompletionLogprobs, CompletionRequest, DetokenizeRequest,
                                   TokenizeRequest, chat_logprobs)
from tiered.engine.tools import ToolPlan, call_id, tool_call

STATIC = Path(__file__).parent / "static"  # the page at /
NO_TOOLS = ToolPlan("none")  # a request without tools: its text is its content
RETRY_AFTER_S = 1  # what a 503 (queue full) asks the client to wait
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
# A prompt of more characters than CHARS_PER_TOKEN x the context window cannot fit it: tokenizers put
# a few characters in a token on real text (~4 in English) and a few dozen at most on any. Such a
# prompt is refused before it is encoded (an 8 MB message took ~12 s to encode on 2 cores), and a
# body too large to hold a prompt that fits is refused before it is read.
CHARS_PER_TOKEN = 32
BODY_BYTES_PER_CHAR = 6  # JSON's worst case: a character as a \uXXXX escape
BODY_OVERHEAD_BYTES = 1 << 20  # room for the rest of a body (message structure, stop strings, token ids)
log = logging.getLogger("tiered.serve")


class APIError(Exception):
    """An error answered as OpenAI's JSON error object with HTTP `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers

    def body(self) -> dict:
        """{"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, path: str = "") -> JSONResponse:
        """The error as an HTTP response (in Anthropic's shape on its /v1/messages paths)."""
        body = anthropic.error_body(self.status, self.message, self.code) if path.startswith("/v1/messages") else \
            self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _bad_request(e: TieredError, param: str | None = None) -> APIError:
    """The 400 of a request the engine refused with TieredError `e`: its message and, in brackets, its hint."""
    return APIError(400, e.message + (f" ({e.hint})" if e.hint else ""), param=param)


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry once it is back", "server_error", "server_shutting_down")


class _Guard:
    """ASGI middleware around the app: refuses a body over `max_body_bytes` with 413 (by its
    Content-Length before reading it, or as soon as a chunked body passes the limit), and answers an
    exception that no handler caught with OpenAI's JSON 500 (and a logged traceback) instead of a
    plain-text 500 on a dropped connection. Counts both in `metrics` for /v1/* paths."""

    def __init__(self, app, max_body_bytes: int, metrics: ServerMetrics) -> None:
        self.app, self.max_body_bytes, self.metrics = app, max_body_bytes, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        api = scope["path"].startswith("/v1/")
        too_large = APIError(413, f"the request body is larger than this server takes ({self.max_body_bytes} bytes: "
                             "more than a prompt that fits the context window)", code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            if api:
                self.metrics.count_request("invalid", 413)
            await too_large.response(scope["path"])(scope, receive, send)
            return
        started = False
        received = 0

        async def guarded_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:  # FastAPI answers it through the HTTPException handler
                    raise StarletteHTTPException(413, too_large.message)
            return message

        async def watched_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, guarded_receive, watched_send)
        except Exception as e:  # noqa: BLE001 - a bug in a handler: answer it as OpenAI's error object
            if started:
                raise  # mid-response (a stream): nothing else can be said
            log.exception("%s %s failed", scope.get("method"), scope["path"])
            if api:
                self.metrics.count_request("error", 500)
            await APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error").response(scope["path"])(
                scope, receive, send)


# Browser pages whose requests the server answers with CORS headers (the Fetch standard's cross-origin checks) by
# default: pages served from this machine, any scheme and port (a web UI on localhost:3000 calling the API on
# :8000), as Ollama allows by default. A page elsewhere gets no CORS headers, so its browser does not let it read the
# answers (the server binds 127.0.0.1 by default, but any site the user visits can reach that from the browser).
LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


def build_app(engine: ServingEngine, model_name: str, api_key: str | None = None, reasoning: bool = True,
              allowed_origins: tuple[str, ...] = ()) -> FastAPI:
    """The FastAPI application. Its lifespan starts the engine thread (unless the engine is run on
    a thread of the caller's: ServingEngine.run) and stops the engine at shutdown.

    Args:
        engine: the ServingEngine (not yet started, or stepped by `run` on another thread).
        model_name: the id /v1/models lists; requests must name it.
        api_key: when set, /v1/* requires `Authorization: Bearer <api_key>`.
        reasoning: a reasoning model's chat answers its reasoning apart, as `reasoning` (vLLM's and OpenRouter's, OpenAI's
            guidance for gpt-oss) and `reasoning_content` (DeepSeek's API
            and llama.cpp's field; engine/reasoning.py), and harmony's tool calls as tool_calls; False: the
            whole output is the content, as the model wrote it.
        allowed_origins: browser origins (scheme://host[:port]) allowed to call the API besides LOCAL_ORIGINS'
            pages (CORS: preflights answered, responses carrying Access-Control-Allow-Origin; the Authorization
            header allowed, so an API key still applies); "*" allows every origin.
    """

    # the sampling the model's authors ship (generation_config.json), for requests that leave it out
    sampling_defaults = engine.llm.checkpoint.generation_defaults()

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        """The engine steps while the app serves."""
        if not engine.external:
            engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="tiered", lifespan=lifespan)
    created = int(time.time())
    max_prompt_chars = CHARS_PER_TOKEN * engine.llm.max_context
    app.add_middleware(_Guard, max_body_bytes=BODY_BYTES_PER_CHAR * max_prompt_chars + BODY_OVERHEAD_BYTES,
                       metrics=engine.metrics)
    # outside the guard: a preflight is answered before it, and its 413s and 500s carry the CORS headers too
    every = "*" in allowed_origins
    app.add_middleware(CORSMiddleware, allow_origins=["*"] if every else list(allowed_origins),
                       allow_origin_regex=None if every else LOCAL_ORIGINS, allow_methods=["GET", "POST"],
                       allow_headers=["*"], max_age=600)

    def refused(request: Request, error: APIError) -> JSONResponse:
        """The response of a /v1/* request refused before the engine saw it, counted in the metrics
        (what the engine refuses or fails, it counts itself)."""
        if request.url.path.startswith("/v1/") and 400 <= error.status < 500:
            engine.metrics.count_request("invalid", error.status)
        return error.response(request.url.path)  # Anthropic's clients read Anthropic's shape

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return refused(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        status, where = exc.status_code, f"{request.method} {request.url.path}"
        message, code = {404: (f"no such endpoint: {where}", "unknown_url"),
                         405: (f"method not allowed: {where}", "method_not_allowed")}.get(
            status, (str(exc.detail), "request_too_large" if status == 413 else None))
        return refused(request, APIError(status, message, code=code, headers=exc.headers))

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":  # loc is ("body", character offset)
            at = first.get("loc", ("body", "?"))[-1]
            reason = (first.get("ctx") or {}).get("error", "malformed JSON")
            return refused(request, APIError(400, f"the body is not valid JSON: {reason} at character {at}"))
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return refused(request, APIError(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}",
                                         param=where or None))

    async def check_key(request: Request) -> None:
        """Raise APIError 401 unless the request carries `Authorization: Bearer <api_key>` (the
        scheme in any case, as HTTP has it) or `x-api-key: <api_key>` (Anthropic's header)."""
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        if "x-api-key" in request.headers:
            scheme, given = "bearer", request.headers["x-api-key"]
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                           "authentication_error", "invalid_api_key")

    @app.get("/health")
    async def health() -> dict:
        """Liveness: {"status": "ok"} while the server answers."""
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        """Prometheus text: requests, tokens, TTFT / ITL summaries, batch, queue, KV cache bytes, expert hit rate."""
        text = engine.metrics.render(engine.scheduler.num_waiting, engine.scheduler.num_running,
                                     engine.llm.runtime_stats(), kv=engine.cache)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/state")
    async def state() -> dict:
        """The live state of the tiers (serve/metrics.tier_state), which the page at / polls."""
        return {"served_model": model_name, **tier_state(engine.llm, engine.metrics, engine.scheduler.num_waiting,
                                                           engine.scheduler.num_running, kv=engine.cache)}

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        """The chat page with the live view of the tiers (plain HTML and JS, tiered/serve/static)."""
        return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"))

    # OpenAI's model object and Anthropic's fields beside (type, display_name, created_at): both SDKs read it
    model_object = {"id": model_name, "object": "model", "created": created, "owned_by": "tiered", "type": "model",
                    "display_name": model_name,
                    "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))}

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models() -> dict:
        """The one model this server serves (OpenAI's list, with Anthropic's paging fields)."""
        return {"object": "list", "data": [model_object], "has_more": False, "first_id": model_name,
                "last_id": model_name}

    @app.get("/v1/models/{model:path}", dependencies=[Depends(check_key)])
    async def model_info(model: str) -> dict:
        """The model object of `model` (404 model_not_found for any other id)."""
        if model != model_name:
            raise APIError(404, f"model {model!r} is not served here; this server serves {model_name!r}",
                           code="model_not_found", param="model")
        return model_object

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI's text completion: each prompt as it is (no chat template), n choices each."""
        return await _generate(request, body, body.prompts, chat=False, default_max_tokens=16, kind="completion")

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        """OpenAI's chat completion: the messages through the model's chat template."""
        messages = [m.as_dict() for m in body.messages]
        try:
            tools = body.tool_plan(engine.llm.tokenizer)
        except TieredError as e:
            raise _bad_request(e, param="tool_choice")
        return await _generate(request, body, [messages], chat=True, default_max_tokens=engine.llm.max_context,
                               kind="chat", tools=tools, template_kwargs=body.template_kwargs())

    @app.post("/v1/messages", dependencies=[Depends(check_key)])
    async def messages(body: anthropic.MessagesRequest, request: Request):
        """Anthropic's Messages API (serve/anthropic.py) through the chat template; whatever model it names (an
        Anthropic client names Claude models), the served model answers."""
        chat, tools = _translated(lambda: body.chat_request(model_name))
        handles = await _start(chat, [[m.as_dict() for m in chat.messages]], True, engine.llm.max_context, tools,
                               chat.template_kwargs())
        mid = anthropic.message_id()
        if body.stream:
            return StreamingResponse(_message_events(handles[0], mid, tools), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        outs = await _collect(request, handles)
        if outs is None:  # the client went away
            return JSONResponse({}, status_code=499)
        return anthropic.message(mid, model_name, outs[0], *answer(outs[0], tools))

    @app.post("/v1/messages/count_tokens", dependencies=[Depends(check_key)])
    async def count_tokens(body: anthropic.CountTokensRequest) -> dict:
        """Anthropic's token count of a Messages request: {"input_tokens": the prompt's tokens through the chat
        template, its tools included}."""
        chat, plan = _translated(lambda: body.chat_request(model_name))
        prompt = [m.as_dict() for m in chat.messages]
        check_prompt_chars(prompt, "messages")
        try:
            ids = await run_in_threadpool(encode_prompt, tokenizer(), prompt, True, tools=plan.tools or None,
                                          template_kwargs=chat.template_kwargs(),
                                          continue_final=chat.continue_final_message)
        except TieredError as e:
            raise _bad_request(e) from e
        return {"input_tokens": len(ids)}

    def _translated(make) -> tuple[ChatCompletionRequest, ToolPlan]:
        """The chat completion another API's request asks for (`make()`: a Messages or Responses request's
        chat_request) and its tool plan, or APIError 400 for what the translation or the chat request refuses."""
        try:
            chat = make()
            return chat, chat.tool_plan(engine.llm.tokenizer)
        except ValidationError as e:  # what the chat request refuses (a tool's name, a sampling bound)
            first = e.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise APIError(400, f"{where}: {first.get('msg', 'invalid')}") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except TieredError as e:
            raise _bad_request(e, param="tool_choice") from None

    async def _answer_parts(handle: Handle, tools: ToolPlan):
        """One streamed chat answer told apart as it comes, for the Messages and Responses streams: ("thinking",
        text) and ("text", text) pieces (with tools, the text from where a call may begin held back, ToolPlan.held),
        then ("end", out, calls, thought, content): the RequestOutput, its calls (harmony's, or those parsed out of
        its text), its whole reasoning and the text before the calls; or ("error", APIError). Closing it cancels the
        request (the client went away mid-stream; a no-op when it finished)."""
        seq = handle.seq
        thinking = ReasoningStream(seq.reasoning_format, seq.thinking_opened) if reasoning and seq.reasoning_format \
            else None
        held = tools.calls  # the text may hold calls: stream it up to where one may begin
        text, sent, thoughts = "", 0, ""
        try:
            while True:
                ev = await handle.events.get()
                if isinstance(ev, Exception):
                    yield ("error", _shutting_down() if isinstance(ev, ServerShuttingDownError) else
                           APIError(500, f"generation failed: {ev}", "server_error"))
                    return
                delta, out, _ = ev
                harmony = []
                if thinking is not None:
                    thought, delta = thinking.feed(delta)
                    if out is not None:
                        more, rest, harmony = thinking.finish()
                        thought, delta = thought + more, delta + rest
                    thoughts += thought
                    yield ("thinking", thought)
                text += delta
                if out is None:
                    upto = len(text) - tools.held(text) if held else len(text)
                    yield ("text", text[sent:upto])
                    sent = max(sent, upto)
                    continue
                calls = [tool_call(name, args) for name, args in harmony]
                upto = len(text)
                if held and not calls:
                    full = out.content if thinking is not None else out.text
                    calls = tools.parse(full, out.finish_reason)[1]
                    text, upto = full, tools.content_end(full) if calls else len(full)
                yield ("text", text[sent:upto])
                yield ("end", out, calls, thoughts or None, text[:upto].strip() or None)
                return
        finally:
            engine.cancel(handle)

    async def _events(handle: Handle, tools: ToolPlan, start, piece, end, error):
        """An event stream of one answer: start() first, then piece(kind, text) of each thinking / text piece,
        end(out, calls, thought, content) at its end or error(APIError), each returning the events' text; empty
        texts are not sent (an empty body chunk may read as the end of a chunked body)."""
        parts = _answer_parts(handle, tools)
        try:
            yield start()
            async for part in parts:
                text = (error(part[1]) if part[0] == "error" else end(*part[1:]) if part[0] == "end" else
                        piece(*part))
                if text:
                    yield text
        finally:
            await parts.aclose()

    def _message_events(handle: Handle, mid: str, tools: ToolPlan):
        """Anthropic's event stream of one answer (anthropic.MessageStream): its reasoning as a thinking block, its
        text as a text block, its calls as tool_use blocks at the end, then the stop reason and usage."""
        blocks = anthropic.MessageStream()

        def start() -> str:
            return anthropic.event("message_start", {"message": {
                "id": mid, "type": "message", "role": "assistant", "model": model_name, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": anthropic.usage(len(handle.seq.prompt_ids), 0, 0)}})

        def end(out, calls, thought, content) -> str:
            reason, stop = anthropic.stop_reason(out.finish_reason, out.stop_string, bool(calls))
            usage = anthropic.usage(len(out.prompt_token_ids), out.stats.cached_tokens, len(out.token_ids))
            return ("".join(blocks.tool(call) for call in calls) + blocks.close()
                    + anthropic.event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": stop},
                                                        "usage": usage})
                    + anthropic.event("message_stop", {}))

        return _events(handle, tools, start,
                       lambda kind, text: blocks.thinking(text) if kind == "thinking" else blocks.text(text), end,
                       lambda err: anthropic.event("error", {"error": anthropic.error_body(err.status,
                                                                                           err.message)["error"]}))

    kept = responses.ResponseStore()

    @app.post("/v1/responses", dependencies=[Depends(check_key)])
    async def create_response(body: responses.ResponsesRequest, request: Request):
        """OpenAI's Responses API (serve/responses.py) through the chat template."""
        history = []
        if body.previous_response_id is not None:
            found = kept.get(body.previous_response_id)
            if found is None:
                raise APIError(400, f"previous response {body.previous_response_id!r} is not kept here (the last "
                               f"{kept.most} stored responses are, in memory): send the whole conversation as input",
                               param="previous_response_id")
            history = found[1]
        try:
            conversation = history + body.input_messages()
        except ValueError as e:  # an item this server cannot take
            raise APIError(400, str(e)) from None
        chat, tools = _translated(lambda: body.chat_request(model_name, conversation))
        handles = await _start(chat, [[m.as_dict() for m in chat.messages]], True, engine.llm.max_context, tools,
                               chat.template_kwargs())
        rid, created = responses.new_id("resp"), int(time.time())
        if body.stream:
            return StreamingResponse(_response_events(handles[0], rid, created, body, tools, conversation),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        outs = await _collect(request, handles)
        if outs is None:  # the client went away
            return JSONResponse({}, status_code=499)
        out = outs[0]
        thought, content, calls = answer(out, tools)
        status = responses.status(out, calls)
        obj = responses.response_object(rid, created, model_name, body, status,
                                        responses.output_items(thought, content, calls, status == "completed"), out)
        if body.store:
            kept.put(obj, conversation + [responses.answer_message(thought, content, calls)])
        return obj

    @app.get("/v1/responses/{rid}", dependencies=[Depends(check_key)])
    async def get_response(rid: str) -> dict:
        """A stored response (404 where it is not kept)."""
        found = kept.get(rid)
        if found is None:
            raise APIError(404, f"no response {rid!r} is kept here", code="not_found", param="response_id")
        return found[0]

    @app.delete("/v1/responses/{rid}", dependencies=[Depends(check_key)])
    async def delete_response(rid: str) -> dict:
        """Forget a stored response (404 where it is not kept)."""
        if not kept.delete(rid):
            raise APIError(404, f"no response {rid!r} is kept here", code="not_found", param="response_id")
        return {"id": rid, "object": "response.deleted", "deleted": True}

    def _response_events(handle: Handle, rid: str, created: int, body: responses.ResponsesRequest, tools: ToolPlan,
                         conversation: list[dict]):
        """The Responses API's event stream of one answer (responses.ResponseStream): its reasoning as a reasoning
        item, its text as a message item, its calls as function_call items at the end, then response.completed (or
        incomplete) with the whole Response, which is kept where `store` says."""
        st = responses.ResponseStream()

        def start() -> str:
            obj = responses.response_object(rid, created, model_name, body)
            return st.event("response.created", {"response": obj}) + st.event("response.in_progress", {"response": obj})

        def end(out, calls, thought, content) -> str:
            status = responses.status(out, calls)
            events = st.close(status) + "".join(st.call(call) for call in calls)
            obj = responses.response_object(rid, created, model_name, body, status, st.items, out)
            if body.store:
                kept.put(obj, conversation + [responses.answer_message(thought, content, calls)])
            return events + st.event(f"response.{status}", {"response": obj})

        def error(err: APIError) -> str:
            failed = responses.response_object(rid, created, model_name, body, "failed", st.items)
            failed["error"] = {"code": "server_error", "message": err.message}
            return (st.event("error", {"code": err.code or err.type, "message": err.message, "param": None})
                    + st.event("response.failed", {"response": failed}))

        return _events(handle, tools, start,
                       lambda kind, text: st.reasoning(text) if kind == "thinking" else st.text(text), end, error)

    def tokenizer():
        """The model's tokenizer, or APIError 400 where the checkpoint has none."""
        if engine.llm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", code="no_tokenizer")
        return engine.llm.tokenizer

    def check_model(model: str | None) -> None:
        if model is not None and model != model_name:
            raise APIError(400, f"model {model!r} is not served here; this server serves {model_name!r}",
                           code="model_not_found", param="model")

    def check_prompt_chars(prompt, param: str) -> None:
        """APIError 400 context_length_exceeded for a prompt (text, messages or token ids) of more characters
        than the context window can hold: refused without the seconds its encoding would take."""
        chars = len(prompt) if isinstance(prompt, str) else sum(len(m["content"] or "") for m in prompt
                                                                if isinstance(m, dict))
        if chars > max_prompt_chars:
            raise APIError(400, f"the prompt has {chars} characters, more than a context window of "
                           f"{engine.llm.max_context} tokens holds", code="context_length_exceeded", param=param)

    @app.post("/tokenize", dependencies=[Depends(check_key)])
    async def tokenize(body: TokenizeRequest) -> dict:
        """vLLM's /tokenize: {"count", "max_model_len", "tokens"}: a text as a completion's prompt is
        encoded (add_special_tokens false: without the BOS), messages (with their tools) as a chat's prompt is."""
        check_model(body.model)
        tok = tokenizer()
        prompt = [m.as_dict() for m in body.messages] if body.messages is not None else body.prompt
        check_prompt_chars(prompt, "messages" if body.messages is not None else "prompt")
        # as a completion's prompt (chat=False) or a chat's is encoded
        try:
            ids = await run_in_threadpool(encode_prompt, tok, prompt, False, body.add_generation_prompt,
                                          body.add_special_tokens, [t.model_dump(exclude_none=True) for t in body.tools or []])
        except TieredError as e:  # messages without a chat template
            raise _bad_request(e) from e
        return {"count": len(ids), "max_model_len": engine.llm.max_context, "tokens": ids}

    @app.post("/detokenize", dependencies=[Depends(check_key)])
    async def detokenize(body: DetokenizeRequest) -> dict:
        """vLLM's /detokenize: {"prompt": the tokens' text} (special tokens kept)."""
        check_model(body.model)
        vocab = engine.llm.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens")
        return {"prompt": tokenizer().decode(body.tokens)}

    @app.get("/tokenizer_info", dependencies=[Depends(check_key)])
    async def tokenizer_info() -> dict:
        """vLLM's /tokenizer_info: the special tokens, the chat template and the context window."""
        tok = tokenizer()
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "unk_token": tok.unk_token, "chat_template": tok.chat_template,
                "model_max_length": engine.llm.max_context, "add_bos_token": getattr(tok, "add_bos_token", None)}

    def submit(prompts: list, params, chat: bool, loop, n: int, tools: ToolPlan | None,
               template_kwargs: dict | None, stream: bool, generation_prompt: bool = True,
               continued: bool = False) -> list[Handle]:
        """engine.submit of a request's prompts (on a worker thread: encoding takes a while); a chat with
        tools or template variables, without the `generation_prompt` or `continued` (its last message left open:
        continue_final_message), is encoded here (the chat template renders them), and submitted as a chat's
        token ids."""
        if chat and ((tools is not None and tools.tools) or template_kwargs or continued or not generation_prompt):
            prompts = [encode_prompt(engine.llm.tokenizer, prompts[0], True, generation_prompt,
                                     tools=tools.tools if tools else None, template_kwargs=template_kwargs,
                                     continue_final=continued)]
        return engine.submit(prompts, params, chat, loop, n, stream)

    async def _generate(request: Request, body, prompts: list, chat: bool, default_max_tokens: int, kind: str,
                        tools: ToolPlan | None = None, template_kwargs: dict | None = None):
        """Answer `body` over its `prompts` (a completion's batch, or chat's one message list), n choices
        each: choice p * n + j is prompt p's j-th. `tools`: how a chat's output becomes tool calls;
        `template_kwargs`: a chat template's extra variables."""
        handles = await _start(body, prompts, chat, default_max_tokens, tools, template_kwargs)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        echo = _Echo(engine.llm.tokenizer, body, prompts) if kind == "completion" else None
        if body.stream:
            return StreamingResponse(_sse(handles, rid, kind, body.include_usage, echo, tools,
                                          getattr(body, "include_reasoning", True)),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        outs = await _collect(request, handles)
        if outs is None:  # the client went away
            return JSONResponse({}, status_code=499)
        return _answer(body, outs, kind, rid, echo, tools)

    async def _start(body, prompts: list, chat: bool, default_max_tokens: int, tools: ToolPlan | None,
                     template_kwargs: dict | None) -> list[Handle]:
        """`body`'s prompts submitted (n choices each), or the APIError that refuses them."""
        check_model(body.model)
        for prompt in prompts:
            check_prompt_chars(prompt, "messages" if chat else "prompt")
        if body.n * len(prompts) > engine.capacity:
            what = f"n = {body.n} choices" + (f" of {len(prompts)} prompts" if len(prompts) > 1 else "")
            raise APIError(400, f"{what} are more than this server runs or queues at once "
                           f"({engine.capacity}: --max-batch plus --max-queue)", param="n" if len(prompts) == 1 else "prompt")
        try:
            params = body.sampling(default_max_tokens, sampling_defaults, engine.llm.tokenizer)
            # encoding a long prompt takes a while: on a worker thread, not the event loop's
            handles = await run_in_threadpool(submit, prompts, params, chat, asyncio.get_running_loop(), body.n, tools,
                                              template_kwargs, body.stream, getattr(body, "add_generation_prompt", True),
                                              getattr(body, "continue_final_message", False))
        except QueueFullError as e:
            raise APIError(503, e.message, "server_error", "queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        except ServerShuttingDownError as e:
            raise _shutting_down() from e
        except ContextLengthError as e:
            raise APIError(400, e.message, code="context_length_exceeded", param="messages" if chat else "prompt")
        except TieredError as e:
            raise _bad_request(e)
        return handles

    def _answer(body, outs: list[RequestOutput], kind: str, rid: str, echo: "_Echo | None",
                tools: ToolPlan | None) -> dict:
        """The chat.completion or text_completion object of a request's finished choices."""
        choices = []
        for i, out in enumerate(outs):
            if kind == "chat":
                logprobs = None if out.logprobs is None else chat_logprobs(engine.llm.tokenizer, out.logprobs)
                reasoning, content, calls = answer(out, tools)
                message = ({"role": "assistant", "content": content}
                           | ({"reasoning": reasoning, "reasoning_content": reasoning}
                              if reasoning and body.include_reasoning else {})
                           | ({"tool_calls": calls} if calls else {}))
                choices.append({"index": i, "message": message, "logprobs": logprobs,
                                "finish_reason": "tool_calls" if calls else out.finish_reason})
                continue
            text = echo.text(i, out.prompt_token_ids)
            parts = [echo.logprobs(out.prompt_logprobs, out.prompt_token_ids)] if echo.on and out.logprobs is not None else []
            if not echo.scores_only:  # the completion's logprobs: its text's offsets after the echoed prompt
                parts += [] if out.logprobs is None else [
                    CompletionLogprobs(engine.llm.tokenizer, offset=len(text)).add(out.logprobs)]
                text += out.text
            choices.append({"index": i, "text": text, "finish_reason": echo.finish(out.finish_reason),
                            "logprobs": {k: sum((p[k] for p in parts), []) for k in parts[0]} if parts else None})
        return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": model_name, "choices": choices,
                "usage": _usage(outs, body.n, echo is not None and echo.scores_only)}

    def answer(out: RequestOutput, tools: ToolPlan | None) -> tuple[str | None, str | None, list[dict]]:
        """(reasoning, content, tool calls) of a chat choice's output: its reasoning apart where `reasoning` is on
        (RequestOutput.reasoning, and ToolPlan.answer: harmony's calls, or those `tools` parses out of the
        content); else the whole text as the model wrote it, its calls parsed out of it."""
        tools = tools or NO_TOOLS
        if not reasoning:
            return (None, *tools.parse(out.text, out.finish_reason))
        return (out.reasoning, *tools.answer(out))

    async def _collect(request: Request, handles: list[Handle]) -> list[RequestOutput] | None:
        """Wait for each choice's output; None (and the request cancelled) if the client disconnects."""
        loop = asyncio.get_running_loop()
        checked = loop.time()
        outs: list[RequestOutput] = []
        try:
            for i, handle in enumerate(handles):  # they run together: waiting in turn waits for the slowest
                while len(outs) == i:
                    try:
                        event = await asyncio.wait_for(handle.events.get(), timeout=DISCONNECT_POLL_S)
                    except asyncio.TimeoutError:
                        event = None
                    if loop.time() - checked >= DISCONNECT_POLL_S:  # on a clock: events may never pause
                        checked = loop.time()
                        if await request.is_disconnected():
                            return None
                    if event is None:
                        continue
                    if isinstance(event, ServerShuttingDownError):
                        raise _shutting_down()
                    if isinstance(event, Exception):
                        raise APIError(500, f"generation failed: {event}", "server_error")
                    _, out, _ = event
                    if out is not None:
                        outs.append(out)
            return outs
        finally:
            for handle in handles:
                engine.cancel(handle)  # a no-op when it finished

    async def _sse(handles: list[Handle], rid: str, kind: str, include_usage: bool, echo: "_Echo | None",
                   tools: ToolPlan | None = None, include_reasoning: bool = True):
        """The OpenAI chunk stream: each choice's deltas and its last chunk with finish_reason (chunks
        carry their choice's index), then usage if asked, then [DONE]. With a completion's `echo`, a
        choice's first chunk is its prompt (with the prompt's logprobs where asked), sent when its
        first token is (the prompt's logprobs come from its prefill). A chat whose output may hold tool
        calls (`tools`) holds back the text from where a call may begin (ToolPlan.held) and sends the
        calls in one chunk at the end, before the finishing one; a named function's call streams its
        arguments as they come (the first chunk with the call's id and name), as OpenAI's do. A reasoning model's
        reasoning streams as `reasoning` / `reasoning_content` deltas (left out with `include_reasoning` False, vLLM's)."""
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        created = int(time.time())
        n = len(handles)
        # per choice: logprobs of tokens whose text is not streamed yet (None: not asked), and a
        # completion's tokens so far (their offsets)
        pending: list[list | None] = [None] * n
        completions = [CompletionLogprobs(engine.llm.tokenizer) for _ in range(n)]
        events: asyncio.Queue = asyncio.Queue()  # (choice, event) of every choice, as they come (n > 1)

        async def forward(i: int, handle: Handle) -> None:
            while True:
                event = await handle.events.get()
                events.put_nowait((i, event))
                if isinstance(event, Exception) or event[1] is not None:
                    return

        async def next_event() -> tuple[int, object]:
            """The next (choice, event): one choice's straight from its queue (no task between)."""
            return (0, await handles[0].events.get()) if n == 1 else await events.get()

        def chunk(i: int, text: str | None, finish: str | None = None, role: bool = False,
                  logprobs: dict | None = None, calls: list[dict] | None = None, thought: str | None = None) -> str:
            """One SSE event of choice i: a text delta, the finishing chunk, chat's opening role chunk, a chat's
            tool calls, or its reasoning's delta (`thought`); it carries the choice's pending logprobs (or
            `logprobs`, an echoed prompt's)."""
            if pending[i] is not None and not role and logprobs is None:
                logprobs, pending[i] = _logprobs(kind, pending[i], completions[i]), []
            if kind == "chat":
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                if thought:
                    delta["reasoning"] = delta["reasoning_content"] = thought
                if calls:
                    delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
                choice = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            else:
                choice = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
            data = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice]}
            if include_usage:
                data["usage"] = None
            return f"data: {json.dumps(data)}\n\n"

        echoed = [False] * n
        texts, sent = [""] * n, [0] * n  # with tools: each choice's text so far, and how much of it went out
        # a reasoning model's chat: each choice's output told apart as it streams (engine/reasoning.py)
        thinking = [ReasoningStream(h.seq.reasoning_format, h.seq.thinking_opened)
                    if reasoning and kind == "chat" and h.seq.reasoning_format else None for h in handles]
        forwarders = [asyncio.ensure_future(forward(i, h)) for i, h in enumerate(handles)] if n > 1 else []
        outs: list[RequestOutput | None] = [None] * n
        try:
            if kind == "chat":
                for i in range(n):
                    yield chunk(i, None, role=True)
            while any(out is None for out in outs):
                i, event = await next_event()
                if isinstance(event, Exception):  # an error event, then the stream's usual end
                    err = (_shutting_down() if isinstance(event, ServerShuttingDownError) else
                           APIError(500, f"generation failed: {event}", "server_error"))
                    yield f"data: {json.dumps(err.body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                delta, out, new_logprobs = event
                if echo is not None and echo.on and not echoed[i]:  # the prompt first, once its prefill is done
                    echoed[i] = True
                    seq = handles[i].seq
                    text = echo.text(i, seq.prompt_ids)
                    completions[i].offset = len(text)
                    yield chunk(i, text, logprobs=echo.logprobs(seq.prompt_logprobs, seq.prompt_ids) if seq.prompt_logprobs is not None else None)
                if echo is not None and echo.scores_only:  # the one token generated is no part of the answer
                    delta, new_logprobs = "", None
                if new_logprobs is not None:
                    pending[i] = (pending[i] or []) + new_logprobs
                if thinking[i] is not None:  # the reasoning goes out as it comes; the answer goes on as the text
                    thought, delta = thinking[i].feed(delta)
                    harmony = []
                    if out is not None:
                        more, rest, harmony = thinking[i].finish()
                        thought, delta = thought + more, delta + rest
                    if thought and include_reasoning:
                        yield chunk(i, None, thought=thought)
                    if harmony:  # gpt-oss's calls (commentary to=functions.NAME)
                        if delta:
                            yield chunk(i, delta)
                        yield chunk(i, None, calls=[tool_call(name, args) for name, args in harmony])
                        outs[i] = out
                        yield chunk(i, None, finish="tool_calls")
                        continue
                if tools is not None and tools.mode == "named":  # the text is the call's arguments: their deltas
                    if delta:
                        head = {} if sent[i] else {"id": call_id(), "type": "function"}
                        sent[i] += len(delta)
                        fn = {"arguments": delta} | ({"name": tools.name} if head else {})
                        yield chunk(i, None, calls=[head | {"function": fn}])
                    if out is not None:
                        outs[i] = out
                        yield chunk(i, None, finish="tool_calls" if out.finish_reason == "stop" else out.finish_reason)
                    continue
                if tools is not None and tools.calls:  # the text from where a call may begin waits
                    text = texts[i] = texts[i] + delta if out is None else (out.content if thinking[i] else out.text)
                    calls = tools.parse(text, out.finish_reason)[1] if out is not None else []
                    # the text to have sent: up to what may begin a call; at the end, all of it, or the
                    # text before the first call
                    upto = (len(text) - tools.held(text) if out is None else
                            tools.content_end(text) if calls else len(text))
                    delta, sent[i] = text[sent[i]:upto], max(sent[i], upto)
                    if calls:
                        if delta:
                            yield chunk(i, delta)
                        yield chunk(i, None, calls=calls)
                        outs[i] = out
                        yield chunk(i, None, finish="tool_calls")
                        continue
                if delta:
                    yield chunk(i, delta)
                if out is not None:
                    outs[i] = out
                    yield chunk(i, None, finish=echo.finish(out.finish_reason) if echo else out.finish_reason)
            if include_usage:
                data = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [],
                        "usage": _usage(outs, echo.n if echo else n, echo is not None and echo.scores_only)}
                yield f"data: {json.dumps(data)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for f in forwarders:
                f.cancel()
            for handle in handles:
                engine.cancel(handle)  # the client went away mid-stream (a no-op when it finished)

    def _logprobs(kind: str, entries: list, completion: CompletionLogprobs) -> dict:
        """A choice's logprobs of `entries`: chat's, or the next of `completion` (its tokens so far)."""
        return chat_logprobs(engine.llm.tokenizer, entries) if kind == "chat" else completion.add(entries)

    return app


def _usage(outs: list[RequestOutput], n: int, scores_only: bool = False) -> dict:
    """OpenAI's usage object of a request's choices, `n` a prompt (choice p * n + j prompt p's j-th):
    each prompt counted once, the completion tokens of every choice (none where the prompt was only
    scored: `scores_only`); prompt_tokens_details.cached_tokens counts the prompt tokens whose KV was
    not computed for each prompt's first choice (prefix reuse)."""
    firsts = outs[::n]
    n_prompt = sum(len(out.prompt_token_ids) for out in firsts)
    n_gen = 0 if scores_only else sum(len(out.token_ids) for out in outs)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen,
            "prompt_tokens_details": {"cached_tokens": sum(out.stats.cached_tokens for out in firsts)}}


class _Echo:
    """A completion request's prompts, as `echo` puts them before each choice (choice i is prompt
    i // n's): a text prompt as sent, token ids decoded with their special tokens; and their tokens'
    logprobs (protocol.CompletionLogprobs of an echoed prompt). `on` False: nothing is echoed."""

    def __init__(self, tokenizer, body: CompletionRequest, prompts: list) -> None:
        self.tokenizer, self.prompts, self.n = tokenizer, prompts, body.n
        self.on, self.scores_only = body.echo, body.scores_only

    def text(self, i: int, ids: list[int]) -> str:
        """Choice i's echoed prompt ("" without echo); `ids` its token ids."""
        if not self.on:
            return ""
        prompt = self.prompts[i // self.n]
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def finish(self, reason: str) -> str:
        """A choice's finish_reason: "length" where the prompt was only scored (max_tokens 0)."""
        return "length" if self.scores_only else reason

    def logprobs(self, entries: list, ids: list[int]) -> dict:
        """The logprobs of a prompt's tokens `ids`: `entries` its prompt_logprobs (one per token, the first None)."""
        return CompletionLogprobs(self.tokenizer, skip_special=False).add(entries, ids)
