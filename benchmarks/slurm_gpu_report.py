"""What benchmarks/slurm_gpu.py reads out of each job (its followed log, result.json) and the
tables it prints. Pure text work."""

from __future__ import annotations

import json
import re
from pathlib import Path

_JOB = re.compile(r"submitted job (\d+)")
_FINISHED = re.compile(r"^job (\d+): (\S+), exit code (-?\d+), restarts (\d+)", re.M)
_PREFLIGHT = re.compile(r"^hpc-ddp preflight: (.*)$", re.M)
_CVD = re.compile(
    r"(?:rank=(\d+)/\d+ |torchrun agent node_rank=(\d+)/\d+ ).*CUDA_VISIBLE_DEVICES=(\S+)"
)
_TRAINING = re.compile(r"training \S+ on .*backend \S+")
RESULT_KEYS = ("status", "epochs", "steps", "world_size", "test_accuracy", "train_loss",
               "params_sha256", "wall_seconds", "interruptions")  # fmt: skip


def parse_job(log: str, run_dir: Path, submit_rc: int | None) -> dict:
    job = _JOB.search(log)
    fin = _FINISHED.search(log)
    preflight = _PREFLIGHT.findall(log)
    cvd = {}
    for line in preflight:
        m = _CVD.search(line)
        if m:
            key = f"rank {m.group(1)}" if m.group(1) is not None else f"agent {m.group(2)}"
            cvd[key] = m.group(3)
    entry: dict = {
        "job_id": job.group(1) if job else None,
        "state": fin.group(2) if fin else None,
        "exit_code": int(fin.group(3)) if fin else None,
        "restarts": int(fin.group(4)) if fin else None,
        "submit_rc": submit_rc,
        "preflight": preflight,
        "cuda_visible_devices": cvd,
        "training_line": (_TRAINING.findall(log) or [None])[0],
        "resumed": "resumed from" in log,
        "result": _result(run_dir),
    }
    if entry["state"] != "COMPLETED" or entry["exit_code"] != 0:
        entry["log_tail"] = log.splitlines()[-40:]
    return entry


def _result(run_dir: Path) -> dict:
    try:
        data = json.loads((run_dir / "result.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: data[k] for k in RESULT_KEYS if k in data}


def directives(script: str) -> list[str]:
    return re.findall(r"^#SBATCH (.*)$", script, re.M)


def _gpu_request(entry: dict) -> str:
    asks = [d for d in entry.get("directives", []) if d.startswith(("--gpus", "--ntasks"))]
    return " ".join(asks)


def _cvd(entry: dict) -> str:
    return "; ".join(f"{k}: {v}" for k, v in entry.get("cuda_visible_devices", {}).items())


def layout_line(name: str, e: dict) -> str:
    r = e.get("result", {})
    return (
        f"{name}: {e.get('state')} exit {e.get('exit_code')} | {_gpu_request(e)} | "
        f"CUDA_VISIBLE_DEVICES {_cvd(e)} | world {r.get('world_size')} acc "
        f"{r.get('test_accuracy')} sha {str(r.get('params_sha256'))[:16]} | {e.get('wall_s')} s"
    )


def preempt_line(name: str, e: dict) -> str:
    r = e.get("result", {})
    return (
        f"{name} preempted at step {e.get('hold_step')} ({e.get('scancel')}): {e.get('state')} "
        f"exit {e.get('exit_code')} restarts {e.get('restarts')} interruptions "
        f"{r.get('interruptions')} resumed {e.get('resumed')} same weights {e.get('same_weights')}"
    )


def markdown(res: dict) -> str:
    m = res.get("machine", {})
    lines = [
        "# Committed GPU jobs under a real Slurm",
        "",
        f"GPUs: {'; '.join(m.get('gpus', [])) or '?'}",
        f"OS {m.get('os')}, kernel {m.get('kernel')}, {m.get('cpus')} CPUs, Python "
        f"{m.get('python')}, torch {m.get('torch')}, /sys/fs/cgroup: {m.get('cgroup_fs')}",
        f"Slurm: {res.get('versions', {}).get('slurmd')}; munge: "
        f"{res.get('versions', {}).get('munged')}; cgroups: {res.get('cgroups')}",
        "",
        "| layout | GPU request (#SBATCH) | CUDA_VISIBLE_DEVICES (preflight) | state, exit | "
        "processes | test acc | params_sha256 | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, e in res.get("layouts", {}).items():
        r = e.get("result", {})
        lines.append(
            f"| {name} | `{_gpu_request(e)}` | {_cvd(e)} | {e.get('state')}, "
            f"{e.get('exit_code')} | {r.get('world_size')} | {r.get('test_accuracy')} | "
            f"`{str(r.get('params_sha256'))[:16]}` | {e.get('wall_s')} |"
        )
    lines += [
        "",
        "| preempted layout | scancel | hold step | state, exit | restarts | interruptions | "
        "resumed | weights = uninterrupted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, e in res.get("preemptions", {}).items():
        r = e.get("result", {})
        lines.append(
            f"| {name} | `{e.get('scancel')}` | {e.get('hold_step')} | {e.get('state')}, "
            f"{e.get('exit_code')} | {e.get('restarts')} | {r.get('interruptions')} | "
            f"{e.get('resumed')} | **{e.get('same_weights')}** |"
        )
    checks = res.get("binding_check", {})
    if checks:
        lines += ["", "Binding check (one srun per request, each task's view):", ""]
        for name, out in checks.items():
            lines += [f"- `{name}`:", *[f"  - `{line}`" for line in out]]
    for note in res.get("notes", []):
        lines += ["", f"Note: {note}"]
    return "\n".join(lines) + "\n"
