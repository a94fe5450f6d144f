"""Run ``hpc-ddp train`` with a stopwatch attached: time to first step, checkpoint stalls, resume.

    python benchmarks/probe.py --probe-nproc 4 --probe-json t.json -- \\
        --model resnet18 --synthetic ...   # any trainer flags after --
    torchrun --standalone --nproc-per-node=4 benchmarks/probe.py --probe-json t.json -- ...

``--probe-nproc N`` starts the workers as ``hpc-ddp train --nproc-per-node N`` does (forked by
hpc_ddp.spawn after the imports); under torchrun each worker is its own interpreter.

The trainer runs unmodified; the probe wraps a few of its functions (process-group init, data
staging and loading, the data path choice, model build, restore, each checkpoint phase, the
first optimizer step) and writes, on rank 0, one JSON object with:
- ``ttfs``: seconds from process start (kernel's start time of this process) and from the
  command (``BENCH_T0``, set by bench.py just before launching) to the end of the first
  optimizer step, with the phases in between (imports, process group, data, model, ...);
- ``saves``: every checkpoint save, split into state_dict copy / prepare / write / commit;
- ``train_s``: training time, from the first step's start to the end of the last epoch's
  evaluation and checkpoint (what a user waits for), plus the trainer's result.json.
``--probe-no-ddp`` replaces DDP by the bare model (for the cost of the DDP wrapper on 1 GPU);
``--probe-ddp-of-one`` wraps DDP in a job of one process too (the trainer does not: for DDP's
cost at 1 GPU); ``--probe-ddp-defaults`` builds DDP with torch's defaults (not
trainer.ddp_options);
``--probe-stock-optimizer`` keeps torch.optim's torch._dynamo wrappers (optim.without_dynamo off);
``--probe-store-backoff`` lets ranks > 0 meet a refusal and TCPStore's backoff (no listener wait);
``--probe-one-stage-prefetch`` imports torch._dynamo whole from the start, as the trainer did
before hpc_ddp/train/fast/prefetch.py's two stages (init_process_group then waits for it);
``--probe-deterministic`` asks for deterministic kernels (exact-resume comparisons on GPUs).
"""

from __future__ import annotations

import os
import time

T_MAIN = time.time()


def _process_start() -> float:
    """This process's start time (wall clock) from /proc: includes the interpreter's start."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as fh:
            btime = next(int(line.split()[1]) for line in fh if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return T_MAIN


T_PROC = _process_start()

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

DYNAMO: dict[str, Any] = {}  # who imported torch._dynamo first, and whether before the first step


class DynamoImportWitness:
    """A meta-path finder that only looks: records the stack of torch._dynamo's first import."""

    def find_spec(self, name: str, *_: Any) -> None:
        if name == "torch._dynamo" and "stack" not in DYNAMO:
            frames = traceback.extract_stack()[:-1]
            DYNAMO["stack"] = [
                f"{f.filename.rsplit('site-packages/', 1)[-1]}:{f.lineno} {f.name}"
                for f in frames
                if "importlib" not in f.filename
            ][-8:]
            DYNAMO["thread"] = threading.current_thread().name


sys.meta_path.insert(0, DynamoImportWitness())

import torch  # noqa: E402

T_TORCH = time.time()

import hpc_ddp.dist as hdist  # noqa: E402
from hpc_ddp import spawn  # noqa: E402
from hpc_ddp.checkpoint import checkpointer  # noqa: E402
from hpc_ddp.run_dir.paths import RunPaths  # noqa: E402
from hpc_ddp.train import config, loop  # noqa: E402
from hpc_ddp.train import report as train_report  # noqa: E402
from hpc_ddp.train import trainer as tr  # noqa: E402
from hpc_ddp.train.cifar import data  # noqa: E402
from hpc_ddp.train.fast import choice as fast  # noqa: E402
from hpc_ddp.train.fast import cuda_graphs, gpu_data  # noqa: E402

