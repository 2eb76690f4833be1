"""Every import inside ``lightning_cp`` follows the dependency table of ``docs/design.md``.

The table ("package | may import") is read from the design document, so the two cannot drift apart: an
import across packages that the table does not allow fails here, and so does a package it does not list.
Imports are read with ``ast``, so lazy imports inside functions and ``TYPE_CHECKING`` imports count too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lightning_cp"
ROOT = "lightning_cp"
"""The table's name for the package's own ``__init__.py`` (``import lightning_cp``)."""

_ROW = re.compile(r"^\| `(?P<package>\w+)` \| (?P<allowed>.*) \|$")


def _packages() -> set[str]:
    """The top-level subpackages and modules of ``lightning_cp``, and :data:`ROOT`."""
    names = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}
    names |= {path.stem for path in PACKAGE.glob("*.py") if path.name != "__init__.py"}
    return names | {ROOT}


def _table() -> dict[str, set[str]]:
    """``{package: the packages it may import}`` from the design document's table."""
    text = (REPO / "docs" / "design.md").read_text()
    lines = text[text.index("| package | may import |") :].splitlines()[2:]
    table = {}
    for line in lines:
        match = _ROW.match(line)
        if match is None:
            break
        allowed = set(re.findall(r"`(\w+)`", match["allowed"]))
        if "every package" in match["allowed"]:
            allowed |= _packages()
        table[match["package"]] = allowed
    return table


def _owner(path: Path) -> str:
    """The table's row of a source file: its top-level package or module, or :data:`ROOT`."""
    parts = path.relative_to(PACKAGE).parts
    return ROOT if parts == ("__init__.py",) else parts[0].removesuffix(".py")


def _imported(source: str, module: str) -> set[str]:
    """The packages of ``lightning_cp`` that ``source`` (the module named ``module``) imports."""
    targets = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                anchor = module.split(".")[: -node.level]
                base = ".".join([*anchor, base] if base else anchor)
            # `from lightning_cp import x` imports the subpackage x, or a name of the root __init__.
            names = [f"{base}.{alias.name}" for alias in node.names] if base == ROOT else [base]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == ROOT:
                targets.add(parts[1] if len(parts) > 1 and parts[1] in _packages() else ROOT)
    return targets


def _violations() -> list[str]:
    table = _table()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        owner = _owner(path)
        module = ".".join((ROOT, *path.relative_to(PACKAGE).with_suffix("").parts))
        for target in sorted(_imported(path.read_text(), module) - {owner} - table.get(owner, set())):
            found.append(f"{path.relative_to(REPO)} imports {target}, which {owner} may not import")
    return found


def test_the_table_lists_every_package_once():
    assert set(_table()) == _packages()


def test_every_import_follows_the_table():
    assert _violations() == []


def test_the_check_sees_the_imports_the_table_forbids():
    # The regression the table exists for: the FSDP defaults once imported the GPT's block class.
    assert "models" not in _table()["strategies"]
    module = "lightning_cp.strategies._fsdp"
    assert _imported("from lightning_cp.models.gpt import _Block", module) == {"models"}
    assert _imported("def f():\n    from ..models import gpt", module) == {"models"}
    assert _imported("import lightning_cp.models", module) == {"models"}
    assert _imported("from lightning_cp import models, CPLossMixin", module) == {"models", ROOT}
    assert _imported("import torch\nfrom lightning_cp.parallel import groups", module) == {"parallel"}
