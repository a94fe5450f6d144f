"""What one local cluster is (a dataclass) and the Slurm config files it renders to. Pure.

Two slurm.conf variants: ``daemons.conf`` for slurmctld and slurmd (every job task sees it too:
slurmstepd hands its daemon's config to the tasks as SLURM_CONF) and ``slurm.conf`` for clients
started outside the cluster (``hpc-ddp cluster env``, ``hpc-ddp submit``). They differ in one
line, which makes the daemons bind loopback; see ``render_slurm_conf``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hpc_ddp import schema
from hpc_ddp.env_vars import LOCAL_SLURM_DIR_VAR
from hpc_ddp.errors import ConfigError
from hpc_ddp.localslurm.gpus import per_node
from hpc_ddp.localslurm.install import checked_path

# Slurm puts per-step unix sockets under SlurmdSpoolDir/<node>/<node>_<job>.<step>; sun_path holds
# 107 bytes, so a long root breaks job launch late and obscurely. Refuse it up front instead.
MAX_ROOT_LEN = 64
# Every name resolves to this address (see hosts.py): the same answer in every cluster, so two
# clusters that both call their first node "node1" never disagree about where it is.
NODE_ADDR = "127.0.0.1"
# Every "node" is a slurmd of this machine, with a port and a spool dir of its own.
MAX_NODES = 64


def _range(lo: int, hi: int, why: str = "") -> dict[str, schema.Range]:
    """A numeric field's metadata: its Range (hpc_ddp.schema)."""
    return {"range": schema.Range(lo, hi, why=why)}


