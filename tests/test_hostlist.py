"""Host list and tasks-per-node expansion, checked against the real `scontrol show hostnames`."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from hpc_ddp.cluster.hostlist import MAX_HOSTS, expand_hostlist, expand_tasks_per_node
from hpc_ddp.errors import LaunchEnvError

# (list, expansion). Every row whose third item is True was compared with the output of
# `scontrol show hostnames` from Debian's slurm-wlm 22.05.8 (see test_matches_scontrol).
EXPANSIONS = [
    ("gpu-a[001-004,010]", ["gpu-a001", "gpu-a002", "gpu-a003", "gpu-a004", "gpu-a010"], True),
    ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"], True),
    ("x-y-z[09-11],b", ["x-y-z09", "x-y-z10", "x-y-z11", "b"], True),
    ("n[3,1,2]", ["n3", "n1", "n2"], True),  # written order, not sorted
    ("n[1-2],n1", ["n1", "n2", "n1"], True),  # duplicates kept
    ("foo", ["foo"], True),
    ("c[1-2]-[3-4]", ["c1-3", "c1-4", "c2-3", "c2-4"], True),
    ("a[01-3]", ["a01", "a02", "a03"], True),
    ("a[1-03]", ["a1", "a2", "a3"], True),
    ("n[0]", ["n0"], True),
    ("a,,b", ["a", "b"], True),
    ("a b", ["a", "b"], True),
    ("n[007-010]", ["n007", "n008", "n009", "n010"], True),
    ("n[08-12]", ["n08", "n09", "n10", "n11", "n12"], True),
    ("n[1-1]", ["n1"], True),
    ("[1-2]", ["1", "2"], True),
    ("n[001-2]", ["n001", "n002"], True),
    ("n[1-2]-ib[1-2]", ["n1-ib1", "n1-ib2", "n2-ib1", "n2-ib2"], True),
    ("a[1-2],b[3-4]c[5-6]", ["a1", "a2", "b3c5", "b3c6", "b4c5", "b4c6"], True),
    (
        "n[1-2,5-6]-gpu[1-2]",
        [f"n{n}-gpu{g}" for n in (1, 2, 5, 6) for g in (1, 2)],
        True,
    ),
    # Slurm 22.05 refuses text after the last bracket; newer Slurm and ClusterShell accept it.
    ("node[1-2]-ib,login[1,3-4]", ["node1-ib", "node2-ib", "login1", "login3", "login4"], False),
    ("nodes[9-11]x", ["nodes9x", "nodes10x", "nodes11x"], False),
]

INVALID = ["n[2-1]", "n[a-b]", "n[1,]", "n[]", "n[1-2", "n[1-2]]", "n[[1]]", "", "  ", "n[1-2-3]"]
# Hostile: other scripts' digits (int() reads '١' as 1), a control character, a non-ASCII
# letter, shell syntax, a number too long for Slurm (and for int() past 4300 digits).
INVALID += [
    "n[\u0661-\u0663]",
    "a\x1bb",
    "n\u00f6de",
    "n;rm",
    "n[1-" + "9" * 5000 + "]",
]

# Lists checked against scontrol's own output only (test_matches_scontrol_output): names with
# three or more bracket groups, whose order is Slurm's own, and whitespace separators, which
# is how `scontrol show hostnames` prints a list.
SCONTROL_ONLY = [
    "a[1-2]b[3-4]c[5-6]",
    "a[1-2]b[1-2]c[1-2]d[1-2]",
    "a[1-2]b[1-2]c[1-2]d[1-2]e[1-2]",
    "a[1-3]b[1-2]c[1-2]",
    "a[1,3]b[1-2]c[5,7-8]",
    "n[01-02]x[1-3]y[08-10]",
    "[1-2][3-4][5-6]",
    "x[1-2]y[1-2]z[1-2],a[1-2]b[3-4]c[5-6]",
    "a\tb\nc",
    # (22.05's scontrol refuses a newline right after a name of three groups; a space works.)
    "n[1-2] m[3-4]\tk[5-6]y[1-2]z[1-3] last\nfin",
]


@pytest.mark.parametrize(("text", "hosts", "_"), EXPANSIONS)
def test_expand(text: str, hosts: list[str], _: bool) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", INVALID)
def test_invalid_lists_are_clear_errors(text: str) -> None:
    with pytest.raises(LaunchEnvError) as err:
        expand_hostlist(text)
    assert "cannot parse host list" in err.value.message
    assert err.value.hint


def test_huge_range_is_refused_not_expanded() -> None:
    with pytest.raises(LaunchEnvError, match="more than"):
        expand_hostlist("n[1-99999999]")


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "text",
    [
        "n[0-99999][0-99999][0-99999]",  # 10**15 names: counted, never built
        "n[0-9]" * 40,  # 10**40
        ",".join(f"p{i}[0-999]" for i in range(70)),  # 70 parts of 1000: the TOTAL is capped
        "n[0-65535],m",  # one past the cap
    ],
)
def test_sizes_are_counted_before_expanding_and_the_total_is_capped(text: str) -> None:
    started = time.process_time()
    with pytest.raises(LaunchEnvError, match=f"more than {MAX_HOSTS} hosts") as err:
        expand_hostlist(text)
    assert time.process_time() - started < 0.1
    assert err.value.hint


def test_the_cap_is_on_the_whole_list() -> None:
    """Parts that are each small but together too many are refused; exactly the cap is not."""
    hosts = expand_hostlist("n[1-65535],m")
    assert len(hosts) == MAX_HOSTS and hosts[0] == "n1" and hosts[-1] == "m"
    with pytest.raises(LaunchEnvError, match="more than"):
        expand_hostlist("n[1-65535],m,o")


def test_whitespace_separates_hosts() -> None:
    """What `scontrol show hostnames` prints (one per line), and tabs, are several hosts."""
    assert expand_hostlist("node1\nnode2\tnode[3-4] node5,\n") == [f"node{i}" for i in range(1, 6)]


Scontrol = tuple[str, dict[str, str]]


@pytest.fixture(scope="module")
def scontrol(tmp_path_factory: pytest.TempPathFactory) -> Scontrol:
    """scontrol expands host lists without a running cluster; it only needs a parsable config."""
    exe = shutil.which("scontrol")
    if exe is None:
        pytest.skip("scontrol (slurm-wlm) is not installed")
    conf = tmp_path_factory.mktemp("slurmconf") / "slurm.conf"
    conf.write_text(
        "ClusterName=hl\nSlurmctldHost=localhost\nNodeName=n1\nPartitionName=p Nodes=n1\n"
    )
    return exe, {"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"}


@pytest.mark.parametrize(("text", "hosts"), [(t, h) for t, h, real in EXPANSIONS if real])
def test_matches_scontrol(scontrol: Scontrol, text: str, hosts: list[str]) -> None:
    exe, env = scontrol
    out = subprocess.run(
        [exe, "show", "hostnames", text], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == hosts == expand_hostlist(text)


@pytest.mark.parametrize("text", SCONTROL_ONLY)
def test_matches_scontrol_output(scontrol: Scontrol, text: str) -> None:
    """Slurm's order for three or more bracket groups (last group fastest, then the first,
    then the others left to right), and whitespace as a separator, as the real tool does."""
    exe, env = scontrol
    out = subprocess.run(
        [exe, "show", "hostnames", text], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.splitlines() == expand_hostlist(text)


@pytest.mark.parametrize("text", ["n[2-1]", "n[a-b]", "n[1,]", "n[]", "n[1-2]]"])
def test_scontrol_also_refuses(scontrol: Scontrol, text: str) -> None:
    exe, env = scontrol
    out = subprocess.run([exe, "show", "hostnames", text], env=env, capture_output=True, text=True)
    assert "Invalid hostlist" in out.stdout + out.stderr


@pytest.mark.parametrize(
    ("text", "counts"),
    [
        ("2", [2]),
        ("2(x3),1", [2, 2, 2, 1]),
        ("4,1(x3)", [4, 1, 1, 1]),
        ("1(x2)", [1, 1]),
        ("8(x1)", [8]),
        ("3,2,1", [3, 2, 1]),
    ],
)
def test_tasks_per_node(text: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize(
    "text", ["", "x", "2(x)", "2(3)", "2(x0)", "-1", "2(x3)1", "2,,1", "\u0662", "2(x\u0663)"]
)
def test_tasks_per_node_invalid(text: str) -> None:
    with pytest.raises(LaunchEnvError, match="tasks-per-node") as err:
        expand_tasks_per_node(text)
    assert err.value.hint


@pytest.mark.timeout(10)
def test_tasks_per_node_repeats_are_counted_before_expanding() -> None:
    """One entry per node: a repeat count of a billion would fill memory if built first."""
    started = time.process_time()
    with pytest.raises(LaunchEnvError, match=f"more than {MAX_HOSTS}") as err:
        expand_tasks_per_node("2(x999999999),1")
    assert time.process_time() - started < 0.1
    assert err.value.hint
