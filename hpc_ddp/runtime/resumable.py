"""``Resumable``: what a training loop of your own needs to survive preemption and resume exactly,
in one object.

    run = hpc_ddp.Resumable("runs/x", model=model, optimizer=opt, loader=loader)
    for epoch in run.epochs(10):          # from the checkpoint's epoch; sets the sampler's epoch
        for x, y in run.batches():        # mid-epoch: from the checkpoint's batch on
            ...; opt.step()
            run.step()                    # counts; checkpoints; preempted: save, requeue, exit 75

It owns the objects to save (anything with ``state_dict``/``load_state_dict``: models, optimizers,
schedulers, gradient scalers), the data position (a DataLoader over a ``DistributedSampler`` or a
``SequentialSampler``: the batches this epoch already consumed are skipped by index, nothing is
loaded twice), every rank's RNG streams (and the loader's generator), the step and epoch counters,
and the preemption signal of any launcher (agreed across ranks at step boundaries, then a
checkpoint, then the requeue the launcher expects, then exit 75). On construction it restores the
newest checkpoint that verifies. Checkpoints are the project's (``Checkpointer``: every rank's
part written, then committed atomically, the newest ``keep`` kept). A DDP model on Gloo gets the
exact per-tensor gradient average (``per_tensor_allreduce``): the bucket sums' order would
otherwise differ between a run and its resume.

A loop with its own data position and preemption schedule (the built-in trainer) uses the same
object through its lower-level methods: ``restore(check=...)`` when it is ready (``restore=False``
at construction), ``save(meta=..., staged=...)`` at the points it chooses (in the background with
``async_save=True``; ``stage()`` queues part of the copy earlier), ``preemption.requested`` for
its own agreement, then ``requeue()``; ``wait()``, ``in_flight`` and ``newest`` for what is
being or was written. Its extra state (progress, counters) is one more object with
``state_dict``/``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

from hpc_ddp.checkpoint import Checkpointer, Loaded, Staged
from hpc_ddp.checkpoint.layout import read_latest
from hpc_ddp.errors import ConfigError
from hpc_ddp.exit_codes import EXIT_REQUEUE
from hpc_ddp.run_paths import RunPaths
from hpc_ddp.runtime import rng
from hpc_ddp.runtime.exact_allreduce import per_tensor_allreduce
from hpc_ddp.runtime.preemption import Preemption, requeue
from hpc_ddp.runtime.sampler import ResumableDistributedSampler

# Samplers whose order depends only on the epoch: skipping the consumed indices resumes exactly.
# (A RandomSampler draws its order from the global RNG at each iter(): not reproducible mid-epoch.)
_ORDERED = (DistributedSampler, SequentialSampler, ResumableDistributedSampler)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any], /) -> Any: ...


class _Skip(torch.utils.data.Sampler[int]):
    """``sampler`` without its first ``count`` indices (the resumed epoch's consumed batches)."""

    def __init__(self, sampler: Any, count: int) -> None:
        self.sampler, self.count = sampler, count

    def __iter__(self) -> Iterator[int]:
        it = iter(self.sampler)
        for _ in range(self.count):
            next(it, None)
        return it

    def __len__(self) -> int:
        return max(len(self.sampler) - self.count, 0)


class Resumable:
    """See the module docstring. Construct it on every rank after the process group is up
    (or without one: a single process), with the same arguments.

    ``run_dir``: checkpoints go to ``run_dir/checkpoints``. ``loader``: the training DataLoader
    (optional: without it, only objects and counters are saved). ``checkpoint_every``: also
    save every N optimizer steps (0: at epoch ends and on preemption only). ``check_every``:
    ask the ranks whether one was signalled every N steps (one small all-reduce each time).
    ``objects``: name -> object to save; a DDP model is saved as its module.

    ``preemption``: one already installed (a signal that came before counts), instead of one
    for ``signals``. ``async_save``: ``save()`` queues a copy of the state and writes it in the
    background (the next save, ``wait()`` or ``close()`` reports its error). ``requeue``: how
    ``requeue()`` asks for the next attempt (``auto``, ``none``...: ``hpc_ddp.requeue``).
    ``restore=False``: the caller restores with ``restore()`` once it is ready. ``log``: where
    its own lines go; without it they are printed on rank 0, and so are its checkpointer's,
    which otherwise log through hpc_ddp's logger (rank 0's lines, every rank's warnings).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        loader: DataLoader[Any] | None = None,
        checkpoint_every: int = 0,
        check_every: int = 1,
        keep: int = 2,
        signals: list[str] | None = None,
        preemption: Preemption | None = None,
        async_save: bool = False,
        requeue: str = "auto",
        restore: bool = True,
        log: Callable[[str], None] | None = None,
        **objects: Stateful,
    ) -> None:
        if checkpoint_every < 0 or check_every < 1:
            raise ConfigError(
                f"checkpoint_every={checkpoint_every}, check_every={check_every}",
                hint="checkpoint_every >= 0 (0: epoch ends only), check_every >= 1",
            )
        grouped = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if grouped else 0
        self.world_size = dist.get_world_size() if grouped else 1
        self.is_main = self.rank == 0
        self.paths = RunPaths(Path(run_dir))
        self.loader = _checked_loader(loader)
        self.checkpoint_every, self.check_every = checkpoint_every, check_every
        self.async_save, self.requeue_mode = async_save, requeue
        if log is not None:
            self.log = log  # type: ignore[method-assign]
        self.objects: dict[str, Stateful] = {}
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(
                    f"Resumable({name}=...): {type(obj).__name__} has no state_dict/"
                    "load_state_dict",
                    hint="pass models, optimizers, schedulers, scalers: objects torch can save",
                )
            if isinstance(obj, DistributedDataParallel):
                if grouped and dist.get_backend() == "gloo":
                    per_tensor_allreduce(obj)
                obj = obj.module
            self.objects[name] = obj
        self.epoch = 0  # epochs finished
        self.steps = 0  # optimizer steps taken, all epochs
        self.batches_done = 0  # batches of the current epoch already consumed
        self.preemption = preemption if preemption is not None else Preemption(signals)
        self.checkpointer = Checkpointer(
            self.paths.checkpoints,
            rank=self.rank,
            world_size=self.world_size,
            keep=keep,
            log=None if log is not None else self.log,
            async_save=async_save,  # its Gloo group: created now, on every rank
        )
        self.resumed_from: Path | None = None
        self._staged_names: tuple[str, ...] = ()
        if restore and self._restore() is not None:
            self.log(f"resumed from {self.resumed_from}: epoch {self.epoch + 1}, step {self.steps}")

    # ----------------------------------------------------------------- the loop
    def epochs(self, total: int) -> Iterator[int]:
        """The epochs still to run, 0-based: from the checkpoint's on. Each sets the sampler's
        epoch; the end of each is checkpointed."""
        while self.epoch < total:
            sampler = self._sampler()
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            yield self.epoch
            self.epoch, self.batches_done = self.epoch + 1, 0
            self.save()

    def batches(self) -> Iterator[Any]:
        """The loader's batches of this epoch, from the first one not yet consumed."""
        if self.loader is None:
            raise ConfigError("Resumable.batches() needs loader=", hint="pass the DataLoader")
        batch_sampler = self.loader.batch_sampler
        assert isinstance(batch_sampler, BatchSampler)  # _checked_loader made sure
        original = batch_sampler.sampler
        if self.batches_done:
            batch_sampler.sampler = _Skip(original, self.batches_done * batch_sampler.batch_size)
        try:
            for batch in self.loader:
                self.batches_done += 1
                yield batch
        finally:
            batch_sampler.sampler = original

    def step(self) -> None:
        """After each optimizer step, on every rank: count it, checkpoint when due, and on a
        preemption agreed by all ranks save, requeue and leave with exit 75 (SystemExit)."""
        self.steps += 1
        if self.steps % self.check_every == 0 and self.preemption.agreed():
            self.save()
            self.wait()  # a background save: committed on every rank before the requeue
            self.log(f"preempted at step {self.steps}: checkpointed; {self.requeue()}")
            raise SystemExit(EXIT_REQUEUE)
        if self.checkpoint_every and self.steps % self.checkpoint_every == 0:
            self.save()

    # ----------------------------------------------------------------- state
    def save(
        self, *, meta: dict[str, Any] | None = None, staged: Staged | None = None
    ) -> Path | None:
        """A checkpoint of everything, now (every rank calls it); its directory, or None when
        it is written in the background (``async_save``). ``meta``: small JSON values added to
        the manifest's; ``staged``: what ``stage()`` already queued for this step."""
        generator = self.loader.generator if self.loader is not None else None
        per_rank: dict[str, Any] = {"rng": rng.capture()}
        if generator is not None:
            per_rank["loader_generator"] = generator.get_state()
        # Only rank 0 writes the shared state (Checkpointer): the other ranks skip the copies.
        done = self._staged_names if staged is not None else ()
        shared = {
            name: obj.state_dict()
            for name, obj in self.objects.items()
            if self.is_main and name not in done
        }
        meta = {
            "epoch": self.epoch,
            "step": self.steps,
            "batches": self.batches_done,
            **(meta or {}),
        }
        if self.async_save:  # waits for the previous save (raising its error), then copies
            self.checkpointer.save_async(
                self.steps, shared=shared, per_rank=per_rank, meta=meta, staged=staged
            )
            return None
        return self.checkpointer.save(self.steps, shared=shared, per_rank=per_rank, meta=meta)

    def stage(self, *names: str) -> Staged:
        """Queue the copy of the named objects' state (all without names) for the checkpoint of
        this step now, ahead of its ``save(staged=...)`` (``async_save`` only): a copy queued
        while the GPU still runs earlier work costs training nothing. They must not change
        before that save."""
        self._staged_names = names or tuple(self.objects)
        state = (
            {n: self.objects[n].state_dict() for n in self._staged_names} if self.is_main else {}
        )
        return self.checkpointer.stage(self.steps, state)

    def wait(self) -> Path | None:
        """Wait for a background save; its directory (None if there was none), or its error."""
        return self.checkpointer.wait()

    @property
    def in_flight(self) -> bool:
        """A background save is still being written."""
        return self.checkpointer.in_flight

    @property
    def newest(self) -> Path | None:
        """The newest committed checkpoint's directory (after any save in flight), or None."""
        self.wait()
        name, _ = read_latest(self.paths.checkpoints)
        return self.paths.checkpoints / name if name else None

    def requeue(self) -> str:
        """On rank 0, ask the launcher to run the job again (``requeue=`` at construction);
        returns what happened (empty on the other ranks). Then leave with exit 75."""
        if not self.is_main:
            return ""
        return requeue(self.requeue_mode, run_paths=self.paths)

    def restore(self, check: Callable[[Loaded], None] | None = None) -> Loaded | None:
        """Restore the newest checkpoint that verifies (what construction does unless
        ``restore=False``, without the line construction logs: the caller says what it
        resumed); returns it, or None when there is none. ``check(loaded)`` may refuse it
        (raise) before anything is restored; with it, the checkpoint's world size is the
        caller's to check."""
        return self._restore(check)

    def _restore(self, check: Callable[[Loaded], None] | None = None) -> Loaded | None:
        expect = None if check is not None else {"world_size": self.world_size}
        loaded = self.checkpointer.load_latest(expect=expect)
        if loaded is None:
            return None
        if check is not None:
            check(loaded)
        for name, obj in self.objects.items():
            obj.load_state_dict(loaded.shared[name])
        rng.restore(loaded.per_rank["rng"])
        generator = self.loader.generator if self.loader is not None else None
        if generator is not None and "loader_generator" in loaded.per_rank:
            generator.set_state(loaded.per_rank["loader_generator"])
        self.epoch, self.steps, self.batches_done = (
            int(loaded.meta[k]) for k in ("epoch", "step", "batches")
        )
        self.resumed_from = loaded.path
        return loaded

    def _sampler(self) -> Any:
        return None if self.loader is None else self.loader.batch_sampler.sampler  # type: ignore[union-attr]

    def log(self, message: str) -> None:
        if self.is_main:
            print(message, flush=True)

    def close(self) -> None:
        """Wait for any checkpoint in flight and restore the signal handlers."""
        self.checkpointer.close()
        self.preemption.close()


def _checked_loader(loader: DataLoader[Any] | None) -> DataLoader[Any] | None:
    """A loader whose position can be resumed by index: batched by a BatchSampler over a sampler
    whose order depends only on the epoch. Its batches' order must not draw from the global RNG
    (iter() of a DataLoader without a generator does, for its workers' seeds): it gets a
    generator of its own, saved with each rank's RNG."""
    if loader is None:
        return None
    batch_sampler = loader.batch_sampler
    sampler = getattr(batch_sampler, "sampler", None)
    if not isinstance(batch_sampler, BatchSampler) or not isinstance(sampler, _ORDERED):
        raise ConfigError(
            f"Resumable(loader=...): its sampler is {type(sampler).__name__}, whose order cannot "
            "be resumed mid-epoch",
            hint="build the DataLoader with batch_size= and sampler=DistributedSampler(dataset) "
            "(right for one process too; shuffle=True draws its order from the global RNG)",
        )
    if loader.generator is None:
        loader.generator = torch.Generator()
    return loader
