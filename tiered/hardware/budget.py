"""Memory budgets: hard byte limits per tier, checked at every allocation."""

from __future__ import annotations

import re
import threading

from tiered.errors import BudgetError, ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str | int | float | None) -> int | None:
    """'12GiB' / '512MB' / '1.5g' / 1024 -> bytes (int); None -> None.

    Raises:
        ConfigError: the text is not a size.
    """
    if text is None or isinstance(text, (int, float)):
        return None if text is None else int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read {text!r} as a memory size", "write e.g. 12GiB, 512MB or 1073741824")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: int | float) -> str:
    """Bytes as a short human string (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


class MemoryBudget:
    """A tier's byte budget. Thread-safe; `reserve` raises before the limit is crossed.

    Args:
        name: tier name for messages ("gpu", "cpu").
        capacity: limit in bytes; None = unlimited.
    """

    def __init__(self, name: str, capacity: int | None) -> None:
        self.name, self.capacity = name, capacity
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()

    @property
    def free(self) -> float:
        return float("inf") if self.capacity is None else self.capacity - self.used

    def fits(self, nbytes: int) -> bool:
        return self.capacity is None or self.used + nbytes <= self.capacity

    def reserve(self, nbytes: int, what: str = "") -> None:
        """Account `nbytes` more. Raises BudgetError (nothing reserved) if it would exceed capacity."""
        with self._lock:
            if self.capacity is not None and self.used + nbytes > self.capacity:
                raise BudgetError(
                    f"{self.name} budget exceeded: {what or 'allocation'} needs {format_bytes(nbytes)}, "
                    f"{format_bytes(self.capacity - self.used)} of {format_bytes(self.capacity)} left",
                    f"raise --{self.name}-mem or place more on a slower tier")
            self.used += nbytes
            self.peak = max(self.peak, self.used)

    def empty(self, shape: tuple[int, ...], dtype, what: str = "", pin: bool = False):
        """An uninitialized host tensor reserved against this budget (pinned when `pin`).

        Raises BudgetError (nothing reserved) when it does not fit.
        """
        import torch

        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.reserve(n, what)
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=pin)
        except BaseException:
            self.release(n)
            raise

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes
            assert self.used >= 0, f"{self.name} budget released more than reserved"
