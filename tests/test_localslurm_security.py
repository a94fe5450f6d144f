"""Who can reach the embedded cluster, and as whom: munge, loopback, the private dir.

Real daemons throughout, and a real unprivileged user: ``nobody`` (setpriv), with ``fakeroot``
for the old attack (a client that claims uid 0). Each test starts its own cluster.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurm_support import (
    HPC_DDP,
    SlurmTestCluster,
    as_nobody,
    clean_job_env,
    listening,
    require_local_slurm,
    require_tools,
)

from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.localslurm import LocalCluster, munge, procs, wait_for
from hpc_ddp.localslurm.embedded import default_state_dir, dir_lock

pytestmark = pytest.mark.slurm
NOBODY_UID = 65534


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="hpcddp-sec-", dir="/tmp"))
    yield path
    for d in (path, *path.iterdir()):
        if (d / "run").exists():  # a test failed half-way: never leave daemons running
            LocalCluster(d).stop()
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def cluster(root: Path) -> Iterator[LocalCluster]:
    require_local_slurm()
    c = LocalCluster(root / "c", nodes=2, ephemeral=True)
    c.start(timeout_s=30)
    yield c
    c.stop()


def _public_copy(cluster: LocalCluster, root: Path, edit: dict[str, str] | None = None) -> Path:
    """The cluster's slurm.conf where nobody can read it, as an attacker would write it: the
    file holds no secret (ports, paths), only the cluster dir hides it."""
    pub = Path(tempfile.mkdtemp(prefix="pub-", dir=root))
    os.chmod(root, 0o755)  # mkdtemp made it 0700; the cluster dir below stays 0700
    os.chmod(pub, 0o755)
    lines = cluster.conf_path.read_text().splitlines()
    for key, value in (edit or {}).items():
        lines = [f"{key}={value}" if ln.startswith(f"{key}=") else ln for ln in lines]
    conf = pub / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    os.chmod(conf, 0o644)
    return conf


def _queue(cluster: LocalCluster) -> list[str]:
    return cluster.client().run(["squeue", "-h", "-o", "%i %u"]).stdout.splitlines()


def _ctld_debug(cluster: LocalCluster) -> str:
    config = cluster.client().run(["scontrol", "show", "config"]).stdout
    return next(ln.split("=")[1].strip() for ln in config.splitlines() if "SlurmctldDebug" in ln)


def _attempts(conf: Path, out: Path) -> dict[str, list[str]]:
    """What an unprivileged user would try: admin requests and jobs as root, with and without
    fakeroot (which makes every client believe, and claim, that it runs as uid 0)."""
    job = ["sbatch", f"--output={out}", "--wrap", "id"]
    return {
        "setdebug": ["scontrol", "setdebug", "debug5"],
        "fakeroot setdebug": ["fakeroot", "scontrol", "setdebug", "debug5"],
        "sbatch --uid=0": [*job[:1], "--uid=0", *job[1:]],
        "fakeroot sbatch": ["fakeroot", *job],
        "fakeroot sbatch --uid=0": ["fakeroot", *job[:1], "--uid=0", *job[1:]],
    }


@pytest.mark.slow
def test_other_users_cannot_use_the_cluster_let_alone_as_root(
    cluster: LocalCluster, root: Path
) -> None:
    """Only root can authenticate (the munge socket is in the 0700 dir): nobody, holding a
    copy of the config, gets refused for admin requests, for jobs as root (also through
    fakeroot, which the old auth/none cluster believed), and for jobs as themselves."""
    require_tools("setpriv", "fakeroot")
    conf = _public_copy(cluster, root)
    env = clean_job_env(SLURM_CONF=str(conf))
    for what, argv in _attempts(conf, root / "pwned.out").items():
        proc = as_nobody(argv, env)
        assert proc.returncode != 0, f"{what} was accepted: {proc.stdout}{proc.stderr}"
    own_job = as_nobody(["sbatch", f"--output={root}/own.out", "--wrap", "id"], env)
    assert own_job.returncode != 0 and "Permission denied" in own_job.stderr, own_job.stderr
    # The old cluster's way in: a client that sends no credential at all.
    no_auth = _public_copy(cluster, root, {"AuthType": "auth/none", "CredType": "cred/none"})
    for what, argv in _attempts(no_auth, root / "pwned.out").items():
        proc = as_nobody(argv, clean_job_env(SLURM_CONF=str(no_auth)))
        assert proc.returncode != 0, f"{what} (auth/none) was accepted: {proc.stdout}"
    assert _queue(cluster) == [] and _ctld_debug(cluster) == "info"
    assert not (root / "pwned.out").exists()
    key = os.stat(cluster.root / "munge.key")  # the cluster's own key, root's alone
    assert stat.S_IMODE(key.st_mode) == 0o400 and key.st_uid == 0
    assert stat.S_IMODE(os.stat(cluster.root).st_mode) == 0o700


def _rogue_munged(root: Path) -> Path:
    """A munged that nobody runs with a key of their own; returns its socket."""
    d = Path(tempfile.mkdtemp(prefix="rogue-", dir=root))
    os.chmod(root, 0o755)
    os.chown(d, NOBODY_UID, NOBODY_UID)
    os.chmod(d, 0o711)  # munged wants every dir above its socket searchable by all
    start = (
        f"head -c 128 /dev/urandom > {d}/key && chmod 400 {d}/key && munged --socket "
        f"{d}/sock --key-file {d}/key --pid-file {d}/pid --log-file {d}/log --seed-file {d}/seed"
    )
    proc = as_nobody(["sh", "-c", start], clean_job_env())
    assert proc.returncode == 0, proc.stderr
    return d


def test_only_credentials_of_the_clusters_own_munge_count(
    cluster: LocalCluster, root: Path
) -> None:
    """Two more ways in, both closed. (1) nobody brings a munged with their own key: its
    credentials do not decode here. (2) If nobody could reach the cluster's munge socket (made
    reachable here on purpose), they would authenticate as themselves: the controller then
    believes the credential's uid, never the uid a client claims, so fakeroot gains nothing;
    a job as nobody is accepted, as nobody."""
    require_tools("setpriv", "fakeroot")
    rogue = _rogue_munged(root)
    try:
        conf = _public_copy(cluster, root, {"AuthInfo": f"cred_expire=10,socket={rogue}/sock"})
        env = clean_job_env(SLURM_CONF=str(conf))
        for what, argv in _attempts(conf, root / "pwned.out").items():
            proc = as_nobody(argv, env)
            assert proc.returncode != 0, f"{what} (own munged) was accepted: {proc.stdout}"
        log = (cluster.root / "log" / "slurmctld.log").read_text()
        assert "Munge decode failed: Invalid credential" in log
    finally:
        pid = int((rogue / "pid").read_text())
        assert procs.cmdline(pid)[:1] == ["munged"]
        procs.terminate({pid})

    for d in (cluster.root, cluster.root / "run"):
        os.chmod(d, 0o711)  # what munged by itself would have insisted on
    conf = _public_copy(cluster, root)
    env = clean_job_env(SLURM_CONF=str(conf))
    refused = {what: as_nobody(argv, env) for what, argv in _attempts(conf, root / "x").items()}
    assert all(p.returncode != 0 for p in refused.values()), refused
    assert "Invalid user id" in refused["fakeroot sbatch"].stderr
    assert "Permission denied" in refused["fakeroot setdebug"].stderr
    own = as_nobody(["sbatch", "--parsable", f"--output={root}/own.out", "--wrap", "id"], env)
    assert own.returncode == 0, own.stderr
    info = cluster.client().job_info(own.stdout.strip())
    assert info["UserId"] == f"nobody({NOBODY_UID})"
    assert _queue(cluster) in ([], [f"{own.stdout.strip()} nobody"])
    assert _ctld_debug(cluster) == "info"


def _job_running(cluster: LocalCluster, tmp: Path) -> set[int]:
    """Starts a 2-node job; returns its slurmstepd pids once they run."""
    script = tmp / "sleep.sh"
    script.write_text("#!/bin/bash\nsrun sleep 300\n")
    client = SlurmTestCluster(cluster)
    client.sbatch(script, "-N2", output=tmp / "sleep.out")

    def stepds() -> set[int]:
        pids = procs.cluster_pids(cluster.root, cluster.daemon_conf_path)
        return {p for p in pids if procs.cmdline(p)[0].startswith("slurmstepd")}

    # The batch step on node1, the srun step on both nodes.
    return wait_for(lambda: len(stepds()) >= 3 and stepds(), 20, "the job's steps")


def _assert_loopback_only(cluster: LocalCluster, tmp: Path) -> None:
    daemons = set(cluster._pids().values())
    stepds = _job_running(cluster, tmp)
    sockets = listening(daemons | stepds)
    ports = {cluster.config.ctld_port, *cluster.config.node_ports}
    assert len(sockets) >= len(ports), sockets  # slurmctld and every slurmd listen...
    assert {addr for addr, _ in sockets} == {"127.0.0.1"}, sockets  # ...on loopback only


def test_daemons_listen_on_loopback_only(cluster: LocalCluster, tmp_path: Path) -> None:
    """Every listening socket of slurmctld, each slurmd and the job's slurmstepds, read from
    the kernel while a job runs, is on 127.0.0.1 (before: 0.0.0.0, every interface)."""
    require_tools("ss")
    _assert_loopback_only(cluster, tmp_path)


_START_AND_CHECK = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from hpc_ddp.localslurm import LocalCluster
from test_localslurm_security import _assert_loopback_only
from slurm_support import SlurmTestCluster
cluster = LocalCluster(sys.argv[1], nodes=2, ephemeral=True)
cluster.start(timeout_s=30)
try:
    _assert_loopback_only(cluster, Path(sys.argv[1]).parent)
    # A client outside the cluster, on this host, still gets its steps' output back.
    out = SlurmTestCluster(cluster).srun(["-N2", "hostname"], timeout_s=30)
    assert out.returncode == 0 and out.stdout.split() == ["localhost", "localhost"], out
finally:
    cluster.stop()
print("ok")
"""


