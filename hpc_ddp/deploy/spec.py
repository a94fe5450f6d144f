"""``JobSpec``: one Slurm job (sbatch or submitit), checked completely before anything is rendered.

The shared core (nodes, GPUs, processes, env, setup, workdir, program) and its rules are
``hpc_ddp.deploy.core.ProcessSpec``; this module adds what only Slurm has: the job's name and
limits, the launcher, the preemption signal, #SBATCH directives. A spec is built from a mapping
(a TOML/JSON file, flags on top) by ``JobSpec.from_mapping``; every problem is reported at once,
as one ConfigError, with the valid choices. Pure Python, never imports torch.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, get_args

from hpc_ddp import schema
from hpc_ddp.deploy.core import NODES, ProcessSpec, problem_list
from hpc_ddp.deploy.launchers import DEFAULT_LAUNCHER, LAUNCHERS
from hpc_ddp.deploy.safe_text import (
    CHOICE,
    DIRECTIVE,
    PATTERN,
    SHELL,
    WORD,
    control_problem,
    directive_problem,
)
from hpc_ddp.deploy.spec_fields import Slurm, sbatch_option
from hpc_ddp.env_vars import GPUS_PER_PROCESS_VAR
from hpc_ddp.errors import ConfigError
from hpc_ddp.schema import field_doc as _doc

# The launcher's names are the table's keys (hpc_ddp.deploy.launchers).
Launcher = Literal[tuple(LAUNCHERS)]  # type: ignore[valid-type]
GpuBinding = Literal["gpus-per-node", "gpus-per-task"]
GPU_BINDINGS: tuple[GpuBinding, ...] = get_args(GpuBinding)
# The template family a spec renders to: its launcher's own, else by its GPUs.
Layout = Literal["per-gpu", "per-node", "cpu", "torchrun"]
# Signals a trainer can catch and that Slurm can deliver ahead of the time limit. KILL/STOP
# cannot be caught; TERM is what Slurm sends at the limit itself, so it is no warning.
Signal = Literal["USR1", "USR2", "INT", "HUP", "QUIT", "TERM"]
SIGNALS: tuple[Signal, ...] = get_args(Signal)

# Every pattern is used with fullmatch ('$' would accept a trailing newline) and ASCII digits only.
# Slurm's --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (or UNLIMITED); at most 8 digits
# a part (190 years of minutes), so that reading one is never int() of a thousand digits.
_TIME = re.compile(
    r"\d{1,8}|\d{1,8}:\d{2}|\d{1,8}:\d{2}:\d{2}|\d{1,8}-\d{1,8}(:\d{2}){0,2}|UNLIMITED|INFINITE",
    re.ASCII,
)
_MEM = re.compile(r"\d+[KMGT]?", re.ASCII)
_NAME = re.compile(r"[A-Za-z0-9_.+-]+")
# Slurm's --array: indexes and ranges (with a step), comma-separated, an optional %max running.
_ARRAY_ITEM = r"\d+(-\d+(:\d+)?)?"
_ARRAY = re.compile(rf"{_ARRAY_ITEM}(,{_ARRAY_ITEM})*(%\d+)?", re.ASCII)
# One #SBATCH option, long form: --exclusive or --gres=gpu:a100:8 (the value is checked further).
_EXTRA_SBATCH = re.compile(r"--[A-Za-z][A-Za-z0-9-]*(=.+)?")
# A number of nodes, or Slurm's range MIN-MAX (at most 8 digits each: any more is out of range).
_NODES = re.compile(r"(\d{1,8})(?:-(\d{1,8}))?", re.ASCII)


# Seconds Slurm takes for a signal's lead (sbatch --signal=SIG@0..65535).
LEAD_S = schema.Range(0, 65535, why="Slurm's limit")


# How the fields JobSpec takes from ProcessSpec reach Slurm (its own fields say it themselves).
_PROCESS_FIELDS: Mapping[str, Slurm] = MappingProxyType(
    {
        "gpus_per_node": Slurm(
            sbatch="--gpus-per-node (or --gpus-per-task, gpu_binding)",
            submitit="gpus_per_node (or slurm_gpus_per_task)",
            slurm_only=True,
        ),
        "gpus_per_process": Slurm(
            sbatch="--ntasks-per-node, --gpus-per-task",
            script=f"the processes' environment ({GPUS_PER_PROCESS_VAR})",
            submitit="tasks_per_node, slurm_gpus_per_task",
        ),
        "procs_per_node": Slurm(sbatch="--ntasks-per-node", submitit="tasks_per_node"),
        "workdir": Slurm(sbatch="--chdir", plain=True, slurm_only=True, text=DIRECTIVE),
        "env": Slurm(script="exported before every step", submitit="each task's environment",
                     text=WORD),
        "setup": Slurm(script="shell lines before every step", submitit="slurm_setup",
                       slurm_only=True, text=SHELL),
        "python": Slurm(
            script="the interpreter of every process",
            refused="submitit runs the submitter's interpreter (it unpickles the call); leave "
            "python at its default",
            text=WORD,
        ),
        "module": Slurm(script="the program (python -m)", submitit="the task's program",
                        text=PATTERN),
        "script": Slurm(script="the program", submitit="the task's program", text=WORD),
        "args": Slurm(script="the program's arguments", submitit="the task's program", text=WORD),
        "container": Slurm(
            script="the step's command, in the image",
            refused="submitit runs the task with this Python, not in a container image; submit a "
            "spec with a [container] table through --executor sbatch",
        ),
    }
)  # fmt: skip
_LOGS_IN_FOLDER = "submitit writes every task's log in its folder (<job>_<task>_log.out/.err)"


@dataclass(frozen=True, kw_only=True)
class JobSpec(ProcessSpec):
    """One Slurm job: the shared core (ProcessSpec) plus its name, limits, launcher, signal.
    Each field says in its metadata how it reaches Slurm (``slurm``, hpc_ddp.deploy.spec_fields);
    ``SLURM_FIELDS`` holds them all."""

    nodes: int | str = field(
        default=1,
        metadata=_doc(
            f"number of nodes, {NODES.bounds()}, or a range MIN-MAX (1-4): the job starts on "
            "what Slurm gives it",
            "-N",
            slurm=Slurm(sbatch="--nodes", submitit="nodes (a range is refused)", text=PATTERN),
        ),
    )
    name: str = field(
        default="hpc-ddp",
        metadata=_doc(
            "job name (sbatch -J)", "-J", "--job-name",
            slurm=Slurm(sbatch="--job-name", submitit="name", slurm_only=True, text=PATTERN),
        ),
    )  # fmt: skip
    launcher: Launcher = field(
        default=DEFAULT_LAUNCHER,
        metadata=_doc(
            "; ".join(launcher.help for launcher in LAUNCHERS.values()),
            slurm=Slurm(
                sbatch="--ntasks-per-node",
                script="the template and the step's command",
                submitit="one task per process (only launchers that start one task per "
                "process fit)",
                text=CHOICE,
            ),
        ),
    )
    gpu_binding: GpuBinding = field(
        default="gpus-per-node",
        metadata=_doc(
            "how GPUs are requested: gpus-per-node (each task sees the node's GPUs) "
            "or gpus-per-task (each task sees only its own)",
            slurm=Slurm(
                sbatch="--gpus-per-node or --gpus-per-task",
                submitit="gpus_per_node or slurm_gpus_per_task",
                slurm_only=True,
                text=CHOICE,
            ),
        ),
    )
    partition: str = field(
        default="",
        metadata=_doc(
            "partition; empty = cluster default", "-p",
            slurm=Slurm(sbatch="--partition", plain=True, submitit="slurm_partition",
                        slurm_only=True, text=DIRECTIVE),
        ),
    )  # fmt: skip
    account: str = field(
        default="",
        metadata=_doc(
            "account to charge", "-A",
            slurm=Slurm(sbatch="--account", plain=True, submitit="slurm_account",
                        slurm_only=True, text=DIRECTIVE),
        ),
    )  # fmt: skip
    qos: str = field(
        default="",
        metadata=_doc(
            "quality of service",
            slurm=Slurm(sbatch="--qos", plain=True, submitit="slurm_qos", slurm_only=True,
                        text=DIRECTIVE),
        ),
    )  # fmt: skip
    constraint: str = field(
        default="",
        metadata=_doc(
            "node features", "-C",
            slurm=Slurm(sbatch="--constraint", plain=True, submitit="slurm_constraint",
                        slurm_only=True, text=DIRECTIVE),
        ),
    )  # fmt: skip
    reservation: str = sbatch_option("--reservation", "run in this reservation")
    exclusive: bool = sbatch_option("--exclusive", "no other job on the nodes", default=False)
    mail_type: str = sbatch_option("--mail-type", "mail on these events, e.g. END,FAIL")
    mail_user: str = sbatch_option("--mail-user", "whom the mail goes to")
    time: str = field(
        default="01:00:00",
        metadata=_doc(
            "time limit, Slurm form (D-HH:MM:SS)", "-t",
            slurm=Slurm(sbatch="--time", submitit="timeout_min (whole minutes, rounded up)",
                        text=PATTERN),
        ),
    )  # fmt: skip
    cpus_per_task: int = field(
        default=0,
        metadata=_doc(
            "CPUs per task; 0 = Slurm's default",
            range=schema.Range(0, 4 * schema.MAX_PER_NODE),
            slurm=Slurm(sbatch="--cpus-per-task (a task's processes' CPUs)",
                        submitit="cpus_per_task", slurm_only=True),
        ),
    )  # fmt: skip
    mem: str = field(
        default="",
        metadata=_doc(
            "memory per node, e.g. 64G; empty = default",
            slurm=Slurm(sbatch="--mem", submitit="mem (an additional parameter: Slurm's string)",
                        slurm_only=True, text=PATTERN),
        ),
    )  # fmt: skip
    signal: Signal = field(
        default="USR1",
        metadata=_doc(
            f"preemption/time-limit warning signal, one of {SIGNALS}; sbatch's SIG@SECONDS "
            "(USR1@90) also sets signal_lead_s",
            slurm=Slurm(
                sbatch="--signal=SIG@LEAD",
                script="forwarded to the tasks",
                replaced="submitit's warning signal is USR2 (the trainer is told to listen for it)",
                text=CHOICE,
            ),
        ),
    )
    signal_lead_s: int = field(
        default=90,
        metadata=_doc(
            "seconds before the limit the signal comes; 0 = none",
            range=LEAD_S,
            slurm=Slurm(sbatch="--signal=SIG@LEAD",
                        submitit="slurm_signal_delay_s (local: signal_delay_s)"),
        ),
    )  # fmt: skip
    requeue: bool = field(
        default=True,
        metadata=_doc(
            "allow the job to be requeued",
            slurm=Slurm(
                sbatch="--requeue or --no-requeue",
                script="the requeue after a checkpoint",
                submitit="--requeue",
                refused="submitit requeues a preempted job itself (scontrol requeue)",
            ),
        ),
    )
    output: str = field(
        default="%x-%j.out",
        metadata=_doc(
            "batch log (--output), appended",
            slurm=Slurm(sbatch="--output, --open-mode=append", replaced=_LOGS_IN_FOLDER,
                        text=DIRECTIVE),
        ),
    )  # fmt: skip
    error: str = field(
        default="",
        metadata=_doc(
            "stderr file; empty = into output",
            slurm=Slurm(sbatch="--error", replaced=_LOGS_IN_FOLDER, text=DIRECTIVE),
        ),
    )
    per_rank_logs: bool = field(
        default=False,
        metadata=_doc(
            "srun launcher: one log per rank, <output>.rank<N>",
            slurm=Slurm(script="srun --output=<output>.rank%t",
                        replaced="submitit always writes one log per task"),
        ),
    )  # fmt: skip
    exit_wait_s: int = field(
        default=120,
        metadata=_doc(
            "srun --wait: end the step this long after the first task exits",
            range=schema.Range(0, 86_400),
            slurm=Slurm(script="srun --wait=N", submitit="slurm_srun_args --wait=N",
                        slurm_only=True),
        ),
    )  # fmt: skip
    resv_ports: bool = field(
        default=False,
        metadata=_doc(
            "srun launcher: ask Slurm for a reserved port per step (srun --resv-ports=1), used "
            "as MASTER_PORT; needs MpiParams=ports=... in slurm.conf (`hpc-ddp doctor`)",
            slurm=Slurm(
                script="srun --resv-ports=1",
                refused="submitit's srun gets no reserved port; set resv_ports = false",
            ),
        ),
    )
    preflight: bool = field(
        default=True,
        metadata=_doc(
            "first run a torch-free step where every task prints its rank and master",
            slurm=Slurm(script="a preflight step",
                        replaced="submitit's sbatch script has no preflight step"),
        ),
    )  # fmt: skip
    array: str = field(
        default="",
        metadata=_doc(
            "job array (--array), e.g. 0-3 or 0,4,8%2; each task trains into <run dir>_<task id>",
            slurm=Slurm(
                sbatch="--array",
                plain=True,
                script="each task's run dir and log",
                refused="submitit writes --array itself; use Executor.map_array for a sweep of "
                "functions, or --executor sbatch for an array of trainer runs",
                text=PATTERN,
            ),
        ),
    )
    extra_sbatch: list[str] = field(
        default_factory=list,
        metadata=_doc(
            "extra #SBATCH options, e.g. --gres=nic:1",
            slurm=Slurm(
                script="an #SBATCH line each, as given",
                submitit="slurm_additional_parameters (but options submitit writes itself)",
                slurm_only=True,
                text=DIRECTIVE,
            ),
        ),
    )

    def __post_init__(self) -> None:
        self._adopt_container_table()
        problems = self._settle_nodes() + self.core_problems() + _check(self)
        if problems:
            raise ConfigError(
                "invalid job spec:" + problem_list(problems),
                hint="fix the values above; `hpc-ddp render --help` lists every field",
            )

    def _settle_nodes(self) -> list[str]:
        """``nodes`` as one number (an int, also from "4" or "4-4"), or a range's text
        "MIN-MAX" with MIN < MAX; else why not. Called first in ``__post_init__``."""
        value = self.nodes
        found = _NODES.fullmatch(value) if isinstance(value, str) else None
        if found:
            low, high = int(found.group(1)), int(found.group(2) or found.group(1))
            if 1 <= low <= high <= NODES.hi:
                settled = low if low == high else f"{low}-{high}"
                object.__setattr__(self, "nodes", settled)  # frozen: settled once, here
                return []
        elif isinstance(value, int) and not isinstance(value, bool):
            problem = NODES.problem("nodes", value, int)
            return [f"{problem}, or a range MIN-MAX such as 1-4"] if problem else []
        return [
            f"nodes {value!r}: expected a number of nodes or a range MIN-MAX such as 1-4, "
            f"with 1 <= MIN <= MAX <= {NODES.hi:g}"
        ]

    @property
    def node_range(self) -> tuple[int, int]:
        """(MIN, MAX) of the nodes the job may start on; one number gives MIN = MAX."""
        if isinstance(self.nodes, str):
            low, _, high = self.nodes.partition("-")
            return int(low), int(high)
        return self.nodes, self.nodes

    @property
    def nodes_vary(self) -> bool:
        """Whether Slurm chooses the number of nodes (a range): the script must read it then."""
        return isinstance(self.nodes, str)

    @property
    def world_size(self) -> int:
        """The processes of the job on its fewest nodes (a range's world is known only when the
        job starts; ``world_text`` says both ends)."""
        return self.node_range[0] * self.ppn

    @property
    def world_text(self) -> str:
        """The number of processes, "8", or its range, "4-8"."""
        low, high = self.node_range
        return str(low * self.ppn) if low == high else f"{low * self.ppn}-{high * self.ppn}"

    @property
    def layout(self) -> Layout:
        """The template family: torchrun, per-node (one process drives G GPUs), per-gpu, cpu."""
        fixed = LAUNCHERS[self.launcher].layout
        if fixed is not None:
            return fixed
        if self.gpus_per_node == 0:
            return "cpu"
        return "per-node" if self.gpus_per_process > 1 else "per-gpu"

    # --- construction -------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str = "job spec") -> JobSpec:
        """Build from plain data; unknown keys and wrong types are reported with the valid keys."""
        return cls(**schema.from_mapping(cls, split_signal(data), source=source))

    def replace(self, **changes: Any) -> JobSpec:
        return dataclasses.replace(self, **changes)


def _check(s: JobSpec) -> list[str]:
    """The Slurm fields' rules, in one pass; the messages name the valid choices. Rules that
    compute with numbers run only when every number is in its range (core_problems says
    which are not)."""
    numbers_ok = not schema.number_problems(s)
    p: list[str] = []
    if not _NAME.fullmatch(s.name):
        p.append(f"name {s.name!r}: use letters, digits and . _ + - only")
    elif problem := directive_problem("name", s.name):
        p.append(problem)
    if s.launcher not in LAUNCHERS:
        p.append(f"launcher {s.launcher!r} is not one of {', '.join(LAUNCHERS)}")
    if s.gpu_binding not in GPU_BINDINGS:
        p.append(f"gpu_binding {s.gpu_binding!r} is not one of {', '.join(GPU_BINDINGS)}")
    launcher = LAUNCHERS.get(s.launcher)
    if numbers_ok and launcher is not None:
        p += launcher.gpu_problems(s)
    if not _TIME.fullmatch(s.time):
        p.append(f"time {s.time!r} is not a Slurm time (MM, HH:MM:SS, D-HH:MM:SS)")
    elif (
        numbers_ok
        and s.signal_lead_s
        and (limit := time_limit_seconds(s.time)) is not None
        and s.signal_lead_s >= limit
    ):
        p.append(f"signal_lead_s={s.signal_lead_s} is not shorter than the time limit {s.time}")
    if s.mem and not _MEM.fullmatch(s.mem):
        p.append(f"mem {s.mem!r}: expected a number with an optional K/M/G/T suffix")
    if s.signal not in SIGNALS:
        p.append(f"signal {s.signal!r} is not one of {', '.join(SIGNALS)} (no SIG prefix)")
    if not s.output:
        p.append("output must name a log file, e.g. '%x-%j.out'")
    if s.array and not _ARRAY.fullmatch(s.array):
        p.append(
            f"array {s.array!r}: expected Slurm's --array form, e.g. 0-3, 1,3,5, 0-15:4 or 0-7%2"
        )
    if launcher is not None:
        p += launcher.option_problems(s)
    if not s.script and not s.module:
        p.append("give exactly one of module (python -m) and script")
    p += _check_directives(s)
    p += _check_program_args(s)
    return p


def _check_directives(s: JobSpec) -> list[str]:
    """An #SBATCH value may hold nothing sbatch would interpret (the core checks the rest)."""
    found = [
        directive_problem(name, value)
        for name, slurm in SLURM_FIELDS.items()
        if slurm.text == DIRECTIVE and isinstance(value := getattr(s, name), str) and value
    ]
    for i, opt in enumerate(s.extra_sbatch):
        field = f"extra_sbatch[{i}]"
        problem = control_problem(field, opt)
        if not problem and not _EXTRA_SBATCH.fullmatch(opt):
            problem = (
                f"{field} {opt!r}: expected one long option such as '--exclusive' or "
                "'--gres=gpu:8' (write a value after '=', not after a space)"
            )
        found.append(problem or directive_problem(field, opt))
    return [problem for problem in found if problem]


