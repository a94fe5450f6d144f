"""The house's shape, read from the source with ``ast`` (nothing is imported): no module import
cycle; at the package level (each subpackage and each top-level module one node) no cycle
either; the trainer is an application on top, imported by no lower layer; the deployment layer
never imports the embedded cluster. An import inside a function counts (a lazy import is still a
dependency), and so does ``importlib.import_module`` of a literal name; one under
``if TYPE_CHECKING:`` does not (annotations only).
"""

from __future__ import annotations

import ast
import itertools
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hpc_ddp"
# The nodes allowed to import the trainer: the trainer itself and what sits above it.
ABOVE_THE_TRAINER = {"hpc_ddp", "hpc_ddp.train", "hpc_ddp.commands", "hpc_ddp.cli"}
IMPORT_CALLS = ("import_module", "__import__")


def typing_only_nodes(tree: ast.Module) -> set[int]:
    """The ids of the nodes under an ``if TYPE_CHECKING:`` (annotations only)."""
    return {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for stmt in node.body
        for inner in ast.walk(stmt)
    }


def module_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports. An import of one of the module's own
    packages is left out: Python imports those first anyway, and the package's lazy facade
    (hpc_ddp/__init__.py) only names its submodules."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        modules[name] = (path, name if is_package else name.rpartition(".")[0])

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    facade = public_modules(package)
    graph: dict[str, set[str]] = {}
    for name, (path, home) in modules.items():
        targets: set[str | None] = set()
        tree = ast.parse(path.read_text(), str(path))
        typing_only = typing_only_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets |= {known(alias.name) for alias in node.names}
            elif isinstance(node, ast.Call) and node.args:
                # importlib.import_module("hpc_ddp.x") / __import__: an import all the same
                first, call = node.args[0], ast.unparse(node.func)
                if isinstance(first, ast.Constant) and call.endswith(IMPORT_CALLS):
                    targets.add(known(str(first.value)))
            elif isinstance(node, ast.ImportFrom):
                base = home
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.level else node.module or ""
                source = source.rstrip(".")
                if source == package.name:  # the lazy facade: each name's own module
                    targets |= {known(facade.get(a.name, f"{source}.{a.name}")) for a in node.names}
                elif source.startswith(package.name):
                    targets |= {known(source)} | {known(f"{source}.{a.name}") for a in node.names}
        graph[name] = {t for t in targets if t and t != name and not name.startswith(t + ".")}
    return graph


def package_graph(modules: dict[str, set[str]]) -> dict[str, dict[str, set[str]]]:
    """Node -> imported node -> the modules whose imports make that edge; a node is a top-level
    module or a subpackage (``hpc_ddp.deploy`` for everything under it)."""

    def node(module: str) -> str:
        return ".".join(module.split(".")[:2])

    edges: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for module, targets in modules.items():
        for target in targets:
            if node(target) not in (node(module), "hpc_ddp"):
                edges[node(module)][node(target)].add(module)
    return edges


def find_cycle(graph: dict[str, set[str]] | dict[str, dict[str, set[str]]]) -> list[str] | None:
    """One cycle of the graph, as its nodes in order (the first again at the end), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_module_import_cycle() -> None:
    graph = module_graph()
    assert "hpc_ddp.deploy.shell.host_scripts" in graph  # the walk found the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_package_level_import_cycle() -> None:
    edges = package_graph(module_graph())
    cycle = find_cycle(edges)
    if cycle:
        why = [f"{a} -> {b}: {sorted(edges[a][b])}" for a, b in itertools.pairwise(cycle)]
        raise AssertionError("import cycle " + " -> ".join(cycle) + "\n" + "\n".join(why))


def test_no_lower_layer_imports_the_trainer() -> None:
    edges = package_graph(module_graph())
    importers = {
        node: sorted(targets["hpc_ddp.train"])
        for node, targets in edges.items()
        if "hpc_ddp.train" in targets and node not in ABOVE_THE_TRAINER
    }
    assert not importers, importers


def test_no_deploy_module_imports_the_embedded_cluster() -> None:
    """Production code takes Slurm from hpc_ddp.slurm_client; the embedded cluster is the
    default of the layer above (hpc_ddp.submission, the commands), never deploy's."""
    edges = package_graph(module_graph())
    assert "hpc_ddp.localslurm" not in edges["hpc_ddp.deploy"], edges["hpc_ddp.deploy"]


