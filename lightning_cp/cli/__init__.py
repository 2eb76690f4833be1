"""The ``lightning-cp`` command: Lightning's subcommands, and the package's own commands.

``lightning-cp fit | validate | test | predict`` is a ``LightningCLI``
(:mod:`lightning_cp.cli.lightning_cli`); ``lightning-cp <command>`` for a command of :data:`COMMANDS` runs
that module's ``main(argv) -> int`` on the rest of the command line. ``lightning-cp --help`` lists both.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys

COMMANDS = {
    "doctor": "lightning_cp.cli.doctor",
    "export-hf": "lightning_cp.cli.export_hf",
    "plan": "lightning_cp.cli.plan",
}
"""The package's own commands: name -> module with ``main(argv: list[str]) -> int`` (the exit status) and a
module docstring whose first line describes the command."""

_IMPORT_NOISE = ("torchao", "torch.utils._pytree")
"""Loggers that warn while ``transformers`` imports ``torchao`` (the QLoRA extra) on a CPU build of torch: its
CUDA extensions that cannot load there, and the enums it registers with torch's pytree. Nothing a command's user
can act on, printed above every table; errors still show."""


def main(args: list[str] | None = None) -> int:
    """Entry point of the ``lightning-cp`` console script; returns the exit status.

    Args:
        args: the command line after the program name; ``None`` reads ``sys.argv``.

    Raises:
        SystemExit: from a Lightning subcommand or ``--help``, as :func:`lightning_cp.cli.lightning_cli.main`
            documents (status 2 with one line on stderr for a configuration error).
    """
    argv = sys.argv[1:] if args is None else list(args)
    for name in _IMPORT_NOISE:
        logging.getLogger(name).setLevel(logging.ERROR)
    if argv and argv[0] in COMMANDS:
        return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])
    if argv[:1] in (["-h"], ["--help"]):
        print(_help())
        return 0
    from lightning_cp.cli.lightning_cli import main as lightning_main

    # ``None`` when given ``None``: LightningCLI then reads sys.argv itself (and warns when given both).
    lightning_main(args)
    return 0


def _help() -> str:
    from lightning.pytorch import Trainer
    from lightning.pytorch.cli import LightningCLI

    def summary(doc: str | None) -> str:  # the first sentence
        return " ".join((doc or "").split("\n\n")[0].split()).split(". ")[0].rstrip(".") + "."

    lightning = {name: summary(inspect.getdoc(getattr(Trainer, name))) for name in LightningCLI.subcommands()}
    package = {name: summary(importlib.import_module(module).__doc__) for name, module in COMMANDS.items()}
    width = max(map(len, [*lightning, *package])) + 2
    lines = [
        f"usage: lightning-cp {{{','.join([*lightning, *package])}}} ...",
        "",
        "Context-parallel training with PyTorch Lightning.",
        "",
        "Lightning subcommands (`lightning-cp fit --help` lists every argument and config key):",
        *(f"  {name:{width}}{text}" for name, text in lightning.items()),
        "",
        "lightning-cp commands (`lightning-cp doctor --help`):",
        *(f"  {name:{width}}{text}" for name, text in package.items()),
    ]
    return "\n".join(lines)
