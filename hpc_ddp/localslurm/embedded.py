"""The embedded default: the user's Slurm if one is configured, else the toolkit's own cluster."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from filelock import FileLock

from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.localslurm.daemons import LocalCluster

SYSTEM_CONF = Path("/etc/slurm/slurm.conf")
# Set to "local" to use the embedded cluster even where another Slurm is configured.
FORCE_VAR = "HPC_DDP_SLURM"
DIR_VAR = "HPC_DDP_LOCAL_SLURM_DIR"
# sinfo against a configured but dead controller retries for ~9 s before failing.
PROBE_TIMEOUT_S = 20.0


def default_state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """$HPC_DDP_LOCAL_SLURM_DIR, else $XDG_STATE_HOME/hpc-ddp/slurm (~/.local/state/...)."""
    env = os.environ if environ is None else environ
    if env.get(DIR_VAR):
        return Path(env[DIR_VAR]).absolute()
    state_home = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state_home) / "hpc-ddp" / "slurm"


def dir_lock(root: Path, timeout_s: float = 60) -> FileLock:
    """Serialises start/stop of the cluster in ``root`` between processes. The lock file sits
    beside root (not in it: stop removes root)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(root.parent / f".{root.name}.lock"), timeout=timeout_s)


def configured_slurm(environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The client env of the user's own Slurm, None if there is none.

    A Slurm that is configured but does not answer is an error, not a reason to fall back:
    jobs meant for the user's cluster must never silently run somewhere else.
    """
    env = dict(os.environ if environ is None else environ)
    if env.get(FORCE_VAR) == "local":
        return None
    conf_var = env.get("SLURM_CONF")
    if conf_var:
        conf, origin, client_env = Path(conf_var), "SLURM_CONF", {"SLURM_CONF": conf_var}
    elif SYSTEM_CONF.exists():
        conf, origin, client_env = SYSTEM_CONF, str(SYSTEM_CONF), {}
    else:
        return None
    hint = (
        f"start that cluster, or unset SLURM_CONF / set {FORCE_VAR}=local to use the "
        "toolkit's embedded local cluster instead"
    )
    if not conf.is_file():  # sinfo would retry a missing file for a whole minute
        raise ConfigError(f"{origin} names {conf}, which does not exist", hint=hint)
    if shutil.which("sinfo") is None:
        raise ConfigError(
            f"Slurm is configured ({origin}) but sinfo is not installed",
            hint="apt-get install slurm-client (or slurm-wlm)",
        )
    try:
        proc = subprocess.run(
            ["sinfo", "-h", "-o", "%P"],
            env={**env, **client_env},
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
        answer = proc.stderr.strip() if proc.returncode else ""
    except subprocess.TimeoutExpired:
        answer = f"no answer in {PROBE_TIMEOUT_S:.0f} s"
    if answer:
        raise HpcDdpError(f"the Slurm configured by {origin} does not answer: {answer}", hint=hint)
    return client_env


def ensure_local_cluster(
    nodes: int = 2,
    cpus_per_node: int = 4,
    gpus_per_node: int = 0,
    *,
    environ: Mapping[str, str] | None = None,
    timeout_s: float = 30,
) -> dict[str, str]:
    """The variables Slurm clients need: the user's Slurm, else the embedded cluster.

    The embedded cluster lives in ``default_state_dir()``; it is reused while it runs (by any
    process), started otherwise. A file lock beside its dir makes concurrent callers agree.
    """
    existing = configured_slurm(environ)
    if existing is not None:
        return existing
    root = default_state_dir(environ)
    with dir_lock(root, timeout_s + 30):
        cluster = LocalCluster(root, nodes, cpus_per_node, gpus_per_node)
        if cluster.is_running():
            have = cluster.config
            if have.nodes < nodes or have.gpus_per_node < gpus_per_node:
                raise ConfigError(
                    f"the local cluster in {root} has {have.nodes} node(s) with "
                    f"{have.gpus_per_node} GPU(s) each; {nodes} x {gpus_per_node} were asked for",
                    hint="stop it (hpc-ddp cluster down) and start a bigger one "
                    "(hpc-ddp cluster up --nodes N --gpus-per-node G)",
                )
        else:
            cluster = LocalCluster(root, nodes, cpus_per_node, gpus_per_node)
            cluster.start(timeout_s)
        return cluster.env()
