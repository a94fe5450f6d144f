"""The embedded local Slurm cluster: real slurmctld + slurmd daemons on this machine.

``LocalCluster`` starts and stops one cluster in a dir (root's alone: munge-authenticated,
loopback only); ``embedded.choose_slurm`` / ``ensure_local_cluster`` pick the user's Slurm when
its tools reach one, else this cluster. See docs/local-cluster.md.
"""

from hpc_ddp.localslurm.daemons import ClusterStartError, LocalCluster, check_prerequisites
from hpc_ddp.localslurm.embedded import default_state_dir, ensure_local_cluster
from hpc_ddp.polling import wait_for
from hpc_ddp.slurm_client import JobResult, SlurmClient

__all__ = [
    "ClusterStartError",
    "JobResult",
    "LocalCluster",
    "SlurmClient",
    "check_prerequisites",
    "default_state_dir",
    "ensure_local_cluster",
    "wait_for",
]
