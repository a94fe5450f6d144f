"""Make slurmctld and slurmd listen on loopback only.

With ``CommunicationParameters=NoCtldInAddrAny,NoInAddrAny`` (daemons.conf) Slurm 22.05's
daemons bind the address their host name resolves to (gethostname(), looked up as IPv4),
instead of every interface. Clients dial NODE_ADDR (127.0.0.1), so that is the address the
host name must resolve to. Where it does (this name maps to 127.0.0.1 in /etc/hosts), the
daemons start as they are. Where it does not (Debian's usual 127.0.1.1, a LAN or container
address), each daemon starts in its own UTS namespace whose host name is ``localhost``: the
daemon and its job tasks see that name, nothing else on the machine does.
"""

from __future__ import annotations

import socket
import subprocess

from hpc_ddp.errors import ConfigError
from hpc_ddp.localslurm.config import NODE_ADDR

NAMESPACE_HOSTNAME = "localhost"
# `unshare --uts` gives the command a private host name; sh sets it, then becomes the daemon.
_IN_NAMESPACE = [
    "unshare",
    "--uts",
    "--",
    "sh",
    "-c",
    f'hostname {NAMESPACE_HOSTNAME} && exec "$@"',
    "sh",
]


def hostname_address(name: str | None = None) -> str | None:
    """What Slurm binds with NoInAddrAny: the first IPv4 address of this host's name."""
    try:
        infos = socket.getaddrinfo(name or socket.gethostname(), None, socket.AF_INET)
    except OSError:
        return None
    return str(infos[0][4][0]) if infos else None


def daemon_prefix() -> list[str]:
    """[] where the host name already resolves to NODE_ADDR, else the UTS namespace wrapper."""
    if hostname_address() == NODE_ADDR:
        return []
    if hostname_address(NAMESPACE_HOSTNAME) != NODE_ADDR:
        raise ConfigError(
            f"neither this host's name {socket.gethostname()!r} nor {NAMESPACE_HOSTNAME!r} "
            f"resolves to {NODE_ADDR}: the local cluster's daemons would listen where their "
            "clients cannot reach them",
            hint=f"map localhost to {NODE_ADDR} in /etc/hosts",
        )
    probe = subprocess.run(
        [*_IN_NAMESPACE, "true"], capture_output=True, text=True, timeout=10, check=False
    )
    if probe.returncode != 0:
        raise ConfigError(
            f"this host's name {socket.gethostname()!r} resolves to {hostname_address()}, not "
            f"{NODE_ADDR}, and the daemons cannot get a host name of their own (`unshare --uts` "
            f"failed: {probe.stderr.strip()}); the local cluster's daemons bind the address "
            "of their host name, so they would listen where their clients cannot reach them",
            hint="run it as root with CAP_SYS_ADMIN (docker: --cap-add SYS_ADMIN), or where "
            f"the host name resolves to {NODE_ADDR}",
        )
    return list(_IN_NAMESPACE)
