"""Side-by-side benchmark: step time and counted traffic of every contender, in one run.

Contenders train the same model on the same batches on N ranks (gloo on CPU, NCCL with
``--cuda``), interleaved round-robin in one process group so drift hits them alike:
FSDP2 + AdamW at Z2 and Z3 (FSDP2 ``reshard_after_forward`` False/True), DMuon Z2 and Z3,
naive FSDP2 + Muon (`naive_muon.NaiveMuon`, Z3), and the two published peers on
FSDP2 (Z3), driven through their public API and never patched: ``muon-fsdp2`` 0.3.0 and
``dtensor-muon`` 0.1.0 (``pip install -e 'packages/dmuon-core[bench]'``). A peer that cannot
run in a configuration is recorded with the exception it raised. Traffic is counted by
intercepting torch.distributed (`traffic.TrafficCounter`), never from a library's audit.

    python benchmarks/bench.py                 # full: small, accumulation 1/4/8
    python benchmarks/bench.py --quick --check # CI: tiny, accumulation 1/2, asserts traffic

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
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from cli_types import positive_int
from machine import machine_info
from memory import PeakTensorMemory, dedicated_bytes_formula, dedicated_bytes_held
from traffic import TrafficCounter

OWN = ("adamw-z2", "adamw-z3", "dmuon-z2", "dmuon-z3", "naive-z3")
PEERS = {"muon-fsdp2-z3": ("muon-fsdp2", "0.3.0"), "dtensor-muon-z3": ("dtensor-muon", "0.1.0")}
"""Peer contender -> (distribution, pinned version)."""
CONTENDERS = (*OWN, *PEERS)
RESULTS = Path(__file__).parent / "results"


def formula_units(contender: str, accum: int, nproc: int) -> float | None:
    """Muon-target traffic per optimizer step in units of (N-1)/N x P_M.

    FSDP2 at Z3 with ``no_sync`` accumulation moves 2k + 1 units (an all-gather for each
    forward and backward, one reduce-scatter); DMuon's are in DESIGN.md. On top of FSDP2:
    naive all-gathers the gradient (+1); ``muon-fsdp2`` gathers each gradient to one rank
    and scatters the update back (+2); ``dtensor-muon`` all-to-alls the stacked gradients
    to shards of whole matrices and back (+2/N). At one rank the unit is zero and nothing is
    compared (None).
    """
    if nproc == 1:
        return None
    fsdp_z3 = 2.0 * accum + 1.0
    return {
        "dmuon-z2": 2.0,
        "dmuon-z3": 2.0 * accum + 1.0,
        "naive-z3": fsdp_z3 + 1.0,
        "muon-fsdp2-z3": fsdp_z3 + 2.0,
        "dtensor-muon-z3": fsdp_z3 + 2.0 / nproc,
    }.get(contender)


def _muon_split(model: Any) -> tuple[list[Any], list[Any]]:
    """The matrices DMuon would dedicate (``nn.Linear`` weights, heads excluded), the rest."""
    from torch import nn

    import dmuon

    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    muon, rest = [], []
    for name, param in model.named_parameters():
        chosen = id(param) in linear and dmuon.default_predicate(name, param)
        (muon if chosen else rest).append(param)
    return muon, rest


def _peer_optimizer(contender: str, model: Any) -> Any:
    """A peer's optimizer over the FSDP2 model, built as its documentation shows."""
    muon, rest = _muon_split(model)
    if contender.startswith("muon-fsdp2"):
        import muon_fsdp2

        # Moonlight RMS scaling (its default) makes the AdamW rate the Muon rate as well.
        return muon_fsdp2.Muon(
            [
                {"params": muon, "use_muon": True, "lr": 3e-3},
                {"params": rest, "use_muon": False, "lr": 3e-3},
            ]
        )
    import dtensor_muon

    return dtensor_muon.MuonForeach(
        [{"params": muon, "lr": 0.02}, {"params": rest, "algorithm": "adamw", "lr": 3e-3}]
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(contender: str, args: argparse.Namespace, device: str) -> tuple[Any, Any, int]:
    from naive_muon import NaiveMuon
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from dmuon.train import build_model

    world = dist.get_world_size()
    if args.hsdp > 1:
        mesh = init_device_mesh(
            device, (args.hsdp, world // args.hsdp), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh(device, (world,))
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
    elif contender.startswith("naive"):
        optimizer = NaiveMuon(model)
    else:
        optimizer = _peer_optimizer(contender, model)
    return model, optimizer, p_m


def micro_batches(args: argparse.Namespace, accum: int) -> Iterator[torch.Tensor]:
    """The ``accum`` micro-batches of one step on this rank: the same tokens every step."""
    device = "cuda" if args.cuda else "cpu"
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(accum):
        tokens = torch.randint(0, 256, (args.micro_batch, args.seq_len + 1), generator=gen)
        yield tokens.to(device)


def sync_context(model: Any, micro: int, accum: int) -> Any:
    """``dmuon.no_sync`` on every micro-batch but the last, as a training loop would."""
    import dmuon

    return dmuon.no_sync(model) if micro + 1 < accum else nullcontext()


def _train_step(
    model: Any,
    optimizer: Any,
    args: argparse.Namespace,
    accum: int,
    after_forward: Callable[[], None] | None = None,
) -> float:
    """One optimizer step over ``accum`` micro-batches; returns the seconds of ``step()``.

    ``after_forward`` is called after each forward, before its backward.
    """
    from dmuon.train import lm_loss

    for micro, tokens in enumerate(micro_batches(args, accum)):
        with sync_context(model, micro, accum):
            loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:]) / accum
            if after_forward is not None:
                after_forward()
            loss.backward()
    _sync(args.cuda)
    start = time.perf_counter()
    optimizer.step()
    _sync(args.cuda)
    elapsed = time.perf_counter() - start
    optimizer.zero_grad()
    return elapsed


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()


def _agree(failure: str | None) -> str | None:
    """Every rank's verdict on a contender: the first rank's error, or None if all ran."""
    verdicts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, failure)
    return next((v for v in verdicts if v is not None), None)


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}"


