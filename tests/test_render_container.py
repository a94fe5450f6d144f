"""The ``[container]`` table in every layout, its flags, its checks; the batch-shell requeue.

pyxis and apptainer cannot be installed here: these tests read the rendered commands (parsed
with shlex, as bash would split them) and run the requeue block of a rendered script with bash,
``srun`` and ``scontrol`` replaced by stubs that record their argv. The real local Slurm cluster
runs container jobs through stand-in runtimes in test_container_jobs.py.
"""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp import schema
from hpc_ddp.cli import main
from hpc_ddp.deploy.container import ContainerSpec
from hpc_ddp.deploy.sbatch.render import port_command, preflight_command, render, step_command
from hpc_ddp.deploy.shell.host_scripts import host_script, payload_argv
from hpc_ddp.deploy.shell.spec import make_spec
from hpc_ddp.deploy.spec import JobSpec, build_spec
from hpc_ddp.errors import ConfigError
from hpc_ddp.run_dir.paths import RunPaths
from hpc_ddp.runtime.preemption import requeue
from hpc_ddp.train.config import TrainConfig

APPTAINER = ContainerSpec(
    runtime="apptainer", image="/img/t.sif", mounts=["/data:/data:ro"], workdir="/w"
)
PYXIS = ContainerSpec(runtime="pyxis", image="nvcr.io#nvidia/pytorch:24.05-py3", mounts=["/d"])
LAYOUTS = {
    "per-gpu": dict(gpus_per_node=4),
    "per-node": dict(gpus_per_node=4, gpus_per_process=4),
    "cpu": dict(procs_per_node=2),
    "torchrun": dict(gpus_per_node=4, launcher="torchrun"),
}


def _words(command: str) -> list[str]:
    return shlex.split(command.replace("\\\n", " "))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_apptainer_wraps_every_process_in_every_layout(layout: str) -> None:
    spec = JobSpec(nodes=2, container=APPTAINER, **LAYOUTS[layout])  # type: ignore[arg-type]
    assert spec.layout == layout
    nv = ["--nv"] if spec.gpus_per_node else []
    head = ["apptainer", "exec", *nv, "--bind", "/data:/data:ro", "--pwd", "/w", "/img/t.sif"]
    pre = _words(preflight_command(spec))
    at = pre.index("apptainer")
    assert pre[at : at + len(head)] == head
    assert pre[at + len(head) :] == ["python", "-m", "hpc_ddp.deploy.preflight"]
    text = render(spec)
    if layout == "torchrun":  # the task shell stays on the host; torchrun runs in the image
        assert shlex.join(head) + " \\\n  torchrun --nnodes" in text
        assert _words(port_command(spec)) == [*head, "python", "-m", "hpc_ddp.deploy.port"]
        assert "apptainer" not in _words(step_command(spec))
    else:
        step = _words(step_command(spec))
        at = step.index("apptainer")
        # In the image: hpc-ddp exec (torch's env:// variables), then the program.
        assert step[0] == "srun" and step[at + len(head) :][:5] == [
            "python",
            "-m",
            "hpc_ddp",
            "exec",
            "--",
        ]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pyxis_puts_each_step_in_the_image_in_every_layout(layout: str) -> None:
    spec = JobSpec(nodes=2, container=PYXIS, **LAYOUTS[layout])  # type: ignore[arg-type]
    opts = ["--container-image=nvcr.io#nvidia/pytorch:24.05-py3", "--container-mounts=/d"]
    for command in (preflight_command(spec), step_command(spec)):
        words = _words(command)
        program = words.index("python") if "python" in words else words.index("bash")
        assert words[0] == "srun" and words[program - 2 : program] == opts, words
    assert "apptainer" not in render(spec)
    if layout == "torchrun":  # the batch shell is on the host: the port comes from a step
        assert _words(port_command(spec))[:3] == ["srun", "--nodes=1", "--ntasks=1"]


def test_no_container_renders_as_before() -> None:
    text = render(JobSpec(nodes=2, gpus_per_node=4))
    assert "--container-" not in text and "apptainer" not in text


