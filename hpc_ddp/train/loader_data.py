"""A map-style dataset served through a DataLoader over this rank's ``ShardPlan`` indices.

The data path of any dataset that is not held on the GPU: the CIFAR demo's torchvision path
(cifar/data.py adds its per-epoch augmentation seed) and every plug-in dataset.

A dataset whose item cannot be read returns a ``FailedItem`` in its place instead of raising.
The DataLoader carries it, as the batch, to the process that iterates, which raises its error
there: an exception raised in a worker process would reach the user as that worker's traceback
inside a new exception's message, and one that ends a worker (SystemExit) as "worker exited
unexpectedly", neither naming the dataset nor the item.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset, default_collate

from hpc_ddp import ResumableDistributedSampler, ShardPlan, eval_indices
from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.train import data_wait
from hpc_ddp.train.data_source import Batch
from hpc_ddp.train.loader_settings import LoaderSettings, reads_from_disk

T = TypeVar("T")


@dataclass(frozen=True)
class FailedItem:
    """An item a dataset could not give: the error to raise where the batches are used."""

    message: str
    hint: str | None = None

    def error(self) -> ConfigError:
        return ConfigError(self.message, hint=self.hint)

    @classmethod
    def or_item(cls, get: Callable[[int], T], index: int) -> T | FailedItem:
        """``get(index)``, or the error it raised as a ``FailedItem``: a dataset's
        ``__getitem__`` runs in a loader worker, where a raised error would lose its hint."""
        try:
            return get(index)
        except HpcDdpError as err:
            return cls(err.message, err.hint)


def collate(items: list[Any]) -> Any:
    """``default_collate``, or the first ``FailedItem`` among ``items`` as the batch."""
    failed = next((item for item in items if isinstance(item, FailedItem)), None)
    return failed if failed is not None else default_collate(items)


def _on(device: torch.device, batches: Iterable[Any]) -> Iterator[Batch]:
    for batch in batches:
        if isinstance(batch, FailedItem):
            raise batch.error()
        x, y = batch
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


class EpochIndex(int):
    """A sample index that carries its epoch, for a dataset whose items depend on it (random
    augmentation seeded by (seed, epoch, index)): persistent workers hold a copy of the dataset
    made when they started, so an epoch set on the dataset later would never reach them. A
    dataset asks for these by setting ``epoch_indices = True``; it is an ``int`` otherwise."""

    epoch: int

    def __new__(cls, index: int, epoch: int) -> EpochIndex:
        obj = super().__new__(cls, index)
        obj.epoch = epoch
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (EpochIndex, (int(self), self.epoch))


class _EpochIndices(Sampler[int]):
    """The resumable sampler's indices as ``EpochIndex`` of its current epoch."""

    def __init__(self, inner: ResumableDistributedSampler) -> None:
        self.inner = inner

    def __iter__(self) -> Iterator[int]:
        epoch = self.inner.epoch
        return (EpochIndex(i, epoch) for i in self.inner)

    def __len__(self) -> int:
        return len(self.inner)


class _EpochStream(Sampler[list[int]]):
    """This rank's micro-batches of the ``ShardPlan``, from (``epoch``, ``start``) on and then
    epoch after epoch without end: one DataLoader iterator over it never stops at an epoch's
    end, so its workers decode the next epoch's first batches while the last ones train and the
    evaluation runs, instead of all starting again from an empty queue. Each index is an
    ``EpochIndex``: the item a worker decodes ahead is the next epoch's."""

    def __init__(self, plan: ShardPlan, rank: int) -> None:
        self.plan = plan
        self.rank = rank
        self.epoch = 0
        self.start = 0

    def __iter__(self) -> Iterator[list[int]]:
        epoch, start, size = self.epoch, self.start, self.plan.micro_batch
        while True:
            indices = self.plan.indices(epoch, self.rank, start).tolist()
            for first in range(0, len(indices), size):
                yield [EpochIndex(i, epoch) for i in indices[first : first + size]]
            epoch, start = epoch + 1, 0


def wants_epoch_indices(data: object) -> bool:
    return bool(getattr(data, "epoch_indices", False))


