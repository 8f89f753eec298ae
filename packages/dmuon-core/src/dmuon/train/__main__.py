"""Entry point of ``python -m dmuon.train`` and the ``dmuon-train`` console script.

Under torchrun the entry point records why it failed in torchrun's error file
(``torch.distributed.elastic.multiprocessing.errors.record``): torchrun then reports the
exception type and message of the rank that failed first, and a job server can show them.
Invalid flags are recorded as `UsageError` with argparse's message.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Sequence

import dmuon_recipe_contract as contract

from dmuon._startup import imports_kept_for_life
from dmuon.train.cli import TrainConfig, parse_args


class UsageError(Exception):
    """Invalid command-line flags (argparse's message; the exit status stays 2)."""


def _parse(argv: Sequence[str]) -> TrainConfig:
    """Parse flags; on an argparse error, record it as a `UsageError` too."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return parse_args(argv)
    except SystemExit as exit_:
        sys.stderr.write(captured.getvalue())
        if exit_.code not in (0, None):
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            lines = [line for line in captured.getvalue().splitlines() if line.strip()]
            ErrorHandler().record_exception(UsageError(lines[-1] if lines else "invalid flags"))
        raise


def main(argv: Sequence[str] | None = None, *, own_process: bool = False) -> int:
    """Parse flags, train, and return the exit status.

    0: trained; 2: bad flags or inputs (argparse also exits 2); 3: training diverged (a
    NaN or infinite loss or gradient norm; the message names the step); 4: a checkpoint
    could not be written and ``--on-checkpoint-error stop`` ended the run (the message
    names the folder and the space it needs).

    ``own_process`` (what `program` passes): this run is the whole process, whose
    imports may then be kept out of the garbage collector's reach (`dmuon._startup`).
    """
    config = _parse(sys.argv[1:] if argv is None else argv)
    # torch loads once the flags parse, so --help and flag errors answer at once.
    if own_process:
        with imports_kept_for_life():
            _import_what_a_run_uses(config)
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_train)(config)


def program() -> int:
    """The ``dmuon-train`` command and ``python -m dmuon.train``: `main` as a process of
    its own."""
    return main(own_process=True)


def _import_what_a_run_uses(config: TrainConfig) -> None:
    """Import what every run of ``config`` imports anyway: the loop, the compiler stack
    that torch's optimizers import on their first step, and transformers for a Hugging
    Face model. Imported here, with the collector paused, a rank of a short run uses
    about 40% less CPU time (`dmuon._startup`)."""
    import torch._dynamo
    import torch.distributed.elastic.multiprocessing.errors  # noqa: F401

    import dmuon.train.loop  # noqa: F401

    if config.model not in contract.PRESETS:
        # Without transformers the run itself says what to install.
        with contextlib.suppress(ImportError):
            import transformers.models.auto.modeling_auto  # noqa: F401


def _train(config: TrainConfig) -> int:
    """Run the recipe; each failure a user can cause is an exit status and a message."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    from dmuon.train.checkpoints.folder import CheckpointWriteError
    from dmuon.train.loop import TrainingDiverged, run

    try:
        run(config)
    except (FileNotFoundError, ValueError) as exc:
        print(f"dmuon-train: error: {exc}", file=sys.stderr)
        ErrorHandler().record_exception(exc)
        return contract.EXIT_USAGE
    except CheckpointWriteError as exc:
        print(f"dmuon-train: error: {exc.strerror}", file=sys.stderr)
        ErrorHandler().record_exception(exc)
        return contract.EXIT_CHECKPOINT_WRITE
    except TrainingDiverged as exc:
        print(f"dmuon-train: error: {exc}", file=sys.stderr)
        ErrorHandler().record_exception(exc)
        return contract.EXIT_DIVERGED
    return contract.EXIT_OK


if __name__ == "__main__":
    sys.exit(program())
