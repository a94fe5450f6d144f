"""Reading launcher variables: numbers that are numbers, errors that name the variable.

Every number read from the environment goes through ``ascii_int``. ``int()`` alone accepts
' 3', '+3', '3_0' and other scripts' digits ('٣' is 3), and ``str.isdigit()`` also says yes
to '³', which ``int()`` then refuses with a traceback. Launchers write plain ASCII digits.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from hpc_ddp.cluster.host_names import is_address
from hpc_ddp.errors import LaunchEnvError

# 18 digits: any id or count a launcher writes fits, and int() never meets Python's
# 4300-digit conversion limit (a ValueError of its own). A '-' is read so that -1 is reported
# as below its minimum rather than as text.
_ASCII_INT = re.compile(r"-?[0-9]{1,18}")
# A launcher's job id is shown to users and hashed into a port: printable ASCII, no spaces.
_JOB_ID = re.compile(r"[!-~]{1,256}")


def ascii_int(text: str) -> int | None:
    """``text`` as an integer if it is 1-18 ASCII digits (after an optional '-') and nothing
    else; otherwise None."""
    return int(text) if _ASCII_INT.fullmatch(text) else None


def get_int(environ: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
    """The integer value of a variable that must be set."""
    if name not in environ:
        raise LaunchEnvError(
            f"{name} is not set",
            hint=f"the launcher normally sets {name}; start the job through it, not by hand",
        )
    return parse_int(environ[name], name, minimum=minimum)


def get_opt_int(environ: Mapping[str, str], name: str, *, minimum: int = 0) -> int | None:
    value = environ.get(name)
    if value is None or value.strip() == "":
        return None
    return parse_int(value, name, minimum=minimum)


def parse_int(value: str, name: str, *, minimum: int = 0) -> int:
    number = ascii_int(value)
    if number is None:
        raise LaunchEnvError(
            f"{name}={value!r} is not an integer (ASCII digits 0-9 only, at most 18)",
            hint=f"unset {name} or give it a plain number such as 2; launchers never write "
            "'+', spaces or other scripts' digits",
        )
    if number < minimum:
        raise LaunchEnvError(
            f"{name}={number} is below its minimum {minimum}",
            hint=f"unset {name} or fix the value that set it",
        )
    return number


def first_int(
    environ: Mapping[str, str], names: tuple[str, ...], *, minimum: int = 0
) -> int | None:
    """The first of ``names`` that is set (launchers spell the same thing several ways)."""
    for name in names:
        value = get_opt_int(environ, name, minimum=minimum)
        if value is not None:
            return value
    return None


def get_address(environ: Mapping[str, str], name: str) -> str | None:
    """The host or IP address in ``name``; None when unset. Set but empty, or holding anything
    but a plain address (spaces, control characters, shell syntax), is an error: an empty
    MASTER_ADDR is usually a command substitution that failed in the job script."""
    if name not in environ:
        return None
    value = environ[name]
    if not is_address(value, zone=True):  # the rules of cluster/host_names.py
        what = "empty" if not value.strip() else "not a host name or IP address"
        raise LaunchEnvError(
            f"{name}={value!r} is {what}",
            hint=f"give {name} rank 0's host name or IP address (letters, digits, '.', '-', "
            f"'_', ':'), or unset it so the launcher's own value is used",
        )
    return value


def first_job_id(environ: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    """The first of ``names`` that is set and not empty; an id holding control characters,
    spaces or non-ASCII text is an error (it would reach terminals and logs as it is)."""
    for name in names:
        value = environ.get(name)
        if not value:
            continue
        if not _JOB_ID.fullmatch(value):
            raise LaunchEnvError(
                f"{name}={value!r} is not a job id (printable ASCII without spaces, at most "
                "256 characters)",
                hint=f"unset {name} or give it a plain id; launchers write numbers or names",
            )
        return value
    return None


def check_rank(kind: str, rank: int, size: int, source: str) -> None:
    """rank < size or a LaunchEnvError; ``kind`` is 'rank', 'local rank' or 'node rank'."""
    if not 0 <= rank < size:
        raise LaunchEnvError(
            f"{source}: {kind} {rank} is outside its size {size} (valid: 0..{size - 1})",
            hint="the launcher's variables are inconsistent: look for values exported by hand "
            "or left over from an enclosing job (`env | grep -E 'RANK|SIZE|SLURM_|OMPI_'`)",
        )


def check_part_of_world(kind: str, size: int, world: int, source: str) -> None:
    """A node's processes (or the node count) cannot outnumber the whole world."""
    if size > world:
        raise LaunchEnvError(
            f"{source}: {kind} {size} is larger than the world size {world}",
            hint="the launcher's variables are inconsistent: look for LOCAL_WORLD_SIZE, "
            "*_LOCAL_SIZE or node counts exported by hand or left over from another launch",
        )
