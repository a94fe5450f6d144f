"""``hpc_ddp.CapturedStep`` on the CPU, where it runs its step eagerly: the same weights as DDP
with the same optimizer over two real Gloo processes (accumulation and a short last step
included), its one-line reason, its refusals, a forgotten one closed before the process group
goes, and the optimizer's checkpoint written as the eager optimizer's. The graph itself needs a
GPU (tests/test_gpu_captured_step.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from trainer_helpers import spawn_ranks

import hpc_ddp
from hpc_ddp.cluster.master_port import free_port
from hpc_ddp.dist import end_process_group, shutdown_and_exit
from hpc_ddp.runtime.capturable import given_flags, make_capturable, saved_as_given

CPU_LINE = "captured step: eager, not captured (the model is on cpu, not a CUDA GPU)"


def _net() -> nn.Module:
    torch.manual_seed(0)  # no dropout: the two models' forwards must not share one RNG stream
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


class _Mixed(nn.Module):
    """Parameters of two dtypes: no one flat gradient buffer, so each gradient is averaged by an
    all-reduce of its own (the step's other eager path)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 32).double(), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x.double())).float())


def _sgd(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)


def _ddp_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    result = _against_ddp(rank, _net)
    mixed = _against_ddp(rank, _Mixed)
    end_process_group()  # the script forgot step.close(): the group's end closes it first
    for one in (result, mixed):
        try:
            one.pop("step")(*one.pop("batch"))
            one["closed"] = False
        except hpc_ddp.ConfigError:
            one["closed"] = True
    torch.save({"flat": result, "mixed": mixed}, f"{out}.{rank}")
    shutdown_and_exit(0)  # Gloo can abort at interpreter exit (hpc_ddp.dist explains); this cannot


def _against_ddp(rank: int, build: Callable[[], nn.Module]) -> dict:
    """DDP and CapturedStep side by side on ``build()``'s model, each rank its own data."""
    a, b = build(), build()
    if rank == 1:  # CapturedStep must start from rank 0's weights, as DDP's constructor does
        with torch.no_grad():
            for p in b.parameters():
                p.add_(1.0)
    ddp, opt_a, opt_b = DDP(a), _sgd(a), _sgd(b)
    lines: list[str] = []
    step = hpc_ddp.CapturedStep(b, opt_b, accum_steps=2, log=lines.append)
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own data
    sizes = [8] * 6 + [3]  # 3 steps of 2 micro-batches, then a short step of one odd batch
    batches = [
        (torch.randn(n, 16, generator=g), torch.randint(4, (n,), generator=g)) for n in sizes
    ]
    same_loss = []
    for i, (x, y) in enumerate(batches):
        sync = (i + 1) % 2 == 0 or i + 1 == len(batches)
        with contextlib.nullcontext() if sync else ddp.no_sync():  # the plain DDP recipe
            loss = F.cross_entropy(ddp(x), y)
            (loss / 2).backward()
        if sync:
            opt_a.step()
            opt_a.zero_grad(set_to_none=True)
        same_loss.append(torch.equal(step(x, y, sync=sync), loss.detach()))
    equal = [torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters(), strict=True)]
    start = build().parameters()
    moved = max((pa - p0).abs().max().item() for pa, p0 in zip(a.parameters(), start, strict=True))
    params = [p.detach() for p in b.parameters()]
    return {"equal": equal, "same_loss": same_loss, "lines": lines, "moved": moved,
            "params": params, "step": step, "batch": batches[0]}  # fmt: skip


@pytest.mark.timeout(120)
def test_eager_step_is_ddp_bit_for_bit_on_two_ranks_and_the_group_closes_it(tmp_path) -> None:
    """Two ranks, SGD with momentum and weight decay, 2 micro-batches a step and a short last
    step: every weight and every loss equals DDP's (sum of the ranks' gradients / 2 is exact,
    so the strongest claim holds: bit for bit)."""
    out = str(tmp_path / "res")
    spawn_ranks(_ddp_worker, (free_port(), out), 2)
    ranks = [torch.load(f"{out}.{r}") for r in (0, 1)]
    for kind in ("flat", "mixed"):  # one flat buffer and its buckets; a gradient at a time
        r0, r1 = (r[kind] for r in ranks)
        for r in (r0, r1):
            assert all(r["equal"]) and all(r["same_loss"]), (kind, r)
            assert r["moved"] > 1e-3  # it trained
            assert r["lines"] == [CPU_LINE] and r["closed"], (kind, r)
        for p0, p1 in zip(r0["params"], r1["params"], strict=True):
            assert torch.equal(p0, p1)  # the ranks stay in lockstep


def test_one_process_says_why_it_steps_eagerly() -> None:
    net = _net()
    lines: list[str] = []
    hpc_ddp.CapturedStep(net, _sgd(net), log=lines.append)
    hpc_ddp.CapturedStep(net, _sgd(net), capture=False, log=lines.append)
    assert lines == [CPU_LINE, "captured step: eager, not captured (capture=False)"]


