"""Exit codes shared by the trainer, the rendered jobs and the submitit backend (torch-free).

0 finished; 1 crashed; 2 bad input (``HpcDdpError.exit_code``); ``EXIT_REQUEUE`` checkpointed
after a preemption/time-limit signal and asked for a requeue.
"""

# EX_TEMPFAIL from sysexits.h: "try again later". Launch scripts treat it as "requeued".
EXIT_REQUEUE = 75

# Set to "batch" by a rendered sbatch script whose batch shell requeues the job when the step
# exits EXIT_REQUEUE: the trainer's requeue=auto then leaves the requeue to it. The batch shell
# runs on the host, where scontrol exists even when the step runs in a container without it,
# and one requeue request per preemption keeps the restart count honest.
REQUEUE_BY_VAR = "HPC_DDP_REQUEUE_BY"
