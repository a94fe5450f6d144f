"""Any Python function through ``hpc_ddp.Executor``: submitit's LocalExecutor on this machine and
its AutoExecutor on the real local Slurm cluster (sbatch, srun, scontrol, scancel, all real).

Nothing is mocked. The functions live in tests/fn_support.py, which the jobs import by name.
Preemption is ``scancel --signal=USR2``, what Slurm's ``--signal=USR2@N`` sends before the limit.
The local cluster has no GPUs and no node features of its own: the constraint test gives its
nodes a feature with ``scontrol update`` (as an admin would), the GPU test uses the fake-GPU
cluster (gres over character devices).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import fn_support
import pytest
from slurm_support import HPC_DDP, clean_job_env, late_reply_scontrol_path

import hpc_ddp
from hpc_ddp.deploy.submitit.parameters import executor_parameters, extra_sbatch_parameters
from hpc_ddp.errors import ConfigError
from hpc_ddp.localslurm import wait_for
from hpc_ddp.slurm_client import TERMINAL, parse_show_job

TESTS = Path(__file__).parent
REPO = TESTS.parent


def _pythonpath() -> str:
    """The jobs unpickle tests/fn_support.py's functions: tests/ must be importable there."""
    return os.pathsep.join(filter(None, [str(REPO), str(TESTS), os.environ.get("PYTHONPATH")]))


@pytest.fixture
def importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", _pythonpath())


def test_a_function_runs_in_every_local_task_with_the_process_group(
    tmp_path: Path, importable: None
) -> None:
    ex = hpc_ddp.Executor(tmp_path / "f", "local", distributed=True, procs_per_node=2, time="5")
    job = ex.submit(fn_support.all_reduce, 3)
    assert job.results() == [(0, 2, 9.0), (1, 2, 9.0)]  # 3*1 + 3*2 on both ranks


def test_map_array_runs_one_local_job_per_element(tmp_path: Path, importable: None) -> None:
    ex = hpc_ddp.Executor(tmp_path / "f", "local", procs_per_node=2, cpus_per_task=3)
    jobs = ex.map_array(fn_support.whoami, ["a", "b"])
    results = [job.results() for job in jobs]
    assert [[r["tag"] for r in rs] for rs in results] == [["a", "a"], ["b", "b"]]
    first = results[0]
    assert [(r["RANK"], r["WORLD_SIZE"], r["MASTER_ADDR"]) for r in first] == [
        ("0", "2", "127.0.0.1"),
        ("1", "2", "127.0.0.1"),
    ]
    assert first[0]["OMP_NUM_THREADS"] == "3"  # the spec's derived environment reached fn


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"args": ["--epochs", "1"]}, "args do not apply"),
        ({"requeue": False}, "requeue = false"),
        ({"resv_ports": True}, "resv_ports"),
        ({"python": "python3.9"}, "python 'python3.9'"),
        ({"launcher": "torchrun"}, "launcher"),
        ({"extra_sbatch": ["--output=x.log"]}, r"extra_sbatch\[0\] '--output=x.log'"),
        ({"extra_sbatch": ["--array=0-3"]}, "submitit writes --array itself"),
        ({"mem": "lots"}, "mem 'lots'"),
        ({"nodes": "1-2"}, "nodes '1-2': submitit counts a job's tasks"),
        ({"slurm_no_such_thing": 1}, "submitit refused the executor's parameters"),
    ],
)
def test_what_submitit_cannot_honour_is_refused_by_name(
    tmp_path: Path, changes: dict, needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle):
        ex = hpc_ddp.Executor(tmp_path / "f", "slurm", **changes)
        ex.submit(fn_support.whoami, "never")
    assert not (tmp_path / "f").exists() or not any((tmp_path / "f").iterdir())


def test_local_executor_refuses_several_nodes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="one machine; the spec asks for 2 nodes"):
        hpc_ddp.Executor(tmp_path / "f", "local", nodes=2).submit(fn_support.whoami, "x")
    with pytest.raises(ConfigError, match="not one of slurm, local"):
        hpc_ddp.Executor(tmp_path / "f", "pbs")  # type: ignore[arg-type]


def test_every_slurm_field_becomes_a_submitit_parameter() -> None:
    spec = hpc_ddp.JobSpec(
        name="p", nodes=2, gpus_per_node=4, gpus_per_process=2, gpu_binding="gpus-per-task",
        partition="gpu", account="a", qos="high", constraint="h100", mem="64G", time="90",
        workdir="/w", setup=["module load x"], exit_wait_s=30, signal_lead_s=120,
        extra_sbatch=["--exclusive", "--gres=nic:1"],
    )  # fmt: skip
    assert executor_parameters(spec, "submitit") == {
        "timeout_min": 90, "tasks_per_node": 2, "nodes": 2, "name": "p",
        "slurm_gpus_per_task": 2, "slurm_partition": "gpu", "slurm_account": "a",
        "slurm_qos": "high", "slurm_constraint": "h100", "slurm_signal_delay_s": 120,
        "slurm_setup": ["module load x"], "slurm_srun_args": ["--wait=30"],
        "slurm_additional_parameters": {
            "requeue": True, "mem": "64G", "chdir": "/w", "exclusive": True, "gres": "nic:1",
        },
    }  # fmt: skip
    per_node = executor_parameters(spec.replace(gpu_binding="gpus-per-node"), "submitit")
    assert per_node["gpus_per_node"] == 4 and "slurm_gpus_per_task" not in per_node
    assert extra_sbatch_parameters(["--comment=a=b"]) == {"comment": "a=b"}


