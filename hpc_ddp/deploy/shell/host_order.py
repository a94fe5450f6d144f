"""The host list of a scheduler-less launch, in the one order both pdsh and clush agree on.

pdsh numbers hosts (``%n``) in the order written on ``-w`` and keeps duplicates; clush numbers
them in ClusterShell's sorted, de-duplicated order. A node rank (and with it MASTER_ADDR, the
host of node rank 0) must not depend on which tool ran the job, so ``hpc-ddp launch`` puts the
hosts in *sorted* order (what clush does anyway), removes duplicates, and gives pdsh that exact
list. The remote script then checks that ``%n`` names the host it expects, so a tool that numbers
differently fails loudly instead of training with two nodes that both think they are rank 0.
"""

from __future__ import annotations

import re

from hpc_ddp.cluster.host_names import is_address
from hpc_ddp.cluster.hostlist import expand_hostlist
from hpc_ddp.deploy.safe_text import control_problem
from hpc_ddp.errors import ConfigError, HpcDdpError

_DIGITS = re.compile(r"(\d+)")


def check_address(flag: str, address: str) -> None:
    """Refuse anything but a host name, an IPv4 or an IPv6 address (no zone id: its '%' would
    be a pdsh/clush placeholder), naming ``flag``; the rules are cluster/host_names.py's."""
    if is_address(address, zone=False):
        return
    raise ConfigError(
        f"{flag} {address!r} is not a host name or an IP address",
        hint="give a name such as node01 (letters, digits, '.', '-', '_'), 10.0.0.1 or fd00::1",
    )


def natural_key(host: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key matching ClusterShell's NodeSet order: text parts as text, numbers as numbers.

    ``node9`` < ``node10`` and ``gpu1`` < ``node1``; a zero-padded ``node01`` sorts by value.
    (0, text) / (1, number) tags keep mixed tuples comparable.
    """
    parts: list[tuple[int, int | str]] = []
    for i, piece in enumerate(_DIGITS.split(host)):
        if i % 2:
            parts.append((1, int(piece)))
        elif piece:
            parts.append((0, piece))
    return tuple(parts)


def canonical_hosts(text: str) -> list[str]:
    """Expand ``node[01-02],gpu7`` and return the hosts sorted and de-duplicated.

    Raises ConfigError for an empty or malformed list; expand_hostlist refuses every name that
    is not a host name (cluster/host_names.py), which no shell layer of a launch could carry.
    """
    if problem := control_problem("--hosts", text):
        raise ConfigError(problem, hint="give host names only, e.g. --hosts 'node[01-02]'")
    try:
        hosts = expand_hostlist(text)
    except HpcDdpError as err:
        raise ConfigError(f"--hosts {text!r}: {err.message}", hint=err.hint) from err
    if not hosts:
        raise ConfigError(
            f"--hosts {text!r} names no host",
            hint="give at least one host, e.g. --hosts 'node[01-02]' or --hosts a1,a2",
        )
    # Sorting makes clush's %n and pdsh's %n agree (see the module docstring).
    return sorted(set(hosts), key=natural_key)
