"""Describe, then render: JobSpec validation, the render command, and what each layout emits.

Pure tests (no Slurm): the rendered scripts are run for real in tests/test_slurm_jobs.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from hostile_files import make_fifo, run_child, symlink_to

from hpc_ddp import __version__, schema
from hpc_ddp.cli import main
from hpc_ddp.deploy import JobSpec, build_spec
from hpc_ddp.deploy.launchers import DEFAULT_LAUNCHER, LAUNCHERS
from hpc_ddp.deploy.sbatch.render import render
from hpc_ddp.errors import ConfigError

PY = sys.executable


def _cli(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "hpc_ddp.cli", *argv], capture_output=True, text=True, cwd=cwd, timeout=60
    )


def _directives(text: str) -> list[str]:
    return [
        line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH")
    ]


# --- validation ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (
            dict(gpus_per_node=8, gpus_per_process=3),
            "valid gpus_per_process for 8 GPUs: [1, 2, 4, 8]",
        ),
        (dict(launcher="torchrun", gpus_per_node=8, gpus_per_process=2), 'needs launcher = "srun"'),
        (dict(launcher="mpirun"), "not one of srun, torchrun"),
        (dict(gpus_per_node=4, procs_per_node=3), "contradicts 4 GPUs per node"),
        (dict(gpus_per_process=2), "only applies to GPU jobs"),
        (dict(signal="KILL"), "is not one of USR1"),
        (dict(time="5", signal_lead_s=300), "not shorter than the time limit"),
        (dict(signal="USR2"), "add '--requeue-signal USR2,TERM'"),
        (dict(env={"BAD-KEY": "1"}), "not a valid variable name"),
        (dict(gpu_binding="per-gpu"), "gpus-per-node, gpus-per-task"),
    ],
)
def test_contradictions_fail_listing_what_is_valid(kw: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        JobSpec(**kw)
    assert needle in str(err.value)
    assert err.value.hint


def test_all_problems_are_reported_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        JobSpec(nodes=0, time="soon", mem="lots")
    text = str(err.value)
    assert "nodes=0 is out of range" in text and "time 'soon'" in text and "mem 'lots'" in text


def test_unknown_keys_and_wrong_types_name_the_valid_keys() -> None:
    with pytest.raises(ConfigError) as err:
        JobSpec.from_mapping({"gpu_per_node": 2, "cpus_per_task": "2"})
    text = str(err.value)
    assert "did you mean 'gpus_per_node'" in text
    assert "cpus_per_task: expected an integer" in text
    assert "valid keys:" in text and "gpus_per_process" in text


def test_file_then_flags_flags_win(tmp_path: Path) -> None:
    spec_file = tmp_path / "job.toml"
    spec_file.write_text('nodes = 4\ngpus_per_node = 4\nname = "a"\n[env]\nNCCL_DEBUG = "INFO"\n')
    spec = build_spec(spec_file, {"nodes": 2})
    assert (spec.nodes, spec.gpus_per_node, spec.name, spec.env) == (
        2,
        4,
        "a",
        {"NCCL_DEBUG": "INFO"},
    )
    as_json = tmp_path / "job.json"
    as_json.write_text(json.dumps({"nodes": 3, "launcher": "torchrun"}))
    assert build_spec(as_json).layout == "torchrun"


# --- layouts ------------------------------------------------------------------------------
def test_the_launcher_table_is_where_the_spec_takes_its_launchers_from() -> None:
    """JobSpec's launcher field, its help and its layouts come from LAUNCHERS; each entry
    renders with its own template, which exists."""
    field = {f.name: f for f in dataclasses.fields(JobSpec)}["launcher"]
    kind = typing.get_type_hints(JobSpec)["launcher"]
    assert schema.literal_choices(kind) == tuple(LAUNCHERS) == ("srun", "torchrun")
    assert field.default == DEFAULT_LAUNCHER in LAUNCHERS
    for name, launcher in LAUNCHERS.items():
        assert launcher.name == name and launcher.help in field.metadata["help"]
        assert (Path(__file__).parents[1] / "templates" / launcher.template).is_file()
        spec = JobSpec(nodes=2, gpus_per_node=4, launcher=name)
        assert spec.layout == (launcher.layout or "per-gpu")
        assert f"--ntasks-per-node={launcher.tasks_per_node(spec)}" in _directives(render(spec))


def test_per_gpu_layout_gpus_per_node() -> None:
    text = render(JobSpec(nodes=2, gpus_per_node=8, cpus_per_task=6))
    d = _directives(text)
    assert "--ntasks-per-node=8" in d and "--gpus-per-node=8" in d and "--cpus-per-task=6" in d
    assert "--signal=USR1@90" in d  # steps, not "B:": the trainers get the warning
    assert "--open-mode=append" in d and "--requeue" in d
    step = text[text.index("srun ") :]
    assert "--kill-on-bad-exit=1" in step and "--cpus-per-task=6" in step  # srun does not inherit
    assert "-m \\\n  hpc_ddp.train" in step or "-m hpc_ddp.train" in step
    assert "HPC_DDP_GPUS_PER_PROCESS" not in text


def test_per_gpu_layout_gpus_per_task() -> None:
    d = _directives(render(JobSpec(nodes=2, gpus_per_node=4, gpu_binding="gpus-per-task")))
    assert "--gpus-per-task=1" in d and "--ntasks-per-node=4" in d
    assert not any(x.startswith("--gpus-per-node") for x in d)


def test_per_node_layout_one_task_all_gpus() -> None:
    text = render(JobSpec(nodes=2, gpus_per_node=8, gpus_per_process=8, cpus_per_task=32))
    d = _directives(text)
    assert "--ntasks-per-node=1" in d and "--gpus-per-node=8" in d
    assert "export HPC_DDP_GPUS_PER_PROCESS=8" in text
    assert "# Layout: one process per node driving 8 GPUs: 2 nodes = 2 processes\n" in text


def test_several_processes_per_node_each_driving_gpus_are_described_as_such() -> None:
    text = render(JobSpec(nodes=2, gpus_per_node=4, gpus_per_process=2))
    assert "--ntasks-per-node=2" in _directives(text)
    layout = "2 processes per node, each driving 2 GPUs: 2 nodes x 2 = 4 processes"
    assert f"# Layout: {layout}\n" in text and f"on ${{SLURM_JOB_NODELIST}}: {layout}" in text


def test_torchrun_layout_one_task_per_node_with_c10d_on_first_host() -> None:
    text = render(JobSpec(nodes=2, gpus_per_node=8, launcher="torchrun", cpus_per_task=4))
    d = _directives(text)
    assert "--ntasks-per-node=1" in d and "--cpus-per-task=32" in d  # 8 workers x 4 CPUs
    assert 'scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1' in text
    assert "-m hpc_ddp.deploy.port" in text  # one port rule, the Python one
    assert "--rdzv-backend=c10d" in text and "--nproc-per-node=8" in text
    assert 'trap "" USR1\n  torchrun --nnodes=' in text  # torchrun itself would die on USR1
    # proctrack/cgroup signals only the task (the shell): it hands USR1 on to the workers
    assert 'trap "pkill -USR1 -P ${agent}" USR1' in text and "export -f torchrun_task" in text
    flat = text.replace(" \\\n  ", " ")  # the step command, unwrapped
    assert "bash -c 'torchrun_task \"$@\"' torchrun -m hpc_ddp.train" in flat


def test_cpu_layout() -> None:
    text = render(JobSpec(nodes=2, procs_per_node=2))
    d = _directives(text)
    assert "--ntasks-per-node=2" in d and not any("gpu" in x for x in d)
    assert "CPU/Gloo" in text


def test_optional_directives_only_when_set() -> None:
    bare = _directives(render(JobSpec()))
    assert not any(
        x.startswith(("--partition", "--account", "--qos", "--constraint")) for x in bare
    )
    full = _directives(
        render(JobSpec(partition="gpu", account="proj", qos="high", constraint="a100", mem="64G"))
    )
    for want in (
        "--partition=gpu",
        "--account=proj",
        "--qos=high",
        "--constraint=a100",
        "--mem=64G",
    ):
        assert want in full


@pytest.mark.parametrize(
    ("kw", "layout"),
    [
        (dict(gpus_per_node=8), "one process per GPU (srun): 1-4 nodes x 8 GPUs = 8-32 processes"),
        (
            dict(gpus_per_node=8, gpus_per_process=8),
            "one process per node driving 8 GPUs: 1-4 nodes = 1-4 processes",
        ),
        (dict(procs_per_node=2), "CPU/Gloo (srun): 1-4 nodes x 2 processes = 2-8 processes"),
        (
            dict(gpus_per_node=8, launcher="torchrun"),
            "torchrun, one task per node: 1-4 nodes x 8 GPUs = 8-32 processes",
        ),
    ],
    ids=["per-gpu", "per-node", "cpu", "torchrun"],
)
def test_a_range_of_nodes_is_asked_of_slurm_and_read_back_when_the_job_runs(
    kw: dict, layout: str
) -> None:
    """sbatch gets MIN-MAX; every step and torchrun's rendezvous take the number Slurm gave
    the job, read when it runs; the spec's number appears nowhere else."""
    text = render(JobSpec(nodes="1-4", **kw))
    assert "--nodes=1-4" in _directives(text)
    assert f"# Layout: {layout}\n" in text
    steps = [line for line in text.splitlines() if line.startswith("srun ")]
    assert len(steps) == 2  # the preflight and the training step
    assert all(' --nodes="${SLURM_JOB_NUM_NODES}" ' in line for line in steps), steps
    assert re.findall(r"--nodes=\S+", text) == [
        "--nodes=1-4",
        *['--nodes="${SLURM_JOB_NUM_NODES}"'] * 2,
    ]
    if kw.get("launcher") == "torchrun":
        assert 'torchrun --nnodes="${SLURM_JOB_NUM_NODES}"' in text
    proc = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert proc.returncode == 0, proc.stderr
    fixed = render(JobSpec(nodes=4, **kw))  # one number: the script says it
    assert 'SLURM_JOB_NUM_NODES}" --ntasks' not in fixed and " --nodes=4 " in fixed


