"""Draw the diagrams of docs/ as PNGs into docs/img/ (boxes and arrows, matplotlib only).

    .venv/bin/python docs/figures/make_figures.py          # writes docs/img/*.png

Every picture uses the same colours (see ``C``) and shows 2 nodes x 2 GPUs: 8 GPUs per node work
the same way, with more boxes. The variable values drawn are the ones the local Slurm cluster's
fake-GPU tests check (tests/test_slurm_jobs.py::test_gpu_layouts_bind_gpus_as_intended) and the
ones `hpc-ddp launch ... --rcmd exec` prints; keep them in step with the code.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
from matplotlib.transforms import Bbox

matplotlib.use("Agg")

OUT = Path(__file__).resolve().parent.parent / "img"
DPI = 100

# One palette for every figure: (face, edge).
C = {
    "node": ("#f2f2f2", "#7f7f7f"),  # a machine
    "shell": ("#fff7d6", "#b8962e"),  # batch shell / your shell / launcher
    "agent": ("#ece2f7", "#7b52ab"),  # torchrun agent, node agent, submitit wrapper
    "proc": ("#ddeeff", "#2b6cb0"),  # a training process
    "rank0": ("#ffe3cc", "#d9480f"),  # rank 0 / master / store
    "gpu": ("#dcf5dc", "#2f8a2f"),  # a GPU
    "note": ("#ffffff", "#bbbbbb"),  # side notes
    "bad": ("#fde2e2", "#c92a2a"),  # failure paths
}
MONO = "DejaVu Sans Mono"


def canvas(w: float, h: float, title: str):
    fig = plt.figure(figsize=(w, h), dpi=DPI)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, w)
    ax.set_ylim(0, h)
    ax.axis("off")
    ax.text(0.2, h - 0.25, title, fontsize=14, fontweight="bold", va="top")
    return fig, ax


def box(
    ax,
    x,
    ytop,
    w,
    kind,
    title="",
    lines=(),
    *,
    h=None,
    size=9.5,
    title_size=10.5,
    mono=True,
    align="left",
    lw=1.4,
):
    """A rounded box hanging from ``ytop``; bold title, then text lines. Returns (x, y, w, h).

    ``h`` defaults to what the text needs, so every box fits its text whatever the font size.
    """
    face, edge = C[kind]
    step = size / 72 * 1.45
    need = 0.2 + (title_size / 72 * 1.5 if title else 0) + step * len(lines)
    h = need if h is None else max(h, need)
    y = ytop - h
    ax.add_patch(
        FancyBboxPatch(
            (x, y),
            w,
            h,
            boxstyle="round,pad=0.02,rounding_size=0.08",
            fc=face,
            ec=edge,
            lw=lw,
        )
    )
    tx = x + 0.1 if align == "left" else x + w / 2
    ty = ytop - 0.1
    if title:
        ax.text(
            tx,
            ty,
            title,
            fontsize=title_size,
            fontweight="bold",
            va="top",
            ha=align,
            color=edge if kind != "note" else "#333333",
        )
        ty -= title_size / 72 * 1.5
    for line in lines:
        ax.text(
            tx,
            ty,
            line,
            fontsize=size,
            va="top",
            ha=align,
            family=MONO if mono else None,
            color="#222222",
        )
        ty -= step
    return (x, y, w, h)


def note(ax, x, y, text, size=10):
    ax.text(x, y, text, fontsize=size, va="top", color="#222222")


def arrow(
    ax,
    a,
    b,
    text="",
    *,
    color="#444444",
    style="-|>",
    ls="-",
    lw=1.3,
    rad=0.0,
    size=9.5,
    tx=0.0,
    ty=0.0,
    ha="center",
):
    ax.add_patch(
        FancyArrowPatch(
            a,
            b,
            arrowstyle=style,
            mutation_scale=12,
            color=color,
            lw=lw,
            ls=ls,
            connectionstyle=f"arc3,rad={rad}",
            shrinkA=2,
            shrinkB=2,
        )
    )
    if text:
        mx, my = (a[0] + b[0]) / 2 + tx, (a[1] + b[1]) / 2 + ty
        ax.text(
            mx,
            my,
            text,
            fontsize=size,
            ha=ha,
            va="center",
            color=color,
            bbox=dict(fc="white", ec="none", pad=1.0, alpha=0.9),
        )


def legend(ax, x, y, items):
    for kind, label in items:
        face, edge = C[kind]
        ax.add_patch(
            FancyBboxPatch((x, y), 0.28, 0.18, boxstyle="round,pad=0.01", fc=face, ec=edge, lw=1.2)
        )
        ax.text(x + 0.36, y + 0.09, label, fontsize=9.5, va="center")
        x += 0.55 + 0.072 * len(label)


def top(b):
    return (b[0] + b[2] / 2, b[1] + b[3])


def bottom(b):
    return (b[0] + b[2] / 2, b[1])


def save(fig, name: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / name
    # Crop to what was drawn (the axes span the whole canvas, so "tight" alone would not).
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    extents = [x.get_window_extent(renderer) for x in [*ax.patches, *ax.texts, *ax.lines]]
    drawn = Bbox.union(extents).transformed(fig.dpi_scale_trans.inverted())
    fig.savefig(path, dpi=DPI, bbox_inches=drawn.padded(0.12))
    plt.close(fig)
    size = path.stat().st_size
    assert size < 200_000, f"{path} is {size} bytes; keep each PNG under 200 KB"
    print(f"{path.relative_to(OUT.parent.parent)}  {size // 1024} KB")


LEGEND = [
    ("shell", "batch shell / launcher"),
    ("agent", "agent / wrapper"),
    ("proc", "training process"),
    ("rank0", "rank 0 (master: TCPStore)"),
    ("gpu", "GPU"),
]


def store_bus(ax, procs, y, label):
    """Dashed lines from every other rank down to a bus and up into rank 0: 'connects to rank 0'."""
    red = C["rank0"][1]
    x0 = procs[0][0] + 0.35
    xs = [b[0] + 0.35 for b in procs[1:]]
    for b, x in zip(procs[1:], xs, strict=True):
        ax.plot([x, x], [b[1], y], color=red, ls="--", lw=1.3)
    ax.plot([x0, max(xs)], [y, y], color=red, ls="--", lw=1.3)
    arrow(ax, (x0, y), (x0, procs[0][1]), color=red, ls="--")
    # Under the bus, between rank 0's and rank 1's GPU arrows (nothing else crosses there).
    ax.text(x0 + 1.5, y - 0.06, label, fontsize=9, color=red, ha="left", va="top")


# ---------------------------------------------------------------------------------- layouts
def layout_srun() -> None:
    W, H = 13, 8.0
    fig, ax = canvas(W, H, "Layout (a): one process per GPU: srun starts one task per GPU")
    sh = box(
        ax,
        2.6,
        7.45,
        7.8,
        "shell",
        "sbatch script = the batch shell (runs on node1)",
        [
            "#SBATCH --nodes=2 --ntasks-per-node=2 --gpus-per-node=2",
            "srun --kill-on-bad-exit=1 python -m hpc_ddp.train ... &  wait",
        ],
    )
    procs = []
    for n in range(2):
        x0 = 0.1 + n * 6.45
        node = box(ax, x0, 6.2, 6.35, "node", f"node{n + 1}", [], h=5.05, title_size=12)
        for lr in range(2):
            rank = 2 * n + lr
            kind = "rank0" if rank == 0 else "proc"
            b = box(
                ax,
                x0 + 0.1 + lr * 3.12,
                5.8,
                3.0,
                kind,
                f"srun task {rank} = rank {rank}" + (" (master)" if rank == 0 else ""),
                [
                    "Slurm sets:",
                    f" SLURM_PROCID={rank}",
                    f" SLURM_LOCALID={lr}",
                    f" SLURM_NODEID={n}",
                    " SLURM_STEP_NUM_TASKS=4",
                    " SLURM_STEP_NODELIST=node[1-2]",
                    " CUDA_VISIBLE_DEVICES=0,1",
                    "hpc_ddp.cluster derives:",
                    f" RANK={rank}  LOCAL_RANK={lr}",
                    " WORLD_SIZE=4",
                    " MASTER_ADDR=node1",
                    " MASTER_PORT=20000+id%9000",
                    f" device cuda:{lr}",
                ],
            )
            procs.append(b)
            g = box(
                ax,
                x0 + 0.8 + lr * 3.12,
                node[1] + 0.8,
                1.6,
                "gpu",
                f"GPU {lr}",
                [],
                h=0.6,
                align="center",
            )
            arrow(ax, (b[0] + 1.6, b[1]), (b[0] + 1.6, g[1] + g[3]), color=C["gpu"][1])
        arrow(ax, bottom(sh), (x0 + 3.17, 6.2), f"srun: 2 tasks on node{n + 1}", ty=0.08)
    store_bus(ax, procs, node[1] + 1.3, "ranks 1-3 -> rank 0's TCPStore\n(node1:MASTER_PORT)")
    note(
        ax,
        0.15,
        0.98,
        "MASTER_ADDR = first host of SLURM_STEP_NODELIST; MASTER_PORT = 20000 + "
        "job_id % 9000: every rank derives both alone.",
    )
    note(
        ax,
        0.15,
        0.72,
        'gpu_binding = "gpus-per-task" instead: each task sees only its own GPU '
        "(CUDA_VISIBLE_DEVICES=0 or 1) and uses cuda:0.",
    )
    legend(ax, 0.15, 0.12, LEGEND)
    save(fig, "layout-srun-per-gpu.png")


def layout_torchrun() -> None:
    W, H = 13, 9.0
    fig, ax = canvas(W, H, "Layout (b): one srun task per node, each starting torchrun")
    sh = box(
        ax,
        1.4,
        8.45,
        10.2,
        "shell",
        "sbatch script = the batch shell (runs on node1)",
        [
            "export HPC_DDP_RDZV_ENDPOINT=node1:<port>   # port: python -m hpc_ddp.deploy.port",
            'srun --ntasks-per-node=1 bash -c \'trap "" USR1; exec torchrun --nnodes=2',
            "    --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=... -m hpc_ddp.train ...'",
        ],
    )
    agents = []
    for n in range(2):
        x0 = 0.1 + n * 6.45
        node = box(ax, x0, 6.95, 6.35, "node", f"node{n + 1}", [], h=5.85, title_size=12)
        a = box(
            ax,
            x0 + 0.5,
            6.55,
            5.35,
            "agent",
            f"srun task {n}: torchrun agent",
            [
                f"SLURM_PROCID={n} (numbers agents, not workers)",
                "hosts the c10d rendezvous store" if n == 0 else "joins the rendezvous on node1",
            ],
        )
        agents.append(a)
        arrow(ax, bottom(sh), top(a), f"srun task {n}", ty=0.08)
        for lr in range(2):
            rank = 2 * n + lr
            kind = "rank0" if rank == 0 else "proc"
            b = box(
                ax,
                x0 + 0.1 + lr * 3.12,
                a[1] - 0.45,
                3.0,
                kind,
                f"worker: rank {rank}" + (" (master)" if rank == 0 else ""),
                [
                    "torchrun sets:",
                    f" RANK={rank}  LOCAL_RANK={lr}",
                    " WORLD_SIZE=4",
                    " LOCAL_WORLD_SIZE=2",
                    f" GROUP_RANK={n}",
                    " MASTER_ADDR, MASTER_PORT",
                    " TORCHELASTIC_RUN_ID",
                    "inherited, not believed:",
                    f" the agent's SLURM_PROCID={n} ...",
                    "Slurm: CUDA_VISIBLE_DEVICES=0,1",
                    f"uses cuda:{lr}",
                ],
            )
            arrow(
                ax,
                (b[0] + 1.5, a[1]),
                (b[0] + 1.5, b[1] + b[3]),
                "spawns" if lr == 0 else "",
                color=C["agent"][1],
            )
            g = box(
                ax,
                x0 + 0.8 + lr * 3.12,
                node[1] + 0.8,
                1.6,
                "gpu",
                f"GPU {lr}",
                [],
                h=0.6,
                align="center",
            )
            arrow(ax, (b[0] + 1.6, b[1]), (b[0] + 1.6, g[1] + g[3]), color=C["gpu"][1])
    arrow(
        ax,
        (agents[1][0], agents[1][1] + 0.35),
        (agents[0][0] + agents[0][2], agents[0][1] + 0.35),
        "rendezvous",
        color=C["agent"][1],
        ls="--",
    )
    note(
        ax,
        0.15,
        0.98,
        "torchrun numbers the agents in rendezvous order: rank 0 is usually on node1, "
        "not always. hpc_ddp.cluster believes torchrun's variables first.",
    )
    note(
        ax,
        0.15,
        0.72,
        'USR1: torchrun ignores it (trap ""), Slurm signals every process of the '
        "step, so the workers get it and checkpoint.",
    )
    legend(ax, 0.15, 0.12, LEGEND)
    save(fig, "layout-torchrun.png")


def layout_pernode() -> None:
    W, H = 13, 7.0
    fig, ax = canvas(W, H, "Layout (c): one process per node drives all its GPUs; DDP across nodes")
    sh = box(
        ax,
        1.4,
        6.45,
        10.2,
        "shell",
        "sbatch script = the batch shell (runs on node1)",
        [
            "#SBATCH --nodes=2 --ntasks-per-node=1 --gpus-per-node=2",
            "export HPC_DDP_GPUS_PER_PROCESS=2",
            "srun python -m hpc_ddp.train --gpus-per-process 2 ...",
        ],
    )
    procs = []
    for n in range(2):
        x0 = 0.1 + n * 6.45
        node = box(ax, x0, 5.2, 6.35, "node", f"node{n + 1}", [], h=4.25, title_size=12)
        kind = "rank0" if n == 0 else "proc"
        b = box(
            ax,
            x0 + 0.25,
            4.8,
            5.55,
            kind,
            f"srun task {n} = rank {n}" + (" (master)" if n == 0 else ""),
            [
                f"Slurm sets: SLURM_PROCID={n}  SLURM_NODEID={n}",
                "  SLURM_STEP_NUM_TASKS=2  CUDA_VISIBLE_DEVICES=0,1",
                "the script: HPC_DDP_GPUS_PER_PROCESS=2",
                f"derived: RANK={n} (= node)  WORLD_SIZE=2 (= nodes)",
                "  LOCAL_RANK=0  MASTER_ADDR=node1  gpus (0, 1)",
                "model split over cuda:0 and cuda:1;",
                "DDP(model, device_ids=None)",
            ],
        )
        procs.append(b)
        for g in range(2):
            gb = box(
                ax,
                x0 + 0.8 + g * 3.1,
                node[1] + 1.0,
                1.9,
                "gpu",
                f"GPU {g}",
                ["stages 1..k" if g == 0 else "stages k+1..n"],
                align="center",
            )
            arrow(ax, (b[0] + 1.6 + g * 2.5, b[1]), top(gb), color=C["gpu"][1])
        arrow(ax, bottom(sh), top(b), f"srun: 1 task on node{n + 1}", ty=0.1)
    arrow(
        ax,
        (procs[0][0] + procs[0][2], procs[0][1] + 0.5),
        (procs[1][0], procs[1][1] + 0.5),
        "",
        style="<|-|>",
        color=C["rank0"][1],
    )
    ax.text(
        6.375,
        procs[0][1] + 0.25,
        "DDP\nall-reduce",
        fontsize=9.5,
        ha="center",
        va="top",
        color=C["rank0"][1],
    )
    note(
        ax,
        0.15,
        0.75,
        "For a model too big for one GPU. --gpus-per-process must agree with "
        "HPC_DDP_GPUS_PER_PROCESS; torchrun is refused for this layout.",
    )
    legend(ax, 0.15, 0.12, LEGEND)
    save(fig, "layout-per-node.png")


def no_scheduler() -> None:
    W, H = 13, 9.4
    fig, ax = canvas(W, H, "No scheduler: hpc-ddp launch pdsh|clush (default --mode torchrun)")
    me = box(
        ax,
        0.1,
        8.8,
        3.9,
        "shell",
        "your shell (login node)",
        [
            "hpc-ddp launch pdsh",
            "  --hosts 'node[0-1]'",
            "  --gpus-per-node 2 -- ...",
            "hosts sorted: node0 node1",
            "master = node0 (node rank 0)",
            "port = f(launch id)",
            "reads every output line;",
            "first failed host -> stop",
            "every host, exit non-zero",
        ],
    )
    note(
        ax,
        0.15,
        me[1] - 0.15,
        "runs:  pdsh -S -R ssh -f 2\n         -w node0,node1 ...\n(clush: -R exec ... ssh %h ...)",
        size=9.5,
    )
    hosts = []
    for n in range(2):
        ytop = 8.8 - n * 4.05
        host = box(
            ax,
            4.3,
            ytop,
            8.6,
            "node",
            f"host node{n}   (%h = node{n}, %n = {n} = node rank)",
            [],
            h=3.85,
            title_size=12,
        )
        hosts.append(host)
        hs = box(
            ax,
            4.4,
            ytop - 0.45,
            2.55,
            "shell",
            "host script",
            [
                "check %n = host",
                "cd, export env,",
                "--setup lines",
                "setsid PAYLOAD &",
                "wait; print",
                f"host=node{n} exit=N",
            ],
            size=9,
        )
        ag = box(
            ax,
            7.15,
            ytop - 0.45,
            5.65,
            "agent",
            "torchrun (the PAYLOAD)",
            [
                f"--nnodes 2 --node-rank {n} --nproc-per-node 2",
                "--master-addr node0 --master-port P",
            ],
            size=9,
        )
        arrow(
            ax, (hs[0] + hs[2], ag[1] + ag[3] / 2), (ag[0], ag[1] + ag[3] / 2), color=C["agent"][1]
        )
        for lr in range(2):
            rank = 2 * n + lr
            kind = "rank0" if rank == 0 else "proc"
            b = box(
                ax,
                7.15 + lr * 2.88,
                ag[1] - 0.3,
                2.77,
                kind,
                f"rank {rank}" + (" (master)" if rank == 0 else ""),
                [
                    f"RANK={rank} LOCAL_RANK={lr}",
                    "WORLD_SIZE=4",
                    "LOCAL_WORLD_SIZE=2",
                    f"GROUP_RANK={n}",
                    "MASTER_ADDR=node0",
                    "MASTER_PORT=P",
                    "HPC_DDP_LAUNCH_ID,",
                    " HPC_DDP_LAUNCH_TAG,",
                    " HPC_DDP_GPUS_PER_PROCESS",
                ],
                size=9,
            )
            arrow(ax, (b[0] + 1.4, ag[1]), (b[0] + 1.4, b[1] + b[3]), color=C["agent"][1])
        arrow(ax, (me[0] + me[2], me[1] + 0.8 - n * 0.4), (host[0], hs[1] + hs[3] / 2), "")
        ax.text(4.15, hs[1] + hs[3] / 2 + 0.12, "ssh", fontsize=9.5, ha="right")
    box(
        ax,
        0.1,
        3.95,
        3.9,
        "note",
        "--mode processes instead:",
        [
            "hpc_ddp.deploy.node_agent",
            "starts the 2 processes; each",
            "process sees:",
            " HPC_DDP_LAUNCHER=pdsh|clush",
            " HPC_DDP_NODE_RANK",
            " HPC_DDP_NUM_NODES",
            " HPC_DDP_LOCAL_RANK",
            " HPC_DDP_LOCAL_WORLD_SIZE",
            " HPC_DDP_MASTER_ADDR, _PORT",
            " HPC_DDP_JOB_ID",
            "rank = node_rank x 2 + local",
        ],
        size=9,
    )
    legend(ax, 0.15, 0.12, LEGEND[:4])
    save(fig, "no-scheduler.png")


def submitit_fig() -> None:
    W, H = 13, 7.2
    fig, ax = canvas(W, H, "submitit: the same trainer from Python; submitit requeues it")
    me = box(
        ax,
        0.1,
        6.65,
        5.0,
        "shell",
        "your shell / Python (login node)",
        [
            "hpc-ddp submit --executor submitit SPEC.toml",
            "= AutoExecutor(...).submit(TrainTask(...))",
        ],
    )
    sl = box(
        ax,
        6.6,
        6.65,
        5.0,
        "shell",
        "submitit's sbatch script",
        [
            "#SBATCH --signal=USR2@<signal_lead_s>",
            "srun: one task per process",
        ],
    )
    arrow(ax, (me[0] + me[2], me[1] + me[3] / 2), (sl[0], sl[1] + sl[3] / 2), "sbatch")
    box(ax, 0.1, 5.2, 12.8, "node", "node1  (node2 alike: ranks 2 and 3)", [], h=3.2, title_size=12)
    for lr in range(2):
        x0 = 0.25 + lr * 6.35
        kind = "rank0" if lr == 0 else "proc"
        w = box(
            ax,
            x0,
            4.8,
            6.15,
            "agent",
            f"srun task {lr}: submitit + TrainTask (no torch)",
            [
                f"SLURM_PROCID={lr}  SLURM_LOCALID={lr}  SUBMITIT_*",
                "on USR2: forward it to the child, then",
                "submitit's handler: TrainTask.checkpoint()"
                if lr == 0
                else "submitit's handler (requeue is rank 0's job)",
                "waits for the child, submitit requeues" if lr == 0 else "",
            ],
        )
        arrow(ax, (sl[0] + 1.5 + lr * 2.0, sl[1]), (w[0] + 3.0, w[1] + w[3]), f"task {lr}", ty=0.05)
        b = box(
            ax,
            x0,
            w[1] - 0.4,
            6.15,
            kind,
            f"child: python -m hpc_ddp.train = rank {lr}" + (" (master)" if lr == 0 else ""),
            [
                "--requeue none --requeue-signal SIGUSR2,SIGTERM",
                f"source slurm: RANK={lr} (SLURM_PROCID), WORLD_SIZE=4",
                "on USR2: agree, checkpoint, exit 75",
            ],
        )
        arrow(
            ax, (w[0] + 3.0, w[1]), (b[0] + 3.0, b[1] + b[3]), "starts", color=C["agent"][1], tx=0.4
        )
    note(
        ax,
        0.15,
        1.8,
        "--executor local (submitit's LocalExecutor, one machine): tasks see "
        "SUBMITIT_LOCAL_GLOBALID, _LOCALID, _NODEID, _NTASKS\nand no SLURM_*; master 127.0.0.1, "
        "port derived from the job id.",
    )
    legend(ax, 0.15, 1.05, LEGEND[:4])
    save(fig, "submitit.png")


# ------------------------------------------------------------------------------ checkpoints
def checkpoint_fig() -> None:
    W, H = 13, 8.4
    fig, ax = canvas(W, H, "Checkpoint commit: every rank writes, all agree, rank 0 commits")
    red = C["rank0"][1]
    box(ax, 0.1, 7.8, 3.9, "rank0", "rank 0", [], align="center")
    box(ax, 4.2, 7.8, 3.9, "proc", "ranks 1 .. N-1", [], align="center")
    phases = [
        (
            ["remove .tmp-*/.trash-* leftovers", "mkdir .tmp-step-N, fsync"],
            ["check per_rank is plain data"],
            "agree #1 (prepare)",
        ),
        (
            ["shared.pt, rank-00000.pt:", "write + sha256, fsync, rename"],
            ["rank-0000R.pt:", "write + sha256, fsync, rename"],
            "agree #2 (write): a failed rank -> all raise",
        ),
        (
            [
                "read back and hash the others' files",
                "write manifest.json, fsync",
                "rename .tmp-step-N -> step-N, fsync",
                'latest := "step-N" (os.replace)',
                "prune: keep the newest 2",
            ],
            ["wait"],
            "agree #3 (commit): all return step-N",
        ),
    ]
    y = 7.2
    for left, right, agree in phases:
        lb = box(ax, 0.1, y, 3.9, "rank0", "", left)
        box(ax, 4.2, y, 3.9, "proc", "", right, h=lb[3])
        y = lb[1] - 0.3
        ax.plot([0.1, 8.1], [y, y], color=red, lw=3)
        ax.text(
            4.1, y - 0.08, agree, fontsize=10, ha="center", va="top", fontweight="bold", color=red
        )
        y -= 0.55
    # the commit point, on rank 0's last box
    ax.annotate(
        "THE COMMIT POINT",
        xy=(3.25, lb[1] + 0.55),
        xytext=(4.6, lb[1] + 0.5),
        fontsize=10,
        fontweight="bold",
        color=red,
        va="center",
        arrowprops=dict(arrowstyle="-|>", color=red, lw=1.5),
    )
    note(
        ax,
        0.15,
        y + 0.1,
        "An agreement is an all-reduce that every rank reaches whether its own "
        "part worked\nor not: a full disk on one rank makes every rank raise within "
        "milliseconds,\nnaming that rank, and nothing is committed.",
    )
    note(
        ax,
        0.15,
        y - 0.75,
        "Reading back: the step that latest names, else older ones whose "
        'manifest\nverifies (log: "checkpoint: fell back to step-... after 1 unusable one(s)").',
    )
    ax.text(8.5, 7.75, "run/checkpoints/  (keep=2)", fontsize=11, fontweight="bold", va="top")
    states = [
        ("before the save", ['latest  ("step-00000080")', "step-00000040/", "step-00000080/"]),
        (
            "crash during the save",
            [
                'latest  ("step-00000080")',
                "step-00000040/",
                "step-00000080/",
                ".tmp-step-00000120/  never read,",
                "  removed by the next save/load",
            ],
        ),
        (
            "after the commit point",
            [
                'latest  ("step-00000120")',
                "step-00000080/",
                "step-00000120/",
                "  shared.pt",
                "  rank-00000.pt ...",
                "  manifest.json (sizes, sha256)",
            ],
        ),
    ]
    y = 7.3
    for i, (title, lines) in enumerate(states):
        b = box(ax, 8.5, y, 4.4, "rank0" if i == 2 else "node", title, lines, size=9)
        y = b[1] - 0.3
        if i < 2:
            arrow(ax, (10.7, b[1]), (10.7, y), color="#888888")
    save(fig, "checkpoint-commit.png")


def preemption_fig() -> None:
    W, H = 13, 6.6
    fig, ax = canvas(W, H, "Preemption: signal, flag, agree, checkpoint, requeue, exit 75, resume")
    w, gap = 2.3, 0.32
    row1 = [
        (
            "shell",
            "1. signal",
            ["USR1 before the", "limit (--signal=", "USR1@N); TERM at", "preemption"],
        ),
        ("proc", "2. handler", ["sets a flag,", "nothing else", "(every rank)"]),
        ("proc", "3. step boundary", ["all_reduce of", "(loss, n, flag):", "any rank flagged?"]),
        (
            "proc",
            "4. checkpoint",
            ["together: tmp dir,", "fsync, agree,", "manifest, rename,", "latest moves"],
        ),
        ("rank0", "5. rank 0", ["scontrol requeue", "$SLURM_JOB_ID", "(array: JOB_TASK)"]),
    ]
    row2 = [  # drawn right to left, under row 1
        ("proc", "6. exit 75", ["every rank", "progress.json:", '"preempted"']),
        (
            "shell",
            "7. Slurm",
            ["job PENDING;", "starts again after", "cred_expire +", "a scheduler pass"],
        ),
        (
            "shell",
            "8. job restarts",
            ["SLURM_RESTART_COUNT", "=1; the same log", "file continues", "(--open-mode=append)"],
        ),
        (
            "proc",
            "9. resume",
            ["newest verified", "checkpoint; same", "sample, same RNG:", "same weights"],
        ),
    ]
    b1 = [
        box(ax, 0.15 + i * (w + gap), 5.3, w, k, t, ls, h=1.55) for i, (k, t, ls) in enumerate(row1)
    ]
    for i, (a, b) in enumerate(pairwise(b1)):
        arrow(
            ax,
            (a[0] + w, a[1] + a[3] / 2),
            (b[0], b[1] + b[3] / 2),
            "yes" if i == 2 else "",
            ty=0.2,
        )
    b2 = [
        box(ax, 0.15 + (4 - i) * (w + gap), 2.95, w, k, t, ls, h=1.55)
        for i, (k, t, ls) in enumerate(row2)
    ]
    arrow(ax, bottom(b1[4]), top(b2[0]))
    for a, b in pairwise(b2):
        arrow(ax, (a[0], a[1] + a[3] / 2), (b[0] + w, b[1] + b[3] / 2))
    arrow(
        ax,
        (b1[2][0] + 0.4, b1[2][1] + b1[2][3]),
        (b1[1][0] + w - 0.4, b1[1][1] + b1[1][3]),
        "no: next step",
        rad=0.6,
        ty=0.35,
        color="#666666",
    )
    note(
        ax,
        0.15,
        1.1,
        "submitit: the signal is USR2 and submitit requeues (the trainer runs with "
        "--requeue none).\ntorchrun: the workers get USR1 straight from Slurm and exit 75; "
        "torchrun itself exits 1.\npdsh/clush or no scheduler: steps 1-4 and 6; nothing requeues: "
        "run the same command again and it resumes.",
    )
    save(fig, "preemption.png")


def main() -> None:
    layout_srun()
    layout_torchrun()
    layout_pernode()
    no_scheduler()
    submitit_fig()
    checkpoint_fig()
    preemption_fig()


if __name__ == "__main__":
    main()
