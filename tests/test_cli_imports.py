"""The commands that do not train never import torch (1.5-2 s here; docs/architecture.md).

Each command module, with the modules it imports at load time, is imported in a fresh
interpreter. test_env_command, test_render and test_doctor also run their commands whole.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from hpc_ddp.cli import COMMANDS

TORCH_FREE = (
    "env", "render", "submit", "status", "logs", "cancel", "launch", "doctor", "cluster"
)  # fmt: skip


def test_every_torch_free_command_exists() -> None:
    assert set(TORCH_FREE) <= set(COMMANDS)


@pytest.mark.parametrize("command", TORCH_FREE)
def test_command_module_does_not_import_torch(command: str) -> None:
    code = (
        "import importlib, sys; importlib.import_module(sys.argv[1]); "
        "print(sorted(m for m in ('torch', 'torchvision') if m in sys.modules))"
    )
    module = f"hpc_ddp.commands.{command}"
    out = subprocess.run(
        [sys.executable, "-c", code, module], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"{module} imports {out.stdout.strip()}"


def _help_pages() -> list[list[str]]:
    """Every command's ``--help`` and each of its subcommands', read from its own parser."""
    pages = []
    for name in COMMANDS:
        parser = argparse.ArgumentParser()
        importlib.import_module(f"hpc_ddp.commands.{name}").add_arguments(parser)
        pages.append([name, "--help"])
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                pages += [[name, sub, "--help"] for sub in action.choices]
    return pages


HELP_PAGES = _help_pages()


@pytest.mark.parametrize("argv", HELP_PAGES, ids=" ".join)
def test_every_help_page_renders(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """argparse formats help strings with %: a bare '%' in one breaks only that --help."""
    from hpc_ddp.cli import main

    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: hpc-ddp {argv[0]}")


def test_train_help_says_nproc_per_node_forks_workers() -> None:
    """``hpc-ddp train --help`` as a user runs it: it does not claim to train "in this process"
    when ``--nproc-per-node`` forks workers."""
    done = subprocess.run(
        [sys.executable, "-m", "hpc_ddp.cli", "train", "--help"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    page = " ".join(done.stdout.split())  # argparse wraps lines
    assert "in this process" not in page, page
    assert "or N on this machine with --nproc-per-node N" in page, page
    assert "fork N worker processes on this machine" in page, page
