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


# --- docs/api.md's signatures against the code -----------------------------------------------------------

_API_ROW = re.compile(r"^\| (?P<cell>[^|]+?) \|", re.MULTILINE)
_API_ITEM = re.compile(r"`(?P<name>[A-Za-z_][\w.]*)(?:\((?P<args>[^`]*)\))?`")


def _resolve(name: str) -> object | None:
    """The object a dotted name gives: an attribute of the longest importable module before its last part
    (``lightning_cp.ops.cross_entropy`` is the function the package exports, not its module), else the module
    the whole name imports, else ``None``."""
    import importlib

    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute, None)
        if found is not None:
            return found
        break
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _listed(arguments: str) -> list[str]:
    """The comma-separated items of a documented argument list, brackets kept whole."""
    items, depth, current = [], 0, ""
    for char in arguments:
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += char
    return [*items, current.strip()] if current.strip() else items


def _parameters(target: object) -> tuple[list[str], bool]:
    """The named parameters of a function, or of a class's ``__init__`` and those its ``**kwargs`` reach up
    its bases; and whether the signature ends in ``**kwargs``."""
    import inspect

    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    functions = (
        [c.__init__ for c in inspect.getmro(target) if "__init__" in vars(c)]
        if inspect.isclass(target)
        else [target]
    )
    names: list[str] = []
    for function in functions:
        parameters = inspect.signature(function).parameters.values()
        names += [p.name for p in parameters if p.kind not in variadic and p.name not in ("self", *names)]
        if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters):
            return names, False
    return names, True


def api_signature_problems(text: str) -> list[str]:
    """Where docs/api.md's first column gives a call whose arguments are not the code's: a name that is not a
    parameter, or (a list without ``...`` or ``**``) a parameter left out. A short name is looked up beside the
    previous name of its cell (``OutputHead.from_linear`` after ``lightning_cp.ops.OutputHead``)."""
    import inspect

    problems = []
    for row in _API_ROW.finditer(text):
        beside = None
        for item in _API_ITEM.finditer(row["cell"]):
            name = item["name"]
            if name.split(".")[0] in ("strategy", "trainer", "batch"):  # an instance, not an import
                continue
            candidates = [name] if name.startswith(PACKAGE) else [f"{beside}.{name}"] * bool(beside)
            found = next(((c, t) for c in [*candidates, f"{PACKAGE}.{name}"] if (t := _resolve(c))), None)
            if found is None:
                if item["args"] is not None:
                    problems.append(f"{name}: nothing of that name")
                continue
            full, target = found
            beside = full if inspect.ismodule(target) else full.rsplit(".", 1)[0]
            if item["args"] is None:
                continue
            actual, open_ended = _parameters(target)
            listed = _listed(item["args"])
            names = [a.partition("=")[0].strip() for a in listed if a not in ("*", "...") and a[0] != "*"]
            unknown = [n for n in names if n not in actual]
            if unknown and not open_ended:
                problems.append(f"{name}: {unknown} are not its parameters")
            own = _parameters(target.__init__ if inspect.isclass(target) else target)[0]
            closed = not any(a == "..." or a.startswith("**") for a in listed)
            if closed and (left_out := [n for n in own if n not in names]):
                problems.append(f"{name}: leaves out {left_out}")
    return problems


def test_the_api_checker_sees_a_left_out_and_an_unknown_argument():
    assert api_signature_problems("| `lightning_cp.load_pretrained(path, dtype=None)` | x |") == [
        "lightning_cp.load_pretrained: leaves out ['attn_implementation']"
    ]
    assert api_signature_problems("| `lightning_cp.ops.OutputHead(weight, scale)` | x |")[0].endswith(
        "['scale'] are not its parameters"
    )
    assert api_signature_problems("| `lightning_cp.data.pack_documents_twice(x)` | x |")


def test_every_call_in_the_api_table_has_the_code_s_arguments():
    problems = api_signature_problems((ROOT / "docs" / "api.md").read_text())
    assert not problems, f"docs/api.md's signatures have drifted: {problems}"


def _usage_error_lines() -> list[str]:
    """The example errors of docs/usage.md's Configuration section."""
    usage = (ROOT / "docs" / "usage.md").read_text()
    return re.findall(r"^lightning-cp: error: .*$", _section("Configuration", usage), re.MULTILINE)


@pytest.mark.parametrize(
    "args", [["--trainer.max_steps", "abc"], ["--trainer.devices", "3"]], ids=["type", "divisibility"]
)
def test_usage_s_example_errors_are_what_the_cli_prints(args, cli_before_launch):
    status, _, err = cli_before_launch(
        "fit", "--config", str(ROOT / "examples/configs/cpu_long_range.yaml"), *args
    )
    assert status == 2 and err.strip() in _usage_error_lines()