def test_loopback_also_where_the_host_name_resolves_elsewhere(root: Path) -> None:
    """Slurm binds the address of the host's name; here the name resolves to 127.0.0.1, on
    Debian to 127.0.1.1, elsewhere to a LAN address. Started from a process whose host name is
    127.0.1.1 (a UTS namespace: the rest of the machine keeps its name), the daemons still
    listen on 127.0.0.1 only, in a namespace of their own named localhost, and an srun from
    that process still works (clients do not bind the host name's address)."""
    require_local_slurm()
    require_tools("ss", "unshare")
    script = root / "start.py"
    script.write_text(_START_AND_CHECK)
    tests = str(Path(__file__).parent)
    proc = subprocess.run(
        ["unshare", "--uts", "sh", "-c", 'hostname 127.0.1.1 && exec "$@"', "sh",
         sys.executable, str(script), str(root / "c"), tests],
        capture_output=True, text=True, timeout=120, env=clean_job_env(PYTHONPATH=os.pathsep.join(
            [os.environ.get("PYTHONPATH", ""), tests])),
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def _up(d: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HPC_DDP), "cluster", "up", "--dir", str(d)],
        capture_output=True, text=True, timeout=60, env=clean_job_env(),
    )  # fmt: skip


def test_a_cluster_dir_others_could_change_is_refused(root: Path) -> None:
    """The daemons run as root from the cluster dir: a dir another user owns or may write, or
    sits in, is refused before anything starts, with the dir and the fix named."""
    require_local_slurm()
    theirs = root / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY_UID, NOBODY_UID)
    proc = _up(theirs)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"refusing the local cluster dir {theirs}" in proc.stderr
    assert "owned by nobody (uid 65534), not by you" in proc.stderr and "HINT:" in proc.stderr
    assert list(theirs.iterdir()) == []  # nothing written into it

    open_dir = root / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(ConfigError, match="writable by other users") as info:
        LocalCluster(open_dir, ephemeral=True).start()
    assert str(open_dir) in info.value.message and "0700" in (info.value.hint or "")

    inside = theirs / "c"  # root-owned, but nobody could rename it away and put theirs
    with pytest.raises(ConfigError, match="another user can change") as info:
        LocalCluster(inside, ephemeral=True).start()
    assert not inside.exists()

    # An existing dir of root's that others can only read (as the old code made it) is
    # tightened to 0700, and the cluster starts.
    readable = root / "readable"
    readable.mkdir(mode=0o755)
    cluster = LocalCluster(readable, nodes=1, ephemeral=True)
    cluster.start(timeout_s=30)
    try:
        assert stat.S_IMODE(os.stat(readable).st_mode) == 0o700
    finally:
        cluster.stop()


