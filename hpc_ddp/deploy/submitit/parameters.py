"""A ``JobSpec`` as submitit's ``update_parameters``: every field reaches Slurm, is replaced by
submitit's own mechanism (said so in ``describe``), or is refused with the field's name.

submitit writes the sbatch script itself, so the spec's Slurm settings travel as its parameters:
``slurm_qos``, ``slurm_constraint``, ``slurm_setup`` (shell lines before srun), ``slurm_srun_args``
and ``slurm_additional_parameters`` (any other ``#SBATCH --key=value``). Memory keeps Slurm's own
string (``64G``) through the additional parameters: submitit's ``mem_gb`` is a float of GB.
Pure Python; never imports submitit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from hpc_ddp.deploy.core import problem_list
from hpc_ddp.deploy.launchers import LAUNCHERS
from hpc_ddp.deploy.safe_text import control_problem
from hpc_ddp.deploy.spec import SLURM_FIELDS, JobSpec, time_limit_seconds
from hpc_ddp.errors import ConfigError
from hpc_ddp.private_paths import private_dir_problem

Kind = Literal["submitit", "local"]

# #SBATCH options submitit writes itself (its logs, its signal, its arrays): extra_sbatch may not.
SUBMITIT_OWNED = ("output", "error", "open-mode", "signal", "array", "wckey")
# submitit's minimum: one minute.
_NO_LIMIT_MINUTES = 60 * 24 * 365


def checked_folder(folder: str | Path) -> Path:
    """submitit's folder, refused if it holds a control character (submitit writes it into the
    #SBATCH lines of its script, where a line break would start a line of shell) or if it exists
    and is no private directory of this user's (submitit keeps the job's pickles there, and a
    pickle runs code when it is loaded). Submission creates a missing one with mode 0700
    (``private_paths.ensure_private_dir``); nothing is created here."""
    if problem := control_problem("submitit folder", str(folder)):
        raise ConfigError(problem, hint="give the folder (--folder, folder=) a name of one line")
    if os.path.lexists(folder) and (problem := private_dir_problem(Path(folder))):
        raise ConfigError(
            f"submitit folder {folder} is {problem}; submitit keeps the job's pickles there, "
            "and a pickle someone else could write would run as you",
            hint=f"if it is yours, `chmod go-w {folder}`; otherwise give --folder (folder=) "
            "a directory only you can write, or one that does not exist yet",
        )
    return Path(folder)


def executor_parameters(spec: JobSpec, kind: Kind) -> dict[str, Any]:
    """submitit's ``update_parameters`` for ``spec``; ConfigError for what submitit cannot do."""
    problems = refused(spec, kind)
    if problems:
        raise ConfigError(
            f"the submitit executor ({kind}) cannot run this spec:" + problem_list(problems),
            hint="change the fields named above, or use --executor sbatch",
        )
    minutes = timeout_minutes(spec.time)
    if kind == "local":
        return dict(
            timeout_min=minutes, tasks_per_node=spec.ppn, signal_delay_s=spec.signal_lead_s or 30
        )
    params: dict[str, Any] = dict(
        timeout_min=minutes, tasks_per_node=spec.ppn, nodes=spec.nodes, name=spec.name
    )
    if spec.gpus_per_node:
        if spec.gpu_binding == "gpus-per-task":
            params["slurm_gpus_per_task"] = spec.gpus_per_process
        else:
            params["gpus_per_node"] = spec.gpus_per_node
    if spec.cpus_per_task:
        params["cpus_per_task"] = spec.cpus_per_task
    params["slurm_signal_delay_s"] = spec.signal_lead_s or 90
    extra: dict[str, Any] = {"requeue": True}
    for name, slurm in SLURM_FIELDS.items():  # the plain #SBATCH options that are set
        if slurm.plain and (value := getattr(spec, name)):
            if slurm.submitit:
                params[slurm.submitit] = value
            else:
                extra[slurm.option] = value
    if spec.setup:
        params["slurm_setup"] = list(spec.setup)
    # srun --wait as in the rendered scripts: a stuck exit cannot hold the allocation.
    params["slurm_srun_args"] = [f"--wait={spec.exit_wait_s}"]
    if spec.mem:
        extra["mem"] = spec.mem
    extra.update(extra_sbatch_parameters(spec.extra_sbatch))
    params["slurm_additional_parameters"] = extra
    return params


def refused(spec: JobSpec, kind: Kind) -> list[str]:
    """Why submitit cannot honour ``spec``, one line per field; empty when it can."""
    default = JobSpec()
    p = [
        f"{_shown(name, value)}: {slurm.refused}"
        for name, slurm in SLURM_FIELDS.items()
        if slurm.refused and (value := getattr(spec, name)) != getattr(default, name)
    ]
    if not LAUNCHERS[spec.launcher].by_submitit:
        fits = " or ".join(f"launcher = {n!r}" for n, ln in LAUNCHERS.items() if ln.by_submitit)
        p.append(f"launcher: submitit starts one task per process itself; use {fits}")
    if spec.nodes_vary:
        p.append(
            f"nodes {spec.nodes!r}: submitit counts a job's tasks (nodes x tasks per node) when "
            "it submits it and waits for the result of each; give one number of nodes, or "
            "use --executor sbatch, whose script reads the number Slurm gave the job"
        )
    elif kind == "local" and spec.nodes != 1:
        p.append(
            f"nodes: the local executor runs on one machine; the spec asks for {spec.nodes} "
            "nodes (set nodes = 1, or use --executor submitit)"
        )
    for i, opt in enumerate(spec.extra_sbatch):
        key = opt[2:].partition("=")[0]
        if key in SUBMITIT_OWNED:
            p.append(
                f"extra_sbatch[{i}] {opt!r}: submitit writes --{key} itself "
                f"(it owns {', '.join('--' + k for k in SUBMITIT_OWNED)})"
            )
    return p


def _shown(name: str, value: Any) -> str:
    """A field and its value as a spec file writes them: ``requeue = false``, ``array '0-3'``;
    a table by its name only."""
    if isinstance(value, bool):
        return f"{name} = {str(value).lower()}"
    return f"{name} {value!r}" if isinstance(value, str | int) else name


def extra_sbatch_parameters(options: list[str]) -> dict[str, Any]:
    """``["--exclusive", "--comment=x"]`` -> ``{"exclusive": True, "comment": "x"}``: the form of
    submitit's additional parameters (JobSpec has checked each option already)."""
    parsed: dict[str, Any] = {}
    for opt in options:
        key, eq, value = opt[2:].partition("=")
        parsed[key] = value if eq else True
    return parsed


def not_used(spec: JobSpec, kind: Kind) -> list[str]:
    """The fields set in ``spec`` that this executor replaces or ignores, each with why."""
    default = JobSpec()
    changed = [
        (name, slurm)
        for name, slurm in SLURM_FIELDS.items()
        if getattr(spec, name) != getattr(default, name)
    ]
    notes = [f"{name}: {slurm.replaced}" for name, slurm in changed if slurm.replaced]
    if kind == "local":
        no_slurm = "no Slurm under the local executor"
        notes += [f"{name}: {no_slurm}" for name, slurm in changed if slurm.slurm_only]
    return notes


def timeout_minutes(limit: str) -> int:
    """A Slurm time limit in whole minutes (rounded up, at least 1), submitit's unit."""
    secs = time_limit_seconds(limit)
    return _NO_LIMIT_MINUTES if secs is None else max(1, (secs + 59) // 60)
