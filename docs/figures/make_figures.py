"""Draw the diagrams of docs/ as PNGs into docs/img/ (boxes and arrows, matplotlib only).

    .venv/bin/python docs/figures/make_figures.py          # writes docs/img/*.png
    .venv/bin/python docs/figures/make_figures.py house.png   # only the ones named

The house (``house``) is the package's import graph, read from the tree each time it is drawn.
The other pictures show 2 nodes x 2 GPUs: 8 GPUs per node work the same way, with more boxes.
All use the same colours (see ``C``). The variable values drawn are the ones the local Slurm
cluster's fake-GPU tests check (tests/test_slurm_jobs.py::test_gpu_layouts_bind_gpus_as_intended)
and the ones `hpc-ddp launch ... --rcmd exec` prints; keep them in step with the code.

The first half holds the shapes (box, arrow, node, process pair, GPU row, legend); each figure
function below them only says what goes where. Coordinates are inches on the canvas, y upwards.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from functools import cache
from itertools import pairwise
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
from matplotlib.transforms import Bbox

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "img"
DPI = 100
MONO = "DejaVu Sans Mono"

Box = tuple[float, float, float, float]  # x, y of the lower left corner, width, height
Point = tuple[float, float]

# One palette for every figure: (face, edge).
C = {
    "node": ("#f2f2f2", "#7f7f7f"),  # a machine
    "shell": ("#fff7d6", "#b8962e"),  # batch shell / your shell / launcher
    "agent": ("#ece2f7", "#7b52ab"),  # torchrun agent, node agent, submitit wrapper
    "proc": ("#ddeeff", "#2b6cb0"),  # a training process
    "rank0": ("#ffe3cc", "#d9480f"),  # rank 0 / master / store
    "gpu": ("#dcf5dc", "#2f8a2f"),  # a GPU
    "note": ("#ffffff", "#bbbbbb"),  # side notes
}
RED, PURPLE, GREEN = C["rank0"][1], C["agent"][1], C["gpu"][1]
LEGEND = [
    ("shell", "batch shell / launcher"),
    ("agent", "agent / wrapper"),
    ("proc", "training process"),
    ("rank0", "rank 0 (master: TCPStore)"),
    ("gpu", "GPU"),
]


# ----------------------------------------------------------------------------------- shapes
def canvas(w: float, h: float, title: str) -> tuple[Figure, Axes]:
    fig = plt.figure(figsize=(w, h), dpi=DPI)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, w)  # one data unit = one inch, so sizes below read as inches
    ax.set_ylim(0, h)
    ax.axis("off")
    ax.text(0.2, h - 0.25, title, fontsize=14, fontweight="bold", va="top")
    return fig, ax


def box(
    ax: Axes,
    x: float,
    ytop: float,
    w: float,
    kind: str,
    title: str = "",
    text: str = "",
    *,
    h: float = 0.0,
    size: float = 9.5,
    title_size: float = 10.5,
    align: str = "left",
) -> Box:
    """A rounded box hanging from ``ytop``: bold title, then the lines of ``text`` in mono.

    ``text`` may be an indented triple-quoted block: it is cleaned up like a docstring. The height
    is at least what the text needs, so every box fits its text whatever the font size.
    """
    lines = inspect.cleandoc(text).splitlines()
    face, edge = C[kind]
    step = size / 72 * 1.45
    h = max(h, 0.2 + (title_size / 72 * 1.5 if title else 0) + step * len(lines))
    y = ytop - h
    style = "round,pad=0.02,rounding_size=0.08"
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=style, fc=face, ec=edge, lw=1.4))
    tx, ty = (x + 0.1 if align == "left" else x + w / 2), ytop - 0.1
    if title:
        color = edge if kind != "note" else "#333333"  # a note's grey edge is too pale for text
        ax.text(tx, ty, title, fontsize=title_size, fontweight="bold", va="top", ha=align, c=color)
        ty -= title_size / 72 * 1.5
    for line in lines:
        ax.text(tx, ty, line, fontsize=size, va="top", ha=align, family=MONO, color="#222222")
        ty -= step
    return (x, y, w, h)


def at(b: Box, fx: float, fy: float, dx: float = 0.0, dy: float = 0.0) -> Point:
    """The point of box ``b`` at fractions (fx, fy) of its size, moved by (dx, dy) inches."""
    return (b[0] + fx * b[2] + dx, b[1] + fy * b[3] + dy)


def top(b: Box) -> Point:
    return at(b, 0.5, 1)


def bottom(b: Box) -> Point:
    return at(b, 0.5, 0)


def note(ax: Axes, x: float, y: float, text: str, size: float = 10) -> None:
    ax.text(x, y, text, fontsize=size, va="top", color="#222222")


def arrow(
    ax: Axes, a: Point, b: Point, text: str = "", tx: float = 0, ty: float = 0, **style: Any
) -> None:
    """An arrow from a to b (``style``: FancyArrowPatch settings over the house defaults).

    ``text`` sits at the middle, moved by (tx, ty), on white so that lines under it do not cross it.
    """
    kw: dict[str, Any] = dict(arrowstyle="-|>", mutation_scale=12, color="#444444", lw=1.3)
    kw |= dict(shrinkA=2, shrinkB=2) | style
    ax.add_patch(FancyArrowPatch(a, b, **kw))
    if text:
        mx, my = (a[0] + b[0]) / 2 + tx, (a[1] + b[1]) / 2 + ty
        bg = dict(fc="white", ec="none", pad=1.0, alpha=0.9)
        ax.text(mx, my, text, fontsize=9.5, ha="center", va="center", color=kw["color"], bbox=bg)


def legend(ax: Axes, x: float, y: float, items: list[tuple[str, str]]) -> None:
    for kind, label in items:
        face, edge = C[kind]
        style = "round,pad=0.01"
        ax.add_patch(FancyBboxPatch((x, y), 0.28, 0.18, boxstyle=style, fc=face, ec=edge, lw=1.2))
        ax.text(x + 0.36, y + 0.09, label, fontsize=9.5, va="center")
        x += 0.55 + 0.072 * len(label)  # the label's rough width: no renderer needed


def footer(ax: Axes, *notes: str, y: float = 0.72, items: list[tuple[str, str]] = LEGEND) -> None:
    """Notes stacked upwards from ``y`` (the top of the lowest), the colour legend under them."""
    if items:
        legend(ax, 0.15, y - 0.6, items)
    for text in reversed(notes):  # bottom up, so a note of several lines pushes the others up
        y += 0.2 * text.count("\n")
        note(ax, 0.15, y, text)
        y += 0.26


def node(ax: Axes, x: float, ytop: float, w: float, h: float, title: str) -> Box:
    """A machine: a grey frame with a larger title; what runs on it is drawn on top of it."""
    return box(ax, x, ytop, w, "node", title, h=h, title_size=12)


def two_nodes(ax: Axes, ytop: float, h: float) -> list[Box]:
    """node1 and node2 side by side, filling the 13-inch-wide layout figures."""
    return [node(ax, 0.1 + n * 6.45, ytop, 6.35, h, f"node{n + 1}") for n in range(2)]


def proc(
    ax: Axes, x: float, ytop: float, w: float, rank: int, title: str, text: str, size: float = 9.5
) -> Box:
    """A training process; rank 0 gets the master colour and says so: it hosts the TCPStore."""
    kind, master = ("rank0", " (master)") if rank == 0 else ("proc", "")
    return box(ax, x, ytop, w, kind, title + master, text, size=size)


def rank_pair(
    ax: Axes, x: float, ytop: float, w: float, n: int, title: str, text: str, size: float = 9.5
) -> list[Box]:
    """Node ``n``'s two processes side by side from ``x`` on, each ``w`` wide.

    ``title`` and ``text`` are str.format templates of {rank}, {lr} (local rank) and {n} (node):
    the variables the processes of a layout see differ only in those numbers.
    """
    boxes = []
    for lr in range(2):
        v = dict(rank=2 * n + lr, lr=lr, n=n)
        xl = x + lr * (w + 0.12)
        boxes.append(proc(ax, xl, ytop, w, v["rank"], title.format(**v), text.format(**v), size))
    return boxes


def spawn(ax: Axes, parent: Box, children: list[Box], label: str = "") -> None:
    """Straight down from ``parent``'s bottom into each child; ``label`` on the first arrow only."""
    for i, b in enumerate(children):
        arrow(ax, (top(b)[0], parent[1]), top(b), "" if i else label, color=PURPLE)