# How every field of a JobSpec reaches Slurm, in the fields' order (hpc_ddp.deploy.spec_fields).
SLURM_FIELDS: Mapping[str, Slurm] = MappingProxyType(
    {f.name: f.metadata.get("slurm") or _PROCESS_FIELDS[f.name] for f in fields(JobSpec)}
)


def _check_program_args(s: JobSpec) -> list[str]:
    """What the program's hook says of its arguments: refused ones, a run dir the batch shell
    or an array needs, and the signal Slurm will send, which it must listen for or preemption
    loses work."""
    hook = s.program_hook
    if hook is None:
        return []
    try:
        flags = hook.flags(s.args)
    except ConfigError as err:
        return [f"args: {err.message}"]
    # render reads no files: a run dir only in a --config file is unknown to the batch shell
    config_only = flags.settings_file and not flags.run_dir
    launcher = LAUNCHERS.get(s.launcher)
    reads_marker = launcher is not None and launcher.reads_marker
    if s.container and reads_marker and s.requeue and config_only:
        return [
            f"a {s.launcher} job in a container is requeued by its batch shell when {hook.name}'s "
            "requeue marker is in the run dir, which the script must name: add "
            "'--run-dir runs/NAME' to args (a --config file's run_dir is read only when the "
            "job runs)"
        ]
    if s.array and not flags.run_dir:
        return [
            f"array {s.array!r}: each task trains into <run dir>_<task id>; give the run dir "
            "in args ('--run-dir runs/NAME')"
        ]
    names = flags.signals
    if s.signal_lead_s and names is not None and s.signal not in names:
        return [
            f"the job warns with SIG{s.signal} but {hook.name} listens for {', '.join(names)}: "
            f"add '--requeue-signal {s.signal},TERM' to args (or change signal)"
        ]
    return []


