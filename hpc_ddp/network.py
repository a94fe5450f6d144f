"""Which backend, over which interconnect, through which interface. Pure Python, no torch.

The rule is the backend table (docs/environment.md): CUDA -> NCCL, CPU -> Gloo, MPI only when
asked for and built in. The interconnect (from /sys) never changes the rule; it changes the
settings: which interface carries the TCP bootstrap / Gloo traffic, and the RoCE GID for NCCL.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

from hpc_ddp.cluster.distenv import DistEnv
from hpc_ddp.errors import ConfigError

BACKENDS = ("nccl", "gloo", "mpi")
_SIOCGIFADDR = 0x8915  # Linux ioctl: IPv4 address of an interface


@dataclass(frozen=True)
class BackendChoice:
    backend: str  # "nccl" | "gloo" | "mpi"
    reason: str  # shown to users by `hpc-ddp env`
    interconnect: str  # "infiniband" | "roce" | "ethernet" | "loopback"
    env: dict[str, str] = field(default_factory=dict)  # settings to export; never user-set ones
    interface: str | None = None  # the interface that routes to master_addr, if known


@dataclass(frozen=True)
class RdmaPort:
    device: str  # e.g. mlx5_0
    port: int
    link_layer: str  # "InfiniBand" or "Ethernet" (RoCE)
    roce_v2_gid: int | None  # GID index of a RoCE v2 IPv4 address, RoCE only


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _roce_v2_gid(port_dir: str) -> int | None:
    """First GID index typed "RoCE v2" holding an IPv4-mapped address (routable across subnets);
    NCCL older than 2.21 defaults to index 0, a link-local RoCE v1 GID."""
    types_dir = os.path.join(port_dir, "gid_attrs", "types")
    try:
        indices = sorted(int(name) for name in os.listdir(types_dir) if name.isdigit())
    except OSError:
        return None
    for index in indices:
        gid = _read(os.path.join(port_dir, "gids", str(index)))
        if _read(os.path.join(types_dir, str(index))) == "RoCE v2" and gid.startswith(
            "0000:0000:0000:0000:0000:ffff:"
        ):
            return index
    return None


def rdma_ports(sys_root: str = "/") -> list[RdmaPort]:
    """Active RDMA ports from /sys/class/infiniband/<dev>/ports/<n>/{state,link_layer}."""
    base = os.path.join(sys_root, "sys", "class", "infiniband")
    found: list[RdmaPort] = []
    try:
        devices = sorted(os.listdir(base))
    except OSError:
        return found
    for device in devices:
        ports_dir = os.path.join(base, device, "ports")
        try:
            ports = sorted(int(p) for p in os.listdir(ports_dir) if p.isdigit())
        except OSError:
            continue
        for port in ports:
            port_dir = os.path.join(ports_dir, str(port))
            if not _read(os.path.join(port_dir, "state")).endswith("ACTIVE"):
                continue
            layer = _read(os.path.join(port_dir, "link_layer")) or "InfiniBand"
            gid = _roce_v2_gid(port_dir) if layer == "Ethernet" else None
            found.append(RdmaPort(device, port, layer, gid))
    return found


def physical_interfaces(sys_root: str = "/") -> list[str]:
    """Network interfaces that are up and backed by a device (not lo, bridges, veths, ifb)."""
    base = os.path.join(sys_root, "sys", "class", "net")
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    return [
        name
        for name in names
        if os.path.exists(os.path.join(base, name, "device"))
        and _read(os.path.join(base, name, "operstate")) in ("up", "unknown")
    ]


def detect_interconnect(sys_root: str = "/") -> tuple[str, list[RdmaPort]]:
    ports = rdma_ports(sys_root)
    if any(p.link_layer == "InfiniBand" for p in ports):
        return "infiniband", ports
    if ports:
        return "roce", ports
    return ("ethernet" if physical_interfaces(sys_root) else "loopback"), ports


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(
                sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
            )
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_owner(address: str) -> str | None:
    wanted = ipaddress.IPv6Address(address).exploded.replace(":", "")
    for line in _read("/proc/net/if_inet6").splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[0] == wanted:
            return fields[5]
    return None


def interface_of_address(address: str) -> str | None:
    """The local interface holding ``address``; any loopback address maps to the loopback one."""
    ip = ipaddress.ip_address(address)
    if ip.version == 6:
        return "lo" if ip.is_loopback else _ipv6_owner(address)
    for _, name in socket.if_nameindex():
        held = _ipv4_of(name)
        if held == address or (ip.is_loopback and held and ipaddress.ip_address(held).is_loopback):
            return name
    return None


def route_to(master_addr: str) -> tuple[str, str]:
    """(local address, interface) this host uses to reach master_addr.

    Connecting a UDP socket sends nothing; the kernel only picks the route and source address.
    Raises OSError when master_addr does not resolve or is unreachable.
    """
    family, _, _, _, sockaddr = socket.getaddrinfo(master_addr, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect(sockaddr)
        local = str(sock.getsockname()[0])
    iface = interface_of_address(local)
    if iface is None:
        raise OSError(f"no interface holds the local address {local}")
    return local, iface


def pick_backend(cuda_available: bool, requested: str | None, mpi_available: bool = False) -> str:
    """The process group's backend: ``requested`` checked, or NCCL with CUDA and Gloo without."""
    wanted = (requested or "auto").strip().lower()
    if wanted == "auto":
        return "nccl" if cuda_available else "gloo"
    if wanted not in BACKENDS:
        raise ConfigError(
            f"unknown backend {requested!r} (valid: auto, {', '.join(BACKENDS)})",
            hint="leave it unset: NCCL is chosen with CUDA GPUs, Gloo without",
        )
    if wanted == "nccl" and not cuda_available:
        raise ConfigError(
            "backend 'nccl' was requested but this process has no CUDA GPU",
            hint="use 'gloo' on CPU, or run where a GPU is visible (check CUDA_VISIBLE_DEVICES)",
        )
    if wanted == "mpi" and not mpi_available:
        raise ConfigError(
            "backend 'mpi' was requested but this torch was not built with MPI",
            hint="use 'nccl' (GPU) or 'gloo' (CPU); MPI needs torch built from source against it",
        )
    return wanted


