"""scripts/install.sh: which extras it installs."""

from __future__ import annotations

from pathlib import Path

from hpc_ddp.extras import EXTRAS
from hpc_ddp.schema import load_file

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "install.sh"


def test_the_all_extra_that_install_sh_installs_holds_every_extra() -> None:
    """A missing extra's hint says scripts/install.sh installs every extra: it installs
    hpc-ddp[all], so [all] must pull in each extra the commands can ask for."""
    pyproject = load_file(REPO / "pyproject.toml", what="pyproject.toml")
    extras = pyproject["project"]["optional-dependencies"]
    (requirement,) = extras["all"]
    assert requirement.startswith("hpc-ddp[")
    assert set(requirement[len("hpc-ddp[") : -1].split(",")) == set(EXTRAS)
    assert 'extras="[all]"' in SCRIPT.read_text()