def _try_build(contender: str, args: argparse.Namespace, device: str) -> tuple[Any, str | None]:
    try:
        return _build(contender, args, device), None
    except Exception as error:  # a peer that cannot run here: recorded, not fatal
        if contender not in PEERS:
            raise
        return None, _error_text(error)


def _memory_round(
    contender: str, args: argparse.Namespace, device: str, accum: int
) -> dict[str, int | None]:
    """Peak tensor bytes of a freshly built contender during its second step, and for DMuon
    the packed-buffer bytes held after each forward of that step (the largest) next to
    their formula (``memory.py`` says what is counted)."""
    held: list[int] = []
    with PeakTensorMemory(cuda=args.cuda) as memory:
        model, optimizer, p_m = _build(contender, args, device)
        _train_step(model, optimizer, args, accum)  # creates the optimizer state
        _sync(args.cuda)

        def after_forward(model: Any = model) -> None:
            count = dedicated_bytes_held(model)
            if count is not None:
                held.append(count)

        with memory.window():
            _train_step(model, optimizer, args, accum, after_forward)
        _sync(args.cuda)
        element_size = next(model.parameters()).element_size()
        del model, optimizer
    return {
        "peak_memory_bytes": memory.peak,
        "dedicated_bytes_after_forward": max(held) if held else None,
        "dedicated_bytes_formula": dedicated_bytes_formula(contender, p_m, element_size),
    }


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
    device = "cuda" if args.cuda else "cpu"
    rows: list[dict[str, Any]] = []
    not_run: dict[str, dict[str, str]] = {}
    # Under HSDP the units count the shard dimension, as the formulas do: collectives over
    # this rank's replicate group (the same shard position in every replica) are left out.
    shard = world // args.hsdp
    replicate_ranks = tuple(range(rank % shard, world, shard)) if args.hsdp > 1 else None
    for accum in args.accum:
        built: dict[str, Any] = {}
        for contender in args.contenders:
            model_and_optimizer, failure = _try_build(contender, args, device)
            failure = _agree(failure)
            if failure is None:
                built[contender] = model_and_optimizer
            else:
                not_run.setdefault(contender, {})[str(accum)] = failure
        times, optim_times, traffic = _timed_rounds(built, args, accum, replicate_ranks, not_run)
        p_m = built["dmuon-z3"][2] if "dmuon-z3" in built else None
        rest_z3 = traffic["dmuon-z3"]["torch"] if "dmuon-z3" in built else None
        ran = list(built)
        built = {}  # the memory rounds count each contender alone
        memory = {c: _memory_round(c, args, device, accum) for c in ran}
        for contender in ran:
            formula = formula_units(contender, accum, world)
            measured = (
                None
                if formula is None
                else _measured_units(contender, traffic[contender], p_m, rest_z3)
            )
            rows.append(
                {
                    "contender": contender,
                    "accum": accum,
                    "median_step_s": statistics.median(times[contender]),
                    "median_optim_step_s": statistics.median(optim_times[contender]),
                    **memory[contender],
                    "elements_per_rank": traffic[contender],
                    "muon_elements": p_m,
                    "muon_units": measured,
                    "formula_units": formula,
                }
            )
        if rank == 0 and args.save_partial:
            # A long run keeps what it measured so far if it is stopped.
            _save(_record(args, rows, not_run))
    if rank == 0:
        out.put((rows, not_run))
    dist.destroy_process_group()


