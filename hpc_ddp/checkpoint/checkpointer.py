"""Checkpointer: every rank writes, all agree, rank 0 commits with a manifest, then ``latest``.

The commit protocol (see docs/checkpoints.md for the diagram and the failure table):

1. prepare  rank 0 removes leftovers of crashed saves and creates ``.tmp-step-N``     agree
2. write    rank 0 writes shared.pt, every rank its rank-R.pt; each fsynced           agree
3. commit   rank 0 hashes, writes manifest.json, renames to ``step-N``, fsyncs the
            root, moves ``latest``, prunes                                             agree

Each phase ends in an agreement every rank reaches even when its own part failed, so a failure
anywhere makes every rank raise instead of one raising and the rest hanging in a barrier.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_ddp.log import get_logger

from . import committed
from .asyncsave import BackgroundSave, SaveWorker, Snapshot, start_snapshot
from .comm import Agree, Agreement, choose_agree, dist_ready
from .errors import CheckpointError, CheckpointWriteError
from .fsutil import fsync_dir, raising_io, remove_tree, sha256_file, write_bytes_durably
from .fsutil import write_durably as _write_durably
from .loader import Loaded, ShardedInto, load_latest
from .manifest import (
    MANIFEST,
    SHARED_FILE,
    TRASH_PREFIX,
    build_manifest,
    check_meta,
    manifest_bytes,
    rank_file,
    step_dir_name,
    tmp_dir_name,
)
from .payload import check_plain, prepare_shared

Log = Callable[[str], None]
Phase = Callable[[str], None]


@dataclass(frozen=True)
class Staged:
    """Part of a checkpoint's shared state, copied ahead of its save (Checkpointer.stage)."""

    step: int
    snapshot: Snapshot | None  # None on ranks other than 0, which write no shared state
    specs: dict[tuple[Any, ...], Any] = field(default_factory=dict)  # a sharded state's DTensors


