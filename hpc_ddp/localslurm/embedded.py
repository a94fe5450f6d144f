"""Where submissions go: the user's Slurm if its tools reach one, else the toolkit's own cluster."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.localslurm.daemons import LocalCluster

SYSTEM_CONF = Path("/etc/slurm/slurm.conf")
# Set to "local" to use the embedded cluster even where another Slurm is configured.
FORCE_VAR = "HPC_DDP_SLURM"
DIR_VAR = "HPC_DDP_LOCAL_SLURM_DIR"
# `scontrol ping` answers in milliseconds, also when the controller is down or no Slurm is
# configured at all; the bound is for a resolver that does not answer (see PROBE_RES_OPTIONS).
PROBE_TIMEOUT_S = 10.0
# With no config file, the tools look for a configless site's DNS SRV record. glibc waits
# 5 s x 2 tries per query on a resolver that does not answer; a working one answers in ms.
PROBE_RES_OPTIONS = "timeout:2 attempts:1"
# What the tools print when they found no config file and no configless server.
NO_CONFIG = "Could not establish a configuration source"


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


@dataclass(frozen=True)
class SlurmTarget:
    """Where submissions go: ``env`` for the Slurm clients, ``description`` for people."""

    env: dict[str, str]
    description: str


def _ask(argv: list[str], env: Mapping[str, str]) -> tuple[bool, str]:
    """(answered, text): text is stdout when it answered, else the last line of stderr."""
    resolver = f"{env.get('RES_OPTIONS', '')} {PROBE_RES_OPTIONS}".strip()
    probe_env = {**env, "RES_OPTIONS": resolver}
    try:
        proc = subprocess.run(
            argv, env=probe_env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return False, f"no answer in {PROBE_TIMEOUT_S:.0f} s"
    if proc.returncode == 0:
        return True, proc.stdout
    said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
    return False, said[-1] if said else f"exit {proc.returncode}"


def _describe(scontrol: str, ping: str, env: Mapping[str, str], origin: str) -> str:
    controller = re.search(r" at (\S+) is UP", ping)
    ok, config = _ask([scontrol, "show", "config"], env)
    name = re.search(r"^ClusterName\s*=\s*(\S+)", config, re.M) if ok else None
    return (
        f"the Slurm cluster {name.group(1) if name else '(unnamed)'!r}, controller "
        f"{controller.group(1) if controller else '?'} ({origin})"
    )


def users_slurm(environ: Mapping[str, str] | None = None) -> SlurmTarget | None:
    """The user's own Slurm, asked through its own tools; None if there is none.

    Found however the site set it up: SLURM_CONF, the tools' compiled-in slurm.conf (under
    /etc/slurm, /opt/slurm/etc, ...: whatever ``scontrol`` on PATH reads), a configless
    site (DNS SRV records, slurmd's cached config). A Slurm that is configured but does not
    answer is an error, not a reason to fall back: jobs meant for the user's cluster must never
    silently run somewhere else.
    """
    env = dict(os.environ if environ is None else environ)
    if env.get(FORCE_VAR) == "local":
        return None
    conf_var = env.get("SLURM_CONF")
    hint = (
        f"start that cluster, or unset SLURM_CONF / set {FORCE_VAR}=local to use the "
        "toolkit's embedded local cluster instead"
    )
    if conf_var and not Path(conf_var).is_file():  # the tools would retry it for a minute
        raise ConfigError(f"SLURM_CONF names {conf_var}, which does not exist", hint=hint)
    configured = f"SLURM_CONF={conf_var}" if conf_var else None
    if configured is None and SYSTEM_CONF.exists():
        configured = str(SYSTEM_CONF)
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol is None:
        if configured:
            raise ConfigError(
                f"Slurm is configured ({configured}) but scontrol is not installed",
                hint="apt-get install slurm-client (or load the site's Slurm module)",
            )
        return None
    origin = configured or f"found by {scontrol}"
    answered, text = _ask([scontrol, "ping"], env)
    if answered:
        client_env = {"SLURM_CONF": conf_var} if conf_var else {}
        return SlurmTarget(client_env, _describe(scontrol, text, env, origin))
    if NO_CONFIG in text and not conf_var:
        return None  # the tools are installed, but no config file and no configless server
    raise HpcDdpError(f"the Slurm configured by {origin} does not answer: {text}", hint=hint)


def choose_slurm(
    nodes: int = 2,
    cpus_per_node: int = 4,
    gpus_per_node: int = 0,
    *,
    environ: Mapping[str, str] | None = None,
    timeout_s: float = 30,
) -> SlurmTarget:
    """The user's Slurm (users_slurm), else the embedded cluster.

    The embedded cluster lives in ``default_state_dir()``; it is reused while it runs (by any
    process), started otherwise. A file lock beside its dir makes concurrent callers agree.
    """
    existing = users_slurm(environ)
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
    cfg = cluster.config
    return SlurmTarget(
        cluster.env(),
        f"the embedded local cluster in {root} ({cfg.nodes} nodes, only root can use it; "
        f"SLURM_CONF={cluster.conf_path})",
    )


def ensure_local_cluster(
    nodes: int = 2,
    cpus_per_node: int = 4,
    gpus_per_node: int = 0,
    *,
    environ: Mapping[str, str] | None = None,
    timeout_s: float = 30,
) -> dict[str, str]:
    """The variables Slurm clients need: ``choose_slurm(...).env``."""
    return choose_slurm(
        nodes, cpus_per_node, gpus_per_node, environ=environ, timeout_s=timeout_s
    ).env


def running_slurm(environ: Mapping[str, str] | None = None) -> SlurmTarget:
    """The Slurm a submitted job lives in: the user's (users_slurm), else the embedded cluster
    if it runs. Starts nothing: asking about a job must not start a cluster."""
    existing = users_slurm(environ)
    if existing is not None:
        return existing
    root = default_state_dir(environ)
    cluster = LocalCluster(root)
    if not cluster.is_running():
        raise HpcDdpError(
            f"no Slurm answers here and the embedded cluster in {root} is not running",
            hint="set SLURM_CONF to the cluster the job went to (`hpc-ddp cluster status`)",
        )
    return SlurmTarget(cluster.env(), f"the embedded local cluster in {root}")
