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
newest checkpoint that verifies, also one written by another number of ranks: the epoch then
continues from its global sample position, its rest dealt over the ranks there are now
(``shard_plan.remainder_indices``), and every rank's RNG streams are derived afresh from
``seed``, the step and the rank (``rng.derived_seed``). Checkpoints are the project's
(``Checkpointer``: every rank's part written, then committed atomically, the newest ``keep``
kept). A DDP model on Gloo gets the exact per-tensor gradient average (``per_tensor_allreduce``):
the bucket sums' order would otherwise differ between a run and its resume. A model sharded with
FSDP2 (``fully_shard``) and its optimizer are saved through ``torch.distributed.checkpoint``
instead, every rank writing its shards (:mod:`hpc_ddp.runtime.sharded_state`); ``async_save=True``
writes each checkpoint in the background (``Checkpointer.save_async``).

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

from hpc_ddp.checkpoint import Checkpointer, CheckpointError, Loaded, Staged
from hpc_ddp.checkpoint.committed import read_latest
from hpc_ddp.dtensors import dtensor_type
from hpc_ddp.errors import ConfigError
from hpc_ddp.exit_codes import EXIT_REQUEUE
from hpc_ddp.run_dir.paths import RunPaths
from hpc_ddp.runtime import rng
from hpc_ddp.runtime.exact_allreduce import per_tensor_allreduce
from hpc_ddp.runtime.preemption import Preemption, requeue
from hpc_ddp.runtime.sampler import ResumableDistributedSampler
from hpc_ddp.runtime.shard_plan import epoch_permutation, remainder_indices

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


