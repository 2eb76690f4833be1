"""The ``lightning-cp`` command: a ``LightningCLI`` over the package's model and data (or any by ``class_path``).

Run ``lightning-cp fit --config examples/configs/cpu_long_range.yaml``; ``lightning-cp fit --help`` lists
every argument with its documentation and ``--print_config`` writes a complete, reusable YAML.
"""

from __future__ import annotations

import math
import sys

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from typing_extensions import override

import lightning_cp  # noqa: F401  (registers strategy="megatron_cp")


class CPLightningCLI(LightningCLI):
    """``LightningCLI`` defaulting to ``GPTModule`` on the long-range task, with a closing summary."""

    @override
    def add_arguments_to_parser(self, parser) -> None:  # type: ignore[no-untyped-def]
        parser.set_defaults(
            {
                "model": {"class_path": "lightning_cp.models.GPTModule"},
                "data": {"class_path": "lightning_cp.data.LongRangeDataModule"},
            }
        )

    def after_fit(self) -> None:
        """Tell the user where the logs and checkpoints are, and the final losses (rank 0 only)."""
        trainer = self.trainer
        log_dir = trainer.log_dir  # a broadcast: every rank must ask
        if not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        lines = ["", "lightning-cp: training finished"]
        lines.append(f"  logs:       {log_dir}")
        checkpoint = trainer.checkpoint_callback
        if checkpoint is not None:
            lines.append(f"  checkpoint: {checkpoint.last_model_path or checkpoint.best_model_path}")
        for name in ("train/loss_epoch", "val/loss", "val/accuracy"):
            if name in metrics:
                value = metrics[name].item()
                extra = f"  (perplexity {math.exp(value):.2f})" if name.endswith("loss") and value < 50 else ""
                lines.append(f"  {name + ':':<17}{value:.4f}{extra}")
        print("\n".join(lines), flush=True)


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lightning-cp`` console script."""
    CPLightningCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
