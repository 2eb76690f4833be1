"""``import lightning_cp`` stays light: no Megatron-core in DataLoader workers, no matplotlib from our code."""

import subprocess
import sys

import pytest

# A meta-path spy records the module that asks for each watched top-level package. torchmetrics (imported
# by Lightning) imports matplotlib itself whenever it is installed, so Lightning is imported first and the
# watched modules are then dropped from sys.modules: any later import of them reaches the spy.
_SPY = """
import sys
import lightning.pytorch
for name in [m for m in sys.modules if m.split(".")[0] in ("matplotlib", "megatron")]:
    del sys.modules[name]
WATCHED = ("matplotlib", "megatron")
importers = []
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name in WATCHED:
            frame = sys._getframe(1)
            while frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
                frame = frame.f_back
            importers.append((name, frame.f_globals.get("__name__")))
        return None
sys.meta_path.insert(0, Spy())
"""


_DATA = "from lightning_cp.data import collate_packed, LongRangeDataModule"
_PACKAGE = "import lightning_cp, lightning_cp.loss.metrics, lightning_cp.models"


@pytest.fixture(scope="module")
def importers() -> dict[str, list[list[str]]]:
    """The watched imports of a fresh interpreter after ``_DATA``, then after ``_PACKAGE`` too (one process
    for both: ``_DATA`` first, as a DataLoader worker imports it alone; the second list holds the first)."""
    code = f"{_SPY}{_DATA}\nprint(importers)\n{_PACKAGE}\nprint(importers)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    data, package = out.strip().splitlines()[-2:]
    return {"data": eval(data), "package": eval(package)}


def test_import_lightning_cp_imports_neither_megatron_nor_matplotlib(importers):
    found = importers["package"]
    assert not [name for name, _ in found if name == "megatron"], found
    assert not [who for name, who in found if who.startswith("lightning_cp")], found


def test_dataloader_workers_do_not_import_megatron(importers):
    found = importers["data"]
    assert not [name for name, _ in found if name == "megatron"], found