def _timed_rounds(
    built: dict[str, Any],
    args: argparse.Namespace,
    accum: int,
    replicate_ranks: tuple[int, ...] | None,
    not_run: dict[str, dict[str, str]],
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, dict[str, int]]]:
    """A warm-up round, then ``args.steps`` timed ones, the contenders taking turns: each
    one's step and optimizer-step seconds, and the elements each issuer moved in round 1.

    A peer whose warm-up fails on any rank is dropped from ``built`` into ``not_run``.
    """
    times: dict[str, list[float]] = {c: [] for c in built}
    optim_times: dict[str, list[float]] = {c: [] for c in built}
    traffic: dict[str, dict[str, int]] = {}
    for round_index in range(1 + args.steps):
        for contender in list(built):
            model, optimizer, _ = built[contender]
            _sync(args.cuda)
            counted = round_index == 1
            try:
                counter_ = TrafficCounter(replicate_ranks) if counted else nullcontext()
                with counter_ as counter:
                    start = time.perf_counter()
                    optim_elapsed = _train_step(model, optimizer, args, accum)
                    _sync(args.cuda)
                    elapsed = time.perf_counter() - start
                failure = None
            except Exception as error:  # the warm-up step of a peer that cannot run
                if contender not in PEERS or round_index > 0:
                    raise
                failure = _error_text(error)
            if round_index == 0 and contender in PEERS:
                verdict = _agree(failure)
                if verdict is not None:
                    not_run.setdefault(contender, {})[str(accum)] = verdict
                    del built[contender]
                    continue
            if counter is not None:
                traffic[contender] = {
                    issuer: counter.total(issuer) for issuer in ("dmuon", "torch", "peer")
                }
            if round_index >= 1:
                times[contender].append(elapsed)
                optim_times[contender].append(optim_elapsed)
    return times, optim_times, traffic


def _measured_units(
    contender: str, traffic: dict[str, int], p_m: int | None, rest_z3: int | None
) -> float | None:
    """The matrices' traffic per rank in units of P_M (None where there is none to count:
    one rank, or no DMuon Z3 run to subtract FSDP2's traffic for the rest)."""
    if not p_m:
        return None
    if contender.startswith("dmuon"):
        return traffic["dmuon"] / p_m
    if rest_z3 is None:
        return None
    # FSDP2 moves the matrices' elements on top of what it moves for the rest, which is
    # exactly DMuon Z3's torch-issued traffic (same FSDP2 setting).
    return (traffic["torch"] - rest_z3 + traffic["dmuon"] + traffic["peer"]) / p_m