def gpu(ax: Axes, src: Point, x: float, ytop: float, w: float, i: int, text: str = "") -> Box:
    """GPU ``i`` of a node, with an arrow from ``src`` on the process that drives it."""
    g = box(ax, x, ytop, w, "gpu", f"GPU {i}", text, h=0.6, align="center")
    arrow(ax, src, top(g), color=GREEN)
    return g


def gpu_row(ax: Axes, procs: list[Box], nb: Box) -> None:
    """One GPU straight under each one-GPU process, near the bottom of node box ``nb``."""
    for i, b in enumerate(procs):
        gpu(ax, bottom(b), b[0] + b[2] / 2 - 0.8, nb[1] + 0.8, 1.6, i)


def store_bus(ax: Axes, procs: list[Box], y: float, label: str) -> None:
    """Dashed lines from every other rank down to a bus and up into rank 0: 'connects to rank 0'."""
    x0 = procs[0][0] + 0.35
    xs = [b[0] + 0.35 for b in procs[1:]]
    for b, x in zip(procs[1:], xs, strict=True):
        ax.plot([x, x], [b[1], y], color=RED, ls="--", lw=1.3)
    ax.plot([x0, max(xs)], [y, y], color=RED, ls="--", lw=1.3)
    arrow(ax, (x0, y), (x0, procs[0][1]), color=RED, ls="--")
    # Under the bus, between rank 0's and rank 1's GPU arrows (nothing else crosses there).
    ax.text(x0 + 1.5, y - 0.06, label, fontsize=9, color=RED, ha="left", va="top")


