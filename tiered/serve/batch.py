"""Offline batch inference over the OpenAI Batch API's file format (`tiered batch`; vLLM's `run_batch`).

Each line of the input is a JSON request, `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body": {...}}`; each line of the output answers one, `{"id": "batch_req_...", "custom_id": ...,
"response": {"status_code": ..., "request_id": ..., "body": ...}, "error": null}`, written as it finishes (the
file is never behind by more than the requests in flight, whatever stops the run). A line that is no such
request is answered with `"response": null` and an `error` saying why (and its line number); a request the API
refuses carries the API's own status and error body, as the server would answer it. Nothing is dropped.

The requests go through the server's own application (serve/app.py: the same validation, sampling defaults,
chat templates, tool calls, structured outputs, logprobs) in this process, without a socket (httpx's ASGI
transport), to a ServingEngine of the plan's batch: under the throughput goal (FlexGen's setting; the
planner's `plan_batch`) the batch that generates the most tokens a second for the file's typical lengths, each
finished request's slot taken by the next (continuous batching).
"""

from __future__ import annotations

import asyncio
from array import array
import json
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, NamedTuple

from tiered.errors import ConfigError

URLS = ("/v1/chat/completions", "/v1/completions")
# what a completions request generates when its body gives no max_tokens (the server's default, OpenAI's)
COMPLETION_MAX_TOKENS = 16
QUEUE_RETRY_S = 0.05  # how long a request the engine's queue turned away (503 queue_full) waits to try again


@dataclass
class BatchLine:
    """One line of a batch input file.

    Attributes:
        number: its line number in the file (1-based).
        custom_id: the caller's id of the request (echoed in its output line), or None where unreadable.
        url: the endpoint ("/v1/chat/completions" or "/v1/completions").
        body: the request body, as the endpoint takes it.
        error: why the line is answered without running (not JSON, no custom_id, an unknown url, a stream,
            a custom_id seen before), or None.
    """

    number: int
    custom_id: str | None = None
    url: str | None = None
    body: dict | None = None
    error: str | None = None


@dataclass
class BatchSummary:
    """What a batch run did: requests by outcome, tokens and seconds.

    Attributes:
        requests: lines answered; succeeded: with status 200; failed: the rest.
        prompt_tokens, completion_tokens: summed over the succeeded requests' `usage`; cached_tokens: of the prompt
            tokens, those not computed for their request (usage.prompt_tokens_details.cached_tokens: the server's
            prefix reuse, a twin's prefill).
        seconds: wall time from the first request sent to the last answer written.
    """

    requests: int = 0
    succeeded: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0
    statuses: dict[int, int] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens a second over the run."""
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0


def read_batch(path: Path) -> list[BatchLine]:
    """The requests of a batch input file (JSON lines; blank lines skipped).

    Raises:
        OSError: the file cannot be read.
        ConfigError: it holds no line at all.
    """
    lines: list[BatchLine] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            lines.append(_parse(number, text, seen))
    if not lines:
        raise ConfigError(f"{path} holds no requests", "write one JSON request a line (OpenAI's batch input format)")
    return lines


def _parse(number: int, text: str, seen: set[str]) -> BatchLine:
    """One input line as a BatchLine, its `error` set where it is no runnable request."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return BatchLine(number, error=f"line {number} is not JSON: {e.msg} at character {e.pos}")
    if not isinstance(obj, dict):
        return BatchLine(number, error=f"line {number} is not a JSON object")
    cid = obj.get("custom_id")
    line = BatchLine(number, cid if isinstance(cid, str) else None, obj.get("url"), obj.get("body"))
    if line.custom_id is None:
        line.error = f"line {number} has no custom_id (a string naming the request)"
    elif line.custom_id in seen:
        line.error = f"line {number}: custom_id {line.custom_id!r} is used by an earlier line"
    elif obj.get("method", "POST") != "POST":
        line.error = f"line {number}: method must be POST, not {obj.get('method')!r}"
    elif line.url not in URLS:
        line.error = f"line {number}: url must be one of {', '.join(URLS)}, not {line.url!r}"
    elif not isinstance(line.body, dict):
        line.error = f"line {number}: body must be a JSON object (the request the url takes)"
    elif line.body.get("stream"):
        line.error = f"line {number}: a batch answers whole responses; leave out stream"
    if line.custom_id is not None and line.error is None:
        seen.add(line.custom_id)
    return line


