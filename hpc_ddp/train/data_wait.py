"""Data starvation, said instead of hidden: how long the step waited for its batches.

The loader of a dataset decoded from files measures, each epoch, the time the training loop
spent waiting for the next batch against the whole time between batches (``WaitMeter``); the
first batch of an epoch is left out (the workers start, and fill their prefetch queues, while
the step has nothing to wait for yet). At the end of epoch 1, ``advice`` turns those figures
into one line when the wait is more than ``ALLOWED`` of the step time: how fast one core
decodes, how many cores this process has, how many would keep up, and what would help. Epoch 1's
step is slower than later ones (kernel selection, the warm-up before a captured step), so a loader
that kept up with it may not keep up after: at the end of epoch 2 the line comes (again) when the
wait is over the limit and at least twice epoch 1's (``says``). Both are pure functions of the
measured numbers, so their decisions are tested without timing anything.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

# Above this share of the step spent waiting for data, the run says so.
ALLOWED = 0.05

T = TypeVar("T")


@dataclass
class Waited:
    """One epoch's figures (the first batch left out)."""

    wait_s: float = 0.0  # inside next(): the training loop had no batch
    span_s: float = 0.0  # from the first batch's arrival to the last's consumption
    samples: int = 0  # samples of the batches after the first
    batches: int = 0

    @property
    def share(self) -> float:
        """The share of the time between batches spent waiting (0 without figures)."""
        return self.wait_s / self.span_s if self.span_s > 0 and self.batches > 0 else 0.0


def says(epoch: int, share: float, first_share: float, allowed: float = ALLOWED) -> bool:
    """Whether the end of ``epoch`` (1-based) says its starvation line: epoch 1 over the limit,
    epoch 2 over it and at least twice epoch 1's share, no later epoch."""
    if share <= allowed:
        return False
    return epoch == 1 or (epoch == 2 and share >= 2 * first_share)


class WaitMeter:
    """Measures the waits of the batch iterators it wraps; ``latest`` is the last epoch's,
    ``first_share`` epoch 1's share (for ``says``)."""

    def __init__(self) -> None:
        self.latest = Waited()
        self.first_share = 0.0

    def wrap(self, batches: Iterable[T]) -> Iterator[T]:
        waited = self.latest = Waited()
        it = iter(batches)
        first = True
        start = 0.0
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                if not first:
                    waited.wait_s += time.perf_counter() - t0
                    waited.span_s = time.perf_counter() - start
                return
            now = time.perf_counter()
            if first:
                first, start = False, now
            else:
                waited.wait_s += now - t0
                waited.samples += _samples(item)
                waited.batches += 1
                waited.span_s = now - start
            yield item


def _samples(batch: object) -> int:
    try:
        return len(batch[1])  # type: ignore[index,arg-type]  # (inputs, labels)
    except (TypeError, IndexError):
        return 0


def advice(
    waited: Waited,
    *,
    workers: int,
    cores: int,
    cores_from: str,
    allowed: float = ALLOWED,
    epoch: int = 1,
) -> str | None:
    """The line to print when the step waited more than ``allowed`` of its time, else None."""
    if waited.batches < 1 or waited.span_s <= 0 or waited.samples < 1:
        return None
    share = waited.share
    if share <= allowed:
        return None
    # Starved, the loader delivered what the decoding cores gave: that rate, per core.
    delivered = waited.samples / waited.span_s
    decoders = max(workers, 1)
    per_core = delivered / decoders
    busy = max(waited.span_s - waited.wait_s, 1e-9)
    step_rate = waited.samples / busy  # what the step would take without waiting
    needed = math.ceil(step_rate / per_core) if per_core > 0 else 0
    helps = []
    if workers < max(cores - 1, 1):
        helps.append(f"more --num-workers (now {workers})")
    helps += [
        "more --cpus-per-task (or fewer processes per node)",
        "smaller images",
        "a pre-decoded cache (the decoded pixels as arrays, like the CIFAR files)",
    ]
    return (
        f"data: the step waited for its batches {100 * share:.0f} % of its time in epoch {epoch} "
        f"(more than {100 * allowed:.0f} %): {per_core:.0f} samples/s per decode core x "
        f"{decoders} = {delivered:.0f} samples/s, with {cores} core(s) for this process "
        f"({cores_from}); the step takes {step_rate:.0f} samples/s, which needs about "
        f"{needed} decode cores. What would help: {', '.join(helps)}"
    )
