"""The package layout: stages import one way, ``models`` knows nothing of RL, the benchmark and
experiment scripts are flat entry points over one kit each, and every module stays short
enough to read in one sitting."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sparse_rl_jax"
BENCHMARKS = ROOT / "benchmarks"
KIT = BENCHMARKS / "kit"
EXPERIMENTS = ROOT / "experiments"
EXPERIMENT_KIT = EXPERIMENTS / "kit"

# stage -> the stages it may import (besides itself and ``models``)
ALLOWED = {
    "core": set(),
    "kv": {"core"},
    "tasks": {"core"},
    "rollout": {"core", "kv"},
    "rl": {"core", "kv", "rollout"},
    "records": {"core"},
    "training": {"core", "kv", "tasks", "rollout", "rl", "records"},
}
MAX_LINES = 400


def imported(path: Path) -> set[str]:
    """Dotted names of every module ``path`` imports (at any depth of the file)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{alias.name}" for alias in node.names}
    return out


def test_the_stages_are_the_packages():
    found = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert found == set(ALLOWED)
    assert not [p.name for p in PACKAGE.glob("*.py") if p.name not in {"__init__.py", "cli.py"}]


@pytest.mark.parametrize("stage", sorted(ALLOWED))
def test_stages_import_one_way(stage):
    wrong = []
    for path in sorted((PACKAGE / stage).glob("*.py")):
        for name in imported(path):
            parts = name.split(".")
            if parts[0] == "sparse_rl_jax" and len(parts) > 1 and parts[1] in ALLOWED \
                    and parts[1] != stage and parts[1] not in ALLOWED[stage]:
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
            if parts[0] == "sparse_rl_jax" and len(parts) > 1 and parts[1] == "cli":
                wrong.append(f"{path.relative_to(ROOT)} imports the command line")
    assert not wrong


def test_models_never_import_the_rl_library():
    wrong = [f"{p.relative_to(ROOT)} imports {name}" for p in sorted((ROOT / "models").glob("*.py"))
             for name in imported(p) if name.split(".")[0] == "sparse_rl_jax"]
    assert not wrong


def test_no_module_is_longer_than_one_sitting():
    long = [f"{p.relative_to(ROOT)}: {n} lines"
            for p in sorted([*PACKAGE.rglob("*.py"), *(ROOT / "models").glob("*.py"),
                             *KIT.glob("*.py"), *EXPERIMENT_KIT.glob("*.py")])
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_layout_page_names_every_module():
    """``docs/layout.md`` names every module of the library, of ``models``, of the measuring
    kit and of the experiments' kit (so a new module lands with its line there)."""
    page = (ROOT / "docs" / "layout.md").read_text()
    missing = [str(p.relative_to(ROOT))
               for p in sorted([*PACKAGE.glob("*/*.py"), *(ROOT / "models").glob("*.py"),
                                *KIT.glob("*.py"), *EXPERIMENT_KIT.glob("*.py")])
               if p.name != "__init__.py" and f"{p.name}`" not in page]
    assert not missing, f"modules docs/layout.md does not name: {missing}"


OTHER_TREES = {"benchmarks", "experiments", "tools", "tests", "run"}  # and run.py


def script_imports_wrong(path: Path, tree: Path, scripts: set[str], kit: set[str],
                         allowed: set[str]) -> list[str]:
    """What ``path`` (a script of ``tree``, or a module of its kit) imports that it must not:
    another script (by its bare name or as ``<tree>.<script>``), the kit or one of its modules
    by a bare name (the kit is ``<tree>.kit``), anything else under ``tree``, or another tree
    of the repository (``OTHER_TREES``) but the packages in ``allowed`` (e.g. ``benchmarks.kit``);
    a kit module also never imports a script."""
    def other_tree(name):
        return name.split(".")[0] in OTHER_TREES - {tree.name} and not any(
            f"{name}.".startswith(f"{ok}.") or ok.startswith(f"{name}.") for ok in allowed)
    bad = set()
    for name in imported(path):
        parts = name.split(".")
        if parts[0] in scripts | kit | {"kit"} or other_tree(name) or (
                parts[0] == tree.name and len(parts) > 1 and parts[1] != "kit"):
            bad.add(name)
    return [f"{path.relative_to(tree.parent)} imports {name}" for name in sorted(bad)
            if name.rpartition(".")[0] not in bad]  # a module, not each name taken from it


def flat_scripts_wrong(tree: Path, allowed: set[str]) -> list[str]:
    """Every import of ``tree``'s scripts (``tree/*.py``) and kit (``tree/kit/*.py``) that
    :func:`script_imports_wrong` names."""
    scripts = {p.stem for p in tree.glob("*.py")}
    kit = {p.stem for p in (tree / "kit").glob("*.py") if p.name != "__init__.py"}
    assert scripts and kit, f"{tree.name}: no scripts or no kit: nothing would be checked"
    return [w for p in sorted([*tree.glob("*.py"), *(tree / "kit").glob("*.py")])
            for w in script_imports_wrong(p, tree, scripts, kit, allowed)]


def test_benchmark_scripts_import_only_the_kit():
    """``benchmarks/*.py`` are flat entry points: each imports the measuring kit
    (``benchmarks.kit``) and the library, never another script; the kit imports the library,
    ``models`` and itself, never a script."""
    wrong = flat_scripts_wrong(BENCHMARKS, allowed=set())
    assert not wrong, "\n".join(wrong)


def test_experiment_scripts_import_only_the_kit():
    """``experiments/*.py`` are flat entry points: each imports the experiments' kit
    (``experiments.kit``), the library, ``models`` and at most the measuring kit
    (``benchmarks.kit``), never another script; the kit imports the same, never a script."""
    wrong = flat_scripts_wrong(EXPERIMENTS, allowed={"benchmarks.kit"})
    assert not wrong, "\n".join(wrong)


def test_the_flat_script_rule_names_a_script_importing_a_script(tmp_path):
    """The rule itself: a script importing another script (as a module of the tree, or by its
    bare name), a kit importing a script, and a kit module imported by its bare name are
    named; the kit, the library and an allowed package are not."""
    tree = tmp_path / "experiments"
    (tree / "kit").mkdir(parents=True)
    (tree / "kit" / "__init__.py").write_text("")
    (tree / "kit" / "tables.py").write_text("from experiments.reproduce import arms\n")
    (tree / "reproduce.py").write_text("from experiments.kit.tables import table\n"
                                       "import sparse_rl_jax.core\nimport benchmarks.kit.timing\n")
    (tree / "results_page.py").write_text("from experiments import reproduce\nimport tables\n"
                                          "from benchmarks.soak import main\n")
    wrong = flat_scripts_wrong(tree, allowed={"benchmarks.kit"})
    assert wrong == ["experiments/kit/tables.py imports experiments.reproduce",
                     "experiments/results_page.py imports benchmarks.soak",
                     "experiments/results_page.py imports experiments.reproduce",
                     "experiments/results_page.py imports tables"]
