"""submitit's job watcher, asking ``scontrol`` instead of ``sacct``.

submitit polls ``sacct`` for the state of the jobs it returns, outside the environment they were
submitted with: on a cluster without accounting (the embedded one, many small sites) or one
named only by SLURM_CONF for the submission, every poll printed ``sacct: fatal`` lines and a
submitit warning for a job that was fine, and a job that died before writing its result was
waited on for ever. ``ScontrolWatcher`` answers the same questions from ``scontrol show job``
with the submission's environment; a job Slurm has forgotten for a while (LostJobWatch's rule)
reads as ``LOST``, which ends submitit's wait with its own "no result" error.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from submitit.slurm.slurm import SlurmInfoWatcher

from hpc_ddp.errors import HpcDdpError
from hpc_ddp.slurm_client import UNKNOWN, LostJobWatch, SlurmClient

LOST = "LOST"  # not a Slurm state: submitit treats any state it does not know as finished


class ScontrolWatcher(SlurmInfoWatcher):
    def __init__(self, cluster_env: Mapping[str, str], delay_s: int = 60) -> None:
        super().__init__(delay_s=delay_s)
        self._client = SlurmClient(cluster_env)
        self._lost: dict[str, LostJobWatch] = {}

    def update(self) -> None:
        """The state and nodes of every registered job not yet finished (base class contract)."""
        pending = self._registered - self._finished
        if not pending:
            return
        self._num_calls += 1
        for job_id in pending:
            info = self._client.job_info(job_id)
            state = info.get("JobState", UNKNOWN)
            try:
                self._lost.setdefault(job_id, LostJobWatch(job_id)).answer(state)
            except HpcDdpError:
                state = LOST
            self._info_dict[job_id] = {"State": state, "NodeList": info.get("NodeList", "")}
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)
        self._last_status_check = time.time()


def watched_by_scontrol(jobs: list, cluster_env: Mapping[str, str]) -> None:
    """Point submitted jobs at one ScontrolWatcher (an instance attribute shadows submitit's
    class-wide sacct watcher), registered as submitit registers them."""
    watcher = ScontrolWatcher(cluster_env)
    for job in jobs:
        job.watcher = watcher
        watcher.register_job(str(job.job_id))
