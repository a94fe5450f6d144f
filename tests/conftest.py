"""Shared fixtures. The Slurm ones start the project's own local cluster (hpc_ddp.localslurm).

``slurm_cluster``: 2 nodes x 4 CPUs for the whole session. ``slurm_gpu_cluster``: 2 nodes x 2
fake GPUs, started only if a test asks for it. Without slurm-wlm or root they skip locally, but
FAIL when $CI is set: a CI run that skips every Slurm test proves nothing. Helpers for these
tests are in slurm_support.py. ``data_dir``: one dataset directory per test module, for the
trainer tests (helpers in trainer_helpers.py); ``train_cli``: `hpc-ddp train` processes forked from
one that imported torch once. ``Progress``: a line a person can read every 30 s
(``--progress-every``), serial or under pytest-xdist.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import quick_tier
from cli_forkserver import ForkedCli
from launch_support import Launch, kill_leftovers
from slurm_support import SlurmTestCluster, first_job_id, require_local_slurm

from hpc_ddp import programs
from hpc_ddp.localslurm import LocalCluster
from hpc_ddp.localslurm.orphans import reap

# Every test process, and every process it starts, runs torch on one thread unless the
# developer's shell says otherwise: the suite runs several torch processes per core, where
# torch's default (a thread per core, spinning between small ops) spends more CPU waiting than
# working. A test that checks a thread count sets its own.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# On a machine with NVIDIA GPUs the tests not marked ``gpu`` still mean CPU ranks, as in CI: each
# test's processes see no GPU (CUDA_VISIBLE_DEVICES empty, set before its fixtures run), else a
# 2-rank CPU test is refused on a 1-GPU host and a "GPU path on the CPU" test runs on the GPU.
# This process's own CUDA state was fixed when the test modules counted the GPUs at collection.
_HOST_HAS_GPU = Path("/proc/driver/nvidia").exists() or Path("/dev/nvidia0").exists()
_VISIBLE_GPUS = os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if not _HOST_HAS_GPU:
        return
    if item.get_closest_marker("gpu") is None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif _VISIBLE_GPUS is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = _VISIBLE_GPUS


# Tests import the deployment layer directly: they register the trainer's hook as the layers
# above it do (hpc_ddp/programs.py), whether or not the installed metadata holds its entry point
# (tests/test_program_hook.py checks the entry point itself).
programs.register()


def _short_tmpdir(prefix: str) -> Path:
    # Not tmp_path_factory: Slurm's step sockets live under the cluster dir, and pytest's
    # basetemp can be long enough to overflow a unix socket path.
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def _session_cluster(prefix: str, role: str, **shape: int) -> Iterator[SlurmTestCluster]:
    require_local_slurm()
    reap(Path(tempfile.gettempdir()), "hpcddp-")  # clusters of test runs that were killed
    root = _short_tmpdir(prefix)
    cluster = LocalCluster(root, ephemeral=True, first_job_id=first_job_id(role), **shape)
    cluster.start(timeout_s=30)
    try:
        yield SlurmTestCluster(cluster)
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmTestCluster]:
    """2 nodes (node1, node2) x 4 declared CPUs, shared by the whole session."""
    yield from _session_cluster("hpcddp-slurm-", "cpu", nodes=2, cpus_per_node=4)


@pytest.fixture(scope="session")
def slurm_gpu_cluster() -> Iterator[SlurmTestCluster]:
    """2 nodes x 2 fake GPUs (gres over char devices): Slurm sets CUDA_VISIBLE_DEVICES."""
    yield from _session_cluster("hpcddp-gslurm-", "gpu", nodes=2, cpus_per_node=4, gpus_per_node=2)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trainer's --data-dir, shared by all runs of one test module."""
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="session")
def train_cli() -> ForkedCli:
    """`hpc-ddp train` for single-process runs: each call a process of its own, forked from
    one that imported torch once per session (cli_forkserver.py): the server that also runs
    trainer_helpers.forked_cmd's commands."""
    from trainer_helpers import fork_server

    return fork_server()


@pytest.fixture
def launches() -> Iterator[list[Launch]]:
    """Launches a test starts (append each); their processes are stopped afterwards, whatever
    happened."""
    started: list[Launch] = []
    yield started
    for launch in started:
        kill_leftovers(launch.launch_id)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--quick",
        action="store_true",
        help="only the tests that each took under a second in tests/durations.json (and no "
        "Slurm, slow or GPU test): the inner loop's tier (tests/quick_tier.py)",
    )
    parser.addoption(
        "--record-durations",
        action="store_true",
        help="write this run's per-test durations to tests/durations.json (a full run)",
    )
    parser.addoption(
        "--progress-every",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="print tests done / total, failures and the time so far at most this often "
        "(0: never); the dots alone say little in a run of many minutes",
    )


class Progress:
    """Once at least ``every`` seconds have passed since the last, when a test ends:
    ``progress: 312/1013 tests done (31%), 2 failed, 5m12s so far``. Serial runs count
    ``session.items``; under pytest-xdist the controller (which collects nothing itself)
    counts what a worker collected, and receives every worker's reports."""

    def __init__(self, config: pytest.Config, every: float) -> None:
        self.config = config
        self.every = every
        self.total: int | None = None
        self.done = 0
        self.failed: set[str] = set()
        self.start = self.last = time.monotonic()

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.total = len(session.items)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: object, ids: Sequence[str]) -> None:
        self.total = len(ids)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.failed.add(report.nodeid)
        if report.when != "teardown":  # every test ends with one, even a skipped one
            return
        self.done += 1
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            reporter = self.config.pluginmanager.getplugin("terminalreporter")
            if reporter is not None:  # none under -p no:terminal
                reporter.ensure_newline()  # after a file's name and its dots (a serial run)
                if reporter._tw.width_of_current_line:  # after xdist's dots, which have none
                    reporter._tw.line()
                reporter.write_line(self.line(now))

    def line(self, now: float) -> str:
        total = f"/{self.total}" if self.total else ""
        share = f" ({100 * self.done // self.total}%)" if self.total else ""
        minutes, seconds = divmod(int(now - self.start), 60)
        return (
            f"progress: {self.done}{total} tests done{share}, {len(self.failed)} failed, "
            f"{minutes}m{seconds:02d}s so far"
        )


def pytest_configure(config: pytest.Config) -> None:
    """Children the tests start answer SIGINT whatever the suite was started with. A suite run
    in the background of a script (``./scripts/test.sh &``) inherits SIGINT ignored, and an
    ignored signal stays ignored across exec: the tests that stop a launch script or a local job
    with SIGINT would wait for nothing and time out. A handler, unlike SIG_IGN, is reset to the
    default in every exec'd child. Progress lines come from the process that reports (not from
    pytest-xdist's workers)."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    every = config.getoption("progress_every")
    if every > 0 and not hasattr(config, "workerinput"):
        config.pluginmanager.register(Progress(config, every), "hpc-ddp-progress")
    if config.getoption("record_durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(quick_tier.Recorder(), "hpc-ddp-durations")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--quick``: the quick tier only (tests/quick_tier.py). Then, the files that take longest
    first (tests/durations.json), each file's tests together and in their order: under
    pytest-xdist (scripts/test.sh: whole files per worker, --no-loadscope-reorder) the long
    files start first and the many short ones fill the end, instead of one long file started
    last keeping a worker busy while the others idle."""
    if config.getoption("quick"):
        quick_tier.select_quick(config, items)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a serial run keeps pytest's order
    seconds = quick_tier.file_seconds(items)
    items.sort(key=lambda item: -seconds[item.path])  # stable: files stay whole and in order
