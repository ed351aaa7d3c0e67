"""How much of the CPU other processes took while something was measured.

A measurement of this machine (the kernel tuning, kernels/tune.py; the hardware profile,
hardware/profiler.py) taken while other processes ran times the neighbours as much as the machine:
two builds of the same sources tuned at once on the 2-core Zen 4 VM (2026-11-27) chose opposite
kernel options, and a quick profile measured while CI's tests ran priced SmolLM2's decode at half
the speed it then ran. Each such measurement records `others_share` over its run and is "contended"
above CONTENDED_SHARE. Setup's kernel tuning and `tiered profile` measure a contended one again at
once, RETRIES times at most (a machine that is never quiet keeps its last); the engine, finding a
contended cached profile, measures it again when the machine is quiet now (`quiet_now`), and else
plans with it (a measurement now would be disturbed too).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# the share of the cores other processes took above which a measurement is redone. 0.3 until 2026-12-03: a
# kernel tuning measured while one pytest process ran beside it on the 2-core Sapphire Rapids VM took others'
# share 0.239, passed as quiet, and chose bf16_native_rows 2 and dequantize rows 128 where quiet tunings there
# choose 8 and 256 (9 tests failed on that build); quiet tunings record 0.01-0.05 (a fresh 2-core Zen 4 VM:
# 0.046 right after pip).
CONTENDED_SHARE = 0.15
RETRIES = 3  # contended measurements in a row after which the last is kept


def _busy_seconds() -> float | None:
    """CPU seconds every process on this machine has run (/proc/stat's user + nice + system + irq +
    softirq + steal over USER_HZ), or None where /proc/stat is not readable (not Linux)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    busy = sum(fields[i] for i in (0, 1, 2, 5, 6, 7) if i < len(fields))
    return busy / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    """CPU seconds this process has run (all its threads)."""
    t = os.times()
    return t.user + t.system


def start() -> tuple[float | None, float, float]:
    """A reading to pass to `others_share` later: (all processes' CPU seconds, this process's, the
    monotonic clock), seconds."""
    return _busy_seconds(), _own_seconds(), time.monotonic()


def others_share(busy0: float | None, own0: float, wall0: float) -> float | None:
    """The share of the cores other processes ran since (busy0, own0, wall0) = `start()`: (all processes'
    CPU seconds - this one's) / (wall seconds x cores), in [0, 1] give or take the counters' ticks;
    None without /proc/stat."""
    busy1 = _busy_seconds()
    wall = time.monotonic() - wall0
    if busy0 is None or busy1 is None or wall <= 0:
        return None
    return max(0.0, (busy1 - busy0) - (_own_seconds() - own0)) / (wall * (os.cpu_count() or 1))


def record(reading: tuple[float | None, float, float], previous: dict | None) -> dict:
    """The fields a measurement keeps about its neighbours, from its `start()` reading and the record
    it replaces (`previous`, None for a first one): {"others_share": share rounded to 1e-3 (None
    without /proc/stat), "contended": share > CONTENDED_SHARE, "attempts": measurements in a row since
    the last uncontended one}."""
    share = others_share(*reading)
    return {"others_share": None if share is None else round(share, 3),
            "contended": share is not None and share > CONTENDED_SHARE,
            "attempts": int(previous.get("attempts", 1)) + 1 if previous and previous.get("contended") else 1}


def keep(fields: dict) -> bool:
    """Whether a measurement with these `record` fields is kept: not contended, or contended RETRIES
    times in a row already. One saved before the fields existed is kept."""
    return not fields.get("contended") or int(fields.get("attempts", 1)) >= RETRIES


def quiet_now(seconds: float = 0.3) -> bool | None:
    """Whether other processes take at most CONTENDED_SHARE of the cores now: their share over
    `seconds` of this process sleeping. None without /proc/stat."""
    reading = start()
    time.sleep(seconds)
    share = others_share(*reading)
    return None if share is None else share <= CONTENDED_SHARE