def _check_user_gloo_ifname(value: str, remote: bool) -> None:
    if value.startswith("^") or value == "" or (remote and value == "lo"):
        raise ConfigError(
            f"GLOO_SOCKET_IFNAME={value!r} cannot work"
            + (" for a job spanning hosts" if value == "lo" else ""),
            hint="Gloo wants a concrete interface name such as eth0 or ib0; the '^lo,docker0' "
            "exclusion form is NCCL_SOCKET_IFNAME's only. Unset it to let hpc-ddp choose",
        )


def choose_backend(
    *,
    cuda_available: bool,
    requested: str | None = None,
    mpi_available: bool = False,
    sys_root: str = "/",
    master_addr: str | None = None,
    num_nodes: int = 1,
    environ: Mapping[str, str] | None = None,
    env: DistEnv | None = None,
) -> BackendChoice:
    """Backend plus NCCL_/GLOO_ settings. Settings already in ``environ`` are never overridden.

    ``env`` (a DistEnv) supplies master_addr and num_nodes when they are not given; a one-process
    world needs no interface.
    """
    environ = os.environ if environ is None else environ
    if env is not None:
        num_nodes = env.num_nodes
        if master_addr is None and env.world_size > 1:
            master_addr = env.master_addr
    backend = pick_backend(cuda_available, requested, mpi_available)
    interconnect, ports = detect_interconnect(sys_root)
    why = (
        "requested"
        if requested and requested.lower() != "auto"
        else ("CUDA GPUs present" if cuda_available else "no CUDA GPU")
    )
    notes: list[str] = []
    settings: dict[str, str] = {}  # becomes BackendChoice.env (`env` is the DistEnv argument)

    iface = None
    if master_addr:
        try:
            local, iface = route_to(master_addr)
        except OSError as err:
            notes.append(
                f"cannot route to master {master_addr} ({err}); set GLOO_SOCKET_IFNAME/"
                "NCCL_SOCKET_IFNAME by hand if the job cannot connect"
            )
        else:
            loop = ipaddress.ip_address(local).is_loopback
            notes.append(f"{iface} ({local}) routes to master {master_addr}")
            if loop and num_nodes > 1:
                notes.append(f"{master_addr} is a loopback address: every node must be this host")
            settings["GLOO_SOCKET_IFNAME"] = iface
            if backend == "nccl":
                settings["NCCL_SOCKET_IFNAME"] = iface
    remote = bool(iface and iface != "lo")
    if "GLOO_SOCKET_IFNAME" in environ:
        _check_user_gloo_ifname(environ["GLOO_SOCKET_IFNAME"], remote and num_nodes > 1)

    devices = ",".join(sorted({p.device for p in ports}))
    if backend == "nccl" and interconnect == "infiniband":
        notes.append(
            f"NCCL uses InfiniBand verbs on {devices}; the interface above only bootstraps"
        )
    elif backend == "nccl" and interconnect == "roce":
        gids = {p.roce_v2_gid for p in ports if p.roce_v2_gid is not None}
        notes.append(f"NCCL uses RoCE on {devices}")
        if len(gids) == 1:
            settings["NCCL_IB_GID_INDEX"] = str(gids.pop())
    elif backend == "nccl":
        notes.append("no RDMA device: NCCL talks over TCP sockets between nodes")
    elif backend == "gloo" and interconnect in ("infiniband", "roce"):
        notes.append(
            f"Gloo has no RDMA transport: it uses TCP (IPoIB if that routes), not {devices}"
        )

    kept = sorted(k for k in settings if k in environ)
    for key in kept:
        del settings[key]
    if kept:
        notes.append("kept your " + ", ".join(f"{k}={environ[k]}" for k in kept))
    label = {"nccl": "NCCL", "gloo": "Gloo", "mpi": "MPI"}[backend]
    reason = f"{label}: {why}, {interconnect} interconnect"
    if notes:
        reason += "; " + "; ".join(notes)
    return BackendChoice(backend, reason, interconnect, settings, iface)