def test_describe_says_which_fields_submitit_replaces_or_ignores(tmp_path: Path) -> None:
    spec = hpc_ddp.JobSpec(output="x.out", qos="high", args=["--run-dir", "r"])
    local = hpc_ddp.describe(spec, "local", folder=tmp_path / "f", cwd=tmp_path).text
    assert "# not used: output: submitit writes every task's log" in local
    assert "# not used: qos: no Slurm under the local executor" in local
    on_slurm = hpc_ddp.describe(spec, "submitit", folder=tmp_path / "f", cwd=tmp_path).text
    assert "slurm_qos=high" in on_slurm and "not used: qos" not in on_slurm
    assert not any(tmp_path.iterdir())


def _show(cluster, job_id: str) -> dict[str, str]:
    return parse_show_job(cluster.run(["scontrol", "show", "job", job_id]).stdout)


@pytest.mark.slurm
def test_a_function_on_slurm_gets_every_field_of_its_spec(slurm_cluster, tmp_path: Path) -> None:
    """2 nodes x 1 task, the process group started in each; the spec's Slurm settings are what
    ``scontrol show job`` reports. This Slurm has no accounting (AccountingStorageType=none): it
    accepts --qos and keeps no QOS (``QOS=(null)``), so the QOS is read from the batch script
    Slurm stored."""
    for node in slurm_cluster.node_names:
        slurm_cluster.run(["scontrol", "update", f"NodeName={node}", "AvailableFeatures=fnx",
                           "ActiveFeatures=fnx"])  # fmt: skip
    env = {**slurm_cluster.env, "PYTHONPATH": _pythonpath()}
    ex = hpc_ddp.Executor(tmp_path / "f", "slurm", cluster_env=env, distributed=True)
    ex.update_parameters(
        name="fn-fields", nodes=2, procs_per_node=1, cpus_per_task=2, time="7", qos="normal",
        mem="100M", constraint="fnx", extra_sbatch=["--comment=from-the-spec"],
        setup=["export FN_SETUP=ran"], env={"FN_ENV": "x"},
    )  # fmt: skip
    job = ex.submit(fn_support.all_reduce, 2)
    assert job.results() == [(0, 2, 6.0), (1, 2, 6.0)]
    # The results are written before Slurm ends the job (its steps and epilog still run).
    wait_for(lambda: slurm_cluster.job_state(job.job_id) in TERMINAL, 60, "the job to end")
    info = _show(slurm_cluster, job.job_id)
    expected = {
        "JobName": "fn-fields", "NumNodes": "2", "NumTasks": "2", "CPUs/Task": "2",
        "TimeLimit": "00:07:00", "MinMemoryNode": "100M", "Features": "fnx",
        "Comment": "from-the-spec", "Requeue": "1", "JobState": "COMPLETED",
    }  # fmt: skip
    assert {k: info.get(k, "").strip() for k in expected} == expected, info
    script = slurm_cluster.run(["scontrol", "write", "batch_script", job.job_id, "-"]).stdout
    assert "#SBATCH --qos=normal" in script and "export FN_SETUP=ran" in script, script
    assert "--wait=120" in script  # exit_wait_s: srun --wait, as in the rendered scripts
    seen = ex.submit(fn_support.whoami, "s").results()
    assert [r["FN_SETUP"] for r in seen] == ["ran", "ran"]  # the setup line ran before srun


@pytest.mark.slurm
def test_map_array_on_slurm_is_one_slurm_array(slurm_cluster, tmp_path: Path) -> None:
    env = {**slurm_cluster.env, "PYTHONPATH": _pythonpath()}
    ex = hpc_ddp.Executor(tmp_path / "f", "slurm", cluster_env=env, procs_per_node=2)
    jobs = ex.map_array(fn_support.whoami, ["a", "b"])
    assert [[r["tag"] for r in job.results()] for job in jobs] == [["a", "a"], ["b", "b"]]
    array_id = jobs[0].job_id.split("_")[0]
    assert [job.job_id for job in jobs] == [f"{array_id}_0", f"{array_id}_1"]
    info = _show(slurm_cluster, jobs[1].job_id)
    assert (info["ArrayJobId"], info["ArrayTaskId"], info["NumTasks"]) == (array_id, "1", "2")


