"""`tiered chat`: an interactive conversation in the terminal through the model's chat template.

A Chat keeps the history (system prompt, then user and assistant turns) and streams each answer;
`stop()` (what Ctrl-C calls while an answer streams) ends the answer at the next piece of text and
keeps what was said. `repl` is the loop around it: commands /reset, /stats, /help and /exit; Ctrl-C
at the prompt twice in a row, or EOF (Ctrl-D), quits.
"""

from __future__ import annotations

import contextlib
import select
import signal
import sys
import threading
from pathlib import Path
from typing import Callable, TextIO

from tiered.engine.prompt import check_prompt_fits, encode_prompt
from tiered.engine.reasoning import ReasoningStream
from tiered.engine.sampling import SamplingParams
from tiered.engine.sequence import RequestOutput
from tiered.errors import ContextLengthError, TieredError

PROMPT = ">>> "
HELP = "/reset forgets the conversation, /stats shows the last answer's speed and the tiers, /exit quits"


DIM, RESET = "\x1b[2m", "\x1b[0m"


class AnswerView:
    """A reasoning model's answer as a terminal shows it (engine/reasoning.py): the reasoning as it streams (dim where
    `ansi`; left out with `show_reasoning` False), a blank line, then the answer, and a harmony model's tool calls
    as `[call NAME ARGUMENTS]`. Without a reasoning format (`fmt` None) the text passes as it comes.

    Args:
        write: called with each piece of text to show.
        fmt, opened: the output's reasoning format and whether its prompt opened a think block
            (Sequence.reasoning_format, thinking_opened).
    """

    def __init__(self, write: Callable[[str], None], fmt: str | None, opened: bool = False,
                 show_reasoning: bool = True, ansi: bool = False) -> None:
        self.write, self.show, self.ansi = write, show_reasoning, ansi
        self.stream = ReasoningStream(fmt, opened) if fmt else None
        self.answer = ""  # the answer's text shown so far
        self.reasoned = False  # reasoning was shown (and the answer not yet begun)

    def __call__(self, delta: str) -> None:
        if self.stream is None:
            self.answer += delta
            self.write(delta)
            return
        self._show(*self.stream.feed(delta))

    def finish(self) -> list[tuple[str, str]]:
        """Show what was held back (a tail that might have begun a marker) and the calls; returns the calls."""
        if self.stream is None:
            return []
        *parts, calls = self.stream.finish()
        self._show(*parts)
        self._end_reasoning()
        for name, args in calls:
            self.write(f"[call {name} {args}]")
        return calls

    def _show(self, reasoning: str, content: str) -> None:
        if reasoning and self.show:
            if not self.reasoned and self.ansi:
                self.write(DIM)
            self.reasoned = True
            self.write(reasoning)
        if content:
            self._end_reasoning()
            self.answer += content
            self.write(content)

    def _end_reasoning(self) -> None:
        if self.reasoned:
            self.reasoned = False
            self.write((RESET if self.ansi else "") + "\n\n")


class _Stopped(Exception):
    """Raised inside LLM.generate's text callback to end an answer between engine steps."""