def _ratios(rows: list[dict[str, Any]]) -> None:
    """Step time over AdamW's at the same FSDP2 mode; optimizer step over naive's."""
    for row in rows:
        mode = row["contender"][-2:]
        same = [r for r in rows if r["accum"] == row["accum"]]
        base = next((r for r in same if r["contender"] == f"adamw-{mode}"), None)
        naive = next((r for r in same if r["contender"] == "naive-z3"), None)
        row["vs_adamw_same_mode"] = base and row["median_step_s"] / base["median_step_s"]
        row["optim_vs_naive"] = naive and row["median_optim_step_s"] / naive["median_optim_step_s"]


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _mib(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / 2**20


def format_table(result: dict[str, Any]) -> str:
    """The Markdown table of one run, then the peers that could not run and why."""
    lines = [
        "| contender | accum | step (s) | vs AdamW (same mode) | optimizer step (s) "
        "| vs naive | Muon units | formula | peak (MiB) | dedicated after forward (MiB) "
        "| formula (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['contender']} | {r['accum']} | {r['median_step_s']:.3f} | "
            f"{_fmt(r['vs_adamw_same_mode'], '.2f', 'x')} | {r['median_optim_step_s']:.3f} | "
            f"{_fmt(r['optim_vs_naive'], '.2f', 'x')} | {_fmt(r['muon_units'], '.2f')} | "
            f"{_fmt(r['formula_units'], '.2f')} | "
            f"{_fmt(_mib(r.get('peak_memory_bytes')), '.1f')} | "
            f"{_fmt(_mib(r.get('dedicated_bytes_after_forward')), '.2f')} | "
            f"{_fmt(_mib(r.get('dedicated_bytes_formula')), '.2f')} |"
        )
    for name, peer in result["peers"].items():
        for accum, why in peer["not_run"].items():
            lines.append(f"| {name} | {accum} | not run: {why} |")
    return "\n".join(lines)


def check(result: dict[str, Any]) -> list[str]:
    """What ``--check`` asserts (deterministic only): every counted Muon traffic equals its
    formula, DMuon's packed-buffer bytes after forward equal theirs, AdamW moves nothing
    outside FSDP2, and every peer either ran or says why."""
    problems = []
    for r in result["rows"]:
        where = f"{r['contender']} at accumulation {r['accum']}"
        formula_bytes = r.get("dedicated_bytes_formula")
        if formula_bytes is not None and r.get("dedicated_bytes_after_forward") != formula_bytes:
            problems.append(
                f"{where}: {r.get('dedicated_bytes_after_forward')} bytes of packed buffers "
                f"after forward, formula {formula_bytes}"
            )
        if r["formula_units"] is not None:
            if r["muon_units"] is None:
                problems.append(f"{where}: traffic not counted")
            elif abs(r["muon_units"] - r["formula_units"]) > 1e-6 * r["formula_units"]:
                problems.append(
                    f"{where}: counted {r['muon_units']:.6f} units, formula {r['formula_units']}"
                )
        if r["contender"].startswith("adamw"):
            counted = r["elements_per_rank"]
            if counted["dmuon"] or counted["peer"] or not counted["torch"]:
                problems.append(f"{where}: traffic outside FSDP2 {counted}")
    ran = {(r["contender"], r["accum"]) for r in result["rows"]}
    for name, peer in result["peers"].items():
        for accum in result["accum"]:
            if (name, accum) not in ran and not peer["not_run"].get(str(accum)):
                problems.append(f"{name} at accumulation {accum}: neither ran nor says why")
    return problems


def _installed(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _record(
    args: argparse.Namespace, rows: list[dict[str, Any]], not_run: dict[str, dict[str, str]]
) -> dict[str, Any]:
    rows = sorted(rows, key=lambda r: (r["accum"], args.contenders.index(r["contender"])))
    _ratios(rows)
    peers = {
        name: {
            "distribution": distribution,
            "pinned": pinned,
            "installed": _installed(distribution),
            "not_run": not_run.get(name, {}),
        }
        for name, (distribution, pinned) in PEERS.items()
        if name in args.contenders
    }
    return {
        "name": args.name,
        "model": args.model,
        "nproc": args.nproc,
        "hsdp": args.hsdp,
        "device": "cuda" if args.cuda else "cpu",
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "accum": sorted({r["accum"] for r in rows}),
        "contenders": list(args.contenders),
        "machine": machine_info(),
        "peers": peers,
        "rows": rows,
    }


def _save(result: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{result['name']}.json").write_text(json.dumps(result, indent=2) + "\n")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Spawn ``args.nproc`` ranks, run every contender, return the result record."""
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.spawn(_worker, args=(args.nproc, _free_port(), args, queue), nprocs=args.nproc)
    rows, not_run = queue.get()
    return _record(args, rows, not_run)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; ``--quick`` picks the CI configuration."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, traffic only (CI)")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if traffic or memory != formulas"
    )
    parser.add_argument("--nproc", type=positive_int, default=2)
    parser.add_argument(
        "--hsdp",
        type=positive_int,
        default=1,
        help="replicas of an HSDP (replicate, shard) mesh; 1: a 1-D mesh of every rank",
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--accum", type=positive_int, nargs="+", default=None)
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--seq-len", type=positive_int, default=None)
    parser.add_argument("--micro-batch", type=positive_int, default=4)
    parser.add_argument(
        "--steps", type=positive_int, default=None, help="timed steps per contender"
    )
    parser.add_argument("--cuda", action="store_true", help="NCCL on GPUs instead of gloo")
    parser.add_argument("--name", default=None, help="results/<name>.json")
    parser.add_argument(
        "--save-partial", action="store_true", help="rewrite the JSON after each accumulation"
    )
    args = parser.parse_args(argv)
    quick = args.quick
    args.model = args.model or ("tiny" if quick else "small")
    args.accum = args.accum or ([1, 2] if quick else [1, 4, 8])
    args.seq_len = args.seq_len or (32 if quick else 128)
    args.steps = args.steps or (1 if quick else 5)
    hsdp = f"-hsdp{args.hsdp}" if args.hsdp > 1 else ""
    args.name = args.name or ("quick" if quick else f"{args.model}-n{args.nproc}{hsdp}")
    if args.nproc % args.hsdp:
        parser.error(f"--hsdp {args.hsdp} must divide --nproc {args.nproc}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run, print the table, write ``results/<name>.json``; with ``--check``, assert."""
    args = parse_args(argv)
    result = run(args)
    print(format_table(result))
    _save(result)
    if args.check:
        problems = check(result)
        for problem in problems:
            print(f"FAIL {problem}", file=sys.stderr)
        if problems:
            raise SystemExit(1)
        print(f"check: {len(result['rows'])} rows match their traffic and memory formulas")
    return result


if __name__ == "__main__":
    main()