def test_the_returned_loss_is_overwritten_by_the_next_call() -> None:
    net = _net()
    step = hpc_ddp.CapturedStep(net, _sgd(net), log=lambda _: None)
    x, y = torch.randn(8, 16), torch.randint(4, (8,))
    first = step(x, y)
    kept = first.clone()
    second = step(x, y)
    assert second is first and not torch.equal(kept, second)  # documented: read it before


def test_a_zero_grad_left_in_the_loop_changes_nothing() -> None:
    """``opt.zero_grad()`` (set_to_none) between steps, as a loop written for DDP has it: the
    step points ``.grad`` back at its buffer, and trains as without it."""
    nets = [_net(), _net()]
    opts = [_sgd(net) for net in nets]
    steps = [
        hpc_ddp.CapturedStep(n, o, log=lambda _: None) for n, o in zip(nets, opts, strict=True)
    ]
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        x, y = torch.randn(8, 16, generator=g), torch.randint(4, (8,), generator=g)
        opts[1].zero_grad()
        for step in steps:
            step(x, y)
    for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        assert torch.equal(a, b)
    flat = steps[1].flat
    assert flat is not None
    for p in nets[1].parameters():
        assert p.grad is not None and p.grad.untyped_storage().data_ptr() == flat.data_ptr()


def _foreign_optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)


@pytest.mark.parametrize(
    ("wrap", "optimizer", "kw", "words"),
    [
        (nn.DataParallel, _sgd, {}, "DataParallel-wrapped model"),
        (None, _foreign_optimizer, {}, "not parameters of the model"),
        (None, lambda n: torch.optim.LBFGS(n.parameters()), {}, "LBFGS steps with a closure"),
        (None, _sgd, {"accum_steps": 0}, "accum_steps=0 is out of range"),
        (None, _sgd, {"accum_steps": True}, "accum_steps=True is out of range"),
        (None, _sgd, {"warmup": 0}, "warmup=0 is out of range"),
        (None, _sgd, {"amp_dtype": torch.float64}, "amp_dtype=torch.float64 is not supported"),
        (None, _sgd, {"loss_fn": "mse"}, "loss_fn='mse' is not callable"),
    ],
)
def test_unsupported_input_is_refused_with_a_hint(wrap, optimizer, kw, words) -> None:
    net = _net()
    model = wrap(net) if wrap else net
    with pytest.raises(hpc_ddp.ConfigError, match=words) as err:
        hpc_ddp.CapturedStep(model, optimizer(net), log=lambda _: None, **kw)
    assert err.value.exit_code == 2 and err.value.hint


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_a_captured_optimizers_checkpoint_loads_into_an_eager_one_and_back(tmp_path) -> None:
    """What CapturedStep does to the optimizer on a GPU (a tensor LR the scheduler fills, the
    fused kernel), here on SGD's CPU kernel: saved through ``Checkpointer``, the state holds a
    float LR and the flags the optimizer was built with; an eager optimizer loads it and steps
    on exactly as the captured one does, and the captured one loads an eager checkpoint."""
    captured_net, eager_net = _net(), _net()
    captured, eager = _sgd(captured_net), _sgd(eager_net)
    given = given_flags(captured)
    make_capturable(captured, torch.device("cpu"))
    captured.register_state_dict_post_hook(lambda o, sd: saved_as_given(o, sd, given))
    sched = torch.optim.lr_scheduler.LambdaLR(captured, lambda s: 1.0 / (1 + s))
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 16, generator=g), torch.randint(4, (8,), generator=g))] * 4

    def train(net: nn.Module, opt: torch.optim.Optimizer, steps: list) -> None:
        for x, y in steps:
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()

    train(captured_net, captured, batches[:2])
    sched.step()
    ckpt = hpc_ddp.Checkpointer(tmp_path / "ckpt", rank=0, world_size=1)
    state = {"model": captured_net.state_dict(), "optimizer": captured.state_dict()}
    ckpt.save(2, shared=state, per_rank={}, meta={})
    group = ckpt.load_latest().shared["optimizer"]["param_groups"][0]
    assert type(group["lr"]) is float and group["lr"] == pytest.approx(0.025)
    assert (group["fused"], group["foreach"]) == (None, None)  # as built: the loader's default
    eager_net.load_state_dict(ckpt.load_latest().shared["model"])
    eager.load_state_dict(ckpt.load_latest().shared["optimizer"])
    train(eager_net, eager, batches[2:])
    train(captured_net, captured, batches[2:])
    for a, b in zip(eager_net.parameters(), captured_net.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # fused vs for-loop kernel
    captured.load_state_dict(eager.state_dict())  # and back: an eager checkpoint
    make_capturable(captured, torch.device("cpu"))
    assert isinstance(captured.param_groups[0]["lr"], torch.Tensor)