class Chat:
    """A conversation with a loaded LLM through its tokenizer's chat template.

    Args:
        llm: the LLM; its tokenizer must have a chat template.
        params: sampling parameters of every answer (max_tokens is per answer, capped by the context
            window left).
        system: an optional system prompt, kept across /reset.
        ansi: show a reasoning model's reasoning dim (ANSI codes: a terminal), before its answer (AnswerView).
        template_kwargs: variables for the chat template (Qwen3's enable_thinking, ...: LLM.chat's).
    Raises:
        ConfigError: the tokenizer has no chat template.
    """

    def __init__(self, llm, params: SamplingParams, system: str | None = None, ansi: bool = False,
                 template_kwargs: dict | None = None) -> None:
        self.llm, self.params, self.ansi, self.template_kwargs = llm, params, ansi, template_kwargs or {}
        self.system = [{"role": "system", "content": system}] if system else []
        self.history: list[dict] = list(self.system)
        self.last: RequestOutput | None = None  # the last answer that ran to its end
        self.dropped = 0  # turns dropped from the front of the history to fit the context window
        self._stop = threading.Event()
        # one KV-cache slot kept between turns with the scheduler's prefix reuse (what `tiered serve` runs), so a turn
        # prefills only what its prompt does not share with the last one's tokens; None until the first turn, False
        # where the budget cannot hold a slot of max_context positions (each turn then gets a cache of its own)
        self._slot = None
        self._encode(self.system + [{"role": "user", "content": "hi"}])  # ConfigError without a template

    def _encode(self, messages: list[dict]) -> list[int]:
        """The conversation's prompt ids through the chat template (its variables included, as LLM.chat's)."""
        return encode_prompt(self.llm.tokenizer, messages, True, template_kwargs=self.template_kwargs)

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        self.history = list(self.system)
        self.last, self.dropped = None, 0

    def stop(self) -> None:
        """End the answer being generated at its next piece of text (safe from a signal handler)."""
        self._stop.set()

    def ask(self, text: str, on_text: Callable[[str], None]) -> tuple[str, bool]:
        """Answer `text` in the conversation, streaming the answer's text to `on_text`.

        The oldest turns are dropped while the conversation does not fit the context window.
        Returns:
            (the answer's text, True when stop() cut it short); both the question and the (partial)
            answer join the history.
        Raises:
            ContextLengthError: the message alone does not fit the context window (it is not kept).
        """
        self._stop.clear()
        message = {"role": "user", "content": text}
        alone = len(self._encode(self.system + [message]))
        check_prompt_fits(0, alone, self.llm.max_context, self.llm.config.max_position_embeddings)
        self.history.append(message)

        def stream(_index: int, delta: str) -> None:
            view(delta)
            if self._stop.is_set():
                raise _Stopped

        stopped = False
        while True:
            try:
                ids = self._encode(self.history)  # once a try: the view reads the prompt's opened thinking off it
                view = AnswerView(on_text, *self.llm.reasoning_of(ids, True), ansi=self.ansi)
                self.last = self._generate(ids, stream)
                break
            except _Stopped:
                stopped = True
                break
            except ContextLengthError:  # the message alone fits: drop the oldest question and its answer
                first = len(self.system)
                del self.history[first:first + 2]
                self.dropped += 2
        view.finish()
        # the answer without its reasoning: chat templates drop earlier turns' thinking (or never show it)
        answer = view.answer.strip() if view.stream is not None else view.answer
        self.history.append({"role": "assistant", "content": answer})
        return answer, stopped

    def _generate(self, ids: list[int], stream: Callable[[int, str], None]) -> RequestOutput:
        """The answer to the conversation's prompt `ids`, its text streamed to `stream(0, delta)`, through the slot kept
        between turns (the prefix its KV holds is not prefilled again: RequestStats.cached_tokens); LLM.generate where
        no slot fits the budget. An exception from `stream` (stop()) ends the sequence at the next turn's first step,
        which records the tokens its KV holds (Scheduler.cancel)."""
        from tiered.engine.scheduler import Scheduler
        from tiered.errors import BudgetError

        if self._slot is None:
            try:
                self._slot = (Scheduler(max_batch=1, max_queue=1, prefix_reuse=True), self.llm.kv_cache(1))
            except BudgetError:
                self._slot = False
        if self._slot is False:
            return self.llm.generate(ids, self.params, chat=True, on_text=stream)[0]
        scheduler, cache = self._slot
        seq = self.llm.make_sequence(ids, self.params, True)
        scheduler.add(seq)
        out = None
        try:
            while scheduler.has_work():
                for _, delta, done in self.llm.step(scheduler, cache, burst=True):
                    if delta:
                        stream(0, delta)
                    out = done or out
        except BaseException:
            scheduler.cancel(seq)
            raise
        return out

    def stats(self) -> list[str]:
        """Lines describing the conversation, the last answer's speed (TTFT, tokens/s, ITL) and the
        tiers (the plan, and for MoE models expert placement, hit rate and bytes moved)."""
        turns = sum(m["role"] == "user" for m in self.history)
        window = self.llm.max_context
        used = len(self._encode(self.history)) if len(self.history) > len(self.system) else 0
        lines = [f"conversation: {turns} question{'' if turns == 1 else 's'}, {used} of {window} context tokens"
                 + (f" ({self.dropped} old turns dropped)" if self.dropped else "")]
        if self.last is not None:
            s = self.last.stats
            lines.append(f"last answer: {s.prompt_tokens} prompt tokens, {s.generated_tokens} generated "
                         f"({self.last.finish_reason}) | TTFT {s.ttft_s * 1e3:.0f} ms | prefill "
                         f"{s.prefill_tokens_per_s:.1f} tok/s | decode {s.decode_tokens_per_s:.1f} tok/s | "
                         f"ITL {s.itl_s * 1e3:.1f} ms{s.drafts_note()}"
                         + (f" | {s.cached_tokens} prompt tokens reused from the last turn" if s.cached_tokens else ""))
        lines.append(f"plan: {self.llm.plan_summary(self.last.stats if self.last else None)}")
        rt = self.llm.runtime_stats()
        if rt:
            lines.append(f"experts: {rt['placement']} | hit rate {rt['hit_rate']:.1%} | disk "
                         f"{rt['bytes_read'] / 2**20:.1f} MiB | H2D {rt['bytes_h2d'] / 2**20:.1f} MiB")
        return lines


