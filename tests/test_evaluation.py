"""``evaluate`` on one process: the sums it reduces are the per-batch numbers a plain loop over
the batches gives, in batch order, and each sample is counted once. (Two ranks over Gloo:
tests/test_train_ddp.py; the CUDA-graph ``sums_of``: tests/test_gpu_eval_graph.py.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpc_ddp.runtime.evaluation import accumulate, evaluate
from hpc_ddp.train.cifar.models import build_model


def _batches(n: int, size: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return list(zip(x.split(size), y.split(size), strict=True))


def test_metrics_are_the_plain_loops_numbers() -> None:
    torch.manual_seed(0)
    net = build_model("lenet", 10)
    batches = _batches(300, 64)  # the last batch is short (44)
    loss, correct = 0.0, 0
    with torch.no_grad():
        for x, y in batches:
            out = net(x)
            loss += float(F.cross_entropy(out, y, reduction="sum"))
            correct += int((out.argmax(1) == y).sum())
    net.train()
    metrics = evaluate(net, batches)
    assert metrics["test_samples"] == 300 and metrics["test_samples_per_rank"] == [300]
    assert metrics["test_loss"] == loss / 300  # float64 sums in batch order: equal, not close
    assert metrics["test_accuracy"] == correct / 300
    assert net.training  # evaluation put the model back in training mode


def test_sums_of_chooses_how_batches_are_summed() -> None:
    """The trainer's hook: ``evaluate`` reduces whatever ``sums_of`` returns, once."""
    net = build_model("lenet", 10)
    batches = _batches(128, 32)
    seen = []

    def counting(model, items, amp_dtype):
        seen.append(model)
        return accumulate(model, items, amp_dtype)

    assert evaluate(net, batches, sums_of=counting) == evaluate(net, batches)
    assert seen == [net]


def test_no_batches_give_zero_samples() -> None:
    metrics = evaluate(build_model("lenet", 10), [])
    assert metrics["test_samples"] == 0 and metrics["test_samples_per_rank"] == [0]
    assert metrics["test_loss"] == 0.0 and metrics["test_accuracy"] == 0.0
