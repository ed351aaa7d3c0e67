"""The CPU team's threads follow the cores other processes leave free (hardware/contention.ThreadGovernor):
an OpenMP team of one thread per core stalls at every parallel region while another process holds one of
its cores (SmolLM2 on 2 cores: 169.5 tok/s alone, 49.7 beside a busy process on 2 threads, 109.2 on 1)."""

from __future__ import annotations

import pytest
import torch

from tiered.hardware import contention


@pytest.fixture
def readings(monkeypatch):
    """contention's readings under the test's control: the shares `others_share` returns, in turn,
    and a clock that has always moved past ADAPT_MIN_S."""
    shares: list[float | None] = []
    clock = [0.0]

    def fake_start():
        clock[0] += 1.0
        return (0.0, 0.0, clock[0])
    monkeypatch.setattr(contention, "start", fake_start)
    monkeypatch.setattr(contention, "others_share", lambda *a: shares.pop(0))
    monkeypatch.setattr(contention.time, "monotonic", lambda: clock[0] + 1.0)
    return shares


def test_the_team_shrinks_while_neighbours_take_cores_and_grows_back(readings):
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        gov = contention.ThreadGovernor(4, cores=4)
        readings += [0.05, 0.26, 0.5, 0.9, None, 0.1]  # of the 4 cores: 0.2, ~1, 2, 3.6 busy; unreadable; quiet
        got = [gov.check() for _ in range(6)]
        assert got == [4, 3, 2, 1, 1, 4] and torch.get_num_threads() == 4 and gov.changes == 4
    finally:
        torch.set_num_threads(saved)


def test_the_team_never_grows_past_the_plans_threads(readings):
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        gov = contention.ThreadGovernor(2, cores=8)
        readings += [0.0, 0.5]  # 4 of 8 cores busy: 4 free, the plan's 2 kept
        assert [gov.check(), gov.check()] == [2, 2] and gov.changes == 0
    finally:
        torch.set_num_threads(saved)


def test_a_reading_across_an_idle_gap_is_not_acted_on(monkeypatch):
    """A reading older than ADAPT_MAX_S spans an idle gap (between two requests): a neighbour busy then may
    have left (a 32-token prompt right after llama.cpp's 5 s prompt ran on one thread, 0.51 s for 0.30), so
    the team is kept and a fresh reading starts; the next check acts on that one."""
    saved = torch.get_num_threads()
    clock = [0.0]
    shares = [1.0]  # the fresh window: the neighbour still there
    monkeypatch.setattr(contention, "start", lambda: (0.0, 0.0, clock[0]))
    monkeypatch.setattr(contention, "others_share", lambda *a: shares.pop(0))
    monkeypatch.setattr(contention.time, "monotonic", lambda: clock[0])
    try:
        torch.set_num_threads(2)
        gov = contention.ThreadGovernor(2, cores=2)
        clock[0] = contention.ADAPT_MAX_S + 5.0  # idle since the first reading
        assert gov.check() == 2 and gov.changes == 0 and shares == [1.0]  # not read: a new window started
        clock[0] += contention.ADAPT_MIN_S
        assert gov.check() == 1 and shares == []  # the new window's reading acts
    finally:
        torch.set_num_threads(saved)


def test_a_reading_younger_than_the_interval_changes_nothing(monkeypatch):
    gov = contention.ThreadGovernor(2, cores=2)
    monkeypatch.setattr(contention, "others_share", lambda *a: pytest.fail("read too soon"))
    assert gov.check() == 2  # just built: its first reading is not ADAPT_MIN_S old


def test_where_the_governor_acts(monkeypatch):
    """Not where the threads were given (EngineConfig.num_threads), for one thread, with
    TIERED_ADAPT_THREADS=0, or where this process may not run on every core."""
    monkeypatch.setenv("TIERED_ADAPT_THREADS", "1")
    monkeypatch.setattr(contention.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(contention.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(contention, "_busy_seconds", lambda: 1.0)
    assert isinstance(contention.thread_governor(2, None), contention.ThreadGovernor)
    assert contention.thread_governor(2, 2) is None and contention.thread_governor(1, None) is None
    monkeypatch.setattr(contention.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert contention.thread_governor(2, None) is None
    monkeypatch.setattr(contention.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setenv("TIERED_ADAPT_THREADS", "0")
    assert contention.thread_governor(2, None) is None


def test_an_engine_checks_its_team_every_step(monkeypatch, zoo):
    """LLM builds a governor where one would act (torch's default threads) and consults it at each step (a
    decode burst's once); a request's stats keep the fewest threads its steps had, and `tiered run` says when
    they were fewer than the plan's."""
    from tiered import LLM, EngineConfig, SamplingParams, cli

    monkeypatch.setenv("TIERED_ADAPT_THREADS", "1")
    monkeypatch.setattr(contention.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(contention.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(zoo.dir("llama"), EngineConfig(accelerator="none", max_context=64))
        try:
            assert isinstance(llm.threads, contention.ThreadGovernor) and llm.threads.threads == 2
            calls = []
            monkeypatch.setattr(llm.threads, "check", lambda: calls.append(1) or 2)
            out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
            assert len(calls) == 2  # the prefill's step, then one decode burst (LLM._burst) of the 3 tokens left
            llm.bursts = False  # one step a token: each consults it
            calls.clear()
            out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
            assert len(calls) >= 4  # the prefill's step and each decode step
            assert out.stats.cpu_threads == 2 and cli._fewer_threads(llm, out.stats) == ""
            teams = iter([2, 2, 1, 2, 2, 2])  # a neighbour took a core for one step: the request says so
            monkeypatch.setattr(llm.threads, "check", lambda: next(teams))
            out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
            assert out.stats.cpu_threads == 1 and out.stats.as_dict()["cpu_threads"] == 1
            assert "CPU threads down to 1 of 2" in cli._fewer_threads(llm, out.stats)
        finally:
            llm.close()
        given = LLM(zoo.dir("llama"), EngineConfig(accelerator="none", max_context=64, num_threads=2))
        assert given.threads is None
        given.close()
    finally:
        torch.set_num_threads(saved)


def test_closing_an_engine_gives_torch_back_the_plans_threads(monkeypatch, zoo):
    """ThreadGovernor.restore (LLM.close): a team the governor left smaller goes back to the plan's threads, since
    torch's thread count is the process's and the next engine plans from it (config.cpu_threads): one validation
    run's engines after a neighbour's burst all planned and ran on 1 of 2 threads."""
    import time

    from tiered import LLM, EngineConfig
    from tiered.config import cpu_threads

    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        llm = LLM(zoo.dir("llama"), EngineConfig(accelerator="none", max_context=64))
        gov = llm.threads = contention.ThreadGovernor(2, cores=2)
        gov._reading = (0.0, 0.0, time.monotonic() - contention.ADAPT_MIN_S - 0.1)  # a reading old enough ...
        monkeypatch.setattr(contention, "others_share", lambda *a: 0.9)  # ... in which neighbours took 1.8 cores
        assert gov.check() == 1 and torch.get_num_threads() == 1 and cpu_threads(EngineConfig()) == 1
        llm.close()
        assert torch.get_num_threads() == 2 and gov.current == 2 and cpu_threads(EngineConfig()) == 2
        gov.restore()  # nothing to give back
        assert torch.get_num_threads() == 2 and gov.changes == 1
    finally:
        torch.set_num_threads(saved)