T_IMPORTS = time.time()
T_WORKER: list[float] = []  # when a forked worker began (--probe-nproc)
EVENTS: list[tuple[str, float, float]] = []  # (name, start, end), wall clock
SAVES: list[dict[str, float]] = []
STATE: dict[str, Any] = {"steps": 0}
HOST_STEP_S: list[float] = []
EPOCH_ENDS: list[float] = []  # wall clock at the end of each end_epoch (its save included)
STAGES: list[float] = []  # host time of each epoch-end copy staged after the epoch's last step


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(owner: Any, name: str, label: str) -> None:
    """Replace ``owner.name`` by a wrapper that records (label, start, end)."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            _sync()
            EVENTS.append((label, t0, time.time()))

    setattr(owner, name, wrapper)


def save_every_epochs(k: int) -> None:
    """Epoch-end saves only after every k-th epoch (measuring only: a save's wall-clock cost is
    then the epochs it touches against the clean ones of the same run, see report.table_stall),
    the epoch-end copy staged only for those; the end of each epoch stamped after its save."""
    save, stage, end_epoch = tr.Trainer.save, tr.Trainer.stage_epoch_end, tr.Trainer.end_epoch
    in_end_epoch: list[bool] = []

    def maybe_stage(self: Any, progress: Any, times: Any) -> Any:
        if (progress.epoch + 1) % k:
            return None
        t0 = time.time()
        try:
            return stage(self, progress, times)
        finally:
            STAGES.append(time.time() - t0)

    def maybe_save(self: Any, progress: Any, times: Any, staged: Any = None) -> None:
        if not in_end_epoch or progress.epoch % k == 0:
            save(self, progress, times, staged)

    def stamped_end_epoch(self: Any, *args: Any, **kwargs: Any) -> Any:
        in_end_epoch.append(True)
        try:
            return end_epoch(self, *args, **kwargs)
        finally:
            in_end_epoch.pop()
            EPOCH_ENDS.append(time.time())

    tr.Trainer.save = maybe_save  # type: ignore[method-assign]
    tr.Trainer.stage_epoch_end = maybe_stage  # type: ignore[method-assign]
    tr.Trainer.end_epoch = stamped_end_epoch  # type: ignore[method-assign]


def instrument(no_ddp: bool) -> None:
    timed(hdist, "init_distributed", "process_group")
    timed(data, "prepare", "data_stage")
    timed(gpu_data, "load_splits", "data_read")  # torchvision's classes or gpu_data's reader
    timed(gpu_data, "choose", "data_to_device")
    timed(tr, "build_state", "build")  # model + optimizer + data path
    timed(tr, "restore", "restore")
    timed(tr.Trainer, "finish", "finish")
    timed(cuda_graphs.GraphedStepper, "close", "release_graphs")
    for cls in (loop.Stepper, cuda_graphs.GraphedStepper):
        original = cls.step

        def step(self: Any, micro: Any, times: Any, _orig: Any = original) -> Any:
            t0 = time.time()
            out = _orig(self, micro, times)  # the loss stays on the device (no host sync)
            if STATE["steps"] == 0:
                _sync()  # the first step's GPU work, as when the step read its loss
                EVENTS.append(("first_step", t0, time.time()))
                DYNAMO["imported_by_first_step"] = "torch._dynamo" in sys.modules
            else:  # host time to issue a step: near the wall time per step = CPU-bound
                HOST_STEP_S.append(time.time() - t0)
            STATE["steps"] += 1
            return out

        cls.step = step  # type: ignore[method-assign]

    save, phase = tr.Trainer.save, checkpointer.Checkpointer._phase

    def timed_save(self: Any, *args: Any, **kwargs: Any) -> Any:
        SAVES.append({"epoch": args[0].epoch})
        _sync()
        t0 = time.time()
        out = save(self, *args, **kwargs)
        SAVES[-1]["total"] = time.time() - t0
        SAVES[-1]["state_dict_and_rest"] = SAVES[-1]["total"] - sum(
            v for k, v in SAVES[-1].items() if k in ("prepare", "write", "commit")
        )
        return out

    def timed_phase(self: Any, name: str, step: int, body: Any, agree: Any) -> Any:
        t0 = time.time()
        try:
            return phase(self, name, step, body, agree)
        finally:
            # An --async-checkpoint save runs its phases on a thread, off the training path:
            # they are not part of the stall, and land under "background".
            main = threading.current_thread() is threading.main_thread()
            if SAVES:
                into = SAVES[-1] if main else SAVES[-1].setdefault("background", {})
                into[name] = time.time() - t0

    tr.Trainer.save = timed_save  # type: ignore[method-assign]
    checkpointer.Checkpointer._phase = timed_phase  # type: ignore[method-assign]
    if no_ddp:

        class BareModel:  # isinstance(model, BareModel) is never true: no comm hook either
            def __new__(cls, module: Any, **_: Any) -> Any:
                return module

        fast.DDP = BareModel  # type: ignore[misc,assignment]


def report(path: str, cfg: config.TrainConfig, code: int) -> None:
    ev = {name: (t0, t1) for name, t0, t1 in EVENTS}  # last occurrence of each
    first = {}
    for name, t0, t1 in EVENTS:
        first.setdefault(name, (t0, t1))
    t_cmd = float(os.environ.get("BENCH_T0", T_PROC))
    out: dict[str, Any] = {"exit_code": code, "world_size": int(os.environ.get("WORLD_SIZE", 1))}
    if "first_step" in first:
        fs_end = first["first_step"][1]
        phases = {
            "interpreter_start": T_MAIN - T_PROC,
            "import_torch": T_TORCH - T_MAIN,
            "import_hpc_ddp": T_IMPORTS - T_TORCH,
        }
        if T_WORKER:
            phases["fork_workers"] = T_WORKER[0] - T_IMPORTS
        for name in (
            "process_group",
            "data_stage",
            "data_read",
            "data_to_device",
            "build",
            "restore",
            "first_step",
        ):
            if name in first:
                phases[name] = first[name][1] - first[name][0]
        if "build" in phases and "data_to_device" in phases:
            phases["model_and_optimizer"] = phases.pop("build") - phases["data_to_device"]
        out["ttfs"] = {
            "from_process_start_s": fs_end - T_PROC,
            "from_command_s": fs_end - t_cmd,
            "launcher_s": T_PROC - t_cmd,
            "phases_s": phases,
        }
        if "finish" in ev:
            out["train_s"] = ev["finish"][0] - first["first_step"][0]
    if HOST_STEP_S:
        ordered = sorted(HOST_STEP_S)
        out["host_step_ms"] = {
            "median": 1e3 * ordered[len(ordered) // 2],
            "p90": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
            "mean": 1e3 * sum(ordered) / len(ordered),
        }
    out["after_training_s"] = {
        name: ev[name][1] - ev[name][0]
        for name in ("finish", "release_graphs", "end_process_group")
        if name in ev
    }
    if "exit" in ev and "end_process_group" in ev:  # the plot's join, and train()'s return
        out["after_training_s"]["to_return"] = ev["exit"][0] - ev["end_process_group"][1]
    if "exit" in ev:  # the shell's wall time less this: the processes' own exit
        out["returned_from_command_s"] = ev["exit"][0] - t_cmd
    out["saves"] = SAVES
    out["epoch_ends"] = EPOCH_ENDS
    out["stages"] = STAGES
    out["torch_dynamo"] = DYNAMO
    out["steps_this_attempt"] = STATE["steps"]
    result = RunPaths(cfg.run_dir).result
    if result.exists():
        out["result"] = json.loads(result.read_text())
    metrics = RunPaths(cfg.run_dir).metrics
    if metrics.exists():
        out["history"] = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(out, fh, indent=1)
    os.replace(tmp, path)


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ours = argparse.ArgumentParser()
    ours.add_argument("--probe-json", required=True)
    ours.add_argument("--probe-nproc", type=int, default=1, help="fork N workers (spawn)")
    ours.add_argument("--probe-no-ddp", action="store_true")
    ours.add_argument(
        "--probe-ddp-of-one",
        action="store_true",
        help="DDP in a job of one process too (fast.sync.gradient_sync says none there)",
    )
    ours.add_argument(
        "--probe-ddp-defaults",
        action="store_true",
        help="DDP with torch's defaults instead of trainer.ddp_options",
    )
    ours.add_argument(
        "--probe-stock-optimizer",
        action="store_true",
        help="torch.optim's classes as they are (with their torch._dynamo wrappers)",
    )
    ours.add_argument(
        "--probe-store-backoff",
        action="store_true",
        help="ranks > 0 connect to rank 0's TCPStore at once, retrying on TCPStore's own "
        "backoff (250-750 ms), instead of hpc_ddp.dist waiting until it listens",
    )
    ours.add_argument(
        "--probe-one-stage-prefetch",
        action="store_true",
        help="the former torch._dynamo prefetch: the whole import on a thread from the start",
    )
    ours.add_argument("--probe-no-progress-file", action="store_true")
    ours.add_argument(
        "--probe-save-every-epochs",
        type=int,
        default=1,
        metavar="K",
        help="epoch-end checkpoints after every K-th epoch only (the wall-clock stall measure)",
    )
    ours.add_argument(
        "--probe-deterministic",
        action="store_true",
        help="deterministic cuDNN/cuBLAS kernels, so two runs can be compared bit for bit",
    )
    pargs = ours.parse_args(argv[:split])
    if pargs.probe_deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True, warn_only=True)
    parser = argparse.ArgumentParser(prog="probe.py -- [trainer flags]")
    config.add_arguments(parser)
    cfg = config.from_args(parser.parse_args(argv[split + 1 :]))
    instrument(pargs.probe_no_ddp)
    save_every_epochs(pargs.probe_save_every_epochs)
    if pargs.probe_ddp_of_one:
        fast.gradient_sync = (  # type: ignore[assignment]
            lambda backend, world_size, captured: "none" if captured else "ddp"
        )
    if pargs.probe_ddp_defaults:
        fast.ddp_options = lambda net, **_: {}  # type: ignore[assignment]
    if pargs.probe_stock_optimizer:
        from hpc_ddp.train import optim

        optim.without_dynamo = lambda base: base  # type: ignore[assignment]

    if pargs.probe_one_stage_prefetch:
        from hpc_ddp.train.fast import prefetch

        prefetch.STAGE_ONE = (prefetch.TARGET,)  # stage two then finds it imported
    if pargs.probe_store_backoff:
        hdist._wait_until_listening = lambda *_: None  # type: ignore[attr-defined]
    if pargs.probe_no_progress_file:  # what the per-step progress.json write costs
        train_report.ProgressFile.write = lambda self, progress, status: None  # type: ignore[method-assign]
    end_group = hdist.end_process_group  # train() imports it from hpc_ddp.dist when called
    done: list[int] = []

    def report_then_end(*args: Any, **kwargs: Any) -> Any:
        # Training is over when the trainer ends its group: report first, so that the
        # figures survive even if the teardown were to hang.
        if int(os.environ.get("RANK", 0)) == 0 and not done:
            report(pargs.probe_json, cfg, 0)
            done.append(1)
        t0 = time.time()
        try:
            return end_group(*args, **kwargs)
        finally:  # run() below reports again with it, once train() returns
            EVENTS.append(("end_process_group", t0, time.time()))

    hdist.end_process_group = report_then_end

    def run() -> int:
        code = tr.train(cfg).exit_code
        if int(os.environ.get("RANK", 0)) == 0:
            EVENTS.append(("exit", time.time(), time.time()))
            report(pargs.probe_json, cfg, code)
        return code

    hdist.leave_group_to_exit()  # as the `hpc-ddp train` worker does (forked workers inherit it)
    if pargs.probe_nproc == 1:
        hdist.run_main(run)

    def worker() -> None:
        T_WORKER.append(time.time())
        hdist.run_main(run)

    sys.exit(spawn.launch(worker, pargs.probe_nproc, gpus_per_process=cfg.gpus_per_process or 1))


if __name__ == "__main__":
    main()
