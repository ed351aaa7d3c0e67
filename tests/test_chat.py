"""`tiered chat`: the Chat conversation over a tiny Llama with a chat template, its Ctrl-C handling,
and the command driven through a pseudo-terminal like a person at a keyboard."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time

import pytest

from tiered import SamplingParams
from tiered.chat import PROMPT, Chat, _sigint_stops
from tiered.errors import ContextLengthError

GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture
def llm(zoo, chat_llama):
    return zoo.llm(chat_llama)


def test_answers_go_through_the_template_with_the_history(llm):
    chat = Chat(llm, GREEDY, system="be brief")
    pieces: list[str] = []
    first, stopped = chat.ask("the quick brown fox", pieces.append)
    assert not stopped and first == "".join(pieces)
    expected = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}]
    assert first == llm.generate(expected, GREEDY, chat=True)[0].text
    second, _ = chat.ask("and the dog?", lambda _: None)
    expected += [{"role": "assistant", "content": first}, {"role": "user", "content": "and the dog?"}]
    assert chat.history == expected + [{"role": "assistant", "content": second}]
    assert chat.last.prompt_token_ids == llm.encode(expected, chat=True)  # the whole history was the prompt
    assert "2 questions," in chat.stats()[0] and any(line.startswith("last answer:") for line in chat.stats())
    chat.reset()
    assert chat.history == expected[:1] and chat.last is None and "0 questions" in chat.stats()[0]


def test_a_turn_prefills_only_what_the_last_turn_did_not_leave_in_the_slot(llm):
    """The chat keeps one KV-cache slot between turns with the scheduler's prefix reuse (as `tiered serve` does): a
    turn's prompt (the whole history through the template) skips the tokens the slot already holds, and answers as a
    fresh generate of that history does."""
    chat = Chat(llm, GREEDY, system="be brief")
    questions = ["the quick brown fox", "and the dog?", "what about the cat"]
    for i, q in enumerate(questions):
        history = chat.history + [{"role": "user", "content": q}]
        fresh = llm.generate(history, GREEDY, chat=True)[0]
        answer, _ = chat.ask(q, lambda _: None)
        assert answer == fresh.text and chat.last.prompt_token_ids == fresh.prompt_token_ids
        reused = chat.last.stats.cached_tokens
        assert (reused == 0) if i == 0 else (len(previous) // 2 < reused < len(fresh.prompt_token_ids))
        assert fresh.stats.cached_tokens == 0
        previous = fresh.prompt_token_ids
    assert "reused from the last turn" in chat.stats()[1]


def test_a_budget_without_room_for_a_slot_answers_each_turn_with_its_own_cache(llm, monkeypatch):
    """Where the budget cannot hold a slot of max_context positions (LLM.kv_cache raises BudgetError), the chat asks
    for it once and answers every turn through LLM.generate, as before the slot was kept."""
    from tiered.errors import BudgetError

    asked = []

    def no_room(slots):
        asked.append(slots)
        raise BudgetError("no room for the slot")
    monkeypatch.setattr(llm, "kv_cache", no_room)
    chat = Chat(llm, GREEDY)
    for q in ("the quick brown fox", "and the dog?"):
        history = chat.history + [{"role": "user", "content": q}]
        answer, _ = chat.ask(q, lambda _: None)
        assert answer == llm.generate(history, GREEDY, chat=True)[0].text and chat.last.stats.cached_tokens == 0
    assert asked == [1]


def test_sigint_stops_the_answer_and_the_chat_goes_on(llm):
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    full, _ = Chat(llm, params).ask("memory is a tier", lambda _: None)
    chat = Chat(llm, params)
    pieces: list[str] = []

    def on_text(delta: str) -> None:
        pieces.append(delta)
        if len(pieces) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of the answer
    before = signal.getsignal(signal.SIGINT)
    with _sigint_stops(chat):
        answer, stopped = chat.ask("memory is a tier", on_text)
    assert signal.getsignal(signal.SIGINT) is before  # restored after the answer
    assert stopped and len(pieces) >= 2 and answer == "".join(pieces) and full.startswith(answer) and full != answer
    assert chat.history[-1] == {"role": "assistant", "content": answer}  # the partial answer is kept
    again, stopped = chat.ask("and then?", lambda _: None)
    assert not stopped and again and chat.last.stats.generated_tokens == 60


def test_old_turns_make_room_and_a_message_too_long_is_refused(zoo, chat_llama):
    llm = zoo.llm(chat_llama, max_context=64)
    chat = Chat(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for i in range(6):
        chat.ask(f"question number {i} about caches", lambda _: None)
    assert chat.dropped > 0 and chat.history[-2]["content"] == "question number 5 about caches"
    assert len(llm.encode(chat.history[:-1], chat=True)) < 64
    kept = list(chat.history)
    with pytest.raises(ContextLengthError):
        chat.ask("tier " * 80, lambda _: None)
    assert chat.history == kept  # refused before anything was dropped


def _read_until(fd: int, proc: subprocess.Popen, marker: str, seen: list[str], timeout: float = 180) -> str:
    """Read the pty into seen[0] until `marker` appears after what was read before; returns the new text."""
    start = len(seen[0])
    deadline = time.monotonic() + timeout
    while marker not in seen[0][start:]:
        assert time.monotonic() < deadline, f"no {marker!r} in {seen[0][start:]!r} (before: {seen[0][max(0, start - 800):start]!r})"
        if select.select([fd], [], [], 0.1)[0]:
            try:
                seen[0] += os.read(fd, 4096).decode(errors="replace")
            except OSError:  # the child closed the terminal
                assert marker in seen[0][start:], f"exited ({proc.poll()}) without {marker!r}: {seen[0][start:]!r}"
    return seen[0][start:]


# The child makes the pty on its fd 0 its controlling terminal (it leads a new session), so Ctrl-C
# typed there is SIGINT to it, as in a shell. Done in the child's own code: a preexec_fn can
# deadlock when this process has threads (a loaded LLM's) at the fork. It also restores SIGINT's
# default handler, as a shell does for its foreground job: a suite started in the background of a
# non-interactive shell (`pytest ... &`) ignores SIGINT, the child inherits SIG_IGN through exec and
# Python keeps it, so Ctrl-C would never reach the chat (seen: the prompt hung after "^C").
CHAT = ("import fcntl, signal, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
        "signal.signal(signal.SIGINT, signal.default_int_handler); sys.argv[0] = 'tiered'; "
        "from tiered.cli import app; app()")


def test_the_chat_command_in_a_terminal(chat_llama):
    """`tiered chat` on a pty: a message, /stats, /reset, Ctrl-C at the prompt once (kept), then EOF.
    The Ctrl-C lands on whichever of the chat's threads the kernel picks: the prompt must wake."""
    cmd = [sys.executable, "-c", CHAT, "chat", "--model", str(chat_llama),
           "--plan", "off", "--decode-weights", "fp32", "--temperature", "0", "--max-tokens", "8"]
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                            env={**os.environ, "TERM": "dumb"})
    os.close(slave)
    seen = [""]
    try:
        _read_until(master, proc, PROMPT, seen)
        os.write(master, b"the quick brown fox\n")
        answer = _read_until(master, proc, PROMPT, seen)
        assert "error" not in answer
        os.write(master, b"/stats\n")
        assert "1 question," in _read_until(master, proc, PROMPT, seen)
        os.write(master, b"/reset\n")
        assert "(conversation cleared)" in _read_until(master, proc, PROMPT, seen)
        os.write(master, b"/stats\n")
        assert "0 questions" in _read_until(master, proc, PROMPT, seen)
        os.write(master, b"\x03")  # Ctrl-C at the prompt: a hint, not an exit
        assert "Ctrl-C again" in _read_until(master, proc, PROMPT, seen)
        os.write(master, b"\x04")  # EOF
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)

