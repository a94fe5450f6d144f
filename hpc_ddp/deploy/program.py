"""What the deployment layer asks of the program a job runs: the program's hook.

A job runs a program, ``python -m MODULE ARGS``. Before anything is submitted, deployment checks
some of its arguments and reads answers off them: the signals the program checkpoints on (Slurm's
warning must be one of them), its run dir (where submit and status find result.json and
progress.json, and the torchrun layout's batch shell the requeue marker), the lines that show its
result.json, and what it needs on the compute nodes (render's summary, ``hpc-ddp doctor --job``).
Only the program knows, with its own parser: a ``ProgramHook`` answers for it. The base class
answers for a program deployment knows nothing about; a hook overrides what its program decides.

Deployment never imports a program. It finds the hook of ``python -m MODULE`` by the module's
name: one given to ``register`` (by a layer above deploy that knows the program), else an entry
point of the group ``hpc_ddp.programs`` that an installed package declares::

    [project.entry-points."hpc_ddp.programs"]
    "mypkg.train" = "mypkg.train_hook:HOOK"

A module with neither is a program of the user's, asked only for its ``--run-dir``, read as
written (``program_run_dir``). A hook module must not import torch: jobs are described on login
nodes that may lack it. Torch-free; importing this module costs next to nothing, so that the
command line can register its programs whatever command runs.
"""

from __future__ import annotations

import importlib
import itertools
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from hpc_ddp.errors import HpcDdpError

if TYPE_CHECKING:
    from hpc_ddp.doctor_checks import Check
    from hpc_ddp.run_dir.paths import RunPaths

ENTRY_POINT_GROUP = "hpc_ddp.programs"
# The most lines a result.json of a program without its own lines shows (its scalar fields).
MAX_RESULT_LINES = 40
# Words that end a command in a shell line (a rendered step runs in the background: `... &`).
_SHELL_OPERATORS = frozenset({"&", "&&", "|", "||", ";"})


@dataclass(frozen=True)
class ProgramFlags:
    """What deployment reads from a program's arguments, as the program's own parser reads them."""

    run_dir: str | None = None  # the run dir the arguments give (None: not given)
    settings_file: str | None = None  # a file of settings (--config), read when the job runs
    signals: tuple[str, ...] | None = None  # what it checkpoints on, without SIG; None: unknown


@dataclass(frozen=True, kw_only=True)
class JobNeeds:
    """What a program needs where its job runs (render's summary, ``hpc-ddp doctor --job``)."""

    run_dir: str | None = None  # relative to the job's working directory unless absolute
    imports: tuple[str, ...] = ()  # modules its interpreter must import ("hpc_ddp", "torch")

    def summary_lines(self, where: Callable[[str], str]) -> list[str]:
        """Lines (indented by two spaces) for render's summary of the job; ``where(path)`` names
        a path that the program resolves against the job's working directory."""
        return []

    def checks(self, workdir: Path) -> list[Check]:
        """Doctor's checks of what it needs, run where the job runs; ``workdir``: the job's
        working directory."""
        return []


class ProgramHook:
    """What the deployment layer asks of the program a job runs (see the module's docstring).
    Every method takes the program's arguments, the words after ``-m MODULE``."""

    name = "the program"  # how messages name it: "the trainer would refuse its arguments"
    default_run_dir: str | None = None  # its run dir when its arguments give none

    def flags(self, args: Sequence[str]) -> ProgramFlags:
        """Its flags that deployment asks about, as its own parser reads them. Raises
        ConfigError for arguments the program would refuse."""
        return ProgramFlags(run_dir=program_run_dir(args))

    def run_paths(self, args: Sequence[str], workdir: str | Path) -> RunPaths | None:
        """Its run dir when it starts in ``workdir`` with ``args`` (a settings file read as the
        program reads it, relative to ``workdir``); None if it has none. Raises ConfigError for
        arguments the program would refuse, or a settings file it could not read."""
        from hpc_ddp.run_dir.paths import RunPaths

        run_dir = self.flags(args).run_dir or self.default_run_dir
        return None if run_dir is None else RunPaths(Path(workdir) / run_dir)

    def shell_run_dir(self, args: Sequence[str]) -> str | None:
        """Its run dir as a batch script names it before the job runs (relative to the job's
        working directory, where the program resolves it too): the one its arguments give, else
        its default unless a settings file may set another (a render reads no files). None:
        not known until it runs."""
        flags = self.flags(args)
        if flags.run_dir is not None:
            return flags.run_dir
        return None if flags.settings_file else self.default_run_dir

    def result_lines(self, result: Mapping[str, Any]) -> list[str]:
        """The lines (indented by two spaces) that show its result.json."""
        return plain_result_lines(result)

    def job_needs(self, args: Sequence[str]) -> JobNeeds:
        """What it needs where its job runs, from ``args`` (a settings file read from here).
        Raises ConfigError for arguments the program would refuse."""
        return JobNeeds(run_dir=self.shell_run_dir(args))

    def launcher_requeue_args(self, signals: Sequence[str]) -> list[str]:
        """Arguments added when submitit starts it: checkpoint on ``signals`` (``SIGUSR1``...)
        and leave the requeue to submitit; none for a program without such flags."""
        return []


