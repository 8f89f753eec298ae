"""Entry point of ``python -m dmuon.train`` and the ``dmuon-train`` console script.

Under torchrun the entry point records why it failed in torchrun's error file
(``torch.distributed.elastic.multiprocessing.errors.record``): torchrun then reports the
exception type and message of the rank that failed first, and a job server can show them.
Invalid flags are recorded as :class:`UsageError` with argparse's message.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from .cli import TrainConfig, parse_args
from .loop import run


class UsageError(Exception):
    """Invalid command-line flags (argparse's message; the exit status stays 2)."""


def _parse(argv: Sequence[str]) -> TrainConfig:
    """Parse flags; on an argparse error, record it as a :class:`UsageError` too."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return parse_args(argv)
    except SystemExit as exit_:
        sys.stderr.write(captured.getvalue())
        if exit_.code not in (0, None):
            lines = [line for line in captured.getvalue().splitlines() if line.strip()]
            ErrorHandler().record_exception(UsageError(lines[-1] if lines else "invalid flags"))
        raise


@record
def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, train, and return the exit status (2 on bad flags or data)."""
    config = _parse(sys.argv[1:] if argv is None else argv)
    try:
        run(config)
    except (FileNotFoundError, ValueError) as exc:
        print(f"dmuon-train: error: {exc}", file=sys.stderr)
        ErrorHandler().record_exception(exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
