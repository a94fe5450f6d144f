"""DistEnv: the single answer to "who am I, who are my peers" for one process."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args

from hpc_ddp.env_vars import Starter

# The launcher whose variables were believed; `hpc-ddp env --json` prints these strings.
Source = Literal["torchrun", "slurm", "mpi", Starter, "submitit", "single"]
SOURCES: tuple[Source, ...] = get_args(Source)


@dataclass(frozen=True)
class DistEnv:
    source: Source
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int  # processes on this node (nodes may differ under Slurm)
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    job_id: str | None
    gpus: tuple[int, ...] = ()  # CUDA ordinals as this process sees them; () = CPU
    gpus_per_process: int = 1  # 1 = one process per GPU; G = one process drives G GPUs
    master_port_origin: str = ""  # where master_port came from, e.g. 'MASTER_PORT' (messages)

    @property
    def layout(self) -> str:
        """One line for humans, e.g. '2 nodes x 2 processes x 1 GPU (4 processes)'."""
        per_proc = f"{len(self.gpus)} GPU" + ("s" if len(self.gpus) != 1 else "")
        device = per_proc if self.gpus else "CPU"
        nodes = f"{self.num_nodes} node" + ("s" if self.num_nodes != 1 else "")
        if self.local_world_size * self.num_nodes == self.world_size:
            plural = "es" if self.local_world_size != 1 else ""
            procs = f"{self.local_world_size} process{plural}"
            return f"{nodes} x {procs} x {device} ({self.world_size} in all)"
        # Heterogeneous Slurm steps (tasks per node such as 2(x3),1).
        return (
            f"{self.world_size} processes on {nodes}, {self.local_world_size} on this node, "
            f"{device} each"
        )

    def torch_env(self) -> dict[str, str]:
        """The variables ``init_process_group(init_method="env://")`` reads."""
        return {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
        }

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["gpus"] = list(self.gpus)
        data["layout"] = self.layout
        return data
