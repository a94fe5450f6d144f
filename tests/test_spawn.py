"""``hpc-ddp train --nproc-per-node N``: forked workers, supervised (hpc_ddp.spawn).

Real processes throughout: real fork, real signals, real Gloo ranks training with the project's
trainer, compared bit for bit with real torchrun. Waits poll files with deadlines.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trainer_helpers import (
    HPC_DDP,
    finish,
    forked_cmd,
    holding,
    interrupt_at,
    job_env,
    read_json,
    read_result,
    run,
    start,
    torchrun_cmd,
    train_args,
    wait_for_progress,
)

from hpc_ddp.env_vars import MAX_NPROC_VAR
from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.localslurm import wait_for
from hpc_ddp.spawn import CPU_WORKERS_PER_CORE, check_can_spawn, usable_cores

WORKER = Path(__file__).parent / "workers" / "spawn_worker.py"


def gone(pid: int) -> bool:
    """The process no longer runs (exited, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def run_worker(mode: str, nproc: int, out: Path, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), mode, str(nproc), str(out)],
        env=job_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# ------------------------------------------------------------------- supervision, torch-free
@pytest.mark.parametrize(
    ("codes", "expected"),
    [("0,0,0", 0), ("75,75,75", 75), ("65,65,65", 65), ("0,3,0", 3), ("75,1,75", 1)],
)
def test_the_job_exits_with_the_failed_workers_code(
    tmp_path: Path, codes: str, expected: int
) -> None:
    """75 (requeue) and 65 (diverged) are exits the ranks agree on: no rank failed, and none
    is stopped as a failed rank's peer."""
    proc = run_worker(f"codes:{codes}", 3, tmp_path)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == expected, err
    if expected not in (0, 75, 65):
        assert f"exited with code {expected}" in err
        return  # the others were stopped, maybe before they wrote their files
    assert "stopping the other" not in err, err
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text())["env"] for r in range(3)]
    assert [s["RANK"] for s in seen] == ["0", "1", "2"]
    assert {s["WORLD_SIZE"] for s in seen} == {"3"}
    assert {s["HPC_DDP_STARTED_BY"] for s in seen} == {"spawn"}
    assert len({s["MASTER_PORT"] for s in seen}) == 1  # one rendezvous port for all


def test_signals_to_the_parent_reach_every_worker(tmp_path: Path) -> None:
    proc = run_worker("signal", 2, tmp_path)
    wait_for(lambda: all((tmp_path / f"ready{r}").exists() for r in (0, 1)), 60, "workers up")
    proc.send_signal(signal.SIGUSR1)  # only the parent: as Slurm's B:USR1 or `kill <pid>`
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err  # both workers got it (one missing would exit 1)


@pytest.mark.parametrize("after_usr1", [False, True], ids=["alone", "after-a-forwarded-usr1"])
def test_a_failed_worker_stops_the_others(tmp_path: Path, after_usr1: bool) -> None:
    """Rank 1 exits 3; the others get SIGTERM at once. Also when every worker had got a SIGUSR1
    from the parent and gone on: the others are left to leave by themselves only when the worker
    left on the signal forwarded to all (tests/test_ctrl_c.py), and exit 3 is its own failure."""
    started = time.monotonic()
    proc = run_worker(
        "usr1-then-hang-unless-term" if after_usr1 else "hang-unless-term", 3, tmp_path
    )
    if after_usr1:
        wait_for(lambda: all((tmp_path / f"ready{r}").exists() for r in range(3)), 60, "workers up")
        proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert "rank 1 (pid" in err and "stopping the other 2 worker(s)" in err, err
    assert time.monotonic() - started < 30  # SIGTERM at once, not the workers' 60 s wait
    for rank in (0, 2):
        assert gone(json.loads((tmp_path / f"rank{rank}.json").read_text())["pid"])