def check_models(lines: list[BatchLine], served: str) -> None:
    """Give each runnable line's body the served model's name where it names none (the file is for one model).

    Raises:
        ConfigError: lines name another model: refused before any request runs, rather than answered 400 each.
    """
    others: dict[str, int] = {}
    for line in lines:
        if line.error is None:
            named = line.body.setdefault("model", served)
            if named != served:
                others[str(named)] = others.get(str(named), 0) + 1
    if others:
        listed = ", ".join(f"{name!r} ({n} line{'s' if n > 1 else ''})" for name, n in sorted(others.items()))
        raise ConfigError(f"requests name {listed}, and this batch serves {served!r}",
                          f"pass --served-model-name {next(iter(sorted(others)))} to answer them with this model, "
                          "or leave model out of the bodies")


class RequestLengths(NamedTuple):
    """request_lengths' answer: `prompt` and `gen` the means [tokens], `longest` the most positions a request
    with max_tokens needs, `requests` each runnable line's sequences' (prompt tokens, most tokens generated) in file
    order, `prefixes` which of their prompts share how many leading tokens (planner/batch_sim.PromptPrefixes; None
    without a tokenizer or where none share any)."""

    prompt: int
    gen: int
    longest: int
    requests: tuple[tuple[int, int], ...]
    prefixes: "PromptPrefixes | None" = None


def request_lengths(lines: list[BatchLine], tokenizer, window: int) -> RequestLengths:
    """(mean prompt tokens, mean most tokens generated, most positions a request with max_tokens needs, each
    sequence's (prompt, most generated): a line's, once per choice (`n`) of each of its prompts, and which of those
    prompts share how many leading tokens) of the runnable lines whose bodies the server takes (`_refused`: a
    malformed body is answered 400 and generates nothing), which the throughput plan prices (its batch on the
    requests replayed, their shared prefixes reused: EngineConfig.requests, request_prefixes) and sizes its KV cache
    by (`window` where no request gives max_tokens: those generate up to the context window). A prompt is counted
    through the chat template where the url is the chat one (characters / 4 where it cannot be encoded: the server
    will say why, and no prefixes are known); a completion without max_tokens generates COMPLETION_MAX_TOKENS, as
    the server's.

    Args:
        tokenizer: the model's (None: characters / 4); window: the model's context window [tokens].
    """
    prompts, gens, needs, bounded_any = [], [], [], False
    ids: list | None = []  # each sequence's prompt token ids (None once one cannot be encoded)
    for line in lines:
        if line.error is not None or _refused(line):
            continue
        body = line.body
        chat = line.url == "/v1/chat/completions"
        most = body.get("max_completion_tokens") if chat else None
        most = most if most is not None else body.get("max_tokens", None if chat else COMPLETION_MAX_TOKENS)
        bounded = isinstance(most, int) and most > 0
        bounded_any |= bounded
        n = body.get("n", 1)
        n = n if isinstance(n, int) and n >= 1 else 1
        for one in _prompt_ids(body, chat, tokenizer):  # each prompt's ids, or its estimated tokens
            p = max(1, len(one) if isinstance(one, list) else one)
            g = most if bounded else window - p
            g = max(1, min(g, window - p)) if p < window else 1
            prompts += [p] * n  # each choice of each prompt is a sequence of the scheduler
            gens += [g] * n
            if ids is not None and isinstance(one, list) and one:
                ids.extend([array("i", one)] * n)  # 4 bytes a token: a big file's lists would hold ~36
            else:
                ids = None
            needs.append(min(window, p + g) if bounded else min(window, p + 1))
    if not prompts:
        return RequestLengths(1, 1, 1, ())
    prefixes = None
    if ids:
        from tiered.planner.batch_sim import PromptPrefixes
        prefixes = PromptPrefixes.of(ids)
        prefixes = prefixes if prefixes.any_shared() else None
    # means, not medians: the file's throughput is its sums (every prompt's prefill, every token's decode step) over
    # its time, and a skewed file's middle request is not its average one (48 completions of 15-500-token prompts and
    # 16-128 max_tokens: medians 115 and 32 tokens, means 184 and 53)
    return RequestLengths(max(1, round(statistics.fmean(prompts))), max(1, round(statistics.fmean(gens))),
                          max(needs) if bounded_any else window, tuple(zip(prompts, gens)), prefixes)


def _refused(line: BatchLine) -> bool:
    """Whether the server refuses `line`'s body as malformed before generating anything (its request model,
    serve/protocol.py, rejects it: 400), so that the plan does not price it as a sequence."""
    from pydantic import ValidationError

    from tiered.serve.protocol import ChatCompletionRequest, CompletionRequest

    model = ChatCompletionRequest if line.url == "/v1/chat/completions" else CompletionRequest
    try:
        model.model_validate({"model": "", **line.body})  # (check_models names the served model where none is)
    except ValidationError:
        return True
    return False


def _completion_prompts(body: dict) -> list:
    """A completion body's prompts as CompletionRequest.prompts splits them (a text or token ids each), from the
    unvalidated body (the server refuses a malformed one later)."""
    p = body.get("prompt")
    return list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]


