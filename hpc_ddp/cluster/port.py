"""MASTER_PORT: an explicit value wins; otherwise one every rank derives alone from the job id.

The derived port lies in [20000, 29000): below Linux's ephemeral range (32768+, where the kernel
hands out client ports and could have taken ours) and clear of torch's defaults 29400 (elastic
rendezvous) and 29500 (MASTER_PORT). Two jobs sharing a node collide only if their ids are equal
modulo 9000; set MASTER_PORT explicitly where that matters.
"""

from __future__ import annotations

import socket
import zlib

from hpc_ddp.errors import LaunchEnvError

PORT_BASE = 20000
PORT_SPAN = 9000


def parse_port(value: str, name: str = "MASTER_PORT") -> int:
    try:
        port = int(value.strip())
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise LaunchEnvError(
            f"{name}={value!r} is not a TCP port",
            hint=f"give {name} an integer in 1..65535, or unset it to derive one from the job id",
        )
    return port


def derive_port(job_id: str) -> int:
    """Same job id -> same port on every rank, no communication needed."""
    key = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    return PORT_BASE + key % PORT_SPAN


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on this host: only for single-process runs, where nobody must agree."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
