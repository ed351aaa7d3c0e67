"""The serving engine: one thread runs LLM.step over a Scheduler; HTTP handlers submit and await.

Handlers live on the asyncio event loop; the model runs on the engine thread. A request's events
(text deltas, then its RequestOutput) reach the handler through an asyncio.Queue fed with
`loop.call_soon_threadsafe`. A handler whose client goes away cancels its request: the scheduler
frees the slot at the next step boundary. `stop` ends every request in flight at once with
ServerShuttingDownError, so that a server shutting down answers its clients instead of leaving
them waiting.

A step that raises fails only the requests that fail alone: the engine puts back what the step
changed in its sequences and steps each of them by itself (ServingEngine._isolate). One request's
bad prefill, sampling or detokenizing thus ends that request, while those batched with it go on
with the tokens they would have had; a failure of every step (the model's forward) still fails
every request in its steps.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
from dataclasses import dataclass

import torch

from tiered.engine.prompt import Prompt
from tiered.engine.sampling import SamplingParams
from tiered.engine.scheduler import QueueFullError, Scheduler, StepPlan
from tiered.engine.sequence import RequestOutput, Sequence
from tiered.errors import TieredError
from tiered.serve.metrics import ServerMetrics

__all__ = ["Handle", "QueueFullError", "ServerShuttingDownError", "ServingEngine"]
log = logging.getLogger("tiered.serve")


class ServerShuttingDownError(TieredError):
    """The server is shutting down: the request ends (or is refused) without an answer."""


@dataclass(eq=False)
class Handle:
    """One submitted request: its sequence and the queue its events arrive on.

    Events are (text delta, RequestOutput | None, new TokenLogprobs | None) tuples; the last one
    carries the output. An exception raised by the engine arrives as the event itself. A handle that
    does not `stream` gets the last event only (its handler reads nothing before the output: a
    non-streaming request, `tiered batch`'s): no wake-up of the handler's loop a token.
    """

    seq: Sequence
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    stream: bool = True
    first_token_seen: bool = False  # its TTFT is in the metrics already
    logprobs_sent: int = 0  # entries of seq.logprobs already delivered

    def push(self, event) -> None:
        """Deliver an event from the engine thread to the handler's loop (dropped once that loop is
        closed: nobody listens any more)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed (the HTTP server has gone)
            pass


# `tiered serve`'s batch where --max-batch is 0 (its default). On a CPU-only plan, which prices batches: the batch the
# throughput goal finds fastest (planner/throughput.plan_batch) for requests of AUTO_WORKLOAD (prompt, generated)
# tokens, up to AUTO_MOST sequences; the KV cache of that many slots is reserved in the budget but committed as
# positions are written (memory/host.lazy_zeros). SmolLM2 under 32 streaming clients (benchmarks/serve_load.py,
# 2 AMX cores, 2026-12-07): 899-938 tok/s with the planned 64 slots against 674-784 with 8 (median TTFT 0.06
# against 1.0-1.2 s); under 64 clients 1082 against 925 with 32.
AUTO_WORKLOAD = (256, 256)
AUTO_MOST = 64
# ... and below the first batch whose plan prices one request decoding alone under this share of batch 1's plan's
# speed: under a tight budget each slot's KV cache takes the experts' room (the Qwen3-30B-A3B-width file under
# --cpu-mem 2GiB: the throughput goal alone took 16 slots, 14.9 tok/s at full load where 4 made 14.1, and one
# request 8.3 tok/s against 12.1 at batch 1 and 11.2 at 4)
LONE_DECODE_SHARE = 0.9
# With an accelerator, whose plans do not price batches: the largest batch up to this many slots that the GPU budget
# holds and that keeps one request's decode within LONE_DECODE_SHARE (the KV cache of a slot takes the room experts
# and sliced weights would use). Before, 8 slots whatever the budget: a GPU budget that held the weights and one or
# two slots' KV cache refused to serve at all (the Mixtral-shaped dummy on the stand-in under --gpu-mem 500MiB:
# "cannot hold ... KV cache (512.0 MiB)"), where `tiered run` ran.
ACCELERATOR_BATCH = 8


def serve_batch(accelerator: str, max_batch: int) -> dict:
    """The batch arguments of `tiered serve --max-batch max_batch`'s EngineConfig (max_batch, and goal, workload and
    lone share where the plan chooses). With max_batch 0: the throughput goal's batch for AUTO_WORKLOAD requests
    (planner/throughput.plan_batch), below the first batch that would decode one request alone under
    LONE_DECODE_SHARE of batch 1's speed, up to AUTO_MOST sequences where no accelerator is used (`accelerator`
    "none", or "auto" on a machine without CUDA; its plans price each batch) and up to ACCELERATOR_BATCH with one
    (the largest that fits: its plans price no batch); the server then takes Plan.kv_slots. Else max_batch."""
    from tiered.hardware.accelerator import accelerator_kind

    if max_batch:
        return dict(max_batch=max_batch)
    most = AUTO_MOST if accelerator_kind(accelerator) == "none" else ACCELERATOR_BATCH
    return dict(max_batch=most, goal="throughput", workload=AUTO_WORKLOAD, lone_decode_share=LONE_DECODE_SHARE)


