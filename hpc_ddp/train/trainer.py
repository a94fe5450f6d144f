"""The resumable DDP trainer: ``train(config) -> Result`` and ``run_process(config) -> exit code``.

Every rank runs the same code; rank 0 alone writes files, and the log keeps rank 0's lines
(hpc_ddp.log). Decisions that must be unanimous (run dir usable, data staged, preempted) go
through one collective each, so a rank that fails alone is reported by name instead of leaving
the others in a collective; a NaN or infinite loss is read from values every rank shares
(divergence.py), so every rank stops at the same step. The trainer's parts: state.py builds
what it trains with, resume.py is its checkpoint glue, report.py its progress file and Result,
fast/ its speed machinery; this module is the epoch loop, read top to bottom: its sync points,
which epoch ends save, the loop itself (Trainer) and the run's lifetime (train).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

import torch

from hpc_ddp import Comm, Preemption, detect_env, evaluate, use_deterministic_kernels
from hpc_ddp.errors import HpcDdpError
from hpc_ddp.exit_codes import EXIT_REQUEUE
from hpc_ddp.log import before_each_line, get_logger, set_rank
from hpc_ddp.polling import poll_until
from hpc_ddp.run_dir import RunDirLock, RunPaths
from hpc_ddp.train import results
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.divergence import TrainingDiverged, first_nonfinite, state_is_finite
from hpc_ddp.train.fast.choice import LatencyAdvice, StartUp
from hpc_ddp.train.finished import finished_answer
from hpc_ddp.train.loop import Times, grouped
from hpc_ddp.train.metric_records import Record, step_record
from hpc_ddp.train.metric_writers import MetricWriters, open_writers
from hpc_ddp.train.plotter import Plotter
from hpc_ddp.train.plugins import exited_in_training
from hpc_ddp.train.progress import LiveBar, Progress, wants_live_bar
from hpc_ddp.train.report import ProgressFile, make_result
from hpc_ddp.train.resume import Clock, restore, save, stage
from hpc_ddp.train.run_dir_rules import open_run_dir
from hpc_ddp.train.state import TrainState, build_state, load_splits, preflight

if TYPE_CHECKING:
    from hpc_ddp import DistContext
    from hpc_ddp.checkpoint import Staged

HOLD_TIMEOUT_S = 120.0
log = get_logger("train")


# ------------------------------------------------------------------ sync points
# Where training synchronises the host with the devices and the ranks with each other.
#
# A step's loss stays on the device; nothing in a step waits for the GPU. The ranks meet at *sync
# points*, and only there: one all-reduce carries the per-step loss sums and sample counts of every
# step since the last sync point (in step order), the preemption vote and each rank's recent pace,
# and one host read takes the result. Reading the loss every step would cost a host sync per step:
# the CPU could not queue step s+1 while the GPU finished step s, a sizeable share of a step,
# eager or captured (benchmarks/NOTES.md).
#
# Sync points are a function of the step count and of values every rank holds identically (the
# config, the result of the previous all-reduce), so all ranks enter the same collectives:
# - the epoch's last step, log points (``log_every``), in-epoch checkpoint steps, the test hook
#   ``debug_hold_at_step``: where a value must be known (the log line, a checkpoint's progress);
# - agreement points (``AgreeSchedule``) for the preemption flag: every ``k`` steps with ``k`` set
#   from the measured pace so that ``k`` steps take about ``AGREE_TARGET_S`` seconds, at most
#   ``AGREE_MAX_STEPS``. A signal thus leads to a checkpoint after at most ``k`` more steps
#   (docs/training.md has the bound). One process needs no agreement: it reads its own flag after
#   every step and syncs only when it is set.
#
# Results do not depend on where sync points fall: the losses are folded into the epoch's sums in
# step order, in float64, exactly as when each step was reduced on its own (bit-identical for one or
# two ranks; with three or more, a ring all-reduce may add a step's rank values in another order
# than for a 3-element message, a last-bit difference in the logged loss only).

AGREE_TARGET_S = 0.25  # seconds of training between two preemption agreements, about
AGREE_MAX_STEPS = 64  # and never more steps than this


@dataclass
class AgreeSchedule:
    """At which global steps the ranks agree on the preemption flag (several ranks only)."""

    world_size: int
    target_s: float = AGREE_TARGET_S
    max_steps: int = AGREE_MAX_STEPS
    next_step: int = 0  # the first step after (re)start agrees
    pace: float = -1.0  # this rank's seconds per step over the last full interval; -1 unknown
    agreed_pace: float = -1.0  # the ranks' mean pace from the last sync point: the same on all
    _mark: float | None = field(default=None, repr=False)
    _mark_step: int = 0

    def due(self, step: int, requested: bool) -> bool:
        """Whether ``step`` must be a sync point for the flag (``requested``: this rank's own)."""
        if self.world_size == 1:
            return requested  # no one to agree with: act at this step boundary
        return step >= self.next_step

    def interval(self, pace: float) -> int:
        """Steps until the next agreement at ``pace`` seconds per step (all ranks' mean)."""
        if pace <= 0:
            return 1
        return max(1, min(self.max_steps, int(self.target_s / pace)))

    def start_epoch(self, step: int) -> None:
        """Measure the pace from here: evaluation and checkpoints are not training steps."""
        self._mark, self._mark_step = time.perf_counter(), step

    def synced(self, step: int, pace: float) -> None:
        """After a sync point at ``step``: plan the next agreement, measure the pace from here."""
        now = time.perf_counter()
        if self._mark is not None and step > self._mark_step:
            self.pace = (now - self._mark) / (step - self._mark_step)
        self._mark, self._mark_step = now, step
        self.agreed_pace = pace
        self.next_step = step + self.interval(pace)


@dataclass
class PendingSteps:
    """The steps since the last sync point: device loss sums and sample counts, in step order."""

    losses: list[torch.Tensor] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def add(self, loss_sum: torch.Tensor, n: int) -> None:
        self.losses.append(loss_sum)
        self.counts.append(n)

    def reduce(
        self, comm: Comm, preempt: float, pace: float
    ) -> tuple[list[float], list[float], float, float]:
        """One all-reduce SUM and one host read; empties the list.

        Returns (global loss sum per step, global samples per step, preemption votes, the
        ranks' mean pace).
        """
        k = len(self.losses)
        host = torch.tensor([*map(float, self.counts), preempt, pace], dtype=torch.float64)
        losses = torch.stack(self.losses).to(device=comm.device, dtype=torch.float64)
        values = comm.sum_tensor(torch.cat([losses, host.to(comm.device)]))  # the one host sync
        self.losses.clear()
        self.counts.clear()
        return values[:k], values[k : 2 * k], values[2 * k], values[2 * k + 1] / comm.world_size


# ------------------------------------------------------------------ epoch-end saves
# Which epoch ends write a checkpoint.
#
# Every one when epochs are long; when they are short, one once ``checkpoint_interval_s`` seconds
# of training have passed since the newest checkpoint, so that a save's cost on the training path
# and beside it, which a sub-second epoch cannot absorb (benchmarks/NOTES.md), stays under 1 % of
# training. The last epoch's end always saves, and so do preemptions and ``checkpoint_every_steps``.
#
# Every rank must enter a save's collectives or none: the decision uses only values all ranks
# hold identically, the global step and the ranks' mean pace agreed at the last sync point
# (AgreeSchedule.agreed_pace), never a rank's own clock.


@dataclass
class EpochEndSaves:
    """The epoch-end saving policy of one run (one attempt: ``since_step`` is where it began)."""

    interval_s: float  # TrainConfig.checkpoint_interval_s; 0 saves every epoch end
    since_step: int = 0  # global step of the newest checkpoint, or of this attempt's start
    told: bool = False  # the one log line about thinned saves was written
    trained_s: float = 0.0  # training since the newest checkpoint, at the last decision

    def due(self, step: int, pace: float, *, final: bool) -> bool:
        """Whether the epoch ending at global ``step`` saves, at ``pace`` agreed seconds/step
        (<= 0: not measured yet, so it saves)."""
        self.trained_s = (step - self.since_step) * pace
        if final or self.interval_s <= 0 or pace <= 0:
            return True
        return self.trained_s >= self.interval_s

    def saved(self, step: int) -> None:
        """A checkpoint of ``step`` was written (at an epoch end or elsewhere)."""
        self.since_step = step

    def first_skip(self) -> bool:
        """True once: at the first epoch end that does not save (the run says why)."""
        told, self.told = self.told, True
        return not told


@dataclass
class CtrlC:
    """SIGINT (Ctrl-C) during training: remembers that it came, then raises KeyboardInterrupt.

    A launcher may leave SIGINT at its default action (``--nproc-per-node``'s workers do, so
    that a forwarded Ctrl-C stops them), which ends the process with no chance to say so; this
    turns it into an exception the trainer records (progress.json: ``interrupted``). A rank in
    a collective sees it when the collective returns or fails because a peer left: ``received``
    then tells that error from a crash. Not installed where SIGINT is a requeue signal.
    """

    received: bool = False
    _previous: object = None

    @classmethod
    def install(cls, preemption: Preemption) -> CtrlC:
        ctrl_c = cls()
        if signal.SIGINT not in preemption.signals:
            ctrl_c._previous = signal.signal(signal.SIGINT, ctrl_c._handle)
        return ctrl_c

    def _handle(self, _signum: int, _frame: FrameType | None) -> None:
        if self.received:  # the same Ctrl-C again (a launcher forwards the terminal's): the
            return  # first is already unwinding; raising again could cut its recording short
        self.received = True
        raise KeyboardInterrupt

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)  # type: ignore[arg-type]
            self._previous = None


