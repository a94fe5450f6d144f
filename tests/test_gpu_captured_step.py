"""``hpc_ddp.CapturedStep`` on CUDA GPUs: it replays its graphs and computes what its eager step
computes (fp32 and bf16, with accumulation and an odd last batch), LR schedules reach the graph
and a changed setting it would freeze makes it step eagerly, what cannot be captured steps
eagerly and says why, its optimizer's checkpoint loads into a script without it and back, a run
resumed in-process ends bit-identical to an uninterrupted one, and examples/ddp_train.py --fast
on 2 GPUs (torchrun, NCCL), preempted by a real signal and resumed, ends with the uninterrupted
run's weights bit for bit.

Every test needs CUDA GPUs (the last two) and skips cleanly where fewer are visible: CI has
none. Real graphs, real processes; nothing is mocked.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import hpc_ddp
from hpc_ddp.polling import wait_for

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parent.parent
EXAMPLE = str(REPO / "examples" / "ddp_train.py")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
HOLDING = re.compile(r"rank (\d+) pid (\d+) holding at step (\d+)")


def need(n: int):
    return pytest.mark.skipif(n > GPUS, reason=f"needs {n} CUDA GPU(s), {GPUS} visible")


@pytest.fixture
def dev() -> Iterator[torch.device]:
    """Deterministic fp32 kernels: TF32 convolutions (cuDNN's default) round NCHW and
    channels_last runs apart by ~1e-3 relative, the size of what the comparisons look for."""
    cudnn = torch.backends.cudnn
    before = cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32
    cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32 = True, False, False
    yield torch.device("cuda", 0)
    cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32 = before


def _net(dev: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(32, 10),
    ).to(dev)  # fmt: skip


def _sgd(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, fused=True)


def _batches(dev: torch.device, sizes: list[int], seed: int = 1) -> list:
    g = torch.Generator(device=dev).manual_seed(seed)
    return [
        (
            torch.randn(n, 3, 16, 16, device=dev, generator=g),
            torch.randint(0, 10, (n,), device=dev, generator=g),
        )
        for n in sizes
    ]


def _quiet(_line: str) -> None:
    """The test reads ``step.line`` instead."""


def _sped_up(dev: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh model and SGD through ``speed_up`` (channels_last, fused), as a script has them."""
    net = _net(dev)
    sgd = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    return hpc_ddp.speed_up(net, sgd, log=_quiet)


@need(1)
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize(
    ("amp", "tol"), [(None, (1e-4, 1e-5)), (torch.bfloat16, (2e-2, 2e-3))], ids=["fp32", "bf16"]
)
def test_replays_and_matches_its_eager_step(dev, amp, tol, accum) -> None:
    """8 full micro-batches then an odd one (eager, a step of its own): after one eager step
    every full micro-batch is a replay, of one graph per kind of micro-batch."""
    nets = [_net(dev), _net(dev)]
    steps = [
        hpc_ddp.CapturedStep(
            net, _sgd(net), amp_dtype=amp, accum_steps=accum, warmup=1, capture=capture, log=_quiet
        )
        for net, capture in zip(nets, (False, True), strict=True)
    ]
    batches = _batches(dev, [64] * 8 + [24])
    for i, (x, y) in enumerate(batches):
        sync = (i + 1) % accum == 0 or i + 1 == len(batches)
        eager, captured = (float(step(x, y, sync=sync)) for step in steps)
        assert eager == pytest.approx(captured, rel=tol[0] * 10)
    assert steps[1].line == "captured step: a CUDA graph after 1 eager warm-up step(s)"
    assert steps[1].replays == 8 - accum and steps[0].replays == 0
    assert len(steps[1].graphs) == (1 if accum == 1 else 2)
    # A graph replaying stale inputs would be off by ~lr (0.05) per step; rounding is far less.
    for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=tol[0], atol=tol[1])
    steps[1].close()


@need(1)
def test_an_odd_batch_right_after_the_warm_up_does_not_set_the_graphs_shape(dev) -> None:
    """A resumed run may meet an epoch's short last batch first: the graph takes the shapes
    that come twice in a row, so the full batches after it are replayed, not run eagerly."""
    net = _net(dev)
    step = hpc_ddp.CapturedStep(net, _sgd(net), warmup=1, log=_quiet)
    for x, y in _batches(dev, [64, 24, 64, 64, 64]):
        step(x, y)
    assert step.replays == 2 and step.static_x is not None and len(step.static_x) == 64
    step.close()