def program_run_dir(args: Sequence[str]) -> str | None:
    """The run dir a program without a hook is given: the last ``--run-dir X`` or
    ``--run-dir=X`` of ``args``, before any ``--``. Read as written: the program's own parser
    is unknown, so neither an abbreviation nor a config file counts."""
    found, words = None, iter(args)
    for word in words:
        if word == "--":
            break
        if word == "--run-dir":
            found = next(words, None)
        elif word.startswith("--run-dir="):
            found = word.removeprefix("--run-dir=")
    return found or None


def plain_result_lines(result: Mapping[str, Any]) -> list[str]:
    """A result.json of a program without lines of its own: its scalar fields, in its order,
    at most MAX_RESULT_LINES of them."""
    scalars = [(k, v) for k, v in result.items() if v is None or isinstance(v, str | int | float)]
    lines = [f"  {key}: {value}" for key, value in scalars[:MAX_RESULT_LINES]]
    if len(scalars) > MAX_RESULT_LINES:
        lines.append(f"  ... and {len(scalars) - MAX_RESULT_LINES} more fields")
    return lines


def result_lines(result: Mapping[str, Any], module: str | None) -> list[str]:
    """The lines that show ``result``, the result.json of a job that runs ``python -m module``
    (None: a script, or a program not known)."""
    hook = program_hook(module) if module else None
    return hook.result_lines(result) if hook is not None else plain_result_lines(result)


# --- finding a module's hook -------------------------------------------------------------------
_registered: dict[str, ProgramHook | str] = {}
_found: dict[str, ProgramHook | None] = {}
_declared: dict[str, str] | None = None  # the entry points, read once


def register(module: str, hook: ProgramHook | str, *, replace: bool = True) -> None:
    """Make ``hook`` the hook of ``python -m module`` in this process, ahead of any entry point.
    ``hook``: the hook itself, or where it is as an entry point names it (``"pkg.mod:NAME"``),
    imported when a job that runs ``module`` is first looked at. ``replace=False`` keeps a hook
    registered before."""
    if replace or module not in _registered:
        _registered[module] = hook
        _found.pop(module, None)


def program_hook(module: str) -> ProgramHook | None:
    """The hook of ``python -m module``: registered, else declared as an entry point; None for
    a program without one. Raises HpcDdpError for a hook that cannot be loaded."""
    if module in _found:
        return _found[module]
    where = _registered.get(module)
    if where is None:
        where = _declared_hooks().get(module)
    hook = None if where is None else _load(module, where)
    _found[module] = hook
    return hook


def _declared_hooks() -> dict[str, str]:
    """module -> "pkg.mod:NAME" of the group's entry points; the first declaration of a module
    counts (the installed packages in sys.path order)."""
    global _declared
    if _declared is None:
        from importlib.metadata import entry_points  # tens of ms: only once a hook is asked for

        _declared = {}
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            _declared.setdefault(entry.name, entry.value)
    return _declared


def _load(module: str, where: ProgramHook | str) -> ProgramHook:
    """The hook ``where`` names; HpcDdpError, naming the module and where, if it cannot be
    loaded or is no ProgramHook."""
    if isinstance(where, ProgramHook):
        return where
    hint = (
        f"reinstall the package that declares {module!r} in the entry point group "
        f"{ENTRY_POINT_GROUP!r}, or fix what it names (a ProgramHook: 'package.module:NAME')"
    )
    path, _, attrs = where.partition(":")
    try:
        found: object = importlib.import_module(path.strip())
        for attr in attrs.strip().split(".") if attrs.strip() else ():
            found = getattr(found, attr)
    except (Exception, SystemExit) as err:  # the hook module's import runs its code
        raise HpcDdpError(
            f"the hook of {module} ({where}) cannot be loaded: {type(err).__name__}: {err}",
            hint=hint,
        ) from None
    if not isinstance(found, ProgramHook):
        raise HpcDdpError(
            f"the hook of {module} ({where}) is a {type(found).__name__}, not a ProgramHook "
            "(hpc_ddp.deploy.program)",
            hint=hint,
        )
    return found


class ScriptProgram(NamedTuple):
    """A program a batch script runs: ``python -m module args``, which ``hook`` answers for."""

    module: str
    hook: ProgramHook
    args: list[str]


def program_in_script(text: str) -> ScriptProgram | None:
    """The program of a batch script that deployment can ask about: the first ``-m MODULE``
    whose module has a hook, and the words after it on its (``\\``-continued) line, up to the
    end of that command; None if no line runs one. For a script without its spec, such as a
    committed ``jobs/*.sbatch``. A module named in the script is only looked up, never imported:
    only a hook registered or installed can answer."""
    for line in text.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote: not a command line of ours
            continue
        for i in range(len(words) - 1):
            if words[i] == "-m" and (hook := program_hook(words[i + 1])) is not None:
                rest = words[i + 2 :]
                args = list(itertools.takewhile(lambda w: w not in _SHELL_OPERATORS, rest))
                return ScriptProgram(words[i + 1], hook, args)
    return None
