"""Container jobs on the real local Slurm cluster, through stand-in container runtimes.

Neither apptainer nor pyxis/enroot can be installed here, so two stand-ins take their place,
first on the job's PATH: ``apptainer`` (the command) and an ``srun`` wrapper that takes pyxis's
``--container-*`` options off before calling the real srun. Each records the argv it got and runs
the command it wraps, as a runtime would, but in the host's file system, with a PATH that
holds no ``scontrol``: many images have none, and that is what the batch-shell requeue is for.
What is real: slurmctld + 2 slurmd, sbatch, srun, the preemption signal, ``scontrol requeue``
from the batch shell, the restart, Gloo training and its bit-exact resume.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
from pathlib import Path

import pytest
from deploy_support import (
    progress_status,
    read_result,
    reference_run_fixture,  # noqa: F401  (the reference_run fixture)
    submit_spec,
    train_spec,
)

from hpc_ddp.deploy.container import ContainerSpec
from hpc_ddp.deploy.job_control import run_dir_report
from hpc_ddp.deploy.sbatch.submit import wait_job
from hpc_ddp.localslurm import wait_for
from hpc_ddp.slurm_client import TERMINAL

pytestmark = pytest.mark.slurm

IMAGE = "/images/train.sif"

APPTAINER = """#!/bin/bash
# Stand-in for apptainer: record the argv, then run the command as `apptainer exec` would,
# minus the image: in the host's file system, with the image's PATH (no scontrol there).
printf 'apptainer %s\\n' "$*" >> "$STANDIN_LOG"
[ "$1" = exec ] || { echo "stand-in apptainer: only exec" >&2; exit 64; }
shift
while [ $# -gt 0 ]; do
  case "$1" in
    --nv) shift ;;
    --bind) shift 2 ;;
    --pwd) cd "$2" || exit 65; shift 2 ;;
    -*) echo "stand-in apptainer: unknown option $1" >&2; exit 64 ;;
    *) break ;;
  esac
done
[ "$1" = "$STANDIN_IMAGE" ] || { echo "stand-in apptainer: image $1" >&2; exit 66; }
shift
exec /usr/bin/env PATH="$STANDIN_PATH" "$@"
"""

PYXIS_SRUN = """#!/bin/bash
# Stand-in for srun with the pyxis plugin: record the --container-* options, take them off and
# run the task's command through the real srun with the image's PATH (no scontrol there).
opts=(); pyxis=()
while [ $# -gt 0 ]; do
  case "$1" in
    --container-*) pyxis+=("$1") ;;
    -*) opts+=("$1") ;;
    *) break ;;
  esac
  shift