def _prompt_ids(body: dict, chat: bool, tokenizer) -> list:
    """Each prompt of a request (a chat's messages through the chat template; a completion's texts or ids) as its
    token ids, or where it cannot be encoded (no tokenizer, a malformed body the server refuses later) as an
    estimate of its tokens (an int)."""
    if chat:
        messages = body.get("messages")
        if tokenizer is not None and isinstance(messages, list):
            from tiered.engine.prompt import encode_prompt
            try:
                return [list(encode_prompt(tokenizer, messages, True))]
            except Exception:  # a malformed message list: the server refuses it later; guessed meanwhile
                pass
        return [len(json.dumps(messages)) // 4]
    out = []
    for prompt in _completion_prompts(body):
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            out.append(list(prompt))
        elif isinstance(prompt, str):
            out.append(list(tokenizer.encode(prompt)) if tokenizer is not None else len(prompt) // 4)
        else:
            out.append(1)
    return out


def output_line(line: BatchLine, status: int | None, body: dict | None) -> dict:
    """The output object of `line`: its response (status and body), or, for a line not run, its error."""
    out = {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": line.custom_id, "response": None, "error": None}
    if status is None:
        out["error"] = {"code": "invalid_request", "message": line.error, "line": line.number}
    else:
        out["response"] = {"status_code": status, "request_id": f"req_{uuid.uuid4().hex[:24]}", "body": body}
    return out


async def post_all(app, lines: list[BatchLine], out: IO[str], concurrency: int,
                   progress: Callable[[BatchSummary], None] | None = None) -> BatchSummary:
    """Send every runnable line to the ASGI `app` (at most `concurrency` at once; a 503 queue_full is tried again
    after QUEUE_RETRY_S) and write each answer to `out` as one JSON line as it comes, the unrunnable lines'
    errors first; `progress(summary)` after each. Returns the summary."""
    import httpx

    summary = BatchSummary()
    lock = asyncio.Lock()

    async def write(line: BatchLine, status: int | None, body: dict | None) -> None:
        async with lock:
            out.write(json.dumps(output_line(line, status, body), ensure_ascii=False) + "\n")
            out.flush()
            summary.requests += 1
            if status == 200:
                summary.succeeded += 1
                usage = (body or {}).get("usage") or {}
                summary.prompt_tokens += usage.get("prompt_tokens", 0)
                summary.completion_tokens += usage.get("completion_tokens", 0)
                summary.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            else:
                summary.failed += 1
            if status is not None:
                summary.statuses[status] = summary.statuses.get(status, 0) + 1
            summary.seconds = time.perf_counter() - t0
            if progress is not None:
                progress(summary)

    t0 = time.perf_counter()
    for line in lines:
        if line.error is not None:
            await write(line, None, None)
    gate = asyncio.Semaphore(max(1, concurrency))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://tiered", timeout=None) as client:
        async def one(line: BatchLine) -> None:
            async with gate:
                while True:
                    r = await client.post(line.url, json=line.body)
                    try:
                        body = r.json()
                    except ValueError:
                        body = {"error": {"message": r.text, "type": "server_error"}}
                    code = (body.get("error") or {}).get("code") if isinstance(body, dict) else None
                    if r.status_code == 503 and code == "queue_full":
                        await asyncio.sleep(QUEUE_RETRY_S)
                        continue
                    await write(line, r.status_code, body)
                    return
        await asyncio.gather(*(one(line) for line in lines if line.error is None))
    summary.seconds = time.perf_counter() - t0
    return summary


def run_batch(engine, app, lines: list[BatchLine], output: Path, concurrency: int,
              progress: Callable[[BatchSummary], None] | None = None) -> BatchSummary:
    """Answer `lines` through `app` into `output` (JSON lines; an existing file is replaced), the ServingEngine
    `engine` stepping on the calling thread (the one that loaded the model: its OpenMP team; serve's rule) while
    the requests are sent from a second one.

    Raises:
        OSError: the output cannot be written (before any request runs).
        KeyboardInterrupt: the run was interrupted; the lines answered so far are in `output`.
    """
    result: dict = {}
    with open(output, "w", encoding="utf-8") as out:
        def client() -> None:
            try:
                result["summary"] = asyncio.run(post_all(app, lines, out, concurrency, progress))
            except BaseException as e:  # reported on the caller's thread
                result["error"] = e

        engine.external = True
        sender = threading.Thread(target=client, name="tiered-batch", daemon=True)
        sender.start()
        try:
            engine.run(alive=sender.is_alive)
        finally:
            engine.stop()  # every request still in flight ends (its line answered 503) ...
            sender.join()  # ... so the sender's last writes land before the file closes
    if "error" in result:
        raise result["error"]
    return result["summary"]
