"""The package list: everything under hpc_ddp/ plus the top-level templates/ mapped into it.

All other metadata is in pyproject.toml; this file exists because setuptools' automatic
discovery cannot see a package whose folder ``[tool.setuptools.package-dir]`` maps elsewhere.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["hpc_ddp", "hpc_ddp.*"]), "hpc_ddp._templates"])
