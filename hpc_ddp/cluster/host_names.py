"""What a host name and a host address may hold: one rule for every layer that reads or writes
one (Slurm node lists, MASTER_ADDR, the hosts and master of a scheduler-less launch).

A host name is letters, digits, '.', '-' and '_' (what DNS and /etc/hosts allow, plus '_'),
starting with a letter, a digit or '_', at most 253 characters (DNS's limit for a whole name).
Such a name survives every shell layer of a launch unquoted, ssh cannot read it as an option,
and it carries no '%', which pdsh and clush substitute. An IPv4 address is a host name by these
rules. An IPv6 address is checked by :mod:`ipaddress`; its zone id (``fe80::1%eth0``) is
accepted where the address only reaches the process group (MASTER_ADDR), and refused where it
would pass through pdsh/clush.

Every pattern is used with ``fullmatch``: ``$`` would accept a trailing newline.
"""

from __future__ import annotations

import ipaddress
import re

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,252}")
_NAME_TEXT = re.compile(r"[A-Za-z0-9_.-]*")
_IPV6 = re.compile(r"[0-9A-Fa-f:.]{2,45}")
_ZONE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def is_host_name(text: str) -> bool:
    """A plain host name or IPv4 address (see the module docstring)."""
    return _NAME.fullmatch(text) is not None


def is_name_text(text: str) -> bool:
    """Text that may stand in a host name (the parts around a host list's brackets)."""
    return _NAME_TEXT.fullmatch(text) is not None


def is_ipv6(text: str, *, zone: bool = False) -> bool:
    """An IPv6 address; with ``zone``, one with a zone id (``%eth0``) as well."""
    address, sep, zone_id = text.partition("%")
    if sep and not (zone and _ZONE.fullmatch(zone_id)):
        return False
    if not _IPV6.fullmatch(address):
        return False
    try:
        ipaddress.IPv6Address(address)
    except ValueError:
        return False
    return True


def is_address(text: str, *, zone: bool = False) -> bool:
    """A host name, an IPv4 or an IPv6 address (with a zone id only if ``zone``)."""
    return is_host_name(text) or is_ipv6(text, zone=zone)