class Checkpointer:
    """Atomic, verified, barrier-safe checkpoints of a DDP job in ``root``.

    Call :meth:`save` and :meth:`load_latest` on every rank, with the same arguments where they
    are shared. ``agree`` (optional) is ``all_ok = agree(local_ok)`` across ranks; without it the
    initialised torch.distributed group is used, else ``barrier``. ``on_phase`` is called with
    "prepared", "writing" and "written" (every rank; the first and last when its local part
    is done, before the agreement),
    then "manifest", "renamed", "committed" (rank 0): tests use it to crash a rank at a chosen
    point. With :meth:`save_async` these phases run in the background thread.

    ``async_save=True`` creates, on every rank and at once, the Gloo group that background saves
    agree over (:meth:`save_async` would otherwise create it at its first call, which every rank
    must then make in the same order as its other collectives).

    ``sharded=True`` selects the second payload format, for a state no rank holds whole (an
    FSDP2 model's DTensors): every rank passes its own ``shared`` (e.g.
    ``get_state_dict(model, optimizer)``), and every rank writes its shards of it through
    ``torch.distributed.checkpoint`` into the checkpoint's ``dcp/`` directory, under the same
    protocol; :meth:`load_latest` then reads them into ``sharded_into=``, resharded to its
    layout (see :mod:`hpc_ddp.checkpoint.sharded`).
    """

    def __init__(
        self,
        root: Path,
        *,
        rank: int,
        world_size: int,
        keep: int = 2,
        barrier: Callable[[], None] = lambda: None,
        log: Log | None = None,
        agree: Agree | None = None,
        on_phase: Phase | None = None,
        async_save: bool = False,
        sharded: bool = False,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise CheckpointError(
                f"rank {rank} is not in a world of size {world_size}",
                hint="pass the DistEnv's rank and world_size",
            )
        if keep < 1:
            raise CheckpointError(
                f"keep={keep}: at least the newest checkpoint must be kept",
                hint="use keep=2 (the default) so a corrupt newest one can fall back",
            )
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.sharded = sharded
        # Default: the toolkit's logger (rank 0's lines, every rank's warnings: hpc_ddp.log); a
        # ``log`` callback given gets every line instead.
        logger = get_logger("checkpoint")
        self.log: Log = log if log is not None else logger.info
        self.warn: Log = log if log is not None else logger.warning
        self._barrier = barrier
        self._agree: Agreement = choose_agree(world_size, agree, barrier)
        self._custom_agree = agree
        self._on_phase = on_phase or (lambda _phase: None)
        self._bg_agree: Agreement | None = None  # background saves' agreement (own Gloo group)
        self._bg_group: dist.ProcessGroup | None = None
        self._inflight: BackgroundSave | None = None
        self._worker = SaveWorker(f"hpc-ddp-checkpoint-rank{rank}")
        with raising_io("create the run directory", self.root):
            self.root.mkdir(parents=True, exist_ok=True)
        if async_save:
            self._background_agreement()

    # ------------------------------------------------------------------ save
    def save(
        self, step: int, *, shared: dict[str, Any], per_rank: dict[str, Any], meta: dict[str, Any]
    ) -> Path:
        """Write checkpoint ``step``; return its final directory on every rank.

        ``shared`` is only read on rank 0 (its ``model`` loses DDP's ``module.`` prefix), or,
        with ``sharded=True``, on every rank (each writes its shards of it);
        ``per_rank`` is this rank's own state (RNG); ``meta`` is small JSON (epoch, model name)
        copied into the manifest. Raises on every rank if any rank failed; then nothing new is
        visible and ``latest`` still names the previous checkpoint.
        """
        return self._save(step, shared, per_rank, meta, self._agree)

    def _save(
        self,
        step: int,
        shared: dict[str, Any],
        per_rank: dict[str, Any],
        meta: dict[str, Any],
        agree: Agreement,
        group: dist.ProcessGroup | None = None,
    ) -> Path:
        if not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r}")
        tmp = self.root / tmp_dir_name(step)
        final = self.root / step_dir_name(step)
        state: dict[str, Any] = {}

        def prepare() -> None:
            check_meta(meta)
            check_plain(per_rank, "per_rank")
            if self.sharded:  # every rank's shards; DCP refuses what it cannot write
                state["shared"] = dict(shared)
            elif self.rank == 0:
                state["shared"] = prepare_shared(shared)
            if self.rank == 0:
                committed.clean_leftovers(self.root, self.log)
                with raising_io("create", tmp):
                    tmp.mkdir()
                    fsync_dir(self.root)
            self._on_phase("prepared")

        self._phase("prepare", step, prepare, agree)

        def write() -> None:
            self._on_phase("writing")
            if self.sharded:
                from . import sharded

                dcp_dir = tmp / sharded.SHARDED_DIR
                state["dcp"] = sharded.write(dcp_dir, state["shared"], self.rank, group)
            elif self.rank == 0:
                state["files"] = {SHARED_FILE: self._torch_save(tmp / SHARED_FILE, state["shared"])}
            state["own"] = self._torch_save(tmp / rank_file(self.rank), per_rank)
            with raising_io("fsync", tmp):
                fsync_dir(tmp)
            self._on_phase("written")

        try:
            self._phase("write", step, write, agree)
        except Exception:
            # This save can no longer commit: rank 0 drops the tmp dir now rather than leaving
            # it to the next save (a straggler still writing into it fails and raises too).
            if self.rank == 0:
                remove_tree(tmp, self.log)
            raise

        def commit() -> None:
            if self.sharded:  # rank 0 needs every rank's digests for the manifest
                from . import sharded

                state["files"] = sharded.gather_digests(state["dcp"], self.world_size, group)
            if self.rank == 0:
                self._commit(step, tmp, final, meta, state)

        self._phase("commit", step, commit, agree)
        return final

    # ------------------------------------------------------------ async save
    def stage(self, step: int, shared: dict[str, Any]) -> Staged:
        """Queue the copy of part of checkpoint ``step``'s ``shared`` state now, ahead of its
        :meth:`save_async` (which gets the rest): a copy queued while the GPU still runs earlier
        work costs training nothing. Whatever is staged must not change before that save."""
        if self.sharded:
            snapshot, specs = self._snapshot_sharded(shared)
            return Staged(step, snapshot, specs)
        return Staged(step, start_snapshot(dict(shared)) if self.rank == 0 else None)

    @staticmethod
    def _snapshot_sharded(shared: dict[str, Any]) -> tuple[Snapshot, dict[tuple[Any, ...], Any]]:
        """Every rank's copy of its shards: DTensors' local tensors go through the snapshot like
        plain tensors (queued in stream order), their specs are put back around the copies."""
        from . import sharded

        plain, specs = sharded.split(dict(shared))
        return start_snapshot(plain), specs

    def save_async(
        self,
        step: int,
        *,
        shared: dict[str, Any],
        per_rank: dict[str, Any],
        meta: dict[str, Any],
        staged: Staged | None = None,
    ) -> None:
        """Start checkpoint ``step`` and return once its copy is queued; the rest runs in the
        background.

        First waits for the previous background save and re-raises its error (see
        :meth:`wait`). Then queues a copy of what this rank writes (``shared`` on rank 0 only,
        its ``per_rank``, ``meta``) to CPU memory, GPU tensors in stream order, so training may
        change the live state at once, and hands the save to this checkpointer's save thread,
        which waits for the copies and runs :meth:`save`'s protocol on them, agreeing over a
        dedicated Gloo group. Call it on every rank, in the same order as :meth:`save` would be.
        Its result (or error) comes from the next :meth:`wait`, :meth:`save_async`,
        :meth:`load_latest` or :meth:`close`. ``staged``, from :meth:`stage` for the same step,
        is the rest of ``shared``.
        """
        self.wait()
        if not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r}")
        early = staged.snapshot if staged is not None else None
        if staged is not None and staged.step != step:
            raise CheckpointError(f"state staged for step {staged.step} given to step {step}")
        if early is not None and early.value.keys() & shared.keys():
            both = sorted(early.value.keys() & shared.keys())
            raise CheckpointError(f"shared keys both staged and given: {both}")
        agree = self._background_agreement()
        specs: dict[tuple[Any, ...], Any] = dict(staged.specs) if staged is not None else {}
        if self.sharded:
            shared_copy, more = self._snapshot_sharded(shared)
            specs.update(more)
        else:
            shared_copy = start_snapshot(dict(shared) if self.rank == 0 else {})
        per_rank_copy, meta_copy = start_snapshot(per_rank), start_snapshot(meta)
        group = self._bg_group

        def body() -> Path:
            # The copies finish on the GPU's own schedule; the thread waits for them, not training.
            whole = {**early.ready(), **shared_copy.ready()} if early else shared_copy.ready()
            if specs:
                from . import sharded

                whole = sharded.join(whole, specs)
            return self._save(step, whole, per_rank_copy.ready(), meta_copy.ready(), agree, group)

        self._inflight = self._worker.submit(BackgroundSave(step, body))

    @property
    def in_flight(self) -> bool:
        """True while a background save's thread is still running."""
        return self._inflight is not None and self._inflight.running

    def wait(self) -> Path | None:
        """Wait for the background save, if any; return its final directory, or raise its error.

        The protocol makes every rank's thread fail when any rank fails, so every rank raises
        here. A failed save left nothing visible: ``latest`` names the previous checkpoint.
        """
        job, self._inflight = self._inflight, None
        if job is None:
            return None
        job.join()
        if job.error is not None:
            self.warn(f"checkpoint: the background save of step {job.step} failed (reported now)")
            raise job.error
        return job.result

    def close(self, *, timeout: float | None = None) -> None:
        """Wait for the background save (at most ``timeout`` s) without raising its error: for
        a run that is already failing. The error is logged instead."""
        job = self._inflight
        if job is None:
            return
        t0 = time.monotonic()
        joined = job.join(timeout)
        self._inflight = None  # after the wait: a second call waits again if this one was cut
        if not joined:
            self.warn(
                f"checkpoint: background save of step {job.step} still running after "
                f"{time.monotonic() - t0:.0f} s; abandoning it (the previous checkpoint is intact)"
            )
        elif job.error is not None:
            self.warn(f"checkpoint: background save of step {job.step} failed: {job.error}")

    def _background_agreement(self) -> Agreement:
        """The agreement background saves use, created once (collectively, on every rank)."""
        if self._bg_agree is None:
            group = None
            if self._custom_agree is None and self.world_size > 1 and dist_ready(self.world_size):
                # Its own Gloo group: the thread's all-reduces never interleave with training's
                # collectives on the default group (NCCL or Gloo), and need no GPU stream.
                group = dist.new_group(backend="gloo")
            self._bg_group = group
            self._bg_agree = choose_agree(self.world_size, self._custom_agree, self._barrier, group)
        return self._bg_agree

    def _torch_save(self, path: Path, obj: Any) -> tuple[int, str]:
        # The directory is fsynced once after all files instead of once per file.
        return _write_durably(path, lambda w: torch.save(obj, w), fsync_parent=False)

    def _commit(
        self, step: int, tmp: Path, final: Path, meta: dict[str, Any], state: dict[str, Any]
    ) -> None:
        files: dict[str, tuple[int, str]] = dict(state["files"])
        files[rank_file(0)] = state["own"]
        for r in range(1, self.world_size):
            path = tmp / rank_file(r)
            try:  # other ranks' files: read back through the shared file system
                files[rank_file(r)] = sha256_file(path)
            except OSError as exc:
                raise CheckpointWriteError(
                    f"rank {r}'s file {path} is not visible to rank 0 ({exc.strerror})",
                    hint="the run directory must be on a file system shared by all nodes "
                    "(not node-local /tmp)",
                ) from exc
        payload = "dcp" if self.sharded else "torch"
        manifest = build_manifest(step, self.world_size, meta, files, payload)
        try:
            write_bytes_durably(tmp / MANIFEST, manifest_bytes(manifest))
            self._on_phase("manifest")
            with raising_io("rename into place", final):
                if final.exists():  # same step saved again (after a roll-back): replace it
                    os.rename(final, self.root / f"{TRASH_PREFIX}{final.name}-{os.getpid()}")
                os.rename(tmp, final)
                fsync_dir(self.root)
        except BaseException:
            remove_tree(tmp, self.log)
            raise
        self._on_phase("renamed")
        try:
            committed.write_latest(self.root, final.name)
        except BaseException:
            # Not committed: drop the directory so the next load does not have to explain it.
            remove_tree(final, self.log)
            raise
        self._on_phase("committed")
        nbytes = sum(size for size, _ in files.values())
        self.log(f"checkpoint: saved {final} ({nbytes / 2**20:.1f} MiB, {len(files)} files)")
        try:
            committed.clean_leftovers(self.root, self.log)
            committed.prune(self.root, step, self.keep, self.log)
        except OSError as exc:  # the checkpoint is committed; pruning can wait for next time
            self.warn(f"checkpoint: pruning failed ({exc}); will retry at the next save")

    def _phase(self, name: str, step: int, body: Callable[[], None], agree: Agreement) -> None:
        """Run one phase locally, then agree; raise on every rank if any rank failed."""
        error: BaseException | None = None
        try:
            body()
        except Exception as exc:  # reported after the agreement, so peers are not left waiting
            error = exc
        try:
            all_ok, who = agree(error is None)
        except Exception as exc:
            raise CheckpointWriteError(
                f"rank {self.rank} lost contact with the other ranks while saving step {step} "
                f"({name} phase): {exc}",
                hint="another rank probably died or timed out; see its log. The previous "
                "checkpoint is intact.",
            ) from (error or exc)
        if error is not None:
            raise error
        if not all_ok:
            raise CheckpointWriteError(
                f"checkpoint step {step} was not saved: {who} failed in the {name} phase",
                hint="the failing rank's log has the cause. The previous checkpoint is intact.",
            )

    # ------------------------------------------------------------------ load
    def load_latest(
        self,
        *,
        map_location: Any = "cpu",
        expect: dict[str, Any] | None = None,
        sharded_into: ShardedInto = None,
    ) -> Loaded | None:
        """The newest checkpoint that verifies, loaded for this rank; None if there is none.

        See :func:`hpc_ddp.checkpoint.loader.load_latest` for the fallback rules. Waits
        for a background save first (and raises its error). A sharded checkpoint's state is
        read into ``sharded_into`` in place (every rank passes its own, e.g. the state dicts
        of its FSDP2 model and optimizer, or a function that returns them, called only when
        a sharded checkpoint is there to read), resharded from whatever world wrote it.
        """
        self.wait()
        return load_latest(
            self.root,
            rank=self.rank,
            world_size=self.world_size,
            map_location=map_location,
            expect=expect,
            agree=self._agree,
            log=self.log,
            sharded_into=sharded_into,
        )
