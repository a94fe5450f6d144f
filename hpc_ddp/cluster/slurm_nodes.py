"""Where the tasks of an srun step run: its nodes in the order SLURM_NODEID counts them, and the
host of task 0 (the default MASTER_ADDR).

In an ordinary step both come from SLURM_STEP_NODELIST: its node i is SLURM_NODEID i, and task 0
runs on its first node whatever the distribution (block, cyclic, plane). Two kinds of step break
that (Slurm's src/srun/srun.c, src/slurmd/slurmstepd/task.c):

- A heterogeneous step (``srun A : B``, ``srun --het-group=0,1``). srun joins the components'
  node lists, sorts the joint list and reorders the tasks per node to match
  (``_reorder_het_job_recs``), while each task's SLURM_NODEID and SLURM_PROCID are offsets in
  component order, component 0's nodes first. The order is rebuilt from the components'
  allocations, SLURM_JOB_NODELIST_HET_GROUP_<n> (srun's own allocation sets only the older
  _PACK_GROUP_<n>): a component's step nodes keep the order of its allocation. srun leaves a joint
  list that names a host twice (components sharing a node) unsorted.
- ``--distribution=arbitrary``: task i runs on the i-th host of SLURM_HOSTFILE (or of srun's
  ``-w`` list, which the tasks never see), while the node list stays in Slurm's order.

SLURMD_NODENAME, the node this task runs on, checks the result. A heterogeneous step inside an
ordinary allocation (``srun A : B`` in a job without ``hetjob``) is sorted the same way but has no
per-component lists: there the check is what turns a wrong answer into an error.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from hpc_ddp.cluster._vars import ascii_int, first_int
from hpc_ddp.cluster.host_names import is_host_name
from hpc_ddp.cluster.hostlist import MAX_HOSTS, expand_hostlist
from hpc_ddp.errors import LaunchEnvError
from hpc_ddp.regular_file import open_regular

# slurm.h: MAX_HET_JOB_COMPONENTS.
MAX_HET_COMPONENTS = 128
_HET_SIZE_VARS = ("SLURM_HET_SIZE", "SLURM_PACK_SIZE")
# A hostfile names one host per task; 16 MiB is some 10**6 tasks of long names. Only the bytes up
# to the last task's host are needed (srun reads no further either).
HOSTFILE_LIMIT = 16 << 20
_ARBITRARY = ("arbitrary", "hostfile")  # srun -m: "hostfile" is another name for it


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


def is_arbitrary(environ: Mapping[str, str]) -> bool:
    """srun placed task i on the i-th host it was given (``--distribution=arbitrary``)."""
    value = environ.get("SLURM_DISTRIBUTION", "")
    return value.split(",")[0].split(":")[0].strip().lower() in _ARBITRARY


def _hostfile_error(path: str | None, why: str) -> LaunchEnvError:
    name = "SLURM_HOSTFILE" if path is None else f"SLURM_HOSTFILE={path!r}"
    return LaunchEnvError(
        "SLURM_DISTRIBUTION=arbitrary places task i on the i-th host srun was given, but "
        f"{name} {why}, so the host of rank 0 is not known",
        hint="export MASTER_ADDR=<the host of task 0: the first one srun was given> before "
        "srun in the job script; where srun read SLURM_HOSTFILE, keep that file where every "
        "node can read it",
    )


@dataclass
class _Placement:
    """Where srun put the step's tasks, read from a hostfile: tasks per host, and the hosts of
    task 0 and of one more task (counted, never expanded: ``name*N`` can be huge)."""

    counts: Counter[str] = field(default_factory=Counter)
    placed: int = 0
    first: str = ""
    mine: str = ""


def _place(text: str, tasks: int, rank: int, path: str) -> _Placement:
    """The first ``tasks`` entries of a Slurm hostfile (slurm_read_hostfile): '#' starts a
    comment, hosts are separated by newlines or commas, ``name*N`` is N tasks on name."""
    found = _Placement()
    for number, line in enumerate(text.split("\n"), 1):
        for item in line.split("#", 1)[0].split(","):
            item = item.strip()
            if not item:
                continue
            name, star, count = item.partition("*")
            repeat = ascii_int(count) if star else 1
            if not is_host_name(name) or repeat is None or repeat < 1:
                why = f"holds {item[:80]!r} on line {number} (a host name, or name*N)"
                raise _hostfile_error(path, why)
            repeat = min(repeat, tasks - found.placed)
            if found.placed <= rank < found.placed + repeat:
                found.mine = name
            found.first = found.first or name
            found.counts[name] += repeat
            found.placed += repeat
            if found.placed == tasks:
                return found
    return found


def read_hostfile(environ: Mapping[str, str], tasks: int, rank: int) -> tuple[str, _Placement]:
    """SLURM_HOSTFILE's path and where its first ``tasks`` entries put the tasks; a bounded read
    of a regular file (a FIFO or a device is refused without blocking)."""
    path = environ.get("SLURM_HOSTFILE")
    if not path:
        raise _hostfile_error(
            None, "is not set in this task (srun's -w or --nodefile list never reaches its tasks)"
        )
    try:
        with open_regular(path, follow_symlinks=True) as f:
            data = f.read(HOSTFILE_LIMIT + 1)
    except OSError as err:
        raise _hostfile_error(path, f"cannot be read here ({err.strerror or err})") from None
    cut = len(data) > HOSTFILE_LIMIT
    if cut:  # the last line may end in the middle of a name
        data = data[: data.rfind(b"\n", 0, HOSTFILE_LIMIT) + 1]
    found = _place(data.decode("utf-8", "replace"), tasks, rank, path)
    if found.placed < tasks:
        size = f"its first {HOSTFILE_LIMIT} bytes name" if cut else "names"
        raise _hostfile_error(path, f"{size} {found.placed} task(s), not the step's {tasks}")
    return path, found


def rank0_host(
    environ: Mapping[str, str],
    hosts: list[str],
    tasks: list[int],
    *,
    rank: int,
    node_rank: int,
    world: int,
) -> str:
    """The host task 0 runs on; ``hosts`` and ``tasks`` in SLURM_NODEID order (node_order).

    Under ``--distribution=arbitrary`` every task reads the hostfile and checks it against what
    it knows: the tasks per host of the step, and the host of its own rank.
    """
    if not is_arbitrary(environ):
        return hosts[0]
    path, found = read_hostfile(environ, world, rank)
    step: Counter[str] = Counter()
    for host, count in zip(hosts, tasks, strict=True):
        step[host] += count
    if found.counts != step:
        host = next(h for h in sorted(step | found.counts) if step[h] != found.counts[h])
        why = (
            f"does not describe this step: it places {found.counts[host]} task(s) on {host}, "
            f"the step runs {step[host]} there"
        )
        raise _hostfile_error(path, why)
    if found.mine and found.mine != hosts[node_rank]:
        why = (
            f"does not describe this step: it places task {rank} on {found.mine}, "
            f"which runs on {hosts[node_rank]} (SLURM_NODEID={node_rank})"
        )
        raise _hostfile_error(path, why)
    return found.first
