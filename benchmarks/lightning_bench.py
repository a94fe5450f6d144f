#!/usr/bin/env python3
"""ResNet-18 side by side: a bare loop, ``hpc-ddp train`` and Lightning's Trainer, on the same
model, data, precision and GPUs. Lightning is a benchmark dependency only (carried to the GPU
machine as wheels, benchmarks/issue36_call.sh); nothing in hpc_ddp imports it.

Each measurement runs its command as a child process and times it from start to exit
(command-to-exit), then reads the steady samples/s (the median of the epochs after the first):

    lightning_bench.py --trainer bare      --data cifar  --root DIR --json OUT   # 1 GPU
    lightning_bench.py --trainer ours      --data folder --root DIR --gpus 2 --json OUT
    lightning_bench.py --trainer lightning --data folder --root DIR --gpus 2 --json OUT
    lightning_bench.py --summary OUTDIR    # summary.md from the JSON files in OUTDIR

- the model: the trainer's own ResNet-18, imported through its registry
  (``hpc_ddp.train.registry.resolve("model", "resnet18")``, what ``--model resnet18`` builds);
- the data: ``cifar`` = synthetic CIFAR-100 files in CIFAR's on-disk format, as ``hpc-ddp
  train --synthetic --data-dir ROOT`` writes and reads them (50,000 / 10,000), held in
  memory; ``folder`` = an image folder (``--root`` holds train/ and test/, written by
  ``python -m hpc_ddp.train.image_synthetic``);
- Lightning: DDP (one process per GPU), ``bf16-mixed``, DataLoaders with 8 workers (pinned,
  persistent), random crop (pad size/8) + horizontal flip + normalise as torchvision transforms
  in the workers, SGD 0.05 momentum 0.9, evaluation of the test split after each epoch;
- ours: ``hpc-ddp train --nproc-per-node N --model resnet18`` with default flags (its data path,
  loader and step chosen by itself), the same batch, optimizer, epochs;
- bare: forward + backward + SGD of the same model on one GPU, on a batch already there, no
  augmentation, no DDP, bf16 autocast; NCHW, channels_last, and through ``hpc_ddp.speed_up``.

Every child prints one ``RESULT {json}`` line; ``--json`` gets the merged record. ``--cpu`` runs
all of it on the CPU (Gloo, a few samples): a check that the scripts work, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MEAN = {"cifar": (0.5071, 0.4865, 0.4409), "folder": (0.485, 0.456, 0.406)}
STD = {"cifar": (0.2673, 0.2564, 0.2762), "folder": (0.229, 0.224, 0.225)}


def _steady(epochs_s: list[float], samples: int) -> float | None:
    """Median samples/s over the epochs after the first (CUDA's first use, workers' start)."""
    later = epochs_s[1:] or epochs_s
    return samples / statistics.median(later) if later else None


# ------------------------------------------------------------------------------- children


def _model_name(name: str) -> str:
    """``--model`` as the trainer takes it from any directory: a plug-in file made absolute."""
    return str(REPO / name) if ":" in name else name


def _model(name: str, num_classes: int):
    """A registered model (``resnet18``) or a plug-in ``FILE.py:FUNCTION``, built as the trainer
    builds it (its registry, its plug-in loader)."""
    from hpc_ddp.train import registry

    return registry.resolve("model", _model_name(name))(num_classes)


def _datasets(args: argparse.Namespace):
    """(train, test, num_classes) as a Lightning user would write them (torchvision)."""
    import torch
    from torchvision.transforms import v2 as T

    mean, std = MEAN[args.data], STD[args.data]
    if args.data == "cifar":
        from hpc_ddp.train.cifar.data import read_arrays

        ((x, y), (tx, ty)), num_classes = read_arrays("cifar100", cifar_root(args))
        size = 32
        aug = T.Compose([T.RandomCrop(size, padding=size // 8), T.RandomHorizontalFlip(),
                         T.ToDtype(torch.float32, scale=True), T.Normalize(mean, std)])  # fmt: skip
        plain = T.Compose([T.ToDtype(torch.float32, scale=True), T.Normalize(mean, std)])

        class Arrays(torch.utils.data.Dataset):
            def __init__(self, x, y, transform):
                self.x, self.y, self.transform = x, y, transform

            def __len__(self):
                return len(self.y)

            def __getitem__(self, i):
                return self.transform(self.x[i]), int(self.y[i])

        return Arrays(x, y, aug), Arrays(tx, ty, plain), num_classes
    from torchvision.datasets import ImageFolder

    root = Path(args.root)
    first = next((root / "train").glob("*/*"))
    from PIL import Image

    with Image.open(first) as im:
        size = im.size[0]
    aug = T.Compose([T.PILToTensor(), T.RandomCrop(size, padding=size // 8),
                     T.RandomHorizontalFlip(), T.ToDtype(torch.float32, scale=True),
                     T.Normalize(mean, std)])  # fmt: skip
    plain = T.Compose(
        [T.PILToTensor(), T.ToDtype(torch.float32, scale=True), T.Normalize(mean, std)]
    )
    train = ImageFolder(str(root / "train"), transform=aug)
    return train, ImageFolder(str(root / "test"), transform=plain), len(train.classes)


def child_lightning(args: argparse.Namespace) -> None:
    import lightning.pytorch as L
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    train, test, num_classes = _datasets(args)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model(args.model, num_classes)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, _):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def validation_step(self, batch, _):
            x, y = batch
            out = self(x)
            self.log("val_loss", F.cross_entropy(out, y), sync_dist=True)
            self.log("val_acc", (out.argmax(1) == y).float().mean(), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.epochs_s: list[float] = []
            self.t0 = 0.0

        def on_train_epoch_start(self, trainer, module):
            self.t0 = time.perf_counter()

        def on_train_epoch_end(self, trainer, module):
            if trainer.strategy.root_device.type == "cuda":
                torch.cuda.synchronize()
            self.epochs_s.append(time.perf_counter() - self.t0)

    workers = args.workers
    common = dict(num_workers=workers, pin_memory=not args.cpu, persistent_workers=workers > 0)
    timer = Timer()
    trainer = L.Trainer(
        accelerator="cpu" if args.cpu else "gpu",
        devices=args.gpus,
        strategy="ddp" if args.gpus > 1 else "auto",
        precision="bf16-mixed",
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[timer],
    )
    trainer.fit(
        Module(),
        DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True, **common),
        DataLoader(test, batch_size=args.batch_size, **common),
    )
    if trainer.global_rank == 0:
        per_epoch = len(train) // (args.batch_size * args.gpus) * args.batch_size * args.gpus
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        print("RESULT " + json.dumps({"epochs_s": timer.epochs_s, "samples_per_epoch": per_epoch,
                                      "steady_samples_per_s": _steady(timer.epochs_s, per_epoch),
                                      "metrics": metrics}), flush=True)  # fmt: skip


def child_bare(args: argparse.Namespace) -> None:
    """One GPU: forward + backward + SGD on a batch already there, in each memory format and
    optimizer a user could pick (``--variants``); the best is the bare loop's figure."""
    import torch
    import torch.nn.functional as F

    device = torch.device("cpu" if args.cpu else "cuda")
    size = 32 if args.data == "cifar" else args.size
    out: dict[str, float] = {}
    for variant in args.variants.split(","):
        torch.manual_seed(0)
        net = _model(args.model, 100).to(device)
        memory = torch.channels_last if "channels_last" in variant else torch.contiguous_format
        net = net.to(memory_format=memory)
        fused = {"fused": True} if "fused" in variant and device.type == "cuda" else {}
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4, **fused)
        if variant == "speed_up":  # a script of the user's, through the public API
            import hpc_ddp

            fast = hpc_ddp.speed_up(net, opt)
            (net, opt), memory = fast, fast.memory_format
        x = torch.randn(args.batch_size, 3, size, size, device=device).to(memory_format=memory)
        y = torch.randint(0, 100, (args.batch_size,), device=device)

        def step(net=net, opt=opt, x=x, y=y) -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = F.cross_entropy(net(x).float(), y)
            loss.backward()
            opt.step()

        if "compile" in variant:
            step = torch.compile(step)
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out[variant + "_warmup_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out[variant] = args.steps * args.batch_size / (time.perf_counter() - t0)
    # The bare loop's figure: the best a plain loop gets; speed_up's is shown beside it.
    best = max(v for k, v in out.items() if not k.endswith("_s") and k != "speed_up")
    print("RESULT " + json.dumps({"steady_samples_per_s": best, "by_variant": out}), flush=True)


# -------------------------------------------------------------------------------- parent


def cifar_root(args: argparse.Namespace) -> Path:
    """Where ``hpc-ddp train --synthetic --data-dir ROOT`` keeps the CIFAR-100 files (written
    there first if they are not)."""
    from hpc_ddp.train.cifar import synthetic

    root = synthetic.synthetic_root(Path(args.root), "cifar100", args.train_size, args.test_size)
    if not synthetic.is_current(root, "cifar100", args.train_size, args.test_size, seed=1234):
        synthetic.write_synthetic(
            root, "cifar100", train_size=args.train_size, test_size=args.test_size
        )
    return root


def ours_cmd(args: argparse.Namespace, run_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "hpc_ddp.train", "--nproc-per-node", str(args.gpus)]
    cmd += ["--model", _model_name(args.model), "--batch-size", str(args.batch_size)]
    cmd += ["--optimizer", "sgd"]
    cmd += ["--lr", "0.05", "--epochs", str(args.epochs), "--run-dir", str(run_dir)]
    if args.data == "cifar":
        cmd += ["--dataset", "cifar100", "--synthetic", "--data-dir", args.root]
        cmd += ["--synthetic-train-size", str(args.train_size)]
        cmd += ["--synthetic-test-size", str(args.test_size)]
    else:
        cmd += ["--dataset", "imagefolder", "--data-dir", args.root]
    if args.cpu:
        cmd += ["--log-every", "1000"]
    return cmd + args.extra.split()


def measure(args: argparse.Namespace) -> dict:
    """Run the measurement's command as a child: command-to-exit, and its figures."""
    model = Path(args.model.split(":")[-1]).name  # two runs of one call never share a run dir
    run_dir = Path(args.work) / f"run-{args.trainer}-{args.data}-{args.gpus}-{model}-{args.tag}"
    if args.data == "cifar":
        cifar_root(args)  # written before the clock starts, once for every trainer
    if args.trainer == "ours":
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a finished one answered
        cmd = ours_cmd(args, run_dir)
    else:
        cmd = [sys.executable, __file__, "--child", *sys.argv[1:]]
    code = [args.code] if args.code else []  # another revision's hpc_ddp/, before this one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (*code, str(REPO), os.environ.get("PYTHONPATH", "")) if p)}  # fmt: skip
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on the lent machines
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    t0 = time.perf_counter()
    # Its own session: at the timeout the whole group goes (Lightning's DDP ranks included).
    # `python -m` puts the working directory first on sys.path: run another revision's code
    # from outside this checkout, so that its hpc_ddp/ is the one imported.
    cwd = args.work if args.code else None
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, cwd=cwd,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\n[timed out after {args.timeout:.0f} s]"
    wall = time.perf_counter() - t0
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if args.json:  # the child's whole output beside the record: its epoch lines, data wait
        Path(args.json).with_suffix(".out").write_text(stdout + stderr)
    record = {"trainer": args.trainer, "data": args.data, "gpus": args.gpus, "rc": done.returncode,
              "model": args.model, "tag": args.tag,
              "command_to_exit_s": wall, "cmd": " ".join(cmd)}  # fmt: skip
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            record.update(json.loads(line[len("RESULT ") :]))
    if args.trainer == "ours" and (run_dir / "metrics.jsonl").exists():
        rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rates = [r["samples_per_second"] for r in rows]
        record["epochs_samples_per_s"] = rates
        record["steady_samples_per_s"] = statistics.median(rates[1:] or rates)
        record["metrics"] = {"test_accuracy": rows[-1]["test_accuracy"]}
        record["notes"] = [
            ln for ln in done.stdout.splitlines() if ln.startswith(("data", "CUDA", "step"))
        ]
    if done.returncode != 0:
        record["tail"] = (done.stdout + done.stderr)[-3000:]
    return record


def summary(folder: Path) -> str:
    records = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    for r in records:
        r.setdefault("model", "resnet18")
        r.setdefault("tag", "")
    lines = ["| model | data | trainer | GPUs | steady samples/s | command to exit s | rc |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    key = lambda r: (r["model"], r["data"], r["gpus"], r["trainer"], r["tag"])  # noqa: E731
    for r in sorted(records, key=key):
        rate = r.get("steady_samples_per_s")
        shown = f"{rate:,.0f}" if rate else "-"
        name = r["trainer"] + (f" ({r['tag']})" if r["tag"] else "")
        lines.append(f"| {r['model']} | {r['data']} | {name} | {r['gpus']} | {shown} | "
                     f"{r['command_to_exit_s']:.1f} | {r['rc']} |")  # fmt: skip
    by = {key(r): r for r in records}
    lines.append("")
    for (model, data, gpus, trainer, tag), ours in sorted(by.items()):
        rate = ours.get("steady_samples_per_s")
        if trainer != "ours" or not rate:
            continue
        for other in ("lightning", "bare"):
            ref = by.get((model, data, 1 if other == "bare" else gpus, other, ""))
            if not (ref and ref.get("steady_samples_per_s")):
                continue
            if other == "bare":
                ratio = rate / (ref["steady_samples_per_s"] * gpus)
                said = f"ours / (bare loop x {gpus} GPUs) = {ratio:.3f}"
            else:
                exit_ = ref["command_to_exit_s"] / ours["command_to_exit_s"]
                said = f"ours / Lightning = {rate / ref['steady_samples_per_s']:.2f}x steady "
                said += f"samples/s, {exit_:.2f}x command-to-exit"
            lines.append(f"- {model}, {data}, {gpus} GPU(s){' ' + tag if tag else ''}: {said}")
    for r in records:  # what ours said about its data and step
        for note in r.get("notes", []):
            lines.append(f"- ours, {r['model']}, {r['data']}, {r['gpus']} GPU(s): `{note}`")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainer", choices=("bare", "ours", "lightning"), default="lightning")
    p.add_argument("--data", choices=("cifar", "folder"), default="cifar")
    p.add_argument(
        "--model", default="resnet18", help="resnet18 or a plug-in FILE.py:FUNCTION (from the repo)"
    )
    p.add_argument("--tag", default="", help="a label for this record (e.g. the flags it adds)")
    p.add_argument("--code", help="ours: a folder holding another revision's hpc_ddp/ to run")
    p.add_argument("--extra", default="", help="ours: more `hpc-ddp train` flags, space-separated")
    p.add_argument(
        "--variants",
        default="nchw,channels_last,channels_last_fused,speed_up",
        help="bare loop: comma-separated variants (nchw, channels_last, fused, compile combined; "
        "speed_up: through hpc_ddp.speed_up, shown beside the best)",
    )
    p.add_argument(
        "--root",
        help="cifar: the data dir of `hpc-ddp train --synthetic` (the files are written there "
        "if missing); folder: the image folder (train/, test/)",
    )
    p.add_argument("--train-size", type=int, default=50_000, help="cifar: training samples")
    p.add_argument("--test-size", type=int, default=10_000, help="cifar: test samples")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=8, help="Lightning's DataLoader workers")
    p.add_argument("--size", type=int, default=64, help="bare loop on folder: the image side")
    p.add_argument("--steps", type=int, default=100, help="bare loop: timed steps")
    p.add_argument("--warmup", type=int, default=20, help="bare loop: untimed steps first")
    p.add_argument("--cpu", action="store_true", help="on the CPU (Gloo): a check, not a figure")
    p.add_argument("--work", default="/tmp/issue36-work")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--json", help="write the record here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--summary", type=Path, help="write DIR/summary.md from DIR/*.json and stop")
    args = p.parse_args()
    if args.summary:
        text = summary(args.summary)
        (args.summary / "summary.md").write_text(text)
        print(text)
        return 0
    if args.child:
        (child_bare if args.trainer == "bare" else child_lightning)(args)
        return 0
    record = measure(args)
    print(json.dumps({k: v for k, v in record.items() if k != "tail"}), flush=True)
    if "tail" in record:
        print(record["tail"], file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0 if record["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
