"""DMuon under DistributedDataParallel and under FSDP2 + tensor parallelism, side by side.

A Hugging Face Llama built from a config (sizes of the ``small`` preset: 4 layers, width
256, 4 heads, MLP 768, vocabulary 256) trains on the same batches under each contender,
interleaved round-robin in one process group so drift hits them alike:

- ``--layout ddp`` (2 ranks): DDP + AdamW; DDP + ``torch.optim.Muon`` on the hidden
  matrices (every rank orthogonalizes every matrix) + AdamW; DMuon Z2 and Z3 under DDP.
- ``--layout tp`` (4 ranks, (dp, tp) = (2, 2)): FSDP2 + TP + AdamW; DMuon Z2 and Z3 with
  FSDP2 + TP (torch's ColwiseParallel / RowwiseParallel on attention and MLP).

Per contender: median step time, median ``optimizer.step()`` time, and the traffic of the
hidden matrices, counted by intercepting torch.distributed (`traffic.TrafficCounter`),
never read from a library's audit; DDP all-reduces its buckets through its documented
default hook, so that they pass through torch.distributed too. ``matrix_units``
is the data-parallel traffic of the matrices in units of (N-1)/N x P_M (P_M: their elements
in one tp position, all of them without tensor parallelism); under DMuon with tensor
parallelism ``tp_units`` is rank 0's gather and scatter traffic in units of (T-1)/T x the
whole matrices' elements. Ratios are against the AdamW contender of the same run.

    python benchmarks/layouts.py --layout ddp
    python benchmarks/layouts.py --layout tp

Results go to ``benchmarks/results/layouts-<layout>.json`` and a Markdown table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench import _free_port, _sync
from cli_types import positive_int
from machine import machine_info
from traffic import TrafficCounter

LAYOUTS = {
    "ddp": {
        "nproc": 2,
        "contenders": ("ddp-adamw", "ddp-torch-muon", "ddp-dmuon-z2", "ddp-dmuon-z3"),
    },
    "tp": {"nproc": 4, "contenders": ("tp-adamw", "tp-dmuon-z2", "tp-dmuon-z3")},
}
RESULTS = Path(__file__).parent / "results"
VOCAB = 256
HIDDEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llama(seed: int = 0) -> Any:
    """The benchmark model: a Llama of the ``small`` preset's sizes, from a config."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )
    return transformers.LlamaForCausalLM(config)


def hidden_matrices(model: Any) -> list[torch.nn.Parameter]:
    """The decoder layers' projection weights (what DMuon dedicates by default)."""
    return [
        p
        for name, p in model.named_parameters()
        if name.endswith(".weight") and name.split(".")[-2] in HIDDEN
    ]


def tp_plan(model: Any) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(len(model.model.layers)):
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return plan


