"""The embedded local Slurm cluster itself: start, stop, isolation, failures, CLI, default.

Real daemons throughout; each test that needs its own cluster starts one in a fresh short dir.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hostile_files import lock_held_elsewhere, snapshot
from slurm_support import HPC_DDP, SlurmTestCluster, clean_job_env, require_local_slurm

import hpc_ddp
from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.localslurm import ClusterStartError, LocalCluster, daemons, orphans, procs
from hpc_ddp.localslurm import etc_hosts as hosts
from hpc_ddp.localslurm.config import ClusterConfig, render_gres_conf, render_slurm_conf
from hpc_ddp.localslurm.embedded import ensure_local_cluster, users_slurm
from hpc_ddp.polling import wait_for
from hpc_ddp.slurm_client import SlurmTimeoutError

pytestmark = pytest.mark.slurm
TESTS_DIR = Path(__file__).parent


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="hpcddp-t-", dir="/tmp"))
    yield path
    if (path / "run").exists():  # a test failed half-way: never leave daemons running
        LocalCluster(path).stop()
    shutil.rmtree(path, ignore_errors=True)


def _sleep_job(tmp: Path) -> Path:
    script = tmp / "sleep.sh"
    script.write_text("#!/bin/bash\nsrun sleep 300\n")
    return script


def _sleeps(cluster: LocalCluster) -> set[int]:
    """The job tasks of ``cluster`` that run `sleep 300`."""
    pids = procs.cluster_pids(cluster.root, cluster.daemon_conf_path)
    return {p for p in pids if [Path(a).name for a in procs.cmdline(p)[:2]] == ["sleep", "300"]}


def _assert_nothing_left(cluster: LocalCluster, pids: set[int]) -> None:
    assert not procs.wait_gone(pids, 5), "processes outlived stop()"
    assert not procs.pids_with_args("-f", str(cluster.daemon_conf_path))
    assert not procs.pids_with_args("--key-file", str(cluster.root / "munge.key"))
    assert not cluster.root.exists()
    assert not hosts.has_lines(cluster.root)
    assert not cluster.is_running()


def test_start_stop_leaves_no_processes_or_files(root: Path, tmp_path: Path) -> None:
    require_local_slurm()
    cluster = LocalCluster(root, nodes=2, ephemeral=True)
    started = time.monotonic()
    cluster.start(timeout_s=30)
    took = time.monotonic() - started
    assert took < 5, f"start took {took:.2f} s"
    assert cluster.is_running()
    assert cluster.env() == {"SLURM_CONF": str(root / "slurm.conf")}
    assert hosts.has_lines(root)
    assert all(socket.gethostbyname(n).startswith("127.") for n in cluster.node_names)
    client = SlurmTestCluster(cluster)
    assert client.nodes_in_state("idle") == ["node1", "node2"]

    # A running 2-node job: its slurmstepd and tasks would outlive a bare `scontrol shutdown`.
    client.sbatch(_sleep_job(tmp_path), "-N2", output=tmp_path / "out")
    wait_for(lambda: len(_sleeps(cluster)) == 2, 20, "both nodes' tasks to run")
    job_pids = procs.cluster_pids(root, cluster.daemon_conf_path)
    assert any(procs.cmdline(p)[0].startswith("slurmstepd") for p in job_pids)
    daemon_pids = set(cluster._pids().values())
    assert len(daemon_pids) == 4  # munged, slurmctld, 2 x slurmd

    started = time.monotonic()
    cluster.stop()
    assert time.monotonic() - started < 15
    _assert_nothing_left(cluster, job_pids | daemon_pids)
    cluster.stop()  # idempotent


def test_two_clusters_at_once_do_not_collide(tmp_path: Path) -> None:
    require_local_slurm()
    roots = [Path(tempfile.mkdtemp(prefix=f"hpcddp-{c}-", dir="/tmp")) for c in "ab"]
    clusters = [LocalCluster(r, nodes=2, ephemeral=True) for r in roots]
    errors: list[BaseException] = []

    def start(c: LocalCluster) -> None:
        try:
            c.start(timeout_s=30)
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=start, args=(c,)) for c in clusters]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        a, b = clusters
        ports_a = {a.config.ctld_port, *a.config.node_ports}
        ports_b = {b.config.ctld_port, *b.config.node_ports}
        assert not ports_a & ports_b
        assert a.config.first_job_id != b.config.first_job_id

        script = tmp_path / "job.sh"
        script.write_text("#!/bin/bash\nsrun bash -c 'echo $SLURM_CONF $SLURMD_NODENAME'\n")
        # Job tasks see the daemons' config (slurmstepd sets SLURM_CONF to it).
        results = []
        for i, c in enumerate(clusters):
            client = SlurmTestCluster(c)
            res = client.sbatch_wait(script, "-N2", timeout_s=30, output=tmp_path / f"{i}.out")
            assert (res.state, res.exit_code) == ("COMPLETED", 0), res.output
            assert sorted(res.output.split("\n")[:-1]) == [
                f"{c.daemon_conf_path} node1",
                f"{c.daemon_conf_path} node2",
            ]
            results.append(res)
        assert results[0].job_id != results[1].job_id

        # Stopping one leaves the other whole: daemons, hosts line, name resolution.
        a.stop()
        assert not a.is_running() and b.is_running()
        assert hosts.has_lines(b.root) and not hosts.has_lines(a.root)
        assert socket.gethostbyname("node1").startswith("127.")
        assert SlurmTestCluster(b).nodes_in_state("idle") == ["node1", "node2"]
    finally:
        for c in clusters:
            c.stop()
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)


def test_port_taken_is_a_clear_error(root: Path) -> None:
    require_local_slurm()
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        port = sock.getsockname()[1]
        cluster = LocalCluster(root, nodes=2, port=port, ephemeral=True)
        with pytest.raises(ConfigError) as info:
            cluster.start(timeout_s=10)
    assert str(port) in info.value.message and "in use" in info.value.message
    assert info.value.hint and "free ports" in info.value.hint
    assert not cluster.is_running()


def test_port_stolen_before_bind_is_retried(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race between picking a free port and the daemon binding it, forced: the first pick
    hands node1 a port someone listens on; the real slurmd fails and start() retries."""
    require_local_slurm()
    real = daemons.free_ports
    picks: list[list[int]] = []
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()

        def pick(n: int) -> list[int]:
            ports = real(n)
            if not picks:
                ports[1] = sock.getsockname()[1]
            picks.append(ports)
            return ports

        monkeypatch.setattr(daemons, "free_ports", pick)
        cluster = LocalCluster(root, nodes=2, ephemeral=True)
        cluster.start(timeout_s=30)
    try:
        assert len(picks) == 2 and cluster.is_running()
        assert cluster.config.node_ports == tuple(picks[1][1:])
    finally:
        cluster.stop()


