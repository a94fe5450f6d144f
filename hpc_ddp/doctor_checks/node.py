"""The doctor's checks of this machine (login node or inside an allocation): Slurm, the
allocation, its node list, GPUs, torch, the network, the port and the run dir.

Each check returns one ``Check`` (OK / WARN / FAIL, a detail, a hint). torch is imported only by
the torch check, lazily, so ``--no-torch`` answers in well under a second on a login node.
"""

from __future__ import annotations

import os
import queue
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hpc_ddp.errors import HpcDdpError, first_few
from hpc_ddp.slurm_client import reachable_slurm

Status = Literal["OK", "WARN", "FAIL"]
OK: Status = "OK"
WARN: Status = "WARN"
FAIL: Status = "FAIL"

# The node list's names are looked up in parallel, within one deadline for them all: a doctor
# that waits ~10 s per name on a resolver that does not answer never reports on 64 nodes.
RESOLVE_THREADS, RESOLVE_DEADLINE_S = 32, 15.0


@dataclass(frozen=True)
class EmbeddedCluster:
    """The toolkit's own Slurm cluster, found running (hpc_ddp.localslurm knows where)."""

    root: Path
    nodes: int


@dataclass(frozen=True)
class Check:
    status: Status
    name: str
    detail: str
    hint: str = ""

    def line(self) -> str:
        text = f"{self.status:<4} {self.name}: {self.detail}"
        return f"{text}\n     HINT: {self.hint}" if self.hint and self.status != OK else text


@dataclass(frozen=True)
class Options:
    run_dir: Path = Path("runs")
    gpus: int | None = None  # GPUs per node the job will ask for; None = whatever Slurm says
    port: int | None = None
    torch: bool = True
    environ: Mapping[str, str] | None = None
    # The embedded cluster running for this environment, if any. Asked by the caller (the CLI
    # asks hpc_ddp.localslurm): the deploy layer never imports the embedded cluster itself.
    embedded_cluster: Callable[[Mapping[str, str]], EmbeddedCluster | None] | None = None
    # Names the node-list check found unresolvable or unanswered within its deadline: a later
    # check (the network's route to the master) does not look them up again, which on a
    # resolver that never answers would cost a second deadline for an answer already known.
    dead_names: set[str] = field(default_factory=set, compare=False, repr=False)

    @property
    def env(self) -> Mapping[str, str]:
        return os.environ if self.environ is None else self.environ


def in_allocation(env: Mapping[str, str]) -> bool:
    return bool(env.get("SLURM_JOB_ID"))


def check_slurm_tools(o: Options) -> Check:
    tools = ("sbatch", "srun", "scontrol", "scancel")
    missing = [t for t in tools if shutil.which(t, path=o.env.get("PATH")) is None]
    if not missing:
        return Check(OK, "slurm tools", ", ".join(tools) + " on PATH")
    return Check(
        FAIL if "srun" in missing or "sbatch" in missing else WARN,
        "slurm tools",
        f"missing: {', '.join(missing)}",
        "load the site's Slurm module, or run on a login/compute node; without Slurm use "
        "`hpc-ddp launch` (pdsh/clush) or `hpc-ddp submit --executor local`",
    )


def check_controller(o: Options) -> Check:
    if shutil.which("scontrol", path=o.env.get("PATH")) is None:
        return Check(WARN, "slurm controller", "scontrol not found: not checked")
    try:
        slurm = reachable_slurm(o.env)  # the same answer `hpc-ddp submit` goes by
    except HpcDdpError as err:  # configured, but it does not answer
        return Check(FAIL, "slurm controller", err.message, err.hint or "")
    if slurm is None:
        embedded = o.embedded_cluster(o.env) if o.embedded_cluster else None
        if embedded is not None:
            return Check(
                OK,
                "slurm controller",
                f"no Slurm configured; the embedded local cluster runs in {embedded.root} "
                f"({embedded.nodes} nodes), which `hpc-ddp submit` uses "
                "(`eval $(hpc-ddp cluster env)` points sbatch/srun at it)",
            )
        return Check(
            WARN,
            "slurm controller",
            "no Slurm configured (scontrol finds no config and no configless server)",
            "`hpc-ddp submit` will start the embedded local cluster; set SLURM_CONF to use "
            "another one",
        )
    return Check(OK, "slurm controller", slurm.description)


