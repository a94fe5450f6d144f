"""hpc_ddp.speed_up on the CPU: what it chooses and says, what it refuses, the fused optimizer it
builds (the same groups and hyper-parameters, the same training up to rounding) and its
checkpoints, which load into an unfused optimizer and back, also through Resumable.

No GPU here: where a test needs speed_up's CUDA path, ``on_a_gpu`` makes the CPU count as the
fast device (``fast_step.FAST_DEVICES``); torch has fused SGD/Adam/AdamW kernels on the CPU as
well, so the rebuilt optimizer really is fused and really steps. tests/test_gpu.py runs it on
CUDA."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpc_ddp
from hpc_ddp.runtime import fast_step

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.95), amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
}


def conv_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),  # BatchNorm follows: a bias would learn noise
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def batches(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(n)]  # fmt: skip


def train(model: nn.Module, opt: torch.optim.Optimizer, data: list) -> list[float]:
    losses = []
    for x, y in data:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture
def on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast_step, "FAST_DEVICES", ("cpu",))


def test_on_a_cpu_nothing_changes_and_it_says_so() -> None:
    net = conv_net()
    opt = OPTIMIZERS["sgd"](net.parameters())
    lines: list[str] = []
    fast = hpc_ddp.speed_up(net, opt, log=lines.append)
    model, optimizer = fast
    assert model is net and optimizer is opt and not fast.fused and not fast.channels_last
    assert fast.memory_format == torch.contiguous_format and not fast.on_gpu
    assert lines == [fast.line] == ["step: as given (the model is on cpu, not a CUDA device)"]
    assert net[0].weight.is_contiguous() and opt.param_groups[0]["fused"] is None


def test_on_a_gpu_channels_last_and_fused_with_the_same_groups(on_a_gpu: None) -> None:
    net = conv_net()
    params = list(net.parameters())
    opt = torch.optim.SGD(
        [{"params": params[:2], "lr": 0.5}, {"params": params[2:]}],
        lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4,
    )  # fmt: skip
    lines: list[str] = []
    model, fused = fast = hpc_ddp.speed_up(net, opt, log=lines.append)
    assert lines == [fast.line] == ["step: channels_last (2 Conv2d), fused SGD"]
    assert model is net and fast.channels_last and fast.fused and type(fused) is type(opt)
    assert fast.memory_format == torch.channels_last and fast.on_gpu
    assert net[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert list(net.parameters()) == params  # the same tensors: nothing else holds stale ones
    for old, new in zip(opt.param_groups, fused.param_groups, strict=True):
        assert new["params"] == old["params"] and new["fused"] is True and not new["foreach"]
        keep = {k: v for k, v in old.items() if k not in ("params", "fused", "foreach")}
        assert {k: new[k] for k in keep} == keep
    assert fused.defaults["fused"] is True and fused.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_fused_optimizer_trains_like_the_given_one(on_a_gpu: None, name: str) -> None:
    data = batches()
    plain_net = conv_net()
    plain = train(plain_net, OPTIMIZERS[name](plain_net.parameters()), data)
    net = conv_net()
    model, opt = hpc_ddp.speed_up(net, OPTIMIZERS[name](net.parameters()), log=lambda _: None)
    assert opt.param_groups[0]["fused"] is True
    fast = train(model, opt, data)
    assert fast == pytest.approx(plain, rel=1e-4, abs=1e-5)
    for a, b in zip(plain_net.parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_what_it_leaves_and_why(on_a_gpu: None) -> None:
    mlp = nn.Sequential(nn.Linear(4, 4))
    fast = hpc_ddp.speed_up(mlp, torch.optim.RMSprop(mlp.parameters()), log=lambda _: None)
    assert fast.line == "step: contiguous (no Conv2d), RMSprop as given (no fused CUDA kernel)"
    net = conv_net()
    opt = OPTIMIZERS["adam"](net.parameters())
    fast = hpc_ddp.speed_up(net, opt, memory_format="contiguous", fused=False, log=lambda _: None)
    assert fast.line == "step: contiguous (memory_format=contiguous), Adam as given (fused off)"
    assert fast.optimizer is opt and net[0].weight.is_contiguous()
    assert hpc_ddp.speed_up(conv_net(), log=lambda _: None).line == "step: channels_last (2 Conv2d)"

    class MySGD(torch.optim.SGD):  # a constructor speed_up cannot call for the user
        def __init__(self, params, scale: float) -> None:
            super().__init__(params, lr=0.1 * scale)

    net = conv_net()
    opt = MySGD(net.parameters(), 2.0)
    fast = hpc_ddp.speed_up(net, opt, log=lambda _: None)
    assert fast.optimizer is opt and not fast.fused
    assert fast.line.endswith("MySGD as given (its own constructor: pass it fused=True)")


def test_channels_last_can_be_asked_for_on_a_cpu() -> None:
    net = conv_net()
    fast = hpc_ddp.speed_up(net, memory_format="channels_last", log=lambda _: None)
    assert fast.line == "step: channels_last (2 Conv2d)" and fast.channels_last
    assert net[3].weight.is_contiguous(memory_format=torch.channels_last)


def test_what_cannot_be_sped_up_is_refused_with_the_fix() -> None:
    net = conv_net()
    opt = OPTIMIZERS["sgd"](net.parameters())
    with pytest.raises(hpc_ddp.ConfigError, match="memory_format='nhwc'") as err:
        hpc_ddp.speed_up(net, opt, memory_format="nhwc")  # type: ignore[arg-type]
    assert "channels_last" in str(err.value.hint)
    with pytest.raises(hpc_ddp.ConfigError, match="DataParallel-wrapped") as err:
        hpc_ddp.speed_up(nn.DataParallel(net), opt)
    assert "before wrapping" in str(err.value.hint)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1)
    with pytest.raises(hpc_ddp.ConfigError, match="LR scheduler") as err:
        hpc_ddp.speed_up(net, opt)
    assert "after speed_up" in str(err.value.hint)
    del scheduler
    opt = OPTIMIZERS["sgd"](net.parameters())
    train(net, opt, batches(1))
    with pytest.raises(hpc_ddp.ConfigError, match="already has state") as err:
        hpc_ddp.speed_up(net, opt)
    assert "before the first step" in str(err.value.hint)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_checkpoints_move_between_fused_and_unfused_optimizers(on_a_gpu: None, name: str) -> None:
    """The kernel is the loader's: a fused optimizer's state loads into an unfused one, which
    stays unfused, and back, where the fused one stays fused; both continue alike."""
    data = batches(4)
    net = conv_net()
    _, fused = hpc_ddp.speed_up(net, OPTIMIZERS[name](net.parameters()), log=lambda _: None)
    train(net, fused, data[:2])
    saved = copy.deepcopy(fused.state_dict())  # what a checkpoint holds: no live tensors
    assert all(g["fused"] is None and g["foreach"] is None for g in saved["param_groups"])
    assert fused.param_groups[0]["fused"] is True  # saving changed nothing live

    twin = conv_net()
    twin.load_state_dict(net.state_dict())
    plain = OPTIMIZERS[name](twin.parameters())
    plain.load_state_dict(saved)
    assert plain.param_groups[0]["fused"] is None
    again_net = conv_net()
    _, again = hpc_ddp.speed_up(
        again_net, OPTIMIZERS[name](again_net.parameters()), log=lambda _: None
    )
    again_net.load_state_dict(twin.state_dict())
    again.load_state_dict(copy.deepcopy(plain.state_dict()))  # unfused, into a fused one
    assert again.param_groups[0]["fused"] is True
    rest_plain, rest_fused = train(twin, plain, data[2:]), train(again_net, again, data[2:])
    assert rest_fused == pytest.approx(rest_plain, rel=1e-4, abs=1e-5)


def test_resumable_restores_a_fused_checkpoint_into_an_unfused_optimizer_and_back(
    on_a_gpu: None, tmp_path: Path
) -> None:
    data = batches(4)

    def make(fast: bool) -> tuple[hpc_ddp.Resumable, nn.Module, torch.optim.Optimizer]:
        net = conv_net()
        opt = OPTIMIZERS["adam"](net.parameters())
        if fast:
            net, opt = hpc_ddp.speed_up(net, opt, log=lambda _: None)
        run = hpc_ddp.Resumable(
            tmp_path, signals=[], keep=2, log=lambda _: None, model=net, optimizer=opt
        )
        return run, net, opt

    first, net, opt = make(fast=True)
    train(net, opt, data[:2])
    first.steps = 2
    first.save()
    first.close()
    second, net2, opt2 = make(fast=False)  # restores on construction
    assert second.resumed_from is not None and opt2.param_groups[0]["fused"] is None
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), net2.parameters(), strict=True))
    train(net2, opt2, data[2:3])
    second.steps = 3
    second.save()
    second.close()
    third, net3, opt3 = make(fast=True)
    assert third.steps == 3 and opt3.param_groups[0]["fused"] is True
    assert all(torch.equal(a, b) for a, b in zip(net2.parameters(), net3.parameters(), strict=True))
    a, b = train(net2, opt2, data[3:]), train(net3, opt3, data[3:])
    assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
    third.close()


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_a_contiguous_models_checkpoint_continues_in_channels_last_and_fused(
    on_a_gpu: None, name: str
) -> None:
    """The fused kernel walks a weight, its gradient and its state as flat memory: momentum
    saved for an NCHW weight is laid out again for the channels_last one when it loads."""
    data = batches(4)
    plain_net = conv_net()
    plain = OPTIMIZERS[name](plain_net.parameters())
    train(plain_net, plain, data[:2])
    net = conv_net()
    _, fused = hpc_ddp.speed_up(net, OPTIMIZERS[name](net.parameters()), log=lambda _: None)
    net.load_state_dict(plain_net.state_dict())
    fused.load_state_dict(copy.deepcopy(plain.state_dict()))
    weight = net[0].weight
    for value in fused.state[weight].values():
        assert value.device == weight.device
        assert value.dim() == 0 or value.stride() == weight.stride()
    rest_fused, rest_plain = train(net, fused, data[2:]), train(plain_net, plain, data[2:])
    assert rest_fused == pytest.approx(rest_plain, rel=1e-4, abs=1e-5)
    for a, b in zip(plain_net.parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("model", "memory_format", "line"),
    [
        ("resnet18", "auto", "step: channels_last (2 Conv2d), fused AdamW"),
        ("my_models:net", "auto", "step: channels_last (2 Conv2d), fused AdamW"),
        ("my_models:net", "channels_last", "step: channels_last (2 Conv2d), fused AdamW"),
        ("lenet", "contiguous", "step: contiguous (memory_format=contiguous), fused AdamW"),
    ],
)  # fmt: skip
def test_the_trainer_speeds_up_its_step_as_configured(
    on_a_gpu: None, model: str, memory_format: str, line: str, capsys: pytest.CaptureFixture
) -> None:
    """StepPlan.speed_up, the trainer's one call of hpc_ddp.speed_up, as the config asks (a
    plug-in model without an input to try is taken as it says)."""
    from hpc_ddp.train.config import TrainConfig
    from hpc_ddp.train.fast.choice import StepPlan
    from hpc_ddp.train.optim import build_optimizer

    cfg = TrainConfig(model=model, memory_format=memory_format)
    plan = StepPlan(cfg, None, None, captured=False, sync="none")  # type: ignore[arg-type]
    net = conv_net()
    capsys.readouterr()
    sped = plan.speed_up(net, build_optimizer(cfg, net.parameters()))
    assert capsys.readouterr().out.splitlines() == [line]  # the trainer's log: rank 0's stdout
    assert sped.fused and sped.channels_last == line.startswith("step: channels_last")
    off = TrainConfig(model="my_models:net", fused_optimizer=False, memory_format="contiguous")
    net = conv_net()
    sped = StepPlan(off, None, None, False, "none").speed_up(  # type: ignore[arg-type]
        net, build_optimizer(off, net.parameters())
    )
    assert not sped.fused and not sped.channels_last


def test_the_trainer_on_a_cpu_says_only_that(capsys: pytest.CaptureFixture) -> None:
    from hpc_ddp.train.config import TrainConfig
    from hpc_ddp.train.fast.choice import StepPlan
    from hpc_ddp.train.optim import build_optimizer

    cfg = TrainConfig(model="my_models:net")  # a plug-in's note only where speed_up acts
    net = conv_net()
    capsys.readouterr()
    StepPlan(cfg, None, None, False, "none").speed_up(  # type: ignore[arg-type]
        net, build_optimizer(cfg, net.parameters())
    )
    assert capsys.readouterr().out == "step: as given (the model is on cpu, not a CUDA device)\n"


TRAINER_ON_A_GPU = r"""
import json, sys
from hpc_ddp.runtime import fast_step
from hpc_ddp.train.fast import gpu_data
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.trainer import train
fast_step.FAST_DEVICES = ("cpu",)  # the CPU stands in for the GPU: channels_last, fused SGD
gpu_data.fits_on_device = lambda nbytes, device, fraction=0.25: (True, "pretended")
print("SHA", train(TrainConfig(**json.loads(sys.argv[1]))).params_sha256)
"""


@pytest.mark.slow
def test_the_trainers_faster_step_resumes_bit_identical(tmp_path: Path) -> None:
    """The trainer with speed_up's choices (channels_last, fused SGD, the GPU-resident batches
    in channels_last; the CPU standing in for the GPU): a run continued from its epoch-1
    checkpoint ends with the uninterrupted run's weights, bit for bit."""
    import json
    import subprocess
    import sys

    from trainer_helpers import job_env

    def train(run_dir: str, epochs: int) -> str:
        settings = {
            "data_dir": str(tmp_path / "data"), "synthetic": True, "synthetic_train_size": 256,
            "synthetic_test_size": 64, "batch_size": 32, "lr_schedule": "constant",
            "optimizer": "sgd", "lr": 0.05, "log_every": 1000, "epochs": epochs,
            "run_dir": str(tmp_path / run_dir),
            "memory_format": "channels_last",  # LeNet's narrow convolutions: auto keeps NCHW
        }  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-c", TRAINER_ON_A_GPU, json.dumps(settings)],
            env=job_env(), capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert "step: channels_last (2 Conv2d), fused SGD" in done.stdout, done.stdout
        return done.stdout.split("SHA ")[-1].strip()

    straight = train("straight", 2)
    train("continued", 1)
    assert train("continued", 2) == straight


