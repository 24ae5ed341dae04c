"""Every link, image, path and repo command in the README and ``docs/`` points at something that
exists.

Checked in ``README.md``, ``docs/*.md`` and ``benchmarks/README.md``:

* relative markdown links and images (``[text](docs/api.md)``, ``![x](control_walk.png)``)
  name an existing file, resolved from the page's folder; ``page.md#anchor`` (and ``#anchor``
  within the page) names a heading of that page (GitHub's anchors);
* a path to a repository file, anywhere in the text (``sparse_rl_jax/rollout/sampler.py``,
  ``configs/walk/local.yaml``, ``docs/regime_sweep.md``): one that starts at a top-level entry
  of the repository (or of the page's folder) and ends in a file extension must exist; ``*``
  and ``{a,b}`` in it are expanded and must match;
* a bare module file name in backticks (``kv_scores.py``) exists somewhere in the repository;
* ``python script.py`` (the path from the repository root) in a fenced code block or in
  inline code names an existing script, and ``python -m module`` there or in inline code, for a module of this
  repository (``sparse_rl_jax``, ``models``, ``tools``, ``experiments``, ``benchmarks``),
  an existing module.

A failure names the page and line, so a moved module or page shows every stale reference.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md",
                *(ROOT / "docs").glob("*.md")])
REPO_PACKAGES = ("sparse_rl_jax", "models", "tools", "experiments", "benchmarks", "tests")
EXTENSIONS = ("py", "yaml", "yml", "md", "json", "jsonl", "png", "ipynb", "txt", "toml", "cfg")

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
PATH = re.compile(r"(?<![\w./~$-])((?:[\w.{},*-]+/)+[\w.{},*-]*\.(?:%s))(?![\w/])"
                  % "|".join(EXTENSIONS))
INLINE = re.compile(r"(`+)(.+?)\1")
BARE_MODULE = re.compile(r"^[\w-]+\.py$")
SCRIPT = re.compile(r"\bpython3?\s+((?:[\w.-]+/)*[\w.-]+\.py)\b")
MODULE = re.compile(r"\bpython3?\s+-m\s+([\w.]+)")
FENCE = re.compile(r"^\s*(```|~~~)")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text only
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path, text: str | None = None) -> set[str]:
    """Every heading anchor of ``page`` (duplicates numbered ``-1``, ``-2`` as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in (page.read_text() if text is None else text).splitlines():
        if FENCE.match(line):
            fenced = not fenced
        match = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = github_anchor(match.group(1))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


# Top-level names .gitignore keeps out of the repository (``runs/``: run outputs), which a
# checkout may or may not hold: a path under one is an output, not a repository path.
IGNORED = {line.strip().strip("/") for line in (ROOT / ".gitignore").read_text().splitlines()
           if line.strip() and not line.startswith("#") and "*" not in line}


def expand(path: str) -> list[str]:
    """``a/{b,c}/d.py`` -> ``[a/b/d.py, a/c/d.py]`` (one brace group at a time)."""
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [p for alt in match.group(1).split(",")
            for p in expand(path[:match.start()] + alt + path[match.end():])]


def path_exists(path: str, page: Path) -> bool | None:
    """Whether a path mentioned on ``page`` exists; None when it is not a repository path
    (its first part is no top-level entry of the repository or of the page's folder: run
    outputs such as ``runs/default/config.yaml``, placeholders such as ``RUN/metrics.jsonl``)."""
    first = path.split("/", 1)[0]
    bases = [base for base in (ROOT, page.parent)
             if first and first not in IGNORED and (base / first).exists()]
    if not bases:
        return None
    for candidate in expand(path):
        if not any(glob.glob(str(base / candidate)) for base in bases):
            return False
    return True


def module_exists(module: str) -> bool | None:
    """Whether ``python -m module`` names a module of this repository; None for others
    (``pip``, ``pytest``)."""
    if module.split(".")[0] not in REPO_PACKAGES:
        return None
    base = ROOT.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()


def problems(page: Path, text: str | None = None) -> list[str]:
    """``page:line: what`` for every reference on ``page`` (its ``text``, read from the file
    when None) that points at nothing."""
    out = []
    text = page.read_text() if text is None else text
    names = {p.name for p in ROOT.rglob("*.py") if ".git" not in p.parts}
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        where = f"{page.relative_to(ROOT)}:{number}"
        if FENCE.match(line):
            fenced = not fenced
            continue
        for target in LINK.findall("" if fenced else line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            linked = (page.parent / file).resolve() if file else page
            if file and not linked.exists():
                out.append(f"{where}: link to {target!r}: {file} does not exist")
            elif anchor and linked.suffix == ".md" and \
                    anchor not in anchors(linked, None if file else text):
                out.append(f"{where}: link to {target!r}: no heading with anchor #{anchor} "
                           f"in {linked.relative_to(ROOT)}")
        spans = [line] if fenced else [m.group(2) for m in INLINE.finditer(line)]
        for path in PATH.findall(re.sub(LINK, "", line)):
            if path_exists(path, page) is False:
                out.append(f"{where}: {path} does not exist")
        for span in spans:
            for script in SCRIPT.findall(span):
                if not (ROOT / script).is_file():
                    out.append(f"{where}: `python {script}`: no such script in the repository")
            for module in MODULE.findall(span):
                if module_exists(module) is False:
                    out.append(f"{where}: `python -m {module}`: no such module in the repository")
            word = span.strip()
            if not fenced and BARE_MODULE.match(word) and word not in names:
                out.append(f"{where}: `{word}`: no such file in the repository")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_references_point_at_existing_files(page):
    found = problems(page)
    assert not found, "stale references:\n" + "\n".join(found)


def test_the_checker_catches_stale_references():
    """A page naming a missing module, config, link, anchor and ``-m`` module fails, one
    message per reference, each naming the line."""
    page = ROOT / "docs" / "_stale_check_probe.md"  # never written: the text is passed
    found = problems(page, "# Title\n\n"
                    "See `sparse_rl_jax/no_such_module.py` and `no_such_module.py`.\n"
                    "[a](api.md#no-such-heading) [b](missing.md) [c](#title)\n"
                    "```bash\n"
                    "python run.py --config configs/walk/no_such.yaml\n"
                    "python -m sparse_rl_jax.no_such_cli\n"
                    "python experiments/no_such_script.py\n"
                    "python no_such_runner.py train\n"
                    "```\n")
    text = "\n".join(found)
    assert "docs/_stale_check_probe.md:3: sparse_rl_jax/no_such_module.py does not exist" in text
    assert "docs/_stale_check_probe.md:3: `no_such_module.py`" in text
    assert "docs/_stale_check_probe.md:4: link to 'api.md#no-such-heading'" in text
    assert "docs/_stale_check_probe.md:4: link to 'missing.md'" in text
    assert "configs/walk/no_such.yaml does not exist" in text
    assert "`python -m sparse_rl_jax.no_such_cli`" in text
    assert "experiments/no_such_script.py does not exist" in text
    assert "`python no_such_runner.py`: no such script" in text
    assert len(found) == 9, text