def save(fig: Figure, name: str) -> None:
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


Draw = Callable[[Axes], None]
FIGURES: list[tuple[str, float, Draw]] = []  # (file name, canvas height, drawing), in order


def figure(name: str, h: float) -> Callable[[Draw], Draw]:
    """Register a drawing as docs/img/``name``: a 13 x ``h`` inch canvas titled by its docstring.

    The docstring doubles as the title so that a figure function is only its description.
    """

    def register(draw: Draw) -> Draw:
        FIGURES.append((name, h, draw))
        return draw

    return register


# ---------------------------------------------------------------------------------- layouts
SBATCH_SHELL = "sbatch script = the batch shell (runs on node1)"


@figure("layout-srun-per-gpu.png", 8.0)
def layout_srun(ax: Axes) -> None:
    """Layout (a): one process per GPU: srun starts one task per GPU"""
    script = """#SBATCH --nodes=2 --ntasks-per-node=2 --gpus-per-node=2
        srun --kill-on-bad-exit=1 python -m hpc_ddp.train ... &  wait"""
    task = """Slurm sets:
         SLURM_PROCID={rank}
         SLURM_LOCALID={lr}
         SLURM_NODEID={n}
         SLURM_STEP_NUM_TASKS=4
         SLURM_STEP_NODELIST=node[1-2]
         CUDA_VISIBLE_DEVICES=0,1
        hpc_ddp.cluster derives:
         RANK={rank}  LOCAL_RANK={lr}
         WORLD_SIZE=4
         MASTER_ADDR=node1
         MASTER_PORT=20000+id%9000
         device cuda:{lr}"""
    sh = box(ax, 2.6, 7.45, 7.8, "shell", SBATCH_SHELL, script)
    procs: list[Box] = []
    for n, nb in enumerate(two_nodes(ax, 6.2, 5.05)):
        arrow(ax, bottom(sh), top(nb), f"srun: 2 tasks on node{n + 1}", ty=0.08)
        procs += rank_pair(ax, nb[0] + 0.1, 5.8, 3.0, n, "srun task {rank} = rank {rank}", task)
        gpu_row(ax, procs[-2:], nb)
    store_bus(ax, procs, nb[1] + 1.3, "ranks 1-3 -> rank 0's TCPStore\n(node1:MASTER_PORT)")
    footer(
        ax,
        "MASTER_ADDR = first host of SLURM_STEP_NODELIST; MASTER_PORT = 20000 + "
        "job_id % 9000: every rank derives both alone.",
        'gpu_binding = "gpus-per-task" instead: each task sees only its own GPU '
        "(CUDA_VISIBLE_DEVICES=0 or 1) and uses cuda:0.",
    )


