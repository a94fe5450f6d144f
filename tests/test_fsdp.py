"""FSDP2 (fully_shard) with hpc_ddp.Resumable: sharded checkpoints through
torch.distributed.checkpoint under the project's commit protocol.

Real torchrun, real Gloo ranks on CPU (tests/workers/fsdp_worker.py), real signals: a run
preempted mid-epoch (sync and async saves) resumes to the uninterrupted run's weights and
optimizer state bit for bit; a rank SIGKILLed inside a save leaves the previous checkpoint
committed; a torn shard file falls back to the previous checkpoint; a checkpoint written by 2
ranks loads into 1 and one written by 1 into 2 with the same parameters. The GPU tests (bf16
mixed precision, NCCL, 2 GPUs) skip where fewer than two CUDA GPUs are visible.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from cli_forkserver import ForkedCli
from trainer_helpers import (
    TORCHRUN,
    assert_resumed_like,
    finish,
    forked_cmd,
    holding,
    interrupt_at,
    job_env,
    python_cmd,
    read_metrics,
    read_result,
    reference_run,
    run,
    signal_workers,
    train_args,
    wait_for_progress,
)

from hpc_ddp.errors import ConfigError
from hpc_ddp.runtime.sharded_state import from_opaque
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.program_hook import HOOK
from hpc_ddp.train.state import preflight

REPO = Path(__file__).resolve().parent.parent
WORKER = str(REPO / "tests" / "workers" / "fsdp_worker.py")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
STEPS = 48  # 3 epochs of 512 samples, batch 16, at 2 ranks


def torchrun(world: int, run_dir: Path, out: Path, *extra: str, timeout: float = 180):
    cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={world}", WORKER]
    return run([*cmd, "--run-dir", str(run_dir), "--out", str(out), *extra], timeout=timeout)


def forked(world: int, run_dir: Path, out: Path, *extra: str, timeout: float = 180):
    """The same ranks forked from one interpreter after its imports (hpc_ddp.spawn), itself
    forked from the tests' fork server, which imported torch: a fraction of torchrun's start-up
    on this machine, for the runs whose launcher is not what is tested."""
    args = ["--nproc", str(world), "--run-dir", str(run_dir), "--out", str(out), *extra]
    return run(python_cmd(WORKER, args), timeout=timeout)


def same_state(a: Path, b: Path) -> None:
    """The gathered model and optimizer states of two runs are equal, bit for bit."""
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert x["model"].keys() == y["model"].keys()
    for key in y["model"]:
        assert torch.equal(x["model"][key], y["model"][key]), key
    sx, sy = x["optimizer"]["state"], y["optimizer"]["state"]
    assert sx.keys() == sy.keys() and sy
    for name in sy:
        for key in sy[name]:
            assert torch.equal(sx[name][key], sy[name][key]), (name, key)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The uninterrupted 2-rank run, on forked ranks (the preempted torchrun run below ends equal
    to it): its gathered state and its run directory."""
    d = tmp_path_factory.mktemp("fsdp-ref")
    done = forked(2, d / "run", d / "state.pt")
    assert done.returncode == 0, done.stdout + done.stderr
    return d / "state.pt", d / "run"


def test_sharded_checkpoint_is_written_by_every_rank_under_the_manifest(
    reference: tuple[Path, Path],
) -> None:
    root = reference[1] / "checkpoints"
    assert (root / "latest").read_text() == f"step-{STEPS:08d}\n"
    step = root / f"step-{STEPS:08d}"
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["payload"] == "dcp" and manifest["world_size"] == 2
    assert set(manifest["files"]) == {
        "dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "rank-00000.pt", "rank-00001.pt"
    }  # fmt: skip
    assert not (step / "shared.pt").exists()  # no rank holds, or writes, the whole state
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000032", "step-00000048"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_preempted_fsdp_run_resumes_bit_identical(
    reference: tuple[Path, Path], tmp_path: Path, mode: str
) -> None:
    """SIGUSR1 at step 21 (mid-epoch 2): checkpoint, exit 75; the rerun ends as the reference.
    Async: a save every 5 steps in the background, one in flight when the signal comes."""
    extra = ["--async", "--checkpoint-every", "5"] if mode == "async" else []
    launch = forked if mode == "async" else torchrun
    first = launch(2, tmp_path / "run", tmp_path / "x.pt", *extra, "--preempt-at", "21")
    assert first.returncode != 0, first.stdout  # torchrun reports the workers' 75 as 1
    assert "preempted at step 21: checkpointed" in first.stdout, first.stdout + first.stderr
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step-00000021\n"
    again = launch(2, tmp_path / "run", tmp_path / "state.pt", *extra)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "step-00000021: epoch 2, step 21" in again.stdout, again.stdout
    same_state(tmp_path / "state.pt", reference[0])