def test_refused_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="already rank 1 of 2 started by torchrun"):
        env = {
            "TORCHELASTIC_RUN_ID": "x",
            "RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
        }
        check_can_spawn(2, 1, {**env, "MASTER_ADDR": "h", "MASTER_PORT": "29500"})
    with pytest.raises(ConfigError, match="needs 4 GPUs, but 2 are visible"):
        check_can_spawn(2, 2, {"CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(ConfigError, match="must be at least 1"):
        check_can_spawn(0, 1, {})
    check_can_spawn(2, 1, {"CUDA_VISIBLE_DEVICES": "0,1"})  # fits: no error


def test_more_workers_than_the_machine_runs_are_refused_naming_limit_and_override() -> None:
    """Without GPUs, N is bounded by the usable cores (CPU_WORKERS_PER_CORE each), which
    HPC_DDP_MAX_NPROC overrides; always by the descriptors the parent may open."""
    limit = CPU_WORKERS_PER_CORE * usable_cores()
    with pytest.raises(ConfigError, match=rf"more workers .* \(at most {limit}: ") as refused:
        check_can_spawn(limit + 1, 1, {})
    assert MAX_NPROC_VAR in (refused.value.hint or ""), refused.value.hint
    check_can_spawn(limit, 1, {})  # fits: no error
    check_can_spawn(limit + 1, 1, {MAX_NPROC_VAR: str(limit + 1)})  # the override
    with pytest.raises(ConfigError, match=rf"at most 3: {MAX_NPROC_VAR}=3"):
        check_can_spawn(4, 1, {MAX_NPROC_VAR: "3"})
    for bad in ("0", "x", "+8", "٣"):
        with pytest.raises(HpcDdpError, match=MAX_NPROC_VAR):
            check_can_spawn(2, 1, {MAX_NPROC_VAR: bad})
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        with pytest.raises(ConfigError, match="may open only 256") as refused:
            check_can_spawn(300, 1, {MAX_NPROC_VAR: "1000"})
        assert "ulimit -n" in (refused.value.hint or "")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_cli_refuses_too_many_cpu_workers_before_any_starts(
    tmp_path: Path, data_dir: Path
) -> None:
    nproc = CPU_WORKERS_PER_CORE * usable_cores() + 1
    run_dir = tmp_path / "r"
    started = time.monotonic()
    done = subprocess.run(
        [HPC_DDP, "train", "--nproc-per-node", str(nproc), *train_args(run_dir, data_dir)],
        env=job_env(CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert f"--nproc-per-node {nproc}: more workers than this machine" in done.stderr
    assert f"HINT: use --nproc-per-node {nproc - 1} or fewer" in done.stderr, done.stderr
    assert MAX_NPROC_VAR in done.stderr and "Traceback" not in done.stderr
    assert not run_dir.exists()  # no worker ever ran
    assert time.monotonic() - started < 60


def test_a_signal_while_forking_stops_the_forking_and_the_job(tmp_path: Path) -> None:
    """SIGTERM (a time limit, `timeout`) while the parent forks 500 workers: it is not held
    back until all are forked. Rank 0 sends it at once; the parent forwards it to the workers
    forked so far, forks no more, and the job ends with 143 in seconds."""
    proc = run_worker("term-parent", 500, tmp_path, **{MAX_NPROC_VAR: "500"})
    started = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert time.monotonic() - started < 30
    forked = re.search(r"got SIGTERM while starting the workers: started (\d+) of 500", err)
    assert forked and int(forked[1]) < 500, err
    pids = [json.loads(f.read_text())["pid"] for f in tmp_path.glob("rank*.json")]
    assert len(pids) <= int(forked[1]) and all(gone(pid) for pid in pids)


def test_more_than_1024_workers_are_supervised(tmp_path: Path) -> None:
    """select() cannot watch a descriptor above 1023, and a parent of 1100 workers holds
    pidfds past it (it crashed there); the workers exit at once."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit on open files ({hard}) is below what 1100 workers need")
    proc = run_worker("codes:" + ",".join(["0"] * 1100), 1100, tmp_path, **{MAX_NPROC_VAR: "1100"})
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-2000:]
    assert len(list(tmp_path.glob("rank*.json"))) == 1100


def test_the_cli_refuses_with_exit_2_and_a_hint(tmp_path: Path) -> None:
    done = subprocess.run(
        [HPC_DDP, "train", "--nproc-per-node", "3", "--run-dir", str(tmp_path / "r")],
        env=job_env(CUDA_VISIBLE_DEVICES="0,1"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "needs 3 GPUs, but 2 are visible" in done.stderr and "--nproc-per-node 2" in done.stderr


# ------------------------------------------------------------------- the trainer, forked
def spawn_cmd(nproc: int, args: list[str]) -> list[str]:
    """``forked_cmd`` in an interpreter of its own, not forked from the tests' fork server:
    here the launcher is what is tested, from its own start (its imports, then the forks)."""
    return list(forked_cmd(nproc, args))


@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """The uninterrupted run under torchrun, what the forked workers must end equal to (not
    ``reference_run``: that one forks, to save the other tests CPU time, on the strength of
    this very comparison)."""
    run_dir = tmp_path_factory.mktemp("spawn_ref") / "run"
    done = run(torchrun_cmd(2, train_args(run_dir, data_dir)))
    assert done.returncode == 0, done.stderr
    return run_dir


def test_forked_ranks_preempt_resume_and_match_torchrun_bit_for_bit(
    tmp_path: Path, data_dir: Path, torchrun_reference: Path
) -> None:
    run_dir = tmp_path / "run"
    args = train_args(run_dir, data_dir)
    rc, log = interrupt_at(
        spawn_cmd(2, [*args, "--debug-hold-at-step", "5"]),
        run_dir,
        tmp_path / "1.log",
        launcher=True,  # SIGUSR1 to the parent only: it forwards to both workers
    )
    assert rc == 75, log
    assert "2 process(es)" in log and "preempted (SIGUSR1): checkpointed at step 5" in log, log
    assert read_json(run_dir / "progress.json")["status"] == "preempted"

    final = run(spawn_cmd(2, args))
    assert final.returncode == 0, final.stderr
    result, reference = read_result(run_dir), read_result(torchrun_reference)
    assert result["interruptions"] == 1 and result["world_size"] == 2
    assert result["params_sha256"] == reference["params_sha256"]


def test_a_killed_rank_ends_the_job_and_the_parents_death_ends_the_workers(
    tmp_path: Path, data_dir: Path
) -> None:
    # 1. SIGKILL one rank: the parent names it, stops the other, exits 128 + 9.
    run_dir = tmp_path / "run"
    log = tmp_path / "killed.log"
    proc = start(spawn_cmd(2, [*train_args(run_dir, data_dir), "--debug-hold-at-step", "3"]), log)
    try:
        progress = wait_for_progress(run_dir, holding, proc)
        os.kill(progress["pids"][1], signal.SIGKILL)
        rc, text = finish(proc, log, timeout=60)
    finally:
        proc.kill()
    assert rc == 137 and "rank 1 (pid" in text and "was killed by SIGKILL" in text, text
    wait_for(lambda: gone(progress["pids"][0]), 30, "rank 0 stopped")
    assert not (run_dir / "result.json").exists()

    # 2. SIGKILL the parent (no handler can run): the workers die with it (PR_SET_PDEATHSIG).
    run_dir = tmp_path / "run2"
    proc = start(spawn_cmd(2, [*train_args(run_dir, data_dir), "--debug-hold-at-step", "3"]), log)
    pids: list[int] = []
    try:
        pids = wait_for_progress(run_dir, holding, proc)["pids"]
        proc.kill()
        proc.wait(timeout=30)
        wait_for(lambda: all(gone(p) for p in pids), 30, "orphaned workers gone")
    finally:
        proc.kill()
        for pid in pids:  # only if the assertion above failed: leave nothing behind
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
