"""Start, stop and inspect one local Slurm cluster: munged, slurmctld + N slurmd on loopback.

Debian's slurm-wlm is built with multiple-slurmd support, so N ``slurmd -N nodeK`` on this one
machine, each on its own port, are N nodes to Slurm. Everything a cluster writes lives under
its root dir (private to root: private_dir.py) except one tagged /etc/hosts line (hosts.py);
its processes are found by pid. Clients authenticate through the cluster's own munged
(munge.py); the daemons listen on loopback only (loopback.py).
"""

from __future__ import annotations

import glob
import os
import random
import subprocess
import time
from dataclasses import replace
from pathlib import Path

from hpc_ddp.env_vars import LOCAL_SLURM_DIR_VAR
from hpc_ddp.errors import ConfigError, HpcDdpError, first_few
from hpc_ddp.localslurm import cgroupfs, cluster_dir, gpus, loopback, munge, private_dir, procs
from hpc_ddp.localslurm import etc_hosts as hosts
from hpc_ddp.localslurm.config import (
    NODE_ADDR,
    ClusterConfig,
    render_cgroup_conf,
    render_gres_conf,
    render_slurm_conf,
)
from hpc_ddp.localslurm.free_ports import free_ports, port_in_use
from hpc_ddp.localslurm.install import SYSTEM, SYSTEM_PATH, SlurmInstall
from hpc_ddp.polling import poll_until
from hpc_ddp.slurm_client import SlurmClient, client_env

BINARIES = (
    "munged", "slurmctld", "slurmd", "scontrol", "sinfo", "squeue", "scancel", "sbatch", "srun",
)  # fmt: skip
DAEMON_PATH = SYSTEM_PATH
PORT_RETRIES = 3
BIND_ERROR = "Address already in use"
DAEMONIZE_GRACE_S = 0.5
# Error lines that appear on every (first) start and explain nothing.
LOG_NOISE = ("pmix", "state file", "Trying backup state save file", "specified more than once")
# Where Debian (and other multiarch builds) and RHEL-style builds install the munge plugin.
AUTH_MUNGE_PLUGIN = ("/usr/lib/*/slurm-wlm/auth_munge.so", "/usr/lib*/slurm/auth_munge.so")


class ClusterStartError(HpcDdpError):
    """The daemons did not come up; the message carries the relevant log lines."""


def check_prerequisites(install: SlurmInstall = SYSTEM) -> None:
    """Slurm's and munge's programs and the auth/munge plugin are there (an unpacked
    ``install``'s libraries too), and we are root."""
    install.check()
    missing = [b for b in BINARIES if install.which(b) is None]
    if missing:
        raise ConfigError(
            f"Slurm is not installed: {', '.join(missing)} not found on PATH",
            hint="apt-get install slurm-wlm munge   (Debian/Ubuntu; the local cluster needs "
            "the daemons)",
        )
    if os.geteuid() != 0:
        raise ConfigError(
            "starting the local Slurm cluster needs root (slurmd runs jobs as their user "
            "and edits /etc/hosts)",
            hint="run it as root (sudo hpc-ddp cluster up), or point SLURM_CONF at an existing "
            "Slurm cluster",
        )
    plugin_dir = install.plugin_dir()
    patterns = (f"{plugin_dir}/auth_munge.so",) if plugin_dir else AUTH_MUNGE_PLUGIN
    if not any(glob.glob(pattern) for pattern in patterns):
        raise ConfigError(
            "this Slurm build has no auth/munge plugin (auth_munge.so), which the local "
            "cluster authenticates with",
            hint="use Debian/Ubuntu's slurm-wlm package, which ships it",
        )


