"""Backend choice, interconnect detection and interface selection.

There is no InfiniBand, RoCE or GPU here: RDMA devices and NICs are faked as /sys trees under
tmp_path (sys_root), with the files the kernel exposes (ports/<n>/state, link_layer,
gid_attrs/types, gids; class/net/<if>/device, operstate). Routing to master_addr uses this
machine's real sockets and interfaces, checked against `ip -o addr`.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from hpc_ddp.errors import ConfigError
from hpc_ddp.network import choose_backend, detect_interconnect, route_to


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def fake_sys(
    root: Path, *, ib: str | None = None, nic: bool = True, state: str = "4: ACTIVE"
) -> str:
    """ib: None, "InfiniBand" or "Ethernet" (RoCE). nic: a physical, up eth0 besides lo."""
    _write(root / "sys/class/net/lo/operstate", "unknown")
    if nic:
        _write(root / "sys/class/net/eth0/operstate", "up")
        (root / "sys/class/net/eth0/device").mkdir(parents=True, exist_ok=True)
    _write(root / "sys/class/net/docker0/operstate", "up")  # virtual: no device entry
    if ib:
        port = root / "sys/class/infiniband/mlx5_0/ports/1"
        _write(port / "state", state)
        _write(port / "link_layer", ib)
        if ib == "Ethernet":
            for index, (kind, gid) in enumerate(
                [
                    ("IB/RoCE v1", "fe80:0000:0000:0000:0000:0000:0000:0001"),
                    ("RoCE v2", "fe80:0000:0000:0000:0000:0000:0000:0001"),
                    ("IB/RoCE v1", "0000:0000:0000:0000:0000:ffff:0a00:0005"),
                    ("RoCE v2", "0000:0000:0000:0000:0000:ffff:0a00:0005"),
                ]
            ):
                _write(port / f"gid_attrs/types/{index}", kind)
                _write(port / f"gids/{index}", gid)
    return str(root)


@pytest.mark.parametrize(
    ("ib", "nic", "state", "expected"),
    [
        ("InfiniBand", True, "4: ACTIVE", "infiniband"),
        ("Ethernet", True, "4: ACTIVE", "roce"),
        ("InfiniBand", True, "1: DOWN", "ethernet"),  # a down HCA carries nothing
        (None, True, "", "ethernet"),
        (None, False, "", "loopback"),  # only lo and a virtual bridge
    ],
)
def test_interconnect(tmp_path: Path, ib: str | None, nic: bool, state: str, expected: str) -> None:
    assert detect_interconnect(fake_sys(tmp_path, ib=ib, nic=nic, state=state))[0] == expected


# The backend table: (cuda, RDMA link layer) -> backend, words the reason must contain.
TABLE = [
    (True, "InfiniBand", "nccl", "infiniband", "InfiniBand verbs"),
    (True, None, "nccl", "ethernet", "TCP sockets"),
    (False, "InfiniBand", "gloo", "infiniband", "no RDMA transport"),
    (False, None, "gloo", "ethernet", "no CUDA GPU"),
    (True, "Ethernet", "nccl", "roce", "RoCE"),
]


@pytest.mark.parametrize(("cuda", "ib", "backend", "interconnect", "words"), TABLE)
def test_backend_table(
    tmp_path: Path, cuda: bool, ib: str | None, backend: str, interconnect: str, words: str
) -> None:
    choice = choose_backend(cuda_available=cuda, sys_root=fake_sys(tmp_path, ib=ib), environ={})
    assert (choice.backend, choice.interconnect) == (backend, interconnect)
    assert words in choice.reason


def test_roce_gid_index(tmp_path: Path) -> None:
    choice = choose_backend(
        cuda_available=True, sys_root=fake_sys(tmp_path, ib="Ethernet"), environ={}
    )
    assert choice.env["NCCL_IB_GID_INDEX"] == "3"  # RoCE v2 with an IPv4 address, not index 1
    kept = choose_backend(
        cuda_available=True,
        sys_root=fake_sys(tmp_path, ib="Ethernet"),
        environ={"NCCL_IB_GID_INDEX": "1"},
    )
    assert "NCCL_IB_GID_INDEX" not in kept.env and "kept your NCCL_IB_GID_INDEX=1" in kept.reason


@pytest.mark.parametrize(
    ("requested", "cuda", "mpi", "backend"),
    [
        ("gloo", True, False, "gloo"),
        ("NCCL", True, False, "nccl"),
        ("mpi", False, True, "mpi"),
        ("auto", False, False, "gloo"),
    ],
)
def test_requested(tmp_path: Path, requested: str, cuda: bool, mpi: bool, backend: str) -> None:
    choice = choose_backend(
        cuda_available=cuda,
        requested=requested,
        mpi_available=mpi,
        sys_root=fake_sys(tmp_path),
        environ={},
    )
    assert choice.backend == backend
    assert ("requested" in choice.reason) == (requested != "auto")


@pytest.mark.parametrize(
    ("requested", "cuda", "mpi", "message"),
    [
        ("nccl", False, False, "no CUDA GPU"),
        ("mpi", True, False, "not built with MPI"),
        ("ucc", True, True, "unknown backend"),
    ],
)
def test_requested_errors(
    tmp_path: Path, requested: str, cuda: bool, mpi: bool, message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        choose_backend(
            cuda_available=cuda,
            requested=requested,
            mpi_available=mpi,
            sys_root=fake_sys(tmp_path),
            environ={},
        )
    assert err.value.hint


def test_loopback_master_picks_lo(tmp_path: Path) -> None:
    """All 'nodes' on this host (the local test cluster): lo is right, and the reason says why."""
    choice = choose_backend(
        cuda_available=True,
        master_addr="127.0.0.1",
        num_nodes=2,
        sys_root=fake_sys(tmp_path),
        environ={},
    )
    assert choice.interface == "lo"
    assert choice.env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert "every node must be this host" in choice.reason
    single = choose_backend(
        cuda_available=False, master_addr="localhost", sys_root=fake_sys(tmp_path), environ={}
    )
    assert single.env == {"GLOO_SOCKET_IFNAME": "lo"} and "every node" not in single.reason


def _non_loopback_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.123", 9))  # TEST-NET-1: routing only, nothing is sent
        except OSError:
            pytest.skip("no IPv4 route off this host")
        address = sock.getsockname()[0]
    if address.startswith("127."):
        pytest.skip("no non-loopback IPv4 address")
    return address


def test_route_to_real_interface(tmp_path: Path) -> None:
    """The interface holding this host's own address, as `ip -o addr` reports it."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2 not installed")
    address = _non_loopback_address()
    owner = next(
        line.split()[1]
        for line in subprocess.run(
            ["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True
        ).stdout.splitlines()
        if line.split()[3].split("/")[0] == address
    )
    assert route_to(address) == (address, owner)
    choice = choose_backend(
        cuda_available=False,
        master_addr=address,
        num_nodes=2,
        sys_root=fake_sys(tmp_path),
        environ={},
    )
    assert choice.env == {"GLOO_SOCKET_IFNAME": owner} and owner != "lo"


def test_user_settings_are_never_overridden(tmp_path: Path) -> None:
    environ = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "^docker0,lo"}
    choice = choose_backend(
        cuda_available=True, master_addr="127.0.0.1", sys_root=fake_sys(tmp_path), environ=environ
    )
    assert choice.env == {}
    assert "kept your GLOO_SOCKET_IFNAME=lo, NCCL_SOCKET_IFNAME=^docker0,lo" in choice.reason


