"""The committed GPU jobs under a real Slurm on a GPU machine, in one command.

    python3 benchmarks/slurm_gpu.py --debs DIR --out OUT

On a machine with N NVIDIA GPUs and no Slurm (and no network): unpack Debian's Slurm and munge
packages from DIR (``dpkg -x``; library packages only for what the machine lacks), start the
embedded cluster on them with the real GPUs in GRES (``hpc-ddp cluster up --slurm-root
--gpu-devices auto --cgroups``; without cgroups if they fail, saying why), then submit the
committed 2 x 8 GPU specs scaled to 1 node x N GPUs with ``hpc-ddp render`` overrides and
``hpc-ddp submit``: one process per GPU with --gpus-per-node and with --gpus-per-task, torchrun
per node, one process driving all N GPUs. Each trains ResNet-18 (synthetic CIFAR-10, NCCL,
deterministic kernels) for a few epochs. Then two jobs are preempted with ``scancel
--signal=USR1`` (to the tasks, and ``--batch`` to the batch shell for torchrun) and must end,
requeued and resumed, with the uninterrupted run's weights. Prints tables; writes
OUT/slurm_gpu.json, OUT/report.md and OUT/logs.tar.gz.

``--smoke`` rehearses all of it on a CPU machine: fake GPU device files, LeNet, tiny data.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import slurm_gpu_report as report
import slurm_gpu_setup as setup

from hpc_ddp.deploy import build_spec
from hpc_ddp.localslurm import LocalCluster, wait_for

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "hpc_ddp.cli"]
PER_TASK = ["--gpu-binding", "gpus-per-task"]
# id: (committed spec, render overrides beyond the shape, preemption scancel flags, extra env)
LAYOUTS: dict[str, tuple[str, list[str], list[str], dict[str, str]]] = {
    "gpus-per-node": ("cifar_2x8.toml", [], [], {}),
    "gpus-per-task": ("cifar_2x8.toml", PER_TASK, [], {}),
    "torchrun": ("cifar_torchrun_2x8.toml", [], ["--batch"], {}),
    "one-process": ("cifar_pernode_2x8.toml", [], [], {}),
    # Diagnostics for --gpus-per-task under device cgroups (each process sees one GPU):
    # NCCL's intra-node transports without P2P, or P2P through the legacy CUDA IPC.
    "gpus-per-task+NCCL_P2P_DISABLE": ("cifar_2x8.toml", PER_TASK, [], {"NCCL_P2P_DISABLE": "1"}),
    "gpus-per-task+NCCL_CUMEM_ENABLE=0": (
        "cifar_2x8.toml",
        PER_TASK,
        [],
        {"NCCL_CUMEM_ENABLE": "0"},
    ),
}
MAIN = "gpus-per-node,gpus-per-task,torchrun,one-process"
_SUBMITTED = re.compile(r"submitted job (\d+)")


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = args.out.absolute()
        self.work = args.work.absolute()
        self.deadline = time.monotonic() + args.budget_s
        self.results: dict = {"layouts": {}, "preemptions": {}, "notes": []}
        self.env: dict[str, str] = {}
        self.gpus = 0

    # --- the machine and the cluster ------------------------------------------------------
    def setup(self) -> None:
        a = self.args
        self.results["machine"] = setup.machine_facts()
        if a.debs:
            unpacked = setup.unpack_slurm(a.debs.absolute(), a.slurm_root)
            self.results["unpack"] = unpacked
        install = setup.SlurmInstall(str(a.slurm_root))
        self.results["versions"] = setup.versions(install)
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        devices = self._fake_devices() if a.smoke else "auto"
        cores = os.cpu_count() or 1
        self.node_cpus = a.cpus_per_node or cores
        up = [*CLI, "cluster", "up", "--dir", str(a.cluster_dir), "--nodes", "1"]
        up += ["--cpus-per-node", str(self.node_cpus), "--gpu-devices", devices]
        up += ["--slurm-root", str(a.slurm_root), "--timeout", "60"]
        tries = (
            [["--cgroups"], []] if a.cgroups == "auto" else [["--cgroups"] * (a.cgroups == "on")]
        )
        for extra in tries:
            proc = setup.run([*up, *extra], env=self._base_env())
            said = (proc.stdout + proc.stderr).strip()
            self.results["cluster_up"] = {"argv": [*up[3:], *extra], "rc": proc.returncode}
            self.results["cluster_up"]["output"] = said
            print(f"$ hpc-ddp {' '.join([*up[3:], *extra])}\n{said}", flush=True)
            if proc.returncode == 0:
                # A step that gets a GPU: cgroup trouble (device rules, scopes) shows here.
                env = {**self._base_env(), **LocalCluster.attach(a.cluster_dir).env()}
                step = setup.run(["srun", "-N1", "-n1", "--gpus=1", "true"], env=env, timeout=60)
                self.results["cluster_up"]["first_step_rc"] = step.returncode
                if step.returncode == 0:
                    break
                said = f"srun of a 1-GPU step failed ({step.returncode}): {step.stderr.strip()}"
                said += "\n" + "\n".join(self._log_errors())
            how = " ".join(extra) or "without cgroups"
            self.results["notes"].append(f"cluster up {how} failed: {said}")
            setup.run([*CLI, "cluster", "down", "--dir", str(a.cluster_dir)], env=self._base_env())
        else:
            raise RuntimeError("the cluster did not start: see the notes above")
        cluster = LocalCluster.attach(a.cluster_dir)
        self.results["cgroups"] = cluster.config.cgroups
        self.gpus = cluster.config.gpus_per_node
        self.env = {**self._base_env(), **cluster.env()}
        # The specs' setup line `source .venv/bin/activate` runs as committed: the job's .venv
        # is this interpreter's environment (the image's venv), linked into the work dir.
        venv = Path(sys.prefix)
        if (venv / "bin" / "activate").exists():
            (self.work / ".venv").symlink_to(venv)
        else:
            setup.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                       str(self.work / ".venv")])  # fmt: skip
        self._write_data()

    def _log_errors(self, last: int = 15) -> list[str]:
        """The daemons' error lines (slurmstepd logs into slurmd's file)."""
        lines = []
        for log in sorted((self.args.cluster_dir / "log").glob("*.log")):
            text = log.read_text(errors="replace").splitlines()
            lines += [f"{log.name}: {ln}" for ln in text if "error" in ln and "pmix" not in ln]
        return lines[-last:]

    def _base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env.setdefault("NCCL_NVLS_ENABLE", "0")  # this workplace's rule for its GPU hosts
        return env

    def _fake_devices(self) -> str:
        dev = self.work.parent / f"{self.work.name}-dev"
        shutil.rmtree(dev, ignore_errors=True)
        dev.mkdir(parents=True)
        for i in range(self.args.smoke_gpus):
            os.mknod(dev / f"nvidia{i}", 0o666 | 0o020000, os.makedev(240, i))
        return ",".join(str(dev / f"nvidia{i}") for i in range(self.args.smoke_gpus))

    def _write_data(self) -> None:
        from hpc_ddp.train.cifar import synthetic

        a = self.args
        root = synthetic.synthetic_root(self.work / "data", "cifar10", a.train_size, a.test_size)
        started = time.monotonic()
        synthetic.write_synthetic(root, "cifar10", train_size=a.train_size, test_size=a.test_size)
        self.results["data_seconds"] = round(time.monotonic() - started, 2)

    # --- what Slurm gives each task ---------------------------------------------------------
    def binding_check(self) -> None:
        """One srun per binding: each task's CUDA_VISIBLE_DEVICES, the GPUs CUDA shows it and
        which /dev/nvidiaN it may open (cgroups deny the others)."""
        code = (
            "import os, torch\n"
            "n = torch.cuda.device_count()\n"
            "ids = [str(torch.cuda.get_device_properties(i).uuid)[:12] for i in range(n)]\n"
            "opened = []\n"
            f"for i in range({self.gpus}):\n"
            "    try:\n        os.close(os.open(f'/dev/nvidia{i}', os.O_RDWR)); opened.append(i)\n"
            "    except OSError:\n        pass\n"
            "print(f\"task {os.environ['SLURM_PROCID']}: CUDA_VISIBLE_DEVICES=\"\n"
            "      f\"{os.environ.get('CUDA_VISIBLE_DEVICES', '-')} cuda_devices={n} \"\n"
            "      f\"uuid={','.join(ids) or '-'} may_open=/dev/nvidia{opened}\", flush=True)\n"
        )
        n = str(self.gpus)
        shapes = {"gpus-per-task": ["-n", n, "--gpus-per-task=1"],
                  "gpus-per-node": ["-n", n, f"--gpus-per-node={n}"]}  # fmt: skip
        checks = {}
        for name, shape in shapes.items():
            argv = ["srun", "-N1", *shape, sys.executable, "-c", code]
            proc = setup.run(argv, env=self.env, cwd=self.work, timeout=120)
            checks[name] = sorted((proc.stdout + proc.stderr).strip().splitlines())
            print(f"binding check, {name}:", *checks[name], sep="\n  ", flush=True)
        self.results["binding_check"] = checks

    # --- the jobs ---------------------------------------------------------------------------
    def render(self, layout: str, script: Path, run_dir: str, extra_args: list[str]) -> list[str]:
        spec_file, flags, _, extra_env = LAYOUTS[layout]
        spec_path = REPO / "jobs" / "specs" / spec_file
        spec = build_spec(spec_path)
        g = self.gpus
        shape = ["--nodes", "1", "--gpus-per-node", str(g), *flags]
        train_extra: list[str] = []
        if spec.gpus_per_process > 1:  # the one-process layout: it drives all of the node's GPUs
            shape += ["--gpus-per-process", str(g)]
            train_extra += ["--gpus-per-process", str(g)]
        procs = 1 if spec.gpus_per_process > 1 else g
        env = {**spec.env, **extra_env}
        if "NCCL_SOCKET_IFNAME" in spec.env and self._loopback_only():
            # '^lo,...' leaves NCCL's bootstrap no interface on a machine that has only lo.
            env["NCCL_SOCKET_IFNAME"] = "lo"
        if env != spec.env:
            shape += [f"--env={k}={v}" for k, v in env.items()]
        if spec.cpus_per_task * procs > self.node_cpus:
            shape += ["--cpus-per-task", str(max(1, self.node_cpus // procs))]
        a = self.args
        data = ["--synthetic", "--data-dir", "data", "--synthetic-train-size", str(a.train_size),
                "--synthetic-test-size", str(a.test_size)]  # fmt: skip
        train = [*data, "--epochs", str(a.epochs), "--run-dir", run_dir, "--deterministic"]
        train += ["--log-every", "10", *train_extra, *a.smoke_args, *extra_args]
        # The spec's own arguments first: the trainer's parser keeps the last value of a flag.
        argv = [*CLI, "render", "--config", str(spec_path), *shape, "--script-out", str(script)]
        argv += ["--force", "--", *spec.args, *train]
        proc = setup.run(argv, env=self.env, cwd=self.work)
        if proc.returncode:
            raise RuntimeError(f"render {layout}: {proc.stdout}{proc.stderr}")
        return [*shape, "--", "<spec args>", *train]

    def _loopback_only(self) -> bool:
        return self.results["machine"]["interfaces"] == ["lo"]

    def submit(self, script: Path, log: Path) -> subprocess.Popen:
        timeout = max(30, int(self.deadline - time.monotonic()))
        argv = [*CLI, "submit", str(script), "--wait-timeout", str(timeout)]
        with open(log, "w") as sink:
            return subprocess.Popen(argv, env=self.env, cwd=self.work, stdout=sink,
                                    stderr=subprocess.STDOUT, text=True)  # fmt: skip

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def restart_without_cgroups(self) -> None:
        a = self.args
        setup.run([*CLI, "cluster", "down", "--dir", str(a.cluster_dir)], env=self.env)
        argv = [*CLI, *self.results["cluster_up"]["argv"]]
        argv = [x for x in argv if x != "--cgroups"]
        proc = setup.run(argv, env=self._base_env())
        print(f"$ hpc-ddp {' '.join(argv[3:])}\n{proc.stdout}{proc.stderr}", flush=True)
        self.results["cluster_up_without_cgroups"] = {"rc": proc.returncode}
        if proc.returncode:
            raise RuntimeError(f"cluster up without cgroups: {proc.stdout}{proc.stderr}")
        self.env = {**self._base_env(), **LocalCluster.attach(a.cluster_dir).env()}

    def run_layout(self, layout: str, key: str | None = None) -> None:
        key = key or layout
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", key).strip("-")
        script = self.work / f"{slug}.sbatch"
        run_dir = f"runs/{slug}"
        overrides = self.render(layout, script, run_dir, [])
        log = self.work / f"{slug}.submit.log"
        started = time.monotonic()
        proc = self.submit(script, log)
        proc.wait(timeout=max(30, self.deadline - time.monotonic()) + 30)
        entry = report.parse_job(log.read_text(), self.work / run_dir, proc.returncode)
        entry.update(wall_s=round(time.monotonic() - started, 1), overrides=overrides,
                     directives=report.directives(script.read_text()))  # fmt: skip
        self.results["layouts"][key] = entry
        print(report.layout_line(key, entry), flush=True)

    def preempt(self, layout: str) -> None:
        """Hold the job at step K of epoch 2, signal it, follow it through requeue and resume."""
        straight = self.results["layouts"].get(layout, {}).get("result", {})
        if not straight.get("steps"):
            self.results["preemptions"][layout] = {"skipped": "the uninterrupted run failed"}
            return
        per_epoch = straight["steps"] // self.args.epochs
        if per_epoch < 2 or self.args.epochs < 2:  # the trainer never holds at an epoch's end
            self.results["preemptions"][layout] = {"skipped": "needs 2+ epochs of 2+ steps"}
            return
        hold = per_epoch + per_epoch // 2  # half-way through epoch 2
        script, run_dir = self.work / f"{layout}-preempt.sbatch", f"runs/{layout}-preempt"
        self.render(layout, script, run_dir, ["--debug-hold-at-step", str(hold)])
        log = self.work / f"{layout}-preempt.submit.log"
        proc = self.submit(script, log)
        progress = self.work / run_dir / "progress.json"

        def holding() -> bool:
            if proc.poll() is not None:
                return True  # ended without holding: stop waiting, report below
            try:
                return json.loads(progress.read_text()).get("status") == "holding"
            except (OSError, ValueError):
                return False

        wait_for(holding, max(30, self.deadline - time.monotonic()), "the hold step")
        job = _SUBMITTED.search(log.read_text())
        flags = LAYOUTS[layout][2]
        argv = ["scancel", "--signal=USR1", *flags, job.group(1) if job else "?"]
        signalled = setup.run(argv, env=self.env)
        proc.wait(timeout=max(30, self.deadline - time.monotonic()) + 30)
        entry = report.parse_job(log.read_text(), self.work / run_dir, proc.returncode)
        entry.update(hold_step=hold, scancel=" ".join(argv[:-1]), scancel_rc=signalled.returncode,
                     same_weights=entry.get("result", {}).get("params_sha256")
                     == straight.get("params_sha256"))  # fmt: skip
        self.results["preemptions"][layout] = entry
        print(report.preempt_line(layout, entry), flush=True)

    # --- the end ----------------------------------------------------------------------------
    def finish(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        logs = self.out / "logs.tar.gz"
        with tarfile.open(logs, "w:gz") as tar:
            for pattern in ("*.out", "*.sbatch", "*.submit.log", "runs/*/result.json"):
                for path in sorted(self.work.glob(pattern)):
                    tar.add(path, arcname=f"work/{path.relative_to(self.work)}")
            cluster_log = self.args.cluster_dir / "log"
            for path in sorted(cluster_log.glob("*")) if cluster_log.exists() else []:
                tar.add(path, arcname=f"cluster-log/{path.name}")
        setup.run([*CLI, "cluster", "down", "--dir", str(self.args.cluster_dir)], env=self.env)
        (self.out / "slurm_gpu.json").write_text(json.dumps(self.results, indent=2))
        text = report.markdown(self.results)
        (self.out / "report.md").write_text(text)
        print(text, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--debs", type=Path, help="folder of the .deb files to unpack")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--slurm-root", type=Path, default=Path("/tmp/hpc-ddp-slurm-root"))
    p.add_argument("--cluster-dir", type=Path, default=Path("/tmp/hpc-ddp-gpu-cluster"))
    p.add_argument("--work", type=Path, default=Path("/tmp/hpc-ddp-gpu-work"))
    p.add_argument("--cgroups", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--cpus-per-node", type=int, default=0, help="default: this machine's cores")
    p.add_argument("--layouts", default=MAIN)
    p.add_argument("--diagnose", default=",".join(k for k in LAYOUTS if "+" in k),
                   help="more layouts, run last while time is left")  # fmt: skip
    p.add_argument("--without-cgroups", default="gpus-per-task",
                   help="then restart the cluster without cgroups and run these again")  # fmt: skip
    p.add_argument("--preempt", default="gpus-per-node,torchrun")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--train-size", type=int, default=20000)
    p.add_argument("--test-size", type=int, default=2000)
    p.add_argument("--budget-s", type=float, default=500, help="stop starting jobs after this")
    p.add_argument("--smoke", action="store_true", help="CPU rehearsal: fake GPUs, LeNet")
    p.add_argument("--smoke-gpus", type=int, default=2)
    args = p.parse_args()
    args.smoke_args = ["--model", "lenet"] if args.smoke else []
    bench = Bench(args)
    try:
        bench.setup()
        if not args.smoke:
            bench.binding_check()
        for layout in filter(None, args.layouts.split(",")):
            bench.run_layout(layout)
        for layout in filter(None, args.preempt.split(",")):
            bench.preempt(layout)
        for layout in filter(None, args.diagnose.split(",")):
            if bench.time_left() > 60:
                bench.run_layout(layout)
        if args.without_cgroups and bench.results.get("cgroups") and bench.time_left() > 60:
            bench.restart_without_cgroups()
            for layout in filter(None, args.without_cgroups.split(",")):
                bench.run_layout(layout, key=f"{layout} (no cgroups)")
    except Exception as err:  # keep what was measured, and say what broke
        bench.results["notes"].append(f"stopped: {type(err).__name__}: {err}")
        print(f"stopped: {type(err).__name__}: {err}", flush=True)
    finally:
        bench.finish()


if __name__ == "__main__":
    main()
