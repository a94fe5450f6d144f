"""MASTER_PORT: one rule every rank applies alone, and where its answer came from.

In order: an explicit MASTER_PORT; else the first port Slurm reserved for this step; else a
port derived from the job id.

Reserved ports: where slurm.conf has ``MpiParams=ports=12000-12999``, slurmctld gives each step
ports that no other step on its nodes holds at the same time, and every task of the step sees
the same list in SLURM_STEP_RESV_PORTS (``12001-12004``, or ``12000,12998-12999`` after the
range wrapped). Slurm 22.05 reserves them for every step there (max tasks per node + 1);
``srun --resv-ports=N`` asks for N and fails where the cluster has none. A bare
``--resv-ports`` means 0 to srun's option parser: no ports at all.

The derived port lies in [20000, 29000): below Linux's ephemeral range (32768+, where the kernel
hands out client ports and could have taken ours) and clear of torch's defaults 29400 (elastic
rendezvous) and 29500 (MASTER_PORT). Two jobs sharing a node collide only if their ids are equal
modulo 9000; set MASTER_PORT explicitly, or use reserved ports, where that matters.
"""

from __future__ import annotations

import re
import socket
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from hpc_ddp.cluster._vars import ascii_int
from hpc_ddp.errors import LaunchEnvError

PORT_BASE = 20000
PORT_SPAN = 9000
RESV_PORTS_VAR = "SLURM_STEP_RESV_PORTS"
FREE_PORT_ORIGIN = "a free port (one process: nobody must agree on it)"
TORCHRUN_ORIGIN = "MASTER_PORT (set by torchrun)"
_DERIVED = "derived from job id"
_PORT_ITEM = re.compile(r"([0-9]{1,5})(?:-([0-9]{1,5}))?")

# Which rule gave a port. Its origin text (DistEnv.master_port_origin, `hpc-ddp env --json`)
# also names the variable, the reserved list or the job id; port_rule reads the rule back.
PortRule = Literal["variable", "torchrun", "reserved", "derived", "free"]


@dataclass(frozen=True)
class PortChoice:
    port: int
    origin: str  # for messages: 'MASTER_PORT', 'SLURM_STEP_RESV_PORTS=...', 'derived from ...'


def port_rule(origin: str) -> PortRule:
    """The rule behind an origin text this module wrote, else "variable": the origin is the
    name of the variable that held the port (MASTER_PORT, or the launch contract's)."""
    if origin.startswith(RESV_PORTS_VAR):
        return "reserved"
    if origin.startswith(_DERIVED):
        return "derived"
    if origin == FREE_PORT_ORIGIN:
        return "free"
    if origin == TORCHRUN_ORIGIN:
        return "torchrun"
    return "variable"


def parse_port(value: str, name: str = "MASTER_PORT") -> int:
    port = ascii_int(value)
    if port is None or not 1 <= port <= 65535:
        raise LaunchEnvError(
            f"{name}={value!r} is not a TCP port",
            hint=f"give {name} a plain number in 1..65535 (ASCII digits), or unset it to "
            "use the job's own port",
        )
    return port


def reserved_port(value: str) -> int:
    """The first port of Slurm's SLURM_STEP_RESV_PORTS list: every task of the step sees the
    same list, so every rank picks the same port."""
    ports: list[int] = []
    for item in value.split(","):
        match = _PORT_ITEM.fullmatch(item)
        lo = int(match.group(1)) if match else 0
        hi = int(match.group(2) or lo) if match else 0
        if not 1 <= lo <= hi <= 65535:
            raise LaunchEnvError(
                f"{RESV_PORTS_VAR}={value!r} is not Slurm's list of reserved ports "
                f"(bad item {item!r})",
                hint=f"Slurm writes it as '12001-12004' or '12000,12998-12999'; unset "
                f"{RESV_PORTS_VAR} if it was exported by hand",
            )
        ports.append(lo)
    return ports[0]


def derive_port(job_id: str) -> int:
    """Same job id -> same port on every rank, no communication needed."""
    number = ascii_int(job_id)
    # surrogateescape: an id holding bytes that are not UTF-8 still hashes, the same everywhere.
    key = number if number is not None else zlib.crc32(job_id.encode("utf-8", "surrogateescape"))
    return PORT_BASE + key % PORT_SPAN


def choose_master_port(environ: Mapping[str, str], job_id: str | None) -> PortChoice:
    """THE port rule, shared by the launcher sources and the torchrun template's batch shell
    (``python -m hpc_ddp.deploy.port``); see the module docstring for the order.

    ``job_id`` may be None only when a port is set; callers say what is missing otherwise.
    """
    explicit = environ.get("MASTER_PORT")
    if explicit:
        return PortChoice(parse_port(explicit), "MASTER_PORT")
    reserved = environ.get(RESV_PORTS_VAR)
    if reserved:
        return PortChoice(reserved_port(reserved), f"{RESV_PORTS_VAR}={reserved}")
    if job_id is None:
        raise ValueError("master_port: no MASTER_PORT and no job id")  # a caller's bug
    return PortChoice(derive_port(job_id), f"{_DERIVED} {job_id}")


def master_port(environ: Mapping[str, str], job_id: str | None) -> int:
    return choose_master_port(environ, job_id).port


def bind_failure_hint(port: int, origin: str) -> str:
    """What to do when rank 0 finds ``port`` taken, by where the port came from."""
    who = f"`ss -ltnp 'sport = :{port}'` names the process holding it"
    rule = port_rule(origin)
    if rule == "reserved":
        return (
            f"Slurm reserved {port} for this step, but a process outside Slurm's bookkeeping "
            f"holds it ({who}): stop it, or export MASTER_PORT=<a free port> in the job script"
        )
    if rule == "derived":
        return (
            f"another job on this node (ids equal modulo {PORT_SPAN}) or a stale process holds "
            f"it ({who}): export MASTER_PORT=<a free port> in the job script, or let Slurm "
            "reserve ports per step (slurm.conf MpiParams=ports=...; `hpc-ddp doctor` says "
            "whether the cluster has them)"
        )
    if rule == "free":
        return f"another process took the port between its choice and its use ({who}): run again"
    if rule == "torchrun":
        return f"another process holds it ({who}): give torchrun another --master-port"
    return f"another process holds it ({who}): set {origin.split()[0]} to a free port"


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on this host: only for single-process runs, where nobody must agree."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
