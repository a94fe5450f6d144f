"""What a run leaves behind (rank 0 only): result.json, metrics.jsonl, plot.png, progress.json."""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from hpc_ddp import regular_file
from hpc_ddp.private_paths import replace_file
from hpc_ddp.run_dir.paths import RunPaths

# What a finished run shows of its result.json: the trainer at its end, a re-run of a finished
# run's command (hpc_ddp.train.finished) and ``hpc-ddp submit`` print these lines.
RESULT_KEYS = (
    "status",
    "epochs",
    "steps",
    "world_size",
    "test_accuracy",
    "train_loss",
    "params_sha256",
    "wall_seconds",
    "train_wall_seconds",
)


Status = Literal["finished", "preempted"]  # preempted: checkpointed, exit code 75 (requeue)


@dataclass
class Result:
    """The outcome of ``train()``."""

    status: Status
    exit_code: int
    epochs: int
    steps: int
    world_size: int
    train_loss: float | None
    test_loss: float | None
    test_accuracy: float | None
    test_samples: int
    samples_per_second: float
    wall_seconds: float
    params_sha256: str
    run_dir: str
    interruptions: int = 0
    # Of wall_seconds, the training loop's (resume.Clock); 0 in a result.json from before it.
    train_wall_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def finished_epochs(result: Any) -> int | None:
    """The epochs a finished run trained, from its ``result.json``; None when the record is
    not a finished run's (another status, ``epochs`` not a whole number >= 1, not an object)."""
    if not isinstance(result, dict) or result.get("status") != "finished":
        return None
    epochs = result.get("epochs")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        return None
    return epochs


def result_lines(result: Mapping[str, Any]) -> list[str]:
    return [f"  {k}: {result[k]}" for k in RESULT_KEYS if k in result]


def summary_lines(result: Mapping[str, Any], run_dir: str | Path) -> list[str]:
    """``result (<run-dir>/result.json):`` and the RESULT_KEYS lines under it."""
    return [f"result ({RunPaths(run_dir).result}):", *result_lines(result)]


def write_json(path: Path, data: Any) -> None:
    """Atomic (readers such as tests and monitors never see a half-written file), and never
    through a link at ``path`` (private_paths.replace_file)."""
    replace_file(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: Path) -> Any:
    """A run dir's JSON record, through ``regular_file`` (a FIFO planted there cannot block)."""
    return regular_file.read_json(path)


def write_metrics(run_dir: Path, history: list[dict[str, Any]]) -> None:
    """Rewrite metrics.jsonl from the checkpointed history, so a resume never duplicates lines."""
    lines = "".join(json.dumps(row, sort_keys=True) + "\n" for row in history)
    replace_file(RunPaths(run_dir).metrics, lines.encode())


def plot(run_dir: Path, history: list[dict[str, Any]]) -> Path:
    """Loss and accuracy per epoch as a PNG (matplotlib's Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs = [row["epoch"] for row in history]
    # Fixed margins, not tight_layout(): its measuring of the text costs about what savefig's
    # render does, on the command's way to its exit. They fit tick labels of up to six characters.
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    fig.subplots_adjust(left=0.08, right=0.985, bottom=0.12, top=0.92, wspace=0.22)
    ax_loss.plot(epochs, [row["train_loss"] for row in history], marker="o", label="train")
    ax_loss.plot(epochs, [row["test_loss"] for row in history], marker="o", label="test")
    ax_loss.set(xlabel="epoch", ylabel="loss", title="loss")
    ax_loss.legend()
    ax_acc.plot(epochs, [100 * row["test_accuracy"] for row in history], marker="o")
    ax_acc.set(xlabel="epoch", ylabel="accuracy (%)", title="test accuracy", ylim=(0, 100))
    for ax in (ax_loss, ax_acc):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
    png = io.BytesIO()  # matplotlib would open a path through a link: hand it bytes instead
    fig.savefig(png, format="png", dpi=80)
    plt.close(fig)
    out = RunPaths(run_dir).plot
    replace_file(out, png.getvalue())
    return out