def test_rank_killed_inside_a_save_and_a_torn_shard_fall_back(
    reference: tuple[Path, Path], tmp_path: Path
) -> None:
    """Rank 1 SIGKILLed once its shards of step 32 are written: step 16 stays committed and
    the rerun resumes from it; then the newest checkpoint's shard file is truncated: the next
    load skips it, names why, and falls back."""
    first = forked(2, tmp_path / "run", tmp_path / "x.pt", "--kill-at-save", "32")
    assert first.returncode != 0
    assert "lost contact with the other ranks while saving step 32" in first.stdout + first.stderr
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000016"]
    again = forked(2, tmp_path / "run", tmp_path / "state.pt")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "step-00000016: epoch 2, step 16" in again.stdout
    same_state(tmp_path / "state.pt", reference[0])

    shard = root / f"step-{STEPS:08d}" / "dcp" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    load = forked(1, tmp_path / "run", tmp_path / "loaded.pt", "--load-only")
    assert load.returncode == 0, load.stdout + load.stderr
    assert "dcp/__1_0.distcp has" in load.stdout and "(truncated?)" in load.stdout, load.stdout
    assert "fell back to step-00000032" in load.stdout
    assert "loaded step 32 saved by 2 ranks" in load.stdout


def test_two_ranks_checkpoint_loads_into_one_and_one_into_two(
    reference: tuple[Path, Path], tmp_path: Path
) -> None:
    """DCP reshards: the gathered state after loading equals the saver's, bit for bit. The
    1-rank load checkpoints what it loaded, from its world of 1, for the 2-rank load."""
    one = tmp_path / "one"
    down = forked(1, reference[1], tmp_path / "down.pt", "--load-only", "--save-as", str(one))
    assert down.returncode == 0, down.stdout + down.stderr
    assert "loaded step 48 saved by 2 ranks" in down.stdout
    same_state(tmp_path / "down.pt", reference[0])
    assert (
        json.loads((one / "checkpoints" / "step-00000048" / "manifest.json").read_text())[
            "world_size"
        ]
        == 1
    )

    up = forked(2, one, tmp_path / "up.pt", "--load-only")
    assert up.returncode == 0, up.stdout + up.stderr
    assert "loaded step 48 saved by 1 ranks" in up.stdout
    same_state(tmp_path / "up.pt", reference[0])


def _one_rank(tmp_path: Path, code: str) -> list[str]:
    """``code`` as a script of one rank (its process group in a file under ``tmp_path``, its
    run dir ``tmp_path/run``), forked from the tests' fork server, which imported torch."""
    script = tmp_path / "one_rank.py"
    script.write_text(code)
    return python_cmd(str(script), [str(tmp_path / "run"), str(tmp_path / "s")])


FRESH_THEN_GROWN = """
import sys, torch, torch.distributed as dist, hpc_ddp
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)

class Counters:  # a loop's own state, whose shape changes as it runs
    def __init__(self):
        self.seen, self.last = [], None
    def state_dict(self):
        return {"seen": list(self.seen), "last": self.last}
    def load_state_dict(self, state):
        self.seen, self.last = state["seen"], state["last"]

def build():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(net[0])
    fully_shard(net)
    return net, torch.optim.AdamW(net.parameters(), lr=0.1), Counters()

net, opt, counters = build()
run = hpc_ddp.Resumable(sys.argv[1], model=net, optimizer=opt, counters=counters)
print("fresh optimizer state:", len(opt.state))
net(torch.ones(2, 4)).sum().backward()
opt.step()
counters.seen.append({"step": 1})
counters.last = {"loss": 0.5}
run.save()
net, opt, counters = build()  # a new attempt's objects: nothing seen, no last value
hpc_ddp.Resumable(sys.argv[1], model=net, optimizer=opt, counters=counters)
print("restored:", counters.seen, counters.last, [int(s["step"]) for s in opt.state.values()])
"""


