"""The package layout: stages import one way, ``models`` knows nothing of RL, the benchmark
scripts are flat entry points over one measuring kit, and every module stays short enough to
read in one sitting."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sparse_rl_jax"
BENCHMARKS = ROOT / "benchmarks"
KIT = BENCHMARKS / "kit"

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
                             *KIT.glob("*.py")])
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_layout_page_names_every_module():
    """``docs/layout.md`` names every module of the library, of ``models`` and of the
    measuring kit (so a new module lands with its line there)."""
    page = (ROOT / "docs" / "layout.md").read_text()
    missing = [str(p.relative_to(ROOT))
               for p in sorted([*PACKAGE.glob("*/*.py"), *(ROOT / "models").glob("*.py"),
                                *KIT.glob("*.py")])
               if p.name != "__init__.py" and f"{p.name}`" not in page]
    assert not missing, f"modules docs/layout.md does not name: {missing}"


OTHER_TREES = {"experiments", "tools", "tests", "run"}  # besides the library, and run.py


def benchmark_imports_wrong(path: Path, scripts: set[str], kit: set[str]) -> list[str]:
    """What ``path`` (a script or a kit module) imports that it must not: another script (by
    its bare name or as ``benchmarks.<script>``), a kit module by its bare name (the kit is
    ``benchmarks.kit``), anything else under ``benchmarks`` or another tree of the repository;
    a kit module also never imports a script."""
    bad = set()
    for name in imported(path):
        parts = name.split(".")
        if parts[0] in scripts | kit | OTHER_TREES or (
                parts[0] == "benchmarks" and len(parts) > 1 and parts[1] != "kit"):
            bad.add(name)
    return [f"{path.relative_to(ROOT)} imports {name}" for name in sorted(bad)
            if name.rpartition(".")[0] not in bad]  # a module, not each name taken from it


def test_benchmark_scripts_import_only_the_kit():
    """``benchmarks/*.py`` are flat entry points: each imports the measuring kit
    (``benchmarks.kit``) and the library, never another script; the kit imports the library,
    ``models`` and itself, never a script."""
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")}
    kit = {p.stem for p in KIT.glob("*.py") if p.name != "__init__.py"}
    wrong = [w for p in sorted([*BENCHMARKS.glob("*.py"), *KIT.glob("*.py")])
             for w in benchmark_imports_wrong(p, scripts, kit)]
    assert not wrong, "\n".join(wrong)
    assert scripts and kit, "no scripts or no kit: nothing was checked"
