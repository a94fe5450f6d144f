"""hpc_ddp.Resumable: a plain DDP script made preemption-safe with exact resume in a few lines.

examples/plain_ddp.py knows nothing of hpc-ddp; examples/resumable_ddp.py is the same script with
the lines docs/your-code.md shows. Interrupted by a real signal at whatever step the timing
gives (each optimizer step slowed by tests/workers/slow_steps.py, so that the signal lands mid-run)
and started again, it must end with the uninterrupted run's weights, bit for bit: under torchrun
here, and on the local Slurm's torchrun layout (2 nodes x 2 tasks: real sbatch, srun, torchrun,
scancel --signal, scontrol requeue). Not real: a second physical host, GPUs (CPU and Gloo here).
"""

from __future__ import annotations

import difflib
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_support import Counter
from launch_support import REPO, hpc_ddp
from trainer_helpers import TORCHRUN, finish, forked_script, python_cmd, run, start

import hpc_ddp as hpc_ddp_api
from hpc_ddp.checkpoint import CheckpointError
from hpc_ddp.checkpoint.manifest import _self_hash
from hpc_ddp.slurm_client import TERMINAL, wait_for
from hpc_ddp.train.fingerprint import params_sha256

PLAIN = REPO / "examples" / "plain_ddp.py"
RESUMABLE = REPO / "examples" / "resumable_ddp.py"
SLOW = str(REPO / "tests" / "workers" / "slow_steps.py")
EPOCHS = ["--epochs", "3"]
STEPS_PER_EPOCH = {2: 32, 4: 16}  # 2048 samples, batch 32, per world size
PREEMPTED = re.compile(r"preempted at step (\d+): checkpointed")


def _sha(run_dir: Path) -> str:
    return params_sha256(torch.load(run_dir / "model.pt", weights_only=True))


def _code_lines(path: Path) -> list[str]:
    """The script's lines after its docstring, without comments: what a user edits."""
    text = path.read_text()
    body = text.split('"""', 2)[2]
    return [re.sub(r"\s+#.*$", "", line) for line in body.splitlines()]