@pytest.mark.parametrize("nodes", ["0-2", "2-1", "1-65537", "1-", "-2", "1-2-3", "1 - 2", "a", 0])
def test_a_range_of_nodes_outside_1_to_the_bound_is_refused(nodes: object) -> None:
    with pytest.raises(ConfigError) as err:
        JobSpec(nodes=nodes)
    assert f"nodes={nodes}" in err.value.message or f"nodes {nodes!r}" in err.value.message
    assert "MIN-MAX" in err.value.message


def test_render_says_the_range_of_processes(tmp_path: Path) -> None:
    out = tmp_path / "job.sbatch"
    proc = _cli("render", "-N", "1-2", "--procs-per-node", "2", "--script-out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out} (cpu, 2-4 processes)" in proc.stderr
    assert "#SBATCH --nodes=1-2\n" in out.read_text()


def test_nodes_as_text_or_an_equal_range_is_one_number() -> None:
    assert JobSpec(nodes="3").nodes == 3 and JobSpec(nodes="3-3").nodes == 3
    spec = build_spec(overrides={"nodes": "2-3"})
    assert (spec.nodes, spec.node_range, spec.world_text) == ("2-3", (2, 3), "2-3")


def test_arguments_are_quoted_once() -> None:
    text = render(JobSpec(args=["--run-dir", "runs/with space", "--note", "it's"]))
    assert "'runs/with space'" in text
    assert "'it'\"'\"'s'" in text


def test_render_is_deterministic_and_records_the_command() -> None:
    spec = JobSpec(nodes=2, procs_per_node=2)
    a, b = render(spec, command="hpc-ddp render X"), render(spec, command="hpc-ddp render X")
    assert a == b
    assert a.startswith("#!/bin/bash\n# Rendered by hpc-ddp ")
    assert "hpc-ddp render X" in a.splitlines()[1]


def test_rendered_scripts_are_valid_bash() -> None:
    for spec in (
        JobSpec(nodes=2, procs_per_node=2),
        JobSpec(nodes=2, gpus_per_node=8, launcher="torchrun"),
        JobSpec(nodes=2, gpus_per_node=8, gpus_per_process=8, setup=["echo hi"]),
    ):
        proc = subprocess.run(["bash", "-n"], input=render(spec), text=True, capture_output=True)
        assert proc.returncode == 0, proc.stderr


# --- the command --------------------------------------------------------------------------
def test_cli_bad_spec_fails_before_writing(tmp_path: Path) -> None:
    out = tmp_path / "job.sbatch"
    proc = _cli(
        "render", "--gpus-per-node", "8", "--gpus-per-process", "3", "--script-out", str(out)
    )
    assert proc.returncode == 2
    assert "valid gpus_per_process" in proc.stderr and "HINT" in proc.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_cli_unknown_key_in_file(tmp_path: Path) -> None:
    spec_file = tmp_path / "job.toml"
    spec_file.write_text("nodes = 2\ngpu = 4\n")
    proc = _cli("render", "--config", str(spec_file), "--script-out", str(tmp_path / "x.sbatch"))
    assert proc.returncode == 2 and "unknown key 'gpu'" in proc.stderr
    assert not (tmp_path / "x.sbatch").exists()


def test_cli_writes_atomically_and_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "job.sbatch"
    assert main(["render", "--nodes", "2", "--script-out", str(out)]) == 0
    first = out.read_text()
    assert os.access(out, os.X_OK)
    assert main(["render", "--nodes", "3", "--script-out", str(out)]) == 2  # exists, no --force
    assert out.read_text() == first
    assert main(["render", "--nodes", "3", "--script-out", str(out), "--force"]) == 0
    assert "--nodes=3" in out.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["job.sbatch"]  # no temporary files left
    # A link, even one pointing nowhere yet, is someone's: refused the same way.
    link = tmp_path / "link.sbatch"
    link.symlink_to(tmp_path / "not-yet.sbatch")
    assert main(["render", "--nodes", "2", "--script-out", str(link)]) == 2
    assert link.is_symlink() and not (tmp_path / "not-yet.sbatch").exists()


def test_cli_dry_run_prints_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "job.sbatch"
    proc = _cli(
        "render", "--nodes", "2", "--dry-run", "--script-out", str(out), "--", "--epochs", "1"
    )
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --nodes=2" in proc.stdout and "--epochs 1" in proc.stdout
    assert not out.exists()


def test_render_never_imports_torch() -> None:
    """What keeps render fast is that it never imports torch; its latency is a benchmark
    (benchmarks/README.md), not a timed test."""
    code = (
        "import sys; from hpc_ddp.cli import main; "
        "import contextlib, io\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    rc = main(['render', '--nodes=2', '--gpus-per-node=8', '--launcher=torchrun'])\n"
        "print(rc, 'torch' in sys.modules)"
    )
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    rc, torch_loaded = proc.stdout.split()
    assert rc == "0" and torch_loaded == "False", proc.stderr


def test_spec_file_given_as_positional_is_refused(tmp_path: Path) -> None:
    proc = _cli("render", "jobs/specs/local_cpu_2x2.toml")
    assert proc.returncode == 2 and "--config jobs/specs/local_cpu_2x2.toml" in proc.stderr


def test_per_rank_logs_go_to_one_file_per_rank() -> None:
    text = render(JobSpec(nodes=2, procs_per_node=2, per_rank_logs=True, output="logs/%x-%j.out"))
    step = text[text.index("python -u") - 200 :]
    assert "--output=logs/%x-%j.out.rank%t" in step and "--open-mode=append" in step
    with pytest.raises(ConfigError, match="per_rank_logs needs launcher srun"):
        JobSpec(launcher="torchrun", per_rank_logs=True)


def test_gpus_per_process_env_must_agree_with_the_spec() -> None:
    with pytest.raises(ConfigError, match="gpus_per_process=8 was asked for but HPC_DDP_GPUS_"):
        JobSpec(gpus_per_node=8, gpus_per_process=8, env={"HPC_DDP_GPUS_PER_PROCESS": "4"})


def test_gpus_per_process_not_given_follows_the_one_rule() -> None:
    """Not given (None; 0 in a file or flag) is what the job's processes would conclude from
    the environment they get (the spec's env), else 1: the rule detect_env applies."""
    assert JobSpec(gpus_per_node=8).gpus_per_process == 1
    assert JobSpec(gpus_per_node=8, gpus_per_process=0).layout == "per-gpu"
    from_env = JobSpec(gpus_per_node=8, env={"HPC_DDP_GPUS_PER_PROCESS": "4"})
    assert (from_env.gpus_per_process, from_env.layout, from_env.ppn) == (4, "per-node", 2)
    assert build_spec(overrides={"gpus_per_node": 8, "gpus_per_process": 0}).gpus_per_process == 1
    with pytest.raises(ConfigError, match="gpus_per_process=-1 is out of range"):
        JobSpec(gpus_per_node=8, gpus_per_process=-1)


# --- data never becomes code (the full table is tests/test_hostile_scripts.py) -------------
@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (dict(time="01:00:00\n"), "time '01:00:00\\n'"),  # '$' would accept the newline
        (dict(time="٣"), "time '٣'"),  # an Arabic-Indic digit is no Slurm time
        (dict(mem="4G\n"), "mem '4G\\n'"),
        (dict(name="job\n"), "name 'job\\n'"),
        (dict(env={"KEY\n": "1"}), "env key 'KEY\\n'"),
        (dict(partition="gpu\n#SBATCH --qos=high"), "partition 'gpu\\n#SBATCH"),
        (dict(output="logs/a b.out"), "output 'logs/a b.out': an #SBATCH value cannot hold"),
        (dict(account="hetjob1"), "sbatch reads 'hetjob'"),
        (dict(extra_sbatch=["--exclusive --qos=x"]), "extra_sbatch[0] '--exclusive --qos=x'"),
        (dict(module="pkg.mod;ls"), "module 'pkg.mod;ls'"),
        (dict(args=["ok", "a\rb"]), "args[1] 'a\\rb': U+000D CARRIAGE RETURN"),
        (dict(python="py\u2028thon"), "U+2028 LINE SEPARATOR"),
    ],
)
def test_data_fields_refuse_what_would_leave_their_line(kw: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        JobSpec(**kw)
    assert needle in str(err.value)


def test_setup_lines_are_shell_but_one_line_each() -> None:
    text = render(JobSpec(setup=["module load cuda\t# tab kept", "echo $(hostname)"]))
    assert "module load cuda\t# tab kept\necho $(hostname)\n" in text
    with pytest.raises(ConfigError, match=r"setup\[1\] .*LINE FEED.*its own setup entry"):
        JobSpec(setup=["ok", "echo a\necho b"])


def test_directive_values_are_written_for_sbatch_not_for_a_shell() -> None:
    """sbatch unquotes #SBATCH lines itself: a value goes in as it is (it is checked instead)."""
    d = _directives(render(JobSpec(partition="gpu,debug", constraint="a100&ib")))
    assert "--partition=gpu,debug" in d and "--constraint=a100&ib" in d


def test_the_recorded_command_stays_one_comment_line() -> None:
    text = render(JobSpec(), command="hpc-ddp submit 'a\nb.toml'\u2028x")
    assert text.splitlines()[1] == "# Rendered by hpc-ddp " + __version__ + (
        ": hpc-ddp submit 'a\\nb.toml'\\u2028x"
    )


def test_cli_names_the_field_of_a_control_character(tmp_path: Path) -> None:
    spec_file = tmp_path / "job.json"
    spec_file.write_text(json.dumps({"env": {"DATA": "x\ny"}}))
    out = tmp_path / "job.sbatch"
    proc = _cli("render", "--config", str(spec_file), "--script-out", str(out))
    assert proc.returncode == 2 and "env['DATA'] 'x\\ny': U+000A LINE FEED" in proc.stderr
    assert not out.exists()


def test_an_array_gives_each_task_its_log_and_its_run_dir(tmp_path: Path) -> None:
    spec = JobSpec(array="0-3%2", per_rank_logs=True, args=["--run-dir", "runs/a b"])
    text = render(spec)
    assert "#SBATCH --array=0-3%2\n" in text
    assert "#SBATCH --output=%x-%A_%a.out\n" in text and "--output=%x-%A_%a.out.rank%t" in text
    # The trainer's last --run-dir wins: the spec's value quoted, the task id from the shell.
    assert text.count("--run-dir 'runs/a b_'\"${SLURM_ARRAY_TASK_ID}\" &\n") == 1, text
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    assert "--array" not in render(spec.replace(array=""))


@pytest.mark.parametrize("value", ["0-3\n", "1,,2", "-1", "0-3%", "a", "0-3 %2", "0-３"])
def test_an_array_outside_slurms_form_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"array {value!r}: expected Slurm")):
        JobSpec(array=value, args=["--run-dir", "r"])


