"""Where the time of one optimizer step goes, per rank: FSDP2 + AdamW against DMuon.

The same setup as `bench.py` (its model, batches, seeds, builders and thread count: one
thread per rank on a 2-core machine), interleaved round-robin after a warm-up round.
Explicit timers (``time.perf_counter``) around each phase of every step, with barriers
only at the step's edges and before ``optimizer.step()``:

* ``forward``, ``backward``: summed over the micro-batches, each including the time it
  was blocked on communication;
* ``comm``: the time the training thread spent inside a collective call or waiting on a
  collective's ``Work`` during forward and backward (the collectives wrapped as in
  `traffic.TrafficCounter`, plus ``Work.wait``); the transfer itself runs on gloo's own
  thread, so time it overlaps with compute is not counted;
* ``ns``: Newton-Schulz, the time inside ``NewtonSchulzWorkspace.run`` during the step;
* ``optim_rest``: the rest of ``optimizer.step()`` (momentum, weight decay, AdamW,
  the copies into and out of the Newton-Schulz buffers);
* ``wait``: time in the barriers (waiting for the slower rank);
* ``total``: from the first barrier to the last, as `bench.py` times a step;
* ``cpu``, ``ns_cpu``: the process's CPU time (``time.process_time``: every thread of the
  rank, gloo's included) over the step and inside Newton-Schulz. Other processes on a
  shared machine stretch wall times much more than CPU times, so these compare work.

Medians over the timed steps, per rank. ``--levers`` adds DMuon variants (``-gram``: the
Gram Newton-Schulz iteration, ``ns_gram=True``; ``-2threads``: two threads per rank during
its steps). After the timed steps, one more ``optimizer.step()`` per contender runs under
torch.profiler (operators and memory) to count its allocations and the share of its
operator time spent in matrix products and in copies. Each rank also times the batched float32
matrix product at the shapes its Newton-Schulz multiplies, alone, to show how close the
iteration runs to what the core can do (sampled after every round; the median is kept).

    python benchmarks/profile_step.py            # small, N=2, accumulation 1 and 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
import bench
from cli_types import positive_int
from machine import machine_info
from traffic import TrafficCounter

import dmuon
from dmuon.optim._orthogonalize import NewtonSchulzWorkspace
from dmuon.train import lm_loss

CONTENDERS = ("adamw-z2", "adamw-z3", "dmuon-z2", "dmuon-z3")
LEVERS: dict[str, tuple[dict[str, Any], int | None]] = {
    "dmuon-z2-gram": ({"ns_gram": True}, None),
    "dmuon-z3-gram": ({"ns_gram": True}, None),
    "dmuon-z2-2threads": ({}, 2),
}
"""DMuon variant -> (the `dmuon.Muon` keywords it changes, threads per rank during its steps)."""
ACCUM_1_ONLY = ("dmuon-z2-2threads",)
"""Variants run at accumulation 1 only (oversubscribed threads make them slow)."""
MATMUL_OPS = ("aten::bmm", "aten::baddbmm", "aten::mm", "aten::addmm", "aten::matmul")
COPY_OPS = ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous")
PHASES = ("forward", "backward", "comm", "ns", "optim_rest", "wait", "total", "ns_cpu", "cpu")


class CommTimer(TrafficCounter):
    """`TrafficCounter` that also sums the seconds the calling thread is blocked in
    collectives: inside a (wrapped) collective call or in ``Work.wait``, while `active`."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0
        self.active = False
        self._work_wait: Any = None

    def _counted(self, original: Any, name: str, cost: Any) -> Any:
        counted = super()._counted(original, name, cost)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth or not self.active:
                return counted(*args, **kwargs)
            start = time.perf_counter()
            try:
                return counted(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed

    def __enter__(self) -> CommTimer:
        super().__enter__()
        work = torch._C._distributed_c10d.Work
        original = self._work_wait = work.wait

        def wait(work_self: Any, *args: Any, **kwargs: Any) -> Any:
            if self._depth or not self.active:
                return original(work_self, *args, **kwargs)
            start = time.perf_counter()
            try:
                return original(work_self, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        work.wait = wait
        return self

    def __exit__(self, *exc: object) -> None:
        torch._C._distributed_c10d.Work.wait = self._work_wait
        super().__exit__(*exc)


class NewtonSchulzTimer:
    """Sums the seconds of every `NewtonSchulzWorkspace.run` (wall and process CPU time)
    and records the shapes run."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.shapes: set[tuple[int, int, int, int, bool]] = set()
        self._original = NewtonSchulzWorkspace.run

    def __enter__(self) -> NewtonSchulzTimer:
        original = self._original

        def run(ws: NewtonSchulzWorkspace, triples: Any, eps: float) -> Any:
            start, cpu_start = time.perf_counter(), time.process_time()
            result = original(ws, triples, eps)
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.process_time() - cpu_start
            batch = ws.source.shape[0]
            self.shapes.add((batch, ws.short, ws.long, len(triples), ws.gram))
            return result

        NewtonSchulzWorkspace.run = run  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        NewtonSchulzWorkspace.run = self._original  # type: ignore[method-assign]


def ns_flops(shapes: set[tuple[int, int, int, int, bool]]) -> float:
    """Floating-point operations of one standard Newton-Schulz pass over ``shapes``.

    Per matrix (short side s, long side n) and iteration: ``X Xᵀ`` and ``B X`` take
    2 s² n each, ``A A`` 2 s³. (For Gram buckets this is the work the Gram iteration
    replaces, so its rate reads as an effective one.)
    """
    return float(sum(b * t * (4 * s * s * n + 2 * s**3) for b, s, n, t, _ in shapes))


def bmm_rate(shapes: set[tuple[int, int, int, int, bool]], repeats: int = 2) -> float:
    """FLOP/s of float32 ``bmm`` alone at the Newton-Schulz shapes, per second of process
    CPU time (best of ``repeats``), the time other processes do not stretch."""
    pairs = []
    for batch, short, long, _, _ in sorted(shapes):
        x = torch.randn(batch, short, long)
        pairs.append((x, x.mT.contiguous(), torch.empty(batch, short, short)))
    flops = sum(2.0 * x.shape[0] * x.shape[1] ** 2 * x.shape[2] for x, _, _ in pairs)
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for x, xt, out in pairs:
            torch.bmm(x, xt, out=out)
        best = min(best, time.process_time() - start)
    return flops / best


def _build(contender: str, args: argparse.Namespace) -> tuple[Any, Any]:
    base = "-".join(contender.split("-")[:2])
    model, optimizer, _ = bench._build(base, args, "cpu")
    if contender in LEVERS and LEVERS[contender][0]:
        optimizer = dmuon.Muon(model, **LEVERS[contender][0])
    return model, optimizer


def step_profile(model: Any, optimizer: Any, args: argparse.Namespace, accum: int) -> dict:
    """One more step, its ``optimizer.step()`` under torch.profiler: allocations (count,
    bytes) and the share of operator self time in matrix products and in copies."""
    for micro, tokens in enumerate(bench.micro_batches(args, accum)):
        with bench.sync_context(model, micro, accum):
            (lm_loss(model(tokens[:, :-1]), tokens[:, 1:]) / accum).backward()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        optimizer.step()
    optimizer.zero_grad()
    dist.barrier()
    allocated = [
        e.nbytes()
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.nbytes() > 0
    ]
    ops = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in ops) or 1.0
    return {
        "allocations": len(allocated),
        "allocated_bytes": sum(allocated),
        "matmul_share": sum(e.self_cpu_time_total for e in ops if e.key in MATMUL_OPS) / total,
        "copy_share": sum(e.self_cpu_time_total for e in ops if e.key in COPY_OPS) / total,
    }


def _profiled_step(
    model: Any, optimizer: Any, args: argparse.Namespace, accum: int, comm: CommTimer
) -> dict[str, float]:
    times = dict.fromkeys(PHASES, 0.0)
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    comm.seconds = 0.0
    comm.active = True
    for micro, tokens in enumerate(bench.micro_batches(args, accum)):
        with bench.sync_context(model, micro, accum):
            t0 = time.perf_counter()
            loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:]) / accum
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
        times["forward"] += t1 - t0
        times["backward"] += t2 - t1
    comm.active = False
    times["comm"] = comm.seconds
    t0 = time.perf_counter()
    dist.barrier()
    t1 = time.perf_counter()
    with NewtonSchulzTimer() as ns:
        optimizer.step()
    t2 = time.perf_counter()
    optimizer.zero_grad()
    t3 = time.perf_counter()
    dist.barrier()
    end, cpu_end = time.perf_counter(), time.process_time()
    times["ns"] = ns.seconds
    times["ns_cpu"] = ns.cpu_seconds
    times["cpu"] = cpu_end - cpu_start
    times["optim_rest"] = t2 - t1 - ns.seconds
    times["wait"] = (t1 - t0) + (end - t3)
    times["total"] = end - start
    times["ns_flops"] = ns_flops(ns.shapes)
    times["ns_shapes"] = sorted(ns.shapes)  # type: ignore[assignment]
    return times


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(max(1, args.threads))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    rows = []
    shapes: set[tuple[int, int, int, int, bool]] = set()
    rates: list[float] = []
    with CommTimer() as comm:
        for accum in args.accum:
            built = {
                c: _build(c, args) for c in args.contenders if accum == 1 or c not in ACCUM_1_ONLY
            }
            steps: dict[str, list[dict[str, Any]]] = {c: [] for c in built}
            for round_index in range(1 + args.steps):
                for contender, (model, optimizer) in built.items():
                    threads = LEVERS.get(contender, ({}, None))[1]
                    torch.set_num_threads(threads or args.threads)
                    times = _profiled_step(model, optimizer, args, accum, comm)
                    torch.set_num_threads(args.threads)
                    if round_index >= 1:
                        steps[contender].append(times)
                    shapes.update(tuple(s) for s in times["ns_shapes"] if not s[4])
                if round_index >= 1 and shapes:
                    # The reference rate, sampled every round like the steps it is
                    # compared with, by both ranks at once as in the step.
                    dist.barrier()
                    rates.append(bmm_rate(shapes))
            inside = {c: step_profile(*built[c], args, accum) for c in built}
            for contender, measured in steps.items():
                row: dict[str, Any] = {"contender": contender, "accum": accum, "rank": rank}
                for phase in PHASES:
                    row[phase] = statistics.median(m[phase] for m in measured)
                row["ns_flops"] = measured[0]["ns_flops"]
                row["ns_shapes"] = measured[0]["ns_shapes"]
                row["optimizer_step_profile"] = inside[contender]
                rows.append(row)
            built.clear()
    rate = statistics.median(rates) if rates else None
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (rows, rate))
    if rank == 0:
        out.put(gathered)
    dist.destroy_process_group()


def summarize(per_rank: list[tuple[list[dict[str, Any]], float | None]]) -> list[dict[str, Any]]:
    """One row per (contender, accumulation): each phase per rank, the mean of the ranks,
    and DMuon's extra total over AdamW at the same FSDP2 mode."""
    merged: dict[tuple[str, int], dict[str, Any]] = {}
    for rank_rows, rate in per_rank:
        for r in rank_rows:
            row = merged.setdefault(
                (r["contender"], r["accum"]),
                {"contender": r["contender"], "accum": r["accum"], "per_rank": []},
            )
            if r["rank"] == 0:
                row["optimizer_step_profile_rank0"] = r["optimizer_step_profile"]
            row["per_rank"].append(
                {**{p: r[p] for p in PHASES}, "ns_flops": r["ns_flops"], "bmm_flops_per_s": rate}
            )
    rows = list(merged.values())
    for row in rows:
        ranks = row["per_rank"]
        row["mean"] = {p: statistics.fmean(r[p] for r in ranks) for p in PHASES}
    for row in rows:
        mode = row["contender"].split("-")[1]
        base = merged.get((f"adamw-{mode}", row["accum"]))
        row["extra_over_adamw_s"] = base and row["mean"]["total"] - base["mean"]["total"]
        row["extra_cpu_over_adamw_s"] = base and row["mean"]["cpu"] - base["mean"]["cpu"]
        row["cpu_vs_adamw_same_mode"] = base and row["mean"]["cpu"] / base["mean"]["cpu"]
        row["vs_adamw_same_mode"] = base and row["mean"]["total"] / base["mean"]["total"]
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """bench.py's settings (model, micro-batch, sequence length) plus this script's."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--accum", type=positive_int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=positive_int, default=3, help="timed steps per contender")
    parser.add_argument("--threads", type=positive_int, default=None, help="threads per rank")
    parser.add_argument("--levers", action="store_true", help="add the -gram DMuon variants")
    parser.add_argument("--name", default=None, help="results/<name>.json")
    own = parser.parse_args(argv)
    args = bench.parse_args(["--model", own.model, "--accum", *map(str, own.accum)])
    args.steps = own.steps
    args.contenders = [*CONTENDERS, *(LEVERS if own.levers else ())]
    # bench.py's worker: the cores split evenly over the ranks.
    args.threads = own.threads or max(1, (os.cpu_count() or 1) // args.nproc)
    args.name = own.name or f"profile_{own.model}-n{args.nproc}"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run, print the breakdown, write ``results/<name>.json``."""
    args = parse_args(argv)
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.spawn(_worker, args=(args.nproc, bench._free_port(), args, queue), nprocs=args.nproc)
    rows = summarize(queue.get())
    result = {
        "name": args.name,
        "model": args.model,
        "nproc": args.nproc,
        "device": "cpu",
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "threads": args.threads,
        "accum": list(args.accum),
        "contenders": list(args.contenders),
        "timers": "explicit perf_counter timers, barriers at the step's edges",
        "machine": machine_info(),
        "rows": rows,
    }
    print(f"{'contender':16} accum " + " ".join(f"{p:>10}" for p in PHASES))
    for row in rows:
        cells = " ".join(f"{row['mean'][p]:10.3f}" for p in PHASES)
        print(f"{row['contender']:16} {row['accum']:5} {cells}")
    bench.RESULTS.mkdir(parents=True, exist_ok=True)
    (bench.RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
