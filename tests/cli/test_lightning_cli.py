"""``lightning-cp fit`` run in the shared 2-rank gloo pool (each rank calls the command in-process, as ranks
started by a scheduler do): what it prints and raises at the end of a run."""

from __future__ import annotations

import contextlib
import io

from lightning.pytorch import Callback

from lightning_cp.cli import main
from tests.cli.test_rank_failures import fit_arguments


class RaiseOnEveryRank(Callback):
    """Every rank raises the same error after the first step (no rank waits on another)."""

    def on_train_batch_end(self, trainer, *args):
        raise RuntimeError("the user's error")


def _fit(tmp_path, callbacks: list[dict]) -> tuple[str, str]:
    """Every rank: ``lightning-cp fit`` of two steps of the main job at dp=1 x cp=2 with ``callbacks`` and
    checkpointing disabled; returns what it printed and the error it raised (``""`` for none)."""
    command = [
        *fit_arguments(tmp_path, 2, callbacks),
        "--trainer.max_steps",
        "2",
        "--trainer.enable_checkpointing",
        "false",
        "--data.init_args.num_train_samples",
        "8",
    ]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            main(command)
    except Exception as error:  # noqa: BLE001 - returned to the test
        return printed.getvalue(), f"{type(error).__name__}: {error}"
    return printed.getvalue(), ""


def test_a_run_without_checkpointing_ends_with_its_summary(world2, tmp_path):
    (printed, error), (_, other) = world2.run(_fit, tmp_path, [])
    assert (error, other) == ("", "")
    assert "lightning-cp: training finished after 2 steps" in printed
    assert "checkpoint:" not in printed  # none was configured


def test_an_error_of_a_run_without_checkpointing_is_the_error_raised(world2, tmp_path):
    callbacks = [{"class_path": "tests.cli.test_lightning_cli.RaiseOnEveryRank"}]
    (printed, error), (_, other) = world2.run(_fit, tmp_path, callbacks)
    assert error == other == "RuntimeError: the user's error"
    assert "lightning-cp: training stopped by an error after 1 steps" in printed
