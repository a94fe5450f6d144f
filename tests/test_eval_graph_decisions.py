"""When ``GraphedEval`` records a batch shape (its decision only; the recording itself needs a
GPU: tests/test_gpu_eval_graph.py). Here ``_record`` is replaced by a stand-in that returns a
marker, because CUDA graphs cannot exist on this machine."""

from __future__ import annotations

import torch

from hpc_ddp.train.cifar.models import build_model
from hpc_ddp.train.fast.eval_graph import GraphedEval


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(n, 3, 32, 32), torch.zeros(n, dtype=torch.int64)


def test_a_shape_is_recorded_at_its_second_batch_and_not_while_a_save_runs() -> None:
    busy = [True]
    graphed = GraphedEval(
        build_model("lenet", 10), torch.device("cpu"), may_record=lambda: not busy[0]
    )
    recorded = []
    graphed._record = lambda x, y, amp: recorded.append(len(y)) or "graph"  # type: ignore[method-assign]
    x, y = _batch(4)
    assert graphed._recorded(x, y, None) is None  # first batch: the eager warm-up
    assert graphed._recorded(x, y, None) is None  # a background save in flight: eager again
    assert recorded == [] and not graphed.eager_only
    busy[0] = False
    assert graphed._recorded(x, y, None) == "graph" and recorded == [4]
    assert graphed._recorded(x, y, None) == "graph" and recorded == [4]  # recorded once
    assert graphed._recorded(*_batch(3), None) is None  # another shape warms up on its own


def test_at_most_max_recorded_shapes_are_recorded() -> None:
    """Inputs of many sizes: the first MAX_RECORDED shapes get graphs, the rest run eagerly."""
    from hpc_ddp.train.fast.eval_graph import MAX_RECORDED

    graphed = GraphedEval(build_model("lenet", 10), torch.device("cpu"))
    graphed._record = lambda x, y, amp: "graph"  # type: ignore[method-assign]
    for n in range(1, MAX_RECORDED + 3):
        for _ in range(2):  # each size's warm-up, then its second batch
            graphed._recorded(*_batch(n), None)
    assert len(graphed.recorded) == MAX_RECORDED
    assert len(graphed.eager_only) == 2
    assert graphed._recorded(*_batch(MAX_RECORDED + 1), None) is None
