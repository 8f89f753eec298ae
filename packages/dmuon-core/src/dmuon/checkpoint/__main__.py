"""``python -m dmuon.checkpoint``: tools for DCP checkpoints.

* ``export CKPT_DIR --output FILE``: one file of full weights (``.pt`` or ``.safetensors``);
* ``export-hf CKPT_DIR DIR``: a Hugging Face model directory (`dmuon.checkpoint.export_hf`);
* ``verify DIR``: check a folder against its manifest without loading it (exit 0 when
  whole, 1 when damaged or incomplete).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dmuon.checkpoint import _manifest as manifest
from dmuon.checkpoint._export import export_weights
from dmuon.checkpoint._hf_export import export_hf


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
    export_hf_cmd = commands.add_parser(
        "export-hf",
        help="write a Hugging Face model directory from a checkpoint",
        description="Write a directory that transformers' from_pretrained loads (config, "
        "safetensors weights, tokenizer, generation config) from a DCP checkpoint written "
        "at any world size, without a process group.",
    )
    export_hf_cmd.add_argument("checkpoint_dir", help="a checkpoint directory (has .metadata)")
    export_hf_cmd.add_argument("output", help="the directory to write")
    export_hf_cmd.add_argument(
        "--config",
        metavar="MODEL_DIR",
        default=None,
        help="take config.json and the tokenizer from this model directory (default: the "
        "checkpoint's hf/ folder, which the recipe writes)",
    )
    verify = commands.add_parser(
        "verify",
        help="check a checkpoint folder against its manifest, without loading it",
        description="Check that every file a checkpoint's manifest lists is there, with the "
        "size and checksum it was written with. Exit code 0 when the folder is whole, 1 when "
        "it is damaged or incomplete.",
    )
    verify.add_argument("checkpoint_dir", help="a checkpoint folder written by DMuon's recipe")
    verify.add_argument(
        "--sizes-only", action="store_true", help="compare sizes only (reads no file)"
    )
    args = parser.parse_args(argv)
    if args.command == "verify":
        problems = manifest.verify_checkpoint(args.checkpoint_dir, checksums=not args.sizes_only)
        for problem in problems:
            print(f"{args.checkpoint_dir}: {problem}", file=sys.stderr)
        if not problems:
            print(f"{args.checkpoint_dir}: whole")
        return 1 if problems else 0
    if args.command == "export-hf":
        try:
            out = export_hf(args.checkpoint_dir, args.output, config_dir=args.config)
        except (FileNotFoundError, KeyError, ValueError, ImportError) as error:
            message = error.args[0] if isinstance(error, KeyError) else str(error)
            print(f"python -m dmuon.checkpoint export-hf: error: {message}", file=sys.stderr)
            return 2
        print(f"wrote a Hugging Face model directory to {out}")
        return 0
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
