"""The local cluster on a Slurm unpacked from Debian packages, with real GPU device files in GRES,
and with the cgroup plugins: the options a GPU machine without Slurm needs (`hpc-ddp cluster up
--slurm-root --gpu-devices --cgroups`).

Real daemons throughout. What cannot exist here: a GPU. Its device files are stand-ins made with
mknod under a major number the kernel reserves for local use (240), so no driver answers them:
opening one that the device cgroup allows fails with ENXIO, one it denies with EPERM. The
unpacked Slurm is made from the files of this machine's installed packages (what ``dpkg -x`` of
their .debs gives), since the test machine has no .deb files and needs no network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from deploy_support import (
    progress_status,
    read_result,
    reference_run_fixture,  # noqa: F401  (the reference_run fixture)
    submit_spec,
    train_spec,
)
from slurm_support import HPC_DDP, clean_job_env, first_job_id, require_local_slurm

from hpc_ddp.deploy.sbatch.submit import wait_job
from hpc_ddp.errors import ConfigError
from hpc_ddp.localslurm import LocalCluster, cgroupfs, procs, wait_for
from hpc_ddp.localslurm.config import (
    ClusterConfig,
    render_cgroup_conf,
    render_gres_conf,
    render_slurm_conf,
)
from hpc_ddp.localslurm.gpus import nvidia_devices, parse_devices, per_node
from hpc_ddp.localslurm.install import SlurmInstall
from hpc_ddp.slurm_client import TERMINAL

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "slurm-wlm-basic-plugins", "munge", "libmunge2")
LOCAL_MAJOR = 240  # "LOCAL/EXPERIMENTAL USE" in the kernel's device list: no driver behind it


def _mknod(path: Path, minor: int) -> str:
    os.mknod(path, 0o666 | 0o020000, os.makedev(LOCAL_MAJOR, minor))
    return str(path)


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("mknod and the local cluster need root")


@pytest.fixture
def devices(tmp_path: Path) -> list[str]:
    _need_root()
    return [_mknod(tmp_path / f"nvidia{i}", i) for i in range(2)]


@pytest.fixture(scope="module")
def slurm_root() -> Iterator[Path]:
    """This machine's Slurm and munge packages, file by file, under a fresh root (= dpkg -x)."""
    require_local_slurm()
    if shutil.which("dpkg") is None:
        pytest.skip("needs dpkg to list the installed Slurm packages' files")
    root = Path(tempfile.mkdtemp(prefix="hpcddp-root-", dir="/tmp"))
    listed = subprocess.run(["dpkg", "-L", *PACKAGES], capture_output=True, text=True, check=True)
    for name in listed.stdout.splitlines():
        src = Path(name)
        # Files under /usr only: the programs, plugins and libraries. (/lib is a symlink to
        # /usr/lib on merged-/usr systems: copying it would make root/lib point at the host's.)
        if name.startswith("/usr/") and not src.is_dir() and (src.is_symlink() or src.is_file()):
            dst = root / src.relative_to("/")
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst, follow_symlinks=False)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def cluster_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="hpcddp-i-", dir="/tmp"))
    yield path
    if (path / "run").exists():  # a failed test must not leave daemons behind
        LocalCluster(path).stop()
    shutil.rmtree(path, ignore_errors=True)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HPC_DDP), *args], env=env or clean_job_env(), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


# --- rendering (pure) ---------------------------------------------------------------------------
def test_real_gpus_are_shared_out_to_the_nodes_in_gres_conf() -> None:
    cfg = ClusterConfig(
        root=Path("/tmp/c"), nodes=2, gpus_per_node=2, node_ports=(2, 3), ctld_port=1,
        real_gpus=("/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2", "/dev/nvidia3"),
    )  # fmt: skip
    assert render_gres_conf(cfg) == (
        "NodeName=node1 Name=gpu File=/dev/nvidia0\nNodeName=node1 Name=gpu File=/dev/nvidia1\n"
        "NodeName=node2 Name=gpu File=/dev/nvidia2\nNodeName=node2 Name=gpu File=/dev/nvidia3\n"
    )
    assert cfg.gpu_devices() == []  # nothing to mknod: the files are the machine's
    assert Path("/tmp/c/dev") not in cfg.dirs()
    assert "Gres=gpu:2" in render_slurm_conf(cfg)
    assert ClusterConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ConfigError, match="must match"):
        ClusterConfig(root=Path("/tmp/c"), gpus_per_node=1, node_ports=(2, 3), ctld_port=1,
                      real_gpus=("/dev/nvidia0",))  # fmt: skip
    with pytest.raises(ConfigError, match="not a plain absolute path"):
        ClusterConfig(root=Path("/tmp/c"), nodes=1, gpus_per_node=1, node_ports=(2,),
                      ctld_port=1, real_gpus=("/dev/nvidia0\nNodeName=x",))  # fmt: skip
    with pytest.raises(ConfigError, match="cannot be shared equally"):
        per_node(("/dev/a", "/dev/b", "/dev/c"), 2)