@figure("layout-torchrun.png", 9.0)
def layout_torchrun(ax: Axes) -> None:
    """Layout (b): one srun task per node, each starting torchrun"""
    script = """
        export HPC_DDP_RDZV_ENDPOINT=node1:<port>   # port: python -m hpc_ddp.deploy.port
        srun --ntasks-per-node=1 bash -c 'trap "" USR1; exec torchrun --nnodes=2
            --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=... -m hpc_ddp.train ...'"""
    worker = """torchrun sets:
         RANK={rank}  LOCAL_RANK={lr}
         WORLD_SIZE=4
         LOCAL_WORLD_SIZE=2
         GROUP_RANK={n}
         MASTER_ADDR, MASTER_PORT
         TORCHELASTIC_RUN_ID
        inherited, not believed:
         the agent's SLURM_PROCID={n} ...
        Slurm: CUDA_VISIBLE_DEVICES=0,1
        uses cuda:{lr}"""
    sh = box(ax, 1.4, 8.45, 10.2, "shell", SBATCH_SHELL, script)
    agents = []
    for n, nb in enumerate(two_nodes(ax, 6.95, 5.85)):
        store = "hosts the c10d rendezvous store" if n == 0 else "joins the rendezvous on node1"
        text = f"SLURM_PROCID={n} (numbers agents, not workers)\n{store}"
        a = box(ax, nb[0] + 0.5, 6.55, 5.35, "agent", f"srun task {n}: torchrun agent", text)
        agents.append(a)
        arrow(ax, bottom(sh), top(a), f"srun task {n}", ty=0.08)
        workers = rank_pair(ax, nb[0] + 0.1, a[1] - 0.45, 3.0, n, "worker: rank {rank}", worker)
        spawn(ax, a, workers, "spawns")
        gpu_row(ax, workers, nb)
    left, right = at(agents[1], 0, 0, dy=0.35), at(agents[0], 1, 0, dy=0.35)
    arrow(ax, left, right, "rendezvous", color=PURPLE, ls="--")
    footer(
        ax,
        "torchrun numbers the agents in rendezvous order: rank 0 is usually on node1, "
        "not always. hpc_ddp.cluster believes torchrun's variables first.",
        'USR1: torchrun ignores it (trap ""), Slurm signals every process of the '
        "step, so the workers get it and checkpoint.",
    )


@figure("layout-per-node.png", 7.0)
def layout_pernode(ax: Axes) -> None:
    """Layout (c): one process per node drives all its GPUs; DDP across nodes"""
    script = """#SBATCH --nodes=2 --ntasks-per-node=1 --gpus-per-node=2
        export HPC_DDP_GPUS_PER_PROCESS=2
        srun python -m hpc_ddp.train --gpus-per-process 2 ..."""
    task = """Slurm sets: SLURM_PROCID={n}  SLURM_NODEID={n}
          SLURM_STEP_NUM_TASKS=2  CUDA_VISIBLE_DEVICES=0,1
        the script: HPC_DDP_GPUS_PER_PROCESS=2
        derived: RANK={n} (= node)  WORLD_SIZE=2 (= nodes)
          LOCAL_RANK=0  MASTER_ADDR=node1  gpus (0, 1)
        model split over cuda:0 and cuda:1;
        DDP(model, device_ids=None)"""
    sh = box(ax, 1.4, 6.45, 10.2, "shell", SBATCH_SHELL, script)
    procs = []
    for n, nb in enumerate(two_nodes(ax, 5.2, 4.25)):
        b = proc(ax, nb[0] + 0.25, 4.8, 5.55, n, f"srun task {n} = rank {n}", task.format(n=n))
        procs.append(b)
        arrow(ax, bottom(sh), top(b), f"srun: 1 task on node{n + 1}", ty=0.1)
        for i, stages in enumerate(["stages 1..k", "stages k+1..n"]):
            src = at(b, 0, 0, dx=1.6 + i * 2.5)  # one process, two arrows: fan them out
            gpu(ax, src, nb[0] + 0.8 + i * 3.1, nb[1] + 1.0, 1.9, i, stages)
    left, right = at(procs[0], 1, 0, dy=0.5), at(procs[1], 0, 0, dy=0.5)
    arrow(ax, left, right, "DDP\nall-reduce", arrowstyle="<|-|>", color=RED, ty=-0.4)
    footer(
        ax,
        "For a model too big for one GPU. --gpus-per-process must agree with "
        "HPC_DDP_GPUS_PER_PROCESS; torchrun is refused for this layout.",
    )


