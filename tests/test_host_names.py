"""One rule for host names and addresses (hpc_ddp/cluster/host_names.py), applied alike by
every layer that takes one: Slurm node lists, MASTER_ADDR as a launcher left it, and the hosts
and master address of `hpc-ddp launch`."""

from __future__ import annotations

import pytest

from hpc_ddp.cluster import detect_env
from hpc_ddp.cluster.hostlist import expand_hostlist
from hpc_ddp.deploy.shell.host_order import canonical_hosts, check_address
from hpc_ddp.errors import ConfigError, LaunchEnvError

NAMES = ["node01", "n-1.ib", "gpu_7", "10.0.0.1", "7", "a" * 253]
NOT_NAMES = ["-oProxyCommand", ".hidden", "a" * 254, "a/b", "a;b", "n\u00f6de", "a%n", ""]


def _master(address: str) -> str:
    return detect_env({"MASTER_ADDR": address}, visible_gpus=0).master_addr


@pytest.mark.parametrize("name", NAMES)
def test_a_host_name_is_one_everywhere(name: str) -> None:
    assert expand_hostlist(name) == [name]
    assert canonical_hosts(name) == [name]
    assert _master(name) == name
    check_address("--master-addr", name)


@pytest.mark.parametrize("name", NOT_NAMES)
def test_what_is_no_host_name_is_refused_everywhere(name: str) -> None:
    with pytest.raises(LaunchEnvError):
        expand_hostlist(name)
    with pytest.raises(ConfigError, match="--hosts"):
        canonical_hosts(name)
    with pytest.raises(LaunchEnvError, match="MASTER_ADDR"):
        _master(name)
    with pytest.raises(ConfigError, match="--master-addr"):
        check_address("--master-addr", name)


def test_a_bracket_group_cannot_make_a_name_start_with_an_option_dash() -> None:
    with pytest.raises(LaunchEnvError, match="'-ib1' is not a host name"):
        expand_hostlist("n1,-ib[1-2]")


@pytest.mark.parametrize("address", ["fd00::1", "::ffff:10.0.0.1", "::1"])
def test_ipv6_addresses_are_addresses_everywhere(address: str) -> None:
    assert _master(address) == address
    check_address("--master-addr", address)


@pytest.mark.parametrize("address", ["a:b", ":::", "fd00::1::2", "fd00::1%", "fd00::1%a b"])
def test_what_only_looks_like_ipv6_is_refused_everywhere(address: str) -> None:
    with pytest.raises(LaunchEnvError, match="MASTER_ADDR"):
        _master(address)
    with pytest.raises(ConfigError, match="--master-addr"):
        check_address("--master-addr", address)


def test_a_zone_id_only_where_no_pdsh_or_clush_substitutes_percent() -> None:
    assert _master("fe80::1%eth0") == "fe80::1%eth0"  # the process group resolves it
    with pytest.raises(ConfigError, match="--master-addr"):
        check_address("--master-addr", "fe80::1%eth0")  # '%e' would be a placeholder