def test_unpacked_root_and_cgroups_render_their_settings() -> None:
    cfg = ClusterConfig(root=Path("/tmp/c"), nodes=1, node_ports=(2,), ctld_port=1, cgroups=True)
    conf = render_slurm_conf(cfg, plugin_dir="/opt/s/usr/lib/x86_64-linux-gnu/slurm-wlm")
    assert "PluginDir=/opt/s/usr/lib/x86_64-linux-gnu/slurm-wlm\n" in conf
    assert "ProctrackType=proctrack/cgroup\n" in conf
    assert "TaskPlugin=task/cgroup,task/affinity\n" in conf
    assert "ConstrainDevices=yes\n" in render_cgroup_conf(cfg)
    plain_cfg = ClusterConfig(root=Path("/tmp/c"), node_ports=(2, 3), ctld_port=1)
    plain = render_slurm_conf(plain_cfg)
    assert "PluginDir" not in plain and "ProctrackType=proctrack/linuxproc\n" in plain
    # slurmd loads its cgroup plugin anyway: without systemd it must not ask for it over D-Bus
    assert "IgnoreSystemd=yes\n" in render_cgroup_conf(plain_cfg)
    assert "Constrain" not in render_cgroup_conf(plain_cfg)
    for bad in ("relative/dir", "/a b", "/x/../etc", "/s\n"):
        with pytest.raises(ConfigError, match="not a plain absolute path"):
            SlurmInstall(bad)