class LocalCluster:
    """A real Slurm cluster on this machine, rooted at ``root``.

    ``port`` is slurmctld's port; the slurmd ports follow it. None picks free ports (and retries
    with new ones if another process takes one before the daemon binds it).
    """

    def __init__(
        self,
        root: Path | str,
        nodes: int = 2,
        cpus_per_node: int = 4,
        gpus_per_node: int = 0,
        port: int | None = None,
        *,
        node_prefix: str = "node",
        first_job_id: int | None = None,
        extra: dict[str, str] | None = None,
        ephemeral: bool = False,
        slurm_root: Path | str | None = None,
        real_gpus: tuple[str, ...] = (),
        cgroups: bool = False,
    ) -> None:
        self.root = Path(root).absolute()
        # Before anything is read from it: its state names processes to signal and the config
        # that root's Slurm commands load (plugins included).
        private_dir.check(self.root)
        self.port = port
        # Ephemeral clusters (test sessions) record the process that started them, so that
        # orphans.reap() can stop them once that process is gone (killed test run, Ctrl-C).
        self.ephemeral = ephemeral
        # Validated now (bad input fails before anything starts); ports are filled in by start().
        self._wanted = ClusterConfig(
            root=self.root,
            nodes=nodes,
            cpus_per_node=cpus_per_node,
            gpus_per_node=gpus_per_node,
            ctld_port=port or 1,
            node_ports=tuple(range((port or 1) + 1, (port or 1) + 1 + nodes)),
            node_prefix=node_prefix,
            first_job_id=first_job_id or random.randrange(1000, 60000) * 100,
            extra=dict(extra or {}),
            slurm_root=str(slurm_root or ""),
            real_gpus=tuple(real_gpus),
            cgroups=cgroups,
        )
        self.config = self._load_state() or self._wanted

    @classmethod
    def attach(cls, root: Path | str) -> LocalCluster:
        """The cluster recorded in ``root`` (started by any process)."""
        cluster = cls(root)
        if cluster._load_state() is None:
            raise HpcDdpError(
                f"no local cluster in {cluster.root}", hint="start one: hpc-ddp cluster up"
            )
        return cluster

    # ------------------------------------------------------------------ inspection
    @property
    def conf_path(self) -> Path:
        """The clients' slurm.conf (what ``env()`` exports)."""
        return self.config.conf_path

    @property
    def daemon_conf_path(self) -> Path:
        """The daemons' config; job tasks see it as their SLURM_CONF."""
        return self.config.daemon_conf_path

    @property
    def node_names(self) -> tuple[str, ...]:
        return self.config.node_names

    @property
    def install(self) -> SlurmInstall:
        return SlurmInstall(self.config.slurm_root)

    def env(self) -> dict[str, str]:
        """Variables a Slurm client (sbatch, srun, squeue...) needs to talk to this cluster:
        SLURM_CONF, and for an unpacked Slurm PATH and LD_LIBRARY_PATH (its dirs first)."""
        return {"SLURM_CONF": str(self.conf_path), **self.install.env()}

    def client(self, base_env: dict[str, str] | None = None) -> SlurmClient:
        env = client_env(self.conf_path, base_env)
        env.update(self.install.env(base_env))
        return SlurmClient(env, workdir=self.root / "jobs")

    def _load_state(self) -> ClusterConfig | None:
        path = self.root / "run" / "cluster.json"
        try:
            return ClusterConfig.from_json(path.read_text())
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def _pids(self) -> dict[str, int]:
        path = self.root / "run" / "pids"
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return {}
        return {role: int(pid) for role, pid in (line.split() for line in lines if line.strip())}

    def _daemon_alive(self, pid: int) -> bool:
        """Alive AND still our daemon: the pid file may be stale and the pid reused."""
        argv = procs.cmdline(pid)
        marks = (str(self.daemon_conf_path), str(self.config.munge_key_path))
        return procs.alive(pid) and any(mark in argv for mark in marks)

    def _slurm_daemons(self) -> set[int]:
        """slurmctld and slurmd of this cluster, also those that never wrote a pid file."""
        return procs.pids_with_args("-f", str(self.daemon_conf_path))

    def _munged(self) -> set[int]:
        return procs.pids_with_args("--key-file", str(self.config.munge_key_path))

    def is_running(self) -> bool:
        pids = self._pids()
        if self._load_state() is None or len(pids) != self.config.nodes + 2:  # + ctld, munged
            return False
        return all(self._daemon_alive(p) for p in pids.values()) and self.client().ping()

    # ------------------------------------------------------------------ start
    def start(self, timeout_s: float = 30) -> None:
        """Start the daemons and wait until every node is idle. Undoes itself on failure."""
        check_prerequisites(SlurmInstall(self._wanted.slurm_root))
        gpus.check_devices(self._wanted.real_gpus)
        cgroupfs.check_cores(self._wanted)
        private_dir.check(self.root)
        self._check_dir_is_ours()
        prefix = loopback.daemon_prefix()
        if self.is_running():
            raise HpcDdpError(
                f"a local cluster is already running in {self.root}",
                hint="use it (LocalCluster.attach / hpc-ddp cluster env) or stop it first",
            )
        if self._load_state() is not None or self._pids() or self._slurm_daemons() | self._munged():
            self.stop()  # leftovers of a crashed cluster: clean them before reusing the dir
        if self.port is not None:
            wanted = range(self.port, self.port + 1 + self._wanted.nodes)
            taken = [p for p in wanted if port_in_use(p)]
            if taken:
                raise ConfigError(
                    f"port(s) {taken} already in use: the local cluster needs "
                    f"{self.port}..{self.port + self._wanted.nodes}",
                    hint="leave port=None (hpc-ddp cluster up without --port) to pick free ports",
                )
        attempts = 1 if self.port is not None else PORT_RETRIES
        for attempt in range(1, attempts + 1):
            if self.port is None:
                ctld, *nodes = free_ports(1 + self._wanted.nodes)
                self.config = replace(self._wanted, ctld_port=ctld, node_ports=tuple(nodes))
            else:
                self.config = self._wanted
            try:
                self._start_once(timeout_s, prefix)
                return
            except ClusterStartError as err:
                if attempt == attempts or BIND_ERROR not in str(err):
                    raise

    def _start_once(self, timeout_s: float, prefix: list[str]) -> None:
        """``prefix``: what each Slurm daemon runs under (loopback.daemon_prefix)."""
        cfg = self.config
        deadline = time.monotonic() + timeout_s
        cluster_dir.remove_owned(self.root)  # old state would resurrect old jobs
        private_dir.prepare(self.root)
        cluster_dir.mark(self.root)
        for d in cfg.dirs():
            d.mkdir(parents=True, exist_ok=True)
        plugins = self.install.plugin_dir()
        cfg.conf_path.write_text(render_slurm_conf(cfg, plugin_dir=plugins))
        cfg.daemon_conf_path.write_text(
            render_slurm_conf(cfg, for_daemons=True, plugin_dir=plugins)
        )
        cfg.cgroup_path.write_text(render_cgroup_conf(cfg))
        munge.write_key(cfg.munge_key_path)
        if cfg.gpus_per_node:
            cfg.gres_path.write_text(render_gres_conf(cfg))
            for dev in cfg.gpu_devices():
                os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))  # a char device, like /dev/null
        cfg.state_path.write_text(cfg.to_json())
        if self.ephemeral:
            (self.root / "run" / "owner").write_text(procs.identity(os.getpid()) or "")
        try:
            hosts.prune(_cluster_exists)
            hosts.add_names(cfg.node_names, self.root, NODE_ADDR)
            hosts.check_resolves(cfg.node_names)
            cgroupfs.prepare(controllers=cfg.cgroups)
            daemon = self.install.daemon_paths(self.root / "run" / "bin")
            self._spawn("munged", munge.munged_argv(cfg), deadline)  # found on the root's PATH
            warnings = munge.unexpected_warnings(cfg.log_dir / "munged.log")
            if warnings:
                raise ClusterStartError("munged: " + "; ".join(warnings[-3:]))
            conf = str(cfg.daemon_conf_path)
            self._spawn("slurmctld", [daemon["slurmctld"], "-f", conf], deadline, prefix)
            for name in cfg.node_names:
                argv = [daemon["slurmd"], "-f", conf, "-N", name]
                if self.install.unpacked:
                    argv += ["-d", daemon["slurmstepd"]]
                self._spawn(f"slurmd-{name}", argv, deadline, prefix)
            self._wait_idle(deadline)
        except BaseException as err:
            detail = self._log_excerpt()
            try:
                self.stop(graceful=False)
            except HpcDdpError as undo:  # the start's own error is the one to tell
                detail += f"\n(undoing the start: {undo.message})"
            if isinstance(err, HpcDdpError):
                raise ClusterStartError(f"{err.message}\n{detail}", hint=err.hint) from err
            raise

    def _spawn(
        self, role: str, argv: list[str], deadline: float, prefix: list[str] | None = None
    ) -> None:
        """Run a daemon (it forks itself into the background) and record its pid."""
        env = {"PATH": DAEMON_PATH, "SLURM_CONF": str(self.daemon_conf_path), "LANG": "C"}
        env.update(self.install.env(env))
        with open(self.config.log_dir / f"{role}.stdout", "ab") as out:
            proc = subprocess.run(
                [*(prefix or []), *argv],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                timeout=30,
            )
        if proc.returncode != 0:
            raise ClusterStartError(f"{role} exited {proc.returncode} while starting")
        # slurmd's parent can exit before the daemon writes its pid file: wait for the file,
        # but stop waiting as soon as the daemon is gone or cannot bind its port (it would retry).
        pid_file = self.root / "run" / f"{role}.pid"
        log = self.config.log_dir / f"{role}.log"
        not_started = f"{role} did not start (no pid file {pid_file})"
        seen_at = time.monotonic()

        def pid_written() -> bool:
            nonlocal seen_at
            if pid_file.exists() and pid_file.read_text().strip():
                return True
            if log.exists() and BIND_ERROR in log.read_text(errors="replace"):
                raise ClusterStartError(f"{role} could not bind its port: {BIND_ERROR}")
            now = time.monotonic()
            if procs.pids_with_args(*argv):
                seen_at = now
            # While daemonizing, the process is briefly invisible: only a lasting absence is death.
            if now - seen_at > DAEMONIZE_GRACE_S:
                raise ClusterStartError(not_started)
            return False

        if not poll_until(pid_written, deadline - time.monotonic(), interval_s=0.02):
            raise ClusterStartError(not_started)
        with open(self.root / "run" / "pids", "a") as fh:
            fh.write(f"{role} {int(pid_file.read_text().split()[0])}\n")

    def _wait_idle(self, deadline: float) -> None:
        client = self.client()
        want = set(self.config.node_names)

        def all_idle() -> bool:
            dead = [r for r, p in self._pids().items() if not self._daemon_alive(p)]
            if dead:
                raise ClusterStartError(f"{', '.join(dead)} died while starting")
            return want <= set(client.nodes_in_state("idle"))

        if not poll_until(all_idle, deadline - time.monotonic(), interval_s=0.05):
            raise ClusterStartError("not every node became idle in time")

    def _log_excerpt(self, per_file: int = 12) -> str:
        """The error lines of each daemon log, which say why a start failed."""
        out = []
        for log in sorted(self.config.log_dir.glob("*")) if self.config.log_dir.exists() else []:
            lines = log.read_text(errors="replace").splitlines()
            bad = [ln for ln in lines if "error" in ln.lower() or "fatal" in ln.lower()]
            bad = [ln for ln in bad if not any(n in ln for n in LOG_NOISE)]
            if bad:
                out.append(f"--- {log.name}:")
                out.extend(bad[-per_file:])
        return "\n".join(out) if out else "(no error lines in the daemon logs)"

    # ------------------------------------------------------------------ stop
    def stop(self, timeout_s: float = 20, keep_dir: bool = False, graceful: bool = True) -> None:
        """Cancel jobs, shut the daemons down, kill stragglers by pid, clean up. Idempotent.

        ``graceful=False`` skips the cancel and `scontrol shutdown` round trips (a half-started
        cluster has no jobs, and slurmctld would wait on nodes that never registered). A dir
        that holds files but no cluster (cluster_dir) is refused, untouched.
        """
        if not cluster_dir.holds_cluster(self.root) and (found := cluster_dir.entries(self.root)):
            raise ConfigError(
                f"{self.root} is not a local cluster's dir (no {cluster_dir.MARKER}; it holds "
                f"{first_few(found, 5)}): nothing stopped, nothing removed",
                hint=f"name the dir the cluster was started in (--dir, {LOCAL_SLURM_DIR_VAR}); "
                "`hpc-ddp cluster status --dir DIR` says whether one runs there",
            )
        # Recorded pids, plus any daemon of this dir that died before writing its pid file.
        # munged goes last: the shutdown requests below need it.
        recorded = {role: p for role, p in self._pids().items() if self._daemon_alive(p)}
        munged = self._munged() | {p for role, p in recorded.items() if role == "munged"}
        daemons = self._slurm_daemons() | {p for r, p in recorded.items() if r != "munged"}
        # Without munged every request would fail, each after seconds of retries.
        if graceful and {"slurmctld", "munged"} <= recorded.keys() and self.conf_path.exists():
            self._cancel_jobs(timeout_s / 2)
            # slurmstepd and job tasks outlive `scontrol shutdown`, hence the cancel above.
            self.client().run(["scontrol", "shutdown"], check=False, timeout_s=10)
            daemons = procs.wait_gone(daemons, timeout_s / 4)
        procs.terminate(daemons)
        stragglers = procs.cluster_pids(self.root, self.daemon_conf_path)
        left = procs.terminate(stragglers, grace_s=2) | procs.terminate(munged)
        hosts_error: HpcDdpError | None = None
        try:
            hosts.remove_names(self.root)
        except HpcDdpError as err:  # /etc/hosts stays locked: the dir goes all the same, and
            hosts_error = err  # the next start's prune drops the line of a cluster gone
        if keep_dir:
            for name in ("pids", "cluster.json"):
                (self.root / "run" / name).unlink(missing_ok=True)
        else:
            cluster_dir.remove_owned(self.root)
        if left:
            raise HpcDdpError(f"processes {sorted(left)} of {self.root} survived SIGKILL")
        if hosts_error is not None:
            raise hosts_error

    def _check_dir_is_ours(self) -> None:
        """Refuse a dir holding anything that is not this cluster's (cluster_dir)."""
        if foreign := cluster_dir.foreign_entries(self.root):
            unmarked = "" if cluster_dir.holds_cluster(self.root) else f" (no {cluster_dir.MARKER})"
            raise ConfigError(
                f"{self.root} holds files that are not a local cluster's{unmarked}: "
                + first_few(foreign, 5),
                hint="give the cluster an empty or new dir of its own (--dir)",
            )

    def _cancel_jobs(self, timeout_s: float) -> None:
        client = self.client()
        listed = client.run(["squeue", "-h", "-o", "%i"], check=False, timeout_s=10)
        jobs = listed.stdout.split()
        if not jobs:
            return
        client.run(["scancel", *jobs], check=False, timeout_s=10)

        def queue_empty() -> bool:
            return not client.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()

        # KillWait=5: a task ignoring SIGTERM gets SIGKILL 5 s later. Past the deadline, the
        # straggler sweep in stop() kills what is left.
        poll_until(queue_empty, timeout_s)


def _cluster_exists(root: Path) -> bool:
    """Whether the cluster in ``root`` may still be alive: its confs (a starting cluster writes
    them before its /etc/hosts line) or any of its daemons."""
    conf, daemon_conf = root / "slurm.conf", root / "daemons.conf"
    if conf.exists() or daemon_conf.exists():
        return True
    return bool(procs.pids_with_args("-f", str(daemon_conf)))
