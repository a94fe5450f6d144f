"""The public API: ``import hpc_ddp`` is torch-free, every listed name resolves and documents
itself, and the names that need torch load it only when used."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from trainer_helpers import forked_cmd, read_result, run, train_args

import hpc_ddp

TORCH_FREE = (
    "DistEnv", "detect_env", "torch_contract", "JobSpec", "load_job_spec", "render", "HpcDdpError",
    "doctor", "Check", "run_dir_report", "nccl_dump_report", "stop_launch", "run_training",
    "ShardPlan", "eval_indices", "cluster_up", "cluster_down", "running_cluster", "cluster_env",
    "ClusterUp", "LocalCluster",
)  # fmt: skip


def _python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.strip()


def test_all_lists_exactly_the_public_names() -> None:
    assert set(hpc_ddp.__all__) == {"__version__", *hpc_ddp._PUBLIC}
    assert len(hpc_ddp.__all__) == len(set(hpc_ddp.__all__))


def test_every_public_name_resolves_and_has_a_contract() -> None:
    for name in hpc_ddp._PUBLIC:
        value = getattr(hpc_ddp, name)
        if callable(value):
            assert (value.__doc__ or "").strip(), f"hpc_ddp.{name} has no docstring"


def test_import_and_torch_free_names_do_not_import_torch() -> None:
    names = ", ".join(f"hpc_ddp.{n}" for n in TORCH_FREE)
    code = (
        "import sys, hpc_ddp\n"
        f"_ = ({names})\n"
        "spec = hpc_ddp.load_job_spec(None, {'nodes': 2, 'gpus_per_node': 8})\n"
        "assert '#SBATCH --nodes=2' in hpc_ddp.render(spec)\n"
        "plan = hpc_ddp.ShardPlan(n=101, seed=0, world_size=2, micro_batch=16)\n"
        "assert plan.steps_per_epoch() == 4 and list(hpc_ddp.eval_indices(5, 1, 2)) == [1, 3]\n"
        "print('torch' in sys.modules)\n"
    )
    assert _python(code) == "False"


def test_torch_names_load_torch_on_first_use() -> None:
    code = "import sys, hpc_ddp\nhpc_ddp.Checkpointer\nprint('torch' in sys.modules)\n"
    assert _python(code) == "True"


def test_unknown_name_is_an_attribute_error() -> None:
    try:
        hpc_ddp.no_such_thing  # noqa: B018
    except AttributeError as err:
        assert "no_such_thing" in str(err)
    else:  # pragma: no cover - the assertion below explains
        raise AssertionError("hpc_ddp.no_such_thing resolved")


def test_preemption_flag_from_a_real_signal(monkeypatch) -> None:
    """Without a process group, ``agreed`` is this process's own answer."""
    for key in list(os.environ):
        if key.startswith(("SLURM_", "SUBMITIT_")):
            monkeypatch.delenv(key)
    before = signal.getsignal(signal.SIGUSR1)
    pre = hpc_ddp.Preemption(["USR1"])
    try:
        assert not pre.requested and not pre.agreed()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert pre.requested and pre.agreed()
        assert "not inside a Slurm job" in pre.requeue()
        assert hpc_ddp.Preemption.EXIT_CODE == hpc_ddp.EXIT_REQUEUE == 75
    finally:
        pre.close()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_preemption_listens_for_submitits_signal_only_under_submitit(monkeypatch) -> None:
    """submitit warns with USR2 (or its SUBMITIT_PREEMPT_SIGNAL): a script's ``Preemption()``
    must catch it there, or the signal's default action kills the process before it saves."""
    for key in list(os.environ):
        if key.startswith(("SLURM_", "SUBMITIT_")):
            monkeypatch.delenv(key)
    before = signal.getsignal(signal.SIGUSR2)
    plain = hpc_ddp.Preemption()
    try:
        assert signal.getsignal(signal.SIGUSR2) == before  # outside submitit: left alone
    finally:
        plain.close()
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    for name, sig in (("", signal.SIGUSR2), ("HUP", signal.SIGHUP)):
        monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", name)
        pre = hpc_ddp.Preemption()
        try:
            os.kill(os.getpid(), sig)
            assert pre.requested and "submitit" in pre.requeue()  # submitit requeues itself
        finally:
            pre.close()


def test_run_training_is_the_train_command(tmp_path: Path) -> None:
    """hpc_ddp.run_training(args, nproc_per_node=2) ends where `hpc-ddp train args
    --nproc-per-node 2` does, bit for bit, with the command's exit code."""
    data = tmp_path / "data"
    cli = run(forked_cmd(2, train_args(tmp_path / "cli", data)))
    assert cli.returncode == 0, cli.stderr
    args = train_args(tmp_path / "api", data)
    code = f"import hpc_ddp; hpc_ddp.run_training({args!r}, nproc_per_node=2)"
    api = run([sys.executable, "-c", code])
    assert api.returncode == 0, api.stderr
    assert (
        read_result(tmp_path / "api")["params_sha256"]
        == read_result(tmp_path / "cli")["params_sha256"]
    )
    assert read_result(tmp_path / "api")["world_size"] == 2
