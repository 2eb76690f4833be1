"""``lightning-cp fit | validate | test | predict``: a ``LightningCLI`` over the package's model and data.

Any model and data module are taken by ``class_path``. Run ``lightning-cp fit --config examples/configs/cpu_long_range.yaml``. The subcommands are Lightning's
``fit``, ``validate``, ``test`` and ``predict``; ``lightning-cp fit --help`` lists every argument,
``--model.help lightning_cp.models.GPTModule`` (or any class path) documents one class's arguments, down to
the fields of dataclasses such as ``GPTConfig``, and ``--print_config`` writes a complete YAML that
``--config`` reads back.

A mistake in the command line or the configuration ends the command with exit status 2 and one line on
stderr, ``lightning-cp: error: <key>: <reason>``, instead of a usage dump or a traceback: an unknown key,
a value of the wrong type, or a class that rejects its arguments when it is built (``cp`` not dividing the
number of devices, say), or that :mod:`lightning_cp.cli.launch_checks` finds in the built classes before any
rank starts. Only parsing, the building of the model, data module and trainer, and those checks are treated
this way; an error raised while training keeps its traceback. Set ``JSONARGPARSE_DEBUG=1`` to get the
traceback of a configuration error too. When a rank of a run dies (a signal, or an exception), the rank is
named once, with how it died, instead of every other rank's collective traceback
(:mod:`lightning_cp.cli.rank_failures`).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import sys
from argparse import ArgumentError
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import set_parsing_settings
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

import lightning_cp  # noqa: F401  (registers strategy="megatron_cp")
from lightning_cp.callbacks import RolloutLogprobWriter, TokenLogprobWriter
from lightning_cp.cli import checkpoints
from lightning_cp.cli.launch_checks import check_before_launch
from lightning_cp.cli.parse_errors import ConfigurationError, one_line
from lightning_cp.cli.rank_failures import ReportingLauncher, handle_failure
from lightning_cp.data import RolloutDataModule
from lightning_cp.strategies.preemption import PREEMPTED_EXIT_STATUS, PreemptionCheckpoint

_EXIT_STATUS = 2
"""Exit status of a command-line or configuration error (argparse's status for usage errors)."""

_SUBCOMMANDS = ("fit", "validate", "test", "predict")

_DEFAULT_CLASSES = {"model": "lightning_cp.models.GPTModule", "data": "lightning_cp.data.LongRangeDataModule"}
"""The model and data of a command that names none (the long-range task)."""

_EXTEND = (
    "Raise --trainer.max_steps or --trainer.max_epochs to continue it (the optimizer state and the data "
    "position carry on; a new data file, such as the next RL round's rollouts, trains as the next epochs), or "
    "--ckpt_path null to start over."
)
"""What a ``fit`` whose checkpoint already reached the trainer's limits says to do."""

_SUMMARY_METRICS = (
    "train/loss_epoch",
    "val/loss",
    "val/accuracy",
    *(
        f"train/rl/{name}_epoch"
        for name in ("loss", "pg_loss", "kl", "entropy", "clip_fraction", "ratio_mean", "completion_length")
    ),
)
"""Logged values printed after ``fit``, when present."""


class _HeldRecords:
    """Keeps back what the handlers of some loggers would print until :meth:`release` emits or drops it."""

    def __init__(self, *loggers: logging.Logger) -> None:
        self._held: list[tuple[logging.Handler, logging.LogRecord]] = []
        self._filters = [
            (handler, self._holder(handler)) for logger in loggers for handler in logger.handlers
        ]
        for handler, hold in self._filters:
            handler.addFilter(hold)

    def _holder(self, handler: logging.Handler) -> Callable[[logging.LogRecord], bool]:
        def hold(record: logging.LogRecord) -> bool:
            self._held.append((handler, record))
            return False

        return hold

    def release(self, emit: bool) -> None:
        for handler, hold in self._filters:
            handler.removeFilter(hold)
        for handler, record in self._held if emit else ():
            handler.handle(record)


class CPLightningCLI(LightningCLI):
    """``LightningCLI`` defaulting to ``GPTModule`` on the long-range task, with a closing summary.

    Building the model, data module and trainer is wrapped so that the configuration mistakes those
    constructors report (``ValueError``, ``TypeError``, ``MisconfigurationException``) come out as
    :class:`ConfigurationError`, which :func:`main` turns into a one-line message. Errors of the run itself
    (``fit``, ``validate``, ...) are not touched.
    """

    def __init__(self, *args: Any, args_given: ArgsType = None, **kwargs: Any) -> None:
        self._given = sys.argv[1:] if args_given is None else list(args_given)
        super().__init__(*args, args=args_given, **kwargs)

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Only for a part the command does not name: jsonargparse keeps the default class's values of the
        # arguments another class shares (GPTModule's lr=3e-3 would become HFCausalLM's, for one).
        parser.set_defaults(
            {
                part: {"class_path": class_path}
                for part, class_path in _DEFAULT_CLASSES.items()
                if not _names_part(self._given, part)
            }
        )

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        super().parse_arguments(parser, args)
        # Lightning logs "Seed set to N" and the trainer's devices while the classes are built: print them only
        # once every check passed, so that a configuration error is the one line the user sees.
        self._held_logs = _HeldRecords(
            logging.getLogger("lightning.fabric"), logging.getLogger("lightning.pytorch")
        )

    @override
    def _parse_ckpt_path(self) -> None:
        """Nothing: Lightning's replaces the configuration's model with the checkpoint's hyperparameters,
        silently; :meth:`instantiate_classes` compares them instead (:func:`checkpoints.differences`)."""

    @override
    def instantiate_classes(self) -> None:
        built = False
        try:
            super().instantiate_classes()
            check_before_launch(self.model, self.datamodule, self.trainer.strategy, self.subcommand or "fit")
            self.checkpoint = self._checkpoint_to_load()
            ReportingLauncher.replace(self.trainer)
            built = True
        except (ValueError, TypeError, MisconfigurationException) as error:
            raise ConfigurationError(str(error)) from error
        finally:
            self._held_logs.release(emit=built)

    @override
    def _run_subcommand(self, subcommand: str) -> None:
        """The subcommand; when it fails on a run of several ranks, one summary of which rank failed and how
        (:mod:`lightning_cp.cli.rank_failures`) instead of every rank's traceback."""
        try:
            super()._run_subcommand(subcommand)
        except Exception as error:
            handle_failure(error, self.trainer)
            raise

    def _checkpoint_to_load(self) -> checkpoints.CheckpointInfo | None:
        """Resolve the subcommand's ``ckpt_path`` (``last`` included), read it and check it fits the config.

        The resolved path replaces ``ckpt_path`` in the trainer method's arguments. ``last`` without a
        checkpoint starts ``fit`` from new weights and is an error for the other subcommands (which would
        otherwise evaluate an untrained model); ``best`` and Lightning's other names are left to Lightning.

        Raises:
            ConfigurationError: no checkpoint for ``last`` (not ``fit``), a path that does not exist or is
                not a readable checkpoint, a sharded checkpoint without FSDP, or hyperparameters that differ.
        """
        if self.subcommand is None:
            return None
        arguments = self.config_init[self.subcommand]
        ckpt_path = arguments.get("ckpt_path")
        if ckpt_path is None or ckpt_path in ("best", "hpc") or str(ckpt_path).startswith("registry"):
            return None
        path = Path(ckpt_path)
        if ckpt_path == "last":
            found = checkpoints.last_checkpoint(self.trainer)
            if found is None and self.subcommand == "fit":
                arguments["ckpt_path"] = None
                return None
            if found is None:
                search = checkpoints.last_checkpoint_search(self.trainer)
                where = "(no ModelCheckpoint or logger)" if search is None else str(search[0] / search[1])
                raise ConfigurationError(
                    f"ckpt_path: last: no checkpoint of this run matches {where}. Run fit with the same "
                    f"configuration first, give --ckpt_path PATH, or --ckpt_path null to {self.subcommand} "
                    "the untrained model."
                )
            path = found
        info = checkpoints.read_checkpoint(path, self.trainer)
        found_differences = checkpoints.differences(info, self.model, self.datamodule)
        if found_differences:
            raise ConfigurationError(
                f"ckpt_path: {str(path)!r} does not fit the configuration: {'; '.join(found_differences)}. "
                "Set the configuration to the checkpoint's values, or --ckpt_path null for new weights."
            )
        arguments["ckpt_path"] = str(path)
        return info

    def fit(self, **kwargs: Any) -> None:
        """``trainer.fit``, then a summary naming the logs and the checkpoints read and written (rank 0).

        ``ckpt_path: last`` resumes the newest ``last*.ckpt`` of this run name (:meth:`_checkpoint_to_load`),
        so re-running the same command after a crash or a preemption continues where it stopped; a run whose
        checkpoint already reached ``max_steps`` or ``max_epochs`` says so and ends with status 0 without
        training (nor a new ``version_N``).

        The summary is printed when training ends, is preempted or crashes. A SIGTERM stop (preemption:
        every rank stopped after the same step, ``last.ckpt`` saved) ends the command with status 143.
        """
        finished = self._finished_by_checkpoint()
        if finished is not None:
            print(f"lightning-cp: {finished}: nothing to train. {_EXTEND}", flush=True)
            return
        try:
            self.trainer.fit(**kwargs)
        except SIGTERMException:
            self._print_summary("preempted by SIGTERM")
            # Rank 0 carries the status: Lightning's launcher kills the whole job when a rank it started
            # exits with a non-zero status, possibly before rank 0 is done.
            raise SystemExit(PREEMPTED_EXIT_STATUS if self.trainer.is_global_zero else 0) from None
        except BaseException:
            self._print_summary("stopped by an error")
            raise
        self._print_summary("finished")

    def _finished_by_checkpoint(self) -> str | None:
        """What the checkpoint to resume already reached of the trainer's limits (``max_steps``,
        ``max_epochs``), said in words; ``None`` when it leaves something to train."""
        info, loop = self.checkpoint, self.trainer.fit_loop
        if info is None:
            return None
        if 0 <= loop.max_steps <= info.global_step:
            return f"{info.path} already reached trainer.max_steps={loop.max_steps} (step {info.global_step})"
        if loop.max_epochs is not None and 0 <= loop.max_epochs <= info.finished_epochs:
            return (
                f"{info.path} already trained trainer.max_epochs={loop.max_epochs} "
                f"(epoch {info.finished_epochs}, step {info.global_step})"
            )
        return None

    def validate(self, **kwargs: Any) -> None:
        """``trainer.validate``, then a summary naming the checkpoint evaluated and the logs (rank 0)."""
        self.trainer.validate(**kwargs)
        self._print_evaluation("validate")

    def test(self, **kwargs: Any) -> None:
        """``trainer.test``, then a summary naming the checkpoint evaluated and the logs (rank 0)."""
        self.trainer.test(**kwargs)
        self._print_evaluation("test")

    def predict(self, **kwargs: Any) -> None:
        """``trainer.predict``, writing the per-token log-probabilities under the first logger's directory unless
        the trainer already has a prediction writer: per rollout (:class:`RolloutLogprobWriter`, the layout
        ``RolloutDataModule(old_logprobs=..., ref_logprobs=...)`` reads) for a :class:`RolloutDataModule`, else
        per batch (:class:`TokenLogprobWriter`)."""
        trainer = self.trainer
        if not any(isinstance(callback, BasePredictionWriter) for callback in trainer.callbacks):
            root = trainer.loggers[0].log_dir if trainer.loggers else None
            writer = (
                RolloutLogprobWriter if isinstance(self.datamodule, RolloutDataModule) else TokenLogprobWriter
            )
            trainer.callbacks.append(writer(Path(root or trainer.default_root_dir) / "predictions"))
        trainer.predict(**{**kwargs, "return_predictions": False})
        writers = [
            callback
            for callback in trainer.callbacks
            if isinstance(callback, (TokenLogprobWriter, RolloutLogprobWriter))
        ]
        self._print_evaluation("predict")
        if trainer.is_global_zero and writers:
            print(f"  {'output:':<12}{writers[0].output_dir}  (per-token log-probabilities)", flush=True)

    def _checkpoint_line(self) -> str:
        return f"  {'weights:':<12}" + (
            f"{self.checkpoint.path} (step {self.checkpoint.global_step})"
            if self.checkpoint is not None
            else "new (no checkpoint loaded)"
        )

    def _print_evaluation(self, subcommand: str) -> None:
        trainer = self.trainer
        if not trainer.is_global_zero:
            return
        lines = ["", f"lightning-cp: {subcommand} finished", self._checkpoint_line()]
        if trainer.loggers:
            lines.append(f"  {'logs:':<12}{trainer.loggers[0].log_dir or trainer.loggers[0].save_dir}")
        print("\n".join(lines), flush=True)

    def _print_summary(self, outcome: str) -> None:
        trainer = self.trainer
        if not trainer.is_global_zero:
            return
        lines = [
            "",
            f"lightning-cp: training {outcome} after {trainer.global_step} steps",
            self._checkpoint_line(),
        ]
        for logger in trainer.loggers:
            label = "logs:" if logger is trainer.loggers[0] else ""
            lines.append(f"  {label:<12}{logger.log_dir or logger.save_dir}  ({type(logger).__name__})")
        resume_from = _resume_checkpoint(trainer)
        if isinstance(trainer.checkpoint_callback, ModelCheckpoint):
            lines.append(f"  {'checkpoint:':<12}{resume_from or '(none saved)'}")
        if resume_from and outcome != "finished":
            lines.append(f"  {'resume:':<12}the same command with --ckpt_path {resume_from}")
        metrics = trainer.callback_metrics
        shown = [name for name in _SUMMARY_METRICS if name in metrics]
        width = max([18, *(len(name) + 2 for name in shown)])
        for name in shown:
            value = metrics[name].item()
            extra = f"  (perplexity {math.exp(value):.2f})" if name.endswith("/loss") and value < 50 else ""
            lines.append(f"  {name + ':':<{width}}{value:.4f}{extra}")
        print("\n".join(lines), flush=True)


def _names_part(args: list[str], part: str) -> bool:
    """Whether the command line ``args`` names the class of ``part`` (``"model"`` / ``"data"``): ``--part
    CLASS``, ``--part.class_path CLASS``, or a ``--config`` file (or inline YAML) whose ``part`` has a
    ``class_path`` (an argument of the class alone, ``--model.init_args.lr``, names none)."""
    flags = (f"--{part}", f"--{part}.class_path")
    if any(arg in flags or arg.startswith(tuple(f"{flag}=" for flag in flags)) for arg in args):
        return True
    configs = [value for flag, value in itertools.pairwise(args) if flag == "--config"]
    configs += [arg.removeprefix("--config=") for arg in args if arg.startswith("--config=")]
    for config in configs:
        path = Path(config)
        try:
            tree = yaml.safe_load(path.read_text() if path.is_file() else config)
        except (OSError, yaml.YAMLError):
            continue  # not readable here: the parser reports it
        named = tree.get(part) if isinstance(tree, dict) else None
        if isinstance(named, str) or (isinstance(named, dict) and "class_path" in named):
            return True
    return False


def _resume_checkpoint(trainer: Trainer) -> str | None:
    """The newest checkpoint of this run: the preemption one, else the ModelCheckpoint's last or best."""
    for callback in trainer.callbacks:
        if isinstance(callback, PreemptionCheckpoint) and callback.saved_path:
            return callback.saved_path
    checkpoint = trainer.checkpoint_callback
    if not isinstance(checkpoint, ModelCheckpoint):
        return None  # checkpointing disabled, or a Checkpoint callback of another kind
    return checkpoint.last_model_path or checkpoint.best_model_path or None


def main(args: list[str] | None = None) -> None:
    """Run a Lightning subcommand (``lightning-cp fit ...``; :func:`lightning_cp.cli.main` dispatches here).

    Args:
        args: the command line after the program name; ``None`` reads ``sys.argv``.

    Raises:
        SystemExit: status 0 after ``--help`` / ``--print_config``; status 2 with one line on stderr for a
            command-line or configuration error (see the module docstring).
    """
    # Field docstrings of dataclasses (GPTConfig) become --help text; parsing them costs well under a second.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    strict = {"exit_on_error": False}  # raise ArgumentError instead of printing the usage and exiting
    try:
        CPLightningCLI(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            # The same seed on every run unless the config sets `seed_everything`.
            seed_everything_default=0,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={**strict, **{name: dict(strict) for name in _SUBCOMMANDS}},
            args_given=args,
        )
    except (ArgumentError, ConfigurationError) as error:
        if os.environ.get("JSONARGPARSE_DEBUG"):
            raise
        print(f"lightning-cp: error: {one_line(str(error))}", file=sys.stderr, flush=True)
        raise SystemExit(_EXIT_STATUS) from None