def check_launch_env(o: Options) -> Check:
    """Inside an allocation: are we a task (srun) or the batch shell? What does each rank see?"""
    env = o.env
    if not in_allocation(env):
        return Check(OK, "allocation", "not inside a Slurm job (login node checks only)")
    from hpc_ddp.cluster.slurm import in_srun_task

    # The batch shell has SLURM_PROCID=0 too; the step id tells it from task 0 (cluster/slurm.py).
    if not in_srun_task(env):
        return Check(
            WARN,
            "allocation",
            f"job {env['SLURM_JOB_ID']}: this is the batch shell, not an srun task",
            "training processes must be started with srun (one task per process) or "
            "srun + torchrun; a bare `python train.py` runs one process and waits for the rest",
        )
    from hpc_ddp.cluster import detect_env

    try:
        d = detect_env(env)
    except HpcDdpError as err:
        return Check(FAIL, "allocation", err.message, err.hint or "")
    return Check(
        OK,
        "allocation",
        f"job {d.job_id}: rank {d.rank}/{d.world_size}, local {d.local_rank}/"
        f"{d.local_world_size}, node {d.node_rank}/{d.num_nodes}, master "
        f"{d.master_addr}:{d.master_port} ({d.source})",
    )


def check_nodelist(o: Options) -> Check:
    nodelist = o.env.get("SLURM_STEP_NODELIST") or o.env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return Check(OK, "node list", "no allocation: skipped")
    from hpc_ddp.cluster.hostlist import expand_hostlist

    hosts = expand_hostlist(nodelist)
    bad, silent = _resolve_all(hosts, RESOLVE_DEADLINE_S)
    o.dead_names.update(bad, silent)
    if bad or silent:
        said = [f"{len(bad)} do not resolve: {first_few(bad, 5)}"] if bad else []
        said += [f"{len(silent)} got no answer in {RESOLVE_DEADLINE_S:.0f} s: "
                 f"{first_few(silent, 5)}"] if silent else []  # fmt: skip
        return Check(
            FAIL,
            "node list",
            f"of {len(hosts)} hosts, " + "; ".join(said),
            "MASTER_ADDR is the first of these names; every node must resolve it (DNS or "
            "/etc/hosts), or set MASTER_ADDR to an address",
        )
    return Check(OK, "node list", f"{nodelist}: {len(hosts)} host(s) resolve, first {hosts[0]}")


def _resolve_all(hosts: list[str], deadline_s: float) -> tuple[list[str], list[str]]:
    """(hosts that do not resolve, hosts without an answer by the deadline), looked up
    RESOLVE_THREADS at a time in daemon threads: a resolver that does not answer costs ~10 s a
    name, one after another, and a lookup cannot be interrupted, only left behind."""
    pending: queue.SimpleQueue[str] = queue.SimpleQueue()
    for host in hosts:
        pending.put(host)
    failed: set[str] = set()
    answered: set[str] = set()
    lock, all_answered = threading.Lock(), threading.Event()

    def look_up() -> None:
        while True:
            try:
                host = pending.get_nowait()
            except queue.Empty:
                return
            try:
                socket.gethostbyname(host)
            except Exception:  # OSError; UnicodeError for a label over 63 characters
                with lock:
                    failed.add(host)
            finally:
                with lock:
                    answered.add(host)
                    if len(answered) == len(hosts):
                        all_answered.set()

    for _ in range(min(RESOLVE_THREADS, len(hosts))):
        threading.Thread(target=look_up, daemon=True).start()
    if hosts:
        all_answered.wait(deadline_s)
    with lock:
        return [h for h in hosts if h in failed], [h for h in hosts if h not in answered]


def check_gpus(o: Options) -> Check:
    from hpc_ddp.cluster.devices import count_visible_gpus, driver_gpu_count

    env = o.env
    from hpc_ddp.cluster._vars import get_opt_int
    from hpc_ddp.cluster.slurm import in_srun_task

    asked = o.gpus
    if asked is None:
        asked = get_opt_int(env, "SLURM_GPUS_ON_NODE")
    visible = count_visible_gpus(env)
    driver = driver_gpu_count()
    detail = (
        f"asked {asked if asked is not None else '-'}, visible {visible} "
        f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')}), driver sees {driver}"
    )
    if asked and driver == 0:
        return Check(
            FAIL,
            "gpus",
            detail,
            "GPUs were requested but no NVIDIA driver is loaded here: wrong partition or node?",
        )
    if asked and visible < asked and not in_srun_task(env):
        return Check(FAIL, "gpus", detail, "ask Slurm for them: --gpus-per-node=N")
    if not asked and visible:
        return Check(
            WARN, "gpus", detail, "GPUs are visible but the job asks for none: CPU/Gloo job?"
        )
    return Check(OK, "gpus", detail)