@figure("no-scheduler.png", 9.4)
def no_scheduler(ax: Axes) -> None:
    """No scheduler: hpc-ddp launch pdsh|clush (default --mode torchrun)"""
    launcher = """hpc-ddp launch pdsh
          --hosts 'node[0-1]'
          --gpus-per-node 2 -- ...
        hosts sorted: node0 node1
        master = node0 (node rank 0)
        port = f(launch id)
        reads every output line;
        first failed host -> stop
        every host, exit non-zero"""
    host_script = """check %n = host
        cd, export env,
        --setup lines
        setsid PAYLOAD &
        wait; print
        host=node{n} exit=N"""
    rank = """RANK={rank} LOCAL_RANK={lr}
        WORLD_SIZE=4
        LOCAL_WORLD_SIZE=2
        GROUP_RANK={n}
        MASTER_ADDR=node0
        MASTER_PORT=P
        HPC_DDP_LAUNCH_ID,
         HPC_DDP_LAUNCH_TAG,
         HPC_DDP_GPUS_PER_PROCESS"""
    processes_mode = """hpc_ddp.deploy.shell.node_agent
        starts the 2 processes; each
        process sees:
         HPC_DDP_STARTED_BY=pdsh|clush
         HPC_DDP_NODE_RANK
         HPC_DDP_NUM_NODES
         HPC_DDP_LOCAL_RANK
         HPC_DDP_LOCAL_WORLD_SIZE
         HPC_DDP_MASTER_ADDR, _PORT
         HPC_DDP_JOB_ID
        rank = node_rank x 2 + local"""
    me = box(ax, 0.1, 8.8, 3.9, "shell", "your shell (login node)", launcher)
    runs = (
        "runs:  pdsh -S -R ssh -f 2\n         -w node0,node1 ...\n(clush: -R exec ... ssh %h ...)"
    )
    note(ax, 0.15, me[1] - 0.15, runs, size=9.5)
    for n in range(2):
        ytop = 8.8 - n * 4.05
        host = node(
            ax, 4.3, ytop, 8.6, 3.85, f"host node{n}   (%h = node{n}, %n = {n} = node rank)"
        )
        hs = box(
            ax, 4.4, ytop - 0.45, 2.55, "shell", "host script", host_script.format(n=n), size=9
        )
        args = f"--nnodes 2 --node-rank {n} --nproc-per-node 2\n--master-addr node0 --master-port P"
        ag = box(ax, 7.15, ytop - 0.45, 5.65, "agent", "torchrun (the PAYLOAD)", args, size=9)
        y = ag[1] + ag[3] / 2
        arrow(ax, (hs[0] + hs[2], y), (ag[0], y), color=PURPLE)
        spawn(ax, ag, rank_pair(ax, 7.15, ag[1] - 0.3, 2.77, n, "rank {rank}", rank, size=9))
        y = hs[1] + hs[3] / 2  # the ssh arrows fan out from the launcher into each host script
        arrow(ax, (me[0] + me[2], me[1] + 0.8 - n * 0.4), (host[0], y))
        ax.text(4.15, y + 0.12, "ssh", fontsize=9.5, ha="right")
    box(ax, 0.1, 3.95, 3.9, "note", "--mode processes instead:", processes_mode, size=9)
    footer(ax, items=LEGEND[:4])


@figure("submitit.png", 7.2)
def submitit_fig(ax: Axes) -> None:
    """submitit: the same trainer from Python; submitit requeues it"""
    you = (
        "hpc-ddp submit --executor submitit SPEC.toml\n= AutoExecutor(...).submit(ProgramTask(...))"
    )
    me = box(ax, 0.1, 6.65, 5.0, "shell", "your shell / Python (login node)", you)
    script = "#SBATCH --signal=USR2@<signal_lead_s>\nsrun: one task per process"
    sl = box(ax, 6.6, 6.65, 5.0, "shell", "submitit's sbatch script", script)
    arrow(ax, at(me, 1, 0.5), at(sl, 0, 0.5), "sbatch")
    node(ax, 0.1, 5.2, 12.8, 3.2, "node1  (node2 alike: ranks 2 and 3)")
    on_usr2 = [  # only rank 0's wrapper requeues the job
        "submitit's handler: ProgramTask.checkpoint()\nwaits for the child, submitit requeues",
        "submitit's handler (requeue is rank 0's job)",
    ]
    child = """--requeue none --requeue-signal SIGUSR1,SIGUSR2,SIGTERM
        source slurm: RANK={lr} (SLURM_PROCID), WORLD_SIZE=4
        on any of them: agree, checkpoint, exit 75"""
    for lr in range(2):
        x0 = 0.25 + lr * 6.35
        ids = f"SLURM_PROCID={lr}  SLURM_LOCALID={lr}  SUBMITIT_*"
        text = f"{ids}\nUSR1, USR2, TERM: forward to the child; on USR2\n{on_usr2[lr]}"
        title = f"srun task {lr}: submitit + ProgramTask (no torch)"
        w = box(ax, x0, 4.8, 6.15, "agent", title, text, h=1.19)  # h: both wrappers alike
        arrow(ax, at(sl, 0, 0, dx=1.5 + lr * 2.0), top(w), f"task {lr}", ty=0.05)
        title = f"child: python -m hpc_ddp.train = rank {lr}"
        b = proc(ax, x0, w[1] - 0.4, 6.15, lr, title, child.format(lr=lr))
        arrow(ax, bottom(w), top(b), "starts", color=PURPLE, tx=0.4)
    footer(
        ax,
        "--executor local (submitit's LocalExecutor, one machine): tasks see "
        "SUBMITIT_LOCAL_GLOBALID, _LOCALID, _NODEID, _NTASKS\nand no SLURM_*; master 127.0.0.1, "
        "port derived from the job id. A script or module of yours is the child in the same way "
        "(ProgramTask),\nwith RANK, WORLD_SIZE, MASTER_ADDR... exported and without the "
        "trainer's flags.",
        y=1.42,
        items=LEGEND[:4],
    )


