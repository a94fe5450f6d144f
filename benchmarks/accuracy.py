"""Final test accuracy of the conventional script and of hpc-ddp over several seeds, same data.

    PYTHONPATH=$PWD python3 benchmarks/accuracy.py --seeds 0,1,2 --out OUT [--cpu]

One process each (batch 64, Adam 1e-3, 10 epochs, CIFAR-100 LeNet on the hard synthetic files):
the question is whether the two scripts learn alike, which one run per script cannot answer when
one run's accuracy swings by points from epoch to epoch. On a GPU machine the seeds run side by
side, one per GPU (``--parallel``, default: as many as GPUs; ``--per-gpu K``: K runs share each
GPU, for more seeds in one call). ``--cpu`` runs both on the CPU
(Gloo), one at a time, where the algorithm is the same and no GPU time is needed. Writes
OUT/accuracy.json and prints mean and spread per script.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TRAIN, TEST = 50_000, 10_000


def run_side_by_side(
    jobs: list[tuple[list[str], Path]], slots: int, cpu: bool, gpus: int = 1
) -> None:
    """Run the commands, ``slots`` at a time, slot i on GPU i % ``gpus`` (several a GPU when
    ``slots`` exceeds it: the conventional script is bound by its host's data pipeline)."""
    for first in range(0, len(jobs), slots):
        running: list[tuple[subprocess.Popen[Any], list[str], Path]] = []
        for slot, (cmd, log) in enumerate(jobs[first : first + slots]):
            gpu = {"CUDA_VISIBLE_DEVICES": str(slot % gpus)}
            env = dict(os.environ) if cpu else {**os.environ, **gpu}
            with log.open("w") as fh:
                proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=env)
            running.append((proc, cmd, log))
        for proc, cmd, log in running:
            if proc.wait() != 0:
                raise SystemExit(f"{' '.join(cmd)} failed (rc {proc.returncode}); see {log}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", default="/tmp/hpc-ddp-accuracy")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--parallel", type=int, default=0, help="runs at once (0: one per GPU)")
    parser.add_argument("--per-gpu", type=int, default=1, help="runs a GPU takes at once")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from hpc_ddp.train.cifar import synthetic

    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = work / "data"
    root = synthetic.synthetic_root(data_dir, "cifar100", TRAIN, TEST, variant="hard")
    if not synthetic.is_current(root, "cifar100", TRAIN, TEST, 1234, variant="hard"):
        synthetic.write_synthetic(
            root, "cifar100", train_size=TRAIN, test_size=TEST, variant="hard"
        )
    seeds = [int(s) for s in args.seeds.split(",")]
    refs, ours = [], []
    for seed in seeds:
        cmd = [sys.executable, str(REPO / "benchmarks" / "reference_ddp.py"), "--data", str(root)]
        cmd += ["--mode", "ddp", "--gpus", "1", "--epochs", str(args.epochs), "--seed", str(seed)]
        cmd += ["--port", str(29700 + seed), "--json", str(work / f"ref{seed}.json")]
        refs.append((cmd + (["--cpu"] if args.cpu else []), out / f"ref{seed}.log"))

        run_dir = work / f"ours{seed}"
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [sys.executable, "-m", "hpc_ddp.train", "--synthetic", "--synthetic-variant", "hard"]
        cmd += ["--dataset", "cifar100", "--data-dir", str(data_dir)]
        cmd += ["--synthetic-train-size", str(TRAIN), "--synthetic-test-size", str(TEST)]
        cmd += ["--model", "lenet", "--optimizer", "adam", "--lr", "1e-3", "--weight-decay", "0"]
        cmd += ["--lr-schedule", "constant", "--no-augment", "--amp", "off", "--batch-size", "64"]
        cmd += ["--epochs", str(args.epochs), "--seed", str(seed), "--run-dir", str(run_dir)]
        cmd += ["--log-every", "100000"] + ([] if args.cpu else ["--cuda-graphs"])
        ours.append((cmd, out / f"ours{seed}.log"))
    gpus = 1 if args.cpu else _gpu_count()
    slots = args.parallel or (1 if args.cpu else gpus * max(args.per_gpu, 1))
    run_side_by_side(refs + ours, slots, args.cpu, gpus)
    results: dict[str, list[float]] = {
        "conventional": [
            json.loads((work / f"ref{s}.json").read_text())["test_accuracy"] for s in seeds
        ],
        "hpc-ddp": [
            json.loads((work / f"ours{s}" / "result.json").read_text())["test_accuracy"]
            for s in seeds
        ],
    }
    for seed, ref, our in zip(seeds, results["conventional"], results["hpc-ddp"], strict=True):
        print(f"seed {seed}: conventional {ref:.4f}, hpc-ddp {our:.4f}", flush=True)
    summary = {
        name: {
            "accuracies": accs,
            "mean": statistics.mean(accs),
            "stdev": statistics.stdev(accs) if len(accs) > 1 else None,
        }
        for name, accs in results.items()
    }
    (out / "accuracy.json").write_text(json.dumps({"cpu": args.cpu, **summary}, indent=1))
    for name, s in summary.items():
        spread = f" +- {s['stdev']:.4f}" if s["stdev"] is not None else ""
        print(f"{name}: {s['mean']:.4f}{spread} over {len(s['accuracies'])} seeds")


def _gpu_count() -> int:
    import torch

    return max(torch.cuda.device_count(), 1)


if __name__ == "__main__":
    main()
