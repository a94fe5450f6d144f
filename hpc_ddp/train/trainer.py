"""The resumable DDP trainer: ``train(config) -> Result`` and ``run_process(config) -> exit code``.

Every rank runs the same code; rank 0 alone writes files and logs progress. Decisions that must
be unanimous (run dir usable, data staged, preempted) go through one collective each, so a rank
that fails alone is reported by name instead of leaving the others in a collective.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from hpc_ddp.checkpoint import Checkpointer, RunDirLock
from hpc_ddp.cifar import data, gpu_data, models
from hpc_ddp.cluster import detect_env
from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.exit_codes import EXIT_REQUEUE
from hpc_ddp.runtime import rng
from hpc_ddp.runtime.collectives import Comm
from hpc_ddp.runtime.evaluation import evaluate
from hpc_ddp.runtime.preemption import CtrlC, PreemptionFlag, requeue
from hpc_ddp.runtime.sampler import ShardPlan
from hpc_ddp.train import cuda_graphs, results
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.fingerprint import params_sha256
from hpc_ddp.train.finished import finished_answer
from hpc_ddp.train.loop import Stepper, Times, grouped, timed_allreduce
from hpc_ddp.train.optim import amp_dtype, build_optimizer, lr_lambda
from hpc_ddp.train.prefetch import DynamoPrefetch, needs_dynamo
from hpc_ddp.train.progress import LiveBar, Progress, wants_live_bar
from hpc_ddp.train.rundir import open_run_dir
from hpc_ddp.train.syncpoints import AgreeSchedule, PendingSteps

if TYPE_CHECKING:
    from hpc_ddp.dist import DistContext

HOLD_TIMEOUT_S = 120.0


class Trainer:
    def __init__(self, cfg: TrainConfig, ctx: DistContext) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.rank, self.world_size = ctx.env.rank, ctx.env.world_size
        self.comm = Comm(ctx.device)
        self.run_dir = Path(cfg.run_dir)
        self.t_start = time.perf_counter()
        self.lock = RunDirLock(self.run_dir)
        self.base_wall = 0.0  # wall seconds of earlier attempts (from the checkpoint)
        self.plotting: threading.Thread | None = None
        self._progress_at = float("-inf")  # when progress.json was last written
        self.bar: LiveBar | None = None  # rank 0 on a terminal, while training

    def elapsed(self) -> float:
        return self.base_wall + time.perf_counter() - self.t_start

    def log(self, msg: str) -> None:
        if self.rank == 0:
            if self.bar is not None:
                self.bar.clear()
            print(msg, flush=True)

    # ---------------------------------------------------------------- setup
    def setup(self) -> bool:
        """Returns False when the run dir holds a finished run (nothing to do)."""
        self.amp = amp_dtype(self.cfg, self.ctx.device)  # before touching the run dir
        if self.cfg.sync_bn and self.ctx.device.type != "cuda":
            raise ConfigError(
                "sync_bn needs GPUs: DDP runs SyncBatchNorm only on CUDA modules",
                hint="drop --sync-bn on CPU (each rank then keeps its own BatchNorm statistics)",
            )
        error: BaseException | None = None
        finished = False
        if self.rank == 0:
            try:
                finished = open_run_dir(self.cfg, self.lock).finished
            except Exception as err:
                error = err
        self.comm.check(error, "opening the run directory")
        if self.comm.sum([1.0 if finished else 0.0])[0]:
            return False
        root = data.prepare(self.cfg, local_rank=self.ctx.env.local_rank, check=self.comm.check)
        # torchvision's classes only where its loader will run: the GPU path reads the files itself
        splits = gpu_data.load_splits(self.cfg, root, self.ctx.devices[0])
        self.train_set, self.test_set, num_classes = splits
        self.plan = ShardPlan(
            n=len(self.train_set),
            seed=self.cfg.seed,
            world_size=self.world_size,
            micro_batch=self.cfg.batch_size,
            accum_steps=self.cfg.accum_steps,
        )
        self.build(num_classes)
        return True

    def build(self, num_classes: int) -> None:
        cfg, ctx = self.cfg, self.ctx
        rng.seed_everything(cfg.seed)  # identical initial weights on every rank and every run
        if cfg.deterministic:
            rng.use_deterministic_kernels()
        net = models.build_model(cfg.model, num_classes, sync_bn=cfg.sync_bn)
        devices = ctx.devices  # several when one process drives several GPUs
        self.net = models.place_model(net, devices)
        self.in_device, self.out_device = models.input_device(net), models.output_device(net)
        choice = cuda_graphs.choose(cfg, ctx.device, self.amp, len(devices))
        self.log(choice.line)
        self.captured = choice.captured
        if self.comm.active and not self.captured:  # the graphed step all-reduces itself
            ids = [ctx.device] if ctx.device.type == "cuda" and len(devices) == 1 else None
            options = ddp_options(self.net, one_device=len(devices) == 1)
            self.model: torch.nn.Module = DDP(self.net, device_ids=ids, **options)
        else:
            self.model = self.net
        opt = build_optimizer(cfg, net.parameters())
        total = self.plan.steps_per_epoch() * cfg.epochs
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total))
        scaler = torch.amp.GradScaler(ctx.device.type, enabled=self.amp == torch.float16)
        if self.captured:
            self.stepper = cuda_graphs.GraphedStepper(
                self.net, opt, sched, scaler, self.amp, self.out_device
            )
        else:
            self.stepper = Stepper(self.model, opt, sched, scaler, self.amp, self.out_device)
        if isinstance(self.model, DDP):
            # Gloo (CPU) promises bit-exact resume at any world size, so it reduces per tensor
            # in a hook; NCCL keeps DDP's flat buckets and its C++ all-reduce unless timed (a
            # Python hook per bucket costs host time on every step: benchmarks/README.md).
            gloo = ctx.backend == "gloo"
            self.stepper.comm_timer.per_tensor = gloo
            if gloo or cfg.time_allreduce:
                self.model.register_comm_hook(self.stepper.comm_timer, timed_allreduce)
        self.train_data, self.eval_data = gpu_data.choose(
            cfg,
            self.plan,
            self.train_set,
            self.test_set,
            rank=self.rank,
            world_size=self.world_size,
            device=self.in_device,
            log=self.log,
        )
        self.ckpt = Checkpointer(
            self.run_dir / "checkpoints",
            rank=self.rank,
            world_size=self.world_size,
            keep=cfg.keep_checkpoints,
            log=self.log,
            async_save=cfg.async_checkpoint,  # its Gloo group: created now, on every rank
        )

    # ------------------------------------------------------------ checkpoints
    def restore(self) -> Progress:
        loaded = self.ckpt.load_latest(map_location="cpu")
        if loaded is None:
            return Progress()
        if loaded.world_size != self.world_size:
            raise ConfigError(
                f"the checkpoint {loaded.path} was written by {loaded.world_size} processes, "
                f"this run has {self.world_size}",
                hint="resume with the same number of processes (nodes x processes per node): "
                "the data order and per-rank RNG streams depend on it; or start a new --run-dir",
            )
        s = loaded.shared
        self.net.load_state_dict(s["model"])
        self.stepper.optimizer.load_state_dict(s["optimizer"])
        self.stepper.scheduler.load_state_dict(s["scheduler"])
        self.stepper.scaler.load_state_dict(s["scaler"])
        progress = Progress(**s["progress"])
        progress.interruptions += 1
        self.base_wall = progress.wall_seconds
        rng.restore(loaded.per_rank["rng"])
        self.log(
            f"resumed from {loaded.path} (epoch {progress.epoch + 1}, "
            f"{progress.start} samples into it, step {progress.global_step})"
        )
        return progress

    def save(self, progress: Progress, times: Times) -> None:
        t0 = time.perf_counter()
        progress.epoch_times = times.to_dict()
        progress.wall_seconds = self.elapsed()
        shared = {
            "model": self.net.state_dict(),
            "optimizer": self.stepper.optimizer.state_dict(),
            "scheduler": self.stepper.scheduler.state_dict(),
            "scaler": self.stepper.scaler.state_dict(),
            "progress": asdict(progress),
        }
        meta = {"epoch": progress.epoch, "start": progress.start, "model": self.cfg.model}
        # Async: waits for the previous save (raising its error), copies, writes in the background.
        save = self.ckpt.save_async if self.cfg.async_checkpoint else self.ckpt.save
        save(progress.global_step, shared=shared, per_rank={"rng": rng.capture()}, meta=meta)
        times.checkpoint += time.perf_counter() - t0

    def abandon_checkpoint(self) -> None:
        """The run is failing: let an async save in flight end (bounded), logging its error."""
        ckpt = getattr(self, "ckpt", None)
        if ckpt is not None:
            ckpt.close(timeout=HOLD_TIMEOUT_S)

    # ----------------------------------------------------------------- loop
    def write_progress(self, progress: Progress, status: str, **extra: str) -> None:
        """Rank 0: progress.json, for monitors and tests; routine updates at most every 0.5 s
        (a rename per step would load a parallel filesystem), status changes always."""
        now = time.monotonic()
        if status == "training" and now - self._progress_at < 0.5:
            return
        self._progress_at = now
        if self.rank == 0:
            info = {"status": status, "epoch": progress.epoch, "step": progress.global_step}
            info.update(pids=self.pids, world_size=self.world_size, start=progress.start, **extra)
            results.write_json(self.run_dir / results.PROGRESS, info)

    def record_stop(self, error: BaseException, *, ctrl_c: bool) -> None:
        """Rank 0, training stopped by ``error``: progress.json says so (``interrupted`` after
        Ctrl-C, else ``failed``) and when, instead of a ``training`` with dead pids."""
        progress = getattr(self, "progress", None)
        if progress is None:  # stopped before training: progress.json was never written
            return
        interrupted = ctrl_c or isinstance(error, KeyboardInterrupt)
        status = "interrupted" if interrupted else "failed"
        why = "SIGINT (Ctrl-C)" if interrupted else f"{type(error).__name__}: {error}"
        stopped_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        try:
            self.write_progress(progress, status, stopped_at=stopped_at, reason=why)
        except OSError as err:  # the run dir may be what failed: the error below still counts
            self.log(f"could not record the stop in {results.PROGRESS}: {err}")

    def hold_for_signal(self, progress: Progress, flag: PreemptionFlag) -> None:
        """Test hook (``debug_hold_at_step``): wait, bounded, until a requeue signal arrives."""
        self.write_progress(progress, "holding")
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        while not flag.requested:
            if time.monotonic() > deadline:
                raise HpcDdpError(f"debug_hold_at_step: no signal within {HOLD_TIMEOUT_S:.0f} s")
            time.sleep(0.01)  # polling our own flag, set by the signal handler; deadline above

    def run(self, flag: PreemptionFlag) -> results.Result:
        self.pids = self.comm.gather_objects(os.getpid())
        self.progress = progress = self.restore()  # record_stop reads it
        cfg, plan = self.cfg, self.plan
        steps_per_epoch = plan.steps_per_epoch()
        self.log(
            f"training {cfg.model} on {cfg.dataset}{' (synthetic)' if cfg.synthetic else ''}: "
            f"{plan.n} samples, {self.world_size} process(es), {steps_per_epoch} steps/epoch, "
            f"global batch {plan.micro_batch * plan.accum_steps * self.world_size}, "
            f"device {self.ctx.device}, backend {self.ctx.backend}"
        )
        if self.rank == 0 and wants_live_bar(sys.stdout, os.environ):
            global_batch = plan.micro_batch * plan.accum_steps * self.world_size
            self.bar = LiveBar(sys.stdout, cfg.epochs, global_batch)
        self.model.train()
        agree = AgreeSchedule(self.world_size)
        pending = PendingSteps()
        while progress.epoch < cfg.epochs:
            times = Times.from_dict(progress.epoch_times)
            done = plan.steps_done(progress.start)
            agree.start_epoch(progress.global_step)
            batches = self.train_data.batches(progress.epoch, progress.start)
            for micro in grouped(batches, cfg.accum_steps, times):
                t0 = time.perf_counter()
                loss_sum, n = self.stepper.step(micro, times)  # the loss stays on the device
                done += 1
                progress.global_step += 1
                progress.start = plan.step_start(done)
                last = done == steps_per_epoch
                hold = progress.global_step == cfg.debug_hold_at_step and not last
                if hold:
                    self.hold_for_signal(progress, flag)
                pending.add(loss_sum, n)
                progress.train_seconds += time.perf_counter() - t0
                self.write_progress(progress, "training")
                if self.bar is not None:
                    self.bar.update(progress.epoch + 1, done, steps_per_epoch)
                logging = done % cfg.log_every == 0 or last
                every = cfg.checkpoint_every_steps
                saving = bool(every) and not last and progress.global_step % every == 0
                # Sync points (syncpoints.py): the same steps on every rank. The epoch's last
                # step skips the flag: its checkpoint comes after evaluation.
                due = agree.due(progress.global_step, flag.requested)
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
            self.end_epoch(progress, times)
            if progress.epoch < cfg.epochs and self.comm.sum([float(flag.requested)])[0]:
                return self.preempted(progress, times, flag, saved=True)
        self.ckpt.wait()  # an async save still in flight: committed (or raised) before result.json
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
        lr = float(self.stepper.optimizer.param_groups[0]["lr"])  # a tensor with cuda_graphs
        rate = progress.samples_total / max(progress.train_seconds, 1e-9)
        self.log(
            f"epoch {progress.epoch + 1}/{self.cfg.epochs} step {done}/{steps} "
            f"loss {loss:.4f} lr {lr:.4g} {rate:.0f} samples/s"
        )

    def end_epoch(self, progress: Progress, times: Times) -> None:
        t0 = time.perf_counter()
        batches = self.eval_data.batches(self.cfg.eval_batch_size)
        # The plain module: ranks may run different numbers of eval batches, and DDP's forward
        # must not be entered unevenly. Rank 0's BatchNorm buffers are what DDP trains with.
        self.comm.broadcast_buffers(self.net)
        metrics = evaluate(self.net, batches, self.comm, self.amp)
        times.eval += time.perf_counter() - t0
        epoch_seconds = times.data + times.compute + times.checkpoint
        row = {
            "epoch": progress.epoch + 1,
            "step": progress.global_step,
            "train_loss": progress.epoch_loss_sum / max(progress.epoch_loss_count, 1),
            **metrics,
            "lr": float(self.stepper.optimizer.param_groups[0]["lr"]),
            "samples_per_second": progress.epoch_loss_count / max(times.data + times.compute, 1e-9),
            "seconds": epoch_seconds + times.eval,
            "time": times.to_dict(),
            "allreduce_calls": self.stepper.comm_timer.bucket_calls,
        }
        timed = self.stepper.comm_timer.bucket_calls > 0
        comm = f" (all-reduce {times.comm:.2f}s)" if timed else ""
        self.log(
            f"epoch {row['epoch']}: train loss {row['train_loss']:.4f}, test loss "
            f"{row['test_loss']:.4f}, accuracy {100 * row['test_accuracy']:.2f}% of "
            f"{row['test_samples']} test samples, {row['samples_per_second']:.0f} samples/s; "
            f"time data {times.data:.2f}s compute {times.compute:.2f}s{comm} "
            f"checkpoint {times.checkpoint:.2f}s eval {times.eval:.2f}s"
        )
        progress.history.append(row)
        progress.epoch += 1
        progress.start = 0
        progress.epoch_loss_sum = progress.epoch_loss_count = 0.0
        saving = Times()
        self.save(progress, saving)
        # The epoch-end save belongs to this epoch's breakdown (the checkpoint has it from the
        # next save on); metrics.jsonl is rewritten whole from the history.
        row["time"]["checkpoint"] = round(row["time"]["checkpoint"] + saving.checkpoint, 6)
        if self.rank == 0:
            results.write_metrics(self.run_dir, progress.history)

    def preempted(
        self, progress: Progress, times: Times, flag: PreemptionFlag, *, saved: bool = False
    ) -> results.Result:
        if not saved:
            self.save(progress, times)
        self.ckpt.wait()  # async: committed on every rank before requeueing and exiting 75
        what = ", ".join(sorted(set(flag.received))) or "another rank's signal"
        message = requeue(self.cfg.requeue) if self.rank == 0 else ""
        self.log(f"preempted ({what}): checkpointed at step {progress.global_step}; {message}")
        self.write_progress(progress, "preempted")
        return self.result(progress, "preempted", EXIT_REQUEUE)

    def finish(self, progress: Progress) -> results.Result:
        result = self.result(progress, "finished", 0)
        if self.rank == 0:
            results.write_json(self.run_dir / results.RESULT, result.to_dict())
            if progress.history:
                # matplotlib takes 0.5-1 s to import and draw: on a thread, while the graphs and
                # the process group are torn down; train() joins it before returning.
                self.plotting = threading.Thread(
                    target=results.plot, args=(self.run_dir, progress.history), name="plot"
                )
                self.plotting.start()
            self.write_progress(progress, "finished")
            self.log(f"finished: {self.run_dir / results.RESULT}")
            self.log("\n".join(results.summary_lines(result.to_dict(), self.run_dir)))
        return result

    def result(self, progress: Progress, status: str, code: int) -> results.Result:
        last = progress.history[-1] if progress.history else {}
        return results.Result(
            status=status,
            exit_code=code,
            epochs=progress.epoch,
            steps=progress.global_step,
            world_size=self.world_size,
            train_loss=last.get("train_loss"),
            test_loss=last.get("test_loss"),
            test_accuracy=last.get("test_accuracy"),
            test_samples=int(last.get("test_samples", 0)),
            samples_per_second=progress.samples_total / max(progress.train_seconds, 1e-9),
            wall_seconds=self.elapsed(),
            params_sha256=params_sha256(self.net.state_dict()),
            run_dir=str(self.run_dir),
            interruptions=progress.interruptions,
            extra={
                "allreduce_calls": self.stepper.comm_timer.bucket_calls,
                "cuda_graphs": self.captured,
            },
        )


def ddp_options(net: torch.nn.Module, *, one_device: bool = True) -> dict[str, bool]:
    """DDP's settings for this trainer: less host work per step, the same results.

    - ``gradient_as_bucket_view``: gradients live in DDP's all-reduce buckets, instead of being
      copied in and out of them by one kernel per parameter and direction every step.
    - ``forward_sync_buffers=False`` when every buffer is a normalization layer's running
      statistics: in training those layers use the batch's statistics, so rank 0's buffers and
      every gradient are what they would be with DDP's broadcast before each forward (one
      NCCL broadcast plus a copy per buffer). Rank 0's buffers reach the other ranks where they
      are read: before each evaluation (``Comm.broadcast_buffers``); checkpoints hold rank 0's.
      Any other buffer may be read in training, so such a model keeps DDP's broadcast.
      (torch 2.13 renamed ``broadcast_buffers`` to this; the old name warns on every rank.
      Unlike ``broadcast_buffers=False`` it still broadcasts buffers once at construction:
      the model is built from the same seed on every rank, so that copies equal values.)

    tests/test_train_ddp.py checks both against DDP's defaults, bit for bit. A model split
    across a process's GPUs keeps DDP's defaults: only the one-device case was measured and
    tested on GPUs (benchmarks/README.md: DDP's cost at 1 GPU 19.3 % -> 2.0 %).
    """
    if not one_device:
        return {}
    norm = torch.nn.modules.batchnorm._NormBase
    owners = [m for m in net.modules() if next(m.buffers(recurse=False), None) is not None]
    return {
        "gradient_as_bucket_view": True,
        "forward_sync_buffers": not all(isinstance(m, norm) for m in owners),
    }


def _finished_result(cfg: TrainConfig) -> results.Result:
    saved = results.read_json(Path(cfg.run_dir) / results.RESULT)
    saved.update(status="finished", exit_code=0)
    return results.Result(**saved)


def train(config: TrainConfig, *, ctx: DistContext | None = None) -> results.Result:
    """Train in this process (one rank of the job); returns the Result on every rank.

    Initialises the process group through ``hpc_ddp.dist`` unless one is already up (``ctx`` lets
    a caller pass its DistContext). Raises on errors; ``run_process`` turns them into exit codes.
    """
    import torch.distributed as dist

    from hpc_ddp.dist import init_distributed

    own_group = ctx is None and not dist.is_initialized()
    env = ctx.env if ctx else detect_env(gpus_per_process=config.gpus_per_process or None)
    prefetch = DynamoPrefetch.start() if needs_dynamo(config, env) else None
    if ctx is None:
        ctx = init_distributed(
            env,
            backend=config.backend,
            timeout_s=config.timeout_s,
            connect_timeout_s=config.connect_timeout_s,
        )
    if prefetch is not None:
        prefetch.process_group_ready()
    flag = PreemptionFlag.install(config.requeue_signals)
    ctrl_c = CtrlC.install(flag)
    trainer = Trainer(config, ctx)
    try:
        if not trainer.setup():
            result = _finished_result(config)
            trainer.log("\n".join(finished_answer(config.run_dir, result.to_dict())))
            return result
        result = trainer.run(flag)
    except BaseException as err:
        if trainer.bar is not None:
            trainer.bar.clear()  # the error starts a line of its own
        trainer.record_stop(err, ctrl_c=ctrl_c.received)
        trainer.abandon_checkpoint()
        raise
    finally:
        ctrl_c.uninstall()
        flag.uninstall()
        trainer.lock.release()
    if own_group:
        # Captured NCCL work must go before its communicator (cuda_graphs.GraphedStep.release).
        getattr(trainer.stepper, "close", lambda: None)()
        dist.destroy_process_group()  # only on success: on errors peers may be gone
    if trainer.plotting is not None:
        trainer.plotting.join()
    return result


def run_process(config: TrainConfig) -> int:
    """Train and return the exit code (0, 2 bad input, 1 crash, 75 requeue), errors printed."""
    from hpc_ddp.dist import exit_code_of

    return exit_code_of(lambda: train(config).exit_code)