class _Rest(torch.utils.data.Sampler[int]):
    """This rank's share of an epoch's rest after ``start`` global samples consumed by another
    number of ranks: the sampler's own global order from ``start`` on, dealt over its ranks."""

    def __init__(self, sampler: DistributedSampler[Any] | ResumableDistributedSampler, start: int):
        self.sampler = sampler
        if isinstance(sampler, ResumableDistributedSampler):
            plan = sampler.plan
            self.indices = plan.indices(sampler.epoch, sampler.rank, start).tolist()
            return
        n = len(sampler.dataset)  # type: ignore[arg-type]
        order = (
            epoch_permutation(n, sampler.seed, sampler.epoch)
            if sampler.shuffle
            else torch.arange(n)
        )
        share = remainder_indices(
            order, start, sampler.rank, sampler.num_replicas, drop_last=sampler.drop_last
        )
        self.indices = share.tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class Resumable:
    """See the module docstring. Construct it on every rank after the process group is up
    (or without one: a single process), with the same arguments.

    ``run_dir``: checkpoints go to ``run_dir/checkpoints``. ``loader``: the training DataLoader
    (optional: without it, only objects and counters are saved). ``checkpoint_every``: also
    save every N optimizer steps (0: at epoch ends and on preemption only). ``check_every``:
    ask the ranks whether one was signalled every N steps (one small all-reduce each time).
    ``objects``: name -> object to save; a DDP model is saved as its module; an FSDP2 model
    (and its optimizer) as shards, through DCP. ``async_save``: checkpoints are written by a
    background thread once their copy is queued; a preemption's and the last epoch's are waited
    for before the loop goes on. ``seed``: what every rank's RNG streams are derived from when a
    checkpoint of another world size is resumed (give each run its own).

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
        seed: int = 0,
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
        self.batches_done = 0  # batches of the current epoch consumed since ``origin``
        # Global samples of the epoch consumed before this process's first batch of it: 0, or
        # where the checkpoint resumed from stopped (on this world or another).
        self.origin = 0
        self._rank_left = 0  # this rank's samples of the epoch from ``origin`` on
        self.seed = seed
        self.sharded = _sharded_state(self.objects)
        self.resumed_from: Path | None = None
        self._staged_names: tuple[str, ...] = ()
        self.checkpointer = Checkpointer(
            self.paths.checkpoints,
            rank=self.rank,
            world_size=self.world_size,
            keep=keep,
            log=None if log is not None else self.log,
            async_save=async_save,  # its Gloo group: created now, on every rank
            sharded=self.sharded is not None,
        )
        self.preemption = preemption if preemption is not None else Preemption(signals)
        try:
            loaded = self._restore() if restore else None
        except BaseException:
            # A caller that catches the error must not be left with handlers that only set a
            # flag nobody reads: SIGTERM would no longer end the process.
            self.checkpointer.close()
            if preemption is None:
                self.preemption.close()
            raise
        if loaded is not None:
            self.log(f"resumed from {self.resumed_from}: epoch {self.epoch + 1}, step {self.steps}")
            if loaded.world_size != self.world_size:
                self.log(
                    f"resumed from {loaded.world_size} to {self.world_size} ranks at sample "
                    f"{self.origin} of epoch {self.epoch + 1}; RNG streams derived from seed "
                    f"{self.seed}, step {self.steps} and each rank"
                )

    # ----------------------------------------------------------------- the loop
    def epochs(self, total: int) -> Iterator[int]:
        """The epochs still to run, 0-based: from the checkpoint's on. Each sets the sampler's
        epoch; the end of each is checkpointed."""
        while self.epoch < total:
            sampler = self._sampler()
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            yield self.epoch
            self.epoch, self.batches_done, self.origin = self.epoch + 1, 0, 0
            self.save()
        self.checkpointer.wait()  # the last one committed (or its error raised) before the end

    def batches(self) -> Iterator[Any]:
        """The loader's batches of this epoch, from the first one not yet consumed."""
        if self.loader is None:
            raise ConfigError("Resumable.batches() needs loader=", hint="pass the DataLoader")
        batch_sampler = self.loader.batch_sampler
        assert isinstance(batch_sampler, BatchSampler)  # _checked_loader made sure
        original = batch_sampler.sampler
        batch_sampler.sampler = self._rest_of_epoch(original)
        self._rank_left = len(batch_sampler.sampler)
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

    # ----------------------------------------------------------------- position
    @property
    def samples(self) -> int:
        """Samples of the current epoch consumed, counted over all ranks (each rank's share of a
        DistributedSampler; one rank's for a sampler every rank reads whole)."""
        served = min(self.batches_done * _batch_size(self.loader), self._rank_left)
        return self.origin + served * _shards(self._sampler())

    def _rest_of_epoch(self, sampler: Any) -> Any:
        """The sampler of what is left of this epoch after ``origin`` global samples. Skipping
        ``origin / shards`` indices of a sharded sampler serves exactly the epoch's rest when the
        samples are a multiple of its shards (always on the world that consumed them: that path
        is the uninterrupted run's, bit for bit); otherwise its order is dealt afresh (_Rest)."""
        shards = _shards(sampler)
        if self.origin % shards == 0:
            return _Skip(sampler, self.origin // shards) if self.origin else sampler
        if type(sampler) not in (DistributedSampler, ResumableDistributedSampler):
            raise ConfigError(
                f"cannot resume epoch {self.epoch + 1} at sample {self.origin} on "
                f"{shards} ranks with a {type(sampler).__name__}: its order is its own",
                hint="use torch's DistributedSampler itself, or resume on a number of ranks "
                f"that divides {self.origin}",
            )
        return _Rest(sampler, self.origin)

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
        rest = [name for name in self.objects if name not in done]
        shared = (
            self.sharded.state_dict(rest)  # every rank's shards
            if self.sharded is not None
            else {name: self.objects[name].state_dict() for name in rest if self.is_main}
        )
        meta = {
            "epoch": self.epoch,
            "step": self.steps,
            "samples": self.samples,
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
        if self.sharded is not None:  # every rank stages its shards
            state = self.sharded.state_dict(self._staged_names)
        elif self.is_main:
            state = {n: self.objects[n].state_dict() for n in self._staged_names}
        else:
            state = {}
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
        (raise) before anything is restored."""
        return self._restore(check)

    def _restore(self, check: Callable[[Loaded], None] | None = None) -> Loaded | None:
        # The state to read a sharded checkpoint into, made only when there is one: making it
        # gives an optimizer without state its state (DCP steps it once at learning rate 0),
        # which a run from scratch must not start with (Adam's step count, SGD's momentum).
        into: dict[str, Any] = {}

        def target() -> dict[str, Any]:
            if not into and self.sharded is not None:
                into.update(self.sharded.state_dict())
            return into

        loaded = self.checkpointer.load_latest(
            sharded_into=target if self.sharded is not None else None
        )
        if loaded is None:
            return None
        if check is not None:
            check(loaded)
        if self.sharded is not None:
            self.sharded.load_state_dict(_sharded_payload(loaded, into))
        else:
            for name, obj in self.objects.items():
                obj.load_state_dict(loaded.shared[name])
        self.epoch, self.steps = _count(loaded, "epoch"), _count(loaded, "step")
        self.origin = _position(loaded, self.loader)
        generator = self.loader.generator if self.loader is not None else None
        if loaded.world_size == self.world_size:
            rng.restore(loaded.per_rank["rng"])
            if generator is not None and "loader_generator" in loaded.per_rank:
                generator.set_state(loaded.per_rank["loader_generator"])
        else:
            rng.reseed(self.seed, self.steps, self.rank)
            if generator is not None:
                generator.manual_seed(rng.derived_seed(self.seed, self.steps, self.rank, "loader"))
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


def _sharded_state(objects: dict[str, Stateful]) -> Any:
    """A ShardedState when any object is an FSDP2 model or its optimizer, else None."""
    # A DDP run is spared importing torch.distributed.checkpoint (about a second of its start).
    dtensor = dtensor_type()
    if dtensor is None:
        return None
    params = [
        p
        for o in objects.values()
        for p in (
            o.parameters()
            if isinstance(o, torch.nn.Module)
            else [q for g in o.param_groups for q in g["params"]]
            if isinstance(o, torch.optim.Optimizer)
            else []
        )
    ]
    if not any(isinstance(p, dtensor) for p in params):
        return None
    from hpc_ddp.runtime.sharded_state import ShardedState

    return ShardedState(objects)


def _sharded_payload(loaded: Any, into: Any) -> Any:
    if loaded.sharded is None:
        raise ConfigError(
            f"{loaded.path} holds a whole (unsharded) state, and this run's model is sharded "
            "(fully_shard)",
            hint="resume it with the model it was saved with (DDP), or start a new run directory",
        )
    return into


def _batch_size(loader: DataLoader[Any] | None) -> int:
    return 0 if loader is None else int(loader.batch_sampler.batch_size or 0)  # type: ignore[union-attr]


def _shards(sampler: Any) -> int:
    """Over how many ranks ``sampler`` deals an epoch (1: every rank reads all of it)."""
    while isinstance(sampler, (_Skip, _Rest)):  # batches() serves the epoch's rest through them
        sampler = sampler.sampler
    if isinstance(sampler, DistributedSampler):
        return int(sampler.num_replicas)
    if isinstance(sampler, ResumableDistributedSampler):
        return sampler.plan.world_size
    return 1


def _count(loaded: Loaded, key: str) -> int:
    """``loaded.meta[key]``, a count this class wrote: an integer >= 0, or a clear error."""
    value = loaded.meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(
            f"checkpoint {loaded.path}: meta[{key!r}] is {value!r}, not an integer >= 0",
            hint="it was not written by hpc_ddp.Resumable, or was edited: give the run a "
            "directory of its own, or move that checkpoint aside",
        )
    return value


def _position(loaded: Loaded, loader: DataLoader[Any] | None) -> int:
    """The checkpoint's global sample position in its epoch. Checkpoints written before it was
    saved hold this rank's batches instead, of a world of the checkpoint's size."""
    if "samples" in loaded.meta or "batches" not in loaded.meta:
        return _count(loaded, "samples")
    sampler = None if loader is None else loader.batch_sampler.sampler  # type: ignore[union-attr]
    shards = loaded.world_size if _shards(sampler) > 1 else 1
    return _count(loaded, "batches") * _batch_size(loader) * shards


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
