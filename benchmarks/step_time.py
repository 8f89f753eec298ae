"""Step time and traffic of DMuon against AdamW and naive FSDP2 + Muon, in one run.

Every variant trains the same model on the same batches on N ranks (gloo on CPU, NCCL on
CUDA) and is timed in the same process group, interleaved round-robin so drift on a noisy
machine hits every variant alike. The report gives each variant's median optimizer-step
time as a ratio to AdamW measured in this run, and the traffic for Muon-target matrices in
units of (N-1)/N x P_M: DMuon's from its audit; the naive baseline's step all-gather from
its audit plus FSDP2's own all-gather/reduce-scatter by formula.

    python benchmarks/step_time.py --nproc 2 --model small --accum 4
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dmuon.optim.naive import NaiveMuon

VARIANTS = ("adamw", "dmuon-z2", "dmuon-z3", "naive-z3")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(variant: str, args: argparse.Namespace, device: str) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from dmuon.train import build_model

    mesh = init_device_mesh(device, (dist.get_world_size(),))
    model = build_model(args.model, seed=0, max_seq_len=args.seq_len, device=device)
    if variant.startswith("dmuon"):
        dmuon.dedicate_params(model, mesh, reshard_after_forward=variant.endswith("z3"))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if variant == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif variant.startswith("dmuon"):
        optimizer = dmuon.Muon(model)
    else:
        optimizer = NaiveMuon(model)
    return model, optimizer


def _train_step(model: Any, optimizer: Any, args: argparse.Namespace, device: str) -> None:
    import dmuon
    from dmuon.train import lm_loss

    gen = torch.Generator().manual_seed(dist.get_rank())
    for micro in range(args.accum):
        tokens = torch.randint(0, 256, (args.micro_batch, args.seq_len + 1), generator=gen)
        tokens = tokens.to(device)
        accumulating = micro + 1 < args.accum
        with dmuon.no_sync(model) if accumulating else nullcontext():
            loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:]) / args.accum
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _units(variant: str, model: Any, optimizer: Any, accum: int) -> float | None:
    import dmuon

    if variant.startswith("dmuon"):
        return dmuon.comm_audit(model).last_step().units
    if variant.startswith("naive"):
        # FSDP2 resharding after forward all-gathers twice per micro-batch and, under
        # no_sync, reduce-scatters once per step: 2k + 1 units; the step's all-gather is
        # measured.
        return 2.0 * accum + 1.0 + optimizer.audit.last_step().units
    return None


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    device = "cuda" if args.cuda else "cpu"
    if args.cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "nccl" if args.cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
    )
    built = {v: _build(v, args, device) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for round_index in range(args.warmup + args.steps):
        for variant in VARIANTS:
            model, optimizer = built[variant]
            if args.cuda:
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            _train_step(model, optimizer, args, device)
            if args.cuda:
                torch.cuda.synchronize()
            dist.barrier()
            if round_index >= args.warmup:
                times[variant].append(time.perf_counter() - start)
    if rank == 0:
        out.put(
            {
                v: {
                    "median_s": statistics.median(times[v]),
                    "units": _units(v, *built[v], args.accum),
                }
                for v in VARIANTS
            }
        )
    dist.destroy_process_group()


def main() -> None:
    """Parse flags, run every variant on ``--nproc`` ranks, print the ratio table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cuda", action="store_true", help="NCCL on GPUs instead of gloo")
    args = parser.parse_args()
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.spawn(_worker, args=(args.nproc, _free_port(), args, queue), nprocs=args.nproc)
    results = queue.get()
    baseline = results["adamw"]["median_s"]
    print(
        f"model={args.model} ranks={args.nproc} accum={args.accum} "
        f"micro_batch={args.micro_batch} seq_len={args.seq_len} "
        f"device={'cuda' if args.cuda else 'cpu'} steps={args.steps}"
    )
    print(f"{'variant':<10} {'step (s)':>9} {'vs AdamW':>9} {'Muon units':>11}")
    for variant, row in results.items():
        units = "-" if row["units"] is None else f"{row['units']:.2f}"
        ratio = row["median_s"] / baseline
        print(f"{variant:<10} {row['median_s']:>9.3f} {ratio:>8.2f}x {units:>11}")


if __name__ == "__main__":
    main()