def test_the_run_dir_sits_under_every_layer_that_uses_it() -> None:
    """One owner of a run directory (its names, marker and lock), torch-free and below the
    checkpoints, the runtime, deploy and the trainer, which all use it."""
    modules = module_graph()
    assert "hpc_ddp.run_dir" in modules
    users = {"hpc_ddp.checkpoint", "hpc_ddp.runtime", "hpc_ddp.deploy", "hpc_ddp.train"}
    assert not set(package_graph(modules)["hpc_ddp.run_dir"]) & users


def test_the_reader_sees_lazy_and_relative_imports_not_typing_ones(tmp_path: Path) -> None:
    package = tmp_path / "hpc_ddp"
    (package / "deploy").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text("y = 1\n")
    (package / "cli.py").write_text("x = 1\n")
    (package / "commands.py").write_text("x = 1\n")
    (package / "deploy" / "__init__.py").write_text("from .core import f\n")
    (package / "deploy" / "core.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from hpc_ddp.commands import x\n"
        "def f():\n    from hpc_ddp.train import y\n"
        "def g():\n    importlib.import_module('hpc_ddp.cli')\n"
    )
    modules = module_graph(package)
    assert modules["hpc_ddp.deploy.core"] == {"hpc_ddp.train", "hpc_ddp.cli"}
    assert modules["hpc_ddp.deploy"] == {"hpc_ddp.deploy.core"}
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def launcher_comparisons(package: Path = PACKAGE / "deploy") -> list[str]:
    """Where the deployment code compares a launcher (``launcher ==``/``!=``) with a name, as
    ``path:line``: the Slurm launchers' differences belong in their table
    (hpc_ddp.deploy.launchers), so that a new one is an entry there, not a branch in each module."""

    def is_launcher(node: ast.expr) -> bool:
        return (isinstance(node, ast.Name) and node.id == "launcher") or (
            isinstance(node, ast.Attribute) and node.attr == "launcher"
        )

    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare) and any(
                isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops
            ):
                sides = [node.left, *node.comparators]
                if any(is_launcher(side) for side in sides) and any(
                    isinstance(side, ast.Constant) for side in sides
                ):
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno}")
    return found


def test_the_deployment_code_asks_the_launcher_table_not_the_launchers_name() -> None:
    assert not launcher_comparisons(), launcher_comparisons()


def test_the_launcher_comparison_reader_sees_both_spellings(tmp_path: Path) -> None:
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "m.py").write_text(
        'if spec.launcher == "torchrun": pass\nif "srun" != launcher: pass\n'
        'if spec.launcher in LAUNCHERS: pass\nif spec.layout == "cpu": pass\n'
    )
    assert launcher_comparisons(tmp_path / "deploy") == ["deploy/m.py:1", "deploy/m.py:2"]


def executor_comparisons(
    packages: tuple[Path, ...] = (PACKAGE / "deploy", PACKAGE / "commands"),
) -> list[str]:
    """Where the deployment code or a command compares an executor (``executor ==``/``!=``/
    ``in``) with a name or a tuple of names, as ``path:line``: what tells the executors apart
    belongs in their table (hpc_ddp.deploy.executors), so that a new one is an entry there, not
    a branch in each module."""

    def is_executor(node: ast.expr) -> bool:
        return (isinstance(node, ast.Name) and node.id == "executor") or (
            isinstance(node, ast.Attribute) and node.attr == "executor"
        )

    def is_names(node: ast.expr) -> bool:
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return bool(node.elts) and all(is_names(elt) for elt in node.elts)
        return isinstance(node, ast.Constant) and isinstance(node.value, str)

    found = []
    for package in packages:
        for path in sorted(package.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Compare):
                    sides = [node.left, *node.comparators]
                    if any(is_executor(side) for side in sides) and any(
                        is_names(side) for side in sides
                    ):
                        found.append(f"{path.relative_to(package.parent)}:{node.lineno}")
    return found