def build(contender: str) -> tuple[Any, Any, Any, int]:
    """``(model to call, optimizer, mesh, P_M)`` of one contender."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    import dmuon

    model = llama()
    p_m = sum(p.numel() for p in hidden_matrices(model))
    world = dist.get_world_size()
    z3 = contender.endswith("z3")
    if contender.startswith("ddp"):
        mesh = init_device_mesh("cpu", (world,))
        if "dmuon" in contender:
            dmuon.dedicate_params(model, mesh, reshard_after_forward=z3)
        wrapped = DistributedDataParallel(model)
        # DDP's own all-reduce, issued through torch.distributed so that it is counted.
        wrapped.register_comm_hook(None, allreduce_hook)
        if contender == "ddp-adamw":
            return wrapped, torch.optim.AdamW(model.parameters(), lr=1e-3), mesh, p_m
        if contender == "ddp-torch-muon":
            matrices = {id(p) for p in hidden_matrices(model)}
            muon = torch.optim.Muon([p for p in model.parameters() if id(p) in matrices])
            rest = [p for p in model.parameters() if id(p) not in matrices]
            return wrapped, (muon, torch.optim.AdamW(rest, lr=1e-3)), mesh, p_m
        return wrapped, dmuon.Muon(wrapped), mesh, p_m
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], tp_plan(model))
    if "dmuon" in contender:
        dmuon.dedicate_params(model, mesh["dp"], reshard_after_forward=z3)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=z3)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=z3)
    p_m //= 2  # the matrices' elements in one tp position
    if contender == "tp-adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), mesh, p_m
    return model, dmuon.Muon(model), mesh, p_m


def _data_rank(mesh: Any) -> tuple[int, int]:
    """``(dp rank, dp size)``: tensor-parallel ranks of one dp position see the same data."""
    if mesh.ndim == 2:
        return mesh["dp"].get_local_rank(), mesh["dp"].size()
    return mesh.get_local_rank(), mesh.size()


def train_step(contender: str, built: tuple[Any, ...], args: argparse.Namespace) -> float:
    """One optimizer step over ``args.accum`` micro-batches; returns the seconds of step()."""
    import dmuon

    model, optimizer, mesh, _ = built
    rank, _ = _data_rank(mesh)
    gen = torch.Generator().manual_seed(rank)
    for micro in range(args.accum):
        tokens = torch.randint(0, VOCAB, (args.micro_batch, args.seq_len + 1), generator=gen)
        last = micro + 1 == args.accum
        if "dmuon" in contender:
            context = nullcontext() if last else dmuon.no_sync(model)
        elif contender.startswith("ddp"):
            context = nullcontext() if last else model.no_sync()
        else:
            model.set_requires_gradient_sync(last)
            context = nullcontext()
        with context:
            logits = model(tokens[:, :-1]).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            (loss / args.accum).backward()
    optimizers = optimizer if isinstance(optimizer, tuple) else (optimizer,)
    _sync(False)
    start = time.perf_counter()
    for each in optimizers:
        each.step()
    elapsed = time.perf_counter() - start
    for each in optimizers:
        each.zero_grad()
    return elapsed


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    built = {c: build(c) for c in args.contenders}
    times: dict[str, list[float]] = {c: [] for c in built}
    optim_times: dict[str, list[float]] = {c: [] for c in built}
    traffic: dict[str, dict[str, int]] = {}
    for round_index in range(1 + args.steps):
        for contender, parts in built.items():
            _sync(False)
            counted = round_index == 1
            with TrafficCounter() if counted else nullcontext() as counter:
                start = time.perf_counter()
                optim = train_step(contender, parts, args)
                _sync(False)
                elapsed = time.perf_counter() - start
            if counter is not None:
                dp_ops = ("broadcast", "reduce")
                traffic[contender] = {
                    "dmuon_dp": sum(counter.elements[("dmuon", op)] for op in dp_ops),
                    "dmuon_tp": counter.total("dmuon")
                    - sum(counter.elements[("dmuon", op)] for op in dp_ops),
                    "torch": counter.total("torch"),
                }
            if round_index >= 1:
                times[contender].append(elapsed)
                optim_times[contender].append(optim)
    if rank == 0:
        out.put((times, optim_times, traffic, {c: parts[3] for c, parts in built.items()}))
    dist.destroy_process_group()


def record(args: argparse.Namespace, measured: tuple[Any, ...]) -> dict[str, Any]:
    """The result record: per contender times, ratios to AdamW, counted traffic in units."""
    times, optim_times, traffic, p_ms = measured
    baseline = args.contenders[0]
    first_dmuon = next(c for c in args.contenders if "dmuon" in c)
    rest = traffic[first_dmuon]["torch"]
    rows = []
    for contender in args.contenders:
        p_m = p_ms[contender]
        counted = traffic[contender]
        tp_units = None
        if "dmuon" in contender:
            units = counted["dmuon_dp"] / p_m  # DMuon's own broadcasts and reduces
            if args.layout == "tp":
                tp_units = counted["dmuon_tp"] / (2 * p_m)
        else:
            # DDP / FSDP2 move the matrices on top of the rest, which a DMuon run moves too.
            units = (counted["torch"] - rest) / p_m
        rows.append(
            {
                "contender": contender,
                "median_step_s": statistics.median(times[contender]),
                "median_optim_step_s": statistics.median(optim_times[contender]),
                "vs_adamw": statistics.median(times[contender])
                / statistics.median(times[baseline]),
                "optim_vs_adamw": statistics.median(optim_times[contender])
                / statistics.median(optim_times[baseline]),
                "elements_per_rank": counted,
                "muon_elements": p_m,
                "matrix_units": units,
                "tp_units": tp_units,
            }
        )
    return {
        "name": f"layouts-{args.layout}",
        "layout": args.layout,
        "nproc": args.nproc,
        "model": "llama (small sizes)",
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "accum": args.accum,
        "steps": args.steps,
        "contenders": list(args.contenders),
        "machine": machine_info(),
        "rows": rows,
    }


def format_table(result: dict[str, Any]) -> str:
    """The Markdown table of one run."""
    lines = [
        "| contender | step (s) | vs AdamW | optimizer step (s) | vs AdamW | matrix units "
        "| tp units |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        tp = "-" if r["tp_units"] is None else f"{r['tp_units']:.2f}"
        lines.append(
            f"| {r['contender']} | {r['median_step_s']:.3f} | {r['vs_adamw']:.2f}x | "
            f"{r['median_optim_step_s']:.4f} | {r['optim_vs_adamw']:.2f}x | "
            f"{r['matrix_units']:.2f} | {tp} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps per contender")
    parser.add_argument("--accum", type=positive_int, default=1)
    parser.add_argument("--micro-batch", type=positive_int, default=4)
    parser.add_argument("--seq-len", type=positive_int, default=128)
    args = parser.parse_args(argv)
    args.nproc = LAYOUTS[args.layout]["nproc"]
    args.contenders = list(LAYOUTS[args.layout]["contenders"])
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run, print the table, write ``results/layouts-<layout>.json``."""
    args = parse_args(argv)
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(args.nproc, _free_port(), args, queue), nprocs=args.nproc)
    result = record(args, queue.get())
    print(format_table(result))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{result['name']}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