def test_failed_start_undoes_itself_and_shows_the_log(root: Path) -> None:
    require_local_slurm()
    cluster = LocalCluster(root, nodes=2, extra={"SelectType": "select/bogus"}, ephemeral=True)
    with pytest.raises(ClusterStartError) as info:
        cluster.start(timeout_s=10)
    assert "Can't find plugin for select/bogus" in str(info.value)
    _assert_nothing_left(cluster, set())


def _project_dir(root: Path) -> dict[str, str]:
    """A user's project in ``root``, with entries named like a cluster's own (jobs/, log/,
    slurm.conf): its files and their contents."""
    files = {
        "thesis.tex": "precious",
        "jobs/train.sbatch": "#!/bin/bash\n",
        "log/run1.out": "results",
        "slurm.conf": "ClusterName=theirs\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(exist_ok=True)
        (root / name).write_text(text)
    return files


def test_a_dir_with_other_files_is_never_wiped(root: Path) -> None:
    """Entries named like the cluster's (jobs/, log/, slurm.conf) are the cluster's only in a
    dir that holds its marker: start refuses this one, stop and `cluster down` leave it whole."""
    require_local_slurm()
    files = _project_dir(root)
    before = snapshot(root)
    assert {name: before[name][0] for name in files} == {n: t.encode() for n, t in files.items()}
    with pytest.raises(ConfigError, match=r"jobs, log, slurm\.conf, thesis\.tex") as info:
        LocalCluster(root, ephemeral=True).start()
    assert ".hpc-ddp-local-cluster" in str(info.value)
    assert "empty or new dir" in (info.value.hint or "")
    with pytest.raises(ConfigError, match="nothing stopped, nothing removed"):
        LocalCluster(root).stop()
    down = subprocess.run(
        [str(HPC_DDP), "cluster", "down", "--dir", str(root)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert down.returncode == 2 and "is not a local cluster's dir" in down.stderr, down
    assert snapshot(root) == before  # every entry, its bytes and mtime


def test_a_fifo_at_the_markers_names_does_not_hang_cluster_down(root: Path) -> None:
    """Telling a cluster's dir from another never opens a FIFO planted at the marker's or
    slurm.conf's name: `cluster down` refuses at once and leaves them."""
    for name in (".hpc-ddp-local-cluster", "slurm.conf"):
        os.mkfifo(root / name)
    down = subprocess.run(
        [str(HPC_DDP), "cluster", "down", "--dir", str(root)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert down.returncode == 2 and "is not a local cluster's dir" in down.stderr, down
    assert sorted(p.name for p in root.iterdir()) == [".hpc-ddp-local-cluster", "slurm.conf"]


def test_a_cluster_slurm_conf_without_the_marker_is_not_a_cluster(root: Path) -> None:
    """Only the marker makes a dir the cluster's: a copy of a cluster's slurm.conf (its first
    line names this very dir) beside entries named like the cluster's does not. Stop refuses
    and leaves every entry."""
    cfg = ClusterConfig(root=root)
    (root / "slurm.conf").write_text(render_slurm_conf(cfg))
    for name in ("log", "state", "jobs"):
        (root / name).mkdir()
        (root / name / "x").write_text("mine")
    before = snapshot(root)
    with pytest.raises(ConfigError, match="nothing stopped, nothing removed"):
        LocalCluster(root).stop()
    assert snapshot(root) == before


def test_bad_shapes_fail_before_anything_starts() -> None:
    # A short root of this test's own (a fixed /tmp name could be anyone's).
    parent = Path(tempfile.mkdtemp(prefix="hd-", dir="/tmp"))
    root = parent / "x"
    try:
        with pytest.raises(ConfigError, match="nodes=0 is out of range"):
            LocalCluster(root, nodes=0)
        with pytest.raises(ConfigError, match="characters long") as info:
            LocalCluster("/tmp/" + "d" * 80)
        assert "shorter dir" in (info.value.hint or "")
        with pytest.raises(ConfigError, match="lowercase"):
            LocalCluster(root, node_prefix="n-")
        assert not root.exists()
    finally:
        shutil.rmtree(parent)


def test_config_renders_nodes_ports_and_fake_gpus() -> None:
    cfg = ClusterConfig(Path("/tmp/c"), nodes=3, gpus_per_node=2, node_ports=(7, 8, 9), ctld_port=6)
    conf = render_slurm_conf(cfg)
    assert "SlurmctldPort=6\n" in conf
    assert "AuthInfo=cred_expire=5,socket=/tmp/c/run/munge.socket\n" in conf
    assert "AuthType=auth/munge\n" in conf and "CredType=cred/munge\n" in conf
    assert "InAddrAny" not in conf  # clients: an srun must listen where its steps call back
    # The daemons' copy differs in one line: bind the host name's address, not every interface.
    daemons = render_slurm_conf(cfg, for_daemons=True).splitlines()
    assert [ln for ln in daemons if ln not in conf.splitlines()] == [
        "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny"
    ]
    assert "NodeName=node3 NodeHostname=localhost NodeAddr=127.0.0.1 Port=9 CPUs=4" in conf
    assert "Gres=gpu:2" in conf and "GresTypes=gpu" in conf
    assert render_gres_conf(cfg) == "Name=gpu File=/tmp/c/dev/nvidia[0-1]\n"
    assert cfg.nodelist == "node[1-3]"
    assert ClusterConfig.from_json(cfg.to_json()) == cfg


def test_hosts_lines_are_per_cluster_and_refuse_foreign_names(tmp_path: Path) -> None:
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("127.0.0.1 localhost\n10.0.0.9 gpu1")  # no final newline
    hosts.add_names(["node1", "node2"], Path("/a"), "127.0.0.1", hosts_file)
    hosts.add_names(["node1"], Path("/b"), "127.0.0.1", hosts_file)
    hosts.add_names(["node1"], Path("/b"), "127.0.0.1", hosts_file)  # idempotent
    lines = hosts_file.read_text().splitlines()
    assert lines[1] == "10.0.0.9 gpu1" and len(lines) == 4
    assert hosts.remove_names(Path("/a"), hosts_file) == 1
    assert hosts_file.read_text().endswith("127.0.0.1 node1  # hpc-ddp-localslurm /b\n")
    with pytest.raises(ConfigError, match=r"gpu1 to 10\.0\.0\.9") as info:
        hosts.add_names(["gpu1"], Path("/c"), "127.0.0.1", hosts_file)
    assert "node_prefix" in (info.value.hint or "")
    # A cluster that vanished without stopping (dir deleted) loses its line at the next prune.
    hosts.add_names(["node1"], Path("/gone"), "127.0.0.1", hosts_file)
    assert hosts.prune(lambda root: root != Path("/gone"), hosts_file) == [Path("/gone")]
    assert hosts.has_lines(Path("/b"), hosts_file) and not hosts.has_lines(
        Path("/gone"), hosts_file
    )


def test_a_hosts_file_locked_for_ever_ends_in_an_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process keeps /etc/hosts flocked (stopped, hung): adding, removing and pruning
    the cluster's names fail naming the file instead of waiting for ever. A real process holds
    a real flock on a copy; only the wait is shortened."""
    monkeypatch.setattr(hosts, "LOCK_WAIT_S", 1.0)
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("127.0.0.1 localhost\n")
    take = f"import fcntl\nf = open({str(hosts_file)!r})\nfcntl.flock(f, fcntl.LOCK_EX)"
    with lock_held_elsewhere(take):
        for edit in (
            lambda: hosts.add_names(["node1"], Path("/a"), "127.0.0.1", hosts_file),
            lambda: hosts.remove_names(Path("/a"), hosts_file),
            lambda: hosts.prune(lambda root: True, hosts_file),
        ):
            started = time.monotonic()
            with pytest.raises(HpcDdpError, match="locked by another process for 1 s") as info:
                edit()
            assert time.monotonic() - started < 10
            assert f"fuser -v {hosts_file}" in (info.value.hint or "")
    hosts.add_names(["node1"], Path("/a"), "127.0.0.1", hosts_file)  # released: it works
    assert hosts.has_lines(Path("/a"), hosts_file)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HPC_DDP), "cluster", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env or clean_job_env(),
    )


def test_cli_up_status_env_down(root: Path) -> None:
    require_local_slurm()
    d = str(root / "c")
    assert _cli("status", "--dir", d).returncode == 1
    env_missing = _cli("env", "--dir", d)
    assert env_missing.returncode == 2 and "HINT: hpc-ddp cluster up" in env_missing.stderr
    up = _cli("up", "--dir", d, "--nodes", "3", "--gpus-per-node", "1")
    assert up.returncode == 0, up.stderr
    assert "3 node(s) node[1-3]" in up.stdout and "1 fake GPU(s)" in up.stdout
    again = _cli("up", "--dir", d)
    assert again.returncode == 0 and "already running" in again.stdout
    status = _cli("status", "--dir", d)
    assert status.returncode == 0 and "node3" in status.stdout and "idle" in status.stdout
    exports = _cli("env", "--dir", d)
    assert exports.stdout == f"export SLURM_CONF={d}/slurm.conf\n"
    # The printed lines are meant for eval: a shell that evals them reaches the cluster.
    shell = subprocess.run(
        ["bash", "-c", f'eval "$({HPC_DDP} cluster env --dir {d})" && srun -N3 hostname'],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_job_env(),
    )
    assert shell.returncode == 0 and len(shell.stdout.split()) == 3, shell.stderr
    down = _cli("down", "--dir", d)
    assert down.returncode == 0 and not Path(d).exists()
    assert _cli("down", "--dir", d).returncode == 0  # nothing to stop is fine
    assert not hosts.has_lines(Path(d))


def test_python_api_is_the_cli_up_status_env_down(root: Path) -> None:
    """hpc_ddp.cluster_up / running_cluster / cluster_env / cluster_down are `hpc-ddp cluster
    up|status|env|down`: a cluster started from Python is the one the CLI sees, and back."""
    require_local_slurm()
    d = root / "c"
    assert hpc_ddp.running_cluster(d) is None
    with pytest.raises(HpcDdpError, match="no local cluster running"):
        hpc_ddp.cluster_env(d)
    # Bad input fails before anything starts: one device cannot be shared by two nodes.
    with pytest.raises(ConfigError, match="cannot be shared equally by 2 node"):
        hpc_ddp.cluster_up(d, nodes=2, gpu_devices="/dev/null")
    assert not d.exists()

    up = hpc_ddp.cluster_up(d, nodes=3, gpus_per_node=1)
    assert up.start_s is not None and up.start_s > 0
    assert (up.cluster.config.nodes, up.cluster.config.gpus_per_node) == (3, 1)
    again = hpc_ddp.cluster_up(d)
    assert again.start_s is None and again.cluster.config.nodes == 3  # kept, not restarted
    status = _cli("status", "--dir", str(d))
    assert status.returncode == 0 and "node3" in status.stdout and "idle" in status.stdout
    env = hpc_ddp.cluster_env(d)
    assert env == {"SLURM_CONF": str(d / "slurm.conf")}
    assert _cli("env", "--dir", str(d)).stdout == f"export SLURM_CONF={d}/slurm.conf\n"
    hostnames = subprocess.run(
        ["srun", "-N3", "hostname"], capture_output=True, text=True, timeout=30,
        env=clean_job_env(**env),
    )  # fmt: skip
    assert hostnames.returncode == 0 and len(hostnames.stdout.split()) == 3, hostnames.stderr

    assert hpc_ddp.cluster_down(d) is True
    assert not d.exists() and hpc_ddp.running_cluster(d) is None
    assert not hosts.has_lines(d)
    assert hpc_ddp.cluster_down(d) is False  # nothing to stop is fine, as for the CLI
    # Started by the CLI, seen and stopped from Python.
    assert _cli("up", "--dir", str(d), "--nodes", "1").returncode == 0
    cluster = hpc_ddp.running_cluster(d)
    assert cluster is not None and cluster.config.nodes == 1
    assert hpc_ddp.cluster_down(d) is True
    assert _cli("status", "--dir", str(d)).returncode == 1


def test_cli_without_root_says_so() -> None:
    require_local_slurm()
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) not installed")
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
         "hpc_ddp.cli", "cluster", "up", "--dir", "/tmp/hpcddp-nonroot"],
        capture_output=True, text=True, timeout=60, env=clean_job_env(),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "needs root" in proc.stderr and "HINT:" in proc.stderr
    assert not Path("/tmp/hpcddp-nonroot").exists()


def test_cli_without_slurm_names_the_package(root: Path) -> None:
    env = clean_job_env(PATH=str(Path(sys.executable).parent))  # no /usr/sbin, no /usr/bin
    proc = _cli("up", "--dir", str(root / "c"), env=env)
    assert proc.returncode == 2
    assert "slurmctld" in proc.stderr and "apt-get install slurm-wlm" in proc.stderr


def test_ensure_local_cluster_starts_once_then_reuses(root: Path) -> None:
    require_local_slurm()
    environ = clean_job_env(HPC_DDP_LOCAL_SLURM_DIR=str(root / "s"))
    environ.pop("SLURM_CONF", None)
    first = ensure_local_cluster(environ=environ)
    cluster = LocalCluster(root / "s")
    try:
        assert first == {"SLURM_CONF": str(root / "s" / "slurm.conf")}
        pids = cluster._pids()
        started = time.monotonic()
        assert ensure_local_cluster(environ=environ) == first
        assert time.monotonic() - started < 2 and cluster._pids() == pids  # reused, not restarted
        with pytest.raises(ConfigError, match="GPU"):
            ensure_local_cluster(gpus_per_node=2, environ=environ)
        # A configured, answering Slurm is used as it is, whatever the embedded dir says.
        theirs = users_slurm({**environ, "SLURM_CONF": first["SLURM_CONF"]})
        assert theirs is not None and theirs.env == first
    finally:
        cluster.stop()


def test_configured_but_dead_slurm_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    with pytest.raises(HpcDdpError, match="does not exist") as info:
        ensure_local_cluster(environ={"SLURM_CONF": str(tmp_path / "nope.conf")})
    assert "HPC_DDP_SLURM=local" in (info.value.hint or "")
    assert users_slurm({"SLURM_CONF": "/x", "HPC_DDP_SLURM": "local"}) is None


def test_stop_after_daemons_were_killed_cleans_up(root: Path, tmp_path: Path) -> None:
    """A crashed cluster (daemons SIGKILLed, a job's tasks orphaned) is still cleaned by pid."""
    require_local_slurm()
    cluster = LocalCluster(root, nodes=2, ephemeral=True)
    cluster.start(timeout_s=30)
    client = SlurmTestCluster(cluster)
    job_id, _ = client.sbatch(_sleep_job(tmp_path), "-N1", output=tmp_path / "out")
    job_pids = wait_for(lambda: _sleeps(cluster), 20, f"job {job_id}'s task")
    daemon_pids = set(cluster._pids().values())
    for pid in daemon_pids:
        os.kill(pid, 9)
    assert not procs.wait_gone(daemon_pids, 5)
    assert not cluster.is_running()
    started = time.monotonic()
    LocalCluster(root).stop()
    assert time.monotonic() - started < 15
    _assert_nothing_left(cluster, job_pids)


def test_following_a_job_ends_once_its_controller_is_gone(root: Path, tmp_path: Path) -> None:
    """`hpc-ddp logs -f JOB` follows until the job ends. With slurmctld dead the job never
    "ends": it ends with an error once Slurm has not known the job for LostJobWatch's grace."""
    require_local_slurm()
    cluster = LocalCluster(root, nodes=1, ephemeral=True)
    cluster.start(timeout_s=30)
    client = SlurmTestCluster(cluster)
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\necho job started\nsrun sleep 300\n")
    job_id, _ = client.sbatch(script, "-N1", output=tmp_path / "out")
    wait_for(lambda: _sleeps(cluster), 20, f"job {job_id}'s task")
    shown = tmp_path / "shown"
    with shown.open("w") as sink:
        follow = subprocess.Popen(
            [str(HPC_DDP), "logs", "-f", job_id], stdout=sink, stderr=subprocess.PIPE,
            text=True, env=client.env,
        )  # fmt: skip
    try:  # following: the log's line came through
        wait_for(lambda: "job started" in shown.read_text(), 30, "logs -f to show the log")
        os.kill(cluster._pids()["slurmctld"], 9)
        _, err = follow.communicate(timeout=60)  # the fault: it polled for ever
    finally:
        follow.kill()
        LocalCluster(root).stop()
    assert follow.returncode == 2, err
    assert f"Slurm no longer knows job {job_id}" in err and "scontrol ping" in err, err


def test_a_stopped_controller_is_a_clear_error_not_a_traceback(root: Path) -> None:
    """A slurmctld that never answers (SIGSTOPped, as a hung one): a Slurm command through
    SlurmClient ends at its timeout with an error naming the command, and ping() says no."""
    require_local_slurm()
    cluster = LocalCluster(root, nodes=1, ephemeral=True)
    cluster.start(timeout_s=30)
    client = SlurmTestCluster(cluster)
    ctld = cluster._pids()["slurmctld"]
    os.kill(ctld, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(SlurmTimeoutError, match="`scontrol show job -o 1` got no answer"):
            client.run(["scontrol", "show", "job", "-o", "1"], timeout_s=2)
        assert time.monotonic() - started < 10
        assert client.ping() is False
    finally:
        os.kill(ctld, signal.SIGCONT)
        LocalCluster(root).stop()


@pytest.mark.slow
def test_requeued_job_restarts_within_seconds(
    slurm_cluster: SlurmTestCluster, tmp_path: Path
) -> None:
    """AuthInfo=cred_expire=5 plus the fast scheduler settings: a requeued job runs again in
    ~6 s (Slurm's defaults: ~150 s), with SLURM_RESTART_COUNT=1 and its output appended."""
    script = tmp_path / "requeue.sh"
    script.write_text(
        "#!/bin/bash\n"
        'echo "run ${SLURM_RESTART_COUNT:-0} $(date +%s.%N)"\n'
        'if [ -z "$SLURM_RESTART_COUNT" ]; then scontrol requeue "$SLURM_JOB_ID"; sleep 60; fi\n'
    )
    res = slurm_cluster.sbatch_wait(
        script, "--requeue", "--open-mode=append", timeout_s=60, output=tmp_path / "out"
    )
    runs = [line.split() for line in res.output.splitlines() if line.startswith("run ")]
    assert [r[1] for r in runs] == ["0", "1"], res.output
    assert (res.state, res.exit_code) == ("COMPLETED", 0)
    gap = float(runs[1][2]) - float(runs[0][2])
    assert 4 < gap < 15, f"restarted {gap:.1f} s after the requeue"


def test_orphaned_test_cluster_is_reaped(root: Path) -> None:
    """A test session killed before its teardown leaves an ephemeral cluster; the next session
    start (orphans.reap) stops it because the process that started it is gone."""
    require_local_slurm()
    start_and_die = (
        "import os, sys\n"
        "from hpc_ddp.localslurm import LocalCluster\n"
        "LocalCluster(sys.argv[1], nodes=1, ephemeral=True).start()\n"
        "os._exit(0)  # no stop(): like a SIGKILLed pytest\n"
    )
    # Two levels below /tmp/hpcddp-*: out of reach of the reap() that every other test session
    # on this machine (an xdist worker, say) runs as it starts, which would stop it under us.
    tops = root / "tops"
    orphan = tops / "hpcddp-x" / "c"
    orphan.parent.mkdir(parents=True)
    subprocess.run([sys.executable, "-c", start_and_die, str(orphan)], check=True, timeout=60)
    cluster = LocalCluster(orphan)
    try:
        assert cluster.is_running() and orphans.owner_alive(orphan) is False
        daemon_pids = set(cluster._pids().values())
        assert orphans.reap(tops, "hpcddp-") == [orphan]
        _assert_nothing_left(cluster, daemon_pids)
        assert orphans.reap(tops, "hpcddp-") == []
    finally:
        cluster.stop()  # the root fixture stops only a cluster in root itself


@pytest.mark.parametrize("ci", [None, "1"])
def test_fixture_without_slurm_skips_locally_fails_under_ci(tmp_path: Path, ci: str | None) -> None:
    """A CI run that skipped every Slurm test would prove nothing: there, a missing Slurm fails."""
    (tmp_path / "test_uses.py").write_text("def test_x(slurm_cluster):\n    pass\n")
    env = clean_job_env(PATH=str(Path(sys.executable).parent), PYTHONPATH=str(TESTS_DIR))
    env.pop("CI", None)
    if ci:
        env["CI"] = ci
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "conftest"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if ci:
        assert proc.returncode == 1 and "1 error" in proc.stdout, proc.stdout
        assert "CI is set but the local Slurm cluster cannot start" in proc.stdout
    else:
        assert proc.returncode == 0 and "1 skipped" in proc.stdout, proc.stdout
        assert "local Slurm cluster unavailable: Slurm is not installed" in proc.stdout