def test_the_deployment_code_and_commands_ask_the_executor_table_not_the_name() -> None:
    assert not executor_comparisons(), executor_comparisons()


def test_the_executor_comparison_reader_sees_every_spelling(tmp_path: Path) -> None:
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "m.py").write_text(
        'if job.executor == "local": pass\nif "sbatch" != executor: pass\n'
        'if executor in ("pdsh", "clush"): pass\nif job.executor not in ["a"]: pass\n'
        "if executor in EXECUTORS: pass\nif executor not in (None, job.tool): pass\n"
        'if spec.kind == "local": pass\n'
    )
    found = executor_comparisons((tmp_path / "deploy",))
    assert found == ["deploy/m.py:1", "deploy/m.py:2", "deploy/m.py:3", "deploy/m.py:4"]


def launcher_definitions(package: Path = PACKAGE) -> list[str]:
    """Where the package defines a launcher outside the deployment layer, as ``path[:line]``: a
    module named after one, or a type or table of them (``Launcher``, ``LAUNCHERS``, a class
    ending in ``Launcher``). "Launcher" is a JobSpec's (srun, torchrun: deploy/launchers.py); the
    toolkit's own starters (pdsh, clush, spawn) and their contract's reader have their own names.
    """
    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package.parent)
        if where.parts[1] == "deploy":
            continue
        if "launcher" in path.stem:
            found.append(str(where))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [node.name] if isinstance(node, ast.ClassDef) else []
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
            found += [
                f"{where}:{node.lineno}"
                for name in names
                if name in ("Launcher", "LAUNCHERS") or name.endswith("Launcher")
            ]
    return found


def test_launcher_means_a_jobspecs_launcher_only() -> None:
    assert not launcher_definitions(), launcher_definitions()


def test_the_launcher_definition_reader_sees_modules_types_and_tables(tmp_path: Path) -> None:
    (tmp_path / "hpc_ddp" / "cluster").mkdir(parents=True)
    (tmp_path / "hpc_ddp" / "deploy").mkdir()
    (tmp_path / "hpc_ddp" / "cluster" / "launcher.py").write_text("x = 1\n")
    (tmp_path / "hpc_ddp" / "env_vars.py").write_text(
        'Launcher = Literal["pdsh"]\nLAUNCHERS: tuple = ()\nclass ShellLauncher: pass\n'
        "launcher_env = {}\n"
    )
    (tmp_path / "hpc_ddp" / "deploy" / "launchers.py").write_text("LAUNCHERS = {}\n")
    found = launcher_definitions(tmp_path / "hpc_ddp")
    assert found == [
        "hpc_ddp/cluster/launcher.py",
        "hpc_ddp/env_vars.py:1",
        "hpc_ddp/env_vars.py:2",
        "hpc_ddp/env_vars.py:3",
    ]


# What the trainer may import from outside hpc_ddp/train besides the public API: the package's
# torch-free helpers that every layer shares and that hold no layer's logic (errors, logging,
# bounded reads of files, private files, polling, settings, optional extras, variable names,
# the DTensor check that spares a DDP run an import),
# and the run directory's layout, which every program writing a run dir shares.
FOUNDATION = {
    "hpc_ddp.errors",
    "hpc_ddp.exit_codes",
    "hpc_ddp.log",
    "hpc_ddp.regular_file",
    "hpc_ddp.private_paths",
    "hpc_ddp.polling",
    "hpc_ddp.schema",
    "hpc_ddp.extras",
    "hpc_ddp.env_vars",
    "hpc_ddp.dtensors",
}
RUN_DIRECTORY = {
    "hpc_ddp.run_dir",
    "hpc_ddp.run_dir.paths",
    "hpc_ddp.run_dir.lock",
    "hpc_ddp.run_dir.marker",
    "hpc_ddp.checkpoint.committed",
}