@dataclass(frozen=True)
class ClusterConfig:
    """Everything needed to render the config files and find the daemons again later."""

    root: Path
    nodes: int = field(
        default=2, metadata=_range(1, MAX_NODES, why="slurmd daemons on one machine")
    )
    cpus_per_node: int = field(default=4, metadata=_range(1, 4 * schema.MAX_PER_NODE))
    gpus_per_node: int = field(default=0, metadata=_range(0, schema.MAX_PER_NODE))
    memory_mb: int = field(default=2000, metadata=_range(1, 1 << 30))
    ctld_port: int = field(default=6817, metadata={"range": schema.PORT})
    node_ports: tuple[int, ...] = (6818, 6819)
    node_prefix: str = "node"
    # Distinct job ids per cluster: jobs derive MASTER_PORT from the job id, and every cluster's
    # "nodes" share this machine's network stack, so equal ids in two clusters would collide.
    first_job_id: int = field(
        default=1, metadata=_range(1, 67_043_328, why="Slurm's default MaxJobId")
    )
    cluster_name: str = "hpcddp"
    extra: dict[str, str] = field(default_factory=dict)
    # Debian's Slurm packages unpacked under this dir (install.py); "" = the system's Slurm.
    slurm_root: str = ""
    # Device files of real GPUs (gpus.py), gpus_per_node per node in node order; () = fake GPUs.
    real_gpus: tuple[str, ...] = ()
    # proctrack/task cgroup plugins: a task can touch only its own GPUs and CPUs.
    cgroups: bool = False

    def __post_init__(self) -> None:
        ports = [
            schema.PORT.problem(f"node_ports[{i}]", port, int)
            for i, port in enumerate(self.node_ports)
        ]
        if problems := schema.number_problems(self) + [p for p in ports if p]:
            raise ConfigError("; ".join(problems), hint="use values in the ranges shown")
        if len(self.node_ports) != self.nodes:
            raise ConfigError(f"need one port per node: {self.nodes} nodes, {self.node_ports}")
        ports = (self.ctld_port, *self.node_ports)
        if len(set(ports)) != len(ports):
            raise ConfigError(f"ports must be distinct, got {ports}")
        if not self.node_prefix.isalpha() or not self.node_prefix.islower():
            raise ConfigError(
                f"node_prefix must be lowercase letters, got {self.node_prefix!r}",
                hint="Slurm hostlists split names into a prefix and a number: use e.g. 'node'",
            )
        if self.slurm_root:
            checked_path(self.slurm_root, "the Slurm root")
        for path in self.real_gpus:
            checked_path(path, "GPU device")
        if self.real_gpus and len(self.real_gpus) != self.nodes * self.gpus_per_node:
            raise ConfigError(
                f"{len(self.real_gpus)} GPU device(s) for {self.nodes} node(s) x "
                f"{self.gpus_per_node} GPU(s): the numbers must match",
                hint="leave --gpus-per-node out: it follows from --gpu-devices and --nodes",
            )
        if not self.root.is_absolute():
            raise ConfigError(f"cluster dir must be an absolute path, got {self.root}")
        if len(str(self.root)) > MAX_ROOT_LEN:
            raise ConfigError(
                f"cluster dir {self.root} is {len(str(self.root))} characters long; "
                f"at most {MAX_ROOT_LEN} fit (Slurm's step sockets live under it)",
                hint="pick a shorter dir, e.g. --dir /tmp/hpc-ddp-slurm or "
                f"{LOCAL_SLURM_DIR_VAR}=/tmp/hpc-ddp-slurm",
            )

    # Paths, all under root, so that removing root removes everything the cluster wrote.
    @property
    def conf_path(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def daemon_conf_path(self) -> Path:
        return self.root / "daemons.conf"

    @property
    def munge_key_path(self) -> Path:
        return self.root / "munge.key"

    @property
    def munge_socket(self) -> Path:
        return self.root / "run" / "munge.socket"

    @property
    def gres_path(self) -> Path:
        return self.root / "gres.conf"  # slurmd reads gres.conf from slurm.conf's directory

    @property
    def cgroup_path(self) -> Path:
        return self.root / "cgroup.conf"  # also read from slurm.conf's directory

    @property
    def state_path(self) -> Path:
        return self.root / "run" / "cluster.json"

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(f"{self.node_prefix}{i}" for i in range(1, self.nodes + 1))

    @property
    def nodelist(self) -> str:
        """The node names in Slurm's compressed form, e.g. ``node[1-2]``."""
        if self.nodes == 1:
            return self.node_names[0]
        return f"{self.node_prefix}[1-{self.nodes}]"

    def dirs(self) -> list[Path]:
        spools = [self.root / "spool" / n for n in self.node_names]
        extra = [self.root / "dev"] if self.gpus_per_node and not self.real_gpus else []
        names = ("state", "log", "run", "jobs")
        return [*(self.root / d for d in names), *spools, *extra]

    def gpu_devices(self) -> list[Path]:
        """The fake GPUs' device files (none with real GPUs)."""
        if self.real_gpus:
            return []
        return [self.root / "dev" / f"nvidia{g}" for g in range(self.gpus_per_node)]

    # Persistence: the state file lets `stop`, `status` and `ensure_local_cluster` find a
    # cluster that another process started.
    def to_json(self) -> str:
        data = asdict(self)
        data["root"] = str(self.root)
        data["node_ports"] = list(self.node_ports)
        data["real_gpus"] = list(self.real_gpus)
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> ClusterConfig:
        data = json.loads(text)
        data["root"] = Path(data["root"])
        data["node_ports"] = tuple(data["node_ports"])
        data["real_gpus"] = tuple(data.get("real_gpus", ()))
        return cls(**data)


def conf_header(root: Path) -> str:
    """The first line of the slurm.conf a cluster in ``root`` writes (cluster_dir knows a
    cluster's dir by it)."""
    return f"# Generated by hpc-ddp (hpc_ddp/localslurm) for the local cluster in {root}."


def render_slurm_conf(
    cfg: ClusterConfig, *, for_daemons: bool = False, plugin_dir: str | None = None
) -> str:
    """slurm.conf for clients, or (``for_daemons``) daemons.conf for slurmctld and slurmd.
    ``plugin_dir``: where an unpacked Slurm's plugins are (None: the compiled-in dir)."""
    r = cfg.root
    lines = [
        conf_header(r),
        f"ClusterName={cfg.cluster_name}",
        # "localhost" is a valid controller name on any machine; clients dial the address.
        f"SlurmctldHost=localhost({NODE_ADDR})",
        f"SlurmctldPort={cfg.ctld_port}",
        f"SlurmdPort={cfg.node_ports[0]}",
        "SlurmUser=root",
        "SlurmdUser=root",
        # Every request carries a munge credential that this cluster's own munged (its key,
        # its socket: see munge.py) signed with the sender's real uid: a claimed uid counts
        # for nothing, and only processes that can reach the socket can authenticate at all.
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire: slurmctld holds a requeued job back until its old launch credential has
        # expired (cred_expire + 1 s; 120 by default), so the least Slurm accepts, 5: a local
        # cluster's credential crosses loopback to a slurmd on this machine, well within it.
        f"AuthInfo=cred_expire=5,socket={cfg.munge_socket}",
        f"StateSaveLocation={r}/state",
        f"SlurmdSpoolDir={r}/spool/%n",
        f"SlurmctldPidFile={r}/run/slurmctld.pid",
        f"SlurmdPidFile={r}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={r}/log/slurmctld.log",
        f"SlurmdLogFile={r}/log/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        *_process_plugins(cfg),
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/backfill",
        # Batch jobs start < 1 s after sbatch; requeued jobs ~1 s after they become eligible.
        "SchedulerParameters=batch_sched_delay=0,bf_interval=1,sched_interval=2",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        # Trust CPUs= below, not the real core count, or the nodes get drained for "low cpu count".
        "SlurmdParameters=config_overrides",
        "MailProg=/bin/true",
        "ReturnToService=2",
        "SlurmdTimeout=60",
        # MessageTimeout bounds a round trip between these daemons and their clients, and how
        # long a client keeps redialling a controller that refuses it (a Slurm command against
        # a dead slurmctld fails after about twice this). Every party here is on one host, over
        # loopback: an answer is milliseconds of CPU, late by scheduling delays of a loaded
        # machine, not by seconds; 5 s keeps a wide margin over that while a dead controller is
        # noticed within seconds rather than after twice the default 10.
        "MessageTimeout=5",
        # No accounting, so finished jobs are only visible to scontrol while they are kept.
        "MinJobAge=300",
        "KillWait=5",
        "InactiveLimit=0",
        "Waittime=0",
        f"FirstJobId={cfg.first_job_id}",
    ]
    if plugin_dir:
        lines.insert(1, f"PluginDir={checked_path(plugin_dir, 'the plugin dir')}")
    # `extra` overrides a setting in place (Slurm warns about a key given twice).
    if for_daemons:
        # Bind the address of the host's name (NODE_ADDR: see loopback.py) instead of every
        # interface. Clients read this setting too, and an srun whose host name resolves
        # elsewhere would then listen where its steps cannot call back: so daemons only.
        lines.append("CommunicationParameters=NoCtldInAddrAny,NoInAddrAny")
    lines = [_override(line, cfg.extra) for line in lines]
    known = {line.split("=", 1)[0] for line in lines}
    lines += [f"{k}={v}" for k, v in cfg.extra.items() if k not in known]
    gres = ""
    if cfg.gpus_per_node:
        lines.append("GresTypes=gpu")
        gres = f" Gres=gpu:{cfg.gpus_per_node}"
    for name, port in zip(cfg.node_names, cfg.node_ports, strict=True):
        lines.append(
            f"NodeName={name} NodeHostname=localhost NodeAddr={NODE_ADDR} Port={port} "
            f"CPUs={cfg.cpus_per_node} RealMemory={cfg.memory_mb}{gres} State=UNKNOWN"
        )
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def _process_plugins(cfg: ClusterConfig) -> list[str]:
    if not cfg.cgroups:
        # No cgroups: works in containers and VMs without a delegated cgroup tree.
        return ["ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none"]
    # Each step in its own cgroup (devices, cores) and each task bound to its CPUs.
    return ["ProctrackType=proctrack/cgroup", "TaskPlugin=task/cgroup,task/affinity"]


def render_cgroup_conf(cfg: ClusterConfig) -> str:
    """cgroup.conf, for v1 and v2 alike: slurmd loads its cgroup plugin even without cgroups.

    IgnoreSystemd: on cgroup v2 slurmd would ask systemd (over D-Bus) for its stepd scope; where
    init is not systemd (VMs, containers) that fails, so it makes the directory itself
    (cgroupfs.py prepares its parent). ConstrainDevices (cgroups on): a task opens only the GPUs
    it was given; ConstrainCores: it runs only on its CPUs.
    """
    lines = [
        f"# Generated by hpc-ddp (hpc_ddp/localslurm) for the local cluster in {cfg.root}.",
        "CgroupPlugin=autodetect",
        "IgnoreSystemd=yes",
    ]
    if cfg.cgroups:
        lines += ["ConstrainCores=yes", "ConstrainDevices=yes"]
    return "\n".join(lines) + "\n"


def render_gres_conf(cfg: ClusterConfig) -> str:
    """Real GPUs: each node's share of the device files. Fake GPUs: slurmd only stat()s the
    files, which must be character devices (see daemons)."""
    if not cfg.gpus_per_node:
        return ""
    if cfg.real_gpus:
        shares = per_node(cfg.real_gpus, cfg.nodes)
        return "".join(
            f"NodeName={name} Name=gpu File={path}\n"
            for name, share in zip(cfg.node_names, shares, strict=True)
            for path in share
        )
    last = cfg.gpus_per_node - 1
    files = "nvidia0" if last == 0 else f"nvidia[0-{last}]"
    return f"Name=gpu File={cfg.root}/dev/{files}\n"


def _override(line: str, extra: dict[str, str]) -> str:
    key = line.split("=", 1)[0]
    return f"{key}={extra[key]}" if key in extra else line
