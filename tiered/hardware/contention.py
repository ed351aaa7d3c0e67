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

CONTENDED_SHARE = 0.3  # the share of the cores other processes took above which a measurement is redone
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