@contextlib.contextmanager
def _sigint_stops(chat: Chat):
    """While the block runs, SIGINT (Ctrl-C) calls chat.stop() instead of raising KeyboardInterrupt
    (in the main thread only; elsewhere signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda _signum, _frame: chat.stop())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def read_line(prompt: str) -> str:
    """input(), but on a terminal Ctrl-C interrupts it (KeyboardInterrupt) even when the kernel
    hands SIGINT to one of the engine's worker threads: input()'s wait would not wake then, so the
    wait here polls, and Python runs the pending handler between polls. (The terminal's own line
    editing applies.)

    Raises:
        EOFError: end of input (Ctrl-D).
    """
    if not sys.stdin.isatty():
        return input(prompt)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    while not select.select([sys.stdin], [], [], 0.1)[0]:
        pass
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def repl(chat: Chat, read: Callable[[str], str] = read_line, out: TextIO = sys.stdout) -> None:
    """The interactive loop: read a line, answer it (streamed to `out`) or run a command.

    Ctrl-C while an answer streams stops that answer; at the prompt, a second Ctrl-C in a row quits,
    as does EOF or /exit. Errors about one message (e.g. too long) are printed and the chat goes on.
    """
    def say(text: str) -> None:
        out.write(text)
        out.flush()

    say(f"chatting with {Path(chat.llm.checkpoint.path).name} ({HELP}; Ctrl-C stops an answer)\n")
    interrupted = False
    while True:
        try:
            line = read(PROMPT).strip()
        except EOFError:
            say("\n")
            return
        except KeyboardInterrupt:
            if interrupted:
                say("\n")
                return
            interrupted = True
            say("\n(Ctrl-C again or Ctrl-D to quit)\n")
            continue
        interrupted = False
        if not line:
            continue
        if line.startswith("/"):
            command = line.split()[0]
            if command in ("/exit", "/quit"):
                return
            if command == "/reset":
                chat.reset()
                say("(conversation cleared)\n")
            elif command == "/stats":
                say("\n".join(chat.stats()) + "\n")
            else:
                say(f"{'' if command == '/help' else f'unknown command {command}: '}{HELP}\n")
            continue
        try:
            with _sigint_stops(chat):
                _, stopped = chat.ask(line, say)
        except TieredError as e:
            say(f"error: {e}\n")
            continue
        say(" [stopped]\n" if stopped else "\n")
