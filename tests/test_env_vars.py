"""The HPC_DDP_* variables have one owner (hpc_ddp/env_vars.py), and what every launcher writes
through it is what the reader (hpc_ddp.cluster.launch_contract, detect_env) understands.

The writers run for real: spawn's forked workers, and `hpc-ddp launch pdsh --mode processes`
(its host script's exports, then the node agent's children) with pdsh's exec worker standing in
for a second host, which cannot exist here (see launch_support).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launch_support import Launch, hpc_ddp, json_by_host, launch_args

from hpc_ddp import env_vars
from hpc_ddp.deploy.submission_env import submission_env

REPO = Path(__file__).resolve().parents[1]
NAME = re.compile(r"HPC_DDP_[A-Z0-9_]*[A-Z0-9]")
KNOWN = set(env_vars.LAUNCH_VARS) | set(env_vars.JOB_SHELL_VARS) | set(env_vars.SETTINGS_VARS)


def _spellings(path: Path) -> set[str]:
    return set(NAME.findall(path.read_text()))


def test_only_the_owner_module_spells_the_names() -> None:
    """Code, comments, help texts and messages elsewhere use the owner's constants."""
    owner = REPO / "hpc_ddp" / "env_vars.py"
    found = {
        str(path.relative_to(REPO)): names
        for path in sorted((REPO / "hpc_ddp").rglob("*.py"))
        if path != owner and (names := _spellings(path))
    }
    assert not found, found


def test_templates_and_docs_name_only_real_variables() -> None:
    """The torchrun template exports the rendezvous endpoint and Slurm's process tracking itself
    (its batch shell computes them); it, the docs, the README and the install script must spell
    the owner's names, not near misses."""
    for path in [
        *(REPO / "templates").glob("*.j2"),
        *(REPO / "docs").glob("*.md"),
        REPO / "README.md",
    ]:
        assert _spellings(path) <= KNOWN, path
    assert _spellings(REPO / "scripts" / "install.sh") == {env_vars.TORCH_CPU_INDEX_VAR}
    assert _spellings(REPO / "templates" / "torchrun.sbatch.j2") == {
        env_vars.RDZV_ENDPOINT_VAR,
        env_vars.PROCTRACK_VAR,
    }


def test_a_submission_drops_the_launch_contract_and_keeps_the_settings() -> None:
    inside = {name: "1" for name in KNOWN} | {"PATH": "/usr/bin"}
    assert set(submission_env(inside)) == {"PATH", *env_vars.SETTINGS_VARS}


def test_the_writer_writes_only_what_it_is_given_in_one_order() -> None:
    assert env_vars.launch_environ() == {}
    written = env_vars.launch_environ(master_port=29500, started_by="pdsh", node_rank="%n")
    assert list(written.items()) == [
        (env_vars.STARTED_BY_VAR, "pdsh"),
        (env_vars.NODE_RANK_VAR, "%n"),
        (env_vars.MASTER_PORT_VAR, "29500"),
    ]
    with pytest.raises(ValueError, match="ssh"):
        env_vars.launch_environ(started_by="ssh")  # type: ignore[arg-type]


# --- every writer satisfies the reader ----------------------------------------------------
SPAWN = """
import json, os, sys
from hpc_ddp.cluster import detect_env
from hpc_ddp.spawn import launch

def worker():
    env = detect_env()  # what the trainer does: gpus_per_process from the launcher
    path = os.path.join(sys.argv[1], f"{env.rank}.json")
    with open(path, "w") as fh:
        json.dump(env.to_json(), fh)
    os._exit(0)

given = int(sys.argv[2]) or None  # 0: not given
sys.exit(launch(worker, 2, gpus_per_process=given))
"""


def _clean_env(**extra: str) -> dict[str, str]:
    keep = ("PATH", "HOME", "PYTHONPATH", "LANG")
    return {k: v for k, v in os.environ.items() if k in keep} | extra


@pytest.mark.parametrize(
    ("given", "exported"),
    [("2", {}), ("0", {env_vars.GPUS_PER_PROCESS_VAR: "2"})],
    ids=["argument", "environment"],
)
def test_spawned_workers_read_the_parents_layout(
    tmp_path: Path, given: str, exported: dict[str, str]
) -> None:
    """2 workers of 2 GPUs each on a node showing 4 (CUDA_VISIBLE_DEVICES: no GPU exists here,
    and none is touched): each worker's own detect_env finds the spawn launcher and the
    gpus_per_process of its parent, given as an argument or by the environment, so it takes its
    own pair of GPUs."""
    proc = subprocess.run(
        [sys.executable, "-c", SPAWN, str(tmp_path), given],
        env=_clean_env(CUDA_VISIBLE_DEVICES="0,1,2,3", **exported),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    envs = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert [e["source"] for e in envs] == ["spawn", "spawn"]
    assert [e["gpus_per_process"] for e in envs] == [2, 2]
    assert [e["gpus"] for e in envs] == [[0, 1], [2, 3]]
    assert {e["world_size"] for e in envs} == {2}


def test_host_script_and_node_agent_children_read_their_places(
    tmp_path: Path, launches: list[Launch]
) -> None:
    """The host script's exports plus the node agent's local rank: every process finds the
    pdsh launcher, its rank and the gpus_per_process of the launch."""
    launch = launch_args("pdsh", tmp_path, gpus_per_node=4, extra=("--gpus-per-process", "2"))
    launches.append(launch)
    res = hpc_ddp([*launch.base, "--", "hpc-ddp", "env", "--json"])
    assert res.returncode == 0, res.stderr
    envs = [env for host_envs in json_by_host(res.stdout).values() for env in host_envs]
    assert sorted(e["rank"] for e in envs) == [0, 1, 2, 3]
    for env in envs:
        assert (env["source"], env["world_size"], env["gpus_per_process"]) == ("pdsh", 4, 2)
        assert env["rank"] == env["node_rank"] * 2 + env["local_rank"]
        assert env["job_id"] == launch.launch_id
