"""Shared pieces of the deployment tests (test_slurm_jobs.py, test_submitit.py).

``reference_run`` (import ``reference_run_fixture`` to use it): one uninterrupted 2-node
training job on the local cluster per session; every interrupted run (sbatch layouts, submitit)
must end with its params_sha256.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from filelock import FileLock

from hpc_ddp.deploy import JobSpec
from hpc_ddp.deploy.sbatch.render import render
from hpc_ddp.deploy.sbatch.submit import Finished, sbatch, wait_job


def train_args(data_dir: str, run_dir: str, *extra: str, plot: bool = False) -> list[str]:
    """A tiny, deterministic run: 512 synthetic samples, LeNet, 2 epochs of 8 steps at world 2;
    plot.png only with ``plot`` (tests/trainer_helpers.py says why)."""
    return [
        "--dataset", "cifar10", "--synthetic", "--synthetic-train-size", "512",
        "--synthetic-test-size", "128", "--data-dir", data_dir, "--model", "lenet",
        "--epochs", "2", "--batch-size", "32", "--checkpoint-every-steps", "2",
        "--log-every", "1", "--plot" if plot else "--no-plot", "--run-dir", run_dir, *extra,
    ]  # fmt: skip


def train_spec(name: str, run: str = "run", **kw: object) -> JobSpec:
    """2 nodes x 2 processes, relative paths. World 4, not 2: with two ranks every summation
    order is the same, so only more ranks prove that resume is bit-exact."""
    base: dict[str, object] = dict(
        name=name, nodes=2, procs_per_node=2, time="5", signal_lead_s=60,
        output=f"{run}/%x-%j.out", python=sys.executable, setup=["mkdir -p data"],
        args=train_args("data", run),
    )  # fmt: skip
    base.update(kw)
    return JobSpec(**base)  # type: ignore[arg-type]


def submit_spec(spec: JobSpec, cwd: Path, env: dict[str, str]) -> tuple[str, Path]:
    script = cwd / f"{spec.name}.sbatch"
    script.write_text(render(spec, command="tests"))
    sub = sbatch(script, env, cwd=cwd)
    assert sub.output is not None
    return sub.job_id, sub.output


def read_result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


def progress_status(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / "progress.json").read_text()).get("status")
    except (OSError, ValueError):
        return None


# Each test module that imports the fixture gets its own fixture definition; this cache makes
# them share one run per worker, and the record file one run per test run: pytest-xdist workers
# (each with its own cluster) take the first one's, whose files stay in its basetemp.
_REFERENCE: list[tuple[Path, Finished]] = []


@pytest.fixture(scope="session", name="reference_run")
def reference_run_fixture(slurm_cluster, tmp_path_factory) -> tuple[Path, Finished]:
    """(its working dir, how it ended): result.json is in <dir>/run."""
    if not _REFERENCE:
        shared = tmp_path_factory.getbasetemp()
        if os.environ.get("PYTEST_XDIST_WORKER"):
            shared = shared.parent  # the run's basetemp, above every worker's
        record = shared / "slurm-reference.json"
        with FileLock(shared / "slurm-reference.lock"):
            if record.exists():
                saved = json.loads(record.read_text())
                done = Finished(**{**saved["done"], "output": Path(saved["done"]["output"])})
                _REFERENCE.append((Path(saved["cwd"]), done))
            else:
                cwd = tmp_path_factory.mktemp("reference")
                job_id, out = submit_spec(train_spec("reference"), cwd, slurm_cluster.env)
                done = wait_job(job_id, slurm_cluster.env, timeout_s=180, output=out)
                fields = {**asdict(done), "output": str(done.output), "result": None}
                record.write_text(json.dumps({"cwd": str(cwd), "done": fields}))
                _REFERENCE.append((cwd, done))
    return _REFERENCE[0]