def test_a_spec_file_table_and_flags_merge(tmp_path: Path) -> None:
    spec_file = tmp_path / "job.toml"
    spec_file.write_text(
        'nodes = 2\n[container]\nruntime = "pyxis"\nimage = "a.sqsh"\nmounts = ["/scratch"]\n'
    )
    parser = __import__("argparse").ArgumentParser()
    schema.add_arguments(parser, JobSpec)
    flags = schema.given_values(
        parser.parse_args(["--container-image", "b.sqsh", "--container-env", "WANDB_API_KEY"]),
        JobSpec,
    )
    spec = build_spec(spec_file, flags)
    assert spec.container == ContainerSpec(
        runtime="pyxis", image="b.sqsh", mounts=["/scratch"], env=["WANDB_API_KEY"]
    )


@pytest.mark.parametrize(
    ("table", "needle"),
    [
        ({"runtime": "docker", "image": "a.sif"}, "container.runtime 'docker' is not one of"),
        ({"image": "-it"}, "container.image '-it'"),
        ({"image": "a b.sif"}, "container.image 'a b.sif'"),
        ({"image": "a.sif", "mounts": ["data:/data"]}, "container.mounts[0] 'data:/data'"),
        ({"image": "a.sif", "mounts": ["/a,/b"]}, "container.mounts[0] '/a,/b'"),
        ({"image": "a.sif", "mounts": ["/a:/b:rx"]}, "container.mounts[0] '/a:/b:rx'"),
        ({"image": "a.sif", "workdir": "w"}, "container.workdir 'w'"),
        ({"image": "a.sif", "env": ["A-B"]}, "container.env[0] 'A-B' is not a variable name"),
        ({"image": "a.sif", "imgae": "x"}, "unknown key 'imgae' (did you mean 'image'?)"),
        ({"image": "a.sif", "mounts": "/a"}, "mounts: expected a list of strings"),
    ],
)
def test_bad_container_values_are_named(table: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        JobSpec.from_mapping({"container": table})
    assert needle in str(err.value)


def test_which_jobs_the_batch_shell_requeues() -> None:
    """srun layouts: on the step's exit 75. torchrun (which reports 75 as 1): on the trainer's
    marker in the run dir the script names. Nobody where no run dir is known at render time."""
    srun = render(JobSpec(nodes=2, procs_per_node=2))
    assert "export HPC_DDP_REQUEUE_BY=batch\n" in srun
    assert 'scontrol requeue "${requeue_id}"' in srun and "requeue_marker" not in srun
    torchrun = render(JobSpec(launcher="torchrun", args=["--run-dir", "runs/a b"]))
    assert "export HPC_DDP_REQUEUE_BY=batch-marker\n" in torchrun
    assert 'scontrol requeue "${requeue_id}"' in torchrun
    marker = "requeue_marker='runs/a b'/.requeue-job-\"${SLURM_JOB_ID}\"-restart-"
    assert marker + '"${SLURM_RESTART_COUNT:-0}"\n' in torchrun
    default = render(JobSpec(launcher="torchrun"))  # the trainer's default run dir
    assert f"requeue_marker={TrainConfig().run_dir}/.requeue-job-" in default
    for spec in (
        JobSpec(launcher="torchrun", args=["--config", "c.toml"]),  # run dir in a file
        JobSpec(launcher="torchrun", module="", script="mine.py"),  # a program of your own
        JobSpec(requeue=False),
        JobSpec(launcher="torchrun", requeue=False),
    ):
        text = render(spec)
        assert "HPC_DDP_REQUEUE_BY" not in text and "scontrol requeue" not in text


def test_a_container_torchrun_job_must_name_its_run_dir_for_the_requeue_marker() -> None:
    """Its batch shell requeues on the marker in the run dir; a --config file's run_dir is read
    only when the job runs, too late for the script (and the image may have no scontrol)."""
    config_only = dict(launcher="torchrun", args=["--config", "c.toml"])
    with pytest.raises(ConfigError, match="add '--run-dir runs/NAME' to args"):
        JobSpec(container=APPTAINER, **config_only)
    JobSpec(container=APPTAINER, launcher="torchrun", args=["--config", "c.toml", "--run-dir", "r"])
    JobSpec(**config_only)  # on the host rank 0 can still requeue itself
    JobSpec(container=APPTAINER, requeue=False, **config_only)


def test_the_trainer_leaves_the_requeue_to_the_batch_shell(tmp_path: Path) -> None:
    env = {"SLURM_JOB_ID": "5", "HPC_DDP_REQUEUE_BY": "batch", "PATH": "/nonexistent"}
    assert "batch script, which requeues" in requeue("auto", env)
    # asked explicitly (--requeue scontrol), the trainer still tries itself (and fails here)
    assert "batch script" not in requeue("scontrol", env)
    assert "scontrol" in requeue("scontrol", env)
    paths = RunPaths(tmp_path)
    marked = {**env, "HPC_DDP_REQUEUE_BY": "batch-marker", "SLURM_RESTART_COUNT": "2"}
    requeue("scontrol", marked, run_paths=paths)  # the trainer asks itself (fails here): no
    assert not list(tmp_path.iterdir())  # marker, which would make a second request
    said = requeue("auto", marked, run_paths=paths)
    marker = paths.requeue_marker("5", "2")
    assert said == f"left {marker} for the batch script, which requeues the job from the host shell"
    assert marker.read_text() == "hpc-ddp checkpointed for requeue: job 5 restart 2\n"
    marker.write_text("not ours")  # a file already there is never replaced
    assert "already there and not this run's" in requeue("auto", marked, run_paths=paths)
    assert marker.read_text() == "not ours"
    for bad in ({"SLURM_JOB_ID": "5\n"}, {"SLURM_RESTART_COUNT": "../x"}, {"SLURM_JOB_ID": ""}):
        assert "not requeued" in requeue("auto", {**marked, **bad}, run_paths=paths)
    assert [p.name for p in tmp_path.iterdir()] == [marker.name]


def _stub(path: Path, text: str) -> None:
    path.write_text("#!/bin/bash\n" + text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.parametrize(
    ("array", "requeued"), [({}, "requeue 41"), ({"SLURM_ARRAY_JOB_ID": "40"}, "requeue 40_3")]
)
def test_a_step_exiting_75_is_requeued_by_the_batch_shell(
    tmp_path: Path, array: dict, requeued: str
) -> None:
    """bash runs the rendered script; srun (runs its command) and scontrol (records) are stubs."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    log = tmp_path / "scontrol.log"
    _stub(stubs / "srun", 'while [[ $1 == --* ]]; do shift; done\nexec "$@"\n')
    _stub(stubs / "scontrol", f'echo "$*" >> {shlex.quote(str(log))}\n')
    worker = tmp_path / "w.py"
    worker.write_text("import sys\nsys.exit(75)\n")
    spec = JobSpec(module="", script=str(worker), python=sys.executable, preflight=False)
    script = tmp_path / "job.sbatch"
    script.write_text(render(spec))
    env = {
        "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "41",
        "SLURM_ARRAY_TASK_ID": "3",
        "SLURM_JOB_NODELIST": "n1",
        **array,
    }
    done = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 75, done.stderr
    assert log.read_text().splitlines() == [requeued]
    assert f"step exited 75 (checkpointed): {requeued.replace('requeue', 'requeueing job')}" in (
        done.stdout
    )


def test_launch_wraps_the_payload_in_apptainer_and_refuses_pyxis(tmp_path: Path) -> None:
    container = ContainerSpec(image="/img/t.sif", env=["NCCL_DEBUG"])
    spec = make_spec(tool="pdsh", hosts="n[1-2]", command=["--epochs", "1"], container=container)
    assert spec.python == "python"  # the image's interpreter, not this machine's venv path
    argv = payload_argv(spec)
    assert argv[:4] == ["apptainer", "exec", "--nv", "/img/t.sif"]
    assert argv[4:7] == ["python", "-m", "torch.distributed.run"]
    assert 'export APPTAINERENV_NCCL_DEBUG="${NCCL_DEBUG}"' in host_script(spec)
    with pytest.raises(ConfigError, match="--container-runtime 'pyxis': pyxis is a plugin of srun"):
        make_spec(tool="pdsh", hosts="n1", command=["x"], container=ContainerSpec(runtime="pyxis"))


def test_launch_cli_takes_the_container_flags(tmp_path: Path, capsys) -> None:
    out = tmp_path / "l.sh"
    rc = main(
        ["launch", "pdsh", "--hosts", "n[1-2]", "--container-image", "/img/t.sif",
         "--container-mounts", "/a:/b", "--render-script", str(out), "--", "--epochs", "1"]
    )  # fmt: skip
    assert rc == 0
    assert "setsid apptainer exec --nv --bind /a:/b /img/t.sif python -m" in out.read_text()
    rc = main(["launch", "pdsh", "--hosts", "n1", "--container-image", "x y", "--", "true"])
    assert rc == 2 and "--container-image 'x y'" in capsys.readouterr().err


# What one torchrun "worker" does, then torchrun's report of it: the real marker writer after
# a checkpoint (exit 1: torchrun's word for a worker's 75), a crash (exit 1, no marker), or a
# marker and then success (exit 0: nothing to requeue, whatever the marker says).
TORCHRUN_STUB = """import os, sys
from hpc_ddp.runtime.preemption import requeue
from hpc_ddp.run_dir.paths import RunPaths
if os.environ["CASE"] != "crashed":
    print(requeue("auto", run_paths=RunPaths("run")))
sys.exit(0 if os.environ["CASE"] == "finished" else 1)
"""


@pytest.mark.parametrize(
    ("case", "planted", "requeued"),
    [
        ("checkpointed", None, True),
        ("crashed", None, False),
        ("crashed", "earlier run", False),  # restart 0's marker; this is restart 1
        ("crashed", "not ours", False),  # this run's name, other content
        ("crashed", "link", False),  # this run's name, a link to the right line
        ("finished", None, False),
    ],
)
def test_the_torchrun_batch_shell_requeues_on_this_runs_marker_only(
    tmp_path: Path, case: str, planted: str | None, requeued: bool
) -> None:
    """bash runs a rendered torchrun script; srun, scontrol and torchrun are stubs (torchrun
    plays a worker that checkpointed or crashed, and exits 1 as torchrun does either way)."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    log = tmp_path / "scontrol.log"
    _stub(stubs / "srun", 'while [[ $1 == --* ]]; do shift; done\nexec "$@"\n')
    _stub(
        stubs / "scontrol",
        'case "$1 $2" in\n  "show hostnames") echo n1 ;;\n'
        '  "show config") echo "ProctrackType = proctrack/linuxproc" ;;\n'
        f'  *) echo "$*" >> {shlex.quote(str(log))} ;;\nesac\n',
    )
    (stubs / "torchrun").write_text(f"#!{sys.executable}\n{TORCHRUN_STUB}")
    (stubs / "torchrun").chmod(0o755)
    spec = JobSpec(launcher="torchrun", python=sys.executable, preflight=False)
    spec = spec.replace(args=["--run-dir", "run"])
    script = tmp_path / "job.sbatch"
    script.write_text(render(spec))
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    mine, line = (
        paths.requeue_marker("41", "1"),
        "hpc-ddp checkpointed for requeue: job 41 restart 1",
    )
    if planted == "earlier run":
        paths.requeue_marker("41", "0").write_text(line.replace("restart 1", "restart 0") + "\n")
    elif planted == "not ours":
        mine.write_text("not ours\n")
    elif planted == "link":
        (tmp_path / "target").write_text(line + "\n")
        mine.symlink_to(tmp_path / "target")
    before = sorted(p.name for p in paths.root.iterdir())
    env = {
        "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        "CASE": case,
        "HOME": str(tmp_path),
        "SLURM_JOB_ID": "41",
        "SLURM_RESTART_COUNT": "1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "n1",
    }
    done = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == (0 if case == "finished" else 1), done.stdout + done.stderr
    if requeued:
        assert log.read_text().splitlines() == ["requeue 41"]
        assert (
            "step exited 1 after the trainer checkpointed (requeue marker): requeueing job 41"
            in (done.stdout)
        )
        assert not mine.exists()  # consumed
    else:
        assert not log.exists(), log.read_text()
        # nothing else removed (a finished run's own marker is consumed all the same)
        assert sorted(p.name for p in paths.root.iterdir()) == before


def test_a_container_table_from_python_is_a_spec_files_table(tmp_path: Path) -> None:
    """``container={...}`` in JobSpec and make_launch_spec is read as a spec file's
    ``[container]`` table: the same ContainerSpec, the same script, the same key checks."""
    table = {"image": "/images/train.sif", "mounts": ["/data:/data:ro"]}
    spec_file = tmp_path / "job.toml"
    spec_file.write_text(
        'nodes = 1\ntime = "5"\n[container]\nimage = "/images/train.sif"\n'
        'mounts = ["/data:/data:ro"]\n'
    )
    from_file = build_spec(spec_file)
    from_python = JobSpec(nodes=1, time="5", container=table)
    assert from_python.container == from_file.container
    assert render(from_python) == render(from_file.replace(name=from_python.name))
    launch = make_spec(tool="pdsh", hosts="n1", command=["true"], rcmd="exec", container=table)
    assert launch.container == from_file.container
    with pytest.raises(ConfigError, match="did you mean 'image'"):
        JobSpec(container={"imag": "/images/train.sif"})
