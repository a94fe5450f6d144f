"""Where the tasks of an srun step run: its nodes in the order SLURM_NODEID counts them.

In an ordinary step that is SLURM_STEP_NODELIST's order: its node i is SLURM_NODEID i, and task 0
runs on its first node whatever the distribution (block, cyclic, plane). A heterogeneous step
(``srun A : B``, ``srun --het-group=0,1``) breaks that (Slurm's src/srun/srun.c,
src/slurmd/slurmstepd/task.c): srun joins the components' node lists, sorts the joint list and
reorders the tasks per node to match (``_reorder_het_job_recs``), while each task's SLURM_NODEID
and SLURM_PROCID are offsets in component order, component 0's nodes first. The order is rebuilt
from the components' allocations, SLURM_JOB_NODELIST_HET_GROUP_<n> (srun's own allocation sets
only the older _PACK_GROUP_<n>): a component's step nodes keep the order of its allocation. srun
leaves a joint list that names a host twice (components sharing a node) unsorted.

SLURMD_NODENAME, the node this task runs on, checks the result. A heterogeneous step inside an
ordinary allocation (``srun A : B`` in a job without ``hetjob``) is sorted the same way but has no
per-component lists: there the check is what turns a wrong answer into an error.
"""

from __future__ import annotations

from collections.abc import Mapping

from hpc_ddp.cluster._vars import first_int
from hpc_ddp.cluster.hostlist import MAX_HOSTS, expand_hostlist
from hpc_ddp.errors import LaunchEnvError

# slurm.h: MAX_HET_JOB_COMPONENTS.
MAX_HET_COMPONENTS = 128
_HET_SIZE_VARS = ("SLURM_HET_SIZE", "SLURM_PACK_SIZE")


def _group_vars(n: int) -> tuple[str, str]:
    return (f"SLURM_JOB_NODELIST_HET_GROUP_{n}", f"SLURM_JOB_NODELIST_PACK_GROUP_{n}")


def het_size(environ: Mapping[str, str]) -> int | None:
    """The number of components of the heterogeneous job, or None for an ordinary job."""
    size = first_int(environ, _HET_SIZE_VARS, minimum=1)
    if size is not None and size > MAX_HET_COMPONENTS:
        raise LaunchEnvError(
            f"SLURM_HET_SIZE={size}: a heterogeneous job has at most {MAX_HET_COMPONENTS} "
            "components",
            hint="unset SLURM_HET_SIZE if it was exported by hand; Slurm sets it in the job",
        )
    return size


def _components(environ: Mapping[str, str], size: int, nodelist: str) -> list[list[str]]:
    """Each component's allocated hosts, in Slurm's order."""
    missing = [_group_vars(n)[0] for n in range(size) if not any(map(environ.get, _group_vars(n)))]
    if missing:
        raise LaunchEnvError(
            f"heterogeneous step (SLURM_HET_SIZE={size}) without {', '.join(missing)}: srun "
            f"sorts the step's node list (SLURM_STEP_NODELIST={nodelist!r}) across components "
            "while SLURM_NODEID counts nodes in component order, and only the components' node "
            "lists tell which node is which",
            hint="start the step with a real srun inside the heterogeneous job (sbatch, salloc "
            "and srun set SLURM_JOB_NODELIST_HET_GROUP_<n>; keep them in srun --export), or "
            "start each component as a step of its own",
        )
    groups, total = [], 0
    for n in range(size):
        name = next(name for name in _group_vars(n) if environ.get(name))
        hosts = expand_hostlist(environ[name])
        total += len(hosts)
        if total > MAX_HOSTS:
            raise LaunchEnvError(
                f"the components' node lists (SLURM_JOB_NODELIST_HET_GROUP_0..{n}) name more "
                f"than {MAX_HOSTS} hosts (the most a Slurm job can have)",
                hint="Slurm never writes this; look for SLURM_JOB_NODELIST_HET_GROUP_<n> "
                "exported by hand",
            )
        groups.append(hosts)
    return groups


def node_order(
    environ: Mapping[str, str], hosts: list[str], tasks: list[int], nodelist: str
) -> tuple[list[str], list[int]]:
    """The step's hosts and tasks per host, in the order SLURM_NODEID numbers the nodes.

    ``hosts`` and ``tasks`` are SLURM_STEP_NODELIST and SLURM_STEP_TASKS_PER_NODE expanded (one
    entry per node, already checked to match); ``nodelist`` is the text, for messages.
    """
    size = het_size(environ)
    if size is None or size == 1 or len(set(hosts)) != len(hosts):
        return hosts, tasks
    groups = _components(environ, size, nodelist)
    step = set(hosts)
    owner: dict[str, int] = {}
    for n, group in enumerate(groups):
        for host in step.intersection(group):
            if owner.setdefault(host, n) != n:
                raise LaunchEnvError(
                    f"heterogeneous step: {host} is in the node lists of components "
                    f"{owner[host]} and {n} (SLURM_JOB_NODELIST_HET_GROUP_{owner[host]}, "
                    f"SLURM_JOB_NODELIST_HET_GROUP_{n}), so the order SLURM_NODEID counts the "
                    "step's nodes in cannot be told",
                    hint="give the components distinct nodes, or start each component as a "
                    "step of its own",
                )
    strays = [host for host in hosts if host not in owner]
    if strays:
        raise LaunchEnvError(
            f"heterogeneous step: {strays[0]} of SLURM_STEP_NODELIST={nodelist!r} is in no "
            f"component's node list (SLURM_JOB_NODELIST_HET_GROUP_0..{size - 1})",
            hint="these come from Slurm; look for SLURM_* variables exported by hand or "
            "inherited from another job",
        )
    order = list(dict.fromkeys(h for n, grp in enumerate(groups) for h in grp if owner.get(h) == n))
    counts = dict(zip(hosts, tasks, strict=True))
    return order, [counts[host] for host in order]


def check_this_node(
    environ: Mapping[str, str], hosts: list[str], node_rank: int, nodelist: str
) -> None:
    """SLURMD_NODENAME (where this task runs) is the node SLURM_NODEID names in ``hosts``."""
    here = environ.get("SLURMD_NODENAME")
    if not here or here == hosts[node_rank]:
        return
    raise LaunchEnvError(
        f"this task runs on SLURMD_NODENAME={here!r}, but SLURM_NODEID={node_rank} is "
        f"{hosts[node_rank]!r} of the step's nodes (SLURM_STEP_NODELIST={nodelist!r}): the node "
        "list is not in the order Slurm numbers the nodes, so rank 0's host and the processes "
        "per node cannot be told",
        hint="a heterogeneous step inside an ordinary allocation (`srun A : B`) has its node "
        "list sorted and no per-component lists: submit a heterogeneous job (`#SBATCH hetjob`) "
        "or start each component as a step of its own; otherwise look for SLURM_* variables "
        "exported by hand",
    )
