"""``hpc-ddp doctor``: OK/WARN/FAIL lines with hints, non-zero exit on FAIL.

Login-node checks run here as they are; allocation checks run under real srun/sbatch on the
local cluster. The fake-GPU cluster (gres over character devices; no GPU can exist here) gives
the "GPUs requested but no driver" failure a real allocation to be found in.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

PY = sys.executable


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GLOO_", "MASTER_"))}
    env.update(extra)
    return env


def _doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "hpc_ddp.cli", "doctor", *args],
        capture_output=True, text=True, env=env or _env(), timeout=120,
    )  # fmt: skip


def _line(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line[5:].startswith(name + ":"))


def test_login_node_without_torch_is_fast_and_passes(tmp_path: Path) -> None:
    code = (
        "import sys; from hpc_ddp.cli import main; "
        f"rc = main(['doctor', '--no-torch', '--run-dir', {str(tmp_path / 'runs')!r}]); "
        "print('TORCH', 'torch' in sys.modules); sys.exit(rc)"
    )
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TORCH False" in proc.stdout
    assert _line(proc.stdout, "checkpoint dir").startswith("OK")
    assert _line(proc.stdout, "slurm tools").startswith("OK")


def test_the_doctor_creates_nothing(tmp_path: Path) -> None:
    """Run where a user stands, with the default --run-dir: no `runs` appears there and no
    state dir in HOME (the look for a running embedded cluster creates none)."""
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    env = {k: v for k, v in _env(HOME=str(home)).items() if not k.startswith("XDG_")}
    env.pop("HPC_DDP_LOCAL_SLURM_DIR", None)
    proc = subprocess.run(
        [PY, "-m", "hpc_ddp.cli", "doctor", "--no-torch"],
        capture_output=True, text=True, env=env, cwd=work, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = _line(proc.stdout, "checkpoint dir")
    assert line.startswith("OK") and f"runs does not exist yet; {work}, where" in line, line
    assert list(work.iterdir()) == [] and list(home.iterdir()) == []


def test_a_torch_that_fails_to_import_fails_naming_no_torch(tmp_path: Path) -> None:
    """torch installed but broken (a missing shared library, say). No real install can be
    broken here without breaking the suite's, so an import hook makes `import torch` raise
    what a broken install raises; a torch that is absent altogether is tested for real
    (tests/test_wheel.py: the core install)."""
    code = (
        "import sys\n"
        "class Broken:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n"
        "            raise ImportError('libtorch_cpu.so: cannot open shared object file')\n"
        "sys.meta_path.insert(0, Broken())\n"
        "from hpc_ddp.cli import main\n"
        f"sys.exit(main(['doctor', '--run-dir', {str(tmp_path)!r}]))\n"
    )
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert _line(proc.stdout, "torch").startswith("FAIL torch: import failed: libtorch_cpu.so")
    hint = proc.stdout.split("FAIL torch:", 1)[1].splitlines()[1]
    assert "HINT:" in hint and "--no-torch" in hint, hint


def test_the_api_checks_what_the_cli_checks(tmp_path: Path) -> None:
    """hpc_ddp.doctor() gives the CLI's checks, line for line, without importing torch."""
    runs = str(tmp_path / "runs")
    code = (
        "import sys, hpc_ddp; "
        f"checks = hpc_ddp.doctor({runs!r}, torch=False); "
        "print('\\n'.join(c.line() for c in checks)); print('TORCH', 'torch' in sys.modules)"
    )
    api = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    cli = _doctor("--no-torch", "--run-dir", runs)
    assert api.returncode == 0, api.stderr
    assert api.stdout.splitlines()[-1] == "TORCH False"
    # Free disk space moves while other tests write: the figure is masked, not the line.
    lines = [
        [re.sub(r"[0-9.]+ GiB free", "N GiB free", line) for line in out.splitlines()[:-1]]
        for out in (api.stdout, cli.stdout)
    ]
    assert lines[0] == lines[1], (api.stdout, cli.stdout)