# sbatch's --signal value: [B:]SIG[@SECONDS] (SIG with or without its SIG prefix).
_SBATCH_SIGNAL = re.compile(r"(?:B:)?(?:SIG)?([A-Z0-9]+)(?:@([0-9]{1,5}))?", re.ASCII)


def split_signal(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """``signal = "USR1@90"`` (sbatch's spelling) as signal USR1 and signal_lead_s 90. A lead
    given both ways must agree; anything else is left for the field checks to report."""
    value = data.get("signal")
    found = _SBATCH_SIGNAL.fullmatch(value) if isinstance(value, str) else None
    if found is None or (found.group(0) == found.group(1)):
        return data
    out = {**data, "signal": found.group(1)}
    if found.group(2) is not None:
        lead = int(found.group(2))
        given = data.get("signal_lead_s", data.get("signal-lead-s"))
        if given is not None and given != lead:
            raise ConfigError(
                f"signal {value!r} says {lead} s before the limit, signal_lead_s says {given}",
                hint="give the lead once: --signal USR1@90, or --signal USR1 --signal-lead-s 90",
            )
        out["signal_lead_s"] = lead
    return out


def time_limit_seconds(limit: str) -> int | None:
    """Seconds in a Slurm time limit, or None for UNLIMITED."""
    if limit in ("UNLIMITED", "INFINITE"):
        return None
    days = 0
    if "-" in limit:
        d, limit = limit.split("-", 1)
        days = int(d)
        parts = [int(x) for x in limit.split(":")]
        parts += [0] * (3 - len(parts))  # D-H, D-H:M
        h, m, sec = parts
    else:
        parts = [int(x) for x in limit.split(":")]
        if len(parts) == 1:
            h, m, sec = 0, parts[0], 0  # plain number = minutes
        elif len(parts) == 2:
            h, m, sec = 0, parts[0], parts[1]
        else:
            h, m, sec = parts
    return ((days * 24 + h) * 60 + m) * 60 + sec


def load_spec_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML or JSON spec file into plain data (not yet validated)."""
    return schema.load_file(path, what="job spec")


def build_spec(
    file: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> JobSpec:
    """File values first, then ``overrides`` (flags win). Nothing is written anywhere."""
    data: dict[str, Any] = dict(load_spec_file(file)) if file else {}
    source = str(file) if file else "flags"
    if overrides:
        for given, other in (("script", "module"), ("module", "script")):
            if overrides.get(given) and other not in overrides:
                data.pop(other, None)  # a flag's program replaces the file's (flags win)
        data = schema.merge(data, overrides)
    if data.get("script") and "module" not in data:
        data["module"] = ""  # a script replaces the default program (the trainer module)
    return JobSpec.from_mapping(data, source=source)
