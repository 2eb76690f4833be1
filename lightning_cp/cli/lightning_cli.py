"""``lightning-cp fit | validate | test | predict``: a ``LightningCLI`` over the package's model and data.

Any model and data module are taken by ``class_path``. Run ``lightning-cp fit --config examples/configs/cpu_long_range.yaml``. The subcommands are Lightning's
``fit``, ``validate``, ``test`` and ``predict``; ``lightning-cp fit --help`` lists every argument,
``--model.help lightning_cp.models.GPTModule`` (or any class path) documents one class's arguments, down to
the fields of dataclasses such as ``GPTConfig``, and ``--print_config`` writes a complete YAML that
``--config`` reads back.

A mistake in the command line or the configuration ends the command with exit status 2 and one line on
stderr, ``lightning-cp: error: <key>: <reason>``, instead of a usage dump or a traceback: an unknown key,
a value of the wrong type, or a class that rejects its arguments when it is built (``cp`` not dividing the
number of devices, say). Only parsing and the building of the model, data module and trainer are treated
this way; an error raised while training keeps its traceback. Set ``JSONARGPARSE_DEBUG=1`` to get the
traceback of a configuration error too.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
from argparse import ArgumentError
from pathlib import Path
from typing import Any

from jsonargparse import set_parsing_settings
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

import lightning_cp  # noqa: F401  (registers strategy="megatron_cp")
from lightning_cp.callbacks import TokenLogprobWriter
from lightning_cp.strategies.preemption import PREEMPTED_EXIT_STATUS, PreemptionCheckpoint

_EXIT_STATUS = 2
"""Exit status of a command-line or configuration error (argparse's status for usage errors)."""

_SUBCOMMANDS = ("fit", "validate", "test", "predict")

_SUMMARY_METRICS = ("train/loss_epoch", "val/loss", "val/accuracy")
"""Logged values printed after ``fit``, when present."""

# Lines of jsonargparse's nested "Union" messages that describe the search, not the mistake.
_NOISE = (
    "Does not validate against any of the Union subtypes",
    "Subtypes:",
    "Errors:",
    "Given value type:",
    "Given value:",
    "Expected a <class 'NoneType'>",  # the `None` alternative of every optional class argument
)
# jsonargparse's own reasons why an alternative of a Union does not fit. A reason of any other kind comes
# from the class being built (MegatronCPStrategy, a callback) and is the one to show when there is one.
_GENERIC = (
    "Expected a ",
    "Not a valid subclass of",
    "Subclass types expect one of",
    "a class path (str)",
    "a dict with",
    "a dict without",
)
_KEY_LINE = re.compile(r'Parser key "(?P<key>[^"]+)":\s*(?P<rest>.*)')
_CLASS_LINE = re.compile(r"Problem with given class_path '(?P<class_path>[^']+)':\s*(?P<rest>.*)")


class ConfigurationError(ValueError):
    """A class named in the configuration rejected its arguments while the CLI was building it."""


class _HeldRecords(logging.Filter):
    """Keeps a logger's records back until :meth:`release`, which emits them or drops them."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self._logger = logger
        self._records: list[logging.LogRecord] = []
        logger.addFilter(self)

    @override
    def filter(self, record: logging.LogRecord) -> bool:
        self._records.append(record)
        return False

    def release(self, emit: bool) -> None:
        self._logger.removeFilter(self)
        for record in self._records if emit else ():
            self._logger.handle(record)


class CPLightningCLI(LightningCLI):
    """``LightningCLI`` defaulting to ``GPTModule`` on the long-range task, with a closing summary.

    Building the model, data module and trainer is wrapped so that the configuration mistakes those
    constructors report (``ValueError``, ``TypeError``, ``MisconfigurationException``) come out as
    :class:`ConfigurationError`, which :func:`main` turns into a one-line message. Errors of the run itself
    (``fit``, ``validate``, ...) are not touched.
    """

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults(
            {
                "model": {"class_path": "lightning_cp.models.GPTModule"},
                "data": {"class_path": "lightning_cp.data.LongRangeDataModule"},
            }
        )

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        super().parse_arguments(parser, args)
        # Lightning logs "Seed set to N" before the classes are built: print it only once they are,
        # so that a configuration error is the one line the user sees.
        self._seed_message = _HeldRecords(logging.getLogger(seed_everything.__module__))

    @override
    def instantiate_classes(self) -> None:
        built = False
        try:
            super().instantiate_classes()
            _check_vocabularies(self.model, self.datamodule)
            built = True
        except (ValueError, TypeError, MisconfigurationException) as error:
            raise ConfigurationError(str(error)) from error
        finally:
            self._seed_message.release(emit=built)

    def fit(self, **kwargs: Any) -> None:
        """``trainer.fit``, then a summary naming the logs and the checkpoint to resume from (rank 0).

        ``ckpt_path: last`` resumes the newest ``last*.ckpt`` of this run name: every run logs to a new
        ``<save_dir>/<name>/version_N`` and its checkpoints go to ``version_N/checkpoints`` unless the
        ``ModelCheckpoint`` has a ``dirpath``, so the previous versions are searched too. Re-running the same
        command after a crash or a preemption therefore continues where it stopped.

        The summary is printed when training ends, is preempted or crashes. A SIGTERM stop (preemption:
        every rank stopped after the same step, ``last.ckpt`` saved) ends the command with status 143.
        """
        if kwargs.get("ckpt_path") == "last":
            kwargs["ckpt_path"] = _last_checkpoint_of_run(self.trainer) or "last"
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

    def predict(self, **kwargs: Any) -> None:
        """``trainer.predict``, writing the per-token log-probabilities (:class:`TokenLogprobWriter`) under the
        first logger's directory unless the trainer already has a prediction writer."""
        trainer = self.trainer
        if not any(isinstance(callback, BasePredictionWriter) for callback in trainer.callbacks):
            root = trainer.loggers[0].log_dir if trainer.loggers else None
            trainer.callbacks.append(
                TokenLogprobWriter(Path(root or trainer.default_root_dir) / "predictions")
            )
        trainer.predict(**{**kwargs, "return_predictions": False})
        writers = [callback for callback in trainer.callbacks if isinstance(callback, TokenLogprobWriter)]
        if trainer.is_global_zero and writers:
            print(f"\nlightning-cp: per-token log-probabilities in {writers[0].output_dir}", flush=True)

    def _print_summary(self, outcome: str) -> None:
        trainer = self.trainer
        if not trainer.is_global_zero:
            return
        lines = ["", f"lightning-cp: training {outcome} after {trainer.global_step} steps"]
        for logger in trainer.loggers:
            label = "logs:" if logger is trainer.loggers[0] else ""
            lines.append(f"  {label:<12}{logger.log_dir or logger.save_dir}  ({type(logger).__name__})")
        resume_from = _resume_checkpoint(trainer)
        if trainer.checkpoint_callback is not None:
            lines.append(f"  {'checkpoint:':<12}{resume_from or '(none saved)'}")
        if resume_from and outcome != "finished":
            lines.append(f"  {'resume:':<12}the same command with --ckpt_path {resume_from}")
        metrics = trainer.callback_metrics
        for name in _SUMMARY_METRICS:
            if name in metrics:
                value = metrics[name].item()
                extra = (
                    f"  (perplexity {math.exp(value):.2f})" if name.endswith("loss") and value < 50 else ""
                )
                lines.append(f"  {name + ':':<18}{value:.4f}{extra}")
        print("\n".join(lines), flush=True)


def _check_vocabularies(model: LightningModule, datamodule: LightningDataModule | None) -> None:
    """A data vocabulary larger than the model's fails here, not as an ``IndexError`` in the embedding."""
    config = model.hparams.get("config")  # GPTModule's GPTConfig, a transformers config dict, ...
    model_vocab = (
        config.get("vocab_size") if isinstance(config, dict) else getattr(config, "vocab_size", None)
    )
    data_vocab = getattr(datamodule, "vocab_size", None)
    if isinstance(model_vocab, int) and isinstance(data_vocab, int) and data_vocab > model_vocab:
        raise ValueError(
            f"data.vocab_size={data_vocab} is larger than the model's vocab_size={model_vocab}: token ids up to "
            f"{data_vocab - 1} cannot be embedded. Set the model's vocab_size to at least {data_vocab}."
        )


def _last_checkpoint_of_run(trainer: Trainer) -> str | None:
    """The newest ``last*.ckpt`` in ``<save_dir>/<name>/version_*/checkpoints`` of the first logger.

    ``None`` when the ``ModelCheckpoint`` has its own ``dirpath`` (Lightning's ``"last"`` finds it there),
    there is no checkpointing or no logger, or no such file exists.
    """
    checkpoint = trainer.checkpoint_callback
    if not isinstance(checkpoint, ModelCheckpoint) or checkpoint.dirpath is not None or not trainer.loggers:
        return None
    logger = trainer.loggers[0]
    run = Path(logger.save_dir or trainer.default_root_dir) / str(logger.name or "")
    pattern = f"version_*/checkpoints/{checkpoint.CHECKPOINT_NAME_LAST}*{checkpoint.FILE_EXTENSION}"
    candidates = list(run.glob(pattern))
    return str(max(candidates, key=lambda path: path.stat().st_mtime)) if candidates else None


def _resume_checkpoint(trainer: Trainer) -> str | None:
    """The newest checkpoint of this run: the preemption one, else the ModelCheckpoint's last or best."""
    for callback in trainer.callbacks:
        if isinstance(callback, PreemptionCheckpoint) and callback.saved_path:
            return callback.saved_path
    checkpoint = trainer.checkpoint_callback
    if checkpoint is None:
        return None
    return checkpoint.last_model_path or checkpoint.best_model_path or None


def _one_line(message: str) -> str:
    """The most specific statement of a (possibly nested, multi-line) parser error, with its key.

    jsonargparse reports a bad value inside an optional class argument as a tree: the key, every
    alternative of the ``Union`` it tried, the class it imported, the nested key and only then the
    reason. The line a user can act on is a reason given by the class being built (rather than
    jsonargparse's "Expected a ..." for an alternative that does not fit), and among those the deepest;
    the ``Parser key`` and ``class_path`` lines above it (by indentation) give its full key, e.g.
    ``model.init_args.lr``.
    """
    lines = [line for line in message.splitlines() if line.strip()]
    enclosing: list[tuple[int, str, str]] = []  # (indent, "key" | "class", name) of the lines above
    best: tuple[tuple[bool, int], list[tuple[int, str, str]], str] | None = None
    for line in lines:
        text = line.strip().removeprefix("- ")
        if text.startswith(_NOISE):
            continue
        indent = len(line) - len(line.lstrip(" -"))
        while enclosing and enclosing[-1][0] >= indent:
            enclosing.pop()
        reason = text
        for kind, pattern in (("key", _KEY_LINE), ("class", _CLASS_LINE)):
            match = pattern.fullmatch(text)
            if match:
                enclosing.append((indent, kind, match.group(1)))
                reason = match.group("rest")
                break
        rank = (not reason.startswith(_GENERIC), indent)
        if reason and (best is None or rank > best[0]):
            best = (rank, list(enclosing), reason)
    if best is None:
        return lines[0].strip() if lines else message
    _, path, reason = best
    last_key = max((i for i, (_, kind, _) in enumerate(path) if kind == "key"), default=-1)
    parts = [name if kind == "key" else "init_args" for _, kind, name in path[: last_key + 1]]
    for _, _, class_path in path[last_key + 1 :]:
        reason = f"class_path '{class_path}': {reason}"  # the class itself failed (import, required args)
    return f"{'.'.join(parts)}: {reason}" if parts else reason


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
            args=args,
        )
    except (ArgumentError, ConfigurationError) as error:
        if os.environ.get("JSONARGPARSE_DEBUG"):
            raise
        print(f"lightning-cp: error: {_one_line(str(error))}", file=sys.stderr, flush=True)
        raise SystemExit(_EXIT_STATUS) from None