@dataclass
class LoaderTrainData:
    """Training micro-batches from a DataLoader over this rank's ``ShardPlan`` indices.

    One DataLoader serves every epoch. Without workers, each epoch's iterator takes the
    sampler's new epoch and start (the data position a checkpoint holds). With workers (they
    persist), one iterator streams across epoch ends (``_EpochStream``) and each epoch takes
    its count of batches from it; an epoch asked for at another position than where the stream
    stands (the first, a resumed one, one after an epoch left unfinished) starts a new one."""

    plan: ShardPlan
    data: Dataset[Any]
    rank: int
    device: torch.device
    num_workers: int = 0
    settings: LoaderSettings | None = None  # given: its workers, pinning and prefetch
    meter: data_wait.WaitMeter = field(default_factory=data_wait.WaitMeter)
    _loader: DataLoader[Any] | None = field(default=None, init=False, repr=False)
    _sampler: ResumableDistributedSampler | _EpochStream | None = field(
        default=None, init=False, repr=False
    )
    _stream: Iterator[Any] | None = field(default=None, init=False, repr=False)
    _stream_at: tuple[int, int] | None = field(default=None, init=False, repr=False)

    def loader_kwargs(self) -> dict[str, Any]:
        if self.settings is not None:
            return self.settings.loader_kwargs()
        return {"num_workers": self.num_workers, "pin_memory": self.device.type == "cuda"}

    def batches(self, epoch: int, start: int) -> Iterator[Batch]:
        kwargs = self.loader_kwargs()
        # Its own generator: iter(DataLoader) draws its workers' base seed from the global RNG
        # otherwise, shifting the training's random stream (dropout) at every new iterator.
        kwargs["generator"] = torch.Generator().manual_seed(self.plan.seed)
        if kwargs.get("num_workers", 0):
            batches = self._streamed(epoch, start, kwargs)
        else:
            batches = self._per_epoch(epoch, start, kwargs)
        batches = _on(self.device, batches)
        return self.meter.wrap(batches) if reads_from_disk(self.data) else batches

    def _per_epoch(self, epoch: int, start: int, kwargs: dict[str, Any]) -> Iterable[Any]:
        if self._loader is None:
            self._sampler = ResumableDistributedSampler(self.plan, self.rank)
            sampler: Sampler[int] = self._sampler
            if wants_epoch_indices(self.data):
                sampler = _EpochIndices(self._sampler)
            self._loader = DataLoader(
                self.data,
                batch_size=self.plan.micro_batch,
                sampler=sampler,
                collate_fn=collate,
                **kwargs,
            )
        assert isinstance(self._sampler, ResumableDistributedSampler)
        self._sampler.set_epoch(epoch, start)
        return self._loader

    def _streamed(self, epoch: int, start: int, kwargs: dict[str, Any]) -> Iterator[Any]:
        if self._loader is None:
            self._sampler = _EpochStream(self.plan, self.rank)
            self._loader = DataLoader(
                self.data, batch_sampler=self._sampler, collate_fn=collate, **kwargs
            )
        assert isinstance(self._sampler, _EpochStream)
        if self._stream is None or self._stream_at != (epoch, start):
            self._sampler.epoch, self._sampler.start = epoch, start
            self._stream = iter(self._loader)  # persistent workers: their queues start anew
        count = -(-self.plan.rank_left(start) // self.plan.micro_batch)
        self._stream_at = None  # until the epoch's batches have all been taken
        return self._take(self._stream, count, (epoch + 1, 0))

    def _take(self, stream: Iterator[Any], count: int, then: tuple[int, int]) -> Iterator[Any]:
        for _ in range(count):
            yield next(stream)
        self._stream_at = then

    def starvation(self, epoch: int) -> str | None:
        """The starvation line (data_wait.advice) at the end of ``epoch`` (1-based) when
        ``data_wait.says`` so, for a dataset read from disk."""
        if not reads_from_disk(self.data):
            return None
        waited = self.meter.latest
        if epoch == 1:
            self.meter.first_share = waited.share
        if not data_wait.says(epoch, waited.share, self.meter.first_share):
            return None
        settings = self.settings
        workers = settings.workers if settings is not None else self.num_workers
        cores = settings.cores if settings is not None else 1
        origin = settings.cores_from if settings is not None else "unknown"
        return data_wait.advice(
            waited, workers=workers, cores=cores, cores_from=origin, epoch=epoch
        )


def eval_batches(
    data: Dataset[Any],
    rank: int,
    world_size: int,
    batch_size: int,
    device: torch.device,
    loader_kwargs: dict[str, Any] | None = None,
) -> Iterator[Batch]:
    """This rank's exact share of the test set (no padding: the shards partition the set)."""
    return _on(device, _eval_loader(data, rank, world_size, batch_size, loader_kwargs or {}))


def _eval_loader(
    data: Dataset[Any], rank: int, world_size: int, batch_size: int, kwargs: dict[str, Any]
) -> DataLoader[Any]:
    shard = Subset(data, list(eval_indices(len(data), rank, world_size)))  # type: ignore[arg-type]
    return DataLoader(shard, batch_size=batch_size, shuffle=False, collate_fn=collate, **kwargs)


@dataclass
class LoaderEvalData:
    """The evaluation shard behind the ``batches(size)`` interface of ``data_source.EvalData``.

    With ``settings`` of workers, one DataLoader per batch size serves every evaluation (its
    workers persist between epochs)."""

    dataset: Dataset[Any]
    rank: int
    world_size: int
    device: torch.device
    settings: LoaderSettings | None = None
    _loaders: dict[int, DataLoader[Any]] = field(default_factory=dict, init=False, repr=False)

    def batches(self, batch_size: int) -> Iterator[Batch]:
        if self.settings is None or not self.settings.workers:
            kwargs = self.settings.loader_kwargs() if self.settings is not None else {}
            return eval_batches(
                self.dataset, self.rank, self.world_size, batch_size, self.device, kwargs
            )
        loader = self._loaders.get(batch_size)
        if loader is None:
            kwargs = self.settings.loader_kwargs()
            loader = _eval_loader(self.dataset, self.rank, self.world_size, batch_size, kwargs)
            self._loaders[batch_size] = loader
        return _on(self.device, loader)
