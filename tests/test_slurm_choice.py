"""Which Slurm a submission goes to: the user's, found by asking its own tools, else the
embedded cluster. The user's "real" Slurm here is a second cluster started by the project's
LocalCluster (the session's ``slurm_cluster``): real daemons, real tools.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from slurm_support import HPC_DDP, SlurmTestCluster, clean_job_env

from hpc_ddp.errors import HpcDdpError
from hpc_ddp.localslurm.embedded import choose_slurm, users_slurm
from hpc_ddp.slurm_client import SYSTEM_CONF

pytestmark = pytest.mark.slurm
TOOLS = ("scontrol", "sinfo", "squeue", "sbatch", "scancel", "srun")


def _site_install(bin_dir: Path, conf: Path) -> Path:
    """Slurm's tools under another prefix, like /opt/slurm/bin, reading the config their build
    has compiled in: the real tools, run by wrappers that set the path such a build would have
    compiled in (a second Slurm build is the one part that cannot exist here)."""
    bin_dir.mkdir()
    for tool in TOOLS:
        wrapper = bin_dir / tool
        wrapper.write_text(f'#!/bin/sh\nSLURM_CONF={conf} exec /usr/bin/{tool} "$@"\n')
        wrapper.chmod(0o755)
    return bin_dir


def _environ(tmp_path: Path, bin_dir: Path | None) -> dict[str, str]:
    """No SLURM_CONF; the embedded cluster's dir points somewhere it must not appear."""
    path = os.environ.get("PATH", "/usr/bin:/bin")
    env = clean_job_env(HPC_DDP_LOCAL_SLURM_DIR=str(tmp_path / "embedded"))
    env["PATH"] = f"{bin_dir}{os.pathsep}{path}" if bin_dir else path
    env.pop("SLURM_CONF", None)
    return env


def test_a_slurm_that_its_tools_reach_is_used_not_the_embedded_one(
    slurm_cluster: SlurmTestCluster, tmp_path: Path
) -> None:
    """No SLURM_CONF and no /etc/slurm/slurm.conf, but `scontrol` on PATH reaches a cluster (a
    site install under /opt, a configless site): submissions go there, and say so."""
    if SYSTEM_CONF.exists():
        pytest.skip(f"{SYSTEM_CONF} exists here: the tools would read it")
    conf = slurm_cluster.cluster.conf_path
    env = _environ(tmp_path, _site_install(tmp_path / "opt-slurm-bin", conf))
    target = users_slurm(env)
    assert target is not None and target.env == {}  # the tools find it themselves
    assert "the Slurm cluster 'hpcddp', controller " in target.description
    assert f"found by {tmp_path}/opt-slurm-bin/scontrol" in target.description
    assert choose_slurm(environ=env) == target
    assert users_slurm({**env, "HPC_DDP_SLURM": "local"}) is None  # still forces the embedded

    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\ntrue\n")
    proc = subprocess.run(
        [str(HPC_DDP), "submit", str(script), "--no-wait"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Slurm: {target.description}\n" in proc.stdout
    job_id = proc.stdout.split("submitted job ")[1].split(";")[0]
    assert slurm_cluster.job_info(job_id)  # it went to that cluster
    assert not (tmp_path / "embedded").exists()  # and nothing started the embedded one

    # Configured for the tools but not answering: an error, never a silent fallback.
    dead = tmp_path / "dead.conf"
    dead.write_text(
        conf.read_text().replace(
            f"SlurmctldPort={slurm_cluster.cluster.config.ctld_port}", "SlurmctldPort=1"
        )
    )
    env = _environ(tmp_path, _site_install(tmp_path / "dead-bin", dead))
    started = time.monotonic()
    with pytest.raises(HpcDdpError, match="does not answer") as info:
        choose_slurm(environ=env)
    assert time.monotonic() - started < 5
    assert "HPC_DDP_SLURM=local" in (info.value.hint or "")

    # The tools installed (Debian's, as here) but no config anywhere: the embedded cluster is
    # the answer, found fast (the README's first command asks this).
    started = time.monotonic()
    assert users_slurm(_environ(tmp_path, None)) is None
    took = time.monotonic() - started
    assert took < 2, f"asking the tools took {took:.2f} s"


def _controller_lines(env: dict[str, str], tmp_path: Path) -> tuple[str, str]:
    proc = subprocess.run(
        [str(HPC_DDP), "doctor", "--no-torch", "--run-dir", str(tmp_path / "runs")],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    lines = proc.stdout.splitlines()
    line = next(i for i, text in enumerate(lines) if "slurm controller:" in text)
    ports = next(text for text in lines if "reserved ports:" in text)
    return "\n".join(lines[line : line + 2]), ports


def test_doctor_finds_the_slurm_that_submit_would_use(
    slurm_cluster: SlurmTestCluster, tmp_path: Path
) -> None:
    """No SLURM_CONF, no /etc/slurm/slurm.conf, but the tools reach a cluster: the doctor asks
    them as `hpc-ddp submit` does (hpc_ddp.slurm_client), instead of reporting no Slurm."""
    if SYSTEM_CONF.exists():
        pytest.skip(f"{SYSTEM_CONF} exists here: the tools would read it")
    conf = slurm_cluster.cluster.conf_path
    env = _environ(tmp_path, _site_install(tmp_path / "opt-slurm-bin", conf))
    controller, ports = _controller_lines(env, tmp_path)
    assert controller.startswith("OK") and "the Slurm cluster 'hpcddp'" in controller, controller
    assert "reserves no ports per step" in ports, ports

    dead = tmp_path / "dead.conf"
    dead.write_text(
        conf.read_text().replace(
            f"SlurmctldPort={slurm_cluster.cluster.config.ctld_port}", "SlurmctldPort=1"
        )
    )
    env = _environ(tmp_path, _site_install(tmp_path / "dead-bin", dead))
    controller, _ = _controller_lines(env, tmp_path)
    assert controller.startswith("FAIL") and "does not answer" in controller, controller
    assert "HINT:" in controller and "HPC_DDP_SLURM=local" in controller


def test_a_running_cluster_too_small_for_the_job_names_what_the_spec_asked(
    slurm_cluster: SlurmTestCluster, tmp_path: Path
) -> None:
    """The embedded cluster (here the session's, 2 nodes without GPUs) is reused when it holds
    the job; when it does not, the refusal names the spec's own nodes and GPUs, not the shape a
    new embedded cluster would start with."""
    spec = tmp_path / "job.toml"
    spec.write_text('nodes = 1\ngpus_per_node = 8\nargs = ["--run-dir", "r"]\n')
    env = clean_job_env(
        HPC_DDP_SLURM="local", HPC_DDP_LOCAL_SLURM_DIR=str(slurm_cluster.cluster.root)
    )
    proc = subprocess.run(
        [str(HPC_DDP), "submit", str(spec), "--no-wait"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "has 2 node(s) with 0 GPU(s) each; 1 x 8 were asked for" in proc.stderr, proc.stderr
