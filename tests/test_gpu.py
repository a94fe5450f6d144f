"""GPU checks of the trainer: NCCL, bf16 AMP, SyncBN, 2-GPU DDP through the CLI and torchrun,
exact checkpoint + resume, one process driving two GPUs, CUDA graphs, the GPU-resident data.

Every test needs CUDA GPUs (most need two) and skips cleanly where fewer are visible: CI has
none. They run real processes (torchrun, ``python -m hpc_ddp.train``) on synthetic CIFAR-100
files in the real on-disk format; nothing is mocked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hpc_ddp.train.cifar import synthetic

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parent.parent
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
TRAIN, TEST = 4096, 1024


def need(n: int):
    return pytest.mark.skipif(n > GPUS, reason=f"needs {n} CUDA GPU(s), {GPUS} visible")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("data")
    root = synthetic.synthetic_root(d, "cifar100", TRAIN, TEST)
    synthetic.write_synthetic(root, "cifar100", train_size=TRAIN, test_size=TEST)
    return d


def flags(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    base = ["--synthetic", "--dataset", "cifar100", "--data-dir", str(data_dir)]
    base += ["--synthetic-train-size", str(TRAIN), "--synthetic-test-size", str(TEST)]
    return [*base, "--run-dir", str(run_dir), "--log-every", "1000", *extra]


def lenet(*extra: str) -> list[str]:
    # The reference workload's recipe (benchmarks/README.md): AdamW 1e-3, no decay, no schedule.
    base = ["--model", "lenet", "--optimizer", "adam", "--lr", "1e-3", "--weight-decay", "0"]
    return [*base, "--lr-schedule", "constant", "--no-augment", "--amp", "off", *extra]


def torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]


def train_cmd(procs: int, data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    """``python -m hpc_ddp.train`` as one process, or under torchrun with ``procs`` workers."""
    launcher = [sys.executable] if procs == 1 else torchrun(procs)
    return [*launcher, "-m", "hpc_ddp.train", *flags(data_dir, run_dir, *extra)]


# ResNet-18 at bf16: the GPU paths (cuDNN, autocast, SyncBN, model split) worth checking.
RESNET_BF16 = ("--model", "resnet18", "--amp", "bf16", "--batch-size", "128")


def run(
    cmd: list[str], *, env: dict | None = None, timeout: float = 240, expect: int = 0
) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(REPO), "NCCL_NVLS_ENABLE": "0", **(env or {})}
    proc = subprocess.run(cmd, env=full, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == expect, (
        f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


@need(2)
def test_nccl_allreduce_through_init_distributed(tmp_path) -> None:
    script = tmp_path / "ar.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from hpc_ddp.dist import init_distributed, shutdown_and_exit\n"
        "ctx = init_distributed()\n"
        "t = torch.full((1024,), float(ctx.rank + 1), device=ctx.device)\n"
        "dist.all_reduce(t)\n"
        "assert ctx.backend == 'nccl' and ctx.device.type == 'cuda', ctx\n"
        "assert torch.all(t == 3.0).item(), t[:4]\n"
        "print('ALLREDUCE_OK', ctx.rank, ctx.device, flush=True)\n"
        "shutdown_and_exit(0)\n"
    )
    out = run([*torchrun(2), str(script)]).stdout
    assert out.count("ALLREDUCE_OK") == 2 and "cuda:1" in out


@need(2)
def test_two_gpu_ddp_through_cli(data_dir, tmp_path) -> None:
    """``hpc-ddp train`` (``python -m hpc_ddp.cli train``) under torchrun on 2 GPUs, eager DDP."""
    rd = tmp_path / "run"
    extra = lenet("--epochs", "2", "--no-cuda-graphs")
    out = run([*torchrun(2), "-m", "hpc_ddp.cli", "train", *flags(data_dir, rd, *extra)]).stdout
    res = result(rd)
    assert res["status"] == "finished" and res["world_size"] == 2
    assert res["test_samples"] == TEST  # exact evaluation: every test sample once
    assert res["test_accuracy"] > 0.3, res  # 100 classes: chance is 0.01
    assert "backend nccl" in out and "GPU-resident" in out
    assert "CUDA graphs: off (--no-cuda-graphs)" in out and not res["extra"]["cuda_graphs"]


@need(1)
def test_amp_bf16_resnet18(data_dir, tmp_path) -> None:
    rd = tmp_path / "run"
    run(train_cmd(1, data_dir, rd, *RESNET_BF16, "--epochs", "2"))
    res = result(rd)
    assert res["status"] == "finished" and res["test_accuracy"] > 0.1, res


@need(2)
def test_syncbn_two_gpus(data_dir, tmp_path) -> None:
    rd = tmp_path / "run"
    out = run(train_cmd(2, data_dir, rd, *RESNET_BF16, "--sync-bn", "--epochs", "1")).stdout
    res = result(rd)
    assert res["status"] == "finished" and res["world_size"] == 2, res
    assert res["test_accuracy"] > 0.02, res
    # The default (auto) takes eager DDP here, saying why, once.
    assert out.count("CUDA graphs: off (sync_bn: SyncBatchNorm is not captured") == 1, out


def _preempt_when_holding(run_dir: Path, proc: subprocess.Popen, deadline_s: float = 120) -> None:
    progress = run_dir / "progress.json"
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            info = json.loads(progress.read_text())
        except (OSError, ValueError):
            info = {}
        if info.get("status") == "holding":
            for pid in info["pids"]:
                os.kill(pid, signal.SIGUSR1)
            return
        time.sleep(0.05)  # polling the trainer's progress file; bounded by the deadline
    raise AssertionError("the trainer never reached its hold step")


def deterministic_probe(launcher: str, n: int) -> list[str]:
    """benchmarks/probe.py asking for deterministic kernels, its workers forked or torchrun's."""
    probe = str(REPO / "benchmarks" / "probe.py")
    if launcher == "spawn":
        return [sys.executable, probe, "--probe-nproc", str(n), "--probe-deterministic"]
    return [*torchrun(n), probe, "--probe-deterministic"]