# ------------------------------------------------------------------------------ checkpoints
@figure("checkpoint-commit.png", 8.4)
def checkpoint_fig(ax: Axes) -> None:
    """Checkpoint commit: every rank writes, all agree, rank 0 commits"""
    commit = """read back and hash the others' files
        write manifest.json, fsync
        rename .tmp-step-N -> step-N, fsync
        latest := "step-N" (os.replace)
        prune: keep the newest 2"""
    written = "write + sha256, fsync, rename"
    phases = [  # (what rank 0 does, what the others do, the agreement that ends the phase)
        (
            "remove .tmp-*/.trash-* leftovers\nmkdir .tmp-step-N, fsync",
            "check per_rank is plain data",
        ),
        (f"shared.pt, rank-00000.pt:\n{written}", f"rank-0000R.pt:\n{written}"),
        (commit, "wait"),
    ]
    agreements = [
        "agree #1 (prepare)",
        "agree #2 (write): a failed rank -> all raise",
        "agree #3 (commit): all return step-N",
    ]
    box(ax, 0.1, 7.8, 3.9, "rank0", "rank 0", align="center")
    box(ax, 4.2, 7.8, 3.9, "proc", "ranks 1 .. N-1", align="center")
    bold = dict(fontsize=10, fontweight="bold", color=RED)
    y = 7.2
    for (left, right), agree in zip(phases, agreements, strict=True):
        lb = box(ax, 0.1, y, 3.9, "rank0", "", left)
        box(ax, 4.2, y, 3.9, "proc", "", right, h=lb[3])
        y = lb[1] - 0.3
        ax.plot([0.1, 8.1], [y, y], color=RED, lw=3)  # an agreement: a bar across all ranks
        ax.text(4.1, y - 0.08, agree, ha="center", va="top", **bold)
        y -= 0.55
    arrowprops = dict(arrowstyle="-|>", color=RED, lw=1.5)  # at the rename in rank 0's last box
    xy, xytext = (3.25, lb[1] + 0.55), (4.6, lb[1] + 0.5)
    ax.annotate("THE COMMIT POINT", xy, xytext, va="center", arrowprops=arrowprops, **bold)
    footer(
        ax,
        "An agreement is an all-reduce that every rank reaches whether its own "
        "part worked\nor not: a full disk on one rank makes every rank raise within "
        "milliseconds,\nnaming that rank, and nothing is committed.",
        "Reading back: the step that latest names, else older ones whose "
        'manifest\nverifies (log: "checkpoint: fell back to step-... after 1 unusable one(s)").',
        y=y - 0.75,
        items=[],
    )
    after = """latest  ("step-00000120")
        step-00000080/
        step-00000120/
          shared.pt
          rank-00000.pt ...
          manifest.json (sizes, sha256)"""
    before = 'latest  ("step-00000080")\nstep-00000040/\nstep-00000080/'
    states = [  # the directory before, after a crash mid-save (unchanged but for a tmp dir), after
        ("before the save", before),
        (
            "crash during the save",
            f"{before}\n.tmp-step-00000120/  never read,\n  removed by the next save/load",
        ),
        ("after the commit point", after),
    ]
    ax.text(8.5, 7.75, "run/checkpoints/  (keep=2)", fontsize=11, fontweight="bold", va="top")
    y = 7.3
    for i, (title, text) in enumerate(states):
        b = box(ax, 8.5, y, 4.4, "rank0" if i == 2 else "node", title, text, size=9)
        y = b[1] - 0.3
        if i < 2:
            arrow(ax, (10.7, b[1]), (10.7, y), color="#888888")


def step_row(ax: Axes, ytop: float, slots: list[int], kinds: str, steps: list[str]) -> list[Box]:
    """Equal boxes in the given slots of a row of five; a step's first line is its title."""
    return [
        box(ax, 0.15 + slot * 2.62, ytop, 2.3, kind, *step.split("\n", 1), h=1.55)
        for slot, kind, step in zip(slots, kinds.split(), steps, strict=True)
    ]