class ServingEngine:
    """Continuous batching for a server: a KV cache of `max_batch` slots and a thread stepping it.

    Args:
        llm: the loaded LLM (the engine thread is its only user while the server runs).
        max_batch: KV-cache slots: the most requests decoded together.
        max_queue: most requests waiting beyond those the free slots take; more are refused
            (QueueFullError -> HTTP 503). At most max_batch + max_queue requests run or wait.
        prefix_reuse: a new request reuses the KV its slot still holds for the prefix it shares with
            the slot's last request (a common system prompt, a conversation's history): Scheduler.
    Raises:
        BudgetError: the KV cache of max_batch x max_context does not fit the fast tier's budget.
    """

    def __init__(self, llm, max_batch: int = 8, max_queue: int = 64, prefix_reuse: bool = True) -> None:
        self.llm = llm
        self.scheduler = Scheduler(max_batch, max_queue, prefix_reuse)
        self.cache = llm.kv_cache(max_batch)
        self.metrics = ServerMetrics()
        self._handles: dict[Sequence, Handle] = {}  # its handle while a sequence runs or waits
        self._lock = threading.Lock()
        self._wake = threading.Event()
        # made nonzero by a submit, a cancel or stop(): ends a decode burst of a lone request (LLM._burst)
        # after its token in flight, so that the change is seen at the next step, not ~50 ms later
        self._interrupt = torch.zeros(1, dtype=torch.int32)
        self.step_tokens = 0  # tokens the last step appended to its sequences (_step; the metrics' step_tokens)
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="tiered-engine", daemon=True)
        self.external = False  # True while run() steps it on a caller's thread (the app must not start it)

    def start(self) -> "ServingEngine":
        """Start the engine thread (it idles until a request arrives); returns self."""
        self._thread.start()
        return self

    def run(self, alive=None) -> None:
        """Step on the calling thread until stop(), or until `alive()` turns False (checked at least
        once a second). `tiered serve` runs this on its main thread, with the HTTP server on a
        second one: torch's OpenMP team belongs to the thread that loaded the model, and the same
        SmolLM2 decode step took 7 ms there against 22-32 ms on a fresh thread (2 cores)."""
        self.external = True
        self._loop(alive)

    def stop(self) -> None:
        """Shut down: every request running or waiting ends at once with a ServerShuttingDownError
        event (its handler answers 503, or ends its stream with an error), later submits are
        refused with it, and the engine thread stops after its current step. Safe to call again
        and from any thread."""
        with self._lock:
            self._stopping = True
            handles, self._handles = list(self._handles.values()), {}
        self._poke()
        error = ServerShuttingDownError("the server is shutting down", "retry once it is back")
        for h in handles:
            self.scheduler.cancel(h.seq)
            self.metrics.count_request("shutdown")
            h.push(error)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def capacity(self) -> int:
        """The most sequences running or waiting at once (max_batch + max_queue): a request of more
        choices could never be queued."""
        return self.scheduler.max_batch + self.scheduler.max_queue

    # ------------------------------------------------------------ handlers' side
    def submit(self, prompts: list[Prompt], params: SamplingParams, chat: bool | None,
               loop: asyncio.AbstractEventLoop | None = None, n: int = 1, stream: bool = True) -> list[Handle]:
        """Queue one request of `prompts` (one, or a batched completion's), `n` choices each (OpenAI's `n`):
        n sequences of a prompt, encoded once; all the request's sequences queued or none. Prompt p's
        choice j is choice p * n + j and samples with the seed params.seed + p * n + j (LLM.make_sequence's
        index), so a seeded request's choices differ and repeat. Each choice is one sequence in the
        scheduler and the metrics, with a handle of its own. Callable from any thread: encoding a long
        prompt takes a while, so the app calls it from a worker thread, off its event loop.

        Args:
            loop: the event loop whose handler awaits the request's events (default: the running one).
            stream: the handler reads each step's text (an SSE stream); False: only the output (Handle.stream).
        Returns:
            The choices' handles, choice i's at i.
        Raises:
            ContextLengthError, ConfigError: the prompt does not fit or cannot be encoded.
            QueueFullError: the n sequences do not fit the free slots and the queue's room.
            ServerShuttingDownError: stop() was called.
        """
        loop = loop or asyncio.get_running_loop()
        if self._stopping:  # before the encoding: a server going down does no more work
            raise self._refuse_for_shutdown()
        seqs = []
        for p, one in enumerate(prompts):
            first = self.llm.make_sequence(one, params, chat, index=p * n)
            seqs.append(first)
            for i in range(1, n):  # the same token ids; the seed params.seed + p * n + i
                # a chat's ids as a chat (its reasoning format and any grammar wrapped for it), others as given
                seqs.append(self.llm.make_sequence(first.prompt_ids, params, first.reasoning_format is not None,
                                                   index=p * n + i, t_start=first.t_start))
                seqs[-1].prompt = first.prompt
        handles = [Handle(seq, asyncio.Queue(), loop, stream) for seq in seqs]
        with self._lock:  # under the lock stop() takes: a request either gets refused here or ended by stop()
            stopping = self._stopping
            if not stopping:
                self._handles.update((h.seq, h) for h in handles)
        if stopping:
            raise self._refuse_for_shutdown()
        try:
            self.scheduler.add(*seqs)
        except QueueFullError:
            with self._lock:
                for seq in seqs:
                    self._handles.pop(seq, None)  # gone already if stop() came in between
            self.metrics.count_request("rejected")
            raise
        self._poke()  # after the add: the next step sees the request
        return handles

    def _refuse_for_shutdown(self) -> ServerShuttingDownError:
        """The error a request submitted after stop() gets (counted as a shutdown)."""
        self.metrics.count_request("shutdown")
        return ServerShuttingDownError("the server is shutting down", "retry once it is back")

    def cancel(self, handle: Handle) -> None:
        """The client went away: free the request's slot (or queue place) at the next step.
        A no-op for a request that finished already."""
        with self._lock:
            if self._handles.pop(handle.seq, None) is None:
                return  # finished already
        self.scheduler.cancel(handle.seq)
        self.metrics.count_request("cancelled")
        self._poke()

    def _poke(self) -> None:
        """The requests changed (a submit, a cancel, stop): end a burst under way after its token in
        flight, and wake an idle engine thread."""
        self._interrupt.fill_(1)
        self._wake.set()

    # ------------------------------------------------------------ engine thread
    def _loop(self, alive=None) -> None:
        while not self._stopping and (alive is None or alive()):
            if not self.scheduler.has_work():
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                events = self._step()
            except Exception as e:  # noqa: BLE001 - the scheduler's own failure: every handler must hear of it
                self._fail_all(e)
                continue
            if events:
                self.metrics.observe_step(len({seq for seq, _, _ in events}), self.step_tokens, max(1, self.llm.last_burst))
            for seq, delta, out in _merged(events):
                self._deliver(seq, delta, out)

    def _step(self) -> list[tuple[Sequence, str, RequestOutput | None]]:
        """One LLM.step over the scheduler's next plan, a decode burst where a lone request runs and none
        waits (interrupted by the next submit, cancel or stop); where it raises, _isolate's events instead."""
        self._interrupt.zero_()  # before schedule(): a request added after it interrupts the burst
        plan = self.scheduler.schedule()
        saved = [_Saved.of(seq) for seq in plan.running]
        try:
            events = self.llm.step(_Planned(self.scheduler, plan), self.cache, burst=True, interrupt=self._interrupt)
        except Exception:  # noqa: BLE001 - which sequence failed is found by _isolate
            events = self._isolate(plan, saved)
        # the tokens the step appended (an event may carry several: a burst's, a grammar's forced tokens)
        self.step_tokens = sum(len(s.seq.output_ids) - s.tokens for s in saved)
        return events

    def _isolate(self, plan: StepPlan, saved: list["_Saved"]) -> list[tuple[Sequence, str, RequestOutput | None]]:
        """The step of `plan` raised: put back what it changed in its sequences (`saved` before it
        ran), then step each alone (a prefill for those it admitted). A sequence whose step raises
        again ends with that error and its slot is freed at the next step; the others' events
        are returned. The KV a failed step wrote is written again where a sequence steps again."""
        admitted = set(plan.prefill)
        for s in saved:
            s.restore()
        events = []
        for s in saved:
            alone = StepPlan(prefill=[s.seq] if s.seq in admitted else [], running=[s.seq])
            try:
                events += self.llm.step(_Planned(self.scheduler, alone), self.cache)
            except Exception as e:  # noqa: BLE001 - this request's failure: its handler hears of it
                s.restore()
                self._fail(s.seq, e)
        return events

    def _deliver(self, seq: Sequence, delta: str, out: RequestOutput | None) -> None:
        with self._lock:
            handle = self._handles.get(seq)
            if out is not None:
                self._handles.pop(seq, None)
        if handle is None:
            return  # cancelled: nobody listens
        try:
            if not handle.first_token_seen and seq.token_times:
                handle.first_token_seen = True
                self.metrics.observe_first_token(seq.token_times[0] - seq.t_start)
            if out is not None:
                drafter = seq.drafter
                self.metrics.observe_finished(len(seq.prompt_ids), list(seq.token_times), seq.cached_tokens,
                                              *((drafter.total_drafted, drafter.total_accepted) if drafter else ()))
            new = None
            if seq.logprobs is not None:
                new, handle.logprobs_sent = seq.logprobs[handle.logprobs_sent:], len(seq.logprobs)
        except Exception as e:  # noqa: BLE001 - a bug delivering one event ends that request, not the engine thread
            self._fail(seq, e, handle)
            return
        if out is not None or handle.stream:  # (on a 2-core VM the handlers' wake-ups cost ~1 ms a batched step)
            handle.push((delta, out, new))

    def _fail(self, seq: Sequence, error: Exception, handle: Handle | None = None) -> None:
        """`seq`'s step (or the delivery of its event, whose `handle` the caller holds) raised `error`:
        its request ends with it (HTTP 500, or a stream's error event) and its slot is freed at the
        next step."""
        log.error("a request failed: %s: %s", type(error).__name__, error, exc_info=error)
        with self._lock:
            handle = self._handles.pop(seq, None) or handle
        self.scheduler.cancel(seq)
        if handle is not None:  # else cancelled already: nobody listens
            self.metrics.count_request("error")
            handle.push(error)

    def _fail_all(self, error: Exception) -> None:
        """Scheduling raised: every request in flight ends with `error`, and their slots are freed."""
        log.error("the engine's step failed: %s: %s", type(error).__name__, error, exc_info=error)
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
        for h in handles:
            self.scheduler.cancel(h.seq)
            self.metrics.count_request("error")
            h.push(error)