_TORCH_HINT = (
    "activate the job's environment (`hpc-ddp[train]` there), or pass --no-torch to check the "
    "rest here without torch (a login node needs none)"
)


def check_torch(o: Options) -> Check:
    if not o.torch:
        return Check(OK, "torch", "skipped (--no-torch)")
    try:
        import torch
        import torch.distributed as dist
    except ModuleNotFoundError as err:
        if err.name != "torch":  # torch is there but lacks a module it needs
            return Check(FAIL, "torch", f"import failed: {err}", _TORCH_HINT)
        # The core install, as on a login node: nothing here trains.
        return Check(
            OK,
            "torch",
            "not installed here: torch checks skipped (a login node's core install needs no "
            "torch; run `hpc-ddp doctor` in the job's environment, or `--job FILE` in an "
            "allocation, to check the torch a job uses; --no-torch skips this line)",
        )
    except Exception as err:  # any other import failure is the finding
        return Check(FAIL, "torch", f"import failed: {err}", _TORCH_HINT)
    available = {
        "nccl": dist.is_nccl_available(),
        "gloo": dist.is_gloo_available(),
        "mpi": dist.is_mpi_available(),
    }
    backends = [name for name, ok in available.items() if ok]
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    detail = (
        f"torch {torch.__version__}, CUDA {'yes' if cuda else 'no'} ({count} device(s)), "
        f"backends: {', '.join(backends) or 'none'}"
    )
    if "gloo" not in backends:
        return Check(FAIL, "torch", detail, "this torch build has no Gloo: reinstall torch")
    wants_gpu = bool(o.gpus) or bool(o.env.get("SLURM_GPUS_ON_NODE"))
    if wants_gpu and (not cuda or "nccl" not in backends):
        return Check(
            FAIL,
            "torch",
            detail,
            "GPUs expected but torch cannot use them with NCCL: CPU-only torch wheel or "
            "driver/CUDA mismatch",
        )
    return Check(OK, "torch", detail)