def test_the_resumable_script_differs_from_the_plain_one_by_at_most_10_lines() -> None:
    diff = difflib.ndiff(_code_lines(PLAIN), _code_lines(RESUMABLE))
    added = [line for line in diff if line.startswith("+ ") and line[2:].strip()]
    assert len(added) <= 10, added
    assert "import hpc_ddp" not in PLAIN.read_text()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The uninterrupted runs' weights at world 2 and 4 (forked ranks on this machine: the runs
    under test are torchrun's and Slurm's)."""
    shas = {}
    for world in (2, 4):
        run_dir = tmp_path_factory.mktemp(f"ref{world}") / "run"
        cmd = forked_script(world, str(RESUMABLE), [*EPOCHS, "--run-dir", str(run_dir)])
        done = run(cmd, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        shas[world] = _sha(run_dir)
    return shas


def test_torchrun_interrupted_mid_epoch_resumes_bit_identical(
    reference: dict[int, str], tmp_path: Path
) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "first.log"
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node=2", SLOW, "0.05", str(RESUMABLE), *EPOCHS]
    proc = start([*cmd, "--run-dir", str(run_dir)], log)
    wait_for(lambda: "epoch 1:" in log.read_text() or proc.poll() is not None, 120, "epoch 1")
    proc.send_signal(signal.SIGTERM)  # torchrun hands it to its workers
    rc, text = finish(proc, log)
    step = int(PREEMPTED.search(text)[1])
    assert rc != 0 and step % STEPS_PER_EPOCH[2] != 0, text  # torchrun reports 75 as 1
    assert not (run_dir / "model.pt").exists()

    resume = [*EPOCHS, "--run-dir", str(run_dir)]
    again = run(forked_script(2, str(RESUMABLE), resume), timeout=180)  # resumes anywhere
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from {run_dir / 'checkpoints'}/step-{step:08d}: epoch 2, step {step}" in (
        again.stdout
    ), again.stdout
    assert _sha(run_dir) == reference[2]


def test_a_ddp_run_does_not_import_the_sharded_checkpoint_machinery(tmp_path: Path) -> None:
    """A model without DTensors is saved whole: speed_up and Resumable must not import
    torch.distributed.checkpoint nor torch.distributed.tensor to find that out (about a second
    and half a second of every trainer start on the GPU machine). A fresh interpreter, as a
    user's process is."""
    code = (
        "import sys, torch, hpc_ddp\n"
        "net = hpc_ddp.speed_up(torch.nn.Linear(2, 2)).model\n"
        # torch.optim's own constructor imports torch._dynamo, and with it the DTensor module
        "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.tensor')))\n"
        "opt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
        f"run = hpc_ddp.Resumable({str(tmp_path / 'run')!r}, model=net, optimizer=opt)\n"
        "run.save(); run.close()\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    printed = [line for line in done.stdout.splitlines() if line.startswith("[")]
    assert printed == ["[]", "[]"], done.stdout


def test_what_cannot_resume_is_refused_by_name(tmp_path: Path) -> None:
    code = (
        "import torch, hpc_ddp\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "data = TensorDataset(torch.zeros(8, 2))\n"
        "for bad in (dict(loader=DataLoader(data, 2, shuffle=True)), dict(model=object())):\n"
        "    try:\n"
        "        hpc_ddp.Resumable('/nonexistent/never', **bad)\n"
        "    except hpc_ddp.HpcDdpError as err:\n"
        "        print(str(err).replace('\\n', ' '))\n"
    )
    script = tmp_path / "refused.py"
    script.write_text(code)
    done = run(python_cmd(str(script), []))  # forked: the interpreter's start is not tested
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stdout + done.stderr
    assert "RandomSampler" in lines[0] and "DistributedSampler" in lines[0]
    assert "object has no state_dict" in lines[1]
    assert not Path("/nonexistent/never").exists()


@pytest.mark.parametrize(
    "key,value", [("epoch", -1), ("step", "7"), ("samples", -64), ("samples", True)]
)
def test_a_position_out_of_range_in_a_rehashed_manifest_is_refused_by_name(
    tmp_path: Path, key: str, value: object
) -> None:
    """The counters a resume continues from are read from the manifest's meta: someone who
    rewrites one (and fixes the self-checksum) gets a clear error naming it, not a traceback or
    a run that starts at epoch -1."""
    model = torch.nn.Linear(2, 2)
    run_dir = tmp_path / "run"
    first = hpc_ddp_api.Resumable(run_dir, model=model)
    first.save()
    first.close()
    path = next((run_dir / "checkpoints").glob("step-*")) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["meta"][key] = value
    manifest["manifest_sha256"] = _self_hash(manifest)
    path.write_text(json.dumps(manifest))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(CheckpointError) as err:
        hpc_ddp_api.Resumable(run_dir, model=model).close()
    assert f"meta[{key!r}] is {value!r}, not an integer >= 0" in str(err.value)
    assert signal.getsignal(signal.SIGTERM) == before  # its handlers gone with the error


def test_a_loop_of_its_own_saves_in_the_background_and_restores_when_ready(
    tmp_path: Path,
) -> None:
    """The lower-level use the built-in trainer makes of Resumable, in one process: a copy
    staged early, a background save with extra meta, ``keep`` honoured, the newest checkpoint
    named, and a restore the caller starts and may refuse before anything changes."""
    from hpc_ddp import ConfigError, Resumable
    from hpc_ddp.checkpoint.manifest import read_manifest

    def make(**options: object) -> tuple[Resumable, torch.nn.Linear, Counter]:
        net, counter = torch.nn.Linear(2, 2), Counter()
        run = Resumable(tmp_path, signals=[], keep=1, log=lambda _: None, model=net,
                        counter=counter, **options)  # type: ignore[arg-type]  # fmt: skip
        return run, net, counter

    run, net, counter = make(async_save=True)
    for step in (3, 5):
        run.steps, counter.n = step, step * 10
        staged, saved = run.stage("model"), net.weight.detach().clone()
        with torch.no_grad():
            net.weight.add_(1.0)  # after the stage: the checkpoint keeps the staged weights
        assert run.save(meta={"start": step}, staged=staged) is None  # in the background
        assert run.wait() == tmp_path / "checkpoints" / f"step-{step:08d}"
    assert run.newest == tmp_path / "checkpoints" / "step-00000005"
    steps = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert steps == ["step-00000005"]  # keep=1
    assert read_manifest(run.newest)["meta"]["start"] == 5
    run.close()

    again, net2, counter2 = make(restore=False)
    assert again.resumed_from is None and counter2.n == 0  # nothing until restore()

    def refuse(loaded: object) -> None:
        raise ConfigError("not this one")

    with pytest.raises(ConfigError, match="not this one"):
        again.restore(refuse)
    assert counter2.n == 0 and again.steps == 0
    loaded = again.restore()
    assert loaded is not None and loaded.path == again.resumed_from == run.newest
    assert (again.steps, counter2.n) == (5, 50)
    assert torch.equal(net2.weight, saved)  # the staged copy, not the later change
    again.close()


# --- the local Slurm: the torchrun layout ------------------------------------------------------
# One job, the torchrun layout, where rank 0 of a script's job asks for the requeue itself
# (requeue("auto") runs scontrol requeue). The srun layout's path (exit 75, the batch shell
# requeues; requeue("auto") only says so) is the one a script on hpc_ddp.Preemption takes too:
# test_example_script.py's Slurm job, at world 4 as well. Under submitit, Resumable's Preemption
# and requeue("auto") are that script's: test_example_script.py's submitit job.
def _render(cwd: Path, launcher: str) -> Path:
    job = cwd / "job.sbatch"
    res = hpc_ddp(
        ["render", "--name", f"resumable-{launcher}", "--nodes", "2", "--procs-per-node", "2",
         "--launcher", launcher, "--time", "5", "--signal-lead-s", "60", "--python",
         sys.executable, "--script", SLOW, "--script-out", str(job), "--",
         "0.1", str(RESUMABLE), *EPOCHS, "--run-dir", str(cwd / "run")]
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return job


@pytest.mark.slurm
@pytest.mark.slow
def test_slurm_torchrun_layout_preempted_requeued_resumes_bit_identical(
    slurm_cluster, reference: dict[int, str], tmp_path: Path
) -> None:
    """A real `scancel --signal=USR1` once epoch 1 is printed, in the torchrun layout: rank 0
    runs scontrol requeue, Slurm restarts the job, which resumes and ends with the
    uninterrupted run's weights."""
    job_id, log = slurm_cluster.sbatch(
        _render(tmp_path, "torchrun"), output=tmp_path / "job.out", cwd=tmp_path
    )
    wait_for(lambda: log.exists() and "epoch 1:" in log.read_text(), 120, "epoch 1")
    slurm_cluster.run(["scancel", "--signal=USR1", job_id])
    wait_for(
        lambda: slurm_cluster.job_state(job_id) in TERMINAL
        and (tmp_path / "run" / "model.pt").exists(),
        240, f"job {job_id} to end",
    )  # fmt: skip
    info, text = slurm_cluster.job_info(job_id), log.read_text()
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), text
    assert PREEMPTED.search(text) and "resumed from" in text, text
    assert f"requeued Slurm job {job_id} (scontrol requeue)" in text, text  # rank 0 asked
    assert _sha(tmp_path / "run") == reference[4]


# --- elastic: preempted on W ranks, resubmitted on W' -----------------------------------------
ELASTIC = str(REPO / "tests" / "workers" / "elastic_samples.py")
ELASTIC_SAMPLES, ELASTIC_STEPS = 2000, {2: 32, 4: 16}  # per epoch, batch 32


def _elastic_job(cwd: Path, name: str, nodes: int) -> Path:
    """``nodes`` x 2 tasks of the sample-logging script, steps slowed so that a signal at the end
    of epoch 1 lands mid-epoch 2; --no-requeue: a preempted job ends, and is resubmitted."""
    job = cwd / f"{name}.sbatch"
    res = hpc_ddp(
        ["render", "--name", f"elastic-{name}", "--nodes", str(nodes), "--procs-per-node", "2",
         "--launcher", "srun", "--time", "5", "--no-requeue", "--python", sys.executable,
         "--script", SLOW, "--script-out", str(job), "--",
         "0.1", ELASTIC, "--epochs", "2", "--run-dir", str(cwd / "run")]
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return job


def _trained_on(run_dir: Path) -> dict[int, list[int]]:
    """Epoch -> every index the ranks logged training on, over all jobs (the script's own log)."""
    seen: dict[int, list[int]] = {}
    for path in (run_dir / "samples").glob("*.txt"):
        for line in path.read_text().splitlines():
            epoch, index = map(int, line.split())
            seen.setdefault(epoch, []).append(index)
    return seen


@pytest.mark.slurm
@pytest.mark.slow
def test_slurm_preempted_on_w_ranks_resumes_on_another_number_of_ranks(
    slurm_cluster, tmp_path: Path
) -> None:
    """2 nodes x 2 tasks preempted (a real `scancel --signal=USR1` mid-epoch 2) and resubmitted
    as 1 x 2; beside it, 2 forked ranks preempted the same way (USR1 to their parent, which
    hands it on) and resumed on 4: the world shrinks on Slurm and grows where the launcher is
    not the question (which samples a resumed run takes is the library's arithmetic, whatever
    started the ranks). Every sample of every epoch was trained on
    exactly once across the interruption (2000 samples: no padding, a short last batch), by the
    script's own per-sample log; the run said where it resumed; it learns as an uninterrupted
    run does (held-out accuracy)."""
    pairs = {"4to2": (4, 2), "2to4": (2, 4)}  # the first run's ranks, the resumed run's
    for name in pairs:
        (tmp_path / name).mkdir()
    slurm_dir, forked_dir = tmp_path / "4to2", tmp_path / "2to4"
    job_id, slurm_log = slurm_cluster.sbatch(
        _elastic_job(slurm_dir, "first", 2), output=slurm_dir / "first.out", cwd=slurm_dir
    )
    forked_log = forked_dir / "first.out"
    slowed = ["0.1", ELASTIC, "--epochs", "2", "--run-dir", str(forked_dir / "run")]
    forked = start(forked_script(2, SLOW, slowed), forked_log)
    signalled: set[str] = set()

    def signal_each_at_epoch_1() -> bool:
        if "4to2" not in signalled and slurm_log.exists() and "epoch 1:" in slurm_log.read_text():
            slurm_cluster.run(["scancel", "--signal=USR1", job_id])
            signalled.add("4to2")
        if "2to4" not in signalled and forked_log.exists() and "epoch 1:" in forked_log.read_text():
            forked.send_signal(signal.SIGUSR1)
            signalled.add("2to4")
        elif "2to4" not in signalled and forked.poll() is not None:
            text = forked_log.read_text() if forked_log.exists() else ""
            raise AssertionError(f"the forked run ended before its signal:\n{text}")
        return len(signalled) == len(pairs)

    try:
        wait_for(signal_each_at_epoch_1, 120, "epoch 1 in both runs", interval_s=0.1)
        wait_for(lambda: slurm_cluster.job_state(job_id) in TERMINAL, 120, "4to2 to stop")
    except BaseException:
        forked.kill()
        raise
    rc, forked_text = finish(forked, forked_log)
    assert rc == 75, forked_text
    first = {"4to2": slurm_log.read_text(), "2to4": forked_text}
    steps = {name: int(PREEMPTED.search(text)[1]) for name, text in first.items()}
    for name, (world, _) in pairs.items():
        assert steps[name] % ELASTIC_STEPS[world] != 0, first[name]  # mid-epoch
    second_id, second_log = slurm_cluster.sbatch(
        _elastic_job(slurm_dir, "second", 1), output=slurm_dir / "second.out", cwd=slurm_dir
    )
    grown = run(forked_script(4, ELASTIC, ["--epochs", "2", "--run-dir", str(forked_dir / "run")]))
    wait_for(lambda: slurm_cluster.job_state(second_id) in TERMINAL, 180, "4to2 to end")
    assert slurm_cluster.job_state(second_id) == "COMPLETED", second_log.read_text()
    assert grown.returncode == 0, grown.stdout + grown.stderr
    resumed = {"4to2": second_log.read_text(), "2to4": grown.stdout + grown.stderr}
    accuracy = {}
    for name, (world, new_world) in pairs.items():
        at = (steps[name] - ELASTIC_STEPS[world]) * 32 * world  # samples of epoch 2 before it
        said = f"resumed from {world} to {new_world} ranks at sample {at} of epoch 2"
        assert said in resumed[name], resumed[name]
        seen = _trained_on(tmp_path / name / "run")
        assert sorted(seen) == [0, 1]
        for epoch, indices in seen.items():
            assert sorted(indices) == list(range(ELASTIC_SAMPLES)), (name, epoch)
        accuracy[name] = json.loads((tmp_path / name / "run" / "accuracy.json").read_text())
    ref = tmp_path / "ref"
    done = run(forked_script(2, ELASTIC, ["--run-dir", str(ref)]))
    assert done.returncode == 0, done.stdout + done.stderr
    expected = json.loads((ref / "accuracy.json").read_text())["accuracy"]
    assert expected > 0.85  # 4 classes: chance is 0.25
    for name, result in accuracy.items():
        assert abs(result["accuracy"] - expected) < 0.05, (name, result, expected)