def _merged(events: list[tuple[Sequence, str, RequestOutput | None]]) -> list[tuple[Sequence, str, RequestOutput | None]]:
    """A step's events, one a sequence: its text deltas joined, its output (if it finished) kept. A decode
    burst gives one sequence many tokens in one step; delivered as one event they make one SSE chunk (the
    HTTP thread wakes once a burst, not once a token, beside the engine's OpenMP team), and a client still
    gets the burst's text as soon as it was drawn."""
    merged: dict[Sequence, tuple[str, RequestOutput | None]] = {}
    for seq, delta, out in events:
        text, _ = merged.get(seq, ("", None))
        merged[seq] = (text + delta, out)
    return [(seq, delta, out) for seq, (delta, out) in merged.items()]


class _Planned:
    """The scheduler LLM.step is given: schedule() returns the plan the engine made (its step's, or
    one sequence's in _isolate), finish() gives a finished sequence's slot back to the engine's
    Scheduler, num_waiting is the Scheduler's (a burst only where none waits), kv_reusable sets the Scheduler's
    (what the slots' KV serves a reuse: Scheduler.kv_reusable). LLM.step uses nothing else."""

    def __init__(self, scheduler: Scheduler, plan: StepPlan) -> None:
        self.scheduler, self.plan = scheduler, plan

    @property
    def kv_reusable(self):
        return self.scheduler.kv_reusable

    @kv_reusable.setter
    def kv_reusable(self, fn) -> None:
        self.scheduler.kv_reusable = fn

    def schedule(self) -> StepPlan:
        return self.plan

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)


