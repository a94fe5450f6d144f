"""The trainer's optimizers skip torch.optim's torch._dynamo wrappers and compute the same."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from hpc_ddp.train.optim import without_dynamo

CASES = [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 5e-4}),
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 5e-4, "fused": True}),
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4}),
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "fused": True}),
]


def _train(optimizer_class: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> tuple:
    """Five steps with a schedule, a state-dict round trip in the middle; params + state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = optimizer_class(model.parameters(), **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    data = torch.Generator().manual_seed(1)
    for step in range(5):
        x = torch.randn(4, 6, generator=data)
        model(x).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        if step == 2:
            opt.load_state_dict(opt.state_dict())
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


@pytest.mark.parametrize(("base", "kwargs"), CASES, ids=lambda c: str(c))
def test_same_parameters_and_state_as_torch_optim(
    base: type[torch.optim.Optimizer], kwargs: dict[str, Any]
) -> None:
    ours = without_dynamo(base)
    assert ours is not base and issubclass(ours, base)
    theirs_params, theirs_state = _train(base, kwargs)
    our_params, our_state = _train(ours, kwargs)
    for a, b in zip(theirs_params, our_params, strict=True):
        assert torch.equal(a, b)
    assert our_state["param_groups"] == theirs_state["param_groups"]
    for key, state in theirs_state["state"].items():
        for name, value in state.items():
            ours_value = our_state["state"][key][name]
            assert torch.equal(torch.as_tensor(ours_value), torch.as_tensor(value))


def test_a_training_process_never_imports_torch_dynamo() -> None:
    """Fresh interpreter (pytest's may have imported it): build, step, schedule, save, load."""
    code = """
import sys, torch
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.optim import build_optimizer, lr_lambda
for name in ("adam", "sgd"):
    cfg = TrainConfig(optimizer=name)
    model = torch.nn.Linear(4, 2)
    opt = build_optimizer(cfg, model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, 10))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for _ in range(2):
        scaler.scale(model(torch.randn(3, 4)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
