"""``python -m dmuon.plan``: plan a Hugging Face model on a cluster (see `dmuon.plan`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from dmuon.plan._hardware import DEFAULT_MFU, HARDWARE, MFU_SOURCE, parse_hardware, parse_tokens


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dmuon.plan",
        description=(
            "What DMuon costs each rank of a cluster: owned bytes, Newton-Schulz FLOPs and "
            "workspace, buffers, collectives per step, and the optimizer step's overhead "
            "against forward+backward. The model is built on the meta device from its "
            "config alone; nothing is downloaded, allocated or launched."
        ),
    )
    _add_layout_options(parser)
    _add_optimizer_options(parser)
    parser.add_argument("--per-rank", action="store_true", help="a line for every rank")
    parser.add_argument(
        "--recommend",
        action="store_true",
        help="rank every layout of --world GPUs that fits --hardware's memory (1-D and "
        "HSDP shard groups of 8 and up, Z2/Z3, the fewest micro-batches) by step time, "
        "each with why, beside FSDP2 + AdamW (--shard-size, --mode and --accum are chosen)",
    )
    parser.add_argument("--json", action="store_true", help="everything as JSON, for tools")
    return parser


def _add_layout_options(parser: argparse.ArgumentParser) -> None:
    """The model, the mesh, the tokens per step and how they are accumulated."""
    parser.add_argument("--model", required=True, help="Hugging Face model folder or config.json")
    parser.add_argument("--world", type=int, required=True, help="ranks in all")
    parser.add_argument(
        "--shard-size",
        type=int,
        default=None,
        help="data-parallel ranks per replica of an HSDP mesh (world / tp / shard-size "
        "replicas); default: every data-parallel rank (a 1-D mesh)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size (the world counts every rank, data-parallel x tp); the "
        "matrices the config's base_model_tp_plan splits are dedicated per shard",
    )
    parser.add_argument(
        "--tokens-per-step", default="4M", help="tokens per optimizer step (4M = 4,000,000)"
    )
    parser.add_argument("--mode", choices=("z2", "z3"), default="z3")
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--no-sync", action="store_true", help="accumulate under dmuon.no_sync")
    parser.add_argument(
        "--no-sync-scope",
        choices=("all", "replicas"),
        default="all",
        help='with --no-sync: dmuon.no_sync(scope=...); "replicas" reduces inside each '
        "replica every micro-batch and crosses replicas once per step",
    )


def _add_optimizer_options(parser: argparse.ArgumentParser) -> None:
    """The hardware, the iteration and the dtypes of buffers and reduces."""
    parser.add_argument(
        "--hardware",
        default="h100",
        help=f"{', '.join(sorted(HARDWARE))}, or TFLOPS,GBPS (dense bfloat16 peak, network "
        "per accelerator)",
    )
    parser.add_argument(
        "--mfu",
        type=float,
        default=None,
        help="share of the dense peak forward+backward reaches (default "
        f"{DEFAULT_MFU:.2f}: {MFU_SOURCE})".replace("%", "%%"),
    )
    parser.add_argument("--ns-steps", type=int, default=5, help="Newton-Schulz iterations")
    parser.add_argument(
        "--ns-dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="the iteration's dtype (dmuon.Muon(ns_dtype=...); bfloat16 on GPUs by default)",
    )
    parser.add_argument(
        "--ns-gram",
        action="store_true",
        help="dmuon.Muon(ns_gram=True): the Gram iteration where it applies (float32)",
    )
    parser.add_argument(
        "--param-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the packed buffers (dedicate_params(param_dtype=...))",
    )
    parser.add_argument(
        "--reduce-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype gradients are summed in between replicas, for DMuon and FSDP2 alike",
    )
    parser.add_argument(
        "--max-workspace-bytes",
        type=int,
        default=None,
        help="dmuon.Muon's cap on the Newton-Schulz workspace (default 2 GiB)",
    )
    parser.add_argument(
        "--ns-split",
        type=int,
        default=1,
        help="dedicate_params(ns_split=...): ranks per block that may share a matrix's "
        "iteration (a divisor of the shard size, such as the GPUs per node)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the planner's command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    # torch and the model code load after the flags parse, so --help answers at once.
    import torch

    from dmuon.plan._estimate import plan_cluster
    from dmuon.plan._model import active_parameters, planning_model
    from dmuon.plan._report import format_plan, print_recommendation

    try:
        hardware = parse_hardware(args.hardware)
        if args.mfu is not None:
            if not 0 < args.mfu <= 1:
                raise ValueError(
                    f"--mfu is a share of the peak in (0, 1], such as 0.34, not {args.mfu}"
                )
            hardware = dataclasses.replace(hardware, mfu=args.mfu)
        tokens = parse_tokens(args.tokens_per_step)
        model, config = planning_model(args.model)
        kwargs = {"ns_split": args.ns_split}
        if args.max_workspace_bytes is not None:
            kwargs["max_workspace_bytes"] = args.max_workspace_bytes
        if args.recommend:
            return print_recommendation(args, model, config, hardware, tokens, kwargs)
        plan = plan_cluster(
            model,
            args.world,
            args.shard_size,
            tokens_per_step=tokens,
            mode=args.mode,
            accum=args.accum,
            no_sync=args.no_sync,
            no_sync_scope=args.no_sync_scope,
            hardware=hardware,
            active_parameters=active_parameters(model, config),
            ns_steps=args.ns_steps,
            ns_dtype=torch.float32 if args.ns_dtype == "float32" else torch.bfloat16,
            ns_gram=args.ns_gram,
            param_bytes=2 if args.param_dtype == "bfloat16" else 4,
            reduce_bytes=2 if args.reduce_dtype == "bfloat16" else 4,
            tp=args.tp,
            **kwargs,
        )
    except ValueError as error:
        parser.error(str(error))
    if args.json:
        print(json.dumps(plan.as_dict(), indent=2))
    else:
        print(format_plan(plan, args.model, args.per_rank))
    return 0


if __name__ == "__main__":
    sys.exit(main())
