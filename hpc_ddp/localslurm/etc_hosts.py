"""Make the node names resolve to loopback through tagged /etc/hosts lines.

Jobs use the first node's name as MASTER_ADDR, so ``node1`` must resolve on this machine. Each
cluster adds ONE line, ``127.0.0.1 node1 node2  # hpc-ddp-localslurm <root>``, and removes only
the line carrying its own tag. Two clusters that both have a ``node1`` add two lines with the
same address: harmless duplicates, and each line lives exactly as long as its cluster, so no
reference counting is needed. Edits happen in place (same inode: /etc/hosts may be a bind mount)
under an flock on the file itself, so parallel starts and stops never lose each other's lines.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.polling import poll_until

HOSTS = Path("/etc/hosts")
TAG = "# hpc-ddp-localslurm"


def tag_for(root: Path) -> str:
    return f"{TAG} {root}"


# An edit holds the lock for milliseconds; a holder that keeps it this long is stopped or hung,
# and a cluster's start or stop must not wait on it without a word.
LOCK_WAIT_S = 30.0


@contextmanager
def _locked(path: Path) -> Iterator[TextIO]:
    with open(path, "r+") as fh:

        def locked() -> bool:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

        if not poll_until(locked, LOCK_WAIT_S, interval_s=0.05):
            raise HpcDdpError(
                f"{path} has been locked by another process for {LOCK_WAIT_S:.0f} s "
                "(flock), so the cluster's node names cannot be added or removed",
                hint=f"`fuser -v {path}` names the holder; end it and try again",
            )
        try:
            yield fh
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _entries(text: str) -> Iterator[tuple[str, list[str], str]]:
    """(address, names, whole line) for every non-comment line."""
    for line in text.splitlines():
        body = line.split("#", 1)[0].split()
        if len(body) >= 2:
            yield body[0], body[1:], line


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def add_names(names: Sequence[str], root: Path, address: str, hosts: Path = HOSTS) -> None:
    """Add a tagged line for ``names``; refuse a name the file already maps elsewhere."""
    tag = tag_for(root)
    with _locked(hosts) as fh:
        text = fh.read()
        missing = list(names)
        for addr, entry_names, line in _entries(text):
            for name in set(entry_names) & set(names):
                if not _is_loopback(addr):
                    raise ConfigError(
                        f"{hosts} maps {name} to {addr}, but the local cluster's nodes must "
                        f"resolve to loopback: {line.strip()!r}",
                        hint="remove that line, or start the cluster with other node names "
                        "(LocalCluster(node_prefix=...))",
                    )
                if line.rstrip().endswith(tag) and name in missing:
                    missing.remove(name)
        if not missing:
            return
        if text and not text.endswith("\n"):
            text += "\n"  # a file without a final newline would glue our line to its last one
        text += f"{address} {' '.join(missing)}  {tag}\n"
        fh.seek(0)
        fh.write(text)
        fh.truncate()


def remove_names(root: Path, hosts: Path = HOSTS) -> int:
    """Remove the lines this cluster added; returns how many."""
    tag = tag_for(root)
    with _locked(hosts) as fh:
        lines = fh.read().splitlines(keepends=True)
        kept = [line for line in lines if not line.rstrip().endswith(tag)]
        if len(kept) != len(lines):
            fh.seek(0)
            fh.write("".join(kept))
            fh.truncate()
        return len(lines) - len(kept)


def prune(is_alive: Callable[[Path], bool], hosts: Path = HOSTS) -> list[Path]:
    """Drop lines of clusters that are gone (killed without a stop, dir deleted); returns them.

    ``is_alive(root)`` decides; a starting cluster writes its slurm.conf before its line, so
    "no conf and no daemon" never hits a cluster that is coming up.
    """
    with _locked(hosts) as fh:
        lines = fh.read().splitlines(keepends=True)
        dead: list[Path] = []
        kept = []
        for line in lines:
            body, _, comment = line.rstrip().partition(f"{TAG} ")
            if comment and body.endswith(" ") and not is_alive(Path(comment)):
                dead.append(Path(comment))
            else:
                kept.append(line)
        if dead:
            fh.seek(0)
            fh.write("".join(kept))
            fh.truncate()
        return dead


def has_lines(root: Path, hosts: Path = HOSTS) -> bool:
    tag = tag_for(root)
    return any(line.rstrip().endswith(tag) for line in hosts.read_text().splitlines())


def check_resolves(names: Sequence[str]) -> None:
    """Every name must resolve to a loopback address now (nsswitch may consult DNS first)."""
    for name in names:
        try:
            addr = socket.gethostbyname(name)
        except OSError as err:
            raise ConfigError(
                f"node name {name} does not resolve ({err}) after adding it to {HOSTS}",
                hint="check that /etc/nsswitch.conf has 'files' on its hosts: line",
            ) from err
        if not _is_loopback(addr):
            raise ConfigError(
                f"node name {name} resolves to {addr}, not to loopback",
                hint="another resolver answers first; use other node names (node_prefix=...)",
            )
