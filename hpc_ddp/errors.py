"""One error type for everything a user can fix: what was found, what was expected, the fix."""

from __future__ import annotations


class HpcDdpError(Exception):
    """A problem the user can act on; ``hint`` says how to fix it. The CLI prints both, exits 2."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\nHINT: {self.hint}" if self.hint else self.message


class ConfigError(HpcDdpError):
    """Bad settings: unknown keys, contradictions, values out of range."""


class LaunchEnvError(HpcDdpError):
    """The launcher's variables are missing, contradictory or impossible."""


def first_few(names: list[str], limit: int) -> str:
    """``names`` for a message: the first ``limit`` joined, then how many more there are."""
    more = len(names) - limit
    return ", ".join(names[:limit]) + (f" and {more} more" if more > 0 else "")
