"""MASTER_PORT: an explicit value wins; otherwise one every rank derives alone from the job id.

The derived port lies in [20000, 29000): below Linux's ephemeral range (32768+, where the kernel
hands out client ports and could have taken ours) and clear of torch's defaults 29400 (elastic
rendezvous) and 29500 (MASTER_PORT). Two jobs sharing a node collide only if their ids are equal
modulo 9000; set MASTER_PORT explicitly where that matters.
"""

from __future__ import annotations

import socket
import zlib
from collections.abc import Mapping

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


def master_port(environ: Mapping[str, str], job_id: str | None) -> int:
    """THE port rule, shared by the launcher sources and the torchrun template's batch shell
    (``python -m hpc_ddp.deploy.port``): an explicit MASTER_PORT wins, else ``derive_port``.

    ``job_id`` may be None only when MASTER_PORT is set; callers say what is missing otherwise.
    """
    explicit = environ.get("MASTER_PORT")
    if explicit:
        return parse_port(explicit)
    if job_id is None:
        raise ValueError("master_port: no MASTER_PORT and no job id")  # a caller's bug
    return derive_port(job_id)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on this host: only for single-process runs, where nobody must agree."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
