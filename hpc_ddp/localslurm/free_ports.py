"""Free TCP ports for the daemons of one cluster."""

from __future__ import annotations

import socket
from contextlib import ExitStack


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free right now, chosen by the kernel.

    They come from the ephemeral range (32768+), which keeps them clear of the MASTER_PORTs that
    jobs derive below 32768. All sockets stay open until every port is picked so the kernel
    cannot hand out one port twice. A port can still be taken between here and the daemon's
    bind(); the daemon then fails to start and LocalCluster retries with fresh ports.
    """
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return ports


def port_in_use(port: int) -> bool:
    """True if something already listens on (or holds) ``port`` on any address."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Slurm's daemons set SO_REUSEADDR too: a port held only by TIME_WAIT is free for them.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return True
        return False
