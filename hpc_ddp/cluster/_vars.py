"""Reading launcher variables: numbers that are numbers, errors that name the variable."""

from __future__ import annotations

from collections.abc import Mapping

from hpc_ddp.errors import LaunchEnvError


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
    try:
        number = int(value.strip())
    except ValueError:
        raise LaunchEnvError(
            f"{name}={value!r} is not an integer",
            hint=f"unset {name} or give it a whole number; launchers never set it to text",
        ) from None
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


def check_rank(kind: str, rank: int, size: int, source: str) -> None:
    """rank < size or a LaunchEnvError; ``kind`` is 'rank', 'local rank' or 'node rank'."""
    if not 0 <= rank < size:
        raise LaunchEnvError(
            f"{source}: {kind} {rank} is outside its size {size} (valid: 0..{size - 1})",
            hint="the launcher's variables are inconsistent: look for values exported by hand "
            "or left over from an enclosing job (`env | grep -E 'RANK|SIZE|SLURM_|OMPI_'`)",
        )
