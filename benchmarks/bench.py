"""The benchmark suite: runs every measurement on this machine, prints tables, writes JSON.

    PYTHONPATH=$PWD python3 benchmarks/bench.py --gpus 1,2,4 --out $OUT            # everything
    PYTHONPATH=$PWD python3 benchmarks/bench.py --suites ref --gpus 4 --out DIR    # one suite
    PYTHONPATH=$PWD python3 benchmarks/bench.py --smoke --gpus 1,2 --out /tmp/b    # CPU plumbing

Suites (see benchmarks/README.md for what each measures and the targets):
  ref      the reference workload (CIFAR-100 LeNet, 10 epochs, batch 64/GPU, Adam 1e-3): the
           conventional script (reference_ddp.py) against ``hpc-ddp train --cuda-graphs``
           (synchronous checkpoints) on the same files, and ``hpc-ddp train`` with default flags
           on the most GPUs
  plain    the headline as a user meets it: the conventional script, then ``hpc-ddp train
           --nproc-per-node N`` with the workload's flags only (no probe, no bench flags)
           --repeats times, on the most GPUs; timed from the shell, training time from
           result.json (``train_wall_seconds``: first step to the end, evaluation included)
  ttfs     the default command of ours (4 GPUs, no step or checkpoint flags: the captured step
           and background checkpoints) --repeats times
  refx     the slow extras of ref: the conventional script on 1 GPU and with DataParallel,
           and ours again on the most GPUs (so each call has its own side-by-side pair)
  scaling  ResNet-18 weak scaling (bf16, batch 256/GPU), DDP wrapper cost at 1 GPU, time to
           first step, checkpoint stalls, gradient all-reduce time seen by the trainer
  weak     ResNet-18 weak scaling with default flags, 1 GPU and the most alternating, --repeats
  stall    a checkpoint's wall-clock cost with default flags (ResNet-18 and LeNet, a save after
           every third epoch: the epochs a save touches against the clean ones), --repeats
  ddpcost  the DDP wrapper's cost at 1 GPU alone (bare ResNet-18, then under DDP as the trainer
           builds it, then under DDP with torch's defaults)
  eager    ResNet-18 eager DDP alone on each GPU count above 1 (with ddpcost: eager scaling)
  resume   preempt a ResNet-18 run mid-epoch and resume it: resume-to-first-step time
  nccl     all-reduce bus bandwidth ceiling (benchmarks/nccl_bench.py)
  profile  per-step time of eager DDP vs the captured step (benchmarks/step_profile.py)
  tests    tests/test_gpu.py, the trainer's GPU checks
Every command runs as a subprocess with its own timeout, its log kept; each result is appended
to ``<out>/bench.json`` as soon as it exists, so a cut-off run still leaves its numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
PY = sys.executable
# The stall suite: a save after every STALL_EVERY-th epoch, so each run has as many clean epochs
# as saving ones and ones after a save (5 of each for ResNet-18, 10 for LeNet's short epochs).
STALL_EVERY, STALL_EPOCHS_RESNET, STALL_EPOCHS_LENET = 3, 16, 31
# What the `hpc-ddp` console script runs (pyproject.toml's [project.scripts]: hpc_ddp.cli's
# main), so that a checkout that is not installed runs the same command a user types.
HPC_DDP = [PY, "-m", "hpc_ddp.cli"]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.logs = self.out / "logs"
        self.work = Path(args.work)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + args.budget_s
        self.results: dict[str, Any] = {"meta": self.meta(), "runs": {}}
        self.port = 29600
        from hpc_ddp.train.cifar import synthetic

        size = (args.train_size, args.test_size)
        self.data_dir = self.work / "data"  # ours gets this; the reference script self.root:
        self.root = synthetic.synthetic_root(
            self.data_dir, "cifar100", *size, args.synthetic_variant
        )

    # ------------------------------------------------------------- plumbing
    def meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        try:
            import torch

            meta["torch"] = torch.__version__
            if torch.cuda.is_available():
                meta["gpu"] = torch.cuda.get_device_name(0)
                meta["gpu_count"] = torch.cuda.device_count()
                meta["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as err:  # the table says so rather than the run dying
            meta["torch_error"] = repr(err)
        meta["cpus"] = os.cpu_count()
        return meta

    def save(self) -> None:
        tmp = self.out / "bench.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1, default=str))
        os.replace(tmp, self.out / "bench.json")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(
        self,
        name: str,
        cmd: list[str],
        timeout: float,
        env: dict | None = None,
        cwd: Path = REPO,
    ) -> dict:
        """Run ``cmd``; return {rc, wall_s, log}. Skips (rc=None) when the budget is spent."""
        if self.left() < min(timeout, 30):
            print(f"[bench] skip {name}: {self.left():.0f} s of budget left", flush=True)
            return {"rc": None, "skipped": "budget"}
        timeout = min(timeout, self.left())
        log = self.logs / f"{name}.log"
        full_env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (KINDS.md)
        t0 = time.time()
        full_env["BENCH_T0"] = repr(t0)
        print(f"[bench] {name}: {' '.join(cmd)}", flush=True)
        with open(log, "w") as fh:
            proc = subprocess.Popen(
                cmd,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=cwd,
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = "timeout"
        wall = time.time() - t0
        print(f"[bench] {name}: rc={rc} {wall:.1f} s", flush=True)
        if rc != 0:
            tail = log.read_text(errors="replace").splitlines()[-15:]
            print("\n".join(f"    | {line}" for line in tail), flush=True)
        return {"rc": rc, "wall_s": wall, "log": str(log), "t0": t0}

    def record(self, name: str, entry: dict) -> dict:
        earlier = self.results["runs"].get(name)
        if entry.get("skipped") and earlier and not earlier.get("skipped"):
            return earlier  # a rerun skipped for lack of budget keeps the earlier measurement
        self.results["runs"][name] = entry
        self.save()
        return entry

    def next_port(self) -> int:
        self.port += 1
        return self.port

    def torchrun(self, n: int) -> list[str]:
        return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]

    # ----------------------------------------------------------------- data
    def stage(self) -> None:
        from hpc_ddp.train.cifar import synthetic

        args = self.args
        t0 = time.time()
        size = {"train_size": args.train_size, "test_size": args.test_size}
        kind = {**size, "variant": args.synthetic_variant}
        if not synthetic.is_current(self.root, "cifar100", seed=1234, **kind):
            synthetic.write_synthetic(self.root, "cifar100", **kind)
        self.results["meta"]["data"] = {
            "root": str(self.root),
            "variant": args.synthetic_variant,
            "write_s": time.time() - t0,
        }
        print(f"[bench] data staged in {time.time() - t0:.1f} s: {self.root}", flush=True)

    # ------------------------------------------------------------------ ref
    def reference(self, name: str, mode: str, n: int, batch: int) -> None:
        out = self.work / f"{name}.json"
        out.unlink(missing_ok=True)
        cmd = [PY, str(BENCH / "reference_ddp.py"), "--data", str(self.root), "--mode", mode]
        cmd += ["--gpus", str(n), "--batch-size", str(batch), "--epochs", str(self.args.epochs)]
        cmd += ["--port", str(self.next_port()), "--json", str(out)]
        if self.args.smoke:
            cmd.append("--cpu")
        res = self.run(name, cmd, timeout=self.args.ref_timeout)
        if out.exists():
            res.update(json.loads(out.read_text()))
        self.record(name, {"kind": "reference", **res})

    def trainer_flags(
        self, model: str, epochs: int, batch: int, run_dir: Path, *, plain: bool = False
    ) -> list[str]:
        """The workload's flags; ``plain``: without the probe runs' quiet progress lines."""
        # A fresh run dir: one left by an earlier call on a warm machine would be "finished"
        # (the trainer then does nothing) or be resumed.
        shutil.rmtree(run_dir, ignore_errors=True)
        flags = ["--synthetic", "--dataset", "cifar100", "--data-dir", str(self.data_dir)]
        flags += ["--synthetic-train-size", str(self.args.train_size)]
        flags += ["--synthetic-test-size", str(self.args.test_size)]
        flags += ["--synthetic-variant", self.args.synthetic_variant]
        flags += ["--model", model, "--epochs", str(epochs), "--batch-size", str(batch)]
        flags += ["--run-dir", str(run_dir)]
        if not plain:
            flags += ["--log-every", "100000"]
        if not self.args.smoke:
            flags += ["--data-path", "gpu"]
        return flags

    def ours(
        self,
        name: str,
        n: int,
        flags: list[str],
        probe: list[str] | None = None,
        timeout: float = 75,
        env: dict | None = None,
        launcher: str = "spawn",
    ) -> dict:
        """``hpc-ddp train`` under the probe: its workers forked as ``--nproc-per-node n`` does
        (launcher "spawn"), or one interpreter per worker under torchrun."""
        out = self.work / f"{name}.json"
        out.unlink(missing_ok=True)
        probe_cmd = [str(BENCH / "probe.py"), "--probe-json", str(out)]
        if launcher == "torchrun":
            cmd = [*self.torchrun(n), *probe_cmd]
        else:
            cmd = [PY, *probe_cmd, "--probe-nproc", str(n)]
        res = self.run(name, cmd + (probe or []) + ["--", *flags], timeout=timeout, env=env)
        if out.exists():
            res.update(json.loads(out.read_text()))
        return self.record(name, {"kind": "ours", "gpus": n, "launcher": launcher, **res})

    def plain(
        self, name: str, n: int, flags: list[str], timeout: float = 120, base: Path | None = None
    ) -> dict:
        """``hpc-ddp train --nproc-per-node n`` as a user types it (``flags`` from
        ``lenet_flags(..., plain=True)``): no probe; timed from the shell, its own figures from
        its result.json. ``base``: a directory holding another revision's ``hpc_ddp`` package,
        run from there (``python -m`` puts the working directory before PYTHONPATH)."""
        run_dir = Path(flags[flags.index("--run-dir") + 1])
        cmd = [*HPC_DDP, "train", "--nproc-per-node", str(n), *flags]
        env = {"PYTHONPATH": str(base)} if base is not None else None
        res = self.run(name, cmd, timeout=timeout, env=env, cwd=base or REPO)
        result = run_dir / "result.json"
        if res.get("rc") == 0 and result.exists():
            res["result"] = json.loads(result.read_text())
            # The shell's time outside train(): before it (interpreter, import torch, the forks)
            # and after result.json (the ranks' exit, the parent's wait): where a slower exit went.
            written = result.stat().st_mtime - res["t0"]
            res["outside_train_s"] = {
                "before": written - res["result"]["wall_seconds"],
                "after": res["wall_s"] - written,
            }
            from hpc_ddp.run_dir.paths import RunPaths

            # Each epoch's seconds and their split: where a slower repeat's time went.
            rows = RunPaths(run_dir).metrics.read_text().splitlines()
            res["epochs"] = [{k: json.loads(row)[k] for k in ("seconds", "time")} for row in rows]
        return self.record(name, {"kind": "plain", "gpus": n, "base": base and str(base), **res})

    def suite_plain(self) -> None:
        """The conventional script, then the plain default command --repeats times, on the
        most GPUs, in one call: the ratios users would measure themselves. ``--plain-base``:
        each repeat also with that revision, the order alternating (a drift of the machine
        lands on both sides)."""
        top = max(self.gpus)
        self.reference(f"plain_ref_ddp_{top}gpu", "ddp", top, 64)
        base = self.args.plain_base
        for i in range(1, self.args.repeats + 1):
            self.floor(f"floor_{top}gpu_r{i}", top)
            runs = [("", None)] + ([("_base", base)] if base is not None else [])
            for suffix, where in runs[:: 1 if i % 2 else -1]:
                flags = self.lenet_flags(f"plain{top}{suffix}r{i}", None, plain=True)
                self.plain(f"plain_lenet_{top}gpu{suffix}_r{i}", top, flags, base=where)
        self.floor(f"floor_{top}gpu_r{self.args.repeats + 1}", top)

    def floor(self, name: str, n: int) -> None:
        """``--floor SCRIPT``: the start-up floor (a measuring stick kept outside the project:
        interpreter, import torch, n forked ranks joining NCCL, one all-reduce) timed from the
        shell between the plain repeats, so that each run's exit target takes the floors beside
        it: ``import torch`` alone moves 3.0-4.4 s from run to run on one machine."""
        if self.args.floor is None:
            return
        res = self.run(name, [PY, str(self.args.floor), str(n), str(self.next_port())], 60)
        line = ""
        if res.get("rc") == 0:
            line = next(
                (x for x in Path(res["log"]).read_text().splitlines() if x.startswith("FLOOR")), ""
            )
        # FLOOR n=4 import_torch=3.03s first_allreduce_all_ranks=5.83s exit=6.30s ...
        fields = dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
        figures = {k: float(v.rstrip("s")) for k, v in fields.items() if v.endswith("s")}
        self.record(name, {"kind": "floor", "gpus": n, **res, "floor": figures})

    def lenet_flags(self, name: str, graphs: bool | None, *, plain: bool = False) -> list[str]:
        """The reference workload's flags; ``graphs`` True: ``--cuda-graphs`` with synchronous
        checkpoints (the rows measured before both became defaults), False: eager DDP, also
        synchronous, None: no step or checkpoint flag at all (the defaults). ``plain``: the
        workload's flags only, as a user would type them (no --log-every, --eval-batch-size)."""
        run_dir = self.work / "runs" / name
        flags = self.trainer_flags("lenet", self.args.epochs, 64, run_dir, plain=plain)
        flags += ["--optimizer", "adam", "--lr", "1e-3", "--weight-decay", "0"]
        flags += ["--lr-schedule", "constant", "--no-augment", "--amp", "off"]
        if not plain:
            flags += ["--eval-batch-size", "1024"]
        if graphs is None:
            return flags
        if self.args.smoke:  # a CPU has no step to capture: --cuda-graphs would be refused
            return [*flags, "--no-async-checkpoint"]
        return [*flags, "--cuda-graphs" if graphs else "--no-cuda-graphs", "--no-async-checkpoint"]

    def suite_ref(self) -> None:
        """Ours on every GPU count; the conventional script on the counts above 1 (``refx``
        has its slow 1-GPU run), the largest count first: the headline comparison. Before
        them, one run of ours that reads the CIFAR files for the first time (it writes the
        .npy cache the later runs read): what the first job on new data pays."""
        if not self.args.smoke:
            from hpc_ddp.train.fast.array_cache import CACHE_DIR

            shutil.rmtree(self.root / "cifar-100-python" / CACHE_DIR, ignore_errors=True)
            top = max(self.gpus)
            flags = self.lenet_flags(f"lenet{top}f", graphs=True)
            self.ours(f"ours_lenet_{top}gpu_first_read", top, flags)
        for n in sorted(self.gpus, reverse=True):
            if n > 1:
                self.reference(f"ref_ddp_{n}gpu", "ddp", n, 64)
            self.ours(f"ours_lenet_{n}gpu", n, self.lenet_flags(f"lenet{n}", graphs=True))
            if n == max(self.gpus):  # what a user types, beside the explicit --cuda-graphs
                self.ours(f"ours_lenet_{n}gpu_default", n, self.lenet_flags(f"lenet{n}d", None))
        top = max(self.gpus)
        flags = [*self.lenet_flags(f"lenet{top}a", True), "--async-checkpoint"]
        self.ours(f"ours_lenet_{top}gpu_async", top, flags)
        if self.args.lean:  # the variants below only explain; the headline rows are above
            return
        self.ours(f"ours_lenet_{top}gpu_eager", top, self.lenet_flags(f"lenet{top}e", False))
        flags = self.lenet_flags(f"lenet{top}t", True)
        self.ours(f"ours_lenet_{top}gpu_torchrun", top, flags, launcher="torchrun")

    def suite_ttfs(self) -> None:
        """Time to first step and command-to-exit of the headline run, several times over.
        ``--ttfs-ab``: each repeat also with ``--probe-store-backoff`` (ranks > 0 connect to
        rank 0's store at once and retry on TCPStore's backoff), the order alternating.
        ``--ttfs-eager``: each repeat also as eager DDP (``--no-cuda-graphs``), with the
        two-stage torch._dynamo prefetch and with the former one-stage one."""
        top = max(self.gpus)
        for i in range(1, self.args.repeats + 1):
            runs: list[tuple[str, list[str], list[str]]] = [("", [], [])]
            if self.args.ttfs_ab:
                runs.append(("_backoff", [], ["--probe-store-backoff"]))
            if self.args.ttfs_eager:
                eager = ["--no-cuda-graphs"]
                runs.append(("_eager", eager, []))
                runs.append(("_eager_onestage", eager, ["--probe-one-stage-prefetch"]))
            runs = runs[:: 1 if i % 2 else -1]
            for suffix, step, probe in runs:
                flags = [*self.lenet_flags(f"lenet{top}{suffix}r{i}", None), *step]  # defaults
                self.ours(f"ttfs_lenet_{top}gpu_async{suffix}_r{i}", top, flags, probe=probe)

    def suite_refx(self) -> None:
        top = max(self.gpus)
        self.reference("ref_ddp_1gpu", "ddp", 1, 64)
        self.reference(f"ref_dp_{top}gpu", "dp", top, 64 * top)
        if self.args.single:
            self.reference("ref_single_1gpu", "single", 1, 64 * top)
        if not self.args.lean:
            self.ours(f"ours_lenet_{top}gpu_again", top, self.lenet_flags(f"lenet{top}b", True))

    # -------------------------------------------------------------- scaling
    def resnet_flags(self, name: str, epochs: int) -> list[str]:
        flags = self.trainer_flags(
            "resnet18", epochs, self.args.resnet_batch, self.work / "runs" / name
        )
        flags += ["--optimizer", "sgd", "--lr", "0.05"]  # what the 2026-11-26 figures ran
        flags += ["--no-augment", "--eval-batch-size", "1024"]
        # Eager DDP and synchronous checkpoints unless a row asks otherwise (its flag comes
        # later and wins): what these rows measured before the defaults changed.
        flags += ["--no-cuda-graphs", "--no-async-checkpoint"]
        return flags + ([] if self.args.smoke else ["--amp", "bf16"])

    def resnet(
        self, name: str, n: int, *extra: str, probe: list[str] | None = None, launcher="spawn"
    ) -> dict:
        """ResNet-18 for ``--resnet-epochs`` on ``n`` GPUs under the probe, in its own run dir."""
        flags = [*self.resnet_flags(name, self.args.resnet_epochs), *extra]
        return self.ours(name, n, flags, probe=probe, timeout=180, launcher=launcher)

    def suite_scaling(self) -> None:
        """Eager DDP and the captured step (--cuda-graphs) on every GPU count, then the extras."""
        for n in self.gpus:
            self.resnet(f"resnet_{n}gpu", n)
            self.resnet(f"resnet_{n}gpu_graphs", n, "--cuda-graphs")
        top = max(self.gpus)
        self.resnet(f"resnet_{top}gpu_async", top, "--async-checkpoint")
        # The default step and checkpoints (captured, background): table d's stall by default.
        self.resnet(f"resnet_{top}gpu_default", top, "--cuda-graphs", "auto", "--async-checkpoint")
        if top > 1:  # table e: the all-reduce window, timed by the trainer's comm hook
            self.resnet(f"resnet_{top}gpu_timed", top, "--time-allreduce")
        if self.args.resnet_torchrun:  # the same run, one interpreter per worker
            self.resnet(f"resnet_{top}gpu_torchrun", top, launcher="torchrun")
        self.resnet("resnet_1gpu_noddp", 1, probe=["--probe-no-ddp"])

    def suite_weak(self) -> None:
        """ResNet-18 weak scaling as a user gets it (default flags: the captured step and
        background checkpoints chosen automatically), 1 GPU and the largest count alternating,
        ``--repeats`` times each: a drift of the machine lands on both sides, and the median
        with its spread tells a real gap from run-to-run noise."""
        top = max(self.gpus)
        for r in range(1, self.args.repeats + 1):
            for n in sorted({1, top}):
                self.resnet(f"weak_{n}gpu_r{r}", n, "--cuda-graphs", "auto", "--async-checkpoint")

    def suite_stall(self) -> None:
        """What a checkpoint costs on the wall clock, default flags: ResNet-18 and the reference
        LeNet on the largest GPU count, saving after every third epoch only
        (``--probe-save-every-epochs 3``), ``--repeats`` runs each. The epochs a save touches
        (its own, which ends with it, and the next, beside its background write) against the
        clean ones of the same run: report.table_stall."""
        top, every = max(self.gpus), ["--probe-save-every-epochs", str(STALL_EVERY)]
        each = ["--checkpoint-interval-s", "0"]  # the probe, not the saving policy, picks epochs
        for r in range(1, self.args.repeats + 1):
            flags = self.resnet_flags(f"stall_resnet{r}", STALL_EPOCHS_RESNET)
            flags += ["--cuda-graphs", "auto", "--async-checkpoint", *each]
            self.ours(f"stall_resnet18_{top}gpu_r{r}", top, flags, probe=every, timeout=180)
            flags = [*self.lenet_flags(f"stall_lenet{r}", None), *each]
            flags[flags.index("--epochs") + 1] = str(STALL_EPOCHS_LENET)
            self.ours(f"stall_lenet_{top}gpu_r{r}", top, flags, probe=every)

    def suite_ddpcost(self) -> None:
        """The DDP wrapper's cost at 1 GPU alone: bare model, DDP as the trainer builds it for
        jobs of several processes, DDP with torch's defaults (a job of one process wraps none:
        the probe's --probe-ddp-of-one puts it back); ``--ddpcost-extras``: with the all-reduce
        timing hook, with torch.optim's own classes."""
        one = ["--probe-ddp-of-one"]
        self.resnet("resnet_1gpu_noddp", 1, probe=["--probe-no-ddp"])
        self.resnet("resnet_1gpu", 1, probe=one)
        self.resnet("resnet_1gpu_ddpdefaults", 1, probe=[*one, "--probe-ddp-defaults"])
        if self.args.ddpcost_extras:
            self.resnet("resnet_1gpu_timed", 1, "--time-allreduce", probe=one)
            self.resnet("resnet_1gpu_stockopt", 1, probe=[*one, "--probe-stock-optimizer"])

    def suite_eager(self) -> None:
        """Eager DDP alone on every GPU count above 1 (scaling's eager rows, without the rest)."""
        for n in (g for g in self.gpus if g > 1):
            self.resnet(f"resnet_{n}gpu", n)

    def suite_resume(self) -> None:
        """Preempt at a step mid-epoch 2 with SIGUSR1, then run the same command again."""
        n = max(self.gpus)
        name = f"resnet{n}r"
        flags = self.resnet_flags(name, self.args.resnet_epochs)
        hold = ["--debug-hold-at-step", str(self.args.resume_hold_step)]
        run_dir = self.work / "runs" / name
        progress = run_dir / "progress.json"

        def signal_when_holding() -> None:
            deadline = time.monotonic() + 150
            while time.monotonic() < deadline:
                try:
                    info = json.loads(progress.read_text())
                except (OSError, ValueError):
                    info = {}
                if info.get("status") == "holding":
                    for pid in info.get("pids", []):
                        os.kill(pid, signal.SIGUSR1)
                    return
                time.sleep(0.05)  # polling a file the trainer rewrites; bounded by the deadline

        import threading

        waiter = threading.Thread(target=signal_when_holding, daemon=True)
        waiter.start()
        first = self.ours(f"resume_{n}gpu_first", n, flags + hold, timeout=180)
        waiter.join(timeout=1)
        second = self.ours(f"resume_{n}gpu_second", n, flags, timeout=180)
        uninterrupted = self.results["runs"].get(f"resnet_{n}gpu", {}).get("result", {})
        self.record(
            f"resume_{n}gpu",
            {
                "kind": "resume",
                "first_exit": first.get("exit_code", first.get("rc")),
                "second_exit": second.get("exit_code", second.get("rc")),
                "resume_ttfs": second.get("ttfs"),
                "sha_resumed": second.get("result", {}).get("params_sha256"),
                "sha_uninterrupted": uninterrupted.get("params_sha256"),
            },
        )

    # ----------------------------------------------------------------- nccl
    def torchrun_script(self, kind: str, script: str, n: int, timeout: float) -> None:
        """``script --json OUT`` under torchrun on ``n`` GPUs, its JSON merged into the record."""
        out = self.work / f"{kind}_{n}.json"
        out.unlink(missing_ok=True)  # a warm machine's earlier call must not lend its figures
        cmd = [*self.torchrun(n), str(BENCH / script), "--json", str(out)]
        res = self.run(f"{kind}_{n}gpu", cmd, timeout=timeout)
        if out.exists():
            res.update(json.loads(out.read_text()))
        self.record(f"{kind}_{n}gpu", {"kind": kind, "gpus": n, **res})

    def suite_nccl(self) -> None:
        for n in sorted({max(self.gpus), 2} & set(range(2, 9))):
            if n <= max(self.gpus):
                self.torchrun_script("nccl", "nccl_bench.py", n, timeout=120)

    # ---------------------------------------------------------------- tests
    def suite_tests(self) -> None:
        """tests/test_gpu.py (``--tests-k`` selects), each test bounded by pytest-timeout."""
        cmd = [PY, "-m", "pytest", "-q", "-rs", "tests/test_gpu.py", "--timeout", "100"]
        cmd += ["--junitxml", str(self.out / "gpu_tests.xml")]
        if self.args.tests_k:
            cmd += ["-k", self.args.tests_k]
        res = self.run("gpu_tests", cmd, timeout=self.args.tests_timeout)
        log = Path(res.get("log", "/nonexistent"))
        if log.exists():
            res["summary"] = log.read_text(errors="replace").strip().splitlines()[-1:]
        self.record("gpu_tests", {"kind": "tests", **res})

    # -------------------------------------------------------------- profile
    def suite_profile(self) -> None:
        for n in sorted({min(self.gpus), max(self.gpus)}):
            self.torchrun_script("profile", "step_profile.py", n, timeout=150)

    # ---------------------------------------------------------------- main
    def main(self) -> None:
        self.gpus = sorted(int(g) for g in self.args.gpus.split(","))
        self.stage()
        suites = {
            "ref": self.suite_ref,
            "scaling": self.suite_scaling,
            "ddpcost": self.suite_ddpcost,
            "weak": self.suite_weak,
            "stall": self.suite_stall,
            "eager": self.suite_eager,
            "resume": self.suite_resume,
            "nccl": self.suite_nccl,
            "refx": self.suite_refx,
            "ttfs": self.suite_ttfs,
            "plain": self.suite_plain,
            "profile": self.suite_profile,
            "tests": self.suite_tests,
        }
        for name in self.args.suites.split(","):
            t0 = time.time()
            suites[name]()
            print(f"[bench] suite {name} done in {time.time() - t0:.0f} s", flush=True)
        self.save()
        from report import tables  # benchmarks/report.py

        text = tables(self.results)
        (self.out / "tables.md").write_text(text)
        print(text, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="1,2,4", help="GPU counts to run, e.g. 1,2,4,8")
    parser.add_argument("--suites", default="ref,scaling,nccl,profile,resume")
    parser.add_argument("--tests-k", default="", help="pytest -k expression for the tests suite")
    parser.add_argument("--tests-timeout", type=float, default=200)
    parser.add_argument("--single", action="store_true", help="refx: also the 1-GPU no-DDP run")
    parser.add_argument("--lean", action="store_true", help="ref/refx: headline rows only")
    parser.add_argument("--out", required=True, help="bench.json, tables.md and logs go here")
    parser.add_argument("--work", default="/tmp/hpc-ddp-bench", help="data and run dirs")
    parser.add_argument("--epochs", type=int, default=10, help="reference workload epochs")
    parser.add_argument("--train-size", type=int, default=50_000)
    parser.add_argument("--test-size", type=int, default=10_000)
    parser.add_argument(
        "--synthetic-variant",
        choices=("easy", "hard"),
        default="hard",
        help="synthetic data for every run: hard (LeNet does not saturate, so accuracies can be "
        "compared) or easy (learnt in an epoch)",
    )
    parser.add_argument("--ddpcost-extras", action="store_true", help="ddpcost: 2 more runs")
    parser.add_argument(
        "--plain-base",
        type=lambda text: Path(text).resolve(),
        help="plain: also run the revision whose hpc_ddp/ is in this directory, alternating "
        "(e.g. git archive REV hpc_ddp | tar -x -C DIR)",
    )
    parser.add_argument(
        "--floor",
        type=lambda text: Path(text).resolve(),
        help="plain: the start-up floor script (startup_floor.py NPROC PORT, kept outside the "
        "project), run before each repeat and after the last",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="ttfs, plain: runs of the headline; weak: runs per GPU count",
    )
    parser.add_argument(
        "--ttfs-ab", action="store_true", help="ttfs: each repeat also on TCPStore's backoff"
    )
    parser.add_argument(
        "--ttfs-eager",
        action="store_true",
        help="ttfs: each repeat also as eager DDP, with the two-stage and one-stage prefetch",
    )
    parser.add_argument("--resnet-batch", type=int, default=256, help="per GPU")
    parser.add_argument("--resnet-epochs", type=int, default=5)
    parser.add_argument("--resnet-torchrun", action="store_true", help="scaling: + torchrun row")
    parser.add_argument(
        "--resume-hold-step",
        type=int,
        default=0,
        help="global step to preempt at (0: the middle of epoch 2)",
    )
    parser.add_argument("--ref-timeout", type=float, default=200)
    parser.add_argument("--budget-s", type=float, default=560, help="stop starting runs after")
    parser.add_argument("--smoke", action="store_true", help="CPU plumbing check (Gloo, tiny)")
    args = parser.parse_args()
    if args.resume_hold_step == 0:
        top = max(int(g) for g in args.gpus.split(","))
        steps = args.train_size // (args.resnet_batch * top)
        args.resume_hold_step = steps + max(steps // 2, 1)
    sys.path.insert(0, str(BENCH))
    Bench(args).main()


if __name__ == "__main__":
    main()