ADAPT_MIN_S = 0.25  # seconds between ThreadGovernor's readings (a decode step of SmolLM2 takes ~6 ms)
# A reading older than this spans an idle gap (between two requests): what other processes ran then says
# little of now, and ThreadGovernor.check starts a fresh one instead of acting on it. Judged on the gap, a
# gpt-oss-shaped 32-token prompt that followed llama.cpp's 5 s prompt in another process ran on one thread
# (0.51 s against 0.29-0.30 on two; 2 Sapphire Rapids cores, 2026-11-29): llama.cpp had left by then.
ADAPT_MAX_S = 2.0


class ThreadGovernor:
    """The CPU team's threads while other processes take cores: fewer, and the plan's again when they leave.

    An OpenMP team of one thread per core waits at every parallel region for its slowest thread, and
    a thread whose core another process holds is slowest by a scheduler quantum: SmolLM2's default
    engine on the 2-core EPYC (2026-11-28) decoded 169.5 tok/s alone and 49.7 beside one busy process
    on 2 threads, 114.2 and 109.2 on 1 (OMP_WAIT_POLICY=PASSIVE: 54.9 alone, 102.2 beside it). At
    most every ADAPT_MIN_S seconds `check` reads how many cores the other processes took since the
    last reading (`others_share` x cores) and gives the team max(1, cores - round(that)) threads, no
    more than the plan's; a reading older than ADAPT_MAX_S (an idle gap between requests) is not acted on,
    a fresh one is started. It acts only where this process may run on every core (an affinity mask of
    fewer would count neighbours on cores it never uses) and /proc/stat is readable.

    Args:
        threads: the plan's CPU threads (Plan.cpu_threads), the most it gives.
        cores: the machine's cores (default os.cpu_count()).
    """

    def __init__(self, threads: int, cores: int | None = None) -> None:
        self.threads = max(1, int(threads))
        self.cores = cores or os.cpu_count() or 1
        self.current = self.threads
        self.changes = 0  # how often the team was resized (for tests and stats)
        self._reading = start()

    def check(self) -> int:
        """Resize torch's CPU team (torch.set_num_threads) to this moment's free cores when the last
        reading is ADAPT_MIN_S old; returns the team's threads."""
        age = time.monotonic() - self._reading[2]
        if age < ADAPT_MIN_S:
            return self.current
        share = others_share(*self._reading) if age <= ADAPT_MAX_S else None  # older: an idle gap's (ADAPT_MAX_S)
        self._reading = start()
        if share is None:
            return self.current
        target = max(1, min(self.threads, self.cores - int(share * self.cores + 0.5)))
        if target != self.current:
            import torch

            torch.set_num_threads(target)
            self.current, self.changes = target, self.changes + 1
        return self.current

    def restore(self) -> None:
        """Torch's CPU team back to the plan's threads where `check` left it fewer (LLM.close): torch's thread count
        is the process's, and the next engine plans its threads from it (config.cpu_threads). A planner-validation
        run on the 2-core EPYC (2026-12-01) had one engine's governor leave the team at 1 thread after a
        neighbour's burst, and every engine after it, planned and run on 1 thread, decoded SmolLM2 at 7.1 ms a
        token where 2 threads take 5.8."""
        if self.current != self.threads:
            import torch

            torch.set_num_threads(self.threads)
            self.current = self.threads


def thread_governor(threads: int, configured: int | None) -> ThreadGovernor | None:
    """A ThreadGovernor for an engine's CPU team of `threads`, or None where it would not act: threads
    given explicitly (EngineConfig.num_threads, `configured`), one thread, TIERED_ADAPT_THREADS=0, an
    affinity mask narrower than the machine, or no /proc/stat."""
    if configured or threads <= 1 or os.environ.get("TIERED_ADAPT_THREADS", "1") == "0" or _busy_seconds() is None:
        return None
    try:
        if len(os.sched_getaffinity(0)) != (os.cpu_count() or 1):
            return None
    except (AttributeError, OSError):
        return None
    return ThreadGovernor(threads)