class Trainer:
    """One rank's training run over a built ``TrainState``: the epoch loop, its sync points,
    evaluation, checkpoints and the outcome."""

    def __init__(
        self, cfg: TrainConfig, ctx: DistContext, comm: Comm, state: TrainState, clock: Clock
    ) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.comm = comm
        self.state = state
        self.clock = clock
        self.rank, self.world_size = ctx.env.rank, ctx.env.world_size
        self.paths = RunPaths(cfg.run_dir)
        self.progress_file = ProgressFile(self.paths, self.rank, self.world_size)
        self.plotter: Plotter | None = None  # rank 0's plot.png helper, once training starts
        self.progress: Progress | None = None  # once training starts: what a stop records
        self.bar: LiveBar | None = None  # rank 0 on a terminal, while training
        self._unhook_bar: Callable[[], None] = lambda: None  # the bar's hook into the log
        self.metrics = MetricWriters([])  # rank 0's, once training starts (metric_writers.py)
        self.epoch_end_saves = EpochEndSaves(cfg.checkpoint_interval_s)  # from the restored step
        self.latency = LatencyAdvice(enabled=ctx.device.type == "cuda" and self.rank == 0)
        # A run continued past its old end (run_dir_rules) drops the old end's result.json with its
        # first new checkpoint: until then it still describes the newest checkpoint.
        self.drop_old_result = self.rank == 0

    def record_stop(self, error: BaseException, *, ctrl_c: bool) -> None:
        """progress.json says how training stopped (nothing to say before it started)."""
        if self.bar is not None:
            self.bar.clear()  # the error starts a line of its own
        if self.progress is not None:
            self.progress_file.record_stop(self.progress, error, ctrl_c=ctrl_c)

    def close(self) -> None:
        """The live bar and the metrics files, however the run ended."""
        if self.bar is not None:
            self.bar.clear()
            self._unhook_bar()
            self.bar = None
        self.metrics.close()
        if self.plotter is not None and self.plotter.history is None:
            self.plotter.cancel()  # the run did not finish: no plot

    def open_metrics(self, progress: Progress) -> MetricWriters:
        """Rank 0 opens the metrics files, continued at the restored step; every rank learns
        whether that worked, instead of waiting for rank 0 in the first collective."""
        error: BaseException | None = None
        writers = MetricWriters([])
        if self.rank == 0:
            try:
                writers = open_writers(self.cfg.metrics, self.paths, progress)
            except Exception as err:
                error = err
        self.comm.check(error, "opening the metrics files")
        return writers

    def save(self, progress: Progress, times: Times, staged: Staged | None = None) -> None:
        # Never a non-finite state committed (it would rotate a finite one out): checked on
        # every rank, decided together.
        bad = not state_is_finite(self.state.net, self.state.stepper.optimizer)
        if self.comm.sum([float(bad)])[0]:
            what = "the weights or the optimizer state became NaN or infinite"
            self.diverged(what, progress.global_step, progress)
        self.metrics.flush()  # what was logged so far is on disk before the checkpoint is
        if self.drop_old_result:
            self.paths.result.unlink(missing_ok=True)
            self.drop_old_result = False
        save(self.state, self.cfg, progress, times, self.clock, staged)
        self.epoch_end_saves.saved(progress.global_step)

    def stage_epoch_end(self, progress: Progress, times: Times) -> Staged | None:
        """Background saves: queue the copy of the model and optimizer for the epoch-end
        checkpoint right after the epoch's sync point (evaluation, in between, changes neither);
        the save then adds the progress. Not before that sync: whatever in the queueing waits
        for the GPU would take the epoch's last steps out of its compute time, and the epoch's
        samples/s would then count them only in the epochs that end with a save."""
        if not self.cfg.async_checkpoint:
            return None
        t0 = time.perf_counter()
        staged = stage(self.state, progress)
        times.checkpoint += time.perf_counter() - t0
        return staged

    def hold_for_signal(self, progress: Progress, flag: Preemption) -> None:
        """Test hook (``debug_hold_at_step``): wait, bounded, until a requeue signal arrives."""
        self.progress_file.write(progress, "holding")
        # Polling our own flag, set by the signal handler.
        if not poll_until(lambda: flag.requested, HOLD_TIMEOUT_S, interval_s=0.01):
            raise HpcDdpError(f"debug_hold_at_step: no signal within {HOLD_TIMEOUT_S:.0f} s")

    def diverged(self, what: str, step: int, progress: Progress) -> NoReturn:
        """Stop every rank: each calls this at the same point, on values all ranks share. A
        background save in flight holds a state checked finite: it commits first, and the
        error names the newest checkpoint."""
        newest = self.state.run.newest
        epoch = progress.epoch + 1 if progress.start else progress.epoch  # of the last step
        raise TrainingDiverged(
            what,
            step=step,
            epoch=epoch,
            stopped=progress.global_step,
            checkpoint=str(newest) if newest else None,
            cfg=self.cfg,
        )

    def run(self, flag: Preemption) -> results.Result:
        if self.rank == 0 and self.cfg.plot:
            # The plot's helper imports matplotlib from now on, beside the training: started
            # any later, it would still be importing when a short run ends, and rank 0 would
            # wait for it (benchmarks/NOTES.md). On a core of its own at the lowest priority;
            # ended at once if the run stops without finishing.
            self.plotter = Plotter(self.paths.root)
        self.progress_file.pids = self.comm.gather_objects(os.getpid())
        self.progress = progress = restore(self.state, self.cfg, self.world_size, self.clock)
        saves = self.epoch_end_saves
        saves.saved(progress.global_step)  # the checkpoint resumed from, or the start
        self.metrics = self.open_metrics(progress)
        cfg, state = self.cfg, self.state
        plan = state.plan
        steps_per_epoch = plan.steps_per_epoch()
        log.info(
            f"training {cfg.model} on {cfg.dataset}{' (synthetic)' if cfg.synthetic else ''}: "
            f"{plan.n} samples, {self.world_size} process(es), {steps_per_epoch} steps/epoch, "
            f"global batch {plan.rank_step_samples * self.world_size}, "
            f"device {self.ctx.device}, backend {self.ctx.backend}"
        )
        if self.rank == 0 and wants_live_bar(sys.stdout, os.environ):
            global_batch = plan.rank_step_samples * self.world_size
            self.bar = LiveBar(sys.stdout, cfg.epochs, global_batch)
            self._unhook_bar = before_each_line(self.bar.clear)
        state.model.train()
        agree = AgreeSchedule(self.world_size)
        pending = PendingSteps()
        self.clock.start_loop()
        while progress.epoch < cfg.epochs:
            times = Times.from_dict(progress.epoch_times)
            origin = progress.start  # where this epoch resumed; any count after a world change
            done = plan.steps_done(origin)
            agree.start_epoch(progress.global_step)
            batches = state.train_data.batches(progress.epoch, progress.start)
            staged: Staged | None = None
            epoch_save = True  # decided at the epoch's last step
            for micro in grouped(batches, cfg.accum_steps, times):
                t0 = time.perf_counter()
                loss_sum, n = state.stepper.step(micro, times)  # the loss stays on the device
                done += 1
                progress.global_step += 1
                progress.start = plan.step_start(done, origin)
                last = done == steps_per_epoch
                hold = progress.global_step == cfg.debug_hold_at_step and not last
                if hold:
                    self.hold_for_signal(progress, flag)
                pending.add(loss_sum, n)
                progress.train_seconds += time.perf_counter() - t0
                self.progress_file.write(progress, "training")
                if self.bar is not None:
                    self.bar.update(progress.epoch + 1, done, steps_per_epoch)
                logging = done % cfg.log_every == 0 or last
                every = cfg.checkpoint_every_steps
                saving = bool(every) and not last and progress.global_step % every == 0
                # Sync points (above): the same steps on every rank. The epoch's last
                # step skips the flag: its checkpoint comes after evaluation.
                due = agree.due(progress.global_step, flag.requested)
                if last:
                    final = progress.epoch + 1 == cfg.epochs
                    epoch_save = saves.due(progress.global_step, agree.agreed_pace, final=final)
                if last or logging or saving or hold or due:
                    vote = 0.0 if last else float(flag.requested)
                    preempt, loss = self.sync_steps(progress, pending, times, agree, vote)
                    if self.bar is not None:
                        self.bar.loss = loss
                    if logging:
                        self.log_step(progress, steps_per_epoch, done, loss)
                    if preempt:
                        return self.preempted(progress, times, flag)
                    if saving:
                        self.save(progress, times)
                if last and epoch_save:
                    staged = self.stage_epoch_end(progress, times)
            self.end_epoch(progress, times, staged, epoch_save)
            if progress.epoch < cfg.epochs and self.comm.sum([float(flag.requested)])[0]:
                return self.preempted(progress, times, flag, saved=epoch_save)
        # An async save still in flight: committed (or raised) before result.json.
        self.state.run.wait()
        return self.finish(progress)

    def sync_steps(
        self,
        progress: Progress,
        pending: PendingSteps,
        times: Times,
        agree: AgreeSchedule,
        vote: float,
    ) -> tuple[bool, float]:
        """A sync point: fold the pending steps into ``progress`` (per step, in step order, as a
        collective per step did), agree on preemption; returns (preempt, this step's loss)."""
        t0 = time.perf_counter()
        losses, counts, votes, pace = pending.reduce(self.comm, vote, agree.pace)
        bad = first_nonfinite(losses)  # the sums of all ranks: the same answer on every rank
        if bad is not None:
            step = progress.global_step - len(losses) + 1 + bad
            value = losses[bad] / counts[bad]
            self.diverged(f"the training loss became {value}", step, progress)
        for loss_all, n_all in zip(losses, counts, strict=True):
            progress.epoch_loss_sum += loss_all
            progress.epoch_loss_count += n_all
            progress.samples_total += int(n_all)
        agree.synced(progress.global_step, pace)
        spent = time.perf_counter() - t0  # mostly waiting for the GPU: the steps' compute
        times.compute += spent
        progress.train_seconds += spent
        return votes > 0, losses[-1] / counts[-1]

    def log_step(self, progress: Progress, steps: int, done: int, loss: float) -> None:
        lr = float(self.state.stepper.optimizer.param_groups[0]["lr"])  # a tensor with cuda_graphs
        rate = progress.samples_total / max(progress.train_seconds, 1e-9)
        log.info(
            f"epoch {progress.epoch + 1}/{self.cfg.epochs} step {done}/{steps} "
            f"loss {loss:.4f} lr {lr:.4g} {rate:.0f} samples/s"
        )
        record = step_record(progress, loss, lr, rate)
        progress.last_log = dict(record.row)  # checkpointed: a resume here writes it again
        self.metrics.write(record)

    def end_epoch(
        self, progress: Progress, times: Times, staged: Staged | None = None, save: bool = True
    ) -> None:
        t0 = time.perf_counter()
        batches = self.state.eval_data.batches(self.cfg.eval_batch_size)
        # The plain module: ranks may run different numbers of eval batches, and DDP's forward
        # must not be entered unevenly. Rank 0's BatchNorm buffers are what DDP trains with.
        self.comm.broadcast_buffers(self.state.net)
        with self.latency.evaluating(self.state.net):
            metrics = evaluate(
                self.state.net,
                batches,
                self.comm,
                self.state.amp,
                sums_of=self.state.stepper.eval_sums,
            )
        times.eval += time.perf_counter() - t0
        test_loss = float(metrics["test_loss"])  # all-reduced: the same on every rank
        if not math.isfinite(test_loss):
            what = f"the test loss became {test_loss} (evaluated after the epoch's last step)"
            self.diverged(what, progress.global_step, progress)
        epoch_seconds = times.data + times.compute + times.checkpoint
        row = {
            "epoch": progress.epoch + 1,
            "step": progress.global_step,
            "train_loss": progress.epoch_loss_sum / max(progress.epoch_loss_count, 1),
            **metrics,
            "lr": float(self.state.stepper.optimizer.param_groups[0]["lr"]),
            "samples_per_second": progress.epoch_loss_count / max(times.data + times.compute, 1e-9),
            "seconds": epoch_seconds + times.eval,
            "time": times.to_dict(),
            "allreduce_calls": self.state.stepper.comm_timer.bucket_calls,
        }
        timed = self.state.stepper.comm_timer.bucket_calls > 0
        comm = f" (all-reduce {times.comm:.2f}s)" if timed else ""
        log.info(
            f"epoch {row['epoch']}: train loss {row['train_loss']:.4f}, test loss "
            f"{row['test_loss']:.4f}, accuracy {100 * row['test_accuracy']:.2f}% of "
            f"{row['test_samples']} test samples, {row['samples_per_second']:.0f} samples/s; "
            f"time data {times.data:.2f}s compute {times.compute:.2f}s{comm} "
            f"checkpoint {times.checkpoint:.2f}s eval {times.eval:.2f}s"
        )
        plan = self.state.plan
        advice = self.latency.epoch_ended(
            times.compute, plan.steps_per_epoch(), plan.rank_step_samples
        )
        if advice:
            log.info(advice)
        starvation = getattr(self.state.train_data, "starvation", None)  # data_wait.py
        if starvation is not None and (line := starvation(progress.epoch + 1)):
            log.info(line)
        progress.history.append(row)
        progress.epoch += 1
        progress.start = 0
        progress.epoch_loss_sum = progress.epoch_loss_count = 0.0
        saving = Times()
        if save:
            self.save(progress, saving, staged)
        elif self.epoch_end_saves.first_skip():
            saves = self.epoch_end_saves
            log.info(
                f"checkpoint: none at the end of epoch {progress.epoch}: {saves.trained_s:.2f} s "
                f"of training since the newest (step {saves.since_step}), under "
                f"checkpoint_interval_s={saves.interval_s:g}; epoch ends save once that much has "
                "passed, the last epoch and preemptions always (said once)"
            )
        # The epoch-end save belongs to this epoch's breakdown (the checkpoint has it from the
        # next save on). Written after the save: a resume from it writes the row again.
        row["time"]["checkpoint"] = round(row["time"]["checkpoint"] + saving.checkpoint, 6)
        self.metrics.write(Record("epoch", row))

    def preempted(
        self, progress: Progress, times: Times, flag: Preemption, *, saved: bool = False
    ) -> results.Result:
        if not saved:
            self.save(progress, times)
        self.state.run.wait()  # async: committed on every rank before requeueing and exiting 75
        what = ", ".join(sorted(set(flag.received))) or "another rank's signal"
        message = self.state.run.requeue()
        log.info(f"preempted ({what}): checkpointed at step {progress.global_step}; {message}")
        self.progress_file.write(progress, "preempted")
        return self.result(progress, "preempted", EXIT_REQUEUE)

    def finish(self, progress: Progress) -> results.Result:
        result = self.result(progress, "finished", 0)
        if self.rank == 0:
            results.write_json(self.paths.result, result.to_dict())
            if progress.history and self.plotter is not None:  # started with training
                # Drawn by the helper while the graphs and the process group are torn down;
                # train() waits for it before returning.
                self.plotter.draw(progress.history)
            self.progress_file.write(progress, "finished")
            log.info(f"finished: {self.paths.result}")
            log.info("\n".join(results.summary_lines(result.to_dict(), self.paths.root)))
        return result

    def result(self, progress: Progress, status: results.Status, code: int) -> results.Result:
        return make_result(
            self.state,
            progress,
            status,
            code,
            world_size=self.world_size,
            clock=self.clock,
            paths=self.paths,
        )


