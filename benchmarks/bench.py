"""Side-by-side benchmark: step time and counted traffic of every contender, in one run.

Contenders train the same model on the same batches on N ranks (gloo on CPU, NCCL with
``--cuda``), interleaved round-robin in one process group so drift hits them alike:
FSDP2 + AdamW at Z2 and Z3 (FSDP2 ``reshard_after_forward`` False/True), DMuon Z2 and Z3,
and naive FSDP2 + Muon (`dmuon.optim.naive.NaiveMuon`, Z3). Traffic is counted by
intercepting torch.distributed (`traffic.TrafficCounter`), never from a library's audit.

    python benchmarks/bench.py                 # full: small, accumulation 1/4/8
    python benchmarks/bench.py --quick         # CI: tiny, accumulation 1/2, traffic only

Results go to ``benchmarks/results/<name>.json`` and a Markdown table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from machine import machine_info
from traffic import TrafficCounter

CONTENDERS = ("adamw-z2", "adamw-z3", "dmuon-z2", "dmuon-z3", "naive-z3")
PEERS_NOT_RUN = {
    "muon-fsdp2": "not run: pinned (0.3.0) in the bench extra, not yet driven by this harness",
    "dtensor-muon": "not run: pinned (0.1.0) in the bench extra, not yet driven by this harness",
}
RESULTS = Path(__file__).parent / "results"


def formula_units(contender: str, accum: int) -> float | None:
    """Muon-target traffic per optimizer step in units of (N-1)/N x P_M (DESIGN.md)."""
    if contender == "dmuon-z2":
        return 2.0
    if contender == "dmuon-z3":
        return 2.0 * accum + 1.0
    if contender == "naive-z3":
        return 2.0 * accum + 2.0
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(contender: str, args: argparse.Namespace, device: str) -> tuple[Any, Any, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from dmuon.optim.naive import NaiveMuon
    from dmuon.train import build_model

    mesh = init_device_mesh(device, (dist.get_world_size(),))
    model = build_model(args.model, seed=0, max_seq_len=args.seq_len, device=device)
    reshard = contender.endswith("z3")
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    p_m = 0
    if contender.startswith("dmuon"):
        owners = dmuon.dedicate_params(model, mesh, reshard_after_forward=reshard)
        p_m = sum(sizes[fqn] for fqn in owners)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    if contender.startswith("adamw"):
        optimizer: Any = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif contender.startswith("dmuon"):
        optimizer = dmuon.Muon(model)
    else:
        optimizer = NaiveMuon(model)
    return model, optimizer, p_m


def _train_step(model: Any, optimizer: Any, args: argparse.Namespace, accum: int) -> None:
    import dmuon
    from dmuon.train import lm_loss

    device = "cuda" if args.cuda else "cpu"
    gen = torch.Generator().manual_seed(dist.get_rank())
    for micro in range(accum):
        tokens = torch.randint(0, 256, (args.micro_batch, args.seq_len + 1), generator=gen)
        tokens = tokens.to(device)
        with dmuon.no_sync(model) if micro + 1 < accum else nullcontext():
            loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:]) / accum
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
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
    rows = []
    for accum in args.accum:
        built = {c: _build(c, args, "cuda" if args.cuda else "cpu") for c in CONTENDERS}
        times: dict[str, list[float]] = {c: [] for c in CONTENDERS}
        traffic: dict[str, dict[str, int]] = {}
        for round_index in range(1 + args.steps):
            for contender in CONTENDERS:
                model, optimizer, _ = built[contender]
                _sync(args.cuda)
                counted = round_index == 1
                with TrafficCounter() if counted else nullcontext() as counter:
                    start = time.perf_counter()
                    _train_step(model, optimizer, args, accum)
                    _sync(args.cuda)
                    elapsed = time.perf_counter() - start
                if counter is not None:
                    traffic[contender] = {
                        "dmuon": counter.total("dmuon"),
                        "torch": counter.total("torch"),
                    }
                if round_index >= 1:
                    times[contender].append(elapsed)
        p_m = built["dmuon-z3"][2]
        for contender in CONTENDERS:
            t = traffic[contender]
            if contender.startswith("dmuon"):
                measured = t["dmuon"] / p_m
            elif contender.startswith("naive"):
                # FSDP2 moves the matrices' elements on top of what it moves for the rest,
                # which is exactly DMuon Z3's torch-issued traffic (same FSDP2 setting).
                measured = (t["torch"] - traffic["dmuon-z3"]["torch"] + t["dmuon"]) / p_m
            else:
                measured = None
            rows.append(
                {
                    "contender": contender,
                    "accum": accum,
                    "median_step_s": statistics.median(times[contender]),
                    "elements_per_rank": t,
                    "muon_units": measured,
                    "formula_units": formula_units(contender, accum),
                }
            )
        del built
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def _ratios(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        mode = row["contender"][-2:]
        base = next(
            r for r in rows if r["contender"] == f"adamw-{mode}" and r["accum"] == row["accum"]
        )
        row["vs_adamw_same_mode"] = row["median_step_s"] / base["median_step_s"]


def format_table(result: dict[str, Any]) -> str:
    """The Markdown table of one run."""
    lines = [
        "| contender | accum | step (s) | vs AdamW (same mode) | Muon units | formula |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        units = "-" if r["muon_units"] is None else f"{r['muon_units']:.2f}"
        formula = "-" if r["formula_units"] is None else f"{r['formula_units']:.0f}"
        lines.append(
            f"| {r['contender']} | {r['accum']} | {r['median_step_s']:.3f} | "
            f"{r['vs_adamw_same_mode']:.2f}x | {units} | {formula} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Spawn ``args.nproc`` ranks, run every contender, return the result record."""
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.spawn(_worker, args=(args.nproc, _free_port(), args, queue), nprocs=args.nproc)
    rows = queue.get()
    _ratios(rows)
    return {
        "name": args.name,
        "model": args.model,
        "nproc": args.nproc,
        "device": "cuda" if args.cuda else "cpu",
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "machine": machine_info(),
        "peers": PEERS_NOT_RUN,
        "rows": rows,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; ``--quick`` picks the CI configuration."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, traffic only (CI)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--model", default=None)
    parser.add_argument("--accum", type=int, nargs="+", default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per contender")
    parser.add_argument("--cuda", action="store_true", help="NCCL on GPUs instead of gloo")
    parser.add_argument("--name", default=None, help="results/<name>.json")
    args = parser.parse_args(argv)
    quick = args.quick
    args.model = args.model or ("tiny" if quick else "small")
    args.accum = args.accum or ([1, 2] if quick else [1, 4, 8])
    args.seq_len = args.seq_len or (32 if quick else 128)
    args.steps = args.steps or (1 if quick else 5)
    args.name = args.name or ("quick" if quick else f"{args.model}-n{args.nproc}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run, print the table, write ``results/<name>.json``."""
    args = parse_args(argv)
    result = run(args)
    print(format_table(result))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