@dataclass(frozen=True, slots=True)
class _Saved:
    """What a step may change in a running sequence, saved before the step: the tokens it appends
    (with their times and logprobs), the detokenizer's text and state, the finish, the generator's
    state (a seeded request draws the same numbers when it steps again). The KV cache and the
    slot are not saved: a sequence stepped again writes the same KV over the same positions."""

    seq: Sequence
    tokens: int  # len(output_ids), also len(token_times) and len(logprobs)
    text: str
    emitted: int
    prefix_offset: int
    read_offset: int
    decode_stream: object  # a copy: tokenizers' DecodeStream copies its state
    finish_reason: str | None
    rng: torch.Tensor | None  # the generator's state (None: no generator)
    pending: int  # forced tokens whose KV is not written yet (Sequence.pending)

    @classmethod
    def of(cls, seq: Sequence) -> "_Saved":
        rng = seq.generator.get_state() if seq.generator is not None else None
        return cls(seq, len(seq.output_ids), seq.text, seq.emitted, seq.prefix_offset, seq.read_offset,
                   copy.copy(seq.decode_stream), seq.finish_reason, rng, seq.pending)

    def restore(self) -> None:
        """Put the sequence back as it was when saved (may be called again)."""
        seq, n = self.seq, self.tokens
        seq.truncate(n)
        seq.text, seq.emitted, seq.finish_reason, seq.pending = self.text, self.emitted, self.finish_reason, self.pending
        seq.prefix_offset, seq.read_offset = self.prefix_offset, self.read_offset
        seq.decode_stream = copy.copy(self.decode_stream)
        if self.rng is not None:
            seq.generator.set_state(self.rng)
