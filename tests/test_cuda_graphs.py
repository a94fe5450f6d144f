"""The captured step's semantics, checked on the CPU where it runs eagerly.

The graph capture itself needs a GPU (tests/test_gpu.py); what it captures is the same code, so
here we check that code against the trainer's eager ``loop.Stepper``, alone and against DDP over
two real Gloo processes.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from trainer_helpers import spawn_ranks

from hpc_ddp.cluster.master_port import free_port
from hpc_ddp.dist import shutdown_and_exit
from hpc_ddp.errors import ConfigError
from hpc_ddp.runtime.capturable import make_capturable
from hpc_ddp.train.cifar.models import build_model
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.fast import cuda_graphs
from hpc_ddp.train.loop import Stepper, Times

CPU = torch.device("cpu")


def _parts(model: torch.nn.Module):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    return opt, sched, torch.amp.GradScaler("cpu", enabled=False)


def _batches(seed: int, n: int = 6, batch: int = 8):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g))
        for _ in range(n)
    ]


def _run_both(eager_model, graphed_model, batches):
    eager = Stepper(eager_model, *_parts(eager_model), None, CPU)
    graphed = cuda_graphs.GraphedStepper(graphed_model, *_parts(graphed_model), None, CPU)
    losses = []
    for x, y in batches:
        a = eager.step([(x, y)], Times())
        b = graphed.step([(x, y)], Times())
        for loss, _ in (a, b):  # the loss stays on the device: read only where it is needed
            assert isinstance(loss, torch.Tensor) and loss.dtype == torch.float64
        losses.append(((float(a[0]), a[1]), (float(b[0]), b[1])))
    return losses, graphed


def test_single_process_identical_to_stepper() -> None:
    torch.manual_seed(0)
    a = build_model("lenet", 10)
    b = copy.deepcopy(a)
    losses, graphed = _run_both(a, b, _batches(1))
    for (la, na), (lb, nb) in losses:
        assert la == pytest.approx(lb, rel=1e-6) and na == nb == 8
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert losses[0][0] != losses[-1][0]  # it trained
    flat = graphed.graphed.flat  # every .grad is a view into the one all-reduced buffer
    for p in b.parameters():
        assert p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_a_channels_last_model_steps_as_eager_with_the_fused_kernel() -> None:
    """Each .grad view takes its weight's strides: the fused kernel pairs a weight with its
    gradient element for element in memory, so an NCHW gradient of a channels_last weight
    would update every weight from another one's gradient."""
    torch.manual_seed(0)
    a = build_model("lenet", 10).to(memory_format=torch.channels_last)
    b = copy.deepcopy(a)

    def fused(model: torch.nn.Module):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0), scaler

    eager = Stepper(a, *fused(a), None, CPU)
    graphed = cuda_graphs.GraphedStepper(b, *fused(b), None, CPU)
    for x, y in _batches(2, n=3):
        eager.step([(x, y)], Times())
        graphed.step([(x, y)], Times())
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert pb.grad.stride() == pb.stride(), name
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7, msg=name)


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    a = build_model("lenet", 10)
    b = copy.deepcopy(a)
    if rank == 1:  # the graphed path must broadcast rank 0's weights, as DDP does
        with torch.no_grad():
            for p in b.parameters():
                p.add_(1.0)
    _run_both(DDP(a), b, _batches(10 + rank))
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    diff = max((pa - pb).abs().max().item() for pa, pb in pairs)
    torch.save({"diff": diff, "params": [p.detach() for p in b.parameters()]}, f"{out}.{rank}")
    shutdown_and_exit(0)  # Gloo can abort at interpreter exit (hpc_ddp.dist explains); this cannot


@pytest.mark.timeout(120)
def test_two_ranks_match_ddp(tmp_path) -> None:
    out = str(tmp_path / "res")
    spawn_ranks(_worker, (free_port(), out), 2)
    r0, r1 = (torch.load(f"{out}.{r}") for r in (0, 1))
    assert r0["diff"] < 1e-5 and r1["diff"] < 1e-5  # same math as DDP, up to rounding
    for p0, p1 in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(p0, p1)  # the ranks stay in lockstep


@pytest.mark.parametrize(
    ("kw", "amp", "devices", "word"),
    [
        ({}, torch.float16, 1, "fp16"),
        ({"accum_steps": 2}, None, 1, "accum_steps=2"),
        ({"sync_bn": True}, None, 1, "sync_bn"),
        ({}, None, 2, "gpus_per_process=2"),
    ],
)
def test_unsupported_settings_are_refused(kw, amp, devices, word) -> None:
    with pytest.raises(ConfigError, match=word):
        cuda_graphs.check_supported(TrainConfig(**{"optimizer": "adam", **kw}), amp, devices)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_supported_settings_pass(optimizer: str) -> None:
    cuda_graphs.check_supported(TrainConfig(optimizer=optimizer), torch.bfloat16, 1)