def test_resumable_fsdp_starts_fresh_and_restores_counters_that_grew(tmp_path: Path) -> None:
    """A run with no checkpoint starts with an empty optimizer state (DCP's load target, made
    for a checkpoint there is none of, would step the optimizer once); an object that is not
    sharded is restored whatever shape its state took since it was built (DCP alone loads only
    the keys of the fresh object's state)."""
    done = run(_one_rank(tmp_path, FRESH_THEN_GROWN), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fresh optimizer state: 0" in done.stdout, done.stdout
    assert "restored: [{'step': 1}] {'loss': 0.5} [1, 1, 1, 1]" in done.stdout, done.stdout


# --- the trainer: hpc-ddp train --fsdp (CPU, Gloo) ---------------------------------------------
# SMALL: 256 samples, 2 epochs; here steps of 2 micro-batches of 8 (accumulated: the first
# keeps its gradients unreduced), 16 samples a step per rank: 8 steps an epoch on 2 ranks.
# Evaluation in batches of 10 over 101 test samples: 6 batches on rank 0 (51 samples), 5 on
# rank 1, which then runs one forward more, uncounted, since every FSDP forward gathers the
# weights with the other rank.
FSDP_ARGS = {"batch_size": 8, "accum_steps": 2, "eval_batch_size": 10}


# A model of the user's (--model FILE:FUNCTION) with BatchNorm: buffers, which FSDP2 does not
# shard and each rank updates on its own batches; a checkpoint must hold rank 0's, as evaluation
# uses them. Three blocks of parameters (the Flatten has none).
BN_MODEL = """
from torch import nn


def bn(num_classes):
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(4)),
        nn.Flatten(),
        nn.Sequential(nn.Linear(8 * 8 * 8, 32), nn.BatchNorm1d(32), nn.ReLU()),
        nn.Linear(32, num_classes),
    )
"""


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> dict[str, Path]:
    """Uninterrupted 2-rank runs of SMALL: LeNet with --fsdp and with DDP (the default), and
    the BatchNorm model with --fsdp."""
    d = tmp_path_factory.mktemp("trainer")
    (d / "bn_model.py").write_text(BN_MODEL)
    runs = {"bn_model": d / "bn_model.py"}
    runs["fsdp"] = reference_run(d / "fsdp", data_dir, fsdp=True, **FSDP_ARGS)
    runs["ddp"] = reference_run(d / "ddp", data_dir, **FSDP_ARGS)
    done = run(forked_cmd(2, bn_args(d / "bn", data_dir, runs)))
    assert done.returncode == 0, done.stderr
    runs["bn"] = d / "bn"
    return runs


def bn_args(run_dir: Path, data_dir: Path, runs: dict[str, Path]) -> list[str]:
    """The BatchNorm model's --fsdp run."""
    return train_args(run_dir, data_dir, fsdp=True, model=f"{runs['bn_model']}:bn", **FSDP_ARGS)


def test_trainer_fsdp_learns_as_ddp_with_exact_evaluation(
    fsdp_runs: dict[str, Path], data_dir: Path, train_cli: ForkedCli
) -> None:
    """On 2 ranks FSDP2 adds each gradient's two halves as DDP's all-reduce does, so the runs
    end bit for bit alike; the fingerprint is of the gathered weights, the same on every rank.
    --fsdp is part of a run's identity (a DDP checkpoint holds the whole state, an FSDP one
    shards it): the DDP run is not continued with it, refused at the start."""
    fsdp, ddp = read_result(fsdp_runs["fsdp"]), read_result(fsdp_runs["ddp"])
    assert fsdp["status"] == "finished" and fsdp["steps"] == 16 and fsdp["world_size"] == 2
    assert fsdp["test_accuracy"] > 0.3  # chance: 0.1
    assert fsdp["params_sha256"] == ddp["params_sha256"]
    assert fsdp["test_accuracy"] == ddp["test_accuracy"]
    assert fsdp["extra"] == {"allreduce_calls": 0, "cuda_graphs": False}
    rows = [r for r in read_metrics(fsdp_runs["fsdp"]) if "test_samples" in r]
    assert len(rows) == 2
    for row in rows:
        assert row["test_samples"] == 101 and row["test_samples_per_rank"] == [51, 50]
    manifest = json.loads(
        (fsdp_runs["fsdp"] / "checkpoints" / "step-00000016" / "manifest.json").read_text()
    )
    assert manifest["payload"] == "dcp"  # sharded: every rank wrote its shards

    args = train_args(fsdp_runs["ddp"], data_dir, fsdp=True, epochs=3, **FSDP_ARGS)
    done = train_cli.run(["train", *args])
    assert done.returncode == 2, done.stdout + done.stderr
    assert "holds a run with different settings (fsdp: False -> True)" in done.stderr


@pytest.fixture(scope="module")
def fsdp_preempted(
    tmp_path_factory: pytest.TempPathFactory, data_dir: Path, fsdp_runs: dict[str, Path]
) -> tuple[Path, Path]:
    """The BatchNorm model's 2-rank --fsdp run preempted by SIGUSR1 at step 11, 3 steps into
    epoch 2 (96 of its 256 samples): checkpointed (a background save, the default), exit 75.
    Its run dir, and a copy to resume elsewhere."""
    d = tmp_path_factory.mktemp("preempted")
    args = bn_args(d / "run", data_dir, fsdp_runs)
    rc, log = interrupt_at(
        forked_cmd(2, [*args, "--debug-hold-at-step", "11"]), d / "run", d / "log"
    )
    assert rc == 75 and "preempted (SIGUSR1): checkpointed at step 11" in log, log
    assert "parallelism: FSDP2 (fully_shard per block: 3 blocks, then the root), fp32" in log
    shutil.copytree(d / "run", d / "copy")
    return d / "run", d / "copy"


def test_trainer_fsdp_preempted_resumes_bit_identical(
    fsdp_runs: dict[str, Path], fsdp_preempted: tuple[Path, Path], data_dir: Path
) -> None:
    """Resumed on 2 ranks, the preempted run ends as the uninterrupted one: weights and
    BatchNorm statistics, losses, accuracy."""
    run_dir = fsdp_preempted[0]
    final = run(forked_cmd(2, bn_args(run_dir, data_dir, fsdp_runs)))
    assert final.returncode == 0, final.stderr
    assert "resumed from" in final.stdout and "step 11)" in final.stdout, final.stdout
    result = assert_resumed_like(run_dir, fsdp_runs["bn"], interruptions=1, steps=16)
    assert result["test_accuracy"] == read_result(fsdp_runs["bn"])["test_accuracy"]


def checkpointed_progress(run_dir: Path) -> dict[str, Any]:
    """The trainer's Progress in the newest (sharded) checkpoint, read without a process
    group: DCP's files converted into one torch file, then its progress entry."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    whole = run_dir.parent / "whole.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / latest / "dcp", whole)
    state = torch.load(whole, weights_only=False)  # written just now, by this test
    return from_opaque(state["progress"], "progress")


def test_trainer_fsdp_resumes_from_two_ranks_on_one(
    fsdp_runs: dict[str, Path],
    fsdp_preempted: tuple[Path, Path],
    data_dir: Path,
    train_cli: ForkedCli,
) -> None:
    """The preempted run resumed by one process: DCP reshards the weights and Adam's state onto
    it, the other 160 samples of epoch 2 are its 10 steps of 16; every sample trained on once."""
    run_dir = fsdp_preempted[1]
    final = train_cli.run(["train", *bn_args(run_dir, data_dir, fsdp_runs)], timeout=180)
    assert final.returncode == 0, final.stdout + final.stderr
    assert "resumed from 2 to 1 ranks at sample 96 of epoch 2" in final.stdout, final.stdout
    result = read_result(run_dir)
    assert (result["world_size"], result["steps"], result["interruptions"]) == (1, 21, 1)
    assert checkpointed_progress(run_dir)["samples_total"] == 256 + 96 + 160
    rows = [r for r in read_metrics(run_dir) if "test_samples" in r]
    assert [r["test_samples_per_rank"] for r in rows] == [[51, 50], [101]]
    expected = read_result(fsdp_runs["bn"])["test_accuracy"]
    assert abs(result["test_accuracy"] - expected) < 0.15


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"cuda_graphs": "on"}, "--cuda-graphs: FSDP2's gathers of the weights are not captured"),
        ({"amp": "fp16"}, "--amp fp16: its loss scaler is not made for sharded gradients"),
        ({"sync_bn": True}, "--sync-bn: SyncBatchNorm is DDP's"),
        ({"time_allreduce": True}, "--time-allreduce: it times DDP's all-reduce"),
        ({"gpus_per_process": 2}, "--gpus-per-process 2: FSDP2 shards over processes"),
    ],
)
def test_trainer_fsdp_refuses_what_it_cannot_run(settings: dict[str, Any], says: str) -> None:
    """From flags, a config file or a job spec's arguments alike (TrainConfig checks itself)."""
    with pytest.raises(ConfigError, match="--fsdp cannot run with") as err:
        TrainConfig(fsdp=True, **settings)
    assert says in err.value.message and "drop --fsdp" in (err.value.hint or "")
    TrainConfig(**settings)  # each is a valid setting without --fsdp


def test_a_job_specs_trainer_arguments_carry_fsdp_and_its_refusals() -> None:
    """A job spec's ``args`` (sbatch, submitit, launch) reach the trainer as its flags: the
    checks made when a job is described or submitted read them with the trainer's parser."""
    assert HOOK.job_needs(["--fsdp", "--epochs", "3"]).cfg.fsdp is True
    with pytest.raises(ConfigError, match="--fsdp cannot run with --sync-bn"):
        HOOK.job_needs(["--fsdp", "--sync-bn"])


def test_trainer_fsdp_refusal_exits_2_before_any_work(tmp_path: Path, train_cli: ForkedCli) -> None:
    run_dir = tmp_path / "run"
    args = train_args(run_dir, tmp_path / "data", fsdp=True)
    done = train_cli.run(["train", *args, "--cuda-graphs"])
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--fsdp cannot run with --cuda-graphs" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not run_dir.exists()


def test_trainer_fsdp_refuses_a_process_of_several_gpus() -> None:
    """The layout that gives one process several GPUs (``HPC_DDP_GPUS_PER_PROCESS``) is known
    only once the trainer starts: refused by its preflight, before the run directory is
    touched. Two GPUs cannot exist here: the process's context is a stand-in."""
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    ctx = SimpleNamespace(device=gpus[0], devices=gpus)
    with pytest.raises(ConfigError, match="one process driving 2 GPUs"):
        preflight(TrainConfig(fsdp=True), ctx)  # type: ignore[arg-type]


# --- GPUs: NCCL, bf16 mixed precision -----------------------------------------------------------


def on_gpus(world: int) -> object:
    """A ``world`` parameter, skipped where fewer GPUs are visible."""
    why = f"needs {world} GPUs, {GPUS} visible"
    return pytest.param(world, marks=pytest.mark.skipif(world > GPUS, reason=why))


@pytest.mark.gpu
@pytest.mark.parametrize("world", [on_gpus(2), on_gpus(4)])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_gpu_fsdp_bf16_preempted_resumes_bit_identical(
    tmp_path: Path, mode: str, world: int
) -> None:
    extra = ["--cuda", *(["--async", "--checkpoint-every", "5"] if mode == "async" else [])]
    ref = torchrun(world, tmp_path / "ref", tmp_path / "ref.pt", *extra)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    first = torchrun(world, tmp_path / "run", tmp_path / "x.pt", *extra, "--preempt-at", "21")
    assert "preempted at step 21: checkpointed" in first.stdout, first.stdout + first.stderr
    again = torchrun(world, tmp_path / "run", tmp_path / "state.pt", *extra)
    assert again.returncode == 0, again.stdout + again.stderr
    same_state(tmp_path / "state.pt", tmp_path / "ref.pt")
    down = torchrun(1, tmp_path / "run", tmp_path / "down.pt", "--cuda", "--load-only")
    assert down.returncode == 0, down.stdout + down.stderr
    same_state(tmp_path / "down.pt", tmp_path / "ref.pt")


def gpu_cmd(args: list[str]) -> list[str]:
    """``hpc-ddp train ARGS``, by this interpreter (no console script needed)."""
    return [sys.executable, "-m", "hpc_ddp", "train", *args]


def gpu_start(args: list[str], log: Path) -> subprocess.Popen[str]:
    """The command started, its output into ``log``; NVLink multicast off, as in test_gpu.py."""
    env = {**job_env(), "PYTHONPATH": str(REPO), "NCCL_NVLS_ENABLE": "0"}
    with log.open("w") as out:
        return subprocess.Popen(
            gpu_cmd(args), env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True
        )


def gpu_train(args: list[str], log: Path) -> tuple[int, str]:
    return finish(gpu_start(args, log), log, timeout=240)


# world -> (optimizer steps in 2 epochs, a step inside epoch 2, the ranks' evaluation shards)
TRAINER_WORLDS = {2: (64, 37, [501, 500]), 4: (32, 21, [251, 250, 250, 250])}


@pytest.mark.gpu
@pytest.mark.parametrize("world", [on_gpus(w) for w in TRAINER_WORLDS])
def test_gpu_trainer_fsdp_bf16_learns_and_resumes_bit_identical(tmp_path: Path, world: int) -> None:
    """`hpc-ddp train --fsdp --nproc-per-node W` on W GPUs (NCCL, bf16 by default: FSDP2's mixed
    precision): learns as DDP does; preempted inside epoch 2 and resumed, it ends with the
    uninterrupted run's weights bit for bit (deterministic kernels)."""
    steps, hold_at, shards = TRAINER_WORLDS[world]
    data = tmp_path / "data"
    base = ["--nproc-per-node", str(world), "--synthetic", "--synthetic-train-size", "4096"]
    base += ["--synthetic-test-size", "1001"]
    base += ["--data-dir", str(data), "--epochs", "2", "--eval-batch-size", "100"]
    base += ["--log-every", "1000", "--deterministic"]
    rc, out = gpu_train([*base, "--run-dir", str(tmp_path / "ddp")], tmp_path / "ddp.log")
    assert rc == 0, out[-3000:]
    fsdp = [*base, "--fsdp"]
    rc, out = gpu_train([*fsdp, "--run-dir", str(tmp_path / "ref")], tmp_path / "ref.log")
    assert rc == 0, out[-3000:]
    assert "CUDA graphs: off (fsdp: FSDP2's gathers of the weights are not captured)" in out, out
    line = "parallelism: FSDP2 (fully_shard per block: 5 blocks, then the root), mixed precision"
    assert f"{line} bf16 (gradients reduced in fp32)" in out, out
    ref, ddp = read_result(tmp_path / "ref"), read_result(tmp_path / "ddp")
    assert ref["steps"] == steps and ref["extra"]["cuda_graphs"] is False
    assert ref["test_accuracy"] > 0.3 and abs(ref["test_accuracy"] - ddp["test_accuracy"]) < 0.1
    rows = [r for r in read_metrics(tmp_path / "ref") if "test_samples" in r]
    assert [r["test_samples_per_rank"] for r in rows] == [shards] * 2

    broken = tmp_path / "broken"
    hold = ["--run-dir", str(broken), "--debug-hold-at-step", str(hold_at)]
    proc = gpu_start([*fsdp, *hold], tmp_path / "1.log")
    try:
        signal_workers(wait_for_progress(broken, holding, proc, timeout=180), signal.SIGUSR1)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    rc, out = finish(proc, tmp_path / "1.log")
    assert rc == 75 and f"checkpointed at step {hold_at}" in out, out[-3000:]
    rc, out = gpu_train([*fsdp, "--run-dir", str(broken)], tmp_path / "2.log")
    assert rc == 0 and f"step {hold_at})" in out, out[-3000:]
    again = read_result(broken)
    assert again["interruptions"] == 1 and again["steps"] == steps
    assert again["params_sha256"] == ref["params_sha256"]


WHOLE_THEN_SHARDED = """
import sys, torch, torch.distributed as dist, hpc_ddp
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
net = torch.nn.Linear(4, 4)
hpc_ddp.Resumable(sys.argv[1], model=net).save()  # a whole (shared.pt) checkpoint
fully_shard(net)
try:
    hpc_ddp.Resumable(sys.argv[1], model=net)
except hpc_ddp.HpcDdpError as err:
    print(str(err).replace("\\n", " "))
"""


def test_a_whole_checkpoint_is_refused_for_a_sharded_model(tmp_path: Path) -> None:
    """Not silently resumed with the fresh weights: the run says which kind it found."""
    done = run(_one_rank(tmp_path, WHOLE_THEN_SHARDED), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "holds a whole (unsharded) state, and this run's model is sharded" in done.stdout