@pytest.mark.parametrize("value", ["^lo,docker0", ""])
def test_gloo_ifname_must_be_one_interface(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match="GLOO_SOCKET_IFNAME") as err:
        choose_backend(
            cuda_available=False, sys_root=fake_sys(tmp_path), environ={"GLOO_SOCKET_IFNAME": value}
        )
    assert "concrete interface" in (err.value.hint or "")


def test_gloo_ifname_lo_refused_across_hosts(tmp_path: Path) -> None:
    address = _non_loopback_address()
    with pytest.raises(ConfigError, match="spanning hosts"):
        choose_backend(
            cuda_available=False,
            master_addr=address,
            num_nodes=2,
            sys_root=fake_sys(tmp_path),
            environ={"GLOO_SOCKET_IFNAME": "lo"},
        )


def test_unresolvable_master_is_reported_not_fatal(tmp_path: Path) -> None:
    choice = choose_backend(
        cuda_available=False,
        master_addr="no-such-host.invalid",
        sys_root=fake_sys(tmp_path),
        environ={},
    )
    assert choice.interface is None and choice.env == {}
    assert "cannot route to master no-such-host.invalid" in choice.reason


def test_dist_env_supplies_master_and_nodes(tmp_path: Path) -> None:
    """dist.init_distributed passes the DistEnv itself."""
    from hpc_ddp.cluster.distenv import DistEnv

    two = DistEnv("slurm", 1, 1, 4, 2, 0, 2, "127.0.0.1", 20001, "1")
    choice = choose_backend(cuda_available=False, env=two, sys_root=fake_sys(tmp_path), environ={})
    assert choice.interface == "lo" and "every node must be this host" in choice.reason
    one = DistEnv("single", 0, 0, 1, 1, 0, 1, "127.0.0.1", 20001, None)
    assert (
        choose_backend(cuda_available=False, env=one, sys_root=fake_sys(tmp_path), environ={}).env
        == {}
    )