def public_modules(package: Path = PACKAGE) -> dict[str, str]:
    """``_PUBLIC`` of the package's ``__init__.py``: each public name -> the module defining it
    (empty for a package without one)."""
    init = package / "__init__.py"
    tree = ast.parse(init.read_text()) if init.exists() else ast.Module(body=[], type_ignores=[])
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "_PUBLIC":
            assert isinstance(node.value, ast.Dict)
            return {name: module for name, (module, _) in ast.literal_eval(node.value).items()}
    return {}


def public_names(package: Path = PACKAGE) -> set[str]:
    """The keys of ``_PUBLIC``: the public API."""
    names = set(public_modules(package))
    assert names, f"no _PUBLIC in {package / '__init__.py'}"
    return names


def private_imports(package: Path = PACKAGE, application: str = "train") -> list[str]:
    """Each import of a module under ``package/application`` that reaches outside it for
    something other than a public name (``from hpc_ddp import X``, X in ``_PUBLIC``) or the
    foundation, as ``path:line: what``. As for the graph above, an import under
    ``if TYPE_CHECKING:`` does not count (annotations only)."""
    public = public_names(package)
    inside = f"{package.name}.{application}"
    allowed = FOUNDATION | RUN_DIRECTORY

    def outside(module: str) -> bool:
        return module.startswith(package.name + ".") and not (
            module == inside or module.startswith(inside + ".")
        )

    found = []
    root = package / application
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(package.parent)
        tree = ast.parse(path.read_text(), str(path))
        typing_only = typing_only_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names if outside(alias.name)]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == package.name:
                    names = [f"{package.name}.{a.name}" for a in node.names if a.name not in public]
                    names = [name for name in names if name not in allowed]
                elif outside(node.module) and node.module not in allowed:
                    names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Call) and node.args:
                first, call = node.args[0], ast.unparse(node.func)
                literal = str(first.value) if isinstance(first, ast.Constant) else ""
                if call.endswith(IMPORT_CALLS) and outside(literal) and literal not in allowed:
                    names = [literal]
            found += [f"{where}:{node.lineno}: {name}" for name in names]
    return found


def test_the_trainer_imports_only_public_names() -> None:
    """The built-in trainer is an application of the public API: what it needs from the layers
    below is what a script of the user's can import too."""
    assert not private_imports(), "\n".join(private_imports())


def test_the_private_import_reader_sees_every_spelling(tmp_path: Path) -> None:
    package = tmp_path / "hpc_ddp"
    (package / "train").mkdir(parents=True)
    (package / "__init__.py").write_text('_PUBLIC: dict = {"Resumable": ("m", "a")}\n')
    (package / "train" / "m.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from hpc_ddp import Resumable, schema, secret\n"  # 2: secret
        "from hpc_ddp.runtime.rng import capture\n"  # 3
        "import hpc_ddp.dist\n"  # 4
        "from hpc_ddp.errors import ConfigError\n"
        "from hpc_ddp.train.loop import Stepper\n"
        "if TYPE_CHECKING:\n    from hpc_ddp.dist import DistContext\n"
        "def f():\n    importlib.import_module('hpc_ddp.spawn')\n"  # 10
    )
    assert private_imports(package) == [
        "hpc_ddp/train/m.py:2: hpc_ddp.secret",
        "hpc_ddp/train/m.py:3: hpc_ddp.runtime.rng.capture",
        "hpc_ddp/train/m.py:4: hpc_ddp.dist",
        "hpc_ddp/train/m.py:10: hpc_ddp.spawn",
    ]
