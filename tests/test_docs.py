"""``docs/design.md`` against the code: its package map is the tree, and the sections the code cites exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
PACKAGE = "lightning_cp"

_ENTRY = re.compile(r"(?P<indent>(?:  )*)(?P<name>[A-Za-z_][\w.]*(?:/|\.py))(?:\s|$)")
"""A line of the map that names a path: two spaces per level, then ``name/`` or ``name.py``. Lines that
continue a description are indented to the description column, an odd number of spaces."""

_CITATION = re.compile(r"docs/design\.md`*\s*[,(]?\s*\(?\"(?P<section>[^\"]+)\"")
"""``docs/design.md``, "Section" (or ("Section")), the way docstrings cite a section; it may span lines."""


def _section(name: str, text: str) -> str:
    """The body of the ``## name`` section of ``text``."""
    match = re.search(rf"^## {re.escape(name)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"docs/design.md has no section '## {name}'"
    return match.group(1)


def map_paths(text: str) -> list[str]:
    """The paths the fenced tree of "Package map" lists, relative to the repository (folders end in ``/``).

    Raises:
        AssertionError: on an entry indented under a file or more than one level below its parent.
    """
    tree = re.search(r"```\n(.*?)```", _section("Package map", text), re.DOTALL)
    assert tree, "the Package map section has no fenced tree"
    parents: list[str] = []  # the folder of each level above the current line
    paths = []
    for line in tree.group(1).splitlines():
        entry = _ENTRY.match(line)
        if entry is None:
            continue
        depth = len(entry["indent"]) // 2
        assert depth <= len(parents), f"package map: {line.strip()!r} is indented below no folder"
        del parents[depth:]
        path = "".join(parents) + entry["name"]
        paths.append(path)
        if path.endswith("/"):
            parents.append(path.removeprefix("".join(parents)))
    return paths


def package_paths() -> set[str]:
    """Every package (``pkg/``) and module (``pkg/mod.py``, ``__init__.py`` aside) of the package."""
    paths = set()
    for file in (ROOT / PACKAGE).rglob("*.py"):
        relative = file.relative_to(ROOT)
        if file.name == "__init__.py":
            paths.add(f"{relative.parent.as_posix()}/")
        else:
            paths.add(relative.as_posix())
    return paths


def test_the_package_map_parser_reads_nesting_and_skips_description_lines():
    text = (
        "## Package map\n\n```\npkg/\n  a.py                 one\n                       continued: x.py\n"
        "  sub/                 two\n    b.py               three\n  c.py\nother/\n```\n\n## Next\n"
    )
    assert map_paths(text) == ["pkg/", "pkg/a.py", "pkg/sub/", "pkg/sub/b.py", "pkg/c.py", "other/"]
    with pytest.raises(AssertionError, match="indented below no folder"):
        map_paths("## Package map\n\n```\npkg/\n  a.py\n      b.py\n```\n")


def test_every_path_of_the_package_map_exists():
    listed = map_paths(DESIGN.read_text())
    missing = [p for p in listed if not (ROOT / p).is_dir() if p.endswith("/")]
    missing += [p for p in listed if not p.endswith("/") and not (ROOT / p).is_file()]
    assert not missing, f"docs/design.md's package map lists paths that do not exist: {missing}"


def test_every_module_and_package_is_in_the_package_map():
    listed = set(map_paths(DESIGN.read_text()))
    unlisted = sorted(package_paths() - listed)
    assert not unlisted, f"add these to the package map of docs/design.md: {unlisted}"


def _citing_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for folder in (PACKAGE, "benchmarks", "examples", "tests"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return [f for f in files if f != Path(__file__).resolve()]


def test_every_section_the_code_cites_exists():
    headings = set(re.findall(r"^## (.+)$", DESIGN.read_text(), re.MULTILINE))
    citations = [
        (file.relative_to(ROOT).as_posix(), " ".join(match["section"].split()))
        for file in _citing_files()
        for match in _CITATION.finditer(file.read_text())
    ]
    assert citations, "no file cites a section of docs/design.md: has the citation form changed?"
    wrong = [(file, section) for file, section in citations if section not in headings]
    assert not wrong, f"sections of docs/design.md that do not exist (headings: {sorted(headings)}): {wrong}"


def _own_strategy_arguments() -> list[str]:
    """The strategies' own ``__init__`` arguments (not Lightning's ``DDPStrategy``'s)."""
    import inspect

    from lightning.pytorch.strategies import DDPStrategy

    from lightning_cp import MegatronCPFSDPStrategy
    from lightning_cp.strategies.base import MegatronCPBase

    def names(function: object) -> list[str]:
        kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        return [p.name for p in inspect.signature(function).parameters.values() if p.kind not in kinds]

    lightning = set(names(DDPStrategy.__init__))
    own = [n for n in names(MegatronCPBase.__init__) if n not in lightning]
    return own + [n for n in names(MegatronCPFSDPStrategy.__init__) if n not in lightning]


def test_readme_and_the_usage_table_name_every_strategy_argument():
    flags = re.MULTILINE | re.DOTALL
    readme = re.search(r"^## Configuration\n(.*?)(?=^## )", (ROOT / "README.md").read_text(), flags)
    usage = (ROOT / "docs" / "usage.md").read_text()
    arguments = _own_strategy_arguments()
    assert "cp" in arguments and "fsdp_wrap" in arguments
    assert readme, "README.md has no '## Configuration' section"
    missing = [a for a in arguments if f"`{a}`" not in readme.group(1)]
    assert not missing, f"README.md's Configuration names the strategies' init_args; add {missing}"
    unlisted = [a for a in arguments if not re.search(rf"init_args\.{a}`|`\.{a}`", usage)]
    assert not unlisted, (
        f"docs/usage.md's configuration table lists the strategies' init_args; add {unlisted}"
    )
