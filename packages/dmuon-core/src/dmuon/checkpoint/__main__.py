"""``python -m dmuon.checkpoint export CKPT_DIR --output FILE``: one file of full weights."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dmuon.checkpoint.export import export_weights


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (2 for a usage error)."""
    parser = argparse.ArgumentParser(
        prog="python -m dmuon.checkpoint",
        description="Tools for DCP checkpoints of DMuon (and plain FSDP2) models.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser(
        "export",
        help="write the full model weights of a sharded checkpoint to one file",
        description="Write the full model weights of a sharded DCP checkpoint to one .pt or "
        ".safetensors file, without a process group.",
    )
    export.add_argument("checkpoint_dir", help="a DCP checkpoint directory (has .metadata)")
    export.add_argument("--output", required=True, help="FILE.pt or FILE.safetensors")
    export.add_argument(
        "--key",
        default="model",
        help="top-level entry holding the model state dict (default: model; '' for a "
        "checkpoint of a bare model state dict)",
    )
    args = parser.parse_args(argv)
    try:
        weights = export_weights(args.checkpoint_dir, args.output, args.key)
    except (FileNotFoundError, KeyError, ValueError, ImportError) as error:
        message = error.args[0] if isinstance(error, KeyError) else str(error)
        print(f"python -m dmuon.checkpoint export: error: {message}", file=sys.stderr)
        return 2
    elements = sum(t.numel() for t in weights.values())
    print(f"wrote {len(weights)} tensors ({elements:,} elements) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
