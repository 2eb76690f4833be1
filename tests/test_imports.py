"""``import lightning_cp`` stays light: no Megatron-core in DataLoader workers, no matplotlib from our code."""

import subprocess
import sys

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


def _importers(statement: str) -> list[list[str]]:
    code = _SPY + statement + "\nprint(importers)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return eval(out.strip().splitlines()[-1])


def test_import_lightning_cp_imports_neither_megatron_nor_matplotlib():
    importers = _importers("import lightning_cp, lightning_cp.loss.metrics, lightning_cp.models")
    assert not [name for name, _ in importers if name == "megatron"], importers
    assert not [who for name, who in importers if who.startswith("lightning_cp")], importers


def test_dataloader_workers_do_not_import_megatron():
    importers = _importers("from lightning_cp.data import collate_packed, LongRangeDataModule")
    assert not [name for name, _ in importers if name == "megatron"], importers
