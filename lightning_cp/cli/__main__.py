"""``python -m lightning_cp.cli``: the ``lightning-cp`` command."""

from lightning_cp.cli import main

if __name__ == "__main__":  # not when spawned processes re-import the main module
    raise SystemExit(main())