def test_unwritable_checkpoint_dir_fails_with_a_hint(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    proc = _doctor("--no-torch", "--run-dir", str(blocker / "runs"))
    assert proc.returncode == 1
    line = _line(proc.stdout, "checkpoint dir")
    assert line.startswith("FAIL") and "HINT: checkpoints need a writable" in proc.stdout


def test_port_in_use_fails(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        port = sock.getsockname()[1]
        proc = _doctor("--no-torch", "--run-dir", str(tmp_path), "--port", str(port))
    assert proc.returncode == 1
    assert _line(proc.stdout, "master port").startswith("FAIL")
    assert f"ss -ltnp | grep {port}" in proc.stdout


def test_nccl_syntax_in_gloo_ifname_fails(tmp_path: Path) -> None:
    proc = _doctor("--no-torch", "--run-dir", str(tmp_path), env=_env(GLOO_SOCKET_IFNAME="^lo"))
    assert proc.returncode == 1
    assert _line(proc.stdout, "network").startswith("FAIL")
    assert "NCCL's only" in proc.stdout


def test_torch_check_reports_backends(tmp_path: Path) -> None:
    proc = _doctor("--run-dir", str(tmp_path))
    line = _line(proc.stdout, "torch")
    assert line.startswith("OK") and "gloo" in line, proc.stdout


@pytest.mark.slurm
def test_inside_an_allocation_every_task_checks_itself(slurm_cluster, tmp_path: Path) -> None:
    proc = slurm_cluster.srun(
        ["-N2", "--ntasks-per-node=1", slurm_cluster.hpc_ddp, "doctor", "--no-torch",
         "--run-dir", str(tmp_path)],
        timeout_s=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    allocation = [line for line in proc.stdout.splitlines() if "allocation:" in line]
    assert len(allocation) == 2 and all(line.startswith("OK") for line in allocation)
    assert any("rank 0/2" in line for line in allocation)
    assert any("rank 1/2" in line for line in allocation)
    node_lines = [line for line in proc.stdout.splitlines() if "node list:" in line]
    assert all(line.startswith("OK") and "node[1-2]" in line for line in node_lines)


@pytest.mark.slurm
def test_batch_shell_is_told_it_forgot_srun(slurm_cluster, tmp_path: Path) -> None:
    script = tmp_path / "doctor.sbatch"
    script.write_text(
        f"#!/bin/bash\n{slurm_cluster.hpc_ddp} doctor --no-torch --run-dir {tmp_path}\n"
    )
    res = slurm_cluster.sbatch_wait(script, "-N1", timeout_s=60, output=tmp_path / "out-%j.txt")
    assert res.state == "COMPLETED", res.output
    assert "WARN allocation" in res.output and "not an srun task" in res.output


@pytest.mark.slurm
def test_gpus_requested_without_a_driver_fail(slurm_gpu_cluster, tmp_path: Path) -> None:
    """Fake GPUs: Slurm grants and binds them, but no NVIDIA driver exists here."""
    proc = slurm_gpu_cluster.srun(
        ["-N1", "--gpus-per-node=2", slurm_gpu_cluster.hpc_ddp, "doctor", "--no-torch",
         "--run-dir", str(tmp_path)],
        timeout_s=60,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = _line(proc.stdout, "gpus")
    assert line.startswith("FAIL") and "asked 2, visible 2" in line
    assert "no NVIDIA driver" in proc.stdout


def test_controller_line_knows_the_embedded_cluster(slurm_cluster, tmp_path: Path) -> None:
    """No SLURM_CONF, no /etc/slurm: a WARN while no embedded cluster runs in the state dir,
    OK naming it while one does (the session's real cluster, found through its dir)."""
    if Path("/etc/slurm/slurm.conf").exists():
        pytest.skip("this machine has a system Slurm config; the embedded case cannot arise")
    nowhere = str(tmp_path / ("x" * 80))  # too long to ever hold a cluster: must not crash
    absent = _doctor("--no-torch", env=_env(HPC_DDP_LOCAL_SLURM_DIR=nowhere))
    assert _line(absent.stdout, "slurm controller").startswith("WARN"), absent.stdout
    root = str(slurm_cluster.cluster.root)
    present = _doctor("--no-torch", env=_env(HPC_DDP_LOCAL_SLURM_DIR=root))
    line = _line(present.stdout, "slurm controller")
    assert line.startswith("OK") and f"embedded local cluster runs in {root}" in line, line


@pytest.mark.slurm
def test_a_cluster_without_reserved_ports_says_so(slurm_cluster, tmp_path: Path) -> None:
    """The session cluster's slurm.conf has no MpiParams=ports=... (the cluster that has is in
    test_slurm_env.py): the port comes from the job id, and the line says what that risks."""
    proc = _doctor("--no-torch", "--run-dir", str(tmp_path), env=slurm_cluster.env)
    line = _line(proc.stdout, "reserved ports")
    assert line.startswith("OK") and "reserves no ports per step" in line, proc.stdout
    assert "modulo 9000" in line


def test_a_bad_number_in_the_environment_is_named_not_a_crash(tmp_path: Path) -> None:
    """'²' passes str.isdigit() and then int() refuses it: a traceback inside the check."""
    env = _env(SLURM_JOB_ID="5", SLURM_GPUS_ON_NODE="\u00b2")
    proc = _doctor("--no-torch", "--run-dir", str(tmp_path), env=env)
    line = _line(proc.stdout, "gpus")
    assert line.startswith("FAIL") and "SLURM_GPUS_ON_NODE='\u00b2' is not an integer" in line
    assert "crashed" not in proc.stdout and "HINT: unset SLURM_GPUS_ON_NODE" in proc.stdout


@pytest.mark.skipif(
    os.geteuid() != 0 or subprocess.run(["unshare", "-m", "true"], check=False).returncode != 0,
    reason="needs root and mount namespaces (unshare -m) to point /etc/resolv.conf elsewhere",
)
def test_a_resolver_that_never_answers_costs_one_deadline_not_one_per_node(
    tmp_path: Path,
) -> None:
    """A real resolver that never answers: a UDP socket on 127.0.0.77:53 that reads nothing,
    named in /etc/resolv.conf inside a private mount namespace (16 s per query, just above the
    check's 15-s deadline). 64 nodes looked up one after another took 64 x 16 s; the doctor
    ends after its one deadline: the network check does not look the master (the node list's
    first name, already without an answer) up again for a second one."""
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.77", 53))
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("nameserver 127.0.0.77\noptions timeout:16 attempts:1\n")
    doctor = f"{PY} -m hpc_ddp.cli doctor --no-torch --run-dir {tmp_path / 'runs'}"
    env = _env(SLURM_JOB_ID="5", SLURM_JOB_NODELIST="gpu[001-064]", SLURM_CONF="/nonexistent")
    started = time.monotonic()
    try:
        proc = subprocess.run(
            ["unshare", "-m", "sh", "-c", f"mount --bind {resolv} /etc/resolv.conf && {doctor}"],
            capture_output=True, text=True, env=env, timeout=90,
        )  # fmt: skip
    finally:
        silent.close()
    took = time.monotonic() - started
    node_list = _line(proc.stdout, "node list")
    assert node_list.startswith("FAIL"), proc.stdout + proc.stderr
    assert "64 got no answer in 15 s: gpu001, gpu002" in node_list, node_list
    assert took < 2 * 15, f"{took:.0f} s: more than the one 15-s deadline"
    assert "no route to master gpu001: it did not resolve" in _line(proc.stdout, "network")


def test_a_name_the_resolver_refuses_is_named_at_once(tmp_path: Path) -> None:
    """A label over 63 characters makes the lookup raise UnicodeError, not OSError: it is a
    name that does not resolve, reported at once, not a lookup left to the deadline."""
    bad = "n" + "a" * 70
    env = _env(SLURM_JOB_ID="5", SLURM_JOB_NODELIST=f"localhost,{bad}")
    started = time.monotonic()
    proc = _doctor("--no-torch", "--run-dir", str(tmp_path / "runs"), env=env)
    assert time.monotonic() - started < 14  # under the lookups' 15-s deadline
    node_list = _line(proc.stdout, "node list")
    assert node_list.startswith("FAIL") and f"of 2 hosts, 1 do not resolve: {bad}" in node_list
    assert "Traceback" not in proc.stderr, proc.stderr
