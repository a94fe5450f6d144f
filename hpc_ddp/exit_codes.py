"""Exit codes shared by the trainer, the rendered jobs and the submitit backend (torch-free).

0 finished; 1 crashed; 2 bad input (``HpcDdpError.exit_code``); ``EXIT_DIVERGED`` the loss became
NaN or infinite; ``EXIT_REQUEUE`` checkpointed after a preemption/time-limit signal and asked for
a requeue.
"""

# EX_DATAERR from sysexits.h ("the input data was incorrect"): the training loss, the test loss or
# the state a checkpoint would hold became NaN or infinite. Every rank stopped at the same step,
# nothing was saved after it, and the newest checkpoint is the last finite state
# (hpc_ddp/train/divergence.py). Running the same command again resumes from that checkpoint
# with the same settings and most likely diverges again: a job script must not retry it as it
# does a requeue. A code of sysexits.h, not a small one: a launcher treats it as the ranks'
# agreed exit (AGREED_EXITS), so a program that fails with an everyday code must not match it.
EXIT_DIVERGED = 65

# EX_TEMPFAIL from sysexits.h: "try again later". Launch scripts treat it as "requeued".
EXIT_REQUEUE = 75

# What every rank of a run exits with at once, by a decision the ranks took together: a launcher
# that sees one rank leave with one of these lets the others leave on their own, instead of
# stopping them as it stops the peers of a failed rank.
AGREED_EXITS = (EXIT_DIVERGED, EXIT_REQUEUE)