def test_an_array_of_trainer_runs_needs_a_run_dir_and_is_not_followed_by_submit() -> None:
    with pytest.raises(ConfigError, match="each task trains into <run dir>_<task id>"):
        JobSpec(array="0-1")
    from hpc_ddp.deploy.api import describe, submit

    spec = JobSpec(array="0-1", args=["--run-dir", "r"])
    assert describe(spec).run_paths is None  # one run dir per task
    with pytest.raises(ConfigError, match="an array's tasks are separate jobs"):
        submit(spec, wait=False)


# --- numbers and spec files (docs/security.md: "Numbers and spec files") -------------------
def test_a_huge_gpu_count_is_refused_before_the_layout_is_worked_out() -> None:
    """The layout's rules list the valid GPUs per process for a GPU count (its divisors): run
    on an unchecked count they never ended. A child, so that such a loop fails the test."""
    code = (
        "from hpc_ddp.deploy import JobSpec\nfrom hpc_ddp.errors import ConfigError\n"
        "try:\n    JobSpec(gpus_per_node=2**40 + 1, gpus_per_process=2)\n"
        "except ConfigError as err:\n    print(err)"
    )
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=30)
    assert "gpus_per_node=1099511627777 is out of range" in proc.stdout, proc.stderr


def _hostile_files(root: Path, suffix: str) -> dict[str, tuple[Path, str]]:
    """name -> (a file a user could pass as a spec, config file or batch script, what the refusal
    must say)."""
    root.mkdir()
    files = {
        "FIFO": (make_fifo(root / f"fifo{suffix}"), "it is a FIFO, not a regular file"),
        "link to /dev/zero": (
            symlink_to(root / f"zero{suffix}", "/dev/zero"),
            "it is a character device, not a regular file",
        ),
        "directory": (root / f"dir{suffix}", "it is a directory, not a regular file"),
        "missing": (root / f"missing{suffix}", "does not exist"),
        "not UTF-8": (root / f"latin1{suffix}", "is not UTF-8 text: byte 0xe9 at offset 11"),
        "too large": (root / f"big{suffix}", "larger than the 262144 bytes"),
    }
    (root / f"dir{suffix}").mkdir()
    (root / f"latin1{suffix}").write_bytes(b'name = "caf\xe9"\n')
    (root / f"big{suffix}").write_text("# a comment line\n" * 20_000)
    deep = {
        ".json": ("[" * 100_000, "nested more than 16 levels deep"),
        ".toml": ("args = " + "[" * 100_000, "nested more than 16 levels deep"),
    }
    if suffix in deep:
        text, needle = deep[suffix]
        (root / f"deep{suffix}").write_text(text)
        files["nested 100000 deep"] = (root / f"deep{suffix}", needle)
    if suffix == ".toml":
        (root / "dotted.toml").write_text("env." + "a." * 3000 + "b = '1'\n")
        files["dotted key of 3002 parts"] = (
            root / "dotted.toml",
            "line 1: a dotted key of more than 16 parts",
        )
    return files