def preempted_and_resumed(
    probe: list[str], data_dir: Path, run_dir: Path, extra: tuple[str, ...] | list[str],
    hold_at: int, tmp_path: Path, timeout: float = 120,
) -> None:  # fmt: skip
    """The run in ``run_dir`` held at step ``hold_at``, preempted there (its workers signalled),
    then started again to its end, each under ``probe``."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "NCCL_NVLS_ENABLE": "0"}
    hold = ["--debug-hold-at-step", str(hold_at)]
    cmd = [*probe, "--probe-json", str(tmp_path / "b.json"), "--"]
    proc = subprocess.Popen(
        [*cmd, *flags(data_dir, run_dir, *extra, *hold)],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    _preempt_when_holding(run_dir, proc)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode != 0 and "preempted" in out, out[-2000:]
    run([*probe, "--probe-json", str(tmp_path / "c.json"), "--", *flags(data_dir, run_dir, *extra)])


SYNC = "--no-async-checkpoint"


@need(2)
@pytest.mark.parametrize(
    ("step", "launcher"),
    [
        (["--no-cuda-graphs", SYNC], "torchrun"),
        (["--cuda-graphs", SYNC], "torchrun"),
        (["--cuda-graphs", SYNC], "spawn"),
        ([], "spawn"),
    ],
    ids=["eager", "cuda_graphs", "cuda_graphs_forked", "defaults_forked"],
)
def test_checkpoint_resume_exact_on_two_gpus(data_dir, tmp_path, step, launcher) -> None:
    """Preempted mid-epoch and resumed == uninterrupted, bit for bit (deterministic kernels).
    "defaults": what the user types, the captured step (auto) with background checkpoints."""
    extra = lenet("--epochs", "2", *step)
    probe = deterministic_probe(launcher, 2)
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    run(
        [*probe, "--probe-json", str(tmp_path / "a.json"), "--", *flags(data_dir, straight, *extra)]
    )
    hold_at = TRAIN // (64 * 2) + 5  # inside epoch 2
    preempted_and_resumed(probe, data_dir, broken, extra, hold_at, tmp_path)
    a, c = result(straight), result(broken)
    assert c["interruptions"] == 1 and c["steps"] == a["steps"]
    assert c["params_sha256"] == a["params_sha256"]


@need(2)
def test_forked_workers_equal_torchrun_workers(data_dir, tmp_path) -> None:
    """Workers forked after ``import torch`` (CUDA first touched in the children) run NCCL and
    CUDA graphs, and end with torchrun's weights bit for bit (deterministic kernels)."""
    extra = lenet("--epochs", "2", "--cuda-graphs")
    for launcher in ("spawn", "torchrun"):
        rd = tmp_path / launcher
        run(
            [
                *deterministic_probe(launcher, 2),
                "--probe-json",
                str(tmp_path / f"{launcher}.json"),
                "--",
                *flags(data_dir, rd, *extra),
            ]
        )
    forked, spawned_by_torchrun = result(tmp_path / "spawn"), result(tmp_path / "torchrun")
    assert forked["world_size"] == 2 and forked["status"] == "finished", forked
    assert forked["params_sha256"] == spawned_by_torchrun["params_sha256"]