def test_the_default_dir_sits_in_the_private_state_dir(tmp_path: Path) -> None:
    """The default cluster dir lies in the toolkit's per-user state dir, which is created 0700
    and refused when another user could change it (hpc_ddp.private_paths), like every per-user
    dir of the toolkit; no daemon needed."""
    env = {"XDG_STATE_HOME": str(tmp_path / "state"), "HOME": str(tmp_path)}
    state = tmp_path / "state" / "hpc-ddp"
    assert default_state_dir(env) == state / "slurm"
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    os.chmod(state, 0o777)
    with pytest.raises(HpcDdpError, match="writable by other users"):
        default_state_dir(env)
    os.chmod(state, 0o700)
    os.chown(state, NOBODY_UID, NOBODY_UID)
    with pytest.raises(HpcDdpError, match="owned by nobody"):
        default_state_dir(env)


def test_no_lock_file_where_another_user_could_swap_the_dir(tmp_path: Path) -> None:
    """The start/stop lock sits beside the cluster dir: under a dir others may write (without
    the sticky bit) it is refused before a file is made there, as the dir itself would be."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ConfigError, match="another user can change"):
        dir_lock(shared / "cluster")
    assert list(shared.iterdir()) == []


def test_munged_warnings_other_than_the_socket_one_are_caught(tmp_path: Path) -> None:
    """munged runs with --force, which downgrades its own checks to warnings: the start reads
    them back. A real munged given an insecure key (0644) warns, and that is flagged; the one
    expected warning (socket dirs not searchable by all) is not."""
    require_tools("munged")
    d = Path(tempfile.mkdtemp(prefix="hpcddp-mw-", dir="/tmp"))
    try:
        key = d / "key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o644)
        argv = ["munged", "--force", "--socket", f"{d}/sock", "--key-file", str(key)]
        argv += ["--pid-file", f"{d}/pid", "--log-file", f"{d}/log", "--seed-file", f"{d}/seed"]
        subprocess.run(argv, check=True, timeout=30)
        pid = wait_for(lambda: (d / "pid").exists() and (d / "pid").read_text().strip(), 10)
        procs.terminate({int(pid)})
        flagged = munge.unexpected_warnings(d / "log")
        assert flagged and all("Keyfile is insecure" in line for line in flagged), flagged
        assert munge.EXPECTED_WARNING in (d / "log").read_text()
    finally:
        shutil.rmtree(d, ignore_errors=True)