def test_a_sharded_model_is_left_as_given(on_a_gpu: None) -> None:
    """FSDP2's fully_shard makes the parameters DTensors: their layout and the optimizer's
    kernel are the sharding's (one real Gloo process group of one process)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        net = conv_net()
        fully_shard(net)
        opt = OPTIMIZERS["adamw"](net.parameters())
        fast = hpc_ddp.speed_up(net, opt, log=lambda _: None)
        assert fast.line == "step: as given (a sharded model: its parameters are DTensors)"
        assert fast.optimizer is opt and not fast.fused and not fast.channels_last
        assert net[0].weight.to_local().is_contiguous()
    finally:
        dist.destroy_process_group()


class ViewsNCHW(nn.Module):
    """A user's model written for NCHW activations: ``view`` of a feature map."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8 * 8 * 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.conv(x))
        return self.head(x.view(x.shape[0], -1))


def test_an_example_keeps_a_model_that_fails_in_channels_last_as_built(on_a_gpu: None) -> None:
    """With ``example``, auto tries the forward in channels_last first: a model that views NCHW
    activations stays contiguous, says why, and is left in training mode with its statistics
    untouched; a model that runs keeps channels_last."""
    net = ViewsNCHW()
    stats = copy.deepcopy(net.norm.state_dict())
    x = torch.randn(1, 3, 8, 8)
    with pytest.raises(RuntimeError, match="view"):  # what training would hit otherwise
        net.to(memory_format=torch.channels_last)(x.to(memory_format=torch.channels_last))
    net = ViewsNCHW()
    lines: list[str] = []
    fast = hpc_ddp.speed_up(net, OPTIMIZERS["sgd"](net.parameters()), example=x, log=lines.append)
    assert not fast.channels_last and fast.memory_format == torch.contiguous_format
    assert net.conv.weight.is_contiguous() and net.training
    assert lines[0].startswith("step: contiguous (its forward fails in channels_last: view")
    assert lines[0].endswith("fused SGD")
    for key, value in net.norm.state_dict().items():
        assert torch.equal(value, stats[key]), key
    net(x).sum().backward()  # and it trains as built
    fine = conv_net()
    fast = hpc_ddp.speed_up(fine, example=torch.randn(1, 3, 8, 8), log=lines.append)
    assert fast.channels_last and lines[-1] == "step: channels_last (2 Conv2d)"
    # A function is called only where the trial runs; an explicit channels_last is what the
    # caller asked: no trial.
    called: list[int] = []
    forced = hpc_ddp.speed_up(
        ViewsNCHW(), memory_format="channels_last", example=lambda: called.append(1), log=print
    )
    assert forced.channels_last and called == []


