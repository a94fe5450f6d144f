"""Old flag spellings that still work, with a notice on stderr naming the new one.

Not a command itself: ``render`` and ``submit`` register their former names through
``add_deprecated`` (hidden from --help, same destination as the new flag).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


class _Deprecated(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, *, use: str, **kw: Any) -> None:
        self.use = use
        super().__init__(option_strings, dest, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        print(
            f"{parser.prog}: {option_string} is deprecated; use {self.use}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def add_deprecated(
    parser: argparse.ArgumentParser, *old: str, dest: str, use: str, **kw: Any
) -> None:
    """``old`` spellings of the flag stored in ``dest``; ``use``: what to say instead."""
    parser.add_argument(*old, dest=dest, action=_Deprecated, use=use, help=argparse.SUPPRESS, **kw)