def test_cgroup_v2_system_slice_is_made_where_slurmd_looks_for_it(tmp_path: Path) -> None:
    """A stand-in cgroup v2 mount (a plain dir): slurmd, told IgnoreSystemd, mkdirs its stepd
    scope in <mount>/system.slice, which without systemd nobody made."""
    mount = tmp_path / "cgroup"
    mount.mkdir()
    cgroupfs.prepare(controllers=False, mount=mount)
    assert not (mount / "system.slice").exists()  # not v2: no cgroup.controllers
    (mount / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    cgroupfs.prepare(controllers=False, mount=mount)
    assert (mount / "system.slice").is_dir()
    cgroupfs.prepare(controllers=False, mount=mount)  # there already: kept as it is


def test_gpu_devices_auto_takes_the_nvidia_n_character_devices(tmp_path: Path) -> None:
    _need_root()
    for i in (0, 1, 10, 2):
        _mknod(tmp_path / f"nvidia{i}", i)
    _mknod(tmp_path / "nvidiactl", 255)  # the driver's control node: not a GPU
    (tmp_path / "nvidia3").write_text("")  # a regular file: not a device
    want = tuple(str(tmp_path / f"nvidia{i}") for i in (0, 1, 2, 10))
    assert nvidia_devices(tmp_path) == want
    assert parse_devices("auto", tmp_path) == want
    assert parse_devices("/dev/a,/dev/b") == ("/dev/a", "/dev/b")
    with pytest.raises(ConfigError, match="no /dev/nvidiaN devices"):
        parse_devices("auto", tmp_path / "nothing")
    with pytest.raises(ConfigError, match="twice"):
        parse_devices("/dev/a,/dev/a")


def test_cli_refuses_gpu_counts_that_do_not_match_the_devices(cluster_dir: Path) -> None:
    d = str(cluster_dir / "c")
    proc = _cli(
        "cluster", "up", "--dir", d, "--gpu-devices", "/dev/a,/dev/b", "--gpus-per-node", "3"
    )
    assert proc.returncode == 2 and "--gpus-per-node 3 but --gpu-devices gives" in proc.stderr
    proc = _cli(
        "cluster", "up", "--dir", d, "--nodes", "2", "--gpu-devices", "/dev/a,/dev/b,/dev/c"
    )
    assert proc.returncode == 2 and "cannot be shared equally by 2 node(s)" in proc.stderr
    assert not (cluster_dir / "c").exists()


# --- real daemons -------------------------------------------------------------------------------
@pytest.mark.slurm
def test_cluster_on_unpacked_slurm_gives_tasks_their_gpus(
    slurm_root: Path, cluster_dir: Path, devices: list[str]
) -> None:
    """`cluster up --slurm-root` runs the unpacked daemons, plugins and libraries (not the
    system's), and `cluster env` points a shell's srun at them; GRES over the device files."""
    install = SlurmInstall(str(slurm_root))
    assert install.which("slurmd") == f"{slurm_root}/usr/sbin/slurmd-wlm"  # Debian's real name
    up = _cli("cluster", "up", "--dir", str(cluster_dir), "--nodes", "1",
              "--slurm-root", str(slurm_root), "--gpu-devices", ",".join(devices))  # fmt: skip
    assert up.returncode == 0, up.stdout + up.stderr
    assert "2 real GPU(s) each; slurmctld on 127.0.0.1:" in up.stdout
    assert f"Slurm from {slurm_root}" in up.stdout
    cluster = LocalCluster.attach(cluster_dir)
    munged = cluster._pids()["munged"]  # the cluster's own munged, the root's program
    assert os.readlink(f"/proc/{munged}/exe") == f"{slurm_root}/usr/sbin/munged"
    slurmd = cluster._pids()["slurmd-node1"]
    argv = procs.cmdline(slurmd)
    assert argv[0] == f"{cluster_dir}/run/bin/slurmd" and argv[-2:] == [
        "-d", f"{cluster_dir}/run/bin/slurmstepd"]  # fmt: skip
    maps = Path(f"/proc/{slurmd}/maps").read_text()
    assert f"{install.plugin_dir()}/libslurmfull.so" in maps
    assert " /usr/lib/x86_64-linux-gnu/slurm-wlm/" not in maps  # nothing of the system's
    script = (
        f'eval "$({HPC_DDP} cluster env --dir {cluster_dir})"; command -v srun; '
        "srun -n2 --gpus-per-task=1 bash -c "
        "'echo task=$SLURM_PROCID cvd=$CUDA_VISIBLE_DEVICES gpus=$SLURM_STEP_GPUS'"
    )
    job = subprocess.run(["bash", "-c", script], env=clean_job_env(), capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    lines = sorted(job.stdout.split("\n"))
    assert f"{slurm_root}/usr/bin/srun" in lines, job.stdout + job.stderr
    assert "task=0 cvd=0 gpus=0" in lines and "task=1 cvd=1 gpus=1" in lines, job.stdout
    cluster.stop()
    assert not cluster_dir.exists()


@pytest.mark.slurm
def test_missing_library_of_an_unpacked_slurm_is_named(
    slurm_root: Path, tmp_path: Path, cluster_dir: Path
) -> None:
    """A root whose slurmd links a library this machine lacks: refused before anything starts,
    naming the program and the library (ldd's "not found")."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build a program that links a library which is then removed")
    (tmp_path / "gone.c").write_text("int gone(void) { return 0; }\n")
    (tmp_path / "main.c").write_text("int gone(void);\nint main(void) { return gone(); }\n")
    lib = tmp_path / "libhpcddpgone.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "gone.c")],
                   check=True)  # fmt: skip
    broken = tmp_path / "root"
    shutil.copytree(slurm_root, broken, symlinks=True)
    slurmd = broken / "usr" / "sbin" / "slurmd-wlm"
    slurmd.unlink()
    subprocess.run(["gcc", "-o", str(slurmd), str(tmp_path / "main.c"), f"-L{tmp_path}",
                    "-lhpcddpgone"], check=True)  # fmt: skip
    lib.unlink()
    with pytest.raises(ConfigError, match=r"slurmd: libhpcddpgone\.so => not found|slurmd: lib"):
        SlurmInstall(str(broken)).check()
    proc = _cli("cluster", "up", "--dir", str(cluster_dir / "c"), "--slurm-root", str(broken))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "libraries not found" in proc.stderr and "slurmd: libhpcddpgone.so" in proc.stderr


@pytest.mark.slurm
def test_unpacked_root_that_others_can_write_is_refused(slurm_root: Path, tmp_path: Path) -> None:
    """The daemons run as root from the unpacked root: a dir there that other users can write
    (they could plant a slurmd) is refused before anything runs."""
    fake = tmp_path / "root"  # links to the real files, in dirs of its own
    plugins = Path(str(SlurmInstall(str(slurm_root)).plugin_dir()))
    for sub in ("usr/sbin", "usr/bin"):
        (fake / sub).mkdir(parents=True)
        for f in (slurm_root / sub).iterdir():
            (fake / sub / f.name).symlink_to(f)
    lib = fake / plugins.parent.relative_to(slurm_root)
    lib.mkdir(parents=True)
    (lib / "slurm-wlm").symlink_to(plugins)
    (lib / "libmunge.so.2").symlink_to(plugins.parent / "libmunge.so.2")
    SlurmInstall(str(fake)).check()  # as unpacked by root: accepted
    (fake / "usr" / "sbin").chmod(0o777)
    with pytest.raises(ConfigError, match="another user could change what root runs"):
        SlurmInstall(str(fake)).check()


def _cgroups_available() -> None:
    v1 = Path("/sys/fs/cgroup/devices/devices.allow").exists()
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    if not (v1 or v2):
        pytest.skip("no cgroup devices controller (v1) or cgroup v2 hierarchy on this machine")


@pytest.mark.slurm
def test_cgroups_confine_each_task_to_its_own_gpu(cluster_dir: Path, devices: list[str]) -> None:
    """--cgroups: a task may open only the device file Slurm gave it (ENXIO: allowed, no
    driver; EPERM: denied by the device cgroup) and runs on its own CPU."""
    require_local_slurm()
    _cgroups_available()
    cpus = min(2, os.cpu_count() or 1)
    cluster = LocalCluster(cluster_dir, nodes=1, cpus_per_node=cpus, gpus_per_node=2,
                           real_gpus=tuple(devices), cgroups=True, ephemeral=True)  # fmt: skip
    cluster.start(timeout_s=30)
    probe = (
        "import os\n"
        f"for d in {devices!r}:\n"
        "    try:\n        os.open(d, os.O_RDONLY)\n"
        "    except OSError as e:\n"
        "        print(os.environ['SLURM_PROCID'], os.path.basename(d), e.strerror)\n"
    )
    res = cluster.client(clean_job_env()).srun(
        ["-n2", "--gpus-per-task=1", sys.executable, "-c", probe], timeout_s=60
    )
    lines = set(res.stdout.splitlines())
    assert lines == {
        "0 nvidia0 No such device or address", "0 nvidia1 Operation not permitted",
        "1 nvidia0 Operation not permitted", "1 nvidia1 No such device or address",
    }, res.stdout + res.stderr  # fmt: skip
    cluster.stop()


@pytest.mark.slurm
@pytest.mark.slow
def test_torchrun_job_preempted_under_proctrack_cgroup_resumes(
    reference_run, cluster_dir: Path, tmp_path: Path
) -> None:
    """proctrack/cgroup (most real clusters) signals only a step's tasks, not their children:
    for the torchrun layout that is the shell around torchrun, never the workers. The template's
    task shell hands USR1 on; the job checkpoints, requeues, resumes, ends with the reference's
    weights. (With `exec torchrun` and USR1 ignored there, the workers never heard of it.)"""
    require_local_slurm()
    _cgroups_available()
    cpus = min(2, os.cpu_count() or 1)
    cluster = LocalCluster(cluster_dir, nodes=2, cpus_per_node=cpus, cgroups=True,
                           ephemeral=True, first_job_id=first_job_id("other"))  # fmt: skip
    cluster.start(timeout_s=30)
    env = clean_job_env(**cluster.env())
    spec = train_spec("pre-cgroup", launcher="torchrun", cpus_per_task=1)
    spec = spec.replace(args=[*spec.args, "--debug-hold-at-step", "3"])
    job_id, out = submit_spec(spec, tmp_path, env)
    wait_for(lambda: progress_status(tmp_path / "run") == "holding", 120, "the hold step")
    cluster.client(env).run(["scancel", "--signal=USR1", job_id])  # the step's tasks only
    seen: list[str] = []
    wait_for(lambda: seen.append(cluster.client(env).job_state(job_id)) or seen[-1] in TERMINAL,
             180, "the preempted job to finish", interval_s=0.2)  # fmt: skip
    done = wait_job(job_id, env, timeout_s=10, output=out)
    log = out.read_text()
    assert "PENDING" in seen and (done.state, done.restarts) == ("COMPLETED", 1), log
    assert "resumed from" in log
    result = read_result(tmp_path / "run")
    assert result["interruptions"] == 1
    assert result["params_sha256"] == read_result(reference_run[0] / "run")["params_sha256"]
    cluster.stop()