GPU = torch.device("cuda", 0)  # a device object only: nothing here touches CUDA


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_auto_captures_every_run_that_qualifies(optimizer: str) -> None:
    for amp in (torch.bfloat16, None):
        choice = cuda_graphs.choose(TrainConfig(optimizer=optimizer), GPU, amp, 1)
        assert choice.captured and choice.line.startswith("CUDA graphs: on (auto"), choice
    assert cuda_graphs.choose(TrainConfig(cuda_graphs="on"), GPU, None, 1).captured


@pytest.mark.parametrize(
    ("kw", "device", "amp", "devices", "why"),
    [
        ({}, CPU, None, 1, "device cpu is not a CUDA GPU"),
        ({}, GPU, torch.float16, 1, "amp=fp16: its loss scaler checks for inf on the host"),
        ({"accum_steps": 2}, GPU, None, 1, "accum_steps=2: the captured step takes one"),
        ({"sync_bn": True}, GPU, None, 1, "sync_bn: SyncBatchNorm is not captured"),
        ({}, GPU, None, 2, "gpus_per_process=2: the captured step drives one GPU"),
        ({"time_allreduce": True}, GPU, None, 1, "time_allreduce: it times eager DDP's"),
        ({"cuda_graphs": "off"}, GPU, None, 1, "--no-cuda-graphs"),
    ],
)
def test_auto_says_why_a_run_takes_the_eager_step(kw, device, amp, devices, why) -> None:
    choice = cuda_graphs.choose(TrainConfig(**kw), device, amp, devices)
    assert not choice.captured
    assert choice.line.startswith("CUDA graphs: off (") and why in choice.line, choice.line


@pytest.mark.parametrize(
    ("kw", "device", "amp", "devices", "word"),
    [
        ({}, CPU, None, 1, "needs a CUDA GPU, and this process runs on cpu"),
        ({"accum_steps": 3}, GPU, None, 1, "accum_steps=3"),
        ({}, GPU, torch.float16, 1, "amp=fp16"),
    ],
)
def test_forced_on_refuses_what_it_cannot_capture(kw, device, amp, devices, word) -> None:
    with pytest.raises(ConfigError, match=word) as err:
        cuda_graphs.choose(TrainConfig(cuda_graphs="on", **kw), device, amp, devices)
    assert err.value.exit_code == 2 and err.value.hint


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_make_capturable_turns_lr_into_a_tensor_schedulers_fill() -> None:
    model = build_model("lenet", 10)
    opt, sched, _ = _parts(model)
    make_capturable(opt, CPU)
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and opt.param_groups[0]["capturable"]
    sched.step()
    assert opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(5e-3)


def test_make_capturable_lays_loaded_state_out_as_its_channels_last_weight() -> None:
    """A checkpoint's momentum comes back contiguous (the async save packs it flat); the fused
    kernel would pair it element by element with a channels_last weight's memory. The twin
    goes on with its own state and the multi-tensor SGD."""
    torch.manual_seed(0)
    model, twin = build_model("lenet", 10), build_model("lenet", 10)
    twin.load_state_dict(model.state_dict())
    for m in (model, twin):
        m.to(memory_format=torch.channels_last)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, twin)]
    batches = _batches(4, n=4)

    def train(steps: list) -> None:
        for x, y in steps:
            for m, o in zip((model, twin), opts, strict=True):
                o.zero_grad()
                torch.nn.functional.cross_entropy(m(x), y).backward()
                o.step()

    train(batches[:2])
    saved = copy.deepcopy(opts[0].state_dict())
    for state in saved["state"].values():  # as the async save restores it
        state["momentum_buffer"] = state["momentum_buffer"].contiguous()
    opts[0].load_state_dict(saved)
    make_capturable(opts[0], CPU)
    weight = next(p for p in model.parameters() if p.dim() == 4)
    assert opts[0].state[weight]["momentum_buffer"].stride() == weight.stride()
    train(batches[2:])
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_make_capturable_puts_sgd_on_its_fused_kernel_with_the_same_steps() -> None:
    """SGD under --cuda-graphs: fused kernel, tensor LR that schedulers fill, the same update as
    the multi-tensor SGD (momentum, weight decay) the eager step runs."""
    torch.manual_seed(0)
    model = build_model("lenet", 10)
    twin = build_model("lenet", 10)
    twin.load_state_dict(model.state_dict())
    opts = [
        torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        for m in (model, twin)
    ]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (1 + step)) for o in opts]
    make_capturable(opts[0], CPU)
    group = opts[0].param_groups[0]
    assert group["fused"] and not group["foreach"] and isinstance(group["lr"], torch.Tensor)
    for x, y in _batches(3, n=3):
        for m, o, s in zip((model, twin), opts, scheds, strict=True):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
            s.step()
    assert float(group["lr"]) == pytest.approx(0.05 / 4)  # filled in place by the scheduler
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
