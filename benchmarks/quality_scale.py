"""Quality at scale: steps DMuon (Muon and NorMuon) needs to reach AdamW's best validation loss.

Every optimizer trains the recipe's model (``python -m dmuon.train``) on the default corpus
at three learning rates (half the recipe's default, the default, double) and several seeds;
one seed fixes the initialization and the batch order, so the runs of one seed see the same
batches and are evaluated on the same validation windows. Runs go to separate single-threaded
processes, ``--jobs`` at a time.

For each optimizer the best rate is the one with the lowest final validation loss averaged
over the seeds. AdamW at its best rate is the baseline: for every seed, the target is that
seed's AdamW final validation loss and the ratio is the step at which DMuon's best-rate run
of the same seed first reaches it (linear interpolation between evaluations) over the run's
steps. Reported: the ratio per seed, its mean and spread, and every curve.

    python benchmarks/quality_scale.py                         # small, 1,000 steps, 2 seeds
    python benchmarks/quality_scale.py --model tiny --steps 120 --seeds 0 --jobs 2   # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cli_types import positive_int
from quality import _curve, steps_to_reach

RESULTS = Path(__file__).parent / "results"
OPTIMIZERS = ("adamw", "muon", "normuon")


def default_rates() -> dict[str, tuple[float, list[float]]]:
    """optimizer -> (the recipe's default rate, the sweep: half of it, it, double).

    Muon and NorMuon sweep ``--lr``; their AdamW group stays at the recipe's AdamW default.
    """
    from dmuon.train.cli import TrainConfig

    muon, adamw = TrainConfig().lr, TrainConfig(optimizer="adamw").adamw_rate
    return {
        o: (rate, [rate / 2, rate, rate * 2])
        for o, rate in (("adamw", adamw), ("muon", muon), ("normuon", muon))
    }


def rate_list(text: str) -> tuple[str, list[float]]:
    """``OPTIMIZER=R1,R2,R3`` (``--rates``): the rates one optimizer is swept over."""
    name, _, values = text.partition("=")
    if name not in OPTIMIZERS or not values:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write OPTIMIZER=R1,R2,R3 with OPTIMIZER one of {', '.join(OPTIMIZERS)}"
        )
    try:
        rates = [float(v) for v in values.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the rates must be numbers") from None
    if any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"{text!r}: every rate must be above 0")
    return name, rates


def plan(
    seeds: list[int],
    rates: dict[str, list[float]] | None = None,
    dmuon_adamw_lr: float | None = None,
    optimizers: tuple[str, ...] = OPTIMIZERS,
) -> list[dict[str, Any]]:
    """Every (optimizer, rate, seed) run, with the recipe flags that select it.

    ``rates`` replaces the default sweep (`default_rates`) of the optimizers it names.
    Under Muon and NorMuon the swept rate is ``--lr``, the dedicated matrices'; their AdamW
    group (embedding, norms, head) runs at ``dmuon_adamw_lr`` when given, else at the
    recipe's AdamW default. Each run records its ``adamw_lr``.
    """
    from dmuon.train.cli import TrainConfig

    defaults = default_rates()
    group_default = TrainConfig().adamw_rate
    runs = []
    for optimizer in optimizers:
        flag = "--adamw-lr" if optimizer == "adamw" else "--lr"
        values = (rates or {}).get(optimizer, defaults[optimizer][1])
        recipe = (
            ["--optimizer", "adamw"]
            if optimizer == "adamw"
            else ["--optimizer", "dmuon", "--muon-variant", optimizer]
        )
        for rate in values:
            if optimizer == "adamw":
                group, extra = rate, []
            elif dmuon_adamw_lr is None:
                group, extra = group_default, []
            else:
                group, extra = dmuon_adamw_lr, ["--adamw-lr", str(dmuon_adamw_lr)]
            for seed in seeds:
                runs.append(
                    {
                        "optimizer": optimizer,
                        "lr": rate,
                        "adamw_lr": group,
                        "seed": seed,
                        "flags": [*recipe, flag, str(rate), *extra, "--seed", str(seed)],
                    }
                )
    return runs


def _train(run: dict[str, Any], args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    metrics = tmp / f"{run['optimizer']}-{run['lr']}-{run['adamw_lr']}-{run['seed']}.jsonl"
    command = [
        sys.executable, "-m", "dmuon.train", "--model", args.model,
        "--steps", str(args.steps), "--seq-len", str(args.seq_len),
        "--micro-batch-size", str(args.micro_batch_size),
        "--eval-every", str(args.eval_every), "--eval-sequences", str(args.eval_sequences),
        "--threads", "1", "--device", "cpu", "--progress", "plain",
        "--log-every", str(args.steps), "--metrics-file", str(metrics), *run["flags"],
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr}")
    curve = _curve(metrics)
    if not curve or curve[-1][0] != args.steps:
        raise RuntimeError(f"{metrics.name}: no validation loss at step {args.steps}")
    print(f"{run['optimizer']:>8} lr {run['lr']:<8g} seed {run['seed']}: "
          f"final val loss {curve[-1][1]:.4f}", flush=True)  # fmt: skip
    return {k: run[k] for k in ("optimizer", "lr", "adamw_lr", "seed")} | {
        "final_val_loss": curve[-1][1],
        "curve": curve,
    }


def _key(run: dict[str, Any]) -> tuple[str, float, float, int]:
    return (run["optimizer"], run["lr"], run["adamw_lr"], run["seed"])


def reused(
    path: Path, settings: dict[str, Any]
) -> dict[tuple[str, float, float, int], dict[str, Any]]:
    """The runs of an earlier record, by (optimizer, rate, AdamW rate, seed); an error if it
    was made with other settings (its curves would not compare)."""
    record = json.loads(path.read_text())
    other = {k: record.get(k) for k in settings if record.get(k) != settings[k]}
    if other:
        raise SystemExit(f"{path} was made with {other}, not {settings}: rerun instead")
    return {_key(r): r for r in record["runs"]}


def summarize(runs: list[dict[str, Any]], steps: int, seeds: list[int]) -> dict[str, Any]:
    """Best rate per optimizer (mean over seeds) and the per-seed steps ratios to AdamW."""
    optimizers = [o for o in OPTIMIZERS if any(r["optimizer"] == o for r in runs)]
    mean: dict[str, dict[float, float]] = {}
    for o in optimizers:
        rates = sorted({r["lr"] for r in runs if r["optimizer"] == o})
        mean[o] = {
            lr: statistics.fmean(
                r["final_val_loss"] for r in runs if r["optimizer"] == o and r["lr"] == lr
            )
            for lr in rates
        }
    best_lr = {o: min(mean[o], key=mean[o].__getitem__) for o in optimizers}

    def best_run(o: str, seed: int) -> dict[str, Any]:
        return next(
            r for r in runs if r["optimizer"] == o and r["lr"] == best_lr[o] and r["seed"] == seed
        )

    ratios: dict[str, dict[str, float | None]] = {}
    for o in optimizers:
        if o == "adamw":
            continue
        ratios[o] = {}
        for seed in seeds:
            target = best_run("adamw", seed)["final_val_loss"]
            reached = steps_to_reach(best_run(o, seed)["curve"], target)
            ratios[o][str(seed)] = None if reached is None else reached / steps
    spread = {}
    for o, per_seed in ratios.items():
        values = [v for v in per_seed.values() if v is not None]
        spread[o] = (
            {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
            if len(values) == len(per_seed)
            else None
        )
    return {
        "mean_final_val_loss": {o: {str(lr): v for lr, v in m.items()} for o, m in mean.items()},
        "best_lr": best_lr,
        "best_at_sweep_edge": {o: best_lr[o] in (min(mean[o]), max(mean[o])) for o in optimizers},
        "best_mean_final_val_loss": {o: mean[o][best_lr[o]] for o in optimizers},
        "steps_ratio_to_adamw_best": ratios,
        "steps_ratio_spread": spread,
    }


def main() -> None:
    """Parse the flags, train every run, print the summary, write the JSON record."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=positive_int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--seq-len", type=positive_int, default=128)
    parser.add_argument("--micro-batch-size", type=positive_int, default=4)
    parser.add_argument("--eval-every", type=positive_int, default=50)
    parser.add_argument("--eval-sequences", type=positive_int, default=64)
    parser.add_argument("--jobs", type=positive_int, default=2)
    parser.add_argument(
        "--optimizers",
        nargs="+",
        choices=OPTIMIZERS,
        default=list(OPTIMIZERS),
        help="the optimizers to run (adamw, the baseline, always among them)",
    )
    parser.add_argument(
        "--rates",
        type=rate_list,
        action="append",
        default=[],
        metavar="OPTIMIZER=R1,R2,R3",
        help="sweep these rates instead (e.g. adamw=0.000375,0.00075,0.0015); repeatable",
    )
    parser.add_argument(
        "--dmuon-adamw-lr",
        type=float,
        default=None,
        help="AdamW rate of DMuon's embedding, norms and head (default: the recipe's)",
    )
    parser.add_argument(
        "--reuse",
        type=Path,
        default=None,
        help="a record of this script with the same settings: its runs are taken, not rerun",
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "quality_small.json")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).parent))
    from machine import machine_info

    settings = {
        "model": args.model,
        "steps": args.steps,
        "tokens_per_step": args.seq_len * args.micro_batch_size,
        "eval_every": args.eval_every,
        "eval_sequences": args.eval_sequences,
    }
    done = reused(args.reuse, settings) if args.reuse is not None else {}
    if "adamw" not in args.optimizers:
        parser.error("--optimizers must include adamw, the baseline of the steps ratio")
    runs_planned = plan(args.seeds, dict(args.rates), args.dmuon_adamw_lr, tuple(args.optimizers))
    todo = [r for r in runs_planned if _key(r) not in done]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        ran = {_key(r): r for r in pool.map(lambda run: _train(run, args, Path(tmp)), todo)}
    runs = [done.get(_key(r)) or ran[_key(r)] for r in runs_planned]
    record = {
        "model": args.model,
        "steps": args.steps,
        "seeds": args.seeds,
        "tokens_per_step": args.seq_len * args.micro_batch_size,
        "eval_every": args.eval_every,
        "eval_sequences": args.eval_sequences,
        "defaults": {o: rate for o, (rate, _) in default_rates().items()},
        "dmuon_adamw_lr": args.dmuon_adamw_lr,
        "machine": machine_info(),
        **summarize(runs, args.steps, args.seeds),
        "runs": runs,
    }
    print(f"best rates: {record['best_lr']}")
    print(f"best mean final val loss: {record['best_mean_final_val_loss']}")
    print(f"steps to AdamW's best, per seed: {record['steps_ratio_to_adamw_best']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