@figure("preemption.png", 6.6)
def preemption_fig(ax: Axes) -> None:
    """Preemption: signal, flag, agree, checkpoint, requeue, exit 75, resume"""
    steps = [  # 1-5 left to right, then 6-9 right to left under them: a loop on the page
        "1. signal\nUSR1 before the\nlimit (--signal=\nUSR1@N); TERM at\npreemption",
        "2. handler\nsets a flag,\nnothing else\n(every rank)",
        "3. step boundary\nall_reduce of\n(loss, n, flag):\nany rank flagged?",
        "4. checkpoint\ntogether: tmp dir,\nfsync, agree,\nmanifest, rename,\nlatest moves",
        "5. rank 0\nscontrol requeue\n$SLURM_JOB_ID\n(array: JOB_TASK)",
        '6. exit 75\nevery rank\nprogress.json:\n"preempted"',
        "7. Slurm\njob PENDING;\nstarts again after\ncred_expire +\na scheduler pass",
        "8. job restarts\nSLURM_RESTART_COUNT\n=1; the same log\n"
        "file continues\n(--open-mode=append)",
        "9. resume\nnewest verified\ncheckpoint; same\nsample, same RNG:\nsame weights",
    ]
    # Colours: Slurm's side (shell), what every rank does (proc), what rank 0 alone does (rank0).
    b1 = step_row(ax, 5.3, [0, 1, 2, 3, 4], "shell proc proc proc rank0", steps[:5])
    b2 = step_row(ax, 2.95, [4, 3, 2, 1], "proc shell shell proc", steps[5:])
    for i, (a, b) in enumerate(pairwise(b1)):
        arrow(ax, at(a, 1, 0.5), at(b, 0, 0.5), "yes" if i == 2 else "", ty=0.2)
    arrow(ax, bottom(b1[4]), top(b2[0]))
    for a, b in pairwise(b2):
        arrow(ax, at(a, 0, 0.5), at(b, 1, 0.5))
    back = (at(b1[2], 0, 1, dx=0.4), at(b1[1], 1, 1, dx=-0.4))  # the loop back over the top
    arrow(ax, *back, "no: next step", connectionstyle="arc3,rad=0.6", ty=0.35, color="#666666")
    note(
        ax,
        0.15,
        1.1,
        "submitit: the signal is USR2 and submitit requeues (the trainer runs with "
        "--requeue none).\ntorchrun: the workers get USR1 straight from Slurm and exit 75; "
        "torchrun itself exits 1.\npdsh/clush or no scheduler: steps 1-4 and 6; nothing requeues: "
        "run the same command again and it resumes.",
    )


# ------------------------------------------------------------------------------------ steps
def span(
    ax: Axes, x0: float, x1: float, y: float, kind: str, label: str, *, under: bool = False
) -> None:
    """A stretch of work on a stream: a bar from x0 to x1 inches at height y, labelled inside
    (``under``: below it, for bars too short to hold their label)."""
    face, edge, h = *C[kind], 0.36
    ax.add_patch(FancyBboxPatch((x0, y), x1 - x0, h, boxstyle="square,pad=0", fc=face, ec=edge))
    ty, va = (y - 0.05, "top") if under else (y + h / 2, "center")
    ax.text((x0 + x1) / 2, ty, label, fontsize=9, ha="center", va=va, c="#222222")


@figure("captured-step.png", 5.6)
def captured_step(ax: Axes) -> None:
    """The captured step on 4 GPUs: gradient all-reduce after backward, or bucket by bucket"""
    ms = 0.9  # inches per millisecond; the phases inside a step are drawn to a rough scale
    x0 = 2.6
    rows = [  # title, measured total ms, end of backward, NCCL spans (start, end, label) in ms
        ("no all-reduce\n(1 GPU)", 10.66, 10.30, []),
        (
            "before: one all-reduce\nafter backward",
            10.97,
            10.30,
            [(10.30, 10.61, "one all-reduce")],
        ),
        (
            "now: buckets started\nduring backward",
            10.87,
            10.45,
            [(5.2, 5.45, "bucket 1"), (7.2, 7.9, "bucket 2"), (10.45, 10.51, "bucket 3")],
        ),
    ]
    y = 4.45
    for title, total, backward_end, nccl in rows:
        ax.text(0.2, y + 0.48, title, fontsize=10, va="center", fontweight="bold")
        span(ax, x0, x0 + 3.4 * ms, y + 0.3, "gpu", "forward")
        span(
            ax, x0 + 3.4 * ms, x0 + backward_end * ms, y + 0.3, "gpu", "backward (last layer first)"
        )
        update = max([backward_end, *(b for _, b, _ in nccl)])
        span(ax, x0 + update * ms, x0 + total * ms, y + 0.3, "gpu", "opt")
        for a, b, label in nccl:
            span(ax, x0 + a * ms, x0 + b * ms, y - 0.1, "agent", label, under=True)
        ax.text(x0 + total * ms + 0.1, y + 0.48, f"{total:.2f} ms", fontsize=10, va="center")
        y -= 1.25
    footer(
        ax,
        "Measured on 4 x H200, ResNet-18, bf16, batch 256 per GPU: the step's GPU time per replay,"
        " the same on every rank (benchmarks/README.md).\nThe phases inside a step are schematic."
        " The 42.8 MiB of gradients go in 3 buckets (DDP's sizes); overlapped, the all-reduce still"
        " costs 0.21 ms:\nNCCL's kernels slow the backward they run beside.",
        y=0.95,
        items=[("gpu", "compute stream"), ("agent", "NCCL stream (all-reduce)")],
    )


