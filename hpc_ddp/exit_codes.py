"""Exit codes shared by the trainer, the rendered jobs and the submitit backend (torch-free).

0 finished; 1 crashed; 2 bad input (``HpcDdpError.exit_code``); ``EXIT_REQUEUE`` checkpointed
after a preemption/time-limit signal and asked for a requeue.
"""

# EX_TEMPFAIL from sysexits.h: "try again later". Launch scripts treat it as "requeued".
EXIT_REQUEUE = 75