_READERS = {
    "render -c": (".toml", ["render", "-c", "{f}", "--script-out", "{dir}/out.sbatch"]),
    "render -c (json)": (".json", ["render", "-c", "{f}", "--script-out", "{dir}/out.sbatch"]),
    "submit SPEC": (".toml", ["submit", "{f}", "--dry-run"]),
    "submit SCRIPT": (".sbatch", ["submit", "{f}", "--dry-run"]),
    "doctor --job": (".sbatch", ["doctor", "--no-torch", "--job", "{f}"]),
    "train --config": (
        ".toml",
        ["train", "--config", "{f}", "--synthetic", "--epochs", "1", "--run-dir", "{dir}/run"],
    ),
}
# In a child whose memory is capped: a reader that blocks on a FIFO or reads /dev/zero to its
# end fails the test (timeout, MemoryError traceback) instead of hanging or starving it.
_READ_IN_CHILD = """
import contextlib, io, json, sys
from hpc_ddp.cli import main
cap_memory()
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


@pytest.mark.parametrize("reader", list(_READERS))
def test_a_spec_file_that_is_no_small_text_file_is_refused_naming_it(
    tmp_path: Path, reader: str
) -> None:
    suffix, argv = _READERS[reader]
    files = _hostile_files(tmp_path / "in", suffix)
    work = tmp_path / "work"
    work.mkdir()
    runs = [[a.format(f=path, dir=work) for a in argv] for path, _ in files.values()]
    results = run_child(_READ_IN_CHILD, json.dumps(runs), timeout=60)
    for (name, (path, needle)), (code, err) in zip(files.items(), results, strict=True):
        assert code == 2, (name, err)
        assert str(path) in err and needle in err and "HINT" in err, (name, err)
    assert list(work.iterdir()) == []  # no script, no run dir