@need(2)
def test_cli_nproc_per_node_on_two_gpus(data_dir, tmp_path) -> None:
    """What users type: ``python -m hpc_ddp.train --nproc-per-node 2`` on a 2-GPU machine, no
    step flags: the step is captured (auto). The same command again answers from the run dir."""
    rd = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpc_ddp.train", "--nproc-per-node", "2"]
    cmd += flags(data_dir, rd, *lenet("--epochs", "2"))
    out = run(cmd).stdout
    res = result(rd)
    assert res["status"] == "finished" and res["world_size"] == 2 and res["test_samples"] == TEST
    assert res["test_accuracy"] > 0.3, res
    assert "2 process(es)" in out and "backend nccl" in out, out
    assert out.count("CUDA graphs: on (auto") == 1 and res["extra"]["cuda_graphs"], out
    again = run(cmd, timeout=30).stdout
    assert again.startswith(f"run dir {rd} already finished"), again
    assert f"params_sha256: {res['params_sha256']}" in again


@need(2)
def test_default_step_is_the_explicit_cuda_graphs_step(data_dir, tmp_path) -> None:
    """No step flag on GPUs = ``--cuda-graphs``: the same weights bit for bit (deterministic
    kernels, forked workers), and both report the captured step."""
    for name, step in (("default", []), ("forced", ["--cuda-graphs"])):
        out = run(
            [
                *deterministic_probe("spawn", 2),
                "--probe-json",
                str(tmp_path / f"{name}.json"),
                "--",
                *flags(data_dir, tmp_path / name, *lenet("--epochs", "2", *step)),
            ]
        ).stdout
        assert out.count("CUDA graphs: on (") == 1, out
        # LeNet's step: ~0.4 ms for 0.25 GFLOP per GPU, said once (train/fast/step_rate.py)
        assert out.count("bound by kernel latency, not arithmetic") == 1, out
    default, forced = result(tmp_path / "default"), result(tmp_path / "forced")
    assert default["extra"]["cuda_graphs"] and forced["extra"]["cuda_graphs"]
    assert default["steps"] == forced["steps"] and default["status"] == "finished"
    assert default["params_sha256"] == forced["params_sha256"]


@need(2)
def test_resnet_sgd_cuda_graphs_learn_like_eager_ddp(data_dir, tmp_path) -> None:
    """The weak-scaling recipe (ResNet-18, bf16, SGD momentum) captured: SGD's fused kernel with
    a device LR, BatchNorm inside the graph; it learns as the eager DDP step does."""
    recipe = (*RESNET_BF16, "--optimizer", "sgd", "--lr", "0.05", "--no-augment", "--epochs", "2")
    eager, graphs = tmp_path / "eager", tmp_path / "graphs"
    eager_out = run(train_cmd(2, data_dir, eager, *recipe, "--no-cuda-graphs")).stdout
    out = run(train_cmd(2, data_dir, graphs, *recipe, "--cuda-graphs")).stdout
    for log in (eager_out, out):  # tens of TFLOP/s: no latency advice
        assert "bound by kernel latency" not in log and "epoch 2:" in log, log
    a, b = result(eager), result(graphs)
    assert b["status"] == "finished" and b["steps"] == a["steps"], b
    assert abs(a["test_accuracy"] - b["test_accuracy"]) < 0.05, (a, b)
    assert abs(a["train_loss"] - b["train_loss"]) < 0.1 * abs(a["train_loss"]) + 1e-2, (a, b)
    assert "backend nccl" in out


@need(2)
def test_cuda_graphs_match_eager_ddp(data_dir, tmp_path) -> None:
    """Same run with and without --cuda-graphs on 2 GPUs: same learning, different speed."""
    eager, graphs = tmp_path / "eager", tmp_path / "graphs"
    run(train_cmd(2, data_dir, eager, *lenet("--epochs", "2", "--no-cuda-graphs")))
    run(train_cmd(2, data_dir, graphs, *lenet("--epochs", "2", "--cuda-graphs")))
    a, b = result(eager), result(graphs)
    assert not a["extra"]["cuda_graphs"] and b["extra"]["cuda_graphs"]
    assert b["steps"] == a["steps"]
    assert abs(a["test_accuracy"] - b["test_accuracy"]) < 0.02, (a, b)
    assert abs(a["train_loss"] - b["train_loss"]) < 0.02 * abs(a["train_loss"]) + 1e-3, (a, b)


