"""Errors that tiered raises for bad input.

Every error carries a one-line message naming the problem and a hint naming the fix; the CLI prints
both on one line and exits non-zero without a traceback.
"""

from __future__ import annotations


class TieredError(Exception):
    """Base class of tiered's user-facing errors.

    Args:
        message: what is wrong, one line.
        hint: what the user should do about it, one line.
    """

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class CheckpointError(TieredError):
    """A checkpoint is missing, incomplete, corrupt or of an unsupported format."""


class UnsupportedModelError(TieredError):
    """The checkpoint is readable but its architecture or one of its options is not supported."""


class ContextLengthError(TieredError):
    """A prompt (plus the tokens asked for) does not fit in the context window."""


class ConfigError(TieredError):
    """An engine or sampling setting is invalid."""


class BudgetError(TieredError):
    """A memory budget is too small for what must be placed in it."""