@need(1)
def test_an_epochs_short_batch_is_captured_when_it_comes_again(dev) -> None:
    """Eager, an epoch's short last batch is a fixed cost per epoch (a larger share the more
    GPUs shorten the epoch): at its second coming it gets graphs of its own, and the weights
    stay those of the eager step."""
    nets = [_net(dev), _net(dev)]
    steps = [
        hpc_ddp.CapturedStep(net, _sgd(net), warmup=1, capture=capture, log=_quiet)
        for net, capture in zip(nets, (False, True), strict=True)
    ]
    for x, y in _batches(dev, [64, 64, 64, 24, 64, 64, 24, 64, 40, 40]):
        for step in steps:
            step(x, y)
    # 1 warm-up, 2 full, the short one eager (first seen), 2 full, the short one captured,
    # 1 full; 40 is a third shape: eager, even twice in a row.
    assert steps[1].replays == 6 and len(steps[1].graphs) == 2
    for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    steps[1].close()


@need(1)
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_lr_schedules_reach_the_graph_and_a_frozen_setting_goes_eager(dev) -> None:
    nets = [_net(dev), _net(dev)]
    opts = [_sgd(net) for net in nets]
    lines: list[str] = []
    steps = [
        hpc_ddp.CapturedStep(nets[0], opts[0], warmup=1, capture=False, log=_quiet),
        hpc_ddp.CapturedStep(nets[1], opts[1], warmup=1, log=lines.append),
    ]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in opts]
    batches = iter(_batches(dev, [64] * 12))

    def train(n: int) -> None:
        for _ in range(n):
            x, y = next(batches)
            for step, sched in zip(steps, scheds, strict=True):
                step(x, y)
                sched.step()

    def close() -> None:
        for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

    train(4)  # the scheduler fills the tensor the graph reads
    assert steps[1].replays == 3 and float(opts[1].param_groups[0]["lr"]) == pytest.approx(0.01)
    for opt in opts:  # a hand-written schedule assigns a float: copied into that tensor
        opt.param_groups[0]["lr"] = 0.02
    train(2)
    assert steps[1].captured and steps[1].replays == 5
    close()
    for opt in opts:  # a graph would keep momentum 0.9: the step goes eager, and says so
        opt.param_groups[0]["momentum"] = 0.5
    train(2)
    assert not steps[1].captured and steps[1].replays == 5
    assert lines[-1].startswith(
        "captured step: eager from now on (the optimizer's momentum changed after the capture"
    ), lines
    close()


@need(1)
def test_what_cannot_be_captured_steps_eagerly_and_says_why(dev) -> None:
    net, other = _net(dev), _net(dev)  # one step per model: each points .grad at its buffer
    rms = hpc_ddp.CapturedStep(net, torch.optim.RMSprop(net.parameters()), log=_quiet)
    assert rms.line == (
        "captured step: eager, not captured (RMSprop has no capturable kernel here "
        "(SGD, Adam and AdamW have))"
    )
    fp16 = hpc_ddp.CapturedStep(other, _sgd(other), amp_dtype=torch.float16, log=_quiet)
    assert "amp_dtype=float16: its loss scaling checks for inf on the host" in fp16.line
    for step in (rms, fp16):
        for x, y in _batches(dev, [64] * 5):
            assert torch.isfinite(step(x, y))
        assert step.replays == 0 and not step.graphs
    assert isinstance(fp16.scaler, torch.amp.GradScaler)