# ------------------------------------------------------------------------------- the house
def import_layers() -> tuple[list[list[str]], dict[str, set[str]]]:
    """The package-level import graph of the tree as it is now, read by the same ``ast`` reader
    as tests/test_import_graph.py: its rows (row 0 imports nothing of the package; every node
    sits one row above the highest node it imports) and its arrows, an arrow left out where a
    longer path already implies it (the transitive reduction). Nothing is hard-coded: the
    picture follows the tree."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_import_graph import module_graph, package_graph

    modules = module_graph()
    edges = {node: set(targets) for node, targets in package_graph(modules).items()}
    for module in modules:  # a node that imports nothing of the package is drawn too
        edges.setdefault(".".join(module.split(".")[:2]), set())

    @cache
    def row(node: str) -> int:
        return 1 + max((row(t) for t in edges[node]), default=-1)

    @cache
    def below(node: str) -> frozenset[str]:
        return frozenset().union(*({t} | below(t) for t in edges[node]))

    arrows = {
        node: {t for t in targets if not any(t in below(o) for o in targets - {t})}
        for node, targets in edges.items()
    }
    rows: list[list[str]] = [[] for _ in range(1 + max(map(row, edges)))]
    for node in sorted(edges):
        rows[row(node)].append(node)
    for _ in range(2):  # order each row by where what it imports sits: fewer crossings
        for k in range(1, len(rows)):
            place = {n: i / max(1, len(r) - 1) for r in rows[:k] for i, n in enumerate(r)}
            rows[k].sort(key=lambda n: sum(place[t] for t in arrows[n]) / max(1, len(arrows[n])))
    return rows, arrows


def node_label(node: str) -> str:
    name = node.removeprefix("hpc_ddp.") if node != "hpc_ddp" else "__init__"
    return f"{name}/" if (ROOT / "hpc_ddp" / name).is_dir() else f"{name}.py"


@figure("house.png", 10.4)
def house(ax: Axes) -> None:
    """The house: hpc_ddp's modules and subpackages, each above what it imports"""
    rows, arrows = import_layers()
    gap = (10.4 - 2.2) / len(rows)
    boxes: dict[str, Box] = {}
    for k, members in enumerate(rows):
        widths = [0.35 + 0.085 * len(node_label(n)) for n in members]
        x = (13 - sum(widths) - 0.35 * (len(members) - 1)) / 2
        for node, w in zip(members, widths, strict=True):
            label = node_label(node)
            kind = "rank0" if node == "hpc_ddp.train" else "agent" if label[-1] == "/" else "note"
            boxes[node] = box(ax, x, 1.55 + (k + 0.5) * gap, w, kind, text=label, h=0.34,
                              size=9, align="center")  # fmt: skip
            x += w + 0.35
    row_of = {n: k for k, members in enumerate(rows) for n in members}
    for node, targets in arrows.items():
        for target in targets:
            # An arrow past a row bends, so that it does not run through that row's boxes.
            leftwards = top(boxes[target])[0] < bottom(boxes[node])[0]
            bend = (0.12 if leftwards else -0.12) if row_of[node] - row_of[target] > 1 else 0
            arrow(ax, bottom(boxes[node]), top(boxes[target]), lw=0.8, color="#777777",
                  mutation_scale=8, connectionstyle=f"arc3,rad={bend}")  # fmt: skip
    footer(
        ax,
        "Read from the source by tests/test_import_graph.py's reader: an arrow is an import, lazy "
        "ones included; an arrow a longer path implies is left out.",
        y=0.95,
        items=[("agent", "subpackage"), ("note", "module"), ("rank0", "the trainer")],
    )


def main(names: list[str]) -> None:
    unknown = set(names) - {name for name, _, _ in FIGURES}
    if unknown:
        raise SystemExit(f"no figure named {', '.join(sorted(unknown))}")
    for name, h, draw in FIGURES:
        if names and name not in names:
            continue
        fig, ax = canvas(13, h, draw.__doc__ or "")
        draw(ax)
        save(fig, name)


if __name__ == "__main__":
    main(sys.argv[1:])
