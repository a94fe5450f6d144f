"""``JobSpec``: the schema of one Slurm job, checked completely before anything is rendered.

A spec is built from a mapping (a TOML/JSON file, flags on top) by ``JobSpec.from_mapping``.
Every problem is collected and reported at once, with the valid choices, as one ConfigError:
a user fixing a job file should not have to discover its mistakes one submission at a time.
Pure Python, never imports torch.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hpc_ddp import schema
from hpc_ddp.deploy.safe_text import ENV_NAME, control_problem, directive_problem
from hpc_ddp.errors import ConfigError

LAUNCHERS = ("srun", "torchrun")
GPU_BINDINGS = ("gpus-per-node", "gpus-per-task")
# Signals a trainer can catch and that Slurm can deliver ahead of the time limit. KILL/STOP
# cannot be caught; TERM is what Slurm sends at the limit itself, so it is no warning.
SIGNALS = ("USR1", "USR2", "INT", "HUP", "QUIT", "TERM")
TRAIN_MODULE = "hpc_ddp.train"
# What `python -m hpc_ddp.train` listens for without --requeue-signals (hpc_ddp.train.config).
TRAINER_DEFAULT_SIGNALS = ("USR1", "TERM")
_SIGNAL_FLAGS = ("--requeue-signal", "--requeue-signals")

# Every pattern is used with fullmatch ('$' would accept a trailing newline) and ASCII digits only.
# Slurm's --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (or UNLIMITED).
_TIME = re.compile(
    r"\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+(:\d{2}){0,2}|UNLIMITED|INFINITE", re.ASCII
)
_MEM = re.compile(r"\d+[KMGT]?", re.ASCII)
_NAME = re.compile(r"[A-Za-z0-9_.+-]+")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
# One #SBATCH option, long form: --exclusive or --gres=gpu:a100:8 (the value is checked further).
_EXTRA_SBATCH = re.compile(r"--[A-Za-z][A-Za-z0-9-]*(=.+)?")
# Fields written into #SBATCH lines, which sbatch parses (name and extra_sbatch are checked apart).
_DIRECTIVE_FIELDS = ("partition", "account", "qos", "constraint", "output", "error", "workdir")


def _doc(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class JobSpec:
    """One job: where it runs, how its processes are laid out, what each of them runs."""

    name: str = field(default="hpc-ddp", metadata=_doc("job name (--job-name)"))
    nodes: int = field(default=1, metadata=_doc("number of nodes"))
    gpus_per_node: int = field(default=0, metadata=_doc("GPUs per node; 0 = CPU job with Gloo"))
    gpus_per_process: int = field(
        default=1, metadata=_doc("GPUs each process drives: 1 = one process per GPU")
    )
    procs_per_node: int = field(
        default=0,
        metadata=_doc("processes per node; 0 = derived (GPUs/GPUs per process, or 1 on CPU)"),
    )
    launcher: str = field(
        default="srun",
        metadata=_doc("srun = one Slurm task per process; torchrun = one task per node"),
    )
    gpu_binding: str = field(
        default="gpus-per-node",
        metadata=_doc(
            "how GPUs are requested: gpus-per-node (each task sees the node's GPUs) "
            "or gpus-per-task (each task sees only its own)"
        ),
    )
    partition: str = field(default="", metadata=_doc("partition (-p); empty = cluster default"))
    account: str = field(default="", metadata=_doc("account (-A)"))
    qos: str = field(default="", metadata=_doc("quality of service"))
    constraint: str = field(default="", metadata=_doc("node features (-C)"))
    time: str = field(default="01:00:00", metadata=_doc("time limit, Slurm form (D-HH:MM:SS)"))
    cpus_per_task: int = field(default=0, metadata=_doc("CPUs per task; 0 = Slurm's default"))
    mem: str = field(default="", metadata=_doc("memory per node, e.g. 64G; empty = default"))
    signal: str = field(
        default="USR1", metadata=_doc(f"preemption/time-limit warning signal: {SIGNALS}")
    )
    signal_lead_s: int = field(
        default=90, metadata=_doc("seconds before the limit the signal comes; 0 = none")
    )
    requeue: bool = field(default=True, metadata=_doc("allow the job to be requeued"))
    output: str = field(default="%x-%j.out", metadata=_doc("batch log (--output), appended"))
    error: str = field(default="", metadata=_doc("stderr file; empty = into output"))
    per_rank_logs: bool = field(
        default=False, metadata=_doc("srun launcher: one log per rank, <output>.rank<N>")
    )
    exit_wait_s: int = field(
        default=120,
        metadata=_doc("srun --wait: end the step this long after the first task exits"),
    )
    resv_ports: bool = field(
        default=False,
        metadata=_doc(
            "srun launcher: ask Slurm for a reserved port per step (srun --resv-ports=1), used "
            "as MASTER_PORT; needs MpiParams=ports=... in slurm.conf (`hpc-ddp doctor`)"
        ),
    )
    preflight: bool = field(
        default=True,
        metadata=_doc("first run a torch-free step where every task prints its rank and master"),
    )
    workdir: str = field(default="", metadata=_doc("working directory (--chdir)"))
    env: dict[str, str] = field(
        default_factory=dict, metadata=_doc("environment for every process (KEY=VALUE)")
    )
    setup: list[str] = field(
        default_factory=list, metadata=_doc("shell lines run first (module load, venv activation)")
    )
    python: str = field(default="python", metadata=_doc("Python interpreter for srun layouts"))
    module: str = field(default=TRAIN_MODULE, metadata=_doc("module to run (python -m)"))
    script: str = field(default="", metadata=_doc("script to run instead of a module"))
    args: list[str] = field(default_factory=list, metadata=_doc("arguments of the program"))
    extra_sbatch: list[str] = field(
        default_factory=list, metadata=_doc("extra #SBATCH options, e.g. --exclusive")
    )

    def __post_init__(self) -> None:
        problems = _check(self)
        if problems:
            raise ConfigError(
                "invalid job spec:\n  - " + "\n  - ".join(problems),
                hint="fix the values above; `hpc-ddp render --help` lists every field",
            )

    # --- derived layout -----------------------------------------------------------------
    @property
    def ppn(self) -> int:
        """Processes per node."""
        if self.procs_per_node:
            return self.procs_per_node
        return self.gpus_per_node // self.gpus_per_process if self.gpus_per_node else 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.ppn

    @property
    def layout(self) -> str:
        """The template family: torchrun, per-node (one process drives G GPUs), per-gpu, cpu."""
        if self.launcher == "torchrun":
            return "torchrun"
        if self.gpus_per_node == 0:
            return "cpu"
        return "per-node" if self.gpus_per_process > 1 else "per-gpu"

    @property
    def program(self) -> list[str]:
        """What follows the interpreter (or torchrun): ``-m module args`` or ``script args``."""
        head = [self.script] if self.script else ["-m", self.module]
        return [*head, *self.args]

    # --- construction -------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str = "job spec") -> JobSpec:
        """Build from plain data; unknown keys and wrong types are reported with the valid keys."""
        return cls(**schema.from_mapping(cls, data, source=source))

    def replace(self, **changes: Any) -> JobSpec:
        return dataclasses.replace(self, **changes)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check(s: JobSpec) -> list[str]:
    """Every contradiction in one pass; the messages name the valid choices."""
    p: list[str] = []
    if not _NAME.fullmatch(s.name):
        p.append(f"name {s.name!r}: use letters, digits and . _ + - only")
    elif problem := directive_problem("name", s.name):
        p.append(problem)
    if s.nodes < 1:
        p.append(f"nodes must be >= 1, got {s.nodes}")
    if s.gpus_per_node < 0:
        p.append(f"gpus_per_node must be >= 0, got {s.gpus_per_node}")
    if s.gpus_per_process < 1:
        p.append(f"gpus_per_process must be >= 1, got {s.gpus_per_process}")
    if s.procs_per_node < 0:
        p.append(f"procs_per_node must be >= 0 (0 = derived), got {s.procs_per_node}")
    if s.launcher not in LAUNCHERS:
        p.append(f"launcher {s.launcher!r} is not one of {', '.join(LAUNCHERS)}")
    if s.gpu_binding not in GPU_BINDINGS:
        p.append(f"gpu_binding {s.gpu_binding!r} is not one of {', '.join(GPU_BINDINGS)}")
    if s.gpus_per_node > 0 and s.gpus_per_process >= 1:
        g, gpp = s.gpus_per_node, s.gpus_per_process
        if g % gpp:
            p.append(
                f"{g} GPUs per node cannot be split into processes of {gpp} GPUs each; "
                f"valid gpus_per_process for {g} GPUs: {_divisors(g)}"
            )
        elif s.procs_per_node and s.procs_per_node != g // gpp:
            p.append(
                f"procs_per_node={s.procs_per_node} contradicts {g} GPUs per node at {gpp} per "
                f"process ({g // gpp} processes); leave procs_per_node at 0"
            )
    if s.gpus_per_node == 0 and s.gpus_per_process != 1:
        p.append("gpus_per_process only applies to GPU jobs: set gpus_per_node or leave it at 1")
    if s.launcher == "torchrun" and s.gpus_per_process > 1:
        p.append(
            "launcher torchrun starts one process per GPU; one process driving "
            f'{s.gpus_per_process} GPUs needs launcher = "srun" (one task per node)'
        )
    if not _TIME.fullmatch(s.time):
        p.append(f"time {s.time!r} is not a Slurm time (MM, HH:MM:SS, D-HH:MM:SS)")
    elif (
        s.signal_lead_s
        and (limit := time_limit_seconds(s.time)) is not None
        and s.signal_lead_s >= limit
    ):
        p.append(f"signal_lead_s={s.signal_lead_s} is not shorter than the time limit {s.time}")
    if s.cpus_per_task < 0:
        p.append(f"cpus_per_task must be >= 0, got {s.cpus_per_task}")
    if s.mem and not _MEM.fullmatch(s.mem):
        p.append(f"mem {s.mem!r}: expected a number with an optional K/M/G/T suffix")
    if s.signal not in SIGNALS:
        p.append(f"signal {s.signal!r} is not one of {', '.join(SIGNALS)} (no SIG prefix)")
    if s.signal_lead_s < 0 or s.signal_lead_s > 65535:
        p.append(f"signal_lead_s must be in 0..65535 (Slurm's limit), got {s.signal_lead_s}")
    if s.exit_wait_s < 0:
        p.append(f"exit_wait_s must be >= 0, got {s.exit_wait_s}")
    if not s.output:
        p.append("output must name a log file, e.g. '%x-%j.out'")
    if s.resv_ports and s.launcher != "srun":
        p.append("resv_ports needs launcher srun (torchrun's port is chosen before any step)")
    if s.per_rank_logs and s.launcher != "srun":
        p.append("per_rank_logs needs launcher srun (torchrun writes its own per-worker logs)")
    gpp_env = s.env.get("HPC_DDP_GPUS_PER_PROCESS")
    if gpp_env is not None and gpp_env != str(s.gpus_per_process):
        p.append(
            f"env HPC_DDP_GPUS_PER_PROCESS={gpp_env} contradicts gpus_per_process="
            f"{s.gpus_per_process}; set gpus_per_process only (the script exports it)"
        )
    if bool(s.script) == bool(s.module):
        p.append("give exactly one of module (python -m) and script")
    p += _check_text(s)
    p += _check_trainer_args(s)
    return p


def _check_text(s: JobSpec) -> list[str]:
    """Data never becomes code: what each text field may hold where the script puts it.

    An #SBATCH value may hold nothing sbatch would interpret; a value the script shell-quotes
    (python, script, args, env values) may hold anything but control characters; setup lines
    are shell by design, one line each.
    """
    found = [directive_problem(name, v) for name in _DIRECTIVE_FIELDS if (v := getattr(s, name))]
    for i, opt in enumerate(s.extra_sbatch):
        field = f"extra_sbatch[{i}]"
        problem = control_problem(field, opt)
        if not problem and not _EXTRA_SBATCH.fullmatch(opt):
            problem = (
                f"{field} {opt!r}: expected one long option such as '--exclusive' or "
                "'--gres=gpu:8' (write a value after '=', not after a space)"
            )
        found.append(problem or directive_problem(field, opt))
    if s.module and not _MODULE.fullmatch(s.module):
        found.append(f"module {s.module!r}: expected a dotted Python module name (hpc_ddp.train)")
    found += [control_problem("python", s.python), control_problem("script", s.script)]
    found += [control_problem(f"args[{i}]", arg) for i, arg in enumerate(s.args)]
    for key, value in s.env.items():
        if not ENV_NAME.fullmatch(key):
            found.append(f"env key {key!r} is not a valid variable name")
        found.append(control_problem(f"env[{key!r}]", value))
    for i, line in enumerate(s.setup):
        if problem := control_problem(f"setup[{i}]", line, allow_tab=True):
            found.append(f"{problem} (give each shell line as its own setup entry)")
    return [problem for problem in found if problem]


def _check_trainer_args(s: JobSpec) -> list[str]:
    """The trainer must listen for the signal Slurm will send, or preemption loses work."""
    if s.module != TRAIN_MODULE or s.script or not s.signal_lead_s:
        return []
    listened = list(TRAINER_DEFAULT_SIGNALS)
    for i, arg in enumerate(s.args):
        if arg in _SIGNAL_FLAGS and i + 1 < len(s.args):
            listened = s.args[i + 1].split(",")
        elif arg.split("=", 1)[0] in _SIGNAL_FLAGS and "=" in arg:
            listened = arg.split("=", 1)[1].split(",")
    names = [x.strip().upper().removeprefix("SIG") for x in listened]
    if s.signal not in names:
        return [
            f"the job warns with SIG{s.signal} but the trainer listens for {', '.join(names)}: "
            f"add '--requeue-signal {s.signal},TERM' to args (or change signal)"
        ]
    return []


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
        data.update(overrides)
    if data.get("script") and "module" not in data:
        data["module"] = ""  # a script replaces the default program (the trainer module)
    return JobSpec.from_mapping(data, source=source)