def check_network(o: Options) -> Check:
    from hpc_ddp.network import choose_backend

    env = o.env
    master = None
    if in_allocation(env) and (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")):
        from hpc_ddp.cluster.hostlist import expand_hostlist

        master = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"])[0]
    from hpc_ddp.cluster._vars import get_opt_int

    nodes = get_opt_int(env, "SLURM_JOB_NUM_NODES", minimum=1) or 1
    ifname = env.get("GLOO_SOCKET_IFNAME", "")
    if ifname.startswith("^") or "," in ifname:
        return Check(
            FAIL,
            "network",
            f"GLOO_SOCKET_IFNAME={ifname!r}",
            "Gloo takes one interface name; the '^lo,docker0' syntax is NCCL's only",
        )

    dead_master = master if master in o.dead_names else None
    try:
        choice = choose_backend(
            cuda_available=bool(o.gpus),
            master_addr=None if dead_master else master,
            num_nodes=nodes,
            environ=env,
        )
    except HpcDdpError as err:
        return Check(FAIL, "network", err.message, err.hint or "")
    detail = f"{choice.backend}: {choice.reason}; interconnect {choice.interconnect}"
    if dead_master:
        detail += (
            f"; no route to master {dead_master}: it did not resolve (node list above); set "
            "GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME by hand if the job cannot connect"
        )
    if choice.interface:
        detail += f", interface {choice.interface}"
    return Check(OK, "network", detail)


def check_port(o: Options) -> Check:
    from hpc_ddp.cluster.master_port import RESV_PORTS_VAR, choose_master_port

    env = o.env
    port, source = o.port, "--port"
    job_id = env.get("SLURM_JOB_ID")
    if port is None and (env.get("MASTER_PORT") or env.get(RESV_PORTS_VAR) or job_id):
        try:
            choice = choose_master_port(env, job_id)  # the rule every rank of the job applies
        except HpcDdpError as err:
            return Check(FAIL, "master port", err.message, err.hint or "")
        port, source = choice.port, choice.origin
    if port is None:
        return Check(OK, "master port", "no job and no --port: skipped")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError as err:
            return Check(
                FAIL,
                "master port",
                f"{port} ({source}) is in use here: {err.strerror}",
                "another job or a stale process holds it: set MASTER_PORT explicitly, or find "
                f"it with `ss -ltnp | grep {port}`",
            )
    return Check(OK, "master port", f"{port} ({source}) is free")


def check_reserved_ports(o: Options) -> Check:
    """Does slurmctld reserve ports per step (slurm.conf ``MpiParams=ports=A-B``)? Then every
    srun step gets ports no other step on its nodes holds, and MASTER_PORT comes from them."""
    from hpc_ddp.cluster.master_port import RESV_PORTS_VAR

    name = "reserved ports"
    step_ports = o.env.get(RESV_PORTS_VAR)
    if step_ports:
        return Check(OK, name, f"this step has {RESV_PORTS_VAR}={step_ports}: MASTER_PORT uses it")
    try:
        slurm = reachable_slurm(o.env)
    except HpcDdpError:
        slurm = None  # the controller line reports it
    if slurm is None:
        return Check(OK, name, "no Slurm answers: not checked")
    try:
        proc = subprocess.run(
            ["scontrol", "show", "config"], env={**o.env, **slurm.env}, capture_output=True,
            text=True, timeout=20,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return Check(OK, name, "scontrol show config: no answer in 20 s, not checked")
    if proc.returncode != 0:
        return Check(OK, name, "scontrol show config failed (controller down?): not checked")
    params = next(
        (line.split("=", 1)[1].strip() for line in proc.stdout.splitlines()
         if line.split("=", 1)[0].strip() == "MpiParams"),
        "",
    )  # fmt: skip
    ports = next((p.split("=", 1)[1] for p in params.split(",") if p.startswith("ports=")), "")
    if ports:
        return Check(
            OK,
            name,
            f"the cluster reserves ports {ports} per step (MpiParams): srun tasks take "
            f"MASTER_PORT from {RESV_PORTS_VAR}; `resv_ports = true` in a job spec requires them",
        )
    return Check(
        OK,
        name,
        "the cluster reserves no ports per step (no MpiParams=ports=...): MASTER_PORT is "
        "derived from the job id; jobs sharing a node collide only if their ids are equal "
        "modulo 9000",
    )


def check_run_dir(o: Options) -> Check:
    """Can the trainer write there? A doctor creates nothing: a run dir not made yet is judged
    by the nearest dir above it that exists, where the trainer would create it; the write test
    is a temporary file, removed at once."""
    path, name = o.run_dir, "checkpoint dir"
    hint = "checkpoints need a writable directory on storage every node shares"
    existing = next(p for p in (path, *path.absolute().parents) if os.path.lexists(p))
    if not existing.is_dir():
        return Check(FAIL, name, f"{path}: {existing} is not a directory", hint)
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".doctor-") as f:
            f.write(b"x" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        return Check(FAIL, name, f"{path}: {existing} is not writable: {err.strerror}", hint)
    free = shutil.disk_usage(existing).free / 2**30
    status = WARN if free < 1 else OK
    hint = "less than 1 GiB free: checkpoints may fail" if status == WARN else ""
    where = (
        f"{path.resolve()} writable"
        if existing == path
        else f"{path} does not exist yet; {existing.resolve()}, where the trainer creates it, "
        "is writable"
    )
    return Check(status, name, f"{where}, {free:.1f} GiB free", hint)


CHECKS: tuple[Callable[[Options], Check], ...] = (
    check_slurm_tools,
    check_controller,
    check_launch_env,
    check_nodelist,
    check_gpus,
    check_network,
    check_port,
    check_reserved_ports,
    check_run_dir,
    check_torch,
)


def run_checks(o: Options) -> list[Check]:
    out = []
    for check in CHECKS:
        try:
            out.append(check(o))
        except HpcDdpError as err:  # a bad value in the environment, named with its fix
            name = check.__name__.removeprefix("check_")
            out.append(Check(FAIL, name, err.message, err.hint or ""))
        except Exception as err:  # a broken check is reported, never a crash of the doctor
            out.append(Check(FAIL, check.__name__.removeprefix("check_"), f"check crashed: {err}"))
    return out
