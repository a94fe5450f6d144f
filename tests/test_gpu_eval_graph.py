"""Evaluation replayed as CUDA graphs (``fast/eval_graph.py``) gives eager evaluation's numbers,
bit for bit, while the weights change between evaluations, beside a captured training step that
shares its memory pool, and falls back to eager batches where a forward cannot be recorded.

Needs one CUDA GPU (skips cleanly without: CI has none). Real models, real graphs, in process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpc_ddp.runtime.evaluation import accumulate
from hpc_ddp.train.cifar.models import build_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _batches(dev: torch.device, n: int = 700, size: int = 256, classes: int = 100):
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(n, 3, 32, 32, device=dev, generator=g)
    y = torch.randint(0, classes, (n,), device=dev, generator=g)
    return list(zip(x.split(size), y.split(size), strict=True))  # 256, 256, then 188


def _sums(fn, model, batches, amp):
    model.eval()
    with torch.no_grad():
        s = fn(model, batches, amp)
    model.train()
    return s.loss.item(), s.correct.item(), s.count


@pytest.mark.parametrize(
    ("model_name", "amp"),
    [("lenet", None), ("resnet18", torch.bfloat16)],
    ids=["lenet", "resnet18-bf16"],
)
def test_graphed_evaluation_equals_eager_as_weights_change(model_name, amp) -> None:
    from hpc_ddp.train.fast.eval_graph import GraphedEval

    torch.backends.cudnn.deterministic = True
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    net = build_model(model_name, 100).to(dev)
    graphed = GraphedEval(net, dev)
    batches = _batches(dev)
    for epoch in range(3):
        assert _sums(graphed.accumulate, net, batches, amp) == _sums(accumulate, net, batches, amp)
        with torch.no_grad():  # training's in-place updates, BatchNorm statistics included
            for t in [*net.parameters(), *(b for b in net.buffers() if b.is_floating_point())]:
                t.mul_(0.9).add_(0.01 * (epoch + 1))
    # Epoch 1: each shape's first batch warms up eagerly, 256 is recorded at its second; the
    # short last batch (188) is recorded at its second, in epoch 2. Then every batch replays.
    assert {shape[0][0] for shape in graphed.recorded} == {256, 188}
    assert graphed.replays == 1 + 3 + 3
    graphed.release()


def test_graphed_evaluation_beside_a_captured_step_sharing_its_pool() -> None:
    """The training graph and the evaluation graph in one pool, replayed in turn: evaluation
    still equals eager evaluation of the weights the steps produced."""
    from hpc_ddp.train.fast.cuda_graphs import GraphedStep
    from hpc_ddp.train.fast.eval_graph import GraphedEval

    torch.backends.cudnn.deterministic = True
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    net = build_model("lenet", 100).to(dev)
    step = GraphedStep(net, torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0))
    graphed = GraphedEval(net, dev, pool=lambda: step.graphs[0].pool() if step.graphs else None)
    batches = _batches(dev)
    g = torch.Generator(device=dev).manual_seed(2)
    for _ in range(3):
        for _ in range(8):
            x = torch.randn(64, 3, 32, 32, device=dev, generator=g)
            step.step(x, torch.randint(0, 100, (64,), device=dev, generator=g))
        eager = _sums(accumulate, net, batches, None)
        assert _sums(graphed.accumulate, net, batches, None) == eager
    assert step.replays > 0 and graphed.replays > 0
    graphed.release()
    step.release()


class _ReadsOnHost(nn.Module):
    """A forward that reads a value on the host: it cannot be recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * 32 * 32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x.flatten(1))
        return out * 2 if float(out.abs().max()) > 1e9 else out


def test_a_forward_that_cannot_be_recorded_runs_eagerly(capsys: pytest.CaptureFixture[str]) -> None:
    from hpc_ddp.train.fast.eval_graph import GraphedEval

    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    net = _ReadsOnHost().to(dev)
    graphed = GraphedEval(net, dev)
    batches = _batches(dev, classes=10)
    for _ in range(2):
        assert _sums(graphed.accumulate, net, batches, None) == _sums(
            accumulate, net, batches, None
        )
    assert not graphed.recorded and graphed.eager_only
    # hpc_ddp's logger writes to stdout and does not propagate (hpc_ddp/log.py).
    said = capsys.readouterr().out
    assert "evaluation runs eagerly: its forward cannot be captured" in said, said
    # The failed recording left the GPU usable.
    assert float(F.relu(torch.ones(2, device=dev)).sum()) == 2.0