@need(1)
def test_its_checkpoint_loads_into_a_script_without_it_and_back(dev, tmp_path) -> None:
    """A captured run's checkpoint loads into a plain script (float LR, its momentum), and the
    plain script's own checkpoint of that state loads back into a captured run, which then steps
    on bit for bit as the run that never stopped. Weights are compared only between runs of the
    same kernels: this small BatchNorm model turns the rounding of other kernels (NCHW against
    channels_last, a float against a tensor LR) into 1e-2 apart within four steps (H200)."""
    net, opt = _sped_up(dev)
    step = hpc_ddp.CapturedStep(net, opt, warmup=1, log=_quiet)
    batches = _batches(dev, [64] * 10)
    for x, y in batches[:4]:
        step(x, y)
    assert step.replays == 3
    ckpt = hpc_ddp.Checkpointer(tmp_path / "ckpt", rank=0, world_size=1)
    ckpt.save(4, shared={"model": net.state_dict(), "optimizer": opt.state_dict()}, per_rank={},
              meta={})  # fmt: skip
    saved = ckpt.load_latest().shared
    group = saved["optimizer"]["param_groups"][0]
    assert type(group["lr"]) is float and group["lr"] == pytest.approx(0.05)
    # A script without it: the plain multi-tensor SGD, a float LR, the same momentum.
    plain = _net(dev)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    plain.load_state_dict(saved["model"])
    plain_opt.load_state_dict(saved["optimizer"])
    assert plain_opt.param_groups[0]["lr"] == pytest.approx(0.05)
    for mine, theirs in zip(plain.parameters(), net.parameters(), strict=True):
        assert torch.equal(
            plain_opt.state[mine]["momentum_buffer"], opt.state[theirs]["momentum_buffer"]
        )
    # And back, through the plain script's own checkpoint: the same steps as the run that never
    # stopped (one eager warm-up step, then a new capture; eager and replay agree bit for bit).
    back, back_opt = _sped_up(dev)
    back_step = hpc_ddp.CapturedStep(back, back_opt, warmup=1, log=_quiet)
    back.load_state_dict(plain.state_dict())
    back_opt.load_state_dict(plain_opt.state_dict())
    for x, y in batches[4:]:
        step(x, y)
        back_step(x, y)
    assert back_step.replays == 5
    for a, b in zip(net.state_dict().values(), back.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    step.close()
    back_step.close()


@need(1)
def test_a_run_resumed_in_process_ends_bit_identical(dev, tmp_path) -> None:
    """Uninterrupted: 3 eager steps, then replays. Resumed after step 5 from a checkpoint: new
    objects, 3 eager steps again, then a new capture. The same weights, bit for bit."""
    batches = _batches(dev, [64] * 12)

    def build() -> tuple[nn.Module, torch.optim.Optimizer, hpc_ddp.CapturedStep]:
        net, opt = _sped_up(dev)
        return net, opt, hpc_ddp.CapturedStep(net, opt, log=_quiet)

    net, _, step = build()
    for x, y in batches:
        step(x, y)
    step.close()
    first, opt1, step1 = build()
    for x, y in batches[:5]:
        step1(x, y)
    state = {"model": first.state_dict(), "optimizer": opt1.state_dict()}
    ckpt = hpc_ddp.Checkpointer(tmp_path / "ckpt", rank=0, world_size=1)
    ckpt.save(5, shared=state, per_rank={}, meta={})
    step1.close()
    resumed, opt2, step2 = build()
    saved = ckpt.load_latest().shared
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optimizer"])
    for x, y in batches[5:]:
        step2(x, y)
    assert step2.replays == 4
    for a, b in zip(net.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    step2.close()


def _holding(log: Path, ranks: int, proc: subprocess.Popen) -> dict[int, int]:
    text = log.read_text(errors="replace") if log.exists() else ""
    found = {int(m[1]): int(m[2]) for m in HOLDING.finditer(text)}
    if proc.poll() is not None:
        raise AssertionError(f"exited ({proc.returncode}) before holding:\n{text[-3000:]}")
    return found if len(found) == ranks else {}


@need(2)
def test_example_fast_preempted_and_resumed_ends_bit_identical(tmp_path) -> None:
    """examples/ddp_train.py --fast under torchrun on 2 GPUs (NCCL): speed_up + CapturedStep,
    2 micro-batches a step and an odd last batch each epoch. SIGUSR1 to rank 1 at step 5: both
    ranks checkpoint and exit 75; the rerun resumes there (3 eager steps, a new capture) and
    ends with the uninterrupted run's weights bit for bit."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "NCCL_NVLS_ENABLE": "0"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", EXAMPLE]  # fmt: skip
    args = ["--samples", "1030", "--epochs", "2", "--checkpoint-every", "4", "--fast"]

    def run(run_dir: Path, *extra: str) -> str:
        done = subprocess.run([*torchrun, *args, "--run-dir", str(run_dir), *extra], env=env,
                              cwd=REPO, capture_output=True, text=True, timeout=180)  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    straight, broken, log = tmp_path / "straight", tmp_path / "broken", tmp_path / "broken.log"
    out = run(straight)
    assert "step: contiguous (no Conv2d), fused SGD" in out, out
    assert "captured step: a CUDA graph after 3 eager warm-up step(s)" in out, out
    with log.open("w") as sink:
        cmd = [*torchrun, *args, "--run-dir", str(broken), "--hold-at-step", "5"]
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
        try:
            pids = wait_for(lambda: _holding(log, 2, proc), 120, "both ranks to hold")
            os.kill(pids[1], signal.SIGUSR1)  # to one rank: the ranks agree at the next step
            proc.wait(timeout=120)
        finally:
            proc.kill()
    text = log.read_text(errors="replace")
    assert "preempted at step 5: checkpointed; exit 75" in text, text[-3000:]
    resumed = run(broken)
    assert "step-00000005: epoch 1, step 5" in resumed, resumed
    a, b = (json.loads((d / "result.json").read_text()) for d in (straight, broken))
    assert a["steps"] == b["steps"] == 18
    assert b["params_sha256"] == a["params_sha256"]
    assert a["samples_per_s"] > 0 and a["train_s"] > 0