done
if [ ${#pyxis[@]} -eq 0 ]; then exec "$REAL_SRUN" "${opts[@]}" "$@"; fi
printf 'srun %s -- %s\\n' "${pyxis[*]}" "$*" >> "$STANDIN_LOG"
exec "$REAL_SRUN" "${opts[@]}" /usr/bin/env PATH="$STANDIN_PATH" "$@"
"""


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _standin_env(tmp_path: Path, base: dict[str, str]) -> dict[str, str]:
    """The job's environment: the stand-ins first on PATH, and the "image"'s PATH: the venv's
    bin dir (python, torchrun) plus the few tools a task shell uses, without scontrol."""
    tools = tmp_path / "standins"
    image_bin = tmp_path / "image-bin"
    tools.mkdir()
    image_bin.mkdir()
    _executable(tools / "apptainer", APPTAINER)
    _executable(tools / "srun", PYXIS_SRUN)
    for tool in ("bash", "grep", "pgrep", "pkill", "cat", "sleep", "mkdir"):
        found = shutil.which(tool, path=base["PATH"])
        assert found, tool
        (image_bin / tool).symlink_to(found)
    venv_bin = Path(shutil.which("python", path=base["PATH"]) or "").parent
    assert not (venv_bin / "scontrol").exists()
    return {
        **base,
        "PATH": f"{tools}{os.pathsep}{base['PATH']}",
        "REAL_SRUN": shutil.which("srun", path=base["PATH"]) or "srun",
        "STANDIN_LOG": str(tmp_path / "runtime-argv.log"),
        "STANDIN_IMAGE": IMAGE,
        "STANDIN_PATH": f"{venv_bin}{os.pathsep}{image_bin}",
    }


@pytest.mark.slow
def test_container_jobs_run_and_the_batch_shell_requeues_them(
    slurm_cluster, reference_run, tmp_path: Path
) -> None:
    """Two jobs at once, per-process srun, each in a container stand-in:

    * apptainer, preempted at step 3 with USR1 to the step's tasks (``scancel --signal=USR1``,
      what ``--signal=USR1@N`` does): the ranks agree, checkpoint and all exit 75. Inside the
      "container" there is no scontrol, and rendered srun jobs leave the requeue to the batch
      shell anyway: on the step's 75 it runs ``scontrol requeue`` on the host. The job comes
      back with SLURM_RESTART_COUNT=1, resumes, and ends with the uninterrupted reference's
      weights; the run dir alone then names the job and its restart. On the code before the
      batch-shell requeue the step's 75 ended the job (FAILED, never requeued). The srun
      layout's one preemption test of the trainer: the host-side path is the same template
      minus the ``apptainer exec`` prefix (test_example_script.py runs it with a user's script).
    * pyxis, uninterrupted: its tasks run under srun's --container-* options and end with the
      reference's weights. Its preemption would take the apptainer job's path: the step's 75,
      then the same batch shell on the host."""
    env = _standin_env(tmp_path, slurm_cluster.env)
    jobs = {}
    for runtime, hold in (("apptainer", ["--debug-hold-at-step", "3"]), ("pyxis", [])):
        cwd = tmp_path / runtime
        cwd.mkdir()
        container = ContainerSpec(runtime=runtime, image=IMAGE, mounts=["/tmp:/scratch:ro"])
        spec = train_spec(f"ctr-{runtime}", container=container)
        spec = spec.replace(args=[*spec.args, *hold])
        jobs[runtime] = (cwd, *submit_spec(spec, cwd, env))
    cwd, job_id, _ = jobs["apptainer"]
    wait_for(lambda: progress_status(cwd / "run") == "holding", 120, "apptainer hold")
    slurm_cluster.run(["scancel", "--signal=USR1", job_id])
    states: dict[str, list[str]] = {job_id: [] for _, job_id, _ in jobs.values()}

    def all_ended() -> bool:
        for job_id, seen in states.items():
            seen.append(slurm_cluster.job_state(job_id))
        return all(seen[-1] in TERMINAL for seen in states.values())

    wait_for(all_ended, 180, "both container jobs to finish", interval_s=0.2)
    reference = read_result(reference_run[0] / "run")["params_sha256"]
    for runtime, (cwd, job_id, out) in jobs.items():
        done = wait_job(job_id, env, timeout_s=10, output=out)
        log = out.read_text()
        if runtime == "pyxis":
            assert (done.state, done.exit_code, done.restarts) == ("COMPLETED", 0, 0), log
            assert read_result(cwd / "run")["params_sha256"] == reference
            continue
        assert "PENDING" in states[job_id], states[job_id]
        assert (done.state, done.exit_code, done.restarts) == ("COMPLETED", 0, 1), log
        assert f"job {job_id} restart 0 " in log and f"job {job_id} restart 1 " in log
        assert f"step exited 75 (checkpointed): requeueing job {job_id}" in log, log
        assert "batch script, which requeues the job" in log, log  # the trainer left it there
        assert "resumed from" in log, log
        result = read_result(cwd / "run")
        assert (result["interruptions"], result["world_size"]) == (1, 4)
        assert result["params_sha256"] == reference
        # What the run dir alone says (`hpc-ddp status RUN_DIR` once Slurm forgot the job): its
        # job, and the restart that wrote progress.json last.
        report = run_dir_report(cwd / "run")
        assert (report.job_id, report.restarts, report.state) == (job_id, 1, "ENDED"), report
    calls = Path(env["STANDIN_LOG"]).read_text().splitlines()
    apptainer = [c for c in calls if c.startswith("apptainer ")]
    pyxis = [c for c in calls if c.startswith("srun ")]
    exec_head = f"apptainer exec --bind /tmp:/scratch:ro {IMAGE} "
    # 4 tasks x (preflight + training) x 2 runs, every one in the image
    assert len(apptainer) == 16, calls
    assert all(c.startswith(exec_head) for c in apptainer), apptainer
    assert sum("-m hpc_ddp.deploy.preflight" in c for c in apptainer) == 8
    assert sum("-u -m hpc_ddp.train" in c for c in apptainer) == 8
    pyxis_head = f"srun --container-image={IMAGE} --container-mounts=/tmp:/scratch:ro -- "
    # one run: the preflight step and the training step
    assert len(pyxis) == 2 and all(c.startswith(pyxis_head) for c in pyxis), pyxis


@pytest.mark.slow
def test_torchrun_in_the_image_is_requeued_by_the_batch_shell_after_a_checkpoint_only(
    slurm_cluster, reference_run, tmp_path: Path
) -> None:
    """torchrun layout, two jobs at once, each in the apptainer stand-in, holding at step 3:

    * ``preempted``: USR1 to the batch shell only (``scancel --batch``, what
      ``--signal=B:USR1@N`` does), which the template forwards to the tasks; torchrun ignores
      it, its workers checkpoint and exit 75, which torchrun reports as 1; rank 0 (no scontrol
      in the image) left the requeue marker in the run dir, so the batch shell on the host
      requeues. The job resumes and ends with the uninterrupted reference's weights. On the
      code before the marker no one could requeue: the job ended FAILED after its first run.
      (The torchrun layout's preemption test; the apptainer job above is the srun layout's.)
    * ``crashed``, on one node: one worker dies (SIGKILL, as the OOM killer does) and torchrun
      stops the other with SIGTERM, which the trainer takes for a preemption signal; but no
      checkpoint can commit without the dead rank, so there is no marker and the job ends
      FAILED, never requeued (an exit-code-only rule, "torchrun's 1 means requeue", would loop
      here).

    The host's task shell starts ``apptainer exec IMAGE torchrun ...`` on each node; the batch
    shell gets the rendezvous port from the image's python."""
    jobs = {}
    for case in ("preempted", "crashed"):
        cwd = tmp_path / case
        cwd.mkdir()
        env = {**_standin_env(cwd, slurm_cluster.env), "STANDIN_LOG": str(cwd / "argv.log")}
        # The crash needs one node: its step then always ends with torchrun's 1 (on two, srun's
        # --kill-on-bad-exit can make it 143), the code an exit-code-only rule would requeue.
        spec = train_spec(
            f"ctr-torchrun-{case}",
            launcher="torchrun",
            container=ContainerSpec(image=IMAGE),
            nodes=2 if case == "preempted" else 1,
        )
        spec = spec.replace(args=[*spec.args, "--debug-hold-at-step", "3"])
        jobs[case] = (cwd, env, *submit_spec(spec, cwd, env))
    for case, (cwd, *_) in jobs.items():
        wait_for(lambda c=cwd: progress_status(c / "run") == "holding", 120, f"{case} hold")
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", jobs["preempted"][2]])
    os.kill(_progress(jobs["crashed"][0] / "run")["pids"][1], signal.SIGKILL)
    states: dict[str, list[str]] = {job_id: [] for _, _, job_id, _ in jobs.values()}

    def all_ended() -> bool:
        for job_id, seen in states.items():
            seen.append(slurm_cluster.job_state(job_id))
        return all(seen[-1] in TERMINAL for seen in states.values())

    wait_for(all_ended, 180, "both torchrun jobs to end", interval_s=0.2)
    for case, (cwd, env, job_id, out) in jobs.items():
        done = wait_job(job_id, env, timeout_s=10, output=out)
        log = out.read_text()
        assert not list((cwd / "run").glob(".requeue-job-*")), log  # consumed, or never left
        if case == "crashed":
            assert (done.state, done.restarts) == ("FAILED", 0), log
            assert "PENDING" not in states[job_id] and "requeueing" not in log, log
            assert not (cwd / "run" / "result.json").exists()
            continue
        assert "PENDING" in states[job_id], states[job_id]
        assert (done.state, done.exit_code, done.restarts) == ("COMPLETED", 0, 1), log
        assert f"job {job_id} restart 0 " in log and f"job {job_id} restart 1 " in log
        assert "batch shell got SIGUSR1, forwarding" in log, log
        assert re.search(r"torchrun rendezvous at node1:\d+", log), log
        assert len(re.findall(r"preflight: torchrun agent node_rank=\d/2 ", log)) == 4, log
        # 1 from torchrun, or 143 when srun's --kill-on-bad-exit stopped the other node first
        said = r"step exited (1|143) after the trainer checkpointed \(requeue marker\): requeueing"
        assert re.search(f"{said} job {job_id}\n", log), log
        assert "for the batch script, which requeues the job" in log, log  # rank 0 left it
        assert "resumed from" in log, log
        result = read_result(cwd / "run")
        assert (result["interruptions"], result["world_size"]) == (1, 4)
        assert result["params_sha256"] == read_result(reference_run[0] / "run")["params_sha256"]
        report = run_dir_report(cwd / "run")  # what the run dir alone says, as in the srun job
        assert (report.job_id, report.restarts, report.state) == (job_id, 1, "ENDED"), report
        calls = Path(env["STANDIN_LOG"]).read_text().splitlines()
        head, python = f"apptainer exec {IMAGE} ", spec.python
        # per run (2 runs): the batch shell's port, 2 nodes x (preflight + torchrun)
        assert sum(c.startswith(f"{head}{python} -m hpc_ddp.deploy.port") for c in calls) == 2
        assert sum(c.startswith(f"{head}{python} -m hpc_ddp.deploy.preflight") for c in calls) == 4
        assert (
            sum(c.startswith(head + "torchrun --nnodes=2 --nproc-per-node=2") for c in calls) == 4
        )


def _progress(run_dir: Path) -> dict:
    return json.loads((run_dir / "progress.json").read_text())
