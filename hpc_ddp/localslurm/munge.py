"""Each cluster's own munged: its own key, its own socket, nothing shared with a system munge.

Layout, all in the 0700 cluster dir (private_dir.py): ``munge.key`` (random, mode 0400, made
here), ``run/munge.socket``, ``log/munged.log``, ``run/munged.pid``, ``state/munged.seed``.
A system munged (/etc/munge, /run/munge) is never read or touched, so the cluster runs beside
one, and a credential that another munged signed (another key) does not decode here.

Who can authenticate: only processes that can reach the socket, i.e. root, since the socket
sits inside the private dir. Any other local user cannot get a credential for this cluster
at all, so cannot submit, not even as themselves: the cluster is root's alone.

munged refuses to start unless every dir above its socket is searchable by all users (a system
munged serves every local user). That is exactly what this layout must not allow, so munged
runs with ``--force``, which turns that refusal into a warning. ``--force`` also downgrades
munged's other checks (key and dir permissions, an existing socket) to warnings; those are
covered by the dir checks in private_dir.py, by writing the key here, by starting munged only
in a dir with no munged of its own left running, and by ``unexpected_warnings``: the start
fails on any munged warning but the expected one.
"""

from __future__ import annotations

import os
from pathlib import Path

from hpc_ddp.localslurm.config import ClusterConfig

KEY_BYTES = 128  # mungekey's default size (1024 bits)
# The one warning --force is for: the socket's dirs are not searchable by all users.
EXPECTED_WARNING = "Socket is inaccessible"


def write_key(path: Path) -> None:
    """A fresh random key, created 0400 (never an existing file: O_EXCL, no symlink)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
    try:
        os.fchmod(fd, 0o400)  # whatever the umask
        os.write(fd, os.urandom(KEY_BYTES))
    finally:
        os.close(fd)


def munged_argv(cfg: ClusterConfig) -> list[str]:
    r = cfg.root
    return [
        "munged",
        "--force",
        "--socket",
        str(cfg.munge_socket),
        "--key-file",
        str(cfg.munge_key_path),
        "--pid-file",
        str(r / "run" / "munged.pid"),
        "--log-file",
        str(r / "log" / "munged.log"),
        "--seed-file",
        str(r / "state" / "munged.seed"),
    ]


def unexpected_warnings(log: Path) -> list[str]:
    """munged's warnings and errors other than the one ``--force`` is meant for."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [
        line
        for line in text.splitlines()
        if ("Warning:" in line or "Error:" in line) and EXPECTED_WARNING not in line
    ]