def test_the_trainer_tries_a_plug_in_model_on_a_training_input(on_a_gpu: None) -> None:
    """The trainer hands its data's first input to the layout trial for a plug-in model only:
    the built-in models are known to run in channels_last."""
    from hpc_ddp.train.config import TrainConfig
    from hpc_ddp.train.fast.choice import StepPlan
    from hpc_ddp.train.optim import build_optimizer

    asked: list[str] = []

    def example() -> torch.Tensor:
        asked.append("example")
        return torch.randn(1, 3, 8, 8)

    for model, wanted, tried in (("my_models:net", False, True), ("lenet", True, False)):
        cfg = TrainConfig(model=model)
        plan = StepPlan(cfg, None, None, captured=False, sync="none")  # type: ignore[arg-type]
        net = ViewsNCHW() if model != "lenet" else conv_net()
        asked.clear()
        sped = plan.speed_up(net, build_optimizer(cfg, net.parameters()), example)
        assert sped.channels_last is wanted and bool(asked) is tried, model


def test_auto_keeps_narrow_convolutions_in_nchw(on_a_gpu: None) -> None:
    """LeNet's convolutions (6 and 16 channels) have no tensor-core NHWC kernels and step
    faster in NCHW: auto leaves such a model as built and says why; asked, it converts."""
    from hpc_ddp.train.cifar.models import build_model

    lenet = build_model("lenet", 10)
    fast = hpc_ddp.speed_up(lenet, log=lambda _: None)
    assert not fast.channels_last
    assert fast.line == "step: contiguous (1 of 2 Conv2d narrower than 8-channel multiples)"
    asked = hpc_ddp.speed_up(build_model("lenet", 10), memory_format="channels_last", log=print)
    assert asked.channels_last
