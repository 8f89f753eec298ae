"""Half-precision communication: the same run with float32 and with bfloat16 collectives.

The recipe's model trains on 2 gloo ranks for ``--steps`` steps three times from the same
seed (the same initialization, batches and validation windows): with DMuon's default
communication (gradients reduced in float32, matrices broadcast in the compute dtype),
with ``--reduce-dtype bfloat16`` alone, and with ``--reduce-dtype bfloat16
--broadcast-dtype bfloat16``. Masters, momentum and the accumulation buffer are float32 in
all three. Reported per contender:

* the training loss of every step and the validation loss every ``--eval-every`` steps;
* the largest relative difference of the training loss from the float32 run's at any
  step, that of the mean of the last 10 steps, and the final validation loss's;
* the bytes of each kind of DMuon collective in one steady-state step (step 2, from
  `dmuon.comm_audit`), next to the float32 run's.

    python benchmarks/comm_dtype.py          # small, 3 runs of 50 steps on 2 ranks

Writes ``results/comm_dtype.json`` and the figure ``results/comm_dtype.png`` (with its
Chinese twin ``comm_dtype.zh.png``; drawn by ``benchmarks/plots.py``, which needs
matplotlib, part of the ``bench`` extra).
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

import torch.distributed as dist
import torch.multiprocessing as mp
from cli_types import positive_int

sys.path.insert(0, str(Path(__file__).parent))

RESULTS = Path(__file__).parent / "results"

#: contender -> (--reduce-dtype, --broadcast-dtype).
CONTENDERS: dict[str, tuple[str, str]] = {
    "float32": ("float32", "auto"),
    "bf16-reduce": ("bfloat16", "auto"),
    "bf16-reduce-broadcast": ("bfloat16", "bfloat16"),
}
BASELINE = "float32"


def _flags(args: argparse.Namespace, reduce: str, broadcast: str) -> list[str]:
    return [
        "--model", args.model, "--steps", str(args.steps), "--optimizer", "dmuon",
        "--mode", args.mode, "--seq-len", str(args.seq_len),
        "--micro-batch-size", str(args.micro_batch_size),
        "--eval-sequences", str(args.eval_sequences), "--warmup-steps", "5",
        "--device", "cpu", "--seed", "0", "--threads", str(args.threads),
        "--reduce-dtype", reduce, "--broadcast-dtype", broadcast,
        "--progress", "plain", "--log-every", "100000",
    ]  # fmt: skip


def _one_run(args: argparse.Namespace, reduce: str, broadcast: str) -> dict[str, Any]:
    """Train one contender in the running process group; every rank returns the record."""
    import dmuon
    from dmuon.train.cli import parse_args
    from dmuon.train.loop import Trainer

    trainer = Trainer(parse_args(_flags(args, reduce, broadcast)))
    try:
        train_loss: list[float] = []
        val_loss = [(0, trainer.evaluate())]
        collectives: dict[str, Any] = {}
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            train_loss.append(float(trainer.train_step(step)["loss"]))
            if step == 2:
                collectives = dmuon.comm_audit(trainer.model).last_step().as_dict()
            if step % args.eval_every == 0 or step == args.steps:
                val_loss.append((step, trainer.evaluate()))
        seconds = time.perf_counter() - start
    finally:
        trainer.close()
    return {
        "reduce_dtype": reduce,
        "broadcast_dtype": broadcast,
        "train_loss": train_loss,
        "val_loss": val_loss,
        "step2": collectives,
        "seconds": seconds,
    }


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    # One process group for every run, so the recipe joins it instead of creating its own.
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        runs = {name: _one_run(args, *dtypes) for name, dtypes in CONTENDERS.items()}
    finally:
        dist.destroy_process_group()
    if rank == 0:
        out.put(runs)


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each contender against the float32 run: loss differences and bytes per kind."""
    base = runs[BASELINE]
    base_bytes = {k: v["bytes"] for k, v in base["step2"]["collectives"].items()}
    out = {}
    for name, run in runs.items():
        pairs = zip(run["train_loss"], base["train_loss"], strict=True)
        diffs = [_relative(a, b) for a, b in pairs]
        final_val, base_val = run["val_loss"][-1][1], base["val_loss"][-1][1]
        kinds = run["step2"]["collectives"]
        out[name] = {
            "max_train_loss_rel_diff": max(diffs),
            "last10_train_loss_rel_diff": _relative(
                statistics.fmean(run["train_loss"][-10:]),
                statistics.fmean(base["train_loss"][-10:]),
            ),
            "final_val_loss": final_val,
            "final_val_loss_rel_diff": _relative(final_val, base_val),
            "bytes": {k: v["bytes"] for k, v in kinds.items()},
            "bytes_vs_float32": {k: v["bytes"] / base_bytes[k] for k, v in kinds.items()},
            "units": run["step2"]["units"],
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse flags, run the contenders, print the summary, write the JSON and the figures."""
    import plots
    from bench import _free_port
    from machine import machine_info

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--mode", choices=("z2", "z3"), default="z2")
    parser.add_argument("--steps", type=positive_int, default=50)
    parser.add_argument("--seq-len", type=positive_int, default=128)
    parser.add_argument("--micro-batch-size", type=positive_int, default=4)
    parser.add_argument("--eval-every", type=positive_int, default=10)
    parser.add_argument("--eval-sequences", type=positive_int, default=16)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--json", type=Path, default=RESULTS / "comm_dtype.json")
    parser.add_argument("--png", type=Path, default=RESULTS / "comm_dtype.png")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(2, _free_port(), args, queue), nprocs=2)
    runs = queue.get()
    result = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "png")},
        "nproc": 2,
        "machine": machine_info(),
        "runs": runs,
        "summary": summarize(runs),
        "seconds": time.perf_counter() - start,
    }
    for name, s in result["summary"].items():
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in s["bytes_vs_float32"].items())
        print(
            f"{name:>22}: final val loss {s['final_val_loss']:.4f} "
            f"({s['final_val_loss_rel_diff'] * 100:.3f} % from float32), train loss at most "
            f"{s['max_train_loss_rel_diff'] * 100:.3f} % off; bytes {ratios}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    for lang, path in plots.language_paths(args.png).items():
        plots.comm_dtype(result, path, lang)
    print(f"wrote {args.json} and {args.png} ({result['seconds']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