@pytest.mark.slurm
@pytest.mark.slow
def test_a_preempted_function_is_requeued_and_called_again(slurm_cluster, tmp_path: Path) -> None:
    """USR2 -> submitit's handler on rank 0 -> FunctionTask.checkpoint() (Checkpointable: the
    same call) -> scontrol requeue -> the function runs again and returns. The job's scontrol
    answers late (late_reply_scontrol_path): the requeue's own SIGTERM reaches it first, and
    must not make it fail (submitit would record the first attempt as failed)."""
    path = late_reply_scontrol_path(tmp_path / "bin", slurm_cluster.env)
    env = {**slurm_cluster.env, "PYTHONPATH": _pythonpath(), "PATH": path}
    ex = hpc_ddp.Executor(tmp_path / "f", "slurm", cluster_env=env, time="10")
    job = ex.submit(fn_support.hold_once, str(tmp_path))
    wait_for(lambda: (tmp_path / "holding").exists(), 120, "the first run holding")
    slurm_cluster.run(["scancel", "--signal=USR2", job.job_id])
    assert job.result() == 2  # the second call's return value
    assert _show(slurm_cluster, job.job_id)["Restarts"] == "1"
    said = Path(job.paths.stdout).read_text()
    assert "Calling checkpoint method" in said
    assert f"Requeued job {job.job_id}" in said, said  # scontrol exited 0, 3 s after its SIGTERM


@pytest.mark.slurm
def test_the_gpu_binding_reaches_slurm(slurm_gpu_cluster, tmp_path: Path) -> None:
    """Held jobs (never started): Slurm records the GPUs per node or per task the spec asks."""
    env = {**slurm_gpu_cluster.env, "PYTHONPATH": _pythonpath()}
    tres = {}
    for binding in ("gpus-per-node", "gpus-per-task"):
        ex = hpc_ddp.Executor(tmp_path / binding, "slurm", cluster_env=env)
        ex.update_parameters(gpus_per_node=2, gpu_binding=binding, extra_sbatch=["--hold"])
        job = ex.submit(fn_support.whoami, binding)
        info = _show(slurm_gpu_cluster, job.job_id)
        slurm_gpu_cluster.run(["scancel", job.job_id])
        tres[binding] = (info.get("TresPerNode", ""), info.get("TresPerTask", ""), info["NumTasks"])
    assert tres == {
        "gpus-per-node": ("gres:gpu:2", "", "2"),
        "gpus-per-task": ("", "gres:gpu:1", "2"),
    }, tres


README_LINE = """
import fn_support, hpc_ddp, hpc_ddp.polling, hpc_ddp.slurm_client
job = hpc_ddp.Executor({folder!r}, cluster="slurm").submit(fn_support.whoami, "readme")
results = [r["tag"] for r in job.results()]
# The result pickle lands a moment before Slurm marks the job done, and submitit's watcher
# answers from a cache it refreshes every few seconds: wait for an ended state, bounded.
ended = lambda: job.state in hpc_ddp.slurm_client.TERMINAL
hpc_ddp.polling.wait_for(ended, 60, "the job's end in Slurm", 0.5)
print("results", results, job.state)
"""


@pytest.mark.slurm
def test_the_readme_line_works_without_a_configured_slurm(tmp_path: Path) -> None:
    """No SLURM_CONF and no configuration: the README's Executor line chooses the cluster as
    `hpc-ddp submit` does (here the embedded one, started in a dir of this test's), says which,
    and reports the job's state from scontrol: no `sacct: fatal` line or submitit warning. Before,
    sbatch failed with 'Could not establish a configuration source'."""
    # A short dir: Slurm's step sockets live under it (conftest reaps hpcddp-* of killed runs).
    embedded = Path(tempfile.mkdtemp(prefix="hpcddp-fn-", dir="/tmp")) / "slurm"
    env = clean_job_env(PYTHONPATH=_pythonpath(), HPC_DDP_LOCAL_SLURM_DIR=str(embedded))
    env.pop("SLURM_CONF", None)
    code = README_LINE.format(folder=str(tmp_path / "fn"))
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
            timeout=180,
        )  # fmt: skip
    finally:
        subprocess.run([str(HPC_DDP), "cluster", "down"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(embedded.parent, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "results ['readme'] COMPLETED" in proc.stdout, proc.stdout
    assert f"Slurm: the embedded local cluster in {embedded}" in proc.stderr
    assert "fatal" not in proc.stderr and "sacct" not in proc.stderr, proc.stderr


def test_a_function_gets_resumable_like_a_script(tmp_path: Path, importable: None) -> None:
    """hpc_ddp.Resumable inside an Executor function: the second call, asked for more epochs,
    continues from the first's checkpoint instead of starting over."""
    ex = hpc_ddp.Executor(tmp_path / "f", "local", distributed=True, procs_per_node=2, time="5")
    run_dir = str(tmp_path / "run")
    first = ex.submit(fn_support.resumable_steps, run_dir, 1).results()
    assert first == [(4, 1, None), (4, 1, None)]  # 64 samples / 2 ranks / batch 8
    again = ex.submit(fn_support.resumable_steps, run_dir, 2).results()
    step4 = f"{run_dir}/checkpoints/step-00000004"
    assert again == [(8, 2, step4), (8, 2, step4)]