def _open_run_dir(cfg: TrainConfig, ctx: DistContext, comm: Comm, lock: RunDirLock) -> bool:
    """Rank 0 opens the run dir (claim, lock, identity); every rank learns whether it holds a
    finished run (then there is nothing to do)."""
    error: BaseException | None = None
    finished = False
    if ctx.env.rank == 0:
        try:
            finished = open_run_dir(cfg, lock).finished
        except Exception as err:
            error = err
    comm.check(error, "opening the run directory")
    return bool(comm.sum([1.0 if finished else 0.0])[0])


def _finished_result(cfg: TrainConfig) -> results.Result:
    saved = results.read_json(RunPaths(cfg.run_dir).result)
    saved.update(status="finished", exit_code=0)
    return results.Result(**saved)


def train(
    config: TrainConfig, *, ctx: DistContext | None = None, exiting: bool = False
) -> results.Result:
    """Train in this process (one rank of the job); returns the Result on every rank.

    Initialises the process group through ``hpc_ddp.dist`` unless one is already up (``ctx`` lets
    a caller pass its DistContext). Raises on errors; ``run_process`` turns them into exit codes.
    ``exiting``: the process exits once this returns (the command's worker), so an NCCL group
    is left to the exit (``end_process_group``).
    """
    import torch.distributed as dist

    from hpc_ddp import end_process_group, init_distributed

    clock = Clock()
    if config.deterministic:  # before any CUDA work of ours: cuBLAS reads its setting once
        use_deterministic_kernels()
    own_group = ctx is None and not dist.is_initialized()
    env = ctx.env if ctx else detect_env(gpus_per_process=config.gpus_per_process or None)
    set_rank(env.rank)
    startup = StartUp.begin(config, env, joining=ctx is None)  # beside the join (fast/)
    if ctx is None:
        try:
            ctx = init_distributed(
                env,
                backend=config.backend,
                timeout_s=config.timeout_s,
                connect_timeout_s=config.connect_timeout_s,
            )
        finally:
            startup.joined()
    startup.process_group_ready()
    comm = Comm(ctx.device)
    lock = RunDirLock(config.run_dir)
    flag = Preemption(config.requeue_signals)
    ctrl_c = CtrlC.install(flag)
    state: TrainState | None = None
    trainer: Trainer | None = None
    stopped = False  # _stop below ran to its end
    try:
        try:
            amp = preflight(config, ctx)  # before the run dir is touched
            if _open_run_dir(config, ctx, comm, lock):
                result = _finished_result(config)
                log.info(
                    "\n".join(finished_answer(config.run_dir, result.to_dict(), config.epochs))
                )
                return result
            splits = load_splits(config, ctx, comm)
            state = build_state(config, ctx, comm, amp, splits, flag)
            trainer = Trainer(config, ctx, comm, state, clock)
            try:
                result = trainer.run(flag)
            except SystemExit as err:
                raise exited_in_training(config.model, err) from err
        except BaseException as err:
            _stop(trainer, state, err, ctrl_c=ctrl_c.received)
            stopped = True
            raise
    except KeyboardInterrupt as late:
        # Ctrl-C reaches every rank at once. Where a peer left first, this rank's collective
        # failed before its own handler ran, and the handler's KeyboardInterrupt then lands
        # inside _stop, cutting it short. The handler raises once, so this pass runs whole.
        if not stopped:
            _stop(trainer, state, late, ctrl_c=True)
        raise
    finally:
        if trainer is not None:
            trainer.close()
        ctrl_c.uninstall()
        flag.close()
        lock.release()
    if own_group:  # only on success: on errors peers may be gone
        # Captured NCCL work must go before its communicator (cuda_graphs.GraphedStep.release).
        end_process_group(release=state.stepper.close, exiting=exiting)
    if trainer.plotter is not None:
        trainer.plotter.finish()
    return result


def _stop(
    trainer: Trainer | None, state: TrainState | None, err: BaseException, *, ctrl_c: bool
) -> None:
    """Training stops with ``err``: progress.json says how, and an async save in flight ends
    (bounded; its error logged)."""
    if trainer is not None:
        trainer.record_stop(err, ctrl_c=ctrl_c)
    if state is not None:
        state.run.checkpointer.close(timeout=HOLD_TIMEOUT_S)


def run_process(config: TrainConfig) -> int:
    """Train and return the exit code (0, 2 bad input, 1 crash, 65 diverged, 75 requeue), errors
    printed."""
    from hpc_ddp import exit_code_of

    return exit_code_of(lambda: train(config).exit_code)