@need(2)
def test_one_process_drives_two_gpus(data_dir, tmp_path) -> None:
    """gpus_per_process=2: the model is split over both GPUs of one process."""
    rd = tmp_path / "run"
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "HPC_DDP_GPUS_PER_PROCESS": "2"}
    split = (*RESNET_BF16, "--gpus-per-process", "2", "--epochs", "1")
    run(train_cmd(1, data_dir, rd, *split), env=env)
    res = result(rd)
    assert res["status"] == "finished" and res["test_accuracy"] > 0.02, res


@need(4)
def test_two_processes_each_driving_two_gpus(data_dir, tmp_path) -> None:
    """DDP across processes (device_ids=None) with each model split over two GPUs."""
    rd = tmp_path / "run"
    split = (*RESNET_BF16, "--gpus-per-process", "2", "--epochs", "1")
    run(train_cmd(2, data_dir, rd, *split), env={"HPC_DDP_GPUS_PER_PROCESS": "2"})
    res = result(rd)
    assert res["status"] == "finished" and res["world_size"] == 2, res


def cifar_both_ways(data_dir: Path) -> tuple:
    """The tests' synthetic CIFAR-100 (augmented, seed 3) for rank 1 of 2 in batches of 100, as
    the torchvision loader reads it on the CPU and as the resident path holds it on GPU 0:
    (loader, resident training data, resident evaluation data)."""
    from hpc_ddp.runtime.shard_plan import ShardPlan
    from hpc_ddp.train.cifar.data import LoaderTrainData, load_datasets
    from hpc_ddp.train.config import TrainConfig
    from hpc_ddp.train.fast import gpu_data

    cfg = TrainConfig(dataset="cifar100", synthetic=True, augment=True, seed=3)
    root = synthetic.synthetic_root(data_dir, "cifar100", TRAIN, TEST)
    train, test, _ = load_datasets(cfg, root)
    plan = ShardPlan(n=len(train), seed=3, world_size=2, micro_batch=100)
    cpu = LoaderTrainData(plan, train, 1, torch.device("cpu"))
    dev = torch.device("cuda", 0)
    resident = gpu_data.GpuTrainData(
        plan=plan,
        images=gpu_data.normalize(train.images.to(dev)),
        labels=train.targets.to(dev),
        rank=1,
        augment=True,
        seed=3,
    )
    evaluation = gpu_data.GpuEvalData(
        gpu_data.normalize(test.images.to(dev)), test.targets.to(dev), 1, 2
    )
    return cpu, resident, evaluation


@need(1)
def test_gpu_resident_batches_equal_cpu_loader(data_dir) -> None:
    """The same batches on the GPU as the torchvision loader gives on the CPU, bit for bit."""
    cpu, gpu, _ = cifar_both_ways(data_dir)
    n = 0
    for (xc, yc), (xg, yg) in zip(cpu.batches(1, 0), gpu.batches(1, 0), strict=True):
        assert xg.is_cuda and torch.equal(xg.cpu(), xc) and torch.equal(yg.cpu(), yc)
        n += 1
    assert n > 5


@need(1)
def test_kernel_warmup_draws_no_random_numbers_on_the_gpu() -> None:
    """The thread's miniature step under bf16 autocast with the captured step's optimizer
    (AdamW, capturable and fused) runs, and leaves the CPU's and the GPU's generators as they
    were: the run it overlaps computes what it would have computed without it."""
    from hpc_ddp.train.config import TrainConfig
    from hpc_ddp.train.fast.kernel_warmup import KernelWarmup, optimizer_factory

    device = torch.device("cuda", 0)
    make = optimizer_factory(TrainConfig(), captured=True)
    torch.manual_seed(3)
    cpu, gpu = torch.get_rng_state(), torch.cuda.get_rng_state(device)
    warmup = KernelWarmup([device], make, torch.bfloat16).launch()
    warmup.finish()
    assert warmup.error is None, warmup.error
    assert warmup.seconds > 0
    assert torch.equal(torch.get_rng_state(), cpu)
    assert torch.equal(torch.cuda.get_rng_state(device), gpu)


