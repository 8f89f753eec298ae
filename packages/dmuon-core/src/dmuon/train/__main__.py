"""Entry point of ``python -m dmuon.train`` and the ``dmuon-train`` console script."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dmuon.train.cli import parse_args
from dmuon.train.loop import TrainingDiverged, run


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, train, and return the exit status.

    0: trained; 2: bad flags or inputs (argparse also exits 2); 3: training diverged (a
    NaN or infinite loss or gradient norm; the message names the step).
    """
    config = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(config)
    except (FileNotFoundError, ValueError) as exc:
        print(f"dmuon-train: error: {exc}", file=sys.stderr)
        return 2
    except TrainingDiverged as exc:
        print(f"dmuon-train: error: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