@need(1)
def test_graphed_step_replays_and_matches_eager() -> None:
    """In-process: the captured graph computes what the eager step computes."""
    from hpc_ddp.runtime.capturable import make_capturable
    from hpc_ddp.train.cifar.models import build_model
    from hpc_ddp.train.fast.cuda_graphs import GraphedStep

    torch.backends.cudnn.deterministic = True
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    a = build_model("lenet", 100).to(dev)
    b = build_model("lenet", 100).to(dev)
    b.load_state_dict(a.state_dict())
    steps = []
    for model, capture in ((a, False), (b, True)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0)
        make_capturable(opt, dev)  # the same optimizer arithmetic on both sides
        steps.append(GraphedStep(model, opt, capture=capture))
    g = torch.Generator(device=dev).manual_seed(1)
    for _ in range(12):
        x = torch.randn(64, 3, 32, 32, device=dev, generator=g)
        y = torch.randint(0, 100, (64,), device=dev, generator=g)
        la, lb = (float(s.step(x, y)) for s in steps)
        assert la == pytest.approx(lb, rel=1e-4)
    assert steps[1].replays == 12 - steps[1].warmup and steps[0].replays == 0
    # A graph replaying stale inputs would be off by ~lr (1e-3) per step; rounding is far less.
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-3, atol=1e-4)


@need(1)
@pytest.mark.parametrize("piece_bytes", [8 << 20, 16], ids=["one-piece", "many-pieces"])
def test_async_snapshot_packs_give_back_every_tensor(
    tmp_path: Path, piece_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU-staged snapshot packs its CUDA tensors by dtype (one copy each) and gives every
    tensor back with its own dtype, shape and values (0-dim, empty, non-contiguous, int64),
    CPU tensors copied apart, whether a pack's pinned memory is one piece or many (16 bytes:
    a piece a tensor); the copy saves and loads like the state it came from."""
    from hpc_ddp.checkpoint import asyncsave
    from hpc_ddp.checkpoint.asyncsave import start_snapshot

    monkeypatch.setattr(asyncsave, "PIN_PIECE_BYTES", piece_bytes)

    g = torch.Generator(device="cuda").manual_seed(0)
    live = {
        "w": torch.randn(3, 4, device="cuda", generator=g),
        "t": torch.randn(6, 5, device="cuda", generator=g).t(),  # non-contiguous
        "h": torch.randn(7, device="cuda", generator=g).to(torch.bfloat16),
        "step": torch.tensor(12.0, device="cuda"),  # Adam's capturable step: 0-dim
        "n": torch.tensor(5, device="cuda"),  # BatchNorm's num_batches_tracked: int64
        "e": torch.empty(0, 3, device="cuda"),
        "cpu": torch.arange(4.0),
        "nested": [torch.ones(2, device="cuda"), (1, "a")],
    }
    snap = start_snapshot(live, device_staging=True)
    assert sorted(str(p.flat.dtype) for p in snap.packs) == [
        "torch.bfloat16",
        "torch.float32",
        "torch.int64",
    ]
    copy = snap.ready()
    flat = {k: v for k, v in live.items() if k != "nested"}
    flat["nested0"], copy["nested0"] = live["nested"][0], copy["nested"][0]
    for key, value in flat.items():
        got = copy[key]
        assert got.device.type == "cpu", key
        assert (got.dtype, got.shape) == (value.dtype, value.shape), key
        assert torch.equal(got, value.cpu()), key
    assert copy["nested"][1] == (1, "a") and type(copy["nested"]) is list
    torch.save(copy, tmp_path / "c.pt")
    loaded = torch.load(tmp_path / "c.pt", weights_only=True)
    assert all(torch.equal(loaded[k], flat[k].cpu()) for k in flat if k != "nested0")


@need(1)
@pytest.mark.parametrize("device_staging", [True, False], ids=["gpu-staged", "pinned-direct"])
def test_async_snapshot_is_queued_in_stream_order(device_staging: bool) -> None:
    """start_snapshot returns before the GPU copied anything, and an in-place update queued
    right after it cannot leak into the copy (stream order), staged on the GPU or not."""
    from hpc_ddp.checkpoint.asyncsave import start_snapshot

    w = torch.zeros(1 << 24, device="cuda")  # 64 MiB
    # Keep the stream busy (~1 s of GPU cycles, far longer than pinning 64 MiB on a slow host):
    # the copy must still be queued when start_snapshot returns.
    torch.cuda._sleep(2_000_000_000)
    snap = start_snapshot({"w": w, "step": 3, "v": [w[:4]]}, device_staging=device_staging)
    assert not snap.events[0].query(), "start_snapshot waited for the GPU"
    w.fill_(1.0)
    copy = snap.ready()
    assert copy["step"] == 3 and copy["w"].device.type == "cpu" and not copy["w"].any()
    assert copy["w"].is_pinned() and copy["v"][0].tolist() == [0.0] * 4
    assert bool((w == 1).all())
